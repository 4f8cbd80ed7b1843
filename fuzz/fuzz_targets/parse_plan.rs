//! Feeds arbitrary bytes to both plan readers, a plan file's JSON and the `key=value` text of
//! `estimate --plan`: each must return `Ok` or `Err` without panicking, a plan that passes
//! `Plan::check` must answer every question about itself without overflowing, and a parsed
//! text plan must print to text that parses back to it.

#![no_main]

use autopar_cost_model::Plan;
use libfuzzer_sys::fuzz_target;

fn exercise(p: &Plan) {
    if p.check().is_ok() {
        let _ = p.world_size();
        let _ = p.micro_batches();
        let _ = p.mesh_axes();
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(p) = serde_json::from_str::<Plan>(src) {
        exercise(&p);
    }
    if let Ok(p) = Plan::parse(src) {
        exercise(&p);
        let again = Plan::parse(&p.to_string()).expect("a printed plan parses");
        assert_eq!(again, p);
    }
});
