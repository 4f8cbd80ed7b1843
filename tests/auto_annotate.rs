//! `autopar plan --annotate FILE`: the pins of an annotation file (`mesh:` lines pin plan
//! keys, tensor lines require the axes they shard over) hold in every ranked plan.

mod common;

use common::{autopar_err, autopar_ok, scratch};

fn plans(annotations: &str, name: &str) -> Vec<serde_json::Value> {
    let dir = scratch(name);
    let file = dir.join("pins.txt");
    std::fs::write(&file, annotations).expect("write");
    let out = autopar_ok(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=8",
        "--batch",
        "8",
        "--top",
        "100",
        "--annotate",
        file.to_str().expect("UTF-8 path"),
        "--json",
    ]);
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let plans = doc["plans"].as_array().expect("plans").clone();
    assert!(!plans.is_empty(), "{doc}");
    plans
}

#[test]
fn a_tensor_sharded_over_tp_keeps_tp_in_every_plan() {
    for p in plans(
        "# a column-parallel MLP\nh.0.mlp.w1: tp=S(1)\n",
        "annotate_tp",
    ) {
        assert!(p["config"]["tp"].as_u64().expect("tp") > 1, "{p}");
        // The MLP's input GEMM stays split over tp: its weight is.
        let layer = &p["config"]["layer"];
        assert!(layer.is_null() || layer["mlp_in"] == "tensor", "{p}");
    }
}

#[test]
fn run_refuses_an_annotation_that_contradicts_the_layer_placement() {
    let dir = scratch("annotate_layer");
    let file = dir.join("shard.txt");
    std::fs::write(&file, "# column-parallel\nh.0.mlp.w1: tp=S(1)\n").expect("write");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--sp",
        "--mlp",
        "seq",
        "--annotate",
        file.to_str().expect("UTF-8 path"),
    ]);
    assert!(
        err.contains("line 2") && err.contains("h.0.mlp.w1") && err.contains("MLP's input GEMM"),
        "{err}"
    );
}

#[test]
fn mesh_lines_pin_degrees_and_stages_in_every_plan() {
    let all = plans(
        "mesh: tp=2\nmesh: zero=1 # optimizer state sharded\nh.0.mlp.w2: tp=S(0), dp=R\n",
        "annotate_mesh",
    );
    for p in all {
        assert_eq!(p["config"]["tp"], 2, "{p}");
        assert_eq!(p["config"]["zero_stage"], 1, "{p}");
    }
}

#[test]
fn conflicting_or_unknown_pins_are_errors() {
    let dir = scratch("annotate_errors");
    let file = dir.join("pins.txt");
    std::fs::write(&file, "mesh: tp=2\n").expect("write");
    let path = file.to_str().expect("UTF-8 path");
    let base = [
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=8",
        "--batch",
        "8",
    ];
    let err = autopar_err(&[&base[..], &["--annotate", path, "--pin", "tp=4"]].concat());
    assert!(err.contains("pins tp to 2, --pin to 4"), "{err}");
    std::fs::write(&file, "wte: xp=S(0)\n").expect("write");
    let err = autopar_err(&[&base[..], &["--annotate", path]].concat());
    assert!(err.contains("not a plan axis"), "{err}");
}
