//! Software profiles: what the training stack a measurement (or a plan) runs on does, as
//! far as the step time depends on it. The same hardware and plan run at different speeds
//! under Megatron-LM of 2021, Megatron-Core, DeepSpeed or PyTorch FSDP, because they differ in
//! their attention kernel, in which communication they overlap with computation, and in how
//! ZeRO-3 / FSDP gather the sharded weights.
//!
//! A profile is named (`--software megatron-core`, or `[software] name = "..."` in a cluster
//! file) and any knob can be overridden (`--software deepspeed,overlap_param_gather=true`).
//! [`Software::apply`] writes it into a [`CostModel`]'s compute and communication
//! parameters; everything else in the model is hardware.

use serde::{Deserialize, Serialize};

use crate::compute::AttentionKernel;
use crate::error::CostError;
use crate::estimate::CostModel;

/// How ZeRO-3 / FSDP gather a layer's sharded weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatherUnit {
    /// One collective per layer (FSDP's flat parameter of a wrapped block, Megatron's
    /// distributed-optimizer buckets): one latency per layer and direction.
    Layer,
    /// One collective per weight tensor (DeepSpeed ZeRO-3 gathers parameter by parameter
    /// from its module hooks): a ring latency per tensor, which grows with the number of
    /// ranks and dominates small tensors (biases, norm scales). Each gather is DeepSpeed's
    /// `_allgather_param` of 2021 (`partition_parameters.py`): it allocates the full tensor
    /// with `torch.zeros` and passes `torch.distributed.all_gather` a list of one view per
    /// rank, which PyTorch's NCCL process group gathers into a flat buffer of its own and
    /// copies back view by view, one copy kernel per rank
    /// (`ProcessGroupNCCL::allgather`). So a gather also writes the tensor three times
    /// over HBM and pays one kernel's fixed time per rank, a cost that grows with the
    /// data-parallel size as the ring latency does. A module's weights are released after
    /// its forward, so a recomputed forward gathers them again before the backward's own
    /// gathers ([`GatherUnit::regathers_for_recompute`]).
    Tensor,
}

impl GatherUnit {
    /// Whether a layer's recomputed forward (full activation recomputation) gathers its
    /// weights once more, besides its backward's gather. Per module (DeepSpeed ZeRO-3): yes,
    /// the recomputed forward runs the modules' pre-forward hooks, which fetch the weights,
    /// and their post-forward hooks release them before the backward's hooks fetch them
    /// again. Per layer (PyTorch FSDP with the checkpoint wrapper inside the wrapped block):
    /// no, the block's pre-backward hook unshards its flat parameter, the recomputed forward
    /// runs inside that backward on the unsharded weights, and the block is resharded only
    /// after its backward.
    pub fn regathers_for_recompute(self) -> bool {
        match self {
            GatherUnit::Layer => false,
            GatherUnit::Tensor => true,
        }
    }
}

/// How far a stack fuses the element-wise work around its GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fusion {
    /// Fused kernels: layer norm, bias-GeLU, bias-dropout-residual-add each one kernel, and
    /// attention's inputs taken in the GEMM's layout (Megatron-LM, Megatron-Core, this
    /// project's fusion pass).
    Fused,
    /// PyTorch eager mode: every element-wise op its own kernel, with the layout copies a
    /// model's Python code implies (the Q/K/V split made contiguous for the attention kernel
    /// and its output copied back, the residual adds, the casts of autocast): see
    /// [`crate::compute::ComputeParams::eager_passes`].
    Eager,
}

/// The optimizer step of CPU offload ([`crate::plan::Offload`]): memory-bound over the host
/// DRAM, at a fraction of its bandwidth that depends on the implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuOptimizer {
    /// DeepSpeed's `DeepSpeedCPUAdam` (SIMD, multi-threaded, fused over the parameter,
    /// gradient and both moments, writing the 16-bit copy in the same pass): Ren et al.,
    /// "ZeRO-Offload", USENIX ATC 2021, Sec. 5 and Table 2, where it is 5.1-6.4x faster
    /// than PyTorch's CPU Adam. Priced at [`CPU_ADAM_BANDWIDTH_FRACTION`] of the host's
    /// DRAM bandwidth.
    CpuAdam,
    /// PyTorch's `torch.optim.AdamW` on CPU tensors (FSDP's CPU offload): priced
    /// [`TORCH_CPU_ADAM_SLOWDOWN`] times slower than CPU-Adam, the smallest gap the
    /// ZeRO-Offload paper measured.
    Torch,
}

/// Bytes a CPU Adam step moves per parameter: reads the fp32 weight, gradient and two
/// moments (16), writes the weight and moments back (12) and the 16-bit copy the GPU gets
/// (2).
pub const CPU_ADAM_BYTES_PER_PARAM: f64 = 30.0;

/// The share of the host's peak DRAM bandwidth a fused CPU Adam step reaches: ZeRO-Offload's
/// Table 2 updates 1B parameters in about 0.22 s on a DGX-2's two Xeon Platinum 8168
/// sockets (12 DDR4-2666 channels, 256 GB/s peak), 30 bytes each: about 136 GB/s, 0.53 of
/// the peak, rounded to 0.5.
pub const CPU_ADAM_BANDWIDTH_FRACTION: f64 = 0.5;

/// How many times slower PyTorch's CPU Adam is than DeepSpeed's CPU-Adam (ZeRO-Offload,
/// Table 2: 5.1x to 6.4x; the smaller is taken).
pub const TORCH_CPU_ADAM_SLOWDOWN: f64 = 5.1;

impl CpuOptimizer {
    /// Seconds to update `params` parameters with `bandwidth` bytes/s of host DRAM.
    pub fn step_time(self, params: f64, bandwidth: f64) -> f64 {
        let fused = params * CPU_ADAM_BYTES_PER_PARAM / (bandwidth * CPU_ADAM_BANDWIDTH_FRACTION);
        match self {
            CpuOptimizer::CpuAdam => fused,
            CpuOptimizer::Torch => fused * TORCH_CPU_ADAM_SLOWDOWN,
        }
    }
}

/// Bytes a 16-bit gradient's accumulation into its fp32 copy moves per parameter, as
/// DeepSpeed's `BF16_Optimizer.update_hp_grads` does it (`hp_grad.add_(lp.grad.to(fp32))`,
/// `deepspeed/runtime/bf16_optimizer.py`, v0.6-0.7): the cast reads the bf16 gradient and
/// writes an fp32 temporary (2 + 4), the add reads both fp32 tensors and writes the sum
/// (4 + 4 + 4): 18.
pub const FP32_GRAD_ACCUMULATION_BYTES: f64 = 18.0;

fn cpu_adam() -> CpuOptimizer {
    CpuOptimizer::CpuAdam
}

/// How the loss (softmax cross-entropy over the vocabulary) is computed. Its kernels are
/// memory-bound passes over the logits, a tensor of tokens x vocabulary (x 1/tp) elements
/// that for a small model with a large vocabulary moves more bytes than a whole layer, so
/// the implementation decides a visible share of such a model's step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKernel {
    /// A fused kernel (this project's runtime, NeMo's `cross_entropy_loss_fusion`): the
    /// forward reads the logits once for the row maximum and sum, once more to write fp32
    /// probabilities; the backward reads those and writes the logits' gradient.
    Fused,
    /// Megatron-LM's vocab-parallel cross-entropy (`_VocabParallelCrossEntropy`, the path
    /// when `cross_entropy_loss_fusion` is off, its default): the logits are cast to fp32
    /// (`.float()`), then the maximum, the in-place subtraction, the in-place `exp`, the sum
    /// and the in-place division into probabilities are each a pass; the backward multiplies
    /// the saved probabilities by the incoming gradient in place and casts the result back.
    Megatron,
    /// PyTorch eager `F.cross_entropy` on logits cast to fp32 (autocast, or torchtitan's
    /// explicit `.float()`): the cast, then `log_softmax` (a maximum pass, a sum pass and a
    /// read-write pass); the backward zero-fills the NLL gradient, runs `log_softmax`'s
    /// backward (a sum pass and a read-read-write pass) and casts back.
    Torch,
}

