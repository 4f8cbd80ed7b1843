//! The SPMD options of `autopar run` and `autopar dump`: the ZeRO stage, an annotation file,
//! sequence parallelism and the layer placement over the mesh's axes besides `pp` (the mesh
//! is the shared `--mesh`).

use anyhow::Result;

use autopar_cost_model::LayerPlacement;
use autopar_driver::ParallelOptions;

/// Options that parallelise a graph on a device mesh.
#[derive(clap::Args)]
pub struct SpmdArgs {
    /// ZeRO stage over the data ranks (`dp`, and `ep` for weights that are not experts): 0,
    /// 1 (optimizer state sharded), 2 (and gradients), 3 (and weights, gathered before each
    /// use).
    #[arg(long, default_value_t = 0, requires = "mesh")]
    pub zero: u8,
    /// Shardings by tensor name that replace the model's, one per line:
    /// `h.0.mlp.w1: tp=S(1)` (placements R, S(dim), P(sum); `#` starts a comment).
    #[arg(long, value_name = "FILE", requires = "mesh")]
    pub annotate: Option<String>,
    /// Megatron sequence parallelism: the residual stream and layer norms sharded on the
    /// sequence over `tp`, so each tensor-parallel all-reduce becomes a reduce-scatter and an
    /// all-gather.
    #[arg(long, requires = "mesh")]
    pub sp: bool,
    /// Placement of each attention op over `tp`, one letter per op for the QKV projection,
    /// the core and the output projection: `t` Megatron's split (by columns, heads, rows), `s`
    /// on each rank's sequence shard with the weights replicated over `tp`. Aliases: `tp`
    /// (ttt), `seq` (sss), `ulysses` (sts). With the core on the sequence shards the step is
    /// laid out in the load-balanced sequence order over `tp` (not with `cp`).
    #[arg(long, default_value = "tp", value_parser = parse_attn, requires = "mesh")]
    pub attn: String,
    /// Placement of the MLP's input and output GEMMs over `tp`, one letter each, as for
    /// --attn: `tp` (tt) is Megatron's column/row split, `seq` (ss) the whole MLP on each
    /// rank's sequence shard.
    #[arg(long, default_value = "tp", value_parser = parse_mlp, requires = "mesh")]
    pub mlp: String,
    /// Size in MiB of the buckets the data-parallel gradient all-reduces are grouped into,
    /// in the order the backward produces the gradients (PyTorch DDP's default, 25); 0 keeps
    /// one all-reduce per gradient. Small all-reduces that are ready together (the partial
    /// sums of the gradient norm) become one either way.
    #[arg(long, value_name = "MIB", default_value_t = 25.0, value_parser = parse_bucket_mb)]
    pub bucket_mb: f64,
}

/// Checks a --bucket-mb size: a number of MiB, 0 or more.
pub fn parse_bucket_mb(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(mb) if mb.is_finite() && mb >= 0.0 => Ok(mb),
        _ => Err(format!(
            "`{v}` is not a size in MiB (0 or more; 0 disables bucketing)"
        )),
    }
}

/// Checks an --attn code.
fn parse_attn(v: &str) -> Result<String, String> {
    LayerPlacement::default().set_attention(v)?;
    Ok(v.to_string())
}

/// Checks an --mlp code.
fn parse_mlp(v: &str) -> Result<String, String> {
    LayerPlacement::default().set_mlp(v)?;
    Ok(v.to_string())
}

impl SpmdArgs {
    /// The layer placement of --attn and --mlp.
    pub fn layer(&self) -> Result<LayerPlacement> {
        let mut layer = LayerPlacement::MEGATRON;
        layer
            .set_attention(&self.attn)
            .map_err(|e| anyhow::anyhow!("--attn: {e}"))?;
        layer
            .set_mlp(&self.mlp)
            .map_err(|e| anyhow::anyhow!("--mlp: {e}"))?;
        Ok(layer)
    }

    /// The parallel options of these flags (annotation files read and checked).
    pub fn options(&self) -> Result<ParallelOptions> {
        let annotations = match &self.annotate {
            Some(path) => autopar_driver::load_annotations(path)?,
            None => Vec::new(),
        };
        Ok(ParallelOptions {
            zero: self.zero,
            annotations,
            sequence_parallel: self.sp,
            layer: self.layer()?,
        })
    }
}
