//! The HTTP/2 front end's access-log lines: what a request's line needs besides its answer,
//! and the answer's part, written when the response body ends.

use std::sync::Arc;
use std::time::Instant;

use hyper::header::HeaderValue;

use crate::driver::tries::Tries;
use crate::exchange::request::Client;
use crate::observe::access_log::{AccessLog, Entry, RequestLine, TryLog};

/// What the access log needs of an HTTP/2 request besides its answer.
pub(crate) struct H2Log {
    pub(crate) log: Arc<AccessLog>,
    pub(crate) client: Arc<Client>,
    pub(crate) started: Instant,
    pub(crate) cluster: Option<Arc<crate::upstream::cluster::Cluster>>,
    pub(crate) route: Option<u16>,
    /// The head as rewritten for the upstream (the request line and headers the log shows).
    pub(crate) head: Vec<u8>,
}

/// The answer's part of an HTTP/2 access-log line, written when its body ends.
pub(crate) struct H2LogUpstream {
    pub(crate) log: H2Log,
    pub(crate) status: u16,
    pub(crate) endpoint: HeaderValue,
    pub(crate) attempts: u32,
    /// Every try (the access log's `tries`).
    pub(crate) tries: Tries,
    /// Body bytes sent.
    pub(crate) sent: u64,
}

impl H2LogUpstream {
    /// Writes the line of a response whose body has ended.
    pub(crate) fn write(&self) {
        self.log.write(
            self.status,
            self.sent,
            Some(self.endpoint.as_bytes()),
            self.attempts,
            None,
            &self.tries,
        );
    }
}

pub(crate) trait WithHead {
    fn with_head(self, head: Vec<u8>) -> Self;
}

impl WithHead for Option<H2Log> {
    /// The log context with the request's rewritten head (moved, not copied).
    fn with_head(mut self, head: Vec<u8>) -> Self {
        if let Some(l) = &mut self {
            l.head = head;
        }
        self
    }
}

impl H2Log {
    pub(crate) fn write(
        &self,
        status: u16,
        sent: u64,
        endpoint: Option<&[u8]>,
        attempts: u32,
        cause: Option<&str>,
        tries: &Tries,
    ) {
        self.log.log(
            self.client.worker,
            &Entry {
                client: &self.client.ip,
                request: RequestLine::parse(&self.head),
                protocol: "HTTP/2.0",
                status,
                bytes_sent: sent,
                body_bytes_sent: sent,
                duration: self.started.elapsed(),
                cluster: self.cluster.as_ref().map(|c| c.name()),
                endpoint,
                attempts,
                route: self.route,
                cause,
                tries: self.cluster.as_ref().map(|c| TryLog {
                    tries,
                    endpoints: &c.endpoints,
                }),
            },
        );
    }
}
