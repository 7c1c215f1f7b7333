//! A minimal OTLP/gRPC trace collector for scripts/trace-envoy-check.sh: a `TraceService`
//! server (the `opentelemetry-proto` definitions, served with tonic) that prints each span it
//! receives as one JSON line on standard output:
//!
//! ```text
//! {"service":"keel","name":"GET","kind":2,"trace_id":"4bf9...","span_id":"...","parent_span_id":"..."}
//! ```
//!
//! Usage: `otlp-collector 127.0.0.1:4317`.

use std::io::Write;
use std::net::SocketAddr;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tonic::{Request, Response, Status};

struct Printer;

fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// `s` as a JSON string (the names printed here are plain, but a span name is the sender's).
fn json(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[tonic::async_trait]
impl TraceService for Printer {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut out = std::io::stdout().lock();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in rs.scope_spans.iter().flat_map(|s| &s.spans) {
                let _ = writeln!(
                    out,
                    "{{\"service\":{},\"name\":{},\"kind\":{},\"trace_id\":\"{}\",\"span_id\":\"{}\",\"parent_span_id\":\"{}\"}}",
                    json(&service),
                    json(&span.name),
                    span.kind,
                    hex(&span.trace_id),
                    hex(&span.span_id),
                    hex(&span.parent_span_id),
                );
            }
        }
        let _ = out.flush();
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:4317".into())
        .parse()
        .expect("usage: otlp-collector ADDRESS:PORT");
    eprintln!("otlp-collector: listening on {addr}");
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(Printer))
        .serve(addr)
        .await
        .expect("the collector's server");
}
