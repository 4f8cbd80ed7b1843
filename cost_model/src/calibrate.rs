//! The calibration report: every row of the measurement tables of `shared/reference/` that
//! the cost model can express, estimated and compared with what was measured, with per-table
//! and overall median and worst error and how often the prediction is too fast. The caller
//! reads the files (this crate does no I/O) and passes each file's name and text in.
//!
//! A row's error is `predicted / measured - 1` on the figure its table measures: the step
//! time, a transformer layer's forward or backward time, one GEMM's TFLOP/s, or a
//! collective's bus bandwidth. Tables that give achieved
//! TFLOP/s per GPU instead are compared on step time, the measured time being the table's
//! own FLOP count (the formula its header cites) over the measured rate; a negative error on
//! a time (a positive one on a rate) is a prediction that is too fast. Each row's cluster, model, plan and software settings (the
//! attention kernel and whether data-parallel gradient reduction overlaps the backward) come
//! from the table, its header or the source the header names; where the source leaves a
//! choice unstated, the reader says what it assumes. There is no correction factor, per row
//! or per table: every number the estimate uses is the cost model's own.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use autopar_ir::DType;
use autopar_ir::schedule::ScheduleKind;

use crate::cluster::Cluster;
use crate::comm::{Algorithm, Collective};
use crate::compute::GemmShape;
use crate::error::CostError;
use crate::estimate::{CostModel, Estimate};
use crate::mapping::GroupInfo;
use crate::model::TransformerConfig;
use crate::plan::{Plan, Recompute};
use crate::software::Software;

/// The cost model's defaults: what `autopar estimate` prices (the `autopar` profile).
const DEFAULTS: &str = "autopar";

/// Megatron-LM of 2021 (SC'21): attention as two batched GEMMs around a fused softmax
/// (before FlashAttention), its own ("local") DDP, which reduces gradients after the
/// backward, tensor-parallel all-reduces awaited where they are issued, blocking
/// stage-to-stage transfers.
const MEGATRON_2021: &str = "megatron-lm-2021";

/// Megatron-LM of 2022 (Korthikanti et al.): as of 2021, with the asynchronous
/// tensor-parallel all-reduce of the backward.
const MEGATRON_2022: &str = "megatron-lm-2022";

/// Megatron-LM of 2021 with PyTorch DDP (`--DDP-impl torch`): gradient reduction overlapping
/// the backward.
const MEGATRON_2021_OVERLAP: &str = "megatron-lm-2021,overlap_grad_reduce=true";

/// DeepSpeed ZeRO-3 integrated into Megatron-LM (SC'21 Table 2).
const DEEPSPEED_2021: &str = "deepspeed";

/// Megatron-Core r0.8 with the README's overlap flags (`--overlap-grad-reduce`,
/// `--overlap-param-gather`, `--tp-comm-overlap`): the profile's defaults.
const MEGATRON_CORE: &str = "megatron-core";

/// Meta's Llama 3 stack, with Megatron-Core's profile standing in, the keys and values
/// all-gathered for context parallelism (Dubey et al. 2024, Sec. 3.3.2), no dropout (Llama
/// has none), and FlashAttention 2
/// (assumed: PyTorch's attention kernel when Llama 3 was pre-trained, in the first half of
/// 2024; FlashAttention 3 came out in July).
const LLAMA3: &str = "megatron-core,cp_attention=all_gather,attention=flash,dropout=false";

/// Megatron-Core with Transformer Engine's block-scaling fp8 recipe (`--fp8-recipe
/// blockwise`), as the MoE-layer baselines' FP8 rows run ("FP8 blockwise"). The benchmark
/// times the layer call by call, outside a training schedule that would mark the first
/// micro-batch of a step, so every call casts the weights again (`fp8_weight_cache=false`).
const MEGATRON_CORE_BLOCKWISE_FP8: &str =
    "megatron-core,fp8_recipe=blockwise,fp8_weight_cache=false";

/// llm-foundry's MPT runs: PyTorch FSDP in eager mode with fp32 gradient reduction, and
/// FlashAttention 1. Assumed, not stated by the table: until 2024 llm-foundry's `gpu`
/// install extra pinned `flash-attn==1.0.9` (FlashAttention 2 was the separate `gpu-flash2`
/// extra), and the long-sequence rows, where attention dominates, run at FlashAttention 1's
/// speed on both A100 and H100. The benchmark script itself
/// (`scripts/train/benchmarking/submit_benchmarks.py` at b2a43a147, which added the H100 and
/// A100-80GB tables, and at 5e85bd62) sets `attn_impl` from `--attn_impl`, default `triton`,
/// over the yamls' value, and installs `.[gpu]` (flash-attn 1.0.9 with a pre-MLIR Triton
/// built for sm90); `.[gpu-flash2]` only at 5e85bd62, for the large-scale H100 table. The
/// Triton kernel runs at FlashAttention 1's speed on A100 (50-80 against 55-83 TFLOP/s,
/// causal, head dim 128: the FlashAttention-2 paper's A100 figure), and both use Ampere's
/// `mma.sync`, so either is priced as FlashAttention 1.
const LLM_FOUNDRY: &str = "fsdp,attention=flash1";
/// [`LLM_FOUNDRY`] under Composer's `PURE` mixed precision, whose FSDP reduces gradients in
/// the training dtype (`reduce_dtype` bf16, `composer/distributed/mosaic_parallelism.py`,
/// `get_mixed_precision`) where `DEFAULT` reduces them in fp32. The `PURE` rows are the
/// tables of May 2023 (llm-foundry 300cc5c58, `torch==1.13.1`), whose non-reentrant
/// checkpoint replays the whole block: early stopping came with PyTorch 2.1. The `DEFAULT`
/// rows were measured again in October 2023 (b2a43a147) and January 2024 (5e85bd62, `torch>=2.1`);
/// between the two the same 13B and 7B layouts with activation checkpointing gained 4-8%
/// MFU on A100-80GB, those without it 1-2%.
const LLM_FOUNDRY_PURE: &str = "fsdp,attention=flash1,reduce_dtype=bf16,recompute_early_stop=false";
/// [`LLM_FOUNDRY`] with FlashAttention 2, for the large-scale H100 table (128-512 GPUs): the
/// commit that added it (5e85bd62, January 2024) also switched the benchmark's install to
/// `.[gpu-flash2]` (`flash-attn==2.4.2`, `submit_benchmarks.py`) and ran these models with
/// `--attn_impl flash` (`scripts/train/benchmarking/sweep.py` of the same commit), which
/// llm-foundry runs as FlashAttention 2 when version 2 is installed.
const LLM_FOUNDRY_FLASH2: &str = "fsdp,attention=flash";

/// The cost model of `cluster` under the software profile `spec` (as `--software` takes it).
fn with_software(cluster: Cluster, spec: &str) -> Result<CostModel, CostError> {
    let mut m = CostModel::new(cluster);
    Software::parse(spec)?.apply(&mut m);
    Ok(m)
}

/// What a row compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Figure {
    StepTime,
    /// Model TFLOP/s per GPU, by the cost model's own FLOP count: a rate, so a prediction
    /// above the measurement is the fast one.
    ModelTflops,
    LayerForward,
    LayerBackward,
    MlpBlockForward,
    MlpBlockBackward,
}

/// One row the cost model can express: what to estimate and what was measured.
struct Case {
    label: String,
    model: String,
    cfg: TransformerConfig,
    cluster_spec: String,
    cluster: Cluster,
    plan: Plan,
    /// The software profile, as `--software` takes it; empty for the cluster's own (a runs
    /// table's row that names none).
    software: Cow<'static, str>,
    figure: Figure,
    measured: f64,
    /// Measured over a few iterations of a micro-benchmark rather than in a training run:
    /// its GEMMs run at the measured matmul maximum itself, as the MAMF finder's do, not
    /// at the power-limited clock of a long run
    /// ([`crate::compute::ComputeParams::benchmark_clock`]).
    short_run: bool,
    /// The table does not state the micro-batch size of a tuned benchmark, nor, under
    /// pipeline parallelism, its virtual stages: the plan is estimated at every micro-batch
    /// size that divides a data-parallel rank's share of the batch (up to 8) and every number
    /// of virtual stages that divides a stage's layers, and the fastest that fits stands for
    /// the row, as the benchmark's authors would have picked it (and as `autopar plan` does).
    tuned: bool,
}

/// A row of a table, estimated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowResult {
    /// The row, as the table names it (with its line number in the file).
    pub label: String,
    /// The model: a `gpt:` spec `autopar estimate` accepts, or the shape in words.
    pub model: String,
    /// The cluster: a preset `autopar estimate --cluster` accepts, or how it differs from one.
    pub cluster: String,
    /// The plan, in the text form of `autopar estimate --plan`.
    pub plan: String,
    /// The software settings it was estimated under.
    pub software: String,
    /// The figure compared (`step time s`, `layer forward ms`, `layer backward ms`,
    /// `GEMM TFLOP/s`, `all-reduce bus GB/s`, a collective's bus GB/s per NIC).
    pub figure: String,
    /// What the table measured, in the figure's unit.
    pub measured: f64,
    /// What the cost model predicts, in the same unit.
    pub predicted: f64,
    /// `predicted / measured - 1`.
    pub error: f64,
    /// Whether the estimate says the plan fits in memory (it ran, so it did).
    pub fits: bool,
    /// Whether the prediction is faster than the measurement: a smaller time, or a larger
    /// rate.
    pub too_fast: bool,
}

/// Rows of a table left out, all for one reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Why they cannot be expressed or compared.
    pub reason: String,
    /// How many.
    pub rows: usize,
}

/// Median and worst error of a set of rows, and how many are predicted too fast.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Rows estimated.
    pub expressed: usize,
    /// Rows left out.
    pub skipped: usize,
    /// Median `|error|`; `None` without rows.
    pub median_abs_error: Option<f64>,
    /// The error of largest magnitude, signed.
    pub worst_error: Option<f64>,
    /// The label of the worst row.
    pub worst_row: Option<String>,
    /// Fraction of the rows whose prediction is too fast (smaller time than measured).
    pub too_fast: Option<f64>,
}

impl Summary {
    fn of(rows: &[&RowResult], skipped: usize) -> Summary {
        let mut abs: Vec<f64> = rows.iter().map(|r| r.error.abs()).collect();
        abs.sort_by(f64::total_cmp);
        let median = match abs.len() {
            0 => None,
            n if n % 2 == 1 => Some(abs[n / 2]),
            n => Some(0.5 * (abs[n / 2 - 1] + abs[n / 2])),
        };
        let worst = rows
            .iter()
            .max_by(|a, b| a.error.abs().total_cmp(&b.error.abs()));
        let fast = rows.iter().filter(|r| r.too_fast).count();
        Summary {
            expressed: rows.len(),
            skipped,
            median_abs_error: median,
            worst_error: worst.map(|r| r.error),
            worst_row: worst.map(|r| r.label.clone()),
            too_fast: (!rows.is_empty()).then(|| fast as f64 / rows.len() as f64),
        }
    }
}

/// One reference table, estimated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TableReport {
    /// The file's name without `.csv`.
    pub table: String,
    /// What its rows are compared on.
    pub figure: String,
    /// Why none of its rows can be expressed, when none can.
    pub not_expressed: Option<String>,
    /// The rows estimated.
    pub rows: Vec<RowResult>,
    /// The rows left out, by reason.
    pub skipped: Vec<Skipped>,
    /// Median, worst and sign of the errors.
    pub summary: Summary,
}

/// The whole report: one entry per table, then all expressed rows together.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CalibrationReport {
    /// Per table, in the order given.
    pub tables: Vec<TableReport>,
    /// Over every expressed row of every table.
    pub overall: Summary,
}

/// Estimates every expressible row of `tables`, each a file name (`korthikanti2022_....csv`)
/// and its text, and summarises the errors. A table without a reader, or with no expressible
/// row, is listed with the reason. Tables of one's own runs ([`RUN_COLUMNS`]) name their
/// clusters by preset only: [`calibrate_with`] resolves model arguments and cluster files.
pub fn calibrate(tables: &[(String, String)]) -> CalibrationReport {
    calibrate_with(tables, &PresetsOnly)
}

/// [`calibrate`], with the model and cluster arguments of tables of runs resolved by
/// `resolver` (as `autopar estimate` resolves its own).
pub fn calibrate_with(tables: &[(String, String)], resolver: &dyn Resolver) -> CalibrationReport {
    let reports: Vec<TableReport> = tables
        .iter()
        .map(|(name, text)| table_report(name, text, resolver))
        .collect();
    let all: Vec<&RowResult> = reports.iter().flat_map(|t| &t.rows).collect();
    let skipped = reports.iter().map(|t| t.summary.skipped).sum();
    CalibrationReport {
        overall: Summary::of(&all, skipped),
        tables: reports,
    }
}

/// Published runs outside the reference tables, embedded in the crate
/// (`cost_model/published/`), as `(file name, text)` pairs [`calibrate`] reads like the
/// reference tables: a check that the model carries beyond what it was calibrated on. Each
/// file's first line gives its source and caveats.
pub fn published_tables() -> Vec<(String, String)> {
    [
        (
            "llama3_405b_h100.csv",
            include_str!("../published/llama3_405b_h100.csv"),
        ),
        (
            "megatron_core_strong_scaling_h100.csv",
            include_str!("../published/megatron_core_strong_scaling_h100.csv"),
        ),
        (
            "nemo_24_07_fp8_h100.csv",
            include_str!("../published/nemo_24_07_fp8_h100.csv"),
        ),
        (
            "nemo_24_05_fp8_h100.csv",
            include_str!("../published/nemo_24_05_fp8_h100.csv"),
        ),
        (
            "nemo_24_03_long_sequence_h100.csv",
            include_str!("../published/nemo_24_03_long_sequence_h100.csv"),
        ),
        (
            "megatron_bridge_fp8_h100.csv",
            include_str!("../published/megatron_bridge_fp8_h100.csv"),
        ),
        (
            "megatron_bridge_moe_fp8_h100.csv",
            include_str!("../published/megatron_bridge_moe_fp8_h100.csv"),
        ),
        (
            "megatron_lm_llama3_fp8_h100.csv",
            include_str!("../published/megatron_lm_llama3_fp8_h100.csv"),
        ),
        (
            "torchtitan_llama3_h100.csv",
            include_str!("../published/torchtitan_llama3_h100.csv"),
        ),
        (
            "megatron_deepspeed_a100.csv",
            include_str!("../published/megatron_deepspeed_a100.csv"),
        ),
    ]
    .into_iter()
    .map(|(name, text)| (name.to_string(), text.to_string()))
    .collect()
}

