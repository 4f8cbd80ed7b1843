//! Explanations: a step's predicted time split into terms (GEMMs, attention, memory-bound
//! kernels, exposed layer collectives by parallelism (tensor, context, expert, ZeRO), recomputation, bubbles, data-parallel reduction,
//! optimizer, ...) on the critical path, and the term-by-term comparison of two plans that
//! says which term decides and by how much. Also a named reference configuration, built by
//! Megatron-LM's published rules of thumb, to compare the search's best plan against.

use std::fmt;

use serde::{Deserialize, Serialize};

use autopar_cost_model::estimate::{rank_layers, stage_layers};
use autopar_cost_model::{
    CostModel, Estimate, LayerPlacement, Offload, Plan, Recompute, TransformerConfig,
};
use autopar_ir::axis;
use autopar_ir::schedule::ScheduleKind;

use crate::search::SearchOptions;

/// A term of the step time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Term {
    /// Dense GEMMs of the transformer layers (projections, MLP).
    Gemm,
    /// Attention cores.
    Attention,
    /// Memory-bound kernels of the layers (norms, activations, residuals).
    MemoryBound,
    /// Tensor-parallel collectives inside the layers (with sequence parallelism, the
    /// all-gathers and reduce-scatters), the part not hidden under computation.
    TensorParallelCommunication,
    /// Context parallelism's key/value exchange, the part not hidden under attention.
    ContextParallelCommunication,
    /// Expert parallelism's dispatch and combine all-to-alls.
    ExpertParallelCommunication,
    /// ZeRO's per-layer traffic (ZeRO-3 weight gathers, ZeRO-2/3 gradient reduce-scatters),
    /// the part not hidden under computation.
    ZeroCommunication,
    /// Forward work recomputed in the backward.
    Recompute,
    /// Embedding, final norm, logits and loss.
    EmbeddingAndHead,
    /// Pipeline bubbles and waits for stage-to-stage transfers.
    PipelineBubbles,
    /// Data-parallel gradient reduction left after the last backward.
    DataParallelReduction,
    /// All-reduce of the tied embedding gradient between the first and last stage.
    EmbeddingSync,
    /// Optimizer update.
    Optimizer,
    /// All-gather of updated parameters (ZeRO-1/2).
    ParameterGather,
    /// What the per-rank terms miss when the rank with the longest pipeline is not the one
    /// with the longest exposed reduction (never positive).
    RankSkew,
}

impl Term {
    /// Every term, in report order.
    pub const ALL: [Term; 15] = [
        Term::Gemm,
        Term::Attention,
        Term::MemoryBound,
        Term::TensorParallelCommunication,
        Term::ContextParallelCommunication,
        Term::ExpertParallelCommunication,
        Term::ZeroCommunication,
        Term::Recompute,
        Term::EmbeddingAndHead,
        Term::PipelineBubbles,
        Term::DataParallelReduction,
        Term::EmbeddingSync,
        Term::Optimizer,
        Term::ParameterGather,
        Term::RankSkew,
    ];

