/*
 * Virtual QPs end to end, several processes on several emulated nodes:
 * an echo server bound with qbind on node 1 (10.77.0.1), CLIENTS client
 * processes on nodes 2.. connecting with qconnect, krcore-meta started
 * here on node 1.
 *
 * - every client: echoes of 1 B to 1 MiB checked byte for byte, the
 *   replies coming back through the server's src_qp from qpop_msgs;
 *   above 4 KiB (a receive buffer of the library) the receiver READs the
 *   payload: the client sends those from 3 SGEs and receives them into 2;
 *   one-sided READ, WRITE (read back), FETCH_ADD on a counter every client
 *   adds to, CMP_SWP, and WRITE_WITH_IMM (the server sees the immediate
 *   through qpop_msgs) on the server's registered memory;
 * - a completion channel on a client's receive CQ: the echo's completion
 *   raises an event (poll() on the channel's fd, ibv_get_cq_event);
 * - without a meta server: ENOTCONN when KRCORE_META is unset,
 *   ECONNREFUSED when nothing listens there;
 * - error paths: qconnect to a port nobody bound (ECONNREFUSED), qbind of
 *   a bound address (EADDRINUSE), of a GID not on the device
 *   (EADDRNOTAVAIL), a send with a bad lkey (EINVAL, *bad_wr, and the VQP
 *   keeps working), qbind/qconnect on a QP that is not virtual (EINVAL);
 * - KRCORE_LINKS_PER_PEER=2: a client's second VQP goes on a second link
 *   (gauge links), and the server answers on the link each came on;
 * - the server: every message arrives once, the counter ends at CLIENTS.
 *
 * krcore-meta is found next to the library (target/release/krcore-meta)
 * or through KRCORE_META_BIN.
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define CLIENTS 8
#define PORT 5000
#define MSG (1 << 20)		/* the largest echo */
#define NBUF 16
#define BUF 4096		/* one-sided operations */
#define TARGET (128 * 1024)
static const size_t sizes[] = { 1, 100, 1000, 4000, 4096, 4097, 65536, 300001, MSG };
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))
#define ROUNDS 2
/* Per client: echoes, an evented echo, one MR request, one
 * WRITE_WITH_IMM notification. */
#define MSGS_PER_CLIENT ((int)NSIZES * ROUNDS + 3)

struct node {
	struct ct_dev d;
	struct ibv_comp_channel *ch;	/* the receive CQ's */
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	uint8_t *buf;		/* NBUF receive buffers, then NBUF send buffers */
	struct ibv_mr *mr;
};

static void node_open(struct node *n, int node)
{
	char idx[16];

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	ct_open(&n->d);
	n->scq = CT_PTR(ibv_create_cq(n->d.ctx, 256, NULL, NULL, 0));
	n->ch = CT_PTR(ibv_create_comp_channel(n->d.ctx));
	n->rcq = CT_PTR(ibv_create_cq(n->d.ctx, 256, NULL, n->ch, 0));
	n->qp = ct_create_vqp(&n->d, n->scq, n->rcq,
			      (struct ct_qp_caps){ 64, NBUF, 3, 2, 0, 0 }, NULL);
	n->buf = aligned_alloc(4096, 2 * NBUF * (size_t)MSG);
	CT_CHECK(n->buf != NULL, "alloc");
	memset(n->buf, 0, 2 * NBUF * (size_t)MSG);
	n->mr = CT_PTR(ibv_reg_mr(n->d.pd, n->buf, 2 * NBUF * (size_t)MSG,
				  IBV_ACCESS_LOCAL_WRITE));
}

static uint8_t *rbuf(struct node *n, int i) { return n->buf + (size_t)i * MSG; }
static uint8_t *sbuf(struct node *n, int i) { return n->buf + (size_t)(NBUF + i) * MSG; }

/* Receive buffer i, as two SGEs (contiguous: the bytes read back as one). */
static void post_recv(struct node *n, int i)
{
	struct ibv_sge sge[2] = { { (uintptr_t)rbuf(n, i), MSG / 2 - 1000, n->mr->lkey },
				  { (uintptr_t)rbuf(n, i) + MSG / 2 - 1000, MSG / 2 + 1000,
				    n->mr->lkey } };
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)i, .sg_list = sge, .num_sge = 2 };
	struct ibv_recv_wr *bad = NULL;

	CT_OK(ibv_post_recv(n->qp, &wr, &bad));
}

