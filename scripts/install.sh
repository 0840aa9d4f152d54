#!/usr/bin/env bash
# Builds etcfs in release mode and installs it as /usr/local/bin/etcfs (Debian 12, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release --locked
install -m 0755 target/release/etcfs /usr/local/bin/etcfs
echo "installed /usr/local/bin/etcfs"
