/*
 * What a VQP refuses or tolerates so that its shared link never fails
 * (issue 18, items 3, 5 and 6). A server process bound with qbind on node 1
 * and this process (the client) on node 2; krcore-meta started here.
 *
 * - zero-length SGEs at NULL addresses between real ones: SEND inline and
 *   not (a small message, and a 9000-byte one, staged), WRITE inline and
 *   not (read back): every message arrives byte for byte with the right
 *   byte_len (the server checks each), and the library never makes a
 *   slice from NULL: ASan/UBSan do not see into Rust code, but a library
 *   built with RUSTFLAGS='-C debug-assertions' (Rust's UB checks) aborts
 *   here when it does ("slice::from_raw_parts requires the pointer to be
 *   aligned and non-null", the inline copy before issue 18);
 * - a message one byte above the port's max_msg_sz (SEND, and a READ of
 *   two SGEs): EINVAL with *bad_wr at it, nothing posted;
 * - an MR registered with IBV_ACCESS_ON_DEMAND or IBV_ACCESS_ZERO_BASED
 *   (when the device accepts the registration): a WRITE or SEND from it
 *   is EINVAL with *bad_wr, never posted on the link;
 * - after all of that the link still carries checked data, and
 *   links_failed is 0 on both sides.
 *
 * `vqp_guard victim` is the other side of tests/rdma_guard.rs: a bound VQP
 * that must never deliver a message whose header lies about its length.
 * `vqp_guard stager` is the other side of tests/rdma_staging.rs: a bound
 * VQP answering each request with a large (staged) message.
 * `vqp_guard holder` and `vqp_guard flooder` are the two sides of its
 * window test: a bound VQP that posts receives only when told, and an
 * honest sender that floods it.
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 7100
#define NBUF 16
#define SLOT 16384		/* one receive buffer of the server */
#define WAREA (NBUF * SLOT)	/* the server's WRITE area, after them */
#define WLEN 65536
#define BIG 9000		/* above a library receive buffer: staged */
#define NMSG 5			/* SENDs the server checks */
/* Above this max_msg_sz the refusal is not checked (no such buffers). */
#define MAX_TESTED (64u << 20)

static int info_pipe[2];
/* client -> server: its last check done (the server's memory and QP must
 * outlive the client's last WRITE and READ of it). */
static int done_pipe[2];

/* Message k of the client: ct_fill(seed 100 + k) of len[k] bytes. */
static const uint32_t msg_len[NMSG] = { 100, 100, BIG, 3000, 64 };

static void node_close(struct ct_node *n)
{
	ct_buf_free(&n->b);
	CT_OK(ibv_destroy_cq(n->scq));
	CT_OK(ibv_destroy_cq(n->rcq));
	ct_close(&n->d);
}

static void post_recv_slot(struct ibv_qp *qp, struct ct_node *n, int i)
{
	ct_post_recv1(qp, (uint64_t)i, &n->b, (size_t)i * SLOT, SLOT);
}

static int server(int ready_fd)
{
	struct ct_buf big = { 0 };
	struct ct_node n;
	struct ibv_qp *qp;
	int seen = 0;

	ct_node_open(&n, 1, WAREA + WLEN, 256);
	qp = ct_node_vqp(&n, 16, NBUF);
	for (int i = 0; i < NBUF; i++)
		post_recv_slot(qp, &n, i);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	/* A remote MR larger than max_msg_sz: a READ of max_msg_sz + 1 bytes
	 * from it breaks no rule but the length. */
	if (n.d.port_attr.max_msg_sz <= MAX_TESTED)
		ct_buf_alloc(&big, n.d.pd, (size_t)n.d.port_attr.max_msg_sz + 4096);
	{
		uint64_t info[4] = { (uintptr_t)n.b.p + WAREA, n.b.mr->rkey,
				     (uintptr_t)big.p, big.mr ? big.mr->rkey : 0 };

		CT_CHECK(write(info_pipe[1], info, sizeof(info)) == sizeof(info), "info");
	}
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* Messages carry their index in imm: check each byte for byte. */
	while (seen < NMSG) {
		struct ibv_qp *src[4];
		struct ibv_wc wc[4];
		int k = qpop_msgs(qp, 4, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		for (int i = 0; i < k; i++) {
			uint32_t m = ntohl(wc[i].imm_data);

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "message status %s",
				 ibv_wc_status_str(wc[i].status));
			CT_CHECK(m == (uint32_t)seen, "message %u, expected %d", m, seen);
			CT_CHECK(wc[i].byte_len == msg_len[m], "message %u: byte_len %u, sent %u",
				 m, wc[i].byte_len, msg_len[m]);
			ct_expect_pattern(n.b.p + wc[i].wr_id * SLOT, msg_len[m], 100 + m,
					  "a message with NULL zero-length SGEs");
			post_recv_slot(qp, &n, (int)wc[i].wr_id);
			seen++;
		}
		if (k == 0)
			usleep(1000);
	}
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	printf("server: %d messages checked\n", seen);
	{
		char c;

		/* End of file if the client died first. */
		close(done_pipe[1]);
		CT_CHECK(read(done_pipe[0], &c, 1) == 1, "the client's last check");
	}
	CT_OK(ibv_destroy_qp(qp));
	if (big.mr)
		ct_buf_free(&big);
	node_close(&n);
	return 0;
}

