//! `autopar report`: one self-contained HTML page about a training plan (the plan given, or
//! the best one a search finds, with the runner-ups), and the page `autopar run --report`
//! writes after a run on CPU ranks, its measured timeline beside the predicted one. The
//! pictures are drawn by [`crate::report`].

use std::time::Duration;

use anyhow::{Context, Result, bail};

use autopar_cost_model::{CostModel, Plan, Recompute};
use autopar_driver::search::{Constraints, SearchOptions, search_with_progress};
use autopar_driver::{self as driver, CompileOptions, CompiledStep, RunReport};

use crate::report::{self, Measured, PageInput, RankedRow};
use crate::stack_args::{ComputeDtype, StackArgs};

/// Options of `autopar report`.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// A transformer from the zoo (name or spec) or a .air/.json file.
    model: String,
    /// A preset (dgx-a100:nodes=N, dgx-h100:nodes=N[,power=W], hgx-h200:nodes=N, cpu:ranks=N, ...) or a TOML file.
    #[arg(long)]
    cluster: String,
    /// Global batch size in sequences.
    #[arg(long, value_parser = crate::parse_batch)]
    batch: usize,
    /// Report on this plan (keys of `estimate --plan`) instead of searching.
    #[arg(long, conflicts_with = "plan_file")]
    plan: Option<String>,
    /// Report on the plan of this file (written by `plan --save`, or a `plan --json` document,
    /// whose `software` prices it where --software is not given).
    #[arg(long, value_name = "FILE")]
    plan_file: Option<String>,
    #[command(flatten)]
    stack: StackArgs,
    /// Compute dtype [default: bf16 when searching, the plan's otherwise].
    #[arg(long, value_enum)]
    dtype: Option<ComputeDtype>,
    /// How many plans the search ranks (the table of runner-ups).
    #[arg(long, default_value_t = 5, value_parser = crate::parse_top)]
    top: usize,
    /// Pin values of the search, as in `plan --pin`.
    #[arg(long, default_value = "")]
    pin: String,
    /// Stop searching after this many seconds.
    #[arg(long, value_name = "S", value_parser = crate::parse_seconds)]
    max_seconds: Option<Duration>,
    /// Search threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The HTML file to write.
    #[arg(short, long, value_name = "FILE")]
    output: String,
}

/// `autopar report`.
pub fn report(args: ReportArgs) -> Result<()> {
    // A `plan --json` document also names the stack its plans were priced for.
    let (given, from_file) = match (&args.plan, &args.plan_file) {
        (Some(text), _) => (Some(Plan::parse(text).context("--plan")?), None),
        (None, Some(path)) => {
            let (plan, software) = crate::auto_cmd::read_plan_file(path)?;
            (Some(plan), software)
        }
        (None, None) => (None, None),
    };
    let cluster = args.stack.cluster_or(&args.cluster, from_file.as_deref())?;
    let cfg = driver::model_config(&args.model)?;
    let model = CostModel::new(cluster.clone());
    let (rows, provenance) = match given {
        Some(mut plan) => {
            plan.global_batch = args.batch;
            if let Some(d) = args.dtype {
                d.apply(&mut plan);
            }
            let estimate = model
                .estimate(&cfg, &plan)
                .with_context(|| format!("estimating plan `{plan}`"))?;
            let from = match &args.plan_file {
                Some(path) => format!("The plan of `{path}`"),
                None => "The plan given with --plan".to_string(),
            };
            (
                vec![RankedRow { plan, estimate }],
                format!("{from}, estimated by the cost model (no search, so no runner-ups)."),
            )
        }
        None => search(&args, &model, &cfg)?,
    };
    let mut rows = rows;
    if rows[0].estimate.timeline.is_none() {
        // The search keeps no timelines; the best plan's is simulated again.
        let plan = rows[0].plan.clone();
        let again = model
            .estimate(&cfg, &plan)
            .with_context(|| format!("estimating plan `{plan}`"))?;
        rows[0].estimate.timeline = again.timeline;
    }
    let best = &rows[0];
    let page = report::page(&PageInput {
        model: &args.model,
        cfg: &cfg,
        cluster_arg: &args.cluster,
        cluster: &cluster,
        global_batch: args.batch,
        plan: &best.plan,
        estimate: &best.estimate,
        ranked: &rows,
        provenance,
        measured: None,
    })?;
    std::fs::write(&args.output, page).with_context(|| format!("cannot write `{}`", args.output))
}

/// The ranked plans of the search `args` describes, best first, and a sentence saying so.
fn search(
    args: &ReportArgs,
    model: &CostModel,
    cfg: &autopar_cost_model::TransformerConfig,
) -> Result<(Vec<RankedRow>, String)> {
    let mut opts = SearchOptions::new(args.batch);
    let dtype = args.dtype.unwrap_or(ComputeDtype::Bf16);
    opts.dtype = dtype.dtype();
    opts.fp8 = dtype.fp8();
    opts.top_k = args.top;
    opts.threads = args.threads;
    opts.constraints = Constraints::parse(&args.pin).context("--pin")?;
    opts.max_time = args.max_seconds;
    let result = search_with_progress(model, cfg, &opts, &|_| {})?;
    let s = &result.stats;
    let provenance = format!(
        "The best of {} plans searched over {} mesh shapes ({} estimated){}; the table ranks the \
         top {} as `autopar plan` does.",
        s.candidates,
        s.mesh_shapes,
        s.estimated,
        if s.complete {
            ", the space fully explored"
        } else {
            ", the search stopped by --max-seconds"
        },
        result.plans.len()
    );
    let rows: Vec<RankedRow> = result
        .plans
        .into_iter()
        .map(|p| RankedRow {
            plan: p.plan,
            estimate: p.estimate,
        })
        .collect();
    if rows.is_empty() {
        bail!(
            "no plan of {} fits on {} with global batch {} (try `autopar plan` for the reasons)",
            args.model,
            args.cluster,
            args.batch
        );
    }
    Ok((rows, provenance))
}

