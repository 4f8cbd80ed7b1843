//! Properties every estimate keeps, checked over a few thousand drawn configurations (GPU
//! presets, other instances of their GPUs and the CPU runtime; dense, MoE and shared-expert
//! shapes to 32K tokens; every parallelism, ZeRO stage, offload, recompute mode, dtype, layer
//! placement, mesh order and schedule; the software profiles and knob variants of them): a
//! step is finite and positive; a layer's second waves stay within its GEMMs; better
//! hardware (twice the NIC, NVLink, HBM, tensor-core, PCIe or host memory rate, half the
//! latencies, no power limit, not half the NICs) never makes it slower; moving the mesh's
//! single-rank axes in the order changes nothing; where no collective is pipelined with a split GEMM, the step with none of the
//! profile's overlap is never faster than the predicted one and no pass exposes more
//! communication than it issues; the pessimistic end of `plan`'s range is the slower of the
//! two steps, at the same memory; recomputing more or sharding deeper never buys time or
//! costs memory; twice the batch or one more layer per stage never shortens a step nor
//! needs less memory, nor does a larger micro-batch need less; and a model's FLOPs per
//! sequence do not depend on the layout. The search
//! ranks plans by these numbers, so a plan must never win by a cost model that rewards
//! slower hardware or prices a collective's overlap above the collective.
//!
//! The draws come from a fixed seed: a failure names the configuration, which reproduces.
//! `AUTOPAR_PROPERTY_SEED=N` (decimal) mixes `N` into every test's seed to draw
//! other configurations, for sweeping by hand; a failure then names the seed with the case.

use autopar_cost_model::software::Software;
use autopar_cost_model::{Cluster, CostModel, Plan, TransformerConfig};

/// A small deterministic generator (Knuth's MMIX LCG, high bits).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.next() as usize % v.len()]
    }
}

/// One drawn configuration: a model, a cluster, a plan and a profile the model accepts.
struct Case {
    cluster: Cluster,
    cfg: TransformerConfig,
    plan: Plan,
    software: &'static str,
}

impl Case {
    fn model(&self, cluster: Cluster) -> CostModel {
        let mut m = CostModel::new(cluster);
        Software::parse(self.software)
            .expect("a profile")
            .apply(&mut m);
        m
    }

    fn name(&self) -> String {
        let c = &self.cfg;
        let swept = match swept_seed() {
            0 => String::new(),
            s => format!(" [AUTOPAR_PROPERTY_SEED={s}]"),
        };
        format!(
            "{} on {} under {}: layers {} hidden {} heads {} (kv {}, dim {}) seq {} vocab {} \
             ffn {}{} experts {} (shared ffn {}){swept}",
            self.plan,
            self.cluster.name,
            self.software,
            c.layers,
            c.hidden,
            c.heads,
            c.kv_heads,
            c.head_dim(),
            c.seq,
            c.vocab,
            c.ffn,
            if c.gated_mlp { " gated" } else { "" },
            c.experts,
            c.shared_ffn,
        )
    }
}

/// The configurations of `draws` draws from `seed`, mixed with `AUTOPAR_PROPERTY_SEED` where
/// it is set (a draw that makes no case, none).
fn drawn(seed: u64, draws: usize) -> impl Iterator<Item = Case> {
    let mut d = Draw(seed ^ swept_seed());
    (0..draws).filter_map(move |_| draw(&mut d))
}

/// `AUTOPAR_PROPERTY_SEED`, or 0 (the committed draws) where it is unset.
fn swept_seed() -> u64 {
    let Ok(v) = std::env::var("AUTOPAR_PROPERTY_SEED") else {
        return 0;
    };
    v.parse()
        .unwrap_or_else(|_| panic!("AUTOPAR_PROPERTY_SEED={v} is not a decimal number"))
}

