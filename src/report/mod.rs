//! The HTML plan report of `autopar report` and `autopar run --report`: one self-contained
//! page (inline SVG and CSS, no script but an inert JSON data block) with the plan and the
//! ranked alternatives, the mesh on the machines, the simulated (and measured) pipeline
//! timeline, memory per pipeline rank, and where the step time goes. `svg` writes the
//! pictures, `topology`, `timeline` and `memory` lay them out; this module assembles the page.

pub mod memory;
pub mod svg;
pub mod timeline;
pub mod topology;

use std::fmt::Write as _;

use anyhow::{Context, Result};
use serde_json::json;

use autopar_cost_model::{Cluster, Estimate, Plan, TransformerConfig};
use autopar_driver::ir::schedule::{Schedule, Timeline};
use autopar_driver::search::placed_axes;

use svg::{Attrs, Svg, esc, num};
use timeline::{TailPhase, TimelineInput, category_colour};

const GIB: f64 = (1u64 << 30) as f64;

/// A plan with its estimate (a row of the plans table).
pub struct RankedRow {
    /// The plan.
    pub plan: Plan,
    /// Its estimate.
    pub estimate: Estimate,
}

/// What a run on CPU ranks measured.
pub struct Measured {
    /// The mesh of the run, as text.
    pub mesh: String,
    /// The schedule and the executed timeline (ns) of pipeline 0, for a pipelined run.
    pub pipeline: Option<(Schedule, Timeline)>,
    /// How many pipelines ran (one per coordinate of the axes other than `pp`).
    pub pipelines: usize,
    /// Per rank of the whole mesh: its label and its peak live bytes.
    pub rank_peaks: Vec<(String, u64)>,
    /// Per pipeline rank: the largest peak over the pipelines, in bytes.
    pub pipeline_rank_peaks: Vec<f64>,
    /// The losses of the steps that ran.
    pub losses: Vec<f64>,
}

/// Everything the page shows.
pub struct PageInput<'a> {
    /// The model argument.
    pub model: &'a str,
    /// Its shape.
    pub cfg: &'a TransformerConfig,
    /// The cluster argument.
    pub cluster_arg: &'a str,
    /// The cluster.
    pub cluster: &'a Cluster,
    /// The global batch.
    pub global_batch: usize,
    /// The plan shown (the best, or the one given).
    pub plan: &'a Plan,
    /// Its estimate.
    pub estimate: &'a Estimate,
    /// The plans table (the shown plan first).
    pub ranked: &'a [RankedRow],
    /// How the plan was chosen (a sentence).
    pub provenance: String,
    /// What a run measured, for `run --report`.
    pub measured: Option<Measured>,
}

/// The counts of what the page drew, also embedded in its data block for the tests.
#[derive(Default, serde::Serialize)]
struct Counts {
    gpus_drawn: usize,
    nodes_full: usize,
    nodes_summarised: usize,
    pipeline_ranks: usize,
    timeline_slices: usize,
    measured_pipeline_ranks: usize,
    memory_bars: usize,
}

