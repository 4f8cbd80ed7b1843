//! Element types, shapes and tensor types: the static type of every IR value.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The most elements a tensor may have (2^52, 4.5e15): far above any model's tensor, and
/// small enough that products of its dims and its size in bytes (at most 2^55) never
/// overflow. The graph's typing rule refuses larger results.
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 52;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Boolean (one byte per element in memory accounting).
    Bool,
}

impl DType {
    /// Every dtype, in a fixed order (used by tests and the parser's error messages).
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::Bool,
    ];

    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    /// True for the floating-point dtypes.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// True for the integer dtypes.
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// The name used in the text format (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }

    /// Inverse of [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dimensions of a tensor, outermost first. A scalar has rank 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// A shape from its dims.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The rank-0 shape.
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// The dims as a slice.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of elements, saturating at `u64::MAX` (full-size models never get near it).
    pub fn num_elements(&self) -> u64 {
        self.0
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Static type of an IR value: shape and dtype. Printed as `f32[8,32,64]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// The dims.
    pub shape: Shape,
    /// The element type.
    pub dtype: DType,
}

impl TensorType {
    /// A tensor type from a dtype and dims.
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType {
            shape: shape.into(),
            dtype,
        }
    }

    /// A scalar of the given dtype.
    pub fn scalar(dtype: DType) -> Self {
        TensorType::new(dtype, Shape::scalar())
    }

    /// Rank of the shape.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// Dims of the shape.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of elements.
    pub fn num_elements(&self) -> u64 {
        self.shape.num_elements()
    }

    /// Size in bytes, saturating.
    pub fn size_bytes(&self) -> u64 {
        self.num_elements()
            .saturating_mul(self.dtype.size_bytes() as u64)
    }

    /// The same shape with another dtype.
    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType {
            shape: self.shape.clone(),
            dtype,
        }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::from_name("f64"), None);
    }

    #[test]
    fn tensor_type_display_and_size() {
        let t = TensorType::new(DType::BF16, [8, 32, 64]);
        assert_eq!(t.to_string(), "bf16[8,32,64]");
        assert_eq!(t.size_bytes(), 8 * 32 * 64 * 2);
        assert_eq!(TensorType::scalar(DType::F32).to_string(), "f32[]");
    }
}
