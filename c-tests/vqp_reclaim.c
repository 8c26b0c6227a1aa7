/*
 * Link reclaim: KRCORE_MAX_LINKS and the duplicate links of simultaneous
 * connects, several processes on several emulated nodes, krcore-meta
 * started here on node 1.
 *
 * "lru reclaim": 4 servers (nodes 2-5) bound at a port each; a client on
 * node 6 with KRCORE_MAX_LINKS=2 has 2 VQPs to each server and, round
 * after round, posts a burst of SENDs and a READ on every VQP, server
 * after server, without waiting: making the link to the next server
 * closes the least recently used one, often with WQEs of the burst still
 * on it (LINK_CLOSE is then a fence behind them). Every server gets every
 * message of every VQP exactly once, in order, byte for byte, across the
 * link changes, and answers each; the client checks every answer and
 * READ, that links were closed and made again, and that it holds at most
 * KRCORE_MAX_LINKS links once the closes are done. It runs twice: with
 * KRCORE_DGRAM=0 (every VQP needs a link: links are closed and made again
 * every round), and with KRCORE_DGRAM=1, where a VQP whose link is not made (the
 * client is at its limit) stays on the datagram tier: the tier carries
 * work, no link fails, the limit holds.
 *
 * "readers keep their links": a server (node 2, KRCORE_MAX_LINKS=2, bound)
 * and 3 clients (nodes 3-5, KRCORE_DGRAM=0: each needs its link, which the
 * server accepts beyond its limit; an optional link, asked from the
 * datagram tier, it would refuse) that only READ its memory, each as fast
 * as it can, every READ checked. The server posts nothing on their links, so by
 * its own posts all 3 are idle, one over its limit; what it sees of its
 * readers is its QPs' receive PSNs. While they read, over 8 of its
 * maintenance passes (counted by its probes), it closes none of their
 * links, and no reader opens a second one; once they stop (alive, idle:
 * only their probes) it closes one within a bound and holds 2.
 *
 * "simultaneous connects": two processes (nodes 7, 8), each bound at a
 * port, connect 4 VQPs to each other at the same moment with
 * KRCORE_LINKS_PER_PEER=4, so that both make the link of an index at once
 * (each request accepted by the other: two links). Twice: with
 * KRCORE_DGRAM=0 (each qconnect makes its link: the requests cross every
 * time) and on the datagram tier (each VQP asks at its first completion:
 * they cross when both ask within a handshake's time). Messages flow both
 * ways, checked. Crossing requests make one link (the lower
 * incarnation's; with KRCORE_DGRAM=0: exactly 4 opened, none closed); a
 * duplicate made anyway (a request that came after the other side's link
 * was made) is closed (both sides keep the same one), leaving exactly 4
 * links in each process (within the timeout: the links are asked for at
 * each VQP's first completion on the datagram tier); more messages flow
 * after the closes, checked.
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5600

/* The lru case's mode (datagram tier or not) and its servers' base port. */
static int lru_tier, lru_port;
#define MSG_LEN 64
#define NBUF 64

static struct ibv_qp *vqp(struct ct_node *n, uint32_t sq, uint32_t rq)
{
	return ct_node_vqp(n, sq, rq);
}

static void post_recv_at(struct ibv_qp *qp, struct ct_node *n, uint64_t wr_id, size_t off)
{
	ct_post_recv1(qp, wr_id, &n->b, off, MSG_LEN);
}

static void post_at(struct ibv_qp *qp, struct ct_node *n, uint64_t wr_id, enum ibv_wr_opcode op,
		    size_t off, uint64_t raddr, uint32_t rkey)
{
	CT_OK(ct_post_send1(qp, wr_id, op, IBV_SEND_SIGNALED, &n->b, off, MSG_LEN, raddr, rkey, 0));
}

static void fill_msg(uint8_t *p, uint32_t id, uint32_t seq)
{
	ct_fill_msg(p, MSG_LEN, id, seq);
}

static void expect_msg(const uint8_t *p, uint32_t id, uint32_t seq)
{
	ct_expect_msg(p, MSG_LEN, id, seq);
}

static unsigned long long kstat(enum krcore_stat s)
{
	return krcore_stat_get(s);
}

/* Wait (bounded) until the links gauge is at most `max`; its value. */
static unsigned long long links_settle(unsigned long long max, int timeout_ms)
{
	uint64_t t0 = ct_now_ns();

	while (kstat(KRCORE_STAT_LINKS) > max && ct_now_ns() - t0 < (uint64_t)timeout_ms * 1000000ull)
		usleep(2000);
	return kstat(KRCORE_STAT_LINKS);
}

