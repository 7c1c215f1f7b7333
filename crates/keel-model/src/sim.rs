//! placeholder: sim
