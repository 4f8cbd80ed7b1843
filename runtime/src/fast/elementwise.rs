//! Element-wise kernels of the fast backend: unary functions, binary arithmetic, comparisons,
//! select and casts. Each (op, dtype) pair is one monomorphised loop over slices (a splat
//! operand becomes a scalar in the loop), split over threads for large tensors. On f32, bf16
//! and f16 values the basic arithmetic (`+ - * /`, `sqrt`, max, min) gives the reference's
//! results bit for bit (f32 has more than twice the precision of bf16 and f16, so rounding
//! through it first changes nothing); transcendental functions are f32's, within an ulp or two.

use autopar_ir::{BinaryOp, CompareOp, DType, Op, TensorType, UnaryOp};
use rayon::prelude::*;

use super::simd::vectorized;
use super::storage::Elems;
use super::{Ctx, FastTensor, PAR_GRAIN, Val, reference_kernel};
use crate::error::RuntimeError;
use crate::tensor::round_to_dtype;

/// One float operand of a loop: a slice, or one value for every element.
#[derive(Clone, Copy)]
pub(crate) enum Side<'a> {
    Slice(&'a [f32]),
    Scalar(f32),
}

/// `out[i] = f(x[i])` on one thread, vectorised.
#[inline(always)]
fn apply1<F: Fn(f32) -> f32>(x: &[f32], out: &mut [f32], f: &F) {
    vectorized(
        #[inline(always)]
        || out.iter_mut().zip(x).for_each(|(o, &a)| *o = f(a)),
    );
}

/// `out[i] = f(a[i], b[i])` on one thread, vectorised.
#[inline(always)]
fn apply2<F: Fn(f32, f32) -> f32>(a: &[f32], b: &[f32], out: &mut [f32], f: &F) {
    vectorized(
        #[inline(always)]
        || {
            for ((o, &p), &q) in out.iter_mut().zip(a).zip(b) {
                *o = f(p, q);
            }
        },
    );
}

/// `out[i] = f(x[i])`, split over threads when large.
pub(crate) fn map1<F: Fn(f32) -> f32 + Sync>(ctx: &Ctx, x: &[f32], out: &mut [f32], f: F) {
    if ctx.parallel(out.len()) {
        ctx.install(|| {
            out.par_chunks_mut(PAR_GRAIN)
                .zip(x.par_chunks(PAR_GRAIN))
                .for_each(|(o, x)| apply1(x, o, &f));
        });
    } else {
        apply1(x, out, &f);
    }
}

/// `out[i] = f(a[i], b[i])`, with either side possibly a scalar.
pub(crate) fn map2<F: Fn(f32, f32) -> f32 + Sync>(
    ctx: &Ctx,
    a: Side,
    b: Side,
    out: &mut [f32],
    f: F,
) {
    match (a, b) {
        (Side::Slice(a), Side::Slice(b)) => {
            if ctx.parallel(out.len()) {
                ctx.install(|| {
                    out.par_chunks_mut(PAR_GRAIN)
                        .zip(a.par_chunks(PAR_GRAIN).zip(b.par_chunks(PAR_GRAIN)))
                        .for_each(|(o, (a, b))| apply2(a, b, o, &f));
                });
            } else {
                apply2(a, b, out, &f);
            }
        }
        (Side::Slice(a), Side::Scalar(q)) => map1(ctx, a, out, |p| f(p, q)),
        (Side::Scalar(p), Side::Slice(b)) => map1(ctx, b, out, |q| f(p, q)),
        (Side::Scalar(p), Side::Scalar(q)) => out.fill(f(p, q)),
    }
}

/// `e^x` in f32 by range reduction and a polynomial (Cephes' `expf` coefficients), written
/// without calls or branches so that loops over it vectorise; within two ulps of the
/// correctly rounded value, `inf` above 88.72, 0 below -86.6 (where the value would be
/// within 2^-125 of 0), NaN for NaN.
///
/// The range reduction and the polynomial are fused multiply-adds: inside [`vectorized`]
/// on a CPU with FMA they are single instructions (about 30% faster than separate multiplies
/// and adds here, and each rounds once, so no less accurate); elsewhere `mul_add` is the C
/// library's `fmaf`, which gives the same bits more slowly.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer in float arithmetic.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-86.6, 88.72);
    let t = xc.mul_add(LOG2E, ROUND);
    let n = t - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 0.166_666_65);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // 2^(n-1) from its bits (n - 1 lies in -126..=127), times two.
    let bits = (t.to_bits() as i32 - ROUND.to_bits() as i32 + 126) as u32;
    let scaled = y * f32::from_bits(bits << 23) * 2.0;
    let v = if x > 88.72 { f32::INFINITY } else { scaled };
    let v = if x < -86.6 { 0.0 } else { v };
    if x.is_nan() { x } else { v }
}

