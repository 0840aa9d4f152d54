#!/usr/bin/env bash
# Two etcfs binaries side by side on the issue-3 fio jobs (benches/fs.sh's fio part:
# direct=1, io_uring, 1 job, 1 MiB sequential read/write QD 1, 4 KiB random read/write QD 1
# and 32, each job in etcfs and on the raw file back to back). Each round runs
# `benches/fs.sh --etcfs BIN --no-meta --no-perf-pass --runs 1` once per binary, the order
# alternating between rounds (A then B, B then A, ...), so that both see the host alike.
# Prints, per job, the medians over the rounds for each binary (etcfs figure and its ratio
# to the raw file in the same fs.sh run) and B / A.
#
# usage: benches/fio_ab.sh --a PATH --b PATH [--rounds N] [--fio-secs S] [--fio-size SIZE]
#                          [--fio-jobs NAME,...] [--labels "before after"]
set -euo pipefail

ROUNDS=3
FIO_SECS=5
FIO_SIZE=1G
FIO_JOBS=seqread,seqwrite,randread-qd1,randread-qd32,randwrite-qd1,randwrite-qd32
A=""
B=""
LABELS="A B"
while [ $# -gt 0 ]; do
	case "$1" in
	--a) A=$2; shift 2 ;;
	--b) B=$2; shift 2 ;;
	--rounds) ROUNDS=$2; shift 2 ;;
	--fio-secs) FIO_SECS=$2; shift 2 ;;
	--fio-size) FIO_SIZE=$2; shift 2 ;;
	--fio-jobs) FIO_JOBS=$2; shift 2 ;;
	--labels) LABELS=$2; shift 2 ;;
	-h | --help) sed -n '2,11p' "$0"; exit 0 ;;
	*) echo "fio_ab.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$A" ] && [ -x "$B" ] || { echo "fio_ab.sh: --a and --b must name etcfs binaries" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d /tmp/etcfs-fio-ab.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then order=(a b); else order=(b a); fi
	for side in "${order[@]}"; do
		if [ "$side" = a ]; then bin=$A; else bin=$B; fi
		echo "[fio_ab.sh $(date +%H:%M:%S)] round $r/$ROUNDS: $side ($bin)" >&2
		bash "$ROOT/benches/fs.sh" --etcfs "$bin" --no-meta --no-perf-pass --runs 1 \
			--fio-secs "$FIO_SECS" --fio-size "$FIO_SIZE" --fio-jobs "$FIO_JOBS" >/dev/null 2>"$WORK/log" ||
			{ cat "$WORK/log" >&2; exit 1; }
		# "[fs.sh T] fio run 1/1 SIDE JOB: MiB/s IOPS p50-µs = M I P"
		sed -n "s/.* fio run [0-9/]* \([a-z]*\) \([a-z0-9-]*\): .* = \(.*\)/$side $r \1 \2 \3/p" \
			"$WORK/log" | tee -a "$WORK/results" >&2
	done
done

python3 - "$WORK/results" "$LABELS" <<'PY'
import statistics, sys
la, lb = sys.argv[2].split()
R = {}
for line in open(sys.argv[1]):
    binary, rnd, side, job, mibs, iops, p50 = line.split()
    R[(binary, rnd, side, job)] = {"MiB/s": float(mibs), "IOPS": float(iops), "clat p50 µs": float(p50)}
jobs = {
    "seqread": ("1 MiB sequential read, QD 1", "MiB/s"),
    "seqwrite": ("1 MiB sequential write, QD 1", "MiB/s"),
    "randread-qd1": ("4 KiB random read, QD 1", "IOPS"),
    "randread-qd32": ("4 KiB random read, QD 32", "IOPS"),
    "randwrite-qd1": ("4 KiB random write, QD 1", "IOPS"),
    "randwrite-qd32": ("4 KiB random write, QD 32", "IOPS"),
}
rounds = sorted({k[1] for k in R}, key=int)
def vals(binary, side, job, m):
    return [R[(binary, r, side, job)][m] for r in rounds if (binary, r, side, job) in R]
def cell(v, d=0):
    v = sorted(v)
    return f"{statistics.median(v):,.{d}f} ({v[0]:,.{d}f}–{v[-1]:,.{d}f})".replace(",", " ")
print(f"| fio job | metric | etcfs {la} | etcfs {lb} | {lb} / {la} | etcfs / raw, {la} | etcfs / raw, {lb} |")
print("|---|---|---|---|---|---|---|")
for job, (label, unit) in jobs.items():
    for m in (unit, "clat p50 µs"):
        a, b = vals("a", "etcfs", job, m), vals("b", "etcfs", job, m)
        if not a or not b:
            continue
        ra = [x / y for x, y in zip(a, vals("a", "raw", job, m))]
        rb = [x / y for x, y in zip(b, vals("b", "raw", job, m))]
        print(f"| {label} | {m} | {cell(a)} | {cell(b)} | {statistics.median(b) / statistics.median(a):.2f}x "
              f"| {cell(ra, 2)} | {cell(rb, 2)} |")
print()
print(f"Cells: median (min–max) of {len(rounds)} rounds; etcfs / raw within each fs.sh run.")
PY
