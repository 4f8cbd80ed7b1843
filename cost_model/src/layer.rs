//! Intra-op placements of one transformer layer over the tensor-parallel ranks.
//!
//! Five ops carry a layer's work: the QKV projection, the attention core, the output
//! projection, and the MLP's input and output GEMMs. Each is either split Megatron-style over
//! `tp` ([`OpPlacement::Tensor`]: column-parallel, by heads, row-parallel) or run on the
//! ranks' shards of the sequence ([`OpPlacement::Sequence`]: the weights replicated over `tp`,
//! the attention core on its local queries against all keys, the sequence then laid out in a
//! load-balanced order so that causal attention is spread evenly). The norms and residual adds
//! between them run on the residual stream, sequence-sharded with sequence parallelism and
//! replicated without.
//!
//! An op on sequence shards holds its weights whole but not their optimizer state: the
//! gradients, partial sums over `tp`, are reduce-scattered, each rank updates its `1/tp` of
//! the state and the updated weights are all-gathered (ZeRO over `tp`, as DeepSpeed-Ulysses
//! shards over its sequence-parallel ranks), which moves what one all-reduce moves.
//!
//! Every combination is a valid program: where one op leaves an activation in another
//! layout than the next op reads, a collective converts it ([`tp_collectives`] lists them,
//! forward and backward). Megatron-LM's placement is all-`Tensor`; with sequence parallelism,
//! `attn=sts` is DeepSpeed-Ulysses' attention (projections on sequence shards, an all-to-all
//! to heads for the core and back), `attn=sss` gathers keys and values as Llama 3's
//! all-gather context parallelism does, and `mlp=ss` runs the MLP whole on each sequence
//! shard. Which is fastest depends on the shapes, the links of `tp` and the memory left.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::comm::Collective;
use crate::model::TransformerConfig;

/// The five placed ops of a layer, in execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerOp {
    /// The Q, K and V projections (with their biases).
    Qkv,
    /// The attention core (scores, softmax, weighted sum).
    Attention,
    /// The output projection.
    Proj,
    /// The MLP's input GEMM(s) (up and gate), with the activation.
    MlpIn,
    /// The MLP's output GEMM.
    MlpOut,
}

impl LayerOp {
    /// All five, in execution order.
    pub const ALL: [LayerOp; 5] = [
        LayerOp::Qkv,
        LayerOp::Attention,
        LayerOp::Proj,
        LayerOp::MlpIn,
        LayerOp::MlpOut,
    ];

    /// Name in messages.
    pub fn name(self) -> &'static str {
        match self {
            LayerOp::Qkv => "the QKV projection",
            LayerOp::Attention => "the attention core",
            LayerOp::Proj => "the output projection",
            LayerOp::MlpIn => "the MLP's input GEMM",
            LayerOp::MlpOut => "the MLP's output GEMM",
        }
    }

    /// Whether the op belongs to the attention block.
    pub fn in_attention(self) -> bool {
        matches!(self, LayerOp::Qkv | LayerOp::Attention | LayerOp::Proj)
    }
}

/// Where one op runs over the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpPlacement {
    /// Megatron-LM's split: GEMM weights by output (QKV, MLP in) or input (projection, MLP
    /// out) features, the attention core by heads.
    Tensor,
    /// On the rank's sequence shard: GEMM weights replicated over `tp` (their gradients summed
    /// over it), the attention core on the local queries with every key and value gathered.
    Sequence,
}

impl OpPlacement {
    fn letter(self) -> char {
        match self {
            OpPlacement::Tensor => 't',
            OpPlacement::Sequence => 's',
        }
    }

    fn from_letter(c: char) -> Option<Self> {
        match c {
            't' => Some(OpPlacement::Tensor),
            's' => Some(OpPlacement::Sequence),
            _ => None,
        }
    }
}

