//! The import proper: decode, type every value (folding what the data does not change),
//! raise patterns, keep what the outputs need, and emit the IR.
//!
//! Every node is lowered by one function, [`Importer::lower`], twice: once into a scratch
//! builder, which gives every value its type and folds the constant ones, and once into the
//! model's builder, where raised patterns replace the nodes they cover and only the nodes
//! the outputs need are emitted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use autopar_ir::{
    CompareOp, DType, EinsumSpec, Init, InputRole, LayerId, ReduceOp, Shape, TensorType, UnaryOp,
    Values, WeightRole,
};
use prost::Message;

use super::proto::{AttributeProto, ModelProto, NodeProto, type_proto};
use super::raise::{self, Expr, Raised, Structure};
use super::tensor::{self, HostData, HostTensor, MAX_FOLDED_ELEMENTS};
use super::{ImportOptions, ImportReport, Imported, Loss, OPSETS, OnnxError};
use crate::builder::ModelBuilder;
use crate::error::FrontendError;
use crate::tensor::Tensor;

/// What the importer knows of a value before emitting.
#[derive(Clone, Debug)]
pub(crate) enum Val {
    /// Its values are known. `init` names the initializer it is, if it is one unchanged.
    Known { t: HostTensor, init: Option<String> },
    /// Computed from the data; its type.
    Dyn(TensorType),
}

impl Val {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Val::Known { t, .. } => t.dims.clone(),
            Val::Dyn(ty) => ty.dims().to_vec(),
        }
    }

    pub fn known(&self) -> Option<&HostTensor> {
        match self {
            Val::Known { t, .. } => Some(t),
            Val::Dyn(_) => None,
        }
    }
}

/// An operand while lowering: known values, or an IR value.
#[derive(Clone)]
enum Operand<'m> {
    Known(HostTensor, Option<String>),
    Dyn(Tensor<'m>),
}

/// One ONNX node, as the importer reads it.
#[derive(Clone, Debug)]
pub(crate) struct NodeRec {
    pub name: String,
    pub op: String,
    pub domain: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub attrs: Vec<AttributeProto>,
}

impl NodeRec {
    fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.attrs.iter().find(|a| a.name.as_deref() == Some(name))
    }
    pub fn int(&self, name: &str, default: i64) -> i64 {
        self.attr(name).and_then(|a| a.i).unwrap_or(default)
    }
    pub fn float(&self, name: &str, default: f64) -> f64 {
        self.attr(name).and_then(|a| a.f).map_or(default, f64::from)
    }
    pub fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }
    fn string(&self, name: &str) -> Option<String> {
        self.attr(name)
            .and_then(|a| a.s.as_ref())
            .map(|s| String::from_utf8_lossy(s).into_owned())
    }
    /// The `i`-th input's name, `None` when absent or empty (an omitted optional input).
    pub fn input(&self, i: usize) -> Option<&str> {
        self.inputs
            .get(i)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
}

/// The state of one import.
pub(crate) struct Importer {
    pub file: String,
    pub opset: i64,
    data_dir: Option<std::path::PathBuf>,
    pub nodes: Vec<NodeRec>,
    /// Every value's type or values, after the typing pass.
    pub vals: HashMap<String, Val>,
    /// The node producing each value.
    pub producer: HashMap<String, usize>,
    /// How many node inputs (and graph outputs) read each value.
    pub uses: HashMap<String, usize>,
    /// Float initializers, by name, in file order.
    pub initializers: Vec<String>,
    /// The shape each initializer is declared with as a parameter, when raising chose one
    /// (a `[h, n*d]` projection becomes `[h, n, d]`); by default the file's.
    pub param_shapes: HashMap<String, Vec<usize>>,
    /// Initializers to transpose (2-D) when declared (an untied head becomes `[v, h]`).
    pub param_transposed: HashSet<String>,
    /// Initializers that are the transpose of another one (a tied head), and which.
    pub tied: HashMap<String, String>,
}

impl Importer {
    pub fn node_error(&self, i: usize, detail: impl Into<String>) -> OnnxError {
        let n = &self.nodes[i];
        OnnxError::Node {
            file: self.file.clone(),
            node: n.name.clone(),
            op: n.op.clone(),
            opset: self.opset,
            detail: detail.into(),
        }
    }

    fn model_error(&self, detail: impl Into<String>) -> OnnxError {
        OnnxError::Model {
            file: self.file.clone(),
            detail: detail.into(),
        }
    }

    /// Whether known value `name` is a float initializer moved by layout ops only (the
    /// exporter folded a weight's transpose or a slice of a position table): such a value
    /// is that weight, not a constant. At most `depth` ops deep.
    pub fn param_derived(&self, name: &str, depth: usize) -> bool {
        let Some(Val::Known { t, init }) = self.vals.get(name) else {
            return false;
        };
        if init.is_some() {
            return true;
        }
        if depth == 0 || !t.dtype.is_float() {
            return false;
        }
        let Some(&i) = self.producer.get(name) else {
            return false;
        };
        let n = &self.nodes[i];
        let layout = matches!(
            n.op.as_str(),
            "Gather"
                | "Slice"
                | "Transpose"
                | "Reshape"
                | "Unsqueeze"
                | "Squeeze"
                | "Identity"
                | "Flatten"
        );
        layout && n.input(0).is_some_and(|x| self.param_derived(x, depth - 1))
    }

    /// The node producing a computed (not known) value.
    pub fn producing(&self, value: &str) -> Option<(usize, &NodeRec)> {
        if !matches!(self.vals.get(value), Some(Val::Dyn(_))) {
            return None;
        }
        let &i = self.producer.get(value)?;
        Some((i, &self.nodes[i]))
    }
}

/// The ops the importer lowers.
const SUPPORTED: &[&str] = &[
    "Add",
    "Cast",
    "Concat",
    "Constant",
    "ConstantOfShape",
    "Cos",
    "Div",
    "Dropout",
    "Einsum",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Gather",
    "Gelu",
    "Gemm",
    "Greater",
    "Identity",
    "LayerNormalization",
    "Less",
    "MatMul",
    "Max",
    "Min",
    "Mul",
    "Neg",
    "Not",
    "Pow",
    "Range",
    "Reciprocal",
    "ReduceMax",
    "ReduceMean",
    "ReduceSum",
    "Relu",
    "Reshape",
    "Shape",
    "Sigmoid",
    "Sin",
    "Slice",
    "Softmax",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Where",
    "And",
    "Or",
    "Log",
    "Abs",
];

