//! The fast backend's tensors: f32, bf16 and f16 elements held as `f32` (every bf16 and f16
//! value is exact in f32), integers as `i64`, booleans as `bool`, in storage shared by
//! reference count so that reshapes and pass-through outputs copy nothing. Storage taken
//! from a [`Pool`] goes back to it when its last holder drops it.

use std::sync::{Arc, Weak};

use autopar_ir::{DType, TensorType};
use half::{bf16, f16};

use super::pool::Pool;
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor};

/// The elements of a fast tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Elems {
    /// Elements of f32, bf16 or f16 tensors.
    F32(Vec<f32>),
    /// Elements of i32 or i64 tensors (i32 values always lie in its range).
    Int(Vec<i64>),
    /// Elements of bool tensors.
    Bool(Vec<bool>),
}

impl Elems {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Elems::F32(v) => v.len(),
            Elems::Int(v) => v.len(),
            Elems::Bool(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of this storage (4 per float, 8 per integer, 1 per bool).
    pub fn bytes(&self) -> u64 {
        let (n, size) = match self {
            Elems::F32(v) => (v.len(), 4),
            Elems::Int(v) => (v.len(), 8),
            Elems::Bool(v) => (v.len(), 1),
        };
        n as u64 * size
    }
}

/// Bytes one element of `dtype` takes in the fast backend's storage.
pub fn storage_elem_bytes(dtype: DType) -> u64 {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => 4,
        DType::I32 | DType::I64 => 8,
        DType::Bool => 1,
    }
}

/// Bytes a tensor of type `ty` takes in the fast backend's storage.
pub fn storage_bytes(ty: &TensorType) -> u64 {
    ty.num_elements() * storage_elem_bytes(ty.dtype)
}

/// Elements with the pool they return to.
#[derive(Debug)]
pub(crate) struct Storage {
    pub(crate) elems: Elems,
    pool: Weak<Pool>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            let elems = std::mem::replace(&mut self.elems, Elems::Bool(Vec::new()));
            pool.give_back(elems);
        }
    }
}

/// A tensor of the fast backend: its type and shared storage. Cloning shares the storage.
#[derive(Clone, Debug)]
pub struct FastTensor {
    ty: TensorType,
    data: Arc<Storage>,
}

impl PartialEq for FastTensor {
    fn eq(&self, other: &Self) -> bool {
        self.ty == other.ty && self.data.elems == other.data.elems
    }
}

impl crate::error::Typed for FastTensor {
    fn ty(&self) -> &TensorType {
        FastTensor::ty(self)
    }
}

impl FastTensor {
    /// A tensor from elements that fit `ty` (checked: storage kind, count, i32 range).
    pub fn new(ty: TensorType, elems: Elems) -> Result<FastTensor, RuntimeError> {
        let bad = |detail: String| RuntimeError::BadTensor {
            ty: ty.clone(),
            detail,
        };
        let kind_ok = match &elems {
            Elems::F32(_) => ty.dtype.is_float(),
            Elems::Int(_) => ty.dtype.is_int(),
            Elems::Bool(_) => ty.dtype == DType::Bool,
        };
        if !kind_ok {
            return Err(bad(format!("storage cannot hold dtype {}", ty.dtype)));
        }
        if elems.len() as u64 != ty.num_elements() {
            return Err(bad(format!(
                "{} elements given, {} expected",
                elems.len(),
                ty.num_elements()
            )));
        }
        if let (DType::I32, Elems::Int(v)) = (ty.dtype, &elems)
            && let Some(x) = v.iter().find(|&&x| i32::try_from(x).is_err())
        {
            return Err(bad(format!("{x} does not fit in i32")));
        }
        Ok(FastTensor::from_parts(ty, elems, Weak::new()))
    }

    /// A tensor from parts known to fit, whose storage returns to `pool`.
    pub(crate) fn from_parts(ty: TensorType, elems: Elems, pool: Weak<Pool>) -> FastTensor {
        debug_assert_eq!(elems.len() as u64, ty.num_elements(), "{ty}");
        FastTensor {
            ty,
            data: Arc::new(Storage { elems, pool }),
        }
    }

    /// The same storage under another type of the same element count and storage kind.
    pub(crate) fn reshaped(&self, ty: TensorType) -> FastTensor {
        debug_assert_eq!(self.ty.num_elements(), ty.num_elements());
        FastTensor {
            ty,
            data: Arc::clone(&self.data),
        }
    }

