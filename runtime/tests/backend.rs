//! The [`Backend`] contract, written once as a function of the backend and instantiated for
//! each (the CPU interpreter today): a loaded program run against uploaded parameters and
//! inputs gives the reference interpreter's outputs, and the peak its plan predicted; a
//! program loaded once runs many times; and a bad feed is named.

use autopar_runtime::{
    Backend, CpuBackend, ExecutionPlan, RunOptions, RuntimeError, SingleDevice, Tensor, TensorMap,
    init_parameters, run, synthetic_batch,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn upload<B: Backend>(
    backend: &B,
    tensors: &TensorMap,
) -> Result<std::collections::BTreeMap<String, B::Buffer>, RuntimeError> {
    tensors
        .iter()
        .map(|(name, t)| Ok((name.clone(), backend.upload(t)?)))
        .collect()
}

/// Runs the forward graph of `model` on `backend` and compares with the reference
/// interpreter within `tol` (0 for the interpreter itself).
fn matches_the_reference<B: Backend>(backend: &B, model: &str, tol: f64) -> TestResult {
    let g = autopar_frontends::zoo::build(model, 2)?;
    let params = init_parameters(&g, 0)?;
    let plan = ExecutionPlan::new(&g)?;
    let peak = plan.peak_bytes();
    let executable = backend.load(&g, plan)?;
    let p = upload(backend, &params)?;
    for step in 0..2 {
        let batch = synthetic_batch(&g, 0, step)?;
        let inputs = upload(backend, &batch)?;
        let out = backend.execute(&executable, &p, &inputs, &mut SingleDevice)?;
        let want = run(&g, &params, &batch, RunOptions::default())?;
        assert_eq!(out.peak_bytes, peak, "{model}");
        assert_eq!(out.outputs.len(), want.outputs.len());
        for (name, buffer) in &out.outputs {
            let got: Tensor = backend.download(buffer)?;
            let want = want.output(name)?;
            assert_eq!(got.ty(), want.ty(), "{model} {name}");
            let err = got
                .to_f64_vec()
                .iter()
                .zip(want.to_f64_vec())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(err <= tol, "{model} {name}: {err}");
        }
    }
    Ok(())
}

fn a_missing_feed_is_named<B: Backend>(backend: &B) -> TestResult {
    let g = autopar_frontends::zoo::build("mlp-tiny", 2)?;
    let executable = backend.load(&g, ExecutionPlan::new(&g)?)?;
    let none = std::collections::BTreeMap::new();
    let err = backend
        .execute(&executable, &none, &none, &mut SingleDevice)
        .err()
        .ok_or("ran without its parameters")?;
    assert!(matches!(err, RuntimeError::Missing { .. }), "{err}");
    Ok(())
}

/// Instantiates the contract for one backend.
macro_rules! backend_tests {
    ($name:ident, $backend:expr, $tol:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn runs_every_tiny_model_as_the_reference_does() -> TestResult {
                for model in ["mlp-tiny", "gpt-tiny", "llama-tiny", "moe-tiny"] {
                    matches_the_reference(&$backend, model, $tol)?;
                }
                Ok(())
            }

            #[test]
            fn names_a_missing_feed() -> TestResult {
                a_missing_feed_is_named(&$backend)
            }
        }
    };
}

backend_tests!(cpu, CpuBackend::default(), 0.0);
