/*
 * kv_client: a client of kv_server, the disaggregated key-value store.
 *
 * GET is one-sided: the client computes the key's bucket (kv.h) and READs
 * it from the server's registered memory (address and rkey learned when
 * it connected); the server's CPU does nothing. A bucket whose READ
 * overlapped a PUT (a slot with an odd version, or whose check does not
 * match) is READ again. PUT is a message: the client SENDs the key and the
 * value, the server applies it and answers.
 *
 * Every value the client gets is checked: it must belong to the key, be
 * whole (kv_value_ok) and be of the expected generation (-G).
 *
 * Two builds of this one source, like kv_server:
 *   raw verbs (default): an RC QP, connected over a TCP exchange with the
 *     server (QPN, PSN, GID one way; QPN, PSN, GID, table address and
 *     rkey back), INIT -> RTR -> RTS; the TCP connection stays open until
 *     the client exits (the server destroys the QP when it closes).
 *   krcore (-DKRCORE): a virtual QP, qconnect(server's GID, PORT), then a
 *     HELLO message whose answer carries the table's address and rkey.
 *     Needs KRCORE_META (krcore-meta's ip:port); KRCORE_GID_INDEX chooses
 *     the local GID (default: the one routed to the meta server).
 *
 *   kv_client -a ADDR [-P PORT] [-d DEV] [-g GID_INDEX] [-k KEYS]
 *             [-L [-U ROUNDS]] [-G GEN|any] [-n GETS] [-O | -o ADDR:RKEY] [-T] [-W FD]
 *
 *   -a ADDR      the server's address (IPv4, i.e. GID ::ffff:ADDR, or a
 *                GID in IPv6 notation; raw: IPv4 only, its TCP address)
 *   -P PORT      raw: TCP port; krcore: the server's VQP port (18800)
 *   -d DEV       RDMA device (default: the first one)
 *   -g INDEX     raw only: local GID index (default: the port's first
 *                IPv4-mapped GID); krcore: set KRCORE_GID_INDEX instead
 *   -k KEYS      the keys are 1..KEYS (1000)
 *   -L           load: PUT every key 1..KEYS with generation GEN, then
 *                GET each one back (checked) before the GETs below
 *   -U ROUNDS    with -L: load ROUNDS times, with generations GEN, GEN+1,
 *                ... (a writer, for a test of GETs racing PUTs: run the
 *                readers with -G any; they count torn READs)
 *   -G GEN       the generation every GET must find (1); "any": any whole
 *                value of the key (for runs with a concurrent writer)
 *   -n GETS      GETs of random keys in 1..KEYS after connecting (and
 *                loading), each checked (1000; 0: none)
 *   -O           object: READ the server's 64 KiB object once, check it
 *                byte for byte and exit (the "serverless" fetch)
 *   -o ADDR:RKEY as -O, the object's location given (hex, as kv_server's
 *                ready line prints it), as a serverless function is handed
 *                where its input lies: krcore sends no HELLO (qconnect,
 *                then the READ); raw verbs still makes its TCP exchange
 *                (its QP needs one) and checks that the server names the
 *                same location
 *   -T           print a line of absolute CLOCK_MONOTONIC times (us) for
 *                benchmarks: "kv_times main_us=.. setup_us=.. path_us=..
 *                connected_us=.. first_get_us=.. get_start_us=..
 *                get_end_us=.. gets=.. torn=.. object_us=.. main_cpu_us=..
 *                setup_cpu_us=.. path_cpu_us=.. connected_cpu_us=.." (0:
 *                did not happen; setup: device, PD, CQ and MR done; path:
 *                raw, the server's QP address received over TCP, krcore,
 *                qconnect returned; connected: table address known, QP
 *                ready; *_cpu_us: the CPU time this process had used at
 *                main, setup, path and connected), and
 *                right after the first GET "kv_first first_get_us=..
 *                cpu_us=.." (the CPU time this process, all its threads,
 *                had used by then)
 *   -W FD        after the first GET, wait until FD reaches end-of-file
 *                (at most 300 s) before the other GETs (a benchmark starts
 *                many clients and lets them go at once)
 *
 * Output: one line per phase, e.g.
 *
 *   kv_client: 1000 keys loaded from 10.77.0.1 port 18800 (1000 PUTs, each read back and checked): connect 283112 us, 1544 PUTs/s (raw verbs)
 *   kv_client: 1000 GETs verified (0 torn reads retried) from 10.77.0.1 port 18800: connect 283112 us, first GET 812 us later, 9150 GETs/s (raw verbs)
 *
 * (connect: from main() to the QP ready with the table's address: device,
 * PD, CQ, MR and the connection; "later": after that, or after the load).
 *
 * Exit status 0 when every operation succeeded and every value was right,
 * 1 otherwise (the reason on stderr), 2 for a usage error.
 */
