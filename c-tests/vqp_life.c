/*
 * Virtual QPs coming and going, several processes on several emulated
 * nodes, krcore-meta started here on node 1. A server bound with qbind on
 * node 1 answers commands (the first byte of a message) through the
 * src_qp qpop_msgs gives: 'E' echo, 'M' the address and rkey of its
 * "lease" MR, 'D' deregister that MR, 'R' its resident memory and live
 * VQPs, 'Q' finish.
 *
 * Client A (node 2):
 * 1. "src_qp reclaim": CT_CHURN (default 10,000) short-lived VQPs in turn,
 *    each created, connected (qconnect over the live link), echoing one
 *    64-byte message and destroyed. The server reports each sender's
 *    src_qp once more with IBV_WC_WR_FLUSH_ERR after its last message, and
 *    frees it: its live VQPs stay at a handful, the heap it has in use
 *    after the churn is what it was after the first 1,000 (within 16 KiB)
 *    and its RSS within 8 MiB.
 * 2. "large burst": 48 messages of 128 KiB posted at once (the server has
 *    32 receives posted: the rest wait at the server, then are READ),
 *    through a 1 MiB staging (KRCORE_STAGING_BYTES: most need a
 *    registration of their own), echoed back; every byte checked, in
 *    order.
 * 3. "receive too small": a 300 KiB message into the server's 256 KiB
 *    buffers: LOC_LEN_ERR at the server, REM_INV_REQ_ERR at the sender,
 *    whose next send is flushed (its VQP is in error, as RC's).
 * 4. "messages while the server does not poll": the server stops polling
 *    (blocked on a pipe) and the client sends IDLE_MSGS small messages,
 *    more than the library's 256 shared receive buffers: every send
 *    completes (the library moves messages off its buffers in the
 *    background; without that the sender stalls in RNR retries), and the
 *    server, polling again, gets all of them.
 * 5. "MR lease": the server deregisters an MR the client READs
 *    (KRCORE_MR_LEASE_MS=500): ibv_dereg_mr returns at once, the client's
 *    READs keep succeeding (the real MR lives out the lease) until the
 *    client's cached check expires and a post is refused with EINVAL; the
 *    shared link never sees an access error; the server's delayed
 *    deregistration is done by the end.
 *
 * Client C (node 3), "binding expiry":
 * 6. a process bound at (node 4, port) is killed with SIGKILL: the binding
 *    is gone within the lease (KRCORE_META_LEASE_MS=1500; the meta server
 *    sees the TCP connection close), and C binds the address itself;
 * 7. a process bound at (node 5, port) is stopped (SIGSTOP: its lease
 *    renewals stop, its TCP connection stays): within
 *    KRCORE_CONNECT_TIMEOUT_MS (250 in C) plus a margin, a qconnect to it
 *    fails with ETIMEDOUT (KRCORE_DGRAM=0: the handshake), or returns at
 *    once and a SEND on it completes with IBV_WC_RETRY_EXC_ERR (the
 *    datagram tier: no handshake; waited for while its binding stays,
 *    so within the lease plus that timeout); on the tier, a second VQP connected
 *    to it but idle, once the process is taken for gone (counter
 *    peers_unreachable), gets IBV_WC_RETRY_EXC_ERR for its next SEND and
 *    a flush for the one behind (an RC QP's first WR after its peer
 *    died); the binding expires after the lease, not before, and C binds
 *    it;
 * 8. a new process (node 6) qconnects to (node 4, port) and reaches C;
 * 9. a process bound at (node 9, port) is stopped for 700 ms, less than
 *    its lease (a process starved of CPU): C's SEND to it on the tier is
 *    not failed after the connect timeout but waited for (its binding
 *    looked up again: peers_vouched), and completes once it runs.
 *
 * "connect both ways at once": two processes (nodes 7 and 8), each bound,
 * qconnect to each other at the same moment, CROSS_ROUNDS times with new
 * VQPs (the first round makes the links from both sides at once); every
 * round each sends a message the other's bound VQP checks, and READs the
 * other's memory.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5200
#define NBUF 32
#define SBUF (256 * 1024)	/* the server's receive buffers */
#define BURST 48
#define BURST_LEN (128 * 1024)
#define TOO_BIG (300 * 1024)
#define LEASE_MS 500
#define META_LEASE_MS 1500
#define IDLE_MSGS 300
#define IDLE_BATCH 30

/* The server blocks on it after 'S' until the client writes a byte. */
static int pause_pipe[2];

/* The server's resident memory is measured: memory it frees must be
 * reusable at once, not parked in AddressSanitizer's quarantine. */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
	return "quarantine_size_mb=0";
}

/* AddressSanitizer's count of bytes allocated and not freed (its
 * allocator_interface.h is not installed with every compiler). */
size_t __sanitizer_get_current_allocated_bytes(void);

struct node {
	struct ct_dev d;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	uint8_t *buf;
	size_t len;
	struct ibv_mr *mr;
};

static void node_open(struct node *n, int node, size_t len, uint32_t rq)
{
	char idx[16];

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	ct_open(&n->d);
	n->scq = CT_PTR(ibv_create_cq(n->d.ctx, 256, NULL, NULL, 0));
	n->rcq = CT_PTR(ibv_create_cq(n->d.ctx, 256, NULL, NULL, 0));
	n->qp = ct_create_vqp(&n->d, n->scq, n->rcq, (struct ct_qp_caps){ 64, rq, 1, 1, 0, 0 }, NULL);
	n->len = len;
	n->buf = aligned_alloc(4096, len);
	CT_CHECK(n->buf != NULL, "alloc");
	memset(n->buf, 0, len);
	n->mr = CT_PTR(ibv_reg_mr(n->d.pd, n->buf, len, IBV_ACCESS_LOCAL_WRITE));
}

