//! Calibration against `shared/reference/` (beside the repository, at `../shared/reference`),
//! through the calibration report (`autopar_cost_model::calibrate`), which reads every
//! table's configurations and measurements from its file.
//!
//! Korthikanti et al. 2022 (arXiv:2205.05198) keep their long-standing bounds: iteration
//! times of Table 5 within 10% and per-layer times of Table 4 within 15%, under the software
//! of the time (unfused attention, gradient reduction after the backward). Every table is
//! also held to the median and worst error the cost model reaches on it
//! ([`every_table_holds_its_bounds`]), a little above today's figures, so that a change
//! which makes a table worse fails here.

use std::path::PathBuf;

use autopar_cost_model::calibrate;
use autopar_cost_model::calibrate::{CalibrationReport, TableReport};

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference")
}

fn tables() -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(reference_dir())
        .expect("shared/reference beside the repository")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "csv"))
        .map(|p| {
            let name = p
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read_to_string(&p).expect("readable"))
        })
        .collect();
    files.sort();
    files
}

fn report() -> CalibrationReport {
    calibrate(&tables())
}

fn table<'a>(r: &'a CalibrationReport, name: &str) -> &'a TableReport {
    r.tables
        .iter()
        .find(|t| t.table == name)
        .unwrap_or_else(|| panic!("no table {name}"))
}

fn worst(t: &TableReport) -> f64 {
    t.rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max)
}

#[test]
fn iteration_times_of_table_5_within_10_percent() {
    let r = report();
    let t = table(&r, "korthikanti2022_tables3_5_seqpar_selective");
    println!("{}", r.render(true));
    // Five configurations, full recompute and present work each; the DP=8 row has no
    // full-recompute measurement.
    assert_eq!(t.rows.len(), 9, "{:?}", t.skipped);
    assert_eq!(t.summary.skipped, 1);
    assert!(worst(t) <= 0.10, "worst error {:.1}%", 100.0 * worst(t));
}

#[test]
fn per_layer_times_of_table_4_within_15_percent() {
    let r = report();
    let t = table(&r, "korthikanti2022_table4_per_layer_22B");
    assert_eq!(t.rows.len(), 10, "{:?}", t.skipped);
    assert!(worst(t) <= 0.15, "worst error {:.1}%", 100.0 * worst(t));
}

#[test]
fn every_reference_table_is_read_and_the_megatron_tables_are_expressed() {
    let files = tables();
    let r = calibrate(&files);
    assert_eq!(r.tables.len(), files.len());
    for t in &r.tables {
        assert!(
            t.summary.expressed + t.summary.skipped > 0,
            "{} has no row",
            t.table
        );
        if t.rows.is_empty() {
            assert!(t.not_expressed.is_some(), "{} says why not", t.table);
        }
        if let Some(m) = t.summary.median_abs_error {
            assert!(m.is_finite(), "{}", t.table);
        }
    }
    for (name, rows) in [
        ("megatron_sc21_table1_weak_scaling_a100", 10),
        ("megatron_sc21_table2_zero3_vs_ptdp", 12),
        ("korthikanti2022_tables3_5_seqpar_selective", 9),
        ("korthikanti2022_table4_per_layer_22B", 10),
    ] {
        assert_eq!(table(&r, name).rows.len(), rows, "{name}");
    }
    // Every llm-foundry row is estimated, the fp8 ones (Transformer Engine on H100) too.
    let foundry = table(&r, "llmfoundry_mpt_benchmarks");
    assert_eq!(foundry.rows.len(), 216, "{:?}", foundry.skipped);
    assert_eq!(
        foundry
            .rows
            .iter()
            .filter(|r| r.plan.contains("dtype=fp8"))
            .count(),
        7
    );
    // The MoE block's rows, forward and backward: every Mixtral-proxy row, and the
    // DeepSeek proxy's (with its shared expert) under the all-to-all dispatcher; its flex
    // dispatcher rows (one copy of a token per destination rank) are not modelled.
    let moe = table(&r, "megatron_moe_layer_perf_baseline_h100");
    assert_eq!(moe.rows.len(), 16, "{:?}", moe.skipped);
    assert_eq!(
        moe.rows
            .iter()
            .filter(|r| r.model.contains("shared expert"))
            .count(),
        4
    );
    assert!(r.overall.median_abs_error.is_some_and(f64::is_finite));
    assert_eq!(
        r.overall.expressed,
        r.tables.iter().map(|t| t.rows.len()).sum::<usize>()
    );
}