/// The whole HTML page.
pub fn page(input: &PageInput) -> Result<String> {
    let plan = input.plan;
    let est = input.estimate;
    let mut counts = Counts::default();
    let mut body = String::new();

    // Heading and key figures.
    let _ = write!(
        body,
        "<h1>autopar plan report: {} on {}</h1>",
        esc(input.model),
        esc(input.cluster_arg)
    );
    let _ = write!(
        body,
        "<p class=\"sub\">{} layers, hidden {}, {} heads, sequence {}; {} nodes x {} {} ({} devices); \
         global batch {}; priced for the <code>{}</code> stack. {}</p>",
        input.cfg.layers,
        input.cfg.hidden,
        input.cfg.heads,
        input.cfg.seq,
        input.cluster.nodes,
        input.cluster.gpus_per_node,
        esc(&input.cluster.gpu.model),
        input.cluster.num_devices(),
        input.global_batch,
        esc(&crate::stack_args::stack_text(input.cluster)),
        esc(&input.provenance)
    );
    let _ = write!(
        body,
        "<p class=\"plan\"><code>{}</code></p>",
        esc(&plan.to_string())
    );
    let bubble_fraction = if est.time.pipeline_s > 0.0 {
        est.time.bubble_s / est.time.pipeline_s
    } else {
        0.0
    };
    body += "<div class=\"figures\">";
    for (what, value) in [
        ("step time", format!("{:.3} s", est.iter_time_s)),
        ("tokens/s", format!("{:.0}", est.tokens_per_s)),
        ("MFU", format!("{:.1}%", 100.0 * est.mfu)),
        (
            "model TFLOP/s/GPU",
            format!("{:.1}", est.model_tflops_per_gpu),
        ),
        (
            "peak memory",
            format!(
                "{} of {:.1} GiB{}",
                gib_text(est.peak_memory_gib),
                est.memory.capacity / GIB,
                if est.fits { "" } else { " (does not fit)" }
            ),
        ),
        (
            "pipeline bubble",
            format!("{:.1}%", 100.0 * bubble_fraction),
        ),
    ] {
        let _ = write!(
            body,
            "<div class=\"figure\"><div class=\"v\">{}</div><div class=\"k\">{}</div></div>",
            esc(&value),
            esc(what)
        );
    }
    body += "</div>";
    if let Some(why) = &est.fits_reason {
        let _ = write!(body, "<p class=\"warn\">{}</p>", esc(why));
    }

    // The plans table.
    body += "<h2 id=\"plans\">Plans</h2>";
    body += &plans_table(input.ranked);

    // Topology.
    body += "<h2 id=\"topology\">The mesh on the machines</h2>";
    let topo = topology::draw(input.cluster, plan)?;
    counts.gpus_drawn = topo.counts.gpus_drawn;
    counts.nodes_full = topo.counts.nodes_full;
    counts.nodes_summarised = topo.counts.nodes_summarised;
    body += &topo.legend;
    let _ = write!(body, "<div class=\"pic\">{}</div>", topo.svg);

    // Timeline.
    body += "<h2 id=\"timeline\">Pipeline timeline (simulated step)</h2>";
    let schedule = Schedule::new(plan.schedule, plan.pp, plan.vpp, plan.micro_batches())
        .with_context(|| format!("the schedule of plan `{plan}`"))?;
    let tail = tail_phases(est);
    match &est.timeline {
        Some(tl) => {
            let labels: Vec<String> = (0..plan.pp).map(|r| format!("pipeline rank {r}")).collect();
            let pic = timeline::draw(&TimelineInput {
                class: "timeline-predicted",
                schedule: &schedule,
                timeline: tl,
                tail,
                row_labels: labels,
                caption: format!(
                    "{} schedule, {} micro-batches, vpp={}: pipeline {:.3} s, bubbles and \
                     transfer waits {:.3} s = {:.1}% of the pipeline; step {:.3} s",
                    plan.schedule,
                    plan.micro_batches(),
                    plan.vpp,
                    est.time.pipeline_s,
                    est.time.bubble_s,
                    100.0 * bubble_fraction,
                    est.iter_time_s
                ),
                window: None,
            });
            counts.pipeline_ranks = pic.ranks;
            counts.timeline_slices = pic.slices;
            let _ = write!(
                body,
                "<p>Each row is a pipeline rank (all ranks sharing a pipeline coordinate run the \
                 same row); time runs left to right over the whole step, the phases after the \
                 last backward included. Bubble fraction: <b>{:.1}%</b>.</p><div class=\"pic\">{}</div>",
                100.0 * bubble_fraction,
                pic.svg
            );
            body += &zooms(plan, est, &schedule, tl);
        }
        None => {
            body += "<p class=\"warn\">The plan is infeasible: there is no simulated schedule.</p>"
        }
    }
    if let Some(m) = &input.measured {
        body += &measured_section(m, &mut counts);
    }

    // Memory.
    body += "<h2 id=\"memory\">Memory per pipeline rank</h2>";
    let labels: Vec<String> = (0..est.memory_per_pipeline_rank.len())
        .map(|r| format!("pp rank {r}"))
        .collect();
    let measured_peaks = input
        .measured
        .as_ref()
        .map(|m| m.pipeline_rank_peaks.as_slice())
        .filter(|p| !p.is_empty());
    let mem = memory::draw(
        &est.memory_per_pipeline_rank,
        &labels,
        est.memory.capacity,
        measured_peaks,
    );
    counts.memory_bars = mem.bars;
    let _ = write!(
        body,
        "<p>What each pipeline rank holds at its peak, against the {} GiB of a {}; the fullest \
         is pipeline rank {} with {}.</p><div class=\"pic\">{}</div>",
        num(est.memory.capacity / GIB),
        esc(&input.cluster.gpu.model),
        est.memory.pipeline_rank,
        gib_text(est.peak_memory_gib),
        mem.svg
    );
    if let Some(m) = &input.measured
        && m.pipeline.is_none()
    {
        body += &spmd_memory_table(m, est);
    }

    // Where the time goes.
    body += "<h2 id=\"time\">Where the time goes</h2>";
    body += &time_terms(est);
    body += &collectives_table(input, est);

    // The data block.
    let data = json!({
        "model": input.model,
        "cluster": input.cluster_arg,
        "devices": input.cluster.num_devices(),
        "global_batch": input.global_batch,
        "software": crate::stack_args::stack_text(input.cluster),
        "plan": plan.to_string(),
        "config": plan,
        "iter_time_s": est.iter_time_s,
        "tokens_per_s": est.tokens_per_s,
        "mfu": est.mfu,
        "model_tflops_per_gpu": est.model_tflops_per_gpu,
        "peak_memory_gib": est.peak_memory_gib,
        "bubble_fraction": bubble_fraction,
        "time": est.time,
        "memory_per_pipeline_rank": est.memory_per_pipeline_rank,
        "plans": input.ranked.iter().enumerate().map(|(i, r)| json!({
            "rank": i + 1,
            "plan": r.plan.to_string(),
            "iter_time_s": r.estimate.iter_time_s,
            "tokens_per_s": r.estimate.tokens_per_s,
            "mfu": r.estimate.mfu,
            "peak_memory_gib": r.estimate.peak_memory_gib,
        })).collect::<Vec<_>>(),
        "measured": input.measured.as_ref().map(|m| json!({
            "mesh": m.mesh,
            "pipelines": m.pipelines,
            "rank_peak_bytes": m.rank_peaks.iter().map(|r| r.1).collect::<Vec<_>>(),
            "losses": m.losses,
        })),
        "counts": counts,
    });
    let data = serde_json::to_string(&data)?.replace("</", "<\\/");
    Ok(format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>autopar report: {}</title>\
         <style>{CSS}</style></head><body>{body}\
         <script type=\"application/json\" id=\"report-data\">{data}</script></body></html>\n",
        esc(input.model)
    ))
}