    /// The tensor's type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// The elements.
    pub fn elems(&self) -> &Elems {
        &self.data.elems
    }

    /// The float elements, if a float tensor.
    pub fn f32s(&self) -> Option<&[f32]> {
        match &self.data.elems {
            Elems::F32(v) => Some(v),
            Elems::Int(_) | Elems::Bool(_) => None,
        }
    }

    /// The integer elements, if an integer tensor.
    pub fn ints(&self) -> Option<&[i64]> {
        match &self.data.elems {
            Elems::Int(v) => Some(v),
            Elems::F32(_) | Elems::Bool(_) => None,
        }
    }

    /// The bool elements, if a bool tensor.
    pub fn bools(&self) -> Option<&[bool]> {
        match &self.data.elems {
            Elems::Bool(v) => Some(v),
            Elems::F32(_) | Elems::Int(_) => None,
        }
    }

    /// Bytes of its storage.
    pub fn storage_bytes(&self) -> u64 {
        self.data.elems.bytes()
    }

    /// An identity of its storage, equal for tensors that share it.
    pub fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.data) as usize
    }

    /// True when `self` and `other` share storage.
    pub fn shares_storage(&self, other: &FastTensor) -> bool {
        Arc::ptr_eq(&self.data, &other.data)
    }

    /// Copies a reference tensor in (its float values are rounded to f32, which keeps values
    /// of f32, bf16 and f16 tensors exact).
    pub fn from_tensor(t: &Tensor) -> FastTensor {
        let elems = match t.data() {
            Data::Float(v) => Elems::F32(v.iter().map(|&x| x as f32).collect()),
            Data::Int(v) => Elems::Int(v.clone()),
            Data::Bool(v) => Elems::Bool(v.clone()),
        };
        FastTensor::from_parts(t.ty().clone(), elems, Weak::new())
    }

    /// The reference tensor of the same type and values.
    pub fn to_tensor(&self) -> Result<Tensor, RuntimeError> {
        let data = match &self.data.elems {
            Elems::F32(v) => Data::Float(v.iter().map(|&x| f64::from(x)).collect()),
            Elems::Int(v) => Data::Int(v.clone()),
            Elems::Bool(v) => Data::Bool(v.clone()),
        };
        Tensor::new(self.ty.clone(), data)
    }
}

/// Rounds every element of `v` to `dtype` (ties to even), in place: nothing for f32, the
/// nearest bf16 or f16 value otherwise (beyond the largest finite one: an infinity).
pub fn round_slice(dtype: DType, v: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for x in v {
                *x = bf16::from_f32(*x).to_f32();
            }
        }
        DType::F16 => {
            for x in v {
                *x = f16::from_f32(*x).to_f32();
            }
        }
        DType::F32 | DType::I32 | DType::I64 | DType::Bool => {}
    }
}

/// Rounds one value to `dtype`, as [`round_slice`] does.
pub fn round_one(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::F32 | DType::I32 | DType::I64 | DType::Bool => x,
    }
}

/// Wraps integers into the range of `dtype` (i32), as two's-complement hardware would.
pub fn wrap_ints(dtype: DType, v: &mut [i64]) {
    if dtype == DType::I32 {
        for x in v {
            *x = *x as i32 as i64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::round_to_dtype;

    #[test]
    fn rounding_matches_the_reference_on_f32_values() {
        let xs = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            65519.9,
            65520.0,
            -1e6,
            2f32.powi(-25),
            2f32.powi(-24),
            0.1,
            -0.0,
            3.4e38,
        ];
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for &x in &xs {
                let want = round_to_dtype(f64::from(x), dtype);
                let got = f64::from(round_one(dtype, x));
                assert_eq!(got.to_bits(), want.to_bits(), "{x} to {dtype}");
            }
        }
    }

    #[test]
    fn tensors_check_their_elements() {
        let ty = TensorType::new(DType::F32, [2]);
        assert!(FastTensor::new(ty.clone(), Elems::F32(vec![1.0])).is_err());
        assert!(FastTensor::new(ty, Elems::Int(vec![1, 2])).is_err());
        let i32_ty = TensorType::new(DType::I32, [1]);
        assert!(FastTensor::new(i32_ty, Elems::Int(vec![1 << 40])).is_err());
        let t = Tensor::full(TensorType::new(DType::BF16, [3]), 0.1);
        let back = FastTensor::from_tensor(&t).to_tensor().expect("fits");
        assert_eq!(back, t);
    }
}
