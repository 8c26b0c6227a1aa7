/*
 * Teardown of a VQP while its work is still on the shared link (issue 18,
 * items 1 and 2). Two processes, node 1 (this one) and node 2 (a peer),
 * with transparent VQPs (KRCORE_VIRTUALIZE=1): every pair of RC QPs
 * between them shares one link. In each case VQP 1 puts work on the link
 * and is torn down at once; VQP 2, on the same link, then moves checked
 * data, and the counter links_failed stays 0 in both processes.
 *
 * - destroy: a 8 MiB READ on VQP 1, ibv_destroy_qp at once; a canary
 *   written over the buffer after destroy returned must survive VQP 2's
 *   WRITE and READ behind it (RC order: once they completed, the link is
 *   done with the READ). How long destroy waited is printed.
 * - ERR: the same with ibv_modify_qp(ERR): the canary is written once the
 *   READ's flush completion was polled.
 * - RESET: the same with ibv_modify_qp(RESET): the canary is written once
 *   it returned.
 * - ERR, then deregister and munmap: a 8 MiB READ into a buffer of its
 *   own, ERR, its flush completion polled, then ibv_dereg_mr and munmap
 *   at once: nothing faults, no link fails, VQP 2 moves data.
 * - an MR deregistered while its WQE is queued: VQP 2 WRITEs 8 MiB, VQP 1
 *   a page from a small MR behind it, and the small MR is deregistered
 *   right after the post: both WRITEs complete successfully and the peer
 *   finds both payloads, byte for byte; no link fails.
 *
 * - ibv_rereg_mr honours the MR lease: the peer re-registers an MR node 1
 *   just READ (without remote access now); a READ with the old key right
 *   after, within the lease node 1's check holds for, still succeeds and
 *   no link fails (the old registration stays for the lease).
 *
 * - a WQE stuck behind RNR (run last: it fails the link): the peer is
 *   stopped (SIGSTOP: its service thread cannot repost the link's shared
 *   receive queue, though rxe keeps answering in the kernel), VQP 1 SENDs
 *   until its SENDs stop completing (the peer's receives are used up;
 *   the link retries RNR forever, rnr_retry 7), a READ is queued behind
 *   them, and ibv_destroy_qp must return within TRANSPORT_WAIT (10 s) plus
 *   the connect timeout (and a margin), having failed the link
 *   (links_failed 1, VQP 2 on it in ERR); a canary written over the READ's
 *   buffer after it returned survives; the peer resumed (SIGCONT), a new
 *   pair of VQPs to it moves checked data over a new link.
 * - the same with ibv_modify_qp(ERR) instead of destroy: every WR in
 *   flight (the stuck SENDs, then the READ) gets its flush completion, in
 *   order, within the same bound, the link failed; the canary is written
 *   after the last one; ibv_destroy_qp then returns at once.
 *
 * CT_ONLY=destroy|err|reset|err_unmap|dereg_queued|rereg_lease|rnr|rnr_err runs one case.
 * KRCORE_MR_CACHE=0: a deregistration is then the real one at once (with
 * the cache it would wait for the cache's eviction, hiding the failure).
 * krcore-meta is started here on node 1.
 */
#define _GNU_SOURCE
#include "common.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define BIG (8u << 20)		/* the transfer torn down under: rxe's max_msg_sz */
#define SMALL 4096u		/* the queued WRITE of the dereg case */
#define WIT (64u << 10)		/* VQP 2's checked transfers */
#define SRC_SEED 7u		/* the peer's READ source */
#define CANARY 0xc5
#define LEASE_LEN 4096u
#define LEASE_SEED 9u
#define RNR_SENDS 400u		/* above the peer's link receives (service Options::srq_wr: 256) */
#define RNR_DEPTH 15		/* VQP 1's SENDs in flight at most: room for the READ */
#define TRANSPORT_WAIT_MS 10000	/* src/vqp/runtime.rs */
#define CONNECT_TIMEOUT_MS 10000	/* KRCORE_CONNECT_TIMEOUT_MS, set in main */

/* ---- out of band --------------------------------------------------------- */

