//! autopar's CUDA backend: device discovery, CUDA C generated for every op and fusion body of
//! a rank program ([`codegen`]), compiled by NVRTC ([`nvrtc`]), and [`CudaBackend`], the
//! [`autopar_runtime::Backend`] that runs rank programs on GPUs.
//!
//! Everything loads at run time (cudarc's dynamic loading): building needs no CUDA toolkit,
//! and a machine without a GPU gets a clean [`CudaError`] naming what is missing.

pub mod backend;
pub mod bench;
pub mod codegen;
pub mod device;
pub mod error;
pub mod nvrtc;

pub use backend::{CudaBackend, CudaBuffer, CudaExecutable};
pub use codegen::{Kernel, kernels_for_graph, kernels_for_node};
pub use device::{Discovery, discover};
pub use error::CudaError;
