//! Token budgets (`[cluster.token_budget]`) on loopback, in front of real `keel backend --llm`
//! engines: a tenant's budget is charged exactly the tokens the engines' own counters add up
//! (streamed and whole answers, HTTP/1.1 and HTTP/2 clients, usage the client asked for or
//! not), to the token: a request whose estimate is one token more than what is left is
//! refused with `429` and `Retry-After`, one whose estimate is what is left goes through.
//! Refused, a tenant is admitted again once `Retry-After` has passed; tenants are independent,
//! and requests without a key share one budget or have none, as configured.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_testbed::llm::{self, LlmConfig, LlmHandle};

/// What a client got.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: String,
}

/// POSTs `body` to `/v1/completions` with `headers` over HTTP/1.1 or HTTP/2 (prior
/// knowledge), on a connection of its own, and reads the answer whole.
async fn complete(addr: SocketAddr, http2: bool, headers: &[(&str, &str)], body: &str) -> Answer {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = Request::post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .header("content-length", body.len());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let work = async {
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
        let retry_after = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            retry_after,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .expect("an answer within 10 s")
}

/// The tokens the engines counted, prompt and generated, all engines together.
async fn engine_tokens(engines: &[LlmHandle]) -> u64 {
    let mut sum = 0;
    for e in engines {
        let text = get(&format!("http://{}/metrics", e.addr()))
            .await
            .unwrap()
            .text();
        for name in ["vllm:prompt_tokens_total", "vllm:generation_tokens_total"] {
            sum += text
                .lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} in the engine's /metrics"))
                as u64;
        }
    }
    sum
}

