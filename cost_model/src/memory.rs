//! Memory per rank: weights, gradients and optimizer state divided as the ZeRO stage says,
//! activations per layer and micro-batch after Korthikanti et al. 2022 times the in-flight
//! micro-batches of the pipeline schedule, communication buffers and reserved memory.
//!
//! Two runtimes keep different bytes ([`crate::cluster::Runtime`]): a mixed-precision GPU
//! stack in the style of Megatron-LM ([`activation_bytes_per_layer`], [`MemoryParams::default`])
//! and autopar's CPU runtime ([`runtime_activation_bytes_per_layer`],
//! [`MemoryParams::autopar_cpu`]), whose recorded peaks the estimate is checked against.

use serde::{Deserialize, Serialize};

use crate::compute::AttentionKernel;
use crate::layer::{LayerOp, OpPlacement};
use crate::model::TransformerConfig;
use crate::plan::{Plan, Recompute};

/// Tunable parameters of the memory model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryParams {
    /// Bytes per parameter of the gradient buffer. Megatron-LM accumulates gradients in fp32
    /// under bf16 training (its `main_grad`), hence 4.
    pub grad_bytes_per_param: f64,
    /// Bytes per parameter of optimizer state under mixed precision: fp32 master weights and
    /// AdamW's two fp32 moments.
    pub optimizer_bytes_per_param: f64,
    /// Internal buffers NCCL allocates per communicator that is used (channels x buffers).
    pub nccl_buffer_bytes_per_group: f64,
    /// Bytes per parameter of the weights a rank holds between steps; `None` for the compute
    /// dtype (16-bit weights beside fp32 master weights counted in the optimizer state).
    pub weight_bytes_per_param: Option<f64>,
    /// Whether gradient buffers exist for the whole step (Megatron's contiguous buffers), or
    /// only from the moment the backward produces each gradient.
    pub gradients_up_front: bool,
}

impl MemoryParams {
    /// autopar's CPU runtime: its fp32 parameters are the master weights (4 bytes), AdamW's
    /// two fp32 moments are the optimizer state (8 bytes), gradients are fp32 values of the
    /// step graph that exist from their producer on, and there are no communicator buffers.
    pub fn autopar_cpu() -> Self {
        MemoryParams {
            grad_bytes_per_param: 4.0,
            optimizer_bytes_per_param: 8.0,
            nccl_buffer_bytes_per_group: 0.0,
            weight_bytes_per_param: Some(4.0),
            gradients_up_front: false,
        }
    }
}

impl Default for MemoryParams {
    fn default() -> Self {
        MemoryParams {
            grad_bytes_per_param: 4.0,
            optimizer_bytes_per_param: 12.0,
            nccl_buffer_bytes_per_group: 128.0 * 1024.0 * 1024.0,
            weight_bytes_per_param: None,
            gradients_up_front: true,
        }
    }
}

/// What one rank holds at its peak, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Pipeline rank described (the one with the highest peak).
    pub pipeline_rank: usize,
    /// Parameters held on this rank (after tensor/pipeline/expert division, before ZeRO).
    pub num_params: f64,
    /// Of `num_params`, the experts' (sharded by ZeRO over the ranks that hold the same
    /// experts, [`ZeroShards::expert`]).
    #[serde(default)]
    pub num_expert_params: f64,
    /// Weights in the compute dtype.
    pub weights: f64,
    /// Gradient buffers.
    pub gradients: f64,
    /// Master weights and optimizer moments.
    pub optimizer: f64,
    /// Stored activations of the in-flight micro-batches.
    pub activations: f64,
    /// Micro-batch chunks in flight at the peak.
    pub in_flight: usize,
    /// Transient memory of the backward of one layer (recomputed activations, logits).
    pub working: f64,
    /// Communication buffers (pipeline messages, gathered sequence-parallel inputs, NCCL).
    pub comm_buffers: f64,
    /// Memory the device cannot give to tensors.
    pub reserved: f64,
    /// Sum of the above.
    pub total: f64,
    /// Device capacity.
    pub capacity: f64,
    /// Bytes this rank keeps in host memory under CPU offload ([`crate::plan::Offload`]):
    /// its shard of the fp32 master weights, Adam moments and fp32 gradients (and, when the
    /// parameters are offloaded, nothing more: FSDP's fp32 shard is the master). Not part of
    /// `total`, which is the device's.
    #[serde(default)]
    pub host: f64,
}

