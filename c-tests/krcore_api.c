/*
 * krcore_api: the krcore C API (include/krcore.h) and proof that the verbs
 * calls of a program linked with -lkrcore really go through krcore.
 *
 * - krcore_version, krcore_stat_name, krcore_stats_json, krcore_config_dump
 *   behave as documented in the header (static strings, snprintf-style
 *   truncation, NULL/0 outside the enum);
 * - the objects the program gets (context, QP, CQ, SRQ) carry function
 *   pointers that live in libkrcore.so (dladdr), i.e. the static inline
 *   verbs of <infiniband/verbs.h> jump into krcore;
 * - every counter moves by exactly the number of calls this program made
 *   (opens, PDs, MRs, CQs, QPs, SRQs, post_send/recv/srq_recv, poll_cq,
 *   req_notify_cq, CQ events, ibv_wr_* work requests, failed posts).
 */
#define _GNU_SOURCE
#include "common.h"

#include <ctype.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef HAVE_KRCORE
#error "krcore_api needs include/krcore.h (build with LINK=krcore)"
#endif

static uint64_t base[KRCORE_STAT_COUNT];

static void snapshot(void)
{
	for (uint32_t i = 0; i < KRCORE_STAT_COUNT; i++)
		base[i] = krcore_stat_get(i);
}

static uint64_t delta(enum krcore_stat s)
{
	return krcore_stat_get(s) - base[s];
}

#define EXPECT_DELTA(stat, want)                                              \
	do {                                                                  \
		uint64_t d_ = delta(stat), w_ = (want);                       \
		if (d_ != w_)                                                 \
			CT_FAIL("counter %s moved by %" PRIu64 ", expected "  \
				"%" PRIu64, krcore_stat_name(stat), d_, w_);  \
	} while (0)
#define EXPECT_DELTA_MIN(stat, want)                                          \
	do {                                                                  \
		uint64_t d_ = delta(stat), w_ = (want);                       \
		if (d_ < w_)                                                  \
			CT_FAIL("counter %s moved by %" PRIu64 ", expected "  \
				"at least %" PRIu64, krcore_stat_name(stat),  \
				d_, w_);                                      \
	} while (0)

static void test_version(void)
{
	const char *v = krcore_version();
	int dots = 0;

	ct_begin("krcore_version");
	CT_CHECK(v != NULL && *v, "empty version");
	for (const char *p = v; *p && *p != '-' && *p != '+'; p++) {
		if (*p == '.')
			dots++;
		else
			CT_CHECK(isdigit((unsigned char)*p),
				 "version \"%s\" is not MAJOR.MINOR.PATCH", v);
	}
	CT_CHECK(dots == 2, "version \"%s\" is not MAJOR.MINOR.PATCH", v);
	CT_CHECK(krcore_version() == v, "version string is not static");
	printf("krcore %s\n", v);
	ct_pass();
}

static void test_names(void)
{
	ct_begin("krcore_stat_name");
	for (uint32_t i = 0; i < KRCORE_STAT_COUNT; i++) {
		const char *n = krcore_stat_name(i);

		CT_CHECK(n != NULL && *n, "counter %u has no name", i);
		for (const char *p = n; *p; p++)
			CT_CHECK(islower((unsigned char)*p) || *p == '_' ||
					 isdigit((unsigned char)*p),
				 "name \"%s\" is not snake_case", n);
		for (uint32_t j = 0; j < i; j++)
			CT_CHECK(strcmp(n, krcore_stat_name(j)),
				 "counters %u and %u are both \"%s\"", j, i, n);
	}
	CT_CHECK(!strcmp(krcore_stat_name(KRCORE_STAT_POST_SEND), "post_send"),
		 "POST_SEND is \"%s\"", krcore_stat_name(KRCORE_STAT_POST_SEND));
	CT_CHECK(!strcmp(krcore_stat_name(KRCORE_STAT_QPS_CREATED),
			 "qps_created"), "QPS_CREATED is \"%s\"",
		 krcore_stat_name(KRCORE_STAT_QPS_CREATED));
	CT_CHECK(krcore_stat_name(KRCORE_STAT_COUNT) == NULL,
		 "a name for KRCORE_STAT_COUNT");
	CT_CHECK(krcore_stat_name(0xffffffffu) == NULL, "a name for ~0");
	CT_CHECK(krcore_stat_get(KRCORE_STAT_COUNT) == 0,
		 "a value for KRCORE_STAT_COUNT");
	CT_CHECK(krcore_stat_get(0xffffffffu) == 0, "a value for ~0");
	ct_pass();
}

