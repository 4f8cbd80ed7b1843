//! The driver's error: each variant wraps the failing crate's error with what was being
//! done, so that a message names the file, the pass or the option at fault.

use thiserror::Error;

/// Errors of compiling and running a model.
#[derive(Debug, Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// What the OS said.
        error: std::io::Error,
    },
    /// A `.air` file does not parse.
    #[error("{path}:{error}")]
    Parse {
        /// The file.
        path: String,
        /// Line, column and message.
        error: autopar_ir::text::ParseError,
    },
    /// A graph file is not valid (JSON syntax, typing or verifier).
    #[error("{path}: {error}")]
    GraphFile {
        /// The file.
        path: String,
        /// What is wrong.
        error: autopar_ir::IrError,
    },
    /// A model argument or model code is wrong.
    #[error(transparent)]
    Frontend(Box<autopar_frontends::FrontendError>),
    /// Executing a graph failed.
    #[error(transparent)]
    Runtime(#[from] autopar_runtime::RuntimeError),
    /// The CUDA backend cannot start (a library or GPU missing) or failed.
    #[error(transparent)]
    Cuda(#[from] autopar_runtime_cuda::CudaError),
    /// A cluster description, plan or estimate is wrong.
    #[error(transparent)]
    Cost(#[from] autopar_cost_model::CostError),
    /// A compiler pass failed (sharding propagation, partitioning, annotations).
    #[error(transparent)]
    Pass(Box<autopar_passes::PassError>),
    /// The verifier rejected the output of a pass: a compiler bug, not a user error.
    #[error("the verifier rejects the output of pass `{pass}` ({graph}): {error}")]
    Verifier {
        /// The pass whose output is wrong.
        pass: &'static str,
        /// The graph (a rank's program, a pipeline sub-program).
        graph: String,
        /// What the verifier found.
        error: autopar_ir::IrError,
    },
    /// A mesh, placement or graph is malformed.
    #[error(transparent)]
    Ir(#[from] autopar_ir::IrError),
    /// A checkpoint (or a weights file) is missing, incomplete, corrupt or does not fit the
    /// model.
    #[error("{path} {detail}")]
    Checkpoint {
        /// The file or directory at fault.
        path: String,
        /// What is wrong, naming the tensor.
        detail: String,
    },
    /// A batch fed to the step does not fit its inputs (a token id outside the vocabulary).
    #[error("batch input `{input}`: {detail}")]
    BadBatch {
        /// The input.
        input: String,
        /// What is wrong.
        detail: String,
    },
    /// The step's ranks need more memory than the machine has available.
    #[error(
        "the step needs at least {needed} bytes ({}) of memory over its {ranks} rank(s), \
         the machine has {available} bytes ({}) available",
        crate::host::human_bytes(*needed),
        crate::host::human_bytes(*available)
    )]
    HostMemory {
        /// The planned bytes of every rank together.
        needed: u64,
        /// What the machine reports available.
        available: u64,
        /// Ranks in this process.
        ranks: usize,
    },
    /// An option does not apply, or options contradict each other.
    #[error("{0}")]
    Usage(String),
}

impl From<autopar_frontends::FrontendError> for Error {
    fn from(e: autopar_frontends::FrontendError) -> Self {
        Error::Frontend(Box::new(e))
    }
}

impl From<autopar_passes::PassError> for Error {
    fn from(e: autopar_passes::PassError) -> Self {
        // Boxed: pass errors carry names, types and axes, and would make every result large.
        Error::Pass(Box::new(e))
    }
}
