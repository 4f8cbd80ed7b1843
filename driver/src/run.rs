//! Running a compiled step: [`run`] initialises every rank's share of the state, feeds each
//! step its part of the synthetic batch, runs the ranks' programs (SPMD or pipelined) and
//! carries each rank's next state to the next step; with [`RunOptions::verify`] the
//! single-device reference runs beside it and [`VerifyReport`] compares the two.
//!
//! SPMD programs run on any [`Backend`] started by any [`Launcher`] ([`run_on`]): each rank's
//! program is loaded once with its [`ExecutionPlan`] and executed step after step on state
//! held in the backend's buffers. Pipelines run through the pipeline executor on the same
//! backend.
//!
//! The one tolerance policy of `--verify` is [`Tolerance`]'s: [`Tolerance::for_compute`] for
//! the compute dtype, widened by a measured noise floor ([`Tolerance::with_noise_floor`])
//! when the backend under test accumulates f32 contractions in f32 ([`RunOptions::accumulation`]):
//! a second reference, accumulating so, runs beside the first. A NaN or an infinity in either
//! run is a failure.

use std::collections::BTreeMap;

use autopar_ir::DType;
use autopar_passes::train::GRADS_FINITE;
use autopar_runtime::verify::{Comparison, Tolerance, VerifyReport};
use autopar_runtime::{
    self as rt, Accumulation, Backend, CpuBackend, ExecutionPlan, Launcher, PipelineStepReport,
    TensorMap, ThreadLauncher, root_cause,
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
    /// How the backend under test accumulates the dot products of f32 contractions (einsums,
    /// attention). With [`Accumulation::F32`], `verify` of an f32 step also advances a
    /// reference that accumulates so, and holds the run to the tolerance its noise allows
    /// ([`Tolerance::with_noise_floor`]). [`run_on`] cannot tell what a backend does, so its
    /// caller says; [`crate::run_launched`] sets it for the backend it starts.
    pub accumulation: Accumulation,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            seed: 0,
            steps: 1,
            verify: false,
            first_step: 0,
            accumulation: Accumulation::Wide,
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
    /// The largest static arena the backend laid a rank's program out in (SPMD runs on a
    /// backend with an arena), to compare `peak_bytes` with.
    pub arena_bytes: Option<u64>,
    /// The comparison with the single-device reference, when asked for.
    pub verify: Option<VerifyReport>,
    /// The last step's report of every pipeline (the executed timeline), for traces; empty
    /// when the ranks ran in several processes.
    pub pipeline_reports: Vec<PipelineStepReport>,
    /// Whether this process ran rank 0 and so holds the run's figures: always with threads,
    /// on one process of an MPI job (the others report nothing: no losses, no ranks).
    pub primary: bool,
}

/// One rank's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankStats {
    /// Peak live bytes during the last step.
    pub peak_bytes: u64,
    /// The backend's static arena for the rank's program (SPMD runs on a backend with one).
    pub arena_bytes: Option<u64>,
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

