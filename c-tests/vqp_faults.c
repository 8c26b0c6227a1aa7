/*
 * Virtual QPs when peers die (kill -9), several processes on several
 * emulated nodes, krcore-meta started here on node 1.
 *
 * "a client killed mid-stream": a server bound on node 1 takes SENDs from
 * 4 client processes (nodes 2-5), each also bound at a port of its own
 * and READing the server's memory between SENDs. The client on node 2 is
 * killed with SIGKILL halfway. The server gets every message of the 3
 * others exactly once, in order, byte for byte, and the killed client's
 * messages up to its death in order without a gap; qpop_msgs reports the
 * killed client's src_qp closed (IBV_WC_WR_FLUSH_ERR) within the link
 * probe bound and frees it; the killed client's binding is gone from the
 * meta server (the server binds that address itself); the 3 others' sends
 * and READs all succeed (their links see nothing).
 *
 * "a server killed": a client on node 7 streams SENDs and READs on one VQP
 * to a server on node 6 and has a second VQP, connected to a server on
 * node 9, with only receives posted (nothing ever sent on its link). Both
 * servers are killed with SIGKILL. The streaming VQP's outstanding WRs all
 * complete in error (the first as RC reports it, the rest flushed) and its
 * receives are flushed; the idle VQP's receives are flushed too (found by
 * the link's liveness probe): both within the bound, measured from the
 * kill. A later post on either is accepted and flushed, as on an RC QP in
 * error. qconnect to the dead server's address is refused (ECONNREFUSED)
 * until a new server process binds it, then reaches it, and data moves.
 */
#define _GNU_SOURCE
#include "common.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5300
#define CLIENTS 4
#define MSGS 1000
#define MSG_LEN 64
#define NBUF 64
#define WINDOW 16
#define PROBE_MS 500
#define META_LEASE_MS 1500
/* Peer death found within the probe period plus RC's retries (timeout
 * 17, retry_cnt 6: about 3.8 s of transport time), under emulation. */
#define DEATH_BOUND_MS 8000

static struct ibv_qp *vqp(struct ct_node *n, uint32_t sq, uint32_t rq)
{
	return ct_node_vqp(n, sq, rq);
}

static void post_recv_at(struct ibv_qp *qp, struct ct_node *n, uint64_t wr_id, size_t off, uint32_t len)
{
	ct_post_recv1(qp, wr_id, &n->b, off, len);
}

static int post_at(struct ibv_qp *qp, struct ct_node *n, uint64_t wr_id, enum ibv_wr_opcode op, size_t off,
		   uint32_t len, uint64_t raddr, uint32_t rkey)
{
	return ct_post_send1(qp, wr_id, op, IBV_SEND_SIGNALED, &n->b, off, len, raddr, rkey, 0);
}

/* Poll one completion of cq within timeout_ms; 1 if one came. */
static int poll_within(struct ibv_cq *cq, struct ibv_wc *wc, int timeout_ms)
{
	uint64_t t0 = ct_now_ns();

	for (;;) {
		int k = ibv_poll_cq(cq, 1, wc);

		CT_CHECK(k >= 0, "ibv_poll_cq: %d", k);
		if (k == 1)
			return 1;
		if (ct_now_ns() - t0 > (uint64_t)timeout_ms * 1000000ull)
			return 0;
		sched_yield();
	}
}

static double ms_since(uint64_t t0)
{
	return (double)(ct_now_ns() - t0) / 1e6;
}

static void fill_msg(uint8_t *p, uint32_t id, uint32_t seq)
{
	ct_fill_msg(p, MSG_LEN, id, seq);
}

static void expect_msg(const uint8_t *p, uint32_t id, uint32_t seq)
{
	ct_expect_msg(p, MSG_LEN, id, seq);
}

/* qbind (node, port) on q until it succeeds (the old binding is gone);
 * the milliseconds since t0. */
static double rebind(struct ibv_qp *q, int node, int port, uint64_t t0)
{
	for (;;) {
		int rc = qbind(q, ct_node_gid(node), port);

		if (rc == 0)
			return ms_since(t0);
		CT_CHECK(rc == EADDRINUSE, "qbind: %d (%s)", rc, strerror(rc));
		CT_CHECK(ms_since(t0) < 10000, "still bound after 10 s");
		usleep(5000);
	}
}