/* Wait (bounded) until this process holds exactly `n` links: the
 * duplicates closed, and the links its VQPs asked for (at their first
 * completion on the datagram tier, in the background) made. */
static unsigned long long links_reach(unsigned long long n, int timeout_ms)
{
	uint64_t t0 = ct_now_ns();

	while (kstat(KRCORE_STAT_LINKS) != n && ct_now_ns() - t0 < (uint64_t)timeout_ms * 1000000ull)
		usleep(2000);
	return kstat(KRCORE_STAT_LINKS);
}

#define ANSWER_ID 0xa5a5

/* What a bound VQP's service has seen. */
struct service {
	uint32_t next[16];	/* per sender: the next message expected */
	uint32_t got;		/* messages taken */
	uint32_t ans_posted, ans_done;
	uint32_t sends_done;	/* our own sends' completions (same CQ) */
};

/* Take the send completions there are: answers and our own sends. */
static void reap_sends(struct ct_node *n, struct service *sv)
{
	struct ibv_wc s[16];
	int m = ibv_poll_cq(n->scq, 16, s);

	CT_CHECK(m >= 0, "poll");
	for (int i = 0; i < m; i++) {
		CT_CHECK(s[i].status == IBV_WC_SUCCESS, "send %llx: %s", (unsigned long long)s[i].wr_id,
			 ibv_wc_status_str(s[i].status));
		if (s[i].wr_id == ANSWER_ID)
			sv->ans_done++;
		else
			sv->sends_done++;
	}
}

/*
 * A bound VQP's service, one pass: every message that came is checked
 * (sender id from its bytes, in order per sender) and answered with the
 * same bytes on its src_qp, from a ring of NBUF slots (a slot is reused
 * once its answer completed). Returns the messages taken.
 */
static int serve_once(struct ibv_qp *bound, struct ct_node *n, size_t ans_off, struct service *sv,
		      uint32_t nsenders)
{
	struct ibv_qp *src[16];
	struct ibv_wc wc[16];
	int k = qpop_msgs(bound, 16, src, wc);

	CT_CHECK(k >= 0, "qpop_msgs: %d", k);
	for (int i = 0; i < k; i++) {
		uint32_t id, seq;
		uint8_t *p;

		if (wc[i].status == IBV_WC_WR_FLUSH_ERR)
			continue; /* a sender destroyed its VQP */
		CT_CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len == MSG_LEN,
			 "message: %s, %u bytes", ibv_wc_status_str(wc[i].status), wc[i].byte_len);
		p = n->b.p + wc[i].wr_id * MSG_LEN;
		memcpy(&id, p, 4);
		memcpy(&seq, p + 4, 4);
		CT_CHECK(id < nsenders, "sender id %u", id);
		CT_CHECK(seq == sv->next[id], "sender %u: message %u, expected %u (lost, duplicated or reordered)",
			 id, seq, sv->next[id]);
		expect_msg(p, id, seq);
		sv->next[id]++;
		sv->got++;
		{
			uint64_t t0 = ct_now_ns();
			size_t slot = ans_off + (sv->ans_posted % NBUF) * MSG_LEN;

			while (sv->ans_posted - sv->ans_done >= NBUF) {
				CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "answers stuck");
				reap_sends(n, sv);
			}
			memcpy(n->b.p + slot, p, MSG_LEN);
			post_recv_at(bound, n, wc[i].wr_id, wc[i].wr_id * MSG_LEN);
			post_at(src[i], n, ANSWER_ID, IBV_WR_SEND, slot, 0, 0);
			sv->ans_posted++;
		}
	}
	reap_sends(n, sv);
	return k;
}

/* ---- lru reclaim -------------------------------------------------------- */

#define SERVERS 4
#define PER_SERVER 2
#define CLIENT_VQPS (SERVERS * PER_SERVER)
#define ROUNDS 6
#define BURST 8
#define MAX_LINKS 2

static int info_pipe[2];	/* servers -> client: their memory (addr, rkey) */
static int done_pipe[2];	/* parent -> servers: the client finished */
static int start_pipe[2];	/* parent -> servers: the client runs */
static int server_idx;

