//! Two-operand einsum as batched matrix products: the operands are laid out as
//! `[batch, m, k]` and `[batch, k, n]` contiguous buffers and multiplied with `gemm`.

use autopar_ir::{EinsumSpec, TensorType};

use super::{Accumulation, floats, matmul, strided_copy};
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor, strides};

/// The einsum of `a` and `b` per `spec`; `out` is the result type.
///
/// Labels fall in four groups: batch (both operands and the output), contracting (both
/// operands only), and the free labels of each operand (`m` from the left, `n` from the right).
/// Each group may be empty, which covers outer products (no contracting labels) and pure
/// batch products. The products over the contracting labels accumulate as `acc` says.
pub(crate) fn einsum(
    acc: Accumulation,
    spec: &EinsumSpec,
    a: &Tensor,
    b: &Tensor,
    out: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let (av, bv) = (floats("einsum", a)?, floats("einsum", b)?);
    let batch = spec.batch();
    let contracting = spec.contracting();
    let free_of = |own: &[char], other: &[char]| -> Vec<char> {
        spec.out
            .iter()
            .copied()
            .filter(|c| own.contains(c) && !other.contains(c))
            .collect()
    };
    let (m_labels, n_labels) = (free_of(&spec.lhs, &spec.rhs), free_of(&spec.rhs, &spec.lhs));

    let lhs_order: Vec<char> = [&batch[..], &m_labels, &contracting].concat();
    let rhs_order: Vec<char> = [&batch[..], &contracting, &n_labels].concat();
    let lhs = Operand::new(&spec.lhs, a);
    let rhs = Operand::new(&spec.rhs, b);
    let label_size = |c: char| lhs.size(c).or_else(|| rhs.size(c)).unwrap_or(1);
    let size = |labels: &[char]| -> usize { labels.iter().map(|&c| label_size(c)).product() };
    let (nb, m, k, n) = (
        size(&batch),
        size(&m_labels),
        size(&contracting),
        size(&n_labels),
    );

    let packed_a = lhs.packed(av, &lhs_order);
    let packed_b = rhs.packed(bv, &rhs_order);
    let mut c = vec![0.0; nb * m * n];
    for i in 0..nb {
        matmul(
            acc,
            m,
            n,
            k,
            &packed_a[i * m * k..(i + 1) * m * k],
            &packed_b[i * k * n..(i + 1) * k * n],
            &mut c[i * m * n..(i + 1) * m * n],
        );
    }

    // `c` is laid out [batch..., m..., n...]; permute it into the output's label order.
    let c_order: Vec<char> = [&batch[..], &m_labels, &n_labels].concat();
    let data = if c_order == spec.out {
        c
    } else {
        let c_dims: Vec<usize> = c_order.iter().map(|&l| label_size(l)).collect();
        let c_strides = strides(&c_dims);
        let view: Vec<usize> = spec
            .out
            .iter()
            .map(|l| {
                c_order
                    .iter()
                    .position(|x| x == l)
                    .map_or(0, |p| c_strides[p])
            })
            .collect();
        strided_copy(&c, out.dims(), &view)
    };
    Ok(Tensor::from_parts(out.clone(), Data::Float(data)))
}

/// An einsum operand: its labels with their sizes and strides.
struct Operand<'a> {
    labels: &'a [char],
    dims: &'a [usize],
    strides: Vec<usize>,
}

impl<'a> Operand<'a> {
    fn new(labels: &'a [char], t: &'a Tensor) -> Self {
        Operand {
            labels,
            dims: t.dims(),
            strides: strides(t.dims()),
        }
    }

    fn size(&self, label: char) -> Option<usize> {
        self.labels
            .iter()
            .position(|&l| l == label)
            .map(|p| self.dims[p])
    }

    /// The elements laid out with the labels in `order`; borrowed when already so.
    fn packed<'v>(&self, values: &'v [f64], order: &[char]) -> std::borrow::Cow<'v, [f64]> {
        if order == self.labels {
            return std::borrow::Cow::Borrowed(values);
        }
        let (dims, view): (Vec<usize>, Vec<usize>) = order
            .iter()
            .filter_map(|&l| {
                let p = self.labels.iter().position(|&x| x == l)?;
                Some((self.dims[p], self.strides[p]))
            })
            .unzip();
        std::borrow::Cow::Owned(strided_copy(values, &dims, &view))
    }
}