pub(crate) fn import(
    bytes: &[u8],
    file: &str,
    name: &str,
    data_dir: Option<&Path>,
    options: &ImportOptions,
) -> Result<Imported, FrontendError> {
    let model = ModelProto::decode(bytes).map_err(|e| OnnxError::Decode {
        file: file.to_string(),
        detail: e.to_string(),
    })?;
    let opset = model
        .opset_import
        .iter()
        .find(|o| matches!(o.domain.as_deref(), None | Some("") | Some("ai.onnx")))
        .and_then(|o| o.version)
        .unwrap_or(0);
    if !OPSETS.contains(&opset) {
        return Err(OnnxError::Opset {
            file: file.to_string(),
            opset,
        }
        .into());
    }
    let graph = model.graph.ok_or_else(|| OnnxError::Model {
        file: file.to_string(),
        detail: "the model has no graph".into(),
    })?;
    let mut im = Importer {
        file: file.to_string(),
        opset,
        data_dir: data_dir.map(Path::to_path_buf),
        nodes: Vec::with_capacity(graph.node.len()),
        vals: HashMap::new(),
        producer: HashMap::new(),
        uses: HashMap::new(),
        initializers: Vec::new(),
        param_shapes: HashMap::new(),
        param_transposed: HashSet::new(),
        tied: HashMap::new(),
    };
    for (i, n) in graph.node.iter().enumerate() {
        im.nodes.push(node_rec(i, n));
    }
    // Every op is known before anything is computed, so that an unsupported op is reported
    // as such rather than as a consequence.
    for n in &im.nodes {
        if !(n.domain.is_empty() || n.domain == "ai.onnx") || !SUPPORTED.contains(&n.op.as_str()) {
            return Err(OnnxError::UnsupportedOp {
                file: file.to_string(),
                node: n.name.clone(),
                op: n.op.clone(),
                domain: n.domain.clone(),
                opset,
            }
            .into());
        }
    }
    for t in &graph.initializer {
        let name = t.name.clone().unwrap_or_default();
        let host = tensor::decode(t, im.data_dir.as_deref())
            .map_err(|e| im.model_error(format!("initializer `{name}`: {e}")))?;
        let init = host.dtype.is_float().then(|| name.clone());
        if init.is_some() {
            im.initializers.push(name.clone());
        }
        im.vals.insert(name, Val::Known { t: host, init });
    }
    let batch = options.batch;
    let mut inputs: Vec<(String, TensorType)> = Vec::new();
    for vi in &graph.input {
        let name = vi.name.clone().unwrap_or_default();
        if im.vals.contains_key(&name) {
            continue;
        }
        let ty = input_type(&im, &name, vi.r#type.as_ref(), batch)?;
        im.vals.insert(name.clone(), Val::Dyn(ty.clone()));
        inputs.push((name, ty));
    }
    let outputs: Vec<String> = graph
        .output
        .iter()
        .map(|o| o.name.clone().unwrap_or_default())
        .collect();
    if outputs.is_empty() {
        return Err(im.model_error("the graph has no outputs").into());
    }
    for (i, n) in im.nodes.iter().enumerate() {
        for o in &n.outputs {
            if !o.is_empty() {
                im.producer.insert(o.clone(), i);
            }
        }
        for v in &n.inputs {
            *im.uses.entry(v.clone()).or_default() += 1;
        }
    }
    for o in &outputs {
        *im.uses.entry(o.clone()).or_default() += 1;
    }

    // Typing pass: lower every node into a scratch builder.
    {
        let scratch = ModelBuilder::new(name);
        let mut env: HashMap<String, Operand<'_>> = HashMap::new();
        for (n, ty) in &inputs {
            let t = scratch.input(n.clone(), ty.dtype, ty.shape.clone(), InputRole::Features);
            env.insert(n.clone(), Operand::Dyn(t));
        }
        for i in 0..im.nodes.len() {
            let ops = im.operands(i, &scratch, &mut env)?;
            let results = im.lower(i, &scratch, &ops, true)?;
            im.record(i, &scratch, &results, &mut env)?;
        }
    }
    for o in &outputs {
        if !im.vals.contains_key(o) {
            return Err(im
                .model_error(format!("output `{o}` is not computed by any node"))
                .into());
        }
    }

    let raised = raise::find(&mut im);
    let structure = raise::structure(&im, &raised, &inputs, &outputs);
    let needed = im.liveness(&raised, &outputs);

    // Emission.
    let m = ModelBuilder::new(name);
    let mut env: HashMap<String, Operand<'_>> = HashMap::new();
    let mut report = ImportReport {
        opset,
        blocks: structure.blocks,
        not_understood: structure.not_understood.clone(),
        ..ImportReport::default()
    };
    let mut params: HashMap<String, Tensor<'_>> = HashMap::new();
    for (n, ty) in &inputs {
        let role = structure
            .input_roles
            .get(n)
            .copied()
            .unwrap_or(InputRole::Features);
        // Token ids are i32, as the zoo feeds them, when the vocabulary fits (exporters
        // write int64 ids).
        let dtype = match role {
            InputRole::Tokens { vocab } if ty.dtype == DType::I64 && vocab <= i32::MAX as usize => {
                DType::I32
            }
            _ => ty.dtype,
        };
        let t = m.input(n.clone(), dtype, ty.shape.clone(), role);
        env.insert(n.clone(), Operand::Dyn(t));
    }
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..im.nodes.len() {
        if !im.nodes[i].outputs.iter().any(|o| needed.contains(o)) {
            continue;
        }
        let (layer, part) = structure.position(i);
        m.set_position(&scope_of(&im.nodes[i].name), layer, part);
        let mut emit = Emitter {
            im: &im,
            m: &m,
            structure: &structure,
            params: &mut params,
            report: &mut report,
        };
        if let Some(r) = raised.get(&i) {
            let t = emit.raised(i, r, &mut env)?;
            *counts.entry(r.op_name().to_string()).or_default() += 1;
            let out = im.nodes[i].outputs[0].clone();
            env.insert(out, Operand::Dyn(t));
            continue;
        }
        let ops = emit.operands(i, &mut env)?;
        let results = im.lower(i, &m, &ops, false)?;
        for (o, r) in im.nodes[i].outputs.iter().zip(results) {
            env.insert(o.clone(), r);
        }
        check(&im, &m, i)?;
    }
    report.raised = counts.into_iter().collect();
    report
        .raised
        .extend(structure.native.iter().map(|(k, v)| (k.clone(), *v)));
    report.raised.sort();
    m.set_position("", None, None);
    let mut emit = Emitter {
        im: &im,
        m: &m,
        structure: &structure,
        params: &mut params,
        report: &mut report,
    };
    let mut results = Vec::new();
    for o in &outputs {
        let t = emit.dyn_value(o, &mut env, None)?;
        results.push((o.clone(), t));
    }
    match options.loss {
        None => {
            for (o, t) in results {
                m.output(o, t);
            }
        }
        Some(loss) => {
            let Some((last, logits)) = results.pop() else {
                return Err(im.model_error("the graph has no outputs").into());
            };
            let loss = build_loss(&im, &m, loss, &last, logits, &structure)?;
            m.set_position("loss", Some(LayerId::Loss), None);
            m.output("loss", loss);
        }
    }
    check(&im, &m, usize::MAX)?;
    let graph = m.finish()?;
    Ok(Imported { graph, report })
}

/// The loss over the last output `logits` (layer [`LayerId::Loss`]).
fn build_loss<'m>(
    im: &Importer,
    m: &'m ModelBuilder,
    loss: Loss,
    output: &str,
    logits: Tensor<'m>,
    structure: &Structure,
) -> Result<Tensor<'m>, FrontendError> {
    m.set_position("loss", Some(LayerId::Loss), None);
    let Some(ty) = logits.ty() else {
        return Err(im
            .model_error(format!("output `{output}` has no type"))
            .into());
    };
    let dims = ty.dims().to_vec();
    let all: Vec<usize> = (0..dims.len()).collect();
    match loss {
        Loss::CrossEntropy => {
            let Some((&vocab, lead)) = dims.split_last().filter(|_| ty.dtype.is_float()) else {
                return Err(im
                    .model_error(format!(
                        "--loss ce needs float logits [..., vocab]; output `{output}` is {ty}"
                    ))
                    .into());
            };
            let dtype = structure.token_dtype.unwrap_or(DType::I64);
            let targets = m.input(
                "targets",
                dtype,
                lead.to_vec(),
                InputRole::NextTokens { vocab },
            );
            let dims: Vec<usize> = (0..lead.len()).collect();
            let logits = if ty.dtype == DType::F32 {
                logits
            } else {
                logits.cast(DType::F32)
            };
            Ok(logits.cross_entropy(targets).mean(dims))
        }
        Loss::Mse => {
            let targets = m.input("targets", ty.dtype, dims, InputRole::RegressionTargets);
            Ok((logits - targets).square().mean(all).cast(DType::F32))
        }
    }
}

/// Fails with the builder's first error, attributed to node `i`.
fn check(im: &Importer, m: &ModelBuilder, i: usize) -> Result<(), FrontendError> {
    match m.error() {
        None => Ok(()),
        Some(e) if i < im.nodes.len() => Err(im.node_error(i, e.to_string()).into()),
        Some(e) => Err(e),
    }
}

/// A readable scope from an exporter's node name (`/h.0/attn/MatMul` -> `h.0.attn`).
fn scope_of(node: &str) -> String {
    let mut parts: Vec<&str> = node.split('/').filter(|p| !p.is_empty()).collect();
    parts.pop();
    parts.join(".")
}

fn node_rec(i: usize, n: &NodeProto) -> NodeRec {
    NodeRec {
        name: n
            .name
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("#{i}")),
        op: n.op_type.clone().unwrap_or_default(),
        domain: n.domain.clone().unwrap_or_default(),
        inputs: n.input.clone(),
        outputs: n.output.clone(),
        attrs: n.attribute.clone(),
    }
}

/// The type of graph input `name`: its element type, and its dims with every symbolic dim
/// set to `batch` (default 1).
fn input_type(
    im: &Importer,
    name: &str,
    ty: Option<&super::proto::TypeProto>,
    batch: Option<usize>,
) -> Result<TensorType, FrontendError> {
    let Some(type_proto::Value::TensorType(t)) = ty.and_then(|t| t.value.as_ref()) else {
        return Err(im
            .model_error(format!("input `{name}` is not a tensor"))
            .into());
    };
    let elem = t.elem_type.unwrap_or(0);
    let dtype = tensor::dtype_of(elem).ok_or_else(|| {
        im.model_error(format!(
            "input `{name}`: element type {elem} is not supported"
        ))
    })?;
    let shape = t
        .shape
        .as_ref()
        .ok_or_else(|| im.model_error(format!("input `{name}` has no shape")))?;
    let mut dims = Vec::new();
    for d in &shape.dim {
        use super::proto::tensor_shape_proto::dimension::Value as D;
        let size = match &d.value {
            Some(D::DimValue(v)) if *v > 0 => *v as usize,
            Some(D::DimValue(v)) => {
                return Err(im.model_error(format!("input `{name}` has dim {v}")).into());
            }
            Some(D::DimParam(_)) | None => batch.unwrap_or(1),
        };
        if size > crate::zoo::MAX_SIZE {
            return Err(im
                .model_error(format!("input `{name}`: dim {size} is above the limit"))
                .into());
        }
        dims.push(size);
    }
    Ok(TensorType::new(dtype, dims))
}

/// Emits the nodes of the model's graph.
struct Emitter<'a, 'm> {
    im: &'a Importer,
    m: &'m ModelBuilder,
    structure: &'a Structure,
    params: &'a mut HashMap<String, Tensor<'m>>,
    report: &'a mut ImportReport,
}

