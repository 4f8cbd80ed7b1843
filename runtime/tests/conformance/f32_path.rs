//! Runs the conformance suite through the `f32` methods of [`Collectives`]: [`F32Path`] is a
//! communicator whose `Tensor` methods convert float operands to `f32` buffers and call the
//! `*_f32` methods of the communicator under test (integers and booleans keep the `Tensor`
//! methods, which the `f32` path has no part in), and [`F32Launcher`] hands every rank's
//! communicator to its body that way. [`TensorOnly`] hides a communicator's own `f32`
//! methods, so that the trait's default ones (through the `Tensor` methods) are under test.

#![allow(dead_code)]

use autopar_ir::infer::infer;
use autopar_ir::{DeviceMesh, Op, ReduceKind, TensorType};
use autopar_runtime::comm::Collectives;
use autopar_runtime::{Data, Launcher, RankResults, RuntimeError, Tensor};

/// The `f32` path of the communicator it wraps, behind the `Tensor` methods.
pub struct F32Path<'a>(pub &'a mut dyn Collectives);

fn f32s(x: &Tensor) -> Vec<f32> {
    x.floats()
        .expect("a float tensor")
        .iter()
        .map(|&v| v as f32)
        .collect()
}

fn tensor(ty: TensorType, v: Vec<f32>) -> Result<Tensor, RuntimeError> {
    Tensor::new(ty, Data::Float(v.into_iter().map(f64::from).collect()))
}

impl F32Path<'_> {
    /// The result buffer of `op` on `x` (empty when the operand breaks the typing rule, so
    /// that the communicator reports that in its own words), and its type.
    fn out(&self, op: &Op, x: &Tensor) -> (Vec<f32>, TensorType) {
        let ty = infer(op, &[x.ty()], self.0.mesh())
            .ok()
            .and_then(|mut t| t.pop())
            .unwrap_or_else(|| x.ty().clone());
        (vec![0.0; ty.num_elements() as usize], ty)
    }
}

impl Collectives for F32Path<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn mesh(&self) -> Option<&DeviceMesh> {
        self.0.mesh()
    }

    fn all_reduce(
        &mut self,
        x: &Tensor,
        axes: &[String],
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        if !x.dtype().is_float() {
            return self.0.all_reduce(x, axes, reduce);
        }
        let mut v = f32s(x);
        self.0.all_reduce_f32(&mut v, x.ty(), axes, reduce)?;
        tensor(x.ty().clone(), v)
    }

    fn all_gather(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        if !x.dtype().is_float() {
            return self.0.all_gather(x, axes, dim);
        }
        let op = Op::AllGather {
            axes: axes.to_vec(),
            dim,
        };
        let (mut out, ty) = self.out(&op, x);
        self.0
            .all_gather_f32(&f32s(x), x.ty(), axes, dim, &mut out)?;
        tensor(ty, out)
    }

    fn reduce_scatter(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        if !x.dtype().is_float() {
            return self.0.reduce_scatter(x, axes, dim, reduce);
        }
        let op = Op::ReduceScatter {
            axes: axes.to_vec(),
            dim,
            reduce,
        };
        let (mut out, ty) = self.out(&op, x);
        self.0
            .reduce_scatter_f32(&f32s(x), x.ty(), axes, dim, reduce, &mut out)?;
        tensor(ty, out)
    }

    fn all_to_all(
        &mut self,
        x: &Tensor,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        if !x.dtype().is_float() {
            return self.0.all_to_all(x, axes, split_dim, concat_dim);
        }
        let op = Op::AllToAll {
            axes: axes.to_vec(),
            split_dim,
            concat_dim,
        };
        let (mut out, ty) = self.out(&op, x);
        self.0
            .all_to_all_f32(&f32s(x), x.ty(), axes, split_dim, concat_dim, &mut out)?;
        tensor(ty, out)
    }

    fn broadcast(
        &mut self,
        x: &Tensor,
        axes: &[String],
        root: usize,
    ) -> Result<Tensor, RuntimeError> {
        if !x.dtype().is_float() {
            return self.0.broadcast(x, axes, root);
        }
        let mut v = f32s(x);
        self.0.broadcast_f32(&mut v, x.ty(), axes, root)?;
        tensor(x.ty().clone(), v)
    }

    fn send(&mut self, x: &Tensor, axis: &str, shift: i64) -> Result<(), RuntimeError> {
        if !x.dtype().is_float() {
            return self.0.send(x, axis, shift);
        }
        self.0.send_f32(&f32s(x), x.ty(), axis, shift)
    }

    fn recv(&mut self, ty: &TensorType, axis: &str, shift: i64) -> Result<Tensor, RuntimeError> {
        if !ty.dtype.is_float() {
            return self.0.recv(ty, axis, shift);
        }
        let mut out = vec![0.0; ty.num_elements() as usize];
        self.0.recv_f32(&mut out, ty, axis, shift)?;
        tensor(ty.clone(), out)
    }

    fn abort(&mut self, error: &RuntimeError) {
        self.0.abort(error)
    }
}

/// The communicator it wraps with only the `Tensor` methods: its `f32` methods are the
/// trait's defaults.
pub struct TensorOnly<'a>(pub &'a mut dyn Collectives);

impl Collectives for TensorOnly<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn mesh(&self) -> Option<&DeviceMesh> {
        self.0.mesh()
    }

    fn all_reduce(
        &mut self,
        x: &Tensor,
        axes: &[String],
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        self.0.all_reduce(x, axes, reduce)
    }

    fn all_gather(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        self.0.all_gather(x, axes, dim)
    }

    fn reduce_scatter(
        &mut self,
        x: &Tensor,
        axes: &[String],
        dim: usize,
        reduce: ReduceKind,
    ) -> Result<Tensor, RuntimeError> {
        self.0.reduce_scatter(x, axes, dim, reduce)
    }

    fn all_to_all(
        &mut self,
        x: &Tensor,
        axes: &[String],
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor, RuntimeError> {
        self.0.all_to_all(x, axes, split_dim, concat_dim)
    }

    fn broadcast(
        &mut self,
        x: &Tensor,
        axes: &[String],
        root: usize,
    ) -> Result<Tensor, RuntimeError> {
        self.0.broadcast(x, axes, root)
    }

    fn send(&mut self, x: &Tensor, axis: &str, shift: i64) -> Result<(), RuntimeError> {
        self.0.send(x, axis, shift)
    }

    fn recv(&mut self, ty: &TensorType, axis: &str, shift: i64) -> Result<Tensor, RuntimeError> {
        self.0.recv(ty, axis, shift)
    }

    fn abort(&mut self, error: &RuntimeError) {
        self.0.abort(error)
    }
}

/// Launches the ranks of the launcher it wraps with the `f32` path of their communicators
/// (`defaults`: the trait's default `f32` methods rather than the communicator's own).
pub struct F32Launcher<L> {
    pub inner: L,
    pub defaults: bool,
}

impl<L: Launcher> Launcher for F32Launcher<L> {
    fn launch<T, F>(&self, mesh: &DeviceMesh, body: F) -> Result<RankResults<T>, RuntimeError>
    where
        T: Send,
        F: Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync,
    {
        let defaults = self.defaults;
        self.inner.launch(mesh, |comm| {
            if defaults {
                let mut plain = TensorOnly(comm);
                body(&mut F32Path(&mut plain))
            } else {
                body(&mut F32Path(comm))
            }
        })
    }

    fn local_ranks(&self, mesh: &DeviceMesh) -> Result<Vec<usize>, RuntimeError> {
        self.inner.local_ranks(mesh)
    }
}
