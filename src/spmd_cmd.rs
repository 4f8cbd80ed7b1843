//! The SPMD options of `autopar run` and `autopar dump`: the mesh, the ZeRO stage and an
//! annotation file, and what the two commands do with them.

use anyhow::{Context, Result, bail};

use autopar::ir::{DeviceMesh, Graph};
use autopar::passes::parallelize::ParallelOptions;
use autopar::spmd;

/// Options that parallelise a graph on a device mesh.
#[derive(clap::Args)]
pub struct SpmdArgs {
    /// Device mesh, e.g. `dp=2,tp=2`: `run` uses that many CPU ranks (threads), `dump` shows
    /// the graph parallelised for it. `dp` is the data-parallel axis; model annotations name
    /// `tp` (tensor and vocabulary parallel) and `ep` (experts).
    #[arg(long)]
    pub mesh: Option<String>,
    /// ZeRO stage on the `dp` axis: 0, 1 (optimizer state sharded), 2 (and gradients), 3
    /// (and weights, gathered before each use).
    #[arg(long, default_value_t = 0, requires = "mesh")]
    pub zero: u8,
    /// Shardings by tensor name that replace the model's, one per line:
    /// `h.0.mlp.w1: tp=S(1)` (placements R, S(dim), P(sum); `#` starts a comment).
    #[arg(long, value_name = "FILE", requires = "mesh")]
    pub annotate: Option<String>,
}

impl SpmdArgs {
    fn options(&self) -> Result<Option<(DeviceMesh, ParallelOptions)>> {
        let Some(mesh) = &self.mesh else {
            return Ok(None);
        };
        let mesh = DeviceMesh::parse(mesh).with_context(|| format!("--mesh `{mesh}`"))?;
        let annotations = match &self.annotate {
            Some(path) => autopar::load_annotations(path)?,
            None => Vec::new(),
        };
        Ok(Some((
            mesh,
            ParallelOptions {
                zero: self.zero,
                annotations,
            },
        )))
    }
}

/// `dump --stage sharded|partitioned`: the graph with a placement on every value, or the
/// local program of `rank` with its collectives.
pub fn dump_graph(g: &Graph, args: &SpmdArgs, partitioned: bool, rank: usize) -> Result<Graph> {
    let Some((mesh, options)) = args.options()? else {
        bail!("--stage sharded and --stage partitioned need --mesh");
    };
    let p = autopar::passes::parallelize::parallelize(g, &mesh, &options)?;
    if partitioned {
        Ok(autopar::passes::partition::partition(
            &p.graph, &p.plan, rank,
        )?)
    } else {
        Ok(p.graph)
    }
}

/// `run --mesh`: runs `steps` steps of `g` on the mesh's CPU ranks, printing each loss, and
/// with `verify` the comparison with the single-device reference (an error when it fails).
pub fn run(g: &Graph, args: &SpmdArgs, seed: u64, steps: u64, verify: bool) -> Result<()> {
    let Some((mesh, options)) = args.options()? else {
        bail!("--verify needs --mesh");
    };
    let program = spmd::compile(g, &mesh, &options)?;
    let summary = spmd::run(&program, seed, steps, verify, |step, loss| {
        println!("step {} loss: {loss:.6}", step + 1);
    })?;
    println!(
        "ranks: {} ({mesh}), peak memory per rank: {}",
        mesh.num_devices(),
        summary.peak_bytes
    );
    if let Some(report) = summary.verify {
        println!("{}", report.line());
        if !report.ok() {
            bail!(
                "the parallel run differs from the single-device reference (worst: `{}`)",
                report.worst
            );
        }
    }
    Ok(())
}
