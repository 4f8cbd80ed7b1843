//! Context parallelism end to end: the load-balanced layout keeps the model's loss, ring
//! attention runs forward and backward on `cp` ranks and matches the original single-device
//! step, the partitioned program passes K/V blocks around the ring, the activation memory
//! per rank shrinks with the sequence shard, and impossible requests are clear errors.
#![allow(clippy::unwrap_used)]

mod common;

use autopar_driver::ir::{DeviceMesh, Graph, Op};
use autopar_driver::passes::context_parallel::{load_balance, load_balanced_positions};
use autopar_driver::passes::parallelize::{ParallelOptions, parallelize};
use autopar_driver::runtime as rt;
use autopar_driver::{
    CompileOptions, RunOptions, TrainOptions, compile, load_model, load_train_step,
};
use common::{autopar_err, autopar_ok, check_golden};

/// The `verify:` line of a run's output, asserted OK, and its two errors, each also asserted
/// within the line's tolerance (1e-4, or what the f32-accumulation noise floor widens it to).
fn verified(out: &str) -> (f64, f64) {
    let line = out
        .lines()
        .find(|l| l.starts_with("verify: "))
        .unwrap_or_else(|| panic!("no verify line in {out}"));
    assert!(line.ends_with(" OK"), "{out}");
    let err = |key: &str| -> f64 {
        line.split(&format!("{key}="))
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .expect("an error value")
    };
    let (abs, rel) = (err("max_abs_err"), err("max_rel_err"));
    let tolerance = match line.contains("tolerance=") {
        true => err("tolerance"),
        false => 1e-4,
    };
    assert!(abs <= tolerance && rel <= tolerance, "{out}");
    (abs, rel)
}

/// The loss of one forward pass of `g` on the reference interpreter, from `seed`.
fn forward_loss(g: &Graph, seed: u64) -> f64 {
    let params = rt::init_parameters(g, seed).unwrap();
    let batch = rt::synthetic_batch(g, seed, 0).unwrap();
    let out = rt::run(g, &params, &batch, rt::RunOptions::default()).unwrap();
    out.scalar("loss").unwrap()
}

#[test]
fn the_load_balanced_layout_keeps_the_loss() {
    for model in ["llama-tiny", "gpt-tiny"] {
        let g = load_model(model, None).unwrap();
        let want = forward_loss(&g, 7);
        for cp in [2, 4] {
            let laid_out = load_balance(&g, "cp", cp).unwrap();
            let attention: Vec<usize> = ops(&laid_out, |op| matches!(op, Op::Attention { .. }));
            assert!(!attention.is_empty());
            assert!(attention.iter().all(|&n| n == 5), "{model}: {attention:?}");
            let rotary = ops(&laid_out, |op| matches!(op, Op::Rotary { .. }));
            assert!(rotary.iter().all(|&n| n == 2), "{model}: {rotary:?}");
            let got = forward_loss(&laid_out, 7);
            assert!(
                (got - want).abs() < 1e-5,
                "{model} cp={cp}: loss {got} instead of {want}"
            );
        }
    }
}

/// The operand counts of the nodes of `g` whose op satisfies `pick`.
fn ops(g: &Graph, pick: impl Fn(&Op) -> bool) -> Vec<usize> {
    g.nodes_in_order()
        .into_iter()
        .map(|n| g.node(n))
        .filter(|node| pick(&node.op))
        .map(|node| node.inputs.len())
        .collect()
}

#[test]
fn rank_r_holds_chunks_r_and_2n_minus_1_minus_r() {
    let pos = load_balanced_positions(16, 4);
    for r in 0..4 {
        let mine = &pos[r * 4..(r + 1) * 4];
        assert_eq!(mine, [2 * r, 2 * r + 1, 14 - 2 * r, 15 - 2 * r], "rank {r}");
    }
}