/* What the peer offers: its READ source (BIG bytes of SRC_SEED's pattern)
 * and a WRITE target (BIG + WIT bytes), one MR. */
struct offer {
	uint64_t src, dst;
	uint32_t rkey;
	/* A small MR of its own (LEASE_LEN bytes of LEASE_SEED's pattern,
	 * remote READ) that it re-registers on 'R'. */
	uint64_t lease_addr;
	uint32_t lease_rkey;
};

/* A command to the peer: 'Q' make a pair of QPs, 'V' verify a range of
 * its WRITE target, 'R' re-register its small MR without remote access,
 * 'X' finish (seed: how many of its links may have failed). */
struct cmd {
	char op;
	uint32_t seed;
	uint64_t off, len;
};

/* ---- the peer (node 2) --------------------------------------------------- */

static int peer(int fd)
{
	struct ct_node n;
	struct ibv_qp *qps[64];
	int nq = 0;
	union ibv_gid g1 = ct_node_gid(1);
	struct offer o;
	static uint8_t lease_buf[LEASE_LEN] __attribute__((aligned(4096)));
	struct ibv_mr *lease_mr;

	ct_begin("vqp_teardown: peer");
	ct_node_open(&n, 2, 2 * (size_t)BIG + WIT, 64);
	ct_fill(n.b.p, BIG, SRC_SEED);
	ct_fill(lease_buf, LEASE_LEN, LEASE_SEED);
	lease_mr = CT_PTR(ibv_reg_mr(n.d.pd, lease_buf, LEASE_LEN,
				     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
	o.src = (uintptr_t)n.b.p;
	o.dst = (uintptr_t)n.b.p + BIG;
	o.rkey = n.b.mr->rkey;
	o.lease_addr = (uintptr_t)lease_buf;
	o.lease_rkey = lease_mr->rkey;
	ct_oob_write(fd, &o, sizeof(o));
	for (;;) {
		struct cmd c;

		ct_oob_read(fd, &c, sizeof(c));
		if (c.op == 'Q') {
			uint32_t mine[2], theirs[2];
			char go;

			for (int i = 0; i < 2; i++) {
				CT_CHECK(nq < 64, "too many QPs");
				qps[nq + i] = ct_create_rc_qp(&n.d, n.scq, n.rcq, NULL,
							      (struct ct_qp_caps){ 16, 16, 1, 1, 0, 0 });
				mine[i] = qps[nq + i]->qp_num;
			}
			ct_oob_write(fd, mine, sizeof(mine));
			ct_oob_read(fd, theirs, sizeof(theirs));
			/* Node 1 connects first (its RTR makes the link). */
			ct_oob_read(fd, &go, 1);
			for (int i = 0; i < 2; i++)
				CT_OK(ct_connect_qp(&n.d, qps[nq + i], n.d.gid_idx[0], theirs[i], &g1));
			nq += 2;
			ct_oob_write(fd, "c", 1);
		} else if (c.op == 'V') {
			char ok = 'Y';
			uint8_t *p = n.b.p + BIG + c.off;
			uint8_t *want = malloc(c.len);

			CT_CHECK(want != NULL, "alloc");
			ct_fill(want, c.len, c.seed);
			if (memcmp(p, want, c.len) != 0)
				ok = 'N';
			free(want);
			ct_oob_write(fd, &ok, 1);
		} else if (c.op == 'R') {
			/* Peers checked it within their lease: they may still
			 * READ it with the old key for that long. */
			CT_CHECK(ibv_rereg_mr(lease_mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
					      IBV_ACCESS_LOCAL_WRITE) == 0,
				 "ibv_rereg_mr: %s", strerror(errno));
			ct_oob_write(fd, "r", 1);
		} else if (c.op == 'X') {
			uint64_t failed = krcore_stat_get(KRCORE_STAT_LINKS_FAILED);

			for (int i = 0; i < nq; i++)
				CT_OK(ibv_destroy_qp(qps[i]));
			ct_oob_write(fd, &failed, sizeof(failed));
			CT_CHECK(failed <= c.seed, "links failed at the peer: %llu", (unsigned long long)failed);
			ct_pass();
			return 0;
		} else {
			CT_FAIL("unknown command %#x", c.op);
		}
	}
}

/* ---- node 1 -------------------------------------------------------------- */

struct t {
	struct ct_node n;	/* n.b: BIG bytes (canary / WRITE source), then 2 * WIT */
	int fd;
	pid_t peer;
	uint32_t peer_may_fail;	/* links the peer may see failed (the rnr case) */
	struct offer o;
	union ibv_gid g2;
};

static void cmd(struct t *t, char op, uint32_t seed, uint64_t off, uint64_t len)
{
	struct cmd c = { .op = op, .seed = seed, .off = off, .len = len };

	ct_oob_write(t->fd, &c, sizeof(c));
}

/* Two transparent VQPs connected to two of the peer's: one link. */
static void pair(struct t *t, struct ibv_qp **q1, struct ibv_qp **q2)
{
	struct ibv_qp *q[2];
	uint32_t mine[2], theirs[2];
	char ack;

	for (int i = 0; i < 2; i++) {
		q[i] = ct_create_rc_qp(&t->n.d, t->n.scq, t->n.rcq, NULL,
				       (struct ct_qp_caps){ 16, 16, 1, 1, 0, 0 });
		mine[i] = q[i]->qp_num;
	}
	cmd(t, 'Q', 0, 0, 0);
	ct_oob_read(t->fd, theirs, sizeof(theirs));
	ct_oob_write(t->fd, mine, sizeof(mine));
	for (int i = 0; i < 2; i++)
		CT_OK(ct_connect_qp(&t->n.d, q[i], t->n.d.gid_idx[0], theirs[i], &t->g2));
	ct_oob_write(t->fd, "C", 1);
	ct_oob_read(t->fd, &ack, 1);
	CT_CHECK(ack == 'c', "peer connect: '%c'", ack);
	*q1 = q[0];
	*q2 = q[1];
}

static int post1(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op, void *addr, uint32_t len,
		 uint32_t lkey, uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { (uintptr_t)addr, len, lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;

	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

/* `n` completions on the send CQ, passing over one of VQP 1's torn-down
 * READ (wr_id 11): a destroy or RESET that waited for the READ may have
 * seen it complete first, and RC keeps a completion made before the
 * destroy in the CQ. */
static void poll_skipping_torn(struct t *t, struct ibv_wc *wc, int n)
{
	int got = 0, torn = 0;

	while (got < n) {
		ct_poll_n(t->n.scq, &wc[got], 1, CT_TIMEOUT_MS);
		if (wc[got].wr_id == 11) {
			CT_CHECK(!torn++ && (wc[got].status == IBV_WC_SUCCESS ||
					     wc[got].status == IBV_WC_WR_FLUSH_ERR),
				 "VQP 1's READ completed again, or with %s", ibv_wc_status_str(wc[got].status));
			continue;
		}
		got++;
	}
}

/* VQP 2 moves checked data over the same link: a WRITE the peer checks and
 * a READ checked here. RC order: once both completed, every WQE posted on
 * the link before them completed too. */
static void witness(struct t *t, struct ibv_qp *q2, uint32_t seed)
{
	uint8_t *w = t->n.b.p + BIG, *r = w + WIT;
	struct ibv_wc wc[2];
	char ok;

	ct_fill(w, WIT, seed);
	memset(r, 0, WIT);
	CT_OK(post1(q2, 21, IBV_WR_RDMA_WRITE, w, WIT, t->n.b.mr->lkey, t->o.dst + BIG, t->o.rkey));
	CT_OK(post1(q2, 22, IBV_WR_RDMA_READ, r, WIT, t->n.b.mr->lkey, t->o.src, t->o.rkey));
	poll_skipping_torn(t, wc, 2);
	for (int i = 0; i < 2; i++)
		CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].wr_id == 21u + (unsigned)i,
			 "VQP 2's %s: %s (wr_id %llu)", i ? "READ" : "WRITE",
			 ibv_wc_status_str(wc[i].status), (unsigned long long)wc[i].wr_id);
	ct_expect_pattern(r, WIT, SRC_SEED, "VQP 2's READ");
	cmd(t, 'V', seed, BIG, WIT);
	ct_oob_read(t->fd, &ok, 1);
	CT_CHECK(ok == 'Y', "the peer did not find VQP 2's WRITE");
}

static void expect_canary(const uint8_t *p, size_t len, const char *what)
{
	for (size_t i = 0; i < len; i++)
		CT_CHECK(p[i] == CANARY, "%s: byte %zu is %#x, not the canary: the READ landed after the teardown",
			 what, i, p[i]);
}

/* Post the 8 MiB READ on VQP 1 into `dst` (MR `lkey`). */
static void big_read(struct t *t, struct ibv_qp *q1, void *dst, uint32_t lkey)
{
	CT_OK(post1(q1, 11, IBV_WR_RDMA_READ, dst, BIG, lkey, t->o.src, t->o.rkey));
}

static void expect_flush(struct t *t, const char *what)
{
	struct ibv_wc wc;

	ct_poll_n(t->n.scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.wr_id == 11 && (wc.status == IBV_WC_WR_FLUSH_ERR || wc.status == IBV_WC_SUCCESS),
		 "%s: VQP 1's READ completed with %s (wr_id %llu)", what, ibv_wc_status_str(wc.status),
		 (unsigned long long)wc.wr_id);
}

static void modify_state(struct ibv_qp *qp, enum ibv_qp_state s)
{
	struct ibv_qp_attr a = { .qp_state = s };

	CT_OK(ibv_modify_qp(qp, &a, IBV_QP_STATE));
}

static double ms_since(uint64_t t0)
{
	return (double)(ct_now_ns() - t0) / 1e6;
}

static void case_destroy(struct t *t)
{
	struct ibv_qp *q1, *q2;
	struct ibv_wc wc;
	uint64_t t0;
	double plain, waited;

	ct_begin("vqp_teardown: destroy with a 8 MiB READ in flight");
	pair(t, &q1, &q2);
	/* How long the READ takes by itself, for comparison. */
	memset(t->n.b.p, 0, BIG);
	t0 = ct_now_ns();
	CT_OK(post1(q2, 10, IBV_WR_RDMA_READ, t->n.b.p, BIG, t->n.b.mr->lkey, t->o.src, t->o.rkey));
	ct_poll_n(t->n.scq, &wc, 1, CT_TIMEOUT_MS);
	plain = ms_since(t0);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "plain READ: %s", ibv_wc_status_str(wc.status));
	ct_expect_pattern(t->n.b.p, BIG, SRC_SEED, "plain 8 MiB READ");

	memset(t->n.b.p, 0, BIG);
	big_read(t, q1, t->n.b.p, t->n.b.mr->lkey);
	t0 = ct_now_ns();
	CT_OK(ibv_destroy_qp(q1));
	waited = ms_since(t0);
	memset(t->n.b.p, CANARY, BIG);
	witness(t, q2, 101);
	expect_canary(t->n.b.p, BIG, "after ibv_destroy_qp");
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	ct_note("ibv_destroy_qp with a 8 MiB READ in flight returned after %.1f ms (the READ alone: %.1f ms)",
		waited, plain);
	CT_OK(ibv_destroy_qp(q2));
	ct_pass();
}

static void case_err(struct t *t)
{
	struct ibv_qp *q1, *q2;
	uint64_t t0;

	ct_begin("vqp_teardown: ERR with a 8 MiB READ in flight");
	pair(t, &q1, &q2);
	memset(t->n.b.p, 0, BIG);
	big_read(t, q1, t->n.b.p, t->n.b.mr->lkey);
	t0 = ct_now_ns();
	modify_state(q1, IBV_QPS_ERR);
	expect_flush(t, "ERR");
	ct_note("ERR: the READ's flush completion came %.1f ms after the modify", ms_since(t0));
	memset(t->n.b.p, CANARY, BIG);
	witness(t, q2, 102);
	expect_canary(t->n.b.p, BIG, "after the flush completion");
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	CT_OK(ibv_destroy_qp(q1));
	CT_OK(ibv_destroy_qp(q2));
	ct_pass();
}

static void case_reset(struct t *t)
{
	struct ibv_qp *q1, *q2;
	uint64_t t0;

	ct_begin("vqp_teardown: RESET with a 8 MiB READ in flight");
	pair(t, &q1, &q2);
	memset(t->n.b.p, 0, BIG);
	big_read(t, q1, t->n.b.p, t->n.b.mr->lkey);
	t0 = ct_now_ns();
	modify_state(q1, IBV_QPS_RESET);
	ct_note("RESET returned after %.1f ms", ms_since(t0));
	memset(t->n.b.p, CANARY, BIG);
	witness(t, q2, 103);
	expect_canary(t->n.b.p, BIG, "after RESET");
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	CT_OK(ibv_destroy_qp(q1));
	CT_OK(ibv_destroy_qp(q2));
	ct_pass();
}

static void case_err_unmap(struct t *t)
{
	struct ibv_qp *q1, *q2;
	struct ibv_mr *mr;
	uint8_t *p;

	ct_begin("vqp_teardown: ERR, then deregister and munmap the READ's buffer");
	pair(t, &q1, &q2);
	p = mmap(NULL, BIG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CT_CHECK(p != MAP_FAILED, "mmap: %s", strerror(errno));
	mr = CT_PTR(ibv_reg_mr(t->n.d.pd, p, BIG, IBV_ACCESS_LOCAL_WRITE));
	big_read(t, q1, p, mr->lkey);
	modify_state(q1, IBV_QPS_ERR);
	expect_flush(t, "ERR");
	CT_OK(ibv_dereg_mr(mr));
	CT_CHECK(munmap(p, BIG) == 0, "munmap: %s", strerror(errno));
	witness(t, q2, 104);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	CT_OK(ibv_destroy_qp(q1));
	CT_OK(ibv_destroy_qp(q2));
	ct_pass();
}

static void case_rereg_lease(struct t *t)
{
	struct ibv_qp *q1, *q2;
	uint8_t *r = t->n.b.p + BIG;
	struct ibv_wc wc;
	char ack;

	ct_begin("vqp_teardown: ibv_rereg_mr honours the MR lease");
	pair(t, &q1, &q2);
	for (int i = 0; i < 2; i++) {
		memset(r, 0, LEASE_LEN);
		CT_OK(post1(q1, 41 + (uint64_t)i, IBV_WR_RDMA_READ, r, LEASE_LEN, t->n.b.mr->lkey,
			    t->o.lease_addr, t->o.lease_rkey));
		ct_poll_n(t->n.scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 41u + (unsigned)i,
			 "READ %d of the peer's MR: %s", i, ibv_wc_status_str(wc.status));
		ct_expect_pattern(r, LEASE_LEN, LEASE_SEED, "READ of the peer's MR");
		if (i == 0) {
			/* Re-registered without remote access: our check of it
			 * (just made) holds for the lease, so must its key. */
			cmd(t, 'R', 0, 0, 0);
			ct_oob_read(t->fd, &ack, 1);
			CT_CHECK(ack == 'r', "rereg: '%c'", ack);
		}
	}
	witness(t, q2, 106);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	CT_OK(ibv_destroy_qp(q1));
	CT_OK(ibv_destroy_qp(q2));
	ct_pass();
}

static void case_dereg_queued(struct t *t)
{
	static uint8_t small[SMALL] __attribute__((aligned(4096)));
	struct ibv_qp *q1, *q2;
	struct ibv_mr *mr;
	struct ibv_wc wc[2];
	char ok;

	ct_begin("vqp_teardown: an MR deregistered while its WQE is queued on the link");
	pair(t, &q1, &q2);
	ct_fill(t->n.b.p, BIG, 201);
	ct_fill(small, SMALL, 202);
	mr = CT_PTR(ibv_reg_mr(t->n.d.pd, small, SMALL, IBV_ACCESS_LOCAL_WRITE));
	/* VQP 2's 8 MiB WRITE first: VQP 1's WRITE waits behind it. */
	CT_OK(post1(q2, 31, IBV_WR_RDMA_WRITE, t->n.b.p, BIG, t->n.b.mr->lkey, t->o.dst, t->o.rkey));
	CT_OK(post1(q1, 32, IBV_WR_RDMA_WRITE, small, SMALL, mr->lkey, t->o.dst + BIG, t->o.rkey));
	CT_OK(ibv_dereg_mr(mr));
	ct_poll_n(t->n.scq, wc, 2, CT_TIMEOUT_MS);
	for (int i = 0; i < 2; i++)
		CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].wr_id == 31u + (unsigned)i,
			 "WRITE %d: %s (wr_id %llu)", i, ibv_wc_status_str(wc[i].status),
			 (unsigned long long)wc[i].wr_id);
	cmd(t, 'V', 201, 0, BIG);
	ct_oob_read(t->fd, &ok, 1);
	CT_CHECK(ok == 'Y', "the peer did not find VQP 2's 8 MiB WRITE");
	cmd(t, 'V', 202, BIG, SMALL);
	ct_oob_read(t->fd, &ok, 1);
	CT_CHECK(ok == 'Y', "the peer did not find VQP 1's WRITE from the deregistered MR");
	witness(t, q2, 105);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	CT_OK(ibv_destroy_qp(q1));
	CT_OK(ibv_destroy_qp(q2));
	ct_pass();
}

