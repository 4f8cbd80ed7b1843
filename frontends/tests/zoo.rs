//! The model zoo: every entry builds and verifies, parameter counts match the published sizes,
//! and the graphs carry the scopes, annotations, inits and op attributes the models promise.

use autopar_frontends::FrontendError;
use autopar_frontends::zoo::{self, DEFAULT_BATCH, EntryKind, ModelConfig};
use autopar_ir::{
    DType, Graph, Init, InputRole, Node, Op, Placement, ShardingOrigin, TensorType, verify,
};

fn presets() -> Vec<&'static str> {
    zoo::entries()
        .into_iter()
        .filter(|e| e.kind == EntryKind::Preset)
        .map(|e| e.name)
        .collect()
}

/// The parameter node called `name`.
fn param<'g>(g: &'g Graph, name: &str) -> &'g Node {
    let (v, _, _) = g
        .parameters()
        .into_iter()
        .find(|(_, n, _)| *n == name)
        .unwrap_or_else(|| panic!("no parameter `{name}`"));
    g.node(g.value(v).producer)
}

/// The user placements of parameter `name`.
fn placements(g: &Graph, name: &str) -> Vec<(String, Placement)> {
    let v = param(g, name).outputs[0];
    match &g.value(v).sharding {
        Some(s) => {
            assert_eq!(s.origin, ShardingOrigin::User, "{name}");
            s.axes.clone()
        }
        None => Vec::new(),
    }
}

fn shard(axis: &str, dim: usize) -> Vec<(String, Placement)> {
    vec![(axis.to_string(), Placement::Shard(dim))]
}

fn init(g: &Graph, name: &str) -> Init {
    match &param(g, name).op {
        Op::Parameter { init, .. } => init.clone(),
        op => panic!("`{name}` is a {op}"),
    }
}

/// Nodes whose op has the given text name, in id order.
fn nodes<'g>(g: &'g Graph, op: &str) -> Vec<&'g Node> {
    g.node_ids()
        .into_iter()
        .map(|n| g.node(n))
        .filter(|n| n.op.name() == op)
        .collect()
}

fn assert_close(got: f64, want: f64) {
    assert!((got - want).abs() <= 1e-12 * want.abs(), "{got} != {want}");
}

#[test]
fn every_preset_builds_and_verifies() -> Result<(), FrontendError> {
    let names = presets();
    assert_eq!(names.len(), 13);
    for name in names {
        let g = zoo::build(name, DEFAULT_BATCH)?;
        verify(&g).map_err(|e| FrontendError::Verify(Box::new(e)))?;
        assert_eq!(g.name(), name);
        assert_eq!(g.outputs().len(), 1, "{name}");
        let loss = g.output("loss").expect("a loss output");
        assert_eq!(*g.ty(loss), TensorType::scalar(DType::F32), "{name}");
        assert_eq!(g.inputs().len(), 2, "{name}");
        assert!(!g.parameters().is_empty(), "{name}");
    }
    Ok(())
}

#[test]
fn language_models_take_tokens_and_next_tokens() -> Result<(), FrontendError> {
    for (name, vocab) in [
        ("gpt-tiny", 256),
        ("llama-tiny", 256),
        ("mixtral-8x7b", 32000),
    ] {
        let g = zoo::build(name, 3)?;
        let inputs: Vec<(&str, Op)> = g
            .inputs()
            .into_iter()
            .map(|(_, n, op)| (n, op.clone()))
            .collect();
        let seq = match &zoo::resolve(name)?.config {
            ModelConfig::Gpt(c) => c.seq_len,
            ModelConfig::Llama(c) => c.seq_len,
            ModelConfig::Mlp(_) => unreachable!("{name} is a language model"),
        };
        let ty = TensorType::new(DType::I32, [3, seq]);
        assert_eq!(
            inputs,
            vec![
                (
                    "tokens",
                    Op::Input {
                        name: "tokens".into(),
                        ty: ty.clone(),
                        role: InputRole::Tokens { vocab },
                    }
                ),
                (
                    "targets",
                    Op::Input {
                        name: "targets".into(),
                        ty,
                        role: InputRole::NextTokens { vocab },
                    }
                ),
            ]
        );
    }
    Ok(())
}

