//! A `models` route on loopback: two real `keel backend --llm` engines serving different
//! models behind one listener, each request going to the engine of the model its body names
//! (HTTP/1.1 and HTTP/2 clients, `model` before or after the prompt); a model no route lists
//! gets `404` in OpenAI's error shape and reaches no engine; a body naming none gets `400` in
//! the same shape, or the route's default `cluster`; a model name split across the client's
//! writes, after 70 KB of other members, is read whole.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::any_port;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use keel_proxy::ProxyConfig;
use keel_testbed::llm::{self, LlmConfig, LlmHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn engine(model: &str) -> LlmHandle {
    let cfg = LlmConfig {
        model: model.to_string(),
        ..LlmConfig::default()
    };
    llm::spawn(any_port(), cfg).await.unwrap()
}

/// A listener whose one route sends `llama-3` and its adapter `llama-3-sql` to the cluster
/// `llama` and `qwen` to `qwen`; `default`: the route's `cluster` line, if any.
fn config(llama: SocketAddr, qwen: SocketAddr, default: &str) -> ProxyConfig {
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\nerror_detail = \"full\"\n\n\
         [[listener.route]]\nname = \"llm\"\npath_prefix = \"/v1/\"\n{default}\n\
         models = {{ \"llama-3\" = \"llama\", \"llama-3-sql\" = \"llama\", \"qwen\" = \"qwen\" }}\n\n\
         [[cluster]]\nname = \"llama\"\nresponse_headers = {{ endpoint = true }}\nendpoints = [{{ address = \"{llama}\" }}]\n\n\
         [[cluster]]\nname = \"qwen\"\nresponse_headers = {{ endpoint = true }}\nendpoints = [{{ address = \"{qwen}\" }}]\n"
    );
    ProxyConfig::from_toml_str(&text, "models.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// An answer: status, `content-type`, the endpoint keel names, the body.
struct Answer {
    status: u16,
    content_type: String,
    endpoint: String,
    body: String,
}

async fn ask(addr: SocketAddr, h2: bool, method: Method, path: &str, body: &str) -> Answer {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (status, content_type, endpoint) = (
        resp.status().as_u16(),
        header("content-type"),
        header("x-keel-endpoint"),
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        content_type,
        endpoint,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_goes_to_its_engine_and_an_unknown_one_gets_openais_404() {
    let (llama, qwen) = (engine("llama-3").await, engine("qwen").await);
    let proxy = keel_proxy::start(config(llama.addr(), qwen.addr(), ""))
        .await
        .unwrap();
    let listen = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        for (model, home, served) in [
            ("llama-3", &llama, "llama-3"),
            ("qwen", &qwen, "qwen"),
            ("llama-3-sql", &llama, "llama-3"),
        ] {
            // `model` first (a completion), and after `messages` (OpenAI's Python client's
            // order for a chat completion).
            let completion = format!(r#"{{"model":"{model}","prompt":"Say hi","max_tokens":2}}"#);
            let chat = format!(
                r#"{{"messages":[{{"role":"user","content":"Say hi"}}],"model":"{model}","max_tokens":2}}"#
            );
            for (path, body) in [
                ("/v1/completions", completion),
                ("/v1/chat/completions", chat),
            ] {
                let a = ask(listen, h2, Method::POST, path, &body).await;
                if model == "llama-3-sql" {
                    // The engine serves `llama-3` only: it refuses the adapter's name, which
                    // shows the request reached it unchanged.
                    assert_eq!(a.status, 404, "h2={h2} {model}: {}", a.body);
                    assert!(a.body.contains("llama-3-sql"), "{}", a.body);
                } else {
                    assert_eq!(a.status, 200, "h2={h2} {model} {path}: {}", a.body);
                    assert_eq!(json(&a.body)["model"], served);
                }
                assert_eq!(a.endpoint, home.addr().to_string(), "h2={h2} {model}");
            }
        }
    }
    let before = (llama.requests(), qwen.requests());
    for h2 in [false, true] {
        let a = ask(
            listen,
            h2,
            Method::POST,
            "/v1/completions",
            r#"{"prompt":"hi","model":"gpt-9","max_tokens":2}"#,
        )
        .await;
        assert_eq!(a.status, 404, "h2={h2}");
        assert_eq!(a.content_type, "application/json");
        assert_eq!(
            json(&a.body),
            serde_json::json!({"error": {
                "message": "The model `gpt-9` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }})
        );
        // No model, a model that is not a string, a body that is not JSON: 400, same shape.
        for body in [
            r#"{"prompt":"hi","max_tokens":2}"#,
            r#"{"model":7,"prompt":"hi"}"#,
            "model=qwen",
        ] {
            let a = ask(listen, h2, Method::POST, "/v1/completions", body).await;
            assert_eq!(a.status, 400, "h2={h2} {body}");
            assert_eq!(a.content_type, "application/json");
            let e = &json(&a.body)["error"];
            assert_eq!(e["type"], "invalid_request_error");
            assert_eq!(e["param"], "model");
            assert_eq!(e["code"], serde_json::Value::Null);
        }
    }
    assert_eq!(
        (llama.requests(), qwen.requests()),
        before,
        "no engine saw a request keel refused"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_naming_no_model_goes_to_the_routes_default_cluster() {
    let (llama, qwen) = (engine("llama-3").await, engine("qwen").await);
    let proxy = keel_proxy::start(config(llama.addr(), qwen.addr(), "cluster = \"qwen\""))
        .await
        .unwrap();
    let listen = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        // A GET without a body, and a body without `model` (the engine then serves its own).
        let a = ask(listen, h2, Method::GET, "/v1/models", "").await;
        assert_eq!(a.status, 200);
        assert_eq!(json(&a.body)["data"][0]["id"], "qwen");
        let a = ask(
            listen,
            h2,
            Method::POST,
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":2}"#,
        )
        .await;
        assert_eq!((a.status, a.endpoint), (200, qwen.addr().to_string()));
        // A model named and not listed is still refused: the default is for no model.
        let a = ask(
            listen,
            h2,
            Method::POST,
            "/v1/completions",
            r#"{"model":"mistral","prompt":"hi"}"#,
        )
        .await;
        assert_eq!(a.status, 404);
        let a = ask(
            listen,
            h2,
            Method::POST,
            "/v1/completions",
            r#"{"model":"llama-3","prompt":"hi","max_tokens":2}"#,
        )
        .await;
        assert_eq!((a.status, a.endpoint), (200, llama.addr().to_string()));
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// The body of a completion for `qwen` whose `model` comes after 70 KB of another member
/// (past what a front end holds whole), cut inside the model's name.
fn long_body() -> (String, String) {
    let pad = "u".repeat(70_000);
    (
        format!(r#"{{"user":"{pad}","model":"qw"#),
        r#"en","prompt":"Say hi","max_tokens":2}"#.to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_name_split_across_the_clients_writes_is_read_whole() {
    let (llama, qwen) = (engine("llama-3").await, engine("qwen").await);
    let proxy = keel_proxy::start(config(llama.addr(), qwen.addr(), ""))
        .await
        .unwrap();
    let listen = proxy.listener_addrs()[0];
    let (first, rest) = long_body();

    // HTTP/1.1, by length: the head and the first part, a pause, then the rest.
    let mut tcp = tokio::net::TcpStream::connect(listen).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        first.len() + rest.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(first.as_bytes()).await.unwrap();
    tcp.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    tcp.write_all(rest.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_string(&mut answer))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains(&format!("x-keel-endpoint: {}", qwen.addr())),
        "{answer}"
    );
    assert!(answer.contains(r#""model":"qwen""#), "{answer}");

    // HTTP/2: the same two parts as two DATA frames with a pause between.
    let tcp = tokio::net::TcpStream::connect(listen).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
    let frames = Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        let b = rx.recv().await?;
        Some((
            Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)),
            rx,
        ))
    }));
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{listen}/v1/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::StreamBody::new(frames))
        .unwrap();
    let send = tokio::spawn(async move {
        tx.send(Bytes::from(first)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        tx.send(Bytes::from(rest)).await.unwrap();
    });
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    send.await.unwrap();
    let status = resp.status();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{body}");
    let resp = hyper::Response::from_parts(parts, body.clone());
    assert_eq!(
        resp.headers()["x-keel-endpoint"].to_str().unwrap(),
        qwen.addr().to_string()
    );
    assert_eq!(json(resp.body())["model"], "qwen");
    assert_eq!(
        llama.requests(),
        0,
        "nothing went to the other model's engine"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
