//! Sharding propagation (semi-automatic, GSPMD-style): from the user's annotations and a few
//! policy constraints, give every value of a graph a complete sharding over the graph's mesh
//! and choose, for every node and mesh axis, the strategy the partitioner will run.
//!
//! # What is fixed, and what is chosen
//!
//! - **User annotations** (`ShardingOrigin::User`, from model code, `.air` files or the
//!   command line) are never overwritten. Axes the mesh lacks are dropped (they have size 1).
//!   A split that does not divide is an error naming the tensor, the dim and the mesh axis.
//! - **Constraints** ([`Constraints`]) come from a parallelisation policy
//!   ([`crate::parallelize`]): data inputs split on their batch dim over the data axis, ZeRO
//!   placements of weights, gradients and optimizer state, and, for a few nodes, the operand
//!   placements their strategy must take ([`Constraints::operands`]).
//! - **Outputs**: an output named like a parameter (the next value of training state) takes
//!   that parameter's sharding, so the next step can feed it back; every other output is
//!   replicated.
//! - Every other source is replicated. Everything else is chosen here.
//!
//! # How
//!
//! Mesh axes are handled one at a time, outermost first; an axis sees the local types the
//! previous axes left, as [`crate::sharding::strategies`] expects. On one axis, a forward
//! sweep in topological order gives each node the admissible strategy of least cost given its
//! operands' placements; then a backward sweep lets a producer switch to the placement that
//! all its consumers require when that costs it nothing more; forward and backward sweeps
//! repeat until nothing changes (at most [`MAX_SWEEPS`] rounds). A forward sweep keeps a
//! node's current strategy when no other is cheaper, so what a backward sweep settled stays.
//!
//! **Cost** of a strategy: the bytes each device sends to reshard its operands (and its results
//! to a fixed placement), by the single-axis formulas of [`autopar_ir::reshard`] (all-reduce
//! `2(n-1)/n·L`, all-gather `(n-1)·L`, reduce-scatter and all-to-all `(n-1)/n·L`, slices free),
//! plus [`COLLECTIVE_BYTES`] per collective for its latency, plus, for a partial result that
//! no constraint fixes, the reduce-scatter its first use will need at least (so that leaving
//! partial sums is not mistaken for free). A reshard that a consumer earlier in topological
//! order already asks for costs nothing: the partitioner caches resharded copies (the backward
//! of expert parallelism's combine reuses the forward's all-to-all of the experts' output
//! instead of gathering the tokens' gradient). A value's bytes are those it will have once
//! every axis has run: before the first axis, each later axis's demands (below) are found on
//! the global types, and a value a later axis is expected to shard is priced at its shard
//! (on `dp`, which runs before `tp`, the gradient of a vocabulary-sharded embedding costs the
//! all-reduce of its `tp` shard, not of the whole table, and wins over gathering the tokens'
//! gradients).
//!
//! **Ties** go first to a strategy whose results meet their *demand*, then to the first
//! strategy in the table's fixed order (all-replicated first), so the result is
//! deterministic. A demand is the shard that the user's placements require downstream: a
//! value the user sharded, or the next value of a weight the user sharded, demands its
//! shard, and a node whose results are demanded passes the demand on to every operand all
//! its strategies giving those results, with its weights and inputs taken as they are, agree
//! on (`AxisPass::shard_demands`; a demand never splits a weight the user replicated). So a
//! weight's gradient is computed in the weight's sharding where that costs nothing more:
//! the scatter-add of a vocabulary-sharded embedding builds each device's rows (Megatron's
//! `VocabParallelEmbedding`) instead of the whole table sliced for the update. A policy's
//! placements (ZeRO's, sequence parallelism's) demand nothing.
//!
//! **Admissible** strategies follow four rules that keep the result close to what Megatron and
//! GSPMD produce, and away from clever but costly local optima:
//! 1. A value is never made partial (`R → P` would need zeros on all but one device).
//! 2. Partial sums are reduced at their first use: a strategy may take a partial operand and
//!    give a partial result only to add partial sums together. So the row-parallel matmul's
//!    sums are all-reduced where they are used, as in Megatron.
//! 3. A strategy may shard a non-source operand that is not sharded that way yet (a slice,
//!    all-to-all or reduce-scatter) only when another of its operands is already sharded as it
//!    needs, or when its result is fixed to the sharding the strategy gives: shardings spread
//!    from where they are or where they are required, they are not invented mid-graph. Sources
//!    (weights, inputs, constants) can be sliced freely.
//! 4. A source the user sharded on this axis is stationary: it is used as it is stored, never
//!    gathered or re-split on this axis (the owner computes, as in Megatron), unless a policy
//!    gathers it before each use (ZeRO-3). Without this rule a small model's weights would be
//!    cheaper to gather than its activations, and tensor parallelism would turn into weight
//!    gathering.
//!
//! Besides the per-op table, softmax has one more strategy here: sharded on its own dim (the
//! vocabulary of vocabulary-parallel logits), lowered by the partitioner to a local max and
//! sum with all-reduces ([`AxisKernel::ShardedSoftmax`]).
//!
//! The chosen strategies are returned as a side table ([`ShardingPlan`]) for the partitioner.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use autopar_ir::sharding_algebra::check_sharding;
use autopar_ir::{
    BinaryOp, DeviceMesh, Graph, IrError, NodeId, Op, Placement, Sharding, ShardingOrigin,
    TensorType, ValueId, verify,
};

