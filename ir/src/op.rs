//! The op set of the IR: every operation a graph node can perform, with its attributes.
//!
//! Ops are plain data. Their typing rules live in [`crate::infer`], their semantics in the
//! reference interpreter (`autopar-runtime`). Every pass matches on [`Op`] exhaustively, so
//! adding a variant forces a decision in each of them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::placement::ReduceKind;
use crate::types::{DType, Shape, TensorType};

/// How a parameter is initialised (the reference interpreter draws the values, or takes
/// them as given).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// Normal with mean 0 and the given standard deviation. Text: `normal(0.02)`.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All zeros. Text: `zeros`.
    Zeros,
    /// All ones. Text: `ones`.
    Ones,
    /// The given values, row-major (weights imported from a checkpoint or an ONNX file).
    /// Text: `values("3f800000...")`, the bits of each `f32` in 8 hex digits.
    Values(Values),
}

/// The row-major `f32` values of an [`Init::Values`] parameter, shared (cloning a graph or a
/// node does not copy them). Its `Debug` form names only the length, so that debugging
/// output stays small.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "Vec<f32>", into = "Vec<f32>")]
pub struct Values(std::sync::Arc<[f32]>);

impl From<Vec<f32>> for Values {
    fn from(v: Vec<f32>) -> Self {
        Values(v.into())
    }
}

impl From<Values> for Vec<f32> {
    fn from(v: Values) -> Self {
        v.0.to_vec()
    }
}

impl Values {
    /// Wraps `values`.
    pub fn new(values: impl Into<std::sync::Arc<[f32]>>) -> Self {
        Values(values.into())
    }

    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        &self.0
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Values {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Values({} x f32)", self.0.len())
    }
}

/// What a graph input holds, so that a data loader can feed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputRole {
    /// Token ids in `0..vocab` of a language-model sequence. Text: `tokens(256)`.
    Tokens {
        /// Vocabulary size.
        vocab: usize,
    },
    /// The next-token targets of the `Tokens` input (the sequence shifted by one). Text: `next_tokens(256)`.
    NextTokens {
        /// Vocabulary size.
        vocab: usize,
    },
    /// Dense real-valued features. Text: `features`.
    Features,
    /// Real-valued regression targets for the `Features` input. Text: `regression_targets`.
    RegressionTargets,
}

/// Element-wise unary functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `|x|`
    Abs,
    /// `e^x`
    Exp,
    /// natural logarithm
    Log,
    /// square root
    Sqrt,
    /// `1/sqrt(x)`
    Rsqrt,
    /// `1/x`
    Recip,
    /// `x*x`
    Square,
    /// hyperbolic tangent
    Tanh,
    /// logistic function
    Sigmoid,
    /// `max(x, 0)`
    Relu,
    /// GELU, tanh approximation (as GPT-2 uses)
    Gelu,
    /// The derivative of [`UnaryOp::Gelu`]: with `t = tanh(c (x + k x^3))`,
    /// `(1 + t) / 2 + x (1 - t^2) c (1 + 3 k x^2) / 2` (`c = sqrt(2 / pi)`, `k = 0.044715`).
    /// The gradient of GELU is `g * gelu_grad(x)`: one element-wise op where the expanded
    /// formula takes seventeen, as PyTorch's `gelu_backward` kernel is one.
    GeluGrad,
    /// `x * sigmoid(x)` (SwiGLU's gate)
    Silu,
    /// The error function.
    Erf,
    /// GELU in its exact form, `x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default,
    /// BERT's and ONNX `Gelu` without `approximate`).
    GeluErf,
    /// Sine (of radians).
    Sin,
    /// Cosine (of radians): the cosine learning-rate schedule.
    Cos,
}

impl UnaryOp {
    /// Every unary op.
    pub const ALL: [UnaryOp; 18] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Square,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::Silu,
        UnaryOp::Erf,
        UnaryOp::GeluErf,
        UnaryOp::Sin,
        UnaryOp::Cos,
    ];

    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Recip => "recip",
            UnaryOp::Square => "square",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluGrad => "gelu_grad",
            UnaryOp::Silu => "silu",
            UnaryOp::Erf => "erf",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
        }
    }

    /// True when the op is also defined on integers.
    pub fn accepts_int(self) -> bool {
        matches!(self, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Square)
    }
}

