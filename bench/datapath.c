/*
 * datapath: what a virtual QP costs on the data path, when a process
 * connects to many peers, and in memory, next to raw verbs (issue 7).
 * Built twice from this file: target/bench/bin/datapath links -libverbs
 * (raw RC QPs), target/bench/bin/datapath-krcore (-DKRCORE) links
 * libkrcore and uses KRCORE_VQP QPs with qbind / qconnect / qpop_msgs.
 * bench/vqp-compare.sh runs both in one VM boot; bench/vqp_report.py
 * makes the table.
 *
 *   datapath server [-d DEV] [-g GID_INDEX] [-p PORT]
 *   datapath client SERVER_IP [-d DEV] [-g GID_INDEX] [-p PORT] [-r READS]
 *            [-n TPUT_OPS] [-w WINDOW] [-e ECHOS] [-E LARGE_ECHOS]
 *            [-t tsc|clock] [-y SPINS]
 *   datapath mesh [-N PROCS] [-p PORT] [-d DEV] [-Q] [-o natural|ordered]
 *   datapath mem [-K PEERS] [-V VQPS] [-q RAW_QP_PAIRS] [-p PORT] [-d DEV]
 *   (internal: datapath worker -R RANK -N PROCS -k mesh|peer|mem ...)
 *
 * Waiting for a completion is busy-polling with a sched_yield() after
 * every SPINS empty polls (-y, default 1; 0: never yield): the VM has 2
 * vCPUs and rxe does part of its work in softirq context, which a
 * spinning waiter starves (measured: raw first READ 41 ms without
 * yielding, 1.2 ms with).
 *
 * Every process of an emulated node uses GID index G (10.77.0.G, see
 * scripts/rxe-up.sh); the krcore binary also needs KRCORE_META (a running
 * krcore-meta) and KRCORE_GID_INDEX=G (checked; mesh and mem set it for the
 * processes they spawn).
 *
 * ---- server / client: the data path ----------------------------------
 *
 * The server (GID index default 1) registers a 64 KiB READ target filled
 * with a known pattern (remote read) and ECHO_SLOTS receive buffers of
 * 64 KiB, listens on TCP at its GID's IPv4 address and PORT (default
 * 18800) and, in krcore mode, binds a VQP with qbind at (its GID, PORT)
 * with the receive buffers posted on it. Ready line on stdout:
 *
 *   datapath: server ready on A.B.C.D port PORT ...
 *
 * It serves one client, then exits 0. The TCP connection is the control
 * channel in both modes (the READ target's address and rkey, the echo
 * phases); in raw mode it also carries the QP exchange (QPN, PSN, GID):
 * the server creates an RC QP (send depth 64) and brings it to RTS. The
 * server blocks on TCP outside the echo phases, so it takes no CPU while
 * the client measures READs.
 *
 * The client (GID index default 2) connects: raw, an RC QP (depth 64)
 * INIT/RTR/RTS; krcore, ibv_create_qp(KRCORE_VQP) (send depth 64) and
 * qconnect to (the server's GID, PORT). Then, timed with the CPU's cycle
 * counter (bench/timer.h):
 *
 *   first READ   the first 8-byte READ on the new QP: ibv_post_send's own
 *                time and post-to-completion (krcore: the first use of the
 *                server's rkey READs its MR table entry)
 *   (a) READ latency: one signaled 8-byte READ, busy-poll its completion,
 *                check the 8 bytes against the pattern; READS (default
 *                2000) timed, in 10 slices of 100 warm-up READs and a tenth
 *                of READS each: median, p99, ...; and
 *                ibv_post_send's own share of each (line read_post: rxe
 *                runs the whole READ inside the posting system call)
 *   (b) READ throughput: WINDOW (default 32) signaled READs outstanding,
 *                each completion checked and its slot reposted, TPUT_OPS
 *                (default 4000 at 8 B, a quarter of it at 4 KiB) completed
 *                ops from the first post to the last completion, after a
 *                warm-up of 2 x WINDOW; 9 trials, the median of ops/s
 *   (c) echo latency: the client posts a receive, SENDs SIZE bytes
 *                (signaled), the server (busy-polling: raw ibv_poll_cq,
 *                krcore qpop_msgs) SENDs them back (raw: on its QP;
 *                krcore: on the src_qp that qpop_msgs returned), the client
 *                waits for its send and receive completions; every echo's
 *                bytes checked (memcmp against what was sent, its first
 *                and last 8 bytes stamped with the iteration). SIZE 8 B and
 *                4 KiB (ECHOS, default 500, each after 20 warm-ups) and
 *                64 KiB (LARGE_ECHOS, default 200). When the library
 *                refuses a 64 KiB SEND (ibv_post_send EINVAL: krcore
 *                messages are limited to 4 KiB until the large-message path
 *                lands) the size is reported as skipped:
 *                  echo size=65536 skipped=EINVAL ...
 *                and measured as soon as the library takes it.
 *
 * With -T IN,OUT[,first] two clients (raw and krcore) run these phases
 * interleaved, slice by slice: see bench/turns.h.
 *
 * The client's last line is the summary the report reads:
 *
 *   datapath_summary mode=raw|krcore read_lat_med_us=.. read_lat_p99_us=..
 *     read_lat_p10_us=.. tput8_ops_s=.. tput4k_ops_s=.. echo8_med_us=..
 *     echo8_p99_us=.. echo8_p10_us=.. echo4k_{med,p99,p10}_us=..
 *     echo64k_{med,p99,p10}_us=..|skip first_post_us=.. first_read_us=..
 *     second_read_us=.. connect_us=.. window=..
 *
 * ---- mesh: PROCS processes connecting all-to-all -----------------------
 *
 * The coordinator spawns PROCS (default 8) workers, rank r on GID index
 * r+1 (KRCORE_GID_INDEX=r+1), each with a 4 KiB pattern buffer registered
 * for remote read. Setup, untimed (setup_us): open the device, PD, CQ, MR;
 * raw: a TCP listener at the node's address and PORT; krcore: one VQP bound
 * with qbind at (the node's GID, PORT) (this starts the library's runtime
 * and the meta-server bootstrap). Each worker prints "ready" with its
 * buffer's address and rkey; once every worker is ready the coordinator
 * sends them all "go" with every worker's address (as a real application
 * knows its peers' buffers), and each worker, timed from "go":
 *
 *   raw:    creates PROCS-1 RC QPs and moves them to INIT; exchanges
 *           (rank, QPN, PSN, GID) with every peer over TCP (connects to the
 *           higher ranks, accepts the lower ones); RTR + RTS each; a
 *           barrier over TCP (every peer's QP to us is RTR before we READ
 *           it: a READ reaching a QP still in INIT would be dropped and
 *           retried after the transport timeout); then one 8-byte READ to
 *           every peer, all posted, all completions awaited and checked.
 *   krcore: one VQP per peer, ibv_create_qp(KRCORE_VQP) + qconnect, in
 *           one of two orders (-o), then the same READs:
 *           natural (default): every process qconnects to ranks r+1, r+2,
 *             ... mod PROCS at once;
 *           ordered: qconnect to the higher ranks, telling each (a 4-byte
 *             SEND on the new VQP to its bound VQP) that we did; qconnect
 *             to a lower rank once its announcement came (qpop_msgs): the
 *             link it made is then there, so two processes never run the
 *             link handshake towards each other at the same time.
 *
 * total_us per worker: "go" -> all PROCS-1 READs checked; wall_us: the
 * first worker's "go" -> the last worker's end (CLOCK_MONOTONIC, shared by
 * the processes). With -Q the coordinator counts each worker's RC QPs
 * (rdma resource show qp) before telling them to exit. Summary:
 *
 *   mesh_summary mode=.. order=.. procs=.. wall_us=.. proc_med_us=..
 *     proc_max_us=.. proc_min_us=.. setup_med_us=.. [phase medians]
 *
 * ---- mem: bytes per VQP, per link, per RC QP ---------------------------
 *
 * Deltas of one measuring process's (rank 0, GID index 1) VmRSS, VmPin
 * (pinned, i.e. registered, bytes: the kernel counts every ib_umem pin
 * there), VmSize (mapped: the rxe QP and CQ rings, allocated by the
 * kernel and mapped to user space, never show in VmRSS) and of the
 * machine's kernel memory (VmallocUsed + SUnreclaim of /proc/meminfo:
 * both ends of a link count), read once they have been stable for 5
 * readings 10 ms apart (at most 1 s: the library refills its QP pool on a
 * background thread).
 *   krcore: PEERS (default 8) peer processes (ranks 1.., GID index r+1)
 *   each bind a VQP. The measurer: (runtime) a first VQP qconnected to
 *   peer 1 and one READ; (links) one VQP qconnected to each of peers 2..K
 *   and one READ each: a new link each, the delta divided by K-1 (it
 *   includes that one VQP per link); (VQPs) VQPS (default 1000) VQPs
 *   (send and receive depth 16, one SGE) qconnected to peer 1 (its live
 *   link), delta / VQPS; then one READ on each (first use: header slots,
 *   rings touched), delta / VQPS again; then all destroyed.
 *   raw: 2 x RAW_QP_PAIRS (default 100) RC QPs (send and receive depth 16,
 *   one SGE) created, then connected in pairs to each other (INIT, RTR,
 *   RTS over the device), then one READ on each: the deltas / QPs.
 *   Summary (the measurer's line, relayed), X_{rss,pin,virt,kern}_B for
 *   each X, bytes per unit:
 *
 *   mem_summary rank=0 mode=krcore vqps=.. links=.. vqp_depth=..
 *     runtime_*_B link_*_B vqp_*_B vqp_used_*_B
 *   mem_summary rank=0 mode=raw qps=.. qp_depth=.. qp_created_*_B qp_*_B
 *     qp_used_*_B conn_*_B (a connection: 2 QPs)
 *
 * Every verbs, socket and process call is checked; a failure prints what
 * failed on stderr and exits 1 (2 for a usage error). Every wait is
 * bounded (completions 10 s, TCP and worker lines 120 s).
 *
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/datapath.c -libverbs \
 *      -o target/bench/bin/datapath
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror -DKRCORE -I include \
 *      bench/datapath.c -L target/release -lkrcore \
 *      -Wl,-rpath,$PWD/target/release -o target/bench/bin/datapath-krcore
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "timer.h"
#ifdef KRCORE
#include <krcore.h>
#define MODE "krcore"
#else
#define MODE "raw"
#endif

#define TARGET_LEN (64 * 1024)	/* the server's READ target */
#define MAX_ECHO (64 * 1024)	/* largest echo message */
#define ECHO_SLOTS 4		/* server's receive buffers */
#define QP_DEPTH 64		/* send depth of the measured QPs */
#define SLOT 4096		/* client: one READ landing slot */
#define MAX_WINDOW 64
#define WARMUP_READS 100
#define WARMUP_ECHOS 20
#define TPUT_TRIALS 9
#define POLL_TIMEOUT_US 10e6
#define WAIT_MS 120000		/* TCP, worker lines, accept */
#define MAGIC 0x4b524450u	/* "KRDP" */
#define MESH_BUF 4096		/* a mesh worker's READ target */
#define MEM_DEPTH 16		/* QPs and VQPs of the memory measurement */

extern char **environ;

static const char *role = "datapath";

/* The coordinator's workers: killed and reaped when it dies. */
static pid_t *g_worker_pids;
static int g_nworkers;

/* Empty polls between two sched_yield() calls while waiting for a
 * completion (-y; 0: pure busy-polling). The VM has 2 vCPUs and rxe does
 * its work in softirq context: a waiter that never yields starves it
 * when the peer spins too (8 ms echoes measured with both spinning). */