/// The rows of a table this crate knows by its file name (`table`, without `.csv`): a source
/// whose reader knows its stack, layout conventions and caveats; `None` for any other name.
fn reference_table(
    table: &str,
    rows: &[Line],
) -> Option<Result<Vec<Result<Reading, &'static str>>, &'static str>> {
    Some(match table {
        "megatron_sc21_table1_weak_scaling_a100" => Ok(steps(sc21_table1(rows))),
        "megatron_sc21_table2_zero3_vs_ptdp" => Ok(steps(sc21_table2(rows))),
        "korthikanti2022_tables3_5_seqpar_selective" => Ok(steps(korthikanti_table5(rows))),
        "korthikanti2022_table4_per_layer_22B" => Ok(steps(korthikanti_table4(rows))),
        "megatron_core_h100_weak_scaling_readme" => Ok(steps(megatron_core_h100(rows))),
        "llmfoundry_mpt_benchmarks" => Ok(steps(llm_foundry(rows))),
        "hardware_specs" => Err("datasheet figures, no measurement"),
        "megatron_moe_layer_perf_baseline_h100" => Ok(steps(megatron_moe_layer(rows))),
        "mlengineering_mamf_gemm" => Ok(mamf_gemm(rows)),
        "mlengineering_allreduce_busbw" => Ok(mlengineering_allreduce(rows)),
        "nccl_busbw_reference" => Ok(nccl_reference(rows)),
        "nccl_issue_reference_busbw" => Ok(nccl_issues(rows)),
        "nemo_24_07_fp8_h100" => Ok(steps(nemo_fp8_h100(rows, false))),
        "nemo_24_05_fp8_h100" => Ok(steps(nemo_fp8_h100(rows, true))),
        "nemo_24_03_long_sequence_h100" => Ok(steps(nemo_long_sequence_h100(rows))),
        "megatron_bridge_fp8_h100" => Ok(steps(megatron_bridge_fp8_h100(rows))),
        "megatron_bridge_moe_fp8_h100" => Ok(steps(megatron_bridge_moe_fp8_h100(rows))),
        "megatron_core_strong_scaling_h100" => Ok(steps(megatron_core_strong_scaling(rows))),
        "megatron_deepspeed_a100" => Ok(steps(megatron_deepspeed_a100(rows))),
        "llama3_405b_h100" => Ok(steps(llama3_405b(rows))),
        "torchtitan_llama3_h100" => Ok(steps(torchtitan_llama3_h100(rows))),
        "megatron_lm_llama3_fp8_h100" => Ok(steps(megatron_lm_llama3_fp8_h100(rows))),
        _ => return None,
    })
}

fn table_report(file: &str, text: &str, resolver: &dyn Resolver) -> TableReport {
    let table = file.strip_suffix(".csv").unwrap_or(file).to_string();
    let rows = csv(text);
    // A table of one's own runs reports each row it cannot estimate apart, by its line; a
    // reference table counts its rows by reason.
    let (read, own_runs) = match reference_table(&table, &rows) {
        Some(read) => (
            read.map(|cases| {
                cases
                    .into_iter()
                    .map(|c| c.map_err(String::from))
                    .collect::<Vec<_>>()
            }),
            false,
        ),
        None if is_runs_table(text) => (Ok(runs(&rows, resolver)), true),
        None => (Err("no reader for this table"), false),
    };
    let cases = match read {
        Ok(c) => c,
        Err(why) => {
            let skipped = vec![Skipped {
                reason: why.to_string(),
                rows: rows.len(),
            }];
            return TableReport {
                table,
                figure: "-".into(),
                not_expressed: Some(why.to_string()),
                rows: Vec::new(),
                summary: Summary::of(&[], rows.len()),
                skipped,
            };
        }
    };
    let mut results = Vec::new();
    // Reasons in the order their first row comes.
    let mut skipped: Vec<Skipped> = Vec::new();
    let mut figures: Vec<String> = Vec::new();
    for case in cases {
        match case.and_then(|c| match c {
            Reading::Step(c) => estimate_case(&c).map_err(|e| match own_runs {
                true => format!("{}: the cost model refuses it: {e}", c.label),
                false => format!("the cost model refuses it: {e}"),
            }),
            Reading::Done(r) => Ok(*r),
        }) {
            Ok(r) => {
                if !figures.contains(&r.figure) {
                    figures.push(r.figure.clone());
                }
                results.push(r);
            }
            Err(reason) => match skipped.iter_mut().find(|s| s.reason == reason) {
                Some(s) => s.rows += 1,
                None => skipped.push(Skipped { reason, rows: 1 }),
            },
        }
    }
    let n_skipped = skipped.iter().map(|s| s.rows).sum();
    let refs: Vec<&RowResult> = results.iter().collect();
    TableReport {
        figure: figure_note(&table, &figures),
        not_expressed: results
            .is_empty()
            .then(|| "no row can be expressed (see skipped)".to_string()),
        summary: Summary::of(&refs, n_skipped),
        table,
        rows: results,
        skipped,
    }
}

fn figure_note(table: &str, figures: &[String]) -> String {
    let from_tflops = match table {
        "megatron_sc21_table1_weak_scaling_a100" | "megatron_sc21_table2_zero3_vs_ptdp" => {
            ", from measured TFLOP/s/GPU by SC'21 eq. 3"
        }
        "megatron_core_h100_weak_scaling_readme" => {
            ", from measured TFLOP/s/GPU by 72BLsh^2(1+s/6h+V/12hL)"
        }
        "llmfoundry_mpt_benchmarks"
        | "nemo_24_07_fp8_h100"
        | "nemo_24_05_fp8_h100"
        | "megatron_bridge_fp8_h100"
        | "megatron_bridge_moe_fp8_h100"
        | "torchtitan_llama3_h100"
        | "megatron_lm_llama3_fp8_h100" => ", from measured tokens/s",
        "megatron_core_strong_scaling_h100" => ", from MFU by 72BLsh^2(1+s/6h+V/12hL)",
        "nemo_24_03_long_sequence_h100" => {
            ", from measured TFLOP/s/GPU by NeMo's count, sLh^2(12+12g/a+18f/h+12s/h+6V/Lh)"
        }
        _ => "",
    };
    format!("{}{from_tflops}", figures.join(", "))
}

fn estimate_case(c: &Case) -> Result<RowResult, CostError> {
    let mut model = match c.software.is_empty() {
        true => CostModel::new(c.cluster.clone()),
        false => with_software(c.cluster.clone(), &c.software)?,
    };
    if c.short_run {
        model.compute.benchmark_clock = true;
    }
    // A tuned row's winning estimate is the row's: it is not estimated again.
    let (plan, tuned) = match c.tuned.then(|| fastest_layout(&model, c)).flatten() {
        Some((plan, e)) => (plan, Some(e)),
        None => (c.plan.clone(), None),
    };
    let estimate = || match tuned {
        Some(e) => Ok(e),
        None => model.estimate(&c.cfg, &plan),
    };
    let block = || model.mlp_block_times(&c.cfg, &plan);
    let (figure, predicted, fits) = match c.figure {
        Figure::StepTime => {
            let e = estimate()?;
            ("step time s", e.iter_time_s, e.fits)
        }
        Figure::ModelTflops => {
            let e = estimate()?;
            ("model TFLOP/s/GPU", e.model_tflops_per_gpu, e.fits)
        }
        Figure::LayerForward => {
            let e = estimate()?;
            let t = e.time.layer_forward.total_s();
            ("layer forward ms", t * 1e3, e.fits)
        }
        Figure::LayerBackward => {
            let e = estimate()?;
            let t = e.time.layer_backward.total_s();
            ("layer backward ms", t * 1e3, e.fits)
        }
        // One block of a micro-benchmark, which ran: it fitted.
        Figure::MlpBlockForward => (
            "MoE block forward ms",
            block()?.forward.total_s() * 1e3,
            true,
        ),
        Figure::MlpBlockBackward => {
            let t = block()?.backward.total_s();
            ("MoE block backward ms", t * 1e3, true)
        }
    };
    Ok(RowResult {
        label: c.label.clone(),
        model: c.model.clone(),
        cluster: c.cluster_spec.clone(),
        plan: plan.to_string(),
        software: match c.software.is_empty() {
            true => model.software.name.clone(),
            false => c.software.to_string(),
        },
        figure: figure.to_string(),
        measured: c.measured,
        predicted,
        error: predicted / c.measured - 1.0,
        fits,
        too_fast: match c.figure {
            Figure::ModelTflops => predicted > c.measured,
            _ => predicted < c.measured,
        },
    })
}

/// The plan of a row whose micro-batch size and virtual stages the table leaves out
/// ([`Case::tuned`]): its plan at the size among 1, 2, 4 and 8 dividing a data-parallel
/// rank's share of the batch, and under pipeline parallelism at the number of virtual stages
/// dividing a stage's layers (the interleaved schedule above one), whose step is shortest
/// among those that fit (shortest of all if none fits), with its estimate; `None` if no
/// layout can be estimated (the row's own plan then reports why).
fn fastest_layout(model: &CostModel, c: &Case) -> Option<(Plan, Estimate)> {
    let per_rank = c.plan.global_batch / c.plan.dp.max(1);
    let per_stage = c.cfg.layers / c.plan.pp.max(1);
    let virtual_stages: Vec<usize> = match c.plan.pp > 1 {
        true => (1..=per_stage)
            .filter(|v| per_stage.is_multiple_of(*v))
            .collect(),
        false => vec![c.plan.vpp],
    };
    let mut best: Option<(Plan, Estimate)> = None;
    for mbs in [1, 2, 4, 8] {
        if !per_rank.is_multiple_of(mbs) {
            continue;
        }
        for &vpp in &virtual_stages {
            let schedule = match vpp > 1 {
                true => ScheduleKind::Interleaved,
                false => c.plan.schedule,
            };
            let plan = Plan {
                micro_batch_size: mbs,
                vpp,
                schedule,
                ..c.plan.clone()
            };
            // A layout the plan's rules refuse is not a candidate.
            let Ok(e) = model.estimate(&c.cfg, &plan) else {
                continue;
            };
            let better = match &best {
                None => true,
                Some((_, b)) => (e.fits, -e.iter_time_s) > (b.fits, -b.iter_time_s),
            };
            if better {
                best = Some((plan, e));
            }
        }
    }
    best
}

/// One parsed data row: its line number in the file and its fields by column name.
struct Line {
    number: usize,
    fields: BTreeMap<String, String>,
}

impl Line {
    fn get(&self, key: &str) -> &str {
        self.fields
            .get(key)
            .map(String::as_str)
            .unwrap_or("")
            .trim()
    }

    /// A number, ignoring the markers tables put on figures (`~230`, `2560*`).
    fn num(&self, key: &str) -> Option<f64> {
        self.get(key)
            .trim_matches(|c: char| c == '~' || c == '*')
            .parse()
            .ok()
    }

    fn int(&self, key: &str) -> Option<usize> {
        self.num(key)
            .filter(|v| *v >= 0.0 && v.fract() == 0.0)
            .map(|v| v as usize)
    }
}

/// Splits a CSV text into data rows keyed by the header (its names trimmed): `#` lines are
/// the source notes, the first other line is the header, fields may be double-quoted (with
/// `""` for a quote).
fn csv(text: &str) -> Vec<Line> {
    let mut header: Option<Vec<String>> = None;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_csv_line(line);
        match &header {
            None => header = Some(fields.into_iter().map(|f| f.trim().to_string()).collect()),
            Some(h) => rows.push(Line {
                number: i + 1,
                fields: h.iter().cloned().zip(fields).collect(),
            }),
        }
    }
    rows
}

fn split_csv_line(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut field)),
            _ => field.push(c),
        }
    }
    out.push(field);
    out
}

type Read = Vec<Result<Case, &'static str>>;

/// A row read: a training step to estimate, or a row already compared (a single GEMM).
enum Reading {
    Step(Box<Case>),
    Done(Box<RowResult>),
}

/// The rows of a table of training steps, to estimate.
fn steps(read: Read) -> Vec<Result<Reading, &'static str>> {
    read.into_iter()
        .map(|c| c.map(|c| Reading::Step(Box::new(c))))
        .collect()
}

/// Resolves the model and cluster arguments of a table of runs ([`RUN_COLUMNS`]) the way
/// `autopar estimate` resolves its own. Model arguments name zoo models or graph files, which
/// only the driver can build; this crate alone resolves cluster presets ([`calibrate`]).
/// Errors name the argument they refuse.
pub trait Resolver {
    /// The transformer a model argument describes (`llama3-70b`, `gpt:layers=...`, a graph
    /// file).
    fn model(&self, spec: &str) -> Result<TransformerConfig, String>;
    /// The cluster a cluster argument describes (a preset such as `dgx-h100:nodes=4`, or a
    /// cluster file), with its own `[software]` table if it has one.
    fn cluster(&self, spec: &str) -> Result<Cluster, String>;
}

/// What [`calibrate`] resolves by itself: cluster presets, no model arguments.
struct PresetsOnly;

