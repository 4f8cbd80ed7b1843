//! Context parallelism: the sequence sharded over the `cp` mesh axis for the whole model,
//! attention run as ring attention.
//!
//! **Load-balanced layout.** With causal attention, the last positions of a sequence attend
//! to many more keys than the first ones, so splitting the sequence into `N` contiguous
//! pieces would leave the last device with most of the work. [`load_balance`] rewrites a
//! *forward* graph (before the training step is built, so that the backward is derived from
//! the rewritten forward) so that the sequence is held in the order of [`chunk_order`]: cut
//! into `2N` chunks, reordered `[0, 2N-1, 1, 2N-2, ...]`. A contiguous `S(seq)` split over
//! `N` devices then gives device `r` chunks `r` and `2N-1-r`, one from each end, and every
//! device the same amount of attention work.
//!
//! The rewrite permutes the sequence dim (dim 1) of every data input at entry (slices and a
//! concat, scope [`LAYOUT_DATA`]), gives every `rotary` the permuted global positions and
//! every `attention` the permuted positions of its queries and keys (scope
//! [`LAYOUT_POSITIONS`]), so the causal mask compares positions, not row numbers. A learned
//! position table broadcast onto the sequence (`wpe[s, h]` of GPT) is permuted the same way.
//! Everything else in a transformer treats positions alike (matmuls, norms and the MLP act
//! per position; the loss is a mean over positions), so the rewritten model computes the
//! same loss as the original up to the order of its sums. Ops whose result would depend on
//! the order of the rows (MoE capacity, slices and concats along the sequence) are rejected
//! with an error rather than silently reordered.
//!
//! **Placements.** [`context_parallel_constraints`] fixes the permuted data inputs to
//! `S(1)` and the permuted positions to `S(0)` on [`CONTEXT_AXIS`]; propagation derives the
//! rest: activations stay sharded on the sequence, attention takes the ring strategy
//! ([`crate::sharding::Lowering::RingAttention`]), attention's gradient (the fused
//! `attention_backward` that attention with positions differentiates into) takes the ring
//! backward ([`crate::sharding::Lowering::RingAttentionBackward`]), and weight gradients come
//! out partial on `cp` and are all-reduced where the optimizer reads them.
//!
//! The layout's nodes are recognised by what they compute, not by their scopes (which only
//! name them in dumps): a `concat` along dim `d` of the `2N` chunk slices of one value along
//! `d` in [`chunk_order`] is a permutation into the layout, of the data (`d = 1`) or of
//! integer positions (`d = 0`). The new nodes get `phase=forward` metadata, the data's
//! permutation the embedding's layer (it feeds the embedding); the backward is the nodes of
//! phase `backward`.

use std::collections::HashMap;

use autopar_ir::{
    DType, DeviceMesh, Graph, LayerId, NodeId, NodeMeta, Op, Phase, Placement, ValueId, verify,
};

use crate::error::PassError;
use crate::propagate::Constraints;

/// The context-parallel mesh axis.
pub const CONTEXT_AXIS: &str = autopar_ir::axis::CP;

/// Scope path of the nodes that permute the data inputs into the load-balanced order.
pub const LAYOUT_DATA: &str = "cp_layout.data";

/// Scope path of the nodes that permute the positions handed to rotary and attention.
pub const LAYOUT_POSITIONS: &str = "cp_layout.positions";

/// Scope path of the positions `0..s` before they are permuted.
const LAYOUT_IOTA: &str = "cp_layout.iota";

/// Scope path of the nodes that permute a learned position table.
const LAYOUT_TABLE: &str = "cp_layout.table";

/// The order in which the `2 * ways` chunks of the sequence are laid out:
/// `[0, 2N-1, 1, 2N-2, ...]`, so that device `r` of `N` holds chunks `r` and `2N-1-r`.
///
/// ```
/// # use autopar_passes::context_parallel::chunk_order;
/// assert_eq!(chunk_order(2), vec![0, 3, 1, 2]);
/// assert_eq!(chunk_order(1), vec![0, 1]);
/// ```
pub fn chunk_order(ways: usize) -> Vec<usize> {
    (0..ways).flat_map(|r| [r, 2 * ways - 1 - r]).collect()
}

/// The global position of every row of a sequence of `seq` positions laid out for `ways`
/// devices (see [`chunk_order`]); `seq` must be a multiple of `2 * ways`.
///
/// ```
/// # use autopar_passes::context_parallel::load_balanced_positions;
/// assert_eq!(load_balanced_positions(8, 2), vec![0, 1, 6, 7, 2, 3, 4, 5]);
/// ```
pub fn load_balanced_positions(seq: usize, ways: usize) -> Vec<usize> {
    let chunk = seq / (2 * ways).max(1);
    chunk_order(ways)
        .into_iter()
        .flat_map(|c| c * chunk..(c + 1) * chunk)
        .collect()
}

