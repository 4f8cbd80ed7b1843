//! The routed mixture-of-experts MLP (GShard formulation), shared by the GPT-style and the
//! Llama-style (Mixtral) models: a router, top-k dispatch into per-expert capacity slots,
//! one MLP per expert, and a gate-weighted combine.

use autopar_ir::{WeightRole, axis};

use crate::builder::{ModelBuilder, ZEROS, normal};
use crate::tensor::{MoeRouting, Tensor};
use crate::zoo::INIT_STD;

/// Turns a transformer's MLPs into top-k routed mixtures of experts.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Number of experts per layer (spec key `experts`).
    pub n_experts: usize,
    /// Experts each token is routed to (`top_k`).
    pub top_k: usize,
    /// Slots per expert, relative to a perfectly even split (`capacity_factor`).
    pub capacity_factor: f64,
    /// Renormalise each token's top-k gates to sum to 1 (`normalize`).
    pub normalize: bool,
}

impl MoeConfig {
    /// The defaults of a `moe:` spec before its keys are applied.
    pub(crate) fn with_defaults() -> Self {
        MoeConfig {
            n_experts: 0,
            top_k: 0,
            capacity_factor: 1.25,
            normalize: true,
        }
    }

    /// Slots per expert for a routing group of `tokens` tokens:
    /// `ceil(capacity_factor * tokens * top_k / experts)`.
    pub fn capacity(&self, tokens: usize) -> usize {
        let even_share = tokens as f64 * self.top_k as f64 / self.n_experts as f64;
        // Float-to-int `as` saturates; the zoo's size limits keep this far below usize::MAX.
        (self.capacity_factor * even_share).ceil().max(1.0) as usize
    }
}

/// What each expert computes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ExpertMlp {
    /// GPT-style: `gelu(x @ w1 + b1) @ w2 + b2`.
    GeluWithBias,
    /// Mixtral-style SwiGLU: `(silu(x @ w1) * (x @ w3)) @ w2`, no biases.
    SwiGlu,
}

/// Sizes of one MoE layer's input and experts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MoeLayer<'c> {
    pub moe: &'c MoeConfig,
    pub experts: ExpertMlp,
    pub seq: usize,
    pub hidden: usize,
    pub ffn: usize,
    /// Init std of the expert output projections (scaled for the residual stream).
    pub out_std: f64,
}

/// An expert weight with its role: its leading expert dim split over the expert-parallel
/// axis `ep`.
fn expert(w: Tensor<'_>, role: WeightRole) -> Tensor<'_> {
    w.role(role).shard(0, axis::EP)
}

/// The MoE MLP of `x[b, s, h]`, declaring its router and expert weights in the current scope.
///
/// Within each expert the MLP is split Megatron-style on `tp` (the first matmul on its output
/// dim, the second on its input dim), as the dense MLP is.
/// Each sequence of the batch is one routing group (GShard's groups) with
/// [`MoeConfig::capacity`] slots per expert for its `s` tokens, so the routing of one sequence
/// never depends on another: the dispatched tokens `[e, b, c, h]` keep the group dim, and
/// expert parallelism (experts `S(0)` on `ep`, the batch on `ep` too) moves them from their
/// group's device to their expert's device with one all-to-all, and back after the experts.
pub(crate) fn moe_mlp<'m>(m: &'m ModelBuilder, l: &MoeLayer<'_>, x: Tensor<'m>) -> Tensor<'m> {
    let (h, f, e) = (l.hidden, l.ffn, l.moe.n_experts);
    let capacity = l.moe.capacity(l.seq);
    let router = m
        .param("router", [h, e], normal(INIT_STD))
        .role(WeightRole::Router);

    let probs = x.einsum("gsh,he->gse", router).softmax(2);
    let (combine, dispatch) = probs.moe_route(MoeRouting {
        top_k: l.moe.top_k,
        capacity,
        normalize: l.moe.normalize,
    });
    let slots = dispatch.einsum("gsec,gsh->egch", x);

    let expert_out = match l.experts {
        ExpertMlp::GeluWithBias => {
            let w1 = expert(
                m.param("w1", [e, h, f], normal(INIT_STD)),
                WeightRole::ExpertIn,
            )
            .shard(2, axis::TP);
            let b1 = expert(m.param("b1", [e, f], ZEROS), WeightRole::ExpertIn).shard(1, axis::TP);
            let w2 = expert(
                m.param("w2", [e, f, h], normal(l.out_std)),
                WeightRole::ExpertOut,
            )
            .shard(1, axis::TP);
            let b2 = expert(m.param("b2", [e, h], ZEROS), WeightRole::ExpertOut);
            let hidden = slots.einsum("egch,ehf->egcf", w1);
            let hidden = (hidden + b1.broadcast_like(hidden, [0, 3])).gelu();
            let out = hidden.einsum("egcf,efh->egch", w2);
            out + b2.broadcast_like(out, [0, 3])
        }
        ExpertMlp::SwiGlu => {
            let w1 = expert(
                m.param("w1", [e, h, f], normal(INIT_STD)),
                WeightRole::ExpertGate,
            )
            .shard(2, axis::TP);
            let w3 = expert(
                m.param("w3", [e, h, f], normal(INIT_STD)),
                WeightRole::ExpertIn,
            )
            .shard(2, axis::TP);
            let w2 = expert(
                m.param("w2", [e, f, h], normal(l.out_std)),
                WeightRole::ExpertOut,
            )
            .shard(1, axis::TP);
            let gate = slots.einsum("egch,ehf->egcf", w1).silu();
            let up = slots.einsum("egch,ehf->egcf", w3);
            (gate * up).einsum("egcf,efh->egch", w2)
        }
    };

    combine.einsum("gsec,egch->gsh", expert_out)
}

/// Parameters of one MoE MLP, matching [`moe_mlp`] (in `u128`, which no zoo size overflows).
pub(crate) fn num_parameters(moe: &MoeConfig, experts: ExpertMlp, hidden: u128, ffn: u128) -> u128 {
    let e = moe.n_experts as u128;
    let per_expert = match experts {
        ExpertMlp::GeluWithBias => 2 * hidden * ffn + ffn + hidden,
        ExpertMlp::SwiGlu => 3 * hidden * ffn,
    };
    hidden * e + e * per_expert
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_follows_the_gshard_formula() {
        let moe = MoeConfig {
            n_experts: 4,
            top_k: 2,
            capacity_factor: 1.25,
            normalize: true,
        };
        // One group of 32 tokens: 1.25 * 32 * 2 / 4 = 20.
        assert_eq!(moe.capacity(32), 20);
        assert_eq!(moe.capacity(256), 160);
        // Rounds up: 1.25 * 3 * 2 / 4 = 1.875.
        assert_eq!(moe.capacity(3), 2);
        let mixtral = MoeConfig {
            n_experts: 8,
            ..moe
        };
        assert_eq!(mixtral.capacity(4096), 1280);
    }
}
