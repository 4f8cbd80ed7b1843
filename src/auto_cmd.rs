//! Executable plans: `autopar run MODEL --plan-file FILE` runs exactly the plan a search
//! found (written by `autopar plan --save FILE`, or the whole `autopar plan --json`
//! document, whose first plan is taken), and `autopar run MODEL --auto --cluster C`
//! searches the plans the CPU runtime executes, prints the best in one line and runs it.
//!
//! A plan maps onto the CPU runtime as follows: `dp`/`ep`/`tp`/`pp` (in the plan's axis
//! order) with its ZeRO stage and sequence parallelism become the mesh, the plan's `dp`
//! counting the `ep` ranks carved out of it (plan `dp=4,ep=2` is mesh `dp=2,ep=2`); a `pp`
//! axis with its schedule and virtual stages becomes a pipeline (of partitioned programs when
//! `dp`/`ep`/`tp` are there too); the micro-batch count, recompute policy and dtype shape the
//! training step. Anything else (`cp`) is refused, naming what is not supported.

use anyhow::{Context, Result, bail};

use autopar::cost_model::{CostModel, Plan};
use autopar::ir::DType;
use autopar::passes::search::{Constraints, SearchOptions, cpu_unsupported, search_with_progress};
use autopar::{
    LossScaling, TrainOptions, load_train_step, load_train_step_laid_out, sequence_layout,
};

use super::{RunArgs, print_stdout, spmd_cmd};

/// Reads a plan file: a [`Plan`] as JSON, or an `autopar plan --json` document (its best plan).
pub fn read_plan(path: &str) -> Result<Plan> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read `{path}`"))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("`{path}` is not JSON"))?;
    let value = match value.get("plans") {
        Some(plans) => plans
            .get(0)
            .and_then(|p| p.get("config"))
            .cloned()
            .with_context(|| format!("`{path}` lists no plan"))?,
        None => value,
    };
    serde_json::from_value(value).with_context(|| format!("`{path}` is not a plan"))
}

/// `run --auto` and `run --plan-file`.
pub fn run(args: &RunArgs) -> Result<()> {
    if args.forward || args.pipeline.mesh.is_some() || args.trace.is_some() {
        bail!(
            "--auto and --plan-file choose the mesh and train; drop --mesh, --forward and --trace"
        );
    }
    let plan = match &args.plan_file {
        Some(path) => read_plan(path)?,
        None => search(args)?,
    };
    if let Some(b) = args.batch
        && b != plan.global_batch
    {
        bail!(
            "--batch {b} differs from the plan's global batch {}",
            plan.global_batch
        );
    }
    execute(args, &plan)
}

/// The best plan the CPU runtime executes for `args.model` on `args.cluster`, printed.
fn search(args: &RunArgs) -> Result<Plan> {
    let Some(cluster_arg) = &args.cluster else {
        bail!("--auto needs --cluster (e.g. cpu:ranks=8)");
    };
    let cluster = autopar::load_cluster(cluster_arg)?;
    let model = CostModel::new(cluster);
    let cfg = autopar::model_config(&args.model)?;
    let batch = args.batch.unwrap_or(8);
    let mut opts = SearchOptions::new(batch);
    opts.dtype = args.train.options().compute_dtype;
    opts.top_k = 1;
    opts.constraints = Constraints {
        cpu_executable: true,
        ..Constraints::default()
    };
    let result = search_with_progress(&model, &cfg, &opts, &|_| {})?;
    let Some(best) = result.plans.first() else {
        bail!(
            "no plan the CPU runtime executes fits {} on {cluster_arg} with global batch {batch}",
            args.model
        );
    };
    print_stdout(&format!(
        "plan: {} (searched {} plans, predicted {:.3} ms per step)\n",
        best.plan,
        result.stats.candidates,
        best.estimate.iter_time_s * 1e3
    ))?;
    Ok(best.plan.clone())
}

/// The training options of `plan`: the command's optimizer and clipping, the plan's dtype,
/// micro-batches and recompute.
fn train_options(args: &RunArgs, plan: &Plan) -> TrainOptions {
    let mut o = args.train.options();
    o.compute_dtype = plan.dtype;
    o.loss_scaling = (plan.dtype == DType::F16).then_some(LossScaling {
        initial_scale: args.train.loss_scale,
        ..LossScaling::default()
    });
    o.micro_batches = plan.micro_batches();
    o.recompute = match plan.recompute {
        autopar::cost_model::Recompute::None => autopar::Recompute::None,
        autopar::cost_model::Recompute::Selective => autopar::Recompute::Selective,
        autopar::cost_model::Recompute::Full => autopar::Recompute::Full,
    };
    o
}