/* VQP 1 SENDs until they stop completing: the peer (stopped) has no
 * receive left on the link. Returns how many completed; *posted: how many
 * were posted. */
static uint32_t send_until_stuck(struct t *t, struct ibv_qp *q1, uint32_t *posted_out)
{
	uint32_t posted = 0, done = 0;
	uint8_t *src = t->n.b.p + BIG;

	ct_fill(src, 64, 301);
	for (;;) {
		struct ibv_wc wc;
		uint64_t t0;
		int k = 0;

		while (posted < RNR_SENDS && posted - done < RNR_DEPTH) {
			CT_OK(post1(q1, 1000 + posted, IBV_WR_SEND, src, 64, t->n.b.mr->lkey, 0, 0));
			posted++;
		}
		/* A SEND completes within a millisecond while the peer has
		 * receives: CT_QUIET_MS without one, it waits behind RNR. */
		t0 = ct_now_ns();
		while (k == 0 && ct_now_ns() - t0 < (uint64_t)CT_QUIET_MS * 1000000)
			k = ibv_poll_cq(t->n.scq, 1, &wc);
		CT_CHECK(k >= 0, "ibv_poll_cq: %d", k);
		if (k == 0)
			break;
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1000u + done,
			 "SEND %u: %s (wr_id %llu)", done, ibv_wc_status_str(wc.status),
			 (unsigned long long)wc.wr_id);
		done++;
		CT_CHECK(done < RNR_SENDS, "all %u SENDs completed with the peer stopped", RNR_SENDS);
	}
	CT_CHECK(posted > done, "nothing in flight");
	*posted_out = posted;
	return done;
}