/* ---- a client killed mid-stream ----------------------------------------- */

static int info_pipe[2];	/* the server's memory, for each client */
static int kill_pipe[2];	/* the parent tells the server when it killed */
static int half_pipe[2];	/* the victim tells the parent it is halfway */
static int client_id;

static int stream_server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint8_t *mem;
	struct ibv_mr *mmr;
	uint32_t next[CLIENTS] = { 0 };
	struct ibv_qp *srcs[CLIENTS] = { 0 };
	int victim_closed = 0, survivors_done = 0;
	uint64_t t_closed = 0, t_kill = 0;
	uint64_t vqps_before;

	ct_begin("vqp_faults: a client killed mid-stream (server)");
	ct_node_open(&n, 1, NBUF * MSG_LEN, 256);
	qp = vqp(&n, 16, NBUF);
	mem = aligned_alloc(4096, 4096);
	CT_CHECK(mem != NULL, "alloc");
	ct_fill(mem, 4096, 4242);
	mmr = CT_PTR(ibv_reg_mr(n.d.pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
	for (int i = 0; i < NBUF; i++)
		post_recv_at(qp, &n, (uint64_t)i, (size_t)i * MSG_LEN, MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	for (int i = 0; i < CLIENTS; i++) {
		uint64_t info[2] = { (uintptr_t)mem, mmr->rkey };

		CT_CHECK(write(info_pipe[1], info, sizeof(info)) == sizeof(info), "info");
	}
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	while (!victim_closed || survivors_done < CLIENTS - 1) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		int k = qpop_msgs(qp, 16, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			uint32_t id, seq;
			uint8_t *p;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				/* A sender is gone: the victim (killed), or a
				 * survivor that destroyed its VQP at the end. */
				if (src[i] == srcs[0]) {
					CT_CHECK(!victim_closed, "the victim closed twice");
					victim_closed = 1;
					t_closed = ct_now_ns();
				}
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN,
				 "message: %s, %u bytes", ibv_wc_status_str(wc[i].status), wc[i].byte_len);
			p = n.b.p + wc[i].wr_id * MSG_LEN;
			memcpy(&id, p, 4);
			memcpy(&seq, p + 4, 4);
			CT_CHECK(id < CLIENTS, "client id %u", id);
			CT_CHECK(srcs[id] == NULL || srcs[id] == src[i], "client %u changed src_qp", id);
			srcs[id] = src[i];
			/* Exactly once, in order: no gap, no duplicate. */
			CT_CHECK(seq == next[id], "client %u: message %u, expected %u", id, seq, next[id]);
			expect_msg(p, id, seq);
			next[id]++;
			if (id != 0 && next[id] == MSGS)
				survivors_done++;
			post_recv_at(qp, &n, wc[i].wr_id, wc[i].wr_id * MSG_LEN, MSG_LEN);
		}
	}
	CT_CHECK(read(kill_pipe[0], &t_kill, sizeof(t_kill)) == sizeof(t_kill), "kill time");
	for (int id = 1; id < CLIENTS; id++)
		CT_CHECK(next[id] == MSGS, "client %d: %u messages", id, next[id]);
	CT_CHECK(next[0] >= MSGS / 2, "the victim's messages: %u", next[0]);
	ct_note("the killed client's src_qp reported closed %.0f ms after SIGKILL (%u of its messages, in order)",
		(double)(t_closed - t_kill) / 1e6, next[0]);
	CT_CHECK((double)(t_closed - t_kill) / 1e6 < DEATH_BOUND_MS, "closed %.0f ms after the kill",
		 (double)(t_closed - t_kill) / 1e6);
	/* The next call frees the closed src_qps: fewer live VQPs. */
	vqps_before = krcore_stat_get(KRCORE_STAT_VQPS);
	{
		struct ibv_qp *src;
		struct ibv_wc wc;

		CT_CHECK(qpop_msgs(qp, 1, &src, &wc) >= 0, "qpop_msgs");
	}
	CT_CHECK(krcore_stat_get(KRCORE_STAT_VQPS) < vqps_before, "src_qps not freed: %llu VQPs",
		 (unsigned long long)krcore_stat_get(KRCORE_STAT_VQPS));
	/* The killed client's binding is gone: its address is free. */
	{
		struct ibv_qp *q = vqp(&n, 1, 1);
		/* Gone when its TCP connection closed, long before this. */
		double ms = rebind(q, 2, PORT + 2, ct_now_ns());

		ct_note("the killed client's binding was free when looked at (%.0f ms to bind it)", ms);
		CT_CHECK(ms < META_LEASE_MS, "binding still there %.0f ms later", ms);
		CT_OK(ibv_destroy_qp(q));
	}
	CT_CHECK(krcore_stat_get(KRCORE_STAT_LINKS_FAILED) >= 1, "no link failed");
	ct_pass();
	return 0;
}

