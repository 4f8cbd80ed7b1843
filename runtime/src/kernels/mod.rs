//! Kernels: one free function per op over host tensors, and [`eval_op`], the single place
//! where an [`Op`] is mapped to its kernel.
//!
//! Kernels compute in `f64` and leave rounding to [`eval_op`], which rounds every float
//! result to its declared dtype under [`Precision::Declared`]. The dot products of einsum and
//! attention accumulate in `f64` too, or, under [`Accumulation::F32`], as an f32 multiply-add
//! chain would ([`eval_op_with`]). Communication ops have no kernel here: an executor hands
//! them to a [`crate::Collectives`].

mod attention;
mod einsum;
mod elementwise;
mod layout;
mod moe;
mod optim;
mod reduction;

use autopar_ir::infer::infer;
use autopar_ir::{FusionBody, Op, TensorType};

use crate::error::RuntimeError;
use crate::tensor::{Precision, Tensor};

/// How the dot products of contractions (einsum, and the products inside attention and its
/// backward) accumulate; every other sum (reductions, norms, softmax, cross-entropy)
/// accumulates in `f64` either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Accumulation {
    /// In `f64`: the reference's semantics, the exact sum up to `f64` rounding.
    #[default]
    Wide,
    /// In `f32`, as a chain of fused multiply-adds would: each product is formed in `f64`
    /// (exact for two `f32` operands) and the running sum rounded to `f32` after every add.
    /// This is how PyTorch's and cuBLAS's f32 GEMMs (and the fast backend's by default)
    /// accumulate, up to the order of the terms; `--verify` runs a reference so configured to
    /// measure the noise such accumulation adds ([`crate::verify::Tolerance`]).
    F32,
}

impl Accumulation {
    /// `acc + term`, accumulated as `self` says.
    #[inline]
    pub fn add(self, acc: f64, term: f64) -> f64 {
        match self {
            Accumulation::Wide => acc + term,
            Accumulation::F32 => (acc + term) as f32 as f64,
        }
    }
}

/// Computes `op` on `operands` and returns its results, rounded as `precision` says, with
/// dot products accumulated in `f64` ([`Accumulation::Wide`]; see [`eval_op_with`]).
pub fn eval_op(
    op: &Op,
    operands: &[&Tensor],
    precision: Precision,
) -> Result<Vec<Tensor>, RuntimeError> {
    eval_op_with(op, operands, precision, Accumulation::Wide)
}

/// Computes `op` on `operands` and returns its results, rounded as `precision` says, the dot
/// products of contractions accumulated as `accumulation` says.
///
/// The operands are checked against the op's typing rule first, so a kernel never sees
/// operands of the wrong shape. Parameters and inputs are not computed
/// ([`RuntimeError::NotAKernel`]); communication ops need a multi-rank executor
/// ([`RuntimeError::NeedsMultiRank`]).
pub fn eval_op_with(
    op: &Op,
    operands: &[&Tensor],
    precision: Precision,
    accumulation: Accumulation,
) -> Result<Vec<Tensor>, RuntimeError> {
    // Refused before typing, because the typing rules of communication ops need the mesh.
    if op.is_communication() {
        return Err(RuntimeError::NeedsMultiRank { op: op.name() });
    }
    let types: Vec<&TensorType> = operands.iter().map(|t| t.ty()).collect();
    let result_types = infer(op, &types, None)?;
    if let Op::Fusion { body } = op {
        // A fusion means its body: each instruction evaluated and rounded as an unfused
        // node would be, so that a fused program equals its unfused self.
        return fusion(body, operands, precision, accumulation);
    }
    let results = dispatch(op, operands, &result_types, accumulation)?;
    debug_assert!(
        results.iter().map(Tensor::ty).eq(result_types.iter()),
        "`{op}` kernel results disagree with its typing rule"
    );
    Ok(match precision {
        Precision::Declared => results.into_iter().map(Tensor::rounded).collect(),
        Precision::F64 => results,
    })
}

