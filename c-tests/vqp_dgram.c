/*
 * The datagram tier (issue 19): first contact without waiting for a link,
 * and the move onto the link. Several processes on several emulated
 * nodes, krcore-meta here, KRCORE_DGRAM=1.
 *
 * A server bound on node 1 echoes every message through its src_qp (with
 * the sender's immediate) and holds registered memory: a pattern, a WRITE
 * area and atomic counters; it asks for no link itself
 * (KRCORE_LINK_AFTER huge): each client's link is the client's.
 *
 * - Client A (node 2, KRCORE_LINK_AFTER=64: its link is asked for after
 *   64 work requests on the tier): right after qconnect, READ, WRITE and
 *   READ back, FETCH_ADD, CMP_SWP and echoes of 1 B to 64 KiB (segmented
 *   above the path MTU), all on the tier (dgram_wrs counts them, no link
 *   yet); an unknown rkey and a READ past its MR complete with
 *   IBV_WC_REM_ACCESS_ERR and put the VQP in the error state (the next
 *   post is flushed), as on RC. Then the move: ROUNDS rounds of
 *   FETCH_ADD, echo and READ with WINDOW rounds in flight while the link
 *   comes up: every FETCH_ADD returns its round (no atomic lost,
 *   duplicated or reordered), every echo comes back once, in order, byte
 *   for byte, every READ is right; dgram_moves counts the move and later
 *   work went on the link.
 * - Client B (node 3, KRCORE_TEST_DGRAM_LOSS=4: a quarter of its
 *   datagrams dropped, and no link asked for): the same rounds, a
 *   20000-byte WRITE read back and a 64 KiB echo, all checked, all on the
 *   tier; then a READ of 64 KiB + 8, above what the tier carries, waits
 *   for a link made for it, and the VQP moves onto that link.
 * - The server counts the requests it served and the two it refused.
 *
 * krcore-meta is found next to the library or through KRCORE_META_BIN.
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5900
#define MSG_MAX 65536
#define NBUF 32
#define RECV_AREA ((size_t)NBUF * MSG_MAX)
#define PATTERN_LEN 65536
#define WRITE_OFF PATTERN_LEN
#define WRITE_LEN 65536
#define CTR_OFF (WRITE_OFF + WRITE_LEN)
#define TARGET_LEN (CTR_OFF + 4096)
#define ROUNDS 300
#define WINDOW 8
#define SEED 77
#define QUIT 0x51554954u
#define QUIT_WRID 1000

struct target {
	uint64_t addr;
	uint32_t rkey;
};

static int info_pipe[2];
static struct target tgt;
static uint8_t pattern[PATTERN_LEN];

static int server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint8_t *target;
	int quits = 0;
	uint64_t t0;

	ct_begin("vqp_dgram: server");
	ct_node_open(&n, 1, RECV_AREA + TARGET_LEN, 1024);
	qp = ct_node_vqp(&n, 64, NBUF);
	target = n.b.p + RECV_AREA;
	ct_fill(target, PATTERN_LEN, SEED);
	for (int i = 0; i < NBUF; i++)
		ct_post_recv1(qp, (uint64_t)i, &n.b, (size_t)i * MSG_MAX, MSG_MAX);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	tgt = (struct target){ (uint64_t)(uintptr_t)target, n.b.mr->rkey };
	ct_oob_write(info_pipe[1], &tgt, sizeof(tgt));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	t0 = ct_now_ns();
	while (quits < 2) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		int k = qpop_msgs(qp, 16, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		CT_CHECK(ct_now_ns() - t0 < 120000000000ull, "clients not done after 120 s");
		for (int i = 0; i < k; i++) {
			uint64_t buf = wc[i].wr_id;
			uint8_t *p = n.b.p + buf * MSG_MAX;
			int imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) != 0, is_quit;
			struct ibv_wc s;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR)
				continue; /* a sender reported closed: its src_qp goes */
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "receive status %d", wc[i].status);
			/* The answer to a QUIT tells its client that every
			 * echo before it completed here (the client may go
			 * right after: its completion is not waited for). */
			is_quit = wc[i].byte_len == 4 && *(uint32_t *)p == QUIT;
			quits += is_quit;
			CT_OK(ct_post_send1(src[i], is_quit ? QUIT_WRID + buf : buf,
					    imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b,
					    buf * MSG_MAX, wc[i].byte_len, 0, 0, imm ? ntohl(wc[i].imm_data) : 0));
			while (!is_quit) {
				s = ct_poll1(n.scq);
				if (s.wr_id >= QUIT_WRID)
					continue; /* a QUIT's answer, whatever became of it */
				CT_CHECK(s.status == IBV_WC_SUCCESS && s.wr_id == buf, "echo: status %d", s.status);
				break;
			}
			ct_post_recv1(qp, buf, &n.b, buf * MSG_MAX, MSG_MAX);
		}
	}
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_SERVED, >=, 20);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_REFUSED, ==, 2);
	ct_note("served %llu one-sided requests on the tier, refused %llu, dropped %llu datagrams",
		(unsigned long long)krcore_stat_get(KRCORE_STAT_DGRAM_SERVED),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_DGRAM_REFUSED),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_DGRAM_DROPPED));
	ct_pass();
	return 0;
}

