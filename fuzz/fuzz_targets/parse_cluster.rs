//! Feeds arbitrary bytes to the cluster readers, TOML descriptions and preset strings
//! (`dgx-h100:nodes=N`): each must return `Ok` or `Err` without panicking, and an accepted
//! cluster must write TOML that reads back to it and answer device questions.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../properties.rs"]
#[allow(dead_code)]
mod properties;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        properties::cluster(src);
    }
});
