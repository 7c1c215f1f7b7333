//! The HTTP/1.1 leg: a try on a pooled connection ([`upstream`]) and the response body's
//! decoder ([`body`]). The response head's parser is the codec's (`crate::codec::response`).

pub(crate) mod body;
pub(crate) mod upstream;
