/* Shared setup for the krcore C tests: see common.h. */
#define _GNU_SOURCE
#include "common.h"

#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- reporting ------------------------------------------------------ */

static const char *cur_name = "setup";
static unsigned watchdog_secs = 120;

void ct_begin(const char *name)
{
	cur_name = name;
	/* Every sub-test gets the full watchdog budget. */
	ct_watchdog(watchdog_secs);
}

const char *ct_current(void)
{
	return cur_name;
}

void ct_pass(void)
{
	printf("PASS %s\n", cur_name);
	fflush(stdout);
}

void ct_fail_at(const char *file, int line, const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	printf("FAIL %s: ", cur_name);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf(" [%s:%d]\n", file, line);
	fflush(stdout);
	exit(1);
}

void ct_note(const char *fmt, ...)
{
	va_list ap;

	printf("NOTE %s: ", cur_name);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
}

static void watchdog_fired(int sig)
{
	char msg[256];
	int n;

	(void)sig;
	n = snprintf(msg, sizeof(msg),
		     "FAIL %s: watchdog: no progress for %u s (a blocking verbs "
		     "call hung)\n", cur_name, watchdog_secs);
	if (n > 0)
		(void)!write(STDOUT_FILENO, msg, (size_t)n);
	_exit(1);
}

void ct_watchdog(unsigned seconds)
{
	static int installed;

	if (!installed) {
		struct sigaction sa;

		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = watchdog_fired;
		sigemptyset(&sa.sa_mask);
		sigaction(SIGALRM, &sa, NULL);
		installed = 1;
	}
	alarm(seconds);
}

static int env_int(const char *name, int def)
{
	const char *v = getenv(name);

	return v && *v ? atoi(v) : def;
}

/* ---- device --------------------------------------------------------- */

void ct_open(struct ct_dev *d)
{
	const char *want = getenv("CT_DEVICE");
	struct ibv_device **list;
	int n, i;

	setvbuf(stdout, NULL, _IOLBF, 0);
	watchdog_secs = (unsigned)env_int("CT_WATCHDOG", 120);
	ct_watchdog(watchdog_secs);

	if (!want || !*want)
		want = "rxe0";
	memset(d, 0, sizeof(*d));
	d->port = (uint8_t)env_int("CT_PORT", 1);
	d->gid_idx[0] = env_int("CT_GID_A", 1);
	d->gid_idx[1] = env_int("CT_GID_B", 2);

	list = ibv_get_device_list(&n);
	if (!list)
		CT_FAIL("ibv_get_device_list: %s", strerror(errno));
	for (i = 0; i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), want))
			break;
	if (i == n) {
		ibv_free_device_list(list);
		CT_FAIL("no RDMA device named %s (%d devices; run "
			"scripts/rxe-up.sh 2 first)", want, n);
	}
	d->ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!d->ctx)
		CT_FAIL("ibv_open_device(%s): %s", want, strerror(errno));

	CT_OK(ibv_query_device(d->ctx, &d->dev_attr));
	CT_OK(ibv_query_port(d->ctx, d->port, &d->port_attr));
	CT_CHECK(d->port_attr.state == IBV_PORT_ACTIVE, "port %u state %d",
		 d->port, d->port_attr.state);
	for (i = 0; i < 2; i++) {
		static const union ibv_gid zero;

		CT_OK(ibv_query_gid(d->ctx, d->port, d->gid_idx[i], &d->gid[i]));
		CT_CHECK(memcmp(&d->gid[i], &zero, sizeof(zero)) != 0,
			 "GID index %d is empty", d->gid_idx[i]);
	}
	d->pd = CT_PTR(ibv_alloc_pd(d->ctx));
}

void ct_close(struct ct_dev *d)
{
	CT_OK(ibv_dealloc_pd(d->pd));
	CT_OK(ibv_close_device(d->ctx));
	d->pd = NULL;
	d->ctx = NULL;
}

/* ---- QPs ------------------------------------------------------------ */

