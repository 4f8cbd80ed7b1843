//! Model structure is typed metadata, not names: the zoo's gpt-tiny, llama-tiny and moe-tiny
//! with every parameter and every scope renamed to random strings (seeded, so the test is
//! deterministic; data inputs keep their names, they are feeds), and the scopes of their
//! training steps renamed again, tags included, compile exactly as the
//! originals do: the same `TransformerConfig`, the same parallelised and partitioned programs
//! on `dp=2,tp=2` (Megatron's layer placement, a non-default one, and sequence parallelism)
//! up to names, the same pipeline stages and sub-programs, the same recompute rewiring, and
//! the same search result.
//! Without metadata (a hand-written `.air`), what needs it fails with an error naming it.

mod common;

use std::collections::{HashMap, HashSet};

use autopar_cost_model::{Cluster, CostModel, LayerPlacement, TransformerConfig};
use autopar_ir::schedule::ScheduleKind;
use autopar_ir::text::print;
use autopar_ir::{DeviceMesh, Graph, Op};
use autopar_passes::parallelize::{ParallelOptions, parallelize};
use autopar_passes::partition::partition_all;
use autopar_passes::pipeline::{PipelineOptions, plan_stages, split_pipeline};
use autopar_passes::recompute::Recompute;
use autopar_passes::search::{SearchOptions, search};
use autopar_passes::train::{TrainOptions, TrainStep, build_train_step};

const MODELS: [&str; 3] = ["gpt-tiny", "llama-tiny", "moe-tiny"];

/// A small deterministic generator of names (xorshift64*), so that no name of the zoo
/// survives and every run renames alike.
struct Names {
    state: u64,
    used: HashSet<String>,
}

impl Names {
    fn new(seed: u64) -> Self {
        Names {
            state: seed | 1,
            used: HashSet::new(),
        }
    }

    fn next(&mut self) -> String {
        loop {
            let mut name = String::new();
            for _ in 0..10 {
                self.state ^= self.state >> 12;
                self.state ^= self.state << 25;
                self.state ^= self.state >> 27;
                let x = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d);
                name.push(char::from(
                    b"abcdefghijklmnopqrstuvwxyz_-:/"[(x >> 59) as usize % 30],
                ));
            }
            if self.used.insert(name.clone()) {
                return name;
            }
        }
    }
}

/// `g` with every parameter renamed and every scope replaced (one random name per distinct
/// scope), its metadata, types, shardings, value ids and outputs kept.
fn renamed(g: &Graph, seed: u64) -> Graph {
    rewritten(g, seed, true)
}

/// A training step with every scope replaced, tags included (`mb0/grad/h.0.attn` becomes one
/// random string): its parameters keep their names, which bind them to the state outputs.
fn rescoped(s: TrainStep, seed: u64) -> TrainStep {
    TrainStep {
        graph: rewritten(&s.graph, seed, false),
        ..s
    }
}

fn rewritten(g: &Graph, seed: u64, parameters: bool) -> Graph {
    let mut names = Names::new(seed);
    let mut scopes: HashMap<String, String> = HashMap::new();
    let mut out = Graph::new(g.name());
    out.set_mesh(g.mesh().cloned());
    for n in g.nodes_in_order() {
        let node = g.node(n);
        let op = match &node.op {
            Op::Parameter { ty, init, .. } if parameters => Op::Parameter {
                name: names.next(),
                ty: ty.clone(),
                init: init.clone(),
            },
            op => op.clone(),
        };
        let scope = node.scope.as_ref().map(|s| {
            scopes
                .entry(s.clone())
                .or_insert_with(|| names.next())
                .clone()
        });
        let id = out
            .add_node_with_ids(op, &node.inputs, &node.outputs, scope)
            .expect("copy");
        out.set_meta(id, g.meta(n));
        for &v in &node.outputs {
            out.set_sharding(v, g.value(v).sharding.clone())
                .expect("sharding");
        }
    }
    for (name, v) in g.outputs() {
        out.add_output(name.clone(), *v).expect("output");
    }
    out
}

/// `g` up to names: parameters numbered in order, no scopes, outputs numbered in order. Two
/// programs are the same up to names when these print alike (same ops, types, shardings,
/// collectives in the same order, metadata).
fn anonymous(g: &Graph) -> String {
    let mut out = Graph::new(g.name());
    out.set_mesh(g.mesh().cloned());
    let mut k = 0;
    for n in g.nodes_in_order() {
        let node = g.node(n);
        let op = match &node.op {
            Op::Parameter { ty, init, .. } => {
                k += 1;
                Op::Parameter {
                    name: format!("p{k}"),
                    ty: ty.clone(),
                    init: init.clone(),
                }
            }
            op => op.clone(),
        };
        let id = out
            .add_node_with_ids(op, &node.inputs, &node.outputs, None)
            .expect("copy");
        out.set_meta(id, g.meta(n));
        for &v in &node.outputs {
            out.set_sharding(v, g.value(v).sharding.clone())
                .expect("sharding");
        }
    }
    for (i, (_, v)) in g.outputs().iter().enumerate() {
        out.add_output(format!("o{i}"), *v).expect("output");
    }
    print(&out)
}

