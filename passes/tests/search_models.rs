//! The search on the three workloads: GPT-3 175B on 1024 A100s (best plan at least as
//! fast as the hand-tuned Megatron-LM configuration, with an explanation naming the deciding
//! term), Llama 3 70B on 64 H100s and Mixtral 8x7B on 32 H100s (fitting plans).

use autopar_cost_model::{Cluster, CostModel, Offload, Plan, TransformerConfig};
use autopar_passes::search::explain::{Comparison, Term};
use autopar_passes::search::{Constraints, SearchOptions, search};

fn model(preset: &str) -> CostModel {
    CostModel::new(Cluster::preset(preset).expect("preset"))
}

/// Llama 3 70B as the model zoo builds it.
fn llama3_70b() -> TransformerConfig {
    dense("llama3-70b", 80, 8192, 64, 28672)
}

#[test]
fn gpt3_175b_on_1024_a100s_beats_the_hand_tuned_plan() {
    let m = model("dgx-a100:nodes=128");
    let cfg = TransformerConfig::gpt3_175b();
    let opts = SearchOptions::new(1536);
    let r = search(&m, &cfg, &opts).unwrap();
    // Speed is measured by `benches/search.rs`; here, that the bounds do the work: of the
    // millions of candidates, only about a thousand need a full estimate.
    assert!(r.stats.complete);
    assert!(r.stats.estimated <= 5_000, "{:?}", r.stats);
    let best = &r.plans[0];
    assert!(best.estimate.fits);
    let hand =
        Plan::parse("dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,schedule=interleaved,gbs=1536")
            .unwrap();
    let hand_est = m.estimate(&cfg, &hand).unwrap();
    assert!(hand_est.fits);
    assert!(
        best.estimate.tokens_per_s >= hand_est.tokens_per_s,
        "{} < {}",
        best.estimate.tokens_per_s,
        hand_est.tokens_per_s
    );
    let why = Comparison::new(
        &cfg,
        "the hand-tuned plan",
        (&best.plan, &best.estimate),
        (&hand, &hand_est),
    );
    if best.estimate.iter_time_s < hand_est.iter_time_s {
        assert!(why.deciding_saving_s > 0.0);
        assert!(
            why.summary()
                .contains(&format!("The deciding term is {}", why.deciding.name())),
            "{why}"
        );
        assert!(Term::ALL.contains(&why.deciding));
        // The terms add up to the step times.
        let (b, o): (f64, f64) = why
            .terms
            .iter()
            .fold((0.0, 0.0), |(b, o), d| (b + d.best_s, o + d.other_s));
        assert!((b - why.best_iter_time_s).abs() < 1e-9 * b);
        assert!((o - why.other_iter_time_s).abs() < 1e-9 * o);
    }
}

#[test]
fn llama3_70b_on_64_h100s_and_mixtral_on_32_h100s_fit() {
    for (cfg, preset, batch) in [
        (llama3_70b(), "dgx-h100:nodes=8", 512),
        (TransformerConfig::mixtral_8x7b(), "dgx-h100:nodes=4", 256),
    ] {
        let m = model(preset);
        let r = search(&m, &cfg, &SearchOptions::new(batch)).unwrap();
        assert!(r.stats.complete);
        assert!(!r.plans.is_empty(), "{}", cfg.name);
        for p in &r.plans {
            assert!(p.estimate.fits);
            assert!(p.estimate.peak_memory_gib <= 80.0);
        }
        // Ranked best first.
        assert!(
            r.plans
                .windows(2)
                .all(|w| w[0].estimate.iter_time_s <= w[1].estimate.iter_time_s)
        );
    }
}

fn dense(name: &str, layers: usize, hidden: usize, heads: usize, ffn: usize) -> TransformerConfig {
    TransformerConfig {
        name: name.into(),
        layers,
        hidden,
        heads,
        kv_heads: 8,
        head_dim: None,
        ffn,
        vocab: 128256,
        seq: 8192,
        experts: 1,
        top_k: 1,
        gated_mlp: true,
        tied_embeddings: false,
        learned_positions: false,
        rms_norm: true,
        shared_ffn: 0,
    }
}

/// One worker, so that what the time bounds prune does not depend on thread timing.
fn pinned(batch: usize, pins: &str) -> SearchOptions {
    let mut o = SearchOptions::new(batch);
    o.constraints = Constraints::parse(pins).expect("pins");
    o.threads = 1;
    o
}

