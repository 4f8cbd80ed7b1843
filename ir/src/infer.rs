//! Shape and dtype inference: the typing rule of every op.
//!
//! [`infer`] checks an op's operands and attributes and returns its result types. Errors name
//! the op and the shapes involved, so that a model or annotation mistake reads as one.

use crate::error::IrError;
use crate::mesh::DeviceMesh;
use crate::op::{FusionBody, Op, ReduceOp};
use crate::types::{DType, TensorType};

/// Result types of `op` applied to operands of types `inputs`.
///
/// `mesh` is needed only by collectives and point-to-point ops (their group sizes).
pub fn infer(
    op: &Op,
    inputs: &[&TensorType],
    mesh: Option<&DeviceMesh>,
) -> Result<Vec<TensorType>, IrError> {
    let name = op.name();
    let one = |t: TensorType| Ok(vec![t]);
    match op {
        Op::Parameter { ty, .. } | Op::Input { ty, .. } => {
            arity(name, inputs, 0)?;
            one(ty.clone())
        }
        Op::Constant { ty, value } => {
            arity(name, inputs, 0)?;
            match ty.dtype {
                DType::Bool if *value != 0.0 && *value != 1.0 => Err(IrError::attr(
                    name,
                    "value",
                    format!("{value} is not a bool (0 or 1)"),
                )),
                DType::I32 | DType::I64 if value.fract() != 0.0 || !value.is_finite() => Err(
                    IrError::attr(name, "value", format!("{value} is not an integer")),
                ),
                _ => one(ty.clone()),
            }
        }
        Op::Recv { axis, ty, .. } => {
            arity(name, inputs, 0)?;
            mesh_group(name, mesh, std::slice::from_ref(axis))?;
            one(ty.clone())
        }
        Op::Fusion { body } => fusion_types(body, inputs),
        Op::Einsum { spec } => {
            arity(name, inputs, 2)?;
            let (a, b) = (float(name, inputs[0])?, inputs[1]);
            same_dtype(name, a, b)?;
            if spec.lhs.len() != a.rank() || spec.rhs.len() != b.rank() {
                return Err(IrError::ty(
                    name,
                    format!("spec `{spec}` does not fit operands {a} and {b} (ranks differ)"),
                ));
            }
            for (side, labels) in [
                ("lhs", &spec.lhs),
                ("rhs", &spec.rhs),
                ("output", &spec.out),
            ] {
                for (i, c) in labels.iter().enumerate() {
                    if labels[..i].contains(c) {
                        return Err(IrError::attr(
                            name,
                            "spec",
                            format!("label `{c}` repeats in the {side} of `{spec}`"),
                        ));
                    }
                }
            }
            let mut sizes: Vec<(char, usize)> = Vec::new();
            for (labels, t) in [(&spec.lhs, a), (&spec.rhs, b)] {
                for (c, &d) in labels.iter().zip(t.dims()) {
                    match sizes.iter().find(|(l, _)| l == c) {
                        Some(&(_, s)) if s != d => {
                            return Err(IrError::ty(
                                name,
                                format!(
                                    "`{spec}`: label `{c}` is {s} in lhs {a} but {d} in rhs {b}"
                                ),
                            ));
                        }
                        Some(_) => {}
                        None => sizes.push((*c, d)),
                    }
                }
            }
            for c in spec.lhs.iter().chain(&spec.rhs) {
                let in_both = spec.lhs.contains(c) && spec.rhs.contains(c);
                if !in_both && !spec.out.contains(c) {
                    return Err(IrError::attr(
                        name,
                        "spec",
                        format!(
                            "label `{c}` of `{spec}` is in one operand only and not in the output"
                        ),
                    ));
                }
            }
            let mut out = Vec::with_capacity(spec.out.len());
            for c in &spec.out {
                match sizes.iter().find(|(l, _)| l == c) {
                    Some(&(_, s)) => out.push(s),
                    None => {
                        return Err(IrError::attr(
                            name,
                            "spec",
                            format!("output label `{c}` of `{spec}` is in neither operand"),
                        ));
                    }
                }
            }
            one(TensorType::new(a.dtype, out))
        }
        Op::Unary { func } => {
            arity(name, inputs, 1)?;
            let t = inputs[0];
            if !(t.dtype.is_float() || (func.accepts_int() && t.dtype.is_int())) {
                return Err(IrError::ty(
                    name,
                    format!("operand {t} has an unsupported dtype"),
                ));
            }
            one(t.clone())
        }
        Op::Binary { func } => {
            arity(name, inputs, 2)?;
            same_type(name, inputs[0], inputs[1])?;
            let t = inputs[0];
            let ok = match func {
                crate::op::BinaryOp::Pow => t.dtype.is_float(),
                _ => t.dtype != DType::Bool,
            };
            if !ok {
                return Err(IrError::ty(
                    name,
                    format!("operands {t} have an unsupported dtype"),
                ));
            }
            one(t.clone())
        }
        Op::Compare { .. } => {
            arity(name, inputs, 2)?;
            same_type(name, inputs[0], inputs[1])?;
            one(inputs[0].with_dtype(DType::Bool))
        }
        Op::Select => {
            arity(name, inputs, 3)?;
            let (c, a, b) = (inputs[0], inputs[1], inputs[2]);
            if c.dtype != DType::Bool || c.shape != a.shape {
                return Err(IrError::ty(
                    name,
                    format!("condition {c} must be bool with the shape of the values {a}"),
                ));
            }
            same_type(name, a, b)?;
            one(a.clone())
        }
        Op::Cast { to } => {
            arity(name, inputs, 1)?;
            one(inputs[0].with_dtype(*to))
        }
        Op::Reduce { func, dims } => {
            arity(name, inputs, 1)?;
            let t = inputs[0];
            if dims.windows(2).any(|w| w[0] >= w[1]) || dims.iter().any(|&d| d >= t.rank()) {
                return Err(IrError::attr(
                    name,
                    "dims",
                    format!("{dims:?} must be strictly increasing dims of {t}"),
                ));
            }
            if *func == ReduceOp::Mean && !t.dtype.is_float() || t.dtype == DType::Bool {
                return Err(IrError::ty(
                    name,
                    format!("operand {t} has an unsupported dtype"),
                ));
            }
            let out: Vec<usize> = t
                .dims()
                .iter()
                .enumerate()
                .filter(|(i, _)| !dims.contains(i))
                .map(|(_, &d)| d)
                .collect();
            one(TensorType::new(t.dtype, out))
        }
        Op::Softmax { dim } => {
            arity(name, inputs, 1)?;
            let t = float(name, inputs[0])?;
            check_dim(name, "dim", *dim, t)?;
            one(t.clone())
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
            let n_params = if matches!(op, Op::LayerNorm { .. }) {
                2
            } else {
                1
            };
            arity(name, inputs, 1 + n_params)?;
            let x = float(name, inputs[0])?;
            if eps.is_nan() || *eps < 0.0 {
                return Err(IrError::attr(
                    name,
                    "eps",
                    format!("{eps} must be non-negative"),
                ));
            }
            let Some(&h) = x.dims().last() else {
                return Err(IrError::ty(
                    name,
                    format!("operand {x} must have rank at least 1"),
                ));
            };
            for p in &inputs[1..] {
                if p.dims() != [h] || p.dtype != x.dtype {
                    return Err(IrError::ty(
                        name,
                        format!("scale/shift {p} must be {}[{h}] to match {x}", x.dtype),
                    ));
                }
            }
            one(x.clone())
        }
        Op::Gather => {
            arity(name, inputs, 2)?;
            let (table, ids) = (inputs[0], inputs[1]);
            if table.rank() == 0 {
                return Err(IrError::ty(
                    name,
                    format!("table {table} must have rank at least 1"),
                ));
            }
            int(name, ids)?;
            let mut out = ids.dims().to_vec();
            out.extend_from_slice(&table.dims()[1..]);
            one(TensorType::new(table.dtype, out))
        }
        Op::ScatterAdd { num_rows } => {
            arity(name, inputs, 2)?;
            let (ids, upd) = (inputs[0], float(name, inputs[1])?);
            int(name, ids)?;
            if !upd.dims().starts_with(ids.dims()) {
                return Err(IrError::ty(
                    name,
                    format!("updates {upd} must start with the shape of the ids {ids}"),
                ));
            }
            if *num_rows == 0 {
                return Err(IrError::attr(name, "num_rows", "must be positive"));
            }
            let mut out = vec![*num_rows];
            out.extend_from_slice(&upd.dims()[ids.rank()..]);
            one(TensorType::new(upd.dtype, out))
        }
        Op::Reshape { shape } => {
            arity(name, inputs, 1)?;
            let t = inputs[0];
            if shape.num_elements() != t.num_elements() {
                return Err(IrError::ty(
                    name,
                    format!(
                        "cannot reshape {t} ({} elements) to {shape} ({} elements)",
                        t.num_elements(),
                        shape.num_elements()
                    ),
                ));
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::Transpose { perm } => {
            arity(name, inputs, 1)?;
            let t = inputs[0];
            let mut sorted = perm.clone();
            sorted.sort_unstable();
            if sorted != (0..t.rank()).collect::<Vec<_>>() {
                return Err(IrError::attr(
                    name,
                    "perm",
                    format!(
                        "{perm:?} is not a permutation of the {} dims of {t}",
                        t.rank()
                    ),
                ));
            }
            let out: Vec<usize> = perm.iter().map(|&p| t.dims()[p]).collect();
            one(TensorType::new(t.dtype, out))
        }
        Op::Slice { dim, start, end } => {
            arity(name, inputs, 1)?;
            let t = inputs[0];
            check_dim(name, "dim", *dim, t)?;
            let size = t.dims()[*dim];
            if !(start < end && *end <= size) {
                return Err(IrError::attr(
                    name,
                    "start",
                    format!(
                        "range {start}..{end} is not a non-empty range within dim {dim} of {t}"
                    ),
                ));
            }
            let mut out = t.dims().to_vec();
            out[*dim] = end - start;
            one(TensorType::new(t.dtype, out))
        }
        Op::Concat { dim } => {
            let Some(first) = inputs.first() else {
                return Err(IrError::ty(name, "needs at least one operand"));
            };
            check_dim(name, "dim", *dim, first)?;
            let mut total = 0;
            for t in inputs {
                let compatible = t.dtype == first.dtype
                    && t.rank() == first.rank()
                    && t.dims()
                        .iter()
                        .zip(first.dims())
                        .enumerate()
                        .all(|(i, (a, b))| i == *dim || a == b);
                if !compatible {
                    return Err(IrError::ty(
                        name,
                        format!("operands {first} and {t} differ outside dim {dim}"),
                    ));
                }
                total = grow(name, total, t.dims()[*dim], 1)?;
            }
            let mut out = first.dims().to_vec();
            out[*dim] = total;
            one(TensorType::new(first.dtype, out))
        }
        Op::Broadcast { shape, dims } => {
            arity(name, inputs, 1)?;
            let t = inputs[0];
            let increasing = dims.windows(2).all(|w| w[0] < w[1]);
            if dims.len() != t.rank() || !increasing || dims.iter().any(|&d| d >= shape.rank()) {
                return Err(IrError::attr(
                    name,
                    "dims",
                    format!(
                        "{dims:?} must map the {} dims of {t} into {shape} in increasing order",
                        t.rank()
                    ),
                ));
            }
            for (i, &d) in dims.iter().enumerate() {
                let (from, to) = (t.dims()[i], shape.dims()[d]);
                if from != to && from != 1 {
                    return Err(IrError::ty(
                        name,
                        format!(
                            "dim {i} of {t} (size {from}) cannot broadcast to dim {d} of {shape} (size {to})"
                        ),
                    ));
                }
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::Rotary { base } => {
            if inputs.len() != 1 && inputs.len() != 2 {
                return Err(IrError::ty(
                    name,
                    format!("takes 1 or 2 operands, got {}", inputs.len()),
                ));
            }
            let x = float(name, inputs[0])?;
            if base.is_nan() || *base <= 0.0 {
                return Err(IrError::attr(
                    name,
                    "base",
                    format!("{base} must be positive"),
                ));
            }
            if x.rank() < 3 || x.dims()[x.rank() - 1] % 2 != 0 {
                return Err(IrError::ty(
                    name,
                    format!(
                        "operand {x} must be [..., seq, heads, head_dim] with an even head_dim"
                    ),
                ));
            }
            if let Some(pos) = inputs.get(1) {
                int(name, pos)?;
                let s = x.dims()[x.rank() - 3];
                if pos.dims() != [s] {
                    return Err(IrError::ty(
                        name,
                        format!("positions {pos} must be [{s}] for operand {x}"),
                    ));
                }
            }
            one(x.clone())
        }
        Op::Attention { scale, .. } => {
            if inputs.len() != 3 && inputs.len() != 5 {
                return Err(IrError::ty(
                    name,
                    format!(
                        "takes 3 operands (q, k, v) or 5 (q, k, v, q_pos, k_pos), got {}",
                        inputs.len()
                    ),
                ));
            }
            let (q, k, v) = (float(name, inputs[0])?, inputs[1], inputs[2]);
            same_dtype(name, q, k)?;
            same_dtype(name, q, v)?;
            let fits = q.rank() == 4
                && k.rank() == 4
                && v.rank() == 4
                && q.dims()[0] == k.dims()[0]
                && k.dims()[0] == v.dims()[0]
                && k.dims()[1] == v.dims()[1]
                && k.dims()[2] == v.dims()[2]
                && q.dims()[3] == k.dims()[3]
                && k.dims()[2] > 0
                && q.dims()[2] % k.dims()[2] == 0;
            if !fits {
                return Err(IrError::ty(
                    name,
                    format!(
                        "q {q}, k {k}, v {v} must be [b,s,hq,d], [b,t,hkv,d], [b,t,hkv,dv] with hq a multiple of hkv"
                    ),
                ));
            }
            if !scale.is_finite() {
                return Err(IrError::attr(
                    name,
                    "scale",
                    format!("{scale} is not finite"),
                ));
            }
            if let [.., q_pos, k_pos] = inputs
                && inputs.len() == 5
            {
                if q_pos.dtype != k_pos.dtype {
                    return Err(IrError::ty(
                        name,
                        format!("q_pos {q_pos} and k_pos {k_pos} must have one dtype"),
                    ));
                }
                for (what, pos, n) in [("q_pos", q_pos, q.dims()[1]), ("k_pos", k_pos, k.dims()[1])]
                {
                    int(name, pos)?;
                    if pos.dims() != [n] {
                        return Err(IrError::ty(
                            name,
                            format!("{what} {pos} must be [{n}] for q {q} and k {k}"),
                        ));
                    }
                }
            }
            let d = q.dims();
            one(TensorType::new(q.dtype, [d[0], d[1], d[2], v.dims()[3]]))
        }
        Op::AttentionBackward { causal, scale } => {
            if inputs.len() != 5 && inputs.len() != 7 {
                return Err(IrError::ty(
                    name,
                    format!(
                        "takes 5 operands (q, k, v, o, g) or 7 (q, k, v, o, g, q_pos, k_pos), got {}",
                        inputs.len()
                    ),
                ));
            }
            let (q, k, v, o, g) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]);
            let mut forward: Vec<&TensorType> = vec![q, k, v];
            forward.extend(inputs.get(5..).unwrap_or_default());
            let attention = Op::Attention {
                causal: *causal,
                scale: *scale,
            };
            let out = infer(&attention, &forward, mesh).map_err(|e| match e {
                IrError::Type { detail, .. } => IrError::ty(name, detail),
                IrError::Attr { attr, detail, .. } => IrError::attr(name, attr, detail),
                other => other,
            })?;
            for (what, t) in [("o", o), ("g", g)] {
                if *t != out[0] {
                    return Err(IrError::ty(
                        name,
                        format!("{what} {t} must be the attention's result type {}", out[0]),
                    ));
                }
            }
            Ok(vec![q.clone(), k.clone(), v.clone()])
        }
        Op::MoeRoute {
            top_k, capacity, ..
        } => {
            arity(name, inputs, 1)?;
            let p = float(name, inputs[0])?;
            if p.rank() < 2 {
                return Err(IrError::ty(
                    name,
                    format!("router probabilities {p} must be [..., tokens, experts]"),
                ));
            }
            let e = p.dims()[p.rank() - 1];
            if *top_k == 0 || *top_k > e {
                return Err(IrError::attr(
                    name,
                    "top_k",
                    format!("{top_k} must be in 1..={e}"),
                ));
            }
            if *capacity == 0 {
                return Err(IrError::attr(name, "capacity", "must be positive"));
            }
            let mut dims = p.dims().to_vec();
            dims.push(*capacity);
            let t = TensorType::new(p.dtype, dims);
            Ok(vec![t.clone(), t])
        }
        Op::CrossEntropy => {
            arity(name, inputs, 2)?;
            let (logits, targets) = (float(name, inputs[0])?, inputs[1]);
            int(name, targets)?;
            if logits.rank() != targets.rank() + 1 || !logits.dims().starts_with(targets.dims()) {
                return Err(IrError::ty(
                    name,
                    format!(
                        "logits {logits} must be targets {targets} with one more (vocabulary) dim"
                    ),
                ));
            }
            one(TensorType::new(DType::F32, targets.shape.clone()))
        }
        Op::SgdUpdate { .. } => {
            lr_factor(name, inputs, 3)?;
            let p = float(name, inputs[0])?;
            for t in &inputs[1..3] {
                same_type(name, p, t)?;
            }
            Ok(vec![p.clone(), p.clone()])
        }
        Op::AdamWUpdate { .. } => {
            lr_factor(name, inputs, 5)?;
            let p = float(name, inputs[0])?;
            for t in &inputs[1..4] {
                same_type(name, p, t)?;
            }
            let step = inputs[4];
            if *step != TensorType::scalar(DType::F32) {
                return Err(IrError::ty(
                    name,
                    format!("step count {step} must be f32[]"),
                ));
            }
            Ok(vec![p.clone(), p.clone(), p.clone()])
        }
        Op::AllReduce { axes, .. } | Op::CollectiveBroadcast { axes, .. } => {
            arity(name, inputs, 1)?;
            let n = mesh_group(name, mesh, axes)?;
            if let Op::CollectiveBroadcast { root, .. } = op
                && *root >= n
            {
                return Err(IrError::attr(
                    name,
                    "root",
                    format!("{root} is outside the group of {n}"),
                ));
            }
            one(inputs[0].clone())
        }
        Op::AllGather { axes, dim } => {
            arity(name, inputs, 1)?;
            let n = mesh_group(name, mesh, axes)?;
            let t = inputs[0];
            check_dim(name, "dim", *dim, t)?;
            let mut out = t.dims().to_vec();
            out[*dim] = grow(name, 0, out[*dim], n)?;
            one(TensorType::new(t.dtype, out))
        }
        Op::ReduceScatter { axes, dim, .. } => {
            arity(name, inputs, 1)?;
            let n = mesh_group(name, mesh, axes)?;
            let t = inputs[0];
            check_dim(name, "dim", *dim, t)?;
            let mut out = t.dims().to_vec();
            divisible(name, t, *dim, n, axes)?;
            out[*dim] /= n;
            one(TensorType::new(t.dtype, out))
        }
        Op::AllToAll {
            axes,
            split_dim,
            concat_dim,
        } => {
            arity(name, inputs, 1)?;
            let n = mesh_group(name, mesh, axes)?;
            let t = inputs[0];
            check_dim(name, "split_dim", *split_dim, t)?;
            check_dim(name, "concat_dim", *concat_dim, t)?;
            divisible(name, t, *split_dim, n, axes)?;
            let mut out = t.dims().to_vec();
            out[*split_dim] /= n;
            out[*concat_dim] = grow(name, 0, out[*concat_dim], n)?;
            one(TensorType::new(t.dtype, out))
        }
        Op::Send { axis, .. } => {
            arity(name, inputs, 1)?;
            mesh_group(name, mesh, std::slice::from_ref(axis))?;
            Ok(Vec::new())
        }
    }
}

/// Number of results `op` produces (independent of operand types).
pub fn num_results(op: &Op) -> usize {
    match op {
        Op::Send { .. } => 0,
        Op::MoeRoute { .. } | Op::SgdUpdate { .. } => 2,
        Op::AttentionBackward { .. } => 3,
        Op::AdamWUpdate { .. } => 3,
        Op::Fusion { body } => body.results.len(),
        _ => 1,
    }
}

/// `acc + d * n`, or an error when the dim would not fit in a `usize`.
fn grow(op: &'static str, acc: usize, d: usize, n: usize) -> Result<usize, IrError> {
    d.checked_mul(n)
        .and_then(|x| x.checked_add(acc))
        .ok_or_else(|| IrError::ty(op, format!("result dim overflows ({acc} + {d} x {n})")))
}

fn arity(op: &'static str, inputs: &[&TensorType], n: usize) -> Result<(), IrError> {
    if inputs.len() == n {
        Ok(())
    } else {
        Err(IrError::ty(
            op,
            format!("takes {n} operands, got {}", inputs.len()),
        ))
    }
}

/// An optimizer update takes `base` operands and, optionally, a learning-rate factor after
/// them (an `f32[]` the step's schedule computes, multiplying the op's `lr`): whether it has
/// one.
fn lr_factor(name: &'static str, inputs: &[&TensorType], base: usize) -> Result<bool, IrError> {
    match inputs.len() {
        n if n == base => Ok(false),
        n if n == base + 1 => {
            let f = inputs[base];
            if *f != TensorType::scalar(DType::F32) {
                return Err(IrError::ty(
                    name,
                    format!("learning-rate factor {f} must be f32[]"),
                ));
            }
            Ok(true)
        }
        n => Err(IrError::ty(
            name,
            format!(
                "expects {base} operands, or {} with a learning-rate factor, got {n}",
                base + 1
            ),
        )),
    }
}

fn same_type(op: &'static str, a: &TensorType, b: &TensorType) -> Result<(), IrError> {
    if a == b {
        Ok(())
    } else {
        Err(IrError::ty(op, format!("operand types differ: {a} vs {b}")))
    }
}

fn same_dtype(op: &'static str, a: &TensorType, b: &TensorType) -> Result<(), IrError> {
    if a.dtype == b.dtype {
        Ok(())
    } else {
        Err(IrError::ty(
            op,
            format!("operand dtypes differ: {a} vs {b}"),
        ))
    }
}

fn float<'a>(op: &'static str, t: &'a TensorType) -> Result<&'a TensorType, IrError> {
    if t.dtype.is_float() {
        Ok(t)
    } else {
        Err(IrError::ty(
            op,
            format!("operand {t} must be a float tensor"),
        ))
    }
}

fn int(op: &'static str, t: &TensorType) -> Result<(), IrError> {
    if t.dtype.is_int() {
        Ok(())
    } else {
        Err(IrError::ty(
            op,
            format!("index operand {t} must be i32 or i64"),
        ))
    }
}

fn check_dim(
    op: &'static str,
    attr: &'static str,
    dim: usize,
    t: &TensorType,
) -> Result<(), IrError> {
    if dim < t.rank() {
        Ok(())
    } else {
        Err(IrError::attr(
            op,
            attr,
            format!("dim {dim} is out of range for {t}"),
        ))
    }
}

fn divisible(
    op: &'static str,
    t: &TensorType,
    dim: usize,
    n: usize,
    axes: &[String],
) -> Result<(), IrError> {
    if t.dims()[dim].is_multiple_of(n) {
        Ok(())
    } else {
        Err(IrError::ty(
            op,
            format!(
                "dim {dim} of {t} does not split evenly over mesh axes {} ({n} devices)",
                axes.join(",")
            ),
        ))
    }
}

/// Size of the group spanned by `axes` (which must be non-empty and distinct).
fn mesh_group(
    op: &'static str,
    mesh: Option<&DeviceMesh>,
    axes: &[String],
) -> Result<usize, IrError> {
    let mesh = mesh.ok_or(IrError::NoMesh { op })?;
    if axes.is_empty() {
        return Err(IrError::attr(
            op,
            "axes",
            "must name at least one mesh axis",
        ));
    }
    if axes.iter().enumerate().any(|(i, a)| axes[..i].contains(a)) {
        return Err(IrError::attr(
            op,
            "axes",
            format!("{axes:?} names an axis twice"),
        ));
    }
    mesh.group_size(axes)
}

/// The result types of a fusion: its operands must have the body's parameter types, every
/// instruction must be one a body admits, read only earlier values and type-check, and the
/// results must name body values.
fn fusion_types(body: &FusionBody, inputs: &[&TensorType]) -> Result<Vec<TensorType>, IrError> {
    let name = "fusion";
    arity(name, inputs, body.params.len())?;
    for (i, (got, want)) in inputs.iter().zip(&body.params).enumerate() {
        if *got != want {
            return Err(IrError::ty(
                name,
                format!("operand {i} is {got} but the body's parameter ^{i} is {want}"),
            ));
        }
    }
    if body.results.is_empty() {
        return Err(IrError::ty(name, "the body returns no value"));
    }
    let mut types: Vec<TensorType> = body.params.clone();
    for (i, instr) in body.instrs.iter().enumerate() {
        let at = body.params.len() + i;
        if !FusionBody::admits(&instr.op) {
            return Err(IrError::ty(
                name,
                format!(
                    "^{at}: `{}` cannot be part of a fusion body",
                    instr.op.name()
                ),
            ));
        }
        let mut operands = Vec::with_capacity(instr.operands.len());
        for &v in &instr.operands {
            let t = types.get(v).filter(|_| v < at).ok_or_else(|| {
                IrError::ty(
                    name,
                    format!("^{at} reads ^{v}, which is not defined before it"),
                )
            })?;
            operands.push(t);
        }
        let mut out = infer(&instr.op, &operands, None)
            .map_err(|e| IrError::ty(name, format!("^{at}: {e}")))?;
        if out.len() != 1 {
            return Err(IrError::ty(name, format!("^{at} must give one value")));
        }
        types.push(out.remove(0));
    }
    body.results
        .iter()
        .map(|&r| {
            types.get(r).cloned().ok_or_else(|| {
                IrError::ty(
                    name,
                    format!("the body returns ^{r}, which it does not define"),
                )
            })
        })
        .collect()
}
