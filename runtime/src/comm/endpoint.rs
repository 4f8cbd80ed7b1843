//! The collective algorithms every communicator of this crate runs, whatever carries its
//! messages: ring reduce-scatter and ring all-gather (together, ring all-reduce), pairwise
//! all-to-all, binomial-tree broadcast, and tagged point-to-point messages, over a
//! [`Transport`] (threads of one process, or MPI processes).
//!
//! Reductions are reproducible: in the ring, slice `c` of the result is accumulated starting
//! at group member `c + 1` and going around the ring, an order fixed by the ring positions,
//! never by timing, so repeated runs give the same bits, and so does every transport; and since
//! each slice is reduced once and then copied around, every member receives the same bits.
//! Partial sums travel in `f64` (the runtime's accumulation width) and are rounded to the
//! declared dtype once, at the end, as the interpreter rounds every op's result. A different
//! group size, or a different group order, adds in a different order and may round the last
//! bit differently.

use std::collections::HashMap;
use std::sync::Arc;

use autopar_ir::infer::infer;
use autopar_ir::{DeviceMesh, IrError, Op, ReduceKind, TensorType};

use super::Collectives;
use super::blocks::{Element, Layout, check_reducible, chunk_bounds};
use super::group::{group_members, shifted_rank};
use super::mailbox::{CallSignature, Channel, Context, Transport, describe};
use crate::error::RuntimeError;
use crate::tensor::map_data;
use crate::tensor::{Data, Precision, Tensor};

/// Runs a generic collective on whichever element type `data` holds: `$body` gives a
/// `Result<Vec<T>, RuntimeError>`, the whole a `Data` of the same kind (or returns the
/// error).
macro_rules! for_each_kind {
    ($data:expr, |$v:ident| $body:expr) => {
        map_data!($data, |$v| $body?)
    };
}

/// Implements [`Collectives`] for a communicator struct by handing every call to its
/// `inner` [`Endpoint`]; items in braces after the type (overrides of the `f32` methods) join
/// the impl.
macro_rules! delegate_collectives {
    ($ty:ty) => {
        $crate::comm::endpoint::delegate_collectives!($ty, {});
    };
    ($ty:ty, { $($extra:tt)* }) => {
        impl $crate::comm::Collectives for $ty {
            $($extra)*

            fn rank(&self) -> usize {
                self.inner.rank()
            }

            fn mesh(&self) -> Option<&autopar_ir::DeviceMesh> {
                self.inner.mesh()
            }

            fn all_reduce(
                &mut self,
                x: &$crate::Tensor,
                axes: &[String],
                reduce: autopar_ir::ReduceKind,
            ) -> Result<$crate::Tensor, $crate::RuntimeError> {
                self.inner.all_reduce(x, axes, reduce)
            }

            fn all_gather(
                &mut self,
                x: &$crate::Tensor,
                axes: &[String],
                dim: usize,
            ) -> Result<$crate::Tensor, $crate::RuntimeError> {
                self.inner.all_gather(x, axes, dim)
            }

            fn reduce_scatter(
                &mut self,
                x: &$crate::Tensor,
                axes: &[String],
                dim: usize,
                reduce: autopar_ir::ReduceKind,
            ) -> Result<$crate::Tensor, $crate::RuntimeError> {
                self.inner.reduce_scatter(x, axes, dim, reduce)
            }

            fn all_to_all(
                &mut self,
                x: &$crate::Tensor,
                axes: &[String],
                split_dim: usize,
                concat_dim: usize,
            ) -> Result<$crate::Tensor, $crate::RuntimeError> {
                self.inner.all_to_all(x, axes, split_dim, concat_dim)
            }

            fn broadcast(
                &mut self,
                x: &$crate::Tensor,
                axes: &[String],
                root: usize,
            ) -> Result<$crate::Tensor, $crate::RuntimeError> {
                self.inner.broadcast(x, axes, root)
            }

            fn send(
                &mut self,
                x: &$crate::Tensor,
                axis: &str,
                shift: i64,
            ) -> Result<(), $crate::RuntimeError> {
                self.inner.send(x, axis, shift)
            }

            fn recv(
                &mut self,
                ty: &autopar_ir::TensorType,
                axis: &str,
                shift: i64,
            ) -> Result<$crate::Tensor, $crate::RuntimeError> {
                self.inner.recv(ty, axis, shift)
            }

            fn abort(&mut self, error: &$crate::RuntimeError) {
                self.inner.abort(error)
            }
        }
    };
}
pub(crate) use delegate_collectives;

