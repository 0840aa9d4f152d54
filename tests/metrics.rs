//! The operator's views of a mount, on real mounts with a real etcd: the `--metrics`
//! Prometheus endpoint (scraped over HTTP and read back with a Prometheus text parser,
//! its values moving under a workload), a port that cannot be listened on failing the
//! mount, `etcfs stats --watch` (lines for a few seconds, exit 0 on SIGINT) and
//! `etcfs stats --reset`.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`).

mod common;

use std::{
    collections::HashMap,
    io::Read as _,
    net::TcpListener,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use common::{http_get, is_mounted, pattern, run_bounded, signal, wait_bounded, TestFs, ETCFS};
use prometheus_parse::{Sample, Scrape, Value};

fn scrape(port: u16) -> Scrape {
    let (code, body) = http_get(port, "/metrics");
    assert_eq!(code, 200, "{body}");
    Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("Prometheus text format")
}

/// The value of the counter or gauge `metric` whose labels include `labels`.
fn value(s: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    value_if_any(s, metric, labels).unwrap_or_else(|| panic!("no {metric}{labels:?}"))
}

/// [`value`], or `None` when there is no such sample (an op never seen is left out).
fn value_if_any(s: &Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<&Sample> = s
        .samples
        .iter()
        .filter(|x| x.metric == metric && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
        .collect();
    assert!(found.len() <= 1, "{metric}{labels:?}: {found:?}");
    Some(match found.first()?.value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
        ref other => panic!("{metric} is {other:?}"),
    })
}

fn write_files(dir: &std::path::Path, n: usize, bytes: usize) {
    for i in 0..n {
        std::fs::write(dir.join(format!("f{i}")), pattern(bytes, i as u8)).expect("write a file");
    }
}

#[test]
fn metrics_endpoint_serves_prometheus_text_that_moves_under_load() {
    let Some(fs) = TestFs::new_or_skip("metrics_endpoint", None) else {
        return;
    };

    // A port already taken fails the mount before anything is mounted, saying why.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (ok, text, _) = fs.mount_expecting_failure(&fs.mount_args("auto", &["--metrics", &addr]));
    assert!(!ok, "mounted with --metrics on a taken port:\n{text}");
    assert!(
        text.contains("--metrics") && text.contains("cannot listen") && text.contains(&addr),
        "{text}"
    );
    assert!(!is_mounted(&fs.mountpoint()));
    drop(taken);

    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = fs.mount("auto", &["--perf", "--metrics", &addr]);

    let (code, body) = http_get(port, "/");
    assert_eq!(code, 404, "{body}");

    let before = scrape(port);
    for (name, doc) in &before.docs {
        assert!(
            !doc.starts_with("Undescribed"),
            "{name} has no description: {doc}"
        );
        assert!(name.starts_with("etcfs_"), "{name}");
    }
    let lease = value(&before, "etcfs_session_lease_left_seconds", &[]);
    assert!(lease > 0.0 && lease <= 10.0, "lease left {lease}");
    assert_eq!(value(&before, "etcfs_session_fenced", &[]), 0.0);
    assert_eq!(value(&before, "etcfs_mount_info", &[("perf", "on")]), 1.0);

    write_files(&d.mnt, 20, 256 << 10);
    for i in 0..20 {
        let got = std::fs::read(d.path(&format!("f{i}"))).expect("read back");
        assert_eq!(got.len(), 256 << 10);
    }
    let after = scrape(port);

    let grew = |metric: &str, labels: &[(&str, &str)]| {
        let a = value_if_any(&before, metric, labels).unwrap_or(0.0);
        let b = value(&after, metric, labels);
        assert!(b > a, "{metric}{labels:?} did not grow: {a} then {b}");
        b - a
    };
    grew("etcfs_fuse_requests_total", &[("op", "write")]);
    grew("etcfs_fuse_requests_total", &[("op", "create")]);
    let written = grew("etcfs_fuse_write_bytes_total", &[]);
    assert!(
        written >= (20 * (256 << 10)) as f64,
        "{written} bytes written"
    );
    grew("etcfs_etcd_commit_txns_total", &[]);
    let device_written = value(
        &after,
        "etcfs_device_write_bytes_total",
        &[("by", "worker")],
    ) + value(
        &after,
        "etcfs_device_write_bytes_total",
        &[("by", "waiter")],
    );
    assert!(
        device_written >= (20 * (256 << 10)) as f64,
        "{device_written}"
    );
    let worker_requests: f64 = after
        .samples
        .iter()
        .filter(|s| s.metric == "etcfs_worker_requests_total")
        .map(|s| match s.value {
            Value::Counter(v) => v,
            _ => 0.0,
        })
        .sum();
    assert!(worker_requests > 0.0);

    // --perf: request latencies as histograms, per op.
    let writes = after
        .samples
        .iter()
        .find(|s| {
            s.metric == "etcfs_fuse_request_duration_seconds" && s.labels.get("op") == Some("write")
        })
        .expect("a latency histogram of WRITE");
    let Value::Histogram(buckets) = &writes.value else {
        panic!("{writes:?} is not a histogram");
    };
    assert!(buckets.len() >= 10, "{buckets:?}");
    assert!(buckets
        .windows(2)
        .all(|w| w[0].count <= w[1].count && w[0].less_than < w[1].less_than));
    let all = buckets.last().unwrap();
    assert!(
        all.less_than.is_infinite() && all.count >= 20.0,
        "{buckets:?}"
    );
    let count = value(
        &after,
        "etcfs_fuse_request_duration_seconds_count",
        &[("op", "write")],
    );
    assert_eq!(count, all.count);
    let sum = value(
        &after,
        "etcfs_fuse_request_duration_seconds_sum",
        &[("op", "write")],
    );
    assert!(sum > 0.0 && sum < count * 10.0, "sum {sum} of {count}");
    let txn = after
        .samples
        .iter()
        .find(|s| s.metric == "etcfs_etcd_txn_mutations")
        .expect("mutations per transaction");
    assert!(matches!(&txn.value, Value::Histogram(b) if !b.is_empty()));

    // The control socket serves the same text, for a mount without --metrics.
    let (out, _) = run_bounded(
        Command::new(ETCFS)
            .arg("stats")
            .arg(&d.mnt)
            .arg("--prometheus"),
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let via_socket = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    assert!(value(&via_socket, "etcfs_fuse_requests_total", &[("op", "write")]) >= 20.0);

    d.stop();
}

/// The counters of `etcfs stats --json`, by name, and its total requests.
fn stats_numbers(mnt: &std::path::Path) -> (HashMap<String, u64>, u64) {
    let (out, _) = run_bounded(
        Command::new(ETCFS).arg("stats").arg(mnt).arg("--json"),
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let counters = v["counters"]
        .as_object()
        .expect("counters")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
        .collect();
    let requests = v["ops"]
        .as_array()
        .expect("ops")
        .iter()
        .map(|o| o["count"].as_u64().unwrap_or(0))
        .sum();
    (counters, requests)
}

#[test]
fn stats_watch_prints_lines_until_sigint_and_reset_starts_again() {
    let Some(fs) = TestFs::new_or_skip("stats_watch", None) else {
        return;
    };

    // Not an etcfs mount: said so, and a failure.
    let (out, _) = run_bounded(
        Command::new(ETCFS).args(["stats", "/", "--watch"]),
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not an etcfs mount"), "{err}");

    let d = fs.mount("auto", &[]);
    d.stats_json();
    let mut watch = Command::new(ETCFS)
        .arg("stats")
        .arg(&d.mnt)
        .args(["--watch", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn etcfs stats --watch");
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_millis(3500) {
        std::fs::write(d.path(&format!("w{i}")), pattern(64 << 10, i as u8)).unwrap();
        i += 1;
        thread::sleep(Duration::from_millis(20));
    }
    signal(&mut watch, "INT");
    let status =
        wait_bounded(&mut watch, Duration::from_secs(10)).expect("--watch exits on SIGINT");
    let mut stdout = String::new();
    watch
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let mut stderr = String::new();
    watch
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(
        status.success(),
        "--watch exited {status}: {stderr}\n{stdout}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines.len() >= 4,
        "a header of two lines and lines:\n{stdout}"
    );
    assert!(
        lines[1].contains("ops/s") && lines[1].contains("hit%"),
        "{stdout}"
    );
    let data: Vec<Vec<&str>> = lines[2..]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(data.len() >= 2, "{stdout}");
    for cols in &data {
        assert_eq!(cols.len(), 10, "{stdout}");
        assert_eq!(cols[2], "-", "no --perf, no latency: {stdout}");
    }
    let busiest: f64 = data
        .iter()
        .map(|c| c[1].parse::<f64>().unwrap_or(0.0))
        .fold(0.0, f64::max);
    assert!(busiest > 0.0, "no requests seen:\n{stdout}");
    let written: f64 = data.iter().map(|c| c[4].parse::<f64>().unwrap()).sum();
    assert!(written > 0.0, "no writes seen:\n{stdout}");

    // --reset: the counters go back down; the endpoint's view stays cumulative.
    let (before, requests_before) = stats_numbers(&d.mnt);
    assert!(requests_before > 100, "{requests_before}");
    assert!(before["fuse_write_bytes"] > 0 && before["etcd_txns_committed"] > 0);
    let (out, _) = run_bounded(
        Command::new(ETCFS).arg("stats").arg(&d.mnt).arg("--reset"),
        Duration::from_secs(20),
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("reset"),
        "{out:?}"
    );
    let (after, requests_after) = stats_numbers(&d.mnt);
    assert!(
        requests_after < requests_before / 2,
        "{requests_after} requests after the reset, {requests_before} before"
    );
    assert!(after["fuse_write_bytes"] < before["fuse_write_bytes"]);
    assert!(after["etcd_txns_committed"] < before["etcd_txns_committed"]);
    assert!(after["session_lease_left_ms"] > 0, "a gauge is not reset");
    let (out, _) = run_bounded(
        Command::new(ETCFS)
            .arg("stats")
            .arg(&d.mnt)
            .arg("--prometheus"),
        Duration::from_secs(20),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let s = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    assert!(value(&s, "etcfs_fuse_write_bytes_total", &[]) >= before["fuse_write_bytes"] as f64);

    d.stop();
}
