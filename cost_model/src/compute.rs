//! Compute costs: FLOPs and bytes of every IR op, and a roofline time in which GEMMs reach a
//! shape-dependent fraction of the device's measured matmul ceiling (tile and wave
//! quantisation over its SMs, split-K, a per-tile fixed cost), attention kernels the fraction
//! of peak their generation reaches on the device's architecture, and memory-bound ops a
//! fraction of HBM bandwidth. Every tunable number is a field of [`ComputeParams`].

use serde::{Deserialize, Serialize};

use autopar_ir::{BinaryOp, DType, EinsumSpec, Op, TensorType, UnaryOp};

use crate::cluster::Cluster;
use crate::comm::{Collective, CommParams};
use crate::cost::Cost;
use crate::mapping::MeshMapping;
use crate::software::{Fp8Recipe, Fusion};

/// How attention is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKernel {
    /// Two batched GEMMs around a fused scale-mask-softmax and a dropout, materialising the
    /// `s x s` scores (Megatron-LM before fused attention kernels; the Korthikanti et al. 2022
    /// measurements).
    Unfused,
    /// FlashAttention 2 (Dao 2023) or a kernel of its class (PyTorch's scaled-dot-product
    /// attention): scores stay on chip, causal blocks above the diagonal are skipped, the
    /// backward recomputes the scores. Written for Ampere's `mma.sync`.
    Flash,
    /// FlashAttention 1 (Dao et al. 2022): the same algorithm with worse work partitioning,
    /// about half FlashAttention 2's speed (FlashAttention-2 paper, arXiv:2307.08691).
    Flash1,
    /// An attention kernel native to the device's architecture: cuDNN fused attention through
    /// Transformer Engine, or FlashAttention 3 on Hopper (warpgroup MMA, TMA, asynchrony;
    /// arXiv:2407.08608). On Ampere it is priced as [`AttentionKernel::Flash`].
    Fused,
}

impl AttentionKernel {
    /// Whether the kernel writes the `s x s` scores to memory (and so selective recompute has
    /// something to save).
    pub fn materialises_scores(self) -> bool {
        self == AttentionKernel::Unfused
    }

    /// The name `--software attention=` takes.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Unfused => "unfused",
            AttentionKernel::Flash => "flash",
            AttentionKernel::Flash1 => "flash1",
            AttentionKernel::Fused => "fused",
        }
    }
}

/// Fractions of the dense peak that fused attention kernels reach on the FLOPs they perform,
/// forward and backward, with what running an Ampere-era kernel on a newer architecture costs.
/// FlashAttention 2 and the native kernels are given at long sequences, the rate
/// [`ComputeParams::attention_block_factor`] divides for shorter ones; FlashAttention 1 is
/// flat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionFractions {
    /// FlashAttention 1 on Ampere, `[forward, backward]`: "25-40% of the theoretical maximum
    /// FLOPs/s" on A100 (FlashAttention-2 paper, Sec. 1), the backward at the low end.
    pub flash1: [f64; 2],
    /// FlashAttention 2 on Ampere at long sequences: "50-73%" of A100 peak in the forward,
    /// the backward up to about 63% (FlashAttention-2 paper, Sec. 4.1, causal, head dim
    /// 64-128). 0.711 and 0.596 (in the ratio of the paper's forward and backward figures)
    /// make the causal forward+backward 195 TFLOP/s, the asymptote of its A100 figure (189
    /// at 16k tokens, with the block factor).
    pub flash2: [f64; 2],
    /// An architecture-native kernel on Hopper or later at long sequences: FlashAttention 3
    /// reaches up to 75% of H100 peak in the forward (arXiv:2407.08608, abstract; causal,
    /// head dim 128, 616 TFLOP/s at 16k tokens, an asymptote of 635 with the block factor:
    /// 0.64) and 1.5-1.75x FlashAttention 2 in the backward (0.50); cuDNN's fused attention
    /// is of the same class (539 TFLOP/s at 16k in the same figure).
    pub native: [f64; 2],
    /// What an Ampere-era kernel keeps of its Ampere fraction on Hopper or later: without
    /// warpgroup MMA it runs only about 1.65x as fast on H100 as on A100, where the dense peak
    /// is 3.17x (989 against 312 TFLOP/s). 0.52, measured: the FlashAttention-2 paper's
    /// forward+backward benchmarks on both GPUs (arXiv:2307.08691, the A100 and H100 figures,
    /// reproduced in github.com/Dao-AILab/flash-attention's README as
    /// `assets/flash2_a100_fwd_bwd_benchmark.png` and `assets/flash2_h100_fwd_bwd_benchmark.png`)
    /// give FlashAttention 1, causal, head dim 128, sequences 2k-16k, 69/76/80/83 TFLOP/s on
    /// A100 and 108/126/135/137 on H100: 0.49-0.53 of its A100 fraction, median 0.52;
    /// FlashAttention 2 in the same panels keeps 0.53-0.55, and every panel (head dim 64 and
    /// 128, causal or not) lies in 0.47-0.56. The FlashAttention-3 paper's round figures
    /// (about 35% of H100 peak where 70% of A100's, Sec. 1) say the same, one half.
    pub legacy_on_newer_arch: f64,
}

impl Default for AttentionFractions {
    fn default() -> Self {
        AttentionFractions {
            flash1: [0.35, 0.28],
            flash2: [0.711, 0.596],
            native: [0.64, 0.50],
            legacy_on_newer_arch: 0.52,
        }
    }
}

