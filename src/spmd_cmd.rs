//! The SPMD options of `autopar run` and `autopar dump`: the ZeRO stage, an annotation file,
//! sequence parallelism and the layer placement (the mesh is the shared `--mesh`), and what
//! the two commands do with them. A mesh with a `pp` axis longer than 1 is a pipeline, run by
//! the pipeline commands instead.

use anyhow::{Context, Result, bail};

use autopar::cost_model::LayerPlacement;
use autopar::ir::{DeviceMesh, Graph};
use autopar::passes::parallelize::ParallelOptions;
use autopar::spmd;

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

/// True when `mesh` asks for a pipeline (a `pp` axis of size above 1), alone or with other
/// axes.
pub fn is_pipeline(mesh: &str) -> Result<bool> {
    let m = DeviceMesh::parse(mesh).with_context(|| format!("--mesh `{mesh}`"))?;
    Ok(m.axis_size("pp").unwrap_or(1) > 1)
}

/// True when `mesh` has an axis besides `pp` of size above 1 (SPMD inside the pipeline).
pub fn has_spmd_axes(mesh: &str) -> Result<bool> {
    let m = DeviceMesh::parse(mesh).with_context(|| format!("--mesh `{mesh}`"))?;
    Ok(m.axes().iter().any(|a| a.name != "pp" && a.size > 1))
}

/// `run --mesh dp=..,tp=..,pp=N`: the step parallelised over the axes other than `pp`,
/// each rank's local step cut into the pipeline `pipeline` describes, run on one CPU thread
/// per rank of the whole mesh, with the last step's timeline written to `trace` (one track
/// per rank) and with `verify: Some(tolerance)` compared with the single-device reference
/// (`reference` when given, as [`load_for_mesh`] returns it for context parallelism; an error
/// when it fails).
#[allow(clippy::too_many_arguments)]
pub fn run_pipelined(
    step: &autopar::TrainStep,
    reference: Option<&Graph>,
    mesh: &str,
    args: &SpmdArgs,
    pipeline: &autopar::passes::pipeline::PipelineOptions,
    seed: u64,
    steps: u64,
    verify: Option<f64>,
    trace: Option<&str>,
) -> Result<()> {
    let Some((mesh, options)) = args.options(Some(mesh))? else {
        bail!("a pipeline needs --mesh");
    };
    let program = spmd::compile_pipelined_with_reference(
        step,
        reference.cloned(),
        &mesh,
        &options,
        pipeline,
    )?;
    let summary = spmd::run_pipelined(&program, seed, steps, verify, |step, loss| {
        println!("step {} loss: {loss:.6}", step + 1);
    })?;
    let peak = summary
        .last
        .iter()
        .flat_map(|r| r.ranks.iter().map(|k| k.peak_bytes))
        .max()
        .unwrap_or(0);
    for rank in 0..mesh.num_devices() {
        let (pp_rank, which) = autopar::runtime::split_pipeline_rank(&mesh, rank);
        let r = &summary.last[which].ranks[pp_rank];
        println!(
            "{}: peak memory {} bytes, peak activations {} bytes, state {} bytes, {} micro-batch chunks in flight",
            autopar::pipeline_cmd::rank_label(&mesh, rank),
            r.peak_bytes,
            r.peak_activation_bytes,
            summary.state_bytes[rank],
            r.max_in_flight
        );
    }
    if let Some(path) = trace {
        let schedule = &program
            .pipelines
            .first()
            .context("the mesh has no pipeline")?
            .schedule;
        let text = autopar::pipeline_cmd::mesh_trace_json(&mesh, schedule, &summary.last)?;
        std::fs::write(path, text).with_context(|| format!("cannot write `{path}`"))?;
    }
    let state = summary.state_bytes.iter().copied().max().unwrap_or(0);
    println!(
        "ranks: {} ({mesh}), {} pipelines of {} stages, peak memory per rank: {peak}, \
         state per rank: {state}",
        mesh.num_devices(),
        program.pipelines.len(),
        pipeline.pp * pipeline.vpp,
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

/// `dump --stage pipeline --mesh dp=..,tp=..,pp=N`: the step compiled as [`run_pipelined`]
/// would run it, described stage by stage ([`autopar::pipeline_cmd::describe_mesh_stages`]).
pub fn describe_pipeline(
    step: &autopar::TrainStep,
    mesh: &str,
    args: &SpmdArgs,
    pipeline: &autopar::passes::pipeline::PipelineOptions,
) -> Result<String> {
    let Some((mesh, options)) = args.options(Some(mesh))? else {
        bail!("a pipeline needs --mesh");
    };
    let program = spmd::compile_pipelined(step, &mesh, &options, pipeline)?;
    Ok(autopar::pipeline_cmd::describe_mesh_stages(&program)?)
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

    fn options(&self, mesh: Option<&str>) -> Result<Option<(DeviceMesh, ParallelOptions)>> {
        let Some(mesh) = mesh else {
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
                sequence_parallel: self.sp,
                layer: self.layer()?,
            },
        )))
    }
}

/// `dump --stage sharded|partitioned`: the graph with a placement on every value, or the
/// local program of `rank` with its collectives.
pub fn dump_graph(
    g: &Graph,
    mesh: Option<&str>,
    args: &SpmdArgs,
    partitioned: bool,
    rank: usize,
) -> Result<Graph> {
    let Some((mesh, options)) = args.options(mesh)? else {
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

/// The graph `run --mesh` and `dump --mesh` parallelise (the training step, or the forward
/// with `forward`), and, when the mesh and the layer placement `layer` need the load-balanced
/// sequence layout ([`autopar::sequence_layout`]: context parallelism, or the attention core
/// on the sequence shards of `tp`), the original graph the single-device reference runs: the
/// parallelised one is built from the forward laid out by
/// [`autopar::passes::context_parallel::load_balance`].
pub fn load_for_mesh(
    model: &str,
    batch: Option<usize>,
    options: &autopar::TrainOptions,
    forward: bool,
    mesh: &str,
    layer: &LayerPlacement,
) -> Result<(Graph, Option<Graph>)> {
    let parsed = DeviceMesh::parse(mesh).with_context(|| format!("--mesh `{mesh}`"))?;
    let layout = autopar::sequence_layout(&parsed, layer)?;
    if forward {
        let g = autopar::load_model(model, batch)?;
        return Ok(match layout {
            Some(l) => (l.apply(&g)?, Some(g)),
            None => (g, None),
        });
    }
    let step = autopar::load_train_step_laid_out(model, batch, options, layout)?.graph;
    let reference = match layout {
        Some(_) => Some(autopar::load_train_step(model, batch, options)?.graph),
        None => None,
    };
    Ok((step, reference))
}

/// `run --mesh`: runs `steps` steps of `g` on the mesh's CPU ranks, printing each loss, and
/// with `verify: Some(tolerance)` the comparison with the single-device reference (an error
/// when it fails), which runs `reference` when given (see [`load_for_mesh`]), else `g`.
pub fn run(
    g: &Graph,
    reference: Option<&Graph>,
    mesh: &str,
    args: &SpmdArgs,
    seed: u64,
    steps: u64,
    verify: Option<f64>,
) -> Result<()> {
    let Some((mesh, options)) = args.options(Some(mesh))? else {
        bail!("--verify needs --mesh");
    };
    let mut program = spmd::compile(g, &mesh, &options)?;
    program.reference = reference.cloned();
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
