/*
 * reg_mr: latency of ibv_reg_mr + ibv_dereg_mr pairs, per size.
 *
 *   reg_mr [-d DEV] [-n PAIRS] [-p POOL] [-a ACCESS] [-t tsc|clock] [-S]
 *          [SIZE...]
 *
 * For each size (default 4 KiB .. 64 MiB in powers of 4) a pool of POOL
 * separately mmapped buffers is made and every page of every buffer is
 * written first (pre-faulted). The program then runs register/deregister
 * pairs, each on the next buffer of the pool in turn (buffer 0, 1, ...,
 * POOL-1, 0, 1, ...): first untimed warm-up pairs (two rounds of the pool,
 * at least 8 pairs), then PAIRS (default 101) timed pairs continuing the
 * same cycle. Every configuration runs the very same sequence, so:
 *
 *   plain libibverbs (no preload)        every pair is a real reg + dereg
 *                                        of memory already faulted in;
 *   krcore, KRCORE_MR_CACHE_ENTRIES=1    every pair misses (the cache keeps
 *                                        at most one idle region and the
 *                                        next buffer is always another
 *                                        one) and evicts one region: a real
 *                                        reg plus the cache's real dereg;
 *   krcore, cache on, default limits     warmed by the first round: every
 *                                        timed pair is a hit;
 *   krcore, KRCORE_MR_CACHE=0            every pair real, through krcore.
 *
 * POOL defaults to 64 MiB / size clamped to [4, 16]; at least 3 buffers
 * are needed for every pair to miss with one idle region kept.
 *
 * Each pair is timed on its own (registration and deregistration apart)
 * with the CPU's time-stamp counter (x86-64 TSC, aarch64 virtual counter),
 * calibrated against CLOCK_MONOTONIC at start: clock_gettime in an emulated
 * VM reads an emulated HPET and costs 2 to 20 us, as much as a cache hit,
 * whereas the counter costs well under a microsecond (printed). `-t clock`
 * forces clock_gettime. Prints one line per size:
 *
 *   size pages pool pairs reg_med_us dereg_med_us pair_med_us pair_p10_us
 *   pair_p90_us pair_mean_us hits misses evictions mode
 *
 * (medians / percentiles / mean over the timed pairs). hits, misses and
 * evictions are krcore's MR-cache counters moved during the timed pairs,
 * mode is mr_cache_mode after them (1: caching); all -1 when the program
 * does not run under krcore.
 *
 * -I (interleaved, under krcore with KRCORE_MR_CACHE_ENTRIES=1): plain
 * libibverbs and krcore side by side in ONE process, pair by pair. The
 * real libibverbs is opened a second time through dlopen (its objects are
 * its own, krcore never sees them); each timed step is a plain pair on
 * the real PD and a krcore pair (a miss) on krcore's PD, on the same
 * buffer, the order alternating every step. Between-run noise of an
 * emulated VM (often +-30 %) then cancels out of the ratio. Prints per size:
 *
 *   I size pages pool pairs plain_pair_med_us krcore_pair_med_us
 *   ratio_of_medians median_of_step_ratios hits misses evictions
 *
 * -S (for counting system calls under strace): no timing at all; before
 * and after the timed pairs of each size the program writes a marker line
 * "reg_mr-mark begin SIZE PAIRS" / "reg_mr-mark end SIZE PAIRS" to stderr
 * with one write(2) each, so that everything the calling thread does in
 * between is the pairs and nothing else.
 *
 * Links -libverbs only: run it plain, or with LD_PRELOAD=libkrcore.so;
 * bench/reg-mr-compare.sh runs every configuration in one VM boot and
 * prints the table. RLIMIT_MEMLOCK is raised first when allowed (the cache
 * keeps at most half of it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include "timer.h"

/* krcore.h's enum krcore_stat, found by name at run time (dlsym). */
typedef unsigned long long (*stat_get_fn)(unsigned);
typedef const char *(*stat_name_fn)(unsigned);

static stat_get_fn stat_get;

/* The real libibverbs, for -I. */
static struct {
	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
	int (*dereg_mr)(struct ibv_mr *);
} rv;
static int stat_hits = -1, stat_misses = -1, stat_evictions = -1,
	   stat_mode = -1;

