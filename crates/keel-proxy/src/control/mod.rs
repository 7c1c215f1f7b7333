//! The control plane: what changes the routing while the proxy runs, never on a request's
//! path. Discovery finds endpoints; reloads ([`reload`]) rebuild the routing; [`load`] reads a
//! configuration file and checks the files it names.

pub(crate) mod discovery;
pub(crate) mod load;
pub(crate) mod reload;
