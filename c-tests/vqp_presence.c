/*
 * A silent peer that binds nothing (issue 21): whether it lives is asked
 * of the meta server (is the process's own connection to it open? the
 * kernel closes it when the process dies), not guessed from its past
 * traffic. Several processes on emulated nodes, krcore-meta here.
 *
 * A server bound on node 1; two clients that bind nothing (nodes 2, 3)
 * each send one message, which the server takes with qpop_msgs (a src_qp
 * per client). Every process keeps its VQPs on the datagram tier
 * (KRCORE_LINK_AFTER huge: no RC link, whose retries would answer for the
 * peer first): what is tested is how the tier finds out about a peer.
 *
 * 1. "a killed client is gone at once": client A is killed (SIGKILL). The
 *    server's SEND on A's src_qp runs out of the tier's retries (about
 *    2 s); the meta server says A's connection closed: the SEND fails
 *    IBV_WC_RETRY_EXC_ERR within PROMPT_MS, A is taken for gone
 *    (peers_gone + 1; peers_vouched unchanged; a presence query made),
 *    and qpop_msgs reports A's src_qp closed (IBV_WC_WR_FLUSH_ERR).
 *    Before: A had sent to the server within 10 s, so it was vouched for,
 *    and the SEND failed about 10 s after the retries ran out (the race
 *    vqp_popmsgs met when a sender was killed before its link was
 *    confirmed).
 * 2. "a stopped client is waited for": client B is stopped (SIGSTOP) for
 *    STOP_MS, twice the tier's retries; its connection stays open, so it
 *    is vouched for (peers_vouched + 1) and the SEND is waited for: it
 *    lands once B runs again (B checks the bytes), nobody is taken for
 *    gone.
 * 3. "a requester that never confirms its link and lives": krcore-hostile
 *    (node 4) asks the server for a link from its own endpoint and never
 *    confirms it (an RC QPN nobody holds), its meta-server connection
 *    open. The server's accepted link fails (its probe, RC's retries);
 *    the server asks the meta server (presence_queries + 1), which vouches
 *    for the requester (peers_vouched + 1): not taken for gone.
 * 4. "a requester killed during its handshake is gone": the same, the
 *    requester killed (SIGKILL) once it asked: when the link fails, the
 *    meta server says its connection closed: taken for gone (peers_gone
 *    + 1), not vouched for. Before, an unconfirmed link's failure never
 *    took its peer for gone.
 * 5. "a killed attached client is gone at once": client C (node 5)
 *    attached to a krcore-node agent on its GID has no meta-server
 *    connection of its own; the agent vouches for it (its statistics:
 *    vouched 1), and once C is killed says it departed (its pidfd:
 *    departed 1). The server's SEND to C fails IBV_WC_RETRY_EXC_ERR
 *    within PROMPT_MS, C taken for gone, as in case 1. Before (stop 41),
 *    an attached process was unknown to the meta server: the SEND failed
 *    only at the tier's 10 s bound (C had sent within 10 s).
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5800
#define MSG_LEN 64
#define A 0
#define B 1
#define C 2
#define C_NODE 5
/* The tier's retries (about 2 s) and a presence query, with room. */
#define PROMPT_MS 6000
#define STOP_MS 4000
/* An idle link's probe (every second) and RC's retries (about 3.8 s). */
#define LINK_FAIL_MS 15000

static int to_parent[2];	/* server -> parent: a step is done */
static int to_server[2];	/* parent -> server: the next step may go */
static int go_b[2];		/* parent -> B: take the server's reply */
static int client_id;

static void step_done(int fd, char c)
{
	CT_CHECK(write(fd, &c, 1) == 1, "pipe write");
}

static void step_wait(int fd, char want)
{
	char c = 0;

	CT_CHECK(read(fd, &c, 1) == 1 && c == want, "pipe read: got '%c', wanted '%c'", c, want);
}

/* One message (or close report) taken with qpop_msgs, waited for until
 * `until` (ns, ct_now_ns's clock). */
static void pop1(struct ibv_qp *qp, uint64_t until, struct ibv_qp **src, struct ibv_wc *wc, const char *what)
{
	int k;

	while ((k = qpop_msgs(qp, 1, src, wc)) == 0) {
		CT_CHECK(ct_now_ns() < until, "%s: nothing within the bound", what);
		usleep(1000);
	}
	CT_CHECK(k == 1, "qpop_msgs (%s): %d", what, k);
}

