//! Layer placements on the CPU runtime: every placement (the plan search may pick any of them
//! for a CPU cluster) runs and matches the single-device step, for GPT and
//! Llama on `tp=2` with and without sequence parallelism, the attention core on the sequence
//! shards included (on a step laid out in the load-balanced order over `tp`), also with data
//! parallelism and inside a pipeline; the partitioned forward of a layer carries the kinds of
//! collectives the cost model prices for it; and the placements the runtime cannot run are
//! refused by name.

mod common;

use std::collections::HashSet;

use autopar_driver::cost_model::layer::{Pass, tp_collectives};
use autopar_driver::cost_model::{Collective, LayerPlacement};
use autopar_driver::ir::{DeviceMesh, Op};
use autopar_driver::passes::parallelize::{ParallelOptions, parallelize};
use common::{autopar_err, autopar_ok};

/// Runs one step of every runnable placement of `model` with --verify.
fn every_runnable_placement_verifies(model: &str, sp: bool) {
    let placements = LayerPlacement::all();
    // Every placement: 8 attention codes x 4 MLP codes.
    assert_eq!(placements.len(), 32, "{placements:?}");
    for l in placements {
        let (attn, mlp) = (l.attention_code(), l.mlp_code());
        let mut args = vec![
            "run", model, "--mesh", "tp=2", "--attn", &attn, "--mlp", &mlp, "--steps", "1",
            "--verify",
        ];
        if sp {
            args.push("--sp");
        }
        let out = autopar_ok(&args);
        assert!(out.trim_end().ends_with(" OK"), "{l} sp={sp}: {out}");
    }
}

#[test]
fn gpt_runs_every_runnable_placement_with_sp() {
    every_runnable_placement_verifies("gpt-tiny", true);
}

#[test]
fn gpt_runs_every_runnable_placement_without_sp() {
    every_runnable_placement_verifies("gpt-tiny", false);
}

#[test]
fn llama_runs_every_runnable_placement_with_sp() {
    every_runnable_placement_verifies("llama-tiny", true);
}

#[test]
fn llama_runs_every_runnable_placement_without_sp() {
    every_runnable_placement_verifies("llama-tiny", false);
}

/// The collectives of the forward of layer 0 in rank 0's partitioned training step, as
/// `(scope, kind)`.
fn forward_collectives(model: &str, l: &LayerPlacement, sp: bool) -> Vec<(String, Collective)> {
    layer_collectives(model, l, sp, "mb0/h.0")
}

/// The collectives of rank 0's partitioned training step in scope `layer` and its sub-scopes,
/// as `(scope, kind)`.
fn layer_collectives(
    model: &str,
    l: &LayerPlacement,
    sp: bool,
    layer: &str,
) -> Vec<(String, Collective)> {
    // The driver lays the step out in the load-balanced order over `tp` when the attention
    // core runs on the sequence shards.
    let mut options = autopar_driver::CompileOptions::new(model)
        .on_mesh("tp=2")
        .expect("a mesh");
    options.parallel = ParallelOptions {
        sequence_parallel: sp,
        layer: *l,
        ..ParallelOptions::default()
    };
    options.reference = false;
    options.stop_after = Some(autopar_driver::Pass::Partition);
    let local = autopar_driver::compile(&options)
        .expect("compiled")
        .locals
        .swap_remove(0);
    local
        .nodes_in_order()
        .into_iter()
        .filter_map(|n| {
            let node = local.node(n);
            let scope = node.scope.clone()?;
            if scope != layer && !scope.starts_with(&format!("{layer}.")) {
                return None;
            }
            let kind = match node.op {
                Op::AllReduce { .. } => Collective::AllReduce,
                Op::AllGather { .. } => Collective::AllGather,
                Op::ReduceScatter { .. } => Collective::ReduceScatter,
                Op::AllToAll { .. } => Collective::AllToAll,
                _ => return None,
            };
            Some((scope, kind))
        })
        .collect()
}

#[test]
fn the_partitioned_forward_carries_the_planned_collective_kinds() {
    for model in ["gpt-tiny", "llama-tiny"] {
        for sp in [true, false] {
            for l in LayerPlacement::all() {
                let planned: HashSet<Collective> = tp_collectives(&l, sp)
                    .into_iter()
                    .filter(|c| c.pass == Pass::Forward)
                    .map(|c| c.kind)
                    .collect();
                let colls = forward_collectives(model, &l, sp);
                let kinds: HashSet<Collective> = colls.iter().map(|(_, k)| *k).collect();
                assert_eq!(kinds, planned, "{model} {l} sp={sp}: {colls:?}");
            }
        }
    }
}

