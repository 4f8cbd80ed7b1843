//! Every op on small hand-computed cases, einsum against a naive reference, attention
//! against its decomposition, rotary positions and MoE routing order.

mod common;

use autopar_ir::{
    BinaryOp, CompareOp, DType, DeviceMesh, Graph, Init, InputRole, Op, OpKind, ReduceKind,
    ReduceOp, Shape, TensorType, UnaryOp,
};
use autopar_runtime::{
    Precision, RunOptions, RuntimeError, Tensor, TensorMap, decomposed_attention, run,
};
use common::*;
use half::bf16;
use proptest::prelude::*;

/// Loops over the whole op set; the match has no wildcard, so a new op needs a case here.
#[test]
fn every_op_kind_has_a_hand_checked_case() -> TestResult {
    for kind in OpKind::ALL {
        match kind {
            OpKind::Parameter => parameter()?,
            OpKind::Input => input()?,
            OpKind::Constant => constant()?,
            OpKind::Einsum => einsum()?,
            OpKind::Unary => unary()?,
            OpKind::Binary => binary()?,
            OpKind::Compare => compare()?,
            OpKind::Select => select()?,
            OpKind::Cast => cast()?,
            OpKind::Reduce => reduce()?,
            OpKind::Softmax => softmax()?,
            OpKind::LayerNorm => layer_norm()?,
            OpKind::RmsNorm => rms_norm()?,
            OpKind::Gather => gather()?,
            OpKind::ScatterAdd => scatter_add()?,
            OpKind::Reshape => reshape()?,
            OpKind::Transpose => transpose()?,
            OpKind::Slice => slice()?,
            OpKind::Concat => concat()?,
            OpKind::Broadcast => broadcast()?,
            OpKind::Rotary => rotary()?,
            OpKind::Attention => attention()?,
            OpKind::AttentionBackward => attention_backward()?,
            OpKind::MoeRoute => moe_route()?,
            OpKind::CrossEntropy => cross_entropy()?,
            OpKind::SgdUpdate => sgd_update()?,
            OpKind::AdamWUpdate => adamw_update()?,
            OpKind::AllReduce
            | OpKind::AllGather
            | OpKind::ReduceScatter
            | OpKind::AllToAll
            | OpKind::CollectiveBroadcast
            | OpKind::Send
            | OpKind::Recv => communication(kind)?,
            OpKind::Fusion => fusion()?,
        }
    }
    Ok(())
}

fn parameter() -> TestResult {
    let mut g = Graph::new("p");
    let ty = TensorType::new(DType::F32, [2]);
    let p = g.add(
        Op::Parameter {
            name: "w".into(),
            ty: ty.clone(),
            init: Init::Zeros,
        },
        &[],
    )?;
    g.add_output("w", p)?;
    let params = TensorMap::from([("w".to_string(), f32t(&[2], &[1.5, -2.0]))]);
    let out = run(&g, &params, &TensorMap::new(), RunOptions::default())?;
    assert_eq!(out.output("w")?, &f32t(&[2], &[1.5, -2.0]));
    Ok(())
}

fn input() -> TestResult {
    let t = i64t(&[3], &[4, 5, 6]);
    let mut g = Graph::new("i");
    let x = g.add(
        Op::Input {
            name: "tokens".into(),
            ty: t.ty().clone(),
            role: InputRole::Tokens { vocab: 8 },
        },
        &[],
    )?;
    g.add_output("tokens", x)?;
    let inputs = TensorMap::from([("tokens".to_string(), t.clone())]);
    let out = run(&g, &TensorMap::new(), &inputs, RunOptions::default())?;
    assert_eq!(out.output("tokens")?, &t);
    Ok(())
}

fn constant() -> TestResult {
    let c = run_one(
        Op::Constant {
            ty: TensorType::new(DType::F32, [2, 2]),
            value: 0.1,
        },
        &[],
    )?;
    assert_eq!(c.floats(), Some(&[f64::from(0.1f32); 4][..]));
    let c = run_one(
        Op::Constant {
            ty: TensorType::new(DType::BF16, [1]),
            value: 0.1,
        },
        &[],
    )?;
    assert_eq!(c.floats(), Some(&[bf16::from_f64(0.1).to_f64()][..]));
    let c = run_one(
        Op::Constant {
            ty: TensorType::new(DType::I32, [2]),
            value: -3.0,
        },
        &[],
    )?;
    assert_eq!(c.ints(), Some(&[-3, -3][..]));
    let c = run_one(
        Op::Constant {
            ty: TensorType::new(DType::Bool, [1]),
            value: 1.0,
        },
        &[],
    )?;
    assert_eq!(c.bools(), Some(&[true][..]));
    Ok(())
}

fn einsum_op(spec: &str) -> Op {
    Op::Einsum {
        spec: spec.parse().expect("valid spec"),
    }
}

