//! Activation recompute as a transformation of the training-step graph.
//!
//! The interpreter (like a real device) keeps a value from the node that makes it to its last
//! user; in a step graph the forward activations that the backward reads are therefore held
//! from the forward to the backward. [`recompute`] trades that memory for compute:
//!
//! - [`Recompute::Selective`] (Megatron's selective recompute): the attention core, the
//!   nodes of phase [`Phase::Saved`](autopar_ir::Phase::Saved) that compute the attention
//!   probabilities, gets the phase [`Phase::Recompute`](autopar_ir::Phase::Recompute) (and the
//!   scope tag `recompute/` instead of `saved/`), so it
//!   runs just before the attention backward instead of in the forward, and the `[b, h, s, t]`
//!   probabilities are not stored. A fused `attention_backward` (the gradient of attention
//!   with explicit positions) stores none to begin with.
//! - [`Recompute::Full`]: for every block (nodes whose metadata layer is a
//!   [`LayerId::Block`]) and every micro-batch, the backward of the block reads a copy of the
//!   block's forward, rebuilt from the values that enter it (its input activation and the
//!   weights), each copy with the metadata of its original in phase `Recompute` (scope
//!   `mb{k}/recompute/<path>`). Only the layer inputs stay stored;
//!   uses by the backward of *other* layers keep the stored originals.
//!
//! Both give the same numbers as no recompute: the copies are the same ops on the same
//! values. The result is renumbered by [`crate::train::sequence`], which places
//! `recompute/` nodes just before their first user; nodes left without users are removed.

use std::collections::{HashMap, HashSet};

use autopar_ir::{Graph, LayerId, NodeId, Op, Phase as MetaPhase, ValueId};

use crate::autodiff::{SAVED_TAG, split_scope};
use crate::error::PassError;
use crate::train::order::{RECOMPUTE_TAG, rebuild, sequence};

/// Which activations the backward recomputes instead of reading stored ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Store everything the backward reads.
    #[default]
    None,
    /// Recompute the attention core (softmax probabilities) only.
    Selective,
    /// Recompute each layer's forward from its stored input.
    Full,
}

/// Applies `policy` to a step graph built by [`crate::train::build_train_step`] (see the
/// module docs). The result is sequenced; [`Recompute::None`] returns the graph unchanged.
pub fn recompute(step: &Graph, policy: Recompute) -> Result<Graph, PassError> {
    match policy {
        Recompute::None => Ok(step.clone()),
        Recompute::Selective => {
            let mut g = step.clone();
            let saved: Vec<NodeId> = g
                .node_ids()
                .into_iter()
                .filter(|&n| g.meta(n).phase == Some(MetaPhase::Saved))
                .collect();
            let has_attention_core = !saved.is_empty();
            // A fused attention backward (attention with explicit positions) recomputes its
            // probabilities by itself: nothing is stored to recompute.
            let fused = g
                .node_ids()
                .into_iter()
                .any(|n| matches!(g.node(n).op, Op::AttentionBackward { .. }));
            if !has_attention_core && !fused {
                return Err(PassError::BadOption {
                    option: "--recompute selective",
                    detail: format!("`{}` has no attention core to recompute", step.name()),
                });
            }
            for n in saved {
                let meta = g.meta(n).with_phase(MetaPhase::Recompute);
                g.set_meta(n, meta);
                // The scope follows, as provenance for humans.
                let scope = g.node(n).scope.clone();
                if let Some(s) = scope.as_deref()
                    && let Some(retagged) = replace_tag(s, SAVED_TAG, RECOMPUTE_TAG)
                {
                    g.set_scope(n, Some(retagged));
                }
            }
            sequence(&g)
        }
        Recompute::Full => {
            let has_layers = step
                .node_ids()
                .into_iter()
                .any(|n| classify(step, n).is_some());
            if !has_layers {
                return Err(PassError::BadOption {
                    option: "--recompute full",
                    detail: format!(
                        "`{}` has no layers to recompute (no node has a `layer=block(N)` in its metadata)",
                        step.name()
                    ),
                });
            }
            let g = recompute_layers(step)?;
            let g = remove_dead(&g)?;
            sequence(&g)
        }
    }
}

