//! End-to-end properties of the step estimate: the GPT-3 175B plans, memory
//! rejection with a reason, monotonicity in obvious directions, and the JSON contract.

use autopar_cost_model::{
    Cluster, CostModel, LayerPlacement, MeshMapping, Plan, Recompute, TransformerConfig,
};

fn a100(nodes: usize) -> CostModel {
    CostModel::new(Cluster::preset(&format!("dgx-a100:nodes={nodes}")).expect("preset"))
}

#[test]
fn gpt3_on_1024_a100s_fits_and_the_pure_data_parallel_plan_does_not() {
    let m = a100(128);
    let cfg = TransformerConfig::gpt3_175b();
    let plan =
        Plan::parse("dp=8,tp=8,pp=16,mbs=1,recompute=full,schedule=interleaved,vpp=2,gbs=1536")
            .unwrap();
    let e = m.estimate(&cfg, &plan).unwrap();
    assert!(e.fits, "{:?}", e.fits_reason);
    assert!(
        e.iter_time_s > 1.0 && e.iter_time_s < 100.0,
        "{}",
        e.iter_time_s
    );
    assert!(e.mfu > 0.2 && e.mfu < 0.7, "{}", e.mfu);
    assert!(e.hardware_tflops_per_gpu > e.model_tflops_per_gpu);
    assert!(e.cost.is_feasible());
    // Pure data parallelism over 1024 ranks: memory decides.
    let dp_only = Plan::parse("dp=1024,tp=1,pp=1,mbs=1,recompute=full,gbs=2048").unwrap();
    let e = m.estimate(&cfg, &dp_only).unwrap();
    assert!(!e.fits);
    assert!(!e.cost.is_feasible());
    let why = e.fits_reason.unwrap();
    assert!(why.contains("GiB") && why.contains("optimizer"), "{why}");
    assert!(e.peak_memory_gib > 1000.0);
}

#[test]
fn json_has_the_contract_fields() {
    let m = a100(1);
    let cfg = TransformerConfig::gpt("small", 4, 1024, 16, 1024, 51200);
    let e = m
        .estimate(&cfg, &Plan::parse("tp=2,dp=4,mbs=2,gbs=64").unwrap())
        .unwrap();
    let v = serde_json::to_value(&e).unwrap();
    for k in [
        "iter_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "peak_memory_gib",
        "fits",
        "memory",
        "time",
    ] {
        assert!(v.get(k).is_some(), "{k}");
    }
}

#[test]
fn obvious_directions() {
    let mut m = a100(8);
    // Unfused attention stores its scores, so selective recompute has something to drop.
    m.compute.attention = autopar_cost_model::AttentionKernel::Unfused;
    let cfg = TransformerConfig::gpt("13b", 40, 5120, 40, 2048, 51200);
    let est = |s: &str| m.estimate(&cfg, &Plan::parse(s).unwrap()).unwrap();
    let base = "tp=8,pp=4,dp=2,mbs=1,gbs=64";
    // Recompute trades time for memory.
    let none = est(&format!("{base},recompute=none"));
    let sel = est(&format!("{base},recompute=selective"));
    let full = est(&format!("{base},recompute=full"));
    assert!(none.iter_time_s < sel.iter_time_s && sel.iter_time_s < full.iter_time_s);
    assert!(none.memory.activations > sel.memory.activations);
    assert!(sel.memory.activations > full.memory.activations);
    assert!(
        (none.model_tflops_per_gpu * none.iter_time_s
            - full.model_tflops_per_gpu * full.iter_time_s)
            .abs()
            < 1e-6
    );
    // More micro-batches shrink the bubble's share.
    let few = est("tp=8,pp=4,dp=2,mbs=1,gbs=8");
    assert!(few.time.bubble_s / few.iter_time_s > none.time.bubble_s / none.iter_time_s);
    // Interleaving shrinks the bubble.
    let inter = est(&format!("{base},vpp=2"));
    assert!(inter.time.bubble_s < none.time.bubble_s);
    // GPipe holds every micro-batch.
    let gpipe = est(&format!("{base},schedule=gpipe"));
    assert!(gpipe.memory.activations > none.memory.activations);
    // ZeRO stages shrink the state.
    let z: Vec<_> = (0..=3)
        .map(|s| est(&format!("{base},zero={s}")).memory)
        .collect();
    assert!(z[1].optimizer < z[0].optimizer);
    assert!(z[2].gradients < z[1].gradients);
    assert!(z[3].weights < z[2].weights);
    assert_eq!(none.memory.in_flight, 4);
    assert_eq!(gpipe.memory.in_flight, 32);
    // Sequence parallelism divides the replicated activations.
    let sp = est(&format!("{base},sp=true"));
    assert!(sp.memory.activations < none.memory.activations);
    assert_eq!(
        full.memory.activations,
        full.memory.in_flight as f64 * 10.0 * 2.0 * 2048.0 * 5120.0
    );
    let _ = Recompute::Full;
}

/// Full recompute of some layers per virtual stage sits between none and all of them, in
/// time, FLOPs and stored activations, by exact layer counts.
#[test]
fn recomputing_some_layers_is_between_none_and_all() {
    let m = a100(8);
    let cfg = TransformerConfig::gpt("13b", 40, 5120, 40, 2048, 51200);
    let est = |s: &str| m.estimate(&cfg, &Plan::parse(s).unwrap()).unwrap();
    // 40 layers over 4 stages: 10 each.
    let base = "tp=8,pp=4,dp=2,mbs=1,gbs=64";
    let none = est(&format!("{base},recompute=none"));
    let full = est(&format!("{base},recompute=full"));
    let part = |n: usize| est(&format!("{base},recompute=full,recompute_layers={n}"));
    let (some, all) = (part(4), part(10));
    assert!(none.iter_time_s < some.iter_time_s && some.iter_time_s < full.iter_time_s);
    assert!(full.memory.activations < some.memory.activations);
    assert!(some.memory.activations < none.memory.activations);
    // Every layer of a stage is full recompute; more than a stage holds changes nothing.
    for same in [all, part(11)] {
        assert_eq!(same.iter_time_s, full.iter_time_s);
        assert_eq!(same.memory.activations, full.memory.activations);
    }
    // 4 of 10 layers: 40% of full recompute's extra FLOPs, stored activations 4/10 of the
    // way from no recompute to full.
    let extra = |e: &autopar_cost_model::Estimate| {
        (e.hardware_tflops_per_gpu - e.model_tflops_per_gpu) * e.iter_time_s
    };
    assert!((extra(&some) / extra(&full) - 0.4).abs() < 1e-9);
    let share = (none.memory.activations - some.memory.activations)
        / (none.memory.activations - full.memory.activations);
    assert!((share - 0.4).abs() < 1e-9, "{share}");
    // More recomputed layers, more time.
    assert!(part(2).iter_time_s < some.iter_time_s && some.iter_time_s < part(6).iter_time_s);
}

#[test]
fn plans_that_do_not_divide_are_errors() {
    let m = a100(1);
    let cfg = TransformerConfig::gpt("small", 4, 1024, 16, 1024, 51200);
    for s in ["tp=3", "pp=8", "dp=16", "ep=2,dp=2", "tp=2,cp=3"] {
        assert!(m.estimate(&cfg, &Plan::parse(s).unwrap()).is_err(), "{s}");
    }
}

#[test]
fn cpu_cluster_estimates_a_tiny_model() {
    let m = CostModel::new(Cluster::preset("cpu:ranks=8").unwrap());
    let cfg = TransformerConfig::gpt("gpt-tiny", 2, 64, 4, 32, 256);
    let e = m
        .estimate(&cfg, &Plan::parse("dp=2,tp=2,pp=2,mbs=1,gbs=8").unwrap())
        .unwrap();
    assert!(e.fits);
    assert!(
        e.iter_time_s > 0.0 && e.iter_time_s < 1.0,
        "{}",
        e.iter_time_s
    );
}

#[test]
fn a_caller_built_mapping_gives_the_same_estimate() {
    use autopar_cost_model::MeshMapping;
    use autopar_ir::schedule::Schedule;
    let m = a100(16);
    let cfg = TransformerConfig::gpt("small", 8, 2048, 16, 2048, 51200);
    let plan = Plan::parse("dp=8,tp=4,pp=4,mbs=2,gbs=64,order=tp-dp").unwrap();
    let schedule = Schedule::new(plan.schedule, plan.pp, plan.vpp, plan.micro_batches()).unwrap();
    let mapping = MeshMapping::new(&plan.mesh_axes(), &m.cluster).unwrap();
    let with = m
        .estimate_with_mapping(&cfg, &plan, &schedule, &mapping)
        .unwrap();
    assert_eq!(with, m.estimate(&cfg, &plan).unwrap());
    // A mapping of other axes is refused.
    let other = Plan::parse("dp=4,tp=8,pp=4,gbs=64").unwrap();
    let wrong = MeshMapping::new(&other.mesh_axes(), &m.cluster).unwrap();
    assert!(
        m.estimate_with_mapping(&cfg, &plan, &schedule, &wrong)
            .is_err()
    );
}

#[test]
fn zero2_pays_a_reduce_scatter_per_micro_batch() {
    // ZeRO-2 holds a gradient shard only, so with several micro-batches it communicates more
    // than ZeRO-1 (which accumulates into a full buffer) and holds less.
    let m = a100(4);
    let cfg = TransformerConfig::gpt("small", 8, 4096, 32, 2048, 51200);
    let z1 = Plan::parse("dp=8,tp=4,mbs=1,gbs=64,zero=1").unwrap();
    let z2 = Plan {
        zero_stage: 2,
        ..z1.clone()
    };
    let (e1, e2) = (
        m.estimate(&cfg, &z1).unwrap(),
        m.estimate(&cfg, &z2).unwrap(),
    );
    assert!(e2.time.layer_backward.comm_total_s > e1.time.layer_backward.comm_total_s);
    assert!(e2.memory.gradients < e1.memory.gradients);
    // With nothing overlapped the extra traffic is all on the step; overlapped, ZeRO-2's
    // per-micro-batch reduce-scatters hide under each backward where ZeRO-1's one reduction
    // waits for the last, so the two come out about even.
    let bare = m.without_overlap();
    let (b1, b2) = (
        bare.estimate(&cfg, &z1).unwrap(),
        bare.estimate(&cfg, &z2).unwrap(),
    );
    assert!(b2.iter_time_s > b1.iter_time_s);
    assert!((e2.iter_time_s / e1.iter_time_s - 1.0).abs() < 0.05);
}