/* The server's reply `seq` (sender id 9), SENT on a client's src_qp. */
static void post_reply(struct ct_node *n, struct ibv_qp *src, uint64_t wr_id, uint32_t seq)
{
	size_t off = (2 + seq) * MSG_LEN;

	ct_fill_msg(n->b.p + off, MSG_LEN, 9, seq);
	CT_OK(ct_post_send1(src, wr_id, IBV_WR_SEND, IBV_SEND_SIGNALED, &n->b, off, MSG_LEN, 0, 0, 0));
}

/* The server's reply `seq` SENT to a killed `who` on `src` fails
 * IBV_WC_RETRY_EXC_ERR within PROMPT_MS (the tier's retries and a
 * presence query), `who` taken for gone, not vouched for; how long it took. */
static double send_to_killed(struct ct_node *n, struct ibv_qp *src, uint64_t wr_id, uint32_t seq, const char *who)
{
	uint64_t gone = krcore_stat_get(KRCORE_STAT_PEERS_GONE);
	uint64_t vouched = krcore_stat_get(KRCORE_STAT_PEERS_VOUCHED);
	uint64_t t0 = ct_now_ns();
	struct ibv_wc wc;
	double ms;

	post_reply(n, src, wr_id, seq);
	ct_poll_n(n->scq, &wc, 1, 3 * PROMPT_MS);
	ms = (double)(ct_now_ns() - t0) / 1e6;
	CT_CHECK(wc.wr_id == wr_id && wc.status == IBV_WC_RETRY_EXC_ERR, "the SEND to a killed %s: %s", who,
		 ibv_wc_status_str(wc.status));
	CT_CHECK(ms < PROMPT_MS, "the SEND to a killed %s failed after %.0f ms", who, ms);
	CT_KRCORE_STAT(KRCORE_STAT_PEERS_GONE, ==, gone + 1);
	CT_KRCORE_STAT(KRCORE_STAT_PEERS_VOUCHED, ==, vouched);
	return ms;
}

/* Wait (bounded) until counter `stat` is above `above`; how long it took. */
static double wait_above(enum krcore_stat stat, uint64_t above, struct ct_node *n, int ms)
{
	uint64_t t0 = ct_now_ns();
	struct ibv_wc wc;

	while (krcore_stat_get(stat) <= above) {
		CT_CHECK(ibv_poll_cq(n->scq, 1, &wc) == 0, "a send completion");
		CT_CHECK(ct_now_ns() - t0 < (uint64_t)ms * 1000000ull, "%s still %llu after %d ms",
			 krcore_stat_name(stat), (unsigned long long)above, ms);
		usleep(2000);
	}
	return (double)(ct_now_ns() - t0) / 1e6;
}

/* Cases 3 and 4 on the server's side: a half-made link from
 * krcore-hostile fails; `alive` says whether its requester lives. */
static void half_link(struct ct_node *n, int alive)
{
	uint64_t failed = krcore_stat_get(KRCORE_STAT_LINKS_FAILED);
	uint64_t gone = krcore_stat_get(KRCORE_STAT_PEERS_GONE);
	uint64_t vouched = krcore_stat_get(KRCORE_STAT_PEERS_VOUCHED);
	uint64_t asked = krcore_stat_get(KRCORE_STAT_PRESENCE_QUERIES);
	double ms;

	step_done(to_parent[1], 'h');
	step_wait(to_server[0], 'L');
	ms = wait_above(KRCORE_STAT_LINKS_FAILED, failed, n, LINK_FAIL_MS);
	wait_above(KRCORE_STAT_PRESENCE_QUERIES, asked, n, CT_TIMEOUT_MS);
	if (alive) {
		wait_above(KRCORE_STAT_PEERS_VOUCHED, vouched, n, CT_TIMEOUT_MS);
		CT_KRCORE_STAT(KRCORE_STAT_PEERS_GONE, ==, gone);
	} else {
		wait_above(KRCORE_STAT_PEERS_GONE, gone, n, CT_TIMEOUT_MS);
		CT_KRCORE_STAT(KRCORE_STAT_PEERS_VOUCHED, ==, vouched);
	}
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, failed + 1);
	ct_note("the unconfirmed link failed %.0f ms after it was asked for; its requester %s", ms,
		alive ? "vouched for" : "taken for gone");
}

