#!/usr/bin/env bash
# What any FUSE server can reach on this machine, beside etcfs and the raw file (issue 17):
# 4 KiB O_DIRECT random reads at several queue depths on
#   raw    a file beside etcfs's device image (the device through ext4, no FUSE);
#   probe  the do-nothing FUSE server over the ring (shared/reference/probe-src/
#          fuse_uring_probe.c with FUSE_ASYNC_DIO, as etcfs negotiates, and as many ring
#          entries per queue as the deepest depth), whose /big is served from memory: the
#          kernel's FUSE round trip and nothing else;
#   etcfs  `etcfs mount --transport uring` with its defaults, on a device image;
#   devprobe  fusedev's transport with no filesystem behind it (fusedev/examples/devprobe.rs,
#          with etcfs's transport defaults): /big is the raw file, each READ answered by a
#          device read of it as etcfs plans one. etcfs / devprobe is what etcfs's filesystem
#          costs; devprobe / raw is the transport's and the kernel's FUSE path's share;
#   raw-busy  the raw file again, fio pinned to the last CPU while a busy loop holds CPU 0:
#          what the device gives when a second CPU is as busy as a FUSE server keeps it.
#          On a VM whose vCPUs share host cores with the device's emulation this is far
#          below `raw` (host steal time shows it), and no FUSE server can beat it.
# A FUSE server that reads the device pays, per request, at least the probe's round trip
# on top of the raw read; so raw latency + probe latency bounds what etcfs can reach at
# QD 1, and the probe's IOPS at a depth bounds it there (the device's work comes on top).
#
# Each round runs every target (order rotating between rounds) and, per target, fio at each
# depth (`--rw=randread --bs=4k --direct=1 --ioengine=io_uring`, --fio-secs, 1 s ramp).
# Prints per depth the medians over the rounds (min–max) of IOPS and clat p50, and of the
# per-round ratios; then the CPU time all CPUs spent per read (busy time from /proc/stat
# over the reads fio made; the busy loop's CPU left out for raw-busy) and the host's steal
# time as a share of all CPU time.
#
# Private etcd on loopback (a free random port pair), device image and raw file in /var/tmp;
# everything started is stopped by pid and everything mounted unmounted on exit. Needs
# root, /dev/fuse and FUSE over io_uring (6.14+); installs fio, etcd and liburing-dev with
# apt-get if missing.
#
# usage: benches/fuse_ceiling.sh [--rounds R] [--fio-secs S] [--fio-size SIZE]
#            [--depths "1 32"] [--etcfs PATH] [--devprobe PATH]
#            [--targets "raw probe etcfs raw-busy devprobe"]
set -euo pipefail

ROUNDS=5
FIO_SECS=5
FIO_SIZE=512M
DEPTHS="1 32"
TARGETS="raw probe devprobe etcfs raw-busy"
ETCFS_ARG=""
DEVPROBE_ARG=""
while [ $# -gt 0 ]; do
	case "$1" in
	--rounds) ROUNDS=$2; shift 2 ;;
	--fio-secs) FIO_SECS=$2; shift 2 ;;
	--fio-size) FIO_SIZE=$2; shift 2 ;;
	--depths) DEPTHS=$2; shift 2 ;;
	--etcfs) ETCFS_ARG=$2; shift 2 ;;
	--devprobe) DEVPROBE_ARG=$2; shift 2 ;;
	--targets) TARGETS=$2; shift 2 ;;
	-h | --help) sed -n '2,30p' "$0"; exit 0 ;;
	*) echo "fuse_ceiling.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