/// The placement of every op of a layer; every layer of a plan takes the same one.
///
/// Written as two codes, one letter per op (`t` tensor, `s` sequence): `attn=` for the QKV
/// projection, the core and the output projection, `mlp=` for the MLP's input and output
/// GEMMs. `attn=tp` and `mlp=tp` are all-`t`, `attn=seq` and `mlp=seq` all-`s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerPlacement {
    /// The QKV projection.
    pub qkv: OpPlacement,
    /// The attention core.
    pub attention: OpPlacement,
    /// The output projection.
    pub proj: OpPlacement,
    /// The MLP's input GEMM(s).
    pub mlp_in: OpPlacement,
    /// The MLP's output GEMM.
    pub mlp_out: OpPlacement,
}

impl Default for LayerPlacement {
    fn default() -> Self {
        LayerPlacement::MEGATRON
    }
}

impl LayerPlacement {
    /// Megatron-LM's placement: every op split over `tp`.
    pub const MEGATRON: LayerPlacement = LayerPlacement {
        qkv: OpPlacement::Tensor,
        attention: OpPlacement::Tensor,
        proj: OpPlacement::Tensor,
        mlp_in: OpPlacement::Tensor,
        mlp_out: OpPlacement::Tensor,
    };

    /// The placement of `op`.
    pub fn get(&self, op: LayerOp) -> OpPlacement {
        match op {
            LayerOp::Qkv => self.qkv,
            LayerOp::Attention => self.attention,
            LayerOp::Proj => self.proj,
            LayerOp::MlpIn => self.mlp_in,
            LayerOp::MlpOut => self.mlp_out,
        }
    }

    /// Sets the placement of `op`.
    pub fn set(&mut self, op: LayerOp, p: OpPlacement) {
        match op {
            LayerOp::Qkv => self.qkv = p,
            LayerOp::Attention => self.attention = p,
            LayerOp::Proj => self.proj = p,
            LayerOp::MlpIn => self.mlp_in = p,
            LayerOp::MlpOut => self.mlp_out = p,
        }
    }

    /// All 32 placements, Megatron's first, in a fixed order.
    pub fn all() -> Vec<LayerPlacement> {
        (0..32u32)
            .map(|bits| {
                let mut p = LayerPlacement::MEGATRON;
                for (i, op) in LayerOp::ALL.into_iter().enumerate() {
                    if bits & (1 << (4 - i)) != 0 {
                        p.set(op, OpPlacement::Sequence);
                    }
                }
                p
            })
            .collect()
    }

    /// Whether this is Megatron-LM's placement.
    pub fn is_megatron(&self) -> bool {
        *self == LayerPlacement::MEGATRON
    }

    /// The ops run on sequence shards.
    pub fn sequence_ops(&self) -> impl Iterator<Item = LayerOp> + '_ {
        LayerOp::ALL
            .into_iter()
            .filter(|&op| self.get(op) == OpPlacement::Sequence)
    }

    /// The attention code (`ttt`, `sts`, ...).
    pub fn attention_code(&self) -> String {
        [self.qkv, self.attention, self.proj]
            .iter()
            .map(|p| p.letter())
            .collect()
    }

    /// The MLP code (`tt`, `ss`, ...).
    pub fn mlp_code(&self) -> String {
        [self.mlp_in, self.mlp_out]
            .iter()
            .map(|p| p.letter())
            .collect()
    }

    /// Why this placement cannot lay out the layers of `cfg` over `tp` tensor-parallel and
    /// `cp` context-parallel ranks, or `None` when it can: a mixture of experts keeps its MLP
    /// split over `tp` (expert parallelism places the experts); the attention core on query
    /// shards does not combine with context parallelism's ring; ops on sequence shards need
    /// `tp` to divide a context rank's sequence.
    pub fn unsupported(&self, cfg: &TransformerConfig, tp: usize, cp: usize) -> Option<String> {
        if cfg.experts > 1 && self.mlp_code() != "tt" {
            return Some(format!(
                "mlp={} runs MLP GEMMs on sequence shards with replicated weights; `{}` has {} \
                 experts, which expert parallelism places",
                self.mlp_code(),
                cfg.name,
                cfg.experts
            ));
        }
        if cp > 1 && self.attention == OpPlacement::Sequence {
            return Some(format!(
                "attn={} splits the attention core's queries over tp, which context \
                 parallelism's ring attention does not combine with (cp={cp})",
                self.attention_code(),
            ));
        }
        if self.sequence_ops().next().is_some() && !(cfg.seq / cp).is_multiple_of(tp) {
            return Some(format!(
                "{self} runs ops on sequence shards: tp={tp} must divide the sequence {} (over \
                 cp={cp})",
                cfg.seq
            ));
        }
        None
    }

    /// Sets the attention ops from `tp`, `seq`, `ulysses` or a three-letter code.
    pub fn set_attention(&mut self, v: &str) -> Result<(), String> {
        let [a, b, c] = parse_code::<3>(v, &[("tp", "ttt"), ("seq", "sss"), ("ulysses", "sts")])?;
        (self.qkv, self.attention, self.proj) = (a, b, c);
        Ok(())
    }

    /// Sets the MLP ops from `tp`, `seq` or a two-letter code.
    pub fn set_mlp(&mut self, v: &str) -> Result<(), String> {
        let [a, b] = parse_code::<2>(v, &[("tp", "tt"), ("seq", "ss")])?;
        (self.mlp_in, self.mlp_out) = (a, b);
        Ok(())
    }
}

