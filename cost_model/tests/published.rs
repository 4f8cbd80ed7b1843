//! Published training runs outside `shared/reference/`, embedded in the crate
//! (`cost_model/published/`, each file opening with its source and caveats) and read by the
//! calibration report (`calibrate::published_tables`, `autopar calibrate --published`): a
//! check that the model carries beyond the tables it is calibrated on.
//!
//! - Llama 3 405B on 8,192 and 16,384 H100s (the Llama 3 paper's Table 4, model TFLOP/s per
//!   GPU), under Megatron-Core's profile with four virtual stages and one recomputed layer
//!   per chunk (assumed): +3%, -1% and -6%; held within 8%.
//! - NeMo 24.07's fp8 pretraining table on DGX H100 (twelve runs with their whole layout):
//!   the model's step is 1-16% short on every run, 10% in the median (13% before Hopper's
//!   own sustained GEMM share, `cluster::HOPPER_700W_SUSTAINED`). The bounds (median within
//!   12%, each run within 18%) hold that bias so that it cannot grow unnoticed; charging
//!   every fp8 GEMM for casting both its operands, as the model did before, put these runs
//!   24% too slow in the median and the large-tensor-parallel ones 60-100%.
//! - Megatron-Core r0.8's GPT-3 177B at 47% MFU on 96 H100s (its README's strong scaling;
//!   tp=8, pp=6 leave 576 micro-batches, almost no bubble): predicted 14% short, the same
//!   bias; held within 16%.
//! - Megatron-Bridge's fp8 (current scaling) Llama 3 and 3.1 runs on DGX H100 (releases
//!   25.11 and 26.04.01, 8 to 1,024 GPUs, Megatron FSDP and the distributed optimizer, fp8
//!   weights): 5% in the median, the 405B at 512 sequences 11% short; held within 7% in the
//!   median and 13% each. Every run fits the 80 GB, as measured: the interleaved warm-up
//!   holds each chunk at its own size and fp8 GEMM inputs are kept a byte each.

use autopar_cost_model::calibrate;
use autopar_cost_model::calibrate::{CalibrationReport, TableReport, published_tables};

fn report() -> CalibrationReport {
    let r = calibrate(&published_tables());
    println!("{}", r.render(true));
    r
}

fn table<'a>(r: &'a CalibrationReport, name: &str) -> &'a TableReport {
    let t = r
        .tables
        .iter()
        .find(|t| t.table == name)
        .unwrap_or_else(|| panic!("no table {name}"));
    assert!(t.skipped.is_empty(), "{name}: {:?}", t.skipped);
    t
}

/// The largest `|error|` of a table's rows.
fn worst(t: &TableReport) -> f64 {
    t.rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max)
}

#[test]
fn llama3_405b_on_h100s_within_8_percent() {
    let r = report();
    let t = table(&r, "llama3_405b_h100");
    assert_eq!(t.rows.len(), 3);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
    assert!(worst(t) < 0.08, "{}", worst(t));
}

#[test]
fn nemo_24_07_fp8_pretraining_on_h100s_holds_its_bias() {
    let r = report();
    let t = table(&r, "nemo_24_07_fp8_h100");
    assert_eq!(t.rows.len(), 12);
    assert!(worst(t) < 0.18, "{}", worst(t));
    let median = t.summary.median_abs_error.unwrap_or(f64::INFINITY);
    assert!(median < 0.12, "{median}");
}

#[test]
fn megatron_core_177b_on_96_h100s_holds_its_bias() {
    let r = report();
    let t = table(&r, "megatron_core_strong_scaling_h100");
    assert_eq!(t.rows.len(), 1);
    assert!(t.rows[0].fits, "{:?}", t.rows[0]);
    assert!(worst(t) < 0.16, "{}", worst(t));
}

#[test]
fn megatron_bridge_fp8_llama_on_h100s_within_7_percent() {
    let r = report();
    let t = table(&r, "megatron_bridge_fp8_h100");
    assert_eq!(t.rows.len(), 5);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
    assert!(worst(t) < 0.13, "{}", worst(t));
    let median = t.summary.median_abs_error.unwrap_or(f64::INFINITY);
    assert!(median < 0.07, "{median}");
}
