//! The transformer description the step estimate works from, either written by hand or read
//! off an IR graph built by the model zoo (parameter shapes and `h.<i>.attn` / `h.<i>.mlp`
//! scopes).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use autopar_ir::{Graph, InputRole, LayerId, Op, WeightRole};

use crate::error::CostError;

/// A decoder-only transformer, described by the sizes that determine its cost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerConfig {
    /// Name for reports.
    pub name: String,
    /// Transformer layers.
    pub layers: usize,
    /// Hidden size `h`.
    pub hidden: usize,
    /// Query heads `a`.
    pub heads: usize,
    /// Key/value heads (equal to `heads` without grouped-query attention).
    pub kv_heads: usize,
    /// Width of one attention head where it is not `h / a` (Qwen3, Gemma, GPT-OSS): the
    /// queries are `a * head_dim` wide, the keys and values `kv * head_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// MLP inner size (per expert for MoE).
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Sequence length.
    pub seq: usize,
    /// Experts per MoE layer (1: dense MLP).
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Gated MLP (SwiGLU: three matrices) instead of two matrices around GELU.
    pub gated_mlp: bool,
    /// Input embedding and output projection share one matrix.
    pub tied_embeddings: bool,
    /// Learned absolute position embeddings (`[seq, h]`), as in GPT-2/3; otherwise rotary
    /// positions, applied to the queries and keys of every layer.
    pub learned_positions: bool,
    /// RMSNorm (Llama, Mixtral) instead of LayerNorm (GPT-3, MPT). One fused kernel either
    /// way where the stack fuses; in PyTorch eager mode RMSNorm is a chain of element-wise
    /// kernels in fp32 where LayerNorm is one kernel
    /// ([`crate::compute::EAGER_RMS_NORM`]).
    #[serde(default)]
    pub rms_norm: bool,
    /// Width of a MoE layer's shared expert, a dense MLP of the experts' kind every token
    /// passes through beside the routed ones (DeepSeekMoE, Qwen2-MoE, Llama 4); 0: none.
    pub shared_ffn: usize,
}

impl TransformerConfig {
    /// A GPT-3-style model: GELU MLP of `4h`, tied embeddings, learned positions.
    pub fn gpt(
        name: &str,
        layers: usize,
        hidden: usize,
        heads: usize,
        seq: usize,
        vocab: usize,
    ) -> Self {
        TransformerConfig {
            name: name.to_string(),
            layers,
            hidden,
            heads,
            kv_heads: heads,
            head_dim: None,
            ffn: 4 * hidden,
            vocab,
            seq,
            experts: 1,
            top_k: 1,
            gated_mlp: false,
            tied_embeddings: true,
            learned_positions: true,
            rms_norm: false,
            shared_ffn: 0,
        }
    }

    /// GPT-3 175B (Brown et al., 2020): 96 layers, h = 12288, 96 heads, seq 2048, and the
    /// 51200-entry padded vocabulary Megatron-LM uses.
    pub fn gpt3_175b() -> Self {
        Self::gpt("gpt3-175b", 96, 12288, 96, 2048, 51200)
    }

    /// Mixtral 8x7B (Jiang et al., 2024) as the model zoo builds it: 32 layers, h = 4096, 32
    /// query and 8 key/value heads, SwiGLU experts of width 14336, 8 experts with top-2
    /// routing, seq 4096, vocabulary 32000.
    pub fn mixtral_8x7b() -> Self {
        TransformerConfig {
            name: "mixtral-8x7b".into(),
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: None,
            ffn: 14336,
            vocab: 32000,
            seq: 4096,
            experts: 8,
            top_k: 2,
            gated_mlp: true,
            tied_embeddings: false,
            learned_positions: false,
            rms_norm: true,
            shared_ffn: 0,
        }
    }