fn parse_code<const N: usize>(
    v: &str,
    aliases: &[(&str, &str)],
) -> Result<[OpPlacement; N], String> {
    let code = aliases
        .iter()
        .find(|(name, _)| *name == v)
        .map_or(v, |(_, code)| code);
    let letters: Vec<OpPlacement> = code.chars().filter_map(OpPlacement::from_letter).collect();
    if code.chars().count() != N || letters.len() != N {
        let names: Vec<&str> = aliases.iter().map(|(n, _)| *n).collect();
        return Err(format!(
            "expected {} or {N} letters t (split over tp) / s (on sequence shards), not `{v}`",
            names.join(", ")
        ));
    }
    let mut out = [OpPlacement::Tensor; N];
    out.copy_from_slice(&letters);
    Ok(out)
}

impl fmt::Display for LayerPlacement {
    /// `attn=ttt,mlp=tt` form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "attn={},mlp={}", self.attention_code(), self.mlp_code())
    }
}

/// The layout of an activation over the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Whole on every rank.
    Replicated,
    /// Split on the sequence (tokens).
    Sequence,
    /// Split on features: heads, or the MLP's width.
    Feature,
    /// Partial sums (after a row-parallel GEMM).
    Partial,
}

/// Which activation a collective moves, as a width per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Width {
    /// The hidden size `h` (the residual stream, a GEMM's input).
    Hidden,
    /// Queries, keys and values: `(a + 2 kv) d`.
    Qkv,
    /// Queries alone: `a d`.
    Query,
    /// Keys and values: `2 kv d`.
    KeyValue,
    /// The attention output: `a d`.
    AttentionOut,
    /// The MLP's activation output (the output GEMM's input): `f`.
    Ffn,
}

/// Forward or backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
}

/// What a collective can hide under in the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Nothing: it is on the critical path.
    None,
    /// The input-gradient GEMM of an op.
    Dgrad(LayerOp),
    /// The weight-gradient GEMM of an op.
    Wgrad(LayerOp),
    /// The forward GEMM of the op that consumes or produces the collective's data,
    /// pipelined with it chunk by chunk of tokens: only where the software splits GEMMs to
    /// overlap their collectives (Transformer Engine's userbuffers under Megatron-Core's
    /// `--tp-comm-overlap`: a ring-exchange all-gather feeding the QKV and MLP-in GEMMs, a
    /// pipelined reduce-scatter after the projection and MLP-out GEMMs); on the critical
    /// path otherwise.
    PipelinedFprop(LayerOp),
    /// The input-gradient GEMM of an op, pipelined as [`Overlap::PipelinedFprop`] is (the
    /// ring-exchange all-gather of a row-parallel layer's output gradient).
    PipelinedDgrad(LayerOp),
}

/// One collective over `tp` of one layer's forward or backward, per micro-batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpCollective {
    /// Forward or backward.
    pub pass: Pass,
    /// Its kind.
    pub kind: Collective,
    /// What it moves: every token of the micro-batch (of this context-parallel rank) at this
    /// width, before the split over `tp`.
    pub width: Width,
    /// Where it can hide.
    pub overlap: Overlap,
    /// Why the placement needs it.
    pub why: String,
}

