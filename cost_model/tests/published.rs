//! Published training runs outside `shared/reference/`, embedded in the crate
//! (`cost_model/published/`, each file opening with its source and caveats) and read by the
//! calibration report (`calibrate::published_tables`, `autopar calibrate --published`): a
//! check that the model carries beyond the tables it is calibrated on.
//!
//! - Llama 3 405B on 8,192 and 16,384 H100s (the Llama 3 paper's Table 4, model TFLOP/s per
//!   GPU), under Megatron-Core's profile with the paper's layout (Sec. 3.3.2: no activation
//!   checkpointing, eight one-layer virtual stages per rank with the embedding and the head
//!   in stages of their own, the keys and values all-gathered for context parallelism) and
//!   FlashAttention 2 (assumed): the 8K runs 8% too fast, the 131K one 12% too slow; held
//!   within 13%. (With one recomputed layer per chunk and four virtual stages, as assumed
//!   before the paper's text was read, they were 8-12% too slow.)
//! - NeMo 24.07's fp8 pretraining table on DGX H100 (twelve runs with their whole layout):
//!   2% in the median, each within 11% (GPT-3 175B on 512 GPUs the slow one); held within 4%
//!   and 13%. Charging every fp8 GEMM for casting both its operands, as the model did
//!   before, put these runs 24% too slow in the median and the large-tensor-parallel ones
//!   60-100%.
//! - NeMo 24.05's table (NeMo-Framework-Launcher's examples README; ten runs, their virtual
//!   stages the launcher's configurations'): the launcher of the time set
//!   `NVTE_FUSED_ATTN=0`, so FlashAttention 2 rather than cuDNN's attention; 2% in the
//!   median, each within 7%; held within 4% and 9%. (With cuDNN's attention the same layouts
//!   were nine of ten too fast, 4.5% in the median.)
//! - NeMo 24.03.01's long-sequence table (Llama 2 7B in fp8 at 4K to 1M tokens per sequence
//!   with context parallelism up to 32, on 4 to 1,024 H100s; NeMo's own TFLOP/s count) under
//!   the same launcher setting: 2% in the median, each within 7% and none too fast; held
//!   within 3% and 8%. Priced with cuDNN's attention, the runs at 16K and beyond were 18-34%
//!   too fast, each needing 1.6x more attention time: the table pins the attention kernel.
//! - Megatron-Core r0.8's GPT-3 177B at 47% MFU on 96 H100s (its README's strong scaling;
//!   tp=8, pp=6 leave 576 micro-batches, almost no bubble): 4.5% too fast; held within 7%.
//!   It is the run that pins Hopper's sustained share without any pipeline assumption.
//! - Megatron-Bridge's fp8 (current scaling) Llama 3 and 3.1 runs on DGX H100 (releases
//!   25.11 and 26.04.01, 8 to 1,024 GPUs, Megatron FSDP and the distributed optimizer, fp8
//!   weights): 6% in the median, the 8B with Megatron FSDP 14% too slow; held within 7% in
//!   the median and 15% each. Every run fits the 80 GB, as measured: the interleaved warm-up
//!   holds each chunk at its own size and fp8 GEMM inputs are kept a byte each.
//! - Megatron-Bridge's fp8 Qwen3-235B-A22B on 256 H100s (releases 25.11 to 26.04.01; tp=2,
//!   pp=8 with four virtual stages, the experts folded over the tensor-parallel ranks into
//!   ep=32, the expert all-to-alls overlapped by Megatron-Core's merged forward-backward
//!   step): 2% in the median, each within 7%; held within 4% and 9%. The all-to-alls across
//!   four nodes take more time than the step's compute; the model prices them at each rank's
//!   share of its NICs, hides each under the sub-block it is paired with, and pushes that
//!   sub-block's persistent GEMMs into second waves where the NCCL kernels take their SMs.
//!   Hiding them under untouched GEMMs put the runs 10-17% too fast; without the overlap
//!   they are 17% too slow.
//! - Megatron-LM's Llama 3 fp8 examples on H100 (its `examples/llama` README: 8B with cp=2 on
//!   8 GPUs, 70B on 64, 3.1 405B on 1,024, configured as NeMo's performance scripts): 5-7%
//!   too slow, each; held within 8%.
//! - torchtitan's Llama 3.1 benchmarks (8B, 70B and 405B on 8 to 512 H100s of 96 GB HBM2e at
//!   500 W: FSDP2, tensor, pipeline and context parallelism, eager or compiled, bf16 or
//!   float8): 6% in the median, the 8B runs without context or tensor parallelism within 3%.
//!   Full recomputation stops before the MLP's output GEMM (PyTorch's non-reentrant
//!   checkpoint), DTensor's sequence-parallel collectives pay their relayout copies,
//!   torchao's float8 TP gathers in fp8, and torch's async TP leaves the backward's
//!   reduce-scatters of summed input gradients unfused.
//!   What `torch.compile` buys is about reproduced (1.16x measured on 8 and 128 GPUs, 1.21x
//!   predicted: PyTorch eager's RMSNorm, rotary, `repeat_kv` and SwiGLU chains against
//!   fused kernels); without them, and at 700 W with HBM3, the 8B runs were 30-42% short.
//!   Three gaps are held rather than hidden: context parallelism (PyTorch's experimental ring
//!   attention, its eager fp32 merges and its one-shot gathers of the query-wide keys and
//!   values, under the first ring step only, priced) runs 3-32% slower than predicted, more
//!   with more ranks; the 405B runs under pipeline parallelism 8-10% (FSDP holds a stage's
//!   gathered weights over the step there, as torchtitan does, which puts their memory at
//!   80 GiB against the 73-83 measured where per-micro-batch gathers said 39); and async
//!   tensor parallelism, which gains 1.06-1.16x measured and 1.15-1.22x predicted (the 8B
//!   model at tp=8 9-13% short with it, within 8% without).
//! - Megatron-DeepSpeed's production runs on A100 80GB: BLOOM-176B on 384 GPUs of Jean Zay
//!   (4x 100 Gb/s Omni-Path per node) 6% short under the `deepspeed` profile, whose bf16
//!   optimizer accumulates each micro-batch's gradients into fp32 (13% short without it);
//!   MT-NLG 530B on 2,240 to 3,360 GPUs of Selene 21-24% short, held within 30%: the same
//!   layout ran 1.24x faster per micro-batch under Megatron-LM (SC'21 Table 2, which the
//!   model meets within 2%), a gap of DeepSpeed's engine the model has no mechanism for.

