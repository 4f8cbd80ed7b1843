//! The interpreter as a whole: memory accounting, feeding errors, precision and dtype
//! rounding, deterministic initialisation and the synthetic data set.

mod common;

use autopar_ir::{
    BinaryOp, DType, Graph, Init, InputRole, Op, ReduceOp, Shape, TensorType, UnaryOp, ValueId,
};
use autopar_runtime::{
    Data, Feed, Precision, RunOptions, RuntimeError, Tensor, TensorMap, bigram_permutation,
    element_init, init_parameters, regression_teacher, round_to_dtype, run, synthetic_batch,
};
use common::*;
use half::{bf16, f16};

fn param(g: &mut Graph, name: &str, dtype: DType, dims: &[usize], init: Init) -> ValueId {
    g.add(
        Op::Parameter {
            name: name.into(),
            ty: TensorType::new(dtype, dims.to_vec()),
            init,
        },
        &[],
    )
    .expect("parameter")
}

fn input(g: &mut Graph, name: &str, ty: TensorType, role: InputRole) -> ValueId {
    g.add(
        Op::Input {
            name: name.into(),
            ty,
            role,
        },
        &[],
    )
    .expect("input")
}

fn unary(func: UnaryOp) -> Op {
    Op::Unary { func }
}

#[test]
fn peak_memory_counts_live_values_at_declared_sizes() -> TestResult {
    // a: f32[4] (16 B); b = exp(a); c = a + b; d = cast(c, bf16) (8 B); e = -d; an unused
    // constant f32[2] last. During `c` the tensors a, b and c are alive: 48 bytes.
    let mut g = Graph::new("chain");
    let a = param(&mut g, "a", DType::F32, &[4], Init::Ones);
    let b = g.add(unary(UnaryOp::Exp), &[a])?;
    let c = g.add(
        Op::Binary {
            func: BinaryOp::Add,
        },
        &[a, b],
    )?;
    let d = g.add(Op::Cast { to: DType::BF16 }, &[c])?;
    let e = g.add(unary(UnaryOp::Neg), &[d])?;
    g.add(
        Op::Constant {
            ty: TensorType::new(DType::F32, [2]),
            value: 0.0,
        },
        &[],
    )?;
    g.add_output("e", e)?;
    let params = init_parameters(&g, 0)?;
    let out = run(&g, &params, &TensorMap::new(), RunOptions::default())?;
    assert_eq!(out.peak_bytes, 48);
    let expected = -round_to_dtype(1.0 + 1f64.exp(), DType::BF16);
    assert_eq!(out.output("e")?.floats(), Some(&[expected; 4][..]));

    // bf16 values are counted at 2 bytes each, not at their f64 storage: p and exp(p) alive.
    let mut g = Graph::new("bf16");
    let p = param(&mut g, "p", DType::BF16, &[10], Init::Zeros);
    let q = g.add(unary(UnaryOp::Exp), &[p])?;
    g.add_output("q", q)?;
    let out = run(
        &g,
        &init_parameters(&g, 0)?,
        &TensorMap::new(),
        RunOptions::default(),
    )?;
    assert_eq!(out.peak_bytes, 40);
    Ok(())
}

#[test]
fn outputs_stay_alive_until_the_end() -> TestResult {
    // x (16 B) -> y = exp(x) -> z = exp(y); with y an output too, it is never freed.
    let mut g = Graph::new("keep");
    let x = param(&mut g, "x", DType::F32, &[4], Init::Zeros);
    let y = g.add(unary(UnaryOp::Exp), &[x])?;
    let z = g.add(unary(UnaryOp::Exp), &[y])?;
    g.add_output("z", z)?;
    let params = init_parameters(&g, 0)?;
    let peak = |g: &Graph| -> Result<u64, RuntimeError> {
        Ok(run(g, &params, &TensorMap::new(), RunOptions::default())?.peak_bytes)
    };
    assert_eq!(peak(&g)?, 32);
    g.add_output("y", y)?;
    g.add_output("x", x)?;
    assert_eq!(peak(&g)?, 48);
    Ok(())
}

fn one_input_graph() -> Result<Graph, Box<dyn std::error::Error>> {
    let mut g = Graph::new("feed");
    let ty = TensorType::new(DType::I64, [2, 3]);
    let tokens = input(&mut g, "tokens", ty, InputRole::Tokens { vocab: 5 });
    let table = param(
        &mut g,
        "wte",
        DType::F32,
        &[5, 4],
        Init::Normal { std: 1.0 },
    );
    let x = g.add(Op::Gather, &[table, tokens])?;
    g.add_output("x", x)?;
    Ok(g)
}

