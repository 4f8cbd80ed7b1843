//! Pipelines composed with data and tensor parallelism and ZeRO: `autopar run --mesh
//! dp=2,tp=2,pp=2` partitions the step over `dp` and `tp`, cuts every rank's local step into
//! pipeline stages, runs 8 CPU ranks and checks the result against one device.

use std::process::Command;

fn autopar(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .output()
        .expect("autopar runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn verifies(mesh: &str, schedule: &str, zero: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "gpt-tiny",
        "--mesh",
        mesh,
        "--micro-batches",
        "4",
        "--schedule",
        schedule,
        "--zero",
        zero,
        "--verify",
    ];
    args.extend_from_slice(extra);
    let (ok, out) = autopar(&args);
    assert!(ok, "{out}");
    assert!(
        out.contains("verify: max_abs_err=") && out.trim_end().ends_with("OK"),
        "{out}"
    );
    out
}

#[test]
fn dp_tp_pp_zero1_1f1b_verifies() {
    let out = verifies("dp=2,tp=2,pp=2", "1f1b", "1", &[]);
    assert!(
        out.contains("ranks: 8 (dp=2, tp=2, pp=2), 4 pipelines of 2 stages"),
        "{out}"
    );
}

#[test]
fn dp_tp_pp_gpipe_verifies() {
    verifies("dp=2,tp=2,pp=2", "gpipe", "1", &[]);
}

#[test]
fn dp_tp_pp_without_zero_verifies() {
    verifies("dp=2,tp=2,pp=2", "1f1b", "0", &[]);
}

#[test]
fn dp_tp_pp_interleaved_verifies() {
    verifies("dp=2,tp=2,pp=2", "interleaved", "1", &["--vpp", "2"]);
}

#[test]
fn dp_pp_several_steps_match_the_reference() {
    let out = verifies("dp=2,pp=2", "1f1b", "1", &["--steps", "3"]);
    assert!(out.contains("step 3 loss:"), "{out}");
}
