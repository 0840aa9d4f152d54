#!/usr/bin/env bash
# Reads of a fragmented file (issue 12: a file of 30,000 extents took 12-63 ms per 4 KiB
# READ, every READ reading the extent map from etcd, against 0.13 ms for a contiguous one).
#
# Mounts etcfs (private one-member etcd on loopback, sparse device image in /var/tmp), lays
# out two files of the same data: "frag" with EXTENTS one-block extents (every other block
# written, O_DIRECT, so each write is its own extent) and "contig" written in one pass.
# Then fio, 4 KiB random reads, direct=1, io_uring, queue depth 1, FIO_SECS each, on both
# back to back, RUNS times; prints the median p50 latency and IOPS of each, and the etcd
# range requests the fragmented runs cost (from etcd's own metrics).
#
# Needs root, /dev/fuse, etcd and fio (scripts/deps.sh installs them).
#
# usage: benches/fragmented.sh [--extents N] [--runs R] [--fio-secs S] [--etcfs PATH]
set -euo pipefail

EXTENTS=30000
RUNS=3
FIO_SECS=5
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
ETCFS=${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--extents) EXTENTS=$2; shift 2 ;;
	--runs) RUNS=$2; shift 2 ;;
	--fio-secs) FIO_SECS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n '2,14p' "$0"; exit 0 ;;
	*) echo "fragmented.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$ETCFS" ] || { echo "fragmented.sh: no etcfs binary at $ETCFS (cargo build --release)" >&2; exit 1; }

WORK=$(mktemp -d /tmp/etcfs-frag.XXXXXX)
IMG=/var/tmp/etcfs-frag-$$.img
MNT=$WORK/mnt
PORT=${FRAG_ETCD_PORT:-27379}
EP=http://127.0.0.1:$PORT
etcd_pid=
daemon_pid=
cleanup() {
	if mountpoint -q "$MNT" 2>/dev/null; then umount "$MNT" || umount -l "$MNT" || true; fi
	[ -n "$daemon_pid" ] && { kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; }
	[ -n "$etcd_pid" ] && { kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; }
	rm -rf "$WORK" "$IMG"
}
trap cleanup EXIT

start_etcd frag "$WORK" "$PORT"
etcd_pid=$ETCD_PID

truncate -s 2G "$IMG"
"$ETCFS" mkfs --etcd "$EP" --device "$IMG" --prefix frag >/dev/null
mkdir -p "$MNT"
"$ETCFS" mount --foreground --etcd "$EP" --device "$IMG" --prefix frag "$MNT" >"$WORK/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do mountpoint -q "$MNT" && break; sleep 0.1; done
mountpoint -q "$MNT" || { cat "$WORK/daemon.log"; exit 1; }

echo "laying out $EXTENTS one-block extents..." >&2
python3 - "$MNT" "$EXTENTS" <<'EOF'
import mmap, os, sys
mnt, n = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, 4096)
buf.write(os.urandom(4096))
for name, step in (("frag", 2), ("contig", 1)):
    fd = os.open(os.path.join(mnt, name), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    if step == 1:
        big = mmap.mmap(-1, 1 << 20)
        big.write(os.urandom(1 << 20))
        for off in range(0, n * 4096 * 2, 1 << 20):
            os.pwrite(fd, big, off)
    else:
        for i in range(n):
            os.pwrite(fd, buf, i * step * 4096)
    os.fsync(fd)
    os.close(fd)
EOF

ranges() {
	curl -s "$EP/metrics" | awk '/^etcd_mvcc_range_total /{print $2}' | head -1
}
fio_p50() {
	# $1 file -> "p50_us iops"
	fio --name=r --filename="$1" --rw=randread --bs=4k --direct=1 --ioengine=io_uring \
		--iodepth=1 --time_based --runtime="$FIO_SECS" --randseed=42 --output-format=json \
		--size="$((EXTENTS * 2 * 4096 - 4096))" 2>/dev/null |
		python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]; print(j["clat_ns"]["percentile"]["50.000000"]/1000, int(j["iops"]))'
}
declare -a F_P50 C_P50 F_IOPS C_IOPS F_RANGES
for r in $(seq "$RUNS"); do
	for side in frag contig; do
		before=$(ranges)
		read -r p50 iops < <(fio_p50 "$MNT/$side")
		after=$(ranges)
		if [ "$side" = frag ]; then
			F_P50+=("$p50"); F_IOPS+=("$iops"); F_RANGES+=("$(python3 -c "print(int(float('$after') - float('$before')))")")
		else
			C_P50+=("$p50"); C_IOPS+=("$iops")
		fi
	done
done
med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo
echo "4 KiB random reads, QD 1, $RUNS runs of ${FIO_SECS} s ($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'))"
echo
echo "| file | extents | p50 µs (median) | IOPS (median) | etcd ranges per run |"
echo "|---|---|---|---|---|"
echo "| contig | few | $(med "${C_P50[@]}") | $(med "${C_IOPS[@]}") | |"
echo "| frag | $EXTENTS | $(med "${F_P50[@]}") | $(med "${F_IOPS[@]}") | $(med "${F_RANGES[@]}") |"