/// Rewrites the forward graph `g` into the load-balanced sequence layout for the `ways`
/// devices of the mesh axis `axis` that will split the sequence (see the module docs):
/// [`CONTEXT_AXIS`] for context parallelism, or the tensor axis when a layer placement runs
/// the attention core on the sequence shards. The axis only names the layout in errors; the
/// rewrite itself depends on `ways` alone. With `ways <= 1` the graph is returned as it is.
///
/// Errors name the axis, its size and the tensor at fault: a graph without attention,
/// attention whose queries and keys differ in length, a sequence that does not split into
/// `2 * ways` equal chunks, a data input without the sequence on dim 1, and ops whose result
/// depends on the order of the rows.
pub fn load_balance(g: &Graph, axis: &str, ways: usize) -> Result<Graph, PassError> {
    if ways <= 1 {
        return Ok(g.clone());
    }
    let err = |detail: String| PassError::ContextParallel {
        axis: axis.to_string(),
        ways,
        detail,
    };
    let order = g.nodes_in_order();
    let seq = sequence_length(g, &order).map_err(err)?;
    let chunks = 2 * ways;
    if seq == 0 || !seq.is_multiple_of(chunks) {
        return Err(err(format!(
            "the sequence (length {seq}) does not split into {chunks} equal chunks (two per device)"
        )));
    }
    let tables = check_order_free(g, &order, seq).map_err(err)?;

    let mut out = Graph::new(g.name());
    out.set_mesh(g.mesh().cloned());
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let mut positions: Option<ValueId> = None;
    let layout = Layout { seq, ways };
    for n in order {
        let node = g.node(n);
        let mut inputs: Vec<ValueId> = node.inputs.iter().map(|v| map[v]).collect();
        match (&node.op, inputs.len()) {
            (Op::Rotary { .. }, 1) => inputs.push(layout.positions(&mut out, &mut positions)?),
            (Op::Attention { .. }, 3) => {
                let p = layout.positions(&mut out, &mut positions)?;
                inputs.extend([p, p]);
            }
            // Positions given by the model are permuted like the rows they describe.
            (Op::Rotary { .. }, 2) | (Op::Attention { .. }, 5) => {
                let first = if inputs.len() == 2 { 1 } else { 3 };
                for p in inputs.iter_mut().skip(first) {
                    *p = layout.permute(&mut out, *p, 0, LAYOUT_POSITIONS)?;
                }
            }
            _ => {}
        }
        let id = out.add_node(node.op.clone(), &inputs)?;
        out.set_scope(id, node.scope.clone());
        out.set_meta(id, g.meta(n));
        let results = out.node(id).outputs.clone();
        for (&old, &new) in node.outputs.iter().zip(&results) {
            out.set_sharding(new, g.value(old).sharding.clone())?;
            map.insert(old, new);
        }
        let v = node.outputs.first().copied();
        match (&node.op, v) {
            (Op::Input { .. }, Some(v)) => {
                let permuted = layout.permute(&mut out, map[&v], 1, LAYOUT_DATA)?;
                map.insert(v, permuted);
            }
            (Op::Parameter { .. }, Some(v)) => {
                if let Some(&dim) = tables.get(&v) {
                    let permuted = layout.permute(&mut out, map[&v], dim, LAYOUT_TABLE)?;
                    map.insert(v, permuted);
                }
            }
            _ => {}
        }
    }
    for (name, v) in g.outputs() {
        out.add_output(name.clone(), map[v])?;
    }
    verify(&out)?;
    Ok(out)
}

/// The sequence length: that of every attention's queries and keys, which must agree.
fn sequence_length(g: &Graph, order: &[NodeId]) -> Result<usize, String> {
    let mut seq: Option<(usize, NodeId)> = None;
    for &n in order {
        let node = g.node(n);
        if !matches!(node.op, Op::Attention { .. }) {
            continue;
        }
        let (q, k) = (g.ty(node.inputs[0]), g.ty(node.inputs[1]));
        let (s, t) = (q.dims()[1], k.dims()[1]);
        if s != t {
            return Err(format!(
                "attention at {n} has queries {q} and keys {k} of different lengths; only self-attention is split over the sequence"
            ));
        }
        match seq {
            Some((len, first)) if len != s => {
                return Err(format!(
                    "attention at {first} has a sequence of {len} but the one at {n} of {s}"
                ));
            }
            Some(_) => {}
            None => seq = Some((s, n)),
        }
    }
    seq.map(|(s, _)| s).ok_or_else(|| {
        format!(
            "`{}` has no attention: the sequence of a model without attention can be split by data or sequence parallelism instead",
            g.name()
        )
    })
}