impl Resolver for PresetsOnly {
    fn model(&self, spec: &str) -> Result<TransformerConfig, String> {
        Err(format!(
            "model `{spec}` needs the model zoo to be read: run the table through `autopar \
             calibrate`"
        ))
    }

    fn cluster(&self, spec: &str) -> Result<Cluster, String> {
        Cluster::preset(spec).map_err(|e| e.to_string())
    }
}

/// The columns of a table of one's own training runs, which the report reads whatever the
/// file is called (a file of the reference directory with no reader of its own, or one given
/// with `autopar calibrate --reference FILE`): each row is an `autopar estimate` invocation
/// and what the run measured.
///
/// - `model`, `cluster`, `plan` (required): as `autopar estimate` takes its model argument,
///   `--cluster` and `--plan` (with the global batch as `gbs=` or in `batch`, and the dtype as
///   `dtype=`, `fp8` included);
/// - `batch`: the global batch in sequences, where the plan does not give it;
/// - `software`: as `--software` takes it; empty or absent, the cluster file's `[software]`
///   table or the `autopar` profile;
/// - `label` (or `run`): what the row is called in the report;
/// - the measurement, exactly one of `step_s` (seconds per optimizer step),
///   `tokens_per_s_per_gpu` or `tokens_per_s` (over the plan's GPUs), the tokens of a step
///   being the global batch times the model's sequence length.
///
/// Other columns are ignored. A row that cannot be read is skipped with its line and the
/// reason; a plan the cost model refuses is skipped with the model's error.
pub const RUN_COLUMNS: [&str; 3] = ["model", "cluster", "plan"];

/// The measured figures a table of runs may give, one per row ([`RUN_COLUMNS`]).
const RUN_FIGURES: [&str; 3] = ["step_s", "tokens_per_s_per_gpu", "tokens_per_s"];

/// The header of a CSV text: its first line that is neither a `#` note nor blank.
fn header(text: &str) -> Vec<String> {
    text.lines()
        .find(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            split_csv_line(l)
                .into_iter()
                .map(|c| c.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a table's header is that of a table of runs: [`RUN_COLUMNS`] and a measured
/// figure among [`RUN_FIGURES`].
fn is_runs_table(text: &str) -> bool {
    let h = header(text);
    let has = |c: &str| h.iter().any(|x| x == c);
    RUN_COLUMNS.iter().all(|c| has(c)) && RUN_FIGURES.iter().any(|c| has(c))
}

/// The rows of a table of runs ([`RUN_COLUMNS`]), each a step to estimate or why it cannot
/// be, with its line.
fn runs(rows: &[Line], resolver: &dyn Resolver) -> Vec<Result<Reading, String>> {
    rows.iter()
        .map(|r| {
            run_case(r, resolver)
                .map(|c| Reading::Step(Box::new(c)))
                .map_err(|why| format!("line {}: {why}", r.number))
        })
        .collect()
}

fn run_case(r: &Line, resolver: &dyn Resolver) -> Result<Case, String> {
    let required = |k: &str| match r.get(k) {
        "" => Err(format!("no `{k}`")),
        v => Ok(v),
    };
    let (model, cluster_spec, plan_text) =
        (required("model")?, required("cluster")?, required("plan")?);
    let cfg = resolver.model(model)?;
    let mut cluster = resolver.cluster(cluster_spec)?;
    let software = r.get("software");
    if !software.is_empty() {
        // Checked here, so that a misspelt knob names its row rather than failing the estimate.
        Software::parse(software).map_err(|e| format!("software `{software}`: {e}"))?;
        cluster.software = None;
    }
    let mut plan = Plan::parse(plan_text).map_err(|e| format!("plan `{plan_text}`: {e}"))?;
    let plan_gives_batch = crate::plan::key_values(plan_text)
        .map_err(|e| format!("plan `{plan_text}`: {e}"))?
        .iter()
        .any(|(k, _)| matches!(*k, "gbs" | "batch" | "global_batch"));
    match (r.get("batch"), plan_gives_batch) {
        ("", true) => {}
        ("", false) => return Err("no global batch: give `batch` or `gbs=` in the plan".into()),
        (b, given) => {
            let batch = r
                .int("batch")
                .filter(|b| *b > 0)
                .ok_or_else(|| format!("`batch` is `{b}`, not a positive whole number"))?;
            if given && batch != plan.global_batch {
                return Err(format!(
                    "the plan gives a global batch of {}, `batch` {batch}: give it once",
                    plan.global_batch
                ));
            }
            plan.global_batch = batch;
        }
    }
    plan.check()
        .map_err(|e| format!("plan `{plan_text}`: {e}"))?;
    let given: Vec<&str> = RUN_FIGURES
        .into_iter()
        .filter(|k| !r.get(k).is_empty())
        .collect();
    let [figure] = given[..] else {
        return Err(format!(
            "give exactly one measurement of {} (this row gives {})",
            RUN_FIGURES.join(", "),
            match given.is_empty() {
                true => "none".to_string(),
                false => given.join(" and "),
            }
        ));
    };
    let value = r
        .num(figure)
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| format!("`{figure}` is `{}`, not a positive number", r.get(figure)))?;
    let tokens = (plan.global_batch * cfg.seq) as f64;
    let measured = match figure {
        "step_s" => value,
        "tokens_per_s_per_gpu" => tokens / (value * plan.world_size() as f64),
        _ => tokens / value,
    };
    let name = [r.get("label"), r.get("run")]
        .into_iter()
        .find(|l| !l.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| format!("{model} on {cluster_spec}"));
    Ok(Case {
        label: format!("line {}: {name}", r.number),
        model: model.to_string(),
        cfg,
        cluster_spec: cluster_spec.to_string(),
        cluster,
        plan,
        software: software.to_string().into(),
        figure: Figure::StepTime,
        measured,
        short_run: false,
        tuned: false,
    })
}

/// A row's GPT shape columns: `(layers, hidden, heads, seq, vocab)`.
fn gpt_shape(r: &Line) -> Result<(usize, usize, usize, usize, usize), &'static str> {
    let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
    Ok((
        need("layers")?,
        need("hidden")?,
        need("heads")?,
        need("seq")?,
        need("vocab")?,
    ))
}

/// A GPT of the SC'21/Korthikanti/MPT kind (GELU MLP of `4h`, tied embeddings, learned
/// positions) and its `gpt:` spec.
fn gpt(
    layers: usize,
    hidden: usize,
    heads: usize,
    seq: usize,
    vocab: usize,
) -> (String, TransformerConfig) {
    let spec = format!("gpt:layers={layers},hidden={hidden},heads={heads},seq={seq},vocab={vocab}");
    (
        spec.clone(),
        TransformerConfig::gpt(&spec, layers, hidden, heads, seq, vocab),
    )
}

/// A cluster preset of whole 8-GPU nodes.
fn nodes(kind: &str, gpus: usize) -> Result<(String, Cluster), &'static str> {
    if gpus == 0 || !gpus.is_multiple_of(8) {
        return Err("not whole 8-GPU nodes");
    }
    let spec = format!("{kind}:nodes={}", gpus / 8);
    let cluster = Cluster::preset(&spec).map_err(|_| "no cluster preset")?;
    Ok((spec, cluster))
}

fn plan(text: &str) -> Result<Plan, &'static str> {
    Plan::parse(text).map_err(|_| "the plan does not parse")
}

/// SC'21 eq. 3: FLOPs of a step with full recomputation.
fn sc21_flops(batch: f64, seq: f64, layers: f64, hidden: f64, vocab: f64) -> f64 {
    96.0 * batch
        * seq
        * layers
        * hidden
        * hidden
        * (1.0 + seq / (6.0 * hidden) + vocab / (16.0 * layers * hidden))
}