/* One send WR, signaled, and its completion. */
static void send_wr(struct node *n, struct ibv_qp *qp, struct ibv_send_wr *wr)
{
	struct ibv_send_wr *bad = NULL;
	struct ibv_wc wc;

	wr->send_flags |= IBV_SEND_SIGNALED;
	CT_OK(ibv_post_send(qp, wr, &bad));
	ct_poll_n(n->scq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "send status %s (wr_id %llu)",
		 ibv_wc_status_str(wc.status), (unsigned long long)wc.wr_id);
	CT_CHECK(wc.wr_id == wr->wr_id, "wr_id %llu, expected %llu",
		 (unsigned long long)wc.wr_id, (unsigned long long)wr->wr_id);
	CT_CHECK(wc.qp_num == qp->qp_num, "wc.qp_num %u, VQP %u", wc.qp_num,
		 qp->qp_num);
}

/* A message from send buffer `slot`: one SGE, or (nsge 3, len >= 3)
 * three contiguous pieces of it. */
static void send_msg_sges(struct node *n, struct ibv_qp *qp, int slot, size_t len,
			  uint64_t wr_id, int nsge)
{
	uintptr_t a = (uintptr_t)sbuf(n, slot);
	size_t third = len / 3;
	struct ibv_sge sge[3] = { { a, (uint32_t)len, n->mr->lkey } };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND };

	if (nsge == 3 && len >= 3) {
		sge[0].length = (uint32_t)third;
		sge[1] = (struct ibv_sge){ a + third, (uint32_t)third, n->mr->lkey };
		sge[2] = (struct ibv_sge){ a + 2 * third, (uint32_t)(len - 2 * third), n->mr->lkey };
		wr.num_sge = 3;
	}
	send_wr(n, qp, &wr);
}

static void send_msg(struct node *n, struct ibv_qp *qp, int slot, size_t len,
		     uint64_t wr_id)
{
	send_msg_sges(n, qp, slot, len, wr_id, 1);
}

/* ---- the server ------------------------------------------------------ */

struct target {
	uint64_t counter;	/* FETCH_ADD by every client */
	uint64_t swap[CLIENTS];	/* CMP_SWP, one word per client */
	uint8_t bytes[TARGET];
};