/// `33.5 GiB`, or `2.0 MiB` below a GiB.
fn gib_text(gib: f64) -> String {
    if gib >= 1.0 {
        format!("{gib:.1} GiB")
    } else {
        format!("{:.1} MiB", gib * 1024.0)
    }
}

/// With many micro-batches per pipeline rank the bubbles are slivers of the whole step: the
/// warm-up and the cool-down drawn again, zoomed.
fn zooms(plan: &Plan, est: &Estimate, schedule: &Schedule, tl: &Timeline) -> String {
    let m = plan.micro_batches();
    if plan.pp < 2 || m <= 2 * plan.pp {
        return String::new();
    }
    let pipeline_ns = tl.makespan as f64;
    let total_ns = est.iter_time_s * 1e9;
    let f = (2.5 * plan.pp as f64 / m as f64).min(0.5);
    let mut out = String::from("<div class=\"zooms\">");
    for (what, window) in [
        ("warm-up", (0.0, f * pipeline_ns)),
        (
            "cool-down and the step's end",
            ((1.0 - f) * pipeline_ns, total_ns),
        ),
    ] {
        let pic = timeline::draw(&TimelineInput {
            class: "timeline-zoom",
            schedule,
            timeline: tl,
            tail: tail_phases(est),
            row_labels: (0..plan.pp).map(|r| format!("pipeline rank {r}")).collect(),
            caption: format!(
                "zoom on the {what}: {:.3} s to {:.3} s",
                window.0 / 1e9,
                window.1 / 1e9
            ),
            window: Some(window),
        });
        out += &format!("<div class=\"pic\">{}</div>", pic.svg);
    }
    out + "</div>"
}