use crate::error::PassError;
use crate::sharding::{LocalKernel, Lowering, Strategy, local_op, local_type, strategies};

/// Bytes a collective is charged for its latency, on top of the bytes it sends.
pub const COLLECTIVE_BYTES: f64 = 16.0 * 1024.0;

/// Most forward/backward rounds per mesh axis.
pub const MAX_SWEEPS: usize = 4;

/// Placements that a policy fixes, and how consumers see some values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Constraints {
    /// Placements fixed per value and mesh axis (weaker than user annotations).
    pub fixed: BTreeMap<ValueId, Vec<(String, Placement)>>,
    /// `(value, axis)`: consumers see the value as replicated on that axis and gather it
    /// before each use, whatever it is stored as (ZeRO-3 parameters).
    pub gather_on_use: BTreeSet<(ValueId, String)>,
    /// Data inputs are split on dim 0 over this axis, when the mesh has it.
    pub data_axis: Option<String>,
    /// `(node, axis)`: the placements the node's strategy along that axis takes its operands
    /// in, which picks one strategy of the per-op table where costs alone would pick another
    /// (the attention core on the query rows of `tp` with keys and values gathered, as the
    /// cost model prices it, rather than ring attention or a split by heads).
    pub operands: BTreeMap<(NodeId, String), Vec<Placement>>,
}

/// What a device runs for one node along one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisKernel {
    /// The op itself on local shapes.
    Same,
    /// A lowering of the per-op table ([`crate::sharding::lower()`]).
    Lowered(Lowering),
    /// Softmax over a sharded dim: local max, all-reduce max, local sum of exponentials,
    /// all-reduce sum, divide.
    ShardedSoftmax,
}

/// One node's strategy along one mesh axis.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AxisStrategy {
    /// Placement each operand must have.
    pub operands: Vec<Placement>,
    /// Placement each result comes out with.
    pub results: Vec<Placement>,
    /// The local kernel.
    pub kernel: AxisKernel,
}

impl fmt::Display for AxisStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |ps: &[Placement]| {
            ps.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(f, "{} -> {}", list(&self.operands), list(&self.results))?;
        match self.kernel {
            AxisKernel::Same => Ok(()),
            AxisKernel::Lowered(l) => write!(f, " [{l:?}]"),
            AxisKernel::ShardedSoftmax => f.write_str(" [ShardedSoftmax]"),
        }
    }
}

/// The side table of a propagation: the strategy of every non-source node on every mesh axis
/// of size above 1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardingPlan {
    /// The axes strategies were chosen for (size above 1), outermost first, with their sizes.
    pub axes: Vec<(String, usize)>,
    /// Per non-source node, one strategy per entry of `axes`.
    pub strategies: BTreeMap<NodeId, Vec<AxisStrategy>>,
}

impl ShardingPlan {
    /// The complete sharding (every mesh axis, in mesh order) that operand `i` of node `n`
    /// must have, or result `i` comes out with (`result = true`).
    pub fn sharding(&self, mesh: &DeviceMesh, n: NodeId, i: usize, result: bool) -> Sharding {
        let chosen = self.strategies.get(&n);
        let axes = mesh
            .axes()
            .iter()
            .map(|a| {
                let p = self
                    .axes
                    .iter()
                    .position(|(name, _)| *name == a.name)
                    .and_then(|k| chosen.map(|c| &c[k]))
                    .and_then(|s| {
                        if result {
                            s.results.get(i)
                        } else {
                            s.operands.get(i)
                        }
                    })
                    .copied()
                    .unwrap_or(Placement::Replicate);
                (a.name.clone(), p)
            })
            .collect();
        Sharding {
            axes,
            origin: ShardingOrigin::Inferred,
        }
    }
}

/// A name for value `v` in messages: the parameter or input it is, else its id and scope.
pub fn tensor_name(g: &Graph, v: ValueId) -> String {
    let node = g.node(g.value(v).producer);
    if let Op::Parameter { name, .. } | Op::Input { name, .. } = &node.op {
        return name.clone();
    }
    match &node.scope {
        Some(s) => format!("{v} (scope {s})"),
        None => v.to_string(),
    }
}

/// Checks sharding `s` against value `v`'s type on `mesh`, naming the tensor in errors.
pub fn check_value_sharding(
    g: &Graph,
    v: ValueId,
    s: &Sharding,
    mesh: &DeviceMesh,
) -> Result<(), PassError> {
    let ty = g.ty(v);
    check_sharding(ty.dims(), s, mesh).map_err(|e| match e {
        IrError::UnevenShard {
            dim,
            size,
            axis,
            ways,
            ..
        } => PassError::UnevenShard {
            tensor: tensor_name(g, v),
            ty: ty.to_string(),
            dim,
            size,
            axis,
            ways,
        },
        other => PassError::Annotation {
            tensor: tensor_name(g, v),
            detail: other.to_string(),
        },
    })
}

