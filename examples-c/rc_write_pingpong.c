/*
 * rc_write_pingpong: RDMA WRITE ping-pong between two RC QPs of one process.
 *
 * QP A uses local GID index -g, QP B uses -G (on Soft-RoCE each IP address of
 * the netdev is one GID, so the two QPs talk like two nodes). A writes
 * `size` bytes into B's buffer; B sees the last byte change, writes the same
 * amount back; A sees it: one round trip. Latency is reported as half the
 * round trip (like ib_write_lat). The payload is checked at the end.
 * Like ib_write_lat, it relies on the last byte of a WRITE landing last
 * (true of rxe and of common NICs, not promised by the verbs spec).
 *
 * Works with plain libibverbs, linked with -lkrcore, or with libkrcore.so in
 * LD_PRELOAD; when krcore is present (found at run time with dlsym) its
 * version and counters are printed.
 *
 *   rc_write_pingpong [-d rxe0] [-p 1] [-g 1] [-G 2] [-s 64] [-n 1000]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_NS (10ull * 1000000000ull)

struct side {
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	uint8_t *buf;
	int gid_idx;
	union ibv_gid gid;
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what, int err)
{
	fprintf(stderr, "rc_write_pingpong: %s: %s\n", what, strerror(err));
	exit(1);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* RESET -> INIT -> RTR -> RTS towards the other side. */
static void connect_qp(struct ibv_port_attr *pa, uint8_t port,
		       struct side *me, const struct side *peer)
{
	struct ibv_qp_attr a;
	int rc;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = port;
	a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
	rc = ibv_modify_qp(me->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
					       IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
	if (rc)
		die("modify_qp INIT", rc);

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = pa->active_mtu;
	a.dest_qp_num = peer->qp->qp_num;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = peer->gid;
	a.ah_attr.grh.sgid_index = (uint8_t)me->gid_idx;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = port;
	rc = ibv_modify_qp(me->qp, &a, IBV_QP_STATE | IBV_QP_AV |
					       IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					       IBV_QP_RQ_PSN |
					       IBV_QP_MAX_DEST_RD_ATOMIC |
					       IBV_QP_MIN_RNR_TIMER);
	if (rc)
		die("modify_qp RTR", rc);

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 0;
	a.max_rd_atomic = 1;
	rc = ibv_modify_qp(me->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT |
					       IBV_QP_RETRY_CNT |
					       IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					       IBV_QP_MAX_QP_RD_ATOMIC);
	if (rc)
		die("modify_qp RTS", rc);
}

/* Write size bytes at `src` (inside from's MR) into the peer's rx area. */
static void post_write(struct side *from, const uint8_t *src,
		       const struct side *to, size_t size, uint64_t id)
{
	struct ibv_sge sge = { (uintptr_t)src, (uint32_t)size,
			       from->mr->lkey };
	struct ibv_send_wr wr, *bad;
	int rc;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = (uintptr_t)to->buf;
	wr.wr.rdma.rkey = to->mr->rkey;
	rc = ibv_post_send(from->qp, &wr, &bad);
	if (rc)
		die("ibv_post_send", rc);
}

static void reap(struct side *s, uint64_t id)
{
	uint64_t t0 = now_ns();
	struct ibv_wc wc;
	int n;

	while ((n = ibv_poll_cq(s->cq, 1, &wc)) == 0)
		if (now_ns() - t0 > TIMEOUT_NS) {
			fprintf(stderr, "rc_write_pingpong: no completion\n");
			exit(1);
		}
	if (n < 0)
		die("ibv_poll_cq", EIO);
	if (wc.status != IBV_WC_SUCCESS || wc.wr_id != id) {
		fprintf(stderr, "rc_write_pingpong: completion %llu: %s\n",
			(unsigned long long)wc.wr_id,
			ibv_wc_status_str(wc.status));
		exit(1);
	}
}

/* Spin until the last byte of the rx area becomes `val`. */
static void wait_byte(const struct side *s, size_t size, uint8_t val)
{
	volatile uint8_t *last = s->buf + size - 1;
	uint64_t t0 = now_ns();

	while (*last != val)
		if (now_ns() - t0 > TIMEOUT_NS) {
			fprintf(stderr, "rc_write_pingpong: write never landed\n");
			exit(1);
		}
}

/* krcore's counters, if the library is in the process. */
static void print_krcore(void)
{
	const char *(*version)(void) =
		(const char *(*)(void))dlsym(RTLD_DEFAULT, "krcore_version");
	size_t (*json)(char *, size_t) =
		(size_t(*)(char *, size_t))dlsym(RTLD_DEFAULT,
						 "krcore_stats_json");
	char buf[2048];

	if (!version || !json) {
		printf("krcore: not loaded (plain libibverbs)\n");
		return;
	}
	json(buf, sizeof(buf));
	printf("krcore %s: %s\n", version(), buf);
}

int main(int argc, char **argv)
{
	const char *devname = "rxe0";
	uint8_t port = 1;
	size_t size = 64;
	int iters = 1000, opt, n;
	struct side A = { .gid_idx = 1 }, B = { .gid_idx = 2 };
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_pd *pd;
	struct ibv_port_attr pa;
	uint64_t *rtt, t_start, t_total;

	while ((opt = getopt(argc, argv, "d:p:g:G:s:n:h")) != -1) {
		switch (opt) {
		case 'd': devname = optarg; break;
		case 'p': port = (uint8_t)atoi(optarg); break;
		case 'g': A.gid_idx = atoi(optarg); break;
		case 'G': B.gid_idx = atoi(optarg); break;
		case 's': size = strtoul(optarg, NULL, 0); break;
		case 'n': iters = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s [-d dev] [-p port] [-g gidA] "
				"[-G gidB] [-s size] [-n iters]\n", argv[0]);
			return 2;
		}
	}
	if (size < 1 || iters < 1) {
		fprintf(stderr, "size and iters must be >= 1\n");
		return 2;
	}

