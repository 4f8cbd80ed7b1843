//! Reshard planning: the collectives (and local slices) that turn a value sharded one way into
//! the same value sharded another way, on a multi-axis mesh.
//!
//! Every step acts on one group of mesh axes and is either an IR collective or a purely local
//! rewrite, following the table of the design brief:
//!
//! | from \ to  | Replicate        | Shard(d)                  | Partial               |
//! |------------|------------------|---------------------------|-----------------------|
//! | Replicate  | none             | [`ReshardStep::LocalSlice`] | [`ReshardStep::MakePartial`] |
//! | Shard(e)   | [`ReshardStep::AllGather`] | [`ReshardStep::AllToAll`] (e ≠ d) | gather, then make partial |
//! | Partial    | [`ReshardStep::AllReduce`] | [`ReshardStep::ReduceScatter`] | none (same reduction) |
//!
//! When several axes shard one dim, only the innermost (last listed) can be gathered or moved
//! by an all-to-all, and a slice, reduce-scatter or all-to-all always adds the new axis as the
//! innermost split of its dim; the planner tracks that nesting, so a target such as
//! `{dp: S(0), tp: S(0)}` from `{tp: S(0)}` comes out right.
//!
//! **Cost.** The planner minimises, in this order: the number of collectives, the bytes each
//! device sends, and the number of steps; remaining ties go to the first plan found (the
//! search is deterministic). Bytes follow ring algorithms on a group of `n` devices, with `L`
//! the bytes a device holds before the step: all-reduce `2(n-1)/n · L`, all-gather
//! `(n-1) · L`, reduce-scatter and all-to-all `(n-1)/n · L`, local slices and making a value
//! partial `0`. Counting collectives first stops the planner from adding a collective on a
//! slow axis to save bytes on a fast one (slicing on `dp` to shrink a `tp` reduce-scatter,
//! then gathering on `dp` again), which a volume-only model would favour without seeing the
//! links; the cost model in `autopar-cost-model` weighs links when it scores a whole plan.
//! Among plans with as many collectives, sharding early (a reduce-scatter before a gather on
//! another axis) and gathering late make later steps move less, and the search finds those
//! orders. An all-reduce over several axes is one collective.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::IrError;
use crate::mesh::DeviceMesh;
use crate::op::Op;
use crate::placement::{Placement, ReduceKind, Sharding};
use crate::sharding_algebra::{axis_size_or_one, check_sharding};
use crate::types::TensorType;

/// One step of a reshard, over the group of devices spanned by `axes` (in group order: the
/// first axis outermost, as for the IR collectives).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReshardStep {
    /// `Partial(reduce)` → `Replicate` on every axis of `axes`.
    AllReduce {
        /// The group's mesh axes.
        axes: Vec<String>,
        /// The pending reduction.
        reduce: ReduceKind,
    },
    /// `Shard(dim)` → `Replicate`: the axes must be the innermost splits of `dim`, listed
    /// outermost first.
    AllGather {
        /// The group's mesh axes.
        axes: Vec<String>,
        /// The gathered dim.
        dim: usize,
    },
    /// `Partial(reduce)` → `Shard(dim)`, the axes becoming the innermost splits of `dim`.
    ReduceScatter {
        /// The group's mesh axes.
        axes: Vec<String>,
        /// The scattered dim.
        dim: usize,
        /// The pending reduction.
        reduce: ReduceKind,
    },
    /// `Shard(concat_dim)` → `Shard(split_dim)`: the axes leave `concat_dim` (where they were
    /// the innermost splits) and become the innermost splits of `split_dim`.
    AllToAll {
        /// The group's mesh axes.
        axes: Vec<String>,
        /// The dim that becomes sharded.
        split_dim: usize,
        /// The dim that stops being sharded.
        concat_dim: usize,
    },
    /// `Replicate` → `Shard(dim)` without communication: each device keeps its piece of its
    /// local `dim`, the axes becoming its innermost splits.
    LocalSlice {
        /// The group's mesh axes.
        axes: Vec<String>,
        /// The sliced dim.
        dim: usize,
    },
    /// `Replicate` → `Partial(reduce)` without communication: for a sum, the device at group
    /// index 0 keeps the value and the others hold zeros; for max and min every device keeps
    /// it (the reduction of equal copies is the value).
    MakePartial {
        /// The group's mesh axes.
        axes: Vec<String>,
        /// The reduction the value will await.
        reduce: ReduceKind,
    },
}

