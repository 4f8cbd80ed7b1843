//! Pipeline splitting: cuts a training-step graph into `pp * vpp` virtual stages and emits,
//! for every (virtual stage, micro-batch), a forward and a backward sub-program, the values
//! sent between neighbouring stages, and an optimizer phase in per-rank segments
//! ([`autopar_ir::pipeline::PipelineProgram`]).
//!
//! # How nodes are placed
//!
//! The step graph of [`crate::train`] gives every node its metadata ([`autopar_ir::meta`]): a
//! node of micro-batch `k` in phase `forward` or `saved` is micro-batch `k`'s forward, one in
//! `backward`, `recompute` or `accumulate` its backward, and nodes without a micro-batch (the
//! optimizer, the loss mean) the optimizer phase. The node's layer ([`autopar_ir::LayerId`])
//! gives its place in the layer sequence, and the stage split (balanced by FLOPs,
//! [`balance::balance`]) its virtual stage; scopes are not read. Nodes without a layer float: a
//! forward one (an input slice) runs on the earliest stage that reads it, a backward one
//! (the loss seed, the gradient sum of an unscoped weight) on the earliest stage that holds
//! all its operands, an optimizer one beside its earliest operand (so the update of a weight
//! outside every layer, an embedding, runs on the stage that owns it). Constants are copied into every
//! sub-program that reads them; parameters and inputs are read from each rank's store.
//!
//! Forward and backward nodes computed by collectives from parameters and constants alone
//! (with the local ops on the way, `derived_nodes`) are copied in the same way: every
//! sub-program recomputes them where it needs them; so are nodes outside every micro-batch
//! computed from parameters and constants that a forward or backward reads (the loss scale
//! of f16 training, which multiplies every backward's seed). This is what makes ZeRO-3 (FSDP)
//! pipeline: the partitioner all-gathers a sharded weight once and lets every
//! micro-batch, stage and the backward read that copy, which no cut into sub-programs could
//! carry; recomputed, the gather runs in each (virtual stage, micro-batch, forward or
//! backward) sub-program that uses the weight, and the gathered weight is freed after its
//! last use there. Parameters do not change before the optimizer phase, so the copies are
//! equal to the original, and every rank of a collective's group recomputes it in the same
//! sub-program, so collectives still meet in the same order.
//!
//! # What crosses stages
//!
//! A forward value read at a later virtual stage (by its forward or its backward) travels
//! with the activation messages of that micro-batch, relayed stage by stage; a backward value
//! read at an earlier stage travels with the gradient messages. A tied weight read by the
//! first and the last stage (GPT's token embedding) gets its head gradient carried back with
//! the gradient messages and summed on the first stage, which owns the update; the updated
//! weight is then sent to the last stage in the optimizer phase. The optimizer phase (the
//! global gradient norm for clipping crosses every stage) runs as segments in one global
//! order, each segment's results sent to the ranks that read them. A forward value of
//! micro-batch `a` read by a later micro-batch on the same stage (a batch input the SPMD
//! partitioner resharded once for all micro-batches) stays in that rank's store until its
//! last reader. Any other flow (a forward value read by an earlier stage) is a
//! [`PassError::PipelineCut`].
//!
//! The step may be a partitioned local program with collectives over mesh axes other than
//! `pp` (the partitioner gives them the metadata of the global node they come from); the
//! sub-programs keep its mesh, and every node keeps its scope and metadata.

pub mod balance;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use autopar_ir::pipeline::{
    Carried, OptimizerSegment, PipelineProgram, SourceValue, StageProgram, value_name,
};
use autopar_ir::schedule::{Schedule, ScheduleKind};
use autopar_ir::{Graph, InputRole, LayerId, NodeId, Op, Phase as MetaPhase, ValueId};

pub use balance::{Layer, StageSplit, balance, equal_split, layer_sequence, layer_unit};

use crate::error::PassError;
use crate::train::TrainStep;

