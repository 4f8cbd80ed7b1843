//! Golden tests: the text IR of each tiny zoo model is fixed in `tests/golden/*.air`.
//! Rewrite the expectations with `AUTOPAR_BLESS=1 cargo test --test golden`.

mod common;

use autopar_driver::{DumpFormat, dump, load_model};

#[test]
fn tiny_model_text_dumps_match_golden_files() {
    for model in ["mlp-tiny", "gpt-tiny", "llama-tiny", "moe-tiny"] {
        let g = load_model(model, None).unwrap();
        common::check_golden(&format!("{model}.air"), &dump(&g, DumpFormat::Text));
    }
}
