//! The driver seen from the command line: `--timings` lists every pass that ran,
//! `--dump-after` writes a pass's graphs as text IR that parses back, and `--verify` fails
//! on a run whose values are not finite instead of calling it exact.

mod common;

use common::{autopar, autopar_err, autopar_ok, scratch};

#[test]
fn timings_list_every_pass_in_order() {
    let out = autopar_ok(&["run", "gpt-tiny", "--mesh", "dp=2,tp=2", "--timings"]);
    let passes: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("pass "))
        .skip(1)
        .take_while(|l| !l.starts_with("total"))
        .map(|l| l.split_whitespace().next().expect("a pass name"))
        .collect();
    assert_eq!(
        passes,
        [
            "model",
            "train-step",
            "parallelize",
            "partition",
            "memory-plan"
        ],
        "{out}"
    );
    // A pipeline with context parallelism runs every pass.
    let out = autopar_ok(&[
        "run",
        "llama-tiny",
        "--mesh",
        "cp=2,pp=2",
        "--micro-batches",
        "2",
        "--timings",
    ]);
    for pass in ["sequence-layout", "pipeline-split"] {
        assert!(out.lines().any(|l| l.starts_with(pass)), "{out}");
    }
}

#[test]
fn dump_after_partition_writes_every_rank_program() {
    let dir = scratch("dump-after-partition");
    let dir_text = dir.to_str().expect("a UTF-8 path");
    autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--dump-after",
        "partition",
        "--dump-dir",
        dir_text,
    ]);
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("the dump directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    files.sort();
    assert_eq!(
        files,
        (0..4)
            .map(|r| format!("partition.rank{r}.air"))
            .collect::<Vec<_>>()
    );
    // Each file is a rank's program: it parses back and prints identically, collectives
    // included.
    let text = std::fs::read_to_string(dir.join("partition.rank3.air")).expect("rank 3");
    let g = autopar_driver::ir::text::parse(&text).expect("parses");
    assert_eq!(autopar_driver::ir::text::print(&g), text);
    assert!(
        text.contains("all_reduce"),
        "no collective in rank 3's program"
    );

    let err = autopar_err(&["run", "gpt-tiny", "--dump-after", "optimise"]);
    assert!(
        err.contains("unknown pass `optimise`") && err.contains("partition"),
        "{err}"
    );
}

#[test]
fn verify_fails_when_the_loss_is_nan() {
    // A learning rate of 1e30 makes every weight NaN after the first update.
    let out = autopar(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "2",
        "--lr",
        "1e30",
        "--steps",
        "3",
        "--verify",
    ]);
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("verify: "))
        .expect("a verify line");
    assert!(
        line.contains("FAILED") && line.contains("non-finite"),
        "{line}"
    );
    assert!(!line.contains("max_abs_err=0.000e0"), "{line}");
    // The same on an SPMD mesh.
    let out = autopar(&[
        "run", "gpt-tiny", "--mesh", "dp=2", "--lr", "1e30", "--steps", "2", "--verify",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAILED (non-finite"));
}

/// Bad requests the driver refuses before anything runs, naming what is wrong.
#[test]
fn meshes_annotations_steps_and_outputs_are_checked_before_the_run() {
    for mesh in ["foo=2", "DP=2", "dp=2,xp=1"] {
        let err = autopar_err(&["run", "gpt-tiny", "--mesh", mesh]);
        assert!(
            err.contains("is not a mesh axis the compiler uses (dp, tp, pp, cp, ep)"),
            "{mesh}: {err}"
        );
    }
    let dir = scratch("driver-checks");
    let annotations = dir.join("cp.txt");
    std::fs::write(&annotations, "h.0.mlp.w1: cp=S(1)\n").expect("written");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--annotate",
        annotations.to_str().expect("UTF-8"),
    ]);
    assert!(
        err.contains("line 1") && err.contains("`h.0.mlp.w1`") && err.contains("`cp`"),
        "{err}"
    );
    // `plan --annotate` reads weights by their role in the model: a name the model does not
    // have is an error, not an annotation that silently constrains nothing.
    let unknown = dir.join("unknown.txt");
    std::fs::write(&unknown, "h.9.mlp.w1: tp=S(1)\n").expect("written");
    let err = autopar_err(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--annotate",
        unknown.to_str().expect("UTF-8"),
    ]);
    assert!(
        err.contains(":1: `h.9.mlp.w1` is neither a parameter nor an input of"),
        "{err}"
    );
    let err = autopar_err(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--stage",
        "partitioned",
        "--rank",
        "5",
    ]);
    assert!(
        err.contains("--rank 5") && err.contains("has 2 ranks"),
        "{err}"
    );
    let err = autopar_err(&[
        "run", "gpt-tiny", "--mesh", "dp=2", "--steps", "0", "--verify",
    ]);
    assert!(err.contains("--steps 0"), "{err}");
    // An unwritable trace is an error before the training (nothing is printed).
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--trace",
        "/nonexistent-dir/step.json",
    ]);
    assert!(err.contains("/nonexistent-dir/step.json"), "{err}");
}

