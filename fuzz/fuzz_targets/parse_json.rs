//! Feeds arbitrary bytes to the JSON graph loader: it must return `Ok` or `Err` without
//! panicking, and any graph it accepts must dump to JSON that loads back to the same graph.

#![no_main]

use autopar_ir::json::{from_json, to_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(g) = from_json(src) {
        let text = to_json(&g);
        match from_json(&text) {
            Ok(again) => assert_eq!(to_json(&again), text),
            Err(e) => panic!("a dumped graph does not load: {e}\n{text}"),
        }
    }
});
