//! Parallelisations as placements: data parallelism, ZeRO-1/2/3 and annotation files become
//! constraints for [`crate::propagate`], and [`parallelize`] is the driver that attaches a
//! mesh, applies them, propagates and verifies.
//!
//! - **Data parallelism**: data inputs are split on their batch dim (dim 0) over the data axis
//!   (`dp`). Weight gradients then come out partial on `dp` and are reduced as the placement
//!   of the gradient asks.
//! - **Tensor and vocabulary parallelism** come from the weights' annotations in model code
//!   (or an annotation file); propagation does the rest.
//! - **Layer placements** ([`ParallelOptions::layer`]): the ops of a layer placed on the
//!   sequence shards keep their weights whole on every tensor-parallel rank
//!   ([`place_layers`]), and the activations each op reads and writes are fixed so that
//!   propagation converts between the ops' layouts with the collectives the cost model prices
//!   (an all-to-all between sequence shards and heads, a gather back into a replicated
//!   residual stream without sequence parallelism). The attention core on the sequence shards
//!   runs on a graph laid out by [`crate::context_parallel::load_balance`] over the tensor
//!   axis: each rank attends its queries to the gathered keys and values.
//! - **Expert parallelism** (a mesh axis `ep` above 1): the experts' weights are annotated
//!   in model code, and [`crate::expert_parallel`] splits the batch over `ep` too.
//! - **Context parallelism** on `cp`: a graph laid out by
//!   [`crate::context_parallel::load_balance`] has its data inputs split on the sequence
//!   ([`crate::context_parallel::context_parallel_constraints`]); attention becomes ring
//!   attention.
//! - **ZeRO on the data axes**, for a training-step graph (one with optimizer updates). A
//!   weight's state is sharded over the ranks that replicate it: `dp` and, with expert
//!   parallelism, `ep` too (both on one dim, in mesh order), except for the experts' weights,
//!   which `ep` splits already and which are sharded over `dp` alone. Below, "on `dp`" means
//!   on those axes, and `z` is the first dim of a weight that splits evenly over them
//!   (preferring dims no other axis shards):
//!   - stage 0: gradients and optimizer state replicated on `dp` (gradients all-reduced);
//!   - stage 1: optimizer state `S(z)` on `dp`, and the gradient `S(z)` where the optimizer
//!     reads it: gradients are reduce-scattered, each rank updates its shard, and the updated
//!     weight (replicated, like the weight it replaces) is all-gathered;
//!   - stage 2: also the accumulated gradient `S(z)` on `dp` across micro-batches: every
//!     micro-batch's gradient is reduce-scattered as it is added, so no rank ever holds a
//!     full gradient accumulator (stage 1 sums the full partial gradients of all
//!     micro-batches and reduce-scatters once, sending less but holding more; with one
//!     micro-batch the two coincide);
//!   - stage 3 (FSDP): also the weights `S(z)` on `dp`, gathered before each use
//!     ([`Constraints::gather_on_use`]), updated in place as shards.
//!
//!   A weight with no dim that splits evenly stays replicated. In a graph without optimizer
//!   updates (a forward pass), stage 3 shards every parameter and the others change nothing.
//!
//! # Annotation files
//!
//! `--annotate FILE` gives shardings by tensor name, one per line, overriding model code:
//!
//! ```text
//! # comments and blank lines are ignored
//! h.0.mlp.w1: tp=S(1)
//! h.0.mlp.w2: tp=S(0), dp=R
//! wpe:                      # replicated on every axis
//! ```
//!
//! A name is everything before the line's last `:` (names may contain `:`); placements are
//! `R`, `S(dim)` or `P(sum|max|min)` per mesh axis. Names must be parameters or inputs; in a
//! training step, a weight's annotation also applies to its next value (the output of the same
//! name), and its optimizer state can be annotated by its own names (`w:adam_m`, ...).

use std::collections::BTreeMap;

use autopar_ir::sharding_algebra::axis_size_or_one;
use autopar_ir::{
    BinaryOp, DeviceMesh, Graph, Op, Part, Phase, Placement, ReduceKind, Sharding, ValueId,
    WeightRole, mesh::is_identifier,
};

use autopar_cost_model::{LayerOp, LayerPlacement, OpPlacement};

use crate::error::PassError;
use crate::expert_parallel::{EXPERT_AXIS, expert_parallel_constraints};
use crate::propagate::{Constraints, ShardingPlan, propagate_sharding};

/// The data-parallel mesh axis.
pub const DATA_AXIS: &str = autopar_ir::axis::DP;

/// The tensor-parallel mesh axis (sequence parallelism shards over it too).
pub const TENSOR_AXIS: &str = autopar_ir::axis::TP;

/// How to parallelise a graph on a mesh.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParallelOptions {
    /// ZeRO stage on the data axis: 0, 1, 2 or 3.
    pub zero: u8,
    /// Shardings by tensor name that replace the model's (see the module docs).
    pub annotations: Vec<Annotation>,
    /// Megatron sequence parallelism on the tensor axis (see the module docs).
    pub sequence_parallel: bool,
    /// Where each op of a transformer layer runs over the tensor axis: Megatron's split by
    /// default, or on the sequence shards with replicated weights ([`place_layers`]).
    pub layer: LayerPlacement,
}

/// One sharding given by tensor name.
#[derive(Clone, Debug, PartialEq)]
pub struct Annotation {
    /// A parameter or input name.
    pub tensor: String,
    /// Placement per mesh axis.
    pub axes: Vec<(String, Placement)>,
    /// Line of the annotation file (1-based), 0 when not from a file.
    pub line: usize,
}

