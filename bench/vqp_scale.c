/* SPDX-License-Identifier: MIT */
/*
 * Physical QPs and memory for N application RC QPs (issue 8): one process
 * on node 1 (GID index 1) and one peer process on node 2 (GID index 2,
 * forked before either uses libibverbs, each given its KRCORE_GID_INDEX
 * first: the library reads its configuration once, at its first use).
 * The program is plain libibverbs; bench/vqp-scale.sh runs it as is
 * (raw), with LD_PRELOAD=libkrcore.so (plain: every RC QP real, the
 * library passing through) and with KRCORE_VIRTUALIZE=1 as well (virt:
 * every RC QP a virtual QP on a shared link).
 *
 *   vqp_scale -n N [-m LABEL] [-d DEV] [-t SECONDS] [-M META_PID] [-o]
 *
 * Each process: opens DEV at its GID index, one PD, one CQ (2N + 16
 * entries), a registered buffer of 2 slots per QP (touched), then its
 * "before" figures (once stable). Then, timed from a common go (a
 * barrier over the socketpair) to the last completion:
 *   create   N x ibv_create_qp (RC, 4 send / 4 recv WRs, 1 SGE, the one
 *            CQ) + INIT + one receive posted;
 *   exchange (QPN, PSN) of every QP and the GID over the socketpair;
 *   connect  N x RTR (to the peer's QP of the same index) + RTS, both
 *            processes at once; with -o node 2 starts once node 1's first
 *            QP is in RTS (two processes that connect to each other at the
 *            same time make a link each: see Links in src/service/mod.rs);
 *   messages a barrier (both sides in RTS), then one SEND of 64 bytes per
 *            QP each way; every completion successful, on the QP it
 *            belongs to, every message checked byte for byte.
 * Then, with all N QPs still connected: the "after" figures (once
 * stable), and node 1 counts the kernel's QPs (`rdma resource show qp`)
 * of each process, of krcore-meta (-M PID) and the rest. A QP's "pid" there
 * is the thread that created it: a QP belongs to a process when that
 * thread is one of the process's (/proc/PID/task/TID), so the library's
 * own QPs (service UD QP, warm pool, links, meta client, notifiers) count
 * for the process that holds them. QPs whose thread is gone, or with no
 * pid (the kernel's own, e.g. the GSI QP), are reported as such.
 *
 * Output (one key=value line each, for bench/vqp_scale_report.py):
 *   scale node=1|2 mode=LABEL n=N pid=.. create_us= exchange_us=
 *         connect_us= msgs_us= total_us= teardown_us= rss_before_kB=
 *         rss_after_kB= rss_delta_B= virt_delta_B= pin_delta_B=
 *         anon_delta_B= file_delta_B= shmem_delta_B= (VmRSS's parts)
 *         app_qps_virtual= (qp_num with bit 23 set) stat_qps_virtualized=
 *         stat_vqps= stat_links= stat_links_opened= (the library's
 *         counters, -1 without the library)
 *   scale_qps n=N mode=LABEL who=node1|node2|meta|other-user|kernel
 *         qps= rc= ud= other= rts= init= app= (the application's real
 *         QPs) lib= (the others of the process: the library's) (node 1
 *         only), and a `scale_libqp who=.. <rdma's line>` for each of the
 *         latter
 *   scale_kern n=N mode=LABEL kern_delta_B= vmalloc_delta_B=
 *         slab_delta_B= memfree_delta_B= (node 1 only; machine-wide
 *         /proc/meminfo between a point where both processes were set up
 *         and one where both were connected: both ends, the meta server)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int node;

static void die(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "vqp_scale node %d: ", node);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

#include "rc.h"

/* Wall time in microseconds (the phases timed here take milliseconds to
 * seconds: clock_gettime's own cost under emulation does not matter). */
static double mono_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* For enum krcore_stat only: the counters are read through dlsym, the
 * program is not linked against the library (it is LD_PRELOADed). */
