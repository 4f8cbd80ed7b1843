//! The [`Backend`] seam: what executes rank programs. A backend holds tensors in its own
//! buffers, loads a rank program with its [`ExecutionPlan`] into an executable once, and
//! executes it as often as needed against parameters, inputs and a [`Collectives`].
//! [`CpuBackend`], the reference interpreter, is the first implementation; a CUDA backend
//! (device buffers, one arena allocation per rank of [`ExecutionPlan::arena_bytes`], kernels
//! compiled at load time) fits behind the same trait.

use std::collections::BTreeMap;

use autopar_ir::Graph;

use crate::TensorMap;
use crate::comm::Collectives;
use crate::error::RuntimeError;
use crate::interp::{RunOptions, RunOutput, run_planned};
use crate::plan::ExecutionPlan;
use crate::tensor::Tensor;

/// Executes rank programs on one kind of device.
pub trait Backend {
    /// A tensor held by the backend (host memory, a device buffer).
    type Buffer;

    /// A rank program ready to execute, which may borrow the graph it was loaded from.
    type Executable<'g>;

    /// Copies `tensor` into a new buffer.
    fn upload(&self, tensor: &Tensor) -> Result<Self::Buffer, RuntimeError>;

    /// Reads `buffer` back as a tensor.
    fn download(&self, buffer: &Self::Buffer) -> Result<Tensor, RuntimeError>;

    /// Prepares `graph` (one rank's local program) to run in the order, and with the memory,
    /// of `plan`, which must have been built from it.
    fn load<'g>(
        &self,
        graph: &'g Graph,
        plan: ExecutionPlan,
    ) -> Result<Self::Executable<'g>, RuntimeError>;

    /// Runs `executable` once, on parameters and inputs by name (extra entries are ignored),
    /// handing its communication ops to `comm`.
    fn execute(
        &self,
        executable: &Self::Executable<'_>,
        params: &BTreeMap<String, Self::Buffer>,
        inputs: &BTreeMap<String, Self::Buffer>,
        comm: &mut dyn Collectives,
    ) -> Result<RunOutput<Self::Buffer>, RuntimeError>;
}

/// The reference interpreter as a backend: buffers are host [`Tensor`]s, loading keeps the
/// graph and its plan, and executing interprets the plan op by op.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuBackend {
    /// Options of every run (whether results are rounded to their declared dtypes).
    pub options: RunOptions,
}

/// A rank program loaded by [`CpuBackend`]: the graph and its plan.
#[derive(Clone, Debug)]
pub struct CpuExecutable<'g> {
    graph: &'g Graph,
    plan: ExecutionPlan,
}

impl CpuExecutable<'_> {
    /// The graph it runs.
    pub fn graph(&self) -> &Graph {
        self.graph
    }

    /// The plan it runs by.
    pub fn plan(&self) -> &ExecutionPlan {
        &self.plan
    }
}

impl Backend for CpuBackend {
    type Buffer = Tensor;
    type Executable<'g> = CpuExecutable<'g>;

    fn upload(&self, tensor: &Tensor) -> Result<Tensor, RuntimeError> {
        Ok(tensor.clone())
    }

    fn download(&self, buffer: &Tensor) -> Result<Tensor, RuntimeError> {
        Ok(buffer.clone())
    }

    fn load<'g>(
        &self,
        graph: &'g Graph,
        plan: ExecutionPlan,
    ) -> Result<CpuExecutable<'g>, RuntimeError> {
        Ok(CpuExecutable { graph, plan })
    }

    fn execute(
        &self,
        executable: &CpuExecutable<'_>,
        params: &TensorMap,
        inputs: &TensorMap,
        comm: &mut dyn Collectives,
    ) -> Result<RunOutput, RuntimeError> {
        run_planned(
            executable.graph,
            &executable.plan,
            params,
            inputs,
            self.options,
            comm,
        )
    }
}
