/*
 * Virtual QPs at scale (issue 9, "Scale"), several processes on several
 * emulated nodes, krcore-meta started here on node 1. Memory is measured
 * three ways in each process: the heap in use (AddressSanitizer's count of
 * bytes allocated and not freed: exact, what the library and the test
 * hold), VmRSS and its anonymous part RssAnon (/proc/self/status: what the
 * kernel charges, including ASan's shadow and redzones, the allocator's
 * caches and rxe's queue buffers mapped from the kernel). Figures are
 * printed as "NOTE ...: figure name=value" lines.
 *
 * 1. "1000 vqps over 8 peers": 8 server processes (nodes 2..9), each with
 *    one VQP qbind'ed at (node, PORT1 + s). One client process (node 10)
 *    creates 1,000 VQPs (KRCORE_VQP) and qconnects VQP i to server i % 8
 *    (125 each), in three measured steps: VQP 0 (the library's per-PD
 *    runtime, the meta server's connection and the first link), VQPs 1..7
 *    (one new link each), VQPs 8..999 (links live: pure software). Every
 *    VQP then SENDs a 64-byte message naming it (VQP index, pattern) and
 *    gets the server's answer (another pattern of the same index, sent on
 *    the src_qp qpop_msgs gave), both checked byte for byte; each server
 *    checks it got each of its 125 VQPs once and none of another server's.
 *    While all 1,000 are connected the client holds at most
 *    KRCORE_LINKS_PER_PEER x 8 links (at least 8), opened that many
 *    (links_opened) and counts 1,000 VQPs; each server holds
 *    KRCORE_LINKS_PER_PEER links at most and 126 VQPs (its bound one and
 *    125 src_qps). After the client destroys its VQPs every server gets
 *    125 close reports and its VQP count returns to 1.
 *    Figures: bytes_per_vqp = the client's heap delta over VQPs 8..999
 *    (created + connected, before any data) / 992; bytes_per_link = (the
 *    heap delta over VQPs 1..7 - 7 x bytes_per_vqp) / 7, i.e. what a
 *    client keeps per link it opens (the link's RC QP is taken from the
 *    warm pool, which is refilled in the background, so it is the steady
 *    cost of one more QP and its bookkeeping); the same with RssAnon and
 *    VmRSS; bytes_per_src_qp = a server's heap delta from its first
 *    message to its 125th (all answered) / 124, mean, min and max over the
 *    8 servers.
 *
 * 2. "10000 short-lived clients": one server process (node 2) bound at
 *    (node 2, PORT2) serves with qpop_msgs in a loop (64 receives posted,
 *    each message answered on its src_qp, the receive reposted when the
 *    answer completed, closed src_qps freed by the next qpop_msgs).
 *    CLIENT_PROCS (20) client processes are forked in turn, one at a time
 *    (the next is forked when the previous has exited), on nodes 3..10 in
 *    rotation; each makes CLIENT_VQPS (500) VQPs: VQP 0 alone (it makes
 *    the process's link), then WINDOW (10) at a time: each created,
 *    qconnected, a receive posted, 64 bytes SENT carrying (process, VQP
 *    index, sequence = process x 500 + index) and a pattern of the
 *    sequence, its answer awaited and checked byte for byte; then the 10
 *    destroyed. Then the process frees everything (CQs, MR, PD, device)
 *    and exits normally (exit(0)): 20 x 500 = 10,000 client VQPs, and 20
 *    links made and left behind by processes that are gone. (100 x 100
 *    one VQP at a time took 77-139 s in the VM under other engineers'
 *    load, beyond the 120 s the suite gives a test: a process costs
 *    0.4-1.6 s to open the device under ASan and emulation; 20 x 500
 *    takes 35-60 s.) The server checks every message (fields, bytes),
 *    that each sequence arrives exactly once and each src_qp carries one
 *    VQP's message, and at the end that all 10,000 did, with 10,000 close
 *    reports (each attributed to its process through its src_qp). It
 *    measures itself every 1,000 close reports; "warm" is after the first
 *    WARM_CLIENTS (2,000: four processes), "end" after the 10,000th (the
 *    same state: the links of the last processes still being found dead).
 *    Then it waits (bounded, RECLAIM_MS) until its VQP gauge is back to
 *    its baseline (the bound VQP) and its links to 0 (every exited
 *    client's link found dead by the probe, KRCORE_LINK_PROBE_MS=300
 *    here, plus RC's retries, about 3.8 s), and measures again.
 *    Bounds, asserted:
 *    - links: at every change of the gauge, links <= 1 + the number of
 *      client processes that are running or whose last close arrived less
 *      than DEAD_LINK_MS ago (a link is found dead within the probe period
 *      plus the retries; 8 s as in vqp_faults, with margin for load): a
 *      link that is never reclaimed breaks it within 8 s; the maximum
 *      seen is reported.
 *    - heap in use once the 10,000 are gone (the measurement after the
 *      wait above: links reclaimed, no datagram-tier flow left) vs after
 *      the warm-up: below HEAP_GROWTH (64 KiB): 8,000 clients and 16
 *      processes later, one leaked 8-byte object per client VQP or one
 *      4 KiB object per process would exceed it; the test's own state is
 *      allocated up front. Not at the 10,000th close: the last clients'
 *      flows and links are still held then (+14 to +107 KiB over runs
 *      with the datagram tier on, the same state gone once reclaimed).
 *    - VmRSS and RssAnon after the 10,000 vs after the warm-up: below
 *      RSS_GROWTH (16 MiB). Much looser than the heap: resident memory is
 *      the allocators' high-water mark (ASan's allocator returns free
 *      pages to the kernel only every 100 ms here and keeps its size-class
 *      regions) plus the rxe queues of the links not yet found dead, and
 *      in 2 of 8 runs it stepped up once by 8.5-9 MiB (RssAnon) at a
 *      random moment while the heap in use stayed flat: three anonymous
 *      mappings outside ASan's heap grew (noted by the diagnostics below;
 *      not explained yet, see docs/performance.md). Other runs: -0.3 to
 *      +1.0 MiB. A steady leak of 2 KiB per client VQP (less than half a
 *      src_qp) would still exceed it; smaller leaks are the heap bound's.
 *    - mappings (/proc/self/maps lines, but the device's: the rxe queues
 *      of the links alive at that moment, which the links bound covers;
 *      and ASan's allocator's, whose size-class regions are mapped as
 *      each size is first used, which the heap bound covers):
 *      fewer than MAPS_GROWTH (8) more: a mapping left behind per client
 *      process (a link's registered buffers, a thread's stack), whatever
 *      its size, adds 16.
 *    When RssAnon steps up by more than 2 MiB between two checkpoints the
 *    server notes which mappings grew (diagnostics).
 *
 * KRCORE_LINKS_PER_PEER may be set (default 1): the bounds follow it.
 * CT_SCALE_PROCS / CT_SCALE_VQPS change the shape of part 2 (for
 * experiments; the default is the shape above; the VM does not pass the
 * host's environment on). The suite gives a C test 120 s in all: part 1
 * takes 13-15 s in the VM, part 2 35-60 s.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT1 5400
#define PORT2 5500
#define SERVERS 8
#define NVQP 1000
#define PER_SERVER (NVQP / SERVERS)
#define MSG_LEN 64
#define CLIENT_PROCS 20
#define CLIENT_VQPS 500
#define WINDOW 10
#define WARM_CLIENTS 2000
#define CHECKPOINT 1000
#define MAX_CHECKPOINTS 32
#define NBUF 64
#define MAX_LIVE 4096
#define PROBE_MS "300"
#define DEAD_LINK_MS 8000
#define RECLAIM_MS 15000
#define HEAP_GROWTH (64 << 10)
#define RSS_GROWTH (16 << 20)
#define MAPS_GROWTH 8

/* Memory is measured: what is freed must be reusable at once, not parked
 * in AddressSanitizer's quarantine. */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
	return "quarantine_size_mb=0:allocator_release_to_os_interval_ms=100";
}