    /// Words for reports.
    pub fn name(self) -> &'static str {
        match self {
            Term::Gemm => "dense GEMMs",
            Term::Attention => "attention",
            Term::MemoryBound => "memory-bound kernels",
            Term::TensorParallelCommunication => "exposed tensor-parallel communication",
            Term::ContextParallelCommunication => "exposed context-parallel communication",
            Term::ExpertParallelCommunication => "exposed expert-parallel all-to-all",
            Term::ZeroCommunication => "exposed ZeRO gathers and reduce-scatters",
            Term::Recompute => "recomputation",
            Term::EmbeddingAndHead => "embedding and head",
            Term::PipelineBubbles => "pipeline bubbles and transfers",
            Term::DataParallelReduction => "exposed data-parallel gradient reduction",
            Term::EmbeddingSync => "embedding gradient sync",
            Term::Optimizer => "optimizer step",
            Term::ParameterGather => "ZeRO parameter all-gather",
            Term::RankSkew => "rank skew",
        }
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The step time of `estimate` split into [`Term::ALL`], in seconds; the terms add up to
/// `iter_time_s`.
///
/// The compute terms are those of the busiest pipeline rank (the one with the most forward
/// and backward work): its layers times the micro-batches times the per-layer forward and
/// backward breakdown; what its stages do beyond its layers is the embedding and head. The
/// step is that rank's work, plus bubbles, plus the step-level terms of the estimate.
pub fn time_terms(cfg: &TransformerConfig, plan: &Plan, estimate: &Estimate) -> Vec<(Term, f64)> {
    let t = &estimate.time;
    let pp = plan.pp.max(1);
    let m = estimate.micro_batches as f64;
    let layers = stage_layers(cfg, plan);
    let stage = |v: usize| {
        t.stage_forward_s.get(v).copied().unwrap_or(0.0)
            + t.stage_backward_s.get(v).copied().unwrap_or(0.0)
    };
    // The busiest rank, and how many layers it runs.
    let (mut busiest_work, mut busiest_layers) = (f64::NEG_INFINITY, 0usize);
    for r in 0..pp {
        let work: f64 = (0..plan.vpp).map(|c| stage(c * pp + r)).sum::<f64>() * m;
        if work > busiest_work {
            busiest_work = work;
            busiest_layers = rank_layers(&layers, pp, r);
        }
    }
    let (f, b) = (&t.layer_forward, &t.layer_backward);
    let per_layer = busiest_layers as f64 * m;
    let gemm = per_layer * (f.gemm_s + b.gemm_s);
    let attention = per_layer * (f.attention_s + b.attention_s);
    let memory = per_layer * (f.memory_s + b.memory_s);
    let comm = per_layer * (f.comm_exposed_s + b.comm_exposed_s);
    let (fe, be) = (&f.exposed_by, &b.exposed_by);
    let comm_terms = [
        (Term::TensorParallelCommunication, fe.tp_s + be.tp_s),
        (Term::ContextParallelCommunication, fe.cp_s + be.cp_s),
        (Term::ExpertParallelCommunication, fe.ep_s + be.ep_s),
        (Term::ZeroCommunication, fe.zero_s + be.zero_s),
    ]
    .map(|(term, s)| (term, per_layer * s));
    let recompute = per_layer * (f.recompute_s + b.recompute_s);
    let head = (t.busiest_rank_compute_s - gemm - attention - memory - comm - recompute).max(0.0);
    let mut terms = vec![
        (Term::Gemm, gemm),
        (Term::Attention, attention),
        (Term::MemoryBound, memory),
        comm_terms[0],
        comm_terms[1],
        comm_terms[2],
        comm_terms[3],
        (Term::Recompute, recompute),
        (Term::EmbeddingAndHead, head),
        (Term::PipelineBubbles, t.bubble_s),
        (Term::DataParallelReduction, t.grad_reduce_exposed_s),
        (Term::EmbeddingSync, t.embedding_sync_s),
        (Term::Optimizer, t.optimizer_s),
        (Term::ParameterGather, t.param_gather_s),
    ];
    let sum: f64 = terms.iter().map(|(_, v)| v).sum();
    terms.push((Term::RankSkew, estimate.iter_time_s - sum));
    terms
}

/// One term of two plans.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TermDelta {
    /// The term.
    pub term: Term,
    /// Seconds per step of the better plan.
    pub best_s: f64,
    /// Seconds per step of the other plan.
    pub other_s: f64,
}

/// Why one plan beats another, term by term.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// What the other plan is ("the runner-up", a reference's name).
    pub label: String,
    /// The better plan.
    pub best: Plan,
    /// The plan it is compared with.
    pub other: Plan,
    /// Step time of the better plan.
    pub best_iter_time_s: f64,
    /// Step time of the other plan.
    pub other_iter_time_s: f64,
    /// Whether the other plan fits in memory.
    pub other_fits: bool,
    /// Every term of both.
    pub terms: Vec<TermDelta>,
    /// The term with the largest saving (`other_s - best_s`).
    pub deciding: Term,
    /// Its saving in seconds per step.
    pub deciding_saving_s: f64,
    /// The term where the better plan loses most (`best_s - other_s > 0`), if any.
    pub largest_cost: Option<(Term, f64)>,
    /// How the plans differ, e.g. `pp 16 -> 8`.
    pub changes: Vec<String>,
}