impl<'m> Emitter<'_, 'm> {
    fn operands(
        &mut self,
        i: usize,
        env: &mut HashMap<String, Operand<'m>>,
    ) -> Result<Vec<Option<Operand<'m>>>, FrontendError> {
        let node = &self.im.nodes[i];
        let mut out = Vec::new();
        for name in &node.inputs {
            if name.is_empty() {
                out.push(None);
                continue;
            }
            let op = match self.im.vals.get(name) {
                Some(Val::Known { t, init }) => match init {
                    // Initializers reach ops as parameters, except where only their values
                    // matter (shapes, axes).
                    Some(n) if self.consumes_as_data(i) => Operand::Dyn(self.param(n)?),
                    None if self.consumes_as_data(i) && self.im.param_derived(name, 8) => {
                        Operand::Dyn(self.derived(name, 8)?)
                    }
                    _ => Operand::Known(t.clone(), init.clone()),
                },
                _ => match env.get(name) {
                    Some(op) => op.clone(),
                    None => {
                        return Err(self
                            .im
                            .node_error(i, format!("input `{name}` is not computed before it"))
                            .into());
                    }
                },
            };
            out.push(Some(op));
        }
        Ok(out)
    }

    /// The value `name`, folded from a weight by layout ops ([`Importer::param_derived`]),
    /// computed from the weight's parameter so that it is trained as that weight.
    fn derived(&mut self, name: &str, depth: usize) -> Result<Tensor<'m>, FrontendError> {
        let Some(&i) = self.im.producer.get(name) else {
            return Err(self
                .im
                .model_error(format!("`{name}` has no producer"))
                .into());
        };
        let node = &self.im.nodes[i];
        let mut ops = Vec::new();
        for (k, v) in node.inputs.iter().enumerate() {
            ops.push(match (k, self.im.vals.get(v)) {
                (_, None) => None,
                (0, Some(Val::Known { init: Some(n), .. })) => {
                    Some(Operand::Dyn(self.param(&n.clone())?))
                }
                (0, Some(Val::Known { .. })) if depth > 0 => {
                    Some(Operand::Dyn(self.derived(v, depth - 1)?))
                }
                (_, Some(Val::Known { t, init })) => Some(Operand::Known(t.clone(), init.clone())),
                (_, Some(Val::Dyn(_))) => {
                    return Err(self
                        .im
                        .model_error(format!("`{name}` is computed from the data"))
                        .into());
                }
            });
        }
        match self.im.lower(i, self.m, &ops, false)?.into_iter().next() {
            Some(Operand::Dyn(t)) => {
                check(self.im, self.m, i)?;
                Ok(t)
            }
            _ => Err(self
                .im
                .node_error(i, "a weight's layout op gave no value")
                .into()),
        }
    }

    /// Whether node `i` computes on data (so an initializer operand is a weight), rather
    /// than being folded.
    fn consumes_as_data(&self, i: usize) -> bool {
        self.im.nodes[i]
            .outputs
            .iter()
            .any(|o| matches!(self.im.vals.get(o), Some(Val::Dyn(_))))
    }

    /// The parameter of initializer `name`, declared on first use in its shape.
    fn param(&mut self, name: &str) -> Result<Tensor<'m>, FrontendError> {
        if let Some(t) = self.params.get(name) {
            return Ok(*t);
        }
        if let Some(table) = self.im.tied.get(name) {
            let table = self.param(&table.clone())?;
            return Ok(table.transpose([1, 0]));
        }
        let Some(Val::Known { t, .. }) = self.im.vals.get(name) else {
            return Err(self
                .im
                .model_error(format!("`{name}` is not an initializer"))
                .into());
        };
        let mut values: Vec<f32> = (0..t.num_elements())
            .map(|i| t.data.f64(i) as f32)
            .collect();
        let mut dims = self
            .im
            .param_shapes
            .get(name)
            .cloned()
            .unwrap_or_else(|| t.dims.clone());
        if self.im.param_transposed.contains(name)
            && let [r, c] = dims[..]
        {
            let mut tr = vec![0f32; values.len()];
            for a in 0..r {
                for b in 0..c {
                    tr[b * r + a] = values[a * c + b];
                }
            }
            values = tr;
            dims = vec![c, r];
        }
        let (scope, layer, part) = self.m.position();
        self.m.set_position("", layer, part);
        let p = self
            .m
            .param_typed(name, DType::F32, dims, Init::Values(Values::new(values)));
        self.m.set_position(&scope, layer, part);
        let p = match self.structure.roles.get(name) {
            Some(&role) => megatron(p.role(role), role),
            None => p,
        };
        self.params.insert(name.to_string(), p);
        Ok(p)
    }

    /// The IR value of `name` for a data consumer: emitted, an initializer's parameter, or a
    /// known tensor made a value (`like` gives the type a uniform one is filled to).
    fn dyn_value(
        &mut self,
        name: &str,
        env: &mut HashMap<String, Operand<'m>>,
        like: Option<&TensorType>,
    ) -> Result<Tensor<'m>, FrontendError> {
        if let Some(Val::Known { init: Some(n), .. }) = self.im.vals.get(name) {
            let t = self.param(&n.clone())?;
            // A parameter declared in another shape is read in the file's.
            let dims = self.im.vals[name].dims();
            return Ok(
                if t.shape().dims() != dims.as_slice() && !self.im.tied.contains_key(name) {
                    t.reshape(dims)
                } else {
                    t
                },
            );
        }
        match env.get(name) {
            Some(Operand::Dyn(t)) => Ok(*t),
            Some(Operand::Known(t, _)) => {
                let t = t.clone();
                materialize(self.im, self.m, &t, like, name, Some(self.report))
            }
            None => match self.im.vals.get(name) {
                Some(Val::Known { t, .. }) => {
                    let t = t.clone();
                    materialize(self.im, self.m, &t, like, name, Some(self.report))
                }
                _ => Err(self
                    .im
                    .model_error(format!("value `{name}` is not computed"))
                    .into()),
            },
        }
    }

    /// Emits raised op `r` at node `i`.
    fn raised(
        &mut self,
        i: usize,
        r: &Raised,
        env: &mut HashMap<String, Operand<'m>>,
    ) -> Result<Tensor<'m>, FrontendError> {
        let t = match r {
            Raised::RmsNorm { x, gamma, eps } => {
                let x = self.dyn_value(x, env, None)?;
                let g = self.dyn_value(gamma, env, None)?;
                x.rms_norm(g, *eps)
            }
            Raised::LayerNorm {
                x,
                gamma,
                beta,
                eps,
            } => {
                let x = self.dyn_value(x, env, None)?;
                let g = self.dyn_value(gamma, env, None)?;
                let b = self.dyn_value(beta, env, None)?;
                x.layer_norm(g, b, *eps)
            }
            Raised::Gelu { x } => self.dyn_value(x, env, None)?.gelu(),
            Raised::GeluErf { x } => self.dyn_value(x, env, None)?.unary(UnaryOp::GeluErf),
            Raised::Silu { x } => self.dyn_value(x, env, None)?.silu(),
            Raised::Projection { x, w, b } => {
                let x = self.dyn_value(x, env, None)?;
                let w = self.param(w)?;
                let y = x.einsum("bsh,hnd->bsnd", w);
                match b {
                    Some(b) => y.add_bias(self.param(b)?),
                    None => y,
                }
            }
            Raised::OutProjection { x, w, b } => {
                let x = self.dyn_value(x, env, None)?;
                let w = self.param(w)?;
                let y = x.einsum("bsnd,ndh->bsh", w);
                match b {
                    Some(b) => y.add_bias(self.param(b)?),
                    None => y,
                }
            }
            Raised::Head { x, w } => {
                let x = self.dyn_value(x, env, None)?;
                let w = match self.im.tied.get(w) {
                    Some(table) => self.param(&table.clone())?,
                    None => self.param(w)?,
                };
                x.einsum("bsh,vh->bsv", w)
            }
            Raised::Attention {
                q,
                k,
                v,
                causal,
                scale,
            } => {
                let q = self.expr(q, env)?;
                let k = self.expr(k, env)?;
                let v = self.expr(v, env)?;
                match causal {
                    true => q.causal_attention(k, v, *scale),
                    false => q.attention(k, v, *scale),
                }
            }
        };
        check(self.im, self.m, i)?;
        Ok(t)
    }

    fn expr(
        &mut self,
        e: &Expr,
        env: &mut HashMap<String, Operand<'m>>,
    ) -> Result<Tensor<'m>, FrontendError> {
        Ok(match e {
            Expr::Value(name) => self.dyn_value(name, env, None)?,
            Expr::Transpose(inner, perm) => self.expr(inner, env)?.transpose(perm),
            Expr::Rotary(inner, base) => self.expr(inner, env)?.rotary(*base),
        })
    }
}

/// The tensor-parallel split the zoo's model code writes for a weight of `role` (Megatron's
/// column and row splits, the vocabulary-parallel embedding), so that an imported model is
/// annotated as the same model written with the builder would be. An annotation file
/// (`--annotate`) overrides it, as it does the zoo's.
fn megatron(p: Tensor<'_>, role: WeightRole) -> Tensor<'_> {
    let rank = p.rank();
    let dim = match (role, rank) {
        (WeightRole::TokenEmbedding | WeightRole::Head, 2) => Some(0),
        (WeightRole::Query | WeightRole::Key | WeightRole::Value, 3) => Some(1),
        (WeightRole::Query | WeightRole::Key | WeightRole::Value, 2) => Some(0),
        (WeightRole::AttentionOut, 3) => Some(0),
        (WeightRole::MlpIn | WeightRole::MlpGate, 2) => Some(1),
        (WeightRole::MlpIn | WeightRole::MlpGate, 1) => Some(0),
        (WeightRole::MlpOut, 2) => Some(0),
        _ => None,
    };
    match dim {
        Some(d) => p.shard(d, autopar_ir::axis::TP),
        None => p,
    }
}

/// A known tensor as an IR value: a fill constant when uniform (of type `like` when given),
/// else a parameter holding its values (reported: it will be trained).
fn materialize<'m>(
    im: &Importer,
    m: &'m ModelBuilder,
    t: &HostTensor,
    like: Option<&TensorType>,
    name: &str,
    report: Option<&mut ImportReport>,
) -> Result<Tensor<'m>, FrontendError> {
    if let Some(v) = t.uniform() {
        let ty = like
            .cloned()
            .unwrap_or_else(|| TensorType::new(t.dtype, t.dims.clone()));
        return Ok(m.constant(v, ty.dtype, ty.shape));
    }
    if !t.dtype.is_float() {
        return Err(im
            .model_error(format!(
                "`{name}`: a constant {} tensor of shape {:?} with varying values feeds the \
                 computation; only uniform integer constants are supported",
                t.dtype, t.dims
            ))
            .into());
    }
    if let Some(report) = report {
        report.constant_parameters.push(name.to_string());
    }
    let values: Vec<f32> = (0..t.num_elements())
        .map(|i| t.data.f64(i) as f32)
        .collect();
    let (scope, layer, part) = m.position();
    m.set_position("", layer, part);
    let p = m.param_typed(
        format!("const:{name}"),
        DType::F32,
        t.dims.clone(),
        Init::Values(Values::new(values)),
    );
    m.set_position(&scope, layer, part);
    Ok(p)
}