/// What a device runs for one [`ReshardStep`].
#[derive(Clone, Debug, PartialEq)]
pub enum StepLowering {
    /// A collective op on the local value.
    Collective(Op),
    /// A local op: a `slice` of the local value, or a zero `constant` that replaces it.
    Local(Op),
    /// Nothing: the local value is already right.
    Identity,
}

impl ReshardStep {
    /// The mesh axes of the step's group.
    pub fn axes(&self) -> &[String] {
        match self {
            ReshardStep::AllReduce { axes, .. }
            | ReshardStep::AllGather { axes, .. }
            | ReshardStep::ReduceScatter { axes, .. }
            | ReshardStep::AllToAll { axes, .. }
            | ReshardStep::LocalSlice { axes, .. }
            | ReshardStep::MakePartial { axes, .. } => axes,
        }
    }

    /// The IR collective of a communicating step, `None` for the local ones.
    ///
    /// ```
    /// # use autopar_ir::{Op, reshard::ReshardStep};
    /// let step = ReshardStep::AllGather { axes: vec!["tp".into()], dim: 1 };
    /// assert_eq!(step.collective(), Some(Op::AllGather { axes: vec!["tp".into()], dim: 1 }));
    /// ```
    pub fn collective(&self) -> Option<Op> {
        match self {
            ReshardStep::AllReduce { axes, reduce } => Some(Op::AllReduce {
                axes: axes.clone(),
                reduce: *reduce,
            }),
            ReshardStep::AllGather { axes, dim } => Some(Op::AllGather {
                axes: axes.clone(),
                dim: *dim,
            }),
            ReshardStep::ReduceScatter { axes, dim, reduce } => Some(Op::ReduceScatter {
                axes: axes.clone(),
                dim: *dim,
                reduce: *reduce,
            }),
            ReshardStep::AllToAll {
                axes,
                split_dim,
                concat_dim,
            } => Some(Op::AllToAll {
                axes: axes.clone(),
                split_dim: *split_dim,
                concat_dim: *concat_dim,
            }),
            ReshardStep::LocalSlice { .. } | ReshardStep::MakePartial { .. } => None,
        }
    }

    /// What the device at mesh coordinates `coords` runs for this step, given the type of
    /// the value it holds before it.
    ///
    /// ```
    /// # use autopar_ir::{DType, DeviceMesh, Op, TensorType};
    /// # use autopar_ir::reshard::{ReshardStep, StepLowering};
    /// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
    /// let step = ReshardStep::LocalSlice { axes: vec!["tp".into()], dim: 0 };
    /// let local = TensorType::new(DType::F32, [8, 3]);
    /// // The device at dp=1, tp=2 keeps rows 4..6.
    /// assert_eq!(
    ///     step.lower(&local, &mesh, &[1, 2]).unwrap(),
    ///     StepLowering::Local(Op::Slice { dim: 0, start: 4, end: 6 })
    /// );
    /// ```
    pub fn lower(
        &self,
        local: &TensorType,
        mesh: &DeviceMesh,
        coords: &[usize],
    ) -> Result<StepLowering, IrError> {
        if let Some(op) = self.collective() {
            return Ok(StepLowering::Collective(op));
        }
        let (index, n) = group_index(mesh, self.axes(), coords);
        match self {
            ReshardStep::LocalSlice { dim, .. } => {
                let Some(&size) = local.dims().get(*dim) else {
                    return Err(IrError::ty("slice", format!("dim {dim} of {local}")));
                };
                if !size.is_multiple_of(n) {
                    return Err(IrError::UnevenShard {
                        ty: local.to_string(),
                        dim: *dim,
                        size,
                        axis: self.axes().join(","),
                        ways: n,
                    });
                }
                let len = size / n;
                Ok(StepLowering::Local(Op::Slice {
                    dim: *dim,
                    start: index * len,
                    end: (index + 1) * len,
                }))
            }
            ReshardStep::MakePartial { reduce, .. } => match reduce {
                ReduceKind::Sum if index != 0 => Ok(StepLowering::Local(Op::Constant {
                    ty: local.clone(),
                    value: 0.0,
                })),
                ReduceKind::Sum | ReduceKind::Max | ReduceKind::Min => Ok(StepLowering::Identity),
            },
            ReshardStep::AllReduce { .. }
            | ReshardStep::AllGather { .. }
            | ReshardStep::ReduceScatter { .. }
            | ReshardStep::AllToAll { .. } => Ok(StepLowering::Identity),
        }
    }
}

