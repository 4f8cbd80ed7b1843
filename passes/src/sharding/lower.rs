//! Lowerings: the local computations of strategies whose kernel is not the op itself,
//! emitted as IR ops into a device's local graph.
//!
//! A partitioner calls [`lower()`] once per op with a [`ShardContext`] that combines every mesh
//! axis whose strategy chose the lowering: the shard this device holds of the dim the
//! lowering is about (the table's rows, the logits' vocabulary, the reduced dims of a mean),
//! numbered row-major over those axes, and the axes themselves (cross-entropy all-reduces
//! over them). Operands are the device's local values; the local graph needs a mesh with the
//! axes when the lowering emits collectives.

use autopar_ir::{
    BinaryOp, CompareOp, DType, Graph, Op, ReduceKind, ReduceOp, Shape, TensorType, UnaryOp,
    ValueId,
};

use super::error::ShardingError;
use super::strategy::Lowering;

/// Which shard of the relevant dim this device holds, and over which mesh axes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardContext {
    /// The mesh axes splitting the dim, outermost first.
    pub axes: Vec<String>,
    /// This device's shard, row-major over the axes' coordinates.
    pub index: usize,
    /// Number of shards (the product of the axes' sizes).
    pub count: usize,
}

/// Emits into `g` the local computation of `op` under `lowering`, on this device's local
/// `operands`, and returns its results (in the op's result order).
///
/// - [`Lowering::PartialMean`]: `reduce_mean(x) * (1 / count)`.
/// - [`Lowering::VocabParallelGather`], with `table[v_local, ...]` and `ids`:
///   `local = ids - index * v_local`; `ok = (local >= 0) & (local < v_local)` (as a select);
///   `rows = gather(table, select(ok, local, 0))`; `select(broadcast(ok), rows, 0)`.
/// - [`Lowering::RowParallelScatterAdd`], with whole `ids` and `updates`: the same shift and
///   mask, updates outside the shard zeroed, then `scatter_add` into `num_rows / count` rows.
/// - [`Lowering::RingAttention`], with local `q`, `k`, `v` (and `q_pos`, `k_pos`) rows of the
///   sequence: see the strategy's docs; the ring runs along the one axis in `shard`,
///   `count` steps long.
/// - [`Lowering::RingAttentionBackward`], with local rows of `q`, `k`, `v`, `o`, `g` (and the
///   positions): two passes around the same ring, then the key/value gradients sent home.
/// - [`Lowering::VocabParallelCrossEntropy`], with `logits[..., v_local]` and whole `targets`:
///   `m = all_reduce_max(reduce_max(logits))`; `z = logits - m`;
///   `s = all_reduce_sum(reduce_sum(exp(z)))`; the target's `z`, picked by comparing
///   `iota(v_local)` with `targets - index * v_local` (never equal off-shard), summed over the
///   vocabulary and all-reduced; `loss = log(s) - z[target]`, cast to `f32`.
pub fn lower(
    g: &mut Graph,
    op: &Op,
    lowering: Lowering,
    operands: &[ValueId],
    shard: &ShardContext,
) -> Result<Vec<ValueId>, ShardingError> {
    let mismatch = |detail: &str| ShardingError::Mismatch {
        op: op.name(),
        detail: format!("lowering {lowering:?}: {detail}"),
    };
    if shard.count == 0 || shard.index >= shard.count {
        return Err(mismatch("shard index outside the shard count"));
    }
    match (lowering, op, operands) {
        (Lowering::PartialMean, Op::Reduce { func, .. }, &[x]) if *func == ReduceOp::Mean => {
            let mean = g.add(op.clone(), &[x])?;
            let scale = constant(g, g.ty(mean).clone(), 1.0 / shard.count as f64)?;
            Ok(vec![binary(g, BinaryOp::Mul, mean, scale)?])
        }
        (Lowering::VocabParallelGather, Op::Gather, &[table, ids]) => {
            let rows = g.ty(table).dims()[0];
            let (ok, local_ids) = in_shard(g, ids, shard.index * rows, rows)?;
            let picked = g.add(Op::Gather, &[table, local_ids])?;
            Ok(vec![mask(g, ok, picked)?])
        }
        (Lowering::RowParallelScatterAdd, Op::ScatterAdd { num_rows }, &[ids, updates]) => {
            if !num_rows.is_multiple_of(shard.count) {
                return Err(mismatch("rows do not split evenly"));
            }
            let rows = num_rows / shard.count;
            let (ok, local_ids) = in_shard(g, ids, shard.index * rows, rows)?;
            let kept = mask(g, ok, updates)?;
            Ok(vec![g.add(
                Op::ScatterAdd { num_rows: rows },
                &[local_ids, kept],
            )?])
        }
        (Lowering::VocabParallelCrossEntropy, Op::CrossEntropy, &[logits, targets]) => {
            vocab_parallel_cross_entropy(g, logits, targets, shard)
        }
        (Lowering::RingAttention, Op::Attention { causal, scale }, [q, k, v, positions @ ..])
            if positions.is_empty() || positions.len() == 2 =>
        {
            let (ring, positions) = Ring::of(shard, *causal, *scale, positions, &mismatch)?;
            ring_attention(g, &ring, [*q, *k, *v], positions)
        }
        (
            Lowering::RingAttentionBackward,
            Op::AttentionBackward { causal, scale },
            [q, k, v, o, grad, positions @ ..],
        ) if positions.is_empty() || positions.len() == 2 => {
            let (ring, positions) = Ring::of(shard, *causal, *scale, positions, &mismatch)?;
            ring_attention_backward(g, &ring, [*q, *k, *v, *o, *grad], positions)
        }
        _ => Err(mismatch("does not apply to this op or its operands")),
    }
}

