//! Feeds arbitrary bytes to the `.air` parser: it must return `Ok` or `Err` without
//! panicking, and any graph it accepts must print to text that parses and prints the same.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../properties.rs"]
#[allow(dead_code)]
mod properties;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        properties::air(src);
    }
});
