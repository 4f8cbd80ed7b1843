//! The training-step graph end to end: its structure, gradient accumulation, mixed precision
//! with loss scaling, and activation recompute, run on the reference interpreter.

#![allow(clippy::unwrap_used)]

use autopar_driver::ir::{DType, Op, text, verify};
use autopar_driver::load_train_step;
use autopar_driver::passes::recompute::Recompute;
use autopar_driver::passes::train::{
    GOOD_STEPS, GRAD_NORM, GRADS_FINITE, LOSS_SCALE, LossScaling, LrDecay, LrSchedule,
    LrScheduleError, Optimizer, STEP_COUNT, TrainOptions, TrainStep, adam_m_name, has_tag,
};
use autopar_driver::runtime::{RunOptions, StepReport, Tensor, TensorMap, Trainer};

fn step_graph(model: &str, options: &TrainOptions) -> TrainStep {
    load_train_step(model, None, options).unwrap()
}

/// Runs `steps` steps and returns the reports and the final state.
fn run_steps(step: &TrainStep, steps: u64) -> (Vec<StepReport>, TensorMap) {
    let mut trainer = Trainer::new(&step.graph, 0, RunOptions::default()).unwrap();
    let reports = (0..steps).map(|_| trainer.step().unwrap()).collect();
    (reports, trainer.state().clone())
}

fn losses(model: &str, options: &TrainOptions, steps: u64) -> Vec<f64> {
    let step = step_graph(model, options);
    run_steps(&step, steps).0.iter().map(|r| r.loss).collect()
}

fn scalar(t: &Tensor) -> f64 {
    t.scalar_value().unwrap()
}

#[test]
fn step_graph_is_a_verified_function_of_its_state() {
    let options = TrainOptions {
        micro_batches: 2,
        ..TrainOptions::default()
    };
    let step = step_graph("gpt-tiny", &options);
    let g = &step.graph;
    verify(g).unwrap();
    // The text form round-trips, so the step can be dumped and read back.
    assert!(text::parse(&text::print(g)).unwrap() == *g);
    // Every weight and every optimizer buffer is a parameter with an output of its name.
    for name in step.weights.iter().chain(&step.optimizer_state) {
        assert!(g.output(name).is_some(), "no output for state `{name}`");
    }
    let params: Vec<&str> = g.parameters().iter().map(|(_, n, _)| *n).collect();
    assert_eq!(
        params.len(),
        step.weights.len() + step.optimizer_state.len()
    );
    assert!(step.optimizer_state.contains(&adam_m_name("wte")));
    assert!(step.optimizer_state.contains(&STEP_COUNT.to_string()));
    for name in ["loss", GRAD_NORM] {
        assert!(g.output(name).is_some(), "no `{name}` output");
    }
    // Inputs carry the global batch; both micro-batches have forward and gradient nodes.
    for (v, name, _) in g.inputs() {
        assert_eq!(g.ty(v).dims()[0], 8, "{name}");
    }
    for tag in ["mb0/", "mb1/", "mb0/grad/", "mb1/grad/", "mb1/accumulate/"] {
        let n = g
            .node_ids()
            .into_iter()
            .filter(|&n| {
                g.node(n)
                    .scope
                    .as_deref()
                    .is_some_and(|s| s.starts_with(tag))
            })
            .count();
        assert!(n > 0, "no node tagged `{tag}`");
    }
    // Layers stay findable by path under the gradient tag.
    assert!(
        g.node_ids()
            .into_iter()
            .any(|n| g.node(n).scope.as_deref() == Some("mb0/grad/h.1.mlp"))
    );
}

#[test]
fn mixed_precision_casts_are_explicit() {
    let step = step_graph("gpt-tiny", &TrainOptions::for_dtype(DType::F16));
    let g = &step.graph;
    let casts_to = |dtype| {
        g.node_ids()
            .into_iter()
            .filter(|&n| g.node(n).op == Op::Cast { to: dtype })
            .count()
    };
    // Master weights (f32) are cast to f16 per use site; logits go back to f32.
    assert!(casts_to(DType::F16) >= step.weights.len());
    assert!(casts_to(DType::F32) >= 1);
    for (_, name, ty) in g.parameters() {
        assert_eq!(ty.dtype, DType::F32, "state `{name}` is not fp32");
    }
    for n in g.node_ids() {
        let node = g.node(n);
        if node.op == Op::CrossEntropy {
            assert_eq!(g.ty(node.inputs[0]).dtype, DType::F32);
        }
        if let Op::Einsum { .. } = node.op
            && node
                .scope
                .as_deref()
                .is_some_and(|s| s.starts_with("mb0/h."))
        {
            assert_eq!(g.ty(node.outputs[0]).dtype, DType::F16);
        }
    }
    for name in [LOSS_SCALE, GOOD_STEPS, GRADS_FINITE] {
        assert!(g.output(name).is_some(), "no `{name}` output");
    }
}

