/*
 * reg_mr: latency of ibv_reg_mr + ibv_dereg_mr on one buffer, per size.
 *
 *   reg_mr [-d DEV] [-n ITERS] [-a ACCESS] [SIZE...]
 *
 * For each size (default 4 KiB .. 64 MiB in powers of 4) the buffer is
 * mmapped and every page written first; untimed reg/dereg pairs warm up
 * (with krcore's cache on, they leave the region idle in the cache, so
 * the timed registrations are cache hits) and size the batch; then ITERS
 * (default 31) samples, each BATCH ibv_reg_mr of the buffer followed by
 * their BATCH ibv_dereg_mr, timed as a whole (clock_gettime can cost
 * microseconds in an emulated VM) and divided by BATCH. Prints one line
 * per size (times per registration, median / 10th / 90th percentile over
 * the samples):
 *
 *   size pages samples batch reg_med_us dereg_med_us pair_med_us
 *   pair_p10_us pair_p90_us hits misses
 *
 * hits/misses are krcore's MR-cache counters moved during the samples
 * (-1 when the program does not run under krcore; with the cache warmed,
 * hits = samples * batch). Links -libverbs only:
 * run it plain, or with LD_PRELOAD=libkrcore.so (KRCORE_MR_CACHE=0/1);
 * bench/reg-mr-compare.sh does all three in one VM boot and prints the
 * table. RLIMIT_MEMLOCK is raised first when allowed (the cache keeps at
 * most half of it).
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

/* krcore.h's enum krcore_stat, found at run time (dlsym). */
#define KRCORE_STAT_NAME_HITS "mr_cache_hits"
#define KRCORE_STAT_NAME_MISSES "mr_cache_misses"

typedef unsigned long long (*stat_get_fn)(unsigned);
typedef const char *(*stat_name_fn)(unsigned);

static stat_get_fn stat_get;
static int stat_hits = -1, stat_misses = -1;

static void find_krcore(void)
{
	stat_name_fn name = (stat_name_fn)dlsym(RTLD_DEFAULT, "krcore_stat_name");

	stat_get = (stat_get_fn)dlsym(RTLD_DEFAULT, "krcore_stat_get");
	if (!stat_get || !name)
		return;
	for (unsigned i = 0; i < 256; i++) {
		const char *n = name(i);

		if (!n)
			break;
		if (!strcmp(n, KRCORE_STAT_NAME_HITS))
			stat_hits = (int)i;
		if (!strcmp(n, KRCORE_STAT_NAME_MISSES))
			stat_misses = (int)i;
	}
}

static long long counter(int i)
{
	return stat_get && i >= 0 ? (long long)stat_get((unsigned)i) : -1;
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

/* Sorts v in place; q in [0,1]. */
static double quantile(double *v, int n, double q)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return v[(int)(q * (n - 1) + 0.5)];
}

/* Each sample times `k` registrations then their `k` deregistrations
 * with one pair of clock reads, k chosen so that a sample lasts about
 * SAMPLE_US: in an emulated VM clock_gettime itself may cost microseconds
 * (an HPET read), as much as a cache hit. */
#define SAMPLE_US 2000.0
#define MAX_BATCH 1000
#define MAX_PINNED ((size_t)256 << 20)	/* k * size at most this */

static void die(const char *what)
{
	fprintf(stderr, "reg_mr: %s: %s\n", what, strerror(errno));
	exit(1);
}

