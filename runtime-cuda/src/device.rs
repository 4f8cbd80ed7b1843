//! Device discovery: which CUDA libraries this process can load and how many GPUs the driver
//! sees, found without a single call that could panic.
//!
//! cudarc loads every library lazily on first use and panics when it is absent, so each
//! library is probed first with cudarc's own `is_culib_present` (it opens the library under
//! the names cudarc will use, and calls nothing in it). Only when the driver library is present
//! is it initialised and asked for its device count.

use crate::error::CudaError;

/// Where the loader looks, said once for every library.
const LOADER_HINT: &str = "put its folder on LD_LIBRARY_PATH (cudarc opens libNAME.so or \
    libNAME.so.13; the PyPI wheels nvidia-cuda-nvrtc, nvidia-cublas and nvidia-nccl-cu13 ship \
    them under site-packages/nvidia/cu13/lib and nvidia/nccl/lib)";

/// What to do without the driver library.
const DRIVER_HINT: &str = "it comes with the NVIDIA driver, which this machine lacks (or \
    whose folder is not on the loader's path)";

/// One library the backend loads, and whether it could.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Library {
    /// Its file name as the loader looks for it.
    pub name: &'static str,
    /// What the backend uses it for.
    pub role: &'static str,
    /// Whether it can be loaded.
    pub present: bool,
}

/// What [`discover`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovery {
    /// The CUDA driver (`libcuda.so`), NVRTC, cuBLAS, cuBLASLt and NCCL, in that order.
    pub libraries: Vec<Library>,
    /// GPUs the driver reports (0 when the driver is absent or fails to initialise).
    pub gpus: usize,
    /// Why the driver reports no GPU, when it failed to initialise.
    pub driver_error: Option<String>,
}

impl Discovery {
    /// The first missing library among those a single-process run needs (driver, NVRTC,
    /// cuBLAS and cuBLASLt), or no GPU, as an error; `Ok` when a run can start.
    pub fn require_runnable(&self) -> Result<(), CudaError> {
        for lib in self.libraries.iter().filter(|l| l.name != NCCL) {
            if !lib.present {
                return Err(CudaError::LibraryMissing {
                    library: lib.name,
                    hint: if lib.name == DRIVER {
                        DRIVER_HINT
                    } else {
                        LOADER_HINT
                    },
                });
            }
        }
        if self.gpus == 0 {
            return Err(CudaError::NoGpu {
                detail: self.driver_error.clone(),
            });
        }
        Ok(())
    }

    /// NVRTC alone, for compiling kernels without a GPU.
    pub fn require_nvrtc(&self) -> Result<(), CudaError> {
        match self.libraries.iter().find(|l| l.name == NVRTC) {
            Some(l) if l.present => Ok(()),
            _ => Err(CudaError::LibraryMissing {
                library: NVRTC,
                hint: LOADER_HINT,
            }),
        }
    }

    /// Whether NCCL is there (needed only for ranks on distinct GPUs).
    pub fn has_nccl(&self) -> bool {
        self.libraries.iter().any(|l| l.name == NCCL && l.present)
    }

    /// One line per library and the GPU count, for `--device cuda` diagnostics.
    pub fn summary(&self) -> String {
        let libs: Vec<String> = self
            .libraries
            .iter()
            .map(|l| format!("{} {}", l.name, if l.present { "found" } else { "missing" }))
            .collect();
        format!("{}; {} GPU(s)", libs.join(", "), self.gpus)
    }
}

const DRIVER: &str = "libcuda.so";
const NVRTC: &str = "libnvrtc.so";
const CUBLAS: &str = "libcublas.so";
const CUBLASLT: &str = "libcublasLt.so";
const NCCL: &str = "libnccl.so";

/// Probes the CUDA libraries and, when the driver is there, counts the GPUs. Never panics.
pub fn discover() -> Discovery {
    let driver = driver_present();
    let libraries = vec![
        Library {
            name: DRIVER,
            role: "the CUDA driver: memory, streams, kernel launches",
            present: driver,
        },
        Library {
            name: NVRTC,
            role: "compiles the generated kernels",
            present: nvrtc_present(),
        },
        Library {
            name: CUBLAS,
            role: "cuBLAS handle (cuBLASLt needs it)",
            present: cublas_present(),
        },
        Library {
            name: CUBLASLT,
            role: "GEMMs and batched GEMMs",
            present: cublaslt_present(),
        },
        Library {
            name: NCCL,
            role: "collectives between GPUs",
            present: nccl_present(),
        },
    ];
    let (gpus, driver_error) = if driver {
        match count_gpus() {
            Ok(n) => (n, None),
            Err(e) => (0, Some(e)),
        }
    } else {
        (0, None)
    };
    Discovery {
        libraries,
        gpus,
        driver_error,
    }
}

/// Whether libnvrtc can be loaded (all that compiling kernels needs; no GPU, no driver).
pub fn nvrtc_present() -> bool {
    // SAFETY: asks the dynamic loader to open libnvrtc under cudarc's candidate names; no
    // symbol of it is called, and NVRTC's initialisers need nothing from the caller.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

fn driver_present() -> bool {
    // SAFETY: as in `nvrtc_present`, for libcuda.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::driver::sys::is_culib_present()
    }
}

fn cublas_present() -> bool {
    // SAFETY: as in `nvrtc_present`, for libcublas.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::cublas::sys::is_culib_present()
    }
}

fn cublaslt_present() -> bool {
    // SAFETY: as in `nvrtc_present`, for libcublasLt.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::cublaslt::sys::is_culib_present()
    }
}

fn nccl_present() -> bool {
    // SAFETY: as in `nvrtc_present`, for libnccl.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nccl::sys::is_culib_present()
    }
}

/// `cuInit` and `cuDeviceGetCount`; only called once libcuda is known to load.
fn count_gpus() -> Result<usize, String> {
    cudarc::driver::result::init().map_err(|e| format!("cuInit: {e:?}"))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| format!("cuDeviceGetCount: {e:?}"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_never_panics_and_names_what_is_missing() {
        let d = discover();
        assert_eq!(d.libraries.len(), 5);
        match d.require_runnable() {
            Ok(()) => assert!(d.gpus > 0),
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains(".so") || text.contains("no GPU"),
                    "unhelpful error: {text}"
                );
            }
        }
        assert!(d.summary().contains("GPU(s)"));
    }
}
