/*
 * The ibv_wr_* API on transparent virtual QPs (KRCORE_VIRTUALIZE=1).
 *
 * Two processes, "A" on emulated node 2 and "B" on node 1, each with
 * KRCORE_VIRTUALIZE=1 and its KRCORE_GID_INDEX set before the library's
 * first use, krcore-meta started here. Each creates an RC QP with
 * ibv_create_qp_ex + IBV_QP_INIT_ATTR_SEND_OPS_FLAGS (it must come back
 * virtual: qps_virtualized, QPN bit 23), they swap QPN, GID and buffer
 * over a socketpair and connect with plain ibv_modify_qp.
 *
 * A builds every work request with ibv_wr_start / ibv_wr_* /
 * ibv_wr_complete; B receives with classic verbs and checks:
 * - wr_send + wr_set_sge, wr_send_imm + wr_set_sge_list (3 pieces of
 *   different lengths), wr_send + wr_set_inline_data (the buffer scribbled
 *   between the setter and wr_complete), wr_send_imm +
 *   wr_set_inline_data_list, wr_rdma_write_imm from an SGE and from inline
 *   data (120 bytes), a batch of WRITE (SGE) + WRITE (inline) + SEND with
 *   only the SEND signaled, a 10000-byte SEND (above 4 KiB) from two SGEs;
 *   every byte, length, immediate and opcode checked at B;
 * - at A: wr_rdma_read, wr_rdma_write then a fenced wr_rdma_read of it in
 *   one batch, wr_atomic_cmp_swp (match and mismatch) and
 *   wr_atomic_fetch_add in one batch (original values and the final
 *   remote value), completions in order with the application's wr_id;
 * - error paths: wr_complete after a too-long SGE list (EINVAL), a setter
 *   before any opcode (EINVAL), inline data above max_inline_data
 *   (EINVAL), more WRs than the send queue (ENOMEM), a batch whose second
 *   WR has a bad rkey (EINVAL and the first WR not posted either: all or
 *   nothing), wr_complete without wr_start (EINVAL), wr_abort (nothing
 *   posted); after each the QP keeps working;
 * - creation: the builders the QP asked for are there, the others NULL;
 *   a QP asking for IBV_QP_EX_WITH_BIND_MW stays real (logged), an explicit
 *   KRCORE_VQP asking for it gets EOPNOTSUPP, one asking for SEND gets
 *   the builders; classic ibv_post_send still works on the QP.
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define BUF_LEN (256 * 1024)
#define SLOT 16384		/* B's receive slots */
#define NRECV 12
#define MAX_INLINE 128
#define SQ_DEPTH 64
#define SEND_OPS                                                              \
	(IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |     \
	 IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_SEND |                     \
	 IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |   \
	 IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)

/* Where A writes in B's buffer (above B's receive slots). */
#define W_SGE (NRECV * SLOT)		/* WRITE_WITH_IMM from an SGE */
#define W_INL (W_SGE + 4096)		/* WRITE_WITH_IMM inline */
#define W_B1 (W_INL + 4096)		/* batch: WRITE from an SGE */
#define W_B2 (W_B1 + 4096)		/* batch: WRITE inline */
#define R_SRC (W_B2 + 4096)		/* B's pattern A READs */
#define W_RB (R_SRC + 8192)		/* WRITE then READ back */
#define ATOM (W_RB + 4096)		/* atomics target */
#define UNTOUCHED (ATOM + 64)		/* must stay zero (refused WRs) */

/* Lengths and seeds of the messages A sends, in order. */
enum { M_SGE, M_SGE_LIST, M_INLINE, M_INLINE_LIST, M_WIMM, M_WIMM_INL, M_BATCH, M_LARGE,
       M_CLASSIC, M_COUNT };
static const uint32_t msg_len[M_COUNT] = { 1500, 2137, 100, 100, 3000, 120, 512, 10000, 64 };