fn draw(d: &mut Draw) -> Option<Case> {
    let preset = d.pick(&[
        "dgx-a100",
        "dgx-a100-40gb",
        "dgx-h100",
        "hgx-h200",
        "dgx-b200",
        "aws-p5",
        "cpu",
    ]);
    let nodes = d.pick(&[1usize, 2, 4, 8, 16]);
    // The CPU runtime's ranks (threads of one process), eight for each node drawn; now and
    // then another instance of the same GPU, or a power limit.
    let preset = match (preset, d.pick(&[0, 0, 1, 2])) {
        ("dgx-a100", 1) => "aws-p4d",
        ("dgx-h100", 1) => "aws-p5en",
        ("dgx-h100", 2) => "hgx-h100-96gb",
        ("dgx-b200", 1) => "aws-p6-b200",
        (p, _) => p,
    };
    let spec = match preset {
        "cpu" => format!("cpu:ranks={}", 8 * nodes),
        "dgx-h100" if d.pick(&[false, false, true]) => format!("{preset}:nodes={nodes},power=500"),
        _ => format!("{preset}:nodes={nodes}"),
    };
    let cluster = Cluster::preset(&spec).expect("preset");
    let hidden = d.pick(&[1024usize, 2048, 4096, 8192]);
    let heads = hidden / 128;
    let mut cfg = TransformerConfig::gpt(
        "drawn",
        d.pick(&[8, 16, 24, 32, 48]),
        hidden,
        heads,
        d.pick(&[1024, 2048, 4096, 8192, 32768]),
        d.pick(&[32000, 128256]),
    );
    if d.pick(&[false, true]) {
        // Llama-style: grouped keys and values, SwiGLU, RMSNorm.
        cfg.kv_heads = heads / d.pick(&[1usize, 2, 4, 8]).min(heads);
        cfg.gated_mlp = true;
        cfg.rms_norm = true;
        cfg.ffn = hidden * 8 / 3 / 64 * 64;
    }
    if d.pick(&[false, false, true]) {
        cfg.experts = d.pick(&[8, 16]);
        cfg.top_k = 2;
        // A DeepSeekMoE-style shared expert beside the routed ones, now and then.
        cfg.shared_ffn = d.pick(&[0, 0, cfg.ffn / 4]);
    } else if d.pick(&[false, false, false, true]) {
        // Heads narrower than hidden / heads (Qwen3's, Gemma's shapes).
        cfg.head_dim = Some(64);
    }
    let (tp, pp, cp) = (
        d.pick(&[1usize, 2, 4, 8]),
        d.pick(&[1usize, 2, 4, 8]),
        d.pick(&[1usize, 1, 2, 4]),
    );
    let n = cluster.num_devices();
    if !n.is_multiple_of(tp * pp * cp) {
        return None;
    }
    let dp = n / (tp * pp * cp);
    let ep = match cfg.experts {
        0 | 1 => 1,
        _ => d.pick(&[1usize, 2, 4, 8]).min(dp),
    };
    let mbs = d.pick(&[1usize, 2]);
    let plan = format!(
        "dp={dp},tp={tp},pp={pp},cp={cp},ep={ep},vpp={},mbs={mbs},gbs={},zero={},recompute={},\
         dtype={},sp={}{}{}",
        if pp > 1 { d.pick(&[1, 2, 3]) } else { 1 },
        dp * mbs * d.pick(&[1, 4, 16]),
        d.pick(&[0, 1, 2, 3]),
        d.pick(&["none", "selective", "full"]),
        d.pick(&["bf16", "fp8"]),
        tp > 1 && d.pick(&[false, true]),
        // Rarer keys (a plan they do not fit is refused, and then not a case).
        d.pick(&[
            "",
            "",
            "",
            ",offload=optimizer",
            ",offload=params",
            ",etp=1",
            ",recompute_layers=2",
        ]),
        // Layer placements other than Megatron-LM's, other mesh orders, other schedules.
        d.pick(&[
            "",
            "",
            "",
            ",attn=seq",
            ",attn=ulysses,mlp=seq",
            ",attn=tts",
            ",order=pp-dp-ep-tp-cp",
            ",order=dp-pp-ep-cp-tp",
            ",schedule=gpipe",
        ]),
    );
    let plan = Plan::parse(&plan).ok()?;
    let software = d.pick(&[
        "autopar",
        "megatron-core",
        "megatron-core,ep_comm_overlap=true",
        "nemo",
        "nemo,tp_comm_overlap=true",
        "megatron-core,cp_attention=all_gather,selective=op",
        "megatron-core,fp8_params=true,overlap_param_gather=false",
        "fsdp",
        "fsdp,param_gather=tensor,fusion=eager",
        "torchtitan",
        "deepspeed",
        "deepspeed,overlap_param_gather=true",
        "megatron-lm-2021",
    ]);
    Some(Case {
        cluster,
        cfg,
        plan,
        software,
    })
}

