//! [`CudaError`], the one error type of the CUDA backend, and its mapping onto the runtime's
//! [`RuntimeError`] where the [`autopar_runtime::Backend`] trait needs one.

use autopar_ir::{DType, TensorType};
use autopar_runtime::RuntimeError;

/// What can go wrong in the CUDA backend: a library or device that is absent, an op or
/// dtype the code generator does not handle, a compiler diagnostic, a driver failure.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library cannot be loaded.
    #[error("the CUDA backend needs {library}, which cannot be loaded: {hint}")]
    LibraryMissing {
        /// The library (`libcuda.so`, `libnvrtc.so`, ...).
        library: &'static str,
        /// Where the loader looks and how to make it found.
        hint: &'static str,
    },
    /// The driver loaded but reports no GPU.
    #[error("the CUDA driver reports no GPU{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    NoGpu {
        /// What the driver said, if it said anything.
        detail: Option<String>,
    },
    /// The code generator has no kernel for an op with these operand types.
    #[error("no CUDA kernel for `{op}` on {operands}: {detail}")]
    Unsupported {
        /// The op's mnemonic.
        op: &'static str,
        /// The operand types, as the text IR writes them.
        operands: String,
        /// Why.
        detail: String,
    },
    /// A dtype a kernel cannot hold.
    #[error("no CUDA kernel for `{op}` on dtype {dtype}")]
    UnsupportedDType {
        /// The op's mnemonic.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// NVRTC rejected (or warned about) a generated kernel.
    #[error("NVRTC {outcome} kernel `{kernel}` for {arch}:\n{log}")]
    Compile {
        /// The kernel's name.
        kernel: String,
        /// The target architecture (`sm_90`).
        arch: String,
        /// `failed to compile` or `warned about`.
        outcome: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// A call into the CUDA driver, cuBLASLt or NCCL failed.
    #[error("{call} failed: {detail}")]
    Driver {
        /// The call (`cuMemAlloc`, `cublasLtMatmul`, ...).
        call: &'static str,
        /// The error it returned.
        detail: String,
    },
    /// A tensor handed to the backend does not fit where it goes.
    #[error("tensor of type {ty}: {detail}")]
    BadTensor {
        /// Its type.
        ty: TensorType,
        /// What is wrong.
        detail: String,
    },
    /// A runtime error (typing, missing feeds) met inside the backend.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl From<CudaError> for RuntimeError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Runtime(r) => r,
            other => RuntimeError::SpmdSetup {
                detail: other.to_string(),
            },
        }
    }
}
