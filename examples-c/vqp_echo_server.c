/*
 * vqp_echo_server: an echo server on a krcore virtual QP (VQP).
 *
 * One VQP, bound with qbind to (ADDR, PORT), serves every client: there is
 * no per-client QP to create, no ibv_modify_qp and no out-of-band exchange
 * of QP numbers. Clients (vqp_echo_client) find the server through the
 * krcore-meta server (KRCORE_META) and connect with qconnect. Each received
 * message comes out of qpop_msgs together with `src_qp`, a VQP the library
 * has already connected back to its sender; the server echoes the message
 * with an ordinary ibv_post_send on it.
 *
 *   KRCORE_META=10.77.0.1:18700 vqp_echo_server -a 10.77.0.1 [-P 5000]
 *       [-d rxe0] [-n MESSAGES]
 *
 *   -a ADDR   the address to bind: an IPv4 address (its RoCE v2 GID,
 *             ::ffff:ADDR) or a GID in IPv6 notation; it must be one of the
 *             device's GIDs
 *   -P PORT   the VQP "port" to bind (a krcore port, not a TCP port; 5000)
 *   -d DEV    the RDMA device (default: the first one)
 *   -n COUNT  exit after echoing COUNT messages (default: run until
 *             SIGTERM or SIGINT)
 *
 * When bound it prints one line on stdout (scripts wait for it):
 *
 *   vqp_echo_server: ready: bound to 10.77.0.1 port 5000 on rxe0
 *
 * and on exit a summary ("echoed N messages (B bytes) from K senders").
 * Exit status 0 on a clean stop with every echo delivered; 1 after an error
 * (printed on stderr), or when some echo failed (its client went away).
 *
 * Build: cc -O2 -I include vqp_echo_server.c -L target/release -lkrcore
 * (see examples-c/Makefile).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <krcore.h> /* includes <infiniband/verbs.h> */
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/*
 * Each receive buffer holds the largest message this server echoes (1 MiB;
 * the library READs a message above 4 KiB straight into it). NBUF receives
 * are posted at all times (minus the ones whose echo is in flight, see
 * below): enough for several clients with a message each in flight.
 */
#define MSG_MAX (1 << 20)
#define NBUF 16
#define POP_BATCH 16
#define MAX_SENDERS 1024

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static void die(const char *what, int err)
{
	fprintf(stderr, "vqp_echo_server: %s: %s\n", what, strerror(err));
	exit(1);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* An IPv4 address becomes its RoCE v2 GID (IPv4-mapped IPv6, ::ffff:a.b.c.d);
 * anything else must be a GID written as an IPv6 address. */
static int parse_gid(const char *s, union ibv_gid *gid)
{
	struct in_addr v4;

	memset(gid, 0, sizeof(*gid));
	if (inet_pton(AF_INET, s, &v4) == 1) {
		gid->raw[10] = gid->raw[11] = 0xff;
		memcpy(&gid->raw[12], &v4, 4);
		return 0;
	}
	return inet_pton(AF_INET6, s, gid->raw) == 1 ? 0 : -1;
}

static struct ibv_context *open_device(const char *name)
{
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	int n, i;

	list = ibv_get_device_list(&n);
	if (!list)
		die("ibv_get_device_list", errno);
	for (i = 0; i < n; i++)
		if (!name || !strcmp(ibv_get_device_name(list[i]), name))
			break;
	if (i == n) {
		fprintf(stderr, "vqp_echo_server: no RDMA device%s%s (%d found)\n",
			name ? " named " : "", name ? name : "", n);
		exit(1);
	}
	ctx = ibv_open_device(list[i]);
	if (!ctx)
		die("ibv_open_device", errno);
	ibv_free_device_list(list);
	return ctx;
}

/* qbind's errors, with what to do about them. */
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
	fprintf(stderr, "vqp_echo_server: qbind(%s, port %d): %s%s\n", addr,
		port, strerror(rc), hint);
	exit(1);
}

struct server {
	struct ibv_qp *qp;	/* the bound VQP */
	struct ibv_cq *cq;	/* its send completions (echoes) */
	struct ibv_mr *mr;
	uint8_t *buf;		/* NBUF receive buffers of MSG_MAX bytes */
	int in_flight;		/* echoes posted and not completed yet */
	unsigned long echoed, bytes, failed, closed;
	struct {
		struct ibv_qp *qp;
		uint32_t qp_num;
	} senders[MAX_SENDERS];
	int nsenders;
};

