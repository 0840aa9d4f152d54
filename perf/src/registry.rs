//! The registry of per-core slots, the recorder each worker writes through, and the merge that
//! turns all slots into a [`Report`].

use std::{
    cell::Cell,
    cmp::Reverse,
    fmt,
    marker::PhantomData,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Instant,
};

use hdrhistogram::Histogram;

use crate::{
    report::{OpReport, Report, StageReport},
    Stage, CORES_MAX, COUNTERS_MAX, LATENCY_NS_MAX, LATENCY_NS_MIN, LATENCY_SIGFIGS, OPS_MAX,
};

const STAGES: usize = Stage::ALL.len();

/// Counters, op names and one recording slot per core, shared by the workers (each through
/// its own [`CoreRecorder`]) and the reader that calls [`Registry::snapshot`].
pub struct Registry {
    op_names: Vec<&'static str>,
    counter_names: Vec<&'static str>,
    histograms: bool,
    slots: Box<[CoreSlot]>,
}

/// The handle one worker records through. It is `Send` (move it into the worker thread) but
/// not `Sync`, and [`Registry::core`] hands out at most one per core at a time: that is what
/// lets the counters be bumped with a plain load and store instead of an atomic add.
pub struct CoreRecorder {
    registry: Arc<Registry>,
    core: usize,
    // Copied out of the registry so that the disabled check touches no shared memory.
    histograms: bool,
    // A `Cell` is `Send + !Sync`: sharing a recorder between threads would let two writers
    // race on the owner-only counters.
    _not_sync: PhantomData<Cell<()>>,
}

/// A start time for measuring a stage, taken only when histograms are on.
///
/// The default value is a disabled timer: recording from it does nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timer {
    start: Option<Instant>,
}

// Aligned so that two cores' slots (their lock word in particular) never share a cache line.
// 128 rather than 64 because adjacent-line prefetching pairs lines on common x86 parts.
#[repr(align(128))]
struct CoreSlot {
    claimed: AtomicBool,
    ops: OwnerCells,
    counters: OwnerCells,
    histograms: Mutex<CoreHistograms>,
}

const CELLS_PER_LINE: usize = 16;

#[repr(align(128))]
struct Line([AtomicU64; CELLS_PER_LINE]);

/// `u64` cells written by one core only. Whole aligned lines, so that the allocation of one
/// core's cells cannot end on the same cache line where another core's begins.
struct OwnerCells {
    lines: Box<[Line]>,
    len: usize,
}

/// One core's histograms, indexed by `op * STAGES + stage`; `None` until the first sample.
struct CoreHistograms {
    slots: Vec<Option<Recorded>>,
}

#[derive(Clone)]
struct Recorded {
    histogram: Histogram<u64>,
    // Samples above `LATENCY_NS_MAX`, recorded as the maximum.
    saturated: u64,
    // Every sample as recorded (clamped to the bound), summed: a mean over an interval is
    // the difference of two sums over the difference of two counts.
    sum_ns: u64,
}

/// What every count, counter and histogram of a [`Registry`] held at one moment, so that a
/// later report shows only what came after ([`Registry::snapshot_since`]): the `--reset`
/// of a stats view, which must not touch the cells the workers write without atomics.
///
/// Histograms are kept as their recorded (value, count) pairs, not whole: a whole one is
/// about 216 KiB, the pairs of a typical latency distribution a few KiB. So a baseline
/// takes at most ops × stages × (distinct values recorded) pairs.
#[derive(Clone, Debug, Default)]
pub struct Baseline {
    ops: Vec<u64>,
    counters: Vec<u64>,
    requests_per_core: Vec<u64>,
    histograms: Vec<Option<Sparse>>,
}

#[derive(Clone, Debug)]
struct Sparse {
    values: Vec<(u64, u64)>,
    saturated: u64,
    sum_ns: u64,
}