/* AddressSanitizer's count of bytes allocated and not freed (its
 * allocator_interface.h is not installed with every compiler). */
size_t __sanitizer_get_current_allocated_bytes(void);

struct mem {
	int64_t heap, rss, anon, asan_mapped, maps;
};

size_t __sanitizer_get_heap_size(void);

/* Diagnostics: the anonymous memory of each mapping, to compare two
 * moments (which mappings grew). */
#define MAX_MAPS 1024
struct map_anon {
	unsigned long lo, hi;
	long anon_kb;
	char name[64];
};

static int maps_snapshot(struct map_anon *out)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char line[512];
	int n = -1;

	CT_CHECK(f != NULL, "smaps");
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		long kb;
		char name[256] = "";

		if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %255s", &lo, &hi, name) >= 2 &&
		    strchr(line, '-') < strchr(line, ' ')) {
			if (n + 1 >= MAX_MAPS)
				break;
			n++;
			out[n].lo = lo;
			out[n].hi = hi;
			out[n].anon_kb = 0;
			snprintf(out[n].name, sizeof(out[n].name), "%.63s", name);
		} else if (n >= 0 && sscanf(line, "Anonymous: %ld kB", &kb) == 1) {
			out[n].anon_kb = kb;
		}
	}
	fclose(f);
	return n + 1;
}

/* Notes the mappings whose anonymous memory grew by more than 64 KiB
 * from a to b (new ones included), largest first, at most 10. */
/* AddressSanitizer's allocator space on x86_64 (asan_allocator.h): its
 * size-class regions, each mapped as it is first used (a size first
 * allocated after the warm-up adds about four lines while the heap stays
 * flat). What is allocated there is the heap bound's business. */
static int in_asan_heap(unsigned long addr)
{
	return addr >= 0x600000000000ul && addr < 0x640000000000ul;
}

static void maps_diff(const struct map_anon *a, int na, const struct map_anon *b, int nb)
{
	static long grew[MAX_MAPS];
	long total = 0;

	for (int j = 0; j < nb; j++) {
		long before = 0;

		for (int i = 0; i < na; i++)
			if (a[i].lo == b[j].lo && a[i].hi == b[j].hi)
				before = a[i].anon_kb;
		grew[j] = b[j].anon_kb - before;
		total += grew[j];
	}
	ct_note("mappings %d then %d; anonymous memory of the mappings present at the end grew by %ld kB",
		na, nb, total);
	for (int k = 0; k < 10; k++) {
		int best = -1;

		for (int j = 0; j < nb; j++)
			if (grew[j] > 64 && (best < 0 || grew[j] > grew[best]))
				best = j;
		if (best < 0)
			break;
		ct_note("  %lx-%lx (%lu kB) %s: anonymous +%ld kB", b[best].lo, b[best].hi,
			(b[best].hi - b[best].lo) >> 10, b[best].name, grew[best]);
		grew[best] = 0;
	}
	/* Mappings that are new, of those the mappings bound counts. */
	for (int j = 0, shown = 0; j < nb && shown < 16; j++) {
		int seen = 0;

		for (int i = 0; i < na && !seen; i++)
			seen = a[i].lo == b[j].lo && a[i].hi == b[j].hi;
		if (!seen && !strstr(b[j].name, "/dev/infiniband/") && !in_asan_heap(b[j].lo)) {
			ct_note("  new: %lx-%lx (%lu kB) %s, anonymous %ld kB", b[j].lo, b[j].hi,
				(b[j].hi - b[j].lo) >> 10, b[j].name, b[j].anon_kb);
			shown++;
		}
	}
}

static int64_t status_kb(const char *text, const char *key)
{
	const char *p = strstr(text, key);
	long long v = -1;

	CT_CHECK(p != NULL, "no %s in /proc/self/status", key);
	int got = sscanf(p + strlen(key), " %lld", &v);

	CT_CHECK(got == 1, "%s format", key);
	return (int64_t)v * 1024;
}

static struct mem mem_now(void)
{
	static char text[8192];
	struct mem m;
	FILE *f = fopen("/proc/self/status", "r");
	size_t k;

