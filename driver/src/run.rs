//! Running a compiled step: [`run`] initialises every rank's share of the state, feeds each
//! step its part of the synthetic batch, runs the ranks' programs (SPMD or pipelined) and
//! carries each rank's next state to the next step; with [`RunOptions::verify`] the
//! single-device reference runs beside it and [`VerifyReport`] compares the two.
//!
//! SPMD programs run on any [`Backend`] started by any [`Launcher`] ([`run_on`]): each rank's
//! program is loaded once with its [`ExecutionPlan`] and executed step after step on state
//! held in the backend's buffers. Pipelines run on the CPU pipeline executor.
//!
//! The one tolerance policy of `--verify` is [`Tolerance::for_compute`]: it depends only on
//! the compute dtype, and a NaN or an infinity in either run is a failure.

use std::any::Any;
use std::collections::BTreeMap;

use autopar_passes::train::GRADS_FINITE;
use autopar_runtime::verify::{Comparison, Tolerance, VerifyReport};
use autopar_runtime::{
    self as rt, Backend, CpuBackend, ExecutionPlan, Launcher, PipelineStepReport, TensorMap,
    ThreadLauncher, root_cause,
};

use crate::Error;
use crate::compile::CompiledStep;
use crate::state::rank_inputs;

/// How to run a compiled step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// Seed of the state initialisation and of the synthetic data.
    pub seed: u64,
    /// Steps to run (at least one: zero is an error).
    pub steps: u64,
    /// Run the single-device reference beside the ranks and compare.
    pub verify: bool,
    /// Index of the first step: how many steps the state has already taken (a resumed run
    /// starts after its checkpoint's). It selects each step's data, so that a resumed run
    /// is fed what the uninterrupted one was.
    pub first_step: u64,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            seed: 0,
            steps: 1,
            verify: false,
            first_step: 0,
        }
    }
}

/// Where a run's state and data come from, and what it does with its state between steps.
/// The default draws the state from the seed, feeds [`rt::synthetic_batch`] and saves
/// nothing.
#[derive(Default)]
pub struct RunHooks<'a> {
    /// The state rank `rank` (of the whole mesh) starts from, instead of the one drawn from
    /// the seed ([`crate::StateLayout::init_rank`]): a checkpoint's, or loaded weights. With
    /// `verify`, the reference starts from these states too, gathered.
    pub initial_state: Option<&'a StateFn<'a>>,
    /// The global batch of step `i` (0-based, counting from the start of training), instead
    /// of the synthetic one.
    pub batch: Option<&'a BatchFn<'a>>,
    /// What to do with the state every so many steps.
    pub save: Option<SaveHook<'a>>,
}

/// A callback that receives every rank's state after every `every` steps and after the
/// last one.
pub struct SaveHook<'a> {
    /// Steps between saves (counted from the start of training, at least one).
    pub every: u64,
    /// Called with the number of steps the state has taken and every rank's state, in rank
    /// order.
    pub save: &'a mut SaveFn<'a>,
}

/// The initial state of a rank, by rank of the whole mesh.
pub type StateFn<'a> = dyn Fn(usize) -> Result<TensorMap, Error> + Sync + 'a;
/// The global batch of a step, by step index.
pub type BatchFn<'a> = dyn Fn(u64) -> Result<TensorMap, Error> + Sync + 'a;
/// A save callback: steps taken and every rank's state.
pub type SaveFn<'a> = dyn FnMut(u64, &[TensorMap]) -> Result<(), Error> + 'a;

/// What one step reported, as soon as it ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepEvent {
    /// 0-based step index.
    pub step: u64,
    /// The step's loss.
    pub loss: f64,
    /// With dynamic loss scaling: false when the gradients overflowed and the update was
    /// skipped.
    pub grads_finite: Option<bool>,
}