#[test]
fn stage_times_are_what_the_estimate_feeds_the_schedule() {
    use autopar_cost_model::MeshMapping;
    let m = a100(16);
    let cfg = TransformerConfig::gpt("small", 12, 2048, 16, 2048, 51200);
    let plan = Plan::parse("dp=4,tp=4,pp=8,vpp=1,mbs=1,gbs=64,recompute=full").unwrap();
    let mapping = MeshMapping::new(&plan.mesh_axes(), &m.cluster).unwrap();
    let st = m.stage_times(&cfg, &plan, &mapping).unwrap();
    let e = m.estimate(&cfg, &plan).unwrap();
    assert_eq!(st.forward_s, e.time.stage_forward_s);
    assert_eq!(st.backward_s, e.time.stage_backward_s);
}

#[test]
fn mlp_on_sequence_shards_trades_activation_traffic_for_replicated_weights() {
    let m = a100(1);
    let cfg = TransformerConfig::gpt("1.3b", 24, 2048, 16, 2048, 51200);
    let megatron = Plan::parse("dp=1,tp=8,mbs=4,gbs=32,sp=true").unwrap();
    let seq = Plan::parse("dp=1,tp=8,mbs=4,gbs=32,sp=true,mlp=seq").unwrap();
    assert_eq!(Plan::parse(&seq.to_string()).unwrap(), seq);
    let (a, b) = (
        m.estimate(&cfg, &megatron).unwrap(),
        m.estimate(&cfg, &seq).unwrap(),
    );
    let (fa, fb) = (&a.time.layer_forward, &b.time.layer_forward);
    // Half the tensor-parallel collectives (attention's only), the same GEMM work.
    assert!(
        fb.exposed_by.tp_s < 0.6 * fa.exposed_by.tp_s,
        "{fa:?} {fb:?}"
    );
    assert!(
        (fb.gemm_s - fa.gemm_s).abs() < 0.25 * fa.gemm_s,
        "{fa:?} {fb:?}"
    );
    // Whole MLP weights on every rank.
    assert!(b.memory.num_params > 2.0 * a.memory.num_params);
    // The placement needs tensor parallelism and a dense MLP.
    assert!(Plan::parse("mlp=seq").is_err());
    let mut moe = cfg.clone();
    moe.experts = 8;
    moe.top_k = 2;
    assert!(m.estimate(&moe, &seq).is_err());
}

/// A grouped-query model: 64 query heads sharing 8 key/value heads.
fn gqa() -> TransformerConfig {
    TransformerConfig {
        kv_heads: 8,
        gated_mlp: true,
        ffn: 28672,
        ..TransformerConfig::gpt("gqa", 8, 8192, 64, 4096, 128256)
    }
}

#[test]
fn attention_placements_move_what_their_layouts_need() {
    let m = a100(1);
    let cfg = gqa();
    let at = |attn: &str| {
        let p = Plan::parse(&format!("tp=8,mbs=1,gbs=8,sp=true,attn={attn}")).unwrap();
        assert_eq!(Plan::parse(&p.to_string()).unwrap(), p);
        m.estimate(&cfg, &p).unwrap()
    };
    let (megatron, ulysses, gathered) = (at("tp"), at("ulysses"), at("seq"));
    let tp_fwd = |e: &autopar_cost_model::Estimate| e.time.layer_forward.exposed_by.tp_s;
    // Ulysses' all-to-alls move 1/tp of what the gathers and reductions move; gathering the
    // 8 key/value heads moves less than the hidden state, and the MLP's collectives remain.
    assert!(tp_fwd(&ulysses) < tp_fwd(&megatron), "{ulysses:?}");
    assert!(tp_fwd(&gathered) < tp_fwd(&megatron), "{gathered:?}");
    // Both replicate the attention weights over tp; the gathered keys and values are kept.
    assert!(ulysses.memory.num_params > megatron.memory.num_params);
    assert!(gathered.memory.activations > ulysses.memory.activations);
    // The attention core's queries cannot also be split by context parallelism.
    let cp = Plan::parse("tp=4,cp=2,mbs=1,gbs=8,sp=true,attn=sss").unwrap();
    let err = m.estimate(&cfg, &cp).unwrap_err().to_string();
    assert!(err.contains("context"), "{err}");
}

#[test]
fn a_beaten_layer_placement_is_never_faster_or_smaller() {
    // For plans of several shapes, every recompute policy and ZeRO stage: a placement that
    // another beats in the layer profile is no faster and holds no less.
    let m = a100(2);
    let cfg = gqa();
    for text in [
        "dp=2,tp=8,mbs=1,gbs=16,sp=true",
        "dp=2,tp=8,mbs=2,gbs=16,sp=true",
        "dp=4,tp=4,mbs=1,gbs=16",
        "dp=2,tp=4,pp=2,mbs=1,gbs=16,sp=true",
    ] {
        let plan = Plan::parse(text).unwrap();
        let mapping = MeshMapping::new(&plan.mesh_axes(), &m.cluster).unwrap();
        let all = LayerPlacement::all();
        let order = m.layer_dominance(&cfg, &plan, &mapping, &all).unwrap();
        assert_eq!(order.len(), all.len());
        let beaten = order.iter().filter(|(_, by)| !by.is_empty()).count();
        assert!(beaten > 0 && beaten < all.len(), "{text}");
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            for zero in [0, 1, 3] {
                let est = |l: LayerPlacement| {
                    let p = Plan {
                        layer: l,
                        recompute,
                        zero_stage: zero,
                        ..plan.clone()
                    };
                    m.estimate(&cfg, &p).unwrap()
                };
                for (i, (layer, by)) in order.iter().enumerate() {
                    let e = est(*layer);
                    for &k in by {
                        assert!(k < i, "{text}: {layer} listed before what beats it");
                        let f = est(order[k].0);
                        assert!(
                            f.iter_time_s <= e.iter_time_s
                                && f.peak_memory_gib <= e.peak_memory_gib,
                            "{text} {recompute:?} zero={zero}: {} beats {layer} in the profile \
                             but not in the estimate",
                            order[k].0
                        );
                    }
                }
            }
        }
    }
}

/// `dtype=fp8`: refused by name where the GPU has no fp8 peak; on H100 faster than bf16 (the
/// layers' GEMMs at the fp8 ceiling) but by less than the peaks' 2x (casts, attention and
/// the head stay bf16), with the fp8 weight copies in memory and MFU against the fp8 peak.
#[test]
fn fp8_is_priced_where_the_gpu_has_it_and_refused_where_not() {
    let cfg = TransformerConfig::gpt("7b", 32, 4096, 32, 2048, 50368);
    let bf16 = Plan::parse("dp=8,mbs=4,gbs=32,zero=3").unwrap();
    let fp8 = Plan::parse("dp=8,mbs=4,gbs=32,zero=3,dtype=fp8").unwrap();
    assert!(fp8.fp8);
    assert!(fp8.to_string().contains("dtype=fp8"));
    let err = a100(1).estimate(&cfg, &fp8).unwrap_err().to_string();
    assert!(err.contains("dtype=fp8") && err.contains("A100"), "{err}");
    let h100 = CostModel::new(Cluster::preset("dgx-h100").unwrap());
    let (b, f) = (
        h100.estimate(&cfg, &bf16).unwrap(),
        h100.estimate(&cfg, &fp8).unwrap(),
    );
    let speedup = b.iter_time_s / f.iter_time_s;
    assert!(speedup > 1.1 && speedup < 2.0, "{speedup}");
    assert!(f.memory.weights > b.memory.weights);
    assert!(f.mfu < f.model_tflops_per_gpu * 1e12 / 989e12);
}

/// Transformer Engine casts each tensor to fp8 once (the layer's input and weight for the
/// forward GEMM, the output gradient for the input-gradient GEMM; the weight-gradient GEMM
/// reads their transposed copies), so a small model, whose GEMMs are short, still gains from
/// fp8: llm-foundry measured MPT-1B at 512 tokens on 8 H100 at 52,275 tokens/s/GPU in bf16
/// and 70,315 in fp8, 1.35x (reference table, lines 63 and 79). Casting both operands for
/// every GEMM would leave it at about 1.0x. Block scaling costs GEMM rate on Hopper, not on
/// Blackwell.
#[test]
fn fp8_casts_each_tensor_once_and_block_scaling_costs_rate_on_hopper() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("1b", 24, 2048, 16, 512, 50368);
    let plan = |dtype: &str| Plan::parse(&format!("dp=8,mbs=56,gbs=448,zero=3,dtype={dtype}"));
    let time = |preset: &str, sw: &str, dtype: &str| {
        let mut m = CostModel::new(Cluster::preset(preset).unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(&cfg, &plan(dtype).unwrap()).unwrap().iter_time_s
    };
    let bf16 = time("dgx-h100", "fsdp,attention=flash1", "bf16");
    let fp8 = time("dgx-h100", "fsdp,attention=flash1", "fp8");
    assert!(bf16 / fp8 > 1.2, "{}", bf16 / fp8);
    let block = time(
        "dgx-h100",
        "fsdp,attention=flash1,fp8_recipe=blockwise",
        "fp8",
    );
    assert!(fp8 < block && block < bf16, "{fp8} {block} {bf16}");
    let b200 = |sw: &str| time("dgx-b200", sw, "fp8");
    assert_eq!(
        b200("megatron-core"),
        b200("megatron-core,fp8_recipe=blockwise")
    );
}

