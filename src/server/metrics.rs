//! The server's counters and gauges, rendered as Prometheus text at `GET /metrics`. The speculative
//! decoding counters have vLLM's meaning: a draft is one sequence's verification of proposed tokens,
//! draft tokens are the tokens proposed (a tree's nodes), accepted tokens the ones the target kept, and
//! the per-position counter counts the verifications that accepted at least position + 1 tokens.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use crate::spec::SpecStats;

/// Bounds, in seconds, of the step-time histogram's buckets.
const STEP_BUCKETS: [f64; 12] = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0];

/// Every figure `/metrics` shows.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Figures>,
}

#[derive(Default, Clone)]
struct Figures {
    mode: String,
    kv_pages_total: usize,
    kv_pages_in_use: usize,
    running: usize,
    waiting: usize,
    requests_by_status: Vec<(String, u64)>,
    admitted: u64,
    cancelled: u64,
    prompt_tokens: u64,
    stats: SpecStats,
    step_count: u64,
    step_seconds: f64,
    step_buckets: [u64; STEP_BUCKETS.len()],
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Figures) -> T) -> T {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    /// Records the decoding mode and the cache's size.
    pub(crate) fn set_mode(&self, mode: &str, kv_pages_total: usize) {
        self.with(|f| {
            f.mode = mode.to_string();
            f.kv_pages_total = kv_pages_total;
        });
    }

    /// Requests in the batch and the cache pages they hold.
    pub(crate) fn set_running(&self, running: usize, kv_pages_in_use: usize) {
        self.with(|f| {
            f.running = running;
            f.kv_pages_in_use = kv_pages_in_use;
        });
    }

    /// Requests waiting for a place in the batch.
    pub(crate) fn set_waiting(&self, waiting: usize) {
        self.with(|f| f.waiting = waiting);
    }

    /// A request joined the batch with a prompt of `prompt_tokens`.
    pub(crate) fn count_admitted(&self, prompt_tokens: usize) {
        self.with(|f| {
            f.admitted += 1;
            f.prompt_tokens += prompt_tokens as u64;
        });
    }

    /// A running request was cancelled (its client went away or a stop string ended it).
    pub(crate) fn count_cancelled(&self) {
        self.with(|f| f.cancelled += 1);
    }

    /// A response was sent with HTTP `status` (or, for generations, the finish reason).
    pub(crate) fn count_request(&self, status: &str) {
        self.with(|f| match f.requests_by_status.iter_mut().find(|(s, _)| s == status) {
            Some((_, n)) => *n += 1,
            None => f.requests_by_status.push((status.to_string(), 1)),
        });
    }

    /// One engine step of `took`, and the engine's counters after it.
    pub(crate) fn record_step(&self, took: Duration, stats: &SpecStats) {
        self.with(|f| {
            let s = took.as_secs_f64();
            f.step_count += 1;
            f.step_seconds += s;
            for (bucket, &bound) in f.step_buckets.iter_mut().zip(&STEP_BUCKETS) {
                if s <= bound {
                    *bucket += 1;
                }
            }
            f.stats.clone_from(stats);
        });
    }

    /// KV cache pages held now.
    pub fn kv_pages_in_use(&self) -> usize {
        self.with(|f| f.kv_pages_in_use)
    }

    /// Requests in the batch now.
    pub fn running(&self) -> usize {
        self.with(|f| f.running)
    }

    /// The Prometheus text exposition of every figure.
    pub fn render(&self) -> String {
        let f = self.with(|f| f.clone());
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP kdtree_{name} {help}\n# TYPE kdtree_{name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "kdtree_{name}{labels} {v}");
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
        metric("mode_info", "gauge", "The decoding mode.", &[(format!("{{mode=\"{}\"}}", f.mode), 1.0)]);
        let statuses: Vec<(String, f64)> =
            f.requests_by_status.iter().map(|(s, n)| (format!("{{status=\"{s}\"}}"), *n as f64)).collect();
        metric("requests_total", "counter", "Responses by HTTP status or finish reason.", &statuses);
        metric("requests_admitted_total", "counter", "Requests that joined the batch.", &one(f.admitted as f64));
        metric("requests_cancelled_total", "counter", "Running requests cancelled.", &one(f.cancelled as f64));
        metric("num_requests_running", "gauge", "Requests in the batch.", &one(f.running as f64));
        metric("num_requests_waiting", "gauge", "Requests queued for the batch.", &one(f.waiting as f64));
        metric("kv_pages_in_use", "gauge", "KV cache pages held by requests.", &one(f.kv_pages_in_use as f64));
        metric("kv_pages_total", "gauge", "KV cache pages.", &one(f.kv_pages_total as f64));
        metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", &one(f.prompt_tokens as f64));
        metric("generation_tokens_total", "counter", "Tokens generated.", &one(f.stats.tokens as f64));
        metric("spec_decode_num_drafts_total", "counter", "Draft verifications.", &one(f.stats.drafts as f64));
        let draft_tokens = f.stats.draft_tokens as f64;
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", &one(draft_tokens));
        let accepted = f.stats.accepted as f64;
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", &one(accepted));
        let by_pos: Vec<(String, f64)> = f
            .stats
            .accepted_by_depth
            .iter()
            .enumerate()
            .map(|(p, n)| (format!("{{position=\"{p}\"}}"), *n as f64))
            .collect();
        metric(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Verifications that accepted at least position + 1 draft tokens.",
            &by_pos,
        );
        let mut hist: Vec<(String, f64)> = STEP_BUCKETS
            .iter()
            .zip(f.step_buckets)
            .map(|(b, n)| (format!("_bucket{{le=\"{b}\"}}"), n as f64))
            .collect();
        hist.push(("_bucket{le=\"+Inf\"}".into(), f.step_count as f64));
        hist.push(("_sum".into(), f.step_seconds));
        hist.push(("_count".into(), f.step_count as f64));
        metric("step_seconds", "histogram", "Engine step time (prefill, decode or verify).", &hist);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_shows_spec_counters_and_histogram() {
        let m = Metrics::default();
        let stats =
            SpecStats { drafts: 3, draft_tokens: 48, accepted: 7, accepted_by_depth: vec![3, 2], ..Default::default() };
        m.record_step(Duration::from_millis(3), &stats);
        m.count_request("200");
        let text = m.render();
        assert!(text.contains("kdtree_spec_decode_num_drafts_total 3\n"), "{text}");
        assert!(text.contains("kdtree_spec_decode_num_accepted_tokens_total 7\n"), "{text}");
        assert!(text.contains("kdtree_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 2\n"), "{text}");
        assert!(text.contains("kdtree_step_seconds_bucket{le=\"0.002\"} 0\n"), "{text}");
        assert!(text.contains("kdtree_step_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("kdtree_requests_total{status=\"200\"} 1\n"), "{text}");
    }
}