static int stream_client(void)
{
	uint32_t id = (uint32_t)client_id;
	int node = 2 + client_id;
	struct ct_node n;
	struct ibv_qp *qp;
	uint64_t info[2];
	uint32_t sent = 0, done = 0, reads = 0;
	int outstanding = 0;

	ct_begin(id == 0 ? "vqp_faults: the client to kill" : "vqp_faults: a surviving client");
	ct_node_open(&n, node, (WINDOW + 1) * 2 * MSG_LEN, 256);
	qp = vqp(&n, 2 * WINDOW, 1);
	CT_OK(qbind(vqp(&n, 1, 1), ct_node_gid(node), PORT + node));
	CT_CHECK(read(info_pipe[0], info, sizeof(info)) == sizeof(info), "server info");
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	/* Messages, with a READ of the server's memory every 8th, WINDOW at
	 * most in flight. The victim goes on until it is killed. */
	while (id == 0 || done < MSGS) {
		struct ibv_wc wc;

		while (outstanding < WINDOW && (id == 0 || sent < MSGS)) {
			size_t slot = (sent % WINDOW) * 2 * MSG_LEN;

			fill_msg(n.b.p + slot, id, sent);
			CT_OK(post_at(qp, &n, sent, IBV_WR_SEND, slot, MSG_LEN, 0, 0));
			outstanding++;
			if (sent % 8 == 0) {
				CT_OK(post_at(qp, &n, (1ull << 32) | sent, IBV_WR_RDMA_READ, slot + MSG_LEN,
					      MSG_LEN, info[0] + (sent % 64) * MSG_LEN, (uint32_t)info[1]));
				outstanding++;
			}
			sent++;
			if (id == 0 && sent == MSGS / 2)
				CT_CHECK(write(half_pipe[1], "H", 1) == 1, "halfway");
		}
		ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS, "client %u: wr %llx: %s", id,
			 (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
		outstanding--;
		if (wc.wr_id >> 32) {
			uint8_t want[4096];
			uint32_t seq = (uint32_t)wc.wr_id;

			ct_fill(want, 4096, 4242);
			ct_expect_bytes(n.b.p + (seq % WINDOW) * 2 * MSG_LEN + MSG_LEN,
					want + (seq % 64) * MSG_LEN, MSG_LEN, "READ of the server's memory");
			reads++;
		} else {
			done++;
		}
	}
	while (outstanding > 0) {
		struct ibv_wc wc;

		ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS, "READ: %s", ibv_wc_status_str(wc.status));
		outstanding--;
	}
	CT_CHECK(reads == (MSGS + 7) / 8, "%u READs", reads);
	CT_OK(ibv_destroy_qp(qp));
	ct_pass();
	return 0;
}

static int client_killed(void)
{
	pid_t srv, cli[CLIENTS];
	uint64_t t_kill;
	char b;
	int fails = 0;

	CT_CHECK(pipe(info_pipe) == 0 && pipe(kill_pipe) == 0 && pipe(half_pipe) == 0, "pipe");
	srv = ct_fork_ready(stream_server, "the stream server (node 1)");
	for (int i = 0; i < CLIENTS; i++) {
		cli[i] = fork();
		CT_CHECK(cli[i] >= 0, "fork");
		if (cli[i] == 0) {
			client_id = i;
			_exit(stream_client());
		}
	}
	CT_CHECK(read(half_pipe[0], &b, 1) == 1, "the victim never got halfway");
	kill(cli[0], SIGKILL);
	t_kill = ct_now_ns();
	waitpid(cli[0], NULL, 0);
	CT_CHECK(write(kill_pipe[1], &t_kill, sizeof(t_kill)) == sizeof(t_kill), "kill time");
	for (int i = 1; i < CLIENTS; i++)
		fails += ct_wait_child(cli[i], "a surviving client");
	fails += ct_wait_child(srv, "the stream server");
	return fails;
}

