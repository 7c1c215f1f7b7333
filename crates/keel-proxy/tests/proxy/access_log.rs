//! The access log on loopback: one line per request answered, keel's own
//! answers included (a `404` for want of a route, a `502` after a retry, a `400` for a
//! malformed head), over HTTP/1.1 and HTTP/2, with every field the log has and the bytes
//! the client really got; NGINX's combined format; reopened (as on SIGUSR1) after the file was
//! moved; the documented `[access_log]` table as written.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_proxy::ProxyConfig;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

/// The documented `[access_log]` table, verbatim.
const ISSUE_ACCESS_LOG: &str = r#"[access_log]
path = "access.log"   # "-" for stdout; relative to the configuration file
format = "json"       # or "combined" (NGINX's combined format)
"#;

/// A fresh directory for one test.
fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("keel-access-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `text` as `keel.toml` in `dir` and loads it from there (relative paths are the
/// directory's).
fn load_from(dir: &Path, text: &str) -> ProxyConfig {
    let path = dir.join("keel.toml");
    std::fs::write(&path, text).unwrap();
    ProxyConfig::from_file(&path).unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// Sends raw bytes on a new connection and reads until the server closes it.
async fn raw(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    got
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_json_line_per_request_answered_with_every_field() {
    let d = dir("json");
    let bs = backends(1, Duration::ZERO).await;
    let good = bs[0].addr();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let text = format!(
        "{ISSUE_ACCESS_LOG}\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\n\
         [[listener.route]]\npath_prefix = \"/app/\"\ncluster = \"app\"\n\n\
         [[listener.route]]\npath = \"/flaky\"\ncluster = \"flaky\"\n\n\
         [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{good}\" }}]\n\n\
         [[cluster]]\nname = \"flaky\"\nstrategy = \"round-robin\"\nendpoints = [{{ address = \"{dead}\" }}, {{ address = \"127.0.0.1:1\" }}]\n[cluster.retry]\nattempts = 1\n"
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let addr = proxy.listener_addrs()[0];

    // 1: a 200 over HTTP/1.1; the bytes the client got are the line's bytes_sent.
    let got = raw(
        addr,
        b"GET /app/x?y=1 HTTP/1.1\r\nHost: shop.test\r\nUser-Agent: t/1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    let ok_bytes = got.len() as u64;
    // 2: HEAD on a keep-alive connection, then 3: a 404 on the same connection.
    let c = client();
    let r = send(
        &c,
        hyper::Method::HEAD,
        &format!("http://{addr}/app/h"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    let r = send(
        &c,
        hyper::Method::GET,
        &format!("http://{addr}/nowhere"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 404);
    // 4: a 502 after two tries (both endpoints refuse).
    let r = send(
        &c,
        hyper::Method::GET,
        &format!("http://{addr}/flaky"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 502);
    // 5: a malformed head: 400.
    let got = raw(addr, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert!(
        got.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    // 6 and 7: HTTP/2, routed and not.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    for path in ["/app/two", "/none"] {
        let req = hyper::Request::builder()
            .uri(format!("http://h2.test{path}"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = h2.send_request(req).await.unwrap();
        let _ = resp.into_body().collect().await.unwrap();
    }
    drop(h2);
    // 8: a connection that closes before its head is complete: no answer, no line.
    {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /app/ HTTP/1.1\r\nHost: x").await.unwrap();
    }
    proxy.shutdown(Duration::from_secs(1)).await;

    let lines = lines(&d.join("access.log"));
    assert_eq!(
        lines.len(),
        7,
        "one line per request answered:\n{}",
        lines.join("\n")
    );
    let v: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let keys = [
        "time",
        "client",
        "method",
        "host",
        "path",
        "protocol",
        "status",
        "bytes_sent",
        "duration_ms",
        "cluster",
        "endpoint",
        "attempts",
        "route",
        "cause",
        "request_id",
        "trace_id",
        "user_agent",
        "referer",
        "tries",
    ];
    for line in &v {
        let obj = line.as_object().unwrap();
        assert_eq!(obj.len(), keys.len(), "{line}");
        for k in keys {
            assert!(obj.contains_key(k), "{k} in {line}");
        }
        let time = line["time"].as_str().unwrap();
        assert!(
            time.len() == 24 && time.ends_with('Z') && &time[10..11] == "T" && &time[19..20] == ".",
            "RFC 3339 with milliseconds: {time}"
        );
        assert_eq!(line["client"], "127.0.0.1");
        assert!(line["duration_ms"].as_f64().unwrap() >= 0.0);
    }
    // Lines are written as answers end; find each by what it is.
    let find = |status: u64, path: &str| {
        v.iter()
            .find(|l| l["status"] == status && l["path"] == path)
            .unwrap_or_else(|| panic!("no {status} line for {path} in\n{}", lines.join("\n")))
    };
    let ok = find(200, "/app/x?y=1");
    assert_eq!(ok["method"], "GET");
    assert_eq!(ok["host"], "shop.test");
    assert_eq!(ok["protocol"], "HTTP/1.1");
    assert_eq!(ok["bytes_sent"], ok_bytes);
    assert_eq!(ok["cluster"], "app");
    assert_eq!(ok["endpoint"], good.to_string());
    assert_eq!(ok["attempts"], 1);
    assert_eq!(ok["route"], 0);
    assert!(ok["cause"].is_null());
    // One try, answered: it lasts until the response's end, so at most the request's time.
    let tries = ok["tries"].as_array().unwrap();
    assert_eq!(tries.len(), 1, "{ok}");
    assert_eq!(tries[0]["endpoint"], good.to_string());
    assert_eq!(tries[0]["outcome"], "ok");
    assert_eq!(tries[0]["in_flight"], 0);
    let t = tries[0]["duration_ms"].as_f64().unwrap();
    assert!(t >= 0.0 && t <= ok["duration_ms"].as_f64().unwrap(), "{ok}");
    let head = find(200, "/app/h");
    assert_eq!(head["method"], "HEAD");
    let nf = find(404, "/nowhere");
    assert!(nf["cluster"].is_null() && nf["endpoint"].is_null() && nf["route"].is_null());
    assert_eq!(nf["attempts"], 0);
    assert_eq!(nf["tries"], serde_json::json!([]));
    assert_eq!(nf["cause"], "no route matches the request");
    let bad = find(502, "/flaky");
    assert_eq!(bad["cluster"], "flaky");
    assert_eq!(bad["route"], 1);
    assert_eq!(bad["attempts"], 2);
    let last = bad["endpoint"].as_str().unwrap();
    assert!(last == dead.to_string() || last == "127.0.0.1:1", "{bad}");
    assert!(
        bad["cause"].as_str().unwrap().contains("cannot connect"),
        "{bad}"
    );
    // Both tries, each refused, on the two endpoints, the last one the line's `endpoint`.
    let tries = bad["tries"].as_array().unwrap();
    assert_eq!(tries.len(), 2, "{bad}");
    let mut names: Vec<&str> = tries
        .iter()
        .map(|t| t["endpoint"].as_str().unwrap())
        .collect();
    assert_eq!(names[1], last);
    names.sort();
    let mut want = [dead.to_string(), "127.0.0.1:1".to_string()];
    want.sort();
    assert_eq!(names, want);
    for t in tries {
        assert_eq!(t["outcome"], "connect refused", "{bad}");
    }
    let refused = v.iter().find(|l| l["status"] == 400).unwrap();
    assert_eq!(refused["method"], "NOT");
    assert!(refused["cluster"].is_null());
    assert!(
        refused["cause"].as_str().unwrap().contains("malformed"),
        "{refused}"
    );
    let h2 = find(200, "/app/two");
    assert_eq!(h2["protocol"], "HTTP/2.0");
    assert_eq!(h2["host"], "h2.test");
    assert_eq!(h2["cluster"], "app");
    assert_eq!(h2["route"], 0);
    assert!(h2["bytes_sent"].as_u64().unwrap() > 0);
    assert_eq!(h2["tries"][0]["outcome"], "ok");
    assert_eq!(h2["tries"][0]["endpoint"], good.to_string());
    let h2_404 = find(404, "/none");
    assert_eq!(h2_404["protocol"], "HTTP/2.0");
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn combined_lines_are_nginxs_and_a_reopen_follows_a_moved_file() {
    let d = dir("combined");
    let bs = backends(1, Duration::ZERO).await;
    let text = format!(
        "[access_log]\npath = \"logs.txt\"\nformat = \"combined\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
         [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let got = raw(
        addr,
        b"GET /a\"b HTTP/1.1\r\nHost: x\r\nReferer: http://r.test/\r\nUser-Agent: curl/8.5\r\nConnection: close\r\n\r\n",
    )
    .await;
    let body_len = {
        let text = String::from_utf8_lossy(&got);
        let (_, body) = text.split_once("\r\n\r\n").unwrap();
        body.len()
    };
    // The line is written within the writer's 100 ms.
    let log = d.join("logs.txt");
    assert!(eventually(Duration::from_secs(2), || lines(&log).len() == 1).await);
    let line = &lines(&log)[0];
    let (prefix, rest) = line.split_once(" [").unwrap();
    assert_eq!(prefix, "127.0.0.1 - -");
    let (time, rest) = rest.split_once("] ").unwrap();
    assert_eq!(time.len(), "01/May/2024:12:00:00 +0000".len(), "{line}");
    assert!(time.ends_with(" +0000"), "{line}");
    assert_eq!(
        rest,
        format!("\"GET /a\\x22b HTTP/1.1\" 200 {body_len} \"http://r.test/\" \"curl/8.5\"")
    );

    // logrotate: the file is moved, the proxy told to reopen (SIGUSR1 in `keel proxy`).
    let moved = d.join("logs.txt.1");
    std::fs::rename(&log, &moved).unwrap();
    proxy.reopen_access_log();
    // Until the writer reopened it, a line may still go to the moved file.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = get(&format!("http://{addr}/after")).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(eventually(Duration::from_secs(2), || lines(&log).len() == 1).await);
    assert!(
        lines(&log)[0].contains("\"GET /after HTTP/1.1\" 200"),
        "{:?}",
        lines(&log)
    );
    assert_eq!(lines(&moved).len(), 1);
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn access_log_settings_load_and_bad_ones_are_located() {
    let d = dir("settings");
    let tail = "\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";
    let c = load_from(&d, &format!("{ISSUE_ACCESS_LOG}{tail}"));
    let a = c.access_log.unwrap();
    assert_eq!(a.path, d.join("access.log"), "relative to the file");
    assert_eq!(a.format, keel_proxy::config::AccessLogFormat::Json);
    let c = load_from(&d, &format!("[access_log]\npath = \"-\"\n{tail}"));
    assert_eq!(c.access_log.unwrap().file(), None, "standard output");
    for (table, key, words) in [
        (
            "[access_log]\npath = \"a.log\"\nformat = \"apache\"\n",
            Some("access_log.format"),
            "combined",
        ),
        // (A missing key is not located today, whichever table lacks it.)
        (
            "[access_log]\nformat = \"json\"\n",
            None,
            "missing field `path`",
        ),
        (
            "[access_log]\npath = \"a.log\"\nbuffer = 1\n",
            Some("access_log.buffer"),
            "unknown field",
        ),
        (
            "[access_log]\npath = \".\"\n",
            Some("access_log.path"),
            "not a file path",
        ),
    ] {
        let path = d.join("bad.toml");
        std::fs::write(&path, format!("{table}{tail}")).unwrap();
        let e = ProxyConfig::from_file(&path).unwrap_err();
        if key.is_some() {
            assert_eq!(e.key.as_deref(), key, "{table}: {e}");
        }
        assert!(e.message.contains(words), "{table}: {e}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The `tries` field: a try that timed out and its retry, with their durations, and
/// the in-flight count each endpoint had when it was picked, over real sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tries_record_every_try_its_outcome_time_and_in_flight() {
    let d = dir("tries");
    let bs = backends(2, Duration::from_millis(100)).await;
    fault(&bs[0], keel_model::FailureMode::Hang).await;
    let (hung, good) = (bs[0].addr(), bs[1].addr());
    let text = format!(
        "[access_log]\npath = \"access.log\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
         [[cluster]]\nname = \"app\"\nstrategy = \"round-robin\"\n\
         endpoints = [{{ address = \"{hung}\" }}, {{ address = \"{good}\" }}]\n\
         [cluster.retry]\nattempts = 1\nper_try_timeout = \"300ms\"\n"
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    // Round-robin starts on the hanging endpoint: the request times out there after 300 ms
    // and is answered by the other.
    let c = client();
    let r = send(
        &c,
        hyper::Method::GET,
        &format!("http://{addr}/a"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    proxy.shutdown(Duration::from_secs(1)).await;
    let got = lines(&d.join("access.log"));
    assert_eq!(got.len(), 1, "{}", got.join("\n"));
    let first: Value = serde_json::from_str(&got[0]).unwrap();
    let tries = first["tries"].as_array().unwrap();
    assert_eq!(tries.len(), 2, "{first}");
    assert_eq!(tries[0]["endpoint"], hung.to_string());
    assert_eq!(tries[0]["outcome"], "timeout");
    let waited = tries[0]["duration_ms"].as_f64().unwrap();
    // The upper bound leaves room for a loaded machine's late timer (CI runs tests side by side).
    assert!((300.0..2000.0).contains(&waited), "{first}");
    assert_eq!(tries[1]["endpoint"], good.to_string());
    assert_eq!(tries[1]["outcome"], "ok");
    // The retry took the backend's 100 ms, and both tries fit in the request's time.
    let answered = tries[1]["duration_ms"].as_f64().unwrap();
    assert!(answered >= 100.0, "{first}");
    let total = first["duration_ms"].as_f64().unwrap();
    assert!(waited + answered <= total + 1.0, "{first}");

    // Three requests at once on one endpoint that takes 1.5 s: each finds the ones picked
    // before it still there (0, 1 and 2 in flight). The time is long so that on a loaded
    // machine the third is picked before the first has finished.
    let slow = backends(1, Duration::from_millis(1500)).await;
    let text = format!(
        "[access_log]\npath = \"slow.log\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"one\"\n\n\
         [[cluster]]\nname = \"one\"\nendpoints = [{{ address = \"{}\" }}]\n",
        slow[0].addr()
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut tasks = Vec::new();
    for i in 0..3 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            send(
                &c,
                hyper::Method::GET,
                &format!("http://{addr}/b{i}"),
                &[],
                b"",
            )
            .await
            .unwrap()
            .status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    proxy.shutdown(Duration::from_secs(1)).await;
    let got = lines(&d.join("slow.log"));
    let mut in_flight: Vec<u64> = got
        .iter()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["tries"][0]["in_flight"]
                .as_u64()
                .unwrap()
        })
        .collect();
    in_flight.sort();
    assert_eq!(in_flight, [0, 1, 2], "{}", got.join("\n"));
    let _ = std::fs::remove_dir_all(&d);
}

/// An endpoint that answers by path: `/ok` a 200, `/bad` a chunked body malformed from its
/// first byte (keel answers 502 in its place), `/cut` one chunk, then a close (a body cut
/// after keel sent its head: a small body with a length would have been read whole first).
async fn scripted_endpoint() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                        _ => return,
                    }
                }
                let answer: &[u8] = if head.starts_with(b"GET /ok") {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                } else if head.starts_with(b"GET /bad") {
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nshort\r\n"
                };
                let _ = s.write_all(answer).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

/// One record per request: the status counted in `keel_requests_total` and the access log's
/// line are the status the client got (keel's 502 in place of a malformed body, not the
/// endpoint's 200), and a body the endpoint cut says why over HTTP/2 as over HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counter_and_the_line_of_a_request_come_from_one_record() {
    let d = dir("record");
    let up = scripted_endpoint().await;
    let text = format!(
        "[access_log]\npath = \"access.log\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n\
         [[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
         [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{up}\" }}]\n\
         [cluster.retry]\nattempts = 0\n"
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());
    let ok = raw(
        addr,
        b"GET /ok HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        ok.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&ok)
    );
    let bad = raw(
        addr,
        b"GET /bad HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        bad.starts_with(b"HTTP/1.1 502"),
        "{}",
        String::from_utf8_lossy(&bad)
    );
    let cut = raw(
        addr,
        b"GET /cut HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        cut.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&cut)
    );
    let mut h2 = h2_connect(addr).await;
    let r = h2_send(
        &mut h2,
        hyper::Method::GET,
        &format!("http://{addr}/ok"),
        &[],
    )
    .await;
    assert_eq!(r.status, 200);
    // The endpoint cuts the body: keel resets the HTTP/2 client's stream after the head (which
    // the client may see first, or only the reset).
    let req = hyper::Request::get(format!("http://{addr}/cut"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    if let Ok(resp) = h2.send_request(req).await {
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await;
        assert!(body.is_err(), "the cut reaches the client");
    }

    let count = |class: &'static str| {
        metric(
            admin,
            Box::leak(format!("keel_requests_total{{cluster=\"app\",class=\"{class}\"}}").into()),
        )
    };
    assert_eq!(
        count("2xx").await,
        Some(4.0),
        "two ok and two cut, over both protocols"
    );
    assert_eq!(
        count("5xx").await,
        Some(1.0),
        "keel's 502, not the endpoint's 200"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
    let got: Vec<Value> = lines(&d.join("access.log"))
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), 5, "{got:?}");
    let line = |path: &str, protocol: &str| {
        got.iter()
            .find(|l| l["path"] == path && l["protocol"] == protocol)
            .unwrap_or_else(|| panic!("a line for {path} over {protocol}: {got:?}"))
    };
    assert_eq!(line("/bad", "HTTP/1.1")["status"], 502);
    for protocol in ["HTTP/1.1", "HTTP/2.0"] {
        assert_eq!(line("/ok", protocol)["status"], 200);
        assert!(line("/ok", protocol)["cause"].is_null());
        let cut = line("/cut", protocol);
        assert_eq!(cut["status"], 200);
        assert!(
            cut["cause"]
                .as_str()
                .is_some_and(|c| c.contains("upstream")),
            "{protocol}: {cut}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A line format of the operator's with five variables (NGINX's names and keel's), and a JSON
/// line with chosen keys: exactly the expected lines for real requests, answered by an
/// endpoint and by keel itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_line_format_and_json_fields_give_exactly_the_lines_expected() {
    let d = dir("line-format");
    let bs = backends(1, Duration::ZERO).await;
    let good = bs[0].addr();
    let routes = format!(
        "\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\n[[listener.route]]\npath_prefix = \"/app/\"\ncluster = \"app\"\n\n\
         [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{good}\" }}]\n"
    );
    let text = format!(
        "[access_log]\npath = \"line.log\"\nformat = '$remote_addr \"$request\" $status ${{upstream_addr}}/$route ($cause)'\n{routes}"
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    assert_eq!(
        get(&format!("http://{addr}/app/x?y=1"))
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        get(&format!("http://{addr}/none")).await.unwrap().status,
        404
    );
    let log = d.join("line.log");
    assert!(eventually(Duration::from_secs(2), || lines(&log).len() == 2).await);
    let got = lines(&log);
    assert_eq!(
        got[0],
        format!("127.0.0.1 \"GET /app/x?y=1 HTTP/1.1\" 200 {good}/0 (-)")
    );
    // keel's own 404: no endpoint, no route, and its cause.
    assert!(
        got[1].starts_with("127.0.0.1 \"GET /none HTTP/1.1\" 404 -/- ("),
        "{}",
        got[1]
    );
    proxy.shutdown(Duration::from_secs(1)).await;

    let text = format!(
        "[access_log]\npath = \"fields.log\"\nformat = \"json\"\nfields = [\"status\", \"endpoint\", \"method\", \"route\"]\n{routes}"
    );
    let proxy = keel_proxy::start(load_from(&d, &text)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    assert_eq!(
        get(&format!("http://{addr}/app/z")).await.unwrap().status,
        200
    );
    let log = d.join("fields.log");
    assert!(eventually(Duration::from_secs(2), || lines(&log).len() == 1).await);
    assert_eq!(
        lines(&log)[0],
        format!("{{\"status\":200,\"endpoint\":\"{good}\",\"method\":\"GET\",\"route\":0}}")
    );
    proxy.shutdown(Duration::from_secs(1)).await;

    // Errors at the key, with the line: an unknown variable named, an unknown JSON key,
    // `fields` with a line format.
    let tail = "\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";
    for (table, key, words) in [
        (
            "[access_log]\npath = \"a.log\"\nformat = \"$status $upstream_time\"\n",
            "access_log.format",
            "unknown variable `$upstream_time`",
        ),
        (
            "[access_log]\npath = \"a.log\"\nformat = \"$tries\"\n",
            "access_log.format",
            "unknown variable `$tries`",
        ),
        (
            "[access_log]\npath = \"a.log\"\nfields = [\"status\", \"remote_addr\"]\n",
            "access_log.fields",
            "unknown key `remote_addr`",
        ),
        (
            "[access_log]\npath = \"a.log\"\nfields = [\"status\"]\nformat = \"combined\"\n",
            "access_log.fields",
            "json",
        ),
    ] {
        let path = d.join("bad.toml");
        std::fs::write(&path, format!("{table}{tail}")).unwrap();
        let e = ProxyConfig::from_file(&path).unwrap_err();
        assert_eq!(e.key.as_deref(), Some(key), "{table}: {e}");
        assert!(e.message.contains(words), "{table}: {e}");
        assert!(e.to_string().contains("bad.toml:3:"), "{table}: {e}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
