#!/usr/bin/env bash
# The longest stall an application sees when the etcd leader is killed under load: a
# three-member etcd on loopback (all members given to the mount), one process creating,
# writing (16 KiB), fsyncing and renaming files in a loop, the leader killed with SIGKILL
# and restarted ROUNDS times. Prints, per round, the longest single step of the loop
# around the kill and the errors the application saw (there should be none).
#
# Usage: sudo bash benches/etcd_failover.sh [--rounds N] [--etcfs PATH]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=5
ETCFS=$ROOT/target/release/etcfs
BASE=${ETCFS_BENCH_PORT:-24579}
while [ $# -gt 0 ]; do
	case $1 in
	--rounds) ROUNDS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n 2,8p "$0"; exit 0 ;;
	*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
	esac
done
WORK=$(mktemp -d /var/tmp/etcfs-etcd-failover.XXXXXX)
MNT=$WORK/mnt
declare -a EPIDS=(0 0 0)
DAEMON=
LOADER=
cleanup() {
	[ -n "$LOADER" ] && { kill "$LOADER" 2>/dev/null || true; wait "$LOADER" 2>/dev/null || true; }
	if mountpoint -q "$MNT"; then umount "$MNT" 2>/dev/null || umount -l "$MNT"; fi
	[ -n "$DAEMON" ] && { kill "$DAEMON" 2>/dev/null || true; wait "$DAEMON" 2>/dev/null || true; }
	for p in "${EPIDS[@]}"; do [ "$p" != 0 ] && { kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }; done
	if [ -n "${KEEP:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
client() { echo "http://127.0.0.1:$((BASE + 2 * $1))"; }
peer() { echo "http://127.0.0.1:$((BASE + 2 * $1 + 1))"; }
CLUSTER="m0=$(peer 0),m1=$(peer 1),m2=$(peer 2)"
ENDPOINTS="$(client 0),$(client 1),$(client 2)"
run_member() {
	local i=$1
	etcd --name "m$i" --data-dir "$WORK/m$i" --listen-client-urls "$(client "$i")" \
		--advertise-client-urls "$(client "$i")" --listen-peer-urls "$(peer "$i")" \
		--initial-advertise-peer-urls "$(peer "$i")" --initial-cluster "$CLUSTER" \
		>>"$WORK/m$i.log" 2>&1 &
	EPIDS[$i]=$!
}
healthy() {
	for _ in $(seq 150); do
		etcdctl --endpoints "$ENDPOINTS" endpoint health >/dev/null 2>&1 && return 0
		sleep 0.2
	done
	echo "etcd cluster not healthy" >&2
	return 1
}
leader() {
	etcdctl --endpoints "$ENDPOINTS" endpoint status -w json | python3 -c '
import json, sys
for i, r in enumerate(json.load(sys.stdin)):
    if r["Status"]["header"]["member_id"] == r["Status"]["leader"]:
        print(r["Endpoint"].rsplit(":", 1)[1])'
}
for i in 0 1 2; do run_member "$i"; done
healthy
truncate -s 4G "$WORK/dev.img"
"$ETCFS" mkfs --etcd "$ENDPOINTS" --device "$WORK/dev.img" --prefix failover >/dev/null
mkdir -p "$MNT"
"$ETCFS" mount --foreground --etcd "$ENDPOINTS" --device "$WORK/dev.img" --prefix failover "$MNT" \
	>"$WORK/daemon.log" 2>&1 &
DAEMON=$!
for _ in $(seq 200); do mountpoint -q "$MNT" && break; sleep 0.1; done
mountpoint -q "$MNT" || { cat "$WORK/daemon.log" >&2; exit 1; }

# The application: one line per step, "<end time> <duration> ok|error".
python3 - "$MNT" >"$WORK/steps" <<'PY' &
import os, sys, time
root = sys.argv[1]
data = b"s" * 16384
i = 0
while True:
    t = time.monotonic()
    try:
        tmp = os.path.join(root, "w%d.tmp" % i)
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, os.path.join(root, "w%d" % (i % 500)))
        ok = "ok"
    except OSError as e:
        ok = "error:" + e.strerror.replace(" ", "_")
    end = time.monotonic()
    print("%.6f %.6f %s" % (end, end - t, ok), flush=True)
    i += 1
PY
LOADER=$!
sleep 3
: >"$WORK/kills"
for r in $(seq "$ROUNDS"); do
	port=$(leader)
	i=$(((port - BASE) / 2))
	t=$(python3 -c 'import time; print("%.6f" % time.monotonic())')
	kill -9 "${EPIDS[$i]}"; wait "${EPIDS[$i]}" 2>/dev/null || true
	echo "$r $t m$i" >>"$WORK/kills"
	sleep 4
	run_member "$i"
	healthy
	sleep 3
done
kill "$LOADER"; wait "$LOADER" 2>/dev/null || true; LOADER=
python3 - "$WORK/kills" "$WORK/steps" <<'PY'
import statistics, sys
kills = [l.split() for l in open(sys.argv[1])]
steps = [l.split() for l in open(sys.argv[2]) if len(l.split()) == 3]
print()
print("| round | leader killed | longest step within 6 s after the kill | errors | steps in that window |")
print("|---|---|---|---|---|")
worst = []
for r, t, m in kills:
    t = float(t)
    win = [(float(e), float(d), s) for e, d, s in steps if t <= float(e) <= t + 6 + float(d)]
    longest = max((d for _, d, _ in win), default=0.0)
    errs = sum(1 for _, _, s in win if s != "ok")
    worst.append(longest)
    print("| %s | %s | %.2f s | %d | %d |" % (r, m, longest, errs, len(win)))
for e, d, s in steps:
    if s != "ok":
        print("error at %s after %s s: %s" % (e, d, s))
base = [float(d) for e, d, s in steps]
print()
print("median longest stall %.2f s over %d rounds (min %.2f, max %.2f); median step overall %.1f ms; %d errors in %d steps"
      % (statistics.median(worst), len(worst), min(worst), max(worst),
         1000 * statistics.median(base), sum(1 for s in steps if s[2] != "ok"), len(steps)))
PY