/// Parameters of each placed op of one layer ([`LayerOp`]), before any division: the QKV
/// projection and output projection with their biases, the dense MLP's input GEMM(s) (up,
/// and gate when gated) and output GEMM with theirs. A MoE MLP's routed experts and router
/// are counted whole under [`LayerOp::MlpIn`] (expert parallelism places them); its shared
/// expert is split between the two as a dense MLP is.
pub fn op_params(cfg: &TransformerConfig, op: LayerOp) -> f64 {
    let (h, d) = (cfg.hidden as f64, cfg.head_dim() as f64);
    let (a, kv) = (cfg.heads as f64, cfg.kv_heads as f64);
    let moe = cfg.experts > 1;
    // The dense MLP's width: the shared expert's under MoE (0 without one).
    let f = if moe { cfg.shared_ffn } else { cfg.ffn } as f64;
    let in_mats = if cfg.gated_mlp { 2.0 } else { 1.0 };
    let dense_in = if f > 0.0 { in_mats * (h * f + f) } else { 0.0 };
    let dense_out = if f > 0.0 { f * h + h } else { 0.0 };
    let routed = (cfg.routed_expert_params() + cfg.router_params()) as f64;
    match op {
        LayerOp::Qkv => (h + 1.0) * (a + 2.0 * kv) * d,
        LayerOp::Attention => 0.0,
        LayerOp::Proj => a * d * h + h,
        LayerOp::MlpIn => routed + dense_in,
        LayerOp::MlpOut => dense_out,
    }
}

/// Parameters of one transformer layer held by one rank under `plan`, before any ZeRO
/// division: each op's split over the tensor-parallel ranks unless the plan runs it on
/// sequence shards ([`Plan::layer`]), the experts also over the expert-parallel ranks, the
/// norms replicated.
pub fn layer_params_per_rank(cfg: &TransformerConfig, plan: &Plan) -> f64 {
    LayerOp::ALL
        .into_iter()
        .map(|op| {
            // The experts over ep x etp (expert tensor parallelism, `tp` by default) and the
            // router replicated; the rest of the op as its placement splits it.
            let (mut n, mut held) = (op_params(cfg, op), 0.0);
            if op == LayerOp::MlpIn {
                let router = cfg.router_params() as f64;
                held = expert_params_per_layer(cfg, plan) + router;
                n -= cfg.routed_expert_params() as f64 + router;
            }
            if plan.layer.get(op) == OpPlacement::Tensor {
                n /= plan.tp as f64;
            }
            n + held
        })
        .sum::<f64>()
        + cfg.norm_params() as f64
}

/// Of [`layer_params_per_rank`], the parameters replicated over `tp` because their op runs
/// on sequence shards: their gradients are summed over `tp` once per step.
///
/// Their optimizer state (and fp32 master weights) is sharded over `tp` all the same, as
/// ZeRO shards it over data-parallel ranks: the summed gradient is reduce-scattered, each rank
/// updates its shard and the updated weights are all-gathered, which moves what an
/// all-reduce moves ([`optimizer_params_per_layer`]).
pub fn tp_replicated_params_per_layer(cfg: &TransformerConfig, plan: &Plan) -> f64 {
    if plan.tp <= 1 {
        return 0.0;
    }
    plan.layer.sequence_ops().map(|op| op_params(cfg, op)).sum()
}

/// Of [`layer_params_per_rank`], the routed experts' parameters (a MoE MLP without its
/// router and shared expert, which are dense): one rank holds `1/ep` of the experts (and
/// `1/etp` of each, [`Plan::expert_tp`]), replicated over the `dp / ep x tp / etp` ranks
/// that hold the same expert shards.
pub fn expert_params_per_layer(cfg: &TransformerConfig, plan: &Plan) -> f64 {
    cfg.routed_expert_params() as f64 / plan.ep as f64 / plan.expert_tp() as f64
}