/// The software changes the step: eager PyTorch is slower than fused kernels, and
/// FlashAttention 1 slower than FlashAttention 2, most at long sequences; on H100 an
/// Ampere-era kernel loses more than the architecture-native one.
#[test]
fn fusion_and_attention_generation_change_the_step() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("1b", 24, 2048, 16, 16384, 50368);
    let plan = Plan::parse("dp=8,mbs=1,gbs=8,zero=3").unwrap();
    let time = |preset: &str, sw: &str| {
        let mut m = CostModel::new(Cluster::preset(preset).unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(&cfg, &plan).unwrap().iter_time_s
    };
    for preset in ["dgx-a100", "dgx-h100"] {
        let fused = time(preset, "fsdp,fusion=fused");
        let eager = time(preset, "fsdp");
        let fa1 = time(preset, "fsdp,attention=flash1");
        assert!(eager > fused, "{preset}");
        assert!(fa1 > 1.3 * eager, "{preset}: {fa1} vs {eager}");
    }
    let h_fa2 = time("dgx-h100", "fsdp,attention=flash");
    let h_native = time("dgx-h100", "fsdp,attention=fused");
    let a_fa2 = time("dgx-a100", "fsdp,attention=flash");
    let a_native = time("dgx-a100", "fsdp,attention=fused");
    assert!(h_native < 0.85 * h_fa2, "{h_native} vs {h_fa2}");
    assert!((a_native - a_fa2).abs() < 1e-12);
}

/// Beside a persistent Hopper GEMM a NCCL collective pushes the CTAs it displaces into a
/// second wave: FSDP on H100 pays the overlapped GEMM time again, which the pass reports as
/// its second waves; not on A100, whose GEMMs launch a CTA per tile, nor where the stack
/// carves SMs out for the collectives.
#[test]
fn persistent_gemms_lose_a_second_wave_to_overlapped_collectives() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("13b", 8, 5120, 40, 2048, 50368);
    let plan = Plan::parse("dp=8,mbs=2,gbs=16,zero=3").unwrap();
    let run = |preset: &str, sw: &str| {
        let mut m = CostModel::new(Cluster::preset(preset).unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(&cfg, &plan).unwrap()
    };
    let h100 = run("dgx-h100", "fsdp");
    let carved = run("dgx-h100", "fsdp,sm_carveout=true");
    let a100 = run("dgx-a100", "fsdp");
    let wave = |e: &autopar_cost_model::Estimate| {
        e.time.layer_forward.second_wave_s + e.time.layer_backward.second_wave_s
    };
    assert!(wave(&h100) > 0.0);
    assert_eq!(wave(&carved), 0.0);
    assert_eq!(wave(&a100), 0.0);
    // The second waves are what separates the two H100 estimates, layer by layer.
    let layer = |e: &autopar_cost_model::Estimate| {
        e.time.layer_forward.total_s() + e.time.layer_backward.total_s()
    };
    let gap = layer(&h100) - layer(&carved);
    assert!((gap - wave(&h100)).abs() < 1e-9, "{gap} vs {}", wave(&h100));
    assert!(h100.iter_time_s > 1.1 * carved.iter_time_s);
}

/// Selective recomputation follows the stack: Megatron's (the attention core) costs nothing
/// beside a fused attention kernel, torchtitan's per-op policy runs the unsaved matmuls and
/// every element-wise kernel again and keeps less than no recomputation, more than full.
#[test]
fn selective_recompute_is_the_stacks_own() {
    use autopar_cost_model::Software;
    let mut cfg = TransformerConfig::gpt("8b", 8, 4096, 32, 8192, 128256);
    cfg.kv_heads = 8;
    cfg.ffn = 14336;
    cfg.gated_mlp = true;
    let run = |sw: &str, recompute: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-a100").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        let plan = Plan::parse(&format!("dp=8,mbs=1,gbs=8,zero=3,recompute={recompute}")).unwrap();
        let e = m.estimate(&cfg, &plan).unwrap();
        (e.iter_time_s, e.peak_memory_gib, e.hardware_tflops_per_gpu)
    };
    let (none, none_mem, _) = run("torchtitan", "none");
    let (op, op_mem, op_hw) = run("torchtitan", "selective");
    let (full, full_mem, _) = run("torchtitan", "full");
    assert!(none < op && op < full, "{none} {op} {full}");
    assert!(
        full_mem < op_mem && op_mem < none_mem,
        "{full_mem} {op_mem} {none_mem}"
    );
    let (attention, _, attention_hw) = run("torchtitan,selective=attention", "selective");
    assert!(
        (attention - none).abs() < 1e-9 * none,
        "{attention} vs {none}"
    );
    // The recomputed matmuls count as hardware FLOPs.
    assert!(op_hw * op > 1.05 * attention_hw * attention);
}

/// The loss kernels are memory-bound passes over the logits: for a small model with a large
/// vocabulary the unfused ones (Megatron's fp32 cross-entropy, PyTorch's eager one) cost a
/// visible share of the step, each pass's bytes on the head's time, and nothing else moves.
#[test]
fn unfused_loss_kernels_cost_passes_over_the_logits() {
    use autopar_cost_model::{LossKernel, Software};
    let cfg = TransformerConfig::gpt("1b", 24, 2048, 16, 4096, 131072);
    let plan = Plan::parse("dp=8,mbs=1,gbs=32,zero=1").unwrap();
    // Without the parameter gather under the first forward, which the longer head of a
    // slower loss kernel would partly hide.
    let estimate = |loss: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
        Software::parse(&format!(
            "megatron-core,loss={loss},overlap_param_gather=false"
        ))
        .unwrap()
        .apply(&mut m);
        m.estimate(&cfg, &plan).unwrap()
    };
    let (fused, megatron, torch) = (estimate("fused"), estimate("megatron"), estimate("torch"));
    // Four micro-batches of 4096 tokens, each over 131072 logits, at the measured fraction
    // of the H100's HBM bandwidth.
    let logits = 4.0 * 4096.0 * 131072.0;
    let m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
    let per_byte = m.compute.memory_time(1.0e9, &m.cluster) / 1.0e9;
    let bytes = |k: LossKernel| {
        let (f, b) = k.bytes_per_logit(2.0);
        f + b
    };
    for (slower, kernel) in [
        (&megatron, LossKernel::Megatron),
        (&torch, LossKernel::Torch),
    ] {
        let extra = slower.iter_time_s - fused.iter_time_s;
        let expected = logits * (bytes(kernel) - bytes(LossKernel::Fused)) * per_byte;
        assert!(
            (extra - expected).abs() < 0.02 * expected,
            "{kernel:?}: {extra} s more than fused, {expected} s expected"
        );
    }
    assert!(megatron.iter_time_s > 1.05 * fused.iter_time_s);
    assert_eq!(
        Software::preset("megatron-core").unwrap().loss,
        LossKernel::Megatron
    );
    assert_eq!(Software::preset("fsdp").unwrap().loss, LossKernel::Torch);
    assert_eq!(Software::preset("nemo").unwrap().loss, LossKernel::Fused);
}

/// Megatron-Core's `--tp-comm-overlap` pipelines each sequence-parallel gather and
/// reduce-scatter with its GEMM, chunk by chunk of tokens, and the backward's gathers of a
/// row-parallel GEMM's output gradient with its input-gradient GEMM: far less is exposed
/// than without it. The chunks are GEMMs of their own: with few tokens per chunk they
/// leave SMs idle, so the pipeline costs more than the transfers it hides.
#[test]
fn tp_comm_overlap_pipelines_collectives_with_their_gemms() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("30b", 4, 7168, 56, 4096, 131072);
    let layer = |sw: &str, seq: usize| {
        let cfg = TransformerConfig { seq, ..cfg.clone() };
        let plan = Plan::parse("dp=1,tp=8,mbs=1,gbs=1,sp=true").unwrap();
        let mut m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        let t = m.estimate(&cfg, &plan).unwrap().time;
        (t.layer_forward, t.layer_backward)
    };
    let (f_on, b_on) = layer("megatron-core", 4096);
    let (f_off, b_off) = layer("megatron-core,tp_comm_overlap=false", 4096);
    assert_eq!(f_on.comm_total_s, f_off.comm_total_s);
    assert!(
        f_on.comm_exposed_s < 0.7 * f_off.comm_exposed_s,
        "{f_on:?} {f_off:?}"
    );
    assert!(
        b_on.comm_exposed_s < 0.7 * b_off.comm_exposed_s,
        "{b_on:?} {b_off:?}"
    );
    // Without the overlap the forward's gathers and reduce-scatters are all exposed.
    assert!((f_off.comm_exposed_s - f_off.comm_total_s).abs() < 1e-12);
    // 512 tokens split 8 ways: 64-row chunks cannot fill an H100, and the pipeline costs
    // more than the collectives' own time.
    let (short_on, _) = layer("megatron-core", 512);
    let (short_off, _) = layer("megatron-core,tp_comm_overlap=false", 512);
    assert!(
        short_on.comm_exposed_s > short_off.comm_exposed_s,
        "{short_on:?}"
    );
}

/// Megatron-LM's blocking stage-to-stage transfers put every send and the receiver's
/// gather on the ranks' time, so the step is slower by at least half a transfer per
/// micro-batch and chunk of a rank; and the 2021 code's awaited tensor-parallel
/// all-reduce of the backward exposes what the 2022 code hides under the weight gradients.
#[test]
fn blocking_transfers_and_awaited_backward_all_reduces_cost_time() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("40b", 48, 8192, 64, 2048, 51200);
    let plan = Plan::parse(
        "dp=2,tp=8,pp=4,vpp=2,mbs=1,gbs=32,recompute=full,schedule=interleaved,dtype=f16",
    )
    .unwrap();
    let estimate = |sw: &str| {
        let mut m = a100(8);
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(&cfg, &plan).unwrap()
    };
    let free = estimate("megatron-lm-2022,p2p_blocking=false");
    let blocking = estimate("megatron-lm-2022");
    let transfers = (plan.micro_batches() * plan.vpp) as f64;
    assert!(
        blocking.iter_time_s - free.iter_time_s > transfers * free.time.p2p_s * 0.5,
        "{} vs {} (transfer {})",
        blocking.iter_time_s,
        free.iter_time_s,
        free.time.p2p_s
    );
    let awaited = estimate("megatron-lm-2021");
    assert!(
        awaited.time.layer_backward.comm_exposed_s
            > 2.0 * blocking.time.layer_backward.comm_exposed_s
    );
    assert!(awaited.iter_time_s > blocking.iter_time_s);
}

