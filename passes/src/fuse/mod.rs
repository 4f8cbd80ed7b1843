//! The rewrite and fusion pass over rank programs: algebraic simplification and
//! common-subexpression elimination in an e-graph (egg), then the grouping of element-wise
//! regions into [`autopar_ir::Op::Fusion`] nodes.
//!
//! It runs on the local programs partitioning made (and on the sub-programs of a pipeline),
//! so it needs no sharding rule and no derivative, and it keeps what executors rely on: every
//! value keeps its id (a value the rewrites merged takes the smallest id of its class), every
//! output its name, every parameter, input, `send` and `recv` its node, and every node its
//! metadata.
//!
//! - [`lang`]: the e-graph language (every op interned, pure ops hash-consed) and the type
//!   analysis.
//! - [`rules`]: the rewrite rules, each exact under the interpreter's semantics.
//! - [`region`]: region formation and the cost check.
//!
//! Collectives merge only where every rank of the program's group makes the same merge
//! ([`fuse_group`]): a rank that skipped an all-reduce its peers still issue would pair the
//! wrong calls.

pub mod lang;
pub mod region;
pub mod rules;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use autopar_cost_model::OpCostModel;
use autopar_ir::{Graph, LayerId, NodeId, Op, Phase, TensorType, ValueId};
use egg::{CostFunction, Extractor, Id, Language, Runner};

use crate::PassError;
use lang::{RankEGraph, Term, Types, is_pure_compute};

/// Options of [`fuse`].
#[derive(Clone, Debug, PartialEq)]
pub struct FuseOptions {
    /// Run the rewrite rules (CSE happens either way: it is the e-graph's hash-consing).
    pub simplify: bool,
    /// Merge identical collectives on identical operands.
    pub merge_collectives: bool,
    /// Group element-wise regions into fusions.
    pub regions: bool,
    /// The e-graph runner's iteration limit.
    pub iter_limit: usize,
    /// Its node limit: this many e-nodes per node of the program, and at least 10 000.
    pub nodes_per_node: usize,
    /// Its time limit, per program.
    pub time_limit: Duration,
    /// Equal pure nodes of different phases or micro-batches merge only when their results
    /// are at most this fraction (1/N) of the program's largest value: merging keeps the
    /// first value alive until the last use of the other, which is cheap for a loss's
    /// per-position maximum and sum but would undo recomputation (of positions, masks,
    /// activations) for large ones.
    pub cross_phase_share: u64,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            simplify: true,
            merge_collectives: true,
            regions: true,
            iter_limit: 16,
            nodes_per_node: 4,
            time_limit: Duration::from_secs(5),
            cross_phase_share: 16,
        }
    }
}

/// What [`fuse`] did to one program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FuseReport {
    /// Nodes before.
    pub nodes_before: usize,
    /// Nodes after simplification, before fusion.
    pub nodes_simplified: usize,
    /// Nodes after.
    pub nodes_after: usize,
    /// Fusion nodes made.
    pub fusions: usize,
    /// Nodes that became members of fusions.
    pub fused_members: usize,
    /// Constants, broadcasts and reshapes of them copied into fusion bodies.
    pub duplicated: usize,
    /// Candidate regions the cost model kept unfused.
    pub rejected: usize,
    /// Collective nodes before.
    pub collectives_before: usize,
    /// Collective nodes after (the difference was merged).
    pub collectives_after: usize,
    /// Why the e-graph runner stopped, and after how many iterations.
    pub stop_reason: String,
    /// Iterations the runner made.
    pub iterations: usize,
    /// E-nodes of the saturated e-graph.
    pub egraph_nodes: usize,
    /// Bytes read and written by every node, as the cost model counts them, before.
    pub bytes_moved_before: f64,
    /// The same after.
    pub bytes_moved_after: f64,
    /// Bytes of the results of every node but parameters and inputs, before.
    pub bytes_written_before: u64,
    /// The same after.
    pub bytes_written_after: u64,
    /// For every value of the fused program, the values of the original it stands for (equal
    /// to it; a fusion's results are values of its class too).
    pub values: BTreeMap<ValueId, Vec<ValueId>>,
    /// Wall time of the pass.
    pub wall: Duration,
}

