//! The pipeline executor: runs a [`PipelineProgram`] under its schedule, each sub-program on
//! any [`Backend`] (loaded once per rank and step), with activations and gradients exchanged by `send`/`recv` over mesh axis
//! `pp` through the rank's [`Collectives`]. [`run_pipeline_rank`] runs one rank, for any
//! launcher; [`run_pipeline_step_planned`] and its siblings start every rank as a thread
//! ([`ThreadLauncher`]).
//!
//! Each rank keeps a store of tensors keyed by the step graph's value ids. It starts with the
//! state and inputs the rank reads; every forward, backward and optimizer segment moves its
//! inputs out of the store, runs on the backend and puts its exports back (the store holds
//! the backend's buffers; messages cross the communicator as host tensors); a
//! value leaves the store after its last use on the rank (so a micro-batch's activations are
//! freed once its backward has run). Gradients accumulate over micro-batches inside the
//! backward sub-programs; the optimizer runs after the last backward.
//!
//! Messages between two ranks travel in the order the sender posts them; a receiver that
//! needs a later message first keeps the earlier ones aside until their turn, so the action
//! lists' own order decides nothing about matching.
//!
//! The executor records, per rank, the peak bytes of its store (plus the working set of the
//! sub-program running), the peak bytes of stored forward activations, the largest number of
//! (micro-batch, chunk) forwards whose backward had not yet run, and when each action started
//! and ended.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Instant;

use autopar_ir::pipeline::{Carried, PipelineProgram, StageProgram, value_name};
use autopar_ir::schedule::Action;
use autopar_ir::{DeviceMesh, ValueId};

use crate::TensorMap;
use crate::backend::{Backend, CpuBackend};
use crate::comm::{Collectives, CommOptions};
use crate::error::RuntimeError;
use crate::interp::RunOptions;
use crate::launch::{Launcher, ThreadLauncher, root_cause};
use crate::plan::ExecutionPlan;
use crate::tensor::Tensor;

/// The mesh axis pipeline messages travel on.
pub const PP_AXIS: &str = autopar_ir::axis::PP;

/// What one rank did during a step.
#[derive(Clone, Debug, PartialEq)]
pub struct RankReport {
    /// Peak bytes held by the rank: its store plus the working set of the running sub-program.
    pub peak_bytes: u64,
    /// Peak bytes of forward activations held for backwards (including received ones).
    pub peak_activation_bytes: u64,
    /// Largest number of (micro-batch, chunk) forwards run whose backward had not.
    pub max_in_flight: usize,
    /// `(start, end)` in nanoseconds since the step began, one per action of the rank's list.
    pub spans: Vec<(u64, u64)>,
    /// The rank's next state: the state it reads, updated.
    pub state: TensorMap,
}

/// What a pipeline step produced.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineStepReport {
    /// The step graph's outputs (loss, next state, ...), each from the rank that holds it.
    pub outputs: TensorMap,
    /// Per pipeline rank.
    pub ranks: Vec<RankReport>,
}

/// Runs one step of `program` on the ranks of `mesh` (which must have the single axis
/// `pp`), rank `r` starting from `states[r]` (at least the state it reads) and the global
/// `batch`.
pub fn run_pipeline_step(
    program: &PipelineProgram,
    mesh: &DeviceMesh,
    states: &[TensorMap],
    batch: &TensorMap,
    options: RunOptions,
    comm: CommOptions,
) -> Result<PipelineStepReport, RuntimeError> {
    let pp = program.pp();
    if mesh.axis_size(PP_AXIS) != Some(pp) || mesh.num_devices() != pp || states.len() != pp {
        return Err(RuntimeError::SpmdSetup {
            detail: format!(
                "a {pp}-stage pipeline needs the mesh `pp={pp}` and {pp} rank states (got `{mesh}`, {} states)",
                states.len()
            ),
        });
    }
    let batches = vec![batch.clone(); pp];
    let mut reports = run_pipeline_step_spmd(
        std::slice::from_ref(program),
        mesh,
        states,
        &batches,
        options,
        comm,
    )?;
    reports.pop().ok_or_else(|| RuntimeError::SpmdSetup {
        detail: "the pipeline produced no report".into(),
    })
}

/// The pipeline coordinate of linear `rank` of `mesh`, and the linear index of its
/// coordinates on the other axes (row-major, in the mesh's axis order without `pp`).
pub fn split_pipeline_rank(mesh: &DeviceMesh, rank: usize) -> (usize, usize) {
    let coords = mesh.coords(rank);
    let (mut pp_coord, mut other) = (0, 0);
    for (axis, c) in mesh.axes().iter().zip(coords) {
        if axis.name == PP_AXIS {
            pp_coord = c;
        } else {
            other = other * axis.size + c;
        }
    }
    (pp_coord, other)
}

