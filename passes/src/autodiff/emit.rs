//! A small node emitter over [`Graph`]: one method per op the passes compose, each adding a
//! typed node under the emitter's current scope and typed metadata.

use autopar_ir::{
    BinaryOp, CompareOp, DType, EinsumSpec, Graph, IrError, NodeMeta, Op, ReduceOp, Shape,
    TensorType, UnaryOp, ValueId,
};

use crate::error::PassError;

/// Adds nodes to a graph, giving each the current scope and metadata.
pub(crate) struct Emitter<'g> {
    /// The graph being extended.
    pub g: &'g mut Graph,
    scope: Option<String>,
    meta: NodeMeta,
}

impl<'g> Emitter<'g> {
    /// An emitter that gives new nodes `scope` (for humans) and `meta` (for passes).
    pub fn new(g: &'g mut Graph, scope: Option<String>, meta: NodeMeta) -> Self {
        Emitter { g, scope, meta }
    }

    /// Changes the metadata given to the nodes added from now on.
    pub fn set_meta(&mut self, meta: NodeMeta) {
        self.meta = meta;
    }

    /// The metadata given to new nodes.
    pub fn meta(&self) -> NodeMeta {
        self.meta
    }

    /// Changes the scope given to the nodes added from now on.
    pub fn set_scope(&mut self, scope: Option<String>) {
        self.scope = scope;
    }

    /// The scope given to new nodes.
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// The type of `v`.
    pub fn ty(&self, v: ValueId) -> TensorType {
        self.g.ty(v).clone()
    }

    /// The dims of `v`.
    pub fn dims(&self, v: ValueId) -> Vec<usize> {
        self.g.ty(v).dims().to_vec()
    }

    /// Adds a node and returns all its results.
    pub fn node(&mut self, op: Op, inputs: &[ValueId]) -> Result<Vec<ValueId>, PassError> {
        let n = self.g.add_node(op, inputs)?;
        self.g.set_scope(n, self.scope.clone());
        self.g.set_meta(n, self.meta);
        Ok(self.g.node(n).outputs.clone())
    }

    /// Adds a single-result node and returns its result.
    pub fn op(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId, PassError> {
        let name = op.name();
        match self.node(op, inputs)?.as_slice() {
            [v] => Ok(*v),
            outs => Err(IrError::Verify(format!(
                "`{name}` has {} results where one was expected",
                outs.len()
            ))
            .into()),
        }
    }

    /// A tensor of type `ty` filled with `value`.
    pub fn constant(&mut self, ty: TensorType, value: f64) -> Result<ValueId, PassError> {
        self.op(Op::Constant { ty, value }, &[])
    }

    /// A tensor of `v`'s type filled with `value`.
    pub fn full_like(&mut self, v: ValueId, value: f64) -> Result<ValueId, PassError> {
        let ty = self.ty(v);
        self.constant(ty, value)
    }

    /// A rank-0 tensor.
    pub fn scalar(&mut self, dtype: DType, value: f64) -> Result<ValueId, PassError> {
        self.constant(TensorType::scalar(dtype), value)
    }

    /// An element-wise unary function.
    pub fn unary(&mut self, func: UnaryOp, x: ValueId) -> Result<ValueId, PassError> {
        self.op(Op::Unary { func }, &[x])
    }

    /// An element-wise binary function.
    pub fn binary(&mut self, func: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.op(Op::Binary { func }, &[a, b])
    }

    /// `a + b`.
    pub fn add(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.binary(BinaryOp::Add, a, b)
    }

    /// `a - b`.
    pub fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.binary(BinaryOp::Sub, a, b)
    }