/// Asserts two texts are equal, showing the first line where they differ.
fn assert_same(what: &str, a: &str, b: &str) {
    if a == b {
        return;
    }
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let i = la
        .iter()
        .zip(&lb)
        .position(|(x, y)| x != y)
        .unwrap_or(la.len().min(lb.len()));
    panic!(
        "{what}: differs at line {} ({} vs {} lines):\n  original: {}\n  renamed:  {}",
        i + 1,
        la.len(),
        lb.len(),
        la.get(i).unwrap_or(&"<end>"),
        lb.get(i).unwrap_or(&"<end>")
    );
}

/// The original and renamed forward graphs of a zoo model (micro-batch 8 sequences).
fn pair(model: &str, seed: u64) -> (Graph, Graph) {
    let g = autopar_frontends::zoo::build(model, 8).expect("zoo model");
    let r = renamed(&g, seed);
    assert!(
        !g.parameters()
            .iter()
            .zip(r.parameters())
            .any(|((_, a, _), (_, b, _))| *a == b),
        "{model}: every parameter is renamed"
    );
    (g, r)
}

fn step(g: &Graph, options: &TrainOptions) -> TrainStep {
    build_train_step(g, options).expect("train step")
}

#[test]
fn the_transformer_config_does_not_depend_on_names() {
    for (i, model) in MODELS.iter().enumerate() {
        let (g, r) = pair(model, 11 + i as u64);
        let a = TransformerConfig::from_graph(&g).expect("config of the original");
        let b = TransformerConfig::from_graph(&r).expect("config of the renamed model");
        assert_eq!(a, b, "{model}");
    }
}

/// The description of a MoE model with a shared expert, read off its weight roles: the
/// routed experts' width is `ffn`, the dense MLP beside them the shared expert's; and the
/// parameter count matches the graph's.
#[test]
fn a_shared_expert_is_read_off_the_graph() {
    let spec =
        "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,ffn=128,shared_ffn=96";
    let g = autopar_frontends::zoo::build(spec, 8).expect("zoo model");
    let c = TransformerConfig::from_graph(&g).expect("config");
    assert_eq!((c.ffn, c.shared_ffn, c.experts, c.top_k), (128, 96, 4, 2));
    assert_eq!(c.total_params(), g.num_parameter_elements() as u64);
    let r = renamed(&g, 5);
    assert_eq!(TransformerConfig::from_graph(&r).expect("config"), c);
}

/// The norm is read off the graph's ops: the zoo's Llama normalises with RMSNorm, its GPT
/// with LayerNorm (what PyTorch eager mode pays for differs: one kernel against a chain).
#[test]
fn the_norm_is_read_off_the_ops() {
    let config = |spec: &str| {
        let g = autopar_frontends::zoo::build(spec, 8).expect("zoo model");
        TransformerConfig::from_graph(&g).expect("config")
    };
    let llama = config("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=172,seq=32,vocab=256");
    assert!(llama.rms_norm && !llama.learned_positions && llama.gated_mlp);
    let gpt = config("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256");
    assert!(!gpt.rms_norm && gpt.learned_positions);
}

