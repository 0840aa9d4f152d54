//! The Prometheus text exposition format (version 0.0.4) of a mount's counters, written
//! by the `prometheus-client` crate from one snapshot per scrape.

use std::{collections::HashMap, fmt};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, NoLabelSet},
    metrics::{counter::ConstCounter, gauge::ConstGauge, MetricType},
    registry::Registry,
};

use super::names::{Desc, Kind, DESCS, TXN_MUTATIONS, TXN_MUTATIONS_SUM, TXN_MUTATION_BUCKETS};

/// Upper bounds of the request latency buckets, in seconds: a FUSE request served on a
/// core takes tens of microseconds, one that waits for etcd milliseconds, one stuck
/// behind a lost etcd leader seconds.
pub(crate) const LATENCY_BOUNDS_S: [f64; 19] = [
    10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2,
    0.5, 1.0, 2.0, 5.0, 10.0,
];

/// [`LATENCY_BOUNDS_S`] in nanoseconds, for [`perf::Registry::export`].
pub(crate) fn latency_bounds_ns() -> Vec<u64> {
    LATENCY_BOUNDS_S
        .iter()
        .map(|s| (s * 1e9).round() as u64)
        .collect()
}

/// What one scrape shows.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// The workers' counts, counters and (with `--perf`) latency buckets, cumulative.
    pub(crate) export: perf::Export,
    /// The filesystem's counters (`Handler::counters`).
    pub(crate) counters: Vec<(String, u64)>,
    pub(crate) transport: String,
    pub(crate) histograms: bool,
}

