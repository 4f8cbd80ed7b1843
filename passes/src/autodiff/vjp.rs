//! The vector-Jacobian product of every op, written with IR ops.
//!
//! [`vjp`] receives a forward node, the gradients of its results (`None` where a result has
//! none) and which operands want a gradient, and emits the nodes computing those gradients.
//! Each rule's comment gives the formula; `g` is the incoming gradient, `x`/`a`/`b` the
//! operands and `y` the result.

use autopar_ir::{
    BinaryOp, CompareOp, DType, EinsumSpec, Node, NodeId, Op, Phase, ReduceOp, TensorType, UnaryOp,
    ValueId,
};

use super::{Emitter, saved_scope};
use crate::error::PassError;

/// `sqrt(2 / pi)`, as in the interpreter's GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation of GELU.
const GELU_CUBIC: f64 = 0.044_715;

/// True when gradients can flow through `op` (see [`vjp`] for the ops without a rule).
pub(super) fn has_rule(op: &Op) -> bool {
    match op {
        Op::Parameter { .. }
        | Op::Input { .. }
        | Op::Constant { .. }
        | Op::Einsum { .. }
        | Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Gather
        | Op::ScatterAdd { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Broadcast { .. }
        | Op::Rotary { .. }
        | Op::Attention { .. }
        | Op::MoeRoute { .. }
        | Op::CrossEntropy => true,
        Op::AttentionBackward { .. }
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. }
        // Fusions are made after the step is built and partitioned.
        | Op::Fusion { .. } => false,
    }
}

