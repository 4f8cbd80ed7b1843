//! Tensors as safetensors bytes: each of the IR's dtypes in its own little-endian width
//! (`bool` as one byte), and back, with every size checked before anything is allocated.

use autopar_ir::{DType, TensorType};
use autopar_runtime::{Data, Tensor};
use half::{bf16, f16};
use safetensors::Dtype;

/// The safetensors dtype that stores `dtype`.
pub(crate) fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::Bool => Dtype::BOOL,
    }
}

/// The little-endian bytes of `t`'s elements in its own dtype.
pub(crate) fn to_bytes(t: &Tensor) -> Vec<u8> {
    let dtype = t.dtype();
    let mut out = Vec::with_capacity(t.len() * dtype.size_bytes());
    match t.data() {
        Data::Float(v) => {
            for &x in v {
                match dtype {
                    DType::F16 => out.extend(f16::from_f64(x).to_le_bytes()),
                    DType::BF16 => out.extend(bf16::from_f64(x).to_le_bytes()),
                    _ => out.extend((x as f32).to_le_bytes()),
                }
            }
        }
        Data::Int(v) => {
            for &x in v {
                match dtype {
                    DType::I64 => out.extend(x.to_le_bytes()),
                    // I32 tensors hold values in range (the runtime wraps them).
                    _ => out.extend((x as i32).to_le_bytes()),
                }
            }
        }
        Data::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
    }
    out
}

/// The tensor of type `ty` whose elements are `bytes`, stored as `stored`: the stored dtype
/// must be `ty`'s own, except that a float tensor may be read from any float width (a
/// bf16 or f64 file into an f32 model) and an integer one from either integer width (whose
/// values must fit). The error says what does not fit.
pub(crate) fn from_bytes(ty: &TensorType, stored: Dtype, bytes: &[u8]) -> Result<Tensor, String> {
    let n = ty.num_elements() as usize;
    let width = match stored {
        Dtype::F64 | Dtype::I64 => 8,
        Dtype::F32 | Dtype::I32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        Dtype::BOOL => 1,
        other => return Err(format!("stores {other:?}, which autopar has no dtype for")),
    };
    if Some(bytes.len()) != n.checked_mul(width) {
        return Err(format!(
            "holds {} bytes, not the {n} elements of {ty} as {stored:?}",
            bytes.len()
        ));
    }
    let float_ok =
        ty.dtype.is_float() && matches!(stored, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16);
    let int_ok = ty.dtype.is_int() && matches!(stored, Dtype::I64 | Dtype::I32);
    if !float_ok && !int_ok && stored != st_dtype(ty.dtype) {
        return Err(format!(
            "stores {stored:?} but the model's tensor is {}",
            ty.dtype
        ));
    }
    let data = match stored {
        Dtype::F64 => Data::Float(chunks(bytes, |b: [u8; 8]| f64::from_le_bytes(b))),
        Dtype::F32 => Data::Float(chunks(bytes, |b: [u8; 4]| f64::from(f32::from_le_bytes(b)))),
        Dtype::F16 => Data::Float(chunks(bytes, |b: [u8; 2]| f16::from_le_bytes(b).to_f64())),
        Dtype::BF16 => Data::Float(chunks(bytes, |b: [u8; 2]| bf16::from_le_bytes(b).to_f64())),
        Dtype::I64 => Data::Int(chunks(bytes, i64::from_le_bytes)),
        Dtype::I32 => Data::Int(chunks(bytes, |b: [u8; 4]| i64::from(i32::from_le_bytes(b)))),
        _ => Data::Bool(bytes.iter().map(|&b| b != 0).collect()),
    };
    if ty.dtype == DType::I32
        && let Data::Int(v) = &data
        && let Some(x) = v.iter().find(|&&x| i32::try_from(x).is_err())
    {
        return Err(format!("holds {x}, which does not fit the model's i32"));
    }
    let t = Tensor::new(ty.clone(), data).map_err(|e| e.to_string())?;
    // A wider file rounds to the model's dtype, as every value the runtime holds is.
    Ok(t.rounded())
}

fn chunks<const W: usize, T>(bytes: &[u8], f: impl Fn([u8; W]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(W)
        .map(|c| {
            let mut b = [0u8; W];
            b.copy_from_slice(c);
            f(b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_its_bytes() -> Result<(), String> {
        for dtype in DType::ALL {
            let ty = TensorType::new(dtype, [3]);
            let t = match dtype {
                DType::Bool => Tensor::from_bool([3], vec![true, false, true]),
                d if d.is_float() => Tensor::from_f64(ty.clone(), vec![1.5, -0.25, 3.0]),
                _ => Tensor::from_i64(ty.clone(), vec![-7, 0, 1 << 20]),
            }
            .map_err(|e| e.to_string())?;
            let bytes = to_bytes(&t);
            assert_eq!(bytes.len(), 3 * dtype.size_bytes(), "{dtype}");
            assert_eq!(from_bytes(&ty, st_dtype(dtype), &bytes)?, t, "{dtype}");
        }
        Ok(())
    }

    #[test]
    fn a_wrong_size_or_kind_is_refused() {
        let ty = TensorType::new(DType::F32, [2]);
        assert!(from_bytes(&ty, Dtype::F32, &[0; 7]).is_err());
        assert!(from_bytes(&ty, Dtype::I32, &[0; 8]).is_err());
        // Floats of another width are read and rounded.
        let bf = [
            bf16::from_f64(1.0).to_le_bytes(),
            bf16::from_f64(2.0).to_le_bytes(),
        ]
        .concat();
        assert_eq!(
            from_bytes(&ty, Dtype::BF16, &bf).map(|t| t.to_f64_vec()),
            Ok(vec![1.0, 2.0])
        );
    }
}
