#!/usr/bin/env bash
# Filesystem benchmark (issue 3, "Measure"): etcfs with its metadata in a real etcd and its
# data on a device image, next to the floors it is built on.
#
#   1. fio, direct=1, io_uring, 1 job: 1 MiB sequential read and write (queue depth 1) and
#      4 KiB random read and write at queue depth 1 and 32, on a file inside etcfs and on a
#      raw file of the same size on the host filesystem that holds etcfs's device image.
#      Both are laid out by the same write pass first (reads hit written blocks, writes
#      overwrite); random offsets are the same on both (fixed seed). etcfs is measured with
#      its default ring depth and, with --deep N, again with --ring-entries-per-queue N.
#   2. single-client create, stat and unlink rates (benches/meta_rates.c: FILES files in one
#      directory, one timed phase each, no process start-up inside the timing), next to
#      same-shaped etcd requests sent one at a time by benches/etcd_txn.rs through etcfs's
#      own etcd client stack (meta::etcd::EtcdBackend), against the same etcd.
#   3. the same phases by CLIENTS processes (FILES/CLIENTS files each), once in one shared
#      directory and once in one directory per client (the kernel serialises creates and
#      unlinks within one directory, so only the second lets the daemon see them overlap):
#      aggregate rate and filesystem mutations per etcd transaction, from the filesystem's
#      counters in `etcfs stats --json` when it exports them, and always from the etcd
#      revision delta (every etcd write transaction adds exactly one revision).
#
# The metadata mounts use --attr-timeout/--entry-timeout META_TIMEOUT (default 1, etcfs's
# own default), and the script waits META_TIMEOUT + 0.5 s before the stat and unlink phases
# so that the kernel's cache from the previous phase has expired: every call reaches the
# daemon at least once (a LOOKUP), without the per-component revalidation timeouts of 0 add.
#
# Runs against a private one-member etcd on loopback ports (data under /tmp) and a sparse
# device image in /var/tmp, both removed on exit together with every mount and process the
# script started. Every figure is the median of --runs repetitions (min-max beside it); in
# each repetition each fio job runs on the raw file and in etcfs back to back (which first
# alternates), and the metadata sides in an order that rotates. After them, one extra
# pass with --perf records where the time goes (not part
# of the medians). Prints markdown tables; --write-doc also writes them into
# docs/benchmarks.md between this script's markers.
#
# Needs root and /dev/fuse; installs etcd, fio, gcc and python3 with apt-get if missing.
#
# usage: benches/fs.sh [--runs R] [--fio-secs S] [--fio-size SIZE] [--deep N|0]
#                      [--files N] [--clients K] [--meta-timeout SECS]
#                      [--no-fio] [--fio-jobs NAME,...] [--no-meta] [--no-perf-pass]
#                      [--no-build] [--etcfs PATH] [--write-doc]
# --fio-jobs runs only the named fio jobs (seqread, seqwrite, randread-qd1, randread-qd32,
# randwrite-qd1, randwrite-qd32).
# --no-build uses the binaries already in the target directory (as they are) instead of
# building the working tree first. --etcfs PATH measures that etcfs binary (e.g. one built
# from another commit) and builds nothing (benches/etcd_txn.rs, needed for the metadata
# part only, is then the newest one in the target directory).
set -euo pipefail

RUNS=5
FIO_SECS=5
FIO_SIZE=1G
DEEP=0
FILES=2000
CLIENTS=4
META_TIMEOUT=1
DO_FIO=1
FIO_ONLY=""
DO_META=1
DO_PERF=1
BUILD=1
ETCFS_ARG=""
WRITE_DOC=0
ORIG_ARGS=("$@")
while [ $# -gt 0 ]; do
	case "$1" in
	--runs) RUNS=$2; shift 2 ;;
	--fio-secs) FIO_SECS=$2; shift 2 ;;
	--fio-size) FIO_SIZE=$2; shift 2 ;;
	--deep) DEEP=$2; shift 2 ;;
	--files) FILES=$2; shift 2 ;;
	--clients) CLIENTS=$2; shift 2 ;;
	--meta-timeout) META_TIMEOUT=$2; shift 2 ;;
	--no-fio) DO_FIO=0; shift ;;
	--fio-jobs) FIO_ONLY=$2; shift 2 ;;
	--no-meta) DO_META=0; shift ;;
	--no-perf-pass) DO_PERF=0; shift ;;
	--no-build) BUILD=0; shift ;;
	--etcfs) ETCFS_ARG=$2; BUILD=0; shift 2 ;;
	--write-doc) WRITE_DOC=1; shift ;;
	-h | --help) sed -n '2,47p' "$0"; exit 0 ;;
	*) echo "fs.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
ETCFS=${ETCFS_ARG:-$TARGET_DIR/release/etcfs}

