//! `autopar run --checkpoint/--resume/--init-from` and `autopar checkpoint` end to end: a
//! crash during a save, damaged shards, Hugging Face weights in and out.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{autopar, autopar_err, autopar_ok, scratch};

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// The `step N loss: X` values of a run's output.
fn losses(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.to_string())
        .collect()
}

fn fixture(model: &str, file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(model)
        .join(file)
}

#[test]
fn a_crash_during_a_save_leaves_the_previous_checkpoint() {
    let dir = scratch("ckpt-crash");
    let root = dir.join("ckpt");
    let run = |root: &Path| -> Vec<String> {
        let root = s(root).to_string();
        [
            "run",
            "gpt-tiny",
            "--mesh",
            "dp=2",
            "--steps",
            "4",
            "--save-every",
            "2",
        ]
        .into_iter()
        .map(str::to_string)
        .chain(["--checkpoint".to_string(), root])
        .collect()
    };
    let other = run(&dir.join("other"));
    let uninterrupted = autopar_ok(&other.iter().map(String::as_str).collect::<Vec<_>>());
    let args = run(&root);
    // The save after step 4 dies after its first shard file.
    let out = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .env("AUTOPAR_FAULT_SAVE", "4")
        .output()
        .expect("runs");
    assert!(!out.status.success(), "the process was to die in the save");
    let mut entries: Vec<String> = std::fs::read_dir(&root)
        .expect("the root exists")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert!(entries[0].starts_with(".tmp-step-00000004"), "{entries:?}");
    assert_eq!(entries[1], "step-00000002");
    // The root resolves to step 2, which resumes to the uninterrupted run's losses.
    let inspect = autopar_ok(&["checkpoint", "inspect", s(&root)]);
    assert!(inspect.contains("step: 2 "), "{inspect}");
    let resumed = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--steps",
        "4",
        "--resume",
        s(&root),
        "--checkpoint",
        s(&root),
    ]);
    assert_eq!(losses(&resumed), losses(&uninterrupted)[2..]);
    // That save cleaned up the crashed one.
    assert!(root.join("step-00000004/index.json").is_file());
    assert!(std::fs::read_dir(&root).expect("root").all(|e| {
        !e.expect("entry")
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp")
    }));
}

/// A fresh checkpoint of gpt-tiny on `dp=2,tp=2` under `dir/name`, with its rank-0 file's
/// first tensor name.
fn checkpoint_to_damage(dir: &Path, name: &str) -> PathBuf {
    let root = dir.join(name);
    autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "1",
        "--checkpoint",
        s(&root),
    ]);
    root.join("step-00000001")
}

fn resume_err(ckpt: &Path) -> String {
    autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "2",
        "--resume",
        s(ckpt),
    ])
}

#[test]
fn damaged_shards_are_named_with_their_tensor_and_nothing_runs() {
    let dir = scratch("ckpt-damage");
    // Truncated: the first tensor past the cut is named.
    let ckpt = checkpoint_to_damage(&dir, "truncated");
    let file = ckpt.join("rank-00001.safetensors");
    let bytes = std::fs::read(&file).expect("shard");
    std::fs::write(&file, &bytes[..bytes.len() / 2]).expect("truncate");
    let err = resume_err(&ckpt);
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    assert!(err.contains("is cut off") && err.contains('`'), "{err}");

    // One flipped byte in the data: the tensor whose bytes it is in.
    let ckpt = checkpoint_to_damage(&dir, "flipped");
    let file = ckpt.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).expect("shard");
    let at = bytes.len() - 10;
    bytes[at] ^= 0x40;
    std::fs::write(&file, &bytes).expect("flip");
    let err = resume_err(&ckpt);
    assert!(
        err.contains("rank-00000.safetensors") && err.contains("corrupt"),
        "{err}"
    );
    assert!(err.contains("do not match their checksum"), "{err}");

    // A deleted file: what it held.
    let ckpt = checkpoint_to_damage(&dir, "deleted");
    // (Ranks 2 and 3 hold replicas of ranks 0 and 1, which write them.)
    assert!(!ckpt.join("rank-00002.safetensors").exists());
    std::fs::remove_file(ckpt.join("rank-00001.safetensors")).expect("delete");
    let err = resume_err(&ckpt);
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("missing"),
        "{err}"
    );
    assert!(err.contains("it holds `"), "{err}");

    // The index claims a shape the model does not have.
    let ckpt = checkpoint_to_damage(&dir, "reshaped");
    let index = ckpt.join("index.json");
    let text = std::fs::read_to_string(&index).expect("index");
    std::fs::write(
        &index,
        text.replacen(
            "\"shape\": [\n        256,",
            "\"shape\": [\n        255,",
            1,
        ),
    )
    .expect("edit");
    let err = resume_err(&ckpt);
    assert!(err.contains("index.json") && err.contains("`wte`"), "{err}");
}

