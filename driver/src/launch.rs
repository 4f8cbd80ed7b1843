//! How the ranks of a run start: as threads of this process, or as the processes of an MPI
//! job (one rank each, feature `mpi`), and on which device and backend: on the CPU the fast
//! backend (the default) or the reference interpreter, or CUDA (one thread per rank, ranks
//! round robin over the GPUs). [`run_launched`] is [`crate::run_on`] with the chosen launcher
//! and backend; [`finish`] and [`abort`] end an MPI process the way its job
//! needs (cleanly after success; after a failure, taking the whole job down once the error
//! is reported, so that no rank waits for one that will never come).

use std::time::Duration;

use autopar_runtime::{
    Accumulation, CommOptions, CpuBackend, FastCpuBackend, Launcher, ThreadLauncher,
};

use crate::Error;
use crate::compile::CompiledStep;
use crate::run::{RunHooks, RunOptions, RunReport, StepEvent, run_on};

/// Which launcher starts the ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LauncherKind {
    /// One thread per rank, in this process.
    #[default]
    Threads,
    /// This process's rank of an `mpirun` job.
    Mpi,
}

impl std::str::FromStr for LauncherKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "threads" => Ok(LauncherKind::Threads),
            "mpi" => Ok(LauncherKind::Mpi),
            other => Err(Error::Usage(format!(
                "unknown launcher `{other}` (threads or mpi)"
            ))),
        }
    }
}

/// Which backend executes the ranks' programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// The fast CPU backend ([`FastCpuBackend`]: f32 storage, pooled buffers, threads).
    #[default]
    Fast,
    /// The reference interpreter ([`CpuBackend`]), the oracle `--verify` compares with.
    Interpreter,
}

/// Which device executes the rank programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU, with the backend [`BackendKind`] names.
    #[default]
    Cpu,
    /// [`autopar_runtime_cuda::CudaBackend`]: generated kernels on NVIDIA GPUs.
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(Error::Usage(format!(
                "unknown device `{other}` (cpu or cuda)"
            ))),
        }
    }
}

/// How to start the ranks of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// The launcher.
    pub kind: LauncherKind,
    /// The device.
    pub device: Device,
    /// How long a rank waits for any one message of a collective or pipeline transfer
    /// before it reports the peer it waited for and the run fails.
    pub collective_timeout: Duration,
    /// The backend that runs the programs.
    pub backend: BackendKind,
    /// Threads per rank for the fast backend; `None`: the available cores divided by the
    /// ranks this process runs (at least 1).
    pub threads: Option<usize>,
    /// Whether the fast backend's f32 einsums accumulate in f64, or in f32 (the default, as
    /// PyTorch's and cuBLAS's GEMMs do, and about twice as fast; `--verify` then measures
    /// the noise such accumulation adds and allows for it).
    pub wide_accumulation: bool,
}

impl Default for Launch {
    fn default() -> Self {
        Launch {
            kind: LauncherKind::Threads,
            device: Device::Cpu,
            collective_timeout: CommOptions::DEFAULT_TIMEOUT,
            backend: BackendKind::Fast,
            threads: None,
            wide_accumulation: false,
        }
    }
}

impl Launch {
    /// How the CPU backend this launch names accumulates f32 contractions: the interpreter
    /// and the fast backend with `wide_accumulation` in `f64`, the fast backend otherwise in
    /// `f32`.
    pub fn accumulation(&self) -> Accumulation {
        match (self.backend, self.wide_accumulation) {
            (BackendKind::Fast, false) => Accumulation::F32,
            (BackendKind::Interpreter, _) | (BackendKind::Fast, true) => Accumulation::Wide,
        }
    }
}

/// Threads per rank when `local_ranks` ranks share this process's `cores`: `requested`, or
/// an equal share of the cores (at least 1).
pub fn threads_per_rank(requested: Option<usize>, cores: usize, local_ranks: usize) -> usize {
    requested.unwrap_or(cores / local_ranks.max(1)).max(1)
}

/// The cores this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Whether this build can launch MPI processes (the `mpi` feature).
pub const MPI_AVAILABLE: bool = cfg!(feature = "mpi");