#define _GNU_SOURCE
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <unistd.h>
#ifdef KRCORE
#include <krcore.h>
#define TRANSPORT "krcore VQP"
#else
#define TRANSPORT "raw verbs"
#endif
#include "kv.h"

#define OP_TIMEOUT_US 30e6	/* one operation: generous, the VM is slow */
#define TORN_RETRIES 1000	/* READs of one bucket that overlap PUTs */
#define GEN_ANY UINT64_MAX

/* Local buffers, one registration: a bucket, a message each way, the
 * object. */
#define OFF_BUCKET 0
#define OFF_TX 512
#define OFF_RX 1024
#define OFF_OBJECT 4096
#define LOCAL_LEN (OFF_OBJECT + KV_OBJECT_LEN)

/*
 * Errors go out in one write(2): many clients may share one stderr (a
 * benchmark starts dozens at once), and a message written in pieces would
 * interleave with theirs.
 */
static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void fail(const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	int n = snprintf(msg, sizeof(msg), "kv_client: ");

	fflush(stdout);
	va_start(ap, fmt);
	n += vsnprintf(msg + n, sizeof(msg) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(msg) - 2)
		n = (int)sizeof(msg) - 2;
	msg[n++] = '\n';
	if (write(2, msg, (size_t)n) < 0)
		exit(1);
	exit(1);
}

static void die(const char *what, int err)
{
	fail("%s: %s", what, strerror(err));
}

struct client {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	struct ibv_qp *qp;
	uint8_t *buf;
	struct kv_table_info info;
	uint64_t seq;
	unsigned long torn;
	int fd;			/* raw: the TCP connection to the server */
	double t_setup;		/* device, PD, CQ, MR done (CLOCK_MONOTONIC us) */
	double cpu_setup, cpu_path;	/* the CPU time used by then (us) */
	double t_path;		/* raw: the server's answer over TCP received;
				 * krcore: qconnect returned */
	int given;		/* -o: info.object_addr and info.rkey given */
};