/// The kernel of every op, on operands that satisfy its typing rule (with `result_types` the
/// types that rule gives). No wildcard arm: a new op must get a kernel or an explicit refusal.
fn dispatch(
    op: &Op,
    x: &[&Tensor],
    result_types: &[TensorType],
    acc: Accumulation,
) -> Result<Vec<Tensor>, RuntimeError> {
    let name = op.name();
    // Every op that reaches a kernel has at least one result (only `send` has none).
    let out = || &result_types[0];
    let one = |t: Tensor| Ok(vec![t]);
    match op {
        Op::Parameter { .. } | Op::Input { .. } => Err(RuntimeError::NotAKernel { op: name }),
        Op::Constant { ty, value } => one(Tensor::full(ty.clone(), *value)),
        Op::Einsum { spec } => one(einsum::einsum(acc, spec, x[0], x[1], out())?),
        Op::Unary { func } => one(elementwise::unary(*func, x[0])?),
        Op::Binary { func } => one(elementwise::binary(*func, x[0], x[1])?),
        Op::Compare { func } => one(elementwise::compare(*func, x[0], x[1])?),
        Op::Select => one(elementwise::select(x[0], x[1], x[2])?),
        Op::Cast { to } => one(elementwise::cast(x[0], *to)),
        Op::Reduce { func, dims } => one(reduction::reduce(name, *func, dims, x[0], out())?),
        Op::Softmax { dim } => one(reduction::softmax(*dim, x[0])?),
        Op::LayerNorm { eps } => one(reduction::layer_norm(*eps, x[0], x[1], x[2])?),
        Op::RmsNorm { eps } => one(reduction::rms_norm(*eps, x[0], x[1])?),
        Op::Gather => one(layout::gather(x[0], x[1], out())?),
        Op::ScatterAdd { num_rows } => one(layout::scatter_add(*num_rows, x[0], x[1], out())?),
        Op::Reshape { .. } => one(x[0].clone().retyped(out().clone())),
        Op::Transpose { perm } => one(layout::transpose(perm, x[0], out())),
        Op::Slice { dim, start, end } => one(layout::slice(*dim, *start, *end, x[0], out())),
        Op::Concat { dim } => one(layout::concat(*dim, x, out())?),
        Op::Broadcast { dims, .. } => one(layout::broadcast(dims, x[0], out())),
        Op::Rotary { base } => one(attention::rotary(*base, x[0], x.get(1).copied())?),
        Op::Attention { causal, scale } => one(attention::attention(
            acc,
            *causal,
            *scale,
            [x[0], x[1], x[2]],
            x.get(3).copied().zip(x.get(4).copied()),
            out(),
        )?),
        Op::AttentionBackward { causal, scale } => attention::attention_backward(
            acc,
            *causal,
            *scale,
            [x[0], x[1], x[2], x[3], x[4]],
            x.get(5).copied().zip(x.get(6).copied()),
            result_types,
        ),
        Op::MoeRoute {
            top_k,
            capacity,
            normalize,
        } => moe::moe_route(*top_k, *capacity, *normalize, x[0], out()),
        Op::CrossEntropy => one(reduction::cross_entropy(x[0], x[1], out())?),
        Op::SgdUpdate {
            lr,
            momentum,
            weight_decay,
        } => {
            let lr = lr * lr_factor(x.get(3))?;
            optim::sgd_update(lr, *momentum, *weight_decay, x[0], x[1], x[2])
        }
        Op::AdamWUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => optim::adamw_update(
            optim::AdamW {
                lr: lr * lr_factor(x.get(5))?,
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
            },
            [x[0], x[1], x[2], x[3]],
            x[4],
        ),
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => Err(RuntimeError::NeedsMultiRank { op: name }),
        // [`eval_op`] evaluates fusions itself (it knows the precision).
        Op::Fusion { body } => fusion(body, x, Precision::Declared, acc),
    }
}

/// The results of a fusion body on `operands` (which its typing rule has checked).
fn fusion(
    body: &FusionBody,
    operands: &[&Tensor],
    precision: Precision,
    accumulation: Accumulation,
) -> Result<Vec<Tensor>, RuntimeError> {
    let mut values: Vec<Tensor> = Vec::with_capacity(body.num_values());
    values.extend(operands.iter().map(|t| (*t).clone()));
    for instr in &body.instrs {
        let args: Vec<&Tensor> = instr.operands.iter().map(|&v| &values[v]).collect();
        let mut out = eval_op_with(&instr.op, &args, precision, accumulation)?;
        values.push(out.remove(0));
    }
    Ok(body.results.iter().map(|&r| values[r].clone()).collect())
}

