/*
 * The VQP soak (issue 9): KRCORE_SOAK_S seconds (default 300) of process
 * churn on 10 emulated nodes, krcore-meta started here on node 1.
 *
 * Roles (one process each, forked by the driver, which itself never opens
 * the device):
 * - the server (node 1, uid 0): qbind at SRV_PORT, a qpop_msgs loop that
 *   checks every message (per src_qp stream: sequence numbers from 0, no gap,
 *   no duplicate, bytes as sent) and answers each on its src_qp with a
 *   checked 32-byte echo; it reports its links/vqps gauges every second and
 *   one record per stream when the stream's src_qp is reported closed;
 * - clients (nodes 2..10, uid 1, 2, ...): 1-4 rounds to the server, each a
 *   new VQP (create, qconnect, SENDs of 16 B..6 KiB with a READ of the
 *   server's memory every 4th, every echo checked, destroy: destroy and
 *   reconnect); 40% also bind a port of their own and serve (the same
 *   checks, the same echo) the clients that connect to them; 60% connect
 *   to one live binder and run a stream of SENDs and READs to it too;
 * - the driver: spawns clients (KRCORE_SOAK_CLIENTS at once, default 6),
 *   kills 35% of them with SIGKILL at a random point (0.05-4 s after their
 *   start: while binding, connecting, streaming or serving), tells the
 *   others when to exit (a binder only once no connector still uses it),
 *   collects every report through one pipe, samples the server's VmRSS,
 *   its links gauge and its physical QPs (`rdma resource show qp`) every
 *   5 s, and checks at the end.
 *
 * Checks: every stream of a client that was not killed arrived exactly
 * once: in order and byte for byte (at the acceptor), every echo in order
 * (at the client), and the acceptor's count of the stream equals the
 * client's; a killed client's streams arrived in order without a gap up to
 * its death and were reported closed; every error completion (and every
 * refused qconnect) is on a VQP whose peer was killed, with a peer-death
 * status (RETRY_EXC_ERR, WR_FLUSH_ERR, REM_OP_ERR); every wait is bounded
 * (STALL_MS without a completion while work is outstanding is a hang);
 * every process not killed exits 0; the server's links never exceed the
 * client processes alive in the last LINK_WINDOW_S seconds (a link to a
 * process that ended goes within the probe period plus RC's retries), all
 * go when the clients are gone, its physical QPs (every QP its threads
 * created, as `rdma resource show qp` lists them) never exceed those it had
 * before the first client plus that many and come back to them, its RSS
 * after warm-up stays within RSS_SLACK_KB of the warm-up sample, and after
 * the last client its RSS is within RSS_END_SLACK_KB and its heap in use
 * (mallinfo2) within HEAP_SLACK_KB of what they were before the first.
 *
 * The seed (KRCORE_SOAK_SEED, default the time) is printed; a run is
 * reproduced with the same seed up to timing.
 */
#define _GNU_SOURCE
#include "common.h"

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NODES 10
#define SRV_NODE 1
#define SRV_PORT 9100
#define BIND_PORT_BASE 10000
#define MAX_UID 4000
#define HDR 16
#define MSG_MAX 6144		/* above 4 KiB: the staging/READ path */
#define REPLY_LEN 32
#define WINDOW 8
#define NRECV 64
#define NREP 128
#define MAX_STREAMS 256
#define MEM_LEN 4096
#define READ_LEN 64
#define PEER_ROUND 100
#define STALL_MS 30000		/* no completion with work outstanding */
#define CLOSE_WAIT_MS 30000	/* finished connectors' src_qps closed */
#define SAMPLE_S 5
#define LINK_WINDOW_S 30
#define RSS_SLACK_KB (24 * 1024)	/* after warm-up, over the warm-up sample */
#define RSS_END_SLACK_KB (4 * 1024)	/* after the last client, over the first sample */
#define HEAP_SLACK_KB 1024		/* heap in use after the last client, over before the first */
#define P_KILL 35
#define P_BINDER 40
#define P_PEER 60

/* ---- reports: fixed-size records, one write each (atomic on a pipe) ---- */

enum {
	R_HELLO = 1,	/* uid, a: binder, x: memory address, y: rkey */
	R_DONE,		/* uid, a: peer uid (0 server), b: round, c: messages, d: READs */
	R_FAIL,		/* uid, a: peer uid, b: round, c: status (1000 + errno: qconnect) */
	R_RX,		/* uid: acceptor, a: from uid, b: round, c: messages verified */
	R_ACC_ERR,	/* uid: acceptor, a: from uid, c: status of an echo */
	R_OWN_DONE,	/* uid: its own streams are done, waiting for 'X' */
	R_EXIT,		/* uid: exiting with status 0 */
	R_STAT,		/* server: a links, b vqps, c links_failed, d links_opened, x heap in use */
	R_FINAL,	/* server: a open streams, b links, c vqps, x messages verified, y heap in use */
};

struct rec {
	uint32_t type, uid, a, b, c, d;
	uint64_t x, y;
};

static int rep_fd = -1;		/* write end, every process */
static int ctl_fd = -1;		/* read end in a child: 'X' / 'S' */

static void report(struct rec r)
{
	CT_CHECK(write(rep_fd, &r, sizeof(r)) == (ssize_t)sizeof(r), "report: %s", strerror(errno));
}

/* ---- small helpers ------------------------------------------------------ */

static uint64_t rng_state;

static uint32_t rnd(void)
{
	/* xorshift64* */
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}

static uint32_t rnd_in(uint32_t lo, uint32_t hi)
{
	return lo + rnd() % (hi - lo + 1);
}

static double ms_since(uint64_t t0)
{
	return (double)(ct_now_ns() - t0) / 1e6;
}

static uint32_t msg_seed(uint32_t uid, uint32_t round, uint32_t seq)
{
	return uid * 7919u + round * 131u + seq * 2654435761u;
}

static uint32_t mem_seed(uint32_t uid)
{
	return 0x5eed0000u + uid;
}

static int peer_death_status(uint32_t s)
{
	return s == IBV_WC_RETRY_EXC_ERR || s == IBV_WC_WR_FLUSH_ERR || s == IBV_WC_REM_OP_ERR;
}

struct node {
	struct ct_dev d;
	int node;
};

static void node_open(struct node *n, int node)
{
	char idx[16];

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	ct_open(&n->d);
	n->node = node;
}

static void *reg_buf(struct node *n, size_t len, struct ibv_mr **mr, int access)
{
	size_t l = (len + 4095) & ~(size_t)4095;
	void *p = aligned_alloc(4096, l);

	CT_CHECK(p != NULL, "alloc");
	memset(p, 0, l);
	*mr = CT_PTR(ibv_reg_mr(n->d.pd, p, l, access));
	return p;
}

