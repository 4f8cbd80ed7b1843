#![allow(clippy::unwrap_used)]
//! Shape and dtype inference: for every op kind, one well-typed case with its exact result
//! types and one ill-typed case whose error names the op and the offending shapes.

use autopar_ir::infer::{infer, num_results};
use autopar_ir::*;

fn t(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn f32t(dims: &[usize]) -> TensorType {
    t(DType::F32, dims)
}

fn i32t(dims: &[usize]) -> TensorType {
    t(DType::I32, dims)
}

fn axes(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A well-typed application, its expected result types, and an ill-typed one with the
/// fragments its error message must contain.
struct Case {
    op: Op,
    inputs: Vec<TensorType>,
    expect: Vec<TensorType>,
    bad_op: Op,
    bad_inputs: Vec<TensorType>,
    bad_msg: Vec<&'static str>,
}

fn case(kind: OpKind) -> Case {
    let ein = |s: &str| Op::Einsum {
        spec: s.parse().unwrap(),
    };
    match kind {
        OpKind::Parameter => Case {
            op: Op::Parameter {
                name: "w".into(),
                ty: f32t(&[3, 4]),
                init: Init::Zeros,
            },
            inputs: vec![],
            expect: vec![f32t(&[3, 4])],
            bad_op: Op::Parameter {
                name: "w".into(),
                ty: f32t(&[3]),
                init: Init::Ones,
            },
            bad_inputs: vec![f32t(&[3])],
            bad_msg: vec!["`parameter`", "takes 0 operands, got 1"],
        },
        OpKind::Input => Case {
            op: Op::Input {
                name: "x".into(),
                ty: i32t(&[2, 5]),
                role: InputRole::Tokens { vocab: 9 },
            },
            inputs: vec![],
            expect: vec![i32t(&[2, 5])],
            bad_op: Op::Input {
                name: "x".into(),
                ty: i32t(&[2]),
                role: InputRole::Features,
            },
            bad_inputs: vec![i32t(&[2])],
            bad_msg: vec!["`input`", "takes 0 operands"],
        },
        OpKind::Constant => Case {
            op: Op::Constant {
                ty: t(DType::Bool, &[2]),
                value: 1.0,
            },
            inputs: vec![],
            expect: vec![t(DType::Bool, &[2])],
            bad_op: Op::Constant {
                ty: i32t(&[]),
                value: 0.5,
            },
            bad_inputs: vec![],
            bad_msg: vec!["`constant`", "0.5 is not an integer"],
        },
        OpKind::Einsum => Case {
            op: ein("bhsd,bhtd->bhst"),
            inputs: vec![f32t(&[2, 4, 8, 16]), f32t(&[2, 4, 6, 16])],
            expect: vec![f32t(&[2, 4, 8, 6])],
            bad_op: ein("bsh,hf->bsf"),
            bad_inputs: vec![f32t(&[8, 32, 64]), f32t(&[32, 256])],
            bad_msg: vec!["`einsum`", "label `h`", "f32[8,32,64]", "f32[32,256]"],
        },
        OpKind::Unary => Case {
            op: Op::Unary {
                func: UnaryOp::Gelu,
            },
            inputs: vec![t(DType::BF16, &[3])],
            expect: vec![t(DType::BF16, &[3])],
            bad_op: Op::Unary { func: UnaryOp::Exp },
            bad_inputs: vec![i32t(&[3])],
            bad_msg: vec!["`exp`", "i32[3]"],
        },
        OpKind::Binary => Case {
            op: Op::Binary {
                func: BinaryOp::Mul,
            },
            inputs: vec![f32t(&[2, 3]), f32t(&[2, 3])],
            expect: vec![f32t(&[2, 3])],
            bad_op: Op::Binary {
                func: BinaryOp::Add,
            },
            bad_inputs: vec![f32t(&[2, 3]), f32t(&[3, 2])],
            bad_msg: vec!["`add`", "f32[2,3] vs f32[3,2]"],
        },
        OpKind::Compare => Case {
            op: Op::Compare {
                func: CompareOp::Lt,
            },
            inputs: vec![i32t(&[4]), i32t(&[4])],
            expect: vec![t(DType::Bool, &[4])],
            bad_op: Op::Compare {
                func: CompareOp::Eq,
            },
            bad_inputs: vec![i32t(&[4]), f32t(&[4])],
            bad_msg: vec!["`eq`", "i32[4] vs f32[4]"],
        },
        OpKind::Select => Case {
            op: Op::Select,
            inputs: vec![t(DType::Bool, &[2, 2]), f32t(&[2, 2]), f32t(&[2, 2])],
            expect: vec![f32t(&[2, 2])],
            bad_op: Op::Select,
            bad_inputs: vec![f32t(&[2, 2]), f32t(&[2, 2]), f32t(&[2, 2])],
            bad_msg: vec!["`select`", "condition f32[2,2]"],
        },
        OpKind::Cast => Case {
            op: Op::Cast { to: DType::BF16 },
            inputs: vec![f32t(&[5])],
            expect: vec![t(DType::BF16, &[5])],
            bad_op: Op::Cast { to: DType::F16 },
            bad_inputs: vec![],
            bad_msg: vec!["`cast`", "takes 1 operands, got 0"],
        },
        OpKind::Reduce => Case {
            op: Op::Reduce {
                func: ReduceOp::Mean,
                dims: vec![0, 2],
            },
            inputs: vec![f32t(&[2, 3, 4])],
            expect: vec![f32t(&[3])],
            bad_op: Op::Reduce {
                func: ReduceOp::Sum,
                dims: vec![1, 1],
            },
            bad_inputs: vec![f32t(&[2, 3])],
            bad_msg: vec!["`reduce_sum`", "dims", "f32[2,3]"],
        },
        OpKind::Softmax => Case {
            op: Op::Softmax { dim: 1 },
            inputs: vec![f32t(&[2, 3])],
            expect: vec![f32t(&[2, 3])],
            bad_op: Op::Softmax { dim: 2 },
            bad_inputs: vec![f32t(&[2, 3])],
            bad_msg: vec!["`softmax`", "dim 2 is out of range for f32[2,3]"],
        },
        OpKind::LayerNorm => Case {
            op: Op::LayerNorm { eps: 1e-5 },
            inputs: vec![f32t(&[2, 8]), f32t(&[8]), f32t(&[8])],
            expect: vec![f32t(&[2, 8])],
            bad_op: Op::LayerNorm { eps: 1e-5 },
            bad_inputs: vec![f32t(&[2, 8]), f32t(&[4]), f32t(&[8])],
            bad_msg: vec!["`layer_norm`", "f32[4]", "f32[2,8]"],
        },
        OpKind::RmsNorm => Case {
            op: Op::RmsNorm { eps: 1e-6 },
            inputs: vec![f32t(&[2, 3, 8]), f32t(&[8])],
            expect: vec![f32t(&[2, 3, 8])],
            bad_op: Op::RmsNorm { eps: 1e-6 },
            bad_inputs: vec![f32t(&[2, 8]), t(DType::BF16, &[8])],
            bad_msg: vec!["`rms_norm`", "bf16[8]"],
        },
        OpKind::Gather => Case {
            op: Op::Gather,
            inputs: vec![f32t(&[256, 64]), i32t(&[8, 32])],
            expect: vec![f32t(&[8, 32, 64])],
            bad_op: Op::Gather,
            bad_inputs: vec![f32t(&[256, 64]), f32t(&[8, 32])],
            bad_msg: vec!["`gather`", "f32[8,32]", "i32 or i64"],
        },
        OpKind::ScatterAdd => Case {
            op: Op::ScatterAdd { num_rows: 256 },
            inputs: vec![i32t(&[8, 32]), f32t(&[8, 32, 64])],
            expect: vec![f32t(&[256, 64])],
            bad_op: Op::ScatterAdd { num_rows: 256 },
            bad_inputs: vec![i32t(&[8, 32]), f32t(&[32, 8, 64])],
            bad_msg: vec!["`scatter_add`", "f32[32,8,64]", "i32[8,32]"],
        },
        OpKind::Reshape => Case {
            op: Op::Reshape {
                shape: Shape::new([4, 6]),
            },
            inputs: vec![f32t(&[2, 3, 4])],
            expect: vec![f32t(&[4, 6])],
            bad_op: Op::Reshape {
                shape: Shape::new([5, 5]),
            },
            bad_inputs: vec![f32t(&[2, 3, 4])],
            bad_msg: vec!["`reshape`", "f32[2,3,4]", "[5,5]"],
        },
        OpKind::Transpose => Case {
            op: Op::Transpose {
                perm: vec![2, 0, 1],
            },
            inputs: vec![f32t(&[2, 3, 4])],
            expect: vec![f32t(&[4, 2, 3])],
            bad_op: Op::Transpose {
                perm: vec![0, 0, 1],
            },
            bad_inputs: vec![f32t(&[2, 3, 4])],
            bad_msg: vec!["`transpose`", "perm", "f32[2,3,4]"],
        },
        OpKind::Slice => Case {
            op: Op::Slice {
                dim: 1,
                start: 2,
                end: 5,
            },
            inputs: vec![f32t(&[2, 8])],
            expect: vec![f32t(&[2, 3])],
            bad_op: Op::Slice {
                dim: 1,
                start: 6,
                end: 9,
            },
            bad_inputs: vec![f32t(&[2, 8])],
            bad_msg: vec!["`slice`", "6..9", "f32[2,8]"],
        },
        OpKind::Concat => Case {
            op: Op::Concat { dim: 0 },
            inputs: vec![f32t(&[2, 3]), f32t(&[5, 3])],
            expect: vec![f32t(&[7, 3])],
            bad_op: Op::Concat { dim: 0 },
            bad_inputs: vec![f32t(&[2, 3]), f32t(&[2, 4])],
            bad_msg: vec!["`concat`", "f32[2,3]", "f32[2,4]"],
        },
        OpKind::Broadcast => Case {
            op: Op::Broadcast {
                shape: Shape::new([8, 32, 64]),
                dims: vec![2],
            },
            inputs: vec![f32t(&[64])],
            expect: vec![f32t(&[8, 32, 64])],
            bad_op: Op::Broadcast {
                shape: Shape::new([8, 32, 64]),
                dims: vec![1],
            },
            bad_inputs: vec![f32t(&[64])],
            bad_msg: vec!["`broadcast`", "f32[64]", "[8,32,64]"],
        },
        OpKind::Rotary => Case {
            op: Op::Rotary { base: 10000.0 },
            inputs: vec![f32t(&[2, 32, 4, 16]), i32t(&[32])],
            expect: vec![f32t(&[2, 32, 4, 16])],
            bad_op: Op::Rotary { base: 10000.0 },
            bad_inputs: vec![f32t(&[2, 32, 4, 15])],
            bad_msg: vec!["`rotary`", "f32[2,32,4,15]", "even"],
        },
        OpKind::Attention => Case {
            op: Op::Attention {
                causal: true,
                scale: 0.25,
            },
            inputs: vec![
                f32t(&[2, 8, 4, 16]),
                f32t(&[2, 8, 2, 16]),
                f32t(&[2, 8, 2, 16]),
            ],
            expect: vec![f32t(&[2, 8, 4, 16])],
            bad_op: Op::Attention {
                causal: true,
                scale: 0.25,
            },
            bad_inputs: vec![
                f32t(&[2, 8, 4, 16]),
                f32t(&[2, 8, 3, 16]),
                f32t(&[2, 8, 3, 16]),
            ],
            bad_msg: vec!["`attention`", "f32[2,8,4,16]", "f32[2,8,3,16]"],
        },
        OpKind::AttentionBackward => Case {
            op: Op::AttentionBackward {
                causal: true,
                scale: 0.25,
            },
            inputs: vec![
                f32t(&[2, 8, 4, 16]),
                f32t(&[2, 8, 2, 16]),
                f32t(&[2, 8, 2, 8]),
                f32t(&[2, 8, 4, 8]),
                f32t(&[2, 8, 4, 8]),
            ],
            expect: vec![
                f32t(&[2, 8, 4, 16]),
                f32t(&[2, 8, 2, 16]),
                f32t(&[2, 8, 2, 8]),
            ],
            bad_op: Op::AttentionBackward {
                causal: true,
                scale: 0.25,
            },
            bad_inputs: vec![
                f32t(&[2, 8, 4, 16]),
                f32t(&[2, 8, 2, 16]),
                f32t(&[2, 8, 2, 8]),
                f32t(&[2, 8, 4, 8]),
                f32t(&[2, 8, 4, 16]),
            ],
            bad_msg: vec!["`attention_backward`", "f32[2,8,4,16]", "f32[2,8,4,8]"],
        },
        OpKind::MoeRoute => Case {
            op: Op::MoeRoute {
                top_k: 2,
                capacity: 5,
                normalize: true,
            },
            inputs: vec![f32t(&[2, 16, 4])],
            expect: vec![f32t(&[2, 16, 4, 5]), f32t(&[2, 16, 4, 5])],
            bad_op: Op::MoeRoute {
                top_k: 5,
                capacity: 5,
                normalize: true,
            },
            bad_inputs: vec![f32t(&[16, 4])],
            bad_msg: vec!["`moe_route`", "top_k", "1..=4"],
        },
        OpKind::CrossEntropy => Case {
            op: Op::CrossEntropy,
            inputs: vec![t(DType::BF16, &[8, 32, 256]), i32t(&[8, 32])],
            expect: vec![f32t(&[8, 32])],
            bad_op: Op::CrossEntropy,
            bad_inputs: vec![f32t(&[8, 32, 256]), i32t(&[8, 16])],
            bad_msg: vec!["`cross_entropy`", "f32[8,32,256]", "i32[8,16]"],
        },
        OpKind::SgdUpdate => Case {
            op: Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            inputs: vec![f32t(&[3]), f32t(&[3]), f32t(&[3])],
            expect: vec![f32t(&[3]), f32t(&[3])],
            bad_op: Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            bad_inputs: vec![f32t(&[3]), t(DType::BF16, &[3]), f32t(&[3])],
            bad_msg: vec!["`sgd_update`", "f32[3] vs bf16[3]"],
        },
        OpKind::AdamWUpdate => Case {
            op: Op::AdamWUpdate {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            inputs: vec![f32t(&[3]), f32t(&[3]), f32t(&[3]), f32t(&[3]), f32t(&[])],
            expect: vec![f32t(&[3]), f32t(&[3]), f32t(&[3])],
            bad_op: Op::AdamWUpdate {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            bad_inputs: vec![f32t(&[3]), f32t(&[3]), f32t(&[3]), f32t(&[3]), i32t(&[])],
            bad_msg: vec!["`adamw_update`", "step count i32[]"],
        },
        OpKind::AllReduce => Case {
            op: Op::AllReduce {
                axes: axes(&["dp", "tp"]),
                reduce: ReduceKind::Sum,
            },
            inputs: vec![f32t(&[3, 5])],
            expect: vec![f32t(&[3, 5])],
            bad_op: Op::AllReduce {
                axes: axes(&["ep"]),
                reduce: ReduceKind::Sum,
            },
            bad_inputs: vec![f32t(&[3, 5])],
            bad_msg: vec!["mesh axis `ep`", "dp=2, tp=4"],
        },
        OpKind::AllGather => Case {
            op: Op::AllGather {
                axes: axes(&["tp"]),
                dim: 1,
            },
            inputs: vec![f32t(&[3, 5])],
            expect: vec![f32t(&[3, 20])],
            bad_op: Op::AllGather {
                axes: axes(&["tp"]),
                dim: 2,
            },
            bad_inputs: vec![f32t(&[3, 5])],
            bad_msg: vec!["`all_gather`", "dim 2", "f32[3,5]"],
        },
        OpKind::ReduceScatter => Case {
            op: Op::ReduceScatter {
                axes: axes(&["tp"]),
                dim: 0,
                reduce: ReduceKind::Sum,
            },
            inputs: vec![f32t(&[8, 5])],
            expect: vec![f32t(&[2, 5])],
            bad_op: Op::ReduceScatter {
                axes: axes(&["tp"]),
                dim: 1,
                reduce: ReduceKind::Sum,
            },
            bad_inputs: vec![f32t(&[8, 5])],
            bad_msg: vec!["`reduce_scatter`", "dim 1 of f32[8,5]", "tp"],
        },
        OpKind::AllToAll => Case {
            op: Op::AllToAll {
                axes: axes(&["dp"]),
                split_dim: 0,
                concat_dim: 1,
            },
            inputs: vec![f32t(&[4, 3])],
            expect: vec![f32t(&[2, 6])],
            bad_op: Op::AllToAll {
                axes: axes(&["tp"]),
                split_dim: 1,
                concat_dim: 0,
            },
            bad_inputs: vec![f32t(&[4, 3])],
            bad_msg: vec!["`all_to_all`", "dim 1 of f32[4,3]"],
        },
        OpKind::CollectiveBroadcast => Case {
            op: Op::CollectiveBroadcast {
                axes: axes(&["tp"]),
                root: 3,
            },
            inputs: vec![f32t(&[4])],
            expect: vec![f32t(&[4])],
            bad_op: Op::CollectiveBroadcast {
                axes: axes(&["tp"]),
                root: 4,
            },
            bad_inputs: vec![f32t(&[4])],
            bad_msg: vec!["`collective_broadcast`", "root", "group of 4"],
        },
        OpKind::Send => Case {
            op: Op::Send {
                axis: "dp".into(),
                shift: 1,
            },
            inputs: vec![f32t(&[4])],
            expect: vec![],
            bad_op: Op::Send {
                axis: "dp".into(),
                shift: 1,
            },
            bad_inputs: vec![],
            bad_msg: vec!["`send`", "takes 1 operands, got 0"],
        },
        OpKind::Recv => Case {
            op: Op::Recv {
                axis: "dp".into(),
                shift: -1,
                ty: f32t(&[4]),
            },
            inputs: vec![],
            expect: vec![f32t(&[4])],
            bad_op: Op::Recv {
                axis: "pp".into(),
                shift: -1,
                ty: f32t(&[4]),
            },
            bad_inputs: vec![],
            bad_msg: vec!["mesh axis `pp`"],
        },
        // exp(x) + broadcast(b), and its sum over the last dim: two results.
        OpKind::Fusion => {
            let body = |bcast_dims: Vec<usize>| FusionBody {
                params: vec![f32t(&[3, 4]), f32t(&[4])],
                instrs: vec![
                    FusedInstr {
                        op: Op::Unary { func: UnaryOp::Exp },
                        operands: vec![0],
                    },
                    FusedInstr {
                        op: Op::Broadcast {
                            shape: Shape::new(vec![3, 4]),
                            dims: bcast_dims,
                        },
                        operands: vec![1],
                    },
                    FusedInstr {
                        op: Op::Binary {
                            func: BinaryOp::Add,
                        },
                        operands: vec![2, 3],
                    },
                    FusedInstr {
                        op: Op::Reduce {
                            func: ReduceOp::Sum,
                            dims: vec![1],
                        },
                        operands: vec![4],
                    },
                ],
                results: vec![4, 5],
            };
            Case {
                op: Op::Fusion {
                    body: body(vec![1]),
                },
                inputs: vec![f32t(&[3, 4]), f32t(&[4])],
                expect: vec![f32t(&[3, 4]), f32t(&[3])],
                // The broadcast puts the bias on the wrong dim.
                bad_op: Op::Fusion {
                    body: body(vec![0]),
                },
                bad_inputs: vec![f32t(&[3, 4]), f32t(&[4])],
                bad_msg: vec!["`fusion`", "^3"],
            }
        }
    }
}

#[test]
fn every_op_kind_has_a_good_and_a_bad_case() {
    let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
    for kind in OpKind::ALL {
        let c = case(kind);
        assert_eq!(c.op.kind(), kind);
        let inputs: Vec<&TensorType> = c.inputs.iter().collect();
        let got = infer(&c.op, &inputs, Some(&mesh)).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(got, c.expect, "{kind:?}");
        assert_eq!(got.len(), num_results(&c.op), "{kind:?}");
        let bad: Vec<&TensorType> = c.bad_inputs.iter().collect();
        let err = infer(&c.bad_op, &bad, Some(&mesh))
            .expect_err(&format!("{kind:?}: ill-typed case accepted"))
            .to_string();
        for frag in &c.bad_msg {
            assert!(err.contains(frag), "{kind:?}: error `{err}` lacks `{frag}`");
        }
    }
}

#[test]
fn every_unary_binary_compare_and_reduce_function_types() {
    let x = f32t(&[2, 3]);
    for func in UnaryOp::ALL {
        assert_eq!(
            infer(&Op::Unary { func }, &[&x], None).unwrap(),
            vec![x.clone()]
        );
    }
    for func in BinaryOp::ALL {
        assert_eq!(
            infer(&Op::Binary { func }, &[&x, &x], None).unwrap(),
            vec![x.clone()]
        );
    }
    for func in CompareOp::ALL {
        assert_eq!(
            infer(&Op::Compare { func }, &[&x, &x], None).unwrap(),
            vec![x.with_dtype(DType::Bool)]
        );
    }
    for func in ReduceOp::ALL {
        assert_eq!(
            infer(
                &Op::Reduce {
                    func,
                    dims: vec![1]
                },
                &[&x],
                None
            )
            .unwrap(),
            vec![f32t(&[2])]
        );
    }
}

#[test]
fn collectives_need_a_mesh() {
    let err = infer(
        &Op::AllReduce {
            axes: axes(&["dp"]),
            reduce: ReduceKind::Sum,
        },
        &[&f32t(&[2])],
        None,
    )
    .unwrap_err();
    assert_eq!(err, IrError::NoMesh { op: "all_reduce" });
}

#[test]
fn einsum_rejects_dangling_and_repeated_labels() {
    let a = f32t(&[2, 3]);
    let b = f32t(&[3, 4]);
    let e = |s: &str| Op::Einsum {
        spec: s.parse().unwrap(),
    };
    assert!(
        infer(&e("ij,jk->i"), &[&a, &b], None)
            .unwrap_err()
            .to_string()
            .contains("label `k`")
    );
    assert!(
        infer(&e("ij,jk->ikz"), &[&a, &b], None)
            .unwrap_err()
            .to_string()
            .contains("label `z`")
    );
    assert!(infer(&e("ii,jk->ik"), &[&a, &b], None).is_err());
    // Outer product and pure batch product are fine.
    assert_eq!(
        infer(&e("i,k->ik"), &[&f32t(&[2]), &f32t(&[4])], None).unwrap(),
        vec![f32t(&[2, 4])]
    );
    assert_eq!(
        infer(&e("bi,bi->bi"), &[&a, &a], None).unwrap(),
        vec![a.clone()]
    );
}

#[test]
fn attention_positions_are_integers_of_the_sequence_lengths() {
    let op = Op::Attention {
        causal: true,
        scale: 0.5,
    };
    let (q, k, v) = (
        f32t(&[2, 8, 4, 16]),
        f32t(&[2, 6, 2, 16]),
        f32t(&[2, 6, 2, 16]),
    );
    let (qp, kp) = (i32t(&[8]), i32t(&[6]));
    assert_eq!(
        infer(&op, &[&q, &k, &v, &qp, &kp], None).unwrap(),
        vec![f32t(&[2, 8, 4, 16])]
    );
    // Swapped lengths, float positions, mixed dtypes and a lone positions operand.
    let err = infer(&op, &[&q, &k, &v, &kp, &qp], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("q_pos") && err.contains("[8]"), "{err}");
    let fp = f32t(&[8]);
    assert!(infer(&op, &[&q, &k, &v, &fp, &kp], None).is_err());
    let wide = t(DType::I64, &[6]);
    let err = infer(&op, &[&q, &k, &v, &qp, &wide], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("one dtype"), "{err}");
    let err = infer(&op, &[&q, &k, &v, &qp], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("got 4"), "{err}");
}
