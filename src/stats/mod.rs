//! A mount's statistics: the reports `etcfs stats` asks the daemon for over the control
//! socket (a table, JSON, the Prometheus text, a reset), the `--metrics` HTTP endpoint,
//! and the client side of `etcfs stats` (one report, `--watch`, `--reset`).
//!
//! A reset takes a baseline rather than zeroing anything: the workers' cells are written
//! without atomic read-modify-writes by their owner only, and a store from here could be
//! lost under theirs. Reports over the control socket show what came after the baseline;
//! the Prometheus metrics stay cumulative since mount, as scrapers expect of counters, so
//! an operator's reset never looks like a daemon restart to them.

pub(crate) mod http;
mod names;
mod prometheus;
mod watch;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
};

use anyhow::Result;
use fusedev::server::Handler;

use crate::control::{self, Ask};

/// Where a mount's numbers come from.
pub(crate) struct Stats {
    registry: Arc<perf::Registry>,
    handler: Arc<dyn Handler>,
    transport: String,
    baseline: Mutex<Option<Baseline>>,
}

/// What everything held at the last `etcfs stats --reset`.
struct Baseline {
    perf: perf::Baseline,
    /// The filesystem's counters then (gauges are never taken off).
    counters: HashMap<String, u64>,
}

impl Stats {
    pub(crate) fn new(
        registry: Arc<perf::Registry>,
        handler: Arc<dyn Handler>,
        transport: String,
    ) -> Stats {
        Stats {
            registry,
            handler,
            transport,
            baseline: Mutex::new(None),
        }
    }

    /// The report `etcfs stats` shows: everything since mount or the last reset.
    pub(crate) fn report(&self) -> perf::Report {
        let base = self.baseline.lock().unwrap_or_else(PoisonError::into_inner);
        let mut r = self.registry.snapshot_since(base.as_ref().map(|b| &b.perf));
        r.transport = self.transport.clone();
        let mut counters = self.handler.counters();
        if let Some(b) = base.as_ref() {
            for (name, v) in &mut counters {
                if let Some(then) = b.counters.get(name.as_str()) {
                    if names::is_counter(name) {
                        *v = v.saturating_sub(*then);
                    }
                }
            }
        }
        r.counters.extend(counters);
        r
    }

    /// Makes later reports start from now.
    pub(crate) fn reset(&self) {
        let mut base = self.baseline.lock().unwrap_or_else(PoisonError::into_inner);
        *base = Some(Baseline {
            perf: self.registry.baseline(),
            counters: self.handler.counters().into_iter().collect(),
        });
    }

    /// The Prometheus text exposition, cumulative since mount.
    pub(crate) fn prometheus(&self) -> String {
        prometheus::Snapshot {
            export: self.registry.export(&prometheus::latency_bounds_ns()),
            counters: self.handler.counters(),
            transport: self.transport.clone(),
            histograms: self.registry.histograms_enabled(),
        }
        .encode()
    }

    /// The control socket's answer to `ask`.
    pub(crate) fn answer(&self, ask: Ask) -> String {
        match ask {
            Ask::Text => self.report().to_text(),
            Ask::Json => self.report().to_json(),
            Ask::Prometheus => self.prometheus(),
            Ask::Reset => {
                self.reset();
                control::RESET_DONE.to_owned()
            }
        }
    }
}

/// `etcfs stats`.
#[derive(clap::Args, Debug)]
pub(crate) struct StatsArgs {
    /// Where the filesystem is mounted.
    pub(crate) mountpoint: PathBuf,
    /// Print one JSON object instead of a table (with --watch: one object per interval).
    #[arg(long, conflicts_with = "prometheus")]
    pub(crate) json: bool,
    /// Print one line per interval (default 1 s): requests/s, mean latency (with the
    /// mount's --perf), FUSE and device throughput, etcd transactions/s, cache hit rate.
    /// Until interrupted (SIGINT or SIGTERM: exit status 0).
    #[arg(
        long,
        value_name = "SECS",
        num_args = 0..=1,
        default_missing_value = "1",
        conflicts_with_all = ["reset", "prometheus"]
    )]
    pub(crate) watch: Option<f64>,
    /// Start the counters of `etcfs stats` again from zero (the --metrics endpoint stays
    /// cumulative since mount, as Prometheus expects).
    #[arg(long, conflicts_with_all = ["json", "prometheus"])]
    pub(crate) reset: bool,
    /// Print the Prometheus text exposition (what --metrics serves), e.g. for
    /// node_exporter's textfile collector on a mount without --metrics.
    #[arg(long)]
    pub(crate) prometheus: bool,
}

/// Runs `etcfs stats`.
pub(crate) fn main(args: &StatsArgs) -> Result<()> {
    if let Some(secs) = args.watch {
        let every = watch::interval(secs)?;
        return watch::run(&args.mountpoint, every, args.json);
    }
    if args.reset {
        let mountpoint = control::ask(&args.mountpoint, Ask::Reset)?.0;
        println!(
            "etcfs: statistics of {} reset: `etcfs stats` counts from now (the --metrics \
             endpoint stays cumulative since mount)",
            mountpoint.display()
        );
        return Ok(());
    }
    let ask = if args.prometheus {
        Ask::Prometheus
    } else if args.json {
        Ask::Json
    } else {
        Ask::Text
    };
    let out = control::ask(&args.mountpoint, ask)?.1;
    print!("{out}");
    if !out.ends_with('\n') {
        println!();
    }
    Ok(())
}
