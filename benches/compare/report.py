#!/usr/bin/env python3
"""Counter snapshots, deltas and the report of benches/compare/run.sh.

Subcommands (all called by run.sh):
  delta TAG A B          counters that moved between snapshots TAG-A.* and TAG-B.*, as
                         "key value" lines: etcd.* from etcd's /metrics, d.<OP> FUSE
                         requests the daemon(s) served, c.<name> etcfs counters
  fio JSON               "cold_iops X" and "warm_iops Y" from a two-job fio run
  meta FILES OUT         ops/s per phase (slowest client) and overall, from metaclient's output
  transport JSON         the transport an etcfs mount reports
  report RESULTS         markdown tables (environment variables describe the run)
  write-doc DOC SECTION  put SECTION between this script's markers in DOC
"""
import glob
import json
import os
import re
import sys

BEGIN = "<!-- benches/compare: begin -->"
END = "<!-- benches/compare: end -->"
SYSTEMS = ("etcfs", "juicefs", "local")
LABEL = {"etcfs": "etcfs", "juicefs": "JuiceFS (etcd)", "local": "local fs (floor)"}

# --- snapshots ---------------------------------------------------------------------------------


def etcd_metrics(path):
    """Requests etcd's gRPC server completed, by method (every status code), and the MVCC
    range count (ranges inside transactions included)."""
    out = {}
    pat = re.compile(r'^grpc_server_handled_total\{([^}]*)\} ([0-9.e+]+)$')
    for line in open(path):
        m = pat.match(line.strip())
        if m:
            labels = dict(kv.split("=", 1) for kv in m.group(1).split(","))
            if labels.get("grpc_service", "").strip('"') != "etcdserverpb.KV":
                continue
            meth = labels["grpc_method"].strip('"').lower()
            out[f"etcd.{meth}"] = out.get(f"etcd.{meth}", 0) + float(m.group(2))
        elif line.startswith("etcd_mvcc_range_total "):
            out["etcd.mvcc_ranges"] = float(line.split()[1])
        elif line.startswith("etcd_disk_wal_fsync_duration_seconds_sum "):
            out["etcd.fsync_s"] = float(line.split()[1])
        elif line.startswith("etcd_disk_wal_fsync_duration_seconds_count "):
            out["etcd.fsyncs"] = float(line.split()[1])
    return out


def etcfs_stats(path):
    j = json.load(open(path))
    out = {f"d.{o['op']}": o["count"] for o in j.get("ops", [])}
    for k, v in (j.get("counters") or {}).items():
        out[f"c.{k}"] = v
    return out


def juicefs_stats(path):
    """The .stats file of a JuiceFS mount: juicefs_fuse_ops_total_<op> counts FUSE requests."""
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) != 2:
            continue
        if f[0].startswith("juicefs_fuse_ops_total_"):
            out["d." + f[0][len("juicefs_fuse_ops_total_"):].upper()] = float(f[1])
        elif f[0].startswith("juicefs_meta_ops_total_"):
            out["jm." + f[0][len("juicefs_meta_ops_total_"):]] = float(f[1])
        elif f[0] == "juicefs_transaction_durations_histogram_seconds_total":
            out["jm.transactions"] = float(f[1])
    return out


def snapshot(tag, phase):
    snap = {}
    e = f"{tag}-{phase}.etcd"
    if os.path.exists(e):
        snap.update(etcd_metrics(e))
    v = f"{tag}-{phase}.vm"
    if os.path.exists(v):  # drop_pagecache / drop_slab: how often anyone dropped the caches
        for line in open(v):
            f = line.split()
            if len(f) == 2:
                snap[f"vm.{f[0]}"] = float(f[1])
    for p in sorted(glob.glob(f"{tag}-{phase}.*.etcfs")):
        for k, v in etcfs_stats(p).items():
            snap[k] = snap.get(k, 0) + v
    for p in sorted(glob.glob(f"{tag}-{phase}.*.jfs")):
        for k, v in juicefs_stats(p).items():
            snap[k] = snap.get(k, 0) + v
    return snap


# Gauges and maxima in etcfs's counters: a difference of them means nothing.
GAUGES = ("pipeline_pending", "etcd_txns_in_flight", "etcd_mutations_per_txn_max", "watch_revision")


