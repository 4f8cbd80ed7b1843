//! Differential tests of parallelised forward passes: every partitioned program, run on CPU
//! ranks, against the single-device reference.

use autopar::ir::DeviceMesh;
use autopar::passes::parallelize::ParallelOptions;
use autopar::spmd;

fn check(model: &str, mesh: &str, zero: u8) {
    let g = autopar::load_model(model, None).expect("ok");
    let mesh = DeviceMesh::parse(mesh).expect("ok");
    let options = ParallelOptions {
        zero,
        ..ParallelOptions::default()
    };
    let program = spmd::compile(&g, &mesh, &options).expect("ok");
    let summary = spmd::run(&program, 0, 1, Some(spmd::VERIFY_TOLERANCE), |_, _| {}).expect("ok");
    let report = summary.verify.expect("ok");
    assert!(report.ok(), "{model} on {mesh}: {}", report.line());
}

#[test]
fn mlp_tiny_forward() {
    check("mlp-tiny", "dp=2,tp=2", 0);
}

#[test]
fn gpt_tiny_forward() {
    check("gpt-tiny", "dp=2,tp=2", 0);
}

#[test]
fn llama_tiny_forward() {
    check("llama-tiny", "tp=2", 0);
}

#[test]
fn moe_tiny_forward() {
    check("moe-tiny", "dp=2,tp=2", 0);
}

#[test]
fn gpt_tiny_forward_zero3() {
    check("gpt-tiny", "dp=2,tp=2", 3);
}
