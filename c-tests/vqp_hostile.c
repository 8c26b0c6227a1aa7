/*
 * The trust boundary (issue 20) against a real stack: a hostile process
 * next to honest ones, several processes on several emulated nodes,
 * krcore-meta here.
 *
 * A server bound on node 1 echoes every message through its src_qp. An
 * honest client on node 2 streams checked echoes with it while
 * krcore-hostile (target/release, or KRCORE_HOSTILE_BIN), on node 3 with
 * a service endpoint of its own, sends the server's service UD QP 20,000
 * datagrams: random bytes, link requests with random fields (naming
 * processes that do not exist), and link requests with random bits
 * flipped; then one well-formed link request naming the honest client
 * (found at its own binding); then it binds the server's address to the
 * server's own endpoint at krcore-meta and unbinds it; then it binds an
 * address of its own to the honest client's endpoint with the VQPN of the
 * client's connected VQP, and a process on node 3 qconnects there and
 * SENDs to that VQP: over the datagram tier (refused: its first SEND
 * fails with RETRY_EXC_ERR, once the tier gave up on a process the meta
 * server says lives: its retries and up to 10 s more) and over a link (KRCORE_DGRAM=0: the link
 * delivers them, the client drops them; before the fix they landed in
 * the client's receive buffers). Before the injector, krcore-hostile
 * sends 2,000 datagrams of the datagram tier to the server and to the
 * honest client (`tier`): bytes behind a valid tier prefix, DATA on the
 * pair's route written as either end's (sequence numbers in and far out
 * of the window), ACKs of each end's flow, READ/WRITE/atomics with
 * guessed rkeys and out-of-range or misaligned addresses (on the pair's
 * route and on fresh routes of its own), and bit-flipped copies: none may
 * be served (what comes back is counted: refusals only), and both count
 * what they dropped (dgram_dropped, dgram_refused). Then 120 malformed or
 * out-of-order connections to krcore-meta (`meta-garbage`: truncated,
 * oversized, other-version, random and bit-flipped Hello/Query, a Bind
 * in their place, a Bind after a Query, a Query after a Hello), its
 * honest queries checked throughout; its descriptors come back.
 * The honest client sees nothing but latency
 * (every echo once, in order, byte for byte; its one link never
 * replaced; the server never takes it for gone); afterwards a new client
 * on node 4 binds a VQP (its incarnation and VQPN public), krcore-hostile
 * writes the routes of its next 8 VQPs to the server on the tier
 * (`tier-squat`), and it connects with one of them, echoes and gets its
 * link, within a bound: the server still accepts links, and a route
 * written first by a stranger is not the stranger's (before the fix the
 * route was whoever's sent first, and the client's packets on it were
 * dropped). The server counts the forged and malformed link messages it
 * dropped and never holds more than KRCORE_MAX_PEER_LINKS links for the
 * hostile process (before the fix: 471 links opened, and the new client
 * linked 4.4 s after its qconnect).
 *
 * Measured (rxe under QEMU, three runs): the tier's 2,000 in 4-7 s, 99-109
 * requests refused and none served, 820-872 datagrams dropped at the
 * server and 983-993 at the client (most others lost to the UD receive
 * queues); krcore-meta's slowest honest query 43-78 ms among the garbage,
 * 12 descriptors before and 10-11 after; the new client linked 185-294 ms
 * after its qconnect; the whole test 46-72 s (the 20,000 link datagrams
 * take 37 s of it; under the suite's 120 s per process).
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5600
#define MSG_LEN 64
#define NBUF 32
#define QUIT 0x51554954u
#define GARBAGE "20000"
/* A new client's link after the attack, under emulation. */
#define LINK_BOUND_MS 10000
/* SENDs the injector makes over its link to the honest client's VQP. */
#define INJECT 50
#define INJECT_PORT (PORT + 4)
/* The new client's bound VQP (its incarnation and VQPN made public). */
#define LATE_PORT (PORT + 6)
/* How long the datagram tier waits for a process the meta server vouches
 * for once its retries ran out (LIVE_BOUND_US). */
#define LIVE_BOUND_MS 10000
/* Datagrams of the tier's forgeries, and connections to krcore-meta. */
#define TIER "2000"
#define META_CONNS "120"
/* The whole test's bound (the server and the honest client live through
 * all of it). */
#define WATCHDOG_S 300

