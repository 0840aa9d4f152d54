#!/usr/bin/env python3
"""Post-processor of benches/latency_budget.sh (issue 17): turns kernel tracepoints of a
QD 1 fio run into a per-request timeline, and the runs of several rounds into the budget.

  latency_budget.py trace KIND ENGINE TIDS_FILE TARGET RESULTS CLOCK M1 M2 < ftrace text
      KIND: raw (no FUSE), fuse-dev (a FUSE server that reads a device), fuse (one that
      does not); ENGINE: io_uring or psync (how the application, fio, reads);
      TIDS_FILE: the server's thread ids, one per line (empty for raw); appends the run's
      stage p50s and counts to RESULTS as "trace.TARGET.STAGE µs" / "diag.TARGET.X N" lines;
      CLOCK: the instance's trace_clock; M1, M2: CLOCK_MONOTONIC ns of its two markers.
  latency_budget.py fio FIO_JSON            -> "iops lat_p50_us lat_mean_us clat_p50_us"
  latency_budget.py perf STATS_JSON OUT     -> the READ op's --perf stages, as KEY VALUE lines
  latency_budget.py report RESULTS          -> the markdown tables (env: see report())
  latency_budget.py write-doc DOC SECTION BEGIN END

How requests are told apart: fio runs one job at queue depth 1, so every event between
two of its submissions belongs to the first one. Within that window the markers are found
in the order a request passes them (each searched after the previous one), and a window
in which one is missing is left out (counted in the report's coverage line).
"""

import bisect
import json
import os
import re
import statistics
import sys

# The opcodes of a worker's device read: READ_FIXED since the workers register their
# payload arena and the device with their rings (99d4d7e); while only READ was looked for,
# no etcfs request was followed to the end.
DEVICE_READ_OPS = ("READ", "READ_FIXED")

# ftrace's text: "comm-pid [cpu] flags timestamp: event: fields"; syscall events print as
# "sys_NAME(args)" and "sys_NAME -> ret".
LINE = re.compile(r"^\s*(.*?)-(\d+)\s+\[(\d+)\]\s+(?:[^\s:]+\s+)?(\d+)(?:\.(\d+))?:\s+(.*)$")
EVENT = re.compile(r"^(\w+):\s?(.*)$")
SYSCALL = re.compile(r"^sys_(\w+)(\(| -> )")
KV = re.compile(r"(\w+)[=: ]\s*(0x[0-9a-f]+|-?\d+|\S+?)(?:,|\s|$)")
FUSE_READ = 15

# (key, label, tracepoint span) in the order a request passes them. The raw file has
# only the rows marked in RAW_ROWS; the do-nothing server has no device rows.
STAGES = [
    ("queue", "the kernel queueing the request",
     "app's `io_uring_submit_req` (psync: `sys_enter_pread64`) → `fuse_request_send`"),
    ("wake", "the worker waking",
     "`fuse_request_send` → `sched_switch` to the worker (0 when it was running)"),
    ("deliver", "request delivered to the worker",
     "→ the request's CQE posted (task work copies the header) and the worker back in user space"),
    ("plan", "decode, handler, planning, device READ queued (user space)",
     "→ the worker's `io_uring_submit_req` READ (do-nothing server: → its reply's submit)"),
    ("dsubmit", "device submission (io_uring → ext4 → block layer)",
     "→ `block_rq_issue` (raw file: app's `io_uring_submit_req` → `block_rq_issue`)"),
    ("device", "the device", "`block_rq_issue` → `block_rq_complete`"),
    ("dseen", "completion seen by the worker",
     "→ `io_uring_complete` of the device READ (interrupt, task work on the worker)"),
    ("reply", "reply built, COMMIT queued and submitted (user space)",
     "→ the worker's next `io_uring_submit_req` (URING_CMD; devfuse: WRITE)"),
    ("commit", "reply committed (kernel copies the data out, ends the request)",
     "→ `fuse_request_end`"),
    ("appwake", "the application waking",
     "→ app's `sys_exit_io_uring_enter` (raw file: from `block_rq_complete`)"),
]
RAW_ROWS = {"dsubmit", "device", "appwake"}


