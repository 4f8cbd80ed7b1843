//! Reductions and the kernels built on them, on f32 storage: reduce, softmax, layer and RMS
//! norm, cross-entropy. Sums, means, variances and log-sum-exps accumulate in `f64`, as the
//! reference does, so long rows lose nothing; rows are split over threads when large.

use autopar_ir::{ReduceOp, TensorType};
use rayon::prelude::*;

use super::elementwise::{exp_f32, floats, ints};
use super::layout::{checked_ids, strided_copy_into};
use super::simd::vectorized;
use super::{Ctx, FastTensor, PAR_GRAIN};
use crate::error::RuntimeError;
use crate::tensor::strides;

/// Runs `f(row_index, row, out_row)` over rows of `x` (length `w`) and `out` (length `ow`),
/// in parallel when the work is large.
#[inline(always)]
fn rows<F>(ctx: &Ctx, x: &[f32], w: usize, out: &mut [f32], ow: usize, f: F)
where
    F: Fn(usize, &[f32], &mut [f32]) + Sync,
{
    if w == 0 || ow == 0 {
        return;
    }
    if ctx.parallel(x.len()) {
        let per = (PAR_GRAIN / w).max(1);
        ctx.install(|| {
            out.par_chunks_mut(ow * per)
                .zip(x.par_chunks(w * per))
                .enumerate()
                .for_each(|(c, (o, x))| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (i, (o, x)) in
                                o.chunks_exact_mut(ow).zip(x.chunks_exact(w)).enumerate()
                            {
                                f(c * per + i, x, o);
                            }
                        },
                    );
                });
        });
    } else {
        vectorized(
            #[inline(always)]
            || {
                for (i, (o, x)) in out.chunks_exact_mut(ow).zip(x.chunks_exact(w)).enumerate() {
                    f(i, x, o);
                }
            },
        );
    }
}

/// Lanes of the running maxima below: one AVX-512 register of f32 (two AVX2 ones).
const LANES: usize = 8;

/// Partial sums of the f64 sums below: four AVX2 registers of f64, so that four additions
/// are in flight at once (with 8 the sums ran at the latency of two dependent chains, about
/// 30% slower).
const SUM_LANES: usize = 16;

/// The sum of a row in f64, in [`SUM_LANES`] partial sums (vectorised, and keeping f64
/// accuracy).
#[inline(always)]
pub(crate) fn sum64(row: &[f32]) -> f64 {
    sum64_of(row, f64::from)
}

/// Elements per block of [`sum64_of_f32`]: its f32 buffer (1 KiB) stays in L1.
const BLOCK: usize = 256;

/// The sum in f64 of `f(x)` computed in f32 over a row: `f` maps a block of the row into a
/// buffer in one plain loop, which LLVM vectorises at the full f32 width (an exponential,
/// say), and the buffer is summed by [`sum64`]. Mapping and summing in one loop, `f` would
/// run at the width of f64 or worse.
#[inline(always)]
pub(crate) fn sum64_of_f32(row: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut buf = [0.0f32; BLOCK];
    let mut s = 0.0;
    for c in row.chunks(BLOCK) {
        let b = &mut buf[..c.len()];
        for (o, &x) in b.iter_mut().zip(c) {
            *o = f(x);
        }
        s += sum64(b);
    }
    s
}

/// The sum of `f(x)` over a row, in [`SUM_LANES`] partial sums.
#[inline(always)]
pub(crate) fn sum64_of(row: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0.0f64; SUM_LANES];
    let chunks = row.chunks_exact(SUM_LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..SUM_LANES {
            acc[j] += f(c[j]);
        }
    }
    let (lo, hi) = acc.split_at(SUM_LANES / 2);
    let mut s = 0.0;
    for (a, b) in lo.iter().zip(hi) {
        s += a + b;
    }
    for &x in tail {
        s += f(x);
    }
    s
}

