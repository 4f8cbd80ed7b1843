//! Running parallelised graphs: every rank of the mesh initialises only its shards of the
//! state and takes its part of each batch, the partitioned programs run on CPU threads
//! ([`autopar_runtime::run_spmd`]), and, to verify, the single-device reference runs the
//! same global graph next to them (or, for context parallelism, the original step before the
//! sequence was reordered: [`SpmdProgram::reference`]) and the results are compared, every
//! state tensor gathered back to its global shape.
//!
//! A graph's *state* is its parameters; an output named like a parameter is that parameter's
//! next value (the training-step convention), so a forward graph has no state updates and a
//! step graph updates weights and optimizer state.

use autopar_ir::sharding_algebra::local_region;
use autopar_ir::{DeviceMesh, Graph, Op, Sharding, TensorType};
use autopar_passes::parallelize::{ParallelOptions, Parallelized, parallelize};
use autopar_passes::partition::partition_all;
use autopar_runtime::{
    self as rt, Data, RankProgram, RunOptions, SpmdOptions, Tensor, TensorMap, element_init,
};

use crate::Error;

/// A graph parallelised on a mesh and partitioned into one program per rank.
#[derive(Clone, Debug)]
pub struct SpmdProgram {
    /// The global graph with complete shardings, and the chosen strategies.
    pub global: Parallelized,
    /// The local program of every rank, in rank order.
    pub ranks: Vec<Graph>,
    /// The graph `--verify` runs on one device, when it is not the global graph itself: the
    /// original step of a model laid out for context parallelism, whose global graph holds
    /// the sequence in another order (same parameters, inputs and loss).
    pub reference: Option<Graph>,
}

impl SpmdProgram {
    /// The mesh the programs run on.
    pub fn mesh(&self) -> Result<&DeviceMesh, Error> {
        self.global
            .graph
            .mesh()
            .ok_or_else(|| Error::Usage("the parallelised graph has no mesh".into()))
    }
}

/// Parallelises `g` on `mesh` and partitions it for every rank.
pub fn compile(
    g: &Graph,
    mesh: &DeviceMesh,
    options: &ParallelOptions,
) -> Result<SpmdProgram, Error> {
    let global = parallelize(g, mesh, options)?;
    let ranks = partition_all(&global.graph, &global.plan)?;
    Ok(SpmdProgram {
        global,
        ranks,
        reference: None,
    })
}

/// The outcome of `--verify`.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyReport {
    /// The tensor (or `loss`) with the largest relative difference.
    pub worst: String,
    /// Largest absolute difference over the losses and every state tensor.
    pub max_abs_err: f64,
    /// Largest relative difference: per tensor, the largest absolute difference over the
    /// largest magnitude of the reference, or [`REL_FLOOR`] when that is smaller (see there).
    pub max_rel_err: f64,
    /// The tolerance both errors are held to.
    pub tolerance: f64,
}

impl VerifyReport {
    /// True when both errors are within the tolerance (and are numbers).
    pub fn ok(&self) -> bool {
        self.max_abs_err <= self.tolerance && self.max_rel_err <= self.tolerance
    }

    /// `verify: max_abs_err=<x> max_rel_err=<y> OK` (or `FAILED`).
    pub fn line(&self) -> String {
        format!(
            "verify: max_abs_err={:.3e} max_rel_err={:.3e} {}",
            self.max_abs_err,
            self.max_rel_err,
            if self.ok() { "OK" } else { "FAILED" }
        )
    }
}

/// What a multi-rank run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct SpmdSummary {
    /// The loss of every step (from rank 0; the loss is replicated).
    pub losses: Vec<f64>,
    /// The comparison with the reference, when asked for.
    pub verify: Option<VerifyReport>,
    /// Largest peak of live tensor bytes of any rank in any step.
    pub peak_bytes: u64,
}

