// One client of the shared-directory metadata scenario of benches/compare/run.sh.
//
//   metaclient DIR ID FILES GO_FIFO BACK_FIFO
//
// In DIR (shared with the other clients, each usually through its own mount of the same
// filesystem) runs three phases on the names c<ID>-<i>, i = 0..FILES-1:
//   create: openat(O_CREAT|O_EXCL|O_WRONLY) + close
//   stat:   fstatat
//   unlink: unlinkat
// The driver holds both FIFOs open read-write (GO_FIFO is this client's own). Before each
// phase the client writes "ready <phase> <ID>" to BACK_FIFO and blocks reading one byte from
// GO_FIFO; the driver writes a byte to every client's GO_FIFO when all are ready, so the
// clients start a phase together without spinning. After the phase it writes "done <phase> <ID> <µs>". It also prints
// "<phase> <elapsed µs>" on stdout, timed from the go byte to the last call returning.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void tell(int fd, const char *msg)
{
	size_t n = strlen(msg);
	if (write(fd, msg, n) != (ssize_t)n) {
		perror("metaclient: write to the driver");
		exit(1);
	}
}

static void wait_go(int fd)
{
	char c;
	ssize_t r;
	while ((r = read(fd, &c, 1)) < 0 && errno == EINTR)
		;
	if (r != 1) {
		fprintf(stderr, "metaclient: the go pipe closed\n");
		exit(1);
	}
}

static void die(const char *what, const char *name)
{
	fprintf(stderr, "metaclient: %s %s: %s\n", what, name, strerror(errno));
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: metaclient DIR ID FILES GO_FIFO BACK_FIFO\n");
		return 2;
	}
	int id = atoi(argv[2]), n = atoi(argv[3]);
	if (n <= 0)
		return 2;
	int go = open(argv[4], O_RDONLY), back = open(argv[5], O_WRONLY);
	if (go < 0 || back < 0)
		die("open", go < 0 ? argv[4] : argv[5]);
	char msg[128];
	char (*names)[32] = calloc(n, 32);
	for (int i = 0; i < n; i++)
		snprintf(names[i], 32, "c%d-%05d", id, i);
	int dfd = open(argv[1], O_RDONLY | O_DIRECTORY);
	if (dfd < 0)
		die("open", argv[1]);
	static const char *phases[] = {"create", "stat", "unlink"};
	for (int ph = 0; ph < 3; ph++) {
		struct stat st;
		snprintf(msg, sizeof msg, "ready %s %d\n", phases[ph], id);
		tell(back, msg);
		wait_go(go);
		double t0 = now_us();
		for (int i = 0; i < n; i++) {
			if (ph == 0) {
				int fd = openat(dfd, names[i], O_CREAT | O_EXCL | O_WRONLY, 0644);
				if (fd < 0)
					die("create", names[i]);
				if (close(fd) != 0)
					die("close", names[i]);
			} else if (ph == 1) {
				if (fstatat(dfd, names[i], &st, 0) != 0)
					die("stat", names[i]);
			} else if (unlinkat(dfd, names[i], 0) != 0) {
				die("unlink", names[i]);
			}
		}
		double t = now_us() - t0;
		printf("%s %.0f\n", phases[ph], t);
		fflush(stdout);
		snprintf(msg, sizeof msg, "done %s %d %.0f\n", phases[ph], id, t);
		tell(back, msg);
	}
	return 0;
}