static int yield_spins = 1;

static void idle(unsigned spins)
{
	if (yield_spins > 0 && spins % (unsigned)yield_spins == 0)
		sched_yield();
}

static void die(const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	fprintf(stderr, "datapath-%s %s: ", MODE, role);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	for (int i = 0; i < g_nworkers; i++)
		if (g_worker_pids[i] > 0) {
			kill(g_worker_pids[i], SIGKILL);
			waitpid(g_worker_pids[i], NULL, 0);
		}
	exit(1);
}

#include "rc.h"
#include "turns.h"

/* ---- numbers ------------------------------------------------------------ */

/* Quantile q of n values (nearest rank; the median of an even count is
 * the mean of the middle two). v is left untouched. */
static double quantile(const double *v, int n, double q)
{
	double *c, r;

	if (n <= 0)
		return 0;
	c = malloc((size_t)n * sizeof(*c));
	if (!c)
		die("malloc");
	memcpy(c, v, (size_t)n * sizeof(*c));
	qsort(c, (size_t)n, sizeof(*c), cmp_double);
	if (n % 2 == 0 && q == 0.5)
		r = (c[n / 2 - 1] + c[n / 2]) / 2;
	else
		r = c[(int)(q * (n - 1) + 0.5)];
	free(c);
	return r;
}

static double median(const double *v, int n)
{
	return quantile(v, n, 0.5);
}

static uint8_t pat(uint32_t seed, size_t i)
{
	uint32_t x = seed * 0x9e3779b1u + (uint32_t)i * 0x85ebca6bu;

	x ^= x >> 13;
	x *= 0xc2b2ae35u;
	x ^= x >> 16;
	return (uint8_t)x;
}

static void fill(uint8_t *p, size_t len, uint32_t seed)
{
	for (size_t i = 0; i < len; i++)
		p[i] = pat(seed, i);
}

static uint32_t rng_state = 1;

/* Raw verbs only (unused in the krcore build). */
#define RAW_ONLY __attribute__((unused))

RAW_ONLY static uint32_t rand_psn(void)
{
	return rc_rand_psn(&rng_state);
}

/* ---- device -------------------------------------------------------------- */

struct dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	union ibv_gid gid;
	struct rc_port rp;
	char ip[INET_ADDRSTRLEN];
};

static void open_dev(struct dev *d, const char *name, int gid_idx)
{
	struct in_addr a;

	memset(d, 0, sizeof(*d));
	d->ctx = rc_open(name, gid_idx, &d->gid, &d->rp);
	if (gid_ipv4(&d->gid, &a))
		die("GID index %d is not an IPv4-mapped (RoCE v2) GID", gid_idx);
	inet_ntop(AF_INET, &a, d->ip, sizeof(d->ip));
	d->pd = ibv_alloc_pd(d->ctx);
	if (!d->pd)
		die("ibv_alloc_pd: %s", strerror(errno));
}

static struct ibv_cq *make_cq(struct dev *d, int cqe)
{
	struct ibv_cq *cq = ibv_create_cq(d->ctx, cqe, NULL, NULL, 0);

	if (!cq)
		die("ibv_create_cq(%d): %s", cqe, strerror(errno));
	return cq;
}

static struct ibv_mr *reg(struct dev *d, uint8_t **buf, size_t len, int access)
{
	struct ibv_mr *mr;

	if (posix_memalign((void **)buf, 4096, len))
		die("posix_memalign(%zu)", len);
	memset(*buf, 0, len);
	mr = ibv_reg_mr(d->pd, *buf, len, access);
	if (!mr)
		die("ibv_reg_mr(%zu): %s", len, strerror(errno));
	return mr;
}

#ifdef KRCORE
/* Dies unless the library knows a meta server and makes this process's
 * links from GID index gid_idx (KRCORE_GID_INDEX, read by the library
 * itself at its first use: setting it here would be too late). */
static void check_env(int gid_idx)
{
	char dump[4096], want[64];
	const char *m = getenv("KRCORE_META");

	if (!m || !*m)
		die("KRCORE_META is not set (start krcore-meta --listen IP:PORT "
		    "and export KRCORE_META=IP:PORT; bench/vqp-compare.sh does "
		    "both)");
	(void)krcore_config_dump(dump, sizeof(dump));
	snprintf(want, sizeof(want), "KRCORE_GID_INDEX=%d\n", gid_idx);
	if (!strstr(dump, want))
		die("the library does not make this process's links from GID "
		    "index %d: export KRCORE_GID_INDEX=%d", gid_idx, gid_idx);
}

static struct ibv_qp *create_vqp(struct dev *d, struct ibv_cq *scq,
				 struct ibv_cq *rcq, int send_wr, int recv_wr)
{
	struct ibv_qp_init_attr ia;
	struct ibv_qp *qp;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = scq;
	ia.recv_cq = rcq;
	ia.qp_type = (enum ibv_qp_type)KRCORE_VQP;
	ia.cap.max_send_wr = (uint32_t)send_wr;
	ia.cap.max_recv_wr = (uint32_t)recv_wr;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	qp = ibv_create_qp(d->pd, &ia);
	if (!qp)
		die("ibv_create_qp(KRCORE_VQP): %s", strerror(errno));
	return qp;
}
#endif

/* ---- raw RC QPs ---------------------------------------------------------- */

#define ACCESS_RW (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)

RAW_ONLY static struct ibv_qp *create_rc(struct dev *d, struct ibv_cq *scq,
					 struct ibv_cq *rcq, int send_wr,
					 int recv_wr)
{
	struct ibv_qp_init_attr ia;
	struct ibv_qp *qp;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = scq;
	ia.recv_cq = rcq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = (uint32_t)send_wr;
	ia.cap.max_recv_wr = (uint32_t)recv_wr;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	qp = ibv_create_qp(d->pd, &ia);
	if (!qp)
		die("ibv_create_qp(RC): %s", strerror(errno));
	return qp;
}

RAW_ONLY static void to_init(struct dev *d, struct ibv_qp *qp)
{
	int rc = rc_to_init(&d->rp, qp, ACCESS_RW);

	if (rc)
		die("ibv_modify_qp(INIT): %s", strerror(rc));
}

RAW_ONLY static void to_rtr(struct dev *d, struct ibv_qp *qp, uint32_t dqpn,
			    uint32_t rq_psn, const union ibv_gid *dgid)
{
	int rc = rc_to_rtr(&d->rp, qp, dqpn, rq_psn, dgid);

	if (rc)
		die("ibv_modify_qp(RTR): %s", strerror(rc));
}

RAW_ONLY static void to_rts(struct dev *d, struct ibv_qp *qp, uint32_t sq_psn)
{
	int rc = rc_to_rts(&d->rp, qp, sq_psn);

	if (rc)
		die("ibv_modify_qp(RTS): %s", strerror(rc));
}

/* ---- posting and polling -------------------------------------------------- */

/* One signaled single-SGE work request; raddr and rkey are for READs. */
static int post_one(struct ibv_qp *qp, enum ibv_wr_opcode opcode, void *local,
		    uint32_t len, uint32_t lkey, uint64_t raddr, uint32_t rkey,
		    uint64_t wr_id)
{
	struct ibv_sge sge = { (uintptr_t)local, len, lkey };
	struct ibv_send_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = opcode;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

static int post_read(struct ibv_qp *qp, void *local, uint32_t len,
		     uint32_t lkey, uint64_t raddr, uint32_t rkey,
		     uint64_t wr_id)
{
	return post_one(qp, IBV_WR_RDMA_READ, local, len, lkey, raddr, rkey,
			wr_id);
}

static int post_send_msg(struct ibv_qp *qp, void *local, uint32_t len,
			 uint32_t lkey, uint64_t wr_id)
{
	return post_one(qp, IBV_WR_SEND, local, len, lkey, 0, 0, wr_id);
}

static void post_recv_buf(struct ibv_qp *qp, void *local, uint32_t len,
			  uint32_t lkey, uint64_t wr_id)
{
	struct ibv_sge sge = { (uintptr_t)local, len, lkey };
	struct ibv_recv_wr wr, *bad = NULL;
	int rc;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	if ((rc = ibv_post_recv(qp, &wr, &bad)))
		die("ibv_post_recv: %s", strerror(rc));
}

#ifdef KRCORE
/* qpop_msgs reports a sender's src_qp once more when the sender destroyed
 * its VQP (no receive buffer used). */
static int is_close_report(const struct ibv_wc *wc)
{
	return wc->status == IBV_WC_WR_FLUSH_ERR && wc->byte_len == 0;
}
#endif

static void check_wc(const struct ibv_wc *wc, const char *what)
{
	if (wc->status != IBV_WC_SUCCESS)
		die("%s: completion wr_id %llu status %s (%d), vendor_err %#x",
		    what, (unsigned long long)wc->wr_id,
		    ibv_wc_status_str(wc->status), wc->status, wc->vendor_err);
}

/* Busy-polls one successful completion of cq into *wc. */
static void poll1(struct ibv_cq *cq, struct ibv_wc *wc, const char *what)
{
	uint64_t start = ticks();
	uint64_t limit = (uint64_t)(POLL_TIMEOUT_US * ticks_per_us);
	unsigned spins = 0;
	int n;

	for (;;) {
		n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			die("%s: ibv_poll_cq returned %d", what, n);
		if (n == 1)
			break;
		if ((++spins & 1023) == 0 && (int64_t)(ticks() - start) > (int64_t)limit)
			die("%s: no completion after %.0f s", what,
			    POLL_TIMEOUT_US / 1e6);
		idle(spins);
	}
	check_wc(wc, what);
}

/* Cost of the clock and of the timer, then the timer's calibration. */
static void timer_setup(double *clock_us, double *timer_us)
{
	double t0 = mono_us(), d[1001];
	int i;

	for (i = 0; i < 1000; i++)
		(void)mono_us();
	*clock_us = (mono_us() - t0) / 1000;
	if (!calibrate())
		die("timer calibration failed (%.3f ticks per us)", ticks_per_us);
	for (i = 0; i < 1001; i++) {
		uint64_t a = ticks();

		d[i] = us_of(a, ticks());
	}
	*timer_us = median(d, 1001);
}

/* ---- TCP ------------------------------------------------------------------- */

static void sock_opts(int fd)
{
	struct timeval tv = { WAIT_MS / 1000, 0 };
	int one = 1;

	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) ||
	    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) ||
	    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)))
		die("setsockopt: %s", strerror(errno));
}

static int tcp_listen(const char *ip, int port)
{
	struct sockaddr_in sa;
	int fd, one = 1;

	fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		die("socket: %s", strerror(errno));
	if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)))
		die("setsockopt(SO_REUSEADDR): %s", strerror(errno));
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
		die("%s is not an IPv4 address", ip);
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)))
		die("bind %s:%d: %s", ip, port, strerror(errno));
	if (listen(fd, 64))
		die("listen: %s", strerror(errno));
	return fd;
}

static int tcp_accept(int lfd)
{
	struct pollfd p = { lfd, POLLIN, 0 };
	int fd, rc;

	do
		rc = poll(&p, 1, WAIT_MS);
	while (rc < 0 && errno == EINTR);
	if (rc == 0)
		die("no connection within %d s", WAIT_MS / 1000);
	if (rc < 0)
		die("poll: %s", strerror(errno));
	fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
	if (fd < 0)
		die("accept: %s", strerror(errno));
	sock_opts(fd);
	return fd;
}

