/*
 * kv_example: the key-value store a user would copy (examples-c/kv_server.c,
 * kv_client.c), both builds (raw verbs, and krcore's virtual QPs), run as
 * they are shipped. Each program's exit status is its verdict (0: every
 * operation succeeded and every value read was right, checked by the
 * program itself).
 *
 * Per build: krcore-meta (krcore only), a server on one emulated node; a
 * client that loads 200 keys (each PUT read back); two readers at once,
 * 500 GETs each of random keys (every value checked); the serverless
 * fetch of the server's 64 KiB object, asked for (-O) and with its
 * location given as the server's ready line printed it (-o ADDR:RKEY:
 * krcore sends no HELLO); the same with a wrong rkey (krcore: the READ
 * fails; raw: the server names another location), which must fail; the
 * server stopped with SIGTERM, exit 0, its summary counting the PUTs.
 */
#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define SERVER_NODE 3
#define CLIENT_NODE 6
#define KEYS "200"

static char dir[4200];	/* target/examples-c/<build> */
static int raw;		/* the raw verbs build */

static const char *prog(const char *name, char *buf, size_t len)
{
	snprintf(buf, len, "%s/%s", dir, name);
	return buf;
}

/* Everything `fd` gives until its end (bounded), into `buf`. */
static void read_all(int fd, char *buf, size_t len, const char *who)
{
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	size_t used = 0;

	for (;;) {
		ssize_t k;

		CT_CHECK(poll(&pfd, 1, CT_TIMEOUT_MS * 6) == 1, "%s: no end within %d s", who,
			 CT_TIMEOUT_MS * 6 / 1000);
		k = read(fd, buf + used, len - 1 - used);
		if (k <= 0)
			break;
		used += (size_t)k;
		CT_CHECK(used < len - 1, "%s: more output than %zu bytes", who, len);
	}
	buf[used] = 0;
}

/* Run the client with `args` (NULL-terminated) from CLIENT_NODE; its
 * stdout in `out`; its exit status. */
static int client(char *const args[], char *out, size_t len)
{
	char path[4300], gid[16], *argv[16];
	int fd, st, n = 0;
	pid_t pid;

	snprintf(gid, sizeof(gid), "%d", CLIENT_NODE);
	argv[n++] = (char *)prog("kv_client", path, sizeof(path));
	if (raw) {
		argv[n++] = "-g";
		argv[n++] = gid;
	}
	for (int i = 0; args[i]; i++)
		argv[n++] = args[i];
	argv[n] = NULL;
	pid = ct_spawn_piped(argv, &fd);
	read_all(fd, out, len, "kv_client");
	close(fd);
	CT_CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void expect_client(char *const args[], int status, const char *says)
{
	char out[8192];
	int got = client(args, out, sizeof(out));

	CT_CHECK(got == status, "kv_client %s ...: exit status %d, expected %d; it said: %s", args[0], got,
		 status, out);
	CT_CHECK(!says || strstr(out, says), "kv_client %s ...: said %s, not \"%s\"", args[0], out, says);
}

static void run_build(const char *build, int port)
{
	char here[4000], path[4300], addr[32], ports[8], gid[16], ready[1024], where[64], wrong[64], rest[4096];
	char *sargv[] = { NULL, "-a", addr, "-P", ports, NULL };
	char *load[] = { "-a", addr, "-P", ports, "-k", KEYS, "-L", "-n", "0", NULL };
	char *get[] = { "-a", addr, "-P", ports, "-k", KEYS, "-n", "500", NULL };
	char *fetch[] = { "-a", addr, "-P", ports, "-O", NULL };
	char *given[] = { "-a", addr, "-P", ports, "-o", where, NULL };
	char *bad[] = { "-a", addr, "-P", ports, "-o", wrong, NULL };
	const char *at;
	pid_t server, readers[2];
	uint64_t obj;
	unsigned rkey;
	int out, st, named;
	ssize_t k;

	raw = !strcmp(build, "ibverbs");
	k = readlink("/proc/self/exe", here, sizeof(here) - 1);
	CT_CHECK(k > 0, "readlink");
	here[k] = 0;
	*strrchr(here, '/') = 0; /* target/c-tests */
	snprintf(dir, sizeof(dir), "%s/../examples-c/%s", here, build);
	snprintf(addr, sizeof(addr), "10.77.0.%d", SERVER_NODE);
	snprintf(ports, sizeof(ports), "%d", port);
	sargv[0] = (char *)prog("kv_server", path, sizeof(path));

	ct_begin(raw ? "kv_example: raw verbs" : "kv_example: krcore");
	unsetenv("KRCORE_GID_INDEX"); /* the server's: its qbind's GID */
	server = ct_spawn_ready_line(sargv, "kv_server: ready:", &out, ready, sizeof(ready));
	/* The krcore clients' local GID (inherited; raw clients get -g). */
	snprintf(gid, sizeof(gid), "%d", CLIENT_NODE);
	setenv("KRCORE_GID_INDEX", gid, 1);
	at = strstr(ready, "; object ");
	named = at ? sscanf(at, "; object %" SCNx64 " rkey %x", &obj, &rkey) : 0;
	CT_CHECK(named == 2, "kv_server's ready line names no object: %s", ready);
	snprintf(where, sizeof(where), "%" PRIx64 ":%x", obj, rkey);
	snprintf(wrong, sizeof(wrong), "%" PRIx64 ":%x", obj, rkey ^ 0x80);

	expect_client(load, 0, KEYS " keys loaded");
	for (int i = 0; i < 2; i++) {
		readers[i] = fork();
		CT_CHECK(readers[i] >= 0, "fork");
		if (readers[i] == 0) {
			expect_client(get, 0, "500 GETs verified");
			_exit(0);
		}
	}
	for (int i = 0; i < 2; i++) {
		CT_CHECK(waitpid(readers[i], &st, 0) == readers[i], "waitpid");
		CT_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "reader %d failed (status %#x)", i, st);
	}
	expect_client(fetch, 0, "object verified");
	expect_client(given, 0, "object verified");
	expect_client(bad, 1, NULL);

	CT_CHECK(kill(server, SIGTERM) == 0, "SIGTERM");
	read_all(out, rest, sizeof(rest), "kv_server after SIGTERM");
	CT_CHECK(waitpid(server, &st, 0) == server, "waitpid server");
	CT_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kv_server: status %#x; it said: %s", st, rest);
	CT_CHECK(strstr(rest, KEYS " PUTs"), "kv_server's summary counts no " KEYS " PUTs: %s", rest);
	close(out);
	ct_pass();
}

int main(void)
{
	pid_t meta;

	ct_watchdog(240);
	run_build("ibverbs", 18861);
	meta = ct_start_meta();
	run_build("krcore", 18862);
	kill(meta, SIGTERM);
	waitpid(meta, NULL, 0);
	return 0;
}
