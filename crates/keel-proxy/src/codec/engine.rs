//! An inference engine's own account of its load, as vLLM gives it: the requests waiting in its
//! queue, those running, and the share of its KV cache in use. Two wire forms, one reading:
//! the named metrics of its ORCA header (`named_metrics.num_requests_waiting`,
//! `named_metrics.kv_cache_usage_perc`, read by keel-balance's [`OrcaReport`]) and the gauges
//! of its Prometheus `/metrics` (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
//! `vllm:kv_cache_usage_perc`).

use keel_balance::OrcaReport;

/// What an engine said about its load. `f32`: the values are small counts and a share, and
/// the report rides in every response head of a cluster that asks for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EngineLoad {
    /// Requests waiting in the engine's queue (vLLM `num_requests_waiting`).
    pub waiting: f32,
    /// Requests running (vLLM `num_requests_running`); NaN when the form has none (ORCA).
    pub running: f32,
    /// KV cache in use, 0 to 1 (vLLM `kv_cache_usage_perc`, a share despite its name); NaN
    /// when not given.
    pub kv_cache: f32,
}

/// An engine report as it arrived: readable, or counted and ignored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum EngineReport {
    /// A report with at least the queue depth, every value in its range.
    Load(EngineLoad),
    /// Unreadable: not the form's grammar, no queue depth, or a value out of range.
    Malformed,
}

/// The ORCA named metric of the queue depth.
pub(crate) const ORCA_WAITING: &str = "num_requests_waiting";
/// The ORCA named metric of the KV cache's use.
pub(crate) const ORCA_KV_CACHE: &str = "kv_cache_usage_perc";

impl EngineReport {
    /// The engine's report in an ORCA header's value (TEXT or JSON form).
    pub(crate) fn of_orca(value: &[u8]) -> (Option<OrcaReport>, Self) {
        match OrcaReport::parse(value) {
            Ok(r) => {
                let named = |n: &str| {
                    r.named_metrics
                        .iter()
                        .find(|(k, _)| k == n)
                        .map(|(_, v)| *v)
                };
                let report = Self::checked(named(ORCA_WAITING), None, named(ORCA_KV_CACHE));
                (Some(r), report)
            }
            Err(_) => (None, Self::Malformed),
        }
    }

    /// The engine's report in a Prometheus text exposition (vLLM's `/metrics`): each gauge
    /// summed over its series (one per engine core or model), the KV use their mean.
    pub(crate) fn of_prometheus(text: &[u8]) -> Self {
        let (mut waiting, mut running, mut kv, mut kv_n) = (None::<f64>, None::<f64>, 0.0, 0u32);
        for line in text.split(|b| *b == b'\n') {
            let line = line.trim_ascii();
            if line.first().is_none_or(|b| *b == b'#') {
                continue;
            }
            let name_end = line
                .iter()
                .position(|b| matches!(b, b'{' | b' ' | b'\t'))
                .unwrap_or(line.len());
            let slot = match &line[..name_end] {
                b"vllm:num_requests_waiting" => 0,
                b"vllm:num_requests_running" => 1,
                b"vllm:kv_cache_usage_perc" => 2,
                _ => continue,
            };
            let Some(v) = sample_value(&line[name_end..]) else {
                return Self::Malformed;
            };
            match slot {
                0 => *waiting.get_or_insert(0.0) += v,
                1 => *running.get_or_insert(0.0) += v,
                _ => {
                    kv += v;
                    kv_n += 1;
                }
            }
        }
        let kv = (kv_n > 0).then(|| kv / f64::from(kv_n));
        Self::checked(waiting, Some(running), kv)
    }

