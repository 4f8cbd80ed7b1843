//! Model arguments: generic specs, preset overrides, the canonical spec, and every way a spec
//! can be wrong, with the message each gives.

use autopar_frontends::FrontendError;
use autopar_frontends::zoo::{
    self, EntryKind, GptConfig, LlamaConfig, MlpConfig, ModelConfig, MoeConfig,
};

fn error(arg: &str) -> String {
    zoo::resolve(arg)
        .map(|m| panic!("`{arg}` resolved to {m:?}"))
        .unwrap_or_else(|e| e.to_string())
}

#[test]
fn a_generic_gpt_spec() -> Result<(), FrontendError> {
    let model = zoo::resolve(" gpt:layers=4, hidden=64,heads=4,seq=32,vocab=256 ")?;
    assert_eq!(
        model.name,
        "gpt:layers=4, hidden=64,heads=4,seq=32,vocab=256"
    );
    assert_eq!(
        model.config,
        ModelConfig::Gpt(GptConfig {
            n_layers: 4,
            hidden: 64,
            n_heads: 4,
            seq_len: 32,
            vocab: 256,
            ffn: None,
            moe: None,
        })
    );
    let ModelConfig::Gpt(c) =
        zoo::resolve("gpt:layers=1,hidden=8,heads=2,seq=4,vocab=16,ffn=24")?.config
    else {
        panic!("a gpt spec gives a GPT");
    };
    assert_eq!((c.ffn(), c.head_dim()), (24, 4));
    Ok(())
}

#[test]
fn generic_llama_moe_and_mlp_specs() -> Result<(), FrontendError> {
    let llama = zoo::resolve("llama:layers=2,hidden=64,heads=4,ffn=128,seq=32,vocab=256")?;
    assert_eq!(
        llama.config,
        ModelConfig::Llama(LlamaConfig {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 4,
            head_dim: None,
            ffn: 128,
            seq_len: 32,
            vocab: 256,
            rope_base: 10000.0,
            moe: None,
        })
    );

    let moe =
        zoo::resolve("moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,ffn=128")?;
    assert_eq!(moe.config, zoo::resolve("moe-tiny")?.config);

    let mixtral = zoo::resolve(
        "moe:style=llama,layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=4096,\
         vocab=32000,rope_base=1e6,experts=8,top_k=2",
    )?;
    assert_eq!(mixtral.config, zoo::resolve("mixtral-8x7b")?.config);

    let custom = zoo::resolve(
        "moe:layers=1,hidden=8,heads=2,seq=4,vocab=16,experts=4,top_k=1,capacity_factor=2,normalize=false",
    )?;
    let ModelConfig::Gpt(GptConfig { moe: Some(m), .. }) = custom.config else {
        panic!("a GPT-style MoE")
    };
    assert_eq!(
        m,
        MoeConfig {
            n_experts: 4,
            top_k: 1,
            capacity_factor: 2.0,
            normalize: false,
            shared_ffn: None,
        }
    );

    assert_eq!(
        zoo::resolve("mlp:in=32,hidden=64,out=16")?.config,
        ModelConfig::Mlp(MlpConfig {
            n_in: 32,
            hidden: 64,
            n_out: 16
        })
    );
    Ok(())
}

/// Qwen3, Gemma and GPT-OSS give their attention heads a width of their own: Qwen3-32B runs
/// 64 query heads of 128 over a 5120-wide model.
#[test]
fn a_head_dim_of_its_own() -> Result<(), FrontendError> {
    let qwen3 = zoo::resolve(
        "llama:layers=64,hidden=5120,heads=64,kv_heads=8,head_dim=128,ffn=25600,seq=4096,\
         vocab=151936",
    )?;
    let ModelConfig::Llama(c) = &qwen3.config else {
        panic!("a llama spec gives a Llama")
    };
    assert_eq!((c.head_dim, c.head_dim()), (Some(128), 128));
    // 32.8B parameters, as Qwen3-32B's model card counts them (without its per-head q/k
    // norms, 256 parameters a layer).
    let billions = qwen3.num_parameters() as f64 / 1e9;
    assert!((billions - 32.76).abs() < 0.01, "{billions}");
    let spec = qwen3.config.to_string();
    assert!(spec.contains("kv_heads=8,head_dim=128,"), "{spec}");
    assert_eq!(zoo::resolve(&spec)?.config, qwen3.config);

    // The hidden size need not divide among the heads then (GPT-OSS: 2880 over 64 heads of
    // 64), and the graph holds the parameters the sizes count.
    let small = zoo::resolve(
        "llama:layers=2,hidden=48,heads=4,kv_heads=2,head_dim=16,ffn=64,seq=8,vocab=32",
    )?;
    let graph = small.build(zoo::DEFAULT_BATCH)?;
    assert_eq!(graph.num_parameter_elements(), small.num_parameters());
    zoo::resolve(
        "llama:layers=1,hidden=2880,heads=64,kv_heads=8,head_dim=64,ffn=2880,seq=16,vocab=64",
    )?;
    assert_eq!(
        error("llama-tiny:head_dim=5"),
        "model `llama-tiny:head_dim=5`: the head dim `head_dim` = 5 must be even for rotary \
         embeddings"
    );
    assert_eq!(
        error("llama-tiny:head_dim=0"),
        "model `llama-tiny:head_dim=0`: `head_dim` must be positive, got 0"
    );
    Ok(())
}

