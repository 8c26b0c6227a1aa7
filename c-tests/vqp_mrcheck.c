/*
 * A peer's rkeys are checked with their owner, and guessing them is
 * bounded (issue 20, item 5). A server bound with qbind on node 1 holds two
 * MRs with remote access: one it gives out (address and rkey, through a
 * pipe, as applications do out of band), and a secret one. A client on
 * node 2 connects:
 *
 * - a READ and a WRITE with the given MR's address and rkey move data, byte
 *   for byte (on the datagram tier first, then on the link, where the
 *   client's first use of the rkey asks the server, which answers from its
 *   MRs);
 * - the secret MR's rkey with an address outside it (as one that guessed
 *   the rkey but not the address): EINVAL, nothing posted, as RC would
 *   fail the access;
 * - 48 READs with random rkeys and addresses: each EINVAL; the server
 *   answers at most KRCORE_MR_CHECK_MISSES (16) misses a second from one
 *   GID, so the 50 misses take at least (50 - 16) / 16 s. With the MR
 *   table that any linked peer could READ (before), they took
 *   milliseconds and every rkey of the PD was there to be read;
 * - meanwhile a client on node 3 (another GID) READs the given MR at its
 *   first try, not held up by node 2's guessing;
 * - the server counted each miss (mr_check_misses == 50), and answered
 *   some checks BUSY; no link failed.
 */
#define _GNU_SOURCE
#include "common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 7300
#define LEN 4096
#define GUESSES 48
/* Misses before the flood: the secret rkey at two wrong addresses. */
#define EARLY_MISSES 2
#define RATE 16 /* KRCORE_MR_CHECK_MISSES's default */

static int info_pipe[2];  /* server -> parent: given addr, rkey; secret rkey */
static int done_pipe[2];  /* parent -> server: report your counters */
static int stats_pipe[2]; /* server -> parent: its counters */
/* node 3 -> parent: it READ; parent -> node 3: the server counted, go
 * (a process that exits fails its links at its peers sooner or later). */
static int by_pipe[2], go_pipe[2];

static int server(int ready_fd)
{
	struct ct_node n;
	struct ct_buf secret;
	struct ibv_qp *qp;
	uint64_t info[3], stats[4];
	char c;

	ct_node_open(&n, 1, LEN, 64);
	qp = ct_node_vqp(&n, 16, 16);
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	ct_fill(n.b.p, LEN, 1);
	ct_buf_alloc(&secret, n.d.pd, LEN);
	ct_fill(secret.p, LEN, 2);
	info[0] = (uintptr_t)n.b.p;
	info[1] = n.b.mr->rkey;
	info[2] = secret.mr->rkey;
	ct_oob_write(info_pipe[1], info, sizeof(info));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	/* The service thread answers the checks; nothing to poll here. */
	ct_oob_read(done_pipe[0], &c, 1);
	stats[0] = krcore_stat_get(KRCORE_STAT_MR_CHECKS);
	stats[1] = krcore_stat_get(KRCORE_STAT_MR_CHECK_MISSES);
	stats[2] = krcore_stat_get(KRCORE_STAT_MR_CHECKS_BUSY);
	stats[3] = krcore_stat_get(KRCORE_STAT_LINKS_FAILED);
	ct_expect_pattern(secret.p, LEN, 2, "the secret MR, untouched");
	ct_oob_write(stats_pipe[1], stats, sizeof(stats));
	CT_OK(ibv_destroy_qp(qp));
	ct_buf_free(&secret);
	return 0;
}

/* Post one READ or WRITE of `len` bytes at the start of our buffer;
 * the post's return value. On success, wait for its completion. */
static int rdma(struct ct_node *n, struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t addr, uint32_t rkey,
		uint32_t len)
{
	struct ibv_sge sge = { (uintptr_t)n->b.p, len, n->b.mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 9, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;
	struct ibv_wc wc;
	int rc;

	wr.wr.rdma.remote_addr = addr;
	wr.wr.rdma.rkey = rkey;
	rc = ibv_post_send(qp, &wr, &bad);
	if (rc == 0) {
		ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS, "status %s", ibv_wc_status_str(wc.status));
	} else {
		CT_CHECK(bad == &wr, "*bad_wr is the refused WR");
	}
	return rc;
}

static void open_client(struct ct_node *n, struct ibv_qp **qp, int node)
{
	ct_node_open(n, node, LEN, 16);
	*qp = ct_node_vqp(n, 16, 16);
	CT_OK(qconnect(*qp, ct_node_gid(1), PORT));
}

static void close_client(struct ct_node *n, struct ibv_qp *qp)
{
	CT_OK(ibv_destroy_qp(qp));
	ct_buf_free(&n->b);
	CT_OK(ibv_destroy_cq(n->scq));
	CT_OK(ibv_destroy_cq(n->rcq));
	ct_close(&n->d);
}

static uint64_t given_addr;
static uint32_t given_rkey;