/// `autopar run ... | head` stops training when the reader goes away.
#[test]
fn a_closed_pipe_stops_the_training() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(["run", "gpt-tiny", "--steps", "1000000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("autopar starts");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("a pipe"))
        .read_line(&mut first)
        .expect("a line");
    assert!(first.starts_with("step 1 loss: "), "{first}");
    // The reader is gone: the next line written ends the program.
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("waits") {
            assert!(status.success(), "{status}");
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("autopar kept training after its reader went away");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `run` and `dump` spell dtypes as `plan` and `estimate` do too (`fp16`, `fp32`).
#[test]
fn dtypes_are_spelled_alike_everywhere() {
    for (a, b) in [("f32", "fp32"), ("f16", "fp16")] {
        let one = autopar_ok(&["dump", "gpt-tiny", "--stage", "train", "--dtype", a]);
        let other = autopar_ok(&["dump", "gpt-tiny", "--stage", "train", "--dtype", b]);
        assert_eq!(one, other, "--dtype {a} and --dtype {b}");
    }
}

/// A plan file runs as written or not at all: fields that would make it run as another plan
/// are refused by name, and so are flags the plan overrides.
#[test]
fn plan_files_run_as_written_or_not_at_all() {
    let good = common::plan_file("plan-ok", "dp=2,tp=2,mbs=2,gbs=8,dtype=f32");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&good).expect("a plan file")).expect("JSON");
    let dir = scratch("plan-files-checked");
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("dp0", serde_json::json!({"dp": 0}), "`dp` is 0"),
        ("tp0", serde_json::json!({"tp": 0}), "`tp` is 0"),
        (
            "mbs0",
            serde_json::json!({"micro_batch_size": 0}),
            "`micro_batch_size` is 0",
        ),
        (
            "mbs3",
            serde_json::json!({"micro_batch_size": 3}),
            "not a whole number of micro-batches",
        ),
        (
            "order",
            serde_json::json!({"axis_order": ["pp", "dp", "ep", "cp", "xp"]}),
            "`xp`",
        ),
    ];
    for (name, patch, want) in cases {
        let mut plan = base.clone();
        for (k, v) in patch.as_object().expect("an object") {
            plan[k] = v.clone();
        }
        let file = dir.join(format!("{name}.json"));
        std::fs::write(&file, plan.to_string()).expect("written");
        let err = autopar_err(&[
            "run",
            "gpt-tiny",
            "--plan-file",
            file.to_str().expect("UTF-8"),
        ]);
        assert!(err.contains(want), "{name}: {err}");
    }
    // Leaving `tp` (degree 2) out of the order would drop it.
    let mut plan = base.clone();
    plan["axis_order"] = serde_json::json!(["pp", "dp", "ep", "cp"]);
    let file = dir.join("order-without-tp.json");
    std::fs::write(&file, plan.to_string()).expect("written");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        file.to_str().expect("UTF-8"),
    ]);
    assert!(err.contains("leaves out `tp`"), "{err}");
    // Flags the plan overrides.
    let err = autopar_err(&["run", "gpt-tiny", "--plan-file", &good, "--dtype", "bf16"]);
    assert!(err.contains("--dtype"), "{err}");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        &good,
        "--micro-batches",
        "2",
    ]);
    assert!(err.contains("--micro-batches"), "{err}");
    // The plan as written runs.
    let out = autopar_ok(&["run", "gpt-tiny", "--plan-file", &good, "--verify"]);
    assert!(out.contains(" OK"), "{out}");
}
