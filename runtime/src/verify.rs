//! The comparison of a parallel run with the single-device reference (`--verify`): per-step
//! losses and final state tensors, parallel against reference, held to one [`Tolerance`]
//! policy, with a [`VerifyReport`] that fails on any non-finite value.
//!
//! Errors are measured per tensor: the absolute error is the largest `|parallel - reference|`
//! over its elements, the relative error that over `max(max |reference|, REL_FLOOR)` (see
//! [`Tolerance::REL_FLOOR`]). A NaN or infinity anywhere, in either run, in a loss or in any
//! state element, fails the comparison and is reported by name: a diverged run must never
//! read `max_abs_err=0`.
//!
//! A run whose f32 contractions accumulate in f32 is held to a tolerance widened by a
//! measured noise floor ([`Tolerance::with_noise_floor`]): the difference between the
//! reference and a second reference that accumulates in f32 ([`crate::Accumulation::F32`]),
//! advanced on the same state and batches and compared the same way.

use autopar_ir::DType;

use crate::TensorMap;
use crate::error::RuntimeError;
use crate::tensor::Tensor;

/// The largest absolute and relative error a parallel run may show against the reference.
///
/// The policy, in one place:
/// - f32 compute: `1e-4` ([`Tolerance::F32`]). The parallel run adds partial sums in another
///   order (ring reductions, sharded contractions); in f32 that moves results by a few ulps
///   per op, far below `1e-4` after a few steps.
/// - bf16 or f16 compute: `5e-2` ([`Tolerance::LOW_PRECISION`]). Partial sums are rounded to
///   8 (or 11) bits in a different order on every mesh, so gradients differ by about 1%, and
///   Adam's normalised update turns that into a difference of up to the learning rate per
///   step on elements with tiny gradients.
/// - f32 compute on a backend whose f32 contractions accumulate in f32 (the fast CPU
///   backend's default, as PyTorch's and cuBLAS's GEMMs do): `max(1e-4, NOISE_FACTOR × noise)`
///   ([`Tolerance::with_noise_floor`]), where the noise floor is the larger error of a second
///   reference that accumulates in f32 ([`crate::Accumulation::F32`]) against the wide one,
///   on the same trajectory. Each dot product then carries a relative rounding error of
///   about `sqrt(k) 2^-24`, and training amplifies it step after step (Adam normalises a
///   gradient that cancels, so noise in it becomes an update of up to the learning rate):
///   after 60 steps of `gpt-tiny` the state moves by about `1e-4` from accumulation alone,
///   after 3 steps already by more than `1e-4` on some meshes, beyond any fixed f32 tolerance
///   that still catches bugs. A correct parallel run adds its own f32 noise (another order
///   of the terms, sharded sums, attention's probabilities held in f32), so its error is
///   another sample of about the floor's size. Measured over the verify configurations of
///   the tests (`gpt-tiny`, `llama-tiny`, `moe-tiny` on `dp=2`, `tp=2`, `dp=2,tp=2`, `pp=2`,
///   `cp=2`, `ep=2` and ZeRO-1/2/3, AdamW, 3 and 60 steps), the parallel error was 0.2 to 1.2
///   times the floor for `llama-tiny` and `moe-tiny` and 1.2 to 2.8 times for `gpt-tiny` (the
///   largest on `pp=2` with two micro-batches, whose floor is the smallest: the fast
///   backend's noise shrinks less with shorter sums than the sequential chains' do).
///   [`Tolerance::NOISE_FACTOR`] = 5 leaves a margin of 1.8 above the worst, while a defect
///   (a term dropped, a shard misplaced, a scale off by 1e-3 on a weight of size 1) moves a
///   tensor by several times its rounding noise and still fails. One kind of run is beyond
///   any noise floor: top-k routing (`moe_route`) over many steps, where noise can send a
///   token to another expert in one run and not in the other (`moe-tiny` after 55 to 60
///   steps on `dp=2`, `ep=2`, `pp=2` and ZeRO meshes, and on one device: an error ten times
///   the floor, appearing at once); wide accumulation keeps such runs within `1e-4`.
/// - Relative errors are taken against `max(|reference|, 1)` ([`Tolerance::REL_FLOOR`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance(pub f64);

impl Tolerance {
    /// The tolerance for f32 compute.
    pub const F32: Tolerance = Tolerance(1e-4);

    /// The tolerance for bf16 or f16 compute.
    pub const LOW_PRECISION: Tolerance = Tolerance(5e-2);