/* Post one WR; its completion must be a success. */
static void post_ok(struct ct_node *n, struct ibv_qp *qp, struct ibv_send_wr *wr)
{
	struct ibv_send_wr *bad = NULL;
	struct ibv_wc wc;

	wr->send_flags |= IBV_SEND_SIGNALED;
	CT_OK(ibv_post_send(qp, wr, &bad));
	ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == wr->wr_id,
		 "wr %llu: status %s, wr_id %llu", (unsigned long long)wr->wr_id,
		 ibv_wc_status_str(wc.status), (unsigned long long)wc.wr_id);
}

/* Post one WR that the pre-checks must refuse: EINVAL, *bad_wr at it, no
 * completion. */
static void post_refused(struct ct_node *n, struct ibv_qp *qp, struct ibv_send_wr *wr,
			 const char *what)
{
	struct ibv_send_wr *bad = NULL;
	int rc;

	wr->send_flags |= IBV_SEND_SIGNALED;
	rc = ibv_post_send(qp, wr, &bad);
	CT_CHECK(rc == EINVAL, "%s: ibv_post_send returned %d, expected EINVAL", what, rc);
	CT_CHECK(bad == wr, "%s: *bad_wr %p, expected %p", what, (void *)bad, (void *)wr);
	ct_expect_quiet(n->scq, 50, what);
}

/* SEND of message m from buf (filled here) with a NULL zero-length SGE
 * between its two halves. */
static void send_msg(struct ct_node *n, struct ibv_qp *qp, uint32_t m, uint8_t *buf,
		     uint32_t lkey, unsigned flags)
{
	uint32_t len = msg_len[m], half = len / 2;
	struct ibv_sge sge[3] = { { (uintptr_t)buf, half, lkey }, { 0, 0, 0 },
				  { (uintptr_t)buf + half, len - half, lkey } };
	struct ibv_send_wr wr = { .wr_id = 1000 + m, .sg_list = sge, .num_sge = 3,
				  .opcode = IBV_WR_SEND_WITH_IMM, .send_flags = flags,
				  .imm_data = htonl(m) };

	ct_fill(buf, len, 100 + m);
	post_ok(n, qp, &wr);
}

/* WRITE of len bytes (pattern seed) at the server's WRITE area + off with
 * a NULL zero-length SGE first, then READ back and compared. */
static void write_and_check(struct ct_node *n, struct ibv_qp *qp, const uint64_t info[2],
			    size_t off, uint32_t len, unsigned flags, uint32_t seed)
{
	uint8_t *src = n->b.p, *back = n->b.p + WLEN;
	struct ibv_sge sge[2] = { { 0, 0, n->b.mr->lkey }, { (uintptr_t)src, len, n->b.mr->lkey } };
	struct ibv_send_wr wr = { .wr_id = 2000 + seed, .sg_list = sge, .num_sge = 2,
				  .opcode = IBV_WR_RDMA_WRITE, .send_flags = flags };

	ct_fill(src, len, seed);
	wr.wr.rdma.remote_addr = info[0] + off;
	wr.wr.rdma.rkey = (uint32_t)info[1];
	post_ok(n, qp, &wr);
	memset(back, 0, len);
	{
		struct ibv_sge rs = { (uintptr_t)back, len, n->b.mr->lkey };
		struct ibv_send_wr rd = { .wr_id = 3000 + seed, .sg_list = &rs, .num_sge = 1,
					  .opcode = IBV_WR_RDMA_READ };

		rd.wr.rdma.remote_addr = info[0] + off;
		rd.wr.rdma.rkey = (uint32_t)info[1];
		post_ok(n, qp, &rd);
	}
	ct_expect_pattern(back, len, seed, "a WRITE with a NULL zero-length SGE, read back");
}