/// The index of the device at `coords` within the group spanned by `axes` (row-major, first
/// axis outermost) and the group's size. Axes the mesh lacks count as size 1.
pub fn group_index(mesh: &DeviceMesh, axes: &[String], coords: &[usize]) -> (usize, usize) {
    axes.iter().fold((0, 1), |(index, n), axis| {
        let size = axis_size_or_one(mesh, axis);
        let c = mesh
            .axis_index(axis)
            .and_then(|i| coords.get(i).copied())
            .unwrap_or(0);
        (index * size + c, n * size)
    })
}

/// A planned reshard: the steps in order, and their cost.
#[derive(Clone, Debug, PartialEq)]
pub struct ReshardPlan {
    /// The steps, to run in order.
    pub steps: Vec<ReshardStep>,
    /// Bytes each device sends, summed over the steps (see the module docs).
    pub bytes_sent: f64,
}

/// Plans the reshard of a value of type `ty` from sharding `from` to sharding `to` on `mesh`.
///
/// Axes a sharding does not mention are `Replicate`; axes of size 1 (or absent from the mesh)
/// never need a step. Both shardings must fit the type ([`check_sharding`]), and a sharding
/// that is partial on several axes must await one reduction kind on all of them.
///
/// ```
/// # use autopar_ir::{DType, DeviceMesh, Placement, ReduceKind, Sharding, TensorType};
/// # use autopar_ir::reshard::{plan_reshard, ReshardStep};
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
/// let ty = TensorType::new(DType::F32, [8, 16]);
/// let sh = |p: &[(&str, Placement)]| Sharding::user(p.iter().map(|(a, p)| (a.to_string(), *p)));
/// let sum = Placement::Partial(ReduceKind::Sum);
/// // The row-parallel matmul's partial sums, wanted sharded on the sequence: reduce-scatter.
/// let plan = plan_reshard(&ty, &sh(&[("tp", sum)]), &sh(&[("tp", Placement::Shard(0))]), &mesh).unwrap();
/// assert_eq!(plan.steps, vec![ReshardStep::ReduceScatter { axes: vec!["tp".into()], dim: 0, reduce: ReduceKind::Sum }]);
/// assert_eq!(plan.bytes_sent, 3.0 / 4.0 * 512.0);
/// // Gathering both splits of a dim: one all-gather over both axes, outermost first.
/// let both = sh(&[("dp", Placement::Shard(0)), ("tp", Placement::Shard(0))]);
/// let plan = plan_reshard(&ty, &both, &sh(&[]), &mesh).unwrap();
/// assert_eq!(plan.steps, vec![ReshardStep::AllGather { axes: vec!["dp".into(), "tp".into()], dim: 0 }]);
/// // Swapping the nesting order of two axes on one dim needs more than one step.
/// let swapped = sh(&[("tp", Placement::Shard(0)), ("dp", Placement::Shard(0))]);
/// assert!(plan_reshard(&ty, &both, &swapped, &mesh).unwrap().steps.len() > 1);
/// ```
pub fn plan_reshard(
    ty: &TensorType,
    from: &Sharding,
    to: &Sharding,
    mesh: &DeviceMesh,
) -> Result<ReshardPlan, IrError> {
    let dims = ty.dims();
    for s in [from, to] {
        check_sharding(dims, s, mesh)?;
        let mut kinds = s.axes.iter().filter_map(|(_, p)| match p {
            Placement::Partial(k) => Some(*k),
            Placement::Replicate | Placement::Shard(_) => None,
        });
        if let Some(first) = kinds.next()
            && kinds.any(|k| k != first)
        {
            return Err(IrError::InvalidSharding {
                sharding: s.to_string(),
                ty: ty.to_string(),
                detail: "partial on several axes with different reductions".into(),
            });
        }
    }
    let axes: Vec<(String, usize)> = mesh
        .axes()
        .iter()
        .filter(|a| a.size > 1)
        .map(|a| (a.name.clone(), a.size))
        .collect();
    let space = Space {
        dims: dims.to_vec(),
        elem_bytes: ty.dtype.size_bytes() as f64,
        sizes: axes.iter().map(|a| a.1).collect(),
        target: State::of(from_sharding(to, &axes), dims.len(), to, &axes),
    };
    let start = State::of(from_sharding(from, &axes), dims.len(), from, &axes);
    let moves = space
        .search(&start)
        .unwrap_or_else(|| space.canonical(&start));
    let steps = merge(&moves, &axes);
    let bytes_sent = plan_cost(&steps, dims, ty.dtype.size_bytes() as f64, from, mesh);
    Ok(ReshardPlan { steps, bytes_sent })
}

