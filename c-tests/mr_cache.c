/*
 * mr_cache: krcore's memory-registration cache (src/mr/), with real data
 * over the wire, byte for byte.
 *
 * - hits: 100 reg/dereg of one buffer are 1 miss + 99 hits; every returned
 *   MR carries the requested addr/length and the application's PD; a
 *   local-only sub-range of a registered buffer hits; a REMOTE_WRITE
 *   sub-range does not (and its rkey really stops at the sub-range);
 *   overlapping ranges are registered separately; iova != addr bypasses the
 *   cache;
 * - rkey after ibv_dereg_mr: refused with the cache off and in hold-only
 *   mode; in caching mode the idle region may still accept it (reported
 *   as a NOTE);
 * - stale memory: register and use a buffer, deregister it (the region is
 *   now idle in the cache), replace its pages (brk shrink, munmap + mmap,
 *   mmap MAP_FIXED, mremap, madvise(MADV_DONTNEED), shmdt + shmat, glibc
 *   free() + malloc), write NEW bytes (the complement of the OLD ones, so
 *   every byte differs), register the same address again and move it over
 *   RDMA (WRITE from QP A, READ from QP B): the receiver must get the NEW
 *   bytes. A stale cached registration would move the OLD pages, which
 *   it keeps pinned; a control registration held across the change proves
 *   that this is what a stale registration does on this device;
 * - fork: a child never gets the parent's cached registrations; the
 *   parent's held and idle registrations keep working after the fork;
 * - ibv_dealloc_pd flushes idle registrations of that PD, and is EBUSY
 *   (with the PD and the held MR still usable) while the application holds
 *   one;
 * - eviction (re-executed with KRCORE_MR_CACHE_ENTRIES=4, then with
 *   KRCORE_MR_CACHE_BYTES=262144, then with ENTRIES=4 and the background
 *   deregistration in batches of 2, then inline, KRCORE_MR_DEREG_BATCH=0):
 *   evictions and deregistration batches happen, pinned bytes (cached and
 *   queued for deregistration) stay bounded, every full batch is
 *   deregistered by the thread, evicted regions come back as misses, and
 *   ibv_dealloc_pd (teardown) waits for the queued ones;
 * - the whole file once more with KRCORE_MR_CACHE=0 (re-executed): no hits,
 *   same data; and once more without userfaultfd (a seccomp filter makes
 *   it ENOSYS): the hold-only fallback (mode 2) reuses nothing, not even a
 *   registration someone still holds: every cached-path ibv_reg_mr is one
 *   miss (a real registration), hits stay 0, the data is right;
 * - stale_held_*: the same changes with the old registration held across
 *   them (same access flags as the new one): the new registration moves
 *   the NEW bytes in every mode, including glibc free() + malloc in
 *   hold-only mode, where nothing sees the unmap;
 * - close_device (a sub-run): ibv_close_device of a context whose PD
 *   still has an idle cached MR deregisters that MR before the real close
 *   (nothing stays pinned) and never hurts the next context, whose first
 *   MR has the same kernel handle.
 * - rereg_like_provider: ibv_rereg_mr on cache-backed (exclusive and
 *   shared) and uncached MRs gives the return value, errno and key
 *   behaviour of the real libibverbs (dlopen'd in this process) on the same
 *   device, for every flag combination.
 * - held_large, held_large_root (sub-runs): with an 8 MiB registration held
 *   (larger than a 2 MiB KRCORE_MR_CACHE_BYTES, or with root's 8 MiB
 *   RLIMIT_MEMLOCK and the default budget), 200 reg/dereg pairs of a 1 MiB
 *   buffer are 1 miss + 199 hits: the budget bounds idle regions only.
 * - pinned_limit (a sub-run as user nobody, RLIMIT_MEMLOCK 4 MiB, 1 GiB
 *   budget): idle regions fill the pinnable memory and later registrations
 *   still succeed (the cache drops them and retries); twice the limit fails
 *   with ENOMEM as it would without the library.
 *
 * Sub-runs are this program re-executed (/proc/self/exe --run=NAME) with
 * the variable set; their lines carry a "NAME/" prefix. RLIMIT_MEMLOCK is
 * raised first when allowed (except in held_large_root and pinned_limit).
 * CT_MR_CASE=NAME runs only the stale-memory cases whose name contains
 * NAME (debugging).
 */
#define _GNU_SOURCE
#include "common.h"

#include <inttypes.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <malloc.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/shm.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <dlfcn.h>
#include <grp.h>
#include <unistd.h>

#ifndef HAVE_KRCORE
#error "mr_cache needs include/krcore.h (build with LINK=krcore)"
#endif

/* glibc's own allocator (the tests are built with AddressSanitizer, whose
 * malloc never gives memory back at once): its free() of an mmapped chunk
 * calls munmap inside libc, which no symbol interposition sees. */
extern void *__libc_malloc(size_t size);
extern void __libc_free(void *p);
extern int __libc_mallopt(int param, int value);

#define MiB (1024 * 1024)
#define KiB 1024
#define CHUNK (1 * MiB)		/* largest single RDMA message we post */
#define STALE_LEN (1 * MiB)	/* buffers of the stale-memory cases */
#define MALLOC_LEN (8 * MiB)	/* the glibc malloc case */
#define LOCAL IBV_ACCESS_LOCAL_WRITE
#define REMOTE_RD (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)
#define REMOTE_WR (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)

struct pair {
	struct ibv_cq *cqa, *cqb;
	struct ibv_qp *a, *b;
};

static struct ct_dev dev;
static struct pair P;		/* the main pair: A on GID 1, B on GID 2 */
static struct ct_buf rb;	/* B's receive buffer */
static size_t pg;
static int cache_on;		/* KRCORE_MR_CACHE is not 0 */
static int keep_idle;		/* caching mode (1): regions are reused and
				 * kept idle; hold-only (2) reuses nothing */
static const char *run_name = "";	/* "" for the main run */
static char namebuf[128];

/* ---- small helpers -------------------------------------------------- */

static void begin(const char *name)
{
	snprintf(namebuf, sizeof(namebuf), "%s%s%s", run_name,
		 *run_name ? "/" : "", name);
	ct_begin(namebuf);
}

struct snap {
	unsigned long long v[KRCORE_STAT_COUNT];
};

static void snap(struct snap *s)
{
	for (uint32_t i = 0; i < KRCORE_STAT_COUNT; i++)
		s->v[i] = krcore_stat_get(i);
}

static long long delta(const struct snap *s, enum krcore_stat st)
{
	return (long long)(krcore_stat_get(st) - s->v[st]);
}

static unsigned long long cnt(enum krcore_stat st)
{
	return krcore_stat_get(st);
}

#define HITS KRCORE_STAT_MR_CACHE_HITS
#define MISSES KRCORE_STAT_MR_CACHE_MISSES
#define EVICTIONS KRCORE_STAT_MR_CACHE_EVICTIONS
#define INVALIDATIONS KRCORE_STAT_MR_CACHE_INVALIDATIONS
#define PINNED KRCORE_STAT_MR_CACHE_PINNED_BYTES
#define BATCHES KRCORE_STAT_MR_CACHE_DEREG_BATCHES
#define UNCACHEABLE KRCORE_STAT_MR_CACHE_UNCACHEABLE
#define MODE KRCORE_STAT_MR_CACHE_MODE
#define IDLE KRCORE_STAT_MR_CACHE_IDLE_BYTES
#define RETRIES KRCORE_STAT_MR_CACHE_LIMIT_RETRIES
#define PENDING KRCORE_STAT_MR_CACHE_DEREG_PENDING
#define BACKGROUND KRCORE_STAT_MR_CACHE_DEREG_BACKGROUND
#define INLINE KRCORE_STAT_MR_CACHE_DEREG_INLINE

