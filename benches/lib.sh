# Shared by the benchmark scripts (sourced, not run).

# start_etcd NAME DIR PORT: a private one-member etcd on loopback, client port PORT and
# peer port PORT+1, data under DIR; sets ETCD_PID (for the caller's cleanup) and returns
# once it answers, or after 10 s with a warning (the next etcfs command then says why).
start_etcd() {
	local name=$1 dir=$2 port=$3
	local ep=http://127.0.0.1:$port peer=http://127.0.0.1:$((port + 1))
	etcd --name "$name" --data-dir "$dir/etcd" --listen-client-urls "$ep" \
		--advertise-client-urls "$ep" --listen-peer-urls "$peer" \
		--initial-advertise-peer-urls "$peer" --initial-cluster "$name=$peer" \
		>"$dir/etcd.log" 2>&1 &
	ETCD_PID=$!
	for _ in $(seq 100); do
		etcdctl --endpoints "$ep" endpoint health >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	echo "etcd on port $port did not answer within 10 s; see $dir/etcd.log" >&2
}

# compact_etcd EP: compacts etcd's history up to its current revision and waits for it
# (`--physical`), as an operator's periodic compaction would (README, "Running etcd").
# Until then etcd keeps every key etcfs deleted (locks given back, commit markers) in its
# index and walks it in every range read and compare over its span: creating many files
# and restarting the daemon for each cold run leave hours of a steady node's churn in
# minutes (a cold `ls -l` of 5,000 files in listing.sh took 0.91 s uncompacted,
# 0.31 s compacted: docs/benchmarks.md, "Seventh round").
compact_etcd() {
	local rev
	rev=$(ETCDCTL_API=3 etcdctl --endpoints "$1" endpoint status -w json |
		python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["Status"]["header"]["revision"])')
	ETCDCTL_API=3 etcdctl --endpoints "$1" --command-timeout 120s compact --physical "$rev" >/dev/null
}

# mount_etcfs ETCFS EP IMG PREFIX MNT LOG [OPTION...]: one node, `etcfs mount --foreground`
# in the background (its pid appended to the caller's `pids` array, for its cleanup),
# returning once MNT is mounted and the daemon answers `etcfs stats` (its control socket
# and ring queues come up just after the kernel mount: a run timed or a `stats --reset`
# sent before then raced them), or failing after 20 s with the log's path.
mount_etcfs() {
	local etcfs=$1 ep=$2 img=$3 prefix=$4 mnt=$5 log=$6
	shift 6
	mkdir -p "$mnt"
	"$etcfs" mount --foreground --etcd "$ep" --device "$img" --prefix "$prefix" "$@" "$mnt" \
		>"$log" 2>&1 &
	pids+=($!)
	for _ in $(seq 200); do
		mountpoint -q "$mnt" && "$etcfs" stats "$mnt" >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	echo "etcfs did not mount $mnt (or does not answer etcfs stats) within 20 s; see $log" >&2
	return 1
}

# stop_started: ends, for the caller's cleanup trap, what it started with mount_etcfs
# (its `pids`, daemons first) and start_etcd (ETCD_PID, if set), waiting for each.
stop_started() {
	local p
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
	if [ -n "${ETCD_PID:-}" ]; then kill "$ETCD_PID" 2>/dev/null || true; wait "$ETCD_PID" 2>/dev/null || true; fi
}

# need COMMAND PACKAGE: installs PACKAGE with apt-get when COMMAND is missing (once more
# after an apt-get update). Uses the caller's log, die and WORK (apt's output goes to
# $WORK/apt.log).
need() { # COMMAND PACKAGE
	command -v "$1" >/dev/null && return 0
	log "installing $2"
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y -q "$2" >>"$WORK/apt.log" 2>&1 ||
		{ apt-get update -q >>"$WORK/apt.log" 2>&1 && apt-get install -y -q "$2" >>"$WORK/apt.log" 2>&1; } ||
		die "cannot install $2 (see $WORK/apt.log)"
}