/// Bytes each device sends for `steps`, starting from a value of global shape `dims` sharded
/// as `from` (see the module docs for the per-step formulas).
fn plan_cost(
    steps: &[ReshardStep],
    dims: &[usize],
    elem_bytes: f64,
    from: &Sharding,
    mesh: &DeviceMesh,
) -> f64 {
    let mut local: Vec<usize> = dims
        .iter()
        .enumerate()
        .map(|(d, &size)| size / crate::sharding_algebra::ways(from, mesh, d))
        .collect();
    let mut total = 0.0;
    for step in steps {
        let n = group_index(mesh, step.axes(), &[]).1;
        let bytes = local.iter().product::<usize>() as f64 * elem_bytes;
        total += step_bytes(step, n, bytes);
        match step {
            ReshardStep::AllGather { dim, .. } => local[*dim] *= n,
            ReshardStep::ReduceScatter { dim, .. } | ReshardStep::LocalSlice { dim, .. } => {
                local[*dim] /= n
            }
            ReshardStep::AllToAll {
                split_dim,
                concat_dim,
                ..
            } => {
                local[*split_dim] /= n;
                local[*concat_dim] *= n;
            }
            ReshardStep::AllReduce { .. } | ReshardStep::MakePartial { .. } => {}
        }
    }
    total
}

/// Bytes a device sends for one step on a group of `n` holding `bytes` each.
fn step_bytes(step: &ReshardStep, n: usize, bytes: f64) -> f64 {
    let n_f = n as f64;
    match step {
        ReshardStep::AllReduce { .. } => 2.0 * (n_f - 1.0) / n_f * bytes,
        ReshardStep::AllGather { .. } => (n_f - 1.0) * bytes,
        ReshardStep::ReduceScatter { .. } | ReshardStep::AllToAll { .. } => {
            (n_f - 1.0) / n_f * bytes
        }
        ReshardStep::LocalSlice { .. } | ReshardStep::MakePartial { .. } => 0.0,
    }
}

/// Placements of a sharding on the mesh's non-trivial axes, in mesh order.
fn from_sharding(s: &Sharding, axes: &[(String, usize)]) -> Vec<Placement> {
    axes.iter()
        .map(|(name, _)| s.get(name).unwrap_or(Placement::Replicate))
        .collect()
}

/// A layout during the search: the placement of each non-trivial mesh axis, and for each dim
/// the axes splitting it, outermost first (indices into the axis list).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    placements: Vec<Placement>,
    nests: Vec<Vec<usize>>,
}

impl State {
    fn of(
        placements: Vec<Placement>,
        rank: usize,
        s: &Sharding,
        axes: &[(String, usize)],
    ) -> State {
        let mut nests = vec![Vec::new(); rank];
        for (d, nest) in nests.iter_mut().enumerate() {
            for name in s.axes_sharding_dim(d) {
                if let Some(i) = axes.iter().position(|(a, _)| a == name) {
                    nest.push(i);
                }
            }
        }
        State { placements, nests }
    }

