//! Kernels that move elements without computing on them: transpose, slice, concat,
//! broadcast, and the embedding gather with its scatter-add gradient.

use autopar_ir::TensorType;

use super::{checked_ids, ints, strided_copy};
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor, map_data, strides};

/// Result dim `i` is operand dim `perm[i]`.
pub(crate) fn transpose(perm: &[usize], x: &Tensor, out: &TensorType) -> Tensor {
    let src = strides(x.dims());
    let view: Vec<usize> = perm.iter().map(|&p| src[p]).collect();
    let data = map_data!(x.data(), |v| strided_copy(v, out.dims(), &view));
    Tensor::from_parts(out.clone(), data)
}

/// The range `start..end` of dim `dim`.
pub(crate) fn slice(dim: usize, start: usize, end: usize, x: &Tensor, out: &TensorType) -> Tensor {
    let dims = x.dims();
    let inner: usize = dims[dim + 1..].iter().product();
    let outer: usize = dims[..dim].iter().product();
    let block = dims[dim] * inner;
    let data = map_data!(x.data(), |v| take_slice(
        v,
        outer,
        block,
        start * inner,
        end * inner
    ));
    Tensor::from_parts(out.clone(), data)
}

fn take_slice<T: Copy>(v: &[T], outer: usize, block: usize, from: usize, to: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(outer * (to - from));
    for o in 0..outer {
        out.extend_from_slice(&v[o * block + from..o * block + to]);
    }
    out
}

/// Concatenation along `dim` (operands agree on every other dim and on dtype).
pub(crate) fn concat(dim: usize, xs: &[&Tensor], out: &TensorType) -> Result<Tensor, RuntimeError> {
    let inner: usize = out.dims()[dim + 1..].iter().product();
    let outer: usize = out.dims()[..dim].iter().product();
    let blocks: Vec<usize> = xs.iter().map(|t| t.dims()[dim] * inner).collect();
    let mismatch = || RuntimeError::UnsupportedDType {
        op: "concat",
        dtype: out.dtype,
    };
    let data = match out.dtype {
        d if d.is_float() => Data::Float(join(
            outer,
            &blocks,
            &parts(xs, Tensor::floats).ok_or_else(mismatch)?,
        )),
        d if d.is_int() => Data::Int(join(
            outer,
            &blocks,
            &parts(xs, Tensor::ints).ok_or_else(mismatch)?,
        )),
        _ => Data::Bool(join(
            outer,
            &blocks,
            &parts(xs, Tensor::bools).ok_or_else(mismatch)?,
        )),
    };
    Ok(Tensor::from_parts(out.clone(), data))
}

/// The same kind of storage of every operand, if they all hold it.
fn parts<'a, T>(xs: &[&'a Tensor], get: fn(&'a Tensor) -> Option<&'a [T]>) -> Option<Vec<&'a [T]>> {
    xs.iter().map(|t| get(t)).collect()
}

/// For each of `outer` steps, the next block of each part in turn.
fn join<T: Copy>(outer: usize, blocks: &[usize], parts: &[&[T]]) -> Vec<T> {
    let mut out = Vec::with_capacity(outer * blocks.iter().sum::<usize>());
    for o in 0..outer {
        for (part, &block) in parts.iter().zip(blocks) {
            out.extend_from_slice(&part[o * block..(o + 1) * block]);
        }
    }
    out
}

/// Operand dim `i` becomes result dim `dims[i]` (expanded when its size is 1).
pub(crate) fn broadcast(dims: &[usize], x: &Tensor, out: &TensorType) -> Tensor {
    let src = strides(x.dims());
    let mut view = vec![0; out.rank()];
    for (i, &d) in dims.iter().enumerate() {
        if x.dims()[i] != 1 {
            view[d] = src[i];
        }
    }
    let data = map_data!(x.data(), |v| strided_copy(v, out.dims(), &view));
    Tensor::from_parts(out.clone(), data)
}

/// Rows `ids[...]` of `table[v, rest...]`.
pub(crate) fn gather(
    table: &Tensor,
    ids: &Tensor,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let rows = table.dims()[0];
    let ids = checked_ids("gather", ints("gather", ids)?, rows)?;
    let row_len: usize = table.dims()[1..].iter().product();
    let data = map_data!(table.data(), |v| gather_rows(v, &ids, row_len));
    Ok(Tensor::from_parts(out.clone(), data))
}

fn gather_rows<T: Copy>(table: &[T], ids: &[usize], row_len: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(ids.len() * row_len);
    for &id in ids {
        out.extend_from_slice(&table[id * row_len..(id + 1) * row_len]);
    }
    out
}

/// Row `r` of the result is the sum of the rows of `updates` whose id is `r`.
pub(crate) fn scatter_add(
    num_rows: usize,
    ids: &Tensor,
    updates: &Tensor,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let op = "scatter_add";
    let ids = checked_ids(op, ints(op, ids)?, num_rows)?;
    let row_len: usize = out.dims()[1..].iter().product();
    let n = num_rows * row_len;
    let data = match updates.data() {
        Data::Float(u) => Data::Float(add_rows(vec![0.0; n], &ids, u, row_len, |a, b| a + b)),
        Data::Int(u) => Data::Int(add_rows(vec![0; n], &ids, u, row_len, i64::wrapping_add)),
        Data::Bool(_) => {
            return Err(RuntimeError::UnsupportedDType {
                op,
                dtype: updates.dtype(),
            });
        }
    };
    Ok(Tensor::from_parts(out.clone(), data))
}

/// Adds row `i` of `updates` into row `ids[i]` of `acc`.
fn add_rows<T: Copy>(
    mut acc: Vec<T>,
    ids: &[usize],
    updates: &[T],
    row_len: usize,
    add: fn(T, T) -> T,
) -> Vec<T> {
    for (src, &id) in updates.chunks_exact(row_len.max(1)).zip(ids) {
        for (a, &s) in acc[id * row_len..(id + 1) * row_len].iter_mut().zip(src) {
            *a = add(*a, s);
        }
    }
    acc
}
