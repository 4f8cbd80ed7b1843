//! Reductions and the kernels built on them: reduce, softmax, layer and RMS norm, and
//! cross-entropy. All accumulate in `f64`.

use autopar_ir::{ReduceOp, TensorType};

use super::{checked_ids, floats, for_each_offset, ints};
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor, strides};

/// Reduction over `dims`; `out` is the result type (the other dims, in order).
pub(crate) fn reduce(
    op: &'static str,
    func: ReduceOp,
    dims: &[usize],
    x: &Tensor,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let n_out = out.num_elements() as usize;
    let count: usize = dims.iter().map(|&d| x.dims()[d]).product();
    if count == 0 && n_out > 0 && matches!(func, ReduceOp::Max | ReduceOp::Min) {
        return Err(RuntimeError::EmptyReduction { op });
    }
    // For every input dim, how far one step along it moves in the output (0 if reduced).
    let out_strides = strides(out.dims());
    let mut kept = out_strides.iter();
    let step: Vec<usize> = (0..x.dims().len())
        .map(|d| {
            if dims.contains(&d) {
                0
            } else {
                kept.next().copied().unwrap_or(0)
            }
        })
        .collect();
    let data = match x.data() {
        Data::Float(v) => {
            let init = match func {
                ReduceOp::Sum | ReduceOp::Mean => 0.0,
                ReduceOp::Max => f64::NEG_INFINITY,
                ReduceOp::Min => f64::INFINITY,
            };
            let mut acc = vec![init; n_out];
            let mut i = 0;
            let combine: fn(f64, f64) -> f64 = match func {
                ReduceOp::Sum | ReduceOp::Mean => |a, b| a + b,
                // A NaN, once met, stays.
                ReduceOp::Max => |a, b| if a.is_nan() || a >= b { a } else { b },
                ReduceOp::Min => |a, b| if a.is_nan() || a <= b { a } else { b },
            };
            for_each_offset(x.dims(), &step, |o| {
                acc[o] = combine(acc[o], v[i]);
                i += 1;
            });
            if func == ReduceOp::Mean {
                for a in &mut acc {
                    *a /= count as f64;
                }
            }
            Data::Float(acc)
        }
        Data::Int(v) => {
            let (init, combine): (i64, fn(i64, i64) -> i64) = match func {
                ReduceOp::Sum => (0, i64::wrapping_add),
                ReduceOp::Max => (i64::MIN, i64::max),
                ReduceOp::Min => (i64::MAX, i64::min),
                ReduceOp::Mean => {
                    return Err(RuntimeError::UnsupportedDType {
                        op,
                        dtype: x.dtype(),
                    });
                }
            };
            let mut acc = vec![init; n_out];
            let mut i = 0;
            for_each_offset(x.dims(), &step, |o| {
                acc[o] = combine(acc[o], v[i]);
                i += 1;
            });
            Data::Int(acc)
        }
        Data::Bool(_) => {
            return Err(RuntimeError::UnsupportedDType {
                op,
                dtype: x.dtype(),
            });
        }
    };
    Ok(Tensor::from_parts(out.clone(), data))
}

/// Softmax along `dim`, subtracting the maximum first.
pub(crate) fn softmax(dim: usize, x: &Tensor) -> Result<Tensor, RuntimeError> {
    let v = floats("softmax", x)?;
    let dims = x.dims();
    let n = dims[dim];
    let inner: usize = dims[dim + 1..].iter().product();
    let outer: usize = dims[..dim].iter().product();
    let mut out = v.to_vec();
    let mut row = vec![0.0; n];
    for o in 0..outer {
        for i in 0..inner {
            let base = o * n * inner + i;
            for (j, r) in row.iter_mut().enumerate() {
                *r = v[base + j * inner];
            }
            softmax_in_place(&mut row);
            for (j, r) in row.iter().enumerate() {
                out[base + j * inner] = *r;
            }
        }
    }
    Ok(Tensor::from_parts(x.ty().clone(), Data::Float(out)))
}

/// Numerically stable softmax of a contiguous row.
pub(crate) fn softmax_in_place(row: &mut [f64]) {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for r in row.iter_mut() {
        *r = (*r - max).exp();
        sum += *r;
    }
    for r in row.iter_mut() {
        *r /= sum;
    }
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dim, with the biased variance.
pub(crate) fn layer_norm(
    eps: f64,
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
) -> Result<Tensor, RuntimeError> {
    let op = "layer_norm";
    let (g, b) = (floats(op, gamma)?, floats(op, beta)?);
    normalize_rows(op, x, |row, out| {
        let h = row.len() as f64;
        let mean = row.iter().sum::<f64>() / h;
        let var = row.iter().map(|&a| (a - mean) * (a - mean)).sum::<f64>() / h;
        let inv = 1.0 / (var + eps).sqrt();
        for (k, o) in out.iter_mut().enumerate() {
            *o = (row[k] - mean) * inv * g[k] + b[k];
        }
    })
}

/// `x / sqrt(mean(x^2) + eps) * gamma` over the last dim.
pub(crate) fn rms_norm(eps: f64, x: &Tensor, gamma: &Tensor) -> Result<Tensor, RuntimeError> {
    let op = "rms_norm";
    let g = floats(op, gamma)?;
    normalize_rows(op, x, |row, out| {
        let mean_sq = row.iter().map(|&a| a * a).sum::<f64>() / row.len() as f64;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (k, o) in out.iter_mut().enumerate() {
            *o = row[k] * inv * g[k];
        }
    })
}

/// Applies `f(row, out_row)` to every row of the last dim of `x`.
fn normalize_rows(
    op: &'static str,
    x: &Tensor,
    mut f: impl FnMut(&[f64], &mut [f64]),
) -> Result<Tensor, RuntimeError> {
    let v = floats(op, x)?;
    let h = x.dims().last().copied().unwrap_or(1);
    let mut out = vec![0.0; v.len()];
    if h > 0 {
        for (row, out_row) in v.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            f(row, out_row);
        }
    }
    Ok(Tensor::from_parts(x.ty().clone(), Data::Float(out)))
}

/// `logsumexp(logits) - logits[target]` for every position; `out` is `f32[...]`.
pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let op = "cross_entropy";
    let l = floats(op, logits)?;
    let v = logits.dims().last().copied().unwrap_or(1);
    let t = checked_ids(op, ints(op, targets)?, v)?;
    let loss = t
        .iter()
        .enumerate()
        .map(|(i, &target)| {
            let row = &l[i * v..(i + 1) * v];
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|&a| (a - max).exp()).sum::<f64>().ln();
            lse - row[target]
        })
        .collect();
    Ok(Tensor::from_parts(out.clone(), Data::Float(loss)))
}
