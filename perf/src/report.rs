//! A merged snapshot of all cores, and its text and JSON renderings.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::Stage;

/// Everything all cores recorded up to one [`Registry::snapshot`](crate::Registry::snapshot).
///
/// Latencies are in microseconds. The JSON form (see [`Report::to_json`]) mirrors the fields,
/// with `counters` and each op's `stages` as objects keyed by name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Which FUSE transport served the mount; empty until the caller sets it, since `perf`
    /// knows nothing of transports.
    pub transport: String,
    /// Whether latency histograms were recorded. When false every latency is `None`.
    pub histograms: bool,
    /// Ops with at least one request, busiest first.
    pub ops: Vec<OpReport>,
    /// Requests counted by each core, indexed by core.
    pub requests_per_core: Vec<u64>,
    /// Every registered counter, summed over cores, in registration order.
    #[serde(with = "pairs_as_map")]
    pub counters: Vec<(String, u64)>,
}

/// One op's request count and, with histograms on, its latency distribution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpReport {
    /// The op's name as registered.
    pub op: String,
    /// Requests counted, whether or not histograms are on.
    pub count: u64,
    /// Samples of the `Total` stage (0 with histograms off; requests without a reply,
    /// such as FORGET, have none).
    #[serde(default)]
    pub samples: u64,
    /// Sum of the `Total` samples, for a mean over an interval (difference of two sums
    /// over the difference of two `samples`); `None` without `Total` samples.
    #[serde(default)]
    pub sum_us: Option<f64>,
    /// Median of the `Total` stage; `None` (JSON `null`) without `Total` samples.
    pub p50_us: Option<f64>,
    /// 90th percentile of the `Total` stage.
    pub p90_us: Option<f64>,
    /// 99th percentile of the `Total` stage.
    pub p99_us: Option<f64>,
    /// 99.9th percentile of the `Total` stage.
    pub p999_us: Option<f64>,
    /// Largest `Total` sample.
    pub max_us: Option<f64>,
    /// `Total` samples above the histogram's 60 s bound, recorded as the bound.
    pub saturated: u64,
    /// Every stage other than `Total` that has samples, in [`Stage::ALL`] order.
    #[serde(with = "pairs_as_map")]
    pub stages: Vec<(Stage, StageReport)>,
}

/// The latency distribution of one stage of one op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    /// Samples recorded for the stage (may differ from the op's request count).
    pub count: u64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest sample.
    pub max_us: f64,
    /// Samples above the histogram's 60 s bound, recorded as the bound.
    pub saturated: u64,
}

impl Report {
    /// A human-readable table: a header with the transport and whether histograms are on,
    /// one line per op (count, then p50/p90/p99/p99.9/max in µs, `-` when unknown), its
    /// stages indented beneath it, then requests per core and the counters.
    pub fn to_text(&self) -> String {
        let transport = if self.transport.is_empty() {
            "-"
        } else {
            &self.transport
        };
        let histograms = if self.histograms { "on" } else { "off" };
        let mut out = format!("perf report: transport={transport} histograms={histograms}\n");

        let name_width = self
            .ops
            .iter()
            .flat_map(|op| {
                let stages = op.stages.iter().map(|(stage, _)| stage.name().len() + 2);
                std::iter::once(op.op.len()).chain(stages)
            })
            .chain(std::iter::once("op".len()))
            .max()
            .unwrap_or(0);
        // `write!` into a `String` cannot fail, so its results are ignored here and below.
        let _ = writeln!(
            out,
            "{:<name_width$} {:>12} {:>11} {:>11} {:>11} {:>11} {:>11}",
            "op", "count", "p50_us", "p90_us", "p99_us", "p99.9_us", "max_us"
        );
        for op in &self.ops {
            let latencies = [op.p50_us, op.p90_us, op.p99_us, op.p999_us, op.max_us];
            push_row(
                &mut out,
                &op.op,
                name_width,
                op.count,
                latencies,
                op.saturated,
            );
            for (stage, s) in &op.stages {
                let name = format!("  {}", stage.name());
                let latencies = [s.p50_us, s.p90_us, s.p99_us, s.p999_us, s.max_us].map(Some);
                push_row(&mut out, &name, name_width, s.count, latencies, s.saturated);
            }
        }

        let total: u64 = self.requests_per_core.iter().sum();
        let _ = write!(out, "requests per core (total {total}):");
        for (core, n) in self.requests_per_core.iter().enumerate() {
            let _ = write!(out, " {core}={n}");
        }
        out.push('\n');

        out.push_str("counters:");
        if self.counters.is_empty() {
            out.push_str(" -");
        }
        out.push('\n');
        for (name, n) in &self.counters {
            let _ = writeln!(out, "  {name} {n}");
        }
        out
    }

    /// The report as one JSON object on one line (see the field docs for its keys).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a report holds only strings, numbers and maps")
    }
}

// Latency columns are 11 wide: the 60 s bound is 60000000.00 µs.
fn push_row(
    out: &mut String,
    name: &str,
    name_width: usize,
    count: u64,
    latencies_us: [Option<f64>; 5],
    saturated: u64,
) {
    let _ = write!(out, "{name:<name_width$} {count:>12}");
    for latency in latencies_us {
        match latency {
            Some(us) => {
                let _ = write!(out, " {us:>11.2}");
            }
            None => {
                let _ = write!(out, " {:>11}", "-");
            }
        }
    }
    if saturated > 0 {
        let _ = write!(out, "  ({saturated} saturated at 60 s)");
    }
    out.push('\n');
}

/// Serializes a list of pairs as a JSON object, keeping the list's order both ways, so that
/// names read as keys in JSON while the Rust side keeps registration order without a map.
mod pairs_as_map {
    use std::{fmt, marker::PhantomData};

    use serde::{
        de::{MapAccess, Visitor},
        Deserialize, Deserializer, Serialize, Serializer,
    };

    pub(crate) fn serialize<K, V, S>(pairs: &[(K, V)], serializer: S) -> Result<S::Ok, S::Error>
    where
        K: Serialize,
        V: Serialize,
        S: Serializer,
    {
        serializer.collect_map(pairs.iter().map(|(k, v)| (k, v)))
    }

    pub(crate) fn deserialize<'de, K, V, D>(deserializer: D) -> Result<Vec<(K, V)>, D::Error>
    where
        K: Deserialize<'de>,
        V: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        deserializer.deserialize_map(PairsVisitor(PhantomData))
    }

    struct PairsVisitor<K, V>(PhantomData<(K, V)>);

    impl<'de, K, V> Visitor<'de> for PairsVisitor<K, V>
    where
        K: Deserialize<'de>,
        V: Deserialize<'de>,
    {
        type Value = Vec<(K, V)>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            // No capacity from the size hint: it comes from the input and is not trusted.
            let mut pairs = Vec::new();
            while let Some(pair) = map.next_entry()? {
                pairs.push(pair);
            }
            Ok(pairs)
        }
    }
}