/// Per table: (median |error| at most, worst |error| at most, share predicted too fast at
/// most). Today's figures, each with a little headroom: llm-foundry 4.3% / 29.1% (the 70B
/// on 64 A100-40GB; the H100 rows 8% too slow in the median at Hopper's sustained share,
/// `cluster::HOPPER_700W_SUSTAINED`, the fp8 ones 2-10%), Megatron-Core 5.4% / 14.2% (each
/// row at the fastest micro-batch size and number of virtual stages that fit, which the
/// README does not give: the 32B row's fp32 gradient reduce-scatter over 48 nodes hides under
/// a whole backward at micro-batch 4 and was 30% too slow at 1, and the pipelined rows'
/// MFU needs virtual stages; the 1.7B and 7.1B rows 12% and 5% too fast, the 16B and 32B,
/// with tp=4 and 8 and no pipeline, 5% and 14% too slow), SC'21 Table 1 4.0% / 5.8%, SC'21
/// Table 2 4.5% / 18.5% (PTD-P within
/// 5%, the 530B ZeRO-3 rows 18% too fast), Korthikanti Table 4 3.0% / 4.9% and Table 5
/// 2.0% / 5.1%, the all-reduce sweep 2.2% / 39.4% (4 B200 nodes over EFA at 4-256 MiB,
/// 18-39% too fast, a ring across nodes below its large-message rate that the model
/// does not explain; inside one node NVLS's medium-message steps bring 4 MiB-4 GiB within
/// 22%), the MAMF GEMMs
/// 4.5% / 12.5% (GH200 and A100 PCIe included), the NCCL maintainers' and users' bus
/// bandwidths 0.6% / 11.5% (2 nodes with 4 HDR NICs, 86 GB/s measured against the ring's
/// 96) and 0.2% / 1.9%, the Megatron-Core MoE block on 8 H100s with ep=8 4.2% / 14.2% (the
/// Mixtral proxy within 11%; the DeepSeek proxy's backward with its shared expert 14%
/// too slow).
const BOUNDS: [(&str, f64, f64, f64); 11] = [
    ("korthikanti2022_table4_per_layer_22B", 0.04, 0.06, 0.5),
    (
        "korthikanti2022_tables3_5_seqpar_selective",
        0.03,
        0.06,
        0.65,
    ),
    ("llmfoundry_mpt_benchmarks", 0.045, 0.30, 0.55),
    ("megatron_core_h100_weak_scaling_readme", 0.06, 0.16, 0.8),
    ("megatron_moe_layer_perf_baseline_h100", 0.05, 0.16, 0.3),
    ("megatron_sc21_table1_weak_scaling_a100", 0.045, 0.07, 0.95),
    ("megatron_sc21_table2_zero3_vs_ptdp", 0.055, 0.195, 0.85),
    ("mlengineering_allreduce_busbw", 0.03, 0.42, 0.8),
    ("mlengineering_mamf_gemm", 0.06, 0.14, 0.1),
    ("nccl_busbw_reference", 0.015, 0.13, 0.5),
    ("nccl_issue_reference_busbw", 0.01, 0.03, 0.5),
];

