/*
 * The meta server's failover (docs/vqp.md, "Meta server"): replicas that
 * die and come back, a single server restarted under running clients, and
 * leases that run out. Meta servers run here on 10.77.0.9 and 10.77.0.1;
 * processes ("workers", forked, each on one emulated node) qbind and
 * qconnect on command from this process over pipes and report what they
 * got and how long it took. KRCORE_META_LEASE_MS=1500: leases are renewed
 * and replicas that are down are tried again every 500 ms.
 *
 * 1. "one replica down": replicas M1, M2 (KRCORE_META=M1,M2). M1 is
 *    killed (SIGKILL, reaped); qconnects to bindings made before (lookups)
 *    and new qbinds keep working, each within a bound, and every lookup
 *    is answered by M2 (the meta_lookup_failovers counter moves by exactly
 *    the lookups made); a process started while M1 is down binds and
 *    connects too.
 * 2. "restarted replica repopulated": M1 restarted at the same address;
 *    within a bound the binders, doing nothing, have registered all their
 *    bindings there again (their meta_rebinds counters, polled), and a
 *    process whose KRCORE_META names only M1 finds, at its first lookup, a
 *    binding made before the kill, one made while M1 was down, and one of
 *    the process that started while M1 was down.
 * 3. "single meta server restarted": M3 alone; it is killed while its
 *    clients run bound: a lookup then fails at once (no replica, no
 *    wait); qbind too. M3 restarted: a running client reaches a binding
 *    made before the restart that it never looked up, a new process
 *    reaches another, and the binder binds anew.
 * 4. "an expired lease never resolves": a bound process is stopped
 *    (SIGSTOP: no renewals, its TCP connections stay open); a prober
 *    (KRCORE_CONNECT_TIMEOUT_MS=200, KRCORE_DGRAM=1) qconnects to its address and SENDs
 *    again and again: the SEND completes with IBV_WC_RETRY_EXC_ERR (bound,
 *    not answering; qconnect makes no handshake) while the lease runs,
 *    then qconnect fails with ECONNREFUSED and never anything else; no
 *    probe that began after the lease's end (last renewal at most at the
 *    SIGSTOP) found it, and it did not go before half the lease.
 * 5. "a meta server answering late keeps the bindings": M3 stopped
 *    (SIGSTOP) for 5.3 s under a binder with 9 s leases: its renewal
 *    waits for the late answer instead of closing its connection (which
 *    made the server drop its bindings); in the 4 s after SIGCONT every
 *    lookup finds the binding and the binder has not reconnected.
 * 6. "a new process's first qconnect waits for a meta server that answers
 *    late": M3 stopped when a new process starts; its first qconnect
 *    still waits 3 s later (the answer to its TCP query is waited for as
 *    a live peer's, not for the 1 s connect timeout); after SIGCONT it
 *    succeeds, and the connection its runtime started making at the start
 *    is made (none failed).
 * 7. "a meta server that never answers fails a new process's first
 *    qconnect, bounded": as 6, M3 never continued: ETIMEDOUT after the
 *    10 s a live peer's answer is waited for (more than 3 connect
 *    timeouts, less than 10 s and 5).
 */
#define _GNU_SOURCE
#include "common.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define PORT 5600
#define LEASE_MS 1500
#define PERIOD_MS (LEASE_MS / 3)
#define CONNECT_TIMEOUT_MS 1000
/* A qbind or qconnect while a replica is down. */
#define OP_BOUND_MS 1500
/* From a restart to a binding being found there: a period, the
 * reconnection and the registrations, with room for a loaded VM. */
#define REPOPULATE_BOUND_MS 3000
#define PROBE_TIMEOUT_MS 200

static const uint64_t MS = 1000000ull;

/* ---- workers ----------------------------------------------------------- */

enum { CMD_BIND = 'B', CMD_CONNECT = 'C', CMD_WAIT_CONNECT = 'W', CMD_WAIT_BIND = 'b',
       CMD_PROBE = 'P', CMD_WATCH = 'w', CMD_STATS = 'S', CMD_QUIT = 'Q' };

struct cmd {
	char op;
	int node, port;
	/* CMD_WAIT_*: give up after this long; CMD_PROBE: how long to go on
	 * after the first refusal; CMD_WATCH: how long to look. */
	int limit_ms;
};

