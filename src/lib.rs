//! The `autopar` facade: resolves model arguments (zoo names, specs, `.air` and `.json`
//! files) into graphs, builds training steps and runs them, tying the workspace crates
//! together for the command line.
//!
//! The crates themselves are re-exported so that one dependency gives the whole compiler.

use std::path::Path;

use thiserror::Error;

pub use autopar_cost_model as cost_model;
pub use autopar_frontends as frontends;
pub use autopar_ir as ir;
pub use autopar_passes as passes;
pub use autopar_runtime as runtime;

pub mod pipeline_cmd;

use autopar_ir::Graph;
use autopar_passes::train::build_train_step;

pub use autopar_passes::recompute::Recompute;
pub use autopar_passes::train::{LossScaling, Optimizer, TrainOptions, TrainStep};
pub use autopar_runtime::StepReport;

pub mod spmd;

/// Errors of the facade: each wraps the failing crate's error with what was being done.
#[derive(Debug, Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A `.air` file does not parse.
    #[error("{path}:{error}")]
    Parse {
        /// The file.
        path: String,
        /// Line, column and message.
        error: autopar_ir::text::ParseError,
    },
    /// A graph file is not valid (JSON syntax, typing or verifier).
    #[error("{path}: {error}")]
    GraphFile {
        /// The file.
        path: String,
        /// What is wrong.
        error: autopar_ir::IrError,
    },
    /// A model argument or model code is wrong.
    #[error(transparent)]
    Frontend(Box<autopar_frontends::FrontendError>),
    /// Executing a graph failed.
    #[error(transparent)]
    Runtime(#[from] autopar_runtime::RuntimeError),
    /// A cluster description, plan or estimate is wrong.
    #[error(transparent)]
    Cost(#[from] autopar_cost_model::CostError),
    /// A compiler pass failed (sharding propagation, partitioning, annotations).
    #[error(transparent)]
    Pass(Box<autopar_passes::PassError>),
    /// An option does not apply.
    #[error("{0}")]
    Usage(String),
}

impl From<autopar_frontends::FrontendError> for Error {
    fn from(e: autopar_frontends::FrontendError) -> Self {
        Error::Frontend(Box::new(e))
    }
}

impl From<autopar_passes::PassError> for Error {
    fn from(e: autopar_passes::PassError) -> Self {
        // Boxed: pass errors carry names, types and axes, and would make every result large.
        Error::Pass(Box::new(e))
    }
}

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A zoo name or spec, built at a batch size.
    Zoo(String),
    /// A text IR file.
    AirFile(String),
    /// A JSON graph file.
    JsonFile(String),
}

impl ModelSource {
    /// Classifies a model argument: a path ending in `.air` or `.json` (or any existing file)
    /// is a file; anything else is a zoo name or spec.
    pub fn classify(arg: &str) -> ModelSource {
        let lower = arg.to_ascii_lowercase();
        if lower.ends_with(".json") {
            ModelSource::JsonFile(arg.to_string())
        } else if lower.ends_with(".air") || (Path::new(arg).is_file() && !arg.contains(':')) {
            ModelSource::AirFile(arg.to_string())
        } else {
            ModelSource::Zoo(arg.to_string())
        }
    }
}

/// Loads the graph a model argument names. `batch` applies to zoo models only (default
/// [`autopar_frontends::zoo::DEFAULT_BATCH`]); a file's shapes are fixed, so giving a batch
/// size with a file is an error rather than silently ignored.
pub fn load_model(arg: &str, batch: Option<usize>) -> Result<Graph, Error> {
    match ModelSource::classify(arg) {
        ModelSource::Zoo(name) => {
            let batch = batch.unwrap_or(autopar_frontends::zoo::DEFAULT_BATCH);
            Ok(autopar_frontends::zoo::build(&name, batch)?)
        }
        ModelSource::AirFile(path) => {
            no_batch(&path, batch)?;
            let src = read(&path)?;
            autopar_ir::text::parse(&src).map_err(|error| Error::Parse { path, error })
        }
        ModelSource::JsonFile(path) => {
            no_batch(&path, batch)?;
            let src = read(&path)?;
            autopar_ir::json::from_json(&src).map_err(|error| Error::GraphFile { path, error })
        }
    }
}

fn no_batch(path: &str, batch: Option<usize>) -> Result<(), Error> {
    match batch {
        Some(_) => Err(Error::Usage(format!(
            "--batch applies to zoo models; the shapes of `{path}` are fixed by the file"
        ))),
        None => Ok(()),
    }
}

fn read(path: &str) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_string(),
        source,
    })
}

/// Loads a cluster: a preset with options (`dgx-a100:nodes=4`, `cpu:ranks=8`) or a TOML file
/// (any argument ending in `.toml`, or naming an existing file).
pub fn load_cluster(arg: &str) -> Result<autopar_cost_model::Cluster, Error> {
    use autopar_cost_model::Cluster;
    if arg.to_ascii_lowercase().ends_with(".toml")
        || (Path::new(arg).is_file() && !arg.contains(':'))
    {
        let src = read(arg)?;
        Cluster::from_toml(&src).map_err(|e| Error::Usage(format!("{arg}: {e}")))
    } else {
        Ok(Cluster::preset(arg)?)
    }
}

