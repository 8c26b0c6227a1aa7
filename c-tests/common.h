/*
 * Shared setup for the krcore C tests.
 *
 * Every test is one process on one RDMA device (rxe0 in the testbed VM):
 * QP "A" uses GID index 1, QP "B" uses GID index 2, and the two are connected
 * to each other with plain ibv_modify_qp (INIT/RTR/RTS over RoCE v2).
 *
 * Reporting: ct_begin("name") opens a sub-test, ct_pass() prints
 * "PASS name"; any failed check prints "FAIL name: reason" and exits 1.
 * Every wait is bounded (CT_TIMEOUT_MS) and a watchdog (SIGALRM) guards the
 * calls that can block (ibv_get_cq_event, ibv_get_async_event, destroy).
 *
 * Environment overrides: CT_DEVICE (default rxe0), CT_PORT (1),
 * CT_GID_A (1), CT_GID_B (2), CT_WATCHDOG (seconds, 120).
 */
#ifndef KRCORE_CT_COMMON_H
#define KRCORE_CT_COMMON_H

#include <infiniband/verbs.h>
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef HAVE_KRCORE
#include "krcore.h"
#endif

#define CT_TIMEOUT_MS 10000
/* How long "nothing else must complete" checks wait. */
#define CT_QUIET_MS 300

/* ---- reporting ------------------------------------------------------ */