fn constant(g: &mut Graph, ty: TensorType, value: f64) -> Result<ValueId, ShardingError> {
    Ok(g.add(Op::Constant { ty, value }, &[])?)
}

fn binary(g: &mut Graph, func: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, ShardingError> {
    Ok(g.add(Op::Binary { func }, &[a, b])?)
}

fn compare(
    g: &mut Graph,
    func: CompareOp,
    a: ValueId,
    b: ValueId,
) -> Result<ValueId, ShardingError> {
    Ok(g.add(Op::Compare { func }, &[a, b])?)
}

/// Ids relative to a shard of rows `start..start + rows`: whether each id falls in it, and
/// the shifted id (0 where it does not, so that a gather stays in range).
fn in_shard(
    g: &mut Graph,
    ids: ValueId,
    start: usize,
    rows: usize,
) -> Result<(ValueId, ValueId), ShardingError> {
    let ty = g.ty(ids).clone();
    let start = constant(g, ty.clone(), start as f64)?;
    let shifted = binary(g, BinaryOp::Sub, ids, start)?;
    let zero = constant(g, ty.clone(), 0.0)?;
    let end = constant(g, ty.clone(), rows as f64)?;
    let above = compare(g, CompareOp::Ge, shifted, zero)?;
    let below = compare(g, CompareOp::Lt, shifted, end)?;
    let no = constant(g, ty.with_dtype(DType::Bool), 0.0)?;
    let ok = g.add(Op::Select, &[above, below, no])?;
    let safe = g.add(Op::Select, &[ok, shifted, zero])?;
    Ok((ok, safe))
}

/// `x` where `ok` (broadcast over `x`'s trailing dims), zero elsewhere.
fn mask(g: &mut Graph, ok: ValueId, x: ValueId) -> Result<ValueId, ShardingError> {
    let x_ty = g.ty(x).clone();
    let lead = g.ty(ok).rank();
    let ok = g.add(
        Op::Broadcast {
            shape: x_ty.shape.clone(),
            dims: (0..lead).collect(),
        },
        &[ok],
    )?;
    let zero = constant(g, x_ty, 0.0)?;
    Ok(g.add(Op::Select, &[ok, x, zero])?)
}

/// The ring of a [`Lowering::RingAttention`]: its mesh axis, its length and the op's
/// attributes.
struct Ring<'a> {
    axis: &'a str,
    steps: usize,
    causal: bool,
    scale: f64,
}

