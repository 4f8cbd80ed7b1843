//! Reverse-mode automatic differentiation over the IR.
//!
//! [`differentiate`] appends to a graph the nodes that compute the gradient of a scalar loss
//! with respect to chosen values (usually parameters). Every op has a vector-Jacobian product
//! (VJP) rule written with IR ops in the `vjp` module; the rules match on [`Op`] exhaustively, so a
//! new op must get a rule or an explicit refusal.
//!
//! # What is differentiable
//!
//! - Only float values carry gradients: integer and `bool` operands (token ids, positions,
//!   comparison results, select conditions) get none.
//! - Comparisons have no gradient (their results are `bool`); `moe_route`'s dispatch mask is
//!   piecewise constant in the router probabilities, so its derivative is zero wherever it
//!   exists: it is treated as a constant, and no gradient is computed towards it.
//! - Optimizer updates, collectives and point-to-point ops have no rule yet: a gradient that
//!   would flow through one is a [`PassError::NotDifferentiable`].
//! - At ties, `max`/`min` and `reduce_max`/`reduce_min` choose a subgradient: the binary ops
//!   give the whole gradient to their first operand, the reductions to every tied element.
//!
//! # Metadata and scopes
//!
//! The gradient nodes of a forward node get its [`NodeMeta`] (micro-batch and layer) with the
//! phase [`Phase::Backward`] (and no weight role); the nodes a backward rule computes from
//! forward values only (the attention probabilities) get [`Phase::Saved`]. Passes read these,
//! never the scope strings below, which are provenance for humans.
//!
//! A scope is a list of tags, each ending in `/`, followed by a layer path:
//! `mb1/grad/h.0.attn` is the layer path `h.0.attn` with the tags `mb1/` and `grad/`. The
//! gradient nodes of a forward node get the forward node's tags, then `grad/`, then its path
//! ([`grad_scope`]); a forward node without a scope gives `grad/`. Nodes that only compute
//! from forward values what a backward rule needs to keep (the attention probabilities) are
//! tagged `saved/` instead ([`saved_scope`]): scheduling decides whether they run in the
//! forward (and are stored) or just before their use (recomputed).

mod emit;
mod vjp;

use std::collections::{HashMap, HashSet};

use autopar_ir::{Graph, NodeMeta, Op, Phase, ValueId};

pub(crate) use emit::Emitter;

use crate::error::PassError;

/// Tag of gradient (backward) nodes.
pub const GRAD_TAG: &str = "grad/";
/// Tag of nodes that compute, from forward values only, what a backward rule keeps.
pub const SAVED_TAG: &str = "saved/";

/// Splits a scope into its tags (each ending in `/`, concatenated) and its layer path:
/// `"mb1/grad/h.0.attn"` gives `("mb1/grad/", "h.0.attn")`.
pub fn split_scope(scope: &str) -> (&str, &str) {
    match scope.rfind('/') {
        Some(i) => scope.split_at(i + 1),
        None => ("", scope),
    }
}

/// The scope of the gradient nodes of a forward node with scope `forward`:
/// `mb0/h.0.mlp` → `mb0/grad/h.0.mlp`, `h.0.mlp` → `grad/h.0.mlp`, none → `grad/`.
pub fn grad_scope(forward: Option<&str>) -> String {
    with_tag(forward, GRAD_TAG)
}

/// The scope of the nodes a backward rule computes from forward values only (see the
/// module docs): `mb0/h.0.attn` → `mb0/saved/h.0.attn`.
pub fn saved_scope(forward: Option<&str>) -> String {
    with_tag(forward, SAVED_TAG)
}

/// `forward`'s tags, then `tag`, then its path.
pub fn with_tag(forward: Option<&str>, tag: &str) -> String {
    let (tags, path) = split_scope(forward.unwrap_or(""));
    format!("{tags}{tag}{path}")
}

