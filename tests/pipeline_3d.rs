//! Pipelines composed with data and tensor parallelism and ZeRO: `autopar run --mesh
//! dp=2,tp=2,pp=2` partitions the step over `dp` and `tp`, cuts every rank's local step into
//! pipeline stages, runs 8 CPU ranks and checks the result against one device. ZeRO-3
//! gathers its weights in every sub-program that uses them, each rank holds only its stages'
//! state, and the trace and the dumps cover every rank of the mesh.

use std::process::Command;

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

fn verifies(mesh: &str, schedule: &str, zero: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "gpt-tiny",
        "--mesh",
        mesh,
        "--micro-batches",
        "4",
        "--schedule",
        schedule,
        "--zero",
        zero,
        "--verify",
    ];
    args.extend_from_slice(extra);
    let (ok, out) = autopar(&args);
    assert!(ok, "{out}");
    assert!(
        out.contains("verify: max_abs_err=") && out.trim_end().ends_with("OK"),
        "{out}"
    );
    out
}

#[test]
fn dp_tp_pp_zero1_1f1b_verifies() {
    let out = verifies("dp=2,tp=2,pp=2", "1f1b", "1", &[]);
    assert!(
        out.contains("ranks: 8 (dp=2, tp=2, pp=2), 4 pipelines of 2 stages"),
        "{out}"
    );
}

#[test]
fn dp_tp_pp_gpipe_verifies() {
    verifies("dp=2,tp=2,pp=2", "gpipe", "1", &[]);
}

#[test]
fn dp_tp_pp_without_zero_verifies() {
    verifies("dp=2,tp=2,pp=2", "1f1b", "0", &[]);
}

#[test]
fn dp_tp_pp_interleaved_verifies() {
    verifies("dp=2,tp=2,pp=2", "interleaved", "1", &["--vpp", "2"]);
}

#[test]
fn dp_pp_several_steps_match_the_reference() {
    let out = verifies("dp=2,pp=2", "1f1b", "1", &["--steps", "3"]);
    assert!(out.contains("step 3 loss:"), "{out}");
}

#[test]
fn dp_tp_pp_zero3_1f1b_verifies() {
    let out = verifies("dp=2,tp=2,pp=2", "1f1b", "3", &[]);
    assert!(out.contains("state per rank: "), "{out}");
}

#[test]
fn dp_pp_zero3_verifies_over_several_steps() {
    let out = verifies("dp=2,pp=2", "1f1b", "3", &["--steps", "2"]);
    assert!(out.contains("step 2 loss:"), "{out}");
}

#[test]
fn dp_tp_pp_zero3_interleaved_verifies() {
    verifies("dp=2,tp=2,pp=2", "interleaved", "3", &["--vpp", "2"]);
}

/// gpt-tiny's training step with `micro_batches` micro-batches, compiled for `mesh` (with
/// `pp=2`) under ZeRO stage `zero` and a 1F1B schedule.
fn compile_1f1b(mesh: &str, micro_batches: usize, zero: u8) -> autopar_driver::CompiledStep {
    let mut options = autopar_driver::CompileOptions::new("gpt-tiny")
        .on_mesh(mesh)
        .expect("mesh");
    options.train.micro_batches = micro_batches;
    options.parallel.zero = zero;
    autopar_driver::compile(&options).expect("compiles")
}

/// FSDP in a pipeline: every forward and backward sub-program that reads a ZeRO-3 weight
/// gathers it over `dp` itself, and no gathered weight is carried between sub-programs.
#[test]
fn zero3_gathers_in_every_sub_program_that_uses_a_weight() {
    use autopar_driver::ir::pipeline::value_name;
    use autopar_driver::ir::{Op, Placement};

    let program = compile_1f1b("dp=2,pp=2", 4, 3);
    let global = &program.global;
    let step = program.train.as_ref().expect("a training step");
    let sharded: std::collections::HashSet<String> = global
        .parameters()
        .into_iter()
        .filter(|(v, name, _)| {
            step.weights.iter().any(|w| w == name)
                && matches!(
                    global.value(*v).sharding.as_ref().and_then(|s| s.get("dp")),
                    Some(Placement::Shard(_))
                )
        })
        .map(|(_, name, _)| name.to_string())
        .collect();
    assert!(sharded.len() > 4, "ZeRO-3 shards the weights: {sharded:?}");
    let pipelines = &program.pipeline.as_ref().expect("a pipeline").pipelines;
    for (which, pipeline) in pipelines.iter().enumerate() {
        let local = &program.locals[which];
        let param_of = |v| match &local.node(local.value(v).producer).op {
            Op::Parameter { name, .. } => Some(name.clone()),
            _ => None,
        };
        let (mut forward, mut backward) = (0, 0);
        for (is_forward, subs) in [(true, &pipeline.forward), (false, &pipeline.backward)] {
            for p in subs.iter().flatten() {
                for &v in &p.inputs {
                    // No sub-program reads a weight gathered by another one.
                    let producer = local.node(local.value(v).producer);
                    assert!(
                        !(matches!(producer.op, Op::AllGather { .. })
                            && param_of(producer.inputs[0]).is_some()),
                        "{} reads {v}, a weight gathered elsewhere",
                        p.graph.name()
                    );
                    let Some(name) = param_of(v).filter(|n| sharded.contains(n)) else {
                        continue;
                    };
                    let input = p
                        .graph
                        .nodes_in_order()
                        .into_iter()
                        .find(|&n| matches!(&p.graph.node(n).op, Op::Input { name, .. } if *name == value_name(v)))
                        .expect("the weight is an input");
                    let gathered = p.graph.users(p.graph.node(input).outputs[0]).iter().any(
                        |&(u, _)| matches!(&p.graph.node(u).op, Op::AllGather { axes, .. } if axes == &["dp"]),
                    );
                    assert!(
                        gathered,
                        "{} reads `{name}` without gathering it",
                        p.graph.name()
                    );
                    if is_forward {
                        forward += 1;
                    } else {
                        backward += 1;
                    }
                }
            }
        }
        assert!(forward >= 8 && backward >= 8, "{forward} {backward}");
    }
}