impl<'a> Ring<'a> {
    /// The ring of `shard` (one mesh axis, a step per device) and the `(q_pos, k_pos)`
    /// operands when `positions` has them; `mismatch` words the error of a ring over several
    /// axes.
    fn of(
        shard: &'a ShardContext,
        causal: bool,
        scale: f64,
        positions: &[ValueId],
        mismatch: &dyn Fn(&str) -> ShardingError,
    ) -> Result<(Self, Option<(ValueId, ValueId)>), ShardingError> {
        let [axis] = shard.axes.as_slice() else {
            return Err(mismatch("a ring runs along one mesh axis"));
        };
        let positions = match *positions {
            [q_pos, k_pos] => Some((q_pos, k_pos)),
            _ => None,
        };
        let ring = Ring {
            axis,
            steps: shard.count,
            causal,
            scale,
        };
        Ok((ring, positions))
    }
}

/// Ring attention on this device's rows `q[b, s, hq, d]` and its key/value block
/// `k[b, t, hkv, d]`, `v[b, t, hkv, dv]` (with `positions = (q_pos[s], k_pos[t])` when the
/// mask needs them). Step `i` works on the block that started `i` devices back: scores
/// `z = scale q k^T` (masked to `-inf` where `k_pos > q_pos`), block max `m_i`, running max
/// `m = max(m, m_i)`, `p = exp(z - m)`, and the running sum and output rescaled by
/// `exp(m_old - m)` before `sum(p)` and `p v` are added. Before every step but the first,
/// the block (and its positions) is sent to the next device and the previous device's is
/// received, all sends first. A max that is still `-inf` (every key so far masked) is
/// replaced by 0 where it is subtracted, so no `-inf - -inf` arises. The result is the
/// output divided by the running sum.
fn ring_attention(
    g: &mut Graph,
    ring: &Ring<'_>,
    [q, k, v]: [ValueId; 3],
    positions: Option<(ValueId, ValueId)>,
) -> Result<Vec<ValueId>, ShardingError> {
    let sh = RingShapes::of(g, q, v, "attention")?;
    let out_shape = Shape::new([sh.b, sh.s, sh.hkv, sh.group, sh.dv]);
    // Per-query statistics `[b, hkv, g, s]` laid out like the output rows `[b, s, hkv, g]`.
    let over_rows = |g: &mut Graph, x: ValueId| -> Result<ValueId, ShardingError> {
        let x = g.add(
            Op::Transpose {
                perm: vec![0, 3, 1, 2],
            },
            &[x],
        )?;
        Ok(g.add(
            Op::Broadcast {
                shape: out_shape.clone(),
                dims: vec![0, 1, 2, 3],
            },
            &[x],
        )?)
    };
    let q5 = g.add(
        Op::Reshape {
            shape: Shape::new([sh.b, sh.s, sh.hkv, sh.group, sh.d]),
        },
        &[q],
    )?;
    let neg_inf = constant(g, sh.stats(), f64::NEG_INFINITY)?;
    let zero = constant(g, sh.stats(), 0.0)?;
    let mut block = vec![k, v];
    block.extend(positions.map(|(_, k_pos)| k_pos));
    // (running max, running sum, running output)
    let mut state: Option<(ValueId, ValueId, ValueId)> = None;
    for step in 0..ring.steps {
        if step > 0 {
            block = pass_on(g, ring.axis, &block)?;
        }
        let (kb, vb) = (block[0], block[1]);
        let block_positions = match (positions, block.get(2)) {
            (Some((q_pos, _)), Some(&k_pos)) => Some((q_pos, k_pos)),
            _ => None,
        };
        let logits = ring_logits(g, ring, q5, kb, block_positions)?;
        let soft = block_softmax(g, logits, state.map(|(m, _, _)| m), [neg_inf, zero])?;
        let block_out = einsum(g, "attention", "bkgst,btke->bskge", soft.exp, vb)?;
        state = Some(match state {
            None => (soft.max, soft.sum, block_out),
            Some((m, sum, out)) => {
                let (sum, alpha) = rescaled_sum(g, m, sum, &soft)?;
                let alpha_rows = over_rows(g, alpha)?;
                let kept = binary(g, BinaryOp::Mul, out, alpha_rows)?;
                let out = binary(g, BinaryOp::Add, kept, block_out)?;
                (soft.max, sum, out)
            }
        });
    }
    let Some((_, sum, out)) = state else {
        return Err(ShardingError::Mismatch {
            op: "attention",
            detail: "ring attention over zero devices".into(),
        });
    };
    let sum_rows = over_rows(g, sum)?;
    let out = binary(g, BinaryOp::Div, out, sum_rows)?;
    Ok(vec![g.add(
        Op::Reshape {
            shape: Shape::new([sh.b, sh.s, sh.hq, sh.dv]),
        },
        &[out],
    )?])
}