impl LossKernel {
    /// Bytes the loss moves per logit in the forward and in the backward, with logits of
    /// `e` bytes (the GEMMs that produce and consume them are priced separately).
    pub fn bytes_per_logit(self, e: f64) -> (f64, f64) {
        match self {
            // Read twice, write fp32 probabilities; read them, write the gradient.
            LossKernel::Fused => (2.0 * e + 4.0, 4.0 + e),
            // Cast (e + 4), max (4), subtract (8), exp (8), sum (4), divide (8); multiply
            // (8), cast back (4 + e).
            LossKernel::Megatron => (e + 36.0, 12.0 + e),
            // Cast (e + 4), log_softmax (4 + 4 + 8); zero-fill (4), log_softmax backward
            // (4 + 12), cast back (4 + e).
            LossKernel::Torch => (e + 20.0, 24.0 + e),
        }
    }
}

fn fused_loss() -> LossKernel {
    LossKernel::Fused
}

/// How Transformer Engine scales the fp8 tensors of a `dtype=fp8` plan (Megatron-Core's
/// `--fp8-recipe`). The casts move the same bytes either way
/// ([`crate::compute::ComputeParams::fp8_cast_bytes_per_element`]); the GEMMs differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Recipe {
    /// One scale per tensor (TE's `DelayedScaling`, its default, or per-tensor current
    /// scaling): the scales are applied once in the GEMM's epilogue, which runs at the
    /// device's fp8 rate.
    #[default]
    Tensor,
    /// DeepSeek-V3-style block scaling (TE's `Float8BlockScaling`: 1x128 tiles of the
    /// activations and gradients, 128x128 blocks of the weights). The scales vary along the
    /// contraction, so each 128-deep slice of the accumulation is scaled and added on the
    /// CUDA cores inside the GEMM's main loop; on Hopper that costs a share of the fp8 rate
    /// ([`crate::compute::ComputeParams::blockwise_fp8_fraction`]), on Blackwell the tensor
    /// cores take block scales themselves.
    Blockwise,
}

fn tensor_recipe() -> Fp8Recipe {
    Fp8Recipe::Tensor
}

/// How context-parallel attention combines what each rank holds of the keys and values,
/// priced over the rank's queries (and, for the gradients of grouped keys and values, their
/// own width) by [`CpAttention::bytes_per_step`] per step of its ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpAttention {
    /// A ring of `cp` steps, each an attention call over the keys and values the rank holds
    /// at that step, merged by fused kernels: Transformer Engine's `AttnFuncWithCPAndKVP2P`
    /// (Megatron-Core, NeMo; this project's ring attention is priced alike). Each
    /// step's output is folded into the running one by a correction kernel
    /// (`flash_attn_fwd_out_correction`: read the step's 16-bit output, read and write the
    /// running one, 6 B per element); the backward adds each step's query gradient into the
    /// running one (6 B) and each step's key and value gradients into those passed around
    /// the ring (6 B each, at their own width).
    #[default]
    Ring,
    /// The same ring in PyTorch's experimental `context_parallel` (torchtitan;
    /// `torch/distributed/tensor/experimental/_attention.py`), with torchtitan's default
    /// rotate method `allgather` (`--experimental.context_parallel_rotate_method`): the
    /// query-wide keys and values all-gathered once, under the first step's attention only,
    /// gathered again in the backward, where the fp32 key and value gradients go around the
    /// ring a step at a time. Merged by eager ops: per step the keys and values, query-wide
    /// after `repeat_kv`, are concatenated for the exchange (8 B per query element; every
    /// step, though only the first one's is gathered), the step's output is cast to fp32
    /// (6 B) and merged by fp32 element-wise ops (about 32 B), half the steps copying the
    /// running output through `chunk` and `cat` (4 B on average): 50 B. The backward
    /// concatenates the keys and
    /// values again (8 B), accumulates the query, key and value gradients in fp32 (10 B
    /// each) and concatenates the fp32 key and value gradients to pass them on (16 B), with
    /// partial-update copies (about 8 B): 62 B.
    EagerRing,
    /// The keys and values all-gathered first and one attention call per query chunk over
    /// all of them, nothing to merge (Llama 3's context parallelism: Dubey et al. 2024,
    /// Sec. 3.3.2).
    AllGather,
}

impl CpAttention {
    /// Bytes per ring step, `[forward, backward]`, as `(per element of the rank's queries,
    /// per element of its keys)`.
    pub fn bytes_per_step(self) -> [(f64, f64); 2] {
        match self {
            CpAttention::Ring => [(6.0, 0.0), (6.0, 12.0)],
            CpAttention::EagerRing => [(50.0, 0.0), (62.0, 0.0)],
            CpAttention::AllGather => [(0.0, 0.0), (0.0, 0.0)],
        }
    }
}

/// What a plan's selective recomputation (`recompute=selective`) repeats in the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectiveRecompute {
    /// The attention core (Korthikanti et al. 2022, Megatron's `--recompute-granularity
    /// selective`): its softmax and dropout over the scores, which a fused attention kernel
    /// never stores, so there it recomputes nothing.
    Attention,
    /// torchtitan's per-op policy: the attention kernel's output and every other matmul's
    /// output saved, the other matmuls and every element-wise kernel run again
    /// ([`crate::memory::op_policy_recomputed_gemm_share`]).
    Op,
}

impl SelectiveRecompute {
    /// Whether it repeats any work beside the `attention` kernel: Megatron's only where the
    /// kernel stores the scores, torchtitan's always.
    pub fn does_work(self, attention: AttentionKernel) -> bool {
        match self {
            SelectiveRecompute::Attention => attention.materialises_scores(),
            SelectiveRecompute::Op => true,
        }
    }
}

fn attention_selective() -> SelectiveRecompute {
    SelectiveRecompute::Attention
}

