//! The conformance suite (`conformance/collectives.rs` and `conformance/failures.rs`) over MPI
//! processes: every check, run with [`MpiLauncher`] in a world of 8 processes (each launch
//! uses the first `n` of them for a mesh of `n` ranks), through the `Tensor` methods and
//! through the `f32` ones (the trait's defaults, which MPI keeps).
//!
//! Run as a test, the binary starts itself again under `mpirun -np 8` and passes when every
//! process does; under `mpirun` it runs the checks one after another, in the same order in
//! every process (a launch is collective over all of them), and reports each process's
//! failures with its rank.

#[path = "conformance/collectives.rs"]
mod collectives;
#[path = "conformance/f32_path.rs"]
mod f32_path;
#[path = "conformance/failures.rs"]
mod failures;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use autopar_runtime::comm::mpi::{finalize, started_by_mpirun, world_rank_and_size};
use autopar_runtime::{CommOptions, MpiLauncher};

/// Processes of the world: enough for the largest mesh of the suite (2x2x2).
const WORLD: usize = 8;
/// The whole suite must finish within this (a divergent process would otherwise leave the
/// others waiting in a launch).
const LIMIT: Duration = Duration::from_secs(300);

fn main() -> ExitCode {
    if started_by_mpirun() {
        run_suite()
    } else {
        run_under_mpirun()
    }
}

fn run_under_mpirun() -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("cannot find this test binary: {e}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(WORLD.to_string())
        .arg(&exe)
        .stdin(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot start mpirun (install Open MPI: openmpi-bin): {e}");
            return ExitCode::FAILURE;
        }
    };
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => {
                println!(
                    "comm_mpi: every check passed on {WORLD} MPI processes in {:.1?}",
                    started.elapsed()
                );
                return ExitCode::SUCCESS;
            }
            Ok(Some(status)) => {
                eprintln!("comm_mpi: mpirun ended with {status}");
                return ExitCode::FAILURE;
            }
            Ok(None) if started.elapsed() > LIMIT => {
                // SIGTERM lets mpirun take its processes down with it.
                let _ = Command::new("kill").arg(child.id().to_string()).status();
                let _ = child.wait();
                eprintln!("comm_mpi: the suite did not finish within {LIMIT:?}");
                return ExitCode::FAILURE;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => {
                eprintln!("comm_mpi: cannot wait for mpirun: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
}

fn run_suite() -> ExitCode {
    let (rank, size) = match world_rank_and_size() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("comm_mpi: {e}");
            return ExitCode::FAILURE;
        }
    };
    if size != WORLD {
        eprintln!("comm_mpi: needs {WORLD} MPI processes, got {size}");
        return ExitCode::FAILURE;
    }
    let make = |options: CommOptions| MpiLauncher::new(options).idle_extra_ranks();
    let mut failed = 0;
    let mut run =
        |suite: &str, name: &str, case: &dyn Fn() -> Result<(), Box<dyn std::error::Error>>| {
            let start = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(case));
            let verdict = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("panicked (see above)".to_string()),
            };
            match verdict {
                None if rank == 0 => println!("{suite}::{name} ... ok ({:.2?})", start.elapsed()),
                None => {}
                Some(why) => {
                    failed += 1;
                    eprintln!("{suite}::{name} ... FAILED on process {rank}: {why}");
                }
            }
        };
    for (name, case) in collectives::cases() {
        run("collectives", name, &|| case(&make));
    }
    for (name, case) in failures::cases() {
        run("failures", name, &|| case(&make));
    }
    let make_f32 = |options: CommOptions| f32_path::F32Launcher {
        inner: make(options),
        defaults: false,
    };
    for (name, case) in collectives::cases() {
        run("collectives_f32", name, &|| case(&make_f32));
    }
    for (name, case) in failures::cases() {
        run("failures_f32", name, &|| case(&make_f32));
    }
    finalize();
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