fn einsum() -> TestResult {
    let a = f32t(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let b = f32t(&[2, 2], &[5.0, 6.0, 7.0, 8.0]);
    let c = run_one(einsum_op("ij,jk->ik"), &[a.clone(), b.clone()])?;
    assert_close(&c, &[2, 2], &[19.0, 22.0, 43.0, 50.0], 0.0);
    // Transposed output: labels in an order gemm does not produce directly.
    let c = run_one(einsum_op("ij,jk->ki"), &[a.clone(), b.clone()])?;
    assert_close(&c, &[2, 2], &[19.0, 43.0, 22.0, 50.0], 0.0);
    // Row-wise dot products: `i` is a batch label, `j` contracted.
    let c = run_one(einsum_op("ij,ij->i"), &[a.clone(), b.clone()])?;
    assert_close(&c, &[2], &[17.0, 53.0], 0.0);
    // Pure batch product (element-wise).
    let c = run_one(einsum_op("ij,ij->ji"), &[a, b])?;
    assert_close(&c, &[2, 2], &[5.0, 21.0, 12.0, 32.0], 0.0);
    // Outer product: no contracting label.
    let x = f32t(&[2], &[1.0, 2.0]);
    let y = f32t(&[3], &[3.0, 4.0, 5.0]);
    let c = run_one(einsum_op("i,j->ij"), &[x, y])?;
    assert_close(&c, &[2, 3], &[3.0, 4.0, 5.0, 6.0, 8.0, 10.0], 0.0);
    Ok(())
}

fn unary() -> TestResult {
    let xs = [-1.5, -0.25, 0.0, 0.5, 2.0];
    let x = f32t(&[5], &xs);
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    for func in UnaryOp::ALL {
        let expected: Vec<f64> = xs
            .iter()
            .map(|&v| {
                let r = match func {
                    UnaryOp::Neg => -v,
                    UnaryOp::Abs => v.abs(),
                    UnaryOp::Exp => v.exp(),
                    UnaryOp::Log => v.ln(),
                    UnaryOp::Sqrt => v.sqrt(),
                    UnaryOp::Rsqrt => 1.0 / v.sqrt(),
                    UnaryOp::Recip => 1.0 / v,
                    UnaryOp::Square => v * v,
                    UnaryOp::Tanh => v.tanh(),
                    UnaryOp::Sigmoid => sigmoid(v),
                    UnaryOp::Relu => v.max(0.0),
                    UnaryOp::Gelu => {
                        let inner =
                            (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3));
                        0.5 * v * (1.0 + inner.tanh())
                    }
                    // d/dv of the line above: `(1 + t) / 2 + v sech^2(w) w' / 2`.
                    UnaryOp::GeluGrad => {
                        let a = (2.0 / std::f64::consts::PI).sqrt();
                        let t = (a * (v + 0.044715 * v.powi(3))).tanh();
                        0.5 * (1.0 + t)
                            + 0.5 * v * (1.0 - t * t) * a * (1.0 + 3.0 * 0.044715 * v * v)
                    }
                    UnaryOp::Silu => v * sigmoid(v),
                    UnaryOp::Erf => libm::erf(v),
                    UnaryOp::GeluErf => 0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt())),
                    UnaryOp::Sin => v.sin(),
                    UnaryOp::Cos => v.cos(),
                };
                f64::from(r as f32)
            })
            .collect();
        let y = run_one(Op::Unary { func }, std::slice::from_ref(&x))?;
        assert_close(&y, &[5], &expected, 0.0);
    }
    // Exact GELU at 1 is Phi(1) = 0.841344746...; erf(0.5) = 0.520499877...
    let y = run_one(
        Op::Unary {
            func: UnaryOp::GeluErf,
        },
        &[typed(DType::F32, &[1], &[1.0])],
    )?;
    assert_close(&y, &[1], &[0.841_344_746_068_542_9], 1e-7);
    let y = run_one(
        Op::Unary { func: UnaryOp::Erf },
        &[typed(DType::F32, &[1], &[0.5])],
    )?;
    assert_close(&y, &[1], &[0.520_499_877_813_046_5], 1e-7);
    // Published values of the tanh-approximated GELU and of SiLU.
    let y = run_one(
        Op::Unary {
            func: UnaryOp::Gelu,
        },
        &[f32t(&[1], &[1.0])],
    )?;
    assert_close(&y, &[1], &[0.841_192], 1e-6);
    let y = run_one(
        Op::Unary {
            func: UnaryOp::Silu,
        },
        &[f32t(&[1], &[1.0])],
    )?;
    assert_close(&y, &[1], &[0.731_058_6], 1e-6);
    // Integer versions.
    let i = i64t(&[2], &[-3, 4]);
    let neg = run_one(Op::Unary { func: UnaryOp::Neg }, std::slice::from_ref(&i))?;
    assert_eq!(neg.ints(), Some(&[3, -4][..]));
    let sq = run_one(
        Op::Unary {
            func: UnaryOp::Square,
        },
        std::slice::from_ref(&i),
    )?;
    assert_eq!(sq.ints(), Some(&[9, 16][..]));
    let abs = run_one(Op::Unary { func: UnaryOp::Abs }, &[i])?;
    assert_eq!(abs.ints(), Some(&[3, 4][..]));
    Ok(())
}

fn binary() -> TestResult {
    let a = f32t(&[3], &[1.0, 2.0, -3.0]);
    let b = f32t(&[3], &[4.0, 0.5, 2.0]);
    let cases = [
        (BinaryOp::Add, [5.0, 2.5, -1.0]),
        (BinaryOp::Sub, [-3.0, 1.5, -5.0]),
        (BinaryOp::Mul, [4.0, 1.0, -6.0]),
        (BinaryOp::Div, [0.25, 4.0, -1.5]),
        (BinaryOp::Max, [4.0, 2.0, 2.0]),
        (BinaryOp::Min, [1.0, 0.5, -3.0]),
        (BinaryOp::Pow, [1.0, 2f64.sqrt() as f32 as f64, 9.0]),
    ];
    for (func, expected) in cases {
        let y = run_one(Op::Binary { func }, &[a.clone(), b.clone()])?;
        assert_close(&y, &[3], &expected, 0.0);
    }
    let div = Op::Binary {
        func: BinaryOp::Div,
    };
    let q = run_one(div.clone(), &[i64t(&[2], &[7, -7]), i64t(&[2], &[2, 2])])?;
    assert_eq!(q.ints(), Some(&[3, -3][..]), "integer division truncates");
    let err = run_one(div, &[i64t(&[1], &[1]), i64t(&[1], &[0])]).expect_err("this must fail");
    assert_eq!(err.innermost(), &RuntimeError::DivisionByZero { op: "div" });
    Ok(())
}

fn compare() -> TestResult {
    let a = f32t(&[3], &[1.0, 2.0, 3.0]);
    let b = f32t(&[3], &[2.0, 2.0, 2.0]);
    let cases = [
        (CompareOp::Eq, [false, true, false]),
        (CompareOp::Ne, [true, false, true]),
        (CompareOp::Lt, [true, false, false]),
        (CompareOp::Le, [true, true, false]),
        (CompareOp::Gt, [false, false, true]),
        (CompareOp::Ge, [false, true, true]),
    ];
    for (func, expected) in cases {
        let y = run_one(Op::Compare { func }, &[a.clone(), b.clone()])?;
        assert_eq!(y.bools(), Some(&expected[..]), "{}", func.name());
        let y = run_one(
            Op::Compare { func },
            &[i64t(&[3], &[1, 2, 3]), i64t(&[3], &[2, 2, 2])],
        )?;
        assert_eq!(y.bools(), Some(&expected[..]), "integer {}", func.name());
    }
    Ok(())
}

fn select() -> TestResult {
    let y = run_one(
        Op::Select,
        &[
            boolt(&[2], &[true, false]),
            f32t(&[2], &[1.0, 2.0]),
            f32t(&[2], &[3.0, 4.0]),
        ],
    )?;
    assert_close(&y, &[2], &[1.0, 4.0], 0.0);
    let y = run_one(
        Op::Select,
        &[
            boolt(&[2], &[false, true]),
            i64t(&[2], &[1, 2]),
            i64t(&[2], &[3, 4]),
        ],
    )?;
    assert_eq!(y.ints(), Some(&[3, 2][..]));
    Ok(())
}

