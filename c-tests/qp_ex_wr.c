/*
 * qp_ex_wr: the extended QP/CQ API.
 *
 * QPs come from ibv_create_qp_ex with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, work
 * requests are built with ibv_wr_start / ibv_wr_* / ibv_wr_set_sge(_list) /
 * ibv_wr_set_inline_data / ibv_wr_complete (and one ibv_wr_abort), and the
 * CQs come from ibv_create_cq_ex and are read with ibv_start_poll /
 * ibv_next_poll / ibv_end_poll and the ibv_wc_read_* accessors.
 */
#define _GNU_SOURCE
#include "common.h"

#include <endian.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_LEN (64 * 1024)
#define WC_FLAGS                                                              \
	(IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM)
#define SEND_OPS                                                              \
	(IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |     \
	 IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_SEND |                     \
	 IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |   \
	 IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)

static struct ct_dev dev;
static struct ibv_cq_ex *cqa, *cqb;
static struct ibv_qp *qpa, *qpb;
static struct ibv_qp_ex *xa, *xb;
static struct ct_buf ba, bb;

static struct ibv_cq_ex *make_cq(void)
{
	struct ibv_cq_init_attr_ex ca;
	struct ibv_cq_ex *cq;

	memset(&ca, 0, sizeof(ca));
	ca.cqe = 256;
	ca.wc_flags = WC_FLAGS;
	cq = CT_PTR(ibv_create_cq_ex(dev.ctx, &ca));
	CT_CHECK(ibv_cq_ex_to_cq(cq)->context == dev.ctx,
		 "cq->context is not the device context");
	return cq;
}

static struct ibv_qp *make_qp(struct ibv_cq_ex *cq)
{
	struct ibv_qp_init_attr_ex ia;
	struct ibv_qp *qp;

	memset(&ia, 0, sizeof(ia));
	ia.qp_type = IBV_QPT_RC;
	ia.send_cq = ibv_cq_ex_to_cq(cq);
	ia.recv_cq = ibv_cq_ex_to_cq(cq);
	ia.cap.max_send_wr = 64;
	ia.cap.max_recv_wr = 64;
	ia.cap.max_send_sge = 4;
	ia.cap.max_recv_sge = 4;
	ia.cap.max_inline_data = 64;
	ia.sq_sig_all = 0;
	ia.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	ia.pd = dev.pd;
	ia.send_ops_flags = SEND_OPS;
	qp = CT_PTR(ibv_create_qp_ex(dev.ctx, &ia));
	CT_CHECK(qp->context == dev.ctx && qp->pd == dev.pd,
		 "QP context/pd not the ones passed in");
	CT_CHECK(qp->send_cq == ibv_cq_ex_to_cq(cq), "qp->send_cq mismatch");
	return qp;
}

/* Classic receive on B: one WR over n SGEs carved out of bb at `off`. */
static void post_recv_b(uint64_t wr_id, size_t off, const uint32_t *lens,
			int n)
{
	struct ibv_sge sge[4];
	struct ibv_recv_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof(wr));
	for (int i = 0; i < n; i++) {
		sge[i].addr = (uintptr_t)(bb.p + off);
		sge[i].length = lens[i];
		sge[i].lkey = bb.mr->lkey;
		off += lens[i];
	}
	wr.wr_id = wr_id;
	wr.sg_list = n ? sge : NULL;
	wr.num_sge = n;
	CT_OK(ibv_post_recv(qpb, &wr, &bad));
}

static void expect_wcx(const struct ct_wcx *w, uint64_t wr_id,
		       enum ibv_wc_opcode op, uint32_t qp_num,
		       const char *what)
{
	if (w->status != IBV_WC_SUCCESS)
		CT_FAIL("%s: wr_id=0x%" PRIx64 " status %s (%d)", what,
			w->wr_id, ibv_wc_status_str(w->status), w->status);
	if (w->wr_id != wr_id)
		CT_FAIL("%s: wr_id 0x%" PRIx64 ", expected 0x%" PRIx64, what,
			w->wr_id, wr_id);
	if (w->opcode != op)
		CT_FAIL("%s: opcode %s (%d), expected %s (%d)", what,
			ct_wc_opcode_str(w->opcode), w->opcode,
			ct_wc_opcode_str(op), op);
	if (w->qp_num != qp_num)
		CT_FAIL("%s: qp_num %u, expected %u", what, w->qp_num, qp_num);
}

static struct ct_wcx poll_a(void)
{
	struct ct_wcx w;

	ct_poll_ex_n(cqa, WC_FLAGS, &w, 1, CT_TIMEOUT_MS);
	return w;
}