/* CPU time (user + system) of all this process's threads so far, us. */
static double cpu_us(void)
{
	struct rusage ru;

	if (getrusage(RUSAGE_SELF, &ru))
		return -1;
	return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
	       (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

/* ---- waiting for completions ------------------------------------------ */

/* Polls until `want` completions came (a SEND and its answer's receive
 * come in either order). Every one must succeed. */
static void wait_wcs(struct client *c, int want, const char *what)
{
	double start = kv_now_us(), since = 0;
	int got = 0, sends = 0, recvs = 0;

	while (got < want) {
		struct ibv_wc wc;
		int k = ibv_poll_cq(c->cq, 1, &wc);

		if (k < 0)
			fail("%s: ibv_poll_cq failed", what);
		if (k == 0) {
			if (kv_now_us() - start > OP_TIMEOUT_US)
				fail("%s: %d of %d completions within %.0f s (%d send, %d "
				     "receive: is the server alive?)", what, got, want,
				     OP_TIMEOUT_US / 1e6, sends, recvs);
			kv_backoff(&since);
			continue;
		}
		since = 0;
		if (wc.status != IBV_WC_SUCCESS)
			fail("%s: %s completion: %s (vendor error %#x)", what,
			     wc.opcode == IBV_WC_RECV ? "receive" : "send",
			     ibv_wc_status_str(wc.status), wc.vendor_err);
		got++;
		if (wc.opcode == IBV_WC_RECV)
			recvs++;
		else
			sends++;
	}
}

/* One RDMA READ of len bytes at the server's raddr into buf + off. */
static void rdma_read(struct client *c, uint64_t raddr, uint32_t len,
		      size_t off, const char *what)
{
	struct ibv_sge sge = { (uintptr_t)(c->buf + off), len, c->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_RDMA_READ,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	int rc;

	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = c->info.rkey;
	if ((rc = ibv_post_send(c->qp, &wr, &bad)))
		fail("%s: ibv_post_send(RDMA_READ): %s", what, strerror(rc));
	wait_wcs(c, 1, what);
}

/* Sends the message in the TX buffer and waits for the answer in RX. */
static struct kv_msg *call(struct client *c, const char *what)
{
	struct kv_msg *tx = (struct kv_msg *)(c->buf + OFF_TX);
	struct kv_msg *rx = (struct kv_msg *)(c->buf + OFF_RX);
	struct ibv_sge rsge = { (uintptr_t)rx, sizeof(*rx), c->mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 2, .sg_list = &rsge, .num_sge = 1 }, *rbad;
	struct ibv_sge ssge = { (uintptr_t)tx, sizeof(*tx), c->mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 3, .sg_list = &ssge, .num_sge = 1,
				   .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED }, *sbad;
	int rc;

	tx->magic = KV_MSG_MAGIC;
	tx->seq = ++c->seq;
	memset(rx, 0, sizeof(*rx));
	/* The receive before the send: the answer always finds a buffer. */
	if ((rc = ibv_post_recv(c->qp, &rwr, &rbad)))
		fail("%s: ibv_post_recv: %s", what, strerror(rc));
	if ((rc = ibv_post_send(c->qp, &swr, &sbad)))
		fail("%s: ibv_post_send(SEND): %s", what, strerror(rc));
	wait_wcs(c, 2, what);
	if (rx->magic != KV_MSG_MAGIC || rx->seq != tx->seq ||
	    rx->type != tx->type + 1)
		fail("%s: a wrong answer (magic %#x, type %u, seq %llu; sent type "
		     "%u, seq %llu)", what, rx->magic, rx->type,
		     (unsigned long long)rx->seq, tx->type,
		     (unsigned long long)tx->seq);
	return rx;
}

/* ---- the store's operations ------------------------------------------- */

static void put(struct client *c, uint64_t key, uint64_t gen)
{
	struct kv_msg *tx = (struct kv_msg *)(c->buf + OFF_TX);
	struct kv_msg *rx;
	char what[64];

	snprintf(what, sizeof(what), "PUT of key %llu", (unsigned long long)key);
	memset(tx, 0, sizeof(*tx));
	tx->type = KV_PUT;
	tx->key = key;
	kv_value_fill(key, gen, tx->u.value);
	rx = call(c, what);
	if (rx->status == KV_FULL)
		fail("%s: refused, the key's probe path is full (start the server "
		     "with more buckets, -b)", what);
	if (rx->status != KV_OK)
		fail("%s: refused (status %u)", what, rx->status);
}

/* A slot is readable when stable (even version) and whole (its check). */
static int slot_torn(const struct kv_slot *s)
{
	if (s->version == 0 && s->key == 0)
		return 0;	/* never written */
	return (s->version & 1) || s->check != kv_check(s->version, s->key, s->value);
}

/* GET: the key's value into value; dies if it is absent. */
static void get(struct client *c, uint64_t key, uint8_t *value)
{
	uint32_t mask = c->info.nbuckets - 1, h = kv_bucket_of(key, c->info.nbuckets);
	const struct kv_bucket *b = (const struct kv_bucket *)(c->buf + OFF_BUCKET);
	char what[64];

	snprintf(what, sizeof(what), "GET of key %llu", (unsigned long long)key);
	for (uint32_t p = 0; p < KV_PROBES; p++) {
		uint64_t raddr = c->info.table_addr +
				 (uint64_t)((h + p) & mask) * sizeof(struct kv_bucket);
		int torn = 1, empty = 0;

		for (int r = 0; r < TORN_RETRIES && torn; r++) {
			rdma_read(c, raddr, sizeof(*b), OFF_BUCKET, what);
			torn = 0;
			for (int i = 0; i < KV_SLOTS; i++)
				torn |= slot_torn(&b->slot[i]);
			c->torn += (unsigned long)torn;
		}
		if (torn)
			fail("%s: bucket %u changed under %d READs in a row",
			     what, (h + p) & mask, TORN_RETRIES);
		for (int i = 0; i < KV_SLOTS; i++) {
			if (b->slot[i].key == key) {
				memcpy(value, b->slot[i].value, KV_VALUE_LEN);
				return;
			}
			empty |= b->slot[i].key == 0;
		}
		if (empty)
			break;	/* the probe path ends here */
	}
	fail("%s: not in the table (load it first: kv_client -L, or kv_server -k)",
	     what);
}

/* GET and check the value: whole, of this key, of generation gen. */
static void get_checked(struct client *c, uint64_t key, uint64_t gen)
{
	uint8_t value[KV_VALUE_LEN];
	uint64_t g;

	get(c, key, value);
	if (kv_value_ok(key, value, &g))
		fail("GET of key %llu: the value is not one a PUT of this key "
		     "wrote (corrupt, or another key's)", (unsigned long long)key);
	if (gen != GEN_ANY && g != gen)
		fail("GET of key %llu: generation %llu, expected %llu",
		     (unsigned long long)key, (unsigned long long)g,
		     (unsigned long long)gen);
}

/* ---- connecting ---------------------------------------------------------- */

static struct ibv_qp *create_qp(struct client *c, enum ibv_qp_type type)
{
	struct ibv_qp_init_attr qa;

	memset(&qa, 0, sizeof(qa));
	qa.send_cq = c->cq;
	qa.recv_cq = c->cq;
	qa.qp_type = type;
	qa.cap.max_send_wr = 4;
	qa.cap.max_recv_wr = 4;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	return ibv_create_qp(c->pd, &qa);
}

#ifndef KRCORE

/* The first IPv4-mapped GID of the port (RoCE v2 on an IPv4 address). */
static int default_gid_index(struct ibv_context *ctx, uint8_t port)
{
	struct ibv_port_attr pa;
	struct in_addr ip;
	union ibv_gid g;

	if (ibv_query_port(ctx, port, &pa))
		return -1;
	for (int i = 0; i < pa.gid_tbl_len; i++)
		if (!ibv_query_gid(ctx, port, i, &g) && !kv_gid_ipv4(&g, &ip))
			return i;
	return -1;
}

static void full_io(int fd, void *p, size_t len, int out, const char *what)
{
	size_t done = 0;

	while (done < len) {
		ssize_t n = out ? send(fd, (char *)p + done, len - done, MSG_NOSIGNAL)
				: recv(fd, (char *)p + done, len - done, 0);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			fail("%s: the server did not answer within %.0f s", what,
			     OP_TIMEOUT_US / 1e6);
		if (n < 0)
			fail("%s: %s", what, strerror(errno));
		if (n == 0)
			fail("%s: the server closed the connection (see its output)",
			     what);
		done += (size_t)n;
	}
}

/*
 * Raw verbs: create an RC QP, INIT, exchange (QPN, PSN, GID) with the
 * server over TCP (it creates and connects its own QP for us and sends the
 * table's address and rkey), RTR, RTS.
 */
static void connect_server(struct client *c, const char *addr, int port,
			   int gid_index)
{
	struct ibv_port_attr pa;
	struct ibv_device_attr da;
	struct ibv_qp_attr a;
	struct kv_conn_req req;
	struct kv_conn_rep rep;
	struct sockaddr_in sa;
	struct timeval tv = { (time_t)(OP_TIMEOUT_US / 1e6), 0 };
	union ibv_gid gid;
	uint32_t psn = ((uint32_t)getpid() * 2654435761u) & 0xffffff;
	uint8_t port_num = 1;
	int one = 1, rc;

	if ((rc = ibv_query_port(c->ctx, port_num, &pa)))
		die("ibv_query_port", rc);
	if ((rc = ibv_query_device(c->ctx, &da)))
		die("ibv_query_device", rc);
	if (gid_index < 0 && (gid_index = default_gid_index(c->ctx, port_num)) < 0)
		fail("no IPv4-mapped GID on %s port %u: give one with -g",
		     ibv_get_device_name(c->ctx->device), port_num);
	if ((rc = ibv_query_gid(c->ctx, port_num, gid_index, &gid)))
		fail("GID index %d: ibv_query_gid: %s", gid_index, strerror(rc));

	c->qp = create_qp(c, IBV_QPT_RC);
	if (!c->qp)
		die("ibv_create_qp(RC)", errno);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = port_num;
	a.qp_access_flags = 0;	/* nobody reads or writes the client */
	if ((rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
						   IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)))
		die("ibv_modify_qp(INIT)", rc);

	/* TCP from the GID's own IPv4 address (on Soft-RoCE every address is
	 * a node: the connection comes from the same one as the QP). */
	c->fd = socket(AF_INET, SOCK_STREAM, 0);
	if (c->fd < 0)
		die("socket", errno);
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	if (!kv_gid_ipv4(&gid, &sa.sin_addr) &&
	    bind(c->fd, (struct sockaddr *)&sa, sizeof(sa)))
		fail("bind to GID index %d's address: %s", gid_index, strerror(errno));
	sa.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, addr, &sa.sin_addr) != 1)
		fail("-a %s: the raw build needs the server's IPv4 address", addr);
	if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)))
		fail("connect to %s:%d: %s (is kv_server running there?)", addr,
		     port, strerror(errno));
	setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)))
		die("setsockopt(SO_RCVTIMEO)", errno);

	memset(&req, 0, sizeof(req));
	req.magic = KV_CONN_MAGIC;
	req.qpn = c->qp->qp_num;
	req.psn = psn;
	req.mtu = pa.active_mtu;
	memcpy(req.gid, gid.raw, 16);
	full_io(c->fd, &req, sizeof(req), 1, "sending the QP's address");
	full_io(c->fd, &rep, sizeof(rep), 0, "receiving the server's QP address");
	c->t_path = kv_now_us();
	c->cpu_path = cpu_us();
	if (rep.magic != KV_CONN_MAGIC)
		fail("the server's answer has a bad magic (%#x): not kv_server?",
		     rep.magic);
	if (rep.status)
		fail("the server could not connect a QP for us: %s",
		     strerror((int)rep.status));
	c->info = rep.info;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = (enum ibv_mtu)rep.mtu;
	a.dest_qp_num = rep.qpn;
	a.rq_psn = rep.psn;
	a.max_dest_rd_atomic = 0;	/* the server never READs us */
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, rep.gid, 16);
	a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = port_num;
	if ((rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_AV |
						   IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
						   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
						   IBV_QP_MIN_RNR_TIMER)))
		die("ibv_modify_qp(RTR)", rc);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = psn;
	a.max_rd_atomic = da.max_qp_rd_atom > 16 ? 16 : (uint8_t)da.max_qp_rd_atom;
	if ((rc = ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT |
						   IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
						   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)))
		die("ibv_modify_qp(RTS)", rc);
}

