//! The execution plan is made at compile time and is what runs: for every executable zoo
//! model, on one device and on `dp=2,tp=2`, each rank's planned peak of live bytes (known
//! before anything runs) is exactly the peak the executor records, and its arena holds it.

use autopar_driver::frontends::zoo::{self, EntryKind};
use autopar_driver::{CompileOptions, RunOptions, compile, run};

/// The zoo's models small enough to execute (every `*-tiny` preset).
fn tiny_models() -> Vec<&'static str> {
    zoo::entries()
        .iter()
        .filter(|e| e.kind == EntryKind::Preset && e.name.ends_with("-tiny"))
        .map(|e| e.name)
        .collect()
}

#[test]
fn planned_peaks_are_the_recorded_peaks() {
    let models = tiny_models();
    assert!(models.len() >= 4, "{models:?}");
    for model in models {
        for mesh in [None, Some("dp=2,tp=2")] {
            let mut options = CompileOptions::new(model);
            if let Some(m) = mesh {
                options = options.on_mesh(m).expect("a mesh");
            }
            let step = compile(&options).expect("compiles");
            assert_eq!(step.plans.len(), step.locals.len(), "{model} {mesh:?}");
            let report = run(&step, &RunOptions::default(), |_| {}).expect("runs");
            for (rank, (plan, stats)) in step.plans.iter().zip(&report.ranks).enumerate() {
                assert_eq!(
                    plan.peak_bytes(),
                    stats.peak_bytes,
                    "{model} on {mesh:?}, rank {rank}: planned and recorded peaks differ"
                );
                assert!(plan.arena_bytes() >= plan.peak_bytes());
            }
        }
    }
}
