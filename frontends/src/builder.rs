//! [`ModelBuilder`]: the object model code talks to. It owns the IR graph under construction,
//! the current scope (layer path, for humans), the current layer of the layer sequence (typed
//! metadata, for passes: [`ModelBuilder::layer`], and the part of it, [`ModelBuilder::part`])
//! and the first error, and hands out
//! [`Tensor`] handles. Every node it adds gets the [`Phase::Forward`] phase (parameters and
//! inputs none) and the current layer and part; [`Tensor::role`](crate::Tensor::role) gives a parameter
//! its weight role.
//!
//! Errors are sticky: the first failing operation is recorded together with its scope, every
//! later operation becomes a no-op, and [`ModelBuilder::finish`] returns that first error. Model
//! code therefore needs no `?` on every line and never panics on a shape mistake.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use autopar_ir::infer::num_results;
use autopar_ir::mesh::is_identifier;
use autopar_ir::{
    DType, Graph, Init, InputRole, IrError, LayerId, NodeMeta, Op, Part, Phase, Placement, Shape,
    Sharding, ShardingOrigin, TensorType, ValueId, WeightRole, verify,
};

use crate::error::FrontendError;
use crate::tensor::Tensor;

/// Builds one model's graph. See the module docs and the crate example.
pub struct ModelBuilder {
    state: RefCell<State>,
}

/// Everything mutable, behind the `RefCell`. No borrow of it is ever held while model code
/// runs (see [`ModelBuilder::scope`]), so the borrows never conflict.
struct State {
    graph: Graph,
    /// The current scope path, segments joined by `.`.
    scope: String,
    /// Length of `scope` before each open segment was pushed.
    scope_marks: Vec<usize>,
    /// The layer every node added now belongs to.
    layer: Option<LayerId>,
    /// The part of the layer every node added now belongs to.
    part: Option<Part>,
    error: Option<FrontendError>,
    /// `(kind, name)` of every parameter, input and output declared so far.
    declared: HashSet<(&'static str, String)>,
}

impl State {
    /// Records the error that `make` builds from the current scope, unless an earlier error
    /// is already recorded (the first one wins).
    fn fail(&mut self, make: impl FnOnce(String) -> FrontendError) {
        if self.error.is_none() {
            self.error = Some(make(self.scope.clone()));
        }
    }

    /// The value that operand `position` of `op` names, if the builder has no error yet and
    /// the handle is one of `builder`'s; records a foreign handle as the error.
    fn operand(
        &mut self,
        builder: &ModelBuilder,
        t: &Tensor<'_>,
        op: &'static str,
        position: usize,
    ) -> Option<ValueId> {
        if self.error.is_some() {
            return None;
        }
        if !t.is_from(builder) {
            self.fail(|scope| FrontendError::ForeignTensor {
                scope,
                op,
                operand: position,
            });
            return None;
        }
        // A handle is inert only once an error is recorded, so this is `Some` here.
        t.value()
    }

    /// Records the declaration of a parameter, input or output (`kind`) called `name`;
    /// false, with the error recorded, if that name is taken.
    fn declare(&mut self, kind: &'static str, name: &str) -> bool {
        if self.declared.insert((kind, name.to_string())) {
            return true;
        }
        self.fail(|scope| FrontendError::DuplicateName {
            scope,
            kind,
            name: name.to_string(),
        });
        false
    }

    fn scope_attr(&self) -> Option<String> {
        (!self.scope.is_empty()).then(|| self.scope.clone())
    }

    /// How error messages name a value: its parameter or input name, else its id.
    fn describe(&self, v: ValueId) -> String {
        let node = self.graph.node(self.graph.value(v).producer);
        match &node.op {
            Op::Parameter { name, .. } | Op::Input { name, .. } => name.clone(),
            op => format!("{v} ({})", op.name()),
        }
    }
}

impl ModelBuilder {
    /// An empty model; `name` becomes the graph's name.
    pub fn new(name: impl Into<String>) -> Self {
        ModelBuilder {
            state: RefCell::new(State {
                graph: Graph::new(name),
                scope: String::new(),
                scope_marks: Vec::new(),
                layer: None,
                part: None,
                error: None,
                declared: HashSet::new(),
            }),
        }
    }

