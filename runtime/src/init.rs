//! Deterministic parameter initialisation: element `i` of parameter `name` depends only on
//! the seed, the name and `i`, so the same weight gets the same values in any graph, in any
//! order, and a rank holding a shard can draw just its own elements.

use autopar_ir::{Graph, Init, Op, TensorType};

use crate::TensorMap;
use crate::error::RuntimeError;
use crate::rng::Stream;
use crate::tensor::{Data, Tensor};

/// Draws every parameter of `graph` following its [`Init`].
pub fn init_parameters(graph: &Graph, seed: u64) -> Result<TensorMap, RuntimeError> {
    let mut params = TensorMap::new();
    for n in graph.nodes_in_order() {
        if let Op::Parameter { name, ty, init } = &graph.node(n).op {
            params.insert(name.clone(), init_parameter(name, ty, *init, seed)?);
        }
    }
    Ok(params)
}

/// Draws one parameter. Normal draws need a float dtype; zeros and ones fit every dtype.
pub fn init_parameter(
    name: &str,
    ty: &TensorType,
    init: Init,
    seed: u64,
) -> Result<Tensor, RuntimeError> {
    match init {
        Init::Zeros => Ok(Tensor::zeros(ty.clone())),
        Init::Ones => Ok(Tensor::full(ty.clone(), 1.0)),
        Init::Normal { .. } if !ty.dtype.is_float() => Err(RuntimeError::Init {
            name: name.to_string(),
            ty: ty.clone(),
            detail: "normal draws need a float dtype".into(),
        }),
        Init::Normal { .. } => {
            let draw = element_init(name, init, seed);
            let values = (0..ty.num_elements()).map(draw).collect();
            Ok(Tensor::new(ty.clone(), Data::Float(values))?.rounded())
        }
    }
}

/// The values of parameter `name` as a function of the row-major element index (in the full
/// parameter), before rounding to its dtype. A rank that holds a shard calls it with the
/// global indices of its own elements.
pub fn element_init(name: &str, init: Init, seed: u64) -> impl Fn(u64) -> f64 + use<> {
    let stream = Stream::new(seed, name);
    move |index| match init {
        Init::Normal { std } => std * stream.normal(index),
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
    }
}
