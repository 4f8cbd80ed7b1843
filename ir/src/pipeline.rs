//! Pipeline programs as data: a training step cut into per-(virtual stage, micro-batch)
//! forward and backward sub-programs, an optimizer phase in per-rank segments, and the
//! messages that carry values between them.
//!
//! The compiler's pipeline splitter produces a [`PipelineProgram`]; the runtime's pipeline
//! executor runs it under a [`Schedule`]. The type lives here, beside the schedule, because
//! the runtime does not depend on the compiler.
//!
//! # Conventions
//!
//! Every value keeps the [`ValueId`] it has in the step graph the program was cut from, in
//! every sub-program that reads or writes it, so a rank keeps one map from value ids to
//! tensors. A sub-program reads each value it takes from outside through an `input` node
//! whose name is the value's id in text form (`%12`), and exports each value that is read
//! elsewhere as an output of the same name ([`value_name`]).

use serde::{Deserialize, Serialize};

use crate::schedule::Schedule;
use crate::{Graph, TensorType, ValueId};

/// The name under which a sub-program reads or exports value `v`: its text form, `%12`.
pub fn value_name(v: ValueId) -> String {
    v.to_string()
}

/// One sub-program: a graph with the values it takes and the values it exports.
#[derive(Clone, Debug)]
pub struct StageProgram {
    /// The nodes, with the step graph's value ids; external values are `input` nodes.
    pub graph: Graph,
    /// Values read from the rank's store (each an `input` of the graph), in id order.
    pub inputs: Vec<ValueId>,
    /// Values the graph exports to the rank's store (each an output), in id order.
    pub outputs: Vec<ValueId>,
}

/// A value carried by a message, with its type (the receiver must know it in advance).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Carried {
    /// The value's id.
    pub value: ValueId,
    /// Its type.
    pub ty: TensorType,
}

/// One segment of the optimizer phase: a sub-program that runs on one pipeline rank, and
/// what it sends to other ranks afterwards.
#[derive(Clone, Debug)]
pub struct OptimizerSegment {
    /// The pipeline rank that runs it.
    pub rank: usize,
    /// What it computes.
    pub program: StageProgram,
    /// `(destination rank, values)`, sent right after the segment ran.
    pub sends: Vec<(usize, Vec<Carried>)>,
}

/// Where a rank's store gets a value before the step: a parameter (state) or a data input of
/// the step graph, by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceValue {
    /// The parameter or input name.
    pub name: String,
    /// Its value id in the step graph.
    pub value: ValueId,
    /// Its type.
    pub ty: TensorType,
    /// True for a parameter (training state), false for a data input.
    pub is_state: bool,
}

/// A training step cut into pipeline stages (see the module docs).
#[derive(Clone, Debug)]
pub struct PipelineProgram {
    /// The schedule the sub-programs run under.
    pub schedule: Schedule,
    /// `forward[vs][mb]`: the forward of micro-batch `mb` through virtual stage `vs`.
    pub forward: Vec<Vec<StageProgram>>,
    /// `backward[vs][mb]`: its backward.
    pub backward: Vec<Vec<StageProgram>>,
    /// `activations[vs][mb]`: what virtual stage `vs` sends to `vs + 1` after the forward of
    /// `mb` (empty for the last stage).
    pub activations: Vec<Vec<Vec<Carried>>>,
    /// `gradients[vs][mb]`: what virtual stage `vs` sends to `vs - 1` after the backward of
    /// `mb` (empty for stage 0).
    pub gradients: Vec<Vec<Vec<Carried>>>,
    /// The optimizer phase, in an order every rank walks (a topological order).
    pub optimizer: Vec<OptimizerSegment>,
    /// `sources[rank]`: the parameters and inputs the rank reads.
    pub sources: Vec<Vec<SourceValue>>,
    /// `state_outputs[rank]`: `(state name, value)` of each next-state value that ends the
    /// step on the rank: the state it reads, updated, for the next step.
    pub state_outputs: Vec<Vec<(String, ValueId)>>,
    /// The step graph's outputs, `(name, value, rank that holds it at the end)`.
    pub outputs: Vec<(String, ValueId, usize)>,
}

impl PipelineProgram {
    /// Pipeline ranks.
    pub fn pp(&self) -> usize {
        self.schedule.pp
    }
}
