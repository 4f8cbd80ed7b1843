//! End-to-end runs of hand-partitioned programs on several ranks, each checked against the
//! single-device interpreter on the global program: data parallelism (local gradients
//! all-reduced), a Megatron-style tensor-parallel MLP (column- then row-split, one
//! all-reduce), both at once on a 2-D mesh, and a two-stage pipeline with send and recv.

use autopar_ir::{
    BinaryOp, DType, DeviceMesh, Graph, Init, InputRole, Op, ReduceKind, ReduceOp, TensorType,
    UnaryOp, ValueId,
};
use autopar_runtime::{
    Precision, RankProgram, RunOptions, RunOutput, RuntimeError, SpmdOptions, Tensor, TensorMap,
    eval_op, init_parameters, run, run_spmd, synthetic_batch,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn input(g: &mut Graph, name: &str, dtype: DType, dims: &[usize]) -> Result<ValueId, RuntimeError> {
    let ty = TensorType::new(dtype, dims.to_vec());
    Ok(g.add(
        Op::Input {
            name: name.into(),
            ty,
            role: InputRole::Features,
        },
        &[],
    )?)
}

fn param(g: &mut Graph, name: &str, dtype: DType, dims: &[usize]) -> Result<ValueId, RuntimeError> {
    let ty = TensorType::new(dtype, dims.to_vec());
    Ok(g.add(
        Op::Parameter {
            name: name.into(),
            ty,
            init: Init::Normal { std: 0.5 },
        },
        &[],
    )?)
}

fn einsum(
    g: &mut Graph,
    spec: &str,
    a: ValueId,
    b: ValueId,
) -> Result<ValueId, Box<dyn std::error::Error>> {
    Ok(g.add(
        Op::Einsum {
            spec: spec.parse()?,
        },
        &[a, b],
    )?)
}

/// Part `part` of `parts` of `x` along `dim`.
fn shard(x: &Tensor, dim: usize, part: usize, parts: usize) -> Result<Tensor, RuntimeError> {
    let len = x.dims()[dim] / parts;
    let op = Op::Slice {
        dim,
        start: part * len,
        end: (part + 1) * len,
    };
    Ok(eval_op(&op, &[x], Precision::Declared)?.remove(0))
}

fn sum_over(axes: &[&str]) -> Op {
    Op::AllReduce {
        axes: axes.iter().map(|s| s.to_string()).collect(),
        reduce: ReduceKind::Sum,
    }
}

fn close(got: &Tensor, want: &Tensor, rtol: f64, what: &str) {
    assert!(
        got.all_close(want, rtol, rtol),
        "{what}: got {:?}, want {:?}",
        got.floats(),
        want.floats()
    );
}

/// A linear model's gradient: `dw = x^T (x w - t)` over the batch, and the predictions.
/// `dp` is the number of data-parallel ranks (1: the global program).
fn linear_gradient(
    mesh: Option<&DeviceMesh>,
    batch: usize,
) -> Result<Graph, Box<dyn std::error::Error>> {
    let mut g = Graph::new("linear_gradient");
    g.set_mesh(mesh.cloned());
    let x = input(&mut g, "x", DType::F32, &[batch, 6])?;
    let t = input(&mut g, "t", DType::F32, &[batch, 3])?;
    let w = param(&mut g, "w", DType::F32, &[6, 3])?;
    let y = einsum(&mut g, "bf,fo->bo", x, w)?;
    let err = g.add(
        Op::Binary {
            func: BinaryOp::Sub,
        },
        &[y, t],
    )?;
    let mut dw = einsum(&mut g, "bf,bo->fo", x, err)?;
    if mesh.is_some() {
        dw = g.add(sum_over(&["dp"]), &[dw])?;
    }
    g.add_output("dw", dw)?;
    g.add_output("y", y)?;
    Ok(g)
}

#[test]
fn data_parallel_gradients_match_the_global_program() -> TestResult {
    let (dp, batch) = (4, 16);
    let global = linear_gradient(None, batch)?;
    let params = init_parameters(&global, 1)?;
    let inputs = {
        let mut m = TensorMap::new();
        let x = synthetic_batch(&global, 2, 0)?;
        for name in ["x", "t"] {
            let t = &x[name];
            let values = t.to_f64_vec().iter().map(|v| v * 0.5 + 0.1).collect();
            m.insert(name.into(), Tensor::from_f64(t.ty().clone(), values)?);
        }
        m
    };
    let want = run(&global, &params, &inputs, RunOptions::default())?;

    let mesh = DeviceMesh::parse(&format!("dp={dp}"))?;
    let local = linear_gradient(Some(&mesh), batch / dp)?;
    let shards: Vec<TensorMap> = (0..dp)
        .map(|r| {
            let mut m = TensorMap::new();
            for name in ["x", "t"] {
                m.insert(name.into(), shard(&inputs[name], 0, r, dp)?);
            }
            Ok(m)
        })
        .collect::<Result<_, RuntimeError>>()?;
    let ranks: Vec<RankProgram<'_>> = shards
        .iter()
        .map(|inputs| RankProgram {
            graph: &local,
            params: &params,
            inputs,
        })
        .collect();
    let outs = run_spmd(&mesh, &ranks, SpmdOptions::default())?;
    let want_dw = want.output("dw")?;
    for (r, out) in outs.iter().enumerate() {
        // Partial sums are rounded to f32 on each rank before the all-reduce adds them.
        close(out.output("dw")?, want_dw, 1e-5, "dw");
        // Every rank holds the same bits.
        assert_eq!(out.output("dw")?, outs[0].output("dw")?);
        close(
            out.output("y")?,
            &shard(want.output("y")?, 0, r, dp)?,
            1e-6,
            "y",
        );
        // A rank holds a quarter of the batch, so it needs less memory than one device.
        assert!(out.peak_bytes > 0 && out.peak_bytes < want.peak_bytes);
    }
    Ok(())
}

/// A two-layer MLP `relu(x w1) w2`; with `tp > 1`, `w1` is split by columns and `w2` by
/// rows over `tp`, and one all-reduce over `tp` sums the partial outputs. With `dp > 1` the
/// batch is split too, and the sum of squares is all-reduced over `dp`.
fn mlp(
    mesh: Option<&DeviceMesh>,
    dtype: DType,
    batch: usize,
    hidden: usize,
) -> Result<Graph, Box<dyn std::error::Error>> {
    let mut g = Graph::new("mlp");
    g.set_mesh(mesh.cloned());
    let x = input(&mut g, "x", dtype, &[batch, 8])?;
    let w1 = param(&mut g, "w1", dtype, &[8, hidden])?;
    let w2 = param(&mut g, "w2", dtype, &[hidden, 8])?;
    let h = einsum(&mut g, "bd,dh->bh", x, w1)?;
    let h = g.add(
        Op::Unary {
            func: UnaryOp::Relu,
        },
        &[h],
    )?;
    let mut out = einsum(&mut g, "bh,hd->bd", h, w2)?;
    let tp = mesh.and_then(|m| m.axis_size("tp"));
    if tp.is_some() {
        out = g.add(sum_over(&["tp"]), &[out])?;
    }
    let sq = g.add(
        Op::Unary {
            func: UnaryOp::Square,
        },
        &[out],
    )?;
    let mut loss = g.add(
        Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![0, 1],
        },
        &[sq],
    )?;
    if mesh.and_then(|m| m.axis_size("dp")).is_some() {
        loss = g.add(sum_over(&["dp"]), &[loss])?;
    }
    g.add_output("out", out)?;
    g.add_output("loss", loss)?;
    Ok(g)
}