#[test]
fn partitioned_programs_do_not_depend_on_names() {
    let mesh = DeviceMesh::parse("dp=2,tp=2").expect("mesh");
    for (i, model) in MODELS.iter().enumerate() {
        let (g, r) = pair(model, 23 + i as u64);
        let (sg, sr) = (
            step(&g, &TrainOptions::default()),
            rescoped(step(&r, &TrainOptions::default()), 29 + i as u64),
        );
        let mut placed = LayerPlacement::default();
        placed.set_attention("sts").expect("attn");
        if *model != "moe-tiny" {
            placed.set_mlp("ss").expect("mlp");
        }
        // Megatron's layer placement, one on the sequence shards, and sequence parallelism.
        for (layer, sequence_parallel) in [
            (LayerPlacement::default(), false),
            (placed, false),
            (LayerPlacement::default(), true),
        ] {
            let options = ParallelOptions {
                layer,
                sequence_parallel,
                ..ParallelOptions::default()
            };
            let what = format!("{model} on {mesh} with {layer}, sp={sequence_parallel}");
            let pa = parallelize(&sg.graph, &mesh, &options).expect("parallelize original");
            let pb = parallelize(&sr.graph, &mesh, &options).expect("parallelize renamed");
            assert_same(&what, &anonymous(&pa.graph), &anonymous(&pb.graph));
            let ra = partition_all(&pa.graph, &pa.plan).expect("partition original");
            let rb = partition_all(&pb.graph, &pb.plan).expect("partition renamed");
            assert_eq!(ra.len(), rb.len());
            for (rank, (a, b)) in ra.iter().zip(&rb).enumerate() {
                assert_same(
                    &format!("{what}, rank {rank}"),
                    &anonymous(a),
                    &anonymous(b),
                );
            }
        }
        // The pins of sequence parallelism (the residual stream and the norms' backward on the
        // sequence shards) are the same values: compared directly, since propagation happens
        // to reach the same program on these shapes even without the backward's pins.
        let pins = |g: &Graph| {
            let mut c = autopar_passes::propagate::Constraints::default();
            autopar_passes::parallelize::sequence_parallel_constraints(g, &mesh, &mut c)
                .expect("sp constraints");
            c.fixed
        };
        assert_eq!(pins(&sg.graph), pins(&sr.graph), "{model}: sp pins");
        // A mixture of experts refuses the MLP on the sequence shards, whatever its names.
        if *model == "moe-tiny" {
            let mut mlp = LayerPlacement::default();
            mlp.set_mlp("ss").expect("mlp");
            let options = ParallelOptions {
                layer: mlp,
                ..ParallelOptions::default()
            };
            assert!(parallelize(&sg.graph, &mesh, &options).is_err());
            assert!(parallelize(&sr.graph, &mesh, &options).is_err());
        }
    }
}

#[test]
fn pipeline_stages_and_recompute_do_not_depend_on_names() {
    for (i, model) in MODELS.iter().enumerate() {
        let (g, r) = pair(model, 37 + i as u64);
        let options = TrainOptions {
            micro_batches: 2,
            ..TrainOptions::default()
        };
        let (sg, sr) = (
            step(&g, &options),
            rescoped(step(&r, &options), 41 + i as u64),
        );
        let a = plan_stages(&sg.graph, 2, &[]).expect("stages of the original");
        let b = plan_stages(&sr.graph, 2, &[]).expect("stages of the renamed model");
        assert_eq!(a.starts, b.starts, "{model}");
        let layers = |s: &autopar_passes::pipeline::StageSplit| {
            s.layers.iter().map(|l| (l.id, l.flops)).collect::<Vec<_>>()
        };
        assert_eq!(layers(&a), layers(&b), "{model}");
        assert!(
            a.layers.len() > 3,
            "{model}: embedding, blocks, norm, head, loss"
        );

        let pipeline = PipelineOptions {
            pp: 2,
            vpp: 1,
            schedule: ScheduleKind::OneFOneB,
            boundaries: Vec::new(),
        };
        let pa = split_pipeline(&sg, &pipeline).expect("split original");
        let pb = split_pipeline(&sr, &pipeline).expect("split renamed");
        assert_eq!(pa.split.starts, pb.split.starts, "{model}");
        let subs = |p: &autopar_passes::pipeline::PipelineSplit| {
            let programs = p.program.forward.iter().chain(&p.program.backward);
            programs
                .flatten()
                .map(|s| (anonymous(&s.graph), s.inputs.clone(), s.outputs.clone()))
                .collect::<Vec<_>>()
        };
        for (k, (x, y)) in subs(&pa).iter().zip(subs(&pb)).enumerate() {
            assert_same(&format!("{model}: sub-program {k}"), &x.0, &y.0);
            assert_eq!((&x.1, &x.2), (&y.1, &y.2), "{model}: sub-program {k}");
        }
        assert_eq!(pa.program.activations, pb.program.activations, "{model}");
        assert_eq!(pa.program.gradients, pb.program.gradients, "{model}");

        for policy in [Recompute::Selective, Recompute::Full] {
            let options = TrainOptions {
                micro_batches: 2,
                recompute: policy,
                ..TrainOptions::default()
            };
            let (a, b) = (step(&g, &options), step(&r, &options));
            let plain = step(
                &g,
                &TrainOptions {
                    micro_batches: 2,
                    ..TrainOptions::default()
                },
            );
            assert_same(
                &format!("{model} with {policy:?} recompute"),
                &anonymous(&a.graph),
                &anonymous(&b.graph),
            );
            // The rewiring did something: the step differs from the one without recompute.
            assert_ne!(
                anonymous(&a.graph),
                anonymous(&plain.graph),
                "{model} {policy:?}"
            );
        }
    }
}

