/*
 * cq_events: the classic data path and completion events.
 *
 * - ibv_post_send / ibv_post_recv / ibv_poll_cq with SEND (multi-SGE, with
 *   immediate, inline) and RDMA WRITE (with and without immediate);
 * - a completion channel: ibv_req_notify_cq + ibv_get_cq_event must return
 *   the very CQ pointer the application created and its cq_context, both
 *   blocking and through poll() on the channel fd, solicited-only arming,
 *   ibv_ack_cq_events;
 * - an SRQ shared by two QPs (ibv_create_srq, ibv_post_srq_recv);
 * - orderly destruction (a channel with a CQ attached is EBUSY).
 */
#define _GNU_SOURCE
#include "common.h"

#include <endian.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_LEN (64 * 1024)

static struct ct_dev dev;
static struct ibv_comp_channel *ch;
static struct ibv_cq *cqa, *cqb_send, *cqb_recv;
static struct ibv_qp *qpa, *qpb;
static struct ct_buf ba, bb;
static int ev_marker;		/* &ev_marker is cqb_recv's cq_context */
static unsigned events_unacked;

static void test_setup(void)
{
	ct_begin("setup");
	ch = CT_PTR(ibv_create_comp_channel(dev.ctx));
	CT_CHECK(ch->context == dev.ctx, "channel->context mismatch");
	CT_CHECK(ch->fd >= 0, "channel fd %d", ch->fd);
	cqa = CT_PTR(ibv_create_cq(dev.ctx, 128, NULL, NULL, 0));
	cqb_send = CT_PTR(ibv_create_cq(dev.ctx, 128, NULL, NULL, 0));
	cqb_recv = CT_PTR(ibv_create_cq(dev.ctx, 128, &ev_marker, ch, 0));
	CT_CHECK(cqb_recv->cq_context == &ev_marker,
		 "cq->cq_context %p, expected %p", cqb_recv->cq_context,
		 (void *)&ev_marker);
	CT_CHECK(cqb_recv->channel == ch, "cq->channel mismatch");
	CT_CHECK(cqb_recv->cqe >= 128, "cq->cqe %d < 128", cqb_recv->cqe);
	qpa = ct_create_rc_qp(&dev, cqa, cqa, NULL, CT_QP_CAPS_DEFAULT);
	qpb = ct_create_rc_qp(&dev, cqb_send, cqb_recv, NULL,
			      CT_QP_CAPS_DEFAULT);
	ct_buf_alloc(&ba, dev.pd, BUF_LEN);
	ct_buf_alloc(&bb, dev.pd, BUF_LEN);
	ct_connect_pair(&dev, qpa, qpb);
	ct_pass();
}

