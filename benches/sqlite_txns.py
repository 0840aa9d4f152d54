#!/usr/bin/env python3
"""SQLite transactions on one database file: the rate a database's commits reach.

usage: sqlite_txns.py DB MODE N [--worker ID] [--init] [--warm W]
  MODE: wal or delete (SQLite's journal modes), synchronous=FULL either way.
  --init: create the database (table t) and exit (the runs create it too).
  --warm W: W transactions first, not timed, on the same connection: past SQLite's
  automatic checkpoint (1,000 pages) a WAL is written again from its start, in place,
  as a long-running database's is; before that every commit appends to it.
  Each transaction inserts one row (key ID * 10**9 + i, 100 random bytes), with
  BEGIN IMMEDIATE so that two processes (or nodes) writing at once wait for each
  other's locks (busy_timeout 60 s) instead of failing.
Prints "<txns> <seconds> <txn/s>".
"""
import os
import sqlite3
import sys
import time


def connect(path, mode):
    c = sqlite3.connect(path, isolation_level=None, timeout=60)
    c.execute(f"pragma journal_mode={mode}")
    c.execute("pragma synchronous=full")
    return c


def main():
    path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    worker = int(sys.argv[sys.argv.index("--worker") + 1]) if "--worker" in sys.argv else 0
    c = connect(path, mode)
    c.execute("create table if not exists t (k integer primary key, v blob)")
    if "--init" in sys.argv:
        return
    warm = int(sys.argv[sys.argv.index("--warm") + 1]) if "--warm" in sys.argv else 0
    for i in range(warm):
        c.execute("begin immediate")
        c.execute("insert into t values (?, ?)", (worker * 10**9 + n + i, os.urandom(100)))
        c.execute("commit")
    t0 = time.monotonic()
    for i in range(n):
        c.execute("begin immediate")
        c.execute("insert into t values (?, ?)", (worker * 10**9 + i, os.urandom(100)))
        c.execute("commit")
    dt = time.monotonic() - t0
    print(n, f"{dt:.3f}", f"{n / dt:.1f}")


if __name__ == "__main__":
    main()