/// A training stack's behaviour, as the cost model sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Software {
    /// The profile's name.
    pub name: String,
    /// The attention kernel.
    pub attention: AttentionKernel,
    /// Data-parallel gradient reduction runs bucket by bucket under the backward.
    pub overlap_grad_reduce: bool,
    /// Tensor-parallel collectives of the backward run under the weight-gradient GEMMs.
    pub tp_backward_overlap: bool,
    /// Sequence-parallel gathers and reduce-scatters are pipelined with their GEMMs chunk
    /// by chunk: the forward's, and the backward's gathers of a row-parallel GEMM's output
    /// gradient with its input-gradient GEMM (Megatron-Core `--tp-comm-overlap`).
    pub tp_forward_overlap: bool,
    /// ZeRO-3 / FSDP weight all-gathers are prefetched under the previous layer's compute;
    /// with ZeRO-1/2 (the distributed optimizer), the all-gather of the updated weights runs
    /// under the next step's forward, bucket by bucket (Megatron `--overlap-param-gather`).
    pub overlap_param_gather: bool,
    /// How the ZeRO-3 / FSDP gathers and reduce-scatters are cut into collectives.
    pub param_gather: GatherUnit,
    /// The data-parallel gradient all-reduces as buckets of this many MiB, filled in the
    /// order the backward produces the gradients, as autopar's `collectives` pass forms them
    /// (0: one all-reduce per tensor; [`crate::buckets`]); `None`: one bucket per layer (and
    /// one for the embedding), as Megatron-Core's distributed optimizer and FSDP's wrapped
    /// blocks cut them.
    #[serde(default)]
    pub bucket_mb: Option<f64>,
    /// How far element-wise work is fused.
    pub fusion: Fusion,
    /// Bytes per gradient element of the ZeRO-2/3 (FSDP) reduce-scatter that each
    /// micro-batch's backward issues: 2 where sharded gradients are reduced in bf16
    /// (DeepSpeed's default), 4 where in fp32 (PyTorch FSDP under Composer's `DEFAULT` mixed
    /// precision, `reduce_dtype=float32`). The ZeRO-0/1 all-reduce of accumulated gradients
    /// moves their buffer ([`Software::grad_buffer_bytes`]).
    pub reduce_bytes: f64,
    /// Bytes per element of the gradient buffer that ZeRO-0/1 accumulates over a step's
    /// micro-batches and then all-reduces (or reduce-scatters), where the stack keeps it in
    /// its reduce dtype: 4 under the Megatron profiles (fp32, as Megatron-LM forces under
    /// bf16: `accumulate_allreduce_grads_in_fp32`), 2 where the stack accumulates and
    /// reduces in bf16, as NeMo's H100 performance scripts for GPT-3 and
    /// Llama ask (`optim.grad_sync_dtype=bf16`, NeMo-Framework-Launcher
    /// `examples/training/{gpt,llama}/h100/*.sh`, June 2024; Megatron-Core's
    /// `grad_reduce_in_fp32=False`); `None` where the reduce dtype is only the collective's
    /// (the memory model's default buffer, [`crate::memory::MemoryParams::grad_bytes_per_param`]).
    /// Where it is set, `reduce_dtype` sets it with `reduce_bytes` (one switch in Megatron).
    #[serde(default)]
    pub grad_buffer_bytes: Option<f64>,
    /// Stage-to-stage transfers block both ends: the sender waits for its send to complete
    /// before its next micro-batch, and the receiver gathers a scattered activation itself
    /// before computing on it. Megatron-LM until Megatron-Core's `--overlap-p2p-comm` waits
    /// on every `batch_isend_irecv` and then calls `torch.cuda.synchronize()`
    /// (`p2p_communication.py`, "to protect against race condition"), so no transfer runs
    /// under computation; `false` where the transfers run on their own stream.
    #[serde(default)]
    pub p2p_blocking: bool,
    /// The stack's GEMMs leave SMs to the NCCL collectives they overlap (cuBLASLt's
    /// `CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`, set through PyTorch's
    /// `torch._C._set_sm_carveout_experimental` or Transformer Engine's
    /// `NVTE_EXT_MARGIN_SM`), so a persistent GEMM is not split into two waves
    /// ([`crate::comm::CommParams::persistent_gemm_slowdown`]). Off in every profile, as
    /// those settings are off by default. Transformer Engine's userbuffers, which pipeline
    /// the tensor-parallel collectives with their GEMMs (`tp_forward_overlap`), always
    /// size their GEMMs to the SMs the communication leaves, so they are priced without it.
    /// What a carve-out costs in turn (a GEMM on fewer SMs, every GEMM where PyTorch's
    /// global setting applies) is not priced.
    #[serde(default)]
    pub sm_carveout: bool,
    /// The optimizer step of a plan that offloads to the CPU: DeepSpeed's CPU-Adam
    /// (`deepspeed`, `autopar`, and `megatron-core`, whose `--optimizer-cpu-offload` runs a
    /// fused CPU Adam unless `--use-torch-optimizer-for-cpu-offload` is given), or PyTorch's
    /// (`fsdp`, `torchtitan`: FSDP's CPU offload steps `torch.optim` on the CPU shards).
    #[serde(default = "cpu_adam")]
    pub cpu_optimizer: CpuOptimizer,
    /// The loss kernels: fused (`autopar`, `nemo`), Megatron's fp32 vocab-parallel
    /// cross-entropy (`megatron-lm-*`, `megatron-core`, and `deepspeed`, whose measured
    /// GPTs are Megatron-DeepSpeed's) or PyTorch's eager one (`fsdp`, `torchtitan`).
    #[serde(default = "fused_loss")]
    pub loss: LossKernel,
    /// How a `dtype=fp8` plan's tensors are scaled: per tensor in every profile (TE's
    /// default), block-wise when asked (`fp8_recipe=blockwise`).
    #[serde(default = "tensor_recipe")]
    pub fp8_recipe: Fp8Recipe,
    /// Under `dtype=fp8`, the weights' fp8 copies are cast on a step's first micro-batch and
    /// reused by the others (Transformer Engine's `is_first_microbatch`, which Megatron-Core
    /// and NeMo pass to its modules); otherwise every micro-batch casts them again (TE
    /// modules called without it, as Composer's and plain PyTorch loops do).
    #[serde(default)]
    pub fp8_weight_cache: bool,
    /// ZeRO / FSDP shards the state of a parameter over the context-parallel ranks too, which
    /// hold the same parameters (Megatron-Core's data-parallel group "with context
    /// parallelism", torchtitan's FSDP mesh `dp_shard x cp`); otherwise over the
    /// data-parallel ranks alone, as autopar's compiler does (`zero_constraints`).
    #[serde(default)]
    pub zero_over_cp: bool,
    /// Under `dtype=fp8`, the layers' weights live in fp8 only (Megatron-Core's
    /// `--fp8-param-gather`, NeMo's `fp8_params`): the fp32 master copy in the optimizer is
    /// cast straight to fp8 after the step, no 16-bit copy is kept, and the distributed
    /// optimizer all-gathers a byte per parameter instead of two. Off by default; NeMo's
    /// 2024 H100 scripts set it only for Mixtral and Grok, Megatron-Bridge's fp8 precision
    /// configurations (`bf16_with_fp8_*_mixed`) for every model.
    #[serde(default)]
    pub fp8_params: bool,
    /// What selective recomputation repeats: the attention core (every profile but
    /// `torchtitan`) or, under `torchtitan`, its default per-op policy
    /// (`selective_ac_option = "op"`).
    #[serde(default = "attention_selective")]
    pub selective: SelectiveRecompute,
    /// How context-parallel attention combines the ranks' keys and values.
    #[serde(default)]
    pub cp_attention: CpAttention,
    /// Under pipeline parallelism, ZeRO-3 gathers a stage's weights once per step and holds
    /// them, and reduces its gradients once, after the last micro-batch, instead of
    /// gathering and reducing for every micro-batch: torchtitan's FSDP2 under PP
    /// (`reshard_after_forward=False` "to avoid per-microbatch all-gathers",
    /// `parallelize_llama.py`, and PyTorch's pipelining stage, which defers FSDP's reshard
    /// and gradient sync to the last backward). Its traffic and memory are ZeRO-1's, and so
    /// are ZeRO-2's (FSDP2 without resharding after the forward), whose gradient
    /// reduction the stage defers alike.
    #[serde(default)]
    pub pp_holds_gathered_weights: bool,
    /// Under bf16 with ZeRO-0/1, every micro-batch's backward is followed by a pass that
    /// adds the rank's bf16 gradients into fp32 copies
    /// ([`FP32_GRAD_ACCUMULATION_BYTES`] per parameter; until it runs, the backward's 16-bit
    /// gradients live beside the fp32 ones), and the fp32 copies are what the step reduces: DeepSpeed's `BF16_Optimizer`, which its pipeline engine calls after each
    /// backward (`update_hp_grads` in `_exec_backward_pass`, `deepspeed/runtime/pipe/engine.py`,
    /// v0.6-0.7; the optimizer Megatron-DeepSpeed's bf16 runs take with ZeRO stage 0, as
    /// BLOOM's did). Megatron's own distributed optimizer accumulates into its fp32 buffer
    /// inside the weight-gradient GEMM instead (`gradient_accumulation_fusion`), at no extra
    /// pass.
    #[serde(default)]
    pub fp32_grad_accumulation: bool,
    /// Full recomputation stops once it has rebuilt every tensor the backward saved, so a
    /// layer's last GEMM (the MLP's output projection, whose result only feeds the residual
    /// add) and what follows it are not run again: PyTorch's non-reentrant
    /// `torch.utils.checkpoint` from PyTorch 2.1 on (`set_checkpoint_early_stop`, on by
    /// default; pytorch/pytorch#96866), which FSDP's `checkpoint_wrapper` uses when
    /// `use_reentrant=False` (llm-foundry's yamls, torchtitan's full activation
    /// checkpointing). Megatron's, Transformer Engine's and DeepSpeed's checkpoint functions
    /// replay the whole forward. Dense layers only: an MoE layer's combine multiplies the
    /// experts' outputs by their routing weights, which saves those outputs.
    #[serde(default)]
    pub recompute_early_stop: bool,
    /// Each micro-batch's expert-parallel all-to-alls (dispatch and combine) run while another
    /// micro-batch's layer computes: Megatron-Core's `--overlap-moe-expert-parallel-comm`
    /// (Megatron-Bridge's `overlap_moe_expert_parallel_comm` / `moe_a2a_overlap`), which
    /// merges the forward of one micro-batch with the backward of another in the steady
    /// 1F1B phase, each all-to-all beside one sub-block of the other pass
    /// (`Ctx::overlap_expert_all_to_alls` in the estimate says which; the NCCL kernels push
    /// the persistent GEMMs beside them into second waves unless [`Software::sm_carveout`]),
    /// on the plans
    /// Megatron-Core runs it on ([`crate::Plan::overlaps_expert_all_to_alls`]: not with full
    /// recomputation, nor with pipeline stages but no virtual ones). Off in every profile:
    /// a Megatron-Core option of 2025, which benchmark recipes turn on per model.
    #[serde(default)]
    pub ep_comm_overlap: bool,
    /// Tensor-parallel collectives along the sequence copy the whole tensor to move the
    /// sequence dimension to the front and back: PyTorch's functional collectives gather and
    /// scatter along dimension 0 (`all_gather_tensor` ends in
    /// `torch.cat(torch.chunk(res, group_size, dim=0), dim=gather_dim)`,
    /// `reduce_scatter_tensor` starts with the same cat of its input), and DTensor's
    /// sequence parallelism (torchtitan's `SequenceParallel`, batch-first activations)
    /// shards dimension 1, so every all-gather writes its output twice and every
    /// reduce-scatter its input. Under torch's micro-pipelined (async) TP the fused kernels
    /// restride the local shard before the gather and sum the peers' partial products after
    /// the scatter (`torch/distributed/_symmetric_memory`). Megatron's activations are
    /// sequence-first: nothing to move.
    #[serde(default)]
    pub tp_relayout_copies: bool,
    /// Under fp8 training the tensor-parallel all-gathers move fp8: torchao's float8 tensor
    /// parallelism (torchtitan's float8 TP plan) casts a column-parallel layer's input to
    /// float8 before gathering it (`PrepareFloat8ModuleInput`, "so that ... we perform fp8
    /// allgather only once") and a row-parallel layer's output gradient before the backward's
    /// gather (`NoopFwToFloat8BwDynamic`); reduce-scatters stay in bf16.
    #[serde(default)]
    pub fp8_tp_gather: bool,
    /// With `tp_forward_overlap` (micro-pipelined TP), the backward's reduce-scatter of an
    /// input gradient is pipelined with the GEMMs that produce it. Not under torch's async
    /// TP on torchtitan's Llama: its pattern matcher fuses a reduce-scatter only with the one
    /// matmul that feeds it, and the input gradients of the separate q/k/v and w1/w3
    /// projections are summed first ("only valid scaled_mm-reduce-scatter patterns in the
    /// forward graph, but not in the backward graph": pytorch/pytorch#149946), so those
    /// reduce-scatters run as plain NCCL collectives beside the weight-gradient GEMMs.
    #[serde(default = "crate::comm::yes")]
    pub tp_pipelined_backward_reduce_scatter: bool,
    /// The model trains with dropout on the hidden states and the attention scores, which
    /// keeps a one-byte mask per element it drops from for the backward and writes it in the
    /// forward (Korthikanti et al. 2022 count the two hidden-state masks, and the scores'
    /// with unfused attention): Megatron-LM's and Megatron-Core's defaults
    /// (`hidden_dropout` and `attention_dropout` 0.1, `TransformerConfig`), so the
    /// `megatron-*` and `deepspeed` profiles (BLOOM's run kept them: "The default
    /// Megatron-LM dropout settings are inherited", bigscience `train/tr11-176B-ml/README.md`).
    /// Modern recipes train without it: NeMo's and
    /// Megatron-Bridge's Llama, Nemotron and Qwen configurations (0.0; NeMo-Framework-Launcher
    /// keeps 0.1 for GPT-3 only), llm-foundry's MPT (`resid_pdrop`, `attn_pdrop` 0.0), Meta's
    /// and torchtitan's Llama, and this project's own training step.
    #[serde(default)]
    pub dropout: bool,
}