/// How to cut a step into a pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineOptions {
    /// Pipeline ranks.
    pub pp: usize,
    /// Model chunks per rank (virtual stages `pp * vpp`).
    pub vpp: usize,
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Pinned stage boundaries: layer names or indices that must start a virtual stage.
    pub boundaries: Vec<String>,
}

/// A step cut into a pipeline: the stage split and the program.
#[derive(Clone, Debug)]
pub struct PipelineSplit {
    /// The layer sequence and the virtual stages' first layers.
    pub split: StageSplit,
    /// The sub-programs, messages and optimizer segments.
    pub program: PipelineProgram,
}

/// The stage split of `step` for `n_stages` virtual stages: balanced FLOPs, pinned
/// boundaries respected.
pub fn plan_stages(
    step: &Graph,
    n_stages: usize,
    boundaries: &[String],
) -> Result<StageSplit, PassError> {
    let layers = layer_sequence(step)?;
    let pinned = balance::resolve_boundaries(&layers, boundaries)?;
    let costs: Vec<f64> = layers.iter().map(|l| l.flops).collect();
    let starts = balance(&costs, n_stages, &pinned)?;
    Ok(StageSplit { layers, starts })
}

/// When a node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Phase {
    Forward(usize),
    Backward(usize),
    Optimizer,
}

/// What a node is for the splitter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A parameter or input: read from the rank's store.
    Source,
    /// A node without operands: copied into each sub-program that reads it.
    Constant,
    /// A forward or backward node computed from parameters and constants only, through a
    /// collective (a ZeRO-3 weight's all-gather, see `derived_nodes`): recomputed in each
    /// sub-program that reads it, so it is never carried between sub-programs.
    Derived,
    /// Computed in `(phase, virtual stage)`.
    Placed(Phase, usize),
}

