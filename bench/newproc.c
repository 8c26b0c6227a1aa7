/*
 * newproc: where a new process's time goes before its first verb, with
 * raw verbs or with krcore (issue 19: "measure what a user sees").
 *
 *   newproc parent N    spawns N copies of itself one after the other
 *   newproc child T0    (internal) T0: CLOCK_MONOTONIC µs at the spawn
 *
 * Each child prints, in µs: exec_to_main (the dynamic loader, libraries'
 * constructors), devlist (ibv_get_device_list: with krcore it loads the
 * real libibverbs first), open, pd, cq (32 entries), mr (a 4 KiB
 * ibv_reg_mr: with krcore the MR cache starts at the first one), total.
 *
 *   cc -O2 bench/newproc.c -libverbs -o target/bench/bin/newproc
 *   cc -O2 bench/newproc.c -L target/release -lkrcore \
 *      -Wl,-rpath,$PWD/target/release -o target/bench/bin/newproc-krcore
 *   scripts/vm-run.sh OUT_DIR bash -c 'bash scripts/rxe-up.sh 10 >/dev/null;
 *      for k in 1 2; do target/bench/bin/newproc parent 6;
 *      target/bench/bin/newproc-krcore parent 6; done'
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static double now_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int parent(const char *self, int n)
{
	for (int i = 0; i < n; i++) {
		char t0[64];
		char *argv[] = { (char *)self, "child", t0, NULL };
		pid_t pid;
		int st;

		snprintf(t0, sizeof(t0), "%.1f", now_us());
		if (posix_spawn(&pid, self, NULL, NULL, argv, environ) ||
		    waitpid(pid, &st, 0) != pid || !WIFEXITED(st) ||
		    WEXITSTATUS(st)) {
			fprintf(stderr, "newproc: child %d failed\n", i);
			return 1;
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct ibv_device **list;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	double t[6], t0;
	void *buf;
	int n;

	if (argc == 3 && !strcmp(argv[1], "parent"))
		return parent(argv[0], atoi(argv[2]));
	if (argc != 3 || strcmp(argv[1], "child")) {
		fprintf(stderr, "usage: newproc parent N\n");
		return 2;
	}
	t0 = atof(argv[2]);
	t[0] = now_us();
	list = ibv_get_device_list(&n);
	t[1] = now_us();
	if (!list || n < 1)
		return 1;
	ctx = ibv_open_device(list[0]);
	t[2] = now_us();
	pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	t[3] = now_us();
	cq = ctx ? ibv_create_cq(ctx, 32, NULL, NULL, 0) : NULL;
	t[4] = now_us();
	if (posix_memalign(&buf, 4096, 4096))
		return 1;
	mr = pd ? ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE) : NULL;
	t[5] = now_us();
	if (!ctx || !pd || !cq || !mr)
		return 1;
	printf("exec_to_main=%.0f devlist=%.0f open=%.0f pd=%.0f cq=%.0f "
	       "mr=%.0f total=%.0f\n", t[0] - t0, t[1] - t[0], t[2] - t[1],
	       t[3] - t[2], t[4] - t[3], t[5] - t[4], t[5] - t0);
	return 0;
}