impl Importer {
    /// The operands of node `i` in the typing pass: known values stay known.
    fn operands<'m>(
        &self,
        i: usize,
        m: &'m ModelBuilder,
        env: &mut HashMap<String, Operand<'m>>,
    ) -> Result<Vec<Option<Operand<'m>>>, FrontendError> {
        let node = &self.nodes[i];
        let mut out = Vec::new();
        for name in &node.inputs {
            if name.is_empty() {
                out.push(None);
                continue;
            }
            let op = match self.vals.get(name) {
                Some(Val::Known { t, init }) => Operand::Known(t.clone(), init.clone()),
                Some(Val::Dyn(_)) => env.get(name).cloned().ok_or_else(|| {
                    self.node_error(i, format!("input `{name}` is not computed before it"))
                })?,
                None => {
                    return Err(self
                        .node_error(i, format!("input `{name}` is not computed before it"))
                        .into());
                }
            };
            out.push(Some(op));
        }
        let _ = m;
        Ok(out)
    }

    /// Records the results of node `i` from the typing pass.
    fn record<'m>(
        &mut self,
        i: usize,
        m: &'m ModelBuilder,
        results: &[Operand<'m>],
        env: &mut HashMap<String, Operand<'m>>,
    ) -> Result<(), FrontendError> {
        if let Some(e) = m.error() {
            return Err(self.node_error(i, e.to_string()).into());
        }
        let outputs = self.nodes[i].outputs.clone();
        for (o, r) in outputs.iter().zip(results) {
            if o.is_empty() {
                continue;
            }
            if self.vals.contains_key(o) {
                return Err(self
                    .node_error(i, format!("value `{o}` is defined twice"))
                    .into());
            }
            let val = match r {
                Operand::Known(t, init) => Val::Known {
                    t: t.clone(),
                    init: init.clone(),
                },
                Operand::Dyn(t) => Val::Dyn(t.ty().ok_or_else(|| self.node_error(i, "no type"))?),
            };
            self.vals.insert(o.clone(), val);
            env.insert(o.clone(), r.clone());
        }
        Ok(())
    }

    /// The values the outputs need, walking back from them: a raised node needs the leaves
    /// of its pattern, any other node its computed inputs.
    fn liveness(&self, raised: &HashMap<usize, Raised>, outputs: &[String]) -> HashSet<String> {
        let mut needed: HashSet<String> = outputs.iter().cloned().collect();
        for i in (0..self.nodes.len()).rev() {
            let node = &self.nodes[i];
            if !node.outputs.iter().any(|o| needed.contains(o)) {
                continue;
            }
            match raised.get(&i) {
                Some(r) => needed.extend(r.leaves()),
                None => needed.extend(node.inputs.iter().filter(|s| !s.is_empty()).cloned()),
            }
        }
        needed
    }

    /// Lowers node `i`: folds it when every operand is known, else emits IR ops into `m`.
    fn lower<'m>(
        &self,
        i: usize,
        m: &'m ModelBuilder,
        ops: &[Option<Operand<'m>>],
        typing: bool,
    ) -> Result<Vec<Operand<'m>>, FrontendError> {
        let node = &self.nodes[i];
        let err = |detail: String| -> FrontendError { self.node_error(i, detail).into() };
        let op_at = |k: usize| -> Result<&Operand<'m>, FrontendError> {
            ops.get(k)
                .and_then(Option::as_ref)
                .ok_or_else(|| err(format!("input {k} is missing")))
        };
        let known_at = |k: usize| -> Result<&HostTensor, FrontendError> {
            match op_at(k)? {
                Operand::Known(t, _) => Ok(t),
                Operand::Dyn(_) => Err(err(format!(
                    "input {k} must be a constant (it is computed from the data)"
                ))),
            }
        };
        let all_known = ops
            .iter()
            .all(|o| matches!(o, None | Some(Operand::Known(..))));
        let known = |t: HostTensor| -> Result<Vec<Operand<'m>>, FrontendError> {
            if t.num_elements() > MAX_FOLDED_ELEMENTS {
                return Err(err(format!(
                    "a constant of {} elements is too large to fold",
                    t.num_elements()
                )));
            }
            Ok(vec![Operand::Known(t, None)])
        };
        let dyn1 = |t: Tensor<'m>| Ok(vec![Operand::Dyn(t)]);
        let ty_of = |o: &Operand<'m>| -> Option<TensorType> {
            match o {
                Operand::Known(t, _) => Some(TensorType::new(t.dtype, t.dims.clone())),
                Operand::Dyn(t) => t.ty(),
            }
        };
        let rank_of = |k: usize| -> Result<usize, FrontendError> {
            Ok(ty_of(op_at(k)?).map_or(0, |t| t.rank()))
        };
        let axis = |a: i64, rank: usize| -> Result<usize, FrontendError> {
            let r = rank as i64;
            let a2 = if a < 0 { a + r } else { a };
            if (0..r).contains(&a2) {
                Ok(a2 as usize)
            } else {
                Err(err(format!("axis {a} is out of range for rank {rank}")))
            }
        };
        // An operand as an IR value; a known one made a value of type `like` if uniform.
        let value = |k: usize, like: Option<&TensorType>| -> Result<Tensor<'m>, FrontendError> {
            match op_at(k)? {
                Operand::Dyn(t) => Ok(*t),
                // The typing pass needs only types: any fill will do.
                Operand::Known(t, _) if typing => {
                    let ty = like
                        .cloned()
                        .unwrap_or_else(|| TensorType::new(t.dtype, t.dims.clone()));
                    Ok(m.constant(0.0, ty.dtype, ty.shape))
                }
                Operand::Known(t, _) => materialize(self, m, t, like, &node.inputs[k], None),
            }
        };

        let op = node.op.as_str();
        match op {
            "Identity" | "Dropout" => {
                let mut out = vec![op_at(0)?.clone()];
                if node.outputs.len() > 1 && op == "Dropout" {
                    return Err(err("the mask output of Dropout is not supported".into()));
                }
                if let Operand::Known(t, _) = &out[0] {
                    // An alias of an initializer is still that parameter.
                    out[0] = Operand::Known(
                        t.clone(),
                        ops[0].as_ref().and_then(|o| match o {
                            Operand::Known(_, init) => init.clone(),
                            Operand::Dyn(_) => None,
                        }),
                    );
                }
                Ok(out)
            }
            "Constant" => {
                let t = if let Some(a) = node.attr("value") {
                    let tp =
                        a.t.as_ref()
                            .ok_or_else(|| err("`value` is not a tensor".into()))?;
                    tensor::decode(tp, self.data_dir.as_deref()).map_err(err)?
                } else if let Some(a) = node.attr("value_float") {
                    HostTensor {
                        dtype: DType::F32,
                        dims: vec![],
                        data: HostData::Float(vec![f64::from(a.f.unwrap_or(0.0))]),
                    }
                } else if let Some(a) = node.attr("value_floats") {
                    HostTensor {
                        dtype: DType::F32,
                        dims: vec![a.floats.len()],
                        data: HostData::Float(a.floats.iter().map(|&x| f64::from(x)).collect()),
                    }
                } else if let Some(a) = node.attr("value_int") {
                    HostTensor::ints(vec![], vec![a.i.unwrap_or(0)])
                } else if let Some(a) = node.attr("value_ints") {
                    HostTensor::ints(vec![a.ints.len()], a.ints.clone())
                } else {
                    return Err(err("no supported value attribute".into()));
                };
                known(t)
            }
            "Shape" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let r = dims.len() as i64;
                let clamp = |a: i64| (if a < 0 { a + r } else { a }).clamp(0, r) as usize;
                let start = clamp(node.int("start", 0));
                let end = clamp(node.int("end", r));
                let dims: Vec<i64> = dims
                    .get(start..end.max(start))
                    .unwrap_or(&[])
                    .iter()
                    .map(|&d| d as i64)
                    .collect();
                known(HostTensor::ints(vec![dims.len()], dims))
            }
            "ConstantOfShape" => {
                let shape = known_at(0)?.as_i64s();
                let n = tensor::element_count(&shape)
                    .ok_or_else(|| err(format!("invalid shape {shape:?}")))?;
                let (dtype, v) = match node.attr("value").and_then(|a| a.t.as_ref()) {
                    Some(tp) => {
                        let t = tensor::decode(tp, None).map_err(err)?;
                        (
                            t.dtype,
                            t.scalar()
                                .ok_or_else(|| err("`value` must have one element".into()))?,
                        )
                    }
                    None => (DType::F32, 0.0),
                };
                let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                if n > MAX_FOLDED_ELEMENTS {
                    check_dims(&dims).map_err(err)?;
                    return dyn1(m.constant(v, dtype, dims));
                }
                known(fill(dtype, dims, v, n))
            }
            "Range" => {
                let (s, l, d) = (known_at(0)?, known_at(1)?, known_at(2)?);
                let (start, limit, delta) = (
                    s.scalar()
                        .ok_or_else(|| err("start must be a scalar".into()))?,
                    l.scalar()
                        .ok_or_else(|| err("limit must be a scalar".into()))?,
                    d.scalar()
                        .ok_or_else(|| err("delta must be a scalar".into()))?,
                );
                if delta == 0.0 || !(start.is_finite() && limit.is_finite() && delta.is_finite()) {
                    return Err(err("delta must be finite and non-zero".into()));
                }
                let count = ((limit - start) / delta).ceil().max(0.0);
                if count > MAX_FOLDED_ELEMENTS as f64 {
                    return Err(err(format!("a range of {count} elements is too large")));
                }
                let n = count as usize;
                let vals: Vec<f64> = (0..n).map(|k| start + k as f64 * delta).collect();
                known(HostTensor {
                    dtype: s.dtype,
                    dims: vec![n],
                    data: match s.dtype.is_float() {
                        true => HostData::Float(vals),
                        false => HostData::Int(vals.iter().map(|&x| x as i64).collect()),
                    },
                })
            }
            "Cast" => {
                let to = tensor::dtype_of(node.int("to", 1) as i32).ok_or_else(|| {
                    err(format!(
                        "cast to element type {} is not supported",
                        node.int("to", 1)
                    ))
                })?;
                match op_at(0)? {
                    Operand::Known(t, _) => known(cast_host(t, to)),
                    Operand::Dyn(t) if t.ty().map(|t| t.dtype) == Some(to) => dyn1(*t),
                    Operand::Dyn(t) => dyn1(t.cast(to)),
                }
            }
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Max" | "Min" | "Equal" | "Less"
            | "Greater" | "And" | "Or" => {
                let (a, b) = (ty_of(op_at(0)?), ty_of(op_at(1)?));
                let (Some(a), Some(b)) = (a, b) else {
                    return Err(err("operands have no type".into()));
                };
                let out = broadcast_dims(a.dims(), b.dims())
                    .ok_or_else(|| err(format!("shapes {a} and {b} do not broadcast")))?;
                if all_known {
                    return known(binary_host(op, known_at(0)?, known_at(1)?, &out).map_err(err)?);
                }
                let dtype = if matches!(op_at(0)?, Operand::Dyn(_)) {
                    a.dtype
                } else {
                    b.dtype
                };
                let out_ty = TensorType::new(dtype, out.clone());
                let x = broadcast(value(0, Some(&out_ty))?, &out);
                let y = broadcast(value(1, Some(&out_ty))?, &out);
                dyn1(match op {
                    "Add" => x + y,
                    "Sub" => x - y,
                    "Mul" => x * y,
                    "Div" => x / y,
                    "Pow" => x.pow(y),
                    "Max" => x.max(y),
                    "Min" => x.min(y),
                    "Equal" => x.compare(CompareOp::Eq, y),
                    "Less" => x.compare(CompareOp::Lt, y),
                    "Greater" => x.compare(CompareOp::Gt, y),
                    _ => {
                        return Err(err(
                            "logical ops on computed values are not supported".into()
                        ));
                    }
                })
            }
            "Where" => {
                let tys: Vec<TensorType> = (0..3)
                    .map(|k| op_at(k).map(&ty_of))
                    .collect::<Result<Vec<_>, _>>()?
                    .into_iter()
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| err("operands have no type".into()))?;
                let out = broadcast_dims(tys[0].dims(), tys[1].dims())
                    .and_then(|d| broadcast_dims(&d, tys[2].dims()))
                    .ok_or_else(|| err("operand shapes do not broadcast".into()))?;
                if all_known {
                    let (c, a, b) = (known_at(0)?, known_at(1)?, known_at(2)?);
                    if out
                        .iter()
                        .try_fold(1usize, |n, &d| n.checked_mul(d))
                        .is_none_or(|n| n > MAX_FOLDED_ELEMENTS)
                    {
                        return Err(err("the selected constant is too large to fold".into()));
                    }
                    return known(where_host(c, a, b, &out));
                }
                let dtype = if matches!(op_at(1)?, Operand::Dyn(_)) {
                    tys[1].dtype
                } else {
                    tys[2].dtype
                };
                let like = TensorType::new(dtype, out.clone());
                let cond_like = TensorType::new(DType::Bool, out.clone());
                let c = broadcast(value(0, Some(&cond_like))?, &out);
                let a = broadcast(value(1, Some(&like))?, &out);
                let b = broadcast(value(2, Some(&like))?, &out);
                dyn1(c.select(a, b))
            }
            "Neg" | "Sqrt" | "Reciprocal" | "Exp" | "Tanh" | "Sigmoid" | "Relu" | "Log" | "Abs"
            | "Cos" | "Sin" | "Erf" | "Not" => {
                if all_known {
                    return known(unary_host(op, known_at(0)?).map_err(err)?);
                }
                let x = value(0, None)?;
                let func = match op {
                    "Neg" => UnaryOp::Neg,
                    "Sqrt" => UnaryOp::Sqrt,
                    "Reciprocal" => UnaryOp::Recip,
                    "Exp" => UnaryOp::Exp,
                    "Tanh" => UnaryOp::Tanh,
                    "Sigmoid" => UnaryOp::Sigmoid,
                    "Relu" => UnaryOp::Relu,
                    "Log" => UnaryOp::Log,
                    "Abs" => UnaryOp::Abs,
                    "Erf" => UnaryOp::Erf,
                    _ => {
                        return Err(err(format!(
                            "`{op}` on computed values has no autopar op (only on constants)"
                        )));
                    }
                };
                dyn1(x.unary(func))
            }
            "Gelu" => {
                let x = value(0, None)?;
                match node.string("approximate").as_deref() {
                    Some("tanh") => dyn1(x.gelu()),
                    Some("none") | None => dyn1(x.unary(UnaryOp::GeluErf)),
                    Some(other) => Err(err(format!("GELU with approximate='{other}'"))),
                }
            }
            "Reshape" | "Unsqueeze" | "Squeeze" | "Flatten" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let out = match op {
                    "Reshape" => {
                        let shape = known_at(1)?.as_i64s();
                        reshape_dims(&dims, &shape, node.int("allowzero", 0) != 0).map_err(err)?
                    }
                    "Flatten" => {
                        let a = axis(node.int("axis", 1), dims.len() + 1)?;
                        let lead: usize = dims[..a.min(dims.len())].iter().product();
                        let rest: usize = dims[a.min(dims.len())..].iter().product();
                        vec![lead, rest]
                    }
                    _ => {
                        let axes = match node.input(1) {
                            Some(_) => known_at(1)?.as_i64s(),
                            None => node.ints("axes").unwrap_or_default(),
                        };
                        if op == "Unsqueeze" {
                            let r = dims.len() + axes.len();
                            let mut ax: Vec<usize> =
                                axes.iter().map(|&a| axis(a, r)).collect::<Result<_, _>>()?;
                            ax.sort_unstable();
                            ax.dedup();
                            if ax.len() != axes.len() {
                                return Err(err("repeated axes".into()));
                            }
                            let mut out = Vec::with_capacity(r);
                            let mut src = dims.iter();
                            for k in 0..r {
                                if ax.contains(&k) {
                                    out.push(1);
                                } else {
                                    out.push(*src.next().unwrap_or(&1));
                                }
                            }
                            out
                        } else {
                            let ax: Vec<usize> = if axes.is_empty() {
                                (0..dims.len()).filter(|&k| dims[k] == 1).collect()
                            } else {
                                axes.iter()
                                    .map(|&a| axis(a, dims.len()))
                                    .collect::<Result<_, _>>()?
                            };
                            if ax.iter().any(|&k| dims[k] != 1) {
                                return Err(err("squeezing a dim whose size is not 1".into()));
                            }
                            dims.iter()
                                .enumerate()
                                .filter(|(k, _)| !ax.contains(k))
                                .map(|(_, &d)| d)
                                .collect()
                        }
                    }
                };
                match op_at(0)? {
                    Operand::Known(t, _) => {
                        let mut t = t.clone();
                        t.dims = out;
                        known(t)
                    }
                    Operand::Dyn(t) if t.shape().dims() == out.as_slice() => dyn1(*t),
                    Operand::Dyn(t) => dyn1(t.reshape(out)),
                }
            }
            "Transpose" => {
                let rank = rank_of(0)?;
                let perm: Vec<usize> = match node.ints("perm") {
                    Some(p) => p.iter().map(|&a| axis(a, rank)).collect::<Result<_, _>>()?,
                    None => (0..rank).rev().collect(),
                };
                let mut sorted = perm.clone();
                sorted.sort_unstable();
                if sorted != (0..rank).collect::<Vec<_>>() {
                    return Err(err(format!("perm {perm:?} is not a permutation")));
                }
                match op_at(0)? {
                    Operand::Known(t, _) => known(transpose_host(t, &perm)),
                    Operand::Dyn(t) => dyn1(t.transpose(perm)),
                }
            }
            "Slice" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let starts = known_at(1)?.as_i64s();
                let ends = known_at(2)?.as_i64s();
                let axes = match node.input(3) {
                    Some(_) => known_at(3)?.as_i64s(),
                    None => (0..starts.len() as i64).collect(),
                };
                let steps = match node.input(4) {
                    Some(_) => known_at(4)?.as_i64s(),
                    None => vec![1; starts.len()],
                };
                if ends.len() != starts.len()
                    || axes.len() != starts.len()
                    || steps.len() != starts.len()
                {
                    return Err(err("starts, ends, axes and steps differ in length".into()));
                }
                let mut ranges = Vec::new();
                for k in 0..starts.len() {
                    let a = axis(axes[k], dims.len())?;
                    let size = dims[a] as i64;
                    let step = steps[k];
                    if step != 1 && !matches!(op_at(0)?, Operand::Known(..)) {
                        return Err(err(
                            "only steps of 1 are supported on computed values".into()
                        ));
                    }
                    if step == 0 {
                        return Err(err("a step of 0".into()));
                    }
                    let norm = |v: i64, lo: i64, hi: i64| {
                        (if v < 0 { v.saturating_add(size) } else { v }).clamp(lo, hi)
                    };
                    let (s, e) = if step > 0 {
                        (norm(starts[k], 0, size), norm(ends[k], 0, size))
                    } else {
                        (norm(starts[k], -1, size - 1), norm(ends[k], -1, size - 1))
                    };
                    ranges.push((a, s, e, step));
                }
                match op_at(0)? {
                    Operand::Known(t, _) => known(slice_host(t, &ranges)),
                    Operand::Dyn(t) => {
                        let mut t = *t;
                        for (a, s, e, _) in ranges {
                            if e <= s {
                                return Err(err("an empty slice".into()));
                            }
                            if s != 0 || e != dims[a] as i64 {
                                t = t.slice(a, s as usize..e as usize);
                            }
                        }
                        dyn1(t)
                    }
                }
            }
            "Concat" => {
                let rank = rank_of(0)?;
                let a = axis(node.int("axis", 0), rank)?;
                if all_known {
                    let parts: Vec<&HostTensor> =
                        (0..ops.len()).map(known_at).collect::<Result<_, _>>()?;
                    return known(concat_host(&parts, a).map_err(err)?);
                }
                let parts: Vec<Tensor<'m>> = (0..ops.len())
                    .map(|k| value(k, None))
                    .collect::<Result<_, _>>()?;
                dyn1(m.concat(&parts, a))
            }
            "Split" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let a = axis(node.int("axis", 0), dims.len())?;
                let n = node.outputs.len();
                let sizes: Vec<usize> = match node.input(1) {
                    Some(_) => known_at(1)?
                        .as_i64s()
                        .iter()
                        .map(|&s| s.max(0) as usize)
                        .collect(),
                    None => match node.ints("split") {
                        Some(s) if !s.is_empty() => s.iter().map(|&s| s.max(0) as usize).collect(),
                        _ => {
                            let chunk = dims[a].div_ceil(n.max(1));
                            (0..n)
                                .map(|k| chunk.min(dims[a].saturating_sub(k * chunk)))
                                .collect()
                        }
                    },
                };
                if sizes.len() != n || sizes.iter().sum::<usize>() != dims[a] || sizes.contains(&0)
                {
                    return Err(err(format!(
                        "split sizes {sizes:?} do not divide dim {}",
                        dims[a]
                    )));
                }
                let mut out = Vec::new();
                let mut start = 0;
                for s in sizes {
                    let r = start..start + s;
                    start += s;
                    out.push(match op_at(0)? {
                        Operand::Known(t, _) => Operand::Known(
                            slice_host(t, &[(a, r.start as i64, r.end as i64, 1)]),
                            None,
                        ),
                        Operand::Dyn(t) => Operand::Dyn(t.slice(a, r)),
                    });
                }
                Ok(out)
            }
            "Expand" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let shape: Vec<usize> = known_at(1)?
                    .as_i64s()
                    .iter()
                    .map(|&d| d.max(0) as usize)
                    .collect();
                let out = broadcast_dims(&dims, &shape)
                    .ok_or_else(|| err(format!("{dims:?} does not expand to {shape:?}")))?;
                match op_at(0)? {
                    Operand::Known(t, _) => {
                        let z = fill(
                            t.dtype,
                            out.clone(),
                            0.0,
                            tensor::element_count(
                                &out.iter().map(|&d| d as i64).collect::<Vec<_>>(),
                            )
                            .unwrap_or(usize::MAX)
                            .min(MAX_FOLDED_ELEMENTS + 1),
                        );
                        if z.num_elements() > MAX_FOLDED_ELEMENTS {
                            return Err(err("the expanded constant is too large".into()));
                        }
                        known(binary_host("Add", t, &z, &out).map_err(err)?)
                    }
                    Operand::Dyn(t) => dyn1(broadcast(*t, &out)),
                }
            }
            "Gather" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let a = axis(node.int("axis", 0), dims.len())?;
                match (op_at(0)?, op_at(1)?) {
                    (Operand::Known(t, _), Operand::Known(idx, _)) => {
                        known(gather_host(t, idx, a).map_err(err)?)
                    }
                    (_, Operand::Known(idx, _)) => {
                        // Constant indices on computed data: a scalar picks a slice, a run of
                        // consecutive indices is a slice.
                        let x = value(0, None)?;
                        let v: Vec<i64> = idx
                            .as_i64s()
                            .iter()
                            .map(|&k| if k < 0 { k + dims[a] as i64 } else { k })
                            .collect();
                        let first = *v.first().ok_or_else(|| err("no indices".into()))?;
                        let run = v.iter().enumerate().all(|(j, &k)| k == first + j as i64);
                        if !run || first < 0 || first as usize + v.len() > dims[a] {
                            return Err(err(
                                "constant indices that are not a run of consecutive indices".into(),
                            ));
                        }
                        let y = match first == 0 && v.len() == dims[a] {
                            true => x,
                            false => x.slice(a, first as usize..first as usize + v.len()),
                        };
                        if idx.dims.is_empty() {
                            let mut d = dims.clone();
                            d.remove(a);
                            dyn1(y.reshape(d))
                        } else if idx.dims.len() == 1 {
                            dyn1(y)
                        } else {
                            Err(err("multi-dimensional constant indices".into()))
                        }
                    }
                    (_, Operand::Dyn(ids)) => {
                        if a != 0 {
                            return Err(err(
                                "gathering computed indices along an axis other than 0".into(),
                            ));
                        }
                        let table = value(0, None)?;
                        dyn1(table.gather(*ids))
                    }
                }
            }
            "Trilu" => {
                let t = known_at(0)
                    .map_err(|_| err("Trilu on computed values is not supported".into()))?;
                let k = match node.input(1) {
                    Some(_) => known_at(1)?.scalar().unwrap_or(0.0) as i64,
                    None => 0,
                };
                known(trilu_host(t, k, node.int("upper", 1) != 0).map_err(err)?)
            }
            "Softmax" => {
                let rank = rank_of(0)?;
                let a = axis(node.int("axis", -1), rank)?;
                dyn1(value(0, None)?.softmax(a))
            }
            "LayerNormalization" => {
                let rank = rank_of(0)?;
                let a = axis(node.int("axis", -1), rank)?;
                if a + 1 != rank {
                    return Err(err(
                        "layer norm over more than the last dim is not supported".into(),
                    ));
                }
                if node
                    .outputs
                    .iter()
                    .skip(1)
                    .any(|o| !o.is_empty() && self.uses.get(o).copied().unwrap_or(0) > 0)
                {
                    return Err(err(
                        "the mean and inverse-deviation outputs are not supported".into(),
                    ));
                }
                let x = value(0, None)?;
                let h = x.shape().dims().last().copied().unwrap_or(1);
                let dtype = x.ty().map_or(DType::F32, |t| t.dtype);
                let g = value(1, None)?;
                let b = match ops.get(2).and_then(Option::as_ref) {
                    Some(_) => value(2, None)?,
                    None => m.constant(0.0, dtype, [h]),
                };
                let mut out = vec![Operand::Dyn(x.layer_norm(
                    g,
                    b,
                    node.float("epsilon", 1e-5),
                ))];
                out.resize(
                    node.outputs.len(),
                    Operand::Known(HostTensor::ints(vec![], vec![0]), None),
                );
                Ok(out)
            }
            "ReduceMean" | "ReduceSum" | "ReduceMax" => {
                let dims = ty_of(op_at(0)?)
                    .map(|t| t.dims().to_vec())
                    .unwrap_or_default();
                let axes_in = op == "ReduceSum" || self.opset >= 18;
                let axes = match (axes_in, node.input(1)) {
                    (true, Some(_)) => Some(known_at(1)?.as_i64s()),
                    (true, None) => None,
                    (false, _) => node.ints("axes"),
                };
                let mut ax: Vec<usize> = match axes {
                    Some(a) if !a.is_empty() => a
                        .iter()
                        .map(|&a| axis(a, dims.len()))
                        .collect::<Result<_, _>>()?,
                    _ if node.int("noop_with_empty_axes", 0) != 0 => {
                        return Ok(vec![op_at(0)?.clone()]);
                    }
                    _ => (0..dims.len()).collect(),
                };
                ax.sort_unstable();
                ax.dedup();
                let keep = node.int("keepdims", 1) != 0;
                let out: Vec<usize> = dims
                    .iter()
                    .enumerate()
                    .filter_map(|(k, &d)| match ax.contains(&k) {
                        true => keep.then_some(1),
                        false => Some(d),
                    })
                    .collect();
                if all_known {
                    return known(reduce_host(op, known_at(0)?, &ax, out).map_err(err)?);
                }
                let func = match op {
                    "ReduceMean" => ReduceOp::Mean,
                    "ReduceSum" => ReduceOp::Sum,
                    _ => ReduceOp::Max,
                };
                let r = value(0, None)?.reduce(func, &ax);
                dyn1(if keep { r.reshape(out) } else { r })
            }
            "MatMul" | "Gemm" => {
                let (a, b) = (value(0, None)?, value(1, None)?);
                let (ta, tb) = (node.int("transA", 0) != 0, node.int("transB", 0) != 0);
                let a = if ta { a.transpose([1, 0]) } else { a };
                let b = if tb { b.transpose([1, 0]) } else { b };
                let y = matmul(a, b).map_err(err)?;
                if op == "MatMul" {
                    return dyn1(y);
                }
                let alpha = node.float("alpha", 1.0);
                let y = if alpha != 1.0 { y * alpha } else { y };
                match ops.get(2).and_then(Option::as_ref) {
                    None => dyn1(y),
                    Some(_) => {
                        let out = y.shape().dims().to_vec();
                        let like = y.ty();
                        let c = broadcast(value(2, like.as_ref())?, &out);
                        let beta = node.float("beta", 1.0);
                        dyn1(y + if beta != 1.0 { c * beta } else { c })
                    }
                }
            }
            "Einsum" => {
                let eq = node.string("equation").unwrap_or_default().replace(' ', "");
                if all_known {
                    let parts: Vec<&HostTensor> =
                        (0..ops.len()).map(known_at).collect::<Result<_, _>>()?;
                    return known(einsum_host(&eq, &parts).map_err(err)?);
                }
                let spec: EinsumSpec = eq.parse().map_err(err)?;
                let (a, b) = (value(0, None)?, value(1, None)?);
                dyn1(a.einsum(&spec.to_string(), b))
            }
            _ => Err(OnnxError::UnsupportedOp {
                file: self.file.clone(),
                node: node.name.clone(),
                op: node.op.clone(),
                domain: node.domain.clone(),
                opset: self.opset,
            }
            .into()),
        }
    }
}

