//! The routed mixture-of-experts MLP (GShard formulation), shared by the GPT-style and the
//! Llama-style (Mixtral) models: a router, top-k dispatch into per-expert capacity slots,
//! one MLP per expert, and a gate-weighted combine; optionally a shared expert, a dense MLP
//! every token passes through beside the routed ones (DeepSeekMoE, Qwen2-MoE, Llama 4).

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
    /// Width of a shared expert: a dense MLP of the experts' kind that every token passes
    /// through, its output added to the routed experts' (`shared_ffn`; none by default).
    pub shared_ffn: Option<usize>,
}

impl MoeConfig {
    /// The defaults of a `moe:` spec before its keys are applied.
    pub(crate) fn with_defaults() -> Self {
        MoeConfig {
            n_experts: 0,
            top_k: 0,
            capacity_factor: 1.25,
            normalize: true,
            shared_ffn: None,
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

    let routed = combine.einsum("gsec,egch->gsh", expert_out);
    match l.moe.shared_ffn {
        Some(f) => {
            let shared = m.scope("shared", || dense_mlp(m, l.experts, h, f, l.out_std, x));
            routed + shared
        }
        None => routed,
    }
}

/// A dense MLP of `kind` on `x[b, s, h]`, split Megatron-style on `tp` (the first matmul on
/// its output dim, the second on its input dim): the MLP of a dense GPT or Llama, and a MoE
/// layer's shared expert, whose weights thus have the dense MLP's roles and are placed,
/// sharded and priced as a dense MLP's.
pub(crate) fn dense_mlp<'m>(
    m: &'m ModelBuilder,
    kind: ExpertMlp,
    h: usize,
    f: usize,
    out_std: f64,
    x: Tensor<'m>,
) -> Tensor<'m> {
    match kind {
        ExpertMlp::GeluWithBias => {
            let w1 = m
                .param("w1", [h, f], normal(INIT_STD))
                .role(WeightRole::MlpIn)
                .shard(1, axis::TP);
            let b1 = m
                .param("b1", [f], ZEROS)
                .role(WeightRole::MlpIn)
                .shard(0, axis::TP);
            let w2 = m
                .param("w2", [f, h], normal(out_std))
                .role(WeightRole::MlpOut)
                .shard(0, axis::TP);
            let b2 = m.param("b2", [h], ZEROS).role(WeightRole::MlpOut);
            x.einsum("bsh,hf->bsf", w1)
                .add_bias(b1)
                .gelu()
                .einsum("bsf,fh->bsh", w2)
                .add_bias(b2)
        }
        ExpertMlp::SwiGlu => {
            let w1 = m
                .param("w1", [h, f], normal(INIT_STD))
                .role(WeightRole::MlpGate)
                .shard(1, axis::TP);
            let w3 = m
                .param("w3", [h, f], normal(INIT_STD))
                .role(WeightRole::MlpIn)
                .shard(1, axis::TP);
            let w2 = m
                .param("w2", [f, h], normal(out_std))
                .role(WeightRole::MlpOut)
                .shard(0, axis::TP);
            let gate = x.einsum("bsh,hf->bsf", w1).silu();
            let up = x.einsum("bsh,hf->bsf", w3);
            (gate * up).einsum("bsf,fh->bsh", w2)
        }
    }
}

/// Parameters of one MoE MLP, matching [`moe_mlp`] (in `u128`, which no zoo size overflows).
pub(crate) fn num_parameters(moe: &MoeConfig, experts: ExpertMlp, hidden: u128, ffn: u128) -> u128 {
    let e = moe.n_experts as u128;
    let mlp = |ffn: u128| match experts {
        ExpertMlp::GeluWithBias => 2 * hidden * ffn + ffn + hidden,
        ExpertMlp::SwiGlu => 3 * hidden * ffn,
    };
    let shared = moe.shared_ffn.map_or(0, |f| mlp(f as u128));
    hidden * e + e * mlp(ffn) + shared
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
            shared_ffn: None,
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