/* Counter `st` moved by `op want` since `s`. */
#define CHECK_DELTA(s, st, op, want)                                          \
	do {                                                                  \
		long long d_ = delta((s), (st));                              \
		long long w_ = (want);                                        \
		if (!(d_ op w_))                                              \
			ct_fail_at(__FILE__, __LINE__,                        \
				   "krcore counter %s moved by %lld, "        \
				   "expected %s %lld", krcore_stat_name(st),  \
				   d_, #op, w_);                              \
	} while (0)

static void check_mr(const struct ibv_mr *mr, struct ibv_pd *pd,
		     const void *addr, size_t len)
{
	CT_CHECK(mr->addr == addr && mr->length == len,
		 "MR addr/length %p/%zu, expected %p/%zu", mr->addr,
		 mr->length, addr, len);
	CT_CHECK(mr->pd == pd, "mr->pd %p is not the PD passed in (%p)",
		 (void *)mr->pd, (void *)pd);
	CT_CHECK(mr->context == pd->context, "mr->context %p != %p",
		 (void *)mr->context, (void *)pd->context);
}

static struct ibv_mr *reg(struct ibv_pd *pd, void *p, size_t len, int access)
{
	struct ibv_mr *mr = CT_PTR(ibv_reg_mr(pd, p, len, access));

	check_mr(mr, pd, p, len);
	return mr;
}

static void dereg(struct ibv_mr *mr)
{
	CT_OK(ibv_dereg_mr(mr));
}

static uint8_t *map_anon(size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	CT_CHECK(p != MAP_FAILED, "mmap(%zu): %s", len, strerror(errno));
	return p;
}

static void unmap(void *p, size_t len)
{
	CT_CHECK(munmap(p, len) == 0, "munmap: %s", strerror(errno));
}

static void pair_open(struct ct_dev *d, struct pair *p)
{
	p->cqa = CT_PTR(ibv_create_cq(d->ctx, 64, NULL, NULL, 0));
	p->cqb = CT_PTR(ibv_create_cq(d->ctx, 64, NULL, NULL, 0));
	p->a = ct_create_rc_qp(d, p->cqa, p->cqa, NULL, CT_QP_CAPS_DEFAULT);
	p->b = ct_create_rc_qp(d, p->cqb, p->cqb, NULL, CT_QP_CAPS_DEFAULT);
	ct_connect_pair(d, p->a, p->b);
}

static void pair_close(struct pair *p)
{
	CT_OK(ibv_destroy_qp(p->a));
	CT_OK(ibv_destroy_qp(p->b));
	CT_OK(ibv_destroy_cq(p->cqa));
	CT_OK(ibv_destroy_cq(p->cqb));
	memset(p, 0, sizeof(*p));
}

/*
 * RDMA `op` of len bytes in CHUNK pieces on `qp` (completions on `cq`):
 * local side (mr, laddr), remote side (raddr, rkey).
 */
static void rdma(struct ibv_qp *qp, struct ibv_cq *cq, enum ibv_wr_opcode op,
		 struct ibv_mr *mr, void *laddr, uint64_t raddr, uint32_t rkey,
		 size_t len, const char *what)
{
	struct ct_buf lb = { .p = laddr, .len = len, .mr = mr };
	struct ibv_wc wc[64];
	int n = 0;

	CT_CHECK(len > 0 && (len + CHUNK - 1) / CHUNK <= 32, "length %zu",
		 len);
	for (size_t off = 0; off < len; off += CHUNK, n++) {
		uint32_t c = (uint32_t)(len - off < CHUNK ? len - off : CHUNK);

		CT_OK(ct_post_send1(qp, (uint64_t)n, op, IBV_SEND_SIGNALED,
				    &lb, off, c, raddr + off, rkey, 0));
	}
	ct_poll_n(cq, wc, n, CT_TIMEOUT_MS);
	for (int i = 0; i < n; i++)
		ct_expect_wc(&wc[i], (uint64_t)i,
			     op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ :
						      IBV_WC_RDMA_WRITE,
			     what);
}

/* WRITE from (mr, p) on QP A into rb (cleared first). */
static void write_to_rb(struct ibv_mr *mr, void *p, size_t len,
			const char *what)
{
	CT_CHECK(len <= rb.len, "%zu > receive buffer", len);
	memset(rb.p, 0, len);
	rdma(P.a, P.cqa, IBV_WR_RDMA_WRITE, mr, p, (uintptr_t)rb.p,
	     rb.mr->rkey, len, what);
}

/* QP B READs (p, len) through mr's rkey into rb (cleared first). */
static void read_into_rb(struct ibv_mr *mr, void *p, size_t len,
			 const char *what)
{
	CT_CHECK(len <= rb.len, "%zu > receive buffer", len);
	memset(rb.p, 0, len);
	rdma(P.b, P.cqb, IBV_WR_RDMA_READ, rb.mr, rb.p, (uintptr_t)p,
	     mr->rkey, len, what);
}

/*
 * rb must hold `want` (len bytes). `old`, when given, is what the memory
 * held before it was replaced: a byte equal to it is reported as the
 * library having used a stale registration.
 */
static void expect_rb(const uint8_t *want, const uint8_t *old, size_t len,
		      const char *what)
{
	if (!memcmp(rb.p, want, len))
		return;
	for (size_t i = 0; i < len; i++) {
		if (rb.p[i] == want[i])
			continue;
		if (old && rb.p[i] == old[i]) {
			size_t n = 0;

			for (size_t j = i; j < len; j++)
				n += rb.p[j] == old[j];
			CT_FAIL("%s: STALE REGISTRATION: byte %zu is 0x%02x, "
				"the OLD content (%zu of %zu bytes are old; "
				"NEW byte would be 0x%02x): the library "
				"handed out a registration of the replaced "
				"pages", what, i, rb.p[i], n, len - i,
				want[i]);
		}
		CT_FAIL("%s: byte %zu of %zu is 0x%02x, expected 0x%02x",
			what, i, len, rb.p[i], want[i]);
	}
}

static void fill(uint8_t *p, size_t len, uint32_t seed)
{
	ct_fill(p, len, seed);
}

/* The complement of old: every byte differs. */
static void fill_new(uint8_t *p, const uint8_t *old, size_t len)
{
	for (size_t i = 0; i < len; i++)
		p[i] = (uint8_t)~old[i];
}

/* ---- setup ---------------------------------------------------------- */

static void raise_memlock(void)
{
	struct rlimit r = { RLIM_INFINITY, RLIM_INFINITY };

	/* Before the first verbs call: the cache sizes itself then. */
	if (setrlimit(RLIMIT_MEMLOCK, &r) != 0 && !*run_name)
		printf("NOTE setup: cannot raise RLIMIT_MEMLOCK (%s): the "
		       "cache keeps at most half of it\n", strerror(errno));
}

static void setup(size_t rb_len)
{
	begin("setup");
	pg = (size_t)sysconf(_SC_PAGESIZE);
	ct_open(&dev);
	pair_open(&dev, &P);
	ct_buf_alloc(&rb, dev.pd, rb_len);
	if (keep_idle) {
		/* The first registration started the cache. */
		CT_CHECK(cnt(MODE) == 1,
			 "MR cache mode %llu, expected 1 (caching with a "
			 "userfaultfd monitor; 2 = hold-only fallback: is "
			 "userfaultfd available?)", cnt(MODE));
	} else if (cache_on) {
		CT_CHECK(cnt(MODE) == 2, "MR cache mode %llu without "
			 "userfaultfd, expected 2 (hold-only)", cnt(MODE));
	} else {
		CT_CHECK(cnt(MODE) == 0, "mode %llu with KRCORE_MR_CACHE=0",
			 cnt(MODE));
		CT_CHECK(cnt(MISSES) == 0 && cnt(HITS) == 0,
			 "cache used although off");
	}
	ct_pass();
}

static void teardown(void)
{
	begin("teardown");
	ct_buf_free(&rb);
	pair_close(&P);
	ct_close(&dev);
	if (cache_on)
		CT_CHECK(cnt(PINNED) == 0, "%llu bytes still pinned by the "
			 "cache after the last PD was deallocated",
			 cnt(PINNED));
	ct_pass();
}

/* ---- hits ----------------------------------------------------------- */

static void test_hits(void)
{
	size_t len = 256 * KiB;
	uint8_t *buf = map_anon(len);
	struct ibv_mr *mr;
	uint32_t lkey = 0, rkey = 0;
	struct snap s;

	begin("hits");
	fill(buf, len, 11);
	snap(&s);
	for (int i = 0; i < 100; i++) {
		mr = reg(dev.pd, buf, len, CT_ACCESS_ALL);
		if (i == 0) {
			lkey = mr->lkey;
			rkey = mr->rkey;
		} else if (keep_idle) {
			CT_CHECK(mr->lkey == lkey && mr->rkey == rkey,
				 "iteration %d: keys %#x/%#x, the cached "
				 "region has %#x/%#x", i, mr->lkey, mr->rkey,
				 lkey, rkey);
		}
		if (i == 99) {
			write_to_rb(mr, buf, len, "WRITE from the 100th MR");
			expect_rb(buf, NULL, len, "WRITE from the 100th MR");
			read_into_rb(mr, buf, len, "READ via the 100th MR");
			expect_rb(buf, NULL, len, "READ via the 100th MR");
		}
		dereg(mr);
	}
	if (keep_idle) {
		CHECK_DELTA(&s, HITS, >=, 99);
		CHECK_DELTA(&s, MISSES, <=, 1);
	} else {
		/* Hold-only: nothing stays registered once released. */
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, cache_on ? 100 : 0);
	}
	/* Two holders of the same buffer: in caching mode both are served by
	 * the idle region; in hold-only mode each is a registration of its
	 * own, even while the other one is held. */
	snap(&s);
	{
		struct ibv_mr *m1 = reg(dev.pd, buf, len, CT_ACCESS_ALL);
		struct ibv_mr *m2 = reg(dev.pd, buf, len, CT_ACCESS_ALL);

		CT_CHECK(m1 != m2, "the same ibv_mr handed out twice");
		if (keep_idle) {
			CHECK_DELTA(&s, HITS, ==, 2);
			CHECK_DELTA(&s, MISSES, ==, 0);
			CT_CHECK(m1->lkey == m2->lkey && m1->rkey == m2->rkey,
				 "held region not shared");
		} else if (cache_on) {
			CHECK_DELTA(&s, HITS, ==, 0);
			CHECK_DELTA(&s, MISSES, ==, 2);
			CT_CHECK(m1->lkey != m2->lkey && m1->rkey != m2->rkey,
				 "hold-only mode shared a held registration "
				 "(keys %#x/%#x)", m1->lkey, m1->rkey);
		}
		dereg(m1);
		write_to_rb(m2, buf, len, "WRITE after the other holder's "
			    "ibv_dereg_mr");
		expect_rb(buf, NULL, len, "WRITE after the other holder's "
			  "ibv_dereg_mr");
		dereg(m2);
	}
	ct_pass();
	unmap(buf, len);
}

