/*
 * kv_server: the memory node of a small disaggregated key-value store.
 *
 * It holds a hash table (kv.h: buckets of 4 slots, 8-byte keys, 64-byte
 * values, a version and a check per slot) in memory registered for remote
 * READ. Clients (kv_client) GET with one-sided RDMA READs of a bucket: no
 * work for this server's CPU. They PUT with messages: the server applies
 * the PUT to the table with its CPU and answers.
 *
 * One source, two transports, chosen at compile time:
 *
 *   raw verbs (default): one RC QP per client. A client connects over TCP
 *     and sends its QPN, PSN and GID; the server creates an RC QP on its
 *     shared receive queue (one SRQ for all clients, so the receive
 *     buffers do not grow with the number of clients), moves it to INIT,
 *     RTR and RTS, and answers with its own QPN, PSN, GID and the table's
 *     address and rkey. The TCP connection stays open: when it closes, the
 *     client is gone and its QP is destroyed.
 *   krcore (-DKRCORE, linked with -lkrcore): one virtual QP bound with
 *     qbind(ADDR's GID, PORT) serves every client. Clients find it through
 *     krcore-meta (KRCORE_META) and qconnect; their messages come out of
 *     qpop_msgs with a src_qp connected back to the sender, and the answer
 *     is an ibv_post_send on it. A client's first message is a HELLO,
 *     answered with the table's address and rkey.
 *
 *   kv_server -a ADDR [-P PORT] [-d DEV] [-b BUCKETS] [-k KEYS]
 *   (krcore build: KRCORE_META=ip:port of a running krcore-meta)
 *
 *   -a ADDR     the server's address: an IPv4 address (its RoCE v2 GID is
 *               ::ffff:ADDR) or a GID in IPv6 notation; must be a GID of
 *               the device. Raw: the TCP listening address (IPv4 GIDs
 *               only) and the GID of the RC QPs; krcore: the qbind GID
 *   -P PORT     raw: TCP port; krcore: the VQP port to bind (18800)
 *   -d DEV      RDMA device (default: the first one)
 *   -b BUCKETS  buckets in the table, a power of two (4096: 16384 slots,
 *               1.5 MiB)
 *   -k KEYS     preload keys 1..KEYS with generation 1 (default 0: the
 *               table starts empty; kv_client -L loads it with PUTs)
 *
 * When clients may connect it prints one line on stdout (scripts wait for
 * it), e.g.
 *
 *   kv_server: ready: 4096 buckets (16384 slots, 0 keys) at 10.77.0.1 port 18800 on rxe0 (raw verbs); object 0x7f3c5e7fe000 rkey 0x1a2b
 *
 * (where its 64 KiB object lies: what a "serverless" client is handed,
 * kv_client -o ADDR:RKEY),
 * and, on SIGTERM or SIGINT, a summary ("kv_server: 64 clients, 1000 PUTs
 * (0 refused: probe path full), 1000 keys"). Exit status 0, or 1 after an
 * error (printed on stderr), 2 for a usage error.
 *
 * Build: make -C examples-c (target/examples-c/ibverbs/kv_server and
 * target/examples-c/krcore/kv_server).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#ifdef KRCORE
#include <krcore.h>
#endif
#include "kv.h"

#define NRECV 64	/* message buffers: receives posted at all times */
#define MAX_CLIENTS 1024	/* raw: clients connected at once */
#define SEND_DEPTH 16	/* answers in flight per client QP */

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static void die(const char *what, int err)
{
	fprintf(stderr, "kv_server: %s: %s\n", what, strerror(err));
	exit(1);
}

/* ---- the table ------------------------------------------------------- */

struct server {
	struct kv_bucket *table;
	uint32_t nbuckets;
	uint8_t *object;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *table_mr;	/* table + object, remote READ */
	struct ibv_mr *msg_mr;		/* the message buffers */
	struct ibv_cq *cq;
	struct kv_msg *rx;		/* NRECV receive buffers */
	struct kv_msg *tx;		/* NRECV answers: tx[i] answers rx[i] */
	unsigned long keys, puts, full, bad, hellos, clients, left;
#ifdef KRCORE
	struct ibv_qp *vqp;
	union ibv_gid gid_bind;
#else
	struct ibv_srq *srq;
	struct ibv_comp_channel *chan;
	uint8_t port;
	int gid_index;
	union ibv_gid gid;
	enum ibv_mtu mtu;
	uint8_t rd_atom;
	uint32_t rng;
#endif
};

