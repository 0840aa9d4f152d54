//! `etcfs stats MOUNTPOINT --watch [SECS]`: one line per interval, computed from two
//! reports of the daemon, for someone changing `--cpus` or the ring flags and watching
//! what it does.

use std::{
    io::Write as _,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use signal_hook::consts::{SIGINT, SIGTERM};

use crate::control::{self, Ask};

/// Lines between two headers.
const HEADER_EVERY: usize = 20;
/// The shortest and longest interval accepted.
const INTERVAL_MIN: Duration = Duration::from_millis(100);
const INTERVAL_MAX: Duration = Duration::from_secs(3600);
/// How often a sleeping watch looks for a signal.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The caches whose hits and misses make the hit rate.
const CACHES: [&str; 4] = ["attr", "dentry", "negative", "dir_names"];

/// What one interval saw, per second.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Rates {
    /// Seconds since the watch started, at the end of the interval.
    pub(crate) t_s: f64,
    pub(crate) ops_per_s: f64,
    /// Mean time per request (needs the mount's `--perf`).
    pub(crate) mean_latency_us: Option<f64>,
    pub(crate) fuse_read_bytes_per_s: f64,
    pub(crate) fuse_write_bytes_per_s: f64,
    pub(crate) device_read_bytes_per_s: f64,
    pub(crate) device_write_bytes_per_s: f64,
    pub(crate) etcd_commit_txns_per_s: f64,
    pub(crate) etcd_read_txns_per_s: f64,
    /// Lookups answered by the daemon's caches, of all its cache lookups (none: `None`).
    pub(crate) cache_hit_ratio: Option<f64>,
}

fn counter(r: &perf::Report, name: &str) -> u64 {
    r.counters
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| *v)
}

impl Rates {
    /// The rates between two reports taken `secs` apart. A counter that went down (a
    /// reset in between) counts as no change.
    pub(crate) fn between(prev: &perf::Report, cur: &perf::Report, secs: f64, t_s: f64) -> Rates {
        let secs = secs.max(1e-9);
        let delta = |name: &str| counter(cur, name).saturating_sub(counter(prev, name));
        let per_s = |n: u64| n as f64 / secs;
        let ops_delta = |f: &dyn Fn(&perf::OpReport) -> f64| -> f64 {
            let then = |op: &str| prev.ops.iter().find(|p| p.op == op).map_or(0.0, f);
            cur.ops.iter().map(|o| (f(o) - then(&o.op)).max(0.0)).sum()
        };
        let requests = ops_delta(&|o| o.count as f64);
        let samples = ops_delta(&|o| o.samples as f64);
        let latency_sum = ops_delta(&|o| o.sum_us.unwrap_or(0.0));
        let hits: u64 = CACHES
            .iter()
            .map(|c| delta(&format!("cache_{c}_hits")))
            .sum();
        let misses: u64 = CACHES
            .iter()
            .map(|c| delta(&format!("cache_{c}_misses")))
            .sum();
        Rates {
            t_s,
            ops_per_s: requests / secs,
            mean_latency_us: (cur.histograms && samples > 0.0).then(|| latency_sum / samples),
            fuse_read_bytes_per_s: per_s(delta("fuse_read_bytes")),
            fuse_write_bytes_per_s: per_s(delta("fuse_write_bytes")),
            device_read_bytes_per_s: per_s(
                delta("device_read_bytes_worker") + delta("device_read_bytes_waiter"),
            ),
            device_write_bytes_per_s: per_s(
                delta("device_write_bytes_worker") + delta("device_write_bytes_waiter"),
            ),
            etcd_commit_txns_per_s: per_s(delta("etcd_txns_committed")),
            etcd_read_txns_per_s: per_s(delta("etcd_read_txns")),
            cache_hit_ratio: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
        }
    }

    /// The table's line for these rates (columns as in [`header`]).
    pub(crate) fn line(&self) -> String {
        let mib = |b: f64| format!("{:.1}", b / (1 << 20) as f64);
        format!(
            "{:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>6}",
            format!("{:.0}", self.t_s),
            count(self.ops_per_s),
            self.mean_latency_us
                .map_or("-".to_owned(), |us| format!("{us:.1}")),
            mib(self.fuse_read_bytes_per_s),
            mib(self.fuse_write_bytes_per_s),
            mib(self.device_read_bytes_per_s),
            mib(self.device_write_bytes_per_s),
            count(self.etcd_commit_txns_per_s),
            count(self.etcd_read_txns_per_s),
            self.cache_hit_ratio
                .map_or("-".to_owned(), |r| format!("{:.1}", r * 100.0)),
        )
    }
}

