//! Differential tests of parallelised training steps (forward, backward and optimizer) on
//! CPU ranks against the single-device reference: the loss of every step and every updated
//! weight and optimizer state, gathered to its global shape.

use autopar_driver::{CompileOptions, RunOptions, compile, run};

fn check(model: &str, mesh: &str, zero: u8) {
    let mut options = CompileOptions::new(model).on_mesh(mesh).expect("ok");
    options.parallel.zero = zero;
    let step = compile(&options).expect("ok");
    let three = RunOptions {
        steps: 3,
        verify: true,
        ..RunOptions::default()
    };
    let report = run(&step, &three, |_| {}).expect("ok").verify.expect("ok");
    eprintln!(
        "{model} {mesh} zero={zero}: {} worst {}",
        report.line(),
        report.worst
    );
    assert!(
        report.ok(),
        "{model} on {mesh}, ZeRO-{zero}: {}",
        report.line()
    );
}

#[test]
fn gpt_tiny_dp2_tp2() {
    check("gpt-tiny", "dp=2,tp=2", 0);
}

#[test]
fn mlp_tiny_dp2_tp2() {
    check("mlp-tiny", "dp=2,tp=2", 0);
}

#[test]
fn llama_tiny_tp2() {
    check("llama-tiny", "tp=2", 0);
}

#[test]
fn moe_tiny_dp2_tp2() {
    check("moe-tiny", "dp=2,tp=2", 0);
}

#[test]
fn gpt_tiny_dp4() {
    check("gpt-tiny", "dp=4", 0);
}

#[test]
fn gpt_tiny_tp4() {
    check("gpt-tiny", "tp=4", 0);
}

#[test]
fn gpt_tiny_dp2_tp4() {
    check("gpt-tiny", "dp=2,tp=4", 0);
}

#[test]
fn gpt_tiny_zero1() {
    check("gpt-tiny", "dp=2,tp=2", 1);
}

#[test]
fn gpt_tiny_zero2() {
    check("gpt-tiny", "dp=2,tp=2", 2);
}

#[test]
fn gpt_tiny_zero3() {
    check("gpt-tiny", "dp=2,tp=2", 3);
}