static int lru_server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *bound;
	uint8_t *mem;
	struct ibv_mr *mmr;
	struct service sv = { 0 };
	const uint32_t want = PER_SERVER * ROUNDS * BURST;
	int node = 2 + server_idx;
	char c;

	ct_begin("vqp_reclaim: lru reclaim (server)");
	ct_node_open(&n, node, 2 * NBUF * MSG_LEN, 1024);
	bound = vqp(&n, 64, NBUF);
	mem = aligned_alloc(4096, 4096);
	CT_CHECK(mem != NULL, "alloc");
	ct_fill(mem, 4096, 7000 + node);
	mmr = CT_PTR(ibv_reg_mr(n.d.pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
	for (int i = 0; i < NBUF; i++)
		post_recv_at(bound, &n, (uint64_t)i, (size_t)i * MSG_LEN);
	CT_OK(qbind(bound, ct_node_gid(node), lru_port + node));
	{
		uint64_t info[3] = { (uint64_t)node, (uintptr_t)mem, mmr->rkey };

		CT_CHECK(write(info_pipe[1], info, sizeof(info)) == sizeof(info), "info");
	}
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* Silence is timed from the client's start, not from ours (the
	 * servers after us take seconds to start under emulation). */
	CT_CHECK(read(start_pipe[0], &c, 1) == 1, "start");
	while (sv.got < want || sv.ans_done < want) {
		uint64_t t0 = ct_now_ns();
		uint32_t before = sv.ans_done;

		while (serve_once(bound, &n, NBUF * MSG_LEN, &sv, CLIENT_VQPS) == 0 && sv.ans_done == before) {
			CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull,
				 "nothing for %d ms (%u of %u messages, %u answers)", CT_TIMEOUT_MS, sv.got, want,
				 sv.ans_done);
			if (sv.got == want && sv.ans_done == want)
				break;
			sched_yield();
		}
	}
	/* Stay up (the client READs us, and closes links with us) until the
	 * parent says the client is done. */
	CT_CHECK(read(done_pipe[0], &c, 1) == 1, "done");
	ct_note("server on node %d: %u messages in order, %u answers; links_closed=%llu", node, sv.got,
		sv.ans_done, kstat(KRCORE_STAT_LINKS_CLOSED));
	ct_pass();
	return 0;
}

