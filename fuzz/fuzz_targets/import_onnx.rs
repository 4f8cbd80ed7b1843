//! Feeds arbitrary bytes to the ONNX importer: it must return `Ok` or `Err` without
//! panicking, hanging or allocating without bound, and any graph it accepts must verify and
//! round-trip through the text format.

#![no_main]

use autopar_frontends::onnx::{ImportOptions, import_bytes};
use autopar_ir::text::{parse, print};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let options = ImportOptions {
        batch: Some(2),
        loss: None,
    };
    if let Ok(imported) = import_bytes(data, "fuzz.onnx", "fuzz", None, &options) {
        autopar_ir::verify(&imported.graph).expect("an imported graph verifies");
        let text = print(&imported.graph);
        match parse(&text) {
            Ok(again) => assert_eq!(print(&again), text),
            Err(e) => panic!("an imported graph does not parse back: {e}"),
        }
    }
});
