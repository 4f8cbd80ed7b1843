//! The expert-parallel policy on moe-tiny's forward graph: the batch is split over `dp` and
//! `ep`, routing runs on each rank's sequences, the experts stay on their ranks, and the
//! requests it cannot honour are errors that say why.

use autopar_frontends::zoo;
use autopar_ir::{DeviceMesh, Graph, Op, Placement};
use autopar_passes::PassError;
use autopar_passes::parallelize::{ParallelOptions, parallelize};

fn mesh(s: &str) -> DeviceMesh {
    DeviceMesh::parse(s).expect("ok")
}

fn moe_tiny(batch: usize) -> Graph {
    zoo::build("moe-tiny", batch).expect("builds")
}

#[test]
fn routing_runs_on_group_shards_and_experts_stay_put() {
    let p = parallelize(
        &moe_tiny(8),
        &mesh("dp=2,ep=2"),
        &ParallelOptions::default(),
    )
    .expect("parallelizes");
    let g = &p.graph;
    let on = |v, axis: &str| g.value(v).sharding.as_ref().and_then(|s| s.get(axis));
    for (v, name, _) in g.inputs() {
        assert_eq!(on(v, "dp"), Some(Placement::Shard(0)), "{name}");
        assert_eq!(on(v, "ep"), Some(Placement::Shard(0)), "{name}");
    }
    let mut routes = 0;
    for n in g.nodes_in_order() {
        let node = g.node(n);
        if let Op::MoeRoute { .. } = node.op {
            routes += 1;
            for &v in node.inputs.iter().chain(&node.outputs) {
                assert_eq!(on(v, "ep"), Some(Placement::Shard(0)), "{v}");
            }
        }
    }
    assert_eq!(routes, 2);
    for (v, name, _) in g.parameters() {
        let expected = if name.contains(".mlp.") && !name.ends_with("router") {
            Placement::Shard(0)
        } else {
            Placement::Replicate
        };
        assert_eq!(on(v, "ep"), Some(expected), "{name}");
    }
}

#[test]
fn expert_parallelism_needs_experts_and_an_even_batch() {
    let opts = ParallelOptions::default();
    // No MoE layer.
    let gpt = zoo::build("gpt-tiny", 8).expect("builds");
    let err = parallelize(&gpt, &mesh("ep=2"), &opts).expect_err("no experts");
    assert!(
        matches!(err, PassError::BadOption { .. }) && err.to_string().contains("no MoE layer"),
        "{err}"
    );
    // MoE layers, but no weight sharded on `ep` (the annotations dropped).
    let mut bare = moe_tiny(8);
    let params: Vec<_> = bare.parameters().into_iter().map(|(v, _, _)| v).collect();
    for v in params {
        bare.set_sharding(v, None).expect("ok");
    }
    let err = parallelize(&bare, &mesh("ep=2"), &opts).expect_err("no expert weights");
    assert!(err.to_string().contains("shards no weight"), "{err}");
    // A batch of 6 over dp=2 and ep=2: `ep` is where the split stops being even.
    let err = parallelize(&moe_tiny(6), &mesh("dp=2,ep=2"), &opts).expect_err("uneven batch");
    match err {
        PassError::UnevenShard {
            tensor, dim, axis, ..
        } => {
            assert_eq!((tensor.as_str(), dim, axis.as_str()), ("tokens", 0, "ep"));
        }
        other => panic!("{other}"),
    }
    // 4 experts over 8 ranks (the batch of 8 divides).
    let err = parallelize(&moe_tiny(8), &mesh("ep=8"), &opts).expect_err("uneven experts");
    match err {
        PassError::UnevenShard {
            tensor, dim, axis, ..
        } => {
            assert_eq!(
                (tensor.as_str(), dim, axis.as_str()),
                ("h.0.mlp.w1", 0, "ep")
            );
        }
        other => panic!("{other}"),
    }
}