/// `autopar run ... --report FILE`: the page of the plan the run executed, estimated on the
/// CPU cluster of its ranks, with what the run measured.
pub fn write_run_report(
    path: &str,
    options: &CompileOptions,
    step: &CompiledStep,
    run: &RunReport,
) -> Result<()> {
    let mesh = &step.mesh;
    let n = mesh.num_devices();
    let cluster_arg = format!("cpu:ranks={n}");
    let cluster = driver::load_cluster(&cluster_arg)?;
    let cfg = driver::model_config(&options.model).with_context(|| {
        format!(
            "--report needs a transformer to estimate, `{}`",
            options.model
        )
    })?;
    let plan = plan_of_run(options, step)?;
    let estimate = CostModel::new(cluster.clone())
        .estimate(&cfg, &plan)
        .with_context(|| format!("--report: estimating the run's plan `{plan}`"))?;
    let pp_idx = mesh.axis_index(driver::ir::axis::PP);
    let rank_peaks: Vec<(String, u64)> = run
        .ranks
        .iter()
        .enumerate()
        .map(|(r, s)| (driver::describe::rank_label(mesh, r), s.peak_bytes))
        .collect();
    let mut pipeline_rank_peaks = vec![0.0f64; plan.pp];
    for (r, s) in run.ranks.iter().enumerate() {
        let p = pp_idx.map_or(0, |i| mesh.coords(r)[i]);
        if let Some(slot) = pipeline_rank_peaks.get_mut(p) {
            *slot = slot.max(s.peak_bytes as f64);
        }
    }
    let pipeline = match (&step.pipeline, run.pipeline_reports.first()) {
        (Some(p), Some(first)) => p.pipelines.first().map(|prog| {
            let spans: Vec<Vec<(u64, u64)>> = first.ranks.iter().map(|r| r.spans.clone()).collect();
            let makespan = spans.iter().flatten().map(|s| s.1).max().unwrap_or(0);
            (
                prog.schedule.clone(),
                driver::ir::schedule::Timeline { spans, makespan },
            )
        }),
        _ => None,
    };
    let measured = Measured {
        mesh: mesh.to_string(),
        pipelines: run.pipeline_reports.len(),
        pipeline,
        rank_peaks,
        pipeline_rank_peaks: if step.is_pipeline() {
            pipeline_rank_peaks
        } else {
            Vec::new()
        },
        losses: run.losses.clone(),
    };
    let page = report::page(&PageInput {
        model: &options.model,
        cfg: &cfg,
        cluster_arg: &cluster_arg,
        cluster: &cluster,
        global_batch: plan.global_batch,
        plan: &plan,
        estimate: &estimate,
        ranked: &[RankedRow {
            plan: plan.clone(),
            estimate: estimate.clone(),
        }],
        provenance: format!(
            "The plan `autopar run` executed on {n} CPU rank(s), estimated by the cost model on \
             `{cluster_arg}`, with the run's measurements below."
        ),
        measured: Some(measured),
    })?;
    std::fs::write(path, page).with_context(|| format!("cannot write `{path}`"))
}

/// The cost model's plan for the step a run compiled: its mesh, micro-batches, ZeRO stage,
/// sequence parallelism, layer placement, schedule, dtype and recompute.
fn plan_of_run(options: &CompileOptions, step: &CompiledStep) -> Result<Plan> {
    use driver::ir::axis;
    let mesh = &step.mesh;
    let size = |a: &str| mesh.axis_size(a).unwrap_or(1);
    let ep = size(axis::EP);
    let dp = size(axis::DP) * ep;
    let micro_batches = options.train.micro_batches.max(1);
    let batch = options.batch.unwrap_or(8);
    if !batch.is_multiple_of(dp * micro_batches) {
        bail!(
            "--report: the batch {batch} is not a whole number of sequences per data-parallel \
             rank and micro-batch (dp={dp}, {micro_batches} micro-batches)"
        );
    }
    let mut order: Vec<String> = Plan::DEFAULT_ORDER
        .iter()
        .filter(|a| mesh.axis_index(a).is_none())
        .map(|a| a.to_string())
        .collect();
    order.extend(
        mesh.axes()
            .iter()
            .map(|a| a.name.clone())
            .filter(|a| Plan::DEFAULT_ORDER.contains(&a.as_str())),
    );
    let plan = Plan {
        dp,
        tp: size(axis::TP),
        pp: size(axis::PP),
        vpp: options.pipeline.vpp.max(1),
        cp: size(axis::CP),
        ep,
        micro_batch_size: (batch / (dp * micro_batches)).max(1),
        global_batch: batch,
        zero_stage: options.parallel.zero,
        recompute: match options.train.recompute {
            driver::Recompute::None => Recompute::None,
            driver::Recompute::Selective => Recompute::Selective,
            driver::Recompute::Full => Recompute::Full,
        },
        sequence_parallel: options.parallel.sequence_parallel,
        schedule: options.pipeline.schedule,
        dtype: options.train.compute_dtype,
        fp8: false,
        axis_order: order,
        stage_layers: None,
        layer: options.parallel.layer,
        ..Plan::default()
    };
    plan.check()
        .with_context(|| format!("--report: the run's plan `{plan}`"))?;
    Ok(plan)
}
