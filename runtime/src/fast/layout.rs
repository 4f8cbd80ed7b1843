//! Kernels that move elements without computing on them: broadcast (a splat when the operand
//! has one element), transpose, slice, concat, and the embedding gather with its scatter-add
//! gradient. Copies run over the innermost dim as slice copies where it is contiguous.

use autopar_ir::TensorType;

use super::elementwise::{floats, ints};
use super::storage::Elems;
use super::{Ctx, FastTensor, Val};
use crate::error::RuntimeError;
use crate::tensor::strides;

/// Writes into `dst` (contiguous, of shape `dims`) the elements of `src` at the offsets
/// `sum(index[i] * view[i])`, row-major.
pub(crate) fn strided_copy_into<T: Copy>(src: &[T], dims: &[usize], view: &[usize], dst: &mut [T]) {
    if dims.contains(&0) || dst.is_empty() {
        return;
    }
    let Some(last) = dims.len().checked_sub(1) else {
        dst[0] = src[0];
        return;
    };
    let (inner, inner_stride) = (dims[last], view[last]);
    let mut index = vec![0usize; last];
    let mut base = 0usize;
    for row in dst.chunks_exact_mut(inner) {
        match inner_stride {
            1 => row.copy_from_slice(&src[base..base + inner]),
            0 => row.fill(src[base]),
            s => {
                for (j, d) in row.iter_mut().enumerate() {
                    *d = src[base + j * s];
                }
            }
        }
        // Advance the outer dims like an odometer.
        let mut d = last;
        while d > 0 {
            d -= 1;
            index[d] += 1;
            base += view[d];
            if index[d] < dims[d] {
                break;
            }
            base -= view[d] * dims[d];
            index[d] = 0;
        }
    }
}

/// A strided view of `x` copied out as a tensor of type `out`.
fn view_copy(ctx: &Ctx, x: &FastTensor, view: &[usize], out: &TensorType) -> FastTensor {
    let n = out.num_elements() as usize;
    let dims = out.dims();
    let elems = match x.elems() {
        Elems::F32(v) => {
            let mut o = ctx.f32s(n);
            strided_copy_into(v, dims, view, &mut o);
            Elems::F32(o)
        }
        Elems::Int(v) => {
            let mut o = ctx.ints(n);
            strided_copy_into(v, dims, view, &mut o);
            Elems::Int(o)
        }
        Elems::Bool(v) => {
            let mut o = ctx.bools(n);
            strided_copy_into(v, dims, view, &mut o);
            Elems::Bool(o)
        }
    };
    ctx.of_elems(out, elems)
}

/// Operand dim `i` becomes result dim `dims[i]` (expanded when its size is 1).
pub(crate) fn broadcast(ctx: &Ctx, dims: &[usize], x: &Val, out: &TensorType) -> Val {
    let t = match x {
        Val::Splat(_, v) => return Val::Splat(out.clone(), *v),
        Val::Dense(t) => t,
    };
    if t.ty().num_elements() == 1 {
        let value = match t.elems() {
            Elems::F32(v) => f64::from(v[0]),
            Elems::Int(v) => v[0] as f64,
            Elems::Bool(v) => f64::from(u8::from(v[0])),
        };
        // Integers beyond 2^53 would not survive the f64: keep those dense.
        if t.ints().is_none_or(|v| v[0].unsigned_abs() < (1 << 53)) {
            return Val::Splat(out.clone(), value);
        }
    }
    let src = strides(t.ty().dims());
    let mut view = vec![0; out.rank()];
    for (i, &d) in dims.iter().enumerate() {
        if t.ty().dims()[i] != 1 {
            view[d] = src[i];
        }
    }
    Val::Dense(view_copy(ctx, t, &view, out))
}

/// Result dim `i` is operand dim `perm[i]`.
pub(crate) fn transpose(ctx: &Ctx, perm: &[usize], x: &FastTensor, out: &TensorType) -> FastTensor {
    let src = strides(x.ty().dims());
    let view: Vec<usize> = perm.iter().map(|&p| src[p]).collect();
    view_copy(ctx, x, &view, out)
}

/// The range `start..end` of dim `dim`.
pub(crate) fn slice(
    ctx: &Ctx,
    dim: usize,
    start: usize,
    _end: usize,
    x: &FastTensor,
    out: &TensorType,
) -> FastTensor {
    let src = strides(x.ty().dims());
    let base = start * src.get(dim).copied().unwrap_or(0);
    let n = out.num_elements() as usize;
    let dims = out.dims();
    let elems = match x.elems() {
        Elems::F32(v) => {
            let mut o = ctx.f32s(n);
            strided_copy_into(&v[base.min(v.len())..], dims, &src, &mut o);
            Elems::F32(o)
        }
        Elems::Int(v) => {
            let mut o = ctx.ints(n);
            strided_copy_into(&v[base.min(v.len())..], dims, &src, &mut o);
            Elems::Int(o)
        }
        Elems::Bool(v) => {
            let mut o = ctx.bools(n);
            strided_copy_into(&v[base.min(v.len())..], dims, &src, &mut o);
            Elems::Bool(o)
        }
    };
    ctx.of_elems(out, elems)
}