/// Each pipeline rank holds only the state its stages read: its shards of those parameters
/// and their optimizer state, not those of the other stages.
#[test]
fn pipeline_ranks_hold_only_their_stages_state() {
    let program = compile_1f1b("dp=2,tp=2,pp=2", 2, 1);
    let mesh = &program.mesh;
    let g = &program.global;
    let bytes = |m: &autopar_driver::runtime::TensorMap| -> u64 {
        m.values().map(|t| t.size_bytes()).sum()
    };
    let mut held = Vec::new();
    for rank in 0..mesh.num_devices() {
        let (pp_rank, which) = autopar_driver::runtime::split_pipeline_rank(mesh, rank);
        let state = program.state.init_rank(rank, 7).expect("state");
        let whole: u64 = program.locals[which]
            .parameters()
            .iter()
            .map(|(_, _, ty)| ty.size_bytes())
            .sum();
        assert!(
            bytes(&state) < whole,
            "rank {rank} holds every stage's state"
        );
        // The first stage holds no weight of the last layer, the last none of the first.
        let foreign = if pp_rank == 0 { "h.1." } else { "h.0." };
        assert!(
            state.keys().all(|name| !name.starts_with(foreign)),
            "rank {rank}: {:?}",
            state.keys().collect::<Vec<_>>()
        );
        assert!(!state.is_empty());
        held.push((which, state));
    }
    // Together, the pipeline ranks of a coordinate hold all of its state.
    for which in 0..program.locals.len() {
        for (_, name, _) in g.parameters() {
            assert!(
                held.iter()
                    .any(|(w, s)| *w == which && s.contains_key(name)),
                "nobody holds `{name}`"
            );
        }
    }
    let two_steps = autopar_driver::RunOptions {
        seed: 7,
        steps: 2,
        verify: true,
        first_step: 0,
        ..autopar_driver::RunOptions::default()
    };
    let summary = autopar_driver::run(&program, &two_steps, |_| {}).expect("runs");
    assert!(summary.verify.expect("verified").ok());
    for (rank, r) in summary.ranks.iter().enumerate() {
        assert_eq!(
            r.state_bytes,
            bytes(&held[rank].1),
            "rank {rank} keeps the size of its state"
        );
    }
}

/// `--trace` on a mesh with `pp` and other axes: one track per rank of the whole mesh, named
/// by its coordinates, and one slice per action of its pipeline rank, in schedule order.
#[test]
fn dp_tp_pp_trace_has_one_track_per_rank_in_schedule_order() {
    use autopar_driver::ir::schedule::{Action, Schedule, ScheduleKind};

    let path = std::env::temp_dir().join(format!("autopar-3d-trace-{}.json", std::process::id()));
    let path_s = path.to_string_lossy().into_owned();
    let out = verifies("dp=2,tp=2,pp=2", "1f1b", "1", &["--trace", &path_s]);
    assert!(
        out.contains("rank 3 (dp=0,tp=1,pp=1): peak memory "),
        "{out}"
    );
    let text = std::fs::read_to_string(&path).expect("trace written");
    let _ = std::fs::remove_file(&path);
    let doc: serde_json::Value = serde_json::from_str(&text).expect("trace is JSON");
    let events = doc["traceEvents"].as_array().expect("events");
    let tracks: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "M").collect();
    assert_eq!(tracks.len(), 8, "one track per rank");
    assert_eq!(tracks[3]["args"]["name"], "rank 3 (dp=0,tp=1,pp=1)");
    assert_eq!(tracks[4]["args"]["name"], "rank 4 (dp=1,tp=0,pp=0)");
    let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 1, 4).expect("schedule");
    for rank in 0..8 {
        // `pp` is the innermost axis of `dp=2,tp=2,pp=2`.
        let list = &schedule.per_rank[rank % 2];
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
        let computed: Vec<&str> = slices
            .iter()
            .filter(|e| e["cat"] == "forward" || e["cat"] == "backward")
            .map(|e| e["name"].as_str().unwrap_or(""))
            .collect();
        let expected: Vec<String> = list
            .iter()
            .filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. }))
            .map(|a| autopar_driver::ir::trace::describe(a).0)
            .collect();
        assert_eq!(computed, expected, "rank {rank}");
    }
}

