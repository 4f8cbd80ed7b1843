//! Models, clusters and annotation files from the arguments a user gives: a zoo name or
//! spec, a `.air` or `.json` graph file, a cluster preset or TOML file. Also the one-shot
//! services around a model: its transformer description for the cost model, a step
//! estimate, and dumps.

use std::path::Path;

use autopar_ir::Graph;
use autopar_passes::parallelize::Annotation;

use crate::Error;

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A zoo name or spec, built at a batch size.
    Zoo(String),
    /// A text IR file.
    AirFile(String),
    /// A JSON graph file.
    JsonFile(String),
    /// An ONNX model (its batch dim set at load time, a loss built on request).
    OnnxFile(String),
}

impl ModelSource {
    /// Classifies a model argument: a path ending in `.air` or `.json` (or any existing file)
    /// is a file; anything else is a zoo name or spec.
    pub fn classify(arg: &str) -> ModelSource {
        let lower = arg.to_ascii_lowercase();
        if lower.ends_with(".json") {
            ModelSource::JsonFile(arg.to_string())
        } else if lower.ends_with(".onnx") {
            ModelSource::OnnxFile(arg.to_string())
        } else if lower.ends_with(".air") || (Path::new(arg).is_file() && !arg.contains(':')) {
            ModelSource::AirFile(arg.to_string())
        } else {
            ModelSource::Zoo(arg.to_string())
        }
    }
}

/// Loads the graph a model argument names. `batch` applies to zoo and ONNX models only
/// (default [`autopar_frontends::zoo::DEFAULT_BATCH`]); the shapes of an IR file are fixed,
/// so giving a batch size with one is an error rather than silently ignored. An ONNX model
/// is its forward, without a loss (see [`load_model_with_loss`]).
pub fn load_model(arg: &str, batch: Option<usize>) -> Result<Graph, Error> {
    load_model_with_loss(arg, batch, None)
}

/// [`load_model`], with `loss` built over an ONNX model's last output (ignored for other
/// models, which have theirs).
pub fn load_model_with_loss(
    arg: &str,
    batch: Option<usize>,
    loss: Option<autopar_frontends::onnx::Loss>,
) -> Result<Graph, Error> {
    match ModelSource::classify(arg) {
        ModelSource::OnnxFile(path) => Ok(import_onnx(&path, batch, loss)?.graph),
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

/// Imports an ONNX model at a global batch (default
/// [`autopar_frontends::zoo::DEFAULT_BATCH`]), with `loss` over its last output.
pub fn import_onnx(
    path: &str,
    batch: Option<usize>,
    loss: Option<autopar_frontends::onnx::Loss>,
) -> Result<autopar_frontends::onnx::Imported, Error> {
    let options = autopar_frontends::onnx::ImportOptions {
        batch: Some(batch.unwrap_or(autopar_frontends::zoo::DEFAULT_BATCH)),
        loss,
    };
    Ok(autopar_frontends::onnx::import_file(path, &options)?)
}

/// The forward graph of one micro-batch: a zoo or ONNX model built at
/// `batch / micro_batches` (`batch` defaults to [`autopar_frontends::zoo::DEFAULT_BATCH`] and
/// must be a multiple of `micro_batches`), or an IR file, whose shapes are taken as one
/// micro-batch's. An ONNX model gets `loss`; training one needs it.
pub fn load_micro_batch_forward(
    arg: &str,
    batch: Option<usize>,
    micro_batches: usize,
) -> Result<Graph, Error> {
    load_micro_batch_forward_with_loss(arg, batch, micro_batches, None)
}

/// [`load_micro_batch_forward`] with the loss of an ONNX model.
pub fn load_micro_batch_forward_with_loss(
    arg: &str,
    batch: Option<usize>,
    micro_batches: usize,
    loss: Option<autopar_frontends::onnx::Loss>,
) -> Result<Graph, Error> {
    let source = ModelSource::classify(arg);
    let micro = |batch: Option<usize>| -> Result<usize, Error> {
        let batch = batch.unwrap_or(autopar_frontends::zoo::DEFAULT_BATCH);
        let m = micro_batches;
        if m == 0 || !batch.is_multiple_of(m) {
            return Err(Error::Usage(format!(
                "--micro-batches {m} must divide the batch size {batch}"
            )));
        }
        Ok(batch / m)
    };
    match source {
        ModelSource::Zoo(name) => Ok(autopar_frontends::zoo::build(&name, micro(batch)?)?),
        ModelSource::OnnxFile(path) => {
            if loss.is_none() {
                return Err(Error::Usage(format!(
                    "`{path}` is a forward: training it needs --loss ce or --loss mse"
                )));
            }
            Ok(import_onnx(&path, Some(micro(batch)?), loss)?.graph)
        }
        ModelSource::AirFile(_) | ModelSource::JsonFile(_) => load_model(arg, batch),
    }
}

/// The training step of a model argument on one device (see [`autopar_passes::train`]):
/// the forward of one micro-batch ([`load_micro_batch_forward`]) with its backward and
/// optimizer update. [`crate::compile()`] is the general form.
pub fn load_train_step(
    arg: &str,
    batch: Option<usize>,
    options: &autopar_passes::train::TrainOptions,
) -> Result<autopar_passes::train::TrainStep, Error> {
    let forward = load_micro_batch_forward(arg, batch, options.micro_batches)?;
    Ok(autopar_passes::train::build_train_step(&forward, options)?)
}

fn no_batch(path: &str, batch: Option<usize>) -> Result<(), Error> {
    match batch {
        Some(_) => Err(Error::Usage(format!(
            "--batch applies to zoo models; the shapes of `{path}` are fixed by the file"
        ))),
        None => Ok(()),
    }
}

/// Reads a text file, naming it in the error.
pub fn read(path: &str) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|error| Error::Io {
        path: path.to_string(),
        error,
    })
}