/// The gradients of `node`'s operands (one entry per operand; `None` where none is wanted or
/// the operand is not differentiable), given the gradients `out` of its results.
pub(super) fn vjp(
    e: &mut Emitter<'_>,
    id: NodeId,
    node: &Node,
    out: &[Option<ValueId>],
    wanted: &[bool],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let x = &node.inputs;
    let y = &node.outputs;
    let want = |i: usize| wanted.get(i).copied().unwrap_or(false);
    // Every single-result op reaching here has a gradient for that result.
    let g = out.first().copied().flatten();
    let no_rule = || PassError::NotDifferentiable {
        op: node.op.name(),
        node: id.to_string(),
        scope: node.scope.clone(),
    };
    let grad = |g: Option<ValueId>| g.ok_or_else(no_rule);
    match &node.op {
        // Sources have no operands.
        Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => Ok(Vec::new()),
        // `a,b->y`: `da = einsum(y,b->a)(g, b)`, `db = einsum(a,y->b)(a, g)`.
        Op::Einsum { spec } => {
            let g = grad(g)?;
            let da = if want(0) {
                let s = EinsumSpec {
                    lhs: spec.out.clone(),
                    rhs: spec.rhs.clone(),
                    out: spec.lhs.clone(),
                };
                Some(e.einsum_spec(s, g, x[1])?)
            } else {
                None
            };
            let db = if want(1) {
                let s = EinsumSpec {
                    lhs: spec.lhs.clone(),
                    rhs: spec.out.clone(),
                    out: spec.rhs.clone(),
                };
                Some(e.einsum_spec(s, x[0], g)?)
            } else {
                None
            };
            Ok(vec![da, db])
        }
        Op::Unary { func } => Ok(vec![Some(unary(e, *func, x[0], y[0], grad(g)?)?)]),
        Op::Binary { func } => {
            let (da, db) = binary(e, *func, [x[0], x[1]], y[0], grad(g)?, [want(0), want(1)])?;
            Ok(vec![da, db])
        }
        // Comparisons give `bool`: nothing flows back.
        Op::Compare { .. } => Ok(vec![None, None]),
        // `select(c, a, b)`: `da = select(c, g, 0)`, `db = select(c, 0, g)`; `c` is `bool`.
        Op::Select => {
            let g = grad(g)?;
            let da = want(1).then(|| e.keep_where(x[0], g)).transpose()?;
            let db = if want(2) {
                let zero = e.full_like(g, 0.0)?;
                Some(e.select(x[0], zero, g)?)
            } else {
                None
            };
            Ok(vec![None, da, db])
        }
        // Float to float: the gradient cast back; anything involving integers: none.
        Op::Cast { to } => {
            let from = e.ty(x[0]).dtype;
            if from.is_float() && to.is_float() {
                Ok(vec![Some(e.cast_if_needed(grad(g)?, from)?)])
            } else {
                Ok(vec![None])
            }
        }
        Op::Reduce { func, dims } => Ok(vec![Some(reduce(e, *func, dims, x[0], y[0], grad(g)?)?)]),
        // `dx = y * (g - sum(g * y, dim))`.
        Op::Softmax { dim } => {
            let g = grad(g)?;
            let shape = e.dims(y[0]);
            let gy = e.mul(g, y[0])?;
            let s = e.sum(gy, vec![*dim])?;
            let s = e.broadcast(s, &shape, (0..shape.len()).filter(|d| d != dim).collect())?;
            let d = e.sub(g, s)?;
            Ok(vec![Some(e.mul(y[0], d)?)])
        }
        Op::LayerNorm { eps } => norm_vjp(e, NormKind::Layer, *eps, x, grad(g)?, wanted),
        Op::RmsNorm { eps } => norm_vjp(e, NormKind::Rms, *eps, x, grad(g)?, wanted),
        // `dtable = scatter_add(ids, g)`; ids are integers.
        Op::Gather => {
            let num_rows = e.dims(x[0]).first().copied().unwrap_or(0);
            let dt = if want(0) {
                Some(e.op(Op::ScatterAdd { num_rows }, &[x[1], grad(g)?])?)
            } else {
                None
            };
            Ok(vec![dt, None])
        }
        // `dupdates = gather(g, ids)`.
        Op::ScatterAdd { .. } => {
            let du = if want(1) {
                Some(e.op(Op::Gather, &[grad(g)?, x[0]])?)
            } else {
                None
            };
            Ok(vec![None, du])
        }
        Op::Reshape { .. } => {
            let shape = e.dims(x[0]);
            Ok(vec![Some(e.reshape(grad(g)?, &shape)?)])
        }
        // The inverse permutation.
        Op::Transpose { perm } => {
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            Ok(vec![Some(e.transpose(grad(g)?, inverse)?)])
        }
        // Zeros around `g` along `dim`.
        Op::Slice { dim, start, end } => {
            let g = grad(g)?;
            let shape = e.dims(x[0]);
            let ty = e.ty(g);
            let mut parts = Vec::new();
            let zeros = |e: &mut Emitter<'_>, len: usize| {
                let mut dims = shape.clone();
                dims[*dim] = len;
                e.constant(TensorType::new(ty.dtype, dims), 0.0)
            };
            if *start > 0 {
                parts.push(zeros(e, *start)?);
            }
            parts.push(g);
            if *end < shape[*dim] {
                parts.push(zeros(e, shape[*dim] - end)?);
            }
            Ok(vec![Some(e.concat(&parts, *dim)?)])
        }
        // Each operand's range of `g`.
        Op::Concat { dim } => {
            let g = grad(g)?;
            let mut offset = 0;
            let mut grads = Vec::with_capacity(x.len());
            for (i, &v) in x.iter().enumerate() {
                let len = e.dims(v)[*dim];
                grads.push(if want(i) {
                    Some(e.slice(g, *dim, offset, offset + len)?)
                } else {
                    None
                });
                offset += len;
            }
            Ok(grads)
        }
        // Sum over the new and the expanded dims, then restore the operand's shape.
        Op::Broadcast { shape, dims } => {
            let g = grad(g)?;
            let from = e.dims(x[0]);
            let summed: Vec<usize> = (0..shape.rank())
                .filter(|d| match dims.iter().position(|k| k == d) {
                    None => true,
                    Some(i) => from[i] == 1 && shape.dims()[*d] != 1,
                })
                .collect();
            let s = e.sum(g, summed)?;
            Ok(vec![Some(e.reshape(s, &from)?)])
        }
        // A rotation is orthogonal, so its transpose is the rotation by the opposite angle:
        // `R(-theta) = P R(theta) P` with `P` negating the second half of the last dim.
        Op::Rotary { base } => {
            let g = grad(g)?;
            let flipped = negate_second_half(e, g)?;
            let mut operands = vec![flipped];
            operands.extend(x.get(1).copied());
            let rotated = e.op(Op::Rotary { base: *base }, &operands)?;
            let dx = negate_second_half(e, rotated)?;
            let mut grads = vec![Some(dx)];
            if x.len() > 1 {
                grads.push(None);
            }
            Ok(grads)
        }
        // With explicit positions (the context-parallel layout), one fused op that
        // recomputes the probabilities from `q`, `k` and the result, so that a sequence split
        // can run it as a ring; without, the decomposition below (whose `saved/` probabilities
        // selective recompute works on).
        Op::Attention { causal, scale } if x.len() == 5 => {
            let fused = Op::AttentionBackward {
                causal: *causal,
                scale: *scale,
            };
            let grads = e.node(fused, &[x[0], x[1], x[2], y[0], grad(g)?, x[3], x[4]])?;
            let mut out: Vec<Option<ValueId>> = grads
                .into_iter()
                .enumerate()
                .map(|(i, d)| want(i).then_some(d))
                .collect();
            out.resize(x.len(), None);
            Ok(out)
        }
        Op::Attention { causal, scale } => {
            let saved = saved_scope(node.scope.as_deref());
            attention(
                e,
                saved,
                [x[0], x[1], x[2]],
                *causal,
                *scale,
                grad(g)?,
                wanted,
            )
        }
        Op::MoeRoute {
            top_k, normalize, ..
        } => {
            // Only the combine weights carry a gradient; the dispatch mask is piecewise constant.
            match out.first().copied().flatten() {
                Some(g) => Ok(vec![Some(moe_route(e, *top_k, *normalize, x[0], y[1], g)?)]),
                None => Ok(vec![None]),
            }
        }
        // `dlogits = (softmax(logits) - onehot(targets)) * g`.
        Op::CrossEntropy => {
            let g = grad(g)?;
            let dl = if want(0) {
                Some(cross_entropy(e, x[0], x[1], g)?)
            } else {
                None
            };
            Ok(vec![dl, None])
        }
        Op::AttentionBackward { .. }
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. }
        | Op::Fusion { .. } => Err(no_rule()),
    }
}

