#!/usr/bin/env python3
"""Latency of the metadata calls around short-lived files and attribute changes, as a
database's rollback journal, a build's temporary files or `tar x` / `rsync -a` make them.

usage: file_cycles.py DIR [N]
Jobs, N operations each, in DIR (emptied first):
  tmpfile      create, write 4 KiB, fsync, close, unlink: the whole cycle
  unlink       the unlink of that cycle alone (the file closed a moment before)
  fsyncdir     fsync of the directory right after a create in it (a journaling database
               does it to make its new journal's name durable)
  chmod        chmod of one of 16 existing files, mode alternating
  utime        utime (atime and mtime) of one of them
  chown-same   chown to the owner it has (SQLite does it to each journal as root)
Prints "<job> <p50 us> <p90 us>" per job.
"""
import os
import sys
import time


def pct(t):
    t.sort()
    return t[len(t) // 2] / 1000, t[len(t) * 9 // 10] / 1000


def main():
    d = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    block = os.urandom(4096)
    cycle, unlink, fsyncdir = [], [], []
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    for i in range(n):
        path = os.path.join(d, f"tmp{i}")
        t0 = time.perf_counter_ns()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, block)
        os.fsync(fd)
        os.close(fd)
        t1 = time.perf_counter_ns()
        os.unlink(path)
        t2 = time.perf_counter_ns()
        cycle.append(t2 - t0)
        unlink.append(t2 - t1)
    for i in range(n):
        os.close(os.open(os.path.join(d, f"new{i}"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
        t0 = time.perf_counter_ns()
        os.fsync(dfd)
        fsyncdir.append(time.perf_counter_ns() - t0)
    os.close(dfd)
    for i in range(n):
        os.unlink(os.path.join(d, f"new{i}"))
    files = [os.path.join(d, f"f{i}") for i in range(16)]
    for p in files:
        with open(p, "wb") as f:
            f.write(block)
    st = os.stat(files[0])
    ops = {
        "chmod": lambda i, p: os.chmod(p, 0o600 if i % 2 else 0o640),
        "utime": lambda i, p: os.utime(p, (1_000_000 + i, 1_000_000 + i)),
        "chown-same": lambda i, p: os.chown(p, st.st_uid, st.st_gid),
    }
    results = {"tmpfile": pct(cycle), "unlink": pct(unlink), "fsyncdir": pct(fsyncdir)}
    for name, op in ops.items():
        t = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            op(i, files[i % len(files)])
            t.append(time.perf_counter_ns() - t0)
        results[name] = pct(t)
    for p in files:
        os.unlink(p)
    for name, (p50, p90) in results.items():
        print(f"{name} {p50:.1f} {p90:.1f}")


if __name__ == "__main__":
    main()