/// What a run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// The loss of every step.
    pub losses: Vec<f64>,
    /// Per rank of the whole mesh, in rank order.
    pub ranks: Vec<RankStats>,
    /// The largest peak of live tensor bytes of any rank in any step.
    pub peak_bytes: u64,
    /// The comparison with the single-device reference, when asked for.
    pub verify: Option<VerifyReport>,
    /// The last step's report of every pipeline (the executed timeline), for traces.
    pub pipeline_reports: Vec<PipelineStepReport>,
}

/// One rank's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankStats {
    /// Peak live bytes during the last step.
    pub peak_bytes: u64,
    /// Bytes of state the rank holds between steps.
    pub state_bytes: u64,
    /// Pipeline figures of the last step (pipelines only).
    pub pipeline: Option<PipelineRankStats>,
}

/// What a pipeline rank did in the last step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineRankStats {
    /// Peak bytes of forward activations held for backwards.
    pub peak_activation_bytes: u64,
    /// Largest number of micro-batch chunks whose backward had not run yet.
    pub max_in_flight: usize,
}

/// Runs `options.steps` steps of `step` on CPU ranks, one thread per rank of its mesh
/// ([`ThreadLauncher`], [`CpuBackend`]); `on_step` sees every step as it ends.
pub fn run(
    step: &CompiledStep,
    options: &RunOptions,
    on_step: impl FnMut(&StepEvent),
) -> Result<RunReport, Error> {
    run_with(step, options, RunHooks::default(), on_step)
}

/// Like [`run`], with the state and data from `hooks`, and the state handed to its save
/// callback as the run goes.
pub fn run_with(
    step: &CompiledStep,
    options: &RunOptions,
    hooks: RunHooks<'_>,
    on_step: impl FnMut(&StepEvent),
) -> Result<RunReport, Error> {
    run_on(
        step,
        &ThreadLauncher::default(),
        &CpuBackend::default(),
        options,
        hooks,
        on_step,
    )
}