fn cast() -> TestResult {
    let x = f32t(&[4], &[-1.7, 2.5, 0.0, 1e10]);
    let y = run_one(Op::Cast { to: DType::I32 }, std::slice::from_ref(&x))?;
    assert_eq!(y.ints(), Some(&[-1, 2, 0, i64::from(i32::MAX)][..]));
    let y = run_one(Op::Cast { to: DType::Bool }, std::slice::from_ref(&x))?;
    assert_eq!(y.bools(), Some(&[true, true, false, true][..]));
    let y = run_one(Op::Cast { to: DType::F32 }, &[boolt(&[2], &[true, false])])?;
    assert_close(&y, &[2], &[1.0, 0.0], 0.0);
    let y = run_one(Op::Cast { to: DType::I64 }, &[boolt(&[2], &[true, false])])?;
    assert_eq!(y.ints(), Some(&[1, 0][..]));
    // 1 + 2^-8 lies halfway between two bf16 values: ties go to the even one.
    let tie = 1.0 + 2f64.powi(-8);
    let y = run_one(Op::Cast { to: DType::BF16 }, &[f32t(&[2], &[tie, 0.1])])?;
    assert_eq!(y.floats(), Some(&[1.0, bf16::from_f32(0.1).to_f64()][..]));
    let y = run_one(
        Op::Cast { to: DType::I32 },
        &[i64t(&[2], &[(1 << 32) + 5, -2])],
    )?;
    assert_eq!(y.ints(), Some(&[5, -2][..]), "i64 to i32 wraps");
    let y = run_one(Op::Cast { to: DType::F16 }, &[i64t(&[1], &[2049])])?;
    assert_eq!(
        y.floats(),
        Some(&[2048.0][..]),
        "2049 is not an f16; ties to even"
    );
    Ok(())
}

fn reduce_op(func: ReduceOp, dims: &[usize]) -> Op {
    Op::Reduce {
        func,
        dims: dims.to_vec(),
    }
}

fn reduce() -> TestResult {
    let x = f32t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let y = run_one(reduce_op(ReduceOp::Sum, &[1]), std::slice::from_ref(&x))?;
    assert_close(&y, &[2], &[6.0, 15.0], 0.0);
    let y = run_one(reduce_op(ReduceOp::Mean, &[0]), std::slice::from_ref(&x))?;
    assert_close(&y, &[3], &[2.5, 3.5, 4.5], 0.0);
    let y = run_one(reduce_op(ReduceOp::Max, &[0, 1]), std::slice::from_ref(&x))?;
    assert_close(&y, &[], &[6.0], 0.0);
    let y = run_one(reduce_op(ReduceOp::Min, &[1]), std::slice::from_ref(&x))?;
    assert_close(&y, &[2], &[1.0, 4.0], 0.0);
    let y = run_one(reduce_op(ReduceOp::Sum, &[]), std::slice::from_ref(&x))?;
    assert_eq!(y, x, "reducing no dims is the identity");
    let y = run_one(
        reduce_op(ReduceOp::Sum, &[0, 2]),
        &[i64t(&[2, 2, 2], &[1, 2, 3, 4, 5, 6, 7, 8])],
    )?;
    assert_eq!(y.ints(), Some(&[1 + 2 + 5 + 6, 3 + 4 + 7 + 8][..]));
    Ok(())
}

fn softmax() -> TestResult {
    let ln3 = 3f64.ln();
    let x = f32t(&[2, 2], &[0.0, ln3, 0.0, 0.0]);
    let y = run_one(Op::Softmax { dim: 1 }, std::slice::from_ref(&x))?;
    assert_close(&y, &[2, 2], &[0.25, 0.75, 0.5, 0.5], 1e-7);
    let y = run_one(Op::Softmax { dim: 0 }, &[x])?;
    assert_close(&y, &[2, 2], &[0.5, 0.75, 0.5, 0.25], 1e-7);
    // Large logits do not overflow (the maximum is subtracted first).
    let y = run_one(Op::Softmax { dim: 0 }, &[f32t(&[2], &[1000.0, 1000.0])])?;
    assert_close(&y, &[2], &[0.5, 0.5], 0.0);
    Ok(())
}

fn layer_norm() -> TestResult {
    // Row 0: mean 2, variance 2/3, so x = 3 normalises to sqrt(1.5). Row 1: mean 1,
    // variance 2, so x = 0 normalises to -1/sqrt(2).
    let (s, r) = (1.5f64.sqrt(), 0.5f64.sqrt());
    let y = run_one(
        Op::LayerNorm { eps: 0.0 },
        &[
            f32t(&[2, 3], &[1.0, 2.0, 3.0, 0.0, 0.0, 3.0]),
            f32t(&[3], &[1.0, 2.0, 1.0]),
            f32t(&[3], &[0.0, 1.0, 0.0]),
        ],
    )?;
    assert_close(&y, &[2, 3], &[-s, 1.0, s, -r, 1.0 - 2.0 * r, 2.0 * r], 1e-6);
    Ok(())
}