def delta(tag, a, b):
    sa, sb = snapshot(tag, a), snapshot(tag, b)
    if glob.glob(f"{tag}-{b}.*.etcfs") or glob.glob(f"{tag}-{b}.*.jfs"):
        for k in ("d.LOOKUP", "d.READ"):
            sb.setdefault(k, 0)
    for k in sorted(sb):
        if any(k.endswith(g) for g in GAUGES):
            continue
        d = sb[k] - sa.get(k, 0)
        if d or k.startswith("etcd.") or k in ("d.LOOKUP", "d.READ", "vm.drop_pagecache"):
            print(f"{k} {d:g}")
    # Which etcfs counters exist, so the report can say "not exported" instead of 0.
    names = [k for k in sb if k.startswith("c.")]
    if names:
        print("has_counters " + ",".join(sorted(names)))


def fio_passes(path):
    j = json.load(open(path))
    jobs = {job["jobname"]: job for job in j["jobs"]}
    for name in ("cold", "warm"):
        r = jobs[name]["read"]
        print(f"{name}_iops {r['iops']:.0f}")
        print(f"{name}_ios {r['total_ios']}")


def meta_outputs(nfiles, path):
    """ops/s of each phase, timed over its slowest client, and of all three together, from
    metaclient's "<client> <phase> <µs>" lines."""
    worst, clients = {}, set()
    for line in open(path):
        f = line.split()
        if len(f) == 3:
            clients.add(f[0])
            worst[f[1]] = max(worst.get(f[1], 0), float(f[2]))
    n = nfiles * len(clients)
    total = 0.0
    for ph in ("create", "stat", "unlink"):
        if not worst.get(ph):
            sys.exit(f"report.py: no {ph} time in {path}")
        total += worst[ph]
        print(f"{ph}_us {worst[ph]:.0f}")
        print(f"{ph}_ops {n * 1e6 / worst[ph]:.1f}")
    print(f"all_ops {3 * n * 1e6 / total:.1f}")


# --- the report ----------------------------------------------------------------------------------


def load_results(path):
    r = {}
    for line in open(path):
        k, _, v = line.strip().partition(" ")
        if k:
            r.setdefault(k, []).append(v)
    return r