/// Checks that dims describe a tensor the IR can hold.
fn check_dims(dims: &[usize]) -> Result<(), String> {
    Shape::from(dims.to_vec()).num_elements();
    if dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
        .is_none()
    {
        return Err(format!("shape {dims:?} is too large"));
    }
    Ok(())
}

/// numpy matmul of two float values, as an einsum.
fn matmul<'m>(a: Tensor<'m>, b: Tensor<'m>) -> Result<Tensor<'m>, String> {
    let (ad, bd) = (a.shape().dims().to_vec(), b.shape().dims().to_vec());
    let letters = ['a', 'c', 'e', 'f', 'g', 'i', 'j', 'l'];
    match (ad.len(), bd.len()) {
        (0, _) | (_, 0) => Err("MatMul of a scalar".into()),
        (1, 1) => Ok(a.einsum("k,k->", b).reshape(Vec::<usize>::new())),
        (1, rb) if rb <= 10 => {
            let lead: String = letters[..bd.len() - 2].iter().collect();
            Ok(a.einsum(&format!("k,{lead}kn->{lead}n"), b))
        }
        (ra, 1) if ra <= 10 => {
            let lead: String = letters[..ad.len() - 2].iter().collect();
            Ok(a.einsum(&format!("{lead}mk,k->{lead}m"), b))
        }
        (3, 2) => Ok(a.einsum("bsh,hf->bsf", b)),
        (ra, 2) if ra <= 10 => {
            let lead: String = letters[..ra - 2].iter().collect();
            Ok(a.einsum(&format!("{lead}mk,kn->{lead}mn"), b))
        }
        (2, rb) if rb <= 10 => {
            let lead: String = letters[..rb - 2].iter().collect();
            Ok(a.einsum(&format!("mk,{lead}kn->{lead}mn"), b))
        }
        (ra, rb) if ra <= 10 && rb <= 10 => {
            let batch = broadcast_dims(&ad[..ra - 2], &bd[..rb - 2])
                .ok_or_else(|| format!("batch dims {ad:?} and {bd:?} do not broadcast"))?;
            let lead: String = letters[..batch.len()].iter().collect();
            let full = |t: Tensor<'m>, d: &[usize]| {
                let mut shape = batch.clone();
                shape.extend_from_slice(&d[d.len() - 2..]);
                broadcast(t, &shape)
            };
            let (a, b) = (full(a, &ad), full(b, &bd));
            Ok(a.einsum(&format!("{lead}mk,{lead}kn->{lead}mn"), b))
        }
        _ => Err("MatMul of operands of rank above 10".into()),
    }
}