static void test_send_recv(void)
{
	struct ibv_sge sge[3];
	struct ibv_send_wr wr[2], *bad = NULL;
	struct ibv_recv_wr rwr[2], *rbad = NULL;
	struct ibv_sge rsge[2];
	struct ibv_wc wc[2];

	ct_begin("post_send_recv");
	/* Two receives posted as one chain, 4 KiB each. */
	memset(rwr, 0, sizeof(rwr));
	for (int i = 0; i < 2; i++) {
		rsge[i].addr = (uintptr_t)(bb.p + (size_t)i * 4096);
		rsge[i].length = 4096;
		rsge[i].lkey = bb.mr->lkey;
		rwr[i].wr_id = 0x100 + (uint64_t)i;
		rwr[i].sg_list = &rsge[i];
		rwr[i].num_sge = 1;
		rwr[i].next = i ? NULL : &rwr[1];
	}
	CT_OK(ibv_post_recv(qpb, rwr, &rbad));

	/* SEND gathering 3 pieces, then SEND_WITH_IMM, one chain. */
	ct_fill(ba.p, 300, 1);
	ct_fill(ba.p + 1000, 700, 2);
	ct_fill(ba.p + 2000, 1, 3);
	ct_fill(ba.p + 3000, 2048, 4);
	for (int i = 0; i < 3; i++)
		sge[i].lkey = ba.mr->lkey;
	sge[0].addr = (uintptr_t)ba.p;
	sge[0].length = 300;
	sge[1].addr = (uintptr_t)(ba.p + 1000);
	sge[1].length = 700;
	sge[2].addr = (uintptr_t)(ba.p + 2000);
	sge[2].length = 1;
	memset(wr, 0, sizeof(wr));
	wr[0].wr_id = 0x201;
	wr[0].sg_list = sge;
	wr[0].num_sge = 3;
	wr[0].opcode = IBV_WR_SEND;
	wr[0].send_flags = IBV_SEND_SIGNALED;
	wr[0].next = &wr[1];
	struct ibv_sge s2 = { (uintptr_t)(ba.p + 3000), 2048, ba.mr->lkey };
	wr[1].wr_id = 0x202;
	wr[1].sg_list = &s2;
	wr[1].num_sge = 1;
	wr[1].opcode = IBV_WR_SEND_WITH_IMM;
	wr[1].imm_data = htobe32(0xfeedf00d);
	wr[1].send_flags = IBV_SEND_SIGNALED;
	CT_OK(ibv_post_send(qpa, wr, &bad));

	ct_poll_n(cqa, wc, 2, CT_TIMEOUT_MS);
	ct_expect_wc(&wc[0], 0x201, IBV_WC_SEND, "send #1");
	ct_expect_wc(&wc[1], 0x202, IBV_WC_SEND, "send #2");
	CT_CHECK(wc[0].qp_num == qpa->qp_num, "qp_num %u, expected %u",
		 wc[0].qp_num, qpa->qp_num);

	ct_poll_n(cqb_recv, wc, 2, CT_TIMEOUT_MS);
	ct_expect_wc(&wc[0], 0x100, IBV_WC_RECV, "recv #1");
	ct_expect_wc(&wc[1], 0x101, IBV_WC_RECV, "recv #2");
	for (int i = 0; i < 2; i++)
		CT_CHECK(wc[i].qp_num == qpb->qp_num,
			 "recv #%d qp_num %u, expected %u", i + 1,
			 wc[i].qp_num, qpb->qp_num);
	CT_CHECK(wc[0].byte_len == 1001, "recv #1 byte_len %u, expected 1001",
		 wc[0].byte_len);
	CT_CHECK(!(wc[0].wc_flags & IBV_WC_WITH_IMM),
		 "recv #1 has WITH_IMM");
	CT_CHECK(wc[1].byte_len == 2048, "recv #2 byte_len %u, expected 2048",
		 wc[1].byte_len);
	CT_CHECK(wc[1].wc_flags & IBV_WC_WITH_IMM, "recv #2 lacks WITH_IMM");
	CT_CHECK(be32toh(wc[1].imm_data) == 0xfeedf00d,
		 "recv #2 imm 0x%08x", be32toh(wc[1].imm_data));
	ct_expect_pattern(bb.p, 300, 1, "recv #1 piece 1");
	ct_expect_pattern(bb.p + 300, 700, 2, "recv #1 piece 2");
	ct_expect_pattern(bb.p + 1000, 1, 3, "recv #1 piece 3");
	ct_expect_zero(bb.p + 1001, 64, "after recv #1");
	ct_expect_pattern(bb.p + 4096, 2048, 4, "recv #2");
	ct_expect_quiet(cqb_send, 20, "B's send CQ");
	ct_pass();
}

