//! Top-k MoE routing with expert capacity (GShard style).

use autopar_ir::TensorType;

use super::floats;
use crate::error::RuntimeError;
use crate::tensor::{Data, Tensor};

/// Routes the tokens of `probs[..., t, e]` and returns `combine[..., t, e, c]` and
/// `dispatch[..., t, e, c]` (both of type `out`).
///
/// Every index of the leading dims is an independent routing group with its own `capacity`
/// slots per expert. Each token picks its `top_k` most probable experts (ties go to the lower
/// expert index); its gates are those probabilities, divided by their sum when `normalize`
/// (unless the sum is zero). Within a group, slots are then handed out choice rank by choice
/// rank, and within a rank in token order: the token takes its expert's next free slot, or
/// that choice is dropped when the expert already holds `capacity` tokens of the group.
pub(crate) fn moe_route(
    top_k: usize,
    capacity: usize,
    normalize: bool,
    probs: &Tensor,
    out: &TensorType,
) -> Result<Vec<Tensor>, RuntimeError> {
    let p = floats("moe_route", probs)?;
    let dims = probs.dims();
    let rank = dims.len();
    let (tokens, experts) = (dims[rank - 2], dims[rank - 1]);
    let groups: usize = dims[..rank - 2].iter().product();
    let per_group_in = tokens * experts;
    let per_group_out = per_group_in * capacity;
    let mut combine = vec![0.0; groups * per_group_out];
    let mut dispatch = vec![0.0; groups * per_group_out];
    if per_group_in > 0 {
        for ((probs, combine), dispatch) in p
            .chunks_exact(per_group_in)
            .zip(combine.chunks_exact_mut(per_group_out.max(1)))
            .zip(dispatch.chunks_exact_mut(per_group_out.max(1)))
        {
            route_group(
                top_k, capacity, normalize, experts, probs, combine, dispatch,
            );
        }
    }
    Ok(vec![
        Tensor::from_parts(out.clone(), Data::Float(combine)),
        Tensor::from_parts(out.clone(), Data::Float(dispatch)),
    ])
}

/// Routes one group's `probs[t, e]` into its `combine[t, e, c]` and `dispatch[t, e, c]`
/// (zeroed on entry).
fn route_group(
    top_k: usize,
    capacity: usize,
    normalize: bool,
    experts: usize,
    p: &[f64],
    combine: &mut [f64],
    dispatch: &mut [f64],
) {
    let tokens = p.len() / experts;
    // choices[token * top_k + rank] = (expert, gate)
    let mut choices = Vec::with_capacity(tokens * top_k);
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for row in p.chunks_exact(experts) {
        order.clear();
        order.extend(0..experts);
        // A stable sort by descending probability keeps ties in expert order.
        order.sort_by(|&x, &y| row[y].total_cmp(&row[x]));
        let chosen = &order[..top_k];
        let sum: f64 = chosen.iter().map(|&e| row[e]).sum();
        let norm = if normalize && sum != 0.0 { sum } else { 1.0 };
        choices.extend(chosen.iter().map(|&e| (e, row[e] / norm)));
    }
    let mut used = vec![0usize; experts];
    for rank in 0..top_k {
        for token in 0..tokens {
            let (e, gate) = choices[token * top_k + rank];
            if used[e] < capacity {
                let slot = (token * experts + e) * capacity + used[e];
                combine[slot] = gate;
                dispatch[slot] = 1.0;
                used[e] += 1;
            }
        }
    }
}