/// A parallelised global graph: complete shardings on every value, and the strategies.
#[derive(Clone, Debug)]
pub struct Parallelized {
    /// The graph, with the mesh attached and every value sharded.
    pub graph: Graph,
    /// The chosen strategy of every node on every mesh axis (for the partitioner).
    pub plan: ShardingPlan,
}

/// Parses an annotation file (see the module docs); errors name the line.
pub fn parse_annotations(text: &str) -> Result<Vec<Annotation>, PassError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let bad = |detail: String| PassError::AnnotationSyntax { line, detail };
        let Some((name, rest)) = content.rsplit_once(':') else {
            return Err(bad(format!(
                "expected `name: axis=placement, ...`, found `{content}`"
            )));
        };
        let name = name.trim();
        if name.is_empty() {
            return Err(bad("the tensor name is empty".into()));
        }
        let mut axes: Vec<(String, Placement)> = Vec::new();
        for part in rest.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((axis, p)) = part.split_once('=') else {
                return Err(bad(format!("`{part}` is not of the form axis=placement")));
            };
            let axis = axis.trim();
            if !is_identifier(axis) {
                return Err(bad(format!("`{axis}` is not a mesh axis name")));
            }
            if axes.iter().any(|(a, _)| a == axis) {
                return Err(bad(format!("mesh axis `{axis}` is given twice")));
            }
            let p = parse_placement(p.trim()).ok_or_else(|| {
                bad(format!(
                    "`{}` is not a placement (R, S(dim) or P(sum|max|min))",
                    p.trim()
                ))
            })?;
            axes.push((axis.to_string(), p));
        }
        out.push(Annotation {
            tensor: name.to_string(),
            axes,
            line,
        });
    }
    Ok(out)
}

fn parse_placement(s: &str) -> Option<Placement> {
    if s == "R" {
        return Some(Placement::Replicate);
    }
    let inner = |prefix: &str| {
        s.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(')'))
            .map(str::trim)
    };
    if let Some(d) = inner("S(") {
        return d.parse().ok().map(Placement::Shard);
    }
    inner("P(")
        .and_then(ReduceKind::from_name)
        .map(Placement::Partial)
}

/// Attaches `mesh` to a copy of `g`, applies the annotations and the data-parallel and ZeRO
/// policies, and propagates shardings (see the module docs). The result passes the verifier.
pub fn parallelize(
    g: &Graph,
    mesh: &DeviceMesh,
    options: &ParallelOptions,
) -> Result<Parallelized, PassError> {
    if options.zero > 3 {
        return Err(PassError::BadOption {
            option: "--zero",
            detail: format!("stage {} does not exist (0, 1, 2 or 3)", options.zero),
        });
    }
    let mut graph = g.clone();
    graph.set_mesh(Some(mesh.clone()));
    if !options.layer.is_megatron() {
        if mesh.axis_size(TENSOR_AXIS).is_none_or(|n| n < 2) {
            return Err(PassError::BadOption {
                option: "--attn/--mlp",
                detail: format!(
                    "the layer placement `{}` places ops over `{TENSOR_AXIS}`, which the mesh \
                     {mesh} does not have (above 1)",
                    options.layer
                ),
            });
        }
        if options.layer.attention == OpPlacement::Sequence
            && let Some(cp) = mesh
                .axis_size(crate::context_parallel::CONTEXT_AXIS)
                .filter(|&n| n > 1)
        {
            return Err(PassError::BadOption {
                option: "--attn",
                detail: format!(
                    "the layer placement `{}` runs the attention core on the sequence shards \
                     of `{TENSOR_AXIS}`, which does not compose with context parallelism \
                     ({}={cp}); keep the core split by heads (e.g. attn=sts)",
                    options.layer,
                    crate::context_parallel::CONTEXT_AXIS
                ),
            });
        }
        place_layers(&mut graph, &options.layer)?;
        // An annotation that splits a weight over `tp` contradicts running its op on the
        // sequence shards with the weight replicated.
        for a in &options.annotations {
            let split = a
                .axes
                .iter()
                .any(|(axis, p)| axis == TENSOR_AXIS && matches!(p, Placement::Shard(_)));
            let annotated = graph
                .parameters()
                .into_iter()
                .find(|(_, name, _)| *name == a.tensor)
                .map(|(v, _, _)| v);
            if let Some(op) = annotated.and_then(|v| layer_op_of_parameter(&graph, v))
                && split
                && options.layer.get(op) == OpPlacement::Sequence
            {
                return Err(PassError::BadOption {
                    option: "--attn/--mlp",
                    detail: format!(
                        "line {}: `{}` is split over `{TENSOR_AXIS}` by the annotation, but the \
                         layer placement `{}` runs {} on the sequence shards with its weights \
                         replicated over `{TENSOR_AXIS}`",
                        a.line,
                        a.tensor,
                        options.layer,
                        op.name()
                    ),
                });
            }
        }
    }
    apply_annotations(&mut graph, &options.annotations)?;
    let mut constraints = zero_constraints(&graph, mesh, options.zero)?;
    if mesh.axis_size(EXPERT_AXIS).is_some_and(|n| n > 1) {
        expert_parallel_constraints(&graph, mesh, &mut constraints)?;
    }
    if options.sequence_parallel {
        sequence_parallel_constraints(&graph, mesh, &mut constraints)?;
    }
    if !options.layer.is_megatron() {
        layer_constraints(
            &graph,
            &options.layer,
            options.sequence_parallel,
            &mut constraints,
        );
    }
    crate::context_parallel::context_parallel_constraints(&graph, mesh, &mut constraints)?;
    let plan = propagate_sharding(&mut graph, &constraints)?;
    Ok(Parallelized { graph, plan })
}