    fn partial_kind(&self) -> Option<ReduceKind> {
        self.placements.iter().find_map(|p| match p {
            Placement::Partial(k) => Some(*k),
            Placement::Replicate | Placement::Shard(_) => None,
        })
    }
}

/// One single-axis step of the search (axis indices, not names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Move {
    /// Over the axes whose bits are set (in mesh order).
    AllReduce(u32, ReduceKind),
    AllGather(usize, usize),
    ReduceScatter(usize, usize, ReduceKind),
    AllToAll {
        axis: usize,
        from: usize,
        to: usize,
    },
    Slice(usize, usize),
    MakePartial(usize, ReduceKind),
}

/// The search problem: the global shape, the element size, the axis sizes and the target.
struct Space {
    dims: Vec<usize>,
    elem_bytes: f64,
    sizes: Vec<usize>,
    target: State,
}

/// States explored before the search gives up on optimality (meshes with many axes and
/// tensors of high rank); the canonical plan is used then.
const MAX_STATES: usize = 200_000;

/// Cost of a path: collectives, then bytes sent, then steps.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cost {
    collectives: usize,
    bytes: f64,
    steps: usize,
}

impl Cost {
    const ZERO: Cost = Cost {
        collectives: 0,
        bytes: 0.0,
        steps: 0,
    };

    fn cmp(&self, other: &Cost) -> Ordering {
        self.collectives
            .cmp(&other.collectives)
            .then(self.bytes.total_cmp(&other.bytes))
            .then(self.steps.cmp(&other.steps))
    }

    fn then(&self, m: Move, bytes: f64) -> Cost {
        let communicates = match m {
            Move::AllReduce(..)
            | Move::AllGather(..)
            | Move::ReduceScatter(..)
            | Move::AllToAll { .. } => 1,
            Move::Slice(..) | Move::MakePartial(..) => 0,
        };
        Cost {
            collectives: self.collectives + communicates,
            bytes: self.bytes + bytes,
            steps: self.steps + 1,
        }
    }
}

/// A heap entry, ordered so that `BinaryHeap` pops the cheapest (then the oldest) first.
struct Entry {
    cost: Cost,
    seq: usize,
    state: State,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .cost
            .cmp(&self.cost)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

impl Space {
    fn local_dims(&self, s: &State) -> Vec<usize> {
        self.dims
            .iter()
            .zip(&s.nests)
            .map(|(&size, nest)| size / nest.iter().map(|&a| self.sizes[a]).product::<usize>())
            .collect()
    }

    /// Dijkstra over layouts; `None` when the state budget runs out.
    fn search(&self, start: &State) -> Option<Vec<Move>> {
        let mut best: HashMap<State, (Cost, Option<(State, Move)>)> = HashMap::new();
        let mut heap = BinaryHeap::new();
        let mut seq = 0usize;
        best.insert(start.clone(), (Cost::ZERO, None));
        heap.push(Entry {
            cost: Cost::ZERO,
            seq,
            state: start.clone(),
        });
        while let Some(Entry { cost, state, .. }) = heap.pop() {
            if best
                .get(&state)
                .is_some_and(|(c, _)| c.cmp(&cost) == Ordering::Less)
            {
                continue;
            }
            if state == self.target {
                let mut moves = Vec::new();
                let mut cur = state;
                while let Some((_, Some((prev, m)))) = best.get(&cur) {
                    moves.push(*m);
                    cur = prev.clone();
                }
                moves.reverse();
                return Some(moves);
            }
            for (m, next, bytes) in self.moves(&state) {
                let c = cost.then(m, bytes);
                let better = best
                    .get(&next)
                    .is_none_or(|(old, _)| c.cmp(old) == Ordering::Less);
                if better {
                    if best.len() >= MAX_STATES {
                        return None;
                    }
                    best.insert(next.clone(), (c, Some((state.clone(), m))));
                    seq += 1;
                    heap.push(Entry {
                        cost: c,
                        seq,
                        state: next,
                    });
                }
            }
        }
        None
    }

