//! The compiler's pass pipeline: [`compile`] lists the passes in order, runs the IR
//! verifier on every graph a pass hands on, times each pass, and keeps the text of those
//! asked for in [`CompileOptions::dump_after`] (Cranelift's `Context::optimize` and XLA's
//! pass pipeline are the models). Its result, [`CompiledStep`], is the contract between the
//! compiler and every backend: the per-rank programs, the layout of the training state over
//! the ranks, and the graph `--verify` runs on one device.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use autopar_cost_model::{CostModel, cluster};
use autopar_ir::pipeline::PipelineProgram;
use autopar_ir::{DType, DeviceMesh, Graph, axis};
use autopar_passes::collectives::{CollectiveOptions, group_collectives};
use autopar_passes::fuse::{FuseOptions, FuseReport, fuse_group};
use autopar_passes::pipeline::{PipelineOptions, StageSplit, plan_stages, split_pipeline};
use autopar_passes::propagate::ShardingPlan;
use autopar_passes::train::{TrainStep, build_train_step};
use autopar_runtime::{ExecutionPlan, PipelinePlans};

use crate::options::{CompileOptions, sequence_layout, without_pp};
use crate::state::StateLayout;
use crate::{Error, load_micro_batch_forward_with_loss, load_model_with_loss};

/// The passes of [`compile`], in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pass {
    /// Build the forward graph of one micro-batch (zoo, spec or file).
    Model,
    /// Lay the sequence out in the load-balanced order context parallelism (or the
    /// attention core on `tp`'s sequence shards) needs. Runs only for such meshes.
    SequenceLayout,
    /// Build the training step: autodiff, casts, loss scaling, clipping, the optimizer and
    /// activation recompute. Skipped for a forward-only compile.
    TrainStep,
    /// Give every value a sharding over the mesh's axes other than `pp` (data, tensor,
    /// context and expert parallelism, ZeRO, annotations, layer placement). Runs when the
    /// mesh has such an axis.
    Parallelize,
    /// Turn the sharded global graph into the local program of every rank, with its
    /// collectives. Runs when [`Pass::Parallelize`] does.
    Partition,
    /// Cut every rank's local program into pipeline stages, micro-batch by micro-batch.
    /// Runs for a `pp` axis above 1.
    PipelineSplit,
    /// Rewrite every rank program (every sub-program of a pipeline): exact algebraic
    /// simplification, identical collectives merged, element-wise regions grouped into
    /// `fusion` nodes ([`autopar_passes::fuse`]). Runs unless [`CompileOptions::fuse`] is off.
    Fuse,
    /// Bucket the gradient all-reduces of every rank program (every sub-program of a
    /// pipeline) into [`CompileOptions::bucket_mb`] buckets and batch its small all-reduces
    /// ([`autopar_passes::collectives`]). Runs when [`Pass::Partition`] does.
    Collectives,
    /// Plan the execution of every rank program (every sub-program of a pipeline): its
    /// order, the values freed after each node, and a static arena with the peak bytes known
    /// before anything runs.
    MemoryPlan,
}

impl Pass {
    /// Every pass, in pipeline order.
    pub const ALL: [Pass; 9] = [
        Pass::Model,
        Pass::SequenceLayout,
        Pass::TrainStep,
        Pass::Parallelize,
        Pass::Partition,
        Pass::PipelineSplit,
        Pass::Fuse,
        Pass::Collectives,
        Pass::MemoryPlan,
    ];

    /// The pass's name in `--dump-after` and `--timings`.
    pub const fn name(self) -> &'static str {
        match self {
            Pass::Model => "model",
            Pass::SequenceLayout => "sequence-layout",
            Pass::TrainStep => "train-step",
            Pass::Parallelize => "parallelize",
            Pass::Partition => "partition",
            Pass::PipelineSplit => "pipeline-split",
            Pass::Fuse => "fuse",
            Pass::Collectives => "collectives",
            Pass::MemoryPlan => "memory-plan",
        }
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Pass {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Pass::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Pass::ALL.iter().map(|p| p.name()).collect();
                format!("unknown pass `{s}` (passes: {})", names.join(", "))
            })
    }
}

