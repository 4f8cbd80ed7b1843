//! The gradient of a token embedding sharded over `tp` on its vocabulary is vocabulary
//! parallel, as Megatron's `VocabParallelEmbedding` computes it: every rank scatter-adds its
//! tokens' gradients into the rows of its own shard, with no gathered ids or gradients and no
//! full-vocabulary table, and the data-parallel reduction then moves exactly that shard.
//! Llama-style models (an untied embedding, whose gradient is the scatter-add itself) are
//! held to it as well as GPT's tied one.

use std::collections::BTreeSet;

use autopar_driver::{CompileOptions, Pass, RunOptions, compile, run};
use autopar_ir::{DType, Graph, LayerId, NodeId, Op, Phase, TensorType, WeightRole};

const MODELS: &[&str] = &[
    "llama-tiny",
    "gpt-tiny",
    "llama:layers=2,hidden=64,heads=4,ffn=128,seq=16,vocab=128",
    "moe:layers=2,hidden=64,heads=4,seq=16,vocab=128,experts=4,top_k=2,ffn=128,style=llama",
];

/// Every rank's partitioned program (before fusion and bucketing) of `model` on `mesh`.
fn partitioned(model: &str, mesh: &str, batch: Option<usize>) -> Vec<Graph> {
    let mut options = CompileOptions::new(model).on_mesh(mesh).expect("mesh");
    options.batch = batch;
    options.stop_after = Some(Pass::Partition);
    compile(&options)
        .unwrap_or_else(|e| panic!("{model} on {mesh} compiles: {e}"))
        .locals
}

/// The local type of the token embedding table in `g`.
fn table(g: &Graph) -> TensorType {
    let tables: Vec<TensorType> = g
        .nodes_in_order()
        .into_iter()
        .filter(|&n| {
            matches!(g.node(n).op, Op::Parameter { .. })
                && g.meta(n).role == Some(WeightRole::TokenEmbedding)
        })
        .map(|n| g.ty(g.node(n).outputs[0]).clone())
        .collect();
    assert_eq!(tables.len(), 1, "one token embedding: {tables:?}");
    tables[0].clone()
}

/// The nodes of the embedding's backward.
fn embedding_backward(g: &Graph) -> Vec<NodeId> {
    g.nodes_in_order()
        .into_iter()
        .filter(|&n| {
            let meta = g.meta(n);
            meta.phase == Some(Phase::Backward) && meta.layer == Some(LayerId::Embedding)
        })
        .collect()
}

/// Bytes of the results of `g`'s communication ops among `nodes` whose axes include `axis`.
fn communicated_bytes(g: &Graph, nodes: &[NodeId], axis: &str) -> u64 {
    nodes
        .iter()
        .filter(|&&n| {
            let op = &g.node(n).op;
            op.is_communication()
                && match op {
                    Op::AllReduce { axes, .. }
                    | Op::AllGather { axes, .. }
                    | Op::ReduceScatter { axes, .. }
                    | Op::AllToAll { axes, .. } => axes.iter().any(|a| a == axis),
                    _ => true,
                }
        })
        .map(|&n| g.ty(g.node(n).outputs[0]).size_bytes())
        .sum()
}