/*
 * Writes one slot with the CPU while clients may be READing it: version
 * odd first, then the fields and their check, then version even. The
 * fences keep the compiler (and a weakly ordered CPU) from moving the
 * stores across each other; an RDMA READ may still see any mix of old and
 * new bytes, which the check (computed with the final version) exposes.
 */
static void write_slot(struct kv_slot *s, uint64_t key, const uint8_t *value)
{
	uint64_t v = s->version;

	__atomic_store_n(&s->version, v + 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	s->key = key;
	memcpy(s->value, value, KV_VALUE_LEN);
	s->check = kv_check(v + 2, key, value);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	__atomic_store_n(&s->version, v + 2, __ATOMIC_RELAXED);
}

/* KV_OK (updated or inserted), KV_FULL (no free slot on the key's probe
 * path) or KV_BAD (key 0). Same probe order as the client's GET. */
static int table_put(struct server *s, uint64_t key, const uint8_t *value)
{
	uint32_t h = kv_bucket_of(key, s->nbuckets);

	if (key == 0)
		return KV_BAD;
	for (uint32_t p = 0; p < KV_PROBES; p++) {
		struct kv_bucket *b = &s->table[(h + p) & (s->nbuckets - 1)];

		for (int i = 0; i < KV_SLOTS; i++)
			if (b->slot[i].key == key) {
				write_slot(&b->slot[i], key, value);
				return KV_OK;
			}
		/* Slots fill in order and nothing is deleted: the first
		 * empty slot ends the probe path. */
		for (int i = 0; i < KV_SLOTS; i++)
			if (b->slot[i].key == 0) {
				write_slot(&b->slot[i], key, value);
				s->keys++;
				return KV_OK;
			}
	}
	return KV_FULL;
}

/* Builds the answer to one received message (len bytes); returns its
 * length. Shared by both transports. */
static uint32_t handle_msg(struct server *s, const struct kv_msg *in,
			   uint32_t len, struct kv_msg *out)
{
	memset(out, 0, sizeof(*out));
	out->magic = KV_MSG_MAGIC;
	if (len != sizeof(*in) || in->magic != KV_MSG_MAGIC) {
		s->bad++;
		out->type = KV_PUT_REPLY;
		out->status = KV_BAD;
		return sizeof(*out);
	}
	out->seq = in->seq;
	out->key = in->key;
	switch (in->type) {
	case KV_HELLO:
		s->hellos++;
		out->type = KV_HELLO_REPLY;
		out->u.info.table_addr = (uintptr_t)s->table;
		out->u.info.object_addr = (uintptr_t)s->object;
		out->u.info.rkey = s->table_mr->rkey;
		out->u.info.nbuckets = s->nbuckets;
		out->u.info.object_len = KV_OBJECT_LEN;
		break;
	case KV_PUT:
		out->type = KV_PUT_REPLY;
		out->status = (uint16_t)table_put(s, in->key, in->u.value);
		if (out->status == KV_OK)
			s->puts++;
		else if (out->status == KV_FULL)
			s->full++;
		else
			s->bad++;
		break;
	default:
		s->bad++;
		out->type = KV_PUT_REPLY;
		out->status = KV_BAD;
	}
	return sizeof(*out);
}

static void setup_memory(struct server *s, uint32_t nbuckets, long preload)
{
	size_t tbytes = (size_t)nbuckets * sizeof(struct kv_bucket);
	uint8_t value[KV_VALUE_LEN];
	uint8_t *mem;

	/* Table and object in one allocation, one registration: one rkey
	 * for the client to learn. Remote READ only: clients never write. */
	mem = aligned_alloc(4096, tbytes + KV_OBJECT_LEN);
	if (!mem)
		die("aligned_alloc (table)", ENOMEM);
	memset(mem, 0, tbytes);
	s->table = (struct kv_bucket *)mem;
	s->nbuckets = nbuckets;
	s->object = mem + tbytes;
	for (size_t i = 0; i < KV_OBJECT_LEN; i++)
		s->object[i] = kv_object_byte(i);
	for (long k = 1; k <= preload; k++) {
		kv_value_fill((uint64_t)k, 1, value);
		if (table_put(s, (uint64_t)k, value) != KV_OK) {
			fprintf(stderr, "kv_server: -k %ld: key %ld does not fit "
				"(probe path full): use more buckets (-b)\n",
				preload, k);
			exit(2);
		}
	}
	s->table_mr = ibv_reg_mr(s->pd, mem, tbytes + KV_OBJECT_LEN,
				 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	if (!s->table_mr)
		die("ibv_reg_mr (table)", errno);

	s->rx = aligned_alloc(4096, 2 * NRECV * sizeof(struct kv_msg));
	if (!s->rx)
		die("aligned_alloc (messages)", ENOMEM);
	s->tx = s->rx + NRECV;
	s->msg_mr = ibv_reg_mr(s->pd, s->rx, 2 * NRECV * sizeof(struct kv_msg),
			       IBV_ACCESS_LOCAL_WRITE);
	if (!s->msg_mr)
		die("ibv_reg_mr (messages)", errno);
}

static struct ibv_sge msg_sge(struct server *s, struct kv_msg *m, uint32_t len)
{
	struct ibv_sge sge = { (uintptr_t)m, len, s->msg_mr->lkey };

	return sge;
}

/* Answer `slot` (tx[slot]) on qp, signaled, wr_id as given. */
static int post_answer(struct server *s, struct ibv_qp *qp, int slot,
		       uint32_t len, uint64_t wr_id)
{
	struct ibv_sge sge = msg_sge(s, &s->tx[slot], len);
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;

	return ibv_post_send(qp, &wr, &bad);
}

#ifndef KRCORE

/* ---- raw verbs: RC QP per client, SRQ, TCP exchange -------------------- */

struct conn {
	int fd;			/* -1: slot free; the TCP connection */
	size_t got;		/* bytes of the request read so far */
	struct kv_conn_req req;
	struct ibv_qp *qp;	/* NULL until the request is served */
	int inflight;		/* answers posted, not completed */
	int closing;		/* TCP closed: QP in ERR, destroyed at inflight 0 */
	int served;		/* its QP was connected */
};

static struct conn conns[MAX_CLIENTS];

/* wr_id of an answer: bit 63, the connection, the slot. */
#define WR_SEND (1ull << 63)

static void post_srq_recv(struct server *s, int slot)
{
	struct ibv_sge sge = msg_sge(s, &s->rx[slot], sizeof(struct kv_msg));
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)slot, .sg_list = &sge,
				  .num_sge = 1 }, *bad;
	int rc = ibv_post_srq_recv(s->srq, &wr, &bad);

	if (rc)
		die("ibv_post_srq_recv", rc);
}

