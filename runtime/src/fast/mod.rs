//! The fast CPU backend, [`FastCpuBackend`]: the same programs as the reference interpreter,
//! run for speed. Floats are stored as `f32` (bf16 and f16 values are exact in f32; every
//! result is rounded to its declared dtype, ties to even), integers as `i64`, booleans as
//! `bool` ([`storage`]); storage is shared by reference count (reshapes and pass-through
//! outputs copy nothing) and comes from the executable's [`pool`], to which it returns when
//! its last holder drops it, so that a steady-state step reuses the previous step's buffers.
//! Constants, and broadcasts of one element, are splats that no kernel writes out at full
//! size.
//!
//! Kernels, by family: [`gemm`] (einsum as strided `gemm` calls, no transposed copies, the
//! result written in place, with `gemm`'s own threads; f32 products accumulate in f32 by
//! default, as PyTorch's do, or in f64), [`elementwise`] (one monomorphised
//! loop per op and dtype), [`reduce`] (reductions, softmax, layer and RMS norm,
//! cross-entropy; sums accumulate in `f64` as the reference does), [`layout`] (broadcast,
//! transpose, slice, concat, gather, scatter-add), [`attention`] (attention and its backward
//! per head through `gemm`, rotary), [`optim`] (AdamW and SGD, in `f64` per element) and
//! [`fusion`] (fusion bodies evaluated over tiles of a few hundred elements or of whole rows,
//! one tight loop per instruction, without full-size temporaries). With `threads > 1` the large kernels
//! split their work over a rayon pool.
//!
//! Ops without a fast kernel go through the reference kernel ([`crate::kernels::eval_op`])
//! with their operands converted to and from [`Tensor`]: `moe_route`, reductions and
//! scatter-adds of integers, unary ops and `select` on integers or booleans, casts from
//! integers to bool, and element-wise ops whose operands are all splats (evaluated on one
//! element; the result is a splat). Communication ops go to the rank's [`Collectives`]
//! through one adapter, `communicate_fast` (today by conversion to [`Tensor`]; the coming f32
//! methods of `Collectives` plug in there).
//!
//! Loops run compiled for the CPU's widest vector instructions (module `simd`).
//!
//! `AUTOPAR_PROFILE=1` makes every executable print, when dropped, the time it spent per op
//! kind; `AUTOPAR_PROFILE=nodes` also lists its 25 costliest nodes (`nodes:N`: its N
//! costliest).

pub mod attention;
pub mod elementwise;
pub mod fusion;
pub mod gemm;
pub mod layout;
pub mod optim;
pub mod pool;
pub mod reduce;
pub(crate) mod simd;
pub mod storage;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use autopar_ir::{DType, Graph, IrError, Op, TensorType, ValueId};

use crate::backend::Backend;
use crate::comm::{Collectives, communicate};
use crate::error::{Feed, RuntimeError, fed};
use crate::interp::RunOutput;
use crate::kernels::eval_op;
use crate::plan::{ExecutionPlan, Interval, assign_offsets};
use crate::tensor::{Precision, Tensor, round_to_dtype};
use pool::Pool;
pub use storage::{Elems, FastTensor, storage_bytes};
use storage::{round_slice, wrap_ints};

/// Below this many elements a kernel runs on the calling thread: splitting costs more.
pub(crate) const PAR_GRAIN: usize = 1 << 15;

/// The fast CPU backend (see the module docs).
#[derive(Clone)]
pub struct FastCpuBackend {
    threads: usize,
    wide: bool,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl std::fmt::Debug for FastCpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastCpuBackend")
            .field("threads", &self.threads)
            .field("wide", &self.wide)
            .finish()
    }
}

impl Default for FastCpuBackend {
    fn default() -> Self {
        FastCpuBackend {
            threads: 1,
            wide: false,
            pool: None,
        }
    }
}