void ct_begin(const char *name);
void ct_pass(void);
const char *ct_current(void);
_Noreturn void ct_fail_at(const char *file, int line, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
void ct_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define CT_FAIL(...) ct_fail_at(__FILE__, __LINE__, __VA_ARGS__)
#define CT_CHECK(cond, ...)                                                   \
	do {                                                                  \
		if (!(cond))                                                  \
			ct_fail_at(__FILE__, __LINE__, "check `" #cond        \
				   "` failed: " __VA_ARGS__);                 \
	} while (0)
/* For calls returning 0 or an errno value. */
#define CT_OK(call)                                                           \
	do {                                                                  \
		int ct_rc_ = (call);                                          \
		if (ct_rc_)                                                   \
			ct_fail_at(__FILE__, __LINE__, "%s returned %d (%s)", \
				   #call, ct_rc_, strerror(ct_rc_));          \
	} while (0)
/* For calls returning a pointer (NULL + errno on failure). */
#define CT_PTR(call)                                                          \
	({                                                                    \
		errno = 0;                                                    \
		__typeof__(call) ct_p_ = (call);                              \
		if (!ct_p_)                                                   \
			ct_fail_at(__FILE__, __LINE__,                        \
				   "%s returned NULL (errno %d: %s)", #call,  \
				   errno, strerror(errno));                   \
		ct_p_;                                                        \
	})

/* ---- device --------------------------------------------------------- */

struct ct_dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	uint8_t port;
	struct ibv_port_attr port_attr;
	struct ibv_device_attr dev_attr;
	int gid_idx[2];		/* [0] for QP A, [1] for QP B */
	union ibv_gid gid[2];
};

/* Installs the watchdog, opens the device, allocates a PD, queries GIDs. */
void ct_open(struct ct_dev *d);
/* Deallocates the PD and closes the device (checked). */
void ct_close(struct ct_dev *d);

/* Re-arms the watchdog to `seconds` from now. */
void ct_watchdog(unsigned seconds);

/* ---- QPs ------------------------------------------------------------ */

struct ct_qp_caps {
	uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge;
	uint32_t max_inline;
	int sq_sig_all;
};
#define CT_QP_CAPS_DEFAULT \
	((struct ct_qp_caps){ 64, 64, 4, 4, 64, 0 })

/* Plain ibv_create_qp, RC. srq may be NULL. */
struct ibv_qp *ct_create_rc_qp(struct ct_dev *d, struct ibv_cq *scq,
			       struct ibv_cq *rcq, struct ibv_srq *srq,
			       struct ct_qp_caps caps);

/*
 * Moves `qp` RESET->INIT->RTR->RTS towards (dqpn, dgid), with local GID index
 * `sgid_idx`. Access: local write, remote read/write/atomic. Returns 0 or the
 * failing ibv_modify_qp's error (does not fail the test by itself).
 */
int ct_connect_qp(struct ct_dev *d, struct ibv_qp *qp, int sgid_idx,
		  uint32_t dqpn, const union ibv_gid *dgid);
/* The three steps of ct_connect_qp, one ibv_modify_qp each (0 or its
 * error): RESET->INIT, INIT->RTR towards (dqpn, dgid), RTR->RTS. */
int ct_qp_init(struct ct_dev *d, struct ibv_qp *qp);
int ct_qp_rtr(struct ct_dev *d, struct ibv_qp *qp, int sgid_idx,
	      uint32_t dqpn, const union ibv_gid *dgid);
int ct_qp_rts(struct ct_dev *d, struct ibv_qp *qp);
/* Connects a (GID A) and b (GID B) to each other; fails the test on error. */
void ct_connect_pair(struct ct_dev *d, struct ibv_qp *a, struct ibv_qp *b);
/* Moves a QP to ERR (fails the test on error). */
void ct_qp_to_err(struct ibv_qp *qp);
enum ibv_qp_state ct_qp_state(struct ibv_qp *qp);

/* ---- memory --------------------------------------------------------- */

#define CT_ACCESS_ALL                                                         \
	(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |                   \
	 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)

struct ct_buf {
	uint8_t *p;
	size_t len;
	struct ibv_mr *mr;
};
/* Page-aligned, zeroed buffer registered with CT_ACCESS_ALL on pd. */
void ct_buf_alloc(struct ct_buf *b, struct ibv_pd *pd, size_t len);
void ct_buf_free(struct ct_buf *b);

/* Deterministic pattern: byte i = f(seed, i). */
void ct_fill(void *p, size_t len, uint32_t seed);
/* Compares len bytes; on mismatch fails with the first differing offset. */
void ct_expect_bytes(const void *got, const void *want, size_t len,
		     const char *what);
/* Checks that p[0..len) equals the pattern ct_fill(seed) would write. */
void ct_expect_pattern(const void *p, size_t len, uint32_t seed,
		       const char *what);
void ct_expect_zero(const void *p, size_t len, const char *what);

/* ---- classic posting ------------------------------------------------ */

/*
 * ibv_post_send of one WR with one SGE (lb at loff, len bytes; len 0 means
 * no SGE). raddr/rkey are used for RDMA and atomics (atomics: compare_add =
 * cmp_add, swap = swap). imm is in host order. Returns ibv_post_send's value.
 */
int ct_post_send1(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op,
		  unsigned flags, const struct ct_buf *lb, size_t loff,
		  uint32_t len, uint64_t raddr, uint32_t rkey, uint32_t imm);
int ct_post_atomic(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op,
		   const struct ct_buf *lb, size_t loff, uint64_t raddr,
		   uint32_t rkey, uint64_t cmp_add, uint64_t swap);
/* ibv_post_recv of one WR with one SGE (len 0: no SGE); fails on error. */
void ct_post_recv1(struct ibv_qp *qp, uint64_t wr_id, const struct ct_buf *b,
		   size_t off, uint32_t len);

/* ---- completions ---------------------------------------------------- */

/* Polls until `n` completions are collected, or fails after timeout_ms. */
void ct_poll_n(struct ibv_cq *cq, struct ibv_wc *wc, int n, int timeout_ms);
/* One completion. */
struct ibv_wc ct_poll1(struct ibv_cq *cq);
/* Asserts that no completion arrives on cq within ms milliseconds. */
void ct_expect_quiet(struct ibv_cq *cq, int ms, const char *what);
/* Waits (up to CT_TIMEOUT_MS) for a completion event on ch, asserts that
 * it is cq's (and carries cq_context ctx, unless ctx is NULL), acks it. */
void ct_cq_event(struct ibv_comp_channel *ch, struct ibv_cq *cq, void *ctx, const char *what);
/* Asserts status==SUCCESS, wr_id and opcode. */
void ct_expect_wc(const struct ibv_wc *wc, uint64_t wr_id,
		  enum ibv_wc_opcode opcode, const char *what);

/* A completion read from an ibv_cq_ex through the ibv_wc_read_* accessors. */
struct ct_wcx {
	uint64_t wr_id;
	enum ibv_wc_status status;
	enum ibv_wc_opcode opcode;
	unsigned int wc_flags;
	uint32_t byte_len;
	__be32 imm_data;
	uint32_t qp_num;
};
/*
 * Collects n completions with ibv_start_poll/ibv_next_poll/ibv_end_poll;
 * `cq_wc_flags` are the flags the CQ was created with (decides which
 * ibv_wc_read_* accessors may be called).
 */
void ct_poll_ex_n(struct ibv_cq_ex *cq, uint64_t cq_wc_flags,
		  struct ct_wcx *out, int n, int timeout_ms);
void ct_expect_quiet_ex(struct ibv_cq_ex *cq, int ms, const char *what);

/* ---- krcore counters (only with -DHAVE_KRCORE) ----------------------- */

#ifdef HAVE_KRCORE
/* Process-wide counters: since the process started, stat OP want. */
#define CT_KRCORE_STAT(stat, op, want)                                        \
	do {                                                                  \
		unsigned long long v_ = krcore_stat_get(stat);                \
		unsigned long long w_ = (want);                               \
		if (!(v_ op w_))                                              \
			ct_fail_at(__FILE__, __LINE__,                        \
				   "krcore counter %s is %llu, expected "     \
				   "%s %llu", krcore_stat_name(stat), v_,     \
				   #op, w_);                                  \
	} while (0)
/* The same, waited for (a background link): polled for up to CT_TIMEOUT_MS. */
#define CT_KRCORE_STAT_WITHIN(stat, op, want)                                 \
	do {                                                                  \
		uint64_t t_ = ct_now_ns();                                    \
		while (!(krcore_stat_get(stat) op (want)) &&                  \
		       ct_now_ns() - t_ < CT_TIMEOUT_MS * 1000000ull)         \
			usleep(1000);                                         \
		CT_KRCORE_STAT(stat, op, want);                               \
	} while (0)
#endif

/* ---- misc ----------------------------------------------------------- */

uint64_t ct_now_ns(void);
const char *ct_wc_opcode_str(enum ibv_wc_opcode op);

#ifdef HAVE_KRCORE
/* ---- virtual-QP tests ---------------------------------------------------- */

#include <sys/types.h>

/* The RoCE v2 GID of emulated node `node` (10.77.0.node). */
union ibv_gid ct_node_gid(int node);
/* Start krcore-meta on 10.77.0.1 (next to the library, or
 * KRCORE_META_BIN), wait for it to serve, set KRCORE_META; its pid. */
pid_t ct_start_meta(void);
/* The same with a table of `slots` slots (about four per key published). */
pid_t ct_start_meta_slots(unsigned slots);
/* Start krcore-meta listening on `addr` ("ip:port"; the RDMA device
 * whose GIDs include ip serves its table) with `slots` slots, wait for it
 * to serve; its pid. KRCORE_META is left alone. */
pid_t ct_start_meta_at(const char *addr, unsigned slots);
/* Start argv[0] (argv NULL-terminated) with its stdout on a pipe (its
 * read end in *out): its pid. */
pid_t ct_spawn_piped(char *const argv[], int *out);
/* Start argv[0] (argv NULL-terminated) with its stdout on a pipe and wait
 * (bounded) for its first line, which must contain `expect`: its pid, and
 * in *out the pipe (its later lines). */
pid_t ct_spawn_ready(char *const argv[], const char *expect, int *out);
/* The same, its first line copied into `first` (`len` bytes at most). */
pid_t ct_spawn_ready_line(char *const argv[], const char *expect, int *out, char *first, size_t len);
/* The statistics line krcore-node `agent` prints on SIGUSR1 to its stdout
 * pipe `out` (as ct_spawn_ready gave it), asked for now and waited for
 * (bounded), read into `buf`; and the value of one `field` of it
 * ("vouched", "departed", ...). */
const char *ct_agent_stats_line(pid_t agent, int out, char *buf, size_t len);
long ct_agent_stat(pid_t agent, int out, const char *field);
/* The crate binary `name`: the path in environment variable `env`, else
 * target/release/<name> beside this test's target/c-tests (in `buf`). */
const char *ct_release_bin(const char *env, const char *name, char *buf, size_t len);
/* A VQP (KRCORE_VQP) with these capabilities; the granted ones in
 * *granted when not NULL. */
struct ibv_qp *ct_create_vqp(struct ct_dev *d, struct ibv_cq *scq, struct ibv_cq *rcq,
			     struct ct_qp_caps caps, struct ibv_qp_cap *granted);
/* One process of a multi-process VQP test: the device on emulated node
 * `node` (GID index node, 10.77.0.node; also KRCORE_GID_INDEX, read at the
 * library's first use), a send and a receive CQ of `cqe` entries, and a
 * buffer of `len` bytes rounded up to pages (ct_buf_alloc), posted from
 * with ct_post_send1 / ct_post_recv1. */
struct ct_node {
	struct ct_dev d;
	struct ibv_cq *scq, *rcq;
	struct ct_buf b;
};
void ct_node_open(struct ct_node *n, int node, size_t len, int cqe);
/* A VQP on the node's CQs with sq/rq WRs of one SGE each. */
struct ibv_qp *ct_node_vqp(struct ct_node *n, uint32_t sq, uint32_t rq);
/* Message `seq` of sender `id` (len >= 8 bytes): id and seq, then a
 * pattern of both; ct_expect_msg fails the test if p is not that. */
void ct_fill_msg(uint8_t *p, size_t len, uint32_t id, uint32_t seq);
void ct_expect_msg(const uint8_t *p, size_t len, uint32_t id, uint32_t seq);

/* Fork a process running role(ready_fd); return once it has written a
 * byte to ready_fd (bounded by the watchdog). */
pid_t ct_fork_ready(int (*role)(int ready_fd), const char *what);
/* A bound VQP (qbind on `node`'s GID, `port`) that echoes every message
 * (up to CT_ECHO_MSG bytes) to its sender; CT_ECHO_TARGET of its 4 KiB
 * buffer holds 64 bytes of ct_fill(seed) for READs (address and rkey, two
 * uint64_t, written to info_fd). Writes one byte to ready_fd once bound;
 * runs until killed. */
#define CT_ECHO_MSG 64
#define CT_ECHO_TARGET 2048
int ct_echo_target_server(const char *name, int node, int port, uint32_t seed, int info_fd, int ready_fd);
/* Wait (bounded) until every thread of process `pid` is stopped (state
 * 't' or 'T' in /proc): kill(SIGSTOP) returns before its threads stop, and
 * one still running may answer what is sent to the process meanwhile. */
void ct_wait_stopped(pid_t pid);
/* Wait for a child process; 0 if it exited with 0, else 1 (reported). */
int ct_wait_child(pid_t pid, const char *what);
/* Run f() in a forked child and wait for it (as ct_wait_child). */
int ct_run_child(int (*f)(void), const char *what);
#endif

/* ---- out of band (pipes and sockets between test processes) ------- */

/* Bound on every out-of-band read. */
#define CT_OOB_MS 60000
/* Write or read exactly n bytes; anything else (a peer gone, nothing
 * within CT_OOB_MS) fails the current sub-test. */
void ct_oob_write(int fd, const void *p, size_t n);
void ct_oob_read(int fd, void *p, size_t n);

#endif
