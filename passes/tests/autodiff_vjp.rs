//! Every op's VJP against central finite differences, in f64, on random small inputs.
//!
//! The test loops over `OpKind::ALL` with an exhaustive match: a new op fails to compile here
//! until it gets a case (or is asserted non-differentiable).

#![allow(clippy::unwrap_used)]

use autopar_frontends::zoo;
use autopar_ir::{
    BinaryOp, CompareOp, DType, DeviceMesh, Graph, Init, Op, OpKind, ReduceKind, ReduceOp, Shape,
    TensorType, UnaryOp, ValueId, verify,
};
use autopar_passes::PassError;
use autopar_passes::autodiff::{differentiate, has_vjp};
use autopar_runtime::rng::Stream;
use autopar_runtime::{
    Accumulation, Data, Precision, RunOptions, Tensor, TensorMap, init_parameters, run,
};

const F64: RunOptions = RunOptions {
    precision: Precision::F64,
    accumulation: Accumulation::Wide,
};

/// A graph whose parameters are fed from `values`, with a scalar `loss` output; the float
/// parameters listed in `wrt` are differentiated.
struct Case {
    label: String,
    g: Graph,
    values: TensorMap,
    wrt: Vec<(String, ValueId)>,
}

struct Builder {
    label: String,
    g: Graph,
    values: TensorMap,
    wrt: Vec<(String, ValueId)>,
}

fn normals(label: &str, n: usize) -> Vec<f64> {
    let s = Stream::new(7, label);
    (0..n as u64).map(|i| s.normal(i)).collect()
}

impl Builder {
    fn new(label: impl Into<String>) -> Self {
        Builder {
            label: label.into(),
            g: Graph::new("vjp"),
            values: TensorMap::new(),
            wrt: Vec::new(),
        }
    }

    fn param(&mut self, name: String, tensor: Tensor) -> ValueId {
        let v = self
            .g
            .add(
                Op::Parameter {
                    name: name.clone(),
                    ty: tensor.ty().clone(),
                    init: Init::Zeros,
                },
                &[],
            )
            .unwrap();
        self.values.insert(name, tensor);
        v
    }

    /// A differentiated f32 operand: standard normals mapped through `f`.
    fn float(&mut self, dims: &[usize], f: impl Fn(f64) -> f64) -> ValueId {
        let name = format!("x{}", self.values.len());
        let n = dims.iter().product();
        let data = normals(&format!("{}/{name}", self.label), n)
            .into_iter()
            .map(f)
            .collect();
        let t = Tensor::new(
            TensorType::new(DType::F32, dims.to_vec()),
            Data::Float(data),
        )
        .unwrap();
        let v = self.param(name.clone(), t);
        self.wrt.push((name, v));
        v
    }

    /// A fixed (not differentiated) operand.
    fn fixed(&mut self, tensor: Tensor) -> ValueId {
        let name = format!("c{}", self.values.len());
        self.param(name, tensor)
    }

    fn ints(&mut self, dims: &[usize], values: Vec<i64>) -> ValueId {
        self.fixed(Tensor::from_i64(TensorType::new(DType::I32, dims.to_vec()), values).unwrap())
    }

    fn op(&mut self, op: Op, inputs: &[ValueId]) -> Vec<ValueId> {
        let n = self.g.add_node(op, inputs).unwrap();
        self.g.node(n).outputs.clone()
    }

    /// `loss = sum_k sum(y_k * probe_k)` over the float results, with random probes.
    fn finish(mut self, results: &[ValueId]) -> Case {
        let mut loss: Option<ValueId> = None;
        for &y in results {
            let ty = self.g.ty(y).clone();
            if !ty.dtype.is_float() {
                continue;
            }
            let name = format!("probe{}", self.values.len());
            let data = normals(
                &format!("{}/{name}", self.label),
                ty.num_elements() as usize,
            );
            let probe = self.param(name, Tensor::new(ty.clone(), Data::Float(data)).unwrap());
            let prod = self.op(
                Op::Binary {
                    func: BinaryOp::Mul,
                },
                &[y, probe],
            )[0];
            let dims: Vec<usize> = (0..ty.rank()).collect();
            let s = if dims.is_empty() {
                prod
            } else {
                self.op(
                    Op::Reduce {
                        func: ReduceOp::Sum,
                        dims,
                    },
                    &[prod],
                )[0]
            };
            loss = Some(match loss {
                Some(l) => self.op(
                    Op::Binary {
                        func: BinaryOp::Add,
                    },
                    &[l, s],
                )[0],
                None => s,
            });
        }
        self.g
            .add_output("loss", loss.expect("a float result"))
            .unwrap();
        Case {
            label: self.label,
            g: self.g,
            values: self.values,
            wrt: self.wrt,
        }
    }
}