/* ---- a server killed ----------------------------------------------------- */

static int server_node;
static int srv_info[2];		/* a server's memory, for the client */

static int plain_server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;

	ct_node_open(&n, server_node, NBUF * MSG_LEN, 256);
	qp = vqp(&n, 16, NBUF);
	ct_fill(n.b.p, n.b.len, 900 + (uint32_t)server_node);
	for (int i = 0; i < NBUF; i++)
		post_recv_at(qp, &n, (uint64_t)i, (size_t)i * MSG_LEN, MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(server_node), PORT + 50 + server_node));
	{
		uint64_t info[2] = { (uintptr_t)n.b.p, n.b.mr->rkey };

		CT_CHECK(write(srv_info[1], info, sizeof(info)) == sizeof(info), "info");
	}
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* Take messages (reposting) until killed. */
	for (;;) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		int k = qpop_msgs(qp, 16, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++)
			if (wc[i].status == IBV_WC_SUCCESS)
				post_recv_at(qp, &n, wc[i].wr_id, wc[i].wr_id * MSG_LEN, MSG_LEN);
		if (k == 0)
			usleep(1000);
	}
}

static pid_t start_server(int node, uint64_t info[2])
{
	server_node = node;
	pid_t p = ct_fork_ready(plain_server, "a server");

	CT_CHECK(read(srv_info[0], info, 2 * sizeof(uint64_t)) == 2 * sizeof(uint64_t), "info");
	return p;
}

static int go_pipe[2];		/* parent -> client: kill time, then "restarted" */
static int client_pipe[2];	/* client -> parent: streaming, then "refused" */

/* What the WR in flight when the peer died completes with, as on an RC
 * QP: RETRY_EXC_ERR when the peer no longer answers, REM_OP_ERR when its
 * QP was being torn down as the request came (rxe answers with a NAK),
 * WR_FLUSH_ERR when another VQP's WR met the error first. */
static int peer_death_status(enum ibv_wc_status s)
{
	return s == IBV_WC_RETRY_EXC_ERR || s == IBV_WC_REM_OP_ERR || s == IBV_WC_WR_FLUSH_ERR;
}

/* The `outstanding` WRs behind the first error all complete flushed. */
static void expect_all_fail(struct ibv_cq *cq, int outstanding, const char *what)
{
	while (outstanding > 0) {
		struct ibv_wc wc;

		CT_CHECK(poll_within(cq, &wc, DEATH_BOUND_MS), "%s: %d WRs never completed", what, outstanding);
		outstanding--;
		CT_CHECK(wc.status == IBV_WC_WR_FLUSH_ERR, "%s: status %s", what, ibv_wc_status_str(wc.status));
	}
}

