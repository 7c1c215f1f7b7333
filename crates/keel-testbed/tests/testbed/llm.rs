//! `keel backend --llm` over real loopback sockets: vLLM's API, its prefix cache as usage shows
//! it, its metrics and ORCA header, and a lone request's TTFT against the engine's formula.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::Request;
use hyper_util::rt::TokioIo;
use keel_balance::OrcaReport;
use keel_model::inference::EngineSpec;
use keel_model::vocab::FailureMode;
use keel_testbed::llm::{self, LlmConfig, LlmHandle};
use serde_json::{json, Value};
use tokio::net::TcpStream;

async fn start(spec: EngineSpec) -> LlmHandle {
    let cfg = LlmConfig {
        spec,
        seed: 7,
        ..LlmConfig::default()
    };
    llm::spawn("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap()
}

/// The answer to one request on a fresh connection: status, headers, body, and when the first
/// body bytes came (after the request was sent).
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
    first_bytes: Duration,
}

async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let fut = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "test")
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let sent = Instant::now();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let mut incoming = resp.into_body();
        let mut all = Vec::new();
        let mut first_bytes = None;
        while let Some(frame) = incoming.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                first_bytes.get_or_insert_with(|| sent.elapsed());
                all.extend_from_slice(&data);
            }
        }
        Answer {
            status,
            headers,
            body: Bytes::from(all),
            first_bytes: first_bytes.unwrap_or_default(),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("answered within 10 s")
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> Answer {
    send(addr, "POST", path, &body.to_string(), &[]).await
}

fn json_of(a: &Answer) -> Value {
    serde_json::from_slice(&a.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&a.body)))
}

/// The `data:` payloads of a server-sent event stream.
fn events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "{text}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("a data event").to_string())
        .collect()
}

#[tokio::test]
async fn a_stream_sends_one_event_per_token_then_usage_then_done() {
    let server = start(EngineSpec::default()).await;
    let a = post(
        server.addr(),
        "/v1/completions",
        json!({"model": "keel-llm", "prompt": "Say something.", "max_tokens": 5,
               "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(a.status, 200);
    assert!(a.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let ev = events(&a.body);
    assert_eq!(ev.len(), 5 + 2, "{ev:?}"); // 5 tokens, the usage, [DONE]
    assert_eq!(ev[6], "[DONE]");
    for (i, e) in ev[..5].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty());
        let finish = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(v["choices"][0]["finish_reason"], finish);
    }
    let usage: Value = serde_json::from_str(&ev[5]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["usage"]["prompt_tokens"], 4); // 14 bytes
                                                    // Chat streams open with the assistant's role; without include_usage no usage chunk.
    let a = post(
        server.addr(),
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
               "stream": true}),
    )
    .await;
    let ev = events(&a.body);
    assert_eq!(ev.len(), 1 + 3 + 1, "{ev:?}");
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(ev[4], "[DONE]");
}

#[tokio::test]
async fn a_second_prompt_sharing_a_400_token_prefix_gets_its_full_blocks_from_cache() {
    let server = start(EngineSpec::default()).await;
    let shared: String = (0..1600).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let ask = |suffix: &str| json!({"prompt": format!("{shared}{suffix}"), "max_tokens": 2});
    let a = post(
        server.addr(),
        "/v1/completions",
        ask("first question, 40 bytes long......"),
    )
    .await;
    let b = post(
        server.addr(),
        "/v1/completions",
        ask("another one, also about as long....."),
    )
    .await;
    let (a, b) = (json_of(&a), json_of(&b));
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // 400 shared tokens are 25 full blocks of 16.
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"],
        25 * 16
    );
    assert_eq!(b["usage"]["prompt_tokens"], 409);
    assert_eq!(b["usage"]["completion_tokens"], 2);
    assert_eq!(b["usage"]["total_tokens"], 411);
    assert_eq!(b["object"], "text_completion");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    // Chat prompts are cached the same way.
    let chat = |q: &str| {
        json!({"model": "keel-llm", "messages": [
            {"role": "system", "content": shared}, {"role": "user", "content": q}]})
    };
    post(server.addr(), "/v1/chat/completions", chat("one?")).await;
    let c = json_of(&post(server.addr(), "/v1/chat/completions", chat("two?")).await);
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    // "system: " + 1600 bytes + "\n" = 1609 bytes: 25 full blocks shared.
    assert_eq!(
        c["usage"]["prompt_tokens_details"]["cached_tokens"],
        25 * 16
    );
    assert_eq!(c["usage"]["completion_tokens"], 16); // the default max_tokens
}

