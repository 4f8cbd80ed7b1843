//! The [`Launcher`] seam: what starts the ranks of a mesh and runs a body on each with its
//! [`Collectives`]. [`ThreadLauncher`] runs every rank as a thread of this process with
//! in-process communicators; a process launcher (MPI) runs only this process's rank, which is
//! why a launch returns the results of the ranks that ran here, with their rank numbers.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

use autopar_ir::DeviceMesh;

use crate::comm::{Collectives, CommOptions, in_process_communicators};
use crate::error::RuntimeError;

/// The results of the ranks a launch ran in this process: `(rank, result)` in rank order,
/// each error wrapped in [`RuntimeError::OnRank`].
pub type RankResults<T> = Vec<(usize, Result<T, RuntimeError>)>;

/// Starts the ranks of a mesh and runs a body on each.
pub trait Launcher {
    /// Runs `body` on the ranks of `mesh` this launcher starts, each with its own
    /// [`Collectives`] (whose [`rank`](Collectives::rank) says which rank it is).
    ///
    /// A rank whose body fails or panics [aborts](Collectives::abort) before its
    /// communicator goes away, so that the others fail promptly instead of waiting for it.
    /// The outer error is for a launch that cannot start at all.
    fn launch<T, F>(&self, mesh: &DeviceMesh, body: F) -> Result<RankResults<T>, RuntimeError>
    where
        T: Send,
        F: Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync;

    /// The ranks of `mesh` that a launch runs in this process, ascending: what this process
    /// must load before it launches. An error when this launcher cannot run `mesh` here.
    fn local_ranks(&self, mesh: &DeviceMesh) -> Result<Vec<usize>, RuntimeError>;
}

/// One thread per rank of the mesh, communicating through [`InProcessCommunicator`](crate::comm::InProcessCommunicator)s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadLauncher {
    /// Timeout and reduction precision of the communicators.
    pub options: CommOptions,
}

impl Launcher for ThreadLauncher {
    fn launch<T, F>(&self, mesh: &DeviceMesh, body: F) -> Result<RankResults<T>, RuntimeError>
    where
        T: Send,
        F: Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync,
    {
        let comms = in_process_communicators(mesh, self.options);
        let body = &body;
        Ok(std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            let mut comm = comm;
                            run_rank(&mut comm, body)
                        })
                        .map_err(|e| RuntimeError::SpmdSetup {
                            detail: format!("cannot start the thread of rank {rank}: {e}"),
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    let result = h.and_then(|h| {
                        h.join().unwrap_or_else(|payload| {
                            // `run_rank` catches panics of the body; this is one in the
                            // launcher's own bookkeeping.
                            Err(RuntimeError::RankPanicked {
                                rank,
                                message: panic_message(payload.as_ref()),
                            })
                        })
                    });
                    let result = result.map_err(|e| RuntimeError::OnRank {
                        rank,
                        error: Box::new(e),
                    });
                    (rank, result)
                })
                .collect()
        }))
    }

    fn local_ranks(&self, mesh: &DeviceMesh) -> Result<Vec<usize>, RuntimeError> {
        Ok((0..mesh.num_devices()).collect())
    }
}

/// One rank: runs the body, and on failure tells the other ranks before its communicator goes
/// away.
fn run_rank<T>(
    comm: &mut dyn Collectives,
    body: &(impl Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync),
) -> Result<T, RuntimeError> {
    let rank = comm.rank();
    let outcome = catch_unwind(AssertUnwindSafe(|| body(&mut *comm)));
    let result = outcome.unwrap_or_else(|payload| {
        Err(RuntimeError::RankPanicked {
            rank,
            message: panic_message(payload.as_ref()),
        })
    });
    if let Err(e) = &result {
        comm.abort(e);
    }
    result
}

/// Runs this process's rank of a mesh, when the process is one of the ranks `mpirun` started,
/// communicating through an [`crate::comm::MpiCommunicator`]. Every process of the MPI world
/// calls [`Launcher::launch`] with the same mesh, at the same point of its program; process
/// `r` runs mesh rank `r`. The world's size must equal the mesh's device count (unless
/// [`MpiLauncher::idle_extra_ranks`]), and a process not started by `mpirun` cannot launch.
///
/// The communicators are made by the first launch (collectively) and kept for the next
/// launches of the same mesh, so that a rank that has died cannot hold the others in a
/// communicator split. A launch returns at most one result, this process's. A rank that fails tells the others,
/// which fail at their next wait; a rank that dies or stops answering makes its peers fail
/// when the timeout passes. Either way every rank returns its error, and the program ends the
/// job (`crate::comm::mpi::abort_job`) once it has reported it.
#[cfg(feature = "mpi")]
#[derive(Default)]
pub struct MpiLauncher {
    options: CommOptions,
    idle_extra_ranks: bool,
    /// The communicators of the last mesh launched, made by its first launch and used by the
    /// next ones (`None` inside on a process that sits the mesh out).
    connection: std::cell::RefCell<Option<(DeviceMesh, Option<crate::comm::mpi::MpiConnection>)>>,
}

#[cfg(feature = "mpi")]
impl MpiLauncher {
    /// A launcher whose communicators have `options`.
    pub fn new(options: CommOptions) -> MpiLauncher {
        MpiLauncher {
            options,
            ..MpiLauncher::default()
        }
    }

