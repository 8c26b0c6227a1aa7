/*
 * async_events: ibv_get_async_event must name the application's own objects.
 *
 * rxe (Linux 6.1) emits two async events deterministically:
 * - IBV_EVENT_SRQ_LIMIT_REACHED once an armed SRQ (ibv_modify_srq with
 *   IBV_SRQ_LIMIT) drops below its limit; the limit then reads back as 0;
 * - IBV_EVENT_SQ_DRAINED when an RC QP is moved to SQD with
 *   en_sqd_async_notify (idle or with WRs in flight).
 * It does not emit IBV_EVENT_QP_LAST_WQE_REACHED when an SRQ-attached QP goes
 * to ERR, nor QP_ACCESS_ERR on a remote access violation (checked), so those
 * are not tested here.
 *
 * The async fd is made non-blocking and waited on with poll(); every event
 * is acknowledged before the object it names is destroyed.
 */
#define _GNU_SOURCE
#include "common.h"

#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_LEN (64 * 1024)

static struct ct_dev dev;
static struct ct_buf ba, bb;

static struct ibv_async_event wait_event(void)
{
	struct pollfd pfd = { .fd = dev.ctx->async_fd, .events = POLLIN };
	struct ibv_async_event ev;
	int n = poll(&pfd, 1, CT_TIMEOUT_MS);

	CT_CHECK(n == 1, "no async event within %d ms (poll returned %d)",
		 CT_TIMEOUT_MS, n);
	memset(&ev, 0, sizeof(ev));
	if (ibv_get_async_event(dev.ctx, &ev))
		CT_FAIL("ibv_get_async_event: %s", strerror(errno));
	return ev;
}

static void expect_no_event(int ms, const char *what)
{
	struct pollfd pfd = { .fd = dev.ctx->async_fd, .events = POLLIN };
	struct ibv_async_event ev;

	if (poll(&pfd, 1, ms) == 0)
		return;
	if (ibv_get_async_event(dev.ctx, &ev) == 0) {
		enum ibv_event_type t = ev.event_type;
		void *el = ev.element.qp;

		ibv_ack_async_event(&ev);
		CT_FAIL("%s: unexpected async event %s (%d), element %p", what,
			ibv_event_type_str(t), t, el);
	}
	CT_CHECK(errno == EAGAIN, "%s: async fd readable but "
		 "ibv_get_async_event failed: %s", what, strerror(errno));
}

