//! Running a compiled step: [`run`] initialises every rank's share of the state, feeds each
//! step its part of the synthetic batch, runs the ranks' programs (SPMD or pipelined) and
//! carries each rank's next state to the next step; with [`RunOptions::verify`] the
//! single-device reference runs beside it and [`VerifyReport`] compares the two.
//!
//! The one tolerance policy of `--verify` lives here ([`tolerance`]): it depends only on the
//! compute dtype, and a NaN or an infinity in either run is a failure.

use autopar_ir::DType;
use autopar_passes::train::GRADS_FINITE;
use autopar_runtime::{
    self as rt, CommOptions, PipelineStepReport, RankProgram, SpmdOptions, TensorMap,
};

use crate::Error;
use crate::compile::CompiledStep;
use crate::state::rank_inputs;

/// How to run a compiled step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// Seed of the state initialisation and of the synthetic data.
    pub seed: u64,
    /// Steps to run (at least one).
    pub steps: u64,
    /// Run the single-device reference beside the ranks and compare.
    pub verify: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            seed: 0,
            steps: 1,
            verify: false,
        }
    }
}

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

/// Runs `options.steps` steps of `step` on CPU ranks, one thread per rank of its mesh;
/// `on_step` sees every step as it ends.
pub fn run(
    step: &CompiledStep,
    options: &RunOptions,
    mut on_step: impl FnMut(&StepEvent),
) -> Result<RunReport, Error> {
    if step.locals.is_empty() {
        return Err(Error::Usage(
            "the step was compiled without its rank programs (stop_after)".into(),
        ));
    }
    let n = step.mesh.num_devices();
    let g = &step.global;
    let mut states: Vec<TensorMap> = (0..n)
        .map(|rank| step.state.init_rank(rank, options.seed))
        .collect::<Result<_, _>>()?;
    let mut reference = match options.verify {
        true => Some(Reference::new(step, options.seed)?),
        false => None,
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
    for i in 0..options.steps.max(1) {
        let batch = rt::synthetic_batch(g, options.seed, i)?;
        let inputs: Vec<TensorMap> = (0..step.locals.len())
            .map(|which| rank_inputs(g, &batch, &step.spmd_mesh, which))
            .collect::<Result<_, _>>()?;
        let outputs = match &step.pipeline {
            None => run_spmd_step(step, &states, &inputs, &mut peaks)?,
            Some(p) => {
                let reports = rt::run_pipeline_step_spmd(
                    &p.pipelines,
                    &step.mesh,
                    &states,
                    &(0..n)
                        .map(|rank| inputs[rt::split_pipeline_rank(&step.mesh, rank).1].clone())
                        .collect::<Vec<_>>(),
                    rt::RunOptions::default(),
                    CommOptions::default(),
                )?;
                let outputs = pipeline_outputs(step, &reports, &mut peaks, &mut pipeline_stats)?;
                report.pipeline_reports = reports;
                outputs
            }
        };
        let loss = outputs
            .first()
            .and_then(|o| o.get("loss"))
            .and_then(|t| t.scalar_value())
            .ok_or_else(|| Error::Usage("the step has no scalar output `loss`".into()))?;
        let grads_finite = outputs
            .first()
            .and_then(|o| o.get(GRADS_FINITE))
            .and_then(|t| t.scalar_value())
            .map(|v| v != 0.0);
        on_step(&StepEvent {
            step: i,
            loss,
            grads_finite,
        });
        report.losses.push(loss);
        // Every rank takes its own next state: each tensor it holds, updated (a tensor the
        // step does not update stays as it is).
        for (rank, (state, next)) in states.iter_mut().zip(outputs).enumerate() {
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
        if let Some(r) = reference.as_mut() {
            r.step(&batch, loss)?;
        }
        report.peak_bytes = report
            .peak_bytes
            .max(peaks.iter().copied().max().unwrap_or(0));
    }
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

/// One SPMD step: every rank's outputs, in rank order; `peaks` gets each rank's peak.
fn run_spmd_step(
    step: &CompiledStep,
    states: &[TensorMap],
    inputs: &[TensorMap],
    peaks: &mut [u64],
) -> Result<Vec<TensorMap>, Error> {
    let ranks: Vec<RankProgram<'_>> = step
        .locals
        .iter()
        .zip(states)
        .zip(inputs)
        .map(|((graph, params), inputs)| RankProgram {
            graph,
            params,
            inputs,
        })
        .collect();
    let outs = rt::run_spmd(&step.spmd_mesh, &ranks, SpmdOptions::default())?;
    Ok(outs
        .into_iter()
        .zip(peaks.iter_mut())
        .map(|(out, peak)| {
            *peak = out.peak_bytes;
            out.outputs
        })
        .collect())
}

/// Every rank's outputs of a pipelined step, in rank order: its next state, and the step's
/// outputs (loss and metrics) on rank 0.
fn pipeline_outputs(
    step: &CompiledStep,
    reports: &[PipelineStepReport],
    peaks: &mut [u64],
    stats: &mut [Option<PipelineRankStats>],
) -> Result<Vec<TensorMap>, Error> {
    let mut out = Vec::with_capacity(peaks.len());
    for rank in 0..peaks.len() {
        let (pp_rank, which) = rt::split_pipeline_rank(&step.mesh, rank);
        let pipeline = reports
            .get(which)
            .ok_or_else(|| Error::Usage(format!("rank {rank} has no pipeline report")))?;
        let r = pipeline
            .ranks
            .get(pp_rank)
            .ok_or_else(|| Error::Usage(format!("rank {rank} has no pipeline rank report")))?;
        peaks[rank] = r.peak_bytes;
        stats[rank] = Some(PipelineRankStats {
            peak_activation_bytes: r.peak_activation_bytes,
            max_in_flight: r.max_in_flight,
        });
        let mut outputs = r.state.clone();
        if rank == 0 {
            for (name, t) in &pipeline.outputs {
                outputs.entry(name.clone()).or_insert_with(|| t.clone());
            }
        }
        out.push(outputs);
    }
    Ok(out)
}

/// The tolerance `--verify` holds both errors to, by compute dtype: 1e-4 for f32; 5e-2 for
/// bf16 and f16, whose partial sums are rounded to 8 (or 11) bits in a different order on
/// every mesh, so that gradients differ by about 1%, which Adam's normalised update turns
/// into up to the learning rate per step on elements with tiny gradients.
pub fn tolerance(compute: DType) -> f64 {
    if compute == DType::F32 { 1e-4 } else { 5e-2 }
}

/// The smallest scale relative errors are taken against, so that tensors of magnitude below
/// 1 are held to the absolute tolerance (the usual mixed criterion `|a - b| <= tol * max(|b|,
/// 1)`). A weight whose gradient vanishes in exact arithmetic (a key bias: softmax ignores a
/// shift common to all keys) moves only on rounding noise, which differs with the order of
/// the sums; relative to its own near-zero size that noise would look like a disagreement.
pub const REL_FLOOR: f64 = 1.0;

/// The outcome of `--verify`.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyReport {
    /// The tensor (or `loss`) with the largest relative difference, or the first one found
    /// not finite.
    pub worst: String,
    /// Largest absolute difference over the losses and every state tensor (infinite when a
    /// value is not finite).
    pub max_abs_err: f64,
    /// Largest relative difference: per tensor, the largest absolute difference over the
    /// largest magnitude of the reference, or [`REL_FLOOR`] when that is smaller.
    pub max_rel_err: f64,
    /// The tolerance both errors are held to ([`tolerance`]).
    pub tolerance: f64,
    /// The first value found NaN or infinite, in either run (`loss of step 3`, a tensor).
    pub non_finite: Option<String>,
}

impl VerifyReport {
    /// True when both errors are within the tolerance and every value is finite.
    pub fn ok(&self) -> bool {
        self.non_finite.is_none()
            && self.max_abs_err <= self.tolerance
            && self.max_rel_err <= self.tolerance
    }

    /// `verify: max_abs_err=<x> max_rel_err=<y> OK` (or `FAILED`, with the non-finite value
    /// named).
    pub fn line(&self) -> String {
        let mut line = format!(
            "verify: max_abs_err={:.3e} max_rel_err={:.3e} {}",
            self.max_abs_err,
            self.max_rel_err,
            if self.ok() { "OK" } else { "FAILED" }
        );
        if let Some(what) = &self.non_finite {
            line += &format!(" (not finite: {what})");
        }
        line
    }
}

/// The single-device reference, advanced step by step beside the ranks, and the running
/// comparison with them.
struct Reference<'a> {
    graph: &'a autopar_ir::Graph,
    state: TensorMap,
    report: VerifyReport,
    steps: u64,
}

impl<'a> Reference<'a> {
    fn new(step: &'a CompiledStep, seed: u64) -> Result<Self, Error> {
        Ok(Reference {
            graph: &step.reference,
            state: rt::init_parameters(&step.reference, seed)?,
            report: VerifyReport {
                worst: "loss".into(),
                max_abs_err: 0.0,
                max_rel_err: 0.0,
                tolerance: tolerance(step.compute_dtype),
                non_finite: None,
            },
            steps: 0,
        })
    }

    /// Runs the reference step on its state (advanced in place) and compares its loss with
    /// the ranks' `loss`.
    fn step(&mut self, batch: &TensorMap, loss: f64) -> Result<(), Error> {
        let out = rt::run(self.graph, &self.state, batch, rt::RunOptions::default())?;
        let want = out.scalar("loss")?;
        self.steps += 1;
        let what = format!("loss of step {}", self.steps);
        self.record(&what, &[loss], &[want]);
        for (name, t) in out.outputs {
            if let Some(slot) = self.state.get_mut(&name) {
                *slot = t;
            }
        }
        Ok(())
    }

    /// Folds the comparison of `got` with `want` (the reference) into the report.
    fn record(&mut self, what: &str, got: &[f64], want: &[f64]) {
        let r = &mut self.report;
        let mut abs = 0.0f64;
        let mut scale = 0.0f64;
        for (x, y) in got.iter().zip(want) {
            if !x.is_finite() || !y.is_finite() {
                if r.non_finite.is_none() {
                    let side = if x.is_finite() {
                        "reference"
                    } else {
                        "parallel run"
                    };
                    r.non_finite = Some(format!("{what} in the {side}"));
                    r.worst = what.to_string();
                }
                r.max_abs_err = f64::INFINITY;
                r.max_rel_err = f64::INFINITY;
                return;
            }
            abs = abs.max((x - y).abs());
            scale = scale.max(y.abs());
        }
        if got.len() != want.len() {
            abs = f64::INFINITY;
        }
        r.max_abs_err = r.max_abs_err.max(abs);
        let rel = abs / scale.max(REL_FLOOR);
        if rel > r.max_rel_err {
            r.max_rel_err = rel;
            if r.non_finite.is_none() {
                r.worst = what.to_string();
            }
        }
    }

    /// Compares every state tensor, gathered from the ranks' `states`, with the reference's.
    fn finish(mut self, step: &CompiledStep, states: &[TensorMap]) -> Result<VerifyReport, Error> {
        for t in &step.state.tensors {
            let Some(want) = self.state.get(&t.name) else {
                continue;
            };
            let got = step.state.gather(&t.name, states)?;
            let (got, want) = (got.to_f64_vec(), want.to_f64_vec());
            self.record(&t.name, &got, &want);
        }
        Ok(self.report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> VerifyReport {
        VerifyReport {
            worst: "loss".into(),
            max_abs_err: 0.0,
            max_rel_err: 0.0,
            tolerance: 1e-4,
            non_finite: None,
        }
    }

    fn folded(pairs: &[(&str, &[f64], &[f64])]) -> VerifyReport {
        let g = autopar_ir::Graph::new("empty");
        let mut r = Reference {
            graph: &g,
            state: TensorMap::new(),
            report: fresh(),
            steps: 0,
        };
        for (what, got, want) in pairs {
            r.record(what, got, want);
        }
        r.report
    }

    #[test]
    fn nan_in_either_run_fails() {
        let r = folded(&[("w", &[f64::NAN, 1.0], &[f64::NAN, 1.0])]);
        assert!(!r.ok());
        assert_eq!(r.non_finite.as_deref(), Some("w in the parallel run"));
        assert!(
            r.line()
                .ends_with("FAILED (not finite: w in the parallel run)"),
            "{}",
            r.line()
        );
        let r = folded(&[
            ("a", &[1.0], &[1.0]),
            ("loss of step 2", &[0.5], &[f64::INFINITY]),
        ]);
        assert!(!r.ok());
        assert_eq!(
            r.non_finite.as_deref(),
            Some("loss of step 2 in the reference")
        );
        assert_eq!(r.worst, "loss of step 2");
    }

    #[test]
    fn mixed_criterion() {
        // Relative to max(|reference|, 1): a small tensor is held to the absolute tolerance.
        let r = folded(&[("small", &[1e-6 + 5e-5], &[1e-6])]);
        assert!(r.ok(), "{r:?}");
        // Both errors are held to the tolerance: a large tensor is not excused by its size.
        let r = folded(&[("big", &[1000.0 + 0.05], &[1000.0])]);
        assert!(!r.ok() && r.max_rel_err < 1e-4, "{r:?}");
        let r = folded(&[("off", &[1.0 + 2e-4], &[1.0])]);
        assert!(!r.ok());
        assert_eq!(r.worst, "off");
    }
}
