//! Expert parallelism as placements: the policy of the expert-parallel mesh axis (`ep`).
//!
//! `ep` is a data-like axis carved out of data parallelism: the data inputs are split on
//! their batch dim over `ep` as well as over `dp` (nested in mesh order), every weight is
//! replicated on `ep` with its gradient all-reduced over `ep` (ZeRO shards its state over
//! `ep` as over `dp`, [`crate::parallelize::zero_constraints`]), except the experts' weights,
//! which model code annotates `S(0)` on `ep` (their leading expert dim, `.shard(0, "ep")`)
//! and whose gradients stay `S(0)` (each rank's experts see only the tokens routed to them).
//!
//! Nothing about MoE is special-cased past that. `moe_route` routes each routing group (a
//! sequence) independently, so it runs on the group shards of its rank; the dispatched
//! tokens `[e, g, c, h]` come out sharded on the group dim, and the expert matmul, whose
//! weight is stationary on its expert shard, needs them sharded on the expert dim:
//! propagation reshards `S(1) -> S(0)` with one all-to-all (dispatch), and the experts'
//! output back `S(0) -> S(1)` for the combine with another; the backward mirrors both.

use autopar_ir::{DeviceMesh, Graph, Op, Placement, ShardingOrigin};

use crate::error::PassError;
use crate::parallelize::{DATA_AXIS, gradient_source};
use crate::propagate::{Constraints, tensor_name};

/// The expert-parallel mesh axis.
pub const EXPERT_AXIS: &str = autopar_ir::axis::EP;

/// Adds the expert-parallel constraints of `g` on `mesh` to `c` (see the module docs). An
/// error when the mesh has no `ep` axis above 1, when `g` has no MoE layer or no weight
/// sharded on `ep`, or when a data input's batch does not split over `dp` and `ep`.
pub fn expert_parallel_constraints(
    g: &Graph,
    mesh: &DeviceMesh,
    c: &mut Constraints,
) -> Result<(), PassError> {
    let bad = |detail: String| PassError::BadOption {
        option: "--mesh",
        detail,
    };
    let Some(ep) = mesh.axis_size(EXPERT_AXIS).filter(|&n| n > 1) else {
        return Err(bad(format!(
            "expert parallelism needs a `{EXPERT_AXIS}` axis above 1 in the mesh"
        )));
    };
    let nodes = g.nodes_in_order();
    if !nodes
        .iter()
        .any(|&n| matches!(g.node(n).op, Op::MoeRoute { .. }))
    {
        return Err(bad(format!(
            "mesh axis `{EXPERT_AXIS}` shards experts, but `{}` has no MoE layer (`moe_route`)",
            g.name()
        )));
    }
    // The experts: weights the model shards on `ep`.
    let expert_placement = |v| {
        g.value(v)
            .sharding
            .as_ref()
            .filter(|s| s.origin == ShardingOrigin::User)
            .and_then(|s| s.get(EXPERT_AXIS))
    };
    let experts: Vec<_> = g
        .parameters()
        .into_iter()
        .filter_map(|(v, _, _)| match expert_placement(v) {
            Some(p @ Placement::Shard(_)) => Some((v, p)),
            _ => None,
        })
        .collect();
    if experts.is_empty() {
        return Err(bad(format!(
            "`{}` shards no weight on mesh axis `{EXPERT_AXIS}`: annotate the experts' weights on their expert dim (`.shard(0, \"{EXPERT_AXIS}\")`)",
            g.name()
        )));
    }

    // Data inputs: the batch dim over `dp` and `ep` (in mesh order).
    let dp = mesh.axis_size(DATA_AXIS).unwrap_or(1);
    let mut nested = [(DATA_AXIS, dp), (EXPERT_AXIS, ep)];
    nested.sort_by_key(|(a, _)| mesh.axis_index(a));
    for (v, _, _) in g.inputs() {
        let ty = g.ty(v);
        let Some(&b) = ty.dims().first() else {
            continue;
        };
        let mut ways = 1;
        for (axis, n) in nested {
            ways *= n;
            if !b.is_multiple_of(ways) {
                return Err(PassError::UnevenShard {
                    tensor: tensor_name(g, v),
                    ty: ty.to_string(),
                    dim: 0,
                    size: b,
                    axis: axis.to_string(),
                    ways,
                });
            }
        }
        let fixed = c.fixed.entry(v).or_default();
        if !fixed.iter().any(|(a, _)| a == EXPERT_AXIS) {
            fixed.push((EXPERT_AXIS.to_string(), Placement::Shard(0)));
        }
    }

    // Gradients: an expert's stays on its rank's experts, every other is reduced over `ep`.
    for &n in &nodes {
        let node = g.node(n);
        if !matches!(node.op, Op::SgdUpdate { .. } | Op::AdamWUpdate { .. }) {
            continue;
        }
        let weight = node.inputs[0];
        let p = experts
            .iter()
            .find(|(v, _)| *v == weight)
            .map_or(Placement::Replicate, |&(_, p)| p);
        let grad = gradient_source(g, node.inputs[1]);
        let fixed = c.fixed.entry(grad).or_default();
        if !fixed.iter().any(|(a, _)| a == EXPERT_AXIS) {
            fixed.push((EXPERT_AXIS.to_string(), p));
        }
    }
    Ok(())
}