static void test_srq_limit(void)
{
	struct ibv_srq_init_attr sia;
	struct ibv_srq_attr sa;
	struct ibv_srq *srq;
	struct ibv_cq *cq;
	struct ibv_qp *a, *b;
	struct ibv_async_event ev;
	int srq_ctx_marker;

	ct_begin("srq_limit_reached");
	memset(&sia, 0, sizeof(sia));
	sia.srq_context = &srq_ctx_marker;
	sia.attr.max_wr = 16;
	sia.attr.max_sge = 1;
	srq = CT_PTR(ibv_create_srq(dev.pd, &sia));
	cq = CT_PTR(ibv_create_cq(dev.ctx, 64, NULL, NULL, 0));
	a = ct_create_rc_qp(&dev, cq, cq, NULL, CT_QP_CAPS_DEFAULT);
	b = ct_create_rc_qp(&dev, cq, cq, srq, CT_QP_CAPS_DEFAULT);
	ct_connect_pair(&dev, a, b);
	for (int i = 0; i < 8; i++) {
		struct ibv_sge s = { (uintptr_t)(bb.p + (size_t)i * 1024), 1024,
				     bb.mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 0x100 + (uint64_t)i,
					 .sg_list = &s, .num_sge = 1 };
		struct ibv_recv_wr *bad = NULL;

		CT_OK(ibv_post_srq_recv(srq, &w, &bad));
	}
	memset(&sa, 0, sizeof(sa));
	sa.srq_limit = 4;
	CT_OK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT));
	memset(&sa, 0, sizeof(sa));
	CT_OK(ibv_query_srq(srq, &sa));
	CT_CHECK(sa.srq_limit == 4, "srq_limit reads back %u, expected 4",
		 sa.srq_limit);

	for (int m = 0; m < 5; m++) {
		struct ibv_wc wc[2];

		ct_fill(ba.p + (size_t)m * 1024, 512, 10 + m);
		CT_OK(ct_post_send1(a, 0x200 + (uint64_t)m, IBV_WR_SEND,
				    IBV_SEND_SIGNALED, &ba, (size_t)m * 1024,
				    512, 0, 0, 0));
		ct_poll_n(cq, wc, 2, CT_TIMEOUT_MS);
		for (int i = 0; i < 2; i++) {
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS,
				 "message %d: status %s", m,
				 ibv_wc_status_str(wc[i].status));
			if (wc[i].opcode == IBV_WC_RECV) {
				CT_CHECK(wc[i].wr_id >= 0x100 &&
						 wc[i].wr_id < 0x108,
					 "recv wr_id 0x%" PRIx64, wc[i].wr_id);
				ct_expect_pattern(bb.p + (wc[i].wr_id - 0x100) *
							       1024,
						  512, 10 + m, "srq payload");
			}
		}
		/* 8 - (m + 1) receives are left: above the limit, quiet. */
		if (m < 3)
			expect_no_event(CT_QUIET_MS / 3, "SRQ above its limit");
	}
	/* 3 receives left, below 4: the event names the app's SRQ. */
	ev = wait_event();
	CT_CHECK(ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED,
		 "event %s (%d), expected SRQ_LIMIT_REACHED",
		 ibv_event_type_str(ev.event_type), ev.event_type);
	CT_CHECK(ev.element.srq == srq, "event names SRQ %p, the "
		 "application's SRQ is %p", (void *)ev.element.srq,
		 (void *)srq);
	CT_CHECK(ev.element.srq->srq_context == &srq_ctx_marker,
		 "srq_context %p, expected %p", ev.element.srq->srq_context,
		 (void *)&srq_ctx_marker);
	ibv_ack_async_event(&ev);
	/* The limit disarms itself. */
	memset(&sa, 0, sizeof(sa));
	CT_OK(ibv_query_srq(srq, &sa));
	CT_CHECK(sa.srq_limit == 0, "srq_limit %u after the event, expected 0",
		 sa.srq_limit);
	expect_no_event(CT_QUIET_MS, "after SRQ_LIMIT_REACHED");

	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	CT_OK(ibv_destroy_srq(srq));
	CT_OK(ibv_destroy_cq(cq));
	ct_pass();
}

static void to_sqd(struct ibv_qp *qp)
{
	struct ibv_qp_attr qa;

	memset(&qa, 0, sizeof(qa));
	qa.qp_state = IBV_QPS_SQD;
	qa.en_sqd_async_notify = 1;
	CT_OK(ibv_modify_qp(qp, &qa,
			    IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY));
}

static void expect_drained(struct ibv_qp *qp, const char *which)
{
	struct ibv_async_event ev = wait_event();

	CT_CHECK(ev.event_type == IBV_EVENT_SQ_DRAINED,
		 "%s: event %s (%d), expected SQ_DRAINED", which,
		 ibv_event_type_str(ev.event_type), ev.event_type);
	CT_CHECK(ev.element.qp == qp, "%s: event names QP %p, the "
		 "application's QP is %p", which, (void *)ev.element.qp,
		 (void *)qp);
	CT_CHECK(ev.element.qp->qp_num == qp->qp_num, "qp_num mismatch");
	ibv_ack_async_event(&ev);
}