static int server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp, *src[2] = { 0 };
	struct ibv_wc wc;

	ct_begin("vqp_presence: the server");
	/* Receives in slots 0, 1 (A, B) and 5 (C); replies in 2 + seq. */
	ct_node_open(&n, 1, 6 * MSG_LEN, 64);
	qp = ct_node_vqp(&n, 4, 4);
	for (int i = 0; i < 2; i++)
		ct_post_recv1(qp, (uint64_t)i, &n.b, (size_t)i * MSG_LEN, MSG_LEN);
	ct_post_recv1(qp, 5, &n.b, 5 * MSG_LEN, MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	step_done(ready_fd, 'R');
	close(ready_fd);
	{
		uint64_t until = ct_now_ns() + (uint64_t)CT_TIMEOUT_MS * 1000000ull;

		for (int got = 0; got < 2; got++) {
			struct ibv_qp *s;
			uint32_t id;

			pop1(qp, until, &s, &wc, got == 0 ? "the first message" : "the second message");
			CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == MSG_LEN, "message: %s",
				 ibv_wc_status_str(wc.status));
			memcpy(&id, n.b.p + wc.wr_id * MSG_LEN, 4);
			CT_CHECK(id < 2 && !src[id], "client %u", id);
			ct_expect_msg(n.b.p + wc.wr_id * MSG_LEN, MSG_LEN, id, 0);
			src[id] = s;
		}
	}
	ct_pass();
	step_done(to_parent[1], 'M');

	ct_begin("vqp_presence: a killed client is gone at once");
	step_wait(to_server[0], 'K');
	{
		uint64_t asked = krcore_stat_get(KRCORE_STAT_PRESENCE_QUERIES);
		double ms = send_to_killed(&n, src[A], 70, 0, "client");

		CT_KRCORE_STAT(KRCORE_STAT_PRESENCE_QUERIES, >, asked);
		/* Its src_qp is reported closed once. */
		{
			struct ibv_qp *s;

			pop1(qp, ct_now_ns() + (uint64_t)CT_TIMEOUT_MS * 1000000ull, &s, &wc,
			     "the killed client's src_qp reported closed");
			CT_CHECK(s == src[A] && wc.status == IBV_WC_WR_FLUSH_ERR, "qpop_msgs after the kill: %s",
				 ibv_wc_status_str(wc.status));
		}
		ct_note("the SEND to the killed client failed after %.0f ms (%llu presence queries)", ms,
			(unsigned long long)(krcore_stat_get(KRCORE_STAT_PRESENCE_QUERIES) - asked));
	}
	ct_pass();
	step_done(to_parent[1], 'A');

	ct_begin("vqp_presence: a stopped client is waited for");
	step_wait(to_server[0], 'S');
	{
		uint64_t gone = krcore_stat_get(KRCORE_STAT_PEERS_GONE);
		uint64_t vouched = krcore_stat_get(KRCORE_STAT_PEERS_VOUCHED);
		uint64_t t0 = ct_now_ns();

		post_reply(&n, src[B], 71, 1);
		/* Out of retries, asked about, vouched for. */
		CT_KRCORE_STAT_WITHIN(KRCORE_STAT_PEERS_VOUCHED, >, vouched);
		while (ct_now_ns() - t0 < (uint64_t)STOP_MS * 1000000ull) {
			CT_CHECK(ibv_poll_cq(n.scq, 1, &wc) == 0, "the SEND completed while its peer was stopped: %s",
				 ibv_wc_status_str(wc.status));
			usleep(10000);
		}
		step_done(to_parent[1], 'C');
		ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.wr_id == 71 && wc.status == IBV_WC_SUCCESS, "the SEND to a client stopped for %d ms: %s",
			 STOP_MS, ibv_wc_status_str(wc.status));
		CT_KRCORE_STAT(KRCORE_STAT_PEERS_GONE, ==, gone);
		ct_note("a SEND to a client stopped for %d ms completed %.0f ms after it was posted", STOP_MS,
			(double)(ct_now_ns() - t0) / 1e6);
	}
	ct_pass();

	ct_begin("vqp_presence: a requester that never confirms its link and lives");
	step_wait(to_server[0], 'H');
	half_link(&n, 1);
	step_done(to_parent[1], 'v');
	ct_pass();
	ct_begin("vqp_presence: a requester killed during its handshake is gone");
	step_wait(to_server[0], 'H');
	half_link(&n, 0);
	ct_pass();

	ct_begin("vqp_presence: a killed attached client is gone at once");
	step_wait(to_server[0], 'P');
	{
		struct ibv_qp *s;
		double ms;
		uint32_t id;

		/* B's src_qp is reported closed first (B destroyed its VQP). */
		pop1(qp, ct_now_ns() + (uint64_t)CT_TIMEOUT_MS * 1000000ull, &s, &wc, "client B's close");
		CT_CHECK(s == src[B] && wc.status == IBV_WC_WR_FLUSH_ERR, "client B's close: %s",
			 ibv_wc_status_str(wc.status));
		pop1(qp, ct_now_ns() + (uint64_t)CT_TIMEOUT_MS * 1000000ull, &s, &wc, "the attached client's message");
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 5, "message: %s", ibv_wc_status_str(wc.status));
		memcpy(&id, n.b.p + 5 * MSG_LEN, 4);
		CT_CHECK(id == C, "client %u", id);
		ct_expect_msg(n.b.p + 5 * MSG_LEN, MSG_LEN, C, 0);
		step_done(to_parent[1], 'p');
		step_wait(to_server[0], 'K');
		ms = send_to_killed(&n, s, 72, 2, "attached client");
		ct_note("the SEND to the killed attached client failed after %.0f ms", ms);
	}
	ct_pass();
	return 0;
}

