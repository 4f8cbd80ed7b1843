//! The driver's run contract: refusals that name what is missing instead of comparing with
//! the wrong graph or running on the wrong machinery.

use autopar_driver::{CompileOptions, Error, RunOptions, compile, run};

fn verify() -> RunOptions {
    RunOptions {
        verify: true,
        ..RunOptions::default()
    }
}

#[test]
fn verify_needs_the_original_step_of_a_laid_out_model() -> Result<(), Error> {
    let mut options = CompileOptions::new("llama-tiny").on_mesh("cp=2")?;
    options.reference = false;
    let step = compile(&options)?;
    assert!(step.reference.is_none());
    let err = run(&step, &verify(), |_| {}).expect_err("no reference to compare with");
    assert!(
        err.to_string().contains("CompileOptions::reference"),
        "{err}"
    );
    // Asked for, the original step is there and the run verifies.
    options.reference = true;
    let report = run(&compile(&options)?, &verify(), |_| {})?;
    assert!(report.verify.is_some_and(|v| v.ok()));
    Ok(())
}

#[test]
fn a_step_stopped_before_partitioning_does_not_run() -> Result<(), Error> {
    let mut options = CompileOptions::new("gpt-tiny").on_mesh("dp=2")?;
    options.stop_after = Some(autopar_driver::Pass::Parallelize);
    let step = compile(&options)?;
    assert!(step.locals.is_empty() && step.plans.is_empty());
    let err = run(&step, &RunOptions::default(), |_| {}).expect_err("no programs");
    assert!(err.to_string().contains("stop_after"), "{err}");
    Ok(())
}

#[test]
fn every_pass_can_end_the_compilation() -> Result<(), Error> {
    use autopar_driver::Pass;
    for (i, last) in Pass::ALL.into_iter().enumerate() {
        let mut options = CompileOptions::new("llama-tiny").on_mesh("cp=2,pp=2")?;
        options.train.micro_batches = 2;
        options.stop_after = Some(last);
        let step = compile(&options)?;
        // Exactly the passes up to `last` ran (this mesh needs every one of them).
        let ran: Vec<Pass> = step.timings.iter().map(|t| t.pass).collect();
        assert_eq!(ran, Pass::ALL[..=i], "stopped after {last}");
        assert_eq!(step.is_training(), last >= Pass::TrainStep, "{last}");
    }
    Ok(())
}
