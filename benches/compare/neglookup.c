// Negative-lookup sweeps for benches/compare/run.sh.
//
//   neglookup DIR MISSING WARM_SWEEPS HOOK
//
// Opens DIR once (so the path walk to it is not part of any sweep), then calls
// fstatat(DIR, "missing-NNNN") for NNNN = 0..MISSING-1: one cold sweep, then WARM_SWEEPS warm
// sweeps. Every call must fail with ENOENT. Runs `HOOK pre`, `HOOK mid` and `HOOK post` (through
// the shell, outside the timed regions) before the cold sweep, between the sweeps and after the
// warm ones, so the caller can snapshot counters around each. Prints
//   cold_us <µs per lookup in the cold sweep>
//   warm_us <µs per lookup over all warm sweeps>
//   warm_median_us <µs per lookup in the median warm sweep>
//   warm_best_us <µs per lookup in the fastest warm sweep>
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

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void hook(const char *cmd, const char *phase)
{
	char buf[4096];
	if (!cmd[0])
		return;
	snprintf(buf, sizeof buf, "%s %s", cmd, phase);
	if (system(buf) != 0) {
		fprintf(stderr, "neglookup: hook '%s' failed\n", buf);
		exit(1);
	}
}

// One sweep; returns its elapsed µs. Exits if a name unexpectedly exists.
static double sweep(int dfd, char (*names)[32], int n)
{
	struct stat st;
	double t0 = now_us();
	for (int i = 0; i < n; i++) {
		if (fstatat(dfd, names[i], &st, 0) == 0 || errno != ENOENT) {
			fprintf(stderr, "neglookup: %s: expected ENOENT, got %s\n", names[i],
				strerror(errno));
			exit(1);
		}
	}
	return now_us() - t0;
}

int main(int argc, char **argv)
{
	if (argc != 5) {
		fprintf(stderr, "usage: neglookup DIR MISSING WARM_SWEEPS HOOK\n");
		return 2;
	}
	int n = atoi(argv[2]), warm = atoi(argv[3]);
	if (n <= 0 || warm <= 0)
		return 2;
	char (*names)[32] = calloc(n, 32);
	for (int i = 0; i < n; i++)
		snprintf(names[i], 32, "missing-%04d", i);
	int dfd = open(argv[1], O_RDONLY | O_DIRECTORY);
	if (dfd < 0) {
		perror(argv[1]);
		return 1;
	}
	hook(argv[4], "pre");
	double cold = sweep(dfd, names, n);
	hook(argv[4], "mid");
	double total = 0, *each = calloc(warm, sizeof(double));
	for (int s = 0; s < warm; s++) {
		each[s] = sweep(dfd, names, n);
		total += each[s];
	}
	hook(argv[4], "post");
	qsort(each, warm, sizeof(double), cmp_double);
	printf("cold_us %.3f\nwarm_us %.3f\nwarm_median_us %.3f\nwarm_best_us %.3f\n", cold / n,
	       total / ((double)n * warm), each[(warm - 1) / 2] / n, each[0] / n);
	return 0;
}