static int server(int ready_fd)
{
	struct node n;
	struct target *t = aligned_alloc(4096, (sizeof(struct target) + 4095) / 4096 * 4096);
	struct ibv_mr *tmr;
	int got = 0, imms = 0, nsenders = 0;
	struct ibv_qp *sender_qp[CLIENTS];

	ct_begin("vqp_echo server");
	node_open(&n, 1);
	CT_CHECK(t != NULL, "alloc");
	memset(t, 0, sizeof(*t));
	ct_fill(t->bytes, TARGET, 77);
	tmr = CT_PTR(ibv_reg_mr(n.d.pd, t, sizeof(*t),
				IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
				IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC));
	for (int i = 0; i < NBUF; i++)
		post_recv(&n, i);
	CT_OK(qbind(n.qp, ct_node_gid(1), PORT));
	CT_CHECK(qpop_msgs(n.qp, -1, NULL, NULL) == -EINVAL, "qpop_msgs(-1)");
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	while (got < CLIENTS * MSGS_PER_CLIENT) {
		struct ibv_qp *src[8];
		struct ibv_wc wc[8];
		int k = qpop_msgs(n.qp, 8, src, wc);

		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		if (k == 0) {
			sched_yield();
			continue;
		}
		for (int i = 0; i < k; i++) {
			int slot = (int)wc[i].wr_id;

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "recv status %s",
				 ibv_wc_status_str(wc[i].status));
			CT_CHECK(wc[i].qp_num == n.qp->qp_num, "recv qp_num");
			CT_CHECK(src[i] != NULL && src[i]->qp_type == (enum ibv_qp_type)KRCORE_VQP,
				 "src_qp is a VQP");
			/* One src_qp per sending VQP, reused: CLIENTS distinct
			 * ones in all (virtual QP numbers are per process, so
			 * wc.src_qp alone does not tell senders apart). */
			{
				int known = 0;

				for (int j = 0; j < nsenders; j++)
					known |= sender_qp[j] == src[i];
				if (!known) {
					CT_CHECK(nsenders < CLIENTS, "more src_qps than clients");
					sender_qp[nsenders++] = src[i];
				}
			}
			got++;
			if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
				CT_CHECK(wc[i].wc_flags & IBV_WC_WITH_IMM, "imm flag");
				CT_CHECK(ntohl(wc[i].imm_data) >= 0x1000, "imm");
				imms++;
			} else if (wc[i].byte_len == 1 && rbuf(&n, slot)[0] == 'M') {
				/* MR request: answer address and rkey. */
				uint64_t a = (uintptr_t)t;
				uint32_t k32 = tmr->rkey;

				memcpy(sbuf(&n, slot), &a, 8);
				memcpy(sbuf(&n, slot) + 8, &k32, 4);
				send_msg(&n, src[i], slot, 12, 1000 + (uint64_t)slot);
			} else {
				memcpy(sbuf(&n, slot), rbuf(&n, slot), wc[i].byte_len);
				send_msg(&n, src[i], slot, wc[i].byte_len, 2000 + (uint64_t)slot);
			}
			post_recv(&n, slot);
		}
	}
	CT_CHECK(imms == CLIENTS, "WRITE_WITH_IMM notifications: %d", imms);
	CT_CHECK(nsenders == CLIENTS, "%d senders", nsenders);
	CT_CHECK(t->counter == CLIENTS, "FETCH_ADD counter %llu, expected %d",
		 (unsigned long long)t->counter, CLIENTS);
	ct_note("server: %d messages from %d clients", got, CLIENTS);
	ct_pass();
	return 0;
}

/* ---- a client ---------------------------------------------------------- */

static void onesided(struct node *n, struct ibv_send_wr *wr, enum ibv_wr_opcode op,
		     uint64_t raddr, uint32_t rkey, void *local, uint32_t len,
		     uint64_t wr_id)
{
	struct ibv_sge sge = { (uintptr_t)local, len, n->mr->lkey };

	memset(wr, 0, sizeof(*wr));
	wr->wr_id = wr_id;
	wr->sg_list = &sge;
	wr->num_sge = 1;
	wr->opcode = op;
	if (op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP) {
		wr->wr.atomic.remote_addr = raddr;
		wr->wr.atomic.rkey = rkey;
	} else {
		wr->wr.rdma.remote_addr = raddr;
		wr->wr.rdma.rkey = rkey;
	}
	send_wr(n, n->qp, wr);
}

