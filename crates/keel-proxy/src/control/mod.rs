//! The control plane: what changes the routing while the proxy runs, never on a request's
//! path. Discovery finds endpoints; reloads ([`reload`]) rebuild the routing.

pub(crate) mod discovery;
pub(crate) mod reload;
