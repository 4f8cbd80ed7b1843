//! The in-process communicator: ranks are threads of one process and exchange tensors over
//! channels ([`Mailbox`]) with the algorithms of [`super::endpoint`]: ring reduce-scatter and
//! ring all-gather (together, ring all-reduce), pairwise all-to-all, binomial-tree broadcast,
//! and tagged point-to-point messages, with reproducible reductions. The `f32` collectives go
//! through buffers shared between the rank threads instead (`super::shared`); the `f32`
//! all-reduce lends the caller's buffer itself to the group, where the member that arrives
//! last reduces every member's buffer in place.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use autopar_ir::infer::infer;
use autopar_ir::{DeviceMesh, IrError, Op, ReduceKind, TensorType};

use super::Collectives;
use super::blocks::Layout;
use super::endpoint::{Endpoint, delegate_collectives};
use super::floats::check_len;
use super::group::group_members;
use super::mailbox::{CallSignature, Mailbox};
use super::shared::{
    BarrierCall, GroupSlots, Role, Rounding, World, all_reduce_shared, publish, reduce_pieces,
    round_in_place,
};
use crate::error::RuntimeError;
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
///
/// The `f32` collectives ([`Collectives::all_reduce_f32`] and the others but `send_f32` and
/// `recv_f32`, which take the channels) exchange through buffers shared by the group's
/// threads and reused from call to call (an all-reduce lends the caller's own buffer and
/// copies no operand), with the same meaning, bits, timeout and failure reports as the
/// `Tensor` methods.
pub struct InProcessCommunicator {
    inner: Endpoint<Mailbox>,
    world: Arc<World>,
    options: CommOptions,
    /// The groups this rank has used, by the axes that name them.
    groups: HashMap<Vec<String>, Group>,
    /// A piece of an all-to-all on its way from a peer's buffer to the result.
    scratch: Vec<f32>,
}

/// A group of the `f32` path as one member sees it.
#[derive(Clone)]
struct Group {
    members: Arc<[usize]>,
    pos: usize,
    slots: Arc<GroupSlots>,
}

/// The communicators of every rank of `mesh`, indexed by rank (linear mesh coordinate).
pub fn in_process_communicators(
    mesh: &DeviceMesh,
    options: CommOptions,
) -> Vec<InProcessCommunicator> {
    let n = mesh.num_devices();
    let mesh = Arc::new(mesh.clone());
    let world = Arc::new(World::new(n));
    Mailbox::connect(n, options.timeout, &world)
        .into_iter()
        .map(|mailbox| InProcessCommunicator {
            inner: Endpoint::new(Arc::clone(&mesh), mailbox, options.precision),
            world: Arc::clone(&world),
            options,
            groups: HashMap::new(),
            scratch: Vec::new(),
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

/// The read or write guard of a shared buffer (see [`super::shared::lock`] on poisoning).
fn read(slot: &std::sync::RwLock<Vec<f32>>) -> std::sync::RwLockReadGuard<'_, Vec<f32>> {
    slot.read().unwrap_or_else(PoisonError::into_inner)
}

fn write(slot: &std::sync::RwLock<Vec<f32>>) -> std::sync::RwLockWriteGuard<'_, Vec<f32>> {
    slot.write().unwrap_or_else(PoisonError::into_inner)
}

/// `slot[range]`, or an error when a peer published fewer elements than its call declares
/// (which the call check at the first barrier rules out).
fn part<'a>(
    slot: &'a [f32],
    range: std::ops::Range<usize>,
    op: &'static str,
) -> Result<&'a [f32], RuntimeError> {
    let len = slot.len();
    slot.get(range.clone()).ok_or_else(|| {
        IrError::Verify(format!(
            "`{op}`: a peer's buffer holds {len} elements, {range:?} were expected"
        ))
        .into()
    })
}

impl InProcessCommunicator {
    /// `result`, after telling the other ranks of its error.
    fn aborting<R>(&mut self, result: Result<R, RuntimeError>) -> Result<R, RuntimeError> {
        if let Err(e) = &result {
            self.inner.abort(e);
        }
        result
    }