static int attack_pipe[2];	/* the parent: the attack is over */
static int stats_pipe[2];	/* the server's counters, for the parent */
static int vqpn_pipe[2];	/* the honest client's VQPN, for the parent */
static int refused_pipe[2];	/* the honest client's msgs_refused */
static int late_pipe[2];	/* the new client: bound, its routes written */
static int squat_pipe[2];

static struct ibv_qp *vqp(struct ct_node *n)
{
	return ct_node_vqp(n, 16, NBUF);
}

static int server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	struct ibv_qp *quit[2] = { 0 };
	int quits = 0;
	uint64_t st[7], most = 0;

	ct_begin("vqp_hostile: the server");
	ct_node_open(&n, 1, 2 * NBUF * MSG_LEN, 256);
	qp = vqp(&n);
	for (int i = 0; i < NBUF; i++)
		ct_post_recv1(qp, (uint64_t)i, &n.b, (size_t)i * MSG_LEN, MSG_LEN);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	/* It serves through the whole attack, longer than a sub-test's budget
	 * (after ct_node_open, which arms the watchdog too). */
	ct_watchdog(WATCHDOG_S);
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* Both clients end with a QUIT. */
	while (quits < 2) {
		struct ibv_qp *src[8];
		struct ibv_wc wc[8];
		int k = qpop_msgs(qp, 8, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		if (krcore_stat_get(KRCORE_STAT_LINKS) > most)
			most = krcore_stat_get(KRCORE_STAT_LINKS);
		for (int i = 0; i < k; i++) {
			uint8_t *in = n.b.p + wc[i].wr_id * MSG_LEN;
			uint8_t *out = n.b.p + (NBUF + wc[i].wr_id) * MSG_LEN;
			struct ibv_wc sw;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
				/* A client's VQP went: only after its QUIT (a
				 * forged link request must not take a client for
				 * gone). */
				CT_CHECK(src[i] == quit[0] || src[i] == quit[1], "a client's src_qp closed before its QUIT");
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN, "message: %s, %u bytes",
				 ibv_wc_status_str(wc[i].status), wc[i].byte_len);
			memcpy(out, in, MSG_LEN);
			if (*(uint32_t *)in == QUIT)
				quit[quits++] = src[i];
			CT_OK(ct_post_send1(src[i], wc[i].wr_id, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b,
					    (NBUF + wc[i].wr_id) * MSG_LEN, MSG_LEN, 0, 0, 0));
			ct_poll_n(n.scq, &sw, 1, CT_TIMEOUT_MS);
			CT_CHECK(sw.status == IBV_WC_SUCCESS, "echo: %s", ibv_wc_status_str(sw.status));
			ct_post_recv1(qp, wc[i].wr_id, &n.b, wc[i].wr_id * MSG_LEN, MSG_LEN);
		}
	}
	st[0] = krcore_stat_get(KRCORE_STAT_LINK_MSGS_DROPPED);
	st[1] = most;
	st[2] = krcore_stat_get(KRCORE_STAT_LINKS_OPENED);
	st[3] = krcore_stat_get(KRCORE_STAT_LINKS_REFUSED);
	st[4] = krcore_stat_get(KRCORE_STAT_DGRAM_DROPPED);
	st[5] = krcore_stat_get(KRCORE_STAT_DGRAM_REFUSED);
	st[6] = krcore_stat_get(KRCORE_STAT_DGRAM_FLOWS);
	ct_oob_write(stats_pipe[1], st, sizeof(st));
	ct_pass();
	return 0;
}

/* One checked echo of message `seq` of client `id`; its round trip, µs. */
static double echo(struct ct_node *n, struct ibv_qp *qp, uint32_t id, uint32_t seq)
{
	uint64_t t0 = ct_now_ns();
	struct ibv_wc wc;

	ct_post_recv1(qp, 1, &n->b, MSG_LEN, MSG_LEN);
	ct_fill_msg(n->b.p, MSG_LEN, id, seq);
	if (seq == QUIT)
		*(uint32_t *)n->b.p = QUIT;
	CT_OK(ct_post_send1(qp, 2, IBV_WR_SEND, IBV_SEND_SIGNALED, &n->b, 0, MSG_LEN, 0, 0, 0));
	ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "client %u: SEND %u: %s", id, seq, ibv_wc_status_str(wc.status));
	ct_poll_n(n->rcq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == MSG_LEN, "client %u: echo %u: %s, %u bytes", id, seq,
		 ibv_wc_status_str(wc.status), wc.byte_len);
	if (seq == QUIT)
		CT_CHECK(*(uint32_t *)(n->b.p + MSG_LEN) == QUIT, "the QUIT's echo");
	else
		ct_expect_msg(n->b.p + MSG_LEN, MSG_LEN, id, seq);
	return (double)(ct_now_ns() - t0) / 1e3;
}

