/*
 * vqp_prestart: the runtime started in the background at a process's first
 * ibv_alloc_pd (KRCORE_PRESTART, on by default with KRCORE_META set).
 *
 * Each case runs in a fresh child of a parent that never used a PD (the
 * library's configuration and the "first PD" are per process):
 * - the first PD's runtime starts by itself (runtimes_prestarted becomes 1
 *   without any extended verb), and the first qconnect uses it: a SEND
 *   echoed by a bound VQP and a READ of the server's buffer, checked byte
 *   for byte; no second runtime is started;
 * - a PD freed right after its allocation, its runtime still starting, is
 *   freed cleanly (ibv_dealloc_pd and ibv_close_device return 0), in 5
 *   processes;
 * - a meta server that comes up after the early start's connection to it
 *   failed: the first qbind connects anew and succeeds (the early failure
 *   is not its answer);
 * - a start that fails in the background (KRCORE_GID_INDEX names an empty
 *   slot of the GID table) is not counted, and the first qconnect reports
 *   EADDRNOTAVAIL, as in a process with KRCORE_PRESTART=0; the PD still
 *   goes.
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 7401
#define MSG CT_ECHO_MSG
#define SERVER_NODE 3
#define CLIENT_NODE 4

static uint64_t prestarted(void)
{
	return krcore_stat_get(KRCORE_STAT_RUNTIMES_PRESTARTED);
}

/* Waits (bounded) until the background start is counted. */
static void wait_prestarted(void)
{
	for (int i = 0; i < 2000 && prestarted() == 0; i++)
		usleep(5000);
	CT_CHECK(prestarted() == 1, "runtimes_prestarted %llu after 10 s",
		 (unsigned long long)prestarted());
}

/* The bound VQP: echoes every message back; the bytes at TARGET of its
 * buffer hold a pattern the client READs (address and rkey through a pipe).
 * Runs until killed. */
#define TARGET CT_ECHO_TARGET
#define SEED 77
static int info_pipe[2];

static int server(int ready_fd)
{
	return ct_echo_target_server("vqp_prestart: server", SERVER_NODE, PORT, SEED, info_pipe[1], ready_fd);
}

static uint64_t target[2];

