//! The `f32` path of [`Collectives`]: the checks its methods share, the conversions their
//! default implementations make through the `Tensor` methods, and [`communicate_f32`], the
//! mapping of the IR's communication ops onto the `f32` methods (the twin of
//! [`communicate`](super::communicate)).

use autopar_ir::infer::infer;
use autopar_ir::{IrError, Op, TensorType};

use super::Collectives;
use crate::error::RuntimeError;
use crate::tensor::Tensor;

/// `result`, after aborting `comm` on its error: a rank whose call failed is out of step with
/// its groups.
fn aborting<C: Collectives + ?Sized, R>(
    comm: &mut C,
    result: Result<R, RuntimeError>,
) -> Result<R, RuntimeError> {
    if let Err(e) = &result {
        comm.abort(e);
    }
    result
}

/// Checks that `ty`, the type an `f32` call of `op` declares, has a float dtype.
pub(crate) fn check_float<C: Collectives + ?Sized>(
    comm: &mut C,
    op: &Op,
    ty: &TensorType,
) -> Result<(), RuntimeError> {
    let result = float_type(op, ty);
    aborting(comm, result)
}

fn float_type(op: &Op, ty: &TensorType) -> Result<(), RuntimeError> {
    if ty.dtype.is_float() {
        Ok(())
    } else {
        Err(RuntimeError::UnsupportedDType {
            op: op.name(),
            dtype: ty.dtype,
        })
    }
}

/// Checks that `len` elements fill a tensor of type `ty`.
pub(crate) fn check_len(ty: &TensorType, len: usize, what: &str) -> Result<(), RuntimeError> {
    if len as u64 == ty.num_elements() {
        Ok(())
    } else {
        Err(RuntimeError::BadTensor {
            ty: ty.clone(),
            detail: format!(
                "the {what} buffer holds {len} elements, the type {}",
                ty.num_elements()
            ),
        })
    }
}

/// The operand `x` of an `f32` call of `op`, declared as `ty`, as a [`Tensor`] (checked to
/// be a float type that `x` fills).
pub(crate) fn operand<C: Collectives + ?Sized>(
    comm: &mut C,
    op: &Op,
    ty: &TensorType,
    x: &[f32],
) -> Result<Tensor, RuntimeError> {
    let result = float_type(op, ty)
        .and_then(|()| check_len(ty, x.len(), "operand"))
        .and_then(|()| Tensor::from_f64(ty.clone(), x.iter().map(|&v| f64::from(v)).collect()));
    aborting(comm, result)
}

/// Writes the float result `r` of `op` into `out`, which must hold exactly its elements
/// (rounded to `f32`, which only changes a result kept in `f64`).
pub(crate) fn write_result<C: Collectives + ?Sized>(
    comm: &mut C,
    op: &Op,
    r: &Tensor,
    out: &mut [f32],
) -> Result<(), RuntimeError> {
    let result = check_len(r.ty(), out.len(), "result").and_then(|()| {
        let values = r.floats().ok_or_else(|| {
            RuntimeError::from(IrError::Verify(format!(
                "`{}` gave a non-float result {}",
                op.name(),
                r.ty()
            )))
        })?;
        for (o, &v) in out.iter_mut().zip(values) {
            *o = v as f32;
        }
        Ok(())
    });
    aborting(comm, result)
}

