//! The collectives of rank programs after the `collectives` pass: gpt-tiny's data-parallel
//! gradients reduced in `--bucket-mb` buckets (one all-reduce per tensor with 0), the
//! gradient norm under tensor parallelism one all-reduce, and the bucketed programs trained
//! next to the single-device reference (`--verify`) on data, tensor and pipeline meshes and
//! under ZeRO.

mod common;

use autopar_driver::{CompileOptions, CompiledStep, RunOptions, compile, run};
use autopar_ir::{Graph, Op, Phase};

fn compiled(mesh: &str, bucket_mb: f64) -> CompiledStep {
    let mut options = CompileOptions::new("gpt-tiny").on_mesh(mesh).expect("mesh");
    options.bucket_mb = bucket_mb;
    compile(&options).expect("gpt-tiny compiles")
}

/// The all-reduces of `g` over `axis` alone in `phases`, as the element counts of their
/// operands.
fn all_reduces(g: &Graph, axis: &str, phases: &[Phase]) -> Vec<u64> {
    g.nodes_in_order()
        .into_iter()
        .filter(|&n| match &g.node(n).op {
            Op::AllReduce { axes, .. } => {
                axes.len() == 1
                    && axes[0] == axis
                    && g.meta(n).phase.is_some_and(|p| phases.contains(&p))
            }
            _ => false,
        })
        .map(|n| g.ty(g.node(n).inputs[0]).num_elements())
        .collect()
}

const GRADIENT: &[Phase] = &[Phase::Backward, Phase::Accumulate];

#[test]
fn data_parallel_gradients_are_bucketed() {
    let per_tensor = compiled("dp=2", 0.0);
    let params = per_tensor
        .train
        .as_ref()
        .expect("a training step")
        .weights
        .len();
    assert_eq!(params, 36);
    let unbucketed = all_reduces(&per_tensor.locals[0], "dp", GRADIENT);
    // One all-reduce per weight gradient.
    assert_eq!(unbucketed.len(), params, "{unbucketed:?}");
    let total: u64 = unbucketed.iter().sum();
    // gpt-tiny's gradients (under half a MiB) fit one 25 MiB bucket.
    let default = compiled("dp=2", 25.0);
    assert_eq!(all_reduces(&default.locals[0], "dp", GRADIENT), vec![total]);
    // 64 KiB buckets: every bucket but the last holds at most 64 KiB unless it is a single
    // gradient larger than that, and the gradients are all there.
    let cap = 64 * 1024 / 4;
    let small = all_reduces(&compiled("dp=2", 1.0 / 16.0).locals[0], "dp", GRADIENT);
    assert!(small.len() > 1 && small.len() < params, "{small:?}");
    assert_eq!(small.iter().sum::<u64>(), total);
    let largest = unbucketed.iter().copied().max().unwrap_or(0);
    for &b in &small {
        assert!(
            b <= cap || unbucketed.contains(&b),
            "{b} of {small:?} (largest {largest})"
        );
    }
}

#[test]
fn the_gradient_norm_costs_one_all_reduce_under_tensor_parallelism() {
    for bucket_mb in [25.0, 0.0] {
        let step = compiled("tp=2", bucket_mb);
        for (rank, g) in step.locals.iter().enumerate() {
            let norm = all_reduces(g, "tp", &[Phase::Optimizer]);
            assert_eq!(
                norm.len(),
                1,
                "rank {rank}, --bucket-mb {bucket_mb}: {norm:?}"
            );
        }
    }
    // Partitioning alone issues one per sharded gradient.
    let mut options = CompileOptions::new("gpt-tiny")
        .on_mesh("tp=2")
        .expect("mesh");
    options.stop_after = Some(autopar_driver::Pass::Partition);
    let partitioned = compile(&options).expect("compiles");
    assert!(all_reduces(&partitioned.locals[0], "tp", &[Phase::Optimizer]).len() > 10);
}

fn verify(mesh: &str, micro_batches: usize, zero: u8, bucket_mb: f64) {
    let mut options = CompileOptions::new("gpt-tiny").on_mesh(mesh).expect("mesh");
    options.train.micro_batches = micro_batches;
    options.parallel.zero = zero;
    options.bucket_mb = bucket_mb;
    let step = compile(&options).expect("compiles");
    let two = RunOptions {
        steps: 2,
        verify: true,
        ..RunOptions::default()
    };
    let report = run(&step, &two, |_| {})
        .expect("runs")
        .verify
        .expect("verifies");
    assert!(
        report.ok(),
        "{mesh}, {micro_batches} micro-batches, ZeRO-{zero}, --bucket-mb {bucket_mb}: {}",
        report.line()
    );
}

#[test]
fn bucketed_steps_match_the_reference() {
    // Small buckets, so that every mesh runs several.
    verify("dp=2", 1, 0, 1.0 / 16.0);
    verify("dp=2", 2, 0, 25.0);
    verify("dp=2,tp=2", 1, 0, 1.0 / 16.0);
    verify("tp=2", 1, 0, 25.0);
}

#[test]
fn bucketed_pipelines_match_the_reference() {
    verify("pp=2,dp=2", 2, 0, 1.0 / 16.0);
    verify("pp=2,dp=2", 2, 0, 25.0);
}