/// The pessimistic end of a plan's range: with no overlap the step is never faster, and it
/// is slower where the profile hides communication.
#[test]
fn without_overlap_is_the_slow_end_of_the_range() {
    let cfg = TransformerConfig::gpt("13b", 40, 5120, 40, 2048, 51200);
    let m = a100(4);
    let none = m.without_overlap();
    assert!(!none.software.overlap_grad_reduce && none.software.p2p_blocking);
    assert!(!none.comm.overlap_tp_backward && !none.comm.overlap_tp_forward);
    for text in [
        "dp=4,tp=8,mbs=1,gbs=64",
        "dp=2,tp=4,pp=4,vpp=2,mbs=1,gbs=64,schedule=interleaved,sp=true",
        "dp=32,mbs=1,gbs=64,zero=3",
    ] {
        let plan = Plan::parse(text).unwrap();
        let (fast, slow) = (
            m.estimate(&cfg, &plan).unwrap(),
            none.estimate(&cfg, &plan).unwrap(),
        );
        assert!(slow.iter_time_s > fast.iter_time_s, "{text}");
    }
}

/// A 13B GPT on one DGX A100 node under ZeRO-3, with and without offload: the fp32 state
/// moves to the host and the step pays for the copies and the CPU's optimizer step; GPT-3
/// 175B's 175B x 16 bytes of fp32 state (2.8 TB) does not fit the node's 2 TB host.
#[test]
fn cpu_offload_moves_state_to_the_host_and_costs_pcie_time() {
    let m = a100(1);
    let cfg = TransformerConfig::gpt("13b", 40, 5120, 40, 2048, 51200);
    let on_gpu = Plan::parse("dp=8,zero=3,mbs=1,gbs=64,recompute=full").unwrap();
    let base = m.estimate(&cfg, &on_gpu).unwrap();
    assert!(base.fits, "{:?}", base.fits_reason);
    assert_eq!(base.memory.host, 0.0);
    for offload in ["optimizer", "params"] {
        let plan = Plan::parse(&format!("{on_gpu},offload={offload}")).unwrap();
        let e = m.estimate(&cfg, &plan).unwrap();
        assert!(e.fits, "{offload}: {:?}", e.fits_reason);
        // The fp32 state leaves the GPU for the host...
        assert_eq!(e.memory.optimizer, 0.0, "{offload}");
        assert!(e.memory.host > base.memory.optimizer, "{offload}");
        assert!(e.peak_memory_gib < base.peak_memory_gib, "{offload}");
        // ... and the step pays for the copies and the CPU's optimizer step.
        assert!(e.iter_time_s > base.iter_time_s, "{offload}");
        assert!(e.time.optimizer_s > base.time.optimizer_s, "{offload}");
        assert!(
            e.time.layer_backward.comm_total_s > base.time.layer_backward.comm_total_s,
            "{offload}"
        );
    }
    let params = Plan::parse(&format!("{on_gpu},offload=params")).unwrap();
    let e = m.estimate(&cfg, &params).unwrap();
    assert_eq!((e.memory.weights, e.memory.gradients), (0.0, 0.0));
    // FSDP's CPU optimizer is PyTorch's, slower than DeepSpeed's CPU-Adam.
    let mut fsdp = a100(1);
    autopar_cost_model::Software::parse("fsdp")
        .unwrap()
        .apply(&mut fsdp);
    assert!(fsdp.estimate(&cfg, &params).unwrap().time.optimizer_s > e.time.optimizer_s * 4.0);

    // 175B: 2.8 TB of fp32 state on a node with 2 TB of host memory.
    let big = TransformerConfig::gpt3_175b();
    let plan = Plan::parse("dp=8,zero=3,mbs=1,gbs=64,recompute=full,offload=params").unwrap();
    let e = m.estimate(&big, &plan).unwrap();
    assert!(!e.fits && !e.cost.is_feasible());
    let why = e.fits_reason.unwrap();
    assert!(why.contains("host memory") && why.contains("GiB"), "{why}");
}

/// torchtitan's pipeline stages hold their gathered weights and unsharded gradients over
/// the step, which offloading the FSDP shards does not free: refused, not mispriced.
#[test]
fn offload_under_torchtitan_pipelines_is_refused() {
    let mut m = CostModel::new(Cluster::preset("dgx-h100:nodes=2").unwrap());
    autopar_cost_model::Software::parse("torchtitan")
        .unwrap()
        .apply(&mut m);
    let cfg = TransformerConfig::gpt("small", 8, 1024, 16, 1024, 51200);
    let piped = Plan::parse("dp=4,pp=4,zero=3,gbs=16,offload=optimizer").unwrap();
    let err = m.estimate(&cfg, &piped).unwrap_err().to_string();
    assert!(err.contains("pp=4") && err.contains("torchtitan"), "{err}");
    let flat = Plan::parse("dp=16,zero=3,gbs=16,offload=optimizer").unwrap();
    assert!(m.estimate(&cfg, &flat).is_ok());
}

#[test]
fn offload_needs_a_described_host() {
    let mut c = Cluster::preset("dgx-h100:nodes=1").unwrap();
    c.host = None;
    let cfg = TransformerConfig::gpt("small", 4, 1024, 16, 1024, 51200);
    let plan = Plan::parse("dp=8,zero=2,gbs=8,offload=optimizer").unwrap();
    let err = CostModel::new(c)
        .estimate(&cfg, &plan)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[host]"), "{err}");
    let cpu = CostModel::new(Cluster::preset("cpu:ranks=2").unwrap());
    let plan = Plan::parse("dp=2,zero=2,gbs=2,offload=optimizer").unwrap();
    assert!(cpu.estimate(&cfg, &plan).is_err());
}

/// Expert tensor parallelism: the experts split over `etp` of the `tp` ranks, their weights
/// over `ep x etp`, the MoE block's collectives over the `etp` group (none with `etp=1`).
#[test]
fn expert_tensor_parallelism_divides_expert_weights_and_moves_the_collectives() {
    let m = CostModel::new(Cluster::preset("dgx-h100:nodes=4").unwrap());
    let cfg = TransformerConfig::mixtral_8x7b();
    let est = |etp: &str| {
        let plan = Plan::parse(&format!("dp=4,ep=4,tp=8,sp=true,mbs=1,gbs=64{etp}")).unwrap();
        m.estimate(&cfg, &plan).unwrap()
    };
    let (full, two, one) = (est(""), est(",etp=2"), est(",etp=1"));
    assert_eq!(
        full.memory.num_expert_params,
        est(",etp=8").memory.num_expert_params
    );
    let ratio = two.memory.num_expert_params / full.memory.num_expert_params;
    assert!((ratio - 4.0).abs() < 1e-9, "{ratio}");
    let ratio = one.memory.num_expert_params / full.memory.num_expert_params;
    assert!((ratio - 8.0).abs() < 1e-9, "{ratio}");
    // The MoE block's gathers and reduce-scatters: over 2 ranks with etp=2, none with etp=1,
    // so tensor-parallel traffic falls with etp while the attention block's stays.
    let tp_issued = |e: &autopar_cost_model::Estimate| e.time.layer_forward.exposed_by.tp_s;
    assert!(
        tp_issued(&one) < tp_issued(&two),
        "{} {}",
        tp_issued(&one),
        tp_issued(&two)
    );
    assert!(tp_issued(&one) > 0.0);
    // More expert state per rank: a larger peak.
    assert!(one.peak_memory_gib > two.peak_memory_gib);
    assert!(two.peak_memory_gib > full.peak_memory_gib);

    for (bad, says) in [
        (
            "dp=4,ep=4,tp=8,sp=true,gbs=64,etp=3",
            "does not divide tp=8",
        ),
        ("dp=4,ep=4,tp=8,gbs=64,etp=2", "needs sp=true"),
    ] {
        let err = Plan::parse(bad).unwrap_err().to_string();
        assert!(err.contains(says), "{bad}: {err}");
    }
    let dense = TransformerConfig::gpt("small", 4, 1024, 16, 1024, 51200);
    let plan = Plan::parse("tp=4,sp=true,gbs=8,etp=2").unwrap();
    let err = m.estimate(&dense, &plan).unwrap_err().to_string();
    assert!(err.contains("without experts"), "{err}");
}

