/* SPDX-License-Identifier: MIT */
/*
 * What bench/connect.c and bench/datapath.c share of plain verbs: opening
 * a device's port 1 at a GID index, an RC QP's INIT / RTR / RTS, PSNs, and
 * RoCE v2 GIDs of IPv4 addresses. The includer defines
 *     static void die(const char *fmt, ...);
 * before including this file (each benchmark reports fatal errors its own
 * way).
 */
#ifndef KRCORE_BENCH_RC_H
#define KRCORE_BENCH_RC_H

#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>

/* What the RC transitions need of the local port. */
struct rc_port {
	uint8_t port;
	int gid_idx;
	enum ibv_mtu mtu;
	/* max_qp_rd_atom, at most 16 */
	uint8_t rd_atom;
};

/* Opens device `name`, checks that port 1 is active and that GID index
 * `gid_idx` is set; fills the GID and the port's facts. Dies on failure. */
static inline struct ibv_context *rc_open(const char *name, int gid_idx,
					  union ibv_gid *gid,
					  struct rc_port *rp)
{
	static const union ibv_gid zero;
	struct ibv_device **list;
	struct ibv_device_attr da;
	struct ibv_port_attr pa;
	struct ibv_context *ctx;
	int n, i, rc;

	memset(rp, 0, sizeof(*rp));
	rp->port = 1;
	rp->gid_idx = gid_idx;
	list = ibv_get_device_list(&n);
	if (!list)
		die("ibv_get_device_list: %s", strerror(errno));
	for (i = 0; i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), name))
			break;
	if (i == n)
		die("no RDMA device named %s (%d devices; run scripts/rxe-up.sh "
		    "first)", name, n);
	ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!ctx)
		die("ibv_open_device(%s): %s", name, strerror(errno));
	if ((rc = ibv_query_device(ctx, &da)))
		die("ibv_query_device: %s", strerror(rc));
	if ((rc = ibv_query_port(ctx, rp->port, &pa)))
		die("ibv_query_port: %s", strerror(rc));
	if (pa.state != IBV_PORT_ACTIVE)
		die("%s port %u is not active (state %d)", name, rp->port,
		    pa.state);
	rp->mtu = pa.active_mtu;
	rp->rd_atom = da.max_qp_rd_atom < 16 ? (uint8_t)da.max_qp_rd_atom : 16;
	if (rp->rd_atom < 1)
		die("%s supports no outstanding RDMA READ (max_qp_rd_atom %d)",
		    name, da.max_qp_rd_atom);
	if ((rc = ibv_query_gid(ctx, rp->port, gid_idx, gid)))
		die("ibv_query_gid(index %d): %s", gid_idx, strerror(rc));
	if (!memcmp(gid, &zero, sizeof(zero)))
		die("GID index %d of %s is empty (run scripts/rxe-up.sh with "
		    "enough nodes)", gid_idx, name);
	return ctx;
}

/* RESET -> INIT; the verb's errno. */
static inline int rc_to_init(const struct rc_port *rp, struct ibv_qp *qp,
			     int access)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = rp->port;
	a.qp_access_flags = access;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
					     IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

/* INIT -> RTR towards QP `dqpn` at `dgid`; the verb's errno. */
static inline int rc_to_rtr(const struct rc_port *rp, struct ibv_qp *qp,
			    uint32_t dqpn, uint32_t rq_psn,
			    const union ibv_gid *dgid)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = rp->mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = rp->rd_atom;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *dgid;
	a.ah_attr.grh.sgid_index = (uint8_t)rp->gid_idx;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = rp->port;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV |
					     IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					     IBV_QP_RQ_PSN |
					     IBV_QP_MAX_DEST_RD_ATOMIC |
					     IBV_QP_MIN_RNR_TIMER);
}

/* RTR -> RTS; the verb's errno. */
static inline int rc_to_rts(const struct rc_port *rp, struct ibv_qp *qp,
			    uint32_t sq_psn)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = sq_psn;
	a.max_rd_atomic = rp->rd_atom;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT |
					     IBV_QP_RETRY_CNT |
					     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					     IBV_QP_MAX_QP_RD_ATOMIC);
}

/* A 24-bit PSN from the xorshift state `*s` (which must not be 0). */
static inline uint32_t rc_rand_psn(uint32_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 17;
	*s ^= *s << 5;
	return *s & 0xffffff;
}

/* The IPv4 address of a RoCE v2 IPv4-mapped GID (::ffff:a.b.c.d). */
static inline int gid_ipv4(const union ibv_gid *g, struct in_addr *out)
{
	static const uint8_t prefix[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
					    0xff, 0xff };

	if (memcmp(g->raw, prefix, sizeof(prefix)))
		return -1;
	memcpy(&out->s_addr, g->raw + 12, 4);
	return 0;
}

/* The RoCE v2 GID of an IPv4 address (::ffff:a.b.c.d). */
static inline union ibv_gid gid_of_ipv4(const char *ip)
{
	union ibv_gid g;
	struct in_addr a;

	if (inet_pton(AF_INET, ip, &a) != 1)
		die("%s is not an IPv4 address", ip);
	memset(&g, 0, sizeof(g));
	g.raw[10] = g.raw[11] = 0xff;
	memcpy(g.raw + 12, &a.s_addr, 4);
	return g;
}

#endif
