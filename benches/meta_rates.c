// meta_rates: the metadata client of benches/fs.sh.
//
// Runs one phase (create, stat or unlink) over a set of files in one directory, with K
// client processes in parallel, and times the phase as a whole: from the moment every
// client is ready until the last one is done. Process start-up is outside the timed part,
// so the rate is the filesystem's, not fork/exec's.
//
// Client k owns the files DIR/c<k>.<i> for i in [0, N) (with -d: DIR/d<k>/c<k>.<i>, one
// directory per client, which the create phase makes and the unlink phase removes, both
// outside the timed part):
//   create  open(O_CREAT|O_EXCL|O_WRONLY, 0644) then close (what creat(2)-style tools do)
//   stat    stat(2)
//   unlink  unlink(2)
// Each client also times every call; the phase prints one line of key=value pairs:
//
//   phase=create clients=4 files=2000 secs=1.234 ops_per_s=1621 p50_us=2100.0 p99_us=5200.0 errors=0
//
// ops_per_s is the aggregate (files of all clients / phase time). Exit status 1 if any call
// failed (the first failure is reported on stderr).
//
// usage: meta_rates -p create|stat|unlink -n FILES_PER_CLIENT [-c CLIENTS] [-d] DIR
// build: gcc -O2 -Wall benches/meta_rates.c -o meta_rates
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum phase { P_CREATE, P_STAT, P_UNLINK };

static double mono_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return (x > y) - (x < y);
}

// One call of the phase on one path; 0 or an errno.
static int one_op(enum phase p, const char *path)
{
	struct stat st;
	int fd;
	switch (p) {
	case P_CREATE:
		fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
		if (fd < 0)
			return errno;
		if (close(fd) != 0)
			return errno;
		return 0;
	case P_STAT:
		return stat(path, &st) == 0 ? 0 : errno;
	case P_UNLINK:
		return unlink(path) == 0 ? 0 : errno;
	}
	return EINVAL;
}

// Runs client k's share; writes per-call latencies (µs, rounded up) into lat[0..n).
// Returns the number of failed calls.
static int client(enum phase p, const char *dir, int own_dir, int k, int n, uint32_t *lat)
{
	char path[4096];
	int failed = 0;
	for (int i = 0; i < n; i++) {
		if (own_dir)
			snprintf(path, sizeof path, "%s/d%d/c%d.%d", dir, k, k, i);
		else
			snprintf(path, sizeof path, "%s/c%d.%d", dir, k, i);
		double t0 = mono_s();
		int e = one_op(p, path);
		double us = (mono_s() - t0) * 1e6;
		lat[i] = us >= 4e9 ? UINT32_MAX : (uint32_t)(us + 0.999);
		if (e != 0) {
			if (failed == 0)
				fprintf(stderr, "meta_rates: %s: %s\n", path, strerror(e));
			failed++;
		}
	}
	return failed;
}

static void usage(void)
{
	fprintf(stderr, "usage: meta_rates -p create|stat|unlink -n FILES_PER_CLIENT [-c CLIENTS] [-d] DIR\n");
	exit(2);
}

int main(int argc, char **argv)
{
	enum phase p = P_CREATE;
	const char *pname = NULL;
	int n = 0, clients = 1, own_dir = 0, opt;
	while ((opt = getopt(argc, argv, "p:n:c:d")) != -1) {
		switch (opt) {
		case 'p':
			pname = optarg;
			break;
		case 'n':
			n = atoi(optarg);
			break;
		case 'c':
			clients = atoi(optarg);
			break;
		case 'd':
			own_dir = 1;
			break;
		default:
			usage();
		}
	}
	if (optind != argc - 1 || !pname || n <= 0 || clients <= 0 || clients > 256)
		usage();
	if (strcmp(pname, "create") == 0)
		p = P_CREATE;
	else if (strcmp(pname, "stat") == 0)
		p = P_STAT;
	else if (strcmp(pname, "unlink") == 0)
		p = P_UNLINK;
	else
		usage();
	const char *dir = argv[optind];
	char sub[4096];
	if (own_dir && p == P_CREATE) {
		for (int k = 0; k < clients; k++) {
			snprintf(sub, sizeof sub, "%s/d%d", dir, k);
			if (mkdir(sub, 0755) != 0 && errno != EEXIST) {
				fprintf(stderr, "meta_rates: mkdir %s: %s\n", sub, strerror(errno));
				return 1;
			}
		}
	}

	// Latencies and failure counts live in a shared mapping the children fill in.
	size_t total = (size_t)n * (size_t)clients;
	size_t bytes = total * sizeof(uint32_t) + (size_t)clients * sizeof(int);
	void *shm = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (shm == MAP_FAILED) {
		perror("meta_rates: mmap");
		return 1;
	}
	uint32_t *lat = shm;
	int *failed = (int *)(lat + total);

	// Start gate: children block reading `go` until the parent closes its write end.
	// Ready pipe: each child writes one byte once it is about to wait on the gate.
	int go[2], ready[2];
	if (pipe(go) != 0 || pipe(ready) != 0) {
		perror("meta_rates: pipe");
		return 1;
	}
	pid_t *pids = calloc((size_t)clients, sizeof(pid_t));
	for (int k = 0; k < clients; k++) {
		pid_t pid = fork();
		if (pid < 0) {
			perror("meta_rates: fork");
			return 1;
		}
		if (pid == 0) {
			char c;
			close(go[1]);
			close(ready[0]);
			if (write(ready[1], "r", 1) != 1)
				_exit(3);
			if (read(go[0], &c, 1) < 0)
				_exit(3);
			failed[k] = client(p, dir, own_dir, k, n, lat + (size_t)k * (size_t)n);
			_exit(0);
		}
		pids[k] = pid;
	}
	close(go[0]);
	close(ready[1]);
	for (int k = 0; k < clients; k++) {
		char c;
		if (read(ready[0], &c, 1) != 1) {
			fprintf(stderr, "meta_rates: a client died before starting\n");
			return 1;
		}
	}
	double t0 = mono_s();
	close(go[1]); // every child's read returns 0 now
	int bad_exit = 0;
	for (int k = 0; k < clients; k++) {
		int status;
		if (waitpid(pids[k], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
			bad_exit = 1;
	}
	double secs = mono_s() - t0;
	if (own_dir && p == P_UNLINK) {
		for (int k = 0; k < clients; k++) {
			snprintf(sub, sizeof sub, "%s/d%d", dir, k);
			if (rmdir(sub) != 0) {
				fprintf(stderr, "meta_rates: rmdir %s: %s\n", sub, strerror(errno));
				bad_exit = 1;
			}
		}
	}

	long errors = 0;
	for (int k = 0; k < clients; k++)
		errors += failed[k];
	qsort(lat, total, sizeof(uint32_t), cmp_u32);
	double p50 = lat[(total - 1) / 2];
	double p99 = lat[(size_t)((double)(total - 1) * 0.99)];
	printf("phase=%s clients=%d dirs=%d files=%zu secs=%.3f ops_per_s=%.0f p50_us=%.0f p99_us=%.0f errors=%ld\n",
	       pname, clients, own_dir ? clients : 1, total, secs, (double)total / secs, p50, p99, errors);
	return (errors || bad_exit) ? 1 : 0;
}