/// The op of a transformer layer that reads a weight of role `role`: the Q/K/V projections
/// and their biases, the output projection and its bias, the MLP's input GEMMs (up and gate,
/// of a dense MLP or of the experts) and its output GEMM. Norms, embeddings, the head, a
/// router and the dense weights of a model that is no transformer read no placed op.
/// [`place_layers`] refuses to move the experts' weights (a model with a router).
pub fn layer_op_of_role(role: WeightRole) -> Option<LayerOp> {
    match role {
        WeightRole::Query | WeightRole::Key | WeightRole::Value => Some(LayerOp::Qkv),
        WeightRole::AttentionOut => Some(LayerOp::Proj),
        WeightRole::MlpIn | WeightRole::MlpGate | WeightRole::ExpertIn | WeightRole::ExpertGate => {
            Some(LayerOp::MlpIn)
        }
        WeightRole::MlpOut | WeightRole::ExpertOut => Some(LayerOp::MlpOut),
        WeightRole::TokenEmbedding
        | WeightRole::PositionEmbedding
        | WeightRole::Norm
        | WeightRole::Router
        | WeightRole::Head
        | WeightRole::Dense => None,
    }
}

/// The op of a transformer layer that reads parameter `v` of `g`, from its weight role
/// ([`layer_op_of_role`]); `None` for a value that is no parameter or has no role.
pub fn layer_op_of_parameter(g: &Graph, v: ValueId) -> Option<LayerOp> {
    let n = g.value(v).producer;
    match g.node(n).op {
        Op::Parameter { .. } => g.meta(n).role.and_then(layer_op_of_role),
        _ => None,
    }
}

/// The op of a transformer layer that reads the zoo weight at `path` (a parameter name such
/// as `h.3.attn.wq`), by the zoo's naming convention: the Q/K/V projections and their biases,
/// the output projection and its bias, the MLP's input GEMMs (`w1`, the gate `w3`, the bias
/// `b1`) and its output GEMM (`w2`, `b2`). For reading names that people write (plan
/// annotations without a graph); passes read the weight roles ([`layer_op_of_parameter`]).
pub fn layer_op_of_weight(path: &str) -> Option<LayerOp> {
    let parts: Vec<&str> = path.split('.').collect();
    let [layers, index, block, weight] = parts[..] else {
        return None;
    };
    if layers != "h" || index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match (block, weight) {
        ("attn", "wq" | "wk" | "wv" | "bq" | "bk" | "bv") => Some(LayerOp::Qkv),
        ("attn", "wo" | "bo") => Some(LayerOp::Proj),
        ("mlp", "w1" | "w3" | "b1") => Some(LayerOp::MlpIn),
        ("mlp", "w2" | "b2") => Some(LayerOp::MlpOut),
        _ => None,
    }
}

/// Applies the layer placement `layer` to `g` (see [`ParallelOptions::layer`]): every weight
/// of an op placed on [`OpPlacement::Sequence`] ([`layer_op_of_weight`]) loses its split over
/// the tensor axis, keeping its placements on the other axes, so that each rank runs the op
/// on its own rows of the sequence and the weight's gradient is summed over the tensor axis;
/// the weight's next value (the output of the same name) follows. Propagation then places the
/// activations around it.
///
/// The attention core on the sequence shards has no weights: it needs the global positions
/// of its queries for the causal mask, so every attention must have its positions operands,
/// as [`crate::context_parallel::load_balance`] gives them (the sequence then also sits in the
/// load-balanced order the cost model prices); [`parallelize`] pins it onto the query rows.
///
/// Only what the partitioned program then computes exactly as planned is accepted; the
/// errors name the op and the reason: the attention core on the sequence in a graph whose
/// attention has no positions (not laid out), the MLP of a mixture of experts keeps its
/// experts' split, and a model whose layers have none of the zoo's weights cannot be placed
/// at all.
pub fn place_layers(g: &mut Graph, layer: &LayerPlacement) -> Result<(), PassError> {
    let refuse = |op: LayerOp, why: &str| PassError::BadOption {
        option: if op.in_attention() { "--attn" } else { "--mlp" },
        detail: format!("{} on the sequence shards (`{layer}`) {why}", op.name()),
    };
    if layer.attention == OpPlacement::Sequence
        && let Some(n) = g.nodes_in_order().into_iter().find(|&n| {
            let node = g.node(n);
            matches!(node.op, Op::Attention { .. }) && node.inputs.len() != 5
        })
    {
        return Err(refuse(
            LayerOp::Attention,
            &format!(
                "needs the global positions of its queries for the causal mask, but {n} \
                 (scope `{}`) has none: the forward must be laid out by \
                 `context_parallel::load_balance` over `{TENSOR_AXIS}` before the training step \
                 is built",
                g.node(n).scope.as_deref().unwrap_or("")
            ),
        ));
    }
    let params: Vec<(ValueId, String)> = g
        .parameters()
        .into_iter()
        .map(|(v, name, _)| (v, name.to_string()))
        .collect();
    let moe = params
        .iter()
        .any(|&(v, _)| g.meta(g.value(v).producer).role == Some(WeightRole::Router));
    if moe && let Some(op) = layer.sequence_ops().find(|op| !op.in_attention()) {
        return Err(refuse(
            op,
            "cannot run in a mixture of experts, whose experts' weights stay split over `tp` \
             (mlp=tt)",
        ));
    }
    // The core has no weights to place.
    for op in layer.sequence_ops().filter(|&op| op != LayerOp::Attention) {
        let weights: Vec<(ValueId, String, Sharding)> = params
            .iter()
            .filter(|&&(v, _)| layer_op_of_parameter(g, v) == Some(op))
            .filter_map(|(v, name)| Some((*v, name.clone(), g.value(*v).sharding.clone()?)))
            .collect();
        if weights.is_empty() {
            return Err(refuse(
                op,
                &format!("finds none of its weights in `{}`", g.name()),
            ));
        }
        for (v, name, s) in weights {
            let axes = s
                .axes
                .iter()
                .map(|(a, p)| {
                    let p = if a == TENSOR_AXIS {
                        Placement::Replicate
                    } else {
                        *p
                    };
                    (a.clone(), p)
                })
                .collect::<Vec<_>>();
            let replicated = Sharding::user(axes);
            g.set_sharding(v, Some(replicated.clone()))?;
            if let Some(next) = g.output(&name).filter(|&o| o != v) {
                g.set_sharding(next, Some(replicated))?;
            }
        }
    }
    Ok(())
}