/// Megatron-Core's MoE parallel folding: with `etp` below `tp`, the tensor-parallel ranks
/// holding the same expert shards are expert-parallel ranks first, so `ep` may exceed `dp`
/// (Megatron-Bridge's Qwen3-235B-A22B on 256 H100s: tp=2, etp=1, ep=32 on dp=16). Expert
/// all-to-alls across nodes leave through each rank's own NIC; overlapped with another
/// micro-batch's compute (`ep_comm_overlap`) they hide, and the range's slow end keeps them.
#[test]
fn expert_parallelism_folds_over_tensor_parallel_ranks() {
    let m = CostModel::new(Cluster::preset("dgx-h100:nodes=32").unwrap());
    let qwen3 = TransformerConfig {
        kv_heads: 4,
        head_dim: Some(128),
        ffn: 1536,
        experts: 128,
        top_k: 8,
        gated_mlp: true,
        tied_embeddings: false,
        learned_positions: false,
        rms_norm: true,
        ..TransformerConfig::gpt("qwen3-235b-a22b", 94, 4096, 64, 4096, 151936)
    };
    let layout = "dp=16,tp=2,pp=8,vpp=4,schedule=interleaved,sp=true,mbs=1,gbs=8192,dtype=fp8";
    let plan = |rest: &str| Plan::parse(&format!("{layout},{rest}")).unwrap();
    let folded = plan("ep=32,etp=1");
    assert_eq!((folded.ep_over_tp(), folded.ep_over_dp()), (2, 16));
    let est = |p: &Plan, software: &str| {
        let mut m = m.clone();
        autopar_cost_model::Software::parse(software)
            .unwrap()
            .apply(&mut m);
        m.estimate(&qwen3, p).unwrap()
    };
    let plain = est(&folded, "megatron-core");
    // 128 experts over 32 ranks (4 each) hold half the expert weights of 16 ranks (8 each).
    let sixteen = est(&plan("ep=16,etp=1"), "megatron-core");
    let ratio = sixteen.memory.num_expert_params / plain.memory.num_expert_params;
    assert!((ratio - 2.0).abs() < 1e-9, "{ratio}");
    // Half of each rank's dispatch goes to the 24 peers on other nodes at its NIC's rate.
    assert!(plain.time.layer_forward.exposed_by.ep_s > 0.0);
    let overlapped = est(&folded, "megatron-core,ep_comm_overlap=true");
    let ep = |e: &autopar_cost_model::Estimate| {
        e.time.layer_forward.exposed_by.ep_s + e.time.layer_backward.exposed_by.ep_s
    };
    // Each all-to-all (2.3 ms) outlasts the sub-block it runs beside, so some stays exposed,
    // and NCCL's kernels push the persistent GEMMs beside them into second waves.
    let waves = |e: &autopar_cost_model::Estimate| {
        e.time.layer_forward.second_wave_s + e.time.layer_backward.second_wave_s
    };
    assert!(
        ep(&overlapped) < 0.9 * ep(&plain) && ep(&overlapped) > 0.5 * ep(&plain),
        "{} {}",
        ep(&overlapped),
        ep(&plain)
    );
    assert!(waves(&overlapped) > 0.0 && waves(&plain) == 0.0);
    assert!(overlapped.iter_time_s < plain.iter_time_s);
    // With SMs carved out of the GEMMs for NCCL there is no second wave, and more hides.
    let carved = est(
        &folded,
        "megatron-core,ep_comm_overlap=true,sm_carveout=true",
    );
    assert_eq!(waves(&carved), 0.0);
    assert!(
        ep(&carved) < ep(&overlapped) && ep(&carved) > 0.3 * ep(&plain),
        "{} {}",
        ep(&carved),
        ep(&overlapped)
    );
    // The range's slow end overlaps nothing: the plain estimate's all-to-alls.
    let mut overlapping = m.clone();
    autopar_cost_model::Software::parse("megatron-core,ep_comm_overlap=true")
        .unwrap()
        .apply(&mut overlapping);
    let mut without = m.clone();
    autopar_cost_model::Software::parse("megatron-core")
        .unwrap()
        .apply(&mut without);
    let slow_end = |m: &CostModel| m.without_overlap().estimate(&qwen3, &folded).unwrap();
    let (a, b) = (slow_end(&overlapping), slow_end(&without));
    assert!((a.iter_time_s - b.iter_time_s).abs() < 1e-9 * b.iter_time_s);
    // Megatron-Core refuses the overlap with full recomputation and with pipeline stages but
    // no virtual ones: such plans are priced without it.
    for refused in [
        "dp=16,tp=2,pp=8,vpp=4,schedule=interleaved,sp=true,mbs=1,gbs=8192,dtype=fp8,ep=32,etp=1,\
         recompute=full",
        "dp=16,tp=2,pp=8,sp=true,mbs=1,gbs=8192,dtype=fp8,ep=32,etp=1",
    ] {
        let p = Plan::parse(refused).unwrap();
        assert!(!p.overlaps_expert_all_to_alls(&qwen3), "{refused}");
        let (on, off) = (
            est(&p, "megatron-core,ep_comm_overlap=true"),
            est(&p, "megatron-core"),
        );
        assert_eq!(on.iter_time_s, off.iter_time_s, "{refused}");
    }
    assert!(folded.overlaps_expert_all_to_alls(&qwen3));

    for (bad, says) in [
        ("ep=32", "does not divide dp=16"),
        (
            "ep=3,etp=1",
            "tensor-parallel ranks holding the same expert shards",
        ),
        (
            "ep=64,etp=1",
            "ep must divide 2 or be 2 times a divisor of dp",
        ),
    ] {
        let err = Plan::parse(&format!("{layout},{bad}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

/// The MoE block the calibration prices alone is the one inside the layer: its all-to-alls
/// are the layer's, its GEMMs a part of the layer's, and its backward twice its forward.
#[test]
fn the_moe_block_is_priced_by_the_layers_code() {
    let m = CostModel::new(Cluster::preset("dgx-h100:nodes=1").unwrap());
    let cfg = TransformerConfig::mixtral_8x7b();
    let plan = Plan::parse("dp=8,ep=8,mbs=1,gbs=8").unwrap();
    let b = m.mlp_block_times(&cfg, &plan).unwrap();
    let e = m.estimate(&cfg, &plan).unwrap();
    let (lf, lb) = (&e.time.layer_forward, &e.time.layer_backward);
    assert_eq!(b.forward.exposed_by.ep_s, lf.exposed_by.ep_s);
    assert_eq!(b.backward.exposed_by.ep_s, lb.exposed_by.ep_s);
    assert!(b.forward.exposed_by.ep_s > 0.0);
    assert!(b.forward.gemm_s > 0.5 * lf.gemm_s && b.forward.gemm_s < lf.gemm_s);
    assert!(b.forward.memory_s < lf.memory_s);
    let ratio = b.backward.gemm_s / b.forward.gemm_s;
    assert!((1.9..2.1).contains(&ratio), "{ratio}");
}

/// A shared expert is a dense MLP beside the routed experts: its parameters are dense (split
/// over `tp`, replicated over `ep`), every token computes through it (its GEMMs add the
/// whole dense MLP's to the block's, and its FLOPs to the model's), and its activations
/// are kept.
#[test]
fn a_shared_expert_is_priced_as_a_dense_mlp_beside_the_experts() {
    let m = CostModel::new(Cluster::preset("dgx-h100:nodes=2").unwrap());
    let routed = TransformerConfig {
        name: "deepseek-like".into(),
        layers: 4,
        hidden: 4096,
        heads: 32,
        kv_heads: 32,
        head_dim: None,
        ffn: 1024,
        vocab: 32000,
        seq: 4096,
        experts: 64,
        top_k: 6,
        gated_mlp: true,
        tied_embeddings: false,
        learned_positions: false,
        rms_norm: true,
        shared_ffn: 0,
    };
    let shared = TransformerConfig {
        shared_ffn: 2048,
        ..routed.clone()
    };
    // A dense SwiGLU of width 2048 (the cost model counts biases on every matrix).
    let dense = 3 * 4096 * 2048 + 2 * 2048 + 4096;
    assert_eq!(shared.shared_expert_params(), dense);
    assert_eq!(shared.mlp_params(), routed.mlp_params() + dense);
    let active = shared.active_mlp_params() - routed.active_mlp_params();
    assert_eq!(active, dense as f64);

    let plan = Plan::parse("dp=8,ep=8,tp=2,sp=true,mbs=1,gbs=16").unwrap();
    let (a, b) = (
        m.estimate(&routed, &plan).unwrap(),
        m.estimate(&shared, &plan).unwrap(),
    );
    // Dense: split over tp only, not over ep; one per layer.
    let extra = b.memory.num_params - a.memory.num_params;
    assert!((extra - 4.0 * dense as f64 / 2.0).abs() < 1.0, "{extra}");
    assert_eq!(b.memory.num_expert_params, a.memory.num_expert_params);
    // Every token's work: 2 GEMMs forward (the gate and up projections as one), tp-split.
    let n = 4096.0;
    let flops = 2.0 * n * (2.0 * 2048.0 * 4096.0 + 2048.0 * 4096.0) / 2.0;
    let (bf, af) = (
        m.mlp_block_times(&shared, &plan).unwrap(),
        m.mlp_block_times(&routed, &plan).unwrap(),
    );
    assert!(bf.forward.gemm_s > af.forward.gemm_s);
    let rate = flops / (bf.forward.gemm_s - af.forward.gemm_s);
    assert!(rate > 2e14 && rate < 9e14, "{rate}");
    assert!(b.iter_time_s > a.iter_time_s);
    assert!(b.memory.activations > a.memory.activations);
    assert!(b.model_tflops_per_gpu * b.iter_time_s > a.model_tflops_per_gpu * a.iter_time_s);

    // The graph's description: a dense MLP's weights beside the experts' are the shared
    // expert's, and a shared expert needs experts.
    let dense_only = TransformerConfig {
        experts: 1,
        top_k: 1,
        ..shared.clone()
    };
    let err = dense_only.validate().unwrap_err().to_string();
    assert!(err.contains("shared expert"), "{err}");
    let odd = TransformerConfig {
        shared_ffn: 1000,
        ..shared
    };
    assert!(odd.tp_split_error(16).unwrap().contains("shared expert"));
}

/// Under full recomputation a layer's backward reruns its forward. PyTorch FSDP gathers the
/// block's weights once for both (the recomputed forward runs inside the block's backward,
/// on the weights its pre-backward hook unsharded); DeepSpeed's per-module hooks gather them
/// for the recomputed forward and again for the backward. With the gathers not overlapped,
/// the difference is exactly the forward's exposed gather.
#[test]
fn a_recomputed_forward_regathers_only_where_weights_are_gathered_per_module() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("1b", 24, 2048, 16, 2048, 50368);
    let plan = Plan::parse("dp=16,mbs=2,gbs=32,zero=3,recompute=full").unwrap();
    let layer = |sw: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-a100:nodes=2").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        let t = m.estimate(&cfg, &plan).unwrap().time;
        (t.layer_forward, t.layer_backward)
    };
    // The whole forward is replayed (PyTorch before 2.1) for the comparison to be exact.
    let (fwd, bwd) = layer("fsdp,overlap_param_gather=false,recompute_early_stop=false");
    assert!(fwd.exposed_by.zero_s > 0.0);
    let rerun = fwd.total_s() - fwd.exposed_by.zero_s;
    assert!((bwd.recompute_s - rerun).abs() < 1e-12 * rerun.max(1.0));
    let (fwd, bwd) =
        layer("fsdp,overlap_param_gather=false,param_gather=tensor,recompute_early_stop=false");
    assert!((bwd.recompute_s - fwd.total_s()).abs() < 1e-12 * fwd.total_s());
    assert!(fwd.exposed_by.zero_s > 0.0);
}

/// PyTorch's non-reentrant checkpoint (2.1 on) stops recomputing once every tensor the
/// backward saved is rebuilt, so a dense layer's MLP output GEMM (a third of a GPT layer's
/// forward GEMM FLOPs at ffn = 4h) and the residual add after it are not run again; the
/// hardware FLOPs drop by that GEMM. Megatron-Core replays the whole forward, and an MoE
/// layer's combine saves the experts' outputs, so neither stops early.
#[test]
fn pytorch_recomputation_stops_before_the_mlp_output_gemm() {
    use autopar_cost_model::Software;
    let plan = Plan::parse("dp=8,mbs=2,gbs=16,zero=3,recompute=full").unwrap();
    let run = |cfg: &TransformerConfig, sw: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(cfg, &plan).unwrap()
    };
    let dense = TransformerConfig::gpt("1b", 24, 2048, 16, 2048, 50368);
    let (early, whole) = (
        run(&dense, "fsdp"),
        run(&dense, "fsdp,recompute_early_stop=false"),
    );
    let skipped = whole.time.layer_backward.recompute_s - early.time.layer_backward.recompute_s;
    let share = skipped / whole.time.layer_forward.gemm_s;
    assert!(share > 0.3 && share < 0.45, "{share}");
    assert!(early.iter_time_s < whole.iter_time_s);
    let hardware = |e: &autopar_cost_model::Estimate| e.hardware_tflops_per_gpu * e.iter_time_s;
    let model = |e: &autopar_cost_model::Estimate| e.model_tflops_per_gpu * e.iter_time_s;
    // Recomputation repeats the layers' forward FLOPs; stopping early drops the output
    // GEMM's share of them: 8h^2 of 24h^2 plus the attention core's (at seq = h, between
    // none and 4sh), so between 2/7 and 1/3.
    let repeated = |e| hardware(e) / model(e) - 1.0;
    let kept = repeated(&early) / repeated(&whole);
    assert!(kept > 2.0 / 3.0 - 1e-3 && kept < 5.0 / 7.0 + 1e-3, "{kept}");

    let replays = |cfg: &TransformerConfig, sw: &str| {
        let e = run(cfg, sw);
        let f = e.time.layer_forward;
        (e.time.layer_backward.recompute_s - (f.total_s() - f.exposed_by.zero_s)).abs()
            < 1e-9 * f.total_s()
    };
    assert!(replays(&dense, "megatron-core"));
    let mut moe = dense.clone();
    moe.experts = 8;
    moe.top_k = 2;
    assert!(replays(&moe, "fsdp"));
}

/// A first virtual stage that holds the embedding alone and a last that holds the head
/// alone (Llama 3's pipeline) are priced as that: the embedding's stage is nearly free, the
/// head's costs the output GEMM and the loss, and the layers between are one each.
#[test]
fn embedding_and_head_stages_of_their_own_hold_no_layers() {
    let cfg = TransformerConfig::gpt("g", 6, 4096, 32, 4096, 128256);
    let m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
    let plan = Plan::parse("pp=4,vpp=2,mbs=1,gbs=32,stages=0-1-1-1-1-1-1-0").unwrap();
    let mapping = autopar_cost_model::MeshMapping::new(&plan.mesh_axes(), &m.cluster).unwrap();
    let st = m.stage_times(&cfg, &plan, &mapping).unwrap();
    let (f, last) = (&st.forward_s, st.forward_s.len() - 1);
    let layer = f[1];
    assert!(
        f[1..last].iter().all(|&t| (t - layer).abs() < 1e-9 * layer),
        "{f:?}"
    );
    assert!(f[0] < 0.1 * layer, "{f:?}");
    // The head of a 128K vocabulary: 2hV against a layer's 24h^2 + 4sh FLOPs per token.
    assert!(f[last] > 1.5 * layer && f[last] < 4.0 * layer, "{f:?}");
    assert!(m.estimate(&cfg, &plan).is_ok());
    // The layer count must still cover every layer, and a stage inside cannot be empty.
    let short = Plan::parse("pp=4,vpp=2,mbs=1,gbs=32,stages=0-1-1-1-1-1-0-0");
    assert!(short.is_err());
    let fewer = Plan::parse("pp=4,vpp=2,mbs=1,gbs=32,stages=0-1-1-1-1-1-1-1").unwrap();
    assert!(m.estimate(&cfg, &fewer).is_err());
}

/// PyTorch's functional collectives gather and scatter along dimension 0, and DTensor's
/// sequence parallelism shards dimension 1 of batch-first activations: every tensor-parallel
/// all-gather rewrites its output and every reduce-scatter copies its input, four full
/// tensors read and written in a Llama layer's forward. Under torchao's float8 TP the
/// all-gathers move a byte per element; reduce-scatters stay in bf16. Megatron's stacks do
/// neither.
#[test]
fn pytorch_tensor_parallelism_pays_its_relayout_copies_and_gathers_fp8() {
    use autopar_cost_model::{Collective, Software};
    let cfg = TransformerConfig {
        kv_heads: 8,
        ffn: 14336,
        gated_mlp: true,
        rms_norm: true,
        learned_positions: false,
        tied_embeddings: false,
        ..TransformerConfig::gpt("llama-8b", 32, 4096, 32, 8192, 128256)
    };
    let run = |sw: &str, plan: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(&cfg, &Plan::parse(plan).unwrap()).unwrap()
    };
    let plan = "dp=1,tp=8,mbs=2,gbs=8,sp=true";
    let (with, without) = (
        run("torchtitan", plan),
        run("torchtitan,tp_relayout_copies=false", plan),
    );
    let added = with.time.layer_forward.memory_s - without.time.layer_forward.memory_s;
    // Four collectives of the whole [2, 8192, 4096] bf16 activation, each read and written.
    let whole = 2.0 * 8192.0 * 4096.0 * 2.0;
    let hbm = Cluster::preset("dgx-h100").unwrap().hbm_bandwidth();
    let at_peak = 4.0 * 2.0 * whole / hbm;
    assert!(
        added > at_peak && added < 1.6 * at_peak,
        "{added} {at_peak}"
    );
    // Micro-pipelined (async) TP restrides shards and sums partials instead: less.
    let fused = run("torchtitan,tp_comm_overlap=true", plan);
    let fused_off = run(
        "torchtitan,tp_comm_overlap=true,tp_relayout_copies=false",
        plan,
    );
    let fused_added = fused.time.layer_forward.memory_s - fused_off.time.layer_forward.memory_s;
    assert!(
        fused_added > 0.0 && fused_added < 0.5 * added,
        "{fused_added} {added}"
    );
    // torch's async TP leaves the backward's reduce-scatters of summed input gradients to
    // NCCL: more of the backward's tensor-parallel traffic is exposed than when they are
    // pipelined as Transformer Engine pipelines them.
    let rs_pipelined = run(
        "torchtitan,tp_comm_overlap=true,tp_pipelined_backward_reduce_scatter=true",
        plan,
    );
    let exposed = |e: &autopar_cost_model::Estimate| e.time.layer_backward.exposed_by.tp_s;
    assert!(exposed(&fused) > exposed(&rs_pipelined) + 1e-6);
    assert_eq!(
        fused.time.layer_forward.total_s(),
        rs_pipelined.time.layer_forward.total_s()
    );
    // No copies without tensor parallelism, nor under Megatron-Core.
    let dp = "dp=8,mbs=2,gbs=16";
    assert_eq!(
        run("torchtitan", dp).time.layer_forward.memory_s,
        run("torchtitan,tp_relayout_copies=false", dp)
            .time
            .layer_forward
            .memory_s
    );
    assert_eq!(
        run("megatron-core", plan).time.layer_forward.memory_s,
        run("megatron-core,tp_relayout_copies=false", plan)
            .time
            .layer_forward
            .memory_s
    );

    // fp8: the gathers halve, the reduce-scatters do not.
    let fp8 = format!("{plan},dtype=fp8");
    let bytes = |e: &autopar_cost_model::Estimate, kind: Collective| {
        e.layer_tp_collectives
            .iter()
            .filter(|c| c.collective.kind == kind)
            .map(|c| c.bytes)
            .sum::<f64>()
    };
    let (f8, f8_off) = (
        run("torchtitan", &fp8),
        run("torchtitan,fp8_tp_gather=false", &fp8),
    );
    let ratio = bytes(&f8, Collective::AllGather) / bytes(&f8_off, Collective::AllGather);
    assert!((ratio - 0.5).abs() < 1e-9, "{ratio}");
    assert_eq!(
        bytes(&f8, Collective::ReduceScatter),
        bytes(&f8_off, Collective::ReduceScatter)
    );
    assert_eq!(
        bytes(&run("torchtitan", plan), Collective::AllGather),
        bytes(
            &run("torchtitan,fp8_tp_gather=false", plan),
            Collective::AllGather
        )
    );
}

