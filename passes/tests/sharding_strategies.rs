//! Every strategy of every op, checked against the reference interpreter: global operands are
//! cut into the shards a strategy asks for (partial ones into random addends or max/min
//! candidates), each rank runs the strategy's local kernel (the op with local attributes, or
//! its lowering, with collectives simulated in lockstep), and the ranks' results, combined as
//! the result placements say, must equal the op on the global operands in `f64`.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};

use autopar_ir::{
    BinaryOp, CompareOp, DType, DeviceMesh, Graph, Init, InputRole, Op, OpKind, Placement,
    ReduceKind, ReduceOp, Shape, TensorType, UnaryOp, ValueId, verify,
};
use autopar_passes::sharding::{
    LocalKernel, Lowering, ShardContext, ShardingError, Strategy, local_op, lower, strategies,
};
use autopar_runtime::{Data, Precision, Tensor, eval_op};

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn f32_ty(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn floats(dims: &[usize], rng: &mut Rng, lo: f64, hi: f64) -> Tensor {
    let ty = f32_ty(dims);
    let n = ty.num_elements() as usize;
    let v = (0..n).map(|_| lo + (hi - lo) * rng.unit()).collect();
    Tensor::new(ty, Data::Float(v)).unwrap()
}

fn normal(dims: &[usize], rng: &mut Rng) -> Tensor {
    floats(dims, rng, -1.0, 1.0)
}

fn ints(dims: &[usize], rng: &mut Rng, bound: u64) -> Tensor {
    let ty = TensorType::new(DType::I64, dims.to_vec());
    let n = ty.num_elements() as usize;
    let v = (0..n).map(|_| rng.below(bound) as i64).collect();
    Tensor::new(ty, Data::Int(v)).unwrap()
}

fn ints_full(dims: &[usize], value: i64) -> Tensor {
    Tensor::full(TensorType::new(DType::I64, dims.to_vec()), value as f64)
}

fn bools(dims: &[usize], rng: &mut Rng) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_bool(dims.to_vec(), (0..n).map(|_| rng.below(2) == 0).collect()).unwrap()
}

/// What the test does with one op kind.
enum Cases {
    /// Ops with their global operands, run through the interpreter.
    Eval(Vec<(Op, Vec<Tensor>)>),
    /// Parameters and inputs: no kernel; only their strategies' local types are checked.
    Source(Op),
    /// Communication: must have no strategies.
    Communication(Op),
    /// Fusions: made after partitioning, so they have no strategies either.
    Fusion(Op),
}

fn einsum(spec: &str) -> Op {
    Op::Einsum {
        spec: spec.parse().unwrap(),
    }
}

