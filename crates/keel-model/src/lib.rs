//! # keel-model
//!
//! The reliability model of `shared/RELIABILITY-MODEL.md`: closed forms ([`analytic`]), a
//! discrete-event simulator on a virtual clock that drives keel-balance's own balancers
//! ([`sim`]), and SVG charts ([`plot`]).

pub mod analytic;
pub mod plot;
pub mod presets;
pub mod sim;
