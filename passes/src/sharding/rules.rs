//! The strategy table: for every op, the placements along one mesh axis under which local
//! kernels compute the global result.
//!
//! Notation in the docs below: `R` replicate, `S(d)` shard on dim `d`, `P` partial sum,
//! `Pmax`/`Pmin` partial max/min. Every op (but communication) also has the all-`R`
//! strategy, in which each device computes the whole result.
//!
//! Partial values pass through maps that commute with their reduction: linear maps for `P`
//! (`-x`, `x + y` when both are partial, `x * r`, `x / r`, einsum with the other side
//! replicated, reshapes and other moves of elements, float casts), non-decreasing maps for
//! `Pmax`/`Pmin` (`exp`, `relu`, `x + r`, `max(x, r)`), and decreasing ones swap them (`-x`).
//! Sums of floats are exact only up to rounding, as in any data-parallel reduction.
//!
//! `moe_route` splits only on its leading (routing group) dims: each group has capacity of
//! its own, so a device routes its groups exactly as the whole op would; within a group a
//! token's capacity slot depends on every earlier token and its top-k on every expert, so
//! neither the token nor the expert dim splits (expert parallelism routes per group, then
//! moves the dispatched tokens to their experts' devices by all-to-all).
//!
//! Ops deliberately without a sharded strategy: softmax and the norms on their normalised dim,
//! attention on the key sequence alone or on the head dim `d` (the softmax mixes them; the key
//! sequence is split only together with the queries, by ring attention), causal attention on
//! the sequences without the positions operands (the mask needs the global positions), rotary on `head_dim`
//! (rotate-half pairs `i` with `i + d/2`) and on the sequence without explicit positions.

use autopar_ir::infer::infer;
use autopar_ir::sharding_algebra::reshape_sharding;
use autopar_ir::{
    BinaryOp, DType, DeviceMesh, Op, Placement, ReduceKind, ReduceOp, Sharding, TensorType, UnaryOp,
};

use super::error::ShardingError;
use super::strategy::{LocalKernel, Lowering, Strategy};

const R: Placement = Placement::Replicate;
const P: Placement = Placement::Partial(ReduceKind::Sum);
const PMAX: Placement = Placement::Partial(ReduceKind::Max);
const PMIN: Placement = Placement::Partial(ReduceKind::Min);

fn s(d: usize) -> Placement {
    Placement::Shard(d)
}

fn same(operands: Vec<Placement>, results: Vec<Placement>) -> Strategy {
    Strategy {
        operands,
        results,
        kernel: LocalKernel::Same,
    }
}

fn lowered(operands: Vec<Placement>, results: Vec<Placement>, l: Lowering) -> Strategy {
    Strategy {
        operands,
        results,
        kernel: LocalKernel::Lowered(l),
    }
}