impl FuseReport {
    /// Collectives merged into others.
    pub fn collectives_merged(&self) -> usize {
        self.collectives_before
            .saturating_sub(self.collectives_after)
    }
}

/// Rewrites and fuses one program alone. Merging a collective is safe only when every rank
/// of its group merges it too: for programs that communicate, use [`fuse_group`].
pub fn fuse(
    graph: &Graph,
    options: &FuseOptions,
    costs: &dyn OpCostModel,
) -> Result<(Graph, FuseReport), PassError> {
    let mut out = fuse_group(&[graph], options, costs)?;
    out.pop().ok_or_else(|| PassError::BadGraph {
        graph: graph.name().to_string(),
        detail: "fusion produced no program".into(),
    })
}

/// Rewrites and fuses the programs of one group of ranks (the same program on every rank of
/// an SPMD mesh, or the same sub-program of every pipeline), merging a collective only where
/// every program merges the same nodes (by node id, which partitioning makes equal across
/// ranks); where they disagree, the disputed collectives stay apart.
pub fn fuse_group(
    graphs: &[&Graph],
    options: &FuseOptions,
    costs: &dyn OpCostModel,
) -> Result<Vec<(Graph, FuseReport)>, PassError> {
    let start = Instant::now();
    let mut mergeable: Option<BTreeSet<NodeId>> = match options.merge_collectives {
        true => None,
        false => Some(BTreeSet::new()),
    };
    let mut simplified = Vec::new();
    // Each round can only shrink the set of merges; four rounds, then nothing merges.
    for round in 0..5 {
        if round == 4 {
            mergeable = Some(BTreeSet::new());
        }
        simplified = graphs
            .iter()
            .map(|g| simplify(g, options, mergeable.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let first = &simplified[0].merged;
        if simplified.iter().all(|s| s.merged == *first) {
            break;
        }
        let agreed: BTreeSet<(NodeId, NodeId)> =
            simplified.iter().skip(1).fold(first.clone(), |acc, s| {
                acc.intersection(&s.merged).copied().collect()
            });
        mergeable = Some(agreed.iter().flat_map(|&(a, b)| [a, b]).collect());
    }
    let mut out = Vec::with_capacity(graphs.len());
    for (g, s) in graphs.iter().zip(simplified) {
        let mut report = FuseReport {
            nodes_before: g.num_nodes(),
            nodes_simplified: s.graph.num_nodes(),
            collectives_before: count_collectives(g),
            stop_reason: s.stop_reason,
            iterations: s.iterations,
            egraph_nodes: s.egraph_nodes,
            values: s.values,
            ..FuseReport::default()
        };
        let fused = match options.regions {
            true => {
                let (fused, stats) = region::fuse_regions(&s.graph, costs)?;
                report.fusions = stats.fusions;
                report.fused_members = stats.members;
                report.duplicated = stats.duplicated;
                report.rejected = stats.rejected;
                fused
            }
            false => s.graph,
        };
        report.nodes_after = fused.num_nodes();
        report.collectives_after = count_collectives(&fused);
        (report.bytes_moved_before, report.bytes_written_before) = traffic(g, costs);
        (report.bytes_moved_after, report.bytes_written_after) = traffic(&fused, costs);
        out.push((fused, report));
    }
    let wall = start.elapsed();
    for (_, r) in &mut out {
        r.wall = wall / graphs.len().max(1) as u32;
    }
    Ok(out)
}

fn is_collective(op: &Op) -> bool {
    op.is_communication() && !matches!(op, Op::Send { .. } | Op::Recv { .. })
}

/// The merge domain of a large pure node: its phase and micro-batch, except that the loss's
/// forward and backward are one domain (the backward starts where the loss's forward ends, so
/// a value of the one kept for the other lives no longer: the softmax's max and sum, and their
/// all-reduces under `tp`, are computed once).
fn merge_domain(meta: &autopar_ir::NodeMeta) -> (Option<Phase>, Option<u32>) {
    let phase = match (meta.layer, meta.phase) {
        (Some(LayerId::Loss), Some(Phase::Backward)) => Some(Phase::Forward),
        (_, phase) => phase,
    };
    (phase, meta.micro_batch)
}

/// Whether a collective may merge with an identical one: every collective but an
/// all-gather, whose result is larger than its operand (merging ZeRO-3's backward re-gather of
/// a weight into the forward's would keep the gathered weight alive between them, undoing
/// what the re-gather is for).
fn may_merge_collective(op: &Op) -> bool {
    is_collective(op) && !matches!(op, Op::AllGather { .. })
}

fn count_collectives(g: &Graph) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&n| is_collective(&g.node(n).op))
        .count()
}