/// SC'21 Table 1 (weak scaling of PTD-P on A100, fp16, full recomputation, interleaved 1F1B
/// where the scripts give layers per virtual stage).
fn sc21_table1(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (heads, hidden, layers) = (
                need("attention_heads")?,
                need("hidden_size")?,
                need("num_layers")?,
            );
            let (tp, pp, gpus) = (
                need("tensor_parallel")?,
                need("pipeline_parallel")?,
                need("num_gpus")?,
            );
            let (gbs, mbs) = (need("global_batch_size")?, need("micro_batch_size")?);
            let tflops = r
                .num("achieved_tflops_per_gpu")
                .ok_or("no measured throughput")?;
            let dp = gpus / (tp * pp);
            let (vpp, schedule) = match r.int("virtual_pipeline_layers_per_stage") {
                Some(per) if per > 0 && pp > 1 => (layers / (pp * per), "interleaved"),
                _ => (1, "1f1b"),
            };
            let software = match r.get("ddp_impl") {
                "torch" => MEGATRON_2021_OVERLAP,
                _ => MEGATRON_2021,
            };
            let (model, cfg) = gpt(layers, hidden, heads, 2048, 51200);
            let (cluster_spec, cluster) = nodes("dgx-a100", gpus)?;
            let plan = plan(&format!(
                "dp={dp},tp={tp},pp={pp},vpp={vpp},mbs={mbs},gbs={gbs},recompute=full,\
                 schedule={schedule},dtype=f16"
            ))?;
            let flops = sc21_flops(gbs as f64, 2048.0, layers as f64, hidden as f64, 51200.0);
            Ok(Case {
                label: format!(
                    "line {}: {}B on {gpus} GPUs",
                    r.number,
                    r.get("params_billion")
                ),
                model,
                cfg,
                cluster_spec,
                cluster,
                plan,
                software: software.into(),
                figure: Figure::StepTime,
                measured: flops / (gpus as f64 * tflops * 1e12),
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// SC'21 Table 2: ZeRO-3 (DeepSpeed, no model parallelism) against PTD-P (tp 8, pp 12 for
/// 175B, 35 for 530B). The table gives only the parameter count; the shapes are the paper's
/// (GPT-3 175B: 96 layers, h 12288, 96 heads; 530B: Table 1's row). Recomputation is full,
/// as in every SC'21 run; the PTD-P schedule is not stated (1F1B assumed).
fn sc21_table2(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (layers, hidden, heads) = match r.get("params_billion") {
                "174.6" => (96, 12288, 96),
                "529.6" => (105, 20480, 128),
                _ => return Err("model shape unknown"),
            };
            let (mp, gbs, gpus, mbs) = (
                need("model_parallel_size")?,
                r.num("global_batch_size").ok_or("no batch size")? as usize,
                need("num_gpus")?,
                need("micro_batch_size")?,
            );
            let tflops = r
                .num("achieved_tflops_per_gpu")
                .ok_or("no measured throughput")?;
            let (text, software) = match r.get("scheme") {
                "ZeRO-3" if mp == 1 => (
                    format!("dp={gpus},mbs={mbs},gbs={gbs},zero=3,recompute=full,dtype=f16"),
                    DEEPSPEED_2021,
                ),
                "PTD-P" if mp.is_multiple_of(8) => (
                    format!(
                        "dp={},tp=8,pp={},mbs={mbs},gbs={gbs},recompute=full,dtype=f16",
                        gpus / mp,
                        mp / 8
                    ),
                    MEGATRON_2021,
                ),
                _ => return Err("scheme not understood"),
            };
            let (model, cfg) = gpt(layers, hidden, heads, 2048, 51200);
            let (cluster_spec, cluster) = nodes("dgx-a100", gpus)?;
            let flops = sc21_flops(gbs as f64, 2048.0, layers as f64, hidden as f64, 51200.0);
            Ok(Case {
                label: format!(
                    "line {}: {} {}B on {gpus} GPUs",
                    r.number,
                    r.get("scheme"),
                    r.get("params_billion")
                ),
                model,
                cfg,
                cluster_spec,
                cluster,
                plan: plan(&text)?,
                software: software.into(),
                figure: Figure::StepTime,
                measured: flops / (gpus as f64 * tflops * 1e12),
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// Korthikanti et al. 2022, Tables 3 and 5: iteration times with full recomputation, and
/// with sequence parallelism plus selective recomputation ("present work"); tp 8, the
/// interleaved schedule with 3 chunks for 175B and 530B (the header), 1F1B otherwise.
fn korthikanti_table5(rows: &[Line]) -> Read {
    let mut out = Vec::new();
    for r in rows {
        let case = |column: &str, opts: &str| -> Result<Case, &'static str> {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (heads, hidden, layers) = (
                need("attention_heads")?,
                need("hidden_size")?,
                need("num_layers")?,
            );
            let (tp, pp, dp, gpus) = (
                need("tensor_parallel")?,
                need("pipeline_parallel")?,
                need("data_parallel")?,
                need("num_gpus")?,
            );
            let (gbs, mbs) = (need("global_batch_size")?, need("micro_batch_size")?);
            let measured = r.num(column).ok_or("no measured time")?;
            let name = r.get("model");
            let schedule = if name.starts_with("175B") || name.starts_with("530B") {
                "interleaved,vpp=3"
            } else {
                "1f1b"
            };
            let (model, cfg) = gpt(layers, hidden, heads, 2048, 51200);
            let (cluster_spec, cluster) = nodes("dgx-a100", gpus)?;
            Ok(Case {
                label: format!("line {}: {name}, {column}", r.number),
                model,
                cfg,
                cluster_spec,
                cluster,
                plan: plan(&format!(
                    "dp={dp},tp={tp},pp={pp},mbs={mbs},gbs={gbs},schedule={schedule},{opts}"
                ))?,
                software: MEGATRON_2022.into(),
                figure: Figure::StepTime,
                measured,
                short_run: false,
                tuned: false,
            })
        };
        out.push(case(
            "iter_time_full_recompute_s",
            "sp=false,recompute=full",
        ));
        out.push(case(
            "iter_time_present_work_s",
            "sp=true,recompute=selective",
        ));
    }
    out
}

/// Korthikanti et al. 2022, Table 4: forward and backward time of one layer of the 22B model
/// (h 6144, 64 heads, 48 layers, tp 8, seq 2048, micro-batch 4; the header and Table 3).
fn korthikanti_table4(rows: &[Line]) -> Read {
    let mut out = Vec::new();
    for r in rows {
        let opts = match r.get("experiment") {
            "Baseline no recompute" => Some("sp=false,recompute=none"),
            "Sequence Parallelism" => Some("sp=true,recompute=none"),
            "Baseline with recompute (full)" => Some("sp=false,recompute=full"),
            "Selective Recompute" => Some("sp=false,recompute=selective"),
            "Selective + Sequence" => Some("sp=true,recompute=selective"),
            _ => None,
        };
        for (column, figure) in [
            ("forward_ms", Figure::LayerForward),
            ("backward_ms", Figure::LayerBackward),
        ] {
            out.push((|| {
                let opts = opts.ok_or("experiment not understood")?;
                let measured = r.num(column).ok_or("no measured time")?;
                let (model, cfg) = gpt(48, 6144, 64, 2048, 51200);
                let (cluster_spec, cluster) = nodes("dgx-a100", 8)?;
                Ok(Case {
                    label: format!("line {}: {}, {column}", r.number, r.get("experiment")),
                    model,
                    cfg,
                    cluster_spec,
                    cluster,
                    plan: plan(&format!("tp=8,mbs=4,gbs=4,{opts}"))?,
                    software: MEGATRON_2022.into(),
                    figure,
                    measured,
                    short_run: false,
                    tuned: false,
                })
            })());
        }
    }
    out
}

/// Megatron-Core's MoE-layer performance baselines on H100 (one `MoELayer`: router,
/// dispatcher and grouped expert GEMMs, no attention; 8 GPUs of one node, the table's
/// `tp`/`ep`/`etp`, `tokens_per_rank` tokens per rank): forward and backward of the MLP
/// block, priced by the code that prices it in a layer ([`CostModel::mlp_block_times`]).
/// The Mixtral proxy is a SwiGLU MoE (Mixtral's); the DeepSeek proxy's shared expert and
/// group-limited routing are not modelled, so its rows are skipped. The DeepEP and HybridEP
/// dispatchers (`flex`) move the same tokens as the all-to-all and are priced as one;
/// FP8 rows (Transformer Engine's blockwise recipe) as the fp8 GEMMs of `dtype=fp8` under
/// `fp8_recipe=blockwise`.
/// The rows are CI micro-benchmarks (20 timed iterations after 5 warm-up, the header), the
/// MAMF finder's regime rather than a training run's, so `short_run`.
fn megatron_moe_layer(rows: &[Line]) -> Read {
    let mut out = Vec::new();
    for r in rows {
        for (column, figure) in [
            ("forward_ms", Figure::MlpBlockForward),
            ("backward_ms", Figure::MlpBlockBackward),
        ] {
            out.push((|| {
                let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
                let (hidden, ffn, experts, top_k) = (
                    need("hidden")?,
                    need("moe_ffn_hidden")?,
                    need("num_experts")?,
                    need("topk")?,
                );
                let (gpus, tp, ep, etp, tokens) = (
                    need("num_gpus")?,
                    need("tp")?,
                    need("ep")?,
                    need("etp")?,
                    need("tokens_per_rank")?,
                );
                let measured = r.num(column).ok_or("no measured time")?;
                let shared_ffn = match r.get("shared_expert_ffn") {
                    "" => 0,
                    _ => r
                        .int("shared_expert_ffn")
                        .ok_or("shared expert width not understood")?,
                };
                // The flex dispatcher (DeepEP, HybridEP) sends a token once to each rank that
                // holds any of its experts, where the all-to-all dispatcher sends one copy per
                // expert: the same traffic unless a token may pick two experts on one rank.
                // Counting only the copies leaves the DeepSeek proxy's flex rows 13-49% too
                // slow (its kernels also fuse the permutation and overlap the transfers), so
                // they are refused rather than half-modelled.
                if r.get("token_dispatcher") != "alltoall" && top_k > 1 && experts > ep {
                    return Err(
                        "DeepEP/HybridEP dispatch of tokens to several experts per rank \
                                is not modelled",
                    );
                }
                let dtype = if r.get("precision").starts_with("FP8") {
                    "fp8"
                } else {
                    "bf16"
                };
                if !r.get("gpu").starts_with("H100") {
                    return Err("not an H100 row");
                }
                let (cluster_spec, cluster) = nodes("dgx-h100", gpus)?;
                let heads = (hidden / 128).max(1);
                let cfg = TransformerConfig {
                    name: r.get("model_proxy").to_string(),
                    layers: 1,
                    hidden,
                    heads,
                    kv_heads: heads,
                    head_dim: None,
                    ffn,
                    vocab: 32000,
                    seq: tokens,
                    experts,
                    top_k,
                    gated_mlp: true,
                    tied_embeddings: false,
                    learned_positions: false,
                    rms_norm: true,
                    shared_ffn,
                };
                let dp = gpus / tp;
                let sp = if tp > 1 { ",sp=true" } else { "" };
                Ok(Case {
                    label: format!("line {}: {}, {column}", r.number, r.get("case")),
                    model: format!(
                        "one MoE block: hidden {hidden}, expert ffn {ffn} (SwiGLU), {experts} \
                         experts, top-{top_k}, {}{tokens} tokens per rank",
                        match shared_ffn {
                            0 => String::new(),
                            s => format!("a shared expert of {s}, "),
                        }
                    ),
                    cfg,
                    cluster_spec,
                    cluster,
                    plan: plan(&format!(
                        "dp={dp},tp={tp},ep={ep},etp={etp},mbs=1,gbs={dp},dtype={dtype}{sp}"
                    ))?,
                    software: match dtype {
                        "fp8" => MEGATRON_CORE_BLOCKWISE_FP8,
                        _ => MEGATRON_CORE,
                    }
                    .into(),
                    figure,
                    measured,
                    short_run: true,
                    tuned: false,
                })
            })());
        }
    }
    out
}

/// Megatron-Core r0.8.0 weak scaling on H100 (README): seq 4096, vocab 131072, a GPT with a
/// `4h` MLP and untied embeddings (the header's FLOP formula), overlapped gradient reduction.
/// Not stated, so assumed: the fastest micro-batch size that fits (a benchmark's authors tune
/// it; with 4 sequences per data-parallel rank and the gradient reduction overlapping only
/// the last micro-batch's backward, the 32B row's fp32 reduce-scatter over 48 nodes is
/// hidden at 4 and exposed at 1) and, under pipeline parallelism, the fastest number of
/// virtual stages (the interleaved schedule, which the pipelined rows' MFU implies:
/// [`megatron_core_case`]), no recomputation, sequence parallelism with tp, the distributed
/// optimizer (ZeRO-1), bf16, rotary positions.
fn megatron_core_h100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (heads, hidden, layers) = (
                need("attention_heads")?,
                need("hidden_size")?,
                need("num_layers")?,
            );
            let (tp, pp, dp, gpus, gbs) = (
                need("tensor_parallel")?,
                need("pipeline_parallel")?,
                need("data_parallel")?,
                need("num_gpus")?,
                need("global_batch_size")?,
            );
            let tflops = r.num("tflops_per_gpu").ok_or("no measured throughput")?;
            megatron_core_case(
                format!("line {}: {} on {gpus} GPUs", r.number, r.get("model_size")),
                r.get("model_size"),
                (layers, hidden, heads, 4096, 131072),
                gpus,
                (dp, tp, pp, gbs),
                tflops * 1e12,
            )
        })
        .collect()
}

/// llm-foundry's MPT benchmarks: PyTorch FSDP data parallelism (FULL_SHARD as ZeRO-3,
/// SHARD_GRAD_OP as ZeRO-2), FlashAttention ([`LLM_FOUNDRY`]; version 2 for the large-scale
/// H100 table, [`LLM_FOUNDRY_FLASH2`]), gradients reduced in fp32
/// or, under `PURE` mixed precision, bf16 ([`LLM_FOUNDRY_PURE`]), bf16 or Transformer Engine
/// fp8 (`amp_fp8`: `dtype=fp8`), activation checkpointing as full recomputation; measured
/// step time = tokens per step / tokens per second. MPT is a GPT with tied embeddings and
/// (in these yamls) learned positions. A100-40GB rows run on the `dgx-a100-40gb` preset.
fn llm_foundry(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let dtype = match r.get("precision") {
                "amp_fp8" => "fp8",
                "amp_bf16" | "bf16" => "bf16",
                _ => return Err("precision not understood"),
            };
            if r.get("activation_cpu_offload") == "True" {
                return Err("CPU offload not modelled");
            }
            let (layers, hidden, heads, vocab, seq) = (
                need("n_layers_yaml_derived")?,
                need("d_model_yaml_derived")?,
                need("n_heads_yaml_derived")?,
                need("vocab_size_yaml_derived")?,
                need("seq_len")?,
            );
            if r.int("expansion_ratio_yaml_derived") != Some(4) {
                return Err("MLP expansion other than 4");
            }
            let (gpus, mbs, gbs) = (
                need("num_gpus")?,
                need("micro_batch_size")?,
                need("global_batch_seqs")?,
            );
            let tokens = r.num("global_batch_tokens").ok_or("no batch size")?;
            let rate = r
                .num("throughput_tok_per_s")
                .filter(|t| *t > 0.0)
                .ok_or("no measured time")?;
            if gbs != mbs * gpus * need("grad_accum")? {
                return Err("batch columns disagree");
            }
            let large_scale = r.get("table_section").contains("Large Scale");
            let software = match (r.get("mp_mode"), large_scale) {
                ("DEFAULT", false) => LLM_FOUNDRY,
                ("DEFAULT", true) => LLM_FOUNDRY_FLASH2,
                ("PURE", _) => LLM_FOUNDRY_PURE,
                _ => return Err("mixed-precision mode not understood"),
            };
            let zero = match r.get("fsdp_sharding_strategy") {
                "FULL_SHARD" => 3,
                "SHARD_GRAD_OP" => 2,
                _ => return Err("FSDP sharding strategy not understood"),
            };
            let recompute = match r.get("activation_checkpointing") {
                "True" => Recompute::Full,
                _ => Recompute::None,
            };
            let (cluster_spec, cluster) = match r.get("gpu") {
                "h100_80gb" => nodes("dgx-h100", gpus)?,
                "a100_80gb" => nodes("dgx-a100", gpus)?,
                "a100_40gb" => nodes("dgx-a100-40gb", gpus)?,
                _ => return Err("GPU without a cluster preset"),
            };
            let (model, cfg) = gpt(layers, hidden, heads, seq, vocab);
            let plan = plan(&format!(
                "dp={gpus},mbs={mbs},gbs={gbs},zero={zero},recompute={},dtype={dtype}",
                recompute.name()
            ))?;
            Ok(Case {
                label: format!(
                    "line {}: mpt-{} seq {seq} on {gpus} {}",
                    r.number,
                    r.get("model"),
                    r.get("gpu")
                ),
                model,
                cfg,
                cluster_spec,
                cluster,
                plan,
                software: software.into(),
                figure: Figure::StepTime,
                measured: tokens / rate,
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// The best matmul TFLOP/s found per accelerator (ml-engineering's MAMF finder), against the
/// cost model's time for one GEMM of the shape that reached it (operands and result through
/// HBM; fp8 operands with a bf16 result), on the accelerators with a cluster preset or a
/// one-GPU description (GH200, A100 PCIe: [`crate::cluster::gh200_gpu`],
/// [`crate::cluster::a100_pcie_gpu`]); other NVIDIA parts (B300, GB200) wait for a source of
/// their SM count, and other vendors' for a model of their GEMM libraries. The
/// descriptions take their matmul ceiling from this table, so what the rows test is the tile and
/// wave model at the best shape; and the benchmark is short, so the GEMM runs at the
/// measured ceiling, without the sustained-load fraction of a training run.
fn mamf_gemm(rows: &[Line]) -> Vec<Result<Reading, &'static str>> {
    rows.iter()
        .map(|r| {
            let dtype = r.get("dtype").to_ascii_lowercase();
            let fp8 = dtype.contains("fp8");
            if dtype != "bf16" && !fp8 {
                return Err("dtype not modelled");
            }
            let accelerator = r.get("accelerator");
            let (preset, cluster) = match accelerator {
                "NVIDIA A100 SXM" => ("dgx-a100:nodes=1", None),
                "NVIDIA H100 SXM" => ("dgx-h100:nodes=1", None),
                "NVIDIA H200 SXM" => ("hgx-h200:nodes=1", None),
                "NVIDIA B200 SXM" => ("dgx-b200:nodes=1", None),
                "NVIDIA GH200 SXM" => ("gh200-gpu", Some(crate::cluster::gh200_gpu())),
                "NVIDIA A100 PCIe" => ("a100-pcie-gpu", Some(crate::cluster::a100_pcie_gpu())),
                a if !a.starts_with("NVIDIA") => {
                    return Err("not an NVIDIA GPU: the tile model is cuBLAS's on NVIDIA SMs");
                }
                _ => {
                    return Err(
                        "NVIDIA GPU whose SM count and HBM bandwidth no source at hand gives",
                    );
                }
            };
            let need = |k: &str| r.int(k).map(|v| v as u64).ok_or("GEMM shape missing");
            let (m, n, k) = (need("M_derived")?, need("N_derived")?, need("K_derived")?);
            let measured = r.num("mamf_tflops").ok_or("no measured throughput")?;
            let cluster = match cluster {
                Some(c) => c,
                None => Cluster::preset(preset).map_err(|_| "no cluster preset")?,
            };
            let mut model = CostModel::new(cluster);
            model.compute.benchmark_clock = true;
            let shape = GemmShape::new(1, m, n, k);
            let e = if fp8 { 1.0 } else { 2.0 };
            let bytes = e * (m * k + k * n) as f64 + 2.0 * (m * n) as f64;
            let c = &model.compute;
            let ceiling = model
                .cluster
                .gemm_ceiling_flops(DType::BF16, fp8, c.gemm_ceiling_default)
                .ok_or("no fp8 peak on this preset")?;
            let t = c.gemm_time_at(shape, ceiling, bytes, &model.cluster);
            let predicted = shape.flops() / t / 1e12;
            Ok(Reading::Done(Box::new(RowResult {
                label: format!("line {}: {} {m}x{n}x{k}", r.number, r.get("accelerator")),
                model: format!("GEMM {m}x{n}x{k} {}", if fp8 { "fp8" } else { "bf16" }),
                cluster: preset.to_string(),
                plan: "-".into(),
                software: DEFAULTS.to_string(),
                figure: "GEMM TFLOP/s".into(),
                measured,
                predicted,
                error: predicted / measured - 1.0,
                fits: true,
                too_fast: predicted > measured,
            })))
        })
        .collect()
}

/// A Megatron-Core r0.8 run on H100 (its README's weak- and strong-scaling figures): a GPT
/// of `(layers, hidden, heads, seq, vocab)` with untied embeddings and rotary positions on
/// `gpus` GPUs laid out `(dp, tp, pp, gbs)`, at the fastest micro-batch size and number of
/// virtual stages that fit ([`Case::tuned`]; the README gives neither, and its pipelined
/// runs cannot have run without virtual stages: the 177B model reaches 44% MFU on 2,304
/// GPUs, 24 sequences per pipeline of 6 stages, where the plain 1F1B schedule idles 17% of
/// the step, and 47% on 96 GPUs, 576 sequences per pipeline with next to no bubble, so
/// its pipeline stood still at most 6% of the step), no recomputation, sequence parallelism
/// with tp, the distributed optimizer (assumed, not stated), and the step
/// time at which the README's FLOP count, 72BLsh^2(1+s/6h+V/12hL), runs at `rate` FLOP/s
/// per GPU.
fn megatron_core_case(
    label: String,
    name: &str,
    (layers, hidden, heads, seq, vocab): (usize, usize, usize, usize, usize),
    gpus: usize,
    (dp, tp, pp, gbs): (usize, usize, usize, usize),
    rate: f64,
) -> Result<Case, &'static str> {
    let cfg = TransformerConfig {
        tied_embeddings: false,
        learned_positions: false,
        ..TransformerConfig::gpt(name, layers, hidden, heads, seq, vocab)
    };
    let model = format!(
        "gpt, {layers} layers, h {hidden}, {heads} heads, seq {seq}, vocab {vocab}, untied, \
         rotary"
    );
    let (cluster_spec, cluster) = nodes("dgx-h100", gpus)?;
    let sp = tp > 1;
    let plan = plan(&format!(
        "dp={dp},tp={tp},pp={pp},mbs=1,gbs={gbs},zero=1,recompute=none,sp={sp},dtype=bf16"
    ))?;
    let (b, l, s, h, v) = (
        gbs as f64,
        layers as f64,
        seq as f64,
        hidden as f64,
        vocab as f64,
    );
    let flops = 72.0 * b * l * s * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l));
    Ok(Case {
        label,
        model,
        cfg,
        cluster_spec,
        cluster,
        plan,
        software: MEGATRON_CORE.into(),
        figure: Figure::StepTime,
        measured: flops / (gpus as f64 * rate),
        short_run: false,
        tuned: true,
    })
}