/// A softmax over the last dim written as a fusion body (max, subtract, exp, sum, divide,
/// with the broadcasts between), returning the probabilities and the row sums: equal to
/// `softmax` and to the same ops run one by one, in f32 and in bf16.
fn fusion() -> TestResult {
    let bcast = |dims: Vec<usize>| Op::Broadcast {
        shape: Shape::new(vec![2, 3]),
        dims,
    };
    let instr = |op: Op, operands: Vec<usize>| autopar_ir::FusedInstr { op, operands };
    let reduce = |func| Op::Reduce {
        func,
        dims: vec![1],
    };
    let bin = |func| Op::Binary { func };
    let body = |dtype: DType| autopar_ir::FusionBody {
        params: vec![TensorType::new(dtype, [2, 3])],
        instrs: vec![
            instr(reduce(ReduceOp::Max), vec![0]),
            instr(bcast(vec![0]), vec![1]),
            instr(bin(BinaryOp::Sub), vec![0, 2]),
            instr(Op::Unary { func: UnaryOp::Exp }, vec![3]),
            instr(reduce(ReduceOp::Sum), vec![4]),
            instr(bcast(vec![0]), vec![5]),
            instr(bin(BinaryOp::Div), vec![4, 6]),
        ],
        results: vec![7, 5],
    };
    let values = [0.5, -1.0, 2.0, 3.0, 3.0, -0.25];
    for dtype in [DType::F32, DType::BF16] {
        let x = typed(dtype, &[2, 3], &values);
        let fused = run_op(Op::Fusion { body: body(dtype) }, std::slice::from_ref(&x))?;
        assert_eq!(fused.len(), 2);
        let softmax = run_one(Op::Softmax { dim: 1 }, std::slice::from_ref(&x))?;
        let tol = if dtype == DType::F32 { 1e-6 } else { 2e-2 };
        assert_close(&fused[0], &[2, 3], &softmax.to_f64_vec(), tol);
        // The same instructions as separate nodes give the same bits.
        let mut vals = vec![x.clone()];
        for i in &body(dtype).instrs {
            let args: Vec<Tensor> = i.operands.iter().map(|&v| vals[v].clone()).collect();
            vals.push(run_one(i.op.clone(), &args)?);
        }
        assert_eq!(fused[0], vals[7], "{dtype}");
        assert_eq!(fused[1], vals[5], "{dtype}");
    }
    // A body that reads a value before defining it is refused.
    let mut bad = body(DType::F32);
    bad.instrs[0].operands = vec![3];
    let x = typed(DType::F32, &[2, 3], &values);
    let err = run_op(Op::Fusion { body: bad }, &[x]).expect_err("ill-formed body");
    assert!(err.to_string().contains("^1 reads ^3"), "{err}");
    Ok(())
}

fn rms_norm() -> TestResult {
    // mean(x^2) = 12.5 for x = [3, 4].
    let r = 12.5f64.sqrt();
    let y = run_one(
        Op::RmsNorm { eps: 0.0 },
        &[f32t(&[1, 2], &[3.0, 4.0]), f32t(&[2], &[1.0, 2.0])],
    )?;
    assert_close(&y, &[1, 2], &[3.0 / r, 8.0 / r], 1e-6);
    Ok(())
}

fn gather() -> TestResult {
    let table = f32t(&[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let y = run_one(Op::Gather, &[table.clone(), i64t(&[1, 2], &[2, 0])])?;
    assert_close(&y, &[1, 2, 2], &[5.0, 6.0, 1.0, 2.0], 0.0);
    for bad in [3, -1] {
        let err = run_one(Op::Gather, &[table.clone(), i64t(&[2], &[0, bad])])
            .expect_err("this must fail");
        assert_eq!(
            err.innermost(),
            &RuntimeError::IndexOutOfRange {
                op: "gather",
                id: bad,
                bound: 3
            }
        );
        assert!(
            err.to_string()
                .contains(&format!("id {bad} is out of range 0..3"))
        );
    }
    Ok(())
}

fn scatter_add() -> TestResult {
    let y = run_one(
        Op::ScatterAdd { num_rows: 3 },
        &[
            i64t(&[3], &[0, 2, 0]),
            f32t(&[3, 2], &[1.0, 1.0, 2.0, 2.0, 3.0, 3.0]),
        ],
    )?;
    assert_close(&y, &[3, 2], &[4.0, 4.0, 0.0, 0.0, 2.0, 2.0], 0.0);
    let err = run_one(
        Op::ScatterAdd { num_rows: 2 },
        &[i64t(&[1], &[2]), f32t(&[1], &[1.0])],
    )
    .expect_err("this must fail");
    assert!(matches!(
        err.innermost(),
        RuntimeError::IndexOutOfRange {
            op: "scatter_add",
            id: 2,
            bound: 2
        }
    ));
    Ok(())
}

fn reshape() -> TestResult {
    let vals = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let y = run_one(
        Op::Reshape {
            shape: Shape::new([3, 2]),
        },
        &[f32t(&[2, 3], &vals)],
    )?;
    assert_close(&y, &[3, 2], &vals, 0.0);
    Ok(())
}

fn transpose() -> TestResult {
    let y = run_one(
        Op::Transpose { perm: vec![1, 0] },
        &[f32t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
    )?;
    assert_close(&y, &[3, 2], &[1.0, 4.0, 2.0, 5.0, 3.0, 6.0], 0.0);
    let x: Vec<f64> = (0..24).map(f64::from).collect();
    let y = run_one(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        &[f32t(&[2, 3, 4], &x)],
    )?;
    // y[k, i, j] = x[i, j, k] = 12 i + 4 j + k.
    assert_eq!(y.dims(), &[4, 2, 3]);
    let got = y.to_f64_vec();
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                assert_eq!(got[k * 6 + i * 3 + j], (12 * i + 4 * j + k) as f64);
            }
        }
    }
    Ok(())
}