/// Over how many ranks ZeRO shards a parameter's state, by kind. Expert parallelism carves
/// the expert ranks out of the data-parallel ones: a dense weight is replicated over all `dp`
/// of them, an expert's over the `dp / ep` that hold the same experts, and ZeRO shards each
/// over the ranks that replicate it (Megatron-LM's data-parallel and expert-data-parallel
/// groups; autopar's CPU runtime shards dense state over its mesh's `dp` and `ep` axes and
/// expert state over `dp`, the same groups).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZeroShards {
    /// Ranks sharing a dense parameter's state.
    pub dense: f64,
    /// Ranks sharing an expert parameter's state.
    pub expert: f64,
}

impl ZeroShards {
    /// The shards of `plan`: dense state over every data-parallel rank, expert state over
    /// the ranks holding the same expert shards (`dp x (tp / etp) / ep`: `dp / ep` without
    /// expert tensor parallelism below `tp`, [`Plan::ep_over_tp`]); both times `cp` where the
    /// stack shards over the context-parallel ranks too (`over_cp`,
    /// [`crate::Software::zero_over_cp`]).
    pub fn new(plan: &Plan, over_cp: bool) -> Self {
        let cp = if over_cp { plan.cp.max(1) } else { 1 };
        ZeroShards {
            dense: (plan.dp.max(1) * cp) as f64,
            expert: ((plan.dp * (plan.tp / plan.expert_tp()) / plan.ep.max(1)) * cp).max(1) as f64,
        }
    }

    /// Bytes of `dense` and `expert` parameters at `bytes` each, divided by their shards when
    /// the plan's ZeRO stage reaches `from` (1 optimizer state, 2 gradients, 3 weights).
    pub fn bytes(&self, plan: &Plan, from: u8, dense: f64, expert: f64, bytes: f64) -> f64 {
        if plan.zero_stage >= from {
            (dense / self.dense + expert / self.expert) * bytes
        } else {
            (dense + expert) * bytes
        }
    }
}

/// Parameters of one layer whose optimizer state one rank holds, before any ZeRO division:
/// [`layer_params_per_rank`] with the weights replicated over `tp` counted at their `1/tp`
/// shard, which makes it the same for every layer placement.
pub fn optimizer_params_per_layer(cfg: &TransformerConfig, plan: &Plan) -> f64 {
    let t = plan.tp.max(1) as f64;
    layer_params_per_rank(cfg, plan) - tp_replicated_params_per_layer(cfg, plan) * (1.0 - 1.0 / t)
}

/// A layer's matmuls in the order its forward runs them, as torchtitan's Llama writes them
/// (`wq`, `wk`, `wv`, `wo`, then `w1`, `w3` when gated, `w2`; a MoE layer's router, and its
/// shared expert's): per token, (multiply-adds, output elements, whether the output is split
/// over `tp`). A MoE layer's routed experts run as grouped GEMMs, not matmuls, and are
/// counted by [`op_policy_recomputed_gemm_share`] apart.
fn op_policy_matmuls(cfg: &TransformerConfig) -> Vec<(f64, f64, bool)> {
    let h = cfg.hidden as f64;
    let q = cfg.attention_width();
    let kv = (cfg.kv_heads * cfg.head_dim()) as f64;
    let mut mms = vec![
        (q * h, q, true),
        (kv * h, kv, true),
        (kv * h, kv, true),
        (h * q, h, false),
    ];
    let mlp = |f: f64, mms: &mut Vec<(f64, f64, bool)>| {
        mms.push((f * h, f, true));
        if cfg.gated_mlp {
            mms.push((f * h, f, true));
        }
        mms.push((h * f, h, false));
    };
    if cfg.experts > 1 {
        mms.push((h * cfg.experts as f64, cfg.experts as f64, false));
        if cfg.shared_ffn > 0 {
            mlp(cfg.shared_ffn as f64, &mut mms);
        }
    } else {
        mlp(cfg.ffn as f64, &mut mms);
    }
    mms
}