static void post_recv_at(struct ibv_qp *qp, struct node *n, uint64_t wr_id, size_t off, uint32_t len)
{
	struct ibv_sge sge = { (uintptr_t)n->buf + off, len, n->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr *bad = NULL;

	CT_OK(ibv_post_recv(qp, &wr, &bad));
}

static int post_send_at(struct ibv_qp *qp, struct node *n, uint64_t wr_id, size_t off,
			uint32_t len, unsigned flags)
{
	struct ibv_sge sge = { (uintptr_t)n->buf + off, len, n->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = flags };
	struct ibv_send_wr *bad = NULL;

	return ibv_post_send(qp, &wr, &bad);
}

/* A signaled send and its successful completion. */
static void send_sync(struct ibv_qp *qp, struct node *n, uint64_t wr_id, size_t off, uint32_t len)
{
	struct ibv_wc wc;

	CT_OK(post_send_at(qp, n, wr_id, off, len, IBV_SEND_SIGNALED));
	ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == wr_id, "send %llu: %s, wr_id %llu",
		 (unsigned long long)wr_id, ibv_wc_status_str(wc.status),
		 (unsigned long long)wc.wr_id);
}

static uint64_t rss_bytes(void)
{
	unsigned long size = 0, res = 0;
	FILE *f = fopen("/proc/self/statm", "r");
	int fields;

	CT_CHECK(f != NULL, "statm");
	fields = fscanf(f, "%lu %lu", &size, &res);
	CT_CHECK(fields == 2, "statm format");
	fclose(f);
	return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* ---- the server -------------------------------------------------------- */

static int server(int ready_fd)
{
	struct node n;
	uint8_t *lease_buf;
	struct ibv_mr *lease_mr;
	int closes = 0, too_small = 0, done = 0, outstanding = 0, idle_msgs = 0, paused = 0;
	long msgs = 0;

	ct_begin("vqp_life server");
	node_open(&n, 1, 2 * NBUF * (size_t)SBUF, NBUF);
	lease_buf = aligned_alloc(4096, 4096);
	CT_CHECK(lease_buf != NULL, "alloc");
	ct_fill(lease_buf, 4096, 31);
	lease_mr = CT_PTR(ibv_reg_mr(n.d.pd, lease_buf, 4096,
				     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
	for (int i = 0; i < NBUF; i++)
		post_recv_at(n.qp, &n, (uint64_t)i, (size_t)i * SBUF, SBUF);
	CT_OK(qbind(n.qp, ct_node_gid(1), PORT));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	/* Replies are not waited for: a receive slot is reposted when the
	 * reply from its send half completed (a large reply completes only
	 * when the client has READ it). */
	while (!done || outstanding > 0) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		int k = qpop_msgs(n.qp, 16, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			int slot = (int)wc[i].wr_id;
			uint8_t *in = n.buf + (size_t)slot * SBUF;
			uint8_t *out = n.buf + (size_t)(NBUF + slot) * SBUF;
			uint32_t len = 0;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				/* A sender destroyed its VQP: no buffer used. */
				CT_CHECK(wc[i].byte_len == 0 && src[i] != NULL, "close report");
				closes++;
				continue;
			}
			if (wc[i].status == IBV_WC_LOC_LEN_ERR) {
				CT_CHECK(wc[i].byte_len == TOO_BIG, "too-small byte_len %u", wc[i].byte_len);
				too_small++;
				post_recv_at(n.qp, &n, (uint64_t)slot, (size_t)slot * SBUF, SBUF);
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "recv status %s",
				 ibv_wc_status_str(wc[i].status));
			if (++msgs % 500 == 0)
				ct_watchdog(120); /* progress: the watchdog guards each 500 */
			switch (in[0]) {
			case 'E':
				memcpy(out, in, wc[i].byte_len);
				len = wc[i].byte_len;
				break;
			case 'M': {
				uint64_t a = (uintptr_t)lease_buf;
				uint32_t rk = lease_mr->rkey;

				memcpy(out, &a, 8);
				memcpy(out + 8, &rk, 4);
				len = 12;
				break;
			}
			case 'D':
				CT_OK(ibv_dereg_mr(lease_mr));
				/* Returned at once; the real one waits out the lease. */
				CT_KRCORE_STAT(KRCORE_STAT_MR_DEREG_DELAYED, ==, 1);
				out[0] = 'D';
				len = 1;
				break;
			case 'R': {
				uint64_t v[3] = { rss_bytes(), krcore_stat_get(KRCORE_STAT_VQPS),
						  __sanitizer_get_current_allocated_bytes() };

				memcpy(out, v, sizeof(v));
				len = sizeof(v);
				break;
			}
			case 'N':
				/* Sent while we did not poll: counted, not answered. */
				idle_msgs++;
				post_recv_at(n.qp, &n, (uint64_t)slot, (size_t)slot * SBUF, SBUF);
				continue;
			case 'S':
				out[0] = 'S';
				len = 1;
				paused = 1;
				break;
			case 'Q':
				out[0] = 'Q';
				len = 1;
				done = 1;
				break;
			default:
				CT_FAIL("unknown command %#x", in[0]);
			}
			CT_OK(post_send_at(src[i], &n, (uint64_t)slot, (size_t)(NBUF + slot) * SBUF, len,
					   IBV_SEND_SIGNALED));
			outstanding++;
			if (paused) {
				char b;

				/* Not polling until the client has sent everything. */
				CT_CHECK(read(pause_pipe[0], &b, 1) == 1, "resume");
				paused = 0;
			}
		}
		{
			struct ibv_wc swc[16];
			int m = ibv_poll_cq(n.scq, 16, swc);

			CT_CHECK(m >= 0, "poll");
			for (int i = 0; i < m; i++) {
				CT_CHECK(swc[i].status == IBV_WC_SUCCESS, "reply status %s",
					 ibv_wc_status_str(swc[i].status));
				post_recv_at(n.qp, &n, swc[i].wr_id, (size_t)swc[i].wr_id * SBUF, SBUF);
				outstanding--;
			}
			if (k == 0 && m == 0)
				sched_yield();
		}
	}
	/* The client saw its READs refused when its own check expired; our
	 * real deregistration comes 1.1 leases after the dereg plus RC's
	 * retry time (about 3.8 s: a WQE a peer posted within its lease may
	 * arrive that late). */
	{
		uint64_t t = ct_now_ns();

		while (krcore_stat_get(KRCORE_STAT_MR_DEREG_DELAYED) != 0) {
			CT_CHECK(ct_now_ns() - t < 8000000000ull, "the delayed deregistration never ran");
			usleep(10000);
		}
	}
	/* Every churn VQP, the burst VQP and the too-small one said goodbye
	 * before the 'Q' (same link, in order). */
	CT_CHECK(closes >= 2, "closes %d", closes);
	CT_CHECK(too_small == 1, "too-small messages %d", too_small);
	CT_CHECK(idle_msgs == IDLE_MSGS, "%d of %d messages sent while not polling", idle_msgs, IDLE_MSGS);
	ct_note("server: %ld messages, %d src_qps reported closed and freed", msgs, closes);
	ct_pass();
	return 0;
}

/* ---- client A ------------------------------------------------------------ */

/* Command `cmd` (len bytes at offset 0 of the send half) on the main VQP;
 * the answer lands at the receive half; returns its length. */
static uint32_t call(struct node *n, uint8_t cmd, uint32_t len)
{
	struct ibv_wc wc;
	uint8_t *s = n->buf + n->len / 2;

	post_recv_at(n->qp, n, 1, 0, (uint32_t)(n->len / 2));
	s[0] = cmd;
	send_sync(n->qp, n, 2, n->len / 2, len ? len : 1);
	ct_poll_n(n->rcq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "answer to '%c': %s", cmd, ibv_wc_status_str(wc.status));
	return wc.byte_len;
}

static void churn(struct node *n, int count, uint64_t rep[2][3])
{
	struct ibv_cq *cq = CT_PTR(ibv_create_cq(n->d.ctx, 8, NULL, NULL, 0));
	uint64_t t0 = ct_now_ns();

	ct_begin("vqp_life: src_qp reclaim");
	for (int i = 0; i < count; i++) {
		struct ibv_qp *q = ct_create_vqp(&n->d, cq, cq, (struct ct_qp_caps){ 2, 2, 1, 1, 0, 0 }, NULL);
		uint8_t *s = n->buf + n->len / 2;
		struct ibv_wc wc[2];
		int got = 0;

		CT_OK(qconnect(q, ct_node_gid(1), PORT));
		post_recv_at(q, n, 100, 0, 64);
		ct_fill(s, 64, (uint32_t)i);
		s[0] = 'E';
		CT_OK(post_send_at(q, n, 101, n->len / 2, 64, IBV_SEND_SIGNALED));
		while (got < 2) {
			ct_poll_n(cq, &wc[got], 1, CT_TIMEOUT_MS);
			CT_CHECK(wc[got].status == IBV_WC_SUCCESS && wc[got].qp_num == q->qp_num,
				 "churn %d: %s", i, ibv_wc_status_str(wc[got].status));
			got++;
		}
		ct_expect_bytes(n->buf, s, 64, "churn echo");
		CT_OK(ibv_destroy_qp(q));
		if ((i + 1) % 1000 == 0) {
			/* Progress: the watchdog guards each thousand. */
			ct_watchdog(120);
			ct_note("%d VQPs in %.1f s", i + 1, (double)(ct_now_ns() - t0) / 1e9);
		}
		if (i == 999 || i == count - 1) {
			CT_CHECK(call(n, 'R', 1) == sizeof(rep[0]), "R answer");
			memcpy(rep[i == 999 ? 0 : 1], n->buf, sizeof(rep[0]));
		}
	}
	CT_OK(ibv_destroy_cq(cq));
	ct_note("%d short-lived VQPs in %.1f s; the server after 1,000 and after %d: "
		"heap in use %llu and %llu bytes, RSS %.1f and %.1f MiB, live VQPs %llu and %llu",
		count, (double)(ct_now_ns() - t0) / 1e9, count, (unsigned long long)rep[0][2],
		(unsigned long long)rep[1][2], (double)rep[0][0] / 1048576.0,
		(double)rep[1][0] / 1048576.0, (unsigned long long)rep[0][1],
		(unsigned long long)rep[1][1]);
	/* The bound VQP, the main VQP's src_qp, and the last churn VQP's
	 * (reported, freed at the next qpop_msgs). */
	CT_CHECK(rep[1][1] <= 4, "the server keeps %llu VQPs", (unsigned long long)rep[1][1]);
	/* Exact: what the server has allocated and not freed (a leak of one
	 * small object per client would add tens of KiB). */
	CT_CHECK(rep[1][2] < rep[0][2] + 16384, "server heap grew from %llu to %llu bytes",
		 (unsigned long long)rep[0][2], (unsigned long long)rep[1][2]);
	/* Loose: resident memory also moves with the allocator's caches. */
	CT_CHECK(rep[1][0] < rep[0][0] + (8 << 20), "server RSS grew from %llu to %llu",
		 (unsigned long long)rep[0][0], (unsigned long long)rep[1][0]);
	ct_pass();
}

static void large_burst(struct node *n)
{
	struct ibv_cq *scq = CT_PTR(ibv_create_cq(n->d.ctx, 64, NULL, NULL, 0));
	struct ibv_cq *rcq = CT_PTR(ibv_create_cq(n->d.ctx, 64, NULL, NULL, 0));
	struct ibv_qp *b = ct_create_vqp(&n->d, scq, rcq, (struct ct_qp_caps){ 64, 64, 1, 1, 0, 0 }, NULL);
	size_t half = n->len / 2;
	struct ibv_wc wc;
	uint64_t own0 = krcore_stat_get(KRCORE_STAT_LARGE_OWN_REGISTRATIONS);

	ct_begin("vqp_life: large burst");
	CT_OK(qconnect(b, ct_node_gid(1), PORT));
	for (int i = 0; i < BURST; i++)
		post_recv_at(b, n, 1000 + (uint64_t)i, (size_t)i * BURST_LEN, BURST_LEN);
	for (int i = 0; i < BURST; i++) {
		uint8_t *s = n->buf + half + (size_t)i * BURST_LEN;

		ct_fill(s, BURST_LEN, 9000 + (uint32_t)i);
		s[0] = 'E';
		CT_OK(post_send_at(b, n, (uint64_t)i, half + (size_t)i * BURST_LEN, BURST_LEN,
				   i == BURST - 1 ? IBV_SEND_SIGNALED : 0));
	}
	for (int i = 0; i < BURST; i++) {
		uint8_t *r = n->buf + (size_t)i * BURST_LEN;

		ct_poll_n(rcq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1000 + (uint64_t)i &&
				 wc.byte_len == BURST_LEN,
			 "echo %d: %s wr_id %llu len %u", i, ibv_wc_status_str(wc.status),
			 (unsigned long long)wc.wr_id, wc.byte_len);
		CT_CHECK(r[0] == 'E', "echo %d command byte", i);
		{
			uint8_t *want = malloc(BURST_LEN);

			CT_CHECK(want != NULL, "alloc");
			ct_fill(want, BURST_LEN, 9000 + (uint32_t)i);
			ct_expect_bytes(r + 1, want + 1, BURST_LEN - 1, "burst echo");
			free(want);
		}
	}
	/* The last send completes when the server has READ every message. */
	ct_poll_n(scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == BURST - 1, "burst send: %s",
		 ibv_wc_status_str(wc.status));
	CT_KRCORE_STAT(KRCORE_STAT_LARGE_OWN_REGISTRATIONS, >, own0);
	CT_OK(ibv_destroy_qp(b));
	CT_OK(ibv_destroy_cq(scq));
	CT_OK(ibv_destroy_cq(rcq));
	ct_note("%d x %d KiB echoed; %llu needed a registration of their own", BURST,
		BURST_LEN / 1024,
		(unsigned long long)(krcore_stat_get(KRCORE_STAT_LARGE_OWN_REGISTRATIONS) - own0));
	ct_pass();
}

static void too_small(struct node *n)
{
	struct ibv_cq *cq = CT_PTR(ibv_create_cq(n->d.ctx, 8, NULL, NULL, 0));
	struct ibv_qp *s = ct_create_vqp(&n->d, cq, cq, (struct ct_qp_caps){ 4, 1, 1, 1, 0, 0 }, NULL);
	struct ibv_wc wc;

	ct_begin("vqp_life: receive too small");
	CT_OK(qconnect(s, ct_node_gid(1), PORT));
	n->buf[n->len / 2] = 'E';
	CT_OK(post_send_at(s, n, 1, n->len / 2, TOO_BIG, IBV_SEND_SIGNALED));
	ct_poll_n(cq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_REM_INV_REQ_ERR && wc.wr_id == 1, "sender: %s",
		 ibv_wc_status_str(wc.status));
	/* In error, as an RC QP: accepted, then flushed. */
	CT_OK(post_send_at(s, n, 2, n->len / 2, 8, IBV_SEND_SIGNALED));
	ct_poll_n(cq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == 2, "after the error: %s",
		 ibv_wc_status_str(wc.status));
	CT_OK(ibv_destroy_qp(s));
	CT_OK(ibv_destroy_cq(cq));
	ct_pass();
}

static void mr_lease(struct node *n)
{
	uint64_t addr;
	uint32_t rkey;
	uint8_t *local = n->buf;
	int reads = 0, rc;
	uint64_t t_dereg = 0, t_refused;

	ct_begin("vqp_life: MR lease");
	CT_CHECK(call(n, 'M', 1) == 12, "M answer");
	memcpy(&addr, n->buf, 8);
	memcpy(&rkey, n->buf + 8, 4);
	for (;;) {
		struct ibv_sge sge = { (uintptr_t)local + 64, 4096, n->mr->lkey };
		struct ibv_send_wr wr = { .wr_id = 50, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_RDMA_READ,
					  .send_flags = IBV_SEND_SIGNALED };
		struct ibv_send_wr *bad = NULL;
		struct ibv_wc wc;

		wr.wr.rdma.remote_addr = addr;
		wr.wr.rdma.rkey = rkey;
		memset(local + 64, 0, 4096);
		rc = ibv_post_send(n->qp, &wr, &bad);
		if (rc)
			break;
		ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS, "READ %d: %s", reads,
			 ibv_wc_status_str(wc.status));
		ct_expect_pattern(local + 64, 4096, 31, "READ of the lease MR");
		if (++reads == 1) {
			CT_CHECK(call(n, 'D', 1) == 1, "D answer");
			t_dereg = ct_now_ns();
		}
		CT_CHECK(ct_now_ns() - t_dereg < 5000000000ull, "READs still allowed after 5 s");
		/* Sleeping is the point: time passing towards the lease. */
		usleep(20000);
	}
	t_refused = ct_now_ns();
	CT_CHECK(rc == EINVAL, "refused with %d", rc);
	CT_CHECK(reads >= 2, "no READ between the deregistration and the refusal");
	/* The link is intact. */
	n->buf[n->len / 2] = 'E';
	CT_CHECK(call(n, 'E', 16) == 16, "echo after the lease");
	ct_note("%d READs succeeded after ibv_dereg_mr, refused after %.0f ms (lease %d ms)",
		reads - 1, (double)(t_refused - t_dereg) / 1e6, LEASE_MS);
	CT_CHECK(t_refused - t_dereg < (uint64_t)(LEASE_MS + 1000) * 1000000ull, "refused late");
	ct_pass();
}