/// One op applied to fresh operands, as a case.
fn single(
    label: impl Into<String>,
    op: Op,
    operands: impl FnOnce(&mut Builder) -> Vec<ValueId>,
) -> Case {
    let mut b = Builder::new(label);
    let inputs = operands(&mut b);
    let results = b.op(op, &inputs);
    b.finish(&results)
}

fn away_from_zero(x: f64) -> f64 {
    x.signum() * (x.abs() + 0.5)
}

fn positive(x: f64) -> f64 {
    x.abs() + 0.5
}

/// Checks every gradient of `case` against central differences of its loss.
fn check(case: &Case) {
    let mut g = case.g.clone();
    let loss = g.output("loss").unwrap();
    let wrt: Vec<ValueId> = case.wrt.iter().map(|(_, v)| *v).collect();
    let grads = differentiate(&mut g, loss, None, &wrt).unwrap();
    for ((name, _), grad) in case.wrt.iter().zip(&grads) {
        let grad = grad.unwrap_or_else(|| panic!("{}: no gradient for {name}", case.label));
        g.add_output(format!("grad:{name}"), grad).unwrap();
    }
    verify(&g).unwrap();
    let out = run(&g, &case.values, &TensorMap::new(), F64).unwrap();
    let loss_at = |values: &TensorMap| {
        run(&case.g, values, &TensorMap::new(), F64)
            .unwrap()
            .scalar("loss")
            .unwrap()
    };
    let h = 1e-5;
    for (name, _) in &case.wrt {
        let analytic = out.outputs[&format!("grad:{name}")].to_f64_vec();
        let x = &case.values[name];
        let base = x.floats().unwrap().to_vec();
        for (i, &a) in analytic.iter().enumerate() {
            let shifted = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                let mut values = case.values.clone();
                values.insert(
                    name.clone(),
                    Tensor::new(x.ty().clone(), Data::Float(v)).unwrap(),
                );
                loss_at(&values)
            };
            let fd = (shifted(h) - shifted(-h)) / (2.0 * h);
            assert!(
                (a - fd).abs() <= 1e-6 + 1e-5 * fd.abs(),
                "{}: d loss / d {name}[{i}] is {a} by autodiff, {fd} by finite differences",
                case.label
            );
        }
    }
}

/// Asserts that differentiating through `op` (applied to `operands`) is refused.
fn assert_refused(
    label: &str,
    op: Op,
    operands: impl FnOnce(&mut Builder) -> Vec<ValueId>,
    mesh: bool,
) {
    let mut b = Builder::new(label);
    if mesh {
        b.g.set_mesh(Some(DeviceMesh::new([("dp", 2)]).unwrap()));
    }
    let inputs = operands(&mut b);
    let results = b.op(op.clone(), &inputs);
    let mut case = b.finish(&results[..1]);
    let loss = case.g.output("loss").unwrap();
    let wrt: Vec<ValueId> = case.wrt.iter().map(|(_, v)| *v).collect();
    let err = differentiate(&mut case.g, loss, None, &wrt).unwrap_err();
    assert!(
        matches!(err, PassError::NotDifferentiable { op: name, .. } if name == op.name()),
        "{label}: {err}"
    );
    assert!(!has_vjp(&op), "{label}");
}

/// Maps standard normals into an op's domain.
type Domain = fn(f64) -> f64;