/// Representative instances of every op kind. The match is exhaustive: a new op kind must
/// get cases here.
fn cases(kind: OpKind, rng: &mut Rng) -> Cases {
    let x = |rng: &mut Rng| normal(&[4, 8], rng);
    let axes = || vec!["x".to_string()];
    Cases::Eval(match kind {
        OpKind::Parameter => {
            return Cases::Source(Op::Parameter {
                name: "w".into(),
                ty: f32_ty(&[8, 4]),
                init: Init::Zeros,
            });
        }
        OpKind::Input => {
            return Cases::Source(Op::Input {
                name: "tokens".into(),
                ty: TensorType::new(DType::I64, [4, 8]),
                role: InputRole::Tokens { vocab: 16 },
            });
        }
        OpKind::Constant => vec![(
            Op::Constant {
                ty: f32_ty(&[4, 8]),
                value: 1.5,
            },
            vec![],
        )],
        OpKind::Einsum => vec![
            (
                einsum("bsh,hf->bsf"),
                vec![normal(&[4, 4, 8], rng), normal(&[8, 4], rng)],
            ),
            (
                einsum("bhsd,bhtd->bhst"),
                vec![normal(&[2, 4, 4, 8], rng), normal(&[2, 4, 8, 8], rng)],
            ),
            (einsum("ij,jk->ki"), vec![x(rng), normal(&[8, 4], rng)]),
            (
                einsum("i,j->ij"),
                vec![normal(&[4], rng), normal(&[8], rng)],
            ),
            (einsum("ij,j->i"), vec![x(rng), normal(&[8], rng)]),
        ],
        OpKind::Unary => {
            let mut v: Vec<(Op, Vec<Tensor>)> = UnaryOp::ALL
                .iter()
                .map(|&func| (Op::Unary { func }, vec![x(rng)]))
                .collect();
            v.push((
                Op::Unary { func: UnaryOp::Neg },
                vec![ints(&[4, 4], rng, 100)],
            ));
            v
        }
        OpKind::Binary => {
            let mut v: Vec<(Op, Vec<Tensor>)> = BinaryOp::ALL
                .iter()
                .map(|&func| {
                    let a = if func == BinaryOp::Pow {
                        floats(&[4, 8], rng, 0.5, 2.0)
                    } else {
                        x(rng)
                    };
                    (Op::Binary { func }, vec![a, x(rng)])
                })
                .collect();
            for func in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Max, BinaryOp::Div] {
                // Divisors in 1..=7.
                let b = eval1(
                    Op::Binary {
                        func: BinaryOp::Add,
                    },
                    &[ints(&[4, 4], rng, 7), ints_full(&[4, 4], 1)],
                );
                v.push((Op::Binary { func }, vec![ints(&[4, 4], rng, 50), b]));
            }
            v
        }
        OpKind::Compare => CompareOp::ALL
            .iter()
            .map(|&func| (Op::Compare { func }, vec![x(rng), x(rng)]))
            .collect(),
        OpKind::Select => vec![(Op::Select, vec![bools(&[4, 8], rng), x(rng), x(rng)])],
        OpKind::Cast => vec![
            (Op::Cast { to: DType::BF16 }, vec![x(rng)]),
            (
                Op::Cast { to: DType::I64 },
                vec![floats(&[4, 8], rng, -9.0, 9.0)],
            ),
            (Op::Cast { to: DType::F32 }, vec![ints(&[4, 8], rng, 9)]),
            (Op::Cast { to: DType::Bool }, vec![ints(&[4, 8], rng, 2)]),
        ],
        OpKind::Reduce => {
            let mut v = Vec::new();
            for func in ReduceOp::ALL {
                for dims in [vec![1], vec![0, 2], vec![0, 1, 2]] {
                    v.push((Op::Reduce { func, dims }, vec![normal(&[4, 4, 8], rng)]));
                }
            }
            v.push((
                Op::Reduce {
                    func: ReduceOp::Sum,
                    dims: vec![0],
                },
                vec![ints(&[4, 8], rng, 100)],
            ));
            v
        }
        OpKind::Softmax => vec![
            (Op::Softmax { dim: 1 }, vec![normal(&[4, 8, 4], rng)]),
            (Op::Softmax { dim: 0 }, vec![x(rng)]),
        ],
        OpKind::LayerNorm => vec![(
            Op::LayerNorm { eps: 1e-5 },
            vec![
                normal(&[4, 4, 8], rng),
                normal(&[8], rng),
                normal(&[8], rng),
            ],
        )],
        OpKind::RmsNorm => vec![(Op::RmsNorm { eps: 1e-5 }, vec![x(rng), normal(&[8], rng)])],
        OpKind::Gather => vec![
            (
                Op::Gather,
                vec![normal(&[8, 4], rng), ints(&[4, 2], rng, 8)],
            ),
            (
                Op::Gather,
                vec![normal(&[8, 4, 4], rng), ints(&[4], rng, 8)],
            ),
            (
                Op::Gather,
                vec![ints(&[8, 4], rng, 100), ints(&[4], rng, 8)],
            ),
        ],
        OpKind::ScatterAdd => vec![(
            Op::ScatterAdd { num_rows: 8 },
            vec![ints(&[4, 2], rng, 8), normal(&[4, 2, 4], rng)],
        )],
        OpKind::Reshape => [
            (vec![4, 8], vec![32]),
            (vec![4, 8], vec![2, 2, 8]),
            (vec![8, 4], vec![4, 2, 4]),
            (vec![4, 2, 4], vec![4, 8]),
            (vec![4, 8], vec![8, 4]),
            (vec![2, 4, 8], vec![8, 8]),
        ]
        .into_iter()
        .map(|(from, to)| {
            (
                Op::Reshape {
                    shape: Shape::new(to),
                },
                vec![normal(&from, rng)],
            )
        })
        .collect(),
        OpKind::Transpose => vec![(
            Op::Transpose {
                perm: vec![2, 0, 1],
            },
            vec![normal(&[4, 8, 4], rng)],
        )],
        OpKind::Slice => vec![
            (
                Op::Slice {
                    dim: 1,
                    start: 1,
                    end: 3,
                },
                vec![normal(&[8, 4], rng)],
            ),
            (
                Op::Slice {
                    dim: 0,
                    start: 0,
                    end: 4,
                },
                vec![normal(&[8, 4], rng)],
            ),
        ],
        OpKind::Concat => vec![(
            Op::Concat { dim: 1 },
            vec![
                normal(&[4, 2], rng),
                normal(&[4, 4], rng),
                normal(&[4, 2], rng),
            ],
        )],
        OpKind::Broadcast => vec![
            (
                Op::Broadcast {
                    shape: Shape::new([4, 8]),
                    dims: vec![0],
                },
                vec![normal(&[4], rng)],
            ),
            (
                Op::Broadcast {
                    shape: Shape::new([4, 8]),
                    dims: vec![0, 1],
                },
                vec![normal(&[1, 8], rng)],
            ),
            (
                Op::Broadcast {
                    shape: Shape::new([4, 8, 4]),
                    dims: vec![1],
                },
                vec![normal(&[8], rng)],
            ),
        ],
        OpKind::Rotary => vec![
            (
                Op::Rotary { base: 10000.0 },
                vec![normal(&[2, 4, 4, 8], rng)],
            ),
            (
                Op::Rotary { base: 500.0 },
                vec![normal(&[2, 8, 4, 8], rng), ints(&[8], rng, 40)],
            ),
        ],
        OpKind::Attention => {
            let mut v = Vec::new();
            // (hq, hkv): multi-head, grouped-query, multi-query.
            for (hq, hkv) in [(4, 4), (8, 4), (4, 2), (4, 1)] {
                for causal in [false, true] {
                    v.push((
                        Op::Attention { causal, scale: 0.5 },
                        vec![
                            normal(&[2, 4, hq, 4], rng),
                            normal(&[2, 4, hkv, 4], rng),
                            normal(&[2, 4, hkv, 8], rng),
                        ],
                    ));
                }
            }
            // Explicit positions (context parallelism's load-balanced order, and a shuffled
            // one): every query sees its own key, so no row is fully masked.
            let balanced = [0, 7, 1, 6, 2, 5, 3, 4];
            let shuffled = [3, 0, 6, 1, 7, 4, 2, 5];
            for (hq, hkv) in [(4, 2), (2, 2)] {
                for (causal, order) in [(true, balanced), (true, shuffled), (false, shuffled)] {
                    let pos =
                        Tensor::new(TensorType::new(DType::I64, [8]), Data::Int(order.to_vec()))
                            .unwrap();
                    v.push((
                        Op::Attention { causal, scale: 0.5 },
                        vec![
                            normal(&[2, 8, hq, 4], rng),
                            normal(&[2, 8, hkv, 4], rng),
                            normal(&[2, 8, hkv, 4], rng),
                            pos.clone(),
                            pos,
                        ],
                    ));
                }
            }
            v
        }
        OpKind::AttentionBackward => {
            let mut v = Vec::new();
            let balanced = [0, 7, 1, 6, 2, 5, 3, 4];
            let shuffled = [3, 0, 6, 1, 7, 4, 2, 5];
            for (hq, hkv) in [(4, 2), (2, 1)] {
                for causal in [false, true] {
                    let op = Op::AttentionBackward { causal, scale: 0.5 };
                    let (q, k, vv) = (
                        normal(&[2, 8, hq, 4], rng),
                        normal(&[2, 8, hkv, 4], rng),
                        normal(&[2, 8, hkv, 4], rng),
                    );
                    let attn = Op::Attention { causal, scale: 0.5 };
                    let o = eval1(attn.clone(), &[q.clone(), k.clone(), vv.clone()]);
                    let g = normal(&[2, 8, hq, 4], rng);
                    v.push((
                        op.clone(),
                        vec![q.clone(), k.clone(), vv.clone(), o, g.clone()],
                    ));
                    let order = if causal { balanced } else { shuffled };
                    let pos =
                        Tensor::new(TensorType::new(DType::I64, [8]), Data::Int(order.to_vec()))
                            .unwrap();
                    let positioned = [q, k, vv, pos.clone(), pos.clone()];
                    let o = eval1(attn, &positioned);
                    let [q, k, vv, ..] = positioned;
                    v.push((op, vec![q, k, vv, o, g, pos.clone(), pos]));
                }
            }
            v
        }
        OpKind::MoeRoute => vec![
            (
                Op::MoeRoute {
                    top_k: 2,
                    capacity: 3,
                    normalize: true,
                },
                vec![floats(&[8, 4], rng, 0.0, 1.0)],
            ),
            // Routing groups `[4, 2, 8, 4]`, with capacity 2 for 8 tokens of top-2 over 4
            // experts: choices are dropped, per group.
            (
                Op::MoeRoute {
                    top_k: 2,
                    capacity: 2,
                    normalize: false,
                },
                vec![floats(&[4, 2, 8, 4], rng, 0.0, 1.0)],
            ),
        ],
        OpKind::CrossEntropy => vec![
            (Op::CrossEntropy, vec![x(rng), ints(&[4], rng, 8)]),
            (
                Op::CrossEntropy,
                vec![normal(&[2, 4, 8], rng), ints(&[2, 4], rng, 8)],
            ),
        ],
        OpKind::SgdUpdate => vec![(
            Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
            },
            vec![x(rng), x(rng), x(rng)],
        )],
        OpKind::AdamWUpdate => vec![(
            Op::AdamWUpdate {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            vec![
                x(rng),
                x(rng),
                x(rng),
                floats(&[4, 8], rng, 0.0, 1.0),
                Tensor::new(TensorType::scalar(DType::F32), Data::Float(vec![3.0])).unwrap(),
            ],
        )],
        OpKind::AllReduce => {
            return Cases::Communication(Op::AllReduce {
                axes: axes(),
                reduce: ReduceKind::Sum,
            });
        }
        OpKind::AllGather => {
            return Cases::Communication(Op::AllGather {
                axes: axes(),
                dim: 0,
            });
        }
        OpKind::ReduceScatter => {
            return Cases::Communication(Op::ReduceScatter {
                axes: axes(),
                dim: 0,
                reduce: ReduceKind::Sum,
            });
        }
        OpKind::AllToAll => {
            return Cases::Communication(Op::AllToAll {
                axes: axes(),
                split_dim: 0,
                concat_dim: 1,
            });
        }
        OpKind::CollectiveBroadcast => {
            return Cases::Communication(Op::CollectiveBroadcast {
                axes: axes(),
                root: 0,
            });
        }
        OpKind::Send => {
            return Cases::Communication(Op::Send {
                axis: "x".into(),
                shift: 1,
            });
        }
        OpKind::Recv => {
            return Cases::Communication(Op::Recv {
                axis: "x".into(),
                shift: -1,
                ty: f32_ty(&[4]),
            });
        }
        OpKind::Fusion => {
            return Cases::Fusion(Op::Fusion {
                body: autopar_ir::FusionBody {
                    params: vec![f32_ty(&[4])],
                    instrs: vec![autopar_ir::FusedInstr {
                        op: Op::Unary {
                            func: autopar_ir::UnaryOp::Exp,
                        },
                        operands: vec![0],
                    }],
                    results: vec![1],
                },
            });
        }
    })
}

