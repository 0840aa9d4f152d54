#!/usr/bin/env bash
# How soon a name created on one node is visible on another (issue 13, names).
#
# Two daemons (nodes A and B) on one device image and one private etcd on loopback, with
# the default 60 s entry and negative timeouts. For each of NAMES names: B looks the name
# up first (so its kernel caches the absence, the hard case), A creates it (mkdir), and
# right after A's mkdir returns B stats it in a loop until it exists. Prints how many
# first stats on B still said ENOENT and the distribution of the time from A's mkdir
# returning to B seeing the name (the watch's INVAL_ENTRY reaching B's kernel).
#
# Needs root, /dev/fuse, etcd (scripts/deps.sh installs it).
#
# usage: benches/name_visibility.sh [--names N] [--etcfs PATH]
set -euo pipefail

NAMES=200
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
ETCFS=${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--names) NAMES=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n '2,14p' "$0"; exit 0 ;;
	*) echo "name_visibility.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$ETCFS" ] || { echo "name_visibility.sh: no etcfs binary at $ETCFS" >&2; exit 1; }

WORK=$(mktemp -d /tmp/etcfs-names.XXXXXX)
IMG=/var/tmp/etcfs-names-$$.img
PORT=${NAMES_ETCD_PORT:-28379}
EP=http://127.0.0.1:$PORT
pids=()
cleanup() {
	for m in "$WORK/a" "$WORK/b"; do
		if mountpoint -q "$m" 2>/dev/null; then umount "$m" || umount -l "$m" || true; fi
	done
	stop_started
	rm -rf "$WORK" "$IMG"
}
trap cleanup EXIT

start_etcd names "$WORK" "$PORT"
pids+=("$ETCD_PID")
truncate -s 1G "$IMG"
"$ETCFS" mkfs --etcd "$EP" --device "$IMG" --prefix names >/dev/null
for n in a b; do
	mount_etcfs "$ETCFS" "$EP" "$IMG" names "$WORK/$n" "$WORK/$n.log"
done

python3 - "$WORK/a" "$WORK/b" "$NAMES" <<'EOF'
import os, sys, time
a, b, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
first_enoent, waits = 0, []
for i in range(n):
    name = f"n{i}"
    assert not os.path.exists(os.path.join(b, name))
    os.mkdir(os.path.join(a, name))
    t0 = time.perf_counter()
    seen_first = os.path.exists(os.path.join(b, name))
    if not seen_first:
        first_enoent += 1
        while not os.path.exists(os.path.join(b, name)):
            if time.perf_counter() - t0 > 5:
                sys.exit(f"{name} not visible on B after 5 s")
    waits.append((time.perf_counter() - t0) * 1e6)
waits.sort()
pct = lambda p: waits[min(len(waits) - 1, int(p / 100 * len(waits)))]
print(f"| names | first stat on B said ENOENT | p50 µs | p90 µs | p99 µs | max µs |")
print(f"|---|---|---|---|---|---|")
print(f"| {n} | {first_enoent} | {pct(50):.0f} | {pct(90):.0f} | {pct(99):.0f} | {waits[-1]:.0f} |")
EOF
echo
echo "($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), one etcd member on loopback)"
