#!/usr/bin/env bash
# Runs every test of etcfs against real parts: a private etcd on loopback, real FUSE mounts
# (as root, both transports). Installs what it needs first (Debian 12, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh

etcd_dir=$(mktemp -d /tmp/etcfs-test-etcd.XXXXXX)
etcd_pid=
cleanup() {
    if [[ -n "$etcd_pid" ]]; then
        kill "$etcd_pid" 2>/dev/null || true
        wait "$etcd_pid" 2>/dev/null || true
    fi
    rm -rf "$etcd_dir"
}
trap cleanup EXIT
if [[ -z "${ETCD_ENDPOINTS:-}" ]]; then
    port=${ETCFS_TEST_ETCD_PORT:-23379}
    etcd --name etcfs-test --data-dir "$etcd_dir/data" \
        --listen-client-urls "http://127.0.0.1:$port" \
        --advertise-client-urls "http://127.0.0.1:$port" \
        --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
        --initial-cluster "etcfs-test=http://127.0.0.1:$((port + 1))" \
        >"$etcd_dir/etcd.log" 2>&1 &
    etcd_pid=$!
    export ETCD_ENDPOINTS="http://127.0.0.1:$port"
    for _ in $(seq 100); do
        etcdctl --endpoints "$ETCD_ENDPOINTS" endpoint health >/dev/null 2>&1 && break
        sleep 0.1
    done
    etcdctl --endpoints "$ETCD_ENDPOINTS" endpoint health
fi
# As root with /dev/fuse the mount tests must run, not skip.
if [[ $(id -u) == 0 && -e /dev/fuse ]]; then
    export ETCFS_REQUIRE_MOUNT_TESTS=1
fi
cargo test --release --workspace --locked -- --test-threads=2