/// The share of a layer's forward GEMM work that torchtitan's per-op selective
/// recomputation repeats in the backward (`activation_checkpoint.selective_ac_option =
/// "op"`; the policy of its Llama `parallelize.py` from 2024, since moved to
/// `torchtitan/distributed/activation_checkpoint.py`, where a model may now name the
/// tensors to save instead): it saves the output of every
/// other `aten.mm` (the first, third, ...) and the attention kernel's, so the second,
/// fourth, ... matmuls run again, and so do a MoE layer's routed experts, whose grouped GEMMs
/// the policy does not save. For a Llama layer: `wk`, `wo` and `w3`, about 37% of its
/// matmul work at Llama 3 8B's sizes.
pub fn op_policy_recomputed_gemm_share(cfg: &TransformerConfig) -> f64 {
    let mms = op_policy_matmuls(cfg);
    let experts = match cfg.experts > 1 {
        true => {
            let gate = if cfg.gated_mlp { 3.0 } else { 2.0 };
            cfg.top_k as f64 * gate * (cfg.ffn * cfg.hidden) as f64
        }
        false => 0.0,
    };
    let all: f64 = mms.iter().map(|m| m.0).sum::<f64>() + experts;
    let again: f64 = mms.iter().skip(1).step_by(2).map(|m| m.0).sum::<f64>() + experts;
    if all > 0.0 { again / all } else { 0.0 }
}

/// Activation bytes stored per layer per micro-batch under torchtitan's per-op selective
/// recomputation ([`op_policy_recomputed_gemm_share`]), 16-bit: the layer's input, the
/// outputs of the first, third, ... matmuls (a row-parallel one's whole partial sum, a
/// column-parallel one's `1/tp` slice) and the attention kernel's output; everything else is
/// recomputed from them.
pub fn op_policy_activation_bytes_per_layer(cfg: &TransformerConfig, plan: &Plan) -> f64 {
    let t = plan.tp as f64;
    let sp = plan.sequence_parallel && plan.tp > 1;
    let tokens = (cfg.seq / plan.cp) as f64 * plan.micro_batch_size as f64;
    let input = if sp {
        cfg.hidden as f64 / t
    } else {
        cfg.hidden as f64
    };
    let attention_out = cfg.attention_width() / t;
    let saved: f64 = op_policy_matmuls(cfg)
        .iter()
        .step_by(2)
        .map(|&(_, out, split)| if split { out / t } else { out })
        .sum();
    2.0 * tokens * (input + attention_out + saved)
}