struct peer {
	uint32_t qpn;
	union ibv_gid gid;
	uint64_t addr;
	uint32_t rkey;
};

struct side {
	struct ct_dev d;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_qp_ex *x;
	struct ct_buf b;
	struct peer me, them;
	int node;
};

static struct ibv_qp *create_qp_ex(struct side *s, enum ibv_qp_type type, uint64_t ops)
{
	struct ibv_qp_init_attr_ex ia;

	memset(&ia, 0, sizeof(ia));
	ia.qp_type = type;
	ia.send_cq = s->cq;
	ia.recv_cq = s->cq;
	ia.cap.max_send_wr = SQ_DEPTH;
	ia.cap.max_recv_wr = 64;
	ia.cap.max_send_sge = 3;
	ia.cap.max_recv_sge = 3;
	ia.cap.max_inline_data = MAX_INLINE;
	ia.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	ia.pd = s->d.pd;
	ia.send_ops_flags = ops;
	return ibv_create_qp_ex(s->d.ctx, &ia);
}

/* Open the device on `node`, make the QP, swap addresses over `fd`,
 * connect. */
static void side_open(struct side *s, int node, int fd)
{
	char idx[16];

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	setenv("KRCORE_VIRTUALIZE", "1", 1);
	s->node = node;
	ct_open(&s->d);
	s->cq = CT_PTR(ibv_create_cq(s->d.ctx, 256, NULL, NULL, 0));
	s->qp = CT_PTR(create_qp_ex(s, IBV_QPT_RC, SEND_OPS));
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, ==, 1);
	CT_CHECK(s->qp->qp_num & 0x800000, "QPN %#x is not a virtual one", s->qp->qp_num);
	CT_CHECK(s->qp->qp_type == IBV_QPT_RC && s->qp->pd == s->d.pd && s->qp->send_cq == s->cq,
		 "the QP's fields");
	s->x = CT_PTR(ibv_qp_to_qp_ex(s->qp));
	CT_CHECK(&s->x->qp_base == s->qp, "qp_ex->qp_base is not the QP");
	ct_buf_alloc(&s->b, s->d.pd, BUF_LEN);
	{
		struct peer me;

		memset(&me, 0, sizeof(me));
		me.qpn = s->qp->qp_num;
		me.gid = s->d.gid[0];
		me.addr = (uintptr_t)s->b.p;
		me.rkey = s->b.mr->rkey;
		s->me = me;
		CT_CHECK(write(fd, &me, sizeof(me)) == (ssize_t)sizeof(me), "send the address");
	}
	CT_CHECK(read(fd, &s->them, sizeof(s->them)) == (ssize_t)sizeof(s->them), "read the peer's address");
	CT_OK(ct_connect_qp(&s->d, s->qp, node, s->them.qpn, &s->them.gid));
	CT_CHECK(ct_qp_state(s->qp) == IBV_QPS_RTS, "RTS");
}

static void side_close(struct side *s)
{
	CT_OK(ibv_destroy_qp(s->qp));
	CT_OK(ibv_destroy_cq(s->cq));
	ct_buf_free(&s->b);
	ct_close(&s->d);
}

static void sync_with(int fd, const char *what)
{
	char c = 'S';

	CT_CHECK(write(fd, &c, 1) == 1, "sync (%s)", what);
	CT_CHECK(read(fd, &c, 1) == 1 && c == 'S', "sync (%s)", what);
}

/* ---- B: receives and checks ------------------------------------------ */