/// Like [`run_with`], with the ranks started by `launcher` and their programs run by
/// `backend`. Pipelines run only on the CPU backend, whose interpreter the pipeline executor
/// drives.
pub fn run_on<L, B>(
    step: &CompiledStep,
    launcher: &L,
    backend: &B,
    options: &RunOptions,
    mut hooks: RunHooks<'_>,
    mut on_step: impl FnMut(&StepEvent),
) -> Result<RunReport, Error>
where
    L: Launcher + 'static,
    B: Backend + Sync + 'static,
    B::Buffer: Send + Sync,
    for<'g> B::Executable<'g>: Sync,
{
    if step.locals.is_empty() {
        return Err(Error::Usage(
            "the step was compiled without its rank programs (stop_after)".into(),
        ));
    }
    if options.steps == 0 {
        return Err(Error::Usage(
            "--steps 0 runs nothing (and would verify nothing)".into(),
        ));
    }
    if hooks.save.as_ref().is_some_and(|s| s.every == 0) {
        return Err(Error::Usage("a save every 0 steps never saves".into()));
    }
    // Every rank's state is drawn in this process: refuse before allocating any of it.
    crate::host::check_fits(step, crate::host::available_bytes())?;
    let n = step.mesh.num_devices();
    let g = &step.global;
    let initial: Vec<TensorMap> = (0..n)
        .map(|rank| match hooks.initial_state {
            Some(f) => f(rank),
            None => step.state.init_rank(rank, options.seed),
        })
        .collect::<Result<_, _>>()?;
    let mut reference = match options.verify {
        true => Some(Reference::new(
            step,
            options.seed,
            hooks.initial_state.map(|_| &initial[..]),
        )?),
        false => None,
    };
    let mut ranks = match &step.pipeline {
        None => Ranks::Spmd(SpmdRanks::load(step, backend, &initial)?),
        Some(_) => {
            let cpu = (backend as &dyn Any)
                .downcast_ref::<CpuBackend>()
                .ok_or_else(|| Error::Usage("pipelines run on the CPU backend only".into()))?;
            Ranks::Pipelined {
                states: initial,
                backend: *cpu,
            }
        }
    };
    let mut report = RunReport {
        losses: Vec::new(),
        ranks: Vec::new(),
        peak_bytes: 0,
        verify: None,
        pipeline_reports: Vec::new(),
    };
    let mut peaks = vec![0u64; n];
    let mut pipeline_stats = vec![None; n];
    let sharded = step.strategies.is_some();
    let last = options.first_step + options.steps;
    for i in options.first_step..last {
        let batch = match hooks.batch {
            Some(f) => f(i)?,
            None => rt::synthetic_batch(g, options.seed, i)?,
        };
        let inputs: Vec<TensorMap> = (0..step.locals.len())
            .map(|which| rank_inputs(g, sharded, &batch, &step.spmd_mesh, which))
            .collect::<Result<_, _>>()?;
        // The outputs of rank 0 that the run reports (the loss is replicated).
        let outputs = match &mut ranks {
            Ranks::Spmd(s) => s.step(step, launcher, backend, &inputs, &mut peaks)?,
            Ranks::Pipelined { states, backend } => {
                let batches: Vec<TensorMap> = (0..n)
                    .map(|rank| inputs[rt::split_pipeline_rank(&step.mesh, rank).1].clone())
                    .collect();
                let pipeline = step
                    .pipeline
                    .as_ref()
                    .ok_or_else(|| Error::Usage("the step has no pipeline to run".into()))?;
                if pipeline.plans.len() != pipeline.pipelines.len() {
                    return Err(Error::Usage(
                        "the pipeline was compiled without its execution plans (stop_after)".into(),
                    ));
                }
                let reports = rt::run_pipeline_step_planned(
                    &pipeline.pipelines,
                    &pipeline.plans,
                    &step.mesh,
                    states,
                    &batches,
                    backend.options,
                    launcher_options(launcher)?,
                )?;
                let outputs =
                    pipeline_step(step, &reports, states, &mut peaks, &mut pipeline_stats)?;
                report.pipeline_reports = reports;
                outputs
            }
        };
        let scalar = |name: &str| outputs.get(name).and_then(|t| t.scalar_value());
        let loss = scalar("loss")
            .ok_or_else(|| Error::Usage("the step has no scalar output `loss`".into()))?;
        on_step(&StepEvent {
            step: i,
            loss,
            grads_finite: scalar(GRADS_FINITE).map(|v| v != 0.0),
        });
        report.losses.push(loss);
        if let Some(r) = reference.as_mut() {
            r.step(&batch, loss)?;
        }
        report.peak_bytes = report
            .peak_bytes
            .max(peaks.iter().copied().max().unwrap_or(0));
        let done = i + 1;
        if let Some(save) = hooks.save.as_mut()
            && (done.is_multiple_of(save.every) || done == last)
        {
            let states = match &ranks {
                Ranks::Spmd(s) => s.download(backend)?,
                Ranks::Pipelined { states, .. } => states.clone(),
            };
            (save.save)(done, &states)?;
        }
    }
    let states = match ranks {
        Ranks::Spmd(s) => s.download(backend)?,
        Ranks::Pipelined { states, .. } => states,
    };
    report.ranks = (0..n)
        .map(|rank| RankStats {
            peak_bytes: peaks[rank],
            state_bytes: step.state.rank_bytes(rank),
            pipeline: pipeline_stats[rank].clone(),
        })
        .collect();
    if let Some(r) = reference {
        report.verify = Some(r.finish(step, &states)?);
    }
    Ok(report)
}

/// The communicator options the pipeline executor starts its threads with: those of the
/// [`ThreadLauncher`] it must be given (it starts its ranks as threads itself).
fn launcher_options<L: Launcher + 'static>(launcher: &L) -> Result<rt::CommOptions, Error> {
    (launcher as &dyn Any)
        .downcast_ref::<ThreadLauncher>()
        .map(|t| t.options)
        .ok_or_else(|| Error::Usage("pipelines run on the thread launcher only".into()))
}