static int client(int id)
{
	struct node n;
	struct ibv_wc wc;
	struct ibv_send_wr wr, *bad = NULL;
	uint64_t taddr;
	uint32_t trkey;
	int r;

	ct_begin("vqp_echo client");
	node_open(&n, 2 + id);

	/* Error paths first. */
	CT_CHECK(qconnect(n.qp, ct_node_gid(1), PORT + 1) == ECONNREFUSED,
		 "qconnect to an unbound port");
	r = qbind(n.qp, ct_node_gid(1), PORT);
	CT_CHECK(r == EADDRINUSE, "qbind of a bound address: %d", r);
	{
		union ibv_gid nowhere = ct_node_gid(1);

		nowhere.raw[13] = 99;
		CT_CHECK(qbind(n.qp, nowhere, PORT) == EADDRNOTAVAIL, "foreign GID");
	}
	CT_CHECK(qconnect(NULL, ct_node_gid(1), PORT) == EINVAL, "NULL qp");

	CT_OK(qconnect(n.qp, ct_node_gid(1), PORT));
	CT_CHECK(qconnect(n.qp, ct_node_gid(1), PORT) == EINVAL, "connected twice");

	/* Echoes. */
	for (int round = 0; round < ROUNDS; round++)
		for (size_t s = 0; s < NSIZES; s++) {
			size_t len = sizes[s];
			uint32_t seed = (uint32_t)(id * 1000 + round * 10 + (int)s);

			post_recv(&n, 0);
			ct_fill(sbuf(&n, 0), len, seed);
			send_msg_sges(&n, n.qp, 0, len, 10 + s, round == 1 ? 3 : 1);
			ct_poll_n(n.rcq, &wc, 1, CT_TIMEOUT_MS);
			CT_CHECK(wc.status == IBV_WC_SUCCESS, "echo recv status");
			CT_CHECK(wc.opcode == IBV_WC_RECV, "echo recv opcode");
			CT_CHECK(wc.byte_len == len, "echo length %u, sent %zu",
				 wc.byte_len, len);
			CT_CHECK(wc.qp_num == n.qp->qp_num, "echo qp_num");
			ct_expect_pattern(rbuf(&n, 0), len, seed, "echoed bytes");
		}

	/* Completion channel: sleep until the echo's receive completes. */
	{
		int k;

		CT_OK(ibv_req_notify_cq(n.rcq, 0));
		post_recv(&n, 0);
		ct_fill(sbuf(&n, 0), 64, 4242);
		send_msg(&n, n.qp, 0, 64, 40);
		ct_cq_event(n.ch, n.rcq, NULL, "the echo's receive");
		k = ibv_poll_cq(n.rcq, 1, &wc);
		CT_CHECK(k == 1, "the event's completion is there: %d", k);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 64, "evented echo");
		ct_expect_pattern(rbuf(&n, 0), 64, 4242, "evented echo bytes");
	}

	/* A bad lkey is refused before it reaches the shared link. */
	{
		struct ibv_sge sge = { (uintptr_t)sbuf(&n, 1), 8, n.mr->lkey ^ 0x5a5a };
		struct ibv_send_wr w2 = { .wr_id = 99, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND,
					  .send_flags = IBV_SEND_SIGNALED };

		bad = NULL;
		CT_CHECK(ibv_post_send(n.qp, &w2, &bad) == EINVAL, "bad lkey");
		CT_CHECK(bad == &w2, "*bad_wr");
	}

	/* The server's memory: ask for it, then one-sided operations. */
	post_recv(&n, 0);
	sbuf(&n, 0)[0] = 'M';
	send_msg(&n, n.qp, 0, 1, 50);
	ct_poll_n(n.rcq, &wc, 1, CT_TIMEOUT_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 12, "MR answer");
	memcpy(&taddr, rbuf(&n, 0), 8);
	memcpy(&trkey, rbuf(&n, 0) + 8, 4);
	{
		size_t bytes_off = offsetof(struct target, bytes);
		uint8_t *local = sbuf(&n, 2);
		uint64_t *word = (uint64_t *)(void *)sbuf(&n, 3);

		onesided(&n, &wr, IBV_WR_RDMA_READ, taddr + bytes_off, trkey, local, BUF, 60);
		ct_expect_pattern(local, BUF, 77, "READ of the server's pattern");
		ct_fill(local, 512, 500 + (uint32_t)id);
		onesided(&n, &wr, IBV_WR_RDMA_WRITE,
			 taddr + bytes_off + BUF * (size_t)(1 + id), trkey, local, 512, 61);
		memset(local, 0, 512);
		onesided(&n, &wr, IBV_WR_RDMA_READ,
			 taddr + bytes_off + BUF * (size_t)(1 + id), trkey, local, 512, 62);
		ct_expect_pattern(local, 512, 500 + (uint32_t)id, "WRITE read back");
		{
			struct ibv_sge sge = { (uintptr_t)word, 8, n.mr->lkey };
			struct ibv_send_wr a = { .wr_id = 63, .sg_list = &sge, .num_sge = 1,
						 .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD };

			a.wr.atomic.remote_addr = taddr + offsetof(struct target, counter);
			a.wr.atomic.rkey = trkey;
			a.wr.atomic.compare_add = 1;
			send_wr(&n, n.qp, &a);
			CT_CHECK(*word < CLIENTS, "FETCH_ADD returned %llu",
				 (unsigned long long)*word);
			a.wr_id = 64;
			a.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
			a.wr.atomic.remote_addr = taddr + offsetof(struct target, swap) + 8 * (size_t)id;
			a.wr.atomic.compare_add = 0;
			a.wr.atomic.swap = 0xabc0 + (uint64_t)id;
			send_wr(&n, n.qp, &a);
			CT_CHECK(*word == 0, "CMP_SWP returned the old value");
			a.wr_id = 65;
			a.wr.atomic.compare_add = 0xabc0 + (uint64_t)id;
			a.wr.atomic.swap = 7;
			send_wr(&n, n.qp, &a);
			CT_CHECK(*word == 0xabc0 + (uint64_t)id, "CMP_SWP saw our swap");
		}
		/* A bad rkey is refused too. */
		{
			struct ibv_sge sge = { (uintptr_t)local, 8, n.mr->lkey };
			struct ibv_send_wr w2 = { .wr_id = 66, .sg_list = &sge, .num_sge = 1,
						  .opcode = IBV_WR_RDMA_READ };

			w2.wr.rdma.remote_addr = taddr;
			w2.wr.rdma.rkey = trkey ^ 0x777;
			bad = NULL;
			CT_CHECK(ibv_post_send(n.qp, &w2, &bad) == EINVAL, "bad rkey");
			w2.wr.rdma.rkey = trkey;
			w2.wr.rdma.remote_addr = taddr + sizeof(struct target) - 4;
			bad = NULL;
			CT_CHECK(ibv_post_send(n.qp, &w2, &bad) == EINVAL,
				 "READ past the end of the remote MR");
		}
		/* A second VQP on the same link (warm qconnect), its send CQ
		 * smaller than the completions it gets: none is lost, and
		 * they come in order. */
		if (id == 0) {
			struct ibv_cq *tiny = CT_PTR(ibv_create_cq(n.d.ctx, 2, NULL, NULL, 0));
			struct ibv_qp *q2 = ct_create_vqp(&n.d, tiny, n.rcq,
							  (struct ct_qp_caps){ 32, 1, 1, 1, 0, 0 }, NULL);
			int want, got = 0, cqe = tiny->cqe;

			CT_OK(qconnect(q2, ct_node_gid(1), PORT));
			/* Made in the background (KRCORE_DGRAM). */
			CT_KRCORE_STAT_WITHIN(KRCORE_STAT_LINKS, ==, 2);
			want = cqe * 3 < 32 ? cqe * 3 : 32;
			for (int i = 0; i < want; i++) {
				struct ibv_sge sge = { (uintptr_t)local, 8, n.mr->lkey };
				struct ibv_send_wr w2 = { .wr_id = 500 + (uint64_t)i, .sg_list = &sge,
							  .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
							  .send_flags = IBV_SEND_SIGNALED };

				w2.wr.rdma.remote_addr = taddr + bytes_off;
				w2.wr.rdma.rkey = trkey;
				bad = NULL;
				CT_OK(ibv_post_send(q2, &w2, &bad));
			}
			while (got < want) {
				ct_poll_n(tiny, &wc, 1, CT_TIMEOUT_MS);
				CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 500 + (uint64_t)got,
					 "completion %d of %d: wr_id %llu", got, want,
					 (unsigned long long)wc.wr_id);
				got++;
			}
			CT_CHECK(ibv_destroy_cq(tiny) == EBUSY, "a CQ a VQP uses is busy");
			CT_OK(ibv_destroy_qp(q2));
			CT_OK(ibv_destroy_cq(tiny));
			ct_note("%d completions through a CQ of %d entries", want, cqe);
		}

		/* WRITE_WITH_IMM: the data, then the server's notification. */
		{
			struct ibv_sge sge = { (uintptr_t)local, 64, n.mr->lkey };
			struct ibv_send_wr w2 = { .wr_id = 67, .sg_list = &sge, .num_sge = 1,
						  .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
						  .imm_data = htonl(0x1000 + (uint32_t)id) };

			w2.wr.rdma.remote_addr = taddr + bytes_off + BUF * (size_t)(1 + CLIENTS + id);
			w2.wr.rdma.rkey = trkey;
			send_wr(&n, n.qp, &w2);
		}
	}
	ct_pass();
	return 0;
}

