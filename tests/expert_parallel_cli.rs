//! End-to-end tests of expert parallelism on the `ep` mesh axis: MoE training steps on CPU
//! ranks match the single-device reference, each MoE layer's forward moves tokens to their
//! experts and back with one all-to-all each (golden partitioned dump), plans with `ep` run
//! on CPU ranks, and requests that cannot be expert-parallel are refused with the tensor,
//! dim and axis.

mod common;

use common::{autopar_err, autopar_ok, check_golden, collectives, plan_file};

/// Runs `moe-tiny` for two steps on `mesh` (plus `extra` options) with `--verify`, and
/// asserts it prints `OK` with small errors.
fn verifies(mesh: &str, extra: &[&str]) {
    let mut args = vec![
        "run", "moe-tiny", "--mesh", mesh, "--steps", "2", "--verify",
    ];
    args.extend(extra);
    let out = autopar_ok(&args);
    let line = out
        .lines()
        .find(|l| l.starts_with("verify: "))
        .unwrap_or_else(|| panic!("no verify line for {mesh}: {out}"));
    assert!(line.ends_with(" OK"), "{mesh} {extra:?}: {out}");
    let value = |key: &str| -> Option<f64> {
        line.split(&format!("{key}="))
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
    };
    let abs = value("max_abs_err").expect("a max_abs_err value");
    // 1e-4, or the tolerance the f32-accumulation noise floor widens it to.
    let tolerance = value("tolerance").unwrap_or(1e-4);
    assert!(abs <= tolerance, "{mesh} {extra:?}: {line}");
}

#[test]
fn expert_parallel_steps_match_the_reference() {
    verifies("ep=2", &[]);
    verifies("dp=2,ep=2", &["--zero", "1"]);
    verifies("dp=2,ep=2", &["--zero", "3"]);
    verifies("dp=2,ep=2,tp=2", &[]);
    // Pipelined over `pp`, each stage expert-parallel.
    verifies("pp=2,ep=2", &[]);
}

/// A shared expert (a dense MLP beside the routed ones, DeepSeekMoE-style) is split over
/// `tp` and replicated over `ep` and `dp` like the attention weights; its steps match the
/// reference, GPT-style and Llama-style.
#[test]
fn a_shared_expert_beside_the_routed_ones_matches_the_reference() {
    for spec in [
        "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,ffn=128,shared_ffn=64",
        "moe:style=llama,layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,ffn=128,shared_ffn=64",
    ] {
        for (mesh, zero) in [("dp=2,ep=2,tp=2", "0"), ("ep=2,tp=2", "3")] {
            let out = autopar_ok(&[
                "run", spec, "--mesh", mesh, "--steps", "2", "--verify", "--zero", zero,
            ]);
            let line = out
                .lines()
                .find(|l| l.starts_with("verify: "))
                .unwrap_or_else(|| panic!("no verify line for {spec} on {mesh}: {out}"));
            assert!(line.ends_with(" OK"), "{spec} on {mesh}: {out}");
        }
    }
}

/// ZeRO with every data rank an expert rank (no `dp` axis): the dense weights' state is
/// sharded over `ep`, the ranks that replicate them.
#[test]
fn zero_without_a_dp_axis_shards_dense_state_over_ep() {
    verifies("ep=2", &["--zero", "1"]);
    verifies("ep=2", &["--zero", "3"]);
}

/// ZeRO shards a dense weight's optimizer state over every rank that replicates the weight,
/// `dp` and `ep` together on one dim, and an expert's over `dp` only (it is split over `ep`
/// already, on its expert dim).
#[test]
fn dense_optimizer_state_is_sharded_over_dp_and_ep() {
    use autopar_driver::ir::{DeviceMesh, Placement};
    use autopar_driver::passes::parallelize::{ParallelOptions, parallelize};

    let step =
        autopar_driver::load_train_step("moe-tiny", None, &autopar_driver::TrainOptions::default())
            .expect("step");
    for (mesh, zero) in [
        ("dp=2,ep=2", 1),
        ("ep=2,dp=2", 2),
        ("ep=2", 1),
        ("dp=2,ep=2", 3),
    ] {
        let p = parallelize(
            &step.graph,
            &DeviceMesh::parse(mesh).expect("mesh"),
            &ParallelOptions {
                zero,
                ..ParallelOptions::default()
            },
        )
        .expect("parallelizes");
        let g = &p.graph;
        let on = |name: &str, axis: &str| {
            let (v, _, _) = g
                .parameters()
                .into_iter()
                .find(|(_, n, _)| *n == name)
                .unwrap_or_else(|| panic!("no parameter {name}"));
            g.value(v).sharding.as_ref().and_then(|s| s.get(axis))
        };
        let has_dp = mesh.contains("dp");
        for name in ["h.0.attn.wq:adam_m", "h.1.mlp.router:adam_v", "wte:adam_m"] {
            let ep = on(name, "ep");
            assert!(
                matches!(ep, Some(Placement::Shard(_))),
                "{mesh} {name}: {ep:?}"
            );
            if has_dp {
                assert_eq!(on(name, "dp"), ep, "{mesh} {name}: one dim over both");
            }
        }
        // The experts' moments stay on their expert shards over `ep`.
        let name = "h.0.mlp.w1:adam_m";
        assert_eq!(on(name, "ep"), Some(Placement::Shard(0)), "{mesh} {name}");
        let dp = on(name, "dp");
        if has_dp {
            assert!(
                matches!(dp, Some(Placement::Shard(d)) if d != 0),
                "{mesh} {name}: {dp:?}"
            );
        }
        // ZeRO-3 shards the dense weights themselves the same way.
        if zero == 3 {
            assert_eq!(on("h.0.attn.wq", "ep"), on("h.0.attn.wq:adam_m", "ep"));
            assert_eq!(on("h.0.attn.wq", "dp"), on("h.0.attn.wq:adam_m", "dp"));
        }
    }
}

