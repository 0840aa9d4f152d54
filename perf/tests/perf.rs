//! The public API end to end: workers on several threads record, a reader merges, and the
//! report renders as text and JSON.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
};

use perf::{Registry, Report, Stage, LATENCY_NS_MAX};
use serde_json::Value;

const LOOKUP: usize = 0;
const GETATTR: usize = 1;
const WRITE: usize = 2;
const MKDIR: usize = 3;
const ETCD_TXNS: usize = 0;
const WATCH_EVENTS: usize = 1;

fn registry(cores: usize, histograms: bool) -> Arc<Registry> {
    Registry::new(
        vec!["lookup", "getattr", "write", "mkdir"],
        vec!["etcd_txns", "watch_events"],
        cores,
        histograms,
    )
}

/// Each core records 1000 lookups of 1..=1000 µs, 10 getattrs, and a core-dependent number
/// of writes; mkdir is never seen.
fn record_on_threads(registry: &Arc<Registry>, cores: usize) {
    let workers: Vec<_> = (0..cores)
        .map(|core| {
            let recorder = registry.core(core);
            thread::spawn(move || {
                for i in 1..=1000_u64 {
                    recorder.count(LOOKUP);
                    recorder.record(LOOKUP, Stage::Total, i * 1000);
                    recorder.record(LOOKUP, Stage::QueueWait, i);
                }
                for _ in 0..10 {
                    recorder.count(GETATTR);
                    recorder.record(GETATTR, Stage::Total, 2000);
                }
                for _ in 0..=core {
                    recorder.count(WRITE);
                }
                recorder.add_counter(ETCD_TXNS, 3);
                recorder.add_counter(WATCH_EVENTS, core as u64);
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("a worker thread panicked");
    }
}

fn assert_close(actual: f64, expected: f64) {
    // Three significant digits, plus slack for the quantile landing on a bucket edge.
    let tolerance = expected * 0.01;
    assert!(
        (actual - expected).abs() <= tolerance,
        "{actual} is not within 1% of {expected}"
    );
}

#[test]
fn merging_cores_sums_counts_and_keeps_percentiles() {
    let cores = 4;
    let registry = registry(cores, true);
    record_on_threads(&registry, cores);
    let report = registry.snapshot();

    assert!(report.histograms);
    let names: Vec<&str> = report.ops.iter().map(|op| op.op.as_str()).collect();
    assert_eq!(
        names,
        ["lookup", "getattr", "write"],
        "busiest first, unseen ops left out"
    );
    let lookup = &report.ops[0];
    assert_eq!(lookup.count, 4000);
    assert_close(lookup.p50_us.expect("total recorded"), 500.0);
    assert_close(lookup.p90_us.expect("total recorded"), 900.0);
    assert_close(lookup.p99_us.expect("total recorded"), 990.0);
    assert_close(lookup.p999_us.expect("total recorded"), 999.0);
    assert_close(lookup.max_us.expect("total recorded"), 1000.0);
    assert_eq!(lookup.saturated, 0);

    assert_eq!(
        lookup.stages.len(),
        1,
        "only queue_wait was recorded besides total"
    );
    let (stage, queue_wait) = &lookup.stages[0];
    assert_eq!(*stage, Stage::QueueWait);
    assert_eq!(queue_wait.count, 4000);
    assert_close(queue_wait.p50_us, 0.5);
    assert_close(queue_wait.max_us, 1.0);

    let getattr = &report.ops[1];
    assert_eq!(getattr.count, 40);
    assert_close(getattr.p50_us.expect("total recorded"), 2.0);
    assert!(getattr.stages.is_empty());

    let write = &report.ops[2];
    assert_eq!(write.count, 1 + 2 + 3 + 4);
    assert_eq!(write.p50_us, None, "counted but never timed");

    assert_eq!(report.requests_per_core, [1011, 1012, 1013, 1014]);
    assert_eq!(
        report.counters,
        [
            ("etcd_txns".to_owned(), 12),
            ("watch_events".to_owned(), 1 + 2 + 3)
        ]
    );
}

#[test]
fn disabled_mode_counts_but_records_no_latency() {
    let registry = registry(2, false);
    assert!(!registry.histograms_enabled());
    record_on_threads(&registry, 2);
    let recorder = registry.core(0);
    assert!(!recorder.enabled());
    let timer = recorder.timer();
    assert!(!timer.is_enabled());
    assert_eq!(timer.elapsed_ns(), None);
    recorder.record_since(LOOKUP, Stage::Total, &timer);
    drop(recorder);

    let report = registry.snapshot();
    assert!(!report.histograms);
    assert_eq!(report.ops[0].count, 2000);
    for op in &report.ops {
        assert_eq!(
            [op.p50_us, op.p90_us, op.p99_us, op.p999_us, op.max_us],
            [None; 5],
            "{}",
            op.op
        );
        assert!(op.stages.is_empty());
    }

    let json: Value = serde_json::from_str(&report.to_json()).expect("to_json emits JSON");
    for op in json["ops"].as_array().expect("ops is a list") {
        for key in ["p50_us", "p90_us", "p99_us", "p999_us", "max_us"] {
            assert_eq!(op[key], Value::Null, "{key} of {}", op["op"]);
        }
        assert!(op["count"].as_u64().expect("count is a number") > 0);
    }

    let text = report.to_text();
    assert!(text.contains("histograms=off"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("lookup") && l.contains(" - ")),
        "{text}"
    );
}

#[test]
fn json_has_the_documented_keys_and_parses_back() {
    let registry = registry(2, true);
    record_on_threads(&registry, 2);
    let mut report = registry.snapshot();
    report.transport = "fuse-uring".to_owned();
    let text = report.to_json();
    assert_eq!(text.lines().count(), 1, "one object on one line");

    let json: Value = serde_json::from_str(&text).expect("to_json emits JSON");
    assert_eq!(json["transport"], "fuse-uring");
    assert_eq!(json["histograms"], true);
    assert_eq!(json["requests_per_core"], serde_json::json!([1011, 1012]));
    assert_eq!(
        json["counters"],
        serde_json::json!({"etcd_txns": 6, "watch_events": 1})
    );
    let ops = json["ops"].as_array().expect("ops is a list");
    assert_eq!(ops.len(), 3);
    for op in ops {
        for key in [
            "op", "count", "p50_us", "p90_us", "p99_us", "p999_us", "max_us", "stages",
        ] {
            assert!(op.get(key).is_some(), "op {} lacks {key}", op["op"]);
        }
        assert!(op["stages"].is_object());
    }
    let lookup = &ops[0];
    assert_eq!(lookup["op"], "lookup");
    assert!(
        lookup["p99_us"]
            .as_f64()
            .expect("a number when histograms are on")
            > 900.0
    );
    let queue_wait = &lookup["stages"]["queue_wait"];
    assert_eq!(queue_wait["count"], 4000 / 2);
    for key in ["p50_us", "p99_us", "max_us"] {
        assert!(queue_wait[key].is_f64(), "queue_wait.{key}");
    }

    let back: Report = serde_json::from_str(&text).expect("a report parses back");
    assert_eq!(back, report);
}

#[test]
fn latencies_beyond_the_bound_saturate_and_are_counted() {
    let registry = registry(1, true);
    let recorder = registry.core(0);
    recorder.count(MKDIR);
    recorder.record(MKDIR, Stage::Total, u64::MAX);
    recorder.record(MKDIR, Stage::Total, LATENCY_NS_MAX + 1);
    recorder.record(MKDIR, Stage::Total, LATENCY_NS_MAX);
    recorder.record(MKDIR, Stage::Etcd, u64::MAX);
    recorder.count(LOOKUP);
    recorder.record(LOOKUP, Stage::Total, 0);
    let report = registry.snapshot();

    // Equal counts keep registration order: lookup, then mkdir.
    let (lookup, mkdir) = (&report.ops[0], &report.ops[1]);
    assert_eq!((lookup.op.as_str(), mkdir.op.as_str()), ("lookup", "mkdir"));
    assert_eq!(mkdir.saturated, 2, "exactly the bound is not saturated");
    let bound_us = LATENCY_NS_MAX as f64 / 1000.0;
    assert_eq!(
        mkdir.max_us,
        Some(bound_us),
        "saturated samples read as the bound"
    );
    assert_eq!(lookup.max_us, Some(0.0), "zero is recordable");
    let (stage, etcd) = &mkdir.stages[0];
    assert_eq!((*stage, etcd.count, etcd.saturated), (Stage::Etcd, 1, 1));
    assert!(report.to_text().contains("(2 saturated at 60 s)"));
}

#[test]
fn text_lists_every_op_that_ran() {
    let registry = registry(3, true);
    record_on_threads(&registry, 3);
    let mut report = registry.snapshot();
    report.transport = "classic".to_owned();
    let text = report.to_text();

    let first = text.lines().next().expect("a header line");
    assert!(
        first.contains("transport=classic") && first.contains("histograms=on"),
        "{text}"
    );
    for op in &report.ops {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(op.op.as_str()))
            .unwrap_or_else(|| panic!("{} missing from\n{text}", op.op));
        assert!(line.contains(&op.count.to_string()), "{line}");
    }
    assert!(
        !text.contains("mkdir"),
        "ops that never ran are left out:\n{text}"
    );
    assert!(
        text.contains("\n  queue_wait "),
        "stages are indented under their op:\n{text}"
    );
    assert!(text.contains("0=1011 1=1012 2=1013"), "{text}");
    assert!(text.contains("  etcd_txns 9\n"), "{text}");
}

#[test]
fn timer_measures_elapsed_time_when_enabled() {
    let registry = registry(1, true);
    let recorder = registry.core(0);
    let timer = recorder.timer();
    assert!(timer.is_enabled());
    thread::sleep(std::time::Duration::from_millis(2));
    recorder.count(WRITE);
    recorder.record_since(WRITE, Stage::DeviceIo, &timer);
    let report = registry.snapshot();

    let (stage, device_io) = &report.ops[0].stages[0];
    assert_eq!(*stage, Stage::DeviceIo);
    assert!(
        device_io.p50_us >= 2000.0,
        "slept 2 ms, measured {} µs",
        device_io.p50_us
    );
}

#[test]
fn a_core_has_one_recorder_at_a_time() {
    let registry = registry(2, true);
    let first = registry.core(1);
    let second = catch_unwind(AssertUnwindSafe(|| registry.core(1)));
    assert!(
        second.is_err(),
        "a second live recorder on one core must be refused"
    );
    let out_of_range = catch_unwind(AssertUnwindSafe(|| registry.core(2)));
    assert!(out_of_range.is_err());
    drop(first);
    let again = registry.core(1);
    assert_eq!(again.core_index(), 1);
}

#[test]
fn snapshots_while_workers_record_see_monotonic_counts() {
    let registry = registry(2, true);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|core| {
            let recorder = registry.core(core);
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut n = 0_u64;
                while !stop.load(Ordering::Relaxed) {
                    recorder.count(LOOKUP);
                    recorder.record(LOOKUP, Stage::Total, n % 5000 + 1);
                    n += 1;
                }
                n
            })
        })
        .collect();

    // Until the workers are well under way, so the snapshots race real recording.
    let mut last = 0;
    let mut snapshots = 0;
    while snapshots < 20 || last < 100_000 {
        let count = registry.snapshot().ops.first().map_or(0, |op| op.count);
        assert!(count >= last, "count went back from {last} to {count}");
        last = count;
        snapshots += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let recorded: u64 = workers
        .into_iter()
        .map(|w| w.join().expect("worker ran"))
        .sum();
    let report = registry.snapshot();
    assert_eq!(report.ops[0].count, recorded);
}

