//! [`Tensor`]: a copyable handle to a value of the graph being built. Its methods and the
//! arithmetic operators add ops to the graph, and its annotation methods attach placements.
//!
//! The IR has no implicit broadcasting: operands of element-wise ops must have one type, and
//! model code broadcasts explicitly ([`Tensor::broadcast_to`], [`Tensor::add_bias`]). That
//! keeps every broadcast visible to the sharding rules.

use std::fmt;
use std::ops::{Add, Div, Mul, Neg, Range, Sub};

use autopar_ir::{
    BinaryOp, CompareOp, DType, EinsumSpec, IrError, Op, Placement, ReduceOp, Shape, Sharding,
    TensorType, UnaryOp, ValueId,
};

use crate::builder::ModelBuilder;

/// A handle to one value of a [`ModelBuilder`]'s graph: a reference and an id, so `Copy`.
///
/// After the builder has recorded an error, operations return *inert* handles that name no
/// value; everything done with them is a no-op, and [`ModelBuilder::finish`] reports the error.
#[derive(Clone, Copy)]
pub struct Tensor<'m> {
    builder: &'m ModelBuilder,
    value: Option<ValueId>,
}

/// Attributes of [`Tensor::moe_route`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeRouting {
    /// Experts chosen per token.
    pub top_k: usize,
    /// Token slots per expert.
    pub capacity: usize,
    /// Renormalise each token's chosen gates to sum to 1.
    pub normalize: bool,
}

/// Generates the element-wise unary methods, one per [`UnaryOp`] that model code uses.
macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $func:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(self) -> Tensor<'m> {
                self.unary(UnaryOp::$func)
            }
        )*
    };
}

impl<'m> Tensor<'m> {
    pub(crate) fn new(builder: &'m ModelBuilder, value: Option<ValueId>) -> Self {
        Tensor { builder, value }
    }

    /// True when the handle was made by `builder`.
    pub(crate) fn is_from(&self, builder: &ModelBuilder) -> bool {
        std::ptr::eq(self.builder, builder)
    }

    /// The value this handle names, or `None` for an inert handle (after an error).
    pub fn value(&self) -> Option<ValueId> {
        self.value
    }