/// One rank's end of a process group: its mesh, its transport, and the sequence numbers that
/// tell its collectives and messages apart. The public communicators wrap one.
pub(crate) struct Endpoint<T> {
    mesh: Arc<DeviceMesh>,
    transport: T,
    precision: Precision,
    /// Number of collectives this rank has started on each group.
    collectives: HashMap<Arc<[usize]>, u64>,
    /// Point-to-point messages sent to and received from each rank.
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl<T: Transport> Endpoint<T> {
    /// The endpoint of `transport`'s rank on `mesh`.
    pub(crate) fn new(mesh: Arc<DeviceMesh>, transport: T, precision: Precision) -> Self {
        let n = mesh.num_devices();
        Endpoint {
            mesh,
            transport,
            precision,
            collectives: HashMap::new(),
            sent: vec![0; n],
            received: vec![0; n],
        }
    }

    /// The transport underneath.
    pub(crate) fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The declared result type of `op` on this rank's operand `x` (checked against the op's
    /// typing rule on the mesh, so that a direct call with a bad operand fails cleanly).
    fn result_type(&self, op: &Op, x: &Tensor) -> Result<TensorType, RuntimeError> {
        let mut types = infer(op, &[x.ty()], Some(&self.mesh))?;
        types
            .pop()
            .ok_or_else(|| IrError::Verify(format!("`{}` declares no result", op.name())).into())
    }

    /// `result`, after aborting on its error: a failed op leaves this rank out of step with
    /// its groups, so the other ranks must fail too, at their next wait, rather than wait for
    /// this one.
    fn aborting<R>(&mut self, result: Result<R, RuntimeError>) -> Result<R, RuntimeError> {
        if let Err(e) = &result {
            self.transport.announce_error(e);
        }
        result
    }

    fn all_reduce_as(
        &mut self,
        op: &Op,
        x: &Tensor,
        axes: &[String],
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        let ty = self.result_type(op, x)?;
        check_reducible(op.name(), reduce, x.dtype())?;
        let precision = self.precision;
        let mut round = self.begin(op, axes, x.ty())?;
        let data = for_each_kind!(x.data(), |v| round.all_reduce(reduce, v));
        reduced(&ty, data, precision)
    }

    fn reduce_scatter_as(
        &mut self,
        op: &Op,
        x: &Tensor,
        axes: &[String],
        dim: usize,
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        let ty = self.result_type(op, x)?;
        check_reducible(op.name(), reduce, x.dtype())?;
        let precision = self.precision;
        let mut round = self.begin(op, axes, x.ty())?;
        let layout = Layout::split(x.dims(), dim, round.size());
        let data = for_each_kind!(x.data(), |v| round.reduce_scatter_along(reduce, v, layout));
        reduced(&ty, data, precision)
    }

    fn all_gather_as(
        &mut self,
        op: &Op,
        x: &Tensor,
        axes: &[String],
        dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        let ty = self.result_type(op, x)?;
        let mut round = self.begin(op, axes, x.ty())?;
        let layout = Layout::join(x.dims(), dim, round.size());
        let data = for_each_kind!(x.data(), |v| round.all_gather(v, layout));
        tensor(&ty, data)
    }

    fn all_to_all_as(
        &mut self,
        op: &Op,
        x: &Tensor,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        let ty = self.result_type(op, x)?;
        let mut round = self.begin(op, axes, x.ty())?;
        let n = round.size();
        let split = Layout::split(x.dims(), split_dim, n);
        let mut piece_dims = x.dims().to_vec();
        piece_dims[split_dim] /= n;
        let join = Layout::join(&piece_dims, concat_dim, n);
        let data = for_each_kind!(x.data(), |v| round.all_to_all(v, split, join));
        tensor(&ty, data)
    }

    fn broadcast_as(
        &mut self,
        op: &Op,
        x: &Tensor,
        axes: &[String],
        root: usize,
    ) -> Result<Tensor, RuntimeError> {
        let ty = self.result_type(op, x)?;
        let mut round = self.begin(op, axes, x.ty())?;
        let data = for_each_kind!(x.data(), |v| round.broadcast(root, v));
        tensor(&ty, data)
    }

    /// Starts the next collective on the group over `axes`.
    fn begin(
        &mut self,
        op: &Op,
        axes: &[String],
        operand: &TensorType,
    ) -> Result<Round<'_, T>, RuntimeError> {
        let rank = self.rank();
        let members: Arc<[usize]> = group_members(&self.mesh, rank, axes)?.into();
        let pos = members.iter().position(|&m| m == rank).ok_or_else(|| {
            IrError::Verify(format!("rank {rank} is not in its own group {members:?}"))
        })?;
        let count = self.collectives.entry(Arc::clone(&members)).or_insert(0);
        let seq = *count;
        *count += 1;
        Ok(Round {
            transport: &mut self.transport,
            op: op.name(),
            call: Arc::new(CallSignature::new(op, operand)),
            members,
            pos,
            seq,
        })
    }

