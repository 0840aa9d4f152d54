#!/usr/bin/env bash
# Transport benchmark: etcfs's two FUSE transports side by side, on the in-memory filesystem,
# next to the floor (the C probe, a FUSE server that does nothing) and tmpfs.
#
#   1. uncached stat() round trips (entry/attr timeouts 0, so each stat is LOOKUP + GETATTR),
#      1 and 2 client threads (benches/statloop.c): etcfs --transport uring, etcfs --transport
#      devfuse, the C probe in ring mode (the floor) and in classic /dev/fuse mode (-n);
#   2. fio with direct=1: 4 KiB random reads, 1 MiB sequential reads and writes, on etcfs
#      uring, etcfs devfuse and a tmpfs.
#
# Every figure is the median of --runs repetitions (min-max beside it); the servers are
# measured in turn within each repetition so drift hits all of them alike. Prints markdown
# tables; --write-doc also puts them into docs/benchmarks.md between this script's markers.
#
# Needs root and /dev/fuse; turns /sys/module/fuse/parameters/enable_uring on for the run
# (restored afterwards). Installs liburing-dev (for the probe) and fio with apt-get if
# missing; without them the probe column or the fio table says n/a.
#
# usage: benches/transport.sh [--runs R] [--stat-secs S] [--fio-secs S] [--fio-size SIZE]
#                             [--no-stat] [--no-fio] [--write-doc]
set -euo pipefail

RUNS=5
STAT_SECS=3
FIO_SECS=5
FIO_SIZE=512M
DO_STAT=1
DO_FIO=1
WRITE_DOC=0
ORIG_ARGS=("$@")
while [ $# -gt 0 ]; do
	case "$1" in
	--runs) RUNS=$2; shift 2 ;;
	--stat-secs) STAT_SECS=$2; shift 2 ;;
	--fio-secs) FIO_SECS=$2; shift 2 ;;
	--fio-size) FIO_SIZE=$2; shift 2 ;;
	--no-stat) DO_STAT=0; shift ;;
	--no-fio) DO_FIO=0; shift ;;
	--write-doc) WRITE_DOC=1; shift ;;
	-h | --help) sed -n '2,20p' "$0"; exit 0 ;;
	*) echo "transport.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROBE_SRC=${PROBE_SRC:-$ROOT/../shared/reference/probe-src/fuse_uring_probe.c}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
ETCFS=$TARGET_DIR/release/etcfs
URING_PARAM=/sys/module/fuse/parameters/enable_uring

