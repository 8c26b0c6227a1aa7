/*
 * connect: what connecting to a peer costs, with raw verbs (the reference)
 * and, built with -DKRCORE against libkrcore, with krcore's virtual QPs
 * (qbind / qconnect, issue 7). The raw mode is described first; the krcore
 * mode ("connect-krcore") after it.
 *
 *   connect -s [-d DEV] [-g GID_INDEX] [-p TCP_PORT] [-k CLIENTS]
 *   connect -c SERVER_IP [-m steady|fresh] [-d DEV] [-g GID_INDEX]
 *           [-p TCP_PORT] [-n ROUNDS] [-r READS] [-t tsc|clock]
 *
 * Server (-s): opens DEV (default $CT_DEVICE, else rxe0), allocates a PD, a
 * CQ and a 4 KiB buffer filled with a known pattern, registered with remote
 * read access, and listens on TCP at the IPv4 address of its GID
 * (GID_INDEX, default 1; a RoCE v2 IPv4-mapped GID) and TCP_PORT (default
 * 18777). When it listens it prints one line on stdout:
 *
 *   connect: server listening on A.B.C.D:PORT ...
 *
 * It accepts CLIENTS (default 1) clients, one after the other, and serves
 * each one's rounds one after the other; for
 * each round, as a real server accepting a new client must, it creates an
 * RC QP, moves it to INIT, RTR (towards the client's QP) and RTS, then
 * answers with its QPN, PSN, GID, buffer address and rkey (and the time
 * its own phases took). When the client says the round is over it destroys
 * that QP and acknowledges. It exits 0 when the last client closes the
 * connection between rounds.
 *
 * Client (-c): opens DEV, PD, one CQ (shared by every round, as a real
 * program creates its CQ once) and an 8-byte landing buffer, connects over
 * TCP to SERVER_IP:PORT from the IPv4 address of its own GID (GID_INDEX,
 * default 2), then for each of ROUNDS (default 50) times, with the CPU's
 * time-stamp counter calibrated against CLOCK_MONOTONIC (as bench/reg_mr.c
 * does; -t clock forces clock_gettime), the whole cost of connecting and
 * completing a first 8-byte RDMA READ:
 *
 *   create    ibv_create_qp (RC, send/recv depth 16, one SGE)
 *   init      ibv_modify_qp -> INIT
 *   exchange  send (QPN, PSN, GID) over the already open TCP connection
 *             and wait for the server's (QPN, PSN, GID, addr, rkey): this
 *             includes the server's create + INIT + RTR + RTS (printed
 *             apart as srv_*) and the TCP round trip
 *   rtr       ibv_modify_qp -> RTR
 *   rts       ibv_modify_qp -> RTS
 *   read      post one signaled 8-byte RDMA READ and busy-poll its
 *             completion
 *   read2     (not in the total) a second READ on the same QP: the steady
 *             READ of the round, in the same conditions as its first
 *
 * The 8 bytes read (from an offset that changes every round) are checked
 * against the pattern; the landing buffer holds their complement before
 * the READ. Both sides destroy the round's QP before the next round starts
 * (destroy_us is the client's ibv_destroy_qp, not part of the total).
 * Then one more QP is connected the same way (untimed) and READS (default
 * 1000) 8-byte READs are timed one by one on it, each checked, after 100
 * untimed warm-up READs: the steady READ latency.
 *
 * Output (stdout): a header line "# connect ...", one line per round
 *
 *   round N create_us=.. init_us=.. exchange_us=.. rtr_us=.. rts_us=..
 *     read_us=.. total_us=.. srv_create_us=.. srv_init_us=.. srv_rtr_us=..
 *     srv_rts_us=.. wire_us=.. destroy_us=.. read2_us=.. cost_us=..
 *
 * (wire_us: exchange minus the server's four phases, i.e. the TCP round
 * trip and the scheduling around it), a line "steady ..." with the READ
 * latency's median, p10, p90 and mean, and the summary line of medians:
 *
 *   connect_raw_us=M steady_read_us=S connect_minus_read_us=M-S
 *     connect_minus_read2_us=C (the median over rounds of cost_us =
 *     total_us - read2_us)
 *     create_us=.. init_us=.. exchange_us=.. rtr_us=.. rts_us=..
 *     first_read_us=.. srv_create_us=.. ... wire_us=.. rounds=..
 *
 * -m fresh: ROUNDS new processes, spawned one after the other (the
 * server needs -k ROUNDS): each opens the device, PD, CQ, MR, connects
 * over TCP and makes one RC connection as above, and its round is timed
 * on CLOCK_MONOTONIC from the parent's posix_spawn to its first READ's
 * completion (what a user sees of a new program). Lines "fresh N
 * exec_us=..", then "fresh_process exec_to_read_us=MEDIAN rounds=N".
 * The krcore cold mode prints the same line for its kind=first processes.
 *
 * Every verbs and socket call is checked; any failure prints what failed
 * on stderr and exits 1 (2 for a usage error). bench/connect-compare.sh
 * runs both roles on two emulated nodes of the Soft-RoCE VM.
 *
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/connect.c -libverbs \
 *      -o target/bench/bin/connect
 *
 * krcore mode (-DKRCORE; every verb goes through libkrcore):
 *
 *   connect-krcore -s [-d DEV] [-g GID_INDEX] [-p PORT]
 *   connect-krcore -c SERVER_IP [-m warm|cold] [-d DEV] [-g GID_INDEX]
 *                  [-p PORT] [-n ROUNDS] [-r READS] [-t tsc|clock]
 *
 * Both need KRCORE_META (a running krcore-meta) and, for the client,
 * KRCORE_GID_INDEX equal to GID_INDEX (checked: the library reads it).
 * Server (-s): the same pattern buffer, a VQP bound with qbind at (the GID
 * at GID_INDEX, default 1; PORT, default 18777); it prints
 *
 *   connect: server bound on A.B.C.D port PORT ...
 *
 * and answers every 1-byte request message ('M', through qpop_msgs and an
 * ibv_post_send on its src_qp) with its buffer's address and rkey, until
 * SIGTERM or SIGINT (exit 0). Client (-c, GID_INDEX default 2): a control
 * VQP qconnects to (SERVER_IP's GID, PORT) (this process's first contact,
 * printed as first_contact_us), asks for the address and rkey (once per
 * process, outside every timed part, as a real program learns them once)
 * and READs once. Then per round:
 *
 *   create    ibv_create_qp(KRCORE_VQP)
 *   qconnect  qconnect to (SERVER_IP's GID, PORT)
 *   post      ibv_post_send of one signaled 8-byte READ (the library's
 *             pre-checks, including the peer's MR table on a miss)
 *   poll      busy-poll its completion (read_us = post + poll)
 *   read2     (not in the total) a second READ on the VQP, as in raw mode
 *   destroy   ibv_destroy_qp (not in the total)
 *
 * total_us is create + qconnect + read (the span of raw's total_us);
 * from_qconnect_us leaves the create out. The 8 bytes are checked as in
 * the raw mode.
 *   -m warm (default): ROUNDS rounds in this process, over the link the
 *      control VQP made: DCCache hit, live link.
 *   -m cold: 2 x ROUNDS rounds, each in a fresh process spawned from this
 *      one (-X, internal), which has never talked to the server; it gets
 *      the address and rkey from its parent. The kinds alternate:
 *      kind=cold: the child's library is up first (untimed: a qconnect to
 *      the unbound PORT+1, ECONNREFUSED, starts its runtime and meta
 *      client without caching anything about the server; prewarm_us), so
 *      the round pays the lookup, the link handshake and the peer's MR
 *      table; kind=first: the round's qconnect is the process's first
 *      extended verb and pays the runtime's start and the meta-server
 *      bootstrap too; with -b SERVER2_IP (a second qbind server on PORT +
 *      2), kind=peer: the process has made a whole first contact with
 *      that server first (untimed: qconnect, a message, a READ), so its
 *      library and the code of that path are warm, and the round is its
 *      first contact with a new peer (summary line "new_peer ...").
 * Then READS steady 8-byte READs on the control VQP (after 100 warm-up
 * READs). Output: round lines ("round N" warm, "cold N kind=..." cold),
 * the "steady" line, and the summary of medians
 *
 *   connect_krcore_us=M steady_read_us=S connect_minus_read_us=M-S
 *     connect_minus_read2_us=C
 *     create_us=.. qconnect_us=.. post_us=.. poll_us=.. first_read_us=..
 *     from_qconnect_us=.. destroy_us=.. [prewarm_us=..] rounds=..
 *
 * (cold: of kind=cold; a second line "first_verb connect_krcore_us=..."
 * has kind=first). bench/connect-compare.sh starts krcore-meta and runs
 * both modes side by side.
 *
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror -DKRCORE -I include \
 *      bench/connect.c -L target/release -lkrcore \
 *      -Wl,-rpath,$PWD/target/release -o target/bench/bin/connect-krcore
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "timer.h"
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#ifdef KRCORE
#include <krcore.h>
#endif

#define BUF_SIZE 4096
#define READ_LEN 8
#define QP_DEPTH 16
#define WARMUP_READS 100
#define POLL_TIMEOUT_US 5000000.0
#define WIRE_MAGIC 0x4b52434eu /* "KRCN" */

