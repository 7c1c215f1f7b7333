//! The HTTP/1.1 leg: a try on a pooled connection ([`upstream`]) and the response head's
//! parser ([`response`]).

pub(crate) mod response;
pub(crate) mod upstream;