int main(int argc, char **argv)
{
	const char *devname = getenv("CT_DEVICE") ? getenv("CT_DEVICE") : "rxe0";
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
		     IBV_ACCESS_REMOTE_READ;
	int iters = 0, opt, ndev, i;
	size_t sizes[32];
	int nsizes = 0;
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_pd *pd;
	struct rlimit rl = { RLIM_INFINITY, RLIM_INFINITY };
	long pg = sysconf(_SC_PAGESIZE);
	double clock_us;

	while ((opt = getopt(argc, argv, "d:n:a:")) != -1) {
		switch (opt) {
		case 'd': devname = optarg; break;
		case 'n': iters = atoi(optarg); break;
		case 'a': access = (int)strtol(optarg, NULL, 0); break;
		default:
			fprintf(stderr, "usage: reg_mr [-d DEV] [-n ITERS] "
				"[-a ACCESS] [SIZE...]\n");
			return 2;
		}
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

	{
		double t0 = now_us();

		for (i = 0; i < 1000; i++)
			(void)now_us();
		clock_us = (now_us() - t0) / 1000;
	}
	printf("# reg_mr device=%s access=%#x krcore=%s KRCORE_MR_CACHE=%s "
	       "clock_gettime=%.3fus\n", devname, access,
	       stat_get ? "yes" : "no",
	       getenv("KRCORE_MR_CACHE") ? getenv("KRCORE_MR_CACHE") : "unset",
	       clock_us);
	printf("# size pages samples batch reg_med_us dereg_med_us "
	       "pair_med_us pair_p10_us pair_p90_us hits misses\n");
	for (int k = 0; k < nsizes; k++) {
		size_t size = sizes[k];
		int n = iters > 0 ? iters : 31, batch;
		double *reg = calloc((size_t)n, sizeof(double));
		double *der = calloc((size_t)n, sizeof(double));
		double *pair = calloc((size_t)n, sizeof(double));
		struct ibv_mr *mrs[MAX_BATCH];
		long long h0, m0;
		uint8_t *buf;
		double t0, probe;

		if (!reg || !der || !pair)
			die("calloc");
		buf = mmap(NULL, size, PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (buf == MAP_FAILED)
			die("mmap");
		for (size_t off = 0; off < size; off += (size_t)pg)
			buf[off] = (uint8_t)off;
		/* Warm-up (with the cache on, leaves the region idle in it),
		 * which also sizes the batch. */
		t0 = now_us();
		mrs[0] = ibv_reg_mr(pd, buf, size, access);
		if (!mrs[0] || ibv_dereg_mr(mrs[0]))
			die("warm-up ibv_reg_mr/ibv_dereg_mr");
		for (i = 0; i < 3; i++) {
			double t = now_us();

			mrs[0] = ibv_reg_mr(pd, buf, size, access);
			if (!mrs[0] || ibv_dereg_mr(mrs[0]))
				die("warm-up ibv_reg_mr/ibv_dereg_mr");
			probe = now_us() - t;
			if (!i || probe < t0)
				t0 = probe;
		}
		probe = t0 > 0.01 ? t0 : 0.01;
		batch = (int)(SAMPLE_US / probe) + 1;
		if (batch > MAX_BATCH)
			batch = MAX_BATCH;
		if ((size_t)batch * size > MAX_PINNED)
			batch = (int)(MAX_PINNED / size) > 0 ?
					(int)(MAX_PINNED / size) : 1;
		h0 = counter(stat_hits);
		m0 = counter(stat_misses);
		for (i = 0; i < n; i++) {
			double t1, t2;
			int j;

			t0 = now_us();
			for (j = 0; j < batch; j++)
				if (!(mrs[j] = ibv_reg_mr(pd, buf, size, access)))
					die("ibv_reg_mr");
			t1 = now_us();
			for (j = 0; j < batch; j++)
				if (ibv_dereg_mr(mrs[j]))
					die("ibv_dereg_mr");
			t2 = now_us();
			reg[i] = (t1 - t0) / batch;
			der[i] = (t2 - t1) / batch;
			pair[i] = (t2 - t0) / batch;
		}
		printf("%zu %zu %d %d %.3f %.3f %.3f %.3f %.3f %lld %lld\n",
		       size, (size + (size_t)pg - 1) / (size_t)pg, n, batch,
		       quantile(reg, n, 0.5), quantile(der, n, 0.5),
		       quantile(pair, n, 0.5), quantile(pair, n, 0.1),
		       quantile(pair, n, 0.9),
		       stat_get ? counter(stat_hits) - h0 : -1,
		       stat_get ? counter(stat_misses) - m0 : -1);
		fflush(stdout);
		munmap(buf, size);
		free(reg);
		free(der);
		free(pair);
	}
	if (ibv_dealloc_pd(pd))
		die("ibv_dealloc_pd");
	ibv_close_device(ctx);
	return 0;
}