/* snprintf-style text export: NULL/0 sizing, full copy, truncation. */
static char *text_export(size_t (*fn)(char *, size_t), const char *what)
{
	size_t n = fn(NULL, 0), m;
	char *buf, small[8];

	CT_CHECK(n > 0, "%s(NULL, 0) returned 0", what);
	buf = malloc(n + 1);
	CT_CHECK(buf != NULL, "malloc");
	memset(buf, 'X', n + 1);
	m = fn(buf, n + 1);
	CT_CHECK(m == n, "%s: %zu then %zu", what, n, m);
	CT_CHECK(buf[n] == '\0' && strlen(buf) == n,
		 "%s: not NUL-terminated at %zu", what, n);
	memset(small, 'X', sizeof(small));
	m = fn(small, sizeof(small));
	CT_CHECK(m >= n, "%s truncated call returned %zu < %zu", what, m, n);
	CT_CHECK(small[sizeof(small) - 1] == '\0', "%s: truncated copy not "
		 "NUL-terminated", what);
	CT_CHECK(!strncmp(small, buf, sizeof(small) - 1),
		 "%s: truncated copy differs", what);
	return buf;
}

static void test_json(void)
{
	char *json, key[64];

	ct_begin("krcore_stats_json");
	json = text_export(krcore_stats_json, "krcore_stats_json");
	CT_CHECK(json[0] == '{' && json[strlen(json) - 1] == '}',
		 "not a JSON object: %s", json);
	CT_CHECK(strstr(json, krcore_version()) != NULL,
		 "version missing: %s", json);
	for (uint32_t i = 0; i < KRCORE_STAT_COUNT; i++) {
		snprintf(key, sizeof(key), "\"%s\":", krcore_stat_name(i));
		CT_CHECK(strstr(json, key) != NULL, "%s missing from %s", key,
			 json);
	}
	free(json);
	ct_pass();

	ct_begin("krcore_config_dump");
	json = text_export(krcore_config_dump, "krcore_config_dump");
	for (char *line = strtok(json, "\n"); line; line = strtok(NULL, "\n"))
		CT_CHECK(!strncmp(line, "KRCORE_", 7) && strchr(line, '='),
			 "line \"%s\" is not KRCORE_NAME=value", line);
	free(json);
	ct_pass();
}

/* The pointer must be code inside libkrcore.so. */
static void expect_in_krcore(const void *fn, const char *what)
{
	Dl_info info;

	CT_CHECK(fn != NULL, "%s is NULL", what);
	CT_CHECK(dladdr(fn, &info) != 0 && info.dli_fname,
		 "dladdr(%s) failed", what);
	CT_CHECK(strstr(info.dli_fname, "libkrcore") != NULL,
		 "%s = %p lives in %s, not in libkrcore", what, fn,
		 info.dli_fname);
}

static int polls;		/* our own ibv_poll_cq calls */

static void poll_exact(struct ibv_cq *cq, struct ibv_wc *wc, int n)
{
	uint64_t deadline = ct_now_ns() + CT_TIMEOUT_MS * 1000000ull;
	int got = 0;

	while (got < n) {
		int rc = ibv_poll_cq(cq, n - got, wc + got);

		polls++;
		CT_CHECK(rc >= 0, "ibv_poll_cq returned %d", rc);
		got += rc;
		if (got < n && ct_now_ns() > deadline)
			CT_FAIL("timeout: %d of %d completions", got, n);
	}
}