/// Appends to `g` the gradient of the scalar float value `loss` with respect to each value of
/// `wrt`, and returns the gradient values in the same order: `None` for a value the loss does
/// not depend on (or one that is not a float). Each gradient has its value's type.
///
/// `seed` is the gradient of `loss` itself (a value of the loss's type); `None` means 1.
/// Passing `1/m` or a loss scale here scales every gradient without an extra pass over them.
///
/// Only the nodes on a path from `wrt` to `loss` are differentiated, in reverse topological
/// order; contributions to one value from several users are summed in that order.
pub fn differentiate(
    g: &mut Graph,
    loss: ValueId,
    seed: Option<ValueId>,
    wrt: &[ValueId],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let loss_ty = g.value_checked(loss)?.ty.clone();
    if !loss_ty.dtype.is_float() || loss_ty.num_elements() != 1 {
        return Err(PassError::BadGraph {
            graph: g.name().to_string(),
            detail: format!("the loss {loss} must be a one-element float tensor, not {loss_ty}"),
        });
    }
    let order = g.topo_order()?;

    // Values that depend on some `wrt` value (only floats carry derivatives).
    let mut active: HashSet<ValueId> = wrt
        .iter()
        .copied()
        .filter(|&v| g.value_checked(v).is_ok_and(|x| x.ty.dtype.is_float()))
        .collect();
    for &n in &order {
        let node = g.node(n);
        if node.inputs.iter().any(|v| active.contains(v)) {
            for (i, &v) in node.outputs.iter().enumerate() {
                // `moe_route`'s dispatch mask (result 1) has no derivative: no gradient is
                // computed for it at all (not even through the ops that consume it).
                let constant = matches!(node.op, Op::MoeRoute { .. }) && i == 1;
                if g.ty(v).dtype.is_float() && !constant {
                    active.insert(v);
                }
            }
        }
    }
    // Values the loss depends on.
    let mut useful: HashSet<ValueId> = HashSet::from([loss]);
    for &n in order.iter().rev() {
        let node = g.node(n);
        if node.outputs.iter().any(|v| useful.contains(v)) {
            useful.extend(node.inputs.iter().copied());
        }
    }

    let seed = match seed {
        Some(s) => {
            let ty = &g.value_checked(s)?.ty;
            if *ty != loss_ty {
                return Err(PassError::BadGraph {
                    graph: g.name().to_string(),
                    detail: format!("the seed {s} is {ty}, but the loss is {loss_ty}"),
                });
            }
            s
        }
        None => {
            let meta = NodeMeta {
                phase: Some(Phase::Backward),
                micro_batch: g.meta(g.value(loss).producer).micro_batch,
                ..NodeMeta::default()
            };
            let mut e = Emitter::new(g, Some(GRAD_TAG.to_string()), meta);
            e.constant(loss_ty, 1.0)?
        }
    };

    let mut grads: HashMap<ValueId, ValueId> = HashMap::from([(loss, seed)]);
    for &n in order.iter().rev() {
        let node = g.node(n).clone();
        let out_grads: Vec<Option<ValueId>> = node
            .outputs
            .iter()
            .map(|v| {
                (active.contains(v) && useful.contains(v))
                    .then(|| grads.get(v).copied())
                    .flatten()
            })
            .collect();
        if out_grads.iter().all(Option::is_none) {
            continue;
        }
        let wanted: Vec<bool> = node
            .inputs
            .iter()
            .map(|v| active.contains(v) && useful.contains(v))
            .collect();
        if !wanted.iter().any(|&w| w) {
            continue;
        }
        let scope = grad_scope(node.scope.as_deref());
        let meta = g.meta(n).with_phase(Phase::Backward).without_role();
        let mut e = Emitter::new(g, Some(scope.clone()), meta);
        let in_grads = vjp::vjp(&mut e, n, &node, &out_grads, &wanted)?;
        for ((&v, grad), want) in node.inputs.iter().zip(in_grads).zip(&wanted) {
            let Some(grad) = grad else { continue };
            if !want {
                continue;
            }
            debug_assert_eq!(e.g.ty(grad), e.g.ty(v), "VJP of {} for {v}", node.op);
            let total = match grads.get(&v) {
                Some(&prev) => e.add(prev, grad)?,
                None => grad,
            };
            grads.insert(v, total);
        }
    }
    Ok(wrt.iter().map(|v| grads.get(v).copied()).collect())
}

/// True when the gradient of `op`'s results can flow to its operands (some operands may
/// still be non-differentiable, such as integer ids).
pub fn has_vjp(op: &Op) -> bool {
    vjp::has_rule(op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::has_tag;

    #[test]
    fn scopes_are_tags_then_a_path() {
        assert_eq!(split_scope("mb1/grad/h.0.attn"), ("mb1/grad/", "h.0.attn"));
        assert_eq!(split_scope("h.0"), ("", "h.0"));
        assert_eq!(grad_scope(Some("mb0/h.0.mlp")), "mb0/grad/h.0.mlp");
        assert_eq!(grad_scope(Some("h.0.mlp")), "grad/h.0.mlp");
        assert_eq!(grad_scope(None), "grad/");
        assert_eq!(saved_scope(Some("mb3/h.1.attn")), "mb3/saved/h.1.attn");
        assert!(has_tag(Some("mb3/saved/h.1.attn"), SAVED_TAG));
        assert!(!has_tag(Some("mb3/h.1.saved"), SAVED_TAG));
        assert!(!has_tag(None, GRAD_TAG));
    }
}