/* A pair on one link, checked, then the peer stopped and VQP 1 stuck
 * behind RNR with a READ (wr_id 11, into the canary area) queued behind
 * its SENDs. */
static void stuck_pair(struct t *t, struct ibv_qp **q1, struct ibv_qp **q2, uint32_t seed,
		       uint32_t *sent, uint32_t *posted)
{
	int st;

	uint64_t t0 = ct_now_ns();

	pair(t, q1, q2);
	witness(t, *q2, seed);
	/* RNR is the link's matter: the datagram tier may carry a new pair
	 * until its link, made in the background, is up. VQP 1 takes the link
	 * at its next post. */
	while (krcore_stat_get(KRCORE_STAT_LINKS) == 0)
		CT_CHECK(ms_since(t0) < CT_TIMEOUT_MS, "no link to the peer after %d ms", CT_TIMEOUT_MS);
	witness(t, *q1, seed);
	CT_CHECK(kill(t->peer, SIGSTOP) == 0, "SIGSTOP: %s", strerror(errno));
	CT_CHECK(waitpid(t->peer, &st, WUNTRACED) == t->peer && WIFSTOPPED(st), "the peer did not stop");
	t->peer_may_fail++;
	*sent = send_until_stuck(t, *q1, posted);
	memset(t->n.b.p, 0, BIG);
	CT_OK(post1(*q1, 11, IBV_WR_RDMA_READ, t->n.b.p, WIT, t->n.b.mr->lkey, t->o.src, t->o.rkey));
}