/// Concatenation along `dim`.
pub(crate) fn concat(
    ctx: &Ctx,
    dim: usize,
    xs: &[FastTensor],
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let inner: usize = out.dims()[dim + 1..].iter().product();
    let outer: usize = out.dims()[..dim].iter().product();
    let blocks: Vec<usize> = xs.iter().map(|t| t.ty().dims()[dim] * inner).collect();
    let n = out.num_elements() as usize;
    let mismatch = || RuntimeError::UnsupportedDType {
        op: "concat",
        dtype: out.dtype,
    };
    fn join<T: Copy>(outer: usize, blocks: &[usize], parts: &[&[T]], o: &mut [T]) {
        let mut at = 0;
        for i in 0..outer {
            for (part, &block) in parts.iter().zip(blocks) {
                o[at..at + block].copy_from_slice(&part[i * block..(i + 1) * block]);
                at += block;
            }
        }
    }
    let elems = match xs.first().map(FastTensor::elems) {
        Some(Elems::F32(_)) => {
            let parts: Option<Vec<&[f32]>> = xs.iter().map(FastTensor::f32s).collect();
            let mut o = ctx.f32s(n);
            join(outer, &blocks, &parts.ok_or_else(mismatch)?, &mut o);
            Elems::F32(o)
        }
        Some(Elems::Int(_)) => {
            let parts: Option<Vec<&[i64]>> = xs.iter().map(FastTensor::ints).collect();
            let mut o = ctx.ints(n);
            join(outer, &blocks, &parts.ok_or_else(mismatch)?, &mut o);
            Elems::Int(o)
        }
        Some(Elems::Bool(_)) => {
            let parts: Option<Vec<&[bool]>> = xs.iter().map(FastTensor::bools).collect();
            let mut o = ctx.bools(n);
            join(outer, &blocks, &parts.ok_or_else(mismatch)?, &mut o);
            Elems::Bool(o)
        }
        None => return Err(mismatch()),
    };
    Ok(ctx.of_elems(out, elems))
}

/// Ids as row indices, each checked against `0..bound`.
pub(crate) fn checked_ids(
    op: &'static str,
    ids: &[i64],
    bound: usize,
) -> Result<Vec<usize>, RuntimeError> {
    ids.iter()
        .map(|&id| match usize::try_from(id) {
            Ok(row) if row < bound => Ok(row),
            _ => Err(RuntimeError::IndexOutOfRange { op, id, bound }),
        })
        .collect()
}

/// Rows `ids[...]` of `table[v, rest...]`.
pub(crate) fn gather(
    ctx: &Ctx,
    table: &FastTensor,
    ids: &FastTensor,
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let rows = table.ty().dims()[0];
    let ids = checked_ids("gather", ints("gather", ids)?, rows)?;
    let row_len: usize = table.ty().dims()[1..].iter().product();
    let n = out.num_elements() as usize;
    fn take<T: Copy>(table: &[T], ids: &[usize], row_len: usize, o: &mut [T]) {
        for (dst, &id) in o.chunks_exact_mut(row_len.max(1)).zip(ids) {
            dst.copy_from_slice(&table[id * row_len..(id + 1) * row_len]);
        }
    }
    let elems = match table.elems() {
        Elems::F32(v) => {
            let mut o = ctx.f32s(n);
            take(v, &ids, row_len, &mut o);
            Elems::F32(o)
        }
        Elems::Int(v) => {
            let mut o = ctx.ints(n);
            take(v, &ids, row_len, &mut o);
            Elems::Int(o)
        }
        Elems::Bool(v) => {
            let mut o = ctx.bools(n);
            take(v, &ids, row_len, &mut o);
            Elems::Bool(o)
        }
    };
    Ok(ctx.of_elems(out, elems))
}

/// Row `r` of the result is the sum of the rows of `updates` whose id is `r` (floats, added
/// in f32 in the order of the ids).
pub(crate) fn scatter_add(
    ctx: &Ctx,
    num_rows: usize,
    ids: &FastTensor,
    updates: &FastTensor,
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let op = "scatter_add";
    let ids = checked_ids(op, ints(op, ids)?, num_rows)?;
    let u = floats(op, updates)?;
    let row_len: usize = out.dims()[1..].iter().product();
    let mut acc = ctx.zeros(num_rows * row_len);
    for (src, &id) in u.chunks_exact(row_len.max(1)).zip(&ids) {
        for (a, &s) in acc[id * row_len..(id + 1) * row_len].iter_mut().zip(src) {
            *a += s;
        }
    }
    Ok(ctx.float(out, acc))
}