static const char *role = "connect";

static void die(const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	fprintf(stderr, "connect %s: ", role);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	exit(1);
}

#include "rc.h"

/* ---- timer (as bench/reg_mr.c) --------------------------------------- */

/* q in [0,1] of n values (v is left untouched). */
static double quantile(const double *v, int n, double q)
{
	double *c = malloc((size_t)n * sizeof(*c)), r;

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

/* ---- the pattern in the server's buffer ------------------------------ */

static uint8_t pat(size_t i)
{
	uint32_t x = 0x9e3779b1u + (uint32_t)i * 0x85ebca6bu;

	x ^= x >> 13;
	x *= 0xc2b2ae35u;
	x ^= x >> 16;
	return (uint8_t)x;
}

/* ---- device ---------------------------------------------------------- */

struct dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	uint8_t *buf;
	union ibv_gid gid;
	struct rc_port rp;
};

static void open_dev(struct dev *d, const char *name, int gid_idx, int access)
{
	memset(d, 0, sizeof(*d));
	d->ctx = rc_open(name, gid_idx, &d->gid, &d->rp);
	d->pd = ibv_alloc_pd(d->ctx);
	if (!d->pd)
		die("ibv_alloc_pd: %s", strerror(errno));
	d->cq = ibv_create_cq(d->ctx, 2 * QP_DEPTH, NULL, NULL, 0);
	if (!d->cq)
		die("ibv_create_cq: %s", strerror(errno));
	if (posix_memalign((void **)&d->buf, BUF_SIZE, BUF_SIZE))
		die("posix_memalign");
	memset(d->buf, 0, BUF_SIZE);
	d->mr = ibv_reg_mr(d->pd, d->buf, BUF_SIZE, access);
	if (!d->mr)
		die("ibv_reg_mr: %s", strerror(errno));
}

static void close_dev(struct dev *d)
{
	int rc;

	if ((rc = ibv_dereg_mr(d->mr)))
		die("ibv_dereg_mr: %s", strerror(rc));
	if ((rc = ibv_destroy_cq(d->cq)))
		die("ibv_destroy_cq: %s", strerror(rc));
	if ((rc = ibv_dealloc_pd(d->pd))) {
#ifdef KRCORE
		/* libkrcore keeps the runtime it started for the PD's VQPs
		 * (service endpoint, links, registered memory) after the last
		 * VQP is destroyed, so the PD cannot go: say so (not in the
		 * cold children, which would say it every round), leave the PD
		 * and the device open. */
		if (rc == EBUSY) {
			if (strcmp(role, "cold child"))
				fprintf(stderr, "connect %s: note: ibv_dealloc_pd "
					"fails with EBUSY after every VQP was "
					"destroyed (libkrcore keeps the PD's "
					"VQP runtime); PD and device left "
					"open\n", role);
			free(d->buf);
			return;
		}
#endif
		die("ibv_dealloc_pd: %s", strerror(rc));
	}
	if ((rc = ibv_close_device(d->ctx)))
		die("ibv_close_device: %s", strerror(rc));
	free(d->buf);
}

/* ---- client helpers (both modes) -------------------------------------- */

struct client {
	struct dev d;
	int fd;
	uint64_t raddr;
	uint32_t rkey;
	double read_mono;	/* CLOCK_MONOTONIC (us) when the first READ completed */
#ifdef KRCORE
	struct ibv_cq *rcq;	/* receive CQ of the VQPs (the MR answer) */
	struct ibv_qp *ctl;	/* the control VQP: MR request, steady READs */
	union ibv_gid sgid;	/* the server's (GID, port) */
	int sport;
#endif
};

/* Busy-polls one successful completion of cq into *wc. */
static void poll_wc(struct ibv_cq *cq, struct ibv_wc *wc, const char *what)
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
		if ((++spins & 1023) == 0 && ticks() - start > limit)
			die("%s: no completion after %.0f s", what,
			    POLL_TIMEOUT_US / 1e6);
	}
	if (wc->status != IBV_WC_SUCCESS)
		die("%s: completion status %s (%d), vendor_err %#x", what,
		    ibv_wc_status_str(wc->status), wc->status, wc->vendor_err);
}

/* Busy-polls one completion: the READ wr_id, successful. */
static void poll_read(struct client *c, uint64_t wr_id, const char *what)
{
	struct ibv_wc wc;

	poll_wc(c->d.cq, &wc, what);
	if (wc.wr_id != wr_id || wc.opcode != IBV_WC_RDMA_READ)
		die("%s: completion wr_id %llu opcode %d, expected %llu "
		    "RDMA_READ", what, (unsigned long long)wc.wr_id, wc.opcode,
		    (unsigned long long)wr_id);
}

static void prep_read(struct client *c, size_t off)
{
	for (size_t i = 0; i < READ_LEN; i++)
		c->d.buf[i] = (uint8_t)~pat(off + i);
}

static void post_read(struct client *c, struct ibv_qp *qp, uint64_t wr_id,
		      size_t off, const char *what)
{
	struct ibv_sge sge;
	struct ibv_send_wr wr, *bad = NULL;
	int rc;

	sge.addr = (uintptr_t)c->d.buf;
	sge.length = READ_LEN;
	sge.lkey = c->d.mr->lkey;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_READ;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = c->raddr + off;
	wr.wr.rdma.rkey = c->rkey;
	if ((rc = ibv_post_send(qp, &wr, &bad)))
		die("%s: ibv_post_send(RDMA_READ): %s", what, strerror(rc));
}

static void check_read(struct client *c, size_t off, const char *what)
{
	for (size_t i = 0; i < READ_LEN; i++)
		if (c->d.buf[i] != pat(off + i))
			die("%s: byte %zu read from offset %zu is 0x%02x, "
			    "expected 0x%02x", what, i, off, c->d.buf[i],
			    pat(off + i));
}

/* The round's second 8-byte READ (checked), right after its first on the
 * same QP: the steady READ its connect cost is measured against, in the
 * same conditions (caches, scheduling) as the round's own first READ.
 * *us (when not NULL) gets post to completion. */