static void idle_server(struct node *n)
{
	uint8_t *s = n->buf + n->len / 2;
	struct ibv_wc wc;

	ct_begin("vqp_life: messages while the server does not poll");
	CT_CHECK(call(n, 'S', 1) == 1, "S answer");
	memset(s, 'N', 64);
	for (int i = 0; i < IDLE_MSGS; i += IDLE_BATCH) {
		for (int j = 0; j < IDLE_BATCH; j++)
			CT_OK(post_send_at(n->qp, n, 3000 + (uint64_t)(i + j), n->len / 2, 64,
					   j == IDLE_BATCH - 1 ? IBV_SEND_SIGNALED : 0));
		/* Completes once the server's side took the batch in. */
		ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 3000 + (uint64_t)(i + IDLE_BATCH - 1),
			 "batch at %d: %s", i, ibv_wc_status_str(wc.status));
	}
	CT_CHECK(write(pause_pipe[1], "G", 1) == 1, "resume the server");
	ct_note("%d messages taken in while the server was not polling", IDLE_MSGS);
	ct_pass();
}

static int client_a(int ready_fd)
{
	struct node n;
	uint64_t rep[2][3];
	int count = getenv("CT_CHURN") ? atoi(getenv("CT_CHURN")) : 10000;

	(void)ready_fd;
	node_open(&n, 2, 2 * (size_t)BURST * BURST_LEN, 4);
	CT_OK(qconnect(n.qp, ct_node_gid(1), PORT));
	churn(&n, count < 1000 ? 1000 : count, rep);
	large_burst(&n);
	too_small(&n);
	idle_server(&n);
	mr_lease(&n);
	CT_CHECK(call(&n, 'Q', 1) == 1, "Q answer");
	return 0;
}