/// Megatron-Core and torchtitan shard ZeRO state over the context-parallel ranks as well
/// (they hold the same parameters); autopar's compiler shards over the data-parallel ranks
/// alone. With cp=2 the distributed optimizer's state per rank halves under the first.
#[test]
fn zero_state_spans_context_parallel_ranks_where_the_stack_puts_them() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("1b", 8, 2048, 16, 8192, 50304);
    let plan = Plan::parse("dp=4,cp=2,mbs=1,gbs=8,zero=1").unwrap();
    let state = |sw: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        m.estimate(&cfg, &plan).unwrap().memory.optimizer
    };
    let (own, megatron) = (state("autopar"), state("megatron-core"));
    assert!((own / megatron - 2.0).abs() < 1e-9, "{own} vs {megatron}");
    assert_eq!(state("megatron-core,zero_over_cp=false"), own);
    assert_eq!(state("torchtitan"), megatron);
}

/// Where the stack keeps the weights in fp8 (`fp8_params`: Megatron-Core's
/// `--fp8-param-gather`) a rank holds a byte per layer weight and its transpose instead of
/// a 16-bit weight beside them, and the distributed optimizer gathers a byte per layer
/// weight; where it accumulates and reduces gradients in bf16 (NeMo's H100 scripts) the
/// gradient buffer halves. Neither applies to bf16 training's weights.
#[test]
fn fp8_parameters_and_bf16_gradient_buffers_shrink_what_a_rank_holds() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig::gpt("7b", 32, 4096, 32, 4096, 32000);
    let run = |sw: &str, dtype: &str| {
        let mut m = CostModel::new(Cluster::preset("dgx-h100").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        let plan = Plan::parse(&format!("dp=8,mbs=1,gbs=64,zero=1,dtype={dtype}")).unwrap();
        m.estimate(&cfg, &plan).unwrap()
    };
    let (cached, fp8) = (
        run("megatron-core", "fp8"),
        run("megatron-core,fp8_params=true", "fp8"),
    );
    // The layers' 16-bit copies go: 2 of the 4 bytes per layer weight.
    let layer_weights = 32.0 * 12.0 * 4096.0 * 4096.0;
    let saved = cached.memory.weights - fp8.memory.weights;
    // (The layers' biases and norm scales add a few parts in ten thousand.)
    assert!(
        (saved / (2.0 * layer_weights) - 1.0).abs() < 1e-3,
        "{saved}"
    );
    assert!(fp8.time.param_gather_s < 0.6 * cached.time.param_gather_s);
    assert_eq!(
        run("megatron-core", "bf16").memory.weights,
        run("megatron-core,fp8_params=true", "bf16").memory.weights
    );
    // NeMo's bf16 gradient buffer: half of Megatron-Core's fp32 one.
    let (nemo, mcore) = (run("nemo", "bf16"), run("megatron-core", "bf16"));
    assert!((mcore.memory.gradients / nemo.memory.gradients - 2.0).abs() < 1e-9);
    assert_eq!(
        run("nemo,reduce_dtype=fp32", "bf16").memory.gradients,
        mcore.memory.gradients
    );
}