use autopar_cost_model::calibrate;
use autopar_cost_model::calibrate::{CalibrationReport, TableReport, published_tables};

fn report() -> CalibrationReport {
    let r = calibrate(&published_tables());
    println!("{}", r.render(true));
    r
}

fn table<'a>(r: &'a CalibrationReport, name: &str) -> &'a TableReport {
    let t = r
        .tables
        .iter()
        .find(|t| t.table == name)
        .unwrap_or_else(|| panic!("no table {name}"));
    assert!(t.skipped.is_empty(), "{name}: {:?}", t.skipped);
    t
}

/// The largest `|error|` of a table's rows.
fn worst(t: &TableReport) -> f64 {
    t.rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max)
}

/// Asserts that a table has `rows` runs, its median `|error|` below `median` and every run's
/// below `each`.
fn holds(t: &TableReport, rows: usize, median: f64, each: f64) {
    assert_eq!(t.rows.len(), rows, "{}", t.table);
    assert!(worst(t) < each, "{}: worst {}", t.table, worst(t));
    let m = t.summary.median_abs_error.unwrap_or(f64::INFINITY);
    assert!(m < median, "{}: median {m}", t.table);
}

#[test]
fn llama3_405b_on_h100s_within_13_percent() {
    let r = report();
    let t = table(&r, "llama3_405b_h100");
    assert_eq!(t.rows.len(), 3);
    // Without recomputation the memory of Megatron's interleaved order (every virtual stage
    // warmed up before the first backward) is above 80 GB; Meta's schedule runs a tunable
    // number of micro-batches per stage and holds fewer in flight. Time only, then.
    assert!(worst(t) < 0.13, "{}", worst(t));
}