/* After the stuck link failed: VQP 2 (on it) is in ERR; the peer resumed,
 * a new pair to it moves checked data over a new link, and the canary
 * written after the teardown survived. */
static void after_failed_link(struct t *t, struct ibv_qp *q2, uint64_t failed_before, uint32_t seed,
			      const char *what)
{
	struct ibv_qp *q3, *q4;
	uint64_t t0 = ct_now_ns();

	CT_CHECK(krcore_stat_get(KRCORE_STAT_LINKS_FAILED) == failed_before + 1, "links_failed %llu, expected %llu",
		 (unsigned long long)krcore_stat_get(KRCORE_STAT_LINKS_FAILED), (unsigned long long)failed_before + 1);
	while (ct_qp_state(q2) != IBV_QPS_ERR)
		CT_CHECK(ms_since(t0) < CT_TIMEOUT_MS, "VQP 2 not in ERR after its link failed");
	CT_OK(ibv_destroy_qp(q2));
	CT_CHECK(kill(t->peer, SIGCONT) == 0, "SIGCONT: %s", strerror(errno));
	t0 = ct_now_ns();
	pair(t, &q3, &q4);
	ct_note("the resumed peer: a new pair connected in %.1f ms", ms_since(t0));
	witness(t, q4, seed);
	witness(t, q3, seed + 1);
	expect_canary(t->n.b.p, BIG, what);
	CT_CHECK(krcore_stat_get(KRCORE_STAT_LINKS_FAILED) == failed_before + 1, "another link failed");
	CT_OK(ibv_destroy_qp(q3));
	CT_OK(ibv_destroy_qp(q4));
}