/// The tensor-parallel collectives of one layer under `p`, with (`sp`) or without sequence
/// parallelism, in execution order per pass: what turns each op's output layout into the
/// layout the next op reads, and their conjugates in the backward.
///
/// With `tp = 1` nothing is communicated; the caller skips the list.
pub fn tp_collectives(p: &LayerPlacement, sp: bool) -> Vec<TpCollective> {
    collectives(p, sp, true)
}

/// [`tp_collectives`] without their reasons (`why` left empty), for pricing in hot loops.
pub(crate) fn tp_collectives_unexplained(p: &LayerPlacement, sp: bool) -> Vec<TpCollective> {
    collectives(p, sp, false)
}

/// How many of [`tp_collectives`]'s entries belong to the attention block (they come
/// first; the MLP block's follow).
pub(crate) fn attention_block_collectives(p: &LayerPlacement, sp: bool) -> usize {
    collectives_of(p, sp, false, true).len()
}

fn collectives(p: &LayerPlacement, sp: bool, reasons: bool) -> Vec<TpCollective> {
    collectives_of(p, sp, reasons, false)
}

fn collectives_of(
    p: &LayerPlacement,
    sp: bool,
    reasons: bool,
    stop_after_attention: bool,
) -> Vec<TpCollective> {
    let residual = if sp {
        Layout::Sequence
    } else {
        Layout::Replicated
    };
    let mut b = Collectives {
        out: Vec::new(),
        residual,
        reasons,
    };
    // Attention block.
    let qkv_out = b.read_residual(LayerOp::Qkv, p.qkv);
    let core_out = b.attention_core(qkv_out, p.attention);
    let proj_out = b.feature_gemm(LayerOp::Proj, core_out, p.proj, Width::AttentionOut);
    b.write_residual(LayerOp::Proj, proj_out);
    if stop_after_attention {
        return b.out;
    }
    // MLP block.
    let mid = b.read_residual(LayerOp::MlpIn, p.mlp_in);
    let mlp_out = b.feature_gemm(LayerOp::MlpOut, mid, p.mlp_out, Width::Ffn);
    b.write_residual(LayerOp::MlpOut, mlp_out);
    b.out
}

/// Builds [`tp_collectives`], op by op.
struct Collectives {
    out: Vec<TpCollective>,
    residual: Layout,
    /// Whether to write each collective's reason.
    reasons: bool,
}

impl Collectives {
    /// Adds a collective; its reason is written only when the list is for people.
    fn push(
        &mut self,
        pass: Pass,
        kind: Collective,
        width: Width,
        overlap: Overlap,
        why: impl FnOnce() -> String,
    ) {
        let why = if self.reasons { why() } else { String::new() };
        self.out.push(TpCollective {
            pass,
            kind,
            width,
            overlap,
            why,
        });
    }

    /// An op that reads the residual stream (QKV, MLP in); returns its output's layout.
    fn read_residual(&mut self, op: LayerOp, placement: OpPlacement) -> Layout {
        use Collective::{AllGather, AllReduce, ReduceScatter};
        let (fwd, bwd) = (Pass::Forward, Pass::Backward);
        let name = op.name();
        match (self.residual, placement) {
            (Layout::Sequence, OpPlacement::Tensor) => {
                // Megatron-SP: gather the sequence shards and keep only the shard for the
                // backward, which re-gathers it for the weight gradient and reduce-scatters
                // the input's gradient.
                let why = || format!("{name} (split by features) reads every token");
                self.push(
                    fwd,
                    AllGather,
                    Width::Hidden,
                    Overlap::PipelinedFprop(op),
                    why,
                );
                let why = || format!("{name} re-gathers its input for the weight gradient");
                self.push(bwd, AllGather, Width::Hidden, Overlap::Dgrad(op), why);
                let why = || {
                    format!(
                        "{name}'s input gradient is a partial sum, reduced onto the sequence shards"
                    )
                };
                self.push(bwd, ReduceScatter, Width::Hidden, Overlap::Wgrad(op), why);
            }
            // Megatron's `f`: identity forward, all-reduce of the input's gradient.
            (_, OpPlacement::Tensor) => {
                let why = || format!("{name}'s input gradient is a partial sum over tp");
                self.push(bwd, AllReduce, Width::Hidden, Overlap::Wgrad(op), why)
            }
            (Layout::Sequence, OpPlacement::Sequence) => {}
            // Slicing the replicated stream is free; the slices' gradients are gathered back
            // into the replicated stream's.
            (_, OpPlacement::Sequence) => {
                let why = || {
                    format!(
                        "{name} ran on a slice of the replicated stream; its input gradient is \
                     gathered back"
                    )
                };
                self.push(bwd, AllGather, Width::Hidden, Overlap::None, why)
            }
        }
        match placement {
            OpPlacement::Tensor => Layout::Feature,
            OpPlacement::Sequence => Layout::Sequence,
        }
    }