/// CPU offload enters the space only where the GPUs cannot hold a plan's state otherwise: a
/// model that fits is searched exactly as with offload pinned off, and one that fits only
/// with offload is found with it.
#[test]
fn the_search_offloads_only_when_the_gpus_cannot_hold_the_state() {
    let m = model("dgx-a100:nodes=1");
    let small = dense("llama-1b", 16, 2048, 32, 8192);
    let free = search(&m, &small, &pinned(64, "")).unwrap();
    let off = search(&m, &small, &pinned(64, "offload=none")).unwrap();
    assert!(free.plans.iter().all(|p| p.plan.offload == Offload::None));
    assert_eq!(free.stats.candidates, off.stats.candidates);
    assert_eq!(free.stats.estimated, off.stats.estimated);
    assert_eq!(free.plans, off.plans);

    // 34B on eight 40 GB GPUs: 34B x 18 bytes over 8 ranks is 76 GB of state each without
    // offload; with it, the 1 TB host holds the fp32 state.
    let m = model("dgx-a100-40gb:nodes=1");
    let big = dense("llama-34b", 48, 8192, 64, 22016);
    let none = search(&m, &big, &pinned(64, "offload=none")).unwrap();
    assert!(none.plans.is_empty(), "{:?}", none.plans[0].plan);
    let r = search(&m, &big, &SearchOptions::new(64)).unwrap();
    assert!(!r.plans.is_empty());
    for p in &r.plans {
        assert_ne!(p.plan.offload, Offload::None, "{}", p.plan);
        assert!(p.estimate.fits && p.estimate.memory.host > 0.0);
    }
}

/// Llama 3 405B on 16K H100s: the offload families the space gains (shapes whose state does
/// not fit at ZeRO-2/3) are pruned by their bounds, not estimated.
#[test]
fn offload_does_not_make_the_405b_search_estimate_more() {
    let m = model("dgx-h100:nodes=2048");
    let cfg = dense("llama3-405b", 126, 16384, 128, 53248);
    let free = search(&m, &cfg, &pinned(2048, "")).unwrap();
    let off = search(&m, &cfg, &pinned(2048, "offload=none")).unwrap();
    assert!(free.stats.complete && off.stats.complete);
    assert_eq!(free.plans, off.plans);
    assert!(
        free.stats.estimated <= off.stats.estimated + off.stats.estimated / 20,
        "{:?} vs {:?}",
        free.stats,
        off.stats
    );
}

/// Expert tensor parallelism is a dimension of the MoE search: with `tp=4` pinned, plans
/// with the experts over 1 or 2 of the 4 ranks are estimated and ranked beside `etp=tp`.
#[test]
fn the_moe_search_explores_expert_tensor_parallelism() {
    let m = model("dgx-h100:nodes=2");
    let mut o = pinned(64, "tp=4,sp=true,pp=1,zero=1,recompute=full");
    o.top_k = 1000;
    let r = search(&m, &TransformerConfig::mixtral_8x7b(), &o).unwrap();
    let etps: std::collections::BTreeSet<usize> =
        r.plans.iter().map(|p| p.plan.expert_tp()).collect();
    assert!(etps.contains(&4) && etps.len() > 1, "{etps:?}");
    let pinned_tp = search(&m, &TransformerConfig::mixtral_8x7b(), &{
        let mut p = pinned(64, "tp=4,sp=true,pp=1,zero=1,recompute=full,etp=4");
        p.top_k = 1000;
        p
    })
    .unwrap();
    assert!(pinned_tp.plans.iter().all(|p| p.plan.etp.is_none()));
    assert!(pinned_tp.stats.candidates < r.stats.candidates);
}

