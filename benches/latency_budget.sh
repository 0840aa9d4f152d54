#!/usr/bin/env bash
# Latency budget of one 4 KiB read at queue depth 1 (issue 17): where the time of an
# O_DIRECT random read goes, stage by stage, on the raw file beside etcfs's device image,
# in etcfs (FUSE over io_uring, and classic /dev/fuse), and in the do-nothing FUSE server
# (shared/reference/probe-src/fuse_uring_probe.c, ring mode, its /big file). The probe
# runs twice: `probe` is built to ask for FUSE_ASYNC_DIO as etcfs does, so that the kernel
# takes the same path for the application's O_DIRECT read (sent asynchronously, completed
# through the application's io_uring); `probe-sync` is the probe as shipped, without it
# (the read is sent and waited for inside the application's io_uring_enter).
#
# Each round, for each target in an order that rotates between rounds:
#   1. fio untraced (`--rw=randread --bs=4k --iodepth=1 --direct=1`, --fio-secs, 1 s ramp):
#      IOPS and clat p50, the figures tracing must not be mistaken for;
#   2. the same fio for --trace-secs with kernel tracepoints on in a private ftrace instance
#      (fuse, io_uring, block on the image's disk, sched_switch, syscall exits), turned
#      into a per-request timeline by benches/latency_budget.py: the kernel queueing the
#      request, the worker waking, the request delivered to it, decode and planning, the
#      device submission, the device, the completion seen, the reply committed, the
#      application waking (stage p50s, the p50 of the per-request totals, fio's traced clat);
#   3. for etcfs, fio again on a `--perf` mount, and the READ stage p50s of `etcfs stats`.
# The report takes, per cell, the median over the rounds of each round's figure.
#
# Private etcd on loopback (--etcd-port P and P+1, default a free random pair), sparse
# device image and raw file in /var/tmp (the host filesystem whose disk the block
# tracepoints watch), the trace text in /dev/shm; everything started is stopped by pid and
# everything mounted unmounted on exit. Needs root, /dev/fuse, a kernel with FUSE over
# io_uring and the fuse tracepoints (6.14+); installs fio and liburing-dev with apt-get
# if missing.
#
# usage: benches/latency_budget.sh [--rounds R] [--fio-secs S] [--trace-secs S]
#            [--fio-size SIZE] [--engine io_uring|psync]
#            [--targets "raw uring uring-nospin devfuse probe probe-sync"] (uring-nospin: etcfs
#            uring with --device-spin-us 0)
#            [--etcd-port P] [--no-build] [--etcfs PATH] [--write-doc] [--results FILE]
#            [--keep-traces DIR] [--fio-cpu C]
# --results keeps the raw per-round figures (KEY VALUE lines) in FILE; the report can be
# made again from it with `TARGETS=... ENGINE=... ROUNDS=... FIO_SIZE=... FIO_SECS=...
# TRACE_SECS=... python3 benches/latency_budget.py report FILE`. --keep-traces keeps each
# traced run's trace text (with the server's thread ids and the clock marks) in DIR.
# --fio-cpu pins fio to CPU C (`taskset -c C`), so that the device interrupt's CPU (see
# /proc/interrupts) can be made the application's, or not.
set -euo pipefail

ROUNDS=3
FIO_SECS=5
TRACE_SECS=2
FIO_SIZE=512M
ENGINE=io_uring
TARGETS="raw uring uring-nospin devfuse probe probe-sync"
ETCD_PORT=""
BUILD=1
ETCFS_ARG=""
WRITE_DOC=0
RESULTS_OUT=""
KEEP_TRACES=""
FIO_CPU=""
ORIG_ARGS=("$@")
while [ $# -gt 0 ]; do
	case "$1" in
	--rounds) ROUNDS=$2; shift 2 ;;
	--fio-secs) FIO_SECS=$2; shift 2 ;;
	--trace-secs) TRACE_SECS=$2; shift 2 ;;
	--fio-size) FIO_SIZE=$2; shift 2 ;;
	--engine) ENGINE=$2; shift 2 ;;
	--targets) TARGETS=$2; shift 2 ;;
	--etcd-port) ETCD_PORT=$2; shift 2 ;;
	--no-build) BUILD=0; shift ;;
	--etcfs) ETCFS_ARG=$2; BUILD=0; shift 2 ;;
	--write-doc) WRITE_DOC=1; shift ;;
	--results) RESULTS_OUT=$2; shift 2 ;;
	--keep-traces) KEEP_TRACES=$2; shift 2 ;;
	--fio-cpu) FIO_CPU=$2; shift 2 ;;
	-h | --help) sed -n '2,41p' "$0"; exit 0 ;;
	*) echo "latency_budget.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
