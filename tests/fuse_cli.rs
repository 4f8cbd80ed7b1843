//! The fusion pass from the command line: `dump --stage fused` shows a rank program as it
//! runs (golden, and its structure against `--stage partitioned`), `--no-fuse` leaves the
//! program as partitioning made it, and `run --verify` passes with and without fusion.

mod common;

use autopar_driver::ir::text::parse;
use autopar_driver::ir::{Graph, Op};
use common::{autopar_err, autopar_ok, check_golden, collectives};

fn count(g: &Graph, pick: impl Fn(&Op) -> bool) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&n| pick(&g.node(n).op))
        .count()
}

#[test]
fn dump_fused_matches_golden_and_merges_the_loss_backward_all_reduces() {
    let args = ["dump", "gpt-tiny", "--mesh", "tp=2", "--rank", "1"];
    let fused = autopar_ok(&[&args[..], &["--stage", "fused"]].concat());
    check_golden("gpt-tiny.tp2.rank1.fused.air", &fused);
    let partitioned = autopar_ok(&[&args[..], &["--stage", "partitioned"]].concat());
    let (f, p) = (
        parse(&fused).expect("the fused dump parses"),
        parse(&partitioned).expect("parses"),
    );
    assert_eq!(autopar_driver::ir::text::print(&f), fused, "round trip");
    // The loss backward's max and sum all-reduces were the forward's: two fewer, and the
    // rest in the same order.
    let (cf, cp) = (collectives(&fused), collectives(&partitioned));
    assert_eq!(cf.len() + 2, cp.len(), "{cf:?}");
    let backward_loss = |c: &&(String, String, String)| c.2 == "mb0/grad/loss";
    assert_eq!(
        cp.iter().filter(backward_loss).count(),
        cf.iter().filter(backward_loss).count() + 2
    );
    assert!(count(&f, |op| matches!(op, Op::Fusion { .. })) > 10);
    assert!(f.num_nodes() < p.num_nodes() / 2, "{} nodes", f.num_nodes());
    // The same outputs, parameters and inputs.
    let names = |g: &Graph| {
        g.outputs()
            .iter()
            .map(|(n, _)| n.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&f), names(&p));
    assert_eq!(f.parameters().len(), p.parameters().len());
    assert_eq!(f.inputs().len(), p.inputs().len());
    // Without the pass, the fused stage is the partitioned program.
    let unfused = autopar_ok(&[&args[..], &["--stage", "fused", "--no-fuse"]].concat());
    assert_eq!(unfused, partitioned);
}

#[test]
fn dump_fused_on_one_device_and_in_json() {
    let text = autopar_ok(&["dump", "mlp-tiny", "--stage", "fused"]);
    let g = parse(&text).expect("parses");
    assert!(
        count(&g, |op| matches!(op, Op::Fusion { .. })) > 0,
        "{text}"
    );
    let json = autopar_ok(&["dump", "mlp-tiny", "--stage", "fused", "--format", "json"]);
    let back = autopar_driver::ir::json::from_json(&json).expect("the JSON loads");
    assert_eq!(autopar_driver::ir::text::print(&back), text);
}

#[test]
fn dump_fused_refuses_what_it_cannot_show() {
    let err = autopar_err(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "2",
        "--stage",
        "fused",
    ]);
    assert!(err.contains("--dump-after fuse"), "{err}");
    let err = autopar_err(&["dump", "gpt-tiny", "--stage", "fused", "--rank", "1"]);
    assert!(err.contains("--rank 1"), "{err}");
    let err = autopar_err(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--stage",
        "partitioned",
        "--no-fuse",
    ]);
    assert!(err.contains("--no-fuse"), "{err}");
}

#[test]
fn verify_passes_without_fusion_too() {
    for args in [
        &["gpt-tiny", "--mesh", "dp=2,tp=2"][..],
        &["llama-tiny", "--mesh", "cp=2", "--dtype", "bf16"][..],
        &["gpt-tiny", "--mesh", "pp=2", "--micro-batches", "2"][..],
        &["moe-tiny", "--mesh", "ep=2"][..],
    ] {
        let fused = autopar_ok(&[&["run"], args, &["--steps", "2", "--verify"]].concat());
        let unfused =
            autopar_ok(&[&["run"], args, &["--steps", "2", "--verify", "--no-fuse"]].concat());
        for out in [&fused, &unfused] {
            assert!(
                out.lines()
                    .any(|l| l.starts_with("verify:") && l.ends_with("OK")),
                "{args:?}: {out}"
            );
        }
        // The same losses, bit for bit: the pass changes no value.
        let losses = |out: &str| {
            out.lines()
                .filter(|l| l.contains("loss:"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        assert_eq!(losses(&fused), losses(&unfused), "{args:?}");
    }
}

#[test]
fn timings_and_dump_after_know_the_pass() {
    let out = autopar_ok(&["run", "gpt-tiny", "--mesh", "tp=2", "--timings"]);
    assert!(out.lines().any(|l| l.starts_with("fuse ")), "{out}");
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--timings",
        "--no-fuse",
    ]);
    assert!(!out.lines().any(|l| l.starts_with("fuse ")), "{out}");
    let dir = common::scratch("dump-after-fuse");
    let dir_text = dir.to_str().expect("a UTF-8 path");
    autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "2",
        "--dump-after",
        "fuse",
        "--dump-dir",
        dir_text,
    ]);
    let files: Vec<String> = std::fs::read_dir(&dir)
        .expect("the dump directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert!(
        files
            .iter()
            .any(|f| f == "fuse.pipeline0.forward.vs0.mb1.air"),
        "{files:?}"
    );
    for f in &files {
        let text = std::fs::read_to_string(dir.join(f)).expect("a dump");
        parse(&text).expect("every sub-program parses back");
    }
}