/// The float elements of an operand, or an error naming the op.
/// The learning-rate factor operand of an optimizer update, 1 when it has none.
fn lr_factor(factor: Option<&&Tensor>) -> Result<f64, RuntimeError> {
    match factor {
        Some(t) => Ok(floats("learning-rate factor", t)?
            .first()
            .copied()
            .unwrap_or(1.0)),
        None => Ok(1.0),
    }
}

fn floats<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [f64], RuntimeError> {
    t.floats().ok_or(RuntimeError::UnsupportedDType {
        op,
        dtype: t.dtype(),
    })
}

/// The integer elements of an operand, or an error naming the op.
fn ints<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [i64], RuntimeError> {
    t.ints().ok_or(RuntimeError::UnsupportedDType {
        op,
        dtype: t.dtype(),
    })
}

/// Ids as row indices, each checked against `0..bound`.
fn checked_ids(op: &'static str, ids: &[i64], bound: usize) -> Result<Vec<usize>, RuntimeError> {
    ids.iter()
        .map(|&id| match usize::try_from(id) {
            Ok(row) if row < bound => Ok(row),
            _ => Err(RuntimeError::IndexOutOfRange { op, id, bound }),
        })
        .collect()
}

/// Calls `f` with the offset `sum(index[i] * strides[i])` of every index of `dims`, in
/// row-major order.
fn for_each_offset(dims: &[usize], strides: &[usize], mut f: impl FnMut(usize)) {
    debug_assert_eq!(dims.len(), strides.len());
    if dims.contains(&0) {
        return;
    }
    let Some(last) = dims.len().checked_sub(1) else {
        f(0);
        return;
    };
    let (inner_len, inner_stride) = (dims[last], strides[last]);
    let mut index = vec![0usize; last];
    let mut base = 0usize;
    loop {
        for j in 0..inner_len {
            f(base + j * inner_stride);
        }
        // Advance the outer dims like an odometer.
        let mut d = last;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            base += strides[d];
            if index[d] < dims[d] {
                break;
            }
            base -= strides[d] * dims[d];
            index[d] = 0;
        }
    }
}

/// The elements of `src` read at the offsets [`for_each_offset`] gives: a strided view
/// (transposed, broadcast, ...) made contiguous with shape `dims`.
fn strided_copy<T: Copy>(src: &[T], dims: &[usize], strides: &[usize]) -> Vec<T> {
    let mut out = Vec::with_capacity(dims.iter().product());
    for_each_offset(dims, strides, |off| out.push(src[off]));
    out
}

