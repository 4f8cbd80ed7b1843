//! The error type of the cost-model crate: bad cluster descriptions, plans that do not match
//! the model or the cluster, and schedules that cannot be built.

use thiserror::Error;

/// Errors raised while reading cluster descriptions and plans or while estimating a step.
///
/// Every variant names what the user wrote (the TOML key and line, the plan key, the model
/// dimension), so that the message can be shown as is.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CostError {
    /// A cluster description that is not valid TOML or lacks a key.
    #[error("cluster description, line {line}: {message}")]
    ClusterSyntax {
        /// 1-based line of the offending text (0 when unknown).
        line: usize,
        /// What the TOML reader said.
        message: String,
    },
    /// A key whose value is out of range.
    #[error("cluster description: `{key}` {message}")]
    ClusterValue {
        /// Dotted key, e.g. `gpu.peak_tflops.bf16`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A preset string that names no preset or has a bad option.
    #[error("cluster preset `{preset}`: {message}")]
    Preset {
        /// The string given.
        preset: String,
        /// What is wrong.
        message: String,
    },
    /// A software profile or option that does not exist or has a bad value.
    #[error("--software: {0}")]
    Software(String),
    /// A plan string with an unknown key or a bad value.
    #[error("plan: `{key}`: {message}")]
    PlanSyntax {
        /// The key as written.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A plan that does not divide the model or the cluster.
    #[error("plan does not fit the model or cluster: {0}")]
    PlanMismatch(String),
    /// A graph from which no transformer description could be read.
    #[error("cannot read a transformer from the graph: {0}")]
    ModelShape(String),
    /// A mesh axis that the mapping does not know.
    #[error("mesh axis `{0}` is not mapped")]
    UnknownAxis(String),
    /// The pipeline schedule could not be built or run.
    #[error(transparent)]
    Schedule(#[from] autopar_ir::schedule::ScheduleError),
}
