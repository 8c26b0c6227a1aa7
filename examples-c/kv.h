/*
 * kv.h: what kv_server.c and kv_client.c share: the hash table's layout in
 * the server's registered memory, the value format every GET is checked
 * against, the messages, and a few helpers (device, GIDs, waiting for a
 * completion).
 *
 * The table is an array of NBUCKETS buckets (a power of two), each
 * KV_SLOTS slots of 96 bytes:
 *
 *   version  8 B   even: stable; odd: the server is writing the slot
 *   key      8 B   0: the slot is empty (keys are 1 .. 2^64-1)
 *   value   64 B   see kv_value_fill
 *   check    8 B   kv_check(version, key, value)
 *   pad      8 B
 *
 * A key lives in the first bucket of its probe path (kv_bucket_of(key),
 * then the next ones, at most KV_PROBES) that holds it or has an empty
 * slot. A GET is one RDMA READ of a whole bucket (384 B): the key is found
 * there, or the bucket has an empty slot (the key is absent), or it is
 * full and the GET READs the next bucket. Nothing is ever deleted, so the
 * probe path of a key never gets a hole.
 *
 * The server writes a slot with its CPU while clients may READ it: an RDMA
 * READ is not atomic with respect to the CPU's stores (it may see some
 * bytes old and some new, in any order). So a reader accepts a slot only
 * if its version is even and its check matches: a READ that overlapped a
 * write sees a mix of old and new fields and (but for a 2^-64 chance) a
 * wrong check, and READs the bucket again ("torn read").
 *
 * Everything is in host byte order: client and server must run on hosts
 * of the same endianness (the magic numbers detect a mismatch).
 */
#ifndef KV_H
#define KV_H

#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KV_VALUE_LEN 64
#define KV_SLOTS 4
#define KV_PROBES 8
#define KV_OBJECT_LEN (64 * 1024) /* the "object" of the serverless read */
#define KV_MSG_MAGIC 0x4b564d31u  /* "KVM1" */
#define KV_CONN_MAGIC 0x4b564331u /* "KVC1" */
#define KV_DEFAULT_PORT 18800	  /* raw: TCP port; krcore: the qbind port */

struct kv_slot {
	uint64_t version;
	uint64_t key;
	uint8_t value[KV_VALUE_LEN];
	uint64_t check;
	uint64_t pad;
};

struct kv_bucket {
	struct kv_slot slot[KV_SLOTS];
};

_Static_assert(sizeof(struct kv_slot) == 96, "slot layout");
_Static_assert(sizeof(struct kv_bucket) == 384, "bucket layout");

/* Where a client finds the table and the object: learned at connect
 * (raw: in the TCP exchange; krcore: in the answer to a HELLO message). */
struct kv_table_info {
	uint64_t table_addr;	/* remote address of bucket 0 */
	uint64_t object_addr;	/* remote address of the 64 KiB object */
	uint32_t rkey;		/* both are in one MR, remote READ only */
	uint32_t nbuckets;
	uint32_t object_len;
	uint32_t pad;
};

/* The messages of the message path (PUT, and krcore's HELLO): a client
 * sends one and waits for the answer, one at a time. */
enum kv_msg_type { KV_HELLO = 1, KV_HELLO_REPLY, KV_PUT, KV_PUT_REPLY };
enum kv_status { KV_OK = 0, KV_FULL, KV_BAD };

struct kv_msg {
	uint32_t magic;
	uint16_t type;
	uint16_t status;	/* replies: enum kv_status */
	uint64_t seq;		/* copied into the reply */
	uint64_t key;		/* PUT */
	union {
		uint8_t value[KV_VALUE_LEN];	/* PUT */
		struct kv_table_info info;	/* HELLO_REPLY */
	} u;
};

/* Raw verbs only: the TCP exchange that connects a client's RC QP to the
 * server's (the krcore build needs none: qconnect, then a HELLO). */
struct kv_conn_req {
	uint32_t magic;
	uint32_t qpn;
	uint32_t psn;
	uint32_t mtu;		/* the client port's active MTU (enum ibv_mtu) */
	uint8_t gid[16];
};

struct kv_conn_rep {
	uint32_t magic;
	uint32_t status;	/* 0, or an errno of the server's QP set-up */
	uint32_t qpn;
	uint32_t psn;
	uint32_t mtu;		/* the path MTU both sides use */
	uint32_t pad;
	uint8_t gid[16];
	struct kv_table_info info;
};

/* ---- hashing and the values' format ----------------------------------- */

/* splitmix64's finalizer: a good 64-bit mix, cheap. */
static inline uint64_t kv_mix(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 31;
	return x;
}

static inline uint32_t kv_bucket_of(uint64_t key, uint32_t nbuckets)
{
	return (uint32_t)(kv_mix(key) & (nbuckets - 1));
}

/* The check of a slot: every field a torn READ could mix up. */
static inline uint64_t kv_check(uint64_t version, uint64_t key,
				const uint8_t *value)
{
	uint64_t h = kv_mix(version ^ 0x6a09e667f3bcc908ull) ^ kv_mix(key);
	uint64_t w;

	for (int i = 0; i < KV_VALUE_LEN; i += 8) {
		memcpy(&w, value + i, 8);
		h = kv_mix(h ^ w);
	}
	return h;
}

