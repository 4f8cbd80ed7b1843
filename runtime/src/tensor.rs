//! Host tensors: a [`TensorType`] and its elements, floats held as `f64` and rounded to the
//! declared dtype, integers as `i64`, booleans as `bool`.
//!
//! Holding every float as `f64` lets kernels accumulate in wide precision while results keep
//! exact f32/f16/bf16 semantics: [`round_to_dtype`] rounds to nearest, ties to even.

use autopar_ir::{DType, Shape, TensorType};

use crate::error::RuntimeError;

/// Largest finite binary16 value.
const F16_MAX: f64 = 65504.0;
/// Largest finite bfloat16 value, `(2 - 2^-7) * 2^127`.
const BF16_MAX: f64 = 3.389_531_389_251_535_5e38;

/// Rounds `x` to the nearest value of a float `dtype` (ties to even), keeping it as `f64`.
/// Values beyond the largest finite one become infinities; NaN stays NaN. Non-float dtypes
/// return `x` unchanged.
pub fn round_to_dtype(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::F16 => round_to_binary(x, 11, -14, F16_MAX),
        DType::BF16 => round_to_binary(x, 8, -126, BF16_MAX),
        DType::I32 | DType::I64 | DType::Bool => x,
    }
}

/// Correct rounding of an `f64` to a binary format with `precision` significand bits
/// (counting the implicit one), smallest normal exponent `min_exp` and largest finite value
/// `max_finite`. Dividing by a power of two is exact, so one `round_ties_even` does it;
/// going through `f32` first would round twice.
fn round_to_binary(x: f64, precision: i32, min_exp: i32, max_finite: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let biased = ((x.to_bits() >> 52) & 0x7ff) as i32;
    // f64 subnormals are far below every format's range; their exponent only needs to be small.
    let exp = (biased - 1023).max(min_exp);
    let ulp = 2f64.powi(exp - (precision - 1));
    let r = (x / ulp).round_ties_even() * ulp;
    if r.abs() > max_finite {
        f64::INFINITY.copysign(x)
    } else {
        r
    }
}

/// Controls whether float results are rounded to their declared dtypes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Round every float result to its declared dtype (f32, f16, bf16): the semantics of the
    /// program as declared.
    #[default]
    Declared,
    /// Keep every float in `f64`, ignoring declared float dtypes (for finite-difference
    /// gradient checks and error analysis).
    F64,
}

/// The elements of a tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// Elements of a float dtype.
    Float(Vec<f64>),
    /// Elements of an integer dtype.
    Int(Vec<i64>),
    /// Elements of `bool`.
    Bool(Vec<bool>),
}

impl Data {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::Float(v) => v.len(),
            Data::Int(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn kind_name(&self) -> &'static str {
        match self {
            Data::Float(_) => "float",
            Data::Int(_) => "integer",
            Data::Bool(_) => "bool",
        }
    }
}

/// Applies the same generic expression to whichever storage a [`Data`] holds, giving a
/// [`Data`] of the same kind. Used by kernels that move elements without looking at them.
macro_rules! map_data {
    ($data:expr, |$v:ident| $body:expr) => {
        match $data {
            $crate::tensor::Data::Float($v) => $crate::tensor::Data::Float($body),
            $crate::tensor::Data::Int($v) => $crate::tensor::Data::Int($body),
            $crate::tensor::Data::Bool($v) => $crate::tensor::Data::Bool($body),
        }
    };
}
pub(crate) use map_data;

/// A tensor on the host: its type and elements. The storage always matches the dtype (floats
/// in [`Data::Float`], integers in [`Data::Int`], `bool` in [`Data::Bool`]) and holds exactly
/// `ty.num_elements()` elements.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    ty: TensorType,
    data: Data,
}

impl Tensor {
    /// A tensor from its type and elements, checking that they fit. Float elements are kept
    /// exactly as given (see [`Tensor::rounded`]); `i32` elements must lie in its range.
    pub fn new(ty: TensorType, data: Data) -> Result<Tensor, RuntimeError> {
        let bad = |detail: String| RuntimeError::BadTensor {
            ty: ty.clone(),
            detail,
        };
        let kind_ok = match &data {
            Data::Float(_) => ty.dtype.is_float(),
            Data::Int(_) => ty.dtype.is_int(),
            Data::Bool(_) => ty.dtype == DType::Bool,
        };
        if !kind_ok {
            return Err(bad(format!(
                "{} elements cannot hold dtype {}",
                data.kind_name(),
                ty.dtype
            )));
        }
        if data.len() as u64 != ty.num_elements() {
            return Err(bad(format!(
                "{} elements given, {} expected",
                data.len(),
                ty.num_elements()
            )));
        }
        if let (DType::I32, Data::Int(v)) = (ty.dtype, &data)
            && let Some(x) = v.iter().find(|&&x| i32::try_from(x).is_err())
        {
            return Err(bad(format!("{x} does not fit in i32")));
        }
        Ok(Tensor { ty, data })
    }