    /// Every legal single-axis step from `s`, with the resulting layout and its bytes.
    fn moves(&self, s: &State) -> Vec<(Move, State, f64)> {
        let local = self.local_dims(s);
        let bytes = local.iter().product::<usize>() as f64 * self.elem_bytes;
        let rank = self.dims.len();
        let mut out = Vec::new();
        for (a, &p) in s.placements.iter().enumerate() {
            let n = self.sizes[a];
            let target = self.target.placements[a];
            let mut push = |m: Move, next: State| {
                let cost = match m {
                    Move::AllGather(..) => (n as f64 - 1.0) * bytes,
                    Move::ReduceScatter(..) | Move::AllToAll { .. } => {
                        (n as f64 - 1.0) / n as f64 * bytes
                    }
                    Move::AllReduce(..) | Move::Slice(..) | Move::MakePartial(..) => 0.0,
                };
                out.push((m, next, cost));
            };
            match p {
                Placement::Partial(k) => {
                    for (d, &len) in local.iter().enumerate() {
                        if len.is_multiple_of(n) {
                            let mut next = s.clone();
                            next.placements[a] = Placement::Shard(d);
                            next.nests[d].push(a);
                            push(Move::ReduceScatter(a, d, k), next);
                        }
                    }
                }
                Placement::Shard(d) => {
                    if s.nests[d].last() == Some(&a) {
                        let mut gathered = s.clone();
                        gathered.placements[a] = Placement::Replicate;
                        gathered.nests[d].pop();
                        push(Move::AllGather(a, d), gathered.clone());
                        for e in (0..rank).filter(|&e| e != d) {
                            if local[e].is_multiple_of(n) {
                                let mut next = gathered.clone();
                                next.placements[a] = Placement::Shard(e);
                                next.nests[e].push(a);
                                push(
                                    Move::AllToAll {
                                        axis: a,
                                        from: d,
                                        to: e,
                                    },
                                    next,
                                );
                            }
                        }
                    }
                }
                Placement::Replicate => {
                    for (d, &len) in local.iter().enumerate() {
                        if len.is_multiple_of(n) {
                            let mut next = s.clone();
                            next.placements[a] = Placement::Shard(d);
                            next.nests[d].push(a);
                            push(Move::Slice(a, d), next);
                        }
                    }
                    // Only towards a partial target, and never mixing reductions.
                    if let Placement::Partial(k) = target
                        && s.partial_kind().is_none_or(|pk| pk == k)
                    {
                        let mut next = s.clone();
                        next.placements[a] = Placement::Partial(k);
                        push(Move::MakePartial(a, k), next);
                    }
                }
            }
        }
        // All-reduces over every subset of the partial axes at once: one ring over the
        // whole group moves less than one ring per axis.
        let partial: Vec<usize> = (0..s.placements.len())
            .filter(|&a| matches!(s.placements[a], Placement::Partial(_)))
            .collect();
        if let Some(k) = s.partial_kind() {
            // Subsets of up to 6 axes; beyond, each axis alone and all of them together.
            let subsets: Vec<u32> = if partial.len() <= 6 {
                (1u32..(1 << partial.len())).collect()
            } else {
                (0..partial.len())
                    .map(|b| 1 << b)
                    .chain([(1u32 << partial.len()) - 1])
                    .collect()
            };
            for subset in subsets {
                let mut next = s.clone();
                let mut mask = 0u32;
                let mut n = 1usize;
                for (bit, &a) in partial.iter().enumerate() {
                    if subset & (1 << bit) != 0 {
                        mask |= 1 << a;
                        n *= self.sizes[a];
                        next.placements[a] = Placement::Replicate;
                    }
                }
                let cost = 2.0 * (n as f64 - 1.0) / n as f64 * bytes;
                out.push((Move::AllReduce(mask, k), next, cost));
            }
        }
        out
    }