/// Fills in a complete sharding for every value of `g` (see the module docs) and returns the
/// chosen strategies. The graph must have a mesh and no communication ops; it is verified
/// afterwards.
pub fn propagate_sharding(g: &mut Graph, c: &Constraints) -> Result<ShardingPlan, PassError> {
    let mesh = g.mesh().cloned().ok_or_else(|| PassError::BadGraph {
        graph: g.name().to_string(),
        detail: "sharding propagation needs a device mesh".into(),
    })?;
    let order = g.topo_order()?;
    let n_values = g.value_ids().last().map_or(0, |v| v.0 as usize + 1);

    // User annotations, restricted to the mesh's axes and checked.
    let mut user: Vec<Option<Sharding>> = vec![None; n_values];
    for v in g.value_ids() {
        let Some(s) = g.value(v).sharding.clone() else {
            continue;
        };
        if s.origin != ShardingOrigin::User {
            continue;
        }
        let kept = Sharding {
            axes: s
                .axes
                .iter()
                .filter(|(a, _)| mesh.axis_index(a).is_some())
                .cloned()
                .collect(),
            origin: ShardingOrigin::User,
        };
        check_value_sharding(g, v, &kept, &mesh)?;
        check_mesh_order(g, v, &kept, &mesh)?;
        let source = g.node(g.value(v).producer).op.is_source();
        if source
            && kept
                .axes
                .iter()
                .any(|(_, p)| matches!(p, Placement::Partial(_)))
        {
            return Err(PassError::Annotation {
                tensor: tensor_name(g, v),
                detail: "a parameter or input cannot be partial".into(),
            });
        }
        user[v.0 as usize] = Some(kept);
    }
    for (v, fixed) in &c.fixed {
        let s = Sharding::user(fixed.iter().cloned());
        g.value_checked(*v)?;
        check_value_sharding(g, *v, &s, &mesh)?;
    }

    // Outputs: state outputs tied to their parameters, the others replicated.
    let params: HashMap<String, ValueId> = g
        .parameters()
        .into_iter()
        .map(|(v, name, _)| (name.to_string(), v))
        .collect();
    let mut tied: HashMap<ValueId, ValueId> = HashMap::new();
    let mut replicated_outputs: BTreeSet<ValueId> = BTreeSet::new();
    for (name, v) in g.outputs() {
        match params.get(name) {
            Some(&p) if g.ty(p) == g.ty(*v) && p != *v => {
                tied.insert(*v, p);
            }
            _ => {
                replicated_outputs.insert(*v);
            }
        }
    }

    let active: Vec<(String, usize)> = mesh
        .axes()
        .iter()
        .filter(|a| a.size > 1)
        .map(|a| (a.name.clone(), a.size))
        .collect();
    // Final placement of every value on every active axis.
    let mut placed: Vec<Vec<Option<Placement>>> = vec![vec![None; n_values]; active.len()];
    let mut plan = ShardingPlan {
        axes: active.clone(),
        strategies: BTreeMap::new(),
    };
    // Per node, the operand and result types seen by the current axis.
    let mut stage_ops: HashMap<NodeId, Vec<TensorType>> = HashMap::new();
    let mut stage_res: HashMap<NodeId, Vec<TensorType>> = HashMap::new();
    // Per node, the op with the shape attributes the previous axes made local.
    let mut stage_op: HashMap<NodeId, Op> = HashMap::new();
    for &n in &order {
        let node = g.node(n);
        stage_op.insert(n, node.op.clone());
        stage_ops.insert(n, node.inputs.iter().map(|&v| g.ty(v).clone()).collect());
        stage_res.insert(n, node.outputs.iter().map(|&v| g.ty(v).clone()).collect());
    }

    // What later axes will shard, estimated before any axis runs (on the global types), so
    // that an earlier axis prices every value at the size it will have: on `dp` before `tp`,
    // the gradient of a vocabulary-sharded embedding costs the all-reduce of its shard, not
    // of the whole table.
    let setup = AxisSetup {
        g: &*g,
        order: &order,
        n_values,
        user: &user,
        c,
        tied: &tied,
        replicated_outputs: &replicated_outputs,
    };
    let mut divisor: Vec<Vec<f64>> = vec![vec![1.0; n_values]; active.len()];
    for (j, (axis, size)) in active.iter().enumerate().skip(1) {
        // An error here (an uneven data split) is reported, with the local sizes, by the
        // axis's own pass below; without hints the earlier axes price global sizes.
        let Ok(demand) = setup
            .pass(
                axis,
                *size,
                &stage_ops,
                &stage_res,
                &stage_op,
                vec![1.0; n_values],
            )
            .and_then(|mut ax| {
                ax.list_candidates()?;
                Ok(ax.shard_demands())
            })
        else {
            continue;
        };
        for (i, d) in demand.iter().enumerate() {
            if matches!(d, Some(Placement::Shard(_))) {
                for row in divisor.iter_mut().take(j) {
                    row[i] *= *size as f64;
                }
            }
        }
    }

    for (k, (axis, size)) in active.iter().enumerate() {
        let mut ax = setup.pass(
            axis,
            *size,
            &stage_ops,
            &stage_res,
            &stage_op,
            std::mem::take(&mut divisor[k]),
        )?;
        ax.run()?;
        let mut chosen: Vec<(NodeId, AxisStrategy)> = Vec::new();
        for &n in &order {
            if !g.node(n).op.is_source() {
                chosen.push((n, ax.chosen(n)?.clone()));
            }
        }
        let place = std::mem::take(&mut ax.place);
        // Advance the local types for the next axis, and record.
        for &n in &order {
            let node = g.node(n);
            if node.op.is_source() {
                let p = place[node.outputs[0].0 as usize].unwrap_or(Placement::Replicate);
                if let Some(res) = stage_res.get_mut(&n) {
                    res[0] = local_type(&res[0], p, *size)?;
                }
            }
        }
        for (n, s) in chosen {
            if s.kernel == AxisKernel::Same
                && let (Some(op), Some(ops)) = (stage_op.get_mut(&n), stage_ops.get(&n))
            {
                let st = Strategy {
                    operands: s.operands.clone(),
                    results: s.results.clone(),
                    kernel: LocalKernel::Same,
                };
                let refs: Vec<&TensorType> = ops.iter().collect();
                *op = local_op(op, &st, &refs, *size)?;
            }
            if let Some(ops) = stage_ops.get_mut(&n) {
                for (t, &p) in ops.iter_mut().zip(&s.operands) {
                    *t = local_type(t, p, *size)?;
                }
            }
            if let Some(res) = stage_res.get_mut(&n) {
                for (t, &p) in res.iter_mut().zip(&s.results) {
                    *t = local_type(t, p, *size)?;
                }
            }
            plan.strategies.entry(n).or_default().push(s);
        }
        placed[k] = place;
    }

    // Write the complete shardings, every mesh axis in mesh order.
    let values: Vec<ValueId> = g.value_ids().collect();
    for v in values {
        let i = v.0 as usize;
        let axes = mesh
            .axes()
            .iter()
            .map(|a| {
                let p = match active.iter().position(|(name, _)| *name == a.name) {
                    Some(k) => placed[k][i],
                    None => user[i].as_ref().and_then(|s| s.get(&a.name)),
                };
                (a.name.clone(), p.unwrap_or(Placement::Replicate))
            })
            .collect();
        let origin = if user[i].is_some() {
            ShardingOrigin::User
        } else {
            ShardingOrigin::Inferred
        };
        g.set_sharding(v, Some(Sharding { axes, origin }))?;
    }
    verify(g)?;
    Ok(plan)
}

