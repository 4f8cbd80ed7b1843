//! Feeds arbitrary bytes to the JSON graph loader: it must return `Ok` or `Err` without
//! panicking, and any graph it accepts must dump to JSON that loads back to the same graph.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../properties.rs"]
#[allow(dead_code)]
mod properties;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        properties::json_graph(src);
    }
});
