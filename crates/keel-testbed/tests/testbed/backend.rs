//! The experiment backend over real loopback sockets: each fault behaves as documented.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use keel_model::vocab::{FailureMode, Latency, LatencyDist};
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::loadgen::{self, LoadSpec, Target};
use tokio::net::TcpStream;

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn connect(addr: SocketAddr) -> std::io::Result<SendRequest<Empty<Bytes>>> {
    let stream = TcpStream::connect(addr).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(conn);
    Ok(sender)
}

/// A GET on `sender`: (status, x-backend, body) or the error text, bounded by `timeout`.
async fn get(
    sender: &mut SendRequest<Empty<Bytes>>,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String, Bytes), String> {
    let fut = async {
        sender
            .ready()
            .await
            .map_err(|e| format!("not ready: {e}"))?;
        let req = Request::get(path)
            .header("host", "test")
            .body(Empty::new())
            .unwrap();
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = resp.status().as_u16();
        let name = resp
            .headers()
            .get("x-backend")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok((status, name, body))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| "timeout".to_string())?
}

/// One GET on a fresh connection.
async fn get_once(addr: SocketAddr, path: &str) -> Result<(u16, String, Bytes), String> {
    let mut s = connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    get(&mut s, path, Duration::from_secs(2)).await
}

