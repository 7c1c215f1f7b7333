//! Arbitrary bytes as an `endpoint-load-metrics` header: the ORCA parser must never panic,
//! nor must writing back and re-reading what it accepted.
#![no_main]

use keel_balance::OrcaReport;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = OrcaReport::parse(data) {
        let _ = OrcaReport::parse(r.to_text().as_bytes());
        let _ = OrcaReport::parse(r.to_json().as_bytes());
    }
});
