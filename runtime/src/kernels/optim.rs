//! Optimizer updates: SGD with momentum and AdamW, both with decoupled weight decay.

use super::floats;
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor};

/// `m' = momentum * m + g`, `p' = p * (1 - lr * wd) - lr * m'`; returns `[p', m']`.
pub(crate) fn sgd_update(
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    param: &Tensor,
    grad: &Tensor,
    mom: &Tensor,
) -> Result<Vec<Tensor>, RuntimeError> {
    let op = "sgd_update";
    let (p, g, m) = (floats(op, param)?, floats(op, grad)?, floats(op, mom)?);
    let decay = 1.0 - lr * weight_decay;
    let new_m: Vec<f64> = m.iter().zip(g).map(|(&m, &g)| momentum * m + g).collect();
    let new_p = p
        .iter()
        .zip(&new_m)
        .map(|(&p, &m)| p * decay - lr * m)
        .collect();
    Ok(vec![
        Tensor::from_parts(param.ty().clone(), Data::Float(new_p)),
        Tensor::from_parts(param.ty().clone(), Data::Float(new_m)),
    ])
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

/// `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2`, bias-corrected by the 1-based step
/// `t`, and `p' = p (1 - lr wd) - lr mhat / (sqrt(vhat) + eps)`; returns `[p', m', v']`.
pub(crate) fn adamw_update(
    h: AdamW,
    [param, grad, m, v]: [&Tensor; 4],
    step: &Tensor,
) -> Result<Vec<Tensor>, RuntimeError> {
    let op = "adamw_update";
    let (p, g, m, v) = (
        floats(op, param)?,
        floats(op, grad)?,
        floats(op, m)?,
        floats(op, v)?,
    );
    let t = floats(op, step)?.first().copied().unwrap_or(1.0);
    let (bias1, bias2) = (1.0 - h.beta1.powf(t), 1.0 - h.beta2.powf(t));
    let decay = 1.0 - h.lr * h.weight_decay;
    let n = p.len();
    let (mut new_p, mut new_m, mut new_v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        new_m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
        new_v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g[i] * g[i];
        let (m_hat, v_hat) = (new_m[i] / bias1, new_v[i] / bias2);
        new_p[i] = p[i] * decay - h.lr * m_hat / (v_hat.sqrt() + h.eps);
    }
    let ty = param.ty();
    Ok(vec![
        Tensor::from_parts(ty.clone(), Data::Float(new_p)),
        Tensor::from_parts(ty.clone(), Data::Float(new_m)),
        Tensor::from_parts(ty.clone(), Data::Float(new_v)),
    ])
}
