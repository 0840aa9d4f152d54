#!/usr/bin/env bash
# What one cold listing costs etcd (issue 17): a directory of N empty files, the daemon
# restarted at the same mountpoint and the kernel's caches dropped before each run, then
# one timed command. Per run: wall time, CPU seconds of etcd and of the daemon (from
# /proc), and etcd's own counters for the run (from its /metrics: range operations, puts,
# transactions, bytes its Go runtime allocated). Medians of the runs are printed last.
#
#   benches/listing_cost.sh [--files N] [--rounds R] [--cmd "ls -l"] [--etcfs PATH] [--stats]
#                           [--no-compact]
#
# etcd's history is compacted before each run (lib.sh's compact_etcd), as a periodic
# compaction keeps it; --no-compact leaves the restarts' tombstones in.
#
# --stats: after each run, also the FUSE requests the daemon served and its nonzero
# counters (`etcfs stats --json`).
#
# A private one-member etcd and a 1 GiB device image, one node. The etcfs binary may be a
# wrapper script (to add mount options or environment); it must exec the daemon, whose
# pid is then the one measured.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/lib.sh

files=20000 rounds=3 cmd="ls -l" etcfs=target/release/etcfs stats=0 compact=1
while [ $# -gt 0 ]; do
	case "$1" in
	--files) files="$2"; shift 2 ;;
	--rounds) rounds="$2"; shift 2 ;;
	--cmd) cmd="$2"; shift 2 ;;
	--etcfs) etcfs="$2"; shift 2 ;;
	--stats) stats=1; shift ;;
	--no-compact) compact=0; shift ;;
	-h | --help) sed -n '2,20p' "$0"; exit 0 ;;
	*) echo "listing_cost.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$etcfs" ] || cargo build --release -p etcfs
[ "$(id -u)" = 0 ] || { echo "$0: needs root (FUSE mounts, drop_caches)" >&2; exit 2; }
command -v curl >/dev/null || { echo "$0: needs curl (etcd's /metrics)" >&2; exit 2; }

work=$(mktemp -d /var/tmp/listing-cost.XXXXXX)
port=$((42000 + RANDOM % 5000))
ep=http://127.0.0.1:$port
ETCD_PID="" pids=()
mnt=$work/etcfs
cleanup() {
	umount "$mnt" 2>/dev/null || true
	stop_started
	rm -rf "$work"
}
trap cleanup EXIT

start_etcd listing-cost "$work" "$port"
truncate -s 1G "$work/dev.img"
"$etcfs" mkfs --etcd "$ep" --device "$work/dev.img" --prefix lc >/dev/null
mount_node() { mount_etcfs "$etcfs" "$ep" "$work/dev.img" lc "$mnt" "$work/etcfs.log"; }
mount_node
mkdir "$mnt/d"
echo "[listing_cost.sh $(date +%H:%M:%S)] creating $files files" >&2
seq -f "file-%07g" "$files" | (cd "$mnt/d" && xargs -P 16 -n 250 touch)

hz=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# counters FILE: the etcd counters this script reports, one "name value" per line.
counters() {
	awk '/^etcd_mvcc_range_total |^etcd_mvcc_put_total |^etcd_mvcc_txn_total |^go_memstats_alloc_bytes_total /{print $1, $2}' "$1"
}
# delta NAME: how much etcd's counter NAME grew during the run.
delta() {
	local k=$1
	# %.0f: mawk's %d stops at 2^31, and etcd prints large counters as 1.2e+09.
	echo $(($(awk -v k="$k" '$1 == k {printf "%.0f", $2}' "$work/m1") - $(awk -v k="$k" '$1 == k {printf "%.0f", $2}' "$work/m0")))
}
printf '%-5s %8s %9s %11s %10s %8s %6s %10s\n' run wall_s etcd_cpu daemon_cpu ranges puts txns alloc_MB
: >"$work/table"
for r in $(seq "$rounds"); do
	umount "$mnt"
	wait "${pids[-1]}" 2>/dev/null || true
	unset 'pids[-1]'
	[ "$compact" = 0 ] || compact_etcd "$ep"
	mount_node
	sync
	echo 3 >/proc/sys/vm/drop_caches
	daemon=${pids[-1]}
	curl -sf "$ep/metrics" | counters /dev/stdin >"$work/m0"
	e0=$(cpu "$ETCD_PID") d0=$(cpu "$daemon") t0=$(date +%s.%N)
	# shellcheck disable=SC2086 # the command is words on purpose
	$cmd "$mnt/d" >/dev/null
	t1=$(date +%s.%N) e1=$(cpu "$ETCD_PID") d1=$(cpu "$daemon")
	curl -sf "$ep/metrics" | counters /dev/stdin >"$work/m1"
	printf '%-5s %8.3f %9.2f %11.2f %10d %8d %6d %10d\n' "$r" "$(echo "$t1 - $t0" | bc)" \
		"$(echo "($e1 - $e0) / $hz" | bc -l)" "$(echo "($d1 - $d0) / $hz" | bc -l)" \
		"$(delta etcd_mvcc_range_total)" "$(delta etcd_mvcc_put_total)" \
		"$(delta etcd_mvcc_txn_total)" "$(($(delta go_memstats_alloc_bytes_total) / 1000000))" |
		tee -a "$work/table"
	[ "$stats" = 0 ] || "$etcfs" stats --json "$mnt" | python3 -c '
import json, sys
s = json.load(sys.stdin)
ops = s.get("ops") or s.get("operations") or []
if isinstance(ops, dict):
    ops = [dict(o, op=k) if isinstance(o, dict) else {"op": k, "count": o} for k, o in ops.items()]
print("  requests:", " ".join("%s=%s" % (o.get("op") or o.get("name"), o["count"]) for o in ops if o.get("count")))
print("  counters:", " ".join("%s=%s" % kv for kv in s.get("counters", {}).items() if kv[1]))
' >&2
done
printf '%-5s' median
for c in 2 3 4 5 6 7 8; do
	m=$(awk -v c="$c" '{print $c}' "$work/table" | median)
	if [ "$c" -le 4 ]; then printf ' %8.3f' "$m"; else printf ' %8.0f' "$m"; fi
done
echo
