/*
 * Transparent VQPs (KRCORE_VIRTUALIZE=1, issue 8) on several emulated
 * nodes: ordinary RC QPs, created with ibv_create_qp and connected with
 * ibv_modify_qp using QPNs exchanged out of band (socketpairs), become
 * virtual QPs on shared links. krcore-meta is started here on node 1.
 * Node 1 is this process; PEERS peer processes run on nodes 2..PEERS+1,
 * each given KRCORE_VIRTUALIZE=1 before its first use of the library (the
 * configuration is read once per process), and no KRCORE_GID_INDEX: each
 * uses the GID of its node (index = node) at RTR, as perftest -x does, and
 * the library finds the QPNs under those GIDs by itself.
 *
 * - scale: NQP RC QPs between node 1 and the peers (PER_PEER each), depth
 *   4, one CQ per process: every qp_num has bit 23 set and is unique;
 *   every QP carries a SEND with a pattern of its own, answered by the
 *   peer with another, both checked byte for byte; while all are
 *   connected, the gauge `links` is exactly one link per peer process
 *   (KRCORE_LINKS_PER_PEER=1; node 1 connects first so no two links are
 *   made at once), `qps_virtualized` and `vqps` count every QP;
 * - invalid transitions (RESET->RTS, RESET->RTR, RESET->INIT without a
 *   required attribute, INIT->RTS, an attribute INIT->RTR does not take,
 *   ERR->INIT, ERR->RTS) are EINVAL, the state unchanged, and a send in
 *   INIT is refused: the same return values as a real rxe QP gives
 *   (KRCORE_VIRTUALIZE unset, in a child);
 * - RTR naming a QPN nobody published (bit 23 set, or a real-looking
 *   one, or a GID no process serves) is ECONNREFUSED, the QP stays in
 *   INIT and then connects to the right QPN and moves data;
 * - mixed: a UD QP in a virtualized process stays real (its qp_num below
 *   0x800000, qps_virtualized and vqps unchanged) and exchanges checked
 *   UD messages with a peer's UD QP while four virtual RC QPs carry
 *   checked messages at the same time;
 * - ERR: receives posted on an RTS QP complete with IBV_WC_WR_FLUSH_ERR,
 *   in order, with their wr_ids and qp_num, once the QP is moved to ERR
 *   (real and virtual); a receive posted in ERR is accepted and flushed
 *   (rxe accepts it but never reports it); a send posted in ERR is
 *   accepted and flushed, as rxe does;
 * - RESET: a connected pair moved to RESET and connected again (both
 *   sides) moves data again, as a real RC pair does (checked on real QPs
 *   too).
 *
 * - defaults (children): with a KRCORE_META nothing listens at, RC QPs
 *   stay real, connect and move checked data, and the library writes one
 *   line on stderr (KRCORE_LOG unset); with the meta server and
 *   KRCORE_LOG=warn, local-only MRs (all rkey 0 on rxe) log no "not
 *   published" error, and a virtual pair moves data through them.
 *
 * The real-QP outcomes come from a child with KRCORE_VIRTUALIZE unset
 * (a loopback pair on GID A and B), run first. The default 3 s lease
 * holds: 1,000 published QPNs are renewed with one request per period.
 *
 * krcore-meta is found next to the library (target/release/krcore-meta)
 * or through KRCORE_META_BIN.
 */
#define _GNU_SOURCE
#include "common.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define PEERS 4
#define PER_PEER 250
#define NQP (PEERS * PER_PEER)
#define MAXQ (NQP + 32)
#define DEPTH 4
#define MSG 64			/* a message: its seed (4 bytes), then the pattern */
#define GRH 40			/* in front of every UD receive */
#define SLOT 128
#define UDN 8			/* UD messages each way */
#define QKEY 0x11333355u
#define VBIT 0x800000u
#define SEND_BIT (1ull << 62)
#define UD_BIT (1ull << 61)
#define REPLY 0x80000000u	/* seed of an answer: the question's ^ REPLY */
#define N_TIMED 64		/* QPs created to time ibv_create_qp */
#define WAIT_MS 30000		/* bound on every batch of completions */

struct qent {
	struct ibv_qp *qp;
	uint32_t seed_in, seed_out;
	uint32_t peer_qpn;	/* the QP it is connected to */
	int peer;		/* node 1: the peer process it is connected to */
};

struct ep {
	struct ct_dev d;
	int node;
	struct ibv_cq *cq;
	uint8_t *buf;		/* 2 slots per RC QP, then 2 * UDN for UD */
	struct ibv_mr *mr;
	struct qent q[MAXQ];
	int nq;
	struct ibv_qp *ud;
	struct ibv_ah *ah;	/* to the other side's UD QP */
	uint32_t ud_peer_qpn;
	int ud_seen[UDN];
};

/* ---- out of band --------------------------------------------------------- */

static void xput32(int fd, uint32_t v) { ct_oob_write(fd, &v, 4); }
static uint32_t xget32(int fd) { uint32_t v; ct_oob_read(fd, &v, 4); return v; }

static void expect_byte(int fd, char want)
{
	char c;

	ct_oob_read(fd, &c, 1);
	CT_CHECK(c == want, "out of band: '%c', expected '%c'", c, want);
}

static double secs_since(uint64_t t0)
{
	return (double)(ct_now_ns() - t0) / 1e9;
}

/* ---- one process's QPs ------------------------------------------------------ */

static uint8_t *rslot(struct ep *e, int k) { return e->buf + (size_t)(2 * k) * SLOT; }
static uint8_t *sslot(struct ep *e, int k) { return e->buf + (size_t)(2 * k + 1) * SLOT; }
static uint8_t *ud_rslot(struct ep *e, int m) { return e->buf + (size_t)(2 * MAXQ + m) * SLOT; }
static uint8_t *ud_sslot(struct ep *e, int m) { return e->buf + (size_t)(2 * MAXQ + UDN + m) * SLOT; }

static void ep_open(struct ep *e, int node)
{
	char idx[16];
	size_t len = (size_t)(2 * MAXQ + 2 * UDN) * SLOT;

	memset(e, 0, sizeof(*e));
	e->node = node;
	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	ct_open(&e->d);
	e->cq = CT_PTR(ibv_create_cq(e->d.ctx, 4096, NULL, NULL, 0));
	e->buf = aligned_alloc(4096, len);
	CT_CHECK(e->buf != NULL, "alloc");
	memset(e->buf, 0, len);
	e->mr = CT_PTR(ibv_reg_mr(e->d.pd, e->buf, len, IBV_ACCESS_LOCAL_WRITE));
}

