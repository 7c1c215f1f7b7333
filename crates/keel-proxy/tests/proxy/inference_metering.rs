//! `inference = true` on loopback, in front of the real `keel backend --llm` engine: the access
//! log's line of each completion (streamed or not, from HTTP/1.1 and HTTP/2 clients) carries
//! the engine's own token counts, its model and the times of its tokens; a streamed request
//! that did not ask for `usage` gets none (keel asked for it and took it out), one that asked
//! gets the engine's event unchanged; `/metrics` and `/status` count the same tokens.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_testbed::llm::{self, LlmConfig};

/// What a client got: status, body, and when the first byte of the body arrived after the
/// request was sent.
struct Answer {
    status: u16,
    body: String,
    first_byte: Duration,
}

/// POSTs `body` to `/v1/completions` over HTTP/1.1 or HTTP/2 (prior knowledge), on a
/// connection of its own, and reads the answer frame by frame.
async fn complete(addr: SocketAddr, http2: bool, body: &str) -> Answer {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = Request::post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let work = async {
        let sent = Instant::now();
        let resp = if http2 {
            let (mut s, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            s.send_request(req).await.unwrap()
        } else {
            let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .unwrap();
            tokio::spawn(conn);
            s.send_request(req).await.unwrap()
        };
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        let mut got = Vec::new();
        let mut first_byte = None;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                if !data.is_empty() {
                    first_byte.get_or_insert_with(|| sent.elapsed());
                }
                got.extend_from_slice(&data);
            }
        }
        Answer {
            status,
            body: String::from_utf8(got).unwrap(),
            first_byte: first_byte.unwrap_or_default(),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .expect("an answer within 10 s")
}

/// The engine's own counters of tokens: prompt, generated, prompt tokens its cache held.
async fn engine_tokens(engine: SocketAddr) -> [u64; 3] {
    let text = get(&format!("http://{engine}/metrics"))
        .await
        .unwrap()
        .text();
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in the engine's /metrics")) as u64
    };
    [
        value("vllm:prompt_tokens_total"),
        value("vllm:generation_tokens_total"),
        value("vllm:prefix_cache_hits_total"),
    ]
}