/// One (op, stage) latency distribution in fixed buckets, for exposition formats that
/// want cumulative buckets (Prometheus) rather than quantiles.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyBuckets {
    /// The op's name as registered.
    pub op: &'static str,
    /// Which part of the request.
    pub stage: Stage,
    /// Samples at or below each bound given to [`Registry::export`] and above the one
    /// before it (not cumulative), then one more entry for the samples above the last
    /// bound. A sample counts at the bottom of its histogram bucket, which lies within
    /// [`LATENCY_SIGFIGS`] significant digits of the value recorded.
    pub buckets: Vec<u64>,
    /// Samples in all buckets.
    pub count: u64,
    /// Sum of the samples, in nanoseconds (each clamped to [`LATENCY_NS_MAX`]).
    pub sum_ns: u64,
}

/// Everything recorded since the registry was made, unreduced: what a scraper of
/// cumulative metrics wants ([`Registry::export`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Export {
    /// Every op with at least one request, in registration order, with its count.
    pub ops: Vec<(&'static str, u64)>,
    /// Requests counted by each core, indexed by core.
    pub requests_per_core: Vec<u64>,
    /// Every registered counter, in registration order.
    pub counters: Vec<(&'static str, u64)>,
    /// Every (op, stage) with samples, ops in registration order, stages in
    /// [`Stage::ALL`] order; empty when histograms are off.
    pub latencies: Vec<LatencyBuckets>,
}

impl Registry {
    /// Creates a registry for `cores` workers.
    ///
    /// Op `i` and counter `i` are the `i`-th names given here, and reports use these names.
    /// With `histograms` false only counts and counters are kept, and no clock is read.
    ///
    /// # Panics
    ///
    /// If `cores` is 0 or above [`CORES_MAX`], if there are more than [`OPS_MAX`] op names or
    /// [`COUNTERS_MAX`] counter names, or if a name repeats (reports key by name).
    pub fn new(
        op_names: Vec<&'static str>,
        counter_names: Vec<&'static str>,
        cores: usize,
        histograms: bool,
    ) -> Arc<Registry> {
        assert!(cores > 0, "a registry needs at least one core");
        assert!(
            cores <= CORES_MAX,
            "{cores} cores exceed CORES_MAX ({CORES_MAX})"
        );
        assert!(
            op_names.len() <= OPS_MAX,
            "{} ops exceed OPS_MAX",
            op_names.len()
        );
        assert!(
            counter_names.len() <= COUNTERS_MAX,
            "{} counters exceed COUNTERS_MAX",
            counter_names.len()
        );
        assert_unique("op", &op_names);
        assert_unique("counter", &counter_names);

        let slots = (0..cores)
            .map(|_| CoreSlot {
                claimed: AtomicBool::new(false),
                ops: OwnerCells::new(op_names.len()),
                counters: OwnerCells::new(counter_names.len()),
                histograms: Mutex::new(CoreHistograms {
                    slots: if histograms {
                        vec![None; op_names.len() * STAGES]
                    } else {
                        Vec::new()
                    },
                }),
            })
            .collect();
        Arc::new(Registry {
            op_names,
            counter_names,
            histograms,
            slots,
        })
    }

    /// Hands out the recorder for `core`, to be moved into the worker pinned there. The core
    /// becomes available again when the recorder is dropped.
    ///
    /// # Panics
    ///
    /// If `core` is out of range, or its recorder is still alive: two writers on one core's
    /// owner-only cells would lose updates.
    pub fn core(self: &Arc<Self>, core: usize) -> CoreRecorder {
        let slot = self.slots.get(core).unwrap_or_else(|| {
            panic!(
                "core {core} out of range: the registry has {} cores",
                self.slots.len()
            )
        });
        let was_claimed = slot.claimed.swap(true, Ordering::Acquire);
        assert!(
            !was_claimed,
            "the recorder of core {core} is already handed out"
        );
        CoreRecorder {
            registry: Arc::clone(self),
            core,
            histograms: self.histograms,
            _not_sync: PhantomData,
        }
    }

    /// Whether latency histograms are recorded (the daemon's `--perf`).
    pub fn histograms_enabled(&self) -> bool {
        self.histograms
    }

    /// Sums every core's counts and counters and merges their histograms, as of now.
    ///
    /// Each core's lock is held only while that core's histograms are added in, so a worker
    /// is delayed by at most one core's share of the merge. Counts are read without stopping
    /// the workers, so a snapshot taken under load may be a few requests apart between ops.
    /// The returned report's `transport` is empty, for the caller to fill in.
    pub fn snapshot(&self) -> Report {
        self.snapshot_since(None)
    }

    /// [`Registry::snapshot`] less what `base` held: the counts, counters and latency
    /// distributions of what happened after it was taken.
    pub fn snapshot_since(&self, base: Option<&Baseline>) -> Report {
        let mut m = self.merge();
        if let Some(base) = base {
            m.subtract(base);
        }
        let Merged {
            op_counts,
            requests_per_core,
            counters,
            histograms: merged,
        } = m;

        let mut op_reports: Vec<OpReport> = op_counts
            .iter()
            .enumerate()
            .filter(|&(_, &count)| count > 0)
            .map(|(op, &count)| {
                let per_stage = merged.get(op * STAGES..(op + 1) * STAGES).unwrap_or(&[]);
                op_report(self.op_names[op], count, per_stage)
            })
            .collect();
        // Stable, so ties keep the caller's op order and reports diff cleanly.
        op_reports.sort_by_key(|op| Reverse(op.count));

        Report {
            transport: String::new(),
            histograms: self.histograms,
            ops: op_reports,
            requests_per_core,
            counters: self
                .counter_names
                .iter()
                .zip(counters)
                .map(|(name, n)| ((*name).to_owned(), n))
                .collect(),
        }
    }

    /// What everything holds now, for [`Registry::snapshot_since`].
    pub fn baseline(&self) -> Baseline {
        let m = self.merge();
        Baseline {
            ops: m.op_counts,
            counters: m.counters,
            requests_per_core: m.requests_per_core,
            histograms: m
                .histograms
                .iter()
                .map(|r| r.as_ref().map(Sparse::of))
                .collect(),
        }
    }

    /// Everything recorded since the registry was made, with each latency distribution
    /// counted into the buckets `bounds_ns` (ascending upper bounds, in nanoseconds).
    pub fn export(&self, bounds_ns: &[u64]) -> Export {
        debug_assert!(bounds_ns.windows(2).all(|w| w[0] < w[1]));
        let m = self.merge();
        let mut latencies = Vec::new();
        for (i, recorded) in m.histograms.iter().enumerate() {
            let Some(r) = recorded else { continue };
            let mut buckets = vec![0_u64; bounds_ns.len() + 1];
            for v in r.histogram.iter_recorded() {
                // The bottom of the sample's bucket: a sample exactly at a bound (round
                // numbers are common) counts below it, as it should.
                let low = r.histogram.lowest_equivalent(v.value_iterated_to());
                let at = bounds_ns.partition_point(|&b| b < low);
                buckets[at] += v.count_at_value();
            }
            latencies.push(LatencyBuckets {
                op: self.op_names[i / STAGES],
                stage: Stage::ALL[i % STAGES],
                count: buckets.iter().sum(),
                buckets,
                sum_ns: r.sum_ns,
            });
        }
        Export {
            ops: self
                .op_names
                .iter()
                .zip(&m.op_counts)
                .filter(|&(_, &n)| n > 0)
                .map(|(name, &n)| (*name, n))
                .collect(),
            requests_per_core: m.requests_per_core,
            counters: self.counter_names.iter().copied().zip(m.counters).collect(),
            latencies,
        }
    }

    fn merge(&self) -> Merged {
        let ops = self.op_names.len();
        let mut op_counts = vec![0_u64; ops];
        let mut requests_per_core = Vec::with_capacity(self.slots.len());
        let mut counters = vec![0_u64; self.counter_names.len()];
        let mut histograms: Vec<Option<Recorded>> = if self.histograms {
            vec![None; ops * STAGES]
        } else {
            Vec::new()
        };

        for slot in self.slots.iter() {
            let mut requests = 0_u64;
            for (op, total) in op_counts.iter_mut().enumerate() {
                let n = slot.ops.get(op);
                *total = total.wrapping_add(n);
                requests = requests.wrapping_add(n);
            }
            requests_per_core.push(requests);
            for (counter, total) in counters.iter_mut().enumerate() {
                *total = total.wrapping_add(slot.counters.get(counter));
            }
            if self.histograms {
                merge_into(&mut histograms, &lock(&slot.histograms));
            }
        }
        Merged {
            op_counts,
            requests_per_core,
            counters,
            histograms,
        }
    }
}

/// Every core summed.
struct Merged {
    op_counts: Vec<u64>,
    requests_per_core: Vec<u64>,
    counters: Vec<u64>,
    histograms: Vec<Option<Recorded>>,
}

impl Merged {
    /// Takes away what `base` held. Every cell and histogram only grows, so nothing goes
    /// below zero; saturating all the same, for a baseline of another registry.
    fn subtract(&mut self, base: &Baseline) {
        let sub = |now: &mut [u64], then: &[u64]| {
            for (n, t) in now.iter_mut().zip(then) {
                *n = n.saturating_sub(*t);
            }
        };
        sub(&mut self.op_counts, &base.ops);
        sub(&mut self.counters, &base.counters);
        sub(&mut self.requests_per_core, &base.requests_per_core);
        let mut scratch: Option<Histogram<u64>> = None;
        for (now, then) in self.histograms.iter_mut().zip(&base.histograms) {
            let (Some(r), Some(then)) = (now.as_mut(), then) else {
                continue;
            };
            let h = scratch.get_or_insert_with(|| Recorded::new().histogram);
            h.reset();
            for &(value, count) in &then.values {
                h.saturating_record_n(value, count);
            }
            if r.histogram.subtract(&*h).is_err() {
                // Not from this registry's past: report everything rather than nonsense.
                continue;
            }
            r.saturated = r.saturated.saturating_sub(then.saturated);
            r.sum_ns = r.sum_ns.saturating_sub(then.sum_ns);
            if r.histogram.is_empty() {
                *now = None;
            }
        }
    }
}

impl Sparse {
    fn of(r: &Recorded) -> Sparse {
        Sparse {
            values: r
                .histogram
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
            saturated: r.saturated,
            sum_ns: r.sum_ns,
        }
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("op_names", &self.op_names)
            .field("counter_names", &self.counter_names)
            .field("cores", &self.slots.len())
            .field("histograms", &self.histograms)
            .finish_non_exhaustive()
    }
}

impl CoreRecorder {
    /// Whether histograms are on; check it before reading a clock for [`Self::record`].
    #[inline]
    pub fn enabled(&self) -> bool {
        self.histograms
    }

    /// The core this recorder writes for.
    pub fn core_index(&self) -> usize {
        self.core
    }

    /// Counts one request of `op`. Always on.
    ///
    /// # Panics
    ///
    /// If `op` is not below the number of op names given to [`Registry::new`].
    #[inline]
    pub fn count(&self, op: usize) {
        self.slot().ops.add(op, 1);
    }

    /// Adds `n` to the named counter `counter`. Always on.
    ///
    /// # Panics
    ///
    /// If `counter` is not below the number of counter names given to [`Registry::new`].
    #[inline]
    pub fn add_counter(&self, counter: usize, n: u64) {
        self.slot().counters.add(counter, n);
    }

    /// Records that `stage` of a request of `op` took `nanos`. Does nothing when histograms
    /// are off. Values above [`LATENCY_NS_MAX`] are recorded as the maximum and counted as
    /// saturated.
    ///
    /// # Panics
    ///
    /// If `op` is not below the number of op names given to [`Registry::new`].
    #[inline]
    pub fn record(&self, op: usize, stage: Stage, nanos: u64) {
        if !self.histograms {
            return;
        }
        self.record_enabled(op, stage, nanos);
    }

    /// A timer started now, or a disabled one (no clock read) when histograms are off.
    #[inline]
    pub fn timer(&self) -> Timer {
        Timer {
            start: if self.histograms {
                Some(Instant::now())
            } else {
                None
            },
        }
    }

    /// Records the time since `since` was started as `stage` of `op`. Does nothing for a
    /// disabled timer.
    ///
    /// # Panics
    ///
    /// If `op` is not below the number of op names given to [`Registry::new`].
    #[inline]
    pub fn record_since(&self, op: usize, stage: Stage, since: &Timer) {
        if let Some(nanos) = since.elapsed_ns() {
            self.record(op, stage, nanos);
        }
    }

    // Out of line so that the disabled path of `record` inlines to a single branch.
    #[inline(never)]
    fn record_enabled(&self, op: usize, stage: Stage, nanos: u64) {
        let ops = self.registry.op_names.len();
        assert!(op < ops, "op {op} out of range: the registry has {ops} ops");
        let mut histograms = lock(&self.slot().histograms);
        let slot = &mut histograms.slots[op * STAGES + stage.index()];
        let recorded = slot.get_or_insert_with(Recorded::new);
        if nanos > LATENCY_NS_MAX {
            recorded.saturated += 1;
        }
        let nanos = nanos.min(LATENCY_NS_MAX);
        recorded.sum_ns = recorded.sum_ns.saturating_add(nanos);
        recorded.histogram.saturating_record(nanos);
    }

    fn slot(&self) -> &CoreSlot {
        &self.registry.slots[self.core]
    }
}

impl Drop for CoreRecorder {
    fn drop(&mut self) {
        self.slot().claimed.store(false, Ordering::Release);
    }
}

impl fmt::Debug for CoreRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoreRecorder")
            .field("core", &self.core)
            .field("histograms", &self.histograms)
            .finish_non_exhaustive()
    }
}