/* The honest client: echoes until the attack is over, then for two link
 * probe periods more (KRCORE_LINK_PROBE_MS, 1 s): a link made for a forged
 * request in its name would have failed its probe by then, and the
 * server taken it for gone. */
static int honest(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint32_t seq = 0;
	uint64_t over = 0;
	double worst = 0;
	char b;

	ct_begin("vqp_hostile: an honest client during the attack");
	CT_CHECK(fcntl(attack_pipe[0], F_SETFL, O_NONBLOCK) == 0, "fcntl");
	ct_node_open(&n, 2, 2 * MSG_LEN, 64);
	qp = vqp(&n);
	CT_OK(qbind(ct_node_vqp(&n, 1, 1), ct_node_gid(2), PORT + 2));
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	echo(&n, qp, 2, seq++);
	ct_oob_write(vqpn_pipe[1], &qp->qp_num, sizeof(qp->qp_num));
	ct_watchdog(WATCHDOG_S);
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	while (!over || ct_now_ns() - over < 2000000000ull) {
		double us = echo(&n, qp, 2, seq++);

		worst = us > worst ? us : worst;
		if (!over && read(attack_pipe[0], &b, 1) == 1)
			over = ct_now_ns();
	}
	echo(&n, qp, 2, QUIT);
	ct_note("%u echoes during and after the attack, every one checked; the slowest %.0f us", seq, worst);
	{
		uint64_t refused = krcore_stat_get(KRCORE_STAT_MSGS_REFUSED);
		uint64_t opened = krcore_stat_get(KRCORE_STAT_LINKS_OPENED);
		uint64_t out[2] = { refused, krcore_stat_get(KRCORE_STAT_DGRAM_DROPPED) };

		ct_oob_write(refused_pipe[1], out, sizeof(out));
		/* Every SEND of the link, and the tier's (each retransmission). */
		CT_CHECK(refused >= INJECT + 1, "only %llu injected messages refused", (unsigned long long)refused);
		/* Its one link to the server was never replaced (a forged
		 * request for it made no second one that closed the first); the
		 * others are the injectors' (the one on the tier may exit before
		 * its link is made). */
		CT_CHECK(opened == 2 || opened == 3, "links_opened %llu: 1 to the server and 1 or 2 injectors' expected",
			 (unsigned long long)opened);
	}
	ct_pass();
	return 0;
}

/* A new client once the attack is over: it connects, echoes and gets its
 * link (the server still accepts links). It binds a VQP first, which
 * makes its incarnation and VQPN public: krcore-hostile then writes the
 * routes of its next VQPs to the server on the tier (tier-squat); the
 * VQP it connects with is one of them. */
static int newcomer(void)
{
	struct ct_node n;
	struct ibv_qp *qp, *bound;
	uint64_t t0;
	double ms;
	char b;

	ct_begin("vqp_hostile: a new client after the attack");
	ct_node_open(&n, 4, 2 * MSG_LEN, 64);
	bound = ct_node_vqp(&n, 1, 1);
	CT_OK(qbind(bound, ct_node_gid(4), LATE_PORT));
	CT_CHECK(write(late_pipe[1], "B", 1) == 1, "bound");
	CT_CHECK(read(squat_pipe[0], &b, 1) == 1, "its routes written");
	qp = vqp(&n);
	/* Its VQPN is one whose route krcore-hostile wrote first. */
	CT_CHECK(qp->qp_num > bound->qp_num && qp->qp_num <= bound->qp_num + 8, "VQPN %#x, bound %#x: not squatted",
		 qp->qp_num, bound->qp_num);
	t0 = ct_now_ns();
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	for (uint32_t i = 0; i < 3; i++)
		echo(&n, qp, 4, i);
	while (krcore_stat_get(KRCORE_STAT_LINKS) < 1 && (double)(ct_now_ns() - t0) / 1e6 < LINK_BOUND_MS)
		echo(&n, qp, 4, 3);
	ms = (double)(ct_now_ns() - t0) / 1e6;
	CT_CHECK(krcore_stat_get(KRCORE_STAT_LINKS) >= 1, "no link to the server %.0f ms after qconnect", ms);
	ct_note("connected, echoed and linked %.0f ms after qconnect", ms);
	echo(&n, qp, 4, QUIT);
	ct_pass();
	return 0;
}