/// Stated tolerance: over the first 80 steps of gpt-tiny, the bf16 and f16 losses stay
/// within 0.05 of the f32 loss at every step (measured: within 0.01).
#[test]
fn bf16_and_f16_train_like_f32() {
    let steps = 80;
    let f32_losses = losses("gpt-tiny", &TrainOptions::default(), steps);
    for dtype in [DType::BF16, DType::F16] {
        let mixed = losses("gpt-tiny", &TrainOptions::for_dtype(dtype), steps);
        for (i, (a, b)) in f32_losses.iter().zip(&mixed).enumerate() {
            assert!(
                (a - b).abs() <= 0.05,
                "{dtype} step {i}: loss {b} vs f32 {a}"
            );
        }
        assert!(mixed[steps as usize - 1] < 1.5, "{dtype}: {mixed:?}");
    }
}

#[test]
fn f16_overflow_skips_the_step_and_backs_off_the_scale() {
    let initial_scale = 2f64.powi(40);
    let options = TrainOptions {
        loss_scaling: Some(LossScaling {
            initial_scale,
            growth_interval: 3,
            ..LossScaling::default()
        }),
        ..TrainOptions::for_dtype(DType::F16)
    };
    let step = step_graph("gpt-tiny", &options);
    let mut trainer = Trainer::new(&step.graph, 0, RunOptions::default()).unwrap();
    let initial = trainer.state().clone();

    // 2^40 times the loss gradient overflows f16: the step is skipped.
    let report = trainer.step().unwrap();
    assert_eq!(report.scalar(GRADS_FINITE).unwrap(), 0.0);
    for name in &step.weights {
        assert_eq!(
            trainer.state()[name],
            initial[name],
            "`{name}` changed in a skipped step"
        );
    }
    assert_eq!(
        trainer.state()[&adam_m_name("wte")],
        initial[&adam_m_name("wte")]
    );
    assert_eq!(scalar(&trainer.state()[STEP_COUNT]), 0.0);
    assert_eq!(scalar(&trainer.state()[LOSS_SCALE]), 0.5);

    // The scale halves until the gradients fit, then updates resume.
    let mut skipped = 1;
    while trainer.step().unwrap().scalar(GRADS_FINITE).unwrap() == 0.0 {
        skipped += 1;
        assert!(skipped < 40, "the scale never recovered");
    }
    let scale = scalar(&trainer.state()[LOSS_SCALE]);
    assert_eq!(scale, 0.5f64.powi(skipped));
    assert_eq!(scalar(&trainer.state()[STEP_COUNT]), 1.0);
    assert_ne!(trainer.state()["wte"], initial["wte"]);
    // The third finite step in a row (`growth_interval`) doubles the scale.
    let mut in_a_row = 1;
    for _ in 0..40 {
        let before = scalar(&trainer.state()[LOSS_SCALE]);
        if trainer.step().unwrap().scalar(GRADS_FINITE).unwrap() == 0.0 {
            in_a_row = 0;
            continue;
        }
        in_a_row += 1;
        let after = scalar(&trainer.state()[LOSS_SCALE]);
        if in_a_row == 3 {
            assert_eq!(after, 2.0 * before);
            return;
        }
        assert_eq!(after, before);
    }
    panic!("no three finite steps in a row");
}

