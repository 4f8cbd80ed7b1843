//! Attention kernels of the fast backend: scaled dot-product attention and its fused
//! backward per (batch, head), every product a strided `gemm` call straight on the operands'
//! `[batch, seq, heads, dim]` layout, the heads split over threads (a causal forward without
//! explicit positions in blocks of query rows, each against only the keys it sees); and the
//! rotary embedding.
//! Masked logits are `-inf`, as in the reference, so a query that sees no key gives NaN there
//! too.

use autopar_ir::TensorType;
use rayon::prelude::*;

use super::elementwise::{floats, ints};
use super::gemm::{MatMul, matmul};
use super::layout::strided_copy_into;
use super::reduce::softmax_row;
use super::simd::vectorized;
use super::{Ctx, FastTensor};
use crate::error::RuntimeError;

fn bad_rank(t: &FastTensor) -> RuntimeError {
    RuntimeError::BadTensor {
        ty: t.ty().clone(),
        detail: "attention operands must have rank 4".into(),
    }
}

/// The shape of one attention: batch, query rows, query heads, key rows, kv heads, head dims.
#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    s: usize,
    hq: usize,
    t: usize,
    hkv: usize,
    d: usize,
    dv: usize,
}

impl Shape {
    fn of(q: &FastTensor, v: &FastTensor) -> Result<Shape, RuntimeError> {
        let &[b, s, hq, d] = q.ty().dims() else {
            return Err(bad_rank(q));
        };
        let &[_, t, hkv, dv] = v.ty().dims() else {
            return Err(bad_rank(v));
        };
        Ok(Shape {
            b,
            s,
            hq,
            t,
            hkv: hkv.max(1),
            d,
            dv,
        })
    }

    fn group(&self) -> usize {
        (self.hq / self.hkv).max(1)
    }
}

/// Which keys each query row sees.
#[derive(Clone, Copy)]
struct Mask<'a> {
    causal: bool,
    positions: Option<(&'a [i64], &'a [i64])>,
}

/// Turns the raw scores of query row `i` into its probabilities, in place.
#[inline(always)]
fn probabilities(mask: Mask, scale: f32, i: usize, row: &mut [f32], scratch: &mut [f32]) {
    match (mask.causal, mask.positions) {
        (true, Some((qp, kp))) => {
            for (x, &p) in row.iter_mut().zip(kp) {
                *x = if p > qp[i] {
                    f32::NEG_INFINITY
                } else {
                    *x * scale
                };
            }
            softmax_row(row, scratch);
            row.copy_from_slice(scratch);
        }
        (true, None) => {
            let visible = row.len().min(i + 1);
            let (seen, masked) = row.split_at_mut(visible);
            for x in seen.iter_mut() {
                *x *= scale;
            }
            softmax_row(seen, &mut scratch[..visible]);
            seen.copy_from_slice(&scratch[..visible]);
            masked.fill(0.0);
        }
        (false, _) => {
            for x in row.iter_mut() {
                *x *= scale;
            }
            softmax_row(row, scratch);
            row.copy_from_slice(scratch);
        }
    }
}

/// The probabilities `[s, t]` of query head `h` of batch `bi` into `probs`.
fn head_probs(
    sh: Shape,
    mask: Mask,
    scale: f32,
    (qv, kv): (&[f32], &[f32]),
    (bi, h): (usize, usize),
    probs: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), RuntimeError> {
    block_probs(
        sh,
        mask,
        scale,
        (qv, kv),
        (bi, h),
        (0..sh.s, sh.t),
        probs,
        scratch,
    )
}

/// The probabilities of query rows `rows` of head `h` of batch `bi` against the first `keys`
/// keys, into `probs` (`[rows.len(), keys]`): with a causal mask and no explicit positions a
/// block of rows ending at `r` sees no key at or past `r`, so `keys` may stop there.
#[allow(clippy::too_many_arguments)]
fn block_probs(
    sh: Shape,
    mask: Mask,
    scale: f32,
    (qv, kv): (&[f32], &[f32]),
    (bi, h): (usize, usize),
    (rows, keys): (std::ops::Range<usize>, usize),
    probs: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), RuntimeError> {
    let kh = h / sh.group();
    let first = rows.start;
    matmul(
        MatMul {
            m: rows.len(),
            n: keys,
            k: sh.d,
            dst_off: 0,
            dst_rs: keys,
            dst_cs: 1,
            accumulate: false,
            lhs_off: ((bi * sh.s + first) * sh.hq + h) * sh.d,
            lhs_rs: sh.hq * sh.d,
            lhs_cs: 1,
            rhs_off: (bi * sh.t * sh.hkv + kh) * sh.d,
            rhs_rs: 1,
            rhs_cs: sh.hkv * sh.d,
            threads: 1,
        },
        probs,
        qv,
        kv,
    )?;
    if keys > 0 {
        vectorized(
            #[inline(always)]
            || {
                for (i, row) in probs.chunks_exact_mut(keys).enumerate().take(rows.len()) {
                    probabilities(mask, scale, first + i, row, scratch);
                }
            },
        );
    }
    Ok(())
}