static struct ct_wcx poll_b(void)
{
	struct ct_wcx w;

	ct_poll_ex_n(cqb, WC_FLAGS, &w, 1, CT_TIMEOUT_MS);
	return w;
}

static void test_setup(void)
{
	ct_begin("create_qp_ex");
	cqa = make_cq();
	cqb = make_cq();
	qpa = make_qp(cqa);
	qpb = make_qp(cqb);
	xa = ibv_qp_to_qp_ex(qpa);
	xb = ibv_qp_to_qp_ex(qpb);
	CT_CHECK(xa != NULL && xb != NULL, "ibv_qp_to_qp_ex returned NULL");
	CT_CHECK(&xa->qp_base == qpa, "qp_ex->qp_base is not the QP");
	CT_CHECK(xa->wr_start && xa->wr_complete && xa->wr_abort &&
			 xa->wr_rdma_write && xa->wr_rdma_write_imm &&
			 xa->wr_rdma_read && xa->wr_send && xa->wr_send_imm &&
			 xa->wr_atomic_cmp_swp && xa->wr_atomic_fetch_add &&
			 xa->wr_set_sge && xa->wr_set_sge_list &&
			 xa->wr_set_inline_data,
		 "a requested ibv_qp_ex operation is NULL");
	ct_buf_alloc(&ba, dev.pd, BUF_LEN);
	ct_buf_alloc(&bb, dev.pd, BUF_LEN);
	ct_connect_pair(&dev, qpa, qpb);
	ct_pass();
}

static void test_rdma_write(void)
{
	const size_t off = 0, len = 4096;

	ct_begin("wr_rdma_write");
	ct_fill(ba.p + off, len, 11);
	ibv_wr_start(xa);
	xa->wr_id = 0x1001;
	xa->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(xa, bb.mr->rkey, (uintptr_t)(bb.p + off));
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + off),
		       (uint32_t)len);
	CT_OK(ibv_wr_complete(xa));
	struct ct_wcx w = poll_a();
	expect_wcx(&w, 0x1001, IBV_WC_RDMA_WRITE, qpa->qp_num, "write cqe");
	ct_expect_pattern(bb.p + off, len, 11, "written data at B");
	ct_expect_zero(bb.p + off + len, 64, "bytes after the write at B");
	ct_expect_quiet_ex(cqb, 50, "B's CQ after a plain write");
	ct_pass();
}

static void test_rdma_write_imm(void)
{
	const size_t src = 8192, dst = 8192;
	/*
	 * Equal lengths on purpose: rdma-core's rxe provider before v64
	 * ("rxe: Fix dma.length computation in wr_set_sge_list", upstream
	 * 406cd2ad0) sums sg_list[0].length num_sge times, so pieces of
	 * different sizes would be truncated by the provider itself.
	 */
	const uint32_t lens[3] = { 1000, 1000, 1000 };
	const uint32_t total = 3000;
	const uint32_t imm = 0xa1b2c3d4;
	struct ibv_sge sg[3];
	size_t o = src;

	ct_begin("wr_rdma_write_imm_sge_list");
	/* Three non-adjacent source pieces (gaps of 16 bytes). */
	for (int i = 0; i < 3; i++) {
		ct_fill(ba.p + o, lens[i], 20 + i);
		sg[i].addr = (uintptr_t)(ba.p + o);
		sg[i].length = lens[i];
		sg[i].lkey = ba.mr->lkey;
		o += lens[i] + 16;
	}
	post_recv_b(0x2002, 0, NULL, 0);
	ibv_wr_start(xa);
	xa->wr_id = 0x2001;
	xa->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write_imm(xa, bb.mr->rkey, (uintptr_t)(bb.p + dst),
			      htobe32(imm));
	ibv_wr_set_sge_list(xa, 3, sg);
	CT_OK(ibv_wr_complete(xa));

	struct ct_wcx w = poll_a();
	expect_wcx(&w, 0x2001, IBV_WC_RDMA_WRITE, qpa->qp_num,
		   "requester cqe");
	w = poll_b();
	expect_wcx(&w, 0x2002, IBV_WC_RECV_RDMA_WITH_IMM, qpb->qp_num,
		   "responder cqe");
	CT_CHECK(w.wc_flags & IBV_WC_WITH_IMM, "wc_flags 0x%x lacks WITH_IMM",
		 w.wc_flags);
	CT_CHECK(be32toh(w.imm_data) == imm, "imm 0x%08x, expected 0x%08x",
		 be32toh(w.imm_data), imm);
	CT_CHECK(w.byte_len == total, "byte_len %u, expected %u", w.byte_len,
		 total);
	o = dst;
	for (int i = 0; i < 3; i++) {
		ct_expect_pattern(bb.p + o, lens[i], 20 + i, "gathered piece");
		o += lens[i];
	}
	ct_expect_zero(bb.p + o, 64, "bytes after the write");
	ct_pass();
}