/// Estimates one training step of a zoo transformer under `plan` on `cluster`.
///
/// The model's shape is read off its graph (built at batch 1: only shapes matter); the global
/// batch comes from `plan`.
pub fn estimate(
    model: &str,
    cluster: autopar_cost_model::Cluster,
    plan: &autopar_cost_model::Plan,
) -> Result<autopar_cost_model::Estimate, Error> {
    let cfg = model_config(model)?;
    Ok(autopar_cost_model::CostModel::new(cluster).estimate(&cfg, plan)?)
}

/// Output formats of `autopar dump`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DumpFormat {
    /// The `.air` text IR.
    Text,
    /// Graphviz DOT.
    Dot,
    /// JSON (schema in `autopar_ir::json`).
    Json,
}

/// Renders a graph in a dump format.
pub fn dump(g: &Graph, format: DumpFormat) -> String {
    match format {
        DumpFormat::Text => autopar_ir::text::print(g),
        DumpFormat::Dot => autopar_ir::dot::to_dot(g),
        DumpFormat::Json => autopar_ir::json::to_json(g),
    }
}

/// Runs one forward pass of `g` on the reference interpreter, with parameters initialised and
/// a synthetic batch drawn from `seed`, and returns the `loss` output.
pub fn forward_loss(g: &Graph, seed: u64) -> Result<f64, Error> {
    use autopar_runtime as rt;
    let params = rt::init_parameters(g, seed)?;
    let batch = rt::synthetic_batch(g, seed, 0)?;
    let out = rt::run(g, &params, &batch, rt::RunOptions::default())?;
    Ok(out.scalar("loss")?)
}

/// Builds the training step of a model argument (see [`autopar_passes::train`]).
///
/// For a zoo model, `batch` is the global batch (default
/// [`autopar_frontends::zoo::DEFAULT_BATCH`]); it must be a multiple of the number of
/// micro-batches, and the forward is built at `batch / micro_batches`. A file's shapes are
/// fixed, so a file is taken as the forward of one micro-batch.
pub fn load_train_step(
    arg: &str,
    batch: Option<usize>,
    options: &TrainOptions,
) -> Result<TrainStep, Error> {
    load_train_step_cp(arg, batch, options, 1)
}

/// Like [`load_train_step`], for `cp` devices of context parallelism: the forward is laid
/// out by [`autopar_passes::context_parallel::load_balance`] before the step is built, so the
/// backward follows the load-balanced sequence order too. With `cp <= 1` it is
/// [`load_train_step`].
pub fn load_train_step_cp(
    arg: &str,
    batch: Option<usize>,
    options: &TrainOptions,
    cp: usize,
) -> Result<TrainStep, Error> {
    let layout = (cp > 1).then_some(SequenceLayout {
        axis: autopar_passes::context_parallel::CONTEXT_AXIS,
        ways: cp,
    });
    load_train_step_laid_out(arg, batch, options, layout)
}

/// Like [`load_train_step`], with the forward laid out in `layout` (see [`sequence_layout`])
/// before the step is built, so that the backward follows the load-balanced sequence order
/// too. With `None` it is [`load_train_step`].
pub fn load_train_step_laid_out(
    arg: &str,
    batch: Option<usize>,
    options: &TrainOptions,
    layout: Option<SequenceLayout>,
) -> Result<TrainStep, Error> {
    let m = options.micro_batches;
    let forward = match ModelSource::classify(arg) {
        ModelSource::Zoo(name) => {
            let batch = batch.unwrap_or(autopar_frontends::zoo::DEFAULT_BATCH);
            if m == 0 || !batch.is_multiple_of(m) {
                return Err(Error::Usage(format!(
                    "--micro-batches {m} must divide the batch size {batch}"
                )));
            }
            autopar_frontends::zoo::build(&name, batch / m)?
        }
        ModelSource::AirFile(_) | ModelSource::JsonFile(_) => load_model(arg, batch)?,
    };
    let forward = match layout {
        Some(l) => l.apply(&forward)?,
        None => forward,
    };
    Ok(build_train_step(&forward, options)?)
}

/// The load-balanced sequence layout a mesh needs (see
/// [`autopar_passes::context_parallel`]): the mesh axis whose ranks split the sequence, and
/// its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceLayout {
    /// `cp` for context parallelism, `tp` for the attention core on the sequence shards.
    pub axis: &'static str,
    /// The number of sequence shards (above 1).
    pub ways: usize,
}

impl SequenceLayout {
    /// The forward graph `g` rewritten into this layout.
    pub fn apply(&self, g: &Graph) -> Result<Graph, Error> {
        Ok(autopar_passes::context_parallel::load_balance(
            g, self.axis, self.ways,
        )?)
    }
}

