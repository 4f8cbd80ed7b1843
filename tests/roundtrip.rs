//! Round-trip properties over the whole zoo: text and JSON dumps parse back to equal graphs
//! that print identically, and every model verifies.

use autopar_driver::frontends::zoo::{self, EntryKind};
use autopar_driver::ir::{json, text, verify};

#[test]
fn every_zoo_model_round_trips_through_text_and_json() {
    for entry in zoo::entries()
        .into_iter()
        .filter(|e| e.kind == EntryKind::Preset)
    {
        for batch in [1, 3] {
            let g = zoo::build(entry.name, batch).unwrap();
            verify(&g).unwrap();
            let printed = text::print(&g);
            let parsed = text::parse(&printed).unwrap_or_else(|e| panic!("{}: {e}", entry.name));
            assert_eq!(
                parsed, g,
                "{}: text round trip changes the graph",
                entry.name
            );
            assert_eq!(text::print(&parsed), printed, "{}", entry.name);
            let from_json = json::from_json(&json::to_json(&g)).unwrap();
            assert_eq!(
                from_json, g,
                "{}: JSON round trip changes the graph",
                entry.name
            );
        }
    }
}

#[test]
fn generic_specs_round_trip() {
    for spec in [
        "gpt:layers=3,hidden=48,heads=6,seq=20,vocab=100",
        "llama:layers=2,hidden=64,heads=8,kv_heads=2,ffn=96,seq=16,vocab=50,rope_base=500000",
        "moe:layers=2,hidden=32,heads=4,seq=8,vocab=40,experts=8,top_k=2,ffn=48,style=llama",
        "mlp:in=8,hidden=16,out=4",
    ] {
        let g = zoo::build(spec, 2).unwrap();
        let printed = text::print(&g);
        assert_eq!(text::parse(&printed).unwrap(), g, "{spec}");
    }
}