    /// The builder this tensor belongs to.
    pub fn builder(&self) -> &'m ModelBuilder {
        self.builder
    }

    /// The tensor's type, or `None` for an inert handle.
    pub fn ty(&self) -> Option<TensorType> {
        self.value.map(|v| self.builder.type_of(v))
    }

    /// The tensor's shape (empty for an inert handle).
    pub fn shape(&self) -> Shape {
        self.ty().map(|t| t.shape).unwrap_or_default()
    }

    /// The tensor's rank (0 for an inert handle).
    pub fn rank(&self) -> usize {
        self.shape().rank()
    }

    /// The placement annotated (or inferred) so far.
    pub fn sharding(&self) -> Option<Sharding> {
        self.value.and_then(|v| self.builder.sharding_of(v))
    }

    // ---- annotations ------------------------------------------------------------------------

    /// Annotates: this tensor is split evenly on `dim` over mesh axis `axis`.
    ///
    /// Annotations accumulate, one entry per axis (`w.shard(0, "dp").shard(1, "tp")`); naming an
    /// axis twice, or a dim the tensor lacks, is an error. Returns the tensor for chaining.
    pub fn shard(self, dim: usize, axis: &str) -> Self {
        self.place(axis, Placement::Shard(dim))
    }

    /// Annotates: every device along mesh axis `axis` holds the whole tensor.
    pub fn replicate(self, axis: &str) -> Self {
        self.place(axis, Placement::Replicate)
    }

    /// Gives this parameter its weight role (what it is to the model: the query projection,
    /// the MLP's output, ...), which passes read instead of its name. Returns the tensor for
    /// chaining; on anything but a parameter it is an error.
    pub fn role(self, role: autopar_ir::WeightRole) -> Self {
        self.builder.set_role(self, role);
        self
    }

    /// Annotates an arbitrary placement along `axis` (see [`Tensor::shard`]).
    pub fn place(self, axis: &str, placement: Placement) -> Self {
        self.builder.annotate(self, axis, placement);
        self
    }

    // ---- contractions and element-wise ops --------------------------------------------------

    /// Two-operand einsum, e.g. `x.einsum("bsh,hf->bsf", w)`.
    pub fn einsum(self, spec: &str, rhs: Tensor<'m>) -> Tensor<'m> {
        match spec.parse::<EinsumSpec>() {
            Ok(spec) => self.builder.apply1(Op::Einsum { spec }, &[self, rhs]),
            Err(detail) => {
                self.builder.fail_op(
                    "einsum",
                    IrError::Attr {
                        op: "einsum",
                        attr: "spec",
                        detail,
                    },
                );
                self.builder.inert()
            }
        }
    }

    unary_methods! {
        /// GELU (tanh approximation).
        gelu => Gelu;
        /// `x * sigmoid(x)`.
        silu => Silu;
        /// `max(x, 0)`.
        relu => Relu;
        /// Hyperbolic tangent.
        tanh => Tanh;
        /// Logistic function.
        sigmoid => Sigmoid;
        /// `e^x`.
        exp => Exp;
        /// Natural logarithm.
        log => Log;
        /// Square root.
        sqrt => Sqrt;
        /// `1/sqrt(x)`.
        rsqrt => Rsqrt;
        /// `1/x`.
        recip => Recip;
        /// `x*x`.
        square => Square;
        /// `|x|`.
        abs => Abs;
    }

    /// Any element-wise unary function.
    pub fn unary(self, func: UnaryOp) -> Tensor<'m> {
        self.builder.apply1(Op::Unary { func }, &[self])
    }

    /// Any element-wise binary function of two tensors of one type.
    pub fn binary(self, func: BinaryOp, rhs: Tensor<'m>) -> Tensor<'m> {
        self.builder.apply1(Op::Binary { func }, &[self, rhs])
    }

    /// Element-wise maximum.
    pub fn max(self, rhs: Tensor<'m>) -> Tensor<'m> {
        self.binary(BinaryOp::Max, rhs)
    }

    /// Element-wise minimum.
    pub fn min(self, rhs: Tensor<'m>) -> Tensor<'m> {
        self.binary(BinaryOp::Min, rhs)
    }

    /// Element-wise power (floats).
    pub fn pow(self, rhs: Tensor<'m>) -> Tensor<'m> {
        self.binary(BinaryOp::Pow, rhs)
    }

    /// Element-wise comparison, giving `bool`.
    pub fn compare(self, func: CompareOp, rhs: Tensor<'m>) -> Tensor<'m> {
        self.builder.apply1(Op::Compare { func }, &[self, rhs])
    }

    /// `if_true` where this `bool` tensor is set, else `if_false`.
    pub fn select(self, if_true: Tensor<'m>, if_false: Tensor<'m>) -> Tensor<'m> {
        self.builder.apply1(Op::Select, &[self, if_true, if_false])
    }

    /// Element-wise conversion to `to`.
    pub fn cast(self, to: DType) -> Tensor<'m> {
        self.builder.apply1(Op::Cast { to }, &[self])
    }

    /// A tensor of this one's type filled with `value`.
    pub fn full_like(self, value: f64) -> Tensor<'m> {
        match self.ty() {
            Some(ty) => self.builder.apply1(Op::Constant { ty, value }, &[]),
            None => self.builder.inert(),
        }
    }

    // ---- reductions and normalisations ------------------------------------------------------

    /// Any reduction over `dims` (strictly increasing), which are removed.
    pub fn reduce(self, func: ReduceOp, dims: impl AsRef<[usize]>) -> Tensor<'m> {
        let dims = dims.as_ref().to_vec();
        self.builder.apply1(Op::Reduce { func, dims }, &[self])
    }

    /// Sum over `dims`.
    pub fn sum(self, dims: impl AsRef<[usize]>) -> Tensor<'m> {
        self.reduce(ReduceOp::Sum, dims)
    }

    /// Mean over `dims`.
    pub fn mean(self, dims: impl AsRef<[usize]>) -> Tensor<'m> {
        self.reduce(ReduceOp::Mean, dims)
    }

    /// Softmax along `dim`.
    pub fn softmax(self, dim: usize) -> Tensor<'m> {
        self.builder.apply1(Op::Softmax { dim }, &[self])
    }

    /// Layer norm over the last dim with scale `gamma[h]` and shift `beta[h]`.
    pub fn layer_norm(self, gamma: Tensor<'m>, beta: Tensor<'m>, eps: f64) -> Tensor<'m> {
        self.builder
            .apply1(Op::LayerNorm { eps }, &[self, gamma, beta])
    }

    /// RMS norm over the last dim with scale `gamma[h]`.
    pub fn rms_norm(self, gamma: Tensor<'m>, eps: f64) -> Tensor<'m> {
        self.builder.apply1(Op::RmsNorm { eps }, &[self, gamma])
    }

    // ---- indexing and layout ----------------------------------------------------------------

    /// Embedding lookup: the rows of this table `[v, ...]` selected by integer `ids`.
    pub fn gather(self, ids: Tensor<'m>) -> Tensor<'m> {
        self.builder.apply1(Op::Gather, &[self, ids])
    }

    /// The same elements (row-major) in `shape`.
    pub fn reshape(self, shape: impl Into<Shape>) -> Tensor<'m> {
        let shape = shape.into();
        self.builder.apply1(Op::Reshape { shape }, &[self])
    }

    /// Permutes dims: result dim `i` is dim `perm[i]`.
    pub fn transpose(self, perm: impl AsRef<[usize]>) -> Tensor<'m> {
        let perm = perm.as_ref().to_vec();
        self.builder.apply1(Op::Transpose { perm }, &[self])
    }

    /// The indices `range` of dim `dim`.
    pub fn slice(self, dim: usize, range: Range<usize>) -> Tensor<'m> {
        let (start, end) = (range.start, range.end);
        self.builder.apply1(Op::Slice { dim, start, end }, &[self])
    }

    /// Broadcasts into `shape`, this tensor's dim `i` becoming dim `dims[i]` there.
    pub fn broadcast_to(self, shape: impl Into<Shape>, dims: impl AsRef<[usize]>) -> Tensor<'m> {
        let (shape, dims) = (shape.into(), dims.as_ref().to_vec());
        self.builder.apply1(Op::Broadcast { shape, dims }, &[self])
    }

    /// Broadcasts into the shape of `like` (see [`Tensor::broadcast_to`]).
    pub fn broadcast_like(self, like: Tensor<'m>, dims: impl AsRef<[usize]>) -> Tensor<'m> {
        self.broadcast_to(like.shape(), dims)
    }

    /// Adds `bias`, whose dims are the trailing dims of this tensor (a `[h]` bias on
    /// `[b, s, h]`), by an explicit broadcast and an add.
    pub fn add_bias(self, bias: Tensor<'m>) -> Tensor<'m> {
        let rank = self.rank();
        let first = rank.saturating_sub(bias.rank());
        self + bias.broadcast_to(self.shape(), (first..rank).collect::<Vec<_>>())
    }

    // ---- model-level ops --------------------------------------------------------------------

    /// Rotary position embedding of `[..., s, heads, d]` at positions `0..s`.
    pub fn rotary(self, base: f64) -> Tensor<'m> {
        self.builder.apply1(Op::Rotary { base }, &[self])
    }

    /// Rotary position embedding at the integer `positions[s]`.
    pub fn rotary_at(self, positions: Tensor<'m>, base: f64) -> Tensor<'m> {
        self.builder.apply1(Op::Rotary { base }, &[self, positions])
    }

    /// Attention of these queries `[b, s, hq, d]` over keys `[b, t, hkv, d]` and values
    /// `[b, t, hkv, dv]`, every query seeing every key.
    pub fn attention(self, k: Tensor<'m>, v: Tensor<'m>, scale: f64) -> Tensor<'m> {
        let op = Op::Attention {
            causal: false,
            scale,
        };
        self.builder.apply1(op, &[self, k, v])
    }

    /// Like [`Tensor::attention`], with query `i` seeing keys `0..=i` only.
    pub fn causal_attention(self, k: Tensor<'m>, v: Tensor<'m>, scale: f64) -> Tensor<'m> {
        let op = Op::Attention {
            causal: true,
            scale,
        };
        self.builder.apply1(op, &[self, k, v])
    }

    /// Top-k routing of these router probabilities `[..., t, e]` (leading dims: independent
    /// routing groups): returns `(combine, dispatch)`, both `[..., t, e, capacity]`.
    pub fn moe_route(self, routing: MoeRouting) -> (Tensor<'m>, Tensor<'m>) {
        let MoeRouting {
            top_k,
            capacity,
            normalize,
        } = routing;
        let op = Op::MoeRoute {
            top_k,
            capacity,
            normalize,
        };
        self.builder.apply2(op, &[self])
    }

    /// Cross-entropy of these logits `[..., v]` against integer `targets[...]`.
    pub fn cross_entropy(self, targets: Tensor<'m>) -> Tensor<'m> {
        self.builder.apply1(Op::CrossEntropy, &[self, targets])
    }

    /// `self <func> value`, the scalar filled to this tensor's type.
    fn with_scalar(self, func: BinaryOp, value: f64) -> Tensor<'m> {
        self.binary(func, self.full_like(value))
    }
}

impl fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.value, self.ty()) {
            (Some(v), Some(ty)) => write!(f, "Tensor({v}: {ty})"),
            _ => f.write_str("Tensor(inert)"),
        }
    }
}

/// Implements an arithmetic operator for tensor-tensor and tensor-scalar operands.
macro_rules! binary_operator {
    ($trait:ident, $method:ident, $func:ident) => {
        impl<'m> $trait for Tensor<'m> {
            type Output = Tensor<'m>;
            fn $method(self, rhs: Tensor<'m>) -> Tensor<'m> {
                self.binary(BinaryOp::$func, rhs)
            }
        }

        impl<'m> $trait<f64> for Tensor<'m> {
            type Output = Tensor<'m>;
            fn $method(self, rhs: f64) -> Tensor<'m> {
                self.with_scalar(BinaryOp::$func, rhs)
            }
        }
    };
}

binary_operator!(Add, add, Add);
binary_operator!(Sub, sub, Sub);
binary_operator!(Mul, mul, Mul);
binary_operator!(Div, div, Div);

impl<'m> Neg for Tensor<'m> {
    type Output = Tensor<'m>;
    fn neg(self) -> Tensor<'m> {
        self.unary(UnaryOp::Neg)
    }
}