/// How long one pass took, and what it produced.
#[derive(Clone, Debug, PartialEq)]
pub struct PassTiming {
    /// The pass.
    pub pass: Pass,
    /// Wall time of the pass itself.
    pub wall: Duration,
    /// Wall time of the verifier over the pass's output.
    pub verify: Duration,
    /// Graphs the pass produced (one per rank after partitioning, one per sub-program after
    /// the pipeline split).
    pub graphs: usize,
    /// Nodes over all of them.
    pub nodes: usize,
}

/// The output of a pass as text: one `.air` file per graph it produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassDump {
    /// The pass.
    pub pass: Pass,
    /// `(file name, text IR)`, e.g. `partition.rank3.air`.
    pub files: Vec<(String, String)>,
}

/// A training step (or a forward pass) compiled for a mesh: what the compiler hands to a
/// backend.
#[derive(Clone, Debug)]
pub struct CompiledStep {
    /// The whole mesh, `pp` included (a single device is the mesh `dp=1`).
    pub mesh: DeviceMesh,
    /// The mesh the state is sharded over: `mesh` without `pp` (`dp=1` when nothing else).
    pub spmd_mesh: DeviceMesh,
    /// The global step: sharded over `spmd_mesh` when the mesh has axes besides `pp`.
    pub global: Graph,
    /// The strategy propagation chose for every node, when the step was parallelised.
    pub strategies: Option<ShardingPlan>,
    /// The training step's bookkeeping (weights, optimizer state, micro-batches); `None`
    /// for a forward-only compile.
    pub train: Option<TrainStep>,
    /// The local program of every coordinate of `spmd_mesh`, in its rank order: the
    /// programs that run as they are without a pipeline, and that are cut into stages with
    /// one. Empty when compilation stopped before partitioning.
    pub locals: Vec<Graph>,
    /// The execution plan of every program of `locals` (empty for a pipeline, whose plans
    /// are [`CompiledPipeline::plans`], or when compilation stopped before
    /// [`Pass::MemoryPlan`]).
    pub plans: Vec<ExecutionPlan>,
    /// The pipeline, for a `pp` axis above 1.
    pub pipeline: Option<CompiledPipeline>,
    /// Where every state tensor lives: its global type, sharding and the ranks holding
    /// each region.
    pub state: StateLayout,
    /// What `--verify` runs on one device: the uncompiled step (the original one, before the
    /// sequence was laid out, when the mesh needed a layout). `None` when the step was laid
    /// out and [`CompileOptions::reference`] did not ask for the original.
    pub reference: Option<Graph>,
    /// The compute dtype, which sets `--verify`'s tolerance.
    pub compute_dtype: DType,
    /// What [`Pass::Fuse`] did to each program it rewrote, labelled as
    /// [`CompiledStep::programs`] labels them (`rank0`, `pipeline1.backward.vs0.mb1`). Empty
    /// when it did not run.
    pub fusion: Vec<(String, FuseReport)>,
    /// Every pass that ran, in order, with its time.
    pub timings: Vec<PassTiming>,
    /// The outputs of the passes named in [`CompileOptions::dump_after`].
    pub dumps: Vec<PassDump>,
}

/// A step cut into a pipeline on the `pp` axis: one pipeline per coordinate of the other
/// axes, all cut at the same layers.
#[derive(Clone, Debug)]
pub struct CompiledPipeline {
    /// The stage split of the global step, which every pipeline follows.
    pub split: StageSplit,
    /// `pipelines[i]`: the pipeline of coordinate `i` of [`CompiledStep::spmd_mesh`].
    pub pipelines: Vec<PipelineProgram>,
    /// `plans[i]`: the execution plans of the sub-programs of `pipelines[i]` (empty when
    /// compilation stopped before [`Pass::MemoryPlan`]).
    pub plans: Vec<PipelinePlans>,
}