    fn send_as(&mut self, op: &Op, axis: &str, shift: i64, x: &Tensor) -> Result<(), RuntimeError> {
        infer(op, &[x.ty()], Some(&self.mesh))?;
        let rank = self.rank();
        let to = shifted_rank(&self.mesh, rank, axis, shift)?;
        let seq = self.sent[to];
        self.sent[to] += 1;
        let call = Arc::new(CallSignature::new(op, x.ty()));
        let group = [rank, to];
        let cx = Context {
            op: op.name(),
            group: &group,
        };
        self.transport.send(
            to,
            Channel::PointToPoint { seq },
            &call,
            x.data().clone(),
            &cx,
        )
    }

    fn recv_as(
        &mut self,
        op: &Op,
        axis: &str,
        shift: i64,
        ty: &TensorType,
    ) -> Result<Tensor, RuntimeError> {
        let rank = self.rank();
        let from = shifted_rank(&self.mesh, rank, axis, shift)?;
        let seq = self.received[from];
        self.received[from] += 1;
        let group = [from, rank];
        let cx = Context {
            op: op.name(),
            group: &group,
        };
        let d = self
            .transport
            .recv(from, &Channel::PointToPoint { seq }, &cx)?;
        let sent_by_send = d.call.sends;
        if !sent_by_send || d.call.operand != *ty || d.payload.len() as u64 != ty.num_elements() {
            return Err(RuntimeError::CollectiveMismatch {
                op: cx.op,
                group: group.to_vec(),
                rank,
                peer: from,
                ours: format!("{} on nothing", describe(op)),
                theirs: d.call.to_string(),
            });
        }
        tensor(ty, d.payload)
    }
}

impl<T: Transport> Collectives for Endpoint<T> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn mesh(&self) -> Option<&DeviceMesh> {
        Some(&self.mesh)
    }

    fn all_reduce(
        &mut self,
        x: &Tensor,
        axes: &[String],
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        let op = Op::AllReduce {
            axes: axes.to_vec(),
            reduce,
        };
        let result = self.all_reduce_as(&op, x, axes, reduce);
        self.aborting(result)
    }

    fn all_gather(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        let op = Op::AllGather {
            axes: axes.to_vec(),
            dim,
        };
        let result = self.all_gather_as(&op, x, axes, dim);
        self.aborting(result)
    }

    fn reduce_scatter(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        let op = Op::ReduceScatter {
            axes: axes.to_vec(),
            dim,
            reduce,
        };
        let result = self.reduce_scatter_as(&op, x, axes, dim, reduce);
        self.aborting(result)
    }

    fn all_to_all(
        &mut self,
        x: &Tensor,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        let op = Op::AllToAll {
            axes: axes.to_vec(),
            split_dim,
            concat_dim,
        };
        let result = self.all_to_all_as(&op, x, axes, split_dim, concat_dim);
        self.aborting(result)
    }

    fn broadcast(
        &mut self,
        x: &Tensor,
        axes: &[String],
        root: usize,
    ) -> Result<Tensor, RuntimeError> {
        let op = Op::CollectiveBroadcast {
            axes: axes.to_vec(),
            root,
        };
        let result = self.broadcast_as(&op, x, axes, root);
        self.aborting(result)
    }

    fn send(&mut self, x: &Tensor, axis: &str, shift: i64) -> Result<(), RuntimeError> {
        let op = Op::Send {
            axis: axis.to_string(),
            shift,
        };
        let result = self.send_as(&op, axis, shift, x);
        self.aborting(result)
    }

    fn recv(&mut self, ty: &TensorType, axis: &str, shift: i64) -> Result<Tensor, RuntimeError> {
        let op = Op::Recv {
            axis: axis.to_string(),
            shift,
            ty: ty.clone(),
        };
        let result = self.recv_as(&op, axis, shift, ty);
        self.aborting(result)
    }

    fn abort(&mut self, error: &RuntimeError) {
        self.transport.announce_error(error);
    }
}

/// One collective in progress on one rank: the group, this rank's position in it, and the
/// collective's sequence number on that group.
struct Round<'a, T> {
    transport: &'a mut T,
    op: &'static str,
    call: Arc<CallSignature>,
    members: Arc<[usize]>,
    pos: usize,
    seq: u64,
}