static void test_send(int with_imm)
{
	const size_t src = 16384, dst = 16384;
	const uint32_t len = 1500, rl[2] = { 1000, 1000 };
	const uint32_t imm = 0x01020304;
	uint64_t id = with_imm ? 0x4000 : 0x3000;

	ct_begin(with_imm ? "wr_send_imm" : "wr_send");
	memset(bb.p + dst, 0, 2000);
	ct_fill(ba.p + src, len, 30 + with_imm);
	post_recv_b(id + 2, dst, rl, 2);
	ibv_wr_start(xa);
	xa->wr_id = id + 1;
	xa->wr_flags = IBV_SEND_SIGNALED;
	if (with_imm)
		ibv_wr_send_imm(xa, htobe32(imm));
	else
		ibv_wr_send(xa);
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + src), len);
	CT_OK(ibv_wr_complete(xa));

	struct ct_wcx w = poll_a();
	expect_wcx(&w, id + 1, IBV_WC_SEND, qpa->qp_num, "send cqe");
	w = poll_b();
	expect_wcx(&w, id + 2, IBV_WC_RECV, qpb->qp_num, "recv cqe");
	CT_CHECK(w.byte_len == len, "byte_len %u, expected %u", w.byte_len,
		 len);
	if (with_imm) {
		CT_CHECK(w.wc_flags & IBV_WC_WITH_IMM,
			 "wc_flags 0x%x lacks WITH_IMM", w.wc_flags);
		CT_CHECK(be32toh(w.imm_data) == imm,
			 "imm 0x%08x, expected 0x%08x", be32toh(w.imm_data),
			 imm);
	} else {
		CT_CHECK(!(w.wc_flags & IBV_WC_WITH_IMM),
			 "wc_flags 0x%x has WITH_IMM for a plain SEND",
			 w.wc_flags);
	}
	/* Scattered over two receive SGEs: 1000 + 500 bytes. */
	ct_expect_pattern(bb.p + dst, len, 30 + with_imm, "received data");
	ct_expect_zero(bb.p + dst + len, 2000 - len, "rest of recv buffer");
	ct_pass();
}

static void test_send_inline(void)
{
	const size_t dst = 20480;
	uint8_t msg[48], want[48];
	const uint32_t rl[1] = { 256 };

	ct_begin("wr_send_inline");
	ct_fill(msg, sizeof(msg), 40);
	memcpy(want, msg, sizeof(msg));
	post_recv_b(0x5002, dst, rl, 1);
	ibv_wr_start(xa);
	xa->wr_id = 0x5001;
	xa->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_send(xa);
	ibv_wr_set_inline_data(xa, msg, sizeof(msg));
	CT_OK(ibv_wr_complete(xa));
	/* Inline data is copied when posted: scribbling now must not matter. */
	memset(msg, 0xee, sizeof(msg));

	struct ct_wcx w = poll_a();
	expect_wcx(&w, 0x5001, IBV_WC_SEND, qpa->qp_num, "send cqe");
	w = poll_b();
	expect_wcx(&w, 0x5002, IBV_WC_RECV, qpb->qp_num, "recv cqe");
	CT_CHECK(w.byte_len == sizeof(msg), "byte_len %u, expected %zu",
		 w.byte_len, sizeof(msg));
	ct_expect_bytes(bb.p + dst, want, sizeof(want), "inline payload");
	ct_pass();
}

static void test_rdma_read(void)
{
	const size_t src = 24576, dst = 24576, len = 8192;

	ct_begin("wr_rdma_read");
	ct_fill(bb.p + src, len, 50);
	memset(ba.p + dst, 0, len + 64);
	ibv_wr_start(xa);
	xa->wr_id = 0x6001;
	xa->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_read(xa, bb.mr->rkey, (uintptr_t)(bb.p + src));
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + dst),
		       (uint32_t)len);
	CT_OK(ibv_wr_complete(xa));
	struct ct_wcx w = poll_a();
	expect_wcx(&w, 0x6001, IBV_WC_RDMA_READ, qpa->qp_num, "read cqe");
	CT_CHECK(w.byte_len == len, "byte_len %u, expected %zu", w.byte_len,
		 len);
	ct_expect_pattern(ba.p + dst, len, 50, "data read from B");
	ct_expect_zero(ba.p + dst + len, 64, "bytes after the read");
	ct_expect_quiet_ex(cqb, 50, "B's CQ after a read");
	ct_pass();
}

