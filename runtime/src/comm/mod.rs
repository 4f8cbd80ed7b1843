//! Communication between ranks: the [`Collectives`] trait a process group implements (threads
//! of one process, MPI processes; NCCL devices later), the one mapping of the IR's
//! communication ops onto it ([`communicate`]), groups derived from mesh axes, and the
//! implementations.
//!
//! [`InProcessCommunicator`] implements [`Collectives`] for ranks that are threads of one
//! process, and `MpiCommunicator` (feature `mpi`) for ranks that are MPI processes; both run
//! the same ring, pairwise and tree algorithms (`endpoint`) over their own transport, so they
//! give the same bits. No collective can hang: a receive waits at most
//! [`CommOptions::timeout`], and a rank that fails or goes away makes the others fail at their
//! next receive. [`SingleDevice`] is the process group of a lone device, which has no peers.
//!
//! Backends that hold floats as `f32` call the `*_f32` methods of [`Collectives`] (or
//! [`communicate_f32`]) on their own buffers: by default these go through the `Tensor`
//! methods, and the in-process communicator overrides them with buffers shared between the
//! rank threads (`shared`), reused from call to call; its all-reduce moves each rank's buffer
//! into the group's slots and reduces it there, reading and writing every element once.

mod blocks;
mod endpoint;
mod floats;
mod group;
mod in_process;
mod mailbox;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod shared;

use autopar_ir::infer::infer;
use autopar_ir::{DeviceMesh, IrError, Op, ReduceKind, TensorType};

#[cfg(feature = "mpi")]
pub use self::mpi::MpiCommunicator;
pub use floats::communicate_f32;
pub use group::{group_members, shifted_rank};
pub use in_process::{CommOptions, InProcessCommunicator, in_process_communicators};

use crate::error::RuntimeError;
use crate::tensor::Tensor;

/// The collectives and point-to-point messages of one rank of a process group.
///
/// A group is named as the IR names it: the mesh axes it spans (`axes`), its members ordered
/// as [`group_members`] says; a point-to-point peer is the rank `shift` steps along one mesh
/// axis ([`shifted_rank`]). The members of a group must call the collectives on that group
/// in the same order with the same attributes and operand types. Every method is one rank's
/// part of the exchange and returns this rank's result.
///
/// An implementation moves data and reports failures; it need not check operands against the
/// IR's typing rules when called through [`communicate`], which has done so. A failed call
/// leaves the rank out of step with its groups, so an implementation [aborts](Self::abort)
/// on its own failures; executors abort when a rank's program fails elsewhere.
///
/// The conformance suite in `runtime/tests/comm_collectives.rs` and
/// `runtime/tests/comm_failures.rs` is written against this trait; every implementation
/// passes it, through the `Tensor` methods and through the `f32` ones.
///
/// # The `f32` path
///
/// A backend that stores f32, bf16 and f16 tensors as `f32` elements (bf16 and f16 values
/// are exact in `f32`) calls the `*_f32` methods on its own buffers instead of building
/// [`Tensor`]s. Each takes the operand's elements and its declared type `ty` (dtype and
/// dims; the dtype must be a float one), and writes the result into the caller's buffer,
/// `out` or the operand itself, which must hold exactly the elements of the result type the
/// IR's typing rule gives. Their meaning is the `Tensor` method's, to the bit: the same group
/// order, the same slice kept by each member, the same reduction order (partial sums in
/// `f64`, rounded once to the declared dtype unless the communicator keeps `f64`
/// ([`Precision::F64`](crate::Precision::F64)), in which case they are rounded to `f32`, the
/// most an `f32` buffer holds). Every member of a group makes the same call: all of them the
/// `f32` method, or all of them the `Tensor` one (a group that mixes the two fails by
/// timeout). The default implementations go through the `Tensor` methods, so every
/// implementation has them; the in-process communicator overrides them with shared buffers.
pub trait Collectives {
    /// This rank: its linear coordinate on the mesh.
    fn rank(&self) -> usize;

    /// The mesh the ranks form; `None` for a lone device, which has no mesh.
    fn mesh(&self) -> Option<&DeviceMesh>;

