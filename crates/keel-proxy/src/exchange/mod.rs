//! The vocabulary the front ends, the driver and the legs share: the request as parsed
//! ([`request`]), the response's headers as edited on the way ([`response`]), how a try
//! failed ([`error`]), gRPC's status codes ([`grpc`]), the W3C trace context ([`trace`]). An endpoint's pushback (`Retry-After`)
//! is read by the codec (`crate::codec::pushback`). Nothing here does I/O or knows a
//! connection.

pub(crate) mod error;
pub(crate) mod grpc;
pub(crate) mod head;
pub(crate) mod request;
pub(crate) mod response;
pub(crate) mod rewrite;
pub(crate) mod trace;
pub(crate) mod tries;