/// Checks that nothing in `g` depends on the order of the sequence's rows besides rotary and
/// attention, and returns the learned position tables: parameters with a dim of the sequence's
/// length that a broadcast puts onto dim 1 (the sequence) of an activation (every use must).
fn check_order_free(
    g: &Graph,
    order: &[NodeId],
    seq: usize,
) -> Result<HashMap<ValueId, usize>, String> {
    let mut tables = HashMap::new();
    for &n in order {
        let node = g.node(n);
        let operand = |i: usize| g.ty(node.inputs[i]);
        match &node.op {
            Op::MoeRoute { .. } => {
                return Err(format!(
                    "`moe_route` at {n} fills expert capacity in token order, which the load-balanced layout changes"
                ));
            }
            Op::Slice { dim, .. } if operand(0).dims()[*dim] == seq => {
                return Err(format!(
                    "the slice at {n} cuts dim {dim} of {} (the sequence's length {seq}), which the layout reorders",
                    operand(0)
                ));
            }
            Op::Concat { dim } if g.ty(node.outputs[0]).dims()[*dim] == seq => {
                return Err(format!(
                    "the concat at {n} builds dim {dim} of {} (the sequence's length {seq}), which the layout reorders",
                    g.ty(node.outputs[0])
                ));
            }
            Op::Rotary { .. } => {
                let x = operand(0);
                if x.dims()[x.rank() - 3] != seq {
                    return Err(format!(
                        "the rotary at {n} embeds {x}, whose rows are not the sequence of {seq}"
                    ));
                }
            }
            Op::Input { name, ty, .. } if ty.rank() < 2 || ty.dims()[1] != seq => {
                return Err(format!(
                    "data input `{name}` ({ty}) does not have the sequence (length {seq}) on dim 1"
                ));
            }
            Op::Parameter { name, ty, .. } => {
                let v = node.outputs[0];
                let dims: Vec<usize> = (0..ty.rank()).filter(|&d| ty.dims()[d] == seq).collect();
                if dims.is_empty() {
                    continue;
                }
                // A dim of the sequence's length broadcast onto the sequence of an activation
                // is a position table; a parameter used so must be used so everywhere.
                let users = g.users(v);
                let onto: Vec<Option<usize>> = users
                    .iter()
                    .map(|&(user, _)| match &g.node(user).op {
                        Op::Broadcast { dims: to, .. } => {
                            dims.iter().copied().find(|&d| to.get(d) == Some(&1))
                        }
                        _ => None,
                    })
                    .collect();
                let Some(Some(d)) = onto.iter().find(|o| o.is_some()).copied() else {
                    continue;
                };
                if let Some(i) = onto.iter().position(|&o| o != Some(d)) {
                    let user = users[i].0;
                    return Err(format!(
                        "parameter `{name}` ({ty}) is broadcast onto the sequence as a position table but also used by {user} (`{}`)",
                        g.node(user).op.name()
                    ));
                }
                tables.insert(v, d);
            }
            _ => {}
        }
    }
    Ok(tables)
}

/// The layout being built: sequence length and devices.
struct Layout {
    seq: usize,
    ways: usize,
}