static int lru_client(void)
{
	struct ct_node n;
	struct ibv_qp *qp[CLIENT_VQPS];
	uint64_t mem[SERVERS][2];
	int node_of[SERVERS];
	uint32_t answers[CLIENT_VQPS] = { 0 };
	unsigned long long max_links = 0, links;
	/* Per VQP: BURST send slots, a READ slot, BURST receive slots. */
	const size_t per_vqp = (2 * BURST + 1) * MSG_LEN;

	ct_begin(lru_tier ? "vqp_reclaim: lru reclaim (client, KRCORE_MAX_LINKS=2, datagram tier)"
			  : "vqp_reclaim: lru reclaim (client, KRCORE_MAX_LINKS=2, KRCORE_DGRAM=0)");
	/* The client's limit only (read at its first use of the library). */
	setenv("KRCORE_MAX_LINKS", "2", 1);
	setenv("KRCORE_LINK_IDLE_MS", "0", 1);
	ct_node_open(&n, 6, CLIENT_VQPS * per_vqp, 1024);
	for (int s = 0; s < SERVERS; s++) {
		uint64_t info[3];

		CT_CHECK(read(info_pipe[0], info, sizeof(info)) == sizeof(info), "server info");
		node_of[s] = (int)info[0];
		mem[s][0] = info[1];
		mem[s][1] = info[2];
	}
	for (int v = 0; v < CLIENT_VQPS; v++) {
		int s = v / PER_SERVER;

		qp[v] = vqp(&n, 2 * BURST + 2, 2 * BURST);
		for (int b = 0; b < BURST; b++)
			post_recv_at(qp[v], &n, ((uint64_t)v << 32) | (uint64_t)b,
				     v * per_vqp + (BURST + 1 + b) * MSG_LEN);
		CT_OK(qconnect(qp[v], ct_node_gid(node_of[s]), lru_port + node_of[s]));
	}
	for (int r = 0; r < ROUNDS; r++) {
		int sends = 0, reads = 0, recvs = 0;

		/* Server after server, without waiting: the link to the next
		 * one pushes the least recently used one out. */
		for (int v = 0; v < CLIENT_VQPS; v++) {
			int s = v / PER_SERVER;

			for (int b = 0; b < BURST; b++) {
				uint32_t seq = (uint32_t)(r * BURST + b);

				fill_msg(n.b.p + v * per_vqp + b * MSG_LEN, (uint32_t)v, seq);
				post_at(qp[v], &n, ((uint64_t)v << 32) | seq, IBV_WR_SEND, v * per_vqp + b * MSG_LEN, 0, 0);
			}
			post_at(qp[v], &n, (1ull << 63) | ((uint64_t)v << 32), IBV_WR_RDMA_READ,
				v * per_vqp + BURST * MSG_LEN, mem[s][0] + (uint64_t)(r * 64 % 4032), (uint32_t)mem[s][1]);
			links = kstat(KRCORE_STAT_LINKS);
			max_links = links > max_links ? links : max_links;
		}
		while (sends + reads < CLIENT_VQPS * (BURST + 1) || recvs < CLIENT_VQPS * BURST) {
			struct ibv_wc wc;

			if (ibv_poll_cq(n.scq, 1, &wc) == 1) {
				uint32_t v = (uint32_t)(wc.wr_id >> 32) & 0x7fffffff;

				CT_CHECK(wc.status == IBV_WC_SUCCESS, "VQP %u: wr %llx: %s", v,
					 (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
				if (wc.wr_id >> 63) {
					uint8_t want[4096];
					int s = (int)v / PER_SERVER;

					ct_fill(want, 4096, 7000 + node_of[s]);
					ct_expect_bytes(n.b.p + v * per_vqp + BURST * MSG_LEN, want + r * 64 % 4032,
							MSG_LEN, "READ of the server's memory");
					reads++;
				} else {
					sends++;
				}
				continue;
			}
			if (ibv_poll_cq(n.rcq, 1, &wc) == 1) {
				uint32_t v = (uint32_t)(wc.wr_id >> 32), b = (uint32_t)wc.wr_id;
				size_t off = v * per_vqp + (BURST + 1 + b) * MSG_LEN;

				CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == MSG_LEN, "answer: %s",
					 ibv_wc_status_str(wc.status));
				/* Answers come in order too. */
				expect_msg(n.b.p + off, v, answers[v]);
				answers[v]++;
				recvs++;
				post_recv_at(qp[v], &n, wc.wr_id, off);
				continue;
			}
			sched_yield();
		}
		links = links_settle(MAX_LINKS, CT_TIMEOUT_MS);
		CT_CHECK(links <= MAX_LINKS, "round %d: %llu links, KRCORE_MAX_LINKS=%d", r, links, MAX_LINKS);
	}
	for (int v = 0; v < CLIENT_VQPS; v++)
		CT_CHECK(answers[v] == ROUNDS * BURST, "VQP %d: %u answers", v, answers[v]);
	ct_note("%d VQPs to %d servers, %d messages each way and %d READs, all checked: links_opened=%llu "
		"links_closed=%llu, at most %llu links while posting, %llu after each round (max %d)",
		CLIENT_VQPS, SERVERS, CLIENT_VQPS * ROUNDS * BURST, CLIENT_VQPS * ROUNDS,
		kstat(KRCORE_STAT_LINKS_OPENED), kstat(KRCORE_STAT_LINKS_CLOSED), max_links,
		kstat(KRCORE_STAT_LINKS), MAX_LINKS);
	if (lru_tier) {
		/* What the links at the limit could not carry went on the tier. */
		CT_CHECK(kstat(KRCORE_STAT_DGRAM_WRS) > 0, "nothing on the datagram tier");
		ct_note("%llu WRs on the datagram tier, %llu moves onto a link", kstat(KRCORE_STAT_DGRAM_WRS),
			kstat(KRCORE_STAT_DGRAM_MOVES));
	} else {
		/* Each round needs every server's link again: at least one
		 * close per round beyond the first. */
		CT_CHECK(kstat(KRCORE_STAT_LINKS_CLOSED) >= ROUNDS, "only %llu links closed",
			 kstat(KRCORE_STAT_LINKS_CLOSED));
	}
	CT_CHECK(kstat(KRCORE_STAT_LINKS_FAILED) == 0, "%llu links failed", kstat(KRCORE_STAT_LINKS_FAILED));
	for (int v = 0; v < CLIENT_VQPS; v++)
		CT_OK(ibv_destroy_qp(qp[v]));
	ct_pass();
	return 0;
}

static int lru_reclaim(int tier)
{
	pid_t srv[SERVERS], cli;
	int fails = 0;

	/* Read by the children at their first use of the library. */
	lru_tier = tier;
	lru_port = PORT + (tier ? 20 : 0);
	setenv("KRCORE_DGRAM", tier ? "1" : "0", 1);

	CT_CHECK(pipe(info_pipe) == 0 && pipe(done_pipe) == 0 && pipe(start_pipe) == 0, "pipe");
	for (int s = 0; s < SERVERS; s++) {
		server_idx = s;
		srv[s] = ct_fork_ready(lru_server, "lru server");
	}
	cli = fork();
	CT_CHECK(cli >= 0, "fork");
	if (cli == 0)
		_exit(lru_client());
	for (int s = 0; s < SERVERS; s++)
		CT_CHECK(write(start_pipe[1], "S", 1) == 1, "start");
	fails += ct_wait_child(cli, "lru client");
	for (int s = 0; s < SERVERS; s++)
		CT_CHECK(write(done_pipe[1], "D", 1) == 1, "done");
	for (int s = 0; s < SERVERS; s++)
		fails += ct_wait_child(srv[s], "lru server");
	return fails;
}

/* ---- readers keep their links ------------------------------------------- */

#define READERS 3
#define READER_PORT 5660
#define READ_LEN 64

static int rd_info[2];		/* server -> readers: its memory (addr, rkey), once per reader */
static int rd_stop[2];		/* parent -> readers: EOF: stop reading */
static int rd_exit[2];		/* parent -> readers: EOF: exit */
static int rd_checked[2];	/* server -> parent: "C" while reading checked, "S" settled */
static int rd_go[2];		/* parent -> server: "G" the readers stopped */
static int reader_idx;

static int rd_server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *bound;
	uint8_t *mem;
	struct ibv_mr *mmr;
	unsigned long long links, probes0, closed;
	uint64_t t0;
	char c;

	ct_begin("vqp_reclaim: readers keep their links (server, KRCORE_MAX_LINKS=2)");
	/* The readers' ends: they must see end-of-file. */
	close(rd_stop[1]);
	close(rd_exit[1]);
	setenv("KRCORE_MAX_LINKS", "2", 1);
	ct_node_open(&n, 2, 4096, 64);
	bound = vqp(&n, 8, 8);
	mem = aligned_alloc(4096, 4096);
	CT_CHECK(mem != NULL, "alloc");
	ct_fill(mem, 4096, 9100);
	mmr = CT_PTR(ibv_reg_mr(n.d.pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
	CT_OK(qbind(bound, ct_node_gid(2), READER_PORT));
	for (int r = 0; r < READERS; r++) {
		uint64_t info[2] = { (uintptr_t)mem, mmr->rkey };

		CT_CHECK(write(rd_info[1], info, sizeof(info)) == sizeof(info), "info");
	}
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* The readers' links: one over our limit, all idle by our posts. */
	links = links_reach(READERS, CT_TIMEOUT_MS);
	CT_CHECK(links == READERS, "%llu links, expected one per reader", links);
	/* 8 maintenance passes (each probes the 3 links we post nothing on),
	 * each of which would close one of them were they idle. */
	probes0 = kstat(KRCORE_STAT_LINK_PROBES);
	t0 = ct_now_ns();
	while (kstat(KRCORE_STAT_LINK_PROBES) < probes0 + 8 * READERS) {
		CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "%llu probes in %d ms",
			 kstat(KRCORE_STAT_LINK_PROBES) - probes0, CT_TIMEOUT_MS);
		usleep(2000);
	}
	closed = kstat(KRCORE_STAT_LINKS_CLOSED);
	links = kstat(KRCORE_STAT_LINKS);
	CT_CHECK(closed == 0 && links == READERS, "while its readers READ it: %llu links closed, %llu held", closed,
		 links);
	CT_CHECK(write(rd_checked[1], "C", 1) == 1, "checked");
	/* The readers stopped (alive: their probes go on): now they are idle. */
	CT_CHECK(read(rd_go[0], &c, 1) == 1, "go");
	links = links_settle(2, CT_TIMEOUT_MS);
	CT_CHECK(links == 2, "%llu links once its readers went idle, KRCORE_MAX_LINKS=2", links);
	ct_note("server: 3 readers, no link closed while they READ (%llu probes), then %llu closed, %llu held",
		kstat(KRCORE_STAT_LINK_PROBES) - probes0, kstat(KRCORE_STAT_LINKS_CLOSED), links);
	CT_CHECK(write(rd_checked[1], "S", 1) == 1, "settled");
	ct_pass();
	return 0;
}

static int rd_reader(void)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint64_t info[2], reads = 0;
	uint8_t want[4096];
	int node = 3 + reader_idx;
	char c;

	ct_begin("vqp_reclaim: readers keep their links (reader, KRCORE_DGRAM=0)");
	setenv("KRCORE_DGRAM", "0", 1);
	ct_node_open(&n, node, READ_LEN, 64);
	CT_CHECK(read(rd_info[0], info, sizeof(info)) == sizeof(info), "server info");
	ct_fill(want, 4096, 9100);
	qp = vqp(&n, 8, 8);
	CT_OK(qconnect(qp, ct_node_gid(2), READER_PORT));
	CT_CHECK(fcntl(rd_stop[0], F_SETFL, O_NONBLOCK) == 0, "fcntl");
	for (;;) {
		uint64_t off = (reads * READ_LEN) % 4096;
		struct ibv_wc wc;
		uint64_t t0 = ct_now_ns();
		ssize_t k;

		memset(n.b.p, 0, READ_LEN);
		post_at(qp, &n, reads, IBV_WR_RDMA_READ, 0, info[0] + off, (uint32_t)info[1]);
		while (ibv_poll_cq(n.scq, 1, &wc) != 1) {
			CT_CHECK(ct_now_ns() - t0 < (uint64_t)CT_TIMEOUT_MS * 1000000ull, "READ %llu stuck",
				 (unsigned long long)reads);
		}
		CT_CHECK(wc.status == IBV_WC_SUCCESS, "READ %llu: %s", (unsigned long long)reads,
			 ibv_wc_status_str(wc.status));
		ct_expect_bytes(n.b.p, want + off, READ_LEN, "READ of the server's memory");
		reads++;
		if (reads % 64)
			continue;
		k = read(rd_stop[0], &c, 1);
		if (k == 0)
			break;
		CT_CHECK(k < 0 && errno == EAGAIN, "stop pipe");
	}
	/* Made once, never closed under us while we read. */
	CT_CHECK(kstat(KRCORE_STAT_LINKS_OPENED) == 1 && kstat(KRCORE_STAT_LINKS_CLOSED) == 0,
		 "links opened %llu, closed %llu while reading", kstat(KRCORE_STAT_LINKS_OPENED),
		 kstat(KRCORE_STAT_LINKS_CLOSED));
	ct_note("reader on node %d: %llu READs checked, one link", node, (unsigned long long)reads);
	/* Idle and alive until the server has settled. */
	CT_CHECK(read(rd_exit[0], &c, 1) == 0, "exit");
	CT_OK(ibv_destroy_qp(qp));
	ct_pass();
	return 0;
}