/// Activation bytes stored per layer per micro-batch, following Korthikanti et al. 2022
/// Sec. 4 (16-bit activations, one-byte dropout masks), generalised to grouped-query
/// attention, any MLP width, gated MLPs and a head dim of the model's own (the attention's
/// tensors `a d / h` times as wide), and to training without dropout (`dropout` false,
/// [`crate::Software::dropout`]): no masks, `2sbh` less, and unfused attention keeps the
/// softmax output alone (2 bytes per score instead of 5).
///
/// With `s` tokens, micro-batch `b`, hidden `h`, `a` heads and tensor parallelism `t`, a GPT
/// layer without recompute stores `sbh (10 + 24/t + 5as/(ht))` bytes, or `sbh/t (34 + 5as/h)`
/// with sequence parallelism; selective recompute drops the `5as/h` attention-score term,
/// full recompute keeps only the layer input, `2sbh` (over `t` with sequence parallelism).
/// FlashAttention never stores the scores.
///
/// Under `dtype=fp8` each GEMM keeps for its weight gradient the fp8 copy of its input that
/// its forward cast, a byte per element, instead of the 16-bit tensor (Transformer Engine's
/// `Linear` and `LayerNormLinear` save the quantized input and drop its row-wise half,
/// `module/linear.py`): the QKV and MLP inputs take 1 byte instead of 2, the second MLP
/// GEMM's input `f/h` instead of `2f/h`, and the projection's fp8 input comes on top of the
/// attention output the attention backward keeps in 16 bits (3 instead of 2). The first MLP
/// GEMM's output stays 16-bit: the activation function keeps it.
pub fn activation_bytes_per_layer(
    cfg: &TransformerConfig,
    plan: &Plan,
    recompute: Recompute,
    attention: AttentionKernel,
    dropout: bool,
) -> f64 {
    let t = plan.tp as f64;
    let sp = plan.sequence_parallel && plan.tp > 1;
    let sbh = (cfg.seq / plan.cp) as f64 * plan.micro_batch_size as f64 * cfg.hidden as f64;
    let rep = if sp { sbh / t } else { sbh };
    if recompute == Recompute::Full {
        return 2.0 * rep;
    }
    let h = cfg.hidden as f64;
    let kv_frac = cfg.kv_heads as f64 / cfg.heads as f64;
    let f_frac = cfg.ffn as f64 / h;
    let gate = if cfg.gated_mlp { 2.0 } else { 1.0 };
    let seq = |op| plan.tp > 1 && plan.layer.get(op) == OpPlacement::Sequence;
    // The input a GEMM keeps: the stream's layout, or its sequence shard when the op runs on
    // sequence shards.
    let gemm_input = |op| if seq(op) { sbh / t } else { rep };
    // Bytes per element of a GEMM input kept for the weight gradient (and nothing else).
    let kept = if plan.fp8 { 1.0 } else { 2.0 };
    // Replicated (or sequence-sharded) terms: layer-norm inputs 4, QKV input 2, attention
    // dropout-add mask 1, MLP input 2, MLP dropout mask 1.
    let masks = if dropout { 2.0 } else { 0.0 };
    let replicated =
        (4.0 + masks) * rep + kept * (gemm_input(LayerOp::Qkv) + gemm_input(LayerOp::MlpIn));
    // Tensor-sharded terms (split by heads or by queries alike): Q 2, K and V 2 each (scaled
    // by kv/a; whole when the core gathers them for its local queries), projection input 2,
    // MLP activation input 2f/h per gate and its output 2f/h; experts see top_k copies, and a
    // shared expert keeps its own.
    let moe = if cfg.experts > 1 {
        cfg.top_k as f64
    } else {
        1.0
    };
    let shared = cfg.shared_ffn as f64 / h;
    let mlp = moe * (2.0 * f_frac * gate + kept * f_frac) + 2.0 * shared * gate + kept * shared;
    let kv = if seq(LayerOp::Attention) { t } else { 1.0 };
    let projection = if plan.fp8 { 3.0 } else { 2.0 };
    // Q, K, V and the attention output are `a d` (and `kv d`) wide rather than `h`.
    let attention_width = cfg.query_width_ratio();
    let sharded = ((2.0 + 4.0 * kv_frac * kv + projection) * attention_width + mlp) * sbh / t;
    let scores = match (recompute, attention) {
        (Recompute::None, AttentionKernel::Unfused) => {
            // softmax output 2, dropout mask 1, dropout output 2 bytes per score.
            let per_score = if dropout { 5.0 } else { 2.0 };
            per_score * cfg.heads as f64 * (cfg.seq / plan.cp) as f64 * cfg.seq as f64
                / plan.cp as f64
                * plan.micro_batch_size as f64
                / t
        }
        _ => 0.0,
    };
    replicated + sharded + scores
}