/// The cluster with better hardware, one part at a time, each named.
fn better_hardware(c: &Cluster) -> Vec<(&'static str, Cluster)> {
    let mut out = Vec::new();
    let mut x = c.clone();
    x.network.nic_bus_bandwidth_gb_per_s *= 2.0;
    out.push(("twice the NIC bandwidth", x));
    let mut x = c.clone();
    x.intra_node.bus_bandwidth_gb_per_s *= 2.0;
    if let Some(a) = x.intra_node.nvls_algbw_gb_per_s.as_mut() {
        *a *= 2.0;
    }
    out.push(("twice the NVLink bandwidth", x));
    let mut x = c.clone();
    x.network.latency_us *= 0.5;
    x.intra_node.latency_us *= 0.5;
    out.push(("half the latencies", x));
    let mut x = c.clone();
    x.gpu.hbm_bandwidth_gb_per_s *= 2.0;
    out.push(("twice the HBM bandwidth", x));
    let mut x = c.clone();
    let p = &mut x.gpu.peak_tflops;
    (p.bf16, p.f16, p.f32) = (2.0 * p.bf16, 2.0 * p.f16, 2.0 * p.f32);
    for v in [p.fp8.as_mut(), p.tf32.as_mut()].into_iter().flatten() {
        *v *= 2.0;
    }
    if let Some(m) = x.gpu.mamf_tflops.as_mut() {
        m.bf16 *= 2.0;
        if let Some(f) = m.fp8.as_mut() {
            *f *= 2.0;
        }
    }
    out.push(("twice the tensor-core rate", x));
    if let Some(host) = &c.host {
        let mut x = c.clone();
        x.host = Some(autopar_cost_model::cluster::HostSpec {
            pcie_gb_per_s: 2.0 * host.pcie_gb_per_s,
            memory_bandwidth_gb_per_s: 2.0 * host.memory_bandwidth_gb_per_s,
            ..host.clone()
        });
        out.push(("twice the PCIe and host memory rates", x));
    }
    if c.gpu.power_limit_w.is_some() {
        let mut x = c.clone();
        x.gpu.power_limit_w = None;
        out.push(("no power limit", x));
    }
    out
}

/// Sums of the same terms in another order differ in the last bits; nothing else may.
const ROUNDING: f64 = 1e-6;

/// What an estimated step may be off by beyond [`ROUNDING`]: the pipeline schedule times its
/// actions in whole nanoseconds, a forward and a backward per micro-batch and virtual stage.
fn timeline_slack(e: &autopar_cost_model::Estimate) -> f64 {
    1e-9 * (2 * e.micro_batches * e.stage_layers.len().max(1)) as f64
}

/// Whether step `b` is no faster than step `a`, but for rounding.
fn no_faster(a: &autopar_cost_model::Estimate, b: &autopar_cost_model::Estimate) -> bool {
    b.iter_time_s >= a.iter_time_s * (1.0 - ROUNDING) - timeline_slack(a) - timeline_slack(b)
}

/// Each pipeline rank's activations (the busiest rank may differ between two plans).
fn activations_by_rank(e: &autopar_cost_model::Estimate) -> Vec<f64> {
    e.memory_per_pipeline_rank
        .iter()
        .map(|m| m.activations)
        .collect()
}

