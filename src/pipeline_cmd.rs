//! Pipeline-parallel runs and dumps for the command line: cut a training step into stages,
//! run it under a schedule on CPU ranks, check it against the single-device step
//! (`--verify`), export the executed timeline (`--trace`), and describe the stages and the
//! action lists (`dump --stage pipeline|schedule`).

use std::fmt::Write as _;

use autopar_ir::DeviceMesh;
use autopar_ir::schedule::{Schedule, ScheduleKind, Timeline};
use autopar_ir::trace::{chrome_trace, schedule_slices};
use autopar_passes::pipeline::{
    PipelineOptions, PipelineSplit, StageSplit, equal_split, plan_stages, split_pipeline,
};
use autopar_runtime::{self as rt, CommOptions, RunOptions, TensorMap};

use crate::{Error, TrainStep};

/// Errors below this bound (absolute, on every loss and state element) pass `--verify`.
pub const VERIFY_TOLERANCE: f64 = 1e-4;

/// A device mesh for a pipeline-only run: `pp=N` (other axes must have size 1).
pub fn pipeline_degree(mesh: &str) -> Result<(DeviceMesh, usize), Error> {
    let parsed =
        DeviceMesh::parse(mesh).map_err(|e| Error::Usage(format!("--mesh `{mesh}`: {e}")))?;
    let pp = parsed.axis_size("pp").unwrap_or(1);
    for axis in parsed.axes() {
        if axis.name != "pp" && axis.size > 1 {
            return Err(Error::Usage(format!(
                "--mesh `{mesh}`: axis `{}` needs the SPMD partitioner, which this pipeline \
                 runner does not compose with yet; use a pp-only mesh",
                axis.name
            )));
        }
    }
    let pp_mesh = DeviceMesh::parse(&format!("pp={pp}"))
        .map_err(|e| Error::Usage(format!("--mesh `{mesh}`: {e}")))?;
    Ok((pp_mesh, pp))
}

/// Cuts `step` for `pp` ranks.
pub fn split(
    step: &TrainStep,
    pp: usize,
    schedule: ScheduleKind,
    vpp: usize,
    boundaries: &[String],
) -> Result<PipelineSplit, Error> {
    Ok(split_pipeline(
        step,
        &PipelineOptions {
            pp,
            vpp,
            schedule,
            boundaries: boundaries.to_vec(),
        },
    )?)
}

/// What a pipelined training run reports.
#[derive(Clone, Debug)]
pub struct PipelineRunSummary {
    /// Loss of each step.
    pub losses: Vec<f64>,
    /// The last step's report (outputs, per-rank memory, spans).
    pub last: rt::PipelineStepReport,
}

/// Runs `steps` steps of the pipelined `split` on CPU ranks, from the state and data of
/// `seed` (the same as the single-device [`crate::train`]).
pub fn run_steps(
    step: &TrainStep,
    split: &PipelineSplit,
    seed: u64,
    steps: u64,
) -> Result<PipelineRunSummary, Error> {
    let program = &split.program;
    let pp = program.pp();
    let mesh = DeviceMesh::parse(&format!("pp={pp}"))
        .map_err(|e| Error::Usage(format!("pp={pp}: {e}")))?;
    let init = rt::init_parameters(&step.graph, seed)?;
    let mut states: Vec<TensorMap> = program
        .sources
        .iter()
        .map(|srcs| {
            srcs.iter()
                .filter(|s| s.is_state)
                .filter_map(|s| init.get(&s.name).map(|t| (s.name.clone(), t.clone())))
                .collect()
        })
        .collect();
    let mut losses = Vec::new();
    let mut last = None;
    for i in 0..steps.max(1) {
        let batch = rt::synthetic_batch(&step.graph, seed, i)?;
        let report = rt::run_pipeline_step(
            program,
            &mesh,
            &states,
            &batch,
            RunOptions::default(),
            CommOptions::default(),
        )?;
        losses.push(
            report
                .outputs
                .get("loss")
                .and_then(|t| t.scalar_value())
                .unwrap_or(f64::NAN),
        );
        states = report.ranks.iter().map(|r| r.state.clone()).collect();
        last = Some(report);
    }
    let last = last.ok_or_else(|| Error::Usage("no step ran".into()))?;
    Ok(PipelineRunSummary { losses, last })
}