/// Query rows per block of a causal attention without explicit positions: each block
/// multiplies only by the keys its last row sees, about 5/8 of the products at 128 rows.
const CAUSAL_BLOCK: usize = 32;

/// Runs `f(task, chunks...)` over equal chunks of each buffer, on the backend's threads when
/// it has more than one.
fn per_task<F>(ctx: &Ctx, bufs: Vec<(&mut [f32], usize)>, f: F) -> Result<(), RuntimeError>
where
    F: Fn(usize, &mut [&mut [f32]]) -> Result<(), RuntimeError> + Sync,
{
    let tasks = bufs
        .first()
        .map_or(0, |(b, c)| if *c == 0 { 0 } else { b.len() / c });
    let mut per: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::new()).collect();
    for (buf, chunk) in bufs {
        if chunk == 0 {
            for p in per.iter_mut() {
                p.push(&mut []);
            }
            continue;
        }
        for (p, c) in per.iter_mut().zip(buf.chunks_mut(chunk)) {
            p.push(c);
        }
    }
    if ctx.threads > 1 && tasks > 1 {
        ctx.install(|| {
            per.into_par_iter()
                .enumerate()
                .try_for_each(|(i, mut c)| f(i, &mut c))
        })
    } else {
        per.into_iter()
            .enumerate()
            .try_for_each(|(i, mut c)| f(i, &mut c))
    }
}

/// Scaled dot-product attention of `q[b, s, hq, d]`, `k[b, t, hkv, d]`, `v[b, t, hkv, dv]`
/// (query head `h` uses kv head `h / (hq / hkv)`), optionally with `(q_pos, k_pos)`.
pub(crate) fn attention(
    ctx: &Ctx,
    causal: bool,
    scale: f64,
    [q, k, v]: [&FastTensor; 3],
    positions: Option<(&FastTensor, &FastTensor)>,
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let op = "attention";
    let (qv, kv, vv) = (floats(op, q)?, floats(op, k)?, floats(op, v)?);
    let positions = match positions {
        Some((qp, kp)) => Some((ints(op, qp)?, ints(op, kp)?)),
        None => None,
    };
    let sh = Shape::of(q, v)?;
    let mask = Mask { causal, positions };
    let scale = scale as f32;
    // Per head [b, hq, s, dv], then laid out as [b, s, hq, dv].
    let mut heads = ctx.f32s(sh.b * sh.hq * sh.s * sh.dv);
    // Causal without positions: blocks of query rows, each against the keys it sees.
    let blocked = causal && mask.positions.is_none();
    let block = if blocked { CAUSAL_BLOCK } else { sh.s.max(1) };
    per_task(ctx, vec![(&mut heads, sh.s * sh.dv)], |task, bufs| {
        let (bi, h) = (task / sh.hq, task % sh.hq);
        let rows = block.min(sh.s);
        let (mut probs, mut scratch) = (vec![0.0f32; rows * sh.t], vec![0.0f32; sh.t]);
        for start in (0..sh.s).step_by(block) {
            let end = (start + block).min(sh.s);
            let keys = if blocked { end.min(sh.t) } else { sh.t };
            let probs = &mut probs[..(end - start) * keys];
            block_probs(
                sh,
                mask,
                scale,
                (qv, kv),
                (bi, h),
                (start..end, keys),
                probs,
                &mut scratch,
            )?;
            matmul(
                MatMul {
                    m: end - start,
                    n: sh.dv,
                    k: keys,
                    dst_off: start * sh.dv,
                    dst_rs: sh.dv,
                    dst_cs: 1,
                    accumulate: false,
                    lhs_off: 0,
                    lhs_rs: keys,
                    lhs_cs: 1,
                    rhs_off: (bi * sh.t * sh.hkv + h / sh.group()) * sh.dv,
                    rhs_rs: sh.hkv * sh.dv,
                    rhs_cs: 1,
                    threads: 1,
                },
                bufs[0],
                probs,
                vv,
            )?;
        }
        Ok(())
    })?;
    let mut o = ctx.f32s(out.num_elements() as usize);
    let (hs, hsd) = (sh.s * sh.dv, sh.dv);
    strided_copy_into(
        &heads,
        &[sh.b, sh.s, sh.hq, sh.dv],
        &[sh.hq * hs, hsd, hs, 1],
        &mut o,
    );
    Ok(ctx.float(out, o))
}