static int tcp_connect(const char *from, const char *to, int port)
{
	struct sockaddr_in sa;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		die("socket: %s", strerror(errno));
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	if (inet_pton(AF_INET, from, &sa.sin_addr) != 1)
		die("%s is not an IPv4 address", from);
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)))
		die("bind to %s: %s", from, strerror(errno));
	sock_opts(fd);
	sa.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, to, &sa.sin_addr) != 1)
		die("%s is not an IPv4 address", to);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
		die("connect to %s:%d: %s", to, port, strerror(errno));
	return fd;
}

static void send_all(int fd, const void *buf, size_t len, const char *what)
{
	const char *p = buf;

	while (len) {
		ssize_t n = send(fd, p, len, MSG_NOSIGNAL);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			die("sending %s: %s", what,
			    n < 0 ? strerror(errno) : "connection closed");
		p += n;
		len -= (size_t)n;
	}
}

/* 1, or 0 when the peer closed before the first byte and eof_ok. */
static int recv_all(int fd, void *buf, size_t len, const char *what,
		    int eof_ok)
{
	char *p = buf;
	size_t got = 0;

	while (got < len) {
		ssize_t n = recv(fd, p + got, len - got, 0);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			die("receiving %s: nothing within %d s", what,
			    WAIT_MS / 1000);
		if (n < 0)
			die("receiving %s: %s", what, strerror(errno));
		if (n == 0) {
			if (!got && eof_ok)
				return 0;
			die("receiving %s: the peer closed the connection "
			    "(see its own error output)", what);
		}
		got += (size_t)n;
	}
	return 1;
}

/* The control messages of server/client (host order: both ends run on
 * one machine), and of the mesh's raw exchange. */
enum { C_HELLO = 1, C_WELCOME, C_ECHO, C_READY, C_END, C_DONE, C_BYE };

struct ctl {
	uint32_t magic, type;
	uint32_t qpn, psn;
	uint64_t addr;
	uint32_t rkey, size;
	uint64_t count;
	uint8_t gid[16];
};

static void send_ctl(int fd, uint32_t type, struct ctl *m, const char *what)
{
	m->magic = MAGIC;
	m->type = type;
	send_all(fd, m, sizeof(*m), what);
}

static int recv_ctl(int fd, struct ctl *m, uint32_t type, const char *what,
		    int eof_ok)
{
	if (!recv_all(fd, m, sizeof(*m), what, eof_ok))
		return 0;
	if (m->magic != MAGIC)
		die("%s: bad magic %#x", what, m->magic);
	if (type && m->type != type)
		die("%s: message type %u, expected %u", what, m->type, type);
	return 1;
}

/* ---- server ----------------------------------------------------------------- */

static int run_server(const char *devname, int gid_idx, int port)
{
	struct dev d;
	struct ibv_cq *scq, *rcq;
	struct ibv_mr *tmr, *emr;
	struct ibv_qp *qp;
	uint8_t *target, *ebuf;
	struct ctl m;
	int lfd, fd, rc;
	long echoed_total = 0;
#ifdef KRCORE
	struct ibv_qp *bound;
#endif

	role = "server";
	open_dev(&d, devname, gid_idx);
#ifdef KRCORE
	check_env(gid_idx);
#endif
	rng_state = (uint32_t)getpid() * 2654435761u | 1;
	if (!calibrate())
		die("timer calibration failed");
	scq = make_cq(&d, 2 * QP_DEPTH);
	rcq = make_cq(&d, 2 * QP_DEPTH);
	tmr = reg(&d, &target, TARGET_LEN, ACCESS_RW);
	fill(target, TARGET_LEN, 1);
	emr = reg(&d, &ebuf, (size_t)ECHO_SLOTS * MAX_ECHO,
		  IBV_ACCESS_LOCAL_WRITE);
	lfd = tcp_listen(d.ip, port);
#ifdef KRCORE
	bound = create_vqp(&d, scq, rcq, QP_DEPTH, ECHO_SLOTS);
	for (int i = 0; i < ECHO_SLOTS; i++)
		post_recv_buf(bound, ebuf + (size_t)i * MAX_ECHO, MAX_ECHO,
			      emr->lkey, (uint64_t)i);
	if ((rc = qbind(bound, d.gid, port)))
		die("qbind(%s, port %d): %s", d.ip, port, strerror(rc));
#endif
	printf("datapath: server ready on %s port %d mode=%s device=%s "
	       "gid_index=%d target=%d echo_slots=%dx%d\n", d.ip, port, MODE,
	       devname, gid_idx, TARGET_LEN, ECHO_SLOTS, MAX_ECHO);
	fflush(stdout);

	fd = tcp_accept(lfd);
	close(lfd);
	recv_ctl(fd, &m, C_HELLO, "the client's hello", 0);
#ifndef KRCORE
	{
		uint32_t psn = rand_psn();

		qp = create_rc(&d, scq, rcq, QP_DEPTH, ECHO_SLOTS);
		to_init(&d, qp);
		to_rtr(&d, qp, m.qpn, m.psn, (const union ibv_gid *)m.gid);
		to_rts(&d, qp, psn);
		for (int i = 0; i < ECHO_SLOTS; i++)
			post_recv_buf(qp, ebuf + (size_t)i * MAX_ECHO, MAX_ECHO,
				      emr->lkey, (uint64_t)i);
		memset(&m, 0, sizeof(m));
		m.qpn = qp->qp_num;
		m.psn = psn;
	}
#else
	qp = bound;
	memset(&m, 0, sizeof(m));
#endif
	m.addr = (uintptr_t)target;
	m.rkey = tmr->rkey;
	m.size = TARGET_LEN;
	memcpy(m.gid, d.gid.raw, 16);
	send_ctl(fd, C_WELCOME, &m, "the welcome");

	for (;;) {
		uint64_t want, echoed = 0;
		unsigned spins = 0;
		int ended = 0;

		if (!recv_ctl(fd, &m, 0, "a command", 1) || m.type == C_BYE)
			break;
		if (m.type != C_ECHO)
			die("unexpected command %u", m.type);
		want = m.count;
		memset(&m, 0, sizeof(m));
		send_ctl(fd, C_READY, &m, "ready");
		/* Echo until `want` messages or the client's END (it sends
		 * END early when the library refused its message). */
		while (echoed < want && !ended) {
			struct ibv_wc wc, swc;
			struct ibv_qp *to = qp;
			int k;
#ifdef KRCORE
			k = qpop_msgs(bound, 1, &to, &wc);
			if (k < 0)
				die("qpop_msgs: %s", strerror(-k));
			if (k == 1 && is_close_report(&wc))
				continue;
#else
			k = ibv_poll_cq(rcq, 1, &wc);
			if (k < 0)
				die("ibv_poll_cq: %d", k);
#endif
			if (k == 0) {
				struct pollfd p = { fd, POLLIN, 0 };

				if ((++spins & 1023) == 0 && poll(&p, 1, 0) == 1)
					ended = 1;
				idle(spins);
				continue;
			}
			check_wc(&wc, "an echo request");
			if (wc.wr_id >= ECHO_SLOTS || wc.byte_len > MAX_ECHO)
				die("an echo request: wr_id %llu, %u bytes",
				    (unsigned long long)wc.wr_id, wc.byte_len);
			if ((rc = post_send_msg(to, ebuf + wc.wr_id * MAX_ECHO,
						wc.byte_len, emr->lkey,
						1000 + wc.wr_id)))
				die("ibv_post_send (echo of %u bytes): %s",
				    wc.byte_len, strerror(rc));
			poll1(scq, &swc, "the echo's send");
			post_recv_buf(qp, ebuf + wc.wr_id * MAX_ECHO, MAX_ECHO,
				      emr->lkey, wc.wr_id);
			echoed++;
		}
		recv_ctl(fd, &m, C_END, "the end of the echo phase", 0);
		memset(&m, 0, sizeof(m));
		m.count = echoed;
		send_ctl(fd, C_DONE, &m, "done");
		echoed_total += (long)echoed;
	}
	close(fd);
	if ((rc = ibv_destroy_qp(qp)))
		die("ibv_destroy_qp: %s", strerror(rc));
	printf("datapath: server done, %ld messages echoed\n", echoed_total);
	return 0;
}

/* ---- client ----------------------------------------------------------------- */

struct client {
	struct dev d;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	uint8_t *buf;		/* MAX_WINDOW slots, echo send, echo recv */
	uint8_t *sbuf, *rbuf;
	uint8_t expect[TARGET_LEN];	/* the server's target, as filled */
	uint64_t raddr;
	uint32_t rkey;
	int fd;
};

static void prep_slot(uint8_t *slot, const uint8_t *exp, uint32_t len)
{
	memset(slot, 0, len);
	slot[0] = (uint8_t)~exp[0];
	slot[len - 1] = (uint8_t)~exp[len - 1];
}

static void check_slot(const uint8_t *slot, const uint8_t *exp, uint32_t len,
		       size_t off, const char *what)
{
	if (memcmp(slot, exp, len)) {
		for (uint32_t i = 0; i < len; i++)
			if (slot[i] != exp[i])
				die("%s: byte %u of a %u-byte READ at offset %zu "
				    "is 0x%02x, expected 0x%02x", what, i, len,
				    off, slot[i], exp[i]);
	}
}

/* One checked 8-byte READ (the slot 0), returns post-to-completion us;
 * *post_us gets ibv_post_send's own time. */
static double one_read(struct client *c, size_t off, uint64_t wr_id,
		       double *post_us, const char *what)
{
	struct ibv_wc wc;
	uint64_t t0, t1, t2;
	int rc;

	prep_slot(c->buf, c->expect + off, 8);
	t0 = ticks();
	rc = post_read(c->qp, c->buf, 8, c->mr->lkey, c->raddr + off, c->rkey,
		       wr_id);
	t1 = ticks();
	if (rc)
		die("%s: ibv_post_send(RDMA_READ): %s", what, strerror(rc));
	poll1(c->scq, &wc, what);
	t2 = ticks();
	if (wc.wr_id != wr_id || wc.opcode != IBV_WC_RDMA_READ)
		die("%s: completion wr_id %llu opcode %d, expected %llu READ",
		    what, (unsigned long long)wc.wr_id, wc.opcode,
		    (unsigned long long)wr_id);
	check_slot(c->buf, c->expect + off, 8, off, what);
	if (post_us)
		*post_us = us_of(t0, t1);
	return us_of(t0, t2);
}

static void print_dist(const char *prefix, const double *v, int n)
{
	double mean = 0, max = 0;

	for (int i = 0; i < n; i++) {
		mean += v[i];
		if (v[i] > max)
			max = v[i];
	}
	mean /= n;
	printf("%s n=%d med_us=%.1f p99_us=%.1f p10_us=%.1f p90_us=%.1f "
	       "mean_us=%.1f max_us=%.1f\n", prefix, n, median(v, n),
	       quantile(v, n, 0.99), quantile(v, n, 0.1), quantile(v, n, 0.9),
	       mean, max);
}