/// Four micro-batches of 2 sequences update the weights as one batch of 8 does, to f32
/// rounding. SGD is linear in the gradient: over two steps the weights agree to 1e-7.
/// AdamW's moments agree to f32 rounding of the summed gradients too, but its update `lr * g / (|g| + eps)` turns
/// the rounding of a gradient that cancels to about `eps` (1e-8) into a visible difference
/// (measured: 1.2e-5 on one `wte` element whose gradient is 0.85e-8), so AdamW weights are
/// compared to 2e-5 after one step.
#[test]
fn four_micro_batches_equal_one_full_batch() {
    for (optimizer, steps) in [(Optimizer::sgd(0.1), 2), (Optimizer::default(), 1)] {
        let base = TrainOptions {
            optimizer,
            ..TrainOptions::default()
        };
        let accumulated = TrainOptions {
            micro_batches: 4,
            ..base.clone()
        };
        let (full_reports, full) = run_steps(&step_graph("gpt-tiny", &base), steps);
        let (acc_reports, acc) = run_steps(&step_graph("gpt-tiny", &accumulated), steps);
        for (a, b) in full_reports.iter().zip(&acc_reports) {
            assert!((a.loss - b.loss).abs() <= 1e-6, "{} vs {}", a.loss, b.loss);
            let (na, nb) = (a.scalar(GRAD_NORM).unwrap(), b.scalar(GRAD_NORM).unwrap());
            assert!((na - nb).abs() <= 1e-6 * na, "grad norm {na} vs {nb}");
        }
        assert_eq!(
            full.keys().collect::<Vec<_>>(),
            acc.keys().collect::<Vec<_>>()
        );
        for (name, t) in &full {
            let ok = match optimizer {
                Optimizer::Sgd { .. } => t.max_abs_diff(&acc[name]).unwrap() <= 1e-7,
                // Moments: to 1e-5 of the largest element (f32 rounding of sums that cancel).
                Optimizer::AdamW { .. } if name.contains(':') => {
                    let largest = t.to_f64_vec().iter().fold(0f64, |m, x| m.max(x.abs()));
                    t.max_abs_diff(&acc[name]).unwrap() <= 1e-5 * largest
                }
                Optimizer::AdamW { .. } => t.max_abs_diff(&acc[name]).unwrap() <= 2e-5,
            };
            assert!(
                ok,
                "{optimizer:?}: `{name}` differs by {:?}",
                t.max_abs_diff(&acc[name])
            );
        }
    }
}

/// With plain SGD (lr 1, no momentum) the update is minus the clipped gradient, so its global
/// norm is the clipping norm whenever the gradient norm exceeds it.
#[test]
fn gradients_are_clipped_to_the_global_norm() {
    let clip = 0.01;
    let options = TrainOptions {
        optimizer: Optimizer::Sgd {
            lr: 1.0,
            momentum: 0.0,
            weight_decay: 0.0,
        },
        clip_norm: Some(clip),
        ..TrainOptions::default()
    };
    let step = step_graph("mlp-tiny", &options);
    let mut trainer = Trainer::new(&step.graph, 0, RunOptions::default()).unwrap();
    let before = trainer.state().clone();
    let report = trainer.step().unwrap();
    assert!(report.scalar(GRAD_NORM).unwrap() > clip);
    let mut sum_sq = 0.0;
    for name in &step.weights {
        let (old, new) = (
            before[name].to_f64_vec(),
            trainer.state()[name].to_f64_vec(),
        );
        sum_sq += old
            .iter()
            .zip(&new)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>();
    }
    assert!(
        (sum_sq.sqrt() - clip).abs() < 1e-6,
        "update norm {}",
        sum_sq.sqrt()
    );
}

#[test]
fn micro_batches_must_divide_the_batch() {
    let options = TrainOptions {
        micro_batches: 3,
        ..TrainOptions::default()
    };
    let err = load_train_step("gpt-tiny", None, &options).unwrap_err();
    assert!(
        err.to_string().contains("must divide the batch size 8"),
        "{err}"
    );
}

/// Recompute gives bit-identical losses and state, and a lower peak: full < selective < none.
#[test]
fn recompute_is_exact_and_saves_memory() {
    for (model, micro_batches) in [("gpt-tiny", 1), ("llama-tiny", 2), ("moe-tiny", 1)] {
        let run = |recompute| {
            let options = TrainOptions {
                recompute,
                micro_batches,
                ..TrainOptions::default()
            };
            let step = step_graph(model, &options);
            let g = &step.graph;
            let tagged = |tag| {
                g.node_ids()
                    .into_iter()
                    .any(|n| has_tag(g.node(n).scope.as_deref(), tag))
            };
            match recompute {
                Recompute::None => assert!(!tagged("recompute/") && tagged("saved/")),
                Recompute::Selective | Recompute::Full => {
                    assert!(tagged("recompute/") && !tagged("saved/"));
                }
            }
            verify(g).unwrap();
            let (reports, state) = run_steps(&step, 2);
            let peak = reports.iter().map(|r| r.peak_bytes).max().unwrap();
            let losses: Vec<f64> = reports.iter().map(|r| r.loss).collect();
            (losses, state, peak)
        };
        let (none_losses, none_state, none_peak) = run(Recompute::None);
        let (sel_losses, sel_state, sel_peak) = run(Recompute::Selective);
        let (full_losses, full_state, full_peak) = run(Recompute::Full);
        assert_eq!(none_losses, sel_losses, "{model}");
        assert_eq!(none_losses, full_losses, "{model}");
        assert!(
            none_state == sel_state && none_state == full_state,
            "{model}"
        );
        assert!(
            full_peak < sel_peak && sel_peak < none_peak,
            "{model}: peaks none {none_peak}, selective {sel_peak}, full {full_peak}"
        );
    }
}