/// The gradients `dq`, `dk`, `dv` of [`attention`] from `q`, `k`, `v`, its result `o` and
/// the result's gradient `g`: per head, the probabilities `p` are recomputed, then
/// `dv += p^T g`, `ds = p (g v^T - rowsum(g o)) scale`, `dq = ds k`, `dk += ds^T q`.
pub(crate) fn attention_backward(
    ctx: &Ctx,
    causal: bool,
    scale: f64,
    [q, k, v, o, g]: [&FastTensor; 5],
    positions: Option<(&FastTensor, &FastTensor)>,
    types: &[TensorType],
) -> Result<Vec<FastTensor>, RuntimeError> {
    let op = "attention_backward";
    let (qv, kv, vv) = (floats(op, q)?, floats(op, k)?, floats(op, v)?);
    let (ov, gv) = (floats(op, o)?, floats(op, g)?);
    let positions = match positions {
        Some((qp, kp)) => Some((ints(op, qp)?, ints(op, kp)?)),
        None => None,
    };
    let [dq_ty, dk_ty, dv_ty] = types else {
        return Err(RuntimeError::BadTensor {
            ty: q.ty().clone(),
            detail: "attention_backward has three results".into(),
        });
    };
    let sh = Shape::of(q, v)?;
    let group = sh.group();
    let mask = Mask { causal, positions };
    let scale32 = scale as f32;
    // Per (batch, kv head): dq of its query heads [group, s, d], dk [t, d], dv [t, dv].
    let mut dq_t = ctx.f32s(sh.b * sh.hq * sh.s * sh.d);
    let mut dk_t = ctx.f32s(sh.b * sh.hkv * sh.t * sh.d);
    let mut dv_t = ctx.f32s(sh.b * sh.hkv * sh.t * sh.dv);
    let bufs = vec![
        (&mut dq_t[..], group * sh.s * sh.d),
        (&mut dk_t[..], sh.t * sh.d),
        (&mut dv_t[..], sh.t * sh.dv),
    ];
    per_task(ctx, bufs, |task, bufs| {
        let (bi, kh) = (task / sh.hkv, task % sh.hkv);
        let mut probs = vec![0.0f32; sh.s * sh.t];
        let mut dp = vec![0.0f32; sh.s * sh.t];
        let mut scratch = vec![0.0f32; sh.t];
        for gi in 0..group {
            let h = kh * group + gi;
            head_probs(
                sh,
                mask,
                scale32,
                (qv, kv),
                (bi, h),
                &mut probs,
                &mut scratch,
            )?;
            let g_off = (bi * sh.s * sh.hq + h) * sh.dv;
            let q_off = (bi * sh.s * sh.hq + h) * sh.d;
            let k_off = (bi * sh.t * sh.hkv + kh) * sh.d;
            let v_off = (bi * sh.t * sh.hkv + kh) * sh.dv;
            // dv (+)= p^T g.
            matmul(
                MatMul {
                    m: sh.t,
                    n: sh.dv,
                    k: sh.s,
                    dst_off: 0,
                    dst_rs: sh.dv,
                    dst_cs: 1,
                    accumulate: gi > 0,
                    lhs_off: 0,
                    lhs_rs: 1,
                    lhs_cs: sh.t,
                    rhs_off: g_off,
                    rhs_rs: sh.hq * sh.dv,
                    rhs_cs: 1,
                    threads: 1,
                },
                bufs[2],
                &probs,
                gv,
            )?;
            // dp = g v^T.
            matmul(
                MatMul {
                    m: sh.s,
                    n: sh.t,
                    k: sh.dv,
                    dst_off: 0,
                    dst_rs: sh.t,
                    dst_cs: 1,
                    accumulate: false,
                    lhs_off: g_off,
                    lhs_rs: sh.hq * sh.dv,
                    lhs_cs: 1,
                    rhs_off: v_off,
                    rhs_rs: 1,
                    rhs_cs: sh.hkv * sh.dv,
                    threads: 1,
                },
                &mut dp,
                gv,
                vv,
            )?;
            // ds = p (dp - g.o) scale, over dp.
            vectorized(
                #[inline(always)]
                || {
                    for i in 0..sh.s {
                        let at = g_off + i * sh.hq * sh.dv;
                        let centre: f64 = gv[at..at + sh.dv]
                            .iter()
                            .zip(&ov[at..at + sh.dv])
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        let centre = centre as f32;
                        let (p_row, d_row) = (
                            &probs[i * sh.t..(i + 1) * sh.t],
                            &mut dp[i * sh.t..(i + 1) * sh.t],
                        );
                        for (d, &p) in d_row.iter_mut().zip(p_row) {
                            *d = p * (*d - centre) * scale32;
                        }
                    }
                },
            );
            // dq = ds k.
            matmul(
                MatMul {
                    m: sh.s,
                    n: sh.d,
                    k: sh.t,
                    dst_off: gi * sh.s * sh.d,
                    dst_rs: sh.d,
                    dst_cs: 1,
                    accumulate: false,
                    lhs_off: 0,
                    lhs_rs: sh.t,
                    lhs_cs: 1,
                    rhs_off: k_off,
                    rhs_rs: sh.hkv * sh.d,
                    rhs_cs: 1,
                    threads: 1,
                },
                bufs[0],
                &dp,
                kv,
            )?;
            // dk (+)= ds^T q.
            matmul(
                MatMul {
                    m: sh.t,
                    n: sh.d,
                    k: sh.s,
                    dst_off: 0,
                    dst_rs: sh.d,
                    dst_cs: 1,
                    accumulate: gi > 0,
                    lhs_off: 0,
                    lhs_rs: 1,
                    lhs_cs: sh.t,
                    rhs_off: q_off,
                    rhs_rs: sh.hq * sh.d,
                    rhs_cs: 1,
                    threads: 1,
                },
                bufs[1],
                &dp,
                qv,
            )?;
        }
        Ok(())
    })?;
    // Back to [b, seq, heads, dim].
    let lay = |src: &[f32], rows: usize, heads: usize, dim: usize, ty: &TensorType| {
        let mut o = ctx.f32s(ty.num_elements() as usize);
        strided_copy_into(
            src,
            &[sh.b, rows, heads, dim],
            &[heads * rows * dim, dim, rows * dim, 1],
            &mut o,
        );
        ctx.float(ty, o)
    };
    Ok(vec![
        lay(&dq_t, sh.s, sh.hq, sh.d, dq_ty),
        lay(&dk_t, sh.t, sh.hkv, sh.d, dk_ty),
        lay(&dv_t, sh.t, sh.hkv, sh.dv, dv_ty),
    ])
}