fn unary_domain(func: UnaryOp) -> Domain {
    match func {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => positive,
        UnaryOp::Recip | UnaryOp::Abs | UnaryOp::Relu => away_from_zero,
        UnaryOp::Neg
        | UnaryOp::Exp
        | UnaryOp::Square
        | UnaryOp::Tanh
        | UnaryOp::Sigmoid
        | UnaryOp::Gelu
        | UnaryOp::GeluGrad
        | UnaryOp::Silu
        | UnaryOp::Erf
        | UnaryOp::GeluErf
        | UnaryOp::Sin
        | UnaryOp::Cos => |x| x,
    }
}

/// The cases of one op kind: differentiable ones are checked, the others asserted refused.
fn cases(kind: OpKind) -> Vec<Case> {
    let f32_ty = |dims: &[usize]| TensorType::new(DType::F32, dims.to_vec());
    match kind {
        // Sources have no operands: there is nothing to differentiate, and nothing to refuse.
        OpKind::Parameter | OpKind::Input | OpKind::Constant => {
            let op = match kind {
                OpKind::Parameter => Op::Parameter {
                    name: "p".into(),
                    ty: f32_ty(&[2]),
                    init: Init::Zeros,
                },
                OpKind::Input => Op::Input {
                    name: "i".into(),
                    ty: f32_ty(&[2]),
                    role: autopar_ir::InputRole::Features,
                },
                _ => Op::Constant {
                    ty: f32_ty(&[2]),
                    value: 1.0,
                },
            };
            assert!(has_vjp(&op));
            Vec::new()
        }
        OpKind::Einsum => vec![
            single(
                "einsum batch",
                Op::Einsum {
                    spec: "abc,acd->abd".parse().unwrap(),
                },
                |b| vec![b.float(&[2, 3, 4], |x| x), b.float(&[2, 4, 5], |x| x)],
            ),
            single(
                "einsum free",
                Op::Einsum {
                    spec: "bsh,hnd->bsnd".parse().unwrap(),
                },
                |b| vec![b.float(&[2, 3, 4], |x| x), b.float(&[4, 2, 3], |x| x)],
            ),
        ],
        OpKind::Unary => UnaryOp::ALL
            .iter()
            .map(|&func| {
                single(format!("unary {}", func.name()), Op::Unary { func }, |b| {
                    vec![b.float(&[3, 4], unary_domain(func))]
                })
            })
            .collect(),
        OpKind::Binary => BinaryOp::ALL
            .iter()
            .map(|&func| {
                let (fa, fb): (Domain, Domain) = match func {
                    BinaryOp::Div => (|x| x, away_from_zero),
                    BinaryOp::Pow => (positive, |x| x),
                    BinaryOp::Add
                    | BinaryOp::Sub
                    | BinaryOp::Mul
                    | BinaryOp::Max
                    | BinaryOp::Min => (|x| x, |x| x),
                };
                single(
                    format!("binary {}", func.name()),
                    Op::Binary { func },
                    |b| vec![b.float(&[3, 4], fa), b.float(&[3, 4], fb)],
                )
            })
            .collect(),
        // A comparison's result is `bool`: its operands get no gradient through it.
        OpKind::Compare => {
            for func in CompareOp::ALL {
                let mut b = Builder::new("compare");
                let (x, y) = (b.float(&[3], |x| x), b.float(&[3], |x| x));
                let c = b.op(Op::Compare { func }, &[x, y])[0];
                let (p, q) = (
                    b.fixed(Tensor::full(f32_ty(&[3]), 1.0)),
                    b.fixed(Tensor::full(f32_ty(&[3]), 2.0)),
                );
                let s = b.op(Op::Select, &[c, p, q])[0];
                let mut case = b.finish(&[s]);
                let loss = case.g.output("loss").unwrap();
                let grads = differentiate(&mut case.g, loss, None, &[x, y]).unwrap();
                assert_eq!(grads, vec![None, None], "{}", func.name());
            }
            Vec::new()
        }
        OpKind::Select => vec![single("select", Op::Select, |b| {
            let cond = b.fixed(
                Tensor::from_bool([2, 3], vec![true, false, false, true, true, false]).unwrap(),
            );
            vec![cond, b.float(&[2, 3], |x| x), b.float(&[2, 3], |x| x)]
        })],
        OpKind::Cast => {
            // To an integer dtype nothing flows back.
            let mut b = Builder::new("cast to int");
            let x = b.float(&[3], |x| 3.0 * x);
            let i = b.op(Op::Cast { to: DType::I32 }, &[x])[0];
            let f = b.op(Op::Cast { to: DType::F32 }, &[i])[0];
            let mut case = b.finish(&[f]);
            let loss = case.g.output("loss").unwrap();
            assert_eq!(
                differentiate(&mut case.g, loss, None, &[x]).unwrap(),
                vec![None]
            );
            vec![
                single("cast bf16", Op::Cast { to: DType::BF16 }, |b| {
                    vec![b.float(&[2, 3], |x| x)]
                }),
                single("cast f16", Op::Cast { to: DType::F16 }, |b| {
                    vec![b.float(&[2, 3], |x| x)]
                }),
            ]
        }
        OpKind::Reduce => ReduceOp::ALL
            .iter()
            .map(|&func| {
                let op = Op::Reduce {
                    func,
                    dims: vec![0, 2],
                };
                single(format!("reduce {}", func.name()), op, |b| {
                    vec![b.float(&[2, 3, 4], |x| x)]
                })
            })
            .collect(),
        OpKind::Softmax => vec![single("softmax", Op::Softmax { dim: 1 }, |b| {
            vec![b.float(&[2, 3, 4], |x| x)]
        })],
        OpKind::LayerNorm => vec![single("layer_norm", Op::LayerNorm { eps: 1e-5 }, |b| {
            vec![
                b.float(&[2, 3, 5], |x| x),
                b.float(&[5], |x| 1.0 + 0.1 * x),
                b.float(&[5], |x| x),
            ]
        })],
        OpKind::RmsNorm => vec![single("rms_norm", Op::RmsNorm { eps: 1e-5 }, |b| {
            vec![b.float(&[2, 3, 5], |x| x), b.float(&[5], |x| 1.0 + 0.1 * x)]
        })],
        OpKind::Gather => vec![single("gather", Op::Gather, |b| {
            vec![
                b.float(&[5, 3], |x| x),
                b.ints(&[2, 4], vec![0, 4, 2, 2, 1, 0, 4, 3]),
            ]
        })],
        OpKind::ScatterAdd => vec![single("scatter_add", Op::ScatterAdd { num_rows: 5 }, |b| {
            vec![
                b.ints(&[2, 3], vec![1, 4, 1, 0, 0, 3]),
                b.float(&[2, 3, 4], |x| x),
            ]
        })],
        OpKind::Reshape => vec![single(
            "reshape",
            Op::Reshape {
                shape: Shape::new([6, 4]),
            },
            |b| vec![b.float(&[2, 3, 4], |x| x)],
        )],
        OpKind::Transpose => vec![single(
            "transpose",
            Op::Transpose {
                perm: vec![2, 0, 1],
            },
            |b| vec![b.float(&[2, 3, 4], |x| x)],
        )],
        OpKind::Slice => vec![
            single(
                "slice middle",
                Op::Slice {
                    dim: 1,
                    start: 1,
                    end: 3,
                },
                |b| vec![b.float(&[2, 4, 3], |x| x)],
            ),
            single(
                "slice start",
                Op::Slice {
                    dim: 0,
                    start: 0,
                    end: 1,
                },
                |b| vec![b.float(&[2, 4], |x| x)],
            ),
        ],
        OpKind::Concat => vec![single("concat", Op::Concat { dim: 1 }, |b| {
            vec![
                b.float(&[2, 1, 3], |x| x),
                b.float(&[2, 3, 3], |x| x),
                b.float(&[2, 2, 3], |x| x),
            ]
        })],
        OpKind::Broadcast => vec![
            single(
                "broadcast expand",
                Op::Broadcast {
                    shape: Shape::new([2, 3, 4]),
                    dims: vec![1, 2],
                },
                |b| vec![b.float(&[3, 1], |x| x)],
            ),
            single(
                "broadcast scalar",
                Op::Broadcast {
                    shape: Shape::new([2, 3]),
                    dims: vec![],
                },
                |b| vec![b.float(&[], |x| x)],
            ),
        ],
        OpKind::Rotary => vec![
            single("rotary", Op::Rotary { base: 10000.0 }, |b| {
                vec![b.float(&[2, 3, 2, 4], |x| x)]
            }),
            single("rotary at positions", Op::Rotary { base: 100.0 }, |b| {
                vec![b.float(&[2, 3, 2, 4], |x| x), b.ints(&[3], vec![5, 1, 7])]
            }),
        ],
        OpKind::Attention => vec![
            single(
                "attention causal gqa",
                Op::Attention {
                    causal: true,
                    scale: 0.7,
                },
                |b| {
                    vec![
                        b.float(&[2, 3, 4, 2], |x| x),
                        b.float(&[2, 3, 2, 2], |x| x),
                        b.float(&[2, 3, 2, 3], |x| x),
                    ]
                },
            ),
            single(
                "attention full",
                Op::Attention {
                    causal: false,
                    scale: 0.5,
                },
                |b| {
                    vec![
                        b.float(&[1, 3, 2, 2], |x| x),
                        b.float(&[1, 4, 2, 2], |x| x),
                        b.float(&[1, 4, 2, 3], |x| x),
                    ]
                },
            ),
            // Explicit positions differentiate through the fused `attention_backward`.
            single(
                "attention causal positions",
                Op::Attention {
                    causal: true,
                    scale: 0.7,
                },
                |b| {
                    vec![
                        b.float(&[2, 4, 4, 2], |x| x),
                        b.float(&[2, 4, 2, 2], |x| x),
                        b.float(&[2, 4, 2, 3], |x| x),
                        b.ints(&[4], vec![0, 3, 1, 2]),
                        b.ints(&[4], vec![0, 3, 1, 2]),
                    ]
                },
            ),
        ],
        OpKind::AttentionBackward => {
            let op = Op::AttentionBackward {
                causal: true,
                scale: 0.5,
            };
            assert_refused(
                "attention_backward",
                op,
                |b| (0..5).map(|_| b.float(&[1, 2, 1, 2], |x| x)).collect(),
                false,
            );
            Vec::new()
        }
        OpKind::MoeRoute => [true, false]
            .into_iter()
            .map(|normalize| {
                let op = Op::MoeRoute {
                    top_k: 2,
                    capacity: 3,
                    normalize,
                };
                single(format!("moe_route normalize={normalize}"), op, |b| {
                    // Probabilities with gaps far above the finite-difference step, so the
                    // routing does not change under it; 6 tokens, 2 choices each, 3 slots
                    // per expert: some choices are dropped.
                    vec![b.float(&[6, 3], |x| 0.2 + 0.1 * (x * 3.0).round() + 0.01 * x)]
                })
            })
            .chain([single(
                "moe_route in routing groups",
                Op::MoeRoute {
                    top_k: 2,
                    capacity: 2,
                    normalize: true,
                },
                // Two groups of three routing groups of 4 tokens, 2 slots per expert each.
                |b| vec![b.float(&[2, 3, 4, 3], |x| 0.2 + 0.1 * (x * 3.0).round() + 0.01 * x)],
            )])
            .collect(),
        OpKind::CrossEntropy => vec![single("cross_entropy", Op::CrossEntropy, |b| {
            vec![
                b.float(&[2, 3, 5], |x| x),
                b.ints(&[2, 3], vec![0, 4, 2, 2, 1, 3]),
            ]
        })],
        OpKind::SgdUpdate => {
            let op = Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            };
            assert_refused(
                "sgd_update",
                op,
                |b| (0..3).map(|_| b.float(&[3], |x| x)).collect(),
                false,
            );
            Vec::new()
        }
        OpKind::AdamWUpdate => {
            let op = Op::AdamWUpdate {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
            };
            assert_refused(
                "adamw_update",
                op,
                |b| {
                    let mut v: Vec<ValueId> = (0..4).map(|_| b.float(&[3], |x| x)).collect();
                    v.push(b.fixed(Tensor::scalar(DType::F32, 1.0)));
                    v
                },
                false,
            );
            Vec::new()
        }
        OpKind::AllReduce
        | OpKind::AllGather
        | OpKind::ReduceScatter
        | OpKind::AllToAll
        | OpKind::CollectiveBroadcast => {
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
                    concat_dim: 1,
                },
                _ => Op::CollectiveBroadcast { axes, root: 0 },
            };
            assert_refused(op.name(), op, |b| vec![b.float(&[4, 2], |x| x)], true);
            Vec::new()
        }
        // Point-to-point ops have no rule: `send` has no results and `recv` no operands.
        OpKind::Send | OpKind::Recv => {
            let op = match kind {
                OpKind::Send => Op::Send {
                    axis: "pp".into(),
                    shift: 1,
                },
                _ => Op::Recv {
                    axis: "pp".into(),
                    shift: -1,
                    ty: f32_ty(&[2]),
                },
            };
            assert!(!has_vjp(&op));
            Vec::new()
        }
        // Fusions are made after the step is differentiated and partitioned.
        OpKind::Fusion => {
            let op = Op::Fusion {
                body: autopar_ir::FusionBody {
                    params: vec![f32_ty(&[4, 2])],
                    instrs: vec![autopar_ir::FusedInstr {
                        op: Op::Unary { func: UnaryOp::Exp },
                        operands: vec![0],
                    }],
                    results: vec![1],
                },
            };
            assert_refused("fusion", op, |b| vec![b.float(&[4, 2], |x| x)], false);
            Vec::new()
        }
    }
}