    /// The smallest scale relative errors are taken against, so that tensors of magnitude
    /// below 1 are held to the absolute tolerance (the usual mixed criterion `|a - b| <= tol *
    /// max(|b|, 1)`). A weight whose gradient vanishes in exact arithmetic (a key bias:
    /// softmax ignores a shift common to all keys) moves only on rounding noise, which
    /// differs with the order of the sums; relative to its own near-zero size that noise
    /// would look like a disagreement.
    pub const REL_FLOOR: f64 = 1.0;

    /// How many times the f32-accumulation noise floor a parallel run may differ by (see
    /// the policy above).
    pub const NOISE_FACTOR: f64 = 5.0;

    /// The tolerance for a compute dtype.
    pub fn for_compute(compute: DType) -> Tolerance {
        if compute == DType::F32 {
            Tolerance::F32
        } else {
            Tolerance::LOW_PRECISION
        }
    }

    /// This tolerance widened to `NOISE_FACTOR × noise`, the error a correct run with f32
    /// accumulation may show given the `noise` floor measured on its trajectory (the larger
    /// of the noise comparison's errors); never narrower than `self`. A noise floor that is
    /// not finite (the f32-accumulating reference diverged) widens nothing.
    ///
    /// ```
    /// use autopar_runtime::verify::Tolerance;
    /// assert_eq!(Tolerance::F32.with_noise_floor(1e-6), Tolerance::F32);
    /// assert_eq!(Tolerance::F32.with_noise_floor(1e-4).0, Tolerance::NOISE_FACTOR * 1e-4);
    /// assert_eq!(Tolerance::F32.with_noise_floor(f64::NAN), Tolerance::F32);
    /// ```
    pub fn with_noise_floor(self, noise: f64) -> Tolerance {
        if !noise.is_finite() {
            return self;
        }
        Tolerance(self.0.max(Tolerance::NOISE_FACTOR * noise))
    }
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance::F32
    }
}

/// Which of the two runs a value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The parallel run under test.
    Parallel,
    /// The single-device reference.
    Reference,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Parallel => "the parallel run",
            Side::Reference => "the reference",
        })
    }
}

/// A tensor (or loss) holding a NaN or an infinity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NonFinite {
    /// The tensor's name (`loss` for a loss).
    pub tensor: String,
    /// The run it came from (the parallel run when both are non-finite).
    pub side: Side,
}

/// The outcome of a comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyReport {
    /// The tensor (or `loss`) with the largest relative error, or the first non-finite one.
    pub worst: String,
    /// Largest absolute error over the losses and every state tensor (infinite when a value
    /// is not finite).
    pub max_abs_err: f64,
    /// Largest relative error (see the module docs; infinite when a value is not finite).
    pub max_rel_err: f64,
    /// The tolerance both errors are held to.
    pub tolerance: f64,
    /// The f32-accumulation noise floor the tolerance was widened by, when the run under
    /// test accumulates its f32 contractions in f32 ([`Tolerance::with_noise_floor`]).
    pub noise_floor: Option<f64>,
    /// The first tensor found holding a NaN or an infinity, if any.
    pub non_finite: Option<NonFinite>,
}

impl VerifyReport {
    /// True when every value is finite and both errors are within the tolerance.
    pub fn ok(&self) -> bool {
        self.non_finite.is_none()
            && self.max_abs_err <= self.tolerance
            && self.max_rel_err <= self.tolerance
    }

    /// `verify: max_abs_err=<x> max_rel_err=<y> OK` (or `FAILED`, followed by the non-finite
    /// tensor when there is one); with a noise floor, the tolerance and the floor come before
    /// the verdict: `... tolerance=<t> (f32-accumulation noise <n>) OK`.
    pub fn line(&self) -> String {
        let mut line = format!(
            "verify: max_abs_err={:.3e} max_rel_err={:.3e}",
            self.max_abs_err, self.max_rel_err
        );
        if let Some(noise) = self.noise_floor {
            line += &format!(
                " tolerance={:.3e} (f32-accumulation noise {noise:.3e})",
                self.tolerance
            );
        }
        line += if self.ok() { " OK" } else { " FAILED" };
        if let Some(nf) = &self.non_finite {
            line += &format!(" (non-finite values in `{}` of {})", nf.tensor, nf.side);
        }
        line
    }
}

/// A comparison in progress: feed it losses and tensors, then [`finish`](Self::finish).
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    tolerance: Tolerance,
    abs: f64,
    rel: f64,
    worst: Option<String>,
    non_finite: Option<NonFinite>,
}

impl Comparison {
    /// An empty comparison held to `tolerance`.
    pub fn new(tolerance: Tolerance) -> Comparison {
        Comparison {
            tolerance,
            abs: 0.0,
            rel: 0.0,
            worst: None,
            non_finite: None,
        }
    }