PROBE_SRC=${PROBE_SRC:-$ROOT/../shared/reference/probe-src/fuse_uring_probe.c}
ETCFS=${ETCFS_ARG:-${CARGO_TARGET_DIR:-$ROOT/target}/release/etcfs}
DEVPROBE=${DEVPROBE_ARG:-${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/devprobe}
URING_PARAM=/sys/module/fuse/parameters/enable_uring

log() { echo "[fuse_ceiling.sh $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (FUSE mounts, $URING_PARAM)"
[ -e /dev/fuse ] || die "needs /dev/fuse"
[ -e "$URING_PARAM" ] || die "this kernel has no FUSE-over-io_uring ($URING_PARAM missing)"

WORK=$(mktemp -d /tmp/etcfs-ceiling.XXXXXX)
IMGDIR=$(mktemp -d /var/tmp/etcfs-ceiling.XXXXXX)
MNT=$WORK/mnt
pids=()       # mount_etcfs (lib.sh) appends the daemons it starts
SERVER_PID="" # the server of the one mount that exists at a time
BUSY_PID=""   # the busy loop of raw-busy
ETCD_PID=""
URING_WAS=""

cleanup() {
	local rc=$? pid
	set +e
	mountpoint -q "$MNT" 2>/dev/null && { umount "$MNT" 2>/dev/null || umount -l "$MNT"; }
	[ -z "$BUSY_PID" ] || { kill "$BUSY_PID" 2>/dev/null; wait "$BUSY_PID" 2>/dev/null; }
	for pid in "${pids[@]}" $SERVER_PID; do
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill "$pid" 2>/dev/null
		wait "$pid" 2>/dev/null
	done
	[ -z "$ETCD_PID" ] || { kill "$ETCD_PID" 2>/dev/null; wait "$ETCD_PID" 2>/dev/null; }
	[ -z "$URING_WAS" ] || [ "$URING_WAS" = Y ] || echo "$URING_WAS" >"$URING_PARAM"
	rm -rf "$IMGDIR"
	if mountpoint -q "$MNT" 2>/dev/null; then log "left $WORK: $MNT is still mounted"; else rm -rf "$WORK"; fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

need fio fio
URING_WAS=$(cat "$URING_PARAM")
[ "$URING_WAS" = Y ] || echo Y >"$URING_PARAM" || die "cannot turn on $URING_PARAM"
MAX_DEPTH=$(tr ' ' '\n' <<<"$DEPTHS" | sort -n | tail -1)

if [[ " $TARGETS " == *" probe "* ]]; then
	build_probe "$PROBE_SRC" "$WORK"
fi
if [[ " $TARGETS " == *" devprobe "* ]]; then
	if [ ! -x "$DEVPROBE" ] && [ -z "${DEVPROBE_ARG:-}" ]; then
		log "building devprobe"
		(cd "$ROOT" && cargo build --release -q -p etcfs-fusedev --example devprobe) || die "building devprobe failed"
	fi
	[ -x "$DEVPROBE" ] || die "no $DEVPROBE (cargo build --release -p etcfs-fusedev --example devprobe)"
	cp "$DEVPROBE" "$WORK/devprobe"
	DEVPROBE=$WORK/devprobe
fi
if [[ " $TARGETS " == *" etcfs "* ]]; then
	need etcd etcd-server
	need etcdctl etcd-client
	[ -x "$ETCFS" ] || die "no $ETCFS (build it, or give --etcfs)"
	cp "$ETCFS" "$WORK/etcfs" # another build may replace it meanwhile
	ETCFS=$WORK/etcfs
	port=""
	for _ in $(seq 100); do
		p=$((20000 + RANDOM % 10000))
		if ! ss -Htln "sport = :$p or sport = :$((p + 1))" | grep -q .; then port=$p; break; fi
	done
	[ -n "$port" ] || die "no free loopback port pair found"
	ETCD_URL=http://127.0.0.1:$port
	start_etcd ceiling "$WORK" "$port"
	truncate -s $(($(numfmt --from=iec "$FIO_SIZE") * 2 + (2 << 30))) "$IMGDIR/device.img"
	"$ETCFS" mkfs --etcd "$ETCD_URL" --device "$IMGDIR/device.img" --prefix ceiling >"$WORK/mkfs.log" 2>&1 ||
		{ cat "$WORK/mkfs.log" >&2; die "etcfs mkfs failed"; }
fi

NCPU=$(nproc)
if [[ " $TARGETS " == *" raw-busy "* ]] && [ "$NCPU" -lt 2 ]; then
	die "raw-busy needs two CPUs (this machine has $NCPU)"
fi
PIN=() # what fio runs under: taskset for raw-busy

start() { # TARGET: mounts it (raw: nothing) and sets FILE
	PIN=()
	case $1 in
	raw) FILE=$IMGDIR/raw.dat ;;
	raw-busy)
		FILE=$IMGDIR/raw.dat
		taskset -c 0 sh -c 'while :; do :; done' &
		BUSY_PID=$!
		PIN=(taskset -c "$((NCPU - 1))")
		;;
	probe)
		start_probe_server "$WORK/probe" -d "$MAX_DEPTH"
		FILE=$MNT/big
		;;
	devprobe)
		start_probe_server "$DEVPROBE" "$IMGDIR/raw.dat"
		FILE=$MNT/big
		# Its reads must be the raw file's bytes, or it measures nothing: the first and
		# an unaligned MiB through O_DIRECT and through the page cache.
		cmp -s <(dd if="$FILE" bs=1M count=1 iflag=direct status=none) \
			<(dd if="$IMGDIR/raw.dat" bs=1M count=1 status=none) &&
			cmp -s <(tail -c +777 "$FILE" | head -c 1048576) <(tail -c +777 "$IMGDIR/raw.dat" | head -c 1048576) ||
			die "devprobe's /big differs from the raw file"
		;;
	etcfs)
		mount_etcfs "$ETCFS" "$ETCD_URL" "$IMGDIR/device.img" ceiling "$MNT" "$WORK/daemon.log" \
			--transport uring || die "etcfs did not mount"
		SERVER_PID=${pids[-1]}
		pids=()
		FILE=$MNT/fio.dat
		;;
	*) die "unknown target $1 (raw, probe, etcfs, raw-busy, devprobe)" ;;
	esac
}

