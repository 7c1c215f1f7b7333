//! What services speak, through keel on loopback: WebSocket upgrades become tunnels, TCP
//! listeners tunnel bytes to one endpoint per connection (another one when a connect is
//! refused), and h2c endpoints receive keel's requests as HTTP/2, trailers both ways.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{HeaderMap, Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;

use crate::support::*;

/// A WebSocket server that echoes every message, counting the connections it accepted.
pub(crate) async fn websocket_echo() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// A `/metrics` gauge's value for cluster `app`.
async fn gauge(admin: SocketAddr, name: &str) -> i64 {
    let text = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    let prefix = format!("{name}{{cluster=\"app\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_websocket_echo_works_through_keel_as_a_tunnel() {
    let (ws, _) = websocket_echo().await;
    let proxy = keel_proxy::start(simple_config(&[ws], "least-connections", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let stream = TcpStream::connect(proxy.listener_addrs()[0]).await.unwrap();
    let url = format!("ws://{}/chat", proxy.listener_addrs()[0]);
    let (mut client, response) = tokio_tungstenite::client_async(url, stream).await.unwrap();
    assert_eq!(response.status(), 101);
    assert_eq!(
        response.headers()["x-keel-endpoint"].to_str().unwrap(),
        ws.to_string()
    );
    for i in 0..20 {
        let text = format!("message {i}");
        client.send(Message::text(text.clone())).await.unwrap();
        let echoed = client.next().await.unwrap().unwrap();
        assert_eq!(echoed.into_text().unwrap().as_str(), text);
    }
    client
        .send(Message::binary(vec![0u8, 1, 2, 255]))
        .await
        .unwrap();
    assert_eq!(
        client.next().await.unwrap().unwrap().into_data(),
        vec![0u8, 1, 2, 255]
    );
    // While the tunnel is open it is counted, and its pick is held (least-connections sees
    // one connection on the endpoint).
    assert_eq!(gauge(admin, "keel_tunnels_open").await, 1);
    assert_eq!(proxy.cluster_status("app").unwrap()[0].in_flight, 1);
    client.close(None).await.unwrap();
    drop(client);
    let closed = eventually(Duration::from_secs(3), || {
        proxy.cluster_status("app").unwrap()[0].in_flight == 0
    })
    .await;
    assert!(closed, "the pick is finished when the tunnel ends");
    assert_eq!(gauge(admin, "keel_tunnels_open").await, 0);
    let status = &proxy.cluster_status("app").unwrap()[0];
    assert_eq!(status.failures, 0, "{status:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn an_upgrade_refused_by_the_endpoint_is_an_ordinary_response() {
    // The echo server is plain HTTP/1.1: it ignores Upgrade and answers 200, which keel
    // forwards as a response on a connection that stays HTTP.
    let (echo, _task) = echo_server().await;
    let proxy = keel_proxy::start(simple_config(&[echo], "round-robin", ""))
        .await
        .unwrap();
    let mut s = TcpStream::connect(proxy.listener_addrs()[0]).await.unwrap();
    s.write_all(
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("x-forwarded-proto") {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got).to_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    // Both headers reached the endpoint.
    assert!(text.contains("\nconnection: upgrade\n"), "{text}");
    assert!(text.contains("\nupgrade: websocket\n"), "{text}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A TCP echo server.
pub(crate) async fn tcp_echo() -> SocketAddr {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// A port nobody listens on.
fn refusing() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

fn tcp_config(endpoints: &[SocketAddr], strategy: &str, extra: &str) -> keel_proxy::ProxyConfig {
    // A listener as users write it, verbatim but for the port.
    let eps: Vec<String> = endpoints
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\nprotocol = \"tcp\"       # default \"http\"\ncluster = \"db\"\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"db\"\nstrategy = \"{strategy}\"\nendpoints = [{}]\n{extra}\n",
        eps.join(", ")
    );
    keel_proxy::ProxyConfig::from_toml_str(&text, "tcp.toml").unwrap_or_else(|e| panic!("{e}"))
}

async fn echo_through(addr: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(payload).await.unwrap();
    s.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut back))
        .await
        .expect("echo within 5 s")
        .unwrap();
    back
}

#[tokio::test]
async fn tcp_echo_with_one_endpoint_refusing_serves_every_connection() {
    let endpoints = [tcp_echo().await, refusing(), tcp_echo().await];
    let proxy = keel_proxy::start(tcp_config(
        &endpoints,
        "round-robin",
        // Retries alone: outlier detection would eject the refusing endpoint after 5.
        "outlier_detection = false\n[cluster.retry]\nattempts = 2\n",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    for i in 0..30 {
        let payload = format!("connection {i}: {}", "x".repeat(i * 1000));
        assert_eq!(
            echo_through(addr, payload.as_bytes()).await,
            payload.as_bytes()
        );
    }
    let status = proxy.cluster_status("db").unwrap();
    // Connections first sent to the refusing endpoint (every other one: a retry's pick moves
    // round-robin on too) failed to connect there and went to another endpoint; every
    // connection ended as a success on a working one.
    assert!(status[1].failures >= 10, "{status:?}");
    assert_eq!(status[1].successes, 0, "{status:?}");
    assert_eq!(status[0].successes + status[2].successes, 30, "{status:?}");
    assert_eq!(status[0].failures + status[2].failures, 0, "{status:?}");
    assert!(status.iter().all(|s| s.in_flight == 0), "{status:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn tcp_least_connections_counts_open_connections_and_proxy_protocol_v2_is_sent() {
    // A server that reads the PROXY v2 header, reports the client port it names, then echoes.
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let first = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = [0u8; 28];
                s.read_exact(&mut head).await.unwrap();
                assert_eq!(&head[..12], b"\r\n\r\n\0\r\nQUIT\n");
                let port = u16::from_be_bytes([head[24], head[25]]);
                s.write_all(format!("{port}\n").as_bytes()).await.unwrap();
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let second = {
        let l = TcpListener::bind(any_port()).await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut head = [0u8; 28];
                    s.read_exact(&mut head).await.unwrap();
                    let port = u16::from_be_bytes([head[24], head[25]]);
                    s.write_all(format!("{port}\n").as_bytes()).await.unwrap();
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        a
    };
    let proxy = keel_proxy::start(tcp_config(
        &[first, second],
        "least-connections",
        "tie_break = \"lowest-index\"\nproxy_protocol = \"v2\"\n",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    // Four held connections: least-connections spreads them 2/2 by open connections.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while b[0] != b'\n' {
            s.read_exact(&mut b).await.unwrap();
            line.push(b[0]);
        }
        let port: u16 = String::from_utf8_lossy(&line).trim().parse().unwrap();
        assert_eq!(
            port,
            s.local_addr().unwrap().port(),
            "PROXY v2 names the client"
        );
        held.push(s);
    }
    let status = proxy.cluster_status("db").unwrap();
    assert_eq!(
        (status[0].in_flight, status[1].in_flight),
        (2, 2),
        "{status:?}"
    );
    let admin = proxy.admin_addr().unwrap();
    let text = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    assert!(
        text.contains("keel_tunnels_open{cluster=\"db\"} 4"),
        "{text}"
    );
    drop(held);
    let closed = eventually(Duration::from_secs(3), || {
        proxy
            .cluster_status("db")
            .unwrap()
            .iter()
            .all(|s| s.in_flight == 0)
    })
    .await;
    assert!(closed);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn tcp_health_checks_connect_only() {
    let up = tcp_echo().await;
    let down = refusing();
    let proxy = keel_proxy::start(tcp_config(
        &[up, down],
        "round-robin",
        "[cluster.health_check]\nkind = \"tcp\"\ninterval = \"50ms\"\nunhealthy_threshold = 1\nhealthy_threshold = 1\n",
    ))
    .await
    .unwrap();
    let marked = eventually(Duration::from_secs(3), || {
        let s = proxy.cluster_status("db").unwrap();
        s[0].healthy && !s[1].healthy
    })
    .await;
    assert!(marked, "{:?}", proxy.cluster_status("db"));
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// An h2c server (HTTP/2 with prior knowledge) that answers with the version and authority it
/// saw and the request's trailers, and sends trailers of its own. It allows `max_streams`
/// concurrent streams per connection and counts connections.
async fn h2c_server(max_streams: u32) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let count = conns.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: Request<hyper::body::Incoming>| async move {
                        let version = format!("{:?}", req.version());
                        let authority = req
                            .uri()
                            .authority()
                            .map(|a| a.to_string())
                            .unwrap_or_default();
                        let delay = req.headers().contains_key("x-slow");
                        let collected = req.into_body().collect().await.unwrap();
                        let request_trailer = collected
                            .trailers()
                            .and_then(|t| t.get("x-request-trailer"))
                            .map(|v| v.to_str().unwrap().to_string())
                            .unwrap_or_default();
                        let body_len = collected.to_bytes().len();
                        if delay {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        let text = format!(
                        "version: {version}\nauthority: {authority}\nbody: {body_len}\nrequest-trailer: {request_trailer}\n"
                    );
                        let mut trailers = HeaderMap::new();
                        trailers.insert("x-response-trailer", "done".parse().unwrap());
                        let frames = vec![
                            Ok::<_, Infallible>(Frame::data(Bytes::from(text))),
                            Ok(Frame::trailers(trailers)),
                        ];
                        let body = StreamBody::new(futures_util::stream::iter(frames));
                        Ok::<_, Infallible>(Response::new(body))
                    },
                );
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(max_streams)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, conns)
}

type AnyBody = BoxBody<Bytes, Infallible>;

/// `n` GETs of `url` sent at once on `client`, each slowed by the endpoint (`x-slow`), read
/// whole within 10 s: each one's status and `x-keel-endpoint`.
async fn slow_gets_at_once(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, AnyBody>,
    url: &str,
    n: usize,
) -> Vec<(hyper::StatusCode, String)> {
    let calls = (0..n).map(|_| async move {
        let req = Request::get(url)
            .header("x-slow", "1")
            .body(BodyExt::boxed(Full::new(Bytes::new())))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        let endpoint = resp
            .headers()
            .get("x-keel-endpoint")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let status = resp.status();
        resp.into_body().collect().await.unwrap();
        (status, endpoint)
    });
    tokio::time::timeout(
        Duration::from_secs(10),
        futures_util::future::join_all(calls),
    )
    .await
    .unwrap()
}

fn h2_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, AnyBody> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

#[tokio::test]
async fn an_h2c_endpoint_receives_keels_requests_as_http2_with_trailers_both_ways() {
    let (h2c, _) = h2c_server(100).await;
    let proxy = keel_proxy::start(simple_config(&[h2c], "round-robin", "protocol = \"h2c\"\n"))
        .await
        .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    // From an HTTP/1.1 client: the endpoint sees HTTP/2; its trailers end the chunked body.
    let got = get(&url).await.unwrap();
    assert_eq!(got.status, 200);
    assert!(got.text().contains("version: HTTP/2.0\n"), "{}", got.text());
    assert!(
        got.text()
            .contains(&format!("authority: {}", proxy.listener_addrs()[0])),
        "{}",
        got.text()
    );
    assert_eq!(
        got.header("x-keel-endpoint"),
        Some(h2c.to_string().as_str())
    );
    // From an HTTP/2 client, with a streamed body and trailers: both reach the other side.
    let client = h2_client();
    let mut trailers = HeaderMap::new();
    trailers.insert("x-request-trailer", "sent".parse().unwrap());
    let frames = vec![
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"hello "))),
        Ok(Frame::data(Bytes::from_static(b"world"))),
        Ok(Frame::trailers(trailers)),
    ];
    let req = Request::post(&url)
        .body(BodyExt::boxed(StreamBody::new(futures_util::stream::iter(
            frames,
        ))))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.version(), hyper::Version::HTTP_2);
    let collected = resp.into_body().collect().await.unwrap();
    let response_trailer = collected
        .trailers()
        .and_then(|t| t.get("x-response-trailer"))
        .cloned();
    let text = String::from_utf8(collected.to_bytes().to_vec()).unwrap();
    assert!(text.contains("version: HTTP/2.0\n"), "{text}");
    assert!(text.contains("body: 11\n"), "{text}");
    assert!(text.contains("request-trailer: sent\n"), "{text}");
    assert_eq!(response_trailer.unwrap(), "done");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn requests_are_balanced_per_request_over_multiplexed_connections() {
    // Two h2c endpoints, each allowing 2 concurrent streams per connection; one HTTP/2 client
    // connection sends 12 slow requests at once: round-robin spreads them 6/6 (per request,
    // not per connection), and each endpoint gets more than one connection since 6 > 2. (A
    // request first to each: until an endpoint's SETTINGS are in, a connection is assumed to
    // take 100 streams, and the burst would wait on one connection per endpoint.)
    let (a, conns_a) = h2c_server(2).await;
    let (b, conns_b) = h2c_server(2).await;
    let proxy = keel_proxy::start(simple_config(
        &[a, b],
        "round-robin",
        "protocol = \"h2c\"\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    let client = h2_client();
    for _ in 0..2 {
        let req = Request::get(&url)
            .body(BodyExt::boxed(Full::new(Bytes::new())))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        resp.into_body().collect().await.unwrap();
    }
    let results = slow_gets_at_once(&client, &url, 12).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    let on_a = results.iter().filter(|(_, e)| *e == a.to_string()).count();
    assert_eq!(on_a, 6, "{results:?}");
    let (ca, cb) = (
        conns_a.load(Ordering::SeqCst),
        conns_b.load(Ordering::SeqCst),
    );
    assert!(
        (2..=6).contains(&ca) && (2..=6).contains(&cb),
        "connections {ca} and {cb}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// An h2c server counting the requests it answered; `status` is what it answers.
async fn counting_h2c(status: u16) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                        count.fetch_add(1, Ordering::SeqCst);
                        async move {
                            let mut r = Response::new(Full::new(Bytes::from_static(b"ok")));
                            *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                            Ok::<_, Infallible>(r)
                        }
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, served)
}

/// E7 over real sockets: 4 HTTP/2 clients (one connection each, 8 calls in flight) and 8 h2c
/// endpoints, the first answering 503. Through a TCP listener (per-connection balancing, what
/// an L4 balancer does to HTTP/2) 4 endpoints get every call and the client pinned to the
/// failing one loses all of its calls; through keel's HTTP listener (per-request balancing,
/// with a retry) every endpoint gets an even share and every call succeeds.
#[tokio::test]
async fn e7_per_connection_against_per_request_balancing_over_real_sockets() {
    let mut addrs = Vec::new();
    let mut served = Vec::new();
    for i in 0..8 {
        let (a, n) = counting_h2c(if i == 0 { 503 } else { 200 }).await;
        addrs.push(a);
        served.push(n);
    }
    let eps: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\nprotocol = \"tcp\"\ncluster = \"l4\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"l7\"\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"l4\"\nendpoints = [{0}]\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"l7\"\nprotocol = \"h2c\"\nendpoints = [{0}]\n[cluster.retry]\nattempts = 2\nmin_retries_per_second = 1000\n",
        eps.join(", ")
    );
    let config = keel_proxy::ProxyConfig::from_toml_str(&text, "e7.toml").unwrap();
    let proxy = keel_proxy::start(config).await.unwrap();
    let mut rows = Vec::new();
    for (listener, name) in [
        (0, "per-connection (TCP listener)"),
        (1, "per-request (keel)"),
    ] {
        let before: Vec<usize> = served.iter().map(|n| n.load(Ordering::SeqCst)).collect();
        let url = format!("http://{}/call", proxy.listener_addrs()[listener]);
        let clients = (0..4).map(|_| {
            let url = url.clone();
            async move {
                // One client, one connection, 8 calls in flight, 40 calls.
                let client = h2_client();
                let mut ok = 0;
                for _ in 0..5 {
                    let batch = (0..8).map(|_| {
                        let req = Request::get(&url)
                            .body(BodyExt::boxed(Full::new(Bytes::new())))
                            .unwrap();
                        client.request(req)
                    });
                    for r in futures_util::future::join_all(batch).await {
                        ok += usize::from(r.unwrap().status() == 200);
                    }
                }
                ok
            }
        });
        let ok: usize = tokio::time::timeout(
            Duration::from_secs(20),
            futures_util::future::join_all(clients),
        )
        .await
        .unwrap()
        .into_iter()
        .sum();
        let calls: Vec<usize> = served
            .iter()
            .zip(&before)
            .map(|(n, b)| n.load(Ordering::SeqCst) - b)
            .collect();
        let mean = calls.iter().sum::<usize>() as f64 / 8.0;
        let max_over_mean = *calls.iter().max().unwrap() as f64 / mean;
        println!("E7 real traffic, {name}: calls per endpoint {calls:?}, max/mean {max_over_mean:.2}, success {}/160", ok);
        rows.push((max_over_mean, ok, calls));
    }
    let (l4_max, l4_ok, l4_calls) = &rows[0];
    assert_eq!(
        l4_calls.iter().filter(|n| **n == 0).count(),
        4,
        "{l4_calls:?}"
    );
    assert!((l4_max - 2.0).abs() < 1e-9, "{l4_calls:?}");
    assert_eq!(
        *l4_ok, 120,
        "the client pinned to the failing endpoint lost its 40 calls"
    );
    let (l7_max, l7_ok, l7_calls) = &rows[1];
    assert!(*l7_max < 1.3, "{l7_calls:?}");
    assert_eq!(*l7_ok, 160, "{l7_calls:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// The frames of stream 1 that an HTTP/2 server sends a client that asks `GET /` with prior
/// knowledge, read off the wire: (type, flags, payload length), up to the frame that ends the
/// stream. A client written by hand, since a client library hides how a body's end is framed.
async fn raw_h2_get_frames(addr: SocketAddr) -> Vec<(u8, u8, usize)> {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let authority = addr.to_string();
    // HEADERS: :method GET, :scheme http, :path / (static table), :authority as a literal.
    let mut block = vec![0x82, 0x86, 0x84, 0x41, authority.len() as u8];
    block.extend_from_slice(authority.as_bytes());
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    };
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out.extend(frame(0x1, 0x4 | 0x1, 1, &block));
    tcp.write_all(&out).await.unwrap();
    let mut frames = Vec::new();
    let read = async {
        loop {
            let mut head = [0u8; 9];
            tcp.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            tcp.read_exact(&mut payload).await.unwrap();
            if kind == 0x4 && flags & 0x1 == 0 {
                tcp.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap();
            }
            if stream == 1 {
                frames.push((kind, flags, len));
                if flags & 0x1 != 0 || kind == 0x3 {
                    break;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the stream ended within 5 s");
    frames
}

/// An h2c endpoint that answers every request with `body` in one DATA frame ending the stream.
async fn h2c_fixed_body(body: &'static str) -> SocketAddr {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let svc = hyper::service::service_fn(move |_req| async move {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                    body.as_bytes(),
                ))))
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc),
            );
        }
    });
    addr
}

/// An HTTP/1.1 endpoint that answers every request with a chunked body, its chunks and last
/// chunk in one write.
async fn h1_chunked_endpoint() -> SocketAddr {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut piece = [0u8; 1024];
                while let Ok(n) = stream.read(&mut piece).await {
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&piece[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nchunk \r\n8\r\nchunked\n\r\n0\r\n\r\n";
                        if stream.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_http2_clients_response_ends_on_its_last_data_frame_not_on_an_empty_one_after_it() {
    // HTTP/1.1 endpoints (a body of a declared length; chunks whose last chunk comes with the
    // data) and an h2c endpoint (DATA with END_STREAM): either way the client gets HEADERS,
    // then data whose last frame ends the stream. An empty DATA frame after it would cost
    // every response a frame on both sides.
    let b = backends(1, Duration::ZERO).await;
    let h1 = keel_proxy::start(simple_config(&[b[0].addr()], "round-robin", ""))
        .await
        .unwrap();
    let chunked = keel_proxy::start(simple_config(
        &[h1_chunked_endpoint().await],
        "round-robin",
        "",
    ))
    .await
    .unwrap();
    let h2c = h2c_fixed_body("from an h2c endpoint\n").await;
    let h2 = keel_proxy::start(simple_config(&[h2c], "round-robin", "protocol = \"h2c\"\n"))
        .await
        .unwrap();
    for proxy in [&h1, &chunked, &h2] {
        let frames = raw_h2_get_frames(proxy.listener_addrs()[0]).await;
        let (first, rest) = frames.split_first().unwrap();
        assert_eq!(
            (first.0, first.1 & 0x1),
            (0x1, 0),
            "HEADERS first: {frames:?}"
        );
        assert!(!rest.is_empty(), "{frames:?}");
        assert!(
            rest.iter().all(|&(kind, _, len)| kind == 0x0 && len > 0),
            "only non-empty DATA frames follow the head: {frames:?}"
        );
        assert_eq!(rest.last().unwrap().1 & 0x1, 0x1, "{frames:?}");
    }
    h1.shutdown(Duration::from_secs(1)).await;
    chunked.shutdown(Duration::from_secs(1)).await;
    h2.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_burst_at_start_waits_for_one_connection_per_endpoint_instead_of_opening_one_each() {
    // 40 slow requests at once from one HTTP/2 client to a keel that has no connection to
    // its h2c endpoint yet (one worker): they share the connection the first one opens. Each
    // opening its own, as before, made 40 connections to an endpoint that takes 100 streams
    // on one (a connection storm on every start, and after every endpoint restart).
    let (h2c, conns) = h2c_server(100).await;
    let config = simple_config(&[h2c], "round-robin", "protocol = \"h2c\"\n");
    let proxy = keel_proxy::start_with_workers(config, 1).await.unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    let client = h2_client();
    let results = slow_gets_at_once(&client, &url, 40).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    assert_eq!(conns.load(Ordering::SeqCst), 1);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// An h2c endpoint that answers with what it got: the target (with its authority), the
/// `content-length` header if any, and the body's length.
async fn h2c_body_echo() -> SocketAddr {
    use hyper::service::service_fn;
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let (parts, body) = req.into_parts();
                    let n = body.collect().await.map(|b| b.to_bytes().len());
                    let length = parts.headers.get("content-length");
                    let text = format!(
                        "target={} version={:?} content-length={:?} body={:?}\n",
                        parts.uri, parts.version, length, n
                    );
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(
                        http_body_util::Full::new(Bytes::from(text)),
                    ))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_clients_request_reaches_an_http2_endpoint_framed_and_addressed() {
    // The head an HTTP/1.1 client's request becomes for an HTTP/2 endpoint is built as a map
    // (no text between): its body framing and its authority must come out as HTTP/2 wants.
    let e = h2c_body_echo().await;
    let proxy = keel_proxy::start(simple_config(&[e], "round-robin", "protocol = \"h2c\"\n"))
        .await
        .unwrap();
    let at = proxy.listener_addrs()[0];
    // A small chunked body is read whole and sent with its length.
    let got = raw_exchange(
        at,
        b"POST /up?x=1 HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(
        got.contains("target=http://app.test/up?x=1 version=HTTP/2.0 content-length=Some(\"11\") body=Ok(11)"),
        "{got}"
    );
    // A large chunked body streams in DATA frames, with no length and no transfer coding.
    let chunk = vec![b'a'; 16 * 1024];
    let mut raw = b"POST /big HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..8 {
        raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        raw.extend_from_slice(&chunk);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let got = raw_exchange(at, &raw).await;
    assert!(
        got.contains(
            "target=http://app.test/big version=HTTP/2.0 content-length=None body=Ok(131072)"
        ),
        "{got}"
    );
    // An HTTP/1.0 client without `Host`: the endpoint's address is the authority.
    let got = raw_exchange(at, b"GET /old HTTP/1.0\r\n\r\n").await;
    assert!(
        got.contains(&format!("target=http://{e}/old version=HTTP/2.0")),
        "{got}"
    );
    // An absolute-form target's authority wins over `Host`, and `..` is resolved first.
    let got = raw_exchange(
        at,
        b"GET http://other.test:8080/a/../b HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        got.contains("target=http://other.test:8080/b version"),
        "{got}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// HEAD from an HTTP/2 client to an h2c endpoint: the head comes back (the endpoint's
/// headers, no body), never a reset stream, over HTTP/1.1 clients too.
#[tokio::test]
async fn a_head_request_to_an_h2c_endpoint_gets_its_head() {
    let (h2c, _) = h2c_server(100).await;
    let proxy = keel_proxy::start(simple_config(&[h2c], "round-robin", "protocol = \"h2c\"\n"))
        .await
        .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    let client = h2_client();
    for _ in 0..3 {
        let req = Request::head(&url)
            .body(BodyExt::boxed(Full::new(Bytes::new())))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(body.is_empty(), "{body:?}");
    }
    let got = send_head(&url).await;
    assert_eq!(got, 200);
    proxy.shutdown(Duration::from_secs(1)).await;
}

async fn send_head(url: &str) -> u16 {
    let c = Client::builder(TokioExecutor::new()).build_http::<AnyBody>();
    let req = Request::head(url)
        .body(BodyExt::boxed(Full::new(Bytes::new())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
        .await
        .unwrap()
        .unwrap();
    let status = resp.status().as_u16();
    resp.into_body().collect().await.unwrap();
    status
}