#include "krcore.h"
#define STAT_VQPS KRCORE_STAT_VQPS
#define STAT_LINKS KRCORE_STAT_LINKS
#define STAT_QPS_VIRTUALIZED KRCORE_STAT_QPS_VIRTUALIZED
#define STAT_LINKS_OPENED KRCORE_STAT_LINKS_OPENED

#define DEPTH 4
#define MSG 64
#define SLOT 128
#define VBIT 0x800000u
#define SEND_BIT (1ull << 62)
#define IO_MS 120000		/* bound on every out-of-band read */

static int n_qp;
static const char *label = "?";
static int wait_s = 300;
static int ordered;

/* ---- out of band ---------------------------------------------------------- */

static void xwrite(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;

	while (n) {
		ssize_t k = write(fd, b, n);

		if (k <= 0)
			die("out-of-band write: %s", strerror(errno));
		b += k;
		n -= (size_t)k;
	}
}

static void xread(int fd, void *p, size_t n)
{
	uint8_t *b = p;

	while (n) {
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		ssize_t k;

		if (poll(&pfd, 1, IO_MS) != 1)
			die("out-of-band read: nothing within %d ms", IO_MS);
		k = read(fd, b, n);
		if (k <= 0)
			die("out-of-band read: %s", k ? strerror(errno) : "peer gone");
		b += k;
		n -= (size_t)k;
	}
}

/* Both sides reach this point (byte `c` each way). */
static void barrier(int fd, char c)
{
	char got;

	xwrite(fd, &c, 1);
	xread(fd, &got, 1);
	if (got != c)
		die("out of band: '%c', expected '%c'", got, c);
}

/* ---- memory ----------------------------------------------------------------- */

struct snap {
	long rss_kb, anon_kb, file_kb, shmem_kb, pin_kb, virt_kb;
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
		sscanf(line, "RssAnon: %ld", &s->anon_kb);
		sscanf(line, "RssFile: %ld", &s->file_kb);
		sscanf(line, "RssShmem: %ld", &s->shmem_kb);
		sscanf(line, "VmPin: %ld", &s->pin_kb);
		sscanf(line, "VmSize: %ld", &s->virt_kb);
	}
	fclose(f);
}

/* Once the figures have been equal for 5 readings 10 ms apart (at most
 * 2 s: the library refills its warm QP pool on a background thread). */
static void snap_settled(struct snap *s)
{
	struct snap prev;
	double deadline = mono_us() + 2e6;
	int same = 0;

	snap_now(&prev);
	while (same < 5 && mono_us() < deadline) {
		struct timespec nap = { 0, 10 * 1000 * 1000 };

		nanosleep(&nap, NULL);
		snap_now(s);
		if (!memcmp(s, &prev, sizeof(*s)))
			same++;
		else
			same = 0;
		prev = *s;
	}
	*s = prev;
}

/* The machine's kernel memory (/proc/meminfo, kB). */
struct kern {
	long vmalloc_kb, slab_kb, free_kb;
};

static void kern_now(struct kern *k)
{
	FILE *f = fopen("/proc/meminfo", "r");
	char line[256];

	memset(k, 0, sizeof(*k));
	if (!f)
		die("/proc/meminfo: %s", strerror(errno));
	while (fgets(line, sizeof(line), f)) {
		sscanf(line, "VmallocUsed: %ld", &k->vmalloc_kb);
		sscanf(line, "SUnreclaim: %ld", &k->slab_kb);
		sscanf(line, "MemFree: %ld", &k->free_kb);
	}
	fclose(f);
}

/* ---- counting the kernel's QPs ---------------------------------------------- */

enum { W_NODE1, W_NODE2, W_META, W_OTHER, W_KERNEL, W_N };
static const char *const who_name[W_N] = { "node1", "node2", "meta", "other-user", "kernel" };

struct qpcount {
	int qps, rc, ud, other, rts, init, app, lib;
};

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return (x > y) - (x < y);
}

static int is_thread_of(long tid, pid_t pid)
{
	char path[64];

	if (pid <= 0)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/task/%ld", (int)pid, tid);
	return access(path, F_OK) == 0;
}