static void post_recv(struct server *s, int slot)
{
	struct ibv_sge sge = { (uintptr_t)(s->buf + (size_t)slot * MSG_MAX),
			       MSG_MAX, s->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)slot, .sg_list = &sge,
				  .num_sge = 1 }, *bad;
	int rc = ibv_post_recv(s->qp, &wr, &bad);

	if (rc)
		die("ibv_post_recv", rc);
}

/*
 * Reaps echo completions. The echo is sent straight from the receive
 * buffer (no copy), so a buffer is posted for receiving again only once
 * its echo has completed: the send's wr_id is the buffer's slot.
 */
static int reap_sends(struct server *s)
{
	struct ibv_wc wc[POP_BATCH];
	int k = ibv_poll_cq(s->cq, POP_BATCH, wc);

	if (k < 0)
		die("ibv_poll_cq", EIO);
	for (int i = 0; i < k; i++) {
		/* A client that went away mid-echo fails its send; that is
		 * the client's problem, not the server's: note it, go on. */
		if (wc[i].status != IBV_WC_SUCCESS) {
			fprintf(stderr, "vqp_echo_server: an echo failed: %s\n",
				ibv_wc_status_str(wc[i].status));
			s->failed++;
		}
		s->in_flight--;
		post_recv(s, (int)wc[i].wr_id);
	}
	return k;
}

/*
 * Counts distinct senders. The library hands out one src_qp per sending VQP
 * and reuses it for all of that VQP's messages, so the src_qp identifies
 * the sender (wc.src_qp does not: a sender's virtual QP number is unique
 * only in its own process). A src_qp is freed after its sender goes away
 * (reported closed by qpop_msgs) and a later one may get the same address,
 * so the src_qp's own qp_num, which differs from one VQP to the next, is
 * compared too.
 */
static void note_sender(struct server *s, struct ibv_qp *src)
{
	for (int i = 0; i < s->nsenders; i++)
		if (s->senders[i].qp == src && s->senders[i].qp_num == src->qp_num)
			return;
	if (s->nsenders < MAX_SENDERS) {
		s->senders[s->nsenders].qp = src;
		s->senders[s->nsenders++].qp_num = src->qp_num;
	}
}