/// Activation bytes per layer per micro-batch that autopar's own training step keeps from
/// the forward for the backward, read off its VJP rules (the CPU runtime's counterpart of
/// [`activation_bytes_per_layer`]), with `e` bytes per element of the compute dtype.
///
/// In `[s, b, h]` units: the inputs and outputs of both norms, 4 (over `t` with sequence
/// parallelism); over `t`: q, k and v (`1 + 2 kv/a`), the attention output 1 (both times
/// `a d / h` where the head dim is the model's own), and the MLP's
/// `f`-wide tensors, `2f/h` for GELU (its input and output) or `4f/h` for SwiGLU (gate, up,
/// `silu(gate)` and their product), times `top_k` for experts; the attention probabilities,
/// one element per score over the whole key sequence (`as/(ht)`), unless selective recompute
/// drops them or context parallelism's fused attention backward never stores them. No
/// dropout masks. Full recompute keeps only the layer input.
pub fn runtime_activation_bytes_per_layer(
    cfg: &TransformerConfig,
    plan: &Plan,
    recompute: Recompute,
    e: f64,
) -> f64 {
    let t = plan.tp as f64;
    let sp = plan.sequence_parallel && plan.tp > 1;
    let s = (cfg.seq / plan.cp) as f64;
    let sbh = s * plan.micro_batch_size as f64 * cfg.hidden as f64;
    let rep = if sp { sbh / t } else { sbh };
    if recompute == Recompute::Full {
        return rep * e;
    }
    let h = cfg.hidden as f64;
    let kv_frac = cfg.kv_heads as f64 / cfg.heads as f64;
    let f_frac = cfg.ffn as f64 / h;
    let per_width = if cfg.gated_mlp { 4.0 } else { 2.0 };
    let moe = if cfg.experts > 1 {
        cfg.top_k as f64
    } else {
        1.0
    };
    // The experts' tensors (top_k copies) and the shared expert's.
    let mlp = per_width * (moe * f_frac + cfg.shared_ffn as f64 / h);
    // Keys and values are whole when the core gathers them for its local queries.
    let kv = if plan.tp > 1 && plan.layer.attention == OpPlacement::Sequence {
        t
    } else {
        1.0
    };
    let attention = (1.0 + 2.0 * kv_frac * kv + 1.0) * cfg.query_width_ratio() * sbh / t;
    let scores = cfg.heads as f64 * cfg.seq as f64 / (h * t) * sbh;
    // Under context parallelism attention differentiates through the fused ring backward,
    // which keeps no probabilities.
    let scores = if recompute == Recompute::None && plan.cp == 1 {
        scores
    } else {
        0.0
    };
    (4.0 * rep + attention + mlp * sbh / t + scores) * e
}

/// Of [`runtime_activation_bytes_per_layer`] without recompute, the bytes that do not belong
/// to the MLP (norms, q/k/v, attention output and probabilities): what a recomputed layer
/// still holds while the backward of its MLP runs.
pub fn runtime_attention_bytes_per_layer(cfg: &TransformerConfig, plan: &Plan, e: f64) -> f64 {
    let no_mlp = TransformerConfig {
        ffn: 0,
        shared_ffn: 0,
        ..cfg.clone()
    };
    runtime_activation_bytes_per_layer(&no_mlp, plan, Recompute::None, e)
}

/// The most `f`-wide tensors alive at once in autopar's backward of the MLP activation. GELU
/// differentiates through one op, `gelu_grad`: the incoming gradient, the saved input, its
/// derivative and their product, 4. SwiGLU's SiLU is decomposed (its product rule and sigmoid
/// derivative build `sigmoid`, `1 - sigmoid` and their products beside the gradient and the
/// saved gate and up projections), about 6.
pub fn runtime_mlp_backward_temporaries(cfg: &TransformerConfig) -> f64 {
    if cfg.gated_mlp { 6.0 } else { 4.0 }
}