/* ---- client C: binding expiry ------------------------------------------- */

static int victim_node, victim_port;
static pid_t victims[3];
static int rebound[2];		/* C tells the reacher that (node 4) is its */

static int victim(int ready_fd)
{
	struct node n;

	node_open(&n, victim_node, 4096, 1);
	CT_OK(qbind(n.qp, ct_node_gid(victim_node), victim_port));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	for (;;)
		pause();
}

/* qbind (node, port) on q until it succeeds (the old binding is gone);
 * the milliseconds it took. */
static double rebind(struct ibv_qp *q, int node, int port, uint64_t t0)
{
	for (;;) {
		int rc = qbind(q, ct_node_gid(node), port);

		if (rc == 0)
			return (double)(ct_now_ns() - t0) / 1e6;
		CT_CHECK(rc == EADDRINUSE, "qbind: %d (%s)", rc, strerror(rc));
		CT_CHECK(ct_now_ns() - t0 < 10000000000ull, "still bound after 10 s");
		usleep(5000);
	}
}

static int reacher(void)
{
	struct node n;
	char b;

	close(rebound[1]);
	CT_CHECK(read(rebound[0], &b, 1) == 1, "client C never rebound");
	ct_begin("vqp_life: a new qconnect reaches the new binder");
	node_open(&n, 6, 4096, 1);
	CT_OK(qconnect(n.qp, ct_node_gid(4), PORT + 1));
	memcpy(n.buf + 2048, "hello", 5);
	send_sync(n.qp, &n, 1, 2048, 5);
	ct_pass();
	return 0;
}