#else /* KRCORE */

static void die_connect(int rc, const char *addr, int port)
{
	const char *hint = "";

	switch (rc) {
	case ECONNREFUSED: hint = " (nothing is bound there: is kv_server (the "
				  "krcore build) running, with the same KRCORE_META?)"; break;
	case ETIMEDOUT: hint = " (the server's process or krcore-meta did not "
			       "answer within KRCORE_CONNECT_TIMEOUT_MS)"; break;
	case ENOTCONN: hint = " (set KRCORE_META=ip:port of a running krcore-meta)"; break;
	}
	fail("qconnect(%s, port %d): %s%s", addr, port, strerror(rc), hint);
}

/*
 * krcore: a VQP, qconnect to the server's (GID, port) (the library looks
 * it up in krcore-meta and makes or reuses a link to the server's
 * process), then HELLO: the answer has the table's address and rkey.
 */
static void connect_server(struct client *c, const char *addr, int port,
			   int gid_index)
{
	struct kv_msg *tx = (struct kv_msg *)(c->buf + OFF_TX);
	struct kv_msg *rx;
	union ibv_gid gid;
	int rc;

	(void)gid_index;
	if (kv_parse_gid(addr, &gid))
		fail("-a %s: not an IPv4 address or GID", addr);
	c->qp = create_qp(c, (enum ibv_qp_type)KRCORE_VQP);
	if (!c->qp)
		die("ibv_create_qp(KRCORE_VQP)", errno);
	if ((rc = qconnect(c->qp, gid, port)))
		die_connect(rc, addr, port);
	c->t_path = kv_now_us();
	c->cpu_path = cpu_us();
	if (c->given)
		return; /* where the object lies is known: no HELLO */
	memset(tx, 0, sizeof(*tx));
	tx->type = KV_HELLO;
	rx = call(c, "HELLO");
	c->info = rx->u.info;
}