impl CompiledStep {
    /// True when the step runs as a pipeline.
    pub fn is_pipeline(&self) -> bool {
        self.pipeline.is_some()
    }

    /// True for a training step (false for a forward pass).
    pub fn is_training(&self) -> bool {
        self.train.is_some()
    }

    /// Pipeline ranks (1 without a pipeline).
    pub fn pp(&self) -> usize {
        self.mesh.axis_size(axis::PP).unwrap_or(1)
    }

    /// The programs that run, labelled: every SPMD rank program (`rank3`), or with a
    /// pipeline every sub-program of every pipeline (`pipeline0.forward.vs1.mb0`,
    /// `pipeline0.optimizer2.rank1`), as `--dump-after` names their files.
    pub fn programs(&self) -> Vec<(String, &Graph)> {
        match &self.pipeline {
            Some(p) => pipeline_graphs(&p.pipelines),
            None => self.locals.graphs(),
        }
    }
}

/// Compiles `options` (see the module docs for the passes and [`CompiledStep`] for the
/// result).
pub fn compile(options: &CompileOptions) -> Result<CompiledStep, Error> {
    let o = options;
    let mut log = PassLog::new(o);
    let mesh = match &o.mesh {
        Some(m) => m.clone(),
        None => DeviceMesh::new([(axis::DP, 1)])?,
    };
    let pp = mesh.axis_size(axis::PP).unwrap_or(1);
    let partitioned_mesh = without_pp(&mesh)?;
    check_spmd_options(o, &mesh, partitioned_mesh.is_some())?;
    let layout = sequence_layout(&mesh, &o.parallel.layer)?;

    let forward = log.run(Pass::Model, || match o.forward_only {
        true => load_model_with_loss(&o.model, o.batch, o.loss),
        false => {
            load_micro_batch_forward_with_loss(&o.model, o.batch, o.train.micro_batches, o.loss)
        }
    })?;
    let laid_out = match layout {
        Some(l) if !stops_before(o, Pass::SequenceLayout) => {
            Some(log.run(Pass::SequenceLayout, || l.apply(&forward))?)
        }
        _ => None,
    };
    // Stopped before the training step (or compiling a forward pass): the forward is the
    // step.
    let forward_only = o.forward_only || stops_before(o, Pass::TrainStep);
    let (step, train) = if forward_only {
        if pp > 1 && o.forward_only {
            return Err(Error::Usage(format!(
                "--forward runs one forward pass; the mesh `{mesh}` is a pipeline, which trains"
            )));
        }
        (laid_out.clone().unwrap_or_else(|| forward.clone()), None)
    } else {
        let step = log.run(Pass::TrainStep, || {
            Ok(build_train_step(
                laid_out.as_ref().unwrap_or(&forward),
                &o.train,
            )?)
        })?;
        (step.graph.clone(), Some(step))
    };
    // The reference runs the original order of the sequence; without a layout it is the
    // step itself.
    let reference = match (&laid_out, o.reference, forward_only) {
        (None, _, _) => Some(step.clone()),
        (Some(_), false, _) => None,
        (Some(_), true, true) => Some(forward),
        (Some(_), true, false) => Some(build_train_step(&forward, &o.train)?.graph),
    };
    let mut compiled = CompiledStep {
        spmd_mesh: partitioned_mesh
            .clone()
            .unwrap_or(DeviceMesh::new([(axis::DP, 1)])?),
        mesh,
        global: step,
        strategies: None,
        train,
        locals: Vec::new(),
        plans: Vec::new(),
        pipeline: None,
        state: StateLayout::default(),
        reference,
        compute_dtype: o.train.compute_dtype,
        fusion: Vec::new(),
        timings: Vec::new(),
        dumps: Vec::new(),
    };
    if stops_before(o, Pass::Parallelize) {
        return log.finish(compiled);
    }
    if let Some(sub) = &partitioned_mesh {
        let p = log.run(Pass::Parallelize, || {
            Ok(autopar_passes::parallelize::parallelize(
                &compiled.global,
                sub,
                &o.parallel,
            )?)
        })?;
        compiled.global = p.graph;
        compiled.strategies = Some(p.plan);
    }
    if stops_before(o, Pass::Partition) {
        compiled.state = StateLayout::new(&compiled)?;
        return log.finish(compiled);
    }
    compiled.locals = match &compiled.strategies {
        Some(plan) => log.run(Pass::Partition, || {
            Ok(autopar_passes::partition::partition_all(
                &compiled.global,
                plan,
            )?)
        })?,
        None => vec![compiled.global.clone()],
    };
    if pp > 1 && !stops_before(o, Pass::PipelineSplit) {
        let train = compiled.train.as_ref().ok_or_else(|| {
            Error::Usage("a pipeline needs a training step, not a forward pass".into())
        })?;
        let pipeline = log.run(Pass::PipelineSplit, || {
            split_every_rank(train, &compiled.locals, pp, o)
        })?;
        compiled.pipeline = Some(pipeline);
    }
    if o.fuse && !stops_before(o, Pass::Fuse) {
        let fused = log.run(Pass::Fuse, || {
            fuse_programs(&compiled.mesh, &compiled.locals, compiled.pipeline.as_ref())
        })?;
        compiled.fusion = fused.reports;
        match (fused.programs, compiled.pipeline.as_mut()) {
            (Fused::Spmd(locals), _) => compiled.locals = locals,
            (Fused::Pipelined(pipelines), Some(p)) => p.pipelines = pipelines,
            (Fused::Pipelined(_), None) => {}
        }
    }
    if compiled.strategies.is_some() && !stops_before(o, Pass::Collectives) {
        let options = CollectiveOptions::with_bucket_mb(o.bucket_mb)?;
        match compiled.pipeline.take() {
            None => {
                compiled.locals = log.run(Pass::Collectives, || {
                    compiled
                        .locals
                        .iter()
                        .map(|g| Ok(group_collectives(g, &options, next_value_id([g]))?.0))
                        .collect::<Result<Vec<_>, Error>>()
                })?;
            }
            Some(pipeline) => {
                compiled.pipeline = Some(log.run(Pass::Collectives, || {
                    group_pipeline_collectives(pipeline, &options)
                })?);
            }
        }
    }
    if !stops_before(o, Pass::MemoryPlan) {
        let plans = log.run(Pass::MemoryPlan, || {
            Ok(match &compiled.pipeline {
                None => Plans::Spmd(autopar_runtime::plan_all(&compiled.locals)?),
                Some(p) => Plans::Pipelined(
                    p.pipelines
                        .iter()
                        .map(PipelinePlans::new)
                        .collect::<Result<_, _>>()?,
                ),
            })
        })?;
        match (plans, compiled.pipeline.as_mut()) {
            (Plans::Spmd(plans), _) => compiled.plans = plans,
            (Plans::Pipelined(plans), Some(p)) => p.plans = plans,
            (Plans::Pipelined(_), None) => {}
        }
    }
    compiled.state = StateLayout::new(&compiled)?;
    log.finish(compiled)
}