impl Comparison {
    /// Compares `best` with `other` (labelled `label`).
    pub fn new(
        cfg: &TransformerConfig,
        label: &str,
        best: (&Plan, &Estimate),
        other: (&Plan, &Estimate),
    ) -> Comparison {
        let tb = time_terms(cfg, best.0, best.1);
        let to = time_terms(cfg, other.0, other.1);
        let terms: Vec<TermDelta> = tb
            .iter()
            .zip(&to)
            .map(|(&(term, best_s), &(_, other_s))| TermDelta {
                term,
                best_s,
                other_s,
            })
            .collect();
        // The first largest saving wins ties, in report order: deterministic.
        let mut deciding = (Term::Gemm, f64::NEG_INFINITY);
        let mut largest_cost: Option<(Term, f64)> = None;
        for d in &terms {
            let saving = d.other_s - d.best_s;
            if saving > deciding.1 {
                deciding = (d.term, saving);
            }
            if -saving > largest_cost.map_or(0.0, |c| c.1) {
                largest_cost = Some((d.term, -saving));
            }
        }
        Comparison {
            label: label.to_string(),
            best: best.0.clone(),
            other: other.0.clone(),
            best_iter_time_s: best.1.iter_time_s,
            other_iter_time_s: other.1.iter_time_s,
            other_fits: other.1.fits,
            terms,
            deciding: deciding.0,
            deciding_saving_s: deciding.1,
            largest_cost,
            changes: plan_changes(best.0, other.0),
        }
    }

    /// `other / best` step time.
    pub fn speedup(&self) -> f64 {
        self.other_iter_time_s / self.best_iter_time_s
    }

    /// One paragraph in words.
    pub fn summary(&self) -> String {
        let gap = self.other_iter_time_s - self.best_iter_time_s;
        let mut s = format!(
            "against {} ({}): ",
            self.label,
            if self.changes.is_empty() {
                "the same plan".to_string()
            } else {
                self.changes.join(", ")
            }
        );
        if !self.other_fits {
            s += "it does not fit in memory, so it cannot run; ";
        }
        if gap <= 0.0 {
            s += &format!(
                "no faster ({:.3} s vs {:.3} s per step).",
                self.best_iter_time_s, self.other_iter_time_s
            );
            return s;
        }
        s += &format!(
            "{:.3} s vs {:.3} s per step ({:.1}% faster). The deciding term is {}: {:.3} s \
             less per step, {:.0}% of the gap",
            self.best_iter_time_s,
            self.other_iter_time_s,
            100.0 * (self.speedup() - 1.0),
            self.deciding.name(),
            self.deciding_saving_s,
            100.0 * self.deciding_saving_s / gap
        );
        match self.largest_cost {
            Some((term, cost)) if cost > 1e-6 * self.best_iter_time_s => {
                s += &format!("; it pays {cost:.3} s more for {term}.");
            }
            _ => s += ".",
        }
        s
    }

    /// The terms as a table (seconds per step).
    pub fn table(&self) -> String {
        let mut out = format!(
            "  {:<42} {:>10} {:>10} {:>10}\n",
            "term (s per step)", "best", "other", "saving"
        );
        for d in &self.terms {
            if d.best_s.abs() < 1e-9 && d.other_s.abs() < 1e-9 {
                continue;
            }
            out += &format!(
                "  {:<42} {:>10.3} {:>10.3} {:>+10.3}\n",
                d.term.name(),
                d.best_s,
                d.other_s,
                d.other_s - d.best_s
            );
        }
        out += &format!(
            "  {:<42} {:>10.3} {:>10.3} {:>+10.3}\n",
            "step",
            self.best_iter_time_s,
            self.other_iter_time_s,
            self.other_iter_time_s - self.best_iter_time_s
        );
        out
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.summary())?;
        f.write_str(&self.table())
    }
}

