/*
 * qpop_msgs when a sender dies: nothing lost, never blocked (issue 18,
 * item 4). Several processes on several emulated nodes, krcore-meta here.
 *
 * A server bound on node 1 posts receives and takes nothing yet. Two
 * surviving senders (nodes 2, 3) and a victim (node 4) each send M1
 * messages, all acknowledged by the server's link (so the server holds
 * them), before the victim is killed with SIGKILL. Once the server took
 * the victim for gone (its link failed, or, a link the victim never
 * confirmed, the meta server said its connection closed), the server starts taking
 * messages with qpop_msgs while the survivors send M2 more each and a new
 * sender (node 5) connects (its link handshake runs meanwhile) and sends
 * M3. Checked: every message of the survivors and the new sender exactly
 * once, in order, byte for byte; every message the victim had sent (all
 * acknowledged) too, then its src_qp reported closed once
 * (IBV_WC_WR_FLUSH_ERR); a SEND posted on the victim's src_qp is accepted
 * and flushed at once (a VQP in error); no qpop_msgs call fails, and none
 * takes longer than POP_BOUND_MS (the longest is reported).
 *
 * Before the fix, qpop_msgs made a link to the victim for its src_qp (a
 * handshake to a dead process: 2 s, then ETIMEDOUT) and dropped the
 * messages it had popped in that call, other senders' included.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5700
#define MSG_LEN 64
#define NBUF 256
#define WINDOW 16
#define M1 40		/* each of the 3 first senders, before the kill */
#define M2 200		/* each survivor, after */
#define M3 100		/* the new sender */
#define VICTIM 2
#define NEWCOMER 3
#define SENDERS 4
#define POP_BOUND_MS 250
#define DEATH_BOUND_MS 15000

static int kill_pipe[2];	/* parent -> server: the victim is dead */
static int pop_pipe[2];		/* server -> parent: taking messages now */
static int acked_pipe[2];	/* senders -> parent: the first M1 acknowledged */
static int go_pipe[2][2];	/* parent -> each survivor: send the rest */
static int sender_id;

static double ms_since(uint64_t t0)
{
	return (double)(ct_now_ns() - t0) / 1e6;
}

static uint32_t total_of(int id)
{
	return id == VICTIM ? M1 : id == NEWCOMER ? M3 : M1 + M2;
}

static int server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp, *srcs[SENDERS] = { 0 };
	uint32_t next[SENDERS] = { 0 };
	int victim_closed = 0, flushed_reply = 0, pops = 0, failures = 0;
	double max_ms = 0, reply_ms = 0;
	uint64_t t_start;
	char b;

	ct_begin("vqp_popmsgs: senders, one killed (server)");
	ct_node_open(&n, 1, NBUF * MSG_LEN, 256);
	qp = ct_node_vqp(&n, 16, NBUF);
	for (int i = 0; i < NBUF; i++)
		ct_post_recv1(qp, (uint64_t)i, &n.b, (size_t)i * MSG_LEN, MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	/* The victim is dead; wait until it is taken for gone (our link to
	 * it failed: the probe and RC's retries; a link it never confirmed
	 * may fail because it gave its handshake up, so its meta-server
	 * connection is asked about then), polling only the send CQ
	 * (progress of the links' send queues, no message taken). */
	CT_CHECK(read(kill_pipe[0], &b, 1) == 1, "kill");
	t_start = ct_now_ns();
	while (krcore_stat_get(KRCORE_STAT_PEERS_GONE) < 1) {
		struct ibv_wc wc;

		CT_CHECK(ibv_poll_cq(n.scq, 1, &wc) == 0, "a send completion");
		CT_CHECK(ms_since(t_start) < DEATH_BOUND_MS, "the killed sender never taken for gone");
		usleep(2000);
	}
	ct_note("the killed sender taken for gone %.0f ms after the kill (%llu link(s) failed, %llu presence queries)",
		ms_since(t_start), (unsigned long long)krcore_stat_get(KRCORE_STAT_LINKS_FAILED),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_PRESENCE_QUERIES));
	CT_CHECK(write(pop_pipe[1], "P", 1) == 1, "popping");

	t_start = ct_now_ns();
	while (!victim_closed || next[0] < total_of(0) || next[1] < total_of(1) || next[NEWCOMER] < total_of(NEWCOMER)) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		uint64_t t0 = ct_now_ns();
		int k = qpop_msgs(qp, 16, src, wc);
		double ms = ms_since(t0);

		pops++;
		if (ms > max_ms)
			max_ms = ms;
		CT_CHECK(ms_since(t_start) < 60000, "not done after 60 s: %u %u %u %u, victim closed %d", next[0],
			 next[1], next[2], next[3], victim_closed);
		if (k < 0) {
			/* Counted, and the test goes on: what was lost shows. */
			printf("qpop_msgs failed: %d (%s) after %.0f ms\n", k, strerror(-k), ms);
			failures++;
			continue;
		}
		for (int i = 0; i < k; i++) {
			uint32_t id, seq;
			uint8_t *p;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				/* The victim's, or a survivor that went at the end. */
				if (src[i] == srcs[VICTIM]) {
					CT_CHECK(!victim_closed, "the victim reported closed twice");
					CT_CHECK(next[VICTIM] == M1, "the victim closed after %u of its %u messages",
						 next[VICTIM], M1);
					victim_closed = 1;
				}
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN, "message: %s, %u bytes",
				 ibv_wc_status_str(wc[i].status), wc[i].byte_len);
			CT_CHECK(wc[i].wr_id < NBUF, "wr_id %llu", (unsigned long long)wc[i].wr_id);
			p = n.b.p + wc[i].wr_id * MSG_LEN;
			memcpy(&id, p, 4);
			memcpy(&seq, p + 4, 4);
			CT_CHECK(id < SENDERS, "sender id %u", id);
			CT_CHECK(srcs[id] == NULL || srcs[id] == src[i], "sender %u changed src_qp", id);
			srcs[id] = src[i];
			/* Exactly once, in order: no gap, no duplicate. */
			CT_CHECK(seq == next[id], "sender %u: message %u, expected %u", id, seq, next[id]);
			ct_expect_msg(p, MSG_LEN, id, seq);
			next[id]++;
			ct_post_recv1(qp, wc[i].wr_id, &n.b, wc[i].wr_id * MSG_LEN, MSG_LEN);
			if (id == VICTIM && !flushed_reply) {
				/* Its src_qp is in error: a post is accepted and
				 * flushed, without waiting for anything. */
				struct ibv_wc rwc;
				uint64_t t1 = ct_now_ns();

				CT_OK(ct_post_send1(src[i], 77, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, 0, MSG_LEN, 0, 0, 0));
				ct_poll_n(n.scq, &rwc, 1, CT_TIMEOUT_MS);
				reply_ms = ms_since(t1);
				CT_CHECK(rwc.wr_id == 77 && rwc.status == IBV_WC_WR_FLUSH_ERR, "reply to the victim: %s",
					 ibv_wc_status_str(rwc.status));
				flushed_reply = 1;
			}
		}
	}
	ct_note("%d qpop_msgs calls, the longest %.2f ms (bound %d ms); a SEND to the dead sender flushed in %.2f ms; %u + %u + %u + %u messages",
		pops, max_ms, POP_BOUND_MS, reply_ms, next[0], next[1], next[2], next[3]);
	CT_CHECK(failures == 0, "%d qpop_msgs calls failed", failures);
	CT_CHECK(flushed_reply, "no message of the victim");
	CT_CHECK(max_ms < POP_BOUND_MS, "a qpop_msgs call took %.0f ms", max_ms);
	ct_pass();
	return 0;
}