fn slice() -> TestResult {
    let y = run_one(
        Op::Slice {
            dim: 1,
            start: 1,
            end: 3,
        },
        &[f32t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
    )?;
    assert_close(&y, &[2, 2], &[2.0, 3.0, 5.0, 6.0], 0.0);
    Ok(())
}

fn concat() -> TestResult {
    let a = f32t(&[1, 2], &[1.0, 2.0]);
    let b = f32t(&[2, 2], &[3.0, 4.0, 5.0, 6.0]);
    let y = run_one(Op::Concat { dim: 0 }, &[a, b.clone()])?;
    assert_close(&y, &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.0);
    let c = f32t(&[2, 1], &[7.0, 8.0]);
    let y = run_one(Op::Concat { dim: 1 }, &[b, c])?;
    assert_close(&y, &[2, 3], &[3.0, 4.0, 7.0, 5.0, 6.0, 8.0], 0.0);
    let y = run_one(
        Op::Concat { dim: 0 },
        &[boolt(&[1], &[true]), boolt(&[2], &[false, true])],
    )?;
    assert_eq!(y.bools(), Some(&[true, false, true][..]));
    Ok(())
}

fn broadcast() -> TestResult {
    let y = run_one(
        Op::Broadcast {
            shape: Shape::new([2, 3]),
            dims: vec![1],
        },
        &[f32t(&[3], &[1.0, 2.0, 3.0])],
    )?;
    assert_close(&y, &[2, 3], &[1.0, 2.0, 3.0, 1.0, 2.0, 3.0], 0.0);
    let y = run_one(
        Op::Broadcast {
            shape: Shape::new([2, 3]),
            dims: vec![0, 1],
        },
        &[f32t(&[2, 1], &[1.0, 2.0])],
    )?;
    assert_close(&y, &[2, 3], &[1.0, 1.0, 1.0, 2.0, 2.0, 2.0], 0.0);
    Ok(())
}

fn rotary() -> TestResult {
    // x[s=2, heads=1, d=2] with both rows [1, 0]; with d = 2 the only frequency is 1, so
    // position p rotates the pair by p radians.
    let x = f32t(&[2, 1, 2], &[1.0, 0.0, 1.0, 0.0]);
    let op = Op::Rotary { base: 10000.0 };
    let y = run_one(op.clone(), std::slice::from_ref(&x))?;
    assert_close(&y, &[2, 1, 2], &[1.0, 0.0, 1f64.cos(), 1f64.sin()], 1e-7);
    let y = run_one(op, &[x, i64t(&[2], &[3, 0])])?;
    assert_close(&y, &[2, 1, 2], &[3f64.cos(), 3f64.sin(), 1.0, 0.0], 1e-7);
    Ok(())
}

fn attention() -> TestResult {
    // One head of size 1: keys 0 and ln 3 give weights 1/4 and 3/4 to values 4 and 8.
    let q = f32t(&[1, 2, 1, 1], &[1.0, 1.0]);
    let k = f32t(&[1, 2, 1, 1], &[0.0, 3f64.ln()]);
    let v = f32t(&[1, 2, 1, 1], &[4.0, 8.0]);
    let full = run_one(
        Op::Attention {
            causal: false,
            scale: 1.0,
        },
        &[q.clone(), k.clone(), v.clone()],
    )?;
    assert_close(&full, &[1, 2, 1, 1], &[7.0, 7.0], 1e-6);
    let causal = run_one(
        Op::Attention {
            causal: true,
            scale: 1.0,
        },
        &[q, k, v],
    )?;
    assert_close(&causal, &[1, 2, 1, 1], &[4.0, 7.0], 1e-6);
    Ok(())
}

fn attention_backward() -> TestResult {
    // The example of `attention`: weights 1/4 and 3/4 on values 4 and 8, result 7, and a
    // gradient of 1 on both rows: `ds = p (v - 7)`, so `dq = ds . k`, `dk = ds^T q`.
    let q = f32t(&[1, 2, 1, 1], &[1.0, 1.0]);
    let k = f32t(&[1, 2, 1, 1], &[0.0, 3f64.ln()]);
    let v = f32t(&[1, 2, 1, 1], &[4.0, 8.0]);
    let g = f32t(&[1, 2, 1, 1], &[1.0, 1.0]);
    let op = |causal| Op::AttentionBackward { causal, scale: 1.0 };
    let o = f32t(&[1, 2, 1, 1], &[7.0, 7.0]);
    let full = run_op(op(false), &[q.clone(), k.clone(), v.clone(), o, g.clone()])?;
    let dq = 0.75 * 3f64.ln();
    assert_close(&full[0], &[1, 2, 1, 1], &[dq, dq], 1e-6);
    assert_close(&full[1], &[1, 2, 1, 1], &[-1.5, 1.5], 1e-6);
    assert_close(&full[2], &[1, 2, 1, 1], &[0.5, 1.5], 1e-6);
    // Positions: query 0 at position 1 sees both keys, query 1 at position 0 only key 0
    // (its result is 4 and its score gradient 0).
    let o = f32t(&[1, 2, 1, 1], &[7.0, 4.0]);
    let (q_pos, k_pos) = (i64t(&[2], &[1, 0]), i64t(&[2], &[0, 1]));
    let causal = run_op(op(true), &[q, k, v, o, g, q_pos, k_pos])?;
    assert_close(&causal[0], &[1, 2, 1, 1], &[dq, 0.0], 1e-6);
    assert_close(&causal[1], &[1, 2, 1, 1], &[-0.75, 0.75], 1e-6);
    assert_close(&causal[2], &[1, 2, 1, 1], &[1.25, 0.75], 1e-6);
    Ok(())
}

fn moe_op(top_k: usize, capacity: usize, normalize: bool) -> Op {
    Op::MoeRoute {
        top_k,
        capacity,
        normalize,
    }
}

fn moe_route() -> TestResult {
    // Three tokens, two experts, one slot each: token 1 finds expert 0 full and is dropped.
    let probs = f32t(&[3, 2], &[0.75, 0.25, 0.5, 0.5, 0.25, 0.75]);
    let r = run_op(moe_op(1, 1, false), &[probs])?;
    let (combine, dispatch) = (&r[0], &r[1]);
    assert_close(combine, &[3, 2, 1], &[0.75, 0.0, 0.0, 0.0, 0.0, 0.75], 0.0);
    assert_close(dispatch, &[3, 2, 1], &[1.0, 0.0, 0.0, 0.0, 0.0, 1.0], 0.0);
    Ok(())
}

fn cross_entropy() -> TestResult {
    let logits = f32t(&[2, 2], &[0.0, 3f64.ln(), 5.0, 5.0]);
    let y = run_one(Op::CrossEntropy, &[logits.clone(), i64t(&[2], &[1, 0])])?;
    assert_close(&y, &[2], &[(4.0f64 / 3.0).ln(), 2f64.ln()], 1e-6);
    let err =
        run_one(Op::CrossEntropy, &[logits, i64t(&[2], &[0, 2])]).expect_err("this must fail");
    assert!(matches!(
        err.innermost(),
        RuntimeError::IndexOutOfRange {
            op: "cross_entropy",
            id: 2,
            bound: 2
        }
    ));
    Ok(())
}

fn sgd_update() -> TestResult {
    let r = run_op(
        Op::SgdUpdate {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        },
        &[f32t(&[1], &[1.0]), f32t(&[1], &[0.5]), f32t(&[1], &[0.2])],
    )?;
    // m' = 0.9 * 0.2 + 0.5; p' = 1 * (1 - 0.1 * 0.01) - 0.1 * m'.
    assert_close(&r[1], &[1], &[0.68], 1e-7);
    assert_close(&r[0], &[1], &[0.931], 1e-7);
    Ok(())
}

fn adamw_update() -> TestResult {
    let r = run_op(
        Op::AdamWUpdate {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
        },
        &[
            f32t(&[2], &[1.0, 2.0]),
            f32t(&[2], &[0.5, -2.0]),
            f32t(&[2], &[0.0, 0.0]),
            f32t(&[2], &[0.0, 0.0]),
            f32t(&[], &[1.0]),
        ],
    )?;
    // At step 1 the bias-corrected update is g / |g| = ±1 (up to eps); decay multiplies p by
    // 1 - 0.1 * 0.5.
    assert_close(&r[1], &[2], &[0.05, -0.2], 1e-8);
    assert_close(&r[2], &[2], &[0.00025, 0.004], 1e-9);
    assert_close(&r[0], &[2], &[0.95 - 0.1, 1.9 + 0.1], 1e-6);
    Ok(())
}

fn communication(kind: OpKind) -> TestResult {
    let axes = vec!["dp".to_string()];
    let op = match kind {
        OpKind::AllReduce => Op::AllReduce {
            axes,
            reduce: ReduceKind::Sum,
        },
        OpKind::AllGather => Op::AllGather { axes, dim: 0 },
        OpKind::ReduceScatter => Op::ReduceScatter {
            axes,
            dim: 0,
            reduce: ReduceKind::Sum,
        },
        OpKind::AllToAll => Op::AllToAll {
            axes,
            split_dim: 0,
            concat_dim: 0,
        },
        OpKind::CollectiveBroadcast => Op::CollectiveBroadcast { axes, root: 0 },
        OpKind::Send => Op::Send {
            axis: "dp".into(),
            shift: 1,
        },
        OpKind::Recv => Op::Recv {
            axis: "dp".into(),
            shift: -1,
            ty: TensorType::new(DType::F32, [2]),
        },
        other => return Err(format!("{other:?} is not a communication op").into()),
    };
    let name = op.name();
    let mut g = Graph::new("comm");
    g.set_mesh(Some(DeviceMesh::new([("dp", 2)])?));
    let x = g.add(
        Op::Input {
            name: "x".into(),
            ty: TensorType::new(DType::F32, [2]),
            role: InputRole::Features,
        },
        &[],
    )?;
    let operands = if kind == OpKind::Recv {
        vec![]
    } else {
        vec![x]
    };
    g.add_node(op, &operands)?;
    let inputs = TensorMap::from([("x".to_string(), f32t(&[2], &[1.0, 2.0]))]);
    let err =
        run(&g, &TensorMap::new(), &inputs, RunOptions::default()).expect_err("this must fail");
    assert_eq!(err.innermost(), &RuntimeError::NeedsMultiRank { op: name });
    assert!(err.to_string().contains("multi-rank executor"), "{err}");
    Ok(())
}

#[test]
fn moe_route_groups_have_their_own_capacity() -> TestResult {
    // Two routing groups of three tokens, two experts, one slot per expert and group.
    // Group 0: token 1 finds expert 0 full and is dropped. Group 1: token 0 takes expert 1,
    // so token 1 still gets expert 0 (group 0's full expert does not matter here), and
    // token 2 finds expert 1 full in its own group.
    let g0 = [0.75, 0.25, 0.5, 0.5, 0.25, 0.75];
    let g1 = [0.25, 0.75, 0.625, 0.375, 0.125, 0.875];
    let both: Vec<f64> = g0.iter().chain(&g1).copied().collect();
    let r = run_op(moe_op(1, 1, false), &[f32t(&[2, 3, 2], &both)])?;
    assert_close(
        &r[0],
        &[2, 3, 2, 1],
        &[
            0.75, 0.0, 0.0, 0.0, 0.0, 0.75, //
            0.0, 0.75, 0.625, 0.0, 0.0, 0.0,
        ],
        0.0,
    );
    assert_close(
        &r[1],
        &[2, 3, 2, 1],
        &[
            1.0, 0.0, 0.0, 0.0, 0.0, 1.0, //
            0.0, 1.0, 1.0, 0.0, 0.0, 0.0,
        ],
        0.0,
    );
    // Each group routes exactly as it would alone, whatever the other group holds.
    for (k, group) in [g0, g1].iter().enumerate() {
        let alone = run_op(moe_op(1, 1, false), &[f32t(&[3, 2], group)])?;
        for (grouped, alone) in r.iter().zip(&alone) {
            let part = &grouped.to_f64_vec()[k * 6..(k + 1) * 6];
            assert_eq!(part, alone.to_f64_vec().as_slice());
        }
    }
    let other = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5];
    let swapped: Vec<f64> = other.iter().chain(&g1).copied().collect();
    let r2 = run_op(moe_op(1, 1, false), &[f32t(&[2, 3, 2], &swapped)])?;
    assert_eq!(r2[0].to_f64_vec()[6..], r[0].to_f64_vec()[6..]);
    Ok(())
}