/// Sends `block` one step along the ring (all sends first) and returns what the previous
/// device sent.
fn pass_on(g: &mut Graph, axis: &str, block: &[ValueId]) -> Result<Vec<ValueId>, ShardingError> {
    for &x in block {
        g.add_node(
            Op::Send {
                axis: axis.to_string(),
                shift: 1,
            },
            &[x],
        )?;
    }
    block
        .iter()
        .map(|&x| {
            let ty = g.ty(x).clone();
            Ok(g.add(
                Op::Recv {
                    axis: axis.to_string(),
                    shift: -1,
                    ty,
                },
                &[],
            )?)
        })
        .collect()
}

/// `einsum(spec, x, y)`; a malformed spec is an error of `op`.
fn einsum(
    g: &mut Graph,
    op: &'static str,
    spec: &str,
    x: ValueId,
    y: ValueId,
) -> Result<ValueId, ShardingError> {
    let spec = spec
        .parse()
        .map_err(|detail| ShardingError::Mismatch { op, detail })?;
    Ok(g.add(Op::Einsum { spec }, &[x, y])?)
}

/// The sizes of a ring attention (or its backward) on `q[b, s, hq, d]` and
/// `v[b, t, hkv, dv]`; an error of `op` unless both have rank 4.
struct RingShapes {
    b: usize,
    s: usize,
    hq: usize,
    d: usize,
    t: usize,
    hkv: usize,
    dv: usize,
    group: usize,
    dtype: DType,
}

impl RingShapes {
    fn of(g: &Graph, q: ValueId, v: ValueId, op: &'static str) -> Result<Self, ShardingError> {
        let (qt, vt) = (g.ty(q), g.ty(v));
        let (&[b, s, hq, d], &[_, t, hkv, dv]) = (qt.dims(), vt.dims()) else {
            return Err(ShardingError::Mismatch {
                op,
                detail: "ring attention needs rank-4 q, k and v".into(),
            });
        };
        Ok(RingShapes {
            b,
            s,
            hq,
            d,
            t,
            hkv,
            dv,
            group: hq / hkv.max(1),
            dtype: qt.dtype,
        })
    }

    /// The scores of one key block, `[b, hkv, group, s, t]`.
    fn scores(&self) -> Shape {
        Shape::new([self.b, self.hkv, self.group, self.s, self.t])
    }

    /// Per-query-row statistics, `[b, hkv, group, s]`.
    fn stats(&self) -> TensorType {
        TensorType::new(self.dtype, [self.b, self.hkv, self.group, self.s])
    }
}

/// One key block of an online softmax over the last dim of `z[b, hkv, g, s, t]`, given the
/// running max of the blocks before (`None` for the first): the new running max, the same
/// with a still `-inf` max (every key so far masked) replaced by 0 (`safe`, what is
/// subtracted), the block's `exp(z - safe)` and its row sums.
struct BlockSoftmax {
    max: ValueId,
    safe: ValueId,
    exp: ValueId,
    sum: ValueId,
}

fn block_softmax(
    g: &mut Graph,
    z: ValueId,
    running_max: Option<ValueId>,
    [neg_inf, zero]: [ValueId; 2],
) -> Result<BlockSoftmax, ShardingError> {
    let block_max = g.add(
        Op::Reduce {
            func: ReduceOp::Max,
            dims: vec![4],
        },
        &[z],
    )?;
    let max = match running_max {
        None => block_max,
        Some(m) => binary(g, BinaryOp::Max, m, block_max)?,
    };
    let unseen = compare(g, CompareOp::Eq, max, neg_inf)?;
    let safe = g.add(Op::Select, &[unseen, zero, max])?;
    let scores = g.ty(z).shape.clone();
    let safe_b = g.add(
        Op::Broadcast {
            shape: scores,
            dims: vec![0, 1, 2, 3],
        },
        &[safe],
    )?;
    let shifted = binary(g, BinaryOp::Sub, z, safe_b)?;
    let exp = g.add(Op::Unary { func: UnaryOp::Exp }, &[shifted])?;
    let sum = g.add(
        Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![4],
        },
        &[exp],
    )?;
    Ok(BlockSoftmax {
        max,
        safe,
        exp,
        sum,
    })
}