/// Bytes moved (the cost model's count) and bytes written by the nodes of `g`.
pub fn traffic(g: &Graph, costs: &dyn OpCostModel) -> (f64, u64) {
    let (mut moved, mut written) = (0.0, 0u64);
    for n in g.node_ids() {
        let node = g.node(n);
        let ins: Vec<&TensorType> = node.inputs.iter().map(|&v| g.ty(v)).collect();
        let outs: Vec<&TensorType> = node.outputs.iter().map(|&v| g.ty(v)).collect();
        moved += costs.op_cost(&node.op, &ins, &outs, None).bytes;
        if !matches!(node.op, Op::Parameter { .. } | Op::Input { .. }) {
            written += outs.iter().map(|t| t.size_bytes()).sum::<u64>();
        }
    }
    (moved, written)
}

/// A program after the e-graph: simplified and with common subexpressions merged.
struct Simplified {
    graph: Graph,
    /// `(first, other)` for every collective merged into an earlier one, by original node.
    merged: BTreeSet<(NodeId, NodeId)>,
    values: BTreeMap<ValueId, Vec<ValueId>>,
    stop_reason: String,
    iterations: usize,
    egraph_nodes: usize,
}

/// The extraction cost: the bytes on the costliest path to the node (each node costs its
/// result bytes plus one), so that a rewrite is chosen only when it computes less. A path
/// cost rather than a tree sum, which would count a value once per path to it.
struct PathBytes<'a>(&'a RankEGraph);

impl CostFunction<Term> for PathBytes<'_> {
    type Cost = u64;

    fn cost<C>(&mut self, enode: &Term, mut costs: C) -> u64
    where
        C: FnMut(Id) -> u64,
    {
        let own = match enode {
            Term::Result { .. } => 0,
            Term::Apply { .. } => {
                let bytes: u64 = self
                    .0
                    .lookup(enode.clone())
                    .map(|c| self.0[c].data.iter().map(|t| t.size_bytes()).sum())
                    .unwrap_or(0);
                bytes.saturating_add(1)
            }
        };
        let children = enode
            .children()
            .iter()
            .map(|&c| costs(c))
            .max()
            .unwrap_or(0);
        own.saturating_add(children)
    }
}

