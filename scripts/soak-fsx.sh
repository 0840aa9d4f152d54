#!/usr/bin/env bash
# Long fsx runs against a real etcfs mount: a fresh sparse device image and etcd prefix, one
# foreground daemon, then fsx (the `fsx` crate) with several seeds, each on its own file,
# with a remount and read-back check between seeds. CI runs the bounded version
# (tests/fsx.rs); this is the soak. Cleans up everything it made, also on failure or ^C
# (fsx's logs of a failing seed are kept and their path printed).
#
#   scripts/soak-fsx.sh [--ops N] [--duration SECS] [--seeds "S1 S2 ..."]
#                       [--transport auto|uring|devfuse] [--flen BYTES] [--image-gib N]
#
#   --ops N          operations per seed (default 100000; 0 = no limit, use --duration)
#   --duration SECS  stop each seed's run after SECS seconds (a time limit is a pass)
#   --seeds LIST     seeds to run, in order (default "1 2 3")
#   --transport T    FUSE transport of the mount (default auto)
#   --flen BYTES     largest size fsx gives the file (default 16 MiB)
#
# Uses $ETCD_ENDPOINTS when set, otherwise starts a private etcd on loopback
# (port $ETCFS_SOAK_ETCD_PORT, default 25379). Needs root and /dev/fuse.
set -euo pipefail
cd "$(dirname "$0")/.."

ops=100000
duration=
seeds="1 2 3"
transport=auto
flen=$((16 << 20))
image_gib=4
while (($#)); do
    case "$1" in
        --ops) ops=$2; shift 2 ;;
        --duration) duration=$2; shift 2 ;;
        --seeds) seeds=$2; shift 2 ;;
        --transport) transport=$2; shift 2 ;;
        --flen) flen=$2; shift 2 ;;
        --image-gib) image_gib=$2; shift 2 ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "soak-fsx: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ $(id -u) != 0 || ! -e /dev/fuse ]]; then
    echo "soak-fsx: needs root and /dev/fuse" >&2
    exit 1
fi

scripts/deps.sh
cargo build --release --locked --quiet
bin=$PWD/target/release/etcfs
fsx=${FSX:-${CARGO_HOME:-$HOME/.cargo}/bin/fsx}

work=$(mktemp -d /var/tmp/etcfs-soak.XXXXXX)
mnt=$work/mnt
image=$work/device.img
prefix=soak-$$-$(date +%s)
etcd_pid=
daemon_pid=
keep_dir=

stop_daemon() {
    if [[ -n "$daemon_pid" ]]; then
        kill "$daemon_pid" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$daemon_pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$daemon_pid" 2>/dev/null; then
            echo "soak-fsx: daemon $daemon_pid ignored SIGTERM; killing it" >&2
            kill -9 "$daemon_pid" 2>/dev/null || true
        fi
        wait "$daemon_pid" 2>/dev/null || true
        daemon_pid=
    fi
    for _ in 1 2 3; do
        mountpoint -q "$mnt" 2>/dev/null || break
        umount -l "$mnt" || true
    done
}

cleanup() {
    stop_daemon
    if [[ -n "${ETCD_ENDPOINTS:-}" ]]; then
        etcdctl --endpoints "$ETCD_ENDPOINTS" del --prefix "$prefix/" >/dev/null 2>&1 || true
    fi
    if [[ -n "$etcd_pid" ]]; then
        kill "$etcd_pid" 2>/dev/null || true
        wait "$etcd_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
    if [[ -n "$keep_dir" ]]; then
        echo "soak-fsx: fsx logs of the failure kept in $keep_dir"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ -z "${ETCD_ENDPOINTS:-}" ]]; then
    port=${ETCFS_SOAK_ETCD_PORT:-25379}
    etcd --name etcfs-soak --data-dir "$work/etcd" \
        --listen-client-urls "http://127.0.0.1:$port" \
        --advertise-client-urls "http://127.0.0.1:$port" \
        --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
        --initial-cluster "etcfs-soak=http://127.0.0.1:$((port + 1))" \
        >"$work/etcd.log" 2>&1 &
    etcd_pid=$!
    export ETCD_ENDPOINTS="http://127.0.0.1:$port"
    for _ in $(seq 100); do
        etcdctl --endpoints "$ETCD_ENDPOINTS" endpoint health >/dev/null 2>&1 && break
        sleep 0.1
    done
fi

truncate -s "${image_gib}G" "$image"
"$bin" mkfs --etcd "$ETCD_ENDPOINTS" --device "$image" --prefix "$prefix"
mkdir "$mnt"

mount_fs() {
    "$bin" mount --foreground --etcd "$ETCD_ENDPOINTS" --device "$image" --prefix "$prefix" \
        --transport "$transport" "$mnt" >>"$work/daemon.log" 2>&1 &
    daemon_pid=$!
    for _ in $(seq 200); do
        mountpoint -q "$mnt" && return 0
        kill -0 "$daemon_pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "soak-fsx: etcfs did not mount; daemon log:" >&2
    tail -n 50 "$work/daemon.log" >&2
    exit 1
}

cat >"$work/fsx.toml" <<EOF
flen = $flen

[opsize]
max = 262144
min = 0
align = 1

[weights]
close_open = 2
read = 10
write = 10
mapread = 4
mapwrite = 4
invalidate = 1
truncate = 3
fsync = 1
fdatasync = 1
posix_fallocate = 2
punch_hole = 3
sendfile = 1
posix_fadvise = 1
copy_file_range = 2
EOF

mount_fs
echo "soak-fsx: etcfs on $mnt (transport $transport, prefix $prefix), seeds: $seeds," \
    "ops per seed: ${ops/#0/unlimited}${duration:+, at most ${duration}s each}"
start_all=$SECONDS
for seed in $seeds; do
    file=$mnt/fsx.$seed
    artifacts=$work/artifacts.$seed
    mkdir -p "$artifacts"
    args=(-S "$seed" -f "$work/fsx.toml" -P "$artifacts")
    if ((ops > 0)); then
        args+=(-N "$ops")
    fi
    start=$SECONDS
    rc=0
    if [[ -n "$duration" ]]; then
        timeout --signal=TERM "$duration" "$fsx" "${args[@]}" "$file" >"$artifacts/out" 2>&1 || rc=$?
    else
        "$fsx" "${args[@]}" "$file" >"$artifacts/out" 2>&1 || rc=$?
    fi
    if ((rc == 124)); then
        echo "soak-fsx: seed $seed: no failure in ${duration}s (time limit)"
    elif ((rc != 0)); then
        echo "soak-fsx: seed $seed FAILED (exit $rc) after $((SECONDS - start))s; replay:" \
            "fsx ${args[*]} FILE-ON-ETCFS" >&2
        tail -n 60 "$artifacts/out" >&2
        keep_dir=$(mktemp -d /var/tmp/etcfs-soak-failure.XXXXXX)
        cp -r "$artifacts" "$work/fsx.toml" "$work/daemon.log" "$keep_dir/"
        exit 1
    else
        echo "soak-fsx: seed $seed: $ops ops passed in $((SECONDS - start))s"
    fi
    # What fsx left must read back the same after a remount.
    before=$(sha256sum <"$file")
    stop_daemon
    mount_fs
    after=$(sha256sum <"$file")
    if [[ "$before" != "$after" ]]; then
        echo "soak-fsx: seed $seed: the file changed across a remount" >&2
        exit 1
    fi
done
echo "soak-fsx: all seeds passed in $((SECONDS - start_all))s"