/* Echoes one received message back to its sender. */
static void echo(struct server *s, struct ibv_qp *src, const struct ibv_wc *rwc)
{
	int slot = (int)rwc->wr_id;
	struct ibv_sge sge = { (uintptr_t)(s->buf + (size_t)slot * MSG_MAX),
			       rwc->byte_len, s->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = (uint64_t)slot, .sg_list = &sge,
				  .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	int rc;

	/* The sender destroyed its VQP: its src_qp is reported once more,
	 * with no buffer used, and freed at our next qpop_msgs. */
	if (rwc->status == IBV_WC_WR_FLUSH_ERR && rwc->byte_len == 0) {
		s->closed++;
		return;
	}
	if (rwc->status != IBV_WC_SUCCESS) {
		fprintf(stderr, "vqp_echo_server: a receive failed: %s\n",
			ibv_wc_status_str(rwc->status));
		s->failed++;
		post_recv(s, slot);
		return;
	}
	note_sender(s, src);
	if (rwc->byte_len == 0)	/* a zero-length SEND has no SGE */
		wr.num_sge = 0;
	/* ENOMEM: src_qp's send queue is full; completions free it. */
	while ((rc = ibv_post_send(src, &wr, &bad)) == ENOMEM && !stop)
		reap_sends(s);
	if (rc) {
		fprintf(stderr, "vqp_echo_server: echo ibv_post_send: %s\n",
			strerror(rc));
		s->failed++;
		post_recv(s, slot);
		return;
	}
	s->in_flight++;
	s->echoed++;
	s->bytes += rwc->byte_len;
}

static void usage(void)
{
	fprintf(stderr, "usage: vqp_echo_server -a ADDR [-P PORT] [-d DEV] [-n COUNT]\n"
			"  (KRCORE_META=ip:port of krcore-meta must be set)\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *devname = NULL, *addr = NULL;
	int port = 5000, opt, rc;
	long count = 0;
	union ibv_gid gid;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_qp_init_attr qa;
	struct sigaction sa;
	struct server s;
	double t;

	while ((opt = getopt(argc, argv, "a:P:d:n:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'P': port = atoi(optarg); break;
		case 'd': devname = optarg; break;
		case 'n': count = atol(optarg); break;
		default: usage();
		}
	}
	if (!addr || optind != argc || port <= 0 || count < 0)
		usage();
	if (parse_gid(addr, &gid)) {
		fprintf(stderr, "vqp_echo_server: -a %s: not an IPv4 address or GID\n", addr);
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);

	/* SIGTERM / SIGINT end the loop below; no SA_RESTART needed, the
	 * loop never blocks in a system call. */
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);

	memset(&s, 0, sizeof(s));
	ctx = open_device(devname);
	pd = ibv_alloc_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd", errno);
	/* The send CQ sees one completion per echo in flight, at most NBUF. */
	s.cq = ibv_create_cq(ctx, NBUF, NULL, NULL, 0);
	if (!s.cq)
		die("ibv_create_cq", errno);
	s.buf = aligned_alloc(4096, (size_t)NBUF * MSG_MAX);
	if (!s.buf)
		die("aligned_alloc", ENOMEM);
	s.mr = ibv_reg_mr(pd, s.buf, (size_t)NBUF * MSG_MAX, IBV_ACCESS_LOCAL_WRITE);
	if (!s.mr)
		die("ibv_reg_mr", errno);

	/* A VQP is created like any QP, with qp_type KRCORE_VQP. Its receive
	 * CQ is required, but a bound VQP's receives come out of qpop_msgs
	 * only, never through ibv_poll_cq. */
	memset(&qa, 0, sizeof(qa));
	qa.send_cq = s.cq;
	qa.recv_cq = s.cq;
	qa.qp_type = (enum ibv_qp_type)KRCORE_VQP;
	qa.cap.max_send_wr = NBUF;
	qa.cap.max_recv_wr = NBUF;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	s.qp = ibv_create_qp(pd, &qa);
	if (!s.qp)
		die("ibv_create_qp(KRCORE_VQP)", errno);

	/* Receives first, then qbind: a client may send the moment the
	 * binding is visible. (A message arriving with no receive posted is
	 * held by the library, not dropped, but there is no reason to.) */
	for (int i = 0; i < NBUF; i++)
		post_recv(&s, i);
	rc = qbind(s.qp, gid, port);
	if (rc)
		die_bind(rc, addr, port);
	printf("vqp_echo_server: ready: bound to %s port %d on %s\n", addr, port,
	       ibv_get_device_name(ctx->device));

	while (!stop && (!count || (long)s.echoed < count)) {
		struct ibv_qp *src[POP_BATCH];
		struct ibv_wc wc[POP_BATCH];
		/* qpop_msgs never blocks; it also drives the library's
		 * progress, so the server must keep calling it. */
		int k = qpop_msgs(s.qp, POP_BATCH, src, wc);

		if (k < 0)
			die("qpop_msgs", -k);
		for (int i = 0; i < k; i++)
			echo(&s, src[i], &wc[i]);
		/* Nothing to do: let the other processes on this CPU run. */
		if (!reap_sends(&s) && !k)
			sched_yield();
	}

	/* Let the echoes in flight complete (bounded) before tearing down. */
	t = now_s();
	while (s.in_flight > 0 && now_s() - t < 5)
		if (!reap_sends(&s))
			sched_yield();
	printf("vqp_echo_server: echoed %lu messages (%lu bytes) from %d senders, "
	       "%lu failed, %lu senders left%s\n", s.echoed, s.bytes, s.nsenders, s.failed,
	       s.closed, s.in_flight ? ", some echoes never completed" : "");

	/* Destroying the VQP removes the binding from krcore-meta (the lease
	 * would expire anyway if the process died) and frees the src_qps the
	 * library made for it. */
	if ((rc = ibv_destroy_qp(s.qp)))
		die("ibv_destroy_qp", rc);
	if ((rc = ibv_dereg_mr(s.mr)))
		die("ibv_dereg_mr", rc);
	if ((rc = ibv_destroy_cq(s.cq)))
		die("ibv_destroy_cq", rc);
	if ((rc = ibv_dealloc_pd(pd)))
		die("ibv_dealloc_pd", rc);
	if ((rc = ibv_close_device(ctx)))
		die("ibv_close_device", rc);
	free(s.buf);
	return s.failed || s.in_flight ? 1 : 0;
}
