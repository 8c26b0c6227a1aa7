/*
 * Virtual QPs under load and under attack, two processes on two emulated
 * nodes: a server bound with qbind on node 1 (10.77.0.1) that echoes every
 * message through the src_qp qpop_msgs gives and exposes registered memory
 * for one-sided operations, and ONE client process on node 2, so that every
 * VQP of the client shares the one link to the server. krcore-meta is
 * started here on node 1 (as in vqp_echo).
 *
 * 1. "64 VQPs across 4 threads sharing one link": 4 threads x 16 VQPs, one
 *    send CQ and one recv CQ per thread shared by its 16 VQPs. Each VQP
 *    runs UNITS units of (RDMA WRITE of a pattern into its own slice of the
 *    server's memory, RDMA READ of it back, echo SEND), chained 1-8 WRs per
 *    ibv_post_send, IBV_SEND_SIGNALED on every SIG_EVERY-th WR only
 *    (sq_sig_all = 0), each VQP kept full (SQ_DEPTH WRs in flight: 16 x 48
 *    per thread, 4 x that on a link of 256). Checked: a post fails only
 *    with ENOMEM when the VQP's own ring is full (*bad_wr inside the chain,
 *    the WRs before it posted); every completion arrives on its own
 *    thread's CQ with the right wc.qp_num, wr_id and opcode, in posting
 *    order per VQP, no unsignaled WR reported; every READ returns what the
 *    WRITE before it wrote; every echo comes back in order, byte for byte.
 * 2. "fuzz": FUZZ (>= 10,000) malformed WRs from a fixed-seed PRNG on one
 *    VQP (F): bad lkey, SGE outside its MR (also in a later SGE, and
 *    wrapping 2^64), bad rkey, remote range outside the peer's MR, a WRITE or
 *    atomic on a read-only remote MR, a READ into a local MR without local
 *    write, unsupported opcodes, too many SGEs, a negative num_sge or a NULL
 *    sg_list, inline data over the cap, inline on READ/atomics, misaligned
 *    atomics, atomics of the wrong length; half of them chained behind a
 *    valid WR (READ or WRITE, which must be posted and complete), a third
 *    followed by a valid WR (which must never be posted). Each must return
 *    EINVAL with *bad_wr on the malformed WR. Meanwhile a second VQP (G)
 *    on the same link moves verified data (echoes, WRITE+READ back, READs)
 *    before, interleaved with, and after the fuzzing; at the end F's valid
 *    WRITEs are read back and F still echoes.
 *
 * Environment: CT_STRESS_UNITS (units per VQP, default 50), CT_FUZZ
 * (malformed WRs, default 10000).
 */
#define _GNU_SOURCE
#include "common.h"

#include <arpa/inet.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5100

/* Part 1. */
#define NTHR 4
#define VPT 16			/* VQPs per thread */
#define NVQP (NTHR * VPT)
#define SQ_DEPTH 48		/* a VQP's send ring */
#define RQ_DEPTH 32		/* receives posted per VQP */
#define SIG_EVERY 5		/* IBV_SEND_SIGNALED on WR n when n % 5 == 4 */
#define NS 32			/* units a VQP may have in flight (its slots) */
#define SLOT 1024		/* bytes of a WRITE/READ slot */
#define MSG_MAX 256		/* echo payload of part 1 */
#define LINK_DEPTH 256		/* the library's link send queue */
#define IDLE_MS 10000		/* no progress for this long fails */

/* Per-VQP client memory: write sources, read targets, send and recv buffers. */
#define VQ_WSRC 0
#define VQ_RDST (VQ_WSRC + NS * SLOT)
#define VQ_SSRC (VQ_RDST + NS * SLOT)
#define VQ_RBUF (VQ_SSRC + NS * MSG_MAX)
#define VQ_BYTES (VQ_RBUF + RQ_DEPTH * MSG_MAX)

/* The server's target MR: the 64 VQPs' slices, then the fuzz area. */
#define STRESS_BYTES ((size_t)NVQP * NS * SLOT)
#define FUZZ_OFF STRESS_BYTES
#define FS 32			/* F's slots */
#define FSLOT 1024
#define F_AREA 0		/* in the fuzz area: F's WRITE slots */
#define G_AREA (FS * FSLOT)	/* G's slice */
#define G_BYTES (16 * 1024)
#define J_AREA (G_AREA + G_BYTES)	/* junk: where malformed WRs point */
#define J_BYTES (16 * 1024)
#define FUZZ_BYTES (J_AREA + J_BYTES)
#define TGT_BYTES (STRESS_BYTES + FUZZ_BYTES)
#define RO_BYTES (64 * 1024)	/* the server's read-only MR */
#define RO_SEED 77

/* Server. */
#define SRV_NRECV 512
#define SRV_BUF 4096

/* Control messages (distinguished from echoes by their length). */
#define CTL_LEN 3333
struct ctl {
	char magic[8];
	char cmd;		/* 'M' (memory), 'Q' (quit) */
	uint64_t taddr, tlen, roaddr, rolen;
	uint32_t trkey, rorkey;
};

/* wr_id tags of the fuzz part. */
#define TAG_F (0xf1ull << 56)	/* F's valid WRs: | n */
#define TAG_BAD (0xbaull << 56)	/* a malformed WR: | i */
#define TAG_NEVER (0xeeull << 56)	/* behind a malformed WR: never posted */
#define TAG_G (0x6bull << 56)	/* G's WRs */
#define TAG_MASK (0xffull << 56)

static int env_int(const char *name, int def)
{
	const char *v = getenv(name);

	return v && *v ? atoi(v) : def;
}

static uint64_t mix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

struct rng {
	uint64_t s;
};

static uint64_t rnd(struct rng *r)
{
	r->s = mix64(r->s);
	return r->s;
}

static uint32_t below(struct rng *r, uint32_t n)
{
	return (uint32_t)(rnd(r) % n);
}

static uint64_t ms_since(uint64_t t0)
{
	return (ct_now_ns() - t0) / 1000000ull;
}

/* Same pattern as ct_fill (byte i of seed s), for slices of a pattern. */
static uint8_t pat_at(uint32_t seed, size_t i)
{
	uint32_t x = seed * 0x9e3779b1u + (uint32_t)i * 0x85ebca6bu;

	x ^= x >> 13;
	x *= 0xc2b2ae35u;
	x ^= x >> 16;
	return (uint8_t)x;
}

static struct ibv_qp *make_vqp(struct ct_dev *d, struct ibv_cq *scq, struct ibv_cq *rcq,
			       uint32_t send_wr, uint32_t recv_wr, uint32_t send_sge,
			       uint32_t inline_max, struct ibv_qp_cap *granted)
{
	return ct_create_vqp(d, scq, rcq,
			     (struct ct_qp_caps){ send_wr, recv_wr, send_sge, 1, inline_max, 0 },
			     granted);
}

static void open_node(struct ct_dev *d, int node)
{
	char idx[16];

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	ct_open(d);
}

static int is_ctl(const uint8_t *p, uint32_t len)
{
	return len == CTL_LEN && memcmp(p, "KRSTRESS", 8) == 0;
}

/* ---- the server ------------------------------------------------------- */