#[test]
fn bucketed_zero_steps_match_the_reference() {
    for zero in [1, 2, 3] {
        verify("dp=2", 1, zero, 1.0 / 16.0);
    }
}

#[test]
fn pipeline_sub_programs_keep_their_buckets_inside() {
    // Every sub-program verifies on its own (the compile checks it), and the pipeline still
    // reduces fewer gradients than one per tensor.
    let count = |step: &CompiledStep| -> usize {
        step.pipeline
            .as_ref()
            .expect("a pipeline")
            .pipelines
            .iter()
            .map(|p| {
                p.forward
                    .iter()
                    .chain(&p.backward)
                    .flatten()
                    .chain(p.optimizer.iter().map(|s| &s.program))
                    .map(|sp| all_reduces(&sp.graph, "dp", GRADIENT).len())
                    .sum::<usize>()
            })
            .sum()
    };
    let mut options = CompileOptions::new("gpt-tiny")
        .on_mesh("pp=2,dp=2")
        .expect("mesh");
    options.train.micro_batches = 2;
    options.bucket_mb = 0.0;
    let per_tensor = count(&compile(&options).expect("compiles"));
    options.bucket_mb = 25.0;
    let bucketed = count(&compile(&options).expect("compiles"));
    assert!(bucketed < per_tensor, "{bucketed} vs {per_tensor}");
}

#[test]
fn the_cli_dumps_buckets_and_prices_them() {
    let dump = common::autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--stage",
        "collectives",
    ]);
    let grads = common::collectives(&dump)
        .into_iter()
        .filter(|(op, axes, scope)| {
            op == "all_reduce" && axes == "\"dp\"" && scope.contains("grad")
        })
        .count();
    assert_eq!(grads, 1, "{dump}");
    let per_tensor = common::autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--stage",
        "collectives",
        "--bucket-mb",
        "0",
    ]);
    assert!(common::collectives(&per_tensor).len() > 30);
    let err = common::autopar_err(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--stage",
        "partitioned",
        "--bucket-mb",
        "1",
    ]);
    assert!(err.contains("--bucket-mb"), "{err}");
    let err = common::autopar_err(&["run", "gpt-tiny", "--mesh", "dp=2", "--bucket-mb=-2"]);
    assert!(err.contains("not a size in MiB"), "{err}");
    // One bucket at the end of the backward cannot overlap it: more of the reduction is
    // exposed than with 25 MiB buckets.
    let exposed = |mb: &str| -> f64 {
        let out = common::autopar_ok(&[
            "estimate",
            "gpt3-1.3b",
            "--cluster",
            "dgx-a100:nodes=2",
            "--batch",
            "512",
            "--plan",
            "dp=16",
            "--json",
            "--bucket-mb",
            mb,
        ]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("json");
        v["time"]["grad_reduce_exposed_s"]
            .as_f64()
            .expect("grad_reduce_exposed_s")
    };
    assert!(exposed("100000") > exposed("25"));
}

/// Under `tp=2` every rank's program, fused and bucketed, has exactly Megatron-LM's tensor-
/// parallel collectives: per block two all-reduces in the forward (after the attention and MLP
/// row-parallel GEMMs) and two in the backward (the input gradients of the column-parallel
/// QKV and MLP-in GEMMs); the vocabulary-parallel embedding's forward all-reduce; the
/// cross-entropy's max and sum in the forward, which its backward reuses (the fusion pass
/// merges the repeated ones); the head's input gradient; and one gradient-norm all-reduce.
#[test]
fn tensor_parallel_programs_have_megatrons_collectives() {
    use std::collections::BTreeMap;

    use autopar_ir::LayerId;
    let step = compiled("tp=2", 25.0);
    for (rank, g) in step.locals.iter().enumerate() {
        let mut counts: BTreeMap<(Phase, Option<LayerId>), usize> = BTreeMap::new();
        for n in g.nodes_in_order() {
            let op = &g.node(n).op;
            if !op.is_communication() {
                continue;
            }
            assert!(
                matches!(op, Op::AllReduce { .. }),
                "rank {rank}: a `{}` in a tp=2 program",
                op.name()
            );
            let meta = g.meta(n);
            let phase = meta.phase.expect("collectives have a phase");
            // The gradient norm's one all-reduce carries the metadata of its last member.
            let layer = if phase == Phase::Optimizer {
                None
            } else {
                meta.layer
            };
            *counts.entry((phase, layer)).or_default() += 1;
        }
        let mut want: BTreeMap<(Phase, Option<LayerId>), usize> = BTreeMap::new();
        for i in 0..2 {
            want.insert((Phase::Forward, Some(LayerId::Block(i))), 2);
            want.insert((Phase::Backward, Some(LayerId::Block(i))), 2);
        }
        want.insert((Phase::Forward, Some(LayerId::Embedding)), 1);
        want.insert((Phase::Forward, Some(LayerId::Loss)), 2);
        want.insert((Phase::Backward, Some(LayerId::FinalNorm)), 1);
        want.insert((Phase::Optimizer, None), 1);
        assert_eq!(counts, want, "rank {rank}");
    }
}