static int first_pd_starts_its_runtime(void)
{
	struct ct_node n;
	struct ibv_qp *q;
	struct ibv_wc wc;

	ct_begin("vqp_prestart: the first PD's runtime starts by itself");
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	wait_prestarted();
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	ct_fill_msg(n.b.p, MSG, 1, 1);
	ct_post_recv1(q, 1, &n.b, 1024, MSG);
	CT_OK(ct_post_send1(q, 2, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, 0, MSG, 0, 0, 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 2, IBV_WC_SEND, "the SEND");
	wc = ct_poll1(n.rcq);
	ct_expect_wc(&wc, 1, IBV_WC_RECV, "the echo");
	ct_expect_msg(n.b.p + 1024, MSG, 1, 1);
	CT_OK(ct_post_send1(q, 3, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 3, IBV_WC_RDMA_READ, "the READ");
	ct_expect_pattern(n.b.p + 2048, 64, SEED, "the READ's bytes");
	CT_CHECK(prestarted() == 1, "a second runtime was started");
	CT_OK(ibv_destroy_qp(q));
	ct_pass();
	return 0;
}

static int freed_while_starting(void)
{
	struct ct_dev d;

	ct_begin("vqp_prestart: a PD freed while its runtime starts");
	setenv("CT_GID_A", "4", 1);
	setenv("KRCORE_GID_INDEX", "4", 1);
	ct_open(&d);
	ct_close(&d);	/* asserts ibv_dealloc_pd and ibv_close_device */
	ct_pass();
	return 0;
}

/* The child of "late meta": its meta server is not up at its first
 * ibv_alloc_pd; it says so once the early attempt failed, and binds once
 * the parent started that server. */
static char late_addr[64];
static int late_pipe[2], go_pipe[2];

static int late_meta(void)
{
	struct ct_node n;
	struct ibv_qp *q;
	char c = 0;

	ct_begin("vqp_prestart: a meta server that comes up after the early start");
	setenv("KRCORE_META", late_addr, 1);
	ct_node_open(&n, CLIENT_NODE, 4096, 16);
	for (int i = 0; i < 2000 && krcore_stat_get(KRCORE_STAT_META_CONNECT_FAILURES) == 0; i++)
		usleep(5000);
	CT_CHECK(krcore_stat_get(KRCORE_STAT_META_CONNECT_FAILURES) == 1,
		 "the early connection to a meta server not running did not fail within 10 s");
	ct_oob_write(late_pipe[1], "f", 1);
	ct_oob_read(go_pipe[0], &c, 1);
	q = ct_node_vqp(&n, 4, 4);
	CT_OK(qbind(q, ct_node_gid(CLIENT_NODE), PORT + 1));
	CT_CHECK(krcore_stat_get(KRCORE_STAT_META_CONNECT_FAILURES) == 1, "the retry failed too");
	CT_OK(ibv_destroy_qp(q));
	ct_pass();
	return 0;
}

/* qconnect's result in a process whose KRCORE_GID_INDEX names no GID of
 * the port (its runtime cannot start), with the early start on or off;
 * written to rc_pipe. */
static int rc_pipe[2];
static const char *early;

static int bad_gid(void)
{
	struct ct_dev d;
	struct ibv_cq *cq;
	struct ibv_qp *q;
	int rc;

	ct_begin(strcmp(early, "1") ? "vqp_prestart: no GID, started at qconnect"
				    : "vqp_prestart: no GID, a start that fails in the background");
	setenv("KRCORE_PRESTART", early, 1);
	setenv("CT_GID_A", "4", 1);
	setenv("KRCORE_GID_INDEX", "250", 1);
	ct_open(&d);
	cq = CT_PTR(ibv_create_cq(d.ctx, 16, NULL, NULL, 0));
	q = ct_create_vqp(&d, cq, cq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);
	rc = qconnect(q, ct_node_gid(SERVER_NODE), PORT);
	CT_CHECK(rc == EADDRNOTAVAIL, "qconnect from an empty GID index: %d (%s)", rc, strerror(rc));
	CT_CHECK(prestarted() == 0, "a failed start was counted");
	CT_OK(ibv_destroy_qp(q));
	CT_OK(ibv_destroy_cq(cq));
	ct_close(&d);
	ct_oob_write(rc_pipe[1], &rc, sizeof(rc));
	ct_pass();
	return 0;
}

int main(void)
{
	pid_t meta, srv;
	int fails = 0;

	ct_watchdog(240);
	meta = ct_start_meta();
	setenv("KRCORE_PRESTART", "1", 1);
	CT_CHECK(pipe(info_pipe) == 0, "pipe");
	srv = ct_fork_ready(server, "server");
	ct_oob_read(info_pipe[0], target, sizeof(target));
	fails += ct_run_child(first_pd_starts_its_runtime, "first PD");
	for (int i = 0; i < 5; i++)
		fails += ct_run_child(freed_while_starting, "freed while starting");
	{
		int rc_late, rc_early;

		CT_CHECK(pipe(rc_pipe) == 0, "pipe");
		early = "0";
		fails += ct_run_child(bad_gid, "no GID, late start");
		ct_oob_read(rc_pipe[0], &rc_late, sizeof(rc_late));
		early = "1";
		fails += ct_run_child(bad_gid, "no GID, early start");
		ct_oob_read(rc_pipe[0], &rc_early, sizeof(rc_early));
		CT_CHECK(rc_early == rc_late, "qconnect: %d (%s) after a failed early start, %d (%s) without one",
			 rc_early, strerror(rc_early), rc_late, strerror(rc_late));
	}
	{
		pid_t child, meta2;
		char c;

		snprintf(late_addr, sizeof(late_addr), "10.77.0.1:%d", 20000 + (getpid() + 7) % 20000);
		CT_CHECK(pipe(late_pipe) == 0 && pipe(go_pipe) == 0, "pipe");
		child = fork();
		CT_CHECK(child >= 0, "fork");
		if (child == 0)
			_exit(late_meta());
		ct_oob_read(late_pipe[0], &c, 1);
		meta2 = ct_start_meta_at(late_addr, 1024);
		ct_oob_write(go_pipe[1], "g", 1);
		fails += ct_wait_child(child, "late meta");
		kill(meta2, SIGTERM);
		waitpid(meta2, NULL, 0);
	}
	kill(srv, SIGKILL);
	waitpid(srv, NULL, 0);
	kill(meta, SIGTERM);
	waitpid(meta, NULL, 0);
	CT_CHECK(fails == 0, "%d case(s) failed", fails);
	return 0;
}