static int readers_keep_links(void)
{
	pid_t srv, rd[READERS];
	int fails = 0;
	char c;

	CT_CHECK(pipe(rd_info) == 0 && pipe(rd_stop) == 0 && pipe(rd_exit) == 0 && pipe(rd_checked) == 0 &&
			 pipe(rd_go) == 0,
		 "pipe");
	srv = ct_fork_ready(rd_server, "readers' server");
	for (int r = 0; r < READERS; r++) {
		reader_idx = r;
		rd[r] = fork();
		CT_CHECK(rd[r] >= 0, "fork");
		if (rd[r] == 0) {
			close(rd_stop[1]);
			close(rd_exit[1]);
			close(rd_checked[1]);
			_exit(rd_reader());
		}
	}
	/* Only the server writes these: its death is an end-of-file. */
	close(rd_checked[1]);
	close(rd_stop[0]);
	close(rd_exit[0]);
	if (read(rd_checked[0], &c, 1) != 1)
		fails++;
	close(rd_stop[1]);
	CT_CHECK(write(rd_go[1], "G", 1) == 1, "go");
	if (!fails && read(rd_checked[0], &c, 1) != 1)
		fails++;
	close(rd_exit[1]);
	if (fails)
		kill(srv, SIGKILL);
	fails += ct_wait_child(srv, "readers' server");
	for (int r = 0; r < READERS; r++)
		fails += ct_wait_child(rd[r], "reader");
	return fails;
}

