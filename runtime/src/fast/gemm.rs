//! Einsum as strided `gemm` calls on `f32`: no operand is copied or transposed. The labels of
//! each group (batch, free of the left operand `m`, free of the right operand `n`,
//! contracting `k`) are merged into one matrix dim where the operands' strides allow it;
//! whatever cannot be merged becomes a loop around the calls (contracting labels accumulate
//! into the result). The result is written in place, by `gemm`'s own threads for a large
//! product, or by one thread per batch slice when the batch leads the result; small batched
//! calls whose blocks interleave in the result run one per thread into blocks of their own,
//! copied into place after. f32 products
//! accumulate in f32 (as PyTorch's and cuBLAS's do), or in f64 when the backend is told so
//! ([`super::FastCpuBackend::with_wide_accumulation`]).

use autopar_ir::{EinsumSpec, TensorType};
use rayon::prelude::*;

use super::elementwise::floats;
use super::{Ctx, FastTensor};
use crate::error::RuntimeError;
use crate::tensor::strides;

/// Below this many multiply-adds a product runs on one thread.
const PAR_FLOPS: usize = 1 << 18;

/// Below this many multiply-adds per call, the calls of a batched product run one per
/// thread rather than each on all threads (where `gemm`'s own threads cost more than they
/// share: a 128 x 128 x 32 attention block on two threads takes twice as long as on one).
const PAR_CALL_FLOPS: usize = 1 << 22;

/// One label: its size and its stride in the left operand, the right one and the result (0
/// where it does not occur).
#[derive(Clone, Copy, Debug)]
struct Label {
    size: usize,
    a: usize,
    b: usize,
    out: usize,
}

/// A matrix dim made of merged labels: its size and strides.
#[derive(Clone, Copy, Debug, Default)]
struct Dim {
    size: usize,
    a: usize,
    b: usize,
    out: usize,
}

/// Merges the innermost run of `labels` (ordered outer to inner) whose strides are contiguous
/// in every operand `keep` selects; returns the merged dim and the labels left outside it.
fn merge(labels: &[Label], keep: fn(&Label) -> [usize; 2]) -> (Dim, Vec<Label>) {
    let Some((last, rest)) = labels.split_last() else {
        return (
            Dim {
                size: 1,
                ..Dim::default()
            },
            Vec::new(),
        );
    };
    let mut dim = Dim {
        size: last.size,
        a: last.a,
        b: last.b,
        out: last.out,
    };
    let mut left = rest.len();
    while left > 0 {
        let l = &rest[left - 1];
        let [s0, s1] = keep(l);
        let inner = keep(&Label {
            size: dim.size,
            a: dim.a,
            b: dim.b,
            out: dim.out,
        });
        if s0 == inner[0] * dim.size && s1 == inner[1] * dim.size {
            dim.size *= l.size;
            left -= 1;
        } else {
            break;
        }
    }
    (dim, rest[..left].to_vec())
}

