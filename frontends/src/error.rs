//! The error type of the frontends crate: mistakes in model code (caught while a graph is
//! built) and in model arguments (unknown names, bad specs, impossible configurations).

use autopar_ir::IrError;
use thiserror::Error;

/// Everything that can go wrong while naming, configuring or building a model.
///
/// Build errors carry the scope (layer path) that was current when the mistake was made, so
/// that they read like `h.1.mlp: `einsum`: ...`. Spec errors carry the model argument as given.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum FrontendError {
    /// An op rejected its operands or attributes (a shape mismatch, a bad dim, ...).
    #[error("{}{}", at(.scope), .error)]
    Op {
        /// Scope in which the op was applied (empty at the top level).
        scope: String,
        /// Text name of the op.
        op: &'static str,
        /// What the IR's typing rule said, naming the shapes involved (boxed: errors stay
        /// small on the happy path).
        error: Box<IrError>,
    },
    /// An op was given a tensor handle that belongs to another [`crate::ModelBuilder`].
    #[error("{}`{op}`: operand {operand} comes from another model builder", at(.scope))]
    ForeignTensor {
        /// Scope in which the op was applied.
        scope: String,
        /// Text name of the op (or `annotation` or `output`).
        op: &'static str,
        /// Position of the offending operand.
        operand: usize,
    },
    /// A parameter, input or output name was declared twice.
    #[error("{}{kind} `{name}` is declared twice", at(.scope))]
    DuplicateName {
        /// Scope of the second declaration.
        scope: String,
        /// `parameter`, `input` or `output`.
        kind: &'static str,
        /// The (scope-qualified, for parameters) name.
        name: String,
    },
    /// A sharding annotation that cannot apply to its tensor.
    #[error("{}sharding of `{tensor}` ({ty}) over mesh axis `{axis}`: {detail}", at(.scope))]
    Annotation {
        /// Scope in which the annotation was written.
        scope: String,
        /// The tensor: a parameter or input name, or a value id such as `%12`.
        tensor: String,
        /// Its type, e.g. `f32[64,256]`.
        ty: String,
        /// The mesh axis named by the annotation.
        axis: String,
        /// What is wrong.
        detail: String,
    },
    /// An ONNX file that cannot be imported (see [`crate::onnx::OnnxError`]).
    #[error(transparent)]
    Onnx(Box<crate::onnx::OnnxError>),
    /// The finished graph does not verify. This is a bug in the builder, not in model code.
    #[error("the built graph does not verify: {0}")]
    Verify(Box<IrError>),

    /// A model argument that is neither a zoo name nor a spec of a known family.
    #[error(
        "unknown model `{name}` (known models: {known}; or a spec `FAMILY:key=value,...` \
         with FAMILY one of {families})"
    )]
    UnknownModel {
        /// The name as given.
        name: String,
        /// The zoo's model names, comma-separated.
        known: String,
        /// The spec families, comma-separated.
        families: String,
    },
    /// A spec setting that is not `key=value`.
    #[error("model `{model}`: `{setting}` is not a `key=value` setting")]
    MalformedSetting {
        /// The model argument.
        model: String,
        /// The offending piece.
        setting: String,
    },
    /// A spec key that this model does not have.
    #[error("model `{model}`: unknown key `{key}` (valid keys: {valid})")]
    UnknownKey {
        /// The model argument.
        model: String,
        /// The key as given.
        key: String,
        /// The keys this model accepts, comma-separated.
        valid: String,
    },
    /// A spec key given twice.
    #[error("model `{model}`: key `{key}` is given twice")]
    DuplicateKey {
        /// The model argument.
        model: String,
        /// The repeated key.
        key: String,
    },
    /// A key that a generic spec must set.
    #[error("model `{model}`: missing key `{key}` (required: {required})")]
    MissingKey {
        /// The model argument.
        model: String,
        /// The first missing key.
        key: String,
        /// All required keys of the family, comma-separated.
        required: String,
    },
    /// A spec value of the wrong form (`hidden=abc`, `normalize=maybe`).
    #[error("model `{model}`: `{key}={value}`: expected {expected}")]
    BadValue {
        /// The model argument.
        model: String,
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What the key takes, e.g. `a positive integer`.
        expected: &'static str,
    },
    /// A size that must be positive is zero.
    #[error("model `{model}`: `{key}` must be positive, got 0")]
    ZeroValue {
        /// The model argument.
        model: String,
        /// The key (or `batch`).
        key: &'static str,
    },
    /// A size above the limit the zoo accepts (keeps all shape arithmetic far from overflow).
    #[error("model `{model}`: `{key}` is {value}, above the limit of {max}")]
    TooLarge {
        /// The model argument.
        model: String,
        /// The key (or `batch`).
        key: &'static str,
        /// The value.
        value: usize,
        /// The limit.
        max: usize,
    },
    /// One size must be a multiple of another (`hidden` of `heads`, `heads` of `kv_heads`).
    #[error("model `{model}`: `{key}` ({value}) is not divisible by `{by_key}` ({by})")]
    NotDivisible {
        /// The model argument.
        model: String,
        /// The key that must be a multiple.
        key: &'static str,
        /// Its value.
        value: usize,
        /// The key it must be a multiple of.
        by_key: &'static str,
        /// That key's value.
        by: usize,
    },
    /// More experts per token than experts.
    #[error("model `{model}`: `top_k` ({top_k}) exceeds `experts` ({experts})")]
    TopKExceedsExperts {
        /// The model argument.
        model: String,
        /// Experts per token.
        top_k: usize,
        /// Number of experts.
        experts: usize,
    },
    /// Any other impossible configuration (an odd rotary head dim, a non-positive float).
    #[error("model `{model}`: {detail}")]
    InvalidConfig {
        /// The model argument.
        model: String,
        /// What is wrong, naming the keys involved.
        detail: String,
    },
}

/// The `scope: ` prefix of build errors; nothing at the top level.
fn at(scope: &str) -> String {
    if scope.is_empty() {
        String::new()
    } else {
        format!("{scope}: ")
    }
}