    /// Compares one step's loss.
    pub fn loss(&mut self, parallel: f64, reference: f64) {
        self.values("loss", &[parallel], &[reference]);
    }

    /// Compares tensor `name` of the two runs, which must have the same type.
    pub fn tensor(
        &mut self,
        name: &str,
        parallel: &Tensor,
        reference: &Tensor,
    ) -> Result<(), RuntimeError> {
        if parallel.ty() != reference.ty() {
            return Err(RuntimeError::Verify {
                detail: format!(
                    "`{name}` is {} in the parallel run but {} in the reference",
                    parallel.ty(),
                    reference.ty()
                ),
            });
        }
        self.values(name, &parallel.to_f64_vec(), &reference.to_f64_vec());
        Ok(())
    }

    fn values(&mut self, name: &str, parallel: &[f64], reference: &[f64]) {
        let finite = |xs: &[f64]| xs.iter().all(|x| x.is_finite());
        let side = if !finite(parallel) {
            Some(Side::Parallel)
        } else if !finite(reference) {
            Some(Side::Reference)
        } else {
            None
        };
        if let Some(side) = side {
            if self.non_finite.is_none() {
                self.non_finite = Some(NonFinite {
                    tensor: name.to_string(),
                    side,
                });
                self.worst = Some(name.to_string());
            }
            self.abs = f64::INFINITY;
            self.rel = f64::INFINITY;
            return;
        }
        // Every value is finite here, so `f64::max` (which drops NaN) sees none.
        let abs = parallel
            .iter()
            .zip(reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f64, f64::max);
        let scale = reference.iter().map(|x| x.abs()).fold(0.0f64, f64::max);
        let rel = abs / scale.max(Tolerance::REL_FLOOR);
        self.abs = self.abs.max(abs);
        if self.non_finite.is_none() && (self.worst.is_none() || rel > self.rel) {
            self.worst = Some(name.to_string());
        }
        self.rel = self.rel.max(rel);
    }

    /// The report.
    pub fn finish(self) -> VerifyReport {
        VerifyReport {
            worst: self.worst.unwrap_or_else(|| "loss".into()),
            max_abs_err: self.abs,
            max_rel_err: self.rel,
            tolerance: self.tolerance.0,
            noise_floor: None,
            non_finite: self.non_finite,
        }
    }

    /// The report, with the tolerance widened by the noise floor `noise` measured: the report
    /// of the comparison of an f32-accumulating reference with this one's reference, made
    /// exactly as this one (see [`Tolerance::with_noise_floor`]).
    pub fn finish_with_noise(self, noise: &VerifyReport) -> VerifyReport {
        let floor = noise.max_abs_err.max(noise.max_rel_err);
        let tolerance = self.tolerance.with_noise_floor(floor);
        VerifyReport {
            tolerance: tolerance.0,
            noise_floor: Some(floor),
            ..self.finish()
        }
    }
}

/// Compares a parallel run with the reference: the loss of every step, then every tensor of
/// the reference's final `reference_state` with the parallel run's tensor of the same name
/// (extra parallel tensors are ignored).
pub fn compare(
    parallel_losses: &[f64],
    reference_losses: &[f64],
    parallel_state: &TensorMap,
    reference_state: &TensorMap,
    tolerance: Tolerance,
) -> Result<VerifyReport, RuntimeError> {
    if parallel_losses.len() != reference_losses.len() {
        return Err(RuntimeError::Verify {
            detail: format!(
                "the parallel run has {} losses but the reference {}",
                parallel_losses.len(),
                reference_losses.len()
            ),
        });
    }
    let mut c = Comparison::new(tolerance);
    for (&p, &r) in parallel_losses.iter().zip(reference_losses) {
        c.loss(p, r);
    }
    for (name, want) in reference_state {
        let got = parallel_state
            .get(name)
            .ok_or_else(|| RuntimeError::Verify {
                detail: format!("the parallel run has no `{name}`"),
            })?;
        c.tensor(name, got, want)?;
    }
    Ok(c.finish())
}

#[cfg(test)]
mod tests {
    use autopar_ir::TensorType;

    use super::*;

    fn t(values: &[f64]) -> Tensor {
        Tensor::from_f64(TensorType::new(DType::F32, [values.len()]), values.to_vec())
            .expect("tensor")
    }

    fn state(pairs: &[(&str, &[f64])]) -> TensorMap {
        pairs.iter().map(|(n, v)| (n.to_string(), t(v))).collect()
    }

