//! `[cluster.engine_signals]` on loopback: keel asks the real `keel backend --llm` engine for
//! its ORCA report and its view of the engine's queue follows each report; it scrapes the
//! engine's `/metrics` instead; a malformed report and a stale one change nothing and are
//! counted.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use keel_model::inference::EngineSpec;
use keel_testbed::llm::{self, LlmConfig, LlmHandle};

/// An engine that runs one request at a time: every other request waits in its queue.
async fn one_at_a_time() -> LlmHandle {
    let cfg = LlmConfig {
        spec: EngineSpec {
            max_running: 1,
            ..EngineSpec::default()
        },
        ..LlmConfig::default()
    };
    llm::spawn(any_port(), cfg).await.unwrap()
}

/// The engine view of endpoint `i` in keel's `/status`.
async fn engine_view(admin: SocketAddr, i: usize) -> serde_json::Value {
    let text = get(&format!("http://{admin}/status")).await.unwrap().text();
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    status["clusters"][0]["endpoints"][i]["engine"].clone()
}

/// `vllm:num_requests_waiting` in the engine's own `/metrics`.
async fn engine_waiting(engine: SocketAddr) -> f64 {
    let text = get(&format!("http://{engine}/metrics"))
        .await
        .unwrap()
        .text();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_waiting{"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .expect("vllm:num_requests_waiting")
}

/// `named_metrics.num_requests_waiting` of an ORCA TEXT header.
fn orca_waiting(header: &str) -> f64 {
    let r = keel_balance::OrcaReport::parse(header.as_bytes()).unwrap();
    r.named_metrics
        .iter()
        .find(|(k, _)| k == "num_requests_waiting")
        .map(|(_, v)| *v)
        .unwrap()
}

fn completion(max_tokens: u32, stream: bool) -> &'static [u8] {
    let body = format!(
        r#"{{"model":"keel-llm","prompt":"Tell me about load balancing.","max_tokens":{max_tokens},"stream":{stream}}}"#
    );
    Box::leak(body.into_boxed_str()).as_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keels_view_follows_the_engines_orca_reports_one_by_one() {
    let engine = one_at_a_time().await;
    let config = simple_config(
        &[engine.addr()],
        "least-request",
        "[cluster.engine_signals]\nsource = \"orca\"\n",
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());
    let url = format!("http://{addr}/v1/completions");

    // The engine reports only when asked, and the client does not ask: a report on the
    // answer is keel's asking.
    let direct = send(
        &client(),
        Method::POST,
        &format!("http://{}/v1/completions", engine.addr()),
        &[],
        completion(2, false),
    )
    .await
    .unwrap();
    assert!(direct.header("endpoint-load-metrics").is_none());

    // Six requests at once on an engine that runs one: they finish about 65 ms apart, each
    // answer reporting the queue behind it (5, 4, ... 0). Right after each answer, keel's
    // view holds that answer's report.
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let got = send(&client(), Method::POST, &url, &[], completion(10, false))
                .await
                .unwrap();
            let view = engine_view(admin, 0).await;
            (got, view)
        }));
    }
    let mut seen = Vec::new();
    for t in tasks {
        let (got, view) = t.await.unwrap();
        assert_eq!(got.status, 200, "{}", got.text());
        let header = got
            .header("endpoint-load-metrics")
            .expect("keel asked for the ORCA report");
        let reported = orca_waiting(header);
        assert_eq!(
            view["waiting"].as_f64(),
            Some(reported),
            "keel's view against the report on the answer just read: {view}"
        );
        assert!(view["kv_cache_usage"].as_f64().is_some(), "{view}");
        seen.push(reported);
    }
    // The first may run before the others arrive: a queue of at least 4, then drained.
    seen.sort_by(f64::total_cmp);
    seen.dedup();
    assert!(
        seen.len() >= 5 && seen[0] == 0.0,
        "the queue drained one by one: {seen:?}"
    );
    let view = engine_view(admin, 0).await;
    assert_eq!(view["reports"], 6, "{view}");
    assert_eq!(
        (view["malformed"].as_u64(), view["stale"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(engine_waiting(engine.addr()).await, 0.0);
    assert_eq!(
        metric(
            admin,
            &format!(
                "keel_engine_requests_waiting{{cluster=\"app\",endpoint=\"{}\"}}",
                engine.addr()
            )
        )
        .await,
        Some(0.0)
    );
    // A client that asks for the JSON form gets it (keel does not ask again), and keel reads
    // it too.
    let got = send(
        &client(),
        Method::POST,
        &url,
        &[("endpoint-load-metrics-format", "json")],
        completion(2, false),
    )
    .await
    .unwrap();
    let header = got.header("endpoint-load-metrics").unwrap_or_default();
    assert!(header.starts_with("JSON "), "{header}");
    assert_eq!(engine_view(admin, 0).await["reports"], 7);
    // A stream carries no report (vLLM's rule): the view keeps the last one.
    let got = send(&client(), Method::POST, &url, &[], completion(3, true))
        .await
        .unwrap();
    assert!(got.text().contains("data: [DONE]"));
    assert_eq!(engine_view(admin, 0).await["reports"], 7);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A server that answers each path with the ORCA header of that name (`/good`: a queue of 3)
/// and says in `x-asked` whether the request asked for a report.
async fn orca_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let orca = match req.uri().path() {
                        "/good" => "TEXT named_metrics.num_requests_waiting=3, named_metrics.kv_cache_usage_perc=0.5",
                        "/not-a-number" => "TEXT named_metrics.num_requests_waiting=abc",
                        "/no-queue" => "TEXT cpu_utilization=0.5, named_metrics.kv_cache_usage_perc=0.5",
                        "/kv-above-one" => "TEXT named_metrics.num_requests_waiting=9, named_metrics.kv_cache_usage_perc=1.5",
                        _ => "JSON {\"named_metrics\": {",
                    };
                    let asked = req
                        .headers()
                        .get("endpoint-load-metrics-format")
                        .map_or("no", |v| if v == "text" { "text" } else { "other" });
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("endpoint-load-metrics", orca)
                            .header("x-asked", asked)
                            .body(Full::new(Bytes::from_static(b"ok")))
                            .unwrap(),
                    )
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_report_changes_nothing_and_is_counted() {
    let server = orca_server().await;
    let config = simple_config(
        &[server],
        "round-robin",
        "[cluster.engine_signals]\nmax_age = \"600ms\"\n",
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());
    let got = get(&format!("http://{addr}/good")).await.unwrap();
    assert_eq!(
        got.header("x-asked"),
        Some("text"),
        "keel asks, in the text form"
    );
    let view = engine_view(admin, 0).await;
    assert_eq!(
        (view["waiting"].as_f64(), view["kv_cache_usage"].as_f64()),
        (Some(3.0), Some(0.5))
    );
    let bad = ["/not-a-number", "/no-queue", "/kv-above-one", "/cut-json"];
    for path in bad {
        let got = get(&format!("http://{addr}{path}")).await.unwrap();
        assert_eq!(got.status, 200, "a bad report does not fail the answer");
    }
    let view = engine_view(admin, 0).await;
    assert_eq!(view["waiting"].as_f64(), Some(3.0), "{view}");
    assert_eq!(view["kv_cache_usage"].as_f64(), Some(0.5), "{view}");
    assert_eq!(
        (view["reports"].as_u64(), view["malformed"].as_u64()),
        (Some(1), Some(4))
    );
    let line = format!(
        "keel_engine_reports_total{{cluster=\"app\",endpoint=\"{server}\",result=\"malformed\"}}"
    );
    assert_eq!(metric(admin, &line).await, Some(4.0));
    // The view forgets the report once it is max_age old.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let view = engine_view(admin, 0).await;
    assert!(
        view["waiting"].is_null() && view["age_ms"].is_null(),
        "{view}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keels_view_follows_the_engines_metrics_when_it_scrapes_them() {
    let engine = one_at_a_time().await;
    let config = simple_config(
        &[engine.addr()],
        "least-request",
        "[cluster.engine_signals]\nsource = \"metrics\"\ninterval = \"20ms\"\nmax_age = \"500ms\"\n",
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let admin = proxy.admin_addr().unwrap();
    let engine_url = format!("http://{}/v1/completions", engine.addr());
    // Eight requests straight to the engine, queued behind one another (about 130 ms each):
    // its queue goes 7, 6, ... 0, and keel learns it from the engine alone.
    let mut load = Vec::new();
    for _ in 0..8 {
        let url = engine_url.clone();
        load.push(tokio::spawn(async move {
            send(&client(), Method::POST, &url, &[], completion(20, false))
                .await
                .unwrap()
        }));
    }
    let until = Instant::now() + Duration::from_secs(2);
    while engine_waiting(engine.addr()).await < 5.0 {
        assert!(Instant::now() < until, "the engine's queue never grew");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (mut compared, mut highest) = (0, 0.0f64);
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let before = engine_waiting(engine.addr()).await;
        let read_before = Instant::now();
        // Two scrape intervals and their answers.
        tokio::time::sleep(Duration::from_millis(60)).await;
        let view = engine_view(admin, 0).await;
        let since_before = read_before.elapsed().as_secs_f64() * 1e3;
        let after = engine_waiting(engine.addr()).await;
        // Compared only when keel's report was taken after the first reading (a stalled
        // machine can delay a scrape past the sleep; the report's age says so).
        let fresh = view["age_ms"]
            .as_f64()
            .is_some_and(|age| age + 5.0 < since_before);
        if let (true, Some(keel)) = (fresh, view["waiting"].as_f64()) {
            // The queue only shrinks here: keel's value lies between the engine's two readings.
            assert!(
                after <= keel && keel <= before,
                "engine {before} then {after}, keel {keel}: {view}"
            );
            compared += 1;
            highest = highest.max(keel);
        }
        if before == 0.0 && load.iter().all(|t| t.is_finished()) {
            break;
        }
    }
    for t in load {
        assert_eq!(t.await.unwrap().status, 200);
    }
    assert!(highest >= 4.0, "keel saw the queue: at most {highest}");
    assert!(compared >= 5, "{compared} comparisons");
    let view = engine_view(admin, 0).await;
    assert_eq!(view["running"].as_f64(), Some(0.0), "{view}");
    assert_eq!(
        (view["malformed"].as_u64(), view["stale"].as_u64()),
        (Some(0), Some(0)),
        "{view}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A `/metrics` that answers after `delay_ms` (read at each request) with a queue of 7.
async fn slow_metrics(delay_ms: Arc<AtomicU64>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let delay_ms = delay_ms.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                    let delay = Duration::from_millis(delay_ms.load(Relaxed));
                    async move {
                        tokio::time::sleep(delay).await;
                        let text = "vllm:num_requests_waiting{engine=\"0\"} 7.0\nvllm:num_requests_running{engine=\"0\"} 2.0\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n";
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                            text.as_bytes(),
                        ))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_scrape_changes_nothing_and_is_counted() {
    // Later than max_age (100 ms), within the scrape's time limit (2 x max_age + interval).
    let delay = Arc::new(AtomicU64::new(180));
    let server = slow_metrics(delay.clone()).await;
    let config = simple_config(
        &[server],
        "least-request",
        "[cluster.engine_signals]\nsource = \"metrics\"\ninterval = \"50ms\"\nmax_age = \"100ms\"\n",
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let admin = proxy.admin_addr().unwrap();
    // Answers 180 ms late, older than max_age when they arrive.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let view = engine_view(admin, 0).await;
    assert!(view["stale"].as_u64().unwrap() >= 2, "{view}");
    assert_eq!(view["reports"], 0, "{view}");
    assert!(view["waiting"].is_null(), "{view}");
    // On time again: taken.
    delay.store(0, Relaxed);
    let mut view = engine_view(admin, 0).await;
    let until = Instant::now() + Duration::from_secs(2);
    while view["waiting"].is_null() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        view = engine_view(admin, 0).await;
    }
    assert_eq!(
        (
            view["waiting"].as_f64(),
            view["running"].as_f64(),
            view["kv_cache_usage"].as_f64()
        ),
        (Some(7.0), Some(2.0), Some(0.25)),
        "{view}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A queue that keel did not build (eight requests sent straight to engine A, as another proxy
/// of a fleet would) moves least-request's picks to engine B once keel reads the engines'
/// signals; without `[cluster.engine_signals]` keel sees only its own requests and sends A some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_counts_the_queue_an_engine_reports() {
    for reads in [true, false] {
        let (a, b) = (one_at_a_time().await, one_at_a_time().await);
        let extra = if reads {
            "[cluster.engine_signals]\nsource = \"metrics\"\ninterval = \"20ms\"\nmax_age = \"1s\"\n"
        } else {
            ""
        };
        let config = simple_config(&[a.addr(), b.addr()], "least-request", extra);
        let proxy = keel_proxy::start(config).await.unwrap();
        let listen = proxy.listener_addrs()[0];
        let admin = proxy.admin_addr().unwrap();
        let direct = format!("http://{}/v1/completions", a.addr());
        let mut load = Vec::new();
        for _ in 0..8 {
            let url = direct.clone();
            load.push(tokio::spawn(async move {
                send(&client(), Method::POST, &url, &[], completion(20, false))
                    .await
                    .unwrap()
            }));
        }
        let until = Instant::now() + Duration::from_secs(3);
        while engine_waiting(a.addr()).await < 5.0 {
            assert!(Instant::now() < until, "engine A's queue never grew");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if reads {
            let until = Instant::now() + Duration::from_secs(3);
            while engine_view(admin, 0).await["waiting"]
                .as_f64()
                .unwrap_or(0.0)
                < 4.0
            {
                assert!(Instant::now() < until, "keel never read A's queue");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // Four requests through keel at once.
        let url = format!("http://{listen}/v1/completions");
        let mut through = Vec::new();
        for _ in 0..4 {
            let url = url.clone();
            through.push(tokio::spawn(async move {
                send(&client(), Method::POST, &url, &[], completion(5, false))
                    .await
                    .unwrap()
            }));
        }
        let mut on_a = 0;
        for t in through {
            let r = t.await.unwrap();
            assert_eq!(r.status, 200);
            on_a += usize::from(r.header("x-keel-endpoint") == Some(&*a.addr().to_string()));
        }
        if reads {
            assert_eq!(on_a, 0, "a queue of 5 or more on A: all four to B");
        } else {
            // keel's own count alone: A is as idle as B for the first pick (and holds the
            // requests it takes, stuck behind its queue, while B's finish).
            assert!(
                on_a >= 1,
                "without the signal A takes its turn: {on_a} of 4"
            );
        }
        for t in load {
            assert_eq!(t.await.unwrap().status, 200);
        }
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}