/// Like [`run_with`], with the ranks started by `launcher` and their programs (SPMD rank
/// programs, or a pipeline's sub-programs) run by `backend`.
///
/// This process loads and runs only the ranks the launcher runs here
/// ([`Launcher::local_ranks`]): all of them for threads, one for an MPI process. The run's
/// figures (losses, `on_step`, the save hook, `verify`) are rank 0's business: a process
/// without rank 0 runs its rank and reports nothing ([`RunReport::primary`] is false), and
/// what rank 0 needs from the other processes (their state for a save or `verify`, their
/// peaks) is gathered to it through the ranks' collectives.
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
    let local = launcher.local_ranks(&step.mesh)?;
    let primary = local.first() == Some(&0);
    let all_here = local.len() == n;
    let init = |rank: usize| match hooks.initial_state {
        Some(f) => f(rank),
        None => step.state.init_rank(rank, options.seed),
    };
    let initial: BTreeMap<usize, TensorMap> = local
        .iter()
        .map(|&rank| Ok((rank, init(rank)?)))
        .collect::<Result<_, Error>>()?;
    let mut reference = match options.verify && primary {
        true => {
            let given = match hooks.initial_state {
                Some(_) if all_here => Some(initial.values().cloned().collect::<Vec<_>>()),
                Some(_) => Some((0..n).map(init).collect::<Result<Vec<_>, _>>()?),
                None => None,
            };
            let noise =
                options.accumulation == Accumulation::F32 && step.compute_dtype == DType::F32;
            Some(Reference::new(step, options.seed, given.as_deref(), noise)?)
        }
        false => None,
    };
    let mut ranks = match &step.pipeline {
        None => Ranks::Spmd(SpmdRanks::load(step, backend, initial)?),
        Some(p) => {
            if p.plans.len() != p.pipelines.len() {
                return Err(Error::Usage(
                    "the pipeline was compiled without its execution plans (stop_after)".into(),
                ));
            }
            Ranks::Pipelined { states: initial }
        }
    };
    let mut report = RunReport {
        losses: Vec::new(),
        ranks: Vec::new(),
        peak_bytes: 0,
        arena_bytes: None,
        verify: None,
        pipeline_reports: Vec::new(),
        primary,
    };
    // Per local rank: its peak in the last step, and in any step.
    let mut peaks: BTreeMap<usize, (u64, u64)> = local.iter().map(|&r| (r, (0, 0))).collect();
    let mut pipeline_stats: BTreeMap<usize, PipelineRankStats> = BTreeMap::new();
    let sharded = step.strategies.is_some();
    let fault = fault_injection()?;
    let last = options.first_step + options.steps;
    for i in options.first_step..last {
        if let Some((rank, at)) = fault
            && at == i + 1
            && local == [rank]
            && n > 1
        {
            eprintln!("rank {rank}: exiting at the start of step {at} (AUTOPAR_FAULT_EXIT)");
            std::process::exit(1);
        }
        let batch = match hooks.batch {
            Some(f) => f(i)?,
            None => rt::synthetic_batch(g, options.seed, i)?,
        };
        let which_of = |rank: usize| match &step.pipeline {
            Some(_) => rt::split_pipeline_rank(&step.mesh, rank).1,
            None => rank,
        };
        let mut inputs: BTreeMap<usize, TensorMap> = BTreeMap::new();
        for &rank in &local {
            let which = which_of(rank);
            if let std::collections::btree_map::Entry::Vacant(slot) = inputs.entry(which) {
                slot.insert(rank_inputs(g, sharded, &batch, &step.spmd_mesh, which)?);
            }
        }
        // The outputs of rank 0 that the run reports (the loss is replicated, or brought to
        // rank 0 from its pipeline's last stage).
        let outputs = match &mut ranks {
            Ranks::Spmd(s) => s.step(step, launcher, backend, &inputs, &mut peaks)?,
            Ranks::Pipelined { states } => {
                let reports = pipeline_step(step, launcher, backend, states, &inputs)?;
                let mut outputs = TensorMap::new();
                for (&rank, r) in &reports {
                    if let Some(p) = peaks.get_mut(&rank) {
                        *p = (r.report.peak_bytes, p.1.max(r.report.peak_bytes));
                    }
                    pipeline_stats.insert(
                        rank,
                        PipelineRankStats {
                            peak_activation_bytes: r.report.peak_activation_bytes,
                            max_in_flight: r.report.max_in_flight,
                        },
                    );
                    if rank == 0 {
                        outputs = r.outputs.clone();
                    }
                }
                if all_here {
                    report.pipeline_reports = pipeline_reports(step, reports)?;
                }
                outputs
            }
        };
        let done = i + 1;
        if primary {
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
        }
        if let Some(save) = hooks.save.as_mut()
            && (done.is_multiple_of(save.every) || done == last)
        {
            let states = ranks.states(backend)?;
            let stats = rank_figures(&peaks, &pipeline_stats, &ranks.arenas());
            if let Some(all) = gather_to_primary(step, launcher, &states, &stats, true)? {
                (save.save)(done, &all.states)?;
            }
        }
    }
    let states = ranks.states(backend)?;
    let stats = rank_figures(&peaks, &pipeline_stats, &ranks.arenas());
    let gathered = gather_to_primary(step, launcher, &states, &stats, options.verify)?;
    let Some(gathered) = gathered else {
        return Ok(report);
    };
    report.peak_bytes = gathered.figures.iter().map(|f| f[1]).max().unwrap_or(0);
    report.arena_bytes = gathered
        .figures
        .iter()
        .map(|f| f[4])
        .max()
        .filter(|&a| a > 0);
    report.ranks = gathered
        .figures
        .iter()
        .enumerate()
        .map(|(rank, f)| RankStats {
            peak_bytes: f[0],
            arena_bytes: (f[4] > 0).then_some(f[4]),
            state_bytes: step.state.rank_bytes(rank),
            pipeline: step.pipeline.as_ref().map(|_| PipelineRankStats {
                peak_activation_bytes: f[2],
                max_in_flight: f[3] as usize,
            }),
        })
        .collect();
    if let Some(r) = reference {
        let mut states = gathered.states;
        perturbation()?
            .map(|(name, rel)| perturb(&mut states, &name, rel))
            .transpose()?;
        report.verify = Some(r.finish(step, &states)?);
    }
    Ok(report)
}