static void test_subranges(void)
{
	size_t len = 64 * pg;
	uint8_t *buf = map_anon(len);
	uint8_t *sub = buf + 4 * pg;
	size_t sub_len = 8 * pg;
	struct ibv_mr *full, *part, *part2;
	struct pair tmp;
	struct snap s;

	begin("subrange_local_hits");
	fill(buf, len, 21);
	snap(&s);
	full = reg(dev.pd, buf, len, LOCAL);
	part = reg(dev.pd, sub, sub_len, LOCAL);
	if (keep_idle) {
		CHECK_DELTA(&s, MISSES, ==, 1);
		CHECK_DELTA(&s, HITS, ==, 1);
		CT_CHECK(part->lkey == full->lkey, "covered local request "
			 "got lkey %#x, the covering region has %#x",
			 part->lkey, full->lkey);
	} else if (cache_on) {
		/* Hold-only: the held covering region is not reused. */
		CHECK_DELTA(&s, MISSES, ==, 2);
		CHECK_DELTA(&s, HITS, ==, 0);
		CT_CHECK(part->lkey != full->lkey, "hold-only mode served a "
			 "sub-range from the held covering region");
	}
	write_to_rb(part, sub, sub_len, "WRITE from the sub-range MR");
	expect_rb(sub, NULL, sub_len, "WRITE from the sub-range MR");
	dereg(part);
	dereg(full);
	/* Caching: the covering region is idle now and still serves the
	 * sub-range. Hold-only: it is gone, a new registration. */
	snap(&s);
	part = reg(dev.pd, sub + pg, sub_len - 2 * pg, LOCAL);
	if (keep_idle) {
		CHECK_DELTA(&s, HITS, ==, 1);
		CHECK_DELTA(&s, MISSES, ==, 0);
	} else if (cache_on) {
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 1);
	}
	write_to_rb(part, sub + pg, sub_len - 2 * pg, "idle covering region");
	expect_rb(sub + pg, NULL, sub_len - 2 * pg, "idle covering region");
	dereg(part);
	ct_pass();

	begin("subrange_remote_exact_only");
	snap(&s);
	full = reg(dev.pd, buf, len, REMOTE_WR);
	part = reg(dev.pd, sub, sub_len, REMOTE_WR);
	if (cache_on) {
		CHECK_DELTA(&s, MISSES, ==, 2);
		CHECK_DELTA(&s, HITS, ==, 0);
	}
	CT_CHECK(part->rkey != full->rkey, "REMOTE_WRITE sub-range shares "
		 "rkey %#x with the whole buffer", part->rkey);
	/* Inside the sub-range the peer may write... */
	fill(rb.p, sub_len, 22);
	rdma(P.b, P.cqb, IBV_WR_RDMA_WRITE, rb.mr, rb.p, (uintptr_t)sub,
	     part->rkey, sub_len, "peer WRITE inside the sub-range");
	ct_expect_pattern(sub, sub_len, 22, "sub-range after the peer WRITE");
	/* ... one byte before it, it may not (a fresh pair: this one breaks). */
	fill(buf, 4 * pg, 23);
	pair_open(&dev, &tmp);
	{
		struct ct_buf lb = { .p = rb.p, .len = rb.len, .mr = rb.mr };
		struct ibv_wc wc;

		CT_OK(ct_post_send1(tmp.b, 7, IBV_WR_RDMA_WRITE,
				    IBV_SEND_SIGNALED, &lb, 0, 64,
				    (uintptr_t)sub - 32, part->rkey, 0));
		wc = ct_poll1(tmp.cqb);
		CT_CHECK(wc.wr_id == 7 && wc.status == IBV_WC_REM_ACCESS_ERR,
			 "peer WRITE across the sub-range start with its rkey:"
			 " wr_id %" PRIu64 " status %s, expected "
			 "REM_ACCESS_ERR", wc.wr_id,
			 ibv_wc_status_str(wc.status));
	}
	pair_close(&tmp);
	ct_expect_pattern(buf, 4 * pg, 23, "memory before the sub-range");
	/* The exact range again (still held): a hit in caching mode, a
	 * registration of its own in hold-only mode. */
	snap(&s);
	part2 = reg(dev.pd, sub, sub_len, REMOTE_WR);
	if (keep_idle) {
		CHECK_DELTA(&s, HITS, ==, 1);
		CHECK_DELTA(&s, MISSES, ==, 0);
		CT_CHECK(part2->rkey == part->rkey, "exact REMOTE match got "
			 "another region");
	} else if (cache_on) {
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 1);
		CT_CHECK(part2->rkey != part->rkey, "hold-only mode shared "
			 "the held REMOTE region");
	}
	dereg(part2);
	dereg(part);
	dereg(full);
	ct_pass();

	begin("overlap_registers_separately");
	{
		/* A buffer of its own: nothing cached covers it yet. */
		uint8_t *ob = map_anon(24 * pg);
		uint8_t *lo = ob, *hi = ob + 8 * pg, *mid = ob + 4 * pg;
		struct ibv_mr *a, *b, *c;

		snap(&s);
		a = reg(dev.pd, lo, 16 * pg, LOCAL);	/* pages 0..16 */
		b = reg(dev.pd, hi, 16 * pg, LOCAL);	/* pages 8..24 */
		c = reg(dev.pd, mid, 16 * pg, LOCAL);	/* 4..20: covered by none */
		if (cache_on) {
			CHECK_DELTA(&s, MISSES, ==, 3);
			CHECK_DELTA(&s, HITS, ==, 0);
		}
		fill(ob, 24 * pg, 24);
		write_to_rb(a, lo, 16 * pg, "WRITE lo");
		expect_rb(lo, NULL, 16 * pg, "WRITE lo");
		write_to_rb(b, hi, 16 * pg, "WRITE hi");
		expect_rb(hi, NULL, 16 * pg, "WRITE hi");
		write_to_rb(c, mid, 16 * pg, "WRITE mid");
		expect_rb(mid, NULL, 16 * pg, "WRITE mid");
		dereg(a);
		dereg(b);
		dereg(c);
		snap(&s);
		a = reg(dev.pd, lo, 16 * pg, LOCAL);
		b = reg(dev.pd, hi, 16 * pg, LOCAL);
		if (keep_idle) {
			CHECK_DELTA(&s, HITS, ==, 2);
			CHECK_DELTA(&s, MISSES, ==, 0);
		} else if (cache_on) {
			CHECK_DELTA(&s, HITS, ==, 0);
			CHECK_DELTA(&s, MISSES, ==, 2);
		}
		dereg(a);
		dereg(b);
		unmap(ob, 24 * pg);
	}
	ct_pass();

	begin("iova");
	snap(&s);
	full = CT_PTR(ibv_reg_mr_iova2(dev.pd, buf, len, (uintptr_t)buf,
				       LOCAL));
	check_mr(full, dev.pd, buf, len);
	part = CT_PTR(ibv_reg_mr_iova2(dev.pd, sub, sub_len, 0x10000, LOCAL));
	check_mr(part, dev.pd, sub, sub_len);
	CT_CHECK(part->lkey != full->lkey, "iova != addr shares a region");
	if (keep_idle) {
		/* The whole buffer is still cached (idle) from above. */
		CHECK_DELTA(&s, HITS, ==, 1);
		CHECK_DELTA(&s, MISSES, ==, 0);
	} else if (cache_on) {
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 1);
	}
	dereg(part);
	dereg(full);
	ct_pass();
	unmap(buf, len);
}

/*
 * What a peer can do with an rkey after ibv_dereg_mr. Real verbs revoke
 * it (REM_ACCESS_ERR), and so do the cache off and hold-only mode (the
 * registration is really deregistered); in caching mode the region stays
 * registered while idle, so the old rkey may still work (a NOTE says which
 * happened). The memory must show whichever happened.
 */
static void test_rkey_after_dereg(void)
{
	size_t len = 16 * pg;
	uint8_t *buf = map_anon(len);
	struct ct_buf lb = { .p = rb.p, .len = rb.len, .mr = rb.mr };
	struct ibv_mr *mr;
	struct pair tmp;
	struct ibv_wc wc;
	uint32_t rkey;

	begin("rkey_after_dereg");
	mr = reg(dev.pd, buf, len, REMOTE_WR);
	rkey = mr->rkey;
	dereg(mr);
	fill(rb.p, len, 71);
	pair_open(&dev, &tmp);
	CT_OK(ct_post_send1(tmp.b, 9, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED,
			    &lb, 0, (uint32_t)len, (uintptr_t)buf, rkey, 0));
	wc = ct_poll1(tmp.cqb);
	CT_CHECK(wc.wr_id == 9, "wr_id %" PRIu64, wc.wr_id);
	if (wc.status == IBV_WC_SUCCESS) {
		CT_CHECK(keep_idle, "the rkey of a deregistered MR still works "
			 "%s", cache_on ? "in hold-only mode" :
			 "with the cache off");
		ct_expect_pattern(buf, len, 71, "memory written through the "
				  "old rkey");
		ct_note("the peer still wrote through the rkey after "
			"ibv_dereg_mr (the region is idle in the cache, not "
			"deregistered)");
	} else {
		CT_CHECK(wc.status == IBV_WC_REM_ACCESS_ERR, "status %s",
			 ibv_wc_status_str(wc.status));
		ct_expect_zero(buf, len, "memory after a refused WRITE");
		if (keep_idle)
			ct_note("the old rkey was refused after ibv_dereg_mr");
	}
	pair_close(&tmp);
	unmap(buf, len);
	ct_pass();
}