fn stops_before(o: &CompileOptions, pass: Pass) -> bool {
    o.stop_after.is_some_and(|last| last < pass)
}

/// Refuses a mesh axis the compiler gives no meaning to (it would silently replicate
/// everything over it), annotations over axes the mesh does not have, and SPMD options on a
/// mesh without an axis to apply them to.
fn check_spmd_options(o: &CompileOptions, mesh: &DeviceMesh, has_spmd: bool) -> Result<(), Error> {
    let known = || {
        autopar_ir::Axis::ALL
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(a) = mesh
        .axes()
        .iter()
        .find(|a| autopar_ir::Axis::from_name(&a.name).is_none())
    {
        return Err(Error::Usage(format!(
            "--mesh `{mesh}`: `{}` is not a mesh axis the compiler uses ({})",
            a.name,
            known()
        )));
    }
    for a in &o.parallel.annotations {
        if let Some((name, _)) = a
            .axes
            .iter()
            .find(|(name, _)| mesh.axis_size(name).is_none())
        {
            return Err(Error::Usage(format!(
                "annotation line {}: `{}` is placed over `{name}`, which the mesh `{mesh}` does not have",
                a.line, a.tensor
            )));
        }
    }
    if has_spmd {
        return Ok(());
    }
    let p = &o.parallel;
    if p.zero > 0 {
        return Err(Error::Usage(format!(
            "--zero {} shards over the data axes `{}` and `{}`, which the mesh `{mesh}` does not have",
            p.zero,
            axis::DP,
            axis::EP
        )));
    }
    let refused = [
        (!p.annotations.is_empty(), "--annotate"),
        (p.sequence_parallel, "--sp"),
        (
            p.layer != autopar_cost_model::LayerPlacement::MEGATRON,
            "--attn/--mlp",
        ),
    ];
    if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
        return Err(Error::Usage(format!(
            "{flag} places tensors over the mesh's axes besides `{}`; the mesh `{mesh}` has none",
            axis::PP
        )));
    }
    Ok(())
}