/// The fields in which `best` differs from `other`, as `field other -> best`.
pub fn plan_changes(best: &Plan, other: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    let mut diff = |name: &str, b: String, o: String| {
        if b != o {
            out.push(format!("{name} {o} -> {b}"));
        }
    };
    diff(axis::DP, best.dp.to_string(), other.dp.to_string());
    diff(axis::TP, best.tp.to_string(), other.tp.to_string());
    diff(axis::PP, best.pp.to_string(), other.pp.to_string());
    diff("vpp", best.vpp.to_string(), other.vpp.to_string());
    diff(axis::CP, best.cp.to_string(), other.cp.to_string());
    diff(axis::EP, best.ep.to_string(), other.ep.to_string());
    diff(
        "mbs",
        best.micro_batch_size.to_string(),
        other.micro_batch_size.to_string(),
    );
    diff(
        "zero",
        best.zero_stage.to_string(),
        other.zero_stage.to_string(),
    );
    diff("recompute", best.recompute_label(), other.recompute_label());
    diff(
        "sp",
        best.sequence_parallel.to_string(),
        other.sequence_parallel.to_string(),
    );
    diff(
        "attn",
        best.layer.attention_code(),
        other.layer.attention_code(),
    );
    diff("mlp", best.layer.mlp_code(), other.layer.mlp_code());
    diff(
        "schedule",
        best.schedule.to_string(),
        other.schedule.to_string(),
    );
    // The placement only compares when both plans place the same axes.
    let (pb, po) = (placed_axes(best), placed_axes(other));
    let (mut sb, mut so) = (pb.clone(), po.clone());
    sb.sort();
    so.sort();
    if sb == so {
        diff("placement", pb.join("-"), po.join("-"));
    }
    diff("dtype", best.dtype.to_string(), other.dtype.to_string());
    out
}

/// The mesh axes larger than 1, outermost first (the ones whose order matters).
pub fn placed_axes(plan: &Plan) -> Vec<String> {
    plan.mesh_axes()
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(a, _)| a)
        .collect()
}

/// A reference configuration following Megatron-LM's published practice (Narayanan et al.,
/// SC'21): tensor parallelism over the GPUs of a node (the largest degree the heads allow),
/// experts spread over as many data-parallel ranks as they divide, the smallest pipeline depth
/// whose plan fits, full recomputation, micro-batch 1, and the interleaved schedule with two
/// chunks per rank where the layers allow it. Returns its name and plan, or `None` when no
/// such plan fits.
pub fn megatron_reference(
    model: &CostModel,
    cfg: &TransformerConfig,
    opts: &SearchOptions,
) -> Option<(String, Plan)> {
    let devices = model.cluster.num_devices();
    let per_node = model.cluster.gpus_per_node.max(1);
    let tp = (1..=per_node.min(devices))
        .rev()
        .find(|&t| devices.is_multiple_of(t) && cfg.tp_split_error(t).is_none())
        .unwrap_or(1);
    for pp in 1..=cfg.layers.min(devices / tp) {
        if !(devices / tp).is_multiple_of(pp) || !cfg.layers.is_multiple_of(pp) {
            continue;
        }
        let dp = devices / (tp * pp);
        if !opts.global_batch.is_multiple_of(dp) {
            continue;
        }
        let ep = if cfg.experts > 1 {
            (1..=dp)
                .rev()
                .find(|&e| dp.is_multiple_of(e) && cfg.experts.is_multiple_of(e))
                .unwrap_or(1)
        } else {
            1
        };
        let m = opts.global_batch / dp;
        let interleave = pp > 1 && cfg.layers.is_multiple_of(2 * pp) && m.is_multiple_of(pp);
        let plan = Plan {
            dp,
            tp,
            pp,
            vpp: if interleave { 2 } else { 1 },
            cp: 1,
            ep,
            micro_batch_size: 1,
            global_batch: opts.global_batch,
            zero_stage: 0,
            recompute: Recompute::Full,
            sequence_parallel: false,
            schedule: if interleave {
                ScheduleKind::Interleaved
            } else {
                ScheduleKind::OneFOneB
            },
            dtype: opts.dtype,
            fp8: opts.fp8,
            axis_order: Plan::DEFAULT_ORDER.iter().map(|a| a.to_string()).collect(),
            stage_layers: None,
            layer: LayerPlacement::MEGATRON,
            offload: Offload::None,
            etp: None,
            recompute_layers: None,
        };
        if model.estimate(cfg, &plan).is_ok_and(|e| e.fits) {
            let name = format!(
                "the Megatron-style reference (tp={tp} within a node, smallest pp that fits = {pp}, \
                 full recompute, mbs=1{})",
                if interleave {
                    ", interleaved vpp=2"
                } else {
                    ""
                }
            );
            return Some((name, plan));
        }
    }
    None
}
