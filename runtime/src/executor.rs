//! The multi-rank executor: runs one local program per rank of a device mesh, each rank
//! started by a [`Launcher`] (one thread per rank) and its program run by a [`Backend`] (the
//! reference interpreter), the ranks' collectives going through their [`crate::Collectives`].
//!
//! Ranks are linear mesh coordinates. Every rank may run its own graph (pipeline stages) or
//! all may share one (plain SPMD); whatever they run, the members of a group must reach
//! their collectives on that group in the same order. A rank that fails makes the others
//! fail promptly, and the run reports the failure that started it, with its rank.

use std::time::Duration;

use autopar_ir::{DeviceMesh, Graph};

use crate::TensorMap;
use crate::backend::{Backend, CpuBackend};
use crate::comm::CommOptions;
use crate::error::RuntimeError;
use crate::interp::{RunOptions, RunOutput};
use crate::launch::{Launcher, ThreadLauncher, root_cause};
use crate::plan::ExecutionPlan;

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
    let results = results.into_iter().enumerate().collect();
    Ok(root_cause(results)?
        .into_iter()
        .map(|(_, out)| out)
        .collect())
}

/// Like [`run_spmd`], but returns each rank's own result (errors wrapped in
/// [`RuntimeError::OnRank`]). The outer error is for a run that cannot start: the wrong
/// number of programs, or a program attached to another mesh.
///
/// A thin user of the seam: [`ThreadLauncher`] starts the ranks and [`CpuBackend`] loads and
/// runs each rank's program.
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
    let launcher = ThreadLauncher {
        options: CommOptions {
            timeout: options.timeout,
            precision: options.run.precision,
        },
    };
    let backend = CpuBackend {
        options: options.run,
    };
    let results = launcher.launch(mesh, |comm| {
        let program = ranks
            .get(comm.rank())
            .ok_or_else(|| RuntimeError::SpmdSetup {
                detail: format!("no program for rank {}", comm.rank()),
            })?;
        let plan = ExecutionPlan::new(program.graph)?;
        let executable = backend.load(program.graph, plan)?;
        backend.execute(&executable, program.params, program.inputs, comm)
    })?;
    Ok(results.into_iter().map(|(_, r)| r).collect())
}