/* One `rdma resource show qp` snapshot, every QP attributed; `app`
 * (sorted, `napp`): the QPNs of the application's real QPs (both
 * processes'), the others of the two processes are the library's own,
 * printed as `scale_libqp` lines. */
static void count_qps(pid_t p1, pid_t p2, pid_t meta, const uint32_t *app, size_t napp)
{
	FILE *f = popen("rdma resource show qp 2>&1", "r");
	struct qpcount c[W_N];
	char line[1024];
	int lines = 0;

	memset(c, 0, sizeof(c));
	if (!f)
		die("popen(rdma resource show qp): %s", strerror(errno));
	while (fgets(line, sizeof(line), f)) {
		const char *p = strstr(line, " pid ");
		int w;

		if (!strstr(line, "lqpn"))
			continue;
		lines++;
		if (!p) {
			w = W_KERNEL;
		} else {
			long tid = strtol(p + 5, NULL, 10);

			w = is_thread_of(tid, p1)   ? W_NODE1 :
			    is_thread_of(tid, p2)   ? W_NODE2 :
			    is_thread_of(tid, meta) ? W_META : W_OTHER;
		}
		c[w].qps++;
		if (w == W_NODE1 || w == W_NODE2) {
			const char *l = strstr(line, "lqpn ");
			uint32_t qpn = l ? (uint32_t)strtoul(l + 5, NULL, 10) : 0;

			if (l && bsearch(&qpn, app, napp, sizeof(*app), cmp_u32)) {
				c[w].app++;
			} else {
				c[w].lib++;
				printf("scale_libqp n=%d mode=%s who=%s %s", n_qp, label,
				       who_name[w], line);
			}
		}
		if (strstr(line, "state INIT "))
			c[w].init++;
		if (strstr(line, "type RC "))
			c[w].rc++;
		else if (strstr(line, "type UD "))
			c[w].ud++;
		else
			c[w].other++;
		if (strstr(line, "state RTS "))
			c[w].rts++;
	}
	if (pclose(f) != 0 || !lines)
		die("rdma resource show qp failed or listed no QP");
	for (int w = 0; w < W_N; w++)
		printf("scale_qps n=%d mode=%s who=%s qps=%d rc=%d ud=%d other=%d rts=%d "
		       "init=%d app=%d lib=%d\n",
		       n_qp, label, who_name[w], c[w].qps, c[w].rc, c[w].ud, c[w].other,
		       c[w].rts, c[w].init, c[w].app, c[w].lib);
}

/* ---- one process ------------------------------------------------------------ */

struct qent {
	struct ibv_qp *qp;
	uint32_t psn, peer_qpn, peer_psn;
};

static long long stat_of(uint32_t s)
{
	uint64_t (*get)(uint32_t) = (uint64_t (*)(uint32_t))dlsym(RTLD_DEFAULT,
								   "krcore_stat_get");

	return get ? (long long)get(s) : -1;
}

/* The pattern of QP k's message from node `from`. */
static void fill(uint8_t *p, int from, int k)
{
	uint32_t s = ((uint32_t)from << 24) ^ (uint32_t)k * 2654435761u ^ 0x5a5a5a5au;

	for (int i = 0; i < MSG; i++) {
		s ^= s << 13;
		s ^= s >> 17;
		s ^= s << 5;
		p[i] = (uint8_t)s;
	}
}

static void post_recv(struct qent *q, int k, uint8_t *buf, struct ibv_mr *mr)
{
	struct ibv_sge sge = { (uintptr_t)(buf + (size_t)(2 * k) * SLOT), MSG, mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)k, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr *bad = NULL;
	int rc = ibv_post_recv(q[k].qp, &wr, &bad);

	if (rc)
		die("ibv_post_recv on QP %d: %s", k, strerror(rc));
}