    /// The attention core: by heads from heads, on the local queries from sequence shards.
    fn attention_core(&mut self, from: Layout, placement: OpPlacement) -> Layout {
        use Collective::{AllGather, AllToAll, ReduceScatter};
        let (fwd, bwd) = (Pass::Forward, Pass::Backward);
        let none = Overlap::None;
        match (from, placement) {
            (Layout::Feature, OpPlacement::Tensor) => {}
            (_, OpPlacement::Tensor) => {
                // Ulysses: sequence shards to heads.
                let why = "the core splits by heads: q, k, v move from sequence shards to heads";
                self.push(fwd, AllToAll, Width::Qkv, none, || why.into());
                let why = "the q, k, v gradients move back from heads to sequence shards";
                self.push(bwd, AllToAll, Width::Qkv, none, || why.into());
            }
            (from, OpPlacement::Sequence) => {
                if from == Layout::Feature {
                    let why = "the core splits by queries: q moves from heads to sequence shards";
                    self.push(fwd, AllToAll, Width::Query, none, || why.into());
                    let why = "the q gradient moves back from sequence shards to heads";
                    self.push(bwd, AllToAll, Width::Query, none, || why.into());
                }
                // Keys and values gathered; their gradients are partial sums over the local
                // queries, reduce-scattered back.
                let why = "the local queries attend to every key and value";
                self.push(fwd, AllGather, Width::KeyValue, none, || why.into());
                let why = "the key and value gradients are partial sums over the local queries";
                self.push(bwd, ReduceScatter, Width::KeyValue, none, || why.into());
            }
        }
        match placement {
            OpPlacement::Tensor => Layout::Feature,
            OpPlacement::Sequence => Layout::Sequence,
        }
    }

    /// A GEMM reading features (output projection, MLP out): row-parallel (partial sums) or
    /// on sequence shards; an all-to-all converts an input in the other layout.
    fn feature_gemm(
        &mut self,
        op: LayerOp,
        from: Layout,
        placement: OpPlacement,
        width: Width,
    ) -> Layout {
        let wanted = match placement {
            OpPlacement::Tensor => Layout::Feature,
            OpPlacement::Sequence => Layout::Sequence,
        };
        if from != wanted {
            let (there, back) = match placement {
                OpPlacement::Tensor => ("feature shards", "sequence shards"),
                OpPlacement::Sequence => ("sequence shards", "feature shards"),
            };
            let why = || format!("{} reads {there}: its input moves from {back}", op.name());
            self.push(
                Pass::Forward,
                Collective::AllToAll,
                width,
                Overlap::None,
                why,
            );
            let why = || format!("{}'s input gradient moves back to {back}", op.name());
            self.push(
                Pass::Backward,
                Collective::AllToAll,
                width,
                Overlap::None,
                why,
            );
        }
        match placement {
            OpPlacement::Tensor => Layout::Partial,
            OpPlacement::Sequence => Layout::Sequence,
        }
    }