static int client_c(void)
{
	struct node n;
	struct ibv_qp *q4, *q5;
	double killed_ms, stopped_ms;
	uint64_t t0;

	close(rebound[0]);
	/* Read at this process's first use of the library, below. */
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "250", 1);
	ct_begin("vqp_life: binding expiry");
	node_open(&n, 3, 4096, 4);
	q4 = ct_create_vqp(&n.d, n.scq, n.rcq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);
	q5 = ct_create_vqp(&n.d, n.scq, n.rcq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);

	CT_CHECK(qbind(q4, ct_node_gid(4), PORT + 1) == EADDRINUSE, "bound by victim 1");
	kill(victims[0], SIGKILL);
	t0 = ct_now_ns();
	killed_ms = rebind(q4, 4, PORT + 1, t0);
	CT_CHECK(killed_ms < META_LEASE_MS, "a killed process's binding took %.0f ms", killed_ms);

	CT_CHECK(qbind(q5, ct_node_gid(5), PORT + 2) == EADDRINUSE, "bound by victim 2");
	kill(victims[1], SIGSTOP);
	t0 = ct_now_ns();
	{
		/* Bound, but its process answers nothing. */
		struct ibv_qp *probe = ct_create_vqp(&n.d, n.scq, n.rcq,
						     (struct ct_qp_caps){ 1, 1, 1, 1, 0, 0 }, NULL);
		struct ibv_wc wc;
		uint64_t t1 = ct_now_ns();
		double ms;

		uint64_t unreachable = krcore_stat_get(KRCORE_STAT_PEERS_UNREACHABLE);
		int rc = qconnect(probe, ct_node_gid(5), PORT + 2);
		const char *how;

		if (rc == 0) {
			/* Connected too, but idle while the process is found gone. */
			struct ibv_qp *idle = ct_create_vqp(&n.d, n.scq, n.rcq,
							    (struct ct_qp_caps){ 2, 1, 1, 1, 0, 0 }, NULL);
			struct ibv_wc two[2];

			CT_OK(qconnect(idle, ct_node_gid(5), PORT + 2));
			/* The datagram tier: no handshake, the SEND fails. */
			CT_OK(post_send_at(probe, &n, 77, 0, 8, IBV_SEND_SIGNALED));
			ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
			CT_CHECK(wc.wr_id == 77 && wc.status == IBV_WC_RETRY_EXC_ERR, "SEND to a stopped process: %s",
				 ibv_wc_status_str(wc.status));
			how = "a SEND after qconnect failed with RETRY_EXC_ERR";
			ms = (double)(ct_now_ns() - t1) / 1e6;
			/* The link asked for meanwhile gets no answer either: the
			 * process is taken for gone. The idle VQP's first SEND
			 * then meets that error, as an RC QP's first WR after its
			 * peer died; the one behind it is flushed. */
			CT_KRCORE_STAT_WITHIN(KRCORE_STAT_PEERS_UNREACHABLE, >, unreachable);
			CT_OK(post_send_at(idle, &n, 78, 0, 8, 0));
			CT_OK(post_send_at(idle, &n, 79, 0, 8, IBV_SEND_SIGNALED));
			ct_poll_n(n.scq, two, 2, CT_TIMEOUT_MS);
			CT_CHECK(two[0].wr_id == 78 && two[0].status == IBV_WC_RETRY_EXC_ERR,
				 "an idle VQP's first SEND after its peer was found gone: %s (wr %llu)",
				 ibv_wc_status_str(two[0].status), (unsigned long long)two[0].wr_id);
			CT_CHECK(two[1].wr_id == 79 && two[1].status == IBV_WC_WR_FLUSH_ERR, "the SEND behind it: %s",
				 ibv_wc_status_str(two[1].status));
			CT_OK(ibv_destroy_qp(idle));
		} else {
			/* KRCORE_DGRAM=0: the handshake times out. */
			CT_CHECK(rc == ETIMEDOUT, "qconnect to a stopped process: %d (%s)", rc, strerror(rc));
			how = "qconnect failed with ETIMEDOUT";
			ms = (double)(ct_now_ns() - t1) / 1e6;
		}
		/* On the tier, a peer that does not answer is waited for while
		 * its binding stays (a process starved of CPU answers late): a
		 * stopped one until its lease runs out, then the connect
		 * timeout. */
		CT_CHECK(ms >= 250 && ms < META_LEASE_MS + 250 + 1000, "a stopped process found not answering after %.0f ms", ms);
		ct_note("a stopped process: %s after %.0f ms (connect timeout 250 ms, lease %d ms)", how, ms, META_LEASE_MS);
		CT_OK(ibv_destroy_qp(probe));
	}
	stopped_ms = rebind(q5, 5, PORT + 2, t0);
	kill(victims[1], SIGKILL);
	kill(victims[1], SIGCONT);
	/* Renewed every third of the lease: gone between 2/3 and 1 lease
	 * after the last renewal, plus the meta server's sweep. */
	CT_CHECK(stopped_ms > META_LEASE_MS / 2, "expired after only %.0f ms", stopped_ms);
	CT_CHECK(stopped_ms < META_LEASE_MS + 2000, "expired after %.0f ms", stopped_ms);
	ct_note("binding gone %.1f ms after SIGKILL, %.0f ms after SIGSTOP (lease %d ms)",
		killed_ms, stopped_ms, META_LEASE_MS);
	ct_pass();

	ct_begin("vqp_life: a process stopped for less than its lease is waited for");
	{
		/* A process starved of CPU (a burst of new processes on its
		 * host) answers the datagram tier late: stopped for 700 ms
		 * (its binding stays: renewed every 500 ms, gone 1000 ms after
		 * the last renewal at the earliest), almost three connect
		 * timeouts. The SEND is waited for, and lands once it runs. */
		struct ibv_qp *slow = ct_create_vqp(&n.d, n.scq, n.rcq,
						    (struct ct_qp_caps){ 1, 1, 1, 1, 0, 0 }, NULL);
		uint64_t vouched = krcore_stat_get(KRCORE_STAT_PEERS_VOUCHED);
		uint64_t unreachable = krcore_stat_get(KRCORE_STAT_PEERS_UNREACHABLE);
		struct ibv_wc wc;
		uint64_t t_stop, stopped_ns;

		CT_OK(qconnect(slow, ct_node_gid(9), PORT + 3));
		CT_CHECK(kill(victims[2], SIGSTOP) == 0, "SIGSTOP");
		t_stop = ct_now_ns();
		ct_wait_stopped(victims[2]);
		CT_OK(post_send_at(slow, &n, 70, 0, 8, IBV_SEND_SIGNALED));
		/* Looked up, still bound: waited for (the SEND had failed after
		 * one connect timeout). */
		CT_KRCORE_STAT_WITHIN(KRCORE_STAT_PEERS_VOUCHED, >, vouched);
		CT_CHECK(ibv_poll_cq(n.scq, 1, &wc) == 0, "the SEND completed while its peer was stopped: %s",
			 ibv_wc_status_str(wc.status));
		stopped_ns = ct_now_ns() - t_stop;
		if (stopped_ns < 700 * 1000000ull)
			usleep((useconds_t)((700 * 1000000ull - stopped_ns) / 1000));
		CT_CHECK(ibv_poll_cq(n.scq, 1, &wc) == 0, "the SEND completed while its peer was stopped: %s",
			 ibv_wc_status_str(wc.status));
		stopped_ns = ct_now_ns() - t_stop;
		CT_CHECK(kill(victims[2], SIGCONT) == 0, "SIGCONT");
		ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.wr_id == 70 && wc.status == IBV_WC_SUCCESS, "the SEND to a process stopped for %.0f ms: %s",
			 (double)stopped_ns / 1e6, ibv_wc_status_str(wc.status));
		CT_CHECK(krcore_stat_get(KRCORE_STAT_PEERS_UNREACHABLE) == unreachable, "taken for gone");
		ct_note("a SEND to a process stopped for %.0f ms (connect timeout 250 ms, lease %d ms) completed "
			"%.0f ms after the stop; its binding was looked up %llu time(s)", (double)stopped_ns / 1e6,
			META_LEASE_MS, (double)(ct_now_ns() - t_stop) / 1e6,
			(unsigned long long)(krcore_stat_get(KRCORE_STAT_PEERS_VOUCHED) - vouched));
		CT_OK(ibv_destroy_qp(slow));
		kill(victims[2], SIGKILL);
	}
	ct_pass();

	/* (node 4, PORT + 1) is ours now: a new process reaches it. */
	ct_begin("vqp_life: the new binder gets the message");
	post_recv_at(q4, &n, 9, 0, 64);
	CT_CHECK(write(rebound[1], "B", 1) == 1, "tell the reacher");
	{
		uint64_t t = ct_now_ns();
		struct ibv_qp *src;
		struct ibv_wc wc;
		int k;

		while ((k = qpop_msgs(q4, 1, &src, &wc)) == 0) {
			CT_CHECK(ct_now_ns() - t < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "no message");
			sched_yield();
		}
		CT_CHECK(k == 1 && wc.status == IBV_WC_SUCCESS && wc.byte_len == 5, "message: %d", k);
		CT_CHECK(memcmp(n.buf, "hello", 5) == 0, "message bytes");
	}
	ct_pass();
	return 0;
}

