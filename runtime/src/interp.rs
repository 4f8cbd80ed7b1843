//! The reference interpreter: runs a whole [`Graph`] on one device in the order of its
//! [`ExecutionPlan`], freeing every value where the plan says (after its last use) and
//! recording the peak bytes of live tensors; communication ops go to a [`Collectives`].

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use autopar_ir::{Graph, IrError, Node, Op, ValueId};

use crate::TensorMap;
use crate::comm::{Collectives, SingleDevice, communicate};
use crate::error::{Feed, RuntimeError, fed};
use crate::kernels::{Accumulation, eval_op_with};
use crate::plan::ExecutionPlan;
use crate::tensor::{Precision, Tensor};

/// Options of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Whether float results are rounded to their declared dtypes.
    pub precision: Precision,
    /// How the dot products of einsum and attention accumulate: in `f64` (the default, the
    /// reference's semantics) or as f32 multiply-add chains, to measure the rounding noise of
    /// a backend that accumulates so.
    pub accumulation: Accumulation,
}

/// What a run produces: the named graph outputs and the memory it needed. `B` is the
/// backend's buffer type; the CPU interpreter's buffers are [`Tensor`]s.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutput<B = Tensor> {
    /// The graph's outputs, by name.
    pub outputs: BTreeMap<String, B>,
    /// The largest total size of the tensors alive at one time, in bytes at their declared
    /// dtypes. A value is alive from the moment its node runs until its last user has run
    /// (graph outputs until the end); during a node, its operands and results are all alive.
    /// Parameters and inputs are resident: they count from the start of the run (the caller
    /// holds them for the whole step, as a device holds its weights and optimizer state) until
    /// their last use, after which a value that replaces them (an optimizer update's result)
    /// takes their place, as an in-place update would. [`ExecutionPlan::peak_bytes`] is the
    /// same number, known before the run. A backend with its own storage reports the bytes it
    /// really held at once, at its element sizes.
    pub peak_bytes: u64,
    /// The size of the static arena the backend laid the program out in (the plan's layout at
    /// the backend's element sizes), when it has one; `None` for the interpreter.
    pub arena_bytes: Option<u64>,
}

impl RunOutput {
    /// The output called `name`.
    pub fn output(&self, name: &str) -> Result<&Tensor, RuntimeError> {
        self.outputs
            .get(name)
            .ok_or_else(|| RuntimeError::UnknownOutput { name: name.into() })
    }

    /// The value of a one-element output, such as the loss.
    pub fn scalar(&self, name: &str) -> Result<f64, RuntimeError> {
        let t = self.output(name)?;
        t.scalar_value().ok_or_else(|| RuntimeError::NotScalar {
            name: name.into(),
            ty: t.ty().clone(),
        })
    }
}

/// Runs `graph` on one device with the given parameters and inputs (by name; extra entries
/// are ignored). Communication ops are errors ([`RuntimeError::NeedsMultiRank`]).
pub fn run(
    graph: &Graph,
    params: &TensorMap,
    inputs: &TensorMap,
    options: RunOptions,
) -> Result<RunOutput, RuntimeError> {
    run_with_collectives(graph, params, inputs, options, &mut SingleDevice)
}

/// Like [`run`], handing communication ops to `comm`. Plans the graph first; to run one
/// graph many times, build its [`ExecutionPlan`] once and call [`run_planned`].
pub fn run_with_collectives(
    graph: &Graph,
    params: &TensorMap,
    inputs: &TensorMap,
    options: RunOptions,
    comm: &mut dyn Collectives,
) -> Result<RunOutput, RuntimeError> {
    let plan = ExecutionPlan::new(graph)?;
    run_planned(graph, &plan, params, inputs, options, comm)
}