static int killed_client(void)
{
	struct ct_node n;
	struct ibv_cq *idle_rcq;
	struct ibv_qp *busy, *idle, *again;
	uint64_t info6[2], info9[2], t_kill;
	int outstanding = 0;
	uint32_t sent = 0;
	double busy_ms, recv_ms, idle_ms;
	char b;

	ct_begin("vqp_faults: a server killed");
	close(go_pipe[1]);
	close(client_pipe[0]);
	ct_node_open(&n, 7, 64 * MSG_LEN, 256);
	CT_CHECK(read(go_pipe[0], info6, sizeof(info6)) == sizeof(info6), "info 6");
	CT_CHECK(read(go_pipe[0], info9, sizeof(info9)) == sizeof(info9), "info 9");
	busy = vqp(&n, 64, 4);
	/* The idle VQP's receives complete into a CQ of their own. */
	idle_rcq = CT_PTR(ibv_create_cq(n.d.ctx, 16, NULL, NULL, 0));
	idle = ct_create_vqp(&n.d, n.scq, idle_rcq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);
	CT_OK(qconnect(busy, ct_node_gid(6), PORT + 56));
	CT_OK(qconnect(idle, ct_node_gid(9), PORT + 59));
	for (int i = 0; i < 4; i++) {
		post_recv_at(busy, &n, 100 + (uint64_t)i, 32 * MSG_LEN, MSG_LEN);
		post_recv_at(idle, &n, 200 + (uint64_t)i, 40 * MSG_LEN, MSG_LEN);
	}
	/* Stream until the first error completion (the servers were killed
	 * meanwhile): posting stops there. */
	CT_CHECK(write(client_pipe[1], "S", 1) == 1, "streaming");
	t_kill = 0;
	for (;;) {
		struct ibv_wc wc;
		struct pollfd pfd = { go_pipe[0], POLLIN, 0 };

		while (outstanding < 32) {
			size_t slot = (sent % 16) * MSG_LEN;
			int send = sent % 4 != 0;

			fill_msg(n.b.p + slot, 7, sent);
			CT_OK(post_at(busy, &n, sent, send ? IBV_WR_SEND : IBV_WR_RDMA_READ,
				      slot + (send ? 0 : 16 * MSG_LEN), MSG_LEN, info6[0], (uint32_t)info6[1]));
			outstanding++;
			sent++;
		}
		if (t_kill == 0 && poll(&pfd, 1, 0) == 1)
			CT_CHECK(read(go_pipe[0], &t_kill, sizeof(t_kill)) == sizeof(t_kill), "kill time");
		if (!poll_within(n.scq, &wc, 100)) {
			CT_CHECK(t_kill == 0 || ms_since(t_kill) < DEATH_BOUND_MS + 5000, "no error completion");
			continue;
		}
		outstanding--;
		if (wc.status == IBV_WC_SUCCESS)
			continue;
		CT_CHECK(peer_death_status(wc.status), "busy VQP: %s", ibv_wc_status_str(wc.status));
		if (t_kill == 0)
			CT_CHECK(read(go_pipe[0], &t_kill, sizeof(t_kill)) == sizeof(t_kill), "kill time");
		busy_ms = ms_since(t_kill);
		break;
	}
	/* The busy VQP: everything outstanding ends in error, then its
	 * receives are flushed. */
	expect_all_fail(n.scq, outstanding, "busy VQP");
	{
		int flushed = 0;

		while (flushed < 4) {
			struct ibv_wc wc;

			CT_CHECK(poll_within(n.rcq, &wc, DEATH_BOUND_MS), "busy VQP: receives not flushed");
			CT_CHECK(wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id >= 100 && wc.wr_id < 104,
				 "busy VQP receive: %s, wr_id %llu", ibv_wc_status_str(wc.status),
				 (unsigned long long)wc.wr_id);
			flushed++;
		}
		recv_ms = ms_since(t_kill);
	}
	/* The idle VQP: nothing was posted on its link; the probe finds the
	 * peer gone and its receives are flushed. */
	{
		int flushed = 0;

		idle_ms = -1;
		while (flushed < 4) {
			struct ibv_wc wc;

			CT_CHECK(poll_within(idle_rcq, &wc, DEATH_BOUND_MS + 2000), "idle VQP: receives not flushed");
			CT_CHECK(wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id >= 200 && wc.wr_id < 204,
				 "idle VQP receive: %s", ibv_wc_status_str(wc.status));
			if (idle_ms < 0)
				idle_ms = ms_since(t_kill);
			flushed++;
		}
	}
	ct_note("after SIGKILL of the servers: first error completion of the busy VQP %.0f ms, its receives flushed by %.0f ms, the idle VQP's receives flushed %.0f ms (probe every %d ms)",
		busy_ms, recv_ms, idle_ms, PROBE_MS);
	CT_CHECK(busy_ms < DEATH_BOUND_MS && idle_ms < DEATH_BOUND_MS, "beyond the bound");
	/* In error: a post is accepted and flushed, as on an RC QP. */
	CT_OK(post_at(busy, &n, 77, IBV_WR_SEND, 0, MSG_LEN, 0, 0));
	{
		struct ibv_wc wc;

		ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.wr_id == 77 && wc.status == IBV_WC_WR_FLUSH_ERR, "post in error: %s",
			 ibv_wc_status_str(wc.status));
		post_recv_at(idle, &n, 299, 40 * MSG_LEN, MSG_LEN);
		ct_poll_n(idle_rcq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.wr_id == 299 && wc.status == IBV_WC_WR_FLUSH_ERR, "receive in error: %s",
			 ibv_wc_status_str(wc.status));
	}
	CT_OK(ibv_destroy_qp(busy));
	CT_OK(ibv_destroy_qp(idle));
	ct_expect_quiet(n.scq, 100, "nothing more from the dead links");
	ct_pass();

	ct_begin("vqp_faults: qconnect after a server died");
	again = vqp(&n, 4, 1);
	{
		int rc = qconnect(again, ct_node_gid(6), PORT + 56);

		CT_CHECK(rc == ECONNREFUSED, "qconnect to the dead server: %d (%s)", rc, strerror(rc));
	}
	CT_CHECK(write(client_pipe[1], "R", 1) == 1, "refused");
	CT_CHECK(read(go_pipe[0], &b, 1) == 1, "new server");
	CT_CHECK(read(go_pipe[0], info6, sizeof(info6)) == sizeof(info6), "new info");
	CT_OK(qconnect(again, ct_node_gid(6), PORT + 56));
	fill_msg(n.b.p, 7, 4242);
	CT_OK(post_at(again, &n, 1, IBV_WR_SEND, 0, MSG_LEN, 0, 0));
	CT_OK(post_at(again, &n, 2, IBV_WR_RDMA_READ, MSG_LEN, MSG_LEN, info6[0] + MSG_LEN, (uint32_t)info6[1]));
	{
		struct ibv_wc wc[2];
		uint8_t want[NBUF * MSG_LEN];

		ct_poll_n(n.scq, wc, 2, CT_TIMEOUT_MS);
		CT_CHECK(wc[0].status == IBV_WC_SUCCESS && wc[1].status == IBV_WC_SUCCESS,
			 "new server: %s, %s", ibv_wc_status_str(wc[0].status), ibv_wc_status_str(wc[1].status));
		ct_fill(want, sizeof(want), 906);
		ct_expect_bytes(n.b.p + MSG_LEN, want + MSG_LEN, MSG_LEN, "READ of the new server");
	}
	ct_pass();
	return 0;
}