static int side_b(int fd)
{
	struct side s;
	struct ibv_wc wc;

	ct_begin("vqp_wr_api B");
	side_open(&s, 1, fd);
	ct_fill(s.b.p + R_SRC, 8192, 500);
	for (int i = 0; i < NRECV; i++)
		ct_post_recv1(s.qp, (uint64_t)i, &s.b, (size_t)i * SLOT, SLOT);
	sync_with(fd, "B ready");
	for (int m = 0; m < M_COUNT; m++) {
		char what[64];

		snprintf(what, sizeof(what), "message %d", m);
		ct_poll_n(s.cq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS, "%s: status %s", what, ibv_wc_status_str(wc.status));
		CT_CHECK(wc.wr_id == (uint64_t)m, "%s: wr_id %" PRIu64, what, wc.wr_id);
		CT_CHECK(wc.qp_num == s.qp->qp_num, "%s: qp_num", what);
		CT_CHECK(wc.byte_len == msg_len[m], "%s: byte_len %u, expected %u", what, wc.byte_len,
			 msg_len[m]);
		switch (m) {
		case M_SGE_LIST:
		case M_INLINE_LIST:
			CT_CHECK(wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM),
				 "%s: a RECV with an immediate", what);
			CT_CHECK(ntohl(wc.imm_data) == 0x1000u + (unsigned)m, "%s: imm %#x", what,
				 ntohl(wc.imm_data));
			break;
		case M_WIMM:
		case M_WIMM_INL:
			CT_CHECK(wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && (wc.wc_flags & IBV_WC_WITH_IMM),
				 "%s: opcode %d", what, wc.opcode);
			CT_CHECK(ntohl(wc.imm_data) == 0x1000u + (unsigned)m, "%s: imm %#x", what,
				 ntohl(wc.imm_data));
			break;
		default:
			CT_CHECK(wc.opcode == IBV_WC_RECV && !(wc.wc_flags & IBV_WC_WITH_IMM),
				 "%s: a plain RECV (opcode %d, flags %#x)", what, wc.opcode, wc.wc_flags);
		}
		if (m == M_WIMM)
			ct_expect_pattern(s.b.p + W_SGE, msg_len[m], 100 + m, "WRITE_WITH_IMM data");
		else if (m == M_WIMM_INL)
			ct_expect_pattern(s.b.p + W_INL, msg_len[m], 100 + m, "inline WRITE_WITH_IMM data");
		else
			ct_expect_pattern(s.b.p + (size_t)m * SLOT, msg_len[m], 100 + m, what);
		if (m == M_BATCH) {
			/* RC order: the batch's two WRITEs landed before its SEND. */
			ct_expect_pattern(s.b.p + W_B1, 700, 200, "batch WRITE (SGE)");
			ct_expect_pattern(s.b.p + W_B2, 90, 201, "batch WRITE (inline)");
		}
	}
	ct_expect_quiet(s.cq, 50, "B after the messages");
	sync_with(fd, "B checked");
	/* A's one-sided operations and error paths. */
	sync_with(fd, "A done");
	ct_expect_zero(s.b.p + UNTOUCHED, 4096, "targets of refused and aborted WRs");
	ct_expect_quiet(s.cq, 50, "B at the end");
	side_close(&s);
	ct_pass();
	return 0;
}

/* ---- A: builds ----------------------------------------------------------- */

static void poll_send(struct side *s, uint64_t wr_id, enum ibv_wc_opcode op, const char *what)
{
	struct ibv_wc wc;

	ct_poll_n(s->cq, &wc, 1, CT_TIMEOUT_MS);
	ct_expect_wc(&wc, wr_id, op, what);
	CT_CHECK(wc.qp_num == s->qp->qp_num, "%s: qp_num", what);
}