    /// Checks an `f32` call of `op` on `x_len` elements of type `ty`: a float dtype, the
    /// operand's length, the op's typing rule on the mesh; returns the result type.
    fn check(&self, op: &Op, ty: &TensorType, x_len: usize) -> Result<TensorType, RuntimeError> {
        if !ty.dtype.is_float() {
            return Err(RuntimeError::UnsupportedDType {
                op: op.name(),
                dtype: ty.dtype,
            });
        }
        check_len(ty, x_len, "operand")?;
        let mesh = self
            .inner
            .mesh()
            .ok_or_else(|| RuntimeError::NeedsMultiRank { op: op.name() })?;
        infer(op, &[ty], Some(mesh))?
            .pop()
            .ok_or_else(|| IrError::Verify(format!("`{}` declares no result", op.name())).into())
    }

    /// This rank's group over `axes`, with its shared buffers.
    fn group(&mut self, axes: &[String]) -> Result<Group, RuntimeError> {
        if let Some(g) = self.groups.get(axes) {
            return Ok(g.clone());
        }
        let rank = self.inner.rank();
        let mesh = self
            .inner
            .mesh()
            .ok_or(RuntimeError::NeedsMultiRank { op: "collective" })?;
        let members: Arc<[usize]> = group_members(mesh, rank, axes)?.into();
        let pos = members.iter().position(|&m| m == rank).ok_or_else(|| {
            IrError::Verify(format!("rank {rank} is not in its own group {members:?}"))
        })?;
        let g = Group {
            slots: self.world.slots(&members),
            members,
            pos,
        };
        self.groups.insert(axes.to_vec(), g.clone());
        Ok(g)
    }

    fn rounding(&self, ty: &TensorType) -> Rounding {
        Rounding {
            dtype: ty.dtype,
            precision: self.options.precision,
        }
    }

    /// Waits at the group's next barrier; `call` at a collective's first.
    fn barrier(
        &self,
        op: &Op,
        g: &Group,
        call: Option<&Arc<CallSignature>>,
    ) -> Result<(), RuntimeError> {
        self.world.barrier(&BarrierCall {
            op: op.name(),
            members: &g.members,
            pos: g.pos,
            call,
            timeout: self.options.timeout,
        })
    }

    /// The all-reduce of the `f32` path (see [`super::shared`]): `x` is moved into this
    /// member's slot, reduced there together with the others', and moved back, whatever the
    /// outcome. Aborts on its own failures (before taking the buffer back, so that a peer that
    /// finds it gone knows why).
    fn shared_all_reduce(
        &mut self,
        op: &Op,
        x: &mut Vec<f32>,
        ty: &TensorType,
        axes: &[String],
        kind: ReduceKind,
    ) -> Result<(), RuntimeError> {
        let prepared = self.check(op, ty, x.len()).and_then(|_| self.group(axes));
        let g = match prepared {
            Ok(g) => g,
            Err(e) => {
                self.inner.abort(&e);
                return Err(e);
            }
        };
        let rounding = self.rounding(ty);
        if g.members.len() == 1 {
            round_in_place(rounding, x);
            return Ok(());
        }
        self.inner.transport_mut().fault_point(op.name());
        let len = x.len();
        let slot = &g.slots.buffers[g.pos];
        std::mem::swap(&mut *write(slot), x);
        let call = Arc::new(CallSignature::new(op, ty));
        let result = self
            .world
            .elect(&BarrierCall {
                op: op.name(),
                members: &g.members,
                pos: g.pos,
                call: Some(&call),
                timeout: self.options.timeout,
            })
            .and_then(|role| match role {
                Role::Leader => self.lead_all_reduce(op, &g, len, kind, rounding),
                Role::Follower => Ok(()),
            });
        if let Err(e) = &result {
            self.inner.abort(e);
        }
        std::mem::swap(&mut *write(slot), x);
        result
    }