static void post_send(struct qent *q, int k, uint8_t *buf, struct ibv_mr *mr)
{
	uint8_t *p = buf + (size_t)(2 * k + 1) * SLOT;
	struct ibv_sge sge = { (uintptr_t)p, MSG, mr->lkey };
	struct ibv_send_wr wr = { .wr_id = SEND_BIT | (uint64_t)k, .sg_list = &sge,
				  .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad = NULL;
	int rc;

	fill(p, node, k);
	if ((rc = ibv_post_send(q[k].qp, &wr, &bad)))
		die("ibv_post_send on QP %d: %s", k, strerror(rc));
}

static int run(const char *dev, int fd, pid_t child, pid_t meta)
{
	int gid_idx = node, peer = 3 - node, rc;
	union ibv_gid gid, peer_gid;
	struct rc_port rp;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	struct qent *q = calloc((size_t)n_qp, sizeof(*q));
	size_t len = (size_t)2 * (size_t)n_qp * SLOT;
	uint8_t *buf = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
	struct snap before, after;
	struct kern k0, k1;
	double t0, t_create, t_exch, t_conn, t_msgs, t_down;
	uint32_t seed = 0x9e3779b9u ^ ((uint32_t)getpid() << 8);
	int virtual_qpns = 0;

	if (!q || !buf)
		die("out of memory");
	memset(buf, 0, (len + 4095) / 4096 * 4096);
	ctx = rc_open(dev, gid_idx, &gid, &rp);
	if (!(pd = ibv_alloc_pd(ctx)))
		die("ibv_alloc_pd: %s", strerror(errno));
	if (!(cq = ibv_create_cq(ctx, 2 * n_qp + 16, NULL, NULL, 0)))
		die("ibv_create_cq(%d): %s", 2 * n_qp + 16, strerror(errno));
	if (!(mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE)))
		die("ibv_reg_mr: %s", strerror(errno));
	snap_settled(&before);
	barrier(fd, 'B');
	if (node == 1)
		kern_now(&k0);
	barrier(fd, 'G');

	/* ---- timed: create, exchange, connect, first messages ---- */
	t0 = mono_us();
	for (int k = 0; k < n_qp; k++) {
		struct ibv_qp_init_attr ia;

		memset(&ia, 0, sizeof(ia));
		ia.send_cq = ia.recv_cq = cq;
		ia.qp_type = IBV_QPT_RC;
		ia.cap = (struct ibv_qp_cap){ DEPTH, DEPTH, 1, 1, 0 };
		if (!(q[k].qp = ibv_create_qp(pd, &ia)))
			die("ibv_create_qp %d of %d: %s", k, n_qp, strerror(errno));
		if ((rc = rc_to_init(&rp, q[k].qp, IBV_ACCESS_LOCAL_WRITE)))
			die("INIT of QP %d: %s", k, strerror(rc));
		post_recv(q, k, buf, mr);
		q[k].psn = rc_rand_psn(&seed);
		if (q[k].qp->qp_num & VBIT)
			virtual_qpns++;
	}
	t_create = mono_us();
	{
		uint32_t *mine = malloc((size_t)n_qp * 8), *theirs = malloc((size_t)n_qp * 8);

		if (!mine || !theirs)
			die("out of memory");
		for (int k = 0; k < n_qp; k++) {
			mine[2 * k] = q[k].qp->qp_num;
			mine[2 * k + 1] = q[k].psn;
		}
		/* Node 1 writes first, node 2 reads first: no deadlock
		 * whatever the socket buffers hold. */
		if (node == 1) {
			xwrite(fd, &gid, sizeof(gid));
			xwrite(fd, mine, (size_t)n_qp * 8);
			xread(fd, &peer_gid, sizeof(peer_gid));
			xread(fd, theirs, (size_t)n_qp * 8);
		} else {
			xread(fd, &peer_gid, sizeof(peer_gid));
			xread(fd, theirs, (size_t)n_qp * 8);
			xwrite(fd, &gid, sizeof(gid));
			xwrite(fd, mine, (size_t)n_qp * 8);
		}
		for (int k = 0; k < n_qp; k++) {
			q[k].peer_qpn = theirs[2 * k];
			q[k].peer_psn = theirs[2 * k + 1];
		}
		free(mine);
		free(theirs);
	}
	t_exch = mono_us();
	/* -o: node 1 connects its first QP before node 2 connects any, so
	 * that the two processes do not make a link each at the same time. */
	if (ordered && node == 2) {
		char c;

		xread(fd, &c, 1);
		if (c != 'O')
			die("out of band: '%c', expected 'O'", c);
	}
	for (int k = 0; k < n_qp; k++) {
		if ((rc = rc_to_rtr(&rp, q[k].qp, q[k].peer_qpn, q[k].peer_psn, &peer_gid)))
			die("RTR of QP %d (%#x) to QPN %#x: %s", k, q[k].qp->qp_num,
			    q[k].peer_qpn, strerror(rc));
		if ((rc = rc_to_rts(&rp, q[k].qp, q[k].psn)))
			die("RTS of QP %d: %s", k, strerror(rc));
		if (ordered && node == 1 && k == 0)
			xwrite(fd, "O", 1);
	}
	t_conn = mono_us();
	barrier(fd, 'R');
	{
		int got = 0, sent = 0;
		double deadline = mono_us() + wait_s * 1e6;
		struct ibv_wc wc[64];
		uint8_t want[MSG];

		for (int k = 0; k < n_qp; k++)
			post_send(q, k, buf, mr);
		while (got < n_qp || sent < n_qp) {
			int n = ibv_poll_cq(cq, 64, wc);

			if (n < 0)
				die("ibv_poll_cq: %d", n);
			if (!n) {
				if (mono_us() > deadline)
					die("%d of %d messages, %d of %d sends within %d s", got,
					    n_qp, sent, n_qp, wait_s);
				continue;
			}
			for (int i = 0; i < n; i++) {
				int k = (int)(wc[i].wr_id & 0xffffffu);

				if (wc[i].status != IBV_WC_SUCCESS)
					die("completion wr_id %#llx: %s",
					    (unsigned long long)wc[i].wr_id,
					    ibv_wc_status_str(wc[i].status));
				if (k >= n_qp || wc[i].qp_num != q[k].qp->qp_num)
					die("completion wr_id %#llx on QPN %#x",
					    (unsigned long long)wc[i].wr_id, wc[i].qp_num);
				if (wc[i].wr_id & SEND_BIT) {
					if (wc[i].opcode != IBV_WC_SEND)
						die("send completion opcode %d", wc[i].opcode);
					sent++;
					continue;
				}
				if (wc[i].opcode != IBV_WC_RECV || wc[i].byte_len != MSG)
					die("QP %d: receive opcode %d, %u bytes", k, wc[i].opcode,
					    wc[i].byte_len);
				fill(want, peer, k);
				if (memcmp(buf + (size_t)(2 * k) * SLOT, want, MSG))
					die("QP %d: the message is not the peer's QP %d's", k, k);
				got++;
			}
		}
	}
	t_msgs = mono_us();

	/* ---- all N connected: figures ---- */
	snap_settled(&after);
	barrier(fd, 'C');
	if (node == 1) {
		uint32_t *app = malloc((size_t)n_qp * 2 * sizeof(*app));
		size_t napp = 0;

		kern_now(&k1);
		if (!app)
			die("out of memory");
		for (int k = 0; k < n_qp; k++) {
			if (!(q[k].qp->qp_num & VBIT))
				app[napp++] = q[k].qp->qp_num;
			if (!(q[k].peer_qpn & VBIT))
				app[napp++] = q[k].peer_qpn;
		}
		qsort(app, napp, sizeof(*app), cmp_u32);
		count_qps(getpid(), child, meta, app, napp);
		free(app);
		printf("scale_kern n=%d mode=%s kern_delta_B=%ld vmalloc_delta_B=%ld "
		       "slab_delta_B=%ld memfree_delta_B=%ld\n", n_qp, label,
		       ((k1.vmalloc_kb - k0.vmalloc_kb) + (k1.slab_kb - k0.slab_kb)) * 1024,
		       (k1.vmalloc_kb - k0.vmalloc_kb) * 1024, (k1.slab_kb - k0.slab_kb) * 1024,
		       (k1.free_kb - k0.free_kb) * 1024);
	}
	barrier(fd, 'D');

	/* ---- teardown (timed, not part of the table) ---- */
	{
		long long st_virt = stat_of(STAT_QPS_VIRTUALIZED), st_vqps = stat_of(STAT_VQPS),
			  st_links = stat_of(STAT_LINKS), st_opened = stat_of(STAT_LINKS_OPENED);
		double td0 = mono_us();

		for (int k = 0; k < n_qp; k++)
			if ((rc = ibv_destroy_qp(q[k].qp)))
				die("ibv_destroy_qp %d: %s", k, strerror(rc));
		t_down = mono_us() - td0;
		printf("scale node=%d mode=%s n=%d pid=%d create_us=%.0f exchange_us=%.0f "
		       "connect_us=%.0f msgs_us=%.0f total_us=%.0f teardown_us=%.0f "
		       "rss_before_kB=%ld rss_after_kB=%ld rss_delta_B=%ld virt_delta_B=%ld "
		       "pin_delta_B=%ld anon_delta_B=%ld file_delta_B=%ld shmem_delta_B=%ld "
		       "app_qps_virtual=%d stat_qps_virtualized=%lld "
		       "stat_vqps=%lld stat_links=%lld stat_links_opened=%lld\n",
		       node, label, n_qp, (int)getpid(), t_create - t0, t_exch - t_create,
		       t_conn - t_exch, t_msgs - t_conn, t_msgs - t0, t_down, before.rss_kb,
		       after.rss_kb, (after.rss_kb - before.rss_kb) * 1024,
		       (after.virt_kb - before.virt_kb) * 1024,
		       (after.pin_kb - before.pin_kb) * 1024,
		       (after.anon_kb - before.anon_kb) * 1024,
		       (after.file_kb - before.file_kb) * 1024,
		       (after.shmem_kb - before.shmem_kb) * 1024, virtual_qpns, st_virt, st_vqps,
		       st_links, st_opened);
	}
	/* Node 2 prints before node 1 goes on (one output file, in order). */
	barrier(fd, 'E');
	if (ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) ||
	    ibv_close_device(ctx))
		die("teardown of the CQ, MR, PD or device failed");
	free(buf);
	free(q);
	return 0;
}