/// Cuts `step` into a pipeline (see the module docs).
pub fn split_pipeline(
    step: &TrainStep,
    options: &PipelineOptions,
) -> Result<PipelineSplit, PassError> {
    let g = &step.graph;
    let schedule = Schedule::new(
        options.schedule,
        options.pp,
        options.vpp,
        step.micro_batches,
    )
    .map_err(|e| PassError::BadOption {
        option: "--schedule",
        detail: e.to_string(),
    })?;
    let n_vs = schedule.num_virtual_stages();
    let split = plan_stages(g, n_vs, &options.boundaries)?;
    let layer_index: HashMap<LayerId, usize> = split
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| (l.id, i))
        .collect();
    let order = g.nodes_in_order();
    let last = n_vs - 1;

    // Phases and fixed stages; floating nodes are resolved below.
    let mut role: HashMap<NodeId, Role> = HashMap::new();
    let mut floating: Vec<(NodeId, Phase)> = Vec::new();
    let graph_outputs: HashSet<ValueId> = g.outputs().iter().map(|&(_, v)| v).collect();
    let derived = derived_nodes(g, &order, &graph_outputs);
    for &n in &order {
        let node = g.node(n);
        let r = match node.op {
            Op::Parameter { .. } | Op::Input { .. } => Role::Source,
            // A `recv` has no operands but is no constant: it runs where its metadata says,
            // in order with the sends of the same ring.
            _ if node.inputs.is_empty() && !node.op.is_communication() => Role::Constant,
            _ if derived.contains(&n) => Role::Derived,
            _ => {
                let (phase, layer) = classify(g, n);
                let Some(layer) = layer else {
                    floating.push((n, phase));
                    continue;
                };
                let Some(&layer) = layer_index.get(&layer) else {
                    return Err(PassError::BadGraph {
                        graph: g.name().to_string(),
                        detail: format!(
                            "{n} belongs to layer `{layer}`, which has no forward nodes in \
             micro-batch 0"
                        ),
                    });
                };
                Role::Placed(phase, split.stage_of_layer(layer))
            }
        };
        role.insert(n, r);
    }
    let stage_of = |role: &HashMap<NodeId, Role>, n: NodeId| match role.get(&n) {
        Some(Role::Placed(_, s)) => Some(*s),
        _ => None,
    };
    // Forward floating nodes: the earliest stage among their users, latest first.
    for &(n, phase) in floating.iter().rev() {
        if !matches!(phase, Phase::Forward(_)) {
            continue;
        }
        let users = g.node(n).outputs.iter().flat_map(|&v| g.users(v));
        let s = users
            .filter_map(|(u, _)| match role.get(&u) {
                Some(Role::Placed(Phase::Optimizer, _)) => None,
                _ => stage_of(&role, u),
            })
            .min()
            .unwrap_or(0);
        role.insert(n, Role::Placed(phase, s));
    }
    // Backward and optimizer floating nodes, in order: beside their earliest operand, so
    // that the update of a weight outside every layer (the embeddings) runs on the stage that
    // owns it, with the gradient norm it needs brought there, rather than the weight's
    // gradient sent to the last stage and the new weight sent back.
    for &(n, phase) in &floating {
        if matches!(phase, Phase::Forward(_)) {
            continue;
        }
        let s = g
            .node(n)
            .inputs
            .iter()
            .filter_map(|&v| stage_of(&role, g.value(v).producer))
            .min()
            .unwrap_or(last);
        role.insert(n, Role::Placed(phase, s));
    }

    check_flows(g, &role)?;
    let group_of = |n: NodeId| match role.get(&n) {
        Some(Role::Placed(p, s)) => Some((*p, *s)),
        _ => None,
    };

    // Forward and backward sub-programs.
    let m = step.micro_batches;
    let mut members: HashMap<(Phase, usize), Vec<NodeId>> = HashMap::new();
    let mut optimizer_nodes: Vec<NodeId> = Vec::new();
    for &n in &order {
        match group_of(n) {
            Some((Phase::Optimizer, _)) => optimizer_nodes.push(n),
            Some(key) => members.entry(key).or_default().push(n),
            None => {}
        }
    }
    // Is `v` (produced in group `key`) read outside it?
    let exported = |v: ValueId, key: Option<(Phase, usize)>| {
        graph_outputs.contains(&v) || g.users(v).iter().any(|&(u, _)| group_of(u) != key)
    };
    let mut forward = vec![Vec::with_capacity(m); n_vs];
    let mut backward = vec![Vec::with_capacity(m); n_vs];
    for vs in 0..n_vs {
        for mb in 0..m {
            for (phase, out) in [
                (Phase::Forward(mb), &mut forward[vs]),
                (Phase::Backward(mb), &mut backward[vs]),
            ] {
                let nodes = members.remove(&(phase, vs)).unwrap_or_default();
                let name = format!("{}.vs{vs}.mb{mb}", phase_name(phase));
                out.push(extract(g, &name, &nodes, &derived, |v| {
                    exported(v, Some((phase, vs)))
                })?);
            }
        }
    }

    // Messages between neighbouring virtual stages.
    let mut activations = vec![vec![Vec::<Carried>::new(); m]; n_vs];
    let mut gradients = vec![vec![Vec::<Carried>::new(); m]; n_vs];
    for &n in &order {
        let Some((phase, at)) = group_of(n) else {
            continue;
        };
        for &v in &g.node(n).outputs {
            let readers = g
                .users(v)
                .into_iter()
                .filter_map(|(u, _)| group_of(u))
                .filter(|(p, _)| *p != Phase::Optimizer);
            let carried = || Carried {
                value: v,
                ty: g.ty(v).clone(),
            };
            match phase {
                Phase::Forward(mb) => {
                    let furthest = readers.map(|(_, s)| s).max().unwrap_or(at);
                    for msgs in &mut activations[at..furthest] {
                        msgs[mb].push(carried());
                    }
                }
                Phase::Backward(mb) => {
                    let earliest = readers
                        .filter(|(p, _)| *p == Phase::Backward(mb))
                        .map(|(_, s)| s)
                        .min()
                        .unwrap_or(at);
                    for msgs in &mut gradients[earliest + 1..=at] {
                        msgs[mb].push(carried());
                    }
                }
                Phase::Optimizer => {}
            }
        }
    }

    // Sources per rank: whatever a rank's sub-programs read from the store.
    let pp = options.pp;
    let rank_of = |vs: usize| vs % pp;
    let mut sources: Vec<BTreeMap<ValueId, SourceValue>> = vec![BTreeMap::new(); pp];
    let source_of = |v: ValueId| -> Option<SourceValue> {
        match &g.node(g.value(v).producer).op {
            Op::Parameter { name, ty, .. } => Some(SourceValue {
                name: name.clone(),
                value: v,
                ty: ty.clone(),
                is_state: true,
            }),
            Op::Input { name, ty, .. } => Some(SourceValue {
                name: name.clone(),
                value: v,
                ty: ty.clone(),
                is_state: false,
            }),
            _ => None,
        }
    };
    for vs in 0..n_vs {
        for p in forward[vs].iter().chain(&backward[vs]) {
            for &v in &p.inputs {
                if let Some(s) = source_of(v) {
                    sources[rank_of(vs)].insert(v, s);
                }
            }
        }
    }

    // The optimizer phase: segments of consecutive nodes on one rank.
    let mut segments: Vec<(usize, Vec<NodeId>)> = Vec::new();
    for &n in &optimizer_nodes {
        let rank = group_of(n).map_or(0, |(_, s)| rank_of(s));
        match segments.last_mut() {
            Some((r, nodes)) if *r == rank => nodes.push(n),
            _ => segments.push((rank, vec![n])),
        }
    }
    let segment_of: HashMap<NodeId, usize> = segments
        .iter()
        .enumerate()
        .flat_map(|(i, (_, nodes))| nodes.iter().map(move |&n| (n, i)))
        .collect();
    // Which rank holds `v` once the forwards and backwards are done (or after its segment).
    let holder = |v: ValueId| -> Option<(usize, Option<usize>)> {
        let p = g.value(v).producer;
        match (group_of(p), segment_of.get(&p)) {
            (Some(_), Some(&seg)) => Some((segments[seg].0, Some(seg))),
            (Some((_, s)), None) => Some((rank_of(s), None)),
            _ => None,
        }
    };
    let state_names: HashSet<&str> = step
        .weights
        .iter()
        .chain(&step.optimizer_state)
        .map(String::as_str)
        .collect();
    // Sends: (producing segment or the rank's pre-optimizer store) -> (rank, values).
    let mut seg_sends: Vec<BTreeMap<usize, BTreeSet<ValueId>>> =
        vec![BTreeMap::new(); segments.len()];
    let mut flush_sends: Vec<BTreeMap<usize, BTreeSet<ValueId>>> = vec![BTreeMap::new(); pp];
    let mut need = |v: ValueId, rank: usize, sources: &mut Vec<BTreeMap<ValueId, SourceValue>>| {
        if let Some(s) = source_of(v) {
            sources[rank].insert(v, s);
            return;
        }
        if let Some((r, seg)) = holder(v)
            && r != rank
        {
            let sends = match seg {
                Some(seg) => &mut seg_sends[seg],
                None => &mut flush_sends[r],
            };
            sends.entry(rank).or_default().insert(v);
        }
    };
    let mut seg_programs = Vec::with_capacity(segments.len());
    for (i, (rank, nodes)) in segments.iter().enumerate() {
        let p = extract(g, &format!("optimizer.{i}"), nodes, &derived, |v| {
            graph_outputs.contains(&v)
                || g.users(v)
                    .iter()
                    .any(|(u, _)| segment_of.get(u) != Some(&i))
        })?;
        for &v in &p.inputs {
            need(v, *rank, &mut sources);
        }
        seg_programs.push(p);
    }
    // Per rank, the next-state values it must end the step with: for every state it reads,
    // in forwards, backwards or optimizer segments (so only after the segments' sources).
    let mut state_outputs: Vec<Vec<(String, ValueId)>> = vec![Vec::new(); pp];
    for (rank, srcs) in sources.iter().enumerate() {
        for s in srcs.values().filter(|s| s.is_state) {
            if let Some(next) = g.output(&s.name) {
                state_outputs[rank].push((s.name.clone(), next));
            }
        }
    }
    for (rank, outs) in state_outputs.iter().enumerate() {
        for &(_, v) in outs {
            need(v, rank, &mut sources);
        }
    }
    // Graph outputs produced in forwards or backwards (none today) stay on their rank.
    let carried = |set: &BTreeSet<ValueId>| -> Vec<Carried> {
        set.iter()
            .map(|&v| Carried {
                value: v,
                ty: g.ty(v).clone(),
            })
            .collect()
    };
    let mut optimizer = Vec::with_capacity(pp + segments.len());
    for (rank, sends) in flush_sends.iter().enumerate() {
        if sends.is_empty() {
            continue;
        }
        optimizer.push(OptimizerSegment {
            rank,
            program: extract(g, &format!("optimizer.gather{rank}"), &[], &derived, |_| {
                false
            })?,
            sends: sends.iter().map(|(&to, vs)| (to, carried(vs))).collect(),
        });
    }
    for ((rank, _), (program, sends)) in
        segments.iter().zip(seg_programs.into_iter().zip(seg_sends))
    {
        optimizer.push(OptimizerSegment {
            rank: *rank,
            program,
            sends: sends
                .iter()
                .map(|(&to, vs)| (to, carried(&vs.clone())))
                .collect(),
        });
    }

    let outputs = g
        .outputs()
        .iter()
        .map(|(name, v)| {
            let rank = holder(*v).map_or(pp - 1, |(r, _)| r);
            (name.clone(), *v, rank)
        })
        .collect();
    // Every state the step reads must be held somewhere.
    debug_assert!(
        sources
            .iter()
            .flat_map(|s| s.values())
            .filter(|s| s.is_state)
            .all(|s| state_names.contains(s.name.as_str()))
    );
    let program = PipelineProgram {
        schedule,
        forward,
        backward,
        activations,
        gradients,
        optimizer,
        sources: sources
            .into_iter()
            .map(|s| s.into_values().collect())
            .collect(),
        state_outputs,
        outputs,
    };
    Ok(PipelineSplit { split, program })
}

