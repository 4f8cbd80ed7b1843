//! Where the training state lives: [`StateLayout`] records, for every state tensor of a
//! compiled step (its parameters: weights, optimizer state, step counters, loss-scaling
//! state), its global type and sharding and which ranks hold which region. Initialising a
//! rank, gathering a tensor back for `--verify`, and saving and resharding checkpoints
//! ([`crate::checkpoint`]) all read it.

use std::collections::BTreeMap;
use std::ops::Range;

use autopar_ir::sharding_algebra::local_region;
use autopar_ir::{DeviceMesh, Graph, Init, InputRole, Op, Sharding, TensorType};
use autopar_runtime::dist;
use autopar_runtime::{self as rt, Tensor, TensorMap};

use crate::Error;
use crate::compile::CompiledStep;

/// The state of a compiled step over the ranks of its mesh.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateLayout {
    /// Every state tensor, in the global step's node order.
    pub tensors: Vec<StateTensor>,
    /// Ranks of the whole mesh.
    pub num_ranks: usize,
}

/// One state tensor and its shards.
#[derive(Clone, Debug, PartialEq)]
pub struct StateTensor {
    /// Its name (a parameter of the global step).
    pub name: String,
    /// Its global type.
    pub ty: TensorType,
    /// How it is initialised.
    pub init: Init,
    /// Its sharding over the SPMD mesh (`None`: not parallelised, held whole).
    pub sharding: Option<Sharding>,
    /// The distinct regions ranks hold, each with the ranks holding it (replicas share one
    /// entry); together they cover the tensor.
    pub shards: Vec<Shard>,
}

/// A region of a state tensor and the ranks that hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Per dim, the global index range.
    pub region: Vec<Range<usize>>,
    /// Ranks of the whole mesh holding exactly this region, ascending.
    pub ranks: Vec<usize>,
}

impl StateLayout {
    /// The layout of `step`'s state: each rank holds its region (on the SPMD mesh) of every
    /// parameter of the global step; in a pipeline, only of those its own stages read.
    pub fn new(step: &CompiledStep) -> Result<Self, Error> {
        let g = &step.global;
        let n = step.mesh.num_devices();
        let mut tensors = Vec::new();
        for node in g.nodes_in_order() {
            let node = g.node(node);
            let Op::Parameter { name, ty, init } = &node.op else {
                continue;
            };
            let sharding = g.value(node.outputs[0]).sharding.clone();
            let mut shards: Vec<Shard> = Vec::new();
            for rank in 0..n {
                let (pp_rank, which) = rt::split_pipeline_rank(&step.mesh, rank);
                if let Some(p) = &step.pipeline {
                    let held = p
                        .pipelines
                        .get(which)
                        .and_then(|p| p.sources.get(pp_rank))
                        .is_some_and(|s| s.iter().any(|s| s.is_state && s.name == *name));
                    if !held {
                        continue;
                    }
                }
                let region = region_of(ty, sharding.as_ref(), &step.spmd_mesh, which)?;
                match shards.iter_mut().find(|s| s.region == region) {
                    Some(s) => s.ranks.push(rank),
                    None => shards.push(Shard {
                        region,
                        ranks: vec![rank],
                    }),
                }
            }
            tensors.push(StateTensor {
                name: name.clone(),
                ty: ty.clone(),
                init: init.clone(),
                sharding,
                shards,
            });
        }
        Ok(StateLayout {
            tensors,
            num_ranks: n,
        })
    }

    /// The state rank `rank` holds, drawn from `seed`: its region of every tensor it holds,
    /// element by element by global index, so that no rank ever materialises a whole
    /// sharded tensor and every rank draws exactly what the single device draws there.
    pub fn init_rank(&self, rank: usize, seed: u64) -> Result<TensorMap, Error> {
        let mut state = TensorMap::new();
        for t in &self.tensors {
            let Some(shard) = t.shards.iter().find(|s| s.ranks.contains(&rank)) else {
                continue;
            };
            let value = dist::init_region(&t.name, &t.ty, &t.init, &shard.region, seed)?;
            state.insert(t.name.clone(), value);
        }
        Ok(state)
    }

    /// Like [`StateLayout::init_rank`], with the tensors of `given` (whole, at their global
    /// types) taking the place of drawn ones: the rank keeps its region of each.
    pub fn init_rank_with(
        &self,
        rank: usize,
        seed: u64,
        given: &TensorMap,
    ) -> Result<TensorMap, Error> {
        let mut state = TensorMap::new();
        for t in &self.tensors {
            let Some(shard) = t.shards.iter().find(|s| s.ranks.contains(&rank)) else {
                continue;
            };
            let value = match given.get(&t.name) {
                Some(whole) if *whole.ty() == t.ty => {
                    crate::checkpoint::slice(whole, &shard.region)?
                }
                Some(whole) => {
                    return Err(Error::Usage(format!(
                        "`{}` is given as {} but the model's is {}",
                        t.name,
                        whole.ty(),
                        t.ty
                    )));
                }
                None => dist::init_region(&t.name, &t.ty, &t.init, &shard.region, seed)?,
            };
            state.insert(t.name.clone(), value);
        }
        Ok(state)
    }