class Clock:
    """Trace timestamps to CLOCK_MONOTONIC ns: x86-tsc cycles through the two markers
    written at known monotonic times; a ns clock printed as seconds.microseconds as is."""

    def __init__(self, kind, m1, m2):
        self.kind, self.m1, self.m2 = kind, int(m1), int(m2)
        self.c1 = self.c2 = None

    def raw(self, sec, frac):
        if frac is None:
            return int(sec)
        return int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])

    def marker(self, raw):
        if self.c1 is None:
            self.c1 = raw
        else:
            self.c2 = raw

    def to_ns(self, raw):
        if self.kind != "x86-tsc":
            return raw
        if self.c1 is None or self.c2 is None or self.c2 == self.c1:
            sys.exit("latency_budget.py: the trace lacks its two clock markers")
        return self.m1 + (raw - self.c1) * (self.m2 - self.m1) / (self.c2 - self.c1)


def fields(payload):
    out = {}
    for k, v in KV.findall(payload):
        out.setdefault(k, v)
    return out


def parse(stream, clock):
    """Events as tuples (t, kind, tid, cpu, info), time-ordered, t in monotonic ns."""
    ev = []
    for line in stream:
        m = LINE.match(line)
        if not m:
            continue
        comm, tid, cpu, sec, frac, rest = m.groups()
        t = clock.raw(sec, frac)
        tid, cpu = int(tid), int(cpu)
        m2 = SYSCALL.match(rest)
        if m2:
            name = ("sys_enter_" if m2.group(2) == "(" else "sys_exit_") + m2.group(1)
            payload = ""
        else:
            m2 = EVENT.match(rest)
            if not m2:
                continue
            name, payload = m2.groups()
        if name == "tracing_mark_write" and "latency-mark" in payload:
            clock.marker(t)
            continue
        info = {"comm": comm}
        if name in ("io_uring_submit_req", "io_uring_complete", "io_uring_queue_async_work"):
            f = fields(payload)
            info.update(ring=f.get("ring"), req=f.get("req") or f.get("request"),
                        op=f.get("opcode"))
        elif name in ("fuse_request_send", "fuse_request_end"):
            m2 = re.search(r"req (\d+)", payload)
            m3 = re.search(r"opcode (\d+)", payload)
            info.update(unique=int(m2.group(1)) if m2 else None,
                        op=int(m3.group(1)) if m3 else None)
        elif name in ("block_rq_issue", "block_rq_complete"):
            m2 = re.match(r"\s*\d+,\d+\s+(\S+)\s+(?:\d+\s+)?\(.*?\)\s+(\d+)\s+\+\s+(\d+)", payload)
            if not m2:
                continue
            info.update(rwbs=m2.group(1), sector=int(m2.group(2)), nr=int(m2.group(3)))
        elif name == "sched_switch":
            m2 = re.search(r"prev_pid=(\d+).*?prev_state=(\S+).*next_pid=(\d+)", payload)
            if not m2:
                continue
            info.update(prev=int(m2.group(1)), state=m2.group(2), next=int(m2.group(3)))
        elif name == "sched_wakeup":
            m2 = re.search(r"pid=(\d+)", payload)
            info.update(pid=int(m2.group(1)) if m2 else None)
        elif name.startswith("sys_"):
            pass
        else:
            continue
        ev.append((t, name, tid, cpu, info))
    ev.sort(key=lambda e: e[0])
    return [(clock.to_ns(e[0]),) + e[1:] for e in ev]


class Window:
    def __init__(self, ev, lo, hi):
        self.ev, self.lo, self.hi = ev, lo, hi

    def first(self, after, pred, before=None):
        for e in self.ev[self.lo:self.hi]:
            if e[0] < after:
                continue
            if before is not None and e[0] > before:
                return None
            if pred(e):
                return e
        return None

    def last(self, after, before, pred):
        found = None
        for e in self.ev[self.lo:self.hi]:
            if e[0] < after:
                continue
            if e[0] > before:
                break
            if pred(e):
                found = e
        return found

    def any(self, after, before, pred):
        return self.last(after, before, pred) is not None