/// The ranks' state between steps.
enum Ranks<'s, B: Backend> {
    /// SPMD: every rank's program loaded on the backend, its state in the backend's buffers.
    Spmd(SpmdRanks<'s, B>),
    /// A pipeline: every rank's state as host tensors, for the CPU pipeline executor.
    Pipelined {
        /// Per rank of the whole mesh.
        states: Vec<TensorMap>,
        /// The backend, whose options the executor runs with.
        backend: CpuBackend,
    },
}

/// The SPMD ranks of a run: their loaded programs and their state.
struct SpmdRanks<'s, B: Backend> {
    executables: Vec<B::Executable<'s>>,
    states: Vec<BTreeMap<String, B::Buffer>>,
}

impl<'s, B> SpmdRanks<'s, B>
where
    B: Backend + Sync,
    B::Buffer: Send + Sync,
    for<'g> B::Executable<'g>: Sync,
{
    /// Loads every rank's program with its execution plan and uploads its state.
    fn load(step: &'s CompiledStep, backend: &B, initial: &[TensorMap]) -> Result<Self, Error> {
        let executables = step
            .locals
            .iter()
            .enumerate()
            .map(|(rank, g)| {
                let plan = match step.plans.get(rank) {
                    Some(p) => p.clone(),
                    None => ExecutionPlan::new(g)?,
                };
                backend.load(g, plan)
            })
            .collect::<Result<_, _>>()?;
        let states = initial
            .iter()
            .map(|state| upload(backend, state))
            .collect::<Result<_, _>>()?;
        Ok(SpmdRanks {
            executables,
            states,
        })
    }

    /// Runs one step on `inputs` (per rank), carries every rank's next state, records the
    /// ranks' peaks, and returns rank 0's reported outputs (loss and metrics).
    fn step<L: Launcher>(
        &mut self,
        step: &CompiledStep,
        launcher: &L,
        backend: &B,
        inputs: &[TensorMap],
        peaks: &mut [u64],
    ) -> Result<TensorMap, Error> {
        let inputs: Vec<BTreeMap<String, B::Buffer>> = inputs
            .iter()
            .map(|i| upload(backend, i))
            .collect::<Result<_, _>>()?;
        let (executables, states) = (&self.executables, &self.states);
        let results = launcher.launch(&step.spmd_mesh, |comm| {
            let rank = comm.rank();
            match (executables.get(rank), states.get(rank), inputs.get(rank)) {
                (Some(exe), Some(state), Some(inputs)) => backend.execute(exe, state, inputs, comm),
                _ => Err(rt::RuntimeError::SpmdSetup {
                    detail: format!("rank {rank} has no program"),
                }),
            }
        })?;
        let mut reported = TensorMap::new();
        for (rank, out) in root_cause(results)? {
            if let Some(peak) = peaks.get_mut(rank) {
                *peak = out.peak_bytes;
            }
            let mut outputs = out.outputs;
            let state = self.states.get_mut(rank).ok_or_else(|| {
                Error::Usage(format!("rank {rank} is not a rank of `{}`", step.spmd_mesh))
            })?;
            carry_state(step, rank, state, |name| outputs.remove(name))?;
            if rank == 0 {
                for name in ["loss", GRADS_FINITE] {
                    if let Some(b) = outputs.get(name) {
                        reported.insert(name.to_string(), backend.download(b)?);
                    }
                }
            }
        }
        Ok(reported)
    }

    /// Every rank's state, read back from the backend.
    fn download(&self, backend: &B) -> Result<Vec<TensorMap>, Error> {
        self.states
            .iter()
            .map(|s| {
                s.iter()
                    .map(|(name, b)| Ok((name.clone(), backend.download(b)?)))
                    .collect()
            })
            .collect()
    }
}

fn upload<B: Backend>(
    backend: &B,
    tensors: &TensorMap,
) -> Result<BTreeMap<String, B::Buffer>, Error> {
    tensors
        .iter()
        .map(|(name, t)| Ok((name.clone(), backend.upload(t)?)))
        .collect()
}