/// Element-wise binary arithmetic (operands of one type and shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `max(a, b)`
    Max,
    /// `min(a, b)`
    Min,
    /// `a ^ b` (floats only)
    Pow,
}

impl BinaryOp {
    /// Every binary op.
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Pow,
    ];

    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Pow => "pow",
        }
    }
}

/// Element-wise comparisons, giving `bool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompareOp {
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

impl CompareOp {
    /// Every comparison.
    pub const ALL: [CompareOp; 6] = [
        CompareOp::Eq,
        CompareOp::Ne,
        CompareOp::Lt,
        CompareOp::Le,
        CompareOp::Gt,
        CompareOp::Ge,
    ];

    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            CompareOp::Eq => "eq",
            CompareOp::Ne => "ne",
            CompareOp::Lt => "lt",
            CompareOp::Le => "le",
            CompareOp::Gt => "gt",
            CompareOp::Ge => "ge",
        }
    }
}

/// Reductions over tensor dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Arithmetic mean (floats only).
    Mean,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    /// Every reduction.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// An einsum contraction of two operands, e.g. `bsh,hf->bsf`.
///
/// Each dim of each operand carries a one-letter label. A label in both operands and the
/// output is a batch dim; in both operands but not the output, a contracting dim (summed);
/// in one operand and the output, a free dim. Every output label must come from an operand,
/// every operand label must be either contracted or kept, and no label repeats within one
/// operand (no diagonals).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct EinsumSpec {
    /// Labels of the left operand's dims.
    pub lhs: Vec<char>,
    /// Labels of the right operand's dims.
    pub rhs: Vec<char>,
    /// Labels of the output's dims.
    pub out: Vec<char>,
}

impl EinsumSpec {
    /// Labels contracted (summed over): in both operands, not in the output.
    pub fn contracting(&self) -> Vec<char> {
        self.lhs
            .iter()
            .copied()
            .filter(|c| self.rhs.contains(c) && !self.out.contains(c))
            .collect()
    }

    /// Labels shared by both operands and the output.
    pub fn batch(&self) -> Vec<char> {
        self.out
            .iter()
            .copied()
            .filter(|c| self.lhs.contains(c) && self.rhs.contains(c))
            .collect()
    }
}

impl fmt::Display for EinsumSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |v: &[char]| v.iter().collect::<String>();
        write!(f, "{},{}->{}", s(&self.lhs), s(&self.rhs), s(&self.out))
    }
}

impl FromStr for EinsumSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (ins, out) = s
            .split_once("->")
            .ok_or_else(|| format!("einsum spec `{s}` has no `->`"))?;
        let (lhs, rhs) = ins
            .split_once(',')
            .ok_or_else(|| format!("einsum spec `{s}` needs two operands separated by `,`"))?;
        let labels = |part: &str| -> Result<Vec<char>, String> {
            let v: Vec<char> = part.trim().chars().collect();
            if let Some(c) = v.iter().find(|c| !c.is_ascii_alphabetic()) {
                return Err(format!(
                    "einsum spec `{s}`: label `{c}` is not an ASCII letter"
                ));
            }
            Ok(v)
        };
        Ok(EinsumSpec {
            lhs: labels(lhs)?,
            rhs: labels(rhs)?,
            out: labels(out)?,
        })
    }
}

impl From<EinsumSpec> for String {
    fn from(e: EinsumSpec) -> String {
        e.to_string()
    }
}