#endif /* KRCORE */

static void check_info(const struct client *c, const struct kv_table_info *given)
{
	const struct kv_table_info *i = &c->info;

	if (c->given) {
		/* krcore asked nothing; raw's TCP exchange told it where. */
		if (i->object_addr != given->object_addr || i->rkey != given->rkey)
			fail("-o %#" PRIx64 ":%#x: the server's object is at %#" PRIx64
			     " rkey %#x", given->object_addr, given->rkey,
			     i->object_addr, i->rkey);
		return;
	}
	if (!i->nbuckets || (i->nbuckets & (i->nbuckets - 1)) ||
	    i->object_len != KV_OBJECT_LEN)
		fail("the server sent a bad table description (%u buckets, "
		     "object of %u B)", i->nbuckets, i->object_len);
}

/* -W: wait (bounded) until fd reaches end-of-file. */
static void wait_eof(int fd)
{
	double start = kv_now_us();
	char b[64];

	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		int rc = poll(&p, 1, 1000);
		ssize_t n;

		if (rc < 0 && errno != EINTR)
			die("poll (-W)", errno);
		if (rc > 0) {
			n = read(fd, b, sizeof(b));
			if (n == 0)
				return;
			if (n < 0 && errno != EINTR && errno != EAGAIN)
				die("read (-W)", errno);
		}
		if (kv_now_us() - start > 300e6)
			fail("-W %d: no end-of-file within 300 s", fd);
	}
}