static void ep_close(struct ep *e)
{
	for (int k = 0; k < e->nq; k++)
		CT_OK(ibv_destroy_qp(e->q[k].qp));
	if (e->ah)
		CT_OK(ibv_destroy_ah(e->ah));
	if (e->ud)
		CT_OK(ibv_destroy_qp(e->ud));
	CT_OK(ibv_dereg_mr(e->mr));
	CT_OK(ibv_destroy_cq(e->cq));
	free(e->buf);
	ct_close(&e->d);
}

static void make_msg(uint8_t *p, uint32_t seed)
{
	memcpy(p, &seed, 4);
	ct_fill(p + 4, MSG - 4, seed);
}

static void check_msg(const uint8_t *p, uint32_t want, const char *what)
{
	uint32_t seed;

	memcpy(&seed, p, 4);
	CT_CHECK(seed == want, "%s: message %#x, expected %#x", what, seed, want);
	ct_expect_pattern(p + 4, MSG - 4, want, what);
}

static void post_recv_rc(struct ep *e, int k)
{
	struct ibv_sge sge = { (uintptr_t)rslot(e, k), MSG, e->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)k, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr *bad = NULL;

	CT_OK(ibv_post_recv(e->q[k].qp, &wr, &bad));
}

static void post_send_rc(struct ep *e, int k)
{
	struct ibv_sge sge = { (uintptr_t)sslot(e, k), MSG, e->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = SEND_BIT | (uint64_t)k, .sg_list = &sge,
				  .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;

	make_msg(sslot(e, k), e->q[k].seed_out);
	CT_OK(ibv_post_send(e->q[k].qp, &wr, &bad));
}

/* A new RC QP (plain ibv_create_qp: virtual here), in INIT, its receive
 * posted; its index. */
static int rc_new(struct ep *e)
{
	int k = e->nq;
	struct ibv_qp *qp;

	CT_CHECK(k < MAXQ, "too many QPs");
	qp = ct_create_rc_qp(&e->d, e->cq, e->cq, NULL,
			     (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	CT_CHECK(qp->qp_num & VBIT, "RC qp_num %#x: not virtual (bit 23 clear)", qp->qp_num);
	CT_CHECK(qp->qp_num <= 0xffffff, "qp_num %#x above 24 bits", qp->qp_num);
	CT_CHECK(ct_qp_state(qp) == IBV_QPS_RESET, "a new QP is in RESET");
	e->q[k].qp = qp;
	e->nq++;
	CT_OK(ct_qp_init(&e->d, qp));
	post_recv_rc(e, k);
	return k;
}

static void rc_connect(struct ep *e, int k, int peer_node, uint32_t dqpn)
{
	union ibv_gid g = ct_node_gid(peer_node);
	int rc = ct_qp_rtr(&e->d, e->q[k].qp, e->node, dqpn, &g);

	CT_CHECK(rc == 0, "QP %d (%#x): RTR to QPN %#x on node %d: %s", k,
		 e->q[k].qp->qp_num, dqpn, peer_node, strerror(rc));
	CT_OK(ct_qp_rts(&e->d, e->q[k].qp));
	e->q[k].peer_qpn = dqpn;
}

static int find_qp(struct ep *e, uint32_t qpn)
{
	for (int k = 0; k < e->nq; k++)
		if (e->q[k].qp->qp_num == qpn)
			return k;
	return -1;
}

/* A UD QP in RTS with UDN receives posted, and an address handle to the
 * other side's node. */
static void ud_open(struct ep *e, int peer_node)
{
	struct ibv_qp_init_attr ia;
	struct ibv_qp_attr a;
	struct ibv_ah_attr ah;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = ia.recv_cq = e->cq;
	ia.qp_type = IBV_QPT_UD;
	ia.cap = (struct ibv_qp_cap){ UDN, UDN, 1, 1, 0 };
	e->ud = CT_PTR(ibv_create_qp(e->d.pd, &ia));
	CT_CHECK(e->ud->qp_type == IBV_QPT_UD, "UD qp_type %d", e->ud->qp_type);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = e->d.port;
	a.qkey = QKEY;
	CT_OK(ibv_modify_qp(e->ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					       IBV_QP_QKEY));
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	CT_OK(ibv_modify_qp(e->ud, &a, IBV_QP_STATE));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 1;
	CT_OK(ibv_modify_qp(e->ud, &a, IBV_QP_STATE | IBV_QP_SQ_PSN));
	for (int m = 0; m < UDN; m++) {
		struct ibv_sge sge = { (uintptr_t)ud_rslot(e, m), GRH + MSG, e->mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = UD_BIT | (uint64_t)m, .sg_list = &sge,
					  .num_sge = 1 };
		struct ibv_recv_wr *bad = NULL;

		CT_OK(ibv_post_recv(e->ud, &wr, &bad));
	}
	memset(&ah, 0, sizeof(ah));
	ah.is_global = 1;
	ah.grh.dgid = ct_node_gid(peer_node);
	ah.grh.sgid_index = (uint8_t)e->node;
	ah.grh.hop_limit = 64;
	ah.port_num = e->d.port;
	e->ah = CT_PTR(ibv_create_ah(e->d.pd, &ah));
}

static void post_send_ud(struct ep *e, int m, uint32_t seed)
{
	struct ibv_sge sge = { (uintptr_t)ud_sslot(e, m), MSG, e->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = UD_BIT | SEND_BIT | (uint64_t)m, .sg_list = &sge,
				  .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;

	wr.wr.ud.ah = e->ah;
	wr.wr.ud.remote_qpn = e->ud_peer_qpn;
	wr.wr.ud.remote_qkey = QKEY;
	make_msg(ud_sslot(e, m), seed);
	CT_OK(ibv_post_send(e->ud, &wr, &bad));
}

static uint32_t ud_seed(int m) { return 0x55000000u | (uint32_t)m; }

/*
 * Takes completions until `recvs` messages came in and `sends` sends
 * completed: every one successful; each RC message is the one its QP
 * expects (reposting its receive), each UD message one of the UDN expected,
 * once. `reply`: answer each message (a peer), which adds a send to wait for.
 */
static void pump(struct ep *e, int recvs, int sends, int reply)
{
	uint64_t deadline = ct_now_ns() + (uint64_t)WAIT_MS * 1000000ull;
	int got = 0, sent = 0;
	unsigned idle = 0;

	while (got < recvs || sent < sends + (reply ? got : 0)) {
		struct ibv_wc wc[32];
		int n = ibv_poll_cq(e->cq, 32, wc);

		CT_CHECK(n >= 0, "ibv_poll_cq: %d", n);
		if (!n) {
			CT_CHECK(ct_now_ns() < deadline,
				 "timeout after %d ms: %d of %d messages, %d of %d sends",
				 WAIT_MS, got, recvs, sent, sends + (reply ? got : 0));
			if (++idle > 1000)
				usleep(100);
			continue;
		}
		idle = 0;
		for (int i = 0; i < n; i++) {
			struct ibv_wc *w = &wc[i];
			int ud = !!(w->wr_id & UD_BIT);
			int k = (int)(w->wr_id & 0xffffffu);

			CT_CHECK(w->status == IBV_WC_SUCCESS, "completion wr_id %#llx: %s",
				 (unsigned long long)w->wr_id, ibv_wc_status_str(w->status));
			if (w->wr_id & SEND_BIT) {
				CT_CHECK(w->opcode == IBV_WC_SEND, "send opcode %s",
					 ct_wc_opcode_str(w->opcode));
				CT_CHECK(w->qp_num == (ud ? e->ud : e->q[k].qp)->qp_num,
					 "send wc.qp_num %#x", w->qp_num);
				sent++;
				continue;
			}
			CT_CHECK(w->opcode == IBV_WC_RECV, "recv opcode %s",
				 ct_wc_opcode_str(w->opcode));
			if (ud) {
				uint32_t seed;

				CT_CHECK(w->qp_num == e->ud->qp_num, "UD wc.qp_num %#x", w->qp_num);
				CT_CHECK(w->src_qp == e->ud_peer_qpn, "UD src_qp %#x, expected %#x",
					 w->src_qp, e->ud_peer_qpn);
				CT_CHECK(w->byte_len == GRH + MSG, "UD byte_len %u", w->byte_len);
				memcpy(&seed, ud_rslot(e, k) + GRH, 4);
				seed &= ~REPLY;
				CT_CHECK((seed & ~0xffu) == 0x55000000u && (seed & 0xff) < UDN,
					 "UD message %#x", seed);
				CT_CHECK(!e->ud_seen[seed & 0xff], "UD message %#x twice", seed);
				e->ud_seen[seed & 0xff] = 1;
				check_msg(ud_rslot(e, k) + GRH, reply ? seed : seed | REPLY,
					  "UD message");
				if (reply)
					post_send_ud(e, (int)(seed & 0xff), seed | REPLY);
			} else {
				CT_CHECK(k < e->nq && w->qp_num == e->q[k].qp->qp_num,
					 "recv wr_id %d, wc.qp_num %#x (QP %d)", k, w->qp_num,
					 find_qp(e, w->qp_num));
				CT_CHECK(w->byte_len == MSG, "byte_len %u", w->byte_len);
				check_msg(rslot(e, k), e->q[k].seed_in, "RC message");
				memset(rslot(e, k), 0, MSG);
				post_recv_rc(e, k);
				if (reply)
					post_send_rc(e, k);
			}
			got++;
		}
	}
}

/* ---- sub-tests run both on real QPs and on virtual ones -------------------- */

#define NTRANS 10
struct outcome {
	int trans[NTRANS];	/* ibv_modify_qp / ibv_post_send return values */
	int recv_in_err;	/* ibv_post_recv in ERR */
	int recv_in_err_wc;	/* its completion's status, -1: none */
	int send_in_err;	/* ibv_post_send in ERR */
	int send_in_err_wc;
	int send_in_err_bad;	/* *bad_wr pointed at it */
};

static int modify_state(struct ibv_qp *qp, enum ibv_qp_state s, int extra_mask)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = s;
	a.port_num = 1;
	a.qkey = QKEY;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | extra_mask);
}

static void expect_state(struct ibv_qp *qp, enum ibv_qp_state want, const char *after)
{
	enum ibv_qp_state s = ct_qp_state(qp);

	CT_CHECK(s == want, "after %s: state %d, expected %d", after, s, want);
}

/* A fresh RC QP (RESET) through transitions a real RC QP refuses. */
static void transitions(struct ct_dev *d, struct ibv_qp *qp, struct ct_buf *b, int *r)
{
	union ibv_gid g = d->gid[1];
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	r[0] = ct_qp_rts(d, qp);
	CT_CHECK(r[0] == EINVAL, "RESET->RTS: %d", r[0]);
	expect_state(qp, IBV_QPS_RESET, "RESET->RTS");
	r[1] = ct_qp_rtr(d, qp, d->gid_idx[0], 0x12345, &g);
	CT_CHECK(r[1] == EINVAL, "RESET->RTR: %d", r[1]);
	expect_state(qp, IBV_QPS_RESET, "RESET->RTR");
	a.qp_state = IBV_QPS_INIT;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE;
	r[2] = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS);
	CT_CHECK(r[2] == EINVAL, "RESET->INIT without IBV_QP_PORT: %d", r[2]);
	expect_state(qp, IBV_QPS_RESET, "RESET->INIT without IBV_QP_PORT");
	r[3] = modify_state(qp, IBV_QPS_INIT, IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						      IBV_QP_ACCESS_FLAGS | IBV_QP_QKEY);
	CT_CHECK(r[3] == EINVAL, "RESET->INIT with a UD attribute (QKEY): %d", r[3]);
	CT_OK(ct_qp_init(d, qp));
	r[4] = ct_qp_rts(d, qp);
	CT_CHECK(r[4] == EINVAL, "INIT->RTS: %d", r[4]);
	expect_state(qp, IBV_QPS_INIT, "INIT->RTS");
	{
		/* (rxe leaves *bad_wr alone here: not compared.) */
		struct ibv_sge sge = { (uintptr_t)b->p, 8, b->mr->lkey };
		struct ibv_send_wr wr = { .wr_id = 77, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND,
					  .send_flags = IBV_SEND_SIGNALED };
		struct ibv_send_wr *bad = NULL;

		r[5] = ibv_post_send(qp, &wr, &bad);
		CT_CHECK(r[5] == EINVAL, "ibv_post_send in INIT: %d", r[5]);
	}
	r[6] = modify_state(qp, IBV_QPS_ERR, 0);
	CT_CHECK(r[6] == 0, "INIT->ERR: %d", r[6]);
	expect_state(qp, IBV_QPS_ERR, "INIT->ERR");
	r[7] = modify_state(qp, IBV_QPS_INIT, IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						      IBV_QP_ACCESS_FLAGS);
	CT_CHECK(r[7] == EINVAL, "ERR->INIT: %d", r[7]);
	r[8] = ct_qp_rts(d, qp);
	CT_CHECK(r[8] == EINVAL, "ERR->RTS: %d", r[8]);
	expect_state(qp, IBV_QPS_ERR, "ERR->INIT, ERR->RTS");
	r[9] = modify_state(qp, IBV_QPS_RESET, 0);
	CT_CHECK(r[9] == 0, "ERR->RESET: %d", r[9]);
	expect_state(qp, IBV_QPS_RESET, "ERR->RESET");
}

/* Waits up to CT_QUIET_MS for one completion; its status or -1. */
static int maybe_wc(struct ibv_cq *cq, uint64_t wr_id, struct ibv_qp *qp)
{
	uint64_t deadline = ct_now_ns() + (uint64_t)CT_QUIET_MS * 1000000ull;
	struct ibv_wc wc;

	while (ct_now_ns() < deadline) {
		int n = ibv_poll_cq(cq, 1, &wc);

		CT_CHECK(n >= 0, "ibv_poll_cq: %d", n);
		if (n) {
			CT_CHECK(wc.wr_id == wr_id, "wr_id %#llx, expected %#llx",
				 (unsigned long long)wc.wr_id, (unsigned long long)wr_id);
			CT_CHECK(wc.qp_num == qp->qp_num, "wc.qp_num %#x", wc.qp_num);
			return wc.status;
		}
		usleep(1000);
	}
	return -1;
}

/* An RTS QP whose CQ is empty: receives posted, then ERR. */
static void err_flush(struct ibv_qp *qp, struct ibv_cq *cq, struct ct_buf *b,
		      struct outcome *o)
{
	struct ibv_wc wc[3];
	struct ibv_sge sge = { (uintptr_t)b->p, 8, b->mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 0xe4, .sg_list = &sge, .num_sge = 1,
				   .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;
	struct ibv_recv_wr rwr = { .wr_id = 0xe3, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr *rbad = NULL;

	expect_state(qp, IBV_QPS_RTS, "connecting");
	for (int i = 0; i < 3; i++)
		ct_post_recv1(qp, 0xe0 + (uint64_t)i, b, 64 * (size_t)i, 64);
	ct_expect_quiet(cq, 50, "receives posted on an idle QP");
	ct_qp_to_err(qp);
	expect_state(qp, IBV_QPS_ERR, "->ERR");
	ct_poll_n(cq, wc, 3, CT_TIMEOUT_MS);
	for (int i = 0; i < 3; i++) {
		CT_CHECK(wc[i].status == IBV_WC_WR_FLUSH_ERR, "receive %d: %s", i,
			 ibv_wc_status_str(wc[i].status));
		CT_CHECK(wc[i].wr_id == 0xe0 + (uint64_t)i, "flush %d: wr_id %#llx", i,
			 (unsigned long long)wc[i].wr_id);
		CT_CHECK(wc[i].qp_num == qp->qp_num, "flush %d: wc.qp_num %#x", i, wc[i].qp_num);
	}
	ct_expect_quiet(cq, 50, "three receives flushed");
	o->recv_in_err = ibv_post_recv(qp, &rwr, &rbad);
	o->recv_in_err_wc = o->recv_in_err ? -1 : maybe_wc(cq, 0xe3, qp);
	o->send_in_err = ibv_post_send(qp, &swr, &bad);
	o->send_in_err_bad = o->send_in_err && bad == &swr;
	o->send_in_err_wc = o->send_in_err ? -1 : maybe_wc(cq, 0xe4, qp);
	ct_expect_quiet(cq, 50, "after the posts in ERR");
	expect_state(qp, IBV_QPS_ERR, "posting in ERR");
}

static void print_outcome(const char *who, const struct outcome *o)
{
	char t[128];
	int n = 0;

	for (int i = 0; i < NTRANS; i++)
		n += snprintf(t + n, sizeof(t) - (size_t)n, "%s%d", i ? "," : "", o->trans[i]);
	ct_note("%s: transitions %s; in ERR: post_recv %d (completion %d), post_send %d "
		"(completion %d, bad_wr %d)", who, t, o->recv_in_err, o->recv_in_err_wc,
		o->send_in_err, o->send_in_err_wc, o->send_in_err_bad);
}

/* The sub-tests above on real QPs: KRCORE_VIRTUALIZE unset, a loopback
 * pair on GID A and GID B of one process. */
static int real_child(int fd)
{
	struct ct_dev d;
	struct ibv_cq *cq;
	struct ibv_qp *a, *b;
	struct ct_buf buf;
	struct outcome o;

	ct_begin("vqp_transparent: real RC QPs (KRCORE_VIRTUALIZE unset)");
	unsetenv("KRCORE_VIRTUALIZE");
	memset(&o, 0, sizeof(o));
	ct_open(&d);
	cq = CT_PTR(ibv_create_cq(d.ctx, 64, NULL, NULL, 0));
	ct_buf_alloc(&buf, d.pd, 4096);
	a = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	CT_CHECK(!(a->qp_num & VBIT), "a real QP: qp_num %#x", a->qp_num);
	transitions(&d, a, &buf, o.trans);
	CT_OK(ibv_destroy_qp(a));
	/* A send posted in INIT stays in rxe's queue: a new CQ. */
	CT_OK(ibv_destroy_cq(cq));
	cq = CT_PTR(ibv_create_cq(d.ctx, 64, NULL, NULL, 0));
	a = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	b = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	ct_connect_pair(&d, a, b);
	err_flush(a, cq, &buf, &o);
	print_outcome("real", &o);
	/* RESET and connect again, both sides: data moves again (twice). */
	for (int round = 0; round < 2; round++) {
		struct ibv_wc wc[2];

		CT_OK(modify_state(a, IBV_QPS_RESET, 0));
		CT_OK(modify_state(b, IBV_QPS_RESET, 0));
		ct_connect_pair(&d, a, b);
		ct_post_recv1(b, 1, &buf, 2048, 64);
		ct_fill(buf.p + 1024, 64, 900 + (uint32_t)round);
		CT_OK(ct_post_send1(a, 2, IBV_WR_SEND, IBV_SEND_SIGNALED, &buf, 1024, 64, 0, 0, 0));
		ct_poll_n(cq, wc, 2, CT_TIMEOUT_MS);
		CT_CHECK(wc[0].status == IBV_WC_SUCCESS && wc[1].status == IBV_WC_SUCCESS,
			 "round %d: %s, %s", round, ibv_wc_status_str(wc[0].status),
			 ibv_wc_status_str(wc[1].status));
		ct_expect_pattern(buf.p + 2048, 64, 900 + (uint32_t)round, "after RESET");
	}
	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	ct_buf_free(&buf);
	CT_OK(ibv_destroy_cq(cq));
	ct_close(&d);
	ct_oob_write(fd, &o, sizeof(o));
	close(fd);
	ct_pass();
	return 0;
}

/* ---- defaults: an unreachable meta server, local-only MRs ------------------- */

/* Fd 2 goes to an unlinked temporary file (from before the library's
 * first use); *saved keeps the old one. Returns the file's fd. */
static int capture_stderr(int *saved)
{
	char path[] = "/tmp/vqp_transparent_stderrXXXXXX";
	int fd = mkstemp(path);

	CT_CHECK(fd >= 0, "mkstemp");
	unlink(path);
	*saved = dup(2);
	CT_CHECK(*saved >= 0 && dup2(fd, 2) == 2, "dup2");
	return fd;
}

/* Restore fd 2 and return what was written to it meanwhile (also copied
 * to the real stderr, for the log); the caller frees it. */
static char *captured(int fd, int saved)
{
	off_t len = lseek(fd, 0, SEEK_END);
	char *text = calloc(1, (size_t)(len > 0 ? len : 0) + 1);
	ssize_t n;

	CT_CHECK(text != NULL, "alloc");
	n = pread(fd, text, (size_t)(len > 0 ? len : 0), 0);
	CT_CHECK(n == len, "reading the captured stderr");
	CT_CHECK(dup2(saved, 2) == 2, "dup2");
	close(saved);
	close(fd);
	fputs(text, stderr);
	return text;
}

static int count_of(const char *hay, const char *needle)
{
	int n = 0;

	for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
		n++;
	return n;
}

/* A loopback pair of a and b (GID A and B) moves a checked SEND through
 * buf; returns once both completions came. */
static void pair_moves_data(struct ct_dev *d, struct ibv_cq *cq, struct ibv_qp *a,
			    struct ibv_qp *b, struct ct_buf *buf, uint32_t seed)
{
	struct ibv_wc wc[2];

	ct_connect_pair(d, a, b);
	ct_post_recv1(b, 1, buf, 2048, 64);
	ct_fill(buf->p + 1024, 64, seed);
	CT_OK(ct_post_send1(a, 2, IBV_WR_SEND, IBV_SEND_SIGNALED, buf, 1024, 64, 0, 0, 0));
	ct_poll_n(cq, wc, 2, CT_TIMEOUT_MS);
	CT_CHECK(wc[0].status == IBV_WC_SUCCESS && wc[1].status == IBV_WC_SUCCESS, "%s, %s",
		 ibv_wc_status_str(wc[0].status), ibv_wc_status_str(wc[1].status));
	ct_expect_pattern(buf->p + 2048, 64, seed, "the pair's message");
}

/* KRCORE_VIRTUALIZE=1 with a KRCORE_META nothing listens at and KRCORE_LOG
 * unset: ibv_create_qp gives real QPs (no error), which connect and move
 * data; the library says so in exactly one line on stderr. */
static int unreachable_child(int fd)
{
	struct ct_dev d;
	struct ibv_cq *cq;
	struct ibv_qp *a, *b;
	struct ct_buf buf;
	int saved, cap;
	char *text;

	(void)fd;
	ct_begin("vqp_transparent: KRCORE_META unreachable: RC QPs stay real, one warning");
	setenv("KRCORE_VIRTUALIZE", "1", 1);
	setenv("KRCORE_META", "127.0.0.1:1", 1);	/* port 1: refused at once */
	unsetenv("KRCORE_LOG");
	cap = capture_stderr(&saved);
	ct_open(&d);
	cq = CT_PTR(ibv_create_cq(d.ctx, 64, NULL, NULL, 0));
	ct_buf_alloc(&buf, d.pd, 4096);
	a = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	b = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	CT_CHECK(!(a->qp_num & VBIT) && !(b->qp_num & VBIT), "real QPNs: %#x %#x", a->qp_num, b->qp_num);
	pair_moves_data(&d, cq, a, b, &buf, 0x7100);
	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	ct_buf_free(&buf);
	CT_OK(ibv_destroy_cq(cq));
	ct_close(&d);
	text = captured(cap, saved);
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, ==, 0);
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 0);
	CT_CHECK(count_of(text, "krcore[") == 1 && count_of(text, "cannot be reached") == 1,
		 "stderr has %d line(s) of the library, %d saying the meta server cannot be reached; want one",
		 count_of(text, "krcore["), count_of(text, "cannot be reached"));
	free(text);
	ct_pass();
	return 0;
}

/* KRCORE_VIRTUALIZE=1 with the meta server, KRCORE_LOG=warn, no
 * KRCORE_GID_INDEX: local-only MRs (rxe gives each rkey 0), registered
 * before and after the PD's runtime starts, log nothing; a virtual pair on
 * GID A and B (the QPNs resolve under the GIDs the program uses) moves
 * data through a local-only MR. */
static int local_mr_child(int fd)
{
	struct ct_dev d;
	struct ibv_cq *cq;
	struct ibv_qp *a, *b;
	struct ct_buf buf;
	struct ibv_mr *local[4];
	uint8_t *mem;
	int saved, cap;
	char *text;

	(void)fd;
	ct_begin("vqp_transparent: local-only MRs are not published (no error logged)");
	setenv("KRCORE_VIRTUALIZE", "1", 1);
	setenv("KRCORE_LOG", "warn", 1);
	unsetenv("KRCORE_GID_INDEX");
	cap = capture_stderr(&saved);
	ct_open(&d);
	cq = CT_PTR(ibv_create_cq(d.ctx, 64, NULL, NULL, 0));
	mem = aligned_alloc(4096, 4 * 4096);
	CT_CHECK(mem != NULL, "alloc");
	memset(mem, 0, 4 * 4096);
	local[0] = CT_PTR(ibv_reg_mr(d.pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE));
	local[1] = CT_PTR(ibv_reg_mr(d.pd, mem + 4096, 4096, IBV_ACCESS_LOCAL_WRITE));
	ct_buf_alloc(&buf, d.pd, 4096);
	a = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	b = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	CT_CHECK((a->qp_num & VBIT) && (b->qp_num & VBIT), "virtual QPNs: %#x %#x", a->qp_num, b->qp_num);
	{
		/* The cost of a transparent ibv_create_qp (its QPN published
		 * under every GID of the port) and ibv_destroy_qp, one process. */
		struct ibv_qp *q[N_TIMED];
		const int N = N_TIMED;
		uint64_t t0 = ct_now_ns(), t1;

		for (int i = 0; i < N; i++)
			q[i] = ct_create_rc_qp(&d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
		t1 = ct_now_ns();
		for (int i = 0; i < N; i++)
			CT_OK(ibv_destroy_qp(q[i]));
		ct_note("ibv_create_qp %.0f us, ibv_destroy_qp %.0f us (mean of %d)",
			(double)(t1 - t0) / N / 1e3, (double)(ct_now_ns() - t1) / N / 1e3, N);
	}
	local[2] = CT_PTR(ibv_reg_mr(d.pd, mem + 2 * 4096, 4096, IBV_ACCESS_LOCAL_WRITE));
	local[3] = CT_PTR(ibv_reg_mr(d.pd, mem + 3 * 4096, 4096, IBV_ACCESS_LOCAL_WRITE));
	pair_moves_data(&d, cq, a, b, &buf, 0x7200);
	{
		/* The same through a local-only MR on both sides. */
		struct ibv_sge rs = { (uintptr_t)(mem + 3 * 4096), 64, local[3]->lkey };
		struct ibv_sge ss = { (uintptr_t)(mem + 2 * 4096), 64, local[2]->lkey };
		struct ibv_recv_wr rw = { .wr_id = 3, .sg_list = &rs, .num_sge = 1 };
		struct ibv_send_wr sw = { .wr_id = 4, .sg_list = &ss, .num_sge = 1,
					  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
		struct ibv_recv_wr *rbad = NULL;
		struct ibv_send_wr *sbad = NULL;
		struct ibv_wc wc[2];

		ct_fill(mem + 2 * 4096, 64, 0x7300);
		CT_OK(ibv_post_recv(b, &rw, &rbad));
		CT_OK(ibv_post_send(a, &sw, &sbad));
		ct_poll_n(cq, wc, 2, CT_TIMEOUT_MS);
		CT_CHECK(wc[0].status == IBV_WC_SUCCESS && wc[1].status == IBV_WC_SUCCESS, "%s, %s",
			 ibv_wc_status_str(wc[0].status), ibv_wc_status_str(wc[1].status));
		ct_expect_pattern(mem + 3 * 4096, 64, 0x7300, "through local-only MRs");
	}
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, ==, 2 + N_TIMED);
	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	for (int i = 0; i < 4; i++)
		CT_OK(ibv_dereg_mr(local[i]));
	free(mem);
	ct_buf_free(&buf);
	CT_OK(ibv_destroy_cq(cq));
	ct_close(&d);
	text = captured(cap, saved);
	CT_CHECK(count_of(text, "not published") == 0, "stderr: %d MR(s) not published",
		 count_of(text, "not published"));
	free(text);
	ct_pass();
	return 0;
}

/* Run role in a child before anything here used the library. */
static void in_child(int (*role)(int), const char *what)
{
	pid_t pid = fork();

	CT_CHECK(pid >= 0, "fork");
	if (pid == 0)
		_exit(role(-1));
	CT_CHECK(ct_wait_child(pid, what) == 0, "%s failed", what);
}

/* ---- a peer process (node 2 + id) -------------------------------------------- */

/* Takes n (node 1's QPN, seed) pairs for QPs [first, first + n) and
 * connects them. */
static void peer_connect(struct ep *e, int fd, int first, int n)
{
	for (int k = first; k < first + n; k++) {
		uint32_t dqpn = xget32(fd), seed = xget32(fd);

		e->q[k].seed_in = seed;
		e->q[k].seed_out = seed ^ REPLY;
		rc_connect(e, k, 1, dqpn);
	}
}

static int peer(int id, int fd)
{
	struct ep e;
	char name[64];

	snprintf(name, sizeof(name), "vqp_transparent: peer %d (node %d)", id, 2 + id);
	ct_begin(name);
	ep_open(&e, 2 + id);
	for (int k = 0; k < PER_PEER; k++)
		rc_new(&e);
	for (int k = 0; k < PER_PEER; k++)
		xput32(fd, e.q[k].qp->qp_num);
	peer_connect(&e, fd, 0, PER_PEER);
	ct_oob_write(fd, "C", 1);
	pump(&e, PER_PEER, 0, 1);
	/* One peer process: one link (made by node 1's connects). */
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, ==, 1);
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, >=, PER_PEER);
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, >=, PER_PEER);
	ct_oob_write(fd, "E", 1);

	for (;;) {
		char cmd;

		ct_oob_read(fd, &cmd, 1);
		if (cmd == 'X')
			break;
		switch (cmd) {
		case 'Q': {	/* n new QPs connected to node 1's */
			int n = (int)xget32(fd), first = e.nq;

			for (int i = 0; i < n; i++)
				rc_new(&e);
			peer_connect(&e, fd, first, n);
			for (int k = first; k < first + n; k++)
				xput32(fd, e.q[k].qp->qp_num);
			break;
		}
		case 'U':	/* a UD QP */
			e.ud_peer_qpn = xget32(fd);
			ud_open(&e, 1);
			xput32(fd, e.ud->qp_num);
			break;
		case 'S':	/* answer n messages */
			pump(&e, (int)xget32(fd), 0, 1);
			ct_oob_write(fd, "D", 1);
			break;
		case 'R': {	/* our QP of that QPN: RESET, connected again */
			int k = find_qp(&e, xget32(fd));
			uint32_t dqpn;

			CT_CHECK(k >= 0, "'R' names no QP of ours");
			dqpn = e.q[k].peer_qpn;

			CT_OK(modify_state(e.q[k].qp, IBV_QPS_RESET, 0));
			expect_state(e.q[k].qp, IBV_QPS_RESET, "->RESET");
			CT_OK(ct_qp_init(&e.d, e.q[k].qp));
			post_recv_rc(&e, k);
			rc_connect(&e, k, 1, dqpn);
			ct_oob_write(fd, "D", 1);
			break;
		}
		default:
			CT_FAIL("unknown command '%c'", cmd);
		}
	}
	ep_close(&e);
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 0);
	ct_pass();
	return 0;
}

