//! Position and attention kernels: rotary embedding and fused scaled dot-product attention
//! (whose decomposition into IR ops is [`crate::reference::decomposed_attention`]).

use autopar_ir::TensorType;

use super::reduction::softmax_in_place;
use super::{Accumulation, floats, ints, matmul, strided_copy};
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor};

/// Rotate-half rotary embedding of `x[..., s, heads, d]`: for row position `p` and `i < d/2`,
/// `theta = p * base^(-2i/d)`, `out[i] = x[i] cos - x[i + d/2] sin` and
/// `out[i + d/2] = x[i + d/2] cos + x[i] sin`. Positions come from `positions[s]`, else `0..s`.
pub(crate) fn rotary(
    base: f64,
    x: &Tensor,
    positions: Option<&Tensor>,
) -> Result<Tensor, RuntimeError> {
    let op = "rotary";
    let v = floats(op, x)?;
    let r = x.dims().len();
    let (s, heads, d) = (x.dims()[r - 3], x.dims()[r - 2], x.dims()[r - 1]);
    let half = d / 2;
    let pos: Vec<f64> = match positions {
        Some(p) => ints(op, p)?.iter().map(|&q| q as f64).collect(),
        None => (0..s).map(|q| q as f64).collect(),
    };
    // cos and sin of every (row, frequency) pair, computed once.
    let mut cos_sin = Vec::with_capacity(s * half);
    for &p in &pos {
        for i in 0..half {
            let theta = p * base.powf(-2.0 * i as f64 / d as f64);
            cos_sin.push((theta.cos(), theta.sin()));
        }
    }
    let mut out = v.to_vec();
    for (vec_idx, (src, dst)) in v
        .chunks_exact(d.max(1))
        .zip(out.chunks_exact_mut(d.max(1)))
        .enumerate()
    {
        let row = (vec_idx / heads) % s;
        for i in 0..half {
            let (c, sn) = cos_sin[row * half + i];
            let (lo, hi) = (src[i], src[i + half]);
            dst[i] = lo * c - hi * sn;
            dst[i + half] = hi * c + lo * sn;
        }
    }
    Ok(Tensor::from_parts(x.ty().clone(), Data::Float(out)))
}

/// Scaled dot-product attention of `q[b, s, hq, d]`, `k[b, t, hkv, d]`, `v[b, t, hkv, dv]`:
/// query head `h` uses kv head `h / (hq / hkv)`, and with `causal` query `i` sees keys `0..=i`,
/// or, with `positions = (q_pos, k_pos)`, the keys `j` with `k_pos[j] <= q_pos[i]`. The two
/// products (`q k^T` and `p v`) accumulate as `acc` says; the softmax in `f64`.
pub(crate) fn attention(
    acc: Accumulation,
    causal: bool,
    scale: f64,
    [q, k, v]: [&Tensor; 3],
    positions: Option<(&Tensor, &Tensor)>,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let op = "attention";
    let (qv, kv, vv) = (floats(op, q)?, floats(op, k)?, floats(op, v)?);
    let positions = match positions {
        Some((qp, kp)) => Some((ints(op, qp)?, ints(op, kp)?)),
        None => None,
    };
    let &[b, s, hq, d] = q.dims() else {
        return Err(bad_rank(q));
    };
    let &[_, t, hkv, dv] = v.dims() else {
        return Err(bad_rank(v));
    };
    let group = hq / hkv.max(1);
    // Per-head contiguous matrices: Q_h [s, d], K_h transposed [d, t], V_h [t, dv].
    let q_heads = strided_copy(qv, &[b, hq, s, d], &[s * hq * d, d, hq * d, 1]);
    let k_heads_t = strided_copy(kv, &[b, hkv, d, t], &[t * hkv * d, d, 1, hkv * d]);
    let v_heads = strided_copy(vv, &[b, hkv, t, dv], &[t * hkv * dv, dv, hkv * dv, 1]);
    let mut result = vec![0.0; b * s * hq * dv];
    let (mut probs, mut head_out) = (vec![0.0; s * t], vec![0.0; s * dv]);
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group.max(1);
            let q_h = &q_heads[(bi * hq + h) * s * d..][..s * d];
            let k_t = &k_heads_t[(bi * hkv + kh) * d * t..][..d * t];
            let v_h = &v_heads[(bi * hkv + kh) * t * dv..][..t * dv];
            matmul(acc, s, t, d, q_h, k_t, &mut probs);
            for (i, row) in probs.chunks_exact_mut(t.max(1)).enumerate().take(s) {
                if let Some((qp, kp)) = positions {
                    // Masked logits are `-inf`, so their weight is `exp(-inf) = 0`.
                    for (x, &p) in row.iter_mut().zip(kp) {
                        *x = if causal && p > qp[i] {
                            f64::NEG_INFINITY
                        } else {
                            *x * scale
                        };
                    }
                    softmax_in_place(row);
                    continue;
                }
                // Keys past `visible` get weight 0: masked, as `exp(-inf)` would be.
                let visible = if causal { t.min(i + 1) } else { t };
                let (seen, masked) = row.split_at_mut(visible);
                for x in seen.iter_mut() {
                    *x *= scale;
                }
                if !seen.is_empty() {
                    softmax_in_place(seen);
                }
                masked.fill(0.0);
            }
            matmul(acc, s, dv, t, &probs, v_h, &mut head_out);
            for i in 0..s {
                result[((bi * s + i) * hq + h) * dv..][..dv]
                    .copy_from_slice(&head_out[i * dv..][..dv]);
            }
        }
    }
    Ok(Tensor::from_parts(out.clone(), Data::Float(result)))
}