static void usage(void)
{
	fprintf(stderr,
		"usage: kv_client -a ADDR [-P PORT] [-d DEV] [-g GID_INDEX] "
		"[-k KEYS] [-L [-U ROUNDS]] [-G GEN|any] [-n GETS] [-O | -o ADDR:RKEY] [-T] [-W FD]\n"
#ifdef KRCORE
		"  (KRCORE_META=ip:port of krcore-meta must be set; "
		"KRCORE_GID_INDEX picks the local GID)\n"
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
		fprintf(stderr, "kv_client: %s must be an integer in [%ld, %ld], "
			"not '%s'\n", what, lo, hi, s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	double t_main = kv_now_us(), cpu_main = cpu_us(), t_conn, cpu_conn,
	       t_loaded, t_first = 0, t_start = 0, t_end = 0, t_object = 0;
	const char *devname = NULL, *addr = NULL;
	long keys = 1000, gets = 1000, gid_index = -1, wait_fd = -1, rounds = 1;
	int port = KV_DEFAULT_PORT, load = 0, object = 0, times = 0, opt, rc;
	uint64_t gen = 1, rng;
	struct kv_table_info given = { 0 };
	struct client c;
	char tail;

	while ((opt = getopt(argc, argv, "a:P:d:g:k:LU:G:n:Oo:TW:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'P': port = (int)parse_num(optarg, 1, 65535, "-P"); break;
		case 'd': devname = optarg; break;
		case 'g': gid_index = parse_num(optarg, 0, 65535, "-g"); break;
		case 'k': keys = parse_num(optarg, 1, 1L << 30, "-k"); break;
		case 'L': load = 1; break;
		case 'U': rounds = parse_num(optarg, 1, 1L << 30, "-U"); break;
		case 'G':
			gen = strcmp(optarg, "any") ?
				      (uint64_t)parse_num(optarg, 0, 1L << 62, "-G") :
				      GEN_ANY;
			break;
		case 'n': gets = parse_num(optarg, 0, 1L << 40, "-n"); break;
		case 'O': object = 1; break;
		case 'o':
			if (sscanf(optarg, "%" SCNx64 ":%" SCNx32 "%c", &given.object_addr,
				   &given.rkey, &tail) != 2) {
				fprintf(stderr, "kv_client: -o %s: not ADDR:RKEY (hex)\n", optarg);
				return 2;
			}
			object = 2;
			break;
		case 'T': times = 1; break;
		case 'W': wait_fd = parse_num(optarg, 0, 1 << 20, "-W"); break;
		default: usage();
		}
	}
	if (!addr || optind != argc || (load && gen == GEN_ANY) ||
	    (rounds > 1 && !load) || (object == 2 && load))
		usage();
#ifdef KRCORE
	if (gid_index >= 0) {
		fprintf(stderr, "kv_client: -g: the krcore build takes its local GID "
			"from KRCORE_GID_INDEX (the library reads it at start)\n");
		return 2;
	}
#endif
	setvbuf(stdout, NULL, _IOLBF, 0);
	memset(&c, 0, sizeof(c));
	c.fd = -1;
	c.given = object == 2;
	if (c.given)
		c.info = given;
	rng = ((uint64_t)getpid() << 32) ^ (uint64_t)t_main ^ 0x9e3779b97f4a7c15ull;

	c.ctx = kv_open_device("kv_client", devname);
	if (!c.ctx)
		return 1;
	c.pd = ibv_alloc_pd(c.ctx);
	if (!c.pd)
		die("ibv_alloc_pd", errno);
	c.cq = ibv_create_cq(c.ctx, 16, NULL, NULL, 0);
	if (!c.cq)
		die("ibv_create_cq", errno);
	c.buf = aligned_alloc(4096, LOCAL_LEN);
	if (!c.buf)
		die("aligned_alloc", ENOMEM);
	memset(c.buf, 0, LOCAL_LEN);
	c.mr = ibv_reg_mr(c.pd, c.buf, LOCAL_LEN, IBV_ACCESS_LOCAL_WRITE);
	if (!c.mr)
		die("ibv_reg_mr", errno);

	c.t_setup = kv_now_us();
	c.cpu_setup = cpu_us();
	connect_server(&c, addr, port, (int)gid_index);
	check_info(&c, &given);
	t_conn = kv_now_us();
	cpu_conn = cpu_us();

	if (object) {
		/* The serverless fetch: one READ of the whole object. */
		memset(c.buf + OFF_OBJECT, 0, KV_OBJECT_LEN);
		rdma_read(&c, c.info.object_addr, KV_OBJECT_LEN, OFF_OBJECT,
			  "READ of the object");
		for (size_t i = 0; i < KV_OBJECT_LEN; i++)
			if (c.buf[OFF_OBJECT + i] != kv_object_byte(i))
				fail("the object differs at byte %zu: %#x, expected %#x",
				     i, c.buf[OFF_OBJECT + i], kv_object_byte(i));
		t_object = kv_now_us();
		gets = 0;
	}
	for (long r = 0; load && r < rounds; r++) {
		for (long k = 1; k <= keys; k++)
			put(&c, (uint64_t)k, gen + (uint64_t)r);
		for (long k = 1; k <= keys; k++)
			get_checked(&c, (uint64_t)k, gen + (uint64_t)r);
	}
	t_loaded = kv_now_us();
	for (long i = 0; i < gets; i++) {
		uint64_t key;

		rng ^= rng << 13;
		rng ^= rng >> 7;
		rng ^= rng << 17;
		key = 1 + rng % (uint64_t)keys;
		get_checked(&c, key, gen);
		if (i == 0) {
			t_first = kv_now_us();
			if (times)
				printf("kv_first first_get_us=%.0f cpu_us=%.0f\n",
				       t_first, cpu_us());
			if (wait_fd >= 0)
				wait_eof((int)wait_fd);
			t_start = kv_now_us();
		}
	}
	t_end = kv_now_us();

	if (object)
		printf("kv_client: the %d B object verified from %s port %d: "
		       "connect %.0f us, READ %.0f us, %.0f us since main (%s)\n",
		       KV_OBJECT_LEN, addr, port, t_conn - t_main, t_object - t_conn,
		       t_object - t_main, TRANSPORT);
	if (load)
		printf("kv_client: %ld keys loaded from %s port %d (%ld PUTs, each "
		       "read back and checked): connect %.0f us, %.0f PUTs/s (%s)\n",
		       keys, addr, port, keys * rounds, t_conn - t_main,
		       (double)keys * (double)rounds / ((t_loaded - t_conn) / 1e6),
		       TRANSPORT);
	if (gets)
		printf("kv_client: %ld GETs verified (%lu torn reads retried) from "
		       "%s port %d: connect %.0f us, first GET %.0f us later, "
		       "%.0f GETs/s (%s)\n", gets, c.torn, addr, port,
		       t_conn - t_main, t_first - t_loaded,
		       gets > 1 ? (gets - 1) / ((t_end - t_start) / 1e6) : 0, TRANSPORT);
	if (!object && !load && !gets)
		printf("kv_client: connected to %s port %d in %.0f us, nothing else "
		       "to do (-n 0) (%s)\n", addr, port, t_conn - t_main, TRANSPORT);
	if (times)
		printf("kv_times main_us=%.0f setup_us=%.0f path_us=%.0f "
		       "connected_us=%.0f first_get_us=%.0f get_start_us=%.0f "
		       "get_end_us=%.0f gets=%ld torn=%lu object_us=%.0f "
		       "main_cpu_us=%.0f setup_cpu_us=%.0f path_cpu_us=%.0f "
		       "connected_cpu_us=%.0f\n",
		       t_main, c.t_setup, c.t_path, t_conn, t_first,
		       gets ? t_start : 0, gets ? t_end : 0, gets > 1 ? gets - 1 : 0,
		       c.torn, t_object, cpu_main, c.cpu_setup, c.cpu_path, cpu_conn);

	/* Raw: closing the TCP connection tells the server to destroy our
	 * QP's peer. krcore: the server sees the VQP's close report. */
	if ((rc = ibv_destroy_qp(c.qp)))
		die("ibv_destroy_qp", rc);
	if (c.fd >= 0)
		close(c.fd);
	if ((rc = ibv_dereg_mr(c.mr)))
		die("ibv_dereg_mr", rc);
	if ((rc = ibv_destroy_cq(c.cq)))
		die("ibv_destroy_cq", rc);
	if ((rc = ibv_dealloc_pd(c.pd)))
		die("ibv_dealloc_pd", rc);
	if ((rc = ibv_close_device(c.ctx)))
		die("ibv_close_device", rc);
	free(c.buf);
	return 0;
}