static void second_read(struct client *c, struct ibv_qp *qp, int round,
			size_t off, double *us, const char *what)
{
	size_t off2 = (off + READ_LEN) % BUF_SIZE;
	uint64_t t0, t1;

	prep_read(c, off2);
	t0 = ticks();
	post_read(c, qp, (uint64_t)round + (1ull << 32), off2, what);
	poll_read(c, (uint64_t)round + (1ull << 32), what);
	t1 = ticks();
	check_read(c, off2, what);
	if (us)
		*us = us_of(t0, t1);
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

/* READS 8-byte READs timed one by one on the established qp, each
 * checked, after WARMUP_READS untimed ones. */
static void steady_reads(struct client *c, struct ibv_qp *qp, int reads,
			 double *steady)
{
	for (int i = 0; i < WARMUP_READS + reads; i++) {
		size_t off = ((size_t)i * READ_LEN) % BUF_SIZE;
		uint64_t t0, t1;

		prep_read(c, off);
		t0 = ticks();
		post_read(c, qp, (uint64_t)i, off, "steady READ");
		poll_read(c, (uint64_t)i, "steady READ");
		t1 = ticks();
		check_read(c, off, "steady READ");
		if (i >= WARMUP_READS)
			steady[i - WARMUP_READS] = us_of(t0, t1);
	}
}

/* The "steady" line; returns the median. */
static double print_steady(const double *steady, int reads)
{
	double s_med = median(steady, reads), mean = 0;

	for (int i = 0; i < reads; i++)
		mean += steady[i];
	mean /= reads;
	printf("steady reads=%d median_us=%.1f p10_us=%.1f p90_us=%.1f "
	       "mean_us=%.1f\n", reads, s_med, quantile(steady, reads, 0.1),
	       quantile(steady, reads, 0.9), mean);
	return s_med;
}

/* ---- fresh processes (both modes) --------------------------------------- */

#define CHILD_TIMEOUT_MS 60000
extern char **environ;

/* This program's own path, for spawning fresh copies of it. */
static void self_path(char *self, size_t cap)
{
	ssize_t k = readlink("/proc/self/exe", self, cap - 1);

	if (k <= 0)
		die("readlink(/proc/self/exe): %s", strerror(errno));
	self[k] = 0;
}

/* Spawns argv[0] with argv, its stdout into out (NUL-terminated), and
 * waits (bounded) until it exits 0. *exec0 is CLOCK_MONOTONIC (us) right
 * before the spawn: the child's "exec" instant. */
static void spawn_capture(char **argv, char *out, size_t cap,
			  const char *what, double *exec0)
{
	posix_spawn_file_actions_t fa;
	struct pollfd pfd;
	size_t used = 0;
	pid_t pid;
	int p[2], st, rc;

	if (pipe2(p, O_CLOEXEC))
		die("pipe2: %s", strerror(errno));
	if ((rc = posix_spawn_file_actions_init(&fa)) ||
	    (rc = posix_spawn_file_actions_adddup2(&fa, p[1], 1)))
		die("posix_spawn_file_actions: %s", strerror(rc));
	*exec0 = mono_us();
	if ((rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ)))
		die("posix_spawn(%s): %s", argv[0], strerror(rc));
	posix_spawn_file_actions_destroy(&fa);
	close(p[1]);
	pfd.fd = p[0];
	pfd.events = POLLIN;
	for (;;) {
		ssize_t n;

		rc = poll(&pfd, 1, CHILD_TIMEOUT_MS);
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc == 0) {
			kill(pid, SIGKILL);
			die("%s: the child did not finish within %d s", what,
			    CHILD_TIMEOUT_MS / 1000);
		}
		n = read(p[0], out + used, cap - 1 - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die("reading the child's output: %s", strerror(errno));
		if (n == 0)
			break;
		used += (size_t)n;
		if (used == cap - 1)
			die("the child's output is too long");
	}
	out[used] = 0;
	close(p[0]);
	if (waitpid(pid, &st, 0) != pid)
		die("waitpid: %s", strerror(errno));
	if (!WIFEXITED(st) || WEXITSTATUS(st))
		die("%s: the child failed (status %#x; its error is above)",
		    what, st);
}

/* The child's "read_mono_us=": CLOCK_MONOTONIC (us, shared by every
 * process) when its first READ completed. */
static double read_mono_of(const char *out, const char *what)
{
	const char *k = strstr(out, "read_mono_us=");
	double v;

	if (!k || sscanf(k, "read_mono_us=%lf", &v) != 1)
		die("%s: the child printed no read_mono_us: %s", what, out);
	return v;
}

#ifndef KRCORE

/* ---- raw verbs -------------------------------------------------------- */

static uint32_t rng_state;

static uint32_t rand_psn(void)
{
	return rc_rand_psn(&rng_state);
}

/* ---- QP steps -------------------------------------------------------- */

static struct ibv_qp *create_qp(struct dev *d)
{
	struct ibv_qp_init_attr ia;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = d->cq;
	ia.recv_cq = d->cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = QP_DEPTH;
	ia.cap.max_recv_wr = QP_DEPTH;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	return ibv_create_qp(d->pd, &ia);
}

/* ---- the TCP exchange ------------------------------------------------ */

enum { MSG_HELLO = 1, MSG_REPLY, MSG_DONE, MSG_DONE_ACK };

/* Host order in memory; big-endian on the wire (wire_put/wire_get). */
struct msg {
	uint32_t magic;
	uint32_t type;
	uint32_t qpn;
	uint32_t psn;
	uint32_t rkey;
	uint32_t pad;
	uint64_t addr;
	uint64_t srv_ns[4]; /* REPLY: server's create, init, rtr, rts */
	uint8_t gid[16];
};

static void wire_swap(struct msg *m, int to_wire)
{
	uint32_t *w32[] = { &m->magic, &m->type, &m->qpn, &m->psn, &m->rkey,
			    &m->pad };
	uint64_t *w64[] = { &m->addr, &m->srv_ns[0], &m->srv_ns[1],
			    &m->srv_ns[2], &m->srv_ns[3] };

	for (size_t i = 0; i < sizeof(w32) / sizeof(w32[0]); i++)
		*w32[i] = to_wire ? htobe32(*w32[i]) : be32toh(*w32[i]);
	for (size_t i = 0; i < sizeof(w64) / sizeof(w64[0]); i++)
		*w64[i] = to_wire ? htobe64(*w64[i]) : be64toh(*w64[i]);
}

static void send_msg(int fd, const struct msg *in, const char *what)
{
	struct msg m = *in;
	const char *p = (const char *)&m;
	size_t left = sizeof(m);

	m.magic = WIRE_MAGIC;
	wire_swap(&m, 1);
	while (left) {
		ssize_t n = send(fd, p, left, MSG_NOSIGNAL);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			die("sending %s: %s", what, n < 0 ? strerror(errno) :
							     "connection closed");
		p += n;
		left -= (size_t)n;
	}
}

/* 1: a message of the expected type; 0: the peer closed the connection
 * before the first byte (allowed only when eof_ok). */
static int recv_msg(int fd, struct msg *m, uint32_t type, const char *what,
		    int eof_ok)
{
	char *p = (char *)m;
	size_t got = 0;

	while (got < sizeof(*m)) {
		ssize_t n = recv(fd, p + got, sizeof(*m) - got, 0);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die("receiving %s: %s", what, strerror(errno));
		if (n == 0) {
			if (got == 0 && eof_ok)
				return 0;
			die("receiving %s: the peer closed the connection%s",
			    what, got ? " in the middle of a message" :
					" (see its own error output)");
		}
		got += (size_t)n;
	}
	wire_swap(m, 0);
	if (m->magic != WIRE_MAGIC)
		die("receiving %s: bad magic %#x (not a connect peer?)", what,
		    m->magic);
	if (m->type != type)
		die("receiving %s: message type %u, expected %u", what, m->type,
		    type);
	return 1;
}

static void set_nodelay(int fd)
{
	int one = 1;

	if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)))
		die("setsockopt(TCP_NODELAY): %s", strerror(errno));
}

/* ---- server ---------------------------------------------------------- */

static int run_server(const char *devname, int gid_idx, int port,
		      int clients)
{
	struct sockaddr_in sa;
	struct in_addr ip;
	char ipstr[INET_ADDRSTRLEN];
	struct dev d;
	int lfd, fd, one = 1, rounds = 0, rc;

	role = "server";
	open_dev(&d, devname, gid_idx,
		 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	for (size_t i = 0; i < BUF_SIZE; i++)
		d.buf[i] = pat(i);
	if (gid_ipv4(&d.gid, &ip))
		die("GID index %d is not an IPv4-mapped (RoCE v2) GID: no "
		    "address to listen on", gid_idx);
	inet_ntop(AF_INET, &ip, ipstr, sizeof(ipstr));
	if (!calibrate())
		die("timer calibration failed (%.3f ticks per us)", ticks_per_us);

	lfd = socket(AF_INET, SOCK_STREAM, 0);
	if (lfd < 0)
		die("socket: %s", strerror(errno));
	if (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)))
		die("setsockopt(SO_REUSEADDR): %s", strerror(errno));
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)port);
	sa.sin_addr = ip;
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)))
		die("bind %s:%d: %s", ipstr, port, strerror(errno));
	if (listen(lfd, 1))
		die("listen: %s", strerror(errno));
	printf("connect: server listening on %s:%d device=%s gid_index=%d "
	       "buf=%d qp_depth=%d\n", ipstr, port, devname, gid_idx,
	       BUF_SIZE, QP_DEPTH);
	fflush(stdout);

