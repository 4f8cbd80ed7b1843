//! Helpers shared by the end-to-end tests: running the built `autopar` binary and comparing
//! output with golden files.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// GPT-3 175B's plan on 1024 A100s as Megatron-LM's configuration lays it out.
pub const GPT3_PLAN: &str = "dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,schedule=interleaved";

/// `estimate`'s (and `report`'s) arguments for GPT-3 175B on 1024 A100s at Megatron-LM's
/// global batch, under [`GPT3_PLAN`]; the plan is the last argument.
pub const GPT3: [&str; 7] = [
    "gpt3-175b",
    "--cluster",
    "dgx-a100:nodes=128",
    "--batch",
    "1536",
    "--plan",
    GPT3_PLAN,
];

/// Runs the `autopar` binary with `args`.
pub fn autopar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .output()
        .expect("the autopar binary runs")
}

/// Runs `autopar` and returns its stdout, asserting success.
pub fn autopar_ok(args: &[&str]) -> String {
    let out = autopar(args);
    assert!(
        out.status.success(),
        "autopar {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("stdout is UTF-8")
}

/// Runs `autopar`, asserts it fails, and returns its stderr.
pub fn autopar_err(args: &[&str]) -> String {
    let out = autopar(args);
    assert!(
        !out.status.success(),
        "autopar {args:?} unexpectedly succeeded"
    );
    assert!(out.stdout.is_empty(), "a failing command printed to stdout");
    String::from_utf8(out.stderr).expect("stderr is UTF-8")
}

/// A fresh scratch directory under the target directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Writes `plan` (plan text, as `estimate --plan` takes it) as the JSON plan file
/// `<scratch name>/plan.json` that `run --plan-file` reads, and returns its path.
pub fn plan_file(name: &str, plan: &str) -> String {
    let plan = autopar_driver::cost_model::Plan::parse(plan).expect("a plan");
    let file = scratch(name).join("plan.json");
    std::fs::write(&file, serde_json::to_string(&plan).expect("JSON")).expect("write");
    file.to_str().expect("UTF-8 path").to_string()
}

/// Compares `actual` with the golden file `tests/golden/<name>`. With `AUTOPAR_BLESS=1` (and not
/// under CI) the file is rewritten instead; on a mismatch the failure shows a line diff.
pub fn check_golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let bless = std::env::var("AUTOPAR_BLESS").is_ok_and(|v| v == "1")
        && !std::env::var("CI").is_ok_and(|v| v == "true");
    if bless {
        std::fs::write(&path, actual).expect("write golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing golden file {}; run with AUTOPAR_BLESS=1",
            path.display()
        )
    });
    if expected != actual {
        panic!(
            "{} differs from the golden file (rerun with AUTOPAR_BLESS=1 to accept):\n{}",
            path.display(),
            line_diff(&expected, actual)
        );
    }
}

/// A small unified-style diff: the first differing region with some context.
fn line_diff(expected: &str, actual: &str) -> String {
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    let first = e
        .iter()
        .zip(&a)
        .position(|(x, y)| x != y)
        .unwrap_or(e.len().min(a.len()));
    let (mut ee, mut aa) = (e.len(), a.len());
    while ee > first && aa > first && e[ee - 1] == a[aa - 1] {
        ee -= 1;
        aa -= 1;
    }
    let ctx = first.saturating_sub(3);
    let mut out = format!("@@ line {} @@\n", first + 1);
    for l in &e[ctx..first] {
        out += &format!("  {l}\n");
    }
    for l in &e[first..ee] {
        out += &format!("- {l}\n");
    }
    for l in &a[first..aa] {
        out += &format!("+ {l}\n");
    }
    out
}

/// The collectives of a partitioned dump: `(op, axes, scope)` per collective, in order.
pub fn collectives(dump: &str) -> Vec<(String, String, String)> {
    let ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"];
    dump.lines()
        .filter_map(|line| {
            let rhs = line.split_once(" = ")?.1;
            let op = ops.iter().find(|op| rhs.starts_with(&format!("{op} ")))?;
            let axes = rhs.split("axes=[").nth(1)?.split(']').next()?.to_string();
            let scope = line
                .split("scope=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .unwrap_or("")
                .to_string();
            Some((op.to_string(), axes, scope))
        })
        .collect()
}