impl FastCpuBackend {
    /// A backend whose ops use up to `threads` threads each (at least 1), for `ranks` ranks
    /// executing at the same time in this process (they share a pool of `threads * ranks`
    /// workers).
    pub fn new(threads: usize, ranks: usize) -> Result<FastCpuBackend, RuntimeError> {
        let threads = threads.max(1);
        if threads == 1 {
            return Ok(FastCpuBackend::default());
        }
        let workers = threads.saturating_mul(ranks.max(1));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers)
            .thread_name(|i| format!("autopar-fast-{i}"))
            .build()
            .map_err(|e| RuntimeError::SpmdSetup {
                detail: format!("cannot start {workers} threads for the fast backend: {e}"),
            })?;
        Ok(FastCpuBackend {
            threads,
            wide: false,
            pool: Some(Arc::new(pool)),
        })
    }

    /// Whether f32 einsums accumulate in f64 (`true`: gradients within rounding of the
    /// reference's f64 sums) or in f32 (`false`, the default, as PyTorch's and cuBLAS's GEMMs:
    /// about twice the GEMM throughput; gradients differ from the reference by f32 rounding
    /// noise, which `--verify` measures with an f32-accumulating reference).
    pub fn with_wide_accumulation(mut self, wide: bool) -> FastCpuBackend {
        self.wide = wide;
        self
    }

    /// Threads each op may use.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// Time and calls per op kind.
type Profile = BTreeMap<&'static str, (u64, u128)>;

/// A rank program loaded by [`FastCpuBackend`]: the graph, its plan, each node's result types,
/// the buffer pool and (with `AUTOPAR_PROFILE`) the time per op kind.
pub struct FastExecutable<'g> {
    graph: &'g Graph,
    plan: ExecutionPlan,
    results: Vec<Vec<TensorType>>,
    fusions: HashMap<usize, fusion::Compiled>,
    pool: Arc<Pool>,
    arena_bytes: u64,
    profile: Option<Mutex<Profile>>,
    /// Time per plan position (`AUTOPAR_PROFILE=nodes`).
    node_profile: Option<Mutex<Vec<(u64, u128)>>>,
    /// How many of the costliest nodes the profile lists (`AUTOPAR_PROFILE=nodes[:N]`).
    nodes_shown: usize,
}

impl std::fmt::Debug for FastExecutable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastExecutable")
            .field("graph", &self.graph.name())
            .field("arena_bytes", &self.arena_bytes)
            .finish()
    }
}

impl FastExecutable<'_> {
    /// The graph it runs.
    pub fn graph(&self) -> &Graph {
        self.graph
    }

    /// The plan it runs by.
    pub fn plan(&self) -> &ExecutionPlan {
        &self.plan
    }

    /// The size of the plan's static arena at this backend's storage sizes (4 bytes per
    /// float, 8 per integer, 1 per bool), laid out as the plan lays out its values.
    pub fn arena_bytes(&self) -> u64 {
        self.arena_bytes
    }

    /// Time spent per op kind so far (`AUTOPAR_PROFILE` set at load): (op, calls, seconds),
    /// costliest first.
    pub fn profile(&self) -> Vec<(&'static str, u64, f64)> {
        let Some(p) = &self.profile else {
            return Vec::new();
        };
        let p = p.lock().unwrap_or_else(PoisonError::into_inner);
        let mut rows: Vec<_> = p
            .iter()
            .map(|(&op, &(calls, ns))| (op, calls, ns as f64 * 1e-9))
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        rows
    }
}