#[test]
fn the_search_does_not_depend_on_names() {
    let cost = CostModel::new(Cluster::preset("cpu:ranks=8").expect("cluster"));
    for (i, model) in MODELS.iter().enumerate() {
        let (g, r) = pair(model, 53 + i as u64);
        let configs = [&g, &r].map(|x| TransformerConfig::from_graph(x).expect("config"));
        let mut options = SearchOptions::new(16);
        options.top_k = 3;
        options.threads = 1;
        let [a, b] = configs.map(|c| search(&cost, &c, &options).expect("search"));
        assert!(!a.plans.is_empty(), "{model}: some plan fits");
        assert_eq!(a.plans, b.plans, "{model}");
    }
}

/// The command line sees the same: `autopar plan` of a renamed model written to a `.air`
/// file prints the same ranked plans and explanation as the zoo model, and the file runs and
/// verifies on a mesh.
#[test]
fn plan_output_does_not_depend_on_names() {
    let dir = common::scratch("rename-invariance");
    for (i, model) in MODELS.iter().enumerate() {
        let g = autopar_frontends::zoo::build(model, 1).expect("zoo model");
        let file = dir.join(format!("{model}.renamed.air"));
        std::fs::write(&file, print(&renamed(&g, 71 + i as u64))).expect("written");
        let file = file.to_str().expect("a UTF-8 path");
        let plan = |m: &str| {
            let out = common::autopar_ok(&[
                "plan",
                m,
                "--cluster",
                "cpu:ranks=8",
                "--batch",
                "16",
                "--top",
                "5",
                // One thread: with more, what the bounds prune (not what they find) depends
                // on the threads' timing.
                "--threads",
                "1",
            ]);
            // The model's own name appears in the header and the search's wall time in its
            // statistics; everything else must agree.
            out.replace(m, "MODEL")
                .lines()
                .map(|l| match (l.find(" in "), l.find(" s on ")) {
                    (Some(a), Some(b)) if l.starts_with("searched ") && a < b => {
                        format!("{} in (time){}", &l[..a], &l[b + 2..])
                    }
                    _ => l.to_string(),
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        let (want, got) = (plan(model), plan(file));
        assert!(want.contains("MODEL"), "{want}");
        assert_same(&format!("{model}: plan"), &want, &got);
    }
    // A file's shapes are fixed: the run's file holds the batch of 8 sequences it trains on.
    let g = autopar_frontends::zoo::build("gpt-tiny", 8).expect("zoo model");
    let file = dir.join("gpt-tiny.b8.renamed.air");
    std::fs::write(&file, print(&renamed(&g, 97))).expect("written");
    let out = common::autopar_ok(&[
        "run",
        file.to_str().expect("a UTF-8 path"),
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("verify: ") && l.ends_with(" OK")),
        "{out}"
    );
}

/// `g` without any metadata, as a hand-written `.air` without `meta{...}` reads.
fn stripped(g: &Graph) -> Graph {
    let mut out = g.clone();
    for n in out.node_ids() {
        out.set_meta(n, autopar_ir::NodeMeta::default());
    }
    out
}

#[test]
fn missing_metadata_is_a_clear_error() {
    let g = stripped(&autopar_frontends::zoo::build("gpt-tiny", 8).expect("zoo model"));
    let err = TransformerConfig::from_graph(&g)
        .expect_err("no roles")
        .to_string();
    assert!(err.contains("role `query`"), "{err}");

    // The step builder writes phases and micro-batches itself; layers are the model's.
    let options = TrainOptions {
        micro_batches: 2,
        ..TrainOptions::default()
    };
    let s = step(&g, &options);
    let err = plan_stages(&s.graph, 2, &[])
        .expect_err("no layers")
        .to_string();
    assert!(err.contains("layer in its metadata"), "{err}");
    let full = TrainOptions {
        recompute: Recompute::Full,
        ..options
    };
    let err = build_train_step(&g, &full)
        .expect_err("no blocks")
        .to_string();
    assert!(err.contains("layer=block(N)"), "{err}");

    let mesh = DeviceMesh::parse("dp=2,tp=2").expect("mesh");
    let mut placed = LayerPlacement::default();
    placed.set_mlp("ss").expect("mlp");
    let options = ParallelOptions {
        layer: placed,
        ..ParallelOptions::default()
    };
    let err = parallelize(&s.graph, &mesh, &options)
        .expect_err("no roles")
        .to_string();
    assert!(err.contains("finds none of its weights"), "{err}");
}