static void messages(struct side *s)
{
	struct ibv_qp_ex *x = s->x;
	uint8_t *a = s->b.p;
	uint32_t lk = s->b.mr->lkey;

	ct_begin("vqp_wr_api: two-sided and WRITE_WITH_IMM");
	for (int m = 0; m < M_COUNT; m++)
		ct_fill(a + (size_t)m * SLOT, msg_len[m], 100 + m);

	/* wr_send + wr_set_sge */
	ibv_wr_start(x);
	x->wr_id = M_SGE;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, lk, (uintptr_t)a, msg_len[M_SGE]);
	CT_OK(ibv_wr_complete(x));
	poll_send(s, M_SGE, IBV_WC_SEND, "wr_send");

	/* wr_send_imm + wr_set_sge_list: three pieces of different lengths,
	 * gathered from non-adjacent places. */
	{
		uint8_t *src = a + M_SGE_LIST * SLOT;
		uint32_t l0 = 100, l1 = 2000, l2 = msg_len[M_SGE_LIST] - 2100;
		struct ibv_sge sg[3] = { { (uintptr_t)(a + W_B1), l0, lk },
					 { (uintptr_t)(a + W_B2), l1, lk },
					 { (uintptr_t)(a + R_SRC), l2, lk } };

		memcpy(a + W_B1, src, l0);
		memcpy(a + W_B2, src + l0, l1);
		memcpy(a + R_SRC, src + l0 + l1, l2);
		ibv_wr_start(x);
		x->wr_id = M_SGE_LIST;
		x->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_send_imm(x, htonl(0x1000 + M_SGE_LIST));
		ibv_wr_set_sge_list(x, 3, sg);
		CT_OK(ibv_wr_complete(x));
		poll_send(s, M_SGE_LIST, IBV_WC_SEND, "wr_send_imm");
		memset(a + W_B1, 0, 3 * 4096 + 8192);
	}

	/* wr_send + wr_set_inline_data: copied at the setter. */
	{
		uint8_t tmp[100];

		memcpy(tmp, a + M_INLINE * SLOT, sizeof(tmp));
		ibv_wr_start(x);
		x->wr_id = M_INLINE;
		x->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_send(x);
		ibv_wr_set_inline_data(x, tmp, sizeof(tmp));
		memset(tmp, 0xee, sizeof(tmp));
		CT_OK(ibv_wr_complete(x));
		poll_send(s, M_INLINE, IBV_WC_SEND, "inline wr_send");
	}

	/* wr_send_imm + wr_set_inline_data_list: 10 + 0 + 90 bytes. */
	{
		uint8_t *src = a + M_INLINE_LIST * SLOT;
		struct ibv_data_buf bufs[3] = { { src, 10 }, { NULL, 0 }, { src + 10, 90 } };

		ibv_wr_start(x);
		x->wr_id = M_INLINE_LIST;
		x->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_send_imm(x, htonl(0x1000 + M_INLINE_LIST));
		ibv_wr_set_inline_data_list(x, 3, bufs);
		CT_OK(ibv_wr_complete(x));
		poll_send(s, M_INLINE_LIST, IBV_WC_SEND, "inline list wr_send_imm");
	}

	/* wr_rdma_write_imm from an SGE, then from inline data. */
	ibv_wr_start(x);
	x->wr_id = M_WIMM;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write_imm(x, s->them.rkey, s->them.addr + W_SGE, htonl(0x1000 + M_WIMM));
	ibv_wr_set_sge(x, lk, (uintptr_t)(a + M_WIMM * SLOT), msg_len[M_WIMM]);
	x->wr_id = M_WIMM_INL;
	ibv_wr_rdma_write_imm(x, s->them.rkey, s->them.addr + W_INL, htonl(0x1000 + M_WIMM_INL));
	ibv_wr_set_inline_data(x, a + M_WIMM_INL * SLOT, msg_len[M_WIMM_INL]);
	CT_OK(ibv_wr_complete(x));
	poll_send(s, M_WIMM, IBV_WC_RDMA_WRITE, "wr_rdma_write_imm");
	poll_send(s, M_WIMM_INL, IBV_WC_RDMA_WRITE, "inline wr_rdma_write_imm");

	/* One batch: WRITE (SGE) + WRITE (inline), unsignaled, then a
	 * signaled SEND: one completion. */
	ct_fill(a + W_B1, 700, 200);
	ct_fill(a + W_B2, 90, 201);
	ibv_wr_start(x);
	x->wr_id = 0xb1;
	x->wr_flags = 0;
	ibv_wr_rdma_write(x, s->them.rkey, s->them.addr + W_B1);
	ibv_wr_set_sge(x, lk, (uintptr_t)(a + W_B1), 700);
	x->wr_id = 0xb2;
	ibv_wr_rdma_write(x, s->them.rkey, s->them.addr + W_B2);
	ibv_wr_set_inline_data(x, a + W_B2, 90);
	x->wr_id = M_BATCH;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, lk, (uintptr_t)(a + M_BATCH * SLOT), msg_len[M_BATCH]);
	CT_OK(ibv_wr_complete(x));
	poll_send(s, M_BATCH, IBV_WC_SEND, "the batch's SEND");
	ct_expect_quiet(s->cq, CT_QUIET_MS, "the batch's unsignaled WRITEs");

	/* Above 4 KiB (the receiver READs it): from two SGEs. */
	{
		uint8_t *src = a + M_LARGE * SLOT;
		struct ibv_sge sg[2] = { { (uintptr_t)src, 3333, lk },
					 { (uintptr_t)src + 3333, msg_len[M_LARGE] - 3333, lk } };

		ibv_wr_start(x);
		x->wr_id = M_LARGE;
		x->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_send(x);
		ibv_wr_set_sge_list(x, 2, sg);
		CT_OK(ibv_wr_complete(x));
		poll_send(s, M_LARGE, IBV_WC_SEND, "large wr_send");
	}

	/* Classic ibv_post_send on the same QP. */
	CT_OK(ct_post_send1(s->qp, M_CLASSIC, IBV_WR_SEND, IBV_SEND_SIGNALED, &s->b,
			    M_CLASSIC * SLOT, msg_len[M_CLASSIC], 0, 0, 0));
	poll_send(s, M_CLASSIC, IBV_WC_SEND, "classic send");
	ct_pass();
}