#[test]
fn ulysses_moves_q_k_v_by_all_to_all_and_the_mlp_on_shards_moves_nothing() {
    let mut l = LayerPlacement::MEGATRON;
    l.set_attention("ulysses").expect("a code");
    l.set_mlp("seq").expect("a code");
    for model in ["gpt-tiny", "llama-tiny"] {
        let colls = forward_collectives(model, &l, true);
        let in_scope = |scope: &str| -> Vec<Collective> {
            colls
                .iter()
                .filter(|(s, _)| s == scope)
                .map(|(_, k)| *k)
                .collect()
        };
        // q, k and v from the sequence shards to heads, and the core's output back.
        assert_eq!(
            in_scope("mb0/h.0.attn"),
            [Collective::AllToAll; 4],
            "{model}: {colls:?}"
        );
        assert!(in_scope("mb0/h.0.mlp").is_empty(), "{model}: {colls:?}");
        assert_eq!(colls.len(), 4, "{model}: {colls:?}");
        // The backward moves the gradients the same way back: the output gradient to heads,
        // the q, k and v gradients to the sequence shards; nothing is gathered.
        let back = layer_collectives(model, &l, true, "mb0/grad/h.0");
        assert!(
            back.iter().all(|(_, k)| *k == Collective::AllToAll) && back.len() == 4,
            "{model}: {back:?}"
        );
    }
}

#[test]
fn the_core_on_shards_gathers_k_and_v_and_reduce_scatters_their_gradients() {
    let mut l = LayerPlacement::MEGATRON;
    l.set_attention("sss").expect("a code");
    for model in ["gpt-tiny", "llama-tiny"] {
        // Q, K and V come out on the sequence shards, the output projection reads them: only
        // the keys and values move, gathered for the local queries.
        let colls = forward_collectives(model, &l, true);
        let attn: Vec<Collective> = colls
            .iter()
            .filter(|(s, _)| s == "mb0/h.0.attn")
            .map(|(_, k)| *k)
            .collect();
        assert_eq!(attn, [Collective::AllGather; 2], "{model}: {colls:?}");
        // Their gradients, partial sums over the local queries, are reduce-scattered back.
        let back: Vec<Collective> = layer_collectives(model, &l, true, "mb0/grad/h.0.attn")
            .into_iter()
            .map(|(_, k)| k)
            .collect();
        assert_eq!(back, [Collective::ReduceScatter; 2], "{model}: {back:?}");
    }
}

/// Runs one step of `model` with `args` added and --verify, asserting it matches.
fn verifies(model: &str, args: &[&str]) {
    let mut all = vec!["run", model, "--steps", "1", "--verify"];
    all.extend_from_slice(args);
    let out = autopar_ok(&all);
    assert!(out.trim_end().ends_with(" OK"), "{args:?}: {out}");
}

#[test]
fn the_core_on_shards_runs_with_data_parallelism_and_in_a_pipeline() {
    verifies(
        "llama-tiny",
        &["--mesh", "dp=2,tp=2", "--attn", "sss", "--sp"],
    );
    verifies(
        "gpt-tiny",
        &[
            "--mesh",
            "pp=2,tp=2",
            "--micro-batches",
            "2",
            "--attn",
            "sss",
        ],
    );
}

#[test]
fn placements_the_runtime_cannot_run_are_refused_by_name() {
    // The core on tp's sequence shards has its own load-balanced layout, which context
    // parallelism's would have to nest.
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "tp=2,cp=2",
        "--attn",
        "seq",
        "--steps",
        "1",
    ]);
    assert!(
        err.contains("--attn") && err.contains("attention core") && err.contains("cp=2"),
        "{err}"
    );
    // A step not laid out has no positions for the core on the shards.
    let mut l = LayerPlacement::MEGATRON;
    l.set_attention("sss").expect("a code");
    let step =
        autopar_driver::load_train_step("gpt-tiny", None, &autopar_driver::TrainOptions::default())
            .expect("a training step");
    let options = ParallelOptions {
        layer: l,
        ..ParallelOptions::default()
    };
    let mesh = DeviceMesh::parse("tp=2").expect("a mesh");
    let err = parallelize(&step.graph, &mesh, &options)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("--attn") && err.contains("positions"), "{err}");
    let err = autopar_err(&[
        "run", "moe-tiny", "--mesh", "tp=2", "--sp", "--mlp", "seq", "--steps", "1",
    ]);
    assert!(
        err.contains("--mlp") && err.contains("mixture of experts"),
        "{err}"
    );
    let err = autopar_err(&["run", "gpt-tiny", "--mesh", "dp=2", "--attn", "ulysses"]);
    assert!(err.contains("`tp`"), "{err}");
    let err = autopar_err(&["run", "gpt-tiny", "--mesh", "tp=2", "--mlp", "tst"]);
    assert!(err.contains("--mlp") && err.contains("2 letters"), "{err}");
}
