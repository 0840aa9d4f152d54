#!/usr/bin/env bash
# A database's transactions through the whole stack: SQLite (python3's sqlite3,
# synchronous=FULL) inserting one row per transaction, on two etcfs binaries side by side
# and on a directory of the local disk beside the device image as the reference.
#
# Jobs, each TXNS transactions per run:
#   wal:          one process, journal_mode=WAL (fcntl locks on the database and its -shm
#                 file, appends and fsyncs of the -wal file)
#   wal-reused:   the same after 1,200 transactions not timed: the WAL is then written
#                 again from its start in place (SQLite's checkpoint), as a long-running
#                 database's is, where "wal" mostly appends to a new WAL
#   delete:       one process, journal_mode=DELETE (a rollback journal created, written,
#                 fsynced and deleted per transaction, fcntl locks on the database)
#   delete-2node: two processes at once on one database in DELETE mode, TXNS/2 each; on
#                 etcfs each on its own node (two daemons on the same device and etcd), so
#                 every transaction takes the database's locks from the other node and
#                 reads what it wrote. The rows are counted afterwards: all TXNS must be
#                 there. Locally the two processes share the disk.
# Each round mounts each binary in turn on a fresh prefix of one private etcd (order
# alternating between rounds). Prints the median transactions per second over the rounds
# (range) of each side, and B / A and each / local.
#
# Needs root, /dev/fuse, python3 and etcd (scripts/deps.sh installs them).
#
# usage: benches/sqlite.sh --a PATH --b PATH [--rounds N] [--txns N] [--labels "A B"]
set -euo pipefail

ROUNDS=3
TXNS=1000
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
	--txns) TXNS=$2; shift 2 ;;
	--labels) LABELS=$2; shift 2 ;;
	-h | --help) sed -n '2,25p' "$0"; exit 0 ;;
	*) echo "sqlite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$A" ] && [ -x "$B" ] || { echo "sqlite.sh: --a and --b must name etcfs binaries" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "sqlite.sh: needs root (FUSE mounts)" >&2; exit 2; }

WORK=$(mktemp -d /tmp/etcfs-sqlite.XXXXXX)
IMG=/var/tmp/etcfs-sqlite-$$.img
LOCAL=/var/tmp/etcfs-sqlite-local-$$
PORT=${SQLITE_ETCD_PORT:-27589}
EP=http://127.0.0.1:$PORT
TX="python3 $ROOT/benches/sqlite_txns.py"
pids=()
cleanup() {
	unmount_started "$WORK/n1" "$WORK/n2"
	stop_started
	rm -rf "$WORK" "$IMG" "$LOCAL"
}
trap cleanup EXIT

start_etcd sqlite "$WORK" "$PORT"
truncate -s 4G "$IMG"
mkdir -p "$LOCAL/a" "$LOCAL/b"

# one SIDE ROUND JOB DIR1 DIR2: one run of JOB, its rate into results.
one() {
	local side=$1 round=$2 job=$3 d1=$4 d2=$5 rate
	rm -f "$d1"/db*
	case "$job" in
	wal | delete)
		rate=$($TX "$d1/db" "$job" "$TXNS" | awk '{print $3}') ;;
	wal-reused)
		rate=$($TX "$d1/db" wal "$TXNS" --warm 1200 | awk '{print $3}') ;;
	delete-2node)
		$TX "$d1/db" delete 0 --init
		local t0 t1 half=$((TXNS / 2))
		t0=$(date +%s.%N)
		$TX "$d1/db" delete "$half" --worker 1 >"$WORK/w1" &
		local w1=$!
		$TX "$d2/db" delete "$half" --worker 2 >"$WORK/w2" || { wait "$w1"; exit 1; }
		wait "$w1"
		t1=$(date +%s.%N)
		local rows
		rows=$(python3 -c 'import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute("select count(*) from t").fetchone()[0])' "$d2/db")
		[ "$rows" = $((2 * half)) ] || { echo "sqlite.sh: $side: $rows rows after 2 x $half transactions" >&2; exit 1; }
		rate=$(echo "$((2 * half)) / ($t1 - $t0)" | bc -l) ;;
	esac
	printf '%s %s %s %.1f\n' "$side" "$round" "$job" "$rate" >>"$WORK/results"
	printf '[sqlite.sh %s] %s round %s %s: %.1f txn/s\n' "$(date +%H:%M:%S)" "$side" "$round" "$job" "$rate" >&2
}

JOBS="wal wal-reused delete delete-2node"
for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then order=(a local b); else order=(b local a); fi
	for side in "${order[@]}"; do
		if [ "$side" = local ]; then
			for job in $JOBS; do one local "$r" "$job" "$LOCAL/a" "$LOCAL/a"; done
			continue
		fi
		if [ "$side" = a ]; then bin=$A; else bin=$B; fi
		prefix=sq-$r-$side
		"$bin" mkfs --etcd "$EP" --device "$IMG" --prefix "$prefix" --force >/dev/null
		mount_etcfs "$bin" "$EP" "$IMG" "$prefix" "$WORK/n1" "$WORK/n1.log"
		mount_etcfs "$bin" "$EP" "$IMG" "$prefix" "$WORK/n2" "$WORK/n2.log"
		for job in $JOBS; do one "$side" "$r" "$job" "$WORK/n1" "$WORK/n2"; done
		unmount_started "$WORK/n1" "$WORK/n2"
	done
done

python3 - "$WORK/results" "$LABELS" "$ROUNDS" "$TXNS" <<'PY'
import statistics, sys
la, lb = sys.argv[2].split()
R = {}
for line in open(sys.argv[1]):
    side, _, job, v = line.split()
    R.setdefault((side, job), []).append(float(v))
print(f"SQLite, synchronous=FULL, one row per transaction, {sys.argv[4]} transactions per run, "
      f"{sys.argv[3]} rounds; transactions/s, medians (range)")
print()
print(f"| job | local disk | etcfs {la} | etcfs {lb} | {lb} / {la} | {la} / local | {lb} / local |")
print("|---|---|---|---|---|---|---|")
cell = lambda s, j: f"{statistics.median(R[(s, j)]):,.0f} ({min(R[(s, j)]):,.0f}–{max(R[(s, j)]):,.0f})"
med = lambda s, j: statistics.median(R[(s, j)])
for job in ("wal", "wal-reused", "delete", "delete-2node"):
    print(f"| {job} | {cell('local', job)} | {cell('a', job)} | {cell('b', job)} "
          f"| {med('b', job) / med('a', job):.2f}x | {med('a', job) / med('local', job):.3f}x "
          f"| {med('b', job) / med('local', job):.3f}x |")
PY
