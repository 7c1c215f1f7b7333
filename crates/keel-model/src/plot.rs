//! placeholder: plot