/// [`load_cluster`], with the training stack `software` (as `--software` takes it:
/// `deepspeed,overlap_param_gather=true`) in place of the cluster's own `[software]`.
pub fn load_cluster_with(
    arg: &str,
    software: Option<&str>,
) -> Result<autopar_cost_model::Cluster, Error> {
    let mut cluster = load_cluster(arg)?;
    if let Some(spec) = software {
        let spec = autopar_cost_model::SoftwareSpec::parse(spec)?;
        spec.resolve()?;
        cluster.software = Some(spec);
    }
    Ok(cluster)
}

/// Sets the gradient bucket size of `cluster`'s software profile to `mb` MiB (`--bucket-mb`
/// of `estimate` and `plan`; 0: one all-reduce per gradient), keeping the rest of the profile
/// (`autopar` when the cluster names none).
pub fn set_bucket_mb(cluster: &mut autopar_cost_model::Cluster, mb: f64) -> Result<(), Error> {
    let mut spec = cluster
        .software
        .take()
        .unwrap_or_else(|| autopar_cost_model::SoftwareSpec {
            profile: autopar_cost_model::Software::default().name,
            ..Default::default()
        });
    spec.bucket_mb = Some(mb);
    spec.resolve()
        .map_err(|e| Error::Usage(format!("--bucket-mb {mb}: {e}")))?;
    cluster.software = Some(spec);
    Ok(())
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

/// Reads an annotation file for `--annotate` (format in [`autopar_passes::parallelize`]);
/// errors name the file and the line.
pub fn load_annotations(path: &str) -> Result<Vec<Annotation>, Error> {
    let src = read(path)?;
    autopar_passes::parallelize::parse_annotations(&src)
        .map_err(|e| Error::Usage(format!("{path}: {e}")))
}

/// The transformer description of a model argument (a zoo name or spec, or a graph file),
/// read off its graph: what the cost model and the strategy search work from.
pub fn model_config(model: &str) -> Result<autopar_cost_model::TransformerConfig, Error> {
    let g = load_model_shapes(model)?;
    Ok(autopar_cost_model::TransformerConfig::from_graph(&g)?)
}

/// The graph of a model argument for its structure and shapes alone: a zoo model at batch 1,
/// a file as it is.
pub fn load_model_shapes(model: &str) -> Result<Graph, Error> {
    match ModelSource::classify(model) {
        ModelSource::Zoo(_) => load_model(model, Some(1)),
        ModelSource::OnnxFile(_) => load_model(model, Some(1)),
        ModelSource::AirFile(_) | ModelSource::JsonFile(_) => load_model(model, None),
    }
}

/// Estimates one training step of a transformer under `plan` on `cluster`.
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

/// Output formats of a graph dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DumpFormat {
    /// The `.air` text IR, given parameter values elided (`values(elided, N)`).
    Text,
    /// The `.air` text IR with every given parameter value (text that loads back).
    TextWithValues,
    /// Graphviz DOT.
    Dot,
    /// JSON (schema in `autopar_ir::json`).
    Json,
}

/// Renders a graph in a dump format.
pub fn dump(g: &Graph, format: DumpFormat) -> String {
    dump_with(g, format, None)
}

/// Renders a graph in a dump format; `layers` selects what a DOT dump draws (every node when
/// `None`; the text and JSON dumps always hold the whole graph).
pub fn dump_with(
    g: &Graph,
    format: DumpFormat,
    layers: Option<autopar_ir::dot::LayerSelection>,
) -> String {
    match format {
        DumpFormat::Text => autopar_ir::text::print_with(g, autopar_ir::text::Values::Elided),
        DumpFormat::TextWithValues => autopar_ir::text::print(g),
        DumpFormat::Dot => autopar_ir::dot::to_dot_with(g, &autopar_ir::dot::DotOptions { layers }),
        DumpFormat::Json => autopar_ir::json::to_json(g),
    }
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
