//! Element-level helpers of the collective algorithms: the element types a collective moves,
//! how partial reductions combine, and how a tensor's elements are cut into the pieces that
//! travel between ranks and put back together.

use autopar_ir::{DType, ReduceKind};

use crate::error::RuntimeError;
use crate::tensor::Data;

/// An element type of tensor storage (`f64` for floats, `i64` for integers, `bool`).
pub(crate) trait Element: Copy + Default + Send + 'static {
    /// The storage holding `v`.
    fn into_data(v: Vec<Self>) -> Data;
    /// The elements, if `data` holds this type.
    fn from_data(data: Data) -> Option<Vec<Self>>;
    /// `acc[i] = acc[i] (kind) local[i]`: folds this rank's contribution into the partial
    /// result that arrived from the previous rank.
    fn fold(kind: ReduceKind, acc: &mut [Self], local: &[Self]);
}

fn zip_with<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a = f(*a, b));
}

impl Element for f64 {
    fn into_data(v: Vec<Self>) -> Data {
        Data::Float(v)
    }

    fn from_data(data: Data) -> Option<Vec<Self>> {
        match data {
            Data::Float(v) => Some(v),
            Data::Int(_) | Data::Bool(_) => None,
        }
    }

    /// Floats stay in `f64` (rounded once, when the collective ends); a NaN, once met,
    /// stays, as in the reduce kernels.
    fn fold(kind: ReduceKind, acc: &mut [Self], local: &[Self]) {
        match kind {
            ReduceKind::Sum => zip_with(acc, local, |a, b| a + b),
            ReduceKind::Max => {
                zip_with(acc, local, |a, b| if a.is_nan() || a >= b { a } else { b })
            }
            ReduceKind::Min => {
                zip_with(acc, local, |a, b| if a.is_nan() || a <= b { a } else { b })
            }
        }
    }
}

impl Element for i64 {
    fn into_data(v: Vec<Self>) -> Data {
        Data::Int(v)
    }

    fn from_data(data: Data) -> Option<Vec<Self>> {
        match data {
            Data::Int(v) => Some(v),
            Data::Float(_) | Data::Bool(_) => None,
        }
    }

    /// Sums wrap, as the reduce kernels' do.
    fn fold(kind: ReduceKind, acc: &mut [Self], local: &[Self]) {
        match kind {
            ReduceKind::Sum => zip_with(acc, local, i64::wrapping_add),
            ReduceKind::Max => zip_with(acc, local, i64::max),
            ReduceKind::Min => zip_with(acc, local, i64::min),
        }
    }
}

impl Element for bool {
    fn into_data(v: Vec<Self>) -> Data {
        Data::Bool(v)
    }

    fn from_data(data: Data) -> Option<Vec<Self>> {
        match data {
            Data::Bool(v) => Some(v),
            Data::Float(_) | Data::Int(_) => None,
        }
    }

    /// Max is `or`, min is `and`; a sum is refused by [`check_reducible`] before any data
    /// moves (treated as `or` should it ever get here).
    fn fold(kind: ReduceKind, acc: &mut [Self], local: &[Self]) {
        match kind {
            ReduceKind::Sum | ReduceKind::Max => zip_with(acc, local, |a, b| a || b),
            ReduceKind::Min => zip_with(acc, local, |a, b| a && b),
        }
    }
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

/// The element ranges of `n` nearly equal consecutive chunks of `len` elements.
pub(crate) fn chunk_bounds(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|c| c * len / n..(c + 1) * len / n).collect()
}

/// How a row-major tensor of shape `dims` splits around `dim` into `n` parts: the product
/// of the dims before `dim`, and the number of consecutive elements of one part per
/// index of those outer dims.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    outer: usize,
    part: usize,
    n: usize,
}

impl Layout {
    /// Parts of a tensor of shape `dims` cut into `n` equal slices along `dim` (which `n`
    /// divides).
    pub(crate) fn split(dims: &[usize], dim: usize, n: usize) -> Layout {
        let outer = dims[..dim].iter().product();
        let inner: usize = dims[dim + 1..].iter().product();
        Layout {
            outer,
            part: dims[dim] / n * inner,
            n,
        }
    }

    /// Parts of `piece_dims` shape, `n` of them joined along `dim`.
    pub(crate) fn join(piece_dims: &[usize], dim: usize, n: usize) -> Layout {
        let outer = piece_dims[..dim].iter().product();
        let inner: usize = piece_dims[dim + 1..].iter().product();
        Layout {
            outer,
            part: piece_dims[dim] * inner,
            n,
        }
    }

    /// Elements of one part.
    pub(crate) fn part_len(&self) -> usize {
        self.outer * self.part
    }

    /// Elements of the whole.
    pub(crate) fn len(&self) -> usize {
        self.outer * self.part * self.n
    }

    /// Part `j` of `whole`, row-major in its own shape.
    pub(crate) fn take<T: Copy>(&self, whole: &[T], j: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(self.part_len());
        for o in 0..self.outer {
            let start = (o * self.n + j) * self.part;
            out.extend_from_slice(&whole[start..start + self.part]);
        }
        out
    }

    /// Part `j` of `whole` into `out` (cleared first, its allocation reused).
    pub(crate) fn take_into<T: Copy>(&self, whole: &[T], j: usize, out: &mut Vec<T>) {
        out.clear();
        for o in 0..self.outer {
            let start = (o * self.n + j) * self.part;
            out.extend_from_slice(&whole[start..start + self.part]);
        }
    }

    /// Writes `piece` (row-major in its own shape) as part `j` of `whole`.
    pub(crate) fn put<T: Copy>(&self, whole: &mut [T], j: usize, piece: &[T]) {
        for o in 0..self.outer {
            let start = (o * self.n + j) * self.part;
            whole[start..start + self.part]
                .copy_from_slice(&piece[o * self.part..(o + 1) * self.part]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_and_put_along_a_middle_dim() {
        // Shape [2, 4, 3]: two slices along dim 1.
        let whole: Vec<i64> = (0..24).collect();
        let layout = Layout::split(&[2, 4, 3], 1, 2);
        let first = layout.take(&whole, 0);
        assert_eq!(first, vec![0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]);
        let mut back = vec![0; layout.len()];
        for j in 0..2 {
            Layout::join(&[2, 2, 3], 1, 2).put(&mut back, j, &layout.take(&whole, j));
        }
        assert_eq!(back, whole);
    }

    #[test]
    fn uneven_chunks_cover_everything() {
        assert_eq!(chunk_bounds(10, 4), vec![0..2, 2..5, 5..7, 7..10]);
        assert_eq!(chunk_bounds(1, 3), vec![0..0, 0..0, 0..1]);
    }

    #[test]
    fn folds_keep_nans_and_wrap() {
        let mut a = vec![1.0, f64::NAN];
        f64::fold(ReduceKind::Max, &mut a, &[2.0, 0.0]);
        assert_eq!(a[0], 2.0);
        assert!(a[1].is_nan());
        let mut i = vec![i64::MAX];
        i64::fold(ReduceKind::Sum, &mut i, &[1]);
        assert_eq!(i, vec![i64::MIN]);
    }
}
