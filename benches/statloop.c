// statloop: the stat() client of benches/transport.sh.
//
// N threads each call stat(2) on one path in a loop for a fixed time (after a short warm-up)
// and time every call. With the filesystem's entry and attribute timeouts at 0, every call is
// a round trip to the FUSE server (LOOKUP + GETATTR). Prints one line of key=value pairs:
//
//   threads=2 secs=3.000 ops=123456 ops_per_s=41152 p50_us=45.1 p90_us=60.2 p99_us=98.0 errors=0 calls=140000
//
// `calls` counts every stat(2) made, warm-up included, so a caller can divide the requests its
// server saw by it.
//
// usage: statloop [-t THREADS] [-d SECONDS] [-w WARMUP_SECONDS] PATH
// build: gcc -O2 -pthread benches/statloop.c -o statloop
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// Latencies are counted in 100 ns buckets up to 100 ms; slower calls land in the last one.
#define BUCKET_NS 100
#define BUCKETS 1000000

struct worker {
	pthread_t thread;
	const char *path;
	double warmup_s, run_s;
	uint32_t *hist; // BUCKETS counters
	uint64_t ops, errors, calls;
	double elapsed_s;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}

static pthread_barrier_t start_line;

static void *run(void *arg)
{
	struct worker *w = arg;
	struct stat st;
	pthread_barrier_wait(&start_line);
	double warm_end = now_s() + w->warmup_s;
	while (now_s() < warm_end) {
		(void)stat(w->path, &st);
		w->calls++;
	}
	pthread_barrier_wait(&start_line);
	double t0 = now_s(), end = t0 + w->run_s;
	for (;;) {
		// Check the clock every 64 calls; each call is itself timed below.
		for (int i = 0; i < 64; i++) {
			uint64_t a = now_ns();
			int rc = stat(w->path, &st);
			uint64_t b = now_ns() - a;
			w->calls++;
			if (rc != 0) {
				w->errors++;
				continue;
			}
			uint64_t bucket = b / BUCKET_NS;
			w->hist[bucket < BUCKETS ? bucket : BUCKETS - 1]++;
			w->ops++;
		}
		if (now_s() >= end)
			break;
	}
	w->elapsed_s = now_s() - t0;
	return NULL;
}

// The latency (µs) below which a fraction q of the calls fell, from the merged histogram.
static double quantile_us(const uint64_t *hist, uint64_t total, double q)
{
	uint64_t want = (uint64_t)(q * total), seen = 0;
	for (size_t i = 0; i < BUCKETS; i++) {
		seen += hist[i];
		if (seen > want)
			return (i + 0.5) * BUCKET_NS / 1000.0;
	}
	return (BUCKETS - 0.5) * BUCKET_NS / 1000.0;
}

int main(int argc, char **argv)
{
	int threads = 1, opt;
	double run_s = 3, warmup_s = 0.5;
	while ((opt = getopt(argc, argv, "t:d:w:")) != -1) {
		switch (opt) {
		case 't': threads = atoi(optarg); break;
		case 'd': run_s = atof(optarg); break;
		case 'w': warmup_s = atof(optarg); break;
		default: goto usage;
		}
	}
	if (optind + 1 != argc || threads < 1 || threads > 256 || run_s <= 0 || warmup_s < 0)
		goto usage;
	const char *path = argv[optind];
	struct stat st;
	if (stat(path, &st) != 0) {
		fprintf(stderr, "statloop: stat %s: %s\n", path, strerror(errno));
		return 1;
	}

	struct worker *ws = calloc(threads, sizeof *ws);
	uint64_t *merged = calloc(BUCKETS, sizeof *merged);
	if (!ws || !merged)
		return 1;
	pthread_barrier_init(&start_line, NULL, threads);
	for (int i = 0; i < threads; i++) {
		ws[i] = (struct worker){.path = path, .warmup_s = warmup_s, .run_s = run_s};
		ws[i].hist = calloc(BUCKETS, sizeof *ws[i].hist);
		if (!ws[i].hist || pthread_create(&ws[i].thread, NULL, run, &ws[i]) != 0) {
			fprintf(stderr, "statloop: cannot start thread %d\n", i);
			return 1;
		}
	}
	uint64_t ops = 0, errors = 0, calls = 1; // 1: the check in main
	double elapsed = 0;
	for (int i = 0; i < threads; i++) {
		pthread_join(ws[i].thread, NULL);
		ops += ws[i].ops;
		errors += ws[i].errors;
		calls += ws[i].calls;
		if (ws[i].elapsed_s > elapsed)
			elapsed = ws[i].elapsed_s;
		for (size_t b = 0; b < BUCKETS; b++)
			merged[b] += ws[i].hist[b];
	}
	if (ops == 0) {
		fprintf(stderr, "statloop: no successful stat in %.1f s (%llu errors)\n", elapsed,
			(unsigned long long)errors);
		return 1;
	}
	printf("threads=%d secs=%.3f ops=%llu ops_per_s=%.0f p50_us=%.1f p90_us=%.1f p99_us=%.1f errors=%llu calls=%llu\n",
	       threads, elapsed, (unsigned long long)ops, ops / elapsed, quantile_us(merged, ops, 0.50),
	       quantile_us(merged, ops, 0.90), quantile_us(merged, ops, 0.99), (unsigned long long)errors,
	       (unsigned long long)calls);
	return errors ? 1 : 0;
usage:
	fprintf(stderr, "usage: %s [-t THREADS] [-d SECONDS] [-w WARMUP_SECONDS] PATH\n", argv[0]);
	return 2;
}