/// Runs `graph` in the order of `plan` (built from this graph), freeing each value where the
/// plan says, with communication ops handed to `comm`.
pub fn run_planned(
    graph: &Graph,
    plan: &ExecutionPlan,
    params: &TensorMap,
    inputs: &TensorMap,
    options: RunOptions,
    comm: &mut dyn Collectives,
) -> Result<RunOutput, RuntimeError> {
    let order = plan.order();
    // Check every feed before computing anything, so that a bad one fails fast.
    for &n in order {
        match &graph.node(n).op {
            Op::Parameter { name, ty, .. } => fed(Feed::Parameter, params, name, ty).map(drop)?,
            Op::Input { name, ty, .. } => fed(Feed::Input, inputs, name, ty).map(drop)?,
            _ => {}
        }
    }

    let mut live: HashMap<ValueId, Cow<'_, Tensor>> = HashMap::new();
    // Fed values are resident from the start (see `RunOutput::peak_bytes`).
    let fed_node = |node: &Node| matches!(node.op, Op::Parameter { .. } | Op::Input { .. });
    let resident: u64 = order
        .iter()
        .map(|&n| graph.node(n))
        .filter(|node| fed_node(node))
        .flat_map(|node| &node.outputs)
        .map(|&v| graph.ty(v).size_bytes())
        .sum();
    let (mut live_bytes, mut peak_bytes) = (resident, resident);
    for (pos, &n) in order.iter().enumerate() {
        let node = graph.node(n);
        let counted_already = fed_node(node);
        let result_types = node
            .outputs
            .iter()
            .map(|&v| Ok(&graph.value_checked(v)?.ty))
            .collect::<Result<Vec<_>, IrError>>()?;
        let context = |e| match e {
            RuntimeError::Missing { .. } | RuntimeError::WrongType { .. } => e,
            other => RuntimeError::AtNode {
                node: n,
                op: node.op.name(),
                scope: node.scope.clone(),
                error: Box::new(other),
            },
        };
        let results = eval_node(node, &live, params, inputs, options, comm).map_err(context)?;
        if results.len() != result_types.len() {
            return Err(IrError::Verify(format!(
                "{n} ({}) has {} results but evaluated to {}",
                node.op,
                node.outputs.len(),
                results.len()
            ))
            .into());
        }
        for ((&v, declared), t) in node.outputs.iter().zip(result_types).zip(results) {
            if t.ty() != declared {
                return Err(IrError::Verify(format!(
                    "{v} is declared {declared} but evaluates to {}",
                    t.ty()
                ))
                .into());
            }
            if !counted_already {
                live_bytes += declared.size_bytes();
            }
            live.insert(v, t);
        }
        peak_bytes = peak_bytes.max(live_bytes);
        for v in plan.frees_after(pos) {
            if let Some(t) = live.remove(v) {
                live_bytes -= t.size_bytes();
            }
        }
    }

    let mut outputs = TensorMap::new();
    let named = graph.outputs();
    for (i, (name, v)) in named.iter().enumerate() {
        // Move each output out, copying only a value that a later name also exports.
        let t = if named[i + 1..].iter().any(|(_, w)| w == v) {
            live.get(v).cloned()
        } else {
            live.remove(v)
        };
        let t = t.ok_or_else(|| IrError::UnknownValue(v.to_string()))?;
        outputs.insert(name.clone(), t.into_owned());
    }
    Ok(RunOutput {
        outputs,
        peak_bytes,
        arena_bytes: None,
    })
}

/// The results of one node: parameters and inputs are looked up (and checked), communication
/// goes to `comm`, everything else to its kernel.
fn eval_node<'a>(
    node: &Node,
    live: &HashMap<ValueId, Cow<'a, Tensor>>,
    params: &'a TensorMap,
    inputs: &'a TensorMap,
    options: RunOptions,
    comm: &mut dyn Collectives,
) -> Result<Vec<Cow<'a, Tensor>>, RuntimeError> {
    match &node.op {
        Op::Parameter { name, ty, .. } => {
            return Ok(vec![Cow::Borrowed(fed(Feed::Parameter, params, name, ty)?)]);
        }
        Op::Input { name, ty, .. } => {
            return Ok(vec![Cow::Borrowed(fed(Feed::Input, inputs, name, ty)?)]);
        }
        _ => {}
    }
    let mut operands = Vec::with_capacity(node.inputs.len());
    for v in &node.inputs {
        let t = live
            .get(v)
            .ok_or_else(|| IrError::UnknownValue(v.to_string()))?;
        operands.push(t.as_ref());
    }
    let results = if node.op.is_communication() {
        communicate(comm, &node.op, &operands)?
    } else {
        eval_op_with(&node.op, &operands, options.precision, options.accumulation)?
    };
    Ok(results.into_iter().map(Cow::Owned).collect())
}