/// The release before, run through NeMo-Framework-Launcher while it set `NVTE_FUSED_ATTN=0`:
/// FlashAttention 2 in place of cuDNN's attention. Priced with cuDNN's, nine of the ten runs
/// were too fast (4.5% in the median, Nemotron-8B 13%).
#[test]
fn nemo_24_05_fp8_pretraining_on_h100s_within_4_percent() {
    let r = report();
    let t = table(&r, "nemo_24_05_fp8_h100");
    holds(t, 10, 0.04, 0.09);
}

/// Context parallelism from 4K to 1M tokens per sequence: attention grows from a sixth of the
/// step to nine tenths, so the table pins the attention kernel's rate and the ring's
/// exposed exchanges. Priced with cuDNN's attention (which the launcher of the release
/// turned off), the runs at 16K tokens and beyond were 18-34% too fast, needing their
/// attention 1.6x slower on every one of them.
#[test]
fn nemo_long_sequence_llama2_with_context_parallelism_within_3_percent() {
    let r = report();
    let t = table(&r, "nemo_24_03_long_sequence_h100");
    holds(t, 9, 0.03, 0.08);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
}

#[test]
fn nemo_24_07_fp8_pretraining_on_h100s_within_4_percent() {
    let r = report();
    let t = table(&r, "nemo_24_07_fp8_h100");
    holds(t, 12, 0.04, 0.13);
}

#[test]
fn megatron_core_177b_on_96_h100s_within_7_percent() {
    let r = report();
    let t = table(&r, "megatron_core_strong_scaling_h100");
    assert_eq!(t.rows.len(), 1);
    assert!(t.rows[0].fits, "{:?}", t.rows[0]);
    assert!(worst(t) < 0.07, "{}", worst(t));
}

/// The 25.11 8B run (Megatron FSDP on 8 GPUs, 5 layers recomputed as its recipe says) is
/// the worst, 19% too slow: it ran with NCCL user buffers, which the model does not price,
/// and the second waves its ZeRO-3 gathers push the persistent GEMMs into are 1.3 ms of each
/// layer's 18.6 (without them it would be 3% off).
#[test]
fn megatron_bridge_fp8_llama_on_h100s_within_7_percent() {
    let r = report();
    let t = table(&r, "megatron_bridge_fp8_h100");
    holds(t, 5, 0.07, 0.20);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
}

/// Qwen3-235B-A22B with Megatron-Core's MoE parallel folding and its overlapped all-to-alls,
/// whose NCCL kernels push the persistent GEMMs beside them into second waves.
#[test]
fn megatron_bridge_fp8_qwen3_moe_on_h100s_within_4_percent() {
    let r = report();
    let t = table(&r, "megatron_bridge_moe_fp8_h100");
    holds(t, 5, 0.04, 0.09);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
}

/// The torchtitan rows of one table, by the `table N,` their labels carry.
fn torchtitan_rows<'a>(t: &'a TableReport, which: &str) -> Vec<&'a calibrate::RowResult> {
    t.rows
        .iter()
        .filter(|r| r.label.contains(&format!("table {which},")))
        .collect()
}