static void test_inline(void)
{
	uint8_t msg[32];
	struct ibv_sge sge = { (uintptr_t)msg, sizeof(msg), 0 };
	struct ibv_send_wr wr, *bad = NULL;
	struct ibv_wc wc;

	ct_begin("post_send_inline");
	ct_fill(msg, sizeof(msg), 5);
	ct_post_recv1(qpb, 0x301, &bb, 8192, 256);
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = 0x302;
	wr.sg_list = &sge;	/* unregistered stack memory: inline only */
	wr.num_sge = 1;
	wr.opcode = IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	CT_OK(ibv_post_send(qpa, &wr, &bad));
	memset(msg, 0xaa, sizeof(msg));
	wc = ct_poll1(cqa);
	ct_expect_wc(&wc, 0x302, IBV_WC_SEND, "inline send");
	wc = ct_poll1(cqb_recv);
	ct_expect_wc(&wc, 0x301, IBV_WC_RECV, "inline recv");
	CT_CHECK(wc.byte_len == 32, "byte_len %u", wc.byte_len);
	ct_expect_pattern(bb.p + 8192, 32, 5, "inline payload");
	ct_pass();
}

static void test_write(void)
{
	struct ibv_wc wc;

	ct_begin("post_send_rdma_write");
	ct_fill(ba.p + 16384, 8192, 6);
	CT_OK(ct_post_send1(qpa, 0x401, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED,
			    &ba, 16384, 8192, (uintptr_t)(bb.p + 16384),
			    bb.mr->rkey, 0));
	wc = ct_poll1(cqa);
	ct_expect_wc(&wc, 0x401, IBV_WC_RDMA_WRITE, "write");
	ct_expect_pattern(bb.p + 16384, 8192, 6, "written data");
	ct_expect_quiet(cqb_recv, 20, "B's recv CQ after plain write");

	/* WRITE_WITH_IMM consumes a receive; the data goes to raddr. */
	ct_post_recv1(qpb, 0x403, &bb, 0, 0);
	ct_fill(ba.p + 24576, 5000, 7);
	CT_OK(ct_post_send1(qpa, 0x402, IBV_WR_RDMA_WRITE_WITH_IMM,
			    IBV_SEND_SIGNALED, &ba, 24576, 5000,
			    (uintptr_t)(bb.p + 24576), bb.mr->rkey, 77));
	wc = ct_poll1(cqa);
	ct_expect_wc(&wc, 0x402, IBV_WC_RDMA_WRITE, "write_imm");
	wc = ct_poll1(cqb_recv);
	ct_expect_wc(&wc, 0x403, IBV_WC_RECV_RDMA_WITH_IMM, "write_imm recv");
	CT_CHECK(wc.wc_flags & IBV_WC_WITH_IMM, "lacks WITH_IMM");
	CT_CHECK(be32toh(wc.imm_data) == 77, "imm %u", be32toh(wc.imm_data));
	CT_CHECK(wc.byte_len == 5000, "byte_len %u, expected 5000",
		 wc.byte_len);
	CT_CHECK(wc.qp_num == qpb->qp_num, "qp_num %u", wc.qp_num);
	ct_expect_pattern(bb.p + 24576, 5000, 7, "write_imm data");

	/* And a READ back, for good measure. */
	memset(ba.p + 32768, 0, 5000);
	CT_OK(ct_post_send1(qpa, 0x404, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED,
			    &ba, 32768, 5000, (uintptr_t)(bb.p + 24576),
			    bb.mr->rkey, 0));
	wc = ct_poll1(cqa);
	ct_expect_wc(&wc, 0x404, IBV_WC_RDMA_READ, "read");
	ct_expect_pattern(ba.p + 32768, 5000, 7, "read data");
	ct_pass();
}

/* A is sending one message to B; B's receive CQ is the event CQ. */
static void send_a_to_b(uint64_t id, size_t off, uint32_t seed,
			unsigned flags)
{
	struct ibv_wc wc;

	ct_fill(ba.p + off, 512, seed);
	ct_post_recv1(qpb, id + 1, &bb, off, 512);
	CT_OK(ct_post_send1(qpa, id, IBV_WR_SEND, IBV_SEND_SIGNALED | flags,
			    &ba, off, 512, 0, 0, 0));
	wc = ct_poll1(cqa);
	ct_expect_wc(&wc, id, IBV_WC_SEND, "send");
}