/// Cuts every rank's local step into the pipeline `o.pipeline` describes, at the stage
/// boundaries of the global step, so that all pipelines agree.
fn split_every_rank(
    train: &TrainStep,
    locals: &[Graph],
    pp: usize,
    o: &CompileOptions,
) -> Result<CompiledPipeline, Error> {
    let spec = &o.pipeline;
    let split = plan_stages(&train.graph, pp * spec.vpp, &spec.boundaries)?;
    let options = PipelineOptions {
        pp,
        vpp: spec.vpp,
        schedule: spec.schedule,
        boundaries: split.starts.iter().skip(1).map(|s| s.to_string()).collect(),
    };
    let pipelines = locals
        .iter()
        .map(|local| {
            let local_step = TrainStep {
                graph: local.clone(),
                ..train.clone()
            };
            split_pipeline(&local_step, &options).map(|p| p.program)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(CompiledPipeline {
        split,
        pipelines,
        plans: Vec::new(),
    })
}

/// The programs [`Pass::Fuse`] rewrote, with a report per program.
struct FusedPrograms {
    programs: Fused,
    reports: Vec<(String, FuseReport)>,
}

enum Fused {
    Spmd(Vec<Graph>),
    Pipelined(Vec<PipelineProgram>),
}

/// Fuses the SPMD rank programs, or, for a pipeline, every sub-program of every pipeline
/// (the rank programs it was cut from stay as they are: nothing runs them). Programs that
/// talk to each other are fused as one group, so that they merge the same collectives: all
/// rank programs together, and each sub-program with its counterparts in the other
/// pipelines. Priced with the CPU cluster of the mesh's size, which runs them.
fn fuse_programs(
    mesh: &DeviceMesh,
    locals: &[Graph],
    pipeline: Option<&CompiledPipeline>,
) -> Result<FusedPrograms, Error> {
    let costs = CostModel::new(cluster::cpu(mesh.num_devices()));
    let options = FuseOptions::default();
    let Some(pipeline) = pipeline else {
        let graphs: Vec<&Graph> = locals.iter().collect();
        let (programs, reports): (Vec<Graph>, Vec<FuseReport>) =
            fuse_group(&graphs, &options, &costs)?.into_iter().unzip();
        let reports = reports
            .into_iter()
            .enumerate()
            .map(|(rank, r)| (format!("rank{rank}"), r))
            .collect();
        return Ok(FusedPrograms {
            programs: Fused::Spmd(programs),
            reports,
        });
    };
    let mut pipelines = pipeline.pipelines.clone();
    let mut reports: Vec<FuseReport> = Vec::new();
    // Every sub-program, named by where it is: (forward or backward, stage, micro-batch)
    // or an optimizer segment.
    let first = &pipeline.pipelines[..1];
    let mut places: Vec<(usize, usize, usize)> = Vec::new();
    for p in first {
        for (dir, programs) in [&p.forward, &p.backward].into_iter().enumerate() {
            for (vs, per_mb) in programs.iter().enumerate() {
                places.extend((0..per_mb.len()).map(|mb| (dir, vs, mb)));
            }
        }
        places.extend((0..p.optimizer.len()).map(|i| (2, i, 0)));
    }
    fn program(p: &mut PipelineProgram, (dir, a, b): (usize, usize, usize)) -> Option<&mut Graph> {
        match dir {
            0 => p.forward.get_mut(a)?.get_mut(b).map(|s| &mut s.graph),
            1 => p.backward.get_mut(a)?.get_mut(b).map(|s| &mut s.graph),
            _ => p.optimizer.get_mut(a).map(|s| &mut s.program.graph),
        }
    }
    for place in places {
        let originals: Vec<Graph> = pipelines
            .iter_mut()
            .map(|p| program(p, place).map(|g| g.clone()))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                Error::Usage(
                    "the pipelines of the mesh differ in their sub-programs; cannot fuse them \
                     together (compile with fusion off)"
                        .into(),
                )
            })?;
        let graphs: Vec<&Graph> = originals.iter().collect();
        for (p, (fused, report)) in pipelines
            .iter_mut()
            .zip(fuse_group(&graphs, &options, &costs)?)
        {
            if let Some(g) = program(p, place) {
                *g = fused;
            }
            reports.push(report);
        }
    }
    // Label the reports as the programs are labelled (pipeline by pipeline).
    let n = pipelines.len();
    let mut labelled: Vec<Option<FuseReport>> = vec![None; reports.len()];
    let per_pipeline = reports.len() / n.max(1);
    for (i, r) in reports.into_iter().enumerate() {
        let (place, which) = (i / n.max(1), i % n.max(1));
        labelled[which * per_pipeline + place] = Some(r);
    }
    let reports = pipeline_graphs(&pipelines)
        .into_iter()
        .map(|(label, _)| label)
        .zip(labelled.into_iter().flatten())
        .collect();
    Ok(FusedPrograms {
        programs: Fused::Pipelined(pipelines),
        reports,
    })
}