/* Node 3, started once node 2's guesses spent its GID's misses. */
static int bystander(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint64_t t0;

	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);
	open_client(&n, &qp, 3);
	t0 = ct_now_ns();
	/* Its first half: the second was written over by node 2. */
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, given_addr, given_rkey, LEN / 2) == 0, "READ the given MR");
	ct_expect_pattern(n.b.p, LEN / 2, 1, "the given MR from node 3");
	printf("node 3: first READ (its rkey checked) in %.1f ms\n", (ct_now_ns() - t0) / 1e6);
	CT_CHECK(ct_now_ns() - t0 < 1000000000ull, "node 3's first READ waited for node 2's guesses");
	CT_CHECK(write(by_pipe[1], "B", 1) == 1, "read");
	ct_oob_read(go_pipe[0], &t0, 1);
	close_client(&n, qp);
	return 0;
}

int main(void)
{
	struct ct_node n;
	struct ibv_qp *qp;
	uint64_t info[3], stats[4], t0, took;
	pid_t meta_pid, srv, by;
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	ct_watchdog(300);
	meta_pid = ct_start_meta();
	CT_CHECK(pipe(info_pipe) == 0 && pipe(done_pipe) == 0 && pipe(stats_pipe) == 0 && pipe(by_pipe) == 0 &&
			 pipe(go_pipe) == 0,
		 "pipes");
	srv = ct_fork_ready(server, "the server (node 1)");
	ct_oob_read(info_pipe[0], info, sizeof(info));
	given_addr = info[0];
	given_rkey = (uint32_t)info[1];
	open_client(&n, &qp, 2);

	ct_begin("vqp_mrcheck: an rkey given out: READ and WRITE, checked with the owner");
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, given_addr, given_rkey, LEN) == 0, "READ");
	ct_expect_pattern(n.b.p, LEN, 1, "READ of the given MR");
	ct_fill(n.b.p, LEN / 2, 3);
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_WRITE, given_addr + LEN / 2, given_rkey, LEN / 2) == 0, "WRITE");
	memset(n.b.p, 0, LEN);
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, given_addr + LEN / 2, given_rkey, LEN / 2) == 0, "READ back");
	ct_expect_pattern(n.b.p, LEN / 2, 3, "the WRITE, read back");
	ct_pass();

	/* The first contact went on the datagram tier, where the server
	 * checks each one-sided request itself (a bad one completes in error,
	 * as on RC). The checks before posting are the link's: READ until
	 * the VQP moved onto it (a link opened is not yet one to move onto:
	 * one the server made, accepted here, is handed out once its maker
	 * says its end is ready). */
	t0 = ct_now_ns();
	do {
		CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, given_addr, given_rkey, 8) == 0, "READ onto the link");
		CT_CHECK(ct_now_ns() - t0 < CT_TIMEOUT_MS * 1000000ull, "no move onto a link");
	} while (krcore_stat_get(KRCORE_STAT_DGRAM_MOVES) < 1);

	ct_begin("vqp_mrcheck: an rkey without an address inside its MR opens nothing");
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, given_addr, (uint32_t)info[2], 8) == EINVAL,
		 "the secret rkey at the given MR's address");
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, 0x1000, (uint32_t)info[2], 8) == EINVAL,
		 "the secret rkey at a made-up address");
	ct_pass();

	ct_begin("vqp_mrcheck: guessing rkeys is bounded per GID");
	srand(20);
	t0 = ct_now_ns();
	for (int i = 0; i < GUESSES; i++) {
		uint32_t rkey;

		do
			rkey = (uint32_t)rand() << 1 ^ (uint32_t)rand();
		while (rkey == given_rkey || rkey == (uint32_t)info[2]);
		CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, (uint64_t)rand() << 12, rkey, 8) == EINVAL, "guess %d", i);
	}
	took = ct_now_ns() - t0;
	printf("node 2: %d guesses in %.0f ms\n", GUESSES, took / 1e6);
	/* 16 at once, then 16 a second; 0.1 s of slack for the coarse clock. */
	CT_CHECK(took >= (uint64_t)((GUESSES + EARLY_MISSES - RATE) * 1000 / RATE - 100) * 1000000ull,
		 "%d misses in %.0f ms: guessing is not bounded", GUESSES + EARLY_MISSES, took / 1e6);
	by = ct_fork_ready(bystander, "a client on node 3");
	{
		char b;

		ct_oob_read(by_pipe[0], &b, 1);
	}
	/* Node 2's own check of a real rkey still works once it waited. */
	memset(n.b.p, 0, LEN);
	CT_CHECK(rdma(&n, qp, IBV_WR_RDMA_READ, given_addr, given_rkey, LEN / 2) == 0, "READ after guessing");
	ct_expect_pattern(n.b.p, LEN / 2, 1, "the given MR after guessing");
	CT_CHECK(write(done_pipe[1], "D", 1) == 1, "done");
	ct_oob_read(stats_pipe[0], stats, sizeof(stats));
	CT_CHECK(write(go_pipe[1], "G", 1) == 1, "go");
	fails += ct_wait_child(by, "the client on node 3");
	printf("server: mr_checks %llu, mr_check_misses %llu, mr_checks_busy %llu, links_failed %llu\n",
	       (unsigned long long)stats[0], (unsigned long long)stats[1], (unsigned long long)stats[2],
	       (unsigned long long)stats[3]);
	CT_CHECK(stats[1] == GUESSES + EARLY_MISSES, "misses counted: %llu", (unsigned long long)stats[1]);
	CT_CHECK(stats[2] > 0, "no check answered BUSY");
	CT_CHECK(stats[3] == 0, "a link failed");
	ct_pass();

	close_client(&n, qp);
	fails += ct_wait_child(srv, "the server");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
