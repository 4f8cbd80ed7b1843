//! Decompositions of fused ops into primitive IR ops. They define what the fused kernels
//! compute, and tests run both through the interpreter to check that they agree.

use autopar_ir::infer::infer;
use autopar_ir::{
    BinaryOp, CompareOp, DType, EinsumSpec, Graph, IrError, Op, Shape, TensorType, ValueId,
};

/// Adds to `g` the computation of `attention(q, k, v)` from einsum, broadcast, compare,
/// select, constants and softmax, and returns its result (the same type as the fused op's).
///
/// Query heads are split as `[hkv, hq / hkv]`, so query head `h` meets kv head
/// `h / (hq / hkv)`. The causal mask sets the logits of keys `j > i` to `-inf` before the
/// softmax.
pub fn decomposed_attention(
    g: &mut Graph,
    qkv: [ValueId; 3],
    causal: bool,
    scale: f64,
) -> Result<ValueId, IrError> {
    decomposed_attention_at(g, qkv, None, causal, scale)
}

/// [`decomposed_attention`] with explicit positions `[q_pos, k_pos]` (the optional operands
/// of the fused op): the causal mask sets the logits of keys with `k_pos[j] > q_pos[i]` to
/// `-inf`.
pub fn decomposed_attention_at(
    g: &mut Graph,
    [q, k, v]: [ValueId; 3],
    positions: Option<[ValueId; 2]>,
    causal: bool,
    scale: f64,
) -> Result<ValueId, IrError> {
    let (qt, kt, vt) = (
        g.value_checked(q)?.ty.clone(),
        g.value_checked(k)?.ty.clone(),
        g.value_checked(v)?.ty.clone(),
    );
    // The fused op's typing rule vets the operands, so the dims below exist.
    let mut operand_tys = vec![&qt, &kt, &vt];
    let pos_tys = match positions {
        Some([qp, kp]) => vec![
            g.value_checked(qp)?.ty.clone(),
            g.value_checked(kp)?.ty.clone(),
        ],
        None => Vec::new(),
    };
    operand_tys.extend(&pos_tys);
    infer(&Op::Attention { causal, scale }, &operand_tys, None)?;
    let (&[b, s, hq, d], &[_, t, hkv, dv]) = (qt.dims(), vt.dims()) else {
        return Err(IrError::Verify(
            "attention operands must have rank 4".into(),
        ));
    };
    let group = hq / hkv;
    let einsum = |spec: &str| -> Result<Op, IrError> {
        let spec: EinsumSpec = spec.parse().map_err(|detail| IrError::Attr {
            op: "einsum",
            attr: "spec",
            detail,
        })?;
        Ok(Op::Einsum { spec })
    };

    let q5 = g.add(
        Op::Reshape {
            shape: Shape::new([b, s, hkv, group, d]),
        },
        &[q],
    )?;
    let scores = g.add(einsum("bskgd,btkd->bkgst")?, &[q5, k])?;
    let scores_ty = g.ty(scores).clone();
    let scale_c = g.add(
        Op::Constant {
            ty: scores_ty.clone(),
            value: scale,
        },
        &[],
    )?;
    let mut logits = g.add(
        Op::Binary {
            func: BinaryOp::Mul,
        },
        &[scores, scale_c],
    )?;
    if causal {
        let (rows, cols) = match positions {
            Some([qp, kp]) => (qp, kp),
            None => (self::positions(g, s)?, self::positions(g, t)?),
        };
        let square = Shape::new([s, t]);
        let rows = g.add(
            Op::Broadcast {
                shape: square.clone(),
                dims: vec![0],
            },
            &[rows],
        )?;
        let cols = g.add(
            Op::Broadcast {
                shape: square,
                dims: vec![1],
            },
            &[cols],
        )?;
        let future = g.add(
            Op::Compare {
                func: CompareOp::Gt,
            },
            &[cols, rows],
        )?;
        let mask = g.add(
            Op::Broadcast {
                shape: scores_ty.shape.clone(),
                dims: vec![3, 4],
            },
            &[future],
        )?;
        let neg_inf = g.add(
            Op::Constant {
                ty: scores_ty,
                value: f64::NEG_INFINITY,
            },
            &[],
        )?;
        logits = g.add(Op::Select, &[mask, neg_inf, logits])?;
    }
    let probs = g.add(Op::Softmax { dim: 4 }, &[logits])?;
    let out = g.add(einsum("bkgst,btke->bskge")?, &[probs, v])?;
    g.add(
        Op::Reshape {
            shape: Shape::new([b, s, hq, dv]),
        },
        &[out],
    )
}

/// The positions `0..n` as an `i64[n]` value, built from one-element constants (the IR has
/// no iota op).
pub fn positions(g: &mut Graph, n: usize) -> Result<ValueId, IrError> {
    let parts = (0..n)
        .map(|i| {
            g.add(
                Op::Constant {
                    ty: TensorType::new(DType::I64, [1]),
                    value: i as f64,
                },
                &[],
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    if parts.is_empty() {
        return g.add(
            Op::Constant {
                ty: TensorType::new(DType::I64, [0]),
                value: 0.0,
            },
            &[],
        );
    }
    g.add(Op::Concat { dim: 0 }, &parts)
}