/// NeMo 24.07's fp8 pretraining table on DGX H100 (`published/nemo_24_07_fp8_h100.csv`), and
/// NeMo 24.05's (`published/nemo_24_05_fp8_h100.csv`, the same columns, its virtual stages the
/// launcher's configurations'):
/// each run's layout as the table gives it ([`nemo_layout_case`]), the distributed optimizer
/// and no recomputation (not stated), under the `nemo` profile: NeMo's H100 scripts of the
/// time reduce GPT-3's and Llama's gradients in bf16 (the profile's default), Nemotron 8B's and
/// 22B's leave NeMo's fp32 default, and Nemotron-340B's training configuration sets
/// `grad_sync_dtype: bf16` itself (NeMo-Framework-Launcher
/// `launcher_scripts/conf/training/nemotron/nemotron_340b.yaml`, June 2024).
///
/// `launcher_attention` is FlashAttention 2 where the runs went through NeMo-Framework-Launcher
/// while its `launcher_scripts/conf/config.yaml` set `NVTE_FUSED_ATTN: 0` ("Disable cudnn FA
/// until we've tested it more": from 562dcb45, 2024-02-13, in every release tag 24.03 to
/// 24.07, until 04b8d098 "enable fused attention", 2024-08-29), which leaves Transformer
/// Engine the flash-attn package instead of cuDNN: the 24.05 table is that README's own, of
/// June 2024. The 24.07 table's figures were measured across the change (first published in
/// NeMo's documentation on 2024-08-14, the revision read on 2024-09-09, which is 1.8% and
/// 3.3% faster than the August one on the two runs where attention weighs most, Llama 2 7B
/// at 4K and Llama 3 8B at 8K tokens, and within 2% elsewhere) and are read with the
/// profile's cuDNN attention: 2.2% in the median, half the runs too fast; with
/// FlashAttention 2 they are 5.8% too slow in the median.
fn nemo_fp8_h100(rows: &[Line], launcher_attention: bool) -> Read {
    rows.iter()
        .map(|r| {
            let model = r.get("model");
            let reduce_fp32 = model.starts_with("Nemotron") && model != "Nemotron-340B";
            // NeMo-Framework-Launcher's GPT-3 configurations train with dropout 0.1
            // (`conf/training/gpt3/*.yaml`), its Llama and Nemotron ones without.
            let gpt3 = model.starts_with("GPT3");
            let software = match (reduce_fp32, launcher_attention, gpt3) {
                (true, false, _) => "nemo,reduce_dtype=fp32",
                (false, false, false) => "nemo",
                (false, false, true) => "nemo,dropout=true",
                (true, true, _) => "nemo,reduce_dtype=fp32,attention=flash",
                (false, true, false) => NEMO_LAUNCHER,
                (false, true, true) => "nemo,attention=flash,dropout=true",
            };
            nemo_layout_case(r, software, 1)
        })
        .collect()
}

/// NeMo run through NeMo-Framework-Launcher 24.03-24.07: FlashAttention 2 in place of cuDNN's
/// fused attention (`NVTE_FUSED_ATTN: 0`, [`nemo_fp8_h100`]).
const NEMO_LAUNCHER: &str = "nemo,attention=flash";

/// NeMo's long-sequence table on DGX H100 (`published/nemo_24_03_long_sequence_h100.csv`,
/// NeMo 24.03.01): Llama 2 7B in fp8 at 4K to 1M tokens per sequence with context
/// parallelism, each run's layout as given ([`nemo_layout_case`]), its measured TFLOP/s/GPU
/// turned into a step time by NeMo's own count ([`nemo_llama_flops`]), the distributed
/// optimizer, no recomputation and one sequence per micro-batch (not stated), under the
/// launcher of that release's attention ([`NEMO_LAUNCHER`]). Megatron-Core's context
/// parallelism is the `nemo` profile's ring of overlapped key/value exchanges.
fn nemo_long_sequence_h100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| nemo_layout_case(r, NEMO_LAUNCHER, 1))
        .collect()
}

/// NeMo's model FLOPs of a step of a gated-MLP (Llama) model, as its throughput figures count
/// them: `gbs s L h^2 (12 + 12 kv/heads + 18 ffn/h + 12 s/h + 6 V/(L h))` (NeMo
/// `nemo/utils/flops_formulas.py`, `llama2`/`llama3`), attention counted without the causal
/// mask.
fn nemo_llama_flops(cfg: &TransformerConfig, gbs: usize) -> f64 {
    let (s, l, h) = (cfg.seq as f64, cfg.layers as f64, cfg.hidden as f64);
    let groups = cfg.kv_heads as f64 / cfg.heads as f64;
    gbs as f64
        * s
        * l
        * h
        * h
        * (12.0
            + 12.0 * groups
            + 18.0 * cfg.ffn as f64 / h
            + 12.0 * s / h
            + 6.0 * cfg.vocab as f64 / (l * h))
}

/// Megatron-LM's Llama 3 fp8 examples on H100 (`published/megatron_lm_llama3_fp8_h100.csv`):
/// each run's layout ([`nemo_layout_case`]), the distributed optimizer and no recomputation
/// (not stated), under the `nemo` profile whose performance scripts the examples follow.
fn megatron_lm_llama3_fp8_h100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| nemo_layout_case(r, "nemo", 1))
        .collect()
}

/// Megatron-Bridge's fp8 (current scaling) pretraining rows on DGX H100
/// (`published/megatron_bridge_fp8_h100.csv`): each run's layout ([`nemo_layout_case`]),
/// Megatron-Core's FSDP (ZeRO-3) where the row gives an FSDP size and the distributed
/// optimizer otherwise, the whole of the first `recompute_layers` layers recomputed where
/// the release's recipe says so (none otherwise), under the `nemo` profile with the
/// weights in fp8 as its benchmarks keep them (`fp8_params`; gradients in bf16, the
/// profile's default).
fn megatron_bridge_fp8_h100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let zero = match r.int("fsdp") {
                Some(0) => 1,
                Some(_) => 3,
                None => return Err("the FSDP size is missing"),
            };
            let mut case = nemo_layout_case(r, "nemo,fp8_params=true", zero)?;
            if let Some(layers) = r.int("recompute_layers").filter(|n| *n > 0) {
                case.plan.recompute = Recompute::Full;
                case.plan.recompute_layers = Some(layers);
            }
            Ok(case)
        })
        .collect()
}

/// Megatron-Bridge's fp8 (current scaling) pretraining of Qwen3-235B-A22B on DGX H100
/// (`published/megatron_bridge_moe_fp8_h100.csv`): the layout as the table and its recipe
/// give it, with the experts folded over the two tensor-parallel ranks (etp=1, ep=32 over
/// dp=16, [`Plan::ep_over_tp`]), the embedding and the loss counted as layers in the
/// pipeline split (the first and last of the 32 virtual stages hold two layers, the others
/// three), the distributed optimizer, no recomputation, under the `nemo` profile with fp8
/// weights as the dense rows ([`megatron_bridge_fp8_h100`]), without the userbuffer
/// overlap of tensor-parallel communication the recipe turns off, and with the expert
/// all-to-alls overlapped as Megatron-Core's merged forward-backward step runs them
/// (`ep_comm_overlap`, the recipe's `moe_a2a_overlap`).
fn megatron_bridge_moe_fp8_h100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (head_dim, experts, top_k, vocab, seq) = (
                need("head_dim")?,
                need("experts")?,
                need("top_k")?,
                need("vocab")?,
                need("seq")?,
            );
            let (gpus, gbs, mbs) = (need("gpus")?, need("gbs")?, need("mbs")?);
            let (tp, pp, cp, vp, ep, etp) = (
                need("tp")?,
                need("pp")?,
                need("cp")?,
                need("vp")?,
                need("ep")?,
                need("etp")?,
            );
            let dp = data_parallel(gpus, tp * pp * cp)?;
            let tokens = r
                .num("tokens_per_s_per_gpu")
                .filter(|t| *t > 0.0)
                .ok_or("no measured throughput")?;
            let name = r.get("model");
            // Llama's shape (SwiGLU, RMSNorm, rotary, untied), `ffn` each expert's width.
            let (dense, words) = row_model(r, (seq, vocab), true, false)?;
            let layers = dense.layers;
            let cfg = TransformerConfig {
                head_dim: Some(head_dim),
                experts,
                top_k,
                ..dense
            };
            // The embedding and the loss count as one layer each in the split.
            let chunks = pp * vp;
            let per_chunk = (layers + 2) / chunks;
            if per_chunk < 2 || per_chunk * chunks != layers + 2 {
                return Err("the layers with the embedding and loss do not split evenly");
            }
            let stages: Vec<String> = (0..chunks)
                .map(|i| match i == 0 || i + 1 == chunks {
                    true => per_chunk - 1,
                    false => per_chunk,
                })
                .map(|n| n.to_string())
                .collect();
            let plan = plan(&format!(
                "dp={dp},tp={tp},pp={pp},cp={cp},vpp={vp},ep={ep},etp={etp},mbs={mbs},gbs={gbs},\
                 zero=1,recompute=none,dtype=fp8,sp=true,schedule=interleaved,stages={}",
                stages.join("-")
            ))?;
            let (cluster_spec, cluster) = nodes("dgx-h100", gpus)?;
            Ok(Case {
                label: format!(
                    "line {}: {name} on {gpus} GPUs ({})",
                    r.number,
                    r.get("release")
                ),
                model: format!(
                    "{words}; heads of {head_dim}, {experts} experts of that ffn, top-{top_k}"
                ),
                cfg,
                cluster_spec,
                cluster,
                plan,
                software: "nemo,fp8_params=true,tp_comm_overlap=false,ep_comm_overlap=true".into(),
                figure: Figure::StepTime,
                measured: (gbs * seq) as f64 / (gpus as f64 * tokens),
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// The data-parallel size of `gpus` GPUs laid out with `model_parallel` (tp x pp x cp) GPUs per
/// replica, or why the row's layout does not add up.
fn data_parallel(gpus: usize, model_parallel: usize) -> Result<usize, &'static str> {
    let dp = gpus / model_parallel.max(1);
    match dp > 0 && dp * model_parallel == gpus {
        true => Ok(dp),
        false => Err("the layout does not multiply to the GPU count"),
    }
}

/// The model of a published run's row: the shape columns `layers`, `hidden`, `heads`,
/// `kv_heads`, `ffn`, with `seq` and `vocab` given; a gated MLP (SwiGLU) with RMSNorm as in
/// Llama, or a plain one with LayerNorm as in GPT-3 and Nemotron; learned positions (and tied
/// embeddings, as GPT-3 has them) or rotary ones. Returns the description and its words.
fn row_model(
    r: &Line,
    (seq, vocab): (usize, usize),
    gated: bool,
    learned: bool,
) -> Result<(TransformerConfig, String), &'static str> {
    let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
    let (layers, hidden, heads, kv_heads, ffn) = (
        need("layers")?,
        need("hidden")?,
        need("heads")?,
        need("kv_heads")?,
        need("ffn")?,
    );
    let name = r.get("model");
    let cfg = TransformerConfig {
        kv_heads,
        ffn,
        gated_mlp: gated,
        tied_embeddings: learned,
        learned_positions: learned,
        rms_norm: gated,
        ..TransformerConfig::gpt(name, layers, hidden, heads, seq, vocab)
    };
    let words = format!(
        "{name}: {layers} layers, h {hidden}, {heads} heads ({kv_heads} kv), ffn {ffn} ({}, \
         {}), seq {seq}, vocab {vocab}",
        match gated {
            true => "SwiGLU, RMSNorm",
            false => "plain, LayerNorm",
        },
        match learned {
            true => "learned positions",
            false => "rotary",
        }
    );
    Ok((cfg, words))
}