/// The access log's lines once there are `n`.
async fn log_lines(path: &Path, n: usize) -> Vec<serde_json::Value> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<_> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if lines.len() >= n || start.elapsed() > Duration::from_secs(5) {
            assert_eq!(lines.len(), n, "{text}");
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `usage` object of a stream's events, if one carried it.
fn usage_event(stream: &str) -> Option<serde_json::Value> {
    stream
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
        .find(|v| v.get("usage").is_some_and(|u| !u.is_null()))
        .map(|v| v["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_completion_is_logged_with_the_engines_usage_and_its_token_times() {
    let engine = llm::spawn(any_port(), LlmConfig::default()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("keel-metering-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let config = simple_config(
        &[engine.addr()],
        "round-robin",
        &format!(
            "inference = true\n\n[access_log]\npath = \"{}\"\n",
            log.display()
        ),
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());

    let shared = "You are a careful assistant. Answer briefly and cite what you use. ".repeat(4);
    let mut totals = [0u64; 3];
    let mut n = 0;
    for http2 in [false, true] {
        for (i, (stream, asks)) in [(true, false), (true, true), (false, false)]
            .into_iter()
            .enumerate()
        {
            let options = if asks {
                r#","stream_options":{"include_usage":true}"#
            } else {
                ""
            };
            let body = format!(
                r#"{{"model":"keel-llm","prompt":"{shared} question {http2} {i}","max_tokens":6,"stream":{stream}{options}}}"#
            );
            let before = engine_tokens(engine.addr()).await;
            let got = complete(addr, http2, &body).await;
            let after = engine_tokens(engine.addr()).await;
            let what = format!("http2 {http2}, stream {stream}, asks {asks}");
            assert_eq!(got.status, 200, "{what}: {}", got.body);
            let sent: Vec<u64> = (0..3).map(|k| after[k] - before[k]).collect();
            assert!(sent[0] > 0 && sent[1] > 0, "{what}: {sent:?}");
            for k in 0..3 {
                totals[k] += sent[k];
            }
            n += 1;

            // What the client got: usage only when it asked, or for a whole answer.
            let usage = if stream {
                assert!(
                    got.body.ends_with("data: [DONE]\n\n"),
                    "{what}: {}",
                    got.body
                );
                usage_event(&got.body)
            } else {
                let v: serde_json::Value = serde_json::from_str(&got.body).unwrap();
                Some(v["usage"].clone())
            };
            if stream && !asks {
                assert_eq!(
                    usage, None,
                    "{what}: a usage event the client did not ask for"
                );
            } else {
                let u = usage.unwrap_or_else(|| panic!("{what}: the usage it asked for"));
                assert_eq!(u["prompt_tokens"], sent[0], "{what}");
                assert_eq!(u["completion_tokens"], sent[1], "{what}");
                assert_eq!(
                    u["prompt_tokens_details"]["cached_tokens"], sent[2],
                    "{what}"
                );
            }

            // The log's line: the engine's counts, its model, token times.
            let line = log_lines(&log, n).await.pop().unwrap();
            assert_eq!(line["prompt_tokens"], sent[0], "{what}: {line}");
            assert_eq!(line["completion_tokens"], sent[1], "{what}: {line}");
            assert_eq!(line["cached_tokens"], sent[2], "{what}: {line}");
            assert_eq!(line["model"], "keel-llm", "{what}: {line}");
            let ttft = line["ttft_ms"].as_f64().expect("ttft_ms");
            let client_ms = got.first_byte.as_secs_f64() * 1e3;
            assert!(
                ttft > 0.0 && ttft <= line["duration_ms"].as_f64().unwrap(),
                "{what}: {line}"
            );
            if stream {
                // keel times the first token from the request's arrival to its passing: the
                // client, which sent earlier and reads later, cannot have seen it sooner.
                assert!(
                    ttft <= client_ms + 1.0,
                    "{what}: keel {ttft} ms, client {client_ms} ms"
                );
                assert!(
                    line["itl_ms"].as_f64().is_some_and(|v| v > 0.0),
                    "{what}: {line}"
                );
            } else {
                assert!(line["itl_ms"].is_null(), "{what}: {line}");
            }
        }
    }

    // `/metrics` and `/status` count the same tokens.
    let prompt = metric(
        admin,
        "keel_inference_tokens_total{cluster=\"app\",model=\"keel-llm\",kind=\"prompt\"}",
    )
    .await;
    assert_eq!(prompt, Some(totals[0] as f64));
    let cached = metric(
        admin,
        "keel_inference_tokens_total{cluster=\"app\",model=\"keel-llm\",kind=\"cached\"}",
    )
    .await;
    assert_eq!(cached, Some(totals[2] as f64));
    let ttft_count = metric(
        admin,
        "keel_inference_time_to_first_token_seconds_count{cluster=\"app\",model=\"keel-llm\"}",
    )
    .await;
    assert_eq!(ttft_count, Some(n as f64));
    let status: serde_json::Value =
        serde_json::from_str(&get(&format!("http://{admin}/status")).await.unwrap().text())
            .unwrap();
    let model = &status["clusters"][0]["inference"]["models"][0];
    assert_eq!(model["model"], "keel-llm", "{model}");
    assert_eq!(model["answers"], n, "{model}");
    assert_eq!(model["completion_tokens"], totals[1], "{model}");
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_to_other_clusters_log_no_inference_fields() {
    let engine = llm::spawn(any_port(), LlmConfig::default()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("keel-metering-off-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let config = simple_config(
        &[engine.addr()],
        "round-robin",
        &format!("\n[access_log]\npath = \"{}\"\n", log.display()),
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let got = complete(
        addr,
        false,
        r#"{"model":"keel-llm","prompt":"hello","max_tokens":3,"stream":true}"#,
    )
    .await;
    assert_eq!(got.status, 200);
    // Not an inference cluster: the request goes as it is, and no usage comes back.
    assert_eq!(usage_event(&got.body), None);
    let line = log_lines(&log, 1).await.pop().unwrap();
    for k in [
        "ttft_ms",
        "itl_ms",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "model",
    ] {
        assert!(line.get(k).is_none(), "{k} in {line}");
    }
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&dir);
}
