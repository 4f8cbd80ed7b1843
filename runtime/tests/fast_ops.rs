//! Every kernel of the fast CPU backend against the reference interpreter (the oracle), on
//! random inputs of odd sizes, in f32, bf16 and f16: einsums (transposed, strided, batched,
//! outer products), element-wise ops, reductions over every dim set, softmax and norms,
//! layout ops, embedding gather and scatter-add, causal and grouped-query attention with its
//! backward, rotary, cross-entropy, the optimizer updates, and hand-written fusion bodies.

mod common;

use autopar_ir::{
    BinaryOp, CompareOp, DType, FusedInstr, FusionBody, Graph, InputRole, Op, ReduceOp, Shape,
    TensorType, UnaryOp,
};
use autopar_runtime::{
    Backend, ExecutionPlan, FastCpuBackend, RunOptions, SingleDevice, Tensor, TensorMap, run,
};
use common::TestResult;

/// A deterministic stream of numbers in `[-1, 1)`.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
}

fn rand(rng: &mut Lcg, dtype: DType, dims: &[usize], scale: f64) -> Tensor {
    let ty = TensorType::new(dtype, dims.to_vec());
    let n = ty.num_elements() as usize;
    Tensor::from_f64(ty, (0..n).map(|_| rng.next() * scale).collect()).expect("fits")
}

fn ints(dims: &[usize], values: Vec<i64>) -> Tensor {
    Tensor::from_i64(TensorType::new(DType::I64, dims.to_vec()), values).expect("fits")
}

/// Runs `op` on `operands` as a one-node graph on the interpreter and on the fast backend
/// (one and two threads) and checks that every result agrees within `tol` relative to
/// `max(1, |reference|)` per element (NaNs in the same places).
#[track_caller]
fn check(op: Op, operands: &[Tensor], tol: f64) {
    let mut g = Graph::new("one_op");
    let mut inputs = TensorMap::new();
    let mut args = Vec::new();
    for (i, t) in operands.iter().enumerate() {
        let name = format!("x{i}");
        let v = g
            .add(
                Op::Input {
                    name: name.clone(),
                    ty: t.ty().clone(),
                    role: InputRole::Features,
                },
                &[],
            )
            .expect("input");
        args.push(v);
        inputs.insert(name, t.clone());
    }
    let what = format!("{op}");
    let node = g.add_node(op, &args).expect("typed");
    let results = g.node(node).outputs.clone();
    for (i, v) in results.iter().enumerate() {
        g.add_output(format!("y{i}"), *v).expect("output");
    }
    let want = run(&g, &TensorMap::new(), &inputs, RunOptions::default()).expect("reference");
    for threads in [1, 2] {
        let backend = FastCpuBackend::new(threads, 1).expect("threads");
        let exe = backend
            .load(&g, ExecutionPlan::new(&g).expect("plan"))
            .expect("load");
        let fed: std::collections::BTreeMap<_, _> = inputs
            .iter()
            .map(|(k, t)| (k.clone(), backend.upload(t).expect("upload")))
            .collect();
        // Twice, so that the second run takes its buffers from the pool.
        for round in 0..2 {
            let got = backend
                .execute(&exe, &Default::default(), &fed, &mut SingleDevice)
                .expect("fast backend");
            for i in 0..results.len() {
                let name = format!("y{i}");
                let w = want.output(&name).expect("reference result");
                let t = backend.download(&got.outputs[&name]).expect("download");
                assert_eq!(t.ty(), w.ty(), "{what}: result {i} type");
                let (a, b) = (t.to_f64_vec(), w.to_f64_vec());
                for (j, (&x, &y)) in a.iter().zip(&b).enumerate() {
                    let ok = x == y
                        || (x.is_nan() && y.is_nan())
                        || (x - y).abs() <= tol * y.abs().max(1.0);
                    assert!(
                        ok,
                        "{what} (x{threads}, run {round}): result {i} element {j}: {x} vs reference {y}"
                    );
                }
            }
        }
    }
}