/* ---- node 1 ---------------------------------------------------------------- */

static uint32_t seed_of(int peer, int k)
{
	return ((uint32_t)(peer + 1) << 24) | (uint32_t)k;
}

/* Our QPs [first, first + n), in INIT, connected to as many new QPs of
 * peer p (its 'Q'), both sides. */
static void pair(struct ep *e, int fd, int p, int first, int n)
{
	ct_oob_write(fd, "Q", 1);
	xput32(fd, (uint32_t)n);
	for (int k = first; k < first + n; k++) {
		e->q[k].peer = p;
		e->q[k].seed_out = seed_of(p, k);
		e->q[k].seed_in = seed_of(p, k) ^ REPLY;
		xput32(fd, e->q[k].qp->qp_num);
		xput32(fd, e->q[k].seed_out);
	}
	for (int k = first; k < first + n; k++)
		rc_connect(e, k, 2 + p, xget32(fd));
}

/* n new QPs paired with peer p's; the index of the first. */
static int new_pairs(struct ep *e, int fd, int p, int n)
{
	int first = e->nq;

	for (int i = 0; i < n; i++)
		rc_new(e);
	pair(e, fd, p, first, n);
	return first;
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return x < y ? -1 : x > y;
}

static void scale(struct ep *e, int *fd)
{
	static uint32_t peer_qpn[PEERS][PER_PEER], sorted[NQP];
	uint64_t t0 = ct_now_ns();
	double t_create, t_connect;

	ct_begin("vqp_transparent: 1000 RC QPs to 4 peer processes");
	for (int k = 0; k < NQP; k++) {
		rc_new(e);
		e->q[k].peer = k / PER_PEER;
		e->q[k].seed_out = seed_of(k / PER_PEER, k);
		e->q[k].seed_in = seed_of(k / PER_PEER, k) ^ REPLY;
	}
	t_create = secs_since(t0);
	ct_note("created %d QPs in %.2f s", NQP, t_create);
	for (int k = 0; k < NQP; k++)
		sorted[k] = e->q[k].qp->qp_num;
	qsort(sorted, NQP, sizeof(sorted[0]), cmp_u32);
	for (int k = 1; k < NQP; k++)
		CT_CHECK(sorted[k] != sorted[k - 1], "qp_num %#x twice", sorted[k]);
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, >=, NQP);

	/* Node 1 connects first (it makes the four links), then the peers. */
	for (int p = 0; p < PEERS; p++)
		for (int i = 0; i < PER_PEER; i++)
			peer_qpn[p][i] = xget32(fd[p]);
	t0 = ct_now_ns();
	for (int k = 0; k < NQP; k++)
		rc_connect(e, k, 2 + k / PER_PEER, peer_qpn[k / PER_PEER][k % PER_PEER]);
	for (int k = 0; k < NQP; k++) {
		xput32(fd[e->q[k].peer], e->q[k].qp->qp_num);
		xput32(fd[e->q[k].peer], e->q[k].seed_out);
	}
	for (int p = 0; p < PEERS; p++)
		expect_byte(fd[p], 'C');
	t_connect = secs_since(t0);

	t0 = ct_now_ns();
	for (int k = 0; k < NQP; k++)
		post_send_rc(e, k);
	pump(e, NQP, NQP, 0);
	/* All connected: one link per peer process, no more (a process has
	 * one physical RC QP to each peer, not one per QP), no fewer (four
	 * processes cannot share one RC QP). */
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, <=, 1 * PEERS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, >=, PEERS);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_OPENED, >=, PEERS);
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, >=, NQP);
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, >=, NQP);
	for (int p = 0; p < PEERS; p++)
		expect_byte(fd[p], 'E');
	ct_note("created %d QPs in %.2f s, connected both sides in %.2f s, %d echoes in %.2f s; "
		"links %llu, qps_virtualized %llu, vqps %llu", NQP, t_create, t_connect, NQP,
		secs_since(t0), (unsigned long long)krcore_stat_get(KRCORE_STAT_LINKS),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_QPS_VIRTUALIZED),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_VQPS));
	ct_pass();
}

