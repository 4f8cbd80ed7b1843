//! The property each parser fuzz target checks, in one place: the targets under
//! `fuzz_targets/` feed it arbitrary bytes, and the root test `tests/parser_mutations.rs` feeds
//! it bounded, deterministic mutations in `cargo test`. Each function takes one input, which
//! the parser must answer with `Ok` or `Err` without panicking; whatever it accepts must
//! satisfy the round trip below (a failure panics). It returns whether the input was
//! accepted.

use autopar_cost_model::{Cluster, Plan};
use autopar_ir::json::{from_json, to_json};
use autopar_ir::text::{parse, print};

/// `.air` text: an accepted graph prints to text that parses and prints the same.
pub fn air(src: &str) -> bool {
    let Ok(g) = parse(src) else { return false };
    let text = print(&g);
    match parse(&text) {
        Ok(again) => assert_eq!(print(&again), text),
        Err(e) => panic!("a printed graph does not parse: {e}\n{text}"),
    }
    true
}

/// A JSON graph: an accepted graph dumps to JSON that loads back to the same graph.
pub fn json_graph(src: &str) -> bool {
    let Ok(g) = from_json(src) else { return false };
    let text = to_json(&g);
    match from_json(&text) {
        Ok(again) => assert_eq!(to_json(&again), text),
        Err(e) => panic!("a dumped graph does not load: {e}\n{text}"),
    }
    true
}

/// A plan, as a plan file's JSON and as the `key=value` text of `estimate --plan`: a plan that
/// passes `Plan::check` answers every question about itself without overflowing, and a
/// parsed text plan prints to text that parses back to it.
pub fn plan(src: &str) -> bool {
    fn exercise(p: &Plan) {
        if p.check().is_ok() {
            let _ = p.world_size();
            let _ = p.micro_batches();
            let _ = p.mesh_axes();
        }
    }
    let mut accepted = false;
    if let Ok(p) = serde_json::from_str::<Plan>(src) {
        exercise(&p);
        accepted = true;
    }
    if let Ok(p) = Plan::parse(src) {
        exercise(&p);
        let again = Plan::parse(&p.to_string()).expect("a printed plan parses");
        assert_eq!(again, p);
        accepted = true;
    }
    accepted
}

/// A cluster, as TOML and (when short) as a preset string (`dgx-h100:nodes=N`): an accepted
/// cluster answers device questions and writes TOML that reads back to it.
pub fn cluster(src: &str) -> bool {
    fn exercise(c: &Cluster) {
        let n = c.num_devices();
        for device in [0, n / 2, n.saturating_sub(1)] {
            let _ = c.node_of(device);
            let _ = c.nic_of(device);
        }
        let again = Cluster::from_toml(&c.to_toml()).expect("written TOML reads back");
        assert_eq!(&again, c);
    }
    let mut accepted = false;
    if let Ok(c) = Cluster::from_toml(src) {
        exercise(&c);
        accepted = true;
    }
    if src.len() < 256
        && let Ok(c) = Cluster::preset(src)
    {
        exercise(&c);
        accepted = true;
    }
    accepted
}