/* ---- simultaneous connects ---------------------------------------------- */

#define PAIR_VQPS 4
#define PHASE_MSGS 16

static int pair_tier;		/* KRCORE_DGRAM of the pair's run */
static int go_pipe[2][2];	/* parent -> peer i: go (connect, phase 2, end) */
static int step_pipe[2];	/* peers -> parent: ready, phase done */
static int peer_idx;

static void wait_go(void)
{
	char c;

	CT_CHECK(read(go_pipe[peer_idx][0], &c, 1) == 1, "go");
}

static void step(void)
{
	CT_CHECK(write(step_pipe[1], "S", 1) == 1, "step");
}

/* Send PHASE_MSGS more on each of qp[] and serve the other side's, until
 * all of both are done and answered. */
static void exchange(struct ct_node *n, struct ibv_qp *bound, struct ibv_qp **qp, uint32_t *sent,
		     uint32_t *answers, struct service *sv, size_t send_off, size_t ans_off, size_t recv_off)
{
	uint32_t target = sent[0] + PHASE_MSGS;
	uint64_t t0 = ct_now_ns();

	for (int v = 0; v < PAIR_VQPS; v++) {
		for (uint32_t s = sent[v]; s < target; s++) {
			size_t off = send_off + ((size_t)v * PHASE_MSGS + s % PHASE_MSGS) * MSG_LEN;

			fill_msg(n->b.p + off, (uint32_t)v, s);
			post_at(qp[v], n, (1ull << 62) | ((uint64_t)v << 32) | s, IBV_WR_SEND, off, 0, 0);
		}
		sent[v] = target;
	}
	for (;;) {
		struct ibv_wc wc;
		int all = 1;
		const uint32_t total = (uint32_t)PAIR_VQPS * target;

		for (int v = 0; v < PAIR_VQPS; v++)
			all &= answers[v] == target;
		/* Our messages answered, theirs all taken and answered, every
		 * send of ours complete. */
		if (all && sv->got == total && sv->ans_done == total && sv->sends_done == total)
			break;
		CT_CHECK(ct_now_ns() - t0 < (uint64_t)2 * CT_TIMEOUT_MS * 1000000ull,
			 "exchange stuck: %u received, answers %u %u %u %u, %u answered, %u sends done", sv->got,
			 answers[0], answers[1], answers[2], answers[3], sv->ans_done, sv->sends_done);
		serve_once(bound, n, ans_off, sv, PAIR_VQPS);
		if (ibv_poll_cq(n->rcq, 1, &wc) == 1) {
			uint32_t v = (uint32_t)(wc.wr_id >> 32), b = (uint32_t)wc.wr_id;
			size_t off = recv_off + ((size_t)v * PHASE_MSGS + b) * MSG_LEN;

			CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == MSG_LEN, "answer: %s",
				 ibv_wc_status_str(wc.status));
			expect_msg(n->b.p + off, v, answers[v]);
			answers[v]++;
			post_recv_at(qp[v], n, wc.wr_id, off);
		} else {
			sched_yield();
		}
	}
}