impl<T: Transport> Round<'_, T> {
    fn size(&self) -> usize {
        self.members.len()
    }

    /// Group position `pos + offset`, wrapping.
    fn member(&self, offset: isize) -> usize {
        let n = self.size() as isize;
        (self.pos as isize + offset).rem_euclid(n) as usize
    }

    fn channel(&self, step: usize) -> Channel {
        Channel::Collective {
            members: Arc::clone(&self.members),
            seq: self.seq,
            // A collective takes fewer steps than a group has members.
            step: step as u32,
        }
    }

    fn send<E: Element>(
        &mut self,
        member: usize,
        step: usize,
        payload: Vec<E>,
    ) -> Result<(), RuntimeError> {
        let channel = self.channel(step);
        let cx = Context {
            op: self.op,
            group: &self.members,
        };
        self.transport.send(
            self.members[member],
            channel,
            &self.call,
            E::into_data(payload),
            &cx,
        )
    }

    /// Receives the step-`step` message from group member `member`, which must come from the
    /// same collective call as ours and hold `len` elements.
    fn recv<E: Element>(
        &mut self,
        member: usize,
        step: usize,
        len: usize,
    ) -> Result<Vec<E>, RuntimeError> {
        let channel = self.channel(step);
        let cx = Context {
            op: self.op,
            group: &self.members,
        };
        let peer = self.members[member];
        let d = self.transport.recv(peer, &channel, &cx)?;
        let mismatch = |theirs: &CallSignature| RuntimeError::CollectiveMismatch {
            op: self.op,
            group: self.members.to_vec(),
            rank: self.transport.rank(),
            peer,
            ours: self.call.to_string(),
            theirs: theirs.to_string(),
        };
        if *d.call != *self.call {
            return Err(mismatch(&d.call));
        }
        // With equal signatures the payload always fits; check anyway rather than trust a
        // peer's arithmetic.
        match E::from_data(d.payload) {
            Some(v) if v.len() == len => Ok(v),
            _ => Err(mismatch(&d.call)),
        }
    }

    /// Ring reduce-scatter: `chunks` holds this member's contribution to every member's
    /// chunk, in group order; returns chunk `pos` reduced over the group. Takes `n - 1`
    /// steps.
    ///
    /// At step `s` this member sends the partial result of chunk `pos - s - 1` to the next
    /// member and receives that of chunk `pos - s - 2` from the previous one, folding its own
    /// contribution in. Chunk `c` thus starts at member `c + 1` and ends, complete, at `c`:
    /// an order fixed by the ring.
    fn ring_reduce_scatter<E: Element>(
        &mut self,
        kind: ReduceKind,
        chunks: &[&[E]],
    ) -> Result<Vec<E>, RuntimeError> {
        let n = self.size();
        let (next, prev) = (self.member(1), self.member(-1));
        let mut outgoing = chunks[self.member(-1)].to_vec();
        for s in 0..n - 1 {
            self.send(next, s, outgoing)?;
            let c = self.member(-(s as isize) - 2);
            let mut partial = self.recv(prev, s, chunks[c].len())?;
            E::fold(kind, &mut partial, chunks[c]);
            outgoing = partial;
        }
        Ok(outgoing)
    }

    /// Ring all-gather of one block per member, starting with this member's `mine`: hands
    /// every block, with its member's position, to `place`. Takes `n - 1` steps, numbered
    /// from `first_step`; at step `s` this member passes block `pos - s` on to the next
    /// member and receives block `pos - s - 1` from the previous one. `len(b)` is the length
    /// of block `b`.
    fn ring_all_gather<E: Element>(
        &mut self,
        mine: Vec<E>,
        first_step: usize,
        len: impl Fn(usize) -> usize,
        mut place: impl FnMut(usize, &[E]),
    ) -> Result<(), RuntimeError> {
        let n = self.size();
        let (next, prev) = (self.member(1), self.member(-1));
        place(self.pos, &mine);
        let mut outgoing = mine;
        for s in 0..n - 1 {
            self.send(next, first_step + s, outgoing)?;
            let b = self.member(-(s as isize) - 1);
            let block = self.recv(prev, first_step + s, len(b))?;
            place(b, &block);
            outgoing = block;
        }
        Ok(())
    }

    /// Ring all-reduce: a ring reduce-scatter of the flat elements in `n` nearly equal
    /// chunks, then a ring all-gather of the reduced chunks.
    fn all_reduce<E: Element>(
        &mut self,
        kind: ReduceKind,
        x: &[E],
    ) -> Result<Vec<E>, RuntimeError> {
        let n = self.size();
        let bounds = chunk_bounds(x.len(), n);
        let chunks: Vec<&[E]> = bounds.iter().map(|r| &x[r.clone()]).collect();
        let mine = self.ring_reduce_scatter(kind, &chunks)?;
        let mut out = vec![E::default(); x.len()];
        self.ring_all_gather(
            mine,
            n - 1,
            |b| bounds[b].len(),
            |b, block| out[bounds[b].clone()].copy_from_slice(block),
        )?;
        Ok(out)
    }

    /// Reduce-scatter of the slices of `x` that `layout` describes.
    fn reduce_scatter_along<E: Element>(
        &mut self,
        kind: ReduceKind,
        x: &[E],
        layout: Layout,
    ) -> Result<Vec<E>, RuntimeError> {
        let pieces: Vec<Vec<E>> = (0..self.size()).map(|j| layout.take(x, j)).collect();
        let chunks: Vec<&[E]> = pieces.iter().map(Vec::as_slice).collect();
        self.ring_reduce_scatter(kind, &chunks)
    }

    /// Ring all-gather of every member's `x`, joined as `layout` says.
    fn all_gather<E: Element>(&mut self, x: &[E], layout: Layout) -> Result<Vec<E>, RuntimeError> {
        let mut out = vec![E::default(); layout.len()];
        self.ring_all_gather(
            x.to_vec(),
            0,
            |_| layout.part_len(),
            |b, block| layout.put(&mut out, b, block),
        )?;
        Ok(out)
    }

    /// Pairwise exchange: piece `j` of `x` (cut as `split` says) goes to member `j`; the
    /// pieces that arrive are joined as `join` says, in group order. At step `s` (from 1 to
    /// `n - 1`) this member sends to member `pos + s` and receives from member `pos - s`.
    fn all_to_all<E: Element>(
        &mut self,
        x: &[E],
        split: Layout,
        join: Layout,
    ) -> Result<Vec<E>, RuntimeError> {
        let n = self.size();
        let mut out = vec![E::default(); join.len()];
        join.put(&mut out, self.pos, &split.take(x, self.pos));
        for s in 1..n {
            let to = self.member(s as isize);
            self.send(to, s, split.take(x, to))?;
            let from = self.member(-(s as isize));
            let piece = self.recv(from, s, split.part_len())?;
            join.put(&mut out, from, &piece);
        }
        Ok(out)
    }

    /// Binomial-tree broadcast from group member `root`: counting positions relative to the
    /// root, member `r` receives from `r` minus its highest set bit, then sends to `r + 2^k`
    /// for every `2^k` above `r`. Takes about `log2(n)` rounds.
    fn broadcast<E: Element>(&mut self, root: usize, x: &[E]) -> Result<Vec<E>, RuntimeError> {
        let n = self.size();
        let r = (self.pos + n - root) % n;
        let data = if r == 0 {
            x.to_vec()
        } else {
            let high = 1usize << (usize::BITS - 1 - r.leading_zeros());
            let parent = (r - high + root) % n;
            self.recv(parent, 0, x.len())?
        };
        let mut reach = if r == 0 {
            1
        } else {
            1usize << (usize::BITS - r.leading_zeros())
        };
        while r + reach < n {
            self.send((r + reach + root) % n, 0, data.clone())?;
            reach <<= 1;
        }
        Ok(data)
    }
}

/// A tensor of type `ty` holding `data`, checked to fit (integers wrap into `i32`, as the
/// kernels' sums do).
fn tensor(ty: &TensorType, data: Data) -> Result<Tensor, RuntimeError> {
    let kind_ok = match &data {
        Data::Float(_) => ty.dtype.is_float(),
        Data::Int(_) => ty.dtype.is_int(),
        Data::Bool(_) => ty.dtype == autopar_ir::DType::Bool,
    };
    if !kind_ok || data.len() as u64 != ty.num_elements() {
        return Err(RuntimeError::BadTensor {
            ty: ty.clone(),
            detail: format!(
                "received {} elements of the wrong kind or number",
                data.len()
            ),
        });
    }
    Ok(Tensor::from_parts(ty.clone(), data))
}

/// The result of a reduction, rounded to its dtype unless `precision` keeps `f64`.
fn reduced(ty: &TensorType, data: Data, precision: Precision) -> Result<Tensor, RuntimeError> {
    let t = tensor(ty, data)?;
    Ok(match precision {
        Precision::Declared => t.rounded(),
        Precision::F64 => t,
    })
}