	CT_CHECK(f != NULL, "/proc/self/status");
	k = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	text[k] = 0;
	m.heap = (int64_t)__sanitizer_get_current_allocated_bytes();
	m.rss = status_kb(text, "VmRSS:");
	m.anon = status_kb(text, "RssAnon:");
	m.asan_mapped = (int64_t)__sanitizer_get_heap_size();
	{
		/* Not the device's mappings (the rxe queues of the links, which
		 * come and go with them: the links bound's business), nor the
		 * allocator's. */
		FILE *mf = fopen("/proc/self/maps", "r");
		char line[512];

		m.maps = 0;
		CT_CHECK(mf != NULL, "maps");
		while (fgets(line, sizeof(line), mf)) {
			unsigned long lo = strtoul(line, NULL, 16);

			m.maps += strstr(line, "/dev/infiniband/") == NULL && !in_asan_heap(lo);
		}
		fclose(mf);
	}
	return m;
}

static double mib(int64_t b)
{
	return (double)b / 1048576.0;
}

static unsigned links_per_peer(void)
{
	const char *v = getenv("KRCORE_LINKS_PER_PEER");
	int n = v ? atoi(v) : 1;

	return n < 1 ? 1 : n > 64 ? 64 : (unsigned)n;
}

static int env_or(const char *name, int dflt)
{
	const char *v = getenv(name);

	return v && atoi(v) > 0 ? atoi(v) : dflt;
}

static double ms_since(uint64_t t0)
{
	return (double)(ct_now_ns() - t0) / 1e6;
}

/* Frees everything: ibv_dealloc_pd succeeds once the PD's VQPs are gone
 * (the library's service thread holding the PD's runtime for a moment
 * once made it EBUSY now and then). */
static void node_close(struct ct_node *n)
{
	ct_buf_free(&n->b);
	CT_OK(ibv_destroy_cq(n->scq));
	CT_OK(ibv_destroy_cq(n->rcq));
	CT_OK(ibv_dealloc_pd(n->d.pd));
	CT_OK(ibv_close_device(n->d.ctx));
}

static struct ibv_qp *vqp(struct ct_node *n, uint32_t sq, uint32_t rq)
{
	return ct_node_vqp(n, sq, rq);
}

static void post_recv_at(struct ibv_qp *qp, struct ct_node *n, uint64_t wr_id, size_t off)
{
	ct_post_recv1(qp, wr_id, &n->b, off, MSG_LEN);
}

static void post_send_at(struct ibv_qp *qp, struct ct_node *n, uint64_t wr_id, size_t off)
{
	CT_OK(ct_post_send1(qp, wr_id, IBV_WR_SEND, IBV_SEND_SIGNALED, &n->b, off, MSG_LEN, 0, 0, 0));
}

/* A request: (a, b, seq) then a pattern of seq; its answer: the same
 * three words then another pattern of seq. */
static void fill_msg(uint8_t *p, uint32_t a, uint32_t b, uint32_t seq, int answer)
{
	ct_fill(p, MSG_LEN, (answer ? 0x5eed0000u : 0x0a110000u) ^ (seq * 2654435761u));
	memcpy(p, &a, 4);
	memcpy(p + 4, &b, 4);
	memcpy(p + 8, &seq, 4);
}

static void expect_msg(const uint8_t *p, uint32_t a, uint32_t b, uint32_t seq, int answer,
		       const char *what)
{
	uint8_t want[MSG_LEN];

	fill_msg(want, a, b, seq, answer);
	ct_expect_bytes(p, want, MSG_LEN, what);
}

static void msg_fields(const uint8_t *p, uint32_t *a, uint32_t *b, uint32_t *seq)
{
	memcpy(a, p, 4);
	memcpy(b, p + 4, 4);
	memcpy(seq, p + 8, 4);
}

/* ---- 1. 1,000 VQPs over 8 peers ---------------------------------------- */

static int server_idx;
static int measured_pipe[2];	/* servers -> client: src_qps measured */
static int figure_pipe[2];	/* servers -> parent: bytes per src_qp */