impl Drop for FastExecutable<'_> {
    fn drop(&mut self) {
        let rows = self.profile();
        if rows.is_empty() {
            return;
        }
        let total: f64 = rows.iter().map(|r| r.2).sum();
        eprintln!(
            "fast backend profile of `{}` ({total:.3} s in ops):",
            self.graph.name()
        );
        for (op, calls, secs) in rows {
            eprintln!(
                "  {op:<22} {calls:>8} calls {:>10.3} ms {:>5.1}%",
                secs * 1e3,
                100.0 * secs / total.max(1e-12)
            );
        }
        let Some(np) = &self.node_profile else {
            return;
        };
        let np = np.lock().unwrap_or_else(PoisonError::into_inner);
        let mut costliest: Vec<(usize, u64, u128)> = np
            .iter()
            .enumerate()
            .map(|(pos, &(calls, ns))| (pos, calls, ns))
            .collect();
        costliest.sort_by_key(|c| std::cmp::Reverse(c.2));
        // Each node as the `.air` printer writes it, found by its first result.
        let printed = autopar_ir::text::print(self.graph);
        let line_of = |v: ValueId| {
            let head = format!("{v}: ");
            printed
                .lines()
                .map(str::trim_start)
                .find(|l| l.starts_with(&head))
                .unwrap_or("")
                .to_string()
        };
        eprintln!("  costliest nodes:");
        for &(pos, calls, ns) in costliest.iter().take(self.nodes_shown) {
            let node = self.graph.node(self.plan.order()[pos]);
            let mut text = node
                .outputs
                .first()
                .map_or_else(|| node.op.name().to_string(), |&v| line_of(v));
            if let Some((cut, _)) = text.char_indices().nth(NODE_TEXT) {
                text.truncate(cut);
                text += "...";
            }
            eprintln!(
                "  {:>10.3} ms {:>5.1}% {calls:>5}x  {text}",
                ns as f64 * 1e-6,
                100.0 * ns as f64 * 1e-9 / total.max(1e-12)
            );
        }
    }
}

/// Nodes `AUTOPAR_PROFILE=nodes` lists unless `nodes:N` says how many, and the characters
/// of each node's text it shows.
const NODES_SHOWN: usize = 25;
const NODE_TEXT: usize = 220;

/// What kernels need: the pool their results come from and how many threads they may use.
pub(crate) struct Ctx<'a> {
    pub(crate) pool: &'a Arc<Pool>,
    pub(crate) threads: usize,
    /// f32 einsums accumulate in f64.
    pub(crate) wide: bool,
    workers: Option<&'a rayon::ThreadPool>,
}

impl Ctx<'_> {
    /// True when work of `n` elements is worth splitting over threads.
    pub(crate) fn parallel(&self, n: usize) -> bool {
        self.threads > 1 && n >= 2 * PAR_GRAIN
    }

    /// Runs `f` on the backend's threads (rayon's parallel iterators and `gemm`'s threads
    /// inside it use them); on this thread when there are none.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.workers {
            Some(w) => w.install(f),
            None => f(),
        }
    }

    fn weak(&self) -> Weak<Pool> {
        Arc::downgrade(self.pool)
    }

    /// A float buffer of `n` elements with unspecified contents.
    pub(crate) fn f32s(&self, n: usize) -> Vec<f32> {
        self.pool.f32s(n)
    }

    /// A float buffer of `n` zeros.
    pub(crate) fn zeros(&self, n: usize) -> Vec<f32> {
        let mut v = self.pool.f32s(n);
        v.fill(0.0);
        v
    }

    /// An integer buffer of `n` elements with unspecified contents.
    pub(crate) fn ints(&self, n: usize) -> Vec<i64> {
        self.pool.ints(n)
    }

    /// A bool buffer of `n` elements with unspecified contents.
    pub(crate) fn bools(&self, n: usize) -> Vec<bool> {
        self.pool.bools(n)
    }

    /// A float result: rounded to `ty`'s dtype.
    pub(crate) fn float(&self, ty: &TensorType, mut v: Vec<f32>) -> FastTensor {
        round_slice(ty.dtype, &mut v);
        FastTensor::from_parts(ty.clone(), Elems::F32(v), self.weak())
    }

    /// An integer result: wrapped into `ty`'s range.
    pub(crate) fn int(&self, ty: &TensorType, mut v: Vec<i64>) -> FastTensor {
        wrap_ints(ty.dtype, &mut v);
        FastTensor::from_parts(ty.clone(), Elems::Int(v), self.weak())
    }

    /// A bool result.
    pub(crate) fn bool(&self, ty: &TensorType, v: Vec<bool>) -> FastTensor {
        FastTensor::from_parts(ty.clone(), Elems::Bool(v), self.weak())
    }

    /// A result of the same storage kind as `elems`.
    pub(crate) fn of_elems(&self, ty: &TensorType, elems: Elems) -> FastTensor {
        match elems {
            Elems::F32(v) => self.float(ty, v),
            Elems::Int(v) => self.int(ty, v),
            Elems::Bool(v) => self.bool(ty, v),
        }
    }

    /// `ty` with every element `value`, with [`Tensor::full`]'s meaning.
    pub(crate) fn full(&self, ty: &TensorType, value: f64) -> FastTensor {
        let n = ty.num_elements() as usize;
        match ty.dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                let mut v = self.f32s(n);
                v.fill(round_to_dtype(value, ty.dtype) as f32);
                self.float(ty, v)
            }
            DType::I32 | DType::I64 => {
                let mut v = self.ints(n);
                let x = if ty.dtype == DType::I32 {
                    i64::from(value as i32)
                } else {
                    value as i64
                };
                v.fill(x);
                self.int(ty, v)
            }
            DType::Bool => {
                let mut v = self.bools(n);
                v.fill(value != 0.0);
                self.bool(ty, v)
            }
        }
    }

    /// The dense tensor of an argument (a splat written out).
    pub(crate) fn dense(&self, a: &Val) -> FastTensor {
        match a {
            Val::Dense(t) => t.clone(),
            Val::Splat(ty, value) => self.full(ty, *value),
        }
    }
}

