//! Optimizer updates of the fast backend: SGD with momentum and AdamW, both with decoupled
//! weight decay, computed per element in `f64` (as the reference) over f32 storage and split
//! over threads for large parameters.

use rayon::prelude::*;

use super::elementwise::floats;
use super::simd::vectorized;
use super::{Ctx, FastTensor, PAR_GRAIN};
use crate::error::RuntimeError;

/// Runs `f(i, chunk of each output)` over aligned chunks of `n` elements.
fn chunked<F>(ctx: &Ctx, n: usize, outs: &mut [Vec<f32>], f: F)
where
    F: Fn(usize, &mut [&mut [f32]]) + Sync,
{
    let chunk = if ctx.parallel(n) { PAR_GRAIN } else { n.max(1) };
    let mut per: Vec<Vec<&mut [f32]>> = (0..n.div_ceil(chunk)).map(|_| Vec::new()).collect();
    for o in outs.iter_mut() {
        for (p, c) in per.iter_mut().zip(o.chunks_mut(chunk)) {
            p.push(c);
        }
    }
    if per.len() > 1 {
        ctx.install(|| {
            per.into_par_iter()
                .enumerate()
                .for_each(|(i, mut c)| f(i * chunk, &mut c));
        });
    } else {
        for (i, mut c) in per.into_iter().enumerate() {
            f(i * chunk, &mut c);
        }
    }
}

/// `m' = momentum * m + g`, `p' = p * (1 - lr * wd) - lr * m'`; returns `[p', m']`.
pub(crate) fn sgd_update(
    ctx: &Ctx,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    [param, grad, mom]: [&FastTensor; 3],
) -> Result<Vec<FastTensor>, RuntimeError> {
    let op = "sgd_update";
    let (p, g, m) = (floats(op, param)?, floats(op, grad)?, floats(op, mom)?);
    let n = p.len();
    let decay = 1.0 - lr * weight_decay;
    let mut outs = vec![ctx.f32s(n), ctx.f32s(n)];
    chunked(ctx, n, &mut outs, |at, o| {
        let [new_p, new_m] = o else { return };
        let len = new_p.len();
        let (p, g, m) = (&p[at..at + len], &g[at..at + len], &m[at..at + len]);
        vectorized(
            #[inline(always)]
            || {
                for j in 0..len {
                    let nm = momentum * f64::from(m[j]) + f64::from(g[j]);
                    new_m[j] = nm as f32;
                    new_p[j] = (f64::from(p[j]) * decay - lr * nm) as f32;
                }
            },
        );
    });
    let ty = param.ty();
    let new_m = outs.pop().unwrap_or_default();
    let new_p = outs.pop().unwrap_or_default();
    Ok(vec![ctx.float(ty, new_p), ctx.float(ty, new_m)])
}

/// The hyper-parameters of an AdamW step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2`, bias-corrected by the 1-based
/// `step`, and `p' = p (1 - lr wd) - lr mhat / (sqrt(vhat) + eps)`; returns `[p', m', v']`.
pub(crate) fn adamw_update(
    ctx: &Ctx,
    h: AdamW,
    [param, grad, m, v]: [&FastTensor; 4],
    step: f64,
) -> Result<Vec<FastTensor>, RuntimeError> {
    let op = "adamw_update";
    let (p, g, m, v) = (
        floats(op, param)?,
        floats(op, grad)?,
        floats(op, m)?,
        floats(op, v)?,
    );
    let n = p.len();
    let (bias1, bias2) = (1.0 - h.beta1.powf(step), 1.0 - h.beta2.powf(step));
    let decay = 1.0 - h.lr * h.weight_decay;
    let mut outs = vec![ctx.f32s(n), ctx.f32s(n), ctx.f32s(n)];
    chunked(ctx, n, &mut outs, |at, o| {
        let [new_p, new_m, new_v] = o else { return };
        let len = new_p.len();
        let (p, g) = (&p[at..at + len], &g[at..at + len]);
        let (m, v) = (&m[at..at + len], &v[at..at + len]);
        let (new_m, new_v) = (&mut new_m[..len], &mut new_v[..len]);
        vectorized(
            #[inline(always)]
            || {
                for j in 0..len {
                    let gi = f64::from(g[j]);
                    let nm = h.beta1 * f64::from(m[j]) + (1.0 - h.beta1) * gi;
                    let nv = h.beta2 * f64::from(v[j]) + (1.0 - h.beta2) * gi * gi;
                    let (m_hat, v_hat) = (nm / bias1, nv / bias2);
                    new_m[j] = nm as f32;
                    new_v[j] = nv as f32;
                    new_p[j] =
                        (f64::from(p[j]) * decay - h.lr * m_hat / (v_hat.sqrt() + h.eps)) as f32;
                }
            },
        );
    });
    let ty = param.ty();
    let new_v = outs.pop().unwrap_or_default();
    let new_m = outs.pop().unwrap_or_default();
    let new_p = outs.pop().unwrap_or_default();
    Ok(vec![
        ctx.float(ty, new_p),
        ctx.float(ty, new_m),
        ctx.float(ty, new_v),
    ])
}