/// The layer a layer path belongs to: its first two segments when the second is an index
/// (`h.3.attn` → `h.3`). A naming convention of the zoo, for reading scopes; passes find
/// layers in [`Graph::meta`].
pub fn layer_of(path: &str) -> Option<&str> {
    let mut dots = path.match_indices('.').map(|(i, _)| i);
    let first = dots.next()?;
    let end = dots.next().unwrap_or(path.len());
    let index = &path[first + 1..end];
    (!index.is_empty() && index.bytes().all(|b| b.is_ascii_digit())).then(|| &path[..end])
}

/// `scope` with tag `from` replaced by `to`, when it has `from`.
fn replace_tag(scope: &str, from: &str, to: &str) -> Option<String> {
    let (tags, path) = split_scope(scope);
    let name = from.trim_end_matches('/');
    let parts: Vec<&str> = tags.split('/').filter(|t| !t.is_empty()).collect();
    if !parts.contains(&name) {
        return None;
    }
    let mut out = String::new();
    for t in parts {
        if t == name {
            out.push_str(to);
        } else {
            out.push_str(t);
            out.push('/');
        }
    }
    out.push_str(path);
    Some(out)
}

/// Where a node sits: its micro-batch and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct LayerKey {
    /// The micro-batch, if any.
    batch: Option<u32>,
    /// The block index.
    layer: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Forward,
    Backward,
    Other,
}

/// The block and micro-batch of node `n`, and its phase as full recompute sees it; `None`
/// outside the blocks.
fn classify(g: &Graph, n: NodeId) -> Option<(LayerKey, Phase)> {
    let meta = g.meta(n);
    let layer = meta.layer.and_then(LayerId::block)?;
    let phase = match meta.phase {
        // Parameters have no phase; saved values are part of the forward here: full
        // recompute rebuilds them too.
        None | Some(MetaPhase::Forward | MetaPhase::Saved) => Phase::Forward,
        Some(MetaPhase::Backward) => Phase::Backward,
        Some(MetaPhase::Recompute | MetaPhase::Accumulate | MetaPhase::Optimizer) => Phase::Other,
    };
    Some((
        LayerKey {
            batch: meta.micro_batch,
            layer,
        },
        phase,
    ))
}

/// Rewires the backward of every layer to a recomputed copy of its forward.
fn recompute_layers(step: &Graph) -> Result<Graph, PassError> {
    let order = step.topo_order()?;
    let place: HashMap<NodeId, (LayerKey, Phase)> = order
        .iter()
        .filter_map(|&n| classify(step, n).map(|c| (n, c)))
        .collect();
    let forward_in = |v: ValueId, key: &LayerKey| {
        let p = step.value(v).producer;
        let source = step.node(p).op.is_source() && !matches!(step.node(p).op, Op::Constant { .. });
        !source
            && place
                .get(&p)
                .is_some_and(|(k, ph)| *ph == Phase::Forward && k == key)
    };

    let mut next_value = step.value_ids().last().map_or(0, |v| v.0 + 1);
    let mut out = Graph::new(step.name());
    out.set_mesh(step.mesh().cloned());
    // Clones, by original value.
    let mut clones: HashMap<ValueId, ValueId> = HashMap::new();
    for &n in &order {
        let node = step.node(n);
        let mut inputs = node.inputs.clone();
        if let Some((key, Phase::Backward)) = place.get(&n) {
            for v in &mut inputs {
                if forward_in(*v, key) {
                    *v = clone_value(
                        step,
                        *v,
                        key,
                        &forward_in,
                        &mut clones,
                        &mut out,
                        &mut next_value,
                    )?;
                }
            }
        }
        out.copy_node(step, n, &inputs, &node.outputs)?;
        for &v in &node.outputs {
            out.set_sharding(v, step.value(v).sharding.clone())?;
        }
    }
    for (name, v) in step.outputs() {
        out.add_output(name.clone(), *v)?;
    }
    Ok(out)
}