#[test]
fn hugging_face_weights_give_the_loss_transformers_computes() {
    for (dir, model) in [("gpt2-tiny", "gpt-tiny"), ("llama-tiny", "llama-tiny")] {
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(dir, "expected.json")).expect("expected.json"),
        )
        .expect("JSON");
        let want = expected["loss"].as_f64().expect("a loss");
        let out = autopar_ok(&[
            "run",
            model,
            "--forward",
            "--init-from",
            s(&fixture(dir, "model.safetensors")),
            "--data",
            s(&fixture(dir, "batch.safetensors")),
        ]);
        let got: f64 = out
            .trim()
            .strip_prefix("loss: ")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no loss in {out}"));
        assert!(
            ((got - want) / want).abs() < 1e-5,
            "{dir}: autopar {got}, transformers {want}"
        );
        // The weights must matter: a fresh model gives another loss.
        let fresh = autopar_ok(&[
            "run",
            model,
            "--forward",
            "--data",
            s(&fixture(dir, "batch.safetensors")),
        ]);
        assert_ne!(fresh.trim(), out.trim(), "{dir}");
    }
}

#[test]
fn weights_round_trip_through_a_sharded_checkpoint_to_hugging_face() {
    let dir = scratch("ckpt-hf");
    for (fixture_dir, model, mesh) in [
        ("gpt2-tiny", "gpt-tiny", "tp=2"),
        ("llama-tiny", "llama-tiny", "dp=2,tp=2"),
    ] {
        let original = fixture(fixture_dir, "model.safetensors");
        let root = dir.join(fixture_dir);
        autopar_ok(&[
            "run",
            model,
            "--mesh",
            mesh,
            "--forward",
            "--init-from",
            s(&original),
            "--checkpoint",
            s(&root),
        ]);
        let out = dir.join(format!("{fixture_dir}.safetensors"));
        let said = autopar_ok(&[
            "checkpoint",
            "export",
            s(&root),
            "--format",
            "hf",
            "-o",
            s(&out),
        ]);
        assert!(said.starts_with("wrote "), "{said}");
        let (a, b) = (
            std::fs::read(&original).expect("original"),
            std::fs::read(&out).expect("export"),
        );
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&a).expect("original"),
            safetensors::SafeTensors::deserialize(&b).expect("export"),
        );
        let mut names_a = a.names();
        let mut names_b = b.names();
        names_a.sort_unstable();
        names_b.sort_unstable();
        assert_eq!(names_a, names_b, "{fixture_dir}");
        for name in names_a {
            let (x, y) = (a.tensor(name).expect("a"), b.tensor(name).expect("b"));
            assert_eq!(x.shape(), y.shape(), "{fixture_dir} {name}");
            assert_eq!(x.data(), y.data(), "{fixture_dir} {name}");
        }
        let inspect = autopar_ok(&["checkpoint", "inspect", s(&root)]);
        assert!(inspect.contains(&format!("plan: {mesh} (")), "{inspect}");
    }
}

#[test]
fn weights_that_do_not_fit_are_refused_by_name() {
    // GPT-2 weights into a Llama: the first unmatched tensor is named.
    let err = autopar_err(&[
        "run",
        "llama-tiny",
        "--forward",
        "--init-from",
        s(&fixture("gpt2-tiny", "model.safetensors")),
    ]);
    assert!(
        err.contains("model.safetensors") && err.contains("no weight `"),
        "{err}"
    );
    // A wider GPT: the shape mismatch names both tensors.
    let err = autopar_err(&[
        "run",
        "gpt:layers=2,hidden=128,heads=4,seq=32,vocab=256",
        "--forward",
        "--init-from",
        s(&fixture("gpt2-tiny", "model.safetensors")),
    ]);
    assert!(err.contains("does not fit the model's `"), "{err}");
    // Resuming needs steps left to run.
    let dir = scratch("ckpt-steps");
    let root = dir.join("c");
    autopar_ok(&["run", "gpt-tiny", "--steps", "2", "--checkpoint", s(&root)]);
    let err = autopar_err(&["run", "gpt-tiny", "--steps", "2", "--resume", s(&root)]);
    assert!(err.contains("counts from the start of training"), "{err}");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--steps",
        "3",
        "--seed",
        "5",
        "--resume",
        s(&root),
    ]);
    assert!(err.contains("seed 0"), "{err}");
    let out = autopar(&["run", "gpt-tiny", "--steps", "3", "--resume", s(&root)]);
    assert!(out.status.success());
    assert_eq!(losses(&String::from_utf8_lossy(&out.stdout)).len(), 1);
}

#[test]
fn dynamic_loss_scaling_state_is_saved_and_must_match() {
    let dir = scratch("ckpt-f16");
    let root = dir.join("c");
    autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--dtype",
        "f16",
        "--steps",
        "2",
        "--checkpoint",
        s(&root),
    ]);
    let inspect = autopar_ok(&["checkpoint", "inspect", s(&root)]);
    assert!(inspect.contains("loss scale: 65536"), "{inspect}");
    let resumed = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--dtype",
        "f16",
        "--steps",
        "3",
        "--resume",
        s(&root),
        "--verify",
    ]);
    assert!(resumed.contains("OK"), "{resumed}");
    // An f32 run has no loss-scaling state to take it.
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--steps",
        "3",
        "--resume",
        s(&root),
    ]);
    assert!(err.contains("`loss_scale`"), "{err}");
}
