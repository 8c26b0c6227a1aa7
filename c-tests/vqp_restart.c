/*
 * A server killed and restarted on the same node, ROUNDS times in a row
 * (issue 18, item 8). krcore-meta here; the server on node 2, its client
 * on node 3.
 *
 * Each round: the client qconnects a new VQP to (node 2, PORT) -- after
 * the first round this is the server started after the previous one was
 * killed, its qbind returned: it must be reached (0, never ECONNREFUSED)
 * -- and streams SENDs, which the server checks byte for byte. The server
 * is killed with SIGKILL mid-stream; the client's streaming VQP completes
 * in error; a qconnect of another new VQP to the dead server's address is
 * refused (ECONNREFUSED: nothing is bound there); a new server process is
 * started on the same node and binds the address; next round.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5800
#define ROUNDS 12
#define MSG_LEN 64
#define NBUF 64
#define WINDOW 16

static int info_pipe[2];	/* server -> client: bound (its round) */
static int stream_pipe[2];	/* client -> parent: streaming / refused */
static int round_no;

static int server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint32_t next = 0;
	uint64_t t0;

	ct_node_open(&n, 2, NBUF * MSG_LEN, 256);
	qp = ct_node_vqp(&n, 16, NBUF);
	for (int i = 0; i < NBUF; i++)
		ct_post_recv1(qp, (uint64_t)i, &n.b, (size_t)i * MSG_LEN, MSG_LEN);
	/* The killed server's binding goes when the meta server sees its
	 * TCP connection close: until then the address is in use. */
	t0 = ct_now_ns();
	for (;;) {
		int rc = qbind(qp, ct_node_gid(2), PORT);

		if (rc == 0)
			break;
		CT_CHECK(rc == EADDRINUSE, "qbind: %d (%s)", rc, strerror(rc));
		CT_CHECK(ct_now_ns() - t0 < 10000000000ull, "still bound after 10 s");
		usleep(2000);
	}
	CT_CHECK(write(info_pipe[1], &round_no, sizeof(round_no)) == sizeof(round_no), "info");
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* Take messages (checked, reposting) until killed. */
	for (;;) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		int k = qpop_msgs(qp, 16, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			if (wc[i].status != IBV_WC_SUCCESS)
				continue;
			ct_expect_msg(n.b.p + wc[i].wr_id * MSG_LEN, MSG_LEN, (uint32_t)round_no, next);
			next++;
			ct_post_recv1(qp, wc[i].wr_id, &n.b, wc[i].wr_id * MSG_LEN, MSG_LEN);
		}
		if (k == 0)
			usleep(500);
	}
}

static int client(void)
{
	struct ct_node n;

	ct_begin("vqp_restart: qconnect after a server restart");
	ct_node_open(&n, 3, WINDOW * MSG_LEN, 256);
	for (int r = 0; r < ROUNDS; r++) {
		struct ibv_qp *q, *again;
		uint32_t sent = 0, ok = 0;
		int outstanding = 0, told = 0, rc, bound;
		/* Odd rounds leave the link idle when the server is killed. */
		int idle = r % 2 == 1;

		CT_CHECK(read(info_pipe[0], &bound, sizeof(bound)) == sizeof(bound), "server %d", r);
		CT_CHECK(bound == r, "server of round %d", bound);
		q = ct_node_vqp(&n, 2 * WINDOW, 1);
		rc = qconnect(q, ct_node_gid(2), PORT);
		CT_CHECK(rc == 0, "round %d: qconnect to the server just bound: %d (%s)", r, rc, strerror(rc));
		/* Stream until the first error (the server is killed once we
		 * say we stream, after WINDOW messages went through). */
		for (;;) {
			struct ibv_wc wc;

			while (outstanding < WINDOW) {
				size_t slot = (sent % WINDOW) * MSG_LEN;

				ct_fill_msg(n.b.p + slot, MSG_LEN, (uint32_t)r, sent);
				CT_OK(ct_post_send1(q, sent, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, slot, MSG_LEN, 0, 0, 0));
				outstanding++;
				sent++;
			}
			ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
			outstanding--;
			if (wc.status != IBV_WC_SUCCESS)
				break;
			if (++ok == WINDOW && !told) {
				/* An idle round: everything sent completes before
				 * the server may be killed. */
				while (idle && outstanding > 0) {
					ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
					CT_CHECK(wc.status == IBV_WC_SUCCESS, "round %d: %s", r,
						 ibv_wc_status_str(wc.status));
					outstanding--;
				}
				CT_CHECK(write(stream_pipe[1], "S", 1) == 1, "streaming");
				told = 1;
				if (idle)
					break;
			}
		}
		if (idle) {
			/* The link stays idle: the server dies unseen (until
			 * the probe), and the next round's server binds. */
			CT_OK(ibv_destroy_qp(q));
			CT_CHECK(write(stream_pipe[1], "R", 1) == 1, "next");
			continue;
		}
		CT_CHECK(told, "round %d: an error before the kill", r);
		while (outstanding > 0) {
			struct ibv_wc wc;

			ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
			CT_CHECK(wc.status != IBV_WC_SUCCESS, "round %d: a success after the error", r);
			outstanding--;
		}
		CT_OK(ibv_destroy_qp(q));
		again = ct_node_vqp(&n, 1, 1);
		rc = qconnect(again, ct_node_gid(2), PORT);
		CT_CHECK(rc == ECONNREFUSED, "round %d: qconnect to the dead server: %d (%s)", r, rc, strerror(rc));
		CT_OK(ibv_destroy_qp(again));
		CT_CHECK(write(stream_pipe[1], "R", 1) == 1, "refused");
	}
	ct_pass();
	return 0;
}

int main(void)
{
	pid_t meta_pid, c, srv;
	int fails = 0;
	char b;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library. */
	setenv("KRCORE_META_LEASE_MS", "1500", 1);
	setenv("KRCORE_LINK_PROBE_MS", "500", 1);
	ct_watchdog(240);
	meta_pid = ct_start_meta();
	CT_CHECK(pipe(info_pipe) == 0 && pipe(stream_pipe) == 0, "pipe");
	c = fork();
	CT_CHECK(c >= 0, "fork");
	if (c == 0)
		_exit(client());
	/* A client that failed closes the pipe: no wait on it then. */
	close(stream_pipe[1]);
	for (round_no = 0; round_no < ROUNDS; round_no++) {
		srv = ct_fork_ready(server, "a server (node 2)");
		if (read(stream_pipe[0], &b, 1) != 1) {
			kill(srv, SIGKILL);
			waitpid(srv, NULL, 0);
			break;
		}
		kill(srv, SIGKILL);
		waitpid(srv, NULL, 0);
		if (read(stream_pipe[0], &b, 1) != 1)
			break;
	}
	fails += ct_wait_child(c, "the client");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