/* A client: its node, its VQP and a local buffer (receives first). */
struct client {
	struct ct_node n;
	struct ibv_qp *qp;
	uint8_t *out;		/* after the receive buffers */
	int id;
};

static void client_open(struct client *c, int node, int id)
{
	c->id = id;
	ct_node_open(&c->n, node, 2 * RECV_AREA, 1024);
	c->qp = ct_node_vqp(&c->n, 256, NBUF);
	c->out = c->n.b.p + RECV_AREA;
	for (int i = 0; i < NBUF; i++)
		ct_post_recv1(c->qp, (uint64_t)i, &c->n.b, (size_t)i * MSG_MAX, MSG_MAX);
	CT_OK(qconnect(c->qp, ct_node_gid(1), PORT));
}

static struct ibv_wc one(struct ibv_cq *cq, const char *what)
{
	struct ibv_wc wc = ct_poll1(cq);

	CT_CHECK(wc.status == IBV_WC_SUCCESS, "%s: status %s", what, ibv_wc_status_str(wc.status));
	return wc;
}

/* READ len bytes of the server's at off into the out buffer at loff. */
static void read_at(struct client *c, size_t loff, uint64_t off, uint32_t len)
{
	CT_OK(ct_post_send1(c->qp, 1, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &c->n.b, RECV_AREA + loff, len,
			    tgt.addr + off, tgt.rkey, 0));
	one(c->n.scq, "READ");
}