struct ibv_qp *ct_create_rc_qp(struct ct_dev *d, struct ibv_cq *scq,
			       struct ibv_cq *rcq, struct ibv_srq *srq,
			       struct ct_qp_caps caps)
{
	struct ibv_qp_init_attr ia;
	struct ibv_qp *qp;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = scq;
	ia.recv_cq = rcq;
	ia.srq = srq;
	ia.qp_type = IBV_QPT_RC;
	ia.sq_sig_all = caps.sq_sig_all;
	ia.cap.max_send_wr = caps.max_send_wr;
	ia.cap.max_recv_wr = srq ? 0 : caps.max_recv_wr;
	ia.cap.max_send_sge = caps.max_send_sge;
	ia.cap.max_recv_sge = srq ? 0 : caps.max_recv_sge;
	ia.cap.max_inline_data = caps.max_inline;
	qp = CT_PTR(ibv_create_qp(d->pd, &ia));
	CT_CHECK(qp->qp_type == IBV_QPT_RC, "qp_type %d", qp->qp_type);
	CT_CHECK(qp->pd == d->pd, "qp->pd %p != pd %p", (void *)qp->pd,
		 (void *)d->pd);
	CT_CHECK(qp->context == d->ctx, "qp->context %p != ctx %p",
		 (void *)qp->context, (void *)d->ctx);
	CT_CHECK(qp->send_cq == scq && qp->recv_cq == rcq,
		 "qp CQ pointers not the ones passed in");
	return qp;
}

static uint32_t psn_of(uint32_t qpn)
{
	return (qpn * 2654435761u) & 0xffffff;
}

static uint8_t rd_atom(const struct ct_dev *d)
{
	return d->dev_attr.max_qp_rd_atom < 16 ? (uint8_t)d->dev_attr.max_qp_rd_atom : 16;
}

int ct_qp_init(struct ct_dev *d, struct ibv_qp *qp)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = d->port;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
			    IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				     IBV_QP_ACCESS_FLAGS);
}

int ct_qp_rtr(struct ct_dev *d, struct ibv_qp *qp, int sgid_idx,
	      uint32_t dqpn, const union ibv_gid *dgid)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = d->port_attr.active_mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = psn_of(dqpn);
	a.max_dest_rd_atomic = rd_atom(d);
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *dgid;
	a.ah_attr.grh.sgid_index = (uint8_t)sgid_idx;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.dlid = 0;
	a.ah_attr.sl = 0;
	a.ah_attr.src_path_bits = 0;
	a.ah_attr.port_num = d->port;
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
				     IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				     IBV_QP_MAX_DEST_RD_ATOMIC |
				     IBV_QP_MIN_RNR_TIMER);
}

int ct_qp_rts(struct ct_dev *d, struct ibv_qp *qp)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = psn_of(qp->qp_num);
	a.max_rd_atomic = rd_atom(d);
	return ibv_modify_qp(qp, &a,
			     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				     IBV_QP_MAX_QP_RD_ATOMIC);
}

int ct_connect_qp(struct ct_dev *d, struct ibv_qp *qp, int sgid_idx,
		  uint32_t dqpn, const union ibv_gid *dgid)
{
	int rc = ct_qp_init(d, qp);

	if (!rc)
		rc = ct_qp_rtr(d, qp, sgid_idx, dqpn, dgid);
	if (!rc)
		rc = ct_qp_rts(d, qp);
	return rc;
}

void ct_connect_pair(struct ct_dev *d, struct ibv_qp *a, struct ibv_qp *b)
{
	CT_OK(ct_connect_qp(d, a, d->gid_idx[0], b->qp_num, &d->gid[1]));
	CT_OK(ct_connect_qp(d, b, d->gid_idx[1], a->qp_num, &d->gid[0]));
	CT_CHECK(ct_qp_state(a) == IBV_QPS_RTS, "QP A not in RTS");
	CT_CHECK(ct_qp_state(b) == IBV_QPS_RTS, "QP B not in RTS");
}

void ct_qp_to_err(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_ERR;
	CT_OK(ibv_modify_qp(qp, &a, IBV_QP_STATE));
}