static int spread_server(int ready_fd)
{
	int s = server_idx, node = 2 + s;
	struct ct_node n;
	struct ibv_qp *qp;
	struct ibv_qp *srcs[PER_SERVER] = { 0 };
	struct mem m1 = { 0 }, m125 = { 0 };
	int msgs = 0, answered = 0, closes = 0;
	uint64_t t0;
	unsigned lpp = links_per_peer();
	int64_t per_src;

	ct_begin("vqp_scale: 1000 vqps over 8 peers (server)");
	/* Receive slots 0..NBUF-1, answer slots NBUF..2*NBUF-1. */
	ct_node_open(&n, node, 2 * NBUF * MSG_LEN, 256);
	qp = vqp(&n, 256, NBUF);
	for (int i = 0; i < NBUF; i++)
		post_recv_at(qp, &n, (uint64_t)i, (size_t)i * MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(node), PORT1 + s));
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 1);
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	/* Every message: one of our 125 VQPs, once; answered on its src_qp.
	 * Then every src_qp reported closed. */
	t0 = ct_now_ns();
	while (answered < PER_SERVER || closes < PER_SERVER) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16], swc[16];
		int k = qpop_msgs(qp, 16, src, wc), m;

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			uint32_t idx, b, seq, slot = (uint32_t)wc[i].wr_id;
			uint8_t *p = n.b.p + (size_t)slot * MSG_LEN;
			int mine;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				int known = 0;

				CT_CHECK(answered == PER_SERVER, "a close before every answer");
				for (int j = 0; j < PER_SERVER; j++)
					known |= srcs[j] == src[i];
				CT_CHECK(known && wc[i].byte_len == 0, "close report of an unknown src_qp");
				closes++;
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN,
				 "message: %s, %u bytes", ibv_wc_status_str(wc[i].status), wc[i].byte_len);
			CT_CHECK(slot < NBUF, "wr_id %u", slot);
			msg_fields(p, &idx, &b, &seq);
			mine = idx < NVQP && idx % SERVERS == (uint32_t)s;
			CT_CHECK(mine, "server %d got VQP %u's message", s, idx);
			CT_CHECK(srcs[idx / SERVERS] == NULL, "VQP %u: a second message", idx);
			expect_msg(p, idx, 0, idx, 0, "request");
			for (int j = 0; j < PER_SERVER; j++)
				CT_CHECK(srcs[j] != src[i], "VQPs %u and %d share a src_qp", idx,
					 j * SERVERS + s);
			srcs[idx / SERVERS] = src[i];
			msgs++;
			fill_msg(n.b.p + (size_t)(NBUF + slot) * MSG_LEN, idx, 0, idx, 1);
			post_send_at(src[i], &n, slot, (size_t)(NBUF + slot) * MSG_LEN);
			if (msgs == 1)
				m1 = mem_now();	/* a link and one src_qp */
		}
		m = ibv_poll_cq(n.scq, 16, swc);
		CT_CHECK(m >= 0, "poll");
		for (int i = 0; i < m; i++) {
			CT_CHECK(swc[i].status == IBV_WC_SUCCESS, "answer: %s", ibv_wc_status_str(swc[i].status));
			post_recv_at(qp, &n, swc[i].wr_id, swc[i].wr_id * MSG_LEN);
			if (++answered == PER_SERVER) {
				/* All 125 src_qps live: measure, tell the client. */
				m125 = mem_now();
				CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 1 + PER_SERVER);
				CT_KRCORE_STAT(KRCORE_STAT_LINKS, <=, lpp);
				CT_KRCORE_STAT(KRCORE_STAT_LINKS, >=, 1);
				CT_CHECK(write(measured_pipe[1], "M", 1) == 1, "measured");
			}
		}
		if (k == 0 && m == 0)
			usleep(200);
		CT_CHECK(ms_since(t0) < 60000, "%d messages, %d answers, %d closes after 60 s", msgs,
			 answered, closes);
	}
	/* The closed src_qps are freed by the next call: back to the bound
	 * VQP alone. */
	{
		struct ibv_qp *src;
		struct ibv_wc wc;

		CT_CHECK(qpop_msgs(qp, 1, &src, &wc) == 0, "a message after the closes");
	}
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 1);
	per_src = (m125.heap - m1.heap) / (PER_SERVER - 1);
	ct_note("server %d: heap %+lld B, RssAnon %+lld B, VmRSS %+lld B from its 1st src_qp to its 125th (%lld B of heap per src_qp)",
		s, (long long)(m125.heap - m1.heap), (long long)(m125.anon - m1.anon),
		(long long)(m125.rss - m1.rss), (long long)per_src);
	{
		int64_t f[3] = { per_src, (m125.anon - m1.anon) / (PER_SERVER - 1),
				 (m125.rss - m1.rss) / (PER_SERVER - 1) };

		CT_CHECK(write(figure_pipe[1], f, sizeof(f)) == sizeof(f), "figure");
	}
	CT_OK(ibv_destroy_qp(qp));
	node_close(&n);
	ct_pass();
	return 0;
}

static int spread_client(void)
{
	struct ct_node n;
	struct ibv_qp **qps;
	struct mem m0, ma = { 0 }, mb = { 0 }, mc, md;
	unsigned lpp = links_per_peer();
	uint64_t t0, t_conn;
	int64_t per_vqp, per_vqp_anon, per_vqp_rss, per_link, per_link_anon, per_link_rss;

	ct_begin("vqp_scale: 1000 vqps over 8 peers (client)");
	/* Request slots 0..NVQP-1, answer slots NVQP..2*NVQP-1. */
	ct_node_open(&n, 10, 2 * (size_t)NVQP * MSG_LEN, 2 * NVQP + 16);
	qps = calloc(NVQP, sizeof(*qps));
	CT_CHECK(qps != NULL, "alloc");
	m0 = mem_now();
	t0 = ct_now_ns();
	for (int i = 0; i < NVQP; i++) {
		qps[i] = vqp(&n, 2, 2);
		CT_OK(qconnect(qps[i], ct_node_gid(2 + i % SERVERS), PORT1 + i % SERVERS));
		if (i == 0)
			ma = mem_now();
		else if (i == SERVERS - 1)
			mb = mem_now();
	}
	mc = mem_now();
	t_conn = ct_now_ns();
	/* All 1,000 connected: 8 peers, at most links_per_peer links each. */
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, NVQP);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, >=, SERVERS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, <=, lpp * SERVERS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_OPENED, <=, lpp * SERVERS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	/* Every VQP: a message and its answer. */
	for (int i = 0; i < NVQP; i++) {
		post_recv_at(qps[i], &n, (uint64_t)i, (size_t)(NVQP + i) * MSG_LEN);
		fill_msg(n.b.p + (size_t)i * MSG_LEN, (uint32_t)i, 0, (uint32_t)i, 0);
		post_send_at(qps[i], &n, (uint64_t)i, (size_t)i * MSG_LEN);
	}
	{
		static struct ibv_wc wc[NVQP];
		static uint8_t sent[NVQP], got[NVQP];

		ct_poll_n(n.scq, wc, NVQP, 60000);
		for (int i = 0; i < NVQP; i++) {
			uint32_t w = (uint32_t)wc[i].wr_id;

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && w < NVQP && !sent[w] &&
				 wc[i].qp_num == qps[w]->qp_num && wc[i].opcode == IBV_WC_SEND,
				 "send completion %d: %s, wr_id %u", i, ibv_wc_status_str(wc[i].status), w);
			sent[w] = 1;
		}
		ct_poll_n(n.rcq, wc, NVQP, 60000);
		for (int i = 0; i < NVQP; i++) {
			uint32_t w = (uint32_t)wc[i].wr_id;

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && w < NVQP && !got[w] &&
				 wc[i].qp_num == qps[w]->qp_num && wc[i].byte_len == MSG_LEN,
				 "answer %d: %s, wr_id %u, %u bytes", i, ibv_wc_status_str(wc[i].status), w,
				 wc[i].byte_len);
			got[w] = 1;
			expect_msg(n.b.p + (size_t)(NVQP + w) * MSG_LEN, w, 0, w, 1, "answer");
		}
	}
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, <=, lpp * SERVERS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_OPENED, <=, lpp * SERVERS);
	ct_note("1,000 VQPs created and connected in %.0f ms, their messages and answers in %.0f ms; links %llu (opened %llu, links_per_peer %u), VQPs %llu",
		(double)(t_conn - t0) / 1e6, ms_since(t_conn),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_LINKS),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_LINKS_OPENED), lpp,
		(unsigned long long)krcore_stat_get(KRCORE_STAT_VQPS));
	/* The servers measure their 125 src_qps before any goes. */
	for (int s = 0; s < SERVERS; s++) {
		char b;

		CT_CHECK(read(measured_pipe[0], &b, 1) == 1, "a server did not measure");
	}
	for (int i = 0; i < NVQP; i++)
		CT_OK(ibv_destroy_qp(qps[i]));
	md = mem_now();
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 0);
	free(qps);

	per_vqp = (mc.heap - mb.heap) / (NVQP - SERVERS);
	per_vqp_anon = (mc.anon - mb.anon) / (NVQP - SERVERS);
	per_vqp_rss = (mc.rss - mb.rss) / (NVQP - SERVERS);
	per_link = ((mb.heap - ma.heap) - (SERVERS - 1) * per_vqp) / (SERVERS - 1);
	per_link_anon = ((mb.anon - ma.anon) - (SERVERS - 1) * per_vqp_anon) / (SERVERS - 1);
	per_link_rss = ((mb.rss - ma.rss) - (SERVERS - 1) * per_vqp_rss) / (SERVERS - 1);
	ct_note("client heap %.2f MiB before, %.2f after VQP 0 (runtime, meta, first link), %.2f after 8 (8 links), %.2f after 1,000, %.2f after destroying them; RssAnon %.2f / %.2f / %.2f / %.2f / %.2f MiB; VmRSS %.2f / %.2f / %.2f / %.2f / %.2f MiB",
		mib(m0.heap), mib(ma.heap), mib(mb.heap), mib(mc.heap), mib(md.heap), mib(m0.anon),
		mib(ma.anon), mib(mb.anon), mib(mc.anon), mib(md.anon), mib(m0.rss), mib(ma.rss),
		mib(mb.rss), mib(mc.rss), mib(md.rss));
	ct_note("figure bytes_per_vqp=%lld (heap; RssAnon %lld, VmRSS %lld; client, VQPs 8..999 created and connected over live links)",
		(long long)per_vqp, (long long)per_vqp_anon, (long long)per_vqp_rss);
	ct_note("figure bytes_per_link=%lld (heap; RssAnon %lld, VmRSS %lld; client, links 2..8 opened by VQPs 1..7, less 7 VQPs)",
		(long long)per_link, (long long)per_link_anon, (long long)per_link_rss);
	/* Sanity: a VQP costs something, and not more than 64 KiB of heap. */
	CT_CHECK(per_vqp > 0 && per_vqp < 65536, "%lld bytes per VQP", (long long)per_vqp);
	node_close(&n);
	ct_pass();
	return 0;
}