/// The recomputed copy of `v` (produced in layer `key`'s forward), adding it and the copies
/// it needs to `out`.
fn clone_value(
    step: &Graph,
    v: ValueId,
    key: &LayerKey,
    forward_in: &dyn Fn(ValueId, &LayerKey) -> bool,
    clones: &mut HashMap<ValueId, ValueId>,
    out: &mut Graph,
    next_value: &mut u32,
) -> Result<ValueId, PassError> {
    if let Some(&c) = clones.get(&v) {
        return Ok(c);
    }
    let p = step.value(v).producer;
    let node = step.node(p);
    let mut inputs = Vec::with_capacity(node.inputs.len());
    for &i in &node.inputs {
        inputs.push(if forward_in(i, key) {
            clone_value(step, i, key, forward_in, clones, out, next_value)?
        } else {
            i
        });
    }
    let ids: Vec<ValueId> = node
        .outputs
        .iter()
        .map(|_| {
            let id = ValueId(*next_value);
            *next_value += 1;
            id
        })
        .collect();
    let scope = node.scope.as_deref().map(|s| {
        replace_tag(s, SAVED_TAG, RECOMPUTE_TAG).unwrap_or_else(|| {
            let (tags, path) = split_scope(s);
            format!("{tags}{RECOMPUTE_TAG}{path}")
        })
    });
    let copy = out.add_node_with_ids(node.op.clone(), &inputs, &ids, scope)?;
    out.set_meta(copy, step.meta(p).with_phase(MetaPhase::Recompute));
    for (&old, &new) in node.outputs.iter().zip(&ids) {
        out.set_sharding(new, step.value(old).sharding.clone())?;
        clones.insert(old, new);
    }
    Ok(clones[&v])
}

/// `g` without the nodes no output depends on (parameters and inputs are kept, so the feeds
/// of a graph do not change).
fn remove_dead(g: &Graph) -> Result<Graph, PassError> {
    let mut live: HashSet<NodeId> = HashSet::new();
    let mut stack: Vec<NodeId> = g
        .outputs()
        .iter()
        .map(|(_, v)| g.value(*v).producer)
        .collect();
    for n in g.node_ids() {
        let node = g.node(n);
        if node.outputs.is_empty() || matches!(node.op, Op::Parameter { .. } | Op::Input { .. }) {
            stack.push(n);
        }
    }
    while let Some(n) = stack.pop() {
        if live.insert(n) {
            stack.extend(g.node(n).inputs.iter().map(|&v| g.value(v).producer));
        }
    }
    let order: Vec<NodeId> = g
        .topo_order()?
        .into_iter()
        .filter(|n| live.contains(n))
        .collect();
    rebuild(g, &order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_indexed_path_prefixes() {
        assert_eq!(layer_of("h.3.attn"), Some("h.3"));
        assert_eq!(layer_of("h.12"), Some("h.12"));
        assert_eq!(layer_of("layers.0.mlp.w1"), Some("layers.0"));
        assert_eq!(layer_of("embed"), None);
        assert_eq!(layer_of("h.x.attn"), None);
        assert_eq!(layer_of("h."), None);
    }

    #[test]
    fn tags_are_replaced_in_place() {
        assert_eq!(
            replace_tag("mb1/saved/h.0.attn", SAVED_TAG, RECOMPUTE_TAG).as_deref(),
            Some("mb1/recompute/h.0.attn")
        );
        assert_eq!(replace_tag("mb1/h.0.attn", SAVED_TAG, RECOMPUTE_TAG), None);
    }
}
