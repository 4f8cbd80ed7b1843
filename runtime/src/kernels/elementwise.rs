//! Element-wise kernels: unary functions, binary arithmetic, comparisons, select and casts.

use autopar_ir::{BinaryOp, CompareOp, DType, UnaryOp};

use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor};

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub(crate) fn gelu(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// The derivative of [`gelu`] (see `UnaryOp::GeluGrad`).
pub(crate) fn gelu_grad(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    const K: f64 = 0.044_715;
    let t = (SQRT_2_OVER_PI * (x + K * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * K * x * x)
}

/// Exact GELU, `x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))`.
pub(crate) fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

/// The logistic function, written so that neither branch overflows.
pub(crate) fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn unary_float(func: UnaryOp) -> fn(f64) -> f64 {
    match func {
        UnaryOp::Neg => |x| -x,
        UnaryOp::Abs => f64::abs,
        UnaryOp::Exp => f64::exp,
        UnaryOp::Log => f64::ln,
        UnaryOp::Sqrt => f64::sqrt,
        UnaryOp::Rsqrt => |x| 1.0 / x.sqrt(),
        UnaryOp::Recip => |x| 1.0 / x,
        UnaryOp::Square => |x| x * x,
        UnaryOp::Tanh => f64::tanh,
        UnaryOp::Sigmoid => sigmoid,
        // `x < 0` keeps NaN as NaN.
        UnaryOp::Relu => |x| if x < 0.0 { 0.0 } else { x },
        UnaryOp::Gelu => gelu,
        UnaryOp::GeluGrad => gelu_grad,
        UnaryOp::Silu => |x| x * sigmoid(x),
        UnaryOp::Erf => libm::erf,
        UnaryOp::GeluErf => gelu_erf,
        UnaryOp::Sin => f64::sin,
        UnaryOp::Cos => f64::cos,
    }
}

/// Integer versions wrap on overflow, as two's-complement hardware does.
fn unary_int(func: UnaryOp) -> Option<fn(i64) -> i64> {
    match func {
        UnaryOp::Neg => Some(i64::wrapping_neg),
        UnaryOp::Abs => Some(i64::wrapping_abs),
        UnaryOp::Square => Some(|x| x.wrapping_mul(x)),
        UnaryOp::Exp
        | UnaryOp::Log
        | UnaryOp::Sqrt
        | UnaryOp::Rsqrt
        | UnaryOp::Recip
        | UnaryOp::Tanh
        | UnaryOp::Sigmoid
        | UnaryOp::Relu
        | UnaryOp::Gelu
        | UnaryOp::GeluGrad
        | UnaryOp::Silu
        | UnaryOp::Erf
        | UnaryOp::GeluErf
        | UnaryOp::Sin
        | UnaryOp::Cos => None,
    }
}

pub(crate) fn unary(func: UnaryOp, x: &Tensor) -> Result<Tensor, RuntimeError> {
    let unsupported = RuntimeError::UnsupportedDType {
        op: func.name(),
        dtype: x.dtype(),
    };
    let data = match x.data() {
        Data::Float(v) => {
            let f = unary_float(func);
            Data::Float(v.iter().map(|&a| f(a)).collect())
        }
        Data::Int(v) => {
            let f = unary_int(func).ok_or(unsupported)?;
            Data::Int(v.iter().map(|&a| f(a)).collect())
        }
        Data::Bool(_) => return Err(unsupported),
    };
    Ok(Tensor::from_parts(x.ty().clone(), data))
}

fn binary_float(func: BinaryOp) -> fn(f64, f64) -> f64 {
    match func {
        BinaryOp::Add => |a, b| a + b,
        BinaryOp::Sub => |a, b| a - b,
        BinaryOp::Mul => |a, b| a * b,
        BinaryOp::Div => |a, b| a / b,
        // Unlike `f64::max`, a NaN operand gives NaN.
        BinaryOp::Max => |a, b| if a.is_nan() || a > b { a } else { b },
        BinaryOp::Min => |a, b| if a.is_nan() || a < b { a } else { b },
        BinaryOp::Pow => f64::powf,
    }
}

pub(crate) fn binary(func: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor, RuntimeError> {
    let op = func.name();
    let unsupported = RuntimeError::UnsupportedDType {
        op,
        dtype: a.dtype(),
    };
    let data = match (a.data(), b.data()) {
        (Data::Float(x), Data::Float(y)) => {
            let f = binary_float(func);
            Data::Float(x.iter().zip(y).map(|(&p, &q)| f(p, q)).collect())
        }
        (Data::Int(x), Data::Int(y)) => {
            let f: fn(i64, i64) -> i64 = match func {
                BinaryOp::Add => i64::wrapping_add,
                BinaryOp::Sub => i64::wrapping_sub,
                BinaryOp::Mul => i64::wrapping_mul,
                BinaryOp::Max => i64::max,
                BinaryOp::Min => i64::min,
                BinaryOp::Div => {
                    if y.contains(&0) {
                        return Err(RuntimeError::DivisionByZero { op });
                    }
                    // Truncating division; `MIN / -1` wraps.
                    i64::wrapping_div
                }
                BinaryOp::Pow => return Err(unsupported),
            };
            Data::Int(x.iter().zip(y).map(|(&p, &q)| f(p, q)).collect())
        }
        _ => return Err(unsupported),
    };
    Ok(Tensor::from_parts(a.ty().clone(), data))
}

fn compare_slices<T: PartialOrd>(func: CompareOp, a: &[T], b: &[T]) -> Vec<bool> {
    let f: fn(&T, &T) -> bool = match func {
        CompareOp::Eq => T::eq,
        CompareOp::Ne => T::ne,
        CompareOp::Lt => T::lt,
        CompareOp::Le => T::le,
        CompareOp::Gt => T::gt,
        CompareOp::Ge => T::ge,
    };
    a.iter().zip(b).map(|(p, q)| f(p, q)).collect()
}

pub(crate) fn compare(func: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor, RuntimeError> {
    let result = match (a.data(), b.data()) {
        (Data::Float(x), Data::Float(y)) => compare_slices(func, x, y),
        (Data::Int(x), Data::Int(y)) => compare_slices(func, x, y),
        (Data::Bool(x), Data::Bool(y)) => compare_slices(func, x, y),
        _ => {
            return Err(RuntimeError::UnsupportedDType {
                op: func.name(),
                dtype: b.dtype(),
            });
        }
    };
    Ok(Tensor::from_parts(
        a.ty().with_dtype(DType::Bool),
        Data::Bool(result),
    ))
}

fn select_slices<T: Copy>(cond: &[bool], a: &[T], b: &[T]) -> Vec<T> {
    cond.iter()
        .zip(a.iter().zip(b))
        .map(|(&c, (&p, &q))| if c { p } else { q })
        .collect()
}

pub(crate) fn select(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor, RuntimeError> {
    let unsupported = |t: &Tensor| RuntimeError::UnsupportedDType {
        op: "select",
        dtype: t.dtype(),
    };
    let c = cond.bools().ok_or_else(|| unsupported(cond))?;
    let data = match (a.data(), b.data()) {
        (Data::Float(x), Data::Float(y)) => Data::Float(select_slices(c, x, y)),
        (Data::Int(x), Data::Int(y)) => Data::Int(select_slices(c, x, y)),
        (Data::Bool(x), Data::Bool(y)) => Data::Bool(select_slices(c, x, y)),
        _ => return Err(unsupported(b)),
    };
    Ok(Tensor::from_parts(a.ty().clone(), data))
}

/// Float to integer truncates toward zero (saturating; NaN gives 0), integer to `i32` wraps,
/// anything to `bool` is `x != 0`, `bool` to a number is 0 or 1. Float to float is left to
/// the caller's rounding.
pub(crate) fn cast(x: &Tensor, to: DType) -> Tensor {
    let to_float = to.is_float();
    let data = match x.data() {
        Data::Float(v) => match to {
            DType::F32 | DType::F16 | DType::BF16 => Data::Float(v.clone()),
            DType::I32 => Data::Int(v.iter().map(|&a| i64::from(a as i32)).collect()),
            DType::I64 => Data::Int(v.iter().map(|&a| a as i64).collect()),
            DType::Bool => Data::Bool(v.iter().map(|&a| a != 0.0).collect()),
        },
        Data::Int(v) => match to {
            _ if to_float => Data::Float(v.iter().map(|&a| a as f64).collect()),
            DType::Bool => Data::Bool(v.iter().map(|&a| a != 0).collect()),
            // `from_parts` wraps into the range of i32.
            _ => Data::Int(v.clone()),
        },
        Data::Bool(v) => match to {
            _ if to_float => Data::Float(v.iter().map(|&a| f64::from(u8::from(a))).collect()),
            DType::Bool => Data::Bool(v.clone()),
            _ => Data::Int(v.iter().map(|&a| i64::from(a)).collect()),
        },
    };
    Tensor::from_parts(x.ty().with_dtype(to), data)
}