static int post_one(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op, void *p, uint32_t len,
		    uint32_t lkey, uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { (uintptr_t)p, len, lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
				  .opcode = op, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;

	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

static void post_recv(struct ibv_qp *qp, uint64_t wr_id, void *p, uint32_t len, uint32_t lkey)
{
	struct ibv_sge sge = { (uintptr_t)p, len, lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr *bad = NULL;

	CT_OK(ibv_post_recv(qp, &wr, &bad));
}

static void put_hdr(uint8_t *p, uint32_t uid, uint32_t round, uint32_t seq, uint32_t len)
{
	uint32_t h[4] = { uid, round, seq, len };

	memcpy(p, h, HDR);
}

static void get_hdr(const uint8_t *p, uint32_t h[4])
{
	memcpy(h, p, HDR);
}

/* ---- the acceptor: a bound VQP that checks and echoes (server, binders) -- */

struct astream {
	struct ibv_qp *src;
	uint32_t uid, round, next;
};

struct acceptor {
	struct node *n;
	uint32_t self;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	uint8_t *rbuf, *rep, *mem;
	struct ibv_mr *rmr, *repmr, *memmr;
	uint32_t rep_uid[NREP];
	uint8_t rep_busy[NREP];
	int rep_next, rep_out;
	struct astream st[MAX_STREAMS];
	int nst;
	int16_t last_round[MAX_UID];
	uint64_t verified;
};

static void acc_init(struct acceptor *a, struct node *n, uint32_t self, int port)
{
	struct ibv_qp_cap cap;
	int rc;

	memset(a, 0, sizeof(*a));
	a->n = n;
	a->self = self;
	for (int i = 0; i < MAX_UID; i++)
		a->last_round[i] = -1;
	a->scq = CT_PTR(ibv_create_cq(n->d.ctx, 2 * NREP, NULL, NULL, 0));
	a->rcq = CT_PTR(ibv_create_cq(n->d.ctx, 2 * NRECV, NULL, NULL, 0));
	a->qp = ct_create_vqp(&n->d, a->scq, a->rcq, (struct ct_qp_caps){ NREP, NRECV, 1, 1, 0, 0 }, &cap);
	a->rbuf = reg_buf(n, (size_t)NRECV * MSG_MAX, &a->rmr, IBV_ACCESS_LOCAL_WRITE);
	a->rep = reg_buf(n, (size_t)NREP * REPLY_LEN, &a->repmr, IBV_ACCESS_LOCAL_WRITE);
	a->mem = reg_buf(n, MEM_LEN, &a->memmr, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	ct_fill(a->mem, MEM_LEN, mem_seed(self));
	for (int i = 0; i < NRECV; i++)
		post_recv(a->qp, (uint64_t)i, a->rbuf + (size_t)i * MSG_MAX, MSG_MAX, a->rmr->lkey);
	rc = qbind(a->qp, ct_node_gid(n->node), port);
	CT_CHECK(rc == 0, "qbind(10.77.0.%d, %d): %d (%s)", n->node, port, rc, strerror(rc));
}

/* Retire completed echoes; 1 if any. */
static int acc_reap(struct acceptor *a)
{
	struct ibv_wc wc[32];
	int k = ibv_poll_cq(a->scq, 32, wc);

	CT_CHECK(k >= 0, "ibv_poll_cq: %d", k);
	for (int i = 0; i < k; i++) {
		uint32_t slot = (uint32_t)wc[i].wr_id;

		CT_CHECK(slot < NREP && a->rep_busy[slot], "echo completion with wr_id %llu",
			 (unsigned long long)wc[i].wr_id);
		if (wc[i].status != IBV_WC_SUCCESS)
			report((struct rec){ .type = R_ACC_ERR, .uid = a->self, .a = a->rep_uid[slot],
					     .c = wc[i].status });
		a->rep_busy[slot] = 0;
		a->rep_out--;
	}
	return k > 0;
}

static void acc_echo(struct acceptor *a, struct ibv_qp *src, uint32_t uid, uint32_t round, uint32_t seq)
{
	uint64_t t0 = ct_now_ns();
	uint32_t slot;
	uint8_t *p;
	int rc;

	while (a->rep_out == NREP) {
		CT_CHECK(ms_since(t0) < STALL_MS, "%d echoes never completed", NREP);
		if (!acc_reap(a))
			usleep(200);
	}
	while (a->rep_busy[a->rep_next])
		a->rep_next = (a->rep_next + 1) % NREP;
	slot = (uint32_t)a->rep_next;
	p = a->rep + (size_t)slot * REPLY_LEN;
	put_hdr(p, uid, round, seq, REPLY_LEN);
	ct_fill(p + HDR, REPLY_LEN - HDR, msg_seed(uid, round, seq) ^ 0xecu);
	a->rep_busy[slot] = 1;
	a->rep_uid[slot] = uid;
	a->rep_out++;
	while ((rc = post_one(src, slot, IBV_WR_SEND, p, REPLY_LEN, a->repmr->lkey, 0, 0)) == ENOMEM) {
		CT_CHECK(ms_since(t0) < STALL_MS, "src_qp's send queue stayed full");
		if (!acc_reap(a))
			usleep(200);
	}
	CT_CHECK(rc == 0, "echo to uid %u: ibv_post_send %d (%s)", uid, rc, strerror(rc));
}

static struct astream *acc_find(struct acceptor *a, struct ibv_qp *src)
{
	for (int i = 0; i < a->nst; i++)
		if (a->st[i].src == src)
			return &a->st[i];
	return NULL;
}

/* One qpop_msgs pass; 1 if anything happened. */
static int acc_poll(struct acceptor *a)
{
	struct ibv_qp *src[32];
	struct ibv_wc wc[32];
	int k, busy = acc_reap(a);

	k = qpop_msgs(a->qp, 32, src, wc);
	CT_CHECK(k >= 0, "qpop_msgs: %d", k);
	for (int i = 0; i < k; i++) {
		struct astream *s = acc_find(a, src[i]);
		uint32_t h[4];
		uint8_t *p;

		if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
			/* A sender's VQP is gone: destroyed (CLOSE) or its
			 * process died (the link failed). */
			CT_CHECK(s != NULL, "an unknown src_qp %p reported closed", (void *)src[i]);
			report((struct rec){ .type = R_RX, .uid = a->self, .a = s->uid, .b = s->round,
					     .c = s->next });
			*s = a->st[--a->nst];
			continue;
		}
		CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "message: %s", ibv_wc_status_str(wc[i].status));
		CT_CHECK(wc[i].wr_id < NRECV, "wr_id %llu", (unsigned long long)wc[i].wr_id);
		p = a->rbuf + wc[i].wr_id * MSG_MAX;
		get_hdr(p, h);
		CT_CHECK(h[3] == wc[i].byte_len && h[3] >= HDR && h[3] <= MSG_MAX,
			 "byte_len %u, header says %u (uid %u)", wc[i].byte_len, h[3], h[0]);
		CT_CHECK(h[0] > 0 && h[0] < MAX_UID, "uid %u", h[0]);
		if (!s) {
			/* A new stream: from its first message. */
			CT_CHECK(h[2] == 0, "uid %u round %u: a new src_qp starts at message %u (a gap)",
				 h[0], h[1], h[2]);
			CT_CHECK((int)h[1] > a->last_round[h[0]],
				 "uid %u: round %u after round %d (a duplicate stream)", h[0], h[1],
				 a->last_round[h[0]]);
			CT_CHECK(a->nst < MAX_STREAMS, "%d streams", a->nst);
			a->last_round[h[0]] = (int16_t)h[1];
			s = &a->st[a->nst++];
			*s = (struct astream){ src[i], h[0], h[1], 0 };
		}
		CT_CHECK(h[0] == s->uid && h[1] == s->round, "src_qp of uid %u round %u got uid %u round %u",
			 s->uid, s->round, h[0], h[1]);
		CT_CHECK(h[2] == s->next, "uid %u round %u: message %u, expected %u (%s)", h[0], h[1], h[2],
			 s->next, h[2] < s->next ? "a duplicate" : "a gap");
		ct_expect_pattern(p + HDR, h[3] - HDR, msg_seed(h[0], h[1], h[2]), "message bytes");
		s->next++;
		a->verified++;
		acc_echo(a, src[i], h[0], h[1], h[2]);
		post_recv(a->qp, wc[i].wr_id, p, MSG_MAX, a->rmr->lkey);
	}
	return busy || k > 0;
}

static void acc_destroy(struct acceptor *a)
{
	uint64_t t0 = ct_now_ns();

	while (a->rep_out > 0) {
		CT_CHECK(ms_since(t0) < STALL_MS, "%d echoes never completed", a->rep_out);
		if (!acc_reap(a))
			usleep(500);
	}
	CT_OK(ibv_destroy_qp(a->qp));
	CT_OK(ibv_destroy_cq(a->scq));
	CT_OK(ibv_destroy_cq(a->rcq));
	CT_OK(ibv_dereg_mr(a->rmr));
	CT_OK(ibv_dereg_mr(a->repmr));
	CT_OK(ibv_dereg_mr(a->memmr));
	free(a->rbuf);
	free(a->rep);
	free(a->mem);
}

/* ---- the server ------------------------------------------------------- */

static int info_pipe[2];

static int server_role(int ready_fd)
{
	static struct acceptor a;
	struct node n;
	uint64_t t_stat = 0, t_stop = 0;
	int stopping = 0;

	ct_begin("vqp_soak: the server (node 1)");
	node_open(&n, SRV_NODE);
	acc_init(&a, &n, 0, SRV_PORT);
	{
		uint64_t info[2] = { (uintptr_t)a.mem, a.memmr->rkey };

		CT_CHECK(write(info_pipe[1], info, sizeof(info)) == sizeof(info), "info");
	}
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	for (;;) {
		int busy = acc_poll(&a);
		char c;

		if (ms_since(t_stat) >= 1000) {
			t_stat = ct_now_ns();
			report((struct rec){ .type = R_STAT, .a = (uint32_t)krcore_stat_get(KRCORE_STAT_LINKS),
					     .b = (uint32_t)krcore_stat_get(KRCORE_STAT_VQPS),
					     .c = (uint32_t)krcore_stat_get(KRCORE_STAT_LINKS_FAILED),
					     .d = (uint32_t)krcore_stat_get(KRCORE_STAT_LINKS_OPENED),
					     .x = mallinfo2().uordblks });
		}
		if (!stopping && read(ctl_fd, &c, 1) == 1) {
			CT_CHECK(c == 'S', "control byte %c", c);
			stopping = 1;
			t_stop = ct_now_ns();
		}
		if (stopping) {
			/* Every client is gone: every stream must be reported
			 * closed and every link must go (the probe finds the
			 * peers dead), within a bound. */
			uint64_t links = krcore_stat_get(KRCORE_STAT_LINKS);

			if (a.nst == 0 && links == 0)
				break;
			if (ms_since(t_stop) > 60000) {
				report((struct rec){ .type = R_FINAL, .a = (uint32_t)a.nst, .b = (uint32_t)links,
						     .c = (uint32_t)krcore_stat_get(KRCORE_STAT_VQPS),
						     .x = a.verified });
				for (int i = 0; i < a.nst; i++)
					printf("open stream: uid %u round %u, %u messages\n", a.st[i].uid,
					       a.st[i].round, a.st[i].next);
				CT_FAIL("60 s after the last client: %d streams open, %llu links", a.nst,
					(unsigned long long)links);
			}
		}
		if (!busy)
			usleep(stopping ? 2000 : 300);
	}
	report((struct rec){ .type = R_FINAL, .a = 0, .b = 0, .c = (uint32_t)krcore_stat_get(KRCORE_STAT_VQPS),
			     .x = a.verified, .y = mallinfo2().uordblks });
	/* The driver counts our physical QPs, then says 'Q'. */
	{
		struct pollfd pfd = { ctl_fd, POLLIN, 0 };
		char c = 0;

		fcntl(ctl_fd, F_SETFL, 0);
		CT_CHECK(poll(&pfd, 1, 120000) == 1 && read(ctl_fd, &c, 1) == 1 && c == 'Q', "no 'Q' from the driver");
	}
	acc_destroy(&a);
	ct_pass();
	return 0;
}

/* ---- clients ---------------------------------------------------------- */

/* What the driver decided for the child it forks (inherited). */
static struct plan {
	uint32_t uid;
	int node, binder, rounds;
	uint32_t peer;		/* 0: none */
	int peer_node;
	uint64_t peer_addr, srv_addr;
	uint32_t peer_rkey, srv_rkey;
	uint64_t seed;
} plan;

struct cstream {
	int active, failed, sq_failed;
	uint32_t peer, round, nmsgs;
	uint64_t raddr;
	uint32_t rkey;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	uint8_t *buf;		/* WINDOW send slots, WINDOW echo slots, a READ slot */
	struct ibv_mr *mr;
	uint8_t want[MEM_LEN];
	uint32_t sent, send_done, echoed, reads;
	int out_sends, out_read, out_recvs;
	uint32_t fail_status;
	uint64_t last_progress, t_fail;
};

#define SLOT_SEND(s, i) ((s)->buf + (size_t)(i) * MSG_MAX)
#define SLOT_ECHO(s, i) ((s)->buf + (size_t)WINDOW * MSG_MAX + (size_t)(i) * REPLY_LEN)
#define SLOT_READ(s) ((s)->buf + (size_t)WINDOW * (MSG_MAX + REPLY_LEN))
#define CS_BUF_LEN ((size_t)WINDOW * (MSG_MAX + REPLY_LEN) + READ_LEN)

static void cs_free(struct cstream *s)
{
	CT_OK(ibv_destroy_qp(s->qp));
	CT_OK(ibv_destroy_cq(s->scq));
	CT_OK(ibv_destroy_cq(s->rcq));
	CT_OK(ibv_dereg_mr(s->mr));
	free(s->buf);
	s->active = 0;
}

/* Start a stream to the server (peer 0) or a binder; 0, or -1 when the
 * binder refused (reported). */
static int cs_start(struct node *n, struct cstream *s, uint32_t peer, uint32_t round, uint32_t nmsgs)
{
	int node = peer ? plan.peer_node : SRV_NODE;
	int port = peer ? BIND_PORT_BASE + (int)peer : SRV_PORT;
	int rc;

	memset(s, 0, sizeof(*s));
	s->peer = peer;
	s->round = round;
	s->nmsgs = nmsgs;
	s->raddr = peer ? plan.peer_addr : plan.srv_addr;
	s->rkey = peer ? plan.peer_rkey : plan.srv_rkey;
	ct_fill(s->want, MEM_LEN, mem_seed(peer));
	s->scq = CT_PTR(ibv_create_cq(n->d.ctx, 4 * WINDOW, NULL, NULL, 0));
	s->rcq = CT_PTR(ibv_create_cq(n->d.ctx, 2 * WINDOW, NULL, NULL, 0));
	s->qp = ct_create_vqp(&n->d, s->scq, s->rcq, (struct ct_qp_caps){ 2 * WINDOW + 2, WINDOW, 1, 1, 0, 0 },
			      NULL);
	s->buf = reg_buf(n, CS_BUF_LEN, &s->mr, IBV_ACCESS_LOCAL_WRITE);
	s->active = 1;
	rc = qconnect(s->qp, ct_node_gid(node), port);
	if (rc != 0) {
		CT_CHECK(peer != 0, "qconnect to the server: %d (%s)", rc, strerror(rc));
		CT_CHECK(rc == ECONNREFUSED || rc == ETIMEDOUT, "qconnect to uid %u: %d (%s)", peer, rc,
			 strerror(rc));
		report((struct rec){ .type = R_FAIL, .uid = plan.uid, .a = peer, .b = round, .c = 1000u + (uint32_t)rc });
		cs_free(s);
		return -1;
	}
	for (int i = 0; i < WINDOW; i++)
		post_recv(s->qp, (uint64_t)i, SLOT_ECHO(s, i), REPLY_LEN, s->mr->lkey);
	s->out_recvs = WINDOW;
	s->last_progress = ct_now_ns();
	return 0;
}

static void cs_error(struct cstream *s, uint32_t status, const char *what)
{
	CT_CHECK(s->peer != 0, "%s on the VQP to the server (round %u, message %u of %u): %s", what, s->round,
		 s->echoed, s->nmsgs, ibv_wc_status_str((enum ibv_wc_status)status));
	CT_CHECK(peer_death_status(status), "%s on the VQP to uid %u: %s", what, s->peer,
		 ibv_wc_status_str((enum ibv_wc_status)status));
	if (!s->failed) {
		s->failed = 1;
		s->fail_status = status;
		s->t_fail = ct_now_ns();
	}
}

/* One step of a stream; 1 if anything happened. When it ends (done, or
 * failed and drained), it is reported and freed. */
static int cs_step(struct cstream *s)
{
	struct ibv_wc wc[16];
	int k, busy = 0;

	if (!s->active)
		return 0;
	/* Post: a message while the window allows, a READ every 4th. */
	while (!s->failed && s->sent < s->nmsgs && s->sent < s->send_done + WINDOW &&
	       s->sent < s->echoed + WINDOW) {
		uint32_t seq = s->sent;
		uint32_t len = rnd() % 20 == 0 ? rnd_in(4097, MSG_MAX) : rnd_in(HDR, 512);
		uint8_t *p = SLOT_SEND(s, seq % WINDOW);

		put_hdr(p, plan.uid, s->round, seq, len);
		ct_fill(p + HDR, len - HDR, msg_seed(plan.uid, s->round, seq));
		CT_OK(post_one(s->qp, seq, IBV_WR_SEND, p, len, s->mr->lkey, 0, 0));
		s->out_sends++;
		s->sent++;
		if (seq % 4 == 0 && !s->out_read) {
			uint32_t off = (seq * READ_LEN) % MEM_LEN;

			memset(SLOT_READ(s), 0, READ_LEN);
			CT_OK(post_one(s->qp, (1ull << 32) | off, IBV_WR_RDMA_READ, SLOT_READ(s), READ_LEN,
				       s->mr->lkey, s->raddr + off, s->rkey));
			s->out_read = 1;
		}
		busy = 1;
	}
	k = ibv_poll_cq(s->scq, 16, wc);
	CT_CHECK(k >= 0, "ibv_poll_cq: %d", k);
	for (int i = 0; i < k; i++) {
		int is_read = (int)(wc[i].wr_id >> 32);

		if (is_read)
			s->out_read = 0;
		else
			s->out_sends--;
		if (wc[i].status != IBV_WC_SUCCESS) {
			cs_error(s, wc[i].status, is_read ? "READ" : "SEND");
			s->sq_failed = 1;
			continue;
		}
		/* In posting order: everything behind an error is flushed. */
		CT_CHECK(!s->sq_failed, "a successful send completion after an error on the VQP to uid %u", s->peer);
		if (is_read) {
			uint32_t off = (uint32_t)wc[i].wr_id;

			ct_expect_bytes(SLOT_READ(s), s->want + off, READ_LEN, "READ of the peer's memory");
			s->reads++;
		} else {
			CT_CHECK((uint32_t)wc[i].wr_id == s->send_done, "send completion %llu, expected %u",
				 (unsigned long long)wc[i].wr_id, s->send_done);
			s->send_done++;
		}
	}
	busy |= k > 0;
	k = ibv_poll_cq(s->rcq, 16, wc);
	CT_CHECK(k >= 0, "ibv_poll_cq: %d", k);
	for (int i = 0; i < k; i++) {
		uint8_t *p = SLOT_ECHO(s, wc[i].wr_id);
		uint32_t h[4];

		s->out_recvs--;
		if (wc[i].status != IBV_WC_SUCCESS) {
			cs_error(s, wc[i].status, "receive");
			continue;
		}
		/* Echoes that arrived before an error are still delivered. */
		CT_CHECK(wc[i].byte_len == REPLY_LEN, "echo of %u bytes", wc[i].byte_len);
		get_hdr(p, h);
		CT_CHECK(h[0] == plan.uid && h[1] == s->round && h[2] == s->echoed && h[3] == REPLY_LEN,
			 "echo from uid %u: uid %u round %u seq %u, expected round %u seq %u", s->peer, h[0], h[1],
			 h[2], s->round, s->echoed);
		ct_expect_pattern(p + HDR, REPLY_LEN - HDR, msg_seed(h[0], h[1], h[2]) ^ 0xecu, "echo bytes");
		s->echoed++;
		if (!s->failed) {
			post_recv(s->qp, wc[i].wr_id, p, REPLY_LEN, s->mr->lkey);
			s->out_recvs++;
		}
	}
	busy |= k > 0;
	if (busy)
		s->last_progress = ct_now_ns();
	if (s->failed) {
		/* Everything outstanding must complete (in error). */
		if (s->out_sends == 0 && !s->out_read && s->out_recvs == 0) {
			report((struct rec){ .type = R_FAIL, .uid = plan.uid, .a = s->peer, .b = s->round,
					     .c = s->fail_status, .d = s->echoed });
			cs_free(s);
			return 1;
		}
		CT_CHECK(ms_since(s->t_fail) < STALL_MS,
			 "VQP hang: to uid %u after %s: %d sends, %d READs, %d receives never completed", s->peer,
			 ibv_wc_status_str((enum ibv_wc_status)s->fail_status), s->out_sends, s->out_read,
			 s->out_recvs);
		return busy;
	}
	if (s->echoed == s->nmsgs && s->send_done == s->nmsgs && !s->out_read) {
		report((struct rec){ .type = R_DONE, .uid = plan.uid, .a = s->peer, .b = s->round, .c = s->nmsgs,
				     .d = s->reads });
		cs_free(s);
		return 1;
	}
	CT_CHECK(ms_since(s->last_progress) < STALL_MS,
		 "VQP hang: to uid %u round %u: no completion for %d ms (%u sent, %u completed, %u echoed)", s->peer,
		 s->round, STALL_MS, s->sent, s->send_done, s->echoed);
	return busy;
}

static int client_main(void)
{
	static struct acceptor a;
	static struct cstream srv, peer;
	struct node n;
	char name[96];
	int round = 0, peer_started = 0, own_done = 0;
	uint64_t t_exit = 0;

	rng_state = plan.seed ^ ((uint64_t)plan.uid * 0x9e3779b97f4a7c15ull);
	(void)rnd();
	snprintf(name, sizeof(name), "vqp_soak: client uid %u (node %d%s)", plan.uid, plan.node,
		 plan.binder ? ", binder" : "");
	ct_begin(name);
	node_open(&n, plan.node);
	if (plan.binder)
		acc_init(&a, &n, plan.uid, BIND_PORT_BASE + (int)plan.uid);
	report((struct rec){ .type = R_HELLO, .uid = plan.uid, .a = (uint32_t)plan.binder,
			     .x = plan.binder ? (uintptr_t)a.mem : 0, .y = plan.binder ? a.memmr->rkey : 0 });
	for (;;) {
		int busy = 0;
		char c;

		if (!srv.active && round < plan.rounds) {
			round++;
			cs_start(&n, &srv, 0, (uint32_t)round, rnd_in(20, 300));
			busy = 1;
		}
		if (plan.peer && !peer_started) {
			peer_started = 1;
			cs_start(&n, &peer, plan.peer, PEER_ROUND, rnd_in(20, 300));
			busy = 1;
		}
		busy |= cs_step(&srv);
		busy |= cs_step(&peer);
		if (plan.binder)
			busy |= acc_poll(&a);
		if (!own_done && !srv.active && round == plan.rounds && !peer.active &&
		    (!plan.peer || peer_started)) {
			own_done = 1;
			report((struct rec){ .type = R_OWN_DONE, .uid = plan.uid });
		}
		if (own_done && !t_exit && read(ctl_fd, &c, 1) == 1) {
			CT_CHECK(c == 'X', "control byte %c", c);
			t_exit = ct_now_ns();
		}
		if (t_exit) {
			/* A binder: every connector has finished (the driver
			 * said so): their src_qps must all be reported closed. */
			if (!plan.binder || a.nst == 0)
				break;
			CT_CHECK(ms_since(t_exit) < CLOSE_WAIT_MS,
				 "%d src_qps of finished connectors not reported closed after %d ms (first: uid %u)",
				 a.nst, CLOSE_WAIT_MS, a.st[0].uid);
		}
		if (!busy)
			usleep(500);
	}
	if (plan.binder)
		acc_destroy(&a);
	report((struct rec){ .type = R_EXIT, .uid = plan.uid });
	return 0;
}

/* ---- the driver ------------------------------------------------------- */

struct child {
	pid_t pid;
	int node, binder, ctl, hello, own_done, x_sent, killed, reaped, exited_ok, refs;
	uint32_t peer;
	int peer_reported;
	uint64_t t_spawn, t_kill, t_end, mem_addr;
	uint32_t rkey;
};

static struct child kids[MAX_UID];
static uint32_t next_uid = 1;
static int failed;
static struct rec *recs;
static size_t nrecs, cap_recs;
static uint64_t n_errors[64], n_refused[2];
static uint64_t last_heap;
static uint32_t last_links, last_vqps, last_links_failed, last_links_opened, max_links;
static int got_final, n_sigkilled;
static struct rec final_rec;

#define DFAIL(...)                                                            \
	do {                                                                  \
		printf("FAIL vqp_soak: " __VA_ARGS__);                        \
		printf("\n");                                                 \
		failed = 1;                                                   \
	} while (0)

static void drop_ref(uint32_t uid)
{
	struct child *k = &kids[uid];

	if (k->peer && !k->peer_reported) {
		k->peer_reported = 1;
		kids[k->peer].refs--;
	}
}

static void handle(struct rec r)
{
	if (r.uid >= MAX_UID) {
		DFAIL("a record with uid %u", r.uid);
		return;
	}
	switch (r.type) {
	case R_HELLO:
		kids[r.uid].hello = 1;
		kids[r.uid].mem_addr = r.x;
		kids[r.uid].rkey = (uint32_t)r.y;
		break;
	case R_DONE:
	case R_RX:
		if (nrecs == cap_recs) {
			cap_recs = cap_recs ? 2 * cap_recs : 4096;
			recs = realloc(recs, cap_recs * sizeof(*recs));
			CT_CHECK(recs != NULL, "realloc");
		}
		recs[nrecs++] = r;
		if (r.type == R_DONE && r.a != 0)
			drop_ref(r.uid);
		break;
	case R_FAIL:
		/* An error (or a refused qconnect) on a client's VQP: only
		 * ever towards a killed peer. */
		if (r.a == 0 || !kids[r.a].killed)
			DFAIL("uid %u: error %u on its VQP to uid %u, which was not killed", r.uid, r.c, r.a);
		if (r.c >= 1000)
			n_refused[r.c == 1000 + ECONNREFUSED ? 0 : 1]++;
		else
			n_errors[r.c < 64 ? r.c : 63]++;
		drop_ref(r.uid);
		break;
	case R_ACC_ERR:
		if (!peer_death_status(r.c))
			DFAIL("acceptor uid %u: echo to uid %u completed with %s", r.uid, r.a,
			      ibv_wc_status_str((enum ibv_wc_status)r.c));
		if (r.a >= MAX_UID || !kids[r.a].killed)
			DFAIL("acceptor uid %u: echo error %s on the src_qp of uid %u, which was not killed", r.uid,
			      ibv_wc_status_str((enum ibv_wc_status)r.c), r.a);
		n_errors[r.c < 64 ? r.c : 63]++;
		break;
	case R_OWN_DONE:
		kids[r.uid].own_done = 1;
		break;
	case R_EXIT:
		kids[r.uid].exited_ok = 1;
		break;
	case R_STAT:
		last_links = r.a;
		last_vqps = r.b;
		last_links_failed = r.c;
		last_links_opened = r.d;
		last_heap = r.x;
		if (r.a > max_links)
			max_links = r.a;
		break;
	case R_FINAL:
		got_final = 1;
		final_rec = r;
		break;
	default:
		DFAIL("record type %u", r.type);
	}
}

static int rep_rd;

static void drain_reports(int timeout_ms)
{
	struct pollfd pfd = { rep_rd, POLLIN, 0 };

	while (poll(&pfd, 1, timeout_ms) == 1) {
		struct rec r;

		CT_CHECK(read(rep_rd, &r, sizeof(r)) == (ssize_t)sizeof(r), "short report");
		handle(r);
		timeout_ms = 0;
	}
}

static long rss_kb(pid_t pid)
{
	char path[64], line[256];
	long kb = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
			break;
	fclose(f);
	return kb;
}

/* The server's physical QPs as the kernel lists them (rdma resource show
 * qp: one line per QP, "pid N" naming the thread that created it: the
 * application's thread or the library's service thread, so every thread
 * of the server counts). */
static int phys_qps(pid_t pid)
{
	char line[512], path[64];
	int tids[64], ntid = 0, n = 0;
	struct dirent *e;
	DIR *dir;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	dir = opendir(path);
	if (!dir)
		return -1;
	while ((e = readdir(dir)) && ntid < 64)
		if (e->d_name[0] != '.')
			tids[ntid++] = atoi(e->d_name);
	closedir(dir);
	f = popen("rdma resource show qp 2>/dev/null", "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		char *p = strstr(line, " pid ");

		for (int i = 0; p && i < ntid; i++)
			if (atoi(p + 5) == tids[i]) {
				n++;
				break;
			}
	}
	if (pclose(f) != 0)
		return -1;
	return n;
}

static uint64_t env_u64(const char *name, uint64_t def)
{
	const char *v = getenv(name);

	return v && *v ? strtoull(v, NULL, 0) : def;
}

/* Live (not yet reaped) clients, and those that ended within `s` seconds. */
static int recent_clients(uint64_t now, int s)
{
	int n = 0;

	for (uint32_t u = 1; u < next_uid; u++)
		if (!kids[u].reaped || now - kids[u].t_end < (uint64_t)s * 1000000000ull)
			n++;
	return n;
}

static int live_clients(void)
{
	int n = 0;

	for (uint32_t u = 1; u < next_uid; u++)
		n += !kids[u].reaped;
	return n;
}

static void spawn(pid_t srv_pid, uint64_t srv_info[2], uint64_t seed)
{
	uint32_t uid = next_uid++;
	struct child *k = &kids[uid];
	uint32_t cand[MAX_UID];
	int ncand = 0, ctl[2];
	pid_t pid;

	(void)srv_pid;
	memset(&plan, 0, sizeof(plan));
	plan.uid = uid;
	plan.node = 2 + (int)(uid % (NODES - 1));
	plan.binder = rnd() % 100 < P_BINDER;
	plan.rounds = (int)rnd_in(1, 4);
	plan.srv_addr = srv_info[0];
	plan.srv_rkey = (uint32_t)srv_info[1];
	plan.seed = seed;
	/* A peer: a live binder that said hello and has not finished. */
	for (uint32_t u = 1; u < uid; u++)
		if (kids[u].binder && kids[u].hello && !kids[u].own_done && !kids[u].killed && !kids[u].reaped)
			cand[ncand++] = u;
	if (ncand > 0 && rnd() % 100 < P_PEER) {
		uint32_t p = cand[rnd() % (uint32_t)ncand];

		plan.peer = p;
		plan.peer_node = kids[p].node;
		plan.peer_addr = kids[p].mem_addr;
		plan.peer_rkey = kids[p].rkey;
		kids[p].refs++;
	}
	memset(k, 0, sizeof(*k));
	k->node = plan.node;
	k->binder = plan.binder;
	k->peer = plan.peer;
	k->t_spawn = ct_now_ns();
	if (rnd() % 100 < P_KILL)
		k->t_kill = k->t_spawn + (uint64_t)rnd_in(50, 4000) * 1000000ull;
	CT_CHECK(pipe(ctl) == 0, "pipe");
	fflush(stdout);
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		close(ctl[1]);
		close(rep_rd);
		for (uint32_t u = 1; u < uid; u++)
			if (!kids[u].reaped && kids[u].ctl >= 0)
				close(kids[u].ctl);
		ctl_fd = ctl[0];
		fcntl(ctl_fd, F_SETFL, O_NONBLOCK);
		_exit(client_main());
	}
	close(ctl[0]);
	k->ctl = ctl[1];
	k->pid = pid;
}

static void reap(void)
{
	for (uint32_t u = 1; u < next_uid; u++) {
		struct child *k = &kids[u];
		int st;

		if (k->reaped || waitpid(k->pid, &st, WNOHANG) != k->pid)
			continue;
		k->reaped = 1;
		k->t_end = ct_now_ns();
		close(k->ctl);
		k->ctl = -1;
		if (k->killed && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) {
			n_sigkilled++;
			/* Its report of the peer stream will never come. */
			drop_ref(u);
			continue;
		}
		drain_reports(0);
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || !k->exited_ok)
			DFAIL("client uid %u (pid %d) ended with status %#x%s", u, k->pid, st,
			      k->killed ? " (it was being killed)" : "");
		drop_ref(u);
	}
}