static int spread(void)
{
	pid_t srv[SERVERS], cli;
	int fails = 0;
	int64_t sum = 0, lo = INT64_MAX, hi = INT64_MIN, anon = 0, rss = 0;
	uint64_t t0 = ct_now_ns();

	ct_begin("vqp_scale: 1000 vqps over 8 peers");
	CT_CHECK(pipe(measured_pipe) == 0 && pipe(figure_pipe) == 0, "pipe");
	for (int s = 0; s < SERVERS; s++) {
		server_idx = s;
		srv[s] = ct_fork_ready(spread_server, "a server");
	}
	cli = fork();
	CT_CHECK(cli >= 0, "fork");
	if (cli == 0)
		exit(spread_client());
	fails += ct_wait_child(cli, "the client of 1,000 VQPs");
	if (fails) {
		for (int s = 0; s < SERVERS; s++)
			kill(srv[s], SIGKILL);
	}
	for (int s = 0; s < SERVERS; s++)
		fails += ct_wait_child(srv[s], "a server of the 1,000 VQPs");
	if (fails)
		return fails;
	for (int s = 0; s < SERVERS; s++) {
		int64_t f[3];

		CT_CHECK(read(figure_pipe[0], f, sizeof(f)) == sizeof(f), "figure");
		sum += f[0];
		lo = f[0] < lo ? f[0] : lo;
		hi = f[0] > hi ? f[0] : hi;
		anon += f[1];
		rss += f[2];
	}
	ct_note("figure bytes_per_src_qp=%lld (heap, mean of 8 servers, min %lld, max %lld; RssAnon %lld, VmRSS %lld; a server's 1st to 125th src_qp / 124)",
		(long long)(sum / SERVERS), (long long)lo, (long long)hi, (long long)(anon / SERVERS),
		(long long)(rss / SERVERS));
	ct_note("figure part1_seconds=%.1f", ms_since(t0) / 1000.0);
	CT_CHECK(lo > 0 && hi < 65536, "bytes per src_qp %lld..%lld", (long long)lo, (long long)hi);
	close(measured_pipe[0]);
	close(measured_pipe[1]);
	close(figure_pipe[0]);
	close(figure_pipe[1]);
	ct_pass();
	return 0;
}

/* ---- 2. 10,000 short-lived clients ------------------------------------- */

static int nprocs, nvqps;
static int churn_pipe[2];	/* server -> parent: its figures */

struct churn_report {
	struct mem warm, end, reclaimed;
	uint64_t links_max, links_end, vqps_end, vqps_base, links_opened_end;
	int late_closes;
	double reclaim_ms;
	struct mem series[MAX_CHECKPOINTS];
	int64_t heap_peak;	/* the most heap in use after the warm-up */
};