log() { echo "[transport.sh] $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mount(2) and $URING_PARAM)"
[ -e /dev/fuse ] || die "needs /dev/fuse"

WORK=$(mktemp -d /tmp/etcfs-transport-bench.XXXXXX)
PIDS=()     # every process started here, stopped by pid on exit
MOUNTS=()   # every mount made here, unmounted on exit
URING_WAS=""

cleanup() {
	local rc=$?
	set +e
	for pid in "${PIDS[@]}"; do
		kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null
	done
	for pid in "${PIDS[@]}"; do
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
	done
	for m in "${MOUNTS[@]}"; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	for pid in "${PIDS[@]}"; do
		if kill -0 "$pid" 2>/dev/null; then
			log "pid $pid still running; SIGKILL"
			kill -KILL "$pid" 2>/dev/null
		fi
	done
	for m in "${MOUNTS[@]}"; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	if [ -n "$URING_WAS" ] && [ "$URING_WAS" != Y ]; then
		echo "$URING_WAS" >"$URING_PARAM" 2>/dev/null
	fi
	local left=0
	for m in "${MOUNTS[@]}"; do mountpoint -q "$m" 2>/dev/null && left=1; done
	if [ $left = 0 ]; then rm -rf "$WORK"; else log "left $WORK: something is still mounted"; fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- tools -----------------------------------------------------------------------------

apt_install() {
	# Quietly; a failed install leaves the caller to report n/a.
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$WORK/apt.log" 2>&1 && return 0
	DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$WORK/apt.log" 2>&1 || true
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >>"$WORK/apt.log" 2>&1
}

log "building etcfs (release)"
(cd "$ROOT" && cargo build --release --bin etcfs 2>&1 | tail -3) >&2
[ -x "$ETCFS" ] || die "no $ETCFS after cargo build"

gcc -O2 -Wall -pthread "$ROOT/benches/statloop.c" -o "$WORK/statloop" || die "cannot build statloop"

PROBE=""
PROBE_NOTE=""
if [ ! -f "$PROBE_SRC" ]; then
	PROBE_NOTE="probe source not found at $PROBE_SRC"
else
	if [ ! -e /usr/include/liburing.h ]; then
		log "installing liburing-dev for the C probe"
		apt_install liburing-dev || true
	fi
	if gcc -O2 -pthread "$PROBE_SRC" -o "$WORK/fuse_uring_probe" -luring >"$WORK/probe-build.log" 2>&1; then
		PROBE=$WORK/fuse_uring_probe
	else
		PROBE_NOTE="the C probe did not build (liburing-dev missing?): $(grep -m1 error "$WORK/probe-build.log")"
	fi
fi
[ -n "$PROBE_NOTE" ] && log "$PROBE_NOTE; its columns are n/a"

FIO_NOTE=""
if [ $DO_FIO = 1 ] && ! command -v fio >/dev/null; then
	log "installing fio"
	apt_install fio || FIO_NOTE="fio is not installed and apt-get install fio failed"
fi

if [ -e "$URING_PARAM" ]; then
	URING_WAS=$(cat "$URING_PARAM")
	[ "$URING_WAS" = Y ] || echo Y >"$URING_PARAM" || die "cannot turn on $URING_PARAM"
else
	die "this kernel has no FUSE-over-io_uring ($URING_PARAM missing)"
fi

# --- servers -----------------------------------------------------------------------------

wait_mounted() { # MNT PID LOG
	for _ in $(seq 200); do
		mountpoint -q "$1" && return 0
		kill -0 "$2" 2>/dev/null || { cat "$3" >&2; die "server for $1 exited before mounting"; }
		sleep 0.05
	done
	cat "$3" >&2
	die "$1 not mounted within 10 s"
}

# start_etcfs NAME TRANSPORT: mounts etcfs --memfs on $WORK/NAME with timeouts 0.
start_etcfs() {
	local mnt=$WORK/$1 log=$WORK/$1.log
	mkdir -p "$mnt"
	"$ETCFS" mount --memfs --foreground --transport "$2" --attr-timeout 0 --entry-timeout 0 \
		"$mnt" >"$log" 2>&1 &
	PIDS+=($!)
	MOUNTS+=("$mnt")
	wait_mounted "$mnt" $! "$log"
	local served=""
	for _ in $(seq 50); do
		served=$("$ETCFS" stats "$mnt" --json 2>/dev/null | grep -o '"transport":"[^"]*"' || true)
		[ -n "$served" ] && break
		sleep 0.1
	done
	case "$served" in
	"\"transport\":\"$2\"") ;;
	*) die "etcfs --transport $2 on $mnt is served by ${served:-?}" ;;
	esac
	printf 'Hello World!\n' >"$mnt/hello"
}

# start_probe NAME [FLAGS]: mounts the C probe on $WORK/NAME.
start_probe() {
	local mnt=$WORK/$1 log=$WORK/$1.log
	mkdir -p "$mnt"
	shift
	"$PROBE" "$@" "$mnt" >"$log" 2>&1 &
	PIDS+=($!)
	MOUNTS+=("$mnt")
	wait_mounted "$mnt" $! "$log"
	for _ in $(seq 100); do grep -q READY "$log" && return 0; sleep 0.05; done
	die "probe on $mnt never said READY"
}

# stop_server NAME PID: unmounts and waits for the server to exit.
stop_server() {
	local mnt=$WORK/$1
	mountpoint -q "$mnt" && umount "$mnt"
	for _ in $(seq 100); do kill -0 "$2" 2>/dev/null || break; sleep 0.1; done
	kill -0 "$2" 2>/dev/null && die "server $1 (pid $2) did not exit after umount"
	wait "$2" 2>/dev/null || log "server $1 exited with $?"
}

# --- measurements --------------------------------------------------------------------------
# Results go to $WORK/results as lines "KEY VALUE"; medians are taken at the end.

RES=$WORK/results
: >"$RES"
record() { echo "$1 $2" >>"$RES"; }

kv() { # KEY LINE -> value of KEY=... in LINE
	tr ' ' '\n' <<<"$2" | sed -n "s/^$1=//p"
}

# Requests an etcfs daemon has served so far (the sum of its requests_per_core).
etcfs_requests() {
	"$ETCFS" stats "$1" --json | grep -o '"requests_per_core":\[[0-9,]*\]' |
		grep -o '[0-9][0-9]*' | awk '{s += $1} END {print s + 0}'
}

STAT_SERVERS=(etcfs-uring etcfs-devfuse)
[ -n "$PROBE" ] && STAT_SERVERS+=(probe-ring probe-classic)