/* One message each way on QPs [first, first + n), to peer p. */
static void echo(struct ep *e, int fd, int first, int n)
{
	ct_oob_write(fd, "S", 1);
	xput32(fd, (uint32_t)n);
	for (int k = first; k < first + n; k++)
		post_send_rc(e, k);
	pump(e, n, n, 0);
	expect_byte(fd, 'D');
}

static void unknown_qpn(struct ep *e, int fd)
{
	union ibv_gid g2 = ct_node_gid(2), g9 = ct_node_gid(9);
	uint32_t bogus = VBIT | 0x5a5a5;
	int k, rc;

	ct_begin("vqp_transparent: RTR to a QPN nobody published");
	k = rc_new(e);
	/* Peer 0 (node 2) has published no other QPN than these. */
	for (int i = 0; i < PER_PEER; i++)
		CT_CHECK(e->q[i].peer_qpn != bogus, "a QPN of peer 0's");
	rc = ct_qp_rtr(&e->d, e->q[k].qp, e->node, bogus, &g2);
	CT_CHECK(rc == ECONNREFUSED, "RTR to %#x: %d (%s)", bogus, rc, strerror(rc));
	expect_state(e->q[k].qp, IBV_QPS_INIT, "a refused RTR");
	rc = ct_qp_rtr(&e->d, e->q[k].qp, e->node, 0x11, &g2);
	CT_CHECK(rc == ECONNREFUSED, "RTR to 0x11: %d (%s)", rc, strerror(rc));
	rc = ct_qp_rtr(&e->d, e->q[k].qp, e->node, e->q[0].qp->qp_num ^ 1, &g9);
	CT_CHECK(rc == ECONNREFUSED, "RTR to node 9 (no process): %d (%s)", rc, strerror(rc));
	expect_state(e->q[k].qp, IBV_QPS_INIT, "refused RTRs");
	rc = ct_qp_rts(&e->d, e->q[k].qp);
	CT_CHECK(rc == EINVAL, "INIT->RTS after a refused RTR: %d", rc);
	/* Then the right QPN: a new QP of peer 0's, connected to this one. */
	pair(e, fd, 0, k, 1);
	expect_state(e->q[k].qp, IBV_QPS_RTS, "connecting after a refused RTR");
	echo(e, fd, k, 1);
	ct_pass();
}