static int churn_server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	int total = nprocs * nvqps;
	uint8_t *seen = calloc((size_t)total, 1);
	/* Per client process: its VQPs closed, and when the last closed. */
	int *closed = calloc((size_t)nprocs, sizeof(int));
	uint64_t *t_done = calloc((size_t)nprocs, sizeof(uint64_t));
	int msgs = 0, closes = 0, outstanding = 0, late_closes = 0, nlive = 0, last_proc = -1;
	uint64_t last_links = 0, t_progress;
	struct churn_report r;
	/* The live src_qps (one per client VQP until its close report) and
	 * the process each serves. */
	static struct { struct ibv_qp *src; int proc; } live[MAX_LIVE];
	/* Checkpoints every 1,000 close reports: memory and mappings. */
	static struct map_anon warm_maps[MAX_MAPS], end_maps[MAX_MAPS], prev_maps[MAX_MAPS],
		cur_maps[MAX_MAPS];
	int nwarm = 0, nend = 0, nprev = 0, jumped = 0;
	struct mem prev = { 0 };

	ct_begin("vqp_scale: 10000 short-lived clients (server)");
	memset(&r, 0, sizeof(r));
	CT_CHECK(seen && closed && t_done, "alloc");
	ct_node_open(&n, 2, 2 * NBUF * MSG_LEN, 256);
	qp = vqp(&n, NBUF, NBUF);
	for (int i = 0; i < NBUF; i++)
		post_recv_at(qp, &n, (uint64_t)i, (size_t)i * MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(2), PORT2));
	r.vqps_base = krcore_stat_get(KRCORE_STAT_VQPS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, ==, 0);
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	t_progress = ct_now_ns();
	while (msgs < total || closes < total || outstanding > 0) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16], swc[16];
		int k = qpop_msgs(qp, 16, src, wc), m;
		uint64_t links;

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			uint32_t proc, v, seq, slot = (uint32_t)wc[i].wr_id;
			uint8_t *p = n.b.p + (size_t)slot * MSG_LEN;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				/* A client VQP destroyed (or its process found
				 * gone): whose, by the live src_qp it named. */
				int j = 0, cp;

				while (j < nlive && live[j].src != src[i])
					j++;
				CT_CHECK(wc[i].byte_len == 0 && j < nlive, "close report of an unknown src_qp");
				cp = live[j].proc;
				live[j] = live[--nlive];
				closes++;
				if (cp != last_proc)
					late_closes++;
				if (++closed[cp] == nvqps)
					t_done[cp] = ct_now_ns();
				if (closes % CHECKPOINT == 0) {
					struct mem cur = mem_now();
					int ncur = maps_snapshot(cur_maps);
					int c = closes / CHECKPOINT;

					if (c <= MAX_CHECKPOINTS)
						r.series[c - 1] = cur;
					if (closes == WARM_CLIENTS) {
						r.warm = cur;
						nwarm = ncur;
						memcpy(warm_maps, cur_maps, sizeof(cur_maps));
					}
					if (closes == total) {
						r.end = cur;
						nend = ncur;
						memcpy(end_maps, cur_maps, sizeof(cur_maps));
					}
					/* Which mappings a step of resident memory
					 * was in (the first such step only). */
					if (c > 1 && !jumped && cur.anon - prev.anon > (2 << 20)) {
						jumped = 1;
						ct_note("RssAnon +%lld B between %d and %d clients:",
							(long long)(cur.anon - prev.anon), closes - CHECKPOINT, closes);
						maps_diff(prev_maps, nprev, cur_maps, ncur);
					}
					prev = cur;
					nprev = ncur;
					memcpy(prev_maps, cur_maps, sizeof(cur_maps));
				}
				if (closes % 500 == 0) {
					ct_watchdog(120);	/* progress */
					t_progress = ct_now_ns();
				}
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN,
				 "message: %s, %u bytes", ibv_wc_status_str(wc[i].status), wc[i].byte_len);
			CT_CHECK(slot < NBUF, "wr_id %u", slot);
			msg_fields(p, &proc, &v, &seq);
			CT_CHECK(proc < (uint32_t)nprocs && v < (uint32_t)nvqps && seq == proc * nvqps + v,
				 "message (%u, %u, %u)", proc, v, seq);
			/* Exactly once. */
			CT_CHECK(!seen[seq], "message %u (process %u, VQP %u) twice", seq, proc, v);
			seen[seq] = 1;
			expect_msg(p, proc, v, seq, 0, "request");
			for (int j = 0; j < nlive; j++)
				CT_CHECK(live[j].src != src[i], "message %u on a src_qp already used", seq);
			CT_CHECK(nlive < MAX_LIVE, "%d src_qps live", nlive);
			live[nlive].src = src[i];
			live[nlive++].proc = (int)proc;
			if ((int)proc != last_proc)
				last_proc = (int)proc;
			msgs++;
			fill_msg(n.b.p + (size_t)(NBUF + slot) * MSG_LEN, proc, v, seq, 1);
			post_send_at(src[i], &n, slot, (size_t)(NBUF + slot) * MSG_LEN);
			outstanding++;
		}
		m = ibv_poll_cq(n.scq, 16, swc);
		CT_CHECK(m >= 0, "poll");
		for (int i = 0; i < m; i++) {
			CT_CHECK(swc[i].status == IBV_WC_SUCCESS, "answer: %s", ibv_wc_status_str(swc[i].status));
			post_recv_at(qp, &n, swc[i].wr_id, swc[i].wr_id * MSG_LEN);
			outstanding--;
		}
		if (closes >= WARM_CLIENTS) {
			int64_t h = (int64_t)__sanitizer_get_current_allocated_bytes();

			if (h > r.heap_peak)
				r.heap_peak = h;
		}
		/* Links: bounded by the processes running or gone for less
		 * than the time their link takes to be found dead. */
		links = krcore_stat_get(KRCORE_STAT_LINKS);
		if (links != last_links) {
			uint64_t now = ct_now_ns(), allowed = 1;

			for (int p = 0; p < nprocs; p++)
				if (closed[p] > 0 &&
				    (t_done[p] == 0 || now - t_done[p] < DEAD_LINK_MS * 1000000ull))
					allowed++;
			allowed *= links_per_peer();
			CT_CHECK(links <= allowed,
				 "%llu links after %d clients: at most %llu expected (processes running or gone less than %d ms ago)",
				 (unsigned long long)links, closes, (unsigned long long)allowed, DEAD_LINK_MS);
			if (links > r.links_max)
				r.links_max = links;
			last_links = links;
		}
		if (k == 0 && m == 0)
			usleep(100);
		CT_CHECK(ms_since(t_progress) < 30000, "no progress for 30 s: %d messages, %d closes", msgs,
			 closes);
	}
	for (int i = 0; i < total; i++)
		CT_CHECK(seen[i], "message %d never came", i);
	for (int p = 0; p < nprocs; p++)
		CT_CHECK(closed[p] == nvqps, "process %d: %d closes", p, closed[p]);
	r.late_closes = late_closes;
	r.links_opened_end = krcore_stat_get(KRCORE_STAT_LINKS_OPENED);
	/* Every client is gone: its src_qps freed at once, its link when found
	 * dead. */
	{
		uint64_t t0 = ct_now_ns();
		uint64_t flows;

		for (;;) {
			struct ibv_qp *src[4];
			struct ibv_wc wc[4];

			CT_CHECK(qpop_msgs(qp, 4, src, wc) == 0, "a message after the last client");
			r.vqps_end = krcore_stat_get(KRCORE_STAT_VQPS);
			r.links_end = krcore_stat_get(KRCORE_STAT_LINKS);
			flows = krcore_stat_get(KRCORE_STAT_DGRAM_FLOWS);
			/* The datagram tier's flows from the clients go with
			 * their VQPs' CLOSEs (on the tier or on the link). */
			if (r.vqps_end == r.vqps_base && r.links_end == 0 && flows == 0)
				break;
			if (r.links_end > r.links_max)
				r.links_max = r.links_end;
			CT_CHECK(ms_since(t0) < RECLAIM_MS,
				 "%llu VQPs (baseline %llu), %llu links and %llu datagram-tier flows %d ms after the last client",
				 (unsigned long long)r.vqps_end, (unsigned long long)r.vqps_base,
				 (unsigned long long)r.links_end, (unsigned long long)flows, RECLAIM_MS);
			usleep(10000);
		}
		r.reclaim_ms = ms_since(t0);
	}
	r.reclaimed = mem_now();
	ct_note("after %d clients and after %d: ASan allocator mapped %lld and %lld bytes, %lld and %lld mappings",
		WARM_CLIENTS, total, (long long)r.warm.asan_mapped, (long long)r.end.asan_mapped,
		(long long)r.warm.maps, (long long)r.end.maps);
	maps_diff(warm_maps, nwarm, end_maps, nend);
	CT_CHECK(write(churn_pipe[1], &r, sizeof(r)) == sizeof(r), "report");
	CT_OK(ibv_destroy_qp(qp));
	node_close(&n);
	free(seen);
	free(closed);
	free(t_done);
	ct_pass();
	return 0;
}

