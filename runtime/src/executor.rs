//! The multi-rank executor: runs one local program per rank of a device mesh, each on its
//! own thread through the reference interpreter, with the ranks' collectives carried out by
//! in-process communicators.
//!
//! Ranks are linear mesh coordinates. Every rank may run its own graph (pipeline stages) or
//! all may share one (plain SPMD); whatever they run, the members of a group must reach
//! their collectives on that group in the same order. A rank that fails makes the others
//! fail promptly, and the run reports the failure that started it, with its rank.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use autopar_ir::{DeviceMesh, Graph};

use crate::TensorMap;
use crate::comm::{CommOptions, InProcessCommunicator, in_process_communicators};
use crate::error::RuntimeError;
use crate::interp::{RunOptions, RunOutput, run_with_communicator};

/// What one rank runs: its local program and the parameters and inputs it is fed.
#[derive(Clone, Copy, Debug)]
pub struct RankProgram<'a> {
    /// The rank's local graph, with local shapes and explicit communication ops. Its mesh,
    /// if it has one attached, must be the mesh the ranks run on.
    pub graph: &'a Graph,
    /// The rank's parameters (its shards), by name.
    pub params: &'a TensorMap,
    /// The rank's inputs (its part of the batch), by name.
    pub inputs: &'a TensorMap,
}

/// Options of a multi-rank run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpmdOptions {
    /// Options of every rank's interpreter; its precision applies to reductions too.
    pub run: RunOptions,
    /// How long a rank waits for any one message from a peer.
    pub timeout: Duration,
}

impl Default for SpmdOptions {
    fn default() -> Self {
        SpmdOptions {
            run: RunOptions::default(),
            timeout: CommOptions::DEFAULT_TIMEOUT,
        }
    }
}

/// Runs `ranks[r]` on rank `r` of `mesh`, one thread per rank, and returns every rank's
/// outputs and peak memory, in rank order.
///
/// On failure the error is the one that started it, wrapped in [`RuntimeError::OnRank`]:
/// the first rank (lowest number) whose error is not merely the consequence of another
/// rank's failure or exit. [`run_spmd_per_rank`] gives every rank's own result instead.
pub fn run_spmd(
    mesh: &DeviceMesh,
    ranks: &[RankProgram<'_>],
    options: SpmdOptions,
) -> Result<Vec<RunOutput>, RuntimeError> {
    let results = run_spmd_per_rank(mesh, ranks, options)?;
    if results.iter().all(Result::is_ok) {
        return Ok(results.into_iter().flatten().collect());
    }
    let errors: Vec<RuntimeError> = results.into_iter().filter_map(Result::err).collect();
    let root = errors
        .iter()
        .position(|e| !is_consequence(e))
        .unwrap_or_default();
    Err(errors
        .into_iter()
        .nth(root)
        .unwrap_or(RuntimeError::SpmdSetup {
            detail: "a rank failed without an error".into(),
        }))
}

/// Like [`run_spmd`], but returns each rank's own result (errors wrapped in
/// [`RuntimeError::OnRank`]). The outer error is for a run that cannot start: the wrong
/// number of programs, or a program attached to another mesh.
pub fn run_spmd_per_rank(
    mesh: &DeviceMesh,
    ranks: &[RankProgram<'_>],
    options: SpmdOptions,
) -> Result<Vec<Result<RunOutput, RuntimeError>>, RuntimeError> {
    if ranks.len() != mesh.num_devices() {
        return Err(RuntimeError::SpmdSetup {
            detail: format!(
                "the mesh `{mesh}` has {} ranks but {} programs were given",
                mesh.num_devices(),
                ranks.len()
            ),
        });
    }
    for (rank, p) in ranks.iter().enumerate() {
        if let Some(m) = p.graph.mesh()
            && m != mesh
        {
            return Err(RuntimeError::SpmdSetup {
                detail: format!(
                    "rank {rank}'s program `{}` is for the mesh `{m}`, not `{mesh}`",
                    p.graph.name()
                ),
            });
        }
    }
    let comms = in_process_communicators(
        mesh,
        CommOptions {
            timeout: options.timeout,
            precision: options.run.precision,
        },
    );
    Ok(std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(ranks)
            .enumerate()
            .map(|(rank, (comm, &program))| {
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || run_rank(comm, program, options.run))
                    .map_err(|e| RuntimeError::SpmdSetup {
                        detail: format!("cannot start the thread of rank {rank}: {e}"),
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                let result = h?.join().unwrap_or_else(|payload| {
                    // `run_rank` catches panics of the program; this is one in the
                    // executor's own bookkeeping.
                    Err(RuntimeError::RankPanicked {
                        rank,
                        message: panic_message(payload.as_ref()),
                    })
                });
                result.map_err(|e| RuntimeError::OnRank {
                    rank,
                    source: Box::new(e),
                })
            })
            .collect()
    }))
}

/// One rank's thread: runs its program, and on failure tells the other ranks before its
/// communicator goes away.
fn run_rank(
    mut comm: InProcessCommunicator,
    program: RankProgram<'_>,
    options: RunOptions,
) -> Result<RunOutput, RuntimeError> {
    let rank = comm.rank();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        run_with_communicator(
            program.graph,
            program.params,
            program.inputs,
            options,
            &mut comm,
        )
    }));
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