/// The activation placements over the tensor axis that make propagation run each op of a
/// layer where `layer` places it, for a graph whose weights [`place_layers`] has placed. An
/// op's placement alone leaves propagation free to run a sequence op as a row-parallel GEMM on
/// slices of its replicated weight, or to replicate it outright; fixing the layouts an op
/// reads and writes (the sequence dim, 1, for [`OpPlacement::Sequence`], the heads or the MLP's
/// width, dim 2, for [`OpPlacement::Tensor`]) leaves exactly the conversions of
/// [`autopar_cost_model::layer::tp_collectives`] between them:
///
/// - the Q/K/V and MLP-input GEMMs write their layout;
/// - the attention core by heads reads q, k and v by heads; on the sequence shards it reads
///   its queries' rows and every key and value (gathered over the tensor axis), with the
///   keys' positions whole and the queries' on the shards (one value serving as both stays
///   whole, each rank slicing its rows); either way it writes by heads for a
///   tensor-parallel output projection or on the sequence for one on the sequence shards (an
///   all-to-all after the core when the two differ);
/// - the output GEMMs (projection, MLP out) read their layout, and those on the sequence
///   shards write it too;
/// - the Q/K/V and MLP-input GEMMs on the sequence shards also read their rows of the norm's
///   result (else, with a replicated residual stream, propagation could just as cheaply run
///   them whole on every rank and slice their results);
/// - without sequence parallelism, the residual stream (every layer norm's input) stays
///   replicated, so a sequence op's output is gathered back into it.
///
/// In the backward, the attention core's backward reads and writes like its forward: by
/// heads, or on the query rows with every key and value whole (the key and value gradients
/// then come out as partial sums over the local queries, reduce-scattered where they are
/// read); a GEMM reading the weight of an op on the sequence shards (its input gradient) reads
/// and writes the sequence shards, so that the gradients move by the conjugates the cost
/// model prices (all-to-alls back to the sequence shards, not gathers onto every rank). Values
/// already fixed (the residual stream of sequence parallelism) keep their placement.
fn layer_constraints(
    g: &Graph,
    layer: &LayerPlacement,
    sequence_parallel: bool,
    c: &mut Constraints,
) {
    // Everything but the backward and its recomputed copies (sources have no phase).
    let forward = |n: autopar_ir::NodeId| {
        !matches!(g.meta(n).phase, Some(Phase::Backward | Phase::Recompute))
    };
    let mut pin = |v: ValueId, p: Placement| {
        let fixed = c.fixed.entry(v).or_default();
        if !fixed.iter().any(|(a, _)| a == TENSOR_AXIS) {
            fixed.push((TENSOR_AXIS.to_string(), p));
        }
    };
    // The positions of attention's queries and keys (`[q_pos, k_pos]`, absent without the
    // load-balanced layout): the keys' whole, the queries' on the shards. When one value
    // serves as both (the layout hands attention the same positions twice), it stays whole
    // and each rank slices its queries' rows locally, with no collective.
    let pin_positions = |pin: &mut dyn FnMut(ValueId, Placement), positions: &[ValueId]| {
        if let [q_pos, k_pos] = *positions {
            pin(k_pos, Placement::Replicate);
            pin(q_pos, Placement::Shard(0));
        }
    };
    let layout = |p: OpPlacement| match p {
        OpPlacement::Sequence => Placement::Shard(1),
        OpPlacement::Tensor => Placement::Shard(2),
    };
    // The weight a GEMM reads, through the casts of mixed precision.
    let weight_op = |mut v: ValueId| loop {
        let node = g.node(g.value(v).producer);
        match &node.op {
            Op::Cast { .. } => v = node.inputs[0],
            Op::Parameter { .. } => return layer_op_of_parameter(g, v),
            _ => return None,
        }
    };
    // The attention cores on the query rows and the operand placements of that strategy:
    // never ring attention or a split by heads over `tp`.
    let mut query_rows = Vec::new();
    for n in g.nodes_in_order() {
        let node = g.node(n);
        if !forward(n) {
            match &node.op {
                Op::AttentionBackward { .. } => match layer.attention {
                    OpPlacement::Tensor => {
                        for &v in node.inputs.iter().take(5).chain(&node.outputs) {
                            pin(v, layout(OpPlacement::Tensor));
                        }
                    }
                    // The local queries, their output and its gradient on the shards, every
                    // key and value whole; dk and dv come out as partial sums over the local
                    // queries, reduce-scattered at once into the layout of the QKV GEMMs.
                    OpPlacement::Sequence => {
                        let rows = layout(OpPlacement::Sequence);
                        let i = &node.inputs;
                        let at = [rows, Placement::Replicate, Placement::Replicate, rows, rows];
                        for (&v, p) in i.iter().zip(at) {
                            pin(v, p);
                        }
                        pin_positions(&mut pin, &i[5..]);
                        pin(node.outputs[0], rows);
                        for &v in &node.outputs[1..] {
                            pin(v, layout(layer.qkv));
                        }
                        if i.len() == 7 {
                            let mut want = at.to_vec();
                            want.extend([Placement::Shard(0), Placement::Replicate]);
                            query_rows.push((n, want));
                        }
                    }
                },
                Op::Einsum { .. } if node.inputs.len() == 2 => {
                    let reads = |i: usize| weight_op(node.inputs[i]);
                    let (grad, op) = match (reads(0), reads(1)) {
                        (Some(op), None) => (node.inputs[1], op),
                        (None, Some(op)) => (node.inputs[0], op),
                        _ => continue,
                    };
                    if layer.get(op) == OpPlacement::Sequence {
                        pin(grad, layout(OpPlacement::Sequence));
                        pin(node.outputs[0], layout(OpPlacement::Sequence));
                    }
                }
                _ => {}
            }
            continue;
        }
        match &node.op {
            Op::LayerNorm { .. } | Op::RmsNorm { .. } if !sequence_parallel => {
                pin(node.inputs[0], Placement::Replicate);
            }
            Op::Attention { .. } => {
                match layer.attention {
                    OpPlacement::Tensor => {
                        for &v in &node.inputs[..3] {
                            pin(v, layout(OpPlacement::Tensor));
                        }
                    }
                    // Query rows: the local queries attend to every key and value, which are
                    // gathered over the tensor axis.
                    OpPlacement::Sequence => {
                        pin(node.inputs[0], layout(OpPlacement::Sequence));
                        pin(node.inputs[1], Placement::Replicate);
                        pin(node.inputs[2], Placement::Replicate);
                        pin_positions(&mut pin, &node.inputs[3..]);
                        if node.inputs.len() == 5 {
                            let r = Placement::Replicate;
                            let want = vec![Placement::Shard(1), r, r, Placement::Shard(0), r];
                            query_rows.push((n, want));
                        }
                    }
                }
                // The core's output in the layout the projection reads; on the query rows it
                // stays there, as its backward reads it, and the projection converts its own
                // input (a copy the projection's weight gradient reuses).
                let out = match layer.attention {
                    OpPlacement::Tensor => layout(layer.proj),
                    OpPlacement::Sequence => layout(OpPlacement::Sequence),
                };
                pin(node.outputs[0], out);
            }
            Op::Einsum { .. } if node.inputs.len() == 2 => {
                let Some(op) = weight_op(node.inputs[1]) else {
                    continue;
                };
                let p = layer.get(op);
                match op {
                    LayerOp::Qkv | LayerOp::MlpIn => {
                        // On the sequence shards it reads the rows of the (replicated or
                        // sequence-parallel) norm's result it computes on.
                        if p == OpPlacement::Sequence {
                            pin(node.inputs[0], layout(p));
                        }
                        pin(node.outputs[0], layout(p));
                    }
                    LayerOp::Proj | LayerOp::MlpOut => {
                        pin(node.inputs[0], layout(p));
                        if p == OpPlacement::Sequence {
                            pin(node.outputs[0], layout(p));
                        }
                    }
                    LayerOp::Attention => {}
                }
            }
            _ => {}
        }
    }
    for (n, want) in query_rows {
        c.operands.insert((n, TENSOR_AXIS.to_string()), want);
    }
}