enum ibv_qp_state ct_qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;

	memset(&a, 0, sizeof(a));
	CT_OK(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia));
	return a.qp_state;
}

/* ---- memory --------------------------------------------------------- */

void ct_buf_alloc(struct ct_buf *b, struct ibv_pd *pd, size_t len)
{
	size_t pg = (size_t)sysconf(_SC_PAGESIZE);
	size_t alloc = (len + pg - 1) / pg * pg;

	b->p = aligned_alloc(pg, alloc);
	CT_CHECK(b->p != NULL, "aligned_alloc(%zu)", alloc);
	memset(b->p, 0, alloc);
	b->len = len;
	b->mr = CT_PTR(ibv_reg_mr(pd, b->p, len, CT_ACCESS_ALL));
	CT_CHECK(b->mr->addr == b->p && b->mr->length == len,
		 "MR addr/length %p/%zu, expected %p/%zu", b->mr->addr,
		 b->mr->length, (void *)b->p, len);
	CT_CHECK(b->mr->pd == pd, "mr->pd mismatch");
}

void ct_buf_free(struct ct_buf *b)
{
	CT_OK(ibv_dereg_mr(b->mr));
	free(b->p);
	memset(b, 0, sizeof(*b));
}

static uint8_t pat(uint32_t seed, size_t i)
{
	uint32_t x = seed * 0x9e3779b1u + (uint32_t)i * 0x85ebca6bu;

	x ^= x >> 13;
	x *= 0xc2b2ae35u;
	x ^= x >> 16;
	return (uint8_t)x;
}

void ct_fill(void *p, size_t len, uint32_t seed)
{
	uint8_t *q = p;

	for (size_t i = 0; i < len; i++)
		q[i] = pat(seed, i);
}

void ct_expect_bytes(const void *got, const void *want, size_t len,
		     const char *what)
{
	const uint8_t *g = got, *w = want;

	for (size_t i = 0; i < len; i++)
		if (g[i] != w[i])
			CT_FAIL("%s: byte %zu of %zu is 0x%02x, expected 0x%02x",
				what, i, len, g[i], w[i]);
}

void ct_expect_pattern(const void *p, size_t len, uint32_t seed,
		       const char *what)
{
	const uint8_t *g = p;

	for (size_t i = 0; i < len; i++)
		if (g[i] != pat(seed, i))
			CT_FAIL("%s: byte %zu of %zu is 0x%02x, expected 0x%02x",
				what, i, len, g[i], pat(seed, i));
}

void ct_expect_zero(const void *p, size_t len, const char *what)
{
	const uint8_t *g = p;

	for (size_t i = 0; i < len; i++)
		if (g[i])
			CT_FAIL("%s: byte %zu of %zu is 0x%02x, expected 0",
				what, i, len, g[i]);
}

/* ---- classic posting ------------------------------------------------ */

int ct_post_send1(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op,
		  unsigned flags, const struct ct_buf *lb, size_t loff,
		  uint32_t len, uint64_t raddr, uint32_t rkey, uint32_t imm)
{
	struct ibv_sge sge;
	struct ibv_send_wr wr, *bad = NULL;
	int rc;

	memset(&wr, 0, sizeof(wr));
	if (len) {
		sge.addr = (uintptr_t)(lb->p + loff);
		sge.length = len;
		sge.lkey = lb->mr->lkey;
		wr.sg_list = &sge;
		wr.num_sge = 1;
	}
	wr.wr_id = wr_id;
	wr.opcode = op;
	wr.send_flags = flags;
	wr.imm_data = htobe32(imm);
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	rc = ibv_post_send(qp, &wr, &bad);
	if (rc && bad != &wr)
		CT_FAIL("ibv_post_send returned %d but *bad_wr=%p, not the "
			"only WR %p", rc, (void *)bad, (void *)&wr);
	return rc;
}