static uint32_t rand_psn(struct server *s)
{
	s->rng ^= s->rng << 13;
	s->rng ^= s->rng >> 17;
	s->rng ^= s->rng << 5;
	return s->rng & 0xffffff;
}

/* Frees a client's slot: its QP (no answer in flight any more) and its
 * socket (if still open). */
static void free_conn(struct server *s, struct conn *c)
{
	int rc;

	if (c->qp && (rc = ibv_destroy_qp(c->qp)))
		die("ibv_destroy_qp", rc);
	if (c->fd >= 0)
		close(c->fd);
	if (c->served)
		s->left++;
	memset(c, 0, sizeof(*c));
	c->fd = -1;
}

/* The client closed its TCP connection (it exited, or failed). Its QP may
 * have answers in flight: move it to ERR so that they complete (flushed)
 * and their buffers come back, and destroy it when the last one did. */
static void close_conn(struct server *s, struct conn *c)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	int rc;

	close(c->fd);
	c->fd = -2;	/* no longer polled; the slot stays taken */
	if (c->qp && (rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE)))
		die("ibv_modify_qp(ERR)", rc);
	c->closing = 1;
	if (c->inflight == 0)
		free_conn(s, c);
}

/* Creates the client's RC QP (on the SRQ), INIT -> RTR -> RTS towards the
 * client's QP; fills the answer. 0 or an errno. */
