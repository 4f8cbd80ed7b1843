//! CUDA C code generation: every op of a rank program becomes a [`NodeProgram`], a short list
//! of [`Step`]s (kernel launches, cuBLASLt GEMMs, copies), each kernel a self-contained
//! translation unit with the node's shapes baked in and a name derived from a hash of its
//! text, so that identical kernels are compiled once and can be cached by name.
//!
//! # How ops map to kernels
//!
//! * Element-wise, compare, select, cast, reduce, broadcast, reshape and constant ops are
//!   one-instruction fusion bodies; softmax, layer and RMS norm and the SGD/AdamW updates are
//!   bodies too, written out in f32 ([`decompose`]); every body goes through [`fusion`]:
//!   pure element-wise bodies read and write 128-bit vectors, bodies with reductions over
//!   trailing dims run one row per warp (rows up to 1024 elements) or per block, and
//!   broadcasts are index arithmetic.
//! * Transpose, slice, concat, gather and scatter-add are copy kernels ([`layout`]); rotary,
//!   cross-entropy and MoE routing have their own ([`special`]); attention forward and backward
//!   are tiled kernels with online softmax ([`attention`]).
//! * Einsums are cuBLASLt GEMMs over `[batch, m, k] x [batch, k, n]`, with permute kernels
//!   where the operands or the result are laid out otherwise.
//!
//! # Where results can differ from the reference interpreter
//!
//! The reference computes in f64 and rounds each result to its declared dtype. Kernels
//! compute in f32 (fast math off: IEEE division and square root, `expf`/`logf`/`tanhf` of
//! CUDA's math library, within 2 ulp of the exact value; FMA contraction allowed) and round
//! results to the declared dtype with round-to-nearest-even, as the reference does. So:
//!
//! * f32 results differ by a few ulp per op, more where errors compound (reductions summed in
//!   another order, in f32: relative error about `n * 2^-24` for a row of `n`); bf16 and f16
//!   results are the reference's rounded value or a neighbour of it.
//! * Max and min (element-wise and reductions) propagate NaN as the reference does; integer
//!   arithmetic wraps as it does; integer division by zero, an id outside a table (gather,
//!   scatter-add, cross-entropy targets) are errors in the reference and give 0 (NaN for a
//!   cross-entropy loss) here.
//! * Scatter-add accumulates with atomics in f32: its sums are not bit-reproducible.
//! * A casts from i64 to a float goes straight to f32 (the reference goes through f64).
//!
//! `--verify` therefore compares with `Tolerance::for_compute`'s relative tolerances (1e-3
//! for f32, 3e-2 for bf16/f16 compute), not bit equality.

pub mod attention;
pub mod decompose;
pub mod fusion;
pub mod layout;
pub mod prelude;
pub mod special;

use std::fmt::Write as _;

use autopar_ir::infer::infer;
use autopar_ir::{DType, FusedInstr, FusionBody, Graph, NodeId, Op, TensorType};
use sha2::{Digest, Sha256};

use crate::error::CudaError;

/// Threads per block of the element-wise and copy kernels.
pub const BLOCK: u32 = 256;

/// The most blocks a grid-stride kernel launches (each thread loops over the rest).
pub const MAX_GRID: u64 = 1 << 20;

/// One pointer argument of a kernel or step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// The node's operand with this index.
    Operand(usize),
    /// The node's result with this index.
    Result(usize),
    /// The node's scratch memory at this byte offset (see [`NodeProgram::scratch_bytes`]).
    Scratch(u64),
}

/// A generated kernel: its source and how to launch it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The `extern "C"` entry point, `ap_<what>_<hash>`: the same text gets the same name.
    pub name: String,
    /// The whole translation unit (prelude and kernel).
    pub source: String,
    /// Grid dims.
    pub grid: [u32; 3],
    /// Block dims.
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
    /// The kernel's pointer arguments, in order.
    pub args: Vec<Arg>,
}

/// A contiguous row-major batched GEMM `out[b, m, n] = lhs[b, m, k] · rhs[b, k, n]`, f32
/// accumulation, operands and result of one float dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// Batch count.
    pub batch: u64,
    /// Rows of the result.
    pub m: u64,
    /// Columns of the result.
    pub n: u64,
    /// The contracted length.
    pub k: u64,
    /// The dtype of operands and result.
    pub dtype: DType,
    /// Where the left operand is.
    pub lhs: Arg,
    /// Where the right operand is.
    pub rhs: Arg,
    /// Where the result goes.
    pub out: Arg,
}

/// One step of a node's program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Launch a generated kernel.
    Launch(Kernel),
    /// A cuBLASLt GEMM.
    Gemm(Gemm),
    /// Fill `bytes` bytes at `at` with zeros (`cuMemsetD8Async`).
    Zero {
        /// Where.
        at: Arg,
        /// How many bytes.
        bytes: u64,
    },
}