int ct_post_atomic(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op,
		   const struct ct_buf *lb, size_t loff, uint64_t raddr,
		   uint32_t rkey, uint64_t cmp_add, uint64_t swap)
{
	struct ibv_sge sge;
	struct ibv_send_wr wr, *bad = NULL;
	int rc;

	memset(&wr, 0, sizeof(wr));
	sge.addr = (uintptr_t)(lb->p + loff);
	sge.length = 8;
	sge.lkey = lb->mr->lkey;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.wr_id = wr_id;
	wr.opcode = op;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.atomic.remote_addr = raddr;
	wr.wr.atomic.rkey = rkey;
	wr.wr.atomic.compare_add = cmp_add;
	wr.wr.atomic.swap = swap;
	rc = ibv_post_send(qp, &wr, &bad);
	if (rc && bad != &wr)
		CT_FAIL("ibv_post_send returned %d but *bad_wr=%p, not the "
			"only WR %p", rc, (void *)bad, (void *)&wr);
	return rc;
}

void ct_post_recv1(struct ibv_qp *qp, uint64_t wr_id, const struct ct_buf *b,
		   size_t off, uint32_t len)
{
	struct ibv_sge sge;
	struct ibv_recv_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof(wr));
	if (len) {
		sge.addr = (uintptr_t)(b->p + off);
		sge.length = len;
		sge.lkey = b->mr->lkey;
		wr.sg_list = &sge;
		wr.num_sge = 1;
	}
	wr.wr_id = wr_id;
	CT_OK(ibv_post_recv(qp, &wr, &bad));
}

/* ---- completions ---------------------------------------------------- */

uint64_t ct_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Busy-polls for a while, then backs off so rxe's kernel work can run. */
static void poll_backoff(unsigned *spins)
{
	if (++*spins > 2000)
		usleep(50);
}

void ct_poll_n(struct ibv_cq *cq, struct ibv_wc *wc, int n, int timeout_ms)
{
	uint64_t deadline = ct_now_ns() + (uint64_t)timeout_ms * 1000000ull;
	unsigned spins = 0;
	int got = 0;

	while (got < n) {
		int rc = ibv_poll_cq(cq, n - got, wc + got);

		if (rc < 0)
			CT_FAIL("ibv_poll_cq returned %d", rc);
		got += rc;
		if (got >= n)
			break;
		if (ct_now_ns() > deadline)
			CT_FAIL("timeout after %d ms: %d of %d completions",
				timeout_ms, got, n);
		if (!rc)
			poll_backoff(&spins);
	}
}

struct ibv_wc ct_poll1(struct ibv_cq *cq)
{
	struct ibv_wc wc;

	memset(&wc, 0, sizeof(wc));
	ct_poll_n(cq, &wc, 1, CT_TIMEOUT_MS);
	return wc;
}

void ct_expect_quiet(struct ibv_cq *cq, int ms, const char *what)
{
	uint64_t deadline = ct_now_ns() + (uint64_t)ms * 1000000ull;
	struct ibv_wc wc;

	while (ct_now_ns() < deadline) {
		int rc = ibv_poll_cq(cq, 1, &wc);

		if (rc < 0)
			CT_FAIL("ibv_poll_cq returned %d", rc);
		if (rc)
			CT_FAIL("%s: unexpected completion wr_id=%" PRIu64
				" status=%s opcode=%s", what, wc.wr_id,
				ibv_wc_status_str(wc.status),
				ct_wc_opcode_str(wc.opcode));
		usleep(1000);
	}
}

void ct_cq_event(struct ibv_comp_channel *ch, struct ibv_cq *cq, void *ctx, const char *what)
{
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;

	CT_CHECK(poll(&pfd, 1, CT_TIMEOUT_MS) == 1, "%s: no completion event within %d ms", what, CT_TIMEOUT_MS);
	CT_OK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx));
	CT_CHECK(ev_cq == cq, "%s: the event of CQ %p, not %p", what, (void *)ev_cq, (void *)cq);
	CT_CHECK(!ctx || ev_ctx == ctx, "%s: cq_context %p, expected %p", what, ev_ctx, ctx);
	ibv_ack_cq_events(cq, 1);
}