/* ---- stale memory --------------------------------------------------- */

struct stale_case {
	const char *name;
	size_t len;
	/* New memory of len bytes. */
	uint8_t *(*alloc)(size_t len);
	/* Gives p's range new physical pages, ideally at p; returns where. */
	uint8_t *(*replace)(uint8_t *p, size_t len);
	void (*release)(uint8_t *p, size_t len);
	int hooked;	/* the change goes through an interposed libc call */
};

/* brk: grow the break by len (page aligned), shrink it, grow it again. */
static uint8_t *brk_start;
static size_t brk_pad;

static uint8_t *brk_alloc(size_t len)
{
	uint8_t *cur = sbrk(0);

	brk_pad = (pg - (uintptr_t)cur % pg) % pg;
	CT_CHECK(sbrk((intptr_t)(brk_pad + len)) == cur, "sbrk(+%zu): %s",
		 brk_pad + len, strerror(errno));
	brk_start = cur + brk_pad;
	return brk_start;
}

static uint8_t *brk_replace(uint8_t *p, size_t len)
{
	CT_CHECK((uint8_t *)sbrk(0) == p + len, "someone else moved the "
		 "program break");
	CT_CHECK(sbrk(-(intptr_t)len) != (void *)-1, "sbrk(-%zu): %s", len,
		 strerror(errno));
	CT_CHECK(sbrk((intptr_t)len) == p, "sbrk(+%zu) did not come back "
		 "at %p", len, (void *)p);
	return p;
}

static void brk_release(uint8_t *p, size_t len)
{
	CT_CHECK((uint8_t *)sbrk(0) == p + len, "program break moved");
	CT_CHECK(sbrk(-(intptr_t)(len + brk_pad)) != (void *)-1, "sbrk: %s",
		 strerror(errno));
}

/* munmap, then a new mapping at the same address (MAP_FIXED_NOREPLACE:
 * the munmap alone must have invalidated the region). */
