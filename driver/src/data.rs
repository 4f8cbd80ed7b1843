//! Training data from a file instead of the synthetic set: a safetensors file holding, for
//! every input of the step (`tokens`, `targets`, ...), a tensor of that name whose leading
//! dim stacks whole batches. Step `i` is fed batch `i` modulo their number, so a resumed
//! run continues where its checkpoint's data position says.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use autopar_ir::{Op, TensorType};
use autopar_runtime::{Tensor, TensorMap};
use safetensors::SafeTensors;

use crate::Error;
use crate::checkpoint::{checkpoint_error, slice};
use crate::compile::CompiledStep;

/// The batches of a data file, checked against a step's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct DataFile {
    /// The file.
    pub path: PathBuf,
    /// Every input's whole tensor, at the step's dtype.
    tensors: BTreeMap<String, Tensor>,
    /// Each input's batch shape.
    batch_types: BTreeMap<String, TensorType>,
    /// Batches in the file.
    pub batches: u64,
}

impl DataFile {
    /// Reads `path` for the inputs of `step`.
    pub fn open(path: &Path, step: &CompiledStep) -> Result<DataFile, Error> {
        let bad = |detail: String| checkpoint_error(path, detail);
        let bytes = std::fs::read(path).map_err(|error| Error::Io {
            path: path.display().to_string(),
            error,
        })?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("is not a safetensors file: {e}")))?;
        let mut tensors = BTreeMap::new();
        let mut batch_types = BTreeMap::new();
        let mut batches: Option<(u64, String)> = None;
        for (_, name, op) in step.global.inputs() {
            let Op::Input { ty, .. } = op else { continue };
            let view = st
                .tensor(name)
                .map_err(|_| bad(format!("has no tensor `{name}` for the step's input {ty}")))?;
            let shape = view.shape();
            let rows = ty.dims().first().copied().unwrap_or(1);
            let fits = shape.len() == ty.dims().len()
                && !shape.is_empty()
                && shape[1..] == ty.dims()[1..]
                && rows > 0
                && shape[0] % rows == 0
                && shape[0] > 0;
            if !fits {
                return Err(bad(format!(
                    "holds `{name}` as {shape:?}, which is not whole batches of the input's {ty}"
                )));
            }
            let k = (shape[0] / rows) as u64;
            match &batches {
                Some((n, other)) if *n != k => {
                    return Err(bad(format!(
                        "holds {k} batches of `{name}` but {n} of `{other}`"
                    )));
                }
                _ => batches = Some((k, name.to_string())),
            }
            let whole = TensorType::new(ty.dtype, shape.to_vec());
            let t = crate::checkpoint::decode(&whole, view.dtype(), view.data())
                .map_err(|e| bad(format!("`{name}` {e}")))?;
            tensors.insert(name.to_string(), t);
            batch_types.insert(name.to_string(), ty.clone());
        }
        let batches = batches
            .map(|(k, _)| k)
            .ok_or_else(|| bad("feeds a step without inputs".into()))?;
        Ok(DataFile {
            path: path.to_path_buf(),
            tensors,
            batch_types,
            batches,
        })
    }

    /// The batch of step `i` (0-based from the start of training).
    pub fn batch(&self, i: u64) -> Result<TensorMap, Error> {
        let k = (i % self.batches) as usize;
        let mut out = TensorMap::new();
        for (name, t) in &self.tensors {
            let ty = &self.batch_types[name];
            let rows = ty.dims()[0];
            let mut region: Vec<std::ops::Range<usize>> = t.dims().iter().map(|&d| 0..d).collect();
            region[0] = k * rows..(k + 1) * rows;
            out.insert(name.clone(), slice(t, &region)?);
        }
        Ok(out)
    }
}
