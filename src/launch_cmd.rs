//! Ranks as processes on the command line: `autopar run --launcher mpi` (one rank per
//! process of an `mpirun` job: rank 0 prints, the others keep standard output quiet, and a
//! failing rank ends the whole job after reporting), and `autopar launch -n N -- run ...`,
//! which execs `mpirun` with the flags such a job needs on this autopar.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;

use autopar_driver::{self as driver, BackendKind, Launch, LauncherKind};

/// Set on MPI ranks other than 0: they print nothing on standard output.
static QUIET: AtomicBool = AtomicBool::new(false);

/// How `autopar run` starts its ranks.
#[derive(clap::Args)]
pub struct LauncherArgs {
    /// How the ranks start: threads of this process, or one rank per process of an MPI job
    /// (run under `mpirun -np N`, or through `autopar launch -n N`; N must be the mesh's
    /// device count). Under MPI, rank 0 prints the losses and the report.
    #[arg(long, value_enum, default_value_t = LauncherArg::Threads)]
    pub launcher: LauncherArg,
    /// Seconds a rank waits for any one message of a collective or pipeline transfer before
    /// it reports the rank it waited for and the run fails (a rank that died, diverged or
    /// is stuck ends the run within this).
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    pub collective_timeout: f64,
    /// Run the ranks' programs on the reference interpreter (f64 arithmetic, one thread per
    /// rank) instead of the fast CPU backend (f32 storage, reused buffers, threads inside
    /// ops). `--verify` compares with the reference interpreter either way.
    #[arg(long)]
    pub interpreter: bool,
    /// Threads per rank for the fast backend [default: the available cores divided by the
    /// ranks of this process, at least 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024), conflicts_with = "interpreter")]
    pub threads: Option<u64>,
    /// Sum the fast backend's f32 matrix products in f64 instead of f32 (the default, as
    /// PyTorch's GEMMs do): about half the GEMM throughput, with gradients within rounding of
    /// the reference's. Without it, `--verify` also runs an f32-accumulating reference and
    /// allows for the noise it measures.
    #[arg(long, conflicts_with = "interpreter")]
    pub wide_accumulation: bool,
}

/// The launchers of `--launcher`.
#[derive(Clone, Copy, ValueEnum)]
pub enum LauncherArg {
    /// One thread per rank, in this process.
    Threads,
    /// This process's rank of an MPI job.
    Mpi,
}

impl LauncherArgs {
    /// Whether the ranks are MPI processes.
    pub fn is_mpi(&self) -> bool {
        matches!(self.launcher, LauncherArg::Mpi)
    }

    /// How long a failed MPI rank lets the others report before it ends the job: the
    /// collective timeout (by then every rank still alive has timed out or learnt of the
    /// failure), at most 10 s.
    pub fn grace(&self) -> Duration {
        let t = self.collective_timeout;
        match t.is_finite() && t > 0.0 {
            true => Duration::from_secs_f64(t.min(10.0)),
            false => Duration::ZERO,
        }
    }

    /// The driver's launch options.
    pub fn launch(&self) -> Result<Launch> {
        let t = self.collective_timeout;
        if !(t.is_finite() && t > 0.0) {
            bail!("--collective-timeout {t}: needs a positive number of seconds");
        }
        Ok(Launch {
            kind: match self.launcher {
                LauncherArg::Threads => LauncherKind::Threads,
                LauncherArg::Mpi => LauncherKind::Mpi,
            },
            device: autopar_driver::Device::Cpu,
            collective_timeout: Duration::from_secs_f64(t),
            backend: if self.interpreter {
                BackendKind::Interpreter
            } else {
                BackendKind::Fast
            },
            threads: self.threads.map(|n| n as usize),
            wide_accumulation: self.wide_accumulation,
        })
    }
}