fn bad_rank(t: &Tensor) -> RuntimeError {
    RuntimeError::BadTensor {
        ty: t.ty().clone(),
        detail: "attention operands must have rank 4".into(),
    }
}

/// The gradients `dq`, `dk`, `dv` of [`attention`] (see `Op::AttentionBackward`), from `q`,
/// `k`, `v`, the attention's result `o` and its gradient `g`: the probabilities `p` of every
/// query row are recomputed, then `dv += p g`, `ds = p (g·v - g·o) scale`, `dq += ds k` and
/// `dk += ds q`, key by key. The products that are matrix products in a GEMM formulation
/// (`q·k`, `g·v`, and the sums into `dv`, `dq`, `dk`) accumulate as `acc` says; `g·o`, a
/// row reduction, in `f64`.
pub(crate) fn attention_backward(
    acc: Accumulation,
    causal: bool,
    scale: f64,
    [q, k, v, o, g]: [&Tensor; 5],
    positions: Option<(&Tensor, &Tensor)>,
    types: &[TensorType],
) -> Result<Vec<Tensor>, RuntimeError> {
    let op = "attention_backward";
    let (qv, kv, vv) = (floats(op, q)?, floats(op, k)?, floats(op, v)?);
    let (ov, gv) = (floats(op, o)?, floats(op, g)?);
    let positions = match positions {
        Some((qp, kp)) => Some((ints(op, qp)?, ints(op, kp)?)),
        None => None,
    };
    let &[b, s, hq, d] = q.dims() else {
        return Err(bad_rank(q));
    };
    let &[_, t, hkv, dv] = v.dims() else {
        return Err(bad_rank(v));
    };
    let [dq_ty, dk_ty, dv_ty] = types else {
        return Err(RuntimeError::BadTensor {
            ty: q.ty().clone(),
            detail: "attention_backward has three results".into(),
        });
    };
    let group = hq / hkv.max(1);
    let (mut dq, mut dk, mut dvs) = (
        vec![0.0; b * s * hq * d],
        vec![0.0; b * t * hkv * d],
        vec![0.0; b * t * hkv * dv],
    );
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, c)| a * c).sum::<f64>();
    let dot_acc = |x: &[f64], y: &[f64]| x.iter().zip(y).fold(0.0, |s, (a, c)| acc.add(s, a * c));
    let mut row = vec![0.0; t];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group.max(1);
            for i in 0..s {
                let qi = ((bi * s + i) * hq + h) * d;
                let oi = ((bi * s + i) * hq + h) * dv;
                let key = |j: usize| ((bi * t + j) * hkv + kh) * d;
                let val = |j: usize| ((bi * t + j) * hkv + kh) * dv;
                for (j, x) in row.iter_mut().enumerate() {
                    let visible = match (causal, positions) {
                        (false, _) => true,
                        (true, Some((qp, kp))) => kp[j] <= qp[i],
                        (true, None) => j <= i,
                    };
                    *x = if visible {
                        scale * dot_acc(&qv[qi..qi + d], &kv[key(j)..key(j) + d])
                    } else {
                        f64::NEG_INFINITY
                    };
                }
                softmax_in_place(&mut row);
                let gi = &gv[oi..oi + dv];
                let centre = dot(gi, &ov[oi..oi + dv]);
                for (j, &p) in row.iter().enumerate() {
                    let ds = p * (dot_acc(gi, &vv[val(j)..val(j) + dv]) - centre) * scale;
                    for x in 0..dv {
                        dvs[val(j) + x] = acc.add(dvs[val(j) + x], p * gi[x]);
                    }
                    for x in 0..d {
                        dq[qi + x] = acc.add(dq[qi + x], ds * kv[key(j) + x]);
                        dk[key(j) + x] = acc.add(dk[key(j) + x], ds * qv[qi + x]);
                    }
                }
            }
        }
    }
    Ok(vec![
        Tensor::from_parts(dq_ty.clone(), Data::Float(dq)),
        Tensor::from_parts(dk_ty.clone(), Data::Float(dk)),
        Tensor::from_parts(dv_ty.clone(), Data::Float(dvs)),
    ])
}