/// The largest absolute and relative (to the reference tensor's largest magnitude)
/// differences between the outputs of the pipelined run's last step and those of the same
/// number of single-device steps.
pub fn compare_with_reference(
    step: &TrainStep,
    seed: u64,
    steps: u64,
    outputs: &TensorMap,
) -> Result<(f64, f64), Error> {
    let mut trainer = rt::Trainer::new(&step.graph, seed, RunOptions::default())?;
    let mut report = trainer.step()?;
    for _ in 1..steps {
        report = trainer.step()?;
    }
    let mut reference = report.metrics.clone();
    reference.extend(trainer.state().clone());
    let (mut max_abs, mut max_rel) = (0.0f64, 0.0f64);
    for (name, want) in &reference {
        let got = outputs
            .get(name)
            .ok_or_else(|| Error::Usage(format!("the pipelined step has no output `{name}`")))?;
        let (w, g) = (want.to_f64_vec(), got.to_f64_vec());
        if w.len() != g.len() {
            return Err(Error::Usage(format!("output `{name}` has the wrong size")));
        }
        let scale = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let err = w
            .iter()
            .zip(&g)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        let err = if err.is_nan() { f64::INFINITY } else { err };
        max_abs = max_abs.max(err);
        if scale > 0.0 {
            max_rel = max_rel.max(err / scale);
        }
    }
    Ok((max_abs, max_rel))
}

/// The Chrome trace of an executed step: one track per pipeline rank, one slice per action.
pub fn trace_json(program_schedule: &Schedule, report: &rt::PipelineStepReport) -> String {
    let spans: Vec<Vec<(u64, u64)>> = report.ranks.iter().map(|r| r.spans.clone()).collect();
    let makespan = spans.iter().flatten().map(|s| s.1).max().unwrap_or(0);
    let timeline = Timeline { spans, makespan };
    let slices = schedule_slices(program_schedule, &timeline, 1.0);
    let names: Vec<String> = (0..program_schedule.pp)
        .map(|r| format!("pipeline rank {r}"))
        .collect();
    chrome_trace(&names, &slices)
}

/// `rank 3 (dp=0,tp=1,pp=1)`: a rank of `mesh` named by its coordinates.
pub fn rank_label(mesh: &DeviceMesh, rank: usize) -> String {
    let coords: Vec<String> = mesh
        .axes()
        .iter()
        .zip(mesh.coords(rank))
        .map(|(axis, c)| format!("{}={c}", axis.name))
        .collect();
    format!("rank {rank} ({})", coords.join(","))
}

/// The Chrome trace of an executed step of pipelines that also span other mesh axes: one
/// track per rank of the whole `mesh` (named by its coordinates, [`rank_label`]), one slice
/// per action of its pipeline rank's list. `reports[i]` is the step report of the `i`-th
/// pipeline ([`rt::split_pipeline_rank`]); every pipeline runs `schedule`.
pub fn mesh_trace_json(
    mesh: &DeviceMesh,
    schedule: &Schedule,
    reports: &[rt::PipelineStepReport],
) -> Result<String, Error> {
    let n = mesh.num_devices();
    let mut rank_of = std::collections::HashMap::new();
    for rank in 0..n {
        rank_of.insert(rt::split_pipeline_rank(mesh, rank), rank);
    }
    let mut slices = Vec::new();
    for (which, report) in reports.iter().enumerate() {
        let spans: Vec<Vec<(u64, u64)>> = report.ranks.iter().map(|r| r.spans.clone()).collect();
        let makespan = spans.iter().flatten().map(|s| s.1).max().unwrap_or(0);
        let timeline = Timeline { spans, makespan };
        for mut slice in schedule_slices(schedule, &timeline, 1.0) {
            let &rank = rank_of.get(&(slice.track, which)).ok_or_else(|| {
                Error::Usage(format!(
                    "pipeline {which} has no rank {} on the mesh `{mesh}`",
                    slice.track
                ))
            })?;
            slice.track = rank;
            slices.push(slice);
        }
    }
    let names: Vec<String> = (0..n).map(|r| rank_label(mesh, r)).collect();
    Ok(chrome_trace(&names, &slices))
}

/// `dump --stage pipeline`: each virtual stage's rank, layers and FLOPs, beside what equal
/// layer counts would give.
pub fn describe_stages(split: &StageSplit, pp: usize) -> String {
    let n = split.num_stages();
    let total: f64 = split.layers.iter().map(|l| l.flops).sum();
    let mut out = format!(
        "pipeline: {n} virtual stages on pp={pp}, balanced by FLOPs (forward + backward of one micro-batch)\n"
    );
    for s in 0..n {
        let layers: Vec<&str> = split.layers[split.stage_layers(s)]
            .iter()
            .map(|l| l.name.as_str())
            .collect();
        let f = split.stage_flops(s);
        let _ = writeln!(
            out,
            "stage {s} (rank {}, chunk {}): {:>12.4e} FLOPs ({:5.1}%)  layers {}",
            s % pp,
            s / pp,
            f,
            100.0 * f / total.max(1.0),
            layers.join(" ")
        );
    }
    let equal = equal_split(split.layers.len(), n);
    let equal_split = StageSplit {
        layers: split.layers.clone(),
        starts: equal.clone(),
    };
    let max_of = |s: &StageSplit| (0..n).map(|i| s.stage_flops(i)).fold(0.0, f64::max);
    let _ = writeln!(
        out,
        "balanced: starts {:?}, costliest stage {:.4e} FLOPs\nequal layer counts: starts {:?}, costliest stage {:.4e} FLOPs",
        split.starts,
        max_of(split),
        equal,
        max_of(&equal_split)
    );
    let _ = writeln!(out, "layer costs:");
    for (i, l) in split.layers.iter().enumerate() {
        let _ = writeln!(out, "  {i:>3} {:<12} {:>12.4e}", l.name, l.flops);
    }
    out
}