/// The einsum of `a` and `b` per `spec`, of type `out`.
pub(crate) fn einsum(
    ctx: &Ctx,
    spec: &EinsumSpec,
    a: &FastTensor,
    b: &FastTensor,
    out: &TensorType,
) -> Result<FastTensor, RuntimeError> {
    let (av, bv) = (floats("einsum", a)?, floats("einsum", b)?);
    let (sa, sb, so) = (
        strides(a.ty().dims()),
        strides(b.ty().dims()),
        strides(out.dims()),
    );
    let find = |labels: &[char], c: char| labels.iter().position(|&x| x == c);
    let label = |c: char| {
        let pa = find(&spec.lhs, c);
        let pb = find(&spec.rhs, c);
        let po = find(&spec.out, c);
        let size = pa
            .map(|p| a.ty().dims()[p])
            .or(pb.map(|p| b.ty().dims()[p]))
            .unwrap_or(1);
        Label {
            size,
            a: pa.map_or(0, |p| sa[p]),
            b: pb.map_or(0, |p| sb[p]),
            out: po.map_or(0, |p| so[p]),
        }
    };
    let n_out = out.num_elements() as usize;
    let mut dst = ctx.f32s(n_out);
    // Size-1 labels move nothing: leave them out. Groups in the result's order (m, n,
    // batch) or the left operand's (k).
    let in_out = |c: &&char| spec.lhs.contains(c) || spec.rhs.contains(c);
    let group = |pred: &dyn Fn(char) -> bool, order: &[char]| -> Vec<Label> {
        order
            .iter()
            .filter(in_out)
            .copied()
            .filter(|&c| pred(c))
            .map(label)
            .filter(|l| l.size != 1)
            .collect()
    };
    let (in_a, in_b, in_o) = (
        |c: char| spec.lhs.contains(&c),
        |c: char| spec.rhs.contains(&c),
        |c: char| spec.out.contains(&c),
    );
    let batch = group(&|c| in_a(c) && in_b(c) && in_o(c), &spec.out);
    let m_labels = group(&|c| in_a(c) && !in_b(c), &spec.out);
    let n_labels = group(&|c| in_b(c) && !in_a(c), &spec.out);
    let k_labels = group(&|c| in_a(c) && in_b(c) && !in_o(c), &spec.lhs);
    if k_labels.iter().any(|l| l.size == 0) || n_out == 0 {
        dst.fill(0.0);
        return Ok(ctx.float(out, dst));
    }
    let (m, m_rest) = merge(&m_labels, |l| [l.a, l.out]);
    let (n, n_rest) = merge(&n_labels, |l| [l.b, l.out]);
    let (k, k_rest) = merge(&k_labels, |l| [l.a, l.b]);
    // The loops around each call: batch and unmerged free labels index the result; the
    // unmerged contracting labels accumulate.
    let outer: Vec<Label> = [&batch[..], &m_rest, &n_rest].concat();
    let plan = Plan {
        m,
        n,
        k,
        outer: offsets(&outer),
        k_offsets: offsets(&k_rest),
        outer_leads: !outer.is_empty() && merged_is_suffix(&m, &n),
    };
    // f32 products accumulate in f64 when the backend says so (`--wide-accumulation`): a weight
    // gradient's sum over the batch often cancels far below the size of its terms, and Adam's
    // normalised step turns f32 noise in such a gradient into a visible update. bf16 and f16
    // products accumulate in f32, already far wider than their dtype.
    if ctx.wide && out.dtype == autopar_ir::DType::F32 {
        let widen = |v: &[f32]| {
            let mut w = ctx.pool.f64s(v.len());
            for (w, &x) in w.iter_mut().zip(v) {
                *w = f64::from(x);
            }
            w
        };
        let (a64, b64) = (widen(av), widen(bv));
        let mut d64 = ctx.pool.f64s(n_out);
        let result = plan.run(ctx, &mut d64, &a64, &b64);
        for (d, &x) in dst.iter_mut().zip(&d64) {
            *d = x as f32;
        }
        for v in [a64, b64, d64] {
            ctx.pool.give_back_f64s(v);
        }
        result?;
    } else {
        plan.run(ctx, &mut dst, av, bv)?;
    }
    Ok(ctx.float(out, dst))
}

/// The offsets (in the left operand, the right one and the result) of every index of
/// `labels`, row-major.
fn offsets(labels: &[Label]) -> Vec<Label> {
    let total: usize = labels.iter().map(|l| l.size).product();
    (0..total)
        .map(|idx| {
            let mut rem = idx;
            let mut off = Label {
                size: 0,
                a: 0,
                b: 0,
                out: 0,
            };
            for l in labels.iter().rev() {
                let i = rem % l.size;
                rem /= l.size;
                off.a += i * l.a;
                off.b += i * l.b;
                off.out += i * l.out;
            }
            off
        })
        .collect()
}

/// The calls of one einsum: the matrix dims, the offsets of each call around them and of
/// each contracting step that accumulates.
struct Plan {
    m: Dim,
    n: Dim,
    k: Dim,
    outer: Vec<Label>,
    k_offsets: Vec<Label>,
    /// The merged `m`, `n` dims form one contiguous block of the result.
    outer_leads: bool,
}

impl Plan {
    /// One call (or one per unmerged contracting step) at the given offsets.
    fn product<T: Element>(
        &self,
        dst: &mut [T],
        dst_off: usize,
        (oa, ob): (usize, usize),
        (a, b): (&[T], &[T]),
        threads: usize,
    ) -> Result<(), RuntimeError> {
        let strides = (self.m.out, self.n.out);
        self.product_at(dst, dst_off, strides, (oa, ob), (a, b), threads)
    }

