//! Element-level helpers of the collective algorithms: cutting a tensor's elements into the
//! pieces that travel between ranks, joining received pieces, and combining partial
//! reductions. They move elements of any storage kind without looking at them, except
//! [`combine`].

use autopar_ir::{DType, ReduceKind};

use crate::error::RuntimeError;
use crate::tensor::{Data, map_data};

/// The element ranges of `n` nearly equal consecutive chunks of `len` elements (the first
/// ones get no more than the last ones).
pub(crate) fn chunk_bounds(len: usize, n: usize) -> Vec<(usize, usize)> {
    (0..n).map(|c| (c * len / n, (c + 1) * len / n)).collect()
}

/// `data` cut into consecutive chunks with the given bounds.
pub(crate) fn split_flat(data: &Data, bounds: &[(usize, usize)]) -> Vec<Data> {
    bounds
        .iter()
        .map(|&(from, to)| map_data!(data, |v| v[from..to].to_vec()))
        .collect()
}

/// The elements of a row-major tensor of shape `dims` cut into `n` equal slices along
/// `dim` (which `n` divides), each row-major in its own shape.
pub(crate) fn split_along(data: &Data, dims: &[usize], dim: usize, n: usize) -> Vec<Data> {
    let (outer, along, inner) = around(dims, dim);
    let piece = along / n * inner;
    (0..n)
        .map(|j| {
            map_data!(data, |v| {
                let mut out = Vec::with_capacity(outer * piece);
                for o in 0..outer {
                    let start = o * along * inner + j * piece;
                    out.extend_from_slice(&v[start..start + piece]);
                }
                out
            })
        })
        .collect()
}

/// The inverse of [`split_along`]: pieces of equal shape `piece_dims`, joined along `dim`
/// in order. `None` when the pieces are not all of one storage kind.
pub(crate) fn join_along(pieces: Vec<Data>, piece_dims: &[usize], dim: usize) -> Option<Data> {
    let (outer, along, inner) = around(piece_dims, dim);
    let block = along * inner;
    macro_rules! join {
        ($variant:ident) => {{
            let mut parts = Vec::with_capacity(pieces.len());
            for p in pieces {
                match p {
                    Data::$variant(v) if v.len() == outer * block => parts.push(v),
                    _ => return None,
                }
            }
            let mut out = Vec::with_capacity(parts.len() * outer * block);
            for o in 0..outer {
                for p in &parts {
                    out.extend_from_slice(&p[o * block..(o + 1) * block]);
                }
            }
            Some(Data::$variant(out))
        }};
    }
    match pieces.first()? {
        Data::Float(_) => join!(Float),
        Data::Int(_) => join!(Int),
        Data::Bool(_) => join!(Bool),
    }
}

/// Consecutive chunks joined back into one (the inverse of [`split_flat`]). `None` when the
/// chunks are not all of one storage kind.
pub(crate) fn join_flat(chunks: Vec<Data>) -> Option<Data> {
    let len: usize = chunks.iter().map(Data::len).sum();
    macro_rules! join {
        ($variant:ident) => {{
            let mut out = Vec::with_capacity(len);
            for c in chunks {
                match c {
                    Data::$variant(v) => out.extend(v),
                    _ => return None,
                }
            }
            Some(Data::$variant(out))
        }};
    }
    match chunks.first()? {
        Data::Float(_) => join!(Float),
        Data::Int(_) => join!(Int),
        Data::Bool(_) => join!(Bool),
    }
}

/// Product of the dims before `dim`, `dims[dim]`, and the product of the dims after it.
fn around(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = dims[..dim].iter().product();
    let inner = dims[dim + 1..].iter().product();
    (outer, dims[dim], inner)
}

/// Checks that `kind` can reduce elements of `dtype` (booleans have no sum).
pub(crate) fn check_reducible(
    op: &'static str,
    kind: ReduceKind,
    dtype: DType,
) -> Result<(), RuntimeError> {
    if dtype == DType::Bool && kind == ReduceKind::Sum {
        Err(RuntimeError::UnsupportedDType { op, dtype })
    } else {
        Ok(())
    }
}

/// `partial[i] = partial[i] (kind) local[i]`: folds this rank's contribution into the partial
/// result that arrived from the previous rank. Floats stay in `f64` (rounded once, when the
/// collective ends); a NaN, once met, stays, as in the reduce kernels. `false` when the two
/// do not match in kind or length.
pub(crate) fn combine(kind: ReduceKind, partial: &mut Data, local: &Data) -> bool {
    if partial.len() != local.len() {
        return false;
    }
    match (partial, local) {
        (Data::Float(acc), Data::Float(x)) => {
            let f: fn(f64, f64) -> f64 = match kind {
                ReduceKind::Sum => |a, b| a + b,
                ReduceKind::Max => |a, b| if a.is_nan() || a >= b { a } else { b },
                ReduceKind::Min => |a, b| if a.is_nan() || a <= b { a } else { b },
            };
            acc.iter_mut().zip(x).for_each(|(a, &b)| *a = f(*a, b));
        }
        (Data::Int(acc), Data::Int(x)) => {
            let f: fn(i64, i64) -> i64 = match kind {
                ReduceKind::Sum => i64::wrapping_add,
                ReduceKind::Max => i64::max,
                ReduceKind::Min => i64::min,
            };
            acc.iter_mut().zip(x).for_each(|(a, &b)| *a = f(*a, b));
        }
        (Data::Bool(acc), Data::Bool(x)) => {
            let f: fn(bool, bool) -> bool = match kind {
                // Refused by `check_reducible` before any data moves.
                ReduceKind::Sum | ReduceKind::Max => |a, b| a || b,
                ReduceKind::Min => |a, b| a && b,
            };
            acc.iter_mut().zip(x).for_each(|(a, &b)| *a = f(*a, b));
        }
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_join_along_a_middle_dim() {
        // Shape [2, 4, 3]: split dim 1 in two.
        let data = Data::Int((0..24).collect());
        let pieces = split_along(&data, &[2, 4, 3], 1, 2);
        assert_eq!(
            pieces[0],
            Data::Int(vec![0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17])
        );
        assert_eq!(join_along(pieces, &[2, 2, 3], 1), Some(data));
    }

    #[test]
    fn uneven_flat_chunks_round_trip() {
        let data = Data::Float((0..10).map(f64::from).collect());
        let bounds = chunk_bounds(10, 4);
        assert_eq!(bounds, vec![(0, 2), (2, 5), (5, 7), (7, 10)]);
        let chunks = split_flat(&data, &bounds);
        assert_eq!(join_flat(chunks), Some(data));
    }

    #[test]
    fn combine_rejects_mismatched_parts() {
        let mut a = Data::Float(vec![1.0, f64::NAN]);
        assert!(combine(
            ReduceKind::Max,
            &mut a,
            &Data::Float(vec![2.0, 0.0])
        ));
        let Data::Float(v) = &a else { unreachable!() };
        assert_eq!(v[0], 2.0);
        assert!(v[1].is_nan());
        assert!(!combine(ReduceKind::Sum, &mut a, &Data::Int(vec![1, 2])));
        assert!(!combine(ReduceKind::Sum, &mut a, &Data::Float(vec![1.0])));
    }
}
