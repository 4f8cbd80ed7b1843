//! Exact lower bounds that let the search skip plans without estimating them: a bound on the
//! peak memory of a plan from the state every rank must hold, and the ordering of recompute
//! policies in time. Neither can remove a plan that would rank; the proofs are in the docs.

use autopar_cost_model::estimate::{rank_layers, stage_layers};
use autopar_cost_model::memory::{
    activation_bytes_per_layer, expert_params_per_layer, layer_params_per_rank,
    optimizer_params_per_layer,
};
use autopar_cost_model::{CostModel, Offload, Plan, TransformerConfig};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// A lower bound, in bytes, on the peak memory the cost model predicts for `plan`.
///
/// `in_flight[r]` is the number of micro-batch chunks pipeline rank `r` holds at once under
/// the plan's schedule ([`autopar_ir::schedule::Schedule::max_in_flight`]); `None` drops the
/// activation term and gives the *static* bound.
///
/// # Why it is a lower bound
///
/// The estimate's peak is the largest total of any pipeline rank, and a rank's total is a sum
/// of non-negative terms: weights, gradients, optimizer state, stored activations, working
/// memory, communication buffers and the device's reserved memory. For every rank `r`:
///
/// - it holds at least the layers of its virtual stages, `L_r` (the cost model's division,
///   [`stage_layers`]), each with [`layer_params_per_rank`] parameters at `e / z3 + g / z2`
///   bytes each (compute dtype and gradient bytes, each divided from the ZeRO stage that
///   shards it by the ranks sharing it, [`CostModel::zero_shards`]: all data-parallel ranks
///   for dense parameters, those holding the same experts for experts) and the optimizer
///   state of [`optimizer_params_per_layer`] at `o / z1`; embedding and head are left out
///   (under CPU offload, what the estimate leaves on the GPU: the weights and a 16-bit
///   gradient shard with the optimizer offloaded, nothing with the parameters);
/// - it stores `a` activation bytes per layer of each of its `in_flight[r]` in-flight
///   micro-batch chunks (the schedule's peak with every chunk at its own size,
///   `Schedule::peak_in_flight_by`), so at least `in_flight[r] * m * a`, where `m` is the
///   smallest chunk of all and `a` is [`activation_bytes_per_layer`] under the plan's
///   recompute policy;
/// - the reserved memory is always there; working memory and buffers are left out.
///
/// So each rank's total is at least its term here, and the maximum over ranks bounds the
/// peak. The static part depends only on `(dp, tp, pp, vpp, ep, zero)`; the activation part
/// only grows with the micro-batch size and falls with more recomputation; every other choice
/// (schedule, sequence parallelism, axis order) only adds terms that the bound leaves out. A
/// static bound above the device's capacity therefore rules out every plan sharing those six
/// values, whatever the rest.
pub fn memory_lower_bound(
    model: &CostModel,
    cfg: &TransformerConfig,
    plan: &Plan,
    in_flight: Option<&[usize]>,
) -> f64 {
    let pp = plan.pp.max(1);
    let layers = stage_layers(cfg, plan);
    let min_chunk = layers.iter().copied().min().unwrap_or(0) as f64;
    let mp = &model.memory;
    let z = model.zero_shards(plan);
    let expert = expert_params_per_layer(cfg, plan);
    let dense = layer_params_per_rank(cfg, plan) - expert;
    let e = plan.dtype.size_bytes() as f64;
    let per_layer = match plan.offload {
        Offload::None => {
            z.bytes(plan, 3, dense, expert, e)
                + z.bytes(plan, 2, dense, expert, mp.grad_bytes_per_param)
                + z.bytes(
                    plan,
                    1,
                    optimizer_params_per_layer(cfg, plan) - expert,
                    expert,
                    mp.optimizer_bytes_per_param,
                )
        }
        // The estimate keeps the 16-bit weights and a 16-bit gradient shard on the GPU.
        Offload::Optimizer => {
            z.bytes(plan, 3, dense, expert, e) + z.bytes(plan, 2, dense, expert, e)
        }
        Offload::Params => 0.0,
    };
    let act = match in_flight {
        Some(_) => activation_bytes_per_layer(
            cfg,
            plan,
            plan.recompute,
            model.compute.attention,
            model.software.dropout,
        ),
        None => 0.0,
    };
    let worst = (0..pp)
        .map(|r| {
            let held = rank_layers(&layers, pp, r);
            let chunks = in_flight.and_then(|f| f.get(r)).copied().unwrap_or(0) as f64;
            held as f64 * per_layer + chunks * min_chunk * act
        })
        .fold(0.0, f64::max);
    worst + model.cluster.gpu.reserved_gib * GIB
}

/// The device capacity the estimate compares the peak with, in bytes.
pub fn capacity_bytes(model: &CostModel) -> f64 {
    model.cluster.gpu.hbm_capacity_gib * GIB
}

/// A lower bound, in seconds, on the step time the cost model predicts for a plan with
/// `pp` ranks, `vpp` chunks per rank and `m` micro-batches whose virtual stages take `stages`
/// (from [`CostModel::stage_times`]).
///
/// # Why it is a lower bound
///
/// The step is at least the simulated pipeline (the terms after it are non-negative), and in
/// the simulation each rank runs its compute actions one after another, whatever the schedule
/// kind. Rank `r` runs `m` forwards and backwards of each of its chunks, `W_r` in all. Its
/// first forward, of some virtual stage `v >= r`, needs the forwards of that micro-batch on
/// stages `0..v` first, a chain of at least `F_r = sum of forward(v') for v' < r`. Its last
/// backward, of some stage `v >= r`, must be followed by that micro-batch's backwards on
/// stages `v-1` down to `0`, at least `B_r = sum of backward(v') for v' < r`. Transfers only
/// add waiting. So the pipeline takes at least `max_r (F_r + W_r + B_r)`, the classic
/// `(pp - 1)` fill and drain for even stages. The simulation rounds each duration to a
/// nanosecond; the bound subtracts half a nanosecond for every action it counts.
pub fn step_time_lower_bound(
    stages: &autopar_cost_model::StageTimes,
    pp: usize,
    vpp: usize,
    m: usize,
) -> f64 {
    let (f, b) = (&stages.forward_s, &stages.backward_s);
    let at = |x: &Vec<f64>, v: usize| x.get(v).copied().unwrap_or(0.0);
    let (mut ahead_f, mut ahead_b, mut best) = (0.0, 0.0, 0.0f64);
    for r in 0..pp {
        let work: f64 = (0..vpp)
            .map(|c| at(f, c * pp + r) + at(b, c * pp + r))
            .sum::<f64>()
            * m as f64;
        best = best.max(ahead_f + work + ahead_b);
        ahead_f += at(f, r);
        ahead_b += at(b, r);
    }
    let counted = (2 * m * vpp + 2 * pp) as f64;
    best * (1.0 - 1e-12) - counted * 0.5e-9
}