    /// A report of these values: malformed without a queue depth or with a value out of its
    /// range (a count below 0, a share outside 0 to 1). `running`: `None` when the form has
    /// no such value, `Some(None)` when it should have and does not.
    fn checked(waiting: Option<f64>, running: Option<Option<f64>>, kv: Option<f64>) -> Self {
        let count = |v: f64| v.is_finite() && v >= 0.0;
        let Some(waiting) = waiting.filter(|v| count(*v)) else {
            return Self::Malformed;
        };
        let running = match running {
            None => f64::NAN,
            Some(Some(r)) if count(r) => r,
            Some(_) => return Self::Malformed,
        };
        let kv_cache = match kv {
            None => f64::NAN,
            Some(k) if (0.0..=1.0).contains(&k) => k,
            Some(_) => return Self::Malformed,
        };
        Self::Load(EngineLoad {
            waiting: waiting as f32,
            running: running as f32,
            kv_cache: kv_cache as f32,
        })
    }
}

/// The value of a sample line after its name: optional `{labels}`, the value, an optional
/// timestamp.
fn sample_value(rest: &[u8]) -> Option<f64> {
    let mut rest = rest;
    if rest.first() == Some(&b'{') {
        // Label values may hold `}` inside quotes.
        let mut quoted = false;
        let mut k = 1;
        loop {
            match *rest.get(k)? {
                b'\\' if quoted => k += 1,
                b'"' => quoted = !quoted,
                b'}' if !quoted => break,
                _ => {}
            }
            k += 1;
        }
        rest = &rest[k + 1..];
    }
    let rest = rest.trim_ascii_start();
    let end = rest
        .iter()
        .position(|b| b.is_ascii_whitespace())
        .unwrap_or(rest.len());
    let v: f64 = std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?;
    v.is_finite().then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(r: EngineReport) -> EngineLoad {
        match r {
            EngineReport::Load(l) => l,
            EngineReport::Malformed => panic!("malformed"),
        }
    }

    #[test]
    fn vllms_orca_header_in_both_forms() {
        let text =
            b"TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=3.0";
        let l = load(EngineReport::of_orca(text).1);
        assert_eq!((l.waiting, l.kv_cache), (3.0, 0.25));
        assert!(l.running.is_nan());
        let json =
            br#"JSON {"named_metrics": {"kv_cache_usage_perc": 0.5, "num_requests_waiting": 0.0}}"#;
        let l = load(EngineReport::of_orca(json).1);
        assert_eq!((l.waiting, l.kv_cache), (0.0, 0.5));
    }

    #[test]
    fn a_report_without_the_queue_or_out_of_range_is_malformed() {
        for bad in [
            &b"TEXT named_metrics.kv_cache_usage_perc=0.25"[..],
            b"TEXT named_metrics.num_requests_waiting=abc",
            b"TEXT named_metrics.num_requests_waiting=-1",
            b"TEXT named_metrics.num_requests_waiting=1, named_metrics.kv_cache_usage_perc=1.5",
            b"BIN AAAA",
            b"",
        ] {
            assert_eq!(
                EngineReport::of_orca(bad).1,
                EngineReport::Malformed,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn vllms_gauges_summed_over_their_series() {
        let text = b"# HELP vllm:num_requests_waiting Waiting.\n\
            # TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2.0\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 3.0\n\
            vllm:num_requests_running{model_name=\"a}b\",engine=\"0\"} 4.0 1700000000000\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n\
            vllm:num_requests_waiting_total 99\n";
        let l = load(EngineReport::of_prometheus(text));
        assert_eq!((l.waiting, l.running, l.kv_cache), (5.0, 4.0, 0.375));
    }

    #[test]
    fn metrics_without_the_gauges_are_malformed() {
        assert_eq!(
            EngineReport::of_prometheus(b"up 1\n"),
            EngineReport::Malformed
        );
        assert_eq!(
            EngineReport::of_prometheus(b"vllm:num_requests_waiting 1\n"),
            EngineReport::Malformed,
            "no running gauge"
        );
        assert_eq!(
            EngineReport::of_prometheus(
                b"vllm:num_requests_waiting{a=\"b\"} x\nvllm:num_requests_running 1\n"
            ),
            EngineReport::Malformed
        );
    }
}
