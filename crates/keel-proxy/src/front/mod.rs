//! The front ends: they parse what clients send and render the answer; they never pick,
//! retry or map errors (the driver does). HTTP/1.1 ([`h1`], keel's codec), HTTP/2 ([`h2`],
//! hyper's), HTTP/3 ([`h3`], hyperium's h3 over quinn) and TCP ([`tcp`]); [`stream`]
//! handles a request once for HTTP/2 and HTTP/3.

pub(crate) mod h1;
pub(crate) mod h2;
pub(crate) mod h3;
pub(crate) mod stream;
pub(crate) mod tcp;