static int connect_client(struct server *s, struct conn *c,
			  struct kv_conn_rep *rep)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = s->cq, .recv_cq = s->cq, .srq = s->srq,
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = SEND_DEPTH, .max_send_sge = 1 },
	};
	struct ibv_qp_attr a;
	uint32_t psn = rand_psn(s);
	enum ibv_mtu mtu = c->req.mtu < (uint32_t)s->mtu ?
				   (enum ibv_mtu)c->req.mtu : s->mtu;
	int rc;

	c->qp = ibv_create_qp(s->pd, &ia);
	if (!c->qp)
		return errno;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = s->port;
	a.qp_access_flags = IBV_ACCESS_REMOTE_READ;
	if ((rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
						   IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)))
		return rc;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = c->req.qpn;
	a.rq_psn = c->req.psn;
	a.max_dest_rd_atomic = s->rd_atom; /* the clients' READs */
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, c->req.gid, 16);
	a.ah_attr.grh.sgid_index = (uint8_t)s->gid_index;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = s->port;
	if ((rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_AV |
						   IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
						   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
						   IBV_QP_MIN_RNR_TIMER)))
		return rc;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = psn;
	a.max_rd_atomic = 1;
	if ((rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT |
						   IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
						   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)))
		return rc;
	rep->qpn = c->qp->qp_num;
	rep->psn = psn;
	rep->mtu = mtu;
	memcpy(rep->gid, s->gid.raw, 16);
	rep->info.table_addr = (uintptr_t)s->table;
	rep->info.object_addr = (uintptr_t)s->object;
	rep->info.rkey = s->table_mr->rkey;
	rep->info.nbuckets = s->nbuckets;
	rep->info.object_len = KV_OBJECT_LEN;
	return 0;
}

/* The client's socket is readable: read (part of) its request; once it is
 * whole, connect its QP and answer. A failure closes that client only. */
static void conn_readable(struct server *s, struct conn *c)
{
	struct kv_conn_rep rep;
	ssize_t n;
	int rc;

	if (c->qp) {	/* connected: only EOF (or junk) can come */
		char junk[64];

		n = recv(c->fd, junk, sizeof(junk), 0);
		if (n <= 0 && !(n < 0 && (errno == EINTR || errno == EAGAIN)))
			close_conn(s, c);
		return;
	}
	n = recv(c->fd, (char *)&c->req + c->got, sizeof(c->req) - c->got, 0);
	if (n < 0 && (errno == EINTR || errno == EAGAIN))
		return;
	if (n <= 0) {
		close_conn(s, c);
		return;
	}
	c->got += (size_t)n;
	if (c->got < sizeof(c->req))
		return;
	memset(&rep, 0, sizeof(rep));
	rep.magic = KV_CONN_MAGIC;
	if (c->req.magic != KV_CONN_MAGIC) {
		fprintf(stderr, "kv_server: a client sent a bad request (magic "
			"%#x): not kv_client, or another byte order\n", c->req.magic);
		rep.status = EPROTO;
	} else if ((rc = connect_client(s, c, &rep))) {
		fprintf(stderr, "kv_server: connecting a client's QP: %s\n",
			strerror(rc));
		rep.status = (uint32_t)rc;
	}
	/* 100-odd bytes into an empty socket buffer: send does not block. */
	if (send(c->fd, &rep, sizeof(rep), MSG_NOSIGNAL) != sizeof(rep) ||
	    rep.status) {
		close_conn(s, c);
		return;
	}
	c->served = 1;
	s->clients++;
}

static struct conn *conn_of_qpn(uint32_t qpn)
{
	for (int i = 0; i < MAX_CLIENTS; i++)
		if (conns[i].qp && conns[i].qp->qp_num == qpn)
			return &conns[i];
	return NULL;
}