impl Timer {
    /// Nanoseconds since the timer started (saturating at `u64::MAX`), or `None` when it is
    /// disabled.
    #[inline]
    pub fn elapsed_ns(&self) -> Option<u64> {
        self.start
            .map(|start| u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Whether the timer holds a start time, i.e. histograms were on when it was started.
    pub fn is_enabled(&self) -> bool {
        self.start.is_some()
    }
}

impl OwnerCells {
    fn new(len: usize) -> OwnerCells {
        let lines = (0..len.div_ceil(CELLS_PER_LINE))
            .map(|_| Line(std::array::from_fn(|_| AtomicU64::new(0))))
            .collect();
        OwnerCells { lines, len }
    }

    fn cell(&self, i: usize) -> &AtomicU64 {
        assert!(
            i < self.len,
            "index {i} out of range: {} names were registered",
            self.len
        );
        &self.lines[i / CELLS_PER_LINE].0[i % CELLS_PER_LINE]
    }

    // Only the owning core calls this (the recorder is unique per core and not `Sync`), so a
    // load and a store cannot lose an update, and avoid the locked instruction an atomic add
    // would cost. Relaxed, because readers only want an eventually accurate sum.
    fn add(&self, i: usize, n: u64) {
        let cell = self.cell(i);
        cell.store(
            cell.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    fn get(&self, i: usize) -> u64 {
        self.cell(i).load(Ordering::Relaxed)
    }
}

impl Recorded {
    fn new() -> Recorded {
        let histogram = Histogram::new_with_bounds(LATENCY_NS_MIN, LATENCY_NS_MAX, LATENCY_SIGFIGS)
            .expect("the latency bounds are constants that hdrhistogram accepts");
        Recorded {
            histogram,
            saturated: 0,
            sum_ns: 0,
        }
    }
}

// A worker that panicked while holding its lock leaves at most one sample half-recorded;
// the histograms stay usable, so the reader carries on rather than propagating the panic.
fn lock(histograms: &Mutex<CoreHistograms>) -> MutexGuard<'_, CoreHistograms> {
    histograms.lock().unwrap_or_else(PoisonError::into_inner)
}

fn merge_into(merged: &mut [Option<Recorded>], core: &CoreHistograms) {
    debug_assert_eq!(merged.len(), core.slots.len());
    for (into, from) in merged.iter_mut().zip(&core.slots) {
        let Some(from) = from else { continue };
        match into {
            None => *into = Some(from.clone()),
            Some(into) => {
                into.histogram
                    .add(&from.histogram)
                    .expect("every histogram has the same fixed bounds, so addition fits");
                into.saturated += from.saturated;
                into.sum_ns = into.sum_ns.saturating_add(from.sum_ns);
            }
        }
    }
}

fn op_report(op: &str, count: u64, per_stage: &[Option<Recorded>]) -> OpReport {
    let total = per_stage.get(Stage::Total.index()).and_then(Option::as_ref);
    let stages = Stage::ALL
        .iter()
        .zip(per_stage)
        .filter(|&(&stage, _)| stage != Stage::Total)
        .filter_map(|(&stage, recorded)| Some((stage, stage_report(recorded.as_ref()?))))
        .collect();
    let quantile_us = |q: f64| total.map(|r| nanos_to_us(r.histogram.value_at_quantile(q)));
    OpReport {
        op: op.to_owned(),
        count,
        samples: total.map_or(0, |r| r.histogram.len()),
        sum_us: total.map(|r| r.sum_ns as f64 / 1000.0),
        p50_us: quantile_us(0.5),
        p90_us: quantile_us(0.9),
        p99_us: quantile_us(0.99),
        p999_us: quantile_us(0.999),
        max_us: total.map(|r| nanos_to_us(r.histogram.max())),
        saturated: total.map_or(0, |r| r.saturated),
        stages,
    }
}

fn stage_report(recorded: &Recorded) -> StageReport {
    let h = &recorded.histogram;
    StageReport {
        count: h.len(),
        p50_us: nanos_to_us(h.value_at_quantile(0.5)),
        p90_us: nanos_to_us(h.value_at_quantile(0.9)),
        p99_us: nanos_to_us(h.value_at_quantile(0.99)),
        p999_us: nanos_to_us(h.value_at_quantile(0.999)),
        max_us: nanos_to_us(h.max()),
        saturated: recorded.saturated,
    }
}

// hdrhistogram answers with the top of the bucket a value fell in, which near the bound lies
// past it; clamping makes saturated samples read as exactly the bound they saturated at.
fn nanos_to_us(nanos: u64) -> f64 {
    nanos.min(LATENCY_NS_MAX) as f64 / 1000.0
}

fn assert_unique(kind: &str, names: &[&'static str]) {
    for (i, name) in names.iter().enumerate() {
        assert!(
            !names[..i].contains(name),
            "{kind} name {name:?} is registered twice"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_core_state_never_shares_a_cache_line() {
        assert_eq!(std::mem::align_of::<CoreSlot>(), 128);
        assert_eq!(std::mem::align_of::<Line>(), 128);
        assert_eq!(std::mem::size_of::<Line>(), 128);
        let cells = OwnerCells::new(CELLS_PER_LINE + 1);
        assert_eq!(cells.lines.len(), 2);
    }

    #[test]
    fn histogram_size_matches_the_crate_docs() {
        // The crate docs quote about 27 000 buckets (216 KiB of u64) per histogram.
        let buckets = Recorded::new().histogram.distinct_values();
        assert!((26_000..28_000).contains(&buckets), "{buckets} buckets");
    }

    #[test]
    fn histograms_are_allocated_on_first_sample_only() {
        let registry = Registry::new(vec!["a", "b"], vec![], 1, true);
        let recorder = registry.core(0);
        recorder.record(1, Stage::Reply, 10);
        let histograms = lock(&registry.slots[0].histograms);
        let allocated: Vec<usize> = (0..histograms.slots.len())
            .filter(|&i| histograms.slots[i].is_some())
            .collect();
        assert_eq!(allocated, [STAGES + Stage::Reply.index()]);
    }

    #[test]
    fn disabled_registry_holds_no_histogram_slots() {
        let registry = Registry::new(vec!["a"], vec![], 1, false);
        registry.core(0).record(0, Stage::Total, 10);
        assert!(lock(&registry.slots[0].histograms).slots.is_empty());
    }
}
