//! Imports the committed ONNX models (exported from PyTorch modules written like GPT-2 and
//! Llama by `tests/onnx/make_models.py`) and checks what raising made of them; and holds
//! the importer to clear errors on unsupported ops and on malformed or truncated files.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Instant;

use autopar_frontends::FrontendError;
use autopar_frontends::onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, tensor_shape_proto, type_proto,
};
use autopar_frontends::onnx::{
    ImportOptions, Imported, Loss, OnnxError, import_bytes, import_file,
};
use autopar_ir::{Graph, Init, InputRole, LayerId, Op, OpKind, Part, WeightRole};
use prost::Message;

fn path(name: &str) -> String {
    format!("{}/tests/onnx/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn import(name: &str, batch: usize, loss: Option<Loss>) -> Imported {
    let options = ImportOptions {
        batch: Some(batch),
        loss,
    };
    import_file(path(name), &options).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn count(g: &Graph, kind: OpKind) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&n| g.node(n).op.kind() == kind)
        .count()
}

/// What a test reads of a parameter: its role, layer and dims.
type Weight = (Option<WeightRole>, Option<LayerId>, Vec<usize>);

/// Parameter name -> its role, layer and dims.
fn weights(g: &Graph) -> BTreeMap<String, Weight> {
    g.parameters()
        .into_iter()
        .map(|(v, name, ty)| {
            let meta = g.meta(g.value(v).producer);
            (
                name.to_string(),
                (meta.role, meta.layer, ty.dims().to_vec()),
            )
        })
        .collect()
}

fn roles_in(g: &Graph, layer: LayerId) -> Vec<WeightRole> {
    let mut roles: Vec<WeightRole> = weights(g)
        .values()
        .filter(|(_, l, _)| *l == Some(layer))
        .filter_map(|(r, _, _)| *r)
        .collect();
    roles.sort();
    roles
}