stop() {
	[ -z "$SERVER_PID" ] || stop_server
	[ -z "$BUSY_PID" ] || { kill "$BUSY_PID"; wait "$BUSY_PID" 2>/dev/null || true; BUSY_PID=""; }
}

# cpu_ticks SKIP: busy and steal ticks summed over the CPUs other than SKIP (-1: none).
cpu_ticks() {
	awk -v skip="cpu$1" '/^cpu[0-9]/ && $1 != skip {b += $2 + $3 + $4 + $7 + $8; s += $9} END {print b, s}' /proc/stat
}
# all_ticks: every tick of every CPU (for the steal share).
all_ticks() { awk '/^cpu / {t = 0; for (i = 2; i <= NF; i++) t += $i; print t}' /proc/stat; }

if [[ " $TARGETS " =~ \ (raw|raw-busy|devprobe)\  ]]; then
	log "laying out $FIO_SIZE on the raw file"
	layout "$IMGDIR/raw.dat"
fi
if [[ " $TARGETS " == *" etcfs "* ]]; then
	log "laying out $FIO_SIZE in etcfs"
	start etcfs
	layout "$FILE"
	stop
fi

RES=$WORK/results
read -r -a TLIST <<<"$TARGETS"
for round in $(seq "$ROUNDS"); do
	n=${#TLIST[@]}
	for k in $(seq 0 $((n - 1))); do
		target=${TLIST[$(((k + round - 1) % n))]}
		start "$target"
		for depth in $DEPTHS; do
			out=$WORK/fio.json
			skip=-1
			[ "$target" != raw-busy ] || skip=0
			read -r busy0 steal0 < <(cpu_ticks "$skip")
			all0=$(all_ticks)
			"${PIN[@]}" fio --name=randread --filename="$FILE" --rw=randread --bs=4k --iodepth="$depth" \
				--direct=1 --ioengine=io_uring --numjobs=1 --size="$FIO_SIZE" --time_based \
				--runtime="$FIO_SECS" --ramp_time=1 --norandommap --output-format=json \
				--output="$out" >"$WORK/fio.log" 2>&1 || { cat "$WORK/fio.log" >&2; die "fio ($target, QD $depth) failed"; }
			read -r busy1 steal1 < <(cpu_ticks "$skip")
			all1=$(all_ticks)
			# fio's ramp second is in the ticks but not in its IOPS: per read, the busy time
			# is divided over IOPS x (runtime + ramp).
			vals=$(python3 -c 'import json, os, sys
j = json.load(open(sys.argv[1]))["jobs"][0]["read"]
busy, steal, total, secs = (float(x) for x in sys.argv[2:])
hz = os.sysconf("SC_CLK_TCK")
cpu_us = busy / hz * 1e6 / max(j["iops"] * (secs + 1), 1)
print(round(j["iops"]), round(j["clat_ns"]["percentile"]["50.000000"] / 1000, 1),
      round(cpu_us, 1), round(100 * steal / max(total, 1), 1))' "$out" $((busy1 - busy0)) \
				$((steal1 - steal0)) $((all1 - all0)) "$FIO_SECS")
			log "round $round $target QD $depth: IOPS, clat p50 µs, CPU µs per read, steal % = $vals"
			echo "$round $target $depth $vals" >>"$RES"
		done
		stop
	done
done

python3 - "$RES" "$TARGETS" "$DEPTHS" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
targets, depths = sys.argv[2].split(), sys.argv[3].split()
R = {(r, t, d): tuple(float(x) for x in v) for r, t, d, *v in rows}
rounds = sorted({k[0] for k in R}, key=int)
def cell(v, digits=0):
    v = sorted(v)
    return f"{statistics.median(v):,.{digits}f} ({v[0]:,.{digits}f}–{v[-1]:,.{digits}f})".replace(",", " ")
def series(t, d, m):
    return [R[(r, t, d)][m] for r in rounds if (r, t, d) in R]
names = {"raw": "raw file", "probe": "probe (memory)", "etcfs": "etcfs", "raw-busy": "raw, CPU 0 busy",
         "devprobe": "devprobe (no filesystem)"}
head = [f"{names[t]} IOPS" for t in targets] + [f"{names[t]} clat p50 µs" for t in targets]
pairs = [(a, b) for a, b in (("probe", "raw"), ("etcfs", "raw"), ("etcfs", "probe"), ("raw-busy", "raw"), ("etcfs", "raw-busy"),
                                     ("devprobe", "raw"), ("etcfs", "devprobe")) if a in targets and b in targets]
head += [f"{a} / {b} IOPS" for a, b in pairs]
print("| QD | " + " | ".join(head) + " |")
print("|---" * (len(head) + 1) + "|")
for d in depths:
    cells = [cell(series(t, d, 0)) for t in targets] + [cell(series(t, d, 1), 1) for t in targets]
    for a, b in pairs:
        cells.append(cell([x / y for x, y in zip(series(a, d, 0), series(b, d, 0))], 2))
    print(f"| {d} | " + " | ".join(cells) + " |")
if "raw" in targets and "probe" in targets:
    print()
    print("Bound on etcfs / raw at QD 1 from latencies (raw p50 / (raw p50 + probe p50)), per round: "
          + cell([R[(r, "raw", "1")][1] / (R[(r, "raw", "1")][1] + R[(r, "probe", "1")][1])
                  for r in rounds if (r, "raw", "1") in R and (r, "probe", "1") in R], 2))
print()
head = [f"{names[t]} CPU µs per read" for t in targets] + [f"{names[t]} steal %" for t in targets]
print("| QD | " + " | ".join(head) + " |")
print("|---" * (len(head) + 1) + "|")
for d in depths:
    cells = [cell(series(t, d, 2), 1) for t in targets] + [cell(series(t, d, 3), 1) for t in targets]
    print(f"| {d} | " + " | ".join(cells) + " |")
PY