static void mixed(struct ep *e, int fd)
{
	unsigned long long virt = krcore_stat_get(KRCORE_STAT_QPS_VIRTUALIZED);
	unsigned long long vqps = krcore_stat_get(KRCORE_STAT_VQPS);
	int first;

	ct_begin("vqp_transparent: a real UD QP beside virtual RC QPs");
	first = new_pairs(e, fd, 0, 4);
	e->ud_peer_qpn = 0;
	ud_open(e, 2);
	CT_CHECK(e->ud->qp_num < VBIT, "UD qp_num %#x: virtualized", e->ud->qp_num);
	CT_CHECK(krcore_stat_get(KRCORE_STAT_QPS_VIRTUALIZED) == virt + 4,
		 "qps_virtualized %llu, expected %llu (4 RC, no UD)",
		 (unsigned long long)krcore_stat_get(KRCORE_STAT_QPS_VIRTUALIZED), virt + 4);
	CT_CHECK(krcore_stat_get(KRCORE_STAT_VQPS) == vqps + 4, "vqps %llu, expected %llu",
		 (unsigned long long)krcore_stat_get(KRCORE_STAT_VQPS), vqps + 4);
	ct_oob_write(fd, "U", 1);
	xput32(fd, e->ud->qp_num);
	e->ud_peer_qpn = xget32(fd);
	CT_CHECK(e->ud_peer_qpn < VBIT, "the peer's UD qp_num %#x", e->ud_peer_qpn);
	/* Both kinds at once: UD and RC sends interleaved, one poll loop. */
	ct_oob_write(fd, "S", 1);
	xput32(fd, 4 + UDN);
	for (int m = 0; m < UDN; m++) {
		post_send_ud(e, m, ud_seed(m));
		if (m < 4)
			post_send_rc(e, first + m);
	}
	pump(e, 4 + UDN, 4 + UDN, 0);
	expect_byte(fd, 'D');
	for (int m = 0; m < UDN; m++)
		CT_CHECK(e->ud_seen[m], "UD answer %d", m);
	ct_pass();
}

