#!/usr/bin/env bash
# Cross-node handoff (issue 13): how long a read takes when the other node has just
# written the file, i.e. the price of the cluster cache lock changing hands.
#
# Two daemons (nodes A and B) on one device image and one private etcd on loopback. Both
# keep one file open. Each round: A writes 4 KiB at offset 0 (pwrite), then B reads it
# (pread) and checks the bytes; then the same from B to A. Timed separately: the write
# (which takes the lock exclusively, so the reader before it must give its lock up) and
# the read after the other node's write (the writer writes back and downgrades, the reader
# drops its cache). For scale, one etcd commit (create-shaped transaction, the etcd_txn
# bench, serial) and the same write+read pair on one node are measured in the same run.
# Then three nodes append 64-byte records to one file with O_APPEND for APPEND_SECS
# seconds, one process each: records per second, and a check that none was lost.
# ETCFS_OPTS (e.g. "--lock-min-hold-ms 20") goes to every mount.
#
# Needs root, /dev/fuse, etcd (scripts/deps.sh installs it).
#
# usage: benches/handoff.sh [--rounds N] [--append-secs S] [--etcfs-opts "..."] [--etcfs PATH]
set -euo pipefail

ROUNDS=500
APPEND_SECS=5
ETCFS_OPTS=""
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
ETCFS=${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--rounds) ROUNDS=$2; shift 2 ;;
	--append-secs) APPEND_SECS=$2; shift 2 ;;
	--etcfs-opts) ETCFS_OPTS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n '2,19p' "$0"; exit 0 ;;
	*) echo "handoff.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$ETCFS" ] || { echo "handoff.sh: no etcfs binary at $ETCFS" >&2; exit 1; }

WORK=$(mktemp -d /tmp/etcfs-handoff.XXXXXX)
IMG=/var/tmp/etcfs-handoff-$$.img
PORT=${HANDOFF_ETCD_PORT:-29379}
EP=http://127.0.0.1:$PORT
pids=()
cleanup() {
	for m in "$WORK/a" "$WORK/b" "$WORK/c"; do
		if mountpoint -q "$m" 2>/dev/null; then umount "$m" || umount -l "$m" || true; fi
	done
	stop_started
	if [ -n "${HANDOFF_KEEP:-}" ]; then echo "kept $WORK" >&2; rm -f "$IMG"; else rm -rf "$WORK" "$IMG"; fi
}
trap cleanup EXIT

start_etcd handoff "$WORK" "$PORT"
pids+=("$ETCD_PID")
truncate -s 1G "$IMG"
"$ETCFS" mkfs --etcd "$EP" --device "$IMG" --prefix handoff >/dev/null
for n in a b c; do
	# shellcheck disable=SC2086 # ETCFS_OPTS is a list of options
	mount_etcfs "$ETCFS" "$EP" "$IMG" handoff "$WORK/$n" "$WORK/$n.log" $ETCFS_OPTS
done

commit_p50=$(cd "$ROOT" && cargo bench -q --bench etcd_txn -- --etcd "$EP" --prefix handoff-txn \
	--ops 500 2>/dev/null | sed -n 's/^kind=create .*p50_us=\([0-9]*\).*/\1/p')

python3 - "$WORK/a" "$WORK/b" "$ROUNDS" "${commit_p50:-0}" "$WORK/c" "$APPEND_SECS" <<'PY'
import os, sys, time
a, b, rounds, commit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
c, secs = sys.argv[5], float(sys.argv[6])
fa = os.open(os.path.join(a, "f"), os.O_RDWR | os.O_CREAT)
fb = os.open(os.path.join(b, "f"), os.O_RDWR)
def t(f, *args):
    t0 = time.perf_counter_ns()
    r = f(*args)
    return r, (time.perf_counter_ns() - t0) / 1000
writes, reads, local = [], [], []
for i in range(rounds):
    for (w, r) in ((fa, fb), (fb, fa)):
        data = bytes([(i * 7 + (w == fa)) % 251 + 1]) * 4096
        _, tw = t(os.pwrite, w, data, 0)
        got, tr = t(os.pread, r, 4096, 0)
        assert got == data, f"round {i}: the reader saw other bytes"
        writes.append(tw); reads.append(tr)
for i in range(rounds):
    data = bytes([i % 251 + 1]) * 4096
    _, tw = t(os.pwrite, fa, data, 0)
    _, tr = t(os.pread, fa, 4096, 0)
    local.append(tw + tr)
def pct(v, p):
    v = sorted(v); return v[min(len(v) - 1, int(p / 100 * len(v)))]
print("| measured | n | p50 µs | p99 µs |")
print("|---|---|---|---|")
print(f"| read after the other node's 4 KiB write | {len(reads)} | {pct(reads,50):.0f} | {pct(reads,99):.0f} |")
print(f"| 4 KiB write after the other node's read | {len(writes)} | {pct(writes,50):.0f} | {pct(writes,99):.0f} |")
print(f"| write + read on one node (no handoff) | {len(local)} | {pct(local,50):.0f} | {pct(local,99):.0f} |")
if commit:
    print(f"| one etcd commit (create-shaped txn, serial) | 500 | {commit} | |")
    print()
    print(f"read after the other node's write = {pct(reads,50)/commit:.1f} etcd commits (p50)")
# Three appenders, one per node, one process each.
open(os.path.join(a, "log"), "w").close()
pids = []
for n, d in enumerate((a, b, c)):
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(d, "log"), os.O_WRONLY | os.O_APPEND)
        end, seq = time.monotonic() + secs, 0
        while time.monotonic() < end:
            rec = f"node {n} record {seq:08d} ".ljust(63, "x") + "\n"
            os.write(fd, rec.encode())
            seq += 1
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
data = open(os.path.join(b, "log"), "rb").read()
recs = [data[i:i + 64] for i in range(0, len(data), 64)]
seen = {tuple(r.split()[1:4:2]) for r in recs}
ok = len(data) % 64 == 0 and len(seen) == len(recs) and all(r.endswith(b"\n") for r in recs)
print()
print(f"three nodes appending: {len(recs)} records in {secs:.0f} s = {len(recs)/secs:.0f} records/s, "
      f"{'none lost or overwritten' if ok else 'RECORDS LOST OR OVERWRITTEN'}")
if not ok:
    bad = [i for i, r in enumerate(recs) if not r.endswith(b"\n") or not r.startswith(b"node ")]
    per = {}
    for r in recs:
        w = r.split()
        if len(w) > 3:
            per.setdefault(w[1], set()).add(int(w[3]))
    gaps = {n: sorted(set(range(max(s) + 1)) - s)[:10] for n, s in per.items()}
    print(f"  {len(data)} bytes, {len(recs)} records, {len(seen)} distinct, malformed at {bad[:10]}, "
          f"missing per node {gaps}")
    for i in bad[:3]:
        print("  ", recs[i - 1:i + 2])
PY
echo
echo "($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), one etcd member on loopback)"
for n in a b c; do
	"$ETCFS" stats "$WORK/$n" --json 2>/dev/null | python3 -c '
import json, sys
c = json.load(sys.stdin)["counters"]
print("node '"$n"': cache locks taken", c.get("cache_locks_taken"), "waits", c.get("cache_lock_waits"),
      "released", c.get("cache_locks_released"), "downgraded", c.get("cache_locks_downgraded"),
      "upgraded while being given up", c.get("cache_locks_upgraded_in_release"))' || true
done