case $ENGINE in io_uring | psync) ;; *) echo "--engine: io_uring or psync" >&2; exit 2 ;; esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
PY=$ROOT/benches/latency_budget.py
PROBE_SRC=${PROBE_SRC:-$ROOT/../shared/reference/probe-src/fuse_uring_probe.c}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
ETCFS=${ETCFS_ARG:-$TARGET_DIR/release/etcfs}
URING_PARAM=/sys/module/fuse/parameters/enable_uring

log() { echo "[latency_budget.sh $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (FUSE mounts, tracefs, $URING_PARAM)"
[ -e /dev/fuse ] || die "needs /dev/fuse"

WORK=$(mktemp -d /tmp/etcfs-latency.XXXXXX)
IMGDIR=$(mktemp -d /var/tmp/etcfs-latency.XXXXXX)
SHM=$(mktemp -d /dev/shm/etcfs-latency.XXXXXX)
DEV_IMG=$IMGDIR/device.img
RAW_FILE=$IMGDIR/raw.dat
MNT=$WORK/mnt
pids=()       # mount_etcfs (lib.sh) appends the daemons it starts
SERVER_PID="" # the server of the one mount that exists at a time
ETCD_PID=""
URING_WAS=""
INST=""
CMDLINES_WAS=""
TRACEFS=/sys/kernel/tracing

stop_pid() { # PID: SIGTERM, then SIGKILL after 10 s
	local pid=$1
	kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null
	for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
	log "pid $pid still running; SIGKILL"
	kill -KILL "$pid" 2>/dev/null
}

cleanup() {
	local rc=$?
	set +e
	mountpoint -q "$MNT" 2>/dev/null && { umount "$MNT" 2>/dev/null || umount -l "$MNT"; }
	for pid in "${pids[@]}" $SERVER_PID; do
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		stop_pid "$pid"
	done
	mountpoint -q "$MNT" 2>/dev/null && umount -l "$MNT"
	[ -n "$ETCD_PID" ] && stop_pid "$ETCD_PID"
	if [ -d "$INST" ]; then
		echo 0 >"$INST/tracing_on"
		rmdir "$INST" || log "could not remove the ftrace instance $INST"
	fi
	[ -z "$CMDLINES_WAS" ] || echo "$CMDLINES_WAS" >"$TRACEFS/saved_cmdlines_size"
	if [ -n "$URING_WAS" ] && [ "$URING_WAS" != Y ]; then
		echo "$URING_WAS" >"$URING_PARAM" 2>/dev/null
	fi
	rm -rf "$IMGDIR" "$SHM"
	if mountpoint -q "$MNT" 2>/dev/null; then log "left $WORK: $MNT is still mounted"; else rm -rf "$WORK"; fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- tools ---------------------------------------------------------------------------------

need fio fio
need python3 python3
[[ " $TARGETS " == *" uring"* || " $TARGETS " == *" devfuse "* ]] && { need etcd etcd-server; need etcdctl etcd-client; }

[ -e /sys/kernel/tracing/events ] || mount -t tracefs nodev /sys/kernel/tracing ||
	die "no tracefs at /sys/kernel/tracing"
[ -e /sys/kernel/tracing/events/fuse/fuse_request_send ] ||
	die "this kernel has no fuse:fuse_request_send tracepoint (needs 6.14+ with fuse tracepoints)"
if [ -e "$URING_PARAM" ]; then
	URING_WAS=$(cat "$URING_PARAM")
	[ "$URING_WAS" = Y ] || echo Y >"$URING_PARAM" || die "cannot turn on $URING_PARAM"
else
	die "this kernel has no FUSE-over-io_uring ($URING_PARAM missing)"
fi

PROBE=""
if [[ " $TARGETS " == *" probe"* ]]; then
	build_probe "$PROBE_SRC" "$WORK"
	PROBE=$WORK
fi

if [ $BUILD = 1 ]; then
	log "building etcfs (release)"
	(cd "$ROOT" && cargo build --release --bin etcfs) >"$WORK/cargo-build.log" 2>&1 ||
		{ tail -30 "$WORK/cargo-build.log" >&2; die "cargo build --release failed (or use --no-build)"; }
fi
[ -x "$ETCFS" ] || die "no $ETCFS"
SOURCE=$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(cd "$ROOT" && git status --porcelain -- src meta fusedev uring perf 2>/dev/null | awk '{print $2}' | paste -sd' ' - || true)
[ -z "$dirty" ] || SOURCE="$SOURCE with uncommitted changes to: $dirty"
[ -z "$ETCFS_ARG" ] || SOURCE="the binary $ETCFS_ARG"
[ $BUILD = 1 ] || [ -n "$ETCFS_ARG" ] || SOURCE="$SOURCE (--no-build: binary of $(date -r "$ETCFS" -u '+%F %H:%M UTC'))"
# A private copy: another build may replace the target directory's binary meanwhile.
cp "$ETCFS" "$WORK/etcfs"
ETCFS=$WORK/etcfs

# The disk whose block requests the trace watches: the one under the device image. Block
# tracepoints name the whole disk (a partition's requests carry its disk's dev_t).
BLOCK_DEV=$(findmnt -no SOURCE -T "$IMGDIR" 2>/dev/null || true)
DEVT=""
if [ -b "$BLOCK_DEV" ]; then
	disk=$(lsblk -no PKNAME "$BLOCK_DEV" 2>/dev/null | head -1)
	[ -n "$disk" ] || disk=$(basename "$BLOCK_DEV")
	if [ -r "/sys/block/$disk/dev" ]; then
		IFS=: read -r maj min <"/sys/block/$disk/dev"
		DEVT=$(((maj << 20) | min))
		BLOCK_DEV=/dev/$disk
	fi
fi
[ -n "$DEVT" ] || [[ " $TARGETS " != *" raw "* && " $TARGETS " != *" uring"* && " $TARGETS " != *" devfuse "* ]] ||
	die "$IMGDIR is not on a block device (findmnt says ${BLOCK_DEV:-nothing}): no block tracepoints to watch"

# --- etcd, the filesystem, the files -------------------------------------------------------

ETCD_URL=""
PREFIX=latency
if [[ " $TARGETS " == *" uring"* || " $TARGETS " == *" devfuse "* ]]; then
	if [ -z "$ETCD_PORT" ]; then
		port_free() { ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }
		for _ in $(seq 100); do
			p=$((20000 + RANDOM % 10000))
			if port_free "$p" && port_free $((p + 1)); then ETCD_PORT=$p; break; fi
		done
		[ -n "$ETCD_PORT" ] || die "no free loopback port pair found"
	fi
	ETCD_URL=http://127.0.0.1:$ETCD_PORT
	log "starting etcd on $ETCD_URL"
	start_etcd latency "$WORK" "$ETCD_PORT"
	etcdctl --endpoints "$ETCD_URL" endpoint health >/dev/null 2>&1 || die "etcd not healthy; see $WORK/etcd.log"
	FIO_BYTES=$(numfmt --from=iec "${FIO_SIZE%B}")
	truncate -s $((FIO_BYTES * 2 + (2 << 30))) "$DEV_IMG"
	"$ETCFS" mkfs --etcd "$ETCD_URL" --device "$DEV_IMG" --prefix "$PREFIX" >"$WORK/mkfs.log" 2>&1 ||
		{ cat "$WORK/mkfs.log" >&2; die "etcfs mkfs failed"; }
fi

# Which server (pid) serves $MNT now; its threads are the "worker" side of the trace.
# start_etcfs TARGET [OPTION...]: uring, devfuse, or uring-nospin (uring with
# --device-spin-us 0: the worker sleeps through every device read instead of spinning).
start_etcfs() {
	local target=$1 transport=$1 served=""
	shift
	local opts=()
	[ "$target" != uring-nospin ] || { transport=uring; opts=(--device-spin-us 0); }
	mount_etcfs "$ETCFS" "$ETCD_URL" "$DEV_IMG" "$PREFIX" "$MNT" "$WORK/daemon-$target.log" \
		--transport "$transport" "${opts[@]}" "$@" || die "mount failed"
	SERVER_PID=${pids[-1]}
	for _ in $(seq 50); do
		served=$("$ETCFS" stats "$MNT" --json 2>/dev/null | grep -o '"transport":"[^"]*"' || true)
		[ -n "$served" ] && break
		sleep 0.1
	done
	[ "$served" = "\"transport\":\"$transport\"" ] || die "etcfs --transport $transport is served by ${served:-?}"
}

start_probe() { start_probe_server "$PROBE/$1"; } # probe | probe-sync

if [[ " $TARGETS " == *" raw "* ]]; then
	log "laying out $FIO_SIZE on the raw file"
	layout "$RAW_FILE"
fi
if [ -n "$ETCD_URL" ]; then
	log "laying out $FIO_SIZE in etcfs"
	start_etcfs uring
	layout "$MNT/fio.dat"
	stop_server
fi

# --- measurements ----------------------------------------------------------------------------

RES=$WORK/results
: >"$RES"
record() { echo "$1 $2" >>"$RES"; }

FIO_ARGS=(--name=randread --rw=randread --bs=4k --iodepth=1 --direct=1 --ioengine="$ENGINE"
	--numjobs=1 --size="$FIO_SIZE" --time_based --ramp_time=1 --randrepeat=1 --norandommap
	--lat_percentiles=1 --output-format=json)

file_of() { # TARGET
	case $1 in
	raw) echo "$RAW_FILE" ;;
	probe*) echo "$MNT/big" ;;
	*) echo "$MNT/fio.dat" ;;
	esac
}

