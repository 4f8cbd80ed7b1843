//! Published training runs outside `shared/reference/`, as a check that the model carries
//! beyond the tables it is calibrated on: Llama 3 405B on 8,192 and 16,384 H100s (Dubey et
//! al., "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4: 430, 400 and 380 TFLOP/s
//! per GPU in bf16). Meta's stack is not public; Megatron-Core's profile stands in, with the
//! table's parallel layout, the interleaved schedule, and recomputation of one of each
//! chunk's two layers (the paper balances memory across stages but does not list its
//! recomputation). Each estimate is held within 12% of the measurement.
//!
//! NeMo 24.07's fp8 pretraining table on DGX H100 (github.com/NVIDIA/NeMo,
//! `docs/source/performance/performance_summary.md` as of commit 9c5c5e9709, since removed
//! from the repository): twelve runs with their whole layout (GBS, MBS, TP, PP, CP, VP) and
//! measured tokens/s/GPU. The model's step is too short on them by a median of 13%, on
//! every row (4-19%); the test holds that bias (median within 15%, each row within 20%) so
//! that it cannot grow unnoticed. Charging every fp8 GEMM for casting both its operands, as
//! the model did before, put them 24% too slow in the median and the large-tensor-parallel
//! rows 60-100% too slow.
//!
//! Megatron-Core r0.8's README (github.com/NVIDIA/Megatron-LM at f2e5db402c, "Training Speed
//! and Scalability"): its GPT-3 177B, strong-scaled from 96 to 4608 H100s at a batch of 1152
//! sequences, runs at 47% MFU on 96 GPUs, where tp=8 and pp=6 (the 177B row of its weak-scaling
//! table) leave data parallelism 2 and 576 micro-batches, so almost no bubble. The predicted
//! step is 18% short, the same bias; held within 20%.

use autopar_cost_model::{Cluster, CostModel, Plan, Software, TransformerConfig};

/// A decoder with rotary positions and untied embeddings: Llama's SwiGLU (`gated`) or
/// Nemotron's squared-ReLU MLP.
fn rotary(
    name: &str,
    (layers, hidden, heads, kv_heads, ffn): (usize, usize, usize, usize, usize),
    gated: bool,
    vocab: usize,
    seq: usize,
) -> TransformerConfig {
    TransformerConfig {
        kv_heads,
        ffn,
        gated_mlp: gated,
        tied_embeddings: false,
        learned_positions: false,
        ..TransformerConfig::gpt(name, layers, hidden, heads, seq, vocab)
    }
}

/// Llama 3 405B: 126 layers, h = 16384, 128 query and 8 key/value heads, SwiGLU of width
/// 53248, vocabulary 128256, untied, rotary positions.
fn llama3_405b(seq: usize) -> TransformerConfig {
    TransformerConfig {
        kv_heads: 8,
        ffn: 53248,
        gated_mlp: true,
        tied_embeddings: false,
        learned_positions: false,
        ..TransformerConfig::gpt("llama3-405b", 126, 16384, 128, seq, 128256)
    }
}

fn tflops(nodes: usize, seq: usize, plan: &str) -> f64 {
    let mut m =
        CostModel::new(Cluster::preset(&format!("dgx-h100:nodes={nodes}")).expect("preset"));
    Software::parse("megatron-core")
        .expect("profile")
        .apply(&mut m);
    let e = m
        .estimate(&llama3_405b(seq), &Plan::parse(plan).expect("plan"))
        .expect("estimate");
    assert!(e.fits, "{plan}: {:?}", e.fits_reason);
    e.model_tflops_per_gpu
}

#[test]
fn llama3_405b_on_h100s_within_12_percent() {
    // 16M tokens per step: 2,048 sequences of 8,192, or 128 of 131,072.
    let common = "tp=8,pp=16,vpp=4,mbs=1,zero=1,sp=true,recompute=full,recompute_layers=1";
    for (nodes, seq, layout, measured) in [
        (1024, 8192, "dp=64,cp=1,gbs=2048", 430.0),
        (2048, 8192, "dp=128,cp=1,gbs=2048", 400.0),
        (2048, 131072, "dp=8,cp=16,gbs=128", 380.0),
    ] {
        let plan = format!("{layout},{common}");
        let predicted = tflops(nodes, seq, &plan);
        let error = predicted / measured - 1.0;
        println!(
            "{nodes} nodes, seq {seq}: {predicted:.0} TFLOP/s against {measured} ({:+.1}%)",
            100.0 * error
        );
        assert!(error.abs() < 0.12, "{plan}: {predicted} vs {measured}");
    }
}