/// The table's header: what each column of [`Rates::line`] is.
pub(crate) fn header() -> String {
    format!(
        "{:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>6}\n{:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>6}",
        "", "", "mean", "fuse", "fuse", "device", "device", "etcd", "etcd", "cache",
        "secs", "ops/s", "lat_us", "rd_MiB/s", "wr_MiB/s", "rd_MiB/s", "wr_MiB/s", "txn/s",
        "read/s", "hit%",
    )
}

/// A rate as a whole number, shortened with k and M past what the column holds.
fn count(v: f64) -> String {
    if v < 99_999.5 {
        format!("{v:.0}")
    } else if v < 9_999_950.0 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{:.1}M", v / 1e6)
    }
}

/// `--watch SECS` as an interval.
pub(crate) fn interval(secs: f64) -> Result<Duration> {
    let d = Duration::try_from_secs_f64(secs).ok();
    match d {
        Some(d) if (INTERVAL_MIN..=INTERVAL_MAX).contains(&d) => Ok(d),
        _ => bail!(
            "--watch takes an interval between {} and {} seconds, got {secs}",
            INTERVAL_MIN.as_secs_f64(),
            INTERVAL_MAX.as_secs()
        ),
    }
}

fn fetch(mountpoint: &Path) -> Result<perf::Report> {
    let (_, json) = control::ask(mountpoint, Ask::Json)?;
    serde_json::from_str(&json).context("the daemon's report is not the JSON expected")
}