impl PassOutput for FusedPrograms {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        match &self.programs {
            Fused::Spmd(locals) => locals.graphs(),
            Fused::Pipelined(pipelines) => pipeline_graphs(pipelines),
        }
    }
}

/// One above the largest value id of `graphs`: where the ids of new values start.
fn next_value_id<'g>(graphs: impl IntoIterator<Item = &'g Graph>) -> u32 {
    graphs
        .into_iter()
        .flat_map(|g| g.value_ids())
        .map(|v| v.0.saturating_add(1))
        .max()
        .unwrap_or(0)
}

/// [`group_collectives`] over every sub-program of every pipeline, each on its own (so that
/// no bucket spans two sub-programs), new values numbered above every id of the pipeline
/// (a rank keeps the values of all its sub-programs in one store, by id).
fn group_pipeline_collectives(
    mut pipeline: CompiledPipeline,
    options: &CollectiveOptions,
) -> Result<CompiledPipeline, Error> {
    for p in &mut pipeline.pipelines {
        let programs = p
            .forward
            .iter_mut()
            .chain(p.backward.iter_mut())
            .flatten()
            .chain(p.optimizer.iter_mut().map(|seg| &mut seg.program));
        let programs: Vec<&mut autopar_ir::pipeline::StageProgram> = programs.collect();
        let mut fresh = next_value_id(programs.iter().map(|sp| &sp.graph));
        for sp in programs {
            let (graph, _) = group_collectives(&sp.graph, options, fresh)?;
            fresh = fresh.max(next_value_id([&graph]));
            sp.graph = graph;
        }
    }
    Ok(pipeline)
}