static void one_sided(struct side *s)
{
	struct ibv_qp_ex *x = s->x;
	uint8_t *a = s->b.p;
	uint32_t lk = s->b.mr->lkey, rk = s->them.rkey;
	uint64_t r = s->them.addr;
	struct ibv_wc wc[3];

	ct_begin("vqp_wr_api: READ, WRITE, atomics");
	memset(a, 0, 8192);
	ibv_wr_start(x);
	x->wr_id = 0x100;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_read(x, rk, r + R_SRC);
	ibv_wr_set_sge(x, lk, (uintptr_t)a, 8192);
	CT_OK(ibv_wr_complete(x));
	poll_send(s, 0x100, IBV_WC_RDMA_READ, "wr_rdma_read");
	ct_expect_pattern(a, 8192, 500, "READ of B's pattern");

	/* WRITE, then a fenced READ of the same bytes, in one batch. */
	ct_fill(a + 8192, 1000, 300);
	memset(a + 16384, 0, 1000);
	ibv_wr_start(x);
	x->wr_id = 0x101;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, rk, r + W_RB);
	ibv_wr_set_sge(x, lk, (uintptr_t)(a + 8192), 1000);
	x->wr_id = 0x102;
	x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE;
	ibv_wr_rdma_read(x, rk, r + W_RB);
	ibv_wr_set_sge(x, lk, (uintptr_t)(a + 16384), 1000);
	CT_OK(ibv_wr_complete(x));
	ct_poll_n(s->cq, wc, 2, CT_TIMEOUT_MS);
	ct_expect_wc(&wc[0], 0x101, IBV_WC_RDMA_WRITE, "wr_rdma_write");
	ct_expect_wc(&wc[1], 0x102, IBV_WC_RDMA_READ, "fenced read back");
	ct_expect_pattern(a + 16384, 1000, 300, "WRITE read back");

	/* Atomics: CAS that matches, one that does not, FETCH_ADD. */
	{
		const uint64_t v0 = 0, v1 = 0x5555666677778888ull;
		uint64_t *out = (uint64_t *)(void *)(a + 20480);

		out[0] = out[1] = out[2] = out[3] = 0xdeadbeefdeadbeefull;
		ibv_wr_start(x);
		x->wr_flags = IBV_SEND_SIGNALED;
		x->wr_id = 0x201;
		ibv_wr_atomic_cmp_swp(x, rk, r + ATOM, v0, v1);
		ibv_wr_set_sge(x, lk, (uintptr_t)&out[0], 8);
		x->wr_id = 0x202;
		ibv_wr_atomic_cmp_swp(x, rk, r + ATOM, v0, 42);
		ibv_wr_set_sge(x, lk, (uintptr_t)&out[1], 8);
		x->wr_id = 0x203;
		ibv_wr_atomic_fetch_add(x, rk, r + ATOM, 0x10);
		ibv_wr_set_sge(x, lk, (uintptr_t)&out[2], 8);
		CT_OK(ibv_wr_complete(x));
		ct_poll_n(s->cq, wc, 3, CT_TIMEOUT_MS);
		ct_expect_wc(&wc[0], 0x201, IBV_WC_COMP_SWAP, "cas #1");
		ct_expect_wc(&wc[1], 0x202, IBV_WC_COMP_SWAP, "cas #2");
		ct_expect_wc(&wc[2], 0x203, IBV_WC_FETCH_ADD, "faa");
		CT_CHECK(out[0] == v0 && out[1] == v1 && out[2] == v1,
			 "originals %#" PRIx64 " %#" PRIx64 " %#" PRIx64, out[0], out[1], out[2]);
		ibv_wr_start(x);
		x->wr_id = 0x204;
		ibv_wr_rdma_read(x, rk, r + ATOM);
		ibv_wr_set_sge(x, lk, (uintptr_t)&out[3], 8);
		CT_OK(ibv_wr_complete(x));
		poll_send(s, 0x204, IBV_WC_RDMA_READ, "read of the atomics' target");
		CT_CHECK(out[3] == v1 + 0x10, "remote %#" PRIx64, out[3]);
	}
	ct_pass();
}