    #[test]
    fn agreeing_runs_pass_and_print_ok() -> Result<(), RuntimeError> {
        let r = compare(
            &[2.0, 1.5],
            &[2.0, 1.50001],
            &state(&[("w", &[0.5, -3.0])]),
            &state(&[("w", &[0.5, -3.0001])]),
            Tolerance::F32,
        )?;
        assert!(r.ok(), "{r:?}");
        assert!(r.non_finite.is_none());
        assert!(r.line().starts_with("verify: max_abs_err="));
        assert!(r.line().ends_with(" OK"), "{}", r.line());
        Ok(())
    }

    #[test]
    fn relative_errors_are_floored_at_one() -> Result<(), RuntimeError> {
        // An error of 5e-5 on a tensor of size 1e-3 is 5% of it, but within the absolute
        // tolerance: it passes. On a tensor of size 100 the relative error is 5e-5 / 100.
        let r = compare(
            &[],
            &[],
            &state(&[("b", &[1.05e-3])]),
            &state(&[("b", &[1e-3])]),
            Tolerance::F32,
        )?;
        assert!(r.ok(), "{r:?}");
        assert!((r.max_rel_err - 5e-5).abs() < 1e-9, "{r:?}");
        let r = compare(
            &[],
            &[],
            &state(&[("w", &[100.02])]),
            &state(&[("w", &[100.0])]),
            Tolerance::F32,
        )?;
        assert!((r.max_rel_err - 2e-4).abs() < 1e-6, "{r:?}");
        assert!(r.max_abs_err > 1.9e-2);
        assert!(!r.ok());
        Ok(())
    }

    #[test]
    fn the_worst_tensor_is_named() -> Result<(), RuntimeError> {
        let r = compare(
            &[1.0],
            &[1.0],
            &state(&[("a", &[1.0]), ("b", &[2.5])]),
            &state(&[("a", &[1.0]), ("b", &[2.0])]),
            Tolerance::LOW_PRECISION,
        )?;
        assert_eq!(r.worst, "b");
        assert!(!r.ok());
        assert!(r.line().ends_with(" FAILED"), "{}", r.line());
        Ok(())
    }

    #[test]
    fn nan_in_a_parallel_weight_fails_and_is_named() -> Result<(), RuntimeError> {
        let r = compare(
            &[1.0],
            &[1.0],
            &state(&[("a", &[1.0]), ("w", &[f64::NAN, 0.0])]),
            &state(&[("a", &[1.0]), ("w", &[0.0, 0.0])]),
            Tolerance::F32,
        )?;
        assert!(!r.ok());
        assert_eq!(
            r.non_finite,
            Some(NonFinite {
                tensor: "w".into(),
                side: Side::Parallel
            })
        );
        assert_eq!(r.worst, "w");
        assert!(r.max_abs_err.is_infinite());
        assert!(
            r.line()
                .contains("FAILED (non-finite values in `w` of the parallel run)"),
            "{}",
            r.line()
        );
        Ok(())
    }

    #[test]
    fn nan_in_both_runs_is_still_a_failure() -> Result<(), RuntimeError> {
        // Every weight NaN on both sides (a learning rate of 1e30): the differences are NaN,
        // which `f64::max` would drop, reporting max_abs_err=0.
        let nan = state(&[("w", &[f64::NAN, f64::NAN])]);
        let r = compare(&[f64::NAN], &[f64::NAN], &nan, &nan, Tolerance::F32)?;
        assert!(!r.ok());
        assert_ne!(r.max_abs_err, 0.0);
        assert_eq!(
            r.non_finite.as_ref().map(|n| n.tensor.as_str()),
            Some("loss")
        );
        Ok(())
    }

    #[test]
    fn infinity_in_the_reference_fails() -> Result<(), RuntimeError> {
        let r = compare(
            &[],
            &[],
            &state(&[("w", &[1.0])]),
            &state(&[("w", &[f64::INFINITY])]),
            Tolerance::LOW_PRECISION,
        )?;
        assert!(!r.ok());
        assert_eq!(r.non_finite.map(|n| n.side), Some(Side::Reference));
        Ok(())
    }

    #[test]
    fn a_non_finite_loss_fails() -> Result<(), RuntimeError> {
        let w = state(&[("w", &[1.0])]);
        let r = compare(&[1.0, f64::INFINITY], &[1.0, 0.9], &w, &w, Tolerance::F32)?;
        assert!(!r.ok());
        assert_eq!(
            r.non_finite,
            Some(NonFinite {
                tensor: "loss".into(),
                side: Side::Parallel
            })
        );
        Ok(())
    }