static int client(const uint64_t info[4])
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint32_t max = 0;
	uint8_t *sbuf;

	ct_node_open(&n, 2, 4 * WLEN, 64);
	qp = ct_create_vqp(&n.d, n.scq, n.rcq, (struct ct_qp_caps){ 16, 4, 3, 1, 128, 0 }, NULL);
	CT_OK(qconnect(qp, ct_node_gid(1), PORT));
	sbuf = n.b.p + 2 * WLEN;

	ct_begin("vqp_guard: zero-length SGEs at NULL (SEND, WRITE; inline and not)");
	send_msg(&n, qp, 0, sbuf, n.b.mr->lkey, 0);
	send_msg(&n, qp, 1, sbuf, n.b.mr->lkey, IBV_SEND_INLINE);
	send_msg(&n, qp, 2, sbuf, n.b.mr->lkey, 0);	/* staged */
	write_and_check(&n, qp, info, 0, 4000, 0, 7);
	write_and_check(&n, qp, info, 8192, 100, IBV_SEND_INLINE, 8);
	{
		/* Only NULL zero-length SGEs: a 0-byte WRITE, inline and not. */
		struct ibv_sge z[2] = { { 0, 0, n.b.mr->lkey }, { 0, 0, 0 } };
		struct ibv_send_wr wr = { .wr_id = 50, .sg_list = z, .num_sge = 2,
					  .opcode = IBV_WR_RDMA_WRITE };

		wr.wr.rdma.remote_addr = info[0];
		wr.wr.rdma.rkey = (uint32_t)info[1];
		post_ok(&n, qp, &wr);
		wr.wr_id = 51;
		wr.send_flags = IBV_SEND_INLINE;
		post_ok(&n, qp, &wr);
	}
	ct_pass();

	ct_begin("vqp_guard: a message above the port's max_msg_sz is refused");
	max = n.d.port_attr.max_msg_sz;
	ct_note("port max_msg_sz %u, atomic_cap %d", max, (int)n.d.dev_attr.atomic_cap);
	if (max <= MAX_TESTED && info[3] != 0) {
		/* Every SGE inside its MR, local and remote: only the length is
		 * wrong. */
		struct ct_buf big;

		ct_buf_alloc(&big, n.d.pd, (size_t)max + 4096);
		struct ibv_sge one = { (uintptr_t)big.p, max + 1, big.mr->lkey };
		struct ibv_send_wr wr = { .wr_id = 60, .sg_list = &one, .num_sge = 1,
					  .opcode = IBV_WR_SEND };
		struct ibv_sge two[2] = { { (uintptr_t)big.p, max / 2 + 1, big.mr->lkey },
					  { (uintptr_t)big.p + max / 2 + 1, max - max / 2, big.mr->lkey } };
		struct ibv_send_wr rd = { .wr_id = 61, .sg_list = two, .num_sge = 2,
					  .opcode = IBV_WR_RDMA_READ };

		post_refused(&n, qp, &wr, "a SEND of max_msg_sz + 1 bytes");
		rd.wr.rdma.remote_addr = info[2];
		rd.wr.rdma.rkey = (uint32_t)info[3];
		post_refused(&n, qp, &rd, "a READ of max_msg_sz + 1 bytes in two SGEs");
		/* At the limit it is not refused: a READ of max_msg_sz bytes. */
		two[0].length = max / 2;
		rd.wr_id = 62;
		post_ok(&n, qp, &rd);
		ct_buf_free(&big);
	} else {
		ct_note("max_msg_sz above %u: not checked", MAX_TESTED);
	}
	ct_pass();

	ct_begin("vqp_guard: ON_DEMAND and ZERO_BASED MRs are refused at post");
	{
		static const struct { int flag; const char *name; } odd[] = {
			{ IBV_ACCESS_ON_DEMAND, "IBV_ACCESS_ON_DEMAND" },
			{ IBV_ACCESS_ZERO_BASED, "IBV_ACCESS_ZERO_BASED" },
		};
		uint8_t *obuf = n.b.p + 3 * WLEN;

		for (size_t k = 0; k < sizeof(odd) / sizeof(odd[0]); k++) {
			struct ibv_mr *mr = ibv_reg_mr(n.d.pd, obuf, 4096,
						       IBV_ACCESS_LOCAL_WRITE | odd[k].flag);

			if (!mr) {
				ct_note("the device refuses %s MRs (errno %d): nothing to post",
					odd[k].name, errno);
				continue;
			}
			{
				struct ibv_sge s = { (uintptr_t)obuf, 64, mr->lkey };
				struct ibv_send_wr w = { .wr_id = 70, .sg_list = &s, .num_sge = 1,
							 .opcode = IBV_WR_RDMA_WRITE };
				struct ibv_send_wr snd = { .wr_id = 71, .sg_list = &s, .num_sge = 1,
							   .opcode = IBV_WR_SEND };

				w.wr.rdma.remote_addr = info[0];
				w.wr.rdma.rkey = (uint32_t)info[1];
				post_refused(&n, qp, &w, odd[k].name);
				post_refused(&n, qp, &snd, odd[k].name);
			}
			ct_note("%s: refused", odd[k].name);
			CT_OK(ibv_dereg_mr(mr));
		}
	}
	ct_pass();

	ct_begin("vqp_guard: the link still carries checked data");
	send_msg(&n, qp, 3, sbuf, n.b.mr->lkey, 0);
	send_msg(&n, qp, 4, sbuf, n.b.mr->lkey, IBV_SEND_INLINE);
	write_and_check(&n, qp, info, 16384, 5000, 0, 9);
	CT_KRCORE_STAT(KRCORE_STAT_LINKS_FAILED, ==, 0);
	CT_CHECK(write(done_pipe[1], "D", 1) == 1, "done");
	ct_pass();
	CT_OK(ibv_destroy_qp(qp));
	node_close(&n);
	return 0;
}