    /// A plan that is always correct though not always cheapest: gather every split
    /// (innermost first), reduce every partial axis whose target differs, then slice to the
    /// target's nests (outermost first) and make the target's partial axes partial.
    fn canonical(&self, start: &State) -> Vec<Move> {
        let mut moves = Vec::new();
        for (d, nest) in start.nests.iter().enumerate() {
            moves.extend(nest.iter().rev().map(|&a| Move::AllGather(a, d)));
        }
        for (a, &p) in start.placements.iter().enumerate() {
            if let Placement::Partial(k) = p
                && self.target.placements[a] != p
            {
                moves.push(Move::AllReduce(1 << a, k));
            }
        }
        for (d, nest) in self.target.nests.iter().enumerate() {
            moves.extend(nest.iter().map(|&a| Move::Slice(a, d)));
        }
        for (a, &p) in self.target.placements.iter().enumerate() {
            if let Placement::Partial(k) = p
                && start.placements[a] != p
            {
                moves.push(Move::MakePartial(a, k));
            }
        }
        moves
    }
}

/// Turns single-axis moves into steps, merging neighbours that one collective over several
/// axes does identically: all-reduces (and make-partials) of one kind in any order, gathers of
/// one dim (the later gather's axis is the outer one), and reduce-scatters or slices of one
/// dim (the earlier one's axis is the outer one). All-to-alls are not merged: one over two
/// axes nests them in the opposite order to two in sequence.
fn merge(moves: &[Move], axes: &[(String, usize)]) -> Vec<ReshardStep> {
    let name = |a: usize| axes[a].0.clone();
    let masked = |mask: u32| (0..axes.len()).filter(move |&a| mask & (1 << a) != 0);
    let mut steps: Vec<ReshardStep> = Vec::new();
    for &m in moves {
        let merged = match (steps.last_mut(), m) {
            (
                Some(ReshardStep::AllReduce {
                    axes: group,
                    reduce,
                }),
                Move::AllReduce(mask, k),
            ) if *reduce == k => {
                group.extend(masked(mask).map(name));
                true
            }
            (
                Some(ReshardStep::MakePartial {
                    axes: group,
                    reduce,
                }),
                Move::MakePartial(a, k),
            ) if *reduce == k => {
                group.push(name(a));
                true
            }
            (Some(ReshardStep::AllGather { axes: group, dim }), Move::AllGather(a, d))
                if *dim == d =>
            {
                group.insert(0, name(a));
                true
            }
            (
                Some(ReshardStep::ReduceScatter {
                    axes: group,
                    dim,
                    reduce,
                }),
                Move::ReduceScatter(a, d, k),
            ) if *dim == d && *reduce == k => {
                group.push(name(a));
                true
            }
            (Some(ReshardStep::LocalSlice { axes: group, dim }), Move::Slice(a, d))
                if *dim == d =>
            {
                group.push(name(a));
                true
            }
            _ => false,
        };
        if !merged {
            steps.push(match m {
                Move::AllReduce(mask, reduce) => ReshardStep::AllReduce {
                    axes: masked(mask).map(name).collect(),
                    reduce,
                },
                Move::AllGather(a, dim) => ReshardStep::AllGather {
                    axes: vec![name(a)],
                    dim,
                },
                Move::ReduceScatter(a, dim, reduce) => ReshardStep::ReduceScatter {
                    axes: vec![name(a)],
                    dim,
                    reduce,
                },
                Move::AllToAll { axis, from, to } => ReshardStep::AllToAll {
                    axes: vec![name(axis)],
                    split_dim: to,
                    concat_dim: from,
                },
                Move::Slice(a, dim) => ReshardStep::LocalSlice {
                    axes: vec![name(a)],
                    dim,
                },
                Move::MakePartial(a, reduce) => ReshardStep::MakePartial {
                    axes: vec![name(a)],
                    reduce,
                },
            });
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    fn sh(p: &[(&str, Placement)]) -> Sharding {
        Sharding::user(p.iter().map(|(a, p)| (a.to_string(), *p)))
    }

    #[test]
    fn table_of_the_design_brief() {
        let mesh = DeviceMesh::new([("tp", 4)]).unwrap();
        let ty = TensorType::new(DType::F32, [8, 8]);
        let r = sh(&[]);
        let s0 = sh(&[("tp", Placement::Shard(0))]);
        let s1 = sh(&[("tp", Placement::Shard(1))]);
        let p = sh(&[("tp", Placement::Partial(ReduceKind::Sum))]);
        let tp = || vec!["tp".to_string()];
        let plan = |a: &Sharding, b: &Sharding| plan_reshard(&ty, a, b, &mesh).unwrap().steps;
        assert_eq!(plan(&r, &r), vec![]);
        assert_eq!(
            plan(&r, &s0),
            vec![ReshardStep::LocalSlice { axes: tp(), dim: 0 }]
        );
        assert_eq!(
            plan(&r, &p),
            vec![ReshardStep::MakePartial {
                axes: tp(),
                reduce: ReduceKind::Sum
            }]
        );
        assert_eq!(
            plan(&s0, &r),
            vec![ReshardStep::AllGather { axes: tp(), dim: 0 }]
        );
        assert_eq!(
            plan(&s0, &s1),
            vec![ReshardStep::AllToAll {
                axes: tp(),
                split_dim: 1,
                concat_dim: 0
            }]
        );
        assert_eq!(
            plan(&p, &r),
            vec![ReshardStep::AllReduce {
                axes: tp(),
                reduce: ReduceKind::Sum
            }]
        );
        assert_eq!(
            plan(&p, &s1),
            vec![ReshardStep::ReduceScatter {
                axes: tp(),
                dim: 1,
                reduce: ReduceKind::Sum
            }]
        );
    }

    #[test]
    fn partial_on_two_axes_is_one_all_reduce() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        let ty = TensorType::new(DType::F32, [4]);
        let p = Placement::Partial(ReduceKind::Sum);
        let plan = plan_reshard(&ty, &sh(&[("dp", p), ("tp", p)]), &sh(&[]), &mesh).unwrap();
        assert_eq!(
            plan.steps,
            vec![ReshardStep::AllReduce {
                axes: vec!["dp".into(), "tp".into()],
                reduce: ReduceKind::Sum
            }]
        );
        // Ring all-reduce over 4 devices: 2 * 3/4 * 16 bytes.
        assert_eq!(plan.bytes_sent, 24.0);
    }

    #[test]
    fn reduce_scatter_before_gathering_another_axis() {
        // {dp: P, tp: S(1)} -> {dp: S(0), tp: R}: scattering dp first halves the gather.
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        let ty = TensorType::new(DType::F32, [4, 4]);
        let plan = plan_reshard(
            &ty,
            &sh(&[
                ("dp", Placement::Partial(ReduceKind::Sum)),
                ("tp", Placement::Shard(1)),
            ]),
            &sh(&[("dp", Placement::Shard(0))]),
            &mesh,
        )
        .unwrap();
        assert!(matches!(
            plan.steps[0],
            ReshardStep::ReduceScatter { dim: 0, .. }
        ));
        assert_eq!(plan.steps.len(), 2);
    }

    #[test]
    fn mixed_partials_are_rejected() {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
        let ty = TensorType::new(DType::F32, [4]);
        let s = sh(&[
            ("dp", Placement::Partial(ReduceKind::Sum)),
            ("tp", Placement::Partial(ReduceKind::Max)),
        ]);
        assert!(plan_reshard(&ty, &s, &sh(&[]), &mesh).is_err());
    }

    #[test]
    fn canonical_plan_reaches_the_target() {
        let axes = vec![("a".to_string(), 2), ("b".to_string(), 2)];
        let from = sh(&[("a", Placement::Shard(0)), ("b", Placement::Shard(0))]);
        let to = sh(&[("b", Placement::Shard(0)), ("a", Placement::Shard(0))]);
        let space = Space {
            dims: vec![4],
            elem_bytes: 4.0,
            sizes: vec![2, 2],
            target: State::of(from_sharding(&to, &axes), 1, &to, &axes),
        };
        let start = State::of(from_sharding(&from, &axes), 1, &from, &axes);
        let steps = merge(&space.canonical(&start), &axes);
        assert_eq!(
            steps,
            vec![
                ReshardStep::AllGather {
                    axes: vec!["a".into(), "b".into()],
                    dim: 0
                },
                ReshardStep::LocalSlice {
                    axes: vec!["b".into(), "a".into()],
                    dim: 0
                },
            ]
        );
    }
}