    #[test]
    fn mismatched_runs_are_errors() {
        let w = state(&[("w", &[1.0])]);
        let empty = TensorMap::new();
        assert!(matches!(
            compare(&[1.0], &[], &w, &w, Tolerance::F32),
            Err(RuntimeError::Verify { .. })
        ));
        assert!(matches!(
            compare(&[], &[], &empty, &w, Tolerance::F32),
            Err(RuntimeError::Verify { .. })
        ));
        let longer = state(&[("w", &[1.0, 2.0])]);
        assert!(matches!(
            compare(&[], &[], &longer, &w, Tolerance::F32),
            Err(RuntimeError::Verify { .. })
        ));
    }

    #[test]
    fn the_noise_floor_widens_the_tolerance_by_its_factor() -> Result<(), RuntimeError> {
        // Below `F32 / NOISE_FACTOR` the floor changes nothing; above it the tolerance is
        // `NOISE_FACTOR` times the floor; a floor that is not finite widens nothing.
        let small = Tolerance::F32.0 / Tolerance::NOISE_FACTOR / 2.0;
        assert_eq!(Tolerance::F32.with_noise_floor(small), Tolerance::F32);
        assert_eq!(Tolerance::F32.with_noise_floor(0.0), Tolerance::F32);
        let wide = Tolerance::F32.with_noise_floor(1e-3);
        assert!(
            (wide.0 - Tolerance::NOISE_FACTOR * 1e-3).abs() < 1e-15,
            "{wide:?}"
        );
        for bad in [f64::NAN, f64::INFINITY] {
            assert_eq!(Tolerance::F32.with_noise_floor(bad), Tolerance::F32);
        }
        // The factor leaves room for a correct run's noise, yet stays far below the error of
        // a relative defect of 1e-3 on a tensor of size 1 when the noise is about 1e-4.
        const { assert!(Tolerance::NOISE_FACTOR >= 2.0) };
        const { assert!(Tolerance::NOISE_FACTOR * 1e-4 < 1e-3) };

        // A run 2.5e-4 off the reference, against a floor of 1e-4: OK, and the line says so.
        let w = |x: f64| state(&[("w", &[x, 1.0])]);
        let noise = compare(&[1.0], &[1.0], &w(1.0001), &w(1.0), Tolerance::F32)?;
        let mut c = Comparison::new(Tolerance::F32);
        c.loss(1.0, 1.0);
        c.tensor("w", &t(&[1.00025, 1.0]), &t(&[1.0, 1.0]))?;
        let r = c.finish_with_noise(&noise);
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.noise_floor, Some(noise.max_abs_err));
        assert!((r.tolerance - Tolerance::NOISE_FACTOR * noise.max_abs_err).abs() < 1e-12);
        let line = r.line();
        assert!(
            line.starts_with("verify: max_abs_err=2.500e-4 max_rel_err=2.500e-4 tolerance=5.00")
                && line.ends_with(" (f32-accumulation noise 1.000e-4) OK"),
            "{line}"
        );
        // A defect of a relative 1e-3 on that tensor fails against the same floor.
        let mut c = Comparison::new(Tolerance::F32);
        c.tensor("w", &t(&[1.001, 1.0]), &t(&[1.0, 1.0]))?;
        let r = c.finish_with_noise(&noise);
        assert!(!r.ok(), "{r:?}");
        assert!(r.line().ends_with(" FAILED"), "{}", r.line());
        // Without a floor the line is as before, with no tolerance in it.
        let plain = compare(&[], &[], &w(1.0), &w(1.0), Tolerance::F32)?;
        assert_eq!(plain.noise_floor, None);
        assert!(!plain.line().contains("tolerance"), "{}", plain.line());
        Ok(())
    }

    #[test]
    fn a_diverged_noise_reference_does_not_widen_the_tolerance() -> Result<(), RuntimeError> {
        let nan = state(&[("w", &[f64::NAN])]);
        let w = state(&[("w", &[1.0])]);
        let noise = compare(&[], &[], &nan, &w, Tolerance::F32)?;
        let mut c = Comparison::new(Tolerance::F32);
        c.tensor("w", &t(&[1.01]), &t(&[1.0]))?;
        let r = c.finish_with_noise(&noise);
        assert_eq!(r.tolerance, Tolerance::F32.0);
        assert!(!r.ok(), "{r:?}");
        Ok(())
    }

    #[test]
    fn tolerances_follow_the_compute_dtype() {
        assert_eq!(Tolerance::for_compute(DType::F32), Tolerance::F32);
        assert_eq!(
            Tolerance::for_compute(DType::BF16),
            Tolerance::LOW_PRECISION
        );
        assert_eq!(Tolerance::for_compute(DType::F16), Tolerance::LOW_PRECISION);
        assert_eq!(Tolerance::default().0, 1e-4);
    }
}