#[test]
fn a_baseline_hides_what_came_before_it() {
    let registry = registry(2, true);
    record_on_threads(&registry, 2);
    let base = registry.baseline();
    let since = registry.snapshot_since(Some(&base));
    assert!(
        since.ops.is_empty(),
        "nothing after the baseline: {since:?}"
    );
    assert_eq!(since.requests_per_core, [0, 0]);
    assert!(since.counters.iter().all(|(_, n)| *n == 0));

    // Then a few slow lookups on core 0: only those are reported, with their own latency.
    let recorder = registry.core(0);
    for _ in 0..5 {
        recorder.count(LOOKUP);
        recorder.record(LOOKUP, Stage::Total, 50_000_000);
    }
    recorder.add_counter(ETCD_TXNS, 2);
    drop(recorder);
    let since = registry.snapshot_since(Some(&base));
    assert_eq!(since.ops.len(), 1);
    let lookup = &since.ops[0];
    assert_eq!(
        (lookup.op.as_str(), lookup.count, lookup.samples),
        ("lookup", 5, 5)
    );
    let p50 = lookup.p50_us.expect("histograms are on");
    assert!((49_000.0..51_000.0).contains(&p50), "p50 {p50}");
    let sum = lookup.sum_us.expect("histograms are on");
    assert!((sum - 250_000.0).abs() < 1.0, "sum {sum}");
    assert!(
        lookup.stages.is_empty(),
        "queue waits were all before the baseline"
    );
    assert_eq!(since.counters[ETCD_TXNS], ("etcd_txns".to_owned(), 2));
    assert_eq!(since.requests_per_core, [5, 0]);

    // The whole history is still there for whoever wants it.
    let all = registry.snapshot();
    assert_eq!(all.ops[0].count, 2005);
}

