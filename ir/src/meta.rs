//! Model structure as typed metadata: for every node its [`Phase`], micro-batch, [`LayerId`]
//! and the [`Part`] of a block it belongs to, and for every parameter its [`WeightRole`], kept by [`Graph`](crate::Graph)
//! in a side table of [`NodeMeta`] keyed by node id.
//!
//! Frontends write the layer and weight roles of what they build, the training-step builder
//! writes phases and micro-batches, and every pass that copies or creates nodes keeps them
//! (see [`Graph::copy_node`](crate::Graph::copy_node)). Passes read model structure from here
//! and never from a parameter name or a node's scope string, which stay human-readable
//! provenance only. A node without metadata has every field `None`.
//!
//! Text spellings (the `meta{...}` attribute of the `.air` format and the strings of the
//! JSON schema) are the [`Display`](std::fmt::Display) forms below, which [`FromStr`] reads
//! back.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// When, in a training step, a node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The model's forward (also every node of a forward-only graph).
    Forward,
    /// Forward values the backward reads, computed in the forward for it (attention's
    /// log-sum-exp): scheduled early, and the first thing recomputation replaces.
    Saved,
    /// The backward: gradients of the loss.
    Backward,
    /// A forward node copied into the backward by activation recomputation.
    Recompute,
    /// Gradient accumulation over micro-batches, and the mean of their losses.
    Accumulate,
    /// The optimizer update, loss scaling and gradient clipping.
    Optimizer,
}

/// Which entry of the model's layer sequence (embedding, blocks, final norm, head, loss) a
/// node belongs to. The order of the variants is model order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerId {
    /// The token (and position) embedding, or the input layer of a model without embeddings.
    Embedding,
    /// Block `i` of the repeated layers (a transformer block).
    Block(u32),
    /// The norm after the last block.
    FinalNorm,
    /// The output projection onto the vocabulary, or the output layer of another model.
    Head,
    /// The loss.
    Loss,
}

impl LayerId {
    /// The block index of [`LayerId::Block`].
    pub fn block(self) -> Option<u32> {
        match self {
            LayerId::Block(i) => Some(i),
            LayerId::Embedding | LayerId::FinalNorm | LayerId::Head | LayerId::Loss => None,
        }
    }
}

/// Which part of a layer a node belongs to: its norm, its attention or its MLP (the
/// sub-blocks whose backward some placements treat apart, e.g. sequence parallelism runs the
/// norms' backward on the sequence shards).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// A layer norm or RMS norm (in a block, or the final norm).
    Norm,
    /// Self-attention: Q/K/V, the core and the output projection.
    Attention,
    /// The MLP, dense or a mixture of experts.
    Mlp,
}

impl Part {
    /// Every part, in declaration order.
    pub const ALL: [Part; 3] = [Part::Norm, Part::Attention, Part::Mlp];

    /// The text spelling (`norm`, `attention`, `mlp`).
    pub fn name(self) -> &'static str {
        match self {
            Part::Norm => "norm",
            Part::Attention => "attention",
            Part::Mlp => "mlp",
        }
    }
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Part {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Part::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown part `{s}` (expected one of {})",
                    list(Part::ALL.map(Part::name))
                )
            })
    }
}

/// What a parameter is to the model. Biases share the role of their weight; norm scales and
/// shifts are both [`WeightRole::Norm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightRole {
    /// The token embedding `[vocab, hidden]` (also the head when tied).
    TokenEmbedding,
    /// Learned positions `[seq, hidden]`.
    PositionEmbedding,
    /// A norm's scale or shift.
    Norm,
    /// The query projection `[hidden, heads, head_dim]` (and its bias).
    Query,
    /// The key projection `[hidden, kv_heads, head_dim]`.
    Key,
    /// The value projection.
    Value,
    /// Attention's output projection `[heads, head_dim, hidden]`.
    AttentionOut,
    /// The MLP's input (up) projection `[hidden, ffn]`.
    MlpIn,
    /// The gate of a gated (SwiGLU) MLP, `[hidden, ffn]`.
    MlpGate,
    /// The MLP's output (down) projection `[ffn, hidden]`.
    MlpOut,
    /// The router of a mixture of experts `[hidden, experts]`.
    Router,
    /// The experts' input projection `[experts, hidden, ffn]`.
    ExpertIn,
    /// The experts' gate (gated experts).
    ExpertGate,
    /// The experts' output projection `[experts, ffn, hidden]`.
    ExpertOut,
    /// An untied output projection `[vocab, hidden]`.
    Head,
    /// A dense weight of a model that is no transformer (the zoo's MLP regressor).
    Dense,
}

impl WeightRole {
    /// Every role, in declaration order.
    pub const ALL: [WeightRole; 16] = [
        WeightRole::TokenEmbedding,
        WeightRole::PositionEmbedding,
        WeightRole::Norm,
        WeightRole::Query,
        WeightRole::Key,
        WeightRole::Value,
        WeightRole::AttentionOut,
        WeightRole::MlpIn,
        WeightRole::MlpGate,
        WeightRole::MlpOut,
        WeightRole::Router,
        WeightRole::ExpertIn,
        WeightRole::ExpertGate,
        WeightRole::ExpertOut,
        WeightRole::Head,
        WeightRole::Dense,
    ];