#[test]
fn presets_accept_overrides() -> Result<(), FrontendError> {
    let model = zoo::resolve("llama3-8b:seq=4096")?;
    assert_eq!(model.name, "llama3-8b:seq=4096");
    let ModelConfig::Llama(c) = &model.config else {
        panic!("llama3-8b is a Llama")
    };
    assert_eq!((c.seq_len, c.n_layers, c.n_kv_heads), (4096, 32, 8));
    assert_eq!(model.build(1)?.name(), "llama3-8b:seq=4096");

    // GPT's ffn follows hidden unless it is set.
    let ModelConfig::Gpt(c) = zoo::resolve("gpt-tiny:hidden=128,layers=3")?.config else {
        panic!("gpt-tiny is a GPT")
    };
    assert_eq!((c.hidden, c.n_layers, c.ffn()), (128, 3, 512));

    let ModelConfig::Llama(c) = zoo::resolve("mixtral-8x7b:experts=16,capacity_factor=1.0")?.config
    else {
        panic!("mixtral is a Llama")
    };
    assert_eq!(
        c.moe.map(|m| (m.n_experts, m.capacity_factor)),
        Some((16, 1.0))
    );
    Ok(())
}

#[test]
fn every_config_prints_a_spec_that_resolves_back_to_it() -> Result<(), FrontendError> {
    for entry in zoo::entries()
        .into_iter()
        .filter(|e| e.kind == EntryKind::Preset)
    {
        let config = zoo::resolve(entry.name)?.config;
        let spec = config.to_string();
        assert_eq!(zoo::resolve(&spec)?.config, config, "{spec}");
    }
    assert_eq!(
        zoo::resolve("gpt3-175b")?.config.to_string(),
        "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=50304"
    );
    assert_eq!(
        zoo::resolve("mixtral-8x7b")?.config.to_string(),
        "moe:style=llama,layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=4096,\
         vocab=32000,rope_base=1000000,experts=8,top_k=2,capacity_factor=1.25,normalize=true"
    );
    assert_eq!(
        zoo::resolve("moe-tiny")?.config.keys(),
        vec![
            "layers",
            "hidden",
            "heads",
            "seq",
            "vocab",
            "ffn",
            "experts",
            "top_k",
            "capacity_factor",
            "normalize",
            "shared_ffn"
        ]
    );
    Ok(())
}

#[test]
fn unknown_names_list_the_known_ones() {
    assert_eq!(
        error("gpt4"),
        "unknown model `gpt4` (known models: mlp-tiny, gpt-tiny, llama-tiny, moe-tiny, \
         gpt3-125m, gpt3-1.3b, gpt3-6.7b, gpt3-13b, gpt3-175b, llama3-8b, llama3-70b, \
         llama3-405b, mixtral-8x7b; or a spec `FAMILY:key=value,...` with FAMILY one of \
         gpt, llama, moe, mlp)"
    );
    assert!(matches!(
        zoo::resolve("bert:layers=2"),
        Err(FrontendError::UnknownModel { .. })
    ));
}

