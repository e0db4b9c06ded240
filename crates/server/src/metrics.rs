//! Prometheus metrics: requests and their latencies, time to first token and between tokens,
//! tokens, batch sizes, the queue, and the expert cache of the model being served.

use prometheus::{
    exponential_buckets, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use sluice_model::expert::ExpertStats;

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub request_seconds: HistogramVec,
    pub ttft_seconds: Histogram,
    pub inter_token_seconds: Histogram,
    pub prompt_tokens: IntCounter,
    pub reused_prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    pub spec_drafted_tokens: IntCounter,
    pub spec_accepted_tokens: IntCounter,
    pub cancelled: IntCounter,
    pub failed: IntCounter,
    pub rejected: IntCounterVec,
    pub batch_size: Histogram,
    pub batch_tokens: Histogram,
    pub step_seconds: Histogram,
    pub queue_depth: IntGauge,
    pub active: IntGauge,
    pub state_reserved_bytes: IntGauge,
    pub prefix_cache_bytes: IntGauge,
    pub prefix_cache_entries: IntGauge,
    experts_counters: IntCounterVec,
    experts_stall_ns: IntCounterVec,
    experts_gauges: IntGaugeVec,
    experts_tiers: IntCounterVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Only fails for malformed names or duplicate registration, both fixed in this file.
    r.unwrap_or_else(|e| panic!("metrics definition: {e}"))
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let reg = |c: Box<dyn prometheus::core::Collector>| must(registry.register(c));
        let counter = |name: &str, help: &str| {
            let c = must(IntCounter::new(name, help));
            reg(Box::new(c.clone()));
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = must(IntGauge::new(name, help));
            reg(Box::new(g.clone()));
            g
        };
        let hist = |name: &str, help: &str, buckets: Vec<f64>| {
            let h = must(Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)));
            reg(Box::new(h.clone()));
            h
        };
        let secs = || must(exponential_buckets(0.001, 2.0, 18));
        let requests = must(IntCounterVec::new(
            Opts::new("sluice_http_requests_total", "HTTP requests by endpoint and status code"),
            &["endpoint", "status"],
        ));
        reg(Box::new(requests.clone()));
        let request_seconds = must(HistogramVec::new(
            HistogramOpts::new(
                "sluice_request_duration_seconds",
                "Completion requests: time from arrival to the last token (or the error)",
            )
            .buckets(secs()),
            &["endpoint"],
        ));
        reg(Box::new(request_seconds.clone()));
        let rejected = must(IntCounterVec::new(
            Opts::new("sluice_requests_rejected_total", "Completion requests turned away before running, by reason"),
            &["reason"],
        ));
        reg(Box::new(rejected.clone()));
        let experts_counters = must(IntCounterVec::new(
            Opts::new("sluice_expert_cache_events_total", "Expert cache counters of the served model"),
            &["model", "event"],
        ));
        reg(Box::new(experts_counters.clone()));
        let experts_stall_ns = must(IntCounterVec::new(
            Opts::new("sluice_expert_cache_stall_nanoseconds_total", "Time the forward pass waited for expert reads"),
            &["model"],
        ));
        reg(Box::new(experts_stall_ns.clone()));
        let experts_tiers = must(IntCounterVec::new(
            Opts::new(
                "sluice_expert_tier_events_total",
                "Reads, bytes, read time and errors of each tier below the expert cache (a remote model's disk tier and remote)",
            ),
            &["model", "tier", "event"],
        ));
        reg(Box::new(experts_tiers.clone()));
        let experts_gauges = must(IntGaugeVec::new(
            Opts::new("sluice_expert_cache_bytes", "Expert cache sizes: quota and resident bytes"),
            &["model", "kind"],
        ));
        reg(Box::new(experts_gauges.clone()));
        Metrics {
            requests,
            request_seconds,
            ttft_seconds: hist(
                "sluice_time_to_first_token_seconds",
                "From a request's arrival to its first generated token",
                secs(),
            ),
            inter_token_seconds: hist(
                "sluice_inter_token_seconds",
                "Between consecutive generated tokens of a request",
                secs(),
            ),
            prompt_tokens: counter("sluice_prompt_tokens_total", "Prompt tokens of admitted requests"),
            reused_prompt_tokens: counter(
                "sluice_prompt_tokens_reused_total",
                "Prompt tokens not run again because a cached sequence state held them",
            ),
            generated_tokens: counter("sluice_generated_tokens_total", "Tokens generated"),
            spec_drafted_tokens: counter(
                "sluice_spec_drafted_tokens_total",
                "Tokens drafted for speculating requests (n-gram lookup or the draft model)",
            ),
            spec_accepted_tokens: counter("sluice_spec_accepted_tokens_total", "Drafted tokens the model kept"),
            cancelled: counter(
                "sluice_requests_cancelled_total",
                "Requests whose client went away before they finished (their slot was freed)",
            ),
            failed: counter("sluice_requests_failed_total", "Requests that failed while running"),
            rejected,
            batch_size: hist(
                "sluice_batch_size",
                "Sequences in each forward pass",
                vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0],
            ),
            batch_tokens: hist(
                "sluice_batch_tokens",
                "Tokens in each forward pass",
                must(exponential_buckets(1.0, 2.0, 12)),
            ),
            step_seconds: hist("sluice_step_seconds", "Duration of each forward pass and sampling step", secs()),
            queue_depth: gauge("sluice_queue_depth", "Requests waiting to be admitted"),
            active: gauge("sluice_active_requests", "Requests in the running batch"),
            state_reserved_bytes: gauge(
                "sluice_state_reserved_bytes",
                "Sequence state (KV and recurrent) reserved by running requests",
            ),
            prefix_cache_bytes: gauge("sluice_prefix_cache_bytes", "Bytes held by cached sequence states"),
            prefix_cache_entries: gauge("sluice_prefix_cache_entries", "Cached sequence states"),
            experts_counters,
            experts_stall_ns,
            experts_gauges,
            experts_tiers,
            registry,
        }
    }

    /// Brings the expert cache metrics of `model` up to `s` (the source's running totals).
    pub fn set_experts(&self, model: &str, s: &ExpertStats) {
        let events = [
            ("hit", s.hits),
            ("miss", s.misses),
            ("prefetch_hit", s.prefetch_hits),
            ("prefetch_issued", s.prefetch_issued),
            ("prefetch_wasted", s.prefetch_wasted),
            ("eviction", s.evictions),
            ("bytes_read", s.bytes_read),
            ("bytes_loaded", s.loaded_bytes),
        ];
        for (event, v) in events {
            let c = self.experts_counters.with_label_values(&[model, event]);
            c.inc_by(v.saturating_sub(c.get()));
        }
        let c = self.experts_stall_ns.with_label_values(&[model]);
        c.inc_by(s.stall_ns.saturating_sub(c.get()));
        for t in &s.tiers {
            for (event, v) in [
                ("read", t.reads),
                ("byte", t.bytes),
                ("read_nanosecond", t.read_ns),
                ("error", t.errors),
                ("merged_read", t.merged),
            ] {
                let c = self.experts_tiers.with_label_values(&[model, &t.tier, event]);
                c.inc_by(v.saturating_sub(c.get()));
            }
        }
        self.experts_gauges.with_label_values(&[model, "quota"]).set(s.quota_bytes as i64);
        self.experts_gauges.with_label_values(&[model, "resident"]).set(s.resident_bytes as i64);
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            return format!("# error encoding metrics: {e}\n");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
