//! Arbitrary bytes (read as UTF-8, invalid sequences replaced) as a proxy configuration: the
//! TOML parser, serde, the error locator and validation must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    keel_fuzz::check(&text);
});