static int server(int ready_fd)
{
	struct ct_dev d;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	struct ibv_mr *bmr, *tmr, *romr;
	uint8_t *buf, *tgt, *ro;
	struct ibv_qp *senders[NVQP + 8];
	int nsenders = 0, nseen = 0, closed = 0, quit = 0, inflight = 0;
	uint64_t msgs = 0, bytes = 0, enomem = 0, last = ct_now_ns();

	ct_begin("vqp_stress server");
	open_node(&d, 1);
	scq = CT_PTR(ibv_create_cq(d.ctx, 4096, NULL, NULL, 0));
	rcq = CT_PTR(ibv_create_cq(d.ctx, 64, NULL, NULL, 0));
	qp = make_vqp(&d, scq, rcq, 16, SRV_NRECV, 1, 0, NULL);
	buf = aligned_alloc(4096, (size_t)SRV_NRECV * SRV_BUF);
	tgt = aligned_alloc(4096, TGT_BYTES);
	ro = aligned_alloc(4096, RO_BYTES);
	CT_CHECK(buf && tgt && ro, "alloc");
	memset(buf, 0, (size_t)SRV_NRECV * SRV_BUF);
	memset(tgt, 0, TGT_BYTES);
	ct_fill(ro, RO_BYTES, RO_SEED);
	bmr = CT_PTR(ibv_reg_mr(d.pd, buf, (size_t)SRV_NRECV * SRV_BUF, IBV_ACCESS_LOCAL_WRITE));
	tmr = CT_PTR(ibv_reg_mr(d.pd, tgt, TGT_BYTES, CT_ACCESS_ALL));
	romr = CT_PTR(ibv_reg_mr(d.pd, ro, RO_BYTES, IBV_ACCESS_REMOTE_READ));
	for (int i = 0; i < SRV_NRECV; i++) {
		struct ibv_sge sge = { (uintptr_t)(buf + (size_t)i * SRV_BUF), SRV_BUF, bmr->lkey };
		struct ibv_recv_wr wr = { .wr_id = (uint64_t)i, .sg_list = &sge, .num_sge = 1 };
		struct ibv_recv_wr *bad = NULL;

		CT_OK(ibv_post_recv(qp, &wr, &bad));
	}
	CT_OK(qbind(qp, ct_node_gid(1), PORT));
	CT_CHECK(write(ready_fd, "R", 1) == 1, "ready");
	close(ready_fd);

	while (!quit || inflight > 0) {
		struct ibv_wc wc[32];
		struct ibv_qp *src[32];
		int k, active = 0;

		/* Echo completions: the buffer goes back to the receive queue. */
		k = ibv_poll_cq(scq, 32, wc);
		CT_CHECK(k >= 0, "poll send CQ: %d", k);
		for (int i = 0; i < k; i++) {
			struct ibv_sge sge;
			struct ibv_recv_wr wr = { .sg_list = &sge, .num_sge = 1 };
			struct ibv_recv_wr *bad = NULL;
			int slot = (int)wc[i].wr_id;

			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "echo status %s",
				 ibv_wc_status_str(wc[i].status));
			CT_CHECK(wc[i].opcode == IBV_WC_SEND, "echo opcode %d", wc[i].opcode);
			CT_CHECK(slot >= 0 && slot < SRV_NRECV, "echo wr_id %llu",
				 (unsigned long long)wc[i].wr_id);
			sge = (struct ibv_sge){ (uintptr_t)(buf + (size_t)slot * SRV_BUF), SRV_BUF, bmr->lkey };
			wr.wr_id = (uint64_t)slot;
			CT_OK(ibv_post_recv(qp, &wr, &bad));
			inflight--;
		}
		active += k;

		k = qpop_msgs(qp, 32, src, wc);
		CT_CHECK(k >= 0, "qpop_msgs: %d", k);
		active += k;
		for (int i = 0; i < k; i++) {
			int slot = (int)wc[i].wr_id, known = 0;
			uint8_t *p = buf + (size_t)slot * SRV_BUF;
			uint32_t len = wc[i].byte_len;
			struct ibv_sge sge;
			struct ibv_send_wr wr, *bad = NULL;
			uint64_t t0;

			if (wc[i].status == IBV_WC_WR_FLUSH_ERR && wc[i].byte_len == 0) {
				/* The sender destroyed its VQP: its src_qp is
				 * reported once more (no buffer used), then freed
				 * at our next qpop_msgs. */
				int at = -1;

				for (int j = 0; j < nsenders; j++)
					if (senders[j] == src[i])
						at = j;
				CT_CHECK(at >= 0, "a close report for an unknown src_qp");
				senders[at] = senders[--nsenders];
				closed++;
				continue;
			}
			CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "recv status %s",
				 ibv_wc_status_str(wc[i].status));
			CT_CHECK(wc[i].opcode == IBV_WC_RECV, "recv opcode %d", wc[i].opcode);
			CT_CHECK(wc[i].qp_num == qp->qp_num, "recv qp_num");
			CT_CHECK(slot >= 0 && slot < SRV_NRECV, "recv wr_id");
			CT_CHECK(src[i] && src[i]->qp_type == (enum ibv_qp_type)KRCORE_VQP,
				 "src_qp is a VQP");
			for (int j = 0; j < nsenders; j++)
				known |= senders[j] == src[i];
			if (!known) {
				CT_CHECK(nsenders < NVQP + 8, "too many src_qps");
				senders[nsenders++] = src[i];
				nseen++;
			}
			msgs++;
			bytes += len;
			if (is_ctl(p, len)) {
				struct ctl c;

				memcpy(&c, p, sizeof(c));
				if (c.cmd == 'M') {
					c.taddr = (uintptr_t)tgt;
					c.tlen = TGT_BYTES;
					c.trkey = tmr->rkey;
					c.roaddr = (uintptr_t)ro;
					c.rolen = RO_BYTES;
					c.rorkey = romr->rkey;
				} else {
					CT_CHECK(c.cmd == 'Q', "control command %c", c.cmd);
					quit = 1;
				}
				memcpy(p, &c, sizeof(c));
			}
			/* The echo goes out of the receive buffer itself; it is
			 * posted again when the SEND completes. */
			sge = (struct ibv_sge){ (uintptr_t)p, len, bmr->lkey };
			memset(&wr, 0, sizeof(wr));
			wr.wr_id = (uint64_t)slot;
			wr.sg_list = &sge;
			wr.num_sge = 1;
			wr.opcode = IBV_WR_SEND;
			wr.send_flags = IBV_SEND_SIGNALED;
			t0 = ct_now_ns();
			for (;;) {
				int rc = ibv_post_send(src[i], &wr, &bad);
				struct ibv_wc w2[32];
				int k2;

				if (rc == 0)
					break;
				CT_CHECK(rc == ENOMEM, "echo post: %d (%s)", rc, strerror(rc));
				CT_CHECK(bad == &wr, "echo *bad_wr");
				enomem++;
				/* Its ring is full: take completions. */
				k2 = ibv_poll_cq(scq, 32, w2);
				CT_CHECK(k2 >= 0, "poll send CQ: %d", k2);
				for (int j = 0; j < k2; j++) {
					struct ibv_sge s2;
					struct ibv_recv_wr r2 = { .sg_list = &s2, .num_sge = 1 };
					struct ibv_recv_wr *rb = NULL;
					int sl = (int)w2[j].wr_id;

					CT_CHECK(w2[j].status == IBV_WC_SUCCESS, "echo status %s",
						 ibv_wc_status_str(w2[j].status));
					CT_CHECK(sl >= 0 && sl < SRV_NRECV, "echo wr_id");
					s2 = (struct ibv_sge){ (uintptr_t)(buf + (size_t)sl * SRV_BUF),
							       SRV_BUF, bmr->lkey };
					r2.wr_id = (uint64_t)sl;
					CT_OK(ibv_post_recv(qp, &r2, &rb));
					inflight--;
				}
				CT_CHECK(ms_since(t0) < IDLE_MS, "echo ring stayed full for %d ms",
					 IDLE_MS);
				if (!k2)
					usleep(20);
			}
			inflight++;
		}
		if (active)
			last = ct_now_ns();
		else {
			CT_CHECK(ms_since(last) < 40000, "server: nothing for 40 s (%llu messages so far)",
				 (unsigned long long)msgs);
			usleep(20);
		}
	}
	/* ctl + 64 stress VQPs + F + G. */
	CT_CHECK(nseen == NVQP + 3, "%d distinct src_qps, expected %d", nseen, NVQP + 3);
	ct_note("server: %llu messages (%llu bytes) echoed from %d sending VQPs (%d of them "
		"reported closed), %llu ENOMEM retries",
		(unsigned long long)msgs, (unsigned long long)bytes, nseen, closed,
		(unsigned long long)enomem);
	ct_pass();
	return 0;
}

/* ---- the client: shared state ------------------------------------------ */

struct client {
	struct ct_dev d;
	uint8_t *mem;		/* everything local, one MR */
	size_t mem_len;
	struct ibv_mr *mr;
	uint8_t *ro_local;	/* registered without LOCAL_WRITE */
	struct ibv_mr *ro_mr;
	struct ctl srv;		/* the server's memory */
	int units;
};

/* Client memory layout. */
#define M_STRESS 0
#define M_F (M_STRESS + (size_t)NVQP * VQ_BYTES)	/* F's slots */
#define M_FJUNK (M_F + FS * FSLOT)			/* malformed WRs' local memory */
#define M_FJUNK_BYTES (64 * 1024)
#define M_FRECV (M_FJUNK + M_FJUNK_BYTES)		/* F's echo buffers */
#define M_G (M_FRECV + 2 * 4096)			/* G: send, recv, read */
#define M_CTL (M_G + 3 * 8192)				/* control send, recv */
#define M_BYTES (M_CTL + 2 * 4096)

/* ---- part 1 -------------------------------------------------------------- */

struct vq {
	struct ibv_qp *qp;
	uint32_t g;		/* 0..63 */
	uint8_t *mem;
	uint32_t posted;	/* WRs posted */
	uint32_t done;		/* WRs known complete (all below) */
	uint32_t verified;	/* units whose READ was checked */
	uint32_t replies;	/* echoes received */
};

struct thr {
	int tid;
	struct client *c;
	struct ibv_cq *scq, *rcq;
	struct vq v[VPT];
	uint32_t sq_cap;
	pthread_barrier_t *bar;
	struct rng rng;
	/* results */
	uint64_t posts, chains, enomem, send_wcs, recv_wcs, max_inflight;
};

static uint32_t rw_len(uint32_t g, uint32_t u)
{
	return 1 + (uint32_t)(mix64(((uint64_t)g << 32) | u) % SLOT);
}

static uint32_t msg_len(uint32_t g, uint32_t u)
{
	return 1 + (uint32_t)((mix64(((uint64_t)g << 32) | u) >> 20) % MSG_MAX);
}

static uint32_t seed_w(uint32_t g, uint32_t u) { return 0x10000000u + g * 65536u + u; }
static uint32_t seed_e(uint32_t g, uint32_t u) { return 0x20000000u + g * 65536u + u; }

static void check_pattern(const uint8_t *p, size_t len, uint32_t seed, const char *what,
			  uint32_t g, uint32_t u)
{
	for (size_t i = 0; i < len; i++)
		if (p[i] != pat_at(seed, i))
			CT_FAIL("%s of VQP %u unit %u: byte %zu of %zu is 0x%02x, expected 0x%02x",
				what, g, u, i, len, p[i], pat_at(seed, i));
}