#[test]
fn every_table_holds_its_bounds() {
    let r = report();
    let mut failures = Vec::new();
    for (name, median, worst_bound, fast) in BOUNDS {
        let t = table(&r, name);
        let m = t.summary.median_abs_error.unwrap_or(f64::INFINITY);
        let w = worst(t);
        let f = t.summary.too_fast.unwrap_or(1.0);
        if m > median || w > worst_bound || f > fast {
            failures.push(format!(
                "{name}: median {:.1}% (bound {:.1}%), worst {:.1}% (bound {:.1}%), too fast {:.0}% \
                 (bound {:.0}%)",
                100.0 * m,
                100.0 * median,
                100.0 * w,
                100.0 * worst_bound,
                100.0 * f,
                100.0 * fast
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Every all-reduce row with a payload is expressed, B200 and multi-node included, but
    // the 4-node sweep's 32-128 KiB points, which took longer than 256 KiB did.
    let sweep = table(&r, "mlengineering_allreduce_busbw");
    assert_eq!(sweep.rows.len(), 58);
    let out_of_order = sweep
        .skipped
        .iter()
        .find(|s| s.reason.contains("larger payload"))
        .map_or(0, |s| s.rows);
    assert_eq!(out_of_order, 3, "{:?}", sweep.skipped);
    // Inside one node (NVLink rings, NVLink SHARP in chunked steps) every row is within 15%;
    // the 4-node EFA rows run algorithms the model does not price (see
    // `calibrate::mlengineering_allreduce`).
    for row in sweep
        .rows
        .iter()
        .filter(|r| r.label.contains("on 1 node(s)"))
    {
        assert!(
            row.error.abs() <= 0.15,
            "{}: {:.1}%",
            row.label,
            100.0 * row.error
        );
    }
    // The MAMF GEMMs of every NVIDIA part with a description (A100 SXM and PCIe, H100, H200,
    // GH200, B200), bf16 and fp8.
    assert_eq!(table(&r, "mlengineering_mamf_gemm").rows.len(), 9);
    // fp8 rows: estimated, within 20%.
    let foundry = table(&r, "llmfoundry_mpt_benchmarks");
    for row in foundry.rows.iter().filter(|r| r.plan.contains("dtype=fp8")) {
        assert!(
            row.error.abs() <= 0.20,
            "{}: {:.1}%",
            row.label,
            100.0 * row.error
        );
    }
}

/// DeepSpeed ZeRO-3 (SC'21 Table 2) gathers weights parameter by parameter, each gather a
/// ring over every data-parallel rank, on the critical path: its step does not get faster
/// from 768 to 1536 GPUs at the same batch (measured: 66.7 s both), where one overlapped
/// gather per layer would halve it. Each gather also copies its result out one kernel per
/// rank (the list `all_gather` of DeepSpeed's 2021 code), so the latency it pays grows with
/// the data-parallel size twice over; with it every ZeRO-3 row is predicted slower than its
/// PTD-P row, and the table stays within 6% median and 20% worst.
#[test]
fn zero3_under_deepspeed_stops_scaling_as_measured() {
    let r = report();
    let t = table(&r, "megatron_sc21_table2_zero3_vs_ptdp");
    let row = |label: &str| {
        t.rows
            .iter()
            .find(|r| r.label.ends_with(label))
            .unwrap_or_else(|| panic!("no row {label}"))
    };
    for (small, large) in [
        ("ZeRO-3 174.6B on 768 GPUs", "ZeRO-3 174.6B on 1536 GPUs"),
        ("ZeRO-3 529.6B on 1120 GPUs", "ZeRO-3 529.6B on 2240 GPUs"),
    ] {
        let (a, b) = (row(small), row(large));
        assert_eq!(a.software, "deepspeed");
        let speedup = a.predicted / b.predicted;
        assert!(
            speedup < 1.25,
            "{large} predicted {speedup:.2}x faster than {small}; measured {:.2}x",
            a.measured / b.measured
        );
    }
    // ZeRO-3 is measured slower than PTD-P on every model and GPU count: so is it predicted
    // (the 530B ZeRO-3 row on 640 GPUs stands against PTD-P's on 560).
    for (zero3, ptdp) in [
        ("174.6B on 384 GPUs", "174.6B on 384 GPUs"),
        ("174.6B on 768 GPUs", "174.6B on 768 GPUs"),
        ("174.6B on 1536 GPUs", "174.6B on 1536 GPUs"),
        ("529.6B on 640 GPUs", "529.6B on 560 GPUs"),
        ("529.6B on 1120 GPUs", "529.6B on 1120 GPUs"),
        ("529.6B on 2240 GPUs", "529.6B on 2240 GPUs"),
    ] {
        let (z, p) = (
            row(&format!("ZeRO-3 {zero3}")),
            row(&format!("PTD-P {ptdp}")),
        );
        assert!(z.measured > p.measured);
        assert!(
            z.predicted > p.predicted,
            "{zero3}: ZeRO-3 {} vs PTD-P {}",
            z.predicted,
            p.predicted
        );
    }
    let median = t.summary.median_abs_error.expect("a median");
    assert!(median <= 0.06, "median {:.1}%", 100.0 * median);
    assert!(worst(t) <= 0.20, "worst {:.1}%", 100.0 * worst(t));
}

/// Megatron-Core's README runs give no micro-batch size or virtual stages; the pipelined ones
/// are estimated with the interleaved schedule, which their MFU requires (the 177B model at
/// 44% on 2,304 GPUs, 24 sequences per 6-stage pipeline, against 47% with next to no bubble
/// on 96), and the others without pipeline stages at all.
#[test]
fn megatron_core_pipelined_runs_are_interleaved() {
    let r = report();
    let t = table(&r, "megatron_core_h100_weak_scaling_readme");
    assert_eq!(t.rows.len(), 9);
    for row in &t.rows {
        match row.plan.contains("pp=1,") {
            true => assert!(row.plan.contains("vpp=1,"), "{}", row.plan),
            false => assert!(row.plan.contains("schedule=interleaved"), "{}", row.plan),
        }
    }
}
