#!/usr/bin/env bash
# Builds etcfs in release mode and installs it (Debian 12, as root):
#   /usr/local/bin/etcfs                            the daemon and command-line tool
#   /sbin/mount.etcfs -> /usr/local/bin/etcfs       `mount -t etcfs` and fstab lines
#   /usr/local/lib/systemd/system/etcfs@.service    one mount per unit instance
#   /usr/local/share/man/man1/etcfs*.1, man8/mount.etcfs.8   manual pages, from clap
# DESTDIR=DIR installs under DIR instead of / (staging, packaging), touching nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${DESTDIR:-}"
bin=/usr/local/bin/etcfs
scripts/deps.sh
cargo build --release --locked
install -D -m 0755 target/release/etcfs "$dest$bin"
# mount(8) looks for helpers in /sbin, /sbin/fs.d and /sbin/fs only; the binary answers as
# the helper when called by that name.
mkdir -p "$dest/sbin"
ln -sfn "$bin" "$dest/sbin/mount.etcfs"
install -D -m 0644 dist/etcfs@.service "$dest/usr/local/lib/systemd/system/etcfs@.service"
target/release/etcfs man "$dest/usr/local/share/man"
if [[ -z "$dest" ]]; then
    if [[ -d /run/systemd/system ]]; then
        systemctl daemon-reload
    fi
    if command -v mandb >/dev/null; then
        mandb -q 2>/dev/null || true
    fi
fi
echo "installed $dest$bin, $dest/sbin/mount.etcfs, etcfs@.service and the manual pages"
