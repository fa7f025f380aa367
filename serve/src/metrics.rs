//! Prometheus metrics, kept by hand (a few counters and histograms need no client library):
//! requests and errors by route and status, request latency, queue depth, encoder batch
//! sizes and the upstream target's latency and failures.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

const LATENCY_BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

#[derive(Default)]
struct Tables {
    requests: BTreeMap<(String, u16), u64>,
    latency: BTreeMap<String, Histogram>,
    batch_sizes: Option<Histogram>,
    upstream: Option<Histogram>,
    upstream_errors: BTreeMap<String, u64>,
    abandoned: u64,
    reclaimed_slots: u64,
}

/// Every metric the server keeps.
#[derive(Default)]
pub struct Metrics {
    /// Requests waiting for the encoder.
    pub queue_depth: AtomicI64,
    tables: Mutex<Tables>,
}

impl Metrics {
    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One finished request on `route` (the matched path).
    pub fn observe_request(&self, route: &str, status: u16, seconds: f64) {
        let mut t = self.tables();
        *t.requests.entry((route.to_string(), status)).or_default() += 1;
        t.latency.entry(route.to_string()).or_insert_with(|| Histogram::new(&LATENCY_BUCKETS)).observe(seconds);
    }

    /// A target failure after its call was timed (a stream cut in the middle).
    pub fn count_upstream_error(&self, kind: &str) {
        *self.tables().upstream_errors.entry(kind.to_string()).or_default() += 1;
    }

    /// Texts left unencoded because their request was abandoned (deadline passed, client gone).
    pub fn observe_abandoned(&self, texts: usize) {
        if texts > 0 {
            self.tables().abandoned += texts as u64;
        }
    }

    /// A target slot taken back from a call that outlived its request (see `slot`).
    pub fn count_reclaimed_slot(&self) {
        self.tables().reclaimed_slots += 1;
    }

    /// Texts in one encoder call.
    pub fn observe_batch(&self, texts: usize) {
        self.tables().batch_sizes.get_or_insert_with(|| Histogram::new(&BATCH_BUCKETS)).observe(texts as f64);
    }

    /// One call to the target; `error` its kind when it failed.
    pub fn observe_upstream(&self, seconds: f64, error: Option<&str>) {
        let mut t = self.tables();
        t.upstream.get_or_insert_with(|| Histogram::new(&LATENCY_BUCKETS)).observe(seconds);
        if let Some(kind) = error {
            *t.upstream_errors.entry(kind.to_string()).or_default() += 1;
        }
    }

    /// The Prometheus text exposition format.
    pub fn render(&self) -> String {
        let t = self.tables();
        let mut out = String::new();
        out.push_str("# HELP rak_requests_total Requests answered, by route and status.\n# TYPE rak_requests_total counter\n");
        for ((route, status), n) in &t.requests {
            let _ = writeln!(out, "rak_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        out.push_str("# HELP rak_request_errors_total Requests answered with a status of 400 or more, by route and status.\n# TYPE rak_request_errors_total counter\n");
        for ((route, status), n) in t.requests.iter().filter(|((_, s), _)| *s >= 400) {
            let _ = writeln!(out, "rak_request_errors_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        out.push_str("# HELP rak_request_duration_seconds Time from request to response head, by route.\n# TYPE rak_request_duration_seconds histogram\n");
        for (route, h) in &t.latency {
            h.write(&mut out, "rak_request_duration_seconds", &format!("route=\"{route}\""));
        }
        out.push_str("# HELP rak_queue_depth Requests waiting for the encoder.\n# TYPE rak_queue_depth gauge\n");
        let _ = writeln!(out, "rak_queue_depth {}", self.queue_depth.load(Ordering::Relaxed).max(0));
        out.push_str("# HELP rak_abandoned_texts_total Texts not encoded because their request was abandoned.\n# TYPE rak_abandoned_texts_total counter\n");
        let _ = writeln!(out, "rak_abandoned_texts_total {}", t.abandoned);
        out.push_str("# HELP rak_batch_size Texts per encoder call.\n# TYPE rak_batch_size histogram\n");
        t.batch_sizes.clone().unwrap_or_else(|| Histogram::new(&BATCH_BUCKETS)).write(&mut out, "rak_batch_size", "");
        out.push_str("# HELP rak_upstream_duration_seconds Time of each call to the target LM.\n# TYPE rak_upstream_duration_seconds histogram\n");
        t.upstream.clone().unwrap_or_else(|| Histogram::new(&LATENCY_BUCKETS)).write(&mut out, "rak_upstream_duration_seconds", "");
        out.push_str("# HELP rak_upstream_errors_total Failed calls to the target LM, by kind.\n# TYPE rak_upstream_errors_total counter\n");
        for (kind, n) in &t.upstream_errors {
            let _ = writeln!(out, "rak_upstream_errors_total{{kind=\"{kind}\"}} {n}");
        }
        out.push_str("# HELP rak_upstream_slots_reclaimed_total Target slots (--target-concurrency) taken back from calls still running a request timeout after their request gave up.\n# TYPE rak_upstream_slots_reclaimed_total counter\n");
        let _ = writeln!(out, "rak_upstream_slots_reclaimed_total {}", t.reclaimed_slots);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_the_text_format_holds_every_series() {
        let m = Metrics::default();
        m.observe_request("/search", 200, 0.003);
        m.observe_request("/search", 200, 0.2);
        m.observe_request("/search", 429, 0.0001);
        m.observe_batch(5);
        let text = m.render();
        assert!(text.contains("rak_requests_total{route=\"/search\",status=\"200\"} 2"), "{text}");
        assert!(text.contains("rak_request_errors_total{route=\"/search\",status=\"429\"} 1"), "{text}");
        assert!(text.contains("rak_request_duration_seconds_bucket{route=\"/search\",le=\"0.001\"} 1"), "{text}");
        assert!(text.contains("rak_request_duration_seconds_bucket{route=\"/search\",le=\"0.005\"} 2"), "{text}");
        assert!(text.contains("rak_request_duration_seconds_bucket{route=\"/search\",le=\"+Inf\"} 3"), "{text}");
        assert!(text.contains("rak_batch_size_bucket{le=\"4\"} 0") && text.contains("rak_batch_size_bucket{le=\"8\"} 1"), "{text}");
        assert!(text.contains("rak_queue_depth 0"), "{text}");
    }
}