/// Every local rank's figures as [`Gathered::figures`] holds them.
fn rank_figures(
    peaks: &BTreeMap<usize, (u64, u64)>,
    pipeline: &BTreeMap<usize, PipelineRankStats>,
    arenas: &BTreeMap<usize, u64>,
) -> BTreeMap<usize, [u64; FIGURES]> {
    peaks
        .iter()
        .map(|(&rank, &(last, largest))| {
            let p = pipeline.get(&rank);
            let act = p.map_or(0, |p| p.peak_activation_bytes);
            let in_flight = p.map_or(0, |p| p.max_in_flight as u64);
            let arena = arenas.get(&rank).copied().unwrap_or(0);
            (rank, [last, largest, act, in_flight, arena])
        })
        .collect()
}

/// How many figures each rank reports ([`Gathered::figures`]).
const FIGURES: usize = 5;

/// The test-only fault hook: `AUTOPAR_FAULT_EXIT=RANK:STEP` makes rank `RANK` exit with
/// status 1 at the start of step `STEP` (counted from 1, as the steps are printed), when it
/// is the only rank of its process (an MPI rank), to check that the others report the dead
/// rank and the job ends within the collective timeout. Unset, nothing happens.
fn fault_injection() -> Result<Option<(usize, u64)>, Error> {
    let Ok(v) = std::env::var("AUTOPAR_FAULT_EXIT") else {
        return Ok(None);
    };
    let parsed = v
        .split_once(':')
        .and_then(|(r, s)| Some((r.trim().parse().ok()?, s.trim().parse().ok()?)));
    parsed.map(Some).ok_or_else(|| {
        Error::Usage(format!(
            "AUTOPAR_FAULT_EXIT=`{v}`: expected RANK:STEP, e.g. 3:2"
        ))
    })
}

/// The test-only defect hook: `AUTOPAR_FAULT_PERTURB=TENSOR:REL` scales the parallel run's
/// final `TENSOR`, on every rank that holds it, by `1 + REL` before `--verify` compares it,
/// to check that a defect of that size fails the comparison. Unset, nothing happens.
fn perturbation() -> Result<Option<(String, f64)>, Error> {
    let Ok(v) = std::env::var("AUTOPAR_FAULT_PERTURB") else {
        return Ok(None);
    };
    let parsed = v
        .rsplit_once(':')
        .and_then(|(name, rel)| Some((name.trim().to_string(), rel.trim().parse().ok()?)));
    parsed.map(Some).ok_or_else(|| {
        Error::Usage(format!(
            "AUTOPAR_FAULT_PERTURB=`{v}`: expected TENSOR:REL, e.g. wte:1e-3"
        ))
    })
}

/// Scales tensor `name` of every rank's state that holds it by `1 + rel`.
fn perturb(states: &mut [TensorMap], name: &str, rel: f64) -> Result<(), Error> {
    let mut found = false;
    for t in states.iter_mut().filter_map(|s| s.get_mut(name)) {
        let scaled = t.to_f64_vec().iter().map(|x| x * (1.0 + rel)).collect();
        *t = rt::Tensor::from_f64(t.ty().clone(), scaled)?;
        found = true;
    }
    match found {
        true => Ok(()),
        false => Err(Error::Usage(format!(
            "AUTOPAR_FAULT_PERTURB: no rank holds a state tensor `{name}`"
        ))),
    }
}

