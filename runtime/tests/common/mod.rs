//! Helpers shared by the runtime's integration tests: tensor literals, one-op graphs, and a
//! small GPT-like model built by hand.

#![allow(dead_code)]

use autopar_ir::{
    BinaryOp, DType, Graph, Init, InputRole, IrError, Op, ReduceOp, Shape, TensorType, UnaryOp,
    ValueId,
};
use autopar_runtime::{Precision, RunOptions, RuntimeError, Tensor, TensorMap, run};

/// Error type of the tests (`?` on any error).
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// An f32 tensor (values rounded to f32).
pub fn f32t(dims: &[usize], values: &[f64]) -> Tensor {
    typed(DType::F32, dims, values)
}

/// A float tensor of `dtype`, rounded.
pub fn typed(dtype: DType, dims: &[usize], values: &[f64]) -> Tensor {
    Tensor::from_f64(TensorType::new(dtype, dims.to_vec()), values.to_vec())
        .expect("literal fits its type")
}

/// An i64 tensor.
pub fn i64t(dims: &[usize], values: &[i64]) -> Tensor {
    Tensor::from_i64(TensorType::new(DType::I64, dims.to_vec()), values.to_vec())
        .expect("literal fits its type")
}

/// A bool tensor.
pub fn boolt(dims: &[usize], values: &[bool]) -> Tensor {
    Tensor::from_bool(dims.to_vec(), values.to_vec()).expect("literal fits its type")
}

/// Runs `op` on `operands` (fed as graph inputs `x0`, `x1`, ...) with declared precision.
pub fn run_op(op: Op, operands: &[Tensor]) -> Result<Vec<Tensor>, RuntimeError> {
    run_op_with(op, operands, Precision::Declared)
}

/// Runs `op` on `operands` through a one-node graph, returning its results in order.
pub fn run_op_with(
    op: Op,
    operands: &[Tensor],
    precision: Precision,
) -> Result<Vec<Tensor>, RuntimeError> {
    let mut g = Graph::new("one_op");
    let mut inputs = TensorMap::new();
    let mut args = Vec::new();
    for (i, t) in operands.iter().enumerate() {
        let name = format!("x{i}");
        args.push(g.add(
            Op::Input {
                name: name.clone(),
                ty: t.ty().clone(),
                role: InputRole::Features,
            },
            &[],
        )?);
        inputs.insert(name, t.clone());
    }
    let node = g.add_node(op, &args)?;
    let results = g.node(node).outputs.clone();
    for (i, v) in results.iter().enumerate() {
        g.add_output(format!("y{i}"), *v)?;
    }
    let out = run(
        &g,
        &TensorMap::new(),
        &inputs,
        RunOptions {
            precision,
            ..RunOptions::default()
        },
    )?;
    (0..results.len())
        .map(|i| out.output(&format!("y{i}")).cloned())
        .collect()
}

/// Runs a single-result op.
pub fn run_one(op: Op, operands: &[Tensor]) -> Result<Tensor, RuntimeError> {
    let mut r = run_op(op, operands)?;
    Ok(r.remove(0))
}

/// Asserts that `t` is close to the expected values (absolute tolerance `tol`).
#[track_caller]
pub fn assert_close(t: &Tensor, dims: &[usize], expected: &[f64], tol: f64) {
    assert_eq!(t.dims(), dims, "shape");
    let got = t.to_f64_vec();
    assert_eq!(got.len(), expected.len(), "element count");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= tol || (g.is_nan() && e.is_nan()) || g == e,
            "element {i}: got {g}, expected {e} (all: {got:?})"
        );
    }
}

/// Sizes of the small GPT used in tests.
#[derive(Clone, Copy, Debug)]
pub struct GptConfig {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub seq: usize,
    pub batch: usize,
    pub vocab: usize,
}

