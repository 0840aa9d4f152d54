#!/usr/bin/env bash
# What a file costs in etcd: database size per file after compaction and defragmentation,
# keys per file and the bytes of those keys and values, for etcfs and for JuiceFS with its
# metadata in etcd. Each system gets a fresh private etcd, so the database holds only it.
#
# Usage: sudo bash benches/etcd_bytes.sh [--files N] [--size BYTES] [--systems "etcfs juicefs"]
#                                        [--etcfs PATH]
# N files (default 100,000) of BYTES each (default 4096: one extent), 1,000 per directory.
# JuiceFS comes from the venv benches/compare/run.sh installs ($JFS_VENV).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"

FILES=100000
SIZE=4096
SYSTEMS="etcfs juicefs"
ETCFS=$ROOT/target/release/etcfs
JFS_VENV=${JFS_VENV:-/var/tmp/etcfs-compare-venv}
PORT=${ETCFS_BENCH_PORT:-24479}
while [ $# -gt 0 ]; do
	case $1 in
	--files) FILES=$2; shift 2 ;;
	--size) SIZE=$2; shift 2 ;;
	--systems) SYSTEMS=$2; shift 2 ;;
	--etcfs) ETCFS=$2; shift 2 ;;
	-h | --help) sed -n 2,9p "$0"; exit 0 ;;
	*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
	esac
done
JFS=$JFS_VENV/bin/juicefs
EP=http://127.0.0.1:$PORT
WORK=$(mktemp -d /var/tmp/etcfs-etcd-bytes.XXXXXX)
pids=()
ETCD_PID=
MNT=
cleanup() {
	if [ -n "$MNT" ] && mountpoint -q "$MNT"; then umount "$MNT" 2>/dev/null || umount -l "$MNT"; fi
	stop_started
	rm -rf "$WORK"
}
trap cleanup EXIT
log() { echo "[etcd_bytes] $*" >&2; }

# compact_and_measure: compacts at the current revision, defragments, prints
# "db_size keys kv_bytes" (the database file, and the live keys with their bytes).
compact_and_measure() {
	local rev
	rev=$(etcdctl --endpoints "$EP" --command-timeout 300s endpoint status -w json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["Status"]["header"]["revision"])')
	etcdctl --endpoints "$EP" --command-timeout 300s compact --physical "$rev" >/dev/null
	etcdctl --endpoints "$EP" --command-timeout 300s defrag >/dev/null
	local db
	db=$(etcdctl --endpoints "$EP" --command-timeout 300s endpoint status -w json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["Status"]["dbSize"])')
	etcdctl --endpoints "$EP" --command-timeout 300s get "" --from-key -w json | python3 -c '
import base64, json, sys
kvs = json.load(sys.stdin).get("kvs", [])
n = sum(len(base64.b64decode(k["key"])) + len(base64.b64decode(k.get("value", ""))) for k in kvs)
print(len(kvs), n)' | { read -r keys bytes; echo "$db $keys $bytes"; }
}

populate() {
	python3 - "$1" "$FILES" "$SIZE" <<'EOF'
import os, sys
root, files, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = b"e" * size
for i in range(files):
    d = os.path.join(root, "d%d" % (i // 1000))
    if i % 1000 == 0:
        os.mkdir(d)
    with open(os.path.join(d, "f%d" % i), "wb") as f:
        f.write(data)
EOF
}

declare -A RESULT
for sys in $SYSTEMS; do
	rm -rf "$WORK/etcd"
	start_etcd bytes "$WORK" "$PORT"
	MNT=$WORK/mnt-$sys
	mkdir -p "$MNT"
	case $sys in
	etcfs)
		truncate -s 64G "$WORK/dev.img"
		"$ETCFS" mkfs --etcd "$EP" --device "$WORK/dev.img" --prefix bytes >/dev/null
		mount_etcfs "$ETCFS" "$EP" "$WORK/dev.img" bytes "$MNT" "$WORK/etcfs.log"
		;;
	juicefs)
		[ -x "$JFS" ] || { log "no $JFS: run benches/compare/run.sh once to install JuiceFS"; continue; }
		"$JFS" format --storage file --bucket "$WORK/jfs-bucket/" --trash-days 0 "etcd://127.0.0.1:$PORT/bytes" bytes >"$WORK/jfs-format.log" 2>&1
		"$JFS" mount --no-usage-report --log "$WORK/jfs.log" --cache-dir "$WORK/jfs-cache" \
			"etcd://127.0.0.1:$PORT/bytes" "$MNT" >"$WORK/jfs-mount.log" 2>&1 &
		pids+=($!)
		for _ in $(seq 200); do mountpoint -q "$MNT" && break; sleep 0.1; done
		;;
	esac
	read -r db0 keys0 bytes0 < <(compact_and_measure)
	log "$sys: creating $FILES files of $SIZE bytes"
	t0=$(date +%s.%N)
	populate "$MNT"
	sync -f "$MNT"
	t1=$(date +%s.%N)
	umount "$MNT"
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	pids=()
	read -r db1 keys1 bytes1 < <(compact_and_measure)
	RESULT[$sys]="$(python3 -c "
f=$FILES
print('%.0f %.2f %.0f %.2f %.0f' % (($db1-$db0)/f, ($keys1-$keys0)/f, ($bytes1-$bytes0)/f, ($db1-$db0)/f*1e6/2**30, f/($t1-$t0)))")"
	kill "$ETCD_PID"; wait "$ETCD_PID" 2>/dev/null || true; ETCD_PID=
	rm -rf "$WORK/dev.img" "$WORK/jfs-bucket" "$WORK/jfs-cache"
done

echo
echo "etcd per file ($FILES files of $SIZE bytes, 1,000 per directory; after compaction and defrag)"
echo
echo "| system | db bytes per file | keys per file | key+value bytes per file | GiB of db per million files | creates/s while filling |"
echo "|---|---|---|---|---|---|"
for sys in $SYSTEMS; do
	[ -n "${RESULT[$sys]:-}" ] || continue
	read -r db keys bytes gib rate <<<"${RESULT[$sys]}"
	echo "| $sys | $db | $keys | $bytes | $gib | $rate |"
done