static void case_rnr(struct t *t)
{
	struct ibv_qp *q1, *q2;
	uint64_t t0, failed = krcore_stat_get(KRCORE_STAT_LINKS_FAILED);
	uint32_t sent, posted;
	double waited;
	int k;
	struct ibv_wc wc;

	ct_begin("vqp_teardown: destroy with a WQE stuck behind RNR (the peer stopped)");
	stuck_pair(t, &q1, &q2, 107, &sent, &posted);
	t0 = ct_now_ns();
	CT_OK(ibv_destroy_qp(q1));
	waited = ms_since(t0);
	memset(t->n.b.p, CANARY, BIG);
	ct_note("%u SENDs completed before RNR; ibv_destroy_qp with a WQE stuck behind it returned after %.1f ms",
		sent, waited);
	CT_CHECK(waited < TRANSPORT_WAIT_MS + CONNECT_TIMEOUT_MS + 2000, "ibv_destroy_qp took %.1f ms", waited);
	/* VQP 1's completions made before the destroy: its SENDs, flushed. */
	while ((k = ibv_poll_cq(t->n.scq, 1, &wc)) > 0)
		CT_CHECK((wc.wr_id >= 1000 && wc.wr_id < 1000u + posted) || wc.wr_id == 11,
			 "a completion of wr_id %llu (%s)", (unsigned long long)wc.wr_id,
			 ibv_wc_status_str(wc.status));
	after_failed_link(t, q2, failed, 108, "after ibv_destroy_qp of a VQP stuck behind RNR");
	ct_pass();
}