static void virtual_transitions(struct ep *e, struct outcome *o)
{
	struct ct_buf b;
	struct ibv_cq *cq = CT_PTR(ibv_create_cq(e->d.ctx, 16, NULL, NULL, 0));
	struct ibv_qp *qp;

	ct_begin("vqp_transparent: invalid transitions");
	ct_buf_alloc(&b, e->d.pd, 4096);
	qp = ct_create_rc_qp(&e->d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	CT_CHECK(qp->qp_num & VBIT, "qp_num %#x", qp->qp_num);
	transitions(&e->d, qp, &b, o->trans);
	ct_expect_quiet(cq, 50, "the refused send");
	CT_OK(ibv_destroy_qp(qp));
	ct_buf_free(&b);
	CT_OK(ibv_destroy_cq(cq));
	ct_pass();
}

static void virtual_err(struct ep *e, int fd, struct outcome *o, const struct outcome *real)
{
	struct ct_buf b;
	struct ibv_cq *cq = CT_PTR(ibv_create_cq(e->d.ctx, 16, NULL, NULL, 0));
	struct ibv_qp *qp;
	uint32_t pq;

	ct_begin("vqp_transparent: ERR flushes");
	ct_buf_alloc(&b, e->d.pd, 4096);
	qp = ct_create_rc_qp(&e->d, cq, cq, NULL, (struct ct_qp_caps){ DEPTH, DEPTH, 1, 1, 0, 0 });
	CT_OK(ct_qp_init(&e->d, qp));
	ct_oob_write(fd, "Q", 1);
	xput32(fd, 1);
	xput32(fd, qp->qp_num);
	xput32(fd, 0x77000000u);
	pq = xget32(fd);
	{
		union ibv_gid g = ct_node_gid(2);

		CT_OK(ct_qp_rtr(&e->d, qp, e->node, pq, &g));
		CT_OK(ct_qp_rts(&e->d, qp));
	}
	err_flush(qp, cq, &b, o);
	print_outcome("virtual", o);
	/* A receive posted in ERR is flushed (rxe of Linux 6.1 accepts it
	 * but never reports it: only the return value is compared). */
	CT_CHECK(o->recv_in_err == 0 && o->recv_in_err_wc == IBV_WC_WR_FLUSH_ERR,
		 "a receive posted in ERR: %d, completion %d", o->recv_in_err, o->recv_in_err_wc);
	/* A send posted in ERR: rxe accepts it and flushes it. */
	CT_CHECK(real->send_in_err == 0 && real->send_in_err_wc == IBV_WC_WR_FLUSH_ERR,
		 "the real QP's send in ERR: %d, completion %d", real->send_in_err,
		 real->send_in_err_wc);
	CT_CHECK(o->send_in_err == real->send_in_err, "ibv_post_send in ERR: %d, real QP: %d",
		 o->send_in_err, real->send_in_err);
	CT_CHECK(o->send_in_err_wc == real->send_in_err_wc,
		 "the send posted in ERR: completion %d, real QP: %d", o->send_in_err_wc,
		 real->send_in_err_wc);
	CT_CHECK(o->recv_in_err == real->recv_in_err, "ibv_post_recv in ERR: %d, real QP: %d",
		 o->recv_in_err, real->recv_in_err);
	CT_OK(ibv_destroy_qp(qp));
	ct_buf_free(&b);
	CT_OK(ibv_destroy_cq(cq));
	ct_pass();
}

static void reset_again(struct ep *e, int fd)
{
	int k;

	ct_begin("vqp_transparent: RESET and connect again");
	k = new_pairs(e, fd, 0, 1);
	echo(e, fd, k, 1);
	/* Both sides to RESET and back to RTS, as a real RC pair must. */
	CT_OK(modify_state(e->q[k].qp, IBV_QPS_RESET, 0));
	expect_state(e->q[k].qp, IBV_QPS_RESET, "->RESET");
	CT_OK(ct_qp_init(&e->d, e->q[k].qp));
	post_recv_rc(e, k);
	ct_oob_write(fd, "R", 1);
	xput32(fd, e->q[k].peer_qpn);
	expect_byte(fd, 'D');
	rc_connect(e, k, 2, e->q[k].peer_qpn);
	echo(e, fd, k, 1);
	ct_pass();
}

int main(void)
{
	struct ep *e;
	struct outcome real, virt;
	pid_t meta_pid, rc_pid, pid[PEERS];
	int fd[PEERS], fails = 0;
	uint64_t t0 = ct_now_ns();

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Four peers make their first connects at once on an emulated
	 * two-vCPU machine: more than the default 2 s is fair. */
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "10000", 1);
	ct_watchdog(120);
	/* About 2,000 QPNs published, each under every GID of the port (six
	 * on the testbed): a table with room for them. */
	meta_pid = ct_start_meta_slots(65536);

	/* Nothing here has used the library yet: each child sets its own
	 * configuration before its first use. */
	{
		int p[2];

		CT_CHECK(pipe(p) == 0, "pipe");
		rc_pid = fork();
		CT_CHECK(rc_pid >= 0, "fork");
		if (rc_pid == 0) {
			close(p[0]);
			_exit(real_child(p[1]));
		}
		close(p[1]);
		ct_oob_read(p[0], &real, sizeof(real));
		close(p[0]);
		CT_CHECK(ct_wait_child(rc_pid, "the real-QP child") == 0, "the real-QP child failed");
	}
	in_child(unreachable_child, "the unreachable-meta child");
	in_child(local_mr_child, "the local-MR child");
	setenv("KRCORE_VIRTUALIZE", "1", 1);
	for (int p = 0; p < PEERS; p++) {
		int sv[2];

		CT_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
		pid[p] = fork();
		CT_CHECK(pid[p] >= 0, "fork");
		if (pid[p] == 0) {
			/* Gone with node 1 if it fails. */
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			for (int q = 0; q < p; q++)
				close(fd[q]);
			close(sv[0]);
			_exit(peer(p, sv[1]));
		}
		close(sv[1]);
		fd[p] = sv[0];
	}
	e = calloc(1, sizeof(*e));
	CT_CHECK(e != NULL, "alloc");
	ep_open(e, 1);

	scale(e, fd);
	virtual_transitions(e, &virt);
	for (int i = 0; i < NTRANS; i++)
		CT_CHECK(virt.trans[i] == real.trans[i], "transition step %d: %d, real QP: %d", i,
			 virt.trans[i], real.trans[i]);
	unknown_qpn(e, fd[0]);
	mixed(e, fd[0]);
	virtual_err(e, fd[0], &virt, &real);
	reset_again(e, fd[0]);

	for (int p = 0; p < PEERS; p++) {
		ct_oob_write(fd[p], "X", 1);
		close(fd[p]);
	}
	for (int p = 0; p < PEERS; p++)
		fails += ct_wait_child(pid[p], "a peer");
	ct_begin("vqp_transparent: teardown");
	ep_close(e);
	free(e);
	CT_KRCORE_STAT(KRCORE_STAT_VQPS, ==, 0);
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d peer process(es) failed", fails);
	ct_note("total %.1f s", secs_since(t0));
	ct_pass();
	return 0;
}
