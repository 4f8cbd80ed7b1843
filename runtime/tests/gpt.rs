//! End to end: a small GPT-like model built by hand, initialised and fed by the runtime,
//! starts at the loss of a uniform guess.

mod common;

use autopar_runtime::{Precision, RunOptions, TensorMap, init_parameters, run, synthetic_batch};
use common::*;

fn initial_loss(c: GptConfig, precision: Precision) -> Result<f64, Box<dyn std::error::Error>> {
    let g = gpt(c)?;
    autopar_ir::verify(&g)?;
    let params: TensorMap = init_parameters(&g, 0)?;
    let batch = synthetic_batch(&g, 0, 0)?;
    let out = run(
        &g,
        &params,
        &batch,
        RunOptions {
            precision,
            ..RunOptions::default()
        },
    )?;
    assert!(out.peak_bytes > 0);
    Ok(out.scalar("loss")?)
}

#[test]
fn one_layer_gpt_starts_at_the_uniform_loss() -> TestResult {
    let c = GptConfig {
        layers: 1,
        hidden: 32,
        heads: 4,
        seq: 16,
        batch: 4,
        vocab: 64,
    };
    let uniform = (c.vocab as f64).ln();
    let loss = initial_loss(c, Precision::Declared)?;
    assert!(
        (loss - uniform).abs() < 0.1,
        "loss {loss}, ln(vocab) {uniform}"
    );
    // Rounding to f32 along the way moves the loss only slightly.
    let wide = initial_loss(c, Precision::F64)?;
    assert!((loss - wide).abs() < 1e-4, "f32 {loss} vs f64 {wide}");
    Ok(())
}

#[test]
fn two_layer_gpt_forward_pass() -> TestResult {
    let c = GptConfig {
        layers: 2,
        hidden: 64,
        heads: 4,
        seq: 32,
        batch: 8,
        vocab: 256,
    };
    let loss = initial_loss(c, Precision::Declared)?;
    let uniform = (c.vocab as f64).ln();
    assert!(
        (loss - uniform).abs() < 0.1,
        "loss {loss}, ln(vocab) {uniform}"
    );
    Ok(())
}