static void test_counters(void)
{
	struct ct_dev dev;
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq, *ev_cq;
	struct ibv_cq_ex *cqx;
	struct ibv_qp *a, *b, *c;
	struct ibv_qp_ex *qx;
	struct ibv_srq *srq;
	struct ibv_srq_init_attr sia;
	struct ibv_qp_init_attr_ex iax;
	struct ibv_cq_init_attr_ex cax;
	struct ct_buf ba, bb;
	struct ibv_wc wc[4];
	int ev_marker;

	ct_begin("counters_and_objects");
	snapshot();
	ct_open(&dev);
	EXPECT_DELTA(KRCORE_STAT_CONTEXTS_OPENED, 1);
	EXPECT_DELTA(KRCORE_STAT_PDS_ALLOCATED, 1);

	expect_in_krcore((const void *)(uintptr_t)dev.ctx->ops.post_send,
			 "ctx->ops.post_send");
	expect_in_krcore((const void *)(uintptr_t)dev.ctx->ops.post_recv,
			 "ctx->ops.post_recv");
	expect_in_krcore((const void *)(uintptr_t)dev.ctx->ops.poll_cq,
			 "ctx->ops.poll_cq");
	expect_in_krcore((const void *)(uintptr_t)dev.ctx->ops.req_notify_cq,
			 "ctx->ops.req_notify_cq");
	expect_in_krcore((const void *)(uintptr_t)dev.ctx->ops.post_srq_recv,
			 "ctx->ops.post_srq_recv");

	ct_buf_alloc(&ba, dev.pd, 65536);
	ct_buf_alloc(&bb, dev.pd, 65536);
	EXPECT_DELTA(KRCORE_STAT_MRS_REGISTERED, 2);

	ch = CT_PTR(ibv_create_comp_channel(dev.ctx));
	cq = CT_PTR(ibv_create_cq(dev.ctx, 64, NULL, NULL, 0));
	ev_cq = CT_PTR(ibv_create_cq(dev.ctx, 64, &ev_marker, ch, 0));
	memset(&cax, 0, sizeof(cax));
	cax.cqe = 64;
	cax.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM;
	cqx = CT_PTR(ibv_create_cq_ex(dev.ctx, &cax));
	EXPECT_DELTA(KRCORE_STAT_CQS_CREATED, 3);
	expect_in_krcore((const void *)(uintptr_t)cqx->start_poll,
			 "cq_ex->start_poll");

	memset(&sia, 0, sizeof(sia));
	sia.attr.max_wr = 16;
	sia.attr.max_sge = 1;
	srq = CT_PTR(ibv_create_srq(dev.pd, &sia));
	EXPECT_DELTA(KRCORE_STAT_SRQS_CREATED, 1);

	/* a: extended QP (wr_* API) on cqx; b: receives via srq; c: plain. */
	memset(&iax, 0, sizeof(iax));
	iax.qp_type = IBV_QPT_RC;
	iax.send_cq = iax.recv_cq = ibv_cq_ex_to_cq(cqx);
	iax.cap.max_send_wr = iax.cap.max_recv_wr = 16;
	iax.cap.max_send_sge = iax.cap.max_recv_sge = 1;
	iax.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	iax.pd = dev.pd;
	iax.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND;
	a = CT_PTR(ibv_create_qp_ex(dev.ctx, &iax));
	b = ct_create_rc_qp(&dev, cq, ev_cq, srq, CT_QP_CAPS_DEFAULT);
	c = ct_create_rc_qp(&dev, cq, cq, NULL, CT_QP_CAPS_DEFAULT);
	EXPECT_DELTA(KRCORE_STAT_QPS_CREATED, 3);
	qx = ibv_qp_to_qp_ex(a);
	CT_CHECK(qx != NULL, "ibv_qp_to_qp_ex returned NULL");
	expect_in_krcore((const void *)(uintptr_t)qx->wr_start,
			 "qp_ex->wr_start");
	expect_in_krcore((const void *)(uintptr_t)qx->wr_rdma_write,
			 "qp_ex->wr_rdma_write");
	ct_connect_pair(&dev, a, b);

	/* Two WRs through the wr_* API: a WRITE and a SEND into the SRQ. */
	ct_post_recv1(a, 0x1, &bb, 0, 64); /* never consumed */
	{
		struct ibv_sge s = { (uintptr_t)(bb.p + 4096), 4096, bb.mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 0x2, .sg_list = &s,
					 .num_sge = 1 }, *bad = NULL;

		CT_OK(ibv_post_srq_recv(srq, &w, &bad));
	}
	CT_OK(ibv_req_notify_cq(ev_cq, 0));
	ct_fill(ba.p, 1024, 1);
	ct_fill(ba.p + 1024, 512, 2);
	ibv_wr_start(qx);
	qx->wr_id = 0x10;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, bb.mr->rkey, (uintptr_t)(bb.p + 8192));
	ibv_wr_set_sge(qx, ba.mr->lkey, (uintptr_t)ba.p, 1024);
	qx->wr_id = 0x11;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, ba.mr->lkey, (uintptr_t)(ba.p + 1024), 512);
	CT_OK(ibv_wr_complete(qx));
	EXPECT_DELTA_MIN(KRCORE_STAT_WR_CALLS, 2);

	{
		struct ct_wcx w[2];
		uint64_t before = delta(KRCORE_STAT_POLL_CQ);

		ct_poll_ex_n(cqx, cax.wc_flags, w, 2, CT_TIMEOUT_MS);
		CT_CHECK(w[0].wr_id == 0x10 && w[0].status == IBV_WC_SUCCESS &&
				 w[1].wr_id == 0x11 &&
				 w[1].status == IBV_WC_SUCCESS,
			 "wr completions 0x%" PRIx64 "/%d 0x%" PRIx64 "/%d",
			 w[0].wr_id, w[0].status, w[1].wr_id, w[1].status);
		CT_CHECK(delta(KRCORE_STAT_POLL_CQ) > before,
			 "ibv_start_poll not counted in poll_cq");
	}
	ct_expect_pattern(bb.p + 8192, 1024, 1, "written data");

	/* The event for the SRQ receive on ev_cq. */
	ct_cq_event(ch, ev_cq, &ev_marker, "the SRQ receive's event");
	polls = 0;
	uint64_t poll_base = krcore_stat_get(KRCORE_STAT_POLL_CQ);
	poll_exact(ev_cq, wc, 1);
	ct_expect_wc(&wc[0], 0x2, IBV_WC_RECV, "srq receive");
	CT_CHECK(wc[0].qp_num == b->qp_num, "qp_num %u", wc[0].qp_num);
	ct_expect_pattern(bb.p + 4096, 512, 2, "sent data");
	CT_CHECK(krcore_stat_get(KRCORE_STAT_POLL_CQ) - poll_base ==
			 (uint64_t)polls,
		 "poll_cq moved by %" PRIu64 " for %d ibv_poll_cq calls",
		 krcore_stat_get(KRCORE_STAT_POLL_CQ) - poll_base, polls);

	/* A classic post_send (counted) and a refused one (an error). */
	CT_OK(ct_post_send1(b, 0x20, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED, &bb,
			    0, 128, (uintptr_t)(ba.p + 8192), ba.mr->rkey, 0));
	poll_exact(cq, wc, 1);
	ct_expect_wc(&wc[0], 0x20, IBV_WC_RDMA_WRITE, "classic write");
	{
		struct ibv_sge s[64];
		struct ibv_send_wr w, *bad = NULL;

		memset(&w, 0, sizeof(w));
		for (int i = 0; i < 64; i++) {
			s[i].addr = (uintptr_t)bb.p;
			s[i].length = 8;
			s[i].lkey = bb.mr->lkey;
		}
		w.wr_id = 0x21;
		w.sg_list = s;
		w.num_sge = 64;
		w.opcode = IBV_WR_RDMA_WRITE;
		w.wr.rdma.remote_addr = (uintptr_t)ba.p;
		w.wr.rdma.rkey = ba.mr->rkey;
		CT_CHECK(ibv_post_send(b, &w, &bad) != 0 && bad == &w,
			 "64 SGEs accepted");
	}
	EXPECT_DELTA(KRCORE_STAT_POST_SEND, 2);
	EXPECT_DELTA(KRCORE_STAT_POST_RECV, 1);
	EXPECT_DELTA(KRCORE_STAT_POST_SRQ_RECV, 1);
	EXPECT_DELTA(KRCORE_STAT_REQ_NOTIFY_CQ, 1);
	EXPECT_DELTA(KRCORE_STAT_CQ_EVENTS, 1);
	EXPECT_DELTA(KRCORE_STAT_POST_ERRORS, 1);
	EXPECT_DELTA(KRCORE_STAT_ASYNC_EVENTS, 0);
	EXPECT_DELTA(KRCORE_STAT_AHS_CREATED, 0);
	EXPECT_DELTA(KRCORE_STAT_MWS_ALLOCATED, 0);

	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	CT_OK(ibv_destroy_qp(c));
	CT_OK(ibv_destroy_srq(srq));
	CT_OK(ibv_destroy_cq(cq));
	CT_OK(ibv_destroy_cq(ev_cq));
	CT_OK(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)));
	CT_OK(ibv_destroy_comp_channel(ch));
	ct_buf_free(&ba);
	ct_buf_free(&bb);
	ct_close(&dev);
	/* Destruction is not creation. */
	EXPECT_DELTA(KRCORE_STAT_CONTEXTS_OPENED, 1);
	EXPECT_DELTA(KRCORE_STAT_QPS_CREATED, 3);
	ct_pass();
}

int main(void)
{
	test_version();
	test_names();
	test_json();
	test_counters();
	return 0;
}
