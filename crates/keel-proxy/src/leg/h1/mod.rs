//! The HTTP/1.1 leg: a try on a pooled connection ([`upstream`]), the response head's
//! parser ([`response`]) and the body's decoder ([`body`]).

pub(crate) mod body;
pub(crate) mod response;
pub(crate) mod upstream;