    /// Reduces `x` over the group on `axes`; every member gets the whole result.
    fn all_reduce(
        &mut self,
        x: &Tensor,
        axes: &[String],
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError>;

    /// Concatenates the members' `x` along `dim`, in group order.
    fn all_gather(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
    ) -> Result<Tensor, RuntimeError>;

    /// Reduces `x` over the group; member `i` keeps the `i`-th of the group-size slices of
    /// `dim`.
    fn reduce_scatter(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError>;

    /// Splits `split_dim` of `x` into group-size pieces, sends piece `j` to member `j`, and
    /// concatenates the pieces that arrive along `concat_dim`, in group order.
    fn all_to_all(
        &mut self,
        x: &Tensor,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor, RuntimeError>;

    /// Every member gets the `x` of group member `root`.
    fn broadcast(
        &mut self,
        x: &Tensor,
        axes: &[String],
        root: usize,
    ) -> Result<Tensor, RuntimeError>;

    /// Sends `x` to the rank `shift` steps along mesh axis `axis` (wrapping). Messages between
    /// two ranks arrive in the order they were sent.
    fn send(&mut self, x: &Tensor, axis: &str, shift: i64) -> Result<(), RuntimeError>;

    /// Receives the next message, of type `ty`, from the rank `shift` steps along mesh axis
    /// `axis`.
    fn recv(&mut self, ty: &TensorType, axis: &str, shift: i64) -> Result<Tensor, RuntimeError>;

    /// Tells every other rank that this rank has failed with `error`, so that they stop
    /// waiting for it at once. An error that only reports another rank's failure passes that
    /// failure on.
    fn abort(&mut self, error: &RuntimeError);

    /// [`all_reduce`](Self::all_reduce) of the `f32` elements `x`, of declared type `ty`, in
    /// place: every member ends with the whole reduction. `x` is a `Vec` so that an
    /// implementation may lend the buffer itself to its peers for the duration of the call
    /// (the in-process communicator does); the caller gets it back, with its allocation, on
    /// success and on failure.
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
        let t = floats::operand(self, &op, ty, x)?;
        let r = self.all_reduce(&t, axes, reduce)?;
        floats::write_result(self, &op, &r, x)
    }

    /// [`all_gather`](Self::all_gather) of `x` (declared type `ty`) along `dim` into `out`.
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
        let t = floats::operand(self, &op, ty, x)?;
        let r = self.all_gather(&t, axes, dim)?;
        floats::write_result(self, &op, &r, out)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) of `x` (declared type `ty`) along `dim` into
    /// `out`, this member's slice.
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
        let t = floats::operand(self, &op, ty, x)?;
        let r = self.reduce_scatter(&t, axes, dim, reduce)?;
        floats::write_result(self, &op, &r, out)
    }

    /// [`all_to_all`](Self::all_to_all) of `x` (declared type `ty`) into `out`.
    #[allow(clippy::too_many_arguments)]
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
        let t = floats::operand(self, &op, ty, x)?;
        let r = self.all_to_all(&t, axes, split_dim, concat_dim)?;
        floats::write_result(self, &op, &r, out)
    }

    /// [`broadcast`](Self::broadcast) in place: every member's `x` (declared type `ty`)
    /// becomes group member `root`'s.
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
        let t = floats::operand(self, &op, ty, x)?;
        let r = self.broadcast(&t, axes, root)?;
        floats::write_result(self, &op, &r, x)
    }

    /// [`send`](Self::send) of `x`, of declared type `ty`.
    fn send_f32(
        &mut self,
        x: &[f32],
        ty: &TensorType,
        axis: &str,
        shift: i64,
    ) -> Result<(), RuntimeError> {
        let op = Op::Send {
            axis: axis.to_string(),
            shift,
        };
        let t = floats::operand(self, &op, ty, x)?;
        self.send(&t, axis, shift)
    }

    /// [`recv`](Self::recv) of a message of type `ty` into `out`.
    fn recv_f32(
        &mut self,
        out: &mut [f32],
        ty: &TensorType,
        axis: &str,
        shift: i64,
    ) -> Result<(), RuntimeError> {
        let op = Op::Recv {
            axis: axis.to_string(),
            shift,
            ty: ty.clone(),
        };
        floats::check_float(self, &op, ty)?;
        let r = self.recv(ty, axis, shift)?;
        floats::write_result(self, &op, &r, out)
    }
}

/// Carries out the IR communication op `op` on this rank's `operands` with `comm`, returning
/// its results (none for `send`): the one mapping from the IR's ops onto [`Collectives`].
///
/// The operands are checked against the op's typing rule on `comm`'s mesh first, and the
/// results against the types it declares. A failed check [aborts](Collectives::abort)
/// `comm`, since this rank can no longer keep step with its groups (a failed call has
/// aborted it already).
pub fn communicate(
    comm: &mut dyn Collectives,
    op: &Op,
    operands: &[&Tensor],
) -> Result<Vec<Tensor>, RuntimeError> {
    let declared = match check_operands(comm, op, operands) {
        Ok(declared) => declared,
        Err(e) => {
            comm.abort(&e);
            return Err(e);
        }
    };
    let results = dispatch(comm, op, operands)?;
    if let Some(declared) = declared
        && !results.iter().map(Tensor::ty).eq(declared.iter())
    {
        let e = RuntimeError::from(IrError::Verify(format!(
            "`{}` was declared to give {declared:?} but gives {:?}",
            op.name(),
            results.iter().map(Tensor::ty).collect::<Vec<_>>()
        )));
        comm.abort(&e);
        return Err(e);
    }
    Ok(results)
}