/// The execution plan of every sub-program of a pipeline, made once (at compile time) so
/// that a step does not plan its sub-programs again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelinePlans {
    /// `forward[vs][mb]`, as [`PipelineProgram::forward`].
    pub forward: Vec<Vec<ExecutionPlan>>,
    /// `backward[vs][mb]`, as [`PipelineProgram::backward`].
    pub backward: Vec<Vec<ExecutionPlan>>,
    /// One per optimizer segment, as [`PipelineProgram::optimizer`].
    pub optimizer: Vec<ExecutionPlan>,
}

impl PipelinePlans {
    /// Plans every sub-program of `program` (the sub-programs of a stage that differ only in
    /// their micro-batch share one plan: [`crate::plan_all`]).
    pub fn new(program: &PipelineProgram) -> Result<PipelinePlans, RuntimeError> {
        let plan_each = |per_stage: &[Vec<StageProgram>]| {
            per_stage
                .iter()
                .map(|subs| crate::plan_all(subs.iter().map(|p| &p.graph)))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(PipelinePlans {
            forward: plan_each(&program.forward)?,
            backward: plan_each(&program.backward)?,
            optimizer: program
                .optimizer
                .iter()
                .map(|seg| ExecutionPlan::new(&seg.program.graph))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Which sub-program of a pipeline runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Sub {
    Forward(usize, usize),
    Backward(usize, usize),
    Optimizer(usize),
}

/// Runs one step of pipelines that are also split over the other axes of `mesh`:
/// `programs[i]` is the pipeline of the `i`-th coordinate on the axes other than `pp`
/// (row-major, see [`split_pipeline_rank`]); its sub-programs may hold collectives over
/// those axes, which the ranks sharing a pipeline coordinate issue in the same order
/// because they walk the same action list. Rank `r` of `mesh` starts from `states[r]` and
/// reads the inputs `batches[r]` (its part of the batch). Returns one report per program,
/// its `ranks` indexed by pipeline coordinate.
pub fn run_pipeline_step_spmd(
    programs: &[PipelineProgram],
    mesh: &DeviceMesh,
    states: &[TensorMap],
    batches: &[TensorMap],
    options: RunOptions,
    comm: CommOptions,
) -> Result<Vec<PipelineStepReport>, RuntimeError> {
    let plans = programs
        .iter()
        .map(PipelinePlans::new)
        .collect::<Result<Vec<_>, _>>()?;
    run_pipeline_step_planned(programs, &plans, mesh, states, batches, options, comm)
}

/// [`run_pipeline_step_spmd`] with every sub-program's plan made beforehand: `plans[i]` is
/// [`PipelinePlans::new`] of `programs[i]`.
pub fn run_pipeline_step_planned(
    programs: &[PipelineProgram],
    plans: &[PipelinePlans],
    mesh: &DeviceMesh,
    states: &[TensorMap],
    batches: &[TensorMap],
    options: RunOptions,
    comm: CommOptions,
) -> Result<Vec<PipelineStepReport>, RuntimeError> {
    let n = mesh.num_devices();
    let pp = mesh.axis_size(PP_AXIS).unwrap_or(1);
    let bad = programs.len() * pp != n
        || plans.len() != programs.len()
        || states.len() != n
        || batches.len() != n
        || programs.iter().any(|p| p.pp() != pp);
    if bad {
        return Err(RuntimeError::SpmdSetup {
            detail: format!(
                "the mesh `{mesh}` needs {} pipelines of {pp} stages and {n} rank states and \
                 batches (got {} pipelines, {} states, {} batches)",
                n / pp.max(1),
                programs.len(),
                states.len(),
                batches.len()
            ),
        });
    }
    let launcher = ThreadLauncher { options: comm };
    let backend = CpuBackend { options };
    let results = launcher.launch(mesh, |comm| {
        let rank = comm.rank();
        let (pp_rank, which) = split_pipeline_rank(mesh, rank);
        let (Some(program), Some(plans), Some(state), Some(batch)) = (
            programs.get(which),
            plans.get(which),
            states.get(rank),
            batches.get(rank),
        ) else {
            return Err(RuntimeError::SpmdSetup {
                detail: format!("rank {rank} has no pipeline, plans, state or batch"),
            });
        };
        run_pipeline_rank(program, plans, pp_rank, comm, &backend, state, batch)
    })?;
    let mut per_program: Vec<Vec<Option<PipelineRankStep>>> = vec![vec![None; pp]; programs.len()];
    for (rank, step) in root_cause(results)? {
        let (pp_rank, which) = split_pipeline_rank(mesh, rank);
        per_program[which][pp_rank] = Some(step);
    }
    let mut reports = Vec::with_capacity(programs.len());
    for ranks in per_program {
        let mut outputs = TensorMap::new();
        let mut reports_of = Vec::with_capacity(ranks.len());
        for step in ranks.into_iter().flatten() {
            outputs.extend(step.outputs);
            reports_of.push(step.report);
        }
        reports.push(PipelineStepReport {
            outputs,
            ranks: reports_of,
        });
    }
    Ok(reports)
}

/// What one pipeline rank produced in a step: its report (with its next state, by state
/// name) and the step outputs it holds, by output name.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineRankStep {
    /// The rank's figures and next state.
    pub report: RankReport,
    /// The outputs of the step graph that live on this rank (the loss on the last stage).
    pub outputs: TensorMap,
}

/// Runs one step of `program` on pipeline rank `pp_rank` only, its messages and its
/// sub-programs' collectives going through `comm`: the per-rank entry of the pipeline
/// executor, for whatever launcher started the rank (a thread, an MPI process). `plans` are
/// [`PipelinePlans::new`] of `program`; `state` holds (at least) the state the rank reads and
/// `batch` the inputs it reads.
pub fn run_pipeline_rank<B: Backend>(
    program: &PipelineProgram,
    plans: &PipelinePlans,
    pp_rank: usize,
    comm: &mut dyn Collectives,
    backend: &B,
    state: &TensorMap,
    batch: &TensorMap,
) -> Result<PipelineRankStep, RuntimeError> {
    if pp_rank >= program.pp() {
        return Err(RuntimeError::SpmdSetup {
            detail: format!(
                "pipeline rank {pp_rank} of a {}-stage pipeline",
                program.pp()
            ),
        });
    }
    let mut report = RankRun::new(program, plans, pp_rank, comm, backend).run(state, batch)?;
    let held = std::mem::take(&mut report.state);
    for (name, v) in &program.state_outputs[pp_rank] {
        if let Some(t) = held.get(&value_name(*v)) {
            report.state.insert(name.clone(), t.clone());
        }
    }
    let mut outputs = TensorMap::new();
    for (name, v, rank) in &program.outputs {
        if *rank != pp_rank {
            continue;
        }
        let t = held
            .get(&value_name(*v))
            .cloned()
            .ok_or_else(|| RuntimeError::Pipeline {
                rank: *rank,
                detail: format!("output `{name}` ({v}) was not produced"),
            })?;
        outputs.insert(name.clone(), t);
    }
    Ok(PipelineRankStep { report, outputs })
}

/// The kinds of message a rank sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Msg {
    /// Activations of (sending virtual stage, micro-batch).
    Act(usize, usize),
    /// Gradients of (sending virtual stage, micro-batch).
    Grad(usize, usize),
    /// Optimizer segment `i`'s values for the receiver.
    Opt(usize),
}

struct RankRun<'p, 'c, B: Backend> {
    program: &'p PipelineProgram,
    plans: &'p PipelinePlans,
    rank: usize,
    comm: &'c mut dyn Collectives,
    backend: &'c B,
    /// Sub-programs loaded on the backend, each once.
    loaded: HashMap<Sub, B::Executable<'p>>,
    /// Each value held, with its bytes at its declared dtype.
    store: HashMap<ValueId, (B::Buffer, u64)>,
    /// Remaining uses of each value on this rank; `usize::MAX` for values kept to the end.
    uses: HashMap<ValueId, usize>,
    /// Per peer, the messages it will send us, in its order.
    incoming: Vec<VecDeque<Msg>>,
    stash: HashMap<Msg, Vec<(ValueId, Tensor)>>,
    activations: HashSet<ValueId>,
    store_bytes: u64,
    activation_bytes: u64,
    peak_bytes: u64,
    peak_activation_bytes: u64,
}

impl<'p, 'c, B: Backend> RankRun<'p, 'c, B> {
    fn new(
        program: &'p PipelineProgram,
        plans: &'p PipelinePlans,
        rank: usize,
        comm: &'c mut dyn Collectives,
        backend: &'c B,
    ) -> Self {
        let s = &program.schedule;
        let pp = s.pp;
        let mut uses: HashMap<ValueId, usize> = HashMap::new();
        let mut use_all = |vals: &mut dyn Iterator<Item = ValueId>| {
            for v in vals {
                *uses.entry(v).or_insert(0) += 1;
            }
        };
        let mut activations = HashSet::new();
        for a in &s.per_rank[rank] {
            match *a {
                Action::Forward { micro_batch, chunk } => {
                    let p = &program.forward[s.virtual_stage(rank, chunk)][micro_batch];
                    use_all(&mut p.inputs.iter().copied());
                    activations.extend(p.outputs.iter().copied());
                }
                Action::Backward { micro_batch, chunk } => {
                    let p = &program.backward[s.virtual_stage(rank, chunk)][micro_batch];
                    use_all(&mut p.inputs.iter().copied());
                }
                Action::SendActivation {
                    micro_batch, chunk, ..
                } => {
                    let m = &program.activations[s.virtual_stage(rank, chunk)][micro_batch];
                    use_all(&mut m.iter().map(|c| c.value));
                }
                Action::SendGradient {
                    micro_batch, chunk, ..
                } => {
                    let m = &program.gradients[s.virtual_stage(rank, chunk)][micro_batch];
                    use_all(&mut m.iter().map(|c| c.value));
                }
                Action::RecvActivation {
                    micro_batch, chunk, ..
                } => {
                    let m = &program.activations[s.virtual_stage(rank, chunk) - 1][micro_batch];
                    activations.extend(m.iter().map(|c| c.value));
                }
                Action::RecvGradient { .. } | Action::OptimizerStep => {}
            }
        }
        for seg in program.optimizer.iter().filter(|seg| seg.rank == rank) {
            use_all(&mut seg.program.inputs.iter().copied());
            for (_, vals) in &seg.sends {
                use_all(&mut vals.iter().map(|c| c.value));
            }
        }
        for &(_, v) in &program.state_outputs[rank] {
            uses.insert(v, usize::MAX);
        }
        for &(_, v, r) in &program.outputs {
            if r == rank {
                uses.insert(v, usize::MAX);
            }
        }
        // What each peer sends us, in its order.
        let mut incoming = vec![VecDeque::new(); pp];
        for (peer, list) in s.per_rank.iter().enumerate() {
            for a in list {
                match *a {
                    Action::SendActivation {
                        micro_batch,
                        chunk,
                        to,
                    } if to == rank => incoming[peer]
                        .push_back(Msg::Act(s.virtual_stage(peer, chunk), micro_batch)),
                    Action::SendGradient {
                        micro_batch,
                        chunk,
                        to,
                    } if to == rank => incoming[peer]
                        .push_back(Msg::Grad(s.virtual_stage(peer, chunk), micro_batch)),
                    _ => {}
                }
            }
        }
        for (i, seg) in program.optimizer.iter().enumerate() {
            if seg.sends.iter().any(|(to, _)| *to == rank) {
                incoming[seg.rank].push_back(Msg::Opt(i));
            }
        }
        RankRun {
            program,
            plans,
            rank,
            comm,
            backend,
            loaded: HashMap::new(),
            store: HashMap::new(),
            uses,
            incoming,
            stash: HashMap::new(),
            activations,
            store_bytes: 0,
            activation_bytes: 0,
            peak_bytes: 0,
            peak_activation_bytes: 0,
        }
    }

    fn run(&mut self, state: &TensorMap, batch: &TensorMap) -> Result<RankReport, RuntimeError> {
        let program = self.program;
        let s = &program.schedule;
        for src in &program.sources[self.rank] {
            let map = if src.is_state { state } else { batch };
            let t = map.get(&src.name).ok_or_else(|| RuntimeError::Missing {
                feed: if src.is_state {
                    crate::Feed::Parameter
                } else {
                    crate::Feed::Input
                },
                name: src.name.clone(),
                expected: src.ty.clone(),
            })?;
            let buffer = self.backend.upload(t)?;
            self.put(src.value, buffer, src.ty.size_bytes());
        }
        let start = Instant::now();
        let ns = |t: Instant| t.duration_since(start).as_nanos() as u64;
        let mut spans = Vec::with_capacity(s.per_rank[self.rank].len());
        let (mut in_flight, mut max_in_flight) = (0usize, 0usize);
        for a in &s.per_rank[self.rank] {
            let t0 = Instant::now();
            match *a {
                Action::Forward { micro_batch, chunk } => {
                    let vs = s.virtual_stage(self.rank, chunk);
                    self.execute(Sub::Forward(vs, micro_batch))?;
                    in_flight += 1;
                    max_in_flight = max_in_flight.max(in_flight);
                }
                Action::Backward { micro_batch, chunk } => {
                    let vs = s.virtual_stage(self.rank, chunk);
                    self.execute(Sub::Backward(vs, micro_batch))?;
                    in_flight = in_flight.saturating_sub(1);
                }
                Action::SendActivation {
                    micro_batch,
                    chunk,
                    to,
                } => {
                    let vs = s.virtual_stage(self.rank, chunk);
                    self.send(to, &program.activations[vs][micro_batch])?;
                }
                Action::SendGradient {
                    micro_batch,
                    chunk,
                    to,
                } => {
                    let vs = s.virtual_stage(self.rank, chunk);
                    self.send(to, &program.gradients[vs][micro_batch])?;
                }
                Action::RecvActivation {
                    micro_batch,
                    chunk,
                    from,
                } => {
                    let vs = s.virtual_stage(self.rank, chunk);
                    self.receive(from, Msg::Act(vs - 1, micro_batch))?;
                }
                Action::RecvGradient {
                    micro_batch,
                    chunk,
                    from,
                } => {
                    let vs = s.virtual_stage(self.rank, chunk);
                    self.receive(from, Msg::Grad(vs + 1, micro_batch))?;
                }
                Action::OptimizerStep => self.optimizer_step()?,
            }
            spans.push((ns(t0), ns(Instant::now())));
        }
        let mut held = TensorMap::new();
        for (_, v) in &program.state_outputs[self.rank] {
            if let Some((t, _)) = self.store.get(v) {
                held.insert(value_name(*v), self.backend.download(t)?);
            }
        }
        for (_, v, r) in &program.outputs {
            if *r == self.rank
                && let Some((t, _)) = self.store.get(v)
            {
                held.insert(value_name(*v), self.backend.download(t)?);
            }
        }
        Ok(RankReport {
            peak_bytes: self.peak_bytes,
            peak_activation_bytes: self.peak_activation_bytes,
            max_in_flight,
            spans,
            state: held,
        })
    }

    /// Walks the optimizer segments in their global order: runs ours and sends their
    /// results, receives what others send us.
    fn optimizer_step(&mut self) -> Result<(), RuntimeError> {
        let program = self.program;
        for (i, seg) in program.optimizer.iter().enumerate() {
            if seg.rank == self.rank {
                self.execute(Sub::Optimizer(i))?;
                for (to, vals) in &seg.sends {
                    self.send(*to, vals)?;
                }
            } else if seg.sends.iter().any(|(to, _)| *to == self.rank) {
                self.receive(seg.rank, Msg::Opt(i))?;
            }
        }
        Ok(())
    }

    fn put(&mut self, v: ValueId, t: B::Buffer, bytes: u64) {
        if let Some((_, old)) = self.store.insert(v, (t, bytes)) {
            self.forget_bytes(v, old);
        }
        self.store_bytes += bytes;
        if self.activations.contains(&v) {
            self.activation_bytes += bytes;
        }
        self.peak_bytes = self.peak_bytes.max(self.store_bytes);
        self.peak_activation_bytes = self.peak_activation_bytes.max(self.activation_bytes);
    }

    fn forget_bytes(&mut self, v: ValueId, bytes: u64) {
        self.store_bytes -= bytes;
        if self.activations.contains(&v) {
            self.activation_bytes -= bytes;
        }
    }

    /// Counts one use of `v`, dropping it after its last.
    fn used(&mut self, v: ValueId) {
        let Some(n) = self.uses.get_mut(&v) else {
            return;
        };
        if *n == usize::MAX {
            return;
        }
        *n = n.saturating_sub(1);
        if *n == 0
            && let Some((_, bytes)) = self.store.remove(&v)
        {
            self.forget_bytes(v, bytes);
        }
    }

    fn missing(&self, v: ValueId, what: &str) -> RuntimeError {
        RuntimeError::Pipeline {
            rank: self.rank,
            detail: format!("{v} is not on the rank when {what} needs it"),
        }
    }

    /// Runs a sub-program on values moved out of the store, then puts them and the exports
    /// back.
    fn execute(&mut self, sub: Sub) -> Result<(), RuntimeError> {
        let (program, plans) = (self.program, self.plans);
        let missing = || RuntimeError::Pipeline {
            rank: self.rank,
            detail: format!("the pipeline has no sub-program or plan {sub:?}"),
        };
        let (p, plan) = match sub {
            Sub::Forward(vs, mb) => (
                program.forward.get(vs).and_then(|s| s.get(mb)),
                plans.forward.get(vs).and_then(|s| s.get(mb)),
            ),
            Sub::Backward(vs, mb) => (
                program.backward.get(vs).and_then(|s| s.get(mb)),
                plans.backward.get(vs).and_then(|s| s.get(mb)),
            ),
            Sub::Optimizer(i) => (
                program.optimizer.get(i).map(|seg| &seg.program),
                plans.optimizer.get(i),
            ),
        };
        let (Some(p), Some(plan)) = (p, plan) else {
            return Err(missing());
        };
        if p.graph.num_nodes() == 0 {
            return Ok(());
        }
        let mut feed = BTreeMap::new();
        let mut moved = Vec::with_capacity(p.inputs.len());
        let mut moved_bytes = 0;
        for &v in &p.inputs {
            let (t, bytes) = self
                .store
                .remove(&v)
                .ok_or_else(|| self.missing(v, p.graph.name()))?;
            moved_bytes += bytes;
            moved.push((v, bytes));
            feed.insert(value_name(v), t);
        }
        let out = match self.loaded.entry(sub) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => self
                .backend
                .load(&p.graph, plan.clone())
                .map(|exe| e.insert(exe)),
        }
        .and_then(|exe| {
            self.backend
                .execute(exe, &BTreeMap::new(), &feed, &mut *self.comm)
        });
        // Put the inputs back before anything else, so that a failure leaves the store whole.
        for (v, bytes) in moved {
            if let Some(t) = feed.remove(&value_name(v)) {
                self.store.insert(v, (t, bytes));
            }
        }
        let out = out?;
        self.peak_bytes = self
            .peak_bytes
            .max(self.store_bytes - moved_bytes + out.peak_bytes);
        for v in &p.inputs {
            self.used(*v);
        }
        for (name, t) in out.outputs {
            let v = p
                .outputs
                .iter()
                .copied()
                .find(|&v| value_name(v) == name)
                .ok_or_else(|| self.missing(ValueId(u32::MAX), &name))?;
            if self.uses.contains_key(&v) {
                let bytes = p
                    .graph
                    .output(&name)
                    .map_or(0, |w| p.graph.ty(w).size_bytes());
                self.put(v, t, bytes);
            }
        }
        Ok(())
    }

    fn shift(&self, peer: usize) -> i64 {
        peer as i64 - self.rank as i64
    }

    fn send(&mut self, to: usize, values: &[Carried]) -> Result<(), RuntimeError> {
        let shift = self.shift(to);
        for c in values {
            let (t, _) = self
                .store
                .get(&c.value)
                .ok_or_else(|| self.missing(c.value, "a send"))?;
            let t = self.backend.download(t)?;
            self.comm.send(&t, PP_AXIS, shift)?;
        }
        for c in values {
            self.used(c.value);
        }
        Ok(())
    }

    /// Receives message `want` from `from`, keeping aside the ones it sent before.
    fn receive(&mut self, from: usize, want: Msg) -> Result<(), RuntimeError> {
        while !self.stash.contains_key(&want) {
            let next = self.incoming[from]
                .pop_front()
                .ok_or_else(|| RuntimeError::Pipeline {
                    rank: self.rank,
                    detail: format!("rank {from} never sends {want:?}"),
                })?;
            let carried = self.carried(next);
            let mut got = Vec::with_capacity(carried.len());
            for c in carried {
                let t = self.comm.recv(&c.ty, PP_AXIS, self.shift(from))?;
                got.push((c.value, t));
            }
            self.stash.insert(next, got);
        }
        for (v, t) in self.stash.remove(&want).unwrap_or_default() {
            if self.uses.contains_key(&v) {
                let bytes = t.size_bytes();
                let buffer = self.backend.upload(&t)?;
                self.put(v, buffer, bytes);
            }
        }
        Ok(())
    }

    /// The values message `m` carries to this rank.
    fn carried(&self, m: Msg) -> &'p [Carried] {
        let p = self.program;
        match m {
            Msg::Act(vs, mb) => &p.activations[vs][mb],
            Msg::Grad(vs, mb) => &p.gradients[vs][mb],
            Msg::Opt(i) => p.optimizer[i]
                .sends
                .iter()
                .find(|(to, _)| *to == self.rank)
                .map_or(&[], |(_, v)| v.as_slice()),
        }
    }
}
