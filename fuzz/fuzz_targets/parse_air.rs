//! Feeds arbitrary bytes to the `.air` parser: it must return `Ok` or `Err` without
//! panicking, and any graph it accepts must print to text that parses and prints the same.

#![no_main]

use autopar_ir::text::{parse, print};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(g) = parse(src) {
        let text = print(&g);
        match parse(&text) {
            Ok(again) => assert_eq!(print(&again), text),
            Err(e) => panic!("a printed graph does not parse: {e}\n{text}"),
        }
    }
});