/// The tolerance of results in `dtype`: a few f32 ulps, or one ulp of bf16/f16 (the two
/// may round a value just beside a tie to neighbouring values).
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 8e-3,
        DType::F16 => 1e-3,
        _ => 2e-5,
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn einsum(spec: &str) -> Op {
    Op::Einsum {
        spec: spec.parse().expect("spec"),
    }
}

#[test]
fn einsums() -> TestResult {
    let mut rng = Lcg(1);
    let cases: &[(&str, &[usize], &[usize])] = &[
        ("ij,jk->ik", &[7, 13], &[13, 5]),
        ("ij,kj->ik", &[7, 13], &[5, 13]),
        ("ji,jk->ik", &[13, 7], &[13, 5]),
        ("ji,kj->ki", &[13, 7], &[5, 13]),
        ("bij,bjk->bik", &[3, 7, 9], &[3, 9, 5]),
        ("bij,bjk->ikb", &[3, 7, 9], &[3, 9, 5]),
        ("bsh,hnd->bsnd", &[2, 5, 12], &[12, 3, 4]),
        ("bskgd,btkd->bkgst", &[2, 6, 2, 2, 4], &[2, 6, 2, 4]),
        ("bkgst,btkd->bskgd", &[2, 2, 2, 6, 6], &[2, 6, 2, 4]),
        ("bsh,bsf->hf", &[3, 7, 5], &[3, 7, 11]),
        ("bsh,bsf->fh", &[3, 7, 5], &[3, 7, 11]),
        ("ij,j->i", &[9, 17], &[17]),
        ("i,j->ij", &[9], &[4]),
        ("ab,ab->", &[3, 300], &[3, 300]),
        ("aij,ajk->ik", &[4, 3, 5], &[4, 5, 2]),
        ("xij,jk->xik", &[1, 7, 3], &[3, 1]),
        // Large enough for the threaded paths.
        ("bsh,hf->bsf", &[4, 64, 96], &[96, 160]),
        ("bhst,bhtd->bhsd", &[2, 8, 64, 64], &[2, 8, 64, 48]),
        // Batched calls whose blocks interleave in the result (attention's backward): one
        // call per thread into blocks of their own.
        ("bkgst,bskge->btke", &[2, 3, 1, 64, 64], &[2, 64, 3, 1, 24]),
        ("bkgst,btkd->bskgd", &[2, 3, 2, 48, 64], &[2, 64, 3, 16]),
    ];
    for &(spec, a, b) in cases {
        for dtype in FLOATS {
            let x = rand(&mut rng, dtype, a, 1.0);
            let y = rand(&mut rng, dtype, b, 1.0);
            check(einsum(spec), &[x, y], tol(dtype) * 4.0);
        }
    }
    Ok(())
}