#[test]
fn export_counts_samples_into_fixed_buckets() {
    let registry = registry(2, true);
    record_on_threads(&registry, 2);
    // Lookups are 1..=1000 µs on each core, their queue waits 1..=1000 ns.
    let export = registry.export(&[1_000, 500_000, 1_000_000]);
    assert_eq!(
        export.ops,
        [("lookup", 2000), ("getattr", 20), ("write", 3)],
        "registration order, unseen ops left out"
    );
    assert_eq!(export.counters, [("etcd_txns", 6), ("watch_events", 1)]);
    let lookup = export
        .latencies
        .iter()
        .find(|l| l.op == "lookup" && l.stage == Stage::Total)
        .expect("lookup latencies");
    // 1 µs a core up to the first bound, bounds included; up to 500 µs: 499 a core; the
    // rest up to 1 ms; none above.
    assert_eq!(lookup.buckets, [2, 998, 1000, 0]);
    assert_eq!(lookup.count, 2000);
    let exact: u64 = 2 * (1..=1000_u64).map(|i| i * 1000).sum::<u64>();
    assert_eq!(lookup.sum_ns, exact);
    let waits = export
        .latencies
        .iter()
        .find(|l| l.op == "lookup" && l.stage == Stage::QueueWait)
        .expect("queue waits");
    assert_eq!(waits.buckets, [2000, 0, 0, 0]);
    assert!(registry_without_histograms_exports_no_latency());
}

fn registry_without_histograms_exports_no_latency() -> bool {
    let registry = registry(1, false);
    registry.core(0).count(LOOKUP);
    let export = registry.export(&[1_000]);
    export.latencies.is_empty() && export.ops == [("lookup", 1)]
}
