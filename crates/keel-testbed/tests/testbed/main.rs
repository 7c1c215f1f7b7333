//! keel-testbed's integration tests over real loopback sockets, as one test binary.

mod backend;
mod capacity;
mod loadgen;
mod openloop;
