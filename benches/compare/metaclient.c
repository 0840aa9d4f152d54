// The shared-directory metadata scenario of benches/compare/run.sh.
//
//   metaclient FILES HOOK DIR0 [DIR1 ...]
//
// Forks one client process per DIR (the same shared directory seen through a different mount
// of the same filesystem, or the same path for a local filesystem). Client i runs three phases
// on the names c<i>-<n>, n = 0..FILES-1:
//   create: openat(O_CREAT|O_EXCL|O_WRONLY) + close
//   stat:   fstatat
//   unlink: unlinkat
// Before each phase every client reports ready and blocks on its own pipe; when all are ready
// the parent runs `HOOK <phase> a` (the caller's counter snapshot; an empty HOOK runs
// nothing), then releases them all at once, waits until all have finished and runs
// `HOOK <phase> b`. No client spins while it waits, and a client that dies is seen at once
// (its pipe reaches end of file). Prints "<client> <phase> <µs>" for every client and phase,
// timed from the release to the client's last call returning. Exits non-zero if any client
// failed; gives up after 900 s. SIGTERM or SIGINT stops the clients too.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CLIENTS 64

static const char *phases[] = {"create", "stat", "unlink"};
static pid_t kids[MAX_CLIENTS];
static int nkids;

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void stop_kids(void)
{
	for (int i = 0; i < nkids; i++)
		if (kids[i] > 0)
			kill(kids[i], SIGKILL);
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char msg[] = "metaclient: gave up after 900 s\n";
	stop_kids();
	if (write(2, msg, sizeof msg - 1) < 0)
		_exit(1);
	_exit(1);
}

static void on_term(int sig)
{
	(void)sig;
	stop_kids();
	_exit(1);
}

static void full_write(int fd, const void *buf, size_t n)
{
	const char *p = buf;
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			perror("metaclient: write");
			exit(1);
		}
		p += w;
		n -= w;
	}
}

// Reads exactly n bytes; returns 0 at end of file (the other side is gone).
static int full_read(int fd, void *buf, size_t n)
{
	char *p = buf;
	while (n > 0) {
		ssize_t r = read(fd, p, n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return 0;
		p += r;
		n -= r;
	}
	return 1;
}

static void fail(int id, const char *what, const char *name)
{
	fprintf(stderr, "metaclient %d: %s %s: %s\n", id, what, name, strerror(errno));
	exit(1);
}

// One client: reports ready (a byte), waits for go (a byte), runs the phase, reports the
// elapsed µs (a double), three times.
static void client(int id, const char *dir, int n, int go, int back)
{
	char(*names)[32] = calloc(n, 32);
	for (int i = 0; i < n; i++)
		snprintf(names[i], 32, "c%d-%05d", id, i);
	int dfd = open(dir, O_RDONLY | O_DIRECTORY);
	if (dfd < 0)
		fail(id, "open", dir);
	for (int ph = 0; ph < 3; ph++) {
		struct stat st;
		char c = 'r';
		full_write(back, &c, 1);
		if (!full_read(go, &c, 1))
			exit(1);
		double t0 = now_us();
		for (int i = 0; i < n; i++) {
			if (ph == 0) {
				int fd = openat(dfd, names[i], O_CREAT | O_EXCL | O_WRONLY, 0644);
				if (fd < 0)
					fail(id, "create", names[i]);
				if (close(fd) != 0)
					fail(id, "close", names[i]);
			} else if (ph == 1) {
				if (fstatat(dfd, names[i], &st, 0) != 0)
					fail(id, "stat", names[i]);
			} else if (unlinkat(dfd, names[i], 0) != 0) {
				fail(id, "unlink", names[i]);
			}
		}
		double t = now_us() - t0;
		full_write(back, &t, sizeof t);
	}
	exit(0);
}

static void hook(const char *cmd, const char *phase, const char *when)
{
	char buf[8192];
	if (!cmd[0])
		return;
	snprintf(buf, sizeof buf, "%s %s %s", cmd, phase, when);
	if (system(buf) != 0) {
		fprintf(stderr, "metaclient: hook '%s' failed\n", buf);
		stop_kids();
		exit(1);
	}
}

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: metaclient FILES HOOK DIR0 [DIR1 ...]\n");
		return 2;
	}
	int n = atoi(argv[1]);
	nkids = argc - 3;
	if (n <= 0 || nkids > MAX_CLIENTS)
		return 2;
	int go[MAX_CLIENTS], back[MAX_CLIENTS];
	signal(SIGPIPE, SIG_IGN);
	signal(SIGALRM, on_alarm);
	signal(SIGTERM, on_term);
	signal(SIGINT, on_term);
	alarm(900);
	fflush(stdout);
	for (int i = 0; i < nkids; i++) {
		int g[2], b[2];
		if (pipe(g) != 0 || pipe(b) != 0) {
			perror("pipe");
			stop_kids();
			return 1;
		}
		kids[i] = fork();
		if (kids[i] < 0) {
			perror("fork");
			stop_kids();
			return 1;
		}
		if (kids[i] == 0) {
			signal(SIGALRM, SIG_DFL);
			signal(SIGTERM, SIG_DFL);
			signal(SIGINT, SIG_DFL);
			alarm(0);
			for (int j = 0; j < i; j++) {
				close(go[j]);
				close(back[j]);
			}
			close(g[1]);
			close(b[0]);
			client(i, argv[3 + i], n, g[0], b[1]);
		}
		close(g[0]);
		close(b[1]);
		go[i] = g[1];
		back[i] = b[0];
	}
	double took[MAX_CLIENTS][3];
	for (int ph = 0; ph < 3; ph++) {
		for (int i = 0; i < nkids; i++) {
			char c;
			if (!full_read(back[i], &c, 1)) {
				fprintf(stderr, "metaclient: client %d died before %s\n", i, phases[ph]);
				stop_kids();
				return 1;
			}
		}
		hook(argv[2], phases[ph], "a");
		for (int i = 0; i < nkids; i++)
			full_write(go[i], "g", 1);
		for (int i = 0; i < nkids; i++) {
			if (!full_read(back[i], &took[i][ph], sizeof(double))) {
				fprintf(stderr, "metaclient: client %d failed in %s\n", i, phases[ph]);
				stop_kids();
				return 1;
			}
		}
		hook(argv[2], phases[ph], "b");
	}
	int bad = 0;
	for (int i = 0; i < nkids; i++) {
		int st;
		if (waitpid(kids[i], &st, 0) != kids[i] || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			bad = 1;
	}
	for (int i = 0; i < nkids; i++)
		for (int ph = 0; ph < 3; ph++)
			printf("%d %s %.0f\n", i, phases[ph], took[i][ph]);
	return bad;
}
