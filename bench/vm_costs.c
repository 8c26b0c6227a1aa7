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
 * 5 timed loops of N operations each (CLOCK_MONOTONIC around the loop). */
#include <pthread.h>
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
	return 0;
}