/* Echo `len` bytes (message `seq` of this client) with an immediate. */
static void echo(struct client *c, size_t len, uint32_t seq)
{
	struct ibv_wc wc;
	uint8_t *in;

	ct_fill(c->out, len, seq);
	CT_OK(ct_post_send1(c->qp, 2, IBV_WR_SEND_WITH_IMM, IBV_SEND_SIGNALED, &c->n.b, RECV_AREA, (uint32_t)len, 0,
			    0, seq));
	one(c->n.scq, "SEND");
	wc = one(c->n.rcq, "echo");
	in = c->n.b.p + wc.wr_id * MSG_MAX;
	CT_CHECK(wc.byte_len == len && (wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == seq,
		 "echo of %zu: %u bytes, imm %u", len, wc.byte_len, ntohl(wc.imm_data));
	ct_expect_pattern(in, len, seq, "echo");
	ct_post_recv1(c->qp, wc.wr_id, &c->n.b, wc.wr_id * MSG_MAX, MSG_MAX);
}

/* One-sided work and echoes, checked. */
static void basics(struct client *c)
{
	static const size_t sizes[] = { 1, 100, 1000, 3000, 20000, MSG_MAX };
	uint64_t ctr = CTR_OFF + 8 * (uint64_t)c->id;
	uint64_t *v = (uint64_t *)c->out;

	read_at(c, 0, 0, 64);
	ct_expect_pattern(c->out, 64, SEED, "first READ");
	for (int i = 0; i < 2; i++) {
		uint32_t len = i ? 20000 : 1000;
		uint64_t off = WRITE_OFF + 32768 * (uint64_t)c->id;

		ct_fill(c->out, len, 1000u + (uint32_t)c->id + (uint32_t)i);
		CT_OK(ct_post_send1(c->qp, 3, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED, &c->n.b, RECV_AREA, len,
				    tgt.addr + off, tgt.rkey, 0));
		one(c->n.scq, "WRITE");
		memset(c->out, 0, len);
		read_at(c, 0, off, len);
		ct_expect_pattern(c->out, len, 1000u + (uint32_t)c->id + (uint32_t)i, "WRITE read back");
	}
	CT_OK(ct_post_atomic(c->qp, 4, IBV_WR_ATOMIC_FETCH_AND_ADD, &c->n.b, RECV_AREA, tgt.addr + ctr, tgt.rkey, 5,
			     0));
	one(c->n.scq, "FETCH_ADD");
	CT_CHECK(*v == 0, "FETCH_ADD returned %llu", (unsigned long long)*v);
	CT_OK(ct_post_atomic(c->qp, 5, IBV_WR_ATOMIC_CMP_AND_SWP, &c->n.b, RECV_AREA, tgt.addr + ctr, tgt.rkey, 5,
			     9));
	one(c->n.scq, "CMP_SWP");
	CT_CHECK(*v == 5, "CMP_SWP returned %llu", (unsigned long long)*v);
	read_at(c, 0, ctr, 8);
	CT_CHECK(*v == 9, "counter %llu after CMP_SWP", (unsigned long long)*v);
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		echo(c, sizes[i], 100000u + (uint32_t)i);
}

/* A fresh VQP whose first READ is refused by the target: that WR
 * completes with IBV_WC_REM_ACCESS_ERR, the next is flushed. */
static void refused(struct client *c, uint64_t off, uint32_t len, uint32_t rkey, const char *what)
{
	struct ibv_qp *q = ct_node_vqp(&c->n, 4, 1);
	struct ibv_wc wc;

	CT_OK(qconnect(q, ct_node_gid(1), PORT));
	CT_OK(ct_post_send1(q, 7, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &c->n.b, RECV_AREA, len, tgt.addr + off, rkey,
			    0));
	wc = ct_poll1(c->n.scq);
	CT_CHECK(wc.wr_id == 7 && wc.status == IBV_WC_REM_ACCESS_ERR, "%s: wr %llu status %s", what,
		 (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
	CT_OK(ct_post_send1(q, 8, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &c->n.b, RECV_AREA, 8, tgt.addr, tgt.rkey, 0));
	wc = ct_poll1(c->n.scq);
	CT_CHECK(wc.wr_id == 8 && wc.status == IBV_WC_WR_FLUSH_ERR, "%s: after the error: status %s", what,
		 ibv_wc_status_str(wc.status));
	CT_OK(ibv_destroy_qp(q));
}

/* ROUNDS rounds of FETCH_ADD (returns its round), echo (in order) and
 * READ, WINDOW rounds in flight; 3 work requests a round. */
static void rounds(struct client *c, uint64_t ctr_off)
{
	uint32_t posted = 0, done = 0, echoed = 0;
	int send_done[ROUNDS] = { 0 };

	while (done < ROUNDS || echoed < ROUNDS) {
		while (posted < ROUNDS && posted - done < WINDOW) {
			size_t slot = (size_t)(posted % WINDOW) * 256;
			uint8_t *m = c->out + slot + 64;

			CT_OK(ct_post_atomic(c->qp, 3ull * posted, IBV_WR_ATOMIC_FETCH_AND_ADD, &c->n.b,
					     RECV_AREA + slot, tgt.addr + ctr_off, tgt.rkey, 1, 0));
			ct_fill_msg(m, 64, (uint32_t)c->id, posted);
			CT_OK(ct_post_send1(c->qp, 3ull * posted + 1, IBV_WR_SEND, IBV_SEND_SIGNALED, &c->n.b,
					    RECV_AREA + slot + 64, 64, 0, 0, 0));
			CT_OK(ct_post_send1(c->qp, 3ull * posted + 2, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &c->n.b,
					    RECV_AREA + slot + 128, 128, tgt.addr + (posted % 256) * 128, tgt.rkey,
					    0));
			posted++;
		}
		{
			struct ibv_wc wc;
			int k = ibv_poll_cq(c->n.scq, 1, &wc);

			CT_CHECK(k >= 0, "poll");
			if (k == 1) {
				uint32_t r = (uint32_t)(wc.wr_id / 3);
				size_t slot = (size_t)(r % WINDOW) * 256;

				CT_CHECK(wc.status == IBV_WC_SUCCESS, "round %u wr %llu: %s", r,
					 (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
				uint64_t want_id = 3ull * done + (uint64_t)send_done[done];

				CT_CHECK(wc.wr_id == want_id, "completion %llu out of order (round %u)",
					 (unsigned long long)wc.wr_id, done);
				if (wc.wr_id % 3 == 0) {
					uint64_t got = *(uint64_t *)(c->out + slot);

					CT_CHECK(got == r, "round %u: FETCH_ADD returned %llu", r,
						 (unsigned long long)got);
				} else if (wc.wr_id % 3 == 2) {
					ct_expect_bytes(c->out + slot + 128, pattern + (r % 256) * 128, 128, "a round's READ");
				}
				if (++send_done[done] == 3)
					done++;
			}
		}
		{
			struct ibv_wc wc;
			int k = ibv_poll_cq(c->n.rcq, 1, &wc);

			CT_CHECK(k >= 0, "poll");
			if (k == 1) {
				CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 64, "echo %u: status %s, %u bytes",
					 echoed, ibv_wc_status_str(wc.status), wc.byte_len);
				ct_expect_msg(c->n.b.p + wc.wr_id * MSG_MAX, 64, (uint32_t)c->id, echoed);
				ct_post_recv1(c->qp, wc.wr_id, &c->n.b, wc.wr_id * MSG_MAX, MSG_MAX);
				echoed++;
			}
		}
	}
}

/* Tell the server we are done, wait for its answer (every echo of ours
 * completed there), and free everything. */
static void quit(struct client *c)
{
	struct ibv_wc wc;

	*(uint32_t *)c->out = QUIT;
	CT_OK(ct_post_send1(c->qp, 9, IBV_WR_SEND, IBV_SEND_SIGNALED, &c->n.b, RECV_AREA, 4, 0, 0, 0));
	one(c->n.scq, "QUIT");
	wc = one(c->n.rcq, "the QUIT's answer");
	CT_CHECK(wc.byte_len == 4 && *(uint32_t *)(c->n.b.p + wc.wr_id * MSG_MAX) == QUIT, "the QUIT's answer");
	CT_OK(ibv_destroy_qp(c->qp));
	ct_buf_free(&c->n.b);
	CT_OK(ibv_destroy_cq(c->n.scq));
	CT_OK(ibv_destroy_cq(c->n.rcq));
	ct_close(&c->n.d);
}

static int client_a(void)
{
	struct client c;
	uint64_t tier_before;

	ct_begin("vqp_dgram: first contact on the tier, then the move");
	client_open(&c, 2, 0);
	basics(&c);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, ==, 0);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_WRS, ==, 14);
	refused(&c, 0, 8, tgt.rkey ^ 0x5a5a5a, "unknown rkey");
	refused(&c, TARGET_LEN - 8, 64, tgt.rkey, "READ past the MR");
	tier_before = krcore_stat_get(KRCORE_STAT_DGRAM_WRS);
	rounds(&c, CTR_OFF + 64);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_MOVES, >=, 1);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, >=, 1);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_WRS, <, tier_before + 3 * ROUNDS);
	ct_note("%llu of %d rounds' work requests on the tier before the move",
		(unsigned long long)(krcore_stat_get(KRCORE_STAT_DGRAM_WRS) - tier_before), 3 * ROUNDS);
	quit(&c);
	ct_pass();
	return 0;
}