#[test]
fn element_wise() -> TestResult {
    let mut rng = Lcg(2);
    for dtype in FLOATS {
        for n in [1, 7, 1000, 70_001] {
            let x = rand(&mut rng, dtype, &[n], 4.0);
            let y = rand(&mut rng, dtype, &[n], 4.0);
            for func in UnaryOp::ALL {
                let arg = match func {
                    UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => {
                        check(
                            Op::Unary { func: UnaryOp::Abs },
                            std::slice::from_ref(&x),
                            0.0,
                        );
                        let abs: Vec<f64> = x.to_f64_vec().iter().map(|v| v.abs() + 0.01).collect();
                        Tensor::from_f64(x.ty().clone(), abs)?
                    }
                    _ => x.clone(),
                };
                check(Op::Unary { func }, &[arg], tol(dtype) * 2.0);
            }
            for func in BinaryOp::ALL {
                let (p, q) = match func {
                    BinaryOp::Pow => {
                        let p: Vec<f64> = x.to_f64_vec().iter().map(|v| v.abs() + 0.1).collect();
                        (Tensor::from_f64(x.ty().clone(), p)?, y.clone())
                    }
                    _ => (x.clone(), y.clone()),
                };
                check(Op::Binary { func }, &[p, q], tol(dtype));
            }
            for func in CompareOp::ALL {
                check(Op::Compare { func }, &[x.clone(), y.clone()], 0.0);
                check(Op::Compare { func }, &[x.clone(), x.clone()], 0.0);
            }
            let cond = Tensor::from_bool(vec![n], (0..n).map(|i| i % 3 == 0).collect())?;
            check(Op::Select, &[cond, x.clone(), y.clone()], 0.0);
            for to in [
                DType::F32,
                DType::BF16,
                DType::F16,
                DType::I32,
                DType::I64,
                DType::Bool,
            ] {
                check(Op::Cast { to }, std::slice::from_ref(&x), 0.0);
            }
        }
    }
    // Integers.
    let a = ints(&[5], vec![3, -7, 0, 1 << 40, 9]);
    let b = ints(&[5], vec![2, 3, -1, 5, -4]);
    for func in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
    ] {
        check(Op::Binary { func }, &[a.clone(), b.clone()], 0.0);
    }
    for to in [DType::F32, DType::BF16, DType::I32, DType::Bool] {
        check(Op::Cast { to }, std::slice::from_ref(&a), 0.0);
    }
    Ok(())
}

#[test]
fn reductions_softmax_and_norms() -> TestResult {
    let mut rng = Lcg(3);
    for dtype in FLOATS {
        let x = rand(&mut rng, dtype, &[3, 5, 7], 3.0);
        let dim_sets: &[&[usize]] = &[&[0], &[1], &[2], &[0, 1], &[1, 2], &[0, 2], &[0, 1, 2], &[]];
        for func in ReduceOp::ALL {
            for &dims in dim_sets {
                let op = Op::Reduce {
                    func,
                    dims: dims.to_vec(),
                };
                check(op, std::slice::from_ref(&x), tol(dtype));
            }
        }
        for dim in 0..3 {
            check(Op::Softmax { dim }, std::slice::from_ref(&x), tol(dtype));
        }
        let big = rand(&mut rng, dtype, &[64, 1031], 5.0);
        check(
            Op::Softmax { dim: 1 },
            std::slice::from_ref(&big),
            tol(dtype),
        );
        check(
            Op::Reduce {
                func: ReduceOp::Sum,
                dims: vec![0],
            },
            std::slice::from_ref(&big),
            tol(dtype),
        );
        let g = rand(&mut rng, dtype, &[7], 1.0);
        let b = rand(&mut rng, dtype, &[7], 1.0);
        check(
            Op::LayerNorm { eps: 1e-5 },
            &[x.clone(), g.clone(), b],
            tol(dtype) * 2.0,
        );
        check(Op::RmsNorm { eps: 1e-6 }, &[x.clone(), g], tol(dtype) * 2.0);
        let logits = rand(&mut rng, dtype, &[2, 9, 37], 4.0);
        let targets = ints(&[2, 9], (0..18).map(|i| (i * 7) % 37).collect());
        check(Op::CrossEntropy, &[logits, targets], tol(DType::F32) * 4.0);
    }
    Ok(())
}