/* A WRITE of 8 bytes to B's UNTOUCHED area + off: must never land. */
static void refused_write(struct side *s, size_t off)
{
	ibv_wr_rdma_write(s->x, s->them.rkey, s->them.addr + UNTOUCHED + off);
	ibv_wr_set_sge(s->x, s->b.mr->lkey, (uintptr_t)(s->b.p + 24576), 8);
}

/* The QP still works: a signaled WRITE to W_RB. */
static void still_works(struct side *s, const char *after)
{
	struct ibv_qp_ex *x = s->x;
	char what[96];

	snprintf(what, sizeof(what), "a WRITE after %s", after);
	ct_expect_quiet(s->cq, 50, after);
	ibv_wr_start(x);
	x->wr_id = 0x999;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, s->them.rkey, s->them.addr + W_RB);
	ibv_wr_set_sge(x, s->b.mr->lkey, (uintptr_t)(s->b.p + 8192), 64);
	CT_OK(ibv_wr_complete(x));
	poll_send(s, 0x999, IBV_WC_RDMA_WRITE, what);
}

static void errors(struct side *s)
{
	struct ibv_qp_ex *x = s->x;
	uint8_t *a = s->b.p;
	uint32_t lk = s->b.mr->lkey;
	int rc;

	memset(a + 24576, 0x5a, 8);
	ct_begin("vqp_wr_api: wr_complete after a too-long SGE list");
	{
		struct ibv_sge sg[4] = { { (uintptr_t)a, 8, lk }, { (uintptr_t)a + 8, 8, lk },
					 { (uintptr_t)a + 16, 8, lk }, { (uintptr_t)a + 24, 8, lk } };

		ibv_wr_start(x);
		x->wr_id = 0x301;
		x->wr_flags = IBV_SEND_SIGNALED;
		refused_write(s, 0);
		x->wr_id = 0x302;
		ibv_wr_rdma_write(x, s->them.rkey, s->them.addr + UNTOUCHED + 8);
		ibv_wr_set_sge_list(x, 4, sg);
		rc = ibv_wr_complete(x);
		CT_CHECK(rc == EINVAL, "wr_complete returned %d", rc);
		still_works(s, "a too-long SGE list");
	}
	ct_pass();

	ct_begin("vqp_wr_api: a setter before any opcode");
	ibv_wr_start(x);
	ibv_wr_set_sge(x, lk, (uintptr_t)a, 8);
	x->wr_id = 0x311;
	refused_write(s, 16);
	rc = ibv_wr_complete(x);
	CT_CHECK(rc == EINVAL, "wr_complete returned %d", rc);
	still_works(s, "a setter without opcode");
	ct_pass();

	ct_begin("vqp_wr_api: inline data above max_inline_data");
	{
		static uint8_t big[MAX_INLINE + 1];

		ibv_wr_start(x);
		x->wr_id = 0x321;
		x->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_rdma_write(x, s->them.rkey, s->them.addr + UNTOUCHED + 32);
		ibv_wr_set_inline_data(x, big, sizeof(big));
		rc = ibv_wr_complete(x);
		CT_CHECK(rc == EINVAL, "wr_complete returned %d", rc);
		still_works(s, "too much inline data");
	}
	ct_pass();

	ct_begin("vqp_wr_api: more WRs than the send queue");
	ibv_wr_start(x);
	x->wr_flags = IBV_SEND_SIGNALED;
	for (int i = 0; i <= SQ_DEPTH; i++) {
		x->wr_id = 0x400 + (uint64_t)i;
		refused_write(s, 40);
	}
	rc = ibv_wr_complete(x);
	CT_CHECK(rc == ENOMEM, "wr_complete returned %d", rc);
	still_works(s, "a batch deeper than the queue");
	ct_pass();

	ct_begin("vqp_wr_api: all or nothing (bad rkey on the second WR)");
	ibv_wr_start(x);
	x->wr_id = 0x501;
	x->wr_flags = IBV_SEND_SIGNALED;
	refused_write(s, 48);
	x->wr_id = 0x502;
	ibv_wr_rdma_write(x, s->them.rkey ^ 0x777, s->them.addr + W_RB);
	ibv_wr_set_sge(x, lk, (uintptr_t)a, 8);
	rc = ibv_wr_complete(x);
	CT_CHECK(rc == EINVAL, "wr_complete returned %d", rc);
	still_works(s, "a refused batch");
	ct_pass();

	ct_begin("vqp_wr_api: wr_complete without wr_start");
	rc = ibv_wr_complete(x);
	CT_CHECK(rc == EINVAL, "wr_complete returned %d", rc);
	still_works(s, "wr_complete without wr_start");
	ct_pass();

	ct_begin("vqp_wr_api: wr_abort");
	ibv_wr_start(x);
	x->wr_id = 0x601;
	x->wr_flags = IBV_SEND_SIGNALED;
	refused_write(s, 56);
	ibv_wr_abort(x);
	ct_expect_quiet(s->cq, CT_QUIET_MS, "aborted WR");
	still_works(s, "wr_abort");
	ct_pass();
}