    /// [`Plan::product`] into a result laid out with row and column strides `dst_rs`,
    /// `dst_cs`.
    fn product_at<T: Element>(
        &self,
        dst: &mut [T],
        dst_off: usize,
        (dst_rs, dst_cs): (usize, usize),
        (oa, ob): (usize, usize),
        (a, b): (&[T], &[T]),
        threads: usize,
    ) -> Result<(), RuntimeError> {
        for (j, ko) in self.k_offsets.iter().enumerate() {
            matmul(
                MatMul {
                    m: self.m.size,
                    n: self.n.size,
                    k: self.k.size,
                    dst_off,
                    dst_rs,
                    dst_cs,
                    accumulate: j > 0,
                    lhs_off: oa + ko.a,
                    lhs_rs: self.m.a,
                    lhs_cs: self.k.a,
                    rhs_off: ob + ko.b,
                    rhs_rs: self.k.b,
                    rhs_cs: self.n.b,
                    threads,
                },
                dst,
                a,
                b,
            )?;
        }
        Ok(())
    }

    /// Every call, into `dst`.
    fn run<T: Element>(
        &self,
        ctx: &Ctx,
        dst: &mut [T],
        a: &[T],
        b: &[T],
    ) -> Result<(), RuntimeError> {
        let block = self.m.size * self.n.size;
        let flops = block * self.k.size;
        let calls = self.outer.len();
        if self.outer_leads && ctx.threads > 1 && calls > 1 && flops * calls >= PAR_FLOPS {
            // Each call owns one contiguous block of the result when the blocks tile it.
            let mut by_out: Vec<&Label> = self.outer.iter().collect();
            by_out.sort_by_key(|o| o.out);
            if by_out.iter().enumerate().all(|(i, o)| o.out == i * block) {
                return ctx.install(|| {
                    dst.par_chunks_mut(block)
                        .zip(by_out.par_iter())
                        .try_for_each(|(chunk, o)| self.product(chunk, 0, (o.a, o.b), (a, b), 1))
                });
            }
        }
        if ctx.threads > 1 && calls > 1 && flops * calls >= PAR_FLOPS && flops < PAR_CALL_FLOPS {
            // The calls' blocks interleave in the result: each is computed into a block of
            // its own, one call per thread, then copied into place.
            let (m, n) = (self.m.size, self.n.size);
            let mut blocks = vec![T::ZERO; block * calls];
            ctx.install(|| {
                blocks
                    .par_chunks_mut(block)
                    .zip(self.outer.par_iter())
                    .try_for_each(|(chunk, o)| {
                        self.product_at(chunk, 0, (n, 1), (o.a, o.b), (a, b), 1)
                    })
            })?;
            for (chunk, o) in blocks.chunks_exact(block).zip(&self.outer) {
                for (i, row) in chunk.chunks_exact(n).enumerate().take(m) {
                    let at = o.out + i * self.m.out;
                    for (j, &x) in row.iter().enumerate() {
                        dst[at + j * self.n.out] = x;
                    }
                }
            }
            return Ok(());
        }
        let threads = if flops >= PAR_FLOPS { ctx.threads } else { 1 };
        for o in &self.outer {
            if threads > 1 {
                ctx.install(|| self.product(dst, o.out, (o.a, o.b), (a, b), threads))?;
            } else {
                self.product(dst, o.out, (o.a, o.b), (a, b), 1)?;
            }
        }
        Ok(())
    }
}

/// The element types the products run in.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
}

impl Element for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
}

impl Element for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
}

/// True when the merged `m` and `n` dims of the result cover one contiguous block of
/// `m.size * n.size` elements (either order).
fn merged_is_suffix(m: &Dim, n: &Dim) -> bool {
    let dense = |d: &Dim, inner: usize| d.size == 1 || d.out == inner;
    (dense(n, 1) && dense(m, n.size)) || (dense(m, 1) && dense(n, m.size))
}