/// The phases after the pipeline, as the estimate prices them.
fn tail_phases(est: &Estimate) -> Vec<TailPhase> {
    let t = &est.time;
    vec![
        TailPhase {
            label: "gradient reduction, exposed".into(),
            category: "grad-reduce",
            seconds: t.grad_reduce_exposed_s,
        },
        TailPhase {
            label: "embedding gradient sync".into(),
            category: "embedding-sync",
            seconds: t.embedding_sync_s,
        },
        TailPhase {
            label: "optimizer".into(),
            category: "optimizer",
            seconds: t.optimizer_s,
        },
        TailPhase {
            label: "parameter all-gather (ZeRO)".into(),
            category: "param-gather",
            seconds: t.param_gather_s,
        },
    ]
}

fn plans_table(rows: &[RankedRow]) -> String {
    let mut out = String::from(
        "<table class=\"plans\"><thead><tr><th>#</th><th>dp</th><th>tp</th><th>pp</th><th>vpp</th>\
         <th>cp</th><th>ep</th><th>mbs</th><th>zero</th><th>recompute</th><th>sp</th><th>tp ops</th>\
         <th>schedule</th><th>placement</th><th>step s</th><th>tokens/s</th><th>TFLOP/s</th>\
         <th>MFU</th><th>mem GiB</th></tr></thead><tbody>",
    );
    for (i, r) in rows.iter().enumerate() {
        let (p, e) = (&r.plan, &r.estimate);
        let _ = write!(
            out,
            "<tr class=\"plan-row\" data-rank=\"{}\" data-plan=\"{}\" data-iter-time-s=\"{}\" \
             data-tokens-per-s=\"{}\" data-mfu=\"{}\" data-peak-memory-gib=\"{}\" title=\"{}\">\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}-{}</td><td>{}</td><td>{}</td><td>{:.3}</td>\
             <td>{:.0}</td><td>{:.1}</td><td>{:.1}%</td><td>{:.1}</td></tr>",
            i + 1,
            esc(&p.to_string()),
            e.iter_time_s,
            e.tokens_per_s,
            e.mfu,
            e.peak_memory_gib,
            esc(&p.to_string()),
            i + 1,
            p.dp,
            p.tp,
            p.pp,
            p.vpp,
            p.cp,
            p.ep,
            p.micro_batch_size,
            p.zero_stage,
            p.recompute_label(),
            if p.sequence_parallel { "yes" } else { "no" },
            p.layer.attention_code(),
            p.layer.mlp_code(),
            p.schedule.name(),
            placed_axes(p).join("-"),
            e.iter_time_s,
            e.tokens_per_s,
            e.model_tflops_per_gpu,
            100.0 * e.mfu,
            e.peak_memory_gib
        );
    }
    out + "</tbody></table>"
}

/// A horizontal stacked bar of `(label, colour, seconds)` terms, with its legend.
fn stacked_bar(class: &str, caption: &str, terms: &[(String, &str, f64)]) -> String {
    let total: f64 = terms.iter().map(|t| t.2.max(0.0)).sum();
    let width = 1000.0;
    let mut svg = Svg::new(width + 20.0, 40.0, Attrs::new().s("class", class));
    svg.text(
        Attrs::new().n("x", 0.0).n("y", 12.0).s("class", "caption"),
        caption,
    );
    let mut x = 0.0;
    for (label, colour, s) in terms {
        if *s <= 0.0 || total <= 0.0 {
            continue;
        }
        let w = s / total * width;
        svg.leaf_titled(
            "rect",
            Attrs::new()
                .n("x", x)
                .n("y", 18.0)
                .n("width", w)
                .n("height", 20.0)
                .s("class", "term")
                .s("fill", *colour),
            &format!("{label}: {} ms ({:.1}%)", num(s * 1e3), 100.0 * s / total),
        );
        if w > 60.0 {
            svg.text(
                Attrs::new()
                    .n("x", x + 4.0)
                    .n("y", 32.0)
                    .s("class", "term-label"),
                &format!("{:.0}%", 100.0 * s / total),
            );
        }
        x += w;
    }
    let mut out = format!(
        "<div class=\"pic\">{}</div><ul class=\"legend\">",
        svg.finish()
    );
    for (label, colour, s) in terms {
        let _ = write!(
            out,
            "<li><span class=\"swatch\" style=\"background:{colour}\"></span>{}: {} ms ({:.1}%)</li>",
            esc(label),
            num(s * 1e3),
            if total > 0.0 { 100.0 * s / total } else { 0.0 }
        );
    }
    out + "</ul>"
}

