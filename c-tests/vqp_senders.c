/*
 * A bound VQP takes messages from a bounded number of senders (issue 20,
 * item 4: src_qps per claimed sender). Each new sender of a bound VQP
 * gets a src_qp at qpop_msgs, a VQP of the server's process, until it is
 * reported closed: a peer that invents VQPs would make the server make
 * one per VQP. With KRCORE_MAX_SENDERS_PER_GID=2 at the server (node 1):
 * a client on node 2 sends one message from each of three VQPs, one
 * after the other: the first two are taken, the third sender's message is
 * dropped and counted (senders_refused); a sender on node 3 is not held
 * up. Once one of the node-2 VQPs is destroyed (reported closed at the
 * server), the third sender's next message is taken. Every message taken
 * is checked byte for byte; the refused one never shows.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5800
#define MSG_LEN 64
#define NBUF 16
#define PER_GID 2

static int taken_pipe[2];	/* server -> parent: phase 1 seen / closed seen */
static int go_pipe[2];		/* parent -> client: destroy, send again */
static int done_pipe[2];	/* parent -> clients: exit */

/* Pop until `want` messages and `closed` closed senders were reported;
 * every message checked; ids counted in got[]. */
static void pop_until(struct ibv_qp *qp, struct ct_node *n, int want, int closed, uint32_t got[4][2])
{
	uint64_t t0 = ct_now_ns();
	int msgs = 0, gone = 0;

	while (msgs < want || gone < closed) {
		struct ibv_qp *src[4];
		struct ibv_wc wc[4];
		int k = qpop_msgs(qp, 4, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		CT_CHECK(ct_now_ns() - t0 < 30ull * 1000000000, "%d of %d messages, %d of %d closed after 30 s", msgs, want,
			 gone, closed);
		for (int i = 0; i < k; i++) {
			uint32_t id, seq;
			uint8_t *p;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				gone++;
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN, "message: %s",
				 ibv_wc_status_str(wc[i].status));
			p = n->b.p + wc[i].wr_id * MSG_LEN;
			memcpy(&id, p, 4);
			memcpy(&seq, p + 4, 4);
			CT_CHECK(id < 4 && seq < 2, "id %u seq %u", id, seq);
			ct_expect_msg(p, MSG_LEN, id, seq);
			got[id][seq]++;
			msgs++;
			ct_post_recv1(qp, wc[i].wr_id, &n->b, wc[i].wr_id * MSG_LEN, MSG_LEN);
		}
		if (k == 0)
			usleep(500);
	}
}

static int server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint32_t got[4][2] = { { 0 } };

	ct_begin("vqp_senders: a bound VQP takes at most its senders per GID");
	ct_node_open(&n, 1, NBUF * MSG_LEN, 64);
	qp = ct_node_vqp(&n, 8, NBUF);
	for (int i = 0; i < NBUF; i++)
		ct_post_recv1(qp, (uint64_t)i, &n.b, (size_t)i * MSG_LEN, MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	/* Node 2's senders 0 and 1, node 3's sender 3; sender 2 refused. */
	pop_until(qp, &n, 3, 0, got);
	for (uint64_t t0 = ct_now_ns(); krcore_stat_get(KRCORE_STAT_SENDERS_REFUSED) < 1;) {
		CT_CHECK(ct_now_ns() - t0 < 30ull * 1000000000, "nothing refused");
		usleep(1000);
	}
	CT_CHECK(got[0][0] == 1 && got[1][0] == 1 && got[3][0] == 1 && got[2][0] == 0, "taken: %u %u %u, refused one %u",
		 got[0][0], got[1][0], got[3][0], got[2][0]);
	CT_CHECK(write(taken_pipe[1], "1", 1) == 1, "phase 1");
	/* Sender 0 closed: room for sender 2's next message. */
	pop_until(qp, &n, 0, 1, got);
	CT_CHECK(write(taken_pipe[1], "2", 1) == 1, "closed");
	pop_until(qp, &n, 1, 0, got);
	CT_CHECK(got[2][1] == 1 && got[2][0] == 0, "sender 2: its second message taken, its first never");
	ct_note("taken: 4 messages of 4 senders; refused: %llu message(s) of a third sender of one GID (bound %d)",
		(unsigned long long)krcore_stat_get(KRCORE_STAT_SENDERS_REFUSED), PER_GID);
	CT_CHECK(krcore_stat_get(KRCORE_STAT_SENDERS_REFUSED) == 1, "one refused");
	ct_pass();
	return 0;
}