/* Everything in the CQ: PUTs to apply and answer, answers completed. */
static void drain_cq(struct server *s)
{
	struct ibv_wc wc[16];
	int k;

	while ((k = ibv_poll_cq(s->cq, 16, wc)) > 0) {
		for (int i = 0; i < k; i++) {
			struct conn *c;
			int slot, rc;

			if (wc[i].wr_id & WR_SEND) {
				/* An answer completed (flushed if its client
				 * left): its receive buffer goes back. */
				c = &conns[(wc[i].wr_id >> 32) & 0xffff];
				slot = (int)(wc[i].wr_id & 0xffffffff);
				c->inflight--;
				if (wc[i].status != IBV_WC_SUCCESS && !c->closing)
					fprintf(stderr, "kv_server: an answer failed: %s\n",
						ibv_wc_status_str(wc[i].status));
				post_srq_recv(s, slot);
				if (c->closing && c->inflight == 0)
					free_conn(s, c);
				continue;
			}
			slot = (int)wc[i].wr_id;
			if (wc[i].status != IBV_WC_SUCCESS) {
				/* A receive of a QP moved to ERR. */
				if (wc[i].status != IBV_WC_WR_FLUSH_ERR)
					fprintf(stderr, "kv_server: a receive failed: %s\n",
						ibv_wc_status_str(wc[i].status));
				post_srq_recv(s, slot);
				continue;
			}
			c = conn_of_qpn(wc[i].qp_num);
			if (!c || c->closing) {
				post_srq_recv(s, slot);
				continue;
			}
			handle_msg(s, &s->rx[slot], wc[i].byte_len, &s->tx[slot]);
			rc = post_answer(s, c->qp, slot, sizeof(struct kv_msg),
					 WR_SEND | ((uint64_t)(c - conns) << 32) |
						 (uint64_t)slot);
			if (rc) {
				/* ENOMEM: the client has SEND_DEPTH answers
				 * in flight, i.e. it sends without waiting. */
				fprintf(stderr, "kv_server: answer ibv_post_send: %s\n",
					strerror(rc));
				post_srq_recv(s, slot);
				continue;
			}
			c->inflight++;
		}
	}
	if (k < 0)
		die("ibv_poll_cq", EIO);
}