#[test]
fn every_vjp_matches_finite_differences() {
    let mut checked = 0;
    for kind in OpKind::ALL {
        for case in cases(kind) {
            check(&case);
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} cases");
}

/// Whole models: the gradient of every weight (a few elements each) against finite
/// differences of the loss, in f64.
#[test]
fn model_gradients_match_finite_differences() {
    let specs = [
        "gpt:layers=1,hidden=8,heads=2,seq=4,vocab=11",
        "llama:layers=1,hidden=8,heads=2,kv_heads=1,ffn=12,seq=4,vocab=11",
        "moe:layers=1,hidden=8,heads=2,seq=4,vocab=11,experts=3,top_k=2,ffn=8",
        "mlp-tiny",
    ];
    for spec in specs {
        let forward = zoo::build(spec, 2).unwrap();
        let params = init_parameters(&forward, 3).unwrap();
        let batch = autopar_runtime::synthetic_batch(&forward, 3, 0).unwrap();
        let mut g = forward.clone();
        let loss = g.output("loss").unwrap();
        let weights: Vec<(String, ValueId)> = g
            .parameters()
            .into_iter()
            .map(|(v, name, _)| (name.to_string(), v))
            .collect();
        let wrt: Vec<ValueId> = weights.iter().map(|(_, v)| *v).collect();
        let grads = differentiate(&mut g, loss, None, &wrt).unwrap();
        for ((name, _), grad) in weights.iter().zip(&grads) {
            g.add_output(format!("grad:{name}"), grad.unwrap()).unwrap();
        }
        verify(&g).unwrap();
        let out = run(&g, &params, &batch, F64).unwrap();
        let loss_at = |p: &TensorMap| {
            run(&forward, p, &batch, F64)
                .unwrap()
                .scalar("loss")
                .unwrap()
        };
        let h = 1e-6;
        for (name, _) in &weights {
            let analytic = out.outputs[&format!("grad:{name}")].to_f64_vec();
            let x = &params[name];
            let n = analytic.len();
            for i in [0, n / 3, n - 1] {
                let shifted = |delta: f64| {
                    let mut v = x.to_f64_vec();
                    v[i] += delta;
                    let mut p = params.clone();
                    p.insert(
                        name.clone(),
                        Tensor::new(x.ty().clone(), Data::Float(v)).unwrap(),
                    );
                    loss_at(&p)
                };
                let fd = (shifted(h) - shifted(-h)) / (2.0 * h);
                let a = analytic[i];
                assert!(
                    (a - fd).abs() <= 1e-6 + 1e-4 * fd.abs(),
                    "{spec}: d loss / d {name}[{i}] is {a} by autodiff, {fd} by finite differences"
                );
            }
        }
    }
}
