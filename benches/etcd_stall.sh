#!/usr/bin/env bash
# Cores keep answering while etcd stalls: a one-member etcd is stopped (SIGSTOP) for
# STALL seconds while WRITERS threads each try to create a file (every create waits for
# etcd) and one thread stats a cached file in a loop. Prints the stat latency before and
# during the stall, and when the blocked creates finished once etcd was continued.
#
# Usage: sudo bash benches/etcd_stall.sh [--stall SECS] [--writers N] [--etcfs PATH]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
STALL=4
WRITERS=64
ETCFS=$ROOT/target/release/etcfs
PORT=${ETCFS_BENCH_PORT:-24679}
while [ $# -gt 0 ]; do
	case $1 in
	--stall) STALL=$2; shift 2 ;;
	--writers) WRITERS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n 2,8p "$0"; exit 0 ;;
	*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
	esac
done
WORK=$(mktemp -d /var/tmp/etcfs-etcd-stall.XXXXXX)
MNT=$WORK/mnt
pids=()
ETCD_PID=
cleanup() {
	[ -n "$ETCD_PID" ] && kill -CONT "$ETCD_PID" 2>/dev/null || true
	if mountpoint -q "$MNT"; then umount "$MNT" 2>/dev/null || umount -l "$MNT"; fi
	stop_started
	rm -rf "$WORK"
}
trap cleanup EXIT
start_etcd stall "$WORK" "$PORT"
EP=http://127.0.0.1:$PORT
truncate -s 1G "$WORK/dev.img"
"$ETCFS" mkfs --etcd "$EP" --device "$WORK/dev.img" --prefix stall >/dev/null
# A lease longer than the stall: what is measured is the node before any fence.
mount_etcfs "$ETCFS" "$EP" "$WORK/dev.img" stall "$MNT" "$WORK/daemon.log" --lease-ttl 60
echo cached >"$MNT/cached"
python3 - "$MNT" "$ETCD_PID" "$STALL" "$WRITERS" <<'PY'
import os, signal, statistics, sys, threading, time
mnt, etcd, stall, writers = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
cached = os.path.join(mnt, "cached")

def stat_loop(secs):
    lat, end = [], time.monotonic() + secs
    while time.monotonic() < end:
        t = time.perf_counter()
        os.stat(cached)
        lat.append(time.perf_counter() - t)
        time.sleep(0.001)
    return lat

before = stat_loop(1.0)
os.kill(etcd, signal.SIGSTOP)
stopped = time.monotonic()
done = []
def create(i):
    try:
        os.close(os.open(os.path.join(mnt, "new%d" % i), os.O_CREAT | os.O_WRONLY, 0o644))
        done.append((time.monotonic(), "ok"))
    except OSError as e:
        done.append((time.monotonic(), e.strerror))
threads = [threading.Thread(target=create, args=(i,), daemon=True) for i in range(writers)]
for t in threads:
    t.start()
during = stat_loop(max(stall - 0.5, 0.5))
blocked = writers - len(done)
while time.monotonic() < stopped + stall:
    time.sleep(0.01)
os.kill(etcd, signal.SIGCONT)
resumed = time.monotonic()
for t in threads:
    t.join(60)
def row(name, lat):
    lat = sorted(lat)
    p = lambda q: 1e6 * lat[min(len(lat) - 1, int(q * len(lat)))]
    return "| %s | %d | %.0f | %.0f | %.0f |" % (name, len(lat), p(0.5), p(0.99), 1e6 * lat[-1])
print()
print("stat of a cached file while %d creates wait for a stopped etcd (%.0f s)" % (writers, stall))
print()
print("| when | stats | p50 µs | p99 µs | max µs |")
print("|---|---|---|---|---|")
print(row("before the stall", before))
print(row("during the stall", during))
ok = [t for t, r in done if r == "ok"]
errs = [r for t, r in done if r != "ok"]
print()
print("creates still blocked when the stall ended: %d of %d; after SIGCONT: %d succeeded "
      "(last %.2f s after), %d failed %s"
      % (blocked, writers, len(ok), max(ok) - resumed if ok else 0, len(errs), sorted(set(errs))))
PY