/* ---- orchestration ----------------------------------------------------- */

int main(void)
{
	pid_t meta_pid, srv, cli[CLIENTS];
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Eight cold connects at once to one server, whose service thread
	 * brings a QP to RTS for each, on an emulated two-vCPU node: more
	 * than the default 2 s is fair. */
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "10000", 1);
	/* Two links per peer: a client's second VQP takes the second. */
	setenv("KRCORE_LINKS_PER_PEER", "2", 1);
	ct_watchdog(120);
	meta_pid = ct_start_meta();
	srv = ct_fork_ready(server, "the server (qbind)");
	for (int i = 0; i < CLIENTS; i++) {
		cli[i] = fork();
		if (cli[i] == 0)
			_exit(client(i));
	}
	for (int i = 0; i < CLIENTS; i++)
		fails += ct_wait_child(cli[i], "client");
	fails += ct_wait_child(srv, "server");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);

	/* No meta server configured (this process has not used the library
	 * yet, so it reads the environment now): ENOTCONN. One configured
	 * but not running: ECONNREFUSED (a child: the configuration is read
	 * once per process). */
	{
		pid_t child = fork();

		if (child == 0) {
			struct ct_dev d;
			struct ibv_cq *cq;
			struct ibv_qp *q;

			ct_begin("vqp_echo: meta server not running");
			setenv("KRCORE_META", "10.77.0.1:1", 1);
			setenv("CT_GID_A", "2", 1);
			ct_open(&d);
			cq = CT_PTR(ibv_create_cq(d.ctx, 16, NULL, NULL, 0));
			q = ct_create_vqp(&d, cq, cq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);
			{
				int rc = qconnect(q, ct_node_gid(1), PORT);

				CT_CHECK(rc == ECONNREFUSED, "no meta server: %d (%s)", rc, strerror(rc));
				rc = qbind(q, ct_node_gid(2), PORT);
				CT_CHECK(rc == ECONNREFUSED, "no meta server (bind): %d (%s)", rc, strerror(rc));
			}
			CT_OK(ibv_destroy_qp(q));
			CT_OK(ibv_destroy_cq(cq));
			ct_close(&d);
			ct_pass();
			_exit(0);
		}
		fails += ct_wait_child(child, "no-meta-server child");
		CT_CHECK(fails == 0, "the no-meta-server child failed");
	}
	unsetenv("KRCORE_META");
	{
		struct ct_dev d;
		struct ibv_cq *cq;
		struct ibv_qp *q;

		ct_begin("vqp_echo: KRCORE_META unset");
		setenv("CT_GID_A", "2", 1);
		ct_open(&d);
		cq = CT_PTR(ibv_create_cq(d.ctx, 16, NULL, NULL, 0));
		q = ct_create_vqp(&d, cq, cq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);
		CT_CHECK(qconnect(q, ct_node_gid(1), PORT) == ENOTCONN, "KRCORE_META unset");
		CT_OK(ibv_destroy_qp(q));
		CT_OK(ibv_destroy_cq(cq));
		ct_close(&d);
		ct_pass();
	}

	/* Not a VQP: the extended verbs refuse it. */
	{
		struct ct_dev d;
		struct ibv_cq *cq;
		struct ibv_qp *qp;

		ct_begin("vqp_echo: extended verbs on an RC QP");
		setenv("CT_GID_A", "2", 1);
		ct_open(&d);
		cq = CT_PTR(ibv_create_cq(d.ctx, 16, NULL, NULL, 0));
		qp = ct_create_rc_qp(&d, cq, cq, NULL, CT_QP_CAPS_DEFAULT);
		CT_CHECK(qbind(qp, ct_node_gid(2), PORT) == EINVAL, "qbind on RC");
		CT_CHECK(qconnect(qp, ct_node_gid(1), PORT) == EINVAL, "qconnect on RC");
		CT_OK(ibv_destroy_qp(qp));
		CT_OK(ibv_destroy_cq(cq));
		ct_close(&d);
		ct_pass();
	}
	return 0;
}
