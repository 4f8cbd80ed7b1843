//! Exports of a plan to the established training stacks: Megatron-LM command-line arguments
//! and torchtitan TOML sections, with a comment wherever the framework cannot express the
//! plan exactly.
//!
//! Option names follow Megatron-LM's `megatron/training/arguments.py` and
//! `megatron/core/parallel_state.py` as of the core 0.13/0.14 releases (2025:
//! `--num-layers-per-virtual-pipeline-stage`, `--pipeline-model-parallel-layout`,
//! `--use-megatron-fsdp` with `--data-parallel-sharding-strategy`), and torchtitan's
//! `torchtitan/config/job_config.py` of mid-2025 (`[training] local_batch_size` /
//! `global_batch_size`, `[parallelism] pipeline_parallel_microbatch_size` and
//! `pipeline_parallel_layers_per_stage`); older releases of either spell some of them
//! differently.

use autopar_cost_model::estimate::stage_layers;
use autopar_cost_model::{Fp8Recipe, Offload, Plan, Recompute, Software, TransformerConfig};
use autopar_ir::DType;
use autopar_ir::schedule::ScheduleKind;

use crate::search::error::SearchError;

/// What neither stack can say of a plan whose layers leave Megatron-LM's placement over
/// `tp` ([`Plan::layer`]).
fn layer_note(plan: &Plan) -> Option<String> {
    let ops: Vec<&str> = plan.layer.sequence_ops().map(|op| op.name()).collect();
    if ops.is_empty() {
        return None;
    }
    Some(format!(
        "the plan runs {} on sequence shards with replicated weights ({}); these arguments \
         split every op over tp as Megatron-LM does, so they communicate and hold other amounts \
         than the plan (estimate the plan with {} to compare)",
        ops.join(", "),
        plan.layer,
        "attn=ttt,mlp=tt"
    ))
}

/// Megatron-LM's rank order, innermost first, for a plan's axis order (outermost first):
/// the reverse, e.g. `pp-dp-ep-cp-tp` becomes `tp-cp-ep-dp-pp`.
pub fn megatron_order(plan: &Plan) -> String {
    plan.axis_order
        .iter()
        .rev()
        .cloned()
        .collect::<Vec<_>>()
        .join("-")
}