/// `tanh x = 1 - 2 / (e^(2|x|) + 1)` with the sign of `x`, through [`exp_f32`] (so that it
/// vectorises); within about 1e-7 of the true value (absolute, near 0; relative elsewhere).
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let t = 1.0 - 2.0 / (exp_f32(2.0 * x.abs()) + 1.0);
    if x.is_nan() { x } else { t.copysign(x) }
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(u)) = x sigmoid(2u)`, in f32.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp_f32(-2.0 * u))
}

/// The derivative of [`gelu`], in f32 (see `UnaryOp::GeluGrad`).
#[inline(always)]
fn gelu_grad(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const K: f32 = 0.044_715;
    let x2 = x * x;
    let t = tanh_f32(SQRT_2_OVER_PI * (x + K * x2 * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * K * x2)
}

/// The logistic function (`exp` overflowing to infinity gives 0, as it should).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// `out = func(x)` on floats.
pub(crate) fn unary_f32(ctx: &Ctx, func: UnaryOp, x: &[f32], out: &mut [f32]) {
    match func {
        UnaryOp::Neg => map1(ctx, x, out, |a| -a),
        UnaryOp::Abs => map1(ctx, x, out, f32::abs),
        UnaryOp::Exp => map1(ctx, x, out, exp_f32),
        UnaryOp::Log => map1(ctx, x, out, f32::ln),
        UnaryOp::Sqrt => map1(ctx, x, out, f32::sqrt),
        // In f64, as the reference: 1/sqrt rounded twice in f32 could differ.
        UnaryOp::Rsqrt => map1(ctx, x, out, |a| (1.0 / f64::from(a).sqrt()) as f32),
        UnaryOp::Recip => map1(ctx, x, out, |a| 1.0 / a),
        UnaryOp::Square => map1(ctx, x, out, |a| a * a),
        UnaryOp::Tanh => map1(ctx, x, out, tanh_f32),
        UnaryOp::Sigmoid => map1(ctx, x, out, sigmoid),
        UnaryOp::Relu => map1(ctx, x, out, |a| if a < 0.0 { 0.0 } else { a }),
        UnaryOp::Gelu => map1(ctx, x, out, gelu),
        UnaryOp::GeluGrad => map1(ctx, x, out, gelu_grad),
        UnaryOp::Silu => map1(ctx, x, out, |a| a * sigmoid(a)),
        UnaryOp::Erf => map1(ctx, x, out, libm::erff),
        UnaryOp::GeluErf => map1(ctx, x, out, |a| {
            0.5 * a * (1.0 + libm::erff(a * std::f32::consts::FRAC_1_SQRT_2))
        }),
        UnaryOp::Sin => map1(ctx, x, out, f32::sin),
        UnaryOp::Cos => map1(ctx, x, out, f32::cos),
    }
}

/// `out = func(a, b)` on floats.
pub(crate) fn binary_f32(ctx: &Ctx, func: BinaryOp, a: Side, b: Side, out: &mut [f32]) {
    match func {
        BinaryOp::Add => map2(ctx, a, b, out, |p, q| p + q),
        BinaryOp::Sub => map2(ctx, a, b, out, |p, q| p - q),
        BinaryOp::Mul => map2(ctx, a, b, out, |p, q| p * q),
        BinaryOp::Div => map2(ctx, a, b, out, |p, q| p / q),
        // Unlike `f32::max`, a NaN operand gives NaN.
        BinaryOp::Max => map2(
            ctx,
            a,
            b,
            out,
            |p, q| if p.is_nan() || p > q { p } else { q },
        ),
        BinaryOp::Min => map2(
            ctx,
            a,
            b,
            out,
            |p, q| if p.is_nan() || p < q { p } else { q },
        ),
        BinaryOp::Pow => map2(ctx, a, b, out, |p, q| {
            f64::from(p).powf(f64::from(q)) as f32
        }),
    }
}

/// `out = func(a, b)` on floats, as 0/1 booleans.
pub(crate) fn compare_f32(func: CompareOp, a: Side, b: Side, out: &mut [bool]) {
    #[inline(always)]
    fn go(a: Side, b: Side, out: &mut [bool], f: impl Fn(f32, f32) -> bool) {
        vectorized(
            #[inline(always)]
            || match (a, b) {
                (Side::Slice(a), Side::Slice(b)) => {
                    for ((o, &p), &q) in out.iter_mut().zip(a).zip(b) {
                        *o = f(p, q);
                    }
                }
                (Side::Slice(a), Side::Scalar(q)) => {
                    for (o, &p) in out.iter_mut().zip(a) {
                        *o = f(p, q);
                    }
                }
                (Side::Scalar(p), Side::Slice(b)) => {
                    for (o, &q) in out.iter_mut().zip(b) {
                        *o = f(p, q);
                    }
                }
                (Side::Scalar(p), Side::Scalar(q)) => out.fill(f(p, q)),
            },
        )
    }
    match func {
        CompareOp::Eq => go(a, b, out, |p, q| p == q),
        CompareOp::Ne => go(a, b, out, |p, q| p != q),
        CompareOp::Lt => go(a, b, out, |p, q| p < q),
        CompareOp::Le => go(a, b, out, |p, q| p <= q),
        CompareOp::Gt => go(a, b, out, |p, q| p > q),
        CompareOp::Ge => go(a, b, out, |p, q| p >= q),
    }
}

/// A float operand as a loop side (a splat's value is already rounded to its dtype).
fn side(v: &Val) -> Option<Side<'_>> {
    match v {
        Val::Dense(t) => t.f32s().map(Side::Slice),
        Val::Splat(ty, x) if ty.dtype.is_float() => Some(Side::Scalar(*x as f32)),
        Val::Splat(..) => None,
    }
}

/// The result of an element-wise op (unary, binary, compare, select, cast) of type `out`.
pub(crate) fn eval(
    ctx: &Ctx,
    op: &Op,
    args: &[&Val],
    out: &TensorType,
) -> Result<Val, RuntimeError> {
    // On splats only, the result is a splat: computed once, by the reference kernel on
    // one-element operands.
    if args.iter().all(|a| matches!(a, Val::Splat(..))) {
        let scalars: Vec<Val> = args
            .iter()
            .map(|a| Val::Splat(TensorType::scalar(a.ty().dtype), splat_value(a)))
            .collect();
        let refs: Vec<&Val> = scalars.iter().collect();
        let mut r = reference_kernel(ctx, op, &refs)?;
        let t = match r.pop() {
            Some(Val::Dense(t)) => t,
            Some(v @ Val::Splat(..)) => return Ok(v),
            None => return Err(RuntimeError::NotAKernel { op: op.name() }),
        };
        let value = t.to_tensor()?.to_f64_vec().first().copied();
        return Ok(match value {
            Some(v) => Val::Splat(out.clone(), v),
            None => Val::Dense(ctx.dense(&Val::Splat(out.clone(), 0.0))),
        });
    }
    let n = out.num_elements() as usize;
    match op {
        Op::Unary { func } => match args[0] {
            Val::Dense(t) => match t.f32s() {
                Some(x) => {
                    let mut o = ctx.f32s(n);
                    unary_f32(ctx, *func, x, &mut o);
                    Ok(Val::Dense(ctx.float(out, o)))
                }
                None => reference_kernel(ctx, op, args).map(first),
            },
            Val::Splat(..) => reference_kernel(ctx, op, args).map(first),
        },
        Op::Binary { func } => match (side(args[0]), side(args[1])) {
            (Some(a), Some(b)) => {
                let mut o = ctx.f32s(n);
                binary_f32(ctx, *func, a, b, &mut o);
                Ok(Val::Dense(ctx.float(out, o)))
            }
            _ => int_binary(ctx, *func, args, out),
        },
        Op::Compare { func } => match (side(args[0]), side(args[1])) {
            (Some(a), Some(b)) => {
                let mut o = ctx.bools(n);
                compare_f32(*func, a, b, &mut o);
                Ok(Val::Dense(ctx.bool(out, o)))
            }
            _ => compare_other(ctx, *func, args, out),
        },
        Op::Select => select(ctx, args, out),
        Op::Cast { to } => cast(ctx, args[0], *to, out),
        _ => reference_kernel(ctx, op, args).map(first),
    }
}

/// The value of a splat (0 for a dense tensor, which callers never pass).
fn splat_value(v: &Val) -> f64 {
    match v {
        Val::Splat(_, x) => *x,
        Val::Dense(_) => 0.0,
    }
}

fn first(mut v: Vec<Val>) -> Val {
    v.swap_remove(0)
}

/// Comparisons of integers or booleans.
fn compare_other(
    ctx: &Ctx,
    func: CompareOp,
    args: &[&Val],
    out: &TensorType,
) -> Result<Val, RuntimeError> {
    fn go<T: PartialOrd>(func: CompareOp, a: &[T], b: &[T], o: &mut [bool]) {
        let f: fn(&T, &T) -> bool = match func {
            CompareOp::Eq => T::eq,
            CompareOp::Ne => T::ne,
            CompareOp::Lt => T::lt,
            CompareOp::Le => T::le,
            CompareOp::Gt => T::gt,
            CompareOp::Ge => T::ge,
        };
        for ((o, p), q) in o.iter_mut().zip(a).zip(b) {
            *o = f(p, q);
        }
    }
    let (a, b) = (ctx.dense(args[0]), ctx.dense(args[1]));
    let mut o = ctx.bools(out.num_elements() as usize);
    match (a.elems(), b.elems()) {
        (Elems::Int(x), Elems::Int(y)) => go(func, x, y, &mut o),
        (Elems::Bool(x), Elems::Bool(y)) => go(func, x, y, &mut o),
        _ => {
            return Err(RuntimeError::UnsupportedDType {
                op: func.name(),
                dtype: b.ty().dtype,
            });
        }
    }
    Ok(Val::Dense(ctx.bool(out, o)))
}

/// Integer binary ops (wrapping, truncating division), the rest through the reference.
fn int_binary(
    ctx: &Ctx,
    func: BinaryOp,
    args: &[&Val],
    out: &TensorType,
) -> Result<Val, RuntimeError> {
    let (a, b) = (ctx.dense(args[0]), ctx.dense(args[1]));
    let (Some(x), Some(y)) = (a.ints(), b.ints()) else {
        return Err(RuntimeError::UnsupportedDType {
            op: func.name(),
            dtype: b.ty().dtype,
        });
    };
    let f: fn(i64, i64) -> i64 = match func {
        BinaryOp::Add => i64::wrapping_add,
        BinaryOp::Sub => i64::wrapping_sub,
        BinaryOp::Mul => i64::wrapping_mul,
        BinaryOp::Max => i64::max,
        BinaryOp::Min => i64::min,
        BinaryOp::Div => {
            if y.contains(&0) {
                return Err(RuntimeError::DivisionByZero { op: func.name() });
            }
            i64::wrapping_div
        }
        BinaryOp::Pow => {
            return Err(RuntimeError::UnsupportedDType {
                op: func.name(),
                dtype: a.ty().dtype,
            });
        }
    };
    let mut o = ctx.ints(x.len());
    for ((o, &p), &q) in o.iter_mut().zip(x).zip(y) {
        *o = f(p, q);
    }
    Ok(Val::Dense(ctx.int(out, o)))
}

/// `if c { p } else { q }`, chosen on the bits: loops over it vectorise to blends, where a
/// branch, or a select between the two elements' addresses, compiles to gathers.
#[inline(always)]
pub(crate) fn blend(c: bool, p: f32, q: f32) -> f32 {
    let m = 0u32.wrapping_sub(u32::from(c));
    f32::from_bits((p.to_bits() & m) | (q.to_bits() & !m))
}

/// `cond ? a : b` element-wise.
fn select(ctx: &Ctx, args: &[&Val], out: &TensorType) -> Result<Val, RuntimeError> {
    let n = out.num_elements() as usize;
    let cond = ctx.dense(args[0]);
    let c = cond.bools().ok_or(RuntimeError::UnsupportedDType {
        op: "select",
        dtype: cond.ty().dtype,
    })?;
    if let (Some(a), Some(b)) = (side(args[1]), side(args[2])) {
        let mut o = ctx.f32s(n);
        let pick = |i: usize, s: Side| match s {
            Side::Slice(v) => v[i],
            Side::Scalar(x) => x,
        };
        match (a, b) {
            (Side::Slice(a), Side::Slice(b)) => {
                vectorized(
                    #[inline(always)]
                    || {
                        for (((o, &c), &p), &q) in o.iter_mut().zip(c).zip(a).zip(b) {
                            *o = blend(c, p, q);
                        }
                    },
                );
            }
            _ => {
                for (i, (o, &c)) in o.iter_mut().zip(c).enumerate() {
                    *o = blend(c, pick(i, a), pick(i, b));
                }
            }
        }
        return Ok(Val::Dense(ctx.float(out, o)));
    }
    reference_kernel(ctx, &Op::Select, args).map(first)
}

/// Casts: float to float rounds to the new dtype, float to integer truncates toward zero
/// (saturating; NaN gives 0), to bool is `x != 0`, as the reference does.
fn cast(ctx: &Ctx, x: &Val, to: DType, out: &TensorType) -> Result<Val, RuntimeError> {
    let n = out.num_elements() as usize;
    let Val::Dense(t) = x else {
        return reference_kernel(ctx, &Op::Cast { to }, &[x]).map(first);
    };
    Ok(Val::Dense(match (t.f32s(), t.ints(), to) {
        (Some(v), _, DType::F32 | DType::BF16 | DType::F16) => {
            if t.ty().dtype == to || to == DType::F32 {
                // Widening (or no change) is exact: share the storage.
                return Ok(Val::Dense(t.reshaped(out.clone())));
            }
            let mut o = ctx.f32s(n);
            o.copy_from_slice(v);
            ctx.float(out, o)
        }
        (Some(v), _, DType::I32 | DType::I64) => {
            let mut o = ctx.ints(n);
            for (o, &a) in o.iter_mut().zip(v) {
                *o = if to == DType::I32 {
                    i64::from(a as i32)
                } else {
                    a as i64
                };
            }
            ctx.int(out, o)
        }
        (Some(v), _, DType::Bool) => {
            let mut o = ctx.bools(n);
            for (o, &a) in o.iter_mut().zip(v) {
                *o = a != 0.0;
            }
            ctx.bool(out, o)
        }
        (None, None, DType::F32 | DType::BF16 | DType::F16) => {
            let mut o = ctx.f32s(n);
            for (o, &b) in o.iter_mut().zip(t.bools().unwrap_or_default()) {
                *o = f32::from(u8::from(b));
            }
            ctx.float(out, o)
        }
        (None, Some(v), DType::F32 | DType::BF16 | DType::F16) => {
            let mut o = ctx.f32s(n);
            for (o, &a) in o.iter_mut().zip(v) {
                *o = round_to_dtype(a as f64, to) as f32;
            }
            ctx.float(out, o)
        }
        _ => return reference_kernel(ctx, &Op::Cast { to }, &[x]).map(first),
    }))
}

/// `x` as a dense tensor of floats, if it is one.
pub(crate) fn floats<'a>(op: &'static str, t: &'a FastTensor) -> Result<&'a [f32], RuntimeError> {
    t.f32s().ok_or(RuntimeError::UnsupportedDType {
        op,
        dtype: t.ty().dtype,
    })
}

/// `x` as a dense tensor of integers, if it is one.
pub(crate) fn ints<'a>(op: &'static str, t: &'a FastTensor) -> Result<&'a [i64], RuntimeError> {
    t.ints().ok_or(RuntimeError::UnsupportedDType {
        op,
        dtype: t.ty().dtype,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulps_of_the_rounded_value() {
        let mut worst = 0;
        for i in 0..200_001 {
            let x = -86.0 + 174.5 * i as f32 / 200_000.0;
            let want = (x as f64).exp() as f32;
            let got = exp_f32(x);
            worst = worst.max(ulps(got, want));
        }
        assert!(worst <= 2, "exp_f32 is {worst} ulps from the rounded value");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-87.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    /// The vectorised loop (fused multiply-adds as instructions) and a plain call (the C
    /// library's `fmaf`) give the same bits: both round each multiply-add once.
    #[test]
    fn exp_and_the_functions_built_on_it_give_the_same_bits_vectorised() {
        let x: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.731).sin() * 12.0).collect();
        for f in [exp_f32, tanh_f32, gelu, gelu_grad, sigmoid] {
            let plain: Vec<u32> = x.iter().map(|&a| f(a).to_bits()).collect();
            let mut out = vec![0.0f32; x.len()];
            apply1(&x, &mut out, &f);
            let fast: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            assert_eq!(plain, fast);
        }
    }
}