void ct_expect_wc(const struct ibv_wc *wc, uint64_t wr_id,
		  enum ibv_wc_opcode opcode, const char *what)
{
	if (wc->status != IBV_WC_SUCCESS)
		CT_FAIL("%s: wr_id=%" PRIu64 " status %s (%d), vendor_err "
			"0x%x", what, wc->wr_id, ibv_wc_status_str(wc->status),
			wc->status, wc->vendor_err);
	if (wc->wr_id != wr_id)
		CT_FAIL("%s: wr_id %" PRIu64 ", expected %" PRIu64, what,
			wc->wr_id, wr_id);
	if (wc->opcode != opcode)
		CT_FAIL("%s: opcode %s (%d), expected %s (%d)", what,
			ct_wc_opcode_str(wc->opcode), wc->opcode,
			ct_wc_opcode_str(opcode), opcode);
}

static void read_ex(struct ibv_cq_ex *cq, uint64_t flags, struct ct_wcx *o)
{
	memset(o, 0, sizeof(*o));
	o->wr_id = cq->wr_id;
	o->status = cq->status;
	o->opcode = ibv_wc_read_opcode(cq);
	o->wc_flags = ibv_wc_read_wc_flags(cq);
	if (flags & IBV_WC_EX_WITH_BYTE_LEN)
		o->byte_len = ibv_wc_read_byte_len(cq);
	if ((flags & IBV_WC_EX_WITH_IMM) && (o->wc_flags & IBV_WC_WITH_IMM))
		o->imm_data = ibv_wc_read_imm_data(cq);
	if (flags & IBV_WC_EX_WITH_QP_NUM)
		o->qp_num = ibv_wc_read_qp_num(cq);
}

void ct_poll_ex_n(struct ibv_cq_ex *cq, uint64_t cq_wc_flags,
		  struct ct_wcx *out, int n, int timeout_ms)
{
	uint64_t deadline = ct_now_ns() + (uint64_t)timeout_ms * 1000000ull;
	unsigned spins = 0;
	int got = 0;

	while (got < n) {
		struct ibv_poll_cq_attr attr = { .comp_mask = 0 };
		int rc = ibv_start_poll(cq, &attr);

		if (rc == ENOENT) {
			if (ct_now_ns() > deadline)
				CT_FAIL("timeout after %d ms: %d of %d "
					"completions (ibv_start_poll)",
					timeout_ms, got, n);
			poll_backoff(&spins);
			continue;
		}
		if (rc)
			CT_FAIL("ibv_start_poll returned %d (%s)", rc,
				strerror(rc));
		read_ex(cq, cq_wc_flags, &out[got++]);
		while (got < n) {
			rc = ibv_next_poll(cq);
			if (rc == ENOENT)
				break;
			if (rc) {
				ibv_end_poll(cq);
				CT_FAIL("ibv_next_poll returned %d (%s)", rc,
					strerror(rc));
			}
			read_ex(cq, cq_wc_flags, &out[got++]);
		}
		ibv_end_poll(cq);
	}
}

void ct_expect_quiet_ex(struct ibv_cq_ex *cq, int ms, const char *what)
{
	uint64_t deadline = ct_now_ns() + (uint64_t)ms * 1000000ull;

	while (ct_now_ns() < deadline) {
		struct ibv_poll_cq_attr attr = { .comp_mask = 0 };
		int rc = ibv_start_poll(cq, &attr);

		if (rc == 0) {
			uint64_t wr_id = cq->wr_id;
			enum ibv_wc_status st = cq->status;

			ibv_end_poll(cq);
			CT_FAIL("%s: unexpected completion wr_id=%" PRIu64
				" status=%s", what, wr_id,
				ibv_wc_status_str(st));
		}
		if (rc != ENOENT)
			CT_FAIL("ibv_start_poll returned %d (%s)", rc,
				strerror(rc));
		usleep(1000);
	}
}