#[test]
fn cp_runs_verify_against_the_original_step() {
    for args in [
        &["--mesh", "cp=2", "--steps", "3"][..],
        &["--mesh", "cp=4"][..],
        &["--mesh", "dp=2,tp=2,cp=2"][..],
    ] {
        let mut full = vec!["run", "llama-tiny", "--verify"];
        full.extend_from_slice(args);
        let out = autopar_ok(&full);
        verified(&out);
    }
    // With SGD the update is linear in the gradient, so the comparison sees the gradients'
    // own rounding, not AdamW's normalisation of tiny gradients.
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,cp=2",
        "--optimizer",
        "sgd",
        "--steps",
        "2",
        "--verify",
    ]);
    let (abs, _) = verified(&out);
    assert!(abs < 1e-6, "{out}");
}

/// `(op, attributes, scope)` of every send and recv of a partitioned dump, in order.
fn ring_messages(dump: &str) -> Vec<(String, String, String)> {
    dump.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rhs = line.split_once(" = ").map_or(line, |(_, r)| r);
            let op = ["send ", "recv "]
                .into_iter()
                .find(|op| rhs.starts_with(op))?;
            let attrs = rhs.split('{').nth(1)?.split('}').next()?.to_string();
            let scope = line
                .split("scope=\"")
                .nth(1)?
                .split('"')
                .next()?
                .to_string();
            Some((op.trim().to_string(), attrs, scope))
        })
        .collect()
}

#[test]
fn the_partitioned_step_passes_kv_blocks_around_the_ring() {
    for cp in [2usize, 4] {
        let mesh = format!("cp={cp}");
        let dump = autopar_ok(&[
            "dump",
            "llama-tiny",
            "--mesh",
            &mesh,
            "--stage",
            "partitioned",
        ]);
        let messages = ring_messages(&dump);
        for layer in 0..2 {
            // Forward: K, V and the keys' positions, at every step but the first.
            let scope = format!("mb0/h.{layer}.attn");
            let forward: Vec<_> = messages.iter().filter(|(_, _, s)| *s == scope).collect();
            assert_eq!(forward.len(), 2 * 3 * (cp - 1), "{scope}: {forward:?}");
            for step in forward.chunks(2 * 3) {
                let (sends, recvs) = step.split_at(3);
                assert!(
                    sends
                        .iter()
                        .all(|(op, a, _)| op == "send" && a == "axis=\"cp\", shift=1")
                );
                assert!(
                    recvs
                        .iter()
                        .all(|(op, a, _)| op == "recv" && a == "axis=\"cp\", shift=-1")
                );
            }
            // Backward: K and positions for the softmax statistics, then K, V, positions and
            // the two gradient accumulators, and the accumulators' way home.
            let scope = format!("mb0/grad/h.{layer}.attn");
            let backward = messages.iter().filter(|(_, _, s)| *s == scope).count();
            assert_eq!(backward, 2 * (2 * (cp - 1) + 5 * (cp - 1) + 2), "{scope}");
        }
        // The sequence is never gathered: no activation collective over cp but the loss's.
        let gathers = dump
            .lines()
            .filter(|l| {
                (l.contains("= all_gather ") || l.contains("= reduce_scatter "))
                    && l.contains("\"cp\"")
            })
            .count();
        assert_eq!(gathers, 0, "{dump}");
    }
}

#[test]
fn cp_partitioned_dump_matches_golden() {
    let dump = autopar_ok(&[
        "dump",
        "llama:layers=1,hidden=16,heads=2,kv_heads=1,ffn=32,seq=8,vocab=16",
        "--batch",
        "2",
        "--mesh",
        "cp=2",
        "--stage",
        "partitioned",
        "--rank",
        "1",
    ]);
    assert!(!ring_messages(&dump).is_empty());
    // The local program, sends and receives included, reads back as it prints.
    let parsed = autopar_driver::ir::text::parse(&dump).unwrap();
    assert_eq!(autopar_driver::ir::text::print(&parsed), dump);
    check_golden("llama-small.cp2.rank1.partitioned.air", &dump);
}