/// numpy broadcasting of two shapes.
pub(crate) fn broadcast_dims(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let get = |d: &[usize], k: usize| {
        let off = r - d.len();
        if k < off { 1 } else { d[k - off] }
    };
    (0..r)
        .map(|k| match (get(a, k), get(b, k)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// `t` broadcast (numpy-style, trailing dims aligned) to `out`; unchanged when it has that
/// shape already.
fn broadcast<'m>(t: Tensor<'m>, out: &[usize]) -> Tensor<'m> {
    let dims = t.shape().dims().to_vec();
    if dims == out {
        return t;
    }
    let off = out.len().saturating_sub(dims.len());
    // Size-1 dims that grow are dropped first, so that every broadcast is the IR's
    // (operand dims equal to their result dims, new dims added).
    let kept: Vec<usize> = (0..dims.len())
        .filter(|&k| dims[k] == out[off + k])
        .collect();
    let t = if kept.len() == dims.len() {
        t
    } else {
        t.reshape(kept.iter().map(|&k| dims[k]).collect::<Vec<_>>())
    };
    t.broadcast_to(
        out.to_vec(),
        kept.iter().map(|&k| off + k).collect::<Vec<_>>(),
    )
}

fn fill(dtype: DType, dims: Vec<usize>, v: f64, n: usize) -> HostTensor {
    HostTensor {
        dtype,
        dims,
        data: match dtype.is_float() {
            true => HostData::Float(vec![v; n]),
            false => HostData::Int(vec![v as i64; n]),
        },
    }
}

fn cast_host(t: &HostTensor, to: DType) -> HostTensor {
    let data = match (to.is_float(), &t.data) {
        (true, HostData::Float(v)) => {
            HostData::Float(v.iter().map(|&x| f64::from(x as f32)).collect())
        }
        (true, HostData::Int(v)) => HostData::Float(v.iter().map(|&x| x as f64).collect()),
        (false, HostData::Float(v)) if to == DType::Bool => {
            HostData::Int(v.iter().map(|&x| i64::from(x != 0.0)).collect())
        }
        (false, HostData::Float(v)) => HostData::Int(v.iter().map(|&x| x as i64).collect()),
        (false, HostData::Int(v)) if to == DType::Bool => {
            HostData::Int(v.iter().map(|&x| i64::from(x != 0)).collect())
        }
        (false, HostData::Int(v)) => HostData::Int(v.clone()),
    };
    HostTensor {
        dtype: to,
        dims: t.dims.clone(),
        data,
    }
}

/// Row-major strides.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for k in (0..dims.len().saturating_sub(1)).rev() {
        s[k] = s[k + 1] * dims[k + 1];
    }
    s
}

