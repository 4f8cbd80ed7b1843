//! `autopar run` and `autopar dump --stage train` end to end, through the built binary.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn autopar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The losses of `step <i> loss: <value>` lines (checking the numbering) and the peak.
fn parse_run(text: &str) -> (Vec<f64>, u64) {
    let lines: Vec<&str> = text.lines().collect();
    let (last, steps) = lines.split_last().unwrap();
    let losses = steps
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let rest = line
                .strip_prefix(&format!("step {} loss: ", i + 1))
                .unwrap_or_else(|| panic!("unexpected line `{line}`"));
            rest.parse().unwrap()
        })
        .collect();
    let peak = last
        .strip_prefix("peak memory: ")
        .and_then(|rest| rest.strip_suffix(')'))
        .and_then(|rest| rest.split(" bytes (").next())
        .unwrap_or_else(|| panic!("unexpected last line `{last}`"))
        .parse()
        .unwrap();
    (losses, peak)
}

#[test]
fn run_prints_each_step_and_the_peak() {
    let (losses, peak) = parse_run(&stdout(&autopar(&["run", "gpt-tiny", "--steps", "3"])));
    assert_eq!(losses.len(), 3);
    assert!((losses[0] - 256f64.ln()).abs() < 0.1, "{losses:?}");
    assert!(losses[2] < losses[0], "{losses:?}");
    assert!(peak > 0);
}

#[test]
fn run_options_shape_the_step() {
    let base = parse_run(&stdout(&autopar(&[
        "run", "gpt-tiny", "--steps", "2", "--batch", "4",
    ])));
    let full = parse_run(&stdout(&autopar(&[
        "run",
        "gpt-tiny",
        "--steps",
        "2",
        "--batch",
        "4",
        "--recompute",
        "full",
    ])));
    assert_eq!(base.0, full.0);
    assert!(full.1 < base.1);
    let accumulated = parse_run(&stdout(&autopar(&[
        "run",
        "gpt-tiny",
        "--steps",
        "2",
        "--batch",
        "4",
        "--micro-batches",
        "2",
    ])));
    for (a, b) in base.0.iter().zip(&accumulated.0) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    for extra in [
        &["--dtype", "bf16"][..],
        &["--dtype", "f16", "--loss-scale", "1024"],
        &["--optimizer", "sgd", "--lr", "0.05", "--clip-norm", "0"],
    ] {
        let mut args = vec!["run", "mlp-tiny", "--steps", "2"];
        args.extend_from_slice(extra);
        let (losses, _) = parse_run(&stdout(&autopar(&args)));
        assert_eq!(losses.len(), 2, "{extra:?}");
    }
    // The MLP has no attention core: recompute refuses it rather than doing nothing.
    let out = autopar(&[
        "run",
        "mlp-tiny",
        "--steps",
        "2",
        "--recompute",
        "selective",
    ]);
    assert!(!out.status.success());
}

#[test]
fn run_forward_still_prints_the_loss() {
    let text = stdout(&autopar(&["run", "gpt-tiny", "--forward"]));
    let loss: f64 = text.trim().strip_prefix("loss: ").unwrap().parse().unwrap();
    assert!((loss - 256f64.ln()).abs() < 0.1);
}

#[test]
fn bad_training_options_fail_with_a_message() {
    for (args, message) in [
        (
            &["run", "gpt-tiny", "--micro-batches", "3"][..],
            "must divide the batch size 8",
        ),
        (&["run", "gpt-tiny", "--lr=-1"], "--lr"),
        (
            &["run", "gpt-tiny", "--forward", "--steps", "2"],
            "cannot be used with",
        ),
    ] {
        let out = autopar(args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

#[test]
fn dump_train_stage_reads_back() {
    let text = stdout(&autopar(&[
        "dump",
        "gpt-tiny",
        "--stage",
        "train",
        "--micro-batches",
        "2",
    ]));
    let g = autopar_driver::ir::text::parse(&text).unwrap();
    assert!(g.output("loss").is_some() && g.output("wte").is_some());
    assert!(text.contains("scope=\"mb1/grad/h.0.attn\""));
    assert!(text.contains("adamw_update"));
    let forward = stdout(&autopar(&["dump", "gpt-tiny", "--stage", "forward"]));
    assert!(!forward.contains("adamw_update"));
    let json = stdout(&autopar(&[
        "dump",
        "mlp-tiny",
        "--stage",
        "train",
        "--format",
        "json",
        "--optimizer",
        "sgd",
    ]));
    assert!(json.contains("sgd_update"));
}

#[test]
fn help_describes_every_training_option() {
    let help = stdout(&autopar(&["run", "--help"]));
    for option in [
        "--steps",
        "--optimizer",
        "--lr",
        "--dtype",
        "--micro-batches",
        "--recompute",
        "--batch",
        "--seed",
        "--clip-norm",
        "--loss-scale",
        "--forward",
    ] {
        assert!(help.contains(option), "`run --help` lacks {option}");
    }
    let help = stdout(&autopar(&["dump", "--help"]));
    assert!(help.contains("--stage") && help.contains("--recompute"));
}