const char *ct_wc_opcode_str(enum ibv_wc_opcode op)
{
	switch (op) {
	case IBV_WC_SEND: return "SEND";
	case IBV_WC_RDMA_WRITE: return "RDMA_WRITE";
	case IBV_WC_RDMA_READ: return "RDMA_READ";
	case IBV_WC_COMP_SWAP: return "COMP_SWAP";
	case IBV_WC_FETCH_ADD: return "FETCH_ADD";
	case IBV_WC_BIND_MW: return "BIND_MW";
	case IBV_WC_LOCAL_INV: return "LOCAL_INV";
	case IBV_WC_TSO: return "TSO";
	case IBV_WC_RECV: return "RECV";
	case IBV_WC_RECV_RDMA_WITH_IMM: return "RECV_RDMA_WITH_IMM";
	default: return "?";
	}
}

/* ---- virtual-QP tests: krcore-meta and emulated nodes ------------------ */

#ifdef HAVE_KRCORE
union ibv_gid ct_node_gid(int node)
{
	union ibv_gid g;

	memset(&g, 0, sizeof(g));
	g.raw[10] = g.raw[11] = 0xff;
	g.raw[12] = 10;
	g.raw[13] = 77;
	g.raw[14] = 0;
	g.raw[15] = (uint8_t)node;
	return g;
}

pid_t ct_start_meta(void)
{
	return ct_start_meta_slots(4096);
}

pid_t ct_start_meta_slots(unsigned slots)
{
	static char addr[64];
	pid_t pid;

	snprintf(addr, sizeof(addr), "10.77.0.1:%d", 20000 + getpid() % 20000);
	pid = ct_start_meta_at(addr, slots);
	setenv("KRCORE_META", addr, 1);
	return pid;
}

const char *ct_release_bin(const char *env, const char *name, char *buf, size_t len)
{
	const char *bin = getenv(env);
	ssize_t k;

	if (bin)
		return bin;
	k = readlink("/proc/self/exe", buf, len - 64);
	CT_CHECK(k > 0, "readlink");
	buf[k] = 0;
	*strrchr(buf, '/') = 0;	/* target/c-tests */
	snprintf(buf + strlen(buf), len - strlen(buf), "/../release/%s", name);
	return buf;
}

pid_t ct_spawn_ready(char *const argv[], const char *expect, int *out)
{
	return ct_spawn_ready_line(argv, expect, out, NULL, 0);
}

pid_t ct_spawn_piped(char *const argv[], int *out)
{
	pid_t pid;
	int p[2];

	CT_CHECK(pipe(p) == 0, "pipe");
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		dup2(p[1], 1);
		close(p[0]);
		execv(argv[0], argv);
		_exit(127);
	}
	close(p[1]);
	*out = p[0];
	return pid;
}

pid_t ct_spawn_ready_line(char *const argv[], const char *expect, int *out, char *first, size_t len)
{
	char line[1024];
	size_t used = 0;
	struct pollfd pfd;
	pid_t pid;
	int fd;

	pid = ct_spawn_piped(argv, &fd);
	pfd.fd = fd;
	pfd.events = POLLIN;
	while (!memchr(line, '\n', used)) {
		ssize_t k;

		CT_CHECK(poll(&pfd, 1, 30000) == 1, "%s did not start", argv[0]);
		k = read(fd, line + used, sizeof(line) - 1 - used);
		CT_CHECK(k > 0, "%s exited", argv[0]);
		used += (size_t)k;
	}
	line[used] = 0;
	CT_CHECK(strstr(line, expect) != NULL, "%s said: %s", argv[0], line);
	if (first)
		snprintf(first, len, "%s", line);
	*out = fd;
	return pid;
}

const char *ct_agent_stats_line(pid_t agent, int out, char *buf, size_t len)
{
	size_t used = 0;
	struct pollfd pfd = { .fd = out, .events = POLLIN };
	const char *l;

	CT_CHECK(kill(agent, SIGUSR1) == 0, "SIGUSR1 to the agent");
	for (;;) {
		ssize_t k;

		CT_CHECK(used < len - 1, "the agent's output: no statistics line in %zu bytes", used);
		CT_CHECK(poll(&pfd, 1, 10000) == 1, "no statistics line from the agent within 10 s");
		k = read(out, buf + used, len - 1 - used);
		CT_CHECK(k > 0, "the agent's stdout closed");
		used += (size_t)k;
		buf[used] = 0;
		l = strstr(buf, "stats attached=");
		if (l && strchr(l, '\n'))
			return l;
	}
}

