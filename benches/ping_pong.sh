#!/usr/bin/env bash
# Cluster fcntl locks (issue 13): Samba's ping_pong shape (benches/ping_pong.c). Processes
# share a file of processes + 1 bytes; each holds one byte's write lock, takes the next with
# F_SETLKW and lets its previous one go, so every lock is a hand-off to another process.
#
#   2 nodes:   one process on each of two daemons (two nodes) on one image and one etcd
#   1 node:    the same two processes on one daemon (hand-offs inside one node, still
#              through etcd: etcfs keeps no node-local lock state)
#   1 process: one process alone on 2 bytes (no waiting: the uncontended lock+unlock rate)
#
# each on etcfs, on JuiceFS (two `juicefs mount` clients on the same etcd) when a juicefs
# binary is found (PATH, or $JFS_VENV/bin/juicefs as benches/compare/run.sh installs it;
# skipped with a message otherwise), and on the local filesystem of /var/tmp (kernel locks,
# one node only). Every figure is locks per second per process, the median of --runs runs
# of --secs seconds each (after one second of warm-up).
#
# Runs a private one-member etcd on loopback (port $PP_ETCD_PORT, default 29379) and a
# sparse image in /var/tmp, both removed on exit with every mount and process it started.
# Needs root, /dev/fuse, etcd, cc.
#
# usage: benches/ping_pong.sh [--runs R] [--secs S] [--etcfs PATH]
set -euo pipefail

RUNS=3
SECS=10
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
ETCFS=${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs
JFS_VENV=${JFS_VENV:-/var/tmp/etcfs-compare-venv}
while [ $# -gt 0 ]; do
	case "$1" in
	--runs) RUNS=$2; shift 2 ;;
	--secs) SECS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n '2,21p' "$0"; exit 0 ;;
	*) echo "ping_pong.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
die() { echo "ping_pong.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (FUSE mounts)"
[ -x "$ETCFS" ] || die "no etcfs binary at $ETCFS (cargo build --release)"

JFS=$(command -v juicefs || true)
[ -n "$JFS" ] || { [ -x "$JFS_VENV/bin/juicefs" ] && JFS=$JFS_VENV/bin/juicefs; } || true

WORK=$(mktemp -d /tmp/etcfs-pingpong.XXXXXX)
IMG=/var/tmp/etcfs-pingpong-$$.img
LOCALDIR=$(mktemp -d /var/tmp/etcfs-pingpong-local.XXXXXX)
PORT=${PP_ETCD_PORT:-29379}
EP=http://127.0.0.1:$PORT
MNTS=()
pids=()
cleanup() {
	for m in "${MNTS[@]}"; do
		if mountpoint -q "$m" 2>/dev/null; then umount "$m" 2>/dev/null || umount -l "$m" || true; fi
	done
	stop_started
	rm -rf "$WORK" "$IMG" "$LOCALDIR"
}
trap cleanup EXIT

cc -O2 -Wall -o "$WORK/ping_pong" "$ROOT/benches/ping_pong.c"
PP=$WORK/ping_pong

start_etcd pingpong "$WORK" "$PORT"
pids+=("$ETCD_PID")

wait_mounted() { # MNT
	for _ in $(seq 200); do mountpoint -q "$1" && return 0; sleep 0.1; done
	die "$1 did not mount within 20 s"
}

truncate -s 1G "$IMG"
"$ETCFS" mkfs --etcd "$EP" --device "$IMG" --prefix pingpong >/dev/null
for n in a b; do
	MNTS+=("$WORK/etcfs-$n")
	mount_etcfs "$ETCFS" "$EP" "$IMG" pingpong "$WORK/etcfs-$n" "$WORK/etcfs-$n.log" ||
		die "etcfs did not mount"
done

SYSTEMS=(etcfs)
if [ -n "$JFS" ]; then
	"$JFS" format --storage file --bucket "$WORK/jfs-bucket/" --trash-days 0 \
		"etcd://127.0.0.1:$PORT/pingpongjfs" pingpongjfs >"$WORK/jfs-format.log" 2>&1 ||
		{ cat "$WORK/jfs-format.log" >&2; die "juicefs format failed"; }
	for n in a b; do
		mkdir -p "$WORK/juicefs-$n"
		"$JFS" mount --no-usage-report --cache-dir "$WORK/jfs-cache-$n" \
			"etcd://127.0.0.1:$PORT/pingpongjfs" "$WORK/juicefs-$n" >"$WORK/juicefs-$n.log" 2>&1 &
		pids+=($!)
		MNTS+=("$WORK/juicefs-$n")
		wait_mounted "$WORK/juicefs-$n"
	done
	SYSTEMS+=(juicefs)
else
	echo "JuiceFS: no juicefs binary (PATH or $JFS_VENV/bin/juicefs); skipping it." \
		"benches/compare/run.sh installs one." >&2
fi

# Makes the file on node a and waits until node b sees it.
shared() { # SYS NAME
	: >"$WORK/$1-a/$2"
	for _ in $(seq 200); do [ -e "$WORK/$1-b/$2" ] && return 0; sleep 0.05; done
	die "$1: $2 never showed on node b"
}

# One run: prints the per-process rates, space-separated. Files are new every run.
run() { # SYS SHAPE N
	local sys=$1 shape=$2 n=$3 a b f=pp-$2-$3
	case $sys in
	local) a=$LOCALDIR b=$LOCALDIR; : >"$a/$f" ;;
	*) a=$WORK/$sys-a b=$WORK/$sys-b; shared "$sys" "$f" ;;
	esac
	case $shape in
	2nodes) "$PP" "$a/$f" 3 "$SECS" >"$WORK/o1" & local p1=$!
		"$PP" "$b/$f" 3 "$SECS" >"$WORK/o2" & local p2=$!
		wait "$p1" "$p2"
		echo "$(cat "$WORK/o1") $(cat "$WORK/o2")" ;;
	1node) "$PP" "$a/$f" 3 "$SECS" >"$WORK/o1" & local p1=$!
		"$PP" "$a/$f" 3 "$SECS" >"$WORK/o2" & local p2=$!
		wait "$p1" "$p2"
		echo "$(cat "$WORK/o1") $(cat "$WORK/o2")" ;;
	1proc) "$PP" "$a/$f" 2 "$SECS" ;;
	esac
}

median() { sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : int((v[NR/2]+v[NR/2+1])/2)}'; }

echo "| system | shape | locks/s per process (median of $RUNS × ${SECS} s) | every process of every run |"
echo "|---|---|---|---|"
for sys in "${SYSTEMS[@]}" local; do
	for shape in 2nodes 1node 1proc; do
		[ "$sys" = local ] && [ "$shape" = 2nodes ] && continue
		all=""
		for r in $(seq "$RUNS"); do all="$all $(run "$sys" "$shape" "$r")"; done
		med=$(echo "$all" | tr ' ' '\n' | grep . | median)
		echo "| $sys | $shape | $med | $(echo "$all" | xargs) |"
	done
done
echo
echo "($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), one etcd member on loopback)"
