//! `autopar plan`: the strategy search on the command line. Searches the training plans of a
//! model on a cluster, prints the best ones as a table with an explanation of why the best
//! wins (against the runner-up and a reference configuration), as JSON, or exported as
//! Megatron-LM arguments or torchtitan TOML.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;

use crate::progress::Ticker;
use crate::stack_args::{ComputeDtype, StackArgs};
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
    /// A preset (dgx-a100:nodes=N, dgx-h100:nodes=N[,power=W], hgx-h200:nodes=N, cpu:ranks=N, ...) or a TOML file.
    #[arg(long)]
    cluster: String,
    /// Global batch size in sequences.
    #[arg(long, value_parser = crate::parse_batch)]
    batch: usize,
    #[command(flatten)]
    stack: StackArgs,
    /// Compute dtype.
    #[arg(long, value_enum, default_value_t = ComputeDtype::Bf16)]
    dtype: ComputeDtype,
    /// How many plans to rank.
    #[arg(long, default_value_t = 10, value_parser = crate::parse_top)]
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
    /// Rank plans by the pessimistic end of their predicted range: the step with none of the
    /// software profile's overlap (gradient reduction, tensor-parallel collectives, ZeRO
    /// gathers and stage transfers all exposed), or the profile's own where its split GEMMs
    /// make that the slower.
    #[arg(long)]
    robust: bool,
    /// Also say how much of the best plan's lead over the runner-up depends on overlap, and
    /// what a predicted MFU above the highest published on the GPU rests on.
    #[arg(long)]
    explain: bool,
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
    let cluster = args.stack.cluster(&args.cluster)?;
    let devices = cluster.num_devices();
    let gpu = cluster.gpu.model.clone();
    let model = CostModel::new(cluster);
    let no_overlap = model.without_overlap();
    let pessimistic = model.pessimistic();
    // The model the search ranks with: the profile's, or with --robust the pessimistic end
    // of each plan's range (the slower of the step without overlap and with the profile's).
    let ranking = if args.robust { &pessimistic } else { &model };
    let cfg = driver::model_config(&args.model)?;
    let mut opts = SearchOptions::new(args.batch);
    opts.fp8 = args.dtype.fp8();
    opts.dtype = args.dtype.dtype();
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
    let result = search_with_progress(ranking, &cfg, &opts, &report);
    if let Ok(mut ticker) = ticker.lock() {
        ticker.finish();
    }
    let result = result?;

    if result.stats.mesh_shapes == 0 {
        let experts = match cfg.experts > 1 {
            true => format!(
                ", ep divide the {} experts and dp (times tp/etp where the experts fold over \
                 tensor-parallel ranks)",
                cfg.experts
            ),
            false => String::new(),
        };
        bail!(
            "no mesh shape (dp x tp x pp x cp = {devices}) divides the model, the global batch \
             {} and the pins: tp must divide the heads, the key/value heads, the MLP width and the vocabulary, \
             dp the global batch, pp be at most the {} layers{experts}",
            args.batch,
            cfg.layers
        );
    }
    if result.stats.candidates == 0 && result.stats.complete {
        bail!(
            "no plan satisfies the pins `{}`: each mesh shape that divides the model and the \
             batch leaves no combination of the pinned values (an ep that neither divides dp \
             nor folds over tp/etp tensor-parallel ranks into the experts, an etp without \
             sequence parallelism, ...)",
            args.pin
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

    // Each ranked plan's predicted range: the step at the profile's overlap and at none.
    let ranges: Vec<Range> = result
        .plans
        .iter()
        .map(|p| Range::of(&model, &no_overlap, &cfg, p, args.robust))
        .collect::<Result<_>>()?;

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
        let est = ranking
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
        None => megatron_reference(ranking, &cfg, &opts),
    };
    if let Some((name, p)) = &reference {
        let est = ranking
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
        Some(ExportTarget::Megatron) => Some(megatron_args(&cfg, &best.plan, &model.software)?),
        Some(ExportTarget::Torchtitan) => Some(torchtitan_toml(&cfg, &best.plan)?),
        None => None,
    };

    if args.json {
        let plans: Vec<serde_json::Value> = result
            .plans
            .iter()
            .enumerate()
            .zip(&ranges)
            .map(|((i, p), r)| {
                serde_json::json!({
                    "rank": i + 1,
                    "plan": p.plan.to_string(),
                    "config": p.plan,
                    "estimate": p.estimate,
                    "step_s_range": {
                        "overlapped": r.overlapped_s,
                        "no_overlap": r.no_overlap_s,
                    },
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": cfg,
            "cluster": args.cluster,
            "software": crate::stack_args::stack_text(&model.cluster),
            "devices": devices,
            "global_batch": args.batch,
            "ranked_by": if args.robust { "no_overlap" } else { "overlapped" },
            "stats": result.stats,
            "plans": plans,
            "explanations": comparisons,
            "overlap": args.explain.then(|| overlap_notes(&model, &result.plans, &ranges)),
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
    let stack = crate::stack_args::stack_text(&model.cluster);
    let mut out = header(&args, &cfg, (devices, &gpu, &stack), &result);
    out += &table(&result.plans, &ranges);
    out += &format!("\nbest plan: {}\n", best.plan);
    if !comparisons.is_empty() {
        out += "\nwhy it wins\n";
        for c in &comparisons {
            out += &format!("\n{c}");
        }
    }
    if args.explain {
        out += "\nwhat rests on overlap\n";
        for line in overlap_notes(&model, &result.plans, &ranges) {
            out += &format!("  {line}\n");
        }
    }
    super::print_stdout(&out)
}

/// A plan's predicted step at both ends: with the overlap its software profile counts on,
/// and with none.
struct Range {
    overlapped_s: f64,
    no_overlap_s: f64,
    /// MFU at each end.
    overlapped_mfu: f64,
    no_overlap_mfu: f64,
}

impl Range {
    /// The range of `p`, which the search estimated under the pessimistic model
    /// ([`CostModel::pessimistic`]: the slower end) when `robust`, under the profile's
    /// otherwise; both ends are the two models' own.
    fn of(
        model: &CostModel,
        no_overlap: &CostModel,
        cfg: &TransformerConfig,
        p: &RankedPlan,
        robust: bool,
    ) -> Result<Range> {
        let estimate = |m: &CostModel, what: &str| {
            m.estimate(cfg, &p.plan)
                .with_context(|| format!("estimating {} {what}", p.plan))
        };
        let overlapped = match robust {
            true => estimate(model, "with the profile's overlap")?,
            false => p.estimate.clone(),
        };
        let none = estimate(no_overlap, "without overlap")?;
        Ok(Range {
            overlapped_s: overlapped.iter_time_s,
            no_overlap_s: none.iter_time_s,
            overlapped_mfu: overlapped.mfu,
            no_overlap_mfu: none.mfu,
        })
    }
}

/// What `--explain` adds: how much of the best plan's lead over the runner-up depends on
/// overlap, and, where the best plan's predicted MFU is above the highest published on its
/// GPU generation in 16-bit training, the mechanisms the prediction rests on.
fn overlap_notes(model: &CostModel, plans: &[RankedPlan], ranges: &[Range]) -> Vec<String> {
    let mut out = Vec::new();
    let (Some(best), Some(rb)) = (plans.first(), ranges.first()) else {
        return out;
    };
    let hides = rb.no_overlap_s - rb.overlapped_s;
    out.push(format!(
        "best plan: {:.3} s per step with the profile's overlap ({:.1}% MFU), {:.3} s without \
         any ({:.1}% MFU): {}",
        rb.overlapped_s,
        100.0 * rb.overlapped_mfu,
        rb.no_overlap_s,
        100.0 * rb.no_overlap_mfu,
        match hides >= 0.0 {
            true => format!("overlap hides {hides:.3} s"),
            // Transformer Engine's userbuffers split each GEMM a collective feeds or follows;
            // small GEMMs lose more to the split than the collective costs.
            false => format!(
                "overlap costs {:.3} s: the GEMMs split to pipeline the tensor-parallel \
                 collectives lose more than the collectives take",
                -hides
            ),
        }
    ));
    if let (Some(_), Some(r2)) = (plans.get(1), ranges.get(1)) {
        let lead = r2.overlapped_s - rb.overlapped_s;
        let lead_none = r2.no_overlap_s - rb.no_overlap_s;
        let dependent = lead - lead_none;
        let verdict = if lead_none < 0.0 {
            format!(
                "without overlap the runner-up is faster by {:.3} s: all of the lead depends on \
                 overlap",
                -lead_none
            )
        } else if lead > 0.0 && dependent > 0.0 {
            format!(
                "{dependent:.3} s of it ({:.0}%) depends on overlap; {lead_none:.3} s remains \
                 without any",
                100.0 * dependent / lead
            )
        } else {
            format!("none of it depends on overlap: without any the lead is {lead_none:.3} s")
        };
        out.push(format!(
            "lead over the runner-up: {lead:.3} s per step with the profile's overlap; {verdict}"
        ));
    }
    let cluster = &model.cluster;
    let sixteen_bit = matches!(best.plan.dtype, DType::BF16 | DType::F16) && !best.plan.fp8;
    if let (true, Some(ceiling)) = (sixteen_bit, cluster.gpu.arch.published_mfu_ceiling()) {
        // The prediction with the profile's overlap (under --robust, not the ranked one).
        let mfu = rb.overlapped_mfu;
        if mfu > ceiling {
            let sw = &model.software;
            let dtype = best.plan.dtype;
            let ceiling_flops = cluster
                .gemm_ceiling_flops(dtype, false, model.compute.gemm_ceiling_default)
                .unwrap_or(0.0);
            let mut why = vec![format!(
                "dense GEMMs at {:.0}% of the {}'s measured matmul maximum ({:.0}% of peak)",
                100.0 * model.compute.sustained_fraction(cluster),
                cluster.gpu.model,
                100.0 * model.compute.sustained_fraction(cluster) * ceiling_flops
                    / cluster.peak_flops(dtype)
            )];
            if rb.no_overlap_s > rb.overlapped_s {
                why.push(format!(
                    "{:.3} s of communication hidden under computation (at none, {:.1}% MFU)",
                    rb.no_overlap_s - rb.overlapped_s,
                    100.0 * rb.no_overlap_mfu
                ));
            }
            why.push(format!("attention by the `{}` kernel", sw.attention.name()));
            if best.plan.recompute == autopar_cost_model::Recompute::None {
                why.push(format!(
                    "no recomputation ({:.1} GiB of activations kept per GPU)",
                    best.estimate.memory.activations / (1u64 << 30) as f64
                ));
            }
            out.push(format!(
                "predicted {:.1}% MFU is above {:.0}%, the highest published for 16-bit training \
                 on this GPU generation; it rests on {}",
                100.0 * mfu,
                100.0 * ceiling,
                why.join(", ")
            ));
        }
    }
    out
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
    (devices, gpu, stack): (usize, &str, &str),
    r: &SearchResult,
) -> String {
    let s = &r.stats;
    let mut out = format!(
        "model {} ({} layers, hidden {}, {} heads, seq {}) on {} ({devices} x {gpu}), global batch {}, \
         priced for the `{stack}` stack\n",
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

fn table(plans: &[RankedPlan], ranges: &[Range]) -> String {
    let mut out = format!(
        "{:>4} {:>5} {:>3} {:>3} {:>3} {:>3} {:>3} {:>4} {:>4} {:<9} {:<3} {:<6} {:<11} {:<14} {:>8} {:>17} {:>10} {:>7} {:>7} {:>6} {:>7}\n",
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
        "range (no overlap)",
        "tokens/s",
        "TFLOP/s",
        "hw TF/s",
        "MFU",
        "mem GiB"
    );
    for (i, (p, r)) in plans.iter().zip(ranges).enumerate() {
        let (plan, e) = (&p.plan, &p.estimate);
        out += &format!(
            "{:>4} {:>5} {:>3} {:>3} {:>3} {:>3} {:>3} {:>4} {:>4} {:<9} {:<3} {:<6} {:<11} {:<14} {:>8.3} {:>17} {:>10.0} {:>7.1} {:>7.1} {:>5.1}% {:>7.1}\n",
            i + 1,
            plan.dp,
            plan.tp,
            plan.pp,
            plan.vpp,
            plan.cp,
            plan.ep,
            plan.micro_batch_size,
            plan.zero_stage,
            plan.recompute_label(),
            if plan.sequence_parallel { "yes" } else { "no" },
            format!("{}-{}", plan.layer.attention_code(), plan.layer.mlp_code()),
            plan.schedule.name(),
            placed_axes(plan).join("-"),
            e.iter_time_s,
            format!("{:.3}-{:.3}", r.overlapped_s, r.no_overlap_s),
            e.tokens_per_s,
            e.model_tflops_per_gpu,
            e.hardware_tflops_per_gpu,
            100.0 * e.mfu,
            e.peak_memory_gib
        );
    }
    // What the columns do not show: CPU offload and expert tensor parallelism.
    for (i, p) in plans.iter().enumerate() {
        let mut extra = Vec::new();
        if p.plan.offload != autopar_cost_model::Offload::None {
            extra.push(format!(
                "offload={} ({:.1} GiB in host memory per rank)",
                p.plan.offload.name(),
                p.estimate.memory.host / f64::from(1u32 << 30)
            ));
        }
        if let Some(etp) = p.plan.etp {
            extra.push(format!("etp={etp}"));
        }
        if !extra.is_empty() {
            out += &format!("{:>4}: {}\n", i + 1, extra.join(", "));
        }
    }
    out
}
