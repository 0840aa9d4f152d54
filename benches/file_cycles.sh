#!/usr/bin/env bash
# Short-lived files and attribute changes (benches/file_cycles.py: create + write 4 KiB +
# fsync + close + unlink, the unlink alone, fsync of the directory after a create, chmod,
# utime, chown to the same owner), on two
# etcfs binaries side by side and on the local disk beside the device image as the
# reference. Each round mounts each binary in turn (order alternating) on a fresh prefix of
# one private etcd and a fresh device image. Prints per job the median over the rounds of
# the p50 and p90 latency (µs) of each side, and B / A.
#
# Needs root, /dev/fuse, python3 and etcd (scripts/deps.sh installs them).
#
# usage: benches/file_cycles.sh --a PATH --b PATH [--rounds N] [--ops N] [--labels "A B"]
set -euo pipefail

ROUNDS=3
OPS=500
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
	--ops) OPS=$2; shift 2 ;;
	--labels) LABELS=$2; shift 2 ;;
	-h | --help) sed -n '2,10p' "$0"; exit 0 ;;
	*) echo "file_cycles.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$A" ] && [ -x "$B" ] || { echo "file_cycles.sh: --a and --b must name etcfs binaries" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "file_cycles.sh: needs root (FUSE mounts)" >&2; exit 2; }

WORK=$(mktemp -d /tmp/etcfs-file-cycles.XXXXXX)
IMG=/var/tmp/etcfs-file-cycles-$$.img
LOCAL=/var/tmp/etcfs-file-cycles-local-$$
MNT=$WORK/mnt
PORT=${FILE_CYCLES_ETCD_PORT:-27719}
EP=http://127.0.0.1:$PORT
pids=()
cleanup() {
	unmount_started "$MNT"
	stop_started
	rm -rf "$WORK" "$IMG" "$LOCAL"
}
trap cleanup EXIT

start_etcd file-cycles "$WORK" "$PORT"
mkdir -p "$LOCAL"
read -r LA LB <<<"$LABELS"
# run SIDE ROUND DIR: the jobs in DIR, "side round job p50 p90" lines into results.
run() {
	python3 "$ROOT/benches/file_cycles.py" "$3" "$OPS" | sed "s/^/$1 $2 /" >>"$WORK/results"
}
n=0
for round in $(seq "$ROUNDS"); do
	order=("$LA:$A" "$LB:$B")
	[ $((round % 2)) = 1 ] || order=("$LB:$B" "$LA:$A")
	for side in "${order[@]}"; do
		label=${side%%:*} bin=${side#*:}
		n=$((n + 1))
		rm -f "$IMG"
		truncate -s 1G "$IMG"
		"$bin" mkfs --etcd "$EP" --device "$IMG" --prefix "fc$n" >/dev/null
		mount_etcfs "$bin" "$EP" "$IMG" "fc$n" "$MNT" "$WORK/daemon-$n.log"
		run "$label" "$round" "$MNT"
		unmount_started "$MNT"
	done
	run local "$round" "$LOCAL"
done
python3 - "$WORK/results" "$LA" "$LB" "$ROUNDS" "$OPS" <<'PY'
import statistics, sys
from collections import defaultdict
path, a, b, rounds, ops = sys.argv[1:]
v = defaultdict(list)
for line in open(path):
    side, _, job, p50, p90 = line.split()
    v[side, job, "p50"].append(float(p50))
    v[side, job, "p90"].append(float(p90))
med = lambda k: statistics.median(v[k])
print(f"Short-lived files and attribute changes, {ops} per job, {rounds} rounds; µs, medians of the rounds")
print()
print(f"| job | local p50 | {a} p50 | {b} p50 | {a} p90 | {b} p90 | p50 {b} / {a} |")
print("|---|---|---|---|---|---|---|")
for job in ["tmpfile", "unlink", "fsyncdir", "chmod", "utime", "chown-same"]:
    pa, pb = med((a, job, "p50")), med((b, job, "p50"))
    print(f"| {job} | {med(('local', job, 'p50')):.1f} | {pa:.0f} | {pb:.0f} | "
          f"{med((a, job, 'p90')):.0f} | {med((b, job, 'p90')):.0f} | {pb / pa:.2f}x |")
PY