/* ---- connect both ways at once ------------------------------------------- */

#define CROSS_ROUNDS 3
static int cross_go[2][2];	/* [side]: the parent releases both at once */

static int cross(int side)
{
	int me = 7 + side, other = 8 - side;
	struct node n;
	uint8_t *mem;
	struct ibv_mr *mmr;

	ct_begin(side ? "vqp_life: connect both ways at once (node 8)"
		      : "vqp_life: connect both ways at once (node 7)");
	node_open(&n, me, 8192, 8);
	mem = aligned_alloc(4096, 4096);
	CT_CHECK(mem != NULL, "alloc");
	ct_fill(mem, 4096, 700 + (uint32_t)me);
	mmr = CT_PTR(ibv_reg_mr(n.d.pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
	for (int i = 0; i < 8; i++)
		post_recv_at(n.qp, &n, (uint64_t)i, (size_t)i * 512, 512);
	CT_OK(qbind(n.qp, ct_node_gid(me), PORT + 10));
	/* Tell the other side where our memory is, through the parent. */
	{
		uint64_t info[2] = { (uintptr_t)mem, mmr->rkey };

		CT_CHECK(write(cross_go[side][1], info, sizeof(info)) == sizeof(info), "ready");
	}
	for (int round = 0; round < CROSS_ROUNDS; round++) {
		struct ibv_qp *q = ct_create_vqp(&n.d, n.scq, n.rcq, (struct ct_qp_caps){ 4, 1, 1, 1, 0, 0 }, NULL);
		uint64_t info[2];
		struct ibv_wc wc;
		int got = 0;
		uint64_t t0;

		CT_CHECK(read(cross_go[side][0], info, sizeof(info)) == sizeof(info), "go %d", round);
		CT_OK(qconnect(q, ct_node_gid(other), PORT + 10));
		/* A message for the other's bound VQP. */
		ct_fill(n.buf + 4096, 64, (uint32_t)(me * 100 + round));
		send_sync(q, &n, 1, 4096, 64);
		/* A READ of the other's memory. */
		{
			struct ibv_sge sge = { (uintptr_t)n.buf + 6144, 64, n.mr->lkey };
			struct ibv_send_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1,
						  .opcode = IBV_WR_RDMA_READ,
						  .send_flags = IBV_SEND_SIGNALED };
			struct ibv_send_wr *bad = NULL;

			wr.wr.rdma.remote_addr = info[0] + 64 * (uint64_t)round;
			wr.wr.rdma.rkey = (uint32_t)info[1];
			CT_OK(ibv_post_send(q, &wr, &bad));
			ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
			CT_CHECK(wc.status == IBV_WC_SUCCESS, "READ: %s", ibv_wc_status_str(wc.status));
			{
				uint8_t want[4096];

				ct_fill(want, 4096, 700 + (uint32_t)other);
				ct_expect_bytes(n.buf + 6144, want + 64 * round, 64, "READ of the other side");
			}
		}
		/* The other's message, on our bound VQP. */
		t0 = ct_now_ns();
		while (!got) {
			struct ibv_qp *src;
			int k = qpop_msgs(n.qp, 1, &src, &wc);

			CT_CHECK(k >= 0, "qpop_msgs %d", k);
			if (k == 1 && wc.status == IBV_WC_WR_FLUSH_ERR && wc.byte_len == 0)
				continue; /* the other's previous round VQP */
			if (k == 1) {
				uint8_t want[64];

				CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 64, "message: %s",
					 ibv_wc_status_str(wc.status));
				ct_fill(want, 64, (uint32_t)(other * 100 + round));
				ct_expect_bytes(n.buf + wc.wr_id * 512, want, 64, "message from the other side");
				post_recv_at(n.qp, &n, wc.wr_id, wc.wr_id * 512, 512);
				got = 1;
			}
			CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "no message");
		}
		/* Both sides done with this round before the next starts. */
		CT_CHECK(write(cross_go[side][1], info, sizeof(info)) == sizeof(info), "done %d", round);
		CT_OK(ibv_destroy_qp(q));
	}
	/* Both sides done before either exits: the other's last READ of our
	 * memory may still be on its way (an exited process answers nothing,
	 * and the READ would fail with RETRY_EXC_ERR). */
	{
		uint64_t end[2];

		CT_CHECK(read(cross_go[side][0], end, sizeof(end)) == sizeof(end), "the end");
	}
	ct_pass();
	return 0;
}