/// The ranks of `mesh` that run pipeline rank `pp_rank` (one per coordinate on the other
/// axes), as `rank 1 (dp=0,tp=0,pp=1), ...`.
fn ranks_of_pipeline_rank(mesh: &DeviceMesh, pp_rank: usize) -> String {
    (0..mesh.num_devices())
        .filter(|&r| rt::split_pipeline_rank(mesh, r).0 == pp_rank)
        .map(|r| rank_label(mesh, r))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `dump --stage pipeline` on a mesh with `pp` and other axes: the stages of the global step
/// as [`describe_stages`] gives them (FLOPs of the global step: every rank of a stage
/// together), then each pipeline's share, the FLOPs of one rank's local step per stage
/// (every pipeline is cut at the same layers), and the ranks that run each pipeline rank.
pub fn describe_mesh_stages(program: &crate::spmd::PipelinedSpmd) -> Result<String, Error> {
    let mesh = &program.mesh;
    let pp = mesh.axis_size(rt::pipeline::PP_AXIS).unwrap_or(1);
    let split = &program.split;
    let n = split.num_stages();
    let others: Vec<String> = mesh
        .axes()
        .iter()
        .filter(|a| a.name != rt::pipeline::PP_AXIS)
        .map(|a| a.name.clone())
        .collect();
    let mut out = format!(
        "mesh {mesh}: {} pipelines (one per coordinate on {}), all cut at the same layers; \
         costs below are of the global step (all ranks of a stage together)\n",
        program.pipelines.len(),
        others.join(", ")
    );
    out += &describe_stages(split, pp);
    let _ = writeln!(
        out,
        "local step FLOPs per stage (one rank's part of the forward + backward of one micro-batch):"
    );
    let sub = program.spmd.mesh()?;
    for (which, local) in program.spmd.ranks.iter().enumerate() {
        let layers = autopar_passes::pipeline::layer_sequence(local)?;
        let same = layers.len() == split.layers.len()
            && layers
                .iter()
                .zip(&split.layers)
                .all(|(a, b)| a.name == b.name);
        if !same {
            return Err(Error::Usage(format!(
                "the local step of pipeline {which} has other layers than the global step"
            )));
        }
        let local_split = StageSplit {
            layers,
            starts: split.starts.clone(),
        };
        let coords: Vec<String> = sub
            .axes()
            .iter()
            .zip(sub.coords(which))
            .map(|(a, c)| format!("{}={c}", a.name))
            .collect();
        let stages: Vec<String> = (0..n)
            .map(|s| format!("stage {s} {:.4e}", local_split.stage_flops(s)))
            .collect();
        let _ = writeln!(
            out,
            "  pipeline {which} ({}): {}",
            coords.join(","),
            stages.join(", ")
        );
    }
    for r in 0..pp {
        let _ = writeln!(
            out,
            "pp rank {r} runs on {}",
            ranks_of_pipeline_rank(mesh, r)
        );
    }
    Ok(out)
}

/// `dump --stage schedule` on a mesh with `pp` and other axes: every pipeline rank's action
/// list and the ranks of the mesh that run it (all pipelines run the same schedule).
pub fn describe_mesh_schedule(s: &Schedule, mesh: &DeviceMesh) -> String {
    let mut out = format!(
        "schedule {} pp={} vpp={} micro-batches={} on the mesh {mesh}: every rank runs the list of its pp coordinate\n",
        s.kind, s.pp, s.vpp, s.micro_batches
    );
    for (r, list) in s.per_rank.iter().enumerate() {
        let _ = writeln!(
            out,
            "pp rank {r} (peak in flight {}), on {}:",
            s.max_in_flight(r),
            ranks_of_pipeline_rank(mesh, r)
        );
        for a in list {
            let (name, _) = autopar_ir::trace::describe(a);
            let _ = writeln!(out, "  {name}");
        }
    }
    out
}

/// The stage split alone (for `dump --stage pipeline`).
pub fn stages(
    step: &TrainStep,
    n_stages: usize,
    boundaries: &[String],
) -> Result<StageSplit, Error> {
    Ok(plan_stages(&step.graph, n_stages, boundaries)?)
}

/// `dump --stage schedule`: every rank's action list.
pub fn describe_schedule(s: &Schedule) -> String {
    let mut out = format!(
        "schedule {} pp={} vpp={} micro-batches={}\n",
        s.kind, s.pp, s.vpp, s.micro_batches
    );
    for (r, list) in s.per_rank.iter().enumerate() {
        let _ = writeln!(out, "rank {r} (peak in flight {}):", s.max_in_flight(r));
        for a in list {
            let (name, _) = autopar_ir::trace::describe(a);
            let _ = writeln!(out, "  {name}");
        }
    }
    out
}