/// When node `n` runs and its layer, from its metadata: a node of a micro-batch runs in that
/// micro-batch's forward or backward (gradients, their accumulation and recomputed copies);
/// everything else in the optimizer phase.
fn classify(g: &Graph, n: NodeId) -> (Phase, Option<LayerId>) {
    let meta = g.meta(n);
    let phase = match (meta.micro_batch, meta.phase) {
        (None, _) => Phase::Optimizer,
        (Some(k), None | Some(MetaPhase::Forward | MetaPhase::Saved)) => Phase::Forward(k as usize),
        (
            Some(k),
            Some(
                MetaPhase::Backward
                | MetaPhase::Recompute
                | MetaPhase::Accumulate
                | MetaPhase::Optimizer,
            ),
        ) => Phase::Backward(k as usize),
    };
    (phase, meta.layer)
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward(_) => "forward",
        Phase::Backward(_) => "backward",
        Phase::Optimizer => "optimizer",
    }
}

/// Checks that every value flows the way the pipeline carries it.
fn check_flows(g: &Graph, role: &HashMap<NodeId, Role>) -> Result<(), PassError> {
    for (&n, r) in role {
        let Role::Placed(to_phase, to) = *r else {
            continue;
        };
        for &v in &g.node(n).inputs {
            let p = g.value(v).producer;
            let Some(&Role::Placed(from_phase, from)) = role.get(&p) else {
                continue;
            };
            let ok = match (from_phase, to_phase) {
                (_, Phase::Optimizer) => true,
                // A value of an earlier micro-batch's forward (a batch input resharded
                // once by the partitioner, then sliced per micro-batch) stays in the store
                // of its rank: every schedule runs forward `a` of a stage before forward
                // or backward `b > a` of that stage.
                (Phase::Forward(a), Phase::Forward(b))
                | (Phase::Forward(a), Phase::Backward(b)) => {
                    (a == b && from <= to) || (a < b && from == to)
                }
                (Phase::Backward(a), Phase::Backward(b)) => {
                    (a == b && from >= to) || (a < b && from == to)
                }
                (Phase::Backward(_), Phase::Forward(_)) | (Phase::Optimizer, _) => false,
            };
            if !ok {
                let at = |ph: Phase, s: usize| format!("{} of virtual stage {s}", describe(ph));
                return Err(PassError::PipelineCut {
                    value: v.to_string(),
                    from: at(from_phase, from),
                    to: at(to_phase, to),
                });
            }
        }
    }
    Ok(())
}

