#!/usr/bin/env bash
# Node failure (issue 14): how long after a node dies a survivor holds what the dead node
# held, for each lease TTL given.
#
# Two daemons (nodes A and B) on one device image and one private etcd on loopback, both
# mounted with --lease-ttl TTL. Each round: on A a process creates a file, writes 4 KiB,
# fsyncs, takes an fcntl write lock on it and keeps it open (A holds the file's cache lock
# exclusively); once B lists the name, a process on B sends SIGKILL to A's daemon (by its
# pid) and at once opens the file, reads 4 KiB (checked against what A fsync'd) and writes
# 4 KiB, then takes the same fcntl lock (F_SETLKW). Times from the kill: until the read
# returns, until the write returns (the failover time), until the fcntl lock is granted.
# B must wait for A's cache lock until A's lease ends in etcd: expected TTL minus the time
# since A's last renewal (one every TTL/4), i.e. between 0.75 and 1 TTL, plus etcd's
# expiry check (every 0.5 s) and B's grant. A's renewals go out every TTL/4 from its
# session's start, which the script sees as the PUT of A's membership key (an etcd watch);
# round n of N kills A (n - 0.5)/N of the way into one of A's renewal periods (after B
# sees the name), so the rounds spread over the phase, and the expected time is TTL minus
# that (good to a few tens of ms: a renewal goes out at the keepalive's first 0.1 s tick
# after it is due). Then A's mount point is unmounted lazily, B's unmounted, and the next
# round mounts both again.
# With --evict, one more round (first TTL) runs `etcfs evict` on A's session right after
# the kill: the failover time when an operator (or a cluster manager) ends the session.
#
# Needs root, /dev/fuse, etcd (scripts/deps.sh installs it).
#
# usage: benches/failover.sh [--rounds N] [--ttls "10 4"] [--evict] [--etcfs PATH]
set -euo pipefail

ROUNDS=3
TTLS="10 4"
EVICT=0
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
ETCFS=${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--rounds) ROUNDS=$2; shift 2 ;;
	--ttls) TTLS=$2; shift 2 ;;
	--evict) EVICT=1; shift ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n '2,26p' "$0"; exit 0 ;;
	*) echo "failover.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ "$(id -u)" = 0 ] || { echo "failover.sh: needs root (FUSE mounts)" >&2; exit 1; }
[ -x "$ETCFS" ] || { echo "failover.sh: no etcfs binary at $ETCFS" >&2; exit 1; }

WORK=$(mktemp -d /tmp/etcfs-failover.XXXXXX)
IMG=/var/tmp/etcfs-failover-$$.img
PORT=${FAILOVER_ETCD_PORT:-29479}
EP=http://127.0.0.1:$PORT
pids=() # every process started and not yet reaped: etcd, daemons, A's holder
forget() { # PID: reaped, drop it from pids (so that cleanup never signals a reused pid)
	local p keep=()
	for p in "${pids[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
	pids=("${keep[@]}")
}
cleanup() {
	set +e
	for m in "$WORK/a" "$WORK/b"; do
		if mountpoint -q "$m" 2>/dev/null; then umount "$m" 2>/dev/null || umount -l "$m"; fi
	done
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
	if [ -n "${FAILOVER_KEEP:-}" ]; then echo "kept $WORK" >&2; rm -f "$IMG"; else rm -rf "$WORK" "$IMG"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_etcd failover "$WORK" "$PORT"
pids+=("$ETCD_PID")
truncate -s 1G "$IMG"
"$ETCFS" mkfs --etcd "$EP" --device "$IMG" --prefix failover >/dev/null

# The holder on A: create, write, fsync, lock, then say so and wait (until killed).
cat >"$WORK/hold.py" <<'PY'
import fcntl, os, sys, time
path, ready = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"A" * 4096, 0)
os.fsync(fd)
fcntl.lockf(fd, fcntl.LOCK_EX)
open(ready, "w").close()
while True:
    time.sleep(60)
PY
# The survivor on B: wait for the name, kill A's daemon, then the timed read, write, lock.
cat >"$WORK/take.py" <<'PY'
import fcntl, os, signal, subprocess, sys, time
bdir, name, apid = sys.argv[1], sys.argv[2], int(sys.argv[3])
ttl, a_start, phase = float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
evict = sys.argv[7:]  # the evict command, or nothing
renew = max(ttl / 4, 0.25)
end = time.monotonic() + 10
while name not in os.listdir(bdir):
    if time.monotonic() > end:
        sys.exit("the name never showed on B")
    time.sleep(0.01)
# Kill at the given fraction of one of A's renewal periods (they start at a_start).
k = int((time.time() - a_start) / renew) + 1
time.sleep(max(0, a_start + (k + phase) * renew - time.time()))
t0 = time.monotonic()
since = (time.time() - a_start) % renew
os.kill(apid, signal.SIGKILL)
if evict:
    subprocess.run(evict, check=True, stdout=subprocess.DEVNULL)
t_evict = time.monotonic() - t0
fd = os.open(os.path.join(bdir, name), os.O_RDWR)
got = os.pread(fd, 4096, 0)
t_read = time.monotonic() - t0
os.pwrite(fd, b"B" * 4096, 0)
t_write = time.monotonic() - t0
fcntl.lockf(fd, fcntl.LOCK_EX)
t_lock = time.monotonic() - t0
os.close(fd)
print(f"{t_read:.3f} {t_write:.3f} {t_lock:.3f} {t_evict:.3f} {'ok' if got == b'A' * 4096 else 'BAD'} "
      f"{ttl - since:.3f}")
