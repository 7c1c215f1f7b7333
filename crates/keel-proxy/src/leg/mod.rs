//! The legs: one try of a request on one endpoint, in the endpoint's protocol. HTTP/1.1
//! ([`h1`], keel's pool), HTTP/2 and h2c ([`h2`], multiplexed), and the byte tunnel of
//! upgrades and TCP listeners ([`tunnel`]).

pub(crate) mod h1;
pub(crate) mod h2;
pub(crate) mod tunnel;