fn eval(op: &Op, operands: &[Tensor]) -> Vec<Tensor> {
    let refs: Vec<&Tensor> = operands.iter().collect();
    eval_op(op, &refs, Precision::F64).unwrap_or_else(|e| panic!("{op}: {e}"))
}

fn eval1(op: Op, operands: &[Tensor]) -> Tensor {
    eval(&op, operands).remove(0)
}

/// Piece `i` of `n` of `t` along `dim`.
fn piece(t: &Tensor, dim: usize, n: usize, i: usize) -> Tensor {
    let len = t.dims()[dim] / n;
    eval1(
        Op::Slice {
            dim,
            start: i * len,
            end: (i + 1) * len,
        },
        std::slice::from_ref(t),
    )
}

fn combine(k: ReduceKind, parts: &[Tensor]) -> Tensor {
    let func = match k {
        ReduceKind::Sum => BinaryOp::Add,
        ReduceKind::Max => BinaryOp::Max,
        ReduceKind::Min => BinaryOp::Min,
    };
    parts[1..].iter().fold(parts[0].clone(), |acc, p| {
        eval1(Op::Binary { func }, &[acc, p.clone()])
    })
}

/// `n` tensors whose reduction by `k` is `t`: random addends for a sum; for max (min), one
/// random rank per element holds the value and the others something below (above) it.
fn split_partial(t: &Tensor, k: ReduceKind, n: usize, rng: &mut Rng) -> Vec<Tensor> {
    let len = t.len();
    let holder: Vec<usize> = (0..len).map(|_| rng.below(n as u64) as usize).collect();
    let mut parts: Vec<Data> = Vec::new();
    match t.data() {
        Data::Float(v) => {
            let mut noise: Vec<Vec<f64>> = (0..n)
                .map(|_| (0..len).map(|_| rng.unit() * 2.0 - 1.0).collect())
                .collect();
            for i in 0..len {
                match k {
                    ReduceKind::Sum => {
                        let rest: f64 = (0..n)
                            .filter(|&r| r != holder[i])
                            .map(|r| noise[r][i])
                            .sum();
                        noise[holder[i]][i] = v[i] - rest;
                    }
                    ReduceKind::Max | ReduceKind::Min => {
                        for (r, nr) in noise.iter_mut().enumerate() {
                            let delta = nr[i].abs();
                            nr[i] = if r == holder[i] {
                                v[i]
                            } else if k == ReduceKind::Max {
                                v[i] - delta
                            } else {
                                v[i] + delta
                            };
                        }
                    }
                }
            }
            parts.extend(noise.into_iter().map(Data::Float));
        }
        Data::Int(v) => {
            let mut noise: Vec<Vec<i64>> = (0..n)
                .map(|_| (0..len).map(|_| rng.below(11) as i64 - 5).collect())
                .collect();
            for i in 0..len {
                match k {
                    ReduceKind::Sum => {
                        let rest: i64 = (0..n)
                            .filter(|&r| r != holder[i])
                            .map(|r| noise[r][i])
                            .sum();
                        noise[holder[i]][i] = v[i] - rest;
                    }
                    ReduceKind::Max | ReduceKind::Min => {
                        for (r, nr) in noise.iter_mut().enumerate() {
                            let delta = nr[i].abs();
                            nr[i] = if r == holder[i] {
                                v[i]
                            } else if k == ReduceKind::Max {
                                v[i] - delta
                            } else {
                                v[i] + delta
                            };
                        }
                    }
                }
            }
            parts.extend(noise.into_iter().map(Data::Int));
        }
        Data::Bool(_) => panic!("no partial bool values"),
    }
    parts
        .into_iter()
        .map(|d| Tensor::new(t.ty().clone(), d).unwrap())
        .collect()
}

