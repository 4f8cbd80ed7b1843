//! Data distribution over a mesh: what each rank holds of a parallelised graph's state and
//! batch, drawn and sliced by global index from the value shardings, and the state gathered
//! back to global shapes. A rank never holds, nor draws, a whole sharded tensor.
//!
//! A graph's *state* is its parameters; each must carry a complete sharding
//! ([`autopar_ir::Value::sharding`]), as sharding propagation leaves them.

use std::ops::Range;

use autopar_ir::sharding_algebra::local_region;
use autopar_ir::{DeviceMesh, Graph, Init, Op, Sharding, TensorType, ValueId};

use crate::TensorMap;
use crate::error::RuntimeError;
use crate::init::{element_init, init_parameter};
use crate::tensor::{Data, Tensor};

/// Global row-major indices of the elements of `region` of a tensor of shape `dims`, in the
/// region's row-major order.
///
/// ```
/// # use autopar_runtime::dist::region_indices;
/// // Rows 1..3, columns 2..4 of a 3 x 4 tensor.
/// assert_eq!(region_indices(&[3, 4], &[1..3, 2..4]), vec![6, 7, 10, 11]);
/// ```
pub fn region_indices(dims: &[usize], region: &[Range<usize>]) -> Vec<usize> {
    let mut out = vec![0usize];
    for (d, r) in region.iter().enumerate() {
        let mut next = Vec::with_capacity(out.len() * r.len());
        for &base in &out {
            for i in r.clone() {
                next.push(base * dims.get(d).copied().unwrap_or(1) + i);
            }
        }
        out = next;
    }
    out
}

/// The sharding of value `v` of `g`.
pub fn sharding_of(g: &Graph, v: ValueId) -> Result<&Sharding, RuntimeError> {
    g.value_checked(v)?
        .sharding
        .as_ref()
        .ok_or_else(|| RuntimeError::NoSharding {
            value: v.to_string(),
        })
}

/// The state of `rank` of `mesh`: its shard of every parameter of `g`, float ones drawn
/// element by element by global index from `seed` (so the shards of all ranks together are
/// exactly [`crate::init_parameters`]), others initialised at their local type.
pub fn init_rank_state(
    g: &Graph,
    mesh: &DeviceMesh,
    rank: usize,
    seed: u64,
) -> Result<TensorMap, RuntimeError> {
    let coords = mesh.coords(rank);
    let mut state = TensorMap::new();
    for n in g.nodes_in_order() {
        let node = g.node(n);
        let Op::Parameter { name, ty, init } = &node.op else {
            continue;
        };
        let Some(&v) = node.outputs.first() else {
            continue;
        };
        let region = local_region(ty.dims(), sharding_of(g, v)?, mesh, &coords)?;
        state.insert(name.clone(), init_region(name, ty, init, &region, seed)?);
    }
    Ok(state)
}

/// `region` of parameter `name` (global type `ty`, initialiser `init`) as initialised from
/// `seed`: float elements drawn one by one by global index, so that any split of a tensor
/// into regions draws exactly what [`crate::init_parameters`] draws there; other dtypes
/// initialised at the region's type.
pub fn init_region(
    name: &str,
    ty: &TensorType,
    init: &Init,
    region: &[Range<usize>],
    seed: u64,
) -> Result<Tensor, RuntimeError> {
    let local = TensorType::new(ty.dtype, region.iter().map(|r| r.len()).collect::<Vec<_>>());
    if let Init::Values(values) = init {
        crate::init::check_values(name, ty, values)?;
    }
    if !ty.dtype.is_float() {
        return init_parameter(name, &local, init, seed);
    }
    let draw = element_init(name, init, seed);
    let values = region_indices(ty.dims(), region)
        .into_iter()
        .map(|i| draw(i as u64))
        .collect();
    Ok(Tensor::new(local, Data::Float(values))?.rounded())
}

