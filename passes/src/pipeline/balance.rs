//! Stage boundaries that balance cost: the layer sequence of a training step with the FLOPs
//! of each layer (forward and backward of one micro-batch, embedding and loss included), and
//! a dynamic program that cuts it into contiguous stages minimising the costliest stage,
//! respecting boundaries the user pinned.
//!
//! The layer sequence is read from the nodes' typed metadata: every node of micro-batch 0 with
//! a layer ([`autopar_ir::LayerId`]: embedding, blocks, final norm, head, loss) counts towards
//! that layer, in the order in which the forward first reaches each. A layer's name is only a
//! label for people (the unit of its first node's scope path, e.g. `h.3`, else the layer's own
//! spelling, `block(3)`); pins may use either, or an index.

use std::collections::HashMap;

use autopar_cost_model::{Cluster, CommParams, ComputeParams};
use autopar_ir::{Graph, LayerId, Op, TensorType};

use crate::autodiff::split_scope;
use crate::error::PassError;

/// One layer of the sequence a pipeline is cut along.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    /// A label for people: its scope path, e.g. `embed`, `h.3`, `head` (or `block(3)`).
    pub name: String,
    /// Which layer it is.
    pub id: LayerId,
    /// FLOPs of its forward and backward for one micro-batch.
    pub flops: f64,
}

/// Stage boundaries over a layer sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct StageSplit {
    /// The layers, in model order.
    pub layers: Vec<Layer>,
    /// `starts[s]`: index of the first layer of stage `s` (increasing, `starts[0] == 0`).
    pub starts: Vec<usize>,
}

impl StageSplit {
    /// Number of stages.
    pub fn num_stages(&self) -> usize {
        self.starts.len()
    }

    /// The layer indices of stage `s`.
    pub fn stage_layers(&self, s: usize) -> std::ops::Range<usize> {
        let end = self.starts.get(s + 1).copied().unwrap_or(self.layers.len());
        self.starts[s]..end
    }

    /// Total FLOPs of stage `s`.
    pub fn stage_flops(&self, s: usize) -> f64 {
        self.layers[self.stage_layers(s)]
            .iter()
            .map(|l| l.flops)
            .sum()
    }

    /// The stage that holds layer `layer_idx`.
    pub fn stage_of_layer(&self, layer_idx: usize) -> usize {
        self.starts.partition_point(|&s| s <= layer_idx) - 1
    }

    /// Number of layers in each stage.
    pub fn layer_counts(&self) -> Vec<usize> {
        (0..self.num_stages())
            .map(|s| self.stage_layers(s).len())
            .collect()
    }
}

/// The layer unit of a scope path: the path up to its first numeric component (`h.3.attn`
/// → `h.3`, `layers.0.mlp` → `layers.0`), or the whole path (`embed`, `ln_f`, `head`): the
/// label [`layer_sequence`] gives a layer, for people; layers themselves come from metadata.
pub fn layer_unit(path: &str) -> &str {
    let mut end = 0;
    for (i, part) in path.split('.').enumerate() {
        end += part.len() + usize::from(i > 0);
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return &path[..end];
        }
    }
    path
}

/// The layers of a training-step graph in model order, each with the FLOPs of micro-batch
/// 0's forward and backward nodes in it (per-op FLOPs from the cost model). An error when no
/// node of micro-batch 0 has a layer in its metadata (a hand-written step without `meta{...}`):
/// there is nothing to cut along.
pub fn layer_sequence(step: &Graph) -> Result<Vec<Layer>, PassError> {
    let cluster = Cluster::preset("cpu").map_err(|e| PassError::BadGraph {
        graph: step.name().to_string(),
        detail: format!("no cost model for pipeline balancing: {e}"),
    })?;
    let (compute, comm) = (ComputeParams::default(), CommParams::default());
    let mut layers: Vec<Layer> = Vec::new();
    let mut index: HashMap<LayerId, usize> = HashMap::new();
    for n in step.nodes_in_order() {
        let node = step.node(n);
        let meta = step.meta(n);
        let (Some(layer), Some(0)) = (meta.layer, meta.micro_batch) else {
            continue;
        };
        let idx = match index.get(&layer) {
            Some(&i) => i,
            None if meta.phase.is_some_and(|p| p.is_forward()) => {
                index.insert(layer, layers.len());
                // The label only: the unit of the scope path, for people and pins.
                let name = node
                    .scope
                    .as_deref()
                    .map(|s| layer_unit(split_scope(s).1))
                    .filter(|u| !u.is_empty())
                    .map_or_else(|| layer.to_string(), str::to_string);
                layers.push(Layer {
                    name,
                    id: layer,
                    flops: 0.0,
                });
                layers.len() - 1
            }
            None => continue,
        };
        let inputs: Vec<&TensorType> = node.inputs.iter().map(|&v| step.ty(v)).collect();
        let outputs: Vec<&TensorType> = node.outputs.iter().map(|&v| step.ty(v)).collect();
        let flops = match node.op {
            Op::Parameter { .. } | Op::Input { .. } | Op::Constant { .. } => 0.0,
            _ => {
                compute
                    .op_cost(&node.op, &inputs, &outputs, &cluster, &comm, None)
                    .flops
            }
        };
        layers[idx].flops += flops;
    }
    if layers.is_empty() {
        return Err(PassError::BadGraph {
            graph: step.name().to_string(),
            detail: "no forward node of micro-batch 0 has a layer in its metadata \
             (`meta{phase=forward, mb=0, layer=...}`), so there is no layer sequence to \
             cut into pipeline stages"
                .into(),
        });
    }
    Ok(layers)
}

