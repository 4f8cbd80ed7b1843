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
            params.insert(name.clone(), init_parameter(name, ty, init, seed)?);
        }
    }
    Ok(params)
}

/// Draws one parameter. Normal draws need a float dtype; zeros and ones fit every dtype.
pub fn init_parameter(
    name: &str,
    ty: &TensorType,
    init: &Init,
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
        Init::Values(values) => {
            check_values(name, ty, values)?;
            let data = values.as_slice().iter().map(|&x| f64::from(x)).collect();
            Ok(Tensor::new(ty.clone(), Data::Float(data))?.rounded())
        }
    }
}

/// Given values fit a parameter when it has a float dtype and exactly as many elements.
pub(crate) fn check_values(
    name: &str,
    ty: &TensorType,
    values: &autopar_ir::Values,
) -> Result<(), RuntimeError> {
    let detail = if !ty.dtype.is_float() {
        "given values need a float dtype".to_string()
    } else if values.len() as u64 != ty.num_elements() {
        format!(
            "{} values given for {} elements",
            values.len(),
            ty.num_elements()
        )
    } else {
        return Ok(());
    };
    Err(RuntimeError::Init {
        name: name.to_string(),
        ty: ty.clone(),
        detail,
    })
}

/// The values of parameter `name` as a function of the row-major element index (in the full
/// parameter), before rounding to its dtype. A rank that holds a shard calls it with the
/// global indices of its own elements.
///
/// For [`Init::Values`] an index past the values gives 0 (callers check the count against
/// the parameter's global type first, as [`init_parameter`] and `dist::init_region` do).
pub fn element_init(name: &str, init: &Init, seed: u64) -> impl Fn(u64) -> f64 + use<> {
    let stream = Stream::new(seed, name);
    let init = init.clone();
    move |index| match &init {
        Init::Normal { std } => std * stream.normal(index),
        Init::Zeros => 0.0,
        Init::Ones => 1.0,
        Init::Values(values) => usize::try_from(index)
            .ok()
            .and_then(|i| values.as_slice().get(i))
            .map_or(0.0, |&x| f64::from(x)),
    }
}
