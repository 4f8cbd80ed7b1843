//! NCCL's bootstrap over MPI, for a CUDA backend whose ranks are MPI processes: rank 0 makes
//! the NCCL unique id, MPI broadcasts its bytes, and every rank gets the same id to build
//! its NCCL communicator from (`cudarc::nccl::Comm::from_rank`).
//!
//! libnccl is loaded at run time. cudarc panics when it cannot find the library, so rank 0
//! looks for it first (the names cudarc tries, `libnccl.so` among them, on the loader's
//! path), and its absence is an error on every rank, not a panic on one.

use ::mpi::collective::Root;
use ::mpi::topology::Communicator;
use cudarc::nccl::Id;

use super::mpi::with_world;
use crate::error::RuntimeError;

/// Bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

/// Whether libnccl can be loaded.
fn nccl_present() -> bool {
    // SAFETY: the check only asks the dynamic loader to open libnccl under the names cudarc
    // would use; NCCL's initialisers need nothing from the caller, and no symbol is called.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nccl::sys::is_culib_present()
    }
}

/// The NCCL unique id of this job: made on rank 0 of the MPI world, broadcast over MPI, the
/// same on every rank. Called by every process of the world at once.
pub fn nccl_unique_id() -> Result<Id, RuntimeError> {
    // One status byte (0: an id follows; 1: no libnccl; 2: NCCL failed), then the id.
    let mut message = [0u8; 1 + ID_BYTES];
    let mut failure = None;
    let rank = with_world(|w| w.rank())?;
    if rank == 0 {
        if !nccl_present() {
            message[0] = 1;
        } else {
            match Id::new() {
                Ok(id) => {
                    for (b, &c) in message[1..].iter_mut().zip(id.internal()) {
                        *b = c as u8;
                    }
                }
                Err(e) => {
                    message[0] = 2;
                    failure = Some(format!("{e:?}"));
                }
            }
        }
    }
    with_world(|w| w.process_at_rank(0).broadcast_into(&mut message[..]))?;
    let detail = match message[0] {
        0 => {
            let mut internal = [0 as core::ffi::c_char; ID_BYTES];
            for (c, &b) in internal.iter_mut().zip(&message[1..]) {
                *c = b as core::ffi::c_char;
            }
            return Ok(Id::uninit(internal));
        }
        1 => "rank 0 cannot load libnccl (libnccl.so on the loader's path, e.g. \
              LD_LIBRARY_PATH; a pip wheel's libnccl.so.2 needs a libnccl.so link beside it)"
            .to_string(),
        _ => format!(
            "rank 0 could not make an NCCL unique id{}",
            failure.map(|f| format!(": {f}")).unwrap_or_default()
        ),
    };
    Err(RuntimeError::SpmdSetup { detail })
}