#[test]
fn nemo_24_07_fp8_pretraining_on_h100s_holds_its_bias() {
    let gpt3 = |name, layers, hidden, heads| {
        TransformerConfig::gpt(name, layers, hidden, heads, 2048, 50304)
    };
    let llama2 = |name, shape| rotary(name, shape, true, 32000, 4096);
    let nemotron = |name, shape| rotary(name, shape, false, 256000, 4096);
    let llama3 = |name, shape| rotary(name, shape, true, 128256, 8192);
    // The table's GPUs, layout and measured tokens/s/GPU; tensor parallelism runs with
    // sequence parallelism and virtual stages with the interleaved schedule, as NeMo does.
    let (seq, interleaved) = (",sp=true", ",schedule=interleaved");
    #[rustfmt::skip]
    let rows = [
        (gpt3("gpt3-5b", 24, 4096, 32), 64, "dp=64,mbs=4,gbs=2048", 23406.0),
        (gpt3("gpt3-20b", 44, 6144, 48), 64, "dp=32,tp=2,mbs=2,gbs=256", 5851.0),
        (gpt3("gpt3-175b", 96, 12288, 96), 128, "dp=4,tp=4,pp=8,vpp=6,gbs=256", 716.0),
        (gpt3("gpt3-175b", 96, 12288, 96), 512, "dp=16,tp=4,pp=8,vpp=6,mbs=2,gbs=2048", 825.0),
        (llama2("llama2-7b", (32, 4096, 32, 32, 11008)), 8, "dp=8,gbs=128", 16934.0),
        (llama2("llama2-13b", (40, 5120, 40, 40, 13824)), 16, "dp=4,pp=4,vpp=10,gbs=128", 8715.0),
        (llama2("llama2-70b", (80, 8192, 64, 8, 28672)), 64, "dp=4,tp=4,pp=4,vpp=20,gbs=128", 1728.0),
        (nemotron("nemotron-8b", (32, 4096, 32, 32, 16384)), 64, "dp=32,tp=2,mbs=4,gbs=256", 12507.0),
        (nemotron("nemotron-22b", (40, 6144, 48, 48, 24576)), 64, "dp=8,tp=2,pp=4,vpp=10,mbs=2,gbs=256", 4312.0),
        (nemotron("nemotron-340b", (96, 18432, 96, 8, 73728)), 128, "dp=2,tp=8,pp=8,vpp=12,gbs=32", 326.0),
        (llama3("llama3-8b", (32, 4096, 32, 8, 14336)), 8, "dp=4,cp=2,gbs=128", 12273.0),
        (llama3("llama3-70b", (80, 8192, 64, 8, 28672)), 64, "dp=2,tp=4,pp=4,cp=2,vpp=5,gbs=128", 1524.0),
    ];
    let mut errors = Vec::new();
    for (cfg, gpus, layout, measured) in rows {
        let mut plan = format!("{layout},zero=1,dtype=fp8");
        if layout.contains("tp=") {
            plan += seq;
        }
        if layout.contains("vpp=") {
            plan += interleaved;
        }
        let plan = Plan::parse(&plan).expect("plan");
        let mut m = CostModel::new(
            Cluster::preset(&format!("dgx-h100:nodes={}", gpus / 8)).expect("preset"),
        );
        Software::parse("nemo").expect("profile").apply(&mut m);
        let e = m.estimate(&cfg, &plan).expect("estimate");
        let predicted = (plan.global_batch * cfg.seq) as f64 / gpus as f64 / e.iter_time_s;
        // As the calibration report does: the error of the step time.
        let error = measured / predicted - 1.0;
        println!(
            "{} on {gpus}: {predicted:.0} tokens/s/GPU against {measured} (step {:+.1}%)",
            cfg.name,
            100.0 * error
        );
        assert!(
            error.abs() < 0.2,
            "{}: {plan}: {predicted} vs {measured}",
            cfg.name
        );
        errors.push(error.abs());
    }
    errors.sort_by(f64::total_cmp);
    let median = (errors[5] + errors[6]) / 2.0;
    assert!(median < 0.15, "median {median}");
}

#[test]
fn megatron_core_177b_on_96_h100s_holds_its_bias() {
    let cfg = TransformerConfig {
        tied_embeddings: false,
        learned_positions: false,
        ..TransformerConfig::gpt("gpt3-177b", 96, 12288, 96, 4096, 131072)
    };
    let plan = Plan::parse("dp=2,tp=8,pp=6,mbs=1,gbs=1152,zero=1,sp=true").expect("plan");
    let mut m = CostModel::new(Cluster::preset("dgx-h100:nodes=12").expect("preset"));
    Software::parse("megatron-core")
        .expect("profile")
        .apply(&mut m);
    let e = m.estimate(&cfg, &plan).expect("estimate");
    assert!(e.fits, "{:?}", e.fits_reason);
    // The README's MFU counts 72 B L s h^2 (1 + s/6h + V/12hL) FLOPs against 989 TFLOP/s.
    let (b, l, s, h, v) = (1152.0, 96.0, 4096.0, 12288.0, 131072.0);
    let flops = 72.0 * b * l * s * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l));
    let measured = flops / (96.0 * 0.47 * 989e12);
    let error = e.iter_time_s / measured - 1.0;
    println!(
        "177B on 96 H100: {:.1} s against {measured:.1} s ({:+.1}%)",
        e.iter_time_s,
        100.0 * error
    );
    assert!(error.abs() < 0.2, "{} vs {measured}", e.iter_time_s);
}