impl TryFrom<String> for EinsumSpec {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// One operation. See each variant for operands, attributes and result types; the typing
/// rules are implemented in [`crate::infer`] and the semantics in the reference interpreter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    // ---- sources -------------------------------------------------------------------------
    /// A trainable weight. No operands; result `ty`.
    Parameter {
        /// Unique name, e.g. `h.0.mlp.w1`.
        name: String,
        /// Type of the weight.
        ty: TensorType,
        /// Initialisation.
        init: Init,
    },
    /// A data input fed per step. No operands; result `ty`.
    Input {
        /// Unique name, e.g. `tokens`.
        name: String,
        /// Type of the input.
        ty: TensorType,
        /// What it holds.
        role: InputRole,
    },
    /// A tensor filled with one value. No operands; result `ty`.
    Constant {
        /// Type of the result.
        ty: TensorType,
        /// The fill value (0 or 1 for `bool`, integral for integers).
        #[serde(with = "any_f64")]
        value: f64,
    },

    // ---- compute -------------------------------------------------------------------------
    /// Two-operand einsum (matmul with batch and contracting dims) on float operands of one dtype.
    Einsum {
        /// The labels.
        spec: EinsumSpec,
    },
    /// Element-wise unary function.
    Unary {
        /// Which function.
        func: UnaryOp,
    },
    /// Element-wise binary arithmetic on operands of one type.
    Binary {
        /// Which operation.
        func: BinaryOp,
    },
    /// Element-wise comparison giving `bool`.
    Compare {
        /// Which comparison.
        func: CompareOp,
    },
    /// `select(cond, a, b)`: `a` where `cond`, else `b` (cond is `bool`, same shape).
    Select,
    /// Element-wise conversion to another dtype (round to nearest even for floats).
    Cast {
        /// Target dtype.
        to: DType,
    },
    /// Reduction over the listed dims, which are removed from the shape.
    Reduce {
        /// The reduction.
        func: ReduceOp,
        /// Dims to reduce, strictly increasing.
        dims: Vec<usize>,
    },
    /// Softmax along one dim.
    Softmax {
        /// The normalised dim.
        dim: usize,
    },
    /// Layer norm over the last dim: operands `x[..., h]`, `gamma[h]`, `beta[h]`.
    LayerNorm {
        /// Added to the variance.
        eps: f64,
    },
    /// RMS norm over the last dim: operands `x[..., h]`, `gamma[h]`.
    RmsNorm {
        /// Added to the mean square.
        eps: f64,
    },
    /// Embedding lookup: operands `table[v, rest...]`, integer `ids[idx...]`; result
    /// `[idx..., rest...]`. An id outside `0..v` is a runtime error.
    Gather,
    /// Gradient of [`Op::Gather`]: operands integer `ids[idx...]`, `updates[idx..., rest...]`;
    /// result `[num_rows, rest...]` where row `r` is the sum of the updates whose id is `r`.
    ScatterAdd {
        /// Number of rows of the result (the vocabulary size).
        num_rows: usize,
    },
    /// Reinterpret the elements (row-major) in a new shape of the same size.
    Reshape {
        /// The new shape.
        shape: Shape,
    },
    /// Permute dims: result dim `i` is operand dim `perm[i]`.
    Transpose {
        /// A permutation of `0..rank`.
        perm: Vec<usize>,
    },
    /// The range `start..end` of one dim.
    Slice {
        /// The sliced dim.
        dim: usize,
        /// First index kept.
        start: usize,
        /// One past the last index kept (`start < end <= size`).
        end: usize,
    },
    /// Concatenation of one or more operands along a dim.
    Concat {
        /// The joined dim.
        dim: usize,
    },
    /// Broadcast into `shape`: operand dim `i` becomes result dim `dims[i]` (sizes equal, or 1
    /// and expanded); the other result dims are new.
    Broadcast {
        /// Result shape.
        shape: Shape,
        /// Where each operand dim goes, strictly increasing.
        dims: Vec<usize>,
    },
    /// Rotary position embedding (rotate-half form) on `x[..., s, heads, d]` with `d` even;
    /// an optional second operand gives the integer position of each of the `s` rows
    /// (default `0..s`).
    Rotary {
        /// Frequency base (10000 in GPT-NeoX, 500000 in Llama 3).
        base: f64,
    },
    /// Scaled dot-product attention: operands `q[b, s, hq, d]`, `k[b, t, hkv, d]`,
    /// `v[b, t, hkv, dv]` with `hq` a multiple of `hkv` (grouped-query attention: query head
    /// `i` uses kv head `i / (hq / hkv)`); result `[b, s, hq, dv]`. With `causal`, query `i`
    /// sees keys `0..=i`. Two optional integer operands `q_pos[s]` and `k_pos[t]` give the
    /// positions of the rows instead (default `0..s` and `0..t`): with `causal`, query `i`
    /// sees key `j` when `k_pos[j] <= q_pos[i]` (a query that sees no key has an undefined
    /// result). Defined by its decomposition into einsum, softmax and select.
    Attention {
        /// Mask future keys.
        causal: bool,
        /// Logit scale (usually `1/sqrt(d)`).
        scale: f64,
    },
    /// The gradients of [`Op::Attention`] in one op: operands `q`, `k`, `v`, the attention's
    /// result `o[b, s, hq, dv]`, its gradient `g` (same type), and the optional positions
    /// `q_pos[s]`, `k_pos[t]`; results `dq`, `dk`, `dv` (the types of `q`, `k`, `v`). With
    /// `p` the attention probabilities (recomputed from `q`, `k` and the mask):
    /// `dv = p^T g`, `ds = p (g v^T - rowsum(g o)) scale`, `dq = ds k`, `dk = ds^T q`
    /// (`rowsum(g o)` equals `rowsum(p (g v^T))`, so no probabilities need be stored).
    AttentionBackward {
        /// Mask future keys.
        causal: bool,
        /// Logit scale.
        scale: f64,
    },
    /// Top-k MoE routing with expert capacity (GShard-style): operand router probabilities
    /// `probs[..., t, e]`; results `combine[..., t, e, c]` (the gate weight of token `t` in
    /// slot `c` of expert `e`) and `dispatch[..., t, e, c]` (1 where token `t` occupies that
    /// slot, else 0), both of the operand's dtype. Every index of the leading dims is an
    /// independent routing group (GShard's groups) with `capacity` slots per expert of its
    /// own. Within a group, slots are filled in token order, first choices before second
    /// choices; a token whose expert is full in its group is dropped for that choice.
    MoeRoute {
        /// Experts per token.
        top_k: usize,
        /// Slots per expert.
        capacity: usize,
        /// Renormalise the chosen gates of each token to sum to 1.
        normalize: bool,
    },
    /// Cross-entropy per position: operands `logits[..., v]` and integer `targets[...]`;
    /// result `f32[...]`, `logsumexp(logits) - logits[target]`.
    CrossEntropy,
    /// SGD with momentum and decoupled weight decay: operands `param, grad, momentum` (one
    /// type), optionally followed by a learning-rate factor (`f32[]`, as for AdamW); results
    /// `param', momentum'`.
    SgdUpdate {
        /// Learning rate.
        lr: f64,
        /// Momentum coefficient.
        momentum: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
    /// AdamW: operands `param, grad, m, v` (one type) and the 1-based step count as an `f32`
    /// scalar, optionally followed by a learning-rate factor (`f32[]`, from a schedule; the
    /// rate is `lr` times it); results `param', m', v'`. Bias-corrected, decoupled weight decay.
    AdamWUpdate {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },

    // ---- communication -------------------------------------------------------------------
    /// Reduce over the groups spanned by `axes`; every member gets the result.
    AllReduce {
        /// Mesh axes of the group.
        axes: Vec<String>,
        /// The reduction.
        reduce: ReduceKind,
    },
    /// Concatenate the members' operands along `dim` (in group order).
    AllGather {
        /// Mesh axes of the group.
        axes: Vec<String>,
        /// The joined dim.
        dim: usize,
    },
    /// Reduce over the group, member `i` keeping the `i`-th slice of `dim`.
    ReduceScatter {
        /// Mesh axes of the group.
        axes: Vec<String>,
        /// The scattered dim.
        dim: usize,
        /// The reduction.
        reduce: ReduceKind,
    },
    /// Split `split_dim` into group-size pieces, send piece `j` to member `j`, and
    /// concatenate what arrives along `concat_dim`.
    AllToAll {
        /// Mesh axes of the group.
        axes: Vec<String>,
        /// Dim split among the members.
        split_dim: usize,
        /// Dim the received pieces are joined on.
        concat_dim: usize,
    },
    /// Every member gets the operand of member `root`.
    CollectiveBroadcast {
        /// Mesh axes of the group.
        axes: Vec<String>,
        /// Index of the source within the group.
        root: usize,
    },
    /// Send the operand to the device `shift` steps along mesh axis `axis` (wrapping). No
    /// results.
    Send {
        /// The mesh axis.
        axis: String,
        /// Signed distance along the axis.
        shift: i64,
    },
    /// Receive a value of type `ty` from the device `shift` steps along `axis` (wrapping).
    Recv {
        /// The mesh axis.
        axis: String,
        /// Signed distance along the axis.
        shift: i64,
        /// Type of the received value.
        ty: TensorType,
    },

    // ---- fusion --------------------------------------------------------------------------
    /// A fused region: its results are its body evaluated on its operands, in one kernel.
    /// Fusions are made from rank programs after partitioning, so they have no sharding rule
    /// and no derivative. See [`FusionBody`].
    Fusion {
        /// The expression the fusion computes.
        body: FusionBody,
    },
}

/// The body of an [`Op::Fusion`]: a small dataflow graph of element-wise, broadcast,
/// reduction, cast, select, reshape and constant ops over the fusion's operands.
///
/// Body values are numbered: `0..params.len()` are the operands (of types `params`), and
/// instruction `i` defines value `params.len() + i`. An instruction reads only earlier
/// values; `results` lists the values the fusion returns. The text format writes values as
/// `^N` inside `body={...}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusionBody {
    /// The operand types, in order.
    pub params: Vec<TensorType>,
    /// The instructions, in evaluation order.
    pub instrs: Vec<FusedInstr>,
    /// The body values the fusion returns, in order.
    pub results: Vec<usize>,
}