/// With plain SGD (no momentum, decay or clipping) an update moves the weights by exactly
/// `lr * factor(t) * |gradient|`: the step graph's schedule, computed from its step count,
/// matches `LrSchedule::factor` through warmup, cosine decay and the flat end, for SGD and
/// AdamW alike (AdamW's own step count drives it).
#[test]
fn lr_schedule_scales_every_update_by_its_factor() {
    for decay in [
        LrDecay::Cosine {
            steps: 8,
            min_ratio: 0.1,
        },
        LrDecay::Linear {
            steps: 7,
            min_ratio: 0.0,
        },
    ] {
        let schedule = LrSchedule { warmup: 3, decay };
        let lr = 0.05;
        let options = TrainOptions {
            optimizer: Optimizer::Sgd {
                lr,
                momentum: 0.0,
                weight_decay: 0.0,
            },
            clip_norm: None,
            lr_schedule: schedule,
            ..TrainOptions::default()
        };
        let step = step_graph("gpt-tiny", &options);
        assert!(step.optimizer_state.contains(&STEP_COUNT.to_string()));
        let mut trainer = Trainer::new(&step.graph, 0, RunOptions::default()).unwrap();
        for t in 1..=10u64 {
            let before = trainer.state().clone();
            let report = trainer.step().unwrap();
            let moved: f64 = step
                .weights
                .iter()
                .map(|w| {
                    let (a, b) = (
                        before[w].floats().unwrap(),
                        trainer.state()[w].floats().unwrap(),
                    );
                    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>()
                })
                .sum::<f64>()
                .sqrt();
            let factor = moved / (lr * report.scalar(GRAD_NORM).unwrap());
            let want = schedule.factor(t);
            assert!(
                (factor - want).abs() < 2e-3 * want.max(0.05),
                "{decay:?} update {t}: factor {factor} vs {want}"
            );
        }
    }
    // AdamW: the same schedule leaves its first update at lr/warmup of the unscheduled one.
    let adamw = |lr_schedule| TrainOptions {
        lr_schedule,
        clip_norm: None,
        ..TrainOptions::default()
    };
    let moved = |options: &TrainOptions| {
        let step = step_graph("gpt-tiny", options);
        let mut trainer = Trainer::new(&step.graph, 0, RunOptions::default()).unwrap();
        let before = trainer.state().clone();
        trainer.step().unwrap();
        let (a, b) = (
            before["wte"].floats().unwrap().to_vec(),
            trainer.state()["wte"].floats().unwrap().to_vec(),
        );
        a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f64>()
    };
    let warm = LrSchedule {
        warmup: 4,
        decay: LrDecay::Constant,
    };
    let ratio = moved(&adamw(warm)) / moved(&adamw(LrSchedule::default()));
    assert!((ratio - 0.25).abs() < 0.02, "{ratio}");
}

#[test]
fn lr_schedules_are_checked() {
    let bad = LrSchedule {
        warmup: 10,
        decay: LrDecay::Cosine {
            steps: 10,
            min_ratio: 0.1,
        },
    };
    let err = bad.check().unwrap_err();
    assert_eq!(
        err,
        LrScheduleError::DecayEndsInWarmup {
            steps: 10,
            warmup: 10
        }
    );
    assert!(
        err.to_string().contains("must end after the warmup"),
        "{err}"
    );
    let bad = LrSchedule {
        warmup: 0,
        decay: LrDecay::Linear {
            steps: 10,
            min_ratio: 1.5,
        },
    };
    assert_eq!(
        bad.check(),
        Err(LrScheduleError::FinalRatio { min_ratio: 1.5 })
    );
    let cos = LrSchedule {
        warmup: 2,
        decay: LrDecay::Cosine {
            steps: 12,
            min_ratio: 0.1,
        },
    };
    assert_eq!(cos.factor(1), 0.5);
    assert_eq!(cos.factor(2), 1.0);
    assert!((cos.factor(7) - 0.55).abs() < 1e-12);
    assert!((cos.factor(12) - 0.1).abs() < 1e-12 && (cos.factor(100) - 0.1).abs() < 1e-12);
}