if [ $DO_STAT = 1 ]; then
	log "stat: starting servers"
	start_etcfs etcfs-uring uring
	start_etcfs etcfs-devfuse devfuse
	if [ -n "$PROBE" ]; then
		start_probe probe-ring
		start_probe probe-classic -n
	fi
	for run in $(seq "$RUNS"); do
		for s in "${STAT_SERVERS[@]}"; do
			for t in 1 2; do
				before=""
				[[ $s == etcfs-* ]] && before=$(etcfs_requests "$WORK/$s")
				line=$("$WORK/statloop" -t "$t" -d "$STAT_SECS" "$WORK/$s/hello") ||
					die "statloop on $s failed: $line"
				log "stat run $run/$RUNS $s threads=$t: $line"
				record "stat.$s.t$t.ops" "$(kv ops_per_s "$line")"
				record "stat.$s.t$t.p50" "$(kv p50_us "$line")"
				calls=$(kv calls "$line")
				echo "$calls" >>"$WORK/$s.calls"
				if [ -n "$before" ]; then
					after=$(etcfs_requests "$WORK/$s")
					record "stat.$s.rps" "$(awk -v a="$after" -v b="$before" -v c="$calls" 'BEGIN{printf "%.2f", (a - b) / c}')"
				fi
			done
		done
	done
	# Stop in the order started; record how the probe's requests travelled.
	i=0
	for s in "${STAT_SERVERS[@]}"; do
		stop_server "$s" "${PIDS[$i]}"
		i=$((i + 1))
	done
	PROBE_PATHS=""
	if [ -n "$PROBE" ]; then
		PROBE_PATHS="probe ring mode: $(grep -o 'requests via.*' "$WORK/probe-ring.log" | tail -1); classic mode: $(grep -o 'requests via.*' "$WORK/probe-classic.log" | tail -1)"
		log "$PROBE_PATHS"
		# The probe counts the requests it served over its whole life (a handful besides the
		# stat loops): per stat, over all runs.
		for s in probe-ring probe-classic; do
			reqs=$(grep -o 'requests via ring=[0-9]* via /dev/fuse read=[0-9]*' "$WORK/$s.log" |
				tail -1 | grep -o '[0-9][0-9]*' | awk '{s += $1} END {print s + 0}')
			calls=$(awk '{s += $1} END {print s + 0}' "$WORK/$s.calls")
			[ "$calls" -gt 0 ] && record "stat.$s.rps" "$(awk -v r="$reqs" -v c="$calls" 'BEGIN{printf "%.2f", r / c}')"
		done
	fi
fi

FIO_TARGETS=(etcfs-uring etcfs-devfuse tmpfs)
# name rw bs numjobs
FIO_JOBS=("randread4k randread 4k 1" "read1m read 1m 1" "write1m write 1m 1")

if [ $DO_FIO = 1 ] && [ -z "$FIO_NOTE" ]; then
	log "fio: starting servers"
	start_etcfs fio-etcfs-uring uring
	start_etcfs fio-etcfs-devfuse devfuse
	mkdir -p "$WORK/fio-tmpfs"
	mount -t tmpfs -o size=2g etcfs-bench "$WORK/fio-tmpfs"
	MOUNTS+=("$WORK/fio-tmpfs")
	for target in "${FIO_TARGETS[@]}"; do
		# Lay the file out once, unmeasured, so reads find data and writes overwrite.
		fio --name=layout --filename="$WORK/fio-$target/fio.dat" --size="$FIO_SIZE" --rw=write \
			--bs=1m --direct=1 --ioengine=psync >/dev/null
	done
	for run in $(seq "$RUNS"); do
		for job in "${FIO_JOBS[@]}"; do
			set -- $job
			for target in "${FIO_TARGETS[@]}"; do
				out=$(fio --name="$1" --filename="$WORK/fio-$target/fio.dat" --size="$FIO_SIZE" \
					--rw="$2" --bs="$3" --numjobs="$4" --group_reporting --direct=1 \
					--ioengine=psync --runtime="$FIO_SECS" --time_based \
					--output-format=terse --terse-version=3)
				# terse v3: read bw KiB/s $7, iops $8, clat p50 $24; write bw $48, iops $49, p50 $65
				if [ "$2" = write ]; then
					vals=$(awk -F';' '{split($65, p, "="); print $48, $49, p[2]}' <<<"$out")
				else
					vals=$(awk -F';' '{split($24, p, "="); print $7, $8, p[2]}' <<<"$out")
				fi
				read -r bw iops p50 <<<"$vals"
				log "fio run $run/$RUNS $1 $target: ${bw} KiB/s, ${iops} IOPS, p50 ${p50} us"
				record "fio.$1.$target.mibs" "$(awk -v b="$bw" 'BEGIN{printf "%.1f", b/1024}')"
				record "fio.$1.$target.iops" "$iops"
				record "fio.$1.$target.p50" "$p50"
			done
		done
	done
	stop_server fio-etcfs-uring "${PIDS[-2]}"
	stop_server fio-etcfs-devfuse "${PIDS[-1]}"
	umount "$WORK/fio-tmpfs"
