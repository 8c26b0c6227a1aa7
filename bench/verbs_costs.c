/* What the verbs objects a new process makes cost in the testbed VM, to
 * read a new process's CPU against (docs/performance.md, "What a new
 * process's verbs objects cost"): plain libibverbs, no krcore.
 *
 *   cc -O2 -std=gnu11 -Wall -Wextra -Werror bench/verbs_costs.c -libverbs \
 *      -lpthread -o target/bench/bin/verbs_costs
 *   scripts/vm-run.sh target/bench bash -c \
 *      'bash scripts/rxe-up.sh 2 >/dev/null; target/bench/bin/verbs_costs rxe0'
 *
 * Prints one line per primitive: microseconds per operation (made and
 * destroyed), the median of 5 timed loops (CLOCK_MONOTONIC around the
 * loop; the VM is otherwise idle, so wall time is what the machine spent,
 * rxe's kernel work included). Every failure aborts with its errno. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { TRIALS = 5 };

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static char *mem;

#define CHECK(c)                                                                      \
	do {                                                                          \
		if (!(c)) {                                                           \
			fprintf(stderr, "verbs_costs: %s failed: %s\n", #c, strerror(errno)); \
			exit(1);                                                      \
		}                                                                     \
	} while (0)

static double now_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void query_gid(int n)
{
	union ibv_gid g;

	for (int i = 0; i < n; i++)
		CHECK(ibv_query_gid(ctx, 1, 1, &g) == 0);
}

static void query_gid_table(int n)
{
	struct ibv_gid_entry e[16];

	for (int i = 0; i < n; i++)
		CHECK(ibv_query_gid_table(ctx, e, 16, 0) > 0);
}

static void comp_channel(int n)
{
	for (int i = 0; i < n; i++) {
		struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);

		CHECK(ch);
		CHECK(ibv_destroy_comp_channel(ch) == 0);
	}
}

static void cq_of(int n, int cqe, int channel)
{
	for (int i = 0; i < n; i++) {
		struct ibv_comp_channel *ch = channel ? ibv_create_comp_channel(ctx) : NULL;
		struct ibv_cq *c;

		CHECK(!channel || ch);
		c = ibv_create_cq(ctx, cqe, NULL, ch, 0);
		CHECK(c);
		CHECK(ibv_destroy_cq(c) == 0);
		CHECK(!ch || ibv_destroy_comp_channel(ch) == 0);
	}
}

static void cq_64(int n) { cq_of(n, 64, 0); }
static void cq_4096(int n) { cq_of(n, 4096, 0); }
static void cq_64_channel(int n) { cq_of(n, 64, 1); }

static void qp_of(int n, enum ibv_qp_type type, int depth, int to_rts)
{
	for (int i = 0; i < n; i++) {
		struct ibv_qp_init_attr a = {
			.send_cq = cq, .recv_cq = cq, .qp_type = type,
			.cap = { .max_send_wr = depth, .max_recv_wr = depth, .max_send_sge = 1, .max_recv_sge = 1 },
		};
		struct ibv_qp_attr m = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1 };
		struct ibv_qp *q = ibv_create_qp(pd, &a);

		CHECK(q);
		if (type == IBV_QPT_UD) {
			m.qkey = 0x11111111;
			CHECK(ibv_modify_qp(q, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0);
			if (to_rts) {
				m.qp_state = IBV_QPS_RTR;
				CHECK(ibv_modify_qp(q, &m, IBV_QP_STATE) == 0);
				m.qp_state = IBV_QPS_RTS;
				m.sq_psn = 0;
				CHECK(ibv_modify_qp(q, &m, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0);
			}
		} else {
			m.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
			CHECK(ibv_modify_qp(q, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
							 IBV_QP_ACCESS_FLAGS) == 0);
		}
		CHECK(ibv_destroy_qp(q) == 0);
	}
}

static void ud_qp_rts(int n) { qp_of(n, IBV_QPT_UD, 256, 1); }
static void rc_qp_init(int n) { qp_of(n, IBV_QPT_RC, 128, 0); }

static void mr_of(int n, size_t len)
{
	for (int i = 0; i < n; i++) {
		struct ibv_mr *m = ibv_reg_mr(pd, mem, len, IBV_ACCESS_LOCAL_WRITE);

		CHECK(m);
		CHECK(ibv_dereg_mr(m) == 0);
	}
}

static void mr_4k(int n) { mr_of(n, 4096); }
static void mr_1m(int n) { mr_of(n, 1 << 20); }
static void mr_4m(int n) { mr_of(n, 4 << 20); }

static void ah(int n)
{
	struct ibv_ah_attr a = { .is_global = 1, .port_num = 1, .grh = { .sgid_index = 1, .hop_limit = 64 } };

	CHECK(ibv_query_gid(ctx, 1, 2, &a.grh.dgid) == 0);
	for (int i = 0; i < n; i++) {
		struct ibv_ah *h = ibv_create_ah(pd, &a);

		CHECK(h);
		CHECK(ibv_destroy_ah(h) == 0);
	}
}

static void *nothing(void *arg)
{
	return arg;
}

static void thread(int n)
{
	for (int i = 0; i < n; i++) {
		pthread_t t;

		CHECK(pthread_create(&t, NULL, nothing, NULL) == 0);
		CHECK(pthread_join(t, NULL) == 0);
	}
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static void run(const char *name, void (*f)(int), int n)
{
	double v[TRIALS];

	f(1); /* warm up */
	for (int t = 0; t < TRIALS; t++) {
		double t0 = now_us();

		f(n);
		v[t] = (now_us() - t0) / n;
	}
	qsort(v, TRIALS, sizeof(v[0]), cmp);
	printf("%-44s %9.1f us\n", name, v[TRIALS / 2]);
}

int main(int argc, char **argv)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	struct ibv_device *dev = NULL;

	CHECK(list);
	for (int i = 0; list[i]; i++)
		if (argc < 2 || !strcmp(ibv_get_device_name(list[i]), argv[1]))
			dev = list[i];
	CHECK(dev);
	CHECK((ctx = ibv_open_device(dev)));
	CHECK((pd = ibv_alloc_pd(ctx)));
	CHECK((cq = ibv_create_cq(ctx, 1024, NULL, NULL, 0)));
	CHECK((mem = aligned_alloc(4096, 4 << 20)));
	memset(mem, 1, 4 << 20);
	run("ibv_query_gid (one index)", query_gid, 200);
	run("ibv_query_gid_table (16 entries)", query_gid_table, 200);
	run("comp channel: create + destroy", comp_channel, 50);
	run("CQ of 64: create + destroy", cq_64, 50);
	run("CQ of 4096: create + destroy", cq_4096, 20);
	run("CQ of 64 with a channel: create + destroy", cq_64_channel, 50);
	run("UD QP (256 deep) to RTS + destroy", ud_qp_rts, 20);
	run("RC QP (128 deep) to INIT + destroy", rc_qp_init, 20);
	run("MR of 4 KiB: reg + dereg", mr_4k, 50);
	run("MR of 1 MiB: reg + dereg", mr_1m, 20);
	run("MR of 4 MiB: reg + dereg", mr_4m, 10);
	run("AH: create + destroy", ah, 50);
	run("thread: create + join", thread, 50);
	return 0;
}
