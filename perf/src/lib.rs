//! Profiling mode of the etcfs daemon: per-core request counters, HDR latency histograms per
//! op and per stage, and generic named counters, merged into a report only when someone reads
//! them.
//!
//! # Model
//!
//! The daemon runs one pinned worker per CPU. Each worker gets exactly one [`CoreRecorder`]
//! from the shared [`Registry`] and writes only into its own core's slot:
//!
//! * **Op counts and named counters** are always on. They are plain `AtomicU64` cells that
//!   only the owning core ever writes, with a relaxed load and store (no read-modify-write,
//!   so no locked instruction). The cells of different cores live on different cache lines,
//!   so two workers never bounce a line between them.
//! * **Latency histograms** exist only when the registry was built with `histograms: true`
//!   (the daemon's `--perf`). Each core keeps one histogram per (op, [`Stage`]) behind its own
//!   `Mutex`. On the hot path only the owning core takes that lock, so it is never contended
//!   except for the moment a reader merges; it is a per-core lock, never one shared between
//!   cores. When histograms are off, [`CoreRecorder::record`] is a branch on a bool, and
//!   [`CoreRecorder::timer`] hands out a [`Timer`] that never reads the clock.
//!
//! Why per core rather than one shared set: a shared histogram or counter would put a cache
//! line (and, for a histogram, a lock) that every core writes on every request in the middle
//! of the data path, which is exactly the cross-core traffic the thread-per-core design exists
//! to avoid. Recording costs the same on 1 core or 64.
//!
//! # Merging, and what it costs
//!
//! [`Registry::snapshot`] (called by the stats server thread, never by a worker) sums the
//! counters and merges the histograms with `Histogram::add`. Merging walks each core's
//! histograms in turn, holding that core's lock only while it adds that core's histograms, so
//! a worker waits at most for one core's worth of additions, once per snapshot. The work is
//! proportional to cores × (op, stage) pairs that have samples × the histogram's bucket count
//! (about 27 000 buckets for the bounds below), i.e. milliseconds, which is why snapshots are
//! taken on demand and not per request.
//!
//! # Bounds
//!
//! Every histogram tracks [`LATENCY_NS_MIN`] ..= [`LATENCY_NS_MAX`] (1 ns to 60 s) with
//! [`LATENCY_SIGFIGS`] significant digits and never resizes: resizing on the hot path would
//! allocate and skew the measurement. A longer latency is recorded as the maximum and counted
//! as saturated in the report. One histogram with these bounds takes about 216 KiB, so they
//! are allocated on the first sample of each (op, stage) on each core, not up front: a daemon
//! with 50 op names would otherwise reserve 60 MiB per core for ops that never run. Memory is
//! bounded by `cores × ops × stages` histograms, with [`CORES_MAX`] and [`OPS_MAX`] capping
//! the factors.
//!
//! # Usage
//!
//! `perf` knows nothing about FUSE, etcd or io_uring: the caller names its ops and counters at
//! construction and refers to them by index.
//!
//! ```
//! use perf::{Registry, Stage};
//!
//! const LOOKUP: usize = 0;
//! const ETCD_TXNS: usize = 0;
//!
//! let registry = Registry::new(vec!["lookup", "getattr"], vec!["etcd_txns"], 2, true);
//! let recorder = registry.core(0); // moved into the worker pinned to core 0
//!
//! let seen = recorder.timer(); // no clock read when histograms are off
//! recorder.count(LOOKUP);
//! // ... the handler runs ...
//! recorder.record_since(LOOKUP, Stage::Total, &seen);
//! recorder.add_counter(ETCD_TXNS, 1);
//!
//! let mut report = registry.snapshot(); // on the stats thread
//! report.transport = "fuse-uring".to_owned();
//! assert_eq!(report.ops[0].op, "lookup");
//! assert_eq!(report.ops[0].count, 1);
//! println!("{}", report.to_text());
//! ```

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod registry;
mod report;

use serde::{Deserialize, Serialize};

pub use crate::{
    registry::{Baseline, CoreRecorder, Export, LatencyBuckets, Registry, Timer},
    report::{OpReport, Report, StageReport},
};

/// Smallest latency a histogram tells apart from zero, in nanoseconds.
pub const LATENCY_NS_MIN: u64 = 1;
/// Largest latency a histogram tracks, in nanoseconds (60 s); longer samples saturate here.
pub const LATENCY_NS_MAX: u64 = 60_000_000_000;
/// Significant decimal digits every histogram keeps at every magnitude.
pub const LATENCY_SIGFIGS: u8 = 3;
/// Most cores one registry accepts.
pub const CORES_MAX: usize = 1024;
/// Most op names one registry accepts.
pub const OPS_MAX: usize = 256;
/// Most counter names one registry accepts.
pub const COUNTERS_MAX: usize = 256;

/// A part of a request's life whose latency is recorded separately.
///
/// Stages may overlap or nest (device I/O and etcd happen while the handler owns the request);
/// each one is its own distribution, and they are not expected to add up to `Total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The whole request, from the worker seeing it to the reply being handed back.
    Total,
    /// From the worker seeing the request to its handler starting.
    QueueWait,
    /// The op handler itself.
    Handler,
    /// Reads and writes on the shared block device.
    DeviceIo,
    /// Waiting for the metadata store (etcd) to answer or commit.
    Etcd,
    /// Encoding and submitting the reply.
    Reply,
}

impl Stage {
    /// Every stage, in report order.
    pub const ALL: [Stage; 6] = [
        Stage::Total,
        Stage::QueueWait,
        Stage::Handler,
        Stage::DeviceIo,
        Stage::Etcd,
        Stage::Reply,
    ];

    /// The stage's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Total => "total",
            Stage::QueueWait => "queue_wait",
            Stage::Handler => "handler",
            Stage::DeviceIo => "device_io",
            Stage::Etcd => "etcd",
            Stage::Reply => "reply",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_index_matches_all_order() {
        for (i, stage) in Stage::ALL.iter().enumerate() {
            assert_eq!(stage.index(), i);
        }
    }

    #[test]
    fn stage_name_matches_serde_name() {
        for stage in Stage::ALL {
            let json = serde_json::to_string(&stage).expect("a unit variant serializes");
            assert_eq!(json, format!("\"{}\"", stage.name()));
        }
    }
}