fn describe(p: Phase) -> String {
    match p {
        Phase::Forward(k) => format!("forward of micro-batch {k}"),
        Phase::Backward(k) => format!("backward of micro-batch {k}"),
        Phase::Optimizer => "optimizer".into(),
    }
}

/// The [`Role::Derived`] nodes of `g` (`order` is its topological order): forward and
/// backward nodes computed from parameters and constants alone, none of whose results is a
/// graph output, that are a collective or lie on a chain of such nodes through one (a
/// ZeRO-3 weight's all-gather, the cast of the gathered weight), and those computed from
/// constants alone (the global positions of context parallelism, read by every stage). A
/// node outside every micro-batch computed from parameters and constants and read by a
/// forward or backward (with loss scaling, the scale each micro-batch's backward seed is
/// multiplied by) is derived too: the optimizer phase runs after every forward and backward,
/// and the parameters do not change before it. Local values of parameters
/// alone (a cast of a replicated weight) are not recomputed: they stay where the step
/// computes them, so a pipeline without such collectives is cut as if this rule did not
/// exist.
fn derived_nodes(g: &Graph, order: &[NodeId], graph_outputs: &HashSet<ValueId>) -> HashSet<NodeId> {
    // Optimizer-phase nodes whose results a forward or backward reads, directly or through
    // other such nodes (the loss scale the backward seed is multiplied by): they cannot run
    // in the optimizer phase, which comes after every forward and backward.
    let mut read_early: HashSet<NodeId> = HashSet::new();
    for &n in order.iter().rev() {
        if !matches!(classify(g, n).0, Phase::Optimizer) {
            continue;
        }
        let early = g.node(n).outputs.iter().any(|&v| {
            g.users(v).iter().any(|&(u, _)| {
                read_early.contains(&u) || !matches!(classify(g, u).0, Phase::Optimizer)
            })
        });
        if early {
            read_early.insert(n);
        }
    }
    // Computed from parameters and constants alone, and whether a collective is among the
    // node and its ancestors.
    let mut from_parameters: HashMap<NodeId, bool> = HashMap::new();
    // Computed from constants alone (context parallelism's positions): always recomputed.
    let mut from_constants: HashSet<NodeId> = HashSet::new();
    for &n in order {
        let node = g.node(n);
        // Point-to-point messages (a ring's sends and receives) run once, in order with
        // their partner's: never recomputed.
        if node.inputs.is_empty()
            || matches!(node.op, Op::Send { .. } | Op::Recv { .. })
            || (matches!(classify(g, n).0, Phase::Optimizer) && !read_early.contains(&n))
            || node.outputs.iter().any(|v| graph_outputs.contains(v))
        {
            continue;
        }
        let mut collective = node.op.is_communication();
        let constant = |p: NodeId| {
            let producer = g.node(p);
            from_constants.contains(&p)
                || (producer.inputs.is_empty()
                    && !matches!(
                        producer.op,
                        Op::Input { .. } | Op::Recv { .. } | Op::Parameter { .. }
                    ))
        };
        if node.inputs.iter().all(|&v| constant(g.value(v).producer)) {
            from_constants.insert(n);
        }
        let all = node.inputs.iter().all(|&v| {
            let p = g.value(v).producer;
            let producer = g.node(p);
            if let Some(&c) = from_parameters.get(&p) {
                collective |= c;
                return true;
            }
            matches!(producer.op, Op::Parameter { .. })
                || (producer.inputs.is_empty()
                    && !matches!(producer.op, Op::Input { .. } | Op::Recv { .. }))
        });
        if all {
            from_parameters.insert(n, collective);
        }
    }
    // Add the ancestors (within those nodes) of every one reached by a collective.
    let mut derived: HashSet<NodeId> = HashSet::new();
    for &n in order.iter().rev() {
        let Some(&collective) = from_parameters.get(&n) else {
            continue;
        };
        let feeds = g
            .node(n)
            .outputs
            .iter()
            .any(|&v| g.users(v).iter().any(|(u, _)| derived.contains(u)));
        if collective || feeds || from_constants.contains(&n) || read_early.contains(&n) {
            derived.insert(n);
        }
    }
    derived
}