/// The part of the global `batch` that `rank` of `mesh` is fed: each input of `g` sliced to
/// the rank's region of it (inputs absent from `batch` are left out).
pub fn rank_inputs(
    g: &Graph,
    batch: &TensorMap,
    mesh: &DeviceMesh,
    rank: usize,
) -> Result<TensorMap, RuntimeError> {
    let coords = mesh.coords(rank);
    let mut out = TensorMap::new();
    for (v, name, _) in g.inputs() {
        let Some(t) = batch.get(name) else { continue };
        let region = local_region(t.dims(), sharding_of(g, v)?, mesh, &coords)?;
        let idx = region_indices(t.dims(), &region);
        let local = TensorType::new(
            t.dtype(),
            region.iter().map(|r| r.len()).collect::<Vec<_>>(),
        );
        let pick = |n: usize| idx.iter().all(|&i| i < n);
        let data = match t.data() {
            Data::Float(x) if pick(x.len()) => Data::Float(idx.iter().map(|&i| x[i]).collect()),
            Data::Int(x) if pick(x.len()) => Data::Int(idx.iter().map(|&i| x[i]).collect()),
            Data::Bool(x) if pick(x.len()) => Data::Bool(idx.iter().map(|&i| x[i]).collect()),
            _ => {
                return Err(RuntimeError::BadTensor {
                    ty: t.ty().clone(),
                    detail: format!("input `{name}` is smaller than its type says"),
                });
            }
        };
        out.insert(name.to_string(), Tensor::new(local, data)?);
    }
    Ok(out)
}

/// Parameter `name`, of global type `ty` and sharding `sharding` on `mesh`, gathered back to
/// its global shape from every rank's shard (`states[rank]`; a replicated region is taken
/// from the last rank that holds it).
pub fn gather(
    name: &str,
    ty: &TensorType,
    sharding: &Sharding,
    mesh: &DeviceMesh,
    states: &[TensorMap],
) -> Result<Tensor, RuntimeError> {
    let mut values = vec![0.0f64; usize::try_from(ty.num_elements()).unwrap_or(usize::MAX)];
    for (rank, state) in states.iter().enumerate() {
        let t = state.get(name).ok_or_else(|| RuntimeError::MissingShard {
            rank,
            name: name.into(),
        })?;
        let region = local_region(ty.dims(), sharding, mesh, &mesh.coords(rank))?;
        place_shard(&mut values, name, ty, &region, rank, t)?;
    }
    Tensor::from_f64(ty.clone(), values)
}