static void expect_recv(uint64_t id, size_t off, uint32_t seed)
{
	struct ibv_wc wc = ct_poll1(cqb_recv);

	ct_expect_wc(&wc, id, IBV_WC_RECV, "recv on event CQ");
	ct_expect_pattern(bb.p + off, 512, seed, "payload");
}

static void expect_event(int timeout_ms)
{
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;

	if (timeout_ms >= 0) {
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		int n = poll(&pfd, 1, timeout_ms);

		CT_CHECK(n == 1, "poll(channel fd) returned %d after %d ms "
			 "(no completion event)", n, timeout_ms);
	}
	if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx))
		CT_FAIL("ibv_get_cq_event failed: %s", strerror(errno));
	events_unacked++;
	CT_CHECK(ev_cq == cqb_recv, "event CQ %p is not the application's "
		 "CQ %p", (void *)ev_cq, (void *)cqb_recv);
	CT_CHECK(ev_ctx == &ev_marker, "event cq_context %p, expected %p",
		 ev_ctx, (void *)&ev_marker);
}

static void expect_no_event(int ms)
{
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	int n = poll(&pfd, 1, ms);

	CT_CHECK(n == 0, "poll(channel fd) returned %d (revents 0x%x): "
		 "unexpected completion event", n, pfd.revents);
}

static void test_event_blocking(void)
{
	ct_begin("cq_event_blocking");
	CT_OK(ibv_req_notify_cq(cqb_recv, 0));
	send_a_to_b(0x501, 36864, 8, 0);
	/* Blocking read, as ibv_rc_pingpong does (guarded by the watchdog). */
	expect_event(-1);
	ibv_ack_cq_events(cqb_recv, 1);
	events_unacked--;
	expect_recv(0x502, 36864, 8);
	ct_pass();
}

static void test_event_poll_fd(void)
{
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	int fl;

	ct_begin("cq_event_poll_fd");
	fl = fcntl(ch->fd, F_GETFL);
	CT_CHECK(fl >= 0, "F_GETFL on channel fd: %s", strerror(errno));
	CT_CHECK(fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) == 0,
		 "F_SETFL O_NONBLOCK: %s", strerror(errno));
	/* Nothing armed, nothing pending: a non-blocking read fails. */
	errno = 0;
	CT_CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) != 0,
		 "ibv_get_cq_event returned an event with nothing pending");
	CT_CHECK(errno == EAGAIN || errno == EWOULDBLOCK,
		 "errno %d (%s), expected EAGAIN", errno, strerror(errno));

	/* Armed once: two completions make exactly one event. */
	CT_OK(ibv_req_notify_cq(cqb_recv, 0));
	send_a_to_b(0x601, 37888, 9, 0);
	send_a_to_b(0x603, 38912, 10, 0);
	expect_event(CT_TIMEOUT_MS);
	expect_recv(0x602, 37888, 9);
	expect_recv(0x604, 38912, 10);
	expect_no_event(CT_QUIET_MS);

	/* Re-armed: the next completion makes a second event. */
	CT_OK(ibv_req_notify_cq(cqb_recv, 0));
	send_a_to_b(0x605, 39936, 11, 0);
	expect_event(CT_TIMEOUT_MS);
	expect_recv(0x606, 39936, 11);
	/* Both events acknowledged at once. */
	CT_CHECK(events_unacked == 2, "events_unacked %u", events_unacked);
	ibv_ack_cq_events(cqb_recv, events_unacked);
	events_unacked = 0;
	ct_pass();
}

static void test_event_solicited(void)
{
	ct_begin("cq_event_solicited");
	CT_OK(ibv_req_notify_cq(cqb_recv, 1));
	/* An unsolicited message completes but raises no event. */
	send_a_to_b(0x701, 40960, 12, 0);
	expect_recv(0x702, 40960, 12);
	expect_no_event(CT_QUIET_MS);
	/* A solicited one does. */
	send_a_to_b(0x703, 41984, 13, IBV_SEND_SOLICITED);
	expect_event(CT_TIMEOUT_MS);
	expect_recv(0x704, 41984, 13);
	ibv_ack_cq_events(cqb_recv, 1);
	events_unacked = 0;
	ct_pass();
}