#[test]
fn estimates_keep_their_properties_over_drawn_configurations() {
    let mut checked = 0;
    for case in drawn(0x5eed_a070_9a12, 24000) {
        let base = case.model(case.cluster.clone());
        // A plan the model refuses (it does not divide the model) is not a case.
        let Ok(e) = base.estimate(&case.cfg, &case.plan) else {
            continue;
        };
        checked += 1;
        let name = case.name();
        let t = e.iter_time_s;
        assert!(t.is_finite() && t > 0.0, "step {t} for {name}");
        assert!(
            e.peak_memory_gib.is_finite() && e.peak_memory_gib > 0.0,
            "{name}"
        );
        // Megatron-Core's merged step pairs each expert all-to-all with a sub-block of the
        // other micro-batch, and the model splits what a pass leaves free between its
        // sub-blocks by their computation: faster GEMMs can move a little of that cover from
        // the block a dispatch hides under to the other (0.0013% of a step at most in the
        // drawn cases); nothing else may slow a step.
        let slack = match base.software.ep_comm_overlap
            && case.plan.overlaps_expert_all_to_alls(&case.cfg)
        {
            true => 1e-4,
            false => ROUNDING,
        };
        for (what, cluster) in better_hardware(&case.cluster) {
            let faster = case
                .model(cluster)
                .estimate(&case.cfg, &case.plan)
                .unwrap_or_else(|err| panic!("{what} refuses {name}: {err}"));
            assert!(
                faster.iter_time_s <= t * (1.0 + slack) + 2.0 * timeline_slack(&e),
                "{what} slows {name}: {t} s -> {} s",
                faster.iter_time_s
            );
        }
        // Half the NICs of a node (each left carrying two GPUs' traffic) never speed a step.
        if case.cluster.network.nics_per_node >= 2 && case.cluster.nodes > 1 {
            let mut fewer = case.cluster.clone();
            fewer.network.nics_per_node /= 2;
            let slower = case
                .model(fewer)
                .estimate(&case.cfg, &case.plan)
                .unwrap_or_else(|err| panic!("half the NICs refuse {name}: {err}"));
            assert!(
                slower.iter_time_s >= t * (1.0 - slack),
                "half the NICs speed {name}: {t} s -> {} s",
                slower.iter_time_s
            );
        }
        // Where an axis of the mesh sits in the order matters only if it has more than one
        // rank: moving the single-rank axes outermost changes no group, so no number.
        let mut reordered = case.plan.clone();
        let (single, many): (Vec<_>, Vec<_>) = case
            .plan
            .mesh_axes()
            .into_iter()
            .partition(|(_, n)| *n == 1);
        reordered.axis_order = single.into_iter().chain(many).map(|(a, _)| a).collect();
        let r = base
            .estimate(&case.cfg, &reordered)
            .expect("the same plan in another order");
        assert!(
            (r.iter_time_s / t - 1.0).abs() < ROUNDING && r.memory.total == e.memory.total,
            "single-rank axes moved outermost change {name}: {t} s -> {} s",
            r.iter_time_s
        );
        // The pessimistic end is the slower of the two steps, and overlap moves no memory,
        // so the search's memory bound (the no-overlap model's) holds for it.
        let none = base
            .without_overlap()
            .estimate(&case.cfg, &case.plan)
            .expect("the same plan");
        let worst = base
            .pessimistic()
            .estimate(&case.cfg, &case.plan)
            .expect("the same plan");
        assert_eq!(worst.iter_time_s, t.max(none.iter_time_s), "{name}");
        assert_eq!(none.peak_memory_gib, e.peak_memory_gib, "{name}");
        // A persistent GEMM spills its displaced tiles into one second wave however many
        // collectives take its SMs (a layer's forward and backward together, since the
        // expert all-to-alls of one run beside the other's GEMMs).
        let (f, b) = (&e.time.layer_forward, &e.time.layer_backward);
        assert!(
            f.second_wave_s + b.second_wave_s
                <= (f.gemm_s + b.gemm_s) * base.comm.persistent_gemm_slowdown * (1.0 + ROUNDING),
            "{name}: second waves {} + {} s beside {} + {} s of GEMMs",
            f.second_wave_s,
            b.second_wave_s,
            f.gemm_s,
            b.gemm_s
        );
        // GEMMs split to pipeline the tensor-parallel collectives (Transformer Engine's
        // userbuffers) may cost more than the collectives they hide; a collective beside
        // unsplit work never exposes more than itself, nor is any overlap slower than none.
        if !base.comm.overlap_tp_forward {
            let slow = base
                .without_overlap()
                .estimate(&case.cfg, &case.plan)
                .expect("the same plan");
            assert!(
                no_faster(&e, &slow),
                "without overlap {name} is faster: {t} s -> {} s",
                slow.iter_time_s
            );
            for pass in [&e.time.layer_forward, &e.time.layer_backward] {
                assert!(
                    pass.comm_exposed_s <= pass.comm_total_s * (1.0 + ROUNDING),
                    "{name} exposes {} s of the {} s it issues",
                    pass.comm_exposed_s,
                    pass.comm_total_s
                );
            }
        }
    }
    assert!(
        checked > 1500,
        "only {checked} drawn configurations were estimated"
    );
}