/// Every tunable number of the compute model, with the reasoning behind its default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeParams {
    /// Fraction of the device's measured maximum achievable matmul rate
    /// ([`crate::cluster::GpuSpec::mamf_tflops`]) that a large, well-shaped GEMM sustains in a
    /// long training run. The MAMF finder measures each shape over 100 iterations; in
    /// training the GPU stays at its power limit (400 W on A100, 700 W on H100) and its clock
    /// drops below the benchmark's. 0.863 is the one figure the Korthikanti et al. 2022
    /// per-layer times (the measurement that isolates GEMMs, on A100) give: 75% of the A100's
    /// peak, where MAMF finds 86.9%. A device whose description gives its own share
    /// ([`crate::cluster::MamfTflops::sustained`]: 700 W Hopper parts) uses that instead.
    pub gemm_sustained_fraction: f64,
    /// GEMMs run at the measured maximum itself, as in a micro-benchmark's few iterations
    /// (the MAMF finder's, a layer benchmark's) rather than a long run: no sustained share.
    #[serde(default)]
    pub benchmark_clock: bool,
    /// The matmul ceiling, as a fraction of the datasheet peak, on a device whose description
    /// gives no measured maximum: 0.80, about the median of the NVIDIA rows of the MAMF table
    /// (72.9-86.9%).
    pub gemm_ceiling_default: f64,
    /// Fixed cost of one output tile (prologue, epilogue, pipeline fill), in units of the
    /// contraction length: a tile with contraction `k` costs as if it were `k + this`. Makes
    /// GEMMs with short contractions (attention's `q k^T` over the head dim) slower.
    pub gemm_tile_overhead_k: f64,
    /// Output tiles `(rows, cols, efficiency relative to the largest)` the GEMM model may
    /// choose from, as cuBLAS's heuristics do; smaller tiles waste less on ragged shapes and
    /// fill more SMs but reuse operands less.
    pub gemm_tiles: Vec<(usize, usize, f64)>,
    /// Split-K factors the GEMM model may use when there are too few output tiles for the SMs.
    pub gemm_split_k: Vec<usize>,
    /// Whether GEMMs on architectures with warpgroup tensor-core instructions (Hopper and
    /// later) may balance a partial last wave stream-K style: whole waves of tiles as usual,
    /// then the remaining tiles' contraction split evenly over every SM, each SM's share
    /// paying the per-tile overhead and writing and reading back one fp32 partial tile
    /// (Osama et al., "Stream-K", PPoPP 2023, arXiv:2301.03598; CUTLASS 3.1 added the stream-K
    /// tile scheduler to its persistent Hopper kernels). The MAMF finder's best fp8 shapes on
    /// H100 and H200 (1024x9216x14336 and 1280x4096x12032: 288 and 160 tiles of 256x128 on 132
    /// SMs) reach 71-73% of the peak, which whole-tile waves would cap at 73% and 61% of
    /// the ceiling: the library balances the last wave there.
    #[serde(default = "default_true")]
    pub gemm_stream_k: bool,
    /// Fraction of HBM bandwidth that element-wise, normalisation and softmax kernels reach:
    /// 0.8, what a streaming copy reaches on A100 and H100 (about 1.6 of 2.0 TB/s and 2.7 of
    /// 3.35 TB/s in NVIDIA's and users' bandwidth tests), element-wise kernels a little less.
    pub memory_bandwidth_fraction: f64,
    /// Fraction of HBM bandwidth that the kernels over unfused attention's `s x s` scores
    /// reach: the fused scale-mask-softmax (fp32 math on 16-bit rows, with the causal mask),
    /// the dropout that draws a Philox number per score, and their backward. 0.65, from
    /// Korthikanti et al. 2022 Table 4: selective recomputation reruns exactly these kernels
    /// and the two score GEMMs, and adds 1.3 ms to the 22B layer's backward (13.2 against
    /// 11.9 ms), where at [`ComputeParams::memory_bandwidth_fraction`] they would take
    /// 1.1 ms.
    #[serde(default = "default_score_bandwidth_fraction")]
    pub score_bandwidth_fraction: f64,
    /// Fixed time of one kernel (launch gap and tail), added to each op.
    pub kernel_overhead_s: f64,
    /// What each query block of a fused attention kernel pays beside the key blocks it
    /// works through, in key blocks of [`ATTENTION_BLOCK`] (loading its queries, the final
    /// rescale and writing its output; in the backward, each key block's CTA loading its keys
    /// and values and writing their gradients): 1.5, the one figure that reproduces, with the
    /// asymptotes of [`AttentionFractions`], FlashAttention 2's forward+backward on A100 (head
    /// dim 128, causal: 99, 133, 155, 173, 182 and 189 TFLOP/s from 512 to 16k tokens, model
    /// 97, 130, 156, 173, 183, 189; head dim 64 likewise) and FlashAttention 3's forward on
    /// H100 (causal: 292, 423, 521, 579, 602, 616, model 316, 422, 506, 563, 596, 614):
    /// github.com/Dao-AILab/flash-attention `assets/flash2_a100_fwd_bwd_benchmark.png` and
    /// `assets/flash3_fp16_fwd.png`. Without the mask the same figure gives the shape of the
    /// unmasked curve (151, 173, 187, 196, 201, 203 measured; 142, 164, 178, 186, 190, 193
    /// from the causal asymptote), which training does not use. Short sequences run
    /// attention well below its long-sequence rate.
    #[serde(default = "default_attention_block_overhead")]
    pub attention_block_overhead: f64,
    /// How attention runs.
    pub attention: AttentionKernel,
    /// How far element-wise work is fused (the software profile's).
    pub fusion: Fusion,
    /// What eager execution adds per transformer layer, `[forward, backward]`, in passes over
    /// a `[tokens, hidden]` activation (read or write of one such tensor): the Q/K/V split
    /// made contiguous and, for FlashAttention's variable-length interface, gathered to
    /// unpadded tokens and scattered back (9 in the forward: 3h read and written, h out and
    /// the zeroed output), and the backward's mirror scatters and gathers plus the
    /// gradients' zero-fills (12). Counted from llm-foundry's MPT block as it runs without
    /// `torch.compile`.
    pub eager_passes: [f64; 2],
    /// Kernels eager execution adds per layer, `[forward, backward]`, each paying
    /// [`ComputeParams::kernel_overhead_s`]: the copies above, the separate residual adds and
    /// casts, and autograd's accumulation kernels (about 10 and 20).
    pub eager_kernels: [f64; 2],
    /// What the fused attention kernels reach, per generation and architecture.
    pub attention_fractions: AttentionFractions,
    /// Bytes per element that casting a bf16 tensor for Transformer Engine's fp8 GEMMs
    /// moves: one read of the bf16 tensor (2) and writes of its fp8 copy and of the
    /// transposed fp8 copy the other pass's GEMM needs on Hopper's fp8 tensor cores (1 + 1):
    /// 4. TE's `cast_transpose` kernel (`transformer_engine/common/transpose/cast_transpose.cu`)
    /// does all of it in one pass and folds the delayed-scaling amax into the same pass, so
    /// no separate amax read is counted. Each tensor is cast once, not once per GEMM that
    /// reads it ([`ComputeParams::fp8_gemm_time`] takes the count from its caller): a
    /// linear layer's input and weight before its forward GEMM, its output gradient before
    /// the input-gradient GEMM; the weight-gradient GEMM reads the transposed copies.
    pub fp8_cast_bytes_per_element: f64,
    /// The share of the fp8 GEMM ceiling that block-scaled fp8 GEMMs
    /// ([`crate::Fp8Recipe::Blockwise`]) reach on Hopper, whose tensor cores take one scale
    /// per operand: 0.75. Each 128-deep slice of the contraction is rescaled and accumulated
    /// on the CUDA cores in the main loop (DeepSeek-V3 technical report, arXiv:2412.19437,
    /// Sec. 3.3.2). DeepGEMM's README (github.com/deepseek-ai/DeepGEMM, first release) gives
    /// the rates of block-scaled kernels built on CUTLASS 3.6 on H800 (H100's tensor cores)
    /// for DeepSeek-V3's 4096-8192-token training shapes: 916-1185 TFLOP/s (its own
    /// kernels' 1025-1358 over their stated speedups of 1.1-1.2x), a median of 0.73 of the
    /// tensor-scaled ceiling the MAMF finder measures on H100 (1402.6).
    #[serde(default = "default_blockwise_fp8_fraction")]
    pub blockwise_fp8_fraction: f64,
}

impl Default for ComputeParams {
    fn default() -> Self {
        ComputeParams {
            gemm_sustained_fraction: 0.863,
            benchmark_clock: false,
            gemm_ceiling_default: 0.80,
            gemm_tile_overhead_k: 32.0,
            gemm_tiles: vec![
                (256, 128, 1.0),
                (128, 256, 1.0),
                (128, 128, 0.93),
                (128, 64, 0.85),
                (64, 64, 0.72),
            ],
            gemm_split_k: vec![1, 2, 4, 8],
            gemm_stream_k: true,
            memory_bandwidth_fraction: 0.8,
            score_bandwidth_fraction: default_score_bandwidth_fraction(),
            kernel_overhead_s: 3e-6,
            attention_block_overhead: default_attention_block_overhead(),
            attention: AttentionKernel::Flash,
            fusion: Fusion::Fused,
            eager_passes: [9.0, 12.0],
            eager_kernels: [10.0, 20.0],
            attention_fractions: AttentionFractions::default(),
            fp8_cast_bytes_per_element: 4.0,
            blockwise_fp8_fraction: default_blockwise_fp8_fraction(),
        }
    }
}

