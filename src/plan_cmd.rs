//! `autopar plan`: the strategy search on the command line. Searches the training plans of a
//! model on a cluster, prints the best ones as a table with an explanation of why the best
//! wins (against the runner-up and a reference configuration), as JSON, or exported as
//! Megatron-LM arguments or torchtitan TOML.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;

use crate::progress::Ticker;
use autopar_cost_model::{CostModel, LayerPlacement, Plan, TransformerConfig};
use autopar_driver as driver;
use autopar_driver::ir::DType;
use autopar_driver::search::{
    Comparison, Constraints, Progress, RankedPlan, SearchOptions, SearchResult, megatron_args,
    megatron_reference, placed_axes, search_with_progress, torchtitan_toml,
};

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A transformer from the zoo (name or spec) or a .air/.json file.
    model: String,
    /// A preset (dgx-a100:nodes=N, dgx-h100:nodes=N, hgx-h200:nodes=N, cpu:ranks=N) or a TOML file.
    #[arg(long)]
    cluster: String,
    /// Global batch size in sequences.
    #[arg(long, value_parser = crate::parse_batch)]
    batch: usize,
    /// The training stack whose speed is modelled: autopar (default), megatron-lm-2021,
    /// megatron-lm-2022, megatron-core, nemo, deepspeed, fsdp or torchtitan, with knobs
    /// overridden as `NAME,knob=value` (attention=flash|flash1|fused|unfused,
    /// overlap_grad_reduce, tp_backward_overlap, tp_forward_overlap, tp_comm_overlap,
    /// overlap_param_gather, param_gather=layer|tensor, fusion=fused|eager,
    /// reduce_dtype=bf16|fp32, bucket_mb=MIB, p2p_blocking).
    /// Replaces a cluster file's [software].
    #[arg(long, value_name = "PROFILE")]
    software: Option<String>,
    /// Price the data-parallel gradient all-reduces as buckets of this many MiB, as the
    /// compiler's --bucket-mb forms them (0: one all-reduce per gradient); overrides the
    /// software profile's `bucket_mb` (autopar: 25; the others bucket by layer).
    #[arg(long, value_name = "MIB", value_parser = crate::spmd_cmd::parse_bucket_mb)]
    bucket_mb: Option<f64>,
    /// Compute dtype.
    #[arg(long, value_enum, default_value_t = PlanDtype::Bf16)]
    dtype: PlanDtype,
    /// How many plans to rank.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Print the best plan as the arguments or configuration of another stack.
    #[arg(long, value_enum)]
    export: Option<ExportTarget>,
    /// Stop searching after this many seconds and rank what was found.
    #[arg(long, value_name = "S", value_parser = crate::parse_seconds)]
    max_seconds: Option<Duration>,
    /// Pin values, e.g. "tp=8,recompute=full,attn=ulysses" (keys of --plan in `estimate`, and
    /// stages=L0-L1-... for the layers of each virtual stage, runtime=cpu for only the plans
    /// `autopar run --plan-file` executes on CPU ranks).
    #[arg(long, default_value = "")]
    pin: String,
    /// Compare the best plan with this plan (as in `estimate --plan`) instead of the
    /// Megatron-style reference.
    #[arg(long, value_name = "PLAN")]
    reference: Option<String>,
    /// An annotation file whose pins every ranked plan respects: a line `mesh: tp=2,zero=1`
    /// pins plan keys (as --pin, with which it must agree), and a tensor line
    /// `h.0.mlp.w1: tp=S(1)` (the format of `run --annotate`) requires each axis it shards
    /// over to be longer than 1 and, for a layer weight split over tp, keeps its op split
    /// over tp (attn=/mlp= letter `t`).
    #[arg(long, value_name = "FILE")]
    annotate: Option<String>,
    /// Write the best plan as JSON to this file (run it with `autopar run MODEL --plan-file FILE`).
    #[arg(long, value_name = "FILE")]
    save: Option<String>,
    /// Worker threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PlanDtype {
    Bf16,
    /// Transformer-Engine-style fp8 GEMMs in the layers, bf16 elsewhere.
    #[value(alias = "f8")]
    Fp8,
    #[value(alias = "f16")]
    Fp16,
    #[value(alias = "f32")]
    Fp32,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExportTarget {
    /// Megatron-LM command-line arguments.
    Megatron,
    /// torchtitan TOML sections.
    Torchtitan,
}

/// How often a search off a terminal prints its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