/// One instruction of a [`FusionBody`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedInstr {
    /// The op (one [`FusionBody::admits`]).
    pub op: Op,
    /// Body values it reads.
    pub operands: Vec<usize>,
}

impl FusionBody {
    /// True for the ops a body may hold: element-wise arithmetic and functions, comparisons,
    /// `select`, casts, reductions, broadcasts, reshapes and constants: what one kernel
    /// computes in registers and shared memory.
    pub fn admits(op: &Op) -> bool {
        matches!(
            op,
            Op::Unary { .. }
                | Op::Binary { .. }
                | Op::Compare { .. }
                | Op::Select
                | Op::Cast { .. }
                | Op::Reduce { .. }
                | Op::Broadcast { .. }
                | Op::Reshape { .. }
                | Op::Constant { .. }
        )
    }

    /// Number of body values (operands and instruction results).
    pub fn num_values(&self) -> usize {
        self.params.len() + self.instrs.len()
    }
}

/// Discriminant-only view of [`Op`], for tables and exhaustive test loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(missing_docs)]
pub enum OpKind {
    Parameter,
    Input,
    Constant,
    Einsum,
    Unary,
    Binary,
    Compare,
    Select,
    Cast,
    Reduce,
    Softmax,
    LayerNorm,
    RmsNorm,
    Gather,
    ScatterAdd,
    Reshape,
    Transpose,
    Slice,
    Concat,
    Broadcast,
    Rotary,
    Attention,
    AttentionBackward,
    MoeRoute,
    CrossEntropy,
    SgdUpdate,
    AdamWUpdate,
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    CollectiveBroadcast,
    Send,
    Recv,
    Fusion,
}

