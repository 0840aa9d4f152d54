#!/usr/bin/env bash
# Where the requests of a deep-queue 4 KiB random read sit (issue 17's QD 32 goal): fio
# at queue depth D on an etcfs file and then on a raw file beside the device image, each
# traced for half a second with kernel tracepoints (`perf record -a`: fuse request send
# and end, the workers' io_uring READ submissions and completions, block issue, device
# interrupts). Prints, per round:
#
# - IOPS of both, and the device's interrupts per second and transfers per interrupt (a
#   device that completes in bursts shows many transfers per interrupt);
# - for etcfs, the time from a READ's send to its reply, of its device read, and of two
#   steps around it (the worker's decode and planning up to the device submit; the device
#   completion to the commit of the reply); and, by Little's law (requests in a stage =
#   rate x mean time in it), how the D requests divide between the application (replied,
#   not yet sent again), the daemon outside the device (queued for a worker, planned,
#   answered) and the device.
#
#   benches/qd_trace.sh [--iodepth D] [--rounds R] [--etcfs PATH] [-- MOUNT OPTION...]
#
# A private one-member etcd and a 4 GiB device image under /var/tmp, one node; the files
# are 512 MiB, laid out by a 1 MiB O_DIRECT write pass. Needs root, fio and perf.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/lib.sh

iodepth=32 rounds=2 etcfs=target/release/etcfs
while [ $# -gt 0 ]; do
	case "$1" in
	--iodepth) iodepth="$2"; shift 2 ;;
	--rounds) rounds="$2"; shift 2 ;;
	--etcfs) etcfs="$2"; shift 2 ;;
	--) shift; break ;;
	-h | --help) sed -n '2,20p' "$0"; exit 0 ;;
	*) echo "qd_trace.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ -x "$etcfs" ] || cargo build --release -p etcfs
[ "$(id -u)" = 0 ] || { echo "$0: needs root (FUSE mounts, tracepoints)" >&2; exit 2; }
for c in fio perf; do
	command -v "$c" >/dev/null || { echo "$0: needs $c (apt-get install fio linux-perf)" >&2; exit 2; }
done

work=$(mktemp -d /var/tmp/qd-trace.XXXXXX)
port=$((47000 + RANDOM % 2000))
ep=http://127.0.0.1:$port
ETCD_PID="" pids=()
mnt=$work/etcfs
cleanup() {
	umount "$mnt" 2>/dev/null || true
	stop_started
	rm -rf "$work"
}
trap cleanup EXIT
log() { echo "[qd_trace.sh $(date +%H:%M:%S)] $*" >&2; }

start_etcd qd-trace "$work" "$port"
truncate -s 4G "$work/dev.img"
"$etcfs" mkfs --etcd "$ep" --device "$work/dev.img" --prefix qdt >/dev/null
mount_etcfs "$etcfs" "$ep" "$work/dev.img" qdt "$mnt" "$work/etcfs.log" "$@"
layout() { fio --name=layout --rw=write --bs=1M --direct=1 --ioengine=io_uring --size=512M --filename="$1" >/dev/null; }
log "laying out the files"
layout "$mnt/f"
layout "$work/raw"

# trace NAME FILE EVENTS: fio for 5 s on FILE, traced from its third second for 0.5 s.
trace() {
	local name=$1 file=$2 events=$3
	fio --name=qd --rw=randread --bs=4k --iodepth="$iodepth" --direct=1 --ioengine=io_uring \
		--size=512M --time_based --runtime=5 --randrepeat=1 --norandommap \
		--output-format=terse --terse-version=3 --filename="$file" | cut -d';' -f8 >"$work/$name.iops" &
	local fio_pid=$!
	sleep 2
	perf record -a -e "$events" -o "$work/$name.perf" -- sleep 0.5 >/dev/null 2>&1
	wait "$fio_pid"
	perf script -i "$work/$name.perf" -F comm,time,event,trace 2>/dev/null >"$work/$name.txt"
}

for r in $(seq "$rounds"); do
	log "round $r/$rounds"
	mountpoint -q "$mnt" || { echo "etcfs is no longer mounted; see $work/etcfs.log" >&2; exit 1; }
	trace etcfs "$mnt/f" fuse:fuse_request_send,fuse:fuse_request_end,io_uring:io_uring_submit_req,io_uring:io_uring_complete,block:block_rq_issue,irq:irq_handler_entry
	trace raw "$work/raw" block:block_rq_issue,irq:irq_handler_entry
	python3 - "$work" "$iodepth" "$r" <<'PY'
