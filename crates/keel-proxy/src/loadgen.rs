//! placeholder: loadgen