/// The ranks' state between steps, for the ranks this process runs.
enum Ranks<'s, B: Backend> {
    /// SPMD: every local rank's program loaded on the backend, its state in the backend's
    /// buffers.
    Spmd(SpmdRanks<'s, B>),
    /// A pipeline: every local rank's state as host tensors, for the pipeline executor.
    Pipelined {
        /// By rank of the whole mesh.
        states: BTreeMap<usize, TensorMap>,
    },
}

impl<B> Ranks<'_, B>
where
    B: Backend + Sync,
    B::Buffer: Send + Sync,
    for<'g> B::Executable<'g>: Sync,
{
    /// Every local rank's state as host tensors.
    fn states(&self, backend: &B) -> Result<BTreeMap<usize, TensorMap>, Error> {
        match self {
            Ranks::Spmd(s) => s.download(backend),
            Ranks::Pipelined { states, .. } => Ok(states.clone()),
        }
    }

    /// Every local rank's arena (SPMD ranks on a backend with one; none for pipelines).
    fn arenas(&self) -> BTreeMap<usize, u64> {
        match self {
            Ranks::Spmd(s) => s.arenas.clone(),
            Ranks::Pipelined { .. } => BTreeMap::new(),
        }
    }
}

/// The SPMD ranks this process runs: their loaded programs and their state.
struct SpmdRanks<'s, B: Backend> {
    executables: BTreeMap<usize, B::Executable<'s>>,
    states: BTreeMap<usize, BTreeMap<String, B::Buffer>>,
    /// Each local rank's arena, as its last step reported it.
    arenas: BTreeMap<usize, u64>,
}