/// The smallest scale relative errors are taken against, so that tensors of magnitude below
/// 1 are held to the absolute tolerance (the usual mixed criterion `|a - b| <= tol * max(|b|,
/// 1)`). A weight whose gradient vanishes in exact arithmetic (a key bias: softmax ignores a
/// shift common to all keys) moves only on rounding noise, which differs with the order of
/// the sums; relative to its own near-zero size that noise would look like a disagreement.
pub const REL_FLOOR: f64 = 1.0;

/// The tolerance of `--verify` for f32 compute.
pub const VERIFY_TOLERANCE: f64 = 1e-4;

/// The tolerance of `--verify` for bf16 or f16 compute: partial sums are rounded to 8 (or 11)
/// bits in a different order on every mesh, so gradients differ by about 1%, and Adam's
/// normalised update turns that into a difference of up to the learning rate per step on
/// elements with tiny gradients.
pub const VERIFY_TOLERANCE_LOW_PRECISION: f64 = 5e-2;

/// The `--verify` tolerance for a compute dtype.
pub fn verify_tolerance(compute: autopar_ir::DType) -> f64 {
    if compute == autopar_ir::DType::F32 {
        VERIFY_TOLERANCE
    } else {
        VERIFY_TOLERANCE_LOW_PRECISION
    }
}

/// Runs `steps` steps of `program` with state and data drawn from `seed`; with
/// `verify: Some(tolerance)`, runs the reference next to it and compares (see the module
/// docs). `each` sees every step's loss.
pub fn run(
    program: &SpmdProgram,
    seed: u64,
    steps: u64,
    verify: Option<f64>,
    mut each: impl FnMut(u64, f64),
) -> Result<SpmdSummary, Error> {
    let g = &program.global.graph;
    let mesh = program.mesh()?;
    let mut states: Vec<TensorMap> = (0..mesh.num_devices())
        .map(|rank| init_rank_state(g, mesh, rank, seed))
        .collect::<Result<_, _>>()?;
    let reference_graph = program.reference.as_ref().unwrap_or(g);
    let mut reference = if verify.is_some() {
        Some(rt::init_parameters(reference_graph, seed)?)
    } else {
        None
    };
    let mut summary = SpmdSummary {
        losses: Vec::new(),
        verify: None,
        peak_bytes: 0,
    };
    let mut discrepancy = Discrepancy::new();
    for step in 0..steps {
        let batch = rt::synthetic_batch(g, seed, step)?;
        let inputs: Vec<TensorMap> = (0..mesh.num_devices())
            .map(|rank| rank_inputs(g, &batch, mesh, rank))
            .collect::<Result<_, _>>()?;
        let ranks: Vec<RankProgram<'_>> = program
            .ranks
            .iter()
            .zip(&states)
            .zip(&inputs)
            .map(|((graph, params), inputs)| RankProgram {
                graph,
                params,
                inputs,
            })
            .collect();
        let outs = rt::run_spmd(mesh, &ranks, SpmdOptions::default())?;
        let loss = outs
            .first()
            .ok_or_else(|| Error::Usage("the mesh has no ranks".into()))?
            .scalar("loss")?;
        each(step, loss);
        summary.losses.push(loss);
        for (state, out) in states.iter_mut().zip(outs) {
            summary.peak_bytes = summary.peak_bytes.max(out.peak_bytes);
            for (name, t) in out.outputs {
                if let Some(slot) = state.get_mut(&name) {
                    *slot = t;
                }
            }
        }
        if let Some(reference) = reference.as_mut() {
            discrepancy.reference_step(reference_graph, reference, &batch, loss)?;
        }
    }
    if let Some(reference) = &reference {
        let tolerance = verify.unwrap_or(VERIFY_TOLERANCE);
        summary.verify = Some(discrepancy.finish(g, reference, mesh, &states, tolerance)?);
    }
    Ok(summary)
}

/// The running comparison of a parallel run with the single-device reference: the loss of
/// every step, then every state tensor gathered back to its global shape.
struct Discrepancy {
    abs: f64,
    rel: f64,
    worst: String,
}

