//! Feeds arbitrary bytes to both plan readers, a plan file's JSON and the `key=value` text of
//! `estimate --plan`: each must return `Ok` or `Err` without panicking, a plan that passes
//! `Plan::check` must answer every question about itself without overflowing, and a parsed
//! text plan must print to text that parses back to it.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../properties.rs"]
#[allow(dead_code)]
mod properties;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        properties::plan(src);
    }
});