/* What a client process reports to the parent. */
struct client_report {
	double open_ms, first_ms, vqps_ms, close_ms;
};
static int client_pipe[2];

static int churn_client(int proc)
{
	struct ct_node n;
	int node = 3 + proc % 8;
	struct client_report cr;
	uint64_t t = ct_now_ns();

	ct_begin("vqp_scale: 10000 short-lived clients (a client)");
	ct_node_open(&n, node, 2 * WINDOW * MSG_LEN, 2 * WINDOW + 4);
	cr.open_ms = ms_since(t);
	t = ct_now_ns();
	/* VQP 0 alone (it makes the link), then WINDOW at a time: each
	 * created, connected, its message sent and its answer checked, then
	 * all destroyed. Request slots 0..WINDOW-1, answers after them. */
	for (int v0 = 0; v0 < nvqps;) {
		int w = v0 == 0 ? 1 : (nvqps - v0 < WINDOW ? nvqps - v0 : WINDOW);
		struct ibv_qp *q[WINDOW];
		struct ibv_wc wc[WINDOW];
		uint8_t sent[WINDOW] = { 0 }, got[WINDOW] = { 0 };

		for (int j = 0; j < w; j++) {
			uint32_t v = (uint32_t)(v0 + j), seq = (uint32_t)proc * (uint32_t)nvqps + v;

			q[j] = vqp(&n, 1, 1);
			CT_OK(qconnect(q[j], ct_node_gid(2), PORT2));
			post_recv_at(q[j], &n, (uint64_t)j, (size_t)(WINDOW + j) * MSG_LEN);
			fill_msg(n.b.p + (size_t)j * MSG_LEN, (uint32_t)proc, v, seq, 0);
			post_send_at(q[j], &n, (uint64_t)j, (size_t)j * MSG_LEN);
		}
		ct_poll_n(n.scq, wc, w, CT_TIMEOUT_MS);
		for (int i = 0; i < w; i++) {
			uint32_t j = (uint32_t)wc[i].wr_id;

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && j < (uint32_t)w && !sent[j] &&
				 wc[i].qp_num == q[j]->qp_num, "process %d VQP %d: send %s", proc,
				 v0 + (int)j, ibv_wc_status_str(wc[i].status));
			sent[j] = 1;
		}
		ct_poll_n(n.rcq, wc, w, CT_TIMEOUT_MS);
		for (int i = 0; i < w; i++) {
			uint32_t j = (uint32_t)wc[i].wr_id, v = (uint32_t)v0 + j;

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && j < (uint32_t)w && !got[j] &&
				 wc[i].qp_num == q[j]->qp_num && wc[i].byte_len == MSG_LEN,
				 "process %d VQP %u: answer %s, %u bytes", proc, v,
				 ibv_wc_status_str(wc[i].status), wc[i].byte_len);
			got[j] = 1;
			expect_msg(n.b.p + (size_t)(WINDOW + j) * MSG_LEN, (uint32_t)proc, v,
				   (uint32_t)proc * (uint32_t)nvqps + v, 1, "answer");
		}
		for (int j = 0; j < w; j++)
			CT_OK(ibv_destroy_qp(q[j]));
		if (v0 == 0) {
			cr.first_ms = ms_since(t);
			t = ct_now_ns();
		}
		v0 += w;
	}
	cr.vqps_ms = ms_since(t);
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 0);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_OPENED, <=, links_per_peer());
	t = ct_now_ns();
	node_close(&n);
	cr.close_ms = ms_since(t);
	CT_CHECK(write(client_pipe[1], &cr, sizeof(cr)) == sizeof(cr), "report");
	return 0;
}

