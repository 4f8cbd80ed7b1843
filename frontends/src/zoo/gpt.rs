//! GPT (GPT-2/GPT-3 style): learned positions, pre-LN blocks, GELU MLP with biases, and an
//! output layer tied to the token embedding; optionally with mixture-of-experts MLPs.

use autopar_ir::{LayerId, Part, WeightRole, axis};

use crate::builder::{ModelBuilder, ONES, ZEROS, normal};
use crate::tensor::Tensor;
use crate::zoo::lm;
use crate::zoo::moe::{self, ExpertMlp, MoeConfig, MoeLayer};
use crate::zoo::{INIT_STD, NORM_EPS, block_id, residual_std};

/// Sizes of a GPT model. Spec keys are given in parentheses.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Transformer blocks (`layers`).
    pub n_layers: usize,
    /// Model width (`hidden`).
    pub hidden: usize,
    /// Attention heads (`heads`); the head dim is `hidden / heads`.
    pub n_heads: usize,
    /// Sequence length, also the size of the position table (`seq`).
    pub seq_len: usize,
    /// Vocabulary size (`vocab`).
    pub vocab: usize,
    /// MLP width, or each expert's width with MoE (`ffn`); `None` means `4 * hidden`.
    pub ffn: Option<usize>,
    /// Mixture-of-experts MLPs instead of dense ones.
    pub moe: Option<MoeConfig>,
}

impl GptConfig {
    /// The MLP (or expert) width.
    pub fn ffn(&self) -> usize {
        self.ffn.unwrap_or(4 * self.hidden)
    }

    /// The width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads
    }

    /// Number of trainable parameters, counted from the sizes (in `u128`: never overflows).
    pub(crate) fn num_parameters(&self) -> u128 {
        let (h, f) = (self.hidden as u128, self.ffn() as u128);
        let (v, s, l) = (
            self.vocab as u128,
            self.seq_len as u128,
            self.n_layers as u128,
        );
        // q, k, v and output projections with their biases.
        let attention = 4 * h * h + 4 * h;
        let mlp = match &self.moe {
            None => 2 * h * f + f + h,
            Some(moe) => moe::num_parameters(moe, ExpertMlp::GeluWithBias, h, f),
        };
        let norms = 2 * 2 * h;
        v * h + s * h + l * (attention + mlp + norms) + 2 * h
    }
}

/// Builds the model for `batch` sequences and returns the scalar loss.
pub(crate) fn build<'m>(m: &'m ModelBuilder, c: &GptConfig, batch: usize) -> Tensor<'m> {
    let (b, s, h, v) = (batch, c.seq_len, c.hidden, c.vocab);
    let (tokens, targets) = lm::token_inputs(m, b, s, v);
    // The token embedding is split over the vocabulary (Megatron's vocab-parallel embedding).
    let wte = m
        .param("wte", [v, h], normal(INIT_STD))
        .role(WeightRole::TokenEmbedding)
        .shard(0, axis::TP);
    let wpe = m
        .param("wpe", [s, h], normal(0.01))
        .role(WeightRole::PositionEmbedding);

    let mut x = m.layer(LayerId::Embedding, "embed", || {
        wte.gather(tokens) + wpe.broadcast_to([b, s, h], [1, 2])
    });
    for layer_idx in 0..c.n_layers {
        x = m.layer(block_id(layer_idx), format!("h.{layer_idx}"), || {
            block(m, c, x)
        });
    }
    let x = m.layer(LayerId::FinalNorm, "ln_f", || layer_norm(m, x, h));
    lm::next_token_loss(m, x, wte, targets)
}

/// One pre-LN transformer block.
fn block<'m>(m: &'m ModelBuilder, c: &GptConfig, x: Tensor<'m>) -> Tensor<'m> {
    let a = m.scope("ln1", || layer_norm(m, x, c.hidden));
    let x = x + m.scope("attn", || {
        m.part(Part::Attention, || self_attention(m, c, a))
    });
    let a = m.scope("ln2", || layer_norm(m, x, c.hidden));
    x + m.scope("mlp", || m.part(Part::Mlp, || mlp(m, c, a)))
}

/// Layer norm with its scale `g` and shift `b`, declared in the current scope.
fn layer_norm<'m>(m: &'m ModelBuilder, x: Tensor<'m>, hidden: usize) -> Tensor<'m> {
    m.part(Part::Norm, || {
        let gamma = m.param("g", [hidden], ONES).role(WeightRole::Norm);
        let beta = m.param("b", [hidden], ZEROS).role(WeightRole::Norm);
        x.layer_norm(gamma, beta, NORM_EPS)
    })
}

/// Causal multi-head self-attention, split over heads on `tp`.
fn self_attention<'m>(m: &'m ModelBuilder, c: &GptConfig, x: Tensor<'m>) -> Tensor<'m> {
    let (h, n, d) = (c.hidden, c.n_heads, c.head_dim());
    let project = |weight: &str, bias: &str, role: WeightRole| {
        let w = m
            .param(weight, [h, n, d], normal(INIT_STD))
            .role(role)
            .shard(1, axis::TP);
        let b = m.param(bias, [n, d], ZEROS).role(role).shard(0, axis::TP);
        x.einsum("bsh,hnd->bsnd", w).add_bias(b)
    };
    let (q, k, v) = (
        project("wq", "bq", WeightRole::Query),
        project("wk", "bk", WeightRole::Key),
        project("wv", "bv", WeightRole::Value),
    );
    let wo = m
        .param("wo", [n, d, h], normal(residual_std(c.n_layers)))
        .role(WeightRole::AttentionOut)
        .shard(0, axis::TP);
    let bo = m.param("bo", [h], ZEROS).role(WeightRole::AttentionOut);
    q.causal_attention(k, v, 1.0 / (d as f64).sqrt())
        .einsum("bsnd,ndh->bsh", wo)
        .add_bias(bo)
}

/// The dense GELU MLP (split Megatron-style on `tp`), or the MoE MLP.
fn mlp<'m>(m: &'m ModelBuilder, c: &GptConfig, x: Tensor<'m>) -> Tensor<'m> {
    let (h, f) = (c.hidden, c.ffn());
    let out_std = residual_std(c.n_layers);
    if let Some(moe) = &c.moe {
        let layer = MoeLayer {
            moe,
            experts: ExpertMlp::GeluWithBias,
            seq: c.seq_len,
            hidden: h,
            ffn: f,
            out_std,
        };
        return moe::moe_mlp(m, &layer, x);
    }
    moe::dense_mlp(m, ExpertMlp::GeluWithBias, h, f, out_std, x)
}