/// What a training stack can run, along the dimensions the plan search explores
/// ([`Software::offers`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offers {
    /// ZeRO stages.
    pub zero: &'static [u8],
    /// Tensor parallelism.
    pub tensor_parallel: bool,
    /// Pipeline parallelism.
    pub pipeline: bool,
    /// Megatron-style sequence parallelism.
    pub sequence_parallel: bool,
    /// Selective recomputation ([`Software::selective`] says what it repeats).
    pub selective_recompute: bool,
    /// The interleaved pipeline schedule (virtual stages).
    pub interleaved: bool,
    /// Context parallelism.
    pub context_parallel: bool,
    /// Expert parallelism.
    pub expert_parallel: bool,
    /// Layer placements other than Megatron-LM's ([`crate::LayerPlacement`]).
    pub layer_placements: bool,
    /// Full recomputation of only some layers of each stage ([`crate::Plan::recompute_layers`]).
    pub partial_recompute: bool,
}

/// The names of the built-in profiles.
pub const PROFILES: [&str; 8] = [
    "autopar",
    "megatron-lm-2021",
    "megatron-lm-2022",
    "megatron-core",
    "nemo",
    "deepspeed",
    "fsdp",
    "torchtitan",
];

impl Default for Software {
    fn default() -> Self {
        Software {
            name: "autopar".into(),
            attention: AttentionKernel::Flash,
            overlap_grad_reduce: true,
            tp_backward_overlap: true,
            tp_forward_overlap: false,
            overlap_param_gather: true,
            param_gather: GatherUnit::Layer,
            bucket_mb: Some(DEFAULT_BUCKET_MB),
            fusion: Fusion::Fused,
            reduce_bytes: 2.0,
            p2p_blocking: false,
            sm_carveout: false,
            cpu_optimizer: CpuOptimizer::CpuAdam,
            loss: LossKernel::Fused,
            fp8_recipe: Fp8Recipe::Tensor,
            fp8_weight_cache: false,
            zero_over_cp: false,
            fp8_params: false,
            grad_buffer_bytes: None,
            selective: SelectiveRecompute::Attention,
            cp_attention: CpAttention::Ring,
            pp_holds_gathered_weights: false,
            fp32_grad_accumulation: false,
            recompute_early_stop: false,
            ep_comm_overlap: false,
            tp_relayout_copies: false,
            fp8_tp_gather: false,
            tp_pipelined_backward_reduce_scatter: true,
            dropout: false,
        }
    }
}

/// The bucket size of the `autopar` profile: PyTorch DDP's `bucket_cap_mb`, which the
/// compiler's `--bucket-mb` defaults to as well.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

impl Software {
    /// Whether a plan of `pp` pipeline stages holds each stage's gathered weights over the
    /// step ([`Software::pp_holds_gathered_weights`] under pipeline parallelism).
    pub fn holds_stage_weights(&self, pp: usize) -> bool {
        self.pp_holds_gathered_weights && pp > 1
    }