#[test]
fn torchtitan_llama3_on_h100s_holds_its_gaps() {
    let r = report();
    let t = table(&r, "torchtitan_llama3_h100");
    assert_eq!(t.rows.len(), 26);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
    // 6.4%: early-stopping recomputation, the relayout copies of DTensor's sequence-parallel
    // collectives, torchao's fp8 all-gathers and the backward's unfused async-TP
    // reduce-scatters (8.7% with none of them).
    let median = t.summary.median_abs_error.unwrap_or(f64::INFINITY);
    assert!(median < 0.08, "{median}");
    // Without context parallelism every run is within 20%.
    let cp = |row: &calibrate::RowResult| !row.plan.contains("cp=1,");
    for row in t.rows.iter().filter(|row| !cp(row)) {
        assert!(row.error.abs() < 0.20, "{row:?}");
    }
    // Context parallelism is predicted too fast, the more so the more ranks share a sequence
    // (the gap this table exposes, held so that it cannot grow unnoticed).
    for which in ["2", "6"] {
        let rows = torchtitan_rows(t, which);
        assert_eq!(rows.len(), 4, "table {which}");
        assert!(
            rows.iter().filter(|row| cp(row)).all(|row| row.too_fast),
            "{rows:?}"
        );
        assert!(rows[3].error < rows[1].error, "{rows:?}");
        assert!(rows.iter().all(|row| row.error > -0.40), "{rows:?}");
    }
}

/// What `torch.compile` buys the 8B model under FSDP (tables 1 and 3: eager against
/// compiled, both bf16) is predicted within 8% of what was measured (1.21-1.22x against
/// 1.16x): the eager chains of a Llama layer (RMSNorm in fp32, complex rotary, `repeat_kv`,
/// `silu(a) * b`) cost about what compilation removes. The prediction is the larger because
/// the compiled run is priced as hand-fused kernels (`fusion=fused`), and Inductor's
/// generated ones move somewhat more.
#[test]
fn torchtitan_compile_speedup_is_reproduced() {
    let r = report();
    let t = table(&r, "torchtitan_llama3_h100");
    for which in ["1", "3"] {
        let rows = torchtitan_rows(t, which);
        let (eager, compiled) = (rows[0], rows[1]);
        assert!(!eager.software.contains("fused") && compiled.software.contains("fused"));
        let measured = eager.measured / compiled.measured;
        let predicted = eager.predicted / compiled.predicted;
        assert!(measured > 1.1, "{measured}");
        assert!(
            (predicted / measured - 1.0).abs() < 0.08,
            "table {which}: compile speedup {predicted} predicted, {measured} measured"
        );
    }
}

#[test]
fn megatron_lm_llama3_fp8_examples_within_8_percent() {
    let r = report();
    let t = table(&r, "megatron_lm_llama3_fp8_h100");
    assert_eq!(t.rows.len(), 3);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
    assert!(worst(t) < 0.08, "{}", worst(t));
}

/// Megatron-DeepSpeed's production runs on A100: BLOOM-176B's iteration under the
/// `deepspeed` profile (its pipeline engine, awaited tensor-parallel all-reduces, and the bf16
/// optimizer's fp32 accumulation after every micro-batch, 6.6 s of the step) within 10%;
/// MT-NLG 530B's three scales 21-24% faster than measured, which is held, not hidden:
/// Megatron-LM ran the same layout on the same machine 1.24x faster per micro-batch (SC'21
/// Table 2), and that gap of DeepSpeed's engine has no mechanism in the model.
#[test]
fn megatron_deepspeed_runs_on_a100s_hold_their_gap() {
    let r = report();
    let t = table(&r, "megatron_deepspeed_a100");
    assert_eq!(t.rows.len(), 4);
    assert!(t.rows.iter().all(|row| row.fits), "{:?}", t.rows);
    let bloom = &t.rows[0];
    assert!(bloom.label.contains("BLOOM"), "{}", bloom.label);
    assert!(bloom.error.abs() < 0.10, "{}", bloom.error);
    for row in &t.rows[1..] {
        assert!(row.label.contains("MT-NLG"), "{}", row.label);
        assert!(
            row.too_fast && row.error > -0.30,
            "{}: {}",
            row.label,
            row.error
        );
    }
}