/*
 * A value says what it is: bytes 0-7 the key, 8-15 a "generation" (what
 * a writer chose for this PUT: 1 for the load, then 2, 3...), 16-63 a
 * pattern of both. So a reader can check any value it gets (that it
 * belongs to this key and is whole) and also which PUT it came from.
 */
static inline void kv_value_fill(uint64_t key, uint64_t gen, uint8_t *v)
{
	memcpy(v, &key, 8);
	memcpy(v + 8, &gen, 8);
	for (int i = 16; i < KV_VALUE_LEN; i += 8) {
		uint64_t w = kv_mix(key * 31 + gen * 1000003 + (uint64_t)i);

		memcpy(v + i, &w, 8);
	}
}

/* 0 when v is a whole value of key (its generation in *gen), else -1. */
static inline int kv_value_ok(uint64_t key, const uint8_t *v, uint64_t *gen)
{
	uint8_t want[KV_VALUE_LEN];
	uint64_t k;

	memcpy(&k, v, 8);
	memcpy(gen, v + 8, 8);
	if (k != key)
		return -1;
	kv_value_fill(key, *gen, want);
	return memcmp(want, v, KV_VALUE_LEN) ? -1 : 0;
}

/* The object's byte i (the serverless read checks all 64 KiB). */
static inline uint8_t kv_object_byte(size_t i)
{
	return (uint8_t)kv_mix(i / 8 + 0x1234)  ^ (uint8_t)i;
}

/* ---- helpers -------------------------------------------------------- */

static inline double kv_now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* An IPv4 address becomes its RoCE v2 GID (IPv4-mapped IPv6,
 * ::ffff:a.b.c.d); anything else must be a GID in IPv6 notation. */
static inline int kv_parse_gid(const char *s, union ibv_gid *gid)
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

/* The IPv4 address of an IPv4-mapped GID, or -1. */
static inline int kv_gid_ipv4(const union ibv_gid *g, struct in_addr *out)
{
	static const uint8_t prefix[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
					    0xff, 0xff };

	if (memcmp(g->raw, prefix, sizeof(prefix)))
		return -1;
	memcpy(&out->s_addr, g->raw + 12, 4);
	return 0;
}

/* Opens device `name` (NULL: the first one); NULL and a message on
 * stderr (prefixed `who`) when there is none. */
static inline struct ibv_context *kv_open_device(const char *who,
						 const char *name)
{
	struct ibv_device **list;
	struct ibv_context *ctx;
	int n, i;

	list = ibv_get_device_list(&n);
	if (!list) {
		fprintf(stderr, "%s: ibv_get_device_list: %s\n", who,
			strerror(errno));
		return NULL;
	}
	for (i = 0; i < n; i++)
		if (!name || !strcmp(ibv_get_device_name(list[i]), name))
			break;
	if (i == n) {
		fprintf(stderr, "%s: no RDMA device%s%s (%d found; on a machine "
			"without one, scripts/rxe-up.sh brings up Soft-RoCE)\n",
			who, name ? " named " : "", name ? name : "", n);
		ibv_free_device_list(list);
		return NULL;
	}
	ctx = ibv_open_device(list[i]);
	if (!ctx)
		fprintf(stderr, "%s: ibv_open_device(%s): %s\n", who,
			ibv_get_device_name(list[i]), strerror(errno));
	ibv_free_device_list(list);
	return ctx;
}

/* The index of `gid` in port `port`'s GID table, or -1. */
static inline int kv_find_gid(struct ibv_context *ctx, uint8_t port,
			      const union ibv_gid *gid)
{
	struct ibv_port_attr pa;
	union ibv_gid g;

	if (ibv_query_port(ctx, port, &pa))
		return -1;
	for (int i = 0; i < pa.gid_tbl_len; i++)
		if (!ibv_query_gid(ctx, port, i, &g) &&
		    !memcmp(&g, gid, sizeof(g)))
			return i;
	return -1;
}

/*
 * Waiting without burning a CPU that other processes need: poll and yield
 * for the first millisecond (a READ's round trip, a PUT's answer), then
 * sleep between polls, an eighth of the time waited so far, 50 us to 1 ms:
 * a completion waited for long is seen at most 1 ms (or 1/8) late, and no
 * busy loop holds a core while the peer is slow. Call kv_backoff after
 * each empty poll with *since = 0 at the start of the wait.
 */
static inline void kv_backoff(double *since)
{
	double now = kv_now_us(), waited;

	if (*since == 0)
		*since = now;
	waited = now - *since;
	if (waited < 1000) {
		sched_yield();
	} else {
		double us = waited / 8 < 50 ? 50 : waited / 8 > 1000 ? 1000 : waited / 8;
		struct timespec ts = { 0, (long)(us * 1000) };

		nanosleep(&ts, NULL);
	}
}

#endif
