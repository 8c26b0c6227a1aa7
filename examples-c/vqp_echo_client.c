/*
 * vqp_echo_client: a client of vqp_echo_server on a krcore virtual QP (VQP).
 *
 * Connecting is one call: qconnect(qp, server GID, port). The library looks
 * the address up in krcore-meta (KRCORE_META) and attaches the VQP to its
 * link to the server's process, making that link if there is none yet; no
 * ibv_modify_qp, no exchange of QP numbers. Then the VQP is used with the
 * ordinary verbs: the client sends COUNT messages of SIZE bytes, waits for
 * each echo, checks it byte for byte and prints the round-trip median.
 *
 *   KRCORE_META=10.77.0.1:18700 KRCORE_GID_INDEX=2 \
 *       vqp_echo_client -a 10.77.0.1 [-P 5000] [-d rxe0] [-s 4096] [-n 100]
 *
 *   -a ADDR   the server's address: an IPv4 address (its RoCE v2 GID,
 *             ::ffff:ADDR) or a GID in IPv6 notation
 *   -P PORT   the server's VQP port (5000)
 *   -d DEV    the RDMA device (default: the first one)
 *   -s SIZE   bytes per message, 0 to 4096 (64)
 *   -n COUNT  messages (100)
 *
 * KRCORE_GID_INDEX chooses the local GID this process's links use (on
 * Soft-RoCE every IP address of the netdev is a GID, so clients with
 * different indexes behave like different nodes); by default the device's
 * first RoCE v2 GID.
 *
 * Output, one line on success:
 *
 *   vqp_echo_client: 100 echoes of 4096 B from 10.77.0.1 port 5000 verified
 *     (local GID index 2): qconnect 850 us, round trip median 310.4 us
 *     (min 250.1, max 1200.7)
 *
 * Exit status 0 when every echo came back intact, 1 otherwise (the reason
 * on stderr), 2 for a usage error.
 *
 * Build: cc -O2 -I include vqp_echo_client.c -L target/release -lkrcore
 * (see examples-c/Makefile).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <krcore.h> /* includes <infiniband/verbs.h> */
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The largest message this client sends (the server's buffers hold it). */
#define MSG_MAX (1 << 20)
/* How long to wait for one echo before giving up. */
#define ECHO_TIMEOUT_S 10.0

static void die(const char *what, int err)
{
	fprintf(stderr, "vqp_echo_client: %s: %s\n", what, strerror(err));
	exit(1);
}

static double now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
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
	struct ibv_context *ctx;
	int n, i;

	list = ibv_get_device_list(&n);
	if (!list)
		die("ibv_get_device_list", errno);
	for (i = 0; i < n; i++)
		if (!name || !strcmp(ibv_get_device_name(list[i]), name))
			break;
	if (i == n) {
		fprintf(stderr, "vqp_echo_client: no RDMA device%s%s (%d found)\n",
			name ? " named " : "", name ? name : "", n);
		exit(1);
	}
	ctx = ibv_open_device(list[i]);
	if (!ctx)
		die("ibv_open_device", errno);
	ibv_free_device_list(list);
	return ctx;
}

/* qconnect's errors, with what to do about them. */
static void die_connect(int rc, const char *addr, int port)
{
	const char *hint = "";

	switch (rc) {
	case ECONNREFUSED: hint = " (nothing is bound there: is vqp_echo_server "
				  "running, with the same KRCORE_META?)"; break;
	case ETIMEDOUT: hint = " (the server's process or krcore-meta did not "
			       "answer within KRCORE_CONNECT_TIMEOUT_MS)"; break;
	case ENOTCONN: hint = " (set KRCORE_META=ip:port of a running krcore-meta)"; break;
	}
	fprintf(stderr, "vqp_echo_client: qconnect(%s, port %d): %s%s\n", addr,
		port, strerror(rc), hint);
	exit(1);
}

/* A pattern that differs per process and per message, so an echo of the
 * wrong message (or of another client's) cannot pass the check. */
static uint8_t pattern(uint32_t seed, int msg, size_t j)
{
	return (uint8_t)((seed >> (j % 4 * 8)) + (uint32_t)msg * 31u + j * 7u);
}

/* Busy-polls the CQ until this message's send and its echo's receive have
 * both completed (they can come in either order). Returns the receive's
 * byte count. */
static uint32_t wait_echo(struct ibv_cq *cq, int msg)
{
	double deadline = now_us() + ECHO_TIMEOUT_S * 1e6;
	int sent = 0, received = 0;
	uint32_t len = 0;

	while (!sent || !received) {
		struct ibv_wc wc;
		int k = ibv_poll_cq(cq, 1, &wc);

		if (k < 0)
			die("ibv_poll_cq", EIO);
		if (k == 0) {
			if (now_us() > deadline) {
				fprintf(stderr, "vqp_echo_client: message %d: no %s within "
					"%.0f s\n", msg, sent ? "echo" : "send completion",
					ECHO_TIMEOUT_S);
				exit(1);
			}
			/* Spinning, but let other processes on this CPU run. */
			sched_yield();
			continue;
		}
		if (wc.status != IBV_WC_SUCCESS) {
			fprintf(stderr, "vqp_echo_client: message %d: %s failed: %s\n",
				msg, wc.opcode == IBV_WC_RECV ? "receive" : "send",
				ibv_wc_status_str(wc.status));
			exit(1);
		}
		if (wc.opcode == IBV_WC_RECV) {
			received = 1;
			len = wc.byte_len;
		} else {
			sent = 1;
		}
	}
	return len;
}