static void post_recv_slot(struct thr *t, struct vq *q, uint32_t slot)
{
	struct ibv_sge sge = { (uintptr_t)(q->mem + VQ_RBUF + (size_t)slot * MSG_MAX), MSG_MAX,
			       t->c->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = ((uint64_t)q->g << 32) | slot, .sg_list = &sge,
				  .num_sge = 1 };
	struct ibv_recv_wr *bad = NULL;

	CT_OK(ibv_post_recv(q->qp, &wr, &bad));
}

static const enum ibv_wc_opcode kind_wc[3] = { IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_SEND };

/* WR n of VQP q: unit n/3, kind n%3 (WRITE, READ, SEND). */
static void build_op(struct thr *t, struct vq *q, uint32_t n, struct ibv_send_wr *wr,
		     struct ibv_sge *sge)
{
	uint32_t u = n / 3, s = u % NS;
	uint64_t raddr = t->c->srv.taddr + ((size_t)q->g * NS + s) * SLOT;

	memset(wr, 0, sizeof(*wr));
	wr->wr_id = ((uint64_t)q->g << 32) | n;
	wr->sg_list = sge;
	wr->num_sge = 1;
	wr->send_flags = n % SIG_EVERY == SIG_EVERY - 1 ? IBV_SEND_SIGNALED : 0;
	sge->lkey = t->c->mr->lkey;
	switch (n % 3) {
	case 0:
		sge->addr = (uintptr_t)(q->mem + VQ_WSRC + (size_t)s * SLOT);
		sge->length = rw_len(q->g, u);
		ct_fill((void *)(uintptr_t)sge->addr, sge->length, seed_w(q->g, u));
		wr->opcode = IBV_WR_RDMA_WRITE;
		wr->wr.rdma.remote_addr = raddr;
		wr->wr.rdma.rkey = t->c->srv.trkey;
		break;
	case 1:
		sge->addr = (uintptr_t)(q->mem + VQ_RDST + (size_t)s * SLOT);
		sge->length = rw_len(q->g, u);
		memset((void *)(uintptr_t)sge->addr, 0xee, SLOT);
		wr->opcode = IBV_WR_RDMA_READ;
		wr->wr.rdma.remote_addr = raddr;
		wr->wr.rdma.rkey = t->c->srv.trkey;
		break;
	default:
		sge->addr = (uintptr_t)(q->mem + VQ_SSRC + (size_t)s * MSG_MAX);
		sge->length = msg_len(q->g, u);
		ct_fill((void *)(uintptr_t)sge->addr, sge->length, seed_e(q->g, u));
		wr->opcode = IBV_WR_SEND;
		break;
	}
}

/* Post one chain of 1-8 WRs on q; returns WRs posted, -1 after ENOMEM. */
static int post_chain(struct thr *t, struct vq *q)
{
	uint32_t total = 3u * (uint32_t)t->c->units;
	uint32_t limit = 3u * (q->verified + NS);
	struct ibv_send_wr wr[8], *bad = NULL;
	struct ibv_sge sge[8];
	uint32_t m;
	int rc;

	if (limit > total)
		limit = total;
	if (q->posted >= limit)
		return 0;
	m = 1 + below(&t->rng, 8);
	if (m > limit - q->posted)
		m = limit - q->posted;
	for (uint32_t i = 0; i < m; i++) {
		build_op(t, q, q->posted + i, &wr[i], &sge[i]);
		wr[i].next = i + 1 < m ? &wr[i + 1] : NULL;
	}
	rc = ibv_post_send(q->qp, wr, &bad);
	t->chains++;
	if (rc == 0) {
		q->posted += m;
		t->posts += m;
		return (int)m;
	}
	CT_CHECK(rc == ENOMEM, "VQP %u: ibv_post_send returned %d (%s) for WR %u", q->g, rc,
		 strerror(rc), q->posted);
	CT_CHECK(bad >= wr && bad < wr + m, "VQP %u: *bad_wr outside the chain", q->g);
	q->posted += (uint32_t)(bad - wr);
	t->posts += (uint64_t)(bad - wr);
	/* The application's view (posted minus reported) bounds the ring's. */
	CT_CHECK(q->posted - q->done >= t->sq_cap,
		 "VQP %u: ENOMEM with %u WRs outstanding, ring of %u", q->g,
		 q->posted - q->done, t->sq_cap);
	t->enomem++;
	return -1;
}

static void on_send_wc(struct thr *t, const struct ibv_wc *w)
{
	uint32_t g = (uint32_t)(w->wr_id >> 32), n = (uint32_t)w->wr_id;
	struct vq *q;

	CT_CHECK(w->status == IBV_WC_SUCCESS, "thread %d: send completion %s (wr_id %#llx)",
		 t->tid, ibv_wc_status_str(w->status), (unsigned long long)w->wr_id);
	CT_CHECK(g < NVQP && g / VPT == (uint32_t)t->tid,
		 "thread %d's send CQ got wr_id %#llx (VQP %u)", t->tid,
		 (unsigned long long)w->wr_id, g);
	q = &t->v[g % VPT];
	CT_CHECK(w->qp_num == q->qp->qp_num, "VQP %u: wc.qp_num %#x, expected %#x", g, w->qp_num,
		 q->qp->qp_num);
	if (n % SIG_EVERY != SIG_EVERY - 1)
		CT_FAIL("VQP %u: unsignaled WR %u reported", g, n);
	CT_CHECK(n == q->done + SIG_EVERY - 1, "VQP %u: completion of WR %u, expected WR %u (order)",
		 g, n, q->done + SIG_EVERY - 1);
	CT_CHECK(n < q->posted, "VQP %u: completion of WR %u never posted", g, n);
	CT_CHECK(w->opcode == kind_wc[n - n / 3 * 3], "VQP %u WR %u: opcode %s, expected %s", g, n,
		 ct_wc_opcode_str(w->opcode), ct_wc_opcode_str(kind_wc[n % 3]));
	q->done = n + 1;
	t->send_wcs++;
	while (3 * q->verified + 2 < q->done) {
		uint32_t u = q->verified;

		check_pattern(q->mem + VQ_RDST + (size_t)(u % NS) * SLOT, rw_len(g, u),
			      seed_w(g, u), "READ after WRITE", g, u);
		q->verified++;
	}
}

static void on_recv_wc(struct thr *t, const struct ibv_wc *w)
{
	uint32_t g = (uint32_t)(w->wr_id >> 32), slot = (uint32_t)w->wr_id, u;
	struct vq *q;

	CT_CHECK(w->status == IBV_WC_SUCCESS, "thread %d: recv completion %s", t->tid,
		 ibv_wc_status_str(w->status));
	CT_CHECK(g < NVQP && g / VPT == (uint32_t)t->tid,
		 "thread %d's recv CQ got wr_id %#llx", t->tid, (unsigned long long)w->wr_id);
	q = &t->v[g % VPT];
	CT_CHECK(w->qp_num == q->qp->qp_num, "VQP %u: recv wc.qp_num %#x, expected %#x", g,
		 w->qp_num, q->qp->qp_num);
	CT_CHECK(w->opcode == IBV_WC_RECV, "VQP %u: recv opcode %d", g, w->opcode);
	u = q->replies;
	if (slot != u % RQ_DEPTH)
		CT_FAIL("VQP %u: echo %u in recv slot %u, expected %u (order)", g, u, slot,
			u % RQ_DEPTH);
	CT_CHECK(u < q->posted / 3, "VQP %u: echo %u before its SEND was posted", g, u);
	CT_CHECK(w->byte_len == msg_len(g, u), "VQP %u echo %u: %u bytes, sent %u", g, u,
		 w->byte_len, msg_len(g, u));
	check_pattern(q->mem + VQ_RBUF + (size_t)slot * MSG_MAX, w->byte_len, seed_e(g, u),
		      "echo", g, u);
	q->replies++;
	t->recv_wcs++;
	post_recv_slot(t, q, slot);
}

static int poll_thr(struct thr *t)
{
	struct ibv_wc wc[64];
	int k, got = 0;

	k = ibv_poll_cq(t->scq, 64, wc);
	CT_CHECK(k >= 0, "poll send CQ: %d", k);
	for (int i = 0; i < k; i++)
		on_send_wc(t, &wc[i]);
	got += k;
	k = ibv_poll_cq(t->rcq, 64, wc);
	CT_CHECK(k >= 0, "poll recv CQ: %d", k);
	for (int i = 0; i < k; i++)
		on_recv_wc(t, &wc[i]);
	return got + k;
}