/// Checks the embedding backward of every rank of `model` on `mesh` (see the module docs).
fn check(model: &str, mesh: &str, batch: Option<usize>, tp: usize, dp: usize) {
    let vocab = vocabulary(model);
    for (rank, g) in partitioned(model, mesh, batch).iter().enumerate() {
        let at = format!("{model} on {mesh} (batch {batch:?}), rank {rank}");
        let shard = table(g);
        let rows = shard.dims()[0];
        let hidden = shard.dims()[1];
        let nodes = embedding_backward(g);
        let scatters: Vec<NodeId> = nodes
            .iter()
            .copied()
            .filter(|&n| matches!(g.node(n).op, Op::ScatterAdd { .. }))
            .collect();
        assert_eq!(scatters.len(), 1, "{at}: one scatter-add");
        let scatter = scatters[0];
        assert_eq!(
            g.node(scatter).op,
            Op::ScatterAdd { num_rows: rows },
            "{at}: the scatter-add builds the rank's {rows} rows"
        );
        assert_eq!(g.ty(g.node(scatter).outputs[0]), &shard, "{at}");
        for &n in &nodes {
            assert!(
                !matches!(g.node(n).op, Op::AllGather { .. }),
                "{at}: {n} gathers for the embedding's gradient"
            );
            // No value is a whole table, nor larger than the shard or the rank's updates.
            for &v in &g.node(n).outputs {
                let ty = g.ty(v);
                assert!(
                    !(ty.dtype == DType::F32 && ty.dims() == [vocab, hidden]),
                    "{at}: {v} is the whole table ({ty})"
                );
                assert!(
                    ty.num_elements() <= shard.num_elements().max(largest_update(g, scatter)),
                    "{at}: {v} is {ty}, larger than the shard {shard}"
                );
            }
        }
        let path = connected(g, &nodes, scatter);
        let dp_bytes = communicated_bytes(g, &path, "dp");
        let expected = if dp > 1 { shard.size_bytes() } else { 0 };
        assert_eq!(
            dp_bytes, expected,
            "{at}: the data-parallel reduction moves the shard's gradient"
        );
        assert_eq!(
            communicated_bytes(g, &path, "tp"),
            0,
            "{at}: nothing moves over tp"
        );
        assert_eq!(
            rows * tp,
            vocab,
            "{at}: the shard is 1/{tp} of the vocabulary"
        );
    }
}

/// The nodes among `nodes` that `from` reads from or feeds, through nodes among `nodes`:
/// the token embedding's gradient, without the position embedding's beside it.
fn connected(g: &Graph, nodes: &[NodeId], from: NodeId) -> Vec<NodeId> {
    let inside: BTreeSet<NodeId> = nodes.iter().copied().collect();
    let mut seen = BTreeSet::from([from]);
    let mut upstream = vec![from];
    while let Some(n) = upstream.pop() {
        for &v in &g.node(n).inputs {
            let p = g.value(v).producer;
            if inside.contains(&p) && seen.insert(p) {
                upstream.push(p);
            }
        }
    }
    let mut downstream = vec![from];
    while let Some(n) = downstream.pop() {
        for &v in &g.node(n).outputs {
            for (u, _) in g.users(v) {
                if inside.contains(&u) && seen.insert(u) {
                    downstream.push(u);
                }
            }
        }
    }
    seen.into_iter().collect()
}

/// Elements of the updates the scatter-add reads (the rank's tokens' gradients).
fn largest_update(g: &Graph, scatter: NodeId) -> u64 {
    g.ty(g.node(scatter).inputs[1]).num_elements()
}

/// The vocabulary of `model` (rows of its global embedding table).
fn vocabulary(model: &str) -> usize {
    let mut options = CompileOptions::new(model);
    options.stop_after = Some(Pass::TrainStep);
    let step = compile(&options).expect("compiles");
    table(&step.global).dims()[0]
}

#[test]
fn the_embedding_gradient_is_vocabulary_parallel_on_dp_and_tp() {
    for model in MODELS {
        check(model, "dp=2,tp=2", None, 2, 2);
    }
}

#[test]
fn the_embedding_gradient_is_vocabulary_parallel_on_tp() {
    for model in MODELS {
        check(model, "tp=2", None, 2, 1);
    }
}

#[test]
fn larger_batches_keep_the_embedding_gradient_on_its_shard() {
    // At 12 sequences gathering the tokens' gradients costs more than reducing the whole
    // table: the reduction must still be of the shard alone.
    check("llama-tiny", "dp=2,tp=2", Some(12), 2, 2);
    check("llama-tiny", "dp=2,tp=2", Some(16), 2, 2);
}

#[test]
fn llama_with_the_vocabulary_parallel_gradient_matches_the_reference() {
    let options = CompileOptions::new("llama-tiny")
        .on_mesh("dp=2,tp=2")
        .expect("mesh");
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
    assert!(report.ok(), "{}", report.line());
}