impl Discrepancy {
    fn new() -> Self {
        Discrepancy {
            abs: 0.0,
            rel: 0.0,
            worst: "loss".to_string(),
        }
    }

    /// Runs the reference step on `reference` (its state, advanced in place) and compares its
    /// loss with the parallel run's.
    fn reference_step(
        &mut self,
        g: &Graph,
        reference: &mut TensorMap,
        batch: &TensorMap,
        loss: f64,
    ) -> Result<(), Error> {
        let out = rt::run(g, reference, batch, RunOptions::default())?;
        let want = out.scalar("loss")?;
        self.abs = self.abs.max((loss - want).abs());
        self.rel = self
            .rel
            .max((loss - want).abs() / want.abs().max(f64::MIN_POSITIVE));
        for (name, t) in out.outputs {
            if let Some(slot) = reference.get_mut(&name) {
                *slot = t;
            }
        }
        Ok(())
    }

    /// Compares every parameter of `g` held by the ranks' `states` (laid out on `mesh`) with
    /// the reference, and reports the result against `tolerance`.
    fn finish(
        mut self,
        g: &Graph,
        reference: &TensorMap,
        mesh: &DeviceMesh,
        states: &[TensorMap],
        tolerance: f64,
    ) -> Result<VerifyReport, Error> {
        for (v, name, ty) in g.parameters() {
            let Some(want) = reference.get(name) else {
                continue;
            };
            let s = sharding_of(g, v)?;
            let got = gather(name, ty, &s, mesh, states)?;
            let (a, r) = compare(&got, want);
            self.abs = self.abs.max(a);
            if r > self.rel {
                self.rel = r;
                self.worst = name.to_string();
            }
        }
        Ok(VerifyReport {
            worst: self.worst,
            max_abs_err: self.abs,
            max_rel_err: self.rel,
            tolerance,
        })
    }
}

fn sharding_of(g: &Graph, v: autopar_ir::ValueId) -> Result<Sharding, Error> {
    g.value(v)
        .sharding
        .clone()
        .ok_or_else(|| Error::Usage(format!("{v} has no sharding")))
}

/// Global row-major indices of the elements of `region` of a tensor of shape `dims`, in the
/// region's row-major order.
fn region_indices(dims: &[usize], region: &[std::ops::Range<usize>]) -> Vec<usize> {
    let mut out = vec![0usize];
    for (d, r) in region.iter().enumerate() {
        let mut next = Vec::with_capacity(out.len() * r.len());
        for &base in &out {
            for i in r.clone() {
                next.push(base * dims[d] + i);
            }
        }
        out = next;
    }
    out
}

/// The state of `rank`: its shard of every parameter, drawn element by element by global
/// index, so no rank ever holds a whole sharded tensor.
pub fn init_rank_state(
    g: &Graph,
    mesh: &DeviceMesh,
    rank: usize,
    seed: u64,
) -> Result<TensorMap, Error> {
    let coords = mesh.coords(rank);
    let mut state = TensorMap::new();
    for n in g.nodes_in_order() {
        let Op::Parameter { name, ty, init } = &g.node(n).op else {
            continue;
        };
        let v = g.node(n).outputs[0];
        let s = sharding_of(g, v)?;
        let region = local_region(ty.dims(), &s, mesh, &coords).map_err(rt_ir)?;
        let local = TensorType::new(ty.dtype, region.iter().map(|r| r.len()).collect::<Vec<_>>());
        let t = if ty.dtype.is_float() {
            let draw = element_init(name, *init, seed);
            let values = region_indices(ty.dims(), &region)
                .into_iter()
                .map(|i| draw(i as u64))
                .collect();
            Tensor::new(local, Data::Float(values))?.rounded()
        } else {
            rt::init_parameter(name, &local, *init, seed)?
        };
        state.insert(name.clone(), t);
    }
    Ok(state)
}