static uint8_t *munmap_replace(uint8_t *p, size_t len)
{
	void *q;

	unmap(p, len);
	q = mmap(p, len, PROT_READ | PROT_WRITE,
		 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	CT_CHECK(q != MAP_FAILED, "mmap at %p after munmap: %s", (void *)p,
		 strerror(errno));
	return q;
}

/* mmap(MAP_FIXED) straight over the live mapping. */
static uint8_t *mapfixed_replace(uint8_t *p, size_t len)
{
	void *q = mmap(p, len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);

	CT_CHECK(q == p, "mmap(MAP_FIXED) over %p: %s", (void *)p,
		 strerror(errno));
	return q;
}

/* mremap the pages away (MREMAP_FIXED to a reserved range), then map new
 * memory at the old address with MAP_FIXED_NOREPLACE. */
static uint8_t *mremap_replace(uint8_t *p, size_t len)
{
	uint8_t *to = mmap(NULL, len, PROT_NONE,
			   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	uint8_t *moved, first;
	void *q;

	CT_CHECK(to != MAP_FAILED, "mmap: %s", strerror(errno));
	first = p[0];
	moved = mremap(p, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, to);
	CT_CHECK(moved == to, "mremap to %p: %p (%s)", (void *)to,
		 (void *)moved, strerror(errno));
	CT_CHECK(moved[0] == first, "mremap did not move the pages");
	q = mmap(p, len, PROT_READ | PROT_WRITE,
		 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	CT_CHECK(q != MAP_FAILED, "mmap at %p after mremap: %s", (void *)p,
		 strerror(errno));
	unmap(moved, len);
	return q;
}

/* madvise(MADV_DONTNEED): private anonymous memory reads back as zeros,
 * and the next write faults in new pages. */
static uint8_t *dontneed_replace(uint8_t *p, size_t len)
{
	CT_CHECK(madvise(p, len, MADV_DONTNEED) == 0, "madvise: %s",
		 strerror(errno));
	ct_expect_zero(p, pg, "first page after MADV_DONTNEED");
	return p;
}

/* System V shared memory: shmdt, then a new segment attached at the same
 * address. Segments are marked for removal at once (gone at detach). */
static uint8_t *shm_attach(size_t len, void *at)
{
	int id = shmget(IPC_PRIVATE, len, IPC_CREAT | 0600);
	void *p;

	CT_CHECK(id >= 0, "shmget(%zu): %s", len, strerror(errno));
	p = shmat(id, at, 0);
	CT_CHECK(p != (void *)-1, "shmat(%p): %s", at, strerror(errno));
	CT_CHECK(shmctl(id, IPC_RMID, NULL) == 0, "shmctl: %s",
		 strerror(errno));
	return p;
}

static uint8_t *shm_alloc(size_t len)
{
	return shm_attach(len, NULL);
}

static uint8_t *shm_replace(uint8_t *p, size_t len)
{
	CT_CHECK(shmdt(p) == 0, "shmdt: %s", strerror(errno));
	return shm_attach(len, p);
}

static void shm_release(uint8_t *p, size_t len)
{
	(void)len;
	CT_CHECK(shmdt(p) == 0, "shmdt: %s", strerror(errno));
}

/* glibc malloc of a block above the (fixed) mmap threshold, free(), malloc
 * of the same size: free() unmaps inside libc. */
static uint8_t *malloc_alloc(size_t len)
{
	uint8_t *p = __libc_malloc(len);

	CT_CHECK(p != NULL, "malloc(%zu)", len);
	return p;
}

static uint8_t *malloc_replace(uint8_t *p, size_t len)
{
	uint8_t *q;

	__libc_free(p);
	q = __libc_malloc(len);
	CT_CHECK(q != NULL, "malloc(%zu)", len);
	if (q != p)
		ct_note("malloc after free returned %p, not %p: no address "
			"reuse to catch (data still checked)", (void *)q,
			(void *)p);
	return q;
}

static void malloc_release(uint8_t *p, size_t len)
{
	(void)len;
	__libc_free(p);
}

static void anon_release(uint8_t *p, size_t len)
{
	unmap(p, len);
}

/*
 * One stale-memory case. L (local, lkey used by QP A's WRITE) and R
 * (remote read, rkey used by QP B's READ) are registered, used and
 * deregistered (idle in the cache; a re-registration hits); a control MR
 * W (another access set, so another region) stays held. The pages are
 * replaced and NEW bytes written; L2 and R2 registered at the same address
 * must move the NEW bytes, while W (a registration of the old pages, what
 * a stale cache entry is) moves the OLD ones.
 */
static void stale(const struct stale_case *c)
{
	size_t len = c->len;
	uint8_t *p, *q, *old = malloc(len);
	struct ibv_mr *l, *r, *w;
	struct snap s, s2;
	long long pinned;
	int watched;
	char what[96];

	CT_CHECK(old != NULL, "malloc");
	snprintf(what, sizeof(what), "stale_%s", c->name);
	begin(what);
	p = c->alloc(len);
	fill(p, len, 100 + (uint32_t)len);
	memcpy(old, p, len);

	snap(&s);
	l = reg(dev.pd, p, len, LOCAL);
	r = reg(dev.pd, p, len, REMOTE_RD);
	write_to_rb(l, p, len, "WRITE before the change");
	expect_rb(old, NULL, len, "WRITE before the change");
	read_into_rb(r, p, len, "READ before the change");
	expect_rb(old, NULL, len, "READ before the change");
	w = reg(dev.pd, p, len, REMOTE_WR);
	pinned = (long long)cnt(PINNED);
	dereg(l);
	dereg(r);
	watched = delta(&s, UNCACHEABLE) == 0;
	if (cache_on)
		CHECK_DELTA(&s, MISSES, ==, 3);
	if (keep_idle) {
		if (!watched) {
			ct_note("memory not watchable by userfaultfd: kept "
				"only while held (UNCACHEABLE +%lld)",
				delta(&s, UNCACHEABLE));
		} else {
			/* Precondition: the idle regions are cached, a new
			 * registration of the unchanged memory hits. */
			CT_CHECK((long long)cnt(PINNED) == pinned,
				 "idle regions not kept (pinned %llu, %lld "
				 "while held): is RLIMIT_MEMLOCK too small?",
				 cnt(PINNED), pinned);
			snap(&s2);
			l = reg(dev.pd, p, len, LOCAL);
			dereg(l);
			CHECK_DELTA(&s2, HITS, ==, 1);
		}
	}

	snap(&s);
	q = c->replace(p, len);
	fill_new(q, old, len);
	l = reg(dev.pd, q, len, LOCAL);
	r = reg(dev.pd, q, len, REMOTE_RD);
	/* The data first: that is what a stale registration gets wrong. */
	write_to_rb(l, q, len, "WRITE after the change");
	expect_rb(q, old, len, "WRITE after the change");
	read_into_rb(r, q, len, "READ after the change");
	expect_rb(q, old, len, "READ after the change");
	if (cache_on && q == p) {
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 2);
		/* L, R (idle, unless unwatchable or hold-only: then already
		 * gone) and W (held; without userfaultfd only the hooks see
		 * the change). */
		CHECK_DELTA(&s, INVALIDATIONS, >=,
			    keep_idle && watched ? 3 :
			    keep_idle || c->hooked ? 1 : 0);
	}
	if (q == p) {
		/* Control: the registration held across the change still
		 * maps the old pages. This is what the checks above would
		 * have seen from a stale cached registration. */
		write_to_rb(w, q, len, "control WRITE");
		if (memcmp(rb.p, old, len))
			CT_FAIL("control: a registration held across the "
				"change does not move the old pages, so this "
				"test could not see a stale registration");
	}
	dereg(w);
	dereg(l);
	dereg(r);
	if (cache_on && q == p)
		ct_note("invalidations +%lld", delta(&s, INVALIDATIONS));
	c->release(q, len);
	free(old);
	ct_pass();
}

/*
 * The registration of the old pages is HELD across the change, with the
 * same access flags as the new one: a held region must not be handed out
 * for the new pages either. In caching mode it is invalidated while held
 * (the hooks or the userfaultfd saw the change) and deregistered at its
 * last release; in hold-only mode nothing is ever reused, so the new
 * registration is a real one even when no hook saw the change (glibc
 * free()).
 */
static void stale_held(const struct stale_case *c)
{
	size_t len = c->len;
	uint8_t *p, *q, *old = malloc(len);
	struct ibv_mr *w, *l;
	struct snap s;
	char what[96];

	CT_CHECK(old != NULL, "malloc");
	snprintf(what, sizeof(what), "stale_held_%s", c->name);
	begin(what);
	p = c->alloc(len);
	fill(p, len, 200 + (uint32_t)len);
	memcpy(old, p, len);
	w = reg(dev.pd, p, len, LOCAL);
	write_to_rb(w, p, len, "WRITE before the change");
	expect_rb(old, NULL, len, "WRITE before the change");
	snap(&s);
	q = c->replace(p, len);
	fill_new(q, old, len);
	l = reg(dev.pd, q, len, LOCAL);
	write_to_rb(l, q, len, "WRITE after the change");
	expect_rb(q, old, len, "WRITE after the change");
	if (cache_on && q == p) {
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 1);
		/* W, held: invalidated in caching mode; in hold-only mode
		 * only when a hook saw the change. */
		CHECK_DELTA(&s, INVALIDATIONS, >=,
			    keep_idle || c->hooked ? 1 : 0);
	}
	if (q == p) {
		write_to_rb(w, q, len, "control WRITE");
		if (memcmp(rb.p, old, len))
			CT_FAIL("control: the held registration does not move "
				"the old pages");
	}
	dereg(l);
	dereg(w);
	c->release(q, len);
	free(old);
	ct_pass();
}

static void test_stale(void)
{
	static const struct stale_case cases[] = {
		{ "brk", STALE_LEN, brk_alloc, brk_replace, brk_release, 1 },
		{ "munmap_mmap", STALE_LEN, map_anon, munmap_replace,
		  anon_release, 1 },
		{ "mmap_fixed", STALE_LEN, map_anon, mapfixed_replace,
		  anon_release, 1 },
		{ "mremap", STALE_LEN, map_anon, mremap_replace,
		  anon_release, 1 },
		{ "madv_dontneed", STALE_LEN, map_anon, dontneed_replace,
		  anon_release, 1 },
		{ "shmdt", STALE_LEN, shm_alloc, shm_replace, shm_release, 1 },
		/* free() unmaps inside glibc: no hook sees it. */
		{ "malloc_free", MALLOC_LEN, malloc_alloc, malloc_replace,
		  malloc_release, 0 },
	};
	const char *only = getenv("CT_MR_CASE");	/* debugging: one case */

	/* A fixed threshold: glibc would otherwise raise it to the size of
	 * the freed block and serve the next malloc from the heap. */
	CT_CHECK(__libc_mallopt(M_MMAP_THRESHOLD, 256 * KiB) == 1,
		 "mallopt(M_MMAP_THRESHOLD)");
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		if (!only || strstr(cases[i].name, only))
			stale(&cases[i]);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		if (!only || strstr(cases[i].name, only))
			stale_held(&cases[i]);
}

/* ---- fork ----------------------------------------------------------- */

static void test_fork(void)
{
	size_t len = 64 * KiB;
	uint8_t *f = map_anon(len), *g = map_anon(len);
	struct ibv_mr *held, *mg;
	uint32_t held_lkey, g_lkey;
	struct snap s;
	pid_t pid;
	int st;

	begin("fork");
	fill(f, len, 31);
	fill(g, len, 32);
	held = reg(dev.pd, f, len, CT_ACCESS_ALL);
	write_to_rb(held, f, len, "parent WRITE before fork");
	expect_rb(f, NULL, len, "parent WRITE before fork");
	mg = reg(dev.pd, g, len, CT_ACCESS_ALL);
	g_lkey = mg->lkey;
	dereg(mg);		/* idle in the cache */
	held_lkey = held->lkey;
	fflush(stdout);
	pid = fork();
	CT_CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		struct ibv_mr *cf, *cg;

		begin("fork/child");
		snap(&s);
		cf = reg(dev.pd, f, len, CT_ACCESS_ALL);
		cg = reg(dev.pd, g, len, CT_ACCESS_ALL);
		CT_CHECK(cf->lkey != held_lkey, "the child got the parent's "
			 "held registration (lkey %#x)", cf->lkey);
		CT_CHECK(cg->lkey != g_lkey, "the child got the parent's "
			 "idle cached registration (lkey %#x)", cg->lkey);
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 0);
		if (cache_on)
			CT_CHECK(cnt(MODE) == 3, "mode %llu in a forked "
				 "child, expected 3", cnt(MODE));
		dereg(cf);
		dereg(cg);
		ct_pass();
		_exit(0);
	}
	CT_CHECK(waitpid(pid, &st, 0) == pid, "waitpid: %s", strerror(errno));
	CT_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %#x",
		 st);
	if (cache_on)
		CT_CHECK(cnt(MODE) == (keep_idle ? 1u : 2u), "parent mode %llu "
			 "after fork", cnt(MODE));
	/* The parent's held registration still moves its current bytes. */
	fill(f, len, 33);
	write_to_rb(held, f, len, "parent WRITE after fork (held MR)");
	expect_rb(f, NULL, len, "parent WRITE after fork (held MR)");
	/* The idle one still maps the parent's pages (the kernel copied them
	 * for the child at fork, since they are pinned). */
	fill(g, len, 34);
	snap(&s);
	mg = reg(dev.pd, g, len, CT_ACCESS_ALL);
	if (keep_idle) {
		CHECK_DELTA(&s, HITS, ==, 1);
		CT_CHECK(mg->lkey == g_lkey, "idle region not reused");
	} else if (cache_on) {
		CHECK_DELTA(&s, HITS, ==, 0);
		CHECK_DELTA(&s, MISSES, ==, 1);
	}
	write_to_rb(mg, g, len, "parent WRITE after fork (idle MR)");
	expect_rb(g, NULL, len, "parent WRITE after fork (idle MR)");
	read_into_rb(mg, g, len, "peer READ after fork (idle MR)");
	expect_rb(g, NULL, len, "peer READ after fork (idle MR)");
	dereg(mg);
	dereg(held);
	unmap(f, len);
	unmap(g, len);
	ct_pass();
}

/* ---- ibv_dealloc_pd ------------------------------------------------- */

