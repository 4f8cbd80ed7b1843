//! Propagation's tie-break and sizes across axes on llama-tiny's training step, whose token
//! embedding is sharded on its vocabulary over `tp` and untied: its gradient is the
//! scatter-add itself, which must build each `tp` rank's rows (the strategy that meets the
//! table's demand, where the replicated one costs the same), and on `dp`, which runs first,
//! must leave partial sums to reduce (priced at the `tp` shard) rather than gather the
//! tokens' ids and gradients (cheaper only against the whole table).

use autopar_frontends::zoo;
use autopar_ir::{DeviceMesh, Graph, NodeId, Op, Placement, ReduceKind};
use autopar_passes::parallelize::{ParallelOptions, Parallelized, parallelize};
use autopar_passes::partition::partition_all;
use autopar_passes::propagate::AxisKernel;
use autopar_passes::sharding::Lowering;
use autopar_passes::train::{TrainOptions, build_train_step};

fn llama_step(batch: usize) -> Graph {
    let forward = zoo::build("llama-tiny", batch).expect("builds");
    build_train_step(&forward, &TrainOptions::default())
        .expect("a training step")
        .graph
}

fn parallelized(batch: usize, mesh: &str) -> Parallelized {
    let mesh = DeviceMesh::parse(mesh).expect("mesh");
    parallelize(&llama_step(batch), &mesh, &ParallelOptions::default()).expect("parallelizes")
}

fn scatter_add(g: &Graph) -> NodeId {
    let found: Vec<NodeId> = g
        .nodes_in_order()
        .into_iter()
        .filter(|&n| matches!(g.node(n).op, Op::ScatterAdd { .. }))
        .collect();
    assert_eq!(found.len(), 1, "llama-tiny has one embedding gradient");
    found[0]
}

#[test]
fn the_untied_embedding_gradient_builds_the_tp_ranks_rows() {
    for batch in [8, 12] {
        for mesh in ["tp=2", "dp=2,tp=2"] {
            let p = parallelized(batch, mesh);
            let n = scatter_add(&p.graph);
            let axes: Vec<&str> = p.plan.axes.iter().map(|(a, _)| a.as_str()).collect();
            let chosen = &p.plan.strategies[&n];
            let tp = axes.iter().position(|&a| a == "tp").expect("tp");
            assert_eq!(
                chosen[tp].kernel,
                AxisKernel::Lowered(Lowering::RowParallelScatterAdd),
                "batch {batch} on {mesh}: {}",
                chosen[tp]
            );
            if let Some(dp) = axes.iter().position(|&a| a == "dp") {
                assert_eq!(
                    chosen[dp].operands,
                    vec![Placement::Shard(0), Placement::Shard(0)],
                    "batch {batch} on {mesh}: {}",
                    chosen[dp]
                );
                assert_eq!(
                    chosen[dp].results,
                    vec![Placement::Partial(ReduceKind::Sum)],
                    "batch {batch} on {mesh}"
                );
            }
            let result = p.graph.node(n).outputs[0];
            let sharding = p.graph.value(result).sharding.as_ref().expect("sharded");
            assert_eq!(sharding.get("tp"), Some(Placement::Shard(0)), "{mesh}");
        }
    }
}

#[test]
fn zero_placements_demand_nothing() {
    // ZeRO fixes each gradient to a shard over `dp` as a policy, which is no user sharding:
    // it breaks no tie. (Spreading from there through the backward, a demand would pull the
    // weight gradients' inputs off their batch shards, into all-to-alls and gathers.)
    let mesh = DeviceMesh::parse("dp=2").expect("mesh");
    for zero in [1, 2, 3] {
        let options = ParallelOptions {
            zero,
            ..ParallelOptions::default()
        };
        let p = parallelize(&llama_step(8), &mesh, &options).expect("parallelizes");
        let programs = partition_all(&p.graph, &p.plan).expect("partitions");
        for (rank, g) in programs.iter().enumerate() {
            let all_to_all = g
                .nodes_in_order()
                .into_iter()
                .filter(|&n| matches!(g.node(n).op, Op::AllToAll { .. }))
                .count();
            assert_eq!(all_to_all, 0, "ZeRO-{zero}, rank {rank}");
        }
    }
}
