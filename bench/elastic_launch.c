/*
 * elastic_launch: starts new kv_client processes and times them, for
 * bench/elastic-compare.sh (issue 21: the paper's elastic bootstrap and
 * serverless fetch).
 *
 *   elastic_launch burst  -n N [-g GIDS] [-t SECONDS] -- PROG ARGS...
 *   elastic_launch serial -n ROUNDS [-g GIDS] [-t SECONDS] -- PROG ARGS...
 *
 * Each child gets a GID index from GIDS (a comma-separated list, used in
 * turn; default "2"): "%g" in ARGS becomes that index, and the child's
 * environment has KRCORE_GID_INDEX set to it (the krcore build reads it;
 * the raw build takes -g %g). On Soft-RoCE each GID is an emulated node.
 * Every instant is CLOCK_MONOTONIC in microseconds, which all processes of
 * the machine share, so the children's own timestamps ("kv_first ..." and
 * "kv_times ..." lines of kv_client -T) compare with the launcher's.
 *
 * burst: forks N copies of itself, each of which waits at a gate (a pipe)
 * before it execs PROG; when all N are forked the gate opens (the pipe's
 * write end is closed) and all N exec at that one instant, the start of
 * every child. (Spawning them one after the other spreads the starts over
 * seconds in the VM: the launcher competes for the two CPUs with the
 * children it already started.) Each child's stdout is a pipe read here;
 * fd 3 of every child is the read end of one "go" pipe: the children run
 * with -W 3 and, after their first GET, wait for its end-of-file. When
 * every child has printed its "kv_first first_get_us=T" line (or exited
 * without), the launcher closes the pipe: all of them start their
 * remaining GETs at once, and the GET throughput is measured with all N
 * clients up. Output:
 *
 *   child I gid=G first_ms=.. main_ms=.. setup_ms=.. path_ms=..
 *     connected_ms=.. cpu_ms=.. gets=.. get_ms=..
 *   burst n=N served=S first_med_ms=.. first_max_ms=.. all_served_ms=..
 *     fork_span_ms=.. main_med_ms=.. setup_med_ms=.. path_med_ms=..
 *     connected_med_ms=.. cpu_med_ms=.. cpu_sum_ms=.. cpu_main_med_ms=..
 *     cpu_setup_med_ms=.. cpu_path_med_ms=.. cpu_connected_med_ms=..
 *     gets=.. get_window_ms=.. get_ops_s=..
 *
 * first_ms: the start (the gate's opening) to the child's first GET
 * completed and checked;
 * main, setup, path, connected: the child's start to its main(), to its
 * device, PD, CQ and MR, to its QP's path (raw: the server's answer over
 * TCP; krcore: qconnect returned), to its QP ready with the table's
 * address (kv_client -T); cpu: the CPU time the child (all its threads)
 * had used at its first GET (its "cpu_us"), the median and the sum over
 * the N (what the burst asked of the machine's CPUs); cpu_main ..
 * cpu_connected: the median CPU time used at main, setup, path and
 * connected (kv_client's "*_cpu_us");
 * all_served_ms: the start to the last child's first GET; fork_span_ms:
 * how long forking the N took (before the start, not in any figure);
 * get_ops_s: the GETs after the go, all children together, divided by the
 * go to the last child's last GET.
 *
 * serial: ROUNDS children one after the other (each must exit 0 before the
 * next starts; the program is run with -O, the serverless fetch): per
 * round, the child's start to its object READ and verified
 * ("object_us="), and the CPU time it used in all (user + system, all
 * its threads, at its exit). Output: "round I exec_to_data_ms=..
 * main_ms=.. setup_ms=.. path_ms=.. connected_ms=.. cpu_ms=.." and
 * "serial rounds=R exec_to_data_med_ms=.. min_ms=.. max_ms=..
 * main_med_ms=.. setup_med_ms=.. path_med_ms=.. connected_med_ms=..
 * cpu_med_ms=..".
 *
 * Bounded: everything must be done within SECONDS (-t, default 300; in
 * serial mode per round), else the children still running are killed
 * (SIGKILL) and the launcher exits 1, as it does when any child fails
 * (its error is on stderr, which children share with the launcher).
 *
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/elastic_launch.c \
 *      -o target/bench/bin/elastic_launch
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAX_CHILDREN 1024
#define MAX_GIDS 64
#define OUT_CAP 8192

struct child {
	pid_t pid;
	int fd;			/* its stdout; -1 at end-of-file */
	int gid;
	int exited, status;
	double start_us;	/* its start: serial, the instant before its
				 * posix_spawn; burst, the gate's opening */
	double fork_us;		/* burst: the instant before its fork */
	double first_us;	/* kv_first: its first GET done (0: not yet) */
	double cpu_us;		/* kv_first: its CPU time by then (-1: none) */
	double exit_cpu_us;	/* its CPU time in all, at its exit */
	char out[OUT_CAP];
	size_t used;
};