fn time_terms(est: &Estimate) -> String {
    let t = &est.time;
    let step_terms = vec![
        (
            "busiest pipeline rank's forward and backward".to_string(),
            category_colour("forward"),
            t.busiest_rank_compute_s,
        ),
        (
            "pipeline bubbles and transfer waits".into(),
            "#bdbdbd",
            t.bubble_s,
        ),
        (
            "data-parallel gradient reduction, exposed".into(),
            category_colour("grad-reduce"),
            t.grad_reduce_exposed_s,
        ),
        (
            "embedding gradient sync".into(),
            category_colour("embedding-sync"),
            t.embedding_sync_s,
        ),
        (
            "optimizer".into(),
            category_colour("optimizer"),
            t.optimizer_s,
        ),
        (
            "parameter all-gather (ZeRO)".into(),
            category_colour("param-gather"),
            t.param_gather_s,
        ),
    ];
    let sum: f64 = step_terms.iter().map(|x| x.2).sum();
    let mut out = stacked_bar(
        "time-step",
        &format!(
            "one step: {:.3} s (the terms add to {:.3} s: the pipeline's end and the exposed \
             reduction are each the worst rank's)",
            est.iter_time_s, sum
        ),
        &step_terms,
    );
    let (f, b) = (&t.layer_forward, &t.layer_backward);
    let layer_terms = vec![
        ("dense GEMMs".to_string(), "#4e79a7", f.gemm_s + b.gemm_s),
        (
            "attention core".into(),
            "#a0cbe8",
            f.attention_s + b.attention_s,
        ),
        (
            "memory-bound kernels".into(),
            "#edc948",
            f.memory_s + b.memory_s,
        ),
        ("recompute".into(), "#ff9d9a", f.recompute_s + b.recompute_s),
        (
            "tensor-parallel communication, exposed".into(),
            "#d62728",
            f.exposed_by.tp_s + b.exposed_by.tp_s,
        ),
        (
            "context-parallel communication, exposed".into(),
            "#9467bd",
            f.exposed_by.cp_s + b.exposed_by.cp_s,
        ),
        (
            "expert-parallel communication, exposed".into(),
            "#ff7f0e",
            f.exposed_by.ep_s + b.exposed_by.ep_s,
        ),
        (
            "ZeRO communication, exposed".into(),
            "#2ca02c",
            f.exposed_by.zero_s + b.exposed_by.zero_s,
        ),
    ];
    out += &stacked_bar(
        "time-layer",
        &format!(
            "one layer, one micro-batch, forward + backward: {:.3} ms",
            (f.total_s() + b.total_s()) * 1e3
        ),
        &layer_terms,
    );
    out
}