/// Writes `shard`, rank `rank`'s `region` of tensor `name` (global type `ty`), into `values`,
/// the tensor's global elements in row-major order. A shard whose type is not the region's
/// is an error naming the rank and the tensor.
pub fn place_shard(
    values: &mut [f64],
    name: &str,
    ty: &TensorType,
    region: &[Range<usize>],
    rank: usize,
    shard: &Tensor,
) -> Result<(), RuntimeError> {
    let expected = TensorType::new(ty.dtype, region.iter().map(|r| r.len()).collect::<Vec<_>>());
    if *shard.ty() != expected {
        return Err(RuntimeError::ShardMismatch {
            rank,
            name: name.into(),
            expected,
            actual: shard.ty().clone(),
        });
    }
    for (x, global) in shard
        .to_f64_vec()
        .into_iter()
        .zip(region_indices(ty.dims(), region))
    {
        if let Some(slot) = values.get_mut(global) {
            *slot = x;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use autopar_ir::{Init, InputRole, Placement};

    use super::*;
    use crate::{init_parameters, synthetic_batch};

    fn sharded(axes: &[(&str, Placement)]) -> Option<Sharding> {
        Some(Sharding::user(
            axes.iter().map(|(a, p)| (a.to_string(), *p)),
        ))
    }

    /// A graph on `dp=2, tp=2` with a weight split over `tp` on dim 1, a bias replicated, a
    /// table split on both dims, and an input split over `dp` on dim 0.
    fn graph() -> Result<(Graph, DeviceMesh), RuntimeError> {
        let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)])?;
        let mut g = Graph::new("sharded");
        g.set_mesh(Some(mesh.clone()));
        let f32_ty = |dims: &[usize]| TensorType::new(autopar_ir::DType::F32, dims.to_vec());
        let param = |g: &mut Graph, name: &str, dims: &[usize]| {
            g.add(
                Op::Parameter {
                    name: name.into(),
                    ty: f32_ty(dims),
                    init: Init::Normal { std: 1.0 },
                },
                &[],
            )
        };
        let w = param(&mut g, "w", &[3, 4])?;
        g.set_sharding(
            w,
            sharded(&[("dp", Placement::Replicate), ("tp", Placement::Shard(1))]),
        )?;
        let b = param(&mut g, "b", &[4])?;
        g.set_sharding(
            b,
            sharded(&[("dp", Placement::Replicate), ("tp", Placement::Replicate)]),
        )?;
        let t = param(&mut g, "t", &[4, 6])?;
        g.set_sharding(
            t,
            sharded(&[("dp", Placement::Shard(0)), ("tp", Placement::Shard(1))]),
        )?;
        let x = g.add(
            Op::Input {
                name: "x".into(),
                ty: f32_ty(&[4, 3]),
                role: InputRole::Features,
            },
            &[],
        )?;
        g.set_sharding(
            x,
            sharded(&[("dp", Placement::Shard(0)), ("tp", Placement::Replicate)]),
        )?;
        for (name, v) in [("w", w), ("b", b), ("t", t), ("x", x)] {
            g.add_output(name, v)?;
        }
        Ok((g, mesh))
    }

    #[test]
    fn rank_shards_gather_to_the_single_device_parameters() -> Result<(), RuntimeError> {
        let (g, mesh) = graph()?;
        let whole = init_parameters(&g, 7)?;
        let states: Vec<TensorMap> = (0..4)
            .map(|rank| init_rank_state(&g, &mesh, rank, 7))
            .collect::<Result<_, _>>()?;
        // Rank 3 is (dp=1, tp=1): columns 2..4 of `w`, the whole `b`, the last quarter of `t`.
        assert_eq!(states[3]["w"].dims(), &[3, 2]);
        assert_eq!(states[3]["b"].dims(), &[4]);
        assert_eq!(states[3]["t"].dims(), &[2, 3]);
        for (v, name, ty) in g.parameters() {
            let got = gather(name, ty, sharding_of(&g, v)?, &mesh, &states)?;
            assert_eq!(got, whole[name], "{name}");
        }
        Ok(())
    }

    #[test]
    fn rank_inputs_take_the_rank_rows() -> Result<(), RuntimeError> {
        let (g, mesh) = graph()?;
        let batch = synthetic_batch(&g, 3, 0)?;
        let x = batch["x"].to_f64_vec();
        for rank in 0..4 {
            let part = rank_inputs(&g, &batch, &mesh, rank)?;
            let dp = mesh.coords(rank)[0];
            assert_eq!(part["x"].dims(), &[2, 3]);
            assert_eq!(
                part["x"].to_f64_vec(),
                x[dp * 6..dp * 6 + 6].to_vec(),
                "rank {rank}"
            );
        }
        // Gathering the parts back (as if `x` were state) gives the batch again.
        let parts: Vec<TensorMap> = (0..4)
            .map(|rank| rank_inputs(&g, &batch, &mesh, rank))
            .collect::<Result<_, _>>()?;
        let (v, _, _) = g.inputs()[0];
        let back = gather("x", batch["x"].ty(), sharding_of(&g, v)?, &mesh, &parts)?;
        assert_eq!(back, batch["x"]);
        Ok(())
    }

    #[test]
    fn missing_and_misshapen_shards_are_named() -> Result<(), RuntimeError> {
        let (g, mesh) = graph()?;
        let mut states: Vec<TensorMap> = (0..4)
            .map(|rank| init_rank_state(&g, &mesh, rank, 7))
            .collect::<Result<_, _>>()?;
        let (v, name, ty) = g.parameters()[0];
        let s = sharding_of(&g, v)?.clone();
        let wrong = states[1]["b"].clone();
        states[1].insert(name.to_string(), wrong);
        assert!(matches!(
            gather(name, ty, &s, &mesh, &states),
            Err(RuntimeError::ShardMismatch { rank: 1, .. })
        ));
        states[2].remove(name);
        states[1] = init_rank_state(&g, &mesh, 1, 7)?;
        assert!(matches!(
            gather(name, ty, &s, &mesh, &states),
            Err(RuntimeError::MissingShard { rank: 2, .. })
        ));
        let mut bare = g.clone();
        bare.set_sharding(v, None)?;
        assert!(matches!(
            init_rank_state(&bare, &mesh, 0, 7),
            Err(RuntimeError::NoSharding { .. })
        ));
        Ok(())
    }
}