static void *stress_thread(void *arg)
{
	struct thr *t = arg;
	struct client *c = t->c;
	uint32_t total = 3u * (uint32_t)c->units;
	uint64_t last;
	int finished = 0;

	t->scq = CT_PTR(ibv_create_cq(c->d.ctx, 2048, NULL, NULL, 0));
	t->rcq = CT_PTR(ibv_create_cq(c->d.ctx, 2048, NULL, NULL, 0));
	for (int i = 0; i < VPT; i++) {
		struct vq *q = &t->v[i];
		struct ibv_qp_cap cap;

		q->g = (uint32_t)(t->tid * VPT + i);
		q->mem = c->mem + M_STRESS + (size_t)q->g * VQ_BYTES;
		q->qp = make_vqp(&c->d, t->scq, t->rcq, SQ_DEPTH, RQ_DEPTH, 1, 0, &cap);
		CT_CHECK(cap.max_send_wr >= SQ_DEPTH && cap.max_recv_wr >= RQ_DEPTH, "caps");
		t->sq_cap = cap.max_send_wr;
		CT_OK(qconnect(q->qp, ct_node_gid(1), PORT));
		for (uint32_t s = 0; s < RQ_DEPTH; s++)
			post_recv_slot(t, q, s);
	}
	pthread_barrier_wait(t->bar);
	last = ct_now_ns();
	while (!finished) {
		int progress = 0;
		uint64_t inflight = 0;

		/* Fill every VQP until its ring is full (ENOMEM) or its slots are. */
		for (int i = 0; i < VPT; i++) {
			int r;

			while ((r = post_chain(t, &t->v[i])) > 0)
				progress += r;
		}
		for (int i = 0; i < VPT; i++)
			inflight += t->v[i].posted - t->v[i].done;
		if (inflight > t->max_inflight)
			t->max_inflight = inflight;
		progress += poll_thr(t);
		finished = 1;
		for (int i = 0; i < VPT; i++) {
			struct vq *q = &t->v[i];

			if (q->posted < total || q->done < total || q->replies < (uint32_t)c->units)
				finished = 0;
		}
		if (progress)
			last = ct_now_ns();
		else {
			if (ms_since(last) > IDLE_MS) {
				struct vq *q = &t->v[0];

				CT_FAIL("thread %d: no progress for %d ms (VQP %u: posted %u, done %u, "
					"echoes %u of %d)", t->tid, IDLE_MS, q->g, q->posted, q->done,
					q->replies, c->units);
			}
			usleep(20);
		}
	}
	for (int i = 0; i < VPT; i++)
		CT_CHECK(t->v[i].verified == (uint32_t)c->units, "VQP %u verified %u units",
			 t->v[i].g, t->v[i].verified);
	/* Nothing more comes. */
	{
		struct ibv_wc wc;

		CT_CHECK(ibv_poll_cq(t->scq, 1, &wc) == 0, "extra send completion");
		CT_CHECK(ibv_poll_cq(t->rcq, 1, &wc) == 0, "extra recv completion");
	}
	return NULL;
}

static void part1(struct client *c)
{
	pthread_t th[NTHR];
	static struct thr t[NTHR];
	pthread_barrier_t bar;
	uint64_t t0 = ct_now_ns(), posts = 0, chains = 0, enomem = 0, swc = 0, rwc = 0, maxin = 0;

	ct_begin("vqp_stress: 64 VQPs across 4 threads sharing one link");
	CT_CHECK(pthread_barrier_init(&bar, NULL, NTHR) == 0, "barrier");
	for (int i = 0; i < NTHR; i++) {
		memset(&t[i], 0, sizeof(t[i]));
		t[i].tid = i;
		t[i].c = c;
		t[i].bar = &bar;
		t[i].rng.s = 0x5157u + (uint64_t)i;
		CT_CHECK(pthread_create(&th[i], NULL, stress_thread, &t[i]) == 0, "pthread_create");
	}
	for (int i = 0; i < NTHR; i++) {
		CT_CHECK(pthread_join(th[i], NULL) == 0, "pthread_join");
		posts += t[i].posts;
		chains += t[i].chains;
		enomem += t[i].enomem;
		swc += t[i].send_wcs;
		rwc += t[i].recv_wcs;
		maxin += t[i].max_inflight;
		CT_CHECK(t[i].max_inflight > LINK_DEPTH,
			 "thread %d never had more than %llu WRs posted and unreported (link depth %d)", i,
			 (unsigned long long)t[i].max_inflight, LINK_DEPTH);
	}
	pthread_barrier_destroy(&bar);
	CT_CHECK(posts == (uint64_t)NVQP * 3 * (uint64_t)c->units, "posted %llu",
		 (unsigned long long)posts);
	ct_note("%d VQPs x %d units: %llu WRs in %llu ibv_post_send calls (%llu ENOMEM on a full "
		"VQP ring, retried), %llu signaled completions, %llu echoes verified; up to %llu WRs "
		"posted and not yet reported on thread 0 (sum of the 4 threads' maxima %llu, link "
		"depth %d); %llu ms",
		NVQP, c->units, (unsigned long long)posts, (unsigned long long)chains,
		(unsigned long long)enomem, (unsigned long long)swc, (unsigned long long)rwc,
		(unsigned long long)t[0].max_inflight, (unsigned long long)maxin, LINK_DEPTH,
		(unsigned long long)ms_since(t0));
	for (int i = 0; i < NTHR; i++)
		for (int j = 0; j < VPT; j++)
			CT_OK(ibv_destroy_qp(t[i].v[j].qp));
	for (int i = 0; i < NTHR; i++) {
		CT_OK(ibv_destroy_cq(t[i].scq));
		CT_OK(ibv_destroy_cq(t[i].rcq));
	}
	ct_pass();
}

/* ---- part 2: fuzz --------------------------------------------------------- */

enum cat {
	C_LKEY,		/* an SGE's lkey is no MR of ours */
	C_SGE_OOR,	/* an SGE outside its MR (before, past the end, wrapping) */
	C_RKEY,		/* rkey of no MR of the peer */
	C_RADDR,	/* remote range outside the peer's MR */
	C_RACCESS,	/* WRITE / atomic on a read-only remote MR */
	C_LACCESS,	/* READ / atomic into a local MR without LOCAL_WRITE */
	C_OPCODE,	/* an opcode a VQP (RC) does not carry */
	C_NSGE,		/* num_sge above max_send_sge */
	C_NSGE_NEG,	/* negative num_sge, or NULL sg_list */
	C_INLINE,	/* inline data over max_inline_data */
	C_INLINE_OP,	/* IBV_SEND_INLINE on READ or an atomic */
	C_ATOM_ALIGN,	/* atomic: remote or local address not 8-aligned */
	C_ATOM_LEN,	/* atomic: not one 8-byte SGE */
	NCAT
};

static const char *const cat_name[NCAT] = {
	"bad lkey", "SGE outside its MR", "bad rkey", "remote range outside the MR",
	"remote MR lacks access", "local MR lacks LOCAL_WRITE", "bad opcode", "too many SGEs",
	"negative num_sge / NULL sg_list", "inline over the cap", "inline on READ/atomic",
	"misaligned atomic", "atomic of wrong length",
};

struct tally {
	unsigned n, ok, wrong_errno, wrong_bad;
	int first_errno;
	char first[400];
};

struct fuzz {
	struct client *c;
	struct ibv_qp *f, *g;
	struct ibv_cq *fscq, *frcq, *gscq, *grcq;
	struct ibv_qp_cap fcap;
	uint8_t *floc, *junk, *frecv, *gsend, *grecv, *gread;
	uint8_t *ro_expect;	/* the server's read-only pattern */
	/* F's valid WRs, ring by n % FS. */
	uint32_t posted, done, run;
	struct fop {
		uint8_t kind;	/* 0 READ of the RO MR, 1 WRITE to F's area */
		uint8_t sig;
		uint32_t len, off, seed;
	} ops[FS];
	uint32_t sig_q[FS], sig_head, sig_tail;
	uint32_t slot_seed[FS];	/* last pattern WRITTEN to each F slot (0: none) */
	uint32_t slot_len[FS];
	uint32_t fwcs;
	uint32_t gops, gid;
	struct rng r;
};

static uint32_t bad_lkey(struct fuzz *z)
{
	for (;;) {
		uint32_t k = (uint32_t)rnd(&z->r);

		if (below(&z->r, 8) == 0)
			k = 0;
		if (k != z->c->mr->lkey && k != z->c->ro_mr->lkey)
			return k;
	}
}

static uint32_t bad_rkey(struct fuzz *z)
{
	for (;;) {
		uint32_t k = (uint32_t)rnd(&z->r);

		if (below(&z->r, 4) == 0)	/* near the real one */
			k = z->c->srv.trkey ^ (1u << below(&z->r, 32));
		if (k != z->c->srv.trkey && k != z->c->srv.rorkey)
			return k;
	}
}