static void find_krcore(void)
{
	stat_name_fn name = (stat_name_fn)dlsym(RTLD_DEFAULT, "krcore_stat_name");

	stat_get = (stat_get_fn)dlsym(RTLD_DEFAULT, "krcore_stat_get");
	if (!stat_get || !name) {
		stat_get = NULL;
		return;
	}
	for (unsigned i = 0; i < 256; i++) {
		const char *n = name(i);

		if (!n)
			break;
		if (!strcmp(n, "mr_cache_hits"))
			stat_hits = (int)i;
		if (!strcmp(n, "mr_cache_misses"))
			stat_misses = (int)i;
		if (!strcmp(n, "mr_cache_evictions"))
			stat_evictions = (int)i;
		if (!strcmp(n, "mr_cache_mode"))
			stat_mode = (int)i;
	}
}

static long long counter(int i)
{
	return stat_get && i >= 0 ? (long long)stat_get((unsigned)i) : -1;
}

static long long moved(int i, long long before)
{
	return stat_get && i >= 0 ? counter(i) - before : -1;
}

/* Sorts v in place; q in [0,1]. */
static double quantile(double *v, int n, double q)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return v[(int)(q * (n - 1) + 0.5)];
}

static double mean(const double *v, int n)
{
	double s = 0;

	for (int i = 0; i < n; i++)
		s += v[i];
	return s / n;
}

static void die(const char *what)
{
	fprintf(stderr, "reg_mr: %s: %s\n", what, strerror(errno));
	exit(1);
}

static void mark(const char *what, size_t size, int pairs)
{
	char line[96];
	int n = snprintf(line, sizeof(line), "reg_mr-mark %s %zu %d\n", what,
			 size, pairs);

	/* One write(2), no stdio: the marker is one system call. */
	if (write(STDERR_FILENO, line, (size_t)n) != n)
		die("write marker");
}

#define MAX_POOL 64
#define POOL_BYTES ((size_t)64 << 20)

int main(int argc, char **argv)
{
	const char *devname = getenv("CT_DEVICE") ? getenv("CT_DEVICE") : "rxe0";
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
		     IBV_ACCESS_REMOTE_READ;
	int iters = 0, pool_opt = 0, syscall_marks = 0, interleave = 0, opt;
	int ndev, i;
	struct ibv_context *rctx = NULL;
	struct ibv_pd *rpd = NULL;
	size_t sizes[32];
	int nsizes = 0;
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_pd *pd;
	struct rlimit rl = { RLIM_INFINITY, RLIM_INFINITY };
	long pg = sysconf(_SC_PAGESIZE);
	double clock_us, timer_us;

#if defined(__x86_64__) || defined(__aarch64__)
	use_counter = 1;
#endif
	while ((opt = getopt(argc, argv, "d:n:p:a:t:SI")) != -1) {
		switch (opt) {
		case 'd': devname = optarg; break;
		case 'n': iters = atoi(optarg); break;
		case 'p': pool_opt = atoi(optarg); break;
		case 'a': access = (int)strtol(optarg, NULL, 0); break;
		case 't':
			if (!strcmp(optarg, "clock"))
				use_counter = 0;
			else if (strcmp(optarg, "tsc")) {
				fprintf(stderr, "reg_mr: -t tsc|clock\n");
				return 2;
			}
			break;
		case 'S': syscall_marks = 1; break;
		case 'I': interleave = 1; break;
		default:
			fprintf(stderr, "usage: reg_mr [-d DEV] [-n PAIRS] "
				"[-p POOL] [-a ACCESS] [-t tsc|clock] [-S] "
				"[SIZE...]\n");
			return 2;
		}
	}
	if (pool_opt < 0 || pool_opt > MAX_POOL) {
		fprintf(stderr, "reg_mr: -p between 1 and %d (0 or none: "
			"64 MiB / size, clamped to [4, 16])\n", MAX_POOL);
		return 2;
	}
	for (; optind < argc && nsizes < 32; optind++)
		sizes[nsizes++] = strtoull(argv[optind], NULL, 0);
	if (!nsizes)
		for (size_t s = 4 << 10; s <= (size_t)64 << 20; s *= 4)
			sizes[nsizes++] = s;

	/* Before the first verbs call: the cache sizes itself then. */
	if (setrlimit(RLIMIT_MEMLOCK, &rl))
		fprintf(stderr, "reg_mr: note: cannot raise RLIMIT_MEMLOCK "
			"(%s)\n", strerror(errno));
	find_krcore();

	list = ibv_get_device_list(&ndev);
	if (!list)
		die("ibv_get_device_list");
	for (i = 0; i < ndev; i++)
		if (!strcmp(ibv_get_device_name(list[i]), devname))
			ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!ctx) {
		fprintf(stderr, "reg_mr: cannot open %s\n", devname);
		return 1;
	}
	pd = ibv_alloc_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd");
	if (interleave) {
		void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);

		if (!stat_get || !h) {
			fprintf(stderr, "reg_mr: -I needs LD_PRELOAD=libkrcore.so "
				"and libibverbs.so.1\n");
			return 2;
		}
