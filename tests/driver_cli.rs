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