/// Each rank's part of `t` placed as `p` over `n` ranks.
fn distribute(t: &Tensor, p: Placement, n: usize, rng: &mut Rng) -> Vec<Tensor> {
    match p {
        Placement::Replicate => vec![t.clone(); n],
        Placement::Shard(d) => (0..n).map(|i| piece(t, d, n, i)).collect(),
        Placement::Partial(k) => split_partial(t, k, n, rng),
    }
}

/// Runs a lowering on every rank in lockstep: each rank gets its own local graph (the same
/// ops, with rank-dependent constants), nodes are evaluated in order, all-reduces combine
/// the ranks' operands, and `send`s queue their operands for the `recv`s of the ranks they
/// address (first in, first out per pair of ranks).
fn run_lowered(op: &Op, lowering: Lowering, locals: &[Vec<Tensor>], n: usize) -> Vec<Vec<Tensor>> {
    let mesh = DeviceMesh::new([("x", n)]).unwrap();
    let mut graphs = Vec::new();
    let mut io: Vec<(Vec<ValueId>, Vec<ValueId>)> = Vec::new();
    for (rank, operands) in locals.iter().enumerate() {
        let mut g = Graph::new("local");
        g.set_mesh(Some(mesh.clone()));
        let inputs: Vec<ValueId> = operands
            .iter()
            .enumerate()
            .map(|(i, t)| {
                g.add(
                    Op::Input {
                        name: format!("in{i}"),
                        ty: t.ty().clone(),
                        role: InputRole::Features,
                    },
                    &[],
                )
                .unwrap()
            })
            .collect();
        let ctx = ShardContext {
            axes: vec!["x".into()],
            index: rank,
            count: n,
        };
        let outs = lower(&mut g, op, lowering, &inputs, &ctx).unwrap();
        for (i, &o) in outs.iter().enumerate() {
            g.add_output(format!("out{i}"), o).unwrap();
        }
        verify(&g).unwrap();
        graphs.push(g);
        io.push((inputs, outs));
    }
    let order = graphs[0].topo_order().unwrap();
    let mut env: Vec<HashMap<ValueId, Tensor>> = vec![HashMap::new(); n];
    let peer = |rank: usize, shift: i64| (rank as i64 + shift).rem_euclid(n as i64) as usize;
    // Messages in flight, by (from, to).
    let mut queues: HashMap<(usize, usize), std::collections::VecDeque<Tensor>> = HashMap::new();
    for (rank, (inputs, _)) in io.iter().enumerate() {
        for (v, t) in inputs.iter().zip(&locals[rank]) {
            env[rank].insert(*v, t.clone());
        }
    }
    for node in order {
        let first = graphs[0].node(node);
        match &first.op {
            Op::Input { .. } => {}
            Op::Send { shift, .. } => {
                for (rank, e) in env.iter().enumerate() {
                    let t = e[&first.inputs[0]].clone();
                    queues
                        .entry((rank, peer(rank, *shift)))
                        .or_default()
                        .push_back(t);
                }
            }
            Op::Recv { shift, ty, .. } => {
                for (rank, e) in env.iter_mut().enumerate() {
                    let from = peer(rank, *shift);
                    let t = queues
                        .get_mut(&(from, rank))
                        .and_then(std::collections::VecDeque::pop_front)
                        .expect("a recv with no message sent");
                    assert_eq!(t.ty(), ty, "recv of the wrong type");
                    e.insert(first.outputs[0], t);
                }
            }
            Op::AllReduce { reduce, .. } => {
                let parts: Vec<Tensor> = (0..n).map(|r| env[r][&first.inputs[0]].clone()).collect();
                let total = combine(*reduce, &parts);
                for e in &mut env {
                    e.insert(first.outputs[0], total.clone());
                }
            }
            _ => {
                for (rank, g) in graphs.iter().enumerate() {
                    let nd = g.node(node);
                    assert_eq!(nd.op.kind(), first.op.kind(), "ranks' local graphs differ");
                    let operands: Vec<Tensor> =
                        nd.inputs.iter().map(|v| env[rank][v].clone()).collect();
                    for (v, t) in nd.outputs.iter().zip(eval(&nd.op, &operands)) {
                        env[rank].insert(*v, t);
                    }
                }
            }
        }
    }
    assert!(
        queues.values().all(std::collections::VecDeque::is_empty),
        "messages sent but never received"
    );
    io.iter()
        .enumerate()
        .map(|(rank, (_, outs))| outs.iter().map(|v| env[rank][v].clone()).collect())
        .collect()
}