impl Layout {
    /// `x` with dim `dim` (of the sequence's length) reordered into the load-balanced layout:
    /// one slice per chunk, concatenated in [`chunk_order`]; the new nodes get scope `path`.
    fn permute(
        &self,
        g: &mut Graph,
        x: ValueId,
        dim: usize,
        path: &str,
    ) -> Result<ValueId, PassError> {
        let before = g.num_nodes();
        let chunk = self.seq / (2 * self.ways);
        let parts = chunk_order(self.ways)
            .into_iter()
            .map(|c| {
                g.add(
                    Op::Slice {
                        dim,
                        start: c * chunk,
                        end: (c + 1) * chunk,
                    },
                    &[x],
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let y = g.add(Op::Concat { dim }, &parts)?;
        scope_new(g, before, path);
        Ok(y)
    }

    /// Whether `n` is a [`Layout::permute`] of `ways` devices: a concat along its dim of the
    /// chunk slices of one value in [`chunk_order`]. Returns the dim.
    fn permutation_dim(g: &Graph, n: NodeId, ways: usize) -> Option<usize> {
        let node = g.node(n);
        let Op::Concat { dim } = node.op else {
            return None;
        };
        let order = chunk_order(ways);
        if node.inputs.len() != order.len() {
            return None;
        }
        let mut source = None;
        for (&part, &c) in node.inputs.iter().zip(&order) {
            let slice = g.node(g.value(part).producer);
            let Op::Slice { dim: d, start, end } = slice.op else {
                return None;
            };
            let chunk = end.checked_sub(start)?;
            if d != dim
                || chunk == 0
                || start != c * chunk
                || *source.get_or_insert(slice.inputs[0]) != slice.inputs[0]
            {
                return None;
            }
        }
        Some(dim)
    }

    /// The positions of the laid-out rows (built once, at first use).
    fn positions(&self, g: &mut Graph, cache: &mut Option<ValueId>) -> Result<ValueId, PassError> {
        if let Some(p) = *cache {
            return Ok(p);
        }
        let before = g.num_nodes();
        let iota = crate::sharding::iota(g, self.seq, DType::I64)?;
        scope_new(g, before, LAYOUT_IOTA);
        let p = self.permute(g, iota, 0, LAYOUT_POSITIONS)?;
        *cache = Some(p);
        Ok(p)
    }
}

/// Gives scope `path` (for dumps) and forward metadata to every node added since `g` had
/// `before` nodes; the data's permutation belongs to the embedding, which reads it.
fn scope_new(g: &mut Graph, before: usize, path: &str) {
    let meta = NodeMeta {
        phase: Some(Phase::Forward),
        layer: (path == LAYOUT_DATA).then_some(LayerId::Embedding),
        ..NodeMeta::default()
    };
    for id in before..g.num_nodes() {
        g.set_scope(NodeId(id as u32), Some(path.to_string()));
        g.set_meta(NodeId(id as u32), meta);
    }
}

/// The context-parallel placements of a step (or forward) graph laid out by
/// [`load_balance`] on a mesh whose [`CONTEXT_AXIS`] is longer than 1: the permuted data
/// inputs `S(1)` and the permuted positions `S(0)`; nothing else is fixed. An error when the
/// graph was not laid out.
pub fn context_parallel_constraints(
    g: &Graph,
    mesh: &DeviceMesh,
    c: &mut Constraints,
) -> Result<(), PassError> {
    let Some(ways) = mesh.axis_size(CONTEXT_AXIS).filter(|&n| n > 1) else {
        return Ok(());
    };
    let mut found = false;
    // The `[batch, seq]` of the laid-out activations, from the permuted data inputs.
    let mut rows: Option<(usize, usize)> = None;
    for n in g.nodes_in_order() {
        let node = g.node(n);
        let Some(dim) = Layout::permutation_dim(g, n, ways) else {
            continue;
        };
        let v = node.outputs[0];
        let ty = g.ty(v);
        // The data inputs `[batch, seq, ...]` on dim 1, the integer positions `[seq]` on dim 0
        // (a learned position table, float, is read through the data's layout).
        let data = dim == 1;
        let p = match dim {
            1 => Placement::Shard(1),
            0 if !ty.dtype.is_float() => Placement::Shard(0),
            _ => continue,
        };
        let Placement::Shard(d) = p else { continue };
        if !ty.dims()[d].is_multiple_of(ways) {
            return Err(PassError::ContextParallel {
                axis: CONTEXT_AXIS.to_string(),
                ways,
                detail: format!("dim {d} of {v} ({ty}) does not split {ways} ways"),
            });
        }
        let fixed = c.fixed.entry(v).or_default();
        if !fixed.iter().any(|(a, _)| a == CONTEXT_AXIS) {
            fixed.push((CONTEXT_AXIS.to_string(), p));
        }
        if data {
            found = true;
            rows = rows.or(Some((ty.dims()[0], ty.dims()[1])));
        }
    }
    // The backward runs on sequence shards too: its `[batch, seq, ...]` activations are
    // fixed like the forward's, so that no op of the backward gathers the sequence (any
    // partial sum over the local rows is reduce-scattered back onto the shards).
    if let Some((batch, seq)) = rows {
        for n in g.nodes_in_order() {
            let node = g.node(n);
            if g.meta(n).phase != Some(Phase::Backward) {
                continue;
            }
            for &v in &node.outputs {
                let ty = g.ty(v);
                let activation = matches!(ty.rank(), 3 | 4)
                    && ty.dtype.is_float()
                    && ty.dims()[0] == batch
                    && ty.dims()[1] == seq
                    && seq.is_multiple_of(ways);
                if activation {
                    let fixed = c.fixed.entry(v).or_default();
                    if !fixed.iter().any(|(a, _)| a == CONTEXT_AXIS) {
                        fixed.push((CONTEXT_AXIS.to_string(), Placement::Shard(1)));
                    }
                }
            }
        }
    }
    if found {
        Ok(())
    } else {
        Err(PassError::ContextParallel {
            axis: CONTEXT_AXIS.to_string(),
            ways,
            detail: format!(
                "`{}` is not laid out for context parallelism: its forward must be rewritten by `context_parallel::load_balance` before the training step is built",
                g.name()
            ),
        })
    }
}