    /// A float tensor whose elements are rounded to its dtype.
    pub fn from_f64(ty: TensorType, values: Vec<f64>) -> Result<Tensor, RuntimeError> {
        Ok(Tensor::new(ty, Data::Float(values))?.rounded())
    }

    /// An integer tensor.
    pub fn from_i64(ty: TensorType, values: Vec<i64>) -> Result<Tensor, RuntimeError> {
        Tensor::new(ty, Data::Int(values))
    }

    /// A `bool` tensor of the given shape.
    pub fn from_bool(shape: impl Into<Shape>, values: Vec<bool>) -> Result<Tensor, RuntimeError> {
        Tensor::new(TensorType::new(DType::Bool, shape), Data::Bool(values))
    }

    /// A tensor with every element equal to `value`: rounded for floats, truncated toward
    /// zero (and saturated) for integers, `value != 0` for `bool`.
    pub fn full(ty: TensorType, value: f64) -> Tensor {
        let n = ty.num_elements() as usize;
        let data = match ty.dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                Data::Float(vec![round_to_dtype(value, ty.dtype); n])
            }
            DType::I32 => Data::Int(vec![value as i32 as i64; n]),
            DType::I64 => Data::Int(vec![value as i64; n]),
            DType::Bool => Data::Bool(vec![value != 0.0; n]),
        };
        Tensor { ty, data }
    }

    /// A tensor of zeros (`false` for `bool`).
    pub fn zeros(ty: TensorType) -> Tensor {
        Tensor::full(ty, 0.0)
    }

    /// A rank-0 tensor.
    pub fn scalar(dtype: DType, value: f64) -> Tensor {
        Tensor::full(TensorType::scalar(dtype), value)
    }

    /// Builds a tensor from parts already known to fit (kernels' results); integer elements of
    /// an `i32` tensor are wrapped into its range, as two's-complement hardware would.
    pub(crate) fn from_parts(ty: TensorType, mut data: Data) -> Tensor {
        debug_assert_eq!(data.len() as u64, ty.num_elements(), "{ty}");
        if let (DType::I32, Data::Int(v)) = (ty.dtype, &mut data) {
            for x in v {
                *x = *x as i32 as i64;
            }
        }
        Tensor { ty, data }
    }

    /// The same elements under another type of the same element count and storage kind.
    pub(crate) fn retyped(self, ty: TensorType) -> Tensor {
        Tensor::from_parts(ty, self.data)
    }

    /// The tensor's type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.ty.dims()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Size in bytes at the declared dtype (not of the `f64` storage).
    pub fn size_bytes(&self) -> u64 {
        self.ty.size_bytes()
    }

    /// The elements.
    pub fn data(&self) -> &Data {
        &self.data
    }

    /// Consumes the tensor, giving its elements.
    pub fn into_data(self) -> Data {
        self.data
    }

    /// The elements of a float tensor.
    pub fn floats(&self) -> Option<&[f64]> {
        match &self.data {
            Data::Float(v) => Some(v),
            Data::Int(_) | Data::Bool(_) => None,
        }
    }

    /// The elements of an integer tensor.
    pub fn ints(&self) -> Option<&[i64]> {
        match &self.data {
            Data::Int(v) => Some(v),
            Data::Float(_) | Data::Bool(_) => None,
        }
    }

    /// The elements of a `bool` tensor.
    pub fn bools(&self) -> Option<&[bool]> {
        match &self.data {
            Data::Bool(v) => Some(v),
            Data::Float(_) | Data::Int(_) => None,
        }
    }

    /// Every element as `f64` (integers converted, `bool` as 0 or 1).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::Float(v) => v.clone(),
            Data::Int(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&b| f64::from(u8::from(b))).collect(),
        }
    }

    /// The value of a one-element tensor as `f64`.
    pub fn scalar_value(&self) -> Option<f64> {
        match &self.data {
            Data::Float(v) if v.len() == 1 => Some(v[0]),
            Data::Int(v) if v.len() == 1 => Some(v[0] as f64),
            Data::Bool(v) if v.len() == 1 => Some(f64::from(u8::from(v[0]))),
            Data::Float(_) | Data::Int(_) | Data::Bool(_) => None,
        }
    }

    /// The tensor with its float elements rounded to the declared dtype.
    pub fn rounded(mut self) -> Tensor {
        let dtype = self.ty.dtype;
        match (&mut self.data, dtype) {
            // The common case, kept free of per-element dispatch.
            (Data::Float(v), DType::F32) => {
                for x in v {
                    *x = *x as f32 as f64;
                }
            }
            (Data::Float(v), _) => {
                for x in v {
                    *x = round_to_dtype(*x, dtype);
                }
            }
            (Data::Int(_) | Data::Bool(_), _) => {}
        }
        self
    }

    /// Largest absolute element-wise difference to `other`, or `None` when the types differ.
    /// NaN in the same place on both sides counts as equal; elsewhere it gives NaN.
    pub fn max_abs_diff(&self, other: &Tensor) -> Option<f64> {
        if self.ty != other.ty {
            return None;
        }
        let (a, b) = (self.to_f64_vec(), other.to_f64_vec());
        Some(a.iter().zip(&b).fold(0.0f64, |acc, (&x, &y)| {
            if x.is_nan() && y.is_nan() || x == y {
                acc
            } else {
                let d = (x - y).abs();
                if d.is_nan() { f64::NAN } else { acc.max(d) }
            }
        }))
    }

    /// True when the types match and every pair of elements satisfies
    /// `|a - b| <= atol + rtol * |b|` (NaNs must coincide).
    pub fn all_close(&self, other: &Tensor, rtol: f64, atol: f64) -> bool {
        if self.ty != other.ty {
            return false;
        }
        let (a, b) = (self.to_f64_vec(), other.to_f64_vec());
        a.iter().zip(&b).all(|(&x, &y)| {
            x == y || (x.is_nan() && y.is_nan()) || (x - y).abs() <= atol + rtol * y.abs()
        })
    }
}