next_client:
	fd = accept(lfd, NULL, NULL);
	if (fd < 0)
		die("accept: %s", strerror(errno));
	set_nodelay(fd);

	for (;;) {
		struct msg in, out;
		struct ibv_qp *qp;
		uint64_t t0, t1, t2, t3, t4;
		uint32_t psn = rand_psn();

		if (!recv_msg(fd, &in, MSG_HELLO, "the client's QP info", 1))
			break;
		rounds++;
		t0 = ticks();
		qp = create_qp(&d);
		if (!qp)
			die("round %d: ibv_create_qp: %s", rounds,
			    strerror(errno));
		t1 = ticks();
		if ((rc = rc_to_init(&d.rp, qp, IBV_ACCESS_LOCAL_WRITE |
						   IBV_ACCESS_REMOTE_READ)))
			die("round %d: ibv_modify_qp(INIT): %s", rounds,
			    strerror(rc));
		t2 = ticks();
		if ((rc = rc_to_rtr(&d.rp, qp, in.qpn, in.psn,
				 (const union ibv_gid *)in.gid)))
			die("round %d: ibv_modify_qp(RTR): %s", rounds,
			    strerror(rc));
		t3 = ticks();
		if ((rc = rc_to_rts(&d.rp, qp, psn)))
			die("round %d: ibv_modify_qp(RTS): %s", rounds,
			    strerror(rc));
		t4 = ticks();

		memset(&out, 0, sizeof(out));
		out.type = MSG_REPLY;
		out.qpn = qp->qp_num;
		out.psn = psn;
		out.rkey = d.mr->rkey;
		out.addr = (uintptr_t)d.buf;
		out.srv_ns[0] = (uint64_t)(us_of(t0, t1) * 1e3);
		out.srv_ns[1] = (uint64_t)(us_of(t1, t2) * 1e3);
		out.srv_ns[2] = (uint64_t)(us_of(t2, t3) * 1e3);
		out.srv_ns[3] = (uint64_t)(us_of(t3, t4) * 1e3);
		memcpy(out.gid, d.gid.raw, 16);
		send_msg(fd, &out, "the server's QP info");

		recv_msg(fd, &in, MSG_DONE, "the end of the round", 0);
		if ((rc = ibv_destroy_qp(qp)))
			die("round %d: ibv_destroy_qp: %s", rounds,
			    strerror(rc));
		memset(&out, 0, sizeof(out));
		out.type = MSG_DONE_ACK;
		send_msg(fd, &out, "the end-of-round ack");
	}
	close(fd);
	if (--clients > 0)
		goto next_client;
	close(lfd);
	close_dev(&d);
	printf("connect: server done, %d connections served\n", rounds);
	return 0;
}

/* ---- raw client ------------------------------------------------------- */

enum { P_CREATE, P_INIT, P_EXCH, P_RTR, P_RTS, P_READ, P_TOTAL, P_SCREATE,
       P_SINIT, P_SRTR, P_SRTS, P_WIRE, P_DESTROY, P_READ2, P_COST, NPHASE };
static const char *const phase_name[NPHASE] = {
	"create_us", "init_us", "exchange_us", "rtr_us", "rts_us", "read_us",
	"total_us", "srv_create_us", "srv_init_us", "srv_rtr_us",
	"srv_rts_us", "wire_us", "destroy_us", "read2_us", "cost_us",
};

/* One connection: create, INIT, exchange, RTR, RTS, first READ (checked),
 * a second READ (checked). Fills ph[] (when not NULL) and returns the
 * connected QP. */
static struct ibv_qp *connect_once(struct client *c, int round, double *ph)
{
	char what[64];
	struct msg out, in;
	struct ibv_qp *qp;
	uint32_t psn = rand_psn();
	size_t off = ((size_t)round * READ_LEN) % BUF_SIZE;
	uint64_t t[7];
	int rc;

	snprintf(what, sizeof(what), "round %d", round);
	prep_read(c, off);

	t[0] = ticks();
	qp = create_qp(&c->d);
	if (!qp)
		die("%s: ibv_create_qp: %s", what, strerror(errno));
	t[1] = ticks();
	if ((rc = rc_to_init(&c->d.rp, qp, IBV_ACCESS_LOCAL_WRITE)))
		die("%s: ibv_modify_qp(INIT): %s", what, strerror(rc));
	t[2] = ticks();
	memset(&out, 0, sizeof(out));
	out.type = MSG_HELLO;
	out.qpn = qp->qp_num;
	out.psn = psn;
	memcpy(out.gid, c->d.gid.raw, 16);
	send_msg(c->fd, &out, "the client's QP info");
	recv_msg(c->fd, &in, MSG_REPLY, "the server's QP info", 0);
	c->raddr = in.addr;
	c->rkey = in.rkey;
	t[3] = ticks();
	if ((rc = rc_to_rtr(&c->d.rp, qp, in.qpn, in.psn,
			 (const union ibv_gid *)in.gid)))
		die("%s: ibv_modify_qp(RTR): %s", what, strerror(rc));
	t[4] = ticks();
	if ((rc = rc_to_rts(&c->d.rp, qp, psn)))
		die("%s: ibv_modify_qp(RTS): %s", what, strerror(rc));
	t[5] = ticks();
	post_read(c, qp, (uint64_t)round, off, what);
	poll_read(c, (uint64_t)round, what);
	t[6] = ticks();
	c->read_mono = mono_us();
	check_read(c, off, what);
	second_read(c, qp, round, off, ph ? &ph[P_READ2] : NULL, what);

	if (ph) {
		ph[P_CREATE] = us_of(t[0], t[1]);
		ph[P_INIT] = us_of(t[1], t[2]);
		ph[P_EXCH] = us_of(t[2], t[3]);
		ph[P_RTR] = us_of(t[3], t[4]);
		ph[P_RTS] = us_of(t[4], t[5]);
		ph[P_READ] = us_of(t[5], t[6]);
		ph[P_TOTAL] = us_of(t[0], t[6]);
		for (int i = 0; i < 4; i++)
			ph[P_SCREATE + i] = (double)in.srv_ns[i] / 1e3;
		ph[P_WIRE] = ph[P_EXCH] - ph[P_SCREATE] - ph[P_SINIT] -
			     ph[P_SRTR] - ph[P_SRTS];
		ph[P_COST] = ph[P_TOTAL] - ph[P_READ2];
	}
	return qp;
}

/* Destroys the round's QP, tells the server, waits until it destroyed its
 * own. Returns the client's destroy time. */
static double end_round(struct client *c, struct ibv_qp *qp, int round)
{
	struct msg m;
	uint64_t t0, t1;
	int rc;

	t0 = ticks();
	if ((rc = ibv_destroy_qp(qp)))
		die("round %d: ibv_destroy_qp: %s", round, strerror(rc));
	t1 = ticks();
	memset(&m, 0, sizeof(m));
	m.type = MSG_DONE;
	send_msg(c->fd, &m, "the end of the round");
	recv_msg(c->fd, &m, MSG_DONE_ACK, "the end-of-round ack", 0);
	return us_of(t0, t1);
}

/* The client's TCP connection to the server, from the IPv4 address of its
 * own GID (its emulated node); mestr gets that address. */
static void tcp_connect(struct client *c, int gid_idx, const char *server,
			int port, char *mestr)
{
	struct sockaddr_in sa;
	struct in_addr me;

	c->fd = socket(AF_INET, SOCK_STREAM, 0);
	if (c->fd < 0)
		die("socket: %s", strerror(errno));
	if (!gid_ipv4(&c->d.gid, &me)) {
		memset(&sa, 0, sizeof(sa));
		sa.sin_family = AF_INET;
		sa.sin_addr = me;
		if (bind(c->fd, (struct sockaddr *)&sa, sizeof(sa)))
			die("bind to %s (GID index %d): %s",
			    inet_ntoa(me), gid_idx, strerror(errno));
		inet_ntop(AF_INET, &me, mestr, INET_ADDRSTRLEN);
	}
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, server, &sa.sin_addr) != 1)
		die("%s is not an IPv4 address", server);
	if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)))
		die("connect to %s:%d: %s", server, port, strerror(errno));
	set_nodelay(c->fd);
}