/// A value during a run: a dense tensor, or every element equal to one value (a constant or
/// a broadcast scalar), with [`Tensor::full`]'s meaning of the value.
#[derive(Clone, Debug)]
pub(crate) enum Val {
    Dense(FastTensor),
    Splat(TensorType, f64),
}

impl Val {
    pub(crate) fn ty(&self) -> &TensorType {
        match self {
            Val::Dense(t) => t.ty(),
            Val::Splat(ty, _) => ty,
        }
    }

    /// The reference tensor of the same type and values.
    pub(crate) fn to_tensor(&self) -> Result<Tensor, RuntimeError> {
        match self {
            Val::Dense(t) => t.to_tensor(),
            Val::Splat(ty, v) => Ok(Tensor::full(ty.clone(), *v)),
        }
    }
}

impl Backend for FastCpuBackend {
    type Buffer = FastTensor;
    type Executable<'g> = FastExecutable<'g>;

    fn upload(&self, tensor: &Tensor) -> Result<FastTensor, RuntimeError> {
        Ok(FastTensor::from_tensor(tensor))
    }

    fn download(&self, buffer: &FastTensor) -> Result<Tensor, RuntimeError> {
        buffer.to_tensor()
    }

    fn load<'g>(
        &self,
        graph: &'g Graph,
        plan: ExecutionPlan,
    ) -> Result<FastExecutable<'g>, RuntimeError> {
        let mut results = Vec::with_capacity(plan.order().len());
        let mut fusions = HashMap::new();
        for (pos, &n) in plan.order().iter().enumerate() {
            let node = graph.node(n);
            let tys = node
                .outputs
                .iter()
                .map(|&v| Ok(graph.value_checked(v)?.ty.clone()))
                .collect::<Result<Vec<_>, IrError>>()?;
            if let Op::Fusion { body } = &node.op {
                fusions.insert(pos, fusion::Compiled::new(body)?);
            }
            results.push(tys);
        }
        // The plan's arena, laid out again at this backend's element sizes.
        let intervals: Vec<Interval> = plan
            .slots()
            .map(|(v, slot)| Interval {
                first: slot.first,
                last: slot.last,
                bytes: storage_bytes(graph.ty(v)),
            })
            .collect();
        let (_, arena_bytes) = assign_offsets(&intervals);
        let profile_var = std::env::var_os("AUTOPAR_PROFILE").unwrap_or_default();
        let profile =
            (!profile_var.is_empty() && profile_var != "0").then(|| Mutex::new(Profile::new()));
        let profile_var = profile_var.to_string_lossy();
        let nodes_shown = match profile_var.split_once(':') {
            Some(("nodes", n)) => n.parse().ok(),
            _ => (profile_var == "nodes").then_some(NODES_SHOWN),
        };
        let node_profile = nodes_shown.map(|_| Mutex::new(vec![(0, 0); plan.order().len()]));
        Ok(FastExecutable {
            graph,
            plan,
            results,
            fusions,
            // Room for a whole step's worth of buffers, and the state dropped between steps.
            pool: Pool::new(arena_bytes.saturating_mul(2).max(1 << 20)),
            arena_bytes,
            profile,
            node_profile,
            nodes_shown: nodes_shown.unwrap_or(0),
        })
    }

    fn execute(
        &self,
        exe: &FastExecutable<'_>,
        params: &BTreeMap<String, FastTensor>,
        inputs: &BTreeMap<String, FastTensor>,
        comm: &mut dyn Collectives,
    ) -> Result<RunOutput<FastTensor>, RuntimeError> {
        let graph = exe.graph;
        let order = exe.plan.order();
        let ctx = Ctx {
            pool: &exe.pool,
            threads: self.threads,
            wide: self.wide,
            workers: self.pool.as_deref(),
        };
        // Bytes held: every storage counted once, however many values share it (reshapes,
        // pass-through outputs), fed tensors from the start.
        let mut held = Held::default();
        // Check every feed before computing anything, so that a bad one fails fast.
        for &n in order {
            let t = match &graph.node(n).op {
                Op::Parameter { name, ty, .. } => fed(Feed::Parameter, params, name, ty)?,
                Op::Input { name, ty, .. } => fed(Feed::Input, inputs, name, ty)?,
                _ => continue,
            };
            held.add(&Val::Dense(t.clone()));
        }
        let mut live: HashMap<ValueId, Val> = HashMap::new();
        let mut peak_bytes = held.bytes;
        for (pos, &n) in order.iter().enumerate() {
            let node = graph.node(n);
            let declared = &exe.results[pos];
            let context = |e| match e {
                RuntimeError::Missing { .. } | RuntimeError::WrongType { .. } => e,
                other => RuntimeError::AtNode {
                    node: n,
                    op: node.op.name(),
                    scope: node.scope.clone(),
                    error: Box::new(other),
                },
            };
            let started = exe.profile.as_ref().map(|_| Instant::now());
            let (results, fed_node) = match &node.op {
                Op::Parameter { name, ty, .. } => (
                    vec![Val::Dense(fed(Feed::Parameter, params, name, ty)?.clone())],
                    true,
                ),
                Op::Input { name, ty, .. } => (
                    vec![Val::Dense(fed(Feed::Input, inputs, name, ty)?.clone())],
                    true,
                ),
                op => {
                    let mut args = Vec::with_capacity(node.inputs.len());
                    for v in &node.inputs {
                        let a = live
                            .get(v)
                            .ok_or_else(|| IrError::UnknownValue(v.to_string()))?;
                        args.push(a);
                    }
                    let results = if op.is_communication() {
                        let dense: Vec<FastTensor> = args.iter().map(|a| ctx.dense(a)).collect();
                        communicate_fast(&ctx, comm, op, &dense, declared)?
                            .into_iter()
                            .map(Val::Dense)
                            .collect()
                    } else {
                        eval(&ctx, op, &args, declared, exe.fusions.get(&pos)).map_err(context)?
                    };
                    (results, false)
                }
            };
            if let (Some(p), Some(t0)) = (&exe.profile, started) {
                let mut p = p.lock().unwrap_or_else(PoisonError::into_inner);
                let e = p.entry(node.op.name()).or_insert((0, 0));
                let ns = t0.elapsed().as_nanos();
                e.0 += 1;
                e.1 += ns;
                if let Some(np) = &exe.node_profile {
                    let mut np = np.lock().unwrap_or_else(PoisonError::into_inner);
                    np[pos].0 += 1;
                    np[pos].1 += ns;
                }
            }
            if results.len() != declared.len() {
                return Err(IrError::Verify(format!(
                    "{n} ({}) has {} results but evaluated to {}",
                    node.op,
                    declared.len(),
                    results.len()
                ))
                .into());
            }
            for ((&v, ty), r) in node.outputs.iter().zip(declared).zip(results) {
                if r.ty() != ty {
                    return Err(IrError::Verify(format!(
                        "{v} is declared {ty} but evaluates to {}",
                        r.ty()
                    ))
                    .into());
                }
                if !fed_node {
                    held.add(&r);
                }
                live.insert(v, r);
            }
            peak_bytes = peak_bytes.max(held.bytes);
            for v in exe.plan.frees_after(pos) {
                if let Some(t) = live.remove(v) {
                    held.remove(&t);
                }
            }
        }
        let mut outputs = BTreeMap::new();
        for (name, v) in graph.outputs() {
            let t = live
                .get(v)
                .ok_or_else(|| IrError::UnknownValue(v.to_string()))?;
            outputs.insert(name.clone(), ctx.dense(t));
        }
        Ok(RunOutput {
            outputs,
            peak_bytes,
            arena_bytes: Some(exe.arena_bytes),
        })
    }
}