#[test]
fn moe_route_fills_first_choices_before_second_and_breaks_ties_low() -> TestResult {
    // Token 0 ties between experts 0 and 1 (picks 0 first), token 1 prefers expert 0, token 2
    // prefers expert 1. Capacity 2.
    let probs = f32t(
        &[3, 3],
        &[0.375, 0.375, 0.25, 0.5, 0.25, 0.25, 0.25, 0.625, 0.125],
    );
    let r = run_op(moe_op(2, 2, false), std::slice::from_ref(&probs))?;
    let slot = |t: usize, e: usize, c: usize| (t * 3 + e) * 2 + c;
    let dispatch = r[1].to_f64_vec();
    let combine = r[0].to_f64_vec();
    let mut expected = vec![0.0; 18];
    // First choices in token order: t0 -> e0 slot 0, t1 -> e0 slot 1, t2 -> e1 slot 0.
    // Second choices: t0 -> e1 slot 1, t1 -> e1 (full: dropped), t2 -> e0 (full: dropped).
    for (t, e, c, gate) in [
        (0, 0, 0, 0.375),
        (1, 0, 1, 0.5),
        (2, 1, 0, 0.625),
        (0, 1, 1, 0.375),
    ] {
        expected[slot(t, e, c)] = gate;
    }
    assert_eq!(combine, expected);
    let ones: Vec<f64> = expected
        .iter()
        .map(|&g| if g > 0.0 { 1.0 } else { 0.0 })
        .collect();
    assert_eq!(dispatch, ones);

    // With normalisation each token's kept gates are divided by the sum of its chosen ones.
    // Capacity 3 drops nothing: second choices take e1 slots 1 and 2 and e0 slot 2.
    let r = run_op(moe_op(2, 3, true), &[probs])?;
    let slot = |t: usize, e: usize, c: usize| (t * 3 + e) * 3 + c;
    let combine = r[0].to_f64_vec();
    let rounded = |x: f64| f64::from(x as f32);
    let mut expected = vec![0.0; 27];
    for (t, e, c, gate) in [
        (0, 0, 0, 0.5),
        (1, 0, 1, 0.5 / 0.75),
        (2, 1, 0, 0.625 / 0.875),
        (0, 1, 1, 0.5),
        (1, 1, 2, 0.25 / 0.75),
        (2, 0, 2, 0.25 / 0.875),
    ] {
        expected[slot(t, e, c)] = rounded(gate);
    }
    assert_eq!(combine, expected);
    assert_eq!(
        r[1].to_f64_vec().iter().sum::<f64>(),
        6.0,
        "nothing dropped"
    );
    Ok(())
}