/// The larger of two floats, NaN winning.
#[inline(always)]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || a >= b { a } else { b }
}

/// The maximum of a row (NaN if it holds one), or `-inf` for an empty one, in [`LANES`]
/// running maxima: with no NaN the maximum does not depend on the order (of equal values
/// `-0` and `+0`, either may be returned; every caller subtracts it, which gives the same
/// bits either way).
#[inline(always)]
fn max_of(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = nan_max(acc[j], c[j]);
        }
    }
    let mut m = acc.iter().fold(f32::NEG_INFINITY, |a, &b| nan_max(a, b));
    for &x in tail {
        m = nan_max(m, x);
    }
    m
}

/// Reduction of a float tensor over `dims`; `out` is the result type.
pub(crate) fn reduce(
    ctx: &Ctx,
    func: ReduceOp,
    dims: &[usize],
    x: &FastTensor,
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let op = match func {
        ReduceOp::Sum => "reduce_sum",
        ReduceOp::Mean => "reduce_mean",
        ReduceOp::Max => "reduce_max",
        ReduceOp::Min => "reduce_min",
    };
    let v = floats(op, x)?;
    let xd = x.ty().dims();
    let n_out = out.num_elements() as usize;
    let count: usize = dims.iter().map(|&d| xd[d]).product();
    if count == 0 && n_out > 0 && matches!(func, ReduceOp::Max | ReduceOp::Min) {
        return Err(RuntimeError::EmptyReduction { op });
    }
    let mut sorted = dims.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let contiguous = sorted.windows(2).all(|w| w[1] == w[0] + 1);
    let mut o = ctx.f32s(n_out);
    if n_out == 0 {
        return Ok(ctx.float(out, o));
    }
    if count == 0 {
        o.fill(0.0);
        if func == ReduceOp::Mean {
            o.fill(f32::NAN);
        }
        return Ok(ctx.float(out, o));
    }
    let (outer, inner) = match (sorted.first(), sorted.last()) {
        (Some(&first), Some(&last)) if contiguous => (
            xd[..first].iter().product::<usize>(),
            xd[last + 1..].iter().product::<usize>(),
        ),
        (Some(_), Some(_)) => {
            // Reduced dims apart: lay the kept dims out first, then the reduced ones, and
            // reduce rows.
            let kept: Vec<usize> = (0..xd.len()).filter(|d| !sorted.contains(d)).collect();
            let order: Vec<usize> = kept.iter().chain(&sorted).copied().collect();
            let src = strides(xd);
            let pdims: Vec<usize> = order.iter().map(|&d| xd[d]).collect();
            let view: Vec<usize> = order.iter().map(|&d| src[d]).collect();
            let mut permuted = ctx.f32s(v.len());
            strided_copy_into(v, &pdims, &view, &mut permuted);
            reduce_rows(ctx, func, &permuted, count, &mut o);
            return Ok(ctx.float(out, o));
        }
        _ => {
            // Nothing reduced: a copy.
            o.copy_from_slice(v);
            return Ok(ctx.float(out, o));
        }
    };
    if inner == 1 {
        reduce_rows(ctx, func, v, count, &mut o);
        return Ok(ctx.float(out, o));
    }
    // [outer, count, inner] -> [outer, inner]: accumulate whole inner rows.
    let mut acc = vec![0.0f64; inner];
    for (ob, orow) in o.chunks_exact_mut(inner).enumerate().take(outer) {
        let block = &v[ob * count * inner..(ob + 1) * count * inner];
        match func {
            ReduceOp::Sum | ReduceOp::Mean => {
                acc.fill(0.0);
                for r in block.chunks_exact(inner) {
                    for (a, &x) in acc.iter_mut().zip(r) {
                        *a += f64::from(x);
                    }
                }
                let scale = if func == ReduceOp::Mean {
                    1.0 / count as f64
                } else {
                    1.0
                };
                for (o, &a) in orow.iter_mut().zip(&acc) {
                    *o = if func == ReduceOp::Mean {
                        (a / count as f64) as f32
                    } else {
                        (a * scale) as f32
                    };
                }
            }
            ReduceOp::Max | ReduceOp::Min => {
                let max = func == ReduceOp::Max;
                orow.copy_from_slice(&block[..inner]);
                for r in block.chunks_exact(inner).skip(1) {
                    for (a, &b) in orow.iter_mut().zip(r) {
                        let keep = a.is_nan() || if max { *a >= b } else { *a <= b };
                        if !keep {
                            *a = b;
                        }
                    }
                }
            }
        }
    }
    Ok(ctx.float(out, o))
}