static int pair_peer(void)
{
	struct ct_node n;
	struct ibv_qp *bound, *qp[PAIR_VQPS];
	int node = 7 + peer_idx, other = 7 + !peer_idx;
	uint32_t sent[PAIR_VQPS] = { 0 }, answers[PAIR_VQPS] = { 0 };
	struct service sv = { 0 };
	const size_t area = (size_t)PAIR_VQPS * PHASE_MSGS * MSG_LEN;
	unsigned long long opened, links;

	static const char *const names[2][2] = {
		{ "vqp_reclaim: simultaneous connects (peer A, KRCORE_DGRAM=0)",
		  "vqp_reclaim: simultaneous connects (peer B, KRCORE_DGRAM=0)" },
		{ "vqp_reclaim: simultaneous connects (peer A, datagram tier)",
		  "vqp_reclaim: simultaneous connects (peer B, datagram tier)" },
	};

	ct_begin(names[pair_tier][peer_idx]);
	setenv("KRCORE_LINKS_PER_PEER", "4", 1);
	setenv("KRCORE_DGRAM", pair_tier ? "1" : "0", 1);
	/* NBUF receive buffers, then send, answer and answer-receive areas. */
	ct_node_open(&n, node, NBUF * MSG_LEN + 3 * area, 1024);
	bound = vqp(&n, 2 * NBUF, NBUF);
	for (int i = 0; i < NBUF; i++)
		post_recv_at(bound, &n, (uint64_t)i, (size_t)i * MSG_LEN);
	CT_OK(qbind(bound, ct_node_gid(node), PORT + node));
	for (int v = 0; v < PAIR_VQPS; v++) {
		qp[v] = vqp(&n, PHASE_MSGS + 1, PHASE_MSGS);
		for (int b = 0; b < PHASE_MSGS; b++)
			post_recv_at(qp[v], &n, ((uint64_t)v << 32) | (uint64_t)b,
				     NBUF * MSG_LEN + 2 * area + ((size_t)v * PHASE_MSGS + b) * MSG_LEN);
	}
	step();
	wait_go();
	/* Both sides at once: each one's link requests cross the other's. */
	for (int v = 0; v < PAIR_VQPS; v++)
		CT_OK(qconnect(qp[v], ct_node_gid(other), PORT + other));
	exchange(&n, bound, qp, sent, answers, &sv, NBUF * MSG_LEN, NBUF * MSG_LEN + area,
		 NBUF * MSG_LEN + 2 * area);
	opened = kstat(KRCORE_STAT_LINKS_OPENED);
	/* The duplicates close (at the next link maintenance, both sides),
	 * and every index has its link. */
	links = links_reach(PAIR_VQPS, CT_TIMEOUT_MS);
	CT_CHECK(links == PAIR_VQPS, "%llu links to the other process (opened %llu), want %d", links, opened,
		 PAIR_VQPS);
	/* Requests that cross make one link, not two (the lower incarnation's
	 * request makes it; the other's is answered EALREADY). With
	 * KRCORE_DGRAM=0 they cross every time. */
	if (!pair_tier)
		CT_CHECK(kstat(KRCORE_STAT_LINKS_OPENED) == PAIR_VQPS && kstat(KRCORE_STAT_LINKS_CLOSED) == 0,
			 "crossing requests: %llu links opened, %llu closed as duplicates, want %d and 0",
			 kstat(KRCORE_STAT_LINKS_OPENED), kstat(KRCORE_STAT_LINKS_CLOSED), PAIR_VQPS);
	step();
	wait_go();
	exchange(&n, bound, qp, sent, answers, &sv, NBUF * MSG_LEN, NBUF * MSG_LEN + area,
		 NBUF * MSG_LEN + 2 * area);
	/* A link both sides asked for at once in phase 1 closes as a duplicate
	 * at the next maintenance. */
	links = links_reach(PAIR_VQPS, CT_TIMEOUT_MS);
	CT_CHECK(links == PAIR_VQPS, "%llu links after phase 2", links);
	CT_CHECK(kstat(KRCORE_STAT_LINKS_OPENED) - kstat(KRCORE_STAT_LINKS_CLOSED) == PAIR_VQPS,
		 "opened %llu, closed %llu", kstat(KRCORE_STAT_LINKS_OPENED), kstat(KRCORE_STAT_LINKS_CLOSED));
	CT_CHECK(kstat(KRCORE_STAT_LINKS_FAILED) == 0, "%llu links failed", kstat(KRCORE_STAT_LINKS_FAILED));
	ct_note("peer on node %d: %d messages each way checked; links opened %llu, duplicates closed %llu, "
		"%llu links at the end", node, PAIR_VQPS * 2 * PHASE_MSGS, kstat(KRCORE_STAT_LINKS_OPENED),
		kstat(KRCORE_STAT_LINKS_CLOSED), kstat(KRCORE_STAT_LINKS));
	step();
	/* Both stay up until both checked (a link close needs its peer). */
	wait_go();
	for (int v = 0; v < PAIR_VQPS; v++)
		CT_OK(ibv_destroy_qp(qp[v]));
	ct_pass();
	return 0;
}