static int run_client(const char *devname, int gid_idx, const char *server,
		      int port, int rounds, int reads)
{
	struct client c;
	char mestr[INET_ADDRSTRLEN] = "any";
	double (*ph)[NPHASE], *steady, med[NPHASE], clock_us, timer_us;
	struct ibv_qp *qp;
	int i;

	role = "client";
	memset(&c, 0, sizeof(c));
	ph = calloc((size_t)rounds, sizeof(*ph));
	steady = calloc((size_t)reads, sizeof(*steady));
	if (!ph || !steady)
		die("calloc");
	open_dev(&c.d, devname, gid_idx, IBV_ACCESS_LOCAL_WRITE);

	timer_setup(&clock_us, &timer_us);
	tcp_connect(&c, gid_idx, server, port, mestr);

	printf("# connect role=client device=%s gid_index=%d local=%s "
	       "server=%s:%d rounds=%d reads=%d read_len=%d qp_depth=%d "
	       "timer=%s ticks_per_us=%.3f timer_cost_us=%.4f "
	       "clock_gettime_us=%.3f\n", devname, gid_idx, mestr, server,
	       port, rounds, reads, READ_LEN, QP_DEPTH,
	       use_counter ? "counter" : "clock", ticks_per_us, timer_us,
	       clock_us);
	fflush(stdout);

	/* Round lines are printed after the rounds: output to a file on the
	 * VM's shared file system costs milliseconds of host I/O that would
	 * land in the next round. */
	for (i = 0; i < rounds; i++) {
		qp = connect_once(&c, i + 1, ph[i]);
		ph[i][P_DESTROY] = end_round(&c, qp, i + 1);
	}
	for (i = 0; i < rounds; i++) {
		printf("round %d", i + 1);
		for (int k = 0; k < NPHASE; k++)
			printf(" %s=%.1f", phase_name[k], ph[i][k]);
		printf("\n");
	}
	fflush(stdout);

	/* Steady READs on one established QP. */
	qp = connect_once(&c, rounds + 1, NULL);
	steady_reads(&c, qp, reads, steady);
	(void)end_round(&c, qp, rounds + 1);
	if (close(c.fd))
		die("close: %s", strerror(errno));
	close_dev(&c.d);

	{
		double s_med = print_steady(steady, reads);

		for (int k = 0; k < NPHASE; k++) {
			double col[rounds];

			for (i = 0; i < rounds; i++)
				col[i] = ph[i][k];
			med[k] = median(col, rounds);
		}
		printf("connect_raw_us=%.1f steady_read_us=%.1f "
		       "connect_minus_read_us=%.1f connect_minus_read2_us=%.1f",
		       med[P_TOTAL], s_med, med[P_TOTAL] - s_med, med[P_COST]);
		for (int k = 0; k < NPHASE; k++) {
			if (k == P_TOTAL || k == P_COST)
				continue;
			printf(" %s=%.1f", k == P_READ ? "first_read_us" :
							 phase_name[k], med[k]);
		}
		printf(" rounds=%d\n", rounds);
	}
	free(ph);
	free(steady);
	return 0;
}

/* A fresh raw process (-X fresh): what a new program does before its first
 * READ (open the device, PD, CQ, MR, TCP connection, one RC connection),
 * then it prints when that READ completed (read_mono_us) and exits. */
static int raw_fresh_child(const char *devname, int gid_idx,
			   const char *server, int port)
{
	char mestr[INET_ADDRSTRLEN] = "any";
	double ph[NPHASE];
	struct client c;
	struct ibv_qp *qp;

	role = "fresh child";
	memset(&c, 0, sizeof(c));
	open_dev(&c.d, devname, gid_idx, IBV_ACCESS_LOCAL_WRITE);
	tcp_connect(&c, gid_idx, server, port, mestr);
	qp = connect_once(&c, 1, ph);
	printf("child total_us=%.1f read_mono_us=%.1f\n", ph[P_TOTAL],
	       c.read_mono);
	(void)end_round(&c, qp, 1);
	if (close(c.fd))
		die("close: %s", strerror(errno));
	close_dev(&c.d);
	return 0;
}

/* -m fresh: ROUNDS fresh processes one after the other (the server serves
 * each with -k), each timed from its spawn to its first READ's completion:
 * what a user sees of a new process. */
static int run_client_fresh(const char *devname, int gid_idx,
			    const char *server, int port, int rounds)
{
	char self[4096], gs[16], ps[16], out[4096], what[32];
	char *argv[] = { self, "-c", (char *)server, "-d", (char *)devname,
			 "-g", gs, "-p", ps, "-X", "fresh", NULL };
	double *exec = calloc((size_t)rounds, sizeof(*exec));

	role = "client";
	if (!exec)
		die("calloc");
	self_path(self, sizeof(self));
	snprintf(gs, sizeof(gs), "%d", gid_idx);
	snprintf(ps, sizeof(ps), "%d", port);
	printf("# connect role=client mode=fresh device=%s gid_index=%d "
	       "server=%s:%d rounds=%d (each round a new process: spawn to "
	       "its first READ completed)\n", devname, gid_idx, server, port,
	       rounds);
	for (int i = 0; i < rounds; i++) {
		double exec0;

		snprintf(what, sizeof(what), "fresh round %d", i + 1);
		spawn_capture(argv, out, sizeof(out), what, &exec0);
		exec[i] = read_mono_of(out, what) - exec0;
		printf("fresh %d exec_us=%.1f\n", i + 1, exec[i]);
	}
	printf("fresh_process exec_to_read_us=%.1f rounds=%d\n",
	       median(exec, rounds), rounds);
	free(exec);
	return 0;
}

#else /* KRCORE */

/* ---- krcore: VQPs, qbind / qconnect ------------------------------------ */

#define KR_NRECV 64		/* server: receives posted on the bound VQP */
#define KR_SLOT 64		/* server: bytes per message buffer */
#define KR_OFF_SEND 1024	/* client, in d.buf: the MR request byte */
#define KR_OFF_RECV 2048	/* client, in d.buf: the server's answer */
#define KR_MR_REQUEST 'M'
#define KR_ANSWER_LEN 12	/* address (8 bytes), rkey (4) */
#define KR_SETTLE_MS 20

/* -b: a second qbind server (its port is PORT + 2), for kind=peer. */
static const char *other_server;
static const char *const kind_name[3] = { "cold", "first", "peer" };

static volatile sig_atomic_t stop_flag;

static void on_stop(int sig)
{
	(void)sig;
	stop_flag = 1;
}

static struct ibv_qp *create_vqp(struct dev *d, struct ibv_cq *rcq,
				 int recv_wr)
{
	struct ibv_qp_init_attr ia;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = d->cq;
	ia.recv_cq = rcq;
	ia.qp_type = (enum ibv_qp_type)KRCORE_VQP;
	ia.cap.max_send_wr = QP_DEPTH;
	ia.cap.max_recv_wr = (uint32_t)recv_wr;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	return ibv_create_qp(d->pd, &ia);
}

static void post_recv_at(struct ibv_qp *qp, struct ibv_mr *mr, uint8_t *buf,
			 uint32_t len, uint64_t wr_id, const char *what)
{
	struct ibv_sge sge = { (uintptr_t)buf, len, mr->lkey };
	struct ibv_recv_wr wr, *bad = NULL;
	int rc;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	if ((rc = ibv_post_recv(qp, &wr, &bad)))
		die("%s: ibv_post_recv: %s", what, strerror(rc));
}

/* One signaled SEND and its completion (send CQ cq). */
static void send_at(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *mr,
		    uint8_t *buf, uint32_t len, uint64_t wr_id,
		    const char *what)
{
	struct ibv_sge sge = { (uintptr_t)buf, len, mr->lkey };
	struct ibv_send_wr wr, *bad = NULL;
	struct ibv_wc wc;
	int rc;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED;
	if ((rc = ibv_post_send(qp, &wr, &bad)))
		die("%s: ibv_post_send(SEND): %s", what, strerror(rc));
	poll_wc(cq, &wc, what);
	if (wc.wr_id != wr_id || wc.opcode != IBV_WC_SEND)
		die("%s: completion wr_id %llu opcode %d, expected %llu SEND",
		    what, (unsigned long long)wc.wr_id, wc.opcode,
		    (unsigned long long)wr_id);
}

/* Dies unless the library knows a meta server and makes this process's
 * links from GID index gid_idx (KRCORE_GID_INDEX, read by the library
 * itself: setting it here would be too late). */
static void check_env(int gid_idx)
{
	char dump[4096], want[64];
	const char *m = getenv("KRCORE_META");

	if (!m || !*m)
		die("KRCORE_META is not set (start krcore-meta --listen IP:PORT "
		    "and export KRCORE_META=IP:PORT; bench/connect-compare.sh "
		    "does both)");
	(void)krcore_config_dump(dump, sizeof(dump));
	snprintf(want, sizeof(want), "KRCORE_GID_INDEX=%d\n", gid_idx);
	if (!strstr(dump, want))
		die("the library does not make this process's links from GID "
		    "index %d: export KRCORE_GID_INDEX=%d", gid_idx, gid_idx);
}

/* ---- krcore server ---------------------------------------------------- */