struct resp {
	int rc;
	int attempts;
	/* ct_now_ns() when the call started, when it returned. */
	uint64_t t_start, t_end;
	/* CMD_STATS: the meta counters. */
	uint64_t reconnects, rebinds, failovers, connections, connect_failures, renewals;
	/* CMD_PROBE: the start of the last probe that found the binding (0:
	 * none), the end of the first refused one, and probes that found it
	 * after a refusal. */
	uint64_t last_found_start, first_refused_end;
	int found_after_refusal;
	/* CMD_WATCH: lookups that did not find the binding. */
	int missed;
};

struct worker {
	pid_t pid;
	int to, from;
	const char *what;
};

static int w_node;
static struct ct_dev w_dev;
static struct ibv_cq *w_cq;

static struct ibv_qp *new_vqp(void)
{
	return ct_create_vqp(&w_dev, w_cq, w_cq, (struct ct_qp_caps){ 4, 4, 1, 1, 0, 0 }, NULL);
}

/* qconnect a new VQP to (node, port); the VQP is destroyed. */
static int connect_once(int node, int port)
{
	struct ibv_qp *q = new_vqp();
	int rc = qconnect(q, ct_node_gid(node), port);

	CT_OK(ibv_destroy_qp(q));
	return rc;
}

/* qconnect a new VQP to (node, port) and SEND 0 bytes on it: 0 when it
 * arrived, the errno of qconnect, or ETIMEDOUT when the SEND completed
 * with IBV_WC_RETRY_EXC_ERR (nobody answered). The VQP is destroyed. */
