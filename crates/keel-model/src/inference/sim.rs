//! The inference pool in virtual time: engines of [`super::engine`] behind keel-balance's own balancers.