static int kr_server(const char *devname, int gid_idx, int port)
{
	struct dev d;
	struct ibv_cq *rcq;
	struct ibv_mr *mmr;
	struct ibv_qp *qp;
	struct in_addr ip;
	struct sigaction sa;
	char ipstr[INET_ADDRSTRLEN];
	uint8_t *mbuf, *answer;
	size_t mlen = (KR_NRECV + 1) * KR_SLOT;
	long answered = 0;
	int rc;

	role = "server";
	open_dev(&d, devname, gid_idx,
		 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	for (size_t i = 0; i < BUF_SIZE; i++)
		d.buf[i] = pat(i);
	if (gid_ipv4(&d.gid, &ip))
		die("GID index %d is not an IPv4-mapped (RoCE v2) GID", gid_idx);
	inet_ntop(AF_INET, &ip, ipstr, sizeof(ipstr));
	if (!calibrate())
		die("timer calibration failed (%.3f ticks per us)", ticks_per_us);

	rcq = ibv_create_cq(d.ctx, KR_NRECV, NULL, NULL, 0);
	if (!rcq)
		die("ibv_create_cq: %s", strerror(errno));
	if (posix_memalign((void **)&mbuf, 4096, mlen))
		die("posix_memalign");
	memset(mbuf, 0, mlen);
	answer = mbuf + KR_NRECV * KR_SLOT;
	mmr = ibv_reg_mr(d.pd, mbuf, mlen, IBV_ACCESS_LOCAL_WRITE);
	if (!mmr)
		die("ibv_reg_mr: %s", strerror(errno));
	qp = create_vqp(&d, rcq, KR_NRECV);
	if (!qp)
		die("ibv_create_qp(KRCORE_VQP): %s", strerror(errno));
	for (int i = 0; i < KR_NRECV; i++)
		post_recv_at(qp, mmr, mbuf + i * KR_SLOT, KR_SLOT, (uint64_t)i,
			     "the server's receives");

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop;
	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGTERM, &sa, NULL) || sigaction(SIGINT, &sa, NULL))
		die("sigaction: %s", strerror(errno));
	if ((rc = qbind(qp, d.gid, port)))
		die("qbind(%s, port %d): %s", ipstr, port, strerror(rc));
	printf("connect: server bound on %s port %d device=%s gid_index=%d "
	       "buf=%d (krcore qbind, KRCORE_META=%s)\n", ipstr, port, devname,
	       gid_idx, BUF_SIZE, getenv("KRCORE_META"));
	fflush(stdout);

	/* Serves MR requests until SIGTERM; sleeps 5 ms between empty polls
	 * (a bound VQP's messages come out of qpop_msgs only, nothing to
	 * block on; the requests are outside every timed part, and a
	 * spinning or often-waking server would take CPU from the client,
	 * which the raw server, blocked in recv(2), does not). */
	while (!stop_flag) {
		struct ibv_qp *src[8];
		struct ibv_wc wc[8];
		int k = qpop_msgs(qp, 8, src, wc);

		if (k < 0)
			die("qpop_msgs: %s", strerror(-k));
		if (k == 0) {
			struct timespec nap = { 0, 5 * 1000 * 1000 };

			nanosleep(&nap, NULL);
			continue;
		}
		for (int i = 0; i < k; i++) {
			uint64_t slot = wc[i].wr_id, a = (uintptr_t)d.buf;
			uint32_t rkey = d.mr->rkey;

			/* A client destroyed its VQP: its src_qp is reported
			 * once more (no receive buffer used), then freed. */
			if (wc[i].status == IBV_WC_WR_FLUSH_ERR && wc[i].byte_len == 0)
				continue;
			if (wc[i].status != IBV_WC_SUCCESS)
				die("a message: status %s",
				    ibv_wc_status_str(wc[i].status));
			if (slot >= KR_NRECV || wc[i].byte_len != 1 ||
			    mbuf[slot * KR_SLOT] != KR_MR_REQUEST)
				die("an unexpected message (wr_id %llu, %u bytes)",
				    (unsigned long long)slot, wc[i].byte_len);
			memcpy(answer, &a, 8);
			memcpy(answer + 8, &rkey, 4);
			send_at(src[i], d.cq, mmr, answer, KR_ANSWER_LEN,
				1000 + slot, "the MR answer");
			post_recv_at(qp, mmr, mbuf + slot * KR_SLOT, KR_SLOT,
				     slot, "a receive");
			answered++;
		}
	}
	if ((rc = ibv_destroy_qp(qp)))
		die("ibv_destroy_qp: %s", strerror(rc));
	if ((rc = ibv_dereg_mr(mmr)))
		die("ibv_dereg_mr: %s", strerror(rc));
	if ((rc = ibv_destroy_cq(rcq)))
		die("ibv_destroy_cq: %s", strerror(rc));
	free(mbuf);
	close_dev(&d);
	printf("connect: server done, %ld MR requests answered\n", answered);
	return 0;
}

/* ---- krcore client ------------------------------------------------------ */

enum { K_CREATE, K_QCONNECT, K_POST, K_POLL, K_READ, K_TOTAL, K_FROMQC,
       K_DESTROY, K_READ2, K_COST, KPHASE };
static const char *const kphase_name[KPHASE] = {
	"create_us", "qconnect_us", "post_us", "poll_us", "read_us",
	"total_us", "from_qconnect_us", "destroy_us", "read2_us", "cost_us",
};

static void kr_open(struct client *c, const char *devname, int gid_idx,
		    const char *server, int port)
{
	memset(c, 0, sizeof(*c));
	c->fd = -1;
	open_dev(&c->d, devname, gid_idx, IBV_ACCESS_LOCAL_WRITE);
	check_env(gid_idx);
	c->rcq = ibv_create_cq(c->d.ctx, QP_DEPTH, NULL, NULL, 0);
	if (!c->rcq)
		die("ibv_create_cq: %s", strerror(errno));
	c->sgid = gid_of_ipv4(server);
	c->sport = port;
}

static void kr_close(struct client *c)
{
	int rc;

	if (c->ctl && (rc = ibv_destroy_qp(c->ctl)))
		die("ibv_destroy_qp (the control VQP): %s", strerror(rc));
	if ((rc = ibv_destroy_cq(c->rcq)))
		die("ibv_destroy_cq: %s", strerror(rc));
	close_dev(&c->d);
}

/* The control VQP: qconnect (this process's first contact with the
 * server; returns its time), ask the server for its buffer's address and
 * rkey (once per process, outside every timed part, as a real program
 * learns them once), then one checked READ through it. */
static double kr_control(struct client *c)
{
	struct ibv_wc wc;
	uint64_t t0, t1;
	int rc;

	c->ctl = create_vqp(&c->d, c->rcq, QP_DEPTH);
	if (!c->ctl)
		die("ibv_create_qp(KRCORE_VQP): %s", strerror(errno));
	t0 = ticks();
	rc = qconnect(c->ctl, c->sgid, c->sport);
	t1 = ticks();
	if (rc)
		die("qconnect (the control VQP) to port %d: %s", c->sport,
		    strerror(rc));
	post_recv_at(c->ctl, c->d.mr, c->d.buf + KR_OFF_RECV, 64, 1,
		     "the MR answer's receive");
	c->d.buf[KR_OFF_SEND] = KR_MR_REQUEST;
	send_at(c->ctl, c->d.cq, c->d.mr, c->d.buf + KR_OFF_SEND, 1, 2,
		"the MR request");
	poll_wc(c->rcq, &wc, "the MR answer");
	if (wc.opcode != IBV_WC_RECV || wc.byte_len != KR_ANSWER_LEN)
		die("the MR answer: opcode %d, %u bytes", wc.opcode,
		    wc.byte_len);
	memcpy(&c->raddr, c->d.buf + KR_OFF_RECV, 8);
	memcpy(&c->rkey, c->d.buf + KR_OFF_RECV + 8, 4);
	prep_read(c, 0);
	post_read(c, c->ctl, 3, 0, "the control VQP's READ");
	poll_read(c, 3, "the control VQP's READ");
	check_read(c, 0, "the control VQP's READ");
	return us_of(t0, t1);
}

/* One connection: create a VQP, qconnect it, first 8-byte READ (checked),
 * destroy it (destroy_us is not in the total). */