/// Runs the MLP on `mesh` (axes `dp` and/or `tp`) and checks every rank's output rows and the
/// loss against the global program.
fn check_mlp(mesh: &DeviceMesh, dtype: DType, rtol: f64) -> TestResult {
    let (batch, hidden) = (8, 16);
    let dp = mesh.axis_size("dp").unwrap_or(1);
    let tp = mesh.axis_size("tp").unwrap_or(1);
    let global = mlp(None, dtype, batch, hidden)?;
    let params = init_parameters(&global, 3)?;
    let inputs = synthetic_batch(&global, 4, 0)?;
    let want = run(&global, &params, &inputs, RunOptions::default())?;

    let local = mlp(Some(mesh), dtype, batch / dp, hidden / tp)?;
    let mut feeds = Vec::new();
    for rank in 0..mesh.num_devices() {
        let c = mesh.coords(rank);
        let coord = |axis: &str| mesh.axis_index(axis).map_or(0, |i| c[i]);
        let (d, t) = (coord("dp"), coord("tp"));
        let mut p = TensorMap::new();
        p.insert("w1".into(), shard(&params["w1"], 1, t, tp)?);
        p.insert("w2".into(), shard(&params["w2"], 0, t, tp)?);
        let mut x = TensorMap::new();
        x.insert("x".into(), shard(&inputs["x"], 0, d, dp)?);
        feeds.push((p, x, d));
    }
    let ranks: Vec<RankProgram<'_>> = feeds
        .iter()
        .map(|(params, inputs, _)| RankProgram {
            graph: &local,
            params,
            inputs,
        })
        .collect();
    let outs: Vec<RunOutput> = run_spmd(mesh, &ranks, SpmdOptions::default())?;
    for (out, (_, _, d)) in outs.iter().zip(&feeds) {
        close(
            out.output("out")?,
            &shard(want.output("out")?, 0, *d, dp)?,
            rtol,
            "out",
        );
        close(out.output("loss")?, want.output("loss")?, rtol, "loss");
    }
    Ok(())
}

#[test]
fn tensor_parallel_mlp_matches_the_global_program() -> TestResult {
    check_mlp(&DeviceMesh::parse("tp=2")?, DType::F32, 1e-5)?;
    check_mlp(&DeviceMesh::parse("tp=4")?, DType::F32, 1e-5)?;
    // bf16 rounds each rank's partial product before the sum: a few bf16 ulps.
    check_mlp(&DeviceMesh::parse("tp=2")?, DType::BF16, 3e-2)
}

