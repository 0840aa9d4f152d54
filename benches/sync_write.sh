#!/usr/bin/env bash
# A database's commits: 4 KiB overwrites in place, each followed by fdatasync or fsync, and
# 4 KiB reads of the same file while another process commits that way. Two etcfs binaries
# side by side, with the raw file beside the device image as the reference.
#
# Each round mounts each binary in turn (order alternating between rounds) on a fresh
# prefix of one private etcd (one member, loopback) and one sparse device image, lays out
# a SIZE file with one 1 MiB O_DIRECT write pass (so that every later write overwrites
# blocks already allocated, as a database's preallocated files are), and runs with fio
# (`--direct=1 --ioengine=psync`, SECS seconds each after a 1 s ramp):
#   fdatasync: 4 KiB random writes, each followed by fdatasync(2)
#   fsync:     the same with fsync(2)
#   reads:     4 KiB random reads at QD 1 while a second job of the same run does the fsync job
#              on the same file: the reads' latency while commits go on
# The raw file (laid out the same way, next to the image) runs the same jobs once per round.
# Prints, per job, the median over the rounds of the IOPS and latency percentiles of each
# binary and of the raw file, and B / A.
#
# Needs root, /dev/fuse, fio and etcd (scripts/deps.sh installs them).
#
# usage: benches/sync_write.sh --a PATH --b PATH [--rounds N] [--secs S] [--size SIZE]
#                              [--labels "before after"]
set -euo pipefail

ROUNDS=3
SECS=5
SIZE=256M
A=""
B=""
LABELS="A B"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
while [ $# -gt 0 ]; do
	case "$1" in
	--a) A=$2; shift 2 ;;
	--b) B=$2; shift 2 ;;
	--rounds) ROUNDS=$2; shift 2 ;;
	--secs) SECS=$2; shift 2 ;;
	--size) SIZE=$2; shift 2 ;;
	--labels) LABELS=$2; shift 2 ;;
	-h | --help) sed -n '2,22p' "$0"; exit 0 ;;
	*) echo "sync_write.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$A" ] && [ -x "$B" ] || { echo "sync_write.sh: --a and --b must name etcfs binaries" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "sync_write.sh: needs root (FUSE mounts)" >&2; exit 2; }
command -v fio >/dev/null || { echo "sync_write.sh: needs fio (scripts/deps.sh installs it)" >&2; exit 2; }

WORK=$(mktemp -d /tmp/etcfs-sync-write.XXXXXX)
IMG=/var/tmp/etcfs-sync-write-$$.img
RAW=/var/tmp/etcfs-sync-write-raw-$$
MNT=$WORK/mnt
PORT=${SYNC_WRITE_ETCD_PORT:-27579}
EP=http://127.0.0.1:$PORT
pids=()
unmount() { unmount_started "$MNT"; }
cleanup() {
	unmount
	stop_started
	rm -rf "$WORK" "$IMG" "$RAW"
}
trap cleanup EXIT

start_etcd sync-write "$WORK" "$PORT"
truncate -s 4G "$IMG"

lay_out() { # FILE
	fio --name=layout --filename="$1" --rw=write --bs=1m --direct=1 --ioengine=psync \
		--size="$SIZE" >"$WORK/layout.log" 2>&1 || { cat "$WORK/layout.log" >&2; exit 1; }
}
COMMON=(--direct=1 --ioengine=psync --bs=4k --size="$SIZE" --time_based --runtime="$SECS"
	--ramp_time=1 --randrepeat=0 --norandommap --output-format=json)