/// Replaces the shardings of the named parameters and inputs.
fn apply_annotations(g: &mut Graph, annotations: &[Annotation]) -> Result<(), PassError> {
    let mut by_name: BTreeMap<String, ValueId> = BTreeMap::new();
    for (v, name, _) in g.parameters() {
        by_name.insert(name.to_string(), v);
    }
    for (v, name, _) in g.inputs() {
        by_name.insert(name.to_string(), v);
    }
    for a in annotations {
        let Some(&v) = by_name.get(&a.tensor) else {
            let at = if a.line > 0 {
                format!("line {}: ", a.line)
            } else {
                String::new()
            };
            return Err(PassError::Annotation {
                tensor: a.tensor.clone(),
                detail: format!("{at}the graph has no parameter or input of this name"),
            });
        };
        let s = Sharding::user(a.axes.iter().cloned());
        g.set_sharding(v, Some(s.clone()))?;
        // In a training step, a weight's next value is the output of the same name: it keeps
        // the weight's sharding so that the next step can take it back.
        let next: Vec<ValueId> = g
            .outputs()
            .iter()
            .filter(|(name, out)| *name == a.tensor && *out != v)
            .map(|&(_, out)| out)
            .collect();
        for out in next {
            g.set_sharding(out, Some(s.clone()))?;
        }
    }
    Ok(())
}