    /// Adds the output of `op` (a block's last) into the residual stream.
    fn write_residual(&mut self, op: LayerOp, from: Layout) {
        let (fwd, bwd, none) = (Pass::Forward, Pass::Backward, Overlap::None);
        let name = op.name();
        match (from, self.residual) {
            (Layout::Partial, Layout::Sequence) => {
                let why = || {
                    format!(
                        "{name} (split by features) leaves partial sums, reduced onto the residual \
                     stream's sequence shards"
                    )
                };
                let overlap = Overlap::PipelinedFprop(op);
                self.push(fwd, Collective::ReduceScatter, Width::Hidden, overlap, why);
                // Gradients entering a row-parallel GEMM are gathered first.
                let why = || format!("{name} needs the whole output gradient");
                let overlap = Overlap::PipelinedDgrad(op);
                self.push(bwd, Collective::AllGather, Width::Hidden, overlap, why);
            }
            (Layout::Partial, _) => {
                let why = || {
                    format!(
                        "{name} (split by features) leaves partial sums, all-reduced into the \
                     replicated residual stream"
                    )
                };
                self.push(fwd, Collective::AllReduce, Width::Hidden, none, why)
            }
            (Layout::Sequence, Layout::Replicated) => {
                let why = || {
                    format!(
                        "{name} ran on sequence shards; the replicated residual stream gathers them"
                    )
                };
                self.push(fwd, Collective::AllGather, Width::Hidden, none, why)
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Collective::*;

    fn kinds(p: &str, sp: bool, pass: Pass) -> Vec<(Collective, Width)> {
        let mut l = LayerPlacement::MEGATRON;
        let (a, m) = p.split_once(',').unwrap();
        l.set_attention(a).unwrap();
        l.set_mlp(m).unwrap();
        tp_collectives(&l, sp)
            .into_iter()
            .filter(|c| c.pass == pass)
            .map(|c| (c.kind, c.width))
            .collect()
    }

    #[test]
    fn megatron_placements_have_megatrons_collectives() {
        let h = Width::Hidden;
        // Without SP: g (all-reduce) after each block, f's all-reduce in the backward.
        assert_eq!(
            kinds("tp,tp", false, Pass::Forward),
            vec![(AllReduce, h); 2]
        );
        assert_eq!(
            kinds("tp,tp", false, Pass::Backward),
            vec![(AllReduce, h); 2]
        );
        // With SP: all-gather before, reduce-scatter after each block.
        assert_eq!(
            kinds("tp,tp", true, Pass::Forward),
            vec![
                (AllGather, h),
                (ReduceScatter, h),
                (AllGather, h),
                (ReduceScatter, h)
            ]
        );
        assert_eq!(kinds("tp,tp", true, Pass::Backward).len(), 6);
        // The MLP on sequence shards communicates nothing.
        assert_eq!(
            kinds("tp,seq", true, Pass::Forward),
            vec![(AllGather, h), (ReduceScatter, h)]
        );
    }

    #[test]
    fn ulysses_and_gathered_keys() {
        assert_eq!(
            kinds("ulysses,seq", true, Pass::Forward),
            vec![(AllToAll, Width::Qkv), (AllToAll, Width::AttentionOut)]
        );
        assert_eq!(
            kinds("seq,seq", true, Pass::Forward),
            vec![(AllGather, Width::KeyValue)]
        );
        assert_eq!(
            kinds("seq,seq", true, Pass::Backward),
            vec![(ReduceScatter, Width::KeyValue)]
        );
        // Without SP, sequence ops slice the replicated stream and gather their outputs back.
        assert_eq!(
            kinds("seq,seq", false, Pass::Forward),
            vec![
                (AllGather, Width::KeyValue),
                (AllGather, Width::Hidden),
                (AllGather, Width::Hidden)
            ]
        );
    }

    #[test]
    fn codes_round_trip() {
        assert_eq!(LayerPlacement::all().len(), 32);
        assert!(LayerPlacement::all()[0].is_megatron());
        for p in LayerPlacement::all() {
            let mut q = LayerPlacement::MEGATRON;
            q.set_attention(&p.attention_code()).unwrap();
            q.set_mlp(&p.mlp_code()).unwrap();
            assert_eq!(p, q);
        }
        let mut p = LayerPlacement::MEGATRON;
        assert!(p.set_attention("tts ").is_err());
        assert!(p.set_mlp("sss").unwrap_err().contains("2 letters"));
    }
}
