//! Descriptions of what the compiler did, for dumps and traces: the pipeline's stages and
//! their costs, the schedule's action lists, rank labels, and the executed timeline of a
//! pipelined run as a Chrome trace.

use std::fmt::Write as _;

use autopar_ir::DeviceMesh;
use autopar_ir::schedule::{Schedule, Timeline};
use autopar_ir::trace::{chrome_trace, schedule_slices};
use autopar_passes::pipeline::{StageSplit, equal_split};
use autopar_runtime::{self as rt, PipelineStepReport};

use crate::Error;
use crate::compile::CompiledStep;

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

/// The Chrome trace of the last step of a pipelined run: one track per rank of the whole
/// mesh (named by its coordinates, [`rank_label`]), one slice per action of its pipeline
/// rank's list. `reports[i]` is the step report of the `i`-th pipeline
/// ([`rt::split_pipeline_rank`]); every pipeline runs the same schedule.
pub fn pipeline_trace(
    step: &CompiledStep,
    reports: &[PipelineStepReport],
) -> Result<String, Error> {
    let mesh = &step.mesh;
    let schedule = &step
        .pipeline
        .as_ref()
        .and_then(|p| p.pipelines.first())
        .ok_or_else(|| Error::Usage("a trace needs a pipeline (--mesh with pp=N)".into()))?
        .schedule;
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
pub fn describe_mesh_stages(step: &CompiledStep, split: &StageSplit) -> Result<String, Error> {
    let mesh = &step.mesh;
    let pp = step.pp();
    let n = split.num_stages();
    let others: Vec<String> = mesh
        .axes()
        .iter()
        .filter(|a| a.name != autopar_ir::axis::PP)
        .map(|a| a.name.clone())
        .collect();
    let mut out = format!(
        "mesh {mesh}: {} pipelines (one per coordinate on {}), all cut at the same layers; \
         costs below are of the global step (all ranks of a stage together)\n",
        step.locals.len(),
        others.join(", ")
    );
    out += &describe_stages(split, pp);
    let _ = writeln!(
        out,
        "local step FLOPs per stage (one rank's part of the forward + backward of one micro-batch):"
    );
    let sub = &step.spmd_mesh;
    for (which, local) in step.locals.iter().enumerate() {
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

/// `dump --stage pipeline`: the stages of the step `options` compiles to (the mesh must
/// have a `pp` axis), with their layers and FLOPs; with other axes too, each pipeline's
/// share. The stages are planned but the step is not cut.
pub fn pipeline_stages(options: &crate::CompileOptions) -> Result<String, Error> {
    let options = crate::CompileOptions {
        stop_after: Some(crate::Pass::Partition),
        reference: false,
        ..options.clone()
    };
    let step = crate::compile(&options)?;
    let train = step
        .train
        .as_ref()
        .ok_or_else(|| Error::Usage("a pipeline needs a training step".into()))?;
    let n_stages = step.pp() * options.pipeline.vpp;
    let split = autopar_passes::pipeline::plan_stages(
        &train.graph,
        n_stages,
        &options.pipeline.boundaries,
    )?;
    if step.strategies.is_some() {
        describe_mesh_stages(&step, &split)
    } else {
        Ok(describe_stages(&split, step.pp()))
    }
}