/* The injector (node 3, this program run again with "inject"): qconnect to
 * the address krcore-hostile bound to the honest client's VQP, and SEND to
 * it. `tier`: on the datagram tier, whose first SEND must fail (nothing
 * acknowledges it; the client's meta-server connection says it lives, so
 * it is waited for up to the tier's bound, LIVE_BOUND_MS after its
 * retries ran out); else over a link, each SEND acknowledged by the link
 * and dropped by the client. */
static int inject(int tier)
{
	struct ct_node n;
	struct ibv_qp *qp;
	struct ibv_wc wc;
	int sends = tier ? 1 : INJECT;

	ct_begin(tier ? "vqp_hostile: SENDs to another's connected VQP, on the datagram tier"
		      : "vqp_hostile: SENDs to another's connected VQP, over a link");
	ct_node_open(&n, 3, MSG_LEN, 64);
	qp = vqp(&n);
	CT_OK(qconnect(qp, ct_node_gid(3), INJECT_PORT));
	for (int i = 0; i < sends; i++) {
		ct_fill_msg(n.b.p, MSG_LEN, 9, (uint32_t)i);
		CT_OK(ct_post_send1(qp, (uint64_t)i, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, 0, MSG_LEN, 0, 0, 0));
		ct_poll_n(n.scq, &wc, 1, tier ? LIVE_BOUND_MS + CT_TIMEOUT_MS : CT_TIMEOUT_MS);
		if (tier)
			CT_CHECK(wc.status == IBV_WC_RETRY_EXC_ERR, "a SEND on the tier to another's VQP: %s",
				 ibv_wc_status_str(wc.status));
		else
			CT_CHECK(wc.status == IBV_WC_SUCCESS, "SEND %d over the link: %s", i, ibv_wc_status_str(wc.status));
	}
	if (tier)
		ct_note("its SEND failed with RETRY_EXC_ERR; no link was made");
	else
		ct_note("%d SENDs acknowledged by the link", sends);
	if (!tier)
		CT_KRCORE_STAT(KRCORE_STAT_LINKS, ==, 1);
	ct_pass();
	return 0;
}

/* krcore-hostile bind-as, holding the honest client's VQP `vqpn` at
 * (node 3, INJECT_PORT) while the injector runs, on the tier and then
 * over a link. */
static int run_injector(uint32_t vqpn)
{
	static char path[4096], self[4096];
	const char *bin = ct_release_bin("KRCORE_HOSTILE_BIN", "krcore-hostile", path, sizeof(path));
	char gid[64], port[16], vq[16], line[256];
	int in[2], out[2], failed = 0;
	ssize_t len;
	pid_t pid;
	FILE *f;

	CT_CHECK(inet_ntop(AF_INET6, ct_node_gid(2).raw, gid, sizeof(gid)) != NULL, "inet_ntop");
	snprintf(port, sizeof(port), "%d", PORT + 2);
	snprintf(vq, sizeof(vq), "%u", vqpn);
	CT_CHECK(pipe(in) == 0 && pipe(out) == 0, "pipe");
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		char ip[16];

		snprintf(ip, sizeof(ip), "%d", INJECT_PORT);
		dup2(in[0], 0);
		dup2(out[1], 1);
		close(in[1]);
		close(out[0]);
		execl(bin, "krcore-hostile", "--meta", getenv("KRCORE_META"), "--device", getenv("CT_DEVICE"),
		      "--gid-index", "3", "--gid", gid, "--port", port, "bind-as", ip, vq, (char *)NULL);
		_exit(127);
	}
	close(in[0]);
	close(out[1]);
	f = fdopen(out[0], "r");
	CT_CHECK(f && fgets(line, sizeof(line), f) && strstr(line, "bind-as bound"), "krcore-hostile bind-as (%s)", bin);
	len = readlink("/proc/self/exe", self, sizeof(self) - 1);
	CT_CHECK(len > 0, "readlink");
	self[len] = 0;
	for (int tier = 1; tier >= 0; tier--) {
		pid_t child = fork();

		CT_CHECK(child >= 0, "fork");
		if (child == 0) {
			setenv("KRCORE_DGRAM", tier ? "1" : "0", 1);
			execl(self, "vqp_hostile", tier ? "inject-tier" : "inject-link", (char *)NULL);
			_exit(127);
		}
		failed |= ct_wait_child(child, tier ? "the injector on the tier" : "the injector over a link");
	}
	close(in[1]);
	CT_CHECK(waitpid(pid, NULL, 0) == pid, "waitpid");
	fclose(f);
	return failed;
}