# run_fio TARGET LABEL SECS [COMMAND PREFIX...]: records fio.TARGET.LABEL.{iops,p50,mean,clat}
# (p50 and mean of the latency from submission to completion, and clat p50: a read the
# kernel completes inside the submitting io_uring_enter has its time in fio's slat).
run_fio() {
	local target=$1 label=$2 secs=$3 out=$WORK/fio-$1-$2.json vals iops p50 mean
	shift 3
	[ -z "$FIO_CPU" ] || set -- taskset -c "$FIO_CPU" "$@"
	"$@" fio --filename="$(file_of "$target")" --runtime="$secs" "${FIO_ARGS[@]}" \
		--output="$out" >"$WORK/fio.log" 2>&1 || { cat "$WORK/fio.log" >&2; die "fio ($target, $label) failed"; }
	vals=$(python3 "$PY" fio "$out")
	read -r iops p50 mean clat <<<"$vals"
	log "round $round $target $label: $iops IOPS, lat p50 $p50 µs (clat p50 $clat), mean $mean µs"
	record "fio.$target.$label.iops" "$iops"
	record "fio.$target.$label.p50" "$p50"
	record "fio.$target.$label.mean" "$mean"
	record "fio.$target.$label.clat" "$clat"
}

# The capture: a private ftrace instance. (`perf record -a` was tried first and silently
# lost every event raised while a CPU came out of idle, the device's completion and the
# application's wake-up among them; ftrace's buffer keeps them.) Only what the timeline
# uses: each event costs the traced request some hundreds of ns.
TRACEFS=/sys/kernel/tracing
INST=$TRACEFS/instances/etcfs-latency-$$
EVENTS=(fuse/fuse_request_send fuse/fuse_request_end
	io_uring/io_uring_submit_req io_uring/io_uring_complete io_uring/io_uring_queue_async_work
	sched/sched_switch syscalls/sys_exit_io_uring_enter)