/// `dump --stage pipeline|schedule` on a mesh with `pp` and other axes: the stages with their
/// layers and the global and local FLOPs, and each pipeline rank's action list with the mesh
/// ranks that run it.
#[test]
fn dp_tp_pp_dumps_show_stages_and_action_lists() {
    let dump = |stage: &str| {
        let (ok, out) = autopar(&[
            "dump",
            "gpt-tiny",
            "--mesh",
            "dp=2,tp=2,pp=2",
            "--micro-batches",
            "4",
            "--stage",
            stage,
        ]);
        assert!(ok, "{out}");
        out
    };
    let out = dump("pipeline");
    assert!(
        out.contains("4 pipelines (one per coordinate on dp, tp)"),
        "{out}"
    );
    assert!(
        out.contains("stage 0 (rank 0, chunk 0):") && out.contains("layers embed h.0"),
        "{out}"
    );
    assert!(out.contains("layers h.1 ln_f head loss"), "{out}");
    // One rank's local step does about a quarter of the global step's work.
    let global: Vec<f64> = out
        .lines()
        .filter(|l| l.starts_with("stage "))
        .map(|l| {
            let f = l
                .split("):")
                .nth(1)
                .expect("FLOPs")
                .split_whitespace()
                .next();
            f.expect("a number").parse().expect("FLOPs")
        })
        .collect();
    let local = out
        .lines()
        .find(|l| l.starts_with("  pipeline 3 (dp=1,tp=1): "))
        .expect("pipeline 3's local FLOPs");
    let local: Vec<f64> = local
        .split("stage ")
        .skip(1)
        .map(|s| {
            let f = s.split_whitespace().nth(1).expect("FLOPs");
            f.trim_end_matches(',').parse().expect("FLOPs")
        })
        .collect();
    assert_eq!(global.len(), 2, "{out}");
    assert_eq!(local.len(), 2, "{out}");
    for (g, l) in global.iter().zip(&local) {
        assert!(*l > g / 4.0 * 0.9 && *l < g / 2.0, "global {g}, local {l}");
    }
    assert!(
        out.contains(
            "pp rank 1 runs on rank 1 (dp=0,tp=0,pp=1), rank 3 (dp=0,tp=1,pp=1), \
             rank 5 (dp=1,tp=0,pp=1), rank 7 (dp=1,tp=1,pp=1)"
        ),
        "{out}"
    );
    let out = dump("schedule");
    assert!(
        out.contains("pp rank 0 (peak in flight 2), on rank 0 (dp=0,tp=0,pp=0), rank 2"),
        "{out}"
    );
    assert!(out.contains("  B mb3 c0\n  optimizer step"), "{out}");
    let (ok, out) = autopar(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--stage",
        "schedule",
    ]);
    assert!(!ok && out.contains("`pp` axis"), "{out}");
}

/// Without collectives nothing is recomputed: every node of a pp-only bf16 step (whose
/// micro-batches cast the weights) runs in exactly one sub-program, as the step placed it.
#[test]
fn a_pipeline_without_collectives_recomputes_nothing() {
    use autopar_driver::ir::DType;

    let options = autopar_driver::TrainOptions {
        micro_batches: 4,
        ..autopar_driver::TrainOptions::for_dtype(DType::BF16)
    };
    let mut compile = autopar_driver::CompileOptions::new("gpt-tiny")
        .on_mesh("pp=2")
        .expect("mesh");
    compile.train = options;
    let step = autopar_driver::compile(&compile).expect("compiles");
    let p = &step.pipeline.as_ref().expect("a pipeline").pipelines[0];
    let mut seen = std::collections::HashMap::new();
    let subs = p
        .forward
        .iter()
        .chain(&p.backward)
        .flatten()
        .chain(p.optimizer.iter().map(|s| &s.program));
    for sub in subs {
        for n in sub.graph.nodes_in_order() {
            let node = sub.graph.node(n);
            if node.inputs.is_empty() {
                continue;
            }
            if let Some(first) = seen.insert(node.outputs[0], sub.graph.name().to_string()) {
                panic!(
                    "{} runs in {first} and {}",
                    node.outputs[0],
                    sub.graph.name()
                );
            }
        }
    }
    assert!(seen.len() > 100);
}