    /// A built-in profile by name:
    ///
    /// - `autopar` (the default): this project's GPU stack as designed: FlashAttention-style
    ///   attention, gradient reduction in 25 MiB buckets, tensor-parallel backward
    ///   collectives and ZeRO-3 gathers all overlapped, gathers one per layer.
    /// - `megatron-lm-2021`: Megatron-LM as measured in SC'21 (the code of its
    ///   `examples/sc21` scripts, August 2021): attention as two batched GEMMs around a fused
    ///   softmax, its "local" DDP reducing gradients after the backward, the tensor-parallel
    ///   all-reduce of the backward awaited where it is issued (`_CopyToModelParallelRegion`
    ///   reduces the input gradient synchronously; the asynchronous all-reduce under the
    ///   weight-gradient GEMM, `--async-tensor-model-parallel-allreduce`, came later), and
    ///   blocking stage-to-stage transfers.
    /// - `megatron-lm-2022`: Megatron-LM as measured in Korthikanti et al. 2022: the same,
    ///   with the asynchronous tensor-parallel all-reduce of the backward (and sequence
    ///   parallelism's all-gather and reduce-scatter under the weight-gradient GEMMs).
    /// - `megatron-core` and `nemo` (which builds on it): Transformer Engine's fused
    ///   attention (cuDNN, native to Hopper), `--overlap-grad-reduce` and
    ///   `--overlap-param-gather` of the distributed optimizer, bucketed per layer, and
    ///   `--tp-comm-overlap` (the flags of its README's weak-scaling runs). NeMo run through
    ///   NeMo-Framework-Launcher releases 24.03 to 24.07 is `nemo,attention=flash`: the
    ///   launcher's `conf/config.yaml` set `NVTE_FUSED_ATTN: 0` from February to August 2024
    ///   (562dcb45 to 04b8d098), so Transformer Engine ran the flash-attn package's
    ///   FlashAttention 2 rather than cuDNN.
    /// - `deepspeed`: Megatron-DeepSpeed: DeepSpeed ZeRO-3 as in SC'21 Table 2 (unfused
    ///   attention, the gradient reduction not overlapped, as `overlap_comm` defaults to
    ///   false in DeepSpeed's ZeRO configuration of the time, and weights gathered parameter
    ///   by parameter from module hooks, each gather awaited before its module runs), and
    ///   DeepSpeed's pipeline engine with its synchronous stage-to-stage transfers and, under
    ///   bf16, its fp32 gradient accumulation after every micro-batch
    ///   ([`Software::fp32_grad_accumulation`]); the tensor-parallel all-reduce of the
    ///   backward awaited where it is issued.
    /// - `fsdp` and `torchtitan`: PyTorch FSDP (1 and 2): scaled-dot-product attention
    ///   (FlashAttention 2), one all-gather per wrapped block prefetched under the previous
    ///   block (`forward_prefetch`, `backward_prefetch`), reduce-scatter overlapped, PyTorch
    ///   eager element-wise kernels (for a Llama-style layer its fp32 RMSNorm, rotary,
    ///   `repeat_kv` and gate chains, [`crate::compute::EagerChain`]), gradients reduced in
    ///   fp32 (Composer's and llm-foundry's `DEFAULT` mixed precision has
    ///   `reduce_dtype=float32`; torchtitan's `mixed_precision_reduce` defaults to
    ///   `float32`); under `torchtitan`, selective
    ///   recomputation is its per-op policy ([`SelectiveRecompute::Op`]) and context
    ///   parallelism PyTorch's ring attention ([`CpAttention::EagerRing`]), and under
    ///   pipeline parallelism FSDP holds a stage's gathered weights over the step
    ///   ([`Software::pp_holds_gathered_weights`]); full recomputation stops early, as
    ///   PyTorch's non-reentrant checkpoint does ([`Software::recompute_early_stop`]);
    ///   sequence-parallel collectives copy their tensors to move the sequence dimension
    ///   ([`Software::tp_relayout_copies`]), and fp8 training gathers in fp8
    ///   ([`Software::fp8_tp_gather`]).
    pub fn preset(name: &str) -> Result<Software, CostError> {
        let base = Software::default();
        // The other stacks bucket their gradients by layer.
        let by_layer = Software {
            bucket_mb: None,
            ..base.clone()
        };
        // Megatron's loss unless `cross_entropy_loss_fusion` is set (NeMo's configurations
        // set it; Megatron-LM's default is off).
        let megatron = Software {
            loss: LossKernel::Megatron,
            grad_buffer_bytes: Some(4.0),
            dropout: true,
            ..by_layer.clone()
        };
        let s = match name {
            "autopar" => base,
            "megatron-core" => Software {
                attention: AttentionKernel::Fused,
                tp_forward_overlap: true,
                fp8_weight_cache: true,
                zero_over_cp: true,
                ..megatron
            },
            "nemo" => Software {
                attention: AttentionKernel::Fused,
                tp_forward_overlap: true,
                fp8_weight_cache: true,
                zero_over_cp: true,
                grad_buffer_bytes: Some(2.0),
                ..by_layer
            },
            "fsdp" | "torchtitan" => Software {
                fusion: Fusion::Eager,
                reduce_bytes: 4.0,
                cpu_optimizer: CpuOptimizer::Torch,
                loss: LossKernel::Torch,
                selective: match name {
                    "torchtitan" => SelectiveRecompute::Op,
                    _ => SelectiveRecompute::Attention,
                },
                zero_over_cp: name == "torchtitan",
                cp_attention: match name {
                    "torchtitan" => CpAttention::EagerRing,
                    _ => CpAttention::Ring,
                },
                pp_holds_gathered_weights: name == "torchtitan",
                recompute_early_stop: true,
                tp_relayout_copies: true,
                fp8_tp_gather: true,
                tp_pipelined_backward_reduce_scatter: false,
                ..by_layer
            },
            "megatron-lm-2021" => Software {
                attention: AttentionKernel::Unfused,
                overlap_grad_reduce: false,
                tp_backward_overlap: false,
                p2p_blocking: true,
                ..megatron
            },
            "megatron-lm-2022" => Software {
                attention: AttentionKernel::Unfused,
                overlap_grad_reduce: false,
                p2p_blocking: true,
                ..megatron
            },
            "deepspeed" => Software {
                attention: AttentionKernel::Unfused,
                overlap_grad_reduce: false,
                overlap_param_gather: false,
                param_gather: GatherUnit::Tensor,
                // Its pipeline engine's sends and receives are synchronous
                // (`deepspeed/runtime/pipe/p2p.py` refuses `async_op`), and Megatron-DeepSpeed's
                // column-parallel layers all-reduce their input gradient where the backward
                // reaches them (`copy_to_tensor_model_parallel_region` in
                // `megatron/mpu/layers.py` of the BigScience fork), without the later
                // asynchronous all-reduce under the weight-gradient GEMM.
                p2p_blocking: true,
                tp_backward_overlap: false,
                fp32_grad_accumulation: true,
                // Its bf16 optimizer keeps fp32 gradients whatever it reduces in.
                grad_buffer_bytes: None,
                ..megatron
            },
            other => {
                return Err(CostError::Software(format!(
                    "unknown software profile `{other}` (known: {})",
                    PROFILES.join(", ")
                )));
            }
        };
        Ok(Software {
            name: name.to_string(),
            ..s
        })
    }

    /// A profile with overrides, as `--software` takes it: `NAME[,knob=value...]`, e.g.
    /// `deepspeed,overlap_param_gather=true` or `megatron-core,attention=unfused`.
    pub fn parse(spec: &str) -> Result<Software, CostError> {
        SoftwareSpec::parse(spec)?.resolve()
    }

    /// The profile with nothing overlapped: gradient reduction after the backward, the
    /// tensor-parallel collectives and the ZeRO gathers awaited where they are issued,
    /// stage-to-stage transfers blocking. A plan's step under it is the pessimistic end of its
    /// predicted range: what it costs if none of the overlap the profile counts on happens.
    pub fn without_overlap(&self) -> Software {
        Software {
            overlap_grad_reduce: false,
            tp_backward_overlap: false,
            tp_forward_overlap: false,
            overlap_param_gather: false,
            p2p_blocking: true,
            ep_comm_overlap: false,
            ..self.clone()
        }
    }