/// Bytes per logit alive in autopar's cross-entropy backward besides the logits themselves:
/// the one-hot of the targets is built from two `i32` index tensors and a `bool` comparison.
pub const RUNTIME_CROSS_ENTROPY_BYTES_PER_LOGIT: f64 = 9.0;

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(tp: usize, sp: bool) -> Plan {
        Plan {
            tp,
            sequence_parallel: sp,
            micro_batch_size: 4,
            ..Plan::default()
        }
    }

    /// torchtitan's per-op policy on a Llama 3 8B layer (h 4096, 32 heads, 8 key/value
    /// heads, SwiGLU 14336): `wk`, `wo` and `w3` run again, 79.7M of 218.1M multiply-adds
    /// per token; the layer keeps its input, `wq`'s, `wv`'s, `w1`'s and `w2`'s outputs and
    /// the attention output, over `tp` where split.
    #[test]
    fn torchtitan_op_policy() {
        let mut cfg = TransformerConfig::gpt("8b", 32, 4096, 32, 8192, 128256);
        cfg.kv_heads = 8;
        cfg.ffn = 14336;
        cfg.gated_mlp = true;
        let (h, kv, f) = (4096.0, 1024.0, 14336.0);
        let again = h * kv + h * h + h * f;
        let all = 2.0 * h * h + 2.0 * h * kv + 3.0 * h * f;
        let share = op_policy_recomputed_gemm_share(&cfg);
        assert!((share - again / all).abs() < 1e-12, "{share}");
        assert!((0.36..0.37).contains(&share), "{share}");
        let tokens = 8192.0 * 4.0;
        let close = |x: f64, y: f64| assert!((x - y).abs() < 1e-6 * y, "{x} vs {y}");
        // input h, q h, v kv, w1 f, w2 h, attention output h; 2 bytes each.
        close(
            op_policy_activation_bytes_per_layer(&cfg, &plan(1, false)),
            2.0 * tokens * (4.0 * h + kv + f),
        );
        // Over tp = 8 with sequence parallelism: the input's and the column-parallel
        // outputs' slices, the row-parallel w2's whole partial sum.
        close(
            op_policy_activation_bytes_per_layer(&cfg, &plan(8, true)),
            2.0 * tokens * (h / 8.0 + (h + kv + f + h) / 8.0 + h),
        );
    }

    /// Korthikanti et al. 2022, Table 2, for the 22B model (s=2048, b=4, h=6144, a=64).
    #[test]
    fn matches_the_paper_formulas() {
        let cfg = TransformerConfig::gpt("22b", 48, 6144, 64, 2048, 51200);
        let (s, b, h, a) = (2048.0, 4.0, 6144.0, 64.0);
        let sbh = s * b * h;
        let u = AttentionKernel::Unfused;
        let close = |x: f64, y: f64| assert!((x - y).abs() < 1e-6 * y, "{x} vs {y}");
        close(
            activation_bytes_per_layer(&cfg, &plan(1, false), Recompute::None, u, true),
            sbh * (34.0 + 5.0 * a * s / h),
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, false), Recompute::None, u, true),
            sbh * (10.0 + 24.0 / 8.0 + 5.0 * a * s / (h * 8.0)),
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, true), Recompute::None, u, true),
            sbh / 8.0 * (34.0 + 5.0 * a * s / h),
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, true), Recompute::Selective, u, true),
            sbh / 8.0 * 34.0,
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, false), Recompute::Selective, u, true),
            sbh * (10.0 + 24.0 / 8.0),
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, false), Recompute::Full, u, true),
            2.0 * sbh,
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, true), Recompute::Full, u, true),
            2.0 * sbh / 8.0,
        );
        // Flash attention stores no scores.
        close(
            activation_bytes_per_layer(
                &cfg,
                &plan(8, true),
                Recompute::None,
                AttentionKernel::Flash,
                true,
            ),
            sbh / 8.0 * 34.0,
        );
        // Without dropout: no masks (34 - 2), and unfused attention keeps its softmax output
        // alone (2 bytes per score instead of 5).
        close(
            activation_bytes_per_layer(
                &cfg,
                &plan(8, true),
                Recompute::None,
                AttentionKernel::Flash,
                false,
            ),
            sbh / 8.0 * 32.0,
        );
        close(
            activation_bytes_per_layer(&cfg, &plan(8, true), Recompute::None, u, false)
                - activation_bytes_per_layer(&cfg, &plan(8, true), Recompute::Selective, u, false),
            2.0 * a * s * s * b / 8.0,
        );
        // fp8: the QKV and MLP inputs (1 + 1 instead of 2 + 2) and the second MLP GEMM's
        // input (4 instead of 8) kept a byte each, the projection's fp8 input on top of the
        // attention output (3 instead of 2): 34 - 2 - 4 + 1 = 29.
        let fp8 = Plan {
            fp8: true,
            ..plan(8, true)
        };
        close(
            activation_bytes_per_layer(&cfg, &fp8, Recompute::None, AttentionKernel::Flash, true),
            sbh / 8.0 * 29.0,
        );
        close(
            activation_bytes_per_layer(&cfg, &fp8, Recompute::Full, AttentionKernel::Flash, true),
            2.0 * sbh / 8.0,
        );
    }
}