/* Which builders a QP has, and the creation policy. */
static void creation(struct side *s)
{
	struct ibv_qp_ex *x = s->x;
	struct ibv_qp *q;

	ct_begin("vqp_wr_api: builders and creation");
	CT_CHECK(x->wr_start && x->wr_complete && x->wr_abort && x->wr_send && x->wr_send_imm &&
			 x->wr_rdma_write && x->wr_rdma_write_imm && x->wr_rdma_read &&
			 x->wr_atomic_cmp_swp && x->wr_atomic_fetch_add && x->wr_set_sge &&
			 x->wr_set_sge_list && x->wr_set_inline_data && x->wr_set_inline_data_list,
		 "a requested builder is NULL");
	CT_CHECK(!x->wr_bind_mw && !x->wr_local_inv && !x->wr_send_inv && !x->wr_send_tso &&
			 !x->wr_set_ud_addr && !x->wr_set_xrc_srqn && !x->wr_atomic_write,
		 "a builder a VQP cannot do is set");

	/* Only SEND asked: only wr_send among the opcodes. */
	q = CT_PTR(create_qp_ex(s, IBV_QPT_RC, IBV_QP_EX_WITH_SEND));
	CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, ==, 2);
	{
		struct ibv_qp_ex *y = CT_PTR(ibv_qp_to_qp_ex(q));

		CT_CHECK(y->wr_send && y->wr_set_sge && y->wr_complete && !y->wr_send_imm &&
				 !y->wr_rdma_write && !y->wr_atomic_fetch_add,
			 "SEND only: the builders");
	}
	CT_OK(ibv_destroy_qp(q));

	/* BIND_MW asked: stays a real QP (the provider's builders). */
	q = ibv_create_qp_ex(s->d.ctx, &(struct ibv_qp_init_attr_ex){
		.qp_type = IBV_QPT_RC, .send_cq = s->cq, .recv_cq = s->cq,
		.cap = { 4, 4, 1, 1, 0 }, .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = s->d.pd, .send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_BIND_MW });
	if (q) {
		CT_CHECK(!(q->qp_num & 0x800000), "a QP with BIND_MW is virtual (%#x)", q->qp_num);
		CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, ==, 2);
		CT_OK(ibv_destroy_qp(q));
	} else {
		ct_note("the provider refused BIND_MW send ops (errno %d): not virtualized either", errno);
		CT_KRCORE_STAT(KRCORE_STAT_QPS_VIRTUALIZED, ==, 2);
	}

	/* An explicit KRCORE_VQP: EOPNOTSUPP for BIND_MW, builders for SEND. */
	errno = 0;
	q = create_qp_ex(s, (enum ibv_qp_type)KRCORE_VQP, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_BIND_MW);
	CT_CHECK(q == NULL && errno == EOPNOTSUPP, "KRCORE_VQP with BIND_MW: %p, errno %d", (void *)q,
		 errno);
	q = CT_PTR(create_qp_ex(s, (enum ibv_qp_type)KRCORE_VQP, IBV_QP_EX_WITH_SEND));
	CT_CHECK(ibv_qp_to_qp_ex(q) && ibv_qp_to_qp_ex(q)->wr_send, "KRCORE_VQP: wr_send");
	CT_OK(ibv_destroy_qp(q));
	ct_pass();
}

