//! A deterministic, learnable synthetic data set that fills every graph input from its
//! [`InputRole`]: the same `(seed, step)` always gives the same batch, and different steps
//! give different batches.
//!
//! - **Token sequences** follow a fixed bigram rule: the first token of each row is uniform
//!   over the vocabulary and every later token is `perm[previous]` for a permutation `perm`
//!   drawn once from the seed ([`bigram_permutation`]). A row of `s + 1` tokens gives the
//!   `Tokens` input its first `s` and the `NextTokens` input its last `s`. The random first
//!   token is only ever an input, so every target follows from the token before it and the
//!   loss can approach 0; an untrained model starts near `ln(vocab)`.
//! - **Features** are standard normal.
//! - **Regression targets** `[b, o]` are `tanh(features @ W)` for a fixed teacher matrix
//!   `W[f, o]` with normal entries scaled by `1/sqrt(f)`, drawn from the seed; they need
//!   exactly one `Features` input of shape `[b, f]`.

use autopar_ir::{DType, Graph, InputRole, Op, TensorType};

use crate::TensorMap;
use crate::error::RuntimeError;
use crate::rng::Stream;
use crate::tensor::{Data, Tensor};

/// One training batch for every input of `graph`, named as the inputs are.
pub fn synthetic_batch(graph: &Graph, seed: u64, step: u64) -> Result<TensorMap, RuntimeError> {
    let mut batch = TensorMap::new();
    let mut targets = Vec::new();
    for (_, name, op) in graph.inputs() {
        let Op::Input { ty, role, .. } = op else {
            continue;
        };
        let tensor = match *role {
            InputRole::Tokens { vocab } => tokens(name, ty, vocab, seed, step, 0)?,
            InputRole::NextTokens { vocab } => tokens(name, ty, vocab, seed, step, 1)?,
            InputRole::Features => features(name, ty, seed, step)?,
            // Targets are computed from the features, so they come after every other input.
            InputRole::RegressionTargets => {
                targets.push((name, ty));
                continue;
            }
        };
        batch.insert(name.to_string(), tensor);
    }
    for (name, ty) in targets {
        let features = regression_features(graph, &batch, name, ty)?;
        let tensor = regression_targets(ty, features, seed)?;
        batch.insert(name.to_string(), tensor);
    }
    Ok(batch)
}

/// The successor rule of the token sequences: token `x` is followed by `perm[x]`.
pub fn bigram_permutation(seed: u64, vocab: usize) -> Vec<usize> {
    let stream = Stream::new(seed, "data/bigram").derive(vocab as u64);
    let mut perm: Vec<usize> = (0..vocab).collect();
    for i in (1..vocab).rev() {
        let j = stream.below(i as u64, i as u64 + 1) as usize;
        perm.swap(i, j);
    }
    perm
}

fn data_error(name: &str, ty: &TensorType, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Data {
        name: name.to_string(),
        ty: ty.clone(),
        detail: detail.into(),
    }
}

/// Rows of the token sequences (the last dim is the sequence), starting `shift` tokens in.
fn tokens(
    name: &str,
    ty: &TensorType,
    vocab: usize,
    seed: u64,
    step: u64,
    shift: usize,
) -> Result<Tensor, RuntimeError> {
    let max_vocab = if ty.dtype == DType::I32 {
        i32::MAX as usize
    } else {
        i64::MAX as usize
    };
    if !ty.dtype.is_int() {
        return Err(data_error(name, ty, "token ids need an integer dtype"));
    }
    if vocab == 0 || vocab > max_vocab {
        return Err(data_error(
            name,
            ty,
            format!("vocabulary size {vocab} does not fit {}", ty.dtype),
        ));
    }
    let Some(&seq) = ty.dims().last() else {
        return Err(data_error(name, ty, "token inputs need a sequence dim"));
    };
    let n = ty.num_elements() as usize;
    let rows = n.checked_div(seq).unwrap_or(0);
    let perm = bigram_permutation(seed, vocab);
    let first = Stream::new(seed, "data/first-token").derive(step);
    let mut ids = Vec::with_capacity(n);
    for row in 0..rows {
        let mut token = first.below(row as u64, vocab as u64) as usize;
        for _ in 0..shift {
            token = perm[token];
        }
        for _ in 0..seq {
            ids.push(token as i64);
            token = perm[token];
        }
    }
    Tensor::new(ty.clone(), Data::Int(ids))
}

fn features(name: &str, ty: &TensorType, seed: u64, step: u64) -> Result<Tensor, RuntimeError> {
    if !ty.dtype.is_float() {
        return Err(data_error(name, ty, "features need a float dtype"));
    }
    let stream = Stream::new(seed, &format!("data/features/{name}")).derive(step);
    let values = (0..ty.num_elements()).map(|i| stream.normal(i)).collect();
    Ok(Tensor::new(ty.clone(), Data::Float(values))?.rounded())
}

/// The one `Features` input of shape `[b, f]` that regression targets `ty = [b, o]` follow.
fn regression_features<'a>(
    graph: &Graph,
    batch: &'a TensorMap,
    name: &str,
    ty: &TensorType,
) -> Result<&'a Tensor, RuntimeError> {
    if ty.rank() != 2 || !ty.dtype.is_float() {
        return Err(data_error(
            name,
            ty,
            "regression targets must be a float [batch, outputs] tensor",
        ));
    }
    let candidates: Vec<&Tensor> = graph
        .inputs()
        .into_iter()
        .filter(|(_, _, op)| {
            matches!(
                op,
                Op::Input {
                    role: InputRole::Features,
                    ..
                }
            )
        })
        .filter_map(|(_, feature_name, _)| batch.get(feature_name))
        .filter(|t| t.dims().len() == 2 && t.dims()[0] == ty.dims()[0])
        .collect();
    match candidates.as_slice() {
        [one] => Ok(one),
        [] => Err(data_error(
            name,
            ty,
            format!(
                "needs a features input of shape [{}, f], and the graph has none",
                ty.dims()[0]
            ),
        )),
        _ => Err(data_error(
            name,
            ty,
            format!(
                "{} features inputs of shape [{}, f] could drive it; expected exactly one",
                candidates.len(),
                ty.dims()[0]
            ),
        )),
    }
}

/// The teacher matrix `W[features, outputs]` (row-major) behind the regression targets:
/// normal entries scaled by `1/sqrt(features)`, fixed by the seed.
pub fn regression_teacher(seed: u64, features: usize, outputs: usize) -> Vec<f64> {
    let teacher = Stream::new(seed, "data/teacher")
        .derive(features as u64)
        .derive(outputs as u64);
    let scale = 1.0 / (features as f64).sqrt();
    (0..features * outputs)
        .map(|i| scale * teacher.normal(i as u64))
        .collect()
}

/// `tanh(x @ W)` for the seeded teacher `W[f, o]`.
fn regression_targets(ty: &TensorType, x: &Tensor, seed: u64) -> Result<Tensor, RuntimeError> {
    let (b, f, o) = (x.dims()[0], x.dims()[1], ty.dims()[1]);
    let w = regression_teacher(seed, f, o);
    let xs = x.to_f64_vec();
    let mut y = vec![0.0; b * o];
    for row in 0..b {
        for k in 0..f {
            let xk = xs[row * f + k];
            for j in 0..o {
                y[row * o + j] += xk * w[k * o + j];
            }
        }
    }
    for v in &mut y {
        *v = v.tanh();
    }
    Ok(Tensor::new(ty.clone(), Data::Float(y))?.rounded())
}
