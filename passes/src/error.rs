//! The error type of the passes crate: one enum for every pass, with structured fields.

use thiserror::Error;

use autopar_ir::IrError;

use crate::sharding::ShardingError;

/// Errors raised by compiler passes.
///
/// A pass that builds an ill-typed node reports [`PassError::Ir`]; a graph or option that a
/// pass cannot handle is reported with what was asked and why it does not apply.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PassError {
    /// Building or checking IR failed (a typing rule or the verifier).
    #[error(transparent)]
    Ir(#[from] IrError),
    /// A gradient would have to flow through an op that has no derivative rule.
    #[error("cannot differentiate through `{op}` at {node}{}", scope_suffix(.scope))]
    NotDifferentiable {
        /// Text name of the op.
        op: &'static str,
        /// The node, printed as in the text format (`n12`).
        node: String,
        /// Its scope, when it has one.
        scope: Option<String>,
    },
    /// The graph lacks something a pass needs, or has it in an unusable form.
    #[error("graph `{graph}`: {detail}")]
    BadGraph {
        /// The graph's name.
        graph: String,
        /// What is missing or wrong.
        detail: String,
    },
    /// A pass option has a value that does not apply to this graph.
    #[error("option `{option}`: {detail}")]
    BadOption {
        /// The option, spelled as on the command line.
        option: &'static str,
        /// Why the value does not apply.
        detail: String,
    },
    /// A sharding rule or lowering failed while propagating or partitioning.
    #[error(transparent)]
    Sharding(#[from] ShardingError),
    /// A sharding asked of a named tensor does not split one of its dims evenly.
    #[error(
        "`{tensor}` ({ty}): dim {dim} (size {size}) does not split evenly over mesh axis `{axis}` ({ways} ways in all)"
    )]
    UnevenShard {
        /// The tensor: a parameter or input name, or a value id.
        tensor: String,
        /// Its global type.
        ty: String,
        /// The tensor dim.
        dim: usize,
        /// Its global size.
        size: usize,
        /// The mesh axis at which the split stops being even.
        axis: String,
        /// Product of the sizes of the axes sharding the dim, up to and including `axis`.
        ways: usize,
    },
    /// A sharding annotation that cannot apply to its tensor (or names no tensor).
    #[error("annotation of `{tensor}`: {detail}")]
    Annotation {
        /// The tensor named by the annotation.
        tensor: String,
        /// What is wrong.
        detail: String,
    },
    /// A line of an annotation file that does not parse.
    #[error("line {line}: {detail}")]
    AnnotationSyntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// No sharding strategy of a node is compatible with the constraints around it.
    #[error("no sharding strategy for {node} (`{op}`) on mesh axis `{axis}`: {detail}")]
    NoStrategy {
        /// The node, printed as in the text format.
        node: String,
        /// Text name of the op.
        op: &'static str,
        /// The mesh axis.
        axis: String,
        /// Why.
        detail: String,
    },
    /// A pipeline cannot have that many stages.
    #[error("cannot cut {n_layers} layers into {n_stages} pipeline stages")]
    PipelineStages {
        /// Layers of the model (embedding, blocks, head and loss each count).
        n_layers: usize,
        /// Stages asked for (`pp * vpp`).
        n_stages: usize,
    },
    /// A pinned stage boundary cannot be honoured.
    #[error("stage boundary `{boundary}`: {detail}")]
    PinnedBoundary {
        /// The boundary as given.
        boundary: String,
        /// Why.
        detail: String,
    },
    /// A value flows against the pipeline (a forward value read by an earlier stage's
    /// backward, say), so the step cannot be cut at these boundaries.
    #[error("pipeline cut: {value} ({from}) is read by {to}")]
    PipelineCut {
        /// The value, as in the text format.
        value: String,
        /// Where it is produced.
        from: String,
        /// Where it is read.
        to: String,
    },
    /// A graph cannot be laid out in the load-balanced sequence order for a mesh axis that
    /// splits the sequence (`cp`, or `tp` under the attention core on the sequence shards),
    /// or was not laid out for it.
    #[error("load-balanced sequence layout on mesh axis `{axis}` ({ways} ways): {detail}")]
    ContextParallel {
        /// The mesh axis.
        axis: String,
        /// Its size.
        ways: usize,
        /// Why, naming the tensor and its sizes.
        detail: String,
    },
}

fn scope_suffix(scope: &Option<String>) -> String {
    scope
        .as_ref()
        .map(|s| format!(" (scope `{s}`)"))
        .unwrap_or_default()
}