fn default_blockwise_fp8_fraction() -> f64 {
    0.75
}

fn default_attention_block_overhead() -> f64 {
    1.5
}

/// What an element-wise chain of a model's layer costs in PyTorch eager mode beyond the one
/// fused kernel a fusing stack runs for it, `[forward, backward]`: bytes moved per element
/// of the tensor it works on (16-bit activations, fp32 where the model's Python code
/// upcasts) and kernels launched. Counted op by op from torchtitan's Llama
/// (`torchtitan/models/llama/model.py` and `models/norms.py` at the commit of its December
/// 2024 benchmarks, 9dec370); Hugging Face's Llama runs the same chains. The backward of a
/// chain is autograd's: each op's gradient reads the incoming gradient and what the op
/// saved and writes its own, and a tensor read twice accumulates two gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EagerChain {
    /// Extra bytes per element, `[forward, backward]`.
    pub bytes: [f64; 2],
    /// Extra kernels, `[forward, backward]`.
    pub kernels: [f64; 2],
}

/// RMSNorm as `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w`, per
/// element of its `[tokens, h]` input: the forward casts up (2 B read, 4 written), squares
/// (4 + 4), reduces (4), scales (4 + 4), casts down (4 + 2) and multiplies by the weight
/// (2 + 2): 36 B in 7 kernels where one fused kernel reads and writes 4 B, so 32 B more.
/// The backward: the weight's product (the input gradient 2 + 2 and the weight gradient's
/// reduction 2 + 2), the casts (2 + 4, 4 + 2), the scale's two gradients (8 and 8), the
/// square's (4 + 4) and the two gradients of the fp32 input summed (12): 56 B in about 12
/// kernels against a fused kernel's 6, so 50 B more. PyTorch's `nn.LayerNorm` is one kernel
/// in eager mode as well, so a LayerNorm model pays nothing here.
pub const EAGER_RMS_NORM: EagerChain = EagerChain {
    bytes: [32.0, 50.0],
    kernels: [6.0, 11.0],
};

/// Rotary positions as complex multiplication
/// (`view_as_real(view_as_complex(x.float()) * freqs).type_as(x)`), per element of the
/// queries and keys: the upcast (2 + 4), the product (4 + 4; the frequencies are one
/// `[seq, d]` table) and the downcast (4 + 2), 20 B in 3 kernels per tensor where a fused
/// rotary kernel reads and writes 4 B: 16 B more each way (the backward runs the mirror
/// chain, the conjugate product between the casts). Hugging Face's `rotate_half` form
/// (negate, concatenate, two products, a sum, in 16 bits) moves as much.
pub const EAGER_ROTARY: EagerChain = EagerChain {
    bytes: [16.0, 16.0],
    kernels: [4.0, 4.0],
};

/// Grouped-query attention's `repeat_kv` (expand and reshape: a copy) that gives every query
/// head its own key and value head before `scaled_dot_product_attention`, per element of
/// the repeated keys and values: the copy writes the repeated heads (2 B) and reads the
/// shared one once per group (2 B over the group's size); its backward sums the group's
/// gradients back. Counted as 4 B each way per element of the query-wide keys and values,
/// the read as if the group were of one (an over-count of at most a few percent of the
/// chain); nothing without grouping.
pub const EAGER_REPEAT_KV: EagerChain = EagerChain {
    bytes: [4.0, 4.0],
    kernels: [2.0, 2.0],
};

/// A gated MLP's `silu(a) * b`, per element of one gate: `silu` reads `a` and writes its
/// output (4 B) and the product reads both and writes (6 B), where a fused SwiGLU kernel
/// reads the two inputs and writes once (6 B): 4 B more. The backward: the product's two
/// gradients (each reading the incoming gradient and the other factor, writing 2 B: 12 B)
/// and `silu`'s (6 B), against a fused kernel's reads of the gradient and both inputs and
/// writes of two gradients (10 B): 8 B more. A GELU MLP's activation is one kernel in eager
/// mode as in fused code.
pub const EAGER_GATE: EagerChain = EagerChain {
    bytes: [4.0, 8.0],
    kernels: [1.0, 2.0],
};

/// The key block of the fused attention kernels' tiles (FlashAttention 2 and 3, head dims 64
/// to 128): [`ComputeParams::attention_block_factor`] counts work in blocks of it.
pub const ATTENTION_BLOCK: f64 = 128.0;

fn default_true() -> bool {
    true
}

fn default_score_bandwidth_fraction() -> f64 {
    0.65
}

/// What an op is bound by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// No work (sources, views).
    Free,
    /// Tensor-core math (GEMMs, attention).
    Matmul,
    /// Memory-bound kernels.
    Memory,
    /// Collectives and point-to-point transfers.
    Communication,
}

/// The cost of one op on one device.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpCost {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written in device memory (or moved, for communication).
    pub bytes: f64,
    /// Estimated time.
    pub time: Cost,
    /// What bounds it.
    pub class: OpClass,
}

impl OpCost {
    /// An op that costs nothing.
    pub const FREE: OpCost = OpCost {
        flops: 0.0,
        bytes: 0.0,
        time: Cost::ZERO,
        class: OpClass::Free,
    };
}

/// The shape of an attention core: `heads` (batch x heads) score matrices of `s` queries
/// against `t` keys, head dims `d` (queries, keys) and `dv` (values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionShape {
    /// Batch times heads.
    pub heads: u64,
    /// Queries.
    pub s: u64,
    /// Keys.
    pub t: u64,
    /// Query/key head dim.
    pub d: u64,
    /// Value head dim.
    pub dv: u64,
}

/// A GEMM's shape: `batch` independent `[m, k] x [k, n]` products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmShape {
    /// Independent products.
    pub batch: u64,
    /// Rows of the output.
    pub m: u64,
    /// Columns of the output.
    pub n: u64,
    /// Contraction length.
    pub k: u64,
}

impl GemmShape {
    /// A shape.
    pub fn new(batch: u64, m: u64, n: u64, k: u64) -> Self {
        GemmShape { batch, m, n, k }
    }

    /// `2 * batch * m * n * k`.
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

impl ComputeParams {
    /// Seconds to move `bytes` through HBM at the achievable fraction, plus the kernel cost.
    pub fn memory_time(&self, bytes: f64, cluster: &Cluster) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        bytes / (cluster.hbm_bandwidth() * self.memory_bandwidth_fraction) + self.kernel_overhead_s
    }

