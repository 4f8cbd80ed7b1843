//! The in-process communicator: ranks are threads of one process and exchange tensors over
//! channels ([`Mailbox`]) with the algorithms of [`super::endpoint`]: ring reduce-scatter and
//! ring all-gather (together, ring all-reduce), pairwise all-to-all, binomial-tree broadcast,
//! and tagged point-to-point messages, with reproducible reductions.

use std::sync::Arc;
use std::time::Duration;

use autopar_ir::DeviceMesh;

use super::endpoint::{Endpoint, delegate_collectives};
use super::mailbox::Mailbox;
use crate::tensor::Precision;

/// Options of a rank's communicator (in-process or MPI).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommOptions {
    /// How long a rank waits for any one message before the collective fails with
    /// [`RuntimeError::CollectiveTimeout`](crate::RuntimeError::CollectiveTimeout).
    pub timeout: Duration,
    /// Whether reduction results are rounded to their declared dtypes (as
    /// [`crate::RunOptions::precision`] says for the interpreter).
    pub precision: Precision,
}

impl CommOptions {
    /// The default timeout: five minutes, long enough for a rank that computes a large
    /// pipeline stage between two messages, or a 64 MiB collective on a loaded machine; a run
    /// that must fail sooner sets its own (`--collective-timeout`).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Self::DEFAULT_TIMEOUT,
            precision: Precision::Declared,
        }
    }
}

/// One rank's communicator. Create all of them at once with [`in_process_communicators`],
/// move each to its rank's thread, and hand it to an executor as its [`Collectives`](super::Collectives) (or
/// call its methods, or [`super::communicate`], directly).
///
/// Members of a group must call the collectives on that group in the same order with the
/// same op, attributes and operand type. A member that does otherwise fails the run: the
/// ranks that exchange messages with it report a collective mismatch (or, when it waits in a
/// collective on another group, a timeout), and every other rank the peer's failure at its
/// next wait ([`crate::RuntimeError`]). Dropping a
/// communicator tells the others it has gone.
///
/// The timeout bounds each wait for one message, whatever the peer is doing; a rank that
/// computes for longer than that between two collectives needs a longer timeout.
pub struct InProcessCommunicator {
    inner: Endpoint<Mailbox>,
}

/// The communicators of every rank of `mesh`, indexed by rank (linear mesh coordinate).
pub fn in_process_communicators(
    mesh: &DeviceMesh,
    options: CommOptions,
) -> Vec<InProcessCommunicator> {
    let n = mesh.num_devices();
    let mesh = Arc::new(mesh.clone());
    Mailbox::connect(n, options.timeout)
        .into_iter()
        .map(|mailbox| InProcessCommunicator {
            inner: Endpoint::new(Arc::clone(&mesh), mailbox, options.precision),
        })
        .collect()
}

impl InProcessCommunicator {
    /// Fault injection for tests: this rank panics when it is about to send its `(n + 1)`-th
    /// data message from now on (`0`: at its next send), in the middle of whatever collective
    /// it is running.
    pub fn panic_after_sends(&mut self, n: usize) {
        self.inner.transport_mut().panic_after_sends(n);
    }
}

delegate_collectives!(InProcessCommunicator);