/// Resolves pinned boundaries, given as layer labels (`h.2`), layer spellings (`block(2)`)
/// or layer indices (`3`): each names the first layer of a stage. `block(N)`, with `N` the
/// number of blocks, names the first layer after the last block (a last stage that holds the
/// final norm, the head and the loss alone).
pub fn resolve_boundaries(layers: &[Layer], pins: &[String]) -> Result<Vec<usize>, PassError> {
    let blocks = layers.iter().filter(|l| l.id.block().is_some()).count();
    let after_blocks = layers
        .iter()
        .rposition(|l| l.id.block().is_some())
        .map(|i| i + 1);
    let mut out = Vec::with_capacity(pins.len());
    for pin in pins {
        let pin = pin.trim();
        let past_last = after_blocks.filter(|_| pin == LayerId::Block(blocks as u32).to_string());
        let idx = match pin.parse::<usize>() {
            Ok(i) => i,
            Err(_) => layers
                .iter()
                .position(|l| l.name == pin || l.id.to_string() == pin)
                .or(past_last)
                .ok_or_else(|| PassError::PinnedBoundary {
                    boundary: pin.to_string(),
                    detail: format!(
                        "no layer of that name (layers: {})",
                        layers
                            .iter()
                            .map(|l| l.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?,
        };
        if idx == 0 || idx >= layers.len() {
            return Err(PassError::PinnedBoundary {
                boundary: pin.to_string(),
                detail: format!(
                    "a stage boundary must be a layer index in 1..{}",
                    layers.len()
                ),
            });
        }
        out.push(idx);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Cuts `costs` into `n_stages` contiguous non-empty stages minimising the largest stage
/// cost, with a stage starting at every index of `pinned`. Among optimal cuts the one whose
/// stages end earliest wins, so the result is deterministic. Returns each stage's first index.
///
/// `balance(&[1.0, 1.0, 1.0, 5.0], 2, &[])` is `[0, 3]`: the heavy last layer gets a stage
/// of its own, where equal layer counts would give `[0, 2]`.
pub fn balance(costs: &[f64], n_stages: usize, pinned: &[usize]) -> Result<Vec<usize>, PassError> {
    let n = costs.len();
    if n_stages == 0 || n_stages > n {
        return Err(PassError::PipelineStages {
            n_layers: n,
            n_stages,
        });
    }
    if pinned.len() >= n_stages {
        return Err(PassError::PinnedBoundary {
            boundary: format!("{pinned:?}"),
            detail: format!(
                "{} pinned boundaries need more than {n_stages} stages",
                pinned.len()
            ),
        });
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    // A stage [i, j) may not contain a pinned boundary strictly inside it.
    let allowed = |i: usize, j: usize| !pinned.iter().any(|&p| i < p && p < j);
    const INF: f64 = f64::INFINITY;
    // best[k][j]: the smallest max-stage cost of cutting [0, j) into k stages.
    let mut best = vec![vec![INF; n + 1]; n_stages + 1];
    let mut from = vec![vec![0usize; n + 1]; n_stages + 1];
    best[0][0] = 0.0;
    for k in 1..=n_stages {
        for j in k..=n {
            for i in (k - 1)..j {
                if best[k - 1][i] == INF || !allowed(i, j) {
                    continue;
                }
                let c = best[k - 1][i].max(prefix[j] - prefix[i]);
                if c < best[k][j] {
                    best[k][j] = c;
                    from[k][j] = i;
                }
            }
        }
    }
    if best[n_stages][n] == INF {
        return Err(PassError::PinnedBoundary {
            boundary: format!("{pinned:?}"),
            detail: format!("no cut of {n} layers into {n_stages} stages keeps them all"),
        });
    }
    let mut starts = vec![0; n_stages];
    let mut j = n;
    for k in (1..=n_stages).rev() {
        let i = from[k][j];
        starts[k - 1] = i;
        j = i;
    }
    Ok(starts)
}

/// Stage starts for equal layer counts (the first stages take one more when it does not
/// divide), for comparison.
pub fn equal_split(n_layers: usize, n_stages: usize) -> Vec<usize> {
    let (q, r) = (n_layers / n_stages.max(1), n_layers % n_stages.max(1));
    (0..n_stages).map(|s| s * q + s.min(r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_dp() {
        assert_eq!(layer_unit("h.3.attn"), "h.3");
        assert_eq!(layer_unit("layers.10.mlp.up"), "layers.10");
        assert_eq!(layer_unit("embed"), "embed");
        assert_eq!(balance(&[1.0, 1.0, 1.0, 5.0], 2, &[]), Ok(vec![0, 3]));
        assert_eq!(balance(&[1.0; 6], 3, &[]), Ok(vec![0, 2, 4]));
        // A pin forces a stage to start at layer 1.
        assert_eq!(balance(&[1.0, 1.0, 1.0, 5.0], 2, &[1]), Ok(vec![0, 1]));
        assert!(balance(&[1.0; 2], 3, &[]).is_err());
        assert_eq!(equal_split(7, 3), vec![0, 3, 5]);
    }
}