static int run(struct server *s, const char *addr, int port)
{
	struct sockaddr_in sa;
	struct ibv_port_attr pa;
	struct ibv_device_attr da;
	struct ibv_srq_init_attr sia;
	struct pollfd pfd[2 + MAX_CLIENTS];
	int lfd, one = 1, rc;

	s->port = 1;
	s->rng = (uint32_t)getpid() * 2654435761u | 1;
	if ((rc = ibv_query_port(s->ctx, s->port, &pa)))
		die("ibv_query_port", rc);
	if ((rc = ibv_query_device(s->ctx, &da)))
		die("ibv_query_device", rc);
	s->mtu = pa.active_mtu;
	s->rd_atom = da.max_qp_rd_atom > 16 ? 16 : (uint8_t)da.max_qp_rd_atom;
	s->gid_index = kv_find_gid(s->ctx, s->port, &s->gid);
	if (s->gid_index < 0) {
		fprintf(stderr, "kv_server: -a %s is not a GID of %s port %u\n",
			addr, ibv_get_device_name(s->ctx->device), s->port);
		exit(1);
	}
	memset(&sa, 0, sizeof(sa));
	if (kv_gid_ipv4(&s->gid, &sa.sin_addr)) {
		fprintf(stderr, "kv_server: -a %s: the raw build listens on TCP "
			"at the GID's IPv4 address: give an IPv4 address\n", addr);
		exit(2);
	}

	/* A completion channel: the loop below sleeps in poll() on it and on
	 * the sockets, so an idle server costs no CPU. */
	s->chan = ibv_create_comp_channel(s->ctx);
	if (!s->chan)
		die("ibv_create_comp_channel", errno);
	s->cq = ibv_create_cq(s->ctx, NRECV + MAX_CLIENTS, NULL, s->chan, 0);
	if (!s->cq)
		die("ibv_create_cq", errno);
	if ((rc = ibv_req_notify_cq(s->cq, 0)))
		die("ibv_req_notify_cq", rc);
	memset(&sia, 0, sizeof(sia));
	sia.attr.max_wr = NRECV;
	sia.attr.max_sge = 1;
	s->srq = ibv_create_srq(s->pd, &sia);
	if (!s->srq)
		die("ibv_create_srq", errno);
	for (int i = 0; i < NRECV; i++)
		post_srq_recv(s, i);
	for (int i = 0; i < MAX_CLIENTS; i++)
		conns[i].fd = -1;

	lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	if (lfd < 0)
		die("socket", errno);
	if (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)))
		die("setsockopt(SO_REUSEADDR)", errno);
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)port);
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa))) {
		fprintf(stderr, "kv_server: bind %s:%d: %s\n", addr, port,
			strerror(errno));
		exit(1);
	}
	/* A burst of new clients all connect at once: a deep backlog. */
	if (listen(lfd, MAX_CLIENTS))
		die("listen", errno);
	printf("kv_server: ready: %u buckets (%u slots, %lu keys) at %s port %d "
	       "on %s (raw verbs); object 0x%" PRIx64 " rkey 0x%x\n", s->nbuckets,
	       s->nbuckets * KV_SLOTS, s->keys, addr, port,
	       ibv_get_device_name(s->ctx->device), (uint64_t)(uintptr_t)s->object,
	       s->table_mr->rkey);

	while (!stop) {
		int n = 2, map[MAX_CLIENTS];

		pfd[0] = (struct pollfd){ .fd = lfd, .events = POLLIN };
		pfd[1] = (struct pollfd){ .fd = s->chan->fd, .events = POLLIN };
		for (int i = 0; i < MAX_CLIENTS; i++)
			if (conns[i].fd >= 0) {
				map[n - 2] = i;
				pfd[n++] = (struct pollfd){ .fd = conns[i].fd,
							    .events = POLLIN };
			}
		rc = poll(pfd, (nfds_t)n, 1000);
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc < 0)
			die("poll", errno);
		if (pfd[1].revents & POLLIN) {
			struct ibv_cq *ev_cq;
			void *ev_ctx;

			/* Re-arm, then drain: a completion arriving in
			 * between raises a new event, none is missed. */
			if (ibv_get_cq_event(s->chan, &ev_cq, &ev_ctx))
				die("ibv_get_cq_event", errno);
			ibv_ack_cq_events(ev_cq, 1);
			if ((rc = ibv_req_notify_cq(s->cq, 0)))
				die("ibv_req_notify_cq", rc);
			drain_cq(s);
		}
		for (int i = 2; i < n; i++)
			if (pfd[i].revents & (POLLIN | POLLHUP | POLLERR))
				conn_readable(s, &conns[map[i - 2]]);
		if (pfd[0].revents & POLLIN) {
			int fd;

			while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
				int i;

				for (i = 0; i < MAX_CLIENTS && conns[i].fd != -1; i++)
					;
				if (i == MAX_CLIENTS) {
					fprintf(stderr, "kv_server: %d clients connected: "
						"refusing one more\n", MAX_CLIENTS);
					close(fd);
					continue;
				}
				setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
				memset(&conns[i], 0, sizeof(conns[i]));
				conns[i].fd = fd;
			}
			if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
			    errno != ECONNABORTED)
				die("accept", errno);
		}
	}
	close(lfd);
	for (int i = 0; i < MAX_CLIENTS; i++)
		if (conns[i].qp) {
			int r = ibv_destroy_qp(conns[i].qp);

			if (r)
				die("ibv_destroy_qp", r);
			conns[i].qp = NULL;
		}
	if ((rc = ibv_destroy_srq(s->srq)))
		die("ibv_destroy_srq", rc);
	return 0;
}

#else /* KRCORE */

/* ---- krcore: one bound VQP -------------------------------------------- */

static void post_vqp_recv(struct server *s, int slot)
{
	struct ibv_sge sge = msg_sge(s, &s->rx[slot], sizeof(struct kv_msg));
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)slot, .sg_list = &sge,
				  .num_sge = 1 }, *bad;
	int rc = ibv_post_recv(s->vqp, &wr, &bad);

	if (rc)
		die("ibv_post_recv", rc);
}