    /// The leader's part of an all-reduce (see [`super::shared`]): with every member's buffer
    /// in its slot and every member waiting, reduces all of them in place, then releases the
    /// others. A failure announced meanwhile (a member that gave up before the leader
    /// arrived) fails the call instead, and the others learn of it where they wait.
    fn lead_all_reduce(
        &self,
        op: &Op,
        g: &Group,
        len: usize,
        kind: ReduceKind,
        rounding: Rounding,
    ) -> Result<(), RuntimeError> {
        {
            let mut guards: Vec<_> = g.slots.buffers.iter().map(write).collect();
            if let Some(short) = guards.iter().find(|b| b.len() != len) {
                return Err(self.short_buffer(op, g, short.len(), 0..len));
            }
            let mut bufs: Vec<&mut [f32]> = guards.iter_mut().map(|b| b.as_mut_slice()).collect();
            all_reduce_shared(kind, rounding, &mut bufs);
        }
        if let Some((failed_rank, reason)) = self.world.failure() {
            return Err(RuntimeError::PeerFailed {
                op: op.name(),
                group: g.members.to_vec(),
                rank: g.members[g.pos],
                failed_rank,
                reason,
            });
        }
        self.world.release(&g.members, g.pos);
        Ok(())
    }

    /// The error for a peer's buffer that holds `have` elements where `range` was expected:
    /// a peer that failed took its buffer back (and said so first); anything else would be a
    /// call the first barrier should have refused.
    fn short_buffer(
        &self,
        op: &Op,
        g: &Group,
        have: usize,
        range: std::ops::Range<usize>,
    ) -> RuntimeError {
        match self.world.failure() {
            Some((failed_rank, reason)) => RuntimeError::PeerFailed {
                op: op.name(),
                group: g.members.to_vec(),
                rank: g.members[g.pos],
                failed_rank,
                reason,
            },
            None => IrError::Verify(format!(
                "`{}`: a peer's buffer holds {have} elements, {range:?} were expected",
                op.name()
            ))
            .into(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn shared_reduce_scatter(
        &mut self,
        op: &Op,
        x: &[f32],
        ty: &TensorType,
        axes: &[String],
        dim: usize,
        kind: ReduceKind,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let result_ty = self.check(op, ty, x.len())?;
        check_len(&result_ty, out.len(), "result")?;
        let rounding = self.rounding(ty);
        let g = self.group(axes)?;
        let (n, pos) = (g.members.len(), g.pos);
        let layout = Layout::split(ty.dims(), dim, n);
        self.inner.transport_mut().fault_point(op.name());
        for j in 0..n {
            let mut slot = write(&g.slots.inputs[pos][j]);
            layout.take_into(x, j, &mut slot);
        }
        let call = Arc::new(CallSignature::new(op, ty));
        self.barrier(op, &g, Some(&call))?;
        let srcs = (1..=n)
            .map(|k| read(&g.slots.inputs[(pos + k) % n][pos]))
            .collect::<Vec<_>>();
        let len = out.len();
        if let Some(short) = srcs.iter().find(|s| s.len() != len) {
            return Err(IrError::Verify(format!(
                "`{}`: a peer's buffer holds {} elements, {len} were expected",
                op.name(),
                short.len()
            ))
            .into());
        }
        reduce_pieces(
            kind,
            rounding,
            n,
            #[inline(always)]
            |k| &srcs[k][..],
            out,
        );
        drop(srcs);
        self.barrier(op, &g, None)
    }

    fn shared_all_gather(
        &mut self,
        op: &Op,
        x: &[f32],
        ty: &TensorType,
        axes: &[String],
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let result_ty = self.check(op, ty, x.len())?;
        check_len(&result_ty, out.len(), "result")?;
        let g = self.group(axes)?;
        let (n, pos) = (g.members.len(), g.pos);
        let layout = Layout::join(ty.dims(), dim, n);
        self.inner.transport_mut().fault_point(op.name());
        publish(&g.slots.inputs[pos][0], x);
        let call = Arc::new(CallSignature::new(op, ty));
        self.barrier(op, &g, Some(&call))?;
        for m in 0..n {
            if m == pos {
                layout.put(out, m, x);
            } else {
                let src = read(&g.slots.inputs[m][0]);
                layout.put(out, m, part(&src, 0..x.len(), op.name())?);
            }
        }
        self.barrier(op, &g, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn shared_all_to_all(
        &mut self,
        op: &Op,
        x: &[f32],
        ty: &TensorType,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let result_ty = self.check(op, ty, x.len())?;
        check_len(&result_ty, out.len(), "result")?;
        let g = self.group(axes)?;
        let (n, pos) = (g.members.len(), g.pos);
        let split = Layout::split(ty.dims(), split_dim, n);
        let mut piece_dims = ty.dims().to_vec();
        piece_dims[split_dim] /= n;
        let join = Layout::join(&piece_dims, concat_dim, n);
        self.inner.transport_mut().fault_point(op.name());
        publish(&g.slots.inputs[pos][0], x);
        let call = Arc::new(CallSignature::new(op, ty));
        self.barrier(op, &g, Some(&call))?;
        let mut piece = std::mem::take(&mut self.scratch);
        for m in 0..n {
            if m == pos {
                split.take_into(x, pos, &mut piece);
            } else {
                let src = read(&g.slots.inputs[m][0]);
                split.take_into(part(&src, 0..x.len(), op.name())?, pos, &mut piece);
            }
            join.put(out, m, &piece);
        }
        self.scratch = piece;
        self.barrier(op, &g, None)
    }

    fn shared_broadcast(
        &mut self,
        op: &Op,
        x: &mut [f32],
        ty: &TensorType,
        axes: &[String],
        root: usize,
    ) -> Result<(), RuntimeError> {
        self.check(op, ty, x.len())?;
        let g = self.group(axes)?;
        if g.members.len() == 1 {
            return Ok(());
        }
        if g.pos == root {
            self.inner.transport_mut().fault_point(op.name());
            publish(&g.slots.inputs[root][0], x);
        }
        let call = Arc::new(CallSignature::new(op, ty));
        self.barrier(op, &g, Some(&call))?;
        if g.pos != root {
            let src = read(&g.slots.inputs[root][0]);
            let len = x.len();
            x.copy_from_slice(part(&src, 0..len, op.name())?);
        }
        self.barrier(op, &g, None)
    }
}

delegate_collectives!(InProcessCommunicator, {
    fn all_reduce_f32(
        &mut self,
        x: &mut Vec<f32>,
        ty: &TensorType,
        axes: &[String],
        reduce: ReduceKind,
    ) -> Result<(), RuntimeError> {
        let op = Op::AllReduce {
            axes: axes.to_vec(),
            reduce,
        };
        self.shared_all_reduce(&op, x, ty, axes, reduce)
    }

    fn all_gather_f32(
        &mut self,
        x: &[f32],
        ty: &TensorType,
        axes: &[String],
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let op = Op::AllGather {
            axes: axes.to_vec(),
            dim,
        };
        let result = self.shared_all_gather(&op, x, ty, axes, dim, out);
        self.aborting(result)
    }

    fn reduce_scatter_f32(
        &mut self,
        x: &[f32],
        ty: &TensorType,
        axes: &[String],
        dim: usize,
        reduce: ReduceKind,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let op = Op::ReduceScatter {
            axes: axes.to_vec(),
            dim,
            reduce,
        };
        let result = self.shared_reduce_scatter(&op, x, ty, axes, dim, reduce, out);
        self.aborting(result)
    }

    fn all_to_all_f32(
        &mut self,
        x: &[f32],
        ty: &TensorType,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let op = Op::AllToAll {
            axes: axes.to_vec(),
            split_dim,
            concat_dim,
        };
        let result = self.shared_all_to_all(&op, x, ty, axes, split_dim, concat_dim, out);
        self.aborting(result)
    }

    fn broadcast_f32(
        &mut self,
        x: &mut [f32],
        ty: &TensorType,
        axes: &[String],
        root: usize,
    ) -> Result<(), RuntimeError> {
        let op = Op::CollectiveBroadcast {
            axes: axes.to_vec(),
            root,
        };
        let result = self.shared_broadcast(&op, x, ty, axes, root);
        self.aborting(result)
    }
});
