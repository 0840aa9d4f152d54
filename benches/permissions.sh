#!/usr/bin/env bash
# What issue 15's permission work costs (POSIX ACLs, df -i, relatime).
#
# One daemon on a private etcd on loopback and a sparse device image. Measures:
#  * creates/s in a directory without and with a default ACL (the create in the second
#    reads the parent's default ACL first: one more etcd round trip), RUNS runs each;
#  * statfs (`stat -f`) latency with INODES inodes present: the first call after the
#    2 s count cache expired (a count-only etcd range over every inode key) and warm
#    calls, and the same read by etcdctl (`get --keys-only --limit 1`, which returns the count);
#  * a cold read of a file (relatime moves atime: marked in memory, no etcd) vs a warm
#    one (not due), O_DIRECT so each reaches the daemon.
# Prints medians as a markdown table.
#
# Needs root, /dev/fuse, etcd and etcdctl, setfacl, python3.
#
# usage: benches/permissions.sh [--inodes N] [--creates N] [--runs N] [--etcfs PATH]
set -euo pipefail

INODES=60000
CREATES=3000
RUNS=5
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
ETCFS=${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--inodes) INODES=$2; shift 2 ;;
	--creates) CREATES=$2; shift 2 ;;
	--runs) RUNS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n '2,16p' "$0"; exit 0 ;;
	*) echo "permissions.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$ETCFS" ] || { echo "permissions.sh: no etcfs binary at $ETCFS" >&2; exit 1; }

WORK=$(mktemp -d /tmp/etcfs-perm.XXXXXX)
IMG=/var/tmp/etcfs-perm-$$.img
PORT=${PERM_ETCD_PORT:-28479}
EP=http://127.0.0.1:$PORT
pids=()
cleanup() {
	if mountpoint -q "$WORK/m" 2>/dev/null; then umount "$WORK/m" || umount -l "$WORK/m" || true; fi
	stop_started
	rm -rf "$WORK" "$IMG"
}
trap cleanup EXIT

start_etcd perm "$WORK" "$PORT"
pids+=("$ETCD_PID")
truncate -s 4G "$IMG"
"$ETCFS" mkfs --etcd "$EP" --device "$IMG" --prefix perm >/dev/null
mount_etcfs "$ETCFS" "$EP" "$IMG" perm "$WORK/m" "$WORK/m.log"

python3 - "$WORK/m" "$INODES" "$CREATES" "$RUNS" "$EP" <<'PY'
import os, statistics, subprocess, sys, time
m, inodes, creates, runs, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
med = statistics.median

rates = {"plain": [], "default ACL": []}
for r in range(runs):
    for kind in rates:
        d = os.path.join(m, f"{kind.replace(' ', '_')}{r}")
        os.mkdir(d)
        if kind == "default ACL":
            subprocess.run(["setfacl", "-d", "-m", "u:1000:rwx", d], check=True)
        t0 = time.perf_counter()
        for i in range(creates):
            os.close(os.open(os.path.join(d, str(i)), os.O_CREAT | os.O_WRONLY, 0o644))
        rates[kind].append(creates / (time.perf_counter() - t0))

# Fill up to INODES inodes, then time statfs.
have = os.statvfs(m)
used = have.f_files - have.f_ffree
fill = os.path.join(m, "fill")
os.mkdir(fill)
n = 0
while used + n + 1 < inodes:
    os.close(os.open(os.path.join(fill, str(n)), os.O_CREAT | os.O_WRONLY, 0o644))
    n += 1
cold, warm = [], []
for _ in range(runs):
    time.sleep(2.2)
    t0 = time.perf_counter(); s = os.statvfs(m); cold.append((time.perf_counter() - t0) * 1e3)
    for _ in range(5):
        t0 = time.perf_counter(); os.statvfs(m); warm.append((time.perf_counter() - t0) * 1e3)
counted = s.f_files - s.f_ffree
count_only = []
for _ in range(runs):
    t0 = time.perf_counter()
    subprocess.run(["etcdctl", "--endpoints", ep, "get", "perm/I", "perm/J", "--keys-only", "--limit", "1", "-w", "json"],
                   check=True, capture_output=True)
    count_only.append((time.perf_counter() - t0) * 1e3)

# Reads: the first after a change is due (atime marked), later ones are not.
f = os.path.join(m, "a")
with open(f, "wb") as w:
    w.write(b"x" * 4096)
import mmap
mm = mmap.mmap(-1, 4096)
def read_direct():
    fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    t0 = time.perf_counter(); os.readv(fd, [mm]); t = (time.perf_counter() - t0) * 1e6
    os.close(fd)
    return t
due, not_due = [], []
for _ in range(runs * 4):
    os.chmod(f, 0o644)
    due.append(read_direct())
    not_due.append(read_direct())

print("| measure | median |")
print("|---|---|")
print(f"| creates/s, plain directory ({creates} per run) | {med(rates['plain']):.0f} |")
print(f"| creates/s, directory with a default ACL | {med(rates['default ACL']):.0f} |")
print(f"| statfs with {counted} inodes, count expired (ms) | {med(cold):.2f} |")
print(f"| statfs, count cached (ms) | {med(warm):.2f} |")
print(f"| etcdctl get --keys-only --limit 1 over the inode keys (count) (ms, process start included) | {med(count_only):.1f} |")
print(f"| 4 KiB O_DIRECT read, atime due (µs) | {med(due):.0f} |")
print(f"| 4 KiB O_DIRECT read, atime not due (µs) | {med(not_due):.0f} |")
PY
echo
echo "($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), one etcd member on loopback, $RUNS runs)"