static int simultaneous(int tier)
{
	pid_t p[2];
	int fails = 0;

	pair_tier = tier;
	CT_CHECK(pipe(go_pipe[0]) == 0 && pipe(go_pipe[1]) == 0 && pipe(step_pipe) == 0, "pipe");
	for (int i = 0; i < 2; i++) {
		peer_idx = i;
		p[i] = fork();
		CT_CHECK(p[i] >= 0, "fork");
		if (p[i] == 0)
			_exit(pair_peer());
	}
	/* Only the peers write steps: a peer that failed (exited) ends the
	 * parent's read instead of leaving it waiting. */
	close(step_pipe[1]);
	/* Three steps: ready, phase 1 done (duplicates closed), phase 2 done. */
	for (int s = 0; s < 3; s++) {
		for (int i = 0; i < 2; i++) {
			char c;

			if (read(step_pipe[0], &c, 1) != 1) {
				fails++;
				break;
			}
		}
		if (fails)
			break;
		for (int i = 0; i < 2; i++)
			CT_CHECK(write(go_pipe[i][1], "G", 1) == 1, "go");
	}
	if (fails) {
		kill(p[0], SIGKILL);
		kill(p[1], SIGKILL);
	}
	for (int i = 0; i < 2; i++)
		fails += ct_wait_child(p[i], "pair peer");
	return fails;
}

int main(void)
{
	pid_t meta_pid;
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library: link
	 * maintenance (probes, closes) every 200 ms. */
	setenv("KRCORE_LINK_PROBE_MS", "200", 1);
	ct_watchdog(300);
	meta_pid = ct_start_meta();
	fails += lru_reclaim(0);
	fails += lru_reclaim(1);
	unsetenv("KRCORE_DGRAM");
	fails += readers_keep_links();
	fails += simultaneous(0);
	fails += simultaneous(1);
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