fn rt_ir(e: autopar_ir::IrError) -> Error {
    Error::Runtime(rt::RuntimeError::from(e))
}

/// The part of the global batch `rank` is fed: each input sliced to the rank's region.
pub fn rank_inputs(
    g: &Graph,
    batch: &TensorMap,
    mesh: &DeviceMesh,
    rank: usize,
) -> Result<TensorMap, Error> {
    let coords = mesh.coords(rank);
    let mut out = TensorMap::new();
    for (v, name, _) in g.inputs() {
        let Some(t) = batch.get(name) else { continue };
        let s = sharding_of(g, v)?;
        let region = local_region(t.dims(), &s, mesh, &coords).map_err(rt_ir)?;
        let idx = region_indices(t.dims(), &region);
        let local = TensorType::new(
            t.dtype(),
            region.iter().map(|r| r.len()).collect::<Vec<_>>(),
        );
        let data = match t.data() {
            Data::Float(x) => Data::Float(idx.iter().map(|&i| x[i]).collect()),
            Data::Int(x) => Data::Int(idx.iter().map(|&i| x[i]).collect()),
            Data::Bool(x) => Data::Bool(idx.iter().map(|&i| x[i]).collect()),
        };
        out.insert(name.to_string(), Tensor::new(local, data)?);
    }
    Ok(out)
}

/// Parameter `name` gathered to its global type from every rank's shard.
fn gather(
    name: &str,
    ty: &TensorType,
    s: &Sharding,
    mesh: &DeviceMesh,
    states: &[TensorMap],
) -> Result<Tensor, Error> {
    let mut values = vec![0.0f64; ty.num_elements() as usize];
    for (rank, state) in states.iter().enumerate() {
        let t = state
            .get(name)
            .ok_or_else(|| Error::Usage(format!("rank {rank} lost the state `{name}`")))?;
        let region = local_region(ty.dims(), s, mesh, &mesh.coords(rank)).map_err(rt_ir)?;
        let local = t.to_f64_vec();
        for (i, global) in region_indices(ty.dims(), &region).into_iter().enumerate() {
            values[global] = local.get(i).copied().unwrap_or(f64::NAN);
        }
    }
    Ok(Tensor::from_f64(ty.clone(), values)?)
}

/// Largest absolute difference, and that over the reference's largest magnitude.
fn compare(got: &Tensor, want: &Tensor) -> (f64, f64) {
    let (a, b) = (got.to_f64_vec(), want.to_f64_vec());
    let mut abs = 0.0f64;
    let mut scale = 0.0f64;
    for (x, y) in a.iter().zip(&b) {
        let d = (x - y).abs();
        // NaN anywhere fails the comparison.
        abs = if d.is_nan() { f64::NAN } else { abs.max(d) };
        scale = scale.max(y.abs());
    }
    if abs.is_nan() {
        return (f64::INFINITY, f64::INFINITY);
    }
    (abs, abs / scale.max(REL_FLOOR))
}

/// A training step parallelised over the mesh's axes other than `pp` and then cut into a
/// pipeline along `pp`: every coordinate on the other axes gets its own pipeline, cut from
/// its partitioned local step at the same layer boundaries.
#[derive(Clone, Debug)]
pub struct PipelinedSpmd {
    /// The whole mesh, `pp` included.
    pub mesh: DeviceMesh,
    /// The step parallelised and partitioned on the mesh without `pp`.
    pub spmd: SpmdProgram,
    /// The stage split of the global step, shared by every pipeline.
    pub split: autopar_passes::pipeline::StageSplit,
    /// One pipeline per coordinate on the axes other than `pp`, in row-major order.
    pub pipelines: Vec<autopar_ir::pipeline::PipelineProgram>,
}