static int client_b(void)
{
	struct client c;

	ct_begin("vqp_dgram: a lossy network, on the tier only");
	client_open(&c, 3, 1);
	basics(&c);
	rounds(&c, CTR_OFF + 72);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, ==, 0);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_MOVES, ==, 0);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_WRS, ==, 14 + 3 * ROUNDS);
	ct_note("%llu datagrams sent for %llu work requests (a quarter dropped)",
		(unsigned long long)krcore_stat_get(KRCORE_STAT_DGRAM_SENT),
		(unsigned long long)krcore_stat_get(KRCORE_STAT_DGRAM_WRS));
	/* Above 64 KiB the tier carries nothing: this READ waits for a link
	 * (made now, whatever KRCORE_LINK_AFTER says), the VQP moves onto it
	 * and the QUIT goes there too. The READ's last 8 bytes are another
	 * client's WRITE area: its 64 KiB of pattern are checked. */
	memset(c.out, 0, PATTERN_LEN + 8);
	read_at(&c, 0, 0, PATTERN_LEN + 8);
	ct_expect_pattern(c.out, PATTERN_LEN, SEED, "a READ above the tier's bound");
	CT_KRCORE_STAT(KRCORE_STAT_LINKS, ==, 1);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_MOVES, ==, 1);
	quit(&c);
	CT_KRCORE_STAT(KRCORE_STAT_DGRAM_WRS, ==, 14 + 3 * ROUNDS);
	ct_pass();
	return 0;
}