/// Faults the drawn configurations found, as fixed cases.
#[test]
fn found_by_the_drawn_configurations() {
    // A MoE block under --tp-comm-overlap: its grouped GEMMs cannot be split for
    // userbuffers, so the block's gathers stay NCCL's instead of pipelining with tiny
    // per-expert chunks (which exposed 3.2 ms of a 0.66 ms forward's communication).
    let mut cfg = TransformerConfig::gpt("moe", 16, 8192, 64, 1024, 32000);
    (cfg.experts, cfg.top_k) = (8, 2);
    let plan = Plan::parse("dp=1,tp=8,mbs=2,gbs=8,zero=2,recompute=full,sp=true").unwrap();
    let cluster = Cluster::preset("dgx-a100-40gb:nodes=1").unwrap();
    let mut m = CostModel::new(cluster);
    Software::parse("nemo").unwrap().apply(&mut m);
    let e = m.estimate(&cfg, &plan).unwrap();
    let f = &e.time.layer_forward;
    assert!(f.comm_exposed_s <= f.comm_total_s, "{f:?}");
    let slow = m.without_overlap().estimate(&cfg, &plan).unwrap();
    assert!(slow.iter_time_s >= e.iter_time_s);
    // A ZeRO-3 gather beside a window partly of exposed tensor-parallel communication: the
    // persistent GEMMs' second wave is counted over the GEMMs in the window, so it stays
    // below the GEMMs' own time, and a faster HBM (less memory-bound time in the window)
    // does not make the step slower.
    let cfg = TransformerConfig::gpt("small", 32, 1024, 8, 2048, 32000);
    let plan = Plan::parse("dp=32,tp=4,mbs=2,gbs=64,zero=3,recompute=selective,sp=true").unwrap();
    let cluster = Cluster::preset("dgx-b200:nodes=16").unwrap();
    let e = CostModel::new(cluster.clone())
        .estimate(&cfg, &plan)
        .unwrap();
    for pass in [&e.time.layer_forward, &e.time.layer_backward] {
        assert!(pass.second_wave_s <= pass.gemm_s, "{pass:?}");
    }
    // fp8 weight copies kept over a step are cast by the first micro-batch, which passes
    // through every stage before the pipeline fills: the step pays the casts once, so two
    // micro-batches never take less time than one (spread over the micro-batches, the casts
    // made a second micro-batch shorten an eight-stage step by 3%).
    let mut moe = TransformerConfig::gpt("moe", 32, 8192, 64, 4096, 32000);
    (moe.experts, moe.top_k) = (8, 2);
    let mut m = CostModel::new(Cluster::preset("aws-p5:nodes=2").unwrap());
    Software::parse("megatron-core").unwrap().apply(&mut m);
    let step = |gbs: usize| {
        let plan = Plan::parse(&format!(
            "pp=8,cp=2,mbs=1,gbs={gbs},recompute=full,dtype=fp8,order=dp-pp-ep-cp-tp"
        ))
        .unwrap();
        m.estimate(&moe, &plan).unwrap().iter_time_s
    };
    assert!(step(2) >= step(1), "{} -> {}", step(1), step(2));
    let mut fast = cluster;
    fast.gpu.hbm_bandwidth_gb_per_s *= 2.0;
    let f = CostModel::new(fast).estimate(&cfg, &plan).unwrap();
    no_slower(e.iter_time_s, f.iter_time_s);
    // The gradient buckets follow the order the backward produces the gradients in: the
    // first stage's embedding after its first layer, whatever the rounding of the layer's
    // end (half the latencies ended the layer an ulp after the embedding, which moved the
    // embedding's gradient into an earlier bucket and exposed 0.7 ms more of the reduction).
    let mut moe = TransformerConfig::gpt("moe", 8, 2048, 16, 32768, 32000);
    (moe.experts, moe.top_k, moe.shared_ffn) = (8, 2, 2048);
    let plan = Plan::parse("dp=4,tp=8,ep=4,mbs=2,gbs=8,recompute=selective,sp=true,schedule=gpipe")
        .unwrap();
    let cluster = Cluster::preset("dgx-a100:nodes=4").unwrap();
    let mut low = cluster.clone();
    low.network.latency_us *= 0.5;
    low.intra_node.latency_us *= 0.5;
    let step = |c: Cluster| CostModel::new(c).estimate(&moe, &plan).unwrap().iter_time_s;
    no_slower(step(cluster), step(low));
    // A replay that stops before the MLP's output GEMM (PyTorch's early stop) under a
    // profile that gathers weights module by module: it gathers the weights of what it
    // replays, hidden under what it replays, not under the skipped tail. Hiding it under the
    // whole forward let twice the NVLink bandwidth (less exposed tail) slow the step.
    let mut cfg = TransformerConfig::gpt("narrow-heads", 48, 4096, 32, 8192, 128256);
    cfg.head_dim = Some(64);
    let plan =
        Plan::parse("dp=4,tp=2,pp=8,cp=2,mbs=2,gbs=128,zero=3,recompute=full,offload=params")
            .unwrap();
    let cluster = Cluster::preset("dgx-a100-40gb:nodes=16").unwrap();
    let mut wide = cluster.clone();
    wide.intra_node.bus_bandwidth_gb_per_s *= 2.0;
    let step = |c: Cluster| {
        let mut m = CostModel::new(c);
        Software::parse("fsdp,param_gather=tensor,fusion=eager")
            .unwrap()
            .apply(&mut m);
        m.estimate(&cfg, &plan).unwrap().iter_time_s
    };
    no_slower(step(cluster), step(wide));
}