static int side_a(int fd)
{
	struct side s;

	ct_begin("vqp_wr_api A");
	side_open(&s, 2, fd);
	creation(&s);
	sync_with(fd, "B ready");
	messages(&s);
	sync_with(fd, "B checked");
	one_sided(&s);
	errors(&s);
	sync_with(fd, "A done");
	ct_begin("vqp_wr_api: counters");
	CT_KRCORE_STAT(KRCORE_STAT_WR_CALLS, >=, 20);
	side_close(&s);
	ct_pass();
	return 0;
}

int main(void)
{
	int sv[2], fails = 0;
	pid_t meta, pa, pb;

	setvbuf(stdout, NULL, _IOLBF, 0);
	ct_watchdog(120);
	meta = ct_start_meta();
	CT_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
	pb = fork();
	CT_CHECK(pb >= 0, "fork");
	if (pb == 0) {
		close(sv[0]);
		_exit(side_b(sv[1]));
	}
	pa = fork();
	CT_CHECK(pa >= 0, "fork");
	if (pa == 0) {
		close(sv[1]);
		_exit(side_a(sv[0]));
	}
	close(sv[0]);
	close(sv[1]);
	fails += ct_wait_child(pa, "A");
	fails += ct_wait_child(pb, "B");
	kill(meta, SIGTERM);
	waitpid(meta, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	ct_begin("vqp_wr_api");
	ct_pass();
	return 0;
}