/// The plan of a published run's layout: `(dp, tp, pp, cp, vpp)`, `(mbs, gbs)`, with
/// sequence parallelism under tensor parallelism and the interleaved schedule under virtual
/// stages, as Megatron-Core, NeMo and torchtitan run them.
fn layout_plan(
    (dp, tp, pp, cp, vpp): (usize, usize, usize, usize, usize),
    (mbs, gbs): (usize, usize),
    zero: usize,
    recompute: &str,
    dtype: &str,
) -> Result<Plan, &'static str> {
    let sp = if tp > 1 { ",sp=true" } else { "" };
    let schedule = if vpp > 1 { ",schedule=interleaved" } else { "" };
    plan(&format!(
        "dp={dp},tp={tp},pp={pp},cp={cp},vpp={vpp},mbs={mbs},gbs={gbs},zero={zero},\
         recompute={recompute},dtype={dtype}{sp}{schedule}"
    ))
}

/// One row of a NeMo-style fp8 performance table (model shape, GPU count, GBS, MBS, TP, PP,
/// CP, VP, tokens/s/GPU) as a case on DGX H100 under `software` at ZeRO stage `zero`: tensor
/// parallelism with sequence parallelism and virtual stages with the interleaved schedule,
/// as NeMo runs them.
fn nemo_layout_case(r: &Line, software: &'static str, zero: usize) -> Result<Case, &'static str> {
    let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
    let (vocab, seq, gpus, gbs, mbs) = (
        need("vocab")?,
        need("seq")?,
        need("gpus")?,
        need("gbs")?,
        need("mbs")?,
    );
    let (tp, pp, cp, vp) = (need("tp")?, need("pp")?, need("cp")?, need("vp")?);
    let dp = data_parallel(gpus, tp * pp * cp)?;
    // The gated models of these tables (Llama 2 and 3, Mixtral) normalise with RMSNorm,
    // the others (GPT-3, Nemotron) with LayerNorm.
    let (cfg, model) = row_model(
        r,
        (seq, vocab),
        r.get("gated_mlp") == "true",
        r.get("positions") == "learned",
    )?;
    let name = r.get("model");
    // Tokens per second per GPU, or NeMo's model TFLOP/s per GPU where that is the figure.
    let measured = match (r.num("tokens_per_s_per_gpu"), r.num("tflops_per_gpu")) {
        (Some(tokens), _) if tokens > 0.0 => (gbs * seq) as f64 / (gpus as f64 * tokens),
        (None, Some(tflops)) if tflops > 0.0 && cfg.gated_mlp => {
            nemo_llama_flops(&cfg, gbs) / (gpus as f64 * tflops * 1e12)
        }
        (None, Some(_)) if !cfg.gated_mlp => {
            return Err("NeMo's TFLOP/s count is read for gated-MLP (Llama) models only");
        }
        _ => return Err("no measured throughput"),
    };
    // A run on part of one node (4 GPUs) takes that many of its GPUs.
    let (cluster_spec, cluster) = match gpus < 8 && 8 % gpus == 0 {
        true => nodes("dgx-h100", 8)?,
        false => nodes("dgx-h100", gpus)?,
    };
    let plan = layout_plan((dp, tp, pp, cp, vp), (mbs, gbs), zero, "none", "fp8")?;
    Ok(Case {
        label: format!("line {}: {name} on {gpus} GPUs", r.number),
        model,
        cfg,
        cluster_spec,
        cluster,
        plan,
        software: software.into(),
        figure: Figure::StepTime,
        measured,
        short_run: false,
        tuned: false,
    })
}

/// torchtitan's published Llama 3.1 benchmarks (`published/torchtitan_llama3_h100.csv`) on
/// the 96 GB HBM2e H100 at 500 W they ran on (`hgx-h100-96gb`): FSDP2 as ZeRO-3 over the
/// data-parallel ranks (and, under context parallelism, over `dp x cp`, the `torchtitan`
/// profile's `zero_over_cp`), tensor parallelism with sequence parallelism, `torch.compile`
/// as fused element-wise work (`fusion=fused`), async TP as the pipelined tensor-parallel
/// collectives (`tp_comm_overlap`), float8 as `dtype=fp8`. Each data-parallel rank's batch
/// is split into as many micro-batches as there are pipeline ranks (torchtitan's default),
/// otherwise run whole.
fn torchtitan_llama3_h100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let flag = |k: &str| match r.get(k) {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err("a true/false column is not understood"),
            };
            let (vocab, seq, gpus, local) = (
                need("vocab")?,
                need("seq")?,
                need("gpus")?,
                need("local_batch")?,
            );
            let (fsdp, tp, pp, cp, vpp) = (
                need("fsdp")?,
                need("tp")?,
                need("pp")?,
                need("cp")?,
                need("vpp")?,
            );
            let tokens = r
                .num("tokens_per_s_per_gpu")
                .filter(|t| *t > 0.0)
                .ok_or("no measured throughput")?;
            if data_parallel(gpus, tp * pp * cp)? != fsdp {
                return Err("the layout does not multiply to the GPU count");
            }
            let recompute = match r.get("ac") {
                "selective" => "selective",
                "full" => "full",
                _ => return Err("activation checkpointing not understood"),
            };
            let software = match (flag("compile")?, flag("async_tp")?) {
                (false, false) => "torchtitan",
                (true, false) => "torchtitan,fusion=fused",
                (false, true) => "torchtitan,tp_comm_overlap=true",
                (true, true) => "torchtitan,fusion=fused,tp_comm_overlap=true",
            };
            let dtype = if flag("float8")? { "fp8" } else { "bf16" };
            if !local.is_multiple_of(pp) {
                return Err("the batch does not split into one micro-batch per stage");
            }
            let mbs = local / pp;
            let gbs = fsdp * local;
            let name = r.get("model");
            let (cfg, model) = row_model(r, (seq, vocab), true, false)?;
            let (cluster_spec, cluster) = nodes("hgx-h100-96gb", gpus)?;
            let plan = layout_plan((fsdp, tp, pp, cp, vpp), (mbs, gbs), 3, recompute, dtype)?;
            Ok(Case {
                label: format!(
                    "line {}: table {}, {name} on {gpus} GPUs, {software}, {dtype}",
                    r.number,
                    r.get("table")
                ),
                model,
                cfg,
                cluster_spec,
                cluster,
                plan,
                software: software.into(),
                figure: Figure::StepTime,
                measured: (gbs * seq) as f64 / (gpus as f64 * tokens),
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// The line rate of the DGX A100 preset's NICs (HDR InfiniBand), Gb/s: a row's NICs of
/// another rate get the preset's bus bandwidth per NIC in proportion.
const DGX_A100_NIC_GBPS: f64 = 200.0;

/// Megatron-DeepSpeed's production runs on A100 (`published/megatron_deepspeed_a100.csv`:
/// BLOOM-176B, MT-NLG 530B): seconds per iteration under the `deepspeed` profile (its
/// pipeline engine, synchronous transfers, bf16 gradients accumulated in fp32), on DGX A100
/// nodes with the row's NICs, full recomputation and the 1F1B schedule (DeepSpeed's pipeline
/// engine has no other), the distributed optimizer state sharded ZeRO-1 style.
fn megatron_deepspeed_a100(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (layers, hidden, heads, seq, vocab) = gpt_shape(r)?;
            let (nodes, gbs, mbs, tp, pp) = (
                need("nodes")?,
                need("gbs")?,
                need("mbs")?,
                need("tp")?,
                need("pp")?,
            );
            let (cluster_spec, mut cluster) = self::nodes("dgx-a100", nodes * 8)?;
            let nics = need("nics_per_node")?;
            let gbps = r
                .num("nic_gbps")
                .filter(|g| *g > 0.0)
                .ok_or("no NIC rate")?;
            if nics == 0 || nics > cluster.gpus_per_node {
                return Err("NIC count outside 1 to the GPUs of a node");
            }
            cluster.network.nics_per_node = nics;
            cluster.network.nic_bus_bandwidth_gb_per_s *= gbps / DGX_A100_NIC_GBPS;
            // ALiBi adds a bias to the attention scores and has no position embedding.
            let learned = match r.get("positions") {
                "learned" => true,
                "alibi" => false,
                _ => return Err("positions neither learned nor alibi"),
            };
            let (spec, base) = gpt(layers, hidden, heads, seq, vocab);
            let cfg = TransformerConfig {
                learned_positions: learned,
                ..base
            };
            let dp = data_parallel(nodes * 8, tp * pp)?;
            let dtype = match r.get("dtype") {
                d @ ("bf16" | "f16") => d,
                _ => return Err("dtype neither bf16 nor f16"),
            };
            let step = r
                .num("step_s")
                .filter(|t| *t > 0.0)
                .ok_or("no measured step")?;
            let nic_note = match gbps == DGX_A100_NIC_GBPS && nics == cluster.gpus_per_node {
                true => String::new(),
                false => format!(" with {nics}x {gbps} Gb/s NICs"),
            };
            Ok(Case {
                label: format!("line {}: {} on {} GPUs", r.number, r.get("run"), nodes * 8),
                model: format!("{spec} ({} positions)", r.get("positions")),
                cfg,
                cluster_spec: format!("{cluster_spec}{nic_note}"),
                cluster,
                plan: plan(&format!(
                    "dp={dp},tp={tp},pp={pp},mbs={mbs},gbs={gbs},zero=1,recompute=full,\
                     dtype={dtype}"
                ))?,
                software: DEEPSPEED_2021.into(),
                figure: Figure::StepTime,
                measured: step,
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// Megatron-Core r0.8's strong-scaling statement (`published/megatron_core_strong_scaling_h100.csv`):
/// the weak-scaling table's model and tensor/pipeline layout on fewer GPUs, under the same
/// assumptions as [`megatron_core_h100`].
fn megatron_core_strong_scaling(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (layers, hidden, heads, seq, vocab) = gpt_shape(r)?;
            let (gpus, gbs, tp, pp) = (need("gpus")?, need("gbs")?, need("tp")?, need("pp")?);
            let mfu = r
                .num("mfu_pct")
                .filter(|m| *m > 0.0)
                .ok_or("no measured MFU")?
                / 100.0;
            let dp = data_parallel(gpus, tp * pp)?;
            megatron_core_case(
                format!("line {}: {} on {gpus} GPUs", r.number, r.get("model")),
                r.get("model"),
                (layers, hidden, heads, seq, vocab),
                gpus,
                (dp, tp, pp, gbs),
                mfu * H100_BF16_PEAK,
            )
        })
        .collect()
}

/// H100 SXM's dense bf16 peak, the denominator of the MFU that NVIDIA's tables report.
const H100_BF16_PEAK: f64 = 989e12;

/// Llama 3 405B on H100 (`published/llama3_405b_h100.csv`): model TFLOP/s per GPU, the
/// paper's figure, against the model's (whose FLOP count is its own, as the paper's is).
/// Megatron-Core's profile stands in for Meta's stack ([`LLAMA3`]), with the layout of the
/// paper's Sec. 3.3.2: tp=8, pp=16, no recomputation, and eight virtual stages per rank of
/// one layer each but for the first, which holds the embedding alone, and the last, which
/// holds the head alone (`stages=0-1-...-1-0`).
fn llama3_405b(rows: &[Line]) -> Read {
    rows.iter()
        .map(|r| {
            let need = |k: &str| r.int(k).ok_or("a configuration column is missing");
            let (gpus, seq, dp, cp, gbs) = (
                need("gpus")?,
                need("seq")?,
                need("dp")?,
                need("cp")?,
                need("gbs")?,
            );
            let measured = r
                .num("tflops_per_gpu")
                .filter(|t| *t > 0.0)
                .ok_or("no measured TFLOP/s")?;
            if dp * 8 * 16 * cp != gpus {
                return Err("the layout does not multiply to the GPU count");
            }
            let cfg = TransformerConfig {
                kv_heads: 8,
                ffn: 53248,
                gated_mlp: true,
                tied_embeddings: false,
                learned_positions: false,
                rms_norm: true,
                ..TransformerConfig::gpt("llama3-405b", 126, 16384, 128, seq, 128256)
            };
            let (cluster_spec, cluster) = nodes("dgx-h100", gpus)?;
            let stages = std::iter::once("0")
                .chain(std::iter::repeat_n("1", cfg.layers))
                .chain(std::iter::once("0"))
                .collect::<Vec<_>>()
                .join("-");
            let plan = plan(&format!(
                "dp={dp},tp=8,pp=16,vpp=8,cp={cp},mbs=1,gbs={gbs},zero=1,sp=true,\
                 recompute=none,stages={stages}"
            ))?;
            Ok(Case {
                label: format!("line {}: {gpus} GPUs, seq {seq}", r.number),
                model: format!("llama3-405b:seq={seq}"),
                cfg,
                cluster_spec,
                cluster,
                plan,
                software: LLAMA3.into(),
                figure: Figure::ModelTflops,
                measured,
                short_run: false,
                tuned: false,
            })
        })
        .collect()
}

/// Per-call cost of a timed `torch.distributed.all_reduce` in ml-engineering's
/// `all_reduce_bench.py`, fitted on its sweep's small-message floor (see
/// [`mlengineering_allreduce`]).
const TORCH_DISTRIBUTED_CALL_S: f64 = 32e-6;

/// How much slower than a larger payload of its sweep a measured point may be before it is
/// read as not the collective's (run-to-run noise of a timed benchmark, generously: 20%).
const SWEEP_NOISE: f64 = 0.2;

/// All-reduce bus bandwidth (nccl-tests convention) against the cost model's collective time
/// for the same payload and GPU count, on the presets' GPUs (H100, H200, and B200 on the
/// `aws-p6-b200` preset the sweep's instances are).
/// NCCL's NVLink SHARP rows are kept (it is NCCL's default); rows run with
/// `NCCL_NVLS_ENABLE=0` are estimated without it.
///
/// The 4-node P6-B200 rows state no algorithm and are priced as NCCL's ring. On these
/// instances AWS's tuner plugin chooses by message size and rank count (aws-ofi-nccl
/// `src/tuner/nccl_ofi_regions.cpp`, `region_init_internal_p6`; at 32 ranks): trees with the
/// LL and LL128 protocols to 17.5 MiB, a ring with LL128 to 127.5 MiB, NVLink SHARP trees to
/// 415 MiB and the Simple ring above, where the sweep plateaus; every one of them takes
/// 0.35-0.6 ms at small sizes on these four EFA nodes. The cost model prices a tree across
/// nodes at the preset's per-step latency of InfiniBand (5 us, ten steps for 32 ranks),
/// which would put the small and medium rows 1.5-4.6x too fast; its ring (62 steps) is the
/// one form it has whose latency is of that order: within 1% on the plateau, 18-39% too fast
/// from 4 to 256 MiB, where the tuner's other algorithms run. An EFA latency per network
/// step and the tuner's table are what a closer model needs.
///
/// A row whose measured time is more than [`SWEEP_NOISE`] above the time of a larger
/// payload in the same sweep (same system, tool, GPU count and NVLS setting) is skipped: an
/// all-reduce of more bytes over the same GPUs does no less work, so no cost of the
/// collective falls with its size, and such a point records something else (the 4-node
/// sweep's 32 and 64 KiB points take 3-6 ms where 128 KiB to 2 MiB take 0.36-0.57 ms).
fn mlengineering_allreduce(rows: &[Line]) -> Vec<Result<Reading, &'static str>> {
    let sweep = |r: &Line| {
        (
            r.get("system").to_string(),
            r.get("tool").to_string(),
            r.get("gpus_total").to_string(),
            r.get("nvls_enabled").to_string(),
        )
    };
    // Measured seconds of a row: busbw = bytes * 2(n-1)/n / time.
    let seconds = |r: &Line| {
        let n = r.num("gpus_total")?;
        let bytes = r.num("payload_bytes")?;
        let busbw = r.num("busbw_GBps").filter(|b| *b > 0.0)?;
        (n > 1.0).then(|| bytes * 2.0 * (n - 1.0) / n / (busbw * 1e9))
    };
    let slower_than_larger = |r: &Line| {
        let (Some(t), Some(bytes)) = (seconds(r), r.num("payload_bytes")) else {
            return false;
        };
        rows.iter().any(|o| {
            sweep(o) == sweep(r)
                && o.num("payload_bytes").is_some_and(|b| b > bytes)
                && seconds(o).is_some_and(|u| t > u * (1.0 + SWEEP_NOISE))
        })
    };
    rows.iter()
        .map(|r| {
            if slower_than_larger(r) {
                return Err("measured time above a larger payload's in the same sweep");
            }
            let system = r.get("system");
            let kind = if system.contains("H200") {
                "hgx-h200"
            } else if system.contains("H100") {
                "dgx-h100"
            } else if system.to_ascii_lowercase().contains("p6-b200") {
                "aws-p6-b200"
            } else if system.contains("B200") {
                "dgx-b200"
            } else {
                return Err("accelerator without a cluster preset");
            };
            if r.get("collective") != "all_reduce" {
                return Err("collective not all-reduce");
            }
            let nodes = r
                .int("nodes")
                .filter(|&n| n >= 1)
                .ok_or("node count missing")?;
            let gpus = r.int("gpus_total").ok_or("GPU count missing")?;
            let per_node = r.int("gpus_per_node").unwrap_or(gpus);
            if gpus == 0 || per_node == 0 || per_node > 8 || gpus != nodes * per_node {
                return Err("GPU counts disagree");
            }
            let bytes = r.num("payload_bytes").ok_or("payload size not given")?;
            let measured = r.num("busbw_GBps").ok_or("no measured bandwidth")?;
            let preset = format!("{kind}:nodes={nodes}");
            let mut model =
                CostModel::new(Cluster::preset(&preset).map_err(|_| "no cluster preset")?);
            model.comm.nvls = r.get("nvls_enabled") != "False";
            // Where the row records the algorithm NCCL ran, it is the one estimated. Across
            // P6-B200 nodes the rows state none; they are priced as NCCL's ring (see above).
            let algo = r.get("nccl_algo");
            model.comm.force_algorithm = if algo.starts_with("NVLS") {
                Some(Algorithm::Nvls)
            } else if algo.starts_with("Ring") || (nodes > 1 && kind == "aws-p6-b200") {
                Some(Algorithm::Ring)
            } else {
                None
            };
            // all_reduce_bench.py times torch.distributed calls, each with its host dispatch
            // and a device synchronisation: the sweep's floor (47-51 us from 32 KiB to 1 MiB
            // on one node) less NCCL's LL ring latency on 8 GPUs (6.6 + 14 x 0.6 us, see
            // `comm::Protocol`) is that per-call cost, which nccl-tests' back-to-back
            // launches do not pay.
            if r.get("tool").contains("all_reduce_bench.py") {
                model.comm.launch_overhead_s = TORCH_DISTRIBUTED_CALL_S;
            }
            let group = GroupInfo {
                size: gpus,
                nodes_spanned: nodes,
                members_per_node: per_node,
                nics_per_group: if nodes > 1 { per_node } else { 0 },
                groups_per_nic: usize::from(nodes > 1),
            };
            let predicted =
                model
                    .comm
                    .bus_bandwidth(Collective::AllReduce, bytes, &group, &model.cluster)
                    / 1e9;
            Ok(Reading::Done(Box::new(RowResult {
                label: format!(
                    "line {}: {gpus} GPUs on {nodes} node(s) {} {}",
                    r.number,
                    r.get("payload_label"),
                    r.get("nccl_algo")
                ),
                model: format!("all-reduce of {bytes} bytes over {gpus} GPUs"),
                cluster: preset,
                plan: "-".into(),
                software: if model.comm.nvls {
                    DEFAULTS.to_string()
                } else {
                    "NCCL_NVLS_ENABLE=0".to_string()
                },
                figure: "all-reduce bus GB/s".into(),
                measured,
                predicted,
                error: predicted / measured - 1.0,
                fits: true,
                too_fast: predicted > measured,
            })))
        })
        .collect()
}

/// The message size at which nccl-tests reads a peak bus bandwidth where the source gives
/// none ("large", "run to 8G"): the top of its usual sweep, 8 GiB.
const PEAK_SWEEP_BYTES: f64 = 8.0 * (1u64 << 30) as f64;

/// A collective benchmark as the cost model prices it: on `nodes` nodes of `preset` (with
/// `nics` NICs per node where the system has fewer than the preset), `per_node` GPUs each,
/// all in one group; NVLink SHARP allowed or not, an algorithm imposed or not.
struct Bench {
    preset: &'static str,
    nodes: usize,
    per_node: usize,
    nics: Option<usize>,
    collective: Collective,
    bytes: f64,
    nvls: bool,
    algorithm: Option<Algorithm>,
}

impl Bench {
    /// The bus bandwidth (GB/s, nccl-tests' convention) the cost model predicts, and the
    /// cluster it priced it on.
    fn busbw(&self) -> Result<(f64, String), &'static str> {
        let spec = format!("{}:nodes={}", self.preset, self.nodes);
        let mut cluster = Cluster::preset(&spec).map_err(|_| "no cluster preset")?;
        let mut label = spec;
        if let Some(n) = self.nics {
            cluster.network.nics_per_node = n;
            label = format!("{label} with {n} NICs per node");
        }
        if self.per_node == 0 || self.per_node > cluster.gpus_per_node {
            return Err("GPU counts disagree");
        }
        let mut model = CostModel::new(cluster);
        model.comm.nvls = self.nvls;
        model.comm.force_algorithm = self.algorithm;
        let spans = self.nodes > 1;
        let group = GroupInfo {
            size: self.nodes * self.per_node,
            nodes_spanned: self.nodes,
            members_per_node: self.per_node,
            nics_per_group: if spans {
                self.per_node.min(model.cluster.network.nics_per_node)
            } else {
                0
            },
            groups_per_nic: usize::from(spans),
        };
        let bw = model
            .comm
            .bus_bandwidth(self.collective, self.bytes, &group, &model.cluster);
        Ok((bw / 1e9, label))
    }
}

/// A row of a bus-bandwidth table compared with the cost model.
fn busbw_row(
    label: String,
    bench: &Bench,
    measured: f64,
    per_nic: bool,
) -> Result<Reading, &'static str> {
    let (mut predicted, cluster) = bench.busbw()?;
    let mut figure = format!("{} bus GB/s", bench.collective.name());
    if per_nic {
        let nics = bench
            .nics
            .unwrap_or(bench.per_node)
            .min(bench.per_node)
            .max(1);
        predicted /= nics as f64;
        figure = format!("{} bus GB/s per NIC", bench.collective.name());
    }
    Ok(Reading::Done(Box::new(RowResult {
        label,
        model: format!(
            "{} of {} bytes over {} GPUs",
            bench.collective.name(),
            bench.bytes,
            bench.nodes * bench.per_node
        ),
        cluster,
        plan: "-".into(),
        software: match (bench.nvls, bench.algorithm) {
            (_, Some(a)) => format!("NCCL_ALGO={a:?}"),
            (false, None) => "NCCL_NVLS_ENABLE=0".into(),
            (true, None) => DEFAULTS.to_string(),
        },
        figure,
        measured,
        predicted,
        error: predicted / measured - 1.0,
        fits: true,
        too_fast: predicted > measured,
    })))
}

/// A figure such as `~230`, `48-49` or `~101 / ~100`: the middle of a range, the first of a
/// pair.
fn figure(text: &str) -> Option<f64> {
    let first = text.split('/').next()?.split_whitespace().next()?;
    let clean = |t: &str| {
        t.trim()
            .trim_matches(|c: char| c == '~' || c == '*')
            .to_string()
    };
    match first.split_once('-') {
        Some((a, b)) => {
            let (a, b): (f64, f64) = (clean(a).parse().ok()?, clean(b).parse().ok()?);
            Some(0.5 * (a + b))
        }
        None => clean(first).parse().ok(),
    }
}

/// A message size such as `1 GiB`, `256 MiB` or `8G`; a peak reading without one
/// ("large", "large (>256M)") is taken at the top of the sweep.
fn payload(text: &str) -> Option<f64> {
    let t = text.trim();
    if t.is_empty() || t.starts_with("large") {
        return Some(PEAK_SWEEP_BYTES);
    }
    let (num, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic())?);
    let n: f64 = num.trim().parse().ok()?;
    let scale = match unit.trim() {
        "KiB" | "K" => 1u64 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        _ => return None,
    };
    Some(n * scale as f64)
}