/// The running sum of an online softmax after a block: `sum * alpha + block_sum` with
/// `alpha = exp(old_max - safe)`, which also rescales anything else accumulated so far.
fn rescaled_sum(
    g: &mut Graph,
    old_max: ValueId,
    sum: ValueId,
    block: &BlockSoftmax,
) -> Result<(ValueId, ValueId), ShardingError> {
    let diff = binary(g, BinaryOp::Sub, old_max, block.safe)?;
    let alpha = g.add(Op::Unary { func: UnaryOp::Exp }, &[diff])?;
    let kept = binary(g, BinaryOp::Mul, sum, alpha)?;
    Ok((binary(g, BinaryOp::Add, kept, block.sum)?, alpha))
}

/// `scale q5 k^T` as `[b, hkv, g, s, t]`, set to `-inf` where `k_pos > q_pos` when causal.
fn ring_logits(
    g: &mut Graph,
    ring: &Ring<'_>,
    q5: ValueId,
    k: ValueId,
    positions: Option<(ValueId, ValueId)>,
) -> Result<ValueId, ShardingError> {
    let scores = einsum(g, "attention", "bskgd,btkd->bkgst", q5, k)?;
    let ty = g.ty(scores).clone();
    let scale = constant(g, ty.clone(), ring.scale)?;
    let logits = binary(g, BinaryOp::Mul, scores, scale)?;
    let (true, Some((q_pos, k_pos))) = (ring.causal, positions) else {
        return Ok(logits);
    };
    let (s, t) = (ty.dims()[3], ty.dims()[4]);
    let square = Shape::new([s, t]);
    let rows = g.add(
        Op::Broadcast {
            shape: square.clone(),
            dims: vec![0],
        },
        &[q_pos],
    )?;
    let cols = g.add(
        Op::Broadcast {
            shape: square,
            dims: vec![1],
        },
        &[k_pos],
    )?;
    let future = compare(g, CompareOp::Gt, cols, rows)?;
    let mask = g.add(
        Op::Broadcast {
            shape: ty.shape.clone(),
            dims: vec![3, 4],
        },
        &[future],
    )?;
    let masked = constant(g, ty, f64::NEG_INFINITY)?;
    Ok(g.add(Op::Select, &[mask, masked, logits])?)
}

