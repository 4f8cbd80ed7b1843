//! Pipelined training steps against the single-device step, executor memory and in-flight
//! counts, and FLOP-balanced stage boundaries.

use autopar::ir::schedule::ScheduleKind;
use autopar::passes::pipeline::equal_split;
use autopar::pipeline_cmd::{compare_with_reference, run_steps, split, stages};
use autopar::{TrainOptions, TrainStep, load_train_step};

const SMALL: &str = "gpt:layers=4,hidden=32,heads=2,seq=8,vocab=64";

fn step(model: &str, batch: usize, micro_batches: usize) -> TrainStep {
    let options = TrainOptions {
        micro_batches,
        ..TrainOptions::default()
    };
    load_train_step(model, Some(batch), &options).expect("step builds")
}

#[test]
fn every_schedule_matches_the_single_device_step() {
    let s = step(SMALL, 4, 4);
    for (kind, pp, vpp) in [
        (ScheduleKind::GPipe, 2, 1),
        (ScheduleKind::OneFOneB, 2, 1),
        (ScheduleKind::OneFOneB, 4, 1),
        (ScheduleKind::Interleaved, 2, 2),
    ] {
        let sp = split(&s, pp, kind, vpp, &[]).expect("splits");
        let run = run_steps(&s, &sp, 3, 1).expect("runs");
        let (abs, _) = compare_with_reference(&s, 3, 1, &run.last.outputs).expect("compares");
        assert!(abs < 1e-4, "{kind} pp={pp} vpp={vpp}: max abs error {abs}");
        // Several steps: each rank carries its weights and optimizer state to the next step.
        let run = run_steps(&s, &sp, 3, 3).expect("runs three steps");
        let (abs, _) = compare_with_reference(&s, 3, 3, &run.last.outputs).expect("compares");
        assert!(
            abs < 1e-4,
            "{kind} pp={pp} vpp={vpp}, 3 steps: max abs error {abs}"
        );
    }
}

#[test]
fn one_f_one_b_holds_about_half_of_gpipes_activations_on_stage_0() {
    let s = step(SMALL, 8, 8);
    let mut peaks = Vec::new();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let sp = split(&s, 4, kind, 1, &[]).expect("splits");
        let run = run_steps(&s, &sp, 0, 1).expect("runs");
        for (r, rank) in run.last.ranks.iter().enumerate() {
            let expected = match kind {
                ScheduleKind::GPipe => 8,
                _ => 4 - r,
            };
            assert_eq!(rank.max_in_flight, expected, "{kind} rank {r}");
        }
        peaks.push(run.last.ranks[0].peak_activation_bytes);
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
        let sp = autopar::passes::pipeline::StageSplit {
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