/* krcore-hostile on node 3 against the server's endpoint: the action and
 * its arguments (NULL-terminated). Its `hostile: ...` line goes to `line`
 * (and the log). */
static void run_hostile(char *line, size_t len, const char *const *action)
{
	static char path[4096];
	const char *bin = ct_release_bin("KRCORE_HOSTILE_BIN", "krcore-hostile", path, sizeof(path));
	const char *argv[24] = { "krcore-hostile", "--meta", getenv("KRCORE_META"), "--device", getenv("CT_DEVICE"),
				 "--gid-index", "3", "--gid", NULL, "--port", NULL };
	char gid[64], port[16];
	int out[2], status, argc = 11;
	uint64_t t0 = ct_now_ns();
	pid_t pid;
	FILE *f;

	CT_CHECK(inet_ntop(AF_INET6, ct_node_gid(1).raw, gid, sizeof(gid)) != NULL, "inet_ntop");
	snprintf(port, sizeof(port), "%d", PORT);
	argv[8] = gid;
	argv[10] = port;
	while (*action && argc < 23)
		argv[argc++] = *action++;
	argv[argc] = NULL;
	CT_CHECK(pipe(out) == 0, "pipe");
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		dup2(out[1], 1);
		close(out[0]);
		execv(bin, (char *const *)argv);
		_exit(127);
	}
	close(out[1]);
	f = fdopen(out[0], "r");
	line[0] = 0;
	CT_CHECK(f && fgets(line, (int)len, f), "krcore-hostile %s: no output", argv[11]);
	line[strcspn(line, "\n")] = 0;
	fclose(f);
	CT_CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	ct_note("%s (%.1f s)", line, (double)(ct_now_ns() - t0) / 1e9);
	CT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "krcore-hostile (%s) failed: status %#x", bin, status);
}

