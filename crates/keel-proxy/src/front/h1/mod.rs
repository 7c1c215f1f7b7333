//! The HTTP/1.1 front end: the connection loop ([`conn`]) and the client's body and the
//! response relay ([`relay`]).

pub(crate) mod conn;
pub(crate) mod parse;
pub(crate) mod relay;