static void case_rnr_err(struct t *t)
{
	struct ibv_qp *q1, *q2;
	uint64_t t0, failed = krcore_stat_get(KRCORE_STAT_LINKS_FAILED);
	uint32_t sent, posted, next;
	double waited, destroyed;
	struct ibv_wc wc;

	ct_begin("vqp_teardown: ERR with a WQE stuck behind RNR (the peer stopped)");
	stuck_pair(t, &q1, &q2, 110, &sent, &posted);
	t0 = ct_now_ns();
	modify_state(q1, IBV_QPS_ERR);
	/* Every WR in flight is flushed, in order: the SENDs not completed,
	 * then the READ. */
	for (next = sent; next <= posted; next++) {
		uint64_t want = next < posted ? 1000u + next : 11;
		int k = 0;

		while (k == 0) {
			k = ibv_poll_cq(t->n.scq, 1, &wc);
			CT_CHECK(k >= 0, "ibv_poll_cq: %d", k);
			CT_CHECK(ms_since(t0) < TRANSPORT_WAIT_MS + CONNECT_TIMEOUT_MS + 2000,
				 "ERR: no flush completion of wr_id %llu after %.1f ms (%u of %u WRs flushed)",
				 (unsigned long long)want, ms_since(t0), next - sent, posted + 1 - sent);
		}
		CT_CHECK(wc.wr_id == want && wc.status == IBV_WC_WR_FLUSH_ERR,
			 "ERR: wr_id %llu completed with %s, expected wr_id %llu flushed",
			 (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status), (unsigned long long)want);
	}
	waited = ms_since(t0);
	memset(t->n.b.p, CANARY, BIG);
	ct_note("%u SENDs completed before RNR; ERR: the last flush completion came after %.1f ms", sent, waited);
	t0 = ct_now_ns();
	CT_OK(ibv_destroy_qp(q1));
	destroyed = ms_since(t0);
	ct_note("ibv_destroy_qp after those flush completions: %.1f ms", destroyed);
	CT_CHECK(destroyed < 1000, "ibv_destroy_qp took %.1f ms once the link was done", destroyed);
	after_failed_link(t, q2, failed, 111, "after the flush completions of ERR behind RNR");
	ct_pass();
}

