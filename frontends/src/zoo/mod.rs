//! The model zoo: MLP, GPT, Llama and MoE models written with the builder API, the named
//! presets, and the registry through which the command line lists, resolves and builds them.
//!
//! Every zoo model takes data inputs (`tokens`/`targets`, or `features`/`targets`), declares
//! its parameters with semi-auto annotations, and has one output, `"loss"`, an `f32[]`.
//! Transformer layers live in scopes `h.0`, `h.1`, ... with children `attn` and `mlp`, so a
//! pass can find a layer's nodes by scope prefix. The batch size is chosen at build time.
//!
//! ```
//! use autopar_frontends::zoo;
//!
//! let model = zoo::resolve("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256")?;
//! let graph = model.build(zoo::DEFAULT_BATCH)?;
//! assert_eq!(graph.num_parameter_elements(), model.num_parameters());
//! assert!(graph.output("loss").is_some());
//! # Ok::<(), autopar_frontends::FrontendError>(())
//! ```

mod gpt;
mod llama;
mod lm;
mod mlp;
mod moe;
mod presets;
mod spec;

use autopar_ir::Graph;

use crate::builder::ModelBuilder;
use crate::error::FrontendError;

pub use gpt::GptConfig;
pub use llama::LlamaConfig;
pub use mlp::MlpConfig;
pub use moe::MoeConfig;
pub use spec::MAX_SIZE;

/// The batch size used when none is given.
pub const DEFAULT_BATCH: usize = 8;

/// Init std of weights (GPT-2's choice, used for every transformer here).
pub(crate) const INIT_STD: f64 = 0.02;

/// Epsilon of every layer norm and RMS norm.
pub(crate) const NORM_EPS: f64 = 1e-5;

/// The layer-sequence entry of transformer block `layer_idx`.
pub(crate) fn block_id(layer_idx: usize) -> autopar_ir::LayerId {
    // Zoo models have far fewer than 2^32 layers.
    autopar_ir::LayerId::Block(u32::try_from(layer_idx).unwrap_or(u32::MAX))
}

/// Init std of the projections that write into the residual stream (attention output, MLP
/// output): GPT-2 scales them by `1/sqrt(2 * layers)` so the stream's variance stays bounded.
pub(crate) fn residual_std(n_layers: usize) -> f64 {
    INIT_STD / (2.0 * n_layers as f64).sqrt()
}

/// The architecture and sizes of a zoo model.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    /// A two-layer MLP regressor.
    Mlp(MlpConfig),
    /// A GPT, dense or with MoE MLPs.
    Gpt(GptConfig),
    /// A Llama, dense or with MoE MLPs (Mixtral).
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// Builds the training graph for `batch` samples, named `name`.
    pub fn build(&self, name: &str, batch: usize) -> Result<Graph, FrontendError> {
        self.validate(name)?;
        spec::check_size(name, "batch", batch)?;
        let m = ModelBuilder::new(name);
        let loss = match self {
            ModelConfig::Mlp(c) => mlp::build(&m, c, batch),
            ModelConfig::Gpt(c) => gpt::build(&m, c, batch),
            ModelConfig::Llama(c) => llama::build(&m, c, batch),
        };
        m.output("loss", loss);
        m.finish()
    }

    /// Number of trainable parameters, computed from the sizes (equal to what the built graph
    /// declares, at any batch size); saturates at `u64::MAX`.
    pub fn num_parameters(&self) -> u64 {
        let n = match self {
            ModelConfig::Mlp(c) => c.num_parameters(),
            ModelConfig::Gpt(c) => c.num_parameters(),
            ModelConfig::Llama(c) => c.num_parameters(),
        };
        u64::try_from(n).unwrap_or(u64::MAX)
    }
}

/// A resolved model argument: the name it was given by and its configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// The argument as given (trimmed): a zoo name or a spec. Built graphs carry this name.
    pub name: String,
    /// What to build.
    pub config: ModelConfig,
}

impl Model {
    /// Builds the training graph for `batch` samples (see [`ModelConfig::build`]).
    pub fn build(&self, batch: usize) -> Result<Graph, FrontendError> {
        self.config.build(&self.name, batch)
    }

    /// Number of trainable parameters (see [`ModelConfig::num_parameters`]).
    pub fn num_parameters(&self) -> u64 {
        self.config.num_parameters()
    }
}

/// Whether a zoo entry is a named model or a template for generic specs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A named model, e.g. `gpt3-175b`; it accepts overrides such as `gpt3-175b:seq=4096`.
    Preset,
    /// A spec family, e.g. `gpt:layers=L,...`.
    Family,
}

/// One line of the zoo listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZooEntry {
    /// The model name, or the family's spec template.
    pub name: &'static str,
    /// Named model or spec family.
    pub kind: EntryKind,
    /// One line saying what it is.
    pub description: &'static str,
}

/// Every zoo entry: the named models, then the generic spec families.
pub fn entries() -> Vec<ZooEntry> {
    let presets = presets::PRESETS.iter().map(|p| ZooEntry {
        name: p.name,
        kind: EntryKind::Preset,
        description: p.description,
    });
    let families = spec::FAMILIES.iter().map(|&(name, description)| ZooEntry {
        name,
        kind: EntryKind::Family,
        description,
    });
    presets.chain(families).collect()
}

/// Resolves a model argument: a zoo name (`gpt-tiny`), a zoo name with overrides
/// (`llama3-8b:seq=4096`) or a generic spec (`gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256`).
///
/// Errors name the argument and say what is wrong: an unknown name (listing the known
/// ones), an unknown key (listing the valid ones), a missing key, a value that is not a
/// number, a zero size, or sizes that do not fit together.
pub fn resolve(arg: &str) -> Result<Model, FrontendError> {
    spec::parse(arg)
}

/// Resolves `arg` and builds it for `batch` samples.
pub fn build(arg: &str, batch: usize) -> Result<Graph, FrontendError> {
    resolve(arg)?.build(batch)
}