/// A rank of the interleaved schedule holds its in-flight micro-batches of every one of its
/// chunks, each at that chunk's size: with one chunk a layer longer than the others, the
/// stored activations stay below the count in flight times the largest chunk.
#[test]
fn in_flight_activations_count_each_chunk_at_its_own_size() {
    let cfg = TransformerConfig::gpt("uneven", 10, 2048, 16, 2048, 50304);
    let m = CostModel::new(Cluster::preset("dgx-h100:nodes=1").unwrap());
    let even = Plan::parse("dp=2,pp=4,vpp=2,mbs=1,gbs=16,schedule=interleaved").unwrap();
    let per_layer = {
        let e = m
            .estimate(&cfg, &Plan::parse("dp=8,mbs=1,gbs=16").unwrap())
            .unwrap();
        e.memory.activations / 10.0
    };
    // Ten layers over eight virtual stages: two chunks hold two layers.
    let e = m.estimate(&cfg, &even).unwrap();
    let rank = e
        .memory_per_pipeline_rank
        .iter()
        .max_by(|a, b| a.activations.total_cmp(&b.activations))
        .unwrap();
    let largest = *e.stage_layers.iter().max().unwrap() as f64;
    assert!(largest >= 2.0, "{:?}", e.stage_layers);
    let bound = rank.in_flight as f64 * largest * per_layer;
    assert!(
        rank.activations < bound - 0.5 * per_layer,
        "{} vs {bound}",
        rank.activations
    );
    assert!(rank.activations >= rank.in_flight as f64 * per_layer * (1.0 - 1e-9));
}

/// PyTorch eager mode pays, beside the attention plumbing every eager layer has, the
/// element-wise chains of a Llama-style layer: RMSNorm in fp32 twice, complex rotary over
/// the queries and keys, `repeat_kv` of grouped keys and values, and `silu(a) * b`. By
/// hand for one A100 (80% of 2039 GB/s, 3 us a kernel); a GPT-style layer (LayerNorm,
/// learned positions, GELU, a key/value head per query head) pays the plumbing only.
#[test]
fn eager_mode_pays_a_llama_layers_element_wise_chains() {
    use autopar_cost_model::Software;
    let llama = TransformerConfig {
        kv_heads: 8,
        ffn: 14336,
        gated_mlp: true,
        tied_embeddings: false,
        learned_positions: false,
        rms_norm: true,
        ..TransformerConfig::gpt("llama", 2, 4096, 32, 4096, 32000)
    };
    let gpt = TransformerConfig::gpt("gpt", 2, 4096, 32, 4096, 32000);
    let plan = Plan::parse("mbs=1,gbs=1").unwrap();
    let passes = |cfg: &TransformerConfig, sw: &str| {
        let mut m = a100(1);
        Software::parse(sw).unwrap().apply(&mut m);
        let t = m.estimate(cfg, &plan).unwrap().time;
        (t.layer_forward.memory_s, t.layer_backward.memory_s)
    };
    let extra = |cfg: &TransformerConfig| {
        let (eager, fused) = (passes(cfg, "fsdp"), passes(cfg, "fsdp,fusion=fused"));
        (eager.0 - fused.0, eager.1 - fused.1)
    };
    let (t, h, q, kv, f) = (4096.0, 4096.0, 4096.0, 1024.0, 14336.0);
    let bw = 2039e9 * 0.8;
    let plumbing = |passes: f64, kernels: f64| passes * t * h * 2.0 / bw + kernels * 3e-6;
    let (fwd, bwd) = extra(&gpt);
    assert!((fwd - plumbing(9.0, 10.0)).abs() < 1e-9, "{fwd}");
    assert!((bwd - plumbing(12.0, 20.0)).abs() < 1e-9, "{bwd}");
    let chains = |norm: f64, rotary: f64, repeat: f64, gate: f64| {
        (2.0 * norm * t * h + rotary * t * (q + kv) + repeat * t * 2.0 * q + gate * t * f) / bw
    };
    let (fwd, bwd) = extra(&llama);
    let want_fwd = plumbing(9.0, 10.0) + chains(32.0, 16.0, 4.0, 4.0) + 19.0 * 3e-6;
    let want_bwd = plumbing(12.0, 20.0) + chains(50.0, 16.0, 4.0, 8.0) + 30.0 * 3e-6;
    assert!((fwd - want_fwd).abs() < 1e-9, "{fwd} vs {want_fwd}");
    assert!((bwd - want_bwd).abs() < 1e-9, "{bwd} vs {want_bwd}");
    // Several times the plumbing alone: what `torch.compile` buys a Llama layer.
    assert!(fwd > 4.0 * plumbing(9.0, 10.0), "{fwd}");
}

/// Rotary positions cost a fused kernel's read and write of this rank's queries and keys in
/// each pass; learned positions nothing inside the layers. By hand on one A100 at tp=2
/// (16 of 32 query heads and 4 of 8 key/value heads of 128 per rank).
#[test]
fn rotary_positions_cost_a_pass_over_the_queries_and_keys() {
    let learned = TransformerConfig {
        kv_heads: 8,
        ..TransformerConfig::gpt("gqa", 2, 4096, 32, 4096, 32000)
    };
    let rotary = TransformerConfig {
        learned_positions: false,
        ..learned.clone()
    };
    let m = a100(1);
    let plan = Plan::parse("tp=2,mbs=1,gbs=1").unwrap();
    let layer = |cfg: &TransformerConfig| {
        let t = m.estimate(cfg, &plan).unwrap().time;
        (t.layer_forward.memory_s, t.layer_backward.memory_s)
    };
    let ((lf, lb), (rf, rb)) = (layer(&learned), layer(&rotary));
    // The bytes at 80% of 2039 GB/s, and one kernel's 3 us.
    let want = 4096.0 * (16.0 + 4.0) * 128.0 * 2.0 * 2.0 / (2039e9 * 0.8) + 3e-6;
    assert!((rf - lf - want).abs() < 1e-12, "{} vs {want}", rf - lf);
    assert!((rb - lb - want).abs() < 1e-12, "{} vs {want}", rb - lb);
}

/// Context-parallel attention merges its ring's steps: Transformer Engine's fused
/// corrections move 6 bytes per query element per step forward (and 6 per query and 12 per
/// key element backward), PyTorch's eager merges 50 and 62 per query element; gathering the
/// keys and values first (Llama 3's) merges nothing. By hand on one A100 node, cp=2.
#[test]
fn context_parallel_attention_pays_its_merges() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig {
        kv_heads: 8,
        learned_positions: false,
        ..TransformerConfig::gpt("gqa", 2, 4096, 32, 8192, 32000)
    };
    let plan = Plan::parse("dp=4,cp=2,mbs=1,gbs=4").unwrap();
    let memory = |sw: &str| {
        let mut m = a100(1);
        Software::parse(sw).unwrap().apply(&mut m);
        let t = m.estimate(&cfg, &plan).unwrap().time;
        (t.layer_forward.memory_s, t.layer_backward.memory_s)
    };
    let gathered = memory("megatron-core,cp_attention=all_gather");
    let ring = memory("megatron-core");
    let eager = memory("megatron-core,cp_attention=eager_ring");
    // 4096 local tokens, 4096 query and 1024 key elements each; two steps, each one
    // memory-bound kernel at 80% of 2039 GB/s with its 3 us.
    let (q, k) = (4096.0 * 4096.0, 4096.0 * 1024.0);
    let steps = |bytes: f64| 2.0 * (bytes / (2039e9 * 0.8) + 3e-6);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12 * b.max(1.0);
    assert!(close(ring.0 - gathered.0, steps(6.0 * q)), "{ring:?}");
    assert!(
        close(ring.1 - gathered.1, steps(6.0 * q + 12.0 * k)),
        "{ring:?}"
    );
    assert!(close(eager.0 - gathered.0, steps(50.0 * q)), "{eager:?}");
    assert!(close(eager.1 - gathered.1, steps(62.0 * q)), "{eager:?}");
    // torchtitan's profile runs PyTorch's ring.
    assert_eq!(
        Software::parse("torchtitan").unwrap().cp_attention,
        autopar_cost_model::CpAttention::EagerRing
    );
    let e = Software::parse("megatron-core,cp_attention=star").unwrap_err();
    assert!(e.to_string().contains("cp_attention"), "{e}");
}

/// Under pipeline parallelism torchtitan's FSDP gathers a stage's weights once per step and
/// holds them, reducing the gradients once after the last micro-batch: its ZeRO-3 costs what
/// ZeRO-1 costs, in time and memory. Plain FSDP regathers for every micro-batch.
#[test]
fn torchtitan_holds_gathered_weights_under_pipeline_parallelism() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig {
        kv_heads: 8,
        ffn: 14336,
        gated_mlp: true,
        learned_positions: false,
        rms_norm: true,
        ..TransformerConfig::gpt("llama", 8, 4096, 32, 4096, 32000)
    };
    let plan = |zero: u8| Plan::parse(&format!("dp=4,pp=2,mbs=1,gbs=16,zero={zero}")).unwrap();
    let run = |sw: &str, zero: u8| {
        let mut m = a100(1);
        Software::parse(sw).unwrap().apply(&mut m);
        let e = m.estimate(&cfg, &plan(zero)).unwrap();
        (e.iter_time_s, e.peak_memory_gib)
    };
    assert_eq!(run("torchtitan", 3), run("torchtitan", 1));
    // Without pipeline parallelism the hold does not apply.
    let mut m = a100(1);
    Software::parse("torchtitan").unwrap().apply(&mut m);
    let flat = |zero: u8| {
        let p = Plan::parse(&format!("dp=8,mbs=1,gbs=16,zero={zero}")).unwrap();
        m.estimate(&cfg, &p).unwrap().peak_memory_gib
    };
    assert!(flat(3) < flat(1));
    // Plain FSDP gathers per micro-batch: more time, less memory.
    let (fsdp3, fsdp1) = (run("fsdp", 3), run("fsdp", 1));
    assert!(
        fsdp3.0 > fsdp1.0 && fsdp3.1 < fsdp1.1,
        "{fsdp3:?} {fsdp1:?}"
    );
}