/* krcore-hostile half-link from node 4 against the server: its pid, once
 * it asked; *in is its stdin (closing it releases it), *out_f its stdout
 * (it says when it is released). */
static pid_t start_half_link(int *in, FILE **out_f)
{
	static char path[4096];
	const char *bin = ct_release_bin("KRCORE_HOSTILE_BIN", "krcore-hostile", path, sizeof(path));
	char gid[64], port[16], line[256];
	int out[2], inp[2];
	pid_t pid;
	FILE *f;

	CT_CHECK(inet_ntop(AF_INET6, ct_node_gid(1).raw, gid, sizeof(gid)) != NULL, "inet_ntop");
	snprintf(port, sizeof(port), "%d", PORT);
	CT_CHECK(pipe(out) == 0 && pipe(inp) == 0, "pipe");
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		dup2(out[1], 1);
		dup2(inp[0], 0);
		close(out[0]);
		close(inp[1]);
		execl(bin, "krcore-hostile", "--meta", getenv("KRCORE_META"), "--device", getenv("CT_DEVICE"),
		      "--gid-index", "4", "--gid", gid, "--port", port, "half-link", (char *)NULL);
		_exit(127);
	}
	close(out[1]);
	close(inp[0]);
	f = fdopen(out[0], "r");
	CT_CHECK(f && fgets(line, sizeof(line), f), "krcore-hostile half-link: no output");
	line[strcspn(line, "\n")] = 0;
	CT_CHECK(strstr(line, "half-link asked") != NULL, "krcore-hostile: %s", line);
	*in = inp[1];
	*out_f = f;
	return pid;
}

static int client(void)
{
	struct ct_node n;
	struct ibv_qp *qp;
	struct ibv_wc wc;

	ct_begin(client_id == A   ? "vqp_presence: client A (killed)"
		 : client_id == B ? "vqp_presence: client B (stopped)"
				  : "vqp_presence: client C (attached, killed)");
	ct_node_open(&n, client_id == C ? C_NODE : 2 + client_id, 2 * MSG_LEN, 16);
	qp = ct_node_vqp(&n, 1, 1);
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	ct_post_recv1(qp, 1, &n.b, MSG_LEN, MSG_LEN);
	ct_fill_msg(n.b.p, MSG_LEN, (uint32_t)client_id, 0);
	CT_OK(ct_post_send1(qp, 0, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, 0, MSG_LEN, 0, 0, 0));
	ct_poll_n(n.scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "the message: %s", ibv_wc_status_str(wc.status));
	if (client_id != B)
		for (;;)
			pause(); /* until killed */
	/* Stopped and continued meanwhile; the reply is ours then. */
	step_wait(go_b[0], 'G');
	ct_poll_n(n.rcq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == MSG_LEN, "the reply: %s", ibv_wc_status_str(wc.status));
	ct_expect_msg(n.b.p + MSG_LEN, MSG_LEN, 9, 1);
	CT_OK(ibv_destroy_qp(qp));
	ct_pass();
	return 0;
}