/* Answers completed: their buffers are posted for receiving again. */
static int reap_answers(struct server *s)
{
	struct ibv_wc wc[16];
	int k = ibv_poll_cq(s->cq, 16, wc);

	if (k < 0)
		die("ibv_poll_cq", EIO);
	for (int i = 0; i < k; i++) {
		/* A client that left before its answer arrived fails it:
		 * that client's problem, not the server's. */
		if (wc[i].status != IBV_WC_SUCCESS)
			fprintf(stderr, "kv_server: an answer failed: %s\n",
				ibv_wc_status_str(wc[i].status));
		post_vqp_recv(s, (int)wc[i].wr_id);
	}
	return k;
}

static void die_bind(int rc, const char *addr, int port)
{
	const char *hint = "";

	switch (rc) {
	case EADDRNOTAVAIL: hint = " (the address is not one of this device's GIDs)"; break;
	case EADDRINUSE: hint = " (another VQP is bound there already)"; break;
	case ENOTCONN: hint = " (set KRCORE_META=ip:port of a running krcore-meta)"; break;
	case ECONNREFUSED:
	case ETIMEDOUT: hint = " (is krcore-meta running at KRCORE_META?)"; break;
	}
	fprintf(stderr, "kv_server: qbind(%s, port %d): %s%s\n", addr, port,
		strerror(rc), hint);
	exit(1);
}

static int run(struct server *s, const char *addr, int port)
{
	struct ibv_qp_init_attr qa;
	double since = 0;
	int rc;

	/* One CQ: the answers' send completions (a bound VQP's receives come
	 * out of qpop_msgs, never through the CQ, but it needs one). */
	s->cq = ibv_create_cq(s->ctx, NRECV, NULL, NULL, 0);
	if (!s->cq)
		die("ibv_create_cq", errno);
	memset(&qa, 0, sizeof(qa));
	qa.send_cq = s->cq;
	qa.recv_cq = s->cq;
	qa.qp_type = (enum ibv_qp_type)KRCORE_VQP;
	qa.cap.max_send_wr = NRECV;
	qa.cap.max_recv_wr = NRECV;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	s->vqp = ibv_create_qp(s->pd, &qa);
	if (!s->vqp)
		die("ibv_create_qp(KRCORE_VQP)", errno);
	/* Receives first: a client may send the moment the binding shows. */
	for (int i = 0; i < NRECV; i++)
		post_vqp_recv(s, i);
	if ((rc = qbind(s->vqp, s->gid_bind, port)))
		die_bind(rc, addr, port);
	printf("kv_server: ready: %u buckets (%u slots, %lu keys) at %s port %d "
	       "on %s (krcore VQP); object 0x%" PRIx64 " rkey 0x%x\n", s->nbuckets,
	       s->nbuckets * KV_SLOTS, s->keys, addr, port,
	       ibv_get_device_name(s->ctx->device), (uint64_t)(uintptr_t)s->object,
	       s->table_mr->rkey);

	while (!stop) {
		struct ibv_qp *src[16];
		struct ibv_wc wc[16];
		/* qpop_msgs never blocks. Between calls the library's
		 * service thread keeps taking messages in, so an idle server
		 * may sleep (kv_backoff): a message waits at most 1 ms. */
		int k = qpop_msgs(s->vqp, 16, src, wc);

		if (k < 0)
			die("qpop_msgs", -k);
		for (int i = 0; i < k; i++) {
			int slot = (int)wc[i].wr_id;

			/* The sender destroyed its VQP (its process exited):
			 * reported once, no buffer used. */
			if (wc[i].status == IBV_WC_WR_FLUSH_ERR && wc[i].byte_len == 0) {
				s->left++;
				continue;
			}
			if (wc[i].status != IBV_WC_SUCCESS) {
				fprintf(stderr, "kv_server: a receive failed: %s\n",
					ibv_wc_status_str(wc[i].status));
				post_vqp_recv(s, slot);
				continue;
			}
			if (s->rx[slot].type == KV_HELLO)
				s->clients++;
			handle_msg(s, &s->rx[slot], wc[i].byte_len, &s->tx[slot]);
			/* The answer goes back on src_qp, a VQP the library
			 * connected to the sender; its buffer's receive is
			 * posted again when the answer completes. */
			while ((rc = post_answer(s, src[i], slot, sizeof(struct kv_msg),
						 (uint64_t)slot)) == ENOMEM && !stop)
				reap_answers(s);
			if (rc) {
				fprintf(stderr, "kv_server: answer ibv_post_send: %s\n",
					strerror(rc));
				post_vqp_recv(s, slot);
			}
		}
		if (reap_answers(s) || k)
			since = 0;
		else
			kv_backoff(&since);
	}
	/* Destroying the VQP removes the binding from krcore-meta. */
	if ((rc = ibv_destroy_qp(s->vqp)))
		die("ibv_destroy_qp", rc);
	return 0;
}