#[test]
fn layout_and_embeddings() -> TestResult {
    let mut rng = Lcg(4);
    for dtype in FLOATS {
        let x = rand(&mut rng, dtype, &[3, 4, 5], 1.0);
        check(
            Op::Transpose {
                perm: vec![2, 0, 1],
            },
            std::slice::from_ref(&x),
            0.0,
        );
        check(
            Op::Transpose {
                perm: vec![0, 2, 1],
            },
            std::slice::from_ref(&x),
            0.0,
        );
        check(
            Op::Slice {
                dim: 1,
                start: 1,
                end: 3,
            },
            std::slice::from_ref(&x),
            0.0,
        );
        check(
            Op::Reshape {
                shape: Shape::new(vec![12, 5]),
            },
            std::slice::from_ref(&x),
            0.0,
        );
        let y = rand(&mut rng, dtype, &[3, 2, 5], 1.0);
        check(Op::Concat { dim: 1 }, &[x.clone(), y], 0.0);
        let row = rand(&mut rng, dtype, &[5], 1.0);
        check(
            Op::Broadcast {
                shape: Shape::new(vec![3, 4, 5]),
                dims: vec![2],
            },
            &[row],
            0.0,
        );
        let one = rand(&mut rng, dtype, &[1], 1.0);
        check(
            Op::Broadcast {
                shape: Shape::new(vec![3, 4]),
                dims: vec![1],
            },
            &[one],
            0.0,
        );
        let table = rand(&mut rng, dtype, &[11, 6], 1.0);
        let ids = ints(&[2, 5], vec![0, 3, 3, 10, 2, 7, 7, 7, 1, 0]);
        check(Op::Gather, &[table, ids.clone()], 0.0);
        let updates = rand(&mut rng, dtype, &[2, 5, 6], 1.0);
        check(Op::ScatterAdd { num_rows: 11 }, &[ids, updates], tol(dtype));
    }
    Ok(())
}

#[test]
fn attention_and_rotary() -> TestResult {
    let mut rng = Lcg(5);
    for dtype in FLOATS {
        for (hq, hkv) in [(4, 4), (4, 2), (6, 1)] {
            let (b, s, d) = (2, 7, 8);
            let q = rand(&mut rng, dtype, &[b, s, hq, d], 1.0);
            let k = rand(&mut rng, dtype, &[b, s, hkv, d], 1.0);
            let v = rand(&mut rng, dtype, &[b, s, hkv, 5], 1.0);
            let o = rand(&mut rng, dtype, &[b, s, hq, 5], 1.0);
            let g = rand(&mut rng, dtype, &[b, s, hq, 5], 1.0);
            let qp = ints(&[s], vec![0, 1, 2, 3, 4, 5, 6]);
            let kp = ints(&[s], vec![6, 0, 5, 1, 4, 2, 3]);
            for causal in [true, false] {
                let fwd = Op::Attention {
                    causal,
                    scale: 0.35,
                };
                let bwd = Op::AttentionBackward {
                    causal,
                    scale: 0.35,
                };
                let t = tol(dtype) * 4.0;
                check(fwd.clone(), &[q.clone(), k.clone(), v.clone()], t);
                let qkv = [q.clone(), k.clone(), v.clone()];
                let with_pos = [&qkv[..], &[qp.clone(), kp.clone()]].concat();
                check(fwd, &with_pos, t);
                let args = [&qkv[..], &[o.clone(), g.clone()]].concat();
                check(bwd.clone(), &args, t);
                check(bwd, &[&args[..], &[qp.clone(), kp.clone()]].concat(), t);
            }
            check(
                Op::Rotary { base: 10_000.0 },
                std::slice::from_ref(&q),
                tol(dtype),
            );
            check(Op::Rotary { base: 500.0 }, &[q, kp], tol(dtype));
        }
        // Long enough for causal attention to run in blocks of query rows (each against the
        // keys it sees), with a last block shorter than the others.
        let (b, s, hq, hkv, d) = (2, 70, 4, 2, 8);
        let q = rand(&mut rng, dtype, &[b, s, hq, d], 1.0);
        let k = rand(&mut rng, dtype, &[b, s, hkv, d], 1.0);
        let v = rand(&mut rng, dtype, &[b, s, hkv, 6], 1.0);
        for causal in [true, false] {
            let fwd = Op::Attention { causal, scale: 0.3 };
            check(fwd, &[q.clone(), k.clone(), v.clone()], tol(dtype) * 4.0);
        }
    }
    Ok(())
}

