//! Host tensors: the values the importer knows before anything runs (initializers,
//! `Constant` nodes, shapes and everything folded from them), decoded from `TensorProto`s
//! with every size checked against the bytes that are there.

use std::path::Path;

use autopar_ir::DType;

use super::proto::TensorProto;
use super::proto::tensor_proto::{DataLocation, DataType};

/// The most elements a folded (host-computed) tensor may have: constant computations in
/// exported models are shapes, masks and tables, far below this.
pub(crate) const MAX_FOLDED_ELEMENTS: usize = 1 << 24;

/// A tensor whose values are known: floats as `f64`, integers and booleans as `i64`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HostTensor {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub data: HostData,
}

/// The values of a [`HostTensor`], row-major.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum HostData {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

impl HostData {
    pub fn len(&self) -> usize {
        match self {
            HostData::Float(v) => v.len(),
            HostData::Int(v) => v.len(),
        }
    }

    /// Element `i` as `f64`.
    pub fn f64(&self, i: usize) -> f64 {
        match self {
            HostData::Float(v) => v[i],
            HostData::Int(v) => v[i] as f64,
        }
    }
}

impl HostTensor {
    pub fn ints(dims: Vec<usize>, values: Vec<i64>) -> Self {
        HostTensor {
            dtype: DType::I64,
            dims,
            data: HostData::Int(values),
        }
    }

    pub fn num_elements(&self) -> usize {
        self.data.len()
    }

    /// The values as integers (floats truncated), e.g. a shape or axes operand.
    pub fn as_i64s(&self) -> Vec<i64> {
        match &self.data {
            HostData::Int(v) => v.clone(),
            HostData::Float(v) => v.iter().map(|&x| x as i64).collect(),
        }
    }

    /// The single value of a tensor with one element.
    pub fn scalar(&self) -> Option<f64> {
        (self.num_elements() == 1).then(|| self.data.f64(0))
    }

    /// The value every element has, if they all have one (`None` for an empty tensor).
    pub fn uniform(&self) -> Option<f64> {
        let first = (self.num_elements() > 0).then(|| self.data.f64(0))?;
        let same = |x: f64| x == first || (x.is_nan() && first.is_nan());
        (0..self.num_elements())
            .all(|i| same(self.data.f64(i)))
            .then_some(first)
    }
}

/// The IR dtype of an ONNX element type, if the importer handles it.
pub(crate) fn dtype_of(elem_type: i32) -> Option<DType> {
    match DataType::try_from(elem_type).ok()? {
        DataType::Float | DataType::Double => Some(DType::F32),
        DataType::Float16 => Some(DType::F16),
        DataType::Bfloat16 => Some(DType::BF16),
        DataType::Int32 | DataType::Int8 | DataType::Uint8 | DataType::Int16 => Some(DType::I32),
        DataType::Int64 => Some(DType::I64),
        DataType::Bool => Some(DType::Bool),
        _ => None,
    }
}

/// The number of elements of `dims`, `None` when a dim is negative or the product overflows.
pub(crate) fn element_count(dims: &[i64]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
    })
}