static void send_one(struct ct_node *n, struct ibv_qp *qp, uint32_t id, uint32_t seq)
{
	struct ibv_wc wc;

	ct_fill_msg(n->b.p, MSG_LEN, id, seq);
	CT_OK(ct_post_send1(qp, id, IBV_WR_SEND, IBV_SEND_SIGNALED, &n->b, 0, MSG_LEN, 0, 0, 0));
	ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "send %u.%u: %s", id, seq, ibv_wc_status_str(wc.status));
}

/* Node 2: senders 0, 1, 2 one after the other; then sender 0 goes and
 * sender 2 sends again. */
static int client2(void)
{
	struct ct_node n;
	struct ibv_qp *qp[3];
	char b;

	ct_begin("vqp_senders: three senders of one GID");
	ct_node_open(&n, 2, MSG_LEN, 16);
	for (uint32_t i = 0; i < 3; i++) {
		qp[i] = ct_node_vqp(&n, 4, 1);
		CT_OK(qconnect(qp[i], ct_node_gid(1), PORT));
		send_one(&n, qp[i], i, 0);
	}
	CT_CHECK(read(go_pipe[0], &b, 1) == 1, "go");
	CT_OK(ibv_destroy_qp(qp[0]));
	CT_CHECK(read(go_pipe[0], &b, 1) == 1, "go again");
	send_one(&n, qp[2], 2, 1);
	CT_CHECK(read(done_pipe[0], &b, 1) == 1, "done");
	ct_pass();
	return 0;
}

/* Node 3: one sender, after node 2's three. */
static int client3(void)
{
	struct ct_node n;
	struct ibv_qp *qp;
	char b;

	ct_begin("vqp_senders: a sender of another GID");
	ct_node_open(&n, 3, MSG_LEN, 16);
	qp = ct_node_vqp(&n, 4, 1);
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	send_one(&n, qp, 3, 0);
	CT_CHECK(read(done_pipe[0], &b, 1) == 1, "done");
	ct_pass();
	return 0;
}

static pid_t start(int (*role)(void))
{
	pid_t p = fork();

	CT_CHECK(p >= 0, "fork");
	if (p == 0)
		_exit(role());
	return p;
}

int main(void)
{
	pid_t meta_pid, srv, c2, c3;
	int fails = 0;
	char b;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library. */
	setenv("KRCORE_MAX_SENDERS_PER_GID", "2", 1);
	ct_watchdog(120);
	meta_pid = ct_start_meta();
	CT_CHECK(pipe(taken_pipe) == 0 && pipe(go_pipe) == 0 && pipe(done_pipe) == 0, "pipe");
	srv = ct_fork_ready(server, "the server (node 1)");
	c2 = start(client2);
	c3 = start(client3);
	CT_CHECK(read(taken_pipe[0], &b, 1) == 1, "the server never took the first messages");
	CT_CHECK(write(go_pipe[1], "G", 1) == 1, "go");
	CT_CHECK(read(taken_pipe[0], &b, 1) == 1, "the server never saw the sender close");
	CT_CHECK(write(go_pipe[1], "G", 1) == 1, "go again");
	fails += ct_wait_child(srv, "the server");
	CT_CHECK(write(done_pipe[1], "DD", 2) == 2, "done");
	fails += ct_wait_child(c2, "the node-2 client");
	fails += ct_wait_child(c3, "the node-3 client");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