    /// What the stack can run, which the search offers under this profile (a pinned value
    /// is searched all the same, and `estimate` prices any plan):
    ///
    /// - `autopar`: everything this project's compiler runs: ZeRO 0 to 3, sequence
    ///   parallelism, selective recompute, interleaved schedules, context and expert
    ///   parallelism, and layer placements other than Megatron-LM's; not full recompute of
    ///   only some layers, which its recompute pass does not do.
    /// - `megatron-lm-2021` (SC'21's code): no ZeRO (the distributed optimizer came in
    ///   2022), no sequence parallelism or selective recompute (Korthikanti et al., 2022),
    ///   the interleaved schedule (SC'21's own), no context or expert parallelism.
    /// - `megatron-lm-2022`: adds the distributed optimizer (ZeRO-1), sequence parallelism,
    ///   selective recompute and full recompute of the first layers of each stage only
    ///   (`--recompute-method block`, Korthikanti et al., 2022).
    /// - `megatron-core` and `nemo`: adds context and expert parallelism; ZeRO-1 is still the
    ///   deepest sharding (r0.8, the README's runs).
    /// - `deepspeed` (Megatron-DeepSpeed as in SC'21 Table 2): ZeRO 0 to 3 and expert
    ///   parallelism (DeepSpeed-MoE); its pipeline engine runs 1F1B only, and its activation
    ///   checkpointing covers every layer.
    /// - `fsdp` (PyTorch FSDP under Composer, as in llm-foundry's tables): FSDP's
    ///   `NO_SHARD`, `SHARD_GRAD_OP` and `FULL_SHARD` (ZeRO 0, 2 and 3; no stage shards the
    ///   optimizer state alone), and data parallelism only: no tensor or pipeline
    ///   parallelism (Composer 0.17, which those tables ran, has neither), and activation
    ///   checkpointing of every block.
    /// - `torchtitan`: FSDP2's stages and its tensor (with sequence), pipeline (interleaved
    ///   included), context and expert parallelism, selective recompute, and full
    ///   recompute of some layers (every k-th, which recomputes as many as the first ones).
    ///
    /// Layer placements other than Megatron-LM's are this project's own. A profile with
    /// overrides, or read from a file, offers what its base profile offers.
    pub fn offers(&self) -> Offers {
        let all = Offers {
            zero: &[0, 1, 2, 3],
            tensor_parallel: true,
            pipeline: true,
            sequence_parallel: true,
            selective_recompute: true,
            interleaved: true,
            context_parallel: true,
            expert_parallel: true,
            layer_placements: false,
            partial_recompute: true,
        };
        match self.name.as_str() {
            "megatron-lm-2021" => Offers {
                zero: &[0],
                sequence_parallel: false,
                selective_recompute: false,
                partial_recompute: false,
                context_parallel: false,
                expert_parallel: false,
                ..all
            },
            "megatron-lm-2022" => Offers {
                zero: &[0, 1],
                context_parallel: false,
                expert_parallel: false,
                ..all
            },
            "megatron-core" | "nemo" => Offers {
                zero: &[0, 1],
                ..all
            },
            "deepspeed" => Offers {
                sequence_parallel: false,
                selective_recompute: false,
                partial_recompute: false,
                interleaved: false,
                context_parallel: false,
                ..all
            },
            "fsdp" => Offers {
                zero: &[0, 2, 3],
                tensor_parallel: false,
                pipeline: false,
                sequence_parallel: false,
                selective_recompute: false,
                interleaved: false,
                context_parallel: false,
                expert_parallel: false,
                partial_recompute: false,
                ..all
            },
            "torchtitan" => Offers {
                zero: &[0, 2, 3],
                ..all
            },
            _ => Offers {
                layer_placements: true,
                partial_recompute: false,
                ..all
            },
        }
    }

    /// Writes the profile into `model`'s parameters.
    pub fn apply(&self, model: &mut CostModel) {
        model.compute.attention = self.attention;
        model.compute.fusion = self.fusion;
        model.comm.overlap_grad_reduce = self.overlap_grad_reduce;
        model.comm.overlap_tp_backward = self.tp_backward_overlap;
        model.comm.overlap_tp_forward = self.tp_forward_overlap;
        if let Some(b) = self.grad_buffer_bytes {
            model.memory.grad_bytes_per_param = b;
        }
        model.software = self.clone();
    }
}

/// A profile and its overrides: the `[software]` table of a cluster file
/// (`profile = "deepspeed"`, `overlap_param_gather = true`, ...) and the parsed form of
/// `--software`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SoftwareSpec {
    /// The built-in profile ([`PROFILES`]).
    pub profile: String,
    /// `flash` or `unfused`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
    /// See [`Software::overlap_grad_reduce`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_grad_reduce: Option<bool>,
    /// See [`Software::tp_backward_overlap`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_backward_overlap: Option<bool>,
    /// See [`Software::tp_forward_overlap`] (`tp_comm_overlap` sets both directions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_forward_overlap: Option<bool>,
    /// See [`Software::overlap_param_gather`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_param_gather: Option<bool>,
    /// See [`Software::param_gather`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_gather: Option<GatherUnit>,
    /// See [`Software::bucket_mb`] (a size in MiB; 0 for one all-reduce per tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_mb: Option<f64>,
    /// See [`Software::fusion`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fusion: Option<Fusion>,
    /// See [`Software::reduce_bytes`]: `bf16` or `fp32`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_dtype: Option<String>,
    /// See [`Software::p2p_blocking`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p2p_blocking: Option<bool>,
    /// See [`Software::sm_carveout`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_carveout: Option<bool>,
    /// See [`Software::cpu_optimizer`]: `cpu_adam` or `torch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_optimizer: Option<CpuOptimizer>,
    /// See [`Software::loss`]: `fused`, `megatron` or `torch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossKernel>,
    /// See [`Software::fp8_recipe`]: `tensor` or `blockwise`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_recipe: Option<Fp8Recipe>,
    /// See [`Software::fp8_weight_cache`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_weight_cache: Option<bool>,
    /// See [`Software::zero_over_cp`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_over_cp: Option<bool>,
    /// See [`Software::fp8_params`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_params: Option<bool>,
    /// See [`Software::selective`]: `attention` or `op`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selective: Option<SelectiveRecompute>,
    /// See [`Software::cp_attention`]: `ring`, `eager_ring` or `all_gather`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp_attention: Option<CpAttention>,
    /// See [`Software::fp32_grad_accumulation`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_grad_accumulation: Option<bool>,
    /// See [`Software::recompute_early_stop`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_early_stop: Option<bool>,
    /// See [`Software::ep_comm_overlap`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep_comm_overlap: Option<bool>,
    /// See [`Software::tp_relayout_copies`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_relayout_copies: Option<bool>,
    /// See [`Software::fp8_tp_gather`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_tp_gather: Option<bool>,
    /// See [`Software::tp_pipelined_backward_reduce_scatter`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_pipelined_backward_reduce_scatter: Option<bool>,
    /// See [`Software::dropout`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<bool>,
}

/// The value of the software option `key` named `value` among `options`, or an error that
/// lists them ("`fusion` is fused or eager, not `some`").
fn choice<T: Copy>(key: &str, value: &str, options: &[(&str, T)]) -> Result<T, CostError> {
    if let Some((_, v)) = options.iter().find(|(name, _)| *name == value) {
        return Ok(*v);
    }
    let names: Vec<&str> = options.iter().map(|(name, _)| *name).collect();
    let listed = match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(CostError::Software(format!(
        "software option `{key}` is {listed}, not `{value}`"
    )))
}

