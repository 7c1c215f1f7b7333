//! # keel-proxy
//!
//! The network driver of keel-balance: an HTTP reverse proxy, plus the experiment backend and a
//! load generator used by tests and the lab.

pub mod backend;
pub mod loadgen;