    /// Seconds for a kernel over unfused attention's scores to move `bytes`, at
    /// [`ComputeParams::score_bandwidth_fraction`], plus the kernel cost.
    pub fn score_memory_time(&self, bytes: f64, cluster: &Cluster) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        bytes / (cluster.hbm_bandwidth() * self.score_bandwidth_fraction) + self.kernel_overhead_s
    }

    /// Seconds for a GEMM of `shape` in `dtype` whose operands and result total `bytes`.
    ///
    /// The ceiling is the device's measured maximum achievable matmul rate, sustained at
    /// [`ComputeParams::gemm_sustained_fraction`]. With the device's SM count known, each candidate tile (and split-K factor) costs
    /// `waves * tile_flops / (per-SM peak * tile efficiency)`, where a wave is one tile per
    /// SM, tiles are padded to whole tiles and each tile pays a fixed overhead; the cheapest
    /// candidate wins. Without an SM count the padding and waves are ignored. The result is
    /// never below the time to move `bytes`.
    pub fn gemm_time(&self, shape: GemmShape, dtype: DType, bytes: f64, cluster: &Cluster) -> f64 {
        let ceiling = cluster
            .gemm_ceiling_flops(dtype, false, self.gemm_ceiling_default)
            .unwrap_or_else(|| cluster.peak_flops(dtype) * self.gemm_ceiling_default);
        self.gemm_time_at(shape, ceiling, bytes, cluster)
    }

    /// Seconds for a Transformer-Engine-style fp8 GEMM of `shape` under `recipe`: the GEMM
    /// at the device's fp8 ceiling (a share of it for block scaling on a device without
    /// block-scaled tensor cores, [`ComputeParams::blockwise_fp8_fraction`]; operands a byte
    /// each, the result in bf16), plus casting the `cast` elements that this GEMM is the
    /// first to read from bf16 to fp8 ([`ComputeParams::fp8_cast_bytes_per_element`]; 0
    /// where both operands were cast for an earlier GEMM). `None` on a device without fp8
    /// tensor cores.
    pub fn fp8_gemm_time(
        &self,
        shape: GemmShape,
        cast: f64,
        recipe: Fp8Recipe,
        cluster: &Cluster,
    ) -> Option<f64> {
        let mut ceiling =
            cluster.gemm_ceiling_flops(DType::BF16, true, self.gemm_ceiling_default)?;
        if recipe == Fp8Recipe::Blockwise && !cluster.gpu.arch.block_scaled_mma() {
            ceiling *= self.blockwise_fp8_fraction;
        }
        let GemmShape { batch, m, n, k } = shape;
        let operands = (batch * m * k + batch * k * n) as f64;
        let result = (batch * m * n) as f64 * 2.0;
        let gemm = self.gemm_time_at(shape, ceiling, operands + result, cluster);
        Some(gemm + self.memory_time(cast * self.fp8_cast_bytes_per_element, cluster))
    }

    /// The share of the device's matmul maximum its GEMMs sustain: the device's own
    /// ([`crate::cluster::MamfTflops::sustained`]) or the default
    /// ([`ComputeParams::gemm_sustained_fraction`]); all of it at a benchmark's clock. Under
    /// a power limit below the device's rating, times the clock share that limit leaves
    /// ([`crate::cluster::GpuSpec::power_clock_share`]), a benchmark's as well.
    pub fn sustained_fraction(&self, cluster: &Cluster) -> f64 {
        let limited = cluster.gpu.power_clock_share();
        if self.benchmark_clock {
            return limited;
        }
        limited
            * cluster
                .gpu
                .mamf_tflops
                .as_ref()
                .and_then(|m| m.sustained)
                .unwrap_or(self.gemm_sustained_fraction)
    }

    /// [`ComputeParams::gemm_time`] against a given ceiling (FLOP/s of the best shape before
    /// the sustained fraction).
    pub(crate) fn gemm_time_at(
        &self,
        shape: GemmShape,
        ceiling: f64,
        bytes: f64,
        cluster: &Cluster,
    ) -> f64 {
        let GemmShape { batch, m, n, k } = shape;
        if batch == 0 || m == 0 || n == 0 || k == 0 {
            return 0.0;
        }
        let peak = ceiling * self.sustained_fraction(cluster);
        let kf = k as f64;
        let mem = bytes / (cluster.hbm_bandwidth() * self.memory_bandwidth_fraction);
        let compute = match cluster.gpu.sms {
            None => shape.flops() * (kf + self.gemm_tile_overhead_k) / kf / peak,
            Some(sms) => {
                let per_sm = peak / sms as f64;
                let mut best = f64::INFINITY;
                for &(bm, bn, eff) in &self.gemm_tiles {
                    let tiles = batch * m.div_ceil(bm as u64) * n.div_ceil(bn as u64);
                    for &split in &self.gemm_split_k {
                        let split = split as u64;
                        if split > 1 && (tiles >= sms as u64 || k < 256 * split) {
                            continue;
                        }
                        let waves = (tiles * split).div_ceil(sms as u64) as f64;
                        let k_part = kf / split as f64 + self.gemm_tile_overhead_k;
                        let mut t = waves * 2.0 * (bm * bn) as f64 * k_part / (per_sm * eff);
                        if split > 1 {
                            // Partial results are written in fp32 and reduced.
                            let partial = (batch * m * n * split) as f64 * 4.0 * 2.0;
                            t += partial
                                / (cluster.hbm_bandwidth() * self.memory_bandwidth_fraction);
                        }
                        best = best.min(t);
                    }
                    let rest = tiles % sms as u64;
                    if self.gemm_stream_k && cluster.gpu.arch.has_warpgroup_mma() && rest > 0 {
                        // Whole waves, then the rest's contraction spread over every SM.
                        let whole = (tiles / sms as u64) as f64;
                        let tile = |k: f64| 2.0 * (bm * bn) as f64 * k / (per_sm * eff);
                        let share = kf * rest as f64 / sms as f64 + self.gemm_tile_overhead_k;
                        let partial = (sms * bm * bn) as f64 * 4.0 * 2.0;
                        let t = whole * tile(kf + self.gemm_tile_overhead_k)
                            + tile(share)
                            + partial / (cluster.hbm_bandwidth() * self.memory_bandwidth_fraction);
                        best = best.min(t);
                    }
                }
                best
            }
        };
        compute.max(mem) + self.kernel_overhead_s
    }

    /// FLOPs, bytes and time of one op given its operand and result types, on one device.
    /// Collectives need the mesh mapping; without one (or with an unknown axis) they are
    /// [`Cost::INFEASIBLE`].
    pub fn op_cost(
        &self,
        op: &Op,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        cluster: &Cluster,
        comm: &CommParams,
        mapping: Option<&MeshMapping>,
    ) -> OpCost {
        let in_bytes: f64 = inputs.iter().map(|t| t.size_bytes() as f64).sum();
        let out_bytes: f64 = outputs.iter().map(|t| t.size_bytes() as f64).sum();
        let out_elems: f64 = outputs.iter().map(|t| t.num_elements() as f64).sum();
        let in0 = inputs.first().copied();
        let memory = |flops: f64, bytes: f64| OpCost {
            flops,
            bytes,
            time: Cost::from_secs(self.memory_time(bytes, cluster)),
            class: OpClass::Memory,
        };
        let collective = |coll: Collective, axes: &[String], bytes: f64| {
            let time = match mapping.map(|m| m.group(axes)) {
                Some(Ok(g)) => comm.collective(coll, bytes, &g, cluster).cost(),
                Some(Err(_)) | None => Cost::INFEASIBLE,
            };
            OpCost {
                flops: 0.0,
                bytes,
                time,
                class: OpClass::Communication,
            }
        };
        match op {
            Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => OpCost::FREE,
            Op::Reshape { .. } => OpCost::FREE,
            Op::Einsum { spec } => match (inputs, outputs) {
                ([l, r], [o]) => {
                    let shape = einsum_shape(spec, l, r);
                    let bytes = in_bytes + out_bytes;
                    OpCost {
                        flops: shape.flops(),
                        bytes,
                        time: Cost::from_secs(self.gemm_time(shape, o.dtype, bytes, cluster)),
                        class: OpClass::Matmul,
                    }
                }
                _ => OpCost {
                    time: Cost::INFEASIBLE,
                    ..OpCost::FREE
                },
            },
            Op::Unary { func } => memory(out_elems * unary_flops(*func), in_bytes + out_bytes),
            Op::Binary { func } => {
                let f = if *func == BinaryOp::Pow { 8.0 } else { 1.0 };
                memory(out_elems * f, in_bytes + out_bytes)
            }
            Op::Compare { .. } | Op::Select => memory(out_elems, in_bytes + out_bytes),
            Op::Cast { .. } => memory(0.0, in_bytes + out_bytes),
            Op::Reduce { .. } => {
                let n = in0.map_or(0.0, |t| t.num_elements() as f64);
                memory(n, in_bytes + out_bytes)
            }
            Op::Softmax { .. } => memory(5.0 * out_elems, in_bytes + out_bytes),
            Op::LayerNorm { .. } => memory(8.0 * out_elems, in_bytes + out_bytes),
            Op::RmsNorm { .. } => memory(5.0 * out_elems, in_bytes + out_bytes),
            // Rows are read from the table and written out; ids are read once.
            Op::Gather => memory(
                0.0,
                2.0 * out_bytes + inputs.get(1).map_or(0.0, |t| t.size_bytes() as f64),
            ),
            // The result is zeroed, then every update row is read and added into it.
            Op::ScatterAdd { .. } => {
                let upd = inputs.get(1).map_or(0.0, |t| t.num_elements() as f64);
                memory(upd, in_bytes + 2.0 * out_bytes)
            }
            Op::Transpose { .. } | Op::Slice { .. } | Op::Concat { .. } => {
                memory(0.0, 2.0 * out_bytes)
            }
            Op::Broadcast { .. } => memory(0.0, in_bytes + out_bytes),
            Op::Rotary { .. } => memory(3.0 * out_elems, in_bytes + out_bytes),
            Op::Attention { causal, .. } => match inputs {
                [q, k, v, ..] => self.attention_cost(q, k, v, *causal, cluster),
                _ => OpCost {
                    time: Cost::INFEASIBLE,
                    ..OpCost::FREE
                },
            },
            // Recomputes the scores, then four more products of the forward's sizes
            // (`g v^T`, `p^T g`, `ds k`, `ds^T q`): five products where the forward has two.
            Op::AttentionBackward { causal, .. } => match inputs {
                [q, k, v, ..] => {
                    let fwd = self.attention_cost(q, k, v, *causal, cluster);
                    let time = match self.attention {
                        AttentionKernel::Unfused => 2.5 * fwd.time.secs(),
                        _ => {
                            let (s, t) = (q.dims().get(1), k.dims().get(1));
                            let keys = t.copied().unwrap_or(1) as f64;
                            self.flash_time(
                                2.5 * fwd.flops,
                                2.0 * fwd.bytes,
                                q.dtype,
                                cluster,
                                true,
                                keys,
                                *causal && s == t,
                            )
                        }
                    };
                    OpCost {
                        flops: 2.5 * fwd.flops,
                        bytes: 2.0 * fwd.bytes,
                        time: Cost::from_secs(time),
                        class: fwd.class,
                    }
                }
                _ => OpCost {
                    time: Cost::INFEASIBLE,
                    ..OpCost::FREE
                },
            },
            Op::MoeRoute { .. } => memory(4.0 * out_elems, in_bytes + out_bytes),
            Op::CrossEntropy => {
                let n = in0.map_or(0.0, |t| t.num_elements() as f64);
                // Two passes over the logits (max and sum of exponentials), then the pick.
                memory(
                    4.0 * n,
                    2.0 * in0.map_or(0.0, |t| t.size_bytes() as f64) + out_bytes,
                )
            }
            Op::SgdUpdate { .. } => memory(4.0 * out_elems, in_bytes + out_bytes),
            Op::AdamWUpdate { .. } => memory(12.0 * out_elems, in_bytes + out_bytes),
            Op::AllReduce { axes, .. } => collective(Collective::AllReduce, axes, in_bytes),
            Op::AllGather { axes, .. } => collective(Collective::AllGather, axes, out_bytes),
            Op::ReduceScatter { axes, .. } => collective(Collective::ReduceScatter, axes, in_bytes),
            Op::AllToAll { axes, .. } => collective(Collective::AllToAll, axes, in_bytes),
            Op::CollectiveBroadcast { axes, .. } => {
                collective(Collective::Broadcast, axes, in_bytes)
            }
            Op::Send { axis, .. } => {
                collective(Collective::SendRecv, std::slice::from_ref(axis), in_bytes)
            }
            // The transfer is charged to the send; the receive only waits.
            Op::Recv { .. } => OpCost {
                class: OpClass::Communication,
                ..OpCost::FREE
            },
            // One kernel: the body's arithmetic, but only the operands read and the results
            // written (the intermediate values never leave registers or shared memory).
            Op::Fusion { body } => {
                let mut types: Vec<TensorType> = body.params.clone();
                let mut flops = 0.0;
                for instr in &body.instrs {
                    let ins: Option<Vec<&TensorType>> =
                        instr.operands.iter().map(|&v| types.get(v)).collect();
                    let Some(ins) = ins else { break };
                    let Ok(mut out) = autopar_ir::infer::infer(&instr.op, &ins, None) else {
                        break;
                    };
                    let Some(out) = out.pop() else { break };
                    flops += self
                        .op_cost(&instr.op, &ins, &[&out], cluster, comm, mapping)
                        .flops;
                    types.push(out);
                }
                memory(flops, in_bytes + out_bytes)
            }
        }
    }

    /// Attention of `q[b, s, hq, d]` against `k[b, t, hkv, d]`, `v[b, t, hkv, dv]`.
    pub fn attention_cost(
        &self,
        q: &TensorType,
        k: &TensorType,
        v: &TensorType,
        causal: bool,
        cluster: &Cluster,
    ) -> OpCost {
        let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
        if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 {
            return OpCost {
                time: Cost::INFEASIBLE,
                ..OpCost::FREE
            };
        }
        let (b, s, hq, d) = (qd[0] as u64, qd[1] as u64, qd[2] as u64, qd[3] as u64);
        let (t, dv) = (kd[1] as u64, vd[3] as u64);
        let elem = q.dtype.size_bytes() as f64;
        let io = (q.size_bytes() + k.size_bytes() + v.size_bytes()) as f64
            + (b * s * hq * dv) as f64 * elem;
        match self.attention {
            AttentionKernel::Unfused => {
                // The IR's attention has no dropout.
                let t_score = self.unfused_attention_forward(
                    AttentionShape {
                        heads: b * hq,
                        s,
                        t,
                        d,
                        dv,
                    },
                    q.dtype,
                    cluster,
                    false,
                );
                let flops = GemmShape::new(b * hq, s, t, d).flops()
                    + GemmShape::new(b * hq, s, dv, t).flops();
                OpCost {
                    flops,
                    bytes: io + (b * hq * s * t) as f64 * elem * 4.0,
                    time: Cost::from_secs(t_score),
                    class: OpClass::Matmul,
                }
            }
            AttentionKernel::Flash | AttentionKernel::Flash1 | AttentionKernel::Fused => {
                let masked = causal && s == t;
                let frac = if masked { 0.5 } else { 1.0 };
                let flops = frac
                    * (GemmShape::new(b * hq, s, t, d).flops()
                        + GemmShape::new(b * hq, s, dv, t).flops());
                let time = self.flash_time(flops, io, q.dtype, cluster, false, t as f64, masked);
                OpCost {
                    flops,
                    bytes: io,
                    time: Cost::from_secs(time),
                    class: OpClass::Matmul,
                }
            }
        }
    }

    /// Fraction of the dense peak the profile's fused attention kernel reaches on the device,
    /// in the forward or the `backward` ([`AttentionFractions`]); the unfused attention's
    /// GEMMs are priced as GEMMs, so it has none (FlashAttention 2's is returned).
    pub fn attention_fraction(&self, cluster: &Cluster, backward: bool) -> f64 {
        let f = &self.attention_fractions;
        let pass = usize::from(backward);
        let newer = cluster.gpu.arch.has_warpgroup_mma();
        let legacy = if newer { f.legacy_on_newer_arch } else { 1.0 };
        match self.attention {
            AttentionKernel::Flash1 => f.flash1[pass] * legacy,
            AttentionKernel::Fused if newer => f.native[pass],
            AttentionKernel::Flash | AttentionKernel::Fused | AttentionKernel::Unfused => {
                f.flash2[pass] * legacy
            }
        }
    }

    /// How much longer than its FLOPs at the kernel's fraction a fused attention call over
    /// `keys` keys takes: every query block (a CTA of the forward; a key block's CTA in the
    /// backward, symmetrically) pays [`ComputeParams::attention_block_overhead`] key blocks
    /// of [`ATTENTION_BLOCK`] beside those it works through, and under a causal mask it works
    /// through half the keys on average, the diagonal block whole where half is used.
    ///
    /// FlashAttention 1 is left at its flat fraction: it parallelises over batch and heads,
    /// its curve in the same figure is shallower (55 to 83 TFLOP/s, causal, head dim 128),
    /// and llm-foundry's rows, which run it, show no slowdown at 512 and 1024 tokens.
    pub fn attention_block_factor(&self, keys: f64, causal: bool) -> f64 {
        if self.attention == AttentionKernel::Flash1 {
            return 1.0;
        }
        let blocks = (keys / ATTENTION_BLOCK).max(1.0);
        let (useful, diagonal) = match causal {
            true => (blocks / 2.0, 0.5),
            false => (blocks, 0.0),
        };
        1.0 + (self.attention_block_overhead + diagonal) / useful
    }

    /// Seconds for a fused attention kernel doing `flops` with `io` bytes of inputs/outputs,
    /// in the forward or the `backward`, each call over `keys` keys (with or without a
    /// `causal` mask; [`ComputeParams::attention_block_factor`]), at the clock a power limit
    /// leaves ([`crate::cluster::GpuSpec::power_clock_share`]).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_time(
        &self,
        flops: f64,
        io: f64,
        dtype: DType,
        cluster: &Cluster,
        backward: bool,
        keys: f64,
        causal: bool,
    ) -> f64 {
        let peak = cluster.peak_flops(dtype)
            * self.attention_fraction(cluster, backward)
            * cluster.gpu.power_clock_share();
        (flops / peak * self.attention_block_factor(keys, causal))
            .max(io / (cluster.hbm_bandwidth() * self.memory_bandwidth_fraction))
            + self.kernel_overhead_s
    }

    /// Forward of unfused attention for `heads` (batch x heads) score matrices of `s x t`:
    /// `q k^T`, fused scale-mask-softmax (read and write the scores), with `dropout` a
    /// dropout (read scores, write scores and a one-byte mask), then `p v`.
    pub fn unfused_attention_forward(
        &self,
        shape: AttentionShape,
        dtype: DType,
        cluster: &Cluster,
        dropout: bool,
    ) -> f64 {
        let AttentionShape { heads, s, t, d, dv } = shape;
        let e = dtype.size_bytes() as f64;
        let scores = (heads * s * t) as f64;
        let qk = GemmShape::new(heads, s, t, d);
        let pv = GemmShape::new(heads, s, dv, t);
        let qk_bytes = ((heads * s * d) + (heads * t * d)) as f64 * e + scores * e;
        let pv_bytes = scores * e + ((heads * t * dv) + (heads * s * dv)) as f64 * e;
        self.gemm_time(qk, dtype, qk_bytes, cluster)
            + self.score_memory_time(scores * 2.0 * e, cluster)
            + match dropout {
                true => self.score_memory_time(scores * (2.0 * e + 1.0), cluster),
                false => 0.0,
            }
            + self.gemm_time(pv, dtype, pv_bytes, cluster)
    }
}