/// The graphs a pass's output consists of, labelled for the verifier's errors and the dump
/// files.
trait PassOutput {
    fn graphs(&self) -> Vec<(String, &Graph)>;
}

impl PassOutput for Graph {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        vec![(String::new(), self)]
    }
}

impl PassOutput for TrainStep {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        self.graph.graphs()
    }
}

impl PassOutput for autopar_passes::parallelize::Parallelized {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        self.graph.graphs()
    }
}

impl PassOutput for Vec<Graph> {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        self.iter()
            .enumerate()
            .map(|(rank, g)| (format!("rank{rank}"), g))
            .collect()
    }
}

impl PassOutput for CompiledPipeline {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        pipeline_graphs(&self.pipelines)
    }
}

/// Every sub-program of `pipelines`, labelled by pipeline, direction, stage and micro-batch.
fn pipeline_graphs(pipelines: &[PipelineProgram]) -> Vec<(String, &Graph)> {
    let mut out = Vec::new();
    for (which, p) in pipelines.iter().enumerate() {
        for (dir, programs) in [("forward", &p.forward), ("backward", &p.backward)] {
            for (vs, per_mb) in programs.iter().enumerate() {
                for (mb, sub) in per_mb.iter().enumerate() {
                    out.push((format!("pipeline{which}.{dir}.vs{vs}.mb{mb}"), &sub.graph));
                }
            }
        }
        for (i, seg) in p.optimizer.iter().enumerate() {
            out.push((
                format!("pipeline{which}.optimizer{i}.rank{}", seg.rank),
                &seg.program.graph,
            ));
        }
    }
    out
}

/// The execution plans of the rank programs: nothing to verify or dump as IR.
enum Plans {
    Spmd(Vec<ExecutionPlan>),
    Pipelined(Vec<PipelinePlans>),
}

impl PassOutput for Plans {
    fn graphs(&self) -> Vec<(String, &Graph)> {
        Vec::new()
    }
}

/// Runs passes with the verifier after each, and records their times and dumps.
struct PassLog<'o> {
    options: &'o CompileOptions,
    timings: Vec<PassTiming>,
    dumps: Vec<PassDump>,
}

impl<'o> PassLog<'o> {
    fn new(options: &'o CompileOptions) -> Self {
        PassLog {
            options,
            timings: Vec::new(),
            dumps: Vec::new(),
        }
    }

    fn run<T: PassOutput>(
        &mut self,
        pass: Pass,
        body: impl FnOnce() -> Result<T, Error>,
    ) -> Result<T, Error> {
        let start = Instant::now();
        let out = body()?;
        let wall = start.elapsed();
        let start = Instant::now();
        let graphs = out.graphs();
        for (label, g) in &graphs {
            autopar_ir::verify(g).map_err(|error| Error::Verifier {
                pass: pass.name(),
                graph: if label.is_empty() {
                    g.name().to_string()
                } else {
                    format!("{} {label}", g.name())
                },
                error,
            })?;
        }
        self.timings.push(PassTiming {
            pass,
            wall,
            verify: start.elapsed(),
            graphs: graphs.len(),
            nodes: graphs.iter().map(|(_, g)| g.num_nodes()).sum(),
        });
        if self.options.dump_after.contains(&pass) {
            let files = graphs
                .iter()
                .map(|(label, g)| {
                    let name = match label.is_empty() {
                        true => format!("{pass}.air"),
                        false => format!("{pass}.{label}.air"),
                    };
                    (name, autopar_ir::text::print(g))
                })
                .collect();
            self.dumps.push(PassDump { pass, files });
        }
        Ok(out)
    }

    fn finish(self, mut compiled: CompiledStep) -> Result<CompiledStep, Error> {
        compiled.timings = self.timings;
        compiled.dumps = self.dumps;
        Ok(compiled)
    }
}
