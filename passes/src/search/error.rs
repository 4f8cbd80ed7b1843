//! The error type of the strategy search: bad options and constraints, cost-model failures,
//! and plans that cannot be expressed in an exported framework's terms.

use thiserror::Error;

use autopar_cost_model::CostError;

/// Errors raised by the search, its constraints and its exports.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SearchError {
    /// The cost model refused the model or a plan.
    #[error(transparent)]
    Cost(#[from] CostError),
    /// A search option out of range.
    #[error("search option `{option}`: {message}")]
    Option {
        /// The option.
        option: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A constraint with an unknown key or a bad value.
    #[error("constraint `{key}`: {message}")]
    Constraint {
        /// The key as written.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A plan that the target framework cannot run as is.
    #[error("cannot export to {target}: {message}")]
    Export {
        /// `megatron` or `torchtitan`.
        target: &'static str,
        /// What has no equivalent.
        message: String,
    },
}