#[test]
fn unknown_keys_list_the_valid_ones() {
    assert_eq!(
        error("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256,kv_heads=2"),
        "model `gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256,kv_heads=2`: unknown key \
         `kv_heads` (valid keys: layers, hidden, heads, seq, vocab, ffn)"
    );
    assert_eq!(
        error("gpt3-175b:experts=8"),
        "model `gpt3-175b:experts=8`: unknown key `experts` (valid keys: layers, hidden, \
         heads, seq, vocab, ffn)"
    );
    assert_eq!(
        error("moe:style=llama,layer=2"),
        "model `moe:style=llama,layer=2`: unknown key `layer` (valid keys: layers, hidden, \
         heads, kv_heads, head_dim, ffn, seq, vocab, rope_base, experts, top_k, capacity_factor, \
         normalize, shared_ffn, style)"
    );
    // `style` chooses a generic MoE spec's architecture; a preset's is fixed.
    assert!(error("mixtral-8x7b:style=gpt").contains("unknown key `style`"));
}

#[test]
fn missing_keys_are_named() {
    assert_eq!(
        error("gpt:layers=2,hidden=64,seq=32,vocab=256"),
        "model `gpt:layers=2,hidden=64,seq=32,vocab=256`: missing key `heads` (required: \
         layers, hidden, heads, seq, vocab)"
    );
    assert_eq!(
        error("llama"),
        "model `llama`: missing key `layers` (required: layers, hidden, heads, ffn, seq, vocab)"
    );
    assert!(
        error("moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4").ends_with(
            "missing key `top_k` (required: layers, hidden, heads, seq, vocab, experts, top_k)"
        )
    );
}

#[test]
fn values_of_the_wrong_form_are_rejected() {
    assert_eq!(
        error("gpt-tiny:hidden=6.5"),
        "model `gpt-tiny:hidden=6.5`: `hidden=6.5`: expected an integer"
    );
    assert_eq!(
        error("gpt-tiny:layers=-1"),
        "model `gpt-tiny:layers=-1`: `layers=-1`: expected an integer"
    );
    assert_eq!(
        error("llama-tiny:rope_base=big"),
        "model `llama-tiny:rope_base=big`: `rope_base=big`: expected a number"
    );
    assert_eq!(
        error("moe-tiny:normalize=yes"),
        "model `moe-tiny:normalize=yes`: `normalize=yes`: expected `true` or `false`"
    );
    assert_eq!(
        error("moe:style=mamba"),
        "model `moe:style=mamba`: `style=mamba`: expected `gpt` or `llama`"
    );
    assert_eq!(
        error("gpt-tiny:layers"),
        "model `gpt-tiny:layers`: `layers` is not a `key=value` setting"
    );
    assert_eq!(
        error("gpt-tiny:layers=2,layers=3"),
        "model `gpt-tiny:layers=2,layers=3`: key `layers` is given twice"
    );
}

#[test]
fn impossible_sizes_are_rejected() {
    assert_eq!(
        error("gpt-tiny:heads=0"),
        "model `gpt-tiny:heads=0`: `heads` must be positive, got 0"
    );
    assert_eq!(
        error("moe-tiny:ffn=0"),
        "model `moe-tiny:ffn=0`: `ffn` must be positive, got 0"
    );
    assert_eq!(
        error("gpt:layers=2,hidden=100,heads=3,seq=32,vocab=256"),
        "model `gpt:layers=2,hidden=100,heads=3,seq=32,vocab=256`: `hidden` (100) is not \
         divisible by `heads` (3)"
    );
    assert_eq!(
        error("llama-tiny:kv_heads=3"),
        "model `llama-tiny:kv_heads=3`: `heads` (4) is not divisible by `kv_heads` (3)"
    );
    assert_eq!(
        error("moe-tiny:top_k=5"),
        "model `moe-tiny:top_k=5`: `top_k` (5) exceeds `experts` (4)"
    );
    assert_eq!(
        error("llama-tiny:hidden=12,heads=4,kv_heads=4"),
        "model `llama-tiny:hidden=12,heads=4,kv_heads=4`: the head dim `hidden`/`heads` = 3 \
         must be even for rotary embeddings"
    );
    assert_eq!(
        error("moe-tiny:capacity_factor=0"),
        "model `moe-tiny:capacity_factor=0`: `capacity_factor` must be a positive number, got 0"
    );
    assert_eq!(
        error("llama-tiny:rope_base=inf"),
        "model `llama-tiny:rope_base=inf`: `rope_base` must be a positive number, got inf"
    );
    assert_eq!(
        error("gpt-tiny:vocab=99999999999"),
        "model `gpt-tiny:vocab=99999999999`: `vocab` is 99999999999, above the limit of 16777216"
    );
}