static void test_dealloc_pd(void)
{
	size_t len = 128 * KiB, half = len / 2;
	uint8_t *buf = map_anon(len);
	struct ibv_pd *pd;
	struct ibv_mr *mr, *held, *rx;
	struct ct_dev d2;
	struct pair p2;
	long long pinned0;

	begin("dealloc_pd_flushes_idle");
	pd = CT_PTR(ibv_alloc_pd(dev.ctx));
	/* The first cache operation also applies pending invalidations
	 * (earlier tests unmapped their buffers): measure after it. */
	dereg(reg(pd, buf, len, CT_ACCESS_ALL));
	pinned0 = (long long)cnt(PINNED) - (keep_idle ? (long long)len : 0);
	for (int i = 0; i < 2; i++)
		dereg(reg(pd, buf, len, CT_ACCESS_ALL));
	dereg(reg(pd, buf, half, LOCAL));
	if (keep_idle)
		CT_CHECK((long long)cnt(PINNED) == pinned0 + (long long)(len + half),
			 "pinned %llu, expected %lld (two idle regions)",
			 cnt(PINNED), pinned0 + (long long)(len + half));
	CT_OK(ibv_dealloc_pd(pd));
	CT_CHECK((long long)cnt(PINNED) == pinned0, "pinned %llu after "
		 "ibv_dealloc_pd, expected %lld", cnt(PINNED), pinned0);
	ct_pass();

	begin("dealloc_pd_busy");
	pd = CT_PTR(ibv_alloc_pd(dev.ctx));
	held = reg(pd, buf, half, CT_ACCESS_ALL);
	dereg(reg(pd, buf + half, half, CT_ACCESS_ALL));	/* idle */
	errno = 0;
	{
		int rc = ibv_dealloc_pd(pd);

		CT_CHECK(rc == EBUSY, "ibv_dealloc_pd with an MR held "
			 "returned %d (%s), expected EBUSY", rc, strerror(rc));
	}
	/* The PD and the held MR still work: a pair on this PD moves data
	 * from the held MR to a new one. */
	d2 = dev;
	d2.pd = pd;
	pair_open(&d2, &p2);
	rx = reg(pd, buf + half, half, CT_ACCESS_ALL);
	fill(buf, half, 41);
	memset(buf + half, 0, half);
	{
		struct ct_buf lb = { .p = buf, .len = half, .mr = held };
		struct ibv_wc wc;

		CT_OK(ct_post_send1(p2.a, 1, IBV_WR_RDMA_WRITE,
				    IBV_SEND_SIGNALED, &lb, 0, (uint32_t)half,
				    (uintptr_t)(buf + half), rx->rkey, 0));
		wc = ct_poll1(p2.cqa);
		ct_expect_wc(&wc, 1, IBV_WC_RDMA_WRITE, "WRITE on the PD");
	}
	ct_expect_pattern(buf + half, half, 41, "data after EBUSY");
	pair_close(&p2);
	mr = rx;
	dereg(mr);
	dereg(held);
	CT_OK(ibv_dealloc_pd(pd));
	CT_CHECK((long long)cnt(PINNED) == pinned0, "pinned %llu, expected "
		 "%lld", cnt(PINNED), pinned0);
	unmap(buf, len);
	ct_pass();
}

/* ---- eviction (a sub-run) ------------------------------------------- */

static size_t env_size(const char *name, size_t def)
{
	const char *v = getenv(name);

	return v && *v ? strtoull(v, NULL, 10) : def;
}

static void test_evict(void)
{
	enum { N = 16 };
	size_t len = 64 * KiB;
	size_t max_entries = env_size("KRCORE_MR_CACHE_ENTRIES", 1024);
	size_t max_bytes = env_size("KRCORE_MR_CACHE_BYTES", (size_t)1 << 30);
	/* Evicted regions still registered: a batch being deregistered and
	 * one queued, however late the thread runs (the caller deregisters
	 * the rest). */
	size_t batch = env_size("KRCORE_MR_DEREG_BATCH", 16);
	/* Idle regions the limits allow (rb is held: it does not count). */
	size_t kept = max_entries;
	uint8_t *buf[N];
	struct ibv_mr *mr;
	struct snap s;
	long long pinned_max = 0;

	if (max_bytes / len < kept)
		kept = max_bytes / len;
	begin("evict");
	CT_CHECK(kept < N, "limits too large for this test");
	snap(&s);
	for (int i = 0; i < N; i++) {
		long long pinned;

		buf[i] = map_anon(len);
		fill(buf[i], len, 50 + (uint32_t)i);
		mr = reg(dev.pd, buf[i], len, CT_ACCESS_ALL);
		write_to_rb(mr, buf[i], len, "WRITE");
		expect_rb(buf[i], NULL, len, "WRITE");
		dereg(mr);
		/* The cache's regions plus evicted ones not yet deregistered. */
		pinned = (long long)(cnt(PINNED) + cnt(PENDING) * len);
		if (pinned > pinned_max)
			pinned_max = pinned;
		CT_CHECK(pinned <= (long long)(rb.len + (kept + 2 * batch) * len),
			 "after %d registrations %lld bytes pinned, limit "
			 "%zu + %zu idle and 2 x %zu pending regions of %zu",
			 i + 1, pinned, rb.len, kept, batch, len);
		CT_CHECK(cnt(IDLE) <= max_bytes, "%llu idle bytes > "
			 "KRCORE_MR_CACHE_BYTES %zu", cnt(IDLE), max_bytes);
	}
	CHECK_DELTA(&s, MISSES, ==, N);
	CHECK_DELTA(&s, EVICTIONS, >=, (long long)(N - kept));
	CHECK_DELTA(&s, BATCHES, >=, 1);
	CT_CHECK(delta(&s, BATCHES) <= delta(&s, EVICTIONS), "more batches "
		 "than evictions");
	if (batch == 0) {
		CT_CHECK(cnt(PENDING) == 0, "deregistration inline, yet %llu "
			 "queued", cnt(PENDING));
		CHECK_DELTA(&s, BACKGROUND, ==, 0);
		CHECK_DELTA(&s, INLINE, ==, delta(&s, EVICTIONS));
	} else {
		/* Every full batch is deregistered by the thread; less than
		 * a batch may wait (for ibv_dealloc_pd, in teardown). */
		uint64_t deadline = ct_now_ns() + 10000000000ull;

		while (delta(&s, BACKGROUND) + delta(&s, INLINE) +
			       (long long)cnt(PENDING) != delta(&s, EVICTIONS) ||
		       cnt(PENDING) >= batch) {
			CT_CHECK(ct_now_ns() < deadline, "deregistration thread: "
				 "%lld evicted, %lld deregistered by it, %lld "
				 "inline, %llu pending after 10 s",
				 delta(&s, EVICTIONS), delta(&s, BACKGROUND),
				 delta(&s, INLINE), cnt(PENDING));
			sched_yield();
		}
		if (delta(&s, EVICTIONS) >= (long long)batch)
			CHECK_DELTA(&s, BACKGROUND, >=, (long long)batch);
	}
	ct_note("limits: %zu entries, %zu bytes, batch %zu; evictions +%lld "
		"in %lld batches, %lld deregistered by the thread, %lld "
		"inline, %llu pending, pinned at most %lld", max_entries,
		max_bytes, batch, delta(&s, EVICTIONS), delta(&s, BATCHES),
		delta(&s, BACKGROUND), delta(&s, INLINE), cnt(PENDING),
		pinned_max);
	/* The most recent survived; the first one was evicted long ago. */
	snap(&s);
	mr = reg(dev.pd, buf[N - 1], len, CT_ACCESS_ALL);
	CHECK_DELTA(&s, HITS, ==, 1);
	write_to_rb(mr, buf[N - 1], len, "WRITE (last)");
	expect_rb(buf[N - 1], NULL, len, "WRITE (last)");
	dereg(mr);
	snap(&s);
	fill(buf[0], len, 60);
	mr = reg(dev.pd, buf[0], len, CT_ACCESS_ALL);
	CHECK_DELTA(&s, MISSES, ==, 1);
	write_to_rb(mr, buf[0], len, "WRITE (first, re-registered)");
	expect_rb(buf[0], NULL, len, "WRITE (first, re-registered)");
	dereg(mr);
	for (int i = 0; i < N; i++)
		unmap(buf[i], len);
	ct_pass();
}

/* ---- ibv_close_device with an idle cached MR (a sub-run) ------------- */

/*
 * Closing a context whose PD is still allocated is legal (the kernel frees
 * what is left; LeakSanitizer is off in this sub-run). ibv_close_device
 * deregisters the context's idle cached MRs before the real close, so
 * nothing of it stays pinned, and nothing is deregistered later through
 * whatever context reuses the closed one's command fd: the first MR of the
 * next context has the same kernel handle as the closed context's idle MR.
 */
static void test_close_device(void)
{
	size_t len = 64 * KiB;
	uint8_t *a = map_anon(len), *v = map_anon(len), *t = map_anon(len);
	struct ct_dev d1;
	struct ibv_mr *victim;
	struct ibv_wc wc;
	struct snap s;
	uint32_t closed_handle;

	begin("close_device_setup");
	ct_open(&d1);
	victim = reg(d1.pd, a, len, CT_ACCESS_ALL);
	closed_handle = victim->handle;
	dereg(victim);		/* idle in the cache */
	CT_CHECK(cnt(MODE) == 1, "MR cache mode %llu, expected 1 (caching)",
		 cnt(MODE));
	CT_CHECK(cnt(PINNED) == len, "pinned %llu with one idle region of "
		 "%zu bytes", cnt(PINNED), len);
	CT_OK(ibv_close_device(d1.ctx));	/* the PD is not deallocated */
	CT_CHECK(cnt(PINNED) == 0, "%llu bytes still pinned after "
		 "ibv_close_device: the closed context's idle region was not "
		 "flushed", cnt(PINNED));
	ct_open(&dev);
	fill(v, len, 81);
	victim = reg(dev.pd, v, len, CT_ACCESS_ALL);	/* handle 1 again */
	if (victim->handle != closed_handle)
		ct_note("the next context's first MR has handle %u, the "
			"closed context's idle MR had %u: the handle clash "
			"this sub-test is about did not happen", victim->handle,
			closed_handle);
	pair_open(&dev, &P);
	ct_buf_alloc(&rb, dev.pd, len);
	ct_pass();

	begin("close_device_idle_mr");
	/* What used to drop the closed context's region through the next
	 * context: its memory unmapped, then a cache operation. The region
	 * is gone already, so there is nothing left to invalidate. */
	snap(&s);
	unmap(a, len);
	dereg(reg(dev.pd, t, len, LOCAL));
	CHECK_DELTA(&s, INVALIDATIONS, ==, 0);
	memset(rb.p, 0, len);
	{
		struct ct_buf lb = { .p = v, .len = len, .mr = victim };

		CT_OK(ct_post_send1(P.a, 1, IBV_WR_RDMA_WRITE,
				    IBV_SEND_SIGNALED, &lb, 0, (uint32_t)len,
				    (uintptr_t)rb.p, rb.mr->rkey, 0));
	}
	wc = ct_poll1(P.cqa);
	ct_expect_wc(&wc, 1, IBV_WC_RDMA_WRITE, "WRITE with the lkey of the "
		     "next context's first MR (same kernel handle as the "
		     "closed context's idle MR)");
	ct_expect_pattern(rb.p, len, 81, "WRITE from the live MR");
	dereg(victim);
	ct_pass();
	teardown();
	unmap(v, len);
	unmap(t, len);
}

