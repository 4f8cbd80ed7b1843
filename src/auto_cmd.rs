//! Executable plans: `autopar run MODEL --plan-file FILE` runs exactly the plan a search
//! found (written by `autopar plan --save FILE`, or the whole `autopar plan --json`
//! document, whose first plan is taken), and `autopar run MODEL --auto --cluster C`
//! searches the plans the CPU runtime executes, prints the best in one line and runs it.
//! [`autopar_driver::CompileOptions::from_plan`] maps a plan onto the compiler.

use anyhow::{Context, Result, bail};

use autopar_cost_model::{CostModel, Plan};
use autopar_driver::ir::DType;
use autopar_driver::search::{Constraints, SearchOptions, cpu_unsupported, search_with_progress};
use autopar_driver::{self as driver, CompileOptions, LossScaling};

use super::{RunArgs, print_stdout, run_cmd};

/// Reads a plan file: a [`Plan`] as JSON, or an `autopar plan --json` document (its best plan).
pub fn read_plan(path: &str) -> Result<Plan> {
    Ok(read_plan_file(path)?.0)
}

/// [`read_plan`], with the software profile a `plan --json` document says its plans were
/// priced for (its `software`; `None` for a plan file without one).
pub fn read_plan_file(path: &str) -> Result<(Plan, Option<String>)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read `{path}`"))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("`{path}` is not JSON"))?;
    let software = value
        .get("software")
        .and_then(|s| s.as_str())
        .map(str::to_string);
    let value = match value.get("plans") {
        Some(plans) => plans
            .get(0)
            .and_then(|p| p.get("config"))
            .cloned()
            .with_context(|| format!("`{path}` lists no plan"))?,
        None => value,
    };
    let plan = serde_json::from_value(value).with_context(|| format!("`{path}` is not a plan"))?;
    Ok((plan, software))
}

/// `run --auto` and `run --plan-file`.
pub fn run(args: &RunArgs) -> Result<()> {
    if args.forward || args.pipeline.mesh.is_some() || args.trace.is_some() {
        bail!(
            "--auto and --plan-file choose the mesh and train; drop --mesh, --forward and --trace"
        );
    }
    // The plan fixes the micro-batches (and, from a file, the dtype): a flag that would be
    // ignored is refused.
    if args.train.micro_batches != 1 {
        bail!("--micro-batches: the plan sets the micro-batches; drop the flag");
    }
    if args.plan_file.is_some() && args.train.options(Some(args.steps))?.compute_dtype != DType::F32
    {
        bail!("--dtype: the plan file sets the dtype; drop the flag");
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
    let checked = || -> Result<CompileOptions> {
        let cfg = driver::model_config(&args.model)?;
        let unsupported = cpu_unsupported(&cfg, &plan);
        if !unsupported.is_empty() {
            bail!(
                "plan `{plan}` cannot run on the CPU runtime: {} not supported",
                unsupported.join(", ")
            );
        }
        let mut options =
            CompileOptions::from_plan(&args.model, &plan, &args.train.options(Some(args.steps))?)?;
        options.bucket_mb = args.spmd.bucket_mb;
        // The rules the estimate holds a plan to (layers of each stage among them).
        plan.check_model(&cfg)
            .with_context(|| format!("plan `{plan}` does not fit `{}`", args.model))?;
        Ok(options)
    };
    let mut options = match &args.plan_file {
        Some(path) => checked().with_context(|| format!("plan file `{path}`"))?,
        None => checked()?,
    };
    match (options.train.loss_scaling.as_mut(), args.train.loss_scale) {
        (Some(scaling), Some(initial_scale)) => {
            *scaling = LossScaling {
                initial_scale,
                ..*scaling
            }
        }
        (None, Some(_)) => bail!(
            "--loss-scale applies to f16 plans only, and plan `{plan}` computes in {}",
            plan.dtype
        ),
        (_, None) => {}
    }
    options.reference = args.verify;
    run_cmd::run_options(args, options)
}

/// The best plan the CPU runtime executes for `args.model` on `args.cluster`, printed.
fn search(args: &RunArgs) -> Result<Plan> {
    let Some(cluster_arg) = &args.cluster else {
        bail!("--auto needs --cluster (e.g. cpu:ranks=8)");
    };
    let mut cluster = driver::load_cluster(cluster_arg)?;
    // The search prices the gradient buckets the run will compile.
    driver::set_bucket_mb(&mut cluster, args.spmd.bucket_mb)?;
    let model = CostModel::new(cluster);
    let cfg = driver::model_config(&args.model)?;
    let batch = args.batch.unwrap_or(8);
    let mut opts = SearchOptions::new(batch);
    opts.dtype = args.train.options(Some(args.steps))?.compute_dtype;
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