/// Reduces each contiguous row of `count` elements of `v` into one element of `o` (also the
/// row reductions of fusion tiles, on a one-thread `ctx`).
pub(crate) fn reduce_rows(ctx: &Ctx, func: ReduceOp, v: &[f32], count: usize, o: &mut [f32]) {
    match func {
        ReduceOp::Sum => rows(
            ctx,
            v,
            count,
            o,
            1,
            #[inline(always)]
            |_, r, o| o[0] = sum64(r) as f32,
        ),
        ReduceOp::Mean => rows(
            ctx,
            v,
            count,
            o,
            1,
            #[inline(always)]
            |_, r, o| {
                o[0] = (sum64(r) / count as f64) as f32;
            },
        ),
        ReduceOp::Max => rows(
            ctx,
            v,
            count,
            o,
            1,
            #[inline(always)]
            |_, r, o| o[0] = max_of(r),
        ),
        ReduceOp::Min => rows(
            ctx,
            v,
            count,
            o,
            1,
            #[inline(always)]
            |_, r, o| {
                o[0] = r.iter().fold(
                    f32::INFINITY,
                    |a, &b| if a.is_nan() || a <= b { a } else { b },
                );
            },
        ),
    }
}

/// Numerically stable softmax of a contiguous row into `out` (sum in f64).
#[inline(always)]
pub(crate) fn softmax_row(row: &[f32], out: &mut [f32]) {
    let max = max_of(row);
    for (o, &x) in out.iter_mut().zip(row) {
        *o = exp_f32(x - max);
    }
    let inv = 1.0 / sum64(out);
    for o in out.iter_mut() {
        *o = (f64::from(*o) * inv) as f32;
    }
}

/// Softmax along `dim`.
pub(crate) fn softmax(ctx: &Ctx, dim: usize, x: &FastTensor) -> Result<FastTensor, RuntimeError> {
    let v = floats("softmax", x)?;
    let dims = x.ty().dims();
    let n = dims[dim];
    let inner: usize = dims[dim + 1..].iter().product();
    let outer: usize = dims[..dim].iter().product();
    let mut o = ctx.f32s(v.len());
    if inner == 1 {
        rows(
            ctx,
            v,
            n,
            &mut o,
            n,
            #[inline(always)]
            |_, r, o| softmax_row(r, o),
        );
        return Ok(ctx.float(x.ty(), o));
    }
    let (mut row, mut res) = (vec![0.0f32; n], vec![0.0f32; n]);
    vectorized(
        #[inline(always)]
        || {
            for ob in 0..outer {
                for i in 0..inner {
                    let base = ob * n * inner + i;
                    for (j, r) in row.iter_mut().enumerate() {
                        *r = v[base + j * inner];
                    }
                    softmax_row(&row, &mut res);
                    for (j, r) in res.iter().enumerate() {
                        o[base + j * inner] = *r;
                    }
                }
            }
        },
    );
    Ok(ctx.float(x.ty(), o))
}