/// The largest activation peak of any rank: the executor's peak of live bytes less the
/// bytes of the state the rank holds (its parameters: weights and optimizer state, which
/// stay live through the step).
fn activation_peak(model: &str, batch: usize, cp: usize) -> u64 {
    let mut options = CompileOptions::new(model)
        .on_mesh(&format!("cp={cp}"))
        .unwrap();
    options.batch = Some(batch);
    let step = compile(&options).unwrap();
    let verify = RunOptions {
        seed: 3,
        steps: 1,
        verify: true,
        first_step: 0,
        ..RunOptions::default()
    };
    let summary = run_step(&step, &verify);
    assert!(summary.verify.as_ref().is_some_and(|v| v.ok()));
    let state: u64 = step
        .locals
        .iter()
        .map(|g| {
            g.parameters()
                .iter()
                .map(|(_, _, ty)| ty.size_bytes())
                .sum()
        })
        .max()
        .unwrap();
    summary.peak_bytes - state
}

fn run_step(step: &autopar_driver::CompiledStep, o: &RunOptions) -> autopar_driver::RunReport {
    autopar_driver::run(step, o, |_| {}).unwrap()
}

#[test]
fn cp2_holds_at_most_60_percent_of_the_activations_on_a_long_sequence() {
    let model = "llama:layers=1,hidden=32,heads=2,ffn=64,seq=256,vocab=64";
    let one = activation_peak(model, 2, 1);
    let two = activation_peak(model, 2, 2);
    let ratio = two as f64 / one as f64;
    println!("activation peak: cp=1 {one} B, cp=2 {two} B, ratio {ratio:.3}");
    assert!(ratio <= 0.6, "cp=2 holds {ratio:.3} of cp=1's activations");
}

#[test]
fn impossible_layouts_are_clear_errors() {
    let err = autopar_err(&["run", "llama-tiny", "--mesh", "cp=3", "--verify"]);
    assert!(
        err.contains("mesh axis `cp` (3 ways)")
            && err.contains("length 32")
            && err.contains("6 equal chunks"),
        "{err}"
    );
    let err = autopar_err(&["run", "mlp-tiny", "--mesh", "cp=2"]);
    assert!(err.contains("has no attention"), "{err}");
    let err = autopar_err(&["run", "moe-tiny", "--mesh", "cp=2"]);
    assert!(err.contains("moe_route"), "{err}");
    let err = autopar_err(&["run", "llama-tiny", "--mesh", "pp=2,cp=3"]);
    assert!(
        err.contains("`cp`") && err.contains("6 equal chunks"),
        "{err}"
    );
    // A step built without the layout cannot be placed on a cp mesh.
    let step = load_train_step("llama-tiny", None, &TrainOptions::default()).unwrap();
    let mesh = DeviceMesh::parse("cp=2").unwrap();
    let err = parallelize(&step.graph, &mesh, &ParallelOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not laid out"), "{err}");
}

#[test]
fn context_parallelism_composes_with_pipelines() {
    // The ring's sends and receives run inside the pipeline's sub-programs, the global
    // positions are recomputed by every stage that reads them, and the run verifies against
    // the original (unpermuted) step.
    for (mesh, schedule) in [("cp=2,pp=2", "1f1b"), ("dp=2,tp=2,cp=2,pp=2", "gpipe")] {
        let out = autopar_ok(&[
            "run",
            "llama-tiny",
            "--mesh",
            mesh,
            "--micro-batches",
            "2",
            "--schedule",
            schedule,
            "--steps",
            "2",
            "--verify",
        ]);
        assert!(out.trim_end().ends_with("OK"), "{mesh}: {out}");
    }
    let out = autopar_ok(&[
        "run",
        "llama-tiny",
        "--mesh",
        "tp=2,cp=2,pp=2",
        "--sp",
        "--micro-batches",
        "2",
        "--verify",
    ]);
    assert!(out.trim_end().ends_with("OK"), "{out}");
}