/// The data-parallel and ZeRO constraints of `g` on `mesh` (see the module docs).
pub fn zero_constraints(g: &Graph, mesh: &DeviceMesh, zero: u8) -> Result<Constraints, PassError> {
    let mut c = Constraints {
        data_axis: Some(DATA_AXIS.to_string()),
        ..Constraints::default()
    };
    let above_one = |axis: &str| mesh.axis_size(axis).is_some_and(|n| n > 1);
    if !above_one(DATA_AXIS) && (zero == 0 || !above_one(EXPERT_AXIS)) {
        if zero > 0 {
            return Err(PassError::BadOption {
                option: "--zero",
                detail: format!(
                    "ZeRO-{zero} shards over the data axes `{DATA_AXIS}` and `{EXPERT_AXIS}`, \
                     neither of which the mesh {mesh} has (above 1)"
                ),
            });
        }
        return Ok(c);
    }
    // The axes that shard a parameter's ZeRO state, in mesh order: every data-parallel rank
    // holds a replica of a dense weight (`dp` and `ep`), but an expert's weight only on the
    // ranks of `dp` (it is split over `ep` already).
    let zero_axes = |v: ValueId| -> Vec<String> {
        let expert = g
            .value(v)
            .sharding
            .as_ref()
            .is_some_and(|s| matches!(s.get(EXPERT_AXIS), Some(Placement::Shard(_))));
        let mut axes: Vec<&str> = [DATA_AXIS, EXPERT_AXIS]
            .into_iter()
            .filter(|&a| above_one(a) && !(expert && a == EXPERT_AXIS))
            .collect();
        axes.sort_by_key(|a| mesh.axis_index(a));
        axes.into_iter().map(str::to_string).collect()
    };
    let fix = |c: &mut Constraints, v: ValueId, axes: &[String], p: Placement| {
        let fixed = c.fixed.entry(v).or_default();
        for a in axes {
            fixed.push((a.clone(), p));
        }
    };
    let gather = |c: &mut Constraints, v: ValueId, axes: &[String]| {
        for a in axes {
            c.gather_on_use.insert((v, a.clone()));
        }
    };
    // Without ZeRO, gradients and optimizer state are replicated over `dp` (the expert
    // parallelism policy places them over `ep`).
    let data_only: Vec<String> = [DATA_AXIS]
        .into_iter()
        .filter(|&a| above_one(a))
        .map(str::to_string)
        .collect();
    let updates: Vec<&autopar_ir::Node> = g
        .nodes_in_order()
        .into_iter()
        .map(|n| g.node(n))
        .filter(|node| matches!(node.op, Op::SgdUpdate { .. } | Op::AdamWUpdate { .. }))
        .collect();
    if updates.is_empty() {
        if zero == 3 {
            for (v, _, _) in g.parameters() {
                let axes = zero_axes(v);
                if let Some(z) = zero_dim(g, v, mesh, &axes) {
                    fix(&mut c, v, &axes, Placement::Shard(z));
                    gather(&mut c, v, &axes);
                }
            }
        }
        return Ok(c);
    }
    for node in updates {
        let weight = node.inputs[0];
        let axes = zero_axes(weight);
        let z = zero_dim(g, weight, mesh, &axes);
        let grad = gradient_source(g, node.inputs[1]);
        // The buffers follow the weight and its gradient (SGD's momentum, AdamW's moments);
        // AdamW's step count and a learning-rate factor are scalars shared by every weight.
        let end = match node.op {
            Op::AdamWUpdate { .. } => 4,
            _ => 3,
        };
        let buffers: Vec<ValueId> = node.inputs[2..end].to_vec();
        match (zero, z) {
            (0, _) | (_, None) => {
                fix(&mut c, grad, &data_only, Placement::Replicate);
                for &b in &buffers {
                    fix(&mut c, b, &data_only, Placement::Replicate);
                }
            }
            (_, Some(z)) => {
                fix(&mut c, grad, &axes, Placement::Shard(z));
                for &b in &buffers {
                    fix(&mut c, b, &axes, Placement::Shard(z));
                }
                if zero >= 2 {
                    // ZeRO-2: the accumulated gradient is kept sharded across micro-batches,
                    // so each micro-batch's gradient is reduce-scattered as it is added
                    // (ZeRO-1 accumulates the full partial gradient and reduce-scatters once).
                    for v in accumulation_chain(g, grad) {
                        fix(&mut c, v, &axes, Placement::Shard(z));
                    }
                }
                if zero == 3 {
                    fix(&mut c, weight, &axes, Placement::Shard(z));
                    gather(&mut c, weight, &axes);
                }
            }
        }
    }
    Ok(c)
}

/// Megatron sequence parallelism: in the forward, the residual stream (the activation every
/// layer norm reads) and every layer norm's result are sharded on the sequence dim over
/// [`TENSOR_AXIS`]. Nothing else is fixed: propagation then turns the all-reduce that ends each
/// tensor-parallel block into a reduce-scatter onto the sequence shards, and gathers the
/// sequence before the next column-parallel matmul.
pub fn sequence_parallel_constraints(
    g: &Graph,
    mesh: &DeviceMesh,
    c: &mut Constraints,
) -> Result<(), PassError> {
    let Some(tp) = mesh.axis_size(TENSOR_AXIS).filter(|&n| n > 1) else {
        return Err(PassError::BadOption {
            option: "--sp",
            detail: format!(
                "sequence parallelism needs a `{TENSOR_AXIS}` axis above 1 in the mesh"
            ),
        });
    };
    let mut found = false;
    let forward = |n: autopar_ir::NodeId| g.meta(n).phase != Some(Phase::Backward);
    for n in g.nodes_in_order() {
        let node = g.node(n);
        if !matches!(node.op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) || !forward(n) {
            continue;
        }
        // The residual stream: the norm's input, its result, and, when the input is a
        // residual add, both addends (so the block output is reduce-scattered onto the
        // sequence shards before the bias and residual adds, as in Megatron).
        let x = node.inputs[0];
        let producer = g.node(g.value(x).producer);
        let mut stream = vec![x, node.outputs[0]];
        if matches!(
            producer.op,
            Op::Binary {
                func: BinaryOp::Add
            }
        ) && forward(g.value(x).producer)
        {
            stream.extend(producer.inputs.iter().copied());
        }
        for v in stream {
            let ty = g.ty(v);
            if ty.rank() != 3 {
                continue;
            }
            let seq = ty.dims()[1];
            if !seq.is_multiple_of(tp) {
                return Err(PassError::BadOption {
                    option: "--sp",
                    detail: format!(
                        "the sequence dim (dim 1, size {seq}) of {v} ({ty}) does not split over mesh axis `{TENSOR_AXIS}` ({tp} ways)"
                    ),
                });
            }
            let fixed = c.fixed.entry(v).or_default();
            if !fixed.iter().any(|(a, _)| a == TENSOR_AXIS) {
                fixed.push((TENSOR_AXIS.to_string(), Placement::Shard(1)));
            }
            found = true;
        }
    }
    // The backward of the norms runs on the sequence shards too: its rank-3 values are fixed
    // like the forward stream, so the column-parallel input gradient is reduce-scattered into
    // it rather than all-reduced. The norms' backward is what autodiff emits for the nodes of
    // the norm parts (metadata `part=norm`, `phase=backward`).
    for n in g.nodes_in_order() {
        let meta = g.meta(n);
        if meta.phase != Some(Phase::Backward) || meta.part != Some(Part::Norm) {
            continue;
        }
        for &v in &g.node(n).outputs {
            let ty = g.ty(v);
            if ty.rank() == 3 && ty.dtype.is_float() && ty.dims()[1].is_multiple_of(tp) {
                let fixed = c.fixed.entry(v).or_default();
                if !fixed.iter().any(|(a, _)| a == TENSOR_AXIS) {
                    fixed.push((TENSOR_AXIS.to_string(), Placement::Shard(1)));
                }
            }
        }
    }
    if found {
        Ok(())
    } else {
        Err(PassError::BadOption {
            option: "--sp",
            detail: format!(
                "`{}` has no `[batch, seq, hidden]` layer norm to shard on the sequence",
                g.name()
            ),
        })
    }
}

