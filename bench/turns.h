/* SPDX-License-Identifier: MIT */
/*
 * Interleaving two benchmark clients (-T IN,OUT[,first]): raw verbs and
 * krcore run at once and take turns, handing a token over two FIFOs, so
 * that whatever the host does to the VM in a given second hits both
 * alike. Both clients run the same turns in the same order; the one given
 * "first" starts without waiting. Used by bench/datapath.c and
 * bench/connect.c; the includer defines die() first.
 */
#ifndef KRCORE_BENCH_TURNS_H
#define KRCORE_BENCH_TURNS_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

#define TURN_TIMEOUT_MS 600000
static int turn_in = -1, turn_out = -1, turn_first, turns_taken;

static inline void turns_open(char *spec)
{
	char *in = strtok(spec, ","), *out = strtok(NULL, ","),
	     *first = strtok(NULL, ",");

	if (!in || !out || (first && strcmp(first, "first")))
		die("-T takes IN,OUT[,first], not '%s'", spec);
	/* O_RDWR: opening a FIFO never blocks then, and a write never fails
	 * once the other client has exited. */
	if ((turn_in = open(in, O_RDWR)) < 0 ||
	    (turn_out = open(out, O_RDWR)) < 0)
		die("-T: open %s / %s: %s", in, out, strerror(errno));
	turn_first = first != NULL;
}

/* Wait for our turn (at once without -T). */
static inline void turn_begin(void)
{
	struct pollfd p = { .fd = turn_in, .events = POLLIN };
	char b;
	int r;

	if (turn_in < 0 || (turns_taken++ == 0 && turn_first))
		return;
	while ((r = poll(&p, 1, TURN_TIMEOUT_MS)) < 0 && errno == EINTR)
		;
	if (r == 0)
		die("-T: the other client did not hand the turn over in %d s",
		    TURN_TIMEOUT_MS / 1000);
	if (r < 0 || read(turn_in, &b, 1) != 1)
		die("-T: waiting for the turn: %s", strerror(errno));
}

/* Hand the turn over. */
static inline void turn_end(void)
{
	if (turn_out >= 0 && write(turn_out, "t", 1) != 1)
		die("-T: handing the turn over: %s", strerror(errno));
}

#endif