#[test]
fn gpt2_export_is_raised_to_the_zoo_ops() {
    let im = import("gpt2-tiny.onnx", 2, None);
    let g = &im.graph;
    assert!(im.report.not_understood.is_empty(), "{}", im.report);
    assert!(im.report.constant_parameters.is_empty(), "{}", im.report);
    assert_eq!(im.report.blocks, 2);
    assert_eq!(count(g, OpKind::Attention), 2);
    assert_eq!(count(g, OpKind::LayerNorm), 5);
    // GELU recognised in its tanh form: nothing of the decomposition is left.
    assert_eq!(count(g, OpKind::Softmax), 0);
    assert_eq!(count(g, OpKind::Select), 0);
    let unary: Vec<String> = g
        .node_ids()
        .into_iter()
        .filter_map(|n| match &g.node(n).op {
            Op::Unary { func } => Some(func.name().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(unary, ["gelu", "gelu"]);
    for n in g.node_ids() {
        if let Op::Attention { causal, scale } = g.node(n).op {
            assert!(causal);
            assert!((scale - 0.25).abs() < 1e-12);
        }
    }
    let w = weights(g);
    // Q/K/V in the head layout of the zoo, the head tied to the token embedding.
    assert_eq!(w["onnx::MatMul_294"].2, [64, 4, 16]);
    assert_eq!(w["h.0.attn.q_proj.bias"].2, [4, 16]);
    assert_eq!(w["wte.weight"].0, Some(WeightRole::TokenEmbedding));
    assert_eq!(w["wpe.weight"].0, Some(WeightRole::PositionEmbedding));
    assert!(!w.values().any(|(r, _, _)| *r == Some(WeightRole::Head)));
    assert_eq!(w.len(), 2 + 2 * 16 + 2, "{w:?}");
    for i in 0..2 {
        use WeightRole::*;
        assert_eq!(
            roles_in(g, LayerId::Block(i)),
            [
                Norm,
                Norm,
                Norm,
                Norm,
                Query,
                Query,
                Key,
                Key,
                Value,
                Value,
                AttentionOut,
                AttentionOut,
                MlpIn,
                MlpIn,
                MlpOut,
                MlpOut
            ]
        );
    }
    assert_eq!(
        roles_in(g, LayerId::FinalNorm),
        [WeightRole::Norm, WeightRole::Norm]
    );
    // Every attention node is in its block's attention part.
    for n in g.node_ids() {
        if g.node(n).op.kind() == OpKind::Attention {
            assert_eq!(g.meta(n).part, Some(Part::Attention));
        }
    }
    // The values are the file's.
    let Some(Op::Parameter {
        init: Init::Values(v),
        ..
    }) = g
        .node_ids()
        .into_iter()
        .map(|n| &g.node(n).op)
        .find(|op| matches!(op, Op::Parameter { name, .. } if name == "wpe.weight"))
    else {
        panic!("wpe.weight has no values");
    };
    assert_eq!(v.len(), 32 * 64);
    assert!(v.as_slice().iter().any(|&x| x != 0.0));
}

#[test]
fn decomposed_layer_norms_of_opset_14_are_raised() {
    let im = import("gpt2-tiny-opset14.onnx", 2, None);
    let g = &im.graph;
    assert_eq!(im.report.opset, 14);
    assert!(im.report.not_understood.is_empty(), "{}", im.report);
    assert_eq!(count(g, OpKind::LayerNorm), 5);
    assert_eq!(
        count(g, OpKind::Reduce),
        0,
        "no reduction of the decomposition is left"
    );
    assert_eq!(count(g, OpKind::Attention), 2);
    for i in 0..2 {
        let norms = roles_in(g, LayerId::Block(i))
            .iter()
            .filter(|r| **r == WeightRole::Norm)
            .count();
        assert_eq!(norms, 4);
    }
}

#[test]
fn llama_export_raises_rms_norm_rotary_gqa_and_swiglu() {
    // The weights are in the external-data file beside the model.
    let im = import("llama-tiny.onnx", 3, None);
    let g = &im.graph;
    assert!(im.report.not_understood.is_empty(), "{}", im.report);
    assert_eq!(count(g, OpKind::RmsNorm), 5);
    assert_eq!(count(g, OpKind::Rotary), 4);
    assert_eq!(count(g, OpKind::Attention), 2);
    for n in g.node_ids() {
        match &g.node(n).op {
            Op::Rotary { base } => assert_eq!(*base, 10000.0),
            // Grouped-query attention: 4 query heads over 2 key/value heads.
            Op::Attention { causal, .. } => {
                assert!(causal);
                let k = g.node(n).inputs[1];
                assert_eq!(g.ty(k).dims(), [3, 32, 2, 16]);
            }
            _ => {}
        }
    }
    use WeightRole::*;
    assert_eq!(
        roles_in(g, LayerId::Block(1)),
        [
            Norm,
            Norm,
            Query,
            Key,
            Value,
            AttentionOut,
            MlpIn,
            MlpGate,
            MlpOut
        ]
    );
    assert_eq!(roles_in(g, LayerId::Head), [Head]);
    let w = weights(g);
    assert_eq!(
        w["onnx::MatMul_582"].2,
        [256, 64],
        "the head is stored [vocab, hidden]"
    );
}

#[test]
fn a_cross_entropy_loss_makes_the_forward_trainable() {
    let im = import("gpt2-tiny.onnx", 4, Some(Loss::CrossEntropy));
    let g = &im.graph;
    let names: Vec<&str> = g.outputs().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["loss"]);
    let targets = g
        .inputs()
        .into_iter()
        .find(|(_, n, _)| *n == "targets")
        .unwrap();
    let Op::Input { ty, role, .. } = targets.2 else {
        panic!()
    };
    assert_eq!(ty.dims(), [4, 32]);
    assert_eq!(*role, InputRole::NextTokens { vocab: 256 });
    assert_eq!(count(g, OpKind::CrossEntropy), 1);
}

// ---- errors ----------------------------------------------------------------------------

fn tensor_type(elem: i32, dims: &[Option<i64>]) -> TypeProto {
    let dim = dims
        .iter()
        .map(|d| tensor_shape_proto::Dimension {
            value: Some(match d {
                Some(v) => tensor_shape_proto::dimension::Value::DimValue(*v),
                None => tensor_shape_proto::dimension::Value::DimParam("batch".into()),
            }),
            ..Default::default()
        })
        .collect();
    TypeProto {
        value: Some(type_proto::Value::TensorType(type_proto::Tensor {
            elem_type: Some(elem),
            shape: Some(TensorShapeProto { dim }),
        })),
        ..Default::default()
    }
}

fn value_info(name: &str, dims: &[Option<i64>]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(tensor_type(1, dims)),
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// A small MLP: `softmax(relu(x W1 + b1) W2)`, with `op` in place of the relu.
fn mlp_model(op: &str, opset: i64) -> ModelProto {
    let weight = |name: &str, dims: &[i64]| TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(1),
        float_data: (0..dims.iter().product::<i64>())
            .map(|i| (i as f32 * 0.37).sin())
            .collect(),
        ..Default::default()
    };
    let mut act = node(op, "/mlp/act", &["h"], &["a"]);
    if op == "LeakyRelu" {
        act.attribute.push(AttributeProto {
            name: Some("alpha".into()),
            f: Some(0.1),
            r#type: Some(1),
            ..Default::default()
        });
    }
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        graph: Some(GraphProto {
            name: Some("mlp".into()),
            node: vec![
                node("MatMul", "/mlp/fc1", &["x", "w1"], &["y"]),
                node("Add", "/mlp/bias", &["y", "b1"], &["h"]),
                act,
                node("MatMul", "/mlp/fc2", &["a", "w2"], &["z"]),
                node("Softmax", "/mlp/softmax", &["z"], &["out"]),
            ],
            initializer: vec![
                weight("w1", &[8, 16]),
                weight("b1", &[16]),
                weight("w2", &[16, 4]),
            ],
            input: vec![value_info("x", &[None, Some(8)])],
            output: vec![value_info("out", &[None, Some(4)])],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn import_model(m: &ModelProto) -> Result<Imported, FrontendError> {
    let options = ImportOptions {
        batch: Some(3),
        loss: None,
    };
    import_bytes(&m.encode_to_vec(), "mlp.onnx", "mlp", None, &options)
}

#[test]
fn a_small_model_built_here_imports() {
    let im = import_model(&mlp_model("Relu", 13)).unwrap();
    assert_eq!(im.graph.ty(im.graph.outputs()[0].1).dims(), [3, 4]);
    assert_eq!(count(&im.graph, OpKind::Einsum), 2);
    // No attention: said so.
    assert!(!im.report.not_understood.is_empty());
}

#[test]
fn an_unsupported_op_is_named_with_its_node_and_opset() {
    let err = import_model(&mlp_model("LeakyRelu", 17)).unwrap_err();
    let FrontendError::Onnx(e) = &err else {
        panic!("{err}")
    };
    assert!(matches!(**e, OnnxError::UnsupportedOp { .. }), "{err}");
    let text = err.to_string();
    for part in ["mlp.onnx", "`/mlp/act`", "`LeakyRelu`", "opset 17"] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
}

#[test]
fn opsets_outside_13_to_21_are_refused() {
    for opset in [12, 22] {
        let err = import_model(&mlp_model("Relu", opset))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("opset {opset}")), "{err}");
    }
    assert!(import_model(&mlp_model("Relu", 21)).is_ok());
}

#[test]
fn initializer_sizes_are_checked_before_allocating() {
    let mut m = mlp_model("Relu", 17);
    let g = m.graph.as_mut().unwrap();
    // Dims that claim 2^60 elements with 128 values present.
    g.initializer[0].dims = vec![1 << 30, 1 << 30];
    let err = import_model(&m).unwrap_err().to_string();
    assert!(
        err.contains("initializer `w1`") && err.contains("128 values"),
        "{err}"
    );
    g_external(&mut m);
    let err = import_model(&m).unwrap_err().to_string();
    assert!(err.contains("external data"), "{err}");
}

/// Makes the first initializer's data external (with no folder to read it from).
fn g_external(m: &mut ModelProto) {
    let t = &mut m.graph.as_mut().unwrap().initializer[0];
    t.dims = vec![8, 16];
    t.float_data.clear();
    t.data_location = Some(1);
    t.external_data
        .push(autopar_frontends::onnx::proto::StringStringEntryProto {
            key: Some("location".into()),
            value: Some("../../etc/passwd".into()),
        });
}

/// A deterministic xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The bounded form of the fuzz target `fuzz/fuzz_targets/import_onnx.rs`: thousands of
/// truncated and mutated models must each import or fail with an error, never panic.
#[test]
fn truncated_and_mutated_models_fail_cleanly() {
    let start = Instant::now();
    let seeds = [
        mlp_model("Relu", 17).encode_to_vec(),
        mlp_model("Gelu", 20).encode_to_vec(),
        std::fs::read(path("llama-tiny.onnx")).unwrap(),
    ];
    let options = ImportOptions {
        batch: Some(2),
        loss: None,
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut ok, mut failed) = (0, 0);
    let mut run = |bytes: &[u8]| {
        let result = std::panic::catch_unwind(|| {
            import_bytes(bytes, "fuzz.onnx", "fuzz", None, &options).map(|_| ())
        });
        match result {
            Ok(Ok(())) => ok += 1,
            Ok(Err(e)) => {
                assert!(e.to_string().starts_with("fuzz.onnx: "), "{e}");
                failed += 1;
            }
            Err(_) => panic!("the importer panicked on {} bytes: {bytes:?}", bytes.len()),
        }
    };
    for seed in &seeds {
        // Every truncation of the small models; a spread of them for the large one.
        let step = (seed.len() / 400).max(1);
        for len in (0..seed.len()).step_by(step) {
            run(&seed[..len]);
        }
        for _ in 0..2000 {
            let mut bytes = seed.clone();
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(bytes.len());
                match rng.below(3) {
                    0 => bytes[at] = rng.next() as u8,
                    1 => bytes[at] ^= 1 << rng.below(8),
                    _ => {
                        bytes.remove(at);
                    }
                }
            }
            run(&bytes);
        }
    }
    assert!(ok > 0 && failed > 1000, "ok {ok}, failed {failed}");
    assert!(start.elapsed().as_secs() < 60, "took {:?}", start.elapsed());
}

/// The unary functions of a graph's nodes.
fn unaries(g: &autopar_ir::Graph) -> Vec<autopar_ir::UnaryOp> {
    g.nodes_in_order()
        .into_iter()
        .filter_map(|n| match g.node(n).op {
            Op::Unary { func } => Some(func),
            _ => None,
        })
        .collect()
}

#[test]
fn exact_gelu_is_raised_from_its_op_and_from_its_erf_form() {
    use autopar_ir::UnaryOp;
    // ONNX `Gelu` (opset 20) without `approximate`.
    let im = import_model(&mlp_model("Gelu", 20)).unwrap();
    assert_eq!(unaries(&im.graph), [UnaryOp::GeluErf]);
    // What exporters write before opset 20: 0.5 * x * (1 + erf(x / sqrt 2)).
    let mut m = mlp_model("Relu", 13);
    let g = m.graph.as_mut().unwrap();
    let scalar = |name: &str, v: f32| TensorProto {
        name: Some(name.into()),
        data_type: Some(1),
        float_data: vec![v],
        ..Default::default()
    };
    g.initializer.extend([
        scalar("sqrt2", std::f32::consts::SQRT_2),
        scalar("one", 1.0),
        scalar("half", 0.5),
    ]);
    let at = g
        .node
        .iter()
        .position(|n| n.op_type.as_deref() == Some("Relu"))
        .unwrap();
    g.node.splice(
        at..=at,
        [
            node("Div", "/mlp/act/div", &["h", "sqrt2"], &["d"]),
            node("Erf", "/mlp/act/erf", &["d"], &["e"]),
            node("Add", "/mlp/act/add", &["e", "one"], &["f"]),
            node("Mul", "/mlp/act/mul", &["h", "f"], &["p"]),
            node("Mul", "/mlp/act/half", &["p", "half"], &["a"]),
        ],
    );
    let im = import_model(&m).unwrap();
    assert_eq!(unaries(&im.graph), [UnaryOp::GeluErf]);
    // A lone Erf on computed values is the IR's erf.
    let im = import_model(&mlp_model("Erf", 13)).unwrap();
    assert_eq!(unaries(&im.graph), [UnaryOp::Erf]);
}