/// The mesh without its `pp` axis (`None` when no other axis is left).
pub fn without_pp(mesh: &DeviceMesh) -> Result<Option<DeviceMesh>, Error> {
    let text: Vec<String> = mesh
        .axes()
        .iter()
        .filter(|a| a.name != rt::pipeline::PP_AXIS)
        .map(|a| format!("{}={}", a.name, a.size))
        .collect();
    if text.is_empty() {
        return Ok(None);
    }
    let text = text.join(",");
    DeviceMesh::parse(&text)
        .map(Some)
        .map_err(|e| Error::Usage(format!("mesh `{text}`: {e}")))
}

/// Parallelises `step` over the axes of `mesh` other than `pp`, then cuts every rank's
/// local step into the pipeline `pipeline` describes (its `pp` must be the mesh's).
pub fn compile_pipelined(
    step: &crate::TrainStep,
    mesh: &DeviceMesh,
    options: &ParallelOptions,
    pipeline: &autopar_passes::pipeline::PipelineOptions,
) -> Result<PipelinedSpmd, Error> {
    compile_pipelined_with_reference(step, None, mesh, options, pipeline)
}

/// [`compile_pipelined`] for a step whose single-device reference is another graph (a step
/// laid out for context parallelism verifies against the original: [`SpmdProgram::reference`]).
pub fn compile_pipelined_with_reference(
    step: &crate::TrainStep,
    reference: Option<Graph>,
    mesh: &DeviceMesh,
    options: &ParallelOptions,
    pipeline: &autopar_passes::pipeline::PipelineOptions,
) -> Result<PipelinedSpmd, Error> {
    use autopar_passes::pipeline::{PipelineOptions, plan_stages, split_pipeline};
    let sub = without_pp(mesh)?
        .ok_or_else(|| Error::Usage(format!("the mesh `{mesh}` has no axis besides `pp`")))?;
    let mut spmd = compile(&step.graph, &sub, options)?;
    spmd.reference = reference;
    let n_stages = pipeline.pp * pipeline.vpp;
    let split = plan_stages(&step.graph, n_stages, &pipeline.boundaries)?;
    // Every local step is cut at the global step's boundaries, so that all pipelines agree.
    let pins: Vec<String> = split.starts.iter().skip(1).map(|s| s.to_string()).collect();
    let local_options = PipelineOptions {
        boundaries: pins,
        ..pipeline.clone()
    };
    let pipelines = spmd
        .ranks
        .iter()
        .map(|local| {
            let local_step = crate::TrainStep {
                graph: local.clone(),
                ..step.clone()
            };
            split_pipeline(&local_step, &local_options).map(|p| p.program)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PipelinedSpmd {
        mesh: mesh.clone(),
        spmd,
        split,
        pipelines,
    })
}

/// What a pipelined SPMD run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelinedSummary {
    /// The loss of every step.
    pub losses: Vec<f64>,
    /// The comparison with the reference, when asked for.
    pub verify: Option<VerifyReport>,
    /// The last step's report of every pipeline.
    pub last: Vec<rt::PipelineStepReport>,
    /// Bytes of training state each rank of the whole mesh holds between steps (its shards
    /// of the parameters and optimizer state its stages read), in rank order.
    pub state_bytes: Vec<u64>,
}

/// The training state rank `rank` of `program`'s mesh holds between steps: its shards (on
/// the axes other than `pp`) of the state its pipeline stages read, drawn from `seed`.
pub fn init_pipeline_rank_state(
    program: &PipelinedSpmd,
    rank: usize,
    seed: u64,
) -> Result<TensorMap, Error> {
    let g = &program.spmd.global.graph;
    let (pp_rank, which) = rt::split_pipeline_rank(&program.mesh, rank);
    let mut all = init_rank_state(g, program.spmd.mesh()?, which, seed)?;
    let sources = program
        .pipelines
        .get(which)
        .and_then(|p| p.sources.get(pp_rank))
        .ok_or_else(|| Error::Usage(format!("rank {rank} has no pipeline")))?;
    Ok(sources
        .iter()
        .filter(|s| s.is_state)
        .filter_map(|s| all.remove(&s.name).map(|t| (s.name.clone(), t)))
        .collect())
}