/// The sequence layout a step on `mesh` with the layer placement `layer` must be built in,
/// `None` when the order of the sequence does not matter to it:
///
/// - context parallelism (a `cp` axis above 1) runs ring attention over `cp`;
/// - the attention core on the sequence shards ([`autopar_cost_model::OpPlacement::Sequence`])
///   on a `tp` axis above 1 attends each rank's queries to every key, and is priced by the
///   cost model as balanced over `tp`, with one chunk from each end of the sequence per rank.
///
/// Both at once would need the two layouts nested, which neither the cost model nor the
/// passes describe: an error.
pub fn sequence_layout(
    mesh: &autopar_ir::DeviceMesh,
    layer: &autopar_cost_model::LayerPlacement,
) -> Result<Option<SequenceLayout>, Error> {
    use autopar_passes::context_parallel::CONTEXT_AXIS;
    use autopar_passes::parallelize::TENSOR_AXIS;
    let size = |axis: &str| mesh.axis_size(axis).unwrap_or(1);
    let core_on_shards = layer.attention == autopar_cost_model::OpPlacement::Sequence;
    match (size(CONTEXT_AXIS), size(TENSOR_AXIS)) {
        (cp, tp) if cp > 1 && core_on_shards && tp > 1 => Err(Error::Usage(format!(
            "--attn: the layer placement `{layer}` runs the attention core on the sequence \
             shards of `{TENSOR_AXIS}`, which does not compose with context parallelism \
             ({CONTEXT_AXIS}={cp}); keep the core split by heads (e.g. attn=sts) or drop `{CONTEXT_AXIS}`"
        ))),
        (cp, _) if cp > 1 => Ok(Some(SequenceLayout {
            axis: CONTEXT_AXIS,
            ways: cp,
        })),
        (_, tp) if tp > 1 && core_on_shards => Ok(Some(SequenceLayout {
            axis: TENSOR_AXIS,
            ways: tp,
        })),
        _ => Ok(None),
    }
}

/// What a training run reports at its end.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    /// The loss of every step, in order.
    pub losses: Vec<f64>,
    /// The largest peak of live tensor bytes over the steps.
    pub peak_bytes: u64,
}

/// Runs `steps` training steps of `step` on the reference interpreter, with the state
/// initialised and the synthetic data drawn from `seed`; `each` sees every step's report.
pub fn train<E: From<Error>>(
    step: &TrainStep,
    seed: u64,
    steps: u64,
    mut each: impl FnMut(&StepReport) -> Result<(), E>,
) -> Result<TrainSummary, E> {
    use autopar_runtime as rt;
    let runtime = |e: rt::RuntimeError| E::from(Error::from(e));
    let mut trainer =
        rt::Trainer::new(&step.graph, seed, rt::RunOptions::default()).map_err(runtime)?;
    let mut summary = TrainSummary {
        losses: Vec::new(),
        peak_bytes: 0,
    };
    for _ in 0..steps {
        let report = trainer.step().map_err(runtime)?;
        each(&report)?;
        summary.losses.push(report.loss);
        summary.peak_bytes = summary.peak_bytes.max(report.peak_bytes);
    }
    Ok(summary)
}

/// Reads an annotation file for `--annotate` (format in [`autopar_passes::parallelize`]);
/// errors name the file and the line.
pub fn load_annotations(path: &str) -> Result<Vec<autopar_passes::parallelize::Annotation>, Error> {
    let src = read(path)?;
    autopar_passes::parallelize::parse_annotations(&src)
        .map_err(|e| Error::Usage(format!("{path}: {e}")))
}

/// The transformer description of a model argument (a zoo name or spec, or a graph file),
/// read off its graph: what the cost model and the strategy search work from.
pub fn model_config(model: &str) -> Result<autopar_cost_model::TransformerConfig, Error> {
    let g = match ModelSource::classify(model) {
        ModelSource::Zoo(_) => load_model(model, Some(1))?,
        ModelSource::AirFile(_) | ModelSource::JsonFile(_) => load_model(model, None)?,
    };
    Ok(autopar_cost_model::TransformerConfig::from_graph(&g)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_model_arguments() {
        assert_eq!(
            ModelSource::classify("gpt-tiny"),
            ModelSource::Zoo("gpt-tiny".into())
        );
        assert_eq!(
            ModelSource::classify("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256"),
            ModelSource::Zoo("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256".into())
        );
        assert_eq!(
            ModelSource::classify("a/b.AIR"),
            ModelSource::AirFile("a/b.AIR".into())
        );
        assert_eq!(
            ModelSource::classify("g.json"),
            ModelSource::JsonFile("g.json".into())
        );
    }

    #[test]
    fn batch_with_a_file_is_a_usage_error() {
        let err = load_model("missing.air", Some(4)).unwrap_err();
        assert!(
            err.to_string().contains("--batch applies to zoo models"),
            "{err}"
        );
        let err = load_model("missing.air", None).unwrap_err();
        assert!(err.to_string().starts_with("missing.air: "), "{err}");
    }
}