/// Ring attention's backward on this device's rows of `q`, `o` and `grad` and its key/value
/// block (see [`Lowering::RingAttentionBackward`]): pass 1 rings the keys to get every row's
/// `lse = m + log(sum exp(z - m))` over all keys; pass 2 starts again from the local block
/// and, at every step, adds `p^T g` to the held block's `dv`, `ds^T q` to its `dk` and
/// `ds k` to the local `dq`, with `p = exp(z - lse)` and
/// `ds = p (g v^T - rowsum(g o)) scale`, then passes keys, values and both accumulators on;
/// a last step returns the accumulators (now one device ahead of their owner) home.
fn ring_attention_backward(
    g: &mut Graph,
    ring: &Ring<'_>,
    [q, k, v, o, grad]: [ValueId; 5],
    positions: Option<(ValueId, ValueId)>,
) -> Result<Vec<ValueId>, ShardingError> {
    const OP: &str = "attention_backward";
    let sh = RingShapes::of(g, q, v, OP)?;
    let scores_shape = sh.scores();
    let spread = |g: &mut Graph, x: ValueId| {
        g.add(
            Op::Broadcast {
                shape: scores_shape.clone(),
                dims: vec![0, 1, 2, 3],
            },
            &[x],
        )
    };
    let split = |g: &mut Graph, x: ValueId, last: usize| {
        g.add(
            Op::Reshape {
                shape: Shape::new([sh.b, sh.s, sh.hkv, sh.group, last]),
            },
            &[x],
        )
    };
    let q5 = split(g, q, sh.d)?;
    let g5 = split(g, grad, sh.dv)?;
    let o5 = split(g, o, sh.dv)?;
    let k_pos = positions.map(|(_, k_pos)| k_pos);
    let q_pos = positions.map(|(q_pos, _)| q_pos);
    let with_positions = |k_pos: Option<ValueId>| q_pos.zip(k_pos);

    // Pass 1: every row's log-sum-exp over all keys.
    let neg_inf = constant(g, sh.stats(), f64::NEG_INFINITY)?;
    let zero = constant(g, sh.stats(), 0.0)?;
    let mut block: Vec<ValueId> = std::iter::once(k).chain(k_pos).collect();
    let mut stats: Option<(ValueId, ValueId, ValueId)> = None; // (max, safe max, sum)
    for step in 0..ring.steps {
        if step > 0 {
            block = pass_on(g, ring.axis, &block)?;
        }
        let z = ring_logits(g, ring, q5, block[0], with_positions(block.get(1).copied()))?;
        let soft = block_softmax(g, z, stats.map(|(m, _, _)| m), [neg_inf, zero])?;
        let sum = match stats {
            None => soft.sum,
            Some((m, _, sum)) => rescaled_sum(g, m, sum, &soft)?.0,
        };
        stats = Some((soft.max, soft.safe, sum));
    }
    let Some((_, safe, sum)) = stats else {
        return Err(ShardingError::Mismatch {
            op: "attention_backward",
            detail: "ring attention over zero devices".into(),
        });
    };
    let log_sum = g.add(Op::Unary { func: UnaryOp::Log }, &[sum])?;
    let lse = binary(g, BinaryOp::Add, safe, log_sum)?;
    let lse_b = spread(g, lse)?;
    // rowsum(g o) per query row, as `[b, hkv, g, s]`.
    let go = binary(g, BinaryOp::Mul, g5, o5)?;
    let centre = g.add(
        Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![4],
        },
        &[go],
    )?;
    let centre = g.add(
        Op::Transpose {
            perm: vec![0, 2, 3, 1],
        },
        &[centre],
    )?;
    let centre_b = spread(g, centre)?;
    let scale_ty = TensorType::new(sh.dtype, scores_shape.dims());

    // Pass 2: gradients, the key/value gradients travelling with their block.
    let mut block: Vec<ValueId> = vec![k, v];
    block.extend(k_pos);
    let mut dq: Option<ValueId> = None;
    let mut acc: Option<(ValueId, ValueId)> = None;
    for step in 0..ring.steps {
        if step > 0 {
            let mut travelling = block.clone();
            if let Some((dk, dv)) = acc {
                travelling.extend([dk, dv]);
            }
            let received = pass_on(g, ring.axis, &travelling)?;
            let n = block.len();
            block = received[..n].to_vec();
            acc = Some((received[n], received[n + 1]));
        }
        let (kb, vb) = (block[0], block[1]);
        let z = ring_logits(g, ring, q5, kb, with_positions(block.get(2).copied()))?;
        let shifted = binary(g, BinaryOp::Sub, z, lse_b)?;
        let p = g.add(Op::Unary { func: UnaryOp::Exp }, &[shifted])?;
        let dv_part = einsum(g, OP, "bkgst,bskge->btke", p, g5)?;
        let dp = einsum(g, OP, "bskge,btke->bkgst", g5, vb)?;
        let centred = binary(g, BinaryOp::Sub, dp, centre_b)?;
        let ds = binary(g, BinaryOp::Mul, p, centred)?;
        let scale = constant(g, scale_ty.clone(), ring.scale)?;
        let ds = binary(g, BinaryOp::Mul, ds, scale)?;
        let dq_part = einsum(g, OP, "bkgst,btkd->bskgd", ds, kb)?;
        let dk_part = einsum(g, OP, "bkgst,bskgd->btkd", ds, q5)?;
        dq = Some(match dq {
            None => dq_part,
            Some(x) => binary(g, BinaryOp::Add, x, dq_part)?,
        });
        acc = Some(match acc {
            None => (dk_part, dv_part),
            Some((dk, dv)) => (
                binary(g, BinaryOp::Add, dk, dk_part)?,
                binary(g, BinaryOp::Add, dv, dv_part)?,
            ),
        });
    }
    let (Some(dq), Some((mut dk, mut dv))) = (dq, acc) else {
        return Err(ShardingError::Mismatch {
            op: "attention_backward",
            detail: "ring attention over zero devices".into(),
        });
    };
    if ring.steps > 1 {
        let home = pass_on(g, ring.axis, &[dk, dv])?;
        (dk, dv) = (home[0], home[1]);
    }
    let dq = g.add(
        Op::Reshape {
            shape: Shape::new([sh.b, sh.s, sh.hq, sh.d]),
        },
        &[dq],
    )?;
    Ok(vec![dq, dk, dv])
}