static struct child kids[MAX_CHILDREN];
static int nkids;

static void die(const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	fprintf(stderr, "elastic_launch: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	for (int i = 0; i < nkids; i++)
		if (kids[i].pid > 0 && !kids[i].exited)
			kill(kids[i].pid, SIGKILL);
	exit(1);
}

static double now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static double median(double *v, int n)
{
	if (n == 0)
		return 0;
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The value of "key=" in s (the last occurrence), or -1. */
static double field(const char *s, const char *key)
{
	const char *p = NULL, *q = s;
	size_t k = strlen(key);
	double v;

	while ((q = strstr(q, key))) {
		if (q == s || q[-1] == ' ' || q[-1] == '\n')
			p = q;
		q += k;
	}
	if (!p || p[k] != '=' || sscanf(p + k + 1, "%lf", &v) != 1)
		return -1;
	return v;
}

/* The child's "kv_times ..." line, or NULL. */
static const char *times_line(const struct child *c)
{
	return strstr(c->out, "kv_times ");
}

static int gids[MAX_GIDS] = { 2 }, ngids = 1;

static void parse_gids(const char *s)
{
	char *copy = strdup(s), *tok, *save = NULL;

	ngids = 0;
	if (!copy)
		die("strdup");
	for (tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		char *end;
		long v = strtol(tok, &end, 10);

		if (*end || end == tok || v < 0 || v > 65535 || ngids == MAX_GIDS)
			die("-g %s: a comma-separated list of GID indexes (at most %d)",
			    s, MAX_GIDS);
		gids[ngids++] = (int)v;
	}
	free(copy);
	if (!ngids)
		die("-g %s: no GID index", s);
}

/*
 * Starts child i: PROG ARGS with %g replaced by gid, KRCORE_GID_INDEX set,
 * stdout into a pipe, and (go >= 0) fd 3 the go pipe's read end.
 * gate_w < 0: posix_spawn now (serial mode); c->start_us is the instant
 * before it. gate_w >= 0 (burst): fork a copy of this launcher that waits
 * until the gate pipe (gate_r, gate_w) reaches end-of-file and then execs;
 * the caller opens the gate for all children at once and sets start_us.
 */
static void spawn(int i, int gid, char **args, int go, int gate_r, int gate_w)
{
	struct child *c = &kids[i];
	char gidstr[16], envgid[48], *argv[256], **envp;
	size_t ne = 0;
	int p[2], rc, n;

	c->gid = gid;
	snprintf(gidstr, sizeof(gidstr), "%d", c->gid);
	snprintf(envgid, sizeof(envgid), "KRCORE_GID_INDEX=%d", c->gid);
	for (n = 0; args[n]; n++) {
		if (n == 255)
			die("too many arguments");
		if (!strcmp(args[n], "%g"))
			argv[n] = gidstr;
		else
			argv[n] = args[n];
	}
	argv[n] = NULL;
	for (char **e = environ; *e; e++)
		ne++;
	envp = calloc(ne + 2, sizeof(*envp));
	if (!envp)
		die("calloc");
	ne = 0;
	for (char **e = environ; *e; e++)
		if (strncmp(*e, "KRCORE_GID_INDEX=", 17))
			envp[ne++] = *e;
	envp[ne++] = envgid;

	if (pipe2(p, O_CLOEXEC))
		die("pipe2: %s", strerror(errno));
	if (gate_w < 0) {
		posix_spawn_file_actions_t fa;

		if ((rc = posix_spawn_file_actions_init(&fa)) ||
		    (rc = posix_spawn_file_actions_adddup2(&fa, p[1], 1)) ||
		    (go >= 0 && (rc = posix_spawn_file_actions_adddup2(&fa, go, 3))))
			die("posix_spawn_file_actions: %s", strerror(rc));
		c->start_us = now_us();
		if ((rc = posix_spawn(&c->pid, argv[0], &fa, NULL, argv, envp)))
			die("posix_spawn(%s): %s", argv[0], strerror(rc));
		posix_spawn_file_actions_destroy(&fa);
	} else {
		c->fork_us = now_us();
		c->pid = fork();
		if (c->pid < 0)
			die("fork: %s", strerror(errno));
		if (c->pid == 0) {
			char b;
			ssize_t k;

			/* Our copy of the gate's write end would keep it
			 * open for ever: close it, then wait for the EOF. */
			close(gate_w);
			while ((k = read(gate_r, &b, 1)) < 0 && errno == EINTR)
				;
			if (dup2(p[1], 1) < 0 ||
			    (go >= 0 && go != 3 && dup2(go, 3) < 0) ||
			    (go == 3 && fcntl(3, F_SETFD, 0) < 0)) {
				perror("elastic_launch: child: dup2");
				_exit(127);
			}
			execve(argv[0], argv, envp);
			fprintf(stderr, "elastic_launch: exec %s: %s\n", argv[0],
				strerror(errno));
			_exit(127);
		}
	}
	free(envp);
	close(p[1]);
	c->fd = p[0];
	nkids = i + 1;
}

/* Reads what child c wrote; closes its pipe at end-of-file. */
static void drain(struct child *c)
{
	ssize_t n = read(c->fd, c->out + c->used, OUT_CAP - 1 - c->used);

	if (n < 0 && (errno == EINTR || errno == EAGAIN))
		return;
	if (n < 0)
		die("reading child %d's output: %s", (int)(c - kids), strerror(errno));
	if (n == 0 || c->used + (size_t)n == OUT_CAP - 1) {
		if (n > 0)
			c->used += (size_t)n;
		c->out[c->used] = 0;
		close(c->fd);
		c->fd = -1;
		return;
	}
	c->used += (size_t)n;
	c->out[c->used] = 0;
	if (!c->first_us) {
		double f = field(c->out, "first_get_us");

		if (f > 0 && strstr(c->out, "kv_first ")) {
			c->first_us = f;
			c->cpu_us = field(c->out, "cpu_us");
		}
	}
}

/* Polls the children's pipes until all reached end-of-file (or the
 * deadline: die). release() is called after each round of reads. */
static void pump(double deadline, void (*release)(void))
{
	struct pollfd pfd[MAX_CHILDREN];
	int map[MAX_CHILDREN];

	for (;;) {
		int n = 0, rc;

		for (int i = 0; i < nkids; i++)
			if (kids[i].fd >= 0) {
				map[n] = i;
				pfd[n++] = (struct pollfd){ .fd = kids[i].fd, .events = POLLIN };
			}
		if (release)
			release();
		if (n == 0)
			return;
		if (now_us() > deadline) {
			for (int i = 0; i < n; i++)
				fprintf(stderr, "elastic_launch: child %d (pid %d, GID index "
					"%d) did not finish in time; its output so far: %s\n",
					map[i], (int)kids[map[i]].pid, kids[map[i]].gid,
					kids[map[i]].out);
			die("children still running at the deadline: killed");
		}
		rc = poll(pfd, (nfds_t)n, 200);
		if (rc < 0 && errno != EINTR)
			die("poll: %s", strerror(errno));
		for (int i = 0; rc > 0 && i < n; i++)
			if (pfd[i].revents)
				drain(&kids[map[i]]);
	}
}

static void reap_all(double deadline)
{
	int failed = 0;

	for (int i = 0; i < nkids; i++) {
		struct child *c = &kids[i];

		while (!c->exited) {
			struct rusage ru;
			pid_t r = wait4(c->pid, &c->status, WNOHANG, &ru);

			if (r == c->pid) {
				c->exited = 1;
				c->exit_cpu_us = (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
						 (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
				break;
			}
			if (r < 0 && errno != EINTR)
				die("waitpid: %s", strerror(errno));
			if (now_us() > deadline)
				die("child %d (pid %d) closed its output but did not exit",
				    i, (int)c->pid);
			usleep(10000);
		}
		if (!WIFEXITED(c->status) || WEXITSTATUS(c->status)) {
			fprintf(stderr, "elastic_launch: child %d (GID index %d) failed "
				"(status %#x; its error is above); its output: %s\n", i,
				c->gid, c->status, c->out);
			failed++;
		}
	}
	if (failed)
		die("%d of %d children failed", failed, nkids);
}

/* ---- burst --------------------------------------------------------------- */

static int go_w = -1;
static double go_us;

/* Lets the children go once every one has done its first GET or ended. */
static void release_burst(void)
{
	if (go_w < 0)
		return;
	for (int i = 0; i < nkids; i++)
		if (!kids[i].first_us && kids[i].fd >= 0)
			return;
	go_us = now_us();
	close(go_w);
	go_w = -1;
}

static int burst(int n, double timeout_s, char **args)
{
	static double first[MAX_CHILDREN], mainv[MAX_CHILDREN],
		setup[MAX_CHILDREN], path[MAX_CHILDREN], conn[MAX_CHILDREN],
		cpu[MAX_CHILDREN], cpu_at[4][MAX_CHILDREN];
	static const char *const cpu_keys[4] = { "main_cpu_us", "setup_cpu_us",
						  "path_cpu_us", "connected_cpu_us" };
	double deadline, start, last_first = 0, end_max = 0, gets = 0, cpu_sum = 0;
	int go[2], gate[2], served = 0;

	if (pipe2(go, O_CLOEXEC) || pipe2(gate, O_CLOEXEC))
		die("pipe2: %s", strerror(errno));
	/* Not inherited by the children past their exec (O_CLOEXEC): only
	 * fd 3, the read end, is; a child holding the write end would never
	 * see EOF. */
	go_w = go[1];
	/* Fork every child first, each waiting at the gate before its exec,
	 * then open the gate: all N exec at the same instant, the load
	 * spike. (Spawning them one by one would spread the starts over
	 * seconds here: the launcher competes with the children it already
	 * started for the VM's two CPUs.) */
	for (int i = 0; i < n; i++)
		spawn(i, gids[i % ngids], args, go[0], gate[0], gate[1]);
	start = now_us();
	close(gate[1]);
	close(gate[0]);
	close(go[0]);
	for (int i = 0; i < n; i++)
		kids[i].start_us = start;
	deadline = start + timeout_s * 1e6;
	pump(deadline, release_burst);
	reap_all(deadline);

	for (int i = 0; i < n; i++) {
		const struct child *c = &kids[i];
		const char *t = times_line(c);
		double g, end;

		if (!t || !c->first_us)
			die("child %d printed no kv_times / kv_first line (run with -T "
			    "-W 3?): %s", i, c->out);
		first[served] = (c->first_us - c->start_us) / 1e3;
		mainv[served] = (field(t, "main_us") - c->start_us) / 1e3;
		setup[served] = (field(t, "setup_us") - c->start_us) / 1e3;
		path[served] = (field(t, "path_us") - c->start_us) / 1e3;
		conn[served] = (field(t, "connected_us") - c->start_us) / 1e3;
		cpu[served] = c->cpu_us / 1e3;
		cpu_sum += cpu[served];
		for (int k = 0; k < 4; k++)
			cpu_at[k][served] = field(t, cpu_keys[k]) / 1e3;
		g = field(t, "gets");
		end = field(t, "get_end_us");
		gets += g;
		if (end > end_max)
			end_max = end;
		if (c->first_us > last_first)
			last_first = c->first_us;
		printf("child %d gid=%d first_ms=%.1f main_ms=%.1f setup_ms=%.1f "
		       "path_ms=%.1f connected_ms=%.1f cpu_ms=%.1f gets=%.0f "
		       "get_ms=%.1f\n", i, c->gid, first[served], mainv[served],
		       setup[served], path[served], conn[served], cpu[served], g,
		       (end - field(t, "get_start_us")) / 1e3);
		served++;
	}
	{
		double span = kids[n - 1].fork_us - kids[0].fork_us;
		double all = (last_first - start) / 1e3;
		double window = (end_max - go_us) / 1e3;
		double fmax = 0;

		for (int i = 0; i < served; i++)
			if (first[i] > fmax)
				fmax = first[i];
		printf("burst n=%d served=%d first_med_ms=%.1f first_max_ms=%.1f "
		       "all_served_ms=%.1f fork_span_ms=%.1f main_med_ms=%.1f "
		       "setup_med_ms=%.1f path_med_ms=%.1f connected_med_ms=%.1f "
		       "cpu_med_ms=%.1f cpu_sum_ms=%.1f cpu_main_med_ms=%.1f "
		       "cpu_setup_med_ms=%.1f cpu_path_med_ms=%.1f "
		       "cpu_connected_med_ms=%.1f gets=%.0f get_window_ms=%.1f "
		       "get_ops_s=%.0f\n", n, served,
		       median(first, served), fmax, all, span / 1e3,
		       median(mainv, served), median(setup, served),
		       median(path, served), median(conn, served),
		       median(cpu, served), cpu_sum, median(cpu_at[0], served),
		       median(cpu_at[1], served), median(cpu_at[2], served),
		       median(cpu_at[3], served),
		       gets, window, window > 0 ? gets / (window / 1e3) : 0);
	}
	return 0;
}

/* ---- serial ---------------------------------------------------------------- */

static int serial(int rounds, double timeout_s, char **args)
{
	double *e2d = calloc((size_t)rounds, sizeof(double)),
	       *mainv = calloc((size_t)rounds, sizeof(double)),
	       *conn = calloc((size_t)rounds, sizeof(double)),
	       *setup = calloc((size_t)rounds, sizeof(double)),
	       *path = calloc((size_t)rounds, sizeof(double)),
	       *cpu = calloc((size_t)rounds, sizeof(double)), lo = 1e18, hi = 0;

	if (!e2d || !mainv || !conn || !setup || !path || !cpu)
		die("calloc");
	for (int r = 0; r < rounds; r++) {
		struct child *c = &kids[0];
		const char *t;
		double deadline, obj;

		memset(c, 0, sizeof(*c));
		spawn(0, gids[r % ngids], args, -1, -1, -1);
		deadline = c->start_us + timeout_s * 1e6;
		pump(deadline, NULL);
		reap_all(deadline);
		t = times_line(c);
		obj = t ? field(t, "object_us") : -1;
		if (obj <= 0)
			die("round %d: the child printed no object_us (run with -O -T): %s",
			    r + 1, c->out);
		e2d[r] = (obj - c->start_us) / 1e3;
		mainv[r] = (field(t, "main_us") - c->start_us) / 1e3;
		conn[r] = (field(t, "connected_us") - c->start_us) / 1e3;
		setup[r] = (field(t, "setup_us") - c->start_us) / 1e3;
		path[r] = (field(t, "path_us") - c->start_us) / 1e3;
		cpu[r] = c->exit_cpu_us / 1e3;
		if (e2d[r] < lo)
			lo = e2d[r];
		if (e2d[r] > hi)
			hi = e2d[r];
		printf("round %d gid=%d exec_to_data_ms=%.1f main_ms=%.1f "
		       "setup_ms=%.1f path_ms=%.1f connected_ms=%.1f cpu_ms=%.1f\n", r + 1,
		       c->gid, e2d[r], mainv[r], setup[r], path[r], conn[r], cpu[r]);
		nkids = 0;
	}
	printf("serial rounds=%d exec_to_data_med_ms=%.1f min_ms=%.1f max_ms=%.1f "
	       "main_med_ms=%.1f setup_med_ms=%.1f path_med_ms=%.1f "
	       "connected_med_ms=%.1f cpu_med_ms=%.1f\n", rounds, median(e2d, rounds), lo, hi,
	       median(mainv, rounds), median(setup, rounds),
	       median(path, rounds), median(conn, rounds), median(cpu, rounds));
	free(cpu);
	free(setup);
	free(path);
	free(e2d);
	free(mainv);
	free(conn);
	return 0;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: elastic_launch burst -n N [-g GIDS] [-t SECONDS] -- PROG ARGS...\n"
		"       elastic_launch serial -n ROUNDS [-g GIDS] [-t SECONDS] -- PROG ARGS...\n");
	exit(2);
}

int main(int argc, char **argv)
{
	double timeout_s = 300;
	int n = 0, opt;
	const char *mode;

	if (argc < 2)
		usage();
	mode = argv[1];
	optind = 2;
	while ((opt = getopt(argc, argv, "n:g:t:")) != -1) {
		switch (opt) {
		case 'n': n = atoi(optarg); break;
		case 'g': parse_gids(optarg); break;
		case 't': timeout_s = atof(optarg); break;
		default: usage();
		}
	}
	if (n < 1 || n > MAX_CHILDREN || optind >= argc || !(timeout_s > 0))
		usage();
	setvbuf(stdout, NULL, _IOLBF, 0);
	/* A child that dies with our pipe open must not kill us. */
	signal(SIGPIPE, SIG_IGN);
	if (!strcmp(mode, "burst")) {
		printf("# elastic_launch burst n=%d prog=%s\n", n, argv[optind]);
		return burst(n, timeout_s, argv + optind);
	}
	if (!strcmp(mode, "serial")) {
		printf("# elastic_launch serial rounds=%d prog=%s\n", n, argv[optind]);
		return serial(n, timeout_s, argv + optind);
	}
	usage();
	return 2;
}