int main(void)
{
	struct t *t;
	pid_t meta_pid, pid;
	int sv[2], fails;
	uint64_t peer_failed;

	setvbuf(stdout, NULL, _IOLBF, 0);
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "10000", 1);
	setenv("KRCORE_MR_CACHE", "0", 1);
	ct_watchdog(180);
	meta_pid = ct_start_meta();
	setenv("KRCORE_VIRTUALIZE", "1", 1);
	CT_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		close(sv[0]);
		_exit(peer(sv[1]));
	}
	close(sv[1]);
	t = calloc(1, sizeof(*t));
	CT_CHECK(t != NULL, "alloc");
	t->fd = sv[0];
	t->peer = pid;
	t->g2 = ct_node_gid(2);
	ct_node_open(&t->n, 1, (size_t)BIG + 2 * WIT, 64);
	ct_oob_read(t->fd, &t->o, sizeof(t->o));

	/* CT_ONLY=<name>: that case alone (to see one fail on its own). */
	{
		const char *only = getenv("CT_ONLY");
		static const struct {
			const char *name;
			void (*run)(struct t *);
		} cases[] = { { "destroy", case_destroy }, { "err", case_err }, { "reset", case_reset },
			      { "err_unmap", case_err_unmap }, { "dereg_queued", case_dereg_queued },
			      { "rereg_lease", case_rereg_lease }, { "rnr", case_rnr },
			      { "rnr_err", case_rnr_err } };

		for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
			if (!only || strcmp(only, cases[i].name) == 0)
				cases[i].run(t);
	}

	ct_begin("vqp_teardown: the peer");
	cmd(t, 'X', t->peer_may_fail, 0, 0);
	ct_oob_read(t->fd, &peer_failed, sizeof(peer_failed));
	fails = ct_wait_child(pid, "the peer");
	CT_CHECK(fails == 0 && peer_failed <= t->peer_may_fail, "peer: exit %d, links failed %llu", fails,
		 (unsigned long long)peer_failed);
	ct_buf_free(&t->n.b);
	CT_OK(ibv_destroy_cq(t->n.scq));
	CT_OK(ibv_destroy_cq(t->n.rcq));
	ct_close(&t->n.d);
	close(t->fd);
	free(t);
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	ct_pass();
	return 0;
}