#endif /* KRCORE */

static void usage(void)
{
	fprintf(stderr, "usage: kv_server -a ADDR [-P PORT] [-d DEV] [-b BUCKETS] "
			"[-k KEYS]\n"
#ifdef KRCORE
			"  (KRCORE_META=ip:port of a running krcore-meta must be set)\n"
#endif
		);
	exit(2);
}

static long parse_num(const char *s, long lo, long hi, const char *what)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || end == s || v < lo || v > hi) {
		fprintf(stderr, "kv_server: %s must be an integer in [%ld, %ld], "
			"not '%s'\n", what, lo, hi, s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	const char *devname = NULL, *addr = NULL;
	long nbuckets = 4096, preload = 0;
	int port = KV_DEFAULT_PORT, opt, rc;
	struct sigaction sa;
	union ibv_gid gid;
	static struct server s;

	while ((opt = getopt(argc, argv, "a:P:d:b:k:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'P': port = (int)parse_num(optarg, 1, 65535, "-P"); break;
		case 'd': devname = optarg; break;
		case 'b': nbuckets = parse_num(optarg, 1, 1L << 24, "-b"); break;
		case 'k': preload = parse_num(optarg, 0, 1L << 30, "-k"); break;
		default: usage();
		}
	}
	if (!addr || optind != argc)
		usage();
	if (nbuckets & (nbuckets - 1)) {
		fprintf(stderr, "kv_server: -b %ld: the number of buckets must be "
			"a power of two\n", nbuckets);
		return 2;
	}
	if (kv_parse_gid(addr, &gid)) {
		fprintf(stderr, "kv_server: -a %s: not an IPv4 address or GID\n", addr);
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	/* SIGTERM / SIGINT end the loop (no SA_RESTART: poll returns EINTR). */
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);

	s.ctx = kv_open_device("kv_server", devname);
	if (!s.ctx)
		return 1;
	s.pd = ibv_alloc_pd(s.ctx);
	if (!s.pd)
		die("ibv_alloc_pd", errno);
#ifdef KRCORE
	s.gid_bind = gid;
#else
	s.gid = gid;
#endif
	setup_memory(&s, (uint32_t)nbuckets, preload);
	rc = run(&s, addr, port);

	printf("kv_server: %lu clients (%lu gone), %lu PUTs (%lu refused: probe "
	       "path full), %lu bad messages, %lu keys\n", s.clients, s.left,
	       s.puts, s.full, s.bad, s.keys);
	if ((rc = ibv_destroy_cq(s.cq)))
		die("ibv_destroy_cq", rc);
#ifndef KRCORE
	if ((rc = ibv_destroy_comp_channel(s.chan)))
		die("ibv_destroy_comp_channel", rc);
#endif
	if ((rc = ibv_dereg_mr(s.msg_mr)))
		die("ibv_dereg_mr", rc);
	if ((rc = ibv_dereg_mr(s.table_mr)))
		die("ibv_dereg_mr", rc);
	if ((rc = ibv_dealloc_pd(s.pd)))
		die("ibv_dealloc_pd", rc);
	if ((rc = ibv_close_device(s.ctx)))
		die("ibv_close_device", rc);
	return 0;
}