pub fn plan(args: PlanArgs) -> Result<()> {
    let mut cluster = driver::load_cluster_with(&args.cluster, args.software.as_deref())?;
    if let Some(mb) = args.bucket_mb {
        driver::set_bucket_mb(&mut cluster, mb)?;
    }
    let devices = cluster.num_devices();
    let gpu = cluster.gpu.model.clone();
    let model = CostModel::new(cluster);
    let cfg = driver::model_config(&args.model)?;
    let mut opts = SearchOptions::new(args.batch);
    opts.fp8 = args.dtype == PlanDtype::Fp8;
    opts.dtype = match args.dtype {
        PlanDtype::Bf16 | PlanDtype::Fp8 => DType::BF16,
        PlanDtype::Fp16 => DType::F16,
        PlanDtype::Fp32 => DType::F32,
    };
    opts.top_k = args.top;
    opts.threads = args.threads;
    opts.constraints = Constraints::parse(&args.pin)?;
    if let Some(path) = &args.annotate {
        opts.constraints = annotation_constraints(&args.model, path, &args.pin)?;
    }
    opts.max_time = args.max_seconds;

    // A status line on a terminal; off one (a log, CI), a line every few seconds.
    let ticker = Mutex::new(Ticker::with_interval(PROGRESS_EVERY));
    let report = |p: &Progress| {
        let Ok(mut ticker) = ticker.lock() else {
            return;
        };
        let done = p.shapes_done == p.shapes_total;
        if done && !ticker.is_live() {
            return;
        }
        ticker.tick(
            || {
                format!(
                    "searching: {}/{} mesh shapes, {} plans estimated",
                    p.shapes_done, p.shapes_total, p.estimated
                )
            },
            done,
        );
    };
    let result = search_with_progress(&model, &cfg, &opts, &report);
    if let Ok(mut ticker) = ticker.lock() {
        ticker.finish();
    }
    let result = result?;

    if result.stats.mesh_shapes == 0 {
        bail!(
            "no mesh shape (dp x tp x pp x cp = {devices}) divides the model, the global batch \
             {} and the pins: tp must divide the heads, the key/value heads, the MLP width and the vocabulary, \
             dp the global batch, pp be at most the {} layers",
            args.batch,
            cfg.layers
        );
    }
    let Some(best) = result.plans.first() else {
        bail!(
            "no plan fits: {} of the {} plans in the space were ruled out by memory{}",
            result.stats.pruned_by_memory + result.stats.estimated - result.stats.fitting,
            result.stats.candidates,
            if result.stats.complete {
                String::new()
            } else {
                " (the search stopped at --max-seconds before exploring the whole space)".into()
            }
        );
    };

    if let Some(path) = &args.save {
        std::fs::write(path, serde_json::to_string_pretty(&best.plan)? + "\n")
            .with_context(|| format!("cannot write `{path}`"))?;
    }

    let mut comparisons = Vec::new();
    if let Some(second) = result.plans.get(1) {
        comparisons.push(Comparison::new(
            &cfg,
            "the runner-up (#2)",
            (&best.plan, &best.estimate),
            (&second.plan, &second.estimate),
        ));
    }
    if !best.plan.layer.is_megatron() {
        // Why this layer placement: the same plan with every op split over tp.
        let megatron = Plan {
            layer: LayerPlacement::MEGATRON,
            ..best.plan.clone()
        };
        let est = model
            .estimate(&cfg, &megatron)
            .context("estimating the plan with Megatron-LM's layer placement")?;
        comparisons.push(Comparison::new(
            &cfg,
            "the same plan with every op split over tp (attn=ttt,mlp=tt)",
            (&best.plan, &best.estimate),
            (&megatron, &est),
        ));
    }
    let reference = match &args.reference {
        Some(text) => {
            let mut p = Plan::parse(text).context("--reference")?;
            p.global_batch = args.batch;
            p.dtype = opts.dtype;
            p.fp8 = opts.fp8;
            Some(("your reference".to_string(), p))
        }
        None => megatron_reference(&model, &cfg, &opts),
    };
    if let Some((name, p)) = &reference {
        let est = model
            .estimate(&cfg, p)
            .context("estimating the reference plan")?;
        comparisons.push(Comparison::new(
            &cfg,
            name,
            (&best.plan, &best.estimate),
            (p, &est),
        ));
    }

    let export = match args.export {
        Some(ExportTarget::Megatron) => Some(megatron_args(&cfg, &best.plan)?),
        Some(ExportTarget::Torchtitan) => Some(torchtitan_toml(&cfg, &best.plan)?),
        None => None,
    };

    if args.json {
        let plans: Vec<serde_json::Value> = result
            .plans
            .iter()
            .enumerate()
            .map(|(i, p)| {
                serde_json::json!({
                    "rank": i + 1,
                    "plan": p.plan.to_string(),
                    "config": p.plan,
                    "estimate": p.estimate,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": cfg,
            "cluster": args.cluster,
            "devices": devices,
            "global_batch": args.batch,
            "stats": result.stats,
            "plans": plans,
            "explanations": comparisons,
            "export": export,
        });
        return super::print_stdout(&(serde_json::to_string_pretty(&doc)? + "\n"));
    }
    if let Some(text) = export {
        let header = format!(
            "# best plan found by `autopar plan` ({:.1}% MFU predicted): {}\n",
            100.0 * best.estimate.mfu,
            best.plan
        );
        return super::print_stdout(&(header + &text));
    }
    let mut out = header(&args, &cfg, devices, &gpu, &result);
    out += &table(&result.plans);
    out += &format!("\nbest plan: {}\n", best.plan);
    if !comparisons.is_empty() {
        out += "\nwhy it wins\n";
        for c in &comparisons {
            out += &format!("\n{c}");
        }
    }
    super::print_stdout(&out)
}

/// The constraints of `--annotate FILE` combined with `--pin` (see
/// [`driver::search::annotation_constraints`]), for the model argument `model`.
pub fn annotation_constraints(model: &str, path: &str, pin: &str) -> Result<Constraints> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read `{path}`"))?;
    let g = driver::load_model_shapes(model)?;
    Ok(driver::search::annotation_constraints(
        &g, path, &text, pin,
    )?)
}

fn header(
    args: &PlanArgs,
    cfg: &TransformerConfig,
    devices: usize,
    gpu: &str,
    r: &SearchResult,
) -> String {
    let s = &r.stats;
    let mut out = format!(
        "model {} ({} layers, hidden {}, {} heads, seq {}) on {} ({devices} x {gpu}), global batch {}\n",
        args.model, cfg.layers, cfg.hidden, cfg.heads, cfg.seq, args.cluster, args.batch
    );
    out += &format!(
        "searched {} plans over {} mesh shapes in {:.2} s on {} thread(s): {} estimated, {} ruled \
         out by the memory bound, {} by the step-time bound, {} by a better layer \
         placement; {}\n\n",
        s.candidates,
        s.mesh_shapes,
        s.elapsed_s,
        s.threads,
        s.estimated,
        s.pruned_by_memory,
        s.pruned_by_time,
        s.pruned_by_dominance,
        if s.complete {
            "the space was fully explored".to_string()
        } else {
            format!(
                "NOT fully explored: --max-seconds stopped it after {} of {} mesh shapes",
                s.mesh_shapes_done, s.mesh_shapes
            )
        }
    );
    out
}

fn table(plans: &[RankedPlan]) -> String {
    let mut out = format!(
        "{:>4} {:>5} {:>3} {:>3} {:>3} {:>3} {:>3} {:>4} {:>4} {:<9} {:<3} {:<6} {:<11} {:<14} {:>8} {:>10} {:>7} {:>7} {:>6} {:>7}\n",
        "rank",
        "dp",
        "tp",
        "pp",
        "vpp",
        "cp",
        "ep",
        "mbs",
        "zero",
        "recompute",
        "sp",
        "tp ops",
        "schedule",
        "placement",
        "step s",
        "tokens/s",
        "TFLOP/s",
        "hw TF/s",
        "MFU",
        "mem GiB"
    );
    for (i, p) in plans.iter().enumerate() {
        let (plan, e) = (&p.plan, &p.estimate);
        out += &format!(
            "{:>4} {:>5} {:>3} {:>3} {:>3} {:>3} {:>3} {:>4} {:>4} {:<9} {:<3} {:<6} {:<11} {:<14} {:>8.3} {:>10.0} {:>7.1} {:>7.1} {:>5.1}% {:>7.1}\n",
            i + 1,
            plan.dp,
            plan.tp,
            plan.pp,
            plan.vpp,
            plan.cp,
            plan.ep,
            plan.micro_batch_size,
            plan.zero_stage,
            plan.recompute.name(),
            if plan.sequence_parallel { "yes" } else { "no" },
            format!("{}-{}", plan.layer.attention_code(), plan.layer.mlp_code()),
            plan.schedule.name(),
            placed_axes(plan).join("-"),
            e.iter_time_s,
            e.tokens_per_s,
            e.model_tflops_per_gpu,
            e.hardware_tflops_per_gpu,
            100.0 * e.mfu,
            e.peak_memory_gib
        );
    }
    out
}
