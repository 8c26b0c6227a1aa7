/*
 * The benchmarks' timer (bench/reg_mr.c, connect.c, datapath.c): the CPU's
 * cycle counter when there is one and use_counter is set (x86-64 TSC,
 * aarch64 virtual counter: cheap even under emulation, where
 * clock_gettime reads an emulated HPET and costs microseconds), else
 * clock_gettime in nanoseconds. calibrate() measures ticks_per_us against
 * CLOCK_MONOTONIC over a 200 ms sleep (clock_gettime's own cost is then
 * negligible).
 */
#ifndef KRCORE_BENCH_TIMER_H
#define KRCORE_BENCH_TIMER_H

#include <stdint.h>
#include <time.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

static int use_counter;
static double ticks_per_us = 1e3;

static double mono_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static inline uint64_t ticks(void)
{
#if defined(__x86_64__)
	if (use_counter) {
		_mm_lfence();
		return __rdtsc();
	}
#elif defined(__aarch64__)
	if (use_counter) {
		uint64_t v;

		__asm__ __volatile__("isb; mrs %0, cntvct_el0" : "=r"(v) : : "memory");
		return v;
	}
#endif
	{
		struct timespec ts;

		clock_gettime(CLOCK_MONOTONIC, &ts);
		return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	}
}

/* Returns 0 when the result is unusable (not positive). */
static int calibrate(void)
{
	struct timespec nap = { 0, 200 * 1000 * 1000 };
	double m0, m1;
	uint64_t t0, t1;

	if (!use_counter)
		return 1;
	m0 = mono_us();
	t0 = ticks();
	nanosleep(&nap, NULL);
	t1 = ticks();
	m1 = mono_us();
	ticks_per_us = (double)(t1 - t0) / (m1 - m0);
	return ticks_per_us > 0;
}

/* Microseconds between two ticks() readings. */
static inline double us_of(uint64_t a, uint64_t b)
{
	return (double)(b - a) / ticks_per_us;
}

/* qsort order of timed samples. */
static inline int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

#endif