fn collectives_table(input: &PageInput, est: &Estimate) -> String {
    let plan = input.plan;
    let group = |axes: &str| -> String {
        let names: Vec<String> = axes.split(',').map(str::to_string).collect();
        let mapping = autopar_cost_model::MeshMapping::new(&plan.mesh_axes(), input.cluster);
        match mapping.ok().and_then(|m| m.group(&names).ok()) {
            Some(g) if g.intra_node() => format!("{axes} ({} GPUs, inside a node)", g.size),
            Some(g) => format!("{axes} ({} GPUs over {} nodes)", g.size, g.nodes_spanned),
            None => axes.to_string(),
        }
    };
    let mut out = String::from(
        "<h3>Collectives</h3><table class=\"collectives\"><thead><tr><th>when</th><th>kind</th>\
         <th>group</th><th>MB</th><th>ms</th><th>why</th></tr></thead><tbody>",
    );
    let tp_group = group("tp");
    for c in &est.layer_tp_collectives {
        let t = &c.collective;
        let _ = write!(
            out,
            "<tr class=\"coll-row\"><td>each layer and micro-batch, {}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{:.3}</td><td>{}</td></tr>",
            match t.pass {
                autopar_cost_model::layer::Pass::Forward => "forward",
                autopar_cost_model::layer::Pass::Backward => "backward",
            },
            t.kind.name(),
            esc(&tp_group),
            if c.bytes >= 1e7 {
                format!("{:.1}", c.bytes / 1e6)
            } else {
                format!("{:.3}", c.bytes / 1e6)
            },
            c.time_s * 1e3,
            esc(&t.why)
        );
    }
    let t = &est.time;
    let reduce_kind = if plan.zero_stage == 0 {
        "all-reduce"
    } else {
        "reduce-scatter"
    };
    let dp_axes = if plan.cp > 1 { "dp,cp" } else { "dp" };
    let mut steps: Vec<(String, String, String, f64, String)> = Vec::new();
    if plan.dp * plan.cp > 1 {
        steps.push((
            "each step, with the last backwards".into(),
            reduce_kind.into(),
            group(dp_axes),
            t.grad_reduce_s,
            format!(
                "the gradients summed over the data-parallel ranks ({:.3} s of it exposed after \
                 the last backward)",
                t.grad_reduce_exposed_s
            ),
        ));
    }
    if t.embedding_sync_s > 0.0 {
        steps.push((
            "each step".into(),
            "all-reduce".into(),
            "first and last pp stage".into(),
            t.embedding_sync_s,
            "the tied embedding's gradient added between the stages that use it".into(),
        ));
    }
    if t.param_gather_s > 0.0 {
        steps.push((
            "each step, after the optimizer".into(),
            "all-gather".into(),
            group("dp"),
            t.param_gather_s,
            "ZeRO: every rank gathers the parameters the others updated".into(),
        ));
    }
    if plan.pp > 1 {
        steps.push((
            "each micro-batch and stage boundary".into(),
            "send/recv".into(),
            group("pp"),
            t.p2p_s,
            "activations forward and their gradients backward between neighbouring stages".into(),
        ));
    }
    for (when, kind, group, s, why) in steps {
        let _ = write!(
            out,
            "<tr class=\"coll-row\"><td>{}</td><td>{}</td><td>{}</td><td>-</td><td>{:.3}</td>\
             <td>{}</td></tr>",
            esc(&when),
            esc(&kind),
            esc(&group),
            s * 1e3,
            esc(&why)
        );
    }
    out += "</tbody></table>";
    if est.layer_tp_collectives.is_empty() {
        out += "<p>No tensor-parallel collectives: the plan has tp=1.</p>";
    }
    out
}

fn measured_section(m: &Measured, counts: &mut Counts) -> String {
    let mut out = format!(
        "<h2 id=\"measured\">Measured on CPU ranks</h2><p>The run on the mesh <code>{}</code>: {} step(s), last \
         loss {}.</p>",
        esc(&m.mesh),
        m.losses.len(),
        m.losses
            .last()
            .map_or("-".to_string(), |l| format!("{l:.6}"))
    );
    match &m.pipeline {
        Some((schedule, tl)) => {
            let labels: Vec<String> = (0..schedule.pp)
                .map(|r| format!("pipeline rank {r}"))
                .collect();
            let busy: Vec<u64> = tl
                .spans
                .iter()
                .zip(&schedule.per_rank)
                .map(|(spans, actions)| {
                    spans
                        .iter()
                        .zip(actions)
                        .filter(|(_, a)| {
                            matches!(
                                a,
                                autopar_driver::ir::schedule::Action::Forward { .. }
                                    | autopar_driver::ir::schedule::Action::Backward { .. }
                            )
                        })
                        .map(|(s, _)| s.1.saturating_sub(s.0))
                        .sum()
                })
                .collect();
            let busiest = busy.iter().copied().max().unwrap_or(0) as f64;
            let make = tl.makespan.max(1) as f64;
            let pic = timeline::draw(&TimelineInput {
                class: "timeline-measured",
                schedule,
                timeline: tl,
                tail: Vec::new(),
                row_labels: labels,
                caption: format!(
                    "measured (pipeline 0 of {}): {:.3} ms, busiest rank computing {:.1}% of it, \
                     idle or waiting {:.1}%",
                    m.pipelines,
                    make / 1e6,
                    100.0 * busiest / make,
                    100.0 * (1.0 - busiest / make)
                ),
                window: None,
            });
            counts.measured_pipeline_ranks = pic.ranks;
            let _ = write!(
                out,
                "<p>The executed last step beside the prediction above: the same schedule, each \
                 row scaled to its own step time (the CPU interpreter is not the cost model's \
                 hardware, so compare shapes, not lengths).</p><div class=\"pic\">{}</div>",
                pic.svg
            );
        }
        None => {
            out += "<p>The run had no pipeline (no <code>pp</code> axis above 1), so there is no \
                    measured timeline: the memory table below compares each rank's measured peak \
                    with the prediction.</p>";
        }
    }
    out
}