/* (b): `ops` READs of `len` bytes, `window` outstanding; ops/s. */
static double tput_trial(struct client *c, uint32_t len, int window, int ops,
			 int warm)
{
	struct ibv_wc wcs[16];
	int posted = 0, done = 0, total = warm + ops, rc;
	unsigned spins = 0;
	uint64_t t0 = 0, t1, start = ticks();
	uint64_t limit = (uint64_t)(60e6 * ticks_per_us);
	size_t span = TARGET_LEN / len;

	for (; posted < window && posted < total; posted++) {
		size_t off = ((size_t)posted % span) * len;
		uint8_t *slot = c->buf + (size_t)(posted % window) * SLOT;

		prep_slot(slot, c->expect + off, len);
		if ((rc = post_read(c->qp, slot, len, c->mr->lkey,
				    c->raddr + off, c->rkey, (uint64_t)posted)))
			die("throughput: ibv_post_send(RDMA_READ, op %d): %s",
			    posted, strerror(rc));
	}
	while (done < total) {
		int n = ibv_poll_cq(c->scq, 16, wcs);

		if (n < 0)
			die("throughput: ibv_poll_cq returned %d", n);
		if (n == 0) {
			if ((int64_t)(ticks() - start) > (int64_t)limit)
				die("throughput: %d of %d READs completed after "
				    "60 s", done, total);
			idle(++spins);
		}
		for (int i = 0; i < n; i++) {
			uint64_t id = wcs[i].wr_id;
			size_t off = ((size_t)id % span) * len;
			uint8_t *slot = c->buf + (size_t)(id % (uint64_t)window) * SLOT;

			check_wc(&wcs[i], "throughput READ");
			if (id != (uint64_t)done || wcs[i].opcode != IBV_WC_RDMA_READ)
				die("throughput: completion wr_id %llu opcode %d, "
				    "expected %d READ (in order)",
				    (unsigned long long)id, wcs[i].opcode, done);
			check_slot(slot, c->expect + off, len, off,
				   "throughput READ");
			done++;
			if (done == warm)
				t0 = ticks();
			if (posted < total) {
				off = ((size_t)posted % span) * len;
				prep_slot(slot, c->expect + off, len);
				if ((rc = post_read(c->qp, slot, len, c->mr->lkey,
						    c->raddr + off, c->rkey,
						    (uint64_t)posted)))
					die("throughput: ibv_post_send(RDMA_READ, "
					    "op %d): %s", posted, strerror(rc));
				posted++;
			}
		}
	}
	t1 = ticks();
	/* The warm-up's last completion starts the clock: `ops` more
	 * completions follow it, the window already full. */
	return ops / us_of(t0, t1) * 1e6;
}

/* (c) one echo size: returns 0 when measured (med/p99 filled), 1 when the
 * library refused the message (krcore, EINVAL). */
static int echo_size(struct client *c, uint32_t size, int count, double *med,
		     double *p99, double *p10)
{
	struct ctl m;
	double *lat = calloc((size_t)count, sizeof(double));
	int total = WARMUP_ECHOS + count, skipped = 0, i;
	char what[64];

	if (!lat)
		die("calloc");
	snprintf(what, sizeof(what), "echo of %u bytes", size);
	fill(c->sbuf, size, size);
	memset(&m, 0, sizeof(m));
	m.size = size;
	m.count = (uint64_t)total;
	send_ctl(c->fd, C_ECHO, &m, "the echo command");
	recv_ctl(c->fd, &m, C_READY, "the server's ready", 0);
	for (i = 0; i < total; i++) {
		uint64_t stamp = ((uint64_t)size << 32) | (uint64_t)i, t0, t1;
		uint64_t start, limit = (uint64_t)(POLL_TIMEOUT_US * ticks_per_us);
		int got_s = 0, got_r = 0, rc;
		unsigned spins = 0;
		struct ibv_wc wc;

		memcpy(c->sbuf, &stamp, 8 < size ? 8 : size);
		if (size >= 16)
			memcpy(c->sbuf + size - 8, &stamp, 8);
		memset(c->rbuf, 0, size);
		post_recv_buf(c->qp, c->rbuf, MAX_ECHO, c->mr->lkey,
			      (uint64_t)i);
		t0 = ticks();
		rc = post_send_msg(c->qp, c->sbuf, size, c->mr->lkey,
				   (uint64_t)i);
		if (rc) {
#ifdef KRCORE
			if (rc == EINVAL && i == 0 && size > 4096) {
				skipped = 1;
				break;
			}
#endif
			die("%s %d: ibv_post_send(SEND): %s", what, i,
			    strerror(rc));
		}
		start = ticks();
		while (!got_s || !got_r) {
			if (!got_s && ibv_poll_cq(c->scq, 1, &wc) == 1) {
				check_wc(&wc, what);
				if (wc.wr_id != (uint64_t)i ||
				    wc.opcode != IBV_WC_SEND)
					die("%s %d: send completion wr_id %llu "
					    "opcode %d", what, i,
					    (unsigned long long)wc.wr_id,
					    wc.opcode);
				got_s = 1;
			}
			if (!got_r && ibv_poll_cq(c->rcq, 1, &wc) == 1) {
				check_wc(&wc, what);
				if (wc.wr_id != (uint64_t)i ||
				    wc.opcode != IBV_WC_RECV ||
				    wc.byte_len != size)
					die("%s %d: receive completion wr_id "
					    "%llu opcode %d, %u bytes", what, i,
					    (unsigned long long)wc.wr_id,
					    wc.opcode, wc.byte_len);
				got_r = 1;
			}
			if ((++spins & 1023) == 0 && (int64_t)(ticks() - start) > (int64_t)limit)
				die("%s %d: no echo after %.0f s (send %s, "
				    "receive %s)", what, i, POLL_TIMEOUT_US / 1e6,
				    got_s ? "done" : "pending",
				    got_r ? "done" : "pending");
			if (!got_s || !got_r)
				idle(spins);
		}
		t1 = ticks();
		if (memcmp(c->rbuf, c->sbuf, size))
			die("%s %d: the echoed bytes differ from the sent ones",
			    what, i);
		if (i >= WARMUP_ECHOS)
			lat[i - WARMUP_ECHOS] = us_of(t0, t1);
	}
	memset(&m, 0, sizeof(m));
	send_ctl(c->fd, C_END, &m, "the end of the echo phase");
	recv_ctl(c->fd, &m, C_DONE, "the server's done", 0);
	if (skipped) {
		if (m.count != 0)
			die("%s: refused by ibv_post_send but the server "
			    "echoed %llu", what, (unsigned long long)m.count);
		printf("echo size=%u skipped=EINVAL (ibv_post_send refused a "
		       "%u-byte SEND: this libkrcore limits VQP messages to "
		       "4 KiB; measured once the large-message path lands)\n",
		       size, size);
		free(lat);
		return 1;
	}
	if (m.count != (uint64_t)total)
		die("%s: the server echoed %llu of %d", what,
		    (unsigned long long)m.count, total);
	snprintf(what, sizeof(what), "echo size=%u", size);
	print_dist(what, lat, count);
	*med = median(lat, count);
	*p99 = quantile(lat, count, 0.99);
	*p10 = quantile(lat, count, 0.1);
	free(lat);
	return 0;
}

/* Interleaving (-T, bench/turns.h): the turns are the connect and first
 * READs, LAT_SLICES parts of the latency phase, each throughput trial, and
 * the echo phase (one turn: the servers busy-poll during it). */
#define LAT_SLICES 10

static int run_client(const char *devname, int gid_idx, const char *server,
		      int port, int reads, int tput_ops, int window, int echos,
		      int large_echos)
{
	static struct client c;	/* large: the expected target */
	struct ctl m;
	double clock_us, timer_us, connect_us, first_post, first_read,
		second_read, *lat, *post, tput[2][TPUT_TRIALS], tmed[2];
	double emed[3] = { 0 }, ep99[3] = { 0 }, ep10[3] = { 0 };
	int eskip[3] = { 0 };
	static const uint32_t esize[3] = { 8, 4096, MAX_ECHO };
	uint64_t t0, t1;
	int rc;

	role = "client";
	memset(&c, 0, sizeof(c));
	open_dev(&c.d, devname, gid_idx);
#ifdef KRCORE
	check_env(gid_idx);
#endif
	rng_state = (uint32_t)getpid() * 2654435761u | 1;
	c.scq = make_cq(&c.d, 2 * QP_DEPTH);
	c.rcq = make_cq(&c.d, 2 * QP_DEPTH);
	c.mr = reg(&c.d, &c.buf, (size_t)MAX_WINDOW * SLOT + 2 * MAX_ECHO,
		   IBV_ACCESS_LOCAL_WRITE);
	c.sbuf = c.buf + (size_t)MAX_WINDOW * SLOT;
	c.rbuf = c.sbuf + MAX_ECHO;
	fill(c.expect, TARGET_LEN, 1);
	lat = calloc((size_t)reads, sizeof(double));
	post = calloc((size_t)reads, sizeof(double));
	if (!lat || !post)
		die("calloc");
	timer_setup(&clock_us, &timer_us);

	turn_begin();
	c.fd = tcp_connect(c.d.ip, server, port);
	memset(&m, 0, sizeof(m));
	t0 = ticks();
#ifndef KRCORE
	{
		uint32_t psn = rand_psn();

		c.qp = create_rc(&c.d, c.scq, c.rcq, QP_DEPTH, ECHO_SLOTS);
		to_init(&c.d, c.qp);
		m.qpn = c.qp->qp_num;
		m.psn = psn;
		memcpy(m.gid, c.d.gid.raw, 16);
		send_ctl(c.fd, C_HELLO, &m, "the hello");
		recv_ctl(c.fd, &m, C_WELCOME, "the welcome", 0);
		to_rtr(&c.d, c.qp, m.qpn, m.psn, (const union ibv_gid *)m.gid);
		to_rts(&c.d, c.qp, psn);
	}
#else
	send_ctl(c.fd, C_HELLO, &m, "the hello");
	recv_ctl(c.fd, &m, C_WELCOME, "the welcome", 0);
	c.qp = create_vqp(&c.d, c.scq, c.rcq, QP_DEPTH, ECHO_SLOTS);
	{
		union ibv_gid g;

		memcpy(g.raw, m.gid, 16);
		if ((rc = qconnect(c.qp, g, port)))
			die("qconnect to %s port %d: %s", server, port,
			    strerror(rc));
	}
#endif
	t1 = ticks();
	connect_us = us_of(t0, t1);
	c.raddr = m.addr;
	c.rkey = m.rkey;
	if (m.size != TARGET_LEN)
		die("the server's target is %u bytes, expected %d", m.size,
		    TARGET_LEN);
	printf("# datapath role=client mode=%s device=%s gid_index=%d "
	       "server=%s port=%d reads=%d tput_ops=%d window=%d echos=%d "
	       "large_echos=%d qp_depth=%d yield_spins=%d timer=%s "
	       "ticks_per_us=%.3f timer_cost_us=%.4f clock_gettime_us=%.3f\n",
	       MODE, devname, gid_idx, server, port, reads, tput_ops, window,
	       echos, large_echos, QP_DEPTH, yield_spins,
	       use_counter ? "counter" : "clock",
	       ticks_per_us, timer_us, clock_us);

	/* The first READs on the new QP. */
	first_read = one_read(&c, 0, 1, &first_post, "the first READ");
	second_read = one_read(&c, 8, 2, NULL, "the second READ");
	printf("first_read connect_us=%.1f first_post_us=%.1f "
	       "first_read_us=%.1f second_read_us=%.1f\n", connect_us,
	       first_post, first_read, second_read);
	turn_end();

	/* (a) READ latency (in LAT_SLICES turns; the warm-up opens each). */
	for (int sl = 0; sl < LAT_SLICES; sl++) {
		int from = (int)((long)reads * sl / LAT_SLICES),
		    to = (int)((long)reads * (sl + 1) / LAT_SLICES);

		turn_begin();
		for (int i = from - WARMUP_READS; i < to; i++) {
			size_t off = ((size_t)(i + WARMUP_READS) * 8) % TARGET_LEN;
			double post_us;
			double us = one_read(&c, off, 100 + (uint64_t)(i + WARMUP_READS),
					     &post_us, "a timed READ");

			if (i >= from) {
				lat[i] = us;
				post[i] = post_us;
			}
		}
		turn_end();
	}
	print_dist("read_lat size=8", lat, reads);
	print_dist("read_post size=8", post, reads);

	/* (b) READ throughput, 8 B then 4 KiB. */
	for (int s = 0; s < 2; s++) {
		uint32_t len = s ? 4096 : 8;
		int ops = s ? (tput_ops / 4 > 1 ? tput_ops / 4 : 1) : tput_ops;

		for (int t = 0; t < TPUT_TRIALS; t++) {
			turn_begin();
			tput[s][t] = tput_trial(&c, len, window, ops, 2 * window);
			turn_end();
			printf("read_tput size=%u window=%d ops=%d trial=%d "
			       "ops_per_s=%.0f MB_per_s=%.2f\n", len, window, ops,
			       t + 1, tput[s][t], tput[s][t] * len / 1e6);
		}
		tmed[s] = median(tput[s], TPUT_TRIALS);
	}

	/* (c) echo latency. */
	turn_begin();
	for (int s = 0; s < 3; s++)
		eskip[s] = echo_size(&c, esize[s], s == 2 ? large_echos : echos,
				     &emed[s], &ep99[s], &ep10[s]);
	turn_end();

	memset(&m, 0, sizeof(m));
	send_ctl(c.fd, C_BYE, &m, "bye");
	close(c.fd);
	if ((rc = ibv_destroy_qp(c.qp)))
		die("ibv_destroy_qp: %s", strerror(rc));

	printf("datapath_summary mode=%s read_lat_med_us=%.2f "
	       "read_lat_p99_us=%.2f read_lat_p10_us=%.2f tput8_ops_s=%.0f "
	       "tput4k_ops_s=%.0f", MODE, median(lat, reads),
	       quantile(lat, reads, 0.99), quantile(lat, reads, 0.1), tmed[0],
	       tmed[1]);
	for (int s = 0; s < 3; s++) {
		const char *k = s == 0 ? "echo8" : s == 1 ? "echo4k" : "echo64k";

		if (eskip[s])
			printf(" %s_med_us=skip %s_p99_us=skip %s_p10_us=skip", k,
			       k, k);
		else
			printf(" %s_med_us=%.2f %s_p99_us=%.2f %s_p10_us=%.2f", k,
			       emed[s], k, ep99[s], k, ep10[s]);
	}
	printf(" first_post_us=%.1f first_read_us=%.1f second_read_us=%.1f "
	       "connect_us=%.1f window=%d\n", first_post, first_read,
	       second_read, connect_us, window);
	free(lat);
	free(post);
	return 0;
}