import re, statistics, sys
work, depth, rnd = sys.argv[1], int(sys.argv[2]), sys.argv[3]
EV = re.compile(r"\s*(\S+)\s+([\d.]+):\s+(\S+):\s*(.*)")

def events(name):
    out = []
    for line in open(f"{work}/{name}.txt"):
        m = EV.match(line)
        if m:
            out.append((m.group(1), float(m.group(2)), m.group(3), m.group(4)))
    return out

def device(ev):
    span = ev[-1][1] - ev[0][1]
    issues = sum(1 for _, _, n, _ in ev if n == "block:block_rq_issue")
    irqs = sum(1 for _, _, n, a in ev if n == "irq:irq_handler_entry" and "req" in a)
    return issues / span, irqs / span, issues / max(irqs, 1)

raw_iops = float(open(f"{work}/raw.iops").read())
etc_iops = float(open(f"{work}/etcfs.iops").read())
ev = events("etcfs")
sent, lifetimes = {}, []
submitted, device_times = {}, []
read_done, answer_times = {}, []
picked_up, pickup_times = {}, []
for comm, t, n, a in ev:
    if n == "fuse:fuse_request_send" and "FUSE_READ" in a:
        sent[re.search(r"req (\d+)", a).group(1)] = t
    elif n == "fuse:fuse_request_end":
        r = re.search(r"req (\d+)", a).group(1)
        if r in sent:
            lifetimes.append(t - sent.pop(r))
    elif n == "io_uring:io_uring_submit_req" and comm.startswith("etcfs-ring"):
        ring, req, data = re.search(r"ring (\S+), req (\S+), user_data (\S+),", a).groups()
        if re.search(r"opcode READ(_FIXED)?,", a):
            submitted[req] = t
            key = (ring, int(data, 16) & 0xFFFFFFFF)
            if key in picked_up:
                pickup_times.append(t - picked_up.pop(key))
        elif "opcode URING_CMD" in a and (ring, int(data, 16)) in read_done:
            answer_times.append(t - read_done.pop((ring, int(data, 16))))
    elif n == "io_uring:io_uring_complete":
        ring, req, data = re.search(r"ring (\S+), req (\S+), user_data (\S+),", a).groups()
        if comm.startswith("etcfs-ring") and int(data, 16) >> 32 == 0:
            # A request reached the worker: its entry's command (tag 0) completed.
            picked_up[(ring, int(data, 16))] = t
        if req in submitted:
            device_times.append(t - submitted.pop(req))
            # The entry's commit carries its index without the device-I/O tag (bit 32).
            read_done[(ring, int(data, 16) & 0xFFFFFFFF)] = t
# Little's law: requests in a stage = completion rate x mean time in the stage.
rate = len(lifetimes) / (ev[-1][1] - ev[0][1])
in_daemon = rate * statistics.mean(lifetimes)
at_device = rate * statistics.mean(device_times)

e_dev, r_dev = device(ev), device(events("raw"))
q = lambda v, p: sorted(v)[int(len(v) * p)] * 1e6
print(f"round {rnd}: QD {depth}")
print("| | raw file | etcfs |")
print("|---|---|---|")
print(f"| IOPS (fio) | {raw_iops:,.0f} | {etc_iops:,.0f} ({etc_iops / raw_iops:.2f}x) |")
print(f"| device interrupts/s | {r_dev[1]:,.0f} | {e_dev[1]:,.0f} |")
print(f"| device transfers per interrupt | {r_dev[2]:.1f} | {e_dev[2]:.1f} |")
print(f"| READ, send to reply: µs p50 / mean | | {q(lifetimes, .5):.0f} / {statistics.mean(lifetimes) * 1e6:.0f} |")
print(f"| its device read, submit to completion: µs p50 / mean | | {q(device_times, .5):.0f} / {statistics.mean(device_times) * 1e6:.0f} |")
print(f"| its time outside the device, µs mean | | {(statistics.mean(lifetimes) - statistics.mean(device_times)) * 1e6:.0f} |")
print(f"| of which from the worker's pickup to the device submit: µs p50 / mean | | {q(pickup_times, .5):.0f} / {statistics.mean(pickup_times) * 1e6:.0f} |")
# An entry passed to another worker commits from that ring, and its slot may be reused
# by an adopted entry, so this pairing is only good for a median.
print(f"| of which from the device completion to the commit: µs p50 | | {q(answer_times, .5):.0f} |")
print(f"| requests in the application (replied, not sent again) | | {depth - in_daemon:.1f} |")
print(f"| requests in the daemon, not at the device | | {in_daemon - at_device:.1f} |")
print(f"| requests at the device | | {at_device:.1f} |")
print()
PY
done
