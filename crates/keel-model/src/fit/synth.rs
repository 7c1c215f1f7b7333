//! Access logs written from a known model, in the proxy's JSON form: what the fit's tests
//! recover parameters from, and what the 1,000,000-line benchmark reads.
//!
//! Poisson arrivals, round-robin picks (the proxy's default), no retries; each endpoint has a
//! success latency from the vocabulary, optionally a FIFO concurrency limit (calls beyond it
//! wait, and the wait shows in their duration and in the in-flight counts), and shares of fast
//! errors, hangs to the timeout and resets.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{self, Write};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

use super::log::format_rfc3339;
use crate::vocab::Latency;

/// One endpoint of the true model.
#[derive(Debug, Clone)]
pub struct SynthEndpoint {
    /// Address written in the log.
    pub name: String,
    /// Success latency.
    pub latency: Latency,
    /// FIFO concurrency limit; `None`: unlimited.
    pub capacity: Option<u32>,
    /// Share of tries answered `503` after `error_after_ms`.
    pub error_share: f64,
    /// Time of such an error.
    pub error_after_ms: f64,
    /// Share of tries that hang to the timeout.
    pub hang_share: f64,
    /// Share of tries reset after their usual latency.
    pub reset_share: f64,
}

impl SynthEndpoint {
    /// A healthy endpoint with this latency.
    pub fn healthy(name: &str, latency: Latency) -> Self {
        SynthEndpoint {
            name: name.into(),
            latency,
            capacity: None,
            error_share: 0.0,
            error_after_ms: 1.0,
            hang_share: 0.0,
            reset_share: 0.0,
        }
    }
}

/// A log to write.
#[derive(Debug, Clone)]
pub struct SynthLog {
    /// Cluster name written on every line.
    pub cluster: String,
    /// Endpoints, picked in turn.
    pub endpoints: Vec<SynthEndpoint>,
    /// Requests per second (Poisson).
    pub rate: f64,
    /// Lines.
    pub requests: u64,
    /// The per-try timeout, in ms.
    pub timeout_ms: f64,
    /// Write `tries` (the richer form); false: today's form only.
    pub tries: bool,
    /// Seed.
    pub seed: u64,
    /// Time of the first arrival, seconds since the Unix epoch.
    pub start: f64,
}

/// Writes the log; returns the lines written.
pub fn write_log(spec: &SynthLog, out: &mut impl Write) -> io::Result<u64> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let gap = Exp::new(spec.rate).expect("rate > 0");
    let samplers: Vec<_> = spec.endpoints.iter().map(|e| e.latency.sampler()).collect();
    // Per endpoint: the end times of calls present (for in-flight) and, with a capacity, the
    // times its service slots come free.
    let mut present: Vec<BinaryHeap<Reverse<u64>>> = vec![BinaryHeap::new(); spec.endpoints.len()];
    let mut slots: Vec<BinaryHeap<Reverse<u64>>> = spec
        .endpoints
        .iter()
        .map(|e| (0..e.capacity.unwrap_or(0)).map(|_| Reverse(0)).collect())
        .collect();
    let mut now = 0.0f64;
    let mut line = String::with_capacity(512);
    for i in 0..spec.requests {
        now += gap.sample(&mut rng);
        let k = (i % spec.endpoints.len() as u64) as usize;
        let e = &spec.endpoints[k];
        let now_us = (now * 1e6) as u64;
        let heap = &mut present[k];
        while heap.peek().is_some_and(|Reverse(t)| *t <= now_us) {
            heap.pop();
        }
        let in_flight = heap.len();
        let u: f64 = rng.gen();
        let service_ms = samplers[k].sample_secs(&mut rng) * 1e3;
        let (outcome, status, ms) = if u < e.error_share {
            ("status 503", 503, e.error_after_ms)
        } else if u < e.error_share + e.hang_share {
            ("timeout", 504, spec.timeout_ms)
        } else {
            let wait_ms = match slots[k].pop() {
                Some(Reverse(free)) => {
                    let start = free.max(now_us);
                    let end = start + (service_ms * 1e3) as u64;
                    slots[k].push(Reverse(end));
                    (start - now_us) as f64 / 1e3
                }
                None => 0.0,
            };
            let ms = (wait_ms + service_ms).min(spec.timeout_ms);
            if ms >= spec.timeout_ms {
                ("timeout", 504, spec.timeout_ms)
            } else if u < e.error_share + e.hang_share + e.reset_share {
                ("reset", 502, ms)
            } else {
                ("ok", 200, ms)
            }
        };
        heap.push(Reverse(now_us + (ms * 1e3) as u64));
        let end = spec.start + now + ms / 1e3;
        line.clear();
        use std::fmt::Write as _;
        let cause = match outcome {
            "timeout" => format!(
                "\"upstream {} did not answer within {}ms\"",
                e.name, spec.timeout_ms
            ),
            "reset" => format!(
                "\"upstream {} closed the connection before the response\"",
                e.name
            ),
            _ => "null".into(),
        };
        let _ = write!(
            line,
            "{{\"time\":\"{}\",\"client\":\"127.0.0.1\",\"method\":\"GET\",\"host\":\"app\",\"path\":\"/\",\"protocol\":\"HTTP/1.1\",\"status\":{status},\"bytes_sent\":120,\"duration_ms\":{ms:.3},\"cluster\":\"{}\",\"endpoint\":\"{}\",\"attempts\":1,\"route\":null,\"cause\":{cause}",
            format_rfc3339(end),
            spec.cluster,
            e.name
        );
        if spec.tries {
            let _ = write!(
                line,
                ",\"tries\":[{{\"endpoint\":\"{}\",\"outcome\":\"{outcome}\",\"duration_ms\":{ms:.3},\"in_flight\":{in_flight}}}]",
                e.name
            );
        }
        line.push_str("}\n");
        out.write_all(line.as_bytes())?;
    }
    Ok(spec.requests)
}