/* ---- coordinator and workers (mesh, mem) ---------------------------------- */

struct lines {
	int fd;
	char buf[16384];
	size_t used;
};

/* One line (no newline) into out; dies on EOF or after WAIT_MS. */
static void read_line(struct lines *r, char *out, size_t cap, const char *what)
{
	double deadline = mono_us() + WAIT_MS * 1e3;

	for (;;) {
		char *nl = memchr(r->buf, '\n', r->used);
		struct pollfd p = { r->fd, POLLIN, 0 };
		ssize_t n;
		int rc, left;

		if (nl) {
			size_t len = (size_t)(nl - r->buf);

			if (len >= cap)
				die("%s: line too long", what);
			memcpy(out, r->buf, len);
			out[len] = 0;
			r->used -= len + 1;
			memmove(r->buf, nl + 1, r->used);
			return;
		}
		if (r->used == sizeof(r->buf))
			die("%s: line too long", what);
		left = (int)((deadline - mono_us()) / 1e3);
		if (left <= 0)
			die("%s: nothing within %d s", what, WAIT_MS / 1000);
		rc = poll(&p, 1, left);
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc < 0)
			die("%s: poll: %s", what, strerror(errno));
		if (rc == 0)
			continue;
		n = read(r->fd, r->buf + r->used, sizeof(r->buf) - r->used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die("%s: read: %s", what, strerror(errno));
		if (n == 0)
			die("%s: the process exited (its error is above)", what);
		r->used += (size_t)n;
	}
}

/* A value "key=V" in a line of key=value tokens; dies when absent. */
static double kv(const char *line, const char *key)
{
	char pat_[64];
	const char *p = line;
	size_t kl;

	snprintf(pat_, sizeof(pat_), "%s=", key);
	kl = strlen(pat_);
	while ((p = strstr(p, pat_))) {
		if (p == line || p[-1] == ' ')
			return strtod(p + kl, NULL);
		p += kl;
	}
	die("no %s in: %s", key, line);
	return 0;
}

struct worker {
	pid_t pid;
	int in;
	struct lines out;
	char ready[512];
	char done[2048];
};

static void spawn_worker(struct worker *w, const char *self, char **argv,
			 int gid_idx)
{
	posix_spawn_file_actions_t fa;
	int pin[2], pout[2], n = 0, rc;
	char **envp, gi[32];

	for (char **e = environ; *e; e++)
		n++;
	envp = calloc((size_t)n + 2, sizeof(*envp));
	if (!envp)
		die("calloc");
	n = 0;
	for (char **e = environ; *e; e++)
		if (strncmp(*e, "KRCORE_GID_INDEX=", 17))
			envp[n++] = *e;
	snprintf(gi, sizeof(gi), "KRCORE_GID_INDEX=%d", gid_idx);
	envp[n++] = gi;
	envp[n] = NULL;
	if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC))
		die("pipe2: %s", strerror(errno));
	if ((rc = posix_spawn_file_actions_init(&fa)) ||
	    (rc = posix_spawn_file_actions_adddup2(&fa, pin[0], 0)) ||
	    (rc = posix_spawn_file_actions_adddup2(&fa, pout[1], 1)))
		die("posix_spawn_file_actions: %s", strerror(rc));
	if ((rc = posix_spawn(&w->pid, self, &fa, NULL, argv, envp)))
		die("posix_spawn(%s): %s", self, strerror(rc));
	posix_spawn_file_actions_destroy(&fa);
	free(envp);
	close(pin[0]);
	close(pout[1]);
	w->in = pin[1];
	w->out.fd = pout[0];
	w->out.used = 0;
}

static void write_line(int fd, const char *s, const char *what)
{
	size_t len = strlen(s);

	while (len) {
		ssize_t n = write(fd, s, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			die("writing to %s: %s", what, strerror(errno));
		s += n;
		len -= (size_t)n;
	}
}

/* Waits (bounded) for every worker to exit; SIGKILL after 60 s. Returns
 * how many failed. */
static int reap(struct worker *w, int n)
{
	double deadline = mono_us() + 60e6;
	int left = n, failed = 0;
	int *gone = calloc((size_t)n, sizeof(int));

	if (!gone)
		die("calloc");
	while (left) {
		for (int i = 0; i < n; i++) {
			int st;
			pid_t p;

			if (gone[i])
				continue;
			p = waitpid(w[i].pid, &st, WNOHANG);
			if (p == 0)
				continue;
			if (p < 0)
				die("waitpid: %s", strerror(errno));
			gone[i] = 1;
			left--;
			if (i < g_nworkers)
				g_worker_pids[i] = 0;	/* reaped */
			if (!WIFEXITED(st) || WEXITSTATUS(st)) {
				fprintf(stderr, "datapath-%s: worker %d exited "
					"with status %#x\n", MODE, i, st);
				failed++;
			}
		}
		if (left && mono_us() > deadline) {
			for (int i = 0; i < n; i++)
				if (!gone[i])
					kill(w[i].pid, SIGKILL);
			die("%d worker(s) did not exit within 60 s (killed)",
			    left);
		}
		if (left) {
			struct timespec nap = { 0, 5 * 1000 * 1000 };

			nanosleep(&nap, NULL);
		}
	}
	free(gone);
	return failed;
}

/* Whether tid is a thread of process pid. */
static int is_thread_of(long tid, pid_t pid)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/task/%ld", (int)pid, tid);
	return access(path, F_OK) == 0;
}

/* RC QPs per worker (rdma resource show qp: its "pid" is the creating
 * thread's id, so the library's own threads count for their process):
 * total and in RTS. */
static void count_qps(struct worker *w, int n)
{
	FILE *f = popen("rdma resource show qp 2>/dev/null", "r");
	char line[1024];
	int *tot = calloc((size_t)n, sizeof(int)), *rts = calloc((size_t)n, sizeof(int));
	double v[64];

	if (!f || !tot || !rts) {
		fprintf(stderr, "datapath: cannot run rdma resource show qp\n");
		free(tot);
		free(rts);
		if (f)
			pclose(f);
		return;
	}
	while (fgets(line, sizeof(line), f)) {
		const char *p = strstr(line, " pid ");
		long tid;

		if (!p || !strstr(line, "type RC"))
			continue;
		tid = strtol(p + 5, NULL, 10);
		for (int i = 0; i < n; i++)
			if (is_thread_of(tid, w[i].pid)) {
				tot[i]++;
				if (strstr(line, "state RTS"))
					rts[i]++;
			}
	}
	pclose(f);
	for (int i = 0; i < n; i++) {
		printf("qps rank=%d pid=%d rc_qps=%d rc_rts=%d\n", i,
		       (int)w[i].pid, tot[i], rts[i]);
		if (i < 64)
			v[i] = rts[i];
	}
	printf("qps_summary rc_rts_med=%.1f rc_rts_min=%.0f rc_rts_max=%.0f\n",
	       median(v, n < 64 ? n : 64), quantile(v, n < 64 ? n : 64, 0.0),
	       quantile(v, n < 64 ? n : 64, 1.0));
	free(tot);
	free(rts);
}

/* Spawns n workers of `kind` (rank r on GID index r+1), waits for every
 * "ready", sends "go" with every worker's (IP, address, rkey), waits for
 * every "done", then (optionally counts QPs and) tells them to exit. */
static struct worker *coordinate(const char *kind, int n, const char *devname,
				 int port, const char *extra_opt,
				 const char *extra_val, int count)
{
	struct worker *w = calloc((size_t)n, sizeof(*w));
	char self[4096], go[8192], rs[16], ns[16], ps[16];

	g_worker_pids = calloc((size_t)n, sizeof(pid_t));
	if (!g_worker_pids)
		die("calloc");
	size_t used;
	ssize_t k;

	if (!w)
		die("calloc");
	signal(SIGPIPE, SIG_IGN);
	k = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (k <= 0)
		die("readlink(/proc/self/exe): %s", strerror(errno));
	self[k] = 0;
	snprintf(ns, sizeof(ns), "%d", n);
	snprintf(ps, sizeof(ps), "%d", port);
	for (int r = 0; r < n; r++) {
		const char *wk = r == 0 || strcmp(kind, "mem") ? kind : "peer";
		char *argv[] = { self, "worker", "-R", rs, "-N", ns, "-k",
				 (char *)wk, "-p", ps, "-d", (char *)devname,
				 (char *)extra_opt, (char *)extra_val, NULL };

		snprintf(rs, sizeof(rs), "%d", r);
		spawn_worker(&w[r], self, argv, r + 1);
		g_worker_pids[r] = w[r].pid;
		g_nworkers = r + 1;
	}
	used = (size_t)snprintf(go, sizeof(go), "go");
	for (int r = 0; r < n; r++) {
		char what[64];

		snprintf(what, sizeof(what), "worker %d's ready line", r);
		read_line(&w[r].out, w[r].ready, sizeof(w[r].ready), what);
		if (strncmp(w[r].ready, "ready ", 6))
			die("worker %d said: %s", r, w[r].ready);
		{
			char ip[64];
			unsigned long long addr;
			unsigned rkey;

			if (sscanf(w[r].ready, "ready rank=%*d ip=%63s addr=%llx "
					       "rkey=%x", ip, &addr, &rkey) != 3)
				die("worker %d: bad ready line: %s", r,
				    w[r].ready);
			used += (size_t)snprintf(go + used, sizeof(go) - used,
						 " %s %llx %x", ip, addr, rkey);
			if (used >= sizeof(go) - 64)
				die("too many workers");
		}
		printf("worker %d %s\n", r, w[r].ready);
	}
	strcat(go, "\n");
	for (int r = 0; r < n; r++)
		write_line(w[r].in, go, "a worker");
	for (int r = 0; r < n; r++) {
		char what[64];

		snprintf(what, sizeof(what), "worker %d's done line", r);
		read_line(&w[r].out, w[r].done, sizeof(w[r].done), what);
		if (strncmp(w[r].done, "done ", 5))
			die("worker %d said: %s", r, w[r].done);
		printf("worker %d %s\n", r, w[r].done);
	}
	if (count)
		count_qps(w, n);
	for (int r = 0; r < n; r++)
		write_line(w[r].in, "exit\n", "a worker");
	return w;
}

