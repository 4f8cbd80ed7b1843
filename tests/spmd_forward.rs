//! Differential tests of parallelised forward passes: every partitioned program, run on CPU
//! ranks, against the single-device reference.

use autopar_driver::{CompileOptions, RunOptions, compile, run};

fn check(model: &str, mesh: &str, zero: u8) {
    let mut options = CompileOptions::new(model).on_mesh(mesh).expect("ok");
    options.forward_only = true;
    options.parallel.zero = zero;
    let step = compile(&options).expect("ok");
    let verify = RunOptions {
        verify: true,
        ..RunOptions::default()
    };
    let report = run(&step, &verify, |_| {}).expect("ok").verify.expect("ok");
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