/// For every element of `out`, the index into a tensor of `dims` broadcast to it.
fn broadcast_index(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let n: usize = out.iter().product();
    let off = out.len() - dims.len();
    let st = strides(dims);
    let ost = strides(out);
    (0..n)
        .map(|i| {
            let mut idx = 0;
            for (k, &d) in dims.iter().enumerate() {
                let c = (i / ost[off + k]) % out[off + k];
                if d != 1 {
                    idx += c * st[k];
                }
            }
            idx
        })
        .collect()
}

fn binary_host(
    op: &str,
    a: &HostTensor,
    b: &HostTensor,
    out: &[usize],
) -> Result<HostTensor, String> {
    let n: usize = out.iter().product();
    if n > MAX_FOLDED_ELEMENTS {
        return Err(format!("a constant of {n} elements is too large to fold"));
    }
    let (ia, ib) = (broadcast_index(&a.dims, out), broadcast_index(&b.dims, out));
    let compare = matches!(op, "Equal" | "Less" | "Greater" | "And" | "Or");
    let float = a.dtype.is_float() || b.dtype.is_float();
    if float || compare {
        let f = |x: f64, y: f64| -> f64 {
            match op {
                "Add" => x + y,
                "Sub" => x - y,
                "Mul" => x * y,
                "Div" => x / y,
                "Pow" => x.powf(y),
                "Max" => x.max(y),
                "Min" => x.min(y),
                "Equal" => f64::from(u8::from(x == y)),
                "Less" => f64::from(u8::from(x < y)),
                "Greater" => f64::from(u8::from(x > y)),
                "And" => f64::from(u8::from(x != 0.0 && y != 0.0)),
                _ => f64::from(u8::from(x != 0.0 || y != 0.0)),
            }
        };
        let v: Vec<f64> = (0..n)
            .map(|i| f(a.data.f64(ia[i]), b.data.f64(ib[i])))
            .collect();
        return Ok(match compare {
            true => HostTensor {
                dtype: DType::Bool,
                dims: out.to_vec(),
                data: HostData::Int(v.iter().map(|&x| x as i64).collect()),
            },
            false => HostTensor {
                dtype: a.dtype,
                dims: out.to_vec(),
                data: HostData::Float(v),
            },
        });
    }
    let (HostData::Int(x), HostData::Int(y)) = (&a.data, &b.data) else {
        return Err("mixed operand types".into());
    };
    let v: Vec<i64> = (0..n)
        .map(|i| {
            let (p, q) = (x[ia[i]], y[ib[i]]);
            match op {
                "Add" => p.wrapping_add(q),
                "Sub" => p.wrapping_sub(q),
                "Mul" => p.wrapping_mul(q),
                "Div" => p.checked_div(q).unwrap_or(0),
                "Pow" => p.wrapping_pow(q.clamp(0, 63) as u32),
                "Max" => p.max(q),
                _ => p.min(q),
            }
        })
        .collect();
    Ok(HostTensor {
        dtype: a.dtype,
        dims: out.to_vec(),
        data: HostData::Int(v),
    })
}

fn where_host(c: &HostTensor, a: &HostTensor, b: &HostTensor, out: &[usize]) -> HostTensor {
    let n: usize = out.iter().product();
    let (ic, ia, ib) = (
        broadcast_index(&c.dims, out),
        broadcast_index(&a.dims, out),
        broadcast_index(&b.dims, out),
    );
    let pick = |i: usize| {
        if c.data.f64(ic[i]) != 0.0 {
            a.data.f64(ia[i])
        } else {
            b.data.f64(ib[i])
        }
    };
    let v: Vec<f64> = (0..n).map(pick).collect();
    HostTensor {
        dtype: a.dtype,
        dims: out.to_vec(),
        data: match a.dtype.is_float() {
            true => HostData::Float(v),
            false => HostData::Int(v.iter().map(|&x| x as i64).collect()),
        },
    }
}

fn unary_host(op: &str, t: &HostTensor) -> Result<HostTensor, String> {
    if matches!(op, "Neg" | "Abs" | "Not")
        && let HostData::Int(v) = &t.data
    {
        let f = |x: i64| match op {
            "Neg" => x.wrapping_neg(),
            "Abs" => x.wrapping_abs(),
            _ => i64::from(x == 0),
        };
        return Ok(HostTensor {
            dtype: t.dtype,
            dims: t.dims.clone(),
            data: HostData::Int(v.iter().map(|&x| f(x)).collect()),
        });
    }
    let f = |x: f64| match op {
        "Neg" => -x,
        "Sqrt" => x.sqrt(),
        "Reciprocal" => 1.0 / x,
        "Exp" => x.exp(),
        "Tanh" => x.tanh(),
        "Sigmoid" => 1.0 / (1.0 + (-x).exp()),
        "Relu" => x.max(0.0),
        "Log" => x.ln(),
        "Abs" => x.abs(),
        "Cos" => x.cos(),
        "Sin" => x.sin(),
        "Not" => f64::from(u8::from(x == 0.0)),
        _ => libm::erf(x),
    };
    let v: Vec<f64> = (0..t.num_elements()).map(|i| f(t.data.f64(i))).collect();
    Ok(HostTensor {
        dtype: if t.dtype.is_float() {
            t.dtype
        } else {
            DType::F32
        },
        dims: t.dims.clone(),
        data: HostData::Float(v),
    })
}

