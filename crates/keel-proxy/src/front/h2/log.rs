//! What an HTTP/2 (or HTTP/3) request's [`Record`] takes from its stream, owned: an endpoint's response
//! body carries it until the body ends, when the record is written.

use std::sync::Arc;
use std::time::Instant;

use crate::driver::account::Tail;
use crate::exchange::head::HeadView;
use crate::exchange::request::Client;
use crate::observe::access_log::AccessLog;
use crate::observe::record::Record;
use crate::upstream::cluster::Cluster;

/// What an HTTP/2 request's record needs besides its answer.
pub(crate) struct H2Scope {
    /// The access log, when one is configured.
    pub(crate) log: Option<Arc<AccessLog>>,
    pub(crate) client: Arc<Client>,
    pub(crate) started: Instant,
    pub(crate) route: Option<u16>,
    /// The request's head, as rewritten for the upstream (what the log shows of it), when
    /// it is logged.
    pub(crate) request: LoggedHead,
    /// As the log names it: `HTTP/2.0`, or `HTTP/3.0` (the HTTP/3 front end's).
    pub(crate) protocol: &'static str,
    /// The route's counters for its cluster, once routed.
    pub(crate) metrics: Option<Arc<crate::metrics::RouteMetrics>>,
    /// Bytes of the request's body, when its length was announced.
    pub(crate) received: u64,
}

impl H2Scope {
    /// The record of an answer with `status` (its other fields empty: the caller fills them).
    pub(crate) fn record<'a>(&'a self, cluster: Option<&'a Cluster>, status: u16) -> Record<'a> {
        Record {
            client: &self.client,
            cluster,
            route: self.route,
            protocol: self.protocol,
            started: self.started,
            request: match &self.request {
                LoggedHead::None => HeadView::Lines(b""),
                LoggedHead::Text(text) => HeadView::Lines(text),
                LoggedHead::Map(parts) => HeadView::Map(parts),
            },
            status,
            endpoint: None,
            attempts: 0,
            tries: None,
            cause: None,
            own: false,
            bytes_sent: 0,
            body_bytes_sent: 0,
            route_metrics: self.metrics.as_deref(),
            bytes_received: self.received,
        }
    }

    /// The scope with the request's head (moved, not copied), when it is logged.
    pub(crate) fn with_request(mut self, head: impl FnOnce() -> LoggedHead) -> Self {
        if self.log.is_some() {
            self.request = head();
        }
        self
    }
}

/// A request's head as the log shows it, in the form it was sent upstream in (owned; the
/// parts boxed: the scope moves with the response body).
pub(crate) enum LoggedHead {
    None,
    Text(Vec<u8>),
    Map(Box<hyper::http::request::Parts>),
}

impl LoggedHead {
    /// The head written as `text` (`http1`), else `parts`.
    pub(crate) fn of(http1: bool, text: Vec<u8>, parts: hyper::http::request::Parts) -> Self {
        if http1 {
            LoggedHead::Text(text)
        } else {
            LoggedHead::Map(Box::new(parts))
        }
    }
}

/// An endpoint's response on its way to an HTTP/2 client: the record to write when its body
/// ends.
pub(crate) struct H2Answered {
    pub(crate) scope: H2Scope,
    pub(crate) status: u16,
    /// Body bytes sent.
    pub(crate) sent: u64,
}

impl H2Answered {
    /// Writes the record of a response whose body has ended (`cause`: why it was cut), before
    /// `tail` finishes the pick.
    pub(crate) fn write(&self, tail: &Tail, cause: Option<&str>) {
        Record {
            endpoint: Some(tail.endpoint_header().as_bytes()),
            attempts: tail.attempts,
            tries: Some(&tail.tries),
            cause,
            bytes_sent: self.sent,
            body_bytes_sent: self.sent,
            ..self.scope.record(Some(&tail.cluster), self.status)
        }
        .write(self.scope.log.as_deref());
    }
}