static void test_atomics(void)
{
	const size_t target = 40960, res = 40960;
	const uint64_t v0 = 0x1111222233334444ull, v1 = 0x5555666677778888ull;
	uint64_t *remote = (uint64_t *)(void *)(bb.p + target);
	uint64_t *out = (uint64_t *)(void *)(ba.p + res);
	struct ct_wcx w[3];

	ct_begin("wr_atomics");
	*remote = v0;
	out[0] = out[1] = out[2] = 0xdeadbeefdeadbeefull;
	ibv_wr_start(xa);
	xa->wr_flags = IBV_SEND_SIGNALED;
	/* 1: compare matches -> swapped. */
	xa->wr_id = 0x7001;
	ibv_wr_atomic_cmp_swp(xa, bb.mr->rkey, (uintptr_t)remote, v0, v1);
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)&out[0], 8);
	/* 2: compare does not match -> unchanged. */
	xa->wr_id = 0x7002;
	ibv_wr_atomic_cmp_swp(xa, bb.mr->rkey, (uintptr_t)remote, v0, 42);
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)&out[1], 8);
	/* 3: fetch and add. */
	xa->wr_id = 0x7003;
	ibv_wr_atomic_fetch_add(xa, bb.mr->rkey, (uintptr_t)remote, 0x10);
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)&out[2], 8);
	CT_OK(ibv_wr_complete(xa));

	ct_poll_ex_n(cqa, WC_FLAGS, w, 3, CT_TIMEOUT_MS);
	expect_wcx(&w[0], 0x7001, IBV_WC_COMP_SWAP, qpa->qp_num, "cas#1");
	expect_wcx(&w[1], 0x7002, IBV_WC_COMP_SWAP, qpa->qp_num, "cas#2");
	expect_wcx(&w[2], 0x7003, IBV_WC_FETCH_ADD, qpa->qp_num, "faa");
	CT_CHECK(out[0] == v0, "cas#1 original 0x%" PRIx64 ", expected 0x%"
		 PRIx64, out[0], v0);
	CT_CHECK(out[1] == v1, "cas#2 original 0x%" PRIx64 ", expected 0x%"
		 PRIx64, out[1], v1);
	CT_CHECK(out[2] == v1, "faa original 0x%" PRIx64 ", expected 0x%"
		 PRIx64, out[2], v1);
	CT_CHECK(*remote == v1 + 0x10, "remote 0x%" PRIx64 ", expected 0x%"
		 PRIx64, *remote, v1 + 0x10);
	ct_pass();
}

/* Two unsignaled writes and a signaled send in one wr_start..complete. */
static void test_batch_unsignaled(void)
{
	const size_t w1 = 45056, w2 = 49152, s = 53248;
	const uint32_t rl[1] = { 512 };

	ct_begin("wr_batch_unsignaled");
	ct_fill(ba.p + w1, 1024, 61);
	ct_fill(ba.p + w2, 1024, 62);
	ct_fill(ba.p + s, 512, 63);
	post_recv_b(0x8004, s, rl, 1);
	ibv_wr_start(xa);
	xa->wr_id = 0x8001;
	xa->wr_flags = 0;
	ibv_wr_rdma_write(xa, bb.mr->rkey, (uintptr_t)(bb.p + w1));
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + w1), 1024);
	xa->wr_id = 0x8002;
	xa->wr_flags = 0;
	ibv_wr_rdma_write(xa, bb.mr->rkey, (uintptr_t)(bb.p + w2));
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + w2), 1024);
	xa->wr_id = 0x8003;
	xa->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(xa);
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + s), 512);
	CT_OK(ibv_wr_complete(xa));

	struct ct_wcx w = poll_b();
	expect_wcx(&w, 0x8004, IBV_WC_RECV, qpb->qp_num, "recv cqe");
	w = poll_a();
	expect_wcx(&w, 0x8003, IBV_WC_SEND, qpa->qp_num,
		   "only the signaled WR completes");
	ct_expect_quiet_ex(cqa, CT_QUIET_MS, "unsignaled WRs");
	/* RC ordering: the send landed, so both writes did before it. */
	ct_expect_pattern(bb.p + w1, 1024, 61, "write #1");
	ct_expect_pattern(bb.p + w2, 1024, 62, "write #2");
	ct_expect_pattern(bb.p + s, 512, 63, "send");
	ct_pass();
}