static int is_atomic(enum ibv_wr_opcode op)
{
	return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

static void set_remote(struct ibv_send_wr *w, uint64_t addr, uint32_t rkey)
{
	if (is_atomic(w->opcode)) {
		w->wr.atomic.remote_addr = addr;
		w->wr.atomic.rkey = rkey;
		w->wr.atomic.compare_add = 1;
		w->wr.atomic.swap = 2;
	} else {
		w->wr.rdma.remote_addr = addr;
		w->wr.rdma.rkey = rkey;
	}
}

/* A valid local SGE in the junk area (8-aligned for atomics). */
static struct ibv_sge junk_sge(struct fuzz *z, uint32_t len)
{
	uint32_t off = below(&z->r, M_FJUNK_BYTES - len + 1) & ~7u;

	return (struct ibv_sge){ (uintptr_t)(z->junk + off), len, z->c->mr->lkey };
}

/* A valid remote address in the server's junk area for `len` bytes. */
static uint64_t junk_raddr(struct fuzz *z, uint32_t len)
{
	return z->c->srv.taddr + FUZZ_OFF + J_AREA + (below(&z->r, J_BYTES - len + 1) & ~7u);
}

static enum ibv_wr_opcode pick(struct fuzz *z, const enum ibv_wr_opcode *ops, int n)
{
	return ops[below(&z->r, (uint32_t)n)];
}

static const enum ibv_wr_opcode ALL_OPS[] = {
	IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM,
	IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
};
static const enum ibv_wr_opcode RDMA_OPS[] = {
	IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ,
	IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
};
static const enum ibv_wr_opcode ATOMIC_OPS[] = {
	IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
};

/*
 * A malformed WR of category `cat` in *w, its SGEs in sge[16] (all other
 * fields valid). Writes a description into `what`.
 */
static void make_bad(struct fuzz *z, enum cat cat, struct ibv_send_wr *w, struct ibv_sge *sge,
		     char *what, size_t wlen)
{
	uint32_t maxsge = z->fcap.max_send_sge, maxinl = z->fcap.max_inline_data;
	uint64_t tbase = z->c->srv.taddr, tend = tbase + z->c->srv.tlen;
	uintptr_t mbase = (uintptr_t)z->c->mem, mend = mbase + z->c->mem_len;
	uint32_t len, nsge;

	memset(w, 0, sizeof(*w));
	w->num_sge = 1;
	w->sg_list = sge;
	w->send_flags = below(&z->r, 2) ? IBV_SEND_SIGNALED : 0;
	w->imm_data = htonl(0xbad);
	switch (cat) {
	case C_LKEY: {
		uint32_t j;

		w->opcode = pick(z, ALL_OPS, 7);
		if (is_atomic(w->opcode)) {
			nsge = 1;
			len = 8;
		} else {
			nsge = 1 + below(&z->r, maxsge);
			len = 1 + below(&z->r, 512);
		}
		for (uint32_t i = 0; i < nsge; i++)
			sge[i] = junk_sge(z, len);
		j = below(&z->r, nsge);
		sge[j].lkey = bad_lkey(z);
		w->num_sge = (int)nsge;
		set_remote(w, junk_raddr(z, 8 * 512), z->c->srv.trkey);
		snprintf(what, wlen, "opcode %d, SGE %u of %u lkey %#x", w->opcode, j, nsge,
			 sge[j].lkey);
		break;
	}
	case C_SGE_OOR: {
		uint32_t j, v = below(&z->r, 5);
		static const enum ibv_wr_opcode ops[] = { IBV_WR_SEND, IBV_WR_RDMA_WRITE,
							  IBV_WR_RDMA_READ, IBV_WR_SEND_WITH_IMM };

		w->opcode = pick(z, ops, 4);
		nsge = 1 + below(&z->r, maxsge);
		for (uint32_t i = 0; i < nsge; i++)
			sge[i] = junk_sge(z, 1 + below(&z->r, 256));
		j = below(&z->r, nsge);
		len = 1 + below(&z->r, 4096);
		switch (v) {
		case 0:	/* starts before the MR */
			sge[j].addr = mbase - 1 - below(&z->r, 4096);
			sge[j].length = len;
			break;
		case 1:	/* runs past its end by 1..len bytes */
			sge[j].addr = mend - len + 1 + below(&z->r, len);
			sge[j].length = len;
			break;
		case 2:	/* wraps around 2^64 */
			sge[j].addr = UINT64_MAX - below(&z->r, 16);
			sge[j].length = 17 + below(&z->r, 4096);
			break;
		case 3:	/* longer than the MR */
			sge[j].addr = mbase;
			sge[j].length = (uint32_t)z->c->mem_len + 1 + below(&z->r, 4096);
			break;
		default:	/* the read-only local MR's range with the main lkey */
			sge[j].addr = (uintptr_t)z->c->ro_local;
			sge[j].length = 8;
			break;
		}
		if (w->opcode != IBV_WR_SEND && w->opcode != IBV_WR_SEND_WITH_IMM) {
			uint64_t tot = 0;

			for (uint32_t i = 0; i < nsge; i++)
				tot += sge[i].length;
			/* The remote side is valid whenever it can be. */
			if (tot <= J_BYTES)
				set_remote(w, junk_raddr(z, (uint32_t)tot), z->c->srv.trkey);
			else
				set_remote(w, tbase, z->c->srv.trkey);
		}
		w->num_sge = (int)nsge;
		snprintf(what, wlen, "opcode %d, SGE %u of %u at %#llx+%u (MR %#llx+%zu)", w->opcode, j,
			 nsge, (unsigned long long)sge[j].addr, sge[j].length,
			 (unsigned long long)mbase, z->c->mem_len);
		break;
	}
	case C_RKEY:
		w->opcode = pick(z, RDMA_OPS, 5);
		len = is_atomic(w->opcode) ? 8 : 1 + below(&z->r, 1024);
		sge[0] = junk_sge(z, len);
		set_remote(w, junk_raddr(z, len), bad_rkey(z));
		snprintf(what, wlen, "opcode %d, rkey %#x", w->opcode,
			 is_atomic(w->opcode) ? w->wr.atomic.rkey : w->wr.rdma.rkey);
		break;
	case C_RADDR: {
		uint32_t v = below(&z->r, 6);
		int ro = below(&z->r, 4) == 0;
		uint64_t b = ro ? z->c->srv.roaddr : tbase;
		uint64_t e = ro ? z->c->srv.roaddr + z->c->srv.rolen : tend;
		uint64_t ra;

		w->opcode = ro ? IBV_WR_RDMA_READ : pick(z, RDMA_OPS, 5);
		len = is_atomic(w->opcode) ? 8 : 1 + below(&z->r, 2048);
		sge[0] = junk_sge(z, len);
		switch (v) {
		case 0:	/* before the start */
			ra = b - 8 * (1 + below(&z->r, 512));
			break;
		case 1:	/* straddles the end */
			ra = is_atomic(w->opcode) ? e : e - len + 1 + below(&z->r, len);
			if (!is_atomic(w->opcode) && len == 1)
				ra = e;
			break;
		case 2:	/* far beyond */
			ra = e + 8 * below(&z->r, 1u << 20);
			break;
		case 3:
			ra = 0;
			break;
		case 4:	/* wraps */
			ra = UINT64_MAX & ~7ull;
			break;
		default:	/* straddles the start */
			ra = b - 8;
			if (!is_atomic(w->opcode) && len <= 8)
				ra = b - len;
			break;
		}
		set_remote(w, ra, ro ? z->c->srv.rorkey : z->c->srv.trkey);
		snprintf(what, wlen, "opcode %d, remote %#llx+%u (MR %#llx..%#llx)", w->opcode,
			 (unsigned long long)ra, len, (unsigned long long)b, (unsigned long long)e);
		break;
	}
	case C_RACCESS: {
		static const enum ibv_wr_opcode ops[] = { IBV_WR_RDMA_WRITE,
							  IBV_WR_RDMA_WRITE_WITH_IMM,
							  IBV_WR_ATOMIC_CMP_AND_SWP,
							  IBV_WR_ATOMIC_FETCH_AND_ADD };

		w->opcode = pick(z, ops, 4);
		len = is_atomic(w->opcode) ? 8 : 1 + below(&z->r, 1024);
		sge[0] = junk_sge(z, len);
		set_remote(w, z->c->srv.roaddr + (below(&z->r, RO_BYTES - 1024) & ~7u),
			   z->c->srv.rorkey);
		snprintf(what, wlen, "opcode %d on the read-only MR", w->opcode);
		break;
	}
	case C_LACCESS:
		w->opcode = below(&z->r, 2) ? IBV_WR_RDMA_READ : pick(z, ATOMIC_OPS, 2);
		len = is_atomic(w->opcode) ? 8 : 1 + below(&z->r, 4096);
		sge[0] = (struct ibv_sge){ (uintptr_t)z->c->ro_local +
					   (is_atomic(w->opcode) ? 8 * below(&z->r, 8) : 0),
					   len, z->c->ro_mr->lkey };
		set_remote(w, junk_raddr(z, len), z->c->srv.trkey);
		snprintf(what, wlen, "opcode %d into a local MR without LOCAL_WRITE", w->opcode);
		break;
	case C_OPCODE: {
		static const int ops[] = { IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, IBV_WR_SEND_WITH_INV,
					   IBV_WR_TSO, IBV_WR_DRIVER1, 12, 13, 14,
					   IBV_WR_ATOMIC_WRITE, 16, 200, 0x7fffffff };

		w->opcode = (enum ibv_wr_opcode)ops[below(&z->r, sizeof(ops) / sizeof(ops[0]))];
		sge[0] = junk_sge(z, 8);
		w->wr.rdma.remote_addr = junk_raddr(z, 8);
		w->wr.rdma.rkey = z->c->srv.trkey;
		snprintf(what, wlen, "opcode %d", w->opcode);
		break;
	}
	case C_NSGE:
		w->opcode = pick(z, ALL_OPS, 5);	/* SEND .. READ */
		nsge = maxsge + 1 + below(&z->r, 16 - maxsge);
		for (uint32_t i = 0; i < nsge; i++)
			sge[i] = junk_sge(z, 1 + below(&z->r, 64));
		w->num_sge = (int)nsge;
		set_remote(w, junk_raddr(z, 16 * 64), z->c->srv.trkey);
		snprintf(what, wlen, "opcode %d, num_sge %u (max %u)", w->opcode, nsge, maxsge);
		break;
	case C_NSGE_NEG:
		w->opcode = pick(z, ALL_OPS, 7);
		sge[0] = junk_sge(z, 8);
		set_remote(w, junk_raddr(z, 8), z->c->srv.trkey);
		switch (below(&z->r, 3)) {
		case 0:
			w->num_sge = -1;
			break;
		case 1:
			w->num_sge = INT_MIN;
			break;
		default:
			w->num_sge = 1 + (int)below(&z->r, maxsge);
			w->sg_list = NULL;
			break;
		}
		snprintf(what, wlen, "opcode %d, num_sge %d, sg_list %p", w->opcode, w->num_sge,
			 (void *)w->sg_list);
		break;
	case C_INLINE: {
		static const enum ibv_wr_opcode ops[] = { IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
							  IBV_WR_RDMA_WRITE,
							  IBV_WR_RDMA_WRITE_WITH_IMM };
		uint32_t tot = maxinl + 1 + below(&z->r, 3000), left;

		w->opcode = pick(z, ops, 4);
		nsge = 1 + below(&z->r, maxsge);
		if (nsge > tot)
			nsge = 1;
		left = tot;
		for (uint32_t i = 0; i < nsge; i++) {
			uint32_t l = i + 1 == nsge ? left : left / (nsge - i);

			sge[i] = junk_sge(z, l);
			left -= l;
		}
		w->num_sge = (int)nsge;
		w->send_flags |= IBV_SEND_INLINE;
		set_remote(w, junk_raddr(z, tot), z->c->srv.trkey);
		snprintf(what, wlen, "opcode %d, %u inline bytes in %u SGEs (max %u)", w->opcode, tot,
			 nsge, maxinl);
		break;
	}
	case C_INLINE_OP: {
		static const enum ibv_wr_opcode ops[] = { IBV_WR_RDMA_READ,
							  IBV_WR_ATOMIC_CMP_AND_SWP,
							  IBV_WR_ATOMIC_FETCH_AND_ADD };

		w->opcode = pick(z, ops, 3);
		len = is_atomic(w->opcode) ? 8 : 1 + below(&z->r, maxinl ? maxinl : 1);
		sge[0] = junk_sge(z, len);
		w->send_flags |= IBV_SEND_INLINE;
		set_remote(w, junk_raddr(z, len), z->c->srv.trkey);
		snprintf(what, wlen, "opcode %d with IBV_SEND_INLINE, %u bytes", w->opcode, len);
		break;
	}
	case C_ATOM_ALIGN:
		w->opcode = pick(z, ATOMIC_OPS, 2);
		sge[0] = junk_sge(z, 8);
		set_remote(w, junk_raddr(z, 16), z->c->srv.trkey);
		if (below(&z->r, 2)) {
			w->wr.atomic.remote_addr += 1 + below(&z->r, 7);
			snprintf(what, wlen, "opcode %d, remote address %#llx", w->opcode,
				 (unsigned long long)w->wr.atomic.remote_addr);
		} else {
			sge[0].addr += 1 + below(&z->r, 7);
			snprintf(what, wlen, "opcode %d, local address %#llx", w->opcode,
				 (unsigned long long)sge[0].addr);
		}
		break;
	case C_ATOM_LEN:
		w->opcode = pick(z, ATOMIC_OPS, 2);
		set_remote(w, junk_raddr(z, 8), z->c->srv.trkey);
		switch (below(&z->r, 3)) {
		case 0:	/* one SGE of 0..7 or 9..64 bytes */
			len = below(&z->r, 64);
			if (len >= 8)
				len++;
			sge[0] = junk_sge(z, 72);
			sge[0].length = len;
			break;
		case 1:	/* no SGE */
			w->num_sge = 0;
			break;
		default:	/* two of 4 bytes */
			sge[0] = junk_sge(z, 8);
			sge[0].length = 4;
			sge[1] = sge[0];
			sge[1].addr += 4;
			w->num_sge = 2;
			break;
		}
		snprintf(what, wlen, "opcode %d, num_sge %d, length %u", w->opcode, w->num_sge,
			 w->num_sge ? sge[0].length : 0);
		break;
	default:
		CT_FAIL("category %d", cat);
	}
}

/* F's valid WR number `posted` (a READ of the read-only MR or a WRITE to F's area). */
static void make_valid_f(struct fuzz *z, struct ibv_send_wr *w, struct ibv_sge *sge, int sig)
{
	uint32_t n = z->posted, s = n % FS;
	struct fop *o = &z->ops[s];

	memset(w, 0, sizeof(*w));
	o->kind = (uint8_t)below(&z->r, 2);
	o->len = 1 + below(&z->r, FSLOT);
	o->sig = (uint8_t)sig;
	sge->addr = (uintptr_t)(z->floc + (size_t)s * FSLOT);
	sge->length = o->len;
	sge->lkey = z->c->mr->lkey;
	w->wr_id = TAG_F | n;
	w->sg_list = sge;
	w->num_sge = 1;
	w->send_flags = sig ? IBV_SEND_SIGNALED : 0;
	if (o->kind == 0) {
		o->off = below(&z->r, RO_BYTES - o->len + 1);
		memset(z->floc + (size_t)s * FSLOT, 0xee, o->len);
		w->opcode = IBV_WR_RDMA_READ;
		w->wr.rdma.remote_addr = z->c->srv.roaddr + o->off;
		w->wr.rdma.rkey = z->c->srv.rorkey;
	} else {
		o->seed = 0x40000000u + n;
		ct_fill(z->floc + (size_t)s * FSLOT, o->len, o->seed);
		w->opcode = IBV_WR_RDMA_WRITE;
		w->wr.rdma.remote_addr = z->c->srv.taddr + FUZZ_OFF + F_AREA + (size_t)s * FSLOT;
		w->wr.rdma.rkey = z->c->srv.trkey;
	}
}

/* F's WR `posted` was accepted. */
static void f_posted(struct fuzz *z)
{
	struct fop *o = &z->ops[z->posted % FS];

	if (o->sig)
		z->sig_q[z->sig_tail++ % FS] = z->posted;
	if (o->kind == 1) {
		z->slot_seed[z->posted % FS] = o->seed;
		z->slot_len[z->posted % FS] = o->len;
	}
	z->run = o->sig ? 0 : z->run + 1;
	z->posted++;
}

static int poll_f(struct fuzz *z)
{
	struct ibv_wc wc[16];
	int k = ibv_poll_cq(z->fscq, 16, wc);

	CT_CHECK(k >= 0, "poll F: %d", k);
	for (int i = 0; i < k; i++) {
		uint64_t tag = wc[i].wr_id & TAG_MASK;
		uint32_t n = (uint32_t)wc[i].wr_id;

		CT_CHECK(tag == TAG_F, "F: completion of wr_id %#llx (%s): a WR that must not "
			 "have been posted", (unsigned long long)wc[i].wr_id,
			 tag == TAG_BAD ? "the malformed WR" : tag == TAG_NEVER ?
			 "the WR chained after a malformed one" : "unknown");
		CT_CHECK(wc[i].status == IBV_WC_SUCCESS, "F: WR %u completed with %s", n,
			 ibv_wc_status_str(wc[i].status));
		CT_CHECK(wc[i].qp_num == z->f->qp_num, "F: wc.qp_num %#x", wc[i].qp_num);
		if (z->sig_head == z->sig_tail || n != z->sig_q[z->sig_head % FS])
			CT_FAIL("F: completion of WR %u, expected %u (order)", n,
				z->sig_head != z->sig_tail ? z->sig_q[z->sig_head % FS] : ~0u);
		z->sig_head++;
		for (uint32_t m = z->done; m <= n; m++) {
			struct fop *o = &z->ops[m % FS];

			if (o->kind == 0) {
				const uint8_t *got = z->floc + (size_t)(m % FS) * FSLOT;

				if (memcmp(got, z->ro_expect + o->off, o->len) != 0)
					CT_FAIL("F: READ %u (%u bytes at %u) returned wrong data", m,
						o->len, o->off);
			}
		}
		z->done = n + 1;
		z->fwcs++;
	}
	return k;
}

/* Room for a chain of two valid WRs on F. */
static void f_room(struct fuzz *z)
{
	uint64_t t0 = ct_now_ns();

	while (z->posted - z->done > FS - 4) {
		if (!poll_f(z)) {
			CT_CHECK(ms_since(t0) < IDLE_MS, "F: no completion for %d ms (posted %u, done %u)",
				 IDLE_MS, z->posted, z->done);
			usleep(20);
		}
	}
}

static void g_wait(struct fuzz *z, struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_opcode op,
		   struct ibv_wc *out)
{
	struct ibv_wc wc;

	ct_poll_n(cq, &wc, 1, IDLE_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS, "G op %u: %s (wr_id %#llx)", z->gops,
		 ibv_wc_status_str(wc.status), (unsigned long long)wc.wr_id);
	CT_CHECK(wc.wr_id == wr_id, "G op %u: wr_id %#llx, expected %#llx", z->gops,
		 (unsigned long long)wc.wr_id, (unsigned long long)wr_id);
	CT_CHECK(wc.qp_num == z->g->qp_num, "G: wc.qp_num %#x", wc.qp_num);
	CT_CHECK(wc.opcode == op, "G op %u: opcode %s, expected %s", z->gops,
		 ct_wc_opcode_str(wc.opcode), ct_wc_opcode_str(op));
	if (out)
		*out = wc;
}

/* One verified round on G: an echo, a WRITE + READ back, a READ. */
static void g_round(struct fuzz *z)
{
	struct client *c = z->c;
	struct ibv_send_wr w[2], *bad = NULL;
	struct ibv_sge s[2];
	struct ibv_wc wc;
	uint32_t len, off, seed = 0x50000000u + z->gops;

	/* Echo. */
	len = 1 + below(&z->r, 2048);
	{
		struct ibv_sge rs = { (uintptr_t)z->grecv, 4096, c->mr->lkey };
		struct ibv_recv_wr rw = { .wr_id = TAG_G | z->gid, .sg_list = &rs, .num_sge = 1 };
		struct ibv_recv_wr *rb = NULL;

		CT_OK(ibv_post_recv(z->g, &rw, &rb));
	}
	ct_fill(z->gsend, len, seed);
	s[0] = (struct ibv_sge){ (uintptr_t)z->gsend, len, c->mr->lkey };
	memset(w, 0, sizeof(w));
	w[0].wr_id = TAG_G | ++z->gid;
	w[0].sg_list = &s[0];
	w[0].num_sge = 1;
	w[0].opcode = IBV_WR_SEND;
	w[0].send_flags = IBV_SEND_SIGNALED;
	CT_OK(ibv_post_send(z->g, &w[0], &bad));
	g_wait(z, z->gscq, w[0].wr_id, IBV_WC_SEND, NULL);
	ct_poll_n(z->grcq, &wc, 1, IDLE_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV, "G echo %u: %s", z->gops,
		 ibv_wc_status_str(wc.status));
	CT_CHECK(wc.wr_id == (TAG_G | (z->gid - 1)), "G echo: recv wr_id");
	CT_CHECK(wc.qp_num == z->g->qp_num, "G echo: qp_num");
	CT_CHECK(wc.byte_len == len, "G echo %u: %u bytes, sent %u", z->gops, wc.byte_len, len);
	check_pattern(z->grecv, len, seed, "G echo", 0, z->gops);

	/* WRITE (unsignaled) then READ back (signaled), one chain. */
	len = 1 + below(&z->r, G_BYTES);
	off = below(&z->r, G_BYTES - len + 1);
	ct_fill(z->gsend, len, seed + 1);
	memset(z->gread, 0xee, len);
	s[0] = (struct ibv_sge){ (uintptr_t)z->gsend, len, c->mr->lkey };
	s[1] = (struct ibv_sge){ (uintptr_t)z->gread, len, c->mr->lkey };
	memset(w, 0, sizeof(w));
	w[0].wr_id = TAG_G | ++z->gid;
	w[0].sg_list = &s[0];
	w[0].num_sge = 1;
	w[0].opcode = IBV_WR_RDMA_WRITE;
	w[0].wr.rdma.remote_addr = c->srv.taddr + FUZZ_OFF + G_AREA + off;
	w[0].wr.rdma.rkey = c->srv.trkey;
	w[0].next = &w[1];
	w[1] = w[0];
	w[1].next = NULL;
	w[1].wr_id = TAG_G | ++z->gid;
	w[1].sg_list = &s[1];
	w[1].opcode = IBV_WR_RDMA_READ;
	w[1].send_flags = IBV_SEND_SIGNALED;
	CT_OK(ibv_post_send(z->g, &w[0], &bad));
	g_wait(z, z->gscq, w[1].wr_id, IBV_WC_RDMA_READ, NULL);
	check_pattern(z->gread, len, seed + 1, "G WRITE read back", 0, z->gops);

	/* READ of the read-only MR. */
	len = 1 + below(&z->r, 8192);
	off = below(&z->r, RO_BYTES - len + 1);
	memset(z->gread, 0xee, len);
	s[0] = (struct ibv_sge){ (uintptr_t)z->gread, len, c->mr->lkey };
	memset(w, 0, sizeof(w));
	w[0].wr_id = TAG_G | ++z->gid;
	w[0].sg_list = &s[0];
	w[0].num_sge = 1;
	w[0].opcode = IBV_WR_RDMA_READ;
	w[0].send_flags = IBV_SEND_SIGNALED;
	w[0].wr.rdma.remote_addr = c->srv.roaddr + off;
	w[0].wr.rdma.rkey = c->srv.rorkey;
	CT_OK(ibv_post_send(z->g, &w[0], &bad));
	g_wait(z, z->gscq, w[0].wr_id, IBV_WC_RDMA_READ, NULL);
	if (memcmp(z->gread, z->ro_expect + off, len) != 0)
		CT_FAIL("G op %u: READ of %u bytes at %u returned wrong data", z->gops, len, off);
	z->gops++;
}

static void part2(struct client *c)
{
	static struct fuzz z;
	static struct tally tl[NCAT];
	int nfuzz = env_int("CT_FUZZ", 10000), g_every = 25, before = 20, after = 20, fails = 0;
	uint64_t t0 = ct_now_ns(), errs0 = krcore_stat_get(KRCORE_STAT_POST_ERRORS);
	unsigned prefixed = 0, suffixed = 0;

	ct_begin("vqp_stress: fuzz");
	memset(&z, 0, sizeof(z));
	memset(tl, 0, sizeof(tl));
	z.c = c;
	z.r.s = 0x6b72636f72650001ull;
	z.floc = c->mem + M_F;
	z.junk = c->mem + M_FJUNK;
	z.frecv = c->mem + M_FRECV;
	z.gsend = c->mem + M_G;
	z.grecv = c->mem + M_G + 8192;
	z.gread = c->mem + M_G + 16384;
	z.ro_expect = malloc(RO_BYTES);
	CT_CHECK(z.ro_expect != NULL, "alloc");
	ct_fill(z.ro_expect, RO_BYTES, RO_SEED);
	z.fscq = CT_PTR(ibv_create_cq(c->d.ctx, 256, NULL, NULL, 0));
	z.frcq = CT_PTR(ibv_create_cq(c->d.ctx, 16, NULL, NULL, 0));
	z.gscq = CT_PTR(ibv_create_cq(c->d.ctx, 64, NULL, NULL, 0));
	z.grcq = CT_PTR(ibv_create_cq(c->d.ctx, 16, NULL, NULL, 0));
	z.f = make_vqp(&c->d, z.fscq, z.frcq, 64, 4, 3, 64, &z.fcap);
	z.g = make_vqp(&c->d, z.gscq, z.grcq, 16, 4, 1, 0, NULL);
	CT_CHECK(z.fcap.max_send_sge == 3 && z.fcap.max_inline_data == 64,
		 "F caps: %u SGEs, %u inline", z.fcap.max_send_sge, z.fcap.max_inline_data);
	CT_OK(qconnect(z.f, ct_node_gid(1), PORT));
	CT_OK(qconnect(z.g, ct_node_gid(1), PORT));

	for (int i = 0; i < before; i++)
		g_round(&z);

	for (int i = 0; i < nfuzz; i++) {
		struct ibv_send_wr pre, b, suf, *head, *bad = (struct ibv_send_wr *)1;
		struct ibv_sge pre_sge, b_sge[16], suf_sge;
		enum cat cat = (enum cat)below(&z.r, NCAT);
		struct tally *t = &tl[cat];
		int has_pre = (int)below(&z.r, 2), has_suf = below(&z.r, 3) == 0, rc;
		char what[200];

		f_room(&z);
		memset(b_sge, 0, sizeof(b_sge));
		make_bad(&z, cat, &b, b_sge, what, sizeof(what));
		b.wr_id = TAG_BAD | (uint64_t)i;
		b.next = NULL;
		head = &b;
		if (has_suf) {
			suf_sge = (struct ibv_sge){ (uintptr_t)z.junk, 64, c->mr->lkey };
			memset(&suf, 0, sizeof(suf));
			suf.wr_id = TAG_NEVER | (uint64_t)i;
			suf.sg_list = &suf_sge;
			suf.num_sge = 1;
			suf.opcode = IBV_WR_RDMA_READ;
			suf.send_flags = IBV_SEND_SIGNALED;
			suf.wr.rdma.remote_addr = c->srv.roaddr;
			suf.wr.rdma.rkey = c->srv.rorkey;
			b.next = &suf;
			suffixed++;
		}
		if (has_pre) {
			make_valid_f(&z, &pre, &pre_sge, below(&z.r, 3) == 0 || z.run >= 12);
			pre.next = &b;
			head = &pre;
			prefixed++;
		}
		rc = ibv_post_send(z.f, head, &bad);
		if (rc == 0)
			CT_FAIL("fuzz WR %d (%s: %s) was accepted: it reached the shared link", i,
				cat_name[cat], what);
		if (has_pre && bad == &pre)
			CT_FAIL("fuzz WR %d: the valid WR before it was refused (%d, %s)", i, rc,
				strerror(rc));
		if (has_pre)
			f_posted(&z);
		t->n++;
		if (rc == EINVAL && bad == &b) {
			t->ok++;
		} else {
			if (rc != EINVAL)
				t->wrong_errno++;
			if (bad != &b)
				t->wrong_bad++;
			if (!t->first[0]) {
				t->first_errno = rc;
				snprintf(t->first, sizeof(t->first), "WR %d (%s): returned %d (%s), "
					 "*bad_wr %s", i, what, rc, strerror(rc),
					 bad == &b ? "right" : bad == &suf ? "the WR after it" :
					 bad == &pre ? "the WR before it" : "elsewhere");
			}
		}
		poll_f(&z);
		if (i % g_every == g_every - 1)
			g_round(&z);
	}
	/* Drain F: a last signaled WR covers any unsignaled tail. */
	{
		struct ibv_send_wr w, *bad = NULL;
		struct ibv_sge s;
		uint64_t tw = ct_now_ns();

		f_room(&z);
		make_valid_f(&z, &w, &s, 1);
		CT_OK(ibv_post_send(z.f, &w, &bad));
		f_posted(&z);
		while (z.done < z.posted) {
			if (!poll_f(&z)) {
				CT_CHECK(ms_since(tw) < IDLE_MS, "F: drain stuck at %u of %u", z.done,
					 z.posted);
				usleep(20);
			}
		}
	}
	/* F's WRITEs landed: READ F's area back through F. */
	{
		uint8_t *back = z.junk;
		struct ibv_wc wc;

		memset(back, 0xee, FS * FSLOT);
		CT_OK(ct_post_send1(z.f, TAG_F | 0xffffffu, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED,
				    &(struct ct_buf){ c->mem, c->mem_len, c->mr },
				    (size_t)(back - c->mem), FS * FSLOT,
				    c->srv.taddr + FUZZ_OFF + F_AREA, c->srv.trkey, 0));
		ct_poll_n(z.fscq, &wc, 1, IDLE_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == (TAG_F | 0xffffffu),
			 "F read-back: %s", ibv_wc_status_str(wc.status));
		for (int s = 0; s < FS; s++)
			if (z.slot_seed[s])
				check_pattern(back + (size_t)s * FSLOT, z.slot_len[s], z.slot_seed[s],
					      "F's WRITE", 0, (uint32_t)s);
	}
	/* F still echoes. */
	{
		struct ibv_sge rs = { (uintptr_t)z.frecv, 4096, c->mr->lkey };
		struct ibv_recv_wr rw = { .wr_id = 4242, .sg_list = &rs, .num_sge = 1 };
		struct ibv_recv_wr *rb = NULL;
		struct ibv_wc wc;

		CT_OK(ibv_post_recv(z.f, &rw, &rb));
		ct_fill(z.frecv + 4096, 64, 0x60000000u);
		CT_OK(ct_post_send1(z.f, TAG_F | 0xfffffeu, IBV_WR_SEND, IBV_SEND_SIGNALED,
				    &(struct ct_buf){ c->mem, c->mem_len, c->mr },
				    (size_t)(z.frecv + 4096 - c->mem), 64, 0, 0, 0));
		ct_poll_n(z.fscq, &wc, 1, IDLE_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == (TAG_F | 0xfffffeu) &&
			 wc.qp_num == z.f->qp_num, "F's final echo SEND: %s",
			 ibv_wc_status_str(wc.status));
		ct_poll_n(z.frcq, &wc, 1, IDLE_MS);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 4242 && wc.byte_len == 64 &&
			 wc.qp_num == z.f->qp_num, "F's final echo: %s, %u bytes",
			 ibv_wc_status_str(wc.status), wc.byte_len);
		ct_expect_pattern(z.frecv, 64, 0x60000000u, "F's final echo");
	}
	for (int i = 0; i < after; i++)
		g_round(&z);
	ct_expect_quiet(z.fscq, 100, "F after the fuzz");
	ct_expect_quiet(z.gscq, 100, "G after the fuzz");

	for (int k = 0; k < NCAT; k++) {
		ct_note("%-32s %5u WRs, %5u EINVAL with the right *bad_wr%s%s", cat_name[k], tl[k].n,
			tl[k].ok, tl[k].first[0] ? "; first wrong: " : "", tl[k].first);
		fails += tl[k].n - tl[k].ok;
		CT_CHECK(tl[k].n > 0, "category %s never drawn", cat_name[k]);
	}
	CT_KRCORE_STAT(KRCORE_STAT_POST_ERRORS, >=, errs0 + (uint64_t)nfuzz);
	ct_note("%d malformed WRs (%u behind a valid WR, %u with a WR after them), %u valid F WRs "
		"(%u completions), %u G rounds (echo + WRITE/READ + READ) with zero errors; %llu ms",
		nfuzz, prefixed, suffixed, z.posted, z.fwcs, z.gops,
		(unsigned long long)ms_since(t0));
	CT_CHECK(fails == 0, "%d malformed WRs did not get EINVAL with the right *bad_wr", fails);
	CT_OK(ibv_destroy_qp(z.f));
	CT_OK(ibv_destroy_qp(z.g));
	CT_OK(ibv_destroy_cq(z.fscq));
	CT_OK(ibv_destroy_cq(z.frcq));
	CT_OK(ibv_destroy_cq(z.gscq));
	CT_OK(ibv_destroy_cq(z.grcq));
	free(z.ro_expect);
	ct_pass();
}