/// NCCL bus bandwidths stated by NCCL's maintainers or measured by users in nccl-tests
/// issues (`nccl_busbw_reference.csv`): all-reduce inside DGX A100 and H100 nodes, across
/// A100 nodes with 4, 8 or 1 HDR NICs, ring collectives on NVLink4, and one NDR NIC's
/// point-to-point rate. Sizes are the sweep's top (8 GiB) unless the row gives one; the
/// A100 nodes "with 4x HDR 200G NICs" are the DGX A100 preset with 4 NICs per node. The H800
/// row has no preset.
fn nccl_reference(rows: &[Line]) -> Vec<Result<Reading, &'static str>> {
    rows.iter()
        .map(|r| {
            let system = r.get("system");
            let scope = r.get("scope");
            let collective = r.get("collective");
            let measured = figure(r.get("busbw_GBps")).ok_or("no measured bandwidth")?;
            let preset = if system.contains("A100") || system.starts_with("any GPU node") {
                "dgx-a100"
            } else if system.contains("H100") || system.contains("ConnectX-7") {
                "dgx-h100"
            } else {
                return Err("accelerator without a cluster preset");
            };
            let nics = if system.contains("4x HDR") || system.contains("4x CX6") {
                Some(4)
            } else if system.starts_with("any GPU node") {
                Some(1)
            } else {
                None
            };
            let inter = scope.starts_with("inter-node") || scope.contains("nodes");
            let (coll, nvls, algorithm) = if collective.starts_with("p2p") {
                (Collective::SendRecv, false, None)
            } else if collective.starts_with("ring collectives") {
                (Collective::AllGather, false, None)
            } else if collective.starts_with("all_reduce") {
                (Collective::AllReduce, true, None)
            } else {
                return Err("collective not understood");
            };
            let bytes = if r.get("note").contains("-e 4G") {
                4.0 * (1u64 << 30) as f64
            } else {
                PEAK_SWEEP_BYTES
            };
            // One NIC's point-to-point rate: a pair of GPUs on two nodes.
            let per_node = if coll == Collective::SendRecv { 1 } else { 8 };
            let bench = Bench {
                preset,
                nodes: if inter { 2 } else { 1 },
                per_node,
                nics,
                collective: coll,
                bytes,
                nvls,
                algorithm,
            };
            let per_nic = scope == "inter-node" && coll == Collective::AllReduce;
            busbw_row(
                format!("line {}: {system}, {collective}, {scope}", r.number),
                &bench,
                measured,
                per_nic,
            )
        })
        .collect()
}