impl OpKind {
    /// Every op kind, so that tests can loop over the whole op set.
    pub const ALL: [OpKind; 35] = [
        OpKind::Parameter,
        OpKind::Input,
        OpKind::Constant,
        OpKind::Einsum,
        OpKind::Unary,
        OpKind::Binary,
        OpKind::Compare,
        OpKind::Select,
        OpKind::Cast,
        OpKind::Reduce,
        OpKind::Softmax,
        OpKind::LayerNorm,
        OpKind::RmsNorm,
        OpKind::Gather,
        OpKind::ScatterAdd,
        OpKind::Reshape,
        OpKind::Transpose,
        OpKind::Slice,
        OpKind::Concat,
        OpKind::Broadcast,
        OpKind::Rotary,
        OpKind::Attention,
        OpKind::AttentionBackward,
        OpKind::MoeRoute,
        OpKind::CrossEntropy,
        OpKind::SgdUpdate,
        OpKind::AdamWUpdate,
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::CollectiveBroadcast,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Fusion,
    ];
}

impl Op {
    /// The op's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Parameter { .. } => OpKind::Parameter,
            Op::Input { .. } => OpKind::Input,
            Op::Constant { .. } => OpKind::Constant,
            Op::Einsum { .. } => OpKind::Einsum,
            Op::Unary { .. } => OpKind::Unary,
            Op::Binary { .. } => OpKind::Binary,
            Op::Compare { .. } => OpKind::Compare,
            Op::Select => OpKind::Select,
            Op::Cast { .. } => OpKind::Cast,
            Op::Reduce { .. } => OpKind::Reduce,
            Op::Softmax { .. } => OpKind::Softmax,
            Op::LayerNorm { .. } => OpKind::LayerNorm,
            Op::RmsNorm { .. } => OpKind::RmsNorm,
            Op::Gather => OpKind::Gather,
            Op::ScatterAdd { .. } => OpKind::ScatterAdd,
            Op::Reshape { .. } => OpKind::Reshape,
            Op::Transpose { .. } => OpKind::Transpose,
            Op::Slice { .. } => OpKind::Slice,
            Op::Concat { .. } => OpKind::Concat,
            Op::Broadcast { .. } => OpKind::Broadcast,
            Op::Rotary { .. } => OpKind::Rotary,
            Op::Attention { .. } => OpKind::Attention,
            Op::AttentionBackward { .. } => OpKind::AttentionBackward,
            Op::MoeRoute { .. } => OpKind::MoeRoute,
            Op::CrossEntropy => OpKind::CrossEntropy,
            Op::SgdUpdate { .. } => OpKind::SgdUpdate,
            Op::AdamWUpdate { .. } => OpKind::AdamWUpdate,
            Op::AllReduce { .. } => OpKind::AllReduce,
            Op::AllGather { .. } => OpKind::AllGather,
            Op::ReduceScatter { .. } => OpKind::ReduceScatter,
            Op::AllToAll { .. } => OpKind::AllToAll,
            Op::CollectiveBroadcast { .. } => OpKind::CollectiveBroadcast,
            Op::Send { .. } => OpKind::Send,
            Op::Recv { .. } => OpKind::Recv,
            Op::Fusion { .. } => OpKind::Fusion,
        }
    }

    /// The mnemonic used in the text format and dumps.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Input { .. } => "input",
            Op::Constant { .. } => "constant",
            Op::Einsum { .. } => "einsum",
            Op::Unary { func } => func.name(),
            Op::Binary { func } => func.name(),
            Op::Compare { func } => func.name(),
            Op::Select => "select",
            Op::Cast { .. } => "cast",
            Op::Reduce { func, .. } => match func {
                ReduceOp::Sum => "reduce_sum",
                ReduceOp::Mean => "reduce_mean",
                ReduceOp::Max => "reduce_max",
                ReduceOp::Min => "reduce_min",
            },
            Op::Softmax { .. } => "softmax",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Gather => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Broadcast { .. } => "broadcast",
            Op::Rotary { .. } => "rotary",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::MoeRoute { .. } => "moe_route",
            Op::CrossEntropy => "cross_entropy",
            Op::SgdUpdate { .. } => "sgd_update",
            Op::AdamWUpdate { .. } => "adamw_update",
            Op::AllReduce { .. } => "all_reduce",
            Op::AllGather { .. } => "all_gather",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllToAll { .. } => "all_to_all",
            Op::CollectiveBroadcast { .. } => "collective_broadcast",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Fusion { .. } => "fusion",
        }
    }

    /// True for ops with no operands whose result type is an attribute.
    pub fn is_source(&self) -> bool {
        matches!(
            self,
            Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } | Op::Recv { .. }
        )
    }

    /// True for collectives and point-to-point ops.
    pub fn is_communication(&self) -> bool {
        matches!(
            self.kind(),
            OpKind::AllReduce
                | OpKind::AllGather
                | OpKind::ReduceScatter
                | OpKind::AllToAll
                | OpKind::CollectiveBroadcast
                | OpKind::Send
                | OpKind::Recv
        )
    }

    /// The declared result type of a source op.
    pub fn source_type(&self) -> Option<&TensorType> {
        match self {
            Op::Parameter { ty, .. }
            | Op::Input { ty, .. }
            | Op::Constant { ty, .. }
            | Op::Recv { ty, .. } => Some(ty),
            _ => None,
        }
    }

    /// Mutable access to the declared result type of a source op.
    pub fn source_type_mut(&mut self) -> Option<&mut TensorType> {
        match self {
            Op::Parameter { ty, .. }
            | Op::Input { ty, .. }
            | Op::Constant { ty, .. }
            | Op::Recv { ty, .. } => Some(ty),
            _ => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fill value in JSON, which has no NaN or infinity: finite values are numbers, the others
/// strings (`"inf"`, `"-inf"`, and `"nan(0x...)"` with the value's bits, as `.air` writes
/// them), so that a constant of `-inf` (an attention mask) or NaN survives a dump and a load.
mod any_f64 {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else if x.is_nan() {
            s.serialize_str(&format!("nan(0x{:016x})", x.to_bits()))
        } else if *x > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Number(f64),
        Name(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Repr::deserialize(d)? {
            Repr::Number(x) => Ok(x),
            Repr::Name(name) => match name.as_str() {
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                "nan" => Ok(f64::NAN),
                other => other
                    .strip_prefix("nan(0x")
                    .and_then(|h| h.strip_suffix(')'))
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    .map(f64::from_bits)
                    .filter(|x| x.is_nan())
                    .ok_or_else(|| {
                        D::Error::custom(format!(
                            "`{other}` is not a number, `inf`, `-inf`, `nan` or `nan(0x<bits>)`"
                        ))
                    }),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn einsum_spec_parses_and_prints() {
        let e: EinsumSpec = "bsh,hf->bsf".parse().unwrap();
        assert_eq!(e.to_string(), "bsh,hf->bsf");
        assert_eq!(e.contracting(), vec!['h']);
        assert!(e.batch().is_empty());
        let a: EinsumSpec = "bhsd,bhtd->bhst".parse().unwrap();
        assert_eq!(a.batch(), vec!['b', 'h']);
        assert_eq!(a.contracting(), vec!['d']);
        assert!("bsh->bs".parse::<EinsumSpec>().is_err());
        assert!("b1,h->b".parse::<EinsumSpec>().is_err());
    }

    #[test]
    fn op_names_are_unique() {
        let mut names: Vec<&str> = Vec::new();
        names.extend(UnaryOp::ALL.map(|u| u.name()));
        names.extend(BinaryOp::ALL.map(|u| u.name()));
        names.extend(CompareOp::ALL.map(|u| u.name()));
        names.extend([
            "parameter",
            "input",
            "constant",
            "einsum",
            "select",
            "cast",
            "reduce_sum",
            "reduce_mean",
            "reduce_max",
            "reduce_min",
            "softmax",
            "layer_norm",
            "rms_norm",
            "gather",
            "scatter_add",
            "reshape",
            "transpose",
            "slice",
            "concat",
            "broadcast",
            "rotary",
            "attention",
            "moe_route",
            "cross_entropy",
            "sgd_update",
            "adamw_update",
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "collective_broadcast",
            "send",
            "recv",
            "fusion",
        ]);
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