/// `dx` of `y = func(x)`.
fn unary(
    e: &mut Emitter<'_>,
    func: UnaryOp,
    x: ValueId,
    y: ValueId,
    g: ValueId,
) -> Result<ValueId, PassError> {
    match func {
        UnaryOp::Neg => e.neg(g),
        // `g * sign(x)`, with sign(0) = 0.
        UnaryOp::Abs => {
            let zero = e.full_like(x, 0.0)?;
            let pos = e.compare(CompareOp::Gt, x, zero)?;
            let neg = e.compare(CompareOp::Lt, x, zero)?;
            let minus_g = e.neg(g)?;
            let zero_g = e.full_like(g, 0.0)?;
            let inner = e.select(neg, minus_g, zero_g)?;
            e.select(pos, g, inner)
        }
        UnaryOp::Exp => e.mul(g, y),
        UnaryOp::Log => e.div(g, x),
        // `g / (2 y)`.
        UnaryOp::Sqrt => {
            let two_y = e.scale(y, 2.0)?;
            e.div(g, two_y)
        }
        // `-g y^3 / 2`.
        UnaryOp::Rsqrt => {
            let y2 = e.mul(y, y)?;
            let y3 = e.mul(y2, y)?;
            let d = e.scale(y3, -0.5)?;
            e.mul(g, d)
        }
        // `-g y^2`.
        UnaryOp::Recip => {
            let y2 = e.mul(y, y)?;
            let gy2 = e.mul(g, y2)?;
            e.neg(gy2)
        }
        UnaryOp::Square => {
            let two_x = e.scale(x, 2.0)?;
            e.mul(g, two_x)
        }
        // `g (1 - y^2)`.
        UnaryOp::Tanh => {
            let y2 = e.mul(y, y)?;
            let d = e.rsub(1.0, y2)?;
            e.mul(g, d)
        }
        // `g y (1 - y)`.
        UnaryOp::Sigmoid => {
            let one_minus = e.rsub(1.0, y)?;
            let d = e.mul(y, one_minus)?;
            e.mul(g, d)
        }
        UnaryOp::Relu => {
            let zero = e.full_like(x, 0.0)?;
            let pos = e.compare(CompareOp::Gt, x, zero)?;
            e.keep_where(pos, g)
        }
        // One op for the derivative (see `UnaryOp::GeluGrad`).
        UnaryOp::Gelu => {
            let d = e.unary(UnaryOp::GeluGrad, x)?;
            e.mul(g, d)
        }
        // GELU's second derivative. With `u = c (x + k x^3)`, `t = tanh u`,
        // `u' = c (1 + 3 k x^2)`, `t' = (1 - t^2) u'` and `t'' = (1 - t^2) (6 c k x) - 2 t t' u'`:
        // `gelu'' = t' + x t'' / 2`.
        UnaryOp::GeluGrad => {
            let x2 = e.mul(x, x)?;
            let x3 = e.mul(x2, x)?;
            let kx3 = e.scale(x3, GELU_CUBIC)?;
            let inner = e.add(x, kx3)?;
            let u = e.scale(inner, SQRT_2_OVER_PI)?;
            let t = e.unary(UnaryOp::Tanh, u)?;
            let t2 = e.mul(t, t)?;
            let sech2 = e.rsub(1.0, t2)?;
            let du = e.scale(x2, 3.0 * GELU_CUBIC * SQRT_2_OVER_PI)?;
            let c = e.full_like(du, SQRT_2_OVER_PI)?;
            let du = e.add(du, c)?;
            let dt = e.mul(sech2, du)?;
            let ddu = e.scale(x, 6.0 * GELU_CUBIC * SQRT_2_OVER_PI)?;
            let curve = e.mul(sech2, ddu)?;
            let tdt = e.mul(t, dt)?;
            let tdtdu = e.mul(tdt, du)?;
            let bend = e.scale(tdtdu, 2.0)?;
            let ddt = e.sub(curve, bend)?;
            let half_x = e.scale(x, 0.5)?;
            let right = e.mul(half_x, ddt)?;
            let d = e.add(dt, right)?;
            e.mul(g, d)
        }
        // `d sin x = cos x`, `d cos x = -sin x`.
        UnaryOp::Sin => {
            let d = e.unary(UnaryOp::Cos, x)?;
            e.mul(g, d)
        }
        UnaryOp::Cos => {
            let s = e.unary(UnaryOp::Sin, x)?;
            let d = e.neg(s)?;
            e.mul(g, d)
        }
        // `d = 2 / sqrt(pi) e^(-x^2)`.
        UnaryOp::Erf => {
            let x2 = e.mul(x, x)?;
            let minus_x2 = e.neg(x2)?;
            let ex = e.unary(UnaryOp::Exp, minus_x2)?;
            let d = e.scale(ex, std::f64::consts::FRAC_2_SQRT_PI)?;
            e.mul(g, d)
        }
        // `d = Phi(x) + x phi(x)`, with `Phi(x) = (1 + erf(x / sqrt 2)) / 2` and
        // `phi(x) = e^(-x^2 / 2) / sqrt(2 pi)`.
        UnaryOp::GeluErf => {
            let u = e.scale(x, std::f64::consts::FRAC_1_SQRT_2)?;
            let erf = e.unary(UnaryOp::Erf, u)?;
            let one = e.full_like(erf, 1.0)?;
            let cdf = e.add(one, erf)?;
            let cdf = e.scale(cdf, 0.5)?;
            let x2 = e.mul(x, x)?;
            let h = e.scale(x2, -0.5)?;
            let ex = e.unary(UnaryOp::Exp, h)?;
            let pdf = e.scale(ex, 1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
            let x_pdf = e.mul(x, pdf)?;
            let d = e.add(cdf, x_pdf)?;
            e.mul(g, d)
        }
        // With `s = sigmoid(x)`: `d = s (1 + x (1 - s))`.
        UnaryOp::Silu => {
            let s = e.unary(UnaryOp::Sigmoid, x)?;
            let one_minus = e.rsub(1.0, s)?;
            let xs = e.mul(x, one_minus)?;
            let one = e.full_like(xs, 1.0)?;
            let inner = e.add(one, xs)?;
            let d = e.mul(s, inner)?;
            e.mul(g, d)
        }
    }
}

/// `(da, db)` of `y = func(a, b)`, computing only the wanted ones.
fn binary(
    e: &mut Emitter<'_>,
    func: BinaryOp,
    [a, b]: [ValueId; 2],
    y: ValueId,
    g: ValueId,
    [want_a, want_b]: [bool; 2],
) -> Result<(Option<ValueId>, Option<ValueId>), PassError> {
    let (da, db) = match func {
        BinaryOp::Add => (want_a.then_some(g), want_b.then_some(g)),
        BinaryOp::Sub => (want_a.then_some(g), want_b.then(|| e.neg(g)).transpose()?),
        BinaryOp::Mul => (
            want_a.then(|| e.mul(g, b)).transpose()?,
            want_b.then(|| e.mul(g, a)).transpose()?,
        ),
        // `da = g / b`, `db = -g y / b`.
        BinaryOp::Div => {
            let da = want_a.then(|| e.div(g, b)).transpose()?;
            let db = if want_b {
                let gy = e.mul(g, y)?;
                let q = e.div(gy, b)?;
                Some(e.neg(q)?)
            } else {
                None
            };
            (da, db)
        }
        // The kernels return `b` at ties, so `b` gets the gradient there.
        BinaryOp::Max | BinaryOp::Min => {
            let cmp = if func == BinaryOp::Max {
                CompareOp::Gt
            } else {
                CompareOp::Lt
            };
            let a_wins = e.compare(cmp, a, b)?;
            let da = want_a.then(|| e.keep_where(a_wins, g)).transpose()?;
            let db = if want_b {
                let zero = e.full_like(g, 0.0)?;
                Some(e.select(a_wins, zero, g)?)
            } else {
                None
            };
            (da, db)
        }
        // `da = g b a^(b-1)`; `db = g y ln(a)` where `a > 0`, else 0.
        BinaryOp::Pow => {
            let da = if want_a {
                let one = e.full_like(b, 1.0)?;
                let bm1 = e.sub(b, one)?;
                let p = e.binary(BinaryOp::Pow, a, bm1)?;
                let bp = e.mul(b, p)?;
                Some(e.mul(g, bp)?)
            } else {
                None
            };
            let db = if want_b {
                let zero = e.full_like(a, 0.0)?;
                let pos = e.compare(CompareOp::Gt, a, zero)?;
                let ln = e.unary(UnaryOp::Log, a)?;
                let gy = e.mul(g, y)?;
                let d = e.mul(gy, ln)?;
                Some(e.keep_where(pos, d)?)
            } else {
                None
            };
            (da, db)
        }
    };
    Ok((da, db))
}

/// `dx` of `y = reduce(x, dims)`.
fn reduce(
    e: &mut Emitter<'_>,
    func: ReduceOp,
    dims: &[usize],
    x: ValueId,
    y: ValueId,
    g: ValueId,
) -> Result<ValueId, PassError> {
    let shape = e.dims(x);
    let kept: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
    let gb = e.broadcast(g, &shape, kept.clone())?;
    match func {
        ReduceOp::Sum => Ok(gb),
        ReduceOp::Mean => {
            let n: usize = dims.iter().map(|&d| shape[d]).product();
            e.scale(gb, 1.0 / n.max(1) as f64)
        }
        // Every element equal to the extreme gets the gradient.
        ReduceOp::Max | ReduceOp::Min => {
            let yb = e.broadcast(y, &shape, kept)?;
            let hit = e.compare(CompareOp::Eq, x, yb)?;
            e.keep_where(hit, gb)
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum NormKind {
    Layer,
    Rms,
}

/// Layer norm (`x, gamma, beta`) and RMS norm (`x, gamma`) over the last dim. With
/// `xhat` the normalised input, `r` the reciprocal standard deviation and
/// `dxhat = g * gamma`:
/// - layer norm: `dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`;
/// - RMS norm: `dx = r (dxhat - xhat mean(dxhat xhat))`;
/// - `dgamma = sum(g xhat)`, `dbeta = sum(g)` over the leading dims.
fn norm_vjp(
    e: &mut Emitter<'_>,
    kind: NormKind,
    eps: f64,
    x: &[ValueId],
    g: ValueId,
    wanted: &[bool],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let want = |i: usize| wanted.get(i).copied().unwrap_or(false);
    let shape = e.dims(x[0]);
    let last = shape.len() - 1;
    let leading: Vec<usize> = (0..last).collect();
    // Recompute the statistics from the stored input.
    let centred = match kind {
        NormKind::Layer => {
            let mean = e.reduce_last_keep(ReduceOp::Mean, x[0])?;
            e.sub(x[0], mean)?
        }
        NormKind::Rms => x[0],
    };
    let sq = e.mul(centred, centred)?;
    let var = e.reduce_last_keep(ReduceOp::Mean, sq)?;
    let eps_c = e.full_like(var, eps)?;
    let var_eps = e.add(var, eps_c)?;
    let r = e.unary(UnaryOp::Rsqrt, var_eps)?;
    let xhat = e.mul(centred, r)?;

    let dx = if want(0) {
        let gamma = e.broadcast(x[1], &shape, vec![last])?;
        let dxhat = e.mul(g, gamma)?;
        let prod = e.mul(dxhat, xhat)?;
        let m2 = e.reduce_last_keep(ReduceOp::Mean, prod)?;
        let proj = e.mul(xhat, m2)?;
        let mut inner = e.sub(dxhat, proj)?;
        if kind == NormKind::Layer {
            let m1 = e.reduce_last_keep(ReduceOp::Mean, dxhat)?;
            inner = e.sub(inner, m1)?;
        }
        Some(e.mul(r, inner)?)
    } else {
        None
    };
    let dgamma = if want(1) {
        let gx = e.mul(g, xhat)?;
        Some(e.sum(gx, leading.clone())?)
    } else {
        None
    };
    let mut grads = vec![dx, dgamma];
    if kind == NormKind::Layer {
        grads.push(want(2).then(|| e.sum(g, leading)).transpose()?);
    }
    Ok(grads)
}

/// `v` with the second half of its last dim negated.
fn negate_second_half(e: &mut Emitter<'_>, v: ValueId) -> Result<ValueId, PassError> {
    let dims = e.dims(v);
    let last = dims.len() - 1;
    let d = dims[last];
    let lo = e.slice(v, last, 0, d / 2)?;
    let hi = e.slice(v, last, d / 2, d)?;
    let hi = e.neg(hi)?;
    e.concat(&[lo, hi], last)
}

/// Attention `o = softmax(scale q k^T + mask) v` with grouped heads. The probabilities `p`
/// are computed from `q` and `k` under the `saved/` tag (see the module docs of
/// [`crate::autodiff`]); then, with `g5` the incoming gradient split by kv head:
/// `dv = p^T g`, `dp = g v^T`, `ds = p (dp - sum(dp p)) scale`, `dq = ds k`, `dk = ds^T q`.
fn attention(
    e: &mut Emitter<'_>,
    saved: String,
    [q, k, v]: [ValueId; 3],
    causal: bool,
    scale: f64,
    g: ValueId,
    wanted: &[bool],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let want = |i: usize| wanted.get(i).copied().unwrap_or(false);
    let (qd, vd) = (e.dims(q), e.dims(v));
    let (b, s, hq, d) = (qd[0], qd[1], qd[2], qd[3]);
    let (t, hkv, dv) = (vd[1], vd[2], vd[3]);
    let group = hq / hkv;

    // The probabilities, from forward values only.
    let grad_scope = e.scope().map(str::to_string);
    let grad_meta = e.meta();
    e.set_scope(Some(saved));
    e.set_meta(grad_meta.with_phase(Phase::Saved));
    let q5 = e.reshape(q, &[b, s, hkv, group, d])?;
    let scores = e.einsum("bskgd,btkd->bkgst", q5, k)?;
    let mut logits = e.scale(scores, scale)?;
    if causal {
        let score_dims = e.dims(logits);
        let rows = e.iota(s, DType::I64)?;
        let cols = e.iota(t, DType::I64)?;
        let rows = e.broadcast(rows, &[s, t], vec![0])?;
        let cols = e.broadcast(cols, &[s, t], vec![1])?;
        let future = e.compare(CompareOp::Gt, cols, rows)?;
        let mask = e.broadcast(future, &score_dims, vec![3, 4])?;
        let neg_inf = e.full_like(logits, f64::NEG_INFINITY)?;
        logits = e.select(mask, neg_inf, logits)?;
    }
    let p = e.op(Op::Softmax { dim: 4 }, &[logits])?;
    e.set_scope(grad_scope);
    e.set_meta(grad_meta);

    let g5 = e.reshape(g, &[b, s, hkv, group, dv])?;
    let dv_ = want(2)
        .then(|| e.einsum("bkgst,bskge->btke", p, g5))
        .transpose()?;
    let (dq, dk) = if want(0) || want(1) {
        let dp = e.einsum("bskge,btke->bkgst", g5, v)?;
        let dpp = e.mul(dp, p)?;
        let shape = e.dims(p);
        let rows = e.sum(dpp, vec![4])?;
        let rows = e.broadcast(rows, &shape, vec![0, 1, 2, 3])?;
        let centred = e.sub(dp, rows)?;
        let ds = e.mul(p, centred)?;
        let ds = e.scale(ds, scale)?;
        let dq = if want(0) {
            let dq5 = e.einsum("bkgst,btkd->bskgd", ds, k)?;
            Some(e.reshape(dq5, &[b, s, hq, d])?)
        } else {
            None
        };
        let dk = if want(1) {
            let q5 = e.reshape(q, &[b, s, hkv, group, d])?;
            Some(e.einsum("bkgst,bskgd->btkd", ds, q5)?)
        } else {
            None
        };
        (dq, dk)
    } else {
        (None, None)
    };
    Ok(vec![dq, dk, dv_])
}

/// `dprobs` of `moe_route`'s combine weights, the routing decisions held fixed. With `G` the
/// gradient of each token's gate (`g` summed over the slots its dispatch mask selects):
/// without normalisation `dp = G`; with it, the gates are `p / S` for `S` the sum of the
/// token's top-k probabilities, so `dp = G / S - chosen * sum(G p) / S^2`, where `chosen`
/// marks the top-k experts (including choices dropped for capacity, which still count in `S`).
/// Leading (routing group) dims ride along: each token's terms involve only its own row.
fn moe_route(
    e: &mut Emitter<'_>,
    top_k: usize,
    normalize: bool,
    probs: ValueId,
    dispatch: ValueId,
    g: ValueId,
) -> Result<ValueId, PassError> {
    let pd = e.dims(probs);
    let r = pd.len();
    let experts = pd[r - 1];
    let dtype = e.ty(probs).dtype;
    let gd = e.mul(g, dispatch)?;
    let gate_grad = e.sum(gd, vec![r])?;
    if !normalize {
        return Ok(gate_grad);
    }
    // Expert `f` ranks before `e` when its probability is higher, or equal with `f < e` (the
    // kernel's stable sort); `e` is chosen when fewer than `top_k` experts rank before it.
    let mut cube = pd.clone();
    cube.push(experts);
    let lead: Vec<usize> = (0..r - 1).collect();
    let mut e_dims = lead.clone();
    e_dims.push(r - 1);
    let mut f_dims = lead.clone();
    f_dims.push(r);
    let p_e = e.broadcast(probs, &cube, e_dims)?;
    let p_f = e.broadcast(probs, &cube, f_dims)?;
    let higher = e.compare(CompareOp::Gt, p_f, p_e)?;
    let equal = e.compare(CompareOp::Eq, p_f, p_e)?;
    let idx = e.iota(experts, DType::I64)?;
    let idx_e = e.broadcast(idx, &[experts, experts], vec![0])?;
    let idx_f = e.broadcast(idx, &[experts, experts], vec![1])?;
    let lower = e.compare(CompareOp::Lt, idx_f, idx_e)?;
    let lower = e.broadcast(lower, &cube, vec![r - 1, r])?;
    let no = e.constant(TensorType::new(DType::Bool, cube.clone()), 0.0)?;
    let tie_first = e.select(equal, lower, no)?;
    let yes = e.full_like(no, 1.0)?;
    let ahead = e.select(higher, yes, tie_first)?;
    let ahead = e.cast(ahead, dtype)?;
    let rank = e.sum(ahead, vec![r])?;
    let k = e.full_like(rank, top_k as f64)?;
    let chosen = e.compare(CompareOp::Lt, rank, k)?;

    let chosen_p = e.keep_where(chosen, probs)?;
    let total = e.sum(chosen_p, vec![r - 1])?;
    let total = e.broadcast(total, &pd, lead.clone())?;
    let direct = e.div(gate_grad, total)?;
    let gp = e.mul(gate_grad, probs)?;
    let dot = e.sum(gp, vec![r - 1])?;
    let dot = e.broadcast(dot, &pd, lead)?;
    let total2 = e.mul(total, total)?;
    let through_sum = e.div(dot, total2)?;
    let through_sum = e.keep_where(chosen, through_sum)?;
    e.sub(direct, through_sum)
}

/// `dlogits = (softmax(logits) - onehot(targets)) * g` over the last (vocabulary) dim.
fn cross_entropy(
    e: &mut Emitter<'_>,
    logits: ValueId,
    targets: ValueId,
    g: ValueId,
) -> Result<ValueId, PassError> {
    let shape = e.dims(logits);
    let last = shape.len() - 1;
    let dtype = e.ty(logits).dtype;
    let ids = e.iota(shape[last], e.ty(targets).dtype)?;
    let ids = e.broadcast(ids, &shape, vec![last])?;
    let targets = e.broadcast(targets, &shape, (0..last).collect())?;
    let hit = e.compare(CompareOp::Eq, targets, ids)?;
    let onehot = e.cast(hit, dtype)?;
    let probs = e.op(Op::Softmax { dim: last }, &[logits])?;
    let diff = e.sub(probs, onehot)?;
    let g = e.cast_if_needed(g, dtype)?;
    let g = e.broadcast(g, &shape, (0..last).collect())?;
    e.mul(diff, g)
}