    /// The model's weights among the state (parameters with a weight role, not optimizer
    /// state or counters), by name, at their global types.
    pub fn weights(&self, step: &CompiledStep) -> BTreeMap<String, TensorType> {
        let g = &step.global;
        g.nodes_in_order()
            .into_iter()
            .filter_map(|n| {
                let Op::Parameter { name, ty, .. } = &g.node(n).op else {
                    return None;
                };
                g.meta(n).role.map(|_| (name.clone(), ty.clone()))
            })
            .filter(|(name, _)| self.tensors.iter().any(|t| t.name == *name))
            .collect()
    }

    /// Bytes rank `rank` holds.
    pub fn rank_bytes(&self, rank: usize) -> u64 {
        self.tensors
            .iter()
            .filter_map(|t| {
                let shard = t.shards.iter().find(|s| s.ranks.contains(&rank))?;
                let elements: usize = region_dims(&shard.region).iter().product();
                Some(elements as u64 * t.ty.dtype.size_bytes() as u64)
            })
            .sum()
    }

    /// Tensor `name` gathered to its global type from the ranks' `states` (each region from
    /// the first rank that holds it).
    pub fn gather(&self, name: &str, states: &[TensorMap]) -> Result<Tensor, Error> {
        let t = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::Usage(format!("`{name}` is not a state tensor")))?;
        let mut values = vec![f64::NAN; t.ty.num_elements() as usize];
        for shard in &t.shards {
            let rank = shard.ranks[0];
            let local = states.get(rank).and_then(|s| s.get(name)).ok_or_else(|| {
                rt::RuntimeError::MissingShard {
                    rank,
                    name: name.into(),
                }
            })?;
            dist::place_shard(&mut values, name, &t.ty, &shard.region, rank, local)?;
        }
        Ok(Tensor::from_f64(t.ty.clone(), values)?)
    }
}

/// The region of a tensor of type `ty` sharded by `sharding` that coordinate `which` of
/// `mesh` holds (all of it without a sharding).
fn region_of(
    ty: &TensorType,
    sharding: Option<&Sharding>,
    mesh: &DeviceMesh,
    which: usize,
) -> Result<Vec<Range<usize>>, Error> {
    Ok(match sharding {
        Some(s) => local_region(ty.dims(), s, mesh, &mesh.coords(which))?,
        None => ty.dims().iter().map(|&d| 0..d).collect(),
    })
}

fn region_dims(region: &[Range<usize>]) -> Vec<usize> {
    region.iter().map(|r| r.len()).collect()
}

/// The part of the global `batch` that coordinate `which` of `mesh` is fed: each input of
/// `g` sliced to its region when `g` is sharded ([`dist::rank_inputs`]), the whole batch
/// when it is not. The batch is checked first ([`check_batch`]), so that every mesh refuses
/// what a single device refuses.
pub fn rank_inputs(
    g: &Graph,
    sharded: bool,
    batch: &TensorMap,
    mesh: &DeviceMesh,
    which: usize,
) -> Result<TensorMap, Error> {
    check_batch(g, batch)?;
    match sharded {
        true => Ok(dist::rank_inputs(g, batch, mesh, which)?),
        false => Ok(batch.clone()),
    }
}

/// Checks the token ids of `batch` against the vocabulary of the inputs of `g` that carry
/// them ([`InputRole::Tokens`], [`InputRole::NextTokens`]). A single device would fail in its
/// embedding gather, but a vocabulary split over `tp` masks the ids outside each rank's rows
/// and would train on a plausible loss: the check belongs where the batch enters, before it
/// is split.
pub fn check_batch(g: &Graph, batch: &TensorMap) -> Result<(), Error> {
    for (_, name, op) in g.inputs() {
        let Op::Input {
            role: InputRole::Tokens { vocab } | InputRole::NextTokens { vocab },
            ..
        } = op
        else {
            continue;
        };
        let Some(ids) = batch.get(name).and_then(|t| t.ints()) else {
            continue;
        };
        let bound = i64::try_from(*vocab).unwrap_or(i64::MAX);
        if let Some((at, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| !(0..bound).contains(*id))
        {
            return Err(Error::BadBatch {
                input: name.to_string(),
                detail: format!("element {at} is token id {id}, outside the vocabulary 0..{vocab}"),
            });
        }
    }
    Ok(())
}
