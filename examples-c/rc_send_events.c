/*
 * rc_send_events: event-driven SEND/RECV between two RC QPs of one process.
 *
 * QP A (GID index -g) sends `count` messages of `size` bytes to QP B (GID
 * index -G). B's receive CQ is attached to a completion channel: instead of
 * spinning, B sleeps in poll() on the channel's fd, then takes the event with
 * ibv_get_cq_event, re-arms the CQ, drains it with ibv_poll_cq and
 * acknowledges events in batches, the usual pattern for event-driven
 * servers. Every message is checked byte for byte.
 *
 * Works with plain libibverbs, linked with -lkrcore, or with libkrcore.so in
 * LD_PRELOAD.
 *
 *   rc_send_events [-d rxe0] [-p 1] [-g 1] [-G 2] [-s 4096] [-n 1000]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RX_DEPTH 32

static void die(const char *what, int err)
{
	fprintf(stderr, "rc_send_events: %s: %s\n", what, strerror(err));
	exit(1);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void connect_qp(struct ibv_qp *qp, struct ibv_port_attr *pa,
		       uint8_t port, int sgid, struct ibv_qp *peer,
		       const union ibv_gid *dgid)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = port;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
					  IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("modify_qp INIT", errno);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = pa->active_mtu;
	a.dest_qp_num = peer->qp_num;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *dgid;
	a.ah_attr.grh.sgid_index = (uint8_t)sgid;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = port;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					  IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					  IBV_QP_MAX_DEST_RD_ATOMIC |
					  IBV_QP_MIN_RNR_TIMER))
		die("modify_qp RTR", errno);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT |
					  IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		die("modify_qp RTS", errno);
}

static void post_recv(struct ibv_qp *qp, struct ibv_mr *mr, uint8_t *rx,
		      size_t size, int slot)
{
	struct ibv_sge sge = { (uintptr_t)(rx + (size_t)slot * size),
			       (uint32_t)size, mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)slot, .sg_list = &sge,
				  .num_sge = 1 }, *bad;
	int rc = ibv_post_recv(qp, &wr, &bad);

	if (rc)
		die("ibv_post_recv", rc);
}

static void reap_send(struct ibv_cq *scq, int *done, int sent)
{
	double t0 = now_s();

	while (*done < sent) {
		struct ibv_wc wc;
		int k = ibv_poll_cq(scq, 1, &wc);

		if (k < 0 || (k == 1 && wc.status != IBV_WC_SUCCESS))
			die("send completion", EIO);
		*done += k;
		if (!k && now_s() - t0 > 10) {
			fprintf(stderr, "rc_send_events: send never completed\n");
			exit(1);
		}
	}
}

static uint8_t pattern(int msg, size_t j)
{
	return (uint8_t)(msg * 7 + j * 13);
}

int main(int argc, char **argv)
{
	const char *devname = "rxe0";
	uint8_t port = 1;
	int gid_a = 1, gid_b = 2, count = 1000, opt, n, received = 0;
	int sent = 0, send_done = 0;
	unsigned events = 0, unacked = 0;
	size_t size = 4096;
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_port_attr pa;
	union ibv_gid ga, gb;
	double t0, t;

	while ((opt = getopt(argc, argv, "d:p:g:G:s:n:")) != -1) {
		switch (opt) {
		case 'd': devname = optarg; break;
		case 'p': port = (uint8_t)atoi(optarg); break;
		case 'g': gid_a = atoi(optarg); break;
		case 'G': gid_b = atoi(optarg); break;
		case 's': size = strtoul(optarg, NULL, 0); break;
		case 'n': count = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s [-d dev] [-p port] [-g gidA] "
				"[-G gidB] [-s size] [-n count]\n", argv[0]);
			return 2;
		}
	}
	if (size < 1 || count < 1)
		return 2;

	list = ibv_get_device_list(&n);
	if (!list)
		die("ibv_get_device_list", errno);
	for (int i = 0; i < n && !ctx; i++)
		if (!strcmp(ibv_get_device_name(list[i]), devname))
			ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!ctx) {
		fprintf(stderr, "rc_send_events: cannot open %s\n", devname);
		return 1;
	}
	if (ibv_query_port(ctx, port, &pa) ||
	    ibv_query_gid(ctx, port, gid_a, &ga) ||
	    ibv_query_gid(ctx, port, gid_b, &gb))
		die("query port/gid", errno);

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	uint8_t *tx = malloc(size), *rx = malloc(size * RX_DEPTH);
	if (!pd || !ch || !tx || !rx)
		die("setup", errno);
	struct ibv_mr *txmr = ibv_reg_mr(pd, tx, size, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *rxmr = ibv_reg_mr(pd, rx, size * RX_DEPTH,
					 IBV_ACCESS_LOCAL_WRITE);
	struct ibv_cq *scq = ibv_create_cq(ctx, RX_DEPTH, NULL, NULL, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, RX_DEPTH, NULL, ch, 0);
	if (!txmr || !rxmr || !scq || !rcq)
		die("setup", errno);
	struct ibv_qp_init_attr ia = {
		.send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 1, .max_recv_wr = RX_DEPTH,
			 .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *a = ibv_create_qp(pd, &ia);
	struct ibv_qp *b = ibv_create_qp(pd, &ia);
	if (!a || !b)
		die("ibv_create_qp", errno);
	connect_qp(a, &pa, port, gid_a, b, &gb);
	connect_qp(b, &pa, port, gid_b, a, &ga);

	for (int i = 0; i < RX_DEPTH; i++)
		post_recv(b, rxmr, rx, size, i);
	if (ibv_req_notify_cq(rcq, 0))
		die("ibv_req_notify_cq", errno);

	t0 = now_s();
	while (received < count) {
		/* Keep one send in flight (the send queue is 1 deep). */
		if (sent < count && sent == send_done) {
			struct ibv_sge sge = { (uintptr_t)tx, (uint32_t)size,
					       txmr->lkey };
			struct ibv_send_wr wr = {
				.wr_id = (uint64_t)sent, .sg_list = &sge,
				.num_sge = 1, .opcode = IBV_WR_SEND,
				.send_flags = IBV_SEND_SIGNALED,
			}, *bad;

			for (size_t j = 0; j < size; j++)
				tx[j] = pattern(sent, j);
			if ((errno = ibv_post_send(a, &wr, &bad)))
				die("ibv_post_send", errno);
			sent++;
		}
		/* Sleep until B's receive CQ has something. */
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		if (poll(&pfd, 1, 10000) != 1) {
			fprintf(stderr, "rc_send_events: no event in 10 s\n");
			return 1;
		}
		struct ibv_cq *ev_cq;
		void *ev_ctx;
		if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) || ev_cq != rcq)
			die("ibv_get_cq_event", errno);
		events++;
		if (++unacked == 16) {	/* acknowledging takes a lock */
			ibv_ack_cq_events(rcq, unacked);
			unacked = 0;
		}
		/* Re-arm first, then drain: no completion can be missed. */
		if (ibv_req_notify_cq(rcq, 0))
			die("ibv_req_notify_cq", errno);
		struct ibv_wc wc[8];
		while ((n = ibv_poll_cq(rcq, 8, wc)) > 0) {
			for (int k = 0; k < n; k++) {
				int slot = (int)wc[k].wr_id;
				uint8_t *m = rx + (size_t)slot * size;

				if (wc[k].status != IBV_WC_SUCCESS ||
				    wc[k].byte_len != size) {
					fprintf(stderr, "recv: %s, %u bytes\n",
						ibv_wc_status_str(wc[k].status),
						wc[k].byte_len);
					return 1;
				}
				for (size_t j = 0; j < size; j++)
					if (m[j] != pattern(received, j)) {
						fprintf(stderr, "message %d: "
							"byte %zu differs\n",
							received, j);
						return 1;
					}
				received++;
				post_recv(b, rxmr, rx, size, slot);
			}
		}
		if (n < 0)
			die("ibv_poll_cq", EIO);
		/* Message delivered: A's send completion (it follows the
		 * receiver's ACK) is due now; spin for it, bounded. */
		if (received == sent)
			reap_send(scq, &send_done, sent);
	}
	t = now_s() - t0;
	if (unacked)
		ibv_ack_cq_events(rcq, unacked);

	printf("%s GID %d -> GID %d: %d messages of %zu bytes, %u events, "
	       "%.3f s, %.0f msg/s, %.1f MB/s\n", devname, gid_a, gid_b,
	       count, size, events, t, count / t, count * (double)size / t / 1e6);
	{
		size_t (*json)(char *, size_t) = (size_t(*)(char *, size_t))
			dlsym(RTLD_DEFAULT, "krcore_stats_json");
		char buf[2048];

		if (json) {
			json(buf, sizeof(buf));
			printf("krcore: %s\n", buf);
		} else {
			printf("krcore: not loaded (plain libibverbs)\n");
		}
	}

	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(scq) ||
	    ibv_destroy_cq(rcq) || ibv_destroy_comp_channel(ch) ||
	    ibv_dereg_mr(txmr) || ibv_dereg_mr(rxmr) || ibv_dealloc_pd(pd) ||
	    ibv_close_device(ctx))
		die("teardown", errno);
	free(tx);
	free(rx);
	return 0;
}