#[test]
fn data_and_tensor_parallel_mlp_on_a_2d_mesh() -> TestResult {
    check_mlp(&DeviceMesh::parse("dp=2,tp=2")?, DType::F32, 1e-5)?;
    check_mlp(&DeviceMesh::parse("tp=2,dp=2")?, DType::F32, 1e-5)?;
    check_mlp(&DeviceMesh::parse("dp=2,tp=4")?, DType::F32, 1e-5)
}

#[test]
fn two_pipeline_stages_pass_activations_with_send_and_recv() -> TestResult {
    let global = mlp(None, DType::F32, 4, 16)?;
    let params = init_parameters(&global, 5)?;
    let inputs = synthetic_batch(&global, 6, 0)?;
    let want = run(&global, &params, &inputs, RunOptions::default())?;

    let mesh = DeviceMesh::parse("pp=2")?;
    // Stage 0: the first layer, sent on.
    let mut first = Graph::new("stage0");
    first.set_mesh(Some(mesh.clone()));
    let x = input(&mut first, "x", DType::F32, &[4, 8])?;
    let w1 = param(&mut first, "w1", DType::F32, &[8, 16])?;
    let h = einsum(&mut first, "bd,dh->bh", x, w1)?;
    let h = first.add(
        Op::Unary {
            func: UnaryOp::Relu,
        },
        &[h],
    )?;
    first.add_node(
        Op::Send {
            axis: "pp".into(),
            shift: 1,
        },
        &[h],
    )?;
    // Stage 1: receives the activations and applies the second layer.
    let mut second = Graph::new("stage1");
    second.set_mesh(Some(mesh.clone()));
    let h = second.add(
        Op::Recv {
            axis: "pp".into(),
            shift: -1,
            ty: TensorType::new(DType::F32, [4, 16]),
        },
        &[],
    )?;
    let w2 = param(&mut second, "w2", DType::F32, &[16, 8])?;
    let out = einsum(&mut second, "bh,hd->bd", h, w2)?;
    second.add_output("out", out)?;

    let none = TensorMap::new();
    let ranks = [
        RankProgram {
            graph: &first,
            params: &params,
            inputs: &inputs,
        },
        RankProgram {
            graph: &second,
            params: &params,
            inputs: &none,
        },
    ];
    let outs = run_spmd(&mesh, &ranks, SpmdOptions::default())?;
    assert!(outs[0].outputs.is_empty());
    // The same arithmetic on the same values: the same bits.
    assert_eq!(outs[1].output("out")?, want.output("out")?);
    Ok(())
}

#[test]
fn spmd_runs_are_reproducible() -> TestResult {
    let mesh = DeviceMesh::parse("dp=2,tp=2")?;
    let global = mlp(None, DType::F32, 8, 16)?;
    let local = mlp(Some(&mesh), DType::F32, 4, 8)?;
    let params = init_parameters(&global, 7)?;
    let inputs = synthetic_batch(&global, 8, 0)?;
    let mut feeds = Vec::new();
    for rank in 0..4 {
        let (d, t) = (rank / 2, rank % 2);
        let mut p = TensorMap::new();
        p.insert("w1".into(), shard(&params["w1"], 1, t, 2)?);
        p.insert("w2".into(), shard(&params["w2"], 0, t, 2)?);
        let mut x = TensorMap::new();
        x.insert("x".into(), shard(&inputs["x"], 0, d, 2)?);
        feeds.push((p, x));
    }
    let ranks: Vec<RankProgram<'_>> = feeds
        .iter()
        .map(|(params, inputs)| RankProgram {
            graph: &local,
            params,
            inputs,
        })
        .collect();
    let first = run_spmd(&mesh, &ranks, SpmdOptions::default())?;
    for _ in 0..10 {
        assert_eq!(run_spmd(&mesh, &ranks, SpmdOptions::default())?, first);
    }
    Ok(())
}

#[test]
fn setup_errors_are_reported_before_running() -> TestResult {
    let mesh = DeviceMesh::parse("dp=2")?;
    let g = linear_gradient(Some(&mesh), 2)?;
    let empty = TensorMap::new();
    let one = [RankProgram {
        graph: &g,
        params: &empty,
        inputs: &empty,
    }];
    let err = run_spmd(&mesh, &one, SpmdOptions::default()).expect_err("one program for two");
    assert!(matches!(err, RuntimeError::SpmdSetup { .. }), "{err}");
    let other = DeviceMesh::parse("dp=2,tp=1")?;
    let err = run_spmd(&other, &[one[0], one[0]], SpmdOptions::default())
        .expect_err("program for another mesh");
    assert!(err.to_string().contains("not `dp=2, tp=1`"), "{err}");
    // A missing feed on every rank is reported with the lowest rank.
    let err = run_spmd(&mesh, &[one[0], one[0]], SpmdOptions::default()).expect_err("no feeds");
    assert!(
        matches!(&err, RuntimeError::OnRank { rank: 0, error } if matches!(**error, RuntimeError::Missing { .. })),
        "{err}"
    );
    Ok(())
}