static int run_mesh(const char *devname, int n, int port, int count,
		    const char *order)
{
	struct worker *w;
	double first = 1e300, last = 0, *tot, *setup, v[5][64];
	static const char *const phases_raw[] = { "create_us", "exchange_us",
						  "rtr_rts_us", "barrier_us",
						  "read_us" };
	static const char *const phases_kr[] = { "create_us", "qconnect_us",
						 "qconnect_max_us",
						 "announce_us", "read_us" };
	const char *const *ph;
	int nph, failed;

	role = "mesh";
	if (n < 2 || n > 64)
		die("-N must be in [2, 64]");
	tot = calloc((size_t)n, sizeof(double));
	setup = calloc((size_t)n, sizeof(double));
	if (!tot || !setup)
		die("calloc");
	printf("# mesh mode=%s procs=%d device=%s port=%d order=%s\n", MODE, n,
	       devname, port, order);
	fflush(stdout);
	w = coordinate("mesh", n, devname, port, "-o", order, count);
#ifdef KRCORE
	ph = phases_kr;
	nph = 5;
	(void)phases_raw;
#else
	ph = phases_raw;
	nph = 5;
	(void)phases_kr;
#endif
	for (int r = 0; r < n; r++) {
		double s = kv(w[r].done, "start_mono_us"),
		       e = kv(w[r].done, "end_mono_us");

		if (s < first)
			first = s;
		if (e > last)
			last = e;
		tot[r] = kv(w[r].done, "total_us");
		setup[r] = kv(w[r].ready, "setup_us");
		for (int p = 0; p < nph; p++)
			v[p][r] = kv(w[r].done, ph[p]);
	}
	failed = reap(w, n);
	if (failed)
		die("%d worker(s) failed", failed);
	printf("mesh_summary mode=%s order=%s procs=%d wall_us=%.0f "
	       "proc_med_us=%.0f proc_max_us=%.0f proc_min_us=%.0f "
	       "setup_med_us=%.0f", MODE, MODE[0] == 'r' ? "-" : order, n,
	       last - first, median(tot, n), quantile(tot, n, 1.0),
	       quantile(tot, n, 0.0), median(setup, n));
	for (int p = 0; p < nph; p++)
		printf(" %s=%.0f", ph[p], median(v[p], n));
	printf("\n");
	free(w);
	free(tot);
	free(setup);
	return 0;
}

static int run_mem(const char *devname, int peers, int vqps, int pairs,
		   int port)
{
	struct worker *w;
	char val[32];
	int n, failed;

	role = "mem";
#ifdef KRCORE
	n = 1 + peers;
	if (peers < 2 || n > 16)
		die("-K must be in [2, 15]");
	snprintf(val, sizeof(val), "%d", vqps);
	(void)pairs;
#else
	n = 1;
	snprintf(val, sizeof(val), "%d", pairs);
	(void)peers;
	(void)vqps;
#endif
	printf("# mem mode=%s processes=%d device=%s port=%d\n", MODE, n,
	       devname, port);
	fflush(stdout);
	w = coordinate("mem", n, devname, port, "-V", val, 0);
	failed = reap(w, n);
	if (failed)
		die("%d worker(s) failed", failed);
	printf("mem_summary %s\n", w[0].done + 5);
	free(w);
	return 0;
}

/* ---- a worker ---------------------------------------------------------------- */

struct peer {
	char ip[INET_ADDRSTRLEN];
	union ibv_gid gid;
	uint64_t addr;
	uint32_t rkey;
};

/* What a process holds: VmRSS, VmPin (pinned, i.e. registered memory:
 * every ib_umem pin is counted there), VmSize (mapped, including the QP
 * and CQ rings the kernel allocates for rxe and maps to user space, which
 * never show in VmRSS), and the machine's kernel memory that a QP costs
 * (VmallocUsed: rxe's rings; SUnreclaim: kernel objects), from
 * /proc/meminfo: machine-wide, so both ends of a link count. */
struct snap {
	long rss_kb, pin_kb, virt_kb, vmalloc_kb, slab_kb;
};

static void snap_now(struct snap *s)
{
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];

	memset(s, 0, sizeof(*s));
	if (!f)
		die("/proc/self/status: %s", strerror(errno));
	while (fgets(line, sizeof(line), f)) {
		sscanf(line, "VmRSS: %ld", &s->rss_kb);
		sscanf(line, "VmPin: %ld", &s->pin_kb);
		sscanf(line, "VmSize: %ld", &s->virt_kb);
	}
	fclose(f);
	f = fopen("/proc/meminfo", "r");
	if (!f)
		die("/proc/meminfo: %s", strerror(errno));
	while (fgets(line, sizeof(line), f)) {
		sscanf(line, "VmallocUsed: %ld", &s->vmalloc_kb);
		sscanf(line, "SUnreclaim: %ld", &s->slab_kb);
	}
	fclose(f);
}

/* Once the process's figures have been equal for 5 readings 10 ms apart
 * (at most 1 s: the library refills its QP pool on a background thread). */
static void snap_settled(struct snap *s)
{
	struct snap prev;
	double deadline = mono_us() + 1e6;
	int same = 0;

	snap_now(&prev);
	while (same < 5 && mono_us() < deadline) {
		struct timespec nap = { 0, 10 * 1000 * 1000 };

		nanosleep(&nap, NULL);
		snap_now(s);
		if (s->rss_kb == prev.rss_kb && s->pin_kb == prev.pin_kb &&
		    s->virt_kb == prev.virt_kb && s->vmalloc_kb == prev.vmalloc_kb)
			same++;
		else
			same = 0;
		prev = *s;
	}
	*s = prev;
}

/* Appends " NAME_rss_B=.. NAME_pin_B=.. NAME_virt_B=.. NAME_kern_B=.."
 * ((b - a) / div, in bytes; kern = VmallocUsed + SUnreclaim). */
static void put_delta(char *out, size_t cap, const char *name,
		      const struct snap *a, const struct snap *b, double div)
{
	size_t used = strlen(out);

	snprintf(out + used, cap - used, " %s_rss_B=%.0f %s_pin_B=%.0f "
		 "%s_virt_B=%.0f %s_kern_B=%.0f", name,
		 (b->rss_kb - a->rss_kb) * 1024.0 / div, name,
		 (b->pin_kb - a->pin_kb) * 1024.0 / div, name,
		 (b->virt_kb - a->virt_kb) * 1024.0 / div, name,
		 ((b->vmalloc_kb - a->vmalloc_kb) + (b->slab_kb - a->slab_kb)) *
			 1024.0 / div);
}

/* "go IP ADDR RKEY ..." for n workers. */
static void parse_go(char *line, struct peer *p, int n)
{
	char *save = NULL, *tok = strtok_r(line, " ", &save);

	if (!tok || strcmp(tok, "go"))
		die("expected go, got: %s", line);
	for (int i = 0; i < n; i++) {
		char *ip = strtok_r(NULL, " ", &save);
		char *a = strtok_r(NULL, " ", &save);
		char *k = strtok_r(NULL, " ", &save);

		if (!ip || !a || !k)
			die("a short go line");
		snprintf(p[i].ip, sizeof(p[i].ip), "%s", ip);
		p[i].gid = gid_of_ipv4(ip);
		p[i].addr = strtoull(a, NULL, 16);
		p[i].rkey = (uint32_t)strtoul(k, NULL, 16);
	}
}

/* Posts one checked 8-byte READ per QP in qps[0..n) (NULL entries
 * skipped) of the peers' pattern buffers (offset 8 x rank) and waits for
 * all of them. */
static void read_all(struct ibv_qp **qps, struct peer *pe, int n, int rank,
		     struct ibv_cq *cq, uint8_t *land, struct ibv_mr *mr)
{
	int posted = 0, rc;
	size_t off = (size_t)rank * 8 % MESH_BUF;


	for (int p = 0; p < n; p++) {
		if (!qps[p])
			continue;
		memset(land + 8 * p, 0, 8);
		land[8 * p] = (uint8_t)~pat((uint32_t)p + 100, off);
		if ((rc = post_read(qps[p], land + 8 * p, 8, mr->lkey,
				    pe[p].addr + off, pe[p].rkey, (uint64_t)p)))
			die("ibv_post_send(READ to rank %d): %s", p,
			    strerror(rc));
		posted++;
	}
	{
		int got = 0, seen[64] = { 0 };
		double deadline = mono_us() + POLL_TIMEOUT_US;
		unsigned spins = 0;

		while (got < posted) {
			struct ibv_wc wc;
			int k = ibv_poll_cq(cq, 1, &wc);

			if (k < 0)
				die("a first READ: ibv_poll_cq returned %d", k);
			if (k == 0) {
				if ((++spins & 255) == 0 && mono_us() > deadline)
					break;
				idle(spins);
				continue;
			}
			check_wc(&wc, "a first READ");
			if (wc.wr_id >= (uint64_t)n || wc.opcode != IBV_WC_RDMA_READ)
				die("a first READ: wr_id %llu opcode %d",
				    (unsigned long long)wc.wr_id, wc.opcode);
			for (int j = 0; j < 8; j++)
				if (land[8 * wc.wr_id + (size_t)j] !=
				    pat((uint32_t)wc.wr_id + 100, off + (size_t)j))
					die("the READ from rank %llu: byte %d is "
					    "wrong", (unsigned long long)wc.wr_id, j);
			seen[wc.wr_id] = 1;
			got++;
		}
		if (got < posted) {
			/* Say which QPs hang, and in what state. */
			for (int p = 0; p < n; p++) {
				struct ibv_qp_attr a;
				struct ibv_qp_init_attr ia;

				if (!qps[p] || seen[p])
					continue;
				memset(&a, 0, sizeof(a));
				rc = ibv_query_qp(qps[p], &a, IBV_QP_STATE |
							 IBV_QP_SQ_PSN |
							 IBV_QP_RQ_PSN |
							 IBV_QP_DEST_QPN, &ia);
				fprintf(stderr, "datapath-%s %s: the READ to rank "
					"%d did not complete: QP %u state %d "
					"(query rc %d) sq_psn %u rq_psn %u "
					"dest_qpn %u\n", MODE, role, p,
					qps[p]->qp_num, a.qp_state, rc, a.sq_psn,
					a.rq_psn, a.dest_qp_num);
			}
			die("%d of %d first READs completed within %.0f s", got,
			    posted, POLL_TIMEOUT_US / 1e6);
		}
	}
}

#ifndef KRCORE
struct xinfo {
	uint32_t magic, rank, qpn, psn;
	uint8_t gid[16];
};