/* The side of tests/rdma_guard.rs: a bound VQP on node 1 (its own meta
 * server); a message must arrive, never one whose header lies. Prints
 * "victim ready <meta> <port>", then "victim refused" once the library
 * dropped a malformed message (and failed the link), or "victim
 * delivered <byte_len>" if it handed one to the application. */
static int victim(void)
{
	struct ct_node n;
	struct ibv_qp *qp;

	ct_watchdog(120);
	ct_start_meta();
	ct_node_open(&n, 1, NBUF * SLOT, 64);
	qp = ct_node_vqp(&n, 4, NBUF);
	/* Stale bytes a forged length would expose. */
	memset(n.b.p, 0xee, n.b.len);
	for (int i = 0; i < NBUF; i++)
		post_recv_slot(qp, &n, i);
	CT_OK(qbind(qp, ct_node_gid(1), PORT + 1));
	printf("victim ready %s %d\n", getenv("KRCORE_META"), PORT + 1);
	fflush(stdout);
	for (;;) {
		struct ibv_qp *src[4];
		struct ibv_wc wc[4];
		int k = qpop_msgs(qp, 4, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		if (k > 0) {
			printf("victim delivered %u\n", wc[0].byte_len);
			fflush(stdout);
			return 1;
		}
		if (krcore_stat_get(KRCORE_STAT_MSGS_MALFORMED) >= 1 &&
		    krcore_stat_get(KRCORE_STAT_LINKS_FAILED) >= 1) {
			CT_CHECK(qpop_msgs(qp, 4, src, wc) == 0, "a message after the malformed one");
			printf("victim refused\n");
			fflush(stdout);
			return 0;
		}
		usleep(1000);
	}
}

/* The side of tests/rdma_staging.rs: a bound VQP on node 1 (its own meta
 * server) answering each request, 8 bytes (length, seed), through its
 * src_qp with `length` bytes of ct_fill(seed): a message above a receive
 * buffer, so the library stages it and announces it to that sender only.
 * Prints "stager ready <meta> <port>", then "stager sent <length>
 * <status>" once each answer's send completed (the receiver's DONE came,
 * or the link failed); a request of length 0 ends it. */
#define STAGER_MAX (1u << 20)
static int stager(void)
{
	struct ct_node n;
	struct ibv_qp *qp;
	size_t out = NBUF * SLOT;

	ct_watchdog(120);
	ct_start_meta();
	ct_node_open(&n, 1, out + STAGER_MAX, 64);
	qp = ct_node_vqp(&n, 4, NBUF);
	for (int i = 0; i < NBUF; i++)
		post_recv_slot(qp, &n, i);
	CT_OK(qbind(qp, ct_node_gid(1), PORT + 2));
	printf("stager ready %s %d\n", getenv("KRCORE_META"), PORT + 2);
	fflush(stdout);
	for (;;) {
		struct ibv_qp *src;
		struct ibv_wc wc, sw;
		uint32_t req[2];
		int k = qpop_msgs(qp, 1, &src, &wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		if (k == 0) {
			usleep(1000);
			continue;
		}
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == sizeof(req), "a request: %s, %u bytes",
			 ibv_wc_status_str(wc.status), wc.byte_len);
		memcpy(req, n.b.p + wc.wr_id * SLOT, sizeof(req));
		post_recv_slot(qp, &n, (int)wc.wr_id);
		if (req[0] == 0)
			return 0;
		CT_CHECK(req[0] > SLOT && req[0] <= STAGER_MAX, "length %u", req[0]);
		ct_fill(n.b.p + out, req[0], req[1]);
		CT_OK(ct_post_send1(src, 1, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, out, req[0], 0, 0, 0));
		/* Completes with the DONE, after the peer's READs. */
		ct_poll_n(n.scq, &sw, 1, 60000);
		printf("stager sent %u %d\n", req[0], sw.status);
		fflush(stdout);
	}
}

/* The window test's messages (tests/rdma_staging.rs writes them too):
 * WIN_LEN bytes, the sequence number (u32, little-endian), then the
 * number's low byte repeated. */
#define WIN_LEN 4000
static void win_fill(uint8_t *p, uint32_t seq)
{
	memset(p, (int)(seq & 0xff), WIN_LEN);
	memcpy(p, &seq, 4);
}

/* A bound VQP on node 1 (its own meta server, port PORT + 3) that posts
 * no receive until told. Prints "holder ready <meta> <port>", then reads
 * commands on stdin: "take <n> <first>" posts receives and takes the
 * next n messages (sequence numbers first, first + 1, ..., each byte
 * checked), printing "holder took <n> overrun <msgs_overrun>";
 * "wait-rnr <n>" waits (bounded) until the datagram tier answered n
 * packets RNR (their sender's GID held what it may here), printing
 * "holder rnr <dgram_rnr>"; "quit". */
static int holder(void)
{
	struct ct_node n;
	struct ibv_qp *qp;
	char line[64];
	uint8_t want[WIN_LEN];

	ct_watchdog(120);
	ct_start_meta();
	ct_node_open(&n, 1, NBUF * SLOT, 64);
	qp = ct_node_vqp(&n, 4, NBUF);
	CT_OK(qbind(qp, ct_node_gid(1), PORT + 3));
	printf("holder ready %s %d\n", getenv("KRCORE_META"), PORT + 3);
	fflush(stdout);
	int posted = 0;
	while (fgets(line, sizeof(line), stdin)) {
		unsigned k, next;

		if (strncmp(line, "quit", 4) == 0)
			return 0;
		unsigned long long rnrs;

		if (sscanf(line, "wait-rnr %llu", &rnrs) == 1) {
			for (int i = 0; krcore_stat_get(KRCORE_STAT_DGRAM_RNR) < rnrs; i++) {
				CT_CHECK(i < 60000, "no RNR within 60 s");
				usleep(1000);
			}
			printf("holder rnr %llu\n", (unsigned long long)krcore_stat_get(KRCORE_STAT_DGRAM_RNR));
			fflush(stdout);
			continue;
		}
		int parsed = sscanf(line, "take %u %u", &k, &next);

		CT_CHECK(parsed == 2, "a command: %s", line);
		if (!posted) {
			for (int i = 0; i < NBUF; i++)
				post_recv_slot(qp, &n, i);
			posted = 1;
		}
		for (unsigned got = 0; got < k;) {
			struct ibv_qp *src;
			struct ibv_wc wc;
			int r = qpop_msgs(qp, 1, &src, &wc);

			CT_CHECK(r >= 0, "qpop_msgs: %d", r);
			if (r == 0) {
				usleep(200);
				continue;
			}
			CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == WIN_LEN, "message %u: %s, %u bytes", next,
				 ibv_wc_status_str(wc.status), wc.byte_len);
			win_fill(want, next);
			ct_expect_bytes(n.b.p + wc.wr_id * SLOT, want, WIN_LEN, "a held message");
			post_recv_slot(qp, &n, (int)wc.wr_id);
			next++;
			got++;
		}
		printf("holder took %u overrun %llu\n", k, (unsigned long long)krcore_stat_get(KRCORE_STAT_MSGS_OVERRUN));
		fflush(stdout);
	}
	return 1;
}