/// The integers `0..n` as a `dtype[n]` value, in about `3 log2 n` ops: doubling
/// `[0] -> [0, 1] -> [0, 1, 2, 3] -> ...`, then a slice (the IR has no iota op).
pub fn iota(g: &mut Graph, n: usize, dtype: DType) -> Result<ValueId, ShardingError> {
    let mut x = constant(g, TensorType::new(dtype, [1]), 0.0)?;
    let mut len = 1;
    while len < n {
        let offset = constant(g, TensorType::new(dtype, [len]), len as f64)?;
        let upper = binary(g, BinaryOp::Add, x, offset)?;
        x = g.add(Op::Concat { dim: 0 }, &[x, upper])?;
        len *= 2;
    }
    if len != n {
        x = g.add(
            Op::Slice {
                dim: 0,
                start: 0,
                end: n,
            },
            &[x],
        )?;
    }
    Ok(x)
}

fn vocab_parallel_cross_entropy(
    g: &mut Graph,
    logits: ValueId,
    targets: ValueId,
    shard: &ShardContext,
) -> Result<Vec<ValueId>, ShardingError> {
    let lt = g.ty(logits).clone();
    let tt = g.ty(targets).clone();
    let vocab_dim = tt.rank();
    let v_local = lt.dims()[vocab_dim];
    let reduce = |g: &mut Graph, func: ReduceOp, x: ValueId| {
        g.add(
            Op::Reduce {
                func,
                dims: vec![vocab_dim],
            },
            &[x],
        )
    };
    let all_reduce = |g: &mut Graph, reduce: ReduceKind, x: ValueId| {
        g.add(
            Op::AllReduce {
                axes: shard.axes.clone(),
                reduce,
            },
            &[x],
        )
    };
    let over_vocab = |g: &mut Graph, x: ValueId| {
        g.add(
            Op::Broadcast {
                shape: lt.shape.clone(),
                dims: (0..vocab_dim).collect(),
            },
            &[x],
        )
    };
    // Global max per row.
    let local_max = reduce(g, ReduceOp::Max, logits)?;
    let max = all_reduce(g, ReduceKind::Max, local_max)?;
    let max_b = over_vocab(g, max)?;
    let shifted = binary(g, BinaryOp::Sub, logits, max_b)?;
    // Global sum of exp(logit - max).
    let exp = g.add(Op::Unary { func: UnaryOp::Exp }, &[shifted])?;
    let local_sum = reduce(g, ReduceOp::Sum, exp)?;
    let sum = all_reduce(g, ReduceKind::Sum, local_sum)?;
    // The target's shifted logit, from the one device whose shard holds it.
    let start = constant(g, tt.clone(), (shard.index * v_local) as f64)?;
    let local_target = binary(g, BinaryOp::Sub, targets, start)?;
    let target_b = over_vocab(g, local_target)?;
    let columns = iota(g, v_local, tt.dtype)?;
    let columns_b = g.add(
        Op::Broadcast {
            shape: Shape::new(lt.dims()),
            dims: vec![vocab_dim],
        },
        &[columns],
    )?;
    let hit = compare(g, CompareOp::Eq, columns_b, target_b)?;
    let zero = constant(g, lt.clone(), 0.0)?;
    let picked = g.add(Op::Select, &[hit, shifted, zero])?;
    let local_target_logit = reduce(g, ReduceOp::Sum, picked)?;
    let target_logit = all_reduce(g, ReduceKind::Sum, local_target_logit)?;
    let log_sum = g.add(Op::Unary { func: UnaryOp::Log }, &[sum])?;
    let mut loss = binary(g, BinaryOp::Sub, log_sum, target_logit)?;
    if lt.dtype != DType::F32 {
        loss = g.add(Op::Cast { to: DType::F32 }, &[loss])?;
    }
    Ok(vec![loss])
}