/* Two QPs (B2, B3) share one SRQ; A2 and A3 send to them. */
static void test_srq(void)
{
	enum { SLOTS = 8, SLOT = 1024 };
	struct ibv_srq_init_attr sia;
	struct ibv_srq_attr sa;
	struct ibv_srq *srq;
	struct ibv_cq *cq_send, *cq_srq;
	struct ibv_qp *a2, *a3, *b2, *b3;
	struct ibv_recv_wr rwr[SLOTS], *bad = NULL;
	struct ibv_sge rsge[SLOTS];
	int used[SLOTS] = { 0 };
	struct ct_buf sb;

	ct_begin("srq_recv");
	memset(&sia, 0, sizeof(sia));
	sia.srq_context = &sia;
	sia.attr.max_wr = 32;
	sia.attr.max_sge = 1;
	srq = CT_PTR(ibv_create_srq(dev.pd, &sia));
	CT_CHECK(srq->context == dev.ctx && srq->pd == dev.pd,
		 "srq context/pd mismatch");
	CT_CHECK(srq->srq_context == &sia, "srq_context mismatch");
	memset(&sa, 0, sizeof(sa));
	CT_OK(ibv_query_srq(srq, &sa));
	CT_CHECK(sa.max_wr >= 32, "srq max_wr %u", sa.max_wr);

	cq_send = CT_PTR(ibv_create_cq(dev.ctx, 64, NULL, NULL, 0));
	cq_srq = CT_PTR(ibv_create_cq(dev.ctx, 64, NULL, NULL, 0));
	a2 = ct_create_rc_qp(&dev, cq_send, cq_send, NULL, CT_QP_CAPS_DEFAULT);
	a3 = ct_create_rc_qp(&dev, cq_send, cq_send, NULL, CT_QP_CAPS_DEFAULT);
	b2 = ct_create_rc_qp(&dev, cq_send, cq_srq, srq, CT_QP_CAPS_DEFAULT);
	b3 = ct_create_rc_qp(&dev, cq_send, cq_srq, srq, CT_QP_CAPS_DEFAULT);
	CT_CHECK(b2->srq == srq && b3->srq == srq, "qp->srq mismatch");
	ct_connect_pair(&dev, a2, b2);
	ct_connect_pair(&dev, a3, b3);
	ct_buf_alloc(&sb, dev.pd, SLOTS * SLOT);

	memset(rwr, 0, sizeof(rwr));
	for (int i = 0; i < SLOTS; i++) {
		rsge[i].addr = (uintptr_t)(sb.p + (size_t)i * SLOT);
		rsge[i].length = SLOT;
		rsge[i].lkey = sb.mr->lkey;
		rwr[i].wr_id = 0x800 + (uint64_t)i;
		rwr[i].sg_list = &rsge[i];
		rwr[i].num_sge = 1;
		rwr[i].next = i + 1 < SLOTS ? &rwr[i + 1] : NULL;
	}
	CT_OK(ibv_post_srq_recv(srq, rwr, &bad));

	/* Six messages, alternating senders, one at a time. */
	for (int m = 0; m < 6; m++) {
		struct ibv_qp *src = (m & 1) ? a3 : a2;
		struct ibv_qp *dst = (m & 1) ? b3 : b2;
		uint32_t len = 100 + (uint32_t)m * 150;
		struct ibv_wc wc;
		int slot;

		ct_fill(ba.p + 45056 + (size_t)m * SLOT, len, 100 + m);
		CT_OK(ct_post_send1(src, 0x900 + (uint64_t)m, IBV_WR_SEND,
				    IBV_SEND_SIGNALED, &ba,
				    45056 + (size_t)m * SLOT, len, 0, 0, 0));
		wc = ct_poll1(cq_send);
		ct_expect_wc(&wc, 0x900 + (uint64_t)m, IBV_WC_SEND, "srq send");
		CT_CHECK(wc.qp_num == src->qp_num, "send qp_num %u, expected %u",
			 wc.qp_num, src->qp_num);
		wc = ct_poll1(cq_srq);
		if (wc.status != IBV_WC_SUCCESS)
			CT_FAIL("srq recv status %s",
				ibv_wc_status_str(wc.status));
		CT_CHECK(wc.opcode == IBV_WC_RECV, "opcode %d", wc.opcode);
		CT_CHECK(wc.wr_id >= 0x800 && wc.wr_id < 0x800 + SLOTS,
			 "srq recv wr_id 0x%" PRIx64 " was never posted",
			 wc.wr_id);
		slot = (int)(wc.wr_id - 0x800);
		CT_CHECK(!used[slot], "srq recv wr_id 0x%" PRIx64
			 " completed twice", wc.wr_id);
		used[slot] = 1;
		CT_CHECK(wc.qp_num == dst->qp_num,
			 "message %d: recv qp_num %u, expected %u (%s)", m,
			 wc.qp_num, dst->qp_num, (m & 1) ? "B3" : "B2");
		CT_CHECK(wc.byte_len == len, "byte_len %u, expected %u",
			 wc.byte_len, len);
		ct_expect_pattern(sb.p + (size_t)slot * SLOT, len, 100 + m,
				  "srq payload");
	}
	ct_expect_quiet(cq_srq, 20, "srq CQ");

	CT_OK(ibv_destroy_qp(a2));
	CT_OK(ibv_destroy_qp(a3));
	CT_OK(ibv_destroy_qp(b2));
	CT_OK(ibv_destroy_qp(b3));
	CT_OK(ibv_destroy_srq(srq));
	CT_OK(ibv_destroy_cq(cq_send));
	CT_OK(ibv_destroy_cq(cq_srq));
	ct_buf_free(&sb);
	ct_pass();
}

