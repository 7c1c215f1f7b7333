//! The backend's capacity (`concurrency`: at most N worked on at once, the rest in FIFO order)
//! and its load reports (`x-keel-rif`, `x-keel-latency-us` on every answer and at
//! `GET /keel/load`), over real loopback sockets.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use keel_balance::{LoadReport, LATENCY_HEADER, LOAD_PATH, RIF_HEADER};
use keel_model::vocab::{FailureMode, Latency};
use keel_testbed::backend::{self, BackendConfig, BackendHandle};
use tokio::net::TcpStream;

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn connect(addr: SocketAddr) -> SendRequest<Empty<Bytes>> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// One answer: status, the load it reports, its body, when it was complete.
struct Answer {
    status: u16,
    load: LoadReport,
    body: Bytes,
    at: Instant,
}

async fn get(sender: &mut SendRequest<Empty<Bytes>>, path: &str) -> Answer {
    sender.ready().await.unwrap();
    let req = Request::get(path)
        .header("host", "test")
        .body(Empty::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let h = resp.headers();
    let load = LoadReport::from_headers(
        h.get(RIF_HEADER).map(|v| v.as_bytes()),
        h.get(LATENCY_HEADER).map(|v| v.as_bytes()),
    )
    .expect("every answer reports the load");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        load,
        body,
        at: Instant::now(),
    }
}

/// Waits (at most 5 s) until the backend has received `n` requests.
async fn received(b: &BackendHandle, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.requests() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} requests",
            b.requests()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn one_at_a_time_in_arrival_order_reporting_requests_in_flight() {
    const SERVICE: Duration = Duration::from_millis(150);
    let cfg = BackendConfig {
        latency: Latency::fixed(SERVICE),
        concurrency: Some(1),
        ..Default::default()
    };
    let b = backend::spawn(any_port(), cfg).await.unwrap();
    let start = Instant::now();
    let mut calls = Vec::new();
    for i in 0..3 {
        let mut s = connect(b.addr()).await;
        calls.push(tokio::spawn(async move { get(&mut s, "/work").await }));
        // The next one leaves once this one is in: arrival order is known.
        received(&b, i + 1).await;
    }
    // All three in flight (one worked on, two waiting); a load probe is answered at once and
    // is not one of them.
    let mut probe = connect(b.addr()).await;
    let p = get(&mut probe, LOAD_PATH).await;
    assert_eq!(p.status, 200);
    assert_eq!(p.load.in_flight, 3);
    let text = std::str::from_utf8(&p.body).unwrap();
    assert!(
        text.starts_with("{\"in_flight\":3,\"latency_us\":"),
        "{text}"
    );
    assert!(p.at < start + SERVICE, "answered before the first request");
    assert_eq!((b.requests(), b.load_probes()), (3, 1));

    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await.unwrap());
    }
    for (k, a) in answers.iter().enumerate() {
        assert_eq!(a.status, 200);
        // FIFO, one at a time: the k-th is done no sooner than k + 1 service times.
        assert!(
            a.at >= start + SERVICE * (k as u32 + 1),
            "answer {k} after {:?}",
            a.at - start
        );
        // Reported after it left: those still behind it.
        assert_eq!(a.load.in_flight, 2 - k as u32, "answer {k}");
    }
    assert!(answers[0].at < answers[1].at && answers[1].at < answers[2].at);
    // The estimate is learned by in-flight band: the first answer (2 left, band 2-3) has only
    // the first request's 150 ms to go by; the second (1 left) its own, queueing included.
    assert!(answers[0].load.latency >= SERVICE);
    assert!(answers[1].load.latency >= SERVICE * 2 - Duration::from_millis(50));
    assert_eq!(b.load_report().in_flight, 0);
    b.shutdown().await;
}

