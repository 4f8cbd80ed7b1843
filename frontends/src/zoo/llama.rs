//! Llama (Llama-3 style): RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no
//! biases and an untied output layer; with MoE MLPs it is Mixtral.

use autopar_ir::{LayerId, Part, WeightRole, axis};

use crate::builder::{ModelBuilder, ONES, normal};
use crate::tensor::Tensor;
use crate::zoo::lm;
use crate::zoo::moe::{self, ExpertMlp, MoeConfig, MoeLayer};
use crate::zoo::{INIT_STD, NORM_EPS, block_id, residual_std};

/// Sizes of a Llama model. Spec keys are given in parentheses.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks (`layers`).
    pub n_layers: usize,
    /// Model width (`hidden`).
    pub hidden: usize,
    /// Query heads (`heads`).
    pub n_heads: usize,
    /// Key/value heads (`kv_heads`), dividing `heads`; fewer than `heads` is GQA.
    pub n_kv_heads: usize,
    /// Width of one attention head (`head_dim`), where it is not `hidden / heads`: Qwen3,
    /// Gemma and GPT-OSS project the hidden state to `heads * head_dim` queries of another
    /// width than the model's.
    pub head_dim: Option<usize>,
    /// SwiGLU width, or each expert's width with MoE (`ffn`).
    pub ffn: usize,
    /// Sequence length (`seq`).
    pub seq_len: usize,
    /// Vocabulary size (`vocab`).
    pub vocab: usize,
    /// Rotary frequency base (`rope_base`).
    pub rope_base: f64,
    /// Mixture-of-experts MLPs instead of dense ones.
    pub moe: Option<MoeConfig>,
}

impl LlamaConfig {
    /// The width of one attention head: `head_dim` where given, else `hidden / heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.n_heads.max(1))
    }

    /// Number of trainable parameters, counted from the sizes (in `u128`: never overflows).
    pub(crate) fn num_parameters(&self) -> u128 {
        let (h, f, v, l) = (
            self.hidden as u128,
            self.ffn as u128,
            self.vocab as u128,
            self.n_layers as u128,
        );
        let (n, kv, d) = (
            self.n_heads as u128,
            self.n_kv_heads as u128,
            self.head_dim() as u128,
        );
        let attention = h * n * d + 2 * h * kv * d + n * d * h;
        let mlp = match &self.moe {
            None => 3 * h * f,
            Some(moe) => moe::num_parameters(moe, ExpertMlp::SwiGlu, h, f),
        };
        let norms = 2 * h;
        // Untied input and output embeddings, and the final norm.
        2 * v * h + l * (attention + mlp + norms) + h
    }
}

/// Builds the model for `batch` sequences and returns the scalar loss.
pub(crate) fn build<'m>(m: &'m ModelBuilder, c: &LlamaConfig, batch: usize) -> Tensor<'m> {
    let (b, s, h, v) = (batch, c.seq_len, c.hidden, c.vocab);
    let (tokens, targets) = lm::token_inputs(m, b, s, v);
    let tok_embeddings = m
        .param("tok_embeddings", [v, h], normal(INIT_STD))
        .role(WeightRole::TokenEmbedding)
        .shard(0, axis::TP);
    let lm_head = m
        .param("lm_head", [v, h], normal(INIT_STD))
        .role(WeightRole::Head)
        .shard(0, axis::TP);

    let mut x = m.layer(LayerId::Embedding, "embed", || {
        tok_embeddings.gather(tokens)
    });
    for layer_idx in 0..c.n_layers {
        x = m.layer(block_id(layer_idx), format!("h.{layer_idx}"), || {
            block(m, c, x)
        });
    }
    let x = m.layer(LayerId::FinalNorm, "norm_f", || rms_norm(m, x, h));
    lm::next_token_loss(m, x, lm_head, targets)
}

/// One pre-norm transformer block.
fn block<'m>(m: &'m ModelBuilder, c: &LlamaConfig, x: Tensor<'m>) -> Tensor<'m> {
    let a = m.scope("attn_norm", || rms_norm(m, x, c.hidden));
    let x = x + m.scope("attn", || {
        m.part(Part::Attention, || self_attention(m, c, a))
    });
    let a = m.scope("mlp_norm", || rms_norm(m, x, c.hidden));
    x + m.scope("mlp", || m.part(Part::Mlp, || mlp(m, c, a)))
}

/// RMS norm with its scale `g`, declared in the current scope.
fn rms_norm<'m>(m: &'m ModelBuilder, x: Tensor<'m>, hidden: usize) -> Tensor<'m> {
    m.part(Part::Norm, || {
        let gamma = m.param("g", [hidden], ONES).role(WeightRole::Norm);
        x.rms_norm(gamma, NORM_EPS)
    })
}

/// Causal grouped-query self-attention with rotary positions, split over heads on `tp`.
fn self_attention<'m>(m: &'m ModelBuilder, c: &LlamaConfig, x: Tensor<'m>) -> Tensor<'m> {
    let (h, n, kv, d) = (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim());
    let project = |name: &str, heads: usize, role: WeightRole| {
        m.param(name, [h, heads, d], normal(INIT_STD))
            .role(role)
            .shard(1, axis::TP)
    };
    let wq = project("wq", n, WeightRole::Query);
    let wk = project("wk", kv, WeightRole::Key);
    let wv = project("wv", kv, WeightRole::Value);
    let wo = m
        .param("wo", [n, d, h], normal(residual_std(c.n_layers)))
        .role(WeightRole::AttentionOut)
        .shard(0, axis::TP);
    let q = x.einsum("bsh,hnd->bsnd", wq).rotary(c.rope_base);
    let k = x.einsum("bsh,hnd->bsnd", wk).rotary(c.rope_base);
    let v = x.einsum("bsh,hnd->bsnd", wv);
    q.causal_attention(k, v, 1.0 / (d as f64).sqrt())
        .einsum("bsnd,ndh->bsh", wo)
}

/// The dense SwiGLU MLP (split Megatron-style on `tp`), or the Mixtral MoE MLP.
fn mlp<'m>(m: &'m ModelBuilder, c: &LlamaConfig, x: Tensor<'m>) -> Tensor<'m> {
    let (h, f) = (c.hidden, c.ffn);
    let out_std = residual_std(c.n_layers);
    if let Some(moe) = &c.moe {
        let layer = MoeLayer {
            moe,
            experts: ExpertMlp::SwiGlu,
            seq: c.seq_len,
            hidden: h,
            ffn: f,
            out_std,
        };
        return moe::moe_mlp(m, &layer, x);
    }
    moe::dense_mlp(m, ExpertMlp::SwiGlu, h, f, out_std, x)
}
