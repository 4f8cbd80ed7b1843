//! Position and attention kernels: rotary embedding and fused scaled dot-product attention
//! (whose decomposition into IR ops is [`crate::reference::decomposed_attention`]).

use autopar_ir::TensorType;

use super::normalize::softmax_in_place;
use super::{floats, ints};
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
/// query head `h` uses kv head `h / (hq / hkv)`, and with `causal` query `i` sees keys `0..=i`.
pub(crate) fn attention(
    causal: bool,
    scale: f64,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let op = "attention";
    let (qv, kv, vv) = (floats(op, q)?, floats(op, k)?, floats(op, v)?);
    let &[b, s, hq, d] = q.dims() else {
        return Err(bad_rank(q));
    };
    let &[_, t, hkv, dv] = v.dims() else {
        return Err(bad_rank(v));
    };
    let group = hq / hkv.max(1);
    let mut result = vec![0.0; b * s * hq * dv];
    let mut weights = vec![0.0; t];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group.max(1);
            for i in 0..s {
                let visible = if causal { t.min(i + 1) } else { t };
                if visible == 0 {
                    continue;
                }
                let q_row = &qv[((bi * s + i) * hq + h) * d..][..d];
                for (j, w) in weights[..visible].iter_mut().enumerate() {
                    let k_row = &kv[((bi * t + j) * hkv + kh) * d..][..d];
                    *w = scale * q_row.iter().zip(k_row).map(|(x, y)| x * y).sum::<f64>();
                }
                softmax_in_place(&mut weights[..visible]);
                let o_row = &mut result[((bi * s + i) * hq + h) * dv..][..dv];
                for (j, &w) in weights[..visible].iter().enumerate() {
                    let v_row = &vv[((bi * t + j) * hkv + kh) * dv..][..dv];
                    for (o, &x) in o_row.iter_mut().zip(v_row) {
                        *o += w * x;
                    }
                }
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