/* A client as a fresh process (exec: the library reads its
 * configuration at its first use, which a forked child would inherit)
 * with `env` ("NAME=value" pairs) set. */
static pid_t spawn_client(const char *role, const char *const *env)
{
	char addr[32], rkey[16];
	pid_t pid;

	snprintf(addr, sizeof(addr), "%llx", (unsigned long long)tgt.addr);
	snprintf(rkey, sizeof(rkey), "%x", tgt.rkey);
	pid = fork();
	CT_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		for (; *env; env++)
			putenv((char *)*env);
		execl("/proc/self/exe", "vqp_dgram", role, addr, rkey, (char *)NULL);
		_exit(127);
	}
	return pid;
}

int main(int argc, char **argv)
{
	static const char *const env_a[] = { "KRCORE_LINK_AFTER=64", NULL };
	static const char *const env_b[] = { "KRCORE_TEST_DGRAM_LOSS=4", "KRCORE_LINK_AFTER=1000000000", NULL };
	pid_t meta, srv, a, b;
	int failed = 0;

	ct_watchdog(240);
	ct_fill(pattern, PATTERN_LEN, SEED);
	if (argc == 4) {
		tgt.addr = strtoull(argv[2], NULL, 16);
		tgt.rkey = (uint32_t)strtoul(argv[3], NULL, 16);
		return strcmp(argv[1], "a") == 0 ? client_a() : client_b();
	}
	setenv("KRCORE_DGRAM", "1", 1);
	/* The server makes no link of its own: client A's comes when A asks
	 * for it, client B never has one. */
	setenv("KRCORE_LINK_AFTER", "1000000000", 1);
	meta = ct_start_meta();
	CT_CHECK(pipe(info_pipe) == 0, "pipe");
	srv = ct_fork_ready(server, "server");
	ct_oob_read(info_pipe[0], &tgt, sizeof(tgt));
	a = spawn_client("a", env_a);
	b = spawn_client("b", env_b);
	failed |= ct_wait_child(a, "client A");
	failed |= ct_wait_child(b, "client B");
	failed |= ct_wait_child(srv, "server");
	kill(meta, SIGTERM);
	waitpid(meta, NULL, 0);
	return failed;
}
