//! Graphs shared by the text-format tests: one that uses every op kind with shardings,
//! scopes, a permuted device mesh and holes in its value numbers.

#![allow(dead_code, clippy::unwrap_used)]

use autopar_ir::{
    BinaryOp, CompareOp, DType, DeviceMesh, EinsumSpec, FusedInstr, FusionBody, Graph, Init,
    InputRole, MeshAxis, NodeId, Op, OpKind, Placement, ReduceKind, ReduceOp, Shape, Sharding,
    ShardingOrigin, TensorType, UnaryOp, ValueId,
};

pub fn f32t(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

pub fn param(g: &mut Graph, name: &str, ty: TensorType, init: Init) -> ValueId {
    g.add(
        Op::Parameter {
            name: name.into(),
            ty,
            init,
        },
        &[],
    )
    .unwrap()
}

pub fn input(g: &mut Graph, name: &str, ty: TensorType, role: InputRole) -> ValueId {
    g.add(
        Op::Input {
            name: name.into(),
            ty,
            role,
        },
        &[],
    )
    .unwrap()
}

pub fn constant(g: &mut Graph, ty: TensorType, value: f64) -> ValueId {
    g.add(Op::Constant { ty, value }, &[]).unwrap()
}

fn spec(s: &str) -> EinsumSpec {
    s.parse().unwrap()
}

fn axes(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Operands the examples draw on.
struct Ctx {
    x: ValueId,       // f32[4,8]
    y: ValueId,       // f32[4,8]
    m: ValueId,       // f32[4,8]
    v: ValueId,       // f32[4,8]
    w: ValueId,       // f32[8,16]
    gamma: ValueId,   // f32[8]
    beta: ValueId,    // f32[8]
    ids: ValueId,     // i32[2,3]
    targets: ValueId, // i64[4]
    q: ValueId,       // f32[2,4,2,8]
    pos: ValueId,     // i64[4]
    step: ValueId,    // f32[]
}

/// Adds one or more nodes of `kind` to `g` (every function of the families encoded in the
/// mnemonic). The match is exhaustive, so a new op kind must get an example here.
fn add_examples(g: &mut Graph, kind: OpKind, c: &Ctx) -> Vec<NodeId> {
    let add = |g: &mut Graph, op: Op, inputs: &[ValueId]| g.add_node(op, inputs).unwrap();
    match kind {
        OpKind::Parameter => vec![g.value(c.w).producer],
        OpKind::Input => {
            let a = input(g, "feats", f32t(&[4, 3]), InputRole::Features);
            let b = input(g, "y", f32t(&[4]), InputRole::RegressionTargets);
            vec![
                g.value(a).producer,
                g.value(b).producer,
                g.value(c.ids).producer,
            ]
        }
        OpKind::Constant => vec![g.value(c.step).producer],
        OpKind::Einsum => vec![add(
            g,
            Op::Einsum {
                spec: spec("ab,bc->ac"),
            },
            &[c.x, c.w],
        )],
        OpKind::Unary => UnaryOp::ALL
            .iter()
            .map(|&func| add(g, Op::Unary { func }, &[c.x]))
            .collect(),
        OpKind::Binary => BinaryOp::ALL
            .iter()
            .map(|&func| add(g, Op::Binary { func }, &[c.x, c.y]))
            .collect(),
        OpKind::Compare => CompareOp::ALL
            .iter()
            .map(|&func| add(g, Op::Compare { func }, &[c.x, c.y]))
            .collect(),
        OpKind::Select => {
            let lt = g
                .add(
                    Op::Compare {
                        func: CompareOp::Lt,
                    },
                    &[c.x, c.y],
                )
                .unwrap();
            vec![add(g, Op::Select, &[lt, c.x, c.y])]
        }
        OpKind::Cast => vec![add(g, Op::Cast { to: DType::BF16 }, &[c.x])],
        OpKind::Reduce => ReduceOp::ALL
            .iter()
            .map(|&func| {
                add(
                    g,
                    Op::Reduce {
                        func,
                        dims: vec![1],
                    },
                    &[c.x],
                )
            })
            .collect(),
        OpKind::Softmax => vec![add(g, Op::Softmax { dim: 1 }, &[c.x])],
        OpKind::LayerNorm => vec![add(g, Op::LayerNorm { eps: 1e-5 }, &[c.x, c.gamma, c.beta])],
        OpKind::RmsNorm => vec![add(g, Op::RmsNorm { eps: 1e-6 }, &[c.x, c.gamma])],
        OpKind::Gather => vec![add(g, Op::Gather, &[c.x, c.ids])],
        OpKind::ScatterAdd => {
            let upd = constant(g, f32t(&[2, 3, 8]), 0.5);
            vec![add(g, Op::ScatterAdd { num_rows: 4 }, &[c.ids, upd])]
        }
        OpKind::Reshape => vec![add(
            g,
            Op::Reshape {
                shape: [2, 16].into(),
            },
            &[c.x],
        )],
        OpKind::Transpose => vec![add(g, Op::Transpose { perm: vec![1, 0] }, &[c.x])],
        OpKind::Slice => vec![add(
            g,
            Op::Slice {
                dim: 1,
                start: 2,
                end: 6,
            },
            &[c.x],
        )],
        OpKind::Concat => vec![add(g, Op::Concat { dim: 0 }, &[c.x, c.y, c.m])],
        OpKind::Broadcast => vec![add(
            g,
            Op::Broadcast {
                shape: [4, 8].into(),
                dims: vec![1],
            },
            &[c.gamma],
        )],
        OpKind::Rotary => vec![
            add(g, Op::Rotary { base: 10000.0 }, &[c.q]),
            add(g, Op::Rotary { base: 500000.0 }, &[c.q, c.pos]),
        ],
        OpKind::Attention => vec![add(
            g,
            Op::Attention {
                causal: true,
                scale: 1.0 / 8f64.sqrt(),
            },
            &[c.q, c.q, c.q],
        )],
        OpKind::AttentionBackward => vec![
            add(
                g,
                Op::AttentionBackward {
                    causal: true,
                    scale: 0.5,
                },
                &[c.q, c.q, c.q, c.q, c.q],
            ),
            add(
                g,
                Op::AttentionBackward {
                    causal: false,
                    scale: 0.25,
                },
                &[c.q, c.q, c.q, c.q, c.q, c.pos, c.pos],
            ),
        ],
        OpKind::MoeRoute => {
            let probs = g.add(Op::Softmax { dim: 1 }, &[c.x]).unwrap();
            vec![add(
                g,
                Op::MoeRoute {
                    top_k: 2,
                    capacity: 3,
                    normalize: true,
                },
                &[probs],
            )]
        }
        OpKind::CrossEntropy => vec![add(g, Op::CrossEntropy, &[c.x, c.targets])],
        OpKind::SgdUpdate => vec![add(
            g,
            Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            &[c.x, c.y, c.m],
        )],
        OpKind::AdamWUpdate => vec![add(
            g,
            Op::AdamWUpdate {
                lr: 3e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            &[c.x, c.y, c.m, c.v, c.step],
        )],
        OpKind::AllReduce => vec![add(
            g,
            Op::AllReduce {
                axes: axes(&["dp", "tp"]),
                reduce: ReduceKind::Sum,
            },
            &[c.x],
        )],
        OpKind::AllGather => vec![add(
            g,
            Op::AllGather {
                axes: axes(&["tp"]),
                dim: 0,
            },
            &[c.x],
        )],
        OpKind::ReduceScatter => vec![add(
            g,
            Op::ReduceScatter {
                axes: axes(&["dp"]),
                dim: 0,
                reduce: ReduceKind::Max,
            },
            &[c.x],
        )],
        OpKind::AllToAll => vec![add(
            g,
            Op::AllToAll {
                axes: axes(&["tp"]),
                split_dim: 1,
                concat_dim: 0,
            },
            &[c.x],
        )],
        OpKind::CollectiveBroadcast => vec![add(
            g,
            Op::CollectiveBroadcast {
                axes: axes(&["pp"]),
                root: 1,
            },
            &[c.x],
        )],
        OpKind::Send => vec![add(
            g,
            Op::Send {
                axis: "pp".into(),
                shift: 1,
            },
            &[c.x],
        )],
        OpKind::Recv => vec![add(
            g,
            Op::Recv {
                axis: "pp".into(),
                shift: -1,
                ty: f32t(&[4, 8]),
            },
            &[],
        )],
        // gelu(x + broadcast(gamma)) and its row maximum, with a constant and a cast.
        OpKind::Fusion => {
            let instr = |op: Op, operands: Vec<usize>| FusedInstr { op, operands };
            let body = FusionBody {
                params: vec![f32t(&[4, 8]), f32t(&[8])],
                instrs: vec![
                    instr(
                        Op::Broadcast {
                            shape: Shape::new(vec![4, 8]),
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
                            ty: f32t(&[4, 8]),
                            value: 0.5,
                        },
                        vec![],
                    ),
                    instr(
                        Op::Binary {
                            func: BinaryOp::Mul,
                        },
                        vec![4, 5],
                    ),
                    instr(
                        Op::Reduce {
                            func: ReduceOp::Max,
                            dims: vec![1],
                        },
                        vec![6],
                    ),
                    instr(Op::Cast { to: DType::BF16 }, vec![7]),
                ],
                results: vec![6, 8],
            };
            vec![add(g, Op::Fusion { body }, &[c.x, c.gamma])]
        }
    }
}

/// A graph with every op kind (and every function of the unary, binary, comparison and
/// reduction families), shardings of both origins, scopes, a mesh with a permuted device
/// map, multi-result and zero-result ops, and holes in its value numbers.
pub fn every_op_graph() -> Graph {
    let mut g = Graph::new("every op");
    let mesh_axes = [("dp", 2), ("tp", 2), ("pp", 2)]
        .map(|(name, size)| MeshAxis {
            name: name.into(),
            size,
        })
        .to_vec();
    g.set_mesh(Some(
        DeviceMesh::with_devices(mesh_axes, vec![0, 4, 2, 6, 1, 5, 3, 7]).unwrap(),
    ));
    let x = param(&mut g, "x", f32t(&[4, 8]), Init::Normal { std: 0.02 });
    // A value that is removed again, leaving a hole in the numbering.
    let dead = g.add(Op::Unary { func: UnaryOp::Exp }, &[x]).unwrap();
    g.remove_node(g.value(dead).producer).unwrap();
    let y = param(&mut g, "y", f32t(&[4, 8]), Init::Ones);
    let m = param(&mut g, "m", f32t(&[4, 8]), Init::Zeros);
    let v = param(&mut g, "v", f32t(&[4, 8]), Init::Zeros);
    let w = param(&mut g, "w", f32t(&[8, 16]), Init::Normal { std: 1e-3 });
    let gamma = param(&mut g, "gamma", f32t(&[8]), Init::Ones);
    let beta = param(&mut g, "beta", f32t(&[8]), Init::Zeros);
    let ids = input(
        &mut g,
        "tokens",
        TensorType::new(DType::I32, [2, 3]),
        InputRole::Tokens { vocab: 4 },
    );
    let targets = input(
        &mut g,
        "targets",
        TensorType::new(DType::I64, [4]),
        InputRole::NextTokens { vocab: 8 },
    );
    let q = param(&mut g, "q", f32t(&[2, 4, 2, 8]), Init::Normal { std: 1.0 });
    let pos = input(
        &mut g,
        "positions",
        TensorType::new(DType::I64, [4]),
        InputRole::Features,
    );
    let step = constant(&mut g, TensorType::scalar(DType::F32), 1.0);
    let c = Ctx {
        x,
        y,
        m,
        v,
        w,
        gamma,
        beta,
        ids,
        targets,
        q,
        pos,
        step,
    };

    let mut by_kind = Vec::new();
    for kind in OpKind::ALL {
        let nodes = add_examples(&mut g, kind, &c);
        assert!(!nodes.is_empty(), "no example of {kind:?}");
        for n in &nodes {
            assert_eq!(g.node(*n).op.kind(), kind);
        }
        by_kind.push((kind, nodes));
    }

    // Shardings of both origins, an empty one, and an axis name that needs quoting.
    g.set_sharding(
        x,
        Some(Sharding::user([
            ("dp".to_string(), Placement::Shard(0)),
            ("tp".to_string(), Placement::Replicate),
        ])),
    )
    .unwrap();
    g.set_sharding(
        w,
        Some(Sharding {
            axes: vec![
                ("tp".into(), Placement::Shard(1)),
                ("dp".into(), Placement::Partial(ReduceKind::Sum)),
                ("pp".into(), Placement::Partial(ReduceKind::Min)),
            ],
            origin: ShardingOrigin::Inferred,
        }),
    )
    .unwrap();
    g.set_sharding(gamma, Some(Sharding::user([]))).unwrap();
    g.set_sharding(
        beta,
        Some(Sharding {
            axes: vec![
                ("a \"quoted\" axis".into(), Placement::Shard(0)),
                ("ep".into(), Placement::Partial(ReduceKind::Max)),
            ],
            origin: ShardingOrigin::Inferred,
        }),
    )
    .unwrap();
    // Shard a result of a multi-result op, too.
    let sgd = &by_kind
        .iter()
        .find(|(k, _)| *k == OpKind::SgdUpdate)
        .unwrap()
        .1[0];
    let momentum_out = g.node(*sgd).outputs[1];
    g.set_sharding(
        momentum_out,
        Some(Sharding::user([("dp".to_string(), Placement::Shard(0))])),
    )
    .unwrap();

    // Scopes, one of them with characters that need escaping.
    let nodes = g.node_ids();
    for (i, n) in nodes.iter().enumerate() {
        if i % 3 == 0 {
            g.set_scope(*n, Some(format!("h.{i}.attn")));
        }
    }
    g.set_scope(nodes[1], Some("tab\there \"q\" \\ é 🦀".into()));

    let outs: Vec<ValueId> = by_kind
        .iter()
        .flat_map(|(_, nodes)| nodes)
        .flat_map(|n| g.node(*n).outputs.clone())
        .collect();
    g.add_output("loss", outs[outs.len() - 1]).unwrap();
    g.add_output("weird \"name\"\n", outs[0]).unwrap();
    autopar_ir::verify(&g).unwrap();
    g
}