/// A norm's scale or shift holds one value per element of the normalised dim.
fn norm_params(op: &str, h: usize, p: &FastTensor, values: &[f32]) -> Result<(), RuntimeError> {
    if values.len() == h {
        return Ok(());
    }
    Err(RuntimeError::BadTensor {
        ty: p.ty().clone(),
        detail: format!("{op}: {} parameters for a last dim of {h}", values.len()),
    })
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dim, biased variance.
pub(crate) fn layer_norm(
    ctx: &Ctx,
    eps: f64,
    x: &FastTensor,
    gamma: &FastTensor,
    beta: &FastTensor,
) -> Result<FastTensor, RuntimeError> {
    let op = "layer_norm";
    let (v, g, b) = (floats(op, x)?, floats(op, gamma)?, floats(op, beta)?);
    let h = x.ty().dims().last().copied().unwrap_or(1);
    norm_params(op, h, gamma, g)?;
    norm_params(op, h, beta, b)?;
    let mut o = ctx.f32s(v.len());
    rows(
        ctx,
        v,
        h,
        &mut o,
        h,
        #[inline(always)]
        |_, row, out| {
            let hf = row.len() as f64;
            let mean = sum64(row) / hf;
            let var = sum64_of(row, |a| {
                let d = f64::from(a) - mean;
                d * d
            }) / hf;
            let inv = 1.0 / (var + eps).sqrt();
            // Zipped rather than indexed, so that no bounds check keeps the loop scalar.
            for (((o, &x), &gk), &bk) in out.iter_mut().zip(row).zip(g).zip(b) {
                *o = ((f64::from(x) - mean) * inv * f64::from(gk) + f64::from(bk)) as f32;
            }
        },
    );
    Ok(ctx.float(x.ty(), o))
}

/// `x / sqrt(mean(x^2) + eps) * gamma` over the last dim.
pub(crate) fn rms_norm(
    ctx: &Ctx,
    eps: f64,
    x: &FastTensor,
    gamma: &FastTensor,
) -> Result<FastTensor, RuntimeError> {
    let op = "rms_norm";
    let (v, g) = (floats(op, x)?, floats(op, gamma)?);
    let h = x.ty().dims().last().copied().unwrap_or(1);
    norm_params(op, h, gamma, g)?;
    let mut o = ctx.f32s(v.len());
    rows(
        ctx,
        v,
        h,
        &mut o,
        h,
        #[inline(always)]
        |_, row, out| {
            let mean_sq = sum64_of(row, |a| f64::from(a) * f64::from(a)) / row.len() as f64;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            for ((o, &x), &gk) in out.iter_mut().zip(row).zip(g) {
                *o = (f64::from(x) * inv * f64::from(gk)) as f32;
            }
        },
    );
    Ok(ctx.float(x.ty(), o))
}

/// `logsumexp(logits) - logits[target]` for every position (in f64 from f32 exponentials).
pub(crate) fn cross_entropy(
    ctx: &Ctx,
    logits: &FastTensor,
    targets: &FastTensor,
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let op = "cross_entropy";
    let l = floats(op, logits)?;
    let vocab = logits.ty().dims().last().copied().unwrap_or(1);
    let t = checked_ids(op, ints(op, targets)?, vocab)?;
    let mut o = ctx.f32s(t.len());
    rows(
        ctx,
        l,
        vocab,
        &mut o,
        1,
        #[inline(always)]
        |i, row, out| {
            let max = max_of(row);
            let s = sum64_of_f32(
                row,
                #[inline(always)]
                |x| exp_f32(x - max),
            );
            let lse = f64::from(max) + s.ln();
            out[0] = (lse - f64::from(row[t[i]])) as f32;
        },
    );
    Ok(ctx.float(out, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_of_mapped_blocks_match_a_plain_f64_sum() {
        for len in [0, 1, 7, 255, 256, 257, 1000, 4099] {
            let row: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let want: f64 = row.iter().map(|&x| f64::from(exp_f32(x - 3.0))).sum();
            let got = sum64_of_f32(&row, |x| exp_f32(x - 3.0));
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                "{len} elements: {got} against {want}"
            );
        }
    }
}
