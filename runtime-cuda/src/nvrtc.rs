//! NVRTC: compiles a generated kernel's CUDA C to a cubin for one architecture. Any
//! diagnostic fails the compile, warnings included, so generated code stays warning-free.
//!
//! NVRTC needs neither a GPU nor the driver, so this runs on CPU-only machines (CI compiles
//! every generated kernel this way). The caller checks [`crate::device::nvrtc_present`]
//! first: cudarc panics when libnvrtc is absent.

use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::{result, sys};

use crate::error::CudaError;

/// The options every kernel is compiled with: C++17, no fast math (IEEE division and square
/// root, denormals kept), fused multiply-add allowed (it is at least as accurate as the
/// separate operations and the reference accumulates in f64 anyway), and no default headers
/// (the generated source is self-contained).
pub const OPTIONS: [&str; 5] = [
    "--std=c++17",
    "--fmad=true",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
];

/// A compiled kernel module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cubin {
    /// The architecture it is for (`sm_90`).
    pub arch: String,
    /// The image, as `cuModuleLoadData` takes it.
    pub image: Vec<u8>,
}

/// Compiles `source` (named `name` in diagnostics) for `arch` (`sm_80`, `sm_90`, ...).
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Cubin, CudaError> {
    crate::device::discover().require_nvrtc()?;
    let fail = |outcome, log: String| CudaError::Compile {
        kernel: name.to_string(),
        arch: arch.to_string(),
        outcome,
        log,
    };
    let src =
        CString::new(source).map_err(|_| fail("failed to compile", "NUL in source".into()))?;
    let file = CString::new(format!("{name}.cu"))
        .map_err(|_| fail("failed to compile", "NUL in name".into()))?;
    let prog = result::create_program(&src, Some(&file)).map_err(|e| CudaError::Driver {
        call: "nvrtcCreateProgram",
        detail: format!("{e:?}"),
    })?;
    let mut options: Vec<String> = OPTIONS.iter().map(|o| (*o).to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `prog` was just created by `create_program` and is destroyed only below, after
    // its last use; `src` and `file`, which it may point into, outlive it.
    #[allow(unsafe_code)]
    let outcome = unsafe { result::compile_program(prog, &options) };
    // SAFETY: as above; the log is a NUL-terminated buffer NVRTC filled.
    #[allow(unsafe_code)]
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| log_text(&raw))
        .unwrap_or_default();
    let image = match outcome {
        Err(e) => Err(fail("failed to compile", format!("{e:?}\n{log}"))),
        Ok(()) if !log.trim().is_empty() => Err(fail("warned about", log)),
        Ok(()) => cubin(prog).map_err(|e| CudaError::Driver {
            call: "nvrtcGetCUBIN",
            detail: format!("{e:?}"),
        }),
    };
    // SAFETY: `prog` came from `create_program` and is destroyed exactly once, here.
    #[allow(unsafe_code)]
    let _ = unsafe { result::destroy_program(prog) };
    Ok(Cubin {
        arch: arch.to_string(),
        image: image?,
    })
}

/// The bytes of a NUL-terminated C string buffer as text.
fn log_text(raw: &[c_char]) -> String {
    if raw.last() != Some(&0) {
        return String::new();
    }
    // SAFETY: the buffer ends with a NUL (checked above) and lives for this call.
    #[allow(unsafe_code)]
    let text = unsafe { CStr::from_ptr(raw.as_ptr()) };
    text.to_string_lossy().into_owned()
}

/// The cubin of a compiled program.
fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` is a live, successfully compiled program; `size` is a valid out-pointer.
    #[allow(unsafe_code)]
    unsafe {
        sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
    }
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds exactly the `size` bytes NVRTC reported for the cubin.
    #[allow(unsafe_code)]
    unsafe {
        sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()).result()?;
    }
    Ok(image)
}