impl<'s, B> SpmdRanks<'s, B>
where
    B: Backend + Sync,
    B::Buffer: Send + Sync,
    for<'g> B::Executable<'g>: Sync,
{
    /// Loads the program of every rank of `initial` with its execution plan and uploads
    /// its state.
    fn load(
        step: &'s CompiledStep,
        backend: &B,
        initial: BTreeMap<usize, TensorMap>,
    ) -> Result<Self, Error> {
        let mut executables = BTreeMap::new();
        let mut states = BTreeMap::new();
        for (rank, state) in initial {
            let g = step.locals.get(rank).ok_or_else(|| {
                Error::Usage(format!("rank {rank} is not a rank of `{}`", step.spmd_mesh))
            })?;
            let plan = match step.plans.get(rank) {
                Some(p) => p.clone(),
                None => ExecutionPlan::new(g)?,
            };
            executables.insert(rank, backend.load(g, plan)?);
            states.insert(rank, upload(backend, &state)?);
        }
        Ok(SpmdRanks {
            executables,
            states,
            arenas: BTreeMap::new(),
        })
    }

    /// Runs one step on `inputs` (by rank), carries every local rank's next state, records
    /// their peaks, and returns rank 0's reported outputs (loss and metrics) if it is local.
    fn step<L: Launcher>(
        &mut self,
        step: &CompiledStep,
        launcher: &L,
        backend: &B,
        inputs: &BTreeMap<usize, TensorMap>,
        peaks: &mut BTreeMap<usize, (u64, u64)>,
    ) -> Result<TensorMap, Error> {
        let inputs: BTreeMap<usize, BTreeMap<String, B::Buffer>> = inputs
            .iter()
            .map(|(&rank, i)| Ok((rank, upload(backend, i)?)))
            .collect::<Result<_, Error>>()?;
        let (executables, states) = (&self.executables, &self.states);
        let results = launcher.launch(&step.spmd_mesh, |comm| {
            let rank = comm.rank();
            match (executables.get(&rank), states.get(&rank), inputs.get(&rank)) {
                (Some(exe), Some(state), Some(inputs)) => backend.execute(exe, state, inputs, comm),
                _ => Err(rt::RuntimeError::SpmdSetup {
                    detail: format!("rank {rank} has no program in this process"),
                }),
            }
        })?;
        let mut reported = TensorMap::new();
        for (rank, out) in root_cause(results)? {
            if let Some(peak) = peaks.get_mut(&rank) {
                *peak = (out.peak_bytes, peak.1.max(out.peak_bytes));
            }
            if let Some(arena) = out.arena_bytes {
                self.arenas.insert(rank, arena);
            }
            let mut outputs = out.outputs;
            let state = self.states.get_mut(&rank).ok_or_else(|| {
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

    /// Every local rank's state, read back from the backend.
    fn download(&self, backend: &B) -> Result<BTreeMap<usize, TensorMap>, Error> {
        self.states
            .iter()
            .map(|(&rank, s)| {
                let state = s
                    .iter()
                    .map(|(name, b)| Ok((name.clone(), backend.download(b)?)))
                    .collect::<Result<TensorMap, Error>>()?;
                Ok((rank, state))
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

/// Runs one pipelined step on the local ranks (`states`, by rank of the whole mesh; `inputs`
/// by coordinate off `pp`), each through [`rt::run_pipeline_rank`] on the rank the launcher
/// started; carries their next states and returns what each produced. The step's reported
/// outputs (loss and metrics) are broadcast over `pp` from the stage that holds them, so that
/// every stage, rank 0 included, returns them.
fn pipeline_step<L: Launcher, B: Backend + Sync>(
    step: &CompiledStep,
    launcher: &L,
    backend: &B,
    states: &mut BTreeMap<usize, TensorMap>,
    inputs: &BTreeMap<usize, TensorMap>,
) -> Result<BTreeMap<usize, rt::PipelineRankStep>, Error> {
    let pipeline = step
        .pipeline
        .as_ref()
        .ok_or_else(|| Error::Usage("the step has no pipeline to run".into()))?;
    let held = &*states;
    let results = launcher.launch(&step.mesh, |comm| {
        let rank = comm.rank();
        let (pp_rank, which) = rt::split_pipeline_rank(&step.mesh, rank);
        let (Some(program), Some(plans), Some(state), Some(batch)) = (
            pipeline.pipelines.get(which),
            pipeline.plans.get(which),
            held.get(&rank),
            inputs.get(&which),
        ) else {
            return Err(rt::RuntimeError::SpmdSetup {
                detail: format!("rank {rank} has no pipeline, plans, state or batch here"),
            });
        };
        let mut out = rt::run_pipeline_rank(program, plans, pp_rank, comm, backend, state, batch)?;
        for name in ["loss", GRADS_FINITE] {
            let Some(&(_, _, holder)) = program.outputs.iter().find(|(o, _, _)| o == name) else {
                continue;
            };
            // A metric has the same (scalar) type in the global step as in every rank's.
            let Some(v) = step.global.output(name) else {
                continue;
            };
            let ty = step.global.value_checked(v).map(|v| v.ty.clone());
            let ty = ty.map_err(rt::RuntimeError::from)?;
            let mine = out
                .outputs
                .get(name)
                .cloned()
                .unwrap_or_else(|| rt::Tensor::zeros(ty));
            let got = comm.broadcast(&mine, &[rt::pipeline::PP_AXIS.to_string()], holder)?;
            out.outputs.insert(name.to_string(), got);
        }
        Ok(out)
    })?;
    let mut steps = BTreeMap::new();
    for (rank, out) in root_cause(results)? {
        let state = states
            .get_mut(&rank)
            .ok_or_else(|| Error::Usage(format!("rank {rank} has no state in this process")))?;
        carry_state(step, rank, state, |name| {
            out.report.state.get(name).cloned()
        })?;
        steps.insert(rank, out);
    }
    Ok(steps)
}

/// The per-pipeline reports of a step whose ranks all ran in this process (the executed
/// timeline, for traces).
fn pipeline_reports(
    step: &CompiledStep,
    mut steps: BTreeMap<usize, rt::PipelineRankStep>,
) -> Result<Vec<PipelineStepReport>, Error> {
    let pipeline = step
        .pipeline
        .as_ref()
        .ok_or_else(|| Error::Usage("the step has no pipeline".into()))?;
    let mut reports: Vec<PipelineStepReport> = pipeline
        .pipelines
        .iter()
        .map(|_| PipelineStepReport {
            outputs: TensorMap::new(),
            ranks: Vec::new(),
        })
        .collect();
    // Rank order walks each pipeline's stages in order.
    let mut by_pipeline: Vec<Vec<(usize, rt::PipelineRankStep)>> =
        reports.iter().map(|_| Vec::new()).collect();
    for rank in 0..step.mesh.num_devices() {
        let (pp_rank, which) = rt::split_pipeline_rank(&step.mesh, rank);
        let s = steps
            .remove(&rank)
            .ok_or_else(|| Error::Usage(format!("rank {rank} has no pipeline report")))?;
        by_pipeline[which].push((pp_rank, s));
    }
    for (report, mut ranks) in reports.iter_mut().zip(by_pipeline) {
        ranks.sort_by_key(|(pp_rank, _)| *pp_rank);
        for (_, s) in ranks {
            report.outputs.extend(s.outputs);
            report.ranks.push(s.report);
        }
    }
    Ok(reports)
}

/// What rank 0 learns from every rank at the end of a run (or for a save).
struct Gathered {
    /// Every rank's state, in rank order (empty unless asked for).
    states: Vec<TensorMap>,
    /// Every rank's figures, in rank order: peak bytes in the last step and in any step,
    /// (pipelines) peak activation bytes and micro-batch chunks in flight, and the backend's
    /// arena (0 when it has none).
    figures: Vec<[u64; FIGURES]>,
}

/// Brings the local ranks' `states` (when `with_states`) and `figures` of every rank to the
/// process that runs rank 0: directly when every rank runs in this process, otherwise by an
/// all-gather over the whole mesh. `None` on the other processes.
fn gather_to_primary<L: Launcher>(
    step: &CompiledStep,
    launcher: &L,
    states: &BTreeMap<usize, TensorMap>,
    figures: &BTreeMap<usize, [u64; FIGURES]>,
    with_states: bool,
) -> Result<Option<Gathered>, Error> {
    let n = step.mesh.num_devices();
    if states.len() == n && figures.len() == n {
        return Ok(Some(Gathered {
            states: if with_states {
                states.values().cloned().collect()
            } else {
                Vec::new()
            },
            figures: figures.values().copied().collect(),
        }));
    }
    // One row per rank: its figures, then its state's elements in layout order.
    let row_len = |rank: usize| {
        FIGURES
            + if with_states {
                held_types(step, rank)
                    .iter()
                    .map(|(_, ty)| ty.num_elements() as usize)
                    .sum::<usize>()
            } else {
                0
            }
    };
    let width = (0..n).map(row_len).max().unwrap_or(FIGURES);
    let axes: Vec<String> = step.mesh.axes().iter().map(|a| a.name.clone()).collect();
    let results = launcher.launch(&step.mesh, |comm| {
        let rank = comm.rank();
        let mut row: Vec<f64> = figures
            .get(&rank)
            .map_or([0; FIGURES], |f| *f)
            .iter()
            .map(|&x| x as f64)
            .collect();
        if with_states {
            let state = states
                .get(&rank)
                .ok_or_else(|| rt::RuntimeError::SpmdSetup {
                    detail: format!("rank {rank} has no state in this process"),
                })?;
            for (name, _) in held_types(step, rank) {
                let t = state
                    .get(&name)
                    .ok_or_else(|| rt::RuntimeError::MissingShard {
                        rank,
                        name: name.clone(),
                    })?;
                row.extend(t.to_f64_vec());
            }
        }
        row.resize(width, 0.0);
        // The elements travel untouched: an all-gather rounds nothing.
        let x = rt::Tensor::from_f64(autopar_ir::TensorType::new(DType::F32, [1, width]), row)?;
        comm.all_gather(&x, &axes, 0)
    })?;
    let Some((_, all)) = root_cause(results)?.into_iter().find(|(r, _)| *r == 0) else {
        return Ok(None);
    };
    let values = all.to_f64_vec();
    let mut gathered = Gathered {
        states: Vec::new(),
        figures: Vec::new(),
    };
    for rank in 0..n {
        let row = &values[rank * width..(rank + 1) * width];
        gathered
            .figures
            .push([0, 1, 2, 3, 4].map(|i| row[i] as u64));
        if !with_states {
            continue;
        }
        let mut at = FIGURES;
        let mut state = TensorMap::new();
        for (name, ty) in held_types(step, rank) {
            let len = ty.num_elements() as usize;
            let elems = &row[at..at + len];
            at += len;
            let t = match ty.dtype {
                d if d.is_float() => rt::Tensor::from_f64(ty, elems.to_vec())?,
                DType::Bool => rt::Tensor::new(
                    ty,
                    rt::Data::Bool(elems.iter().map(|&x| x != 0.0).collect()),
                )?,
                _ => rt::Tensor::from_i64(ty, elems.iter().map(|&x| x as i64).collect())?,
            };
            state.insert(name, t);
        }
        gathered.states.push(state);
    }
    Ok(Some(gathered))
}

/// The state tensors `rank` holds and their local types, in the layout's order.
fn held_types(step: &CompiledStep, rank: usize) -> Vec<(String, autopar_ir::TensorType)> {
    step.state
        .tensors
        .iter()
        .filter_map(|t| {
            let shard = t.shards.iter().find(|s| s.ranks.contains(&rank))?;
            let dims: Vec<usize> = shard.region.iter().map(|r| r.len()).collect();
            Some((
                t.name.clone(),
                autopar_ir::TensorType::new(t.ty.dtype, dims),
            ))
        })
        .collect()
}

/// The single-device reference, advanced step by step beside the ranks, and the running
/// comparison with them; with f32 accumulation under test, also the f32-accumulating
/// reference that measures the noise floor.
struct Reference<'a> {
    graph: &'a autopar_ir::Graph,
    state: TensorMap,
    comparison: Comparison,
    noise: Option<NoiseFloor>,
}

/// A reference whose contractions accumulate in f32 ([`Accumulation::F32`]), advanced on the
/// same state and batches as the wide one, and its comparison with it: what a correct run
/// with f32 accumulation differs by on this trajectory.
struct NoiseFloor {
    state: TensorMap,
    comparison: Comparison,
}

impl<'a> Reference<'a> {
    /// The reference of `step`, starting from the state drawn from `seed`, or from the
    /// ranks' `initial` states gathered; with `noise`, the noise-floor reference beside it.
    fn new(
        step: &'a CompiledStep,
        seed: u64,
        initial: Option<&[TensorMap]>,
        noise: bool,
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
        let tolerance = Tolerance::for_compute(step.compute_dtype);
        Ok(Reference {
            graph,
            noise: noise.then(|| NoiseFloor {
                state: state.clone(),
                comparison: Comparison::new(tolerance),
            }),
            state,
            comparison: Comparison::new(tolerance),
        })
    }

    /// Runs the reference step on its state (advanced in place) and compares its loss with
    /// the ranks' `loss`; the noise-floor reference likewise, compared with the reference.
    fn step(&mut self, batch: &TensorMap, loss: f64) -> Result<(), Error> {
        let out = rt::run(self.graph, &self.state, batch, rt::RunOptions::default())?;
        let reference_loss = out.scalar("loss")?;
        self.comparison.loss(loss, reference_loss);
        advance(&mut self.state, out);
        if let Some(noise) = self.noise.as_mut() {
            let f32_accumulation = rt::RunOptions {
                accumulation: Accumulation::F32,
                ..rt::RunOptions::default()
            };
            let out = rt::run(self.graph, &noise.state, batch, f32_accumulation)?;
            noise.comparison.loss(out.scalar("loss")?, reference_loss);
            advance(&mut noise.state, out);
        }
        Ok(())
    }

    /// Compares every state tensor, gathered from the ranks' `states`, with the reference's
    /// (and the noise-floor reference's too).
    fn finish(mut self, step: &CompiledStep, states: &[TensorMap]) -> Result<VerifyReport, Error> {
        for t in &step.state.tensors {
            let Some(want) = self.state.get(&t.name) else {
                continue;
            };
            let got = step.state.gather(&t.name, states)?;
            self.comparison.tensor(&t.name, &got, want)?;
            if let Some(noise) = self.noise.as_mut() {
                let floor = noise.state.get(&t.name).ok_or_else(|| {
                    Error::Usage(format!("the noise-floor reference has no `{}`", t.name))
                })?;
                noise.comparison.tensor(&t.name, floor, want)?;
            }
        }
        Ok(match self.noise {
            Some(noise) => self
                .comparison
                .finish_with_noise(&noise.comparison.finish()),
            None => self.comparison.finish(),
        })
    }
}

/// Replaces each tensor of `state` that the step outputs (a parameter's next value) by it.
fn advance(state: &mut TensorMap, out: rt::RunOutput) {
    for (name, t) in out.outputs {
        if let Some(slot) = state.get_mut(&name) {
            *slot = t;
        }
    }
}