/// Below `tp`, experts fold over the tensor-parallel ranks (Megatron-Core's MoE parallel
/// folding): with `tp=4` and `etp=1` the four ranks of a tensor-parallel group join expert
/// parallelism first, so the search reaches `ep` above `dp` (8 experts over 8 ranks on
/// `dp=4`), and a pinned `ep=8` finds those plans rather than none.
#[test]
fn the_moe_search_folds_experts_over_tensor_parallel_ranks() {
    let m = model("dgx-h100:nodes=2");
    let mut o = pinned(64, "tp=4,etp=1,sp=true,pp=1,zero=1,recompute=full");
    o.top_k = 1000;
    let r = search(&m, &TransformerConfig::mixtral_8x7b(), &o).unwrap();
    assert!(
        r.plans.iter().any(|p| p.plan.ep > p.plan.dp),
        "{:?}",
        r.plans
            .iter()
            .map(|p| (p.plan.dp, p.plan.ep))
            .collect::<Vec<_>>()
    );
    let mut o = pinned(64, "tp=4,etp=1,ep=8,sp=true,pp=1,zero=1,recompute=full");
    o.top_k = 1000;
    let r = search(&m, &TransformerConfig::mixtral_8x7b(), &o).unwrap();
    assert!(!r.plans.is_empty());
    for p in &r.plans {
        assert_eq!((p.plan.dp, p.plan.ep, p.plan.ep_over_tp()), (4, 8, 4));
        // The estimate the search ranked is the one `estimate` gives for the same plan.
        let again = m
            .estimate(&TransformerConfig::mixtral_8x7b(), &p.plan)
            .unwrap();
        assert!((again.iter_time_s - p.estimate.iter_time_s).abs() <= 1e-9 * again.iter_time_s);
    }
}

/// The search offers what the software profile's stack can run: under Megatron-Core no
/// ZeRO beyond the distributed optimizer (ZeRO-1), under FSDP no ZeRO-1 (it has no such
/// sharding strategy), under Megatron-LM of 2021 neither sequence parallelism nor selective
/// recompute nor any sharding, under Composer's FSDP data parallelism only, and only this
/// project's compiler places layer ops other than Megatron-LM's way; a pinned value is
/// searched under any profile.
#[test]
fn the_search_offers_what_the_profiles_stack_runs() {
    use autopar_cost_model::{LayerPlacement, Recompute, Software};
    let cfg = dense("llama-8b", 32, 4096, 32, 14336);
    let under = |profile: &str, pins: &str| {
        let mut m = model("dgx-h100:nodes=2");
        Software::parse(profile).unwrap().apply(&mut m);
        let r = search(&m, &cfg, &pinned(64, pins)).unwrap();
        assert!(!r.plans.is_empty(), "{profile} {pins}");
        r.plans.into_iter().map(|p| p.plan).collect::<Vec<Plan>>()
    };
    let megatron = under("megatron-core", "");
    assert!(megatron.iter().all(|p| p.zero_stage <= 1), "{megatron:?}");
    assert!(megatron.iter().all(|p| p.layer == LayerPlacement::MEGATRON));
    let fsdp = under("fsdp", "");
    assert!(
        fsdp.iter()
            .all(|p| p.zero_stage != 1 && !p.sequence_parallel)
    );
    assert!(fsdp.iter().any(|p| p.zero_stage == 3));
    // Composer's FSDP is data parallelism only; a pinned degree is searched all the same.
    assert!(fsdp.iter().all(|p| p.tp == 1 && p.pp == 1), "{fsdp:?}");
    let fsdp_tp = under("fsdp", "tp=2");
    assert!(fsdp_tp.iter().all(|p| p.tp == 2));
    // torchtitan's selective recomputation (its per-op policy) does work beside flash
    // attention, so the search weighs it; Megatron's does not and is left out.
    let titan = {
        let mut m = model("dgx-h100:nodes=2");
        Software::parse("torchtitan").unwrap().apply(&mut m);
        let mut o = pinned(64, "tp=1,pp=1,zero=3,mbs=2");
        o.top_k = 1000;
        search(&m, &cfg, &o).unwrap().plans
    };
    assert!(
        titan
            .iter()
            .any(|p| p.plan.recompute == Recompute::Selective)
    );
    assert!(megatron.iter().all(|p| p.recompute != Recompute::Selective));
    let old = under("megatron-lm-2021,attention=unfused", "");
    for p in &old {
        assert_eq!(p.zero_stage, 0, "{p}");
        assert!(
            !p.sequence_parallel && p.recompute != Recompute::Selective,
            "{p}"
        );
    }
    let pinned_three = under("megatron-core", "zero=3");
    assert!(pinned_three.iter().all(|p| p.zero_stage == 3));
    let pinned_sp = under("megatron-lm-2021", "tp=8,sp=true");
    assert!(pinned_sp.iter().all(|p| p.sequence_parallel));
    let autopar = under("autopar", "tp=2");
    assert!(autopar.iter().any(|p| p.layer != LayerPlacement::MEGATRON));
    assert_eq!(
        Software::preset("megatron-lm-2021").unwrap().offers().zero,
        &[0]
    );
    assert_eq!(
        Software::preset("autopar").unwrap().offers().zero,
        &[0, 1, 2, 3]
    );
}