static int sender(void)
{
	uint32_t id = (uint32_t)sender_id;
	int node = 2 + sender_id;
	struct ct_node n;
	struct ibv_qp *qp;
	uint32_t sent = 0, done = 0, first = id == NEWCOMER ? M3 : M1;
	char b;

	ct_begin(id == VICTIM ? "vqp_popmsgs: the sender to kill" : "vqp_popmsgs: a sender");
	ct_node_open(&n, node, WINDOW * MSG_LEN, 256);
	qp = ct_node_vqp(&n, WINDOW, 1);
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	for (int phase = 0; phase < 2; phase++) {
		uint32_t upto = phase == 0 ? first : total_of((int)id);

		while (done < upto) {
			struct ibv_wc wc;

			while (sent < upto && sent - done < WINDOW) {
				size_t slot = (sent % WINDOW) * MSG_LEN;

				ct_fill_msg(n.b.p + slot, MSG_LEN, id, sent);
				CT_OK(ct_post_send1(qp, sent, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, slot, MSG_LEN, 0, 0,
						    0));
				sent++;
			}
			ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
			CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == done, "sender %u: wr %llu: %s", id,
				 (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
			done++;
		}
		if (phase == 0 && id != NEWCOMER) {
			/* All acknowledged: the server holds them. */
			CT_CHECK(write(acked_pipe[1], "A", 1) == 1, "acked");
			if (id == VICTIM)
				for (;;)
					pause(); /* until killed */
			CT_CHECK(read(go_pipe[id][0], &b, 1) == 1, "go");
		}
		if (id == NEWCOMER)
			break;
	}
	CT_OK(ibv_destroy_qp(qp));
	ct_pass();
	return 0;
}

static pid_t start_sender(int id)
{
	pid_t p = fork();

	CT_CHECK(p >= 0, "fork");
	if (p == 0) {
		sender_id = id;
		_exit(sender());
	}
	return p;
}

int main(void)
{
	pid_t meta_pid, srv, s[SENDERS];
	int fails = 0;
	char b;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library. */
	setenv("KRCORE_META_LEASE_MS", "1500", 1);
	setenv("KRCORE_LINK_PROBE_MS", "500", 1);
	ct_watchdog(180);
	meta_pid = ct_start_meta();
	CT_CHECK(pipe(kill_pipe) == 0 && pipe(pop_pipe) == 0 && pipe(acked_pipe) == 0 && pipe(go_pipe[0]) == 0 &&
			 pipe(go_pipe[1]) == 0,
		 "pipe");
	srv = ct_fork_ready(server, "the server (node 1)");
	for (int i = 0; i <= VICTIM; i++)
		s[i] = start_sender(i);
	for (int i = 0; i <= VICTIM; i++)
		CT_CHECK(read(acked_pipe[0], &b, 1) == 1, "a sender never got its first messages acknowledged");
	kill(s[VICTIM], SIGKILL);
	waitpid(s[VICTIM], NULL, 0);
	CT_CHECK(write(kill_pipe[1], "K", 1) == 1, "killed");
	CT_CHECK(read(pop_pipe[0], &b, 1) == 1, "the server never started taking messages");
	/* The survivors send the rest while the server takes messages, and
	 * a new sender's link is made meanwhile. */
	CT_CHECK(write(go_pipe[0][1], "G", 1) == 1 && write(go_pipe[1][1], "G", 1) == 1, "go");
	s[NEWCOMER] = start_sender(NEWCOMER);
	for (int i = 0; i < SENDERS; i++)
		if (i != VICTIM)
			fails += ct_wait_child(s[i], "a sender");
	fails += ct_wait_child(srv, "the server");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