/// What every axis's pass starts from: the graph, its user annotations and the policy's
/// constraints, and the outputs tied to parameters or replicated.
struct AxisSetup<'a> {
    g: &'a Graph,
    order: &'a [NodeId],
    n_values: usize,
    user: &'a [Option<Sharding>],
    c: &'a Constraints,
    tied: &'a HashMap<ValueId, ValueId>,
    replicated_outputs: &'a BTreeSet<ValueId>,
}

impl<'a> AxisSetup<'a> {
    /// The pass along `axis` over the given stage types, with its fixed placements and
    /// sources placed, and `divisor` per value (how many ways later axes are expected to
    /// split it).
    fn pass(
        &self,
        axis: &'a str,
        size: usize,
        stage_ops: &'a HashMap<NodeId, Vec<TensorType>>,
        stage_res: &'a HashMap<NodeId, Vec<TensorType>>,
        stage_op: &'a HashMap<NodeId, Op>,
        divisor: Vec<f64>,
    ) -> Result<AxisPass<'a>, PassError> {
        let g = self.g;
        let (user, c, order) = (self.user, self.c, self.order);
        let n_values = self.n_values;
        let mut ax = AxisPass {
            g,
            order,
            position: order.iter().enumerate().map(|(i, &n)| (n, i)).collect(),
            axis,
            size,
            place: vec![None; n_values],
            fixed: vec![None; n_values],
            gather: vec![false; n_values],
            stationary: vec![false; n_values],
            cands: HashMap::new(),
            choice: HashMap::new(),
            stage_ops,
            stage_res,
            stage_op,
            operands: &c.operands,
            divisor,
            demand: Vec::new(),
        };
        // Fixed placements: user annotations, then policy constraints, then outputs.
        for v in g.value_ids() {
            let i = v.0 as usize;
            if let Some(s) = &user[i] {
                ax.fixed[i] = s.get(axis);
            }
            if ax.fixed[i].is_none()
                && let Some(list) = c.fixed.get(&v)
            {
                ax.fixed[i] = list.iter().find(|(a, _)| a == axis).map(|&(_, p)| p);
            }
            ax.gather[i] = c.gather_on_use.contains(&(v, axis.to_string()));
            ax.stationary[i] = !ax.gather[i]
                && g.node(g.value(v).producer).op.is_source()
                && user[i]
                    .as_ref()
                    .is_some_and(|s| matches!(s.get(axis), Some(Placement::Shard(_))));
        }
        // Sources.
        for &n in order {
            let node = g.node(n);
            if node.op.is_communication() {
                return Err(PassError::BadGraph {
                    graph: g.name().to_string(),
                    detail: format!(
                        "{n} (`{}`) is communication; propagation takes a graph without any",
                        node.op.name()
                    ),
                });
            }
            if !node.op.is_source() {
                continue;
            }
            let v = node.outputs[0];
            let i = v.0 as usize;
            let data_input =
                matches!(node.op, Op::Input { .. }) && c.data_axis.as_deref() == Some(axis);
            let p = match (ax.fixed[i], stage_res[&n][0].dims().first()) {
                (Some(p), _) => p,
                (None, Some(&b)) if data_input && b.is_multiple_of(size) => Placement::Shard(0),
                (None, Some(&b)) if data_input => {
                    return Err(PassError::UnevenShard {
                        tensor: tensor_name(g, v),
                        ty: g.ty(v).to_string(),
                        dim: 0,
                        size: g.ty(v).dims()[0],
                        axis: axis.to_string(),
                        ways: g.ty(v).dims()[0] / b * size,
                    });
                }
                (None, _) => Placement::Replicate,
            };
            ax.place[i] = Some(p);
            ax.fixed[i] = Some(p);
        }
        // State outputs follow their parameters; other outputs are replicated.
        for (&out, &param) in self.tied {
            if user[out.0 as usize]
                .as_ref()
                .and_then(|s| s.get(axis))
                .is_none()
            {
                ax.fixed[out.0 as usize] = ax.place[param.0 as usize];
            }
        }
        // Demands start where the user sharded: annotated values and the next values of
        // stationary weights.
        ax.demand = vec![None; n_values];
        for v in g.value_ids() {
            let i = v.0 as usize;
            let by_user = user[i].as_ref().and_then(|s| s.get(axis));
            if matches!(by_user, Some(Placement::Shard(_))) {
                ax.demand[i] = by_user;
            }
        }
        for (&out, &param) in self.tied {
            if ax.stationary[param.0 as usize] {
                ax.demand[out.0 as usize] = ax.fixed[out.0 as usize];
            }
        }
        for &out in self.replicated_outputs {
            let i = out.0 as usize;
            if ax.fixed[i].is_none() && !g.node(g.value(out).producer).op.is_source() {
                ax.fixed[i] = Some(Placement::Replicate);
            }
        }
        Ok(ax)
    }
}