/* The parent's part: relay the memory info and release both sides at
 * once, round after round. */
static int cross_run(void)
{
	pid_t p[2];
	uint64_t info[2][2];
	int fails = 0;

	for (int side = 0; side < 2; side++) {
		int to[2], from[2];

		CT_CHECK(pipe(to) == 0 && pipe(from) == 0, "pipe");
		p[side] = fork();
		if (p[side] == 0) {
			cross_go[side][0] = to[0];
			cross_go[side][1] = from[1];
			_exit(cross(side));
		}
		cross_go[side][0] = from[0];	/* what the side says */
		cross_go[side][1] = to[1];	/* what we tell it */
	}
	for (int side = 0; side < 2; side++)
		CT_CHECK(read(cross_go[side][0], info[side], sizeof(info[side])) == sizeof(info[side]),
			 "side %d ready", side);
	for (int round = 0; round < CROSS_ROUNDS; round++) {
		/* Each side gets the other's memory; both go at once. */
		for (int side = 0; side < 2; side++)
			CT_CHECK(write(cross_go[side][1], info[1 - side], sizeof(info[0])) == sizeof(info[0]),
				 "go");
		for (int side = 0; side < 2; side++) {
			uint64_t done[2];

			CT_CHECK(read(cross_go[side][0], done, sizeof(done)) == sizeof(done),
				 "side %d round %d", side, round);
		}
	}
	/* Both finished their last round: they may go. */
	for (int side = 0; side < 2; side++)
		CT_CHECK(write(cross_go[side][1], info[side], sizeof(info[0])) == sizeof(info[0]), "the end");
	for (int side = 0; side < 2; side++)
		fails += ct_wait_child(p[side], "a cross-connecting side");
	return fails;
}