/// Carries out the IR communication op `op` on this rank's `f32` operand with `comm`,
/// writing its result into `out`: the one mapping from the IR's ops onto the `f32` methods
/// of [`Collectives`], as [`communicate`](super::communicate) is for tensors.
///
/// `operand` is the operand's declared type and elements (`None` for `recv`, which has
/// none); `out` receives the result and must hold exactly the elements of the type the op
/// declares (nothing for `send`); it is a `Vec` so that an all-reduce can lend it to the
/// peers. The operand is checked against the op's typing rule on `comm`'s mesh first. An
/// all-reduce or broadcast copies the operand into `out` and works there; a backend that can
/// give up its operand calls [`all_reduce_f32`](Collectives::all_reduce_f32) on it directly
/// and saves the copy. A failed check [aborts](Collectives::abort) `comm`.
pub fn communicate_f32(
    comm: &mut dyn Collectives,
    op: &Op,
    operand: Option<(&TensorType, &[f32])>,
    out: &mut Vec<f32>,
) -> Result<(), RuntimeError> {
    if let Err(e) = check_call(comm, op, operand, out.len()) {
        comm.abort(&e);
        return Err(e);
    }
    match (op, operand) {
        (Op::Recv { axis, shift, ty }, _) => comm.recv_f32(out, ty, axis, *shift),
        (_, Some((ty, x))) => dispatch(comm, op, ty, x, out),
        (_, None) => {
            // `check_call` has refused this.
            let e =
                RuntimeError::from(IrError::Verify(format!("`{}` needs an operand", op.name())));
            comm.abort(&e);
            Err(e)
        }
    }
}

/// The typed call of `op` on `x`, whose type `ty` [`declared_result`] has checked.
fn dispatch(
    comm: &mut dyn Collectives,
    op: &Op,
    ty: &TensorType,
    x: &[f32],
    out: &mut Vec<f32>,
) -> Result<(), RuntimeError> {
    match op {
        Op::AllReduce { axes, reduce } => {
            out.copy_from_slice(x);
            comm.all_reduce_f32(out, ty, axes, *reduce)
        }
        Op::AllGather { axes, dim } => comm.all_gather_f32(x, ty, axes, *dim, out),
        Op::ReduceScatter { axes, dim, reduce } => {
            comm.reduce_scatter_f32(x, ty, axes, *dim, *reduce, out)
        }
        Op::AllToAll {
            axes,
            split_dim,
            concat_dim,
        } => comm.all_to_all_f32(x, ty, axes, *split_dim, *concat_dim, out),
        Op::CollectiveBroadcast { axes, root } => {
            out.copy_from_slice(x);
            comm.broadcast_f32(out, ty, axes, *root)
        }
        Op::Send { axis, shift } => comm.send_f32(x, ty, axis, *shift),
        other => {
            let e = RuntimeError::from(IrError::Verify(format!(
                "`{}` is not a communication op",
                other.name()
            )));
            comm.abort(&e);
            Err(e)
        }
    }
}

/// Checks a call of `op` on `operand` into `out_len` elements: the operand's arity, its
/// float type and length, and (on a mesh) the op's typing rule and the length of the result
/// it declares (none for `send`). Without a mesh the lone device refuses the op in its own
/// words.
fn check_call(
    comm: &dyn Collectives,
    op: &Op,
    operand: Option<(&TensorType, &[f32])>,
    out_len: usize,
) -> Result<(), RuntimeError> {
    if !op.is_communication() {
        return Err(IrError::Verify(format!("`{}` is not a communication op", op.name())).into());
    }
    let wants_operand = !matches!(op, Op::Recv { .. });
    if wants_operand != operand.is_some() {
        return Err(IrError::Verify(format!(
            "`{}` takes {} operand(s) but was given {}",
            op.name(),
            usize::from(wants_operand),
            usize::from(operand.is_some())
        ))
        .into());
    }
    let types: Vec<&TensorType> = match operand {
        Some((ty, x)) => {
            float_type(op, ty)?;
            check_len(ty, x.len(), "operand")?;
            vec![ty]
        }
        None => Vec::new(),
    };
    let Some(mesh) = comm.mesh() else {
        return Ok(());
    };
    match infer(op, &types, Some(mesh))?.pop() {
        Some(result) => check_len(&result, out_len, "result"),
        None if out_len == 0 => Ok(()),
        None => Err(IrError::Verify(format!(
            "`{}` has no result, but was given a buffer of {out_len} elements for one",
            op.name()
        ))
        .into()),
    }
}