/* The raw mesh after "go": fills the done line's phases. */
static void raw_mesh(struct dev *d, int rank, int n, int port, int lfd,
		     struct peer *pe, struct ibv_cq *cq, uint8_t *land,
		     struct ibv_mr *mr, struct ibv_qp **keep, char *out,
		     size_t cap)
{
	struct ibv_qp *qp[64] = { 0 };
	struct xinfo theirs[64];
	uint32_t psn[64];
	int fd[64];
	double t[6];

	t[0] = mono_us();
	for (int p = 0; p < n; p++) {
		if (p == rank)
			continue;
		qp[p] = create_rc(d, cq, cq, MEM_DEPTH, 1);
		to_init(d, qp[p]);
		psn[p] = rand_psn();
	}
	t[1] = mono_us();
	/* Connect to the higher ranks (send ours), accept the lower ones
	 * (read theirs, answer ours), then read the higher ranks' answers:
	 * no cycle of waits. */
	for (int p = rank + 1; p < n; p++) {
		struct xinfo x = { MAGIC, (uint32_t)rank, qp[p]->qp_num, psn[p], { 0 } };

		memcpy(x.gid, d->gid.raw, 16);
		fd[p] = tcp_connect(d->ip, pe[p].ip, port);
		send_all(fd[p], &x, sizeof(x), "our QP info");
	}
	for (int i = 0; i < rank; i++) {
		int f = tcp_accept(lfd), q;
		struct xinfo in, x = { MAGIC, (uint32_t)rank, 0, 0, { 0 } };

		recv_all(f, &in, sizeof(in), "a peer's QP info", 0);
		q = (int)in.rank;
		if (in.magic != MAGIC || q >= rank)
			die("a bad QP info (rank %u)", in.rank);
		fd[q] = f;
		theirs[q] = in;
		x.qpn = qp[q]->qp_num;
		x.psn = psn[q];
		memcpy(x.gid, d->gid.raw, 16);
		send_all(f, &x, sizeof(x), "our QP info");
	}
	for (int p = rank + 1; p < n; p++) {
		recv_all(fd[p], &theirs[p], sizeof(theirs[p]),
			 "a peer's QP info", 0);
		if (theirs[p].magic != MAGIC || theirs[p].rank != (uint32_t)p)
			die("a bad QP info (rank %u, expected %d)",
			    theirs[p].rank, p);
	}
	t[2] = mono_us();
	for (int p = 0; p < n; p++) {
		if (p == rank)
			continue;
		to_rtr(d, qp[p], theirs[p].qpn, theirs[p].psn,
		       (const union ibv_gid *)theirs[p].gid);
		to_rts(d, qp[p], psn[p]);
	}
	t[3] = mono_us();
	for (int p = 0; p < n; p++)
		if (p != rank)
			send_all(fd[p], "R", 1, "the barrier");
	for (int p = 0; p < n; p++) {
		char c;

		if (p == rank)
			continue;
		recv_all(fd[p], &c, 1, "the barrier", 0);
		if (c != 'R')
			die("a bad barrier byte");
	}
	t[4] = mono_us();
	read_all(qp, pe, n, rank, cq, land, mr);
	t[5] = mono_us();
	snprintf(out, cap, "start_mono_us=%.0f end_mono_us=%.0f total_us=%.0f "
		 "create_us=%.0f exchange_us=%.0f rtr_rts_us=%.0f "
		 "barrier_us=%.0f read_us=%.0f", t[0], t[5], t[5] - t[0],
		 t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3],
		 t[5] - t[4]);
	/* Kept until "exit" (the coordinator may count them). */
	for (int p = 0; p < n; p++) {
		if (p == rank)
			continue;
		close(fd[p]);
		keep[p] = qp[p];
	}
}

/* Raw memory: 2 x pairs RC QPs, connected to each other in pairs. */
static void raw_mem(struct dev *d, int pairs, struct ibv_cq *cq, uint8_t *land,
		    struct ibv_mr *mr, uint8_t *target, struct ibv_mr *tmr,
		    char *out, size_t cap)
{
	int nq = 2 * pairs, rc;
	struct ibv_qp **qp = calloc((size_t)nq, sizeof(*qp));
	struct snap s0, s1, s2, s3;

	if (!qp)
		die("calloc");
	snap_settled(&s0);
	for (int i = 0; i < nq; i++)
		qp[i] = create_rc(d, cq, cq, MEM_DEPTH, MEM_DEPTH);
	snap_settled(&s1);
	for (int i = 0; i < pairs; i++) {
		struct ibv_qp *a = qp[i], *b = qp[pairs + i];
		uint32_t pa = rand_psn(), pb = rand_psn();

		to_init(d, a);
		to_init(d, b);
		to_rtr(d, a, b->qp_num, pb, &d->gid);
		to_rtr(d, b, a->qp_num, pa, &d->gid);
		to_rts(d, a, pa);
		to_rts(d, b, pb);
	}
	snap_settled(&s2);
	for (int i = 0; i < nq; i++) {
		struct ibv_wc wc;

		memset(land, 0, 8);
		if ((rc = post_read(qp[i], land, 8, mr->lkey,
				    (uintptr_t)target + 8 * (size_t)(i % 512),
				    tmr->rkey, (uint64_t)i)))
			die("ibv_post_send(READ): %s", strerror(rc));
		poll1(cq, &wc, "a READ");
		if (memcmp(land, target + 8 * (size_t)(i % 512), 8))
			die("a READ's bytes are wrong");
	}
	snap_settled(&s3);
	snprintf(out, cap, "mode=raw qps=%d qp_depth=%d", nq, MEM_DEPTH);
	put_delta(out, cap, "qp_created", &s0, &s1, nq);
	put_delta(out, cap, "qp", &s0, &s2, nq);
	put_delta(out, cap, "qp_used", &s0, &s3, nq);
	/* A connection is two QPs here, as a krcore link is (both ends). */
	put_delta(out, cap, "conn", &s0, &s3, pairs);
	for (int i = 0; i < nq; i++)
		if ((rc = ibv_destroy_qp(qp[i])))
			die("ibv_destroy_qp: %s", strerror(rc));
	free(qp);
}
#else
/* The announcement a rank sends on its new VQP to a higher rank (ordered
 * mesh): its rank, 4 bytes. */
#define ANN_SLOT 64

struct kr_mesh_ctx {
	struct dev *d;
	struct ibv_cq *cq, *rcq;
	struct ibv_qp *bound;	/* ours, ANN receives posted */
	uint8_t *abuf;		/* ANN receive slots, then our announcement */
	struct ibv_mr *amr;
	struct peer *pe;
	struct ibv_qp *qp[64];
	double create, qc, qc_max, ann;
	int port;
};

static void kr_connect_to(struct kr_mesh_ctx *k, int p)
{
	double a = mono_us(), b, c;
	int rc;

	if (k->qp[p])
		die("a second VQP to rank %d", p);
	k->qp[p] = create_vqp(k->d, k->cq, k->rcq, MEM_DEPTH, 1);
	b = mono_us();
	if ((rc = qconnect(k->qp[p], k->pe[p].gid, k->port)))
		die("qconnect to rank %d (%s port %d): %s", p, k->pe[p].ip,
		    k->port, strerror(rc));
	c = mono_us();
	k->create += b - a;
	k->qc += c - b;
	if (c - b > k->qc_max)
		k->qc_max = c - b;
}

/* The krcore mesh after "go". order "natural": qconnect to every peer
 * (ranks r+1, r+2, ... mod n) at once, as fast as possible. order
 * "ordered": qconnect to the higher ranks, telling each (a 4-byte SEND on
 * the new VQP) that we did; qconnect to a lower rank only once its
 * announcement came (qpop_msgs): then the link it made is there and the
 * connect is a lookup, never a second handshake racing the first. */
static void kr_mesh(struct kr_mesh_ctx *k, int rank, int n, const char *order,
		    uint8_t *land, struct ibv_mr *mr, struct ibv_qp **keep,
		    char *out, size_t cap)
{
	double t[3], deadline;
	unsigned spins = 0;
	int rc;

	t[0] = mono_us();
	deadline = t[0] + 60e6;
	if (!strcmp(order, "natural")) {
		for (int j = 1; j < n; j++)
			kr_connect_to(k, (rank + j) % n);
	} else {
		int next = rank + 1, lower = 0;
		uint8_t *mine = k->abuf + (size_t)64 * ANN_SLOT;

		memcpy(mine, &rank, 4);
		while (next < n || lower < rank) {
			struct ibv_qp *src[8];
			struct ibv_wc wc[8];
			int did = 0, got;

			if (next < n) {
				double a;
				struct ibv_wc sw;

				kr_connect_to(k, next);
				a = mono_us();
				if ((rc = post_send_msg(k->qp[next], mine, 4,
							k->amr->lkey,
							1000 + (uint64_t)next)))
					die("ibv_post_send (announcement to rank "
					    "%d): %s", next, strerror(rc));
				poll1(k->cq, &sw, "the announcement");
				if (sw.wr_id != 1000 + (uint64_t)next)
					die("the announcement: wr_id %llu",
					    (unsigned long long)sw.wr_id);
				k->ann += mono_us() - a;
				next++;
				did = 1;
			}
			got = qpop_msgs(k->bound, 8, src, wc);
			if (got < 0)
				die("qpop_msgs: %s", strerror(-got));
			for (int i = 0; i < got; i++) {
				int q;

				if (is_close_report(&wc[i]))
					continue;
				check_wc(&wc[i], "an announcement");
				if (wc[i].wr_id >= 64 || wc[i].byte_len != 4)
					die("an announcement: wr_id %llu, %u bytes",
					    (unsigned long long)wc[i].wr_id,
					    wc[i].byte_len);
				memcpy(&q, k->abuf + wc[i].wr_id * ANN_SLOT, 4);
				if (q < 0 || q >= rank)
					die("an announcement from rank %d", q);
				kr_connect_to(k, q);
				lower++;
				post_recv_buf(k->bound, k->abuf +
					      wc[i].wr_id * ANN_SLOT, ANN_SLOT,
					      k->amr->lkey, wc[i].wr_id);
			}
			if (!did && !got) {
				if ((++spins & 255) == 0 && mono_us() > deadline)
					die("the ordered mesh: %d of %d lower "
					    "ranks announced within 60 s", lower,
					    rank);
				idle(spins);
			}
		}
	}
	t[1] = mono_us();
	read_all(k->qp, k->pe, n, rank, k->cq, land, mr);
	t[2] = mono_us();
	snprintf(out, cap, "start_mono_us=%.0f end_mono_us=%.0f total_us=%.0f "
		 "create_us=%.0f qconnect_us=%.0f qconnect_max_us=%.0f "
		 "announce_us=%.0f read_us=%.0f order=%s", t[0], t[2],
		 t[2] - t[0], k->create, k->qc, k->qc_max, k->ann, t[2] - t[1],
		 order);
	/* Kept until "exit" (the coordinator may count the links). */
	memcpy(keep, k->qp, sizeof(k->qp));
}

static struct ibv_qp *kr_connect_read(struct dev *d, struct ibv_cq *cq,
				      struct ibv_cq *rcq, struct peer *pe,
				      int p, int port, uint8_t *land,
				      struct ibv_mr *mr, int read)
{
	struct ibv_qp *qp = create_vqp(d, cq, rcq, MEM_DEPTH, MEM_DEPTH);
	struct ibv_qp *one[64] = { 0 };
	int rc;

	if ((rc = qconnect(qp, pe[p].gid, port)))
		die("qconnect to rank %d: %s", p, strerror(rc));
	if (read) {
		one[p] = qp;
		read_all(one, pe, p + 1, 0, cq, land, mr);
	}
	return qp;
}

/* krcore memory: the runtime and a first link, K-1 more links, VQPS
 * VQPs on one link. */