    /// Runs `f` with `name` appended to the scope path, and returns what `f` returns.
    ///
    /// Every node added inside gets the path as its scope (`h.0.attn`), and parameters
    /// declared inside are named under it. Nested calls nest; `name` may itself contain dots.
    pub fn scope<R>(&self, name: impl AsRef<str>, f: impl FnOnce() -> R) -> R {
        {
            let mut st = self.state.borrow_mut();
            let mark = st.scope.len();
            st.scope_marks.push(mark);
            if !st.scope.is_empty() {
                st.scope.push('.');
            }
            st.scope.push_str(name.as_ref());
        }
        let result = f();
        let mut st = self.state.borrow_mut();
        if let Some(mark) = st.scope_marks.pop() {
            st.scope.truncate(mark);
        }
        result
    }

    /// Runs `f` in scope `name` (see [`ModelBuilder::scope`]) with every node added inside
    /// belonging to `layer` of the layer sequence, and returns what `f` returns. This, not the
    /// scope's spelling, is what passes read: `m.layer(LayerId::Block(3), "h.3", ..)`.
    pub fn layer<R>(&self, layer: LayerId, name: impl AsRef<str>, f: impl FnOnce() -> R) -> R {
        let outer = self.state.borrow_mut().layer.replace(layer);
        let result = self.scope(name, f);
        self.state.borrow_mut().layer = outer;
        result
    }

    /// Runs `f` with every node added inside belonging to `part` of its layer (its norm, its
    /// attention, its MLP), and returns what `f` returns. The scope does not change.
    pub fn part<R>(&self, part: Part, f: impl FnOnce() -> R) -> R {
        let outer = self.state.borrow_mut().part.replace(part);
        let result = f();
        self.state.borrow_mut().part = outer;
        result
    }

    /// Sets the scope, layer and part every node added from now on gets, without a closure:
    /// for importers, which walk a graph rather than nest model code.
    pub(crate) fn set_position(&self, scope: &str, layer: Option<LayerId>, part: Option<Part>) {
        let mut st = self.state.borrow_mut();
        st.scope = scope.to_string();
        st.scope_marks.clear();
        st.layer = layer;
        st.part = part;
    }

    /// The scope, layer and part nodes get now (see [`ModelBuilder::set_position`]).
    pub(crate) fn position(&self) -> (String, Option<LayerId>, Option<Part>) {
        let st = self.state.borrow();
        (st.scope.clone(), st.layer, st.part)
    }

    /// The current scope path (empty at the top level).
    pub fn current_scope(&self) -> String {
        self.state.borrow().scope.clone()
    }

    /// Declares an `f32` trainable weight. Its name is `name` under the current scope, so
    /// `m.param("w1", ..)` inside scope `h.0.mlp` declares `h.0.mlp.w1`.
    pub fn param(&self, name: impl AsRef<str>, shape: impl Into<Shape>, init: Init) -> Tensor<'_> {
        self.param_typed(name, DType::F32, shape, init)
    }