static void kr_connect_once(struct client *c, int round, double *ph)
{
	char what[64];
	struct ibv_qp *qp;
	size_t off = ((size_t)round * READ_LEN) % BUF_SIZE;
	uint64_t t[7];
	double mono0;
	int rc;

	snprintf(what, sizeof(what), "round %d", round);
	prep_read(c, off);
	mono0 = mono_us();
	t[0] = ticks();
	qp = create_vqp(&c->d, c->rcq, QP_DEPTH);
	if (!qp)
		die("%s: ibv_create_qp(KRCORE_VQP): %s", what, strerror(errno));
	t[1] = ticks();
	if ((rc = qconnect(qp, c->sgid, c->sport)))
		die("%s: qconnect: %s", what, strerror(rc));
	t[2] = ticks();
	post_read(c, qp, (uint64_t)round, off, what);
	t[3] = ticks();
	poll_read(c, (uint64_t)round, what);
	t[4] = ticks();
	c->read_mono = mono_us();
	check_read(c, off, what);
	second_read(c, qp, round, off, &ph[K_READ2], what);
	t[5] = ticks();
	if ((rc = ibv_destroy_qp(qp)))
		die("%s: ibv_destroy_qp: %s", what, strerror(rc));
	t[6] = ticks();
	ph[K_CREATE] = us_of(t[0], t[1]);
	ph[K_QCONNECT] = us_of(t[1], t[2]);
	ph[K_POST] = us_of(t[2], t[3]);
	ph[K_POLL] = us_of(t[3], t[4]);
	ph[K_READ] = us_of(t[2], t[4]);
	ph[K_TOTAL] = us_of(t[0], t[4]);
	ph[K_FROMQC] = us_of(t[1], t[4]);
	ph[K_DESTROY] = us_of(t[5], t[6]);
	ph[K_COST] = ph[K_TOTAL] - ph[K_READ2];
	/* The round's steps on the library's KRCORE_LOG=debug timeline
	 * (bench/coldpath.sh), after the fact: nothing timed pays for them. */
	if (getenv("KRCORE_BENCH_MARKS")) {
		static const char *const step[] = {
			"round: ibv_create_qp(KRCORE_VQP)",
			"round: qconnect called", "round: READ post called",
			"round: READ posted", "round: READ completed" };

		for (int k = 0; k < 5; k++)
			fprintf(stderr, "krcore[%d] debug: mark %.0f app: %s\n",
				(int)getpid(), mono0 + us_of(t[0], t[k]),
				step[k]);
	}
}

static void print_phases(const char *prefix, const double *ph)
{
	printf("%s", prefix);
	for (int k = 0; k < KPHASE; k++)
		printf(" %s=%.1f", kphase_name[k], ph[k]);
}

/* Medians of each phase over n rounds, and the summary keys. */
static void print_summary(const char *prefix, double (*ph)[KPHASE], int n,
			  double s_med, const char *extra)
{
	double med[KPHASE];

	for (int k = 0; k < KPHASE; k++) {
		double col[n];

		for (int i = 0; i < n; i++)
			col[i] = ph[i][k];
		med[k] = median(col, n);
	}
	printf("%sconnect_krcore_us=%.1f steady_read_us=%.1f "
	       "connect_minus_read_us=%.1f connect_minus_read2_us=%.1f",
	       prefix, med[K_TOTAL], s_med, med[K_TOTAL] - s_med, med[K_COST]);
	for (int k = 0; k < KPHASE; k++) {
		if (k == K_TOTAL || k == K_COST)
			continue;
		printf(" %s=%.1f", k == K_READ ? "first_read_us" :
						 kphase_name[k], med[k]);
	}
	printf("%s rounds=%d\n", extra, n);
}

static void kr_header(struct client *c, const char *mode, const char *devname,
		      int gid_idx, const char *server, int rounds, int reads,
		      double first_us, double clock_us, double timer_us)
{
	printf("# connect role=client mode=%s device=%s gid_index=%d "
	       "server=%s port=%d rounds=%d reads=%d read_len=%d qp_depth=%d "
	       "timer=%s ticks_per_us=%.3f timer_cost_us=%.4f "
	       "clock_gettime_us=%.3f first_contact_us=%.1f "
	       "remote_buf=%#llx rkey=%#x (address and rkey learned once per "
	       "process, by an MR request on a control VQP, outside every "
	       "timed part)\n", mode, devname, gid_idx, server, c->sport,
	       rounds, reads, READ_LEN, QP_DEPTH,
	       use_counter ? "counter" : "clock", ticks_per_us, timer_us,
	       clock_us, first_us, (unsigned long long)c->raddr, c->rkey);
	fflush(stdout);
}

/* Warm: a link to the server process is up (the control VQP's connect,
 * untimed); every round connects a new VQP over it. */
static int kr_client_warm(const char *devname, int gid_idx,
			  const char *server, int port, int rounds, int reads)
{
	struct client c;
	double (*ph)[KPHASE], *steady, clock_us, timer_us, first_us, s_med;
	char line[32];

	role = "client";
	ph = calloc((size_t)rounds, sizeof(*ph));
	steady = calloc((size_t)reads, sizeof(*steady));
	if (!ph || !steady)
		die("calloc");
	kr_open(&c, devname, gid_idx, server, port);
	timer_setup(&clock_us, &timer_us);
	first_us = kr_control(&c);
	kr_header(&c, "krcore-warm", devname, gid_idx, server, rounds, reads,
		  first_us, clock_us, timer_us);
	/* Lines after the rounds, as in the raw client. */
	for (int i = 0; i < rounds; i++)
		kr_connect_once(&c, i + 1, ph[i]);
	for (int i = 0; i < rounds; i++) {
		snprintf(line, sizeof(line), "round %d", i + 1);
		print_phases(line, ph[i]);
		printf("\n");
	}
	fflush(stdout);
	steady_reads(&c, c.ctl, reads, steady);
	kr_close(&c);
	s_med = print_steady(steady, reads);
	print_summary("", ph, rounds, s_med, "");
	free(ph);
	free(steady);
	return 0;
}

/* Runs one cold child (a fresh process: DCCache empty, no link), returns
 * its phases, prewarm time and exec time (spawn to first READ). */
static void kr_spawn_child(struct client *c, const char *self,
			   const char *devname, int gid_idx,
			   const char *server, int kind, int round,
			   double *ph, double *prewarm, double *exec)
{
	char spec[160], gs[16], ps[16], out[4096], what[32], *line;
	char *argv[] = { (char *)self, "-c", (char *)server, "-d",
			 (char *)devname, "-g", gs, "-p", ps, "-X", spec,
			 other_server ? "-b" : NULL, (char *)other_server, NULL };
	double exec0;

	snprintf(gs, sizeof(gs), "%d", gid_idx);
	snprintf(ps, sizeof(ps), "%d", c->sport);
	snprintf(what, sizeof(what), "cold round %d", round);
	snprintf(spec, sizeof(spec), "%s,%d,%llu,%u,%d,%.9g",
		 kind_name[kind], round,
		 (unsigned long long)c->raddr, c->rkey, use_counter,
		 ticks_per_us);
	spawn_capture(argv, out, sizeof(out), what, &exec0);
	line = strstr(out, "child ");
	if (!line || sscanf(line, "child create_us=%lf qconnect_us=%lf "
				  "post_us=%lf poll_us=%lf read_us=%lf "
				  "total_us=%lf from_qconnect_us=%lf "
				  "destroy_us=%lf read2_us=%lf cost_us=%lf "
				  "prewarm_us=%lf",
			    &ph[K_CREATE], &ph[K_QCONNECT], &ph[K_POST],
			    &ph[K_POLL], &ph[K_READ], &ph[K_TOTAL],
			    &ph[K_FROMQC], &ph[K_DESTROY], &ph[K_READ2],
			    &ph[K_COST], prewarm) != 11)
		die("%s: the child printed no result: %s", what, out);
	*exec = read_mono_of(out, what) - exec0;
}

/* Cold: each round is a fresh process (spawned here) that has never
 * talked to the server. Kind "cold": its library is already up (a
 * qconnect to an unbound port first, untimed: runtime started, meta
 * server bootstrapped, no lookup of the server cached), so the round pays
 * the lookup, the link handshake and the peer's MR table. Kind "first":
 * the round's qconnect is the process's first extended verb and also
 * pays the runtime's start and the meta-server bootstrap. The kinds
 * alternate; ROUNDS of each. */
