//! autopar's runtime: the single-device reference interpreter that defines the semantics of
//! every IR op, its kernels, deterministic parameter initialisation, a synthetic data set and
//! a driver that runs training-step graphs step after step ([`Trainer`]); and the multi-rank
//! runtime behind four seams:
//!
//! - [`Collectives`] (`comm`): a rank's typed collectives and point-to-point messages over
//!   mesh-axis groups; [`communicate`] maps the IR's communication ops onto them;
//!   [`InProcessCommunicator`] (threads), `MpiCommunicator` (processes, feature `mpi`) and
//!   [`SingleDevice`] implement it.
//! - [`ExecutionPlan`] (`plan`): a rank program's order, liveness and static arena, computed
//!   once before it runs.
//! - [`Backend`] (`backend`): loads a rank program with its plan and executes it;
//!   [`CpuBackend`] is the reference interpreter.
//! - [`Launcher`] (`launch`): starts the ranks of a mesh; [`ThreadLauncher`] runs one thread
//!   per rank, `MpiLauncher` (feature `mpi`) this process's rank of an `mpirun` job.
//!
//! On top of them: [`run_spmd`] and the pipeline executor ([`run_pipeline_step_spmd`]),
//! `dist` (each rank's shards of the state and the batch, and the state gathered back) and
//! `verify` (the comparison with the single-device reference).
//!
//! Typical use: draw parameters with [`init_parameters`], a batch with [`synthetic_batch`],
//! then [`run`] the graph and read the loss with [`RunOutput::scalar`]:
//!
//! ```
//! use autopar_ir::{BinaryOp, DType, Graph, Init, InputRole, Op, ReduceOp, TensorType, UnaryOp};
//! use autopar_runtime::{RunOptions, init_parameters, run, synthetic_batch};
//!
//! let f32_ty = |dims: [usize; 2]| TensorType::new(DType::F32, dims);
//! let mut g = Graph::new("linear_regression");
//! let x = g.add(Op::Input { name: "x".into(), ty: f32_ty([8, 3]), role: InputRole::Features }, &[])?;
//! let y = g.add(
//!     Op::Input { name: "y".into(), ty: f32_ty([8, 2]), role: InputRole::RegressionTargets },
//!     &[],
//! )?;
//! let w = g.add(
//!     Op::Parameter { name: "w".into(), ty: f32_ty([3, 2]), init: Init::Normal { std: 0.1 } },
//!     &[],
//! )?;
//! let pred = g.add(Op::Einsum { spec: "bf,fo->bo".parse()? }, &[x, w])?;
//! let err = g.add(Op::Binary { func: BinaryOp::Sub }, &[pred, y])?;
//! let sq = g.add(Op::Unary { func: UnaryOp::Square }, &[err])?;
//! let loss = g.add(Op::Reduce { func: ReduceOp::Mean, dims: vec![0, 1] }, &[sq])?;
//! g.add_output("loss", loss)?;
//!
//! let params = init_parameters(&g, 0)?;
//! let batch = synthetic_batch(&g, 0, 0)?;
//! let out = run(&g, &params, &batch, RunOptions::default())?;
//! assert!(out.scalar("loss")? > 0.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod backend;
pub mod comm;
pub mod data;
pub mod dist;
pub mod error;
pub mod executor;
pub mod fast;
pub mod init;
pub mod interp;
pub mod kernels;
pub mod launch;
pub mod pipeline;
pub mod plan;
pub mod reference;
pub mod rng;
pub mod tensor;
pub mod train;
pub mod verify;

use std::collections::BTreeMap;

pub use backend::{Backend, CpuBackend, CpuExecutable};
pub use comm::{
    Collectives, CommOptions, InProcessCommunicator, SingleDevice, communicate,
    in_process_communicators,
};
pub use data::{bigram_permutation, regression_teacher, synthetic_batch};
pub use error::{Feed, RuntimeError};
pub use executor::{RankProgram, SpmdOptions, run_spmd, run_spmd_per_rank};
pub use fast::{FastCpuBackend, FastExecutable, FastTensor};
pub use init::{element_init, init_parameter, init_parameters};
pub use interp::{RunOptions, RunOutput, run, run_planned, run_with_collectives};
pub use kernels::{Accumulation, eval_op, eval_op_with};
#[cfg(feature = "mpi")]
pub use launch::MpiLauncher;
pub use launch::{Launcher, RankResults, ThreadLauncher, root_cause};
pub use pipeline::{
    PipelinePlans, PipelineRankStep, PipelineStepReport, RankReport, run_pipeline_rank,
    run_pipeline_step, run_pipeline_step_planned, run_pipeline_step_spmd, split_pipeline_rank,
};
pub use plan::{ExecutionPlan, plan_all};
pub use reference::{decomposed_attention, decomposed_attention_at};
pub use tensor::{Data, Precision, Tensor, round_to_dtype};
pub use train::{StepReport, Trainer};

/// Named tensors: parameters, inputs or outputs, by name.
pub type TensorMap = BTreeMap<String, Tensor>;