/// Axes sharding one dim must be listed in mesh order (outermost first), the nesting the
/// partitioner uses.
fn check_mesh_order(
    g: &Graph,
    v: ValueId,
    s: &Sharding,
    mesh: &DeviceMesh,
) -> Result<(), PassError> {
    for d in 0..g.ty(v).rank() {
        let positions: Vec<usize> = s
            .axes_sharding_dim(d)
            .filter_map(|a| mesh.axis_index(a))
            .collect();
        if positions.windows(2).any(|w| w[0] > w[1]) {
            return Err(PassError::Annotation {
                tensor: tensor_name(g, v),
                detail: format!(
                    "mesh axes sharding dim {d} must be listed outermost first, in the mesh's order ({mesh})"
                ),
            });
        }
    }
    Ok(())
}

/// Cost of a choice: bytes sent plus [`COLLECTIVE_BYTES`] per collective; `None` when not
/// admissible.
type Cost = Option<f64>;

/// What it costs to turn placement `from` into `to` on an axis of `n` devices, for a value
/// whose replicated local size on this axis is `bytes`. `None`: never done (making a value
/// partial, or changing its reduction).
fn reshard_cost(from: Placement, to: Placement, bytes: f64, n: usize) -> Cost {
    let n_f = n as f64;
    let shard = bytes / n_f;
    match (from, to) {
        (a, b) if a == b => Some(0.0),
        (_, Placement::Partial(_)) => None,
        (Placement::Replicate, Placement::Shard(_)) => Some(0.0),
        (Placement::Shard(_), Placement::Replicate) => Some(COLLECTIVE_BYTES + (n_f - 1.0) * shard),
        (Placement::Shard(_), Placement::Shard(_)) => {
            Some(COLLECTIVE_BYTES + (n_f - 1.0) / n_f * shard)
        }
        (Placement::Partial(_), Placement::Replicate) => {
            Some(COLLECTIVE_BYTES + 2.0 * (n_f - 1.0) / n_f * bytes)
        }
        (Placement::Partial(_), Placement::Shard(_)) => {
            Some(COLLECTIVE_BYTES + (n_f - 1.0) / n_f * bytes)
        }
        (Placement::Replicate, Placement::Replicate) => Some(0.0),
    }
}

/// True when going from `from` to `to` makes the value sharded in a new way.
fn shards_anew(from: Placement, to: Placement) -> bool {
    from != to && matches!(to, Placement::Shard(_))
}