#[test]
fn missing_and_mistyped_feeds_are_named() -> TestResult {
    let g = one_input_graph()?;
    let params = init_parameters(&g, 1)?;
    let expected = TensorType::new(DType::I64, [2, 3]);

    let err =
        run(&g, &params, &TensorMap::new(), RunOptions::default()).expect_err("this must fail");
    assert_eq!(
        err,
        RuntimeError::Missing {
            feed: Feed::Input,
            name: "tokens".into(),
            expected: expected.clone()
        }
    );
    assert_eq!(
        err.to_string(),
        "missing input `tokens` (expected i64[2,3])"
    );

    let wrong = TensorMap::from([("tokens".to_string(), f32t(&[3], &[0.0, 1.0, 2.0]))]);
    let err = run(&g, &params, &wrong, RunOptions::default()).expect_err("this must fail");
    assert_eq!(
        err,
        RuntimeError::WrongType {
            feed: Feed::Input,
            name: "tokens".into(),
            expected,
            actual: TensorType::new(DType::F32, [3]),
        }
    );
    assert_eq!(
        err.to_string(),
        "input `tokens` has type f32[3], but the graph declares i64[2,3]"
    );

    let batch = synthetic_batch(&g, 1, 0)?;
    let err =
        run(&g, &TensorMap::new(), &batch, RunOptions::default()).expect_err("this must fail");
    assert!(matches!(
        err,
        RuntimeError::Missing { feed: Feed::Parameter, ref name, .. } if name == "wte"
    ));
    Ok(())
}