#[tokio::test]
async fn metrics_carry_vllms_names_and_count_the_cache_in_tokens() {
    let server = start(EngineSpec::default()).await;
    let prompt = "x".repeat(640); // 160 tokens, 10 blocks
    for _ in 0..2 {
        post(
            server.addr(),
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    }
    let a = send(server.addr(), "GET", "/metrics", "", &[]).await;
    assert_eq!(a.status, 200);
    let text = String::from_utf8(a.body.to_vec()).unwrap();
    let value = |name: &str| -> f64 {
        let prefix = format!("{name}{{model_name=\"keel-llm\",engine=\"0\"}} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"));
        line[prefix.len()..].parse().unwrap()
    };
    assert_eq!(value("vllm:num_requests_running"), 0.0);
    assert_eq!(value("vllm:num_requests_waiting"), 0.0);
    assert_eq!(value("vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(value("vllm:prefix_cache_queries_total"), 320.0);
    // The second prompt hits 9 of its 10 blocks (its last token is always computed).
    assert_eq!(value("vllm:prefix_cache_hits_total"), 144.0);
    assert_eq!(value("vllm:prompt_tokens_total"), 320.0);
    assert_eq!(value("vllm:generation_tokens_total"), 2.0);
    assert_eq!(value("vllm:time_to_first_token_seconds_count"), 2.0);
    assert!(text.contains(
        "vllm:time_to_first_token_seconds_bucket{model_name=\"keel-llm\",engine=\"0\",le=\"+Inf\"} 2.0"
    ));
}

#[tokio::test]
async fn orca_comes_only_when_asked_in_vllms_forms() {
    let server = start(EngineSpec::default()).await;
    let body = json!({"prompt": "hello", "max_tokens": 1}).to_string();
    let plain = send(server.addr(), "POST", "/v1/completions", &body, &[]).await;
    assert!(plain.headers.get("endpoint-load-metrics").is_none());
    for form in ["text", "json"] {
        let a = send(
            server.addr(),
            "POST",
            "/v1/completions",
            &body,
            &[("endpoint-load-metrics-format", form)],
        )
        .await;
        let v = a.headers["endpoint-load-metrics"].to_str().unwrap();
        assert!(v.starts_with(&form.to_uppercase()), "{v}");
        let r = OrcaReport::parse(v.as_bytes()).unwrap();
        let names: Vec<&str> = r.named_metrics.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["kv_cache_usage_perc", "num_requests_waiting"]);
    }
    // As vLLM: streams carry none.
    let stream = json!({"prompt": "hello", "max_tokens": 1, "stream": true}).to_string();
    let a = send(
        server.addr(),
        "POST",
        "/v1/completions",
        &stream,
        &[("endpoint-load-metrics-format", "text")],
    )
    .await;
    assert!(a.headers.get("endpoint-load-metrics").is_none());
}

#[tokio::test]
async fn a_lone_requests_ttft_is_its_prefill_steps() {
    // 1,000 prompt tokens in chunks of 400, 400, 200 at 4,000 tokens/s, each step 6 + 0.3 ms:
    // 3 x 6.3 + 250 = 268.9 ms to the first token.
    let spec = EngineSpec {
        max_batch_tokens: 400,
        ..EngineSpec::default()
    };
    let server = start(spec).await;
    let want = Duration::from_micros(268_900);
    let mut seen = Vec::new();
    for i in 0..3 {
        let prompt: String = format!("{i}").repeat(4000);
        let a = post(
            server.addr(),
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1, "stream": true}),
        )
        .await;
        assert_eq!(events(&a.body).len(), 2);
        seen.push(a.first_bytes);
    }
    // Tolerance: never early; at most 10 ms late (three timer wake-ups, loopback, a busy
    // 2-core machine), on the best of three.
    eprintln!("TTFT measured {seen:?}, formula {want:?}");
    let best = *seen.iter().min().unwrap();
    assert!(best >= want, "{seen:?}");
    assert!(best <= want + Duration::from_millis(10), "{seen:?}");
}