/// The dim ZeRO shards weight `v` on over the mesh axes `axes` (together): the first whose
/// size, divided by the other axes its own sharding already puts on it, splits evenly over
/// all of `axes`, preferring dims no axis shards; `None` when `axes` shard nothing (none
/// above 1) or no dim splits.
fn zero_dim(g: &Graph, v: ValueId, mesh: &DeviceMesh, axes: &[String]) -> Option<usize> {
    let ways: usize = axes.iter().map(|a| axis_size_or_one(mesh, a)).product();
    if ways <= 1 {
        return None;
    }
    let ty = g.ty(v);
    let s = g.value(v).sharding.clone().unwrap_or(Sharding::user([]));
    let local = |d: usize| {
        let other: usize = s
            .axes_sharding_dim(d)
            .filter(|a| !axes.iter().any(|z| z == a))
            .map(|a| axis_size_or_one(mesh, a))
            .product();
        ty.dims()[d] / other.max(1)
    };
    let fits = |d: usize| local(d).is_multiple_of(ways) && local(d) >= ways;
    let free = |d: usize| {
        s.axes_sharding_dim(d)
            .all(|a| axis_size_or_one(mesh, a) == 1)
    };
    (0..ty.rank())
        .find(|&d| free(d) && fits(d))
        .or_else(|| (0..ty.rank()).find(|&d| fits(d)))
}

/// The running sums of a gradient accumulation ending in `sum`, earliest last, down to the
/// first micro-batch's gradient: `sum = add(add(g0, g1), g2)` gives `[add(g0, g1), g0]`.
fn accumulation_chain(g: &Graph, mut sum: ValueId) -> Vec<ValueId> {
    let mut chain = Vec::new();
    loop {
        let node = g.node(g.value(sum).producer);
        let accumulates = g.meta(g.value(sum).producer).phase == Some(Phase::Accumulate);
        match (&node.op, &node.inputs[..]) {
            (
                Op::Binary {
                    func: BinaryOp::Add,
                },
                &[prev, _],
            ) if accumulates => {
                chain.push(prev);
                sum = prev;
            }
            _ => return chain,
        }
    }
}

