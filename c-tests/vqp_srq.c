/*
 * A virtual SRQ bounds a receive by the port's max_msg_sz, as a VQP's
 * receive queue does (issue 18, item 3; it used RC's 2 GiB before).
 *
 * One process, KRCORE_VIRTUALIZE=1, krcore-meta started here. An SRQ
 * (max_sge 2) and two transparent RC QPs connected to each other in this
 * process (GID A and GID B), the receiving one on the SRQ (so the SRQ is
 * virtual). A list of three receives is posted: the first max_msg_sz bytes
 * in two SGEs, the second max_msg_sz + 1 bytes in two SGEs, the third
 * small:
 * - ibv_post_srq_recv returns EINVAL with *bad_recv_wr at the second;
 * - the first was posted, the third not: a SEND lands in the first
 *   (wr_id, byte_len and bytes checked), a second SEND finds no receive
 *   (no completion within CT_QUIET_MS) until one is posted, then lands in
 *   it; nothing else completes.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define MSG 3000u

int main(void)
{
	struct ct_dev d;
	struct ct_buf rb, sb;
	struct ibv_cq *scq, *rcq;
	struct ibv_srq *srq;
	struct ibv_qp *a, *b;
	struct ibv_wc wc;
	pid_t meta_pid;
	uint32_t max;

	setvbuf(stdout, NULL, _IOLBF, 0);
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "10000", 1);
	ct_watchdog(120);
	meta_pid = ct_start_meta();
	setenv("KRCORE_VIRTUALIZE", "1", 1);
	ct_open(&d);
	max = d.port_attr.max_msg_sz;
	ct_note("port max_msg_sz %u", max);
	CT_CHECK(max < (64u << 20), "max_msg_sz %u: no buffer that large here", max);

	ct_begin("vqp_srq: a receive above max_msg_sz is refused");
	ct_buf_alloc(&rb, d.pd, (size_t)max + 4096);
	ct_buf_alloc(&sb, d.pd, 2 * MSG);
	scq = CT_PTR(ibv_create_cq(d.ctx, 16, NULL, NULL, 0));
	rcq = CT_PTR(ibv_create_cq(d.ctx, 16, NULL, NULL, 0));
	{
		struct ibv_srq_init_attr sia = { .attr = { .max_wr = 8, .max_sge = 2 } };

		srq = CT_PTR(ibv_create_srq(d.pd, &sia));
	}
	a = ct_create_rc_qp(&d, scq, scq, NULL, (struct ct_qp_caps){ 16, 16, 1, 1, 0, 0 });
	b = ct_create_rc_qp(&d, scq, rcq, srq, (struct ct_qp_caps){ 16, 16, 1, 2, 0, 0 });
	CT_CHECK((a->qp_num & 0x800000) && (b->qp_num & 0x800000), "QPs not virtual: %#x %#x", a->qp_num,
		 b->qp_num);
	ct_connect_pair(&d, a, b);
	{
		uint8_t *p = rb.p;
		uint32_t k = rb.mr->lkey;
		struct ibv_sge at_max[2] = { { (uintptr_t)p, max / 2, k }, { (uintptr_t)p + max / 2, max - max / 2, k } };
		struct ibv_sge over[2] = { { (uintptr_t)p, max / 2 + 1, k },
					   { (uintptr_t)p + max / 2 + 1, max - max / 2, k } };
		struct ibv_sge small = { (uintptr_t)p, MSG, k };
		struct ibv_recv_wr w[3] = {
			{ .wr_id = 1, .next = &w[1], .sg_list = at_max, .num_sge = 2 },
			{ .wr_id = 2, .next = &w[2], .sg_list = over, .num_sge = 2 },
			{ .wr_id = 3, .next = NULL, .sg_list = &small, .num_sge = 1 },
		};
		struct ibv_recv_wr *bad = NULL;
		int rc = ibv_post_srq_recv(srq, w, &bad);

		CT_CHECK(rc == EINVAL, "ibv_post_srq_recv of max_msg_sz + 1 bytes returned %d, expected EINVAL", rc);
		CT_CHECK(bad == &w[1], "*bad_recv_wr %p, expected the second WR %p", (void *)bad, (void *)&w[1]);
	}
	ct_pass();

	ct_begin("vqp_srq: the receive before it was posted, the one after it not");
	memset(rb.p, 0, 2 * MSG);
	ct_fill(sb.p, MSG, 11);
	CT_OK(ct_post_send1(a, 10, IBV_WR_SEND, IBV_SEND_SIGNALED, &sb, 0, MSG, 0, 0, 0));
	ct_poll_n(rcq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1 && wc.byte_len == MSG,
		 "first SEND: %s, wr_id %llu, byte_len %u", ibv_wc_status_str(wc.status),
		 (unsigned long long)wc.wr_id, wc.byte_len);
	ct_expect_pattern(rb.p, MSG, 11, "first SEND");
	ct_poll_n(scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 10, "first SEND's send completion: %s",
		 ibv_wc_status_str(wc.status));
	ct_fill(sb.p + MSG, MSG, 12);
	CT_OK(ct_post_send1(a, 20, IBV_WR_SEND, IBV_SEND_SIGNALED, &sb, MSG, MSG, 0, 0, 0));
	/* The third receive was not posted: the message waits. */
	ct_expect_quiet(rcq, CT_QUIET_MS, "the SRQ holds no receive");
	{
		struct ibv_sge s = { (uintptr_t)rb.p + MSG, MSG, rb.mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 4, .sg_list = &s, .num_sge = 1 };
		struct ibv_recv_wr *bad = NULL;

		CT_OK(ibv_post_srq_recv(srq, &w, &bad));
	}
	ct_poll_n(rcq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 4 && wc.byte_len == MSG,
		 "second SEND: %s, wr_id %llu, byte_len %u", ibv_wc_status_str(wc.status),
		 (unsigned long long)wc.wr_id, wc.byte_len);
	ct_expect_pattern(rb.p + MSG, MSG, 12, "second SEND");
	ct_poll_n(scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 20, "second SEND's send completion: %s",
		 ibv_wc_status_str(wc.status));
	ct_expect_quiet(rcq, CT_QUIET_MS, "nothing more received");
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	ct_pass();

	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	CT_OK(ibv_destroy_srq(srq));
	CT_OK(ibv_destroy_cq(scq));
	CT_OK(ibv_destroy_cq(rcq));
	ct_buf_free(&rb);
	ct_buf_free(&sb);
	ct_close(&d);
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	return 0;
}