[ -z "$DEVT" ] || EVENTS+=("block/block_rq_issue:dev == $DEVT" "block/block_rq_complete:dev == $DEVT")
[ "$ENGINE" != psync ] || EVENTS+=('syscalls/sys_enter_pread64:comm == "fio"' 'syscalls/sys_exit_pread64:comm == "fio"')
CMDLINES_WAS=""

trace_setup() {
	mkdir "$INST" || die "cannot create the ftrace instance $INST"
	echo 0 >"$INST/tracing_on"
	# TSC cycles, printed as integers: the text output of ns clocks stops at µs. They
	# are turned into ns by two markers written at known CLOCK_MONOTONIC times.
	if grep -qw x86-tsc "$INST/trace_clock"; then
		echo x86-tsc >"$INST/trace_clock"
		CLOCK=x86-tsc
	else
		echo mono >"$INST/trace_clock"
		CLOCK=mono
	fi
	echo 0 >"$INST/options/overwrite" # a full buffer drops new events (counted), never old ones
	echo 131072 >"$INST/buffer_size_kb"
	local ev name filter
	for ev in "${EVENTS[@]}"; do
		name=${ev%%:*}
		filter=""
		[ "$name" = "$ev" ] || filter=${ev#*:}
		[ -e "$INST/events/$name/enable" ] || die "no tracepoint $name in this kernel"
		[ -z "$filter" ] || echo "$filter" >"$INST/events/$name/filter" || die "filter $filter on $name refused"
		echo 1 >"$INST/events/$name/enable"
	done
	# Task names are looked up in a global table when the trace is read: room for every
	# task of a run (restored on exit).
	CMDLINES_WAS=$(cat "$TRACEFS/saved_cmdlines_size")
	echo 8192 >"$TRACEFS/saved_cmdlines_size"
}

mark() { # the marker's TSC time next to CLOCK_MONOTONIC (mean of before and after)
	python3 -c 'import sys, time
a = time.monotonic_ns()
with open(sys.argv[1], "w") as f:
    f.write("latency-mark")
b = time.monotonic_ns()
print((a + b) // 2)' "$INST/trace_marker"
}

traced() { # TARGET KIND: fio with the tracepoints on, then the timeline
	local target=$1 kind=$2 text=$SHM/trace.txt line m1 m2 dropped
	: >"$WORK/tids"
	[ -z "$SERVER_PID" ] || ls "/proc/$SERVER_PID/task" >>"$WORK/tids"
	echo >"$INST/trace"
	echo 1 >"$INST/tracing_on"
	m1=$(mark)
	run_fio "$target" traced "$TRACE_SECS"
	m2=$(mark)
	echo 0 >"$INST/tracing_on"
	# Again after the run: io-wq threads the server started meanwhile.
	[ -z "$SERVER_PID" ] || ls "/proc/$SERVER_PID/task" >>"$WORK/tids"
	dropped=$(cat "$INST"/per_cpu/cpu*/stats | awk '/^dropped events/ {s += $3} END {print s + 0}')
	[ "$dropped" = 0 ] || log "round $round $target: the trace buffer dropped $dropped events"
	record "diag.$target.dropped" "$dropped"
	cat "$INST/trace" >"$text"
	line=$(python3 "$PY" trace "$kind" "$ENGINE" "$WORK/tids" "$target" "$RES" "$CLOCK" "$m1" "$m2" <"$text")
	log "round $round $target trace: $line"
	if [ -n "$KEEP_TRACES" ]; then
		mkdir -p "$KEEP_TRACES"
		cp "$WORK/tids" "$KEEP_TRACES/$target-r$round.tids"
		echo "$CLOCK $m1 $m2" >"$KEEP_TRACES/$target-r$round.marks"
		mv "$text" "$KEEP_TRACES/$target-r$round.trace"
	fi
	rm -f "$text"
	echo >"$INST/trace"
}

perf_pass() { # TARGET
	start_etcfs "$1" --perf
	"$ETCFS" stats "$MNT" --reset >/dev/null
	run_fio "$1" perf "$FIO_SECS"
	"$ETCFS" stats "$MNT" --json >"$WORK/stats.json"
	python3 "$PY" perf "$WORK/stats.json" "$WORK/perf-$1"
	sed "s/^/perf.$1./" "$WORK/perf-$1" >>"$RES"
	rm -f "$WORK/perf-$1"
	stop_server
}

trace_setup
read -r -a TLIST <<<"$TARGETS"
for round in $(seq "$ROUNDS"); do
	n=${#TLIST[@]}
	for k in $(seq 0 $((n - 1))); do
		target=${TLIST[$(((k + round - 1) % n))]}
		case $target in
		raw)
			run_fio raw plain "$FIO_SECS"
			traced raw raw
			;;
		uring | devfuse | uring-nospin)
			start_etcfs "$target"
			run_fio "$target" plain "$FIO_SECS"
			traced "$target" fuse-dev
			stop_server
			perf_pass "$target"
			;;
		probe | probe-sync)
			start_probe "$target"
			run_fio "$target" plain "$FIO_SECS"
			traced "$target" fuse
			stop_server
			;;
		*) die "unknown target $target (raw, uring, uring-nospin, devfuse, probe, probe-sync)" ;;
		esac
	done
