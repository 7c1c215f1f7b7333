//! The front end of TCP listeners (`protocol = "tcp"`): each client connection is one
//! "request" of the attempt driver on the TCP leg ([`crate::leg::tcp`]), then a tunnel.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::config::{HashOn, ListenerConfig};
use crate::driver;
use crate::driver::answer::{Answer, Upstream};
use crate::exchange::request::Client;
use crate::leg::tcp::TcpLeg;
use crate::observe::record::Record;
use crate::state::Shared;

/// Serves one connection of a TCP listener: a pick and a connect through the attempt
/// driver, then a tunnel until either side is done.
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    index: usize,
    settings: &ListenerConfig,
    client: &Client,
    local: SocketAddr,
    mut stream: S,
) {
    // A TCP listener has its `cluster` and no routes (checked by the configuration).
    let Some(target) = shared.routing.load().listeners[index]
        .target(crate::route::RouteRef::Listener)
        .cloned()
    else {
        return;
    };
    let cluster = target.cluster;
    let hash = match cluster.config.balance.hash_on {
        Some(HashOn::ClientIp) => Some(crate::upstream::cluster::client_ip_key(client.peer)),
        // No request to take a header or a path from.
        _ => None,
    };
    let mut leg = TcpLeg {
        peer: client.peer,
        local,
    };
    let mut timer = crate::io::idle_timer();
    let started = Instant::now();
    let asked = driver::DriverRequest {
        hash,
        ..driver::DriverRequest::new(&cluster, client, started, target.limits)
    };
    let driven = driver::drive(asked, &mut leg, &mut timer);
    match driven.await {
        // Counted and logged (TCP has no access-log line); a TCP client only sees the close.
        Answer::Own(own) => Record {
            cluster: Some(&cluster),
            endpoint: own.endpoint.as_ref().map(|e| e.as_bytes()),
            attempts: own.attempts,
            ..Record::refused(
                client,
                "TCP",
                started,
                crate::exchange::head::HeadView::Lines(b""),
                own.status,
                &own.cause,
            )
        }
        .write(None),
        Answer::Upstream(Upstream {
            response: mut conn,
            tail,
        }) => {
            let _open = crate::leg::tunnel::TunnelGauge::new(&cluster.metrics);
            let end =
                crate::leg::tunnel::run(&mut stream, &mut conn.io, &[], &[], settings.idle_timeout)
                    .await;
            tail.end(end.outcome(), None);
        }
    }
}