#[tokio::test]
async fn a_fast_failing_backend_reports_little_load_and_a_hanging_one_no_load() {
    let cfg = BackendConfig {
        latency: Latency::fixed(Duration::from_millis(20)),
        fault: FailureMode::FAIL_AT_ONCE,
        concurrency: Some(1),
        ..Default::default()
    };
    let b = backend::spawn(any_port(), cfg).await.unwrap();
    let mut s = connect(b.addr()).await;
    for _ in 0..3 {
        let a = get(&mut s, "/").await;
        // Errors report their load too: nothing in flight, answered at once (the black hole's
        // bait, which a balancer on reports must see through).
        assert_eq!(a.status, 503);
        assert_eq!(a.load.in_flight, 0);
        assert!(a.load.latency < Duration::from_millis(20), "{:?}", a.load);
    }
    let p = get(&mut s, LOAD_PATH).await;
    assert_eq!((p.status, p.load.in_flight), (200, 0));
    assert_eq!((b.requests(), b.load_probes()), (3, 1));

    b.apply_fault(FailureMode::Hang).await.unwrap();
    let mut s = connect(b.addr()).await;
    let probe = tokio::time::timeout(Duration::from_millis(300), get(&mut s, LOAD_PATH)).await;
    assert!(probe.is_err(), "a hanging backend answers no probe");
    b.shutdown().await;
}

#[tokio::test]
async fn a_waiting_request_whose_client_left_is_no_longer_in_flight() {
    let cfg = BackendConfig {
        latency: Latency::fixed(Duration::from_millis(400)),
        concurrency: Some(1),
        ..Default::default()
    };
    let b = backend::spawn(any_port(), cfg).await.unwrap();
    let mut first = connect(b.addr()).await;
    let worked = tokio::spawn(async move { get(&mut first, "/").await });
    received(&b, 1).await;
    // Its connection lives in its task: aborting the task closes it.
    let addr = b.addr();
    let waiting = tokio::spawn(async move {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::select! {
            _ = conn => None,
            a = get(&mut sender, "/") => Some(a),
        }
    });
    received(&b, 2).await;
    assert_eq!(b.load_report().in_flight, 2);
    // The waiting one's client goes away (its connection closes).
    waiting.abort();
    let _ = waiting.await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while b.load_report().in_flight != 1 {
        assert!(Instant::now() < deadline, "{:?}", b.load_report());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let a = worked.await.unwrap();
    assert_eq!((a.status, a.load.in_flight), (200, 0));
    b.shutdown().await;
}

/// The service time an answer says its work took.
async fn served_ms(sender: &mut SendRequest<Empty<Bytes>>) -> f64 {
    sender.ready().await.unwrap();
    let req = Request::get("/work")
        .header("host", "test")
        .body(Empty::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let us: f64 = resp.headers()[keel_testbed::backend::SERVICE_HEADER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    resp.into_body().collect().await.unwrap();
    us / 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_down_applies_to_work_that_starts_after_it_and_the_precise_timer_serves_what_was_asked(
) {
    // One slot, fixed 40 ms, the precise timer. A is worked on, B waits; the backend is made
    // 3x slower (from a switch held apart from the handle) while B waits: B's work starts
    // after the step and takes 120 ms, A keeps its 40 ms (as a simulated FIFO server applies
    // the factor in force when a call's service starts).
    const SERVICE: Duration = Duration::from_millis(40);
    let cfg = BackendConfig {
        latency: Latency::fixed(SERVICE),
        concurrency: Some(1),
        precise_timer: true,
        ..Default::default()
    };
    let b = backend::spawn(any_port(), cfg).await.unwrap();
    let switch = b.fault_switch();
    let mut sa = connect(b.addr()).await;
    let a = tokio::spawn(async move { served_ms(&mut sa).await });
    received(&b, 1).await;
    let mut sb = connect(b.addr()).await;
    let bb = tokio::spawn(async move { served_ms(&mut sb).await });
    received(&b, 2).await;
    switch.set(FailureMode::Slow { factor: 3.0 });
    let (a, bb) = (a.await.unwrap(), bb.await.unwrap());
    assert_eq!(b.fault(), FailureMode::Slow { factor: 3.0 });
    // Not early; late by the timer's tens of microseconds, up to a loaded machine's stall.
    assert!((40.0..55.0).contains(&a), "A served {a} ms");
    assert!((120.0..135.0).contains(&bb), "B served {bb} ms");
    switch.set(FailureMode::None);
    let mut s = connect(b.addr()).await;
    let c = served_ms(&mut s).await;
    assert!((40.0..55.0).contains(&c), "back to normal: {c} ms");
    b.shutdown().await;
}
