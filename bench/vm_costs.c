/* What a few primitives cost here and in the testbed VM, to read the
 * VQP data-path figures of docs/performance.md against (emulation slows
 * some instructions far more than others):
 *
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/vm_costs.c -lpthread \
 *      -o target/bench/bin/vm_costs
 *   target/bench/bin/vm_costs                                  # host
 *   scripts/vm-run.sh target/bench target/bench/bin/vm_costs   # VM
 *
 * Prints one line per primitive: nanoseconds per operation, the median of
 * 5 timed loops of N operations each (CLOCK_MONOTONIC around the loop).
 * The last three are the floors of a new process's first operation
 * through a host agent (docs/node.md): a round trip between two processes
 * over a unix socket (each side blocked in read: two wake-ups), a fresh
 * unix-socket connect + accept + one round trip (what attaching needs at
 * least), and fork + exec + wait of /bin/true (a process's own start). */
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { N = 1000000, TRIALS = 5 };

static volatile uint64_t sink;
static uint64_t counter;
static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;

static double now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void plain(int n)
{
	for (int i = 0; i < n; i++)
		sink = sink * 31 + (uint64_t)i;
}

static void atomic_add(int n)
{
	for (int i = 0; i < n; i++)
		__atomic_fetch_add(&counter, 1, __ATOMIC_SEQ_CST);
}

static void cmpxchg(int n)
{
	for (int i = 0; i < n; i++) {
		uint64_t e = __atomic_load_n(&counter, __ATOMIC_RELAXED);

		__atomic_compare_exchange_n(&counter, &e, e + 1, 0,
					    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
	}
}

static void mutex_pair(int n)
{
	for (int i = 0; i < n; i++) {
		pthread_mutex_lock(&mutex);
		pthread_mutex_unlock(&mutex);
	}
}

static void clock_coarse(int n)
{
	struct timespec t;

	for (int i = 0; i < n; i++) {
		clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
		sink += (uint64_t)t.tv_nsec;
	}
}

static void clock_mono(int n)
{
	struct timespec t;

	for (int i = 0; i < n; i++) {
		clock_gettime(CLOCK_MONOTONIC, &t);
		sink += (uint64_t)t.tv_nsec;
	}
}

/* A child echoing one byte per round trip on `fd` until end-of-file
 * (`other`, the parent's end, closed in the child). */
static pid_t echoer(int fd, int other)
{
	pid_t pid = fork();
	char b;

	if (pid == 0) {
		close(other);
		while (read(fd, &b, 1) == 1 && write(fd, &b, 1) == 1)
			;
		_exit(0);
	}
	return pid;
}

static int pp_fd = -1;

static void unix_round_trip(int n)
{
	char b = 1;

	for (int i = 0; i < n; i++)
		if (write(pp_fd, &b, 1) != 1 || read(pp_fd, &b, 1) != 1)
			abort();
}

static struct sockaddr_un agent_addr;
static int agent_listen = -1;

/* What attaching to an agent needs at least: connect, the agent's accept,
 * one message there and back; the agent here is a child accepting and
 * echoing in a loop. */
static void unix_connect_round_trip(int n)
{
	char b = 1;

	for (int i = 0; i < n; i++) {
		int fd = socket(AF_UNIX, SOCK_STREAM, 0);

		if (fd < 0 || connect(fd, (struct sockaddr *)&agent_addr, sizeof(agent_addr)) ||
		    write(fd, &b, 1) != 1 || read(fd, &b, 1) != 1)
			abort();
		close(fd);
	}
}

static void spawn_true(int n)
{
	for (int i = 0; i < n; i++) {
		pid_t pid = fork();
		int st;

		if (pid == 0) {
			execl("/bin/true", "true", (char *)NULL);
			_exit(127);
		}
		if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st))
			abort();
	}
}

static void process_primitives(void (*run)(const char *, void (*)(int), int))
{
	int sv[2];
	pid_t echo, agent;

	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
		abort();
	echo = echoer(sv[1], sv[0]);
	close(sv[1]);
	pp_fd = sv[0];
	run("unix socket round trip (2 procs)", unix_round_trip, N / 100);
	close(pp_fd);
	waitpid(echo, NULL, 0);

	agent_addr.sun_family = AF_UNIX;
	snprintf(agent_addr.sun_path, sizeof(agent_addr.sun_path), "/tmp/vm_costs.%d", (int)getpid());
	unlink(agent_addr.sun_path);
	agent_listen = socket(AF_UNIX, SOCK_STREAM, 0);
	if (agent_listen < 0 || bind(agent_listen, (struct sockaddr *)&agent_addr, sizeof(agent_addr)) ||
	    listen(agent_listen, 64))
		abort();
	agent = fork();
	if (agent == 0) {
		for (;;) {
			int fd = accept(agent_listen, NULL, NULL);
			char b;

			if (fd < 0)
				_exit(0);
			if (read(fd, &b, 1) == 1 && write(fd, &b, 1) == 1)
				close(fd);
		}
	}
	run("unix connect + accept + round trip", unix_connect_round_trip, N / 1000);
	kill(agent, SIGKILL);
	waitpid(agent, NULL, 0);
	close(agent_listen);
	unlink(agent_addr.sun_path);
	run("fork + exec /bin/true + wait", spawn_true, N / 10000);
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static void run(const char *name, void (*f)(int), int n)
{
	double v[TRIALS];

	f(n / 10);	/* warm up */
	for (int t = 0; t < TRIALS; t++) {
		double t0 = now_ns();

		f(n);
		v[t] = (now_ns() - t0) / n;
	}
	qsort(v, TRIALS, sizeof(v[0]), cmp);
	printf("%-34s %8.1f ns\n", name, v[TRIALS / 2]);
}

int main(void)
{
	run("plain loop iteration", plain, N);
	run("locked add", atomic_add, N);
	run("compare-and-swap", cmpxchg, N);
	run("pthread mutex lock + unlock", mutex_pair, N);
	run("clock_gettime(MONOTONIC_COARSE)", clock_coarse, N / 10);
	run("clock_gettime(MONOTONIC)", clock_mono, N / 10);
	process_primitives(run);
	return 0;
}
