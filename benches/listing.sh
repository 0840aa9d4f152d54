#!/usr/bin/env bash
# Big directories (issue 17): `ls -f`, `ls -l` and `find -ls` of directories of N empty
# files on etcfs and on ext4, side by side in one run, cold and warm; medians of --rounds.
#
#   benches/listing.sh [--sizes "5000 20000 100000"] [--rounds 3] [--etcfs PATH] [--no-compact]
#
# etcfs: a private one-member etcd and a 1 GiB device image, one node. ext4: a 2 GiB
# image on the same disk (262,144 inodes), loop-mounted. "cold": the page, dentry and inode caches
# dropped and (etcfs) the daemon restarted at the same mountpoint, so its own caches are
# empty too; "warm": the same command again at once. Also printed: the FUSE requests one
# warm `ls -l` sends to the daemon, by operation (from `etcfs stats --json`).
# LISTING_STATS=1: after each timed etcfs run, its requests and nonzero counters (stderr).
# etcd's history is compacted before each cold etcfs run (lib.sh's compact_etcd: the
# restarts would otherwise pile up tombstones no compacted etcd keeps); --no-compact
# leaves it, to see what an uncompacted etcd costs.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/lib.sh

sizes="5000 20000 100000" rounds=3 etcfs=target/release/etcfs compact=1
while [ $# -gt 0 ]; do
	case "$1" in
	--sizes) sizes="$2"; shift 2 ;;
	--rounds) rounds="$2"; shift 2 ;;
	--etcfs) etcfs="$2"; shift 2 ;;
	--no-compact) compact=0; shift ;;
	*) echo "usage: $0 [--sizes \"N...\"] [--rounds R] [--etcfs PATH] [--no-compact]" >&2; exit 2 ;;
	esac
done
[ -x "$etcfs" ] || cargo build --release -p etcfs
[ "$(id -u)" = 0 ] || { echo "$0: needs root (FUSE and loop mounts)" >&2; exit 2; }

work=$(mktemp -d /var/tmp/listing-bench.XXXXXX)
port=$((32000 + RANDOM % 10000))
ep=http://127.0.0.1:$port
ETCD_PID="" pids=() loopdev=""
mnt=$work/etcfs ext=$work/ext4
cleanup() {
	local rc=$?
	umount "$mnt" 2>/dev/null || true
	stop_started
	umount "$ext" 2>/dev/null || true
	[ -z "$loopdev" ] || losetup -d "$loopdev" 2>/dev/null || true
	# A failed run keeps the daemon's log (a listing's EIO at 100,000 entries went
	# unexplained once because it was deleted with the rest).
	if [ "$rc" != 0 ] && [ -f "$work/etcfs.log" ]; then
		cp "$work/etcfs.log" "/var/tmp/listing-bench-failed-$$.log" &&
			echo "listing.sh: failed; the daemon's log is /var/tmp/listing-bench-failed-$$.log" >&2
	fi
	rm -rf "$work"
}
trap cleanup EXIT

start_etcd listing "$work" "$port"
truncate -s 1G "$work/dev.img"
"$etcfs" mkfs --etcd "$ep" --device "$work/dev.img" --prefix lb >/dev/null
mount_node() { mount_etcfs "$etcfs" "$ep" "$work/dev.img" lb "$mnt" "$work/etcfs.log"; }
# Stops the daemon started last (by its pid) after unmounting.
unmount_node() {
	umount "$mnt"
	local p=${pids[-1]}
	wait "$p" 2>/dev/null || true
	unset 'pids[-1]'
}
mount_node
truncate -s 2G "$work/ext4.img"
mkfs.ext4 -q -F -N 262144 "$work/ext4.img"
loopdev=$(losetup --find --show "$work/ext4.img")
mkdir -p "$ext"
mount "$loopdev" "$ext"