static pid_t start_client(int id)
{
	pid_t p = fork();

	CT_CHECK(p >= 0, "fork");
	if (p == 0) {
		client_id = id;
		_exit(client());
	}
	return p;
}

static char agent_sock[108];
static int agent_out = -1;

/* krcore-node for node C_NODE's GID at agent_sock, serving once its meta
 * server is connected. */
static pid_t start_agent(void)
{
	static char path[4096];
	char gi[8];
	char *argv[] = { (char *)ct_release_bin("KRCORE_NODE_BIN", "krcore-node", path, sizeof(path)), "--meta",
			 getenv("KRCORE_META"), "--socket", agent_sock, "--device", getenv("CT_DEVICE"),
			 "--gid-index", gi, NULL };

	snprintf(gi, sizeof(gi), "%d", C_NODE);
	snprintf(agent_sock, sizeof(agent_sock), "/tmp/krcore-vqp-presence-%d.sock", (int)getpid());
	return ct_spawn_ready(argv, "meta server connected", &agent_out);
}

/* Wait (bounded) until the agent's statistic `field` is at least `want`. */
static void agent_wait(pid_t agent, const char *field, long want)
{
	uint64_t t0 = ct_now_ns();
	long v;

	while ((v = ct_agent_stat(agent, agent_out, field)) < want) {
		CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "the agent's %s: %ld, want %ld",
			 field, v, want);
		usleep(20000);
	}
}

int main(void)
{
	pid_t meta_pid, srv, c[2];
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Every VQP stays on the datagram tier (read once per process). */
	setenv("KRCORE_LINK_AFTER", "1000000000", 1);
	ct_watchdog(180);
	meta_pid = ct_start_meta();
	CT_CHECK(pipe(to_parent) == 0 && pipe(to_server) == 0 && pipe(go_b) == 0, "pipe");
	srv = ct_fork_ready(server, "the server (node 1)");
	c[A] = start_client(A);
	c[B] = start_client(B);
	step_wait(to_parent[0], 'M');
	kill(c[A], SIGKILL);
	waitpid(c[A], NULL, 0);
	step_done(to_server[1], 'K');
	step_wait(to_parent[0], 'A');
	CT_CHECK(kill(c[B], SIGSTOP) == 0, "SIGSTOP");
	ct_wait_stopped(c[B]);
	step_done(to_server[1], 'S');
	step_wait(to_parent[0], 'C');
	CT_CHECK(kill(c[B], SIGCONT) == 0, "SIGCONT");
	step_done(go_b[1], 'G');
	fails += ct_wait_child(c[B], "client B");
	for (int alive = 1; alive >= 0; alive--) {
		char line[256];
		FILE *f;
		int in;
		pid_t h;

		step_done(to_server[1], 'H');
		step_wait(to_parent[0], 'h');
		h = start_half_link(&in, &f);
		if (!alive) {
			kill(h, SIGKILL);
			waitpid(h, NULL, 0);
		}
		step_done(to_server[1], 'L');
		if (alive) {
			/* Released once the server is done with it. */
			step_wait(to_parent[0], 'v');
			close(in);
			CT_CHECK(fgets(line, sizeof(line), f) && strstr(line, "half-link released"),
				 "krcore-hostile half-link not released");
			fails += ct_wait_child(h, "krcore-hostile half-link");
		} else {
			close(in);
		}
		fclose(f);
	}
	{
		pid_t agent = start_agent();

		/* C attaches (its first use of the library reads KRCORE_NODE). */
		setenv("KRCORE_NODE", agent_sock, 1);
		c[A] = start_client(C);
		unsetenv("KRCORE_NODE");
		step_done(to_server[1], 'P');
		step_wait(to_parent[0], 'p');
		agent_wait(agent, "vouched", 1);
		kill(c[A], SIGKILL);
		waitpid(c[A], NULL, 0);
		agent_wait(agent, "departed", 1);
		step_done(to_server[1], 'K');
		fails += ct_wait_child(srv, "the server");
		kill(agent, SIGTERM);
		waitpid(agent, NULL, 0);
		close(agent_out);
	}
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