/// NCCL maintainers' expected bandwidths and users' measurements from NCCL issue threads
/// (`nccl_issue_reference_busbw.csv`): NVLS and ring all-reduce on 8 H100, per-NIC rates of
/// NDR and HDR all-reduce across nodes (at the smallest node count each row allows), and a
/// DGX A100 pair's 192 GB/s. The 2x8 H100 RoCE rows are left out: their author reports them
/// below what the hardware reaches (the thread's ~470 GB/s expectation), a configuration
/// fault rather than a property of the fabric.
fn nccl_issues(rows: &[Line]) -> Vec<Result<Reading, &'static str>> {
    rows.iter()
        .map(|r| {
            let system = r.get("system");
            if system.contains("RoCE") || r.get("system") == "same" {
                return Err("reported by its author as below the fabric's expected bandwidth");
            }
            let preset = if system.contains("H100") {
                "dgx-h100"
            } else if system.contains("A100") || system.starts_with("HDR") {
                "dgx-a100"
            } else {
                return Err("accelerator without a cluster preset");
            };
            let algo = r.get("algo");
            let nvls = algo.starts_with("NVLS");
            let algorithm = if nvls {
                Some(Algorithm::Nvls)
            } else if algo.starts_with("Ring") {
                Some(Algorithm::Ring)
            } else {
                None
            };
            // "8" GPUs: one node; "2+ nodes", "3+ nodes": that many; "multi-node": two.
            let gpus = r.get("gpus");
            let nodes = match gpus {
                "8" => 1,
                g if g.ends_with("nodes") => g
                    .trim_end_matches("nodes")
                    .trim()
                    .trim_end_matches('+')
                    .parse()
                    .map_err(|_| "node count not understood")?,
                _ => 2,
            };
            let bytes = payload(r.get("payload")).ok_or("payload size not understood")?;
            let (measured, per_nic) = match figure(r.get("busbw_GBps")) {
                Some(b) => (b, false),
                None => (
                    figure(r.get("per_nic_GBps")).ok_or("no measured bandwidth")?,
                    true,
                ),
            };
            let coll = if r.get("collective").starts_with("all_reduce") {
                Collective::AllReduce
            } else if r.get("collective").starts_with("non-allreduce") {
                Collective::AllGather
            } else {
                return Err("collective not understood");
            };
            let bench = Bench {
                preset,
                nodes,
                per_node: 8,
                nics: None,
                collective: coll,
                bytes,
                nvls,
                algorithm,
            };
            busbw_row(
                format!(
                    "line {}: {system}, {}, {algo}",
                    r.number,
                    r.get("collective")
                ),
                &bench,
                measured,
                per_nic,
            )
        })
        .collect()
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v))
}

fn signed_pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:+.1}%", 100.0 * v))
}

impl CalibrationReport {
    /// The report as text: per table its figure, the rows expressed and skipped (with
    /// reasons), median `|error|`, worst error with its row, and the fraction predicted too
    /// fast; then the same over every row. With `rows`, every estimated row too.
    pub fn render(&self, rows: bool) -> String {
        let mut out = String::new();
        let summary_line = |out: &mut String, s: &Summary| {
            let _ = writeln!(
                out,
                "  expressed {} / skipped {}; median |error| {}; worst {} ({}); too fast {}",
                s.expressed,
                s.skipped,
                pct(s.median_abs_error),
                signed_pct(s.worst_error),
                s.worst_row.as_deref().unwrap_or("-"),
                pct(s.too_fast),
            );
        };
        for t in &self.tables {
            let _ = writeln!(out, "{}", t.table);
            match &t.not_expressed {
                Some(why) if t.rows.is_empty() && t.skipped.len() <= 1 => {
                    let _ = writeln!(out, "  not expressed ({} rows): {why}", t.summary.skipped);
                    continue;
                }
                _ => {}
            }
            let _ = writeln!(out, "  figure: {}", t.figure);
            summary_line(&mut out, &t.summary);
            for s in &t.skipped {
                let _ = writeln!(out, "  skipped {}: {}", s.rows, s.reason);
            }
            if rows {
                for r in &t.rows {
                    let _ = writeln!(
                        out,
                        "    {:<48} measured {:>10.4} predicted {:>10.4} {:>+7.1}%{}",
                        r.label,
                        r.measured,
                        r.predicted,
                        100.0 * r.error,
                        if r.fits {
                            ""
                        } else {
                            "  (predicted not to fit)"
                        }
                    );
                }
            }
        }
        let _ = writeln!(out, "overall");
        summary_line(&mut out, &self.overall);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_may_be_quoted() {
        assert_eq!(
            split_csv_line(r#"a,"b, c",,"say ""hi""""#),
            vec!["a", "b, c", "", r#"say "hi""#]
        );
        let rows = csv("# note\nx,y\n1,~2\n3,4*\n");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].num("y"), Some(2.0));
        assert_eq!(rows[1].int("y"), Some(4));
        assert_eq!(rows[1].number, 4);
    }

    #[test]
    fn stated_figures_and_sizes_are_read() {
        assert_eq!(figure("~230"), Some(230.0));
        assert_eq!(figure("48-49 per NIC"), Some(48.5));
        assert_eq!(figure("~101 / ~100"), Some(101.0));
        assert_eq!(figure(""), None);
        assert_eq!(payload("1 GiB"), Some((1u64 << 30) as f64));
        assert_eq!(payload("256 MiB"), Some((256u64 << 20) as f64));
        assert_eq!(payload("large (>256M)"), Some(PEAK_SWEEP_BYTES));
        assert_eq!(payload("some"), None);
    }

    #[test]
    fn a_table_without_a_reader_is_listed_with_why() {
        let r = calibrate(&[("mystery.csv".into(), "a,b\n1,2\n".into())]);
        assert_eq!(
            r.tables[0].not_expressed.as_deref(),
            Some("no reader for this table")
        );
        assert_eq!(r.overall.expressed, 0);
        assert_eq!(r.overall.skipped, 1);
        assert!(r.overall.median_abs_error.is_none());
    }

    /// Resolves one model, `gpt-2l` (a 2-layer GPT), and the cluster presets.
    struct TwoLayers;

    impl Resolver for TwoLayers {
        fn model(&self, spec: &str) -> Result<TransformerConfig, String> {
            match spec {
                "gpt-2l" => Ok(gpt(2, 1024, 16, 2048, 50304).1),
                _ => Err(format!("unknown model `{spec}`")),
            }
        }

        fn cluster(&self, spec: &str) -> Result<Cluster, String> {
            Cluster::preset(spec).map_err(|e| e.to_string())
        }
    }

    fn step(spec: &str, plan: &str, software: Option<&str>) -> f64 {
        let cluster = Cluster::preset(spec).unwrap();
        let model = match software {
            Some(s) => with_software(cluster, s).unwrap(),
            None => CostModel::new(cluster),
        };
        let cfg = TwoLayers.model("gpt-2l").unwrap();
        model
            .estimate(&cfg, &Plan::parse(plan).unwrap())
            .unwrap()
            .iter_time_s
    }

    #[test]
    fn a_table_of_runs_is_read_whatever_its_name() {
        let autopar = step("dgx-h100:nodes=1", "dp=8,mbs=2,gbs=64", None);
        let mcore = step(
            "dgx-h100:nodes=1",
            "dp=4,tp=2,mbs=2,gbs=64",
            Some("megatron-core"),
        );
        assert!((autopar - mcore).abs() > 1e-9 * autopar);
        // Measured 10% slower and 1.2x faster than predicted, and as tokens per second per GPU
        // (on the plan's 8 of 16 GPUs) and over all.
        let tokens = 64.0 * 2048.0;
        let text = format!(
            "# my runs\n\
             label,model,cluster,plan,batch,software,step_s,tokens_per_s_per_gpu,tokens_per_s\n\
             a,gpt-2l,dgx-h100:nodes=1,\"dp=8,mbs=2\",64,,{},,\n\
             ,gpt-2l,dgx-h100:nodes=1,\"dp=4,tp=2,mbs=2,gbs=64\",,megatron-core,{},,\n\
             c,gpt-2l,dgx-h100:nodes=2,\"dp=8,mbs=2,gbs=64\",,,,{},\n\
             d,gpt-2l,dgx-h100:nodes=1,\"dp=8,mbs=2,gbs=64\",64,,,,{}\n",
            autopar * 1.1,
            mcore / 1.2,
            tokens / (autopar * 8.0),
            tokens / autopar,
        );
        let r = calibrate_with(&[("whatever.csv".into(), text)], &TwoLayers);
        let t = &r.tables[0];
        assert!(t.skipped.is_empty(), "{:?}", t.skipped);
        let errors: Vec<f64> = t.rows.iter().map(|r| r.error).collect();
        let want = [1.0 / 1.1 - 1.0, 0.2, 0.0, 0.0];
        for (e, w) in errors.iter().zip(want) {
            assert!((e - w).abs() < 1e-9, "{errors:?}");
        }
        assert_eq!(t.rows[0].label, "line 3: a");
        assert_eq!(t.rows[1].label, "line 4: gpt-2l on dgx-h100:nodes=1");
        assert_eq!(t.rows[0].software, "autopar");
        assert_eq!(t.rows[1].software, "megatron-core");
        assert!(t.rows[0].too_fast && !t.rows[1].too_fast);
        assert_eq!(t.figure, "step time s");
    }

    #[test]
    fn a_run_that_cannot_be_read_is_skipped_with_its_line_and_why() {
        let text = "model,cluster,plan,batch,software,step_s,tokens_per_s\n\
                    gpt-2l,dgx-h100:nodes=1,\"dp=8,foo=1\",64,,1,\n\
                    gpt-2l,dgx-h100:nodes=1,dp=8,,,1,\n\
                    gpt-2l,dgx-h100:nodes=1,dp=8,64,,1,5\n\
                    gpt-2l,dgx-h100:nodes=1,dp=8,64,,-1,\n\
                    gpt-9l,dgx-h100:nodes=1,dp=8,64,,1,\n\
                    gpt-2l,dgx-h900,dp=8,64,,1,\n\
                    gpt-2l,dgx-h100:nodes=1,\"dp=8,gbs=32\",64,,1,\n\
                    gpt-2l,dgx-h100:nodes=1,dp=8,64,\"fsdp,foo=1\",1,\n\
                    gpt-2l,dgx-h100:nodes=1,dp=16,64,,1,\n\
                    ,dgx-h100:nodes=1,dp=8,64,,1,\n";
        let r = calibrate_with(&[("mine.csv".into(), text.into())], &TwoLayers);
        let t = &r.tables[0];
        assert!(t.rows.is_empty());
        let why: Vec<&str> = t.skipped.iter().map(|s| s.reason.as_str()).collect();
        for (line, says) in [
            (2, "unknown key"),
            (3, "no global batch"),
            (4, "exactly one measurement"),
            (5, "not a positive number"),
            (6, "unknown model `gpt-9l`"),
            (7, "preset `dgx-h900`"),
            (8, "give it once"),
            (9, "software `fsdp,foo=1`"),
            (10, "the cost model refuses it"),
            (11, "no `model`"),
        ] {
            assert!(
                why.iter()
                    .any(|w| w.contains(&format!("line {line}:")) && w.contains(says)),
                "line {line} should say {says}: {why:#?}"
            );
        }
        assert_eq!(r.overall.skipped, 10);
    }

    #[test]
    fn a_runs_table_needs_its_columns_and_a_measurement() {
        assert!(is_runs_table("# note\nmodel,cluster,plan,step_s\n"));
        assert!(is_runs_table("label, model ,cluster,plan,tokens_per_s\n"));
        // Header names are trimmed when the rows are keyed, too.
        let rows = csv("label, model ,cluster\nx,gpt-2l,dgx-h100:nodes=1\n");
        assert_eq!(rows[0].get("model"), "gpt-2l");
        assert!(!is_runs_table("model,cluster,plan\n"));
        assert!(!is_runs_table("model,plan,step_s\n"));
        // The crate alone resolves presets, not model arguments.
        let r = calibrate(&[(
            "mine.csv".into(),
            "model,cluster,plan,step_s\ngpt-2l,dgx-h100:nodes=1,\"dp=8,gbs=8\",1\n".into(),
        )]);
        assert!(r.tables[0].skipped[0].reason.contains("autopar calibrate"));
    }

    #[test]
    fn summary_median_worst_and_sign() {
        let row = |e: f64| RowResult {
            label: format!("{e}"),
            model: String::new(),
            cluster: String::new(),
            plan: String::new(),
            software: String::new(),
            figure: String::new(),
            measured: 1.0,
            predicted: 1.0 + e,
            error: e,
            fits: true,
            too_fast: e < 0.0,
        };
        let rows = [row(-0.1), row(0.3), row(-0.2), row(0.05)];
        let s = Summary::of(&rows.iter().collect::<Vec<_>>(), 0);
        assert!((s.median_abs_error.unwrap() - 0.15).abs() < 1e-12);
        assert_eq!(s.worst_error, Some(0.3));
        assert_eq!(s.too_fast, Some(0.5));
    }
}
