#!/usr/bin/env bash
# Open rates of two etcfs binaries side by side: how much an open costs now that it reads
# its file's extent map with its attributes (one read-only etcd transaction), against a
# binary that read the map at the file's first READ.
#
# Each round mounts each binary in turn (order alternating between rounds) on a fresh
# prefix of one private etcd (one member, loopback) and one sparse device image, writes
# FILES files of 64 KiB, drops the kernel's caches of the mount by remounting, and runs:
#   one:     open(O_RDONLY) + close of one file, repeated for SECS seconds
#   distinct: open + pread of 4 KiB + close of each of the FILES files, once each (every
#            open a cold one: the node has not opened the file since mounting)
# Prints per binary the median over the rounds of each rate, and of the etcd range
# operations and requests per distinct open+read (etcd's own counters), and B / A.
#
# Needs root, /dev/fuse and etcd (scripts/deps.sh installs them).
#
# usage: benches/open_close.sh --a PATH --b PATH [--rounds N] [--files N] [--secs S]
#                              [--labels "before after"]
set -euo pipefail

ROUNDS=3
FILES=500
SECS=3
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
	--files) FILES=$2; shift 2 ;;
	--secs) SECS=$2; shift 2 ;;
	--labels) LABELS=$2; shift 2 ;;
	-h | --help) sed -n '2,18p' "$0"; exit 0 ;;
	*) echo "open_close.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$A" ] && [ -x "$B" ] || { echo "open_close.sh: --a and --b must name etcfs binaries" >&2; exit 2; }

WORK=$(mktemp -d /tmp/etcfs-open-close.XXXXXX)
IMG=/var/tmp/etcfs-open-close-$$.img
MNT=$WORK/mnt
PORT=${OPEN_CLOSE_ETCD_PORT:-27479}
EP=http://127.0.0.1:$PORT
pids=()
unmount() { unmount_started "$MNT"; }
cleanup() {
	unmount
	stop_started
	rm -rf "$WORK" "$IMG"
}
trap cleanup EXIT

start_etcd open-close "$WORK" "$PORT"
truncate -s 4G "$IMG"
# "RANGE_OPS RPCS": range operations (a read-only transaction's count one each) and the
# unary requests (round trips) etcd has served so far.
etcd_counts() {
	curl -s "$EP/metrics" | awk '
		/^etcd_mvcc_range_total / {r = $2}
		/^grpc_server_handled_total/ && /grpc_type="unary"/ {u += $2}
		END {printf "%d %d\n", r, u}'
}

for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then order=(a b); else order=(b a); fi
	for side in "${order[@]}"; do
		if [ "$side" = a ]; then bin=$A; else bin=$B; fi
		prefix=oc-$r-$side
		"$bin" mkfs --etcd "$EP" --device "$IMG" --prefix "$prefix" --force >/dev/null
		mount_etcfs "$bin" "$EP" "$IMG" "$prefix" "$MNT" "$WORK/daemon.log"
		python3 - "$MNT" "$FILES" <<'EOF'
import os, sys
mnt, n = sys.argv[1], int(sys.argv[2])
data = os.urandom(64 << 10)
for i in range(n):
    with open(os.path.join(mnt, f"f{i}"), "wb") as f:
        f.write(data)
EOF
		# A new daemon and a new kernel mount: nothing of the files is cached.
		unmount
		mount_etcfs "$bin" "$EP" "$IMG" "$prefix" "$MNT" "$WORK/daemon.log"
		read -r r0 u0 < <(etcd_counts)
		distinct=$(python3 - "$MNT" "$FILES" <<'EOF'
import os, sys, time
mnt, n = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
for i in range(n):
    fd = os.open(os.path.join(mnt, f"f{i}"), os.O_RDONLY)
    os.pread(fd, 4096, 0)
    os.close(fd)
print(f"{n / (time.perf_counter() - t0):.0f}")
EOF
)
		read -r r1 u1 < <(etcd_counts)
		one=$(python3 - "$MNT/f0" "$SECS" <<'EOF'
import os, sys, time
path, secs = sys.argv[1], float(sys.argv[2])
count, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < secs:
    os.close(os.open(path, os.O_RDONLY))
    count += 1
print(f"{count / (time.perf_counter() - t0):.0f}")
EOF
)
		unmount
		echo "[open_close.sh $(date +%H:%M:%S)] round $r $side: one $one/s, distinct $distinct/s, etcd ranges $((r1 - r0)), requests $((u1 - u0))" >&2
		echo "$side $r $one $distinct $((r1 - r0)) $((u1 - u0))" >>"$WORK/results"
	done
done

python3 - "$WORK/results" "$LABELS" "$FILES" "$ROUNDS" <<'PY'
import statistics, sys
la, lb = sys.argv[2].split()
files, rounds = int(sys.argv[3]), sys.argv[4]
R = {"a": [], "b": []}
for line in open(sys.argv[1]):
    side, _, *v = line.split()
    R[side].append([float(x) for x in v])
def num(x, d=0):
    return f"{x:,.{d}f}".replace(",", " ")
def med(side, k, per=1):
    return statistics.median(v[k] for v in R[side]) / per
def cell(side, k, per=1, d=0):
    v = sorted(x[k] / per for x in R[side])
    return f"{num(med(side, k, per), d)} ({num(v[0], d)}–{num(v[-1], d)})"
print(f"open rates, {rounds} rounds, medians (range)")
print()
print(f"| measure | {la} | {lb} | {lb} / {la} |")
print("|---|---|---|---|")
rows = [
    ("open+close of one file, per s", 0, 1, 0),
    (f"open+read 4 KiB+close of {files} distinct files, per s", 1, 1, 0),
    ("etcd range operations per distinct open+read", 2, files, 2),
    ("etcd requests (round trips) per distinct open+read", 3, files, 2),
]
for label, k, per, d in rows:
    ratio = med("b", k, per) / med("a", k, per)
    print(f"| {label} | {cell('a', k, per, d)} | {cell('b', k, per, d)} | {ratio:.2f}x |")
PY