    /// Lets a world larger than the mesh launch it, processes `n..` sitting out (they run
    /// nothing and return no result): for test suites that launch meshes of several sizes
    /// in one `mpirun`.
    pub fn idle_extra_ranks(mut self) -> MpiLauncher {
        self.idle_extra_ranks = true;
        self
    }
}

#[cfg(feature = "mpi")]
impl std::fmt::Debug for MpiLauncher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiLauncher")
            .field("options", &self.options)
            .field("idle_extra_ranks", &self.idle_extra_ranks)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "mpi")]
impl Launcher for MpiLauncher {
    fn launch<T, F>(&self, mesh: &DeviceMesh, body: F) -> Result<RankResults<T>, RuntimeError>
    where
        T: Send,
        F: Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync,
    {
        self.local_ranks(mesh)?;
        let mut cached = self.connection.borrow_mut();
        if cached.as_ref().is_none_or(|(m, _)| m != mesh) {
            *cached = Some((mesh.clone(), crate::comm::mpi::MpiConnection::new(mesh)?));
        }
        let Some((_, Some(connection))) = cached.as_ref() else {
            return Ok(Vec::new());
        };
        let mut comm = connection.communicator(self.options);
        drop(cached);
        let rank = comm.rank();
        let result = run_rank(&mut comm, &body).map_err(|e| RuntimeError::OnRank {
            rank,
            error: Box::new(e),
        });
        Ok(vec![(rank, result)])
    }

    fn local_ranks(&self, mesh: &DeviceMesh) -> Result<Vec<usize>, RuntimeError> {
        let (rank, size) = crate::comm::mpi::world_rank_and_size()?;
        let n = mesh.num_devices();
        if size != n && !(self.idle_extra_ranks && size > n) {
            return Err(RuntimeError::SpmdSetup {
                detail: format!(
                    "the mesh `{mesh}` has {n} ranks but MPI started {size} processes \
                     (run it with `mpirun -np {n}` or `autopar launch -n {n}`)"
                ),
            });
        }
        Ok(if rank < n { vec![rank] } else { Vec::new() })
    }
}

/// Every rank's value when all succeeded; otherwise the error that started the failure: the
/// first (lowest rank) that is not merely the consequence of another rank's failure or exit
/// ([`RuntimeError::PeerFailed`], [`RuntimeError::PeerExited`]), or the first of all when
/// every one is.
pub fn root_cause<T>(results: RankResults<T>) -> Result<Vec<(usize, T)>, RuntimeError> {
    let mut values = Vec::with_capacity(results.len());
    let mut first: Option<RuntimeError> = None;
    for (rank, result) in results {
        match result {
            Ok(v) => values.push((rank, v)),
            Err(e) => {
                let better = first
                    .as_ref()
                    .is_none_or(|f| is_consequence(f) && !is_consequence(&e));
                if better {
                    first = Some(e);
                }
            }
        }
    }
    match first {
        Some(e) => Err(e),
        None => Ok(values),
    }
}

/// True for an error that only reports another rank's failure or exit.
fn is_consequence(e: &RuntimeError) -> bool {
    matches!(
        e.innermost(),
        RuntimeError::PeerFailed { .. } | RuntimeError::PeerExited { .. }
    )
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer_failed(rank: usize) -> RuntimeError {
        RuntimeError::OnRank {
            rank,
            error: Box::new(RuntimeError::PeerFailed {
                op: "all_reduce",
                group: vec![0, 1, 2],
                rank,
                failed_rank: 2,
                reason: "boom".into(),
            }),
        }
    }

    #[test]
    fn the_root_cause_is_the_first_error_that_is_not_a_consequence() {
        let root = RuntimeError::OnRank {
            rank: 2,
            error: Box::new(RuntimeError::DivisionByZero { op: "div" }),
        };
        let results: RankResults<u8> =
            vec![(0, Err(peer_failed(0))), (1, Ok(1)), (2, Err(root.clone()))];
        assert_eq!(root_cause(results), Err(root));
        // Only consequences: the first of them.
        let results: RankResults<u8> = vec![(0, Err(peer_failed(0))), (1, Err(peer_failed(1)))];
        assert_eq!(root_cause(results), Err(peer_failed(0)));
        assert_eq!(root_cause(vec![(3, Ok(7u8))]), Ok(vec![(3, 7)]));
    }

    #[test]
    fn a_panicking_rank_is_an_error_and_the_others_learn_of_it() -> Result<(), RuntimeError> {
        let mesh = DeviceMesh::new([("x", 2)])?;
        let launcher = ThreadLauncher::default();
        let results = launcher.launch(&mesh, |comm| {
            if comm.rank() == 1 {
                panic!("rank one gives up");
            }
            let x = crate::Tensor::full(
                autopar_ir::TensorType::new(autopar_ir::DType::F32, [2]),
                1.0,
            );
            comm.all_reduce(&x, &["x".to_string()], autopar_ir::ReduceKind::Sum)
        })?;
        assert_eq!(results.len(), 2);
        assert!(matches!(
            results[1].1.as_ref().map_err(RuntimeError::innermost),
            Err(RuntimeError::RankPanicked { rank: 1, message }) if message == "rank one gives up"
        ));
        assert!(matches!(
            results[0].1.as_ref().map_err(RuntimeError::innermost),
            Err(RuntimeError::PeerFailed { failed_rank: 1, .. } | RuntimeError::PeerExited { .. })
        ));
        assert!(matches!(
            root_cause(results),
            Err(RuntimeError::OnRank { rank: 1, .. })
        ));
        Ok(())
    }
}
