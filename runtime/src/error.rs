//! The error type of the runtime: everything that can go wrong while feeding, initialising
//! or executing a graph, with the op, value or name involved.

use std::collections::BTreeMap;
use std::time::Duration;

use autopar_ir::{IrError, NodeId, TensorType};
use thiserror::Error;

/// Which kind of named tensor a caller supplies to the interpreter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    /// A trainable parameter (`Op::Parameter`).
    Parameter,
    /// A per-step data input (`Op::Input`).
    Input,
}

impl std::fmt::Display for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Feed::Parameter => "parameter",
            Feed::Input => "input",
        })
    }
}

/// Errors raised by the runtime. Variants carry structured fields so that callers can match
/// on them; the messages name the op, tensor and types involved.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RuntimeError {
    /// The graph names a parameter or input that the caller did not supply.
    #[error("missing {feed} `{name}` (expected {expected})")]
    Missing {
        /// Parameter or input.
        feed: Feed,
        /// Its name in the graph.
        name: String,
        /// The type the graph declares.
        expected: TensorType,
    },
    /// A supplied parameter or input does not have the declared type.
    #[error("{feed} `{name}` has type {actual}, but the graph declares {expected}")]
    WrongType {
        /// Parameter or input.
        feed: Feed,
        /// Its name in the graph.
        name: String,
        /// The type the graph declares.
        expected: TensorType,
        /// The type of the supplied tensor.
        actual: TensorType,
    },
    /// An index operand (token id, target, gather/scatter id) lies outside its range.
    #[error("`{op}`: id {id} is out of range 0..{bound}")]
    IndexOutOfRange {
        /// Text name of the op.
        op: &'static str,
        /// The offending id.
        id: i64,
        /// The exclusive upper bound.
        bound: usize,
    },
    /// Integer division by zero.
    #[error("`{op}`: integer division by zero")]
    DivisionByZero {
        /// Text name of the op.
        op: &'static str,
    },
    /// A max or min reduction over no elements.
    #[error("`{op}`: reduction over an empty dim has no value")]
    EmptyReduction {
        /// Text name of the op.
        op: &'static str,
    },
    /// The op has no kernel for this operand dtype (a case the typing rules leave open).
    #[error("`{op}`: no kernel for operand dtype {dtype}")]
    UnsupportedDType {
        /// Text name of the op.
        op: &'static str,
        /// The operand's dtype.
        dtype: autopar_ir::DType,
    },
    /// A collective or point-to-point op reached an executor without a communicator.
    #[error(
        "`{op}` communicates between ranks and needs a multi-rank executor; the single-device interpreter cannot run it"
    )]
    NeedsMultiRank {
        /// Text name of the op.
        op: &'static str,
    },
    /// A parameter or input op was handed to the kernel dispatcher, which computes values
    /// only; the executor supplies source values itself.
    #[error("`{op}` is supplied by the executor, not computed by a kernel")]
    NotAKernel {
        /// Text name of the op.
        op: &'static str,
    },
    /// A program too large to plan or hold.
    #[error("graph `{graph}` is too large to run: {detail}")]
    TooLarge {
        /// The program.
        graph: String,
        /// What is too large.
        detail: String,
    },
    /// A tensor's element data does not fit its declared type.
    #[error("tensor of type {ty}: {detail}")]
    BadTensor {
        /// The declared type.
        ty: TensorType,
        /// What is wrong (element count, storage kind, value range).
        detail: String,
    },
    /// A graph output that does not exist.
    #[error("the graph has no output `{name}`")]
    UnknownOutput {
        /// The name asked for.
        name: String,
    },
    /// An output read as a scalar is not a one-element float or integer tensor.
    #[error("output `{name}` of type {ty} is not a scalar")]
    NotScalar {
        /// The output name.
        name: String,
        /// Its type.
        ty: TensorType,
    },
    /// A parameter's initialiser does not fit its dtype (e.g. a normal draw for integers).
    #[error("cannot initialise parameter `{name}` of type {ty}: {detail}")]
    Init {
        /// The parameter.
        name: String,
        /// Its type.
        ty: TensorType,
        /// What is wrong.
        detail: String,
    },
    /// The synthetic data set cannot fill an input as declared.
    #[error("cannot synthesise input `{name}` of type {ty}: {detail}")]
    Data {
        /// The input.
        name: String,
        /// Its type.
        ty: TensorType,
        /// What is wrong.
        detail: String,
    },
    /// Operands rejected by the op's typing rule, or a malformed graph.
    #[error(transparent)]
    Ir(#[from] IrError),
    /// An error raised while executing one node, with the node's id and scope for context.
    #[error("at {node} ({op}{}): {error}", scope.as_deref().map(|s| format!(" in `{s}`")).unwrap_or_default())]
    AtNode {
        /// The node.
        node: NodeId,
        /// Text name of its op.
        op: &'static str,
        /// Its scope (layer path), if any.
        scope: Option<String>,
        /// The underlying error.
        error: Box<RuntimeError>,
    },
    /// A peer did not deliver its part of a collective or point-to-point exchange in time:
    /// it died, diverged (waits in another collective) or is stuck.
    #[error(
        "`{op}` over ranks {group:?} on rank {rank}: nothing from rank {peer} within {timeout:?} (it died, diverged or is stuck)"
    )]
    CollectiveTimeout {
        /// Text name of the collective.
        op: &'static str,
        /// The ranks of the group, in group order (for `send`/`recv`: source, destination).
        group: Vec<usize>,
        /// The rank that waited.
        rank: usize,
        /// The rank it waited for.
        peer: usize,
        /// How long it waited.
        timeout: Duration,
    },
    /// A peer reached the same collective slot with a different op, attributes or operand
    /// type.
    #[error(
        "`{op}` over ranks {group:?}: rank {rank} called {ours}, but rank {peer} called {theirs}"
    )]
    CollectiveMismatch {
        /// Text name of this rank's collective.
        op: &'static str,
        /// The ranks of the group, in group order.
        group: Vec<usize>,
        /// This rank.
        rank: usize,
        /// The rank that disagreed.
        peer: usize,
        /// This rank's call, with attributes and operand type.
        ours: String,
        /// The peer's call.
        theirs: String,
    },
    /// Another rank failed while this one was communicating, so the run cannot finish.
    #[error("`{op}` over ranks {group:?} on rank {rank}: rank {failed_rank} failed: {reason}")]
    PeerFailed {
        /// Text name of the collective this rank was in.
        op: &'static str,
        /// Its group.
        group: Vec<usize>,
        /// This rank.
        rank: usize,
        /// The rank whose failure started it.
        failed_rank: usize,
        /// That rank's error.
        reason: String,
    },
    /// A peer finished or went away without taking part in a collective this rank is in.
    #[error("`{op}` over ranks {group:?} on rank {rank}: rank {peer} exited without taking part")]
    PeerExited {
        /// Text name of the collective.
        op: &'static str,
        /// Its group.
        group: Vec<usize>,
        /// This rank.
        rank: usize,
        /// The rank that is gone.
        peer: usize,
    },
    /// A rank's thread panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A pipeline program is inconsistent with its schedule (a value a sub-program needs is
    /// not on the rank when it runs).
    #[error("pipeline rank {rank}: {detail}")]
    Pipeline {
        /// The pipeline rank.
        rank: usize,
        /// What is missing or wrong.
        detail: String,
    },
    /// A multi-rank run cannot start (wrong number of programs, mismatched meshes).
    #[error("cannot run the ranks: {detail}")]
    SpmdSetup {
        /// What is wrong.
        detail: String,
    },
    /// A value of a parallelised graph has no sharding, so its shard on a rank is unknown.
    #[error("{value} has no sharding, so its shards on the ranks are unknown")]
    NoSharding {
        /// The value (`%7`).
        value: String,
    },
    /// A rank's state lacks the shard of a parameter that is being gathered.
    #[error("rank {rank} holds no shard of `{name}`")]
    MissingShard {
        /// The rank.
        rank: usize,
        /// The parameter.
        name: String,
    },
    /// A rank's shard of a parameter does not have the local type its sharding gives.
    #[error("rank {rank}'s shard of `{name}` has type {actual}, but its sharding gives {expected}")]
    ShardMismatch {
        /// The rank.
        rank: usize,
        /// The parameter.
        name: String,
        /// The local type the parameter's sharding gives the rank.
        expected: TensorType,
        /// The shard's type.
        actual: TensorType,
    },
    /// A comparison with the reference cannot be made: a tensor is missing on one side, the
    /// two have different types, or the runs took different numbers of steps.
    #[error("cannot compare with the reference: {detail}")]
    Verify {
        /// What does not match.
        detail: String,
    },
    /// An error raised on one rank of a multi-rank run.
    #[error("rank {rank}: {error}")]
    OnRank {
        /// The rank.
        rank: usize,
        /// Its error.
        error: Box<RuntimeError>,
    },
}