	list = ibv_get_device_list(&n);
	if (!list)
		die("ibv_get_device_list", errno);
	for (int i = 0; i < n && !ctx; i++)
		if (!strcmp(ibv_get_device_name(list[i]), devname))
			ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!ctx) {
		fprintf(stderr, "rc_write_pingpong: cannot open %s\n", devname);
		return 1;
	}
	if (ibv_query_port(ctx, port, &pa))
		die("ibv_query_port", errno);
	pd = ibv_alloc_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd", errno);

	struct side *sides[2] = { &A, &B };
	for (int i = 0; i < 2; i++) {
		struct side *s = sides[i];
		struct ibv_qp_init_attr ia;

		if (ibv_query_gid(ctx, port, s->gid_idx, &s->gid))
			die("ibv_query_gid", errno);
		/* [0, size): rx area the peer writes; [size, 2 size): tx. */
		s->buf = calloc(2, size);
		if (!s->buf)
			die("calloc", ENOMEM);
		s->mr = ibv_reg_mr(pd, s->buf, 2 * size, IBV_ACCESS_LOCAL_WRITE |
						     IBV_ACCESS_REMOTE_WRITE);
		if (!s->mr)
			die("ibv_reg_mr", errno);
		s->cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
		if (!s->cq)
			die("ibv_create_cq", errno);
		memset(&ia, 0, sizeof(ia));
		ia.send_cq = ia.recv_cq = s->cq;
		ia.qp_type = IBV_QPT_RC;
		ia.cap.max_send_wr = 4;
		ia.cap.max_recv_wr = 1;
		ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
		s->qp = ibv_create_qp(pd, &ia);
		if (!s->qp)
			die("ibv_create_qp", errno);
	}
	connect_qp(&pa, port, &A, &B);
	connect_qp(&pa, port, &B, &A);

	rtt = calloc((size_t)iters, sizeof(*rtt));
	if (!rtt)
		die("calloc", ENOMEM);
	t_start = now_ns();
	for (int i = 0; i < iters; i++) {
		uint8_t tag = (uint8_t)(i % 255 + 1);
		uint64_t t0 = now_ns();

		/* A's tx: byte j = (i + j), the last byte is the tag. */
		for (size_t j = 0; j + 1 < size; j++)
			A.buf[size + j] = (uint8_t)(i + j);
		A.buf[2 * size - 1] = tag;
		post_write(&A, A.buf + size, &B, size, 2 * (uint64_t)i);
		wait_byte(&B, size, tag);
		/* B echoes what landed in its rx area. */
		post_write(&B, B.buf, &A, size, 2 * (uint64_t)i + 1);
		wait_byte(&A, size, tag);
		rtt[i] = now_ns() - t0;
		reap(&A, 2 * (uint64_t)i);
		reap(&B, 2 * (uint64_t)i + 1);
	}
	t_total = now_ns() - t_start;

	/* The last message went A -> B -> A unchanged. */
	for (size_t j = 0; j < size; j++)
		if (A.buf[j] != A.buf[size + j] || B.buf[j] != A.buf[j]) {
			fprintf(stderr, "rc_write_pingpong: payload mismatch at "
				"byte %zu\n", j);
			return 1;
		}

	qsort(rtt, (size_t)iters, sizeof(*rtt), cmp_u64);
	printf("%s GID %d <-> GID %d, %zu bytes, %d iterations\n", devname,
	       A.gid_idx, B.gid_idx, size, iters);
	printf("one-way latency (half round trip): median %.2f us, "
	       "p99 %.2f us, min %.2f us\n", rtt[iters / 2] / 2000.0,
	       rtt[(size_t)iters * 99 / 100] / 2000.0, rtt[0] / 2000.0);
	printf("total %.3f s, %.0f round trips/s\n", t_total / 1e9,
	       iters / (t_total / 1e9));
	print_krcore();

	free(rtt);
	for (int i = 0; i < 2; i++) {
		struct side *s = sides[i];

		if (ibv_destroy_qp(s->qp) || ibv_destroy_cq(s->cq) ||
		    ibv_dereg_mr(s->mr))
			die("teardown", errno);
		free(s->buf);
	}
	if (ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		die("teardown", errno);
	return 0;
}
