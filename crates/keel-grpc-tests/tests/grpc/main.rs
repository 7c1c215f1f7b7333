//! keel-proxy with real gRPC peers, as one test binary (one build and link of keel-proxy's
//! generic code instead of one per file): `calls`, tonic clients and servers through keel;
//! `otlp`, keel's spans exported to a real OTLP/gRPC collector.

mod calls;
mod otlp;