fi

# --- report ----------------------------------------------------------------------------------

med() { # KEY -> median (lower middle for an even count), or empty
	awk -v k="$1" '$1 == k {print $2}' "$RES" | sort -g | awk '{v[NR] = $1} END {if (NR) print v[int((NR + 1) / 2)]}'
}
rng() { # KEY -> "min-max"
	awk -v k="$1" '$1 == k {print $2}' "$RES" | sort -g | awk '{v[NR] = $1} END {if (NR > 1) printf "%s-%s", v[1], v[NR]}'
}
cell() { # KEY [DECIMALS] -> "median (min-max)" or n/a
	local m r d=${2:-0}
	m=$(med "$1")
	[ -z "$m" ] && { echo "n/a"; return; }
	r=$(rng "$1")
	m=$(awk -v x="$m" -v d="$d" 'BEGIN{printf "%.*f", d, x}')
	if [ -n "$r" ]; then
		r=$(awk -v r="$r" -v d="$d" 'BEGIN{split(r, a, "-"); printf "%.*f-%.*f", d, a[1], d, a[2]}')
		echo "$m ($r)"
	else
		echo "$m"
	fi
}
ratio() { # KEY_A KEY_B -> median(A)/median(B) with 2 decimals, or n/a
	local a b
	a=$(med "$1"); b=$(med "$2")
	if [ -z "$a" ] || [ -z "$b" ]; then echo "n/a"; return; fi
	awk -v a="$a" -v b="$b" 'BEGIN{ if (b == 0) print "n/a"; else printf "%.2fx", a / b }'
}

TABLES=$WORK/tables.md
{
	if [ $DO_STAT = 1 ]; then
		echo "### Uncached stat() round trips (entry/attr timeouts 0, so every call reaches the server)"
		echo
		echo "| client threads | metric | etcfs uring | etcfs devfuse | C probe ring (floor) | C probe classic | uring / floor | uring / devfuse |"
		echo "|---|---|---|---|---|---|---|---|"
		for t in 1 2; do
			echo "| $t | stat/s | $(cell stat.etcfs-uring.t$t.ops) | $(cell stat.etcfs-devfuse.t$t.ops) | $(cell stat.probe-ring.t$t.ops) | $(cell stat.probe-classic.t$t.ops) | $(ratio stat.etcfs-uring.t$t.ops stat.probe-ring.t$t.ops) | $(ratio stat.etcfs-uring.t$t.ops stat.etcfs-devfuse.t$t.ops) |"
			echo "| $t | p50 µs | $(cell stat.etcfs-uring.t$t.p50 1) | $(cell stat.etcfs-devfuse.t$t.p50 1) | $(cell stat.probe-ring.t$t.p50 1) | $(cell stat.probe-classic.t$t.p50 1) | $(ratio stat.etcfs-uring.t$t.p50 stat.probe-ring.t$t.p50) | $(ratio stat.etcfs-uring.t$t.p50 stat.etcfs-devfuse.t$t.p50) |"
			for s in etcfs-uring etcfs-devfuse probe-ring probe-classic; do
				r=$(med stat.$s.rps); o=$(med stat.$s.t$t.ops)
				[ -n "$r" ] && [ -n "$o" ] && record "stat.$s.t$t.reqs" "$(awk -v r="$r" -v o="$o" 'BEGIN{printf "%.0f", r * o}')"
			done
			echo "| $t | FUSE requests/s (stat/s × requests per stat) | $(cell stat.etcfs-uring.t$t.reqs) | $(cell stat.etcfs-devfuse.t$t.reqs) | $(cell stat.probe-ring.t$t.reqs) | $(cell stat.probe-classic.t$t.reqs) | $(ratio stat.etcfs-uring.t$t.reqs stat.probe-ring.t$t.reqs) | $(ratio stat.etcfs-uring.t$t.reqs stat.etcfs-devfuse.t$t.reqs) |"
		done
		echo "| all | FUSE requests per stat | $(cell stat.etcfs-uring.rps 2) | $(cell stat.etcfs-devfuse.rps 2) | $(cell stat.probe-ring.rps 2) | $(cell stat.probe-classic.rps 2) | | |"
		echo
		echo "Goal: etcfs uring p50 within 1.2x of the floor, and ahead of devfuse (stat/s ratio > 1, p50 ratio < 1)."
		[ -n "$PROBE_NOTE" ] && echo "C probe: n/a — $PROBE_NOTE."
		[ -n "${PROBE_PATHS:-}" ] && echo "Check: $PROBE_PATHS."
		echo
	fi
	if [ $DO_FIO = 1 ]; then
		echo "### fio, direct=1, psync, 1 job, ${FIO_SIZE} file, ${FIO_SECS} s per run"
		echo
		if [ -n "$FIO_NOTE" ]; then
			echo "n/a — $FIO_NOTE."
		else
			echo "| workload | metric | etcfs uring | etcfs devfuse | tmpfs | uring / tmpfs | devfuse / tmpfs | uring / devfuse |"
			echo "|---|---|---|---|---|---|---|---|"
			for job in "${FIO_JOBS[@]}"; do
				set -- $job
				case $1 in
				randread4k) label="4 KiB random read"; metric=iops; unit="IOPS"; d=0 ;;
				read1m) label="1 MiB sequential read"; metric=mibs; unit="MiB/s"; d=0 ;;
				write1m) label="1 MiB sequential write"; metric=mibs; unit="MiB/s"; d=0 ;;
				esac
				echo "| $label | $unit | $(cell fio.$1.etcfs-uring.$metric $d) | $(cell fio.$1.etcfs-devfuse.$metric $d) | $(cell fio.$1.tmpfs.$metric $d) | $(ratio fio.$1.etcfs-uring.$metric fio.$1.tmpfs.$metric) | $(ratio fio.$1.etcfs-devfuse.$metric fio.$1.tmpfs.$metric) | $(ratio fio.$1.etcfs-uring.$metric fio.$1.etcfs-devfuse.$metric) |"
				echo "| $label | clat p50 µs | $(cell fio.$1.etcfs-uring.p50) | $(cell fio.$1.etcfs-devfuse.p50) | $(cell fio.$1.tmpfs.p50) | $(ratio fio.$1.etcfs-uring.p50 fio.$1.tmpfs.p50) | $(ratio fio.$1.etcfs-devfuse.p50 fio.$1.tmpfs.p50) | $(ratio fio.$1.etcfs-uring.p50 fio.$1.etcfs-devfuse.p50) |"
			done
		fi
		echo
	fi
	echo "Cells: median of $RUNS runs (min-max)."
} >"$TABLES"

