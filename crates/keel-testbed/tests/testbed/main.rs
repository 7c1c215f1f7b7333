//! keel-testbed's integration tests over real loopback sockets, as one test binary.

mod backend;
mod capacity;
mod llm;
mod loadgen;
mod openloop;