#[test]
fn optimizer_updates() -> TestResult {
    let mut rng = Lcg(6);
    for dtype in [DType::F32, DType::BF16] {
        for n in [5, 100_003] {
            let p = rand(&mut rng, dtype, &[n], 1.0);
            let g = rand(&mut rng, dtype, &[n], 1e-3);
            let m = rand(&mut rng, dtype, &[n], 1e-4);
            let v = Tensor::from_f64(
                TensorType::new(dtype, [n]),
                rand(&mut rng, dtype, &[n], 1e-6)
                    .to_f64_vec()
                    .iter()
                    .map(|x| x.abs())
                    .collect(),
            )?;
            let step = Tensor::scalar(DType::F32, 3.0);
            let adamw = Op::AdamWUpdate {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.01,
            };
            check(
                adamw,
                &[p.clone(), g.clone(), m.clone(), v, step],
                tol(dtype),
            );
            let sgd = Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
            };
            check(sgd, &[p, g, m], tol(dtype));
        }
    }
    Ok(())
}

fn instr(op: Op, operands: Vec<usize>) -> FusedInstr {
    FusedInstr { op, operands }
}

#[test]
fn fusion_bodies() -> TestResult {
    let mut rng = Lcg(7);
    for dtype in FLOATS {
        let dims = [33, 70];
        let ty = |d: &[usize]| TensorType::new(dtype, d.to_vec());
        // Element-wise with a broadcast row, a constant, compare, select and casts: tiled.
        let gelu_bias = FusionBody {
            params: vec![ty(&dims), ty(&[70])],
            instrs: vec![
                instr(
                    Op::Broadcast {
                        shape: Shape::new(dims.to_vec()),
                        dims: vec![1],
                    },
                    vec![1],
                ),
                instr(
                    Op::Binary {
                        func: BinaryOp::Add,
                    },
                    vec![0, 2],
                ),
                instr(
                    Op::Unary {
                        func: UnaryOp::Gelu,
                    },
                    vec![3],
                ),
                instr(
                    Op::Constant {
                        ty: ty(&dims),
                        value: 0.1,
                    },
                    vec![],
                ),
                // On the operand (exact in both): a transcendental result just beside the
                // constant could compare either way.
                instr(
                    Op::Compare {
                        func: CompareOp::Gt,
                    },
                    vec![0, 5],
                ),
                instr(Op::Select, vec![6, 4, 5]),
                instr(Op::Cast { to: DType::F32 }, vec![7]),
                instr(
                    Op::Reshape {
                        shape: Shape::new(vec![33 * 70]),
                    },
                    vec![8],
                ),
            ],
            results: vec![9, 6, 4],
        };
        let x = rand(&mut rng, dtype, &dims, 3.0);
        let bias = rand(&mut rng, dtype, &[70], 1.0);
        check(
            Op::Fusion { body: gelu_bias },
            &[x.clone(), bias],
            tol(dtype) * 2.0,
        );
        // Softmax as a body: reductions, so instruction by instruction.
        let red = |func| Op::Reduce {
            func,
            dims: vec![1],
        };
        let back = || Op::Broadcast {
            shape: Shape::new(dims.to_vec()),
            dims: vec![0],
        };
        let softmax = FusionBody {
            params: vec![ty(&dims)],
            instrs: vec![
                instr(red(ReduceOp::Max), vec![0]),
                instr(back(), vec![1]),
                instr(
                    Op::Binary {
                        func: BinaryOp::Sub,
                    },
                    vec![0, 2],
                ),
                instr(Op::Unary { func: UnaryOp::Exp }, vec![3]),
                instr(red(ReduceOp::Sum), vec![4]),
                instr(back(), vec![5]),
                instr(
                    Op::Binary {
                        func: BinaryOp::Div,
                    },
                    vec![4, 6],
                ),
            ],
            results: vec![7, 5],
        };
        check(Op::Fusion { body: softmax }, &[x], tol(dtype) * 2.0);
    }
    Ok(())
}