class Results:
    def __init__(self, path):
        self.r = load_results(path)

    def nums(self, k):
        out = []
        for v in self.r.get(k, []):
            try:
                out.append(float(v))
            except ValueError:
                pass
        return out

    def med(self, k):
        v = sorted(self.nums(k))
        return v[(len(v) - 1) // 2] if v else None  # lower median for an even count

    def text(self, k):
        v = self.r.get(k)
        return v[-1] if v else None


def fmt(x, d=0):
    if x is None:
        return "n/a"
    s = f"{x:,.{d}f}"
    return s.replace(",", " ") if abs(x) >= 10000 else s.replace(",", "")


def cell(R, k, d=0, scale=1.0):
    v = sorted(x * scale for x in R.nums(k))
    if not v:
        return "n/a"
    m = v[(len(v) - 1) // 2]
    return fmt(m, d) if len(v) == 1 or v[0] == v[-1] else f"{fmt(m, d)} ({fmt(v[0], d)}–{fmt(v[-1], d)})"


def ratio(x, y):
    return None if x is None or not y else x / y


def rfmt(x, d=2):
    return "n/a" if x is None else f"{x:.{d}f}x"


def verdict(ok):
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def report(res_path):
    R = Results(res_path)
    env = os.environ
    runs = int(env.get("RUNS", "1"))
    systems = [s for s in SYSTEMS if s in env.get("SYSTEMS", " ".join(SYSTEMS)).split()]
    out = []
    p = out.append
    goals = []  # (scenario, goal, verdict, detail)

    def goal_lines(since):
        for g in goals[since:]:
            p(f"Goal: {g[1]} — {g[2]} ({g[3]}).")
            p("")

    p("## Side by side: etcfs vs JuiceFS on the same etcd vs the local filesystem")
    p("")
    p(f"- date: {env.get('RUN_DATE', 'n/a')}")
    p(f"- machine: {env.get('MACHINE', 'n/a')}")
    p(f"- disk: {env.get('DISK', 'n/a')}")
    p(f"- versions: {env.get('VERSIONS', 'n/a')}")
    p(f"- command: `{env.get('COMMAND', 'bash benches/compare/run.sh')}`")
    p(f"- etcd: `{env.get('ETCD_CMD', 'n/a')}`")
    p(f"- etcfs: `{env.get('ETCFS_MKFS', 'n/a')}`; each mount `{env.get('ETCFS_MOUNT', 'n/a')}`")
    p(f"- JuiceFS: `{env.get('JFS_FORMAT', 'n/a')}`; each mount `{env.get('JFS_MOUNT', 'n/a')}`")
    p(f"- local fs: `{env.get('LOCAL_DIR', 'n/a')}` ({env.get('LOCAL_FSTYPE', 'n/a')}), the disk that holds "
      "etcfs's device image, JuiceFS's blocks and etcd's data")
    p(f"- cells: median of {runs} run{'s' if runs != 1 else ''}"
      + (" (min–max)" if runs > 1 else "") + "; systems measured in turn within each run, order rotated "
      "between runs, only the system under test mounted")
    p("")

    # ---- summary, shaped like design.md §6 ----
    clients = env.get("CLIENTS", "1 2 3").split()
    fsize = env.get("FIO_SIZE", "256M")
    files = env.get("FILES", "500")
    summary = []
    if env.get("DO_FIO") == "1":
        row = [f"warm page-cache reads, {fsize} set (4 KiB sequential reads, psync)"]
        for s in systems:
            iops = R.med(f"fio.{s}.warm_iops")
            reads = R.med(f"fio.{s}.warm.d.READ")
            extra = "" if s == "local" else f", **{fmt(reads)} daemon reads**"
            row.append(f"{fmt(iops)} IOPS{extra}")
        summary.append(row)
    if env.get("DO_META") == "1":
        row = [f"metadata under concurrency: create/stat/unlink, {files} files per client, one shared dir, "
               + "/".join(clients) + " clients"]
        for s in systems:
            row.append(" / ".join(fmt(R.med(f"meta.{s}.k{k}.all_ops")) for k in clients) + " ops/s")
        summary.append(row)
    if env.get("DO_NEG") == "1":
        row = [f"negative lookup: {env.get('MISSING', '200')} missing names, dir of {env.get('ENTRIES', '50')} "
               "entries; cold / warm per lookup"]
        for s in systems:
            row.append(f"{fmt(R.med(f'neg.{s}.cold_us'), 1)} µs / {fmt(R.med(f'neg.{s}.warm_us'), 2)} µs "
                       f"(median sweep {fmt(R.med(f'neg.{s}.warm_median_us'), 2)} µs)")
        summary.append(row)
    if summary:
        p("| scenario | " + " | ".join(LABEL[s] for s in systems) + " |")
        p("|---" * (len(systems) + 1) + "|")
        for row in summary:
            p("| " + " | ".join(row) + " |")
        p("")

    # ---- negative lookup ----
    if env.get("DO_NEG") == "1":
        g0 = len(goals)
        miss, sweeps = int(env.get("MISSING", "200")), int(env.get("WARM_SWEEPS", "200"))
        p(f"### Negative lookup: {miss} missing names in a directory of {env.get('ENTRIES', '50')} entries")
        p("")
        p(f"`neglookup` (benches/compare/neglookup.c) opens the directory, then calls `fstatat()` on "
          f"each missing name: one cold sweep, right after a fresh mount (etcfs, JuiceFS) and "
          f"`echo 3 > /proc/sys/vm/drop_caches`, then {sweeps} warm sweeps. "
          "Daemon = FUSE LOOKUP requests the daemon served (etcfs: `etcfs stats --json`; JuiceFS: "
          "`juicefs_fuse_ops_total_lookup` in its `.stats` file). etcd = requests etcd's gRPC server "
          "handled (`grpc_server_handled_total` from etcd's `/metrics`), the same count for both.")
        p("")
        p("| metric | " + " | ".join(LABEL[s] for s in systems) + " |")
        p("|---" * (len(systems) + 1) + "|")
        p("| cold µs per lookup | " + " | ".join(cell(R, f"neg.{s}.cold_us", 1) for s in systems) + " |")
        p("| warm µs per lookup (all sweeps) | " + " | ".join(cell(R, f"neg.{s}.warm_us", 2) for s in systems) + " |")
        p("| warm µs per lookup (median sweep) | " + " | ".join(cell(R, f"neg.{s}.warm_median_us", 2) for s in systems) + " |")
        p("| warm µs per lookup (fastest sweep) | " + " | ".join(cell(R, f"neg.{s}.warm_best_us", 2) for s in systems) + " |")
        for ph, n in (("cold", miss), ("warm", miss * sweeps)):
            p(f"| {ph}: lookups that reached the daemon (of {fmt(n)}) | "
              + " | ".join("—" if s == "local" else cell(R, f"neg.{s}.{ph}.d.LOOKUP") for s in systems) + " |")
            p(f"| {ph}: etcd Range requests | "
              + " | ".join("—" if s == "local" else cell(R, f"neg.{s}.{ph}.etcd.range") for s in systems) + " |")
            p(f"| {ph}: etcd Txn requests | "
              + " | ".join("—" if s == "local" else cell(R, f"neg.{s}.{ph}.etcd.txn") for s in systems) + " |")
        if "etcfs" in systems:
            has = R.text("neg.etcfs.cold.has_counters") or ""
            for name, label in (("lookups_etcd", "lookups that reached etcd (etcfs counter `lookups_etcd`)"),
                                ("etcd_read_txns", "etcd read txns (etcfs counter `etcd_read_txns`)"),
                                ("cache_dir_names_hits", "name-set cache hits (etcfs counter)"),
                                ("cache_negative_hits", "negative cache hits (etcfs counter)")):
                if f"c.{name}" not in has:
                    continue
                vals = []
                for ph in ("cold", "warm"):
                    k = f"neg.etcfs.{ph}.c.{name}"
                    vals.append(cell(R, k) if R.nums(k) else "0")
                p(f"| etcfs: {label}, cold / warm | {vals[0]} / {vals[1]} |" + " |" * (len(systems) - 1))
        p("")
        e_warm, l_warm = R.med("neg.etcfs.warm_us"), R.med("neg.local.warm_us")
        e_med, l_med = R.med("neg.etcfs.warm_median_us"), R.med("neg.local.warm_median_us")
        r, rm = ratio(e_warm, l_warm), ratio(e_med, l_med)
        v = verdict(None if r is None else r <= 1.5)
        vm = verdict(None if rm is None else rm <= 1.5)
        goals.append(("negative lookup", "warm within 1.5x of local",
                      v if v == vm else f"{v} on the mean of all sweeps, {vm} on the median sweep",
                      f"mean of all sweeps: etcfs {fmt(e_warm, 2)} µs vs local {fmt(l_warm, 2)} µs = {rfmt(r)}; "
                      f"median sweep: {fmt(e_med, 2)} vs {fmt(l_med, 2)} µs = {rfmt(rm)}"))
        cold_reqs = None
        if R.nums("neg.etcfs.cold.etcd.range"):
            cold_reqs = (R.med("neg.etcfs.cold.etcd.range") or 0) + (R.med("neg.etcfs.cold.etcd.txn") or 0)
        goals.append(("negative lookup", "cold: at most one etcd range read per directory",
                      verdict(None if cold_reqs is None else cold_reqs <= 1),
                      f"etcfs cold sweep: {fmt(cold_reqs)} etcd requests (Range + Txn) for one directory"))
        goal_lines(g0)
        j_warm = R.med("neg.juicefs.warm_us")
        if j_warm and e_warm:
            p(f"etcfs / JuiceFS, warm: {rfmt(ratio(e_warm, j_warm), 3)}; cold: "
              f"{rfmt(ratio(R.med('neg.etcfs.cold_us'), R.med('neg.juicefs.cold_us')))}. JuiceFS runs with "
              "its default `--negative-entry-cache 0` (the kernel never caches an absent name), "
              "so every warm lookup is a FUSE round trip plus an etcd read.")
            p("")

    # ---- metadata ----
    if env.get("DO_META") == "1":
        g0 = len(goals)
        p(f"### Metadata under concurrency: {files} files per client, one shared directory")
        p("")
        p("Each client is a `metaclient` process (benches/compare/metaclient.c) on its own mount of "
          "the same filesystem (etcfs: one daemon per mount, same device image and etcd prefix; "
          "JuiceFS: one `juicefs mount` per mountpoint of the same volume; local: one directory, "
          "no mounts). Phases create (`openat(O_CREAT|O_EXCL)` + `close`), stat (`fstatat`) and "
          "unlink (`unlinkat`) start together on all clients (each blocks on its own pipe from "
          "the parent until all are ready); a phase's time is that of its slowest client. ops/s = files × clients / "
          "time; \"all\" = the three phases' operations over the sum of their times.")
        p("")
        p("| clients | phase | " + " | ".join(f"{LABEL[s]} ops/s" for s in systems) + " | etcfs / JuiceFS |")
        p("|---" * (len(systems) + 3) + "|")
        for k in clients:
            for ph in ("create", "stat", "unlink", "all"):
                cells = [cell(R, f"meta.{s}.k{k}.{ph}_ops") for s in systems]
                rr = rfmt(ratio(R.med(f"meta.etcfs.k{k}.{ph}_ops"), R.med(f"meta.juicefs.k{k}.{ph}_ops")))
                name = f"**{ph}**" if ph == "all" else ph
                p(f"| {k} | {name} | " + " | ".join(cells) + f" | {rr} |")
        p("")
        both = [s for s in ("etcfs", "juicefs") if s in systems]
        if both:
            p("What each operation cost in etcd (medians over runs; requests = gRPC KV requests etcd "
              "handled during the phase, fsyncs = etcd WAL fsyncs, both divided by the phase's operations):")
            p("")
            p("| clients | phase | " + " | ".join(
                f"{LABEL[s]}: requests per op (Range + Txn) | {LABEL[s]}: fsyncs per op, mean fsync ms" for s in both) + " |")
            p("|---" * (2 + 2 * len(both)) + "|")
            for k in clients:
                n = int(k) * int(files)
                for ph in ("create", "stat", "unlink"):
                    row = []
                    for s in both:
                        pre = f"meta.{s}.k{k}.{ph}.etcd"
                        a_, b_ = R.med(pre + ".range"), R.med(pre + ".txn")
                        fs, fsec = R.med(pre + ".fsyncs"), R.med(pre + ".fsync_s")
                        row.append("n/a" if a_ is None else
                                   f"{(a_ + (b_ or 0)) / n:.2f} ({a_ / n:.2f} + {(b_ or 0) / n:.2f})")
                        row.append("n/a" if not fs else f"{fs / n:.2f}, {1000 * (fsec or 0) / fs:.2f} ms")
                    p(f"| {k} | {ph} | " + " | ".join(row) + " |")
            p("")
        if "etcfs" in systems and R.text(f"meta.etcfs.k{clients[0]}.create.has_counters"):
            p("etcfs's own view of each phase (its counters in `etcfs stats --json`, summed over the "
              "mounts, per operation): FUSE requests the daemons served, etcd commits "
              "(`etcd_txns_committed`), etcd read transactions (`etcd_read_txns`), and watch events "
              "applied (`watch_events_applied`, of which `watch_events_own` came from the mount's own commits).")
            p("")
            p("| clients | phase | FUSE requests per op | commits per op | read txns per op | watch events per op (own) |")
            p("|---|---|---|---|---|---|")
            for k in clients:
                n = int(k) * int(files)
                for ph in ("create", "stat", "unlink"):
                    pre = f"meta.etcfs.k{k}.{ph}"
                    ops = sorted({key[len(pre) + 3:] for key in R.r if key.startswith(pre + ".d.")})
                    fr = ", ".join(f"{op} {R.med(f'{pre}.d.{op}') / n:.2f}" for op in ops
                                   if R.med(f"{pre}.d.{op}") and op not in ("FORGET", "BATCH_FORGET"))

                    def per(c):
                        v = R.med(f"{pre}.c.{c}")
                        return f"{(v or 0) / n:.2f}"
                    p(f"| {k} | {ph} | {fr or 'none'} | {per('etcd_txns_committed')} | {per('etcd_read_txns')} "
                      f"| {per('watch_events_applied')} ({per('watch_events_own')}) |")
            p("")
        first, last = clients[0], clients[-1]
        p("")
        sc = []
        for s in systems:
            sc.append(f"{LABEL[s]} {rfmt(ratio(R.med(f'meta.{s}.k{last}.all_ops'), R.med(f'meta.{s}.k{first}.all_ops')))}")
        p(f"Scaling {first}→{last} clients (all phases): " + ", ".join(sc) + ".")
        p("")
        for k in clients:
            e, j = R.med(f"meta.etcfs.k{k}.all_ops"), R.med(f"meta.juicefs.k{k}.all_ops")
            r = ratio(e, j)
            us = [R.med(f"meta.etcfs.k{k}.{ph}_us") or 0 for ph in ("create", "stat", "unlink")]
            split = ""
            if sum(us):
                split = ("; etcfs's time by phase create/stat/unlink: "
                         + "/".join(f"{100 * u / sum(us):.0f}%" for u in us))
            goals.append(("metadata", f"≥ 3x JuiceFS aggregate ops/s, {k} client{'s' if k != '1' else ''}",
                          verdict(None if r is None else r >= 3), f"{fmt(e)} vs {fmt(j)} ops/s = {rfmt(r)}{split}"))
        goal_lines(g0)

    # ---- fio ----
    if env.get("DO_FIO") == "1":
        g0 = len(goals)
        p(f"### Warm page cache: a {fsize} working set read twice")
        p("")
        p(f"One fio command with two jobs over the same {fsize} file (written beforehand), "
          "`--rw=read --bs=4k --ioengine=psync`, the whole file once per pass: job `cold` right after a "
          "fresh mount and `drop_caches`, job `warm` (`stonewall`, `--invalidate=0`, "
          f"`--loops={env.get('WARM_LOOPS', '4')}`: the file {env.get('WARM_LOOPS', '4')} times, so the pass lasts long "
          "enough to time) straight after it in the same fio process. Daemon READs: FUSE READ requests served during each pass "
          "(counters snapshotted by fio's `exec_prerun`/`exec_postrun`).")
        p("")
        p("| metric | " + " | ".join(LABEL[s] for s in systems) + " |")
        p("|---" * (len(systems) + 1) + "|")
        p("| cold pass IOPS | " + " | ".join(cell(R, f"fio.{s}.cold_iops") for s in systems) + " |")
        p("| warm pass IOPS | " + " | ".join(cell(R, f"fio.{s}.warm_iops") for s in systems) + " |")
        p("| READ requests reaching the daemon, cold pass | "
          + " | ".join("—" if s == "local" else cell(R, f"fio.{s}.cold.d.READ") for s in systems) + " |")
        p("| READ requests reaching the daemon, warm pass | "
          + " | ".join("—" if s == "local" else cell(R, f"fio.{s}.warm.d.READ") for s in systems) + " |")
        fbytes = None
        try:
            fbytes = float(env.get("FIO_BYTES", ""))
        except ValueError:
            pass
        for ph, key in (("cold", "mid"), ("warm", "post")):
            vals = [R.nums(f"fio.{s}.resident_{key}") for s in systems]
            if any(vals):
                def res(v):
                    if not v:
                        return "n/a"
                    t = "/".join(fmt(x / 2**20, 1) for x in v)
                    return t + (" MiB" if fbytes is None else f" of {fmt(fbytes / 2**20)} MiB")
                p(f"| file in the page cache after the {ph} pass (per run, `fincore`) | "
                  + " | ".join(res(v) for v in vals) + " |")
        for ph in ("cold", "warm"):
            cells = []
            for s in systems:
                if s == "local":
                    cells.append("—")
                    continue
                ops = sorted({k.split(".")[-1] for k in R.r if k.startswith(f"fio.{s}.{ph}.d.")} - {"READ"})
                got = [(op, R.med(f"fio.{s}.{ph}.d.{op}")) for op in ops]
                cells.append(", ".join(f"{op} {fmt(v)}" for op, v in got if v) or "none")
            p(f"| other FUSE requests, {ph} pass | " + " | ".join(cells) + " |")
        p("| warm IOPS / local | " + " | ".join(
            rfmt(ratio(R.med(f"fio.{s}.warm_iops"), R.med("fio.local.warm_iops"))) for s in systems) + " |")
        p("")
        if "etcfs" in systems:
            moved = sorted({k.split(".", 4)[4] for k in R.r if k.startswith("fio.etcfs.warm.c.")})
            if moved:
                p("etcfs counters that moved during the warm pass (per run): " + "; ".join(
                    f"`{c}` " + "/".join(fmt(v) for v in R.nums(f"fio.etcfs.warm.c.{c}")) for c in moved) + ".")
                p("")
        wr = R.nums("fio.etcfs.warm.d.READ")
        drops = R.nums("fio.etcfs.warm.vm.drop_pagecache")
        clean = [r for i, r in enumerate(wr) if i >= len(drops) or not drops[i]]
        per_run = ", ".join(fmt(v) + ("*" if i < len(drops) and drops[i] else "") for i, v in enumerate(wr))
        note = (" (* another process dropped the page cache during that pass, `drop_pagecache` in "
                "/proc/vmstat moved; such runs are left out of the verdict)") if len(clean) < len(wr) else ""
        goals.append(("warm page cache", "zero READ requests reach the daemon in the warm pass (every run)",
                      verdict(None if not clean else max(clean) == 0),
                      f"etcfs: {per_run or 'n/a'} READs in the warm pass of each run{note}"))
        goal_lines(g0)

    # ---- where the time goes ----
    perf = env.get("PERF_FILE")
    if perf and os.path.exists(perf) and os.path.getsize(perf):
        p("### Where etcfs's time goes (one extra pass with `--perf`, not in the medians)")
        p("")
        p("Per FUSE operation on the first mount: requests, p50 of the whole request and of its stages "
          "(queue_wait: transport to handler; handler: synchronous work; whatever is left of the "
          "request is the wait for etcd or the device).")
        p("")
        p("| pass | FUSE op | count | p50 µs | p90 µs | stage p50 µs |")
        p("|---|---|---|---|---|---|")
        for line in open(perf):
            f = line.rstrip("\n").split("\t")
            if len(f) == 6:
                p("| " + " | ".join(f) + " |")
        p("")

    if goals:
        p("### Goals (issue 4), all scenarios")
        p("")
        p("| scenario | goal | verdict | measured |")
        p("|---|---|---|---|")
        for g in goals:
            p("| " + " | ".join(g) + " |")
        p("")
    hit = []
    for k in sorted(R.r):
        if k.endswith(".vm.drop_pagecache"):
            n = sum(1 for v in R.nums(k) if v)
            if n:
                hit.append(f"{k[:-len('.vm.drop_pagecache')]} ({n} of {len(R.nums(k))} runs)")
    if hit:
        p("Another process dropped the page cache (`drop_pagecache` in /proc/vmstat moved) during: "
          + ", ".join(hit) + ". Those intervals may have reached the daemon more often than the "
          "system alone would have.")
        p("")
    notes = env.get("NOTES", "").strip()
    if notes:
        for n in notes.split("\n"):
            p(f"- {n}")
        p("")
    print("\n".join(out).rstrip("\n"))


def perf_rows(label, path, wanted):
    j = json.load(open(path))
    for o in j.get("ops", []):
        if wanted and o["op"] not in wanted.split(","):
            continue
        if o.get("p50_us") is None:
            continue
        st = ", ".join(f"{k} {v['p50_us']:.1f}" for k, v in o.get("stages", {}).items()
                       if v.get("p50_us") is not None)
        print(f"{label}\t{o['op']}\t{o['count']}\t{o['p50_us']:.1f}\t{o.get('p90_us') or 0:.1f}\t{st}")


def write_doc(doc, section_path):
    section = open(section_path).read().rstrip("\n")
    text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text and END in text:
        a = text.index(BEGIN)
        b = text.index(END, a) + len(END)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    open(doc, "w").write(text)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "delta":
        delta(*args)
    elif cmd == "fio":
        fio_passes(args[0])
    elif cmd == "meta":
        meta_outputs(int(args[0]), args[1])
    elif cmd == "transport":
        print(json.load(sys.stdin)["transport"])
    elif cmd == "perf":
        perf_rows(args[0], args[1], args[2] if len(args) > 2 else "")
    elif cmd == "report":
        report(args[0])
    elif cmd == "write-doc":
        write_doc(*args)
    else:
        sys.exit(f"report.py: unknown command {cmd}")