/* Tell finished clients to exit; kill the ones whose time came. */
static void steer(uint64_t now, int *nkilled)
{
	for (uint32_t u = 1; u < next_uid; u++) {
		struct child *k = &kids[u];

		if (k->reaped || k->killed)
			continue;
		if (k->t_kill && now >= k->t_kill && !k->x_sent) {
			k->killed = 1;
			kill(k->pid, SIGKILL);
			(*nkilled)++;
			continue;
		}
		if (k->own_done && !k->x_sent && k->refs == 0) {
			k->x_sent = 1;
			if (write(k->ctl, "X", 1) != 1)
				DFAIL("uid %u: control pipe: %s", u, strerror(errno));
		}
	}
}

int main(void)
{
	uint64_t soak_s = env_u64("KRCORE_SOAK_S", 300);
	uint64_t seed = env_u64("KRCORE_SOAK_SEED", (uint64_t)time(NULL));
	int max_live = (int)env_u64("KRCORE_SOAK_CLIENTS", 6);
	uint64_t warm_s = soak_s / 5 < 60 ? soak_s / 5 : 60;
	uint64_t t0, t_end, t_sample, t_last_spawn = 0;
	uint64_t heap_first, heap_warm = 0, srv_info[2], rss_warm = 0, rss_max_after = 0, rss_first = 0;
	int nkilled = 0, qps_base = -1, qps_max = -1, srv_ctl[2], rp[2];
	pid_t meta_pid, srv_pid;
	int st;

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	rng_state = seed * 0x2545f4914f6cdd1dull + 1;
	(void)rnd();
	printf("NOTE vqp_soak: %llu s, seed %llu (KRCORE_SOAK_SEED), %d clients at once, warm-up %llu s\n",
	       (unsigned long long)soak_s, (unsigned long long)seed, max_live, (unsigned long long)warm_s);
	/* Read once per process at its first use of the library. */
	setenv("KRCORE_META_LEASE_MS", "3000", 0);
	setenv("KRCORE_LINK_PROBE_MS", "1000", 0);
	/* The watchdog of every process: a last resort behind the bounded
	 * waits. */
	{
		char w[32];

		snprintf(w, sizeof(w), "%llu", (unsigned long long)(soak_s + 900));
		setenv("CT_WATCHDOG", w, 1);
		ct_watchdog((unsigned)(soak_s + 900));
	}
	ct_begin("vqp_soak");
	ct_watchdog((unsigned)(soak_s + 900));
	meta_pid = ct_start_meta_slots(16384);
	CT_CHECK(pipe(rp) == 0 && pipe(info_pipe) == 0 && pipe(srv_ctl) == 0, "pipe");
	rep_fd = rp[1];
	rep_rd = rp[0];
	ctl_fd = srv_ctl[0];
	fcntl(srv_ctl[0], F_SETFL, O_NONBLOCK);
	srv_pid = ct_fork_ready(server_role, "the server");
	close(srv_ctl[0]);
	CT_CHECK(read(info_pipe[0], srv_info, sizeof(srv_info)) == sizeof(srv_info), "server info");
	/* A first STAT, then a quiet moment (the warm QP pool refilled). */
	{
		uint64_t t = ct_now_ns();

		while (!last_heap && ms_since(t) < 10000)
			drain_reports(100);
		CT_CHECK(last_heap != 0, "no statistics from the server");
		drain_reports(1500);
	}
	qps_base = phys_qps(srv_pid);
	rss_first = (uint64_t)rss_kb(srv_pid);
	heap_first = last_heap;
	printf("NOTE vqp_soak: server pid %d: %llu kB RSS, %d physical QPs before the first client\n", srv_pid,
	       (unsigned long long)rss_first, qps_base);
	if (qps_base < 0)
		printf("NOTE vqp_soak: `rdma resource show qp` unavailable: physical QPs from the links gauge only\n");

	t0 = ct_now_ns();
	t_end = t0 + soak_s * 1000000000ull;
	t_sample = t0;
	for (;;) {
		uint64_t now = ct_now_ns();
		int live;

		drain_reports(20);
		reap();
		now = ct_now_ns();
		steer(now, &nkilled);
		live = live_clients();
		if (now < t_end && !failed && live < max_live && next_uid < MAX_UID &&
		    now - t_last_spawn > 100000000ull) {
			spawn(srv_pid, srv_info, seed);
			t_last_spawn = now;
		}
		if (now >= t_sample) {
			double t = (double)(now - t0) / 1e9;
			long rss = rss_kb(srv_pid);
			int q = qps_base >= 0 ? phys_qps(srv_pid) : -1;
			int recent = recent_clients(now, LINK_WINDOW_S);

			t_sample += SAMPLE_S * 1000000000ull;
			printf("SAMPLE t=%.0fs started=%u live=%d killed=%d rss_kb=%ld heap_kb=%llu links=%u vqps=%u "
			       "links_opened=%u links_failed=%u phys_qps=%d\n",
			       t, next_uid - 1, live, nkilled, rss, (unsigned long long)last_heap / 1024, last_links,
			       last_vqps, last_links_opened, last_links_failed, q);
			if (q > qps_max)
				qps_max = q;
			if ((int)last_links > recent)
				DFAIL("at %.0f s the server has %u links, but only %d client processes were alive in the last %d s",
				      t, last_links, recent, LINK_WINDOW_S);
			if (q >= 0 && q > qps_base + recent)
				DFAIL("at %.0f s the server has %d physical QPs: more than %d before the first client + %d recent client processes",
				      t, q, qps_base, recent);
			if (rss > 0 && t >= (double)warm_s) {
				if (!rss_warm) {
					rss_warm = (uint64_t)rss;
					heap_warm = last_heap;
				}
				if ((uint64_t)rss > rss_max_after)
					rss_max_after = (uint64_t)rss;
			}
		}
		if ((now >= t_end || failed) && live == 0)
			break;
		if (now >= t_end + 240 * 1000000000ull) {
			DFAIL("%d clients still running 240 s after the end (a hang)", live);
			for (uint32_t u = 1; u < next_uid; u++)
				if (!kids[u].reaped) {
					printf("  uid %u pid %d own_done %d refs %d x_sent %d\n", u, kids[u].pid,
					       kids[u].own_done, kids[u].refs, kids[u].x_sent);
					kill(kids[u].pid, SIGKILL);
					kids[u].killed = 1;
				}
		}
	}
	/* Every client is gone: the server's streams must all close and its
	 * links go; then it exits. */
	{
		uint64_t t_stop = ct_now_ns();
		long rss_end;
		int q_end;

		drain_reports(0);
		CT_CHECK(write(srv_ctl[1], "S", 1) == 1, "stop");
		while (!got_final && ms_since(t_stop) < 90000)
			drain_reports(100);
		rss_end = rss_kb(srv_pid);
		q_end = qps_base >= 0 ? phys_qps(srv_pid) : -1;
		if (got_final)
			CT_CHECK(write(srv_ctl[1], "Q", 1) == 1, "quit");
		else
			kill(srv_pid, SIGKILL);
		if (ct_wait_child(srv_pid, "the server"))
			DFAIL("the server failed");
		drain_reports(0);
		if (!got_final)
			DFAIL("the server never reported its end");
		printf("NOTE vqp_soak: the server after the last client: %u streams open, %u links, %u VQPs, "
		       "%ld kB RSS, %d physical QPs (%d before the first client), %.1f s to close everything\n",
		       final_rec.a, final_rec.b, final_rec.c, rss_end, q_end, qps_base, ms_since(t_stop) / 1e3);
		if (q_end >= 0 && q_end != qps_base)
			DFAIL("the server ends with %d physical QPs, %d before the first client", q_end, qps_base);
		if (rss_warm && rss_max_after > rss_warm + RSS_SLACK_KB)
			DFAIL("the server's RSS grew from %llu kB (warm-up) to %llu kB",
			      (unsigned long long)rss_warm, (unsigned long long)rss_max_after);
		if (rss_warm && rss_end > 0 && (uint64_t)rss_end > rss_warm + RSS_SLACK_KB)
			DFAIL("the server's RSS at the end %ld kB, %llu kB at warm-up", rss_end,
			      (unsigned long long)rss_warm);
		printf("NOTE vqp_soak: server heap in use (mallinfo2) %llu kB before the first client, %llu kB at warm-up, %llu kB at the end (bound: before + %d kB)\n",
		       (unsigned long long)heap_first / 1024, (unsigned long long)heap_warm / 1024,
		       (unsigned long long)final_rec.y / 1024, HEAP_SLACK_KB);
		if (got_final && final_rec.y > heap_first + HEAP_SLACK_KB * 1024ull)
			DFAIL("the server's heap in use grew from %llu kB before the first client to %llu kB after the last",
			      (unsigned long long)heap_first / 1024, (unsigned long long)final_rec.y / 1024);
		if (rss_end > 0 && (uint64_t)rss_end > rss_first + RSS_END_SLACK_KB)
			DFAIL("the server's RSS after the last client %ld kB, %llu kB before the first", rss_end,
			      (unsigned long long)rss_first);
		printf("NOTE vqp_soak: server RSS %llu kB before the first client, %llu kB at warm-up (%llu s), max %llu kB after it, %ld kB at the end (bound: warm-up + %d kB)\n",
		       (unsigned long long)rss_first, (unsigned long long)rss_warm, (unsigned long long)warm_s,
		       (unsigned long long)rss_max_after, rss_end, RSS_SLACK_KB);
	}
	/* Cross-check: each stream a client finished was counted the same by
	 * its acceptor, and each stream an acceptor closed from a client not
	 * killed was finished by that client. */
	{
		uint64_t acc_msgs = 0, echoes = 0, reads = 0, streams = 0, killed_streams = 0;

		for (size_t i = 0; i < nrecs; i++) {
			struct rec *r = &recs[i];

			if (r->type == R_DONE) {
				int found = 0;

				echoes += r->c;
				reads += r->d;
				streams++;
				for (size_t j = 0; j < nrecs && !found; j++)
					if (recs[j].type == R_RX && recs[j].uid == r->a && recs[j].a == r->uid &&
					    recs[j].b == r->b) {
						found = 1;
						if (recs[j].c != r->c)
							DFAIL("uid %u round %u: %u messages sent and echoed, %u received by uid %u",
							      r->uid, r->b, r->c, recs[j].c, r->a);
					}
				if (!found && !(r->a != 0 && kids[r->a].killed))
					DFAIL("uid %u round %u to uid %u: finished, never closed at the acceptor",
					      r->uid, r->b, r->a);
			} else {
				int found = 0;

				acc_msgs += r->c;
				if (r->a < MAX_UID && kids[r->a].killed) {
					killed_streams++;
					continue;
				}
				for (size_t j = 0; j < nrecs && !found; j++)
					found = recs[j].type == R_DONE && recs[j].uid == r->a && recs[j].a == r->uid &&
						recs[j].b == r->b;
				if (!found)
					DFAIL("acceptor uid %u closed a stream of uid %u round %u (%u messages) the client never finished",
					      r->uid, r->a, r->b, r->c);
			}
		}
		{
			int killed_real = 0, binders = 0, connectors = 0;
			uint64_t errs = 0;

			for (uint32_t u = 1; u < next_uid; u++) {
				killed_real += kids[u].killed;
				binders += kids[u].binder;
				connectors += kids[u].peer != 0;
			}
			for (int s = 0; s < 64; s++)
				errs += n_errors[s];
			printf("NOTE vqp_soak: %.0f s, %u client processes (%d binders, %d connecting to a binder), %d killed (%d died of the SIGKILL, the others had just exited); "
			       "%llu streams finished and cross-checked (%llu closed by a killed sender), %llu messages verified at acceptors, "
			       "%llu echoes and %llu READs verified at clients\n",
			       (double)(ct_now_ns() - t0) / 1e9, next_uid - 1, binders, connectors, killed_real, n_sigkilled,
			       (unsigned long long)streams, (unsigned long long)killed_streams,
			       (unsigned long long)acc_msgs, (unsigned long long)echoes, (unsigned long long)reads);
			printf("NOTE vqp_soak: %llu error completions, all on VQPs to killed peers: RETRY_EXC_ERR %llu, WR_FLUSH_ERR %llu, REM_OP_ERR %llu; qconnect to a killed binder: %llu ECONNREFUSED, %llu ETIMEDOUT\n",
			       (unsigned long long)errs, (unsigned long long)n_errors[IBV_WC_RETRY_EXC_ERR],
			       (unsigned long long)n_errors[IBV_WC_WR_FLUSH_ERR],
			       (unsigned long long)n_errors[IBV_WC_REM_OP_ERR], (unsigned long long)n_refused[0],
			       (unsigned long long)n_refused[1]);
			printf("NOTE vqp_soak: the server's links: max %u (bound: client processes alive in the last %d s), %u opened, %u failed; physical QPs max %d (%d before the first client)\n",
			       max_links, LINK_WINDOW_S, last_links_opened, last_links_failed, qps_max, qps_base);
		}
	}
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, &st, 0);
	if (failed) {
		printf("FAIL vqp_soak (seed %llu)\n", (unsigned long long)seed);
		return 1;
	}
	ct_pass();
	return 0;
}
