//! Structured-but-random configurations: real option names with values of the right type
//! (around every bound) and of wrong types, so that inputs get past the TOML parser and serde
//! into `validate` and the balancer builder; accepted configurations must really build.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(doc) = keel_fuzz::Doc::from_bytes(data) {
        keel_fuzz::check(&doc.render());
    }
});