static int churn(void)
{
	pid_t srv;
	struct churn_report r;
	int fails = 0, total;
	uint64_t t0 = ct_now_ns(), t_clients;
	struct client_report cr, sum = { 0, 0, 0, 0 };
	double life_ms = 0;

	nprocs = env_or("CT_SCALE_PROCS", CLIENT_PROCS);
	nvqps = env_or("CT_SCALE_VQPS", CLIENT_VQPS);
	total = nprocs * nvqps;
	CT_CHECK(total > WARM_CLIENTS, "%d clients: more than %d needed", total, WARM_CLIENTS);
	CT_CHECK(pipe(churn_pipe) == 0, "pipe");
	srv = ct_fork_ready(churn_server, "the server of short-lived clients");
	ct_begin("vqp_scale: 10000 short-lived clients");
	CT_CHECK(pipe(client_pipe) == 0, "pipe");
	for (int p = 0; p < nprocs && !fails; p++) {
		uint64_t tp = ct_now_ns();
		pid_t c = fork();

		CT_CHECK(c >= 0, "fork");
		if (c == 0)
			exit(churn_client(p));	/* a normal exit: atexit, destructors */
		fails += ct_wait_child(c, "a short-lived client process");
		if (!fails) {
			CT_CHECK(read(client_pipe[0], &cr, sizeof(cr)) == sizeof(cr), "client report");
			sum.open_ms += cr.open_ms;
			sum.first_ms += cr.first_ms;
			sum.vqps_ms += cr.vqps_ms;
			sum.close_ms += cr.close_ms;
			life_ms += ms_since(tp);
		}
		ct_watchdog(120);	/* progress */
		if ((p + 1) % 10 == 0)
			ct_note("%d client processes done in %.1f s", p + 1, ms_since(t0) / 1000.0);
	}
	close(client_pipe[0]);
	close(client_pipe[1]);
	t_clients = ct_now_ns();
	if (fails) {
		kill(srv, SIGKILL);
		waitpid(srv, NULL, 0);
		return fails;
	}
	if (ct_wait_child(srv, "the server of short-lived clients"))
		return 1;
	CT_CHECK(read(churn_pipe[0], &r, sizeof(r)) == sizeof(r), "report");
	close(churn_pipe[0]);
	close(churn_pipe[1]);
	ct_note("%d client processes x %d VQPs in turn: %.1f s (%.1f ms per process)", nprocs, nvqps,
		(double)(t_clients - t0) / 1e9, (double)(t_clients - t0) / 1e6 / nprocs);
	ct_note("a client process on average: %.0f ms fork to exit; device, PD, CQs, MR %.0f ms; first VQP (meta connection, link) %.0f ms; the other %d VQPs %.0f ms; freeing %.0f ms",
		life_ms / nprocs, sum.open_ms / nprocs, sum.first_ms / nprocs, nvqps - 1, sum.vqps_ms / nprocs,
		sum.close_ms / nprocs);
	ct_note("figure server_rss_warm=%lld (VmRSS after %d clients; RssAnon %lld, heap %lld)",
		(long long)r.warm.rss, WARM_CLIENTS, (long long)r.warm.anon, (long long)r.warm.heap);
	ct_note("figure server_rss_end=%lld (VmRSS after %d clients; RssAnon %lld, heap %lld)",
		(long long)r.end.rss, total, (long long)r.end.anon, (long long)r.end.heap);
	ct_note("figure server_growth_after_warmup=%+lld (VmRSS; RssAnon %+lld, heap %+lld)",
		(long long)(r.end.rss - r.warm.rss), (long long)(r.end.anon - r.warm.anon),
		(long long)(r.end.heap - r.warm.heap));
	ct_note("figure server_rss_reclaimed=%lld (VmRSS once every client's link was reclaimed, %.0f ms after the last close; RssAnon %lld, heap %lld)",
		(long long)r.reclaimed.rss, r.reclaim_ms, (long long)r.reclaimed.anon,
		(long long)r.reclaimed.heap);
	{
		char line[1024];
		size_t used = 0;

		for (int c = 0; c < total / CHECKPOINT && c < MAX_CHECKPOINTS; c++)
			used += (size_t)snprintf(line + used, sizeof(line) - used, " %.2f/%.2f/%.2f",
						 mib(r.series[c].rss), mib(r.series[c].anon),
						 mib(r.series[c].heap));
		ct_note("server VmRSS/RssAnon/heap MiB every %d clients:%s; heap peak after the warm-up %.2f MiB",
			CHECKPOINT, line, mib(r.heap_peak));
	}
	ct_note("figure server_links_max=%llu (links_opened %llu; at the end %llu links, %llu VQPs, baseline %llu)",
		(unsigned long long)r.links_max, (unsigned long long)r.links_opened_end,
		(unsigned long long)r.links_end, (unsigned long long)r.vqps_end,
		(unsigned long long)r.vqps_base);
	ct_note("%d of the %d close reports came after the next process's first message (found by the link's death, not a CLOSE)",
		r.late_closes, total);
	ct_note("figure part2_seconds=%.1f", ms_since(t0) / 1000.0);
	CT_CHECK(r.links_opened_end == (uint64_t)nprocs * links_per_peer() || r.links_opened_end == (uint64_t)nprocs,
		 "the server opened %llu links for %d processes", (unsigned long long)r.links_opened_end, nprocs);
	CT_CHECK(r.reclaimed.heap - r.warm.heap < HEAP_GROWTH,
		 "server heap grew by %lld bytes after the warm-up, once every client was gone",
		 (long long)(r.reclaimed.heap - r.warm.heap));
	CT_CHECK(r.end.rss - r.warm.rss < RSS_GROWTH && r.end.anon - r.warm.anon < RSS_GROWTH,
		 "server RSS grew by %lld bytes (anon %lld) after the warm-up", (long long)(r.end.rss - r.warm.rss),
		 (long long)(r.end.anon - r.warm.anon));
	/* A mapping left behind per client process (a link's buffers, a
	 * thread's stack) would add one per process. */
	CT_CHECK(r.end.maps - r.warm.maps < MAPS_GROWTH, "server mappings %lld after the warm-up, %lld at the end",
		 (long long)r.warm.maps, (long long)r.end.maps);
	ct_pass();
	return 0;
}

int main(void)
{
	pid_t meta_pid;
	int fails;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library: every
	 * process forked below gets these. */
	setenv("KRCORE_LINK_PROBE_MS", PROBE_MS, 1);
	/* Nine processes start at once on two emulated CPUs. */
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "10000", 1);
	ct_watchdog(120);
	meta_pid = ct_start_meta();
	fails = spread();
	if (!fails)
		fails += churn();
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