fn spmd_memory_table(m: &Measured, est: &Estimate) -> String {
    let predicted = est.memory.total;
    let mut out = String::from(
        "<table class=\"spmd-memory\"><thead><tr><th>rank</th><th>measured peak MiB</th>\
         <th>predicted MiB</th><th>measured / predicted</th></tr></thead><tbody>",
    );
    let mib = (1u64 << 20) as f64;
    for (label, peak) in &m.rank_peaks {
        let _ = write!(
            out,
            "<tr class=\"rank-row\"><td>{}</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td></tr>",
            esc(label),
            *peak as f64 / mib,
            predicted / mib,
            if predicted > 0.0 {
                *peak as f64 / predicted
            } else {
                0.0
            }
        );
    }
    out + "</tbody></table>"
}

const CSS: &str = "\
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}\
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}h3{font-size:15px}\
.sub{color:#555;margin:0 0 6px}.plan code{font-size:13px;background:#f4f4f4;padding:2px 6px}\
.figures{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}.figure{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:120px}\
.figure .v{font-size:20px;font-weight:600}.figure .k{color:#666;font-size:12px}\
.warn{color:#b00020}table{border-collapse:collapse;font-size:12px;margin:6px 0}\
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}th{background:#f4f4f4}\
td:last-child{text-align:left}.plans tr:first-child td{font-weight:600}\
.collectives td{text-align:left}.pic{overflow-x:auto}\
.legend{list-style:none;padding:0;font-size:13px}.legend li{margin:2px 0}\
.swatch{display:inline-block;width:11px;height:11px;margin-right:6px;vertical-align:middle;border-radius:2px}\
svg{max-width:100%;height:auto}svg text{font-family:inherit}.node-box{fill:#fbfbfb;stroke:#888}.node-title{font-size:12px;font-weight:600}\
.gpu{stroke:#555}.gpu-name{font-size:11px;font-weight:600}.gpu-coord{font-size:10.5px}\
.switch{fill:#e3ecf7;stroke:#7a9cc6}.nic{fill:#efe6d8;stroke:#b8a078}.nic-label{font-size:9px}\
.network{fill:#efe6d8;stroke:#b8a078}.link-label{font-size:10.5px}\
.link-nvlink{stroke:#7a9cc6;stroke-width:1.5}.link-net{stroke:#b8a078;stroke-width:2}\
.group-outline{fill:none;stroke-width:2.5}.group-arc{fill:none;stroke-width:2;opacity:.85}\
.group-path{fill:none;stroke-width:2.5;stroke-dasharray:6 3;opacity:.9}\
.node-cell{stroke:#666;stroke-width:.5}.idle{fill:#e8e8e8}\
.slice.forward{fill:#4e79a7}.slice.backward{fill:#f28e2b}.slice.wait{fill:#e15759}.slice.optimizer{fill:#b07aa1}\
.lane{fill:none}.lane.forward{stroke:#4e79a7}.lane.backward{stroke:#f28e2b}.lane.wait{stroke:#e15759}.lane.optimizer{stroke:#b07aa1}\
.slice.grad-reduce{fill:#59a14f}.slice.embedding-sync{fill:#76b7b2}.slice.param-gather{fill:#edc948}\
.row-label,.tick{font-size:11px}.caption{font-size:12px;font-weight:600}.axis{stroke:#555}\
.grid{stroke:#eee}.capacity{stroke:#b00020;stroke-width:1.5;stroke-dasharray:5 3}\
.measured-peak{fill:#000}.term{stroke:#fff;stroke-width:.5}.term-label{font-size:11px;fill:#fff}\
@media print{body{margin:8mm}.pic{overflow:visible}h2{break-after:avoid}}";
