//! `autopar run --mesh pp=N` and `autopar dump --stage pipeline|schedule` end to end.

use std::process::Command;

use autopar_driver::ir::schedule::{Action, Schedule, ScheduleKind};

const SMALL: &str = "gpt:layers=4,hidden=32,heads=2,seq=8,vocab=64";

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

#[test]
fn gpt_tiny_verifies_under_1f1b() {
    let (ok, out) = autopar(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "4",
        "--schedule",
        "1f1b",
        "--verify",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("verify: max_abs_err=") && out.trim_end().ends_with("OK"),
        "{out}"
    );
}

/// f16 training keeps its loss scale in a parameter and multiplies every backward's seed by
/// it: each stage's sub-programs recompute that scale, so f16 pipelines run and verify, with
/// a skipped step (an overflowing scale) too, and a plan the search offers for the CPU
/// runtime runs.
#[test]
fn f16_pipelines_run_with_their_loss_scale() {
    for mesh in ["pp=2", "dp=2,tp=2,pp=2"] {
        let (ok, out) = autopar(&[
            "run",
            "gpt-tiny",
            "--mesh",
            mesh,
            "--micro-batches",
            "2",
            "--dtype",
            "f16",
            "--steps",
            "3",
            "--verify",
        ]);
        assert!(ok, "{mesh}: {out}");
        assert!(out.trim_end().ends_with("OK"), "{mesh}: {out}");
    }
    let overflowing = |backend: &[&str]| {
        let mut args = vec![
            "run",
            SMALL,
            "--mesh",
            "pp=2",
            "--micro-batches",
            "4",
            "--schedule",
            "interleaved",
            "--vpp",
            "2",
            "--dtype",
            "f16",
            "--loss-scale",
            "1e30",
            "--steps",
            "2",
            "--verify",
        ];
        args.extend_from_slice(backend);
        let (ok, out) = autopar(&args);
        assert!(ok, "{out}");
        assert!(
            out.contains("gradients are not finite; update skipped"),
            "{out}"
        );
        out
    };
    // Every update skipped: on the interpreter the state and losses equal the reference's
    // bit for bit; the fast backend's f16 losses differ by rounding only.
    let out = overflowing(&["--interpreter"]);
    assert!(out.contains("max_rel_err=0.000e0 OK"), "{out}");
    let out = overflowing(&[]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("verify: ") && l.ends_with(" OK")),
        "{out}"
    );

    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pipeline_f16");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let plan = dir.join("plan.json");
    let plan = plan.to_str().expect("a UTF-8 path");
    let (ok, out) = autopar(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=2",
        "--batch",
        "8",
        "--dtype",
        "f16",
        "--pin",
        "runtime=cpu,pp=2",
        "--save",
        plan,
    ]);
    assert!(ok, "{out}");
    let (ok, out) = autopar(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        plan,
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(ok, "{out}");
    assert!(out.trim_end().ends_with("OK"), "{out}");
}

#[test]
fn interleaved_verifies_and_its_trace_follows_the_schedule() {
    let dir = std::env::temp_dir().join(format!("autopar-pipe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("trace.json");
    let path_s = path.to_string_lossy().into_owned();
    let (ok, out) = autopar(&[
        "run",
        SMALL,
        "--batch",
        "4",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "4",
        "--schedule",
        "interleaved",
        "--vpp",
        "2",
        "--verify",
        "--trace",
        &path_s,
    ]);
    assert!(ok && out.contains(" OK"), "{out}");
    let text = std::fs::read_to_string(&path).expect("trace written");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("trace is JSON");
    let events = doc["traceEvents"].as_array().expect("events");
    let schedule = Schedule::new(ScheduleKind::Interleaved, 2, 2, 4).expect("schedule");
    assert_eq!(
        events.iter().filter(|e| e["ph"] == "M").count(),
        2,
        "one track per rank"
    );
    for (rank, list) in schedule.per_rank.iter().enumerate() {
        let mut slices: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == rank)
            .collect();
        assert_eq!(
            slices.len(),
            list.len(),
            "one slice per action on rank {rank}"
        );
        slices.sort_by(|a, b| {
            let key = |e: &serde_json::Value| e["ts"].as_f64().unwrap_or(0.0);
            key(a).total_cmp(&key(b))
        });
        // Compute slices appear in the schedule's order.
        let computed: Vec<String> = slices
            .iter()
            .filter(|e| e["cat"] == "forward" || e["cat"] == "backward")
            .map(|e| e["name"].as_str().unwrap_or("").to_string())
            .collect();
        let expected: Vec<String> = list
            .iter()
            .filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. }))
            .map(|a| autopar_driver::ir::trace::describe(a).0)
            .collect();
        assert_eq!(computed, expected, "rank {rank}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dumps_show_stage_costs_and_action_lists() {
    let (ok, out) = autopar(&[
        "dump",
        "gpt:layers=4,hidden=32,heads=2,seq=8,vocab=4096",
        "--batch",
        "2",
        "--mesh",
        "pp=2",
        "--stage",
        "pipeline",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("stage 1 (rank 1, chunk 0)") && out.contains("FLOPs"),
        "{out}"
    );
    assert!(out.contains("equal layer counts: starts [0, 4]"), "{out}");
    assert!(!out.contains("balanced: starts [0, 4]"), "{out}");
    let (ok, out) = autopar(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "4",
        "--stage",
        "schedule",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("rank 1 (peak in flight 1):") && out.contains("F mb0 c0"),
        "{out}"
    );
}

#[test]
fn bad_pipeline_options_are_errors() {
    let (ok, out) = autopar(&["run", "gpt-tiny", "--mesh", "pp=2", "--schedule", "zigzag"]);
    assert!(!ok && out.contains("zigzag"), "{out}");
    let (ok, out) = autopar(&[
        "run",
        SMALL,
        "--mesh",
        "pp=2",
        "--stage-boundaries",
        "h.9",
        "--micro-batches",
        "2",
    ]);
    assert!(!ok && out.contains("h.9"), "{out}");
}
