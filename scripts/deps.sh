#!/usr/bin/env bash
# Installs the Debian packages etcfs builds and tests with, when any is missing.
set -euo pipefail
# gcc/libc6-dev build the tests' syscall helper (tests/common); util-linux has setpriv.
pkgs=(etcd-server etcd-client protobuf-compiler fuse3 fio liburing-dev gcc libc6-dev util-linux acl)
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
# fsx (the File System eXerciser crate) for tests/fsx.rs and scripts/soak-fsx.sh, pinned and
# built once into cargo's bin directory (about 1.5 min on 2 CPUs; then reused).
FSX_VERSION=0.3.2
fsx_bin="${CARGO_HOME:-$HOME/.cargo}/bin/fsx"
if [[ "$("$fsx_bin" --version 2>/dev/null)" != "fsx $FSX_VERSION" ]]; then
    echo "installing fsx $FSX_VERSION"
    cargo install fsx --version "=$FSX_VERSION" --locked --quiet
fi