/// `dst[m×n] = lhs[m×k] · rhs[k×n]`, all row-major and contiguous: with `gemm` in `f64`, or,
/// under [`Accumulation::F32`], each element summed over `k` in order, rounded to `f32` after
/// every multiply-add.
#[allow(unsafe_code)]
fn matmul(
    acc: Accumulation,
    m: usize,
    n: usize,
    k: usize,
    lhs: &[f64],
    rhs: &[f64],
    dst: &mut [f64],
) {
    assert!(
        lhs.len() == m * k && rhs.len() == k * n && dst.len() == m * n,
        "matmul buffers do not match {m}x{k} · {k}x{n}"
    );
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    if m == 0 || n == 0 {
        return;
    }
    if acc == Accumulation::F32 {
        // Row by row, `p` outer: every element still sums its `k` terms in order, while the
        // right operand is read along its rows.
        for (row, a_row) in dst.chunks_exact_mut(n).zip(lhs.chunks_exact(k)) {
            row.fill(0.0);
            for (&a, b_row) in a_row.iter().zip(rhs.chunks_exact(n)) {
                for (d, &b) in row.iter_mut().zip(b_row) {
                    *d = acc.add(*d, a * b);
                }
            }
        }
        return;
    }
    // SAFETY: the slices hold exactly m*k, k*n and m*n elements (asserted above) and the
    // strides below (column stride 1, row stride = row length) stay inside them. `dst` is a
    // unique borrow, so it aliases neither operand. With `read_dst = false` the old contents
    // of `dst` are not read; gemm's `alpha` (the factor on `dst`) is then unused and `beta`
    // (the factor on the product) is 1.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use autopar_ir::DType;

    use super::*;

    /// `[1, u, u, ..., u]` (`u` = 2^-24, half an ulp of 1 in f32) dotted with ones: an f32
    /// multiply-add chain rounds every `1 + u` back to 1 (ties to even), the wide sum keeps
    /// every `u`.
    #[test]
    fn f32_accumulation_rounds_the_running_sum() -> Result<(), Box<dyn std::error::Error>> {
        let k = 9;
        let u = 2f64.powi(-24);
        let mut x = vec![u; k];
        x[0] = 1.0;
        let a = Tensor::from_f64(TensorType::new(DType::F32, [1, k]), x)?;
        let b = Tensor::full(TensorType::new(DType::F32, [k, 1]), 1.0);
        let op = Op::Einsum {
            spec: "mk,kn->mn".parse()?,
        };
        let sum = |acc| -> Result<f64, RuntimeError> {
            let out = eval_op_with(&op, &[&a, &b], Precision::F64, acc)?;
            Ok(out[0].to_f64_vec()[0])
        };
        assert_eq!(sum(Accumulation::Wide)?, 1.0 + (k - 1) as f64 * u);
        assert_eq!(sum(Accumulation::F32)?, 1.0);
        // The order of the terms counts: the small ones first add up before meeting 1.
        let rev = Tensor::from_f64(
            TensorType::new(DType::F32, [1, k]),
            (0..k).map(|i| if i == k - 1 { 1.0 } else { u }).collect(),
        )?;
        let out = eval_op_with(&op, &[&rev, &b], Precision::F64, Accumulation::F32)?;
        assert_eq!(
            out[0].to_f64_vec()[0],
            f64::from(1.0f32 + 8.0 * 2f32.powi(-24))
        );
        Ok(())
    }

    #[test]
    fn f32_accumulation_reaches_attention_and_its_backward() -> Result<(), RuntimeError> {
        let ty = TensorType::new(DType::F32, [1, 3, 2, 4]);
        let values =
            |seed: f64| -> Vec<f64> { (0..24).map(|i| ((i as f64 + seed) * 0.7).sin()).collect() };
        let [q, k, v, g] = [0.0, 1.0, 2.0, 3.0].map(|s| Tensor::from_f64(ty.clone(), values(s)));
        let (q, k, v, g) = (q?, k?, v?, g?);
        let fwd = Op::Attention {
            causal: true,
            scale: 0.5,
        };
        let bwd = Op::AttentionBackward {
            causal: true,
            scale: 0.5,
        };
        let run = |acc| -> Result<Vec<Vec<f64>>, RuntimeError> {
            let o = eval_op_with(&fwd, &[&q, &k, &v], Precision::F64, acc)?.remove(0);
            let grads = eval_op_with(&bwd, &[&q, &k, &v, &o, &g], Precision::F64, acc)?;
            let mut all = vec![o.to_f64_vec()];
            all.extend(grads.iter().map(Tensor::to_f64_vec));
            Ok(all)
        };
        let (wide, narrow) = (run(Accumulation::Wide)?, run(Accumulation::F32)?);
        for (w, n) in wide.iter().zip(&narrow) {
            let diff = w
                .iter()
                .zip(n)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            // f32 rounding of the sums, no more: and not nothing, or F32 was ignored.
            assert!(diff < 1e-6, "{diff:e}");
        }
        assert_ne!(wide, narrow);
        Ok(())
    }

    #[test]
    fn offsets_walk_row_major() {
        let mut seen = Vec::new();
        for_each_offset(&[2, 3], &[1, 2], |o| seen.push(o));
        assert_eq!(seen, vec![0, 2, 4, 1, 3, 5]);
        seen.clear();
        for_each_offset(&[], &[], |o| seen.push(o));
        assert_eq!(seen, vec![0]);
        seen.clear();
        for_each_offset(&[2, 0, 3], &[0, 0, 0], |o| seen.push(o));
        assert!(seen.is_empty());
        assert_eq!(strided_copy(&[1, 2], &[2, 2], &[0, 1]), vec![1, 2, 1, 2]);
    }
}