fn close(a: &Tensor, b: &Tensor) -> bool {
    a.all_close(b, 1e-9, 1e-9)
}

/// Checks one strategy of `op` over `n` ranks against the global result `expected`.
fn check(op: &Op, st: &Strategy, globals: &[Tensor], expected: &[Tensor], n: usize, rng: &mut Rng) {
    let per_operand: Vec<Vec<Tensor>> = globals
        .iter()
        .zip(&st.operands)
        .map(|(t, &p)| distribute(t, p, n, rng))
        .collect();
    let locals: Vec<Vec<Tensor>> = (0..n)
        .map(|r| per_operand.iter().map(|parts| parts[r].clone()).collect())
        .collect();
    let results: Vec<Vec<Tensor>> = match st.kernel {
        LocalKernel::Same => {
            let types: Vec<&TensorType> = globals.iter().map(Tensor::ty).collect();
            let local = local_op(op, st, &types, n).unwrap();
            locals.iter().map(|ops| eval(&local, ops)).collect()
        }
        LocalKernel::Lowered(l) => run_lowered(op, l, &locals, n),
    };
    for (j, (&p, want)) in st.results.iter().zip(expected).enumerate() {
        let parts: Vec<Tensor> = results.iter().map(|r| r[j].clone()).collect();
        let got = match p {
            Placement::Replicate => {
                for part in &parts {
                    assert!(close(part, &parts[0]), "{op} [{st}] n={n}: ranks disagree");
                }
                parts[0].clone()
            }
            Placement::Shard(d) => eval1(Op::Concat { dim: d }, &parts),
            Placement::Partial(k) => combine(k, &parts),
        };
        assert!(
            close(&got, want),
            "{op} [{st}] n={n}, result {j}: max abs diff {:?}",
            got.max_abs_diff(want)
        );
    }
}