# median: the median of the numbers on stdin, one per line.
median() { sort -n | awk '{a[NR] = $1} END {if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

# build_probe SRC DIR: builds the do-nothing FUSE server (shared/reference/probe-src/
# fuse_uring_probe.c) twice into DIR: DIR/probe-sync as shipped, and DIR/probe asking for
# FUSE_ASYNC_DIO as etcfs does (the kernel then sends an O_DIRECT read asynchronously and
# completes it through the application's io_uring, as for etcfs). Installs liburing-dev
# when missing. Uses the caller's log, die and WORK.
build_probe() {
	local src=$1 dir=$2 want='uint64_t want = FUSE_INIT_EXT | FUSE_ASYNC_READ'
	[ -f "$src" ] || die "probe source not found at $src (set PROBE_SRC, or leave the probe out)"
	if [ ! -e /usr/include/liburing.h ]; then
		log "installing liburing-dev (for the probe)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q liburing-dev >>"$WORK/apt.log" 2>&1 ||
			{ apt-get update -q >>"$WORK/apt.log" 2>&1 &&
				DEBIAN_FRONTEND=noninteractive apt-get install -y -q liburing-dev >>"$WORK/apt.log" 2>&1; } ||
			die "cannot install liburing-dev (see $WORK/apt.log)"
	fi
	gcc -O2 -pthread "$src" -o "$dir/probe-sync" -luring >"$dir/probe-build.log" 2>&1 ||
		{ cat "$dir/probe-build.log" >&2; die "the probe did not build"; }
	grep -q "$want" "$src" || die "cannot find the probe's INIT flags ($want) to add FUSE_ASYNC_DIO"
	sed "s/$want/& | FUSE_ASYNC_DIO/" "$src" >"$dir/probe-adio.c"
	gcc -O2 -pthread "$dir/probe-adio.c" -o "$dir/probe" -luring >>"$dir/probe-build.log" 2>&1 ||
		{ cat "$dir/probe-build.log" >&2; die "the probe with FUSE_ASYNC_DIO did not build"; }
}

# start_probe_server BINARY [OPTION...]: the probe mounted on the caller's MNT in the
# background (SERVER_PID), returning once it says READY and MNT is mounted. Uses the
# caller's die and WORK.
start_probe_server() {
	mkdir -p "$MNT"
	"$@" "$MNT" >"$WORK/probe.log" 2>&1 &
	SERVER_PID=$!
	for _ in $(seq 200); do
		grep -q READY "$WORK/probe.log" 2>/dev/null && mountpoint -q "$MNT" && return 0
		kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/probe.log" >&2; die "the probe exited"; }
		sleep 0.05
	done
	die "the probe did not mount within 10 s; see $WORK/probe.log"
}

# stop_server: unmounts the caller's MNT and waits for its server (SERVER_PID) to exit.
stop_server() {
	umount "$MNT" || die "umount $MNT failed"
	for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
	kill -0 "$SERVER_PID" 2>/dev/null && die "server $SERVER_PID did not exit after umount"
	wait "$SERVER_PID" 2>/dev/null || log "server $SERVER_PID exited with $?"
	SERVER_PID=""
}

# layout FILE: writes the caller's FIO_SIZE to FILE in one 1 MiB O_DIRECT pass, so that
# random reads find every block written.
layout() {
	fio --name=layout --filename="$1" --rw=write --bs=1m --iodepth=1 --direct=1 \
		--ioengine=psync --size="$FIO_SIZE" >"$WORK/layout.log" 2>&1 ||
		{ cat "$WORK/layout.log" >&2; die "laying out $1 failed"; }
}

# unmount_started MNT...: unmounts each mountpoint still mounted (lazily if it is busy),
# then ends the daemons the caller started with mount_etcfs and empties `pids`.
unmount_started() {
	local m p
	for m in "$@"; do
		if mountpoint -q "$m" 2>/dev/null; then umount "$m" || umount -l "$m" || true; fi
	done
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
	pids=()
}
