//! Models from PyTorch: the committed ONNX exports (`frontends/tests/onnx/`) run, train,
//! partition and plan like the zoo models of the same shape.

mod common;

use common::{autopar, autopar_err, autopar_ok, scratch};

use autopar_driver::{self as driver, CompileOptions, Pass};

fn model(name: &str) -> String {
    format!("{}/frontends/tests/onnx/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `autopar run --forward --outputs` writes what it fed and computed; ONNX Runtime, run on
/// the same inputs, gives the same logits within 1e-4 of their scale.
fn check_against_onnx_runtime(name: &str, batch: &str) {
    let dir = scratch(&format!("onnx-ort-{name}"));
    let dir = dir.to_str().expect("UTF-8 path");
    let out = autopar_ok(&[
        "run",
        &model(name),
        "--forward",
        "--batch",
        batch,
        "--outputs",
        dir,
    ]);
    assert!(out.contains("wrote 2 files"), "{out}");
    let script = format!(
        "{}/frontends/tests/onnx/check_ort.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let run = std::process::Command::new("python3")
        .args([script.as_str(), &model(name), dir, "1e-4"])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "ONNX Runtime disagrees (or is missing: pip install onnxruntime numpy):\n{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("logits: shape") && stdout.contains("OK"),
        "{stdout}"
    );
}

#[test]
fn gpt2_forward_matches_onnx_runtime() {
    check_against_onnx_runtime("gpt2-tiny.onnx", "2");
}

#[test]
fn gpt2_opset14_forward_matches_onnx_runtime() {
    check_against_onnx_runtime("gpt2-tiny-opset14.onnx", "2");
}

#[test]
fn llama_forward_matches_onnx_runtime() {
    check_against_onnx_runtime("llama-tiny.onnx", "3");
}

/// Every collective of rank 0's partitioned training step: op, attributes and result type
/// (names and scopes differ between an import and the zoo, nothing else may).
fn collectives(model: &str, loss: bool) -> Vec<String> {
    let (step, _) = partitioned(model, loss);
    describe(&step.locals[0], |_| true)
}

/// Rank 0's partitioned training step of `model` on `dp=2,tp=2`, and its weights' count.
fn partitioned(model: &str, loss: bool) -> (driver::CompiledStep, usize) {
    let mut o = CompileOptions::new(model)
        .on_mesh("dp=2,tp=2")
        .expect("mesh");
    o.batch = Some(8);
    o.loss = loss.then_some(driver::frontends::onnx::Loss::CrossEntropy);
    o.stop_after = Some(Pass::Partition);
    o.reference = false;
    let step = driver::compile(&o).unwrap_or_else(|e| panic!("{model}: {e}"));
    let weights = step.train.as_ref().map_or(0, |t| t.weights.len());
    (step, weights)
}

/// The collectives among the nodes of `g` that `keep` selects, as [`collectives`] lists them.
fn describe(g: &autopar_ir::Graph, keep: impl Fn(autopar_ir::NodeId) -> bool) -> Vec<String> {
    g.nodes_in_order()
        .into_iter()
        .filter(|&n| g.node(n).op.is_communication() && keep(n))
        .map(|n| {
            let node = g.node(n);
            let ty = g.ty(node.outputs[0]);
            format!("{:?} -> {ty}", node.op)
        })
        .collect()
}

#[test]
fn gpt2_partitions_with_the_collectives_of_the_zoo_model() {
    let onnx = collectives(&model("gpt2-tiny.onnx"), true);
    let zoo = collectives("gpt-tiny", false);
    assert!(onnx.len() > 20, "{onnx:?}");
    assert_eq!(onnx, zoo);
}

#[test]
fn llama_partitions_with_the_collectives_of_the_zoo_model() {
    let (onnx, weights) = partitioned(&model("llama-tiny.onnx"), true);
    let (zoo, zoo_weights) = partitioned("llama-tiny", false);
    assert_eq!(weights, zoo_weights);
    let (onnx, zoo) = (&onnx.locals[0], &zoo.locals[0]);
    let optimizer =
        |g: &autopar_ir::Graph, n| g.meta(n).phase == Some(autopar_ir::Phase::Optimizer);
    let outside = |g: &autopar_ir::Graph| describe(g, |n| !optimizer(g, n));
    assert!(outside(onnx).len() > 20, "{:?}", outside(onnx));
    assert_eq!(outside(onnx), outside(zoo));
    // The gradient norm adds the weights' squared norms in the order the model lists its
    // weights (the file's order for an import), and a partial sum over `tp` (a sharded
    // weight's term) is reduced where a replicated weight's term joins it: how many scalar
    // all-reduces that takes depends on the order (the collectives pass batches them into
    // one). Both reduce only scalars over `tp` there, at most one per weight.
    for g in [onnx, zoo] {
        let norm = describe(g, |n| optimizer(g, n));
        assert!(!norm.is_empty() && norm.len() <= weights, "{norm:?}");
        for c in &norm {
            assert_eq!(c, r#"AllReduce { axes: ["tp"], reduce: Sum } -> f32[]"#);
        }
    }
}

#[test]
fn gpt2_trains_on_dp2_tp2_and_verifies() {
    let out = autopar_ok(&[
        "run",
        &model("gpt2-tiny.onnx"),
        "--loss",
        "ce",
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "3",
        "--verify",
    ]);
    assert!(out.contains("step 3 loss: "), "{out}");
    let verify = out
        .lines()
        .find(|l| l.starts_with("verify: "))
        .expect("a verify line");
    assert!(verify.ends_with(" OK"), "{out}");
    // Training moves the loss.
    let losses: Vec<f64> = out
        .lines()
        .filter_map(|l| l.split("loss: ").nth(1)?.parse().ok())
        .collect();
    assert_eq!(losses.len(), 3);
    assert!(losses[2] < losses[0], "{losses:?}");
}

#[test]
fn an_onnx_forward_needs_a_loss_to_train() {
    let err = autopar_err(&["run", &model("gpt2-tiny.onnx"), "--steps", "1"]);
    assert!(err.contains("--loss ce"), "{err}");
    let err = autopar_err(&["run", &model("gpt2-tiny.onnx"), "--forward"]);
    assert!(err.contains("--outputs DIR"), "{err}");
    let out = autopar_ok(&["run", &model("gpt2-tiny.onnx"), "--forward", "--loss", "ce"]);
    assert!(out.starts_with("loss: "), "{out}");
}

/// The best plan of `plan --json`, without the model's name.
fn best_plan(model: &str) -> serde_json::Value {
    let out = autopar_ok(&[
        "plan",
        model,
        "--cluster",
        "dgx-h100:nodes=2",
        "--batch",
        "64",
        "--json",
    ]);
    let mut v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let mut m = v["model"].take();
    m["name"] = serde_json::Value::Null;
    serde_json::json!({ "model": m, "best": v["plans"][0].take() })
}

#[test]
fn plans_rank_as_for_the_zoo_model_of_the_same_shape() {
    assert_eq!(best_plan(&model("gpt2-tiny.onnx")), best_plan("gpt-tiny"));
    assert_eq!(
        best_plan(&model("llama-tiny.onnx")),
        best_plan("llama-tiny")
    );
}

#[test]
fn dump_prints_the_raised_graph() {
    let out = autopar_ok(&["dump", &model("llama-tiny.onnx"), "--batch", "2"]);
    assert!(out.starts_with("# imported from ONNX (opset 17)"), "{out}");
    assert!(
        out.contains("rms_norm x5") && out.contains("attention x2"),
        "{out}"
    );
    assert!(!out.contains("not understood"), "{out}");
    for op in [" = rotary ", " = attention ", " = silu ", " = rms_norm "] {
        assert!(out.contains(op), "{op} missing");
    }
    assert!(
        out.contains("init=values(elided, 16384)"),
        "the values are elided"
    );
    // With --values the text loads back as the same graph.
    let full = autopar_ok(&["dump", &model("gpt2-tiny.onnx"), "--batch", "2", "--values"]);
    let text: String = full
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let g = driver::ir::text::parse(&text).expect("the full dump parses");
    assert_eq!(driver::ir::text::print(&g).trim_end(), text.trim_end());
}

#[test]
fn an_unknown_op_fails_naming_it() {
    let dir = scratch("onnx-unknown-op");
    let path = dir.join("bad.onnx");
    // The GPT-2 export with its first Tanh made an op no opset has.
    use prost::Message;
    let bytes = std::fs::read(model("gpt2-tiny.onnx")).expect("read");
    let mut m =
        driver::frontends::onnx::proto::ModelProto::decode(bytes.as_slice()).expect("decodes");
    let g = m.graph.as_mut().expect("a graph");
    let tanh = g
        .node
        .iter_mut()
        .find(|n| n.op_type.as_deref() == Some("Tanh"))
        .expect("a Tanh");
    tanh.op_type = Some("Tanq".into());
    std::fs::write(&path, m.encode_to_vec()).expect("write");
    let err = autopar_err(&["dump", path.to_str().expect("UTF-8")]);
    assert!(
        err.contains("op `Tanq`") && err.contains("opset 17"),
        "{err}"
    );
    assert!(err.contains("node `/h.0/mlp/Tanh`"), "{err}");
    let out = autopar(&["run", path.to_str().expect("UTF-8"), "--forward"]);
    assert!(!out.status.success());
}

#[test]
fn annotations_name_onnx_initializers() {
    let dir = scratch("onnx-annotate");
    let file = dir.join("ann.txt");
    // Replicate the first MLP's weights: its Megatron split (and the all-reduce after it)
    // goes, everything else stays.
    std::fs::write(
        &file,
        "onnx::MatMul_307: tp=R\nh.0.mlp.c_fc.bias: tp=R\nonnx::MatMul_308: tp=R\n",
    )
    .expect("write");
    let base = collectives(&model("gpt2-tiny.onnx"), true);
    let mut o = CompileOptions::new(model("gpt2-tiny.onnx"))
        .on_mesh("dp=2,tp=2")
        .expect("mesh");
    o.batch = Some(8);
    o.loss = Some(driver::frontends::onnx::Loss::CrossEntropy);
    o.stop_after = Some(Pass::Partition);
    o.parallel.annotations = driver::load_annotations(file.to_str().expect("UTF-8")).expect("file");
    let step = driver::compile(&o).expect("compiles");
    let g = &step.locals[0];
    let w = g
        .parameters()
        .into_iter()
        .find(|(_, n, _)| *n == "onnx::MatMul_307")
        .expect("the weight");
    assert_eq!(
        w.2.dims(),
        [64, 256],
        "replicated: the whole weight on every rank"
    );
    let n = g
        .nodes_in_order()
        .into_iter()
        .filter(|&n| g.node(n).op.is_communication())
        .count();
    assert_ne!(n, base.len());
    // And the CLI takes the file.
    let out = autopar_ok(&[
        "run",
        &model("gpt2-tiny.onnx"),
        "--loss",
        "ce",
        "--mesh",
        "dp=2,tp=2",
        "--annotate",
        file.to_str().expect("UTF-8"),
        "--verify",
    ]);
    assert!(out.contains(" OK"), "{out}");
}