/// Bodies with reductions and integers, large enough for several thread tasks: column
/// reductions (bias and norm-weight gradients), rows reduced and broadcast back (a layer
/// norm), per-row arithmetic, and an integer one-hot compare.
#[test]
fn fusion_bodies_with_reductions_and_integers() -> TestResult {
    let mut rng = Lcg(11);
    let (rows, width) = (300, 64);
    let dims = [rows, width];
    let bin = |func| Op::Binary { func };
    let red = |func, d: usize| Op::Reduce {
        func,
        dims: vec![d],
    };
    let bcast = |to: &[usize], d: usize| Op::Broadcast {
        shape: Shape::new(to.to_vec()),
        dims: vec![d],
    };
    for dtype in FLOATS {
        let ty = |d: &[usize]| TensorType::new(dtype, d.to_vec());
        // GELU of a biased input, with the gradients of the bias: sums and means of columns.
        let bias_grad = FusionBody {
            params: vec![ty(&dims), ty(&[width])],
            instrs: vec![
                instr(bcast(&dims, 1), vec![1]),
                instr(bin(BinaryOp::Add), vec![0, 2]),
                instr(
                    Op::Unary {
                        func: UnaryOp::Gelu,
                    },
                    vec![3],
                ),
                instr(red(ReduceOp::Sum, 0), vec![4]),
                instr(red(ReduceOp::Mean, 0), vec![3]),
                instr(red(ReduceOp::Max, 0), vec![0]),
            ],
            results: vec![4, 5, 6, 7],
        };
        let x = rand(&mut rng, dtype, &dims, 3.0);
        let b = rand(&mut rng, dtype, &[width], 1.0);
        check(
            Op::Fusion { body: bias_grad },
            &[x.clone(), b.clone()],
            tol(dtype) * 4.0,
        );
        // A layer norm whose statistics are rows, with per-row arithmetic (eps, rsqrt) and
        // the column sum of the scaled result.
        let norm = FusionBody {
            params: vec![ty(&dims), ty(&[width])],
            instrs: vec![
                instr(red(ReduceOp::Mean, 1), vec![0]),
                instr(bcast(&dims, 0), vec![2]),
                instr(bin(BinaryOp::Sub), vec![0, 3]),
                instr(bin(BinaryOp::Mul), vec![4, 4]),
                instr(red(ReduceOp::Mean, 1), vec![5]),
                instr(
                    Op::Constant {
                        ty: ty(&[rows]),
                        value: 1e-5,
                    },
                    vec![],
                ),
                instr(bin(BinaryOp::Add), vec![6, 7]),
                instr(
                    Op::Unary {
                        func: UnaryOp::Rsqrt,
                    },
                    vec![8],
                ),
                instr(bcast(&dims, 0), vec![9]),
                instr(bin(BinaryOp::Mul), vec![4, 10]),
                instr(bcast(&dims, 1), vec![1]),
                instr(bin(BinaryOp::Mul), vec![11, 12]),
                instr(red(ReduceOp::Sum, 0), vec![13]),
                instr(red(ReduceOp::Max, 1), vec![0]),
            ],
            results: vec![13, 9, 14, 15],
        };
        check(Op::Fusion { body: norm }, &[x.clone(), b], tol(dtype) * 4.0);
        // The same statistics as autodiff writes them: broadcast back first, then eps and
        // rsqrt at full size. Those run once per row; the variance's broadcast and its sum
        // with eps feed nothing else and are never written out, the rsqrt feeds a full-size
        // product and is, and a per-row product of it is a result.
        let full_eps = Op::Constant {
            ty: ty(&dims),
            value: 1e-5,
        };
        let rsqrt = Op::Unary {
            func: UnaryOp::Rsqrt,
        };
        let per_row = FusionBody {
            params: vec![ty(&dims)],
            instrs: vec![
                instr(red(ReduceOp::Mean, 1), vec![0]),
                instr(bcast(&dims, 0), vec![1]),
                instr(bin(BinaryOp::Sub), vec![0, 2]),
                instr(bin(BinaryOp::Mul), vec![3, 3]),
                instr(red(ReduceOp::Mean, 1), vec![4]),
                instr(bcast(&dims, 0), vec![5]),
                instr(full_eps, vec![]),
                instr(bin(BinaryOp::Add), vec![6, 7]),
                instr(rsqrt, vec![8]),
                instr(bin(BinaryOp::Mul), vec![3, 9]),
                instr(bin(BinaryOp::Mul), vec![9, 9]),
            ],
            results: vec![10, 11],
        };
        check(
            Op::Fusion { body: per_row },
            std::slice::from_ref(&x),
            tol(dtype) * 4.0,
        );
        // The cross-entropy gradient's one-hot: integer ids against an integer iota.
        let ids = TensorType::new(DType::I64, vec![rows]);
        let iota = TensorType::new(DType::I64, vec![width]);
        let onehot = FusionBody {
            params: vec![ids.clone(), iota.clone(), ty(&dims)],
            instrs: vec![
                instr(bcast(&dims, 0), vec![0]),
                instr(bcast(&dims, 1), vec![1]),
                instr(
                    Op::Compare {
                        func: CompareOp::Eq,
                    },
                    vec![3, 4],
                ),
                instr(Op::Cast { to: dtype }, vec![5]),
                instr(bin(BinaryOp::Sub), vec![2, 6]),
            ],
            results: vec![7, 5],
        };
        let id_values: Vec<i64> = (0..rows as i64).map(|i| (i * 37) % width as i64).collect();
        check(
            Op::Fusion { body: onehot },
            &[
                ints(&[rows], id_values),
                ints(&[width], (0..width as i64).collect()),
                x,
            ],
            tol(dtype),
        );
        // A gradient norm's terms: sums of squares over every dim (fused into one pass for
        // f32 when the square has no other use), one square also returned, one summed over
        // a single dim only.
        let norm_terms = FusionBody {
            params: vec![ty(&dims), ty(&[width])],
            instrs: vec![
                instr(
                    Op::Unary {
                        func: UnaryOp::Square,
                    },
                    vec![0],
                ),
                instr(
                    Op::Reduce {
                        func: ReduceOp::Sum,
                        dims: vec![0, 1],
                    },
                    vec![2],
                ),
                instr(
                    Op::Unary {
                        func: UnaryOp::Square,
                    },
                    vec![1],
                ),
                instr(red(ReduceOp::Sum, 0), vec![4]),
                instr(bin(BinaryOp::Add), vec![3, 5]),
                instr(
                    Op::Unary {
                        func: UnaryOp::Square,
                    },
                    vec![0],
                ),
                instr(red(ReduceOp::Sum, 1), vec![7]),
            ],
            results: vec![6, 4, 8],
        };
        check(
            Op::Fusion { body: norm_terms },
            &[
                rand(&mut rng, dtype, &dims, 2.0),
                rand(&mut rng, dtype, &[width], 2.0),
            ],
            tol(dtype) * 4.0,
        );
        // A causal mask computed on `[s, s]` positions (before the tiles), broadcast over
        // batch and heads into two scaled score tensors, and selects with scalar branches.
        let (b, h, sq) = (3, 2, 24);
        let full = [b, h, sq, sq];
        let scores = ty(&full);
        let pos = TensorType::new(DType::I64, vec![sq]);
        let sq2 = [sq, sq];
        let mask = FusionBody {
            params: vec![pos, scores.clone(), scores],
            instrs: vec![
                instr(bcast(&sq2, 1), vec![0]),
                instr(bcast(&sq2, 0), vec![0]),
                instr(
                    Op::Compare {
                        func: CompareOp::Gt,
                    },
                    vec![3, 4],
                ),
                instr(
                    Op::Constant {
                        ty: ty(&full),
                        value: 0.125,
                    },
                    vec![],
                ),
                instr(bin(BinaryOp::Mul), vec![1, 6]),
                instr(
                    Op::Broadcast {
                        shape: Shape::new(full.to_vec()),
                        dims: vec![2, 3],
                    },
                    vec![5],
                ),
                instr(
                    Op::Constant {
                        ty: ty(&full),
                        value: f64::NEG_INFINITY,
                    },
                    vec![],
                ),
                instr(Op::Select, vec![8, 9, 7]),
                instr(bin(BinaryOp::Mul), vec![2, 6]),
                instr(Op::Select, vec![8, 10, 9]),
                instr(Op::Select, vec![8, 6, 9]),
            ],
            results: vec![10, 12, 13, 8],
        };
        check(
            Op::Fusion { body: mask },
            &[
                ints(&[sq], (0..sq as i64).collect()),
                rand(&mut rng, dtype, &full, 2.0),
                rand(&mut rng, dtype, &full, 2.0),
            ],
            tol(dtype),
        );
    }
    Ok(())
}

