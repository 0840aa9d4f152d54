#!/usr/bin/env bash
# Builds etcfs in release mode and installs it (Debian 12, as root):
#   /usr/local/bin/etcfs                               the daemon and command-line tool
#   /sbin/mount.etcfs -> /usr/local/bin/etcfs          `mount -t etcfs` and fstab lines
#   /usr/local/lib/systemd/system/etcfs@.service       one mount per unit instance
#   /usr/local/share/man/man1/etcfs*.1, man8/mount.etcfs.8   manual pages, from clap
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release --locked
install -m 0755 target/release/etcfs /usr/local/bin/etcfs
# mount(8) looks for helpers in /sbin, /sbin/fs.d and /sbin/fs only; the binary answers as
# the helper when called by that name.
ln -sfn /usr/local/bin/etcfs /sbin/mount.etcfs
install -D -m 0644 dist/etcfs@.service /usr/local/lib/systemd/system/etcfs@.service
/usr/local/bin/etcfs man /usr/local/share/man
if [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
fi
if command -v mandb >/dev/null; then
    mandb -q 2>/dev/null || true
fi
echo "installed /usr/local/bin/etcfs, /sbin/mount.etcfs, etcfs@.service and the manual pages"