impl RuntimeError {
    /// The error without the [`RuntimeError::AtNode`] and [`RuntimeError::OnRank`] context
    /// around it.
    pub fn innermost(&self) -> &RuntimeError {
        match self {
            RuntimeError::AtNode { error, .. } | RuntimeError::OnRank { error, .. } => {
                error.innermost()
            }
            other => other,
        }
    }
}

/// A tensor of some backend that knows its type.
pub(crate) trait Typed {
    /// Its type.
    fn ty(&self) -> &TensorType;
}

impl Typed for crate::tensor::Tensor {
    fn ty(&self) -> &TensorType {
        crate::tensor::Tensor::ty(self)
    }
}

/// The tensor supplied for a parameter or input, checked against its declared type.
pub(crate) fn fed<'a, T: Typed>(
    feed: Feed,
    map: &'a BTreeMap<String, T>,
    name: &str,
    ty: &TensorType,
) -> Result<&'a T, RuntimeError> {
    let t = map.get(name).ok_or_else(|| RuntimeError::Missing {
        feed,
        name: name.into(),
        expected: ty.clone(),
    })?;
    if t.ty() != ty {
        return Err(RuntimeError::WrongType {
            feed,
            name: name.into(),
            expected: ty.clone(),
            actual: t.ty().clone(),
        });
    }
    Ok(t)
}