def trace(kind, engine, tids_file, target, results, clock, m1, m2):
    server = set()
    if tids_file and os.path.exists(tids_file):
        server = {int(x) for x in open(tids_file).read().split()}
    ev = parse(sys.stdin, Clock(clock, m1, m2))
    # The server's threads that submit to io_uring themselves (not its io-wq threads).
    workers = {e[2] for e in ev if e[1] == "io_uring_submit_req" and e[2] in server}
    if engine == "psync":
        is_start = lambda e: e[1] == "sys_enter_pread64" and e[4]["comm"] == "fio"
        is_app_ret = lambda e, app: e[1] == "sys_exit_pread64" and e[2] == app
    else:
        is_start = lambda e: (e[1] == "io_uring_submit_req" and e[4]["comm"] == "fio"
                              and e[4]["op"] == "READ" and e[2] not in server)
        is_app_ret = lambda e, app: e[1] == "sys_exit_io_uring_enter" and e[2] == app
    starts = [i for i, e in enumerate(ev) if is_start(e)]
    vals = {k: [] for k, _, _ in STAGES}
    vals["total"] = []
    vals["between"] = []
    diag = {"windows": 0, "used": 0, "worker_slept": 0, "slept_in_device_wait": 0,
            "same_cpu": 0, "iowq_punts": 0, "missing": {}}
    is_rd = lambda e: e[4].get("rwbs", "").startswith("R")
    prev_ret = None
    for n, i in enumerate(starts[:-1]):
        j = starts[n + 1]
        w = Window(ev, i, j)
        t0, _, app, app_cpu, app_info = ev[i]
        diag["windows"] += 1
        if prev_ret is not None:
            vals["between"].append(t0 - prev_ret)
        prev_ret = None
        diag["iowq_punts"] += sum(
            1 for e in ev[i:j] if e[1] == "io_uring_queue_async_work" and e[4]["ring"] == app_info["ring"])
        row = {}
        flags = set()

        def miss(what):
            diag["missing"][what] = diag["missing"].get(what, 0) + 1

        if kind == "raw":
            bi = w.first(t0, lambda e: e[1] == "block_rq_issue" and is_rd(e))
            if not bi:
                miss("block_rq_issue"); continue
            bd = w.first(bi[0], lambda e: e[1] == "block_rq_complete" and e[4]["sector"] == bi[4]["sector"])
            if not bd:
                miss("block_rq_complete"); continue
            ar = w.first(bd[0], lambda e: is_app_ret(e, app))
            if not ar:
                miss("app return"); continue
            row = {"dsubmit": bi[0] - t0, "device": bd[0] - bi[0], "appwake": ar[0] - bd[0]}
            end_t = ar[0]
        else:
            send = w.first(t0, lambda e: e[1] == "fuse_request_send" and e[4]["op"] == FUSE_READ)
            if not send:
                miss("fuse_request_send"); continue
            u = send[4]["unique"]
            end = w.first(send[0], lambda e: e[1] == "fuse_request_end" and e[4]["unique"] == u)
            if not end:
                miss("fuse_request_end"); continue
            # The worker is the thread that ends the request (the commit runs in its
            # io_uring_enter); an io-wq thread of the server stands for the server thread
            # that queued the reply.
            wk = end[2]
            if wk not in workers:
                q = w.last(send[0], end[0], lambda e: e[1] == "io_uring_submit_req" and e[2] in workers)
                if not q:
                    miss("worker"); continue
                wk = q[2]
            # The request reaches the worker as a CQE posted in its own task work (ring), or
            # as a completed READ of /dev/fuse (devfuse, perhaps posted by io-wq).
            seen = w.first(send[0], lambda e: e[1] == "io_uring_complete" and (
                e[2] == wk or (e[2] in server and e[2] not in workers)), end[0])
            if not seen:
                miss("request CQE"); continue
            # Back in user space: at the end of the io_uring_enter the CQE was posted in, or
            # at once when the task work ran on the way back from a preemption.
            nxt = w.first(seen[0] + 1, lambda e: e[2] == wk and e[1] in (
                "sys_exit_io_uring_enter", "io_uring_submit_req"), end[0])
            ret_t = nxt[0] if nxt and nxt[1] == "sys_exit_io_uring_enter" else seen[0]
            sw = w.last(send[0], seen[0], lambda e: e[1] == "sched_switch" and e[4]["next"] == wk)
            run_t = sw[0] if sw else send[0]
            if sw:
                flags.add("worker_slept")
            if seen[3] == app_cpu:
                flags.add("same_cpu")
            ret = (ret_t,)
            row = {"queue": send[0] - t0, "wake": run_t - send[0], "deliver": ret[0] - run_t}
            if kind == "fuse-dev":
                bi = w.first(ret[0], lambda e: e[1] == "block_rq_issue" and is_rd(e), end[0])
                if not bi:
                    miss("block_rq_issue"); continue
                bd = w.first(bi[0], lambda e: e[1] == "block_rq_complete" and e[4]["sector"] == bi[4]["sector"], end[0])
                if not bd:
                    miss("block_rq_complete"); continue
                dsub = w.last(ret[0], bi[0], lambda e: e[1] == "io_uring_submit_req" and e[2] == wk and e[4]["op"] in DEVICE_READ_OPS)
                if not dsub:
                    miss("device READ submit"); continue
                dseen = w.first(bd[0], lambda e: e[1] == "io_uring_complete" and e[4]["req"] == dsub[4]["req"], end[0])
                if not dseen:
                    miss("device READ completion"); continue
                commit = w.first(dseen[0], lambda e: e[1] == "io_uring_submit_req" and e[2] == wk, end[0])
                if not commit:
                    miss("reply submit"); continue
                if w.any(dsub[0], dseen[0], lambda e: e[1] == "sched_switch" and e[4]["prev"] == wk
                         and e[4]["state"] not in ("R", "R+")):
                    flags.add("slept_in_device_wait")
                row.update(plan=dsub[0] - ret[0], dsubmit=bi[0] - dsub[0], device=bd[0] - bi[0],
                           dseen=dseen[0] - bd[0], reply=commit[0] - dseen[0], commit=end[0] - commit[0])
            else:
                commit = w.first(ret[0], lambda e: e[1] == "io_uring_submit_req" and e[2] == wk, end[0])
                if not commit:
                    miss("reply submit"); continue
                row.update(plan=commit[0] - ret[0], commit=end[0] - commit[0])
            ar = w.first(end[0], lambda e: is_app_ret(e, app))
            if not ar:
                miss("app return"); continue
            row["appwake"] = ar[0] - end[0]
            end_t = ar[0]
        row["total"] = end_t - t0
        prev_ret = end_t
        diag["used"] += 1
        for k in flags:
            diag[k] += 1
        for k, v in row.items():
            vals[k].append(v)
    out = {"diag": diag, "p50_us": {}, "mean_us": {}, "n": {}}
    for k, v in vals.items():
        if v:
            out["p50_us"][k] = statistics.median(v) / 1000
            out["mean_us"][k] = statistics.fmean(v) / 1000
            out["n"][k] = len(v)
    # The sum of the stage medians, next to the median of the per-request totals. (The
    # means add up exactly: every used request has every stage of its kind.)
    out["p50_us"]["sum"] = sum(out["p50_us"].get(k, 0) for k, _, _ in STAGES)
    out["mean_us"]["sum"] = sum(out["mean_us"].get(k, 0) for k, _, _ in STAGES)
    if vals["total"]:
        q = statistics.quantiles(vals["total"], n=100)
        out["p50_us"]["total_p90"] = q[89] / 1000
        out["p50_us"]["total_p99"] = q[98] / 1000
    d = diag
    with open(results, "a") as f:
        for k, v in out["p50_us"].items():
            f.write(f"trace.{target}.{k} {v:.3f}\n")
        for k, v in out["mean_us"].items():
            f.write(f"mean.{target}.{k} {v:.3f}\n")
        f.write(f"diag.{target}.windows {d['windows']}\n")
        f.write(f"diag.{target}.used {d['used']}\n")
        if d["used"]:
            for k in ("worker_slept", "slept_in_device_wait", "same_cpu"):
                f.write(f"diag.{target}.{k}.pct {100 * d[k] / d['used']:.1f}\n")
        if d["windows"]:
            f.write(f"diag.{target}.iowq_punts.rate {d['iowq_punts'] / d['windows']:.3f}\n")
    print(f"windows={d['windows']} used={d['used']} worker_slept={d['worker_slept']} "
          f"slept_in_device_wait={d['slept_in_device_wait']} same_cpu={d['same_cpu']} "
          f"iowq_punts={d['iowq_punts']} total_p50_us={out['p50_us'].get('total', 0):.1f} "
          f"missing={d['missing']}")


