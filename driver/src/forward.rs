//! One forward pass on one device, with everything it read and wrote: the values a check
//! against another runtime (ONNX Runtime on an imported model) needs.

use autopar_runtime::{self as rt, Data, RunOptions, TensorMap};

use crate::Error;
use crate::compile::CompiledStep;

/// The inputs fed and the outputs computed by one forward pass.
#[derive(Clone, Debug)]
pub struct ForwardValues {
    /// Every data input, as fed (the synthetic batch of `seed`, step 0).
    pub inputs: Vec<NamedTensor>,
    /// Every graph output.
    pub outputs: Vec<NamedTensor>,
}

/// A tensor by name, as plain data.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    /// The input or output name.
    pub name: String,
    /// Its dims.
    pub dims: Vec<usize>,
    /// Its values: floats, or integers (booleans as 0 and 1).
    pub values: TensorValues,
}

/// The values of a [`NamedTensor`], row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorValues {
    /// Float elements (at their dtype's precision).
    Float(Vec<f64>),
    /// Integer or boolean elements.
    Int(Vec<i64>),
}

/// Runs the single-device step of `step` (compiled with [`crate::CompileOptions::forward_only`]
/// and no mesh) once, with parameters initialised from `seed`, and returns what it read and
/// wrote.
pub fn run_forward(step: &CompiledStep, seed: u64) -> Result<ForwardValues, Error> {
    if step.is_training() || step.mesh.num_devices() != 1 {
        return Err(Error::Usage(
            "writing the outputs needs a forward pass on one device (--forward, no --mesh)".into(),
        ));
    }
    let g = &step.global;
    let params = rt::init_parameters(g, seed)?;
    let batch = rt::synthetic_batch(g, seed, 0)?;
    let out = rt::run(g, &params, &batch, RunOptions::default())?;
    let named = |map: &TensorMap| -> Vec<NamedTensor> {
        map.iter()
            .map(|(name, t)| NamedTensor {
                name: name.clone(),
                dims: t.dims().to_vec(),
                values: match t.data() {
                    Data::Float(v) => TensorValues::Float(v.clone()),
                    Data::Int(v) => TensorValues::Int(v.clone()),
                    Data::Bool(v) => TensorValues::Int(v.iter().map(|&b| i64::from(b)).collect()),
                },
            })
            .collect()
    };
    let outputs: TensorMap = out.outputs.into_iter().collect();
    Ok(ForwardValues {
        inputs: named(&batch),
        outputs: named(&outputs),
    })
}
