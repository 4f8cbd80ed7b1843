//! The named models of the zoo: tiny ones for tests, and full-size ones with their published
//! shapes, each with the source of its numbers.

use crate::zoo::{GptConfig, LlamaConfig, MlpConfig, ModelConfig, MoeConfig};

/// A named model.
pub(crate) struct Preset {
    pub name: &'static str,
    pub description: &'static str,
    pub config: ModelConfig,
}

/// GPT-3 sizes from Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
/// (n_layers, d_model, n_heads; n_ctx = 2048 for all) and the GPT-2 BPE vocabulary of 50257
/// tokens, padded to [`GPT3_PADDED_VOCAB`] as Megatron-LM pads it. `ffn` is 4 * d_model, as
/// in the paper. The paper alternates dense and locally banded sparse attention; these
/// presets use dense attention throughout, which changes no parameter count.
const fn gpt3(n_layers: usize, hidden: usize, n_heads: usize) -> ModelConfig {
    ModelConfig::Gpt(GptConfig {
        n_layers,
        hidden,
        n_heads,
        seq_len: 2048,
        vocab: GPT3_PADDED_VOCAB,
        ffn: None,
        moe: None,
    })
}

/// The GPT-2 BPE vocabulary (50257 tokens) padded to the next multiple of 128, Megatron-LM's
/// default `--make-vocab-size-divisible-by`: an odd vocabulary cannot be split over
/// tensor-parallel ranks, and 50304 splits over any power of two up to 128. The 47 extra rows
/// are never a target; `gpt3-175b:vocab=50257` is the unpadded model (which no `tp` above 1
/// splits).
pub(crate) const GPT3_PADDED_VOCAB: usize = 50304;

/// Llama 3 sizes from Meta's "The Llama 3 Herd of Models" (2024), Table 3 (layers, model
/// dimension, FFN dimension, attention heads, 8 key/value heads, RoPE base 500000), with the
/// vocabulary of 128256 entries of the released `config.json` (the paper rounds it to 128K)
/// and the 8192-token context of pre-training.
const fn llama3(n_layers: usize, hidden: usize, n_heads: usize, ffn: usize) -> ModelConfig {
    ModelConfig::Llama(LlamaConfig {
        n_layers,
        hidden,
        n_heads,
        n_kv_heads: 8,
        head_dim: None,
        ffn,
        seq_len: 8192,
        vocab: 128256,
        rope_base: 500000.0,
        moe: None,
    })
}

/// Every named model, in the order `autopar models` lists them.
pub(crate) static PRESETS: &[Preset] = &[
    Preset {
        name: "mlp-tiny",
        description: "two-layer MLP regressor 32 -> 64 -> 16 with an MSE loss",
        config: ModelConfig::Mlp(MlpConfig {
            n_in: 32,
            hidden: 64,
            n_out: 16,
        }),
    },
    Preset {
        name: "gpt-tiny",
        description: "GPT, 2 layers, hidden 64, 4 heads, seq 32, vocab 256",
        config: ModelConfig::Gpt(GptConfig {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            seq_len: 32,
            vocab: 256,
            ffn: None,
            moe: None,
        }),
    },
    Preset {
        name: "llama-tiny",
        description: "Llama, 2 layers, hidden 64, 4 heads (2 kv), ffn 128, seq 32, vocab 256",
        config: ModelConfig::Llama(LlamaConfig {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: None,
            ffn: 128,
            seq_len: 32,
            vocab: 256,
            rope_base: 10000.0,
            moe: None,
        }),
    },
    Preset {
        name: "moe-tiny",
        description: "GPT with MoE MLPs, 2 layers, hidden 64, 4 heads, 4 experts top-2, ffn 128",
        config: ModelConfig::Gpt(GptConfig {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            seq_len: 32,
            vocab: 256,
            ffn: Some(128),
            moe: Some(MoeConfig {
                n_experts: 4,
                top_k: 2,
                capacity_factor: 1.25,
                normalize: true,
                shared_ffn: None,
            }),
        }),
    },
    Preset {
        name: "gpt3-125m",
        description: "GPT-3 Small (125M): 12 layers, hidden 768, 12 heads, seq 2048, vocab 50257 padded to 50304",
        config: gpt3(12, 768, 12),
    },
    Preset {
        name: "gpt3-1.3b",
        description: "GPT-3 XL (1.3B): 24 layers, hidden 2048, 16 heads, seq 2048, vocab 50257 padded to 50304",
        config: gpt3(24, 2048, 16),
    },
    Preset {
        name: "gpt3-6.7b",
        description: "GPT-3 6.7B: 32 layers, hidden 4096, 32 heads, seq 2048, vocab 50257 padded to 50304",
        config: gpt3(32, 4096, 32),
    },
    Preset {
        name: "gpt3-13b",
        description: "GPT-3 13B: 40 layers, hidden 5120, 40 heads, seq 2048, vocab 50257 padded to 50304",
        config: gpt3(40, 5120, 40),
    },
    Preset {
        name: "gpt3-175b",
        description: "GPT-3 175B: 96 layers, hidden 12288, 96 heads, seq 2048, vocab 50257 padded to 50304",
        config: gpt3(96, 12288, 96),
    },
    Preset {
        name: "llama3-8b",
        description: "Llama 3 8B: 32 layers, hidden 4096, 32 heads (8 kv), ffn 14336, seq 8192",
        config: llama3(32, 4096, 32, 14336),
    },
    Preset {
        name: "llama3-70b",
        description: "Llama 3 70B: 80 layers, hidden 8192, 64 heads (8 kv), ffn 28672, seq 8192",
        config: llama3(80, 8192, 64, 28672),
    },
    Preset {
        name: "llama3-405b",
        description: "Llama 3 405B: 126 layers, hidden 16384, 128 heads (8 kv), ffn 53248, seq 8192",
        config: llama3(126, 16384, 128, 53248),
    },
    // Jiang et al. 2024, "Mixtral of Experts", Table 1: dim 4096, 32 layers, head dim 128,
    // hidden dim 14336, 32 heads, 8 kv heads, vocabulary 32000, 8 experts, top-2; rope_theta
    // 1e6 from the released `config.json`. The model supports a 32K context; the preset
    // trains on 4096-token sequences.
    Preset {
        name: "mixtral-8x7b",
        description: "Mixtral 8x7B: 32 layers, hidden 4096, 32 heads (8 kv), 8 experts top-2, ffn 14336, seq 4096",
        config: ModelConfig::Llama(LlamaConfig {
            n_layers: 32,
            hidden: 4096,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: None,
            ffn: 14336,
            seq_len: 4096,
            vocab: 32000,
            rope_base: 1e6,
            moe: Some(MoeConfig {
                n_experts: 8,
                top_k: 2,
                capacity_factor: 1.25,
                normalize: true,
                shared_ffn: None,
            }),
        }),
    },
];

/// The preset called `name`.
pub(crate) fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}
