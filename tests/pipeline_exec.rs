//! Pipelined training steps against the single-device step, executor memory and in-flight
//! counts, and FLOP-balanced stage boundaries.

use autopar_driver::ir::schedule::ScheduleKind;
use autopar_driver::passes::pipeline::{StageSplit, equal_split, plan_stages};
use autopar_driver::{
    CompileOptions, CompiledStep, PipelineSpec, RunOptions, RunReport, TrainOptions, TrainStep,
    compile, load_train_step, run,
};

const SMALL: &str = "gpt:layers=4,hidden=32,heads=2,seq=8,vocab=64";

fn step(model: &str, batch: usize, micro_batches: usize) -> TrainStep {
    let options = TrainOptions {
        micro_batches,
        ..TrainOptions::default()
    };
    load_train_step(model, Some(batch), &options).expect("step builds")
}

/// `model` compiled for a pipeline of `pp` ranks under `schedule` with `vpp` chunks each.
fn pipeline(
    model: &str,
    batch: usize,
    micro_batches: usize,
    (schedule, pp, vpp): (ScheduleKind, usize, usize),
) -> CompiledStep {
    let mut o = CompileOptions::new(model)
        .on_mesh(&format!("pp={pp}"))
        .expect("a mesh");
    o.batch = Some(batch);
    o.train.micro_batches = micro_batches;
    o.pipeline = PipelineSpec {
        schedule,
        vpp,
        boundaries: Vec::new(),
    };
    compile(&o).expect("compiles")
}

fn run_steps(step: &CompiledStep, seed: u64, steps: u64, verify: bool) -> RunReport {
    let o = RunOptions {
        seed,
        steps,
        verify,
        first_step: 0,
        ..RunOptions::default()
    };
    run(step, &o, |_| {}).expect("runs")
}

fn stages(s: &TrainStep, n: usize, pins: &[String]) -> Result<StageSplit, autopar_driver::Error> {
    Ok(plan_stages(&s.graph, n, pins)?)
}

#[test]
fn every_schedule_matches_the_single_device_step() {
    for (kind, pp, vpp) in [
        (ScheduleKind::GPipe, 2, 1),
        (ScheduleKind::OneFOneB, 2, 1),
        (ScheduleKind::OneFOneB, 4, 1),
        (ScheduleKind::Interleaved, 2, 2),
    ] {
        let compiled = pipeline(SMALL, 4, 4, (kind, pp, vpp));
        // One step, then several: each rank carries its weights and optimizer state on.
        for steps in [1, 3] {
            let report = run_steps(&compiled, 3, steps, true);
            let v = report.verify.expect("verified");
            assert!(
                v.ok(),
                "{kind} pp={pp} vpp={vpp}, {steps} steps: {}",
                v.line()
            );
        }
    }
}

#[test]
fn one_f_one_b_holds_about_half_of_gpipes_activations_on_stage_0() {
    let mut peaks = Vec::new();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let compiled = pipeline(SMALL, 8, 8, (kind, 4, 1));
        let run = run_steps(&compiled, 0, 1, false);
        let last = &run.pipeline_reports[0];
        for (r, rank) in last.ranks.iter().enumerate() {
            let expected = match kind {
                ScheduleKind::GPipe => 8,
                _ => 4 - r,
            };
            assert_eq!(rank.max_in_flight, expected, "{kind} rank {r}");
        }
        peaks.push(last.ranks[0].peak_activation_bytes);
    }
    let (gpipe, one_f_one_b) = (peaks[0] as f64, peaks[1] as f64);
    assert!(
        one_f_one_b <= 0.55 * gpipe,
        "1f1b {one_f_one_b} vs gpipe {gpipe}"
    );
}

#[test]
fn a_heavy_vocabulary_moves_the_boundary_and_pins_are_kept() {
    let s = step("gpt:layers=4,hidden=32,heads=2,seq=8,vocab=4096", 2, 1);
    let balanced = stages(&s, 2, &[]).expect("balances");
    let equal = equal_split(balanced.layers.len(), 2);
    assert_ne!(balanced.starts, equal);
    // The head stage is the costliest, and the balanced cut makes it no worse than equal.
    let max = |starts: &[usize]| {
        let sp = autopar_driver::passes::pipeline::StageSplit {
            layers: balanced.layers.clone(),
            starts: starts.to_vec(),
        };
        (0..2).map(|i| sp.stage_flops(i)).fold(0.0, f64::max)
    };
    assert!(max(&balanced.starts) < max(&equal));
    let pinned = stages(&s, 2, &["h.2".to_string()]).expect("pins");
    let h2 = pinned.layers.iter().position(|l| l.name == "h.2");
    assert_eq!(Some(pinned.starts[1]), h2);
    assert!(stages(&s, 2, &["nope".to_string()]).is_err());
}
