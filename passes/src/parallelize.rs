//! Parallelisations as placements: data parallelism, ZeRO-1/2/3 and annotation files become
//! constraints for [`crate::propagate`], and [`parallelize`] is the driver that attaches a
//! mesh, applies them, propagates and verifies.
//!
//! - **Data parallelism**: data inputs are split on their batch dim (dim 0) over the data axis
//!   (`dp`). Weight gradients then come out partial on `dp` and are reduced as the placement
//!   of the gradient asks.
//! - **Tensor and vocabulary parallelism** come from the weights' annotations in model code
//!   (or an annotation file); propagation does the rest.
//! - **Expert parallelism** (a mesh axis `ep` above 1): the experts' weights are annotated
//!   in model code, and [`crate::expert_parallel`] splits the batch over `ep` too.
//! - **Context parallelism** on `cp`: a graph laid out by
//!   [`crate::context_parallel::load_balance`] has its data inputs split on the sequence
//!   ([`crate::context_parallel::context_parallel_constraints`]); attention becomes ring
//!   attention.
//! - **ZeRO on the data axis**, for a training-step graph (one with optimizer updates). With
//!   `z` the first dim of a weight that splits evenly over `dp` (preferring dims no other axis
//!   shards):
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
    BinaryOp, DeviceMesh, Graph, Op, Placement, ReduceKind, Sharding, ValueId, mesh::is_identifier,
};

use crate::error::PassError;
use crate::expert_parallel::{EXPERT_AXIS, expert_parallel_constraints};
use crate::propagate::{Constraints, ShardingPlan, propagate_sharding};

/// The data-parallel mesh axis.
pub const DATA_AXIS: &str = "dp";

/// The tensor-parallel mesh axis (sequence parallelism shards over it too).
pub const TENSOR_AXIS: &str = "tp";

/// How to parallelise a graph on a mesh.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParallelOptions {
    /// ZeRO stage on the data axis: 0, 1, 2 or 3.
    pub zero: u8,
    /// Shardings by tensor name that replace the model's (see the module docs).
    pub annotations: Vec<Annotation>,
    /// Megatron sequence parallelism on the tensor axis (see the module docs).
    pub sequence_parallel: bool,
    /// With sequence parallelism: the MLPs run on the residual stream's sequence shards with
    /// their weights replicated over the tensor axis instead of Megatron's column/row split
    /// ([`mlp_on_sequence_shards`]).
    pub mlp_on_sequence: bool,
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
    if options.mlp_on_sequence {
        if !options.sequence_parallel {
            return Err(PassError::BadOption {
                option: "--mlp",
                detail: "the MLP runs on the sequence shards of sequence parallelism: it needs \
                         --sp"
                    .into(),
            });
        }
        mlp_on_sequence_shards(&mut graph)?;
    }
    apply_annotations(&mut graph, &options.annotations)?;
    let mut constraints = zero_constraints(&graph, mesh, options.zero)?;
    if mesh.axis_size(EXPERT_AXIS).is_some_and(|n| n > 1) {
        expert_parallel_constraints(&graph, mesh, &mut constraints)?;
    }
    if options.sequence_parallel {
        sequence_parallel_constraints(&graph, mesh, &mut constraints)?;
    }
    crate::context_parallel::context_parallel_constraints(&graph, mesh, &mut constraints)?;
    let plan = propagate_sharding(&mut graph, &constraints)?;
    Ok(Parallelized { graph, plan })
}