    /// The text spelling (`query`, `mlp_in`, ...).
    pub fn name(self) -> &'static str {
        match self {
            WeightRole::TokenEmbedding => "token_embedding",
            WeightRole::PositionEmbedding => "position_embedding",
            WeightRole::Norm => "norm",
            WeightRole::Query => "query",
            WeightRole::Key => "key",
            WeightRole::Value => "value",
            WeightRole::AttentionOut => "attention_out",
            WeightRole::MlpIn => "mlp_in",
            WeightRole::MlpGate => "mlp_gate",
            WeightRole::MlpOut => "mlp_out",
            WeightRole::Router => "router",
            WeightRole::ExpertIn => "expert_in",
            WeightRole::ExpertGate => "expert_gate",
            WeightRole::ExpertOut => "expert_out",
            WeightRole::Head => "head",
            WeightRole::Dense => "dense",
        }
    }
}

impl Phase {
    /// Every phase, in declaration order.
    pub const ALL: [Phase; 6] = [
        Phase::Forward,
        Phase::Saved,
        Phase::Backward,
        Phase::Recompute,
        Phase::Accumulate,
        Phase::Optimizer,
    ];

    /// The text spelling (`forward`, `backward`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Saved => "saved",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::Accumulate => "accumulate",
            Phase::Optimizer => "optimizer",
        }
    }

    /// Whether the node runs as part of the model's forward (its own forward or the values
    /// saved for the backward), rather than after it.
    pub fn is_forward(self) -> bool {
        match self {
            Phase::Forward | Phase::Saved => true,
            Phase::Backward | Phase::Recompute | Phase::Accumulate | Phase::Optimizer => false,
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for WeightRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `embedding`, `block(3)`, `final_norm`, `head`, `loss`.
impl fmt::Display for LayerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerId::Embedding => f.write_str("embedding"),
            LayerId::Block(i) => write!(f, "block({i})"),
            LayerId::FinalNorm => f.write_str("final_norm"),
            LayerId::Head => f.write_str("head"),
            LayerId::Loss => f.write_str("loss"),
        }
    }
}

impl FromStr for Phase {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Phase::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown phase `{s}` (expected one of {})",
                    list(Phase::ALL.map(Phase::name))
                )
            })
    }
}

impl FromStr for WeightRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WeightRole::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown weight role `{s}` (expected one of {})",
                    list(WeightRole::ALL.map(WeightRole::name))
                )
            })
    }
}

impl FromStr for LayerId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "embedding" => Ok(LayerId::Embedding),
            "final_norm" => Ok(LayerId::FinalNorm),
            "head" => Ok(LayerId::Head),
            "loss" => Ok(LayerId::Loss),
            _ => s
                .strip_prefix("block(")
                .and_then(|r| r.strip_suffix(')'))
                .and_then(|i| i.parse::<u32>().ok())
                .map(LayerId::Block)
                .ok_or_else(|| {
                    format!(
                        "unknown layer `{s}` (expected `embedding`, `block(N)`, `final_norm`, \
                         `head` or `loss`)"
                    )
                }),
        }
    }
}

fn list<const N: usize>(names: [&str; N]) -> String {
    names.map(|n| format!("`{n}`")).join(", ")
}

/// The typed metadata of one node; every field is optional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeMeta {
    /// When the node runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The micro-batch it belongs to (steps unrolled over micro-batches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
    /// The entry of the layer sequence it belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<LayerId>,
    /// The part of the layer it belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<Part>,
    /// For a parameter: what the weight is to the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<WeightRole>,
}

impl NodeMeta {
    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        *self == NodeMeta::default()
    }

    /// The same metadata with `phase`.
    pub fn with_phase(self, phase: Phase) -> Self {
        NodeMeta {
            phase: Some(phase),
            ..self
        }
    }

    /// The same metadata with no weight role (for a node computed from a parameter).
    pub fn without_role(self) -> Self {
        NodeMeta { role: None, ..self }
    }
}

/// `phase=backward, mb=1, layer=block(3), part=attention, role=query`: the set fields, in that
/// order (the inside of the text format's `meta{...}`).
impl fmt::Display for NodeMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(p) = self.phase {
            parts.push(format!("phase={p}"));
        }
        if let Some(k) = self.micro_batch {
            parts.push(format!("mb={k}"));
        }
        if let Some(l) = self.layer {
            parts.push(format!("layer={l}"));
        }
        if let Some(p) = self.part {
            parts.push(format!("part={p}"));
        }
        if let Some(r) = self.role {
            parts.push(format!("role={r}"));
        }
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_read_back() {
        for p in Phase::ALL {
            assert_eq!(p.to_string().parse::<Phase>(), Ok(p));
        }
        for p in Part::ALL {
            assert_eq!(p.to_string().parse::<Part>(), Ok(p));
        }
        for r in WeightRole::ALL {
            assert_eq!(r.to_string().parse::<WeightRole>(), Ok(r));
        }
        for l in [
            LayerId::Embedding,
            LayerId::Block(0),
            LayerId::Block(17),
            LayerId::FinalNorm,
            LayerId::Head,
            LayerId::Loss,
        ] {
            assert_eq!(l.to_string().parse::<LayerId>(), Ok(l));
        }
        assert!("block(x)".parse::<LayerId>().is_err());
        assert!(LayerId::Embedding < LayerId::Block(0) && LayerId::Block(9) < LayerId::Loss);
        let m = NodeMeta {
            phase: Some(Phase::Backward),
            micro_batch: Some(1),
            layer: Some(LayerId::Block(3)),
            part: None,
            role: None,
        };
        assert_eq!(m.to_string(), "phase=backward, mb=1, layer=block(3)");
    }
}