#[test]
fn rotary_explicit_default_positions_match_and_shifts_differ() -> TestResult {
    let (b, s, heads, d) = (2, 5, 3, 8);
    let n = b * s * heads * d;
    let x: Vec<f64> = (0..n)
        .map(|i| ((i * 37 % 101) as f64 - 50.0) / 25.0)
        .collect();
    let x = f32t(&[b, s, heads, d], &x);
    let op = Op::Rotary { base: 500.0 };
    let default = run_one(op.clone(), std::slice::from_ref(&x))?;
    let explicit = run_one(op.clone(), &[x.clone(), i64t(&[s], &[0, 1, 2, 3, 4])])?;
    assert_eq!(default, explicit);
    // Rotations preserve each pair's norm.
    let (xv, yv) = (x.to_f64_vec(), default.to_f64_vec());
    for row in 0..n / d {
        for i in 0..d / 2 {
            let at = |v: &[f64], j: usize| v[row * d + j];
            let before = at(&xv, i).hypot(at(&xv, i + d / 2));
            let after = at(&yv, i).hypot(at(&yv, i + d / 2));
            assert!((before - after).abs() < 1e-5);
        }
    }
    let shifted = run_one(op, &[x.clone(), i64t(&[s], &[1, 2, 3, 4, 5])])?;
    assert_ne!(shifted, default);
    // Row 0 at position 0 is unchanged.
    assert_eq!(&yv[..heads * d], &xv[..heads * d]);
    Ok(())
}

/// The fused attention kernel against its decomposition into primitive ops, both through the
/// interpreter, for causal and full attention with and without grouped-query heads.
#[test]
fn attention_matches_its_decomposition() -> TestResult {
    for (causal, hq, hkv, s, t) in [
        (true, 4, 4, 6, 6),
        (true, 4, 2, 5, 5),
        (false, 6, 2, 4, 7),
        (true, 2, 1, 7, 3),
        (false, 1, 1, 1, 1),
    ] {
        let (b, d, dv) = (2, 4, 3);
        let scale = 1.0 / (d as f64).sqrt();
        let mut g = Graph::new("attn");
        let mut inputs = TensorMap::new();
        let mut operand = |g: &mut Graph, name: &str, dims: [usize; 4], salt: u64| {
            let n: usize = dims.iter().product();
            let values: Vec<f64> = (0..n as u64)
                .map(|i| ((i * 7919 + salt * 104_729) % 997) as f64 / 997.0 * 4.0 - 2.0)
                .collect();
            let t = f32t(&dims, &values);
            inputs.insert(name.to_string(), t.clone());
            g.add(
                Op::Input {
                    name: name.into(),
                    ty: t.ty().clone(),
                    role: InputRole::Features,
                },
                &[],
            )
        };
        let q = operand(&mut g, "q", [b, s, hq, d], 1)?;
        let k = operand(&mut g, "k", [b, t, hkv, d], 2)?;
        let v = operand(&mut g, "v", [b, t, hkv, dv], 3)?;
        let fused = g.add(Op::Attention { causal, scale }, &[q, k, v])?;
        let reference = decomposed_attention(&mut g, [q, k, v], causal, scale)?;
        g.add_output("fused", fused)?;
        g.add_output("reference", reference)?;
        autopar_ir::verify(&g)?;
        for precision in [Precision::Declared, Precision::F64] {
            let out = run(
                &g,
                &TensorMap::new(),
                &inputs,
                RunOptions {
                    precision,
                    ..RunOptions::default()
                },
            )?;
            let (f, r) = (out.output("fused")?, out.output("reference")?);
            let tol = match precision {
                Precision::Declared => 1e-5,
                Precision::F64 => 1e-12,
            };
            assert!(
                f.all_close(r, 0.0, tol),
                "causal={causal} hq={hq} hkv={hkv} s={s} t={t} {precision:?}: max diff {:?}",
                f.max_abs_diff(r)
            );
        }
    }
    Ok(())
}

/// Attention with explicit positions: the fused kernel against its decomposition, and with
/// positions `0..s` against the op without them; permuting the rows of q, k, v and their
/// positions alike permutes the result's rows.
#[test]
fn attention_with_positions_matches_its_decomposition() -> TestResult {
    let (b, s, hq, hkv, d) = (2, 6, 4, 2, 4);
    let order: [i64; 6] = [0, 5, 1, 4, 2, 3];
    for causal in [true, false] {
        let mut g = Graph::new("attn");
        let mut inputs = TensorMap::new();
        let mut operand = |g: &mut Graph, name: &str, t: Tensor| {
            inputs.insert(name.to_string(), t.clone());
            g.add(
                Op::Input {
                    name: name.into(),
                    ty: t.ty().clone(),
                    role: InputRole::Features,
                },
                &[],
            )
        };
        let values = |n: usize, salt: u64| -> Vec<f64> {
            (0..n as u64)
                .map(|i| ((i * 7919 + salt * 104_729) % 997) as f64 / 997.0 * 4.0 - 2.0)
                .collect()
        };
        let q = operand(
            &mut g,
            "q",
            f32t(&[b, s, hq, d], &values(b * s * hq * d, 1)),
        )?;
        let k = operand(
            &mut g,
            "k",
            f32t(&[b, s, hkv, d], &values(b * s * hkv * d, 2)),
        )?;
        let v = operand(
            &mut g,
            "v",
            f32t(&[b, s, hkv, d], &values(b * s * hkv * d, 3)),
        )?;
        let iota: Vec<i64> = (0..s as i64).collect();
        let pos = operand(&mut g, "pos", i64t(&[s], &iota))?;
        let perm = operand(&mut g, "perm", i64t(&[s], &order))?;
        let scale = 0.5;
        let op = Op::Attention { causal, scale };
        let plain = g.add(op.clone(), &[q, k, v])?;
        let at_iota = g.add(op.clone(), &[q, k, v, pos, pos])?;
        let at_perm = g.add(op.clone(), &[q, k, v, perm, perm])?;
        let reference = autopar_runtime::decomposed_attention_at(
            &mut g,
            [q, k, v],
            Some([perm, perm]),
            causal,
            scale,
        )?;
        for (name, x) in [
            ("plain", plain),
            ("iota", at_iota),
            ("perm", at_perm),
            ("ref", reference),
        ] {
            g.add_output(name, x)?;
        }
        autopar_ir::verify(&g)?;
        let out = run(
            &g,
            &TensorMap::new(),
            &inputs,
            RunOptions {
                precision: Precision::F64,
                ..RunOptions::default()
            },
        )?;
        let get = |n: &str| out.output(n);
        assert!(get("plain")?.all_close(get("iota")?, 0.0, 1e-12));
        assert!(get("perm")?.all_close(get("ref")?, 0.0, 1e-12));
        if causal {
            // Query row 1 (position 5) sees every key; row 0 (position 0) only itself.
            assert!(!get("perm")?.all_close(get("plain")?, 0.0, 1e-6));
        }
    }
    Ok(())
}

