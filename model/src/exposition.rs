//! The Prometheus text exposition (format 0.0.4) that every quotalease
//! process serves on `/metrics`, through `prometheus-client`.
//!
//! A process gathers its counters into an owned snapshot (the counters
//! themselves stay the cheap atomics of its request path) and implements
//! [`Collector`] for that snapshot with the helpers here, which hold the
//! conventions: every metric has HELP and TYPE, counters end in `_total`,
//! times are in seconds, and labels are rule ids and small fixed sets
//! (results, agent ids), never tenant or route values (SPEC §8).

use std::fmt;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

pub use prometheus_client::collector::Collector;
pub use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
pub use prometheus_client::encoding::DescriptorEncoder;
pub use prometheus_client::metrics::histogram::Histogram;

/// Bucket upper bounds, in seconds, for round-trip latencies (a renewal
/// between an agent and its allocator): 100 µs to 10 s, 1-2.5-5 per decade.
pub const LATENCY_BUCKETS_SECONDS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// A histogram with [`LATENCY_BUCKETS_SECONDS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS_SECONDS)
}

/// `collector` in the Prometheus text format (version 0.0.4); serve it
/// with `Content-Type: ` [`CONTENT_TYPE`].
pub fn render(collector: impl Collector) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector));
    let mut out = String::new();
    // The helpers below never fail on their own (gauges are clamped into
    // i64); a failure could only come from the writer, and a String
    // accepts every write. Keep what was written rather than panic.
    if prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).is_err() {
        out.push_str("# encoding stopped early\n");
    }
    out
}

/// The name without its `_total`: the encoder appends it to counters.
fn counter_base(name: &str) -> &str {
    debug_assert!(
        name.ends_with("_total"),
        "counter {name} must end in _total"
    );
    name.strip_suffix("_total").unwrap_or(name)
}

/// A counter without labels; `name` ends in `_total`.
pub fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let mut m = enc.encode_descriptor(counter_base(name), help, None, MetricType::Counter)?;
    m.encode_counter::<NoLabelSet, u64, f64>(&v, None)
}

/// A counter with one sample per label set; `name` ends in `_total`.
pub fn counters<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(counter_base(name), help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        m.encode_family(&labels)?
            .encode_counter::<NoLabelSet, u64, f64>(&v, None)?;
    }
    Ok(())
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A gauge without labels (clamped to `i64::MAX`).
pub fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    m.encode_gauge(&gauge_value(v))
}

/// A gauge with one sample per label set.
pub fn gauges<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        m.encode_family(&labels)?.encode_gauge(&gauge_value(v))?;
    }
    Ok(())
}

/// A histogram without labels; `name` ends in its base unit (`_seconds`).
pub fn histogram(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    h: &Histogram,
) -> fmt::Result {
    let m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    h.encode(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Sample(Histogram);

    impl Collector for Sample {
        fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
            counter(&mut enc, "q_things_total", "things done", 3)?;
            counters(
                &mut enc,
                "q_rule_things_total",
                "things by rule",
                [([("rule", "a\"b"), ("result", "ok")], 2)],
            )?;
            gauge(&mut enc, "q_big", "a gauge past i64", u64::MAX)?;
            histogram(&mut enc, "q_latency_seconds", "round trips", &self.0)
        }
    }

    /// Counters keep their `_total` once, label values are escaped, big
    /// gauges are clamped, histograms have cumulative buckets to `+Inf`.
    #[test]
    fn text_format() {
        let h = latency_histogram();
        h.observe(0.0003);
        h.observe(20.0);
        let text = render(Sample(h));
        for line in [
            "# HELP q_things_total things done",
            "# TYPE q_things_total counter",
            "q_things_total 3",
            "q_rule_things_total{rule=\"a\\\"b\",result=\"ok\"} 2",
            "# TYPE q_big gauge",
            "q_big 9223372036854775807",
            "# TYPE q_latency_seconds histogram",
            "q_latency_seconds_bucket{le=\"0.00025\"} 0",
            "q_latency_seconds_bucket{le=\"0.0005\"} 1",
            "q_latency_seconds_bucket{le=\"10\"} 1",
            "q_latency_seconds_bucket{le=\"+Inf\"} 2",
            "q_latency_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        assert!(!text.contains("_total_total"), "{text}");
        assert!(CONTENT_TYPE.starts_with("text/plain; version=0.0.4"));
    }
}
