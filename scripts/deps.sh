#!/usr/bin/env bash
# Installs the Debian packages etcfs builds and tests with, when any is missing.
set -euo pipefail
pkgs=(etcd-server etcd-client protobuf-compiler fuse3 fio liburing-dev)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# FUSE-over-io_uring is off by default; the daemon turns it on too, but tests check it first.
if [[ -w /sys/module/fuse/parameters/enable_uring ]]; then
    echo Y > /sys/module/fuse/parameters/enable_uring
fi