    /// Head dimension: the model's own where given, else `h / a`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads.max(1))
    }

    /// Width of the queries and of the attention's output, `a d`.
    pub fn attention_width(&self) -> f64 {
        (self.heads * self.head_dim()) as f64
    }

    /// [`TransformerConfig::attention_width`] over the hidden size, `a d / h`: 1 unless the
    /// model sets a head dimension of its own. The activations that follow the hidden size
    /// scale by it.
    pub fn query_width_ratio(&self) -> f64 {
        self.attention_width() / self.hidden.max(1) as f64
    }

    /// Parameters of one layer's attention block (weights and biases).
    pub fn attention_params(&self) -> u64 {
        let (h, d) = (self.hidden as u64, self.head_dim() as u64);
        let (a, kv) = (self.heads as u64, self.kv_heads as u64);
        h * (a + 2 * kv) * d + (a + 2 * kv) * d + a * d * h + h
    }

    /// Parameters of one dense MLP of width `f` of this model's kind (weights and biases).
    fn one_mlp_params(&self, f: usize) -> u64 {
        let (h, f) = (self.hidden as u64, f as u64);
        let mats = if self.gated_mlp { 3 } else { 2 };
        mats * h * f + f * (mats - 1) + h
    }

    /// Parameters of one layer's MLP block: the dense MLP, or for MoE all the routed
    /// experts, the router and the shared expert.
    pub fn mlp_params(&self) -> u64 {
        let e = self.experts.max(1) as u64;
        if e == 1 {
            return self.one_mlp_params(self.ffn);
        }
        self.routed_expert_params() + self.router_params() + self.shared_expert_params()
    }

    /// Parameters of one layer's router, `[h, experts]` (0 for a dense MLP).
    pub fn router_params(&self) -> u64 {
        match self.experts > 1 {
            true => (self.hidden * self.experts) as u64,
            false => 0,
        }
    }

    /// Parameters of one layer's routed experts (0 for a dense MLP).
    pub fn routed_expert_params(&self) -> u64 {
        match self.experts > 1 {
            true => self.one_mlp_params(self.ffn) * self.experts as u64,
            false => 0,
        }
    }

    /// Parameters of one layer's shared expert (0 without one).
    pub fn shared_expert_params(&self) -> u64 {
        match self.experts > 1 && self.shared_ffn > 0 {
            true => self.one_mlp_params(self.shared_ffn),
            false => 0,
        }
    }

    /// Parameters of one layer's MLP block that each token computes with: the dense MLP, or
    /// `top_k` of the routed experts, the router and the shared expert.
    pub fn active_mlp_params(&self) -> f64 {
        let routed = self.routed_expert_params() as f64;
        let share = self.top_k as f64 / self.experts.max(1) as f64;
        match self.experts > 1 {
            true => routed * share + (self.mlp_params() as f64 - routed),
            false => self.mlp_params() as f64,
        }
    }

    /// Parameters of the two norms of a layer.
    pub fn norm_params(&self) -> u64 {
        4 * self.hidden as u64
    }

    /// Parameters of the embedding (and position embedding).
    pub fn embedding_params(&self) -> u64 {
        let (v, h) = (self.vocab as u64, self.hidden as u64);
        v * h
            + if self.learned_positions {
                self.seq as u64 * h
            } else {
                0
            }
    }

    /// All parameters.
    pub fn total_params(&self) -> u64 {
        let layer = self.attention_params() + self.mlp_params() + self.norm_params();
        let head = if self.tied_embeddings {
            0
        } else {
            (self.vocab * self.hidden) as u64
        };
        layer * self.layers as u64 + self.embedding_params() + head + 2 * self.hidden as u64
    }

    /// Why `tp` tensor-parallel ranks cannot split this model, or `None` when they can: the
    /// compiler splits the heads (query and key/value), the MLP width and the vocabulary (the
    /// vocab-parallel embedding and output layer) over `tp`, and refuses uneven splits, so
    /// the estimate and the search refuse them too.
    pub fn tp_split_error(&self, tp: usize) -> Option<String> {
        [
            ("heads", self.heads),
            ("key/value heads", self.kv_heads),
            ("the MLP width", self.ffn),
            ("the shared expert's width", self.shared_ffn),
            ("the vocabulary", self.vocab),
        ]
        .into_iter()
        .find(|(_, n)| !n.is_multiple_of(tp.max(1)))
        .map(|(what, n)| {
            format!("tp={tp} does not divide {what} ({n}): the compiler splits it over tp")
        })
    }

    /// Checks that the sizes are consistent.
    pub fn validate(&self) -> Result<(), CostError> {
        let bad = |m: String| Err(CostError::ModelShape(m));
        for (what, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("seq", self.seq),
            ("experts", self.experts),
            ("top_k", self.top_k),
        ] {
            if v == 0 {
                return bad(format!("`{what}` is 0"));
            }
        }
        match self.head_dim {
            Some(0) => return bad("`head_dim` is 0".to_string()),
            Some(_) => {}
            None if !self.hidden.is_multiple_of(self.heads) => {
                return bad(format!(
                    "hidden {} is not a multiple of heads {} (give the head dim)",
                    self.hidden, self.heads
                ));
            }
            None => {}
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads {} is not a multiple of kv_heads {}",
                self.heads, self.kv_heads
            ));
        }
        if self.top_k > self.experts {
            return bad(format!(
                "top_k {} exceeds experts {}",
                self.top_k, self.experts
            ));
        }
        if self.shared_ffn > 0 && self.experts <= 1 {
            return bad(format!(
                "a shared expert (width {}) needs routed experts beside it",
                self.shared_ffn
            ));
        }
        Ok(())
    }

    /// Reads the description off a graph's typed metadata ([`autopar_ir::meta`]), never its
    /// names: layers are the distinct blocks ([`LayerId::Block`]) of its parameters; attention
    /// weights are the `query[h, heads, d]` and `key[h, kv, d]` roles (the head dim `d` kept where
    /// it is not `h / heads`); the MLP width is that of
    /// an `mlp_in`/`mlp_gate` weight `[h, ffn]` (or `expert_in`/`expert_gate`
    /// `[experts, h, ffn]` for MoE, where an `mlp_in` weight is the shared expert's), gated
    /// when a gate is present; the vocabulary is the
    /// `token_embedding`'s first dim, tied unless a `head` weight exists, with learned
    /// positions when a `position_embedding` exists and RMSNorm when an `rms_norm` op is
    /// present; the sequence is the last dim of the token input. A graph without weight roles (a hand-written `.air` without `meta{role=...}`)
    /// is an error naming the role it misses.
    pub fn from_graph(g: &Graph) -> Result<Self, CostError> {
        let mut layers = BTreeSet::new();
        let (mut hidden, mut heads, mut kv_heads, mut head_dim) = (None, None, None, None);
        let (mut dense_ffn, mut expert_ffn) = (None, None);
        let (mut experts, mut gated, mut vocab, mut positions) = (1, false, None, false);
        let mut lm_head = false;
        let mut top_k = 1;
        for (v, _, ty) in g.parameters() {
            let dims = ty.dims();
            let meta = g.meta(g.value(v).producer);
            if let Some(i) = meta.layer.and_then(LayerId::block) {
                layers.insert(i);
            }
            let Some(role) = meta.role else { continue };
            match (role, dims) {
                (WeightRole::Query, [h, a, d]) => {
                    hidden = Some(*h);
                    heads = Some(*a);
                    head_dim = Some(*d);
                }
                (WeightRole::Key, [_, kv, _]) => kv_heads = Some(*kv),
                (WeightRole::MlpIn, [_, f]) => dense_ffn = Some(*f),
                (WeightRole::MlpGate, [_, f]) => {
                    dense_ffn = Some(*f);
                    gated = true;
                }
                (WeightRole::ExpertIn, [e, _, f]) => {
                    expert_ffn = Some(*f);
                    experts = *e;
                }
                (WeightRole::ExpertGate, [e, _, f]) => {
                    expert_ffn = Some(*f);
                    experts = *e;
                    gated = true;
                }
                (WeightRole::PositionEmbedding, [_, _]) => positions = true,
                (WeightRole::Head, [_, _]) => lm_head = true,
                (WeightRole::TokenEmbedding, [v, _]) => vocab = Some(*v),
                // Biases (of the same roles, other ranks), norms, values, output projections
                // and routers say nothing the description needs.
                (
                    WeightRole::Query
                    | WeightRole::Key
                    | WeightRole::Value
                    | WeightRole::AttentionOut
                    | WeightRole::MlpIn
                    | WeightRole::MlpGate
                    | WeightRole::MlpOut
                    | WeightRole::ExpertIn
                    | WeightRole::ExpertGate
                    | WeightRole::ExpertOut
                    | WeightRole::Router
                    | WeightRole::Norm
                    | WeightRole::PositionEmbedding
                    | WeightRole::Head
                    | WeightRole::TokenEmbedding
                    | WeightRole::Dense,
                    _,
                ) => {}
            }
        }
        let mut rms_norm = false;
        for n in g.nodes_in_order() {
            if let Op::RmsNorm { .. } = &g.node(n).op {
                rms_norm = true;
            }
            if let Op::MoeRoute { top_k: k, .. } = &g.node(n).op {
                top_k = *k;
            }
        }
        let seq = g.inputs().into_iter().find_map(|(_, _, op)| match op {
            Op::Input {
                ty,
                role: InputRole::Tokens { vocab: v },
                ..
            } => {
                if vocab.is_none() {
                    vocab = Some(*v);
                }
                ty.dims().last().copied()
            }
            _ => None,
        });
        let missing = |what: &str| CostError::ModelShape(format!("no {what} found"));
        let hidden =
            hidden.ok_or_else(|| missing("attention weight with role `query` [h, heads, d]"))?;
        let heads = heads.ok_or_else(|| missing("query heads"))?;
        // With routed experts, a dense MLP beside them is the shared expert.
        let (ffn, shared_ffn) = match expert_ffn {
            Some(f) => (Some(f), dense_ffn.unwrap_or(0)),
            None => (dense_ffn, 0),
        };
        let cfg = TransformerConfig {
            name: g.name().to_string(),
            layers: layers.len(),
            hidden,
            heads,
            kv_heads: kv_heads.unwrap_or(heads),
            // Only a head dim other than `h / a` is the model's own.
            head_dim: head_dim.filter(|&d| d * heads != hidden),
            ffn: ffn.ok_or_else(|| missing("MLP weight with role `mlp_in` [h, ffn]"))?,
            vocab: vocab.ok_or_else(|| missing("embedding or token input"))?,
            seq: seq.ok_or_else(|| missing("token input"))?,
            experts,
            top_k,
            gated_mlp: gated,
            tied_embeddings: !lm_head,
            learned_positions: positions,
            rms_norm,
            shared_ffn,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopar_ir::{DType, Init, TensorType};

    /// Qwen3-32B: 64 query heads of 128 over h = 5120, 32.8B parameters by its model card
    /// (without its per-head q/k norms); a hidden size the heads do not divide is valid once
    /// the head dim is given.
    #[test]
    fn a_head_dim_of_its_own() {
        let qwen3 = TransformerConfig {
            kv_heads: 8,
            head_dim: Some(128),
            ffn: 25600,
            gated_mlp: true,
            tied_embeddings: false,
            learned_positions: false,
            rms_norm: true,
            ..TransformerConfig::gpt("qwen3-32b", 64, 5120, 64, 4096, 151936)
        };
        assert_eq!(qwen3.validate(), Ok(()));
        assert!((qwen3.query_width_ratio() - 1.6).abs() < 1e-12);
        let billions = qwen3.total_params() as f64 / 1e9;
        assert!((billions - 32.76).abs() < 0.01, "{billions}");
        let plain = TransformerConfig {
            head_dim: None,
            ..qwen3.clone()
        };
        assert!(plain.attention_params() < qwen3.attention_params());
        let odd = TransformerConfig {
            hidden: 3000,
            head_dim: None,
            ..qwen3.clone()
        };
        assert!(odd.validate().is_err());
        let given = TransformerConfig {
            head_dim: Some(64),
            ..odd
        };
        assert_eq!(given.validate(), Ok(()));
        assert!(
            TransformerConfig {
                head_dim: Some(0),
                ..given
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn gpt3_has_175b_parameters() {
        let p = TransformerConfig::gpt3_175b().total_params() as f64;
        assert!((p / 1e9 - 175.0).abs() < 1.5, "{p}");
    }

    /// A parameter with a name that says nothing: only its metadata describes it.
    fn param(g: &mut Graph, layer: Option<u32>, role: WeightRole, dims: &[usize]) {
        let name = format!("p{}", g.num_nodes());
        let v = g
            .add(
                Op::Parameter {
                    name,
                    ty: TensorType::new(DType::F32, dims.to_vec()),
                    init: Init::Zeros,
                },
                &[],
            )
            .unwrap();
        let meta = autopar_ir::NodeMeta {
            layer: layer.map(LayerId::Block),
            role: Some(role),
            ..Default::default()
        };
        g.set_meta(g.value(v).producer, meta);
    }

    #[test]
    fn reads_the_weight_roles() {
        let mut g = Graph::new("tiny");
        g.add(
            Op::Input {
                name: "tokens".into(),
                ty: TensorType::new(DType::I32, [2, 32]),
                role: InputRole::Tokens { vocab: 256 },
            },
            &[],
        )
        .unwrap();
        param(&mut g, None, WeightRole::TokenEmbedding, &[256, 64]);
        param(&mut g, None, WeightRole::PositionEmbedding, &[32, 64]);
        for i in 0..3 {
            let l = Some(i);
            param(&mut g, l, WeightRole::Query, &[64, 4, 16]);
            param(&mut g, l, WeightRole::Key, &[64, 2, 16]);
            param(&mut g, l, WeightRole::AttentionOut, &[4, 16, 64]);
            param(&mut g, l, WeightRole::MlpGate, &[64, 172]);
            param(&mut g, l, WeightRole::MlpIn, &[64, 172]);
            param(&mut g, l, WeightRole::MlpOut, &[172, 64]);
        }
        let c = TransformerConfig::from_graph(&g).unwrap();
        assert_eq!(
            (
                c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq
            ),
            (3, 64, 4, 2, 172, 256, 32)
        );
        assert!(c.gated_mlp && c.learned_positions && c.tied_embeddings);
        assert_eq!(c.experts, 1);
        assert!(TransformerConfig::from_graph(&Graph::new("empty")).is_err());
    }
}
