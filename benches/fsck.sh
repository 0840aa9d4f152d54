#!/usr/bin/env bash
# `etcfs fsck` wall time and peak memory for populations of files (issue 15).
#
#   benches/fsck.sh [--files "100000 1000000"] [--runs 3] [--etcfs PATH]
#
# Each population is written straight into etcd by the hidden `etcfs bench-populate`
# (the meta crate's codec: inodes, 1000 files per directory, one 4 KiB extent per file,
# the free maps marking them used, the inode counter), since creating a million files
# through FUSE takes hours here; nothing is written to the device (fsck reads no file
# data). A private etcd (8 GiB quota, hourly auto-compaction) holds it. fsck runs
# unmounted, under /usr/bin/time -v; the table shows medians of --runs runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/lib.sh

files_list="100000 1000000" runs=3 etcfs=target/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--files) files_list="$2"; shift 2 ;;
	--runs) runs="$2"; shift 2 ;;
	--etcfs) etcfs="$2"; shift 2 ;;
	*) echo "usage: $0 [--files \"N...\"] [--runs R] [--etcfs PATH]" >&2; exit 2 ;;
	esac
done
[ -x "$etcfs" ] || cargo build --release -p etcfs

work=$(mktemp -d /var/tmp/fsck-bench.XXXXXX)
port=$((31000 + RANDOM % 10000))
ep=http://127.0.0.1:$port
ETCD_PID=""
cleanup() {
	if [ -n "$ETCD_PID" ]; then kill "$ETCD_PID" 2>/dev/null || true; wait "$ETCD_PID" 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT
etcd --name fsckbench --data-dir "$work/etcd" --listen-client-urls "$ep" \
	--advertise-client-urls "$ep" --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
	--initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
	--initial-cluster "fsckbench=http://127.0.0.1:$((port + 1))" \
	--quota-backend-bytes 8589934592 --auto-compaction-mode periodic \
	--auto-compaction-retention 1h >"$work/etcd.log" 2>&1 &
ETCD_PID=$!
for _ in $(seq 100); do etcdctl --endpoints "$ep" endpoint health >/dev/null 2>&1 && break; sleep 0.1; done


printf '%-10s %-10s %-12s %-14s %-14s %-6s\n' files keys populate_s fsck_wall_s peak_rss_MiB exit
for n in $files_list; do
	prefix=b$n
	img=$work/$n.img
	# One block per file, plus room: the data area must hold them.
	bytes=$(((n * 4096 * 5 / 4 + (512 << 20)) / 4096 * 4096))
	truncate -s "$bytes" "$img"
	"$etcfs" mkfs --etcd "$ep" --device "$img" --prefix "$prefix" >/dev/null
	t0=$(date +%s.%N)
	"$etcfs" bench-populate --etcd "$ep" --prefix "$prefix" --files "$n" 2>/dev/null
	pop=$(echo "$(date +%s.%N) - $t0" | bc)
	keys=$(etcdctl --endpoints "$ep" get --prefix "$prefix/" --keys-only --limit 1 -w json | sed 's/.*"count":\([0-9]*\).*/\1/')
	walls="" rsss="" code=0
	for _ in $(seq "$runs"); do
		set +e
		/usr/bin/time -v "$etcfs" fsck --etcd "$ep" --device "$img" --prefix "$prefix" --json \
			>"$work/out.json" 2>"$work/time.txt"
		code=$?
		set -e
		wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$work/time.txt" |
			awk -F: '{ if (NF == 3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
		rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$work/time.txt")
		walls="$walls $wall"
		rsss="$rsss $((rss / 1024))"
		[ "$code" = 0 ] || { echo "fsck exit $code:" >&2; head -c 2000 "$work/out.json" >&2; }
	done
	wall=$(echo "$walls" | tr ' ' '\n' | grep . | median)
	rss=$(echo "$rsss" | tr ' ' '\n' | grep . | median)
	printf '%-10s %-10s %-12.1f %-14s %-14s %-6s\n' "$n" "$keys" "$pop" "$wall" "$rss" "$code"
	rm -f "$img"
	etcdctl --endpoints "$ep" --command-timeout=600s del --prefix "$prefix/" >/dev/null
done