/// The storage a run holds: bytes, and how many live values share each storage.
#[derive(Default)]
struct Held {
    bytes: u64,
    refs: HashMap<usize, (usize, u64)>,
}

impl Held {
    fn add(&mut self, v: &Val) {
        let Val::Dense(t) = v else { return };
        let e = self
            .refs
            .entry(t.storage_id())
            .or_insert((0, t.storage_bytes()));
        if e.0 == 0 {
            self.bytes += e.1;
        }
        e.0 += 1;
    }

    /// Drops a value after its last use (a fed one was counted when the run started, and is
    /// resident until then).
    fn remove(&mut self, v: &Val) {
        let Val::Dense(t) = v else { return };
        let id = t.storage_id();
        let Some(e) = self.refs.get_mut(&id) else {
            return;
        };
        e.0 = e.0.saturating_sub(1);
        if e.0 == 0 {
            self.bytes = self.bytes.saturating_sub(e.1);
            self.refs.remove(&id);
        }
    }
}

/// A communication op through the rank's [`Collectives`]: the one place where the fast
/// backend's tensors meet the communicator. Floats go through the f32 methods
/// ([`communicate_f32`](crate::comm::communicate_f32): the in-process communicator's shared
/// buffers, no conversion), anything else by conversion to and from [`Tensor`]. `declared`
/// are the op's result types.
pub(crate) fn communicate_fast(
    ctx: &Ctx,
    comm: &mut dyn Collectives,
    op: &Op,
    operands: &[FastTensor],
    declared: &[TensorType],
) -> Result<Vec<FastTensor>, RuntimeError> {
    let float = |ty: &TensorType| ty.dtype.is_float();
    let operand_ok = match operands {
        [] => matches!(op, Op::Recv { .. }),
        [x] => float(x.ty()) && x.f32s().is_some(),
        _ => false,
    };
    if operand_ok && declared.len() <= 1 && declared.iter().all(float) {
        let operand = operands.first().and_then(|x| Some((x.ty(), x.f32s()?)));
        let len = declared.first().map_or(0, |ty| ty.num_elements() as usize);
        let mut out = ctx.f32s(len);
        crate::comm::communicate_f32(comm, op, operand, &mut out)?;
        return Ok(declared
            .first()
            .map(|ty| ctx.float(ty, out))
            .into_iter()
            .collect());
    }
    let tensors = operands
        .iter()
        .map(FastTensor::to_tensor)
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let results = communicate(comm, op, &refs)?;
    Ok(results.iter().map(|t| from_reference(ctx, t)).collect())
}

