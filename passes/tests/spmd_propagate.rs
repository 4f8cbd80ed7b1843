//! Sharding propagation and partitioning on a small two-layer MLP: annotations are kept,
//! every value gets a complete sharding, the result is deterministic, the Megatron MLP needs
//! exactly one all-reduce, and every rank's program runs to the reference's loss.

use autopar_ir::{
    DType, DeviceMesh, Graph, Init, InputRole, Op, Placement, ReduceOp, Sharding, ShardingOrigin,
    TensorType, UnaryOp, ValueId, text,
};
use autopar_passes::PassError;
use autopar_passes::parallelize::{ParallelOptions, parallelize};
use autopar_passes::partition::partition_all;
use autopar_runtime::{RankProgram, RunOptions, SpmdOptions, init_parameters, run, run_spmd};

fn mlp() -> (Graph, ValueId, ValueId) {
    let mut g = Graph::new("mlp");
    let f32_ty = |dims: &[usize]| TensorType::new(DType::F32, dims.to_vec());
    let x = g
        .add(
            Op::Input {
                name: "x".into(),
                ty: f32_ty(&[8, 16]),
                role: InputRole::Features,
            },
            &[],
        )
        .expect("ok");
    let param = |g: &mut Graph, name: &str, dims: &[usize], dim: usize| {
        let v = g
            .add(
                Op::Parameter {
                    name: name.into(),
                    ty: f32_ty(dims),
                    init: Init::Normal { std: 0.3 },
                },
                &[],
            )
            .expect("ok");
        let s = Sharding::user([("tp".to_string(), Placement::Shard(dim))]);
        g.set_sharding(v, Some(s)).expect("ok");
        v
    };
    let w1 = param(&mut g, "w1", &[16, 32], 1);
    let w2 = param(&mut g, "w2", &[32, 16], 0);
    let einsum = |g: &mut Graph, spec: &str, a, b| {
        g.add(
            Op::Einsum {
                spec: spec.parse().expect("ok"),
            },
            &[a, b],
        )
        .expect("ok")
    };
    let h = einsum(&mut g, "bi,ih->bh", x, w1);
    let h = g
        .add(
            Op::Unary {
                func: UnaryOp::Gelu,
            },
            &[h],
        )
        .expect("ok");
    let y = einsum(&mut g, "bh,ho->bo", h, w2);
    let sq = g
        .add(
            Op::Unary {
                func: UnaryOp::Square,
            },
            &[y],
        )
        .expect("ok");
    let loss = g
        .add(
            Op::Reduce {
                func: ReduceOp::Mean,
                dims: vec![0, 1],
            },
            &[sq],
        )
        .expect("ok");
    g.add_output("loss", loss).expect("ok");
    (g, w1, h)
}

fn mesh(s: &str) -> DeviceMesh {
    DeviceMesh::parse(s).expect("ok")
}

#[test]
fn complete_deterministic_and_keeps_annotations() {
    let (g, w1, h) = mlp();
    let p = parallelize(&g, &mesh("dp=2,tp=2"), &ParallelOptions::default()).expect("ok");
    for v in p.graph.value_ids() {
        let s = p.graph.value(v).sharding.clone().expect("ok");
        let axes: Vec<&str> = s.axes.iter().map(|(a, _)| a.as_str()).collect();
        assert_eq!(axes, ["dp", "tp"], "{v}");
    }
    let w1s = p.graph.value(w1).sharding.clone().expect("ok");
    assert_eq!(w1s.origin, ShardingOrigin::User);
    assert_eq!(w1s.get("tp"), Some(Placement::Shard(1)));
    // The column-parallel hidden layer: batch on dp, features on tp.
    let hs = p.graph.value(h).sharding.clone().expect("ok");
    assert_eq!(hs.get("dp"), Some(Placement::Shard(0)));
    assert_eq!(hs.get("tp"), Some(Placement::Shard(1)));
    let again = parallelize(&g, &mesh("dp=2,tp=2"), &ParallelOptions::default()).expect("ok");
    assert_eq!(text::print(&p.graph), text::print(&again.graph));
    assert_eq!(p.plan, again.plan);
}

#[test]
fn megatron_mlp_needs_one_all_reduce_and_matches_the_reference() {
    let (g, _, _) = mlp();
    let mesh = mesh("tp=2");
    let p = parallelize(&g, &mesh, &ParallelOptions::default()).expect("ok");
    let programs = partition_all(&p.graph, &p.plan).expect("ok");
    for local in &programs {
        let collectives: Vec<&Op> = local
            .node_ids()
            .into_iter()
            .map(|n| &local.node(n).op)
            .filter(|op| op.is_communication())
            .collect();
        assert_eq!(collectives.len(), 1, "{collectives:?}");
        assert!(matches!(collectives[0], Op::AllReduce { .. }));
    }
    let params = init_parameters(&g, 1).expect("ok");
    let batch = autopar_runtime::synthetic_batch(&g, 1, 0).expect("ok");
    let want = run(&g, &params, &batch, RunOptions::default())
        .expect("ok")
        .scalar("loss")
        .expect("ok");
    // Rank r holds columns (w1) or rows (w2) r*16..(r+1)*16.
    let shard = |name: &str, rank: usize| {
        let t = &params[name];
        let v = t.to_f64_vec();
        let (rows, cols) = (t.dims()[0], t.dims()[1]);
        let (ty, data): (Vec<usize>, Vec<f64>) = if name == "w1" {
            let c = cols / 2;
            (
                vec![rows, c],
                (0..rows)
                    .flat_map(|i| (0..c).map(move |j| (i, j)))
                    .map(|(i, j)| v[i * cols + rank * c + j])
                    .collect(),
            )
        } else {
            let r = rows / 2;
            (
                vec![r, cols],
                v[rank * r * cols..(rank + 1) * r * cols].to_vec(),
            )
        };
        autopar_runtime::Tensor::from_f64(TensorType::new(DType::F32, ty), data).expect("ok")
    };
    let states: Vec<autopar_runtime::TensorMap> = (0..2)
        .map(|r| {
            [("w1", shard("w1", r)), ("w2", shard("w2", r))]
                .into_iter()
                .map(|(n, t)| (n.to_string(), t))
                .collect()
        })
        .collect();
    let ranks: Vec<RankProgram<'_>> = programs
        .iter()
        .zip(&states)
        .map(|(graph, params)| RankProgram {
            graph,
            params,
            inputs: &batch,
        })
        .collect();
    let outs = run_spmd(&mesh, &ranks, SpmdOptions::default()).expect("ok");
    for out in outs {
        let got = out.scalar("loss").expect("ok");
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}

#[test]
fn uneven_annotations_name_the_tensor_dim_and_axis() {
    let (g, _, _) = mlp();
    let err = parallelize(&g, &mesh("tp=3"), &ParallelOptions::default()).unwrap_err();
    assert!(matches!(err, PassError::UnevenShard { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("`w1`") && msg.contains("dim 1") && msg.contains("mesh axis `tp`"),
        "{msg}"
    );
}

#[test]
fn axes_the_mesh_lacks_are_ignored() {
    let (g, w1, _) = mlp();
    let p = parallelize(&g, &mesh("dp=4"), &ParallelOptions::default()).expect("ok");
    let s = p.graph.value(w1).sharding.clone().expect("ok");
    assert_eq!(s.axes, vec![("dp".to_string(), Placement::Replicate)]);
    let programs = partition_all(&p.graph, &p.plan).expect("ok");
    assert_eq!(programs.len(), 4);
}