/// Runs `steps` steps of `program` on the CPU ranks of its mesh (one thread per rank), from
/// the state and data of `seed`; with `verify: Some(tolerance)`, runs the single-device
/// reference next to it and compares the losses and every state tensor, gathered back to
/// its global shape from the ranks that hold it.
///
/// Each rank holds, and carries from one step to the next, only the state its own stages
/// read (and update, or receive updated): a pipeline rank never holds the parameters or
/// optimizer state of another rank's stages.
pub fn run_pipelined(
    program: &PipelinedSpmd,
    seed: u64,
    steps: u64,
    verify: Option<f64>,
    mut each: impl FnMut(u64, f64),
) -> Result<PipelinedSummary, Error> {
    let g = &program.spmd.global.graph;
    let sub = program.spmd.mesh()?;
    let mesh = &program.mesh;
    let n = mesh.num_devices();
    let split = |rank: usize| rt::split_pipeline_rank(mesh, rank);
    let mut states: Vec<TensorMap> = (0..n)
        .map(|rank| init_pipeline_rank_state(program, rank, seed))
        .collect::<Result<_, _>>()?;
    let reference_graph = program.spmd.reference.as_ref().unwrap_or(g);
    let mut reference = if verify.is_some() {
        Some(rt::init_parameters(reference_graph, seed)?)
    } else {
        None
    };
    let mut discrepancy = Discrepancy::new();
    let mut losses = Vec::new();
    let mut last = Vec::new();
    for step in 0..steps.max(1) {
        let batch = rt::synthetic_batch(g, seed, step)?;
        let batches: Vec<TensorMap> = (0..n)
            .map(|rank| rank_inputs(g, &batch, sub, split(rank).1))
            .collect::<Result<_, _>>()?;
        let reports = rt::run_pipeline_step_spmd(
            &program.pipelines,
            mesh,
            &states,
            &batches,
            RunOptions::default(),
            rt::CommOptions::default(),
        )?;
        let loss = reports
            .first()
            .and_then(|r| r.outputs.get("loss"))
            .and_then(|t| t.scalar_value())
            .ok_or_else(|| Error::Usage("the pipelined step has no loss".into()))?;
        each(step, loss);
        losses.push(loss);
        // Every rank takes its own next state: the state it read, updated (a state without
        // a next value, which the step does not update, stays as it is).
        for (rank, state) in states.iter_mut().enumerate() {
            let (pp_rank, which) = split(rank);
            let next = &reports[which].ranks[pp_rank].state;
            for (name, slot) in state.iter_mut() {
                match next.get(name) {
                    Some(t) => *slot = t.clone(),
                    None if g.output(name).is_none() => {}
                    None => {
                        return Err(Error::Usage(format!(
                            "rank {rank} did not end the step with the next value of `{name}`"
                        )));
                    }
                }
            }
        }
        if let Some(reference) = reference.as_mut() {
            discrepancy.reference_step(reference_graph, reference, &batch, loss)?;
        }
        last = reports;
    }
    let state_bytes = states
        .iter()
        .map(|s| s.values().map(Tensor::size_bytes).sum())
        .collect();
    let mut verify_report = None;
    if let Some(reference) = &reference {
        // Every coordinate's state, gathered over its pipeline ranks: each tensor from the
        // first rank that holds it (ranks sharing a tied weight hold the same value).
        let mut merged = vec![TensorMap::new(); program.pipelines.len()];
        for (rank, state) in states.iter().enumerate() {
            let held = &mut merged[split(rank).1];
            for (name, t) in state {
                held.entry(name.clone()).or_insert_with(|| t.clone());
            }
        }
        let tolerance = verify.unwrap_or(VERIFY_TOLERANCE);
        verify_report = Some(discrepancy.finish(g, reference, sub, &merged, tolerance)?);
    }
    Ok(PipelinedSummary {
        losses,
        verify: verify_report,
        last,
        state_bytes,
    })
}