done

# --- report ----------------------------------------------------------------------------------

TABLES=$WORK/tables.md
TARGETS="$TARGETS" ENGINE=$ENGINE ROUNDS=$ROUNDS FIO_SIZE=$FIO_SIZE FIO_SECS=$FIO_SECS \
	TRACE_SECS=$TRACE_SECS python3 "$PY" report "$RES" >"$TABLES"
echo
cat "$TABLES"
[ -z "$RESULTS_OUT" ] || cp "$RES" "$RESULTS_OUT"

if [ $WRITE_DOC = 1 ]; then
	DOC=$ROOT/docs/benchmarks.md
	BEGIN_MARK="<!-- benches/latency_budget.sh: begin (generated; edit the script, not this section) -->"
	END_MARK="<!-- benches/latency_budget.sh: end -->"
	SECTION=$WORK/section.md
	cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
	{
		echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
		echo "- machine: $(nproc) CPUs (${cpu:-?}), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, kernel $(uname -r), clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null || echo '?')"
		echo "- etcfs: $SOURCE; \`etcfs mount --transport uring|devfuse --foreground\` with defaults (one worker per CPU, pinned; \`--device-spin-us 100\`, \`--ring-linger-us 80\`); device: a sparse image file on $(findmnt -no FSTYPE -T "$IMGDIR") on $BLOCK_DEV, opened O_DIRECT; raw file: $FIO_SIZE beside it; both laid out by one 1 MiB O_DIRECT write pass"
		echo "- probe: \`fuse_uring_probe MNT\` (ring mode, 2 entries per queue, one pinned thread per CPU), reading its /big (direct_io, 4 KiB copied from memory); \`probe\` built with FUSE_ASYNC_DIO added to its INIT flags (as etcfs negotiates), \`probe-sync\` as shipped"
		echo "- tracing: a private ftrace instance (clock $CLOCK, mapped to CLOCK_MONOTONIC by two markers) with fuse:fuse_request_send/end, io_uring:io_uring_submit_req/complete/queue_async_work, block:block_rq_issue/complete (on $BLOCK_DEV), sched:sched_switch, syscalls:sys_exit_io_uring_enter (and pread64 for psync)"
		echo "- command: \`bash benches/latency_budget.sh${ORIG_ARGS[*]:+ ${ORIG_ARGS[*]}}\`"
		echo
		cat "$TABLES"
	} >"$SECTION"
	python3 "$PY" write-doc "$DOC" "$SECTION" "$BEGIN_MARK" "$END_MARK"
	log "wrote $DOC"
fi