#[test]
fn every_strategy_of_every_op_matches_the_reference() {
    let mut rng = Rng(2024);
    let mut checked: BTreeMap<String, usize> = BTreeMap::new();
    let mut sharded_ops = 0;
    for kind in OpKind::ALL {
        match cases(kind, &mut rng) {
            Cases::Communication(op) => {
                let t = f32_ty(&[4]);
                assert_eq!(
                    strategies(&op, &[&t], 2),
                    Err(ShardingError::Communication { op: op.name() })
                );
            }
            Cases::Fusion(op) => {
                let t = f32_ty(&[4]);
                assert_eq!(strategies(&op, &[&t], 2), Err(ShardingError::Fusion));
            }
            Cases::Source(op) => {
                let st = strategies(&op, &[], 2).unwrap();
                let ty = op.source_type().unwrap().clone();
                assert_eq!(st.len(), 1 + ty.rank(), "{op}: R and S(d) for every dim");
                for s in &st {
                    let local = local_op(&op, s, &[], 2).unwrap();
                    let lt = local.source_type().unwrap();
                    let elems = ty.num_elements() / lt.num_elements();
                    assert_eq!(
                        elems,
                        if s.results[0] == Placement::Replicate {
                            1
                        } else {
                            2
                        }
                    );
                }
                sharded_ops += 1;
            }
            Cases::Eval(list) => {
                let mut any_sharded = false;
                for (op, globals) in list {
                    let expected = eval(&op, &globals);
                    let types: Vec<&TensorType> = globals.iter().map(Tensor::ty).collect();
                    for n in [2, 4] {
                        let list = strategies(&op, &types, n).unwrap();
                        assert_eq!(list[0].operands, vec![Placement::Replicate; globals.len()]);
                        any_sharded |= list.len() > 1;
                        for st in &list {
                            check(&op, st, &globals, &expected, n, &mut rng);
                            *checked.entry(op.name().to_string()).or_default() += 1;
                        }
                    }
                }
                assert!(any_sharded, "{kind:?} has no sharded strategy");
                sharded_ops += usize::from(any_sharded);
            }
        }
    }
    let total: usize = checked.values().sum();
    assert!(
        sharded_ops >= 24,
        "{sharded_ops} op kinds with sharded strategies"
    );
    assert!(total > 500, "only {total} strategies checked: {checked:?}");
}