#[test]
fn out_of_range_ids_are_errors_naming_node_op_and_id() -> TestResult {
    let g = one_input_graph()?;
    let params = init_parameters(&g, 1)?;
    let bad = TensorMap::from([("tokens".to_string(), i64t(&[2, 3], &[0, 1, 2, 3, 4, 5]))]);
    let err = run(&g, &params, &bad, RunOptions::default()).expect_err("this must fail");
    assert_eq!(
        err.innermost(),
        &RuntimeError::IndexOutOfRange {
            op: "gather",
            id: 5,
            bound: 5
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("(gather)") && message.contains("id 5 is out of range 0..5"),
        "{message}"
    );
    Ok(())
}

#[test]
fn declared_precision_rounds_and_f64_precision_does_not() -> TestResult {
    let mut g = Graph::new("precision");
    let x = input(
        &mut g,
        "x",
        TensorType::new(DType::F32, [1]),
        InputRole::Features,
    );
    let y = g.add(
        Op::Binary {
            func: BinaryOp::Add,
        },
        &[x, x],
    )?;
    g.add_output("y", y)?;
    // 0.1 is not an f32; `Tensor::new` keeps it as given.
    let exact = Tensor::new(TensorType::new(DType::F32, [1]), Data::Float(vec![0.1]))?;
    let inputs = TensorMap::from([("x".to_string(), exact)]);
    let declared = run(&g, &TensorMap::new(), &inputs, RunOptions::default())?;
    assert_eq!(declared.scalar("y")?, f64::from(0.2f32));
    let wide = run(
        &g,
        &TensorMap::new(),
        &inputs,
        RunOptions {
            precision: Precision::F64,
            ..RunOptions::default()
        },
    )?;
    assert_eq!(wide.scalar("y")?, 0.2);
    Ok(())
}

/// Every float result of a bf16 or f16 graph is a value of that dtype.
#[test]
fn half_precision_results_are_representable() -> TestResult {
    for dtype in [DType::BF16, DType::F16] {
        let (b, s, heads, d) = (2, 4, 2, 8);
        let h = heads * d;
        let mut g = Graph::new("half");
        let x = input(
            &mut g,
            "x",
            TensorType::new(dtype, [b, s, h]),
            InputRole::Features,
        );
        let w = param(&mut g, "w", dtype, &[h, h], Init::Normal { std: 0.3 });
        let gamma = param(&mut g, "g", dtype, &[h], Init::Ones);
        let beta = param(&mut g, "b", dtype, &[h], Init::Zeros);
        let n = g.add(Op::LayerNorm { eps: 1e-5 }, &[x, gamma, beta])?;
        let y = g.add(
            Op::Einsum {
                spec: "bsh,hf->bsf".parse()?,
            },
            &[n, w],
        )?;
        let act = g.add(unary(UnaryOp::Gelu), &[y])?;
        let heads_shape = Op::Reshape {
            shape: Shape::new([b, s, heads, d]),
        };
        let q = g.add(heads_shape, &[act])?;
        let q = g.add(Op::Rotary { base: 10000.0 }, &[q])?;
        let att = g.add(
            Op::Attention {
                causal: true,
                scale: 0.35,
            },
            &[q, q, q],
        )?;
        let sm = g.add(Op::Softmax { dim: 3 }, &[att])?;
        let total = g.add(
            Op::Reduce {
                func: ReduceOp::Sum,
                dims: vec![0, 1, 2, 3],
            },
            &[sm],
        )?;
        for (name, v) in [
            ("y", y),
            ("act", act),
            ("att", att),
            ("sm", sm),
            ("total", total),
        ] {
            g.add_output(name, v)?;
        }
        let params = init_parameters(&g, 3)?;
        let batch = synthetic_batch(&g, 3, 0)?;
        let out = run(&g, &params, &batch, RunOptions::default())?;
        for (name, t) in &out.outputs {
            let values = t.floats().ok_or("float output")?;
            for &v in values {
                let back = match dtype {
                    DType::BF16 => bf16::from_f64(v).to_f64(),
                    _ => f16::from_f64(v).to_f64(),
                };
                assert_eq!(back, v, "{dtype} output {name} holds {v}");
            }
        }
        // The softmax rows sum to about one each (b * s * heads rows).
        let total = out.scalar("total")?;
        assert!(
            (total - (b * s * heads) as f64).abs() < 0.1,
            "{dtype}: {total}"
        );
    }
    Ok(())
}

fn two_params(names: [&str; 2]) -> Graph {
    let mut g = Graph::new("init");
    let normal = Init::Normal { std: 0.02 };
    for name in names {
        let dims: &[usize] = if name == "w1" { &[4, 3] } else { &[5] };
        let p = param(&mut g, name, DType::F32, dims, normal.clone());
        g.add_output(name, p).expect("output");
    }
    g
}

#[test]
fn init_depends_only_on_seed_name_and_index() -> TestResult {
    let a = init_parameters(&two_params(["w1", "w2"]), 42)?;
    assert_eq!(a, init_parameters(&two_params(["w1", "w2"]), 42)?);
    // Another graph, with the parameters in the other order and w1 in another shape.
    let mut g = Graph::new("other");
    let extra = param(
        &mut g,
        "extra",
        DType::F32,
        &[7],
        Init::Normal { std: 0.02 },
    );
    g.add_output("extra", extra)?;
    let w2 = param(&mut g, "w2", DType::F32, &[5], Init::Normal { std: 0.02 });
    g.add_output("w2", w2)?;
    let w1 = param(&mut g, "w1", DType::F32, &[12], Init::Normal { std: 0.02 });
    g.add_output("w1", w1)?;
    let b = init_parameters(&g, 42)?;
    assert_eq!(a["w2"], b["w2"]);
    assert_eq!(a["w1"].to_f64_vec(), b["w1"].to_f64_vec());
    assert_ne!(a["w1"].to_f64_vec()[..5], b["w2"].to_f64_vec()[..]);
    assert_ne!(a, init_parameters(&two_params(["w1", "w2"]), 43)?);

    // A rank holding elements 6..12 of w1 draws just those.
    let draw = element_init("w1", &Init::Normal { std: 0.02 }, 42);
    let shard: Vec<f64> = (6..12)
        .map(|i| round_to_dtype(draw(i), DType::F32))
        .collect();
    assert_eq!(shard, a["w1"].to_f64_vec()[6..]);
    Ok(())
}

#[test]
fn init_follows_each_initialiser() -> TestResult {
    let mut g = Graph::new("inits");
    param(
        &mut g,
        "w",
        DType::F32,
        &[128, 64],
        Init::Normal { std: 0.02 },
    );
    param(&mut g, "z", DType::BF16, &[3], Init::Zeros);
    param(&mut g, "o", DType::F32, &[3], Init::Ones);
    param(&mut g, "i", DType::I64, &[2], Init::Ones);
    let p = init_parameters(&g, 0)?;
    let w = p["w"].to_f64_vec();
    let mean = w.iter().sum::<f64>() / w.len() as f64;
    let std = (w.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
    assert!(
        mean.abs() < 0.001 && (std - 0.02).abs() < 0.001,
        "mean {mean}, std {std}"
    );
    assert_eq!(p["z"].floats(), Some(&[0.0; 3][..]));
    assert_eq!(p["o"].floats(), Some(&[1.0; 3][..]));
    assert_eq!(p["i"].ints(), Some(&[1, 1][..]));

    let mut g = Graph::new("bad");
    param(&mut g, "ids", DType::I32, &[2], Init::Normal { std: 1.0 });
    assert!(matches!(
        init_parameters(&g, 0),
        Err(RuntimeError::Init { ref name, .. }) if name == "ids"
    ));
    Ok(())
}

fn lm_inputs(vocab: usize, b: usize, s: usize) -> Graph {
    let mut g = Graph::new("lm");
    let ty = TensorType::new(DType::I32, [b, s]);
    input(&mut g, "tokens", ty.clone(), InputRole::Tokens { vocab });
    input(&mut g, "targets", ty, InputRole::NextTokens { vocab });
    g
}

#[test]
fn token_batches_are_deterministic_and_follow_the_bigram_rule() -> TestResult {
    let (vocab, b, s) = (50, 6, 9);
    let g = lm_inputs(vocab, b, s);
    let batch = synthetic_batch(&g, 5, 3)?;
    assert_eq!(batch, synthetic_batch(&g, 5, 3)?);
    assert_ne!(batch, synthetic_batch(&g, 5, 4)?, "steps differ");
    assert_ne!(batch, synthetic_batch(&g, 6, 3)?, "seeds differ");

    let perm = bigram_permutation(5, vocab);
    let mut sorted = perm.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..vocab).collect::<Vec<_>>(), "a permutation");

    let tokens = batch["tokens"].ints().ok_or("integer tokens")?;
    let targets = batch["targets"].ints().ok_or("integer targets")?;
    assert!(tokens.iter().all(|&t| (0..vocab as i64).contains(&t)));
    for row in 0..b {
        for j in 0..s {
            let (t, next) = (tokens[row * s + j], targets[row * s + j]);
            assert_eq!(next, perm[t as usize] as i64);
            if j + 1 < s {
                assert_eq!(tokens[row * s + j + 1], next);
            }
        }
    }
    // First tokens vary between rows and steps.
    let firsts = |batch: &TensorMap| -> Vec<i64> {
        let t = batch["tokens"].ints().unwrap_or_default();
        (0..b).map(|r| t[r * s]).collect()
    };
    let steps: Vec<Vec<i64>> = (0..4)
        .map(|step| synthetic_batch(&g, 5, step).map(|bt| firsts(&bt)))
        .collect::<Result<_, _>>()?;
    assert!(steps.windows(2).all(|w| w[0] != w[1]));
    Ok(())
}

