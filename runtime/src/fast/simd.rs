//! Runtime-dispatched vectorisation. The workspace is compiled for the baseline x86-64 (SSE2),
//! so a plain loop over `f32` runs four lanes wide at most. [`vectorized`] runs a closure
//! inside a function compiled for the best instruction set the CPU offers (AVX-512 or
//! AVX2+FMA, detected once per process by `pulp`), so that the loops inlined into it are
//! auto-vectorised for that set. It changes no result: Rust never contracts `a * b + c` into
//! a fused multiply-add, and the vector forms of `+ - * /`, `sqrt`, comparisons and
//! conversions round exactly as the scalar ones do.
//!
//! The closure must be inlined into that function to benefit, and so must every closure it
//! calls per row or per element: mark each one `#[inline(always)]` where it is written
//! (`vectorized(#[inline(always)] || ...)`, `rows(..., #[inline(always)] |i, row, out| ...)`).
//! Unmarked, LLVM may keep a large closure (an `exp` polynomial, say) as a function of its
//! own, which is compiled for the baseline: softmax, cross-entropy and AdamW ran that way at
//! four lanes until they were marked.

use std::sync::OnceLock;

/// The instruction set detected at first use.
fn arch() -> pulp::Arch {
    static ARCH: OnceLock<pulp::Arch> = OnceLock::new();
    *ARCH.get_or_init(pulp::Arch::new)
}

/// Runs `f` compiled for the CPU's widest vector instructions. `f` itself and whatever it
/// calls must be `#[inline(always)]` (or small enough to be inlined) to benefit.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    arch().dispatch(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each x86 level is a separate `pulp` feature: built without `x86-v3`, a CPU with AVX2
    /// but no AVX-512 ran every loop at the SSE2 baseline.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_cpu_with_avx2_and_fma_gets_a_vector_level() {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("bmi1")
            && std::is_x86_feature_detected!("bmi2")
            && std::is_x86_feature_detected!("lzcnt");
        if avx2 {
            assert!(
                !matches!(arch(), pulp::Arch::Scalar),
                "AVX2 and FMA are present, but the vectorised loops dispatch to the baseline"
            );
        }
    }

    #[test]
    fn vectorized_loops_give_the_scalar_loops_bits() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let f = |a: f32| (a * 1.5 + 0.25) / (1.0 + a * a).sqrt();
        let plain: Vec<f32> = x.iter().map(|&a| f(a)).collect();
        let fast: Vec<f32> = vectorized(|| x.iter().map(|&a| f(a)).collect());
        assert_eq!(
            plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