static int kr_client_cold(const char *devname, int gid_idx,
			  const char *server, int port, int rounds, int reads)
{
	struct client c;
	double (*ph[3])[KPHASE], *pre[3], *exec[3], *steady, clock_us,
		timer_us, first_us, s_med;
	char self[4096], line[48], extra[64];

	role = "client";
	self_path(self, sizeof(self));
	int kinds = other_server ? 3 : 2;

	for (int f = 0; f < kinds; f++) {
		ph[f] = calloc((size_t)rounds, sizeof(*ph[f]));
		pre[f] = calloc((size_t)rounds, sizeof(*pre[f]));
		exec[f] = calloc((size_t)rounds, sizeof(*exec[f]));
		if (!ph[f] || !pre[f] || !exec[f])
			die("calloc");
	}
	steady = calloc((size_t)reads, sizeof(*steady));
	if (!steady)
		die("calloc");
	kr_open(&c, devname, gid_idx, server, port);
	timer_setup(&clock_us, &timer_us);
	first_us = kr_control(&c);
	kr_header(&c, "krcore-cold", devname, gid_idx, server, rounds, reads,
		  first_us, clock_us, timer_us);
	for (int i = 0; i < kinds * rounds; i++) {
		int f = i % kinds, r = i / kinds;

		kr_spawn_child(&c, self, devname, gid_idx, server, f, i + 1,
			       ph[f][r], &pre[f][r], &exec[f][r]);
		snprintf(line, sizeof(line), "cold %d kind=%s", r + 1,
			 kind_name[f]);
		print_phases(line, ph[f][r]);
		printf(" prewarm_us=%.1f exec_us=%.1f\n", pre[f][r],
		       exec[f][r]);
	}
	steady_reads(&c, c.ctl, reads, steady);
	kr_close(&c);
	s_med = print_steady(steady, reads);
	snprintf(extra, sizeof(extra), " prewarm_us=%.1f",
		 median(pre[0], rounds));
	print_summary("", ph[0], rounds, s_med, extra);
	print_summary("first_verb ", ph[1], rounds, s_med, "");
	/* What a user sees: a new process, from its spawn (the library
	 * loaded, device opened, PD, CQ, MR, all of it) to its first READ. */
	printf("fresh_process exec_to_read_us=%.1f rounds=%d\n",
	       median(exec[1], rounds), rounds);
	if (other_server) {
		snprintf(extra, sizeof(extra), " prewarm_us=%.1f",
			 median(pre[2], rounds));
		print_summary("new_peer ", ph[2], rounds, s_med, extra);
	}
	for (int f = 0; f < kinds; f++) {
		free(ph[f]);
		free(pre[f]);
		free(exec[f]);
	}
	free(steady);
	return 0;
}

/* A cold child: SPEC is KIND,ROUND,ADDR,RKEY,USE_COUNTER,TICKS_PER_US
 * (the server's buffer as its parent learned it; the parent's timer). */
static int kr_cold_child(const char *devname, int gid_idx,
			 const char *server, int port, const char *spec)
{
	struct client c;
	struct ibv_qp *probe;
	double ph[KPHASE], prewarm = 0;
	char kind[8];
	unsigned long long raddr;
	unsigned rkey;
	int round, counter, rc;

	role = "cold child";
	if (sscanf(spec, "%7[a-z],%d,%llu,%u,%d,%lf", kind, &round, &raddr,
		   &rkey, &counter, &ticks_per_us) != 6 ||
	    (strcmp(kind, "cold") && strcmp(kind, "first") &&
	     (strcmp(kind, "peer") || !other_server)) ||
	    !(ticks_per_us > 0))
		die("bad -X %s", spec);
	use_counter = counter;
	kr_open(&c, devname, gid_idx, server, port);
	c.raddr = raddr;
	c.rkey = rkey;
	if (!strcmp(kind, "cold")) {
		struct timespec nap = { 0, KR_SETTLE_MS * 1000 * 1000 };
		uint64_t t0, t1;

		probe = create_vqp(&c.d, c.rcq, QP_DEPTH);
		if (!probe)
			die("ibv_create_qp(KRCORE_VQP): %s", strerror(errno));
		t0 = ticks();
		rc = qconnect(probe, c.sgid, port + 1);
		t1 = ticks();
		if (rc != ECONNREFUSED)
			die("prewarm: qconnect to the unbound port %d returned "
			    "%d (%s), expected ECONNREFUSED", port + 1, rc,
			    strerror(rc));
		if ((rc = ibv_destroy_qp(probe)))
			die("ibv_destroy_qp (probe): %s", strerror(rc));
		prewarm = us_of(t0, t1);
		nanosleep(&nap, NULL);
	} else if (!strcmp(kind, "peer")) {
		/* The library up and its code warm: a whole first contact
		 * with another server (qconnect, a message, a READ), then
		 * the round's first contact with this one. */
		struct timespec nap = { 0, KR_SETTLE_MS * 1000 * 1000 };
		union ibv_gid gid_a = c.sgid;

		c.sgid = gid_of_ipv4(other_server);
		c.sport = port + 2;
		prewarm = kr_control(&c);
		c.sgid = gid_a;
		c.sport = port;
		c.raddr = raddr;
		c.rkey = rkey;
		nanosleep(&nap, NULL);
	}
	kr_connect_once(&c, round, ph);
	print_phases("child", ph);
	printf(" prewarm_us=%.1f read_mono_us=%.1f\n", prewarm, c.read_mono);
	fflush(stdout);
	kr_close(&c);
	return 0;
}

#endif /* KRCORE */

static void usage(void)
{
#ifndef KRCORE
	fprintf(stderr,
		"usage: connect -s [-d DEV] [-g GID_INDEX] [-p TCP_PORT] "
		"[-k CLIENTS]\n"
		"       connect -c SERVER_IP [-m steady|fresh] [-d DEV] "
		"[-g GID_INDEX] [-p TCP_PORT] [-n ROUNDS] [-r READS] "
		"[-t tsc|clock]\n");
#else
	fprintf(stderr,
		"usage: connect-krcore -s [-d DEV] [-g GID_INDEX] [-p PORT]\n"
		"       connect-krcore -c SERVER_IP [-m warm|cold] [-b SERVER2_IP] [-d DEV] "
		"[-g GID_INDEX] [-p PORT] [-n ROUNDS] [-r READS] "
		"[-t tsc|clock]\n"
		"(KRCORE_META and KRCORE_GID_INDEX=GID_INDEX must be set)\n");
#endif
	exit(2);
}

static int parse_int(const char *s, int lo, int hi, const char *what)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || end == s || v < lo || v > hi) {
		fprintf(stderr, "connect: %s must be an integer in [%d, %d], "
			"not '%s'\n", what, lo, hi, s);
		exit(2);
	}
	return (int)v;
}

int main(int argc, char **argv)
{
	const char *devname = getenv("CT_DEVICE") && *getenv("CT_DEVICE") ?
				      getenv("CT_DEVICE") : "rxe0";
	const char *server = NULL;
	int is_server = 0, gid_idx = -1, port = 18777, rounds = 50,
	    reads = 1000, opt;
#ifdef KRCORE
	const char *mode = "warm";
#else
	const char *mode = "steady";
	int clients = 1;
#endif
	const char *child = NULL;

#if defined(__x86_64__) || defined(__aarch64__)
	use_counter = 1;
#endif
	while ((opt = getopt(argc, argv, "sc:d:g:p:n:r:t:m:X:k:b:")) != -1) {
		switch (opt) {
		case 's': is_server = 1; break;
		case 'c': server = optarg; break;
		case 'd': devname = optarg; break;
		case 'g': gid_idx = parse_int(optarg, 0, 65535, "-g"); break;
		case 'p': port = parse_int(optarg, 1, 65535, "-p"); break;
		case 'n': rounds = parse_int(optarg, 1, 100000, "-n"); break;
		case 'r': reads = parse_int(optarg, 1, 10000000, "-r"); break;
		case 't':
			if (!strcmp(optarg, "clock"))
				use_counter = 0;
			else if (strcmp(optarg, "tsc"))
				usage();
			break;
		case 'm':
#ifdef KRCORE
			if (strcmp(optarg, "warm") && strcmp(optarg, "cold"))
#else
			if (strcmp(optarg, "steady") && strcmp(optarg, "fresh"))
#endif
				usage();
			mode = optarg;
			break;
		case 'X': child = optarg; break;
#ifdef KRCORE
		case 'b': other_server = optarg; break;
#else
		case 'k': clients = parse_int(optarg, 1, 100000, "-k"); break;
#endif
		default: usage();
		}
	}
	if (optind != argc || is_server == !!server)
		usage();
	setvbuf(stdout, NULL, _IOLBF, 0);
#ifndef KRCORE
	rng_state = (uint32_t)getpid() * 2654435761u ^ (uint32_t)ticks();
	if (!rng_state)
		rng_state = 1;
	if (is_server)
		return run_server(devname, gid_idx < 0 ? 1 : gid_idx, port,
				  clients);
	if (gid_idx < 0)
		gid_idx = 2;
	if (child) {
		if (strcmp(child, "fresh"))
			usage();
		return raw_fresh_child(devname, gid_idx, server, port);
	}
	if (!strcmp(mode, "fresh"))
		return run_client_fresh(devname, gid_idx, server, port,
					rounds);
	return run_client(devname, gid_idx, server, port, rounds, reads);
#else
	if (is_server)
		return kr_server(devname, gid_idx < 0 ? 1 : gid_idx, port);
	if (gid_idx < 0)
		gid_idx = 2;
	if (child)
		return kr_cold_child(devname, gid_idx, server, port, child);
	if (!strcmp(mode, "cold"))
		return kr_client_cold(devname, gid_idx, server, port, rounds,
				      reads);
	return kr_client_warm(devname, gid_idx, server, port, rounds, reads);
#endif
}