static void test_sq_drained(void)
{
	struct ibv_cq *cq;
	struct ibv_qp *a, *b;
	struct ibv_qp_attr qa;
	struct ibv_wc wc[4];

	ct_begin("qp_sq_drained");
	cq = CT_PTR(ibv_create_cq(dev.ctx, 64, NULL, NULL, 0));
	a = ct_create_rc_qp(&dev, cq, cq, NULL, CT_QP_CAPS_DEFAULT);
	b = ct_create_rc_qp(&dev, cq, cq, NULL, CT_QP_CAPS_DEFAULT);
	ct_connect_pair(&dev, a, b);

	/* Idle QP. */
	to_sqd(a);
	expect_drained(a, "idle QP A");
	CT_CHECK(ct_qp_state(a) == IBV_QPS_SQD, "QP A not in SQD");

	/* QP B with four 16 KiB writes in flight. */
	for (int i = 0; i < 4; i++) {
		ct_fill(bb.p + (size_t)i * 16384, 16384, 20 + i);
		CT_OK(ct_post_send1(b, 0x300 + (uint64_t)i, IBV_WR_RDMA_WRITE,
				    IBV_SEND_SIGNALED, &bb,
				    (size_t)i * 16384, 16384,
				    (uintptr_t)(ba.p + (size_t)i * 16384),
				    ba.mr->rkey, 0));
	}
	to_sqd(b);
	expect_drained(b, "busy QP B");
	ct_poll_n(cq, wc, 4, CT_TIMEOUT_MS);
	for (int i = 0; i < 4; i++) {
		ct_expect_wc(&wc[i], 0x300 + (uint64_t)i, IBV_WC_RDMA_WRITE,
			     "write drained by SQD");
		ct_expect_pattern(ba.p + (size_t)i * 16384, 16384, 20 + i,
				  "written data");
	}

	/* SQD -> RTS: A works again. */
	memset(&qa, 0, sizeof(qa));
	qa.qp_state = IBV_QPS_RTS;
	CT_OK(ibv_modify_qp(a, &qa, IBV_QP_STATE));
	ct_fill(ba.p, 256, 30);
	CT_OK(ct_post_send1(a, 0x400, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED,
			    &ba, 0, 256, (uintptr_t)(bb.p + 65536 - 256),
			    bb.mr->rkey, 0));
	wc[0] = ct_poll1(cq);
	ct_expect_wc(&wc[0], 0x400, IBV_WC_RDMA_WRITE, "write after SQD->RTS");
	ct_expect_pattern(bb.p + 65536 - 256, 256, 30, "data after SQD->RTS");
	expect_no_event(CT_QUIET_MS, "after SQ_DRAINED");

	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	CT_OK(ibv_destroy_cq(cq));
	ct_pass();
}

int main(void)
{
	int fl;

	ct_open(&dev);
	ct_buf_alloc(&ba, dev.pd, BUF_LEN);
	ct_buf_alloc(&bb, dev.pd, BUF_LEN);
	ct_begin("setup");
	fl = fcntl(dev.ctx->async_fd, F_GETFL);
	CT_CHECK(fl >= 0, "F_GETFL on async_fd %d: %s", dev.ctx->async_fd,
		 strerror(errno));
	CT_CHECK(fcntl(dev.ctx->async_fd, F_SETFL, fl | O_NONBLOCK) == 0,
		 "F_SETFL: %s", strerror(errno));
	expect_no_event(50, "fresh context");
	ct_pass();

	test_srq_limit();
	test_sq_drained();

	ct_begin("teardown");
	ct_buf_free(&ba);
	ct_buf_free(&bb);
	ct_close(&dev);
	ct_pass();
#ifdef HAVE_KRCORE
	ct_begin("krcore_counters");
	CT_KRCORE_STAT(KRCORE_STAT_ASYNC_EVENTS, ==, 3);
	CT_KRCORE_STAT(KRCORE_STAT_SRQS_CREATED, ==, 1);
	CT_KRCORE_STAT(KRCORE_STAT_QPS_CREATED, ==, 4);
	ct_pass();
#endif
	return 0;
}