/// One product `dst[i, j] (+)= sum_l lhs[i, l] rhs[l, j]` over strided views, in elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatMul {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst_off: usize,
    pub dst_rs: usize,
    pub dst_cs: usize,
    /// Add to `dst` instead of overwriting it.
    pub accumulate: bool,
    pub lhs_off: usize,
    pub lhs_rs: usize,
    pub lhs_cs: usize,
    pub rhs_off: usize,
    pub rhs_rs: usize,
    pub rhs_cs: usize,
    /// Threads `gemm` may use (inside the backend's pool).
    pub threads: usize,
}

/// The last element a `rows x cols` view at `off` with strides `rs`, `cs` reads.
fn last_index(off: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Option<usize> {
    off.checked_add(rows.checked_sub(1)?.checked_mul(rs)?)?
        .checked_add(cols.checked_sub(1)?.checked_mul(cs)?)
}

/// Runs one [`MatMul`] with `gemm`, after checking in safe code that every view lies inside
/// its slice and that no two result elements share an address.
#[allow(unsafe_code)]
pub(crate) fn matmul<T: Element>(
    p: MatMul,
    dst: &mut [T],
    lhs: &[T],
    rhs: &[T],
) -> Result<(), RuntimeError> {
    if p.m == 0 || p.n == 0 {
        return Ok(());
    }
    let bad = |what: &str| RuntimeError::BadTensor {
        ty: TensorType::new(autopar_ir::DType::F32, [dst.len()]),
        detail: format!(
            "einsum: the {what} view of a {}x{}x{} product is out of bounds",
            p.m, p.n, p.k
        ),
    };
    let in_bounds = |len: usize, off, rows, cols, rs, cs| {
        last_index(off, rows, cols, rs, cs).is_some_and(|last| last < len)
    };
    if !in_bounds(dst.len(), p.dst_off, p.m, p.n, p.dst_rs, p.dst_cs) {
        return Err(bad("result"));
    }
    // Distinct result elements at distinct addresses (non-negative strides).
    let distinct = (p.m == 1 || p.dst_rs >= 1)
        && (p.n == 1 || p.dst_cs >= 1)
        && (p.m == 1 || p.n == 1 || p.dst_rs >= p.n * p.dst_cs || p.dst_cs >= p.m * p.dst_rs);
    if !distinct {
        return Err(bad("result (overlapping)"));
    }
    if p.k == 0 {
        if !p.accumulate {
            for i in 0..p.m {
                for j in 0..p.n {
                    dst[p.dst_off + i * p.dst_rs + j * p.dst_cs] = T::ZERO;
                }
            }
        }
        return Ok(());
    }
    if !in_bounds(lhs.len(), p.lhs_off, p.m, p.k, p.lhs_rs, p.lhs_cs) {
        return Err(bad("left operand"));
    }
    if !in_bounds(rhs.len(), p.rhs_off, p.k, p.n, p.rhs_rs, p.rhs_cs) {
        return Err(bad("right operand"));
    }
    let s = |x: usize| isize::try_from(x).map_err(|_| bad("stride of the"));
    let (dst_rs, dst_cs) = (s(p.dst_rs)?, s(p.dst_cs)?);
    let (lhs_rs, lhs_cs) = (s(p.lhs_rs)?, s(p.lhs_cs)?);
    let (rhs_rs, rhs_cs) = (s(p.rhs_rs)?, s(p.rhs_cs)?);
    let parallelism = if p.threads > 1 {
        gemm::Parallelism::Rayon(p.threads)
    } else {
        gemm::Parallelism::None
    };
    let dst = &mut dst[p.dst_off..];
    let lhs = &lhs[p.lhs_off..];
    let rhs = &rhs[p.rhs_off..];
    // SAFETY: every element each view reaches lies inside its slice (checked above with
    // overflow-checked arithmetic, strides non-negative); the result view maps distinct
    // (i, j) to distinct elements, so `gemm`'s threads never write one element twice; `dst`
    // is a unique borrow, so it aliases neither operand. gemm computes
    // `dst = alpha dst + beta lhs rhs` (the reverse of BLAS's names): `alpha = 1` with
    // `read_dst` accumulates, and without `read_dst` the old contents are not read.
    unsafe {
        gemm::gemm(
            p.m,
            p.n,
            p.k,
            dst.as_mut_ptr(),
            dst_cs,
            dst_rs,
            p.accumulate,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}