    /// `a * b`.
    pub fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.binary(BinaryOp::Mul, a, b)
    }

    /// `a / b`.
    pub fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.binary(BinaryOp::Div, a, b)
    }

    /// `-x`.
    pub fn neg(&mut self, x: ValueId) -> Result<ValueId, PassError> {
        self.unary(UnaryOp::Neg, x)
    }

    /// `x * c` for a constant `c`.
    pub fn scale(&mut self, x: ValueId, c: f64) -> Result<ValueId, PassError> {
        let c = self.full_like(x, c)?;
        self.mul(x, c)
    }

    /// `c - x` for a constant `c`.
    pub fn rsub(&mut self, c: f64, x: ValueId) -> Result<ValueId, PassError> {
        let c = self.full_like(x, c)?;
        self.sub(c, x)
    }

    /// An element-wise comparison.
    pub fn compare(
        &mut self,
        func: CompareOp,
        a: ValueId,
        b: ValueId,
    ) -> Result<ValueId, PassError> {
        self.op(Op::Compare { func }, &[a, b])
    }

    /// `a` where `cond`, else `b`.
    pub fn select(&mut self, cond: ValueId, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        self.op(Op::Select, &[cond, a, b])
    }

    /// `a` where `cond`, else zero.
    pub fn keep_where(&mut self, cond: ValueId, a: ValueId) -> Result<ValueId, PassError> {
        let zero = self.full_like(a, 0.0)?;
        self.select(cond, a, zero)
    }

    /// Conversion to `to`.
    pub fn cast(&mut self, x: ValueId, to: DType) -> Result<ValueId, PassError> {
        self.op(Op::Cast { to }, &[x])
    }

    /// `x` converted to `to`, or `x` itself when it already has that dtype.
    pub fn cast_if_needed(&mut self, x: ValueId, to: DType) -> Result<ValueId, PassError> {
        if self.g.ty(x).dtype == to {
            Ok(x)
        } else {
            self.cast(x, to)
        }
    }

    /// A reduction over `dims`; the identity when `dims` is empty.
    pub fn reduce(
        &mut self,
        func: ReduceOp,
        x: ValueId,
        dims: Vec<usize>,
    ) -> Result<ValueId, PassError> {
        if dims.is_empty() {
            return Ok(x);
        }
        self.op(Op::Reduce { func, dims }, &[x])
    }

    /// The sum over `dims`.
    pub fn sum(&mut self, x: ValueId, dims: Vec<usize>) -> Result<ValueId, PassError> {
        self.reduce(ReduceOp::Sum, x, dims)
    }

    /// The sum of every element, as a rank-0 tensor.
    pub fn sum_all(&mut self, x: ValueId) -> Result<ValueId, PassError> {
        let rank = self.g.ty(x).rank();
        self.sum(x, (0..rank).collect())
    }

    /// Broadcast into `shape`, operand dim `i` becoming dim `dims[i]`; the identity when
    /// nothing changes.
    pub fn broadcast(
        &mut self,
        x: ValueId,
        shape: &[usize],
        dims: Vec<usize>,
    ) -> Result<ValueId, PassError> {
        if self.g.ty(x).dims() == shape && dims.iter().copied().eq(0..shape.len()) {
            return Ok(x);
        }
        self.op(
            Op::Broadcast {
                shape: Shape::new(shape.to_vec()),
                dims,
            },
            &[x],
        )
    }

    /// A rank-0 `x` broadcast to every element of `shape`.
    pub fn splat(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId, PassError> {
        self.broadcast(x, shape, Vec::new())
    }

    /// `x[..., r]` reduced over its last dim `r` and broadcast back (for row statistics).
    pub fn reduce_last_keep(&mut self, func: ReduceOp, x: ValueId) -> Result<ValueId, PassError> {
        let dims = self.dims(x);
        let last = dims.len().saturating_sub(1);
        let r = self.reduce(func, x, vec![last])?;
        self.broadcast(r, &dims, (0..last).collect())
    }

    /// The same elements in `shape`; the identity when the shape does not change.
    pub fn reshape(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId, PassError> {
        if self.g.ty(x).dims() == shape {
            return Ok(x);
        }
        self.op(
            Op::Reshape {
                shape: Shape::new(shape.to_vec()),
            },
            &[x],
        )
    }

    /// Permuted dims.
    pub fn transpose(&mut self, x: ValueId, perm: Vec<usize>) -> Result<ValueId, PassError> {
        self.op(Op::Transpose { perm }, &[x])
    }

    /// The range `start..end` of dim `dim`.
    pub fn slice(
        &mut self,
        x: ValueId,
        dim: usize,
        start: usize,
        end: usize,
    ) -> Result<ValueId, PassError> {
        if start == 0 && self.g.ty(x).dims().get(dim) == Some(&end) {
            return Ok(x);
        }
        self.op(Op::Slice { dim, start, end }, &[x])
    }

    /// Concatenation along `dim`; the operand itself when there is one.
    pub fn concat(&mut self, parts: &[ValueId], dim: usize) -> Result<ValueId, PassError> {
        match parts {
            [one] => Ok(*one),
            _ => self.op(Op::Concat { dim }, parts),
        }
    }

    /// A two-operand einsum, e.g. `"bsh,hf->bsf"`.
    pub fn einsum(&mut self, spec: &str, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
        let spec: EinsumSpec = spec.parse().map_err(|detail| IrError::Attr {
            op: "einsum",
            attr: "spec",
            detail,
        })?;
        self.einsum_spec(spec, a, b)
    }

    /// A two-operand einsum with a parsed spec.
    pub fn einsum_spec(
        &mut self,
        spec: EinsumSpec,
        a: ValueId,
        b: ValueId,
    ) -> Result<ValueId, PassError> {
        self.op(Op::Einsum { spec }, &[a, b])
    }

    /// The integers `0..n` as a `dtype[n]` tensor, built by doubling (`[0]`, `[0,1]`,
    /// `[0,1,2,3]`, ...) and a final slice, so it takes `O(log n)` nodes: the IR has no iota.
    pub fn iota(&mut self, n: usize, dtype: DType) -> Result<ValueId, PassError> {
        let mut x = self.constant(TensorType::new(dtype, [1]), 0.0)?;
        let mut len = 1usize;
        while len < n {
            let offset = self.constant(TensorType::new(dtype, [len]), len as f64)?;
            let upper = self.add(x, offset)?;
            x = self.concat(&[x, upper], 0)?;
            len *= 2;
        }
        self.slice(x, 0, 0, n)
    }
}