/* An honest sender on node 2: qconnects to the holder (KRCORE_META, port
 * PORT + 3) and posts `count` messages; prints "flooder posted <k>" after
 * the first `first` and "flooder done <count> <longest post, us>" once
 * every send completed. */
static int flooder(unsigned first, unsigned count)
{
	enum { RING = 32 };
	struct ct_node n;
	struct ibv_qp *qp;
	struct ibv_wc wc[RING];
	unsigned outstanding = 0;
	uint64_t longest = 0;

	ct_watchdog(120);
	ct_node_open(&n, 2, RING * WIN_LEN, 2 * RING);
	qp = ct_node_vqp(&n, RING, 1);
	CT_OK(qconnect(qp, ct_node_gid(1), PORT + 3));
	for (unsigned k = 0; k < count; k++) {
		struct timespec a, b;

		if (outstanding == RING) {
			ct_poll_n(n.scq, wc, 1, 60000);
			CT_CHECK(wc[0].status == IBV_WC_SUCCESS, "send %lu: %s", (unsigned long)wc[0].wr_id,
				 ibv_wc_status_str(wc[0].status));
			outstanding--;
		}
		win_fill(n.b.p + (k % RING) * WIN_LEN, k);
		clock_gettime(CLOCK_MONOTONIC, &a);
		CT_OK(ct_post_send1(qp, k, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, (k % RING) * WIN_LEN, WIN_LEN, 0, 0, 0));
		clock_gettime(CLOCK_MONOTONIC, &b);
		uint64_t us = (uint64_t)(((int64_t)(b.tv_sec - a.tv_sec) * 1000000000 + (b.tv_nsec - a.tv_nsec)) / 1000);
		longest = us > longest ? us : longest;
		outstanding++;
		if (k + 1 == first) {
			printf("flooder posted %u\n", first);
			fflush(stdout);
		}
	}
	ct_poll_n(n.scq, wc, (int)outstanding, 60000);
	for (unsigned i = 0; i < outstanding; i++)
		CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "a send: %s", ibv_wc_status_str(wc[i].status));
	printf("flooder done %u %llu\n", count, (unsigned long long)longest);
	fflush(stdout);
	return 0;
}

int main(int argc, char **argv)
{
	uint64_t info[4];
	pid_t meta_pid, srv;
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc > 1 && strcmp(argv[1], "victim") == 0)
		return victim();
	if (argc > 1 && strcmp(argv[1], "stager") == 0)
		return stager();
	if (argc > 1 && strcmp(argv[1], "holder") == 0)
		return holder();
	if (argc > 3 && strcmp(argv[1], "flooder") == 0)
		return flooder((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]));
	ct_watchdog(300);
	meta_pid = ct_start_meta();
	CT_CHECK(pipe(info_pipe) == 0 && pipe(done_pipe) == 0, "pipe");
	srv = ct_fork_ready(server, "the server (node 1)");
	CT_CHECK(read(info_pipe[0], info, sizeof(info)) == sizeof(info), "info");
	fails += client(info);
	fails += ct_wait_child(srv, "the server");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