/// Replaces each tensor `rank` holds in `state` by its next value, `next(name)`; a tensor
/// the step does not update (no output of that name) stays as it is, and one it updates but
/// whose next value the rank did not produce is an error.
fn carry_state<T>(
    step: &CompiledStep,
    rank: usize,
    state: &mut BTreeMap<String, T>,
    mut next: impl FnMut(&str) -> Option<T>,
) -> Result<(), Error> {
    for (name, slot) in state.iter_mut() {
        match next(name) {
            Some(t) => *slot = t,
            None if step.global.output(name).is_none() => {}
            None => {
                return Err(Error::Usage(format!(
                    "rank {rank} did not end the step with the next value of `{name}`"
                )));
            }
        }
    }
    Ok(())
}

/// Takes the result of a pipelined step: every rank's next state into `states`, its peaks
/// and pipeline figures, and returns the step's outputs (loss and metrics).
fn pipeline_step(
    step: &CompiledStep,
    reports: &[PipelineStepReport],
    states: &mut [TensorMap],
    peaks: &mut [u64],
    stats: &mut [Option<PipelineRankStats>],
) -> Result<TensorMap, Error> {
    for (rank, state) in states.iter_mut().enumerate() {
        let (pp_rank, which) = rt::split_pipeline_rank(&step.mesh, rank);
        let r = reports
            .get(which)
            .and_then(|p| p.ranks.get(pp_rank))
            .ok_or_else(|| Error::Usage(format!("rank {rank} has no pipeline report")))?;
        peaks[rank] = r.peak_bytes;
        stats[rank] = Some(PipelineRankStats {
            peak_activation_bytes: r.peak_activation_bytes,
            max_in_flight: r.max_in_flight,
        });
        carry_state(step, rank, state, |name| r.state.get(name).cloned())?;
    }
    Ok(reports
        .first()
        .map(|r| r.outputs.clone())
        .unwrap_or_default())
}

/// The single-device reference, advanced step by step beside the ranks, and the running
/// comparison with them.
struct Reference<'a> {
    graph: &'a autopar_ir::Graph,
    state: TensorMap,
    comparison: Comparison,
}

impl<'a> Reference<'a> {
    /// The reference of `step`, starting from the state drawn from `seed`, or from the
    /// ranks' `initial` states gathered.
    fn new(
        step: &'a CompiledStep,
        seed: u64,
        initial: Option<&[TensorMap]>,
    ) -> Result<Self, Error> {
        let graph = step.reference.as_ref().ok_or_else(|| {
            Error::Usage(
                "--verify: the step was laid out for its mesh and compiled without the original \
                 step to compare with (CompileOptions::reference)"
                    .into(),
            )
        })?;
        let mut state = rt::init_parameters(graph, seed)?;
        if let Some(ranks) = initial {
            for (name, slot) in state.iter_mut() {
                *slot = step.state.gather(name, ranks)?;
            }
        }
        Ok(Reference {
            graph,
            state,
            comparison: Comparison::new(Tolerance::for_compute(step.compute_dtype)),
        })
    }

    /// Runs the reference step on its state (advanced in place) and compares its loss with
    /// the ranks' `loss`.
    fn step(&mut self, batch: &TensorMap, loss: f64) -> Result<(), Error> {
        let out = rt::run(self.graph, &self.state, batch, rt::RunOptions::default())?;
        self.comparison.loss(loss, out.scalar("loss")?);
        for (name, t) in out.outputs {
            if let Some(slot) = self.state.get_mut(&name) {
                *slot = t;
            }
        }
        Ok(())
    }

    /// Compares every state tensor, gathered from the ranks' `states`, with the reference's.
    fn finish(mut self, step: &CompiledStep, states: &[TensorMap]) -> Result<VerifyReport, Error> {
        for t in &step.state.tensors {
            let Some(want) = self.state.get(&t.name) else {
                continue;
            };
            let got = step.state.gather(&t.name, states)?;
            self.comparison.tensor(&t.name, &got, want)?;
        }
        Ok(self.comparison.finish())
    }
}