static void usage(void)
{
	fprintf(stderr, "usage: vqp_scale -n N [-m LABEL] [-d DEV] [-t SECONDS] [-M META_PID] [-o]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *dev = getenv("CT_DEVICE") ? getenv("CT_DEVICE") : "rxe0";
	pid_t meta = 0, child;
	int opt, sv[2], status, rc;

	while ((opt = getopt(argc, argv, "n:m:d:t:M:o")) != -1) {
		switch (opt) {
		case 'n': n_qp = atoi(optarg); break;
		case 'm': label = optarg; break;
		case 'd': dev = optarg; break;
		case 't': wait_s = atoi(optarg); break;
		case 'M': meta = (pid_t)atoi(optarg); break;
		case 'o': ordered = 1; break;
		default: usage();
		}
	}
	if (n_qp < 1 || n_qp > 100000 || wait_s < 1)
		usage();
	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Nothing has used libibverbs (nor the preloaded library) yet: each
	 * process sets its GID index before its first use. */
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
		die("socketpair: %s", strerror(errno));
	child = fork();
	if (child < 0)
		die("fork: %s", strerror(errno));
	if (child == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		close(sv[0]);
		node = 2;
		setenv("KRCORE_GID_INDEX", "2", 1);
		alarm((unsigned)wait_s * 2 + 60);
		return run(dev, sv[1], 0, meta);
	}
	close(sv[1]);
	node = 1;
	setenv("KRCORE_GID_INDEX", "1", 1);
	alarm((unsigned)wait_s * 2 + 60);
	rc = run(dev, sv[0], child, meta);
	close(sv[0]);
	if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status))
		die("node 2 failed (status %#x)", status);
	return rc;
}