/// A completion request whose budget estimate is exactly `estimate` tokens: its body's bytes /
/// 4, rounded up, plus its `max_tokens` of 1, the prompt padded to fit (`tag` makes it
/// unlike others).
fn with_estimate(estimate: u64, tag: &str) -> String {
    let body =
        |prompt: &str| format!(r#"{{"model":"keel-llm","prompt":"{prompt}","max_tokens":1}}"#);
    let bytes = 4 * (estimate - 1) as usize;
    let empty = body(tag).len();
    assert!(
        bytes >= empty,
        "an estimate of {estimate} is below the body's own"
    );
    let words = "lorem ipsum dolor sit amet ".repeat(bytes / 27 + 1);
    let text = format!("{tag}{}", &words[..bytes - empty]);
    let b = body(&text);
    assert_eq!(b.len(), bytes);
    b
}

/// The `429` of a spent budget: OpenAI's error shape, and `Retry-After` in whole seconds.
fn refused(a: &Answer, what: &str) -> u64 {
    assert_eq!(a.status, 429, "{what}: {}", a.body);
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{what}: {v}");
    assert_eq!(v["error"]["type"], "tokens", "{what}: {v}");
    let secs: u64 = a
        .retry_after
        .as_deref()
        .unwrap_or_else(|| panic!("{what}: Retry-After"))
        .parse()
        .unwrap();
    assert!(secs >= 1, "{what}: {secs}");
    secs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_budget_counts_exactly_the_engines_usage() {
    let engines = vec![
        llm::spawn(any_port(), LlmConfig::default()).await.unwrap(),
        llm::spawn(any_port(), LlmConfig::default()).await.unwrap(),
    ];
    // A day's budget: one token refills in 86.4 s, nothing within the test's few seconds.
    const TOKENS: u64 = 1000;
    let addrs: Vec<_> = engines.iter().map(|e| e.addr()).collect();
    let config = simple_config(
        &addrs,
        "round-robin",
        &format!(
            "inference = true\n\n[cluster.token_budget]\ntokens = {TOKENS}\nunit = \"day\"\nkey = \"header:x-tenant\"\n"
        ),
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());
    let a = [("x-tenant", "a")];

    // Streamed (usage asked for by the client, or by keel alone) and whole answers, from
    // HTTP/1.1 and HTTP/2 clients.
    let before = engine_tokens(&engines).await;
    let mut seen = 0;
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
                r#"{{"model":"keel-llm","prompt":"Answer briefly: question {http2} {i}","max_tokens":6,"stream":{stream}{options}}}"#
            );
            let got = complete(addr, http2, &a, &body).await;
            assert_eq!(
                got.status, 200,
                "http2 {http2} stream {stream}: {}",
                got.body
            );
            seen += 1;
        }
    }
    let used = engine_tokens(&engines).await - before;
    assert!(used > 6 * 6, "{used}");
    let charged = |basis: &'static str| {
        metric(
            admin,
            match basis {
                "usage" => "keel_token_budget_tokens_total{cluster=\"app\",basis=\"usage\"}",
                _ => "keel_token_budget_tokens_total{cluster=\"app\",basis=\"estimate\"}",
            },
        )
    };
    assert_eq!(charged("usage").await, Some(used as f64), "{seen} answers");
    assert_eq!(charged("estimate").await, Some(0.0));

    // What is left is exactly the budget less what the engines counted.
    let left = TOKENS - used;
    let over = complete(addr, false, &a, &with_estimate(left + 1, "over")).await;
    let secs = refused(&over, "one token more than is left");
    assert!(
        (80..=87).contains(&secs),
        "one token refills in 86.4 s: {secs}"
    );
    let fits = complete(addr, true, &a, &with_estimate(left, "fits")).await;
    assert_eq!(fits.status, 200, "exactly what is left: {}", fits.body);
    assert_eq!(
        metric(admin, "keel_token_budget_refused_total{cluster=\"app\"}").await,
        Some(1.0)
    );
    println!(
        "{seen} answers: the engines counted {used} tokens, the budget charged {used}; {left} of {TOKENS} left: {} refused (Retry-After {secs}), {left} admitted",
        left + 1
    );

    // Another tenant has a budget of its own, whole.
    let b = complete(
        addr,
        false,
        &[("x-tenant", "b")],
        &with_estimate(TOKENS, "b"),
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.body);
    // Requests without the header share one budget (`without_key = "shared"`, the default):
    // the second finds it spent by the first.
    let first = complete(addr, true, &[], &with_estimate(TOKENS, "anon1")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let second = complete(addr, false, &[], &with_estimate(TOKENS, "anon2")).await;
    refused(&second, "the shared budget");
    // For `promtool check metrics` (see scripts/check-metrics.sh).
    if let Ok(path) = std::env::var("KEEL_BUDGET_METRICS_OUT") {
        let text = get(&format!("http://{admin}/metrics"))
            .await
            .unwrap()
            .text();
        std::fs::write(path, text).unwrap();
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_tenant_is_admitted_after_retry_after_and_others_are_not_held() {
    let engine = llm::spawn(any_port(), LlmConfig::default()).await.unwrap();
    let dir = std::env::temp_dir().join(format!("keel-budget-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    // 600 tokens a minute: 10 a second refill.
    let config = simple_config(
        &[engine.addr()],
        "round-robin",
        &format!(
            "inference = true\n\n[cluster.token_budget]\ntokens = 600\nkey = \"api-key\"\nwithout_key = \"unlimited\"\n\n[access_log]\npath = \"{}\"\n",
            log.display()
        ),
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());

    // One tenant (one API key) per client protocol, at the same time.
    let tenant = |http2: bool| async move {
        let key = if http2 {
            "Bearer sk-two"
        } else {
            "Bearer sk-one"
        };
        let auth = [("authorization", key)];
        let what = format!("http2 {http2}");
        let whole = complete(addr, http2, &auth, &with_estimate(600, &what)).await;
        assert_eq!(
            whole.status, 200,
            "{what}: the whole budget: {}",
            whole.body
        );
        // About a dozen tokens are left (the body's JSON is estimated, not used).
        let start = Instant::now();
        let over = complete(addr, http2, &auth, &with_estimate(40, &what)).await;
        let secs = refused(&over, &what);
        assert!(
            secs <= 4,
            "{what}: {secs} s for at most 40 tokens at 10 a second"
        );
        let again = complete(addr, http2, &auth, &with_estimate(40, &what)).await;
        refused(&again, &what);
        tokio::time::sleep_until((start + Duration::from_secs(secs)).into()).await;
        let later = complete(addr, http2, &auth, &with_estimate(40, &what)).await;
        assert_eq!(later.status, 200, "{what}: after {secs} s: {}", later.body);
        secs
    };
    let (one, two) = tokio::join!(tenant(false), tenant(true));
    println!("refused, then admitted after Retry-After: {one} s (HTTP/1.1), {two} s (HTTP/2)");
    // Without a key: no budget (`without_key = "unlimited"`), whatever the estimate (here
    // over twice the budget; the engine takes at most 1920 tokens).
    let free = complete(addr, false, &[], &with_estimate(1500, "free")).await;
    assert_eq!(free.status, 200, "{}", free.body);
    assert_eq!(
        metric(admin, "keel_token_budget_refused_total{cluster=\"app\"}").await,
        Some(4.0),
        "refused after {one} and {two} s"
    );
    // The keys are nowhere keel writes.
    let metrics = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    let status = get(&format!("http://{admin}/status")).await.unwrap().text();
    proxy.shutdown(Duration::from_secs(1)).await;
    let logged = std::fs::read_to_string(&log).unwrap();
    // The status field itself: "429" alone also matched the host's port once (127.0.0.1:34429).
    let refused_lines = logged
        .lines()
        .filter(|l| l.contains("\"status\":429,"))
        .count();
    assert_eq!(refused_lines, 4, "{logged}");
    for text in [&metrics, &status, &logged] {
        assert!(!text.contains("sk-one") && !text.contains("sk-two"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