#[test]
fn mlp_tiny_is_a_regressor_with_an_mse_loss() -> Result<(), FrontendError> {
    let g = zoo::build("mlp-tiny", 4)?;
    let roles: Vec<(String, String)> = g
        .inputs()
        .into_iter()
        .map(|(v, n, op)| match op {
            Op::Input { role, .. } => (n.to_string(), format!("{role:?} {}", g.ty(v))),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        roles,
        vec![
            ("features".to_string(), "Features f32[4,32]".to_string()),
            (
                "targets".to_string(),
                "RegressionTargets f32[4,16]".to_string()
            ),
        ]
    );
    let names: Vec<&str> = g.parameters().into_iter().map(|(_, n, _)| n).collect();
    assert_eq!(names, vec!["fc1.w", "fc1.b", "fc2.w", "fc2.b"]);
    assert_eq!(g.num_parameter_elements(), 32 * 64 + 64 + 64 * 16 + 16);
    let loss = g.node(g.value(g.output("loss").expect("loss")).producer);
    assert_eq!(loss.op.name(), "reduce_mean");
    let square = g.node(g.value(loss.inputs[0]).producer);
    assert_eq!(square.op.name(), "square");
    assert_eq!(g.node(g.value(square.inputs[0]).producer).op.name(), "sub");
    Ok(())
}

/// Parameter counts of the full-size presets against their published sizes.
#[test]
fn parameter_counts_match_published_sizes() -> Result<(), FrontendError> {
    let count = |name: &str| zoo::resolve(name).map(|m| m.num_parameters());
    // GPT-3 counts include the token and position embeddings (tied output layer), the
    // vocabulary padded to 50304 rows.
    assert_eq!(count("gpt3-125m")?, 125_262_336);
    assert_eq!(count("gpt3-1.3b")?, 1_315_819_520);
    assert_eq!(count("gpt3-6.7b")?, 6_658_596_864);
    assert_eq!(count("gpt3-13b")?, 12_853_626_880);
    assert_eq!(count("gpt3-175b")?, 174_604_836_864);
    let within = |got: u64, published: f64, tolerance: f64| {
        let rel = (got as f64 - published).abs() / published;
        assert!(rel <= tolerance, "{got} vs {published}: {rel:.4}");
    };
    within(count("gpt3-125m")?, 125e6, 0.01);
    within(count("gpt3-1.3b")?, 1.3e9, 0.015);
    within(count("gpt3-6.7b")?, 6.7e9, 0.01);
    within(count("gpt3-13b")?, 13e9, 0.015);
    within(count("gpt3-175b")?, 175e9, 0.01);
    // Llama 3 and Mixtral: untied embeddings, GQA.
    assert_eq!(count("llama3-8b")?, 8_030_261_248);
    assert_eq!(count("llama3-70b")?, 70_553_706_496);
    assert_eq!(count("llama3-405b")?, 405_853_388_800);
    assert_eq!(count("mixtral-8x7b")?, 46_702_792_704);
    within(count("llama3-8b")?, 8.03e9, 0.001);
    within(count("llama3-70b")?, 70.6e9, 0.001);
    within(count("llama3-405b")?, 405.8e9, 0.001);
    within(count("mixtral-8x7b")?, 46.7e9, 0.001);
    Ok(())
}

/// The analytic count agrees with the built graph for every preset, including the largest
/// ones, which must build from shapes alone (no tensor data) and verify.
#[test]
fn analytic_parameter_counts_agree_with_the_graphs() -> Result<(), FrontendError> {
    for name in presets() {
        let model = zoo::resolve(name)?;
        let g = model.build(1)?;
        verify(&g).map_err(|e| FrontendError::Verify(Box::new(e)))?;
        assert_eq!(g.num_parameter_elements(), model.num_parameters(), "{name}");
    }
    for spec in [
        "gpt:layers=3,hidden=48,heads=6,seq=16,vocab=100,ffn=80",
        "llama:layers=3,hidden=48,heads=6,kv_heads=3,ffn=80,seq=16,vocab=100",
        "moe:style=llama,layers=1,hidden=32,heads=4,kv_heads=1,ffn=40,seq=8,vocab=50,experts=3,top_k=2",
        "moe:layers=1,hidden=32,heads=4,seq=8,vocab=50,experts=3,top_k=1",
        "moe:layers=1,hidden=32,heads=4,seq=8,vocab=50,experts=3,top_k=1,shared_ffn=24",
        "moe:style=llama,layers=1,hidden=32,heads=4,ffn=40,seq=8,vocab=50,experts=3,top_k=2,shared_ffn=16",
        "mlp:in=5,hidden=7,out=3",
    ] {
        let model = zoo::resolve(spec)?;
        let g = model.build(2)?;
        assert_eq!(g.num_parameter_elements(), model.num_parameters(), "{spec}");
        assert_eq!(g.name(), spec);
    }
    Ok(())
}

#[test]
fn nodes_carry_layer_scopes() -> Result<(), FrontendError> {
    let g = zoo::build("gpt-tiny", 2)?;
    let gelus = nodes(&g, "gelu");
    let scopes: Vec<Option<&str>> = gelus.iter().map(|n| n.scope.as_deref()).collect();
    assert_eq!(scopes, vec![Some("h.0.mlp"), Some("h.1.mlp")]);
    assert_eq!(param(&g, "h.1.mlp.w1").scope.as_deref(), Some("h.1.mlp"));
    let attention = nodes(&g, "attention");
    assert_eq!(attention[1].scope.as_deref(), Some("h.1.attn"));
    assert_eq!(nodes(&g, "layer_norm")[1].scope.as_deref(), Some("h.0.ln2"));
    assert_eq!(nodes(&g, "cross_entropy")[0].scope.as_deref(), Some("loss"));
    // Every node but the inputs and the shared embeddings has a scope.
    let unscoped: Vec<String> = g
        .node_ids()
        .into_iter()
        .map(|n| g.node(n))
        .filter(|n| n.scope.is_none())
        .map(|n| match &n.op {
            Op::Parameter { name, .. } | Op::Input { name, .. } => name.clone(),
            op => op.name().to_string(),
        })
        .collect();
    assert_eq!(unscoped, vec!["tokens", "targets", "wte", "wpe"]);

    let g = zoo::build("llama-tiny", 2)?;
    assert_eq!(
        nodes(&g, "silu")
            .iter()
            .map(|n| n.scope.as_deref())
            .collect::<Vec<_>>(),
        vec![Some("h.0.mlp"), Some("h.1.mlp")]
    );
    assert_eq!(nodes(&g, "rotary")[0].scope.as_deref(), Some("h.0.attn"));
    Ok(())
}

#[test]
fn gpt_weights_carry_their_annotations_and_inits() -> Result<(), FrontendError> {
    let g = zoo::build("gpt-tiny", 2)?;
    assert_eq!(placements(&g, "wte"), shard("tp", 0));
    assert_eq!(placements(&g, "wpe"), vec![]);
    for w in ["wq", "wk", "wv"] {
        assert_eq!(placements(&g, &format!("h.1.attn.{w}")), shard("tp", 1));
    }
    for b in ["bq", "bk", "bv", "wo"] {
        assert_eq!(placements(&g, &format!("h.1.attn.{b}")), shard("tp", 0));
    }
    assert_eq!(placements(&g, "h.0.attn.bo"), vec![]);
    assert_eq!(placements(&g, "h.0.mlp.w1"), shard("tp", 1));
    assert_eq!(placements(&g, "h.0.mlp.b1"), shard("tp", 0));
    assert_eq!(placements(&g, "h.0.mlp.w2"), shard("tp", 0));
    assert_eq!(placements(&g, "h.0.mlp.b2"), vec![]);
    assert_eq!(placements(&g, "h.0.ln1.g"), vec![]);

    // GPT-2 init: 0.02, residual projections scaled by 1/sqrt(2 * layers), positions 0.01.
    let Init::Normal { std } = init(&g, "h.0.attn.wo") else {
        panic!("wo is normal")
    };
    assert_close(std, 0.02 / 2.0);
    assert_eq!(init(&g, "h.1.mlp.w2"), Init::Normal { std });
    assert_eq!(init(&g, "h.1.mlp.w1"), Init::Normal { std: 0.02 });
    assert_eq!(init(&g, "wte"), Init::Normal { std: 0.02 });
    assert_eq!(init(&g, "wpe"), Init::Normal { std: 0.01 });
    assert_eq!(init(&g, "h.0.ln1.g"), Init::Ones);
    assert_eq!(init(&g, "ln_f.b"), Init::Zeros);
    assert_eq!(init(&g, "h.0.attn.bq"), Init::Zeros);

    // Shapes follow the documented layouts.
    let ty = |name: &str| g.ty(param(&g, name).outputs[0]).to_string();
    assert_eq!(ty("h.0.attn.wq"), "f32[64,4,16]");
    assert_eq!(ty("h.0.attn.bq"), "f32[4,16]");
    assert_eq!(ty("h.0.attn.wo"), "f32[4,16,64]");
    assert_eq!(ty("h.0.mlp.w1"), "f32[64,256]");

    // Tied output layer: the logits einsum reads the token embedding.
    let wte = param(&g, "wte").outputs[0];
    let logits: Vec<&Node> = nodes(&g, "einsum")
        .into_iter()
        .filter(|n| n.inputs.contains(&wte))
        .collect();
    assert_eq!(logits.len(), 1);
    assert_eq!(
        logits[0].op,
        Op::Einsum {
            spec: "bsh,vh->bsv".parse().expect("a valid spec")
        }
    );
    let attention = &nodes(&g, "attention")[0].op;
    assert_eq!(
        *attention,
        Op::Attention {
            causal: true,
            scale: 0.25
        }
    );
    assert!(matches!(nodes(&g, "layer_norm")[0].op, Op::LayerNorm { eps } if eps == 1e-5));
    Ok(())
}

#[test]
fn llama_weights_carry_their_annotations() -> Result<(), FrontendError> {
    let g = zoo::build("llama-tiny", 2)?;
    assert_eq!(placements(&g, "tok_embeddings"), shard("tp", 0));
    assert_eq!(placements(&g, "lm_head"), shard("tp", 0));
    for w in ["wq", "wk", "wv"] {
        assert_eq!(placements(&g, &format!("h.0.attn.{w}")), shard("tp", 1));
    }
    assert_eq!(placements(&g, "h.0.attn.wo"), shard("tp", 0));
    assert_eq!(placements(&g, "h.1.mlp.w1"), shard("tp", 1));
    assert_eq!(placements(&g, "h.1.mlp.w3"), shard("tp", 1));
    assert_eq!(placements(&g, "h.1.mlp.w2"), shard("tp", 0));
    assert_eq!(placements(&g, "h.1.attn_norm.g"), vec![]);

    // Grouped-query attention: 4 query heads over 2 kv heads of width 16.
    let ty = |name: &str| g.ty(param(&g, name).outputs[0]).to_string();
    assert_eq!(ty("h.0.attn.wq"), "f32[64,4,16]");
    assert_eq!(ty("h.0.attn.wk"), "f32[64,2,16]");
    assert_eq!(ty("h.0.mlp.w1"), "f32[64,128]");
    assert_eq!(ty("h.0.mlp.w2"), "f32[128,64]");
    // No biases anywhere.
    assert!(
        g.parameters()
            .iter()
            .all(|(_, _, t)| t.rank() != 1 || t.dims() == [64])
    );

    // Rotary on q and k only, with the configured base.
    let rotary = nodes(&g, "rotary");
    assert_eq!(rotary.len(), 4);
    assert!(rotary.iter().all(|n| n.op == Op::Rotary { base: 10000.0 }));
    let k_shape = g.ty(rotary[1].outputs[0]).to_string();
    assert_eq!(k_shape, "f32[2,32,2,16]");
    assert!(matches!(nodes(&g, "rms_norm")[0].op, Op::RmsNorm { eps } if eps == 1e-5));
    assert!(nodes(&g, "layer_norm").is_empty());

    let g = zoo::build("llama3-8b", 1)?;
    assert_eq!(nodes(&g, "rotary")[0].op, Op::Rotary { base: 500000.0 });
    Ok(())
}

#[test]
fn moe_layers_route_and_shard_experts() -> Result<(), FrontendError> {
    let g = zoo::build("moe-tiny", DEFAULT_BATCH)?;
    let route = nodes(&g, "moe_route");
    assert_eq!(route.len(), 2);
    // One routing group per sequence of 32 tokens: capacity = ceil(1.25 * 32 * 2 / 4) = 20.
    assert_eq!(
        route[0].op,
        Op::MoeRoute {
            top_k: 2,
            capacity: 20,
            normalize: true
        }
    );
    assert_eq!(route[1].scope.as_deref(), Some("h.1.mlp"));
    assert_eq!(g.ty(route[0].outputs[0]).to_string(), "f32[8,32,4,20]");
    // Experts split over `ep`, and Megatron-style over `tp` inside each expert.
    let ep_tp = |tp_dim: Option<usize>| {
        let mut p = shard("ep", 0);
        p.extend(tp_dim.map(|d| ("tp".to_string(), Placement::Shard(d))));
        p
    };
    for (w, tp_dim) in [
        ("w1", Some(2)),
        ("b1", Some(1)),
        ("w2", Some(1)),
        ("b2", None),
    ] {
        assert_eq!(
            placements(&g, &format!("h.0.mlp.{w}")),
            ep_tp(tp_dim),
            "{w}"
        );
    }
    assert_eq!(placements(&g, "h.0.mlp.router"), vec![]);
    let ty = |name: &str| g.ty(param(&g, name).outputs[0]).to_string();
    assert_eq!(ty("h.0.mlp.router"), "f32[64,4]");
    assert_eq!(ty("h.0.mlp.w1"), "f32[4,64,128]");
    assert_eq!(ty("h.0.mlp.b1"), "f32[4,128]");
    assert_eq!(ty("h.0.mlp.w2"), "f32[4,128,64]");
    let specs: Vec<String> = nodes(&g, "einsum")
        .iter()
        .filter(|n| n.scope.as_deref() == Some("h.0.mlp"))
        .map(|n| match &n.op {
            Op::Einsum { spec } => spec.to_string(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        specs,
        vec![
            "gsh,he->gse",
            "gsec,gsh->egch",
            "egch,ehf->egcf",
            "egcf,efh->egch",
            "gsec,egch->gsh"
        ]
    );
    assert!(
        nodes(&g, "gelu")
            .iter()
            .all(|n| n.scope.as_deref() != Some("h.0.attn"))
    );

    // Mixtral: SwiGLU experts without biases, renormalised top-2 of 8.
    let g = zoo::build("mixtral-8x7b", 1)?;
    let route = nodes(&g, "moe_route");
    assert_eq!(route.len(), 32);
    assert_eq!(
        route[0].op,
        Op::MoeRoute {
            top_k: 2,
            capacity: 1280,
            normalize: true
        }
    );
    for (w, tp_dim) in [("w1", 2), ("w2", 1), ("w3", 2)] {
        let mut p = shard("ep", 0);
        p.extend(shard("tp", tp_dim));
        assert_eq!(placements(&g, &format!("h.31.mlp.{w}")), p, "{w}");
    }
    let names: Vec<&str> = g
        .parameters()
        .into_iter()
        .map(|(_, n, _)| n)
        .filter(|n| n.starts_with("h.0.mlp."))
        .collect();
    assert_eq!(
        names,
        vec!["h.0.mlp.router", "h.0.mlp.w1", "h.0.mlp.w3", "h.0.mlp.w2"]
    );
    Ok(())
}

#[test]
fn the_listing_describes_every_entry() -> Result<(), FrontendError> {
    let entries = zoo::entries();
    for e in &entries {
        assert!(!e.description.is_empty(), "{}", e.name);
        if e.kind == EntryKind::Preset {
            zoo::resolve(e.name)?;
        }
    }
    let families: Vec<&str> = entries
        .iter()
        .filter(|e| e.kind == EntryKind::Family)
        .filter_map(|e| e.name.split(':').next())
        .collect();
    assert_eq!(families, vec!["gpt", "llama", "moe", "mlp"]);
    Ok(())
}

#[test]
fn a_zero_batch_is_rejected() {
    let err = zoo::build("gpt-tiny", 0).expect_err("batch 0");
    assert_eq!(
        err.to_string(),
        "model `gpt-tiny`: `batch` must be positive, got 0"
    );
}