    /// Declares a trainable weight of any dtype; see [`ModelBuilder::param`].
    pub fn param_typed(
        &self,
        name: impl AsRef<str>,
        dtype: DType,
        shape: impl Into<Shape>,
        init: Init,
    ) -> Tensor<'_> {
        let name = {
            let mut st = self.state.borrow_mut();
            let name = if st.scope.is_empty() {
                name.as_ref().to_string()
            } else {
                format!("{}.{}", st.scope, name.as_ref())
            };
            if !st.declare("parameter", &name) {
                return self.inert();
            }
            name
        };
        let ty = TensorType::new(dtype, shape);
        self.apply1(Op::Parameter { name, ty, init }, &[])
    }

    /// Declares a data input fed at every step. Input names are global (not scope-qualified).
    pub fn input(
        &self,
        name: impl Into<String>,
        dtype: DType,
        shape: impl Into<Shape>,
        role: InputRole,
    ) -> Tensor<'_> {
        let name = name.into();
        if !self.state.borrow_mut().declare("input", &name) {
            return self.inert();
        }
        let ty = TensorType::new(dtype, shape);
        self.apply1(Op::Input { name, ty, role }, &[])
    }

    /// A tensor of the given type filled with `value` (no data is stored, only the fill).
    pub fn constant(&self, value: f64, dtype: DType, shape: impl Into<Shape>) -> Tensor<'_> {
        let ty = TensorType::new(dtype, shape);
        self.apply1(Op::Constant { ty, value }, &[])
    }

    /// Concatenates `parts` along `dim`.
    pub fn concat<'m>(&'m self, parts: &[Tensor<'m>], dim: usize) -> Tensor<'m> {
        self.apply1(Op::Concat { dim }, parts)
    }

    /// Applies any op (optimizer updates, collectives, ...) and returns all its results.
    pub fn op<'m>(&'m self, op: Op, operands: &[Tensor<'m>]) -> Vec<Tensor<'m>> {
        let n = num_results(&op);
        match self.add_node(op, operands) {
            Some(values) => values.into_iter().map(|v| self.live(v)).collect(),
            None => vec![self.inert(); n],
        }
    }

    /// Marks `t` as a graph output called `name`.
    pub fn output(&self, name: impl Into<String>, t: Tensor<'_>) {
        let name = name.into();
        let mut st = self.state.borrow_mut();
        let Some(v) = st.operand(self, &t, "output", 0) else {
            return;
        };
        if !st.declare("output", &name) {
            return;
        }
        if let Err(error) = st.graph.add_output(name, v) {
            st.fail(|scope| FrontendError::Op {
                scope,
                op: "output",
                error: Box::new(error),
            });
        }
    }

    /// The first error recorded so far, if any.
    pub fn error(&self) -> Option<FrontendError> {
        self.state.borrow().error.clone()
    }

    /// Number of nodes added so far.
    pub fn num_nodes(&self) -> usize {
        self.state.borrow().graph.num_nodes()
    }

    /// The finished graph, verified; or the first error that model code made.
    pub fn finish(self) -> Result<Graph, FrontendError> {
        let st = self.state.into_inner();
        if let Some(e) = st.error {
            return Err(e);
        }
        verify(&st.graph).map_err(|e| FrontendError::Verify(Box::new(e)))?;
        Ok(st.graph)
    }

    // ---- used by `Tensor` ---------------------------------------------------------------

    /// Adds one node; `None` (with the error recorded) when it cannot be added.
    fn add_node(&self, op: Op, operands: &[Tensor<'_>]) -> Option<Vec<ValueId>> {
        let mut st = self.state.borrow_mut();
        if st.error.is_some() {
            return None;
        }
        let op_name = op.name();
        let mut inputs = Vec::with_capacity(operands.len());
        for (position, t) in operands.iter().enumerate() {
            inputs.push(st.operand(self, t, op_name, position)?);
        }
        match st.graph.add_node(op, &inputs) {
            Ok(n) => {
                let scope = st.scope_attr();
                st.graph.set_scope(n, scope);
                let source = matches!(st.graph.node(n).op, Op::Parameter { .. } | Op::Input { .. });
                let meta = NodeMeta {
                    phase: (!source).then_some(Phase::Forward),
                    layer: st.layer,
                    part: st.part,
                    ..NodeMeta::default()
                };
                st.graph.set_meta(n, meta);
                Some(st.graph.node(n).outputs.clone())
            }
            Err(error) => {
                st.fail(|scope| FrontendError::Op {
                    scope,
                    op: op_name,
                    error: Box::new(error),
                });
                None
            }
        }
    }

    /// Applies a single-result op.
    pub(crate) fn apply1<'m>(&'m self, op: Op, operands: &[Tensor<'m>]) -> Tensor<'m> {
        match self.op(op, operands).as_slice() {
            &[t] => t,
            _ => self.inert(),
        }
    }

    /// Applies a two-result op.
    pub(crate) fn apply2<'m>(
        &'m self,
        op: Op,
        operands: &[Tensor<'m>],
    ) -> (Tensor<'m>, Tensor<'m>) {
        match self.op(op, operands).as_slice() {
            &[a, b] => (a, b),
            _ => (self.inert(), self.inert()),
        }
    }

    /// Records an op error found before the op reached the graph (e.g. an unparsable spec).
    pub(crate) fn fail_op(&self, op: &'static str, error: IrError) {
        self.state.borrow_mut().fail(|scope| FrontendError::Op {
            scope,
            op,
            error: Box::new(error),
        });
    }

    /// Appends `(axis, placement)` to the user sharding of `t`.
    pub(crate) fn annotate(&self, t: Tensor<'_>, axis: &str, placement: Placement) {
        let mut st = self.state.borrow_mut();
        let Some(v) = st.operand(self, &t, "annotation", 0) else {
            return;
        };
        let value = st.graph.value(v);
        let ty = value.ty.clone();
        let mut sharding = match &value.sharding {
            Some(s) if s.origin == ShardingOrigin::User => s.clone(),
            _ => Sharding::user([]),
        };
        let problem = if !is_identifier(axis) {
            Some("the mesh axis name is not an identifier".to_string())
        } else if let Some(p) = sharding.get(axis) {
            Some(format!("the axis is listed twice (it already has {p})"))
        } else {
            match placement {
                Placement::Shard(dim) if dim >= ty.rank() => Some(format!(
                    "dim {dim} does not exist (the tensor has rank {})",
                    ty.rank()
                )),
                _ => None,
            }
        };
        if let Some(detail) = problem {
            let tensor = st.describe(v);
            st.fail(|scope| FrontendError::Annotation {
                scope,
                tensor,
                ty: ty.to_string(),
                axis: axis.to_string(),
                detail,
            });
            return;
        }
        sharding.axes.push((axis.to_string(), placement));
        if let Err(error) = st.graph.set_sharding(v, Some(sharding)) {
            st.fail(|scope| FrontendError::Op {
                scope,
                op: "annotation",
                error: Box::new(error),
            });
        }
    }

    /// Gives the parameter behind `t` its weight role; anything else is an error.
    pub(crate) fn set_role(&self, t: Tensor<'_>, role: WeightRole) {
        let mut st = self.state.borrow_mut();
        let Some(v) = st.operand(self, &t, "role", 0) else {
            return;
        };
        let n = st.graph.value(v).producer;
        if !matches!(st.graph.node(n).op, Op::Parameter { .. }) {
            let tensor = st.describe(v);
            st.fail(|scope| FrontendError::Op {
                scope,
                op: "role",
                error: Box::new(IrError::Verify(format!(
                    "only a parameter has a weight role, not {tensor} (role `{role}`)"
                ))),
            });
            return;
        }
        let meta = NodeMeta {
            role: Some(role),
            ..st.graph.meta(n)
        };
        st.graph.set_meta(n, meta);
    }

    /// The type of a live value.
    pub(crate) fn type_of(&self, v: ValueId) -> TensorType {
        self.state.borrow().graph.ty(v).clone()
    }

    /// The sharding of a live value.
    pub(crate) fn sharding_of(&self, v: ValueId) -> Option<Sharding> {
        self.state.borrow().graph.value(v).sharding.clone()
    }

    fn live(&self, value: ValueId) -> Tensor<'_> {
        Tensor::new(self, Some(value))
    }

    /// The handle returned by operations after an error: it names no value.
    pub(crate) fn inert(&self) -> Tensor<'_> {
        Tensor::new(self, None)
    }
}

impl fmt::Debug for ModelBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.state.try_borrow() {
            Ok(st) => f
                .debug_struct("ModelBuilder")
                .field("name", &st.graph.name())
                .field("scope", &st.scope)
                .field("nodes", &st.graph.num_nodes())
                .field("error", &st.error)
                .finish(),
            Err(_) => f.write_str("ModelBuilder { <in use> }"),
        }
    }
}

/// `Init::Normal { std }`, for model code: `m.param("w", [h, f], normal(0.02))`.
pub fn normal(std: f64) -> Init {
    Init::Normal { std }
}

/// `Init::Zeros` (biases, layer-norm shifts).
pub const ZEROS: Init = Init::Zeros;

/// `Init::Ones` (norm scales).
pub const ONES: Init = Init::Ones;