/// Tiles that read a broadcast in place (a tile inside one run of consecutive source
/// elements), tiles that straddle two runs and gather, and results written straight into
/// the output (float, bool and per-row results, one also read by a later instruction) next
/// to a result yielded twice, on sizes whose tiles do not divide the iteration space.
#[test]
fn fusion_tiles_read_broadcasts_and_write_results_in_place() -> TestResult {
    let mut rng = Lcg(23);
    let dims = [3, 5, 2000];
    let bin = |func| Op::Binary { func };
    let bcast = |dims_of: Vec<usize>| Op::Broadcast {
        shape: Shape::new(dims.to_vec()),
        dims: dims_of,
    };
    for dtype in FLOATS {
        let ty = |d: &[usize]| TensorType::new(dtype, d.to_vec());
        let mut body = FusionBody {
            params: vec![
                ty(&dims),
                ty(&[5, 2000]),
                TensorType::new(DType::I64, [3, 5]),
                TensorType::new(DType::I64, [2000]),
            ],
            instrs: vec![
                // ^4: runs of 10000 consecutive elements of ^1.
                instr(bcast(vec![1, 2]), vec![1]),
                instr(bin(BinaryOp::Add), vec![0, 4]),
                // ^6: one label per run of 2000; ^7: runs of 2000.
                instr(bcast(vec![0, 1]), vec![2]),
                instr(bcast(vec![2]), vec![3]),
                instr(
                    Op::Compare {
                        func: CompareOp::Eq,
                    },
                    vec![6, 7],
                ),
                instr(Op::Select, vec![8, 5, 0]),
                instr(bin(BinaryOp::Mul), vec![9, 5]),
            ],
            results: vec![5, 8, 10, 10],
        };
        let x = rand(&mut rng, dtype, &dims, 2.0);
        let w = rand(&mut rng, dtype, &[5, 2000], 1.0);
        let labels = ints(&[3, 5], (0..15).map(|i| i * 131 % 2000).collect());
        let positions = ints(&[2000], (0..2000).collect());
        let operands = [x, w, labels, positions];
        check(
            Op::Fusion { body: body.clone() },
            &operands,
            tol(dtype) * 2.0,
        );
        // A per-row sum as a result: tiles become whole rows of 2000.
        body.instrs.push(instr(
            Op::Reduce {
                func: ReduceOp::Sum,
                dims: vec![2],
            },
            vec![10],
        ));
        body.results = vec![11, 5, 10];
        check(Op::Fusion { body }, &operands, tol(dtype) * 4.0);
    }
    Ok(())
}
