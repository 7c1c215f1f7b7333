//! placeholder: analytic