#[tokio::test]
async fn answers_with_body_name_and_counts_requests_apart_from_healthz() {
    let cfg = BackendConfig {
        body_bytes: 1000,
        name: "b1".into(),
        ..Default::default()
    };
    let b = backend::spawn(any_port(), cfg).await.unwrap();
    let mut s = connect(b.addr()).await.unwrap();
    for _ in 0..5 {
        // Kept alive: all five on one connection.
        let (status, name, body) = get(&mut s, "/any/path", Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!((status, name.as_str(), body.len()), (200, "b1", 1000));
    }
    let (status, _, body) = get(&mut s, "/healthz", Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!((status, &body[..]), (200, &b"ok\n"[..]));
    assert_eq!(b.requests(), 5);
    assert_eq!(b.healthz_requests(), 1);

    // Without a name, the header is the bound address.
    let b2 = backend::spawn(any_port(), BackendConfig::default())
        .await
        .unwrap();
    let (_, name, body) = get_once(b2.addr(), "/").await.unwrap();
    assert_eq!(name, b2.addr().to_string());
    assert_eq!(body.len(), BackendConfig::default().body_bytes);
    b.shutdown().await;
    b2.shutdown().await;
}

#[tokio::test]
async fn invalid_configs_are_refused() {
    for cfg in [
        BackendConfig {
            fault: FailureMode::Error { probability: 1.5 },
            ..Default::default()
        },
        BackendConfig {
            fault: FailureMode::Slow { factor: 0.0 },
            ..Default::default()
        },
        BackendConfig {
            fault: FailureMode::Flap {
                up: Duration::ZERO,
                down: Duration::from_secs(1),
                down_fails_after: None,
            },
            ..Default::default()
        },
        BackendConfig {
            latency: Latency {
                mean: Duration::from_millis(1),
                dist: LatencyDist::LogNormal { sigma: -1.0 },
            },
            ..Default::default()
        },
        BackendConfig {
            name: "bad\nname".into(),
            ..Default::default()
        },
    ] {
        let err = backend::spawn(any_port(), cfg.clone()).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{cfg:?}");
    }
}

#[tokio::test]
async fn refuse_closes_the_port_and_connections_then_rebinds_the_same_port() {
    let b = backend::spawn(any_port(), BackendConfig::default())
        .await
        .unwrap();
    let addr = b.addr();
    let mut kept = connect(addr).await.unwrap();
    assert_eq!(
        get(&mut kept, "/", Duration::from_secs(2)).await.unwrap().0,
        200
    );

    b.apply_fault(FailureMode::Refuse).await.unwrap();
    let err = TcpStream::connect(addr).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    // The kept-alive connection died with the "process" too.
    assert!(get(&mut kept, "/", Duration::from_secs(2)).await.is_err());

    b.apply_fault(FailureMode::None).await.unwrap();
    assert_eq!(b.addr(), addr);
    assert_eq!(get_once(addr, "/").await.unwrap().0, 200);
    b.shutdown().await;
    // Shut down: refused as well.
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn a_backend_can_start_refusing() {
    let b = backend::spawn(
        any_port(),
        BackendConfig {
            fault: FailureMode::Refuse,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let err = TcpStream::connect(b.addr()).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    b.apply_fault(FailureMode::None).await.unwrap();
    assert_eq!(get_once(b.addr(), "/").await.unwrap().0, 200);
}

#[tokio::test]
async fn hang_holds_the_call_past_the_client_timeout_until_the_fault_changes() {
    let b = backend::spawn(
        any_port(),
        BackendConfig {
            fault: FailureMode::Hang,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut s = connect(b.addr()).await.unwrap();
    let t = Instant::now();
    let r = get(&mut s, "/", Duration::from_millis(200)).await;
    assert_eq!(r.unwrap_err(), "timeout");
    assert!(t.elapsed() >= Duration::from_millis(200));
    assert_eq!(b.requests(), 1, "the request was received, not answered");
    assert_eq!(b.open_connections(), 1);
    // The client gives up and closes: the backend lets the connection go.
    drop(s);
    let t = Instant::now();
    while b.open_connections() > 0 && t.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.open_connections(), 0, "a hung call outlived its client");
    // /healthz hangs as well.
    let mut s2 = connect(b.addr()).await.unwrap();
    let hung = tokio::spawn(async move { get(&mut s2, "/healthz", Duration::from_secs(5)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!hung.is_finished());
    // Changing the fault closes the hung connection without an answer.
    b.set_fault(FailureMode::None);
    let r = hung.await.unwrap();
    assert!(r.is_err() && r.unwrap_err() != "timeout");
    assert_eq!(get_once(b.addr(), "/").await.unwrap().0, 200);
}

#[tokio::test]
async fn fail_fast_answers_503_and_server_error_500_without_the_latency() {
    let b = backend::spawn(
        any_port(),
        BackendConfig {
            latency: Latency::fixed(Duration::from_millis(300)),
            fault: FailureMode::FAIL_AT_ONCE,
            name: "e".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let t = Instant::now();
    let (status, name, body) = get_once(b.addr(), "/x").await.unwrap();
    assert_eq!((status, name.as_str()), (503, "e"));
    assert!(String::from_utf8_lossy(&body).contains("fail-fast"));
    assert_eq!(get_once(b.addr(), "/healthz").await.unwrap().0, 503);
    // At once: the 300 ms latency does not apply.
    assert!(
        t.elapsed() < Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    // After a delay: the delay, not the latency.
    b.set_fault(FailureMode::FailFast {
        after: Duration::from_millis(120),
    });
    let t = Instant::now();
    assert_eq!(get_once(b.addr(), "/x").await.unwrap().0, 503);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(120) && took < Duration::from_millis(290),
        "{took:?}"
    );
    // The server error: a 500, at once too.
    b.set_fault(FailureMode::SERVER_ERROR_AT_ONCE);
    let t = Instant::now();
    let (status, _, body) = get_once(b.addr(), "/x").await.unwrap();
    assert_eq!(status, 500);
    assert!(String::from_utf8_lossy(&body).contains("server-error"));
    assert!(
        t.elapsed() < Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn reset_sends_headers_and_part_of_the_body_then_resets() {
    let b = backend::spawn(
        any_port(),
        BackendConfig {
            fault: FailureMode::Reset,
            body_bytes: 4096,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut s = connect(b.addr()).await.unwrap();
    s.ready().await.unwrap();
    let req = Request::get("/")
        .header("host", "t")
        .body(Empty::new())
        .unwrap();
    let resp = s.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-length"], "4096");
    let mut body = resp.into_body();
    let mut got = 0;
    let err = loop {
        match body.frame().await {
            Some(Ok(f)) => got += f.into_data().map(|d| d.len()).unwrap_or(0),
            Some(Err(e)) => break e,
            None => panic!("the body ended cleanly after {got} bytes"),
        }
    };
    assert!(got < 4096, "got {got} bytes");
    // A reset (or an incomplete message if the RST raced the read): never a clean end.
    let text = format!("{err:?}");
    assert!(
        text.contains("Reset") || text.contains("reset") || err.is_incomplete_message(),
        "{text}"
    );

    // Through the load generator: every call is a transport error, none a response.
    let report = loadgen::run(LoadSpec {
        target: Target::Url(format!("http://{}/", b.addr())),
        requests: 20,
        concurrency: 4,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    })
    .await;
    assert_eq!(report.transport_errors, 20, "{report}");
    assert_eq!(report.timeouts, 0);
    assert!(report.by_status.is_empty());
}

#[tokio::test]
async fn slow_multiplies_the_latency() {
    let b = backend::spawn(
        any_port(),
        BackendConfig {
            latency: Latency::fixed(Duration::from_millis(10)),
            fault: FailureMode::Slow { factor: 8.0 },
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let spec = |requests| LoadSpec {
        target: Target::Url(format!("http://{}/", b.addr())),
        requests,
        concurrency: 4,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    };
    let slow = loadgen::run(spec(12)).await;
    assert_eq!(slow.succeeded, 12, "{slow}");
    // 80 ms; timers may add a millisecond or two, a busy machine more.
    assert!(slow.latency_p50 >= Duration::from_millis(80), "{slow}");
    assert!(slow.latency_p50 < Duration::from_millis(140), "{slow}");
    b.set_fault(FailureMode::None);
    let normal = loadgen::run(spec(12)).await;
    assert!(normal.latency_p50 >= Duration::from_millis(10), "{normal}");
    assert!(normal.latency_p50 < Duration::from_millis(60), "{normal}");
}

#[tokio::test]
async fn exponential_latency_spreads_around_its_mean() {
    let b = backend::spawn_with_seed(
        any_port(),
        BackendConfig {
            latency: Latency {
                mean: Duration::from_millis(10),
                dist: LatencyDist::Exponential,
            },
            ..Default::default()
        },
        3,
    )
    .await
    .unwrap();
    let r = loadgen::run(LoadSpec {
        target: Target::Url(format!("http://{}/", b.addr())),
        requests: 400,
        concurrency: 32,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    })
    .await;
    // Exponential with mean 10 ms: median 6.9 ms, p99 46 ms, 39 ms apart; a fixed 10 ms would
    // have p99 = p50. A busy machine adds delay to both (which spoils a ratio, not the
    // distance), so compare the distance, loosely.
    assert!(r.latency_p99 > Duration::from_millis(30), "{r}");
    assert!(
        r.latency_p99.saturating_sub(r.latency_p50) > Duration::from_millis(20),
        "{r}"
    );
}

#[tokio::test]
async fn flap_alternates_up_and_down_periods() {
    let b = backend::spawn(any_port(), BackendConfig::default())
        .await
        .unwrap();
    let mut s = connect(b.addr()).await.unwrap();
    let (up, down) = (Duration::from_millis(150), Duration::from_millis(100));
    b.set_fault(FailureMode::Flap {
        up,
        down,
        down_fails_after: Some(Duration::ZERO),
    });
    let t0 = Instant::now();
    let period = (up + down).as_millis();
    let (mut ups, mut downs) = (0, 0);
    while t0.elapsed() < Duration::from_millis(750) {
        let sent = t0.elapsed().as_millis();
        let (status, _, _) = get(&mut s, "/", Duration::from_secs(1)).await.unwrap();
        let phase = sent % period;
        // Skip samples within 20 ms of a phase boundary (the clocks of the test and the backend
        // start a moment apart).
        let near = |edge: u128| phase.abs_diff(edge) < 20;
        if !(near(0) || near(up.as_millis()) || near(period)) {
            let expect = if phase < up.as_millis() { 200 } else { 503 };
            assert_eq!(status, expect, "at {sent} ms (phase {phase} ms)");
            if status == 200 {
                ups += 1;
            } else {
                downs += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ups >= 10 && downs >= 5, "ups {ups} downs {downs}");
}

#[tokio::test]
async fn flap_hangs_while_down_unless_told_to_fail() {
    let b = backend::spawn(any_port(), BackendConfig::default())
        .await
        .unwrap();
    b.set_fault(FailureMode::Flap {
        up: Duration::from_millis(50),
        down: Duration::from_secs(30),
        down_fails_after: None,
    });
    tokio::time::sleep(Duration::from_millis(80)).await;
    let mut s = connect(b.addr()).await.unwrap();
    let r = get(&mut s, "/", Duration::from_millis(200)).await;
    assert_eq!(r.unwrap_err(), "timeout");
    assert_eq!(b.requests(), 1, "received, not answered");
    b.set_fault(FailureMode::None);
    assert_eq!(get_once(b.addr(), "/").await.unwrap().0, 200);
}

#[tokio::test]
async fn error_gives_that_share_of_503_and_is_repeatable_with_a_seed() {
    let cfg = BackendConfig {
        fault: FailureMode::Error { probability: 0.2 },
        ..Default::default()
    };
    let mut counts = Vec::new();
    for _ in 0..2 {
        let b = backend::spawn_with_seed(any_port(), cfg.clone(), 11)
            .await
            .unwrap();
        let r = loadgen::run(LoadSpec {
            target: Target::Url(format!("http://{}/", b.addr())),
            requests: 2000,
            concurrency: 16,
            timeout: Duration::from_secs(2),
            calls_per_request: 1,
        })
        .await;
        assert_eq!(r.requests, 2000);
        assert_eq!(r.by_status.values().sum::<u64>(), 2000, "{r}");
        counts.push(r.by_status.get(&503).copied().unwrap_or(0));
    }
    // Binomial(2000, 0.2): mean 400, sd 17.9; 5 sd = 89.
    assert!((311..=489).contains(&counts[0]), "{counts:?}");
    // Same seed, same count, whatever the arrival order of the 16 connections.
    assert_eq!(counts[0], counts[1]);
}
