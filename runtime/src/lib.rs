//! autopar's runtime: the single-device reference interpreter that defines the semantics of
//! every IR op, its kernels, deterministic parameter initialisation and a synthetic data set.
//!
//! Typical use: draw parameters with [`init_parameters`], a batch with [`synthetic_batch`],
//! then [`run`] the graph and read the loss with [`RunOutput::scalar`].

pub mod data;
pub mod error;
pub mod init;
pub mod interp;
pub mod kernels;
pub mod reference;
pub mod rng;
pub mod tensor;

use std::collections::BTreeMap;

pub use data::{bigram_permutation, regression_teacher, synthetic_batch, token_loss_floor};
pub use error::{Feed, RuntimeError};
pub use init::{element_init, init_parameter, init_parameters};
pub use interp::{Communicator, RunOptions, RunOutput, SingleDevice, run, run_with_communicator};
pub use kernels::eval_op;
pub use reference::decomposed_attention;
pub use tensor::{Data, Precision, Tensor, round_to_dtype};

/// Named tensors: parameters, inputs or outputs, by name.
pub type TensorMap = BTreeMap<String, Tensor>;