static void test_abort(void)
{
	const size_t off = 57344, len = 2048;

	ct_begin("wr_abort");
	ct_fill(ba.p + off, len, 70);
	memset(bb.p + off, 0, len);
	ibv_wr_start(xa);
	xa->wr_id = 0x9001;
	xa->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(xa, bb.mr->rkey, (uintptr_t)(bb.p + off));
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + off),
		       (uint32_t)len);
	ibv_wr_abort(xa);
	ct_expect_quiet_ex(cqa, CT_QUIET_MS, "aborted WR");
	ct_expect_zero(bb.p + off, len, "target of the aborted write");

	/* The QP is still usable and the next WR is not confused with it. */
	ct_fill(ba.p + off, len, 71);
	ibv_wr_start(xa);
	xa->wr_id = 0x9002;
	xa->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(xa, bb.mr->rkey, (uintptr_t)(bb.p + off));
	ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + off),
		       (uint32_t)len);
	CT_OK(ibv_wr_complete(xa));
	struct ct_wcx w = poll_a();
	expect_wcx(&w, 0x9002, IBV_WC_RDMA_WRITE, qpa->qp_num,
		   "write after abort");
	ct_expect_quiet_ex(cqa, 50, "after the write following abort");
	ct_expect_pattern(bb.p + off, len, 71, "write after abort");
	ct_pass();
}

/* Many signaled WRs over several batches: completions in posting order. */
static void test_fifo(void)
{
	enum { ROUNDS = 8, PER = 16, CHUNK = 256 };
	struct ct_wcx w[PER];
	uint64_t next = 0xa000;

	ct_begin("wr_fifo_order");
	for (int r = 0; r < ROUNDS; r++) {
		ibv_wr_start(xa);
		for (int i = 0; i < PER; i++) {
			size_t o = (size_t)i * CHUNK;

			ct_fill(ba.p + o, CHUNK, 1000 + r * PER + i);
			xa->wr_id = next + (uint64_t)i;
			xa->wr_flags = IBV_SEND_SIGNALED;
			ibv_wr_rdma_write(xa, bb.mr->rkey,
					  (uintptr_t)(bb.p + 32768 + o));
			ibv_wr_set_sge(xa, ba.mr->lkey, (uintptr_t)(ba.p + o),
				       CHUNK);
		}
		CT_OK(ibv_wr_complete(xa));
		ct_poll_ex_n(cqa, WC_FLAGS, w, PER, CT_TIMEOUT_MS);
		for (int i = 0; i < PER; i++) {
			char what[64];

			snprintf(what, sizeof(what), "round %d wr %d", r, i);
			expect_wcx(&w[i], next + (uint64_t)i,
				   IBV_WC_RDMA_WRITE, qpa->qp_num, what);
			ct_expect_pattern(bb.p + 32768 + (size_t)i * CHUNK,
					  CHUNK, 1000 + r * PER + i, what);
		}
		next += PER;
	}
	ct_pass();
}

static void test_teardown(void)
{
	ct_begin("teardown");
	CT_OK(ibv_destroy_qp(qpa));
	CT_OK(ibv_destroy_qp(qpb));
	CT_OK(ibv_destroy_cq(ibv_cq_ex_to_cq(cqa)));
	CT_OK(ibv_destroy_cq(ibv_cq_ex_to_cq(cqb)));
	ct_buf_free(&ba);
	ct_buf_free(&bb);
	ct_close(&dev);
	ct_pass();
}

#ifdef HAVE_KRCORE
static void test_krcore_counters(void)
{
	ct_begin("krcore_counters");
	CT_KRCORE_STAT(KRCORE_STAT_CONTEXTS_OPENED, ==, 1);
	CT_KRCORE_STAT(KRCORE_STAT_QPS_CREATED, ==, 2);
	CT_KRCORE_STAT(KRCORE_STAT_CQS_CREATED, ==, 2);
	/* 141 WRs were completed through ibv_wr_complete (plus 1 aborted). */
	CT_KRCORE_STAT(KRCORE_STAT_WR_CALLS, >=, 141);
	CT_KRCORE_STAT(KRCORE_STAT_POLL_CQ, >=, 1);
	ct_pass();
}
#endif

int main(void)
{
	ct_open(&dev);
	test_setup();
	test_rdma_write();
	test_rdma_write_imm();
	test_send(0);
	test_send(1);
	test_send_inline();
	test_rdma_read();
	test_atomics();
	test_batch_unsignaled();
	test_abort();
	test_fifo();
	test_teardown();
#ifdef HAVE_KRCORE
	test_krcore_counters();
#endif
	return 0;
}