/// Sets this process up as an MPI rank: a clear error when it was not started by `mpirun`;
/// ranks other than 0 keep standard output quiet.
pub fn as_mpi_rank() -> Result<()> {
    if !driver::launch::MPI_AVAILABLE {
        bail!("--launcher mpi: this autopar was built without MPI (the `mpi` feature)");
    }
    if !driver::launch::started_by_mpirun() {
        bail!(
            "--launcher mpi: this process was not started by mpirun; run it as \
             `autopar launch -n N -- run ...` or `mpirun -np N autopar run ... --launcher mpi`"
        );
    }
    let rank = driver::launch::world_rank()?;
    QUIET.store(rank != 0, Ordering::SeqCst);
    Ok(())
}

/// Whether standard output is kept quiet (an MPI rank other than 0).
pub fn stdout_is_quiet() -> bool {
    QUIET.load(Ordering::SeqCst)
}

/// Ends the MPI job after this rank has reported its error, first giving the other ranks
/// `grace` to report theirs (each learns of the failure at its next wait, or times out).
pub fn end_job(grace: Duration) -> ! {
    driver::launch::abort(1, grace)
}

/// `autopar launch`.
#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Processes (ranks) to start: the device count of the run's mesh.
    #[arg(short = 'n', long = "np", value_name = "N")]
    pub n: usize,
    /// The autopar command each process runs: `run MODEL ...` (`--launcher mpi` is added
    /// when missing).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub command: Vec<String>,
}

/// Execs `mpirun` running `args.command` on this autopar in `args.n` processes.
pub fn launch(args: &LaunchArgs) -> Result<()> {
    if args.n == 0 {
        bail!("-n 0 starts no rank");
    }
    let command: Vec<String> = match args.command.first().map(String::as_str) {
        Some("--") => args.command[1..].to_vec(),
        _ => args.command.clone(),
    };
    if command.first().map(String::as_str) != Some("run") {
        bail!(
            "autopar launch runs `autopar run ...` (got `{}`)",
            command.join(" ")
        );
    }
    let mut command = command;
    let has_launcher = command
        .iter()
        .any(|a| a == "--launcher" || a.starts_with("--launcher="));
    if !has_launcher {
        command.extend(["--launcher".to_string(), "mpi".to_string()]);
    }
    let exe = std::env::current_exe().context("cannot find the autopar binary")?;
    let version = Command::new("mpirun")
        .arg("--version")
        .output()
        .context("cannot run mpirun (install Open MPI: openmpi-bin)")?;
    let open_mpi = String::from_utf8_lossy(&version.stdout).contains("Open MPI");
    let mut mpirun = Command::new("mpirun");
    if open_mpi {
        if running_as_root() {
            mpirun.arg("--allow-run-as-root");
        }
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if args.n > cores {
            mpirun.arg("--oversubscribe");
        }
        // A rank that exits on a failure must not make mpirun kill the others before they
        // report which rank and which collective failed; they end the job themselves.
        mpirun.args(["--mca", "orte_abort_on_non_zero_status", "0"]);
        for var in ["AUTOPAR_FAULT_EXIT", "RUST_BACKTRACE"] {
            if std::env::var_os(var).is_some() {
                mpirun.args(["-x", var]);
            }
        }
    }
    mpirun
        .arg("-np")
        .arg(args.n.to_string())
        .arg(&exe)
        .args(&command);
    exec(mpirun)
}

/// Whether this process runs as root (Open MPI refuses root without a flag).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|uid| uid == "0"))
        })
        .unwrap_or(false)
}

/// Replaces this process by `command` (so that Ctrl-C and the exit status are mpirun's).
#[cfg(unix)]
fn exec(mut command: Command) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let e = command.exec();
    Err(e).context("cannot exec mpirun")
}

#[cfg(not(unix))]
fn exec(mut command: Command) -> Result<()> {
    let status = command.status().context("cannot run mpirun")?;
    if !status.success() {
        bail!("mpirun ended with {status}");
    }
    Ok(())
}