/// The result types `op` declares for `operands` on `comm`'s mesh (`None` without a mesh:
/// a lone device refuses every op in its own words).
fn check_operands(
    comm: &dyn Collectives,
    op: &Op,
    operands: &[&Tensor],
) -> Result<Option<Vec<TensorType>>, RuntimeError> {
    if !op.is_communication() {
        return Err(IrError::Verify(format!("`{}` is not a communication op", op.name())).into());
    }
    let arity = usize::from(!matches!(op, Op::Recv { .. }));
    if operands.len() != arity {
        return Err(IrError::Verify(format!(
            "`{}` takes {arity} operand(s) but was given {}",
            op.name(),
            operands.len()
        ))
        .into());
    }
    let types: Vec<&TensorType> = operands.iter().map(|t| t.ty()).collect();
    Ok(match comm.mesh() {
        Some(mesh) => Some(infer(op, &types, Some(mesh))?),
        None => None,
    })
}

/// The typed call of `op`, whose operands [`check_operands`] has checked.
fn dispatch(
    comm: &mut dyn Collectives,
    op: &Op,
    operands: &[&Tensor],
) -> Result<Vec<Tensor>, RuntimeError> {
    let x = || {
        operands.first().copied().ok_or_else(|| {
            RuntimeError::from(IrError::Verify(format!("`{}` needs an operand", op.name())))
        })
    };
    Ok(match op {
        Op::AllReduce { axes, reduce } => vec![comm.all_reduce(x()?, axes, *reduce)?],
        Op::AllGather { axes, dim } => vec![comm.all_gather(x()?, axes, *dim)?],
        Op::ReduceScatter { axes, dim, reduce } => {
            vec![comm.reduce_scatter(x()?, axes, *dim, *reduce)?]
        }
        Op::AllToAll {
            axes,
            split_dim,
            concat_dim,
        } => vec![comm.all_to_all(x()?, axes, *split_dim, *concat_dim)?],
        Op::CollectiveBroadcast { axes, root } => vec![comm.broadcast(x()?, axes, *root)?],
        Op::Send { axis, shift } => {
            comm.send(x()?, axis, *shift)?;
            Vec::new()
        }
        Op::Recv { axis, shift, ty } => vec![comm.recv(ty, axis, *shift)?],
        other => {
            return Err(
                IrError::Verify(format!("`{}` is not a communication op", other.name())).into(),
            );
        }
    })
}

/// The process group of a lone device: it has no peers and no mesh, so every collective and
/// point-to-point op is [`RuntimeError::NeedsMultiRank`].
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleDevice;

impl SingleDevice {
    fn refuse<T>(op: &'static str) -> Result<T, RuntimeError> {
        Err(RuntimeError::NeedsMultiRank { op })
    }
}

impl Collectives for SingleDevice {
    fn rank(&self) -> usize {
        0
    }

    fn mesh(&self) -> Option<&DeviceMesh> {
        None
    }

    fn all_reduce(
        &mut self,
        _: &Tensor,
        _: &[String],
        _: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        Self::refuse("all_reduce")
    }

    fn all_gather(&mut self, _: &Tensor, _: &[String], _: usize) -> Result<Tensor, RuntimeError> {
        Self::refuse("all_gather")
    }

    fn reduce_scatter(
        &mut self,
        _: &Tensor,
        _: &[String],
        _: usize,
        _: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        Self::refuse("reduce_scatter")
    }

    fn all_to_all(
        &mut self,
        _: &Tensor,
        _: &[String],
        _: usize,
        _: usize,
    ) -> Result<Tensor, RuntimeError> {
        Self::refuse("all_to_all")
    }

    fn broadcast(&mut self, _: &Tensor, _: &[String], _: usize) -> Result<Tensor, RuntimeError> {
        Self::refuse("collective_broadcast")
    }

    fn send(&mut self, _: &Tensor, _: &str, _: i64) -> Result<(), RuntimeError> {
        Self::refuse("send")
    }

    fn recv(&mut self, _: &TensorType, _: &str, _: i64) -> Result<Tensor, RuntimeError> {
        Self::refuse("recv")
    }

    fn abort(&mut self, _: &RuntimeError) {}
}