/// Propagation along one mesh axis.
struct AxisPass<'a> {
    g: &'a Graph,
    order: &'a [NodeId],
    /// Index of every node in `order`.
    position: HashMap<NodeId, usize>,
    axis: &'a str,
    size: usize,
    place: Vec<Option<Placement>>,
    fixed: Vec<Option<Placement>>,
    gather: Vec<bool>,
    stationary: Vec<bool>,
    cands: HashMap<NodeId, Vec<AxisStrategy>>,
    choice: HashMap<NodeId, usize>,
    stage_ops: &'a HashMap<NodeId, Vec<TensorType>>,
    stage_res: &'a HashMap<NodeId, Vec<TensorType>>,
    stage_op: &'a HashMap<NodeId, Op>,
    /// [`Constraints::operands`].
    operands: &'a BTreeMap<(NodeId, String), Vec<Placement>>,
    /// Per value, how many ways the later axes are expected to split it: its bytes on this
    /// axis are its stage size divided by that.
    divisor: Vec<f64>,
    /// Per value, the sharding required downstream on this axis ([`Self::shard_demands`]),
    /// which breaks ties between strategies of equal cost.
    demand: Vec<Option<Placement>>,
}

impl AxisPass<'_> {
    fn run(&mut self) -> Result<(), PassError> {
        self.list_candidates()?;
        self.demand = self.shard_demands();
        self.forward()?;
        for _ in 0..MAX_SWEEPS {
            let changed = self.backward()?;
            let changed_fwd = self.forward()?;
            if !changed && !changed_fwd {
                break;
            }
        }
        Ok(())
    }

    /// Lists the candidate strategies of every non-source node.
    fn list_candidates(&mut self) -> Result<(), PassError> {
        for &n in self.order {
            if !self.g.node(n).op.is_source() {
                let list = self.candidates(n)?;
                self.cands.insert(n, list);
            }
        }
        Ok(())
    }

    /// The shardings that the user's placements impose upstream: a value the user fixed to a
    /// shard, or the next value of a weight the user sharded, demands it (the seeds
    /// [`AxisSetup::pass`] leaves in `demand`; a policy's placements, such as ZeRO's, seed
    /// nothing), and a node whose results are demanded passes on a demand for every operand on
    /// which all its strategies giving those results and taking its sources (weights, inputs)
    /// as they are agree, when that is a shard. A node that would have to slice a source to
    /// meet its demand passes on nothing: the demand follows what the user sharded, it does
    /// not split a weight the user replicated (an update of a replicated weight whose
    /// optimizer state is sharded slices the weight, and the gradient stays replicated). A value whose consumers demand different
    /// shards demands none. So the gradient of a weight sharded on this axis demands the
    /// weight's sharding all the way back to the op that computes it (the optimizer update
    /// takes both alike, through the clipping scale), and the scatter-add of a
    /// vocabulary-sharded embedding's gradient is asked for the table's rows.
    fn shard_demands(&self) -> Vec<Option<Placement>> {
        let is_shard = |p: &Option<Placement>| matches!(p, Some(Placement::Shard(_)));
        let mut demand = self.demand.clone();
        let mut conflict = vec![false; demand.len()];
        for &n in self.order.iter().rev() {
            let node = self.g.node(n);
            if node.op.is_source() {
                continue;
            }
            let asked: Vec<Option<Placement>> =
                node.outputs.iter().map(|v| demand[v.0 as usize]).collect();
            if !asked.iter().any(is_shard) {
                continue;
            }
            let matching: Vec<&AxisStrategy> = self.cands[&n]
                .iter()
                .filter(|s| {
                    s.results
                        .iter()
                        .zip(&asked)
                        .all(|(r, a)| a.is_none_or(|a| a == *r))
                        && node.inputs.iter().zip(&s.operands).all(|(&v, &p)| {
                            !self.g.node(self.g.value(v).producer).op.is_source()
                                || self.seen(v) == p
                        })
                })
                .collect();
            let Some(first) = matching.first() else {
                continue;
            };
            for (i, &v) in node.inputs.iter().enumerate() {
                let vi = v.0 as usize;
                let p = first.operands[i];
                if self.fixed[vi].is_some()
                    || !matches!(p, Placement::Shard(_))
                    || matching.iter().any(|s| s.operands[i] != p)
                {
                    continue;
                }
                match demand[vi] {
                    None if !conflict[vi] => demand[vi] = Some(p),
                    Some(q) if q != p => {
                        demand[vi] = None;
                        conflict[vi] = true;
                    }
                    _ => {}
                }
            }
        }
        demand
    }

    /// True when every result of strategy `s` at `n` that has a demand comes out as
    /// demanded, and at least one has.
    fn meets_demand(&self, n: NodeId, s: &AxisStrategy) -> bool {
        let node = self.g.node(n);
        let mut any = false;
        for (&v, &r) in node.outputs.iter().zip(&s.results) {
            match self.demand.get(v.0 as usize).copied().flatten() {
                Some(d) if d == r => any = true,
                Some(_) => return false,
                None => {}
            }
        }
        any
    }

    fn chosen(&self, n: NodeId) -> Result<&AxisStrategy, PassError> {
        self.choice
            .get(&n)
            .and_then(|&i| self.cands.get(&n).and_then(|c| c.get(i)))
            .ok_or_else(|| {
                PassError::Ir(IrError::Verify(format!(
                    "{n} has no strategy on `{}`",
                    self.axis
                )))
            })
    }

    /// The table's strategies on this axis, plus the sharded softmax.
    fn candidates(&self, n: NodeId) -> Result<Vec<AxisStrategy>, PassError> {
        let op = &self.stage_op[&n];
        let tys = &self.stage_ops[&n];
        let refs: Vec<&TensorType> = tys.iter().collect();
        let mut out: Vec<AxisStrategy> = strategies(op, &refs, self.size)?
            .into_iter()
            .filter(|s| {
                self.operands
                    .get(&(n, self.axis.to_string()))
                    .is_none_or(|want| *want == s.operands)
            })
            .map(|s| AxisStrategy {
                operands: s.operands,
                results: s.results,
                kernel: match s.kernel {
                    LocalKernel::Same => AxisKernel::Same,
                    LocalKernel::Lowered(l) => AxisKernel::Lowered(l),
                },
            })
            .collect();
        if let Op::Softmax { dim } = *op
            && tys[0]
                .dims()
                .get(dim)
                .is_some_and(|d| d.is_multiple_of(self.size))
        {
            out.push(AxisStrategy {
                operands: vec![Placement::Shard(dim)],
                results: vec![Placement::Shard(dim)],
                kernel: AxisKernel::ShardedSoftmax,
            });
        }
        Ok(out)
    }

    /// How operand `i` of `n` is seen by strategies: its placement, or replicated when it is
    /// gathered before each use.
    fn seen(&self, v: ValueId) -> Placement {
        if self.gather[v.0 as usize] {
            Placement::Replicate
        } else {
            self.place[v.0 as usize].unwrap_or(Placement::Replicate)
        }
    }

    /// Operand-side cost of strategy `s` at node `n` (rules 1–3 of the module docs).
    fn operand_cost(&self, n: NodeId, s: &AxisStrategy) -> Cost {
        self.operand_cost_for(n, s, None)
    }

    /// [`Self::operand_cost`] when every user of the node's single result requires it
    /// `wanted` (the backward sweep): that requirement anchors a new sharding like a fixed
    /// result does.
    fn operand_cost_for(&self, n: NodeId, s: &AxisStrategy, wanted: Option<Placement>) -> Cost {
        let node = self.g.node(n);
        let partial_in = s
            .operands
            .iter()
            .any(|p| matches!(p, Placement::Partial(_)));
        let partial_out = s.results.iter().any(|p| matches!(p, Placement::Partial(_)));
        if partial_in && partial_out {
            let adds = matches!(
                node.op,
                Op::Binary {
                    func: BinaryOp::Add | BinaryOp::Sub
                }
            ) && s
                .operands
                .iter()
                .all(|p| matches!(p, Placement::Partial(_)));
            if !adds {
                return None;
            }
        }
        let mut total = 0.0;
        let mut needs_anchor = false;
        let mut anchored = false;
        for (i, (&v, &want)) in node.inputs.iter().zip(&s.operands).enumerate() {
            let have = self.seen(v);
            let bytes = self.stage_ops[&n][i].size_bytes() as f64 / self.divisor[v.0 as usize];
            let cost = reshard_cost(have, want, bytes, self.size)?;
            if self.stationary[v.0 as usize] && have != want {
                return None;
            }
            // The partitioner caches resharded copies: one an earlier consumer already asks
            // for is free, and is no new sharding.
            let copied = have != want && self.copied_earlier(n, v, want);
            if !copied {
                total += cost;
            }
            let source = self.g.node(self.g.value(v).producer).op.is_source();
            if shards_anew(have, want) && !source && !copied {
                needs_anchor = true;
            }
            if have == want && matches!(want, Placement::Shard(_)) {
                anchored = true;
            }
        }
        // A result fixed to the strategy's sharding anchors it too: the sharding is required
        // where the value goes (e.g. sequence parallelism's residual stream).
        let required = node.outputs.iter().zip(&s.results).any(|(&v, &p)| {
            matches!(p, Placement::Shard(_))
                && (self.fixed[v.0 as usize] == Some(p) || wanted == Some(p))
        });
        if needs_anchor && !anchored && !required {
            return None;
        }
        Some(total)
    }

    /// True when a consumer of `v` before `n` (in topological order) takes it as `want`.
    fn copied_earlier(&self, n: NodeId, v: ValueId, want: Placement) -> bool {
        let at = self.position.get(&n).copied().unwrap_or(usize::MAX);
        self.g.users(v).iter().any(|&(u, k)| {
            self.position.get(&u).is_some_and(|&p| p < at)
                && self
                    .choice
                    .get(&u)
                    .and_then(|&i| self.cands.get(&u)?.get(i))
                    .is_some_and(|s| s.operands.get(k) == Some(&want))
        })
    }

    /// Total cost: operands, plus results resharded to their fixed placements, plus, for a
    /// partial result that nothing fixes, the least its reduction will cost (rule 2 reduces
    /// it at its first use, by a reduce-scatter at best): so a strategy that leaves partial
    /// sums competes fairly with one that reshards its operands instead (expert
    /// parallelism's combine, which moves the experts' output back to its tokens rather
    /// than moving the gates to the experts and reducing there).
    fn cost(&self, n: NodeId, s: &AxisStrategy) -> Cost {
        let mut total = self.operand_cost(n, s)?;
        let node = self.g.node(n);
        for (j, (&v, &got)) in node.outputs.iter().zip(&s.results).enumerate() {
            let bytes = self.stage_res[&n][j].size_bytes() as f64 / self.divisor[v.0 as usize];
            match self.fixed[v.0 as usize] {
                Some(f) => total += reshard_cost(got, f, bytes, self.size)?,
                None if matches!(got, Placement::Partial(_)) => {
                    total += reshard_cost(got, Placement::Shard(0), bytes, self.size)?;
                }
                None => {}
            }
        }
        Some(total)
    }

    fn set_results(&mut self, n: NodeId, idx: usize) {
        let node = self.g.node(n);
        let s = &self.cands[&n][idx];
        for (&v, &p) in node.outputs.iter().zip(&s.results) {
            let i = v.0 as usize;
            self.place[i] = Some(self.fixed[i].unwrap_or(p));
        }
        self.choice.insert(n, idx);
    }

    /// Gives every node its cheapest admissible strategy; true if any choice changed.
    fn forward(&mut self) -> Result<bool, PassError> {
        let mut changed = false;
        for &n in self.order {
            if self.g.node(n).op.is_source() {
                continue;
            }
            // Least cost; on a tie, a strategy whose results meet their demand (the shard a
            // weight's gradient must end in), then the table's order.
            let mut best: Option<(usize, f64, bool)> = None;
            for (i, s) in self.cands[&n].iter().enumerate() {
                if let Some(c) = self.cost(n, s) {
                    let meets = self.meets_demand(n, s);
                    if best.is_none_or(|(_, b, m)| c < b || (c == b && meets && !m)) {
                        best = Some((i, c, meets));
                    }
                }
            }
            let mut best = best.map(|(i, c, _)| (i, c));
            // A choice the backward sweep made stays while nothing is cheaper, so that the
            // sweeps converge instead of undoing each other on ties.
            if let (Some((_, b)), Some(&cur)) = (best, self.choice.get(&n))
                && self.cost(n, &self.cands[&n][cur]).is_some_and(|c| c <= b)
            {
                best = Some((cur, b));
            }
            let Some((idx, _)) = best else {
                let node = self.g.node(n);
                return Err(PassError::NoStrategy {
                    node: n.to_string(),
                    op: node.op.name(),
                    axis: self.axis.to_string(),
                    detail: "every strategy would make a value partial".into(),
                });
            };
            if self.choice.get(&n) != Some(&idx) {
                changed = true;
            }
            self.set_results(n, idx);
        }
        Ok(changed)
    }

    /// Lets single-result producers take the placement all their consumers require when that
    /// costs them nothing more; true if any changed.
    fn backward(&mut self) -> Result<bool, PassError> {
        let mut changed = false;
        for &n in self.order.iter().rev() {
            let node = self.g.node(n);
            if node.op.is_source() || node.outputs.len() != 1 {
                continue;
            }
            let v = node.outputs[0];
            if self.fixed[v.0 as usize].is_some() {
                continue;
            }
            let users = self.g.users(v);
            let mut wanted: Option<Placement> = None;
            let mut agree = !users.is_empty();
            for (u, k) in &users {
                let Some(s) = self.choice.get(u).map(|&i| &self.cands[u][i]) else {
                    agree = false;
                    break;
                };
                let p = s.operands[*k];
                if wanted.is_some_and(|w| w != p) {
                    agree = false;
                    break;
                }
                wanted = Some(p);
            }
            let (true, Some(want)) = (agree, wanted) else {
                continue;
            };
            let current = self.place[v.0 as usize].unwrap_or(Placement::Replicate);
            if want == current {
                continue;
            }
            let Some(&cur_idx) = self.choice.get(&n) else {
                continue;
            };
            let Some(cur_cost) = self.operand_cost(n, &self.cands[&n][cur_idx]) else {
                continue;
            };
            let found = self.cands[&n].iter().enumerate().find(|(_, s)| {
                s.results[0] == want
                    && self
                        .operand_cost_for(n, s, Some(want))
                        .is_some_and(|c| c <= cur_cost)
            });
            if let Some((idx, _)) = found {
                self.set_results(n, idx);
                changed = true;
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopar_ir::ReduceKind;

    #[test]
    fn reshard_costs_match_the_planner() {
        use autopar_ir::reshard::plan_reshard;
        use autopar_ir::{DType, TensorType};
        let mesh = DeviceMesh::new([("tp", 4)]).unwrap();
        let ty = TensorType::new(DType::F32, [8, 8]);
        let sh = |p: Placement| Sharding::user([("tp".to_string(), p)]);
        let ps = [
            Placement::Replicate,
            Placement::Shard(0),
            Placement::Shard(1),
            Placement::Partial(ReduceKind::Sum),
        ];
        for from in ps {
            for to in ps {
                let Some(c) = reshard_cost(from, to, ty.size_bytes() as f64, 4) else {
                    continue;
                };
                let plan = plan_reshard(&ty, &sh(from), &sh(to), &mesh).unwrap();
                let collectives = plan
                    .steps
                    .iter()
                    .filter(|s| s.collective().is_some())
                    .count();
                assert_eq!(
                    c,
                    plan.bytes_sent + COLLECTIVE_BYTES * collectives as f64,
                    "{from} -> {to}"
                );
            }
        }
    }
}