/// The MLP placement of [`ParallelOptions::mlp_on_sequence`]: every weight of an MLP block
/// (a parameter whose scope's last component is `mlp`) loses its split over the tensor axis,
/// so that, with the residual stream sharded on the sequence, each rank runs the whole MLP
/// on its sequence shard and the weight gradients are summed over the tensor axis. Other
/// axes keep their placements; the weight's next value (the output of the same name) follows.
pub fn mlp_on_sequence_shards(g: &mut Graph) -> Result<(), PassError> {
    let weights: Vec<(ValueId, String, Sharding)> = g
        .parameters()
        .into_iter()
        .filter(|&(v, _, _)| {
            let scope = g.node(g.value(v).producer).scope.as_deref().unwrap_or("");
            let path = crate::autodiff::split_scope(scope).1;
            path.rsplit('.').next() == Some("mlp")
        })
        .filter_map(|(v, name, _)| {
            let s = g.value(v).sharding.clone()?;
            s.get(TENSOR_AXIS)
                .is_some_and(|p| p != Placement::Replicate)
                .then(|| (v, name.to_string(), s))
        })
        .collect();
    if weights.is_empty() {
        return Err(PassError::BadOption {
            option: "--mlp",
            detail: format!("no MLP weight of the model is split over `{TENSOR_AXIS}`"),
        });
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
    Ok(())
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
    let Some(dp) = mesh.axis_size(DATA_AXIS).filter(|&n| n > 1) else {
        if zero > 0 {
            return Err(PassError::BadOption {
                option: "--zero",
                detail: format!(
                    "ZeRO-{zero} shards over the data axis `{DATA_AXIS}`, which the mesh {} \
                     does not have (above 1)",
                    mesh
                ),
            });
        }
        return Ok(c);
    };
    let fix = |c: &mut Constraints, v: ValueId, p: Placement| {
        c.fixed.insert(v, vec![(DATA_AXIS.to_string(), p)]);
    };
    let updates: Vec<&autopar_ir::Node> = g
        .nodes_in_order()
        .into_iter()
        .map(|n| g.node(n))
        .filter(|node| matches!(node.op, Op::SgdUpdate { .. } | Op::AdamWUpdate { .. }))
        .collect();
    if updates.is_empty() {
        if zero == 3 {
            for (v, _, _) in g.parameters() {
                if let Some(z) = zero_dim(g, v, mesh, dp) {
                    fix(&mut c, v, Placement::Shard(z));
                    c.gather_on_use.insert((v, DATA_AXIS.to_string()));
                }
            }
        }
        return Ok(c);
    }
    for node in updates {
        let weight = node.inputs[0];
        let z = zero_dim(g, weight, mesh, dp);
        let grad = gradient_source(g, node.inputs[1]);
        // AdamW's last operand is the step count, shared by every weight.
        let adamw = matches!(node.op, Op::AdamWUpdate { .. });
        let end = node.inputs.len() - usize::from(adamw);
        let buffers: Vec<ValueId> = node.inputs[2..end].to_vec();
        match (zero, z) {
            (0, _) | (_, None) => {
                fix(&mut c, grad, Placement::Replicate);
                for &b in &buffers {
                    fix(&mut c, b, Placement::Replicate);
                }
            }
            (_, Some(z)) => {
                fix(&mut c, grad, Placement::Shard(z));
                for &b in &buffers {
                    fix(&mut c, b, Placement::Shard(z));
                }
                if zero >= 2 {
                    // ZeRO-2: the accumulated gradient is kept sharded across micro-batches,
                    // so each micro-batch's gradient is reduce-scattered as it is added
                    // (ZeRO-1 accumulates the full partial gradient and reduce-scatters once).
                    for v in accumulation_chain(g, grad) {
                        fix(&mut c, v, Placement::Shard(z));
                    }
                }
                if zero == 3 {
                    fix(&mut c, weight, Placement::Shard(z));
                    c.gather_on_use.insert((weight, DATA_AXIS.to_string()));
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
    let forward = |n: autopar_ir::NodeId| {
        let tags = g
            .node(n)
            .scope
            .as_deref()
            .map_or("", |s| crate::autodiff::split_scope(s).0);
        !tags.contains(crate::autodiff::GRAD_TAG)
    };
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
    // it rather than all-reduced.
    let norm_paths: std::collections::BTreeSet<&str> = g
        .nodes_in_order()
        .into_iter()
        .filter(|&n| {
            matches!(g.node(n).op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) && forward(n)
        })
        .filter_map(|n| {
            g.node(n)
                .scope
                .as_deref()
                .map(|s| crate::autodiff::split_scope(s).1)
        })
        .collect();
    for n in g.nodes_in_order() {
        let node = g.node(n);
        let Some((_, path)) = node.scope.as_deref().map(crate::autodiff::split_scope) else {
            continue;
        };
        if forward(n) || !norm_paths.contains(path) {
            continue;
        }
        for &v in &node.outputs {
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

/// The dim ZeRO shards weight `v` on: the first whose size, divided by the axes its own
/// sharding already puts on it, splits evenly over the data axis, preferring dims no axis
/// shards.
fn zero_dim(g: &Graph, v: ValueId, mesh: &DeviceMesh, dp: usize) -> Option<usize> {
    let ty = g.ty(v);
    let s = g.value(v).sharding.clone().unwrap_or(Sharding::user([]));
    let local = |d: usize| {
        let ways: usize = s
            .axes_sharding_dim(d)
            .filter(|a| *a != DATA_AXIS)
            .map(|a| axis_size_or_one(mesh, a))
            .product();
        ty.dims()[d] / ways.max(1)
    };
    let fits = |d: usize| local(d).is_multiple_of(dp) && local(d) >= dp;
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
        let accumulates = node
            .scope
            .as_deref()
            .is_some_and(|s| s.contains(crate::train::ACCUMULATE_TAG));
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
        let in_optimizer = node
            .scope
            .as_deref()
            .is_some_and(|s| s.starts_with("optimizer/"));
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