/// Einsum by definition: sum over every assignment of the labels.
fn naive_einsum(spec: &str, a: &Tensor, b: &Tensor, sizes: &[(char, usize)]) -> Vec<f64> {
    let spec: autopar_ir::EinsumSpec = spec.parse().expect("valid spec");
    let labels: Vec<char> = sizes.iter().map(|&(c, _)| c).collect();
    let size = |c: char| sizes.iter().find(|&&(l, _)| l == c).map_or(1, |&(_, s)| s);
    let offset = |ls: &[char], assign: &[usize]| -> usize {
        ls.iter().fold(0, |acc, &c| {
            let p = labels.iter().position(|&l| l == c).expect("known label");
            acc * size(c) + assign[p]
        })
    };
    let out_len: usize = spec.out.iter().map(|&c| size(c)).product();
    let mut out = vec![0.0; out_len];
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    let total: usize = labels.iter().map(|&c| size(c)).product();
    let mut assign = vec![0; labels.len()];
    for mut linear in 0..total {
        for i in (0..labels.len()).rev() {
            assign[i] = linear % size(labels[i]);
            linear /= size(labels[i]);
        }
        out[offset(&spec.out, &assign)] +=
            av[offset(&spec.lhs, &assign)] * bv[offset(&spec.rhs, &assign)];
    }
    out
}

/// Where a label appears: batch, contracted, or free on one side.
fn layout_strategy() -> impl Strategy<Value = (String, Vec<(char, usize)>)> {
    let roles = prop::collection::vec((0u8..4, 1usize..4), 1..6);
    (roles, any::<u64>()).prop_flat_map(|(roles, _)| {
        let labels: Vec<(char, u8, usize)> = roles
            .iter()
            .enumerate()
            .map(|(i, &(role, size))| ((b'a' + i as u8) as char, role, size))
            .collect();
        let pick = |f: fn(u8) -> bool| -> Vec<char> {
            labels
                .iter()
                .filter(|&&(_, r, _)| f(r))
                .map(|&(c, _, _)| c)
                .collect()
        };
        // 0 batch, 1 contracting, 2 free in lhs, 3 free in rhs.
        let lhs = pick(|r| r != 3);
        let rhs = pick(|r| r != 2);
        let out = pick(|r| r != 1);
        let sizes: Vec<(char, usize)> = labels.iter().map(|&(c, _, s)| (c, s)).collect();
        (
            Just(lhs).prop_shuffle(),
            Just(rhs).prop_shuffle(),
            Just(out).prop_shuffle(),
            Just(sizes),
        )
            .prop_map(|(l, r, o, sizes)| {
                let s = |v: Vec<char>| v.into_iter().collect::<String>();
                (format!("{},{}->{}", s(l), s(r), s(o)), sizes)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn einsum_matches_the_naive_sum((spec, sizes) in layout_strategy(), salt in 0u64..1000) {
        let parsed: autopar_ir::EinsumSpec = spec.parse().expect("valid spec");
        let size = |c: &char| sizes.iter().find(|(l, _)| l == c).map_or(1, |&(_, s)| s);
        let make = |labels: &[char], salt: u64| -> Tensor {
            let dims: Vec<usize> = labels.iter().map(size).collect();
            let n: usize = dims.iter().product();
            let values: Vec<f64> = (0..n as u64)
                .map(|i| ((i * 31 + salt * 17) % 23) as f64 - 11.0)
                .collect();
            f32t(&dims, &values)
        };
        let a = make(&parsed.lhs, salt);
        let b = make(&parsed.rhs, salt + 1);
        let got = run_op_with(einsum_op(&spec), &[a.clone(), b.clone()], Precision::F64)
            .expect("einsum runs");
        let expected = naive_einsum(&spec, &a, &b, &sizes);
        let out_dims: Vec<usize> = parsed.out.iter().map(size).collect();
        prop_assert_eq!(got[0].dims(), &out_dims[..]);
        // Small integers: every product and sum is exact.
        prop_assert_eq!(got[0].to_f64_vec(), expected, "{}", spec);
    }
}

#[test]
fn einsum_of_large_random_shapes_matches_naive() -> TestResult {
    let spec = "bhsd,bhtd->bhst";
    let sizes = [('b', 2), ('h', 3), ('s', 17), ('d', 33), ('t', 19)];
    let dims = |ls: &str| -> Vec<usize> {
        ls.chars()
            .map(|c| sizes.iter().find(|&&(l, _)| l == c).map_or(1, |&(_, s)| s))
            .collect()
    };
    let make = |ls: &str, salt: u64| {
        let d = dims(ls);
        let n: usize = d.iter().product();
        let v: Vec<f64> = (0..n as u64)
            .map(|i| (((i + salt) * 2_654_435_761) % 1000) as f64 / 500.0 - 1.0)
            .collect();
        f32t(&d, &v)
    };
    let (a, b) = (make("bhsd", 3), make("bhtd", 5));
    let got = run_op_with(einsum_op(spec), &[a.clone(), b.clone()], Precision::F64)?;
    let expected = naive_einsum(spec, &a, &b, &sizes);
    let diff = got[0]
        .to_f64_vec()
        .iter()
        .zip(&expected)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(diff < 1e-12, "max diff {diff}");
    Ok(())
}