# jobs FILE SIDE ROUND: the three jobs on FILE, one line of figures each into results.
jobs() {
	local file=$1 side=$2 round=$3 job
	for job in fdatasync fsync; do
		fio --name="$job" --filename="$file" --rw=randwrite "--$job=1" "${COMMON[@]}" \
			--output="$WORK/$job.json" >/dev/null 2>"$WORK/fio.err" || { cat "$WORK/fio.err" >&2; exit 1; }
		python3 - "$WORK/$job.json" "$side" "$round" "$job" >>"$WORK/results" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
w, s = j["write"], j["sync"]["lat_ns"]
pct = s.get("percentile", {})
print(sys.argv[2], sys.argv[3], sys.argv[4], f'{w["iops"]:.0f}',
      f'{pct.get("50.000000", 0) / 1e3:.1f}', f'{pct.get("99.000000", 0) / 1e3:.1f}')
EOF
	done
	fio "${COMMON[@]}" --filename="$file" --output="$WORK/reads.json" \
		--name=reads --rw=randread \
		--name=commits --rw=randwrite --fsync=1 >/dev/null 2>"$WORK/fio.err" ||
		{ cat "$WORK/fio.err" >&2; exit 1; }
	python3 - "$WORK/reads.json" "$side" "$round" >>"$WORK/results" <<'EOF'
import json, sys
j = {x["jobname"]: x for x in json.load(open(sys.argv[1]))["jobs"]}
r = j["reads"]["read"]
pct = r["clat_ns"]["percentile"]
print(sys.argv[2], sys.argv[3], "reads", f'{r["iops"]:.0f}',
      f'{pct["50.000000"] / 1e3:.1f}', f'{pct["99.000000"] / 1e3:.1f}')
EOF
	tail -3 "$WORK/results" | sed "s/^/[sync_write.sh $(date +%H:%M:%S)] /" >&2
}

lay_out "$RAW"
for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then order=(a raw b); else order=(b raw a); fi
	for side in "${order[@]}"; do
		if [ "$side" = raw ]; then
			jobs "$RAW" raw "$r"
			continue
		fi
		if [ "$side" = a ]; then bin=$A; else bin=$B; fi
		prefix=sw-$r-$side
		"$bin" mkfs --etcd "$EP" --device "$IMG" --prefix "$prefix" --force >/dev/null
		mount_etcfs "$bin" "$EP" "$IMG" "$prefix" "$MNT" "$WORK/daemon.log"
		lay_out "$MNT/db"
		jobs "$MNT/db" "$side" "$r"
		unmount
	done
done

python3 - "$WORK/results" "$LABELS" "$ROUNDS" "$SECS" "$SIZE" <<'PY'
import statistics, sys
la, lb = sys.argv[2].split()
rounds, secs, size = sys.argv[3:6]
R = {}
for line in open(sys.argv[1]):
    side, _, job, *v = line.split()
    R.setdefault((side, job), []).append([float(x) for x in v])
def med(side, job, k):
    return statistics.median(v[k] for v in R[(side, job)])
def cell(side, job, k, d):
    v = sorted(x[k] for x in R[(side, job)])
    f = lambda x: f"{x:,.{d}f}".replace(",", " ")
    return f"{f(med(side, job, k))} ({f(v[0])}–{f(v[-1])})"
print(f"fio --direct=1 --ioengine=psync --bs=4k, {size} file laid out, {secs} s per job, "
      f"{rounds} rounds, medians (range)")
print()
print(f"| job | measure | raw file | etcfs {la} | etcfs {lb} | {lb} / {la} | {la} / raw | {lb} / raw |")
print("|---|---|---|---|---|---|---|---|")
jobs = {
    "fdatasync": ("4 KiB overwrite + fdatasync", "fdatasync"),
    "fsync": ("4 KiB overwrite + fsync", "fsync"),
    "reads": ("4 KiB random read beside overwrite + fsync", "read"),
}
for job, (label, what) in jobs.items():
    for k, measure, d in ((0, "IOPS", 0), (1, f"{what} p50 µs", 1), (2, f"{what} p99 µs", 1)):
        a, b, raw = med("a", job, k), med("b", job, k), med("raw", job, k)
        ratio = lambda x, y: f"{x / y:.2f}x" if y else "—"
        print(f"| {label} | {measure} | {cell('raw', job, k, d)} | {cell('a', job, k, d)} "
              f"| {cell('b', job, k, d)} | {ratio(b, a)} | {ratio(a, raw)} | {ratio(b, raw)} |")
PY