/// What executing one compute node takes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeProgram {
    /// The steps, in order, all on the rank's compute stream.
    pub steps: Vec<Step>,
    /// Scratch device memory the steps use (offsets in [`Arg::Scratch`]).
    pub scratch_bytes: u64,
}

impl NodeProgram {
    /// The kernels among the steps.
    pub fn kernels(&self) -> impl Iterator<Item = &Kernel> {
        self.steps.iter().filter_map(|s| match s {
            Step::Launch(k) => Some(k),
            Step::Gemm(_) | Step::Zero { .. } => None,
        })
    }

    fn launch(kernel: Kernel) -> Self {
        NodeProgram {
            steps: vec![Step::Launch(kernel)],
            scratch_bytes: 0,
        }
    }
}

/// What the backend does for a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeKernels {
    /// A parameter or input: its value is uploaded, nothing runs.
    Source,
    /// A collective or point-to-point op: the backend's communicator runs it.
    Communication,
    /// A compute node.
    Compute(NodeProgram),
}

/// The program of a node with operands of types `operands` and results of types `results`.
pub fn kernels_for_node(
    op: &Op,
    operands: &[&TensorType],
    results: &[TensorType],
) -> Result<NodeKernels, CudaError> {
    let compute = |p: Result<NodeProgram, CudaError>| p.map(NodeKernels::Compute);
    let single = |body: FusionBody| compute(fusion::program(&body));
    match op {
        Op::Parameter { .. } | Op::Input { .. } => Ok(NodeKernels::Source),
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => Ok(NodeKernels::Communication),
        Op::Constant { .. }
        | Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::Broadcast { .. }
        | Op::Reshape { .. } => single(one_instruction(op, operands)),
        Op::Fusion { body } => single(body.clone()),
        Op::Softmax { dim } => single(decompose::softmax(*dim, operands[0])?),
        Op::LayerNorm { eps } => single(decompose::layer_norm(*eps, operands)?),
        Op::RmsNorm { eps } => single(decompose::rms_norm(*eps, operands)?),
        Op::SgdUpdate {
            lr,
            momentum,
            weight_decay,
        } => single(decompose::sgd(*lr, *momentum, *weight_decay, operands)?),
        Op::AdamWUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => single(decompose::adamw(
            decompose::AdamW {
                lr: *lr,
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
            },
            operands,
        )?),
        Op::Einsum { spec } => compute(layout::einsum(spec, operands, &results[0])),
        Op::Transpose { perm } => compute(
            layout::permute(operands[0], perm, Arg::Operand(0), Arg::Result(0))
                .map(NodeProgram::launch),
        ),
        Op::Slice { dim, start, end } => compute(
            layout::slice(*dim, *start, *end, operands[0], &results[0]).map(NodeProgram::launch),
        ),
        Op::Concat { dim } => {
            compute(layout::concat(*dim, operands, &results[0]).map(NodeProgram::launch))
        }
        Op::Gather => compute(layout::gather(operands, &results[0]).map(NodeProgram::launch)),
        Op::ScatterAdd { .. } => compute(layout::scatter_add(operands, &results[0])),
        Op::Rotary { base } => compute(special::rotary(*base, operands).map(NodeProgram::launch)),
        Op::CrossEntropy => {
            compute(special::cross_entropy(operands, &results[0]).map(NodeProgram::launch))
        }
        Op::MoeRoute {
            top_k,
            capacity,
            normalize,
        } => compute(special::moe_route(
            *top_k,
            *capacity,
            *normalize,
            operands,
            &results[0],
        )),
        Op::Attention { causal, scale } => compute(
            attention::forward(*causal, *scale, operands, &results[0]).map(NodeProgram::launch),
        ),
        Op::AttentionBackward { causal, scale } => {
            compute(attention::backward(*causal, *scale, operands))
        }
    }
}

/// The programs of every node of `graph`, in topological order (sources and communication
/// included, so that the list lines up with the graph's nodes).
pub fn kernels_for_graph(graph: &Graph) -> Result<Vec<(NodeId, NodeKernels)>, CudaError> {
    let order = graph
        .topo_order()
        .map_err(|e| CudaError::Runtime(e.into()))?;
    let mut out = Vec::with_capacity(order.len());
    for id in order {
        let node = graph.node(id);
        let operands: Vec<&TensorType> = node.inputs.iter().map(|&v| graph.ty(v)).collect();
        let results: Vec<TensorType> = node.outputs.iter().map(|&v| graph.ty(v).clone()).collect();
        out.push((id, kernels_for_node(&node.op, &operands, &results)?));
    }
    Ok(out)
}

/// The body `^n = op ^0, ^1, ...; yield ^n` of one op over operands of `types`.
pub fn one_instruction(op: &Op, types: &[&TensorType]) -> FusionBody {
    FusionBody {
        params: types.iter().map(|t| (*t).clone()).collect(),
        instrs: vec![FusedInstr {
            op: op.clone(),
            operands: (0..types.len()).collect(),
        }],
        results: vec![types.len()],
    }
}