/* ---- a held registration larger than the budget (a sub-run) -------- */

/*
 * The common RDMA program: one big buffer registered once and held, small
 * buffers registered and deregistered again and again. The budget bounds
 * idle regions only, so the small ones keep hitting although the held one
 * is larger than the whole budget (or than RLIMIT_MEMLOCK/2 for root,
 * whom the kernel does not hold to that limit).
 */
static void test_held_large(void)
{
	enum { ROUNDS = 200 };
	size_t big_len = 8 * MiB, len = 1 * MiB;
	uint8_t *big = map_anon(big_len), *buf = map_anon(len);
	struct ibv_mr *held, *mr;
	struct snap s;

	begin("held_large");
	fill(big, big_len, 70);
	held = reg(dev.pd, big, big_len, CT_ACCESS_ALL);
	snap(&s);
	for (int i = 0; i < ROUNDS; i++) {
		mr = reg(dev.pd, buf, len, CT_ACCESS_ALL);
		if (i == 0 || i == ROUNDS - 1) {
			fill(buf, len, 71 + (uint32_t)i);
			write_to_rb(mr, buf, len, "WRITE");
			expect_rb(buf, NULL, len, "WRITE");
		}
		dereg(mr);
	}
	CHECK_DELTA(&s, MISSES, ==, 1);
	CHECK_DELTA(&s, HITS, ==, ROUNDS - 1);
	CHECK_DELTA(&s, EVICTIONS, ==, 0);
	ct_note("held %zu MiB, %d pairs of %zu MiB: %lld hits, %lld misses, "
		"%llu bytes pinned, %llu idle", big_len / MiB, ROUNDS,
		len / MiB, delta(&s, HITS), delta(&s, MISSES), cnt(PINNED),
		cnt(IDLE));
	/* The held region still works. */
	read_into_rb(held, big, CHUNK, "READ of the held region");
	expect_rb(big, NULL, CHUNK, "READ of the held region");
	dereg(held);
	unmap(big, big_len);
	unmap(buf, len);
	ct_pass();
}

/* ---- the pinned-memory limit (an unprivileged sub-run) --------------- */

#define PIN_LIMIT (4 * MiB)

/*
 * An unprivileged process (uid nobody, no CAP_IPC_LOCK) with
 * RLIMIT_MEMLOCK = 4 MiB and an explicit budget far above it: idle regions
 * fill the pinnable memory, and a registration that fits only without them
 * still succeeds because the cache gives them back and retries. What does
 * not fit even without the cache fails with the kernel's errno.
 */
static void test_pinned_limit(void)
{
	enum { N = 8 };
	size_t len = 1 * MiB;
	uint8_t *buf[N], *huge;
	struct ibv_mr *mr;
	struct snap s;

	begin("pinned_limit");
	CT_CHECK(geteuid() != 0, "still root");
	snap(&s);
	for (int i = 0; i < N; i++) {
		buf[i] = map_anon(len);
		fill(buf[i], len, 80 + (uint32_t)i);
		mr = reg(dev.pd, buf[i], len, CT_ACCESS_ALL);
		write_to_rb(mr, buf[i], len, "WRITE");
		expect_rb(buf[i], NULL, len, "WRITE");
		dereg(mr);
		CT_CHECK(cnt(PINNED) <= PIN_LIMIT, "%llu bytes pinned over "
			 "the %d MiB limit", cnt(PINNED), PIN_LIMIT / MiB);
	}
	CHECK_DELTA(&s, MISSES, ==, N);
	CHECK_DELTA(&s, RETRIES, >=, 1);
	ct_note("%d registrations of 1 MiB under a %d MiB limit: %lld "
		"retries after dropping idle regions", N, PIN_LIMIT / MiB,
		delta(&s, RETRIES));
	huge = map_anon(2 * PIN_LIMIT);
	errno = 0;
	mr = ibv_reg_mr(dev.pd, huge, 2 * PIN_LIMIT, LOCAL);
	CT_CHECK(!mr && (errno == ENOMEM || errno == EAGAIN),
		 "registering twice the limit: %p, errno %d", (void *)mr,
		 errno);
	unmap(huge, 2 * PIN_LIMIT);
	for (int i = 0; i < N; i++)
		unmap(buf[i], len);
	ct_pass();
}

/* Become nobody with a 4 MiB RLIMIT_MEMLOCK (before exec of the sub-run). */
static void drop_privileges(void)
{
	struct rlimit r = { PIN_LIMIT, PIN_LIMIT };

	if (geteuid() == 0 &&
	    (setgroups(0, NULL) || setresgid(65534, 65534, 65534) ||
	     setresuid(65534, 65534, 65534))) {
		printf("FAIL pinned_limit: cannot become nobody: %s\n",
		       strerror(errno));
		_exit(1);
	}
	if (setrlimit(RLIMIT_MEMLOCK, &r)) {
		printf("FAIL pinned_limit: setrlimit: %s\n", strerror(errno));
		_exit(1);
	}
	/* The suite's stats directory belongs to root. */
	unsetenv("KRCORE_STATS_FILE");
}

/* ---- ibv_rereg_mr behaves as the provider does ----------------------- */

/*
 * Every flag combination on krcore MRs (cache-backed and exclusive,
 * cache-backed and shared with another registration, uncached) gives the
 * same return value and errno as the same call on a real libibverbs MR of
 * the same device, and when it succeeds the keys behave alike. The real
 * objects come from libibverbs itself (dlopen'd: our exports would wrap).
 */
struct real_verbs {
	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
	int (*rereg_mr)(struct ibv_mr *, int, struct ibv_pd *, void *, size_t,
			int);
	int (*dereg_mr)(struct ibv_mr *);
};

static void *real_sym(void *h, const char *name, const char *ver)
{
	void *f = dlvsym(h, name, ver);

	CT_CHECK(f, "dlvsym(%s@%s): %s", name, ver, dlerror());
	return f;
}

struct rereg_case {
	int flags, access;
	int new_pd;		/* pass the second PD */
	int new_addr;		/* pass a second buffer (else NULL/0) */
};