/// The accumulated gradient behind an optimizer's gradient operand: back through the
/// optimizer's multiplications by a broadcast scalar (unscaling, clipping).
pub(crate) fn gradient_source(g: &Graph, mut v: ValueId) -> ValueId {
    loop {
        let node = g.node(g.value(v).producer);
        let in_optimizer = g.meta(g.value(v).producer).phase == Some(Phase::Optimizer);
        let is_mul = matches!(
            node.op,
            Op::Binary {
                func: BinaryOp::Mul
            }
        );
        if !(in_optimizer && is_mul) {
            return v;
        }
        let scalar_factor = |w: ValueId| {
            let p = g.node(g.value(w).producer);
            matches!(&p.op, Op::Broadcast { dims, .. } if dims.is_empty())
        };
        match node.inputs[..] {
            [a, b] if scalar_factor(b) => v = a,
            [a, b] if scalar_factor(a) => v = b,
            _ => return v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zoo_weights_map_to_their_layer_ops() {
        for (path, op) in [
            ("h.0.attn.wq", Some(LayerOp::Qkv)),
            ("h.12.attn.bv", Some(LayerOp::Qkv)),
            ("h.1.attn.wo", Some(LayerOp::Proj)),
            ("h.1.attn.bo", Some(LayerOp::Proj)),
            ("h.0.mlp.w1", Some(LayerOp::MlpIn)),
            ("h.0.mlp.w3", Some(LayerOp::MlpIn)),
            ("h.0.mlp.b1", Some(LayerOp::MlpIn)),
            ("h.3.mlp.w2", Some(LayerOp::MlpOut)),
            ("h.3.mlp.b2", Some(LayerOp::MlpOut)),
            ("h.0.mlp.router", None),
            ("h.0.ln1.g", None),
            ("h.x.attn.wq", None),
            ("h..attn.wq", None),
            ("g.0.attn.wq", None),
            ("h.0.attn.wq.t", None),
            ("wte", None),
        ] {
            assert_eq!(layer_op_of_weight(path), op, "{path}");
        }
    }

    fn placement(attn: &str, mlp: &str) -> LayerPlacement {
        let mut l = LayerPlacement::MEGATRON;
        l.set_attention(attn).unwrap();
        l.set_mlp(mlp).unwrap();
        l
    }

    fn tp_split(g: &Graph, name: &str) -> Option<Placement> {
        let (v, _, _) = g
            .parameters()
            .into_iter()
            .find(|(_, n, _)| *n == name)
            .unwrap();
        g.value(v).sharding.as_ref()?.get(TENSOR_AXIS)
    }

    #[test]
    fn sequence_ops_lose_the_tensor_split_of_their_weights_only() {
        let mut g = autopar_frontends::zoo::build("gpt-tiny", 4).unwrap();
        place_layers(&mut g, &placement("sts", "ts")).unwrap();
        for name in ["h.0.attn.wq", "h.1.attn.bk", "h.0.attn.wo", "h.0.mlp.w2"] {
            assert_eq!(tp_split(&g, name), Some(Placement::Replicate), "{name}");
        }
        assert_eq!(tp_split(&g, "h.0.mlp.w1"), Some(Placement::Shard(1)));
        assert_eq!(tp_split(&g, "wte"), Some(Placement::Shard(0)));

        // The core on the shards needs attention's positions, which the load-balanced
        // layout gives; it has no weights of its own to place.
        let err = place_layers(&mut g, &placement("sss", "tt")).unwrap_err();
        assert!(
            err.to_string().contains("attention core") && err.to_string().contains("positions"),
            "{err}"
        );
        let fresh = autopar_frontends::zoo::build("gpt-tiny", 4).unwrap();
        let mut laid_out = crate::context_parallel::load_balance(&fresh, TENSOR_AXIS, 2).unwrap();
        place_layers(&mut laid_out, &placement("tst", "tt")).unwrap();
        assert_eq!(
            tp_split(&laid_out, "h.0.attn.wq"),
            Some(Placement::Shard(1))
        );
        let mut moe = autopar_frontends::zoo::build("moe-tiny", 4).unwrap();
        let err = place_layers(&mut moe, &placement("ttt", "st")).unwrap_err();
        assert!(err.to_string().contains("mixture of experts"), "{err}");
        place_layers(&mut moe, &placement("sts", "tt")).unwrap();
    }

    /// The forward collectives of layer 0 of rank 0's llama-tiny forward program, and the
    /// local sequence length of each Q/K/V projection.
    fn layer0(attn: &str, mlp: &str, sp: bool) -> (Vec<(String, &'static str)>, Vec<usize>) {
        let g = autopar_frontends::zoo::build("llama-tiny", 4).unwrap();
        let mesh = DeviceMesh::parse("tp=2").unwrap();
        let options = ParallelOptions {
            sequence_parallel: sp,
            layer: placement(attn, mlp),
            ..ParallelOptions::default()
        };
        let p = parallelize(&g, &mesh, &options).unwrap();
        let local = crate::partition::partition(&p.graph, &p.plan, 0).unwrap();
        let mut colls = Vec::new();
        let mut qkv_rows = Vec::new();
        for n in local.nodes_in_order() {
            let node = local.node(n);
            let scope = node.scope.clone().unwrap_or_default();
            if !scope.starts_with("h.0") {
                continue;
            }
            let name = node.op.name();
            if ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"].contains(&name) {
                colls.push((scope.clone(), name));
            }
            if matches!(node.op, Op::Einsum { .. }) && scope == "h.0.attn" {
                let reads_wq =
                    local.node(local.value(node.inputs[1]).producer).op.name() == "parameter";
                if reads_wq && local.ty(node.outputs[0]).rank() == 4 {
                    qkv_rows.push(local.ty(node.outputs[0]).dims()[1]);
                }
            }
        }
        (colls, qkv_rows)
    }

    #[test]
    fn ulysses_moves_heads_by_all_to_all_and_computes_on_sequence_shards() {
        for sp in [true, false] {
            let (colls, qkv_rows) = layer0("ulysses", "ss", sp);
            let attn: Vec<&str> = colls
                .iter()
                .filter(|(s, _)| s == "h.0.attn")
                .map(|(_, c)| *c)
                .collect();
            // q, k and v to heads, the core's output back to the sequence.
            assert_eq!(attn, ["all_to_all"; 4], "sp={sp}: {colls:?}");
            assert!(
                !colls.iter().any(|(s, _)| s == "h.0.mlp"),
                "sp={sp}: {colls:?}"
            );
            // The projections run on half of the 32 positions each.
            assert_eq!(qkv_rows, [16; 3], "sp={sp}");
            // Without sp, the two blocks' outputs are gathered back into the replicated stream.
            let gathers = colls
                .iter()
                .filter(|(s, c)| s == "h.0" && *c == "all_gather")
                .count();
            assert_eq!(gathers, if sp { 0 } else { 2 }, "sp={sp}: {colls:?}");
        }
    }

    #[test]
    fn annotation_files_parse_and_errors_name_the_line() {
        let a = parse_annotations("# c\nh.0.mlp.w1: tp=S(1)\n\nw:adam_m: dp=S(0), tp=R\nwpe:\n")
            .unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0].tensor, "h.0.mlp.w1");
        assert_eq!(a[0].axes, vec![("tp".to_string(), Placement::Shard(1))]);
        assert_eq!(a[1].tensor, "w:adam_m");
        assert_eq!(a[1].line, 4);
        assert!(a[2].axes.is_empty());
        let err = parse_annotations("a: tp=S(1)\nb: tp=X\n").unwrap_err();
        assert!(err.to_string().starts_with("line 2: "), "{err}");
        assert!(parse_annotations("no colon").is_err());
        assert!(parse_annotations("a: tp=S(0), tp=R").is_err());
    }
}