int main(void)
{
	pid_t meta_pid, srv, a, c, r;
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library: every
	 * process forked below gets these. */
	setenv("KRCORE_MR_LEASE_MS", "500", 1);
	setenv("KRCORE_META_LEASE_MS", "1500", 1);
	setenv("KRCORE_STAGING_BYTES", "1048576", 1);
	ct_watchdog(300);
	CT_CHECK(pipe(pause_pipe) == 0, "pipe");
	meta_pid = ct_start_meta();
	srv = ct_fork_ready(server, "the server (qbind)");
	victim_node = 4, victim_port = PORT + 1;
	victims[0] = ct_fork_ready(victim, "victim on node 4");
	victim_node = 5, victim_port = PORT + 2;
	victims[1] = ct_fork_ready(victim, "victim on node 5");
	victim_node = 9, victim_port = PORT + 3;
	victims[2] = ct_fork_ready(victim, "victim on node 9");
	CT_CHECK(pipe(rebound) == 0, "pipe");
	r = fork();
	if (r == 0)
		_exit(reacher());
	a = fork();
	if (a == 0)
		_exit(client_a(-1));
	c = fork();
	if (c == 0)
		_exit(client_c());
	close(rebound[0]);
	close(rebound[1]);
	fails += ct_wait_child(c, "client C");
	fails += ct_wait_child(r, "reacher");
	waitpid(victims[0], NULL, 0);
	waitpid(victims[1], NULL, 0);
	waitpid(victims[2], NULL, 0);
	fails += ct_wait_child(a, "client A");
	fails += cross_run();
	fails += ct_wait_child(srv, "server");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