static int reach_once(int node, int port)
{
	struct ibv_qp *q = new_vqp();
	int rc = qconnect(q, ct_node_gid(node), port);

	if (rc == 0) {
		struct ibv_send_wr wr = { .wr_id = 9, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
		struct ibv_send_wr *bad = NULL;
		struct ibv_wc wc;

		CT_OK(ibv_post_send(q, &wr, &bad));
		ct_poll_n(w_cq, &wc, 1, CT_TIMEOUT_MS);
		CT_CHECK(wc.wr_id == 9 && (wc.status == IBV_WC_SUCCESS || wc.status == IBV_WC_RETRY_EXC_ERR),
			 "SEND: %s", ibv_wc_status_str(wc.status));
		rc = wc.status == IBV_WC_SUCCESS ? 0 : ETIMEDOUT;
	}
	CT_OK(ibv_destroy_qp(q));
	return rc;
}

/* qbind a new VQP at (node, port); kept while bound. */
static int bind_once(int node, int port)
{
	struct ibv_qp *q = new_vqp();
	int rc = qbind(q, ct_node_gid(node), port);

	if (rc)
		CT_OK(ibv_destroy_qp(q));
	return rc;
}

/* Retry `op` while it is refused (nothing bound there yet / no replica
 * answers yet), every 20 ms, for at most limit_ms. */
static void retry(struct resp *r, int (*op)(int, int), int refused, const struct cmd *c)
{
	for (;;) {
		r->attempts++;
		r->rc = op(c->node, c->port);
		if (r->rc != refused || ct_now_ns() - r->t_start > (uint64_t)c->limit_ms * MS)
			return;
		/* Polling for a condition, with a deadline. */
		usleep(20000);
	}
}

/* qconnect (a fresh lookup each) to (node, port) over and over for
 * limit_ms: how many did not find it. */
static void watch(struct resp *r, const struct cmd *c)
{
	while (ct_now_ns() - r->t_start < (uint64_t)c->limit_ms * MS) {
		r->attempts++;
		if (connect_once(c->node, c->port))
			r->missed++;
		usleep(20000);
	}
}

/* qconnect over and over to a stopped process's address. */
static void probe(struct resp *r, const struct cmd *c)
{
	uint64_t stop_at = 0;

	for (;;) {
		uint64_t t = ct_now_ns();
		int rc = reach_once(c->node, c->port);

		r->attempts++;
		CT_CHECK(rc == ETIMEDOUT || rc == ECONNREFUSED, "probe %d: %d (%s)", r->attempts, rc,
			 strerror(rc));
		if (rc == ETIMEDOUT) {
			r->last_found_start = t;
			if (r->first_refused_end)
				r->found_after_refusal++;
		} else if (!r->first_refused_end) {
			r->first_refused_end = ct_now_ns();
			stop_at = r->first_refused_end + (uint64_t)c->limit_ms * MS;
		}
		if (stop_at && ct_now_ns() > stop_at)
			return;
		CT_CHECK(ct_now_ns() - r->t_start < 20000 * MS, "still bound after 20 s");
		usleep(20000);
	}
}

static int worker_main(int node, int from_parent, int to_parent)
{
	char idx[16];
	struct cmd c;

	snprintf(idx, sizeof(idx), "%d", node);
	setenv("CT_GID_A", idx, 1);
	setenv("KRCORE_GID_INDEX", idx, 1);
	w_node = node;
	ct_open(&w_dev);
	w_cq = CT_PTR(ibv_create_cq(w_dev.ctx, 64, NULL, NULL, 0));
	while (read(from_parent, &c, sizeof(c)) == sizeof(c)) {
		struct resp r;

		memset(&r, 0, sizeof(r));
		r.t_start = ct_now_ns();
		switch (c.op) {
		case CMD_BIND:
			r.rc = bind_once(c.node, c.port);
			break;
		case CMD_CONNECT:
			r.rc = connect_once(c.node, c.port);
			break;
		case CMD_WAIT_CONNECT:
			retry(&r, connect_once, ECONNREFUSED, &c);
			break;
		case CMD_WAIT_BIND:
			retry(&r, bind_once, ECONNREFUSED, &c);
			break;
		case CMD_PROBE:
			probe(&r, &c);
			break;
		case CMD_WATCH:
			watch(&r, &c);
			break;
		case CMD_STATS:
			r.reconnects = krcore_stat_get(KRCORE_STAT_META_RECONNECTS);
			r.rebinds = krcore_stat_get(KRCORE_STAT_META_REBINDS);
			r.failovers = krcore_stat_get(KRCORE_STAT_META_LOOKUP_FAILOVERS);
			r.connections = krcore_stat_get(KRCORE_STAT_META_CONNECTIONS);
			r.connect_failures = krcore_stat_get(KRCORE_STAT_META_CONNECT_FAILURES);
			r.renewals = krcore_stat_get(KRCORE_STAT_META_RENEWALS);
			break;
		case CMD_QUIT:
			return 0;
		default:
			CT_FAIL("unknown command %c", c.op);
		}
		r.t_end = ct_now_ns();
		CT_CHECK(write(to_parent, &r, sizeof(r)) == sizeof(r), "answer");
	}
	return 0;
}

/* A worker on `node` with KRCORE_META=meta (and these extra variables,
 * "NAME=value" or NULL). */
static void spawn(struct worker *w, int node, const char *meta, const char *extra, const char *what)
{
	int to[2], from[2];

	CT_CHECK(pipe(to) == 0 && pipe(from) == 0, "pipe");
	w->pid = fork();
	CT_CHECK(w->pid >= 0, "fork");
	if (w->pid == 0) {
		close(to[1]);
		close(from[0]);
		/* Read at this process's first use of the library. */
		setenv("KRCORE_META", meta, 1);
		/* `extra`: NAME=VALUE assignments separated by spaces. */
		if (extra) {
			char *all = strdup(extra), *save = NULL;

			CT_CHECK(all != NULL, "strdup");
			for (char *a = strtok_r(all, " ", &save); a; a = strtok_r(NULL, " ", &save))
				CT_CHECK(putenv(a) == 0, "putenv");
		}
		_exit(worker_main(node, to[0], from[1]));
	}
	close(to[0]);
	close(from[1]);
	w->to = to[1];
	w->from = from[0];
	w->what = what;
}

static struct resp call(struct worker *w, char op, int node, int port, int limit_ms)
{
	struct cmd c = { op, node, port, limit_ms };
	struct pollfd pfd = { w->from, POLLIN, 0 };
	struct resp r;

	CT_CHECK(write(w->to, &c, sizeof(c)) == sizeof(c), "command to %s", w->what);
	CT_CHECK(poll(&pfd, 1, 60000) == 1, "%s did not answer '%c' within 60 s", w->what, op);
	CT_CHECK(read(w->from, &r, sizeof(r)) == sizeof(r), "%s died on '%c'", w->what, op);
	return r;
}

static double ms_of(const struct resp *r)
{
	return (double)(r->t_end - r->t_start) / 1e6;
}

/* A call that must succeed within bound_ms; its milliseconds. */
static double call_ok(struct worker *w, char op, int node, int port, double bound_ms)
{
	struct resp r = call(w, op, node, port, 0);

	CT_CHECK(r.rc == 0, "%s: '%c' (node %d, port %d): %d (%s)", w->what, op, node, port, r.rc,
		 strerror(r.rc));
	CT_CHECK(ms_of(&r) < bound_ms, "%s: '%c' (node %d, port %d) took %.1f ms", w->what, op,
		 node, port, ms_of(&r));
	return ms_of(&r);
}

static int quit(struct worker *w)
{
	struct cmd c = { CMD_QUIT, 0, 0, 0 };

	CT_CHECK(write(w->to, &c, sizeof(c)) == sizeof(c), "quit %s", w->what);
	close(w->to);
	close(w->from);
	return ct_wait_child(w->pid, w->what);
}

static void kill_meta(pid_t pid)
{
	/* Reaped: its sockets and QPs are gone when this returns. */
	CT_CHECK(kill(pid, SIGKILL) == 0, "kill");
	CT_CHECK(waitpid(pid, NULL, 0) == pid, "waitpid");
}

/* ---- the test ------------------------------------------------------------ */

int main(void)
{
	char m1[64], m2[64], m3[64], both[160];
	int base = 20000 + (getpid() % 6000) * 3;
	pid_t p1, p2, p3;
	struct worker binder, looker, late, checker, b3, c3, fresh3, victim, prober, slow, newcomer, forsaken;
	int fails = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Read once per process, at its first use of the library: every
	 * worker forked below gets these. This process never uses it. */
	setenv("KRCORE_META_LEASE_MS", "1500", 1);
	setenv("KRCORE_CONNECT_TIMEOUT_MS", "1000", 1);
	ct_watchdog(240);
	snprintf(m1, sizeof(m1), "10.77.0.9:%d", base);
	snprintf(m2, sizeof(m2), "10.77.0.1:%d", base + 1);
	snprintf(m3, sizeof(m3), "10.77.0.9:%d", base + 2);
	snprintf(both, sizeof(both), "%s,%s", m1, m2);
	p1 = ct_start_meta_at(m1, 4096);
	p2 = ct_start_meta_at(m2, 4096);

	/* 1 ------------------------------------------------------------------ */
	ct_begin("meta_failover: one replica down");
	spawn(&binder, 2, both, NULL, "binder (node 2)");
	spawn(&looker, 3, both, NULL, "looker (node 3)");
	for (int k = 0; k < 4; k++)
		call_ok(&binder, CMD_BIND, 2, PORT + k, 10000);
	/* The link from looker to binder, made while both replicas run. */
	call_ok(&looker, CMD_CONNECT, 2, PORT, 10000);
	{
		uint64_t until = ct_now_ns() + 10000 * MS;
		struct resp s0, s1;
		double worst_lookup = 0, worst_bind = 0;

		/* Its meta-server connection made (its first lookups may go by
		 * TCP query while it is being made, and a query is no
		 * failover). */
		while ((s0 = call(&looker, CMD_STATS, 0, 0, 0)).connections == 0) {
			CT_CHECK(ct_now_ns() < until, "the looker's meta connection not made within 10 s");
			usleep(1000);
		}

		CT_CHECK(s0.failovers == 0, "a lookup went past M1 while it ran (%llu)",
			 (unsigned long long)s0.failovers);
		kill_meta(p1);
		for (int k = 1; k < 4; k++) {
			double l, b;

			/* Bound before the kill: M1 had it, M2 answers. */
			l = call_ok(&looker, CMD_CONNECT, 2, PORT + k, OP_BOUND_MS);
			worst_lookup = l > worst_lookup ? l : worst_lookup;
			/* New bindings: M2 alone takes them. */
			b = call_ok(&binder, CMD_BIND, 2, PORT + 10 + k, OP_BOUND_MS);
			worst_bind = b > worst_bind ? b : worst_bind;
			l = call_ok(&looker, CMD_CONNECT, 2, PORT + 10 + k, OP_BOUND_MS);
			worst_lookup = l > worst_lookup ? l : worst_lookup;
		}
		s1 = call(&looker, CMD_STATS, 0, 0, 0);
		CT_CHECK(s1.failovers - s0.failovers == 6, "%llu of 6 lookups answered past M1",
			 (unsigned long long)(s1.failovers - s0.failovers));
		/* A process that starts while M1 is down. */
		spawn(&late, 4, both, NULL, "late starter (node 4)");
		call_ok(&late, CMD_CONNECT, 2, PORT + 1, 10000);
		call_ok(&late, CMD_BIND, 4, PORT + 20, 10000);
		ct_note("M1 killed: 6 qconnects (lookups over a live link) took at most %.1f ms, "
			"3 qbinds at most %.1f ms; every lookup answered by M2",
			worst_lookup, worst_bind);
	}
	ct_pass();

	/* 2 ------------------------------------------------------------------ */
	ct_begin("meta_failover: restarted replica repopulated");
	/* Started now, it first uses the library (and M1) after the restart. */
	spawn(&checker, 5, m1, NULL, "checker on M1 only (node 5)");
	{
		uint64_t t_restart, t_binder = 0, t_late = 0, t_looker = 0;
		struct resp r[3], sb, sl;
		const int keys[3][2] = { { 2, PORT + 2 }, { 2, PORT + 11 }, { 4, PORT + 20 } };
		uint64_t rebinds0 = call(&binder, CMD_STATS, 0, 0, 0).rebinds;
		uint64_t late0 = call(&late, CMD_STATS, 0, 0, 0).rebinds;
		uint64_t looker0 = call(&looker, CMD_STATS, 0, 0, 0).reconnects;

		p1 = ct_start_meta_at(m1, 4096);
		t_restart = ct_now_ns();
		/* Polling the counters, with a deadline: the 4 + 3 bindings of
		 * the binder, the late starter's one, and the looker (which
		 * binds nothing) connected to M1 again, each within a period
		 * of its own. */
		while (!t_binder || !t_late || !t_looker) {
			struct resp x;

			if (!t_looker && (x = call(&looker, CMD_STATS, 0, 0, 0)).reconnects >= looker0 + 1)
				t_looker = x.t_end;
			if (!t_binder && (x = call(&binder, CMD_STATS, 0, 0, 0)).rebinds >= rebinds0 + 7)
				t_binder = x.t_end;
			if (!t_late && (x = call(&late, CMD_STATS, 0, 0, 0)).rebinds >= late0 + 1)
				t_late = x.t_end;
			CT_CHECK(ct_now_ns() - t_restart < (uint64_t)REPOPULATE_BOUND_MS * MS,
				 "not repopulated %d ms after the restart (binder %s, late starter %s, looker %s)",
				 REPOPULATE_BOUND_MS, t_binder ? "done" : "not done", t_late ? "done" : "not done",
				 t_looker ? "reconnected" : "not reconnected");
			usleep(10000);
		}
		for (int k = 0; k < 3; k++) {
			r[k] = call(&checker, CMD_WAIT_CONNECT, keys[k][0], keys[k][1], 10000);
			CT_CHECK(r[k].rc == 0, "(node %d, port %d) on the restarted M1: %d (%s)",
				 keys[k][0], keys[k][1], r[k].rc, strerror(r[k].rc));
			CT_CHECK(r[k].attempts == 1, "(node %d, port %d) missing on M1 after its repopulation",
				 keys[k][0], keys[k][1]);
		}
		sb = call(&binder, CMD_STATS, 0, 0, 0);
		sl = call(&looker, CMD_STATS, 0, 0, 0);
		CT_CHECK(sb.reconnects >= 1, "the binder never reconnected to M1");
		CT_CHECK(sl.reconnects >= 1, "the looker never reconnected to M1");
		ct_note("restarted M1 repopulated by the binder's 7 bindings %.0f ms, the late "
			"starter's %.0f ms after it served again (renewal period %d ms); a process on M1 "
			"alone then found the bindings made before the kill, while it was down, and by "
			"the process started meanwhile, at its first lookup",
			(double)(t_binder - t_restart) / 1e6, (double)(t_late - t_restart) / 1e6, PERIOD_MS);
		/* With both replicas up, lookups go to M1 again. */
		call_ok(&looker, CMD_CONNECT, 4, PORT + 20, OP_BOUND_MS);
	}
	ct_pass();

	/* 3 ------------------------------------------------------------------ */
	ct_begin("meta_failover: single meta server restarted");
	p3 = ct_start_meta_at(m3, 4096);
	spawn(&b3, 6, m3, NULL, "binder on M3 (node 6)");
	spawn(&c3, 7, m3, NULL, "client on M3 (node 7)");
	call_ok(&b3, CMD_BIND, 6, PORT + 30, 10000);
	call_ok(&b3, CMD_BIND, 6, PORT + 31, 10000);
	call_ok(&c3, CMD_CONNECT, 6, PORT + 30, 10000);
	{
		struct resp down_c, down_b, again, nb;
		uint64_t t_restart;

		kill_meta(p3);
		/* No replica: refused at once, nothing waits for a dead server. */
		down_c = call(&c3, CMD_CONNECT, 6, PORT + 31, 0);
		down_b = call(&b3, CMD_BIND, 6, PORT + 32, 0);
		CT_CHECK(down_c.rc != 0 && down_b.rc != 0, "with M3 dead: qconnect %d, qbind %d",
			 down_c.rc, down_b.rc);
		CT_CHECK(ms_of(&down_c) < 500 && ms_of(&down_b) < 500,
			 "with M3 dead: qconnect took %.1f ms, qbind %.1f ms", ms_of(&down_c),
			 ms_of(&down_b));
		p3 = ct_start_meta_at(m3, 4096);
		t_restart = ct_now_ns();
		/* Bound before the restart, never looked up by this client. */
		again = call(&c3, CMD_WAIT_CONNECT, 6, PORT + 31, 10000);
		CT_CHECK(again.rc == 0, "after the restart: %d (%s)", again.rc, strerror(again.rc));
		CT_CHECK((again.t_end - t_restart) / MS < REPOPULATE_BOUND_MS,
			 "found %.0f ms after the restart", (double)(again.t_end - t_restart) / 1e6);
		spawn(&fresh3, 8, m3, NULL, "new client on M3 (node 8)");
		call_ok(&fresh3, CMD_CONNECT, 6, PORT + 30, 10000);
		nb = call(&b3, CMD_WAIT_BIND, 6, PORT + 32, 10000);
		CT_CHECK(nb.rc == 0, "qbind after the restart: %d (%s)", nb.rc, strerror(nb.rc));
		ct_note("M3 dead: qconnect failed in %.2f ms (%s), qbind in %.2f ms (%s); restarted: "
			"a running client found a binding of before %.0f ms after (%d attempts)",
			ms_of(&down_c), strerror(down_c.rc), ms_of(&down_b), strerror(down_b.rc),
			(double)(again.t_end - t_restart) / 1e6, again.attempts);
	}
	ct_pass();

	/* 3b ----------------------------------------------------------------- */
	ct_begin("meta_failover: a single meta server killed while a renewal waits for it");
	{
		struct resp s0, s, down_b, down_c, back;
		uint64_t until;

		/* Stopped, the server leaves the binder's next renewal waiting
		 * (its lookups' READs the kernel still answers); killed then, its
		 * connection closes under that wait, which must end at once: the
		 * binder's own thread waits there, and every bind or lookup of
		 * the process behind it (it used to wait the renewal's whole
		 * bound, 1 s here). */
		s0 = call(&b3, CMD_STATS, 0, 0, 0);
		CT_CHECK(kill(p3, SIGSTOP) == 0, "SIGSTOP");
		until = ct_now_ns() + 3ull * PERIOD_MS * MS;
		while ((s = call(&b3, CMD_STATS, 0, 0, 0)).renewals == s0.renewals) {
			CT_CHECK(ct_now_ns() < until, "no renewal sent within %d ms", 3 * PERIOD_MS);
			usleep(1000);
		}
		kill_meta(p3);
		down_b = call(&b3, CMD_BIND, 6, PORT + 33, 0);
		down_c = call(&c3, CMD_CONNECT, 6, PORT + 34, 0);
		CT_CHECK(down_b.rc != 0 && down_c.rc != 0, "with M3 killed: qbind %d, qconnect %d",
			 down_b.rc, down_c.rc);
		CT_CHECK(ms_of(&down_b) < 500 && ms_of(&down_c) < 500,
			 "with M3 killed under a renewal: qbind took %.1f ms, qconnect %.1f ms",
			 ms_of(&down_b), ms_of(&down_c));
		ct_note("M3 killed while the binder's renewal waited for it: qbind failed in %.2f ms "
			"(%s), qconnect in %.2f ms (%s)", ms_of(&down_b), strerror(down_b.rc),
			ms_of(&down_c), strerror(down_c.rc));
		/* Back for the cases below, the binder's keys registered again. */
		p3 = ct_start_meta_at(m3, 4096);
		back = call(&c3, CMD_WAIT_CONNECT, 6, PORT + 30, 10000);
		CT_CHECK(back.rc == 0, "M3 restarted: %d (%s)", back.rc, strerror(back.rc));
	}
	ct_pass();

	/* 4 ------------------------------------------------------------------ */
	ct_begin("meta_failover: an expired lease never resolves");
	spawn(&victim, 1, both, NULL, "victim (node 1)");
	call_ok(&victim, CMD_BIND, 1, PORT + 40, 10000);
	/* The prober has no link to the victim: every probe looks it up. */
	/* The datagram tier's contract (qconnect makes no handshake). */
	spawn(&prober, 5, both, "KRCORE_CONNECT_TIMEOUT_MS=200 KRCORE_DGRAM=1", "prober (node 5)");
	{
		struct resp sp;
		uint64_t t_stop, end_of_lease;
		double found_ms, refused_ms;

		CT_CHECK(kill(victim.pid, SIGSTOP) == 0, "SIGSTOP");
		t_stop = ct_now_ns();
		/* The last renewal reached the servers at t_stop at the latest. */
		end_of_lease = t_stop + (uint64_t)LEASE_MS * MS;
		sp = call(&prober, CMD_PROBE, 1, PORT + 40, 1000);
		CT_CHECK(sp.last_found_start != 0, "never found before it expired");
		CT_CHECK(sp.found_after_refusal == 0, "found %d times after a refusal",
			 sp.found_after_refusal);
		/* A probe that found it looked it up at its start (qconnect
		 * makes no handshake; a SEND then went unanswered, or the
		 * process was known not to answer). */
		found_ms = (double)((int64_t)sp.last_found_start - (int64_t)t_stop) / 1e6;
		refused_ms = (double)(sp.first_refused_end - t_stop) / 1e6;
		CT_CHECK(sp.last_found_start <= end_of_lease,
			 "found by a lookup %.0f ms after SIGSTOP, past the %d ms lease", found_ms,
			 LEASE_MS);
		CT_CHECK(refused_ms > LEASE_MS / 2, "gone %.0f ms after SIGSTOP", refused_ms);
		CT_CHECK(refused_ms < LEASE_MS + 2000, "still there %.0f ms after SIGSTOP", refused_ms);
		ct_note("stopped at t=0: found by lookups until at least t=%.0f ms (a SEND then "
			"unanswered for the %d ms connect timeout), refused from t=%.0f ms on (%d probes "
			"in all) (lease %d ms)", found_ms, PROBE_TIMEOUT_MS, refused_ms, sp.attempts, LEASE_MS);
		kill(victim.pid, SIGKILL);
		kill(victim.pid, SIGCONT);
		waitpid(victim.pid, NULL, 0);
	}
	ct_pass();

	/* 5 ------------------------------------------------------------------ */
	ct_begin("meta_failover: a meta server answering late keeps the bindings");
	/* Renewals every 3 s; a renewal sent during the stall waits for its
	 * answer until the leases renewed before would run out (6 s), not
	 * the 2 s of a qconnect's wait (which used to close the connection,
	 * and the server dropped every binding of the process with it). */
	spawn(&slow, 6, m3, "KRCORE_META_LEASE_MS=9000 KRCORE_CONNECT_TIMEOUT_MS=2000",
	      "binder with 9 s leases (node 6)");
	call_ok(&slow, CMD_BIND, 6, PORT + 50, 10000);
	call_ok(&c3, CMD_CONNECT, 6, PORT + 50, 10000);
	{
		struct resp s0, s1, w;

		s0 = call(&slow, CMD_STATS, 0, 0, 0);
		CT_CHECK(kill(p3, SIGSTOP) == 0, "SIGSTOP M3");
		/* Longer than a period and a qconnect's wait (so that a
		 * renewal sent in it waits more than 2 s), shorter than the
		 * lease less a period. */
		usleep(5300 * 1000);
		CT_CHECK(kill(p3, SIGCONT) == 0, "SIGCONT M3");
		/* A period and the reconnection's: the time a dropped
		 * connection would leave the binding absent. */
		w = call(&c3, CMD_WATCH, 6, PORT + 50, 4000);
		s1 = call(&slow, CMD_STATS, 0, 0, 0);
		CT_CHECK(w.missed == 0, "%d of %d lookups after the stall did not find the binding",
			 w.missed, w.attempts);
		CT_CHECK(s1.reconnects == s0.reconnects && s1.rebinds == s0.rebinds,
			 "the binder reconnected %llu times (%llu bindings registered again)",
			 (unsigned long long)(s1.reconnects - s0.reconnects),
			 (unsigned long long)(s1.rebinds - s0.rebinds));
		ct_note("M3 stopped 5.3 s: %d lookups in the 4 s after all found the binding; the binder "
			"kept its connection", w.attempts);
	}
	ct_pass();

	/* 6 ------------------------------------------------------------------ */
	ct_begin("meta_failover: a new process's first qconnect waits for a meta server that answers late");
	/* M3 stopped before a new process's first verb (a meta server
	 * starved of CPU by a burst of new processes, taken to the
	 * extreme): the TCP query its first qconnect sends is taken by the
	 * kernel and answered once M3 runs again. Its answer is waited
	 * for as a live peer's (10 s), not a connect timeout's 1 s: the
	 * qconnect still waits after 3 s, then succeeds; the connection
	 * its runtime began at the start is made too (none failed). */
	CT_CHECK(kill(p3, SIGSTOP) == 0, "SIGSTOP M3");
	spawn(&newcomer, 7, m3, NULL, "a process started while M3 is stopped (node 7)");
	{
		struct cmd c = { CMD_CONNECT, 6, PORT + 50, 0 };
		struct pollfd pfd = { newcomer.from, POLLIN, 0 };
		struct resp first, s;

		CT_CHECK(write(newcomer.to, &c, sizeof(c)) == sizeof(c), "command to the newcomer");
		CT_CHECK(poll(&pfd, 1, 3 * CONNECT_TIMEOUT_MS) == 0,
			 "the qconnect ended within %d ms of M3 stopped", 3 * CONNECT_TIMEOUT_MS);
		CT_CHECK(kill(p3, SIGCONT) == 0, "SIGCONT M3");
		CT_CHECK(poll(&pfd, 1, 60000) == 1, "no answer 60 s after SIGCONT");
		CT_CHECK(read(newcomer.from, &first, sizeof(first)) == sizeof(first), "the newcomer died");
		CT_CHECK(first.rc == 0, "qconnect with M3 stopped, then running: %d (%s)", first.rc,
			 strerror(first.rc));
		CT_CHECK(ms_of(&first) < 10000, "it waited %.0f ms", ms_of(&first));
		do {
			s = call(&newcomer, CMD_STATS, 0, 0, 0);
			CT_CHECK(ct_now_ns() - first.t_end < 10000 * MS, "no meta connection 10 s after");
		} while (s.connections == 0 && s.connect_failures == 0);
		CT_CHECK(s.connect_failures == 0 && s.connections == 1,
			 "meta connections %llu made, %llu failed: the one made at the start was "
			 "given up", (unsigned long long)s.connections,
			 (unsigned long long)s.connect_failures);
		ct_note("M3 stopped %d ms, then running: the first qconnect waited and succeeded in "
			"%.0f ms; the connection begun at the start made, none failed",
			3 * CONNECT_TIMEOUT_MS, ms_of(&first));
	}
	ct_pass();

	/* 7 ------------------------------------------------------------------ */
	ct_begin("meta_failover: a meta server that never answers fails a new process's first qconnect, bounded");
	/* As 6, but M3 stays stopped: the query's answer is waited for as a
	 * live peer's (10 s) and no longer; the qconnect fails ETIMEDOUT. */
	CT_CHECK(kill(p3, SIGSTOP) == 0, "SIGSTOP M3");
	spawn(&forsaken, 8, m3, NULL, "a process started while M3 stays stopped (node 8)");
	{
		struct cmd c = { CMD_CONNECT, 6, PORT + 50, 0 };
		struct pollfd pfd = { forsaken.from, POLLIN, 0 };
		struct resp r;

		CT_CHECK(write(forsaken.to, &c, sizeof(c)) == sizeof(c), "command to the process");
		CT_CHECK(poll(&pfd, 1, 30000) == 1, "no answer 30 s after M3 stopped");
		CT_CHECK(read(forsaken.from, &r, sizeof(r)) == sizeof(r), "the process died");
		CT_CHECK(kill(p3, SIGCONT) == 0, "SIGCONT M3");
		CT_CHECK(r.rc == ETIMEDOUT, "qconnect with M3 stopped: %d (%s), not ETIMEDOUT", r.rc, strerror(r.rc));
		CT_CHECK(ms_of(&r) > 3 * CONNECT_TIMEOUT_MS && ms_of(&r) < 10000 + 5 * CONNECT_TIMEOUT_MS,
			 "it failed after %.0f ms, not about 10 s", ms_of(&r));
		ct_note("M3 stopped: the first qconnect failed ETIMEDOUT after %.0f ms", ms_of(&r));
	}
	ct_pass();

	fails += quit(&forsaken);
	fails += quit(&newcomer);
	fails += quit(&slow);
	fails += quit(&prober);
	fails += quit(&fresh3);
	fails += quit(&c3);
	fails += quit(&b3);
	fails += quit(&checker);
	fails += quit(&late);
	fails += quit(&looker);
	fails += quit(&binder);
	kill(p1, SIGTERM);
	kill(p2, SIGTERM);
	kill(p3, SIGTERM);
	waitpid(p1, NULL, 0);
	waitpid(p2, NULL, 0);
	waitpid(p3, NULL, 0);
	CT_CHECK(fails == 0, "%d process(es) failed", fails);
	return 0;
}
