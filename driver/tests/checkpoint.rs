//! Checkpoints across plans: a run saved at step 2 and resumed on the same plan continues
//! bit for bit; resumed on another mesh, layout or ZeRO stage it continues within the
//! `--verify` tolerance of the uninterrupted run.

use std::path::{Path, PathBuf};

use autopar_driver::checkpoint::{self, Checkpoint, PlanRecord, SaveInfo, SaveOptions};
use autopar_driver::runtime::verify::Comparison;
use autopar_driver::{
    CompileOptions, CompiledStep, Error, RunHooks, RunOptions, SaveHook, Tensor, TensorMap,
    Tolerance, compile, run_with,
};

/// A scratch directory of this test process, empty.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("autopar-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A plan: the model, a mesh (`None`: one device), ZeRO stage and micro-batches.
#[derive(Clone, Copy)]
struct Plan<'a> {
    model: &'a str,
    mesh: Option<&'a str>,
    zero: u8,
    micro_batches: usize,
}

impl<'a> Plan<'a> {
    fn new(model: &'a str, mesh: Option<&'a str>) -> Self {
        Plan {
            model,
            mesh,
            zero: 0,
            micro_batches: 1,
        }
    }

    fn zero(self, zero: u8) -> Self {
        Plan { zero, ..self }
    }

    fn micro_batches(self, micro_batches: usize) -> Self {
        Plan {
            micro_batches,
            ..self
        }
    }

    fn compile(&self) -> Result<CompiledStep, Error> {
        let mut o = CompileOptions::new(self.model);
        if let Some(mesh) = self.mesh {
            o = o.on_mesh(mesh)?;
        }
        o.parallel.zero = self.zero;
        o.train.micro_batches = self.micro_batches;
        compile(&o)
    }
}

/// What a run ended with.
struct Trained {
    step: CompiledStep,
    losses: Vec<f64>,
    /// Every state tensor after the last step, gathered to its global shape.
    state: TensorMap,
}