static void test_rereg(void)
{
	static const struct rereg_case cases[] = {
		{ 0, 0, 0, 0 },
		{ IBV_REREG_MR_CHANGE_ACCESS, LOCAL, 0, 0 },
		{ IBV_REREG_MR_CHANGE_ACCESS, REMOTE_WR, 0, 0 },
		{ IBV_REREG_MR_CHANGE_PD, 0, 1, 0 },
		{ IBV_REREG_MR_CHANGE_TRANSLATION, 0, 0, 1 },
		{ IBV_REREG_MR_CHANGE_TRANSLATION, 0, 0, 0 },
		{ IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS,
		  REMOTE_RD, 1, 0 },
		{ IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_PD |
			  IBV_REREG_MR_CHANGE_ACCESS, LOCAL, 1, 1 },
		{ 0, LOCAL, 0, 0 },			/* access without flag */
		{ 0x8, 0, 0, 0 },			/* unknown flag */
		{ IBV_REREG_MR_CHANGE_ACCESS | 0x100, LOCAL, 0, 0 },
	};
	const char *how[] = { "cached, exclusive", "cached, shared",
			      "uncached (iova != addr)" };
	size_t len = 64 * KiB;
	uint8_t *a = map_anon(len), *b = map_anon(len);
	struct real_verbs rv;
	struct ibv_device **list;
	struct ibv_context *rctx = NULL;
	struct ibv_pd *rpd, *rpd2, *pd2;
	void *h;
	int n;

	begin("rereg_like_provider");
	h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
	CT_CHECK(h, "dlopen libibverbs.so.1: %s", dlerror());
	rv.get_device_list = real_sym(h, "ibv_get_device_list", "IBVERBS_1.1");
	rv.free_device_list = real_sym(h, "ibv_free_device_list", "IBVERBS_1.1");
	rv.open_device = real_sym(h, "ibv_open_device", "IBVERBS_1.1");
	rv.close_device = real_sym(h, "ibv_close_device", "IBVERBS_1.1");
	rv.alloc_pd = real_sym(h, "ibv_alloc_pd", "IBVERBS_1.1");
	rv.dealloc_pd = real_sym(h, "ibv_dealloc_pd", "IBVERBS_1.1");
	rv.reg_mr = real_sym(h, "ibv_reg_mr", "IBVERBS_1.1");
	rv.rereg_mr = real_sym(h, "ibv_rereg_mr", "IBVERBS_1.1");
	rv.dereg_mr = real_sym(h, "ibv_dereg_mr", "IBVERBS_1.1");
	list = rv.get_device_list(&n);
	CT_CHECK(list, "real ibv_get_device_list: %s", strerror(errno));
	for (int i = 0; i < n && !rctx; i++)
		if (!strcmp(ibv_get_device_name(list[i]),
			    ibv_get_device_name(dev.ctx->device)))
			rctx = rv.open_device(list[i]);
	rv.free_device_list(list);
	CT_CHECK(rctx, "the real libibverbs cannot open %s",
		 ibv_get_device_name(dev.ctx->device));
	rpd = rv.alloc_pd(rctx);
	rpd2 = rv.alloc_pd(rctx);
	pd2 = CT_PTR(ibv_alloc_pd(dev.ctx));
	CT_CHECK(rpd && rpd2, "real ibv_alloc_pd");

	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const struct rereg_case *k = &cases[c];
		void *naddr = k->new_addr ? b : NULL;
		size_t nlen = k->new_addr ? len : 0;
		struct ibv_mr *r = rv.reg_mr(rpd, a, len, CT_ACCESS_ALL);
		uint32_t rl, rr;
		int rrc, rerr;

		CT_CHECK(r, "real ibv_reg_mr: %s", strerror(errno));
		rl = r->lkey, rr = r->rkey;
		errno = 0;
		rrc = rv.rereg_mr(r, k->flags, k->new_pd ? rpd2 : NULL, naddr,
				  nlen, k->access);
		rerr = errno;
		for (int m = 0; m < 3; m++) {
			struct ibv_mr *mr, *other = NULL;
			uint32_t l, rk;
			int rc, err;

			if (m == 2)
				mr = CT_PTR(ibv_reg_mr_iova(dev.pd, a, len,
							    0x1000000,
							    CT_ACCESS_ALL));
			else
				mr = reg(dev.pd, a, len, CT_ACCESS_ALL);
			if (m == 1)
				other = reg(dev.pd, a, len, CT_ACCESS_ALL);
			l = mr->lkey, rk = mr->rkey;
			errno = 0;
			rc = ibv_rereg_mr(mr, k->flags, k->new_pd ? pd2 : NULL,
					  naddr, nlen, k->access);
			err = errno;
			CT_CHECK(rc == rrc && (rc == 0 || err == rerr),
				 "case %zu (flags %#x, access %#x), %s: "
				 "krcore %d errno %d (%s), provider %d errno "
				 "%d (%s)", c, k->flags, k->access, how[m], rc,
				 err, strerror(err), rrc, rerr,
				 strerror(rerr));
			if (rc == 0) {
				CT_CHECK(mr->pd == (k->new_pd ? pd2 : dev.pd) &&
					 (!k->new_addr || mr->addr == b),
					 "case %zu, %s: MR fields not updated",
					 c, how[m]);
				CT_CHECK((l == mr->lkey) == (rl == r->lkey) &&
					 (rk == mr->rkey) == (rr == r->rkey),
					 "case %zu, %s: keys %s as the "
					 "provider's", c, how[m],
					 "do not change the same way");
			} else {
				CT_CHECK(mr->lkey == l && mr->rkey == rk &&
					 mr->addr == (m == 2 ? (void *)a : a),
					 "case %zu, %s: a refused rereg "
					 "changed the MR", c, how[m]);
			}
			/* The MR still moves data with its (new) keys. */
			if (mr->pd == dev.pd && mr->addr == a) {
				fill(a, len, 90 + (uint32_t)c);
				if (m != 2) {
					write_to_rb(mr, a, len, "WRITE");
					expect_rb(a, NULL, len, "WRITE");
				}
			}
			dereg(mr);
			if (other)
				dereg(other);
		}
		CT_CHECK(rv.dereg_mr(r) == 0, "real ibv_dereg_mr");
		ct_note("case %zu (flags %#x, access %#x): %d, errno %d (%s)",
			c, k->flags, k->access, rrc, rerr,
			rrc ? strerror(rerr) : "ok");
	}
	CT_OK(ibv_dealloc_pd(pd2));
	CT_CHECK(!rv.dealloc_pd(rpd2) && !rv.dealloc_pd(rpd) &&
		 !rv.close_device(rctx), "real teardown");
	dlclose(h);
	unmap(a, len);
	unmap(b, len);
	ct_pass();
}

/* ---- sub-runs ------------------------------------------------------- */

/* No userfaultfd (ENOSYS) from here on: the cache falls back to hold-only. */
static void deny_userfaultfd(void)
{
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS,
			 offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_userfaultfd, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = sizeof(f) / sizeof(f[0]),
				   .filter = f };

	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) ||
	    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
		printf("FAIL holdonly: seccomp: %s\n", strerror(errno));
		_exit(1);
	}
}


/* Re-executes this program as --run=NAME with `env` ("VAR=value", ...,
 * NULL) added to the environment. */
static void subrun(const char *name, const char *const *env)
{
	char arg[64];
	pid_t pid;
	int st;

	begin(name);
	snprintf(arg, sizeof(arg), "--run=%s", name);
	fflush(stdout);
	pid = fork();
	CT_CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		char *argv[] = { "mr_cache", arg, NULL };

		for (; *env; env++) {
			const char *eq = strchr(*env, '=');
			char var[64];

			snprintf(var, sizeof(var), "%.*s", (int)(eq - *env),
				 *env);
			setenv(var, eq + 1, 1);
		}
		if (!strcmp(name, "holdonly"))
			deny_userfaultfd();
		if (!strcmp(name, "pinned_limit"))
			drop_privileges();
		execv("/proc/self/exe", argv);
		printf("FAIL %s: execv: %s\n", name, strerror(errno));
		_exit(127);
	}
	CT_CHECK(waitpid(pid, &st, 0) == pid, "waitpid: %s", strerror(errno));
	CT_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "sub-run failed "
		 "(status %#x)", st);
	ct_pass();
}

int main(int argc, char **argv)
{
	const char *run = argc > 1 && !strncmp(argv[1], "--run=", 6) ?
				  argv[1] + 6 : "";
	const char *c = getenv("KRCORE_MR_CACHE");

	setvbuf(stdout, NULL, _IOLBF, 0);
	run_name = run;
	cache_on = !(c && !strcmp(c, "0"));
	keep_idle = cache_on && strcmp(run, "holdonly") != 0;
	if (!strcmp(run, "held_large_root")) {
		/* Debian's default: the kernel ignores it for root. */
		struct rlimit r = { 8 * MiB, 8 * MiB };

		CT_CHECK(setrlimit(RLIMIT_MEMLOCK, &r) == 0, "setrlimit");
	} else if (strcmp(run, "pinned_limit") != 0) {
		raise_memlock();
	}

	if (!strncmp(run, "held_large", 10)) {
		setup(CHUNK);
		test_held_large();
		teardown();
		return 0;
	}
	if (!strcmp(run, "pinned_limit")) {
		setup(CHUNK);
		test_pinned_limit();
		teardown();
		return 0;
	}
	if (!strncmp(run, "evict", 5)) {
		setup(64 * KiB);
		test_evict();
		teardown();
		return 0;
	}
	if (!strcmp(run, "close_device")) {
		test_close_device();
		return 0;
	}
	setup(MALLOC_LEN);
	test_hits();
	test_subranges();
	test_rkey_after_dereg();
	test_stale();
	test_fork();
	test_dealloc_pd();
	test_rereg();
	teardown();
	if (*run)
		return 0;
	subrun("evict_entries",
	       (const char *const[]){ "KRCORE_MR_CACHE_ENTRIES=4", NULL });
	subrun("evict_bytes",
	       (const char *const[]){ "KRCORE_MR_CACHE_BYTES=262144", NULL });
	/* Batches of 2: the deregistration thread runs several batches. */
	subrun("evict_thread",
	       (const char *const[]){ "KRCORE_MR_CACHE_ENTRIES=4",
				      "KRCORE_MR_DEREG_BATCH=2", NULL });
	subrun("evict_inline",
	       (const char *const[]){ "KRCORE_MR_CACHE_ENTRIES=4",
				      "KRCORE_MR_DEREG_BATCH=0", NULL });
	subrun("held_large",
	       (const char *const[]){ "KRCORE_MR_CACHE_BYTES=2097152", NULL });
	subrun("held_large_root", (const char *const[]){ NULL });
	subrun("pinned_limit",
	       (const char *const[]){ "KRCORE_MR_CACHE_BYTES=1073741824", NULL });
	subrun("nocache", (const char *const[]){ "KRCORE_MR_CACHE=0", NULL });
	subrun("holdonly", (const char *const[]){ NULL });
	/* It leaves a PD behind on purpose: no leak check there. */
	subrun("close_device",
	       (const char *const[]){ "ASAN_OPTIONS=detect_leaks=0", NULL });
	/* LeakSanitizer runs after main returns: a leak fails the exit code. */
	return 0;
}