/// A sub-program of `nodes` (in execution order): operands from outside become `input`
/// nodes named after their values, operand-free nodes and the `derived` nodes (computed from
/// parameters and constants) are copied in, and the values `exported` says are read elsewhere
/// become outputs.
fn extract(
    g: &Graph,
    name: &str,
    nodes: &[NodeId],
    derived: &HashSet<NodeId>,
    exported: impl Fn(ValueId) -> bool,
) -> Result<StageProgram, PassError> {
    let mut sub = Graph::new(name);
    // Collectives of a partitioned step size their groups from the mesh.
    sub.set_mesh(g.mesh().cloned());
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    let mut defined: HashSet<ValueId> = HashSet::new();
    let mut inputs = Vec::new();
    let mut outputs = Vec::new();
    for &n in nodes {
        let node = g.node(n);
        for &v in &node.inputs {
            define_operand(g, &mut sub, v, &inside, derived, &mut defined, &mut inputs)?;
        }
        sub.copy_node(g, n, &node.inputs, &node.outputs)?;
        for &v in &node.outputs {
            defined.insert(v);
            if exported(v) {
                sub.add_output(value_name(v), v)?;
                outputs.push(v);
            }
        }
    }
    inputs.sort_unstable();
    outputs.sort_unstable();
    Ok(StageProgram {
        graph: sub,
        inputs,
        outputs,
    })
}

