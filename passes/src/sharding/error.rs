//! The error type of the sharding rules and lowerings.

use autopar_ir::IrError;
use thiserror::Error;

/// Errors raised while listing strategies or lowering an op to its local kernel.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ShardingError {
    /// Collectives and point-to-point ops have no strategies: the partitioner inserts them,
    /// so finding one in a graph being sharded is a compiler bug.
    #[error("`{op}` is communication, inserted by the partitioner; it has no sharding strategies")]
    Communication {
        /// Text name of the op.
        op: &'static str,
    },
    /// Fusions are made from rank programs after partitioning: finding one in a graph being
    /// sharded is a compiler bug.
    #[error("`fusion` is made after partitioning; it has no sharding strategies")]
    Fusion,
    /// A strategy or lowering that does not fit the op it was applied to.
    #[error("`{op}`: {detail}")]
    Mismatch {
        /// Text name of the op.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// An IR error (typing of the op, or of an op a lowering builds).
    #[error(transparent)]
    Ir(#[from] IrError),
}