PY

# The time (wall clock) of the next PUT of a membership key: a node's session starting.
cat >"$WORK/session_start.py" <<'PY'
import subprocess, sys, time
ep, prefix, out = sys.argv[1:4]
w = subprocess.Popen(["etcdctl", "--endpoints", ep, "watch", "--prefix", prefix + "/M"],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
for line in w.stdout:
    if line.strip() == b"PUT":
        open(out, "w").write(f"{time.time():.6f}\n")
        break
w.kill()
w.wait()
PY

# session_of PID: the session id `etcfs status` gives the node whose daemon has that pid.
session_of() {
	"$ETCFS" status --etcd "$EP" --prefix failover --json | python3 -c '
import json, sys
def walk(o):
    if isinstance(o, dict):
        if o.get("pid") == int(sys.argv[1]) and "session" in o:
            print(o["session"]); sys.exit(0)
        for v in o.values(): walk(v)
    elif isinstance(o, list):
        for v in o: walk(v)
walk(json.load(sys.stdin))
sys.exit("no node with pid " + sys.argv[1])' "$1"
}

RES=$WORK/results
: >"$RES"
# round LABEL TTL N [evict]
round() {
	local label=$1 ttl=$2 n=$3 how=${4:-} apid bpid hpid wpid name line sess
	name=f-$label-$n
	rm -f "$WORK/a-start"
	python3 "$WORK/session_start.py" "$EP" failover "$WORK/a-start" &
	wpid=$!
	pids+=("$wpid")
	sleep 0.5 # for the watch to be in place
	mount_etcfs "$ETCFS" "$EP" "$IMG" failover "$WORK/a" "$WORK/a-$label-$n.log" --lease-ttl "$ttl"
	apid=${pids[-1]}
	wait "$wpid" || { echo "failover.sh: no session start seen for A" >&2; return 1; }
	forget "$wpid"
	mount_etcfs "$ETCFS" "$EP" "$IMG" failover "$WORK/b" "$WORK/b-$label-$n.log" --lease-ttl "$ttl"
	bpid=${pids[-1]}
	rm -f "$WORK/ready"
	python3 "$WORK/hold.py" "$WORK/a/$name" "$WORK/ready" &
	hpid=$!
	pids+=("$hpid")
	for _ in $(seq 100); do [ -e "$WORK/ready" ] && break; sleep 0.1; done
	[ -e "$WORK/ready" ] || { echo "failover.sh: the holder on A did not get going" >&2; return 1; }
	local evict=()
	if [ "$how" = evict ]; then
		sess=$(session_of "$apid")
		# A is dead, so it cannot give its session up: --force revokes the lease.
		evict=("$ETCFS" evict --force --etcd "$EP" --prefix failover "$sess")
	fi
	# Round n of N kills A (n - 0.5) / N of the way into one of its renewal periods.
	line=$(python3 "$WORK/take.py" "$WORK/b" "$name" "$apid" "$ttl" "$(cat "$WORK/a-start")" \
		"$(awk -v n="$n" -v r="$ROUNDS" 'BEGIN{print (n - 0.5) / r}')" "${evict[@]}")
	echo "$label ttl=$ttl round $n: read_s write_s lock_s evict_s data expected_s = $line" >&2
	echo "$label $ttl $line" >>"$RES"
	wait "$apid" 2>/dev/null || true
	forget "$apid"
	kill "$hpid" 2>/dev/null || true
	wait "$hpid" 2>/dev/null || true
	forget "$hpid"
	umount -l "$WORK/a"
	umount "$WORK/b"
	for _ in $(seq 100); do kill -0 "$bpid" 2>/dev/null || break; sleep 0.1; done
	wait "$bpid" 2>/dev/null || true
	forget "$bpid"
}

for ttl in $TTLS; do
	for n in $(seq "$ROUNDS"); do round kill "$ttl" "$n"; done
done
if [ "$EVICT" = 1 ]; then
	ROUNDS=1 round evict "${TTLS%% *}" 1 evict
fi

python3 - "$RES" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print("| node A | --lease-ttl s | rounds | B's write returned after the kill, median (min–max) s "
      "| B's read returned, median s | B's fcntl lock granted, median s "
      "| expected (TTL − time since A's last renewal), median (min–max) s "
      "| write − expected, median (min–max) s | B read A's fsync'd data |")
print("|---|---|---|---|---|---|---|---|---|")
seen = []
for r in rows:
    if (r[0], r[1]) not in seen:
        seen.append((r[0], r[1]))
def mm(v):
    v = sorted(v)
    return f"{statistics.median(v):.2f} ({v[0]:.2f}–{v[-1]:.2f})"
for how, ttl in seen:
    rs = [r for r in rows if (r[0], r[1]) == (how, ttl)]
    col = lambda i: [float(r[i]) for r in rs]
    w, rd, lk, ex = col(3), col(2), col(4), col(7)
    what = "SIGKILL" if how == "kill" else f"SIGKILL + `etcfs evict` ({statistics.median(col(5)):.3f} s)"
    ok = "yes" if all(r[6] == "ok" for r in rs) else "**no**"
    exp = mm(ex) if how == "kill" else "—"
    diff = mm([a - b for a, b in zip(w, ex)]) if how == "kill" else "—"
    print(f"| {what} | {ttl} | {len(rs)} | {mm(w)} | {statistics.median(rd):.2f} "
          f"| {statistics.median(lk):.2f} | {exp} | {diff} | {ok} |")
PY
echo
echo "($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), one etcd member on loopback)"