#define REAL(f) (*(void **)&rv.f = dlvsym(h, "ibv_" #f, "IBVERBS_1.1"))
		if (!REAL(get_device_list) || !REAL(free_device_list) ||
		    !REAL(open_device) || !REAL(close_device) ||
		    !REAL(alloc_pd) || !REAL(dealloc_pd) || !REAL(reg_mr) ||
		    !REAL(dereg_mr))
			die("dlvsym");
#undef REAL
		list = rv.get_device_list(&ndev);
		for (i = 0; list && i < ndev && !rctx; i++)
			if (!strcmp(ibv_get_device_name(list[i]), devname))
				rctx = rv.open_device(list[i]);
		if (list)
			rv.free_device_list(list);
		if (!rctx || !(rpd = rv.alloc_pd(rctx)))
			die("real ibv_open_device/ibv_alloc_pd");
	}

	{
		double t0 = mono_us();
		double d[1001];

		for (i = 0; i < 1000; i++)
			(void)mono_us();
		clock_us = (mono_us() - t0) / 1000;
		if (!calibrate())
			die("timer calibration failed");
		for (i = 0; i < 1001; i++) {
			uint64_t a = ticks();

			d[i] = (double)(ticks() - a) / ticks_per_us;
		}
		timer_us = quantile(d, 1001, 0.5);
	}
	printf("# reg_mr device=%s access=%#x krcore=%s KRCORE_MR_CACHE=%s "
	       "KRCORE_MR_CACHE_ENTRIES=%s "
	       "clock_gettime=%.3fus timer=%s ticks_per_us=%.3f "
	       "timer_cost=%.4fus\n", devname, access,
	       stat_get ? "yes" : "no",
	       getenv("KRCORE_MR_CACHE") ? getenv("KRCORE_MR_CACHE") : "unset",
	       getenv("KRCORE_MR_CACHE_ENTRIES") ?
		       getenv("KRCORE_MR_CACHE_ENTRIES") : "unset",
	       clock_us,
	       syscall_marks ? "none" : use_counter ? "counter" : "clock",
	       ticks_per_us, timer_us);
	printf("# size pages pool pairs reg_med_us dereg_med_us pair_med_us "
	       "pair_p10_us pair_p90_us pair_mean_us hits misses evictions "
	       "mode\n");
	fflush(stdout);
	for (int k = 0; k < nsizes; k++) {
		size_t size = sizes[k];
		int n = iters > 0 ? iters : 101, np, warm;
		double *reg = calloc((size_t)n, sizeof(double));
		double *der = calloc((size_t)n, sizeof(double));
		double *pair = calloc((size_t)n, sizeof(double));
		uint8_t *pool[MAX_POOL];
		long long h0, m0, e0;
		struct ibv_mr *mr;

		if (!reg || !der || !pair)
			die("calloc");
		np = pool_opt;
		if (!np) {
			size_t p = POOL_BYTES / size;

			np = p < 4 ? 4 : p > 16 ? 16 : (int)p;
		}
		for (int b = 0; b < np; b++) {
			pool[b] = mmap(NULL, size, PROT_READ | PROT_WRITE,
				       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (pool[b] == MAP_FAILED)
				die("mmap");
			for (size_t off = 0; off < size; off += (size_t)pg)
				pool[b][off] = (uint8_t)(off + (size_t)b);
		}
		/* Warm-up: with the cache on, the first round leaves every
		 * buffer idle in the cache; with a one-entry cache, the
		 * steady state (one idle region) is reached. */
		warm = 2 * np < 8 ? 8 : 2 * np;
		for (i = 0; i < warm; i++) {
			mr = ibv_reg_mr(pd, pool[i % np], size, access);
			if (!mr || ibv_dereg_mr(mr))
				die("warm-up ibv_reg_mr/ibv_dereg_mr");
		}
		h0 = counter(stat_hits);
		m0 = counter(stat_misses);
		e0 = counter(stat_evictions);
		if (interleave) {
			/* reg[] and der[]: plain and krcore pair times. */
			double *ratio = pair;

			for (i = 0; i < n; i++) {
				uint8_t *buf = pool[(warm + i) % np];
				uint64_t t0, t1;
				struct ibv_mr *rmr;

				for (int side = 0; side < 2; side++) {
					int krc = side ^ (i & 1);

					t0 = ticks();
					if (krc) {
						mr = ibv_reg_mr(pd, buf, size, access);
						if (!mr || ibv_dereg_mr(mr))
							die("krcore pair");
					} else {
						rmr = rv.reg_mr(rpd, buf, size, access);
						if (!rmr || rv.dereg_mr(rmr))
							die("plain pair");
					}
					t1 = ticks();
					(krc ? der : reg)[i] =
						(double)(t1 - t0) / ticks_per_us;
				}
				ratio[i] = der[i] / reg[i];
			}
			h0 = moved(stat_hits, h0);
			m0 = moved(stat_misses, m0);
			e0 = moved(stat_evictions, e0);
			{
				double pm = quantile(reg, n, 0.5);
				double km = quantile(der, n, 0.5);

				printf("I %zu %zu %d %d %.3f %.3f %.4f %.4f %lld "
				       "%lld %lld\n", size,
				       (size + (size_t)pg - 1) / (size_t)pg, np,
				       n, pm, km, km / pm,
				       quantile(ratio, n, 0.5), h0, m0, e0);
			}
			goto next_size;
		} else if (syscall_marks) {
			mark("begin", size, n);
			for (i = 0; i < n; i++) {
				mr = ibv_reg_mr(pd, pool[(warm + i) % np], size,
						access);
				if (!mr)
					die("ibv_reg_mr");
				if (ibv_dereg_mr(mr))
					die("ibv_dereg_mr");
			}
			mark("end", size, n);
			for (i = 0; i < n; i++)
				reg[i] = der[i] = pair[i] = 0;
		} else {
			for (i = 0; i < n; i++) {
				uint8_t *buf = pool[(warm + i) % np];
				uint64_t t0, t1, t2;

				t0 = ticks();
				mr = ibv_reg_mr(pd, buf, size, access);
				t1 = ticks();
				if (!mr)
					die("ibv_reg_mr");
				if (ibv_dereg_mr(mr))
					die("ibv_dereg_mr");
				t2 = ticks();
				reg[i] = (double)(t1 - t0) / ticks_per_us;
				der[i] = (double)(t2 - t1) / ticks_per_us;
				pair[i] = (double)(t2 - t0) / ticks_per_us;
			}
		}
		h0 = moved(stat_hits, h0);
		m0 = moved(stat_misses, m0);
		e0 = moved(stat_evictions, e0);
		{
			double pm = mean(pair, n);
			double rm = quantile(reg, n, 0.5);
			double dm = quantile(der, n, 0.5);
			double p50 = quantile(pair, n, 0.5);
			double p10 = quantile(pair, n, 0.1);
			double p90 = quantile(pair, n, 0.9);

			printf("%zu %zu %d %d %.3f %.3f %.3f %.3f %.3f %.3f "
			       "%lld %lld %lld %lld\n",
			       size, (size + (size_t)pg - 1) / (size_t)pg, np,
			       n, rm, dm, p50, p10, p90, pm, h0, m0, e0,
			       counter(stat_mode));
		}
next_size:
		fflush(stdout);
		for (int b = 0; b < np; b++)
			munmap(pool[b], size);
		free(reg);
		free(der);
		free(pair);
	}
	if (rpd && (rv.dealloc_pd(rpd) || rv.close_device(rctx)))
		die("real ibv_dealloc_pd/ibv_close_device");
	if (ibv_dealloc_pd(pd))
		die("ibv_dealloc_pd");
	ibv_close_device(ctx);
	return 0;
}
