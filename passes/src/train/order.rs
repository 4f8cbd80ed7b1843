//! The execution order of a training-step graph, made explicit in its node ids.
//!
//! The reference interpreter runs a graph in [`Graph::topo_order`], which takes the lowest
//! node id among the ready nodes, and frees each value after its last use. So the order in
//! which nodes are numbered decides what is stored between forward and backward. [`sequence`]
//! renumbers a step graph (value ids are kept) so that:
//!
//! - forward, gradient and optimizer nodes keep their relative order (they are *anchored*);
//! - nodes of phase [`Phase::Saved`](autopar_ir::Phase::Saved) (see [`crate::autodiff`]) run as early as their operands allow, that is
//!   in the forward, so their results are stored until the backward uses them;
//! - [`Phase::Recompute`](autopar_ir::Phase::Recompute) nodes ([`crate::recompute`]), constants, parameters and inputs run as late
//!   as possible, just before their first user, so a recomputed activation lives only from
//!   its recomputation to its last backward use.
//!
//! Later passes that copy nodes in topological order keep this order.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use autopar_ir::{Graph, NodeId, Op, Phase as MetaPhase};

use crate::autodiff::split_scope;
use crate::error::PassError;

/// Tag of recomputed forward nodes.
pub const RECOMPUTE_TAG: &str = "recompute/";

/// When a node should run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// In program order.
    Anchored,
    /// As soon as its operands exist.
    Early,
    /// Just before its first user.
    Late,
}

/// True when `scope` carries the tag `tag` (written with its trailing `/`). Scopes are
/// provenance for humans: passes read [`Graph::meta`] instead.
pub fn has_tag(scope: Option<&str>, tag: &str) -> bool {
    let name = tag.trim_end_matches('/');
    scope.is_some_and(|s| split_scope(s).0.split('/').any(|t| t == name))
}

/// `g` with its nodes renumbered in the execution order described in the module docs. The
/// result is structurally the same graph: same values, types, shardings, scopes, metadata and outputs.
pub fn sequence(g: &Graph) -> Result<Graph, PassError> {
    let topo = g.topo_order()?;
    let position: HashMap<NodeId, i64> = topo
        .iter()
        .enumerate()
        .map(|(i, &n)| (n, i as i64))
        .collect();
    let producer = |v| g.value(v).producer;

    let mut placement: HashMap<NodeId, Placement> = HashMap::new();
    let mut key: HashMap<NodeId, (i64, i64)> = HashMap::new();
    for &n in &topo {
        let node = g.node(n);
        let phase = g.meta(n).phase;
        let source = matches!(
            node.op,
            Op::Constant { .. } | Op::Parameter { .. } | Op::Input { .. }
        );
        let p = if source || phase == Some(MetaPhase::Recompute) {
            Placement::Late
        } else if phase == Some(MetaPhase::Saved) {
            // After the latest operand that is not itself placed late.
            let after = node
                .inputs
                .iter()
                .map(|&v| producer(v))
                .filter(|m| placement.get(m) != Some(&Placement::Late))
                .filter_map(|m| key.get(&m).copied())
                .max();
            match after {
                Some((major, minor)) => {
                    key.insert(n, (major, minor + 1));
                    Placement::Early
                }
                None => Placement::Late,
            }
        } else {
            key.insert(n, (position[&n], 0));
            Placement::Anchored
        };
        placement.insert(n, p);
    }
    // Late nodes take the key of their earliest user, just below it.
    for &n in topo.iter().rev() {
        if placement[&n] != Placement::Late {
            continue;
        }
        let earliest = g
            .node(n)
            .outputs
            .iter()
            .flat_map(|&v| g.users(v))
            .filter_map(|(user, _)| key.get(&user).copied())
            .min()
            .map_or((i64::MAX, 0), |(major, minor)| (major, minor - 1));
        key.insert(n, earliest);
    }

    // Kahn's algorithm, taking the smallest key among ready nodes.
    let mut pending: HashMap<NodeId, usize> = HashMap::new();
    let mut ready = BinaryHeap::new();
    for &n in &topo {
        let deps = g.node(n).inputs.len();
        if deps == 0 {
            ready.push(Reverse((key[&n], position[&n], n)));
        } else {
            pending.insert(n, deps);
        }
    }
    let mut order = Vec::with_capacity(topo.len());
    while let Some(Reverse((_, _, n))) = ready.pop() {
        order.push(n);
        for &v in &g.node(n).outputs {
            for (user, _) in g.users(v) {
                if let Some(d) = pending.get_mut(&user) {
                    *d -= 1;
                    if *d == 0 {
                        pending.remove(&user);
                        ready.push(Reverse((key[&user], position[&user], user)));
                    }
                }
            }
        }
    }
    rebuild(g, &order)
}

/// A copy of `g` whose nodes are added in `order` (a topological order of all its nodes),
/// keeping value ids, scopes, metadata, shardings and outputs.
pub(crate) fn rebuild(g: &Graph, order: &[NodeId]) -> Result<Graph, PassError> {
    let mut out = Graph::new(g.name());
    out.set_mesh(g.mesh().cloned());
    for &n in order {
        let node = g.node(n);
        out.copy_node(g, n, &node.inputs, &node.outputs)?;
        for &v in &node.outputs {
            out.set_sharding(v, g.value(v).sharding.clone())?;
        }
    }
    for (name, v) in g.outputs() {
        out.add_output(name.clone(), *v)?;
    }
    Ok(out)
}