fn reshape_dims(dims: &[usize], shape: &[i64], allowzero: bool) -> Result<Vec<usize>, String> {
    let total: usize = dims.iter().product();
    let mut out = Vec::with_capacity(shape.len());
    let mut infer = None;
    for (k, &s) in shape.iter().enumerate() {
        match s {
            -1 if infer.is_none() => {
                infer = Some(k);
                out.push(1);
            }
            0 if !allowzero => out.push(
                *dims
                    .get(k)
                    .ok_or("a 0 in the shape past the input's rank")?,
            ),
            s if s >= 0 => out.push(s as usize),
            _ => return Err(format!("invalid shape {shape:?}")),
        }
    }
    let known: usize = out
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or("shape overflows")?;
    if let Some(k) = infer {
        if known == 0 || !total.is_multiple_of(known) {
            return Err(format!("cannot reshape {dims:?} to {shape:?}"));
        }
        out[k] = total / known;
    } else if known != total {
        return Err(format!("cannot reshape {dims:?} to {shape:?}"));
    }
    Ok(out)
}

fn transpose_host(t: &HostTensor, perm: &[usize]) -> HostTensor {
    let out: Vec<usize> = perm.iter().map(|&p| t.dims[p]).collect();
    let st = strides(&t.dims);
    let ost = strides(&out);
    let n = t.num_elements();
    let src: Vec<usize> = (0..n)
        .map(|i| {
            perm.iter()
                .enumerate()
                .map(|(k, &p)| ((i / ost[k]) % out[k]) * st[p])
                .sum()
        })
        .collect();
    gather_flat(t, out, &src)
}

fn gather_flat(t: &HostTensor, dims: Vec<usize>, src: &[usize]) -> HostTensor {
    let data = match &t.data {
        HostData::Float(v) => HostData::Float(src.iter().map(|&i| v[i]).collect()),
        HostData::Int(v) => HostData::Int(src.iter().map(|&i| v[i]).collect()),
    };
    HostTensor {
        dtype: t.dtype,
        dims,
        data,
    }
}

fn slice_host(t: &HostTensor, ranges: &[(usize, i64, i64, i64)]) -> HostTensor {
    let mut idx: Vec<Vec<usize>> = t.dims.iter().map(|&d| (0..d).collect()).collect();
    for &(a, s, e, step) in ranges {
        let mut v = Vec::new();
        let mut k = s;
        while (step > 0 && k < e) || (step < 0 && k > e) {
            v.push(k as usize);
            k += step;
        }
        idx[a] = v;
    }
    let out: Vec<usize> = idx.iter().map(Vec::len).collect();
    let st = strides(&t.dims);
    let ost = strides(&out);
    let n: usize = out.iter().product();
    let src: Vec<usize> = (0..n)
        .map(|i| {
            (0..out.len())
                .map(|k| idx[k][(i / ost[k]) % out[k]] * st[k])
                .sum()
        })
        .collect();
    gather_flat(t, out, &src)
}

fn concat_host(parts: &[&HostTensor], a: usize) -> Result<HostTensor, String> {
    let first = parts.first().ok_or("no operands")?;
    let mut out = first.dims.clone();
    if a >= out.len() {
        return Err("concat of scalars".into());
    }
    out[a] = 0;
    for p in parts {
        if p.dims.len() != first.dims.len()
            || p.dims
                .iter()
                .enumerate()
                .any(|(k, &d)| k != a && d != first.dims[k])
        {
            return Err(format!(
                "operand shapes {:?} and {:?} do not concatenate",
                first.dims, p.dims
            ));
        }
        out[a] += p.dims[a];
    }
    let outer: usize = out[..a].iter().product();
    let float = parts.iter().any(|p| matches!(p.data, HostData::Float(_)));
    let mut fv = Vec::new();
    let mut iv = Vec::new();
    for o in 0..outer {
        for p in parts {
            let inner: usize = p.dims[a..].iter().product();
            for k in o * inner..(o + 1) * inner {
                match float {
                    true => fv.push(p.data.f64(k)),
                    false => iv.push(match &p.data {
                        HostData::Int(v) => v[k],
                        HostData::Float(v) => v[k] as i64,
                    }),
                }
            }
        }
    }
    Ok(HostTensor {
        dtype: first.dtype,
        dims: out,
        data: if float {
            HostData::Float(fv)
        } else {
            HostData::Int(iv)
        },
    })
}

fn gather_host(t: &HostTensor, idx: &HostTensor, a: usize) -> Result<HostTensor, String> {
    let size = t.dims[a] as i64;
    let ids: Vec<usize> = idx
        .as_i64s()
        .iter()
        .map(|&k| {
            let k = if k < 0 { k + size } else { k };
            (0..size)
                .contains(&k)
                .then_some(k as usize)
                .ok_or_else(|| format!("index {k} out of range 0..{size}"))
        })
        .collect::<Result<_, _>>()?;
    let mut out = t.dims[..a].to_vec();
    out.extend_from_slice(&idx.dims);
    out.extend_from_slice(&t.dims[a + 1..]);
    let outer: usize = t.dims[..a].iter().product();
    let inner: usize = t.dims[a + 1..].iter().product();
    if outer
        .checked_mul(ids.len())
        .and_then(|n| n.checked_mul(inner))
        .is_none_or(|n| n > MAX_FOLDED_ELEMENTS)
    {
        return Err("the gathered constant is too large".into());
    }
    let mut src = Vec::new();
    for o in 0..outer {
        for &k in &ids {
            for j in 0..inner {
                src.push((o * t.dims[a] + k) * inner + j);
            }
        }
    }
    if src.len() > MAX_FOLDED_ELEMENTS {
        return Err("the gathered constant is too large".into());
    }
    Ok(gather_flat(t, out, &src))
}

fn trilu_host(t: &HostTensor, k: i64, upper: bool) -> Result<HostTensor, String> {
    let r = t.dims.len();
    if r < 2 {
        return Err("Trilu needs a rank of at least 2".into());
    }
    let (rows, cols) = (t.dims[r - 2], t.dims[r - 1]);
    let mut out = t.clone();
    for i in 0..t.num_elements() {
        let (row, col) = (((i / cols) % rows) as i64, (i % cols) as i64);
        let keep = if upper {
            col - row >= k
        } else {
            col - row <= k
        };
        if !keep {
            match &mut out.data {
                HostData::Float(v) => v[i] = 0.0,
                HostData::Int(v) => v[i] = 0,
            }
        }
    }
    Ok(out)
}

fn reduce_host(
    op: &str,
    t: &HostTensor,
    ax: &[usize],
    out: Vec<usize>,
) -> Result<HostTensor, String> {
    let st = strides(&t.dims);
    let kept: Vec<usize> = (0..t.dims.len()).filter(|k| !ax.contains(k)).collect();
    let kdims: Vec<usize> = kept.iter().map(|&k| t.dims[k]).collect();
    let kst = strides(&kdims);
    let n: usize = kdims.iter().product();
    let mut acc = vec![
        if op == "ReduceMax" {
            f64::NEG_INFINITY
        } else {
            0.0
        };
        n
    ];
    for i in 0..t.num_elements() {
        let j: usize = kept
            .iter()
            .enumerate()
            .map(|(q, &k)| ((i / st[k]) % t.dims[k]) * kst[q])
            .sum();
        let x = t.data.f64(i);
        acc[j] = if op == "ReduceMax" {
            acc[j].max(x)
        } else {
            acc[j] + x
        };
    }
    if op == "ReduceMean" {
        let count: usize = ax.iter().map(|&k| t.dims[k]).product();
        for a in &mut acc {
            *a /= count.max(1) as f64;
        }
    }
    Ok(HostTensor {
        dtype: t.dtype,
        dims: out,
        data: HostData::Float(acc),
    })
}

/// Einsum of known tensors (any number of operands, no repeated labels within one).
fn einsum_host(eq: &str, parts: &[&HostTensor]) -> Result<HostTensor, String> {
    let (ins, out) = eq.split_once("->").ok_or("an einsum without `->`")?;
    let ins: Vec<Vec<char>> = ins.split(',').map(|s| s.chars().collect()).collect();
    let out: Vec<char> = out.chars().collect();
    if ins.len() != parts.len() {
        return Err("einsum operand count".into());
    }
    let mut size: BTreeMap<char, usize> = BTreeMap::new();
    for (labels, t) in ins.iter().zip(parts) {
        if labels.len() != t.dims.len() {
            return Err("einsum labels do not match the operand's rank".into());
        }
        for (&c, &d) in labels.iter().zip(&t.dims) {
            if *size.entry(c).or_insert(d) != d {
                return Err(format!("einsum label `{c}` has two sizes"));
            }
        }
    }
    let all: Vec<char> = size.keys().copied().collect();
    let total: usize = all
        .iter()
        .map(|c| size[c])
        .try_fold(1usize, |n, d| n.checked_mul(d))
        .ok_or("too large")?;
    if total > MAX_FOLDED_ELEMENTS {
        return Err("the einsum is too large to fold".into());
    }
    let odims: Vec<usize> = out
        .iter()
        .map(|c| size.get(c).copied().ok_or("unknown output label"))
        .collect::<Result<_, _>>()?;
    let ost = strides(&odims);
    let mut acc = vec![0.0; odims.iter().product()];
    let dims: Vec<usize> = all.iter().map(|c| size[c]).collect();
    let ast = strides(&dims);
    for i in 0..total {
        let at = |c: char| {
            let k = all.iter().position(|&a| a == c).unwrap_or(0);
            (i / ast[k]) % dims[k]
        };
        let mut p = 1.0;
        for (labels, t) in ins.iter().zip(parts) {
            let st = strides(&t.dims);
            let idx: usize = labels.iter().enumerate().map(|(k, &c)| at(c) * st[k]).sum();
            p *= t.data.f64(idx);
        }
        let o: usize = out.iter().enumerate().map(|(k, &c)| at(c) * ost[k]).sum();
        acc[o] += p;
    }
    Ok(HostTensor {
        dtype: DType::F32,
        dims: odims,
        data: HostData::Float(acc),
    })
}
