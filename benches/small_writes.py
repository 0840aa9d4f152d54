#!/usr/bin/env python3
"""Latency of small buffered pwrite(2)s into a file already written, as a database's log
writes them (no fsync: the write alone).

usage: small_writes.py FILE [N]
Lays out 1 MiB in FILE (written and fsynced), then N writes per job, offsets stepping
through the file and wrapping:
  aligned-4k    4 KiB at block-aligned offsets
  24b-4-a-block 24 bytes, four per 4 KiB block (three of four into the block the write
                before touched)
  24b-per-block 24 bytes stepping 4 KiB + 24, each into a block not written just before
  wal-frame     a 24-byte header, then 4 KiB right after it, stepping 4 KiB + 24 (SQLite's
                WAL frame: both unaligned)
Prints "<job> <p50 us> <p90 us>" per job (for wal-frame, per frame).
"""
import os
import sys
import time

SPAN = 1 << 20


def job(fd, writes, n):
    t = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        for off, buf in writes(i):
            os.pwrite(fd, buf, off % (SPAN - 8192))
        t.append(time.perf_counter_ns() - t0)
    t.sort()
    return t[len(t) // 2] / 1000, t[len(t) * 9 // 10] / 1000


def main():
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 0)
    os.pwrite(fd, os.urandom(SPAN), 0)
    os.fsync(fd)
    page, small = os.urandom(4096), os.urandom(24)
    jobs = {
        "aligned-4k": lambda i: [(i * 4096, page)],
        "24b-4-a-block": lambda i: [(i * 1024, small)],
        "24b-per-block": lambda i: [(i * 4120, small)],
        "wal-frame": lambda i: [(32 + i * 4120, small), (56 + i * 4120, page)],
    }
    for name, writes in jobs.items():
        p50, p90 = job(fd, writes, n)
        print(f"{name} {p50:.1f} {p90:.1f}")
    os.close(fd)


if __name__ == "__main__":
    main()