/* ---- the client ------------------------------------------------------------ */

static void ctl_call(struct client *c, struct ibv_qp *qp, struct ibv_cq *scq, struct ibv_cq *rcq,
		     char cmd)
{
	uint8_t *sb = c->mem + M_CTL, *rb = c->mem + M_CTL + 4096;
	struct ibv_sge rs = { (uintptr_t)rb, 4096, c->mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 7, .sg_list = &rs, .num_sge = 1 };
	struct ibv_recv_wr *rbad = NULL;
	struct ibv_sge ss = { (uintptr_t)sb, CTL_LEN, c->mr->lkey };
	struct ibv_send_wr sw = { .wr_id = 8, .sg_list = &ss, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *sbad = NULL;
	struct ctl m;
	struct ibv_wc wc;

	memset(sb, 0, CTL_LEN);
	memset(&m, 0, sizeof(m));
	memcpy(m.magic, "KRSTRESS", 8);
	m.cmd = cmd;
	memcpy(sb, &m, sizeof(m));
	CT_OK(ibv_post_recv(qp, &rw, &rbad));
	CT_OK(ibv_post_send(qp, &sw, &sbad));
	ct_poll_n(scq, &wc, 1, IDLE_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 8, "control SEND: %s",
		 ibv_wc_status_str(wc.status));
	ct_poll_n(rcq, &wc, 1, IDLE_MS);
	CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 7 && wc.byte_len == CTL_LEN,
		 "control reply: %s, %u bytes", ibv_wc_status_str(wc.status), wc.byte_len);
	memcpy(&m, rb, sizeof(m));
	CT_CHECK(is_ctl(rb, CTL_LEN) && m.cmd == cmd, "control reply");
	if (cmd == 'M')
		c->srv = m;
}

