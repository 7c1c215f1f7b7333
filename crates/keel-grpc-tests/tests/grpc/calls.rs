//! gRPC through keel on loopback, with tonic on both sides: unary calls
//! (`grpc.health.v1.Health/Check`) to three endpoints, one of which answers every call with
//! `14 UNAVAILABLE`; keel retries those on another endpoint, so every call succeeds. Also: the
//! active gRPC health check, and keel's own failure reaching a gRPC client as a gRPC status.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// A health service that answers SERVING, or UNAVAILABLE to every call when `down`, and
/// counts the calls it got.
struct Service {
    down: bool,
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Health for Service {
    async fn check(
        &self,
        _req: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.down {
            return Err(Status::unavailable("draining"));
        }
        Ok(Response::new(HealthCheckResponse {
            status: ServingStatus::Serving as i32,
        }))
    }

    type WatchStream = tonic::codegen::BoxStream<HealthCheckResponse>;

    async fn watch(
        &self,
        _req: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("watch"))
    }
}

/// A tonic server on an ephemeral loopback port.
async fn server(down: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let service = Service {
        down,
        calls: calls.clone(),
    };
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(HealthServer::new(service))
            .serve_with_incoming(tokio_stream(listener))
            .await
            .unwrap();
    });
    (addr, calls)
}

/// The listener's connections as the stream tonic's server takes.
fn tokio_stream(
    listener: tokio::net::TcpListener,
) -> impl tonic::codegen::tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tonic::codegen::tokio_stream::wrappers::TcpListenerStream::new(listener)
}

fn config(endpoints: &[SocketAddr], extra: &str) -> keel_proxy::ProxyConfig {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"grpc\"\n\n[[cluster]]\nname = \"grpc\"\nprotocol = \"h2c\"\nstrategy = \"round-robin\"\nendpoints = [{}]\n{extra}\n",
        eps.join(", ")
    );
    keel_proxy::ProxyConfig::from_toml_str(&text, "grpc.toml").unwrap_or_else(|e| panic!("{e}"))
}

async fn client(proxy: &keel_proxy::ProxyHandle) -> HealthClient<tonic::transport::Channel> {
    let url = format!("http://{}", proxy.listener_addrs()[0]);
    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

#[tokio::test]
async fn unary_calls_succeed_with_one_of_three_endpoints_unavailable() {
    let (a, calls_a) = server(false).await;
    let (down, calls_down) = server(true).await;
    let (c, calls_c) = server(false).await;
    let proxy = keel_proxy::start(config(
        &[a, down, c],
        // Retries alone (outlier detection would eject the endpoint after 5 failures).
        "outlier_detection = false\n[cluster.retry]\nattempts = 2\nmin_retries_per_second = 100\n",
    ))
    .await
    .unwrap();
    let mut health = client(&proxy).await;
    for i in 0..60 {
        let resp = health
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap_or_else(|s| panic!("call {i}: {s:?}"));
        assert_eq!(resp.get_ref().status, ServingStatus::Serving as i32);
    }
    // The unavailable endpoint was met (round-robin sends it a share of the calls) and every
    // such call went again to a serving one; its answers count as its failures.
    let met = calls_down.load(Ordering::SeqCst);
    assert!(met >= 15, "the failing endpoint got {met} calls");
    assert_eq!(
        calls_a.load(Ordering::SeqCst) + calls_c.load(Ordering::SeqCst),
        60
    );
    let status = proxy.cluster_status("grpc").unwrap();
    assert_eq!(status[1].failures as usize, met, "{status:?}");
    assert_eq!(status[1].successes, 0, "{status:?}");
    assert_eq!(status[0].successes + status[2].successes, 60, "{status:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_bare_config_loses_no_call_to_one_unavailable_endpoint_of_three() {
    // What a user writes first: endpoints and `attempts = 2`, nothing else. The protections
    // that are on by default (outlier detection, the retry budget) must keep every call.
    let (a, _) = server(false).await;
    let (down, calls_down) = server(true).await;
    let (c, _) = server(false).await;
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"grpc\"\n\n[[cluster]]\nname = \"grpc\"\nprotocol = \"h2c\"\nendpoints = [{{ address = \"{a}\" }}, {{ address = \"{down}\" }}, {{ address = \"{c}\" }}]\n[cluster.retry]\nattempts = 2\n"
    );
    let proxy =
        keel_proxy::start(keel_proxy::ProxyConfig::from_toml_str(&text, "bare.toml").unwrap())
            .await
            .unwrap();
    let mut health = client(&proxy).await;
    let mut failed = 0;
    for _ in 0..150 {
        let ok = health
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .is_ok_and(|r| r.get_ref().status == ServingStatus::Serving as i32);
        failed += usize::from(!ok);
    }
    assert_eq!(failed, 0, "of 150 sequential calls");
    // Ejected after its 5th failure in a row (and not back within the 30 s ejection).
    let met = calls_down.load(Ordering::SeqCst);
    assert!(
        (5..=6).contains(&met),
        "the unavailable endpoint got {met} calls"
    );
    let status = proxy.cluster_status("grpc").unwrap();
    assert!(status[1].ejected_until.is_some(), "{status:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn other_grpc_codes_are_the_applications_unless_listed() {
    // NOT_FOUND is an answer: a success for the balancer, passed to the client as it is.
    let (a, _) = server(false).await;
    let proxy = keel_proxy::start(config(&[a], "")).await.unwrap();
    let mut health = client(&proxy).await;
    // tonic's Health answers UNIMPLEMENTED to watch.
    let err = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    let status = proxy.cluster_status("grpc").unwrap();
    assert_eq!(
        (status[0].successes, status[0].failures),
        (1, 0),
        "{status:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;

    // Listed in retry_on_grpc_status: the endpoint's failure.
    let proxy = keel_proxy::start(config(
        &[a],
        "[cluster.retry]\nattempts = 0\nretry_on_grpc_status = [12]\n",
    ))
    .await
    .unwrap();
    let mut health = client(&proxy).await;
    let err = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    let status = proxy.cluster_status("grpc").unwrap();
    assert_eq!(
        (status[0].successes, status[0].failures),
        (0, 1),
        "{status:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn the_grpc_health_check_marks_an_unavailable_endpoint_down() {
    let (a, _) = server(false).await;
    let (down, _) = server(true).await;
    let proxy = keel_proxy::start(config(
        &[a, down],
        "[cluster.health_check]\nkind = \"grpc\"\ninterval = \"50ms\"\nunhealthy_threshold = 1\nhealthy_threshold = 1\n",
    ))
    .await
    .unwrap();
    let mut marked = false;
    for _ in 0..100 {
        let s = proxy.cluster_status("grpc").unwrap();
        if s[0].healthy && !s[1].healthy {
            marked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(marked, "{:?}", proxy.cluster_status("grpc"));
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn keels_own_failure_reaches_a_grpc_client_as_a_grpc_status() {
    // The only endpoint refuses connections: keel's 502 becomes 14 UNAVAILABLE in an HTTP 200
    // the client can read.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let proxy = keel_proxy::start(config(&[closed], "")).await.unwrap();
    let mut health = client(&proxy).await;
    let err = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("cannot connect"), "{err:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}