static int server_killed(void)
{
	pid_t s6, s9, c;
	uint64_t info[2], t_kill;
	char b;
	int fails = 0;

	CT_CHECK(pipe(srv_info) == 0 && pipe(go_pipe) == 0 && pipe(client_pipe) == 0, "pipe");
	s6 = start_server(6, info);
	c = fork();
	CT_CHECK(c >= 0, "fork");
	if (c == 0)
		_exit(killed_client());
	close(go_pipe[0]);
	close(client_pipe[1]);
	CT_CHECK(write(go_pipe[1], info, sizeof(info)) == sizeof(info), "info 6");
	s9 = start_server(9, info);
	CT_CHECK(write(go_pipe[1], info, sizeof(info)) == sizeof(info), "info 9");
	CT_CHECK(read(client_pipe[0], &b, 1) == 1, "the client never streamed");
	kill(s6, SIGKILL);
	kill(s9, SIGKILL);
	t_kill = ct_now_ns();
	waitpid(s6, NULL, 0);
	waitpid(s9, NULL, 0);
	CT_CHECK(write(go_pipe[1], &t_kill, sizeof(t_kill)) == sizeof(t_kill), "kill time");
	CT_CHECK(read(client_pipe[0], &b, 1) == 1, "the client never saw the refusal");
	s6 = start_server(6, info);
	CT_CHECK(write(go_pipe[1], "N", 1) == 1 && write(go_pipe[1], info, sizeof(info)) == sizeof(info),
		 "restarted");
	fails += ct_wait_child(c, "the client of the killed servers");
	kill(s6, SIGKILL);
	waitpid(s6, NULL, 0);
	return fails;
}

int main(void)
{
	pid_t meta_pid;
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library. */
	setenv("KRCORE_META_LEASE_MS", "1500", 1);
	setenv("KRCORE_LINK_PROBE_MS", "500", 1);
	ct_watchdog(300);
	meta_pid = ct_start_meta();
	fails += client_killed();
	fails += server_killed();
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