/// Megatron-LM's `--pipeline-model-parallel-layout` for the plan's layer division: one
/// `|`-separated entry per virtual stage (`E` embedding, `t*N` layers, `L` loss and head; a
/// first or last stage without layers is `E` or `L` alone), dealt to the pipeline ranks
/// round-robin as the cost model assumes.
pub fn megatron_layout(cfg: &TransformerConfig, plan: &Plan) -> String {
    let layers = stage_layers(cfg, plan);
    let last = layers.len().saturating_sub(1);
    layers
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            format!(
                "{}{}{}",
                if i == 0 { "E" } else { "" },
                if n > 0 {
                    format!("t*{n}")
                } else {
                    String::new()
                },
                if i == last { "L" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// The Megatron-LM arguments (`pretrain_gpt.py`) that run `plan` on `cfg` as `software`
/// prices it (its fp8 recipe), one per line, with `#` comments for what the arguments cannot
/// say.
pub fn megatron_args(
    cfg: &TransformerConfig,
    plan: &Plan,
    software: &Software,
) -> Result<String, SearchError> {
    let mut args: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut arg = |a: &str| args.push(a.to_string());
    arg(&format!("--num-layers {}", cfg.layers));
    arg(&format!("--hidden-size {}", cfg.hidden));
    arg(&format!("--ffn-hidden-size {}", cfg.ffn));
    arg(&format!("--num-attention-heads {}", cfg.heads));
    if cfg.kv_heads != cfg.heads {
        arg("--group-query-attention");
        arg(&format!("--num-query-groups {}", cfg.kv_heads));
    }
    if cfg.gated_mlp {
        arg("--swiglu");
    }
    if !cfg.tied_embeddings {
        arg("--untie-embeddings-and-output-weights");
    }
    if cfg.experts > 1 {
        arg(&format!("--num-experts {}", cfg.experts));
        arg(&format!("--moe-router-topk {}", cfg.top_k));
    }
    arg(&format!("--seq-length {}", cfg.seq));
    arg(&format!("--max-position-embeddings {}", cfg.seq));
    arg(&format!("--tensor-model-parallel-size {}", plan.tp));
    arg(&format!("--pipeline-model-parallel-size {}", plan.pp));
    let layers = stage_layers(cfg, plan);
    let even = layers.iter().all(|&n| n == layers[0]);
    if !even {
        arg(&format!(
            "--pipeline-model-parallel-layout \"{}\"",
            megatron_layout(cfg, plan)
        ));
    } else if plan.vpp > 1 {
        arg(&format!(
            "--num-layers-per-virtual-pipeline-stage {}",
            cfg.layers / (plan.pp * plan.vpp)
        ));
    }
    if plan.schedule == ScheduleKind::GPipe && plan.pp > 1 {
        notes.push(
            "the plan uses GPipe; Megatron-LM runs 1F1B instead (the same bubbles, fewer \
             micro-batches in flight)"
                .into(),
        );
    }
    arg(&format!("--context-parallel-size {}", plan.cp));
    arg(&format!("--expert-model-parallel-size {}", plan.ep));
    if let Some(etp) = plan.etp {
        arg(&format!("--expert-tensor-parallel-size {etp}"));
    }
    match plan.offload {
        Offload::None => {}
        // Megatron-Core's hybrid device optimizer keeps the optimizer state on the CPU.
        Offload::Optimizer => {
            arg("--optimizer-cpu-offload");
        }
        Offload::Params => notes.push(
            "offload=params (FSDP/ZeRO-3 parameter offload) has no Megatron-LM flag; \
             --optimizer-cpu-offload offloads the optimizer state only"
                .into(),
        ),
    }
    if plan.sequence_parallel && plan.tp > 1 {
        arg("--sequence-parallel");
    }
    match plan.recompute {
        Recompute::None => {}
        Recompute::Selective => arg("--recompute-granularity selective"),
        Recompute::Full => {
            arg("--recompute-granularity full");
            match plan.recompute_layers {
                // The first N layers of each model chunk; the rest keep their activations.
                Some(n) => {
                    arg("--recompute-method block");
                    arg(&format!("--recompute-num-layers {n}"));
                }
                None => {
                    arg("--recompute-method uniform");
                    arg("--recompute-num-layers 1");
                }
            }
        }
    }
    match plan.zero_stage {
        0 => {}
        1 => {
            arg("--use-distributed-optimizer");
            arg("--overlap-param-gather");
        }
        stage => {
            arg("--use-distributed-optimizer");
            arg("--use-megatron-fsdp");
            arg(&format!(
                "--data-parallel-sharding-strategy {}",
                if stage == 2 {
                    "optim_grads"
                } else {
                    "optim_grads_params"
                }
            ));
            arg("--ckpt-format fsdp_dtensor");
        }
    }
    // The cost model overlaps the data-parallel reduction with the backward, as this does.
    arg("--overlap-grad-reduce");
    // The overlaps the profile prices beyond it, where Megatron-Core runs them.
    // Userbuffer pipelining of the tensor-parallel collectives, which the cost model (as
    // Megatron-LM) applies under sequence parallelism only.
    if software.tp_forward_overlap && plan.tp > 1 && plan.sequence_parallel {
        arg("--tp-comm-overlap");
    }
    if software.ep_comm_overlap && cfg.experts > 1 && plan.ep > 1 {
        match plan.overlaps_expert_all_to_alls(cfg) {
            true => arg("--overlap-moe-expert-parallel-comm"),
            false => notes.push(
                "the profile overlaps expert all-to-alls, which Megatron-Core refuses with \
                 full recomputation, outside 16-bit, or with pipeline stages but no virtual \
                 ones: the plan is priced without it"
                    .into(),
            ),
        }
    }
    arg(&format!("--micro-batch-size {}", plan.micro_batch_size));
    arg(&format!("--global-batch-size {}", plan.global_batch));
    if plan.fp8 {
        // Transformer Engine fp8 with e4m3 forward and e5m2 gradients, scaled per tensor
        // (Megatron's default recipe) unless the profile prices block scaling.
        arg("--fp8-format hybrid");
        if software.fp8_recipe == Fp8Recipe::Blockwise {
            arg("--fp8-recipe blockwise");
        }
    }
    match plan.dtype {
        DType::BF16 => arg("--bf16"),
        DType::F16 => arg("--fp16"),
        DType::F32 => {}
        other => {
            return Err(SearchError::Export {
                target: "megatron",
                message: format!("no Megatron-LM precision flag for {other}"),
            });
        }
    }
    if let Some(note) = layer_note(plan) {
        notes.push(note);
    }
    let order = megatron_order(plan);
    if order != "tp-cp-ep-dp-pp" {
        notes.push(format!(
            "rank order {order} (innermost first) differs from Megatron-LM's default \
             tp-cp-ep-dp-pp: pass order=\"{order}\" to \
             megatron.core.parallel_state.initialize_model_parallel"
        ));
    }
    let mut out = format!(
        "# Megatron-LM arguments for {} (data parallel {} = world {} / (tp x pp x cp))\n",
        cfg.name,
        plan.dp,
        plan.world_size()
    );
    for n in &notes {
        out += &format!("# note: {n}\n");
    }
    let last = args.len().saturating_sub(1);
    for (i, a) in args.iter().enumerate() {
        out += a;
        out += if i == last { "\n" } else { " \\\n" };
    }
    Ok(out)
}

/// torchtitan TOML sections (`[training]`, `[parallelism]`, `[activation_checkpoint]`) for
/// `plan` on `cfg`, with `#` comments for what torchtitan cannot express.
pub fn torchtitan_toml(cfg: &TransformerConfig, plan: &Plan) -> Result<String, SearchError> {
    if plan.fp8 {
        return Err(SearchError::Export {
            target: "torchtitan",
            message: "dtype=fp8 is priced as Transformer Engine's fp8 recipe, which torchtitan \
                      does not run (its float8 converter is torchao's): export for megatron"
                .into(),
        });
    }
    let precision = match plan.dtype {
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        other => {
            return Err(SearchError::Export {
                target: "torchtitan",
                message: format!(
                    "torchtitan's mixed_precision_param is bfloat16 or float32, not {other}"
                ),
            });
        }
    };
    let mut notes: Vec<String> = Vec::new();
    // Data parallelism: FSDP (sharded) for ZeRO-2/3, DDP (replicated) for ZeRO-0.
    let (replicate, shard, reshard) = match plan.zero_stage {
        0 => (plan.dp, 1, None),
        1 => {
            notes.push(
                "torchtitan has no ZeRO-1 (optimizer-only sharding); FSDP without resharding \
                 after forward (ZeRO-2-like) is the nearest"
                    .into(),
            );
            (1, plan.dp, Some("never"))
        }
        2 => (1, plan.dp, Some("never")),
        _ => (1, plan.dp, Some("always")),
    };
    if replicate > 1 && (plan.tp > 1 || plan.pp > 1 || plan.cp > 1) {
        notes.push(
            "pure replication (DDP) combined with other parallelisms may be unsupported by \
             your torchtitan version; data_parallel_shard_degree (FSDP) is the usual choice"
                .into(),
        );
    }
    if plan.offload == Offload::Optimizer {
        notes.push(
            "torchtitan offloads parameters, gradients and optimizer state together \
             (enable_cpu_offload); the plan was ranked with the optimizer state only offloaded"
                .into(),
        );
    }
    if plan.etp.is_some() {
        notes.push(
            "torchtitan has no expert tensor parallelism separate from tp; the plan's etp \
             is not expressed"
                .into(),
        );
    }
    if plan.tp > 1 && !plan.sequence_parallel {
        notes.push(
            "torchtitan's tensor parallelism always shards norms and dropout over the sequence \
             (sequence parallelism); the plan was ranked without it"
                .into(),
        );
    }
    if let Some(note) = layer_note(plan) {
        notes.push(note);
    }
    if plan.recompute == Recompute::Selective {
        notes.push(
            "selective recompute maps to torchtitan's per-op policy (selective_ac_option = \
             \"op\"), which `--software torchtitan` prices; other profiles price \
             recomputing the attention core only"
                .into(),
        );
    }
    // torchtitan checkpoints every k-th block of a stage (layer-SAC, `selective_ac_option
    // = "k"`), ceil(l / k) of its l layers: the plan's per-stage count maps to the k that
    // gives it on every stage, or to the densest k that recomputes at least as many.
    let layer_sac = plan
        .recompute_layers
        .filter(|_| plan.recompute == Recompute::Full)
        .map(|n| {
            let layers = stage_layers(cfg, plan);
            let widest = layers.iter().copied().max().unwrap_or(1);
            let exact = (1..=widest).find(|&k| layers.iter().all(|&l| l.div_ceil(k) == n.min(l)));
            let covering = (1..=widest)
                .rev()
                .find(|&k| layers.iter().all(|&l| l.div_ceil(k) >= n.min(l)))
                .unwrap_or(1);
            (n, exact, covering)
        });
    if let Some((n, None, k)) = layer_sac {
        notes.push(format!(
            "recompute_layers={n} (the first {n} layers of each stage) has no torchtitan \
             equivalent: it checkpoints every k-th layer; {} recomputes at least as many, \
             so it takes more time than the plan was ranked with",
            match k {
                1 => "full recompute".to_string(),
                k => format!("k = {k}"),
            }
        ));
    }
    if plan.axis_order != Plan::DEFAULT_ORDER {
        notes.push(format!(
            "the plan places mesh axes {} (outermost first); torchtitan builds its device \
             mesh as pp, dp_replicate, dp_shard, cp, tp",
            plan.axis_order.join("-")
        ));
    }
    let per_replica = plan.global_batch / plan.dp.max(1);
    let mut out = format!("# torchtitan configuration for {}\n", cfg.name);
    for n in &notes {
        out += &format!("# note: {n}\n");
    }
    out += "\n[training]\n";
    if plan.pp > 1 {
        // The pipeline splits each rank's batch into micro-batches.
        out += &format!("local_batch_size = {per_replica}\n");
    } else {
        // Without a pipeline, micro-batches are gradient-accumulation steps.
        out += &format!("local_batch_size = {}\n", plan.micro_batch_size);
    }
    out += &format!("global_batch_size = {}\n", plan.global_batch);
    out += &format!("seq_len = {}\n", cfg.seq);
    out += &format!("mixed_precision_param = \"{precision}\"\n");
    out += "mixed_precision_reduce = \"float32\"\n";
    if plan.offload != Offload::None {
        // FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the CPU.
        out += "enable_cpu_offload = true\n";
    }
    out += "\n[parallelism]\n";
    out += &format!("data_parallel_replicate_degree = {replicate}\n");
    out += &format!("data_parallel_shard_degree = {shard}\n");
    if let Some(r) = reshard {
        out += &format!("fsdp_reshard_after_forward = \"{r}\"\n");
    }
    out += &format!("tensor_parallel_degree = {}\n", plan.tp);
    out += "enable_async_tensor_parallel = false\n";
    out += &format!("pipeline_parallel_degree = {}\n", plan.pp);
    if plan.pp > 1 {
        out += &format!(
            "pipeline_parallel_schedule = \"{}\"\n",
            match plan.schedule {
                ScheduleKind::GPipe => "GPipe",
                ScheduleKind::OneFOneB => "1F1B",
                ScheduleKind::Interleaved => "Interleaved1F1B",
            }
        );
        out += &format!(
            "pipeline_parallel_microbatch_size = {}\n",
            plan.micro_batch_size
        );
        let layers = stage_layers(cfg, plan);
        if layers.iter().all(|&n| n == layers[0]) {
            out += &format!("pipeline_parallel_layers_per_stage = {}\n", layers[0]);
        } else {
            out += &format!(
                "# layers per stage {layers:?}: uneven, give pipeline_parallel_split_points\n"
            );
        }
    }
    out += &format!("context_parallel_degree = {}\n", plan.cp);
    out += &format!("expert_parallel_degree = {}\n", plan.ep);
    out += "\n[activation_checkpoint]\n";
    match plan.recompute {
        Recompute::None => out += "mode = \"none\"\n",
        Recompute::Full => match layer_sac {
            Some((_, exact, fallback)) => {
                let k = exact.unwrap_or(fallback);
                match k {
                    1 => out += "mode = \"full\"\n",
                    k => out += &format!("mode = \"selective\"\nselective_ac_option = \"{k}\"\n"),
                }
            }
            None => out += "mode = \"full\"\n",
        },
        Recompute::Selective => {
            out += "mode = \"selective\"\nselective_ac_option = \"op\"\n";
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt3_plan() -> Plan {
        Plan::parse("dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,zero=1,sp=true,gbs=1536").unwrap()
    }

    #[test]
    fn megatron_arguments_of_the_gpt3_plan() {
        let cfg = TransformerConfig::gpt3_175b();
        let s = megatron_args(&cfg, &gpt3_plan(), &Software::default()).unwrap();
        for want in [
            "--tensor-model-parallel-size 8 \\",
            "--pipeline-model-parallel-size 16 \\",
            "--num-layers-per-virtual-pipeline-stage 3 \\",
            "--context-parallel-size 1 \\",
            "--expert-model-parallel-size 1 \\",
            "--sequence-parallel \\",
            "--recompute-granularity full \\",
            "--recompute-method uniform \\",
            "--use-distributed-optimizer \\",
            "--micro-batch-size 1 \\",
            "--global-batch-size 1536 \\",
            "--bf16\n",
        ] {
            assert!(s.contains(want), "{want} missing from\n{s}");
        }
        assert!(!s.contains("note:"), "{s}");
    }

    /// A plan that recomputes some layers of each stage: Megatron-LM's block method, and
    /// torchtitan's every-k-th-layer checkpointing where it gives the same counts.
    #[test]
    fn partial_recompute_exports() {
        let cfg = TransformerConfig::gpt3_175b();
        let plan = |n: usize| {
            Plan::parse(&format!(
                "dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,recompute_layers={n},zero=1,\
                 sp=true,gbs=1536"
            ))
            .unwrap()
        };
        // 96 layers over 32 virtual stages: 3 each.
        let s = megatron_args(&cfg, &plan(2), &Software::default()).unwrap();
        for want in [
            "--recompute-granularity full \\",
            "--recompute-method block \\",
            "--recompute-num-layers 2 \\",
        ] {
            assert!(s.contains(want), "{want} missing from\n{s}");
        }
        // ceil(3 / 2) = 2 and ceil(3 / 3) = 1: every second or third layer.
        let t = torchtitan_toml(&cfg, &plan(2)).unwrap();
        assert!(
            t.contains("mode = \"selective\"\nselective_ac_option = \"2\""),
            "{t}"
        );
        assert!(!t.contains("no torchtitan"), "{t}");
        let t = torchtitan_toml(&cfg, &plan(1)).unwrap();
        assert!(t.contains("selective_ac_option = \"3\""), "{t}");
        // All of a stage's layers is full recompute.
        let t = torchtitan_toml(&cfg, &plan(5)).unwrap();
        assert!(
            t.contains("[activation_checkpoint]\nmode = \"full\""),
            "{t}"
        );
        // 10 layers on one stage: 4 is ceil(10 / 3); 6 is no ceil(10 / k), and the
        // densest k recomputing at least 6 is 1, every layer.
        let mut small = cfg.clone();
        small.layers = 10;
        let p = |n: usize| {
            Plan::parse(&format!("dp=8,recompute=full,recompute_layers={n},gbs=8")).unwrap()
        };
        let t = torchtitan_toml(&small, &p(4)).unwrap();
        assert!(t.contains("selective_ac_option = \"3\""), "{t}");
        let t = torchtitan_toml(&small, &p(6)).unwrap();
        assert!(t.contains("no torchtitan equivalent"), "{t}");
        assert!(
            t.contains("[activation_checkpoint]\nmode = \"full\""),
            "{t}"
        );
        // Uneven stages of 8 and 2 layers, 2 recomputed in each: no k gives both, and only
        // every layer covers the short stage.
        let uneven =
            Plan::parse("dp=4,pp=2,recompute=full,recompute_layers=2,stages=8-2,gbs=8").unwrap();
        let t = torchtitan_toml(&small, &uneven).unwrap();
        assert!(
            t.contains("full recompute recomputes at least as many"),
            "{t}"
        );
        assert!(
            t.contains("[activation_checkpoint]\nmode = \"full\""),
            "{t}"
        );
    }

    /// The overlaps a profile prices are exported where Megatron-Core runs them: userbuffer
    /// pipelining under sequence parallelism, the expert all-to-alls beside the other
    /// micro-batch's compute except where Megatron-Core refuses it (full recomputation, or
    /// pipeline stages without virtual ones), which the note says and the estimate heeds.
    #[test]
    fn overlaps_are_exported_where_megatron_runs_them() {
        let cfg = TransformerConfig::mixtral_8x7b();
        let sw = Software::parse("megatron-core,ep_comm_overlap=true").unwrap();
        let args = |p: &str| megatron_args(&cfg, &Plan::parse(p).unwrap(), &sw).unwrap();
        let s = args("dp=8,ep=8,tp=2,sp=true,pp=2,vpp=4,schedule=interleaved,gbs=64");
        assert!(s.contains("--tp-comm-overlap \\"), "{s}");
        assert!(s.contains("--overlap-moe-expert-parallel-comm \\"), "{s}");
        assert!(!s.contains("note:"), "{s}");
        for refused in [
            "dp=8,ep=8,pp=2,gbs=64",
            "dp=8,ep=8,pp=2,vpp=4,schedule=interleaved,recompute=full,gbs=64",
        ] {
            let s = args(refused);
            assert!(!s.contains("--overlap-moe-expert-parallel-comm"), "{s}");
            assert!(s.contains("Megatron-Core refuses"), "{s}");
            assert!(!s.contains("--tp-comm-overlap"), "{s}");
        }
        let plain = megatron_args(
            &cfg,
            &Plan::parse("dp=8,ep=8,gbs=64").unwrap(),
            &Software::parse("megatron-core").unwrap(),
        )
        .unwrap();
        assert!(!plain.contains("--overlap-moe"), "{plain}");
    }

    /// fp8 plans export Transformer Engine's hybrid format, with the block-scaling recipe
    /// when the profile prices it.
    #[test]
    fn fp8_plans_export_the_profiles_recipe() {
        let cfg = TransformerConfig::gpt3_175b();
        let plan = Plan::parse("dp=8,tp=8,gbs=64,dtype=fp8").unwrap();
        let tensor = megatron_args(&cfg, &plan, &Software::default()).unwrap();
        assert!(tensor.contains("--fp8-format hybrid"), "{tensor}");
        assert!(!tensor.contains("--fp8-recipe"), "{tensor}");
        let block = Software::parse("megatron-core,fp8_recipe=blockwise").unwrap();
        let s = megatron_args(&cfg, &plan, &block).unwrap();
        assert!(s.contains("--fp8-recipe blockwise"), "{s}");
    }

    #[test]
    fn uneven_stages_use_a_layout_and_orders_are_noted() {
        let mut cfg = TransformerConfig::gpt3_175b();
        cfg.layers = 10;
        let plan = Plan::parse("dp=2,pp=4,gbs=8,order=pp-dp").unwrap();
        assert_eq!(megatron_layout(&cfg, &plan), "Et*3|t*3|t*2|t*2L");
        let s = megatron_args(&cfg, &plan, &Software::default()).unwrap();
        assert!(s.contains("--pipeline-model-parallel-layout \"Et*3|t*3|t*2|t*2L\""));
        assert!(s.contains("order=\"dp-pp-tp-cp-ep\""), "{s}");
        // Embedding and head in stages of their own.
        let plan = Plan::parse("dp=2,pp=2,vpp=2,gbs=8,stages=0-5-5-0").unwrap();
        assert_eq!(megatron_layout(&cfg, &plan), "E|t*5|t*5|L");
    }

    #[test]
    fn torchtitan_sections() {
        let cfg = TransformerConfig::gpt3_175b();
        let s = torchtitan_toml(&cfg, &gpt3_plan()).unwrap();
        for want in [
            "[training]\nlocal_batch_size = 192\nglobal_batch_size = 1536\n",
            "mixed_precision_param = \"bfloat16\"",
            "[parallelism]\n",
            "data_parallel_shard_degree = 8",
            "data_parallel_replicate_degree = 1",
            "tensor_parallel_degree = 8",
            "pipeline_parallel_degree = 16",
            "pipeline_parallel_schedule = \"Interleaved1F1B\"",
            "pipeline_parallel_layers_per_stage = 3",
            "context_parallel_degree = 1",
            "enable_async_tensor_parallel = false",
            "[activation_checkpoint]\nmode = \"full\"",
        ] {
            assert!(s.contains(want), "{want} missing from\n{s}");
        }
        // ZeRO-1 has no torchtitan equivalent: said in a note.
        assert!(s.contains("no ZeRO-1"));
        let fp16 = Plan {
            dtype: DType::F16,
            ..gpt3_plan()
        };
        assert!(torchtitan_toml(&cfg, &fp16).is_err());
    }
}
