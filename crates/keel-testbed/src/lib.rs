//! # keel-testbed
//!
//! What keel's experiments run against, kept out of the proxy's library: an HTTP/1.1
//! [`backend`] whose faults can be switched while it runs, and a bounded [`loadgen`] that makes a
//! fixed number of requests (through a proxy, or with a client-side balancer) and reports what it
//! measured, and an [`openloop`] generator of Poisson arrivals; [`etcd`] runs a real etcd cluster
//! on loopback; [`llm`] is a fake vLLM server (keel-model's inference engine behind vLLM's
//! OpenAI-compatible API). The `keel` binary uses them for
//! `keel backend` and `keel lab`; keel-proxy's tests
//! use them as a dev-dependency.

#![warn(missing_docs)]

pub mod backend;
pub mod etcd;
pub mod llm;
pub mod loadgen;
pub mod openloop;
pub mod timer;