cat "$TABLES"

if [ $WRITE_DOC = 1 ]; then
	DOC=$ROOT/docs/benchmarks.md
	BEGIN_MARK="<!-- benches/transport.sh: begin (generated; edit the script, not this section) -->"
	END_MARK="<!-- benches/transport.sh: end -->"
	SECTION=$WORK/section.md
	{
		echo "$BEGIN_MARK"
		echo "## Transport: etcfs uring vs devfuse vs the floor"
		echo
		echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
		echo "- machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, kernel $(uname -r)"
		echo "- etcfs: $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?')$(cd "$ROOT" && git diff --quiet HEAD -- src fusedev uring perf 2>/dev/null || echo ' (with uncommitted changes)'), \`etcfs mount --memfs --foreground --transport T --attr-timeout 0 --entry-timeout 0\`, default workers (one per CPU) and ring/read depths"
		echo "- floor: \`fuse_uring_probe\` from shared/reference/probe-src (ring: 2 entries per queue; classic: \`-n\`, 2 reader threads); its /hello with timeouts 0"
		echo "- command: \`bash benches/transport.sh${ORIG_ARGS[*]:+ ${ORIG_ARGS[*]}}\`"
		echo
		cat "$TABLES"
		echo "$END_MARK"
	} >"$SECTION"
	mkdir -p "$(dirname "$DOC")"
	if [ -f "$DOC" ] && grep -qF "$BEGIN_MARK" "$DOC" && grep -qF "$END_MARK" "$DOC"; then
		awk -v b="$BEGIN_MARK" -v e="$END_MARK" -v s="$SECTION" '
			$0 == b { while ((getline l < s) > 0) print l; skip = 1; next }
			$0 == e { skip = 0; next }
			!skip' "$DOC" >"$WORK/doc.new"
		cp "$WORK/doc.new" "$DOC"
	else
		if [ ! -f "$DOC" ]; then
			printf '# Benchmarks\n\nFigures measured on the project machine; each section says how it was produced and is\nregenerated by the command it names.\n\n' >"$DOC"
		else
			echo >>"$DOC"
		fi
		cat "$SECTION" >>"$DOC"
	fi
	log "wrote $DOC"
fi