fn listed(op: &Op, types: &[TensorType], n: usize) -> Vec<String> {
    let refs: Vec<&TensorType> = types.iter().collect();
    strategies(op, &refs, n)
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn normalised_and_mixing_dims_are_not_sharded() {
    let t = f32_ty(&[4, 8]);
    let softmax = listed(&Op::Softmax { dim: 1 }, std::slice::from_ref(&t), 2);
    assert!(softmax.contains(&"S(0) -> S(0)".to_string()));
    assert!(!softmax.iter().any(|s| s.starts_with("S(1)")));
    let ln = listed(
        &Op::LayerNorm { eps: 1e-5 },
        &[t.clone(), f32_ty(&[8]), f32_ty(&[8])],
        2,
    );
    assert!(!ln.iter().any(|s| s.starts_with("S(1)")));
    let rms = listed(&Op::RmsNorm { eps: 1e-5 }, &[t.clone(), f32_ty(&[8])], 2);
    assert!(!rms.iter().any(|s| s.starts_with("S(1)")));
    assert!(!rms.iter().any(|s| s.contains("P(")));
    // Non-linear maps never pass partial sums.
    for func in [UnaryOp::Exp, UnaryOp::Gelu, UnaryOp::Square, UnaryOp::Log] {
        let l = listed(&Op::Unary { func }, std::slice::from_ref(&t), 2);
        assert!(!l.contains(&"P(sum) -> P(sum)".to_string()), "{func:?}");
    }
    let mul = listed(
        &Op::Binary {
            func: BinaryOp::Mul,
        },
        &[t.clone(), t.clone()],
        2,
    );
    assert!(!mul.contains(&"P(sum), P(sum) -> P(sum)".to_string()));
}

#[test]
fn attention_splits_batch_and_heads_but_not_the_causal_sequence() {
    let (q, k, v) = (
        f32_ty(&[2, 4, 8, 4]),
        f32_ty(&[2, 4, 2, 4]),
        f32_ty(&[2, 4, 2, 8]),
    );
    let causal = Op::Attention {
        causal: true,
        scale: 0.5,
    };
    let l = listed(&causal, &[q.clone(), k.clone(), v.clone()], 2);
    assert!(l.contains(&"S(0), S(0), S(0) -> S(0)".to_string()));
    assert!(l.contains(&"S(2), S(2), S(2) -> S(2)".to_string()));
    assert!(!l.iter().any(|s| s.contains("S(1)")));
    assert!(!l.iter().any(|s| s.starts_with("S(3)")));
    // Two kv heads cannot be split four ways, and query heads alone need one kv head.
    let l4 = listed(&causal, &[q, k, v], 4);
    assert!(!l4.iter().any(|s| s.contains("S(2)")));
}

#[test]
fn attention_with_positions_splits_the_sequence_by_ring() {
    let (q, k, v) = (
        f32_ty(&[2, 8, 4, 4]),
        f32_ty(&[2, 8, 2, 4]),
        f32_ty(&[2, 8, 2, 4]),
    );
    let pos = TensorType::new(DType::I64, [8]);
    let causal = Op::Attention {
        causal: true,
        scale: 0.5,
    };
    let l = listed(
        &causal,
        &[q.clone(), k.clone(), v.clone(), pos.clone(), pos],
        2,
    );
    assert!(l.contains(&"S(1), S(1), S(1), S(0), S(0) -> S(1) [RingAttention]".to_string()));
    // Query rows alone, every key visible to the device: the mask reads global positions.
    assert!(l.contains(&"S(1), R, R, S(0), R -> S(1)".to_string()));
    assert!(l.contains(&"S(0), S(0), S(0), R, R -> S(0)".to_string()));
    // Without positions a causal sequence split has no global positions to mask with.
    let plain = listed(&causal, &[q.clone(), k.clone(), v.clone()], 4);
    assert!(!plain.iter().any(|s| s.contains("RingAttention")));
    let full = Op::Attention {
        causal: false,
        scale: 0.5,
    };
    assert!(
        listed(&full, &[q.clone(), k.clone(), v.clone()], 4)
            .contains(&"S(1), S(1), S(1) -> S(1) [RingAttention]".to_string())
    );
    // The fused backward: a ring too, or keys whole and their gradients partial.
    let o = f32_ty(&[2, 8, 4, 4]);
    let pos = TensorType::new(DType::I64, [8]);
    let backward = Op::AttentionBackward {
        causal: true,
        scale: 0.5,
    };
    let l = listed(&backward, &[q, k, v, o.clone(), o, pos.clone(), pos], 2);
    assert!(
        l.contains(
            &"S(1), S(1), S(1), S(1), S(1), S(0), S(0) -> S(1), S(1), S(1) [RingAttentionBackward]"
                .to_string()
        )
    );
    assert!(l.contains(&"S(1), R, R, S(1), S(1), S(0), R -> S(1), P(sum), P(sum)".to_string()));
}

#[test]
fn moe_routing_splits_only_on_routing_groups() {
    let op = Op::MoeRoute {
        top_k: 2,
        capacity: 4,
        normalize: false,
    };
    // One group: tokens and experts never split.
    assert_eq!(
        listed(&op, &[f32_ty(&[8, 4])], 2),
        vec!["R -> R, R".to_string()]
    );
    // Groups split on every leading dim, never on tokens or experts.
    assert_eq!(
        listed(&op, &[f32_ty(&[2, 4, 8, 4])], 2),
        vec![
            "R -> R, R".to_string(),
            "S(0) -> S(0), S(0)".to_string(),
            "S(1) -> S(1), S(1)".to_string()
        ]
    );
}

#[test]
fn vocabulary_parallel_strategies_are_lowered() {
    let table = f32_ty(&[16, 4]);
    let ids = TensorType::new(DType::I64, [4]);
    let gather = listed(&Op::Gather, &[table, ids.clone()], 2);
    assert!(gather.contains(&"S(0), R -> P(sum) [VocabParallelGather]".to_string()));
    let ce = listed(&Op::CrossEntropy, &[f32_ty(&[4, 16]), ids], 2);
    assert!(ce.contains(&"S(1), R -> R [VocabParallelCrossEntropy]".to_string()));
    assert!(ce.contains(&"S(0), S(0) -> S(0)".to_string()));
    let mean = listed(
        &Op::Reduce {
            func: ReduceOp::Mean,
            dims: vec![1],
        },
        &[f32_ty(&[4, 16])],
        2,
    );
    assert!(mean.contains(&"S(1) -> P(sum) [PartialMean]".to_string()));
}

#[test]
fn uneven_splits_are_not_listed() {
    let op = einsum("ij,jk->ik");
    let l = listed(&op, &[f32_ty(&[3, 4]), f32_ty(&[4, 6])], 2);
    assert!(!l.iter().any(|s| s.starts_with("S(0)")));
    assert!(l.contains(&"R, S(1) -> S(1)".to_string()));
}

/// Combines the ranks' parts of one result placed as `p`.
fn gather_parts(p: Placement, parts: &[Tensor]) -> Tensor {
    match p {
        Placement::Replicate => parts[0].clone(),
        Placement::Shard(d) => eval1(Op::Concat { dim: d }, parts),
        Placement::Partial(k) => combine(k, parts),
    }
}

#[test]
fn strategies_compose_over_two_mesh_axes() {
    // A 2 x 2 mesh: the outer axis picks a strategy on the global types, the inner one on the
    // local types the outer left; the local op is made local twice.
    let mut rng = Rng(99);
    let cases: Vec<(Op, Vec<Tensor>)> = vec![
        (
            einsum("bsh,hf->bsf"),
            vec![normal(&[4, 4, 8], &mut rng), normal(&[8, 4], &mut rng)],
        ),
        (
            Op::Reduce {
                func: ReduceOp::Sum,
                dims: vec![0, 2],
            },
            vec![normal(&[4, 4, 8], &mut rng)],
        ),
        (
            Op::Reshape {
                shape: Shape::new([16, 8]),
            },
            vec![normal(&[4, 4, 8], &mut rng)],
        ),
        (
            Op::Broadcast {
                shape: Shape::new([4, 8, 4]),
                dims: vec![1],
            },
            vec![normal(&[8], &mut rng)],
        ),
    ];
    let mut pairs = 0;
    for (op, globals) in cases {
        let expected = eval(&op, &globals);
        let types: Vec<&TensorType> = globals.iter().map(Tensor::ty).collect();
        for outer in strategies(&op, &types, 2).unwrap() {
            if outer.kernel != LocalKernel::Same {
                continue;
            }
            let outer_op = local_op(&op, &outer, &types, 2).unwrap();
            // Operands of each outer rank, then of each inner rank within it.
            let outer_parts: Vec<Vec<Tensor>> = globals
                .iter()
                .zip(&outer.operands)
                .map(|(t, &p)| distribute(t, p, 2, &mut rng))
                .collect();
            let local_types: Vec<TensorType> =
                outer_parts.iter().map(|p| p[0].ty().clone()).collect();
            let local_refs: Vec<&TensorType> = local_types.iter().collect();
            for inner in strategies(&outer_op, &local_refs, 2).unwrap() {
                if inner.kernel != LocalKernel::Same {
                    continue;
                }
                let inner_op = local_op(&outer_op, &inner, &local_refs, 2).unwrap();
                let mut per_outer: Vec<Vec<Tensor>> = Vec::new();
                for o in 0..2 {
                    let inner_parts: Vec<Vec<Tensor>> = outer_parts
                        .iter()
                        .zip(&inner.operands)
                        .map(|(parts, &p)| distribute(&parts[o], p, 2, &mut rng))
                        .collect();
                    let results: Vec<Vec<Tensor>> = (0..2)
                        .map(|i| {
                            let ops: Vec<Tensor> =
                                inner_parts.iter().map(|p| p[i].clone()).collect();
                            eval(&inner_op, &ops)
                        })
                        .collect();
                    per_outer.push(
                        inner
                            .results
                            .iter()
                            .enumerate()
                            .map(|(j, &p)| {
                                let parts: Vec<Tensor> =
                                    results.iter().map(|r| r[j].clone()).collect();
                                gather_parts(p, &parts)
                            })
                            .collect(),
                    );
                }
                for (j, (&p, want)) in outer.results.iter().zip(&expected).enumerate() {
                    let parts: Vec<Tensor> = per_outer.iter().map(|r| r[j].clone()).collect();
                    let got = gather_parts(p, &parts);
                    assert!(close(&got, want), "{op} outer [{outer}] inner [{inner}]");
                }
                pairs += 1;
            }
        }
    }
    assert!(pairs > 50, "only {pairs} pairs of strategies checked");
}