impl SoftwareSpec {
    /// Parses `NAME[,knob=value...]`; each knob may be given once.
    pub fn parse(spec: &str) -> Result<SoftwareSpec, CostError> {
        let bad = |m: String| CostError::Software(m);
        let mut parts = spec.split(',').map(str::trim);
        let mut out = SoftwareSpec {
            profile: parts.next().unwrap_or_default().to_string(),
            ..SoftwareSpec::default()
        };
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("software option `{part}` is not KEY=VALUE")))?;
            let flag = || match value {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err(bad(format!(
                    "software option `{key}` is true or false, not `{value}`"
                ))),
            };
            let fresh = match key {
                "attention" => out.attention.replace(value.to_string()).is_none(),
                "overlap_grad_reduce" => out.overlap_grad_reduce.replace(flag()?).is_none(),
                "tp_backward_overlap" => out.tp_backward_overlap.replace(flag()?).is_none(),
                "tp_forward_overlap" => out.tp_forward_overlap.replace(flag()?).is_none(),
                "tp_comm_overlap" => {
                    let v = flag()?;
                    let fresh = out.tp_forward_overlap.replace(v).is_none();
                    out.tp_backward_overlap.replace(v).is_none() && fresh
                }
                "overlap_param_gather" => out.overlap_param_gather.replace(flag()?).is_none(),
                "param_gather" => {
                    let unit = choice(
                        key,
                        value,
                        &[("layer", GatherUnit::Layer), ("tensor", GatherUnit::Tensor)],
                    )?;
                    out.param_gather.replace(unit).is_none()
                }
                "bucket_mb" => {
                    let mb: f64 = value.parse().map_err(|_| {
                        bad(format!(
                            "software option `bucket_mb` is a size in MiB, not `{value}`"
                        ))
                    })?;
                    out.bucket_mb.replace(mb).is_none()
                }
                "fusion" => {
                    let f = choice(
                        key,
                        value,
                        &[("fused", Fusion::Fused), ("eager", Fusion::Eager)],
                    )?;
                    out.fusion.replace(f).is_none()
                }
                "reduce_dtype" => out.reduce_dtype.replace(value.to_string()).is_none(),
                "p2p_blocking" => out.p2p_blocking.replace(flag()?).is_none(),
                "sm_carveout" => out.sm_carveout.replace(flag()?).is_none(),
                "cpu_optimizer" => {
                    let o = choice(
                        key,
                        value,
                        &[
                            ("cpu_adam", CpuOptimizer::CpuAdam),
                            ("torch", CpuOptimizer::Torch),
                        ],
                    )?;
                    out.cpu_optimizer.replace(o).is_none()
                }
                "loss" => {
                    let l = choice(
                        key,
                        value,
                        &[
                            ("fused", LossKernel::Fused),
                            ("megatron", LossKernel::Megatron),
                            ("torch", LossKernel::Torch),
                        ],
                    )?;
                    out.loss.replace(l).is_none()
                }
                "fp8_recipe" => {
                    let r = choice(
                        key,
                        value,
                        &[
                            ("tensor", Fp8Recipe::Tensor),
                            ("delayed", Fp8Recipe::Tensor),
                            ("blockwise", Fp8Recipe::Blockwise),
                        ],
                    )?;
                    out.fp8_recipe.replace(r).is_none()
                }
                "fp8_weight_cache" => out.fp8_weight_cache.replace(flag()?).is_none(),
                "zero_over_cp" => out.zero_over_cp.replace(flag()?).is_none(),
                "fp8_params" => out.fp8_params.replace(flag()?).is_none(),
                "selective" => {
                    let r = choice(
                        key,
                        value,
                        &[
                            ("attention", SelectiveRecompute::Attention),
                            ("op", SelectiveRecompute::Op),
                        ],
                    )?;
                    out.selective.replace(r).is_none()
                }
                "cp_attention" => {
                    let a = choice(
                        key,
                        value,
                        &[
                            ("ring", CpAttention::Ring),
                            ("eager_ring", CpAttention::EagerRing),
                            ("all_gather", CpAttention::AllGather),
                        ],
                    )?;
                    out.cp_attention.replace(a).is_none()
                }
                "fp32_grad_accumulation" => out.fp32_grad_accumulation.replace(flag()?).is_none(),
                "recompute_early_stop" => out.recompute_early_stop.replace(flag()?).is_none(),
                "ep_comm_overlap" => out.ep_comm_overlap.replace(flag()?).is_none(),
                "tp_relayout_copies" => out.tp_relayout_copies.replace(flag()?).is_none(),
                "fp8_tp_gather" => out.fp8_tp_gather.replace(flag()?).is_none(),
                "tp_pipelined_backward_reduce_scatter" => out
                    .tp_pipelined_backward_reduce_scatter
                    .replace(flag()?)
                    .is_none(),
                "dropout" => out.dropout.replace(flag()?).is_none(),
                other => {
                    return Err(bad(format!(
                        "unknown software option `{other}` (attention, overlap_grad_reduce, \
                         tp_backward_overlap, tp_forward_overlap, tp_comm_overlap, \
                         overlap_param_gather, param_gather, fusion, reduce_dtype, bucket_mb, \
                         p2p_blocking, sm_carveout, cpu_optimizer, loss, fp8_recipe, fp8_weight_cache, \
                         zero_over_cp, fp8_params, selective, cp_attention, \
                         fp32_grad_accumulation, recompute_early_stop, ep_comm_overlap, \
                         tp_relayout_copies, fp8_tp_gather, tp_pipelined_backward_reduce_scatter, \
                         dropout)"
                    )));
                }
            };
            if !fresh {
                return Err(bad(format!("software option `{key}` is given twice")));
            }
        }
        Ok(out)
    }

    /// The profile with the overrides applied.
    pub fn resolve(&self) -> Result<Software, CostError> {
        let mut s = Software::preset(&self.profile)?;
        if let Some(a) = &self.attention {
            s.attention = match a.as_str() {
                "flash" | "flash2" => AttentionKernel::Flash,
                "flash1" => AttentionKernel::Flash1,
                "fused" | "cudnn" | "flash3" => AttentionKernel::Fused,
                "unfused" => AttentionKernel::Unfused,
                other => {
                    return Err(CostError::Software(format!(
                        "software option `attention` is flash (flash2), flash1, fused (cudnn, \
                         flash3) or unfused, not `{other}`"
                    )));
                }
            };
        }
        if let Some(f) = self.fusion {
            s.fusion = f;
        }
        if let Some(r) = &self.reduce_dtype {
            s.reduce_bytes = match r.as_str() {
                "bf16" | "fp16" => 2.0,
                "fp32" | "f32" => 4.0,
                other => {
                    return Err(CostError::Software(format!(
                        "software option `reduce_dtype` is bf16 or fp32, not `{other}`"
                    )));
                }
            };
            // A stack whose gradient buffer is in its reduce dtype (Megatron's
            // `grad_reduce_in_fp32` sets both) keeps it so; PyTorch FSDP's and DeepSpeed's
            // reduce dtype is only the collective's (FSDP upcasts the reduced shard to the
            // fp32 parameter's dtype), and they name no buffer.
            if s.grad_buffer_bytes.is_some() {
                s.grad_buffer_bytes = Some(s.reduce_bytes);
            }
        }
        if let Some(v) = self.overlap_grad_reduce {
            s.overlap_grad_reduce = v;
        }
        if let Some(v) = self.tp_backward_overlap {
            s.tp_backward_overlap = v;
        }
        if let Some(v) = self.tp_forward_overlap {
            s.tp_forward_overlap = v;
        }
        if let Some(v) = self.overlap_param_gather {
            s.overlap_param_gather = v;
        }
        if let Some(v) = self.param_gather {
            s.param_gather = v;
        }
        if let Some(v) = self.p2p_blocking {
            s.p2p_blocking = v;
        }
        if let Some(v) = self.sm_carveout {
            s.sm_carveout = v;
        }
        if let Some(v) = self.cpu_optimizer {
            s.cpu_optimizer = v;
        }
        if let Some(v) = self.loss {
            s.loss = v;
        }
        if let Some(v) = self.fp8_recipe {
            s.fp8_recipe = v;
        }
        if let Some(v) = self.fp8_weight_cache {
            s.fp8_weight_cache = v;
        }
        if let Some(v) = self.fp8_params {
            s.fp8_params = v;
        }
        if let Some(v) = self.zero_over_cp {
            s.zero_over_cp = v;
        }
        if let Some(v) = self.fp32_grad_accumulation {
            s.fp32_grad_accumulation = v;
        }
        if let Some(v) = self.recompute_early_stop {
            s.recompute_early_stop = v;
        }
        if let Some(v) = self.ep_comm_overlap {
            s.ep_comm_overlap = v;
        }
        if let Some(v) = self.tp_relayout_copies {
            s.tp_relayout_copies = v;
        }
        if let Some(v) = self.fp8_tp_gather {
            s.fp8_tp_gather = v;
        }
        if let Some(v) = self.tp_pipelined_backward_reduce_scatter {
            s.tp_pipelined_backward_reduce_scatter = v;
        }
        if let Some(v) = self.dropout {
            s.dropout = v;
        }
        if let Some(v) = self.selective {
            s.selective = v;
        }
        if let Some(v) = self.cp_attention {
            s.cp_attention = v;
        }
        if let Some(mb) = self.bucket_mb {
            if !mb.is_finite() || mb < 0.0 {
                return Err(CostError::Software(format!(
                    "software option `bucket_mb` is a size in MiB (0 or more), not `{mb}`"
                )));
            }
            s.bucket_mb = Some(mb);
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_resolves_and_knobs_override_it() -> Result<(), CostError> {
        for name in PROFILES {
            assert_eq!(Software::preset(name)?.name, name);
        }
        let s = Software::parse("deepspeed,overlap_param_gather=true,attention=flash")?;
        assert!(s.overlap_param_gather);
        assert_eq!(s.attention, AttentionKernel::Flash);
        assert_eq!(s.param_gather, GatherUnit::Tensor);
        assert_eq!(Software::default(), Software::preset("autopar")?);
        let f = Software::parse("fsdp,attention=flash1,fusion=fused,reduce_dtype=bf16")?;
        assert_eq!(
            (f.attention, f.fusion, f.reduce_bytes),
            (AttentionKernel::Flash1, Fusion::Fused, 2.0)
        );
        assert_eq!(Software::preset("fsdp")?.fusion, Fusion::Eager);
        assert_eq!(
            Software::preset("megatron-core")?.attention,
            AttentionKernel::Fused
        );
        let spec: SoftwareSpec = toml::from_str("profile = \"fsdp\"\nparam_gather = \"tensor\"\n")
            .map_err(|e| CostError::Software(e.to_string()))?;
        assert_eq!(spec.resolve()?.param_gather, GatherUnit::Tensor);
        // torchtitan's selective recomputation is its per-op policy, every other profile's
        // the attention core; no profile carves SMs out; both are knobs, in a file too.
        assert_eq!(
            Software::preset("torchtitan")?.selective,
            SelectiveRecompute::Op
        );
        for name in PROFILES.iter().filter(|&&n| n != "torchtitan") {
            assert_eq!(
                Software::preset(name)?.selective,
                SelectiveRecompute::Attention
            );
        }
        assert!(
            PROFILES
                .iter()
                .all(|n| !Software::preset(n).unwrap().sm_carveout)
        );
        let t = Software::parse("torchtitan,selective=attention,sm_carveout=true")?;
        assert_eq!(t.selective, SelectiveRecompute::Attention);
        assert!(t.sm_carveout);
        let spec: SoftwareSpec =
            toml::from_str("profile = \"fsdp\"\nselective = \"op\"\nsm_carveout = true\n")
                .map_err(|e| CostError::Software(e.to_string()))?;
        let f = spec.resolve()?;
        assert_eq!((f.selective, f.sm_carveout), (SelectiveRecompute::Op, true));
        // fp8 is per-tensor scaled unless block scaling is asked for, on the line or in a file.
        assert!(
            PROFILES
                .iter()
                .all(|n| { Software::preset(n).is_ok_and(|s| s.fp8_recipe == Fp8Recipe::Tensor) })
        );
        let b = Software::parse("megatron-core,fp8_recipe=blockwise")?;
        assert_eq!(b.fp8_recipe, Fp8Recipe::Blockwise);
        // Megatron-Core and NeMo reuse the fp8 weights over a step's micro-batches.
        for (name, cached) in [("megatron-core", true), ("nemo", true), ("fsdp", false)] {
            assert_eq!(Software::preset(name)?.fp8_weight_cache, cached, "{name}");
        }
        assert!(!Software::parse("nemo,fp8_weight_cache=false")?.fp8_weight_cache);
        // ZeRO spans the context-parallel ranks in the stacks whose meshes put them in it.
        for (name, over) in [
            ("megatron-core", true),
            ("nemo", true),
            ("torchtitan", true),
            ("fsdp", false),
            ("autopar", false),
        ] {
            assert_eq!(Software::preset(name)?.zero_over_cp, over, "{name}");
        }
        assert!(Software::parse("autopar,zero_over_cp=true")?.zero_over_cp);
        assert!(Software::parse("megatron-core,fp8_params=true")?.fp8_params);
        assert!(!Software::preset("nemo")?.fp8_params);
        // NeMo's H100 scripts accumulate and reduce gradients in bf16; Megatron-LM in fp32;
        // `reduce_dtype` sets both the buffer and the ZeRO-2/3 reduce-scatter.
        assert_eq!(Software::preset("nemo")?.grad_buffer_bytes, Some(2.0));
        assert_eq!(
            Software::preset("megatron-core")?.grad_buffer_bytes,
            Some(4.0)
        );
        assert_eq!(Software::preset("fsdp")?.grad_buffer_bytes, None);
        let f = Software::parse("megatron-core,reduce_dtype=bf16")?;
        assert_eq!((f.reduce_bytes, f.grad_buffer_bytes), (2.0, Some(2.0)));
        let f = Software::parse("fsdp,reduce_dtype=bf16")?;
        assert_eq!((f.reduce_bytes, f.grad_buffer_bytes), (2.0, None));
        let f = Software::parse("deepspeed,reduce_dtype=bf16")?;
        assert_eq!((f.reduce_bytes, f.grad_buffer_bytes), (2.0, None));
        let mut m = crate::CostModel::new(crate::Cluster::preset("dgx-h100:nodes=1")?);
        Software::parse("nemo,reduce_dtype=fp32")?.apply(&mut m);
        assert_eq!(m.memory.grad_bytes_per_param, 4.0);
        Software::parse("nemo")?.apply(&mut m);
        assert_eq!(m.memory.grad_bytes_per_param, 2.0);
        let spec: SoftwareSpec = toml::from_str("profile = \"nemo\"\nfp8_recipe = \"blockwise\"\n")
            .map_err(|e| CostError::Software(e.to_string()))?;
        assert_eq!(spec.resolve()?.fp8_recipe, Fp8Recipe::Blockwise);
        Ok(())
    }

    #[test]
    fn bad_profiles_and_knobs_are_named() {
        let err = |spec: &str| Software::parse(spec).expect_err(spec).to_string();
        assert!(err("megatron").contains("unknown software profile `megatron`"));
        assert!(err("fsdp,overlap_grad_reduce").contains("KEY=VALUE"));
        assert!(err("fsdp,overlap_grad_reduce=yes").contains("true or false"));
        assert!(err("fsdp,speed=11").contains("unknown software option `speed`"));
        assert!(err("fsdp,param_gather=layer,param_gather=tensor").contains("twice"));
        assert!(err("fsdp,bucket_mb=big").contains("size in MiB"));
        assert!(err("fsdp,bucket_mb=-1").contains("0 or more"));
        assert!(err("fsdp,fusion=some").contains("fused or eager"));
        assert!(err("fsdp,reduce_dtype=int8").contains("bf16 or fp32"));
        assert!(err("fsdp,attention=fast").contains("flash1"));
        assert!(err("fsdp,cpu_optimizer=gpu").contains("cpu_adam or torch"));
        assert!(err("fsdp,loss=liger").contains("fused, megatron or torch"));
        assert!(err("fsdp,selective=layer").contains("attention or op"));
        assert!(err("nemo,fp8_recipe=mx").contains("tensor, delayed or blockwise"));
        assert!(err("fsdp,sm_carveout=16").contains("true or false"));
    }

    #[test]
    fn bucket_sizes_come_from_the_profile_and_the_knob() -> Result<(), CostError> {
        assert_eq!(
            Software::preset("autopar")?.bucket_mb,
            Some(DEFAULT_BUCKET_MB)
        );
        assert_eq!(Software::preset("megatron-core")?.bucket_mb, None);
        assert_eq!(Software::parse("fsdp,bucket_mb=0")?.bucket_mb, Some(0.0));
        assert_eq!(
            Software::parse("autopar,bucket_mb=2.5")?.bucket_mb,
            Some(2.5)
        );
        Ok(())
    }
}