/// Decodes a `TensorProto` (an initializer or a `Constant`'s value). External data is read
/// from `data_dir`; every length is checked before the values are allocated.
pub(crate) fn decode(t: &TensorProto, data_dir: Option<&Path>) -> Result<HostTensor, String> {
    let elem = t.data_type.unwrap_or(0);
    let kind = DataType::try_from(elem).map_err(|_| format!("unknown element type {elem}"))?;
    let dtype = dtype_of(elem).ok_or_else(|| format!("element type {kind:?} is not supported"))?;
    let n = element_count(&t.dims).ok_or_else(|| format!("invalid dims {:?}", t.dims))?;
    let dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    let width = match kind {
        DataType::Double | DataType::Int64 => 8,
        DataType::Float | DataType::Int32 => 4,
        DataType::Float16 | DataType::Bfloat16 | DataType::Int16 => 2,
        _ => 1,
    };
    let external = t.data_location == Some(DataLocation::External as i32);
    let raw: Option<Vec<u8>> = if external {
        Some(read_external(t, data_dir, n.checked_mul(width))?)
    } else {
        t.raw_data.clone()
    };
    let data = if let Some(raw) = raw {
        if Some(raw.len()) != n.checked_mul(width) {
            return Err(format!(
                "{} bytes of data for {n} elements of {kind:?}",
                raw.len()
            ));
        }
        from_raw(kind, &raw)
    } else {
        let have = match kind {
            DataType::Float => t.float_data.len(),
            DataType::Double => t.double_data.len(),
            DataType::Int64 => t.int64_data.len(),
            _ => t.int32_data.len(),
        };
        if have != n {
            return Err(format!("{have} values for {n} elements"));
        }
        match kind {
            DataType::Float => {
                HostData::Float(t.float_data.iter().map(|&x| f64::from(x)).collect())
            }
            DataType::Double => HostData::Float(t.double_data.clone()),
            DataType::Int64 => HostData::Int(t.int64_data.clone()),
            // Half floats are stored as their bits in `int32_data`.
            DataType::Float16 => {
                HostData::Float(t.int32_data.iter().map(|&b| f16_to_f64(b as u16)).collect())
            }
            DataType::Bfloat16 => HostData::Float(
                t.int32_data
                    .iter()
                    .map(|&b| f64::from(f32::from_bits(u32::from(b as u16) << 16)))
                    .collect(),
            ),
            _ => HostData::Int(t.int32_data.iter().map(|&x| i64::from(x)).collect()),
        }
    };
    Ok(HostTensor { dtype, dims, data })
}

fn from_raw(kind: DataType, raw: &[u8]) -> HostData {
    let chunks = |w: usize| raw.chunks_exact(w);
    match kind {
        DataType::Float => HostData::Float(
            chunks(4)
                .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        ),
        DataType::Double => HostData::Float(
            chunks(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ),
        DataType::Float16 => HostData::Float(
            chunks(2)
                .map(|c| f16_to_f64(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        DataType::Bfloat16 => HostData::Float(
            chunks(2)
                .map(|c| {
                    f64::from(f32::from_bits(
                        u32::from(u16::from_le_bytes([c[0], c[1]])) << 16,
                    ))
                })
                .collect(),
        ),
        DataType::Int64 => HostData::Int(
            chunks(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ),
        DataType::Int32 => HostData::Int(
            chunks(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        ),
        DataType::Int16 => HostData::Int(
            chunks(2)
                .map(|c| i64::from(i16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        DataType::Int8 => HostData::Int(raw.iter().map(|&b| i64::from(b as i8)).collect()),
        _ => HostData::Int(raw.iter().map(|&b| i64::from(b)).collect()),
    }
}

/// IEEE half precision bits to `f64`.
fn f16_to_f64(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((bits >> 10) & 0x1f);
    let frac = f64::from(bits & 0x3ff);
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 if frac == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}

/// The bytes of an external-data tensor: `location` (relative to `data_dir`, never outside
/// it), `offset` and `length`, checked against the file's size before reading.
fn read_external(
    t: &TensorProto,
    data_dir: Option<&Path>,
    expected: Option<usize>,
) -> Result<Vec<u8>, String> {
    let entry = |key: &str| {
        t.external_data
            .iter()
            .find(|e| e.key.as_deref() == Some(key))
            .and_then(|e| e.value.clone())
    };
    let location = entry("location").ok_or("external data without a `location`")?;
    let number = |key: &str| -> Result<Option<u64>, String> {
        entry(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| format!("external data `{key}` is `{v}`"))
            })
            .transpose()
    };
    let offset = number("offset")?.unwrap_or(0);
    let dir = data_dir.ok_or("external data, but the model was not read from a file")?;
    let rel = Path::new(&location);
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(format!(
            "external data location `{location}` is outside the model's folder"
        ));
    }
    let path = dir.join(rel);
    let size = std::fs::metadata(&path)
        .map_err(|e| format!("external data `{}`: {e}", path.display()))?
        .len();
    let expected = expected.ok_or("the tensor is too large")? as u64;
    let length = number("length")?.unwrap_or(expected);
    if length != expected {
        return Err(format!(
            "external data length {length} for {expected} bytes of values"
        ));
    }
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(format!(
            "external data `{}` has {size} bytes; the tensor needs bytes {offset}..{}",
            path.display(),
            offset.saturating_add(length)
        ));
    }
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.seek(SeekFrom::Start(offset))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut buf = vec![0u8; length as usize];
    f.read_exact(&mut buf)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(buf)
}