#[test]
fn each_moe_layer_dispatches_and_combines_by_all_to_all() {
    let dump = autopar_ok(&[
        "dump",
        "moe-tiny",
        "--mesh",
        "ep=2",
        "--stage",
        "partitioned",
    ]);
    let colls = collectives(&dump);
    for layer in 0..2 {
        let scope = format!("mb0/h.{layer}.mlp");
        // Forward: exactly the pair, tokens to experts then experts' output back.
        let forward: Vec<&(String, String, String)> =
            colls.iter().filter(|(_, _, s)| *s == scope).collect();
        assert_eq!(forward.len(), 2, "{forward:?}");
        assert!(
            forward
                .iter()
                .all(|(op, axes, _)| op == "all_to_all" && axes == "\"ep\""),
            "{forward:?}"
        );
        let a2a: Vec<&str> = dump
            .lines()
            .filter(|l| l.contains("= all_to_all") && l.contains(&format!("\"{scope}\"")))
            .collect();
        // Dispatch: `[e, g, c, h]` from group shards to expert shards; combine: back.
        assert!(a2a[0].contains("split_dim=0, concat_dim=1"), "{}", a2a[0]);
        assert!(a2a[1].contains("split_dim=1, concat_dim=0"), "{}", a2a[1]);
        // Backward: the gradients take the same two ways back, and no tokens are gathered.
        let grad = format!("mb0/grad/h.{layer}.mlp");
        let count = |what: &str| {
            colls
                .iter()
                .filter(|(op, _, s)| op == what && *s == grad)
                .count()
        };
        assert_eq!(count("all_to_all"), 2, "{colls:?}");
        assert_eq!(count("all_gather"), 0, "{colls:?}");
        // The experts stay on their ranks: half of them each, with their optimizer state.
        for name in ["w1", "w1:adam_m"] {
            let decl = format!("{{name=\"h.{layer}.mlp.{name}\"");
            assert!(
                dump.lines()
                    .any(|l| l.contains(&decl) && l.contains("f32[2,64,128]")),
                "h.{layer}.mlp.{name} is not split over ep"
            );
        }
    }
    check_golden("moe-tiny.ep2.partitioned.air", &dump);

    // With `dp` as well, the all-to-alls stay on `ep`.
    let colls = collectives(&autopar_ok(&[
        "dump",
        "moe-tiny",
        "--mesh",
        "dp=2,ep=2",
        "--stage",
        "partitioned",
    ]));
    let forward: Vec<_> = colls
        .iter()
        .filter(|(_, _, s)| s == "mb0/h.0.mlp")
        .collect();
    assert_eq!(forward.len(), 2, "{forward:?}");
    assert!(
        forward
            .iter()
            .all(|(op, axes, _)| op == "all_to_all" && axes == "\"ep\""),
        "{forward:?}"
    );
}

/// With `tp`, each expert's MLP is split Megatron-style inside: its output is all-reduced
/// over `tp` between the two all-to-alls over `ep`.
#[test]
fn experts_split_over_tp_reduce_between_dispatch_and_combine() {
    let colls = collectives(&autopar_ok(&[
        "dump",
        "moe-tiny",
        "--mesh",
        "ep=2,tp=2",
        "--stage",
        "partitioned",
    ]));
    let forward: Vec<(&str, &str)> = colls
        .iter()
        .filter(|(_, _, s)| s == "mb0/h.1.mlp")
        .map(|(op, axes, _)| (op.as_str(), axes.as_str()))
        .collect();
    assert_eq!(
        forward,
        [
            ("all_to_all", "\"ep\""),
            ("all_reduce", "\"tp\""),
            ("all_to_all", "\"ep\"")
        ]
    );
}

#[test]
fn impossible_expert_parallel_requests_are_refused() {
    // No MoE layer to shard.
    let err = autopar_err(&["run", "gpt-tiny", "--mesh", "ep=2"]);
    assert!(
        err.contains("`ep`") && err.contains("no MoE layer"),
        "{err}"
    );
    // 4 experts over 3 ranks (the batch of 6 divides).
    let err = autopar_err(&["run", "moe-tiny", "--mesh", "ep=3", "--batch", "6"]);
    assert!(
        err.contains("`h.0.mlp.w1`") && err.contains("dim 0") && err.contains("mesh axis `ep`"),
        "{err}"
    );
    // A batch of 8 over dp=4 and ep=4.
    let err = autopar_err(&["run", "moe-tiny", "--mesh", "dp=4,ep=4"]);
    assert!(
        err.contains("`tokens`") && err.contains("dim 0") && err.contains("mesh axis `ep`"),
        "{err}"
    );
}

#[test]
fn plans_with_expert_parallelism_are_searched_and_run() {
    // The CPU runtime's search space has `ep` for a MoE model.
    let out = autopar_ok(&[
        "plan",
        "moe-tiny",
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--top",
        "100",
        "--pin",
        "runtime=cpu",
        "--json",
    ]);
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let plans = doc["plans"].as_array().expect("plans");
    assert!(plans.iter().any(|p| p["config"]["ep"] == 2), "{out}");
    // A plan's `dp` counts the `ep` ranks: dp=4, ep=2 is the mesh dp=2, ep=2.
    let file = plan_file("ep_plan", "dp=4,ep=2,mbs=2,gbs=8,zero=1,dtype=f32");
    let out = autopar_ok(&["run", "moe-tiny", "--plan-file", &file, "--verify"]);
    assert!(out.contains("ranks: 4 (dp=2, ep=2)"), "{out}");
    assert!(out.trim_end().ends_with(" OK"), "{out}");
}