static void test_teardown(void)
{
	int rc;

	ct_begin("teardown");
	CT_OK(ibv_destroy_qp(qpa));
	CT_OK(ibv_destroy_qp(qpb));
	/* A channel that still has a CQ cannot go. */
	rc = ibv_destroy_comp_channel(ch);
	CT_CHECK(rc == EBUSY, "ibv_destroy_comp_channel with a CQ attached "
		 "returned %d, expected EBUSY (%d)", rc, EBUSY);
	CT_OK(ibv_destroy_cq(cqa));
	CT_OK(ibv_destroy_cq(cqb_send));
	/* All events were acknowledged, so this must not block. */
	CT_OK(ibv_destroy_cq(cqb_recv));
	CT_OK(ibv_destroy_comp_channel(ch));
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
	CT_KRCORE_STAT(KRCORE_STAT_QPS_CREATED, ==, 6);
	CT_KRCORE_STAT(KRCORE_STAT_SRQS_CREATED, ==, 1);
	CT_KRCORE_STAT(KRCORE_STAT_REQ_NOTIFY_CQ, ==, 4);
	CT_KRCORE_STAT(KRCORE_STAT_CQ_EVENTS, ==, 4);
	CT_KRCORE_STAT(KRCORE_STAT_POST_SRQ_RECV, ==, 1);
	CT_KRCORE_STAT(KRCORE_STAT_POST_ERRORS, ==, 0);
	ct_pass();
}
#endif

int main(void)
{
	ct_open(&dev);
	test_setup();
	test_send_recv();
	test_inline();
	test_write();
	test_event_blocking();
	test_event_poll_fd();
	test_event_solicited();
	test_srq();
	test_teardown();
#ifdef HAVE_KRCORE
	test_krcore_counters();
#endif
	return 0;
}