/// Trains `plan` for steps `first..last` from `initial` (drawn from seed 0 when `None`),
/// saving under `root` every `every` steps when given.
fn train(
    plan: Plan<'_>,
    first: u64,
    last: u64,
    initial: Option<&Checkpoint>,
    save: Option<(&Path, u64)>,
) -> Result<Trained, Error> {
    let step = plan.compile()?;
    let loaded = initial.map(|c| c.load(&step.state)).transpose()?;
    let start = loaded
        .as_ref()
        .map(|states| move |rank: usize| Ok(states[rank].clone()));
    let mut last_states = Vec::new();
    let mut on_save = |done: u64, states: &[TensorMap]| -> Result<(), Error> {
        if let Some((root, _)) = save {
            let info = SaveInfo {
                step: done,
                seed: 0,
                model: plan.model.into(),
                plan: PlanRecord {
                    mesh: plan.mesh.map(str::to_string),
                    ranks: step.mesh.num_devices(),
                    options: format!("zero={}", plan.zero),
                },
                initial_loss_scale: None,
            };
            checkpoint::save(root, &step.state, states, &info, &SaveOptions::default())?;
        }
        if done == last {
            last_states = states.to_vec();
        }
        Ok(())
    };
    let hooks = RunHooks {
        initial_state: start.as_ref().map(|f| f as &autopar_driver::StateFn<'_>),
        batch: None,
        save: Some(SaveHook {
            every: save.map_or(u64::MAX, |(_, every)| every),
            save: &mut on_save,
        }),
    };
    let options = RunOptions {
        seed: 0,
        steps: last - first,
        verify: false,
        first_step: first,
        ..RunOptions::default()
    };
    let report = run_with(&step, &options, hooks, |_| {})?;
    let state = step
        .state
        .tensors
        .iter()
        .map(|t| Ok((t.name.clone(), step.state.gather(&t.name, &last_states)?)))
        .collect::<Result<_, Error>>()?;
    Ok(Trained {
        step,
        losses: report.losses,
        state,
    })
}

/// Within the `--verify` tolerance of `want`: losses and every state tensor.
fn assert_close(label: &str, got: &Trained, want: &Trained, from: usize) -> Result<(), Error> {
    let mut c = Comparison::new(Tolerance::for_compute(got.step.compute_dtype));
    assert_eq!(got.losses.len(), want.losses.len() - from, "{label}");
    for (a, b) in got.losses.iter().zip(&want.losses[from..]) {
        c.loss(*a, *b);
    }
    for (name, t) in &want.state {
        let g: &Tensor = got.state.get(name).expect("the same state tensors");
        c.tensor(name, g, t)?;
    }
    let report = c.finish();
    assert!(report.ok(), "{label}: {}", report.line());
    Ok(())
}

#[test]
fn gpt_tiny_resumes_bit_for_bit_on_its_plan_and_closely_on_others() -> Result<(), Error> {
    let root = scratch("gpt");
    let saved = Plan::new("gpt-tiny", Some("dp=2,tp=2")).zero(1);
    let full = train(saved, 0, 4, None, Some((&root, 2)))?;
    let listed: Vec<u64> = checkpoint::list(&root)?.iter().map(|(s, _)| *s).collect();
    assert_eq!(listed, [2, 4]);
    let at2 = Checkpoint::open(&root.join(checkpoint::step_dir_name(2)))?;
    assert_eq!((at2.index.step, at2.index.data_position), (2, 2));

    // The same plan: bit for bit.
    let same = train(saved, 2, 4, Some(&at2), None)?;
    assert_eq!(same.losses, full.losses[2..]);
    assert_eq!(same.state, full.state);

    // Other meshes, a pipeline with gradient accumulation, one device.
    for plan in [
        Plan::new("gpt-tiny", Some("tp=4")),
        Plan::new("gpt-tiny", Some("pp=2")).micro_batches(2),
        Plan::new("gpt-tiny", None),
    ] {
        let resumed = train(plan, 2, 4, Some(&at2), None)?;
        assert_close(plan.mesh.unwrap_or("one device"), &resumed, &full, 2)?;
    }
    // The root resolves to its newest checkpoint.
    assert_eq!(Checkpoint::open(&root)?.index.step, 4);
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

#[test]
fn fully_sharded_llama_resumes_on_context_parallel_ranks() -> Result<(), Error> {
    let root = scratch("llama");
    let full = train(
        Plan::new("llama-tiny", Some("dp=2")).zero(3),
        0,
        3,
        None,
        Some((&root, 2)),
    )?;
    let at2 = Checkpoint::open(&root.join(checkpoint::step_dir_name(2)))?;
    // ZeRO-3 shards every weight over dp: each distinct region is written once.
    let wq = at2.tensor_record("h.0.attn.wq").expect("saved");
    assert_eq!(wq.shards.len(), 2);
    let resumed = train(
        Plan::new("llama-tiny", Some("cp=2")),
        2,
        3,
        Some(&at2),
        None,
    )?;
    assert_close("cp=2", &resumed, &full, 2)?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

#[test]
fn expert_parallel_moe_resumes_on_data_parallel_ranks() -> Result<(), Error> {
    let root = scratch("moe");
    let full = train(
        Plan::new("moe-tiny", Some("ep=2")),
        0,
        3,
        None,
        Some((&root, 2)),
    )?;
    let at2 = Checkpoint::open(&root.join(checkpoint::step_dir_name(2)))?;
    let resumed = train(Plan::new("moe-tiny", Some("dp=2")), 2, 3, Some(&at2), None)?;
    assert_close("dp=2", &resumed, &full, 2)?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

#[test]
fn a_checkpoint_of_another_model_or_optimizer_loads_nothing() -> Result<(), Error> {
    let root = scratch("mismatch");
    train(Plan::new("gpt-tiny", None), 0, 1, None, Some((&root, 1)))?;
    let ckpt = Checkpoint::open(&root)?;
    // A wider model: the first tensor whose shape differs is named.
    let wider = Plan::new("gpt:layers=2,hidden=128,heads=4,seq=32,vocab=256", None).compile()?;
    let err = ckpt.load(&wider.state).expect_err("shapes differ");
    assert!(err.to_string().contains("`wte`"), "{err}");
    assert!(err.to_string().contains("index.json"), "{err}");
    // SGD keeps one moment where AdamW keeps two.
    let mut o = CompileOptions::new("gpt-tiny");
    o.train.optimizer = autopar_driver::Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let sgd = compile(&o)?;
    let err = ckpt.load(&sgd.state).expect_err("optimizer state differs");
    assert!(err.to_string().contains("has no tensor"), "{err}");
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

#[test]
fn keep_removes_the_oldest_checkpoints() -> Result<(), Error> {
    let root = scratch("keep");
    let step = Plan::new("gpt-tiny", None).compile()?;
    let states = vec![step.state.init_rank(0, 0)?];
    for s in 1..=4 {
        let info = SaveInfo {
            step: s,
            seed: 0,
            model: "gpt-tiny".into(),
            plan: PlanRecord {
                mesh: None,
                ranks: 1,
                options: String::new(),
            },
            initial_loss_scale: None,
        };
        let options = SaveOptions {
            keep: Some(2),
            crash_after_files: None,
        };
        checkpoint::save(&root, &step.state, &states, &info, &options)?;
    }
    let listed: Vec<u64> = checkpoint::list(&root)?.iter().map(|(s, _)| *s).collect();
    assert_eq!(listed, [3, 4]);
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