/* Open descriptors of process `pid`. */
static int fds_of(pid_t pid)
{
	char dir[64];
	struct dirent *e;
	DIR *d;
	int n = 0;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
	d = opendir(dir);
	CT_CHECK(d != NULL, "opendir %s", dir);
	while ((e = readdir(d)) != NULL)
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

int main(int argc, char **argv)
{
	pid_t meta, srv, cli, late;
	uint64_t st[7], refused[2];
	uint32_t vqpn;
	int failed = 0, fds0, fds1;
	char line[1024], gid2[64], port2[16], vq[16];

	if (argc == 2 && (!strcmp(argv[1], "inject-tier") || !strcmp(argv[1], "inject-link")))
		_exit(inject(!strcmp(argv[1], "inject-tier")));
	ct_watchdog(WATCHDOG_S);
	if (!getenv("CT_DEVICE"))
		setenv("CT_DEVICE", "rxe0", 1);
	meta = ct_start_meta();
	CT_CHECK(pipe(attack_pipe) == 0 && pipe(stats_pipe) == 0 && pipe(vqpn_pipe) == 0 && pipe(refused_pipe) == 0 &&
			 pipe(late_pipe) == 0 && pipe(squat_pipe) == 0,
		 "pipe");
	srv = ct_fork_ready(server, "the server (node 1)");
	cli = ct_fork_ready(honest, "the honest client (node 2)");
	ct_begin("vqp_hostile: 20,000 forged and malformed datagrams to the server");
	ct_watchdog(WATCHDOG_S);
	run_hostile(line, sizeof(line), (const char *const[]){ "garbage", GARBAGE, NULL });
	/* A link request that names the honest client, from node 3. */
	CT_CHECK(inet_ntop(AF_INET6, ct_node_gid(2).raw, gid2, sizeof(gid2)) != NULL, "inet_ntop");
	snprintf(port2, sizeof(port2), "%d", PORT + 2);
	run_hostile(line, sizeof(line), (const char *const[]){ "forge-request", gid2, port2, NULL });
	/* Its binding taken over and withdrawn at the meta server, with the
	 * server's own (public) endpoint: refused, the new client finds it. */
	run_hostile(line, sizeof(line), (const char *const[]){ "steal-binding", NULL });
	ct_oob_read(vqpn_pipe[0], &vqpn, sizeof(vqpn));
	/* The datagram tier's forgeries, to the server and to the honest
	 * client, naming their connection: none may be served. */
	snprintf(vq, sizeof(vq), "%#x", vqpn);
	run_hostile(line, sizeof(line), (const char *const[]){ "tier", TIER, gid2, port2, vq, NULL });
	CT_CHECK(strstr(line, "served 0,") != NULL, "a forged one-sided request was served: %s", line);
	/* Malformed boot traffic at krcore-meta, its honest queries answered
	 * throughout (checked by krcore-hostile); its descriptors come back. */
	fds0 = fds_of(meta);
	run_hostile(line, sizeof(line), (const char *const[]){ "meta-garbage", META_CONNS, NULL });
	failed |= run_injector(vqpn);
	CT_CHECK(write(attack_pipe[1], "D", 1) == 1, "attack over");
	late = fork();
	CT_CHECK(late >= 0, "fork");
	if (late == 0)
		_exit(newcomer());
	{
		/* The new client's next VQPs' routes, written first. */
		char gid4[64], port4[16];
		char b;

		CT_CHECK(read(late_pipe[0], &b, 1) == 1, "the new client bound");
		CT_CHECK(inet_ntop(AF_INET6, ct_node_gid(4).raw, gid4, sizeof(gid4)) != NULL, "inet_ntop");
		snprintf(port4, sizeof(port4), "%d", LATE_PORT);
		run_hostile(line, sizeof(line), (const char *const[]){ "tier-squat", gid4, port4, "8", NULL });
		CT_CHECK(write(squat_pipe[1], "S", 1) == 1, "squatted");
	}
	failed |= ct_wait_child(late, "the new client");
	failed |= ct_wait_child(cli, "the honest client");
	{
		/* krcore-meta drops what it held for the garbage (a connection
		 * owing its Hello goes after 2 s): within a bound. */
		uint64_t t0 = ct_now_ns();

		while ((fds1 = fds_of(meta)) > fds0 + 2 && ct_now_ns() - t0 < 10000000000ull)
			usleep(10000);
		ct_note("krcore-meta: %d descriptors before the garbage, %d after", fds0, fds1);
		CT_CHECK(fds1 <= fds0 + 2, "krcore-meta holds %d descriptors, %d before the garbage", fds1, fds0);
	}
	ct_oob_read(refused_pipe[0], refused, sizeof(refused));
	ct_note("the honest client dropped %llu messages to its VQP (the injector's, the tier's forgeries) and %llu "
		"datagrams of the tier", (unsigned long long)refused[0], (unsigned long long)refused[1]);
	ct_oob_read(stats_pipe[0], st, sizeof(st));
	failed |= ct_wait_child(srv, "the server");
	ct_note("the server dropped %llu link messages, refused %llu link requests, held %llu links at most, "
		"opened %llu in all", (unsigned long long)st[0], (unsigned long long)st[3], (unsigned long long)st[1],
		(unsigned long long)st[2]);
	ct_note("the server dropped %llu datagrams of the tier, refused %llu one-sided requests, holds %llu flows",
		(unsigned long long)st[4], (unsigned long long)st[5], (unsigned long long)st[6]);
	CT_CHECK(st[4] >= 1 && st[5] >= 1 && refused[1] >= 1, "forged datagrams of the tier not counted");
	/* Most datagrams never reach it (its UD receive queue overflows, as
	 * any UD receiver's does); of 13,333 forged or malformed link
	 * messages sent, far more than this many do. */
	CT_CHECK(st[0] >= 1000, "only %llu forged or malformed link messages counted", (unsigned long long)st[0]);
	/* The honest clients' two, and at most KRCORE_MAX_PEER_LINKS (4) at a
	 * time for the hostile process (its links fail at their first probe,
	 * so it gets a few more over the run, never more at once). */
	CT_CHECK(st[1] <= 2 + 4, "the server held %llu links at once", (unsigned long long)st[1]);
	kill(meta, SIGTERM);
	waitpid(meta, NULL, 0);
	if (!failed)
		ct_pass();
	return failed;
}