/// Asserts that better hardware's step (`after`) is no slower than the step `before`.
fn no_slower(before: f64, after: f64) {
    assert!(after <= before, "{before} s -> {after} s");
}

/// What the search trades time for memory with keeps its direction on every drawn
/// configuration: recomputing more never makes a step faster nor (in 16 bits) its
/// activations larger, and a deeper ZeRO stage never makes a pipeline rank's weights,
/// gradients and optimizer state larger.
#[test]
fn memory_trades_keep_their_direction_over_drawn_configurations() {
    use autopar_cost_model::{Estimate, Offload, Recompute};
    let mut checked = 0;
    for case in drawn(0x0dd_ba11, 9000) {
        let m = case.model(case.cluster.clone());
        let with = |f: &dyn Fn(&mut Plan)| {
            let mut p = case.plan.clone();
            f(&mut p);
            m.estimate(&case.cfg, &p).ok()
        };
        let by_recompute: Vec<_> = [Recompute::None, Recompute::Selective, Recompute::Full]
            .into_iter()
            .map(|r| with(&|p: &mut Plan| p.recompute = r))
            .collect();
        let by_zero: Vec<_> = (0..=3u8)
            .map(|z| with(&|p: &mut Plan| p.zero_stage = z))
            .collect();
        let name = case.name();
        let base = with(&|_: &mut Plan| ());
        // More work is never a shorter step nor fewer bytes: a deeper model (one more layer
        // on every virtual stage), twice the global batch (more micro-batches of the same
        // work). A larger micro-batch never needs less memory (its step may be shorter:
        // fewer, larger GEMMs).
        let no_less = |what: &str, more: Option<Estimate>, time: bool| {
            if let (Some(one), Some(more)) = (&base, more) {
                assert!(
                    !time || no_faster(one, &more),
                    "{what} is faster for {name}: {} s -> {} s",
                    one.iter_time_s,
                    more.iter_time_s
                );
                assert!(
                    more.peak_memory_gib >= one.peak_memory_gib * (1.0 - ROUNDING),
                    "{what} needs less memory for {name}"
                );
            }
        };
        let deeper = {
            let mut cfg = case.cfg.clone();
            cfg.layers += case.plan.pp * case.plan.vpp;
            m.estimate(&cfg, &case.plan).ok()
        };
        no_less("a deeper model", deeper, true);
        no_less(
            "twice the batch",
            with(&|p: &mut Plan| p.global_batch *= 2),
            true,
        );
        no_less(
            "twice the micro-batch",
            with(&|p: &mut Plan| {
                p.micro_batch_size *= 2;
                p.global_batch *= 2;
            }),
            false,
        );
        // Sequence parallelism shards what tensor parallelism replicates, and offloading the
        // optimizer moves state off the GPU: neither ever needs more of it.
        if case.plan.tp > 1
            && let (Some(sp), Some(no_sp)) = (
                with(&|p: &mut Plan| p.sequence_parallel = true),
                with(&|p: &mut Plan| p.sequence_parallel = false),
            )
        {
            for (rank, (a, b)) in activations_by_rank(&sp)
                .into_iter()
                .zip(activations_by_rank(&no_sp))
                .enumerate()
            {
                assert!(
                    a <= b * (1.0 + ROUNDING),
                    "sequence parallelism keeps more activations on pipeline rank {rank} for \
                     {name}: {b} -> {a} bytes"
                );
            }
        }
        // (Not so the parameters: their fp32 shards are copied up, two layers ahead, which
        // with few layers per rank or few data-parallel ranks outweighs the 16-bit shards
        // they stop keeping.)
        if let (Some(kept), Some(offloaded)) = (
            with(&|p: &mut Plan| p.offload = Offload::None),
            with(&|p: &mut Plan| p.offload = Offload::Optimizer),
        ) {
            assert!(
                offloaded.memory.total <= kept.memory.total * (1.0 + ROUNDING),
                "offloading the optimizer needs more GPU memory for {name}: {} -> {} bytes",
                kept.memory.total,
                offloaded.memory.total
            );
        }
        if let [Some(none), Some(sel), Some(full)] = &by_recompute[..] {
            checked += 1;
            // Megatron-Core refuses to hide the expert all-to-alls under the other
            // micro-batch with full recompute; where that overlap costs more than it hides
            // (a pass bound by ZeRO-3 gathers), recomputing everything turns it off.
            let overlap_off = m.software.ep_comm_overlap && {
                let mut p = case.plan.clone();
                p.recompute = Recompute::Selective;
                p.overlaps_expert_all_to_alls(&case.cfg)
            };
            for (less, more, what) in [(none, sel, "selective"), (sel, full, "full")] {
                if what == "full" && overlap_off {
                    continue;
                }
                assert!(
                    no_faster(less, more),
                    "{what} recompute is faster for {name}: {} s -> {} s",
                    less.iter_time_s,
                    more.iter_time_s
                );
                // Under fp8 a GEMM keeps the fp8 copy of its input (a byte an element) where
                // a per-op selective policy saves matmul outputs in 16 bits, so that policy
                // may keep a little more than keeping everything; in 16 bits it never does.
                let kept = activations_by_rank(less)
                    .into_iter()
                    .zip(activations_by_rank(more));
                for (rank, (a, b)) in kept.enumerate() {
                    assert!(
                        case.plan.fp8 || b <= a * (1.0 + ROUNDING),
                        "{what} recompute keeps more activations on pipeline rank {rank} for \
                         {name}: {a} -> {b} bytes"
                    );
                }
            }
        }
        // Each pipeline rank's own state (the busiest rank may differ between stages).
        let state = |e: &Estimate| -> Vec<f64> {
            e.memory_per_pipeline_rank
                .iter()
                .map(|m| m.weights + m.gradients + m.optimizer)
                .collect()
        };
        for (stage, pair) in by_zero.windows(2).enumerate() {
            if let [Some(shallow), Some(deep)] = pair {
                for (rank, (a, b)) in state(shallow).into_iter().zip(state(deep)).enumerate() {
                    assert!(
                        b <= a * (1.0 + ROUNDING),
                        "ZeRO {} holds more state than ZeRO {stage} on pipeline rank {rank} for \
                         {name}: {a} -> {b} bytes",
                        stage + 1,
                    );
                }
            }
        }
    }
    assert!(
        checked > 500,
        "only {checked} drawn configurations were estimated"
    );
}