#[tokio::test]
async fn client_errors_are_vllms() {
    let server = start(EngineSpec::default()).await;
    let addr = server.addr();
    let bad = send(addr, "POST", "/v1/completions", "{not json", &[]).await;
    assert_eq!(bad.status, 400);
    assert_eq!(json_of(&bad)["error"]["code"], 400);
    assert_eq!(json_of(&bad)["error"]["type"], "BadRequestError");
    let missing = post(
        addr,
        "/v1/completions",
        json!({"model": "gpt-9", "prompt": "x"}),
    )
    .await;
    assert_eq!(missing.status, 404);
    assert_eq!(json_of(&missing)["error"]["type"], "NotFoundError");
    // 120 blocks of 16 tokens: at most 1,920 tokens, prompt and output.
    let long = post(
        addr,
        "/v1/completions",
        json!({"prompt": "y".repeat(7680), "max_tokens": 1}),
    )
    .await;
    assert_eq!(long.status, 400);
    assert!(json_of(&long)["error"]["message"]
        .as_str()
        .unwrap()
        .contains("1920"));
    assert_eq!(send(addr, "GET", "/nowhere", "", &[]).await.status, 404);
    assert_eq!(
        send(addr, "GET", "/v1/completions", "", &[]).await.status,
        405
    );
    assert_eq!(send(addr, "GET", "/health", "", &[]).await.status, 200);
    let models = json_of(&send(addr, "GET", "/v1/models", "", &[]).await);
    assert_eq!(models["data"][0]["id"], "keel-llm");
    assert_eq!(models["data"][0]["max_model_len"], 1920);
}

#[tokio::test]
async fn tokenize_and_render_answer_vllms_shapes() {
    let server = start(EngineSpec::default()).await;
    let addr = server.addr();
    let t = json_of(&post(addr, "/tokenize", json!({"prompt": "abcdefghij"})).await);
    assert_eq!(t["count"], 3);
    assert_eq!(t["max_model_len"], 1920);
    assert_eq!(t["tokens"].as_array().unwrap().len(), 3);
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let t = json_of(&post(addr, "/tokenize", chat.clone()).await);
    assert_eq!(t["count"], 3); // "user: Hi\n" is 9 bytes
    let r = json_of(&post(addr, "/v1/chat/completions/render", chat).await);
    assert_eq!(r["token_ids"], t["tokens"]);
    assert_eq!(r["sampling_params"]["max_tokens"], 4);
    assert!(r["request_id"].as_str().unwrap().starts_with("chatcmpl-"));
    let r = json_of(
        &post(
            addr,
            "/v1/completions/render",
            json!({"prompt": "abcdefghij"}),
        )
        .await,
    );
    assert_eq!(r[0]["token_ids"].as_array().unwrap().len(), 3);
    assert!(r[0]["request_id"].as_str().unwrap().starts_with("cmpl-"));
    // Rendering generates nothing.
    assert_eq!(server.requests(), 0);
}

#[tokio::test]
async fn the_backends_faults_apply() {
    let server = start(EngineSpec::default()).await;
    let addr = server.addr();
    let ask = json!({"prompt": "hello", "max_tokens": 4});
    server.set_fault(FailureMode::FAIL_AT_ONCE);
    let a = post(addr, "/v1/completions", ask.clone()).await;
    assert_eq!(a.status, 503);
    assert_eq!(json_of(&a)["error"]["code"], 503);
    server.set_fault(FailureMode::None);
    assert_eq!(post(addr, "/v1/completions", ask.clone()).await.status, 200);
    // Reset: a stream is cut after half of its tokens.
    server.set_fault(FailureMode::Reset);
    let stream = json!({"prompt": "hello", "max_tokens": 8, "stream": true}).to_string();
    let cut = async {
        let stream_conn = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream_conn))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::post("/v1/completions")
            .header("host", "test")
            .body(Full::new(Bytes::from(stream)))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        resp.into_body().collect().await.map(|_| ())
    };
    let r = tokio::time::timeout(Duration::from_secs(5), cut)
        .await
        .unwrap();
    assert!(r.is_err(), "the stream was not cut");
    // Slow: steps take 10 times as long.
    server.set_fault(FailureMode::Slow { factor: 10.0 });
    let began = Instant::now();
    let a = post(
        addr,
        "/v1/completions",
        json!({"prompt": "hello", "max_tokens": 3}),
    )
    .await;
    assert_eq!(a.status, 200);
    // 3 steps of 6.3 ms (a 2-token prompt's prefill is 0.5 ms), times 10.
    assert!(
        began.elapsed() >= Duration::from_millis(190),
        "{:?}",
        began.elapsed()
    );
}