impl Snapshot {
    /// The text exposition of the snapshot.
    pub(crate) fn encode(self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Every counter by its `etcfs stats` name: the workers' and the filesystem's.
    fn values(&self) -> HashMap<&str, u64> {
        self.export
            .counters
            .iter()
            .map(|&(n, v)| (n, v))
            .chain(self.counters.iter().map(|(n, v)| (n.as_str(), *v)))
            .collect()
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let perf = if self.histograms { "on" } else { "off" };
        let info = [
            ("version", env!("CARGO_PKG_VERSION")),
            ("transport", self.transport.as_str()),
            ("perf", perf),
        ];
        enc.encode_descriptor(
            "etcfs_mount",
            "The mount: etcfs version, FUSE transport, whether latency histograms are kept \
             (--perf).",
            None,
            MetricType::Info,
        )?
        .encode_info(&info)?;

        let mut fam = enc.encode_descriptor(
            "etcfs_fuse_requests",
            "FUSE requests received, by opcode.",
            None,
            MetricType::Counter,
        )?;
        for &(op, n) in &self.export.ops {
            let labels = [("op", op.to_ascii_lowercase())];
            ConstCounter::new(n).encode(fam.encode_family(&labels)?)?;
        }

        let mut fam = enc.encode_descriptor(
            "etcfs_worker_requests",
            "FUSE requests served by each worker (0 to --cpus less one, in the order given); \
             the last is the reader of /dev/fuse beside the ring.",
            None,
            MetricType::Counter,
        )?;
        for (w, &n) in self.export.requests_per_core.iter().enumerate() {
            let labels = [("worker", w.to_string())];
            ConstCounter::new(n).encode(fam.encode_family(&labels)?)?;
        }

        if self.histograms {
            self.encode_latencies(&mut enc)?;
        }

        let values = self.values();
        let mut described: Vec<&str> = Vec::new();
        for family in families() {
            let present: Vec<(&Desc, u64)> = family
                .iter()
                .filter_map(|d| values.get(d.stat).map(|&v| (d, v)))
                .collect();
            described.extend(family.iter().map(|d| d.stat));
            let Some(&(first, _)) = present.first() else {
                continue;
            };
            let kind = match first.kind {
                Kind::Counter => MetricType::Counter,
                Kind::Gauge => MetricType::Gauge,
            };
            let mut fam = enc.encode_descriptor(first.family, family[0].help, None, kind)?;
            if let [(d, v)] = present[..] {
                if d.labels.is_empty() {
                    // The family's one sample, without labels.
                    encode_value(d, v, fam)?;
                    continue;
                }
            }
            for (d, v) in present {
                encode_value(d, v, fam.encode_family(&d.labels)?)?;
            }
        }

        // Mutations per commit transaction, from the pipeline's power-of-two buckets.
        if let Some(sum) = values.get(TXN_MUTATIONS_SUM) {
            let buckets: Vec<(f64, u64)> = TXN_MUTATION_BUCKETS
                .iter()
                .map(|&(stat, le)| (le, values.get(stat).copied().unwrap_or(0)))
                .collect();
            let count = buckets.iter().map(|(_, n)| n).sum();
            enc.encode_descriptor(
                TXN_MUTATIONS,
                "Mutations per committed etcd transaction (the pipeline batches them).",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<NoLabelSet>(*sum as f64, count, &buckets, None)?;
        }
        described.push(TXN_MUTATIONS_SUM);
        described.extend(TXN_MUTATION_BUCKETS.iter().map(|(s, _)| *s));

        // A counter nobody described yet still shows, as what it is known to be.
        let mut rest: Vec<(&str, u64)> = values
            .iter()
            .filter(|(n, _)| !described.contains(n))
            .map(|(&n, &v)| (n, v))
            .collect();
        rest.sort_unstable();
        for (stat, v) in rest {
            let name = format!("etcfs_{}", sanitize(stat));
            let help = format!("Undescribed counter {stat} of etcfs stats.");
            let fam = enc.encode_descriptor(&name, &help, None, MetricType::Unknown)?;
            ConstGauge::new(v).encode(fam)?;
        }
        Ok(())
    }
}

impl Snapshot {
    fn encode_latencies(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let bounds = &LATENCY_BOUNDS_S;
        for total in [true, false] {
            let (name, help) = if total {
                (
                    "etcfs_fuse_request_duration_seconds",
                    "Time from a worker seeing a FUSE request to handing back its reply, by \
                     opcode (--perf).",
                )
            } else {
                (
                    "etcfs_fuse_request_stage_duration_seconds",
                    "Time spent in one stage of a FUSE request, by opcode and stage: \
                     queue_wait (in the worker's batch), handler, device_io (--perf).",
                )
            };
            let mut fam = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for l in &self.export.latencies {
                if (l.stage == perf::Stage::Total) != total {
                    continue;
                }
                let buckets: Vec<(f64, u64)> =
                    bounds.iter().copied().zip(l.buckets.clone()).collect();
                let sum = l.sum_ns as f64 / 1e9;
                let op = l.op.to_ascii_lowercase();
                if total {
                    let labels = [("op", op)];
                    fam.encode_family(&labels)?
                        .encode_histogram::<NoLabelSet>(sum, l.count, &buckets, None)?;
                } else {
                    let labels = [("op", op), ("stage", l.stage.name().to_owned())];
                    fam.encode_family(&labels)?
                        .encode_histogram::<NoLabelSet>(sum, l.count, &buckets, None)?;
                }
            }
        }
        Ok(())
    }
}

fn encode_value(d: &Desc, v: u64, m: prometheus_client::encoding::MetricEncoder) -> fmt::Result {
    match d.kind {
        Kind::Counter => ConstCounter::new(v).encode(m),
        Kind::Gauge if d.per_unit == 1 => ConstGauge::new(v).encode(m),
        Kind::Gauge => ConstGauge::new(v as f64 / f64::from(d.per_unit)).encode(m),
    }
}

/// [`DESCS`] cut into its families (adjacent runs of one family name).
fn families() -> impl Iterator<Item = &'static [Desc]> {
    DESCS.chunk_by(|a, b| a.family == b.family)
}

/// A metric name made of `stat`: letters, digits and underscores.
fn sanitize(stat: &str) -> String {
    stat.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(histograms: bool) -> Snapshot {
        let registry = perf::Registry::new(
            vec!["READ", "LOOKUP"],
            vec!["fuse_read_bytes", "ring_linger_hits", "ring_linger_misses"],
            1,
            histograms,
        );
        let r = registry.core(0);
        for i in 0..10 {
            r.count(0);
            r.record(0, perf::Stage::Total, 30_000 + i);
            r.record(0, perf::Stage::DeviceIo, 20_000);
        }
        r.add_counter(0, 4096);
        r.add_counter(2, 3);
        drop(r);
        Snapshot {
            export: registry.export(&latency_bounds_ns()),
            counters: vec![
                ("etcd_txns_committed".into(), 7),
                ("etcd_mutations_in_txns".into(), 12),
                ("etcd_txns_with_mutations_1".into(), 5),
                ("etcd_txns_with_mutations_2-3".into(), 1),
                ("etcd_txns_with_mutations_4-7".into(), 1),
                ("session_lease_left_ms".into(), 9_500),
                ("brand_new-thing".into(), 1),
            ],
            transport: "fuse-over-io_uring".into(),
            histograms,
        }
    }

    #[test]
    fn the_text_has_families_labels_units_and_histograms() {
        let text = snapshot(true).encode();
        for line in [
            "# TYPE etcfs_fuse_requests_total counter",
            "etcfs_fuse_requests_total{op=\"read\"} 10",
            "etcfs_worker_requests_total{worker=\"0\"} 10",
            "etcfs_mount_info{version=\"0.1.0\",transport=\"fuse-over-io_uring\",perf=\"on\"} 1",
            "etcfs_fuse_read_bytes_total 4096",
            "etcfs_ring_lingers_total{outcome=\"miss\"} 3",
            "etcfs_etcd_commit_txns_total 7",
            "# TYPE etcfs_session_lease_left_seconds gauge",
            "etcfs_session_lease_left_seconds 9.5",
            "# TYPE etcfs_etcd_txn_mutations histogram",
            "etcfs_etcd_txn_mutations_bucket{le=\"3\"} 6",
            "etcfs_etcd_txn_mutations_bucket{le=\"+Inf\"} 7",
            "etcfs_etcd_txn_mutations_sum 12.0",
            "etcfs_etcd_txn_mutations_count 7",
            "# TYPE etcfs_fuse_request_duration_seconds histogram",
            "etcfs_fuse_request_duration_seconds_bucket{op=\"read\",le=\"2e-05\"} 0",
            "etcfs_fuse_request_duration_seconds_bucket{op=\"read\",le=\"5e-05\"} 10",
            "etcfs_fuse_request_duration_seconds_count{op=\"read\"} 10",
            "etcfs_fuse_request_stage_duration_seconds_count{op=\"read\",stage=\"device_io\"} 10",
            "etcfs_brand_new_thing 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "no line {line:?} in\n{text}"
            );
        }
        assert!(
            !text.contains("etcfs_cache_hits"),
            "families without values are left out"
        );
        let sum_line = text
            .lines()
            .find(|l| l.starts_with("etcfs_fuse_request_duration_seconds_sum{op=\"read\"}"))
            .expect("a sum");
        let sum: f64 = sum_line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((sum - 300_045e-9).abs() < 1e-12, "{sum_line}");
    }

    #[test]
    fn without_perf_there_are_counts_but_no_latencies() {
        let text = snapshot(false).encode();
        assert!(text.contains("etcfs_fuse_requests_total{op=\"read\"} 10"));
        assert!(!text.contains("duration_seconds"), "{text}");
        assert!(text.contains("perf=\"off\""));
    }

    #[test]
    fn bounds_are_increasing_and_exact_in_nanoseconds() {
        let ns = latency_bounds_ns();
        assert!(ns.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(ns[0], 10_000);
        assert_eq!(*ns.last().unwrap(), 10_000_000_000);
    }
}