/// A GPT-2-like language model with a mean next-token cross-entropy output `loss`:
/// token and position embeddings, pre-norm blocks of causal attention and a GELU MLP, a final
/// layer norm, and logits tied to the token embedding.
pub fn gpt(c: GptConfig) -> Result<Graph, IrError> {
    let GptConfig {
        layers,
        hidden: h,
        heads,
        seq: s,
        batch: b,
        vocab: v,
    } = c;
    let hd = h / heads;
    let mut g = Graph::new("gpt");
    let f32ty = |dims: &[usize]| TensorType::new(DType::F32, dims.to_vec());
    let param = |g: &mut Graph, name: &str, dims: &[usize], init: Init| {
        g.add(
            Op::Parameter {
                name: name.into(),
                ty: f32ty(dims),
                init,
            },
            &[],
        )
    };
    let normal = Init::Normal { std: 0.02 };
    let tokens = g.add(
        Op::Input {
            name: "tokens".into(),
            ty: TensorType::new(DType::I64, [b, s]),
            role: InputRole::Tokens { vocab: v },
        },
        &[],
    )?;
    let targets = g.add(
        Op::Input {
            name: "targets".into(),
            ty: TensorType::new(DType::I64, [b, s]),
            role: InputRole::NextTokens { vocab: v },
        },
        &[],
    )?;
    let wte = param(&mut g, "wte", &[v, h], normal.clone())?;
    let wpe = param(&mut g, "wpe", &[s, h], normal.clone())?;
    let tok = g.add(Op::Gather, &[wte, tokens])?;
    let pos = g.add(
        Op::Broadcast {
            shape: Shape::new([b, s, h]),
            dims: vec![1, 2],
        },
        &[wpe],
    )?;
    let add = Op::Binary {
        func: BinaryOp::Add,
    };
    let mut x = g.add(add.clone(), &[tok, pos])?;
    let matmul = |g: &mut Graph, x: ValueId, w: ValueId| -> Result<ValueId, IrError> {
        g.add(
            Op::Einsum {
                spec: "bsh,hf->bsf".parse().map_err(IrError::Verify)?,
            },
            &[x, w],
        )
    };
    let layer_norm = |g: &mut Graph, x: ValueId, name: &str| -> Result<ValueId, IrError> {
        let gamma = param(g, &format!("{name}.g"), &[h], Init::Ones)?;
        let beta = param(g, &format!("{name}.b"), &[h], Init::Zeros)?;
        g.add(Op::LayerNorm { eps: 1e-5 }, &[x, gamma, beta])
    };
    for l in 0..layers {
        let p = format!("h.{l}");
        let a = layer_norm(&mut g, x, &format!("{p}.ln1"))?;
        let heads_of = |g: &mut Graph, which: &str| -> Result<ValueId, IrError> {
            let w = param(g, &format!("{p}.attn.{which}"), &[h, h], normal.clone())?;
            let y = matmul(g, a, w)?;
            g.add(
                Op::Reshape {
                    shape: Shape::new([b, s, heads, hd]),
                },
                &[y],
            )
        };
        let (q, k, vv) = (
            heads_of(&mut g, "wq")?,
            heads_of(&mut g, "wk")?,
            heads_of(&mut g, "wv")?,
        );
        let att = g.add(
            Op::Attention {
                causal: true,
                scale: 1.0 / (hd as f64).sqrt(),
            },
            &[q, k, vv],
        )?;
        let att = g.add(
            Op::Reshape {
                shape: Shape::new([b, s, h]),
            },
            &[att],
        )?;
        let wo = param(&mut g, &format!("{p}.attn.wo"), &[h, h], normal.clone())?;
        let att = matmul(&mut g, att, wo)?;
        x = g.add(add.clone(), &[x, att])?;
        let m = layer_norm(&mut g, x, &format!("{p}.ln2"))?;
        let w1 = param(&mut g, &format!("{p}.mlp.w1"), &[h, 4 * h], normal.clone())?;
        let w2 = param(&mut g, &format!("{p}.mlp.w2"), &[4 * h, h], normal.clone())?;
        let m = matmul(&mut g, m, w1)?;
        let m = g.add(
            Op::Unary {
                func: UnaryOp::Gelu,
            },
            &[m],
        )?;
        let m = matmul(&mut g, m, w2)?;
        x = g.add(add.clone(), &[x, m])?;
    }
    let x = layer_norm(&mut g, x, "ln_f")?;
    let logits = g.add(
        Op::Einsum {
            spec: "bsh,vh->bsv".parse().map_err(IrError::Verify)?,
        },
        &[x, wte],
    )?;
    let ce = g.add(Op::CrossEntropy, &[logits, targets])?;
    let loss = g.add(
        Op::Reduce {
            func: ReduceOp::Mean,
            dims: vec![0, 1],
        },
        &[ce],
    )?;
    g.add_output("loss", loss)?;
    Ok(g)
}
