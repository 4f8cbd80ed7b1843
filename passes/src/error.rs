//! The error type of the passes crate: one enum for every pass, with structured fields.

use thiserror::Error;

use autopar_ir::IrError;

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
}

fn scope_suffix(scope: &Option<String>) -> String {
    scope
        .as_ref()
        .map(|s| format!(" (scope `{s}`)"))
        .unwrap_or_default()
}