/// Makes operand `v` available in `sub`: a copy of its operand-free or derived producer (with
/// the derived producer's own operands first), or an `input` node read from outside.
fn define_operand(
    g: &Graph,
    sub: &mut Graph,
    v: ValueId,
    inside: &HashSet<NodeId>,
    derived: &HashSet<NodeId>,
    defined: &mut HashSet<ValueId>,
    inputs: &mut Vec<ValueId>,
) -> Result<(), PassError> {
    if defined.contains(&v) {
        return Ok(());
    }
    let p = g.value(v).producer;
    let producer = g.node(p);
    if derived.contains(&p) {
        for &u in &producer.inputs {
            define_operand(g, sub, u, inside, derived, defined, inputs)?;
        }
        sub.copy_node(g, p, &producer.inputs, &producer.outputs)?;
        defined.extend(producer.outputs.iter().copied());
        return Ok(());
    }
    if producer.inputs.is_empty() && !matches!(producer.op, Op::Parameter { .. } | Op::Input { .. })
    {
        sub.copy_node(g, p, &[], &[v])?;
    } else {
        debug_assert!(!inside.contains(&p));
        let op = Op::Input {
            name: value_name(v),
            ty: g.ty(v).clone(),
            role: InputRole::Features,
        };
        sub.add_node_with_ids(op, &[], &[v], None)?;
        inputs.push(v);
    }
    defined.insert(v);
    Ok(())
}