long ct_agent_stat(pid_t agent, int out, const char *field)
{
	char buf[4096], key[64];
	const char *l = ct_agent_stats_line(agent, out, buf, sizeof(buf)), *f;
	long v = 0;
	int n;

	snprintf(key, sizeof(key), " %s: ", field);
	f = strstr(l, key);
	n = f ? sscanf(f + strlen(key), "%ld", &v) : 0;
	CT_CHECK(n == 1, "no %s in the agent's statistics: %s", field, l);
	return v;
}

pid_t ct_start_meta_at(const char *addr, unsigned slots)
{
	char nslots[16];
	static char path[4096];
	char *argv[] = { (char *)ct_release_bin("KRCORE_META_BIN", "krcore-meta", path, sizeof(path)), "--listen",
			 (char *)addr, "--slots", nslots, NULL };
	int out;

	snprintf(nslots, sizeof(nslots), "%u", slots);
	/* `out` stays open: a later line must not kill it with SIGPIPE. */
	return ct_spawn_ready(argv, "serving on", &out);
}

struct ibv_qp *ct_create_vqp(struct ct_dev *d, struct ibv_cq *scq, struct ibv_cq *rcq,
			     struct ct_qp_caps caps, struct ibv_qp_cap *granted)
{
	struct ibv_qp_init_attr a;
	struct ibv_qp *qp;

	memset(&a, 0, sizeof(a));
	a.send_cq = scq;
	a.recv_cq = rcq;
	a.qp_type = (enum ibv_qp_type)KRCORE_VQP;
	a.sq_sig_all = caps.sq_sig_all;
	a.cap.max_send_wr = caps.max_send_wr;
	a.cap.max_recv_wr = caps.max_recv_wr;
	a.cap.max_send_sge = caps.max_send_sge;
	a.cap.max_recv_sge = caps.max_recv_sge;
	a.cap.max_inline_data = caps.max_inline;
	qp = CT_PTR(ibv_create_qp(d->pd, &a));
	CT_CHECK(qp->qp_type == (enum ibv_qp_type)KRCORE_VQP, "qp_type");
	if (granted)
		*granted = a.cap;
	return qp;
}

void ct_node_open(struct ct_node *n, int node, size_t len, int cqe)
{
	char idx[16];

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	ct_open(&n->d);
	n->scq = CT_PTR(ibv_create_cq(n->d.ctx, cqe, NULL, NULL, 0));
	n->rcq = CT_PTR(ibv_create_cq(n->d.ctx, cqe, NULL, NULL, 0));
	ct_buf_alloc(&n->b, n->d.pd, (len + 4095) & ~(size_t)4095);
}

struct ibv_qp *ct_node_vqp(struct ct_node *n, uint32_t sq, uint32_t rq)
{
	return ct_create_vqp(&n->d, n->scq, n->rcq, (struct ct_qp_caps){ sq, rq, 1, 1, 0, 0 }, NULL);
}

void ct_fill_msg(uint8_t *p, size_t len, uint32_t id, uint32_t seq)
{
	ct_fill(p, len, id * 1000003u + seq);
	memcpy(p, &id, 4);
	memcpy(p + 4, &seq, 4);
}

void ct_expect_msg(const uint8_t *p, size_t len, uint32_t id, uint32_t seq)
{
	uint8_t want[4096];

	CT_CHECK(len <= sizeof(want), "message of %zu bytes", len);
	ct_fill_msg(want, len, id, seq);
	ct_expect_bytes(p, want, len, "message bytes");
}

pid_t ct_fork_ready(int (*role)(int ready_fd), const char *what)
{
	int ready[2];
	pid_t pid;
	char c;

	CT_CHECK(pipe(ready) == 0, "pipe");
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		close(ready[0]);
		_exit(role(ready[1]));
	}
	close(ready[1]);
	CT_CHECK(read(ready[0], &c, 1) == 1, "%s did not become ready", what);
	close(ready[0]);
	return pid;
}