static int client(void)
{
	static struct client c;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *ctl;

	ct_begin("vqp_stress client setup");
	memset(&c, 0, sizeof(c));
	c.units = env_int("CT_STRESS_UNITS", 50);
	c.units = (c.units + SIG_EVERY - 1) / SIG_EVERY * SIG_EVERY;	/* last WR signaled */
	CT_CHECK(c.units >= NS && c.units < 65536, "CT_STRESS_UNITS");
	open_node(&c.d, 2);
	c.mem_len = M_BYTES;
	c.mem = aligned_alloc(4096, (c.mem_len + 4095) / 4096 * 4096);
	c.ro_local = aligned_alloc(4096, 4096);
	CT_CHECK(c.mem && c.ro_local, "alloc");
	memset(c.mem, 0, c.mem_len);
	memset(c.ro_local, 0x55, 4096);
	c.mr = CT_PTR(ibv_reg_mr(c.d.pd, c.mem, c.mem_len, IBV_ACCESS_LOCAL_WRITE));
	c.ro_mr = CT_PTR(ibv_reg_mr(c.d.pd, c.ro_local, 4096, 0));
	scq = CT_PTR(ibv_create_cq(c.d.ctx, 16, NULL, NULL, 0));
	rcq = CT_PTR(ibv_create_cq(c.d.ctx, 16, NULL, NULL, 0));
	ctl = make_vqp(&c.d, scq, rcq, 4, 4, 1, 0, NULL);
	CT_OK(qconnect(ctl, ct_node_gid(1), PORT));
	ctl_call(&c, ctl, scq, rcq, 'M');
	CT_CHECK(c.srv.tlen == TGT_BYTES && c.srv.rolen == RO_BYTES, "server memory");
	ct_pass();

	part1(&c);
	part2(&c);

	ct_begin("vqp_stress client teardown");
	ctl_call(&c, ctl, scq, rcq, 'Q');
	CT_OK(ibv_destroy_qp(ctl));
	CT_OK(ibv_destroy_cq(scq));
	CT_OK(ibv_destroy_cq(rcq));
	ct_pass();
	return 0;
}

/* ---- orchestration (as vqp_echo) ------------------------------------------ */

int main(void)
{
	pid_t meta_pid, srv, cli;
	int fails = 0;
	uint64_t t0 = ct_now_ns();

	setvbuf(stdout, NULL, _IOLBF, 0);
	ct_watchdog(120);
	meta_pid = ct_start_meta();
	srv = ct_fork_ready(server, "the server (qbind)");
	cli = fork();
	if (cli == 0)
		_exit(client());
	fails += ct_wait_child(cli, "client");
	if (fails)
		kill(srv, SIGTERM);
	fails += ct_wait_child(srv, "server");
	kill(meta_pid, SIGTERM);
	waitpid(meta_pid, NULL, 0);
	ct_begin("vqp_stress");
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	ct_note("total %llu ms", (unsigned long long)ms_since(t0));
	ct_pass();
	return 0;
}
