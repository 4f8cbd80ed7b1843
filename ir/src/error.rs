//! The error type of the IR crate.

use thiserror::Error;

/// Errors raised while building, checking or reading IR.
///
/// Type errors name the op and the offending shapes; verifier errors name the value or node.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum IrError {
    /// An op was applied to operands whose types it does not accept.
    #[error("`{op}`: {detail}")]
    Type {
        /// Text name of the op.
        op: &'static str,
        /// What is wrong, with the shapes involved.
        detail: String,
    },
    /// An op attribute is invalid on its own (e.g. a permutation that is not one).
    #[error("`{op}`: invalid attribute `{attr}`: {detail}")]
    Attr {
        /// Text name of the op.
        op: &'static str,
        /// Attribute name.
        attr: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A value id that is not (or no longer) defined in the graph.
    #[error("value {0} is not defined in this graph")]
    UnknownValue(String),
    /// A mesh axis that the graph's mesh does not have.
    #[error("mesh axis `{axis}` is not in the mesh ({mesh})")]
    UnknownMeshAxis {
        /// The axis named.
        axis: String,
        /// The mesh, printed.
        mesh: String,
    },
    /// A collective or point-to-point op in a graph without a device mesh.
    #[error("`{op}` over mesh axes needs a device mesh, and the graph has none")]
    NoMesh {
        /// Text name of the op.
        op: &'static str,
    },
    /// A malformed device mesh.
    #[error("invalid device mesh: {0}")]
    Mesh(String),
    /// A sharding annotation that does not fit its value.
    #[error("sharding of {value} ({ty}): {detail}")]
    Sharding {
        /// The value, printed as in the text format.
        value: String,
        /// Its type.
        ty: String,
        /// What is wrong (names the dim and mesh axis).
        detail: String,
    },
    /// A tensor dim that does not split evenly over the mesh axes that shard it.
    #[error(
        "dim {dim} of {ty} (size {size}) does not split evenly over mesh axis `{axis}` ({ways} ways in all)"
    )]
    UnevenShard {
        /// The sharded type (or shape), printed.
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
    /// A sharding that cannot describe a value of this type, independent of any graph
    /// (a dim out of range, an axis listed twice, mixed partial reductions).
    #[error("sharding {sharding} of {ty}: {detail}")]
    InvalidSharding {
        /// The sharding, printed.
        sharding: String,
        /// The type (or shape), printed.
        ty: String,
        /// What is wrong.
        detail: String,
    },
    /// A structural invariant of the graph does not hold (see [`crate::verify()`]).
    #[error("verifier: {0}")]
    Verify(String),
}

impl IrError {
    /// Shorthand for a [`IrError::Type`].
    pub(crate) fn ty(op: &'static str, detail: impl Into<String>) -> Self {
        IrError::Type {
            op,
            detail: detail.into(),
        }
    }

    /// Shorthand for a [`IrError::Attr`].
    pub(crate) fn attr(op: &'static str, attr: &'static str, detail: impl Into<String>) -> Self {
        IrError::Attr {
            op,
            attr,
            detail: detail.into(),
        }
    }
}