static void kr_mem(struct dev *d, int n, int vqps, int port, struct peer *pe,
		   struct ibv_cq *cq, struct ibv_cq *rcq, uint8_t *land,
		   struct ibv_mr *mr, char *out, size_t cap)
{
	struct ibv_qp **v = calloc((size_t)vqps, sizeof(*v)), *first,
		*lk[64] = { 0 };
	struct snap s0, s1, s2, s3, s4, s5;
	int links = n - 2, rc;

	if (!v)
		die("calloc");
	snap_settled(&s0);
	first = kr_connect_read(d, cq, rcq, pe, 1, port, land, mr, 1);
	snap_settled(&s1);
	for (int p = 2; p < n; p++)
		lk[p] = kr_connect_read(d, cq, rcq, pe, p, port, land, mr, 1);
	snap_settled(&s2);
	for (int i = 0; i < vqps; i++)
		v[i] = kr_connect_read(d, cq, rcq, pe, 1, port, land, mr, 0);
	snap_settled(&s3);
	for (int i = 0; i < vqps; i++) {
		struct ibv_qp *one[2] = { NULL, v[i] };

		read_all(one, pe, 2, 0, cq, land, mr);
	}
	snap_settled(&s4);
	for (int i = 0; i < vqps; i++)
		if ((rc = ibv_destroy_qp(v[i])))
			die("ibv_destroy_qp: %s", strerror(rc));
	snap_settled(&s5);
	snprintf(out, cap, "mode=krcore vqps=%d links=%d vqp_depth=%d "
		 "rss_after_destroy_kb=%ld", vqps, links, MEM_DEPTH, s5.rss_kb);
	put_delta(out, cap, "runtime", &s0, &s1, 1);
	put_delta(out, cap, "link", &s1, &s2, links);
	put_delta(out, cap, "vqp", &s2, &s3, vqps);
	put_delta(out, cap, "vqp_used", &s2, &s4, vqps);
	for (int p = 2; p < n; p++)
		if ((rc = ibv_destroy_qp(lk[p])))
			die("ibv_destroy_qp: %s", strerror(rc));
	if ((rc = ibv_destroy_qp(first)))
		die("ibv_destroy_qp: %s", strerror(rc));
	free(v);
}
#endif

/* A worker: setup, "ready", wait for "go", its part, "done", wait for
 * "exit". Kinds: mesh (all-to-all), peer (a bound process that others
 * connect to, mem), mem (the measurer, rank 0). */
static int run_worker(const char *devname, int rank, int n, const char *kind,
		      int port, int val, const char *order)
{
	struct dev d;
	struct ibv_cq *cq, *rcq;
	struct ibv_mr *tmr, *lmr;
	uint8_t *target, *land;
	struct lines in = { 0, { 0 }, 0 };
	struct peer pe[64];
	char line[8192], out[2048] = "";
	struct ibv_qp *keep[64] = { 0 };
	double t0, setup;
	int lfd = -1, rc;
	static char rolebuf[32];
#ifdef KRCORE
	struct ibv_qp *bound = NULL;
	struct kr_mesh_ctx k;
#else
	(void)order;
#endif

	snprintf(rolebuf, sizeof(rolebuf), "%s worker %d", kind, rank);
	role = rolebuf;
	use_counter = 0;	/* ticks() in ns: no calibration needed */
	ticks_per_us = 1e3;
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (n > 64)
		die("too many workers");
	rng_state = (uint32_t)getpid() * 2654435761u | 1;
	t0 = mono_us();
	open_dev(&d, devname, rank + 1);
#ifdef KRCORE
	check_env(rank + 1);
#endif
	cq = make_cq(&d, 4 * MEM_DEPTH + 2 * n);
	rcq = make_cq(&d, 64);	/* the VQPs' receive CQ (krcore) */
	(void)rcq;
	tmr = reg(&d, &target, MESH_BUF, ACCESS_RW);
	fill(target, MESH_BUF, (uint32_t)rank + 100);
	lmr = reg(&d, &land, 8 * 64, IBV_ACCESS_LOCAL_WRITE);
	if (!strcmp(kind, "mesh")) {
#ifdef KRCORE
		memset(&k, 0, sizeof(k));
		k.d = &d;
		k.cq = cq;
		k.rcq = rcq;
		k.pe = pe;
		k.port = port;
		k.amr = reg(&d, &k.abuf, (size_t)65 * ANN_SLOT,
			    IBV_ACCESS_LOCAL_WRITE);
		bound = k.bound = create_vqp(&d, cq, rcq, MEM_DEPTH, 64);
		for (int i = 0; i < n && i < 64; i++)
			post_recv_buf(bound, k.abuf + (size_t)i * ANN_SLOT,
				      ANN_SLOT, k.amr->lkey, (uint64_t)i);
		if ((rc = qbind(bound, d.gid, port)))
			die("qbind(%s, port %d): %s", d.ip, port, strerror(rc));
#else
		lfd = tcp_listen(d.ip, port);
#endif
	} else if (!strcmp(kind, "peer")) {
#ifdef KRCORE
		bound = create_vqp(&d, cq, rcq, MEM_DEPTH, 1);
		if ((rc = qbind(bound, d.gid, port)))
			die("qbind(%s, port %d): %s", d.ip, port, strerror(rc));
#endif
	}
	setup = mono_us() - t0;
	printf("ready rank=%d ip=%s addr=%llx rkey=%x setup_us=%.0f\n", rank,
	       d.ip, (unsigned long long)(uintptr_t)target, tmr->rkey, setup);
	read_line(&in, line, sizeof(line), "the go line");
	parse_go(line, pe, n);
	if (!strcmp(kind, "mesh")) {
#ifdef KRCORE
		kr_mesh(&k, rank, n, order, land, lmr, keep, out, sizeof(out));
#else
		raw_mesh(&d, rank, n, port, lfd, pe, cq, land, lmr, keep, out,
			 sizeof(out));
#endif
	} else if (!strcmp(kind, "mem")) {
#ifdef KRCORE
		kr_mem(&d, n, val, port, pe, cq, rcq, land, lmr, out,
		       sizeof(out));
#else
		raw_mem(&d, val, cq, land, lmr, target, tmr, out, sizeof(out));
#endif
	}
	printf("done rank=%d %s\n", rank, out);
	read_line(&in, line, sizeof(line), "the exit line");
	if (strcmp(line, "exit"))
		die("expected exit, got: %s", line);
	for (int p = 0; p < n; p++)
		if (keep[p] && (rc = ibv_destroy_qp(keep[p])))
			die("ibv_destroy_qp: %s", strerror(rc));
#ifdef KRCORE
	if (bound && (rc = ibv_destroy_qp(bound)))
		die("ibv_destroy_qp (bound): %s", strerror(rc));
#endif
	if (lfd >= 0)
		close(lfd);
	return 0;
}

/* ---- main ---------------------------------------------------------------------- */

static void usage(void)
{
	fprintf(stderr,
		"usage: datapath%s server [-d DEV] [-g GID_INDEX] [-p PORT]\n"
		"       datapath%s client SERVER_IP [-d DEV] [-g GID_INDEX] "
		"[-p PORT] [-r READS] [-n TPUT_OPS] [-w WINDOW] [-e ECHOS] "
		"[-E LARGE_ECHOS] [-t tsc|clock] [-y SPINS] [-T IN,OUT[,first]]\n"
		"       datapath%s mesh [-N PROCS] [-p PORT] [-d DEV] [-Q] "
		"[-o natural|ordered]\n"
		"       datapath%s mem [-K PEERS] [-V VQPS] [-q RAW_QP_PAIRS] "
		"[-p PORT] [-d DEV]\n",
		MODE[0] == 'k' ? "-krcore" : "", MODE[0] == 'k' ? "-krcore" : "",
		MODE[0] == 'k' ? "-krcore" : "", MODE[0] == 'k' ? "-krcore" : "");
	exit(2);
}

static int parse_int(const char *s, int lo, int hi, const char *what)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || end == s || v < lo || v > hi) {
		fprintf(stderr, "datapath: %s must be an integer in [%d, %d], "
			"not '%s'\n", what, lo, hi, s);
		exit(2);
	}
	return (int)v;
}

int main(int argc, char **argv)
{
	const char *devname = getenv("CT_DEVICE") && *getenv("CT_DEVICE") ?
				      getenv("CT_DEVICE") : "rxe0";
	const char *cmd, *server = NULL, *kind = "mesh", *order = "natural";
	int gid_idx = -1, port = 18800, reads = 2000, tput_ops = 4000,
	    window = 32, echos = 500, large_echos = 200, procs = 8, peers = 8,
	    vqps = 1000, pairs = 100, rank = -1, count = 0, val = 0, opt;

#if defined(__x86_64__) || defined(__aarch64__)
	use_counter = 1;
#endif
	if (argc < 2)
		usage();
	cmd = argv[1];
	optind = 2;
	if (!strcmp(cmd, "client")) {
		if (argc < 3 || argv[2][0] == '-')
			usage();
		server = argv[2];
		optind = 3;
	}
	while ((opt = getopt(argc, argv, "d:g:p:r:n:w:e:E:t:N:K:V:q:R:k:Qy:o:T:")) != -1) {
		switch (opt) {
		case 'd': devname = optarg; break;
		case 'g': gid_idx = parse_int(optarg, 0, 65535, "-g"); break;
		case 'p': port = parse_int(optarg, 1, 65000, "-p"); break;
		case 'r': reads = parse_int(optarg, 1, 10000000, "-r"); break;
		case 'n': tput_ops = parse_int(optarg, 4, 10000000, "-n"); break;
		case 'w': window = parse_int(optarg, 1, MAX_WINDOW, "-w"); break;
		case 'e': echos = parse_int(optarg, 1, 1000000, "-e"); break;
		case 'E': large_echos = parse_int(optarg, 1, 1000000, "-E"); break;
		case 't':
			if (!strcmp(optarg, "clock"))
				use_counter = 0;
			else if (strcmp(optarg, "tsc"))
				usage();
			break;
		case 'N': procs = parse_int(optarg, 1, 64, "-N"); break;
		case 'K': peers = parse_int(optarg, 2, 15, "-K"); break;
		case 'V': vqps = val = parse_int(optarg, 1, 1000000, "-V"); break;
		case 'q': pairs = parse_int(optarg, 1, 100000, "-q"); break;
		case 'R': rank = parse_int(optarg, 0, 63, "-R"); break;
		case 'k': kind = optarg; break;
		case 'Q': count = 1; break;
		case 'o':
			if (strcmp(optarg, "natural") && strcmp(optarg, "ordered"))
				usage();
			order = optarg;
			break;
		case 'y': yield_spins = parse_int(optarg, 0, 1 << 30, "-y"); break;
		case 'T': turns_open(optarg); break;
		default: usage();
		}
	}
	if (optind != argc)
		usage();
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (!strcmp(cmd, "server"))
		return run_server(devname, gid_idx < 0 ? 1 : gid_idx, port);
	if (!strcmp(cmd, "client"))
		return run_client(devname, gid_idx < 0 ? 2 : gid_idx, server,
				  port, reads, tput_ops, window, echos,
				  large_echos);
	if (!strcmp(cmd, "mesh"))
		return run_mesh(devname, procs, port, count, order);
	if (!strcmp(cmd, "mem"))
		return run_mem(devname, peers, vqps, pairs, port);
	if (!strcmp(cmd, "worker")) {
		if (rank < 0 || rank >= procs || (strcmp(kind, "mesh") &&
		    strcmp(kind, "peer") && strcmp(kind, "mem")))
			usage();
		return run_worker(devname, rank, procs, kind, port, val, order);
	}
	usage();
	return 2;
}