/// A reference tensor copied into pooled storage.
fn from_reference(ctx: &Ctx, t: &Tensor) -> FastTensor {
    let n = t.len();
    let elems = match t.data() {
        crate::tensor::Data::Float(v) => {
            let mut out = ctx.f32s(n);
            for (o, &x) in out.iter_mut().zip(v) {
                *o = x as f32;
            }
            Elems::F32(out)
        }
        crate::tensor::Data::Int(v) => {
            let mut out = ctx.ints(n);
            out.copy_from_slice(v);
            Elems::Int(out)
        }
        crate::tensor::Data::Bool(v) => {
            let mut out = ctx.bools(n);
            out.copy_from_slice(v);
            Elems::Bool(out)
        }
    };
    FastTensor::from_parts(t.ty().clone(), elems, ctx.weak())
}

/// `op` through the reference kernel, its operands converted to [`Tensor`] and its results
/// back: for the ops the fast backend has no kernel of its own for.
pub(crate) fn reference_kernel(
    ctx: &Ctx,
    op: &Op,
    args: &[&Val],
) -> Result<Vec<Val>, RuntimeError> {
    let tensors = args
        .iter()
        .map(|a| a.to_tensor())
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let results = eval_op(op, &refs, Precision::Declared)?;
    Ok(results
        .iter()
        .map(|t| Val::Dense(from_reference(ctx, t)))
        .collect())
}