int ct_echo_target_server(const char *name, int node, int port, uint32_t seed, int info_fd, int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *q;
	uint64_t tgt[2];

	ct_begin(name);
	ct_node_open(&n, node, 4096, 64);
	ct_fill(n.b.p + CT_ECHO_TARGET, 64, seed);
	q = ct_node_vqp(&n, 16, 16);
	for (int i = 0; i < 8; i++)
		ct_post_recv1(q, (uint64_t)i, &n.b, (size_t)i * CT_ECHO_MSG, CT_ECHO_MSG);
	CT_OK(qbind(q, ct_node_gid(node), port));
	tgt[0] = (uint64_t)(uintptr_t)(n.b.p + CT_ECHO_TARGET);
	tgt[1] = n.b.mr->rkey;
	ct_oob_write(info_fd, tgt, sizeof(tgt));
	CT_CHECK(write(ready_fd, "r", 1) == 1, "ready");
	for (;;) {
		struct ibv_qp *src[8];
		struct ibv_wc wc[8];
		int k = qpop_msgs(q, 8, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			uint64_t buf = wc[i].wr_id;
			struct ibv_wc s;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR)
				continue; /* a client went */
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "receive status %d", wc[i].status);
			CT_OK(ct_post_send1(src[i], buf, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b,
					    buf * CT_ECHO_MSG, wc[i].byte_len, 0, 0, 0));
			s = ct_poll1(n.scq);
			CT_CHECK(s.status == IBV_WC_SUCCESS, "echo status %d", s.status);
			ct_post_recv1(q, buf, &n.b, buf * CT_ECHO_MSG, CT_ECHO_MSG);
		}
		if (k == 0)
			usleep(200);
	}
	return 0;
}

int ct_run_child(int (*f)(void), const char *what)
{
	pid_t pid = fork();

	CT_CHECK(pid >= 0, "fork");
	if (pid == 0)
		_exit(f());
	return ct_wait_child(pid, what);
}

void ct_wait_stopped(pid_t pid)
{
	uint64_t t0 = ct_now_ns();
	char dir[64];

	snprintf(dir, sizeof(dir), "/proc/%d/task", (int)pid);
	for (;;) {
		DIR *d = opendir(dir);
		struct dirent *e;
		int running = 0;

		CT_CHECK(d != NULL, "%s", dir);
		while ((e = readdir(d))) {
			char path[384], buf[256], *p;
			FILE *f;

			if (e->d_name[0] == '.')
				continue;
			snprintf(path, sizeof(path), "%s/%s/stat", dir, e->d_name);
			f = fopen(path, "r");
			if (!f)
				continue; /* a thread that just ended */
			p = fgets(buf, sizeof(buf), f) ? strrchr(buf, ')') : NULL;
			fclose(f);
			if (p && p[1] == ' ' && p[2] != 't' && p[2] != 'T')
				running = 1;
		}
		closedir(d);
		if (!running)
			return;
		CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "process %d not stopped", (int)pid);
		usleep(1000);
	}
}

int ct_wait_child(pid_t pid, const char *what)
{
	int st;

	CT_CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
		fprintf(stderr, "%s failed (status %#x)\n", what, st);
		return 1;
	}
	return 0;
}
#endif

/* ---- out of band ----------------------------------------------------- */

void ct_oob_write(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;

	while (n) {
		ssize_t k = write(fd, b, n);

		CT_CHECK(k > 0, "out-of-band write: %s", strerror(errno));
		b += k;
		n -= (size_t)k;
	}
}

void ct_oob_read(int fd, void *p, size_t n)
{
	uint8_t *b = p;

	while (n) {
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		ssize_t k;

		CT_CHECK(poll(&pfd, 1, CT_OOB_MS) == 1, "out-of-band read: nothing within %d ms", CT_OOB_MS);
		k = read(fd, b, n);
		CT_CHECK(k > 0, "out-of-band read: %s", k ? strerror(errno) : "peer gone");
		b += k;
		n -= (size_t)k;
	}
}
