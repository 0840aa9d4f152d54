/*
 * The shape of Samba's ping_pong lock test, for benches/ping_pong.sh: N processes (one per
 * node) share one file of NUM = N + 1 bytes; each holds one byte with an fcntl write lock,
 * takes the next byte (F_SETLKW, waiting for whoever holds it), then lets its previous
 * byte go. With N + 1 bytes among N processes the locks go round the ring: every lock is a
 * hand-off between processes, so on a cluster filesystem between nodes.
 *
 * usage: ping_pong FILE NUM SECS
 * Prints the locks taken per second by this process over SECS seconds (after the first).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void lock_byte(int fd, int type, long off)
{
	struct flock fl;
	memset(&fl, 0, sizeof fl);
	fl.l_type = type;
	fl.l_whence = SEEK_SET;
	fl.l_start = off;
	fl.l_len = 1;
	while (fcntl(fd, type == F_UNLCK ? F_SETLK : F_SETLKW, &fl) != 0) {
		if (errno != EINTR) {
			fprintf(stderr, "ping_pong: fcntl %s byte %ld: %s\n",
				type == F_UNLCK ? "unlock" : "lock", off, strerror(errno));
			exit(1);
		}
	}
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: ping_pong FILE NUM SECS\n");
		return 2;
	}
	long num = atol(argv[2]);
	double secs = atof(argv[3]);
	int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
	if (fd < 0 || num < 2 || secs <= 0) {
		fprintf(stderr, "ping_pong: %s: %s\n", argv[1], fd < 0 ? strerror(errno) : "bad args");
		return 2;
	}
	long i = 0, count = 0;
	lock_byte(fd, F_WRLCK, 0);
	/* The first second is warm-up: the other processes start around now. */
	double t0 = now(), start = t0 + 1;
	int counting = 0;
	for (;;) {
		lock_byte(fd, F_WRLCK, (i + 1) % num);
		lock_byte(fd, F_UNLCK, i % num);
		i++;
		double t = now();
		if (!counting && t >= start) {
			counting = 1;
			count = 0;
			start = t;
		}
		count++;
		if (counting && t - start >= secs)
			break;
	}
	printf("%.0f\n", count / (now() - start));
	lock_byte(fd, F_UNLCK, i % num);
	close(fd);
	return 0;
}