static void usage(void)
{
	fprintf(stderr, "usage: vqp_echo_client -a ADDR [-P PORT] [-d DEV] [-s SIZE] [-n COUNT]\n"
			"  (KRCORE_META=ip:port of krcore-meta must be set; "
			"KRCORE_GID_INDEX picks the local GID)\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *devname = NULL, *addr = NULL, *gidx = getenv("KRCORE_GID_INDEX");
	int port = 5000, count = 100, opt, rc;
	long size = 64;
	union ibv_gid gid;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	struct ibv_qp *qp;
	struct ibv_qp_init_attr qa;
	uint8_t *tx, *rx;
	double t0, connect_us, *rtt;
	uint32_t seed;

	while ((opt = getopt(argc, argv, "a:P:d:s:n:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'P': port = atoi(optarg); break;
		case 'd': devname = optarg; break;
		case 's': size = atol(optarg); break;
		case 'n': count = atoi(optarg); break;
		default: usage();
		}
	}
	if (!addr || optind != argc || port <= 0 || count <= 0 || size < 0)
		usage();
	if (size > MSG_MAX) {
		fprintf(stderr, "vqp_echo_client: -s %ld: the server echoes messages "
			"of at most %d B\n", size, MSG_MAX);
		return 2;
	}
	if (parse_gid(addr, &gid)) {
		fprintf(stderr, "vqp_echo_client: -a %s: not an IPv4 address or GID\n", addr);
		return 2;
	}
	rtt = calloc((size_t)count, sizeof(*rtt));
	if (!rtt)
		die("calloc", ENOMEM);
	seed = (uint32_t)getpid() * 2654435761u;

	ctx = open_device(devname);
	pd = ibv_alloc_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd", errno);
	/* One CQ for both directions: a message's send and its echo. */
	cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	if (!cq)
		die("ibv_create_cq", errno);
	/* One registration for the send buffer and the receive buffer. */
	tx = aligned_alloc(4096, 2 * MSG_MAX);
	if (!tx)
		die("aligned_alloc", ENOMEM);
	rx = tx + MSG_MAX;
	mr = ibv_reg_mr(pd, tx, 2 * MSG_MAX, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("ibv_reg_mr", errno);

	memset(&qa, 0, sizeof(qa));
	qa.send_cq = cq;
	qa.recv_cq = cq;
	qa.qp_type = (enum ibv_qp_type)KRCORE_VQP;
	qa.cap.max_send_wr = 4;
	qa.cap.max_recv_wr = 4;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	qp = ibv_create_qp(pd, &qa);
	if (!qp)
		die("ibv_create_qp(KRCORE_VQP)", errno);

	/* The whole connection setup: the first one from this process pays
	 * the meta-server lookup and a link handshake with the server's
	 * process; later ones (any VQP of this PD) reuse the link. */
	t0 = now_us();
	rc = qconnect(qp, gid, port);
	if (rc)
		die_connect(rc, addr, port);
	connect_us = now_us() - t0;

	for (int i = 0; i < count; i++) {
		struct ibv_sge rsge = { (uintptr_t)rx, MSG_MAX, mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &rsge, .num_sge = 1 }, *rbad;
		struct ibv_sge ssge = { (uintptr_t)tx, (uint32_t)size, mr->lkey };
		struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &ssge,
					   .num_sge = size ? 1 : 0, .opcode = IBV_WR_SEND,
					   .send_flags = IBV_SEND_SIGNALED }, *sbad;
		uint32_t len;

		for (long j = 0; j < size; j++)
			tx[j] = pattern(seed, i, (size_t)j);
		/* The receive is posted before the send, so the echo always
		 * finds a buffer; clear it so a stale echo cannot pass. */
		memset(rx, 0, MSG_MAX);
		if ((rc = ibv_post_recv(qp, &rwr, &rbad)))
			die("ibv_post_recv", rc);
		t0 = now_us();
		if ((rc = ibv_post_send(qp, &swr, &sbad)))
			die("ibv_post_send", rc);
		len = wait_echo(cq, i);
		rtt[i] = now_us() - t0;

		if (len != (uint32_t)size) {
			fprintf(stderr, "vqp_echo_client: message %d: echo of %u B, sent %ld B\n",
				i, len, size);
			return 1;
		}
		for (long j = 0; j < size; j++)
			if (rx[j] != tx[j]) {
				fprintf(stderr, "vqp_echo_client: message %d: echo differs at "
					"byte %ld: %#x, sent %#x\n", i, j, rx[j], tx[j]);
				return 1;
			}
	}

	qsort(rtt, (size_t)count, sizeof(*rtt), cmp_double);
	printf("vqp_echo_client: %d echoes of %ld B from %s port %d verified "
	       "(local GID index %s): qconnect %.0f us, round trip median %.1f us "
	       "(min %.1f, max %.1f)\n", count, size, addr, port,
	       gidx ? gidx : "default", connect_us,
	       count % 2 ? rtt[count / 2] : (rtt[count / 2 - 1] + rtt[count / 2]) / 2, rtt[0],
	       rtt[count - 1]);

	/* Destroying a connected VQP is all it takes; the link to the server
	 * stays with the library for other VQPs (until the process exits). */
	if ((rc = ibv_destroy_qp(qp)))
		die("ibv_destroy_qp", rc);
	if ((rc = ibv_dereg_mr(mr)))
		die("ibv_dereg_mr", rc);
	if ((rc = ibv_destroy_cq(cq)))
		die("ibv_destroy_cq", rc);
	if ((rc = ibv_dealloc_pd(pd)))
		die("ibv_dealloc_pd", rc);
	if ((rc = ibv_close_device(ctx)))
		die("ibv_close_device", rc);
	free(tx);
	free(rtt);
	return 0;
}