/// The type of every value of `body` (operands, then each instruction's result), each
/// instruction checked by the IR's typing rule.
pub fn body_types(body: &FusionBody) -> Result<Vec<TensorType>, CudaError> {
    let mut types = body.params.clone();
    for instr in &body.instrs {
        let args: Vec<&TensorType> = instr.operands.iter().map(|&v| &types[v]).collect();
        let mut out = infer(&instr.op, &args, None).map_err(|e| CudaError::Runtime(e.into()))?;
        if out.len() != 1 {
            return Err(unsupported(
                &instr.op,
                &args,
                "a fusion instruction has one result",
            ));
        }
        types.push(out.remove(0));
    }
    Ok(types)
}

/// The C storage type of a dtype.
pub fn storage(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::F16 => "ap_f16",
        DType::BF16 => "ap_bf16",
        DType::I32 => "int",
        DType::I64 => "ap_i64",
        DType::Bool => "ap_bool",
    }
}

/// The C register type values of a dtype compute in.
pub fn register(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => "float",
        DType::I32 => "int",
        DType::I64 => "ap_i64",
        DType::Bool => "bool",
    }
}

/// C that reads storage expression `x` of `dtype` into its register type.
pub fn load(dtype: DType, x: &str) -> String {
    match dtype {
        DType::F32 | DType::I32 | DType::I64 => x.to_string(),
        DType::F16 => format!("ap_f16_to_f32({x})"),
        DType::BF16 => format!("ap_bf16_to_f32({x})"),
        DType::Bool => format!("({x} != 0)"),
    }
}

/// C that converts register expression `x` of `dtype` to its storage type.
pub fn store(dtype: DType, x: &str) -> String {
    match dtype {
        DType::F32 | DType::I32 | DType::I64 => x.to_string(),
        DType::F16 => format!("ap_f32_to_f16({x})"),
        DType::BF16 => format!("ap_f32_to_bf16({x})"),
        DType::Bool => format!("(ap_bool)({x} ? 1 : 0)"),
    }
}

/// C that rounds a float register expression to `dtype` (identity for f32 and non-floats).
pub fn round(dtype: DType, x: &str) -> String {
    match dtype {
        DType::F16 => format!("ap_round_f16({x})"),
        DType::BF16 => format!("ap_round_bf16({x})"),
        DType::F32 | DType::I32 | DType::I64 | DType::Bool => x.to_string(),
    }
}

/// A C literal of `value` in the register type of `dtype`.
pub fn literal(dtype: DType, value: f64) -> String {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => float_literal(value),
        DType::I32 => format!("{}", value as i32),
        DType::I64 => format!("{}ll", value as i64),
        DType::Bool => (if value != 0.0 { "true" } else { "false" }).to_string(),
    }
}

/// A C `float` literal (infinities and NaN as bit patterns), the f64 rounded to f32.
pub fn float_literal(value: f64) -> String {
    let v = value as f32;
    if v.is_nan() {
        "__int_as_float(0x7fc00000)".to_string()
    } else if v.is_infinite() {
        if v > 0.0 {
            "__int_as_float(0x7f800000)".to_string()
        } else {
            "__int_as_float((int)0xff800000u)".to_string()
        }
    } else {
        // `{:e}` prints the shortest digits that read back as the same f32.
        format!("{v:e}f")
    }
}

/// Row-major strides of `dims`.
pub fn strides(dims: &[usize]) -> Vec<u64> {
    let mut s = vec![1u64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1] as u64;
    }
    s
}

/// Blocks for `work` items at `per_block` items a block, at least 1, at most [`MAX_GRID`].
pub fn blocks_for(work: u64, per_block: u64) -> u32 {
    work.div_ceil(per_block.max(1)).clamp(1, MAX_GRID) as u32
}

/// Finishes a kernel: `body` is its text with `KERNEL` where the name goes; the name is
/// `ap_<what>_` and the first 16 hex digits of the SHA-256 of that text.
pub fn finish(
    what: &str,
    body: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    args: Vec<Arg>,
) -> Kernel {
    let digest = Sha256::digest(body.as_bytes());
    let mut name = format!("ap_{what}_");
    for b in &digest[..8] {
        let _ = write!(name, "{b:02x}");
    }
    let source = format!("{}\n{}", prelude::PRELUDE, body.replace("KERNEL", &name));
    Kernel {
        name,
        source,
        grid,
        block,
        shared_bytes,
        args,
    }
}

/// The operand types as text, for errors.
pub fn types_text(types: &[&TensorType]) -> String {
    types
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// An [`CudaError::Unsupported`] for `op` on `types`.
pub fn unsupported(op: &Op, types: &[&TensorType], detail: impl Into<String>) -> CudaError {
    CudaError::Unsupported {
        op: op.name(),
        operands: types_text(types),
        detail: detail.into(),
    }
}

/// Refuses anything but a float dtype.
pub fn require_float(op: &'static str, dtype: DType) -> Result<(), CudaError> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(CudaError::UnsupportedDType { op, dtype })
    }
}