/// The strategies of `op` on operands of types `operands` along a mesh axis of `axis_size`
/// devices, all-`R` first, then in a fixed order.
///
/// Only strategies whose sharded dims split evenly over `axis_size` are listed, and none puts
/// a `bool` value in a partial placement. Communication ops are an error
/// ([`ShardingError::Communication`]); an op that does not type-check on `operands` is an
/// [`ShardingError::Ir`].
///
/// ```
/// # use autopar_ir::{DType, Op, Placement, ReduceKind, TensorType};
/// # use autopar_passes::sharding::{strategies, Strategy};
/// let x = TensorType::new(DType::F32, [8, 16]);
/// let w = TensorType::new(DType::F32, [16, 32]);
/// let op = Op::Einsum { spec: "bh,hf->bf".parse().unwrap() };
/// let list: Vec<String> = strategies(&op, &[&x, &w], 2).unwrap().iter().map(Strategy::to_string).collect();
/// // Data parallel, row parallel (K split: partial sums), column parallel, partial pass-through.
/// assert!(list.contains(&"S(0), R -> S(0)".to_string()));
/// assert!(list.contains(&"S(1), S(0) -> P(sum)".to_string()));
/// assert!(list.contains(&"R, S(1) -> S(1)".to_string()));
/// assert!(list.contains(&"P(sum), R -> P(sum)".to_string()));
/// ```
pub fn strategies(
    op: &Op,
    operands: &[&TensorType],
    axis_size: usize,
) -> Result<Vec<Strategy>, ShardingError> {
    if op.is_communication() {
        return Err(ShardingError::Communication { op: op.name() });
    }
    let results = infer(op, operands, None)?;
    let candidates = candidates(op, operands, &results, axis_size)?;
    let mut out: Vec<Strategy> = Vec::new();
    for c in candidates {
        let fits = |ps: &[Placement], tys: &[TensorType]| {
            ps.len() == tys.len()
                && ps.iter().zip(tys).all(|(p, t)| match p {
                    Placement::Shard(d) => t
                        .dims()
                        .get(*d)
                        .is_some_and(|&n| n.is_multiple_of(axis_size)),
                    Placement::Partial(_) => t.dtype != DType::Bool,
                    Placement::Replicate => true,
                })
        };
        let operand_tys: Vec<TensorType> = operands.iter().map(|&t| t.clone()).collect();
        if fits(&c.operands, &operand_tys) && fits(&c.results, &results) && !out.contains(&c) {
            out.push(c);
        }
    }
    Ok(out)
}