/// FLOPs per element of a unary function (transcendentals count as several).
fn unary_flops(f: UnaryOp) -> f64 {
    match f {
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Square => 1.0,
        UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => 2.0,
        UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sigmoid | UnaryOp::Tanh => 4.0,
        UnaryOp::Silu => 5.0,
        UnaryOp::Gelu => 8.0,
        // A tanh and about a dozen multiplies and adds.
        UnaryOp::GeluGrad => 16.0,
        // erf as a rational approximation: about twice a tanh.
        UnaryOp::Erf => 8.0,
        UnaryOp::GeluErf => 11.0,
        // A range reduction and a polynomial, about twice a tanh.
        UnaryOp::Sin | UnaryOp::Cos => 8.0,
    }
}

/// The GEMM an einsum performs: batch labels, free labels of each side, contracted labels.
pub fn einsum_shape(spec: &EinsumSpec, lhs: &TensorType, rhs: &TensorType) -> GemmShape {
    let size = |labels: &[char], dims: &[usize], c: char| -> u64 {
        labels
            .iter()
            .position(|&l| l == c)
            .and_then(|i| dims.get(i))
            .map_or(1, |&d| d as u64)
    };
    let (ld, rd) = (lhs.dims(), rhs.dims());
    let mut shape = GemmShape::new(1, 1, 1, 1);
    for &c in &spec.lhs {
        let s = size(&spec.lhs, ld, c);
        if spec.rhs.contains(&c) {
            if spec.out.contains(&c) {
                shape.batch *= s;
            } else {
                shape.k *= s;
            }
        } else {
            shape.m *= s;
        }
    }
    for &c in &spec.rhs {
        if !spec.lhs.contains(&c) {
            shape.n *= size(&spec.rhs, rd, c);
        }
    }
    shape
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster;
    use autopar_ir::{OpKind, ReduceKind};

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-9 * b.abs().max(1e-12), "{a} vs {b}");
    }

    #[test]
    fn big_gemms_run_near_peak_and_skinny_ones_far_below() {
        let c = cluster::dgx_a100(1);
        let p = ComputeParams::default();
        let eff = |s: GemmShape| {
            let bytes = 2.0 * (s.batch * (s.m * s.k + s.k * s.n + s.m * s.n)) as f64;
            s.flops() / p.gemm_time(s, DType::BF16, bytes, &c) / 312e12
        };
        let big = eff(GemmShape::new(1, 8192, 8192, 8192));
        assert!((0.65..0.76).contains(&big), "{big}");
        // The ceiling is the device's: the H100 sustains a smaller share of its peak.
        let h = cluster::dgx_h100(1);
        let s = GemmShape::new(1, 8192, 8192, 8192);
        let h_eff = s.flops() / p.gemm_time(s, DType::BF16, 0.0, &h) / 989e12;
        assert!(h_eff < big - 0.03, "{h_eff} vs {big}");
        let cast = (2 * 8192 * 8192) as f64;
        let fp8 = p
            .fp8_gemm_time(s, cast, Fp8Recipe::Tensor, &h)
            .map(|t| s.flops() / t / 989e12);
        assert!(fp8.is_some_and(|f| f > 1.2 * h_eff), "{fp8:?}");
        assert_eq!(p.fp8_gemm_time(s, cast, Fp8Recipe::Tensor, &c), None);
        let skinny = eff(GemmShape::new(1, 16, 8192, 8192));
        assert!(skinny < 0.1, "{skinny}");
        let short_k = eff(GemmShape::new(32, 2048, 2048, 64));
        assert!(short_k < big * 0.8, "{short_k}");
        let tiny = eff(GemmShape::new(1, 64, 64, 64));
        assert!(tiny < 0.01, "{tiny}");
    }

    /// A Transformer Engine fp8 GEMM pays for the casts its caller says it is first to read
    /// (4 bytes per element: the bf16 read, the fp8 copy and its transpose), and block
    /// scaling costs GEMM rate on Hopper only.
    #[test]
    fn fp8_casts_are_counted_per_tensor_and_block_scaling_per_architecture() {
        let p = ComputeParams::default();
        let h = cluster::dgx_h100(1);
        let s = GemmShape::new(1, 8192, 8192, 8192);
        let bare = p.fp8_gemm_time(s, 0.0, Fp8Recipe::Tensor, &h).unwrap();
        let elements = (2 * 8192 * 8192) as f64;
        let cast = p.fp8_gemm_time(s, elements, Fp8Recipe::Tensor, &h).unwrap();
        let bandwidth = h.hbm_bandwidth() * p.memory_bandwidth_fraction;
        close(
            cast - bare,
            elements * 4.0 / bandwidth + p.kernel_overhead_s,
        );
        // A compute-bound GEMM under block scaling runs at the fraction of the rate (the
        // stream-K partial tiles' memory traffic aside).
        let block = p.fp8_gemm_time(s, 0.0, Fp8Recipe::Blockwise, &h).unwrap();
        let ratio = bare / block;
        assert!((ratio - p.blockwise_fp8_fraction).abs() < 0.01, "{ratio}");
        let b = cluster::dgx_b200(1);
        assert_eq!(
            p.fp8_gemm_time(s, 0.0, Fp8Recipe::Blockwise, &b),
            p.fp8_gemm_time(s, 0.0, Fp8Recipe::Tensor, &b)
        );
    }

    /// A long run keeps the device's own share of its matmul maximum where its description
    /// gives one (700 W Hopper), the default elsewhere, and all of it at a benchmark's clock;
    /// a cluster file may state it.
    #[test]
    fn sustained_share_is_the_devices_own() {
        let p = ComputeParams::default();
        let h100 = cluster::Cluster::preset("dgx-h100:nodes=1").unwrap();
        let h200 = cluster::Cluster::preset("hgx-h200:nodes=1").unwrap();
        let a100 = cluster::Cluster::preset("dgx-a100:nodes=1").unwrap();
        assert_eq!(p.sustained_fraction(&h100), cluster::HOPPER_700W_SUSTAINED);
        assert_eq!(p.sustained_fraction(&h200), cluster::HOPPER_700W_SUSTAINED);
        assert_eq!(p.sustained_fraction(&a100), p.gemm_sustained_fraction);
        let bench = ComputeParams {
            benchmark_clock: true,
            ..ComputeParams::default()
        };
        assert_eq!(bench.sustained_fraction(&h100), 1.0);
        // The GEMM slows in proportion on a compute-bound shape.
        let shape = GemmShape::new(1, 8192, 8192, 8192);
        let bytes = 3.0 * 2.0 * 8192.0 * 8192.0;
        let ratio = p.gemm_time(shape, DType::BF16, bytes, &h100)
            / bench.gemm_time(shape, DType::BF16, bytes, &h100);
        assert!(
            (ratio - 1.0 / cluster::HOPPER_700W_SUSTAINED).abs() < 0.01,
            "{ratio}"
        );
        let text = h100.to_toml();
        let line = format!("sustained = {}", cluster::HOPPER_700W_SUSTAINED);
        assert!(text.contains(&line), "{text}");
        assert_eq!(cluster::Cluster::from_toml(&text).unwrap(), h100);
    }

    /// Under a power limit the GEMMs and the attention kernels both run at the clock share
    /// it leaves, a benchmark's GEMMs as well; memory-bound work is untouched.
    #[test]
    fn a_power_limit_slows_the_tensor_cores_only() {
        let p = ComputeParams::default();
        let full = cluster::Cluster::preset("dgx-h100:nodes=1").unwrap();
        let capped = cluster::Cluster::preset("dgx-h100:nodes=1,power=400").unwrap();
        let share = (400.0f64 / 700.0).cbrt();
        let sustained = p.sustained_fraction(&capped) / p.sustained_fraction(&full);
        assert!((sustained - share).abs() < 1e-12, "{sustained}");
        let bench = ComputeParams {
            benchmark_clock: true,
            ..ComputeParams::default()
        };
        assert!((bench.sustained_fraction(&capped) - share).abs() < 1e-12);
        let flash = |c: &Cluster| p.flash_time(1e15, 1e6, DType::BF16, c, true, 8192.0, true);
        let ratio = (flash(&capped) - p.kernel_overhead_s) / (flash(&full) - p.kernel_overhead_s);
        assert!((ratio - 1.0 / share).abs() < 1e-9, "{ratio}");
        assert_eq!(p.memory_time(1e9, &capped), p.memory_time(1e9, &full));
    }

    /// On Hopper a partial last wave is balanced stream-K style: the MAMF finder's best fp8
    /// shape on H200 (160 tiles of 256x128 on 132 SMs) runs within a few percent of the
    /// ceiling, where whole-tile waves (Ampere, or with stream-K off) lose about a fifth.
    #[test]
    fn stream_k_balances_the_last_wave_on_hopper() {
        let h = cluster::Cluster::preset("hgx-h200:nodes=1").unwrap();
        let p = ComputeParams {
            benchmark_clock: true,
            ..ComputeParams::default()
        };
        let shape = GemmShape::new(1, 1280, 4096, 12032);
        let bytes = (1280 * 12032 + 12032 * 4096) as f64 + 2.0 * (1280 * 4096) as f64;
        let ceiling = 1453.4e12;
        let rate = |p: &ComputeParams, c: &Cluster| {
            shape.flops() / p.gemm_time_at(shape, ceiling, bytes, c) / ceiling
        };
        let balanced = rate(&p, &h);
        assert!((0.85..1.0).contains(&balanced), "{balanced}");
        let waves = rate(
            &ComputeParams {
                gemm_stream_k: false,
                ..p.clone()
            },
            &h,
        );
        assert!(waves < 0.83, "{waves}");
        let mut ampere = h.clone();
        ampere.gpu.arch = crate::cluster::GpuArch::Ampere;
        assert!((rate(&p, &ampere) - waves).abs() < 1e-12);
    }

    /// The block factor with the long-sequence fractions reproduces the published
    /// sequence-length curves: FlashAttention 2's causal forward+backward on A100 and
    /// FlashAttention 3's causal forward on H100 (head dim 128), within 10%; FlashAttention
    /// 1 stays flat.
    #[test]
    fn fused_attention_slows_down_on_short_sequences() {
        let a100 = crate::cluster::dgx_a100(1);
        let h100 = crate::cluster::dgx_h100(1);
        let rate = |p: &ComputeParams, c: &Cluster, seq: f64, backward: bool| {
            let f = 1e15;
            f / 1e12
                / (p.flash_time(f, 0.0, DType::BF16, c, backward, seq, true) - p.kernel_overhead_s)
        };
        let fa2 = ComputeParams {
            attention: AttentionKernel::Flash,
            ..ComputeParams::default()
        };
        let seqs = [512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
        // Forward + backward: 1 unit of FLOPs forward, 2.5 backward.
        let fwd_bwd =
            |s: f64| 3.5 / (1.0 / rate(&fa2, &a100, s, false) + 2.5 / rate(&fa2, &a100, s, true));
        let within = |kernel: &str, s: f64, m: f64, measured: f64| {
            assert!(
                (m / measured - 1.0).abs() < 0.10,
                "{kernel} {s}: {m} vs {measured}"
            );
        };
        for (s, measured) in seqs.iter().zip([99.0, 133.0, 155.0, 173.0, 182.0, 189.0]) {
            within("FA2", *s, fwd_bwd(*s), measured);
        }
        let fa3 = ComputeParams {
            attention: AttentionKernel::Fused,
            ..ComputeParams::default()
        };
        for (s, measured) in seqs.iter().zip([292.0, 423.0, 521.0, 579.0, 602.0, 616.0]) {
            within("FA3", *s, rate(&fa3, &h100, *s, false), measured);
        }
        let fa1 = ComputeParams {
            attention: AttentionKernel::Flash1,
            ..ComputeParams::default()
        };
        assert_eq!(
            rate(&fa1, &a100, 512.0, false),
            rate(&fa1, &a100, 16384.0, false)
        );
        // Without a mask, a query block's fixed cost is spread over twice the key blocks.
        assert!(
            fa2.attention_block_factor(1024.0, false) < fa2.attention_block_factor(1024.0, true)
        );
    }

    #[test]
    fn einsum_shapes() {
        let spec: EinsumSpec = "bsh,hf->bsf".parse().unwrap();
        let l = TensorType::new(DType::BF16, [2, 3, 4]);
        let r = TensorType::new(DType::BF16, [4, 5]);
        assert_eq!(einsum_shape(&spec, &l, &r), GemmShape::new(1, 6, 5, 4));
        let spec: EinsumSpec = "bhsd,bhtd->bhst".parse().unwrap();
        let q = TensorType::new(DType::BF16, [2, 4, 8, 16]);
        let k = TensorType::new(DType::BF16, [2, 4, 9, 16]);
        assert_eq!(einsum_shape(&spec, &q, &k), GemmShape::new(8, 8, 9, 16));
    }

    /// One op of every kind gets a cost; memory-bound ops scale with bytes, collectives need a
    /// mapping.
    #[test]
    fn every_op_kind_is_costed() {
        let c = cluster::dgx_a100(1);
        let p = ComputeParams::default();
        let comm = CommParams::default();
        let mapping = MeshMapping::new(&[("tp", 8)], &c).unwrap();
        let x = TensorType::new(DType::BF16, [4, 1024, 1024]);
        let axes = vec!["tp".to_string()];
        let mut seen = std::collections::BTreeSet::new();
        let ops: Vec<Op> = vec![
            Op::Unary {
                func: UnaryOp::Gelu,
            },
            Op::Binary {
                func: BinaryOp::Add,
            },
            Op::Softmax { dim: 2 },
            Op::AllReduce {
                axes: axes.clone(),
                reduce: ReduceKind::Sum,
            },
            Op::AllGather {
                axes: axes.clone(),
                dim: 0,
            },
            Op::ReduceScatter {
                axes: axes.clone(),
                dim: 0,
                reduce: ReduceKind::Sum,
            },
            Op::AllToAll {
                axes: axes.clone(),
                split_dim: 0,
                concat_dim: 1,
            },
            Op::CollectiveBroadcast {
                axes: axes.clone(),
                root: 0,
            },
            Op::Send {
                axis: "tp".into(),
                shift: 1,
            },
        ];
        for op in &ops {
            seen.insert(op.kind());
            let cost = p.op_cost(op, &[&x, &x], &[&x], &c, &comm, Some(&mapping));
            assert!(cost.time > Cost::ZERO && cost.time.is_feasible(), "{op:?}");
            if op.is_communication() {
                assert_eq!(cost.class, OpClass::Communication);
                let without = p.op_cost(op, &[&x, &x], &[&x], &c, &comm, None);
                assert_eq!(without.time, Cost::INFEASIBLE);
            } else {
                assert_eq!(cost.class, OpClass::Memory);
            }
        }
        let small = TensorType::new(DType::BF16, [4, 16, 1024]);
        let add = Op::Binary {
            func: BinaryOp::Add,
        };
        assert!(
            p.op_cost(&add, &[&small, &small], &[&small], &c, &comm, None)
                .time
                < p.op_cost(&add, &[&x, &x], &[&x], &c, &comm, None).time
        );
        // Attention: flash skips the masked half.
        let q = TensorType::new(DType::BF16, [1, 2048, 16, 128]);
        let a = Op::Attention {
            causal: true,
            scale: 0.1,
        };
        let flash = p.op_cost(&a, &[&q, &q, &q], &[&q], &c, &comm, None);
        let unfused = ComputeParams {
            attention: AttentionKernel::Unfused,
            ..p.clone()
        }
        .op_cost(&a, &[&q, &q, &q], &[&q], &c, &comm, None);
        assert_eq!(flash.flops * 2.0, unfused.flops);
        assert!(OpKind::ALL.len() >= seen.len());
    }

    #[test]
    fn a_fusion_moves_only_its_operands_and_results() {
        use autopar_ir::{BinaryOp, FusedInstr, FusionBody, UnaryOp};
        let c = cluster::dgx_a100(1);
        let p = ComputeParams::default();
        let comm = CommParams::default();
        let x = TensorType::new(DType::BF16, [4096, 4096]);
        let (add, gelu) = (
            Op::Binary {
                func: BinaryOp::Add,
            },
            Op::Unary {
                func: UnaryOp::Gelu,
            },
        );
        let fused = Op::Fusion {
            body: FusionBody {
                params: vec![x.clone(), x.clone()],
                instrs: vec![
                    FusedInstr {
                        op: add.clone(),
                        operands: vec![0, 1],
                    },
                    FusedInstr {
                        op: gelu.clone(),
                        operands: vec![2],
                    },
                ],
                results: vec![3],
            },
        };
        let f = p.op_cost(&fused, &[&x, &x], &[&x], &c, &comm, None);
        let a = p.op_cost(&add, &[&x, &x], &[&x], &c, &comm, None);
        let g = p.op_cost(&gelu, &[&x], &[&x], &c, &comm, None);
        // The same arithmetic, one intermediate fewer written and read.
        assert_eq!(f.flops, a.flops + g.flops);
        assert_eq!(f.bytes, 3.0 * x.size_bytes() as f64);
        assert_eq!(a.bytes + g.bytes, 5.0 * x.size_bytes() as f64);
        assert!(f.time < a.time + g.time);
    }
}