/// Runs `step` on CPU ranks started as `launch` says, on the backend it names ([`run_on`]),
/// with [`RunOptions::accumulation`] set to what that backend does.
pub fn run_launched(
    step: &CompiledStep,
    launch: &Launch,
    options: &RunOptions,
    hooks: RunHooks<'_>,
    on_step: impl FnMut(&StepEvent),
) -> Result<RunReport, Error> {
    let comm = CommOptions {
        timeout: launch.collective_timeout,
        ..CommOptions::default()
    };
    if launch.device == Device::Cuda {
        if launch.kind != LauncherKind::Threads {
            return Err(Error::Usage(
                "--device cuda runs its ranks as threads of one process (--launcher threads)"
                    .into(),
            ));
        }
        if step.is_pipeline() {
            return Err(Error::Usage(
                "--device cuda does not run pipelines yet (its backend has not been through the \
                 pipeline executor); use a mesh without pp"
                    .into(),
            ));
        }
        let backend = autopar_runtime_cuda::CudaBackend::new()?;
        return run_on(
            step,
            &ThreadLauncher { options: comm },
            &backend,
            options,
            hooks,
            on_step,
        );
    }
    match launch.kind {
        LauncherKind::Threads => on_backend(
            step,
            &ThreadLauncher { options: comm },
            launch,
            options,
            hooks,
            on_step,
        ),
        #[cfg(feature = "mpi")]
        LauncherKind::Mpi => on_backend(
            step,
            &autopar_runtime::MpiLauncher::new(comm),
            launch,
            options,
            hooks,
            on_step,
        ),
        #[cfg(not(feature = "mpi"))]
        LauncherKind::Mpi => Err(Error::Usage(
            "--launcher mpi: this autopar was built without MPI (the `mpi` feature)".into(),
        )),
    }
}

/// [`run_on`] with `launcher` and the backend `launch` names, its threads per rank shared out
/// over the ranks the launcher runs in this process.
fn on_backend<L: Launcher + 'static>(
    step: &CompiledStep,
    launcher: &L,
    launch: &Launch,
    options: &RunOptions,
    hooks: RunHooks<'_>,
    on_step: impl FnMut(&StepEvent),
) -> Result<RunReport, Error> {
    let options = RunOptions {
        accumulation: launch.accumulation(),
        ..*options
    };
    match launch.backend {
        BackendKind::Interpreter => run_on(
            step,
            launcher,
            &CpuBackend::default(),
            &options,
            hooks,
            on_step,
        ),
        BackendKind::Fast => {
            let local = launcher.local_ranks(&step.mesh)?.len();
            let threads = threads_per_rank(launch.threads, available_cores(), local);
            let backend = FastCpuBackend::new(threads, local)?
                .with_wide_accumulation(launch.wide_accumulation);
            run_on(step, launcher, &backend, &options, hooks, on_step)
        }
    }
}

/// The CUDA kernel benchmarks (`autopar bench-kernels`): opens the GPUs and times a bf16
/// GEMM, attention forward and backward and a fused element-wise kernel, the problem sizes
/// divided by `shrink`.
pub fn cuda_bench_kernels(
    shrink: usize,
) -> Result<Vec<autopar_runtime_cuda::bench::Figure>, Error> {
    let cuda = autopar_runtime_cuda::CudaBackend::new()?;
    Ok(autopar_runtime_cuda::bench::run(&cuda, shrink)?)
}

/// Whether this process was started by `mpirun` (or another MPI launcher).
pub fn started_by_mpirun() -> bool {
    #[cfg(feature = "mpi")]
    {
        autopar_runtime::comm::mpi::started_by_mpirun()
    }
    #[cfg(not(feature = "mpi"))]
    {
        false
    }
}

/// Ends MPI in this process after a successful run (nothing if it never started).
pub fn finish() {
    #[cfg(feature = "mpi")]
    autopar_runtime::comm::mpi::finalize();
}

/// Ends the whole job with `code` after this process has reported its failure: first waits
/// `grace`, so that the ranks the failure was announced to can report theirs, then aborts
/// the MPI job (or, without MPI, exits this process).
pub fn abort(code: i32, grace: Duration) -> ! {
    #[cfg(feature = "mpi")]
    {
        std::thread::sleep(grace);
        autopar_runtime::comm::mpi::abort_job(code)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = grace;
        std::process::exit(code)
    }
}

/// This process's rank in its MPI job (starting MPI if needed); an error when the process
/// was not started by `mpirun` or the build has no MPI.
pub fn world_rank() -> Result<usize, Error> {
    #[cfg(feature = "mpi")]
    {
        Ok(autopar_runtime::comm::mpi::world_rank_and_size()?.0)
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(Error::Usage(
            "--launcher mpi: this autopar was built without MPI (the `mpi` feature)".into(),
        ))
    }
}