def fio(path):
    """IOPS, p50 and mean of the latency from submission to completion (fio's lat: slat +
    clat), and clat's p50."""
    job = json.load(open(path))["jobs"][0]["read"]
    lat, clat = job["lat_ns"], job["clat_ns"]
    p50 = lat.get("percentile", {}).get("50.000000", 0) / 1000
    c50 = clat.get("percentile", {}).get("50.000000", 0) / 1000
    print(f'{job["iops"]:.0f} {p50:.1f} {lat["mean"] / 1000:.1f} {c50:.1f}')


def perf(path, out):
    j = json.load(open(path))
    ops = {o["op"]: o for o in j["ops"]}
    r = ops.get("READ")
    with open(out, "a") as f:
        if not r or r.get("p50_us") is None:
            return
        f.write(f"total {r['p50_us']}\n")
        for name, s in (r.get("stages") or {}).items():
            f.write(f"{name} {s['p50_us']}\n")
        f.write(f"count {r['count']}\n")


def load(path):
    r = {}
    for line in open(path):
        k, _, v = line.strip().partition(" ")
        if k:
            try:
                r.setdefault(k, []).append(float(v))
            except ValueError:
                pass
    return r


def report(path):
    R = load(path)
    env = os.environ
    targets = env["TARGETS"].split()
    names = {"raw": "raw file", "uring": "etcfs uring", "devfuse": "etcfs devfuse",
             "uring-nospin": "etcfs uring, `--device-spin-us 0`",
             "probe": "probe (ring, ASYNC_DIO)", "probe-sync": "probe as shipped (sync DIO)"}

    def med(k):
        v = R.get(k)
        return statistics.median(v) if v else None

    def rng(k):
        v = R.get(k)
        return (min(v), max(v)) if v and len(v) > 1 else None

    def f(x, d=1):
        return "—" if x is None else f"{x:,.{d}f}".replace(",", " ")

    def cell(k, d=1):
        m, r = med(k), rng(k)
        if m is None:
            return "—"
        return f(m, d) if r is None else f"{f(m, d)} ({f(r[0], d)}–{f(r[1], d)})"

    out = []
    p = out.append
    cols = [t for t in targets]
    has = lambda t: t in cols
    no_dev = ("dsubmit", "device", "dseen", "reply")

    def table(pre, what, spans):
        head = "| # | stage | " + ("tracepoint span | " if spans else "") + " | ".join(names[t] for t in cols)
        sep = "|---|---|" + ("---|" if spans else "") + "---|" * len(cols)
        if has("uring") and has("probe"):
            head += " | etcfs uring − probe"
            sep += "---|"
        if has("uring") and has("raw"):
            head += " | added by etcfs uring (− raw)"
            sep += "---|"
        p(head + " |")
        p(sep)
        for n, (key, label, span) in enumerate(STAGES, 1):
            row = f"| {n} | {label} |" + (f" {span} |" if spans else "")
            for t in cols:
                if (t == "raw" and key not in RAW_ROWS) or (t.startswith("probe") and key in no_dev):
                    row += " — |"
                else:
                    row += f" {cell(f'{pre}.{t}.{key}')} |"
            u = med(f"{pre}.uring.{key}")
            if has("uring") and has("probe"):
                pr = med(f"{pre}.probe.{key}") if key not in no_dev else 0
                row += f" {f(None if u is None else u - (pr or 0))} |"
            if has("uring") and has("raw"):
                rw = med(f"{pre}.raw.{key}") if key in RAW_ROWS else 0
                row += f" {f(None if u is None else u - (rw or 0))} |"
            p(row)

        def line(label, key_of, d=1, diff=True):
            row = f"| | **{label}** |" + (" |" if spans else "")
            for t in cols:
                row += f" {cell(key_of(t), d)} |"
            u = med(key_of("uring"))
            if has("uring") and has("probe"):
                pr = med(key_of("probe"))
                row += f" {f(u - pr) if diff and u is not None and pr is not None else ''} |"
            if has("uring") and has("raw"):
                rw = med(key_of("raw"))
                row += f" {f(u - rw) if diff and u is not None and rw is not None else ''} |"
            p(row)

        line(f"sum of the stage {what}s", lambda t: f"{pre}.{t}.sum")
        line(f"{what} of the per-request totals (traced)", lambda t: f"{pre}.{t}.total")
        if pre == "trace":
            line("p90 of the per-request totals (traced)", lambda t: f"trace.{t}.total_p90")
            line("p99 of the per-request totals (traced)", lambda t: f"trace.{t}.total_p99")
            line("fio lat p50 (submit → completion), traced run", lambda t: f"fio.{t}.traced.p50")
            line("fio lat p50, untraced run", lambda t: f"fio.{t}.plain.p50")
            line("fio lat p50, untraced, `--perf` mount", lambda t: f"fio.{t}.perf.p50")
        else:
            line("fio lat mean, traced run", lambda t: f"fio.{t}.traced.mean")
            line("fio lat mean, untraced run", lambda t: f"fio.{t}.plain.mean")
            line("fio IOPS, traced run", lambda t: f"fio.{t}.traced.iops", 0)
            line("fio IOPS, untraced run", lambda t: f"fio.{t}.plain.iops", 0)
            line("fio's own time between requests (traced)", lambda t: f"{pre}.{t}.between", diff=False)

    p(f"### Where one 4 KiB read's time goes: p50 per stage (µs; tracepoints, {env['ENGINE']} engine)")
    p("")
    table("trace", "p50", True)
    p("")
    p("### The same, mean per stage (µs): the means add up to the mean total, which sets QD 1 IOPS")
    p("")
    table("mean", "mean", False)
    p("")
    p("Cells: median over the rounds of each round's p50 (min–max of the rounds). A stage's "
      "p50 is over the requests of one traced run; the stage p50s need not add up to the p50 "
      "of the totals. Differences are of the medians.")
    p("")
    # How the requests went.
    p("| per request, traced runs | " + " | ".join(names[t] for t in cols if t != "raw") + " |")
    p("|---|" + "---|" * len([t for t in cols if t != "raw"]))
    for label, k in (("requests traced / used (per run)", None),
                     ("worker was asleep when the request came (%)", "worker_slept"),
                     ("worker slept through the device read (%)", "slept_in_device_wait"),
                     ("worker on the application's CPU (%)", "same_cpu"),
                     ("application's io_uring punted the read to io-wq (per request)", "iowq_punts")):
        row = f"| {label} |"
        for t in cols:
            if t == "raw":
                continue
            if k is None:
                row += f" {f(med(f'diag.{t}.windows'), 0)} / {f(med(f'diag.{t}.used'), 0)} |"
            elif k == "iowq_punts":
                row += f" {f(med(f'diag.{t}.{k}.rate'), 2)} |"
            else:
                row += f" {f(med(f'diag.{t}.{k}.pct'), 0)} |"
        p(row)
    p("")
    # --perf stages.
    perf_t = [t for t in cols if R.get(f"perf.{t}.total")]
    if perf_t:
        p("### The daemon's own clocks (`etcfs mount --perf`, `etcfs stats`, READ, p50 µs)")
        p("")
        p("| stage (where its clock starts and stops) | " + " | ".join(names[t] for t in perf_t) + " |")
        p("|---|" + "---|" * len(perf_t))
        rows = [
            ("queue_wait: the worker's wake-up (end of `io_uring_enter`) → its handling of this CQE", "queue_wait"),
            ("handler: copy of the args aside, decode, `EtcFs::dispatch` (READ: `read_fast` builds the plan)", "handler"),
            ("device_io: start of serve → last device READ completion seen (includes handler)", "device_io"),
            ("total: start of serve → reply written, COMMIT queued (not yet submitted)", "total"),
        ]
        for label, k in rows:
            p(f"| {label} | " + " | ".join(cell(f"perf.{t}.{k}") for t in perf_t) + " |")
        p("| device_io − handler: queue the READ, submit, device, completion seen | " +
          " | ".join(f(None if med(f'perf.{t}.device_io') is None else med(f'perf.{t}.device_io') - med(f'perf.{t}.handler')) for t in perf_t) + " |")
        p("| total − device_io: reply built after the data came | " +
          " | ".join(f(None if med(f'perf.{t}.device_io') is None else med(f'perf.{t}.total') - med(f'perf.{t}.device_io')) for t in perf_t) + " |")
        p("")
    p(f"Rounds: {env['ROUNDS']}; fio: `--rw=randread --bs=4k --iodepth=1 --direct=1 "
      f"--ioengine={env['ENGINE']}`, {env['FIO_SIZE']} file, {env['FIO_SECS']} s untraced, "
      f"{env['TRACE_SECS']} s traced (1 s ramp each).")
    print("\n".join(out))


def write_doc(doc, section_path, begin, end):
    section = open(section_path).read().rstrip("\n")
    text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        a = text.index(begin)
        b = text.index(end, a) + len(end)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    open(doc, "w").write(text)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "trace":
        trace(*args)
    elif cmd == "fio":
        fio(*args)
    elif cmd == "perf":
        perf(*args)
    elif cmd == "report":
        report(*args)
    elif cmd == "write-doc":
        write_doc(*args)
    else:
        sys.exit(f"latency_budget.py: unknown command {cmd}")