/// A model's FLOPs per sequence are the model's, whatever the layout: every drawn plan
/// counts what pure data parallelism of the same model counts (work an op repeats on every
/// tensor-parallel rank, such as a MoE router without sequence parallelism, counted once).
#[test]
fn model_flops_do_not_depend_on_the_layout() {
    let mut checked = 0;
    for case in drawn(0xf10b5, 16000) {
        let m = case.model(case.cluster.clone());
        let per_sequence = |p: &Plan| {
            m.estimate(&case.cfg, p).ok().map(|e| {
                e.model_tflops_per_gpu * 1e12 * e.iter_time_s * e.num_gpus as f64
                    / p.global_batch as f64
            })
        };
        let n = case.cluster.num_devices();
        let flat = Plan::parse(&format!(
            "dp={n},mbs=1,gbs={n},dtype={}",
            if case.plan.fp8 { "fp8" } else { "bf16" }
        ))
        .expect("a plan");
        let (Some(a), Some(b)) = (per_sequence(&case.plan), per_sequence(&flat)) else {
            continue;
        };
        checked += 1;
        assert!(
            (a / b - 1.0).abs() < ROUNDING,
            "{}: {a} FLOPs per sequence against {b} under pure data parallelism",
            case.name()
        );
    }
    assert!(
        checked > 1000,
        "only {checked} drawn configurations were estimated"
    );
}