/// Every strategy of the table for `op`, before the divisibility and dtype filter.
fn candidates(
    op: &Op,
    t: &[&TensorType],
    results: &[TensorType],
    axis_size: usize,
) -> Result<Vec<Strategy>, ShardingError> {
    let n_ops = t.len();
    let n_res = results.len();
    let mut v = vec![same(vec![R; n_ops], vec![R; n_res])];
    // Every operand and result sharded on the same dim `d` (elementwise ops).
    let all_shard = |v: &mut Vec<Strategy>, rank: usize| {
        for d in 0..rank {
            v.push(same(vec![s(d); n_ops], vec![s(d); n_res]));
        }
    };
    match op {
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => return Err(ShardingError::Communication { op: op.name() }),
        Op::Fusion { .. } => return Err(ShardingError::Fusion),
        // Sources: each device creates its own shard (the runtime draws parameters and feeds
        // inputs per shard; a constant's shard is a smaller constant).
        Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => {
            all_shard(&mut v, results[0].rank());
        }
        // Every label can be split: batch labels on all sides, a free label on its operand and
        // the result, a contracting label on both operands with partial sums as the result.
        Op::Einsum { spec } => {
            let mut labels: Vec<char> = spec.lhs.clone();
            labels.extend(spec.rhs.iter().filter(|c| !spec.lhs.contains(c)));
            for c in labels {
                let pos = |side: &[char]| side.iter().position(|&x| x == c);
                let side = |i: Option<usize>| i.map_or(R, s);
                let result = pos(&spec.out).map_or(P, s);
                v.push(same(
                    vec![side(pos(&spec.lhs)), side(pos(&spec.rhs))],
                    vec![result],
                ));
            }
            v.push(same(vec![P, R], vec![P]));
            v.push(same(vec![R, P], vec![P]));
        }
        Op::Unary { func } => {
            all_shard(&mut v, t[0].rank());
            let monotone = |v: &mut Vec<Strategy>| {
                v.push(same(vec![PMAX], vec![PMAX]));
                v.push(same(vec![PMIN], vec![PMIN]));
            };
            match func {
                UnaryOp::Neg => {
                    v.push(same(vec![P], vec![P]));
                    v.push(same(vec![PMAX], vec![PMIN]));
                    v.push(same(vec![PMIN], vec![PMAX]));
                }
                UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Relu | UnaryOp::Erf => {
                    monotone(&mut v)
                }
                // Not monotone over all reals (or undefined on part of them): no partials.
                UnaryOp::Abs
                | UnaryOp::Log
                | UnaryOp::Sqrt
                | UnaryOp::Rsqrt
                | UnaryOp::Recip
                | UnaryOp::Square
                | UnaryOp::Gelu
                | UnaryOp::GeluGrad
                | UnaryOp::GeluErf
                | UnaryOp::Silu
                | UnaryOp::Sin
                | UnaryOp::Cos => {}
            }
        }
        Op::Binary { func } => {
            all_shard(&mut v, t[0].rank());
            let float = t[0].dtype.is_float();
            let mut pairs: Vec<([Placement; 2], Placement)> = Vec::new();
            match func {
                BinaryOp::Add => pairs.extend([
                    ([P, P], P),
                    ([PMAX, R], PMAX),
                    ([R, PMAX], PMAX),
                    ([PMIN, R], PMIN),
                    ([R, PMIN], PMIN),
                ]),
                BinaryOp::Sub => pairs.extend([
                    ([P, P], P),
                    ([PMAX, R], PMAX),
                    ([PMIN, R], PMIN),
                    ([R, PMAX], PMIN),
                    ([R, PMIN], PMAX),
                ]),
                BinaryOp::Mul => pairs.extend([([P, R], P), ([R, P], P)]),
                // Integer division truncates: not linear.
                BinaryOp::Div if float => pairs.push(([P, R], P)),
                BinaryOp::Div => {}
                BinaryOp::Max => {
                    pairs.extend([([PMAX, PMAX], PMAX), ([PMAX, R], PMAX), ([R, PMAX], PMAX)])
                }
                BinaryOp::Min => {
                    pairs.extend([([PMIN, PMIN], PMIN), ([PMIN, R], PMIN), ([R, PMIN], PMIN)])
                }
                BinaryOp::Pow => {}
            }
            v.extend(
                pairs
                    .into_iter()
                    .map(|(ops, r)| same(ops.to_vec(), vec![r])),
            );
        }
        Op::Compare { .. } => all_shard(&mut v, t[0].rank()),
        Op::Select => {
            all_shard(&mut v, t[0].rank());
            for k in [P, PMAX, PMIN] {
                v.push(same(vec![R, k, k], vec![k]));
            }
        }
        Op::Cast { to } => {
            all_shard(&mut v, t[0].rank());
            if t[0].dtype.is_float() && to.is_float() {
                for k in [P, PMAX, PMIN] {
                    v.push(same(vec![k], vec![k]));
                }
            }
        }
        // A kept dim stays sharded (renumbered); a reduced one leaves partial results.
        Op::Reduce { func, dims } => {
            for d in 0..t[0].rank() {
                if dims.contains(&d) {
                    v.push(match func {
                        ReduceOp::Sum => same(vec![s(d)], vec![P]),
                        ReduceOp::Max => same(vec![s(d)], vec![PMAX]),
                        ReduceOp::Min => same(vec![s(d)], vec![PMIN]),
                        ReduceOp::Mean => lowered(vec![s(d)], vec![P], Lowering::PartialMean),
                    });
                } else {
                    let before = dims.iter().filter(|&&r| r < d).count();
                    v.push(same(vec![s(d)], vec![s(d - before)]));
                }
            }
            let k = match func {
                ReduceOp::Sum | ReduceOp::Mean => P,
                ReduceOp::Max => PMAX,
                ReduceOp::Min => PMIN,
            };
            v.push(same(vec![k], vec![k]));
        }
        Op::Softmax { dim } => {
            for d in (0..t[0].rank()).filter(|d| d != dim) {
                v.push(same(vec![s(d)], vec![s(d)]));
            }
        }
        // Normalised over the last dim; scale and shift stay whole.
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            for d in 0..t[0].rank().saturating_sub(1) {
                let mut ops = vec![R; n_ops];
                ops[0] = s(d);
                v.push(same(ops, vec![s(d)]));
            }
        }
        Op::Gather => {
            let (table_rank, ids_rank) = (t[0].rank(), t[1].rank());
            for k in 0..ids_rank {
                v.push(same(vec![R, s(k)], vec![s(k)]));
            }
            for d in 1..table_rank {
                v.push(same(vec![s(d), R], vec![s(ids_rank + d - 1)]));
            }
            v.push(lowered(
                vec![s(0), R],
                vec![P],
                Lowering::VocabParallelGather,
            ));
            for k in [P, PMAX, PMIN] {
                v.push(same(vec![k, R], vec![k]));
            }
        }
        Op::ScatterAdd { .. } => {
            let (ids_rank, upd_rank) = (t[0].rank(), t[1].rank());
            for k in 0..ids_rank {
                v.push(same(vec![s(k), s(k)], vec![P]));
            }
            for d in ids_rank..upd_rank {
                v.push(same(vec![R, s(d)], vec![s(d - ids_rank + 1)]));
            }
            v.push(same(vec![R, P], vec![P]));
            v.push(lowered(
                vec![R, R],
                vec![s(0)],
                Lowering::RowParallelScatterAdd,
            ));
        }
        Op::Reshape { shape } => {
            let mesh = DeviceMesh::new([("axis", axis_size)])?;
            for d in 0..t[0].rank() {
                let one = Sharding::user([("axis".to_string(), s(d))]);
                if t[0].dims()[d].is_multiple_of(axis_size)
                    && let Some(r) = reshape_sharding(&one, t[0].dims(), shape.dims(), &mesh)?
                    && let Some(p @ Placement::Shard(_)) = r.get("axis")
                {
                    v.push(same(vec![s(d)], vec![p]));
                }
            }
            for k in [P, PMAX, PMIN] {
                v.push(same(vec![k], vec![k]));
            }
        }
        Op::Transpose { perm } => {
            for (i, &d) in perm.iter().enumerate() {
                v.push(same(vec![s(d)], vec![s(i)]));
            }
            for k in [P, PMAX, PMIN] {
                v.push(same(vec![k], vec![k]));
            }
        }
        Op::Slice { dim, .. } | Op::Concat { dim } => {
            for d in (0..t[0].rank()).filter(|d| d != dim) {
                v.push(same(vec![s(d); n_ops], vec![s(d)]));
            }
            for k in [P, PMAX, PMIN] {
                v.push(same(vec![k; n_ops], vec![k]));
            }
        }
        Op::Broadcast { shape, dims } => {
            for (i, &d) in dims.iter().enumerate() {
                if t[0].dims()[i] == shape.dims()[d] {
                    v.push(same(vec![s(i)], vec![s(d)]));
                }
            }
            // A replicated operand can produce just this device's part of a new or expanded
            // dim: the local broadcast is smaller.
            for e in 0..shape.rank() {
                let copied = match dims.iter().position(|&d| d == e) {
                    Some(i) => t[0].dims()[i] == 1,
                    None => true,
                };
                if copied {
                    v.push(same(vec![R], vec![s(e)]));
                }
            }
            for k in [P, PMAX, PMIN] {
                v.push(same(vec![k], vec![k]));
            }
        }
        // x[..., s, heads, d]: batch dims and heads split freely; the sequence only with
        // explicit positions, sharded alike; linear in x.
        Op::Rotary { .. } => {
            let r = t[0].rank();
            let rest = vec![R; n_ops - 1];
            for d in (0..r.saturating_sub(3)).chain([r - 2]) {
                let mut ops = vec![s(d)];
                ops.extend(&rest);
                v.push(same(ops, vec![s(d)]));
            }
            if n_ops == 2 {
                v.push(same(vec![s(r - 3), s(0)], vec![s(r - 3)]));
            }
            let mut ops = vec![P];
            ops.extend(&rest);
            v.push(same(ops, vec![P]));
        }
        // q[b, s, hq, d], k[b, t, hkv, d], v[b, t, hkv, dv], optional q_pos[s], k_pos[t].
        Op::Attention { causal, .. } => {
            let positioned = n_ops == 5;
            // Positions stay whole unless a strategy splits the sequences.
            let with = |qkv: [Placement; 3]| {
                let mut ops = qkv.to_vec();
                if positioned {
                    ops.extend([R, R]);
                }
                ops
            };
            v.push(same(with([s(0); 3]), vec![s(0)]));
            // Heads: q and kv heads split alike keep every query head with its kv head.
            v.push(same(with([s(2); 3]), vec![s(2)]));
            // Multi-query attention: one kv head, shared by every query head.
            if t[1].dims()[2] == 1 {
                v.push(same(with([s(2), R, R]), vec![s(2)]));
            }
            v.push(same(with([R, R, s(3)]), vec![s(3)]));
            v.push(same(with([R, R, P]), vec![P]));
            // Query rows: each device attends its queries to every key; the causal mask
            // needs the queries' global positions, so only with the positions operands.
            if positioned {
                v.push(same(vec![s(1), R, R, s(0), R], vec![s(1)]));
            } else if !causal {
                v.push(same(vec![s(1), R, R], vec![s(1)]));
            }
            // Ring attention (context parallelism): queries, keys and values all split on
            // the sequence, the key/value blocks passed around the ring.
            if positioned {
                v.push(lowered(
                    vec![s(1), s(1), s(1), s(0), s(0)],
                    vec![s(1)],
                    Lowering::RingAttention,
                ));
            } else if !causal {
                v.push(lowered(vec![s(1); 3], vec![s(1)], Lowering::RingAttention));
            }
        }
        // q, k, v, o[b, s, hq, dv], g (like o), optional q_pos, k_pos -> dq, dk, dv: split like
        // the forward; where keys are whole on every device their gradients are partial sums
        // over the local queries; linear in g.
        Op::AttentionBackward { causal, .. } => {
            let positioned = n_ops == 7;
            let with = |qkvog: [Placement; 5]| {
                let mut ops = qkvog.to_vec();
                if positioned {
                    ops.extend([R, R]);
                }
                ops
            };
            v.push(same(with([s(0); 5]), vec![s(0); 3]));
            v.push(same(with([s(2); 5]), vec![s(2); 3]));
            if t[1].dims()[2] == 1 {
                v.push(same(with([s(2), R, R, s(2), s(2)]), vec![s(2), P, P]));
            }
            v.push(same(with([R, R, R, R, P]), vec![P; 3]));
            if positioned {
                let mut ops = vec![s(1), R, R, s(1), s(1), s(0), R];
                v.push(same(ops.clone(), vec![s(1), P, P]));
                ops = vec![s(1), s(1), s(1), s(1), s(1), s(0), s(0)];
                v.push(lowered(ops, vec![s(1); 3], Lowering::RingAttentionBackward));
            } else if !causal {
                v.push(same(vec![s(1), R, R, s(1), s(1)], vec![s(1), P, P]));
                v.push(lowered(
                    vec![s(1); 5],
                    vec![s(1); 3],
                    Lowering::RingAttentionBackward,
                ));
            }
        }
        // Routing groups split freely; tokens and experts never (see the module docs).
        Op::MoeRoute { .. } => {
            for d in 0..t[0].rank().saturating_sub(2) {
                v.push(same(vec![s(d)], vec![s(d), s(d)]));
            }
        }
        Op::CrossEntropy => {
            let lr = t[0].rank();
            for d in 0..lr - 1 {
                v.push(same(vec![s(d), s(d)], vec![s(d)]));
            }
            v.push(lowered(
                vec![s(lr - 1), R],
                vec![R],
                Lowering::VocabParallelCrossEntropy,
            ));
        }
        // The step count and a learning-rate factor stay replicated.
        Op::SgdUpdate { .. } | Op::AdamWUpdate { .. } => {
            let (tensors, results) = match op {
                Op::SgdUpdate { .. } => (3, 2),
                _ => (4, 3),
            };
            for d in 0..t[0].rank() {
                let mut operands = vec![s(d); tensors];
                operands.resize(t.len(), R);
                v.push(same(operands, vec![s(d); results]));
            }
        }
    }
    Ok(v)
}
