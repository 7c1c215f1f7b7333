//! What `keel backend --llm` says about its load: `/metrics` in Prometheus' text format with
//! vLLM's names and labels, and vLLM's ORCA header (`endpoint-load-metrics`) when a request asks
//! for it with `endpoint-load-metrics-format: text|json`.

use std::fmt::Write as _;

use super::runner::{Snapshot, TTFT_BUCKETS};

/// The request header that asks for an ORCA report, and its forms.
pub(crate) const ORCA_FORMAT_HEADER: &str = "endpoint-load-metrics-format";

/// `/metrics`: vLLM's gauges, counters and TTFT histogram, labelled `model_name` and `engine`.
pub(crate) fn prometheus(s: &Snapshot, model: &str) -> String {
    let c = &s.counters;
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(model));
    let mut out = String::with_capacity(4096);
    let mut one = |name: &str, kind: &str, help: &str, value: String| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}\n"
        );
    };
    one(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        format!("{:?}", c.running as f64),
    );
    one(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        format!("{:?}", c.waiting as f64),
    );
    one(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{:?}", c.kv_usage),
    );
    one(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        format!("{:?}", c.prefix_queries as f64),
    );
    one(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        format!("{:?}", c.prefix_hits as f64),
    );
    one(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        format!("{:?}", c.prompt_tokens as f64),
    );
    one(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        format!("{:?}", c.generation_tokens as f64),
    );
    one(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        format!("{:?}", c.preemptions as f64),
    );
    let _ = write!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{{labels},finished_reason=\"length\"}} {:?}\n",
        c.finished as f64
    );
    let name = "vllm:time_to_first_token_seconds";
    let _ = write!(
        out,
        "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram\n"
    );
    let mut cumulative = 0;
    for (bound, n) in TTFT_BUCKETS.iter().zip(s.ttft_buckets) {
        cumulative += n;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{bound:?}\"}} {:?}",
            cumulative as f64
        );
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels},le=\"+Inf\"}} {:?}",
        s.ttft_count as f64
    );
    let _ = writeln!(out, "{name}_count{{{labels}}} {:?}", s.ttft_count as f64);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", s.ttft_sum);
    out
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// vLLM's ORCA header value in the form asked for (`text` or `json`, any case), with
/// `named_metrics.kv_cache_usage_perc` and `named_metrics.num_requests_waiting`; `None` for
/// another form (vLLM then sends none).
pub(crate) fn orca(s: &Snapshot, form: &str) -> Option<String> {
    let kv = s.counters.kv_usage;
    let waiting = s.counters.waiting as f64;
    // Python's float repr, as vLLM writes them: 0.0, 0.25.
    if form.eq_ignore_ascii_case("text") {
        Some(format!(
            "TEXT named_metrics.kv_cache_usage_perc={kv:?}, named_metrics.num_requests_waiting={waiting:?}"
        ))
    } else if form.eq_ignore_ascii_case("json") {
        Some(format!(
            "JSON {{\"named_metrics\": {{\"kv_cache_usage_perc\": {kv:?}, \"num_requests_waiting\": {waiting:?}}}}}"
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_balance::OrcaReport;

    #[test]
    fn orca_reads_back_in_both_forms() {
        let mut s = Snapshot::default();
        s.counters.kv_usage = 0.25;
        s.counters.waiting = 3;
        for form in ["text", "JSON"] {
            let v = orca(&s, form).unwrap();
            let r = OrcaReport::parse(v.as_bytes()).unwrap();
            assert_eq!(
                r.named_metrics,
                vec![
                    ("kv_cache_usage_perc".to_string(), 0.25),
                    ("num_requests_waiting".to_string(), 3.0)
                ],
                "{v}"
            );
        }
        assert_eq!(orca(&s, "bin"), None);
    }

    #[test]
    fn the_histogram_is_cumulative() {
        let mut s = Snapshot::default();
        s.ttft_buckets[2] = 1; // <= 10 ms
        s.ttft_buckets[7] = 2; // <= 100 ms
        s.ttft_count = 3;
        let text = prometheus(&s, "m");
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.08\"} 1.0"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.1\"} 3.0"
        ));
    }
}