/// Partitions and runs `plan` on CPU ranks.
fn execute(args: &RunArgs, plan: &Plan) -> Result<()> {
    let cfg = autopar::model_config(&args.model)?;
    let unsupported = cpu_unsupported(&cfg, plan);
    if !unsupported.is_empty() {
        bail!(
            "plan `{plan}` cannot run on the CPU runtime: {} not supported",
            unsupported.join(", ")
        );
    }
    let options = train_options(args, plan);
    let axes: Vec<String> = plan
        .axis_order
        .iter()
        .filter_map(|a| match a.as_str() {
            "dp" if plan.dp / plan.ep > 1 => Some(format!("dp={}", plan.dp / plan.ep)),
            "ep" if plan.ep > 1 => Some(format!("ep={}", plan.ep)),
            "tp" if plan.tp > 1 => Some(format!("tp={}", plan.tp)),
            "cp" if plan.cp > 1 => Some(format!("cp={}", plan.cp)),
            "pp" if plan.pp > 1 => Some(format!("pp={}", plan.pp)),
            _ => None,
        })
        .collect();
    let mesh = if axes.is_empty() {
        "dp=1".to_string()
    } else {
        axes.join(",")
    };
    // With context parallelism or the attention core on the sequence shards, the step is
    // laid out in the load-balanced sequence order; --verify runs the original one.
    let layout = sequence_layout(&autopar::ir::DeviceMesh::parse(&mesh)?, &plan.layer)?;
    let step = load_train_step_laid_out(&args.model, Some(plan.global_batch), &options, layout)?;
    let reference = if layout.is_some() && args.verify {
        Some(load_train_step(&args.model, Some(plan.global_batch), &options)?.graph)
    } else {
        None
    };
    // A plan that fixes its layers per virtual stage starts every stage after the first at
    // its first block; otherwise the splitter balances the step's FLOPs.
    let boundaries: Vec<String> = plan
        .stage_layers
        .iter()
        .flat_map(|layers| {
            layers[..layers.len().saturating_sub(1)]
                .iter()
                .scan(0, |start, n| {
                    *start += n;
                    Some(format!("h.{start}"))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    // Pipeline ranks alone: the pipeline runtime on its own.
    if plan.pp > 1 && plan.world_size() == plan.pp && plan.ep == 1 {
        return run_pipeline(args, plan, &step, &boundaries);
    }
    let spmd = spmd_cmd::SpmdArgs {
        zero: plan.zero_stage,
        annotate: None,
        sp: plan.sequence_parallel,
        attn: plan.layer.attention_code(),
        mlp: plan.layer.mlp_code(),
    };
    let verify = args
        .verify
        .then(|| autopar::spmd::verify_tolerance(plan.dtype));
    if plan.pp > 1 {
        let pipeline = autopar::passes::pipeline::PipelineOptions {
            pp: plan.pp,
            vpp: plan.vpp,
            schedule: plan.schedule,
            boundaries,
        };
        return spmd_cmd::run_pipelined(
            &step,
            reference.as_ref(),
            &mesh,
            &spmd,
            &pipeline,
            args.seed,
            args.steps,
            verify,
            None,
        );
    }
    spmd_cmd::run(
        &step.graph,
        reference.as_ref(),
        &mesh,
        &spmd,
        args.seed,
        args.steps,
        verify,
    )
}

/// A pipeline-only plan: its schedule, virtual stages and micro-batches on `pp` ranks.
fn run_pipeline(
    args: &RunArgs,
    plan: &Plan,
    step: &autopar::TrainStep,
    boundaries: &[String],
) -> Result<()> {
    use autopar::pipeline_cmd as pc;
    let split = pc::split(step, plan.pp, plan.schedule, plan.vpp, boundaries)?;
    let summary = pc::run_steps(step, &split, args.seed, args.steps)?;
    for (i, loss) in summary.losses.iter().enumerate() {
        print_stdout(&format!("step {} loss: {loss:.6}\n", i + 1))?;
    }
    print_stdout(&format!("ranks: {} (pp={})\n", plan.pp, plan.pp))?;
    if args.verify {
        let steps = args.steps.max(1);
        let (abs, rel) = pc::compare_with_reference(step, args.seed, steps, &summary.last.outputs)?;
        let tolerance = autopar::spmd::verify_tolerance(plan.dtype).max(pc::VERIFY_TOLERANCE);
        let ok = abs < tolerance;
        print_stdout(&format!(
            "verify: max_abs_err={abs:.3e} max_rel_err={rel:.3e} {}\n",
            if ok { "OK" } else { "FAILED" }
        ))?;
        if !ok {
            bail!("the pipelined step differs from the single-device reference");
        }
    }
    Ok(())
}