/// Prints a line every `every` until SIGINT or SIGTERM (then returns Ok), the daemon
/// goes away (an error), or stdout is closed (Ok: `| head` is done).
pub(crate) fn run(mountpoint: &Path, every: Duration, json: bool) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("install signal handlers")?;
    }
    let start = Instant::now();
    let mut prev = fetch(mountpoint)?;
    let mut prev_at = Instant::now();
    let mut next = prev_at + every;
    let mut out = std::io::stdout();
    let mut lines = 0_usize;
    loop {
        while Instant::now() < next {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            std::thread::sleep(SIGNAL_POLL.min(next.saturating_duration_since(Instant::now())));
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let cur = match fetch(mountpoint) {
            Ok(r) => r,
            Err(_) if stop.load(Ordering::Relaxed) => return Ok(()),
            Err(e) => return Err(e.context("the mount's daemon stopped answering")),
        };
        let now = Instant::now();
        let rates = Rates::between(
            &prev,
            &cur,
            now.duration_since(prev_at).as_secs_f64(),
            now.duration_since(start).as_secs_f64(),
        );
        let mut text = String::new();
        if json {
            text.push_str(&serde_json::to_string(&rates).expect("numbers serialise"));
        } else {
            if lines % HEADER_EVERY == 0 {
                text.push_str(&header());
                text.push('\n');
            }
            text.push_str(&rates.line());
        }
        text.push('\n');
        match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(e).context("write to stdout"),
        }
        lines += 1;
        prev = cur;
        prev_at = now;
        // Keeps the beat: a slow report does not push every later line back.
        next += every;
        if next < now {
            next = now + every;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &str, count: u64, samples: u64, sum_us: Option<f64>) -> perf::OpReport {
        perf::OpReport {
            op: name.into(),
            count,
            samples,
            sum_us,
            p50_us: None,
            p90_us: None,
            p99_us: None,
            p999_us: None,
            max_us: None,
            saturated: 0,
            stages: vec![],
        }
    }

    fn report(
        histograms: bool,
        ops: Vec<perf::OpReport>,
        counters: &[(&str, u64)],
    ) -> perf::Report {
        perf::Report {
            transport: "uring".into(),
            histograms,
            ops,
            requests_per_core: vec![],
            counters: counters
                .iter()
                .map(|(n, v)| ((*n).to_owned(), *v))
                .collect(),
        }
    }

    #[test]
    fn rates_are_differences_over_the_interval() {
        let prev = report(
            true,
            vec![op("READ", 100, 100, Some(5_000.0))],
            &[
                ("fuse_read_bytes", 1 << 20),
                ("device_read_bytes_worker", 0),
                ("etcd_txns_committed", 10),
                ("cache_attr_hits", 8),
                ("cache_attr_misses", 2),
            ],
        );
        let cur = report(
            true,
            vec![
                op("READ", 300, 300, Some(25_000.0)),
                op("LOOKUP", 100, 100, Some(20_000.0)),
            ],
            &[
                ("fuse_read_bytes", 5 << 20),
                ("device_read_bytes_worker", 2 << 20),
                ("device_read_bytes_waiter", 2 << 20),
                ("etcd_txns_committed", 30),
                ("etcd_read_txns", 4),
                ("cache_attr_hits", 38),
                ("cache_attr_misses", 2),
                ("cache_dentry_misses", 10),
            ],
        );
        let r = Rates::between(&prev, &cur, 2.0, 7.0);
        assert_eq!(r.ops_per_s, 150.0);
        // 300 new samples took 40 000 µs.
        assert_eq!(r.mean_latency_us, Some(40_000.0 / 300.0));
        assert_eq!(r.fuse_read_bytes_per_s, (2 << 20) as f64);
        assert_eq!(r.device_read_bytes_per_s, (2 << 20) as f64);
        assert_eq!(r.fuse_write_bytes_per_s, 0.0);
        assert_eq!(r.etcd_commit_txns_per_s, 10.0);
        assert_eq!(r.etcd_read_txns_per_s, 2.0);
        assert_eq!(r.cache_hit_ratio, Some(0.75));
        let line = r.line();
        assert_eq!(
            line.split_whitespace().collect::<Vec<_>>(),
            ["7", "150", "133.3", "2.0", "0.0", "2.0", "0.0", "10", "2", "75.0"]
        );
    }

    #[test]
    fn without_perf_or_lookups_those_columns_say_so() {
        let prev = report(false, vec![op("READ", 1, 0, None)], &[]);
        let cur = report(false, vec![op("READ", 11, 0, None)], &[]);
        let r = Rates::between(&prev, &cur, 1.0, 1.0);
        assert_eq!((r.mean_latency_us, r.cache_hit_ratio), (None, None));
        let line = r.line();
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((cols[2], cols[9]), ("-", "-"));
    }

    #[test]
    fn a_reset_between_two_reports_is_no_change_not_a_wrap() {
        let prev = report(
            false,
            vec![op("READ", 500, 0, None)],
            &[("etcd_txns_committed", 90)],
        );
        let cur = report(
            false,
            vec![op("READ", 5, 0, None)],
            &[("etcd_txns_committed", 3)],
        );
        let r = Rates::between(&prev, &cur, 1.0, 1.0);
        assert_eq!((r.ops_per_s, r.etcd_commit_txns_per_s), (0.0, 0.0));
    }

    #[test]
    fn header_and_lines_line_up() {
        let h = header();
        let r = Rates {
            t_s: 12345.0,
            ops_per_s: 123_456_789.0,
            mean_latency_us: Some(12345.6),
            fuse_read_bytes_per_s: 1e9,
            fuse_write_bytes_per_s: 1e9,
            device_read_bytes_per_s: 1e9,
            device_write_bytes_per_s: 1e9,
            etcd_commit_txns_per_s: 54_321.0,
            etcd_read_txns_per_s: 1.0,
            cache_hit_ratio: Some(1.0),
        };
        for l in h.lines() {
            assert_eq!(l.len(), r.line().len(), "{l:?} vs {:?}", r.line());
        }
        assert!(r.line().contains("123.5M"), "{}", r.line());
    }

    #[test]
    fn counts_shorten_past_their_column() {
        assert_eq!(count(0.4), "0");
        assert_eq!(count(99_999.0), "99999");
        assert_eq!(count(123_456.0), "123.5k");
        assert_eq!(count(12_345_678.0), "12.3M");
    }

    #[test]
    fn intervals_are_bounded() {
        assert_eq!(interval(1.0).unwrap(), Duration::from_secs(1));
        assert_eq!(interval(0.5).unwrap(), Duration::from_millis(500));
        for bad in [0.0, 0.01, -1.0, f64::NAN, 1e9] {
            assert!(interval(bad).is_err(), "{bad}");
        }
    }
}
