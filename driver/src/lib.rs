//! autopar's compiler driver: the entry points that an embedding program, the `autopar`
//! command line and every backend share.
//!
//! - [`compile()`] takes [`CompileOptions`] (model, training options, mesh, parallel and
//!   pipeline options; [`CompileOptions::from_plan`] maps a searched plan onto them) through
//!   the pass pipeline ([`Pass`]: model, sequence layout, training step, parallelize,
//!   partition, pipeline split, the verifier after each) and returns a [`CompiledStep`]:
//!   the per-rank programs, the [`StateLayout`] of the training state over the ranks, and
//!   the reference graph for `--verify`.
//! - [`run()`] executes a compiled step for some steps and reports losses, memory and, with
//!   `verify`, the comparison with the single-device reference ([`VerifyReport`], one
//!   tolerance policy: [`Tolerance::for_compute`]). [`run_on`] takes any launcher and
//!   backend; [`run()`] is the CPU one.
//!
//! ```
//! use autopar_driver::{CompileOptions, RunOptions, compile, run};
//!
//! let options = CompileOptions::new("gpt-tiny").on_mesh("dp=2")?;
//! let step = compile(&options)?;
//! let report = run(&step, &RunOptions { verify: true, ..RunOptions::default() }, |_| {})?;
//! assert!(report.verify.is_some_and(|v| v.ok()));
//! # Ok::<(), autopar_driver::Error>(())
//! ```
//!
//! The workspace's libraries are re-exported, so that one dependency gives the whole
//! compiler.

pub mod checkpoint;
pub mod compile;
pub mod data;
pub mod describe;
mod error;
pub mod forward;
pub mod host;
pub mod launch;
pub mod model;
pub mod options;
pub mod run;
pub mod search;
pub mod state;

pub use autopar_cost_model as cost_model;
pub use autopar_frontends as frontends;
pub use autopar_ir as ir;
pub use autopar_passes as passes;
pub use autopar_runtime as runtime;
pub use autopar_runtime_cuda as runtime_cuda;

pub use autopar_runtime::verify::{Tolerance, VerifyReport};
pub use autopar_runtime::{Tensor, TensorMap};
pub use compile::{CompiledPipeline, CompiledStep, Pass, PassDump, PassTiming, compile};
pub use error::Error;
pub use forward::{ForwardValues, NamedTensor, TensorValues, run_forward};
pub use launch::{BackendKind, Device, Launch, LauncherKind, cuda_bench_kernels, run_launched};
pub use model::{
    DumpFormat, ModelSource, dump, dump_with, estimate, import_onnx, load_annotations,
    load_cluster, load_cluster_with, load_micro_batch_forward, load_micro_batch_forward_with_loss,
    load_model, load_model_shapes, load_model_with_loss, load_train_step, model_config,
    set_bucket_mb,
};
pub use options::{CompileOptions, PipelineSpec, SequenceLayout, sequence_layout, without_pp};
pub use run::{
    BatchFn, PipelineRankStats, RankStats, RunHooks, RunOptions, RunReport, SaveFn, SaveHook,
    StateFn, StepEvent, run, run_on, run_with,
};
pub use state::{Shard, StateLayout, StateTensor};

pub use autopar_passes::fuse::FuseReport;
pub use autopar_passes::parallelize::{Annotation, ParallelOptions};
pub use autopar_passes::recompute::Recompute;
pub use autopar_passes::train::{
    GRADS_FINITE, LossScaling, LrDecay, LrSchedule, LrScheduleError, Optimizer, TrainOptions,
    TrainStep,
};