/// Features `x` and regression targets `y` of the given shapes.
fn regression_graph(x: [usize; 2], y: [usize; 2]) -> Graph {
    let mut g = Graph::new("regression");
    input(
        &mut g,
        "x",
        TensorType::new(DType::F32, x),
        InputRole::Features,
    );
    input(
        &mut g,
        "y",
        TensorType::new(DType::F32, y),
        InputRole::RegressionTargets,
    );
    g
}

#[test]
fn regression_targets_follow_the_teacher() -> TestResult {
    let (b, f, o) = (4, 6, 3);
    let g = regression_graph([b, f], [b, o]);
    let batch = synthetic_batch(&g, 9, 2)?;
    assert_eq!(batch, synthetic_batch(&g, 9, 2)?);
    assert_ne!(batch["x"], synthetic_batch(&g, 9, 3)?["x"]);
    let (x, y) = (batch["x"].to_f64_vec(), batch["y"].to_f64_vec());
    let w = regression_teacher(9, f, o);
    for r in 0..b {
        for j in 0..o {
            let z: f64 = (0..f).map(|k| x[r * f + k] * w[k * o + j]).sum();
            assert_eq!(y[r * o + j], f64::from(z.tanh() as f32));
        }
    }

    // Targets without features of a matching batch size are an error naming the input.
    let g = regression_graph([b + 1, f], [b, o]);
    let err = synthetic_batch(&g, 0, 0).expect_err("this must fail");
    assert!(
        matches!(err, RuntimeError::Data { ref name, .. } if name == "y"),
        "{err}"
    );
    assert!(
        err.to_string().contains("features input of shape [4, f]"),
        "{err}"
    );

    let mut g = Graph::new("float_tokens");
    input(
        &mut g,
        "tokens",
        TensorType::new(DType::F32, [2, 2]),
        InputRole::Tokens { vocab: 4 },
    );
    assert!(matches!(
        synthetic_batch(&g, 0, 0),
        Err(RuntimeError::Data { ref name, .. }) if name == "tokens"
    ));
    Ok(())
}