/// Runs the e-graph over `graph`: its nodes as terms (collectives pure when `mergeable` is
/// `None` or lists them), the rules to saturation or the runner's limits, and the cheapest
/// program extracted, its nodes in the original order where dependencies allow.
fn simplify(
    graph: &Graph,
    options: &FuseOptions,
    mergeable: Option<&BTreeSet<NodeId>>,
) -> Result<Simplified, PassError> {
    let order = graph.topo_order()?;
    let mut egraph = RankEGraph::new(Types {
        mesh: graph.mesh().cloned(),
        ..Types::default()
    });
    // Merge domains: (phase, micro-batch), numbered in order of appearance.
    let mut domains: HashMap<(Option<Phase>, Option<u32>), u32> = HashMap::new();
    let largest: u64 = graph
        .value_ids()
        .map(|v| graph.ty(v).size_bytes())
        .max()
        .unwrap_or(0);
    let mut value_class: HashMap<ValueId, Id> = HashMap::new();
    let mut node_class: Vec<(NodeId, Id)> = Vec::with_capacity(order.len());
    let mut roots: Vec<Id> = Vec::new();
    for &n in &order {
        let node = graph.node(n);
        // A recomputed node stands apart: merged with the forward value it recomputes, it
        // would keep that value alive until the backward, undoing the recompute.
        let recomputed = graph.meta(n).phase == Some(Phase::Recompute);
        let pure = !recomputed
            && (is_pure_compute(&node.op)
                || (may_merge_collective(&node.op) && mergeable.is_none_or(|m| m.contains(&n))));
        let identity = match pure {
            false => egraph.analysis.fresh_identity(),
            true => {
                let bytes: u64 = node.outputs.iter().map(|&v| graph.ty(v).size_bytes()).sum();
                match bytes.saturating_mul(options.cross_phase_share) <= largest {
                    true => 0,
                    false => {
                        let next = domains.len() as u32 + 1;
                        *domains.entry(merge_domain(&graph.meta(n))).or_insert(next)
                    }
                }
            }
        };
        let op = egraph.analysis.table.intern(&node.op);
        let operands = node.inputs.iter().map(|v| value_class[v]).collect();
        let class = egraph.add(Term::Apply {
            op,
            identity,
            operands,
        });
        if !pure || is_collective(&node.op) {
            roots.push(class);
        }
        match node.outputs.as_slice() {
            [v] => {
                value_class.insert(*v, class);
            }
            outs => {
                for (i, v) in outs.iter().enumerate() {
                    let r = egraph.add(Term::Result {
                        index: i as u32,
                        tuple: [class],
                    });
                    value_class.insert(*v, r);
                }
            }
        }
        node_class.push((n, class));
    }
    roots.extend(graph.outputs().iter().map(|(_, v)| value_class[v]));

    let (egraph, stop_reason, iterations) = if options.simplify {
        let limit = (options.nodes_per_node * order.len()).max(10_000);
        let runner = Runner::default()
            .with_egraph(egraph)
            .with_iter_limit(options.iter_limit)
            .with_node_limit(limit)
            .with_time_limit(options.time_limit)
            .run(&rules::rewrites(&rules::all_rules()));
        let reason = match &runner.stop_reason {
            Some(r) => format!("{r:?}"),
            None => "not run".to_string(),
        };
        (runner.egraph, reason, runner.iterations.len())
    } else {
        let mut egraph = egraph;
        egraph.rebuild();
        (egraph, "rules off".to_string(), 0)
    };
    let egraph_nodes = egraph.total_number_of_nodes();
    let extractor = Extractor::new(&egraph, PathBytes(&egraph));
    let canon = |c: Id| egraph.find(c);

    // The position of each class: that of its first original node, which orders the output.
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut class_pos: HashMap<Id, usize> = HashMap::new();
    let mut class_origin: HashMap<Id, NodeId> = HashMap::new();
    let mut original_terms: HashMap<(lang::OpRef, Vec<Id>), NodeId> = HashMap::new();
    for &(n, c) in &node_class {
        let p = pos[&n];
        let mut classes = vec![canon(c)];
        classes.extend(graph.node(n).outputs.iter().map(|v| canon(value_class[v])));
        for c in classes {
            let e = class_pos.entry(c).or_insert(p);
            if p <= *e {
                *e = p;
                class_origin.insert(c, n);
            }
        }
        let node = graph.node(n);
        if let Some(r) = egraph.analysis.table.find(&node.op) {
            let operands = node.inputs.iter().map(|v| canon(value_class[v])).collect();
            original_terms.entry((r, operands)).or_insert(n);
        }
    }
    // The smallest original value id of each class.
    let mut class_value: HashMap<Id, ValueId> = HashMap::new();
    for (&v, &c) in &value_class {
        let e = class_value.entry(canon(c)).or_insert(v);
        *e = (*e).min(v);
    }

    // The classes the roots need, through each class's best node.
    let mut needed: Vec<Id> = Vec::new();
    let mut seen: BTreeSet<Id> = BTreeSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|&c| canon(c)).collect();
    while let Some(c) = stack.pop() {
        if !seen.insert(c) {
            continue;
        }
        needed.push(c);
        stack.extend(
            extractor
                .find_best_node(c)
                .children()
                .iter()
                .map(|&k| canon(k)),
        );
    }
    // Units are classes whose best node is an op; a result class is its op's.
    let unit_of = |c: Id| -> Id {
        match extractor.find_best_node(c) {
            Term::Result { tuple, .. } => canon(tuple[0]),
            Term::Apply { .. } => c,
        }
    };
    let mut next_id = graph.value_ids().map(|v| v.0 + 1).max().unwrap_or(0);
    let mut id_of: HashMap<Id, ValueId> = HashMap::new();
    let units: BTreeSet<Id> = needed.iter().map(|&c| unit_of(c)).collect();
    // Priority: the class's position, or for a class the rules made, its operands' latest.
    let mut prio: HashMap<Id, usize> = HashMap::new();
    fn priority(
        c: Id,
        extractor: &Extractor<'_, PathBytes<'_>, Term, Types>,
        egraph: &RankEGraph,
        class_pos: &HashMap<Id, usize>,
        prio: &mut HashMap<Id, usize>,
    ) -> usize {
        let c = egraph.find(c);
        if let Some(&p) = prio.get(&c) {
            return p;
        }
        let p = match class_pos.get(&c) {
            Some(&p) => p,
            None => {
                // Mark before recursing (the extracted program is acyclic; this only bounds).
                prio.insert(c, 0);
                extractor
                    .find_best_node(c)
                    .children()
                    .iter()
                    .map(|&k| priority(k, extractor, egraph, class_pos, prio))
                    .max()
                    .unwrap_or(0)
            }
        };
        prio.insert(c, p);
        p
    }
    // Communication keeps its order: a rank's sends, receives and collectives pair with its
    // peers' in the order they are issued, so each waits for the one before it.
    let is_comm = |u: Id| match extractor.find_best_node(u) {
        Term::Apply { op, .. } => egraph.analysis.table.get(*op).is_communication(),
        Term::Result { .. } => false,
    };
    let mut comm: Vec<(usize, Id)> = Vec::new();
    for &u in &units {
        if is_comm(u) {
            comm.push((priority(u, &extractor, &egraph, &class_pos, &mut prio), u));
        }
    }
    comm.sort_unstable();
    let previous_comm: HashMap<Id, Id> = comm.windows(2).map(|w| (w[1].1, w[0].1)).collect();
    let mut indegree: HashMap<Id, usize> = HashMap::new();
    let mut dependents: HashMap<Id, Vec<Id>> = HashMap::new();
    for &u in &units {
        let mut deps: Vec<Id> = extractor
            .find_best_node(u)
            .children()
            .iter()
            .map(|&k| unit_of(canon(k)))
            .collect();
        deps.extend(previous_comm.get(&u).copied());
        deps.sort_unstable();
        deps.dedup();
        indegree.insert(u, deps.len());
        for d in deps {
            dependents.entry(d).or_default().push(u);
        }
    }
    let mut ready: BinaryHeap<Reverse<(usize, Id)>> = BinaryHeap::new();
    for &u in &units {
        if indegree[&u] == 0 {
            let p = priority(u, &extractor, &egraph, &class_pos, &mut prio);
            ready.push(Reverse((p, u)));
        }
    }
    let mut out = Graph::new(graph.name());
    out.set_mesh(graph.mesh().cloned());
    let mut emitted = 0usize;
    let value_of = |c: Id, id_of: &mut HashMap<Id, ValueId>, next: &mut u32| -> ValueId {
        let c = canon(c);
        if let Some(&v) = id_of.get(&c) {
            return v;
        }
        let v = class_value.get(&c).copied().unwrap_or_else(|| fresh(next));
        id_of.insert(c, v);
        v
    };
    while let Some(Reverse((_, u))) = ready.pop() {
        emitted += 1;
        let Term::Apply { op, operands, .. } = extractor.find_best_node(u) else {
            continue;
        };
        let op = egraph.analysis.table.get(*op).clone();
        let inputs: Vec<ValueId> = operands
            .iter()
            .map(|&k| value_of(k, &mut id_of, &mut next_id))
            .collect();
        let n_results = egraph[u].data.len();
        let results: Vec<ValueId> = match n_results {
            1 => vec![value_of(u, &mut id_of, &mut next_id)],
            // A multi-result op: result `i` keeps the id of its `Result` class, unless that
            // class is computed by another node (then the result is unused and fresh).
            _ => (0..n_results)
                .map(|i| {
                    let r = egraph.lookup(Term::Result {
                        index: i as u32,
                        tuple: [u],
                    });
                    match r.map(canon) {
                        Some(r)
                            if matches!(
                                extractor.find_best_node(r),
                                Term::Result { tuple, .. } if canon(tuple[0]) == u
                            ) =>
                        {
                            value_of(r, &mut id_of, &mut next_id)
                        }
                        _ => fresh(&mut next_id),
                    }
                })
                .collect(),
        };
        let origin = egraph
            .analysis
            .table
            .find(&op)
            .and_then(|r| {
                original_terms
                    .get(&(r, operands.iter().map(|&k| canon(k)).collect()))
                    .copied()
            })
            .or_else(|| class_origin.get(&u).copied());
        let scope = origin.and_then(|n| graph.node(n).scope.clone());
        let id = out.add_node_with_ids(op, &inputs, &results, scope)?;
        if let Some(n) = origin {
            out.set_meta(id, graph.meta(n));
        }
        for &v in &results {
            if let Ok(orig) = graph.value_checked(v) {
                out.set_sharding(v, orig.sharding.clone())?;
            }
        }
        for &d in dependents.get(&u).map(Vec::as_slice).unwrap_or(&[]) {
            let e = indegree.get_mut(&d).map(|e| {
                *e -= 1;
                *e
            });
            if e == Some(0) {
                let p = priority(d, &extractor, &egraph, &class_pos, &mut prio);
                ready.push(Reverse((p, d)));
            }
        }
    }
    if emitted != units.len() {
        return Err(PassError::BadGraph {
            graph: graph.name().to_string(),
            detail: "rewrite: the extracted program has a cycle".into(),
        });
    }
    for (name, v) in graph.outputs() {
        let id = value_of(value_class[v], &mut id_of, &mut next_id);
        out.add_output(name.clone(), id)?;
    }
    // What each value of the result stands for, and which collectives merged.
    let mut values: BTreeMap<ValueId, Vec<ValueId>> = BTreeMap::new();
    for (&v, &c) in &value_class {
        if let Some(&id) = id_of.get(&canon(c)) {
            values.entry(id).or_default().push(v);
        }
    }
    for vs in values.values_mut() {
        vs.sort_unstable();
    }
    let mut by_class: BTreeMap<Id, Vec<NodeId>> = BTreeMap::new();
    for &(n, c) in &node_class {
        if is_collective(&graph.node(n).op) {
            by_class.entry(canon(c)).or_default().push(n);
        }
    }
    let merged = by_class
        .values()
        .flat_map(|ns| ns[1..].iter().map(|&o| (ns[0], o)))
        .collect();
    Ok(Simplified {
        graph: out,
        merged,
        values,
        stop_reason,
        iterations,
        egraph_nodes,
    })
}

/// A value id no other value has: the next one.
fn fresh(next: &mut u32) -> ValueId {
    let v = ValueId(*next);
    *next += 1;
    v
}

#[cfg(test)]
mod tests;
