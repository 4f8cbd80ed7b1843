//! The fast CPU backend against the reference interpreter on whole training steps of the
//! zoo's tiny models: one step's every output (next parameters and optimizer state, loss),
//! with f64 and with f32 accumulation against the reference accumulating alike, and runs of
//! several steps through the driver with `--verify` on single devices, SPMD meshes and
//! pipelines, in f32 and bf16.

use std::collections::BTreeMap;

use autopar_driver::ir::DType;
use autopar_driver::{CompileOptions, Error, RunHooks, RunOptions, compile, run_on};
use autopar_runtime::{
    self as rt, Accumulation, Backend, FastCpuBackend, FastTensor, SingleDevice, TensorMap,
    ThreadLauncher,
};

/// The largest difference of every output of one step of `model`'s single-device training
/// step between the fast backend (with `threads`, its f32 products accumulated as
/// `accumulation` says) and the interpreter accumulating alike, and the magnitude of the
/// reference output, by output name.
fn one_step(
    model: &str,
    threads: usize,
    accumulation: Accumulation,
) -> Result<BTreeMap<String, (f64, f64)>, Error> {
    let step = compile(&CompileOptions::new(model))?;
    let graph = &step.locals[0];
    let state = step.state.init_rank(0, 7)?;
    let batch = rt::synthetic_batch(&step.global, 7, 0)?;
    let options = rt::RunOptions {
        accumulation,
        ..rt::RunOptions::default()
    };
    let want = rt::run(graph, &state, &batch, options)?;
    let backend =
        FastCpuBackend::new(threads, 1)?.with_wide_accumulation(accumulation == Accumulation::Wide);
    let exe = backend.load(graph, rt::ExecutionPlan::new(graph)?)?;
    let up = |m: &TensorMap| -> Result<BTreeMap<String, FastTensor>, rt::RuntimeError> {
        m.iter()
            .map(|(k, t)| Ok((k.clone(), backend.upload(t)?)))
            .collect()
    };
    let (params, inputs) = (up(&state)?, up(&batch)?);
    // Twice: the second run reuses the first one's buffers.
    for _ in 0..2 {
        backend.execute(&exe, &params, &inputs, &mut SingleDevice)?;
    }
    let got = backend.execute(&exe, &params, &inputs, &mut SingleDevice)?;
    let mut diffs = BTreeMap::new();
    for (name, w) in &want.outputs {
        let g = backend.download(&got.outputs[name])?;
        let d = g.max_abs_diff(w).unwrap_or(f64::INFINITY);
        let scale = w.to_f64_vec().iter().fold(0.0f64, |a, &x| a.max(x.abs()));
        diffs.insert(name.clone(), (d, scale));
    }
    Ok(diffs)
}

#[test]
fn one_step_matches_the_interpreter() -> Result<(), Error> {
    for model in ["gpt-tiny", "llama-tiny", "moe-tiny"] {
        for (threads, acc) in [1, 2].into_iter().flat_map(|t| {
            [Accumulation::Wide, Accumulation::F32]
                .into_iter()
                .map(move |a| (t, a))
        }) {
            let diffs = one_step(model, threads, acc)?;
            for (name, (d, scale)) in &diffs {
                eprintln!("{model} x{threads} {acc:?} {name}: {d:.3e} of {scale:.3e}");
                // Adam's first moments are a tenth of the gradients: they show gradient
                // errors unscaled by the normalised update.
                let bound = if name.starts_with("adam_m") || name.starts_with("adam_v") {
                    1e-6 * scale.max(1e-3)
                } else {
                    1e-4
                };
                assert!(
                    *d <= bound,
                    "{model} x{threads} {acc:?}: `{name}` differs by {d:e} (scale {scale:e})"
                );
            }
        }
    }
    Ok(())
}

/// Runs `steps` steps of `model` on `mesh` on the fast backend (f32 accumulation, its
/// default) with `--verify`, which for f32 compute measures the noise floor.
fn verified(model: &str, mesh: &str, micro_batches: usize, dtype: DType) -> Result<(), Error> {
    let mut options = CompileOptions::new(model).on_mesh(mesh)?;
    options.train.micro_batches = micro_batches;
    options.train.compute_dtype = dtype;
    let step = compile(&options)?;
    let run = RunOptions {
        steps: 3,
        verify: true,
        accumulation: Accumulation::F32,
        ..RunOptions::default()
    };
    let ranks = step.mesh.num_devices();
    let backend = FastCpuBackend::new(1, ranks)?;
    let report = run_on(
        &step,
        &ThreadLauncher::default(),
        &backend,
        &run,
        RunHooks::default(),
        |_| {},
    )?;
    let v = report.verify.expect("verified");
    assert!(v.ok(), "{model} on {mesh} ({dtype}): {v:?}");
    // Only f32 compute has an f32-accumulation noise floor to measure.
    assert_eq!(v.noise_floor.is_some(), dtype == DType::F32, "{v:?}");
    assert_eq!(report.losses.len(), 3);
    Ok(())
}

#[test]
fn training_runs_verify_on_meshes_and_pipelines() -> Result<(), Error> {
    for model in ["gpt-tiny", "llama-tiny", "moe-tiny"] {
        for dtype in [DType::F32, DType::BF16] {
            verified(model, "dp=1", 1, dtype)?;
            verified(model, "dp=2,tp=2", 1, dtype)?;
            verified(model, "pp=2", 2, dtype)?;
        }
    }
    Ok(())
}