/// The results of a compute op on its arguments; `out` holds the declared result types. No
/// wildcard arm: a new op must get a kernel, the reference kernel or a refusal.
pub(crate) fn eval(
    ctx: &Ctx,
    op: &Op,
    args: &[&Val],
    out: &[TensorType],
    compiled: Option<&fusion::Compiled>,
) -> Result<Vec<Val>, RuntimeError> {
    let name = op.name();
    let arity = |n: usize| -> Result<(), RuntimeError> {
        if args.len() < n || out.is_empty() {
            return Err(IrError::Verify(format!(
                "`{name}` got {} operands and {} result types",
                args.len(),
                out.len()
            ))
            .into());
        }
        Ok(())
    };
    let dense = |i: usize| ctx.dense(args[i]);
    let one = |t: FastTensor| Ok(vec![Val::Dense(t)]);
    match op {
        Op::Parameter { .. } | Op::Input { .. } => Err(RuntimeError::NotAKernel { op: name }),
        Op::Constant { ty, value } => Ok(vec![Val::Splat(ty.clone(), *value)]),
        Op::Einsum { spec } => {
            arity(2)?;
            one(gemm::einsum(ctx, spec, &dense(0), &dense(1), &out[0])?)
        }
        Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select
        | Op::Cast { .. } => {
            arity(op_arity(op))?;
            Ok(vec![elementwise::eval(ctx, op, args, &out[0])?])
        }
        Op::Reduce { func, dims } => {
            arity(1)?;
            match args[0] {
                Val::Dense(t) if t.f32s().is_some() => {
                    one(reduce::reduce(ctx, *func, dims, t, &out[0])?)
                }
                _ => reference_kernel(ctx, op, args),
            }
        }
        Op::Softmax { dim } => {
            arity(1)?;
            one(reduce::softmax(ctx, *dim, &dense(0))?)
        }
        Op::LayerNorm { eps } => {
            arity(3)?;
            one(reduce::layer_norm(
                ctx,
                *eps,
                &dense(0),
                &dense(1),
                &dense(2),
            )?)
        }
        Op::RmsNorm { eps } => {
            arity(2)?;
            one(reduce::rms_norm(ctx, *eps, &dense(0), &dense(1))?)
        }
        Op::CrossEntropy => {
            arity(2)?;
            one(reduce::cross_entropy(ctx, &dense(0), &dense(1), &out[0])?)
        }
        Op::Gather => {
            arity(2)?;
            one(layout::gather(ctx, &dense(0), &dense(1), &out[0])?)
        }
        Op::ScatterAdd { num_rows } => {
            arity(2)?;
            match (&dense(0), &dense(1)) {
                (ids, upd) if upd.f32s().is_some() => {
                    one(layout::scatter_add(ctx, *num_rows, ids, upd, &out[0])?)
                }
                _ => reference_kernel(ctx, op, args),
            }
        }
        Op::Reshape { .. } => {
            arity(1)?;
            Ok(vec![match args[0] {
                Val::Dense(t) => Val::Dense(t.reshaped(out[0].clone())),
                Val::Splat(_, v) => Val::Splat(out[0].clone(), *v),
            }])
        }
        Op::Transpose { perm } => {
            arity(1)?;
            Ok(vec![match args[0] {
                Val::Dense(t) => Val::Dense(layout::transpose(ctx, perm, t, &out[0])),
                Val::Splat(_, v) => Val::Splat(out[0].clone(), *v),
            }])
        }
        Op::Slice { dim, start, end } => {
            arity(1)?;
            Ok(vec![match args[0] {
                Val::Dense(t) => Val::Dense(layout::slice(ctx, *dim, *start, *end, t, &out[0])),
                Val::Splat(_, v) => Val::Splat(out[0].clone(), *v),
            }])
        }
        Op::Concat { dim } => {
            arity(1)?;
            let parts: Vec<FastTensor> = args.iter().map(|a| ctx.dense(a)).collect();
            one(layout::concat(ctx, *dim, &parts, &out[0])?)
        }
        Op::Broadcast { dims, .. } => {
            arity(1)?;
            Ok(vec![layout::broadcast(ctx, dims, args[0], &out[0])])
        }
        Op::Rotary { base } => {
            arity(1)?;
            let pos = args.get(1).map(|a| ctx.dense(a));
            one(attention::rotary(ctx, *base, &dense(0), pos.as_ref())?)
        }
        Op::Attention { causal, scale } => {
            arity(3)?;
            let pos = positions(ctx, args, 3);
            one(attention::attention(
                ctx,
                *causal,
                *scale,
                [&dense(0), &dense(1), &dense(2)],
                pos.as_ref().map(|(q, k)| (q, k)),
                &out[0],
            )?)
        }
        Op::AttentionBackward { causal, scale } => {
            arity(5)?;
            let pos = positions(ctx, args, 5);
            let ops = [&dense(0), &dense(1), &dense(2), &dense(3), &dense(4)];
            let results = attention::attention_backward(
                ctx,
                *causal,
                *scale,
                ops,
                pos.as_ref().map(|(q, k)| (q, k)),
                out,
            )?;
            Ok(results.into_iter().map(Val::Dense).collect())
        }
        Op::MoeRoute { .. } => reference_kernel(ctx, op, args),
        Op::SgdUpdate {
            lr,
            momentum,
            weight_decay,
        } => {
            arity(3)?;
            let lr = lr * args.get(3).map_or(1.0, scalar_of);
            let r = optim::sgd_update(
                ctx,
                lr,
                *momentum,
                *weight_decay,
                [&dense(0), &dense(1), &dense(2)],
            )?;
            Ok(r.into_iter().map(Val::Dense).collect())
        }
        Op::AdamWUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            arity(5)?;
            // A learning-rate schedule's factor follows the step count.
            let h = optim::AdamW {
                lr: lr * args.get(5).map_or(1.0, scalar_of),
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
            };
            let step = scalar_of(&args[4]);
            let r =
                optim::adamw_update(ctx, h, [&dense(0), &dense(1), &dense(2), &dense(3)], step)?;
            Ok(r.into_iter().map(Val::Dense).collect())
        }
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => Err(RuntimeError::NeedsMultiRank { op: name }),
        Op::Fusion { body } => {
            let owned;
            let compiled = match compiled {
                Some(c) => c,
                None => {
                    owned = fusion::Compiled::new(body)?;
                    &owned
                }
            };
            fusion::run(ctx, compiled, args)
        }
    }
}

/// The value of a one-element operand (a step count, a learning-rate factor), 1 if empty.
fn scalar_of(v: &&Val) -> f64 {
    match v {
        Val::Splat(_, x) => *x,
        Val::Dense(t) => t
            .f32s()
            .and_then(|s| s.first())
            .map_or(1.0, |&x| f64::from(x)),
    }
}

/// Number of operands of an element-wise op.
fn op_arity(op: &Op) -> usize {
    match op {
        Op::Select => 3,
        Op::Binary { .. } | Op::Compare { .. } => 2,
        _ => 1,
    }
}

/// The optional `(q_pos, k_pos)` operands of attention, at `at` and `at + 1`.
fn positions(ctx: &Ctx, args: &[&Val], at: usize) -> Option<(FastTensor, FastTensor)> {
    match (args.get(at), args.get(at + 1)) {
        (Some(q), Some(k)) => Some((ctx.dense(q), ctx.dense(k))),
        _ => None,
    }
}