/// Row-major strides (in elements) of a shape.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn rounding_edge_cases() {
        assert_eq!(round_to_dtype(65504.0, DType::F16), 65504.0);
        assert_eq!(round_to_dtype(65519.9, DType::F16), 65504.0);
        assert_eq!(round_to_dtype(65520.0, DType::F16), f64::INFINITY);
        assert_eq!(round_to_dtype(-1e6, DType::F16), f64::NEG_INFINITY);
        // Smallest f16 subnormal, and a value halfway below it (ties to even: 0).
        assert_eq!(round_to_dtype(2f64.powi(-24), DType::F16), 2f64.powi(-24));
        assert_eq!(round_to_dtype(2f64.powi(-25), DType::F16), 0.0);
        // 1 + 2^-8 is halfway between two bf16 values; ties go to the even one (1.0).
        assert_eq!(round_to_dtype(1.0 + 2f64.powi(-8), DType::BF16), 1.0);
        assert_eq!(
            round_to_dtype(1.0 + 3.0 * 2f64.powi(-8), DType::BF16),
            1.0 + 2f64.powi(-6)
        );
        // A value just above that tie: direct rounding goes up, rounding via f32 would not.
        let above_tie = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(round_to_dtype(above_tie, DType::BF16), 1.0 + 2f64.powi(-7));
        assert!(round_to_dtype(f64::NAN, DType::BF16).is_nan());
        assert_eq!(
            round_to_dtype(-0.0, DType::F16).to_bits(),
            (-0.0f64).to_bits()
        );
    }

    proptest! {
        #[test]
        fn rounding_agrees_with_half_on_f32_inputs(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite());
            let x64 = f64::from(x);
            prop_assert_eq!(round_to_dtype(x64, DType::BF16), bf16::from_f32(x).to_f64());
            prop_assert_eq!(round_to_dtype(x64, DType::F16), f16::from_f32(x).to_f64());
        }

        #[test]
        fn rounded_values_are_representable(x in -1e6f64..1e6) {
            let b = round_to_dtype(x, DType::BF16);
            prop_assert_eq!(bf16::from_f64(b).to_f64(), b);
            let h = round_to_dtype(x, DType::F16);
            prop_assert!(h.is_infinite() || f16::from_f64(h).to_f64() == h);
        }
    }

    #[test]
    fn constructors_check_their_data() {
        let ty = TensorType::new(DType::F32, [2]);
        assert!(Tensor::from_f64(ty.clone(), vec![1.0]).is_err());
        assert!(Tensor::from_i64(ty, vec![1, 2]).is_err());
        let i32_ty = TensorType::new(DType::I32, [1]);
        assert!(Tensor::from_i64(i32_ty.clone(), vec![1 << 40]).is_err());
        assert!(Tensor::from_i64(i32_ty, vec![-7]).is_ok());
        let t = Tensor::full(TensorType::new(DType::BF16, [3]), 0.1);
        assert_eq!(t.floats(), Some(&[bf16::from_f64(0.1).to_f64(); 3][..]));
        assert_eq!(t.size_bytes(), 6);
    }

    #[test]
    fn row_major_strides() {
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<usize>::new());
    }
}