/// Rotate-half rotary embedding of `x[..., s, heads, d]` (see the reference kernel), with
/// positions from `positions[s]`, else `0..s`; angles and products in f64.
pub(crate) fn rotary(
    ctx: &Ctx,
    base: f64,
    x: &FastTensor,
    positions: Option<&FastTensor>,
) -> Result<FastTensor, RuntimeError> {
    let op = "rotary";
    let v = floats(op, x)?;
    let dims = x.ty().dims();
    let r = dims.len();
    if r < 3 {
        return Err(RuntimeError::BadTensor {
            ty: x.ty().clone(),
            detail: "rotary needs [..., seq, heads, dim]".into(),
        });
    }
    let (s, heads, d) = (dims[r - 3], dims[r - 2], dims[r - 1]);
    let half = d / 2;
    let pos: Vec<f64> = match positions {
        Some(p) => ints(op, p)?.iter().map(|&q| q as f64).collect(),
        None => (0..s).map(|q| q as f64).collect(),
    };
    let mut cos_sin = Vec::with_capacity(s * half);
    for &p in pos.iter().take(s) {
        for i in 0..half {
            let theta = p * base.powf(-2.0 * i as f64 / d as f64);
            cos_sin.push((theta.cos(), theta.sin()));
        }
    }
    let mut o = ctx.f32s(v.len());
    o.copy_from_slice(v);
    if d > 0 {
        for (vec_idx, (src, dst)) in v.chunks_exact(d).zip(o.chunks_exact_mut(d)).enumerate() {
            let row = (vec_idx / heads.max(1)) % s.max(1);
            for i in 0..half {
                let (c, sn) = cos_sin[row * half + i];
                let (lo, hi) = (f64::from(src[i]), f64::from(src[i + half]));
                dst[i] = (lo * c - hi * sn) as f32;
                dst[i + half] = (hi * c + lo * sn) as f32;
            }
        }
    }
    Ok(ctx.float(x.ty(), o))
}