/// DeepSpeed's bf16 optimizer adds every micro-batch's 16-bit gradients into fp32 copies
/// after the backward: 18 bytes per parameter the rank holds (the cast's read and fp32
/// write, the add's two reads and one write), at 80% of the A100's 2039 GB/s and one
/// kernel's 3 us, on each layer's backward; the bf16 gradients (2 bytes per parameter) live
/// beside the fp32 ones until then. Not under fp16 (gradients accumulate in the
/// 16-bit `.grad`), nor ZeRO-2/3 (each micro-batch's gradients are reduce-scattered into
/// the fp32 shard), nor under Megatron's profiles (the fp32 buffer is the weight-gradient
/// GEMM's own output).
#[test]
fn deepspeed_bf16_accumulates_each_micro_batch_into_fp32_gradients() {
    use autopar_cost_model::Software;
    use autopar_cost_model::memory::layer_params_per_rank;
    let cfg = TransformerConfig::gpt("13b", 4, 5120, 40, 2048, 51200);
    let backward = |sw: &str, plan: &str| {
        let mut m = a100(1);
        Software::parse(sw).unwrap().apply(&mut m);
        let plan = Plan::parse(plan).unwrap();
        let e = m.estimate(&cfg, &plan).unwrap();
        (e.time.layer_backward.memory_s, e.iter_time_s, e.memory)
    };
    let bf16 = "dp=2,tp=2,pp=2,mbs=1,gbs=8,zero=1,recompute=full,dtype=bf16";
    let (on, step_on, mem_on) = backward("deepspeed", bf16);
    let (off, step_off, mem_off) = backward("deepspeed,fp32_grad_accumulation=false", bf16);
    // The backward's bf16 gradients live beside the fp32 ones until the pass adds them.
    let extra = mem_on.gradients - mem_off.gradients;
    assert!((extra - 2.0 * mem_on.num_params).abs() < 1.0, "{extra}");
    let params = layer_params_per_rank(&cfg, &Plan::parse(bf16).unwrap());
    let want = params * 18.0 / (2039e9 * 0.8) + 3e-6;
    assert!((on - off - want).abs() < 1e-12, "{} vs {want}", on - off);
    // Each of the 4 micro-batches' backward on the two layers of a stage, at least.
    assert!(
        step_on - step_off > 4.0 * 2.0 * want,
        "{step_on} vs {step_off}"
    );
    for (sw, plan) in [
        ("deepspeed", bf16.replace("bf16", "f16")),
        ("deepspeed", bf16.replace("zero=1", "zero=2")),
        ("megatron-lm-2022", bf16.to_string()),
    ] {
        let (with, _, with_mem) = backward(sw, &plan);
        let sw_off = format!("{sw},fp32_grad_accumulation=false");
        let (without, _, without_mem) = backward(&sw_off, &plan);
        assert_eq!(with, without, "{sw} {plan}");
        assert_eq!(with_mem.gradients, without_mem.gradients, "{sw} {plan}");
    }
}

/// PyTorch's context parallelism as torchtitan ran it all-gathers the query-wide keys and
/// values once, under the first ring step's attention only, and its backward gathers them
/// again and passes fp32 key and value gradients around the ring, a step's shard under each
/// step; Transformer Engine's ring passes the grouped keys and values under the whole
/// attention. Across 4 nodes (tp=8 fills each), with 64 query heads on 8 key/value heads:
/// the gather moves 8x the ring's bytes, the backward adds three fp32 passes, and more of
/// it shows.
#[test]
fn pytorch_context_parallelism_gathers_query_wide_keys_under_one_step() {
    use autopar_cost_model::Software;
    let cfg = TransformerConfig {
        kv_heads: 8,
        learned_positions: false,
        ..TransformerConfig::gpt("gqa", 2, 8192, 64, 65536, 32000)
    };
    let layer = |sw: &str, cfg: &TransformerConfig, plan: &str| {
        let mut m = CostModel::new(Cluster::preset("hgx-h100-96gb:nodes=4").unwrap());
        Software::parse(sw).unwrap().apply(&mut m);
        let plan = Plan::parse(plan).unwrap();
        m.estimate(cfg, &plan).unwrap().time
    };
    let cp4 = "dp=1,tp=8,cp=4,mbs=1,gbs=1,sp=true";
    let ring = layer("torchtitan,cp_attention=ring", &cfg, cp4);
    let eager = layer("torchtitan", &cfg, cp4);
    // The same local tokens without context parallelism: the tensor-parallel traffic alone.
    let short = TransformerConfig {
        seq: 16384,
        ..cfg.clone()
    };
    let alone = layer("torchtitan", &short, "dp=4,tp=8,mbs=1,gbs=4,sp=true");
    let cp = |p: &autopar_cost_model::estimate::PassTime,
              a: &autopar_cost_model::estimate::PassTime| {
        p.comm_total_s - a.comm_total_s
    };
    let (rf, ef, af) = (
        &ring.layer_forward,
        &eager.layer_forward,
        &alone.layer_forward,
    );
    // Issued: 8x the bytes of the same all-gather (within its latency).
    let ratio = cp(ef, af) / cp(rf, af);
    assert!((ratio - 8.0).abs() < 0.5, "{ratio}");
    assert!(ef.exposed_by.cp_s > rf.exposed_by.cp_s, "{ef:?} {rf:?}");
    // Backward: the gather again, and three passes of fp32 gradients, each the size of
    // two of the gather's shards (out of four).
    let (rb, eb, ab) = (
        &ring.layer_backward,
        &eager.layer_backward,
        &alone.layer_backward,
    );
    assert!(
        cp(eb, ab) > cp(ef, af) * 1.5,
        "{} vs {}",
        cp(eb, ab),
        cp(ef, af)
    );
    assert!(eb.exposed_by.cp_s > rb.exposed_by.cp_s, "{eb:?} {rb:?}");
    assert!(eb.exposed_by.cp_s <= cp(eb, ab) + 1e-12);
}

/// Dropout is the recipe's: Megatron's profiles keep its one-byte masks (Korthikanti's
/// 34 bytes per token and hidden unit without recomputation), the others train without it
/// (32), and `dropout=` overrides either; the masks cost memory-bound time as well.
#[test]
fn dropout_masks_are_the_recipes() {
    use autopar_cost_model::software::Software;
    let cfg = TransformerConfig::gpt("1.3b", 24, 2048, 16, 2048, 51200);
    let plan = Plan::parse("dp=8,mbs=4,gbs=32,recompute=none").unwrap();
    let under = |spec: &str| {
        let mut m = a100(1);
        Software::parse(spec).unwrap().apply(&mut m);
        m.estimate(&cfg, &plan).unwrap()
    };
    let sbh = 2048.0 * 4.0 * 2048.0;
    for (spec, bytes) in [
        ("megatron-core", 34.0),
        ("megatron-core,dropout=false", 32.0),
        ("nemo", 32.0),
        ("nemo,dropout=true", 34.0),
        ("fsdp", 32.0),
    ] {
        let e = under(spec);
        let per_layer = e.memory.activations / (cfg.layers as f64 * e.memory.in_flight as f64);
        assert!(
            (per_layer / (bytes * sbh) - 1.0).abs() < 1e-9,
            "{spec}: {per_layer}"
        );
    }
    let (with, without) = (under("megatron-core"), under("megatron-core,dropout=false"));
    assert!(with.time.layer_forward.memory_s > without.time.layer_forward.memory_s);
    assert!(with.iter_time_s > without.iter_time_s);
}

/// The pessimistic end of a plan's range is the slower of the step without overlap and the
/// profile's: usually the first, but the profile's own where its split GEMMs (Transformer
/// Engine's userbuffers under `--tp-comm-overlap`) lose more than the collectives cost.
#[test]
fn the_pessimistic_end_is_the_slower_of_no_overlap_and_the_profile() {
    use autopar_cost_model::software::Software;
    let under = |spec: &str, nodes: usize| {
        let mut m =
            CostModel::new(Cluster::preset(&format!("dgx-a100-40gb:nodes={nodes}")).unwrap());
        Software::parse(spec).unwrap().apply(&mut m);
        m
    };
    let step = |m: &CostModel, cfg: &TransformerConfig, plan: &str| {
        m.estimate(cfg, &Plan::parse(plan).unwrap())
            .unwrap()
            .iter_time_s
    };
    // A wide layer on few tokens, split over 8 ranks: the GEMMs TE splits are small.
    let cfg = TransformerConfig::gpt("wide", 32, 8192, 64, 1024, 32000);
    let plan = "dp=1,tp=8,pp=2,mbs=1,gbs=16,zero=3,recompute=full,sp=true";
    let m = under("nemo", 2);
    let (profile, none) = (step(&m, &cfg, plan), step(&m.without_overlap(), &cfg, plan));
    assert!(profile > none, "{profile} {none}");
    assert_eq!(step(&m.pessimistic(), &cfg, plan), profile);
    // Without split GEMMs the step without overlap is the slower end.
    let m = under("nemo,tp_comm_overlap=false", 2);
    let (profile, none) = (step(&m, &cfg, plan), step(&m.without_overlap(), &cfg, plan));
    assert!(none > profile);
    assert_eq!(step(&m.pessimistic(), &cfg, plan), none);
    // The pessimistic model's own no-overlap view has nothing slower behind it.
    assert!(m.pessimistic().without_overlap().slower_of.is_none());
}