log() { echo "[fs.sh $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (FUSE mounts)"
[ -e /dev/fuse ] || die "needs /dev/fuse"
[ "$CLIENTS" -ge 1 ] && [ $((FILES % CLIENTS)) = 0 ] ||
	die "--files ($FILES) must be a multiple of --clients ($CLIENTS)"

WORK=$(mktemp -d /tmp/etcfs-fs-bench.XXXXXX)
IMGDIR=$(mktemp -d /var/tmp/etcfs-fs-bench.XXXXXX)
DEV_IMG=$IMGDIR/device.img
RAW_FILE=$IMGDIR/raw.dat
MNT=$WORK/mnt
ETCD_PID=""
DAEMON_PID="" # the etcfs daemon of the one mount that exists at a time

cleanup() {
	local rc=$?
	set +e
	if mountpoint -q "$MNT" 2>/dev/null; then
		umount "$MNT" 2>/dev/null || umount -l "$MNT"
	fi
	if [ -n "$DAEMON_PID" ]; then
		for _ in $(seq 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
		if kill -0 "$DAEMON_PID" 2>/dev/null; then
			log "etcfs daemon $DAEMON_PID still running after umount; SIGTERM"
			kill -TERM "$DAEMON_PID"
			for _ in $(seq 50); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
			kill -0 "$DAEMON_PID" 2>/dev/null && kill -KILL "$DAEMON_PID"
		fi
		mountpoint -q "$MNT" 2>/dev/null && umount -l "$MNT"
	fi
	if [ -n "$ETCD_PID" ] && kill -0 "$ETCD_PID" 2>/dev/null; then
		kill -TERM "$ETCD_PID"
		for _ in $(seq 100); do kill -0 "$ETCD_PID" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$ETCD_PID" 2>/dev/null && kill -KILL "$ETCD_PID"
	fi
	rm -rf "$IMGDIR"
	if mountpoint -q "$MNT" 2>/dev/null; then
		log "left $WORK: $MNT is still mounted"
	else
		rm -rf "$WORK"
	fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- tools -------------------------------------------------------------------------------

# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
need etcd etcd-server
need etcdctl etcd-client
need fio fio
need gcc gcc
need python3 python3

# Small helpers in Python (JSON parsing, medians, the report).
PY=$WORK/fsbench.py
cat >"$PY" <<'PYEOF'
import json, os, re, statistics, sys

def cargo_exe(name):
    for line in sys.stdin:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
            print(m["executable"])

def fio(path, rw):
    job = json.load(open(path))["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    p50 = side["clat_ns"].get("percentile", {}).get("50.000000", 0) / 1000
    print(f'{side["bw_bytes"] / 2**20:.1f} {side["iops"]:.0f} {p50:.1f}')

def etcd_rev():
    print(json.load(sys.stdin)[0]["Status"]["header"]["revision"])

def load_stats(path):
    j = json.load(open(path))
    ops = {o["op"]: o for o in j["ops"]}
    return j, ops

def counter(counters, *suffixes):
    for name, v in counters.items():
        if any(name.endswith(s) for s in suffixes):
            return name, v
    return None, None

def stats_delta(before, after, nops):
    """Prints 'reqs_per_op X' and, when the filesystem exports pipeline counters,
    'mut_per_txn Y' and 'txns Z' for the interval."""
    jb, ob = load_stats(before)
    ja, oa = load_stats(after)
    reqs = sum(ja["requests_per_core"]) - sum(jb["requests_per_core"])
    print(f"reqs_per_op {reqs / nops:.2f}")
    cb, ca = jb.get("counters") or {}, ja.get("counters") or {}
    tname, t1 = counter(ca, "txns_committed")
    mname, m1 = counter(ca, "mutations_in_txns", "mutations_committed")
    if tname and mname:
        dt = t1 - cb.get(tname, 0)
        dm = m1 - cb.get(mname, 0)
        print(f"txns {dt}")
        if dt > 0:
            print(f"mut_per_txn {dm / dt:.2f}")
    for label, suffix in (("read_txns_per_op", "read_txns"), ("commits_per_op", "txns_committed")):
        n, v = counter(ca, suffix)
        if n:
            print(f"{label} {(v - cb.get(n, 0)) / nops:.2f}")
    per_op = []
    for op, o in sorted(oa.items(), key=lambda kv: -kv[1]["count"]):
        d = o["count"] - ob.get(op, {}).get("count", 0)
        if d > 0 and op not in ("FORGET", "BATCH_FORGET"):
            per_op.append(f"{op}:{d / nops:.2f}")
    print("ops_per_file " + ",".join(per_op))
    # Counters already shown elsewhere, and gauges (sizes, levels), are left out.
    skip = ("read_txns", "txns_committed", "mutations_committed", "mutations_in_txns",
            "pending", "in_flight", "revision", "_max", "cache_inodes", "cache_dentries", "cache_dir_names")
    other = [f"{k} {v - cb.get(k, 0)}" for k, v in ca.items()
             if v != cb.get(k, 0) and not any(k.endswith(x) for x in skip)]
    print("counter_deltas " + (", ".join(other) if other else "none"))

def perf_ops(path, wanted):
    """One line per op in `wanted` (or every op): op count p50 stage=p50,..."""
    j, ops = load_stats(path)
    names = wanted.split(",") if wanted else [o for o in ops]
    for op in names:
        o = ops.get(op)
        if not o or o.get("p50_us") is None:
            continue
        st = ";".join(f'{k}={v["p50_us"]:.1f}' for k, v in o.get("stages", {}).items()
                      if v.get("p50_us") is not None)
        print(f'{op} {o["count"]} {o["p50_us"]:.1f} {st}')

# --- the report (python) --------------------------------------------------------------------

def load_results(path):
    r = {}
    for line in open(path):
        k, _, v = line.strip().partition(" ")
        if k:
            r.setdefault(k, []).append(v)
    return r

def report(res_path, diag_path):
    R = load_results(res_path)
    env = os.environ
    runs, deep = env["RUNS"], int(env["DEEP"])
    files, clients = int(env["FILES"]), int(env["CLIENTS"])

    def nums(k):
        out = []
        for v in R.get(k, []):
            try:
                out.append(float(v))
            except ValueError:
                pass
        return out

    def med(k):
        v = sorted(nums(k))
        return v[(len(v) - 1) // 2] if v else None  # lower median for an even count

    def fmt(x, d=0):
        return "n/a" if x is None else f"{x:,.{d}f}".replace(",", " ") if x >= 10000 else f"{x:.{d}f}"

    def cell(k, d=0):
        v = sorted(nums(k))
        if not v:
            return "n/a"
        m = v[(len(v) - 1) // 2]
        return fmt(m, d) if len(v) == 1 else f"{fmt(m, d)} ({fmt(v[0], d)}–{fmt(v[-1], d)})"

    def ratio(a, b):
        x, y = med(a), med(b)
        if x is None or not y:
            return None
        return x / y

    def rfmt(x):
        return "n/a" if x is None else f"{x:.2f}x"

    def paired(a, b):
        # etcfs / raw within each repetition (both measured minutes apart at most), so a
        # change in the host between repetitions moves both sides of a ratio alike.
        x, y = nums(a), nums(b)
        if not x or len(x) != len(y):
            return "n/a"
        r = sorted(i / j for i, j in zip(x, y) if j)
        if not r:
            return "n/a"
        m = r[(len(r) - 1) // 2]
        return rfmt(m) if len(r) == 1 else f"{rfmt(m)} ({r[0]:.2f}–{r[-1]:.2f})"

    out = []
    p = out.append
    if env.get("FIO_DONE") == "1":
        tr = ", ".join(sorted(set(R.get("transport.etcfs", []) + R.get("transport.deep", []))))
        p(f"### fio: etcfs vs the raw file (direct=1, io_uring, 1 job, {env['FIO_SIZE']} file, "
          f"{env['FIO_SECS']} s per run after 1 s ramp)")
        p("")
        head = "| workload | metric | raw file | etcfs | etcfs / raw | per repetition |"
        sep = "|---|---|---|---|---|---|"
        if deep:
            head += f" etcfs, {deep} ring entries per queue | that / raw |"
            sep += "---|---|"
        p(head + " goal |")
        p(sep + "---|")
        labels = {
            "seqread": ("1 MiB sequential read, QD 1", "mibs", "MiB/s", 0.9),
            "seqwrite": ("1 MiB sequential write, QD 1", "mibs", "MiB/s", 0.9),
            "randread-qd1": ("4 KiB random read, QD 1", "iops", "IOPS", 0.7),
            "randread-qd32": ("4 KiB random read, QD 32", "iops", "IOPS", 0.7),
            "randwrite-qd1": ("4 KiB random write, QD 1", "iops", "IOPS", None),
            "randwrite-qd32": ("4 KiB random write, QD 32", "iops", "IOPS", None),
        }
        for name, (label, metric, unit, goal) in labels.items():
            k = lambda side, m=metric: f"fio.{side}.{name}.{m}"
            r1 = ratio(k("etcfs"), k("raw"))
            row = (f"| {label} | {unit} | {cell(k('raw'))} | {cell(k('etcfs'))} | {rfmt(r1)} "
                   f"| {paired(k('etcfs'), k('raw'))} |")
            if deep:
                row += f" {cell(k('deep'))} | {rfmt(ratio(k('deep'), k('raw')))} |"
            if goal is None:
                g = "—"
            else:
                g = f"≥ {goal}x: " + ("n/a" if r1 is None else "met" if r1 >= goal else "**not met**")
            p(row + f" {g} |")
            kp = lambda side: f"fio.{side}.{name}.p50"
            row = (f"| {label} | clat p50 µs | {cell(kp('raw'))} | {cell(kp('etcfs'))} "
                   f"| {rfmt(ratio(kp('etcfs'), kp('raw')))} | {paired(kp('etcfs'), kp('raw'))} |")
            if deep:
                row += f" {cell(kp('deep'))} | {rfmt(ratio(kp('deep'), kp('raw')))} |"
            p(row + " |")
        p("")
        p("etcfs / raw is the ratio of the medians, on which the goals (issue 3) are judged; per "
          "repetition is the median (min–max) of the ratios within each repetition, where both "
          "sides ran the job back to back (which first alternates between jobs and repetitions). "
          f"Transport serving the mounts: {tr or 'n/a'}.")
        p("")
    if env.get("META_DONE") == "1":
        p(f"### Metadata, one client: {files} files in one directory (etcd: one member, loopback)")
        p("")
        p("| operation | etcfs ops/s | etcfs p50 µs | FUSE requests per op | etcd commits per op (revisions) "
          "| etcd read txns per op (fs counters) | etcd request of the same shape | etcd serial ops/s "
          "| etcd p50 µs | etcfs / etcd serial |")
        p("|---|---|---|---|---|---|---|---|---|---|")
        shapes = {
            "create": ("create", "txn: 1 compare + 2 puts"),
            "stat": ("get", "range read of 1 key"),
            "unlink": ("unlink", "txn: 1 compare + 2 deletes"),
        }
        for ph, (kind, shape) in shapes.items():
            m = f"meta.c1.{ph}"
            e = f"txn.c1.{kind}"
            p(f"| {ph} | {cell(m + '.ops')} | {cell(m + '.p50')} | {cell(m + '.reqs', 2)} | "
              f"{cell(m + '.revs_per_op', 2)} | {cell(m + '.read_txns', 2)} | {shape} | {cell(e + '.ops')} | {cell(e + '.p50')} | "
              f"{rfmt(ratio(m + '.ops', e + '.ops'))} |")
        p("")
        p("create = open(O_CREAT|O_EXCL) + close; stat = stat(2); unlink = unlink(2). The etcd "
          "column is `benches/etcd_txn.rs` (one request at a time through `meta::etcd::EtcdBackend`, "
          "on the pipeline's runtime thread), run in the same repetitions against the same etcd.")
        p("")
        p(f"### Metadata, {clients} concurrent clients ({files // clients} files each) vs one client ({files} files)")
        p("")
        p("| clients | directories | phase | etcfs ops/s (aggregate) | vs 1 client | p50 µs per op "
          "| mutations per etcd txn (revision delta) | mutations per etcd txn (fs counters) "
          "| etcd, same-shaped requests, as many in flight as clients, ops/s |")
        p("|---|---|---|---|---|---|---|---|---|")
        layouts = (("c1", "1", "1"), ("ck", str(clients), "1 shared"), ("cd", str(clients), "one per client"))
        for lab, ncl, dirs in layouts:
            for ph, (kind, _) in shapes.items():
                m, m1 = f"meta.{lab}.{ph}", f"meta.c1.{ph}"
                if not nums(m + ".ops"):
                    continue
                if ph == "stat":
                    mpt = f"— ({fmt(med(m + '.revs'))} revisions)"
                    mptc = "—"
                else:
                    mpt = cell(m + ".mut_per_rev", 2)
                    mptc = cell(m + ".mut_per_txn", 2) if nums(m + ".mut_per_txn") else "not exported"
                vs1 = "—" if lab == "c1" else rfmt(ratio(m + ".ops", m1 + ".ops"))
                etcd = cell(f"txn.{'c1' if lab == 'c1' else 'ck'}.{kind}.ops")
                p(f"| {ncl} | {dirs} | {ph} | {cell(m + '.ops')} | {vs1} | {cell(m + '.p50')} | {mpt} | {mptc} | {etcd} |")
        p("")
        c1 = cell("meta.c1.create.mut_per_rev", 2)
        p(f"Mutations per etcd txn by revision delta = files changed in the phase / etcd revisions the "
          f"phase added (each etcd write transaction adds one revision; coalesced directory-timestamp "
          f"writes and inode-number reservations count as transactions too). One client, create: {c1}.")
        p("")
    if os.path.exists(diag_path) and os.path.getsize(diag_path):
        p("### Where the time goes (one extra run with `--perf`, not part of the medians)")
        p("")
        p("Per FUSE operation: count, p50 of the whole request and p50 of its stages as `etcfs stats` "
          "reports them (queue_wait: ring to handler; handler: synchronous handler work; device_io: "
          "the data read; the rest of a request's time is the deferred wait, e.g. for etcd).")
        p("")
        p("| pass | FUSE op | count | p50 µs | stage p50 µs |")
        p("|---|---|---|---|---|")
        phases = {}
        for line in open(diag_path):
            f = line.rstrip("\n").split(" ", 2)
            if len(f) < 3:
                continue
            if f[1] in ("ops_per_file", "read_txns_per_op", "commits_per_op", "counter_deltas"):
                phases.setdefault(f[0], {})[f[1]] = f[2]
                continue
            g = f[2].split(" ")
            st = g[2].replace(";", ", ") if len(g) > 2 else ""
            p(f"| {f[0]} | {f[1]} | {g[0]} | {g[1]} | {st} |")
        p("")
        if phases:
            p("Per metadata phase of that run, per file: the FUSE requests the daemon served, etcd "
              "commits and pipeline read transactions (the filesystem's counters), and the other "
              "counters that moved in the phase (totals).")
            p("")
            p("| pass | FUSE requests per file | etcd commits per file | etcd read txns per file | other counter deltas |")
            p("|---|---|---|---|---|")
            for ph, d in phases.items():
                ops = d.get("ops_per_file", "").replace(",", ", ").replace(":", " ")
                p(f"| {ph} | {ops} | {d.get('commits_per_op', 'n/a')} | {d.get('read_txns_per_op', 'n/a')} "
                  f"| {d.get('counter_deltas', 'n/a')} |")
            p("")
    p(f"Cells: median of {runs} runs (min–max).")
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
    if cmd == "cargo-exe":
        cargo_exe(*args)
    elif cmd == "fio":
        fio(*args)
    elif cmd == "etcd-rev":
        etcd_rev()
    elif cmd == "stats-delta":
        stats_delta(args[0], args[1], int(args[2]))
    elif cmd == "perf-ops":
        perf_ops(args[0], args[1] if len(args) > 1 else "")
    elif cmd == "transport":
        print(json.load(sys.stdin)["transport"])
    elif cmd == "report":
        report(*args)
    elif cmd == "write-doc":
        write_doc(*args)
    else:
        sys.exit(f"fsbench.py: unknown command {cmd}")
PYEOF
py() { python3 "$PY" "$@"; }

if [ $BUILD = 1 ]; then
	log "building etcfs and benches/etcd_txn.rs (release)"
	(cd "$ROOT" && cargo build --release --bin etcfs) >"$WORK/cargo-build.log" 2>&1 ||
		{ tail -30 "$WORK/cargo-build.log" >&2; die "cargo build --release failed (or use --no-build)"; }
	TXN_BENCH=$(cd "$ROOT" && cargo bench --bench etcd_txn --no-run --message-format=json 2>"$WORK/cargo-bench.log" |
		py cargo-exe etcd_txn)
	[ -n "$TXN_BENCH" ] && [ -x "$TXN_BENCH" ] ||
		{ tail -30 "$WORK/cargo-bench.log" >&2; die "cannot build benches/etcd_txn.rs (or use --no-build)"; }
else
	# The newest etcd_txn the bench profile built.
	TXN_BENCH=$(ls -t "$TARGET_DIR"/release/deps/etcd_txn-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
	[ -n "$TXN_BENCH" ] && [ -x "$TXN_BENCH" ] || [ "$DO_META" = 0 ] ||
		die "--no-build: no built etcd_txn in $TARGET_DIR/release/deps"
	log "--no-build: using $ETCFS ($(date -r "$ETCFS" '+%F %T')) and ${TXN_BENCH:-no etcd_txn}"
fi
[ -x "$ETCFS" ] || die "no $ETCFS"
# Private copies: the target directory is shared, and another build may replace the binaries
# while this runs.
BUILT_AT=$(date -r "$ETCFS" -u '+%F %H:%M UTC')
# What was built: the commit, and the source files that differed from it at build time.
SOURCE=$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(cd "$ROOT" && git status --porcelain -- src meta fusedev uring perf 2>/dev/null |
	awk '{print $2}' | paste -sd' ' - || true)
[ -z "$dirty" ] || SOURCE="$SOURCE with uncommitted changes to: $dirty"
[ -z "$ETCFS_ARG" ] || SOURCE="the binary $ETCFS_ARG ($("$ETCFS" --version 2>/dev/null || echo 'version unknown'))"
cp "$ETCFS" "$WORK/etcfs"
[ -z "$TXN_BENCH" ] || cp "$TXN_BENCH" "$WORK/etcd_txn"
ETCFS=$WORK/etcfs
TXN_BENCH=$WORK/etcd_txn
gcc -O2 -Wall "$ROOT/benches/meta_rates.c" -o "$WORK/meta_rates" || die "cannot build meta_rates"

# --- etcd and the filesystem ---------------------------------------------------------------

port_free() { ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }
PORT=""
for _ in $(seq 100); do
	p=$((20000 + RANDOM % 10000))
	if port_free "$p" && port_free $((p + 1)); then PORT=$p; break; fi
done
[ -n "$PORT" ] || die "no free loopback port pair found"
ETCD_URL=http://127.0.0.1:$PORT
log "starting etcd on $ETCD_URL (data in $WORK/etcd)"
etcd --name fsbench --data-dir "$WORK/etcd" \
	--listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
	--listen-peer-urls "http://127.0.0.1:$((PORT + 1))" \
	--initial-advertise-peer-urls "http://127.0.0.1:$((PORT + 1))" \
	--initial-cluster "fsbench=http://127.0.0.1:$((PORT + 1))" >"$WORK/etcd.log" 2>&1 &
ETCD_PID=$!
for _ in $(seq 100); do
	etcdctl --endpoints "$ETCD_URL" endpoint health >/dev/null 2>&1 && break
	kill -0 "$ETCD_PID" 2>/dev/null || { cat "$WORK/etcd.log" >&2; die "etcd exited"; }
	sleep 0.1
done
etcdctl --endpoints "$ETCD_URL" endpoint health >/dev/null 2>&1 || die "etcd not healthy within 10 s"
etcd_rev() { etcdctl --endpoints "$ETCD_URL" endpoint status -w json | py etcd-rev; }

FIO_BYTES=$(numfmt --from=iec "${FIO_SIZE%B}")
DEV_BYTES=$((FIO_BYTES * 2 + (2 << 30)))
truncate -s "$DEV_BYTES" "$DEV_IMG"
PREFIX=fsbench
"$ETCFS" mkfs --etcd "$ETCD_URL" --device "$DEV_IMG" --prefix "$PREFIX" >"$WORK/mkfs.log" 2>&1 ||
	{ cat "$WORK/mkfs.log" >&2; die "etcfs mkfs failed"; }
log "$(cat "$WORK/mkfs.log")"
mkdir -p "$MNT"

# mount_etcfs LABEL [MOUNT OPTIONS...]: mounts the filesystem on $MNT in the foreground, as a
# child of this script (so its pid is known), and sets TRANSPORT to what serves it.
mount_etcfs() {
	local label=$1
	shift
	[ -z "$DAEMON_PID" ] || die "internal: mount while mounted"
	"$ETCFS" mount --etcd "$ETCD_URL" --device "$DEV_IMG" --prefix "$PREFIX" --foreground \
		"$@" "$MNT" >>"$WORK/daemon-$label.log" 2>&1 &
	DAEMON_PID=$!
	for _ in $(seq 200); do
		mountpoint -q "$MNT" && break
		if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
			DAEMON_PID=""
			cat "$WORK/daemon-$label.log" >&2
			die "etcfs mount ($label) exited before mounting"
		fi
		sleep 0.05
	done
	mountpoint -q "$MNT" || die "etcfs ($label) not mounted within 10 s"
	# The control socket `etcfs stats` talks to may come up just after the mount.
	TRANSPORT=""
	for _ in $(seq 50); do
		TRANSPORT=$("$ETCFS" stats "$MNT" --json 2>/dev/null | py transport 2>/dev/null) && break
		sleep 0.1
	done
	[ -n "$TRANSPORT" ] || die "etcfs stats $MNT does not answer"
}

unmount_etcfs() {
	umount "$MNT" || die "umount $MNT failed"
	for _ in $(seq 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
	kill -0 "$DAEMON_PID" 2>/dev/null && die "etcfs daemon $DAEMON_PID did not exit after umount"
	local rc=0
	wait "$DAEMON_PID" 2>/dev/null || rc=$?
	[ $rc = 0 ] || log "etcfs daemon exited with status $rc"
	DAEMON_PID=""
}

snap_stats() { "$ETCFS" stats "$MNT" --json >"$1"; }

# Results: lines "KEY VALUE" in $RES; the report takes medians over runs.
RES=$WORK/results
DIAG=$WORK/diag
: >"$RES"
: >"$DIAG"
record() { echo "$1 $2" >>"$RES"; }
kv() { tr ' ' '\n' <<<"$2" | sed -n "s/^$1=//p"; }

# --- 1. fio --------------------------------------------------------------------------------

# name rw bs iodepth
FIO_JOBS=(
	"seqread read 1m 1"
	"seqwrite write 1m 1"
	"randread-qd1 randread 4k 1"
	"randread-qd32 randread 4k 32"
	"randwrite-qd1 randwrite 4k 1"
	"randwrite-qd32 randwrite 4k 32"
)
if [ -n "$FIO_ONLY" ]; then
	kept=()
	for job in "${FIO_JOBS[@]}"; do
		[[ ",$FIO_ONLY," == *",${job%% *},"* ]] && kept+=("$job")
	done
	[ ${#kept[@]} -gt 0 ] || die "--fio-jobs $FIO_ONLY: no such job"
	FIO_JOBS=("${kept[@]}")
fi
FIO_COMMON=(--direct=1 --ioengine=io_uring --numjobs=1 --size="$FIO_SIZE" --time_based
	--runtime="$FIO_SECS" --ramp_time=1 --randrepeat=1 --norandommap)

# run_fio FILE NAME RW BS QD -> "MiB/s IOPS clat-p50-µs" of the direction that moved data
run_fio() {
	local out=$WORK/fio-last.json
	fio --name="$2" --filename="$1" --rw="$3" --bs="$4" --iodepth="$5" "${FIO_COMMON[@]}" \
		--output-format=json --output="$out" >/dev/null 2>"$out.err" ||
		{ cat "$out.err" >&2; die "fio $2 on $1 failed"; }
	py fio "$out" "$3"
}

layout() { # FILE
	fio --name=layout --filename="$1" --rw=write --bs=1m --iodepth=4 --direct=1 \
		--ioengine=io_uring --size="$FIO_SIZE" >"$WORK/layout.log" 2>&1 ||
		{ cat "$WORK/layout.log" >&2; die "laying out $1 failed"; }
}

FIO_DONE=0
if [ $DO_FIO = 1 ]; then
	log "fio: laying out $FIO_SIZE on the raw file and in etcfs"
	layout "$RAW_FILE"
	mount_etcfs layout
	layout "$MNT/fio.dat"
	unmount_etcfs
	# fio_job RUN SIDE FILE NAME RW BS QD: one fio job, its figures recorded for the report.
	fio_job() {
		local run=$1 side=$2 file=$3 name=$4 rw=$5 bs=$6 qd=$7 vals mibs iops p50
		vals=$(run_fio "$file" "$name" "$rw" "$bs" "$qd")
		log "fio run $run/$RUNS $side $name: MiB/s IOPS p50-µs = $vals"
		read -r mibs iops p50 <<<"$vals"
		record "fio.$side.$name.mibs" "$mibs"
		record "fio.$side.$name.iops" "$iops"
		record "fio.$side.$name.p50" "$p50"
	}
	for run in $(seq "$RUNS"); do
		# Each job on both sides back to back, raw first in every other job (and the other
		# way round in the next repetition), so that the two sides of a ratio see the host
		# in the same state: the raw file's 1 MiB write rate moved by 1.5x within minutes.
		mount_etcfs fio
		record "transport.etcfs" "$TRANSPORT"
		j=0
		for job in "${FIO_JOBS[@]}"; do
			read -r name rw bs qd <<<"$job"
			if [ $(((run + j) % 2)) = 1 ]; then order=(raw etcfs); else order=(etcfs raw); fi
			for side in "${order[@]}"; do
				if [ "$side" = raw ]; then file=$RAW_FILE; else file=$MNT/fio.dat; fi
				fio_job "$run" "$side" "$file" "$name" "$rw" "$bs" "$qd"
			done
			j=$((j + 1))
		done
		unmount_etcfs
		if [ "$DEEP" -gt 0 ]; then
			mount_etcfs fio-deep --ring-entries-per-queue "$DEEP"
			record "transport.deep" "$TRANSPORT"
			for job in "${FIO_JOBS[@]}"; do
				read -r name rw bs qd <<<"$job"
				fio_job "$run" deep "$MNT/fio.dat" "$name" "$rw" "$bs" "$qd"
			done
			unmount_etcfs
		fi
	done
	FIO_DONE=1
fi

# --- 2 and 3. metadata ---------------------------------------------------------------------

META_MOUNT=(--attr-timeout "$META_TIMEOUT" --entry-timeout "$META_TIMEOUT")
PAUSE=$(awk -v t="$META_TIMEOUT" 'BEGIN{print (t > 0) ? t + 0.5 : 0}')

# txn_bench LABEL CONCURRENCY: same-shaped etcd requests, FILES of each kind.
txn_bench() {
	local out line kind
	out=$("$TXN_BENCH" --etcd "$ETCD_URL" --prefix fsbench-txn --ops "$FILES" --concurrency "$2") ||
		die "etcd_txn failed: $out"
	while read -r line; do
		kind=$(kv kind "$line")
		log "etcd run $run/$RUNS $1: $line"
		record "txn.$1.$kind.ops" "$(kv ops_per_s "$line")"
		record "txn.$1.$kind.p50" "$(kv p50_us "$line")"
	done <<<"$out"
}

# meta_phases LABEL CLIENTS [-d]: create, stat, unlink of FILES files in a new directory
# (with -d, in one subdirectory per client).
meta_phases() {
	local label=$1 clients=$2 own=${3:-} dir per phase line r0 r1 revs
	dir=$MNT/meta-r$run-$label
	per=$((FILES / clients))
	mkdir "$dir"
	for phase in create stat unlink; do
		# Let the kernel's cached names and attributes from the previous phase expire, so
		# that every call of this phase reaches the daemon at least once.
		[ $phase = create ] || sleep "$PAUSE"
		r0=$(etcd_rev)
		snap_stats "$WORK/s0.json"
		line=$("$WORK/meta_rates" -p "$phase" -n "$per" -c "$clients" $own "$dir") ||
			die "meta_rates $phase ($clients clients) failed: $line"
		r1=$(etcd_rev)
		snap_stats "$WORK/s1.json"
		revs=$((r1 - r0))
		log "meta run $run/$RUNS $label: $line etcd_revisions=$revs"
		record "meta.$label.$phase.ops" "$(kv ops_per_s "$line")"
		record "meta.$label.$phase.p50" "$(kv p50_us "$line")"
		record "meta.$label.$phase.revs" "$revs"
		record "meta.$label.$phase.revs_per_op" "$(awk -v r="$revs" -v n="$FILES" 'BEGIN{printf "%.3f", r / n}')"
		[ "$revs" -gt 0 ] &&
			record "meta.$label.$phase.mut_per_rev" "$(awk -v r="$revs" -v n="$FILES" 'BEGIN{printf "%.3f", n / r}')"
		while read -r k v; do
			case $k in
			reqs_per_op) record "meta.$label.$phase.reqs" "$v" ;;
			mut_per_txn) record "meta.$label.$phase.mut_per_txn" "$v" ;;
			read_txns_per_op) record "meta.$label.$phase.read_txns" "$v" ;;
			esac
		done < <(py stats-delta "$WORK/s0.json" "$WORK/s1.json" "$FILES")
	done
	rmdir "$dir"
}

META_DONE=0
if [ $DO_META = 1 ]; then
	for run in $(seq "$RUNS"); do
		# Alternate which side goes first.
		if [ $((run % 2)) = 1 ]; then
			txn_bench c1 1
			txn_bench ck "$CLIENTS"
		fi
		mount_etcfs meta "${META_MOUNT[@]}"
		meta_phases c1 1
		meta_phases ck "$CLIENTS"
		meta_phases cd "$CLIENTS" -d
		unmount_etcfs
		if [ $((run % 2)) = 0 ]; then
			txn_bench c1 1
			txn_bench ck "$CLIENTS"
		fi
	done
	META_DONE=1
fi

# --- where the time goes: one pass with --perf ---------------------------------------------

if [ $DO_PERF = 1 ]; then
	if [ $FIO_DONE = 1 ]; then
		for job in "${FIO_JOBS[@]}"; do
			read -r name rw bs qd <<<"$job"
			mount_etcfs "perf-$name" --perf
			vals=$(run_fio "$MNT/fio.dat" "$name" "$rw" "$bs" "$qd")
			log "perf pass fio $name: MiB/s IOPS p50-µs = $vals"
			snap_stats "$WORK/perf.json"
			op=READ
			[[ $rw == *write* ]] && op=WRITE
			py perf-ops "$WORK/perf.json" "$op" | sed "s/^/fio:$name /" >>"$DIAG"
			unmount_etcfs
		done
	fi
	if [ $META_DONE = 1 ]; then
		for variant in 1 "$CLIENTS" "$CLIENTS -d"; do
			read -r clients own <<<"$variant"
			label="meta-${clients}c"
			[ -n "$own" ] && label="meta-${clients}c-own-dirs"
			mount_etcfs "perf-$label" --perf "${META_MOUNT[@]}"
			dir=$MNT/perf-$label
			mkdir "$dir"
			for phase in create stat unlink; do
				[ $phase = create ] || sleep "$PAUSE"
				snap_stats "$WORK/s0.json"
				line=$("$WORK/meta_rates" -p "$phase" -n $((FILES / clients)) -c "$clients" $own "$dir") ||
					die "meta_rates $phase failed: $line"
				snap_stats "$WORK/s1.json"
				log "perf pass $label: $line"
				py stats-delta "$WORK/s0.json" "$WORK/s1.json" "$FILES" |
					grep -E '^(ops_per_file|read_txns_per_op|commits_per_op|counter_deltas) ' |
					sed "s/^/$label:$phase($(kv ops_per_s "$line")\/s) /" >>"$DIAG"
			done
			snap_stats "$WORK/perf.json"
			py perf-ops "$WORK/perf.json" LOOKUP,CREATE,GETATTR,FLUSH,RELEASE,UNLINK |
				sed "s/^/$label /" >>"$DIAG"
			rmdir "$dir"
			unmount_etcfs
		done
	fi
fi

# --- report --------------------------------------------------------------------------------

TABLES=$WORK/tables.md
RUNS=$RUNS DEEP=$DEEP FILES=$FILES CLIENTS=$CLIENTS FIO_SIZE=$FIO_SIZE FIO_SECS=$FIO_SECS \
	FIO_DONE=$FIO_DONE META_DONE=$META_DONE py report "$RES" "$DIAG" >"$TABLES"
echo
cat "$TABLES"

if [ $WRITE_DOC = 1 ]; then
	DOC=$ROOT/docs/benchmarks.md
	SECTION=$WORK/section.md
	commit=$SOURCE
	[ $BUILD = 1 ] || commit="$commit; --no-build: binary of $BUILT_AT"
	cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
	mem=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
	fsdev=$(findmnt -no FSTYPE -T "$(dirname "$DEV_IMG")" 2>/dev/null || echo '?')
	fsetcd=$(findmnt -no FSTYPE -T "$WORK" 2>/dev/null || echo '?')
	{
		echo "## Filesystem: etcfs on etcd + a device image vs raw file and raw etcd (issue 3)"
		echo
		echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
		echo "- machine: $(nproc) CPUs (${cpu:-?}), $mem RAM, kernel $(uname -r); shared and noisy (other builds run beside it)"
		echo "- etcfs: $commit; \`etcfs mount --etcd URL --device IMG --foreground\` (transport auto), default workers (one per CPU), default ring depth (automatic: 256 MiB of 1 MiB buffers over the CPU queues, 8 to 32 per queue: $(( q = 256 / $(nproc --all), q < 8 ? 8 : (q > 32 ? 32 : q) )) here)"
		echo "- etcd: $(etcd --version | head -1 | sed 's/etcd Version: //'), one member on loopback, data dir on $fsetcd; etcfs device: sparse $((DEV_BYTES >> 30)) GiB image file on $fsdev (/var/tmp), opened by etcfs with O_DIRECT; raw side: a $FIO_SIZE file beside it"
		echo "- fio $(fio --version | sed 's/^fio-//'): \`--direct=1 --ioengine=io_uring --numjobs=1 --size=$FIO_SIZE --time_based --runtime=$FIO_SECS --ramp_time=1 --randrepeat=1 --norandommap\`, files laid out first by one 1 MiB write pass"
		echo "- metadata mounts: \`--attr-timeout $META_TIMEOUT --entry-timeout $META_TIMEOUT\` and a pause of that + 0.5 s before the stat and unlink phases (so those calls reach the daemon, not the kernel's cache); clients: \`benches/meta_rates.c\`; etcd floor: \`benches/etcd_txn.rs\` (\`cargo bench --bench etcd_txn\`)"
		echo "- command: \`bash benches/fs.sh${ORIG_ARGS[*]:+ ${ORIG_ARGS[*]}}\`"
		echo
		cat "$TABLES"
	} >"$SECTION"
	py write-doc "$DOC" "$SECTION" \
		"<!-- benches/fs.sh: begin (generated; edit the script, not this section) -->" \
		"<!-- benches/fs.sh: end -->"
	log "wrote the fs.sh section of $DOC"
fi