die() { echo "listing.sh: $*" >&2; exit 1; }
# seconds CMD...: wall time of one run, output discarded.
seconds() {
	local t0
	t0=$(date +%s.%N)
	"$@" >/dev/null
	echo "$(date +%s.%N) - $t0" | bc
}
# list CMD DIR: `find` is `find DIR -ls` (stat and ACL/label of every entry, as ls -l).
list() {
	case "$1" in
	find) find "$2" -ls ;;
	*) $1 "$2" ;;
	esac
}
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# run_stats LABEL: with LISTING_STATS set, the requests and nonzero counters of the run
# just timed (to stderr).
run_stats() {
	"$etcfs" stats --json "$mnt" | python3 -c '
import json, sys
s = json.load(sys.stdin)
ops = s.get("ops") or s.get("operations") or []
if isinstance(ops, dict):
    ops = [dict(o, op=k) if isinstance(o, dict) else {"op": k, "count": o} for k, o in ops.items()]
print("  " + sys.argv[1] + ": " + " ".join("%s=%s" % (o.get("op") or o.get("name"), o["count"]) for o in ops if o.get("count")))
print("    " + " ".join("%s=%s" % kv for kv in s.get("counters", {}).items() if kv[1]))
' "$1" >&2
}
cold_etcfs() {
	unmount_node
	[ "$compact" = 0 ] || compact_etcd "$ep"
	mount_node
	drop
}
cold_ext4() { umount "$ext"; mount "$loopdev" "$ext"; drop; }

for n in $sizes; do
	for root in "$mnt" "$ext"; do
		mkdir "$root/d$n"
		# Eight creators at once: the pipeline groups their commits.
		seq -f "file-%07g" "$n" | (cd "$root/d$n" && xargs -P 16 -n 250 touch) || die "creating $n files in $root failed"
	done
done

printf '%-8s %-10s %-6s %10s %10s %8s\n' entries command cache etcfs_s ext4_s ratio
for n in $sizes; do
	for cmd in "ls -f" "ls -l" "find"; do
		for cache in cold warm; do
			e="" x=""
			for _ in $(seq "$rounds"); do
				cold_etcfs
				[ "$cache" = cold ] || list "$cmd" "$mnt/d$n" >/dev/null
				[ -z "${LISTING_STATS:-}" ] || "$etcfs" stats --reset "$mnt" >/dev/null
				e="$e $(seconds list "$cmd" "$mnt/d$n")"
				[ -z "${LISTING_STATS:-}" ] || run_stats "$n $cmd $cache"
				cold_ext4
				[ "$cache" = cold ] || list "$cmd" "$ext/d$n" >/dev/null
				x="$x $(seconds list "$cmd" "$ext/d$n")"
			done
			em=$(echo "$e" | tr ' ' '\n' | grep . | median)
			xm=$(echo "$x" | tr ' ' '\n' | grep . | median)
			printf '%-8s %-10s %-6s %10.3f %10.3f %7.1fx\n' "$n" "$cmd" "$cache" "$em" "$xm" \
				"$(echo "$em / $xm" | bc -l)"
		done
	done
done

# What one warm `ls -l` of the largest directory asks the daemon.
n=${sizes##* }
ls -l "$mnt/d$n" >/dev/null
"$etcfs" stats --reset "$mnt" >/dev/null
ls -l "$mnt/d$n" >/dev/null
echo
echo "FUSE requests of one warm ls -l of $n entries (etcfs stats --json):"
"$etcfs" stats --json "$mnt" | python3 -c '
import json, sys
s = json.load(sys.stdin)
ops = s.get("ops") or s.get("operations") or []
if isinstance(ops, dict):
    ops = [dict(o, op=k) if isinstance(o, dict) else {"op": k, "count": o} for k, o in ops.items()]
for o in ops:
    name = o.get("op") or o.get("name")
    if o.get("count"):
        print("  %-14s %s" % (name, o["count"]))
c = s.get("counters", {})
print("  etcd read txns", c.get("etcd_read_txns"), "etcd txns committed", c.get("etcd_txns_committed"))
'
