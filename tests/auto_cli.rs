//! End-to-end tests of executable plans: `autopar plan --save` and `--json` write a plan,
//! `autopar run --plan-file` runs exactly it on CPU ranks (or refuses what the CPU runtime
//! cannot execute), and `autopar run --auto` searches, prints and runs the best executable
//! plan.

mod common;

use common::{autopar_err, autopar_ok, plan_file, scratch};

#[test]
fn auto_on_eight_cpu_ranks_searches_runs_and_verifies() {
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--auto",
        "--cluster",
        "cpu:ranks=8",
        "--steps",
        "3",
        "--verify",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("plan: dp="), "{out}");
    assert!(lines[0].contains("cp=1,ep=1"), "{out}");
    assert!(lines[0].contains("sp=false"), "{out}");
    assert!(out.contains("step 3 loss: "), "{out}");
    assert!(out.contains("ranks: 8 ("), "{out}");
    let verify = lines.last().expect("a verify line");
    assert!(
        verify.starts_with("verify: ") && verify.ends_with(" OK"),
        "{out}"
    );
}

#[test]
fn auto_needs_a_cluster_and_refuses_one_without_an_executable_plan() {
    autopar_err(&["run", "gpt-tiny", "--auto"]);
    let err = autopar_err(&["run", "gpt-tiny", "--auto", "--cluster", "cpu:ranks=3"]);
    assert!(err.contains("no plan the CPU runtime executes"), "{err}");
}

#[test]
fn every_plan_of_the_cpu_runtime_search_is_executable() {
    let out = autopar_ok(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=8",
        "--batch",
        "8",
        "--top",
        "100",
        "--pin",
        "runtime=cpu",
        "--json",
    ]);
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let plans = doc["plans"].as_array().expect("plans");
    assert!(!plans.is_empty());
    for p in plans {
        let c = &p["config"];
        assert!(c["cp"] == 1 || c["pp"] == 1, "{p}");
        assert_eq!(c["ep"], 1, "{p}");
        assert!(c["sequence_parallel"] == false || c["tp"] != 1, "{p}");
    }
    // ZeRO-3 inside a pipeline with data parallelism runs on the CPU runtime, so the search
    // offers it.
    let out = autopar_ok(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=8",
        "--batch",
        "8",
        "--pin",
        "runtime=cpu,pp=2,zero=3",
        "--json",
    ]);
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let plans = doc["plans"].as_array().expect("plans");
    assert!(
        plans
            .iter()
            .any(|p| p["config"]["dp"] != 1 || p["config"]["tp"] != 1),
        "{out}"
    );
}

#[test]
fn a_saved_plan_runs_exactly_as_written() {
    let dir = scratch("auto_saved_plan");
    let file = dir.join("plan.json");
    let file = file.to_str().expect("UTF-8 path");
    autopar_ok(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--dtype",
        "f32",
        "--pin",
        "dp=2,tp=2,zero=1,sp=false",
        "--save",
        file,
    ]);
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).expect("saved")).expect("JSON");
    assert_eq!(plan["tp"], 2);
    assert_eq!(plan["zero_stage"], 1);
    let out = autopar_ok(&["run", "gpt-tiny", "--plan-file", file, "--verify"]);
    assert!(out.contains("ranks: 4 (dp=2, tp=2)"), "{out}");
    assert!(out.trim_end().ends_with(" OK"), "{out}");
}

#[test]
fn a_pipeline_plan_from_plan_json_runs_its_schedule() {
    let dir = scratch("auto_pipeline_plan");
    let file = dir.join("plans.json");
    let doc = plan_f32_on_two_ranks("gpt-tiny", "8", "pp=2,schedule=gpipe");
    std::fs::write(&file, doc).expect("write");
    let file = file.to_str().expect("UTF-8 path");
    let out = autopar_ok(&["run", "gpt-tiny", "--plan-file", file, "--verify"]);
    assert!(out.contains("ranks: 2 (pp=2)"), "{out}");
    assert!(out.trim_end().ends_with(" OK"), "{out}");
}

#[test]
fn a_plan_file_runs_or_is_refused_by_name() {
    // ZeRO with every data rank an expert rank: dense state is sharded over `dp` and `ep`
    // together (the mesh has no `dp` axis here), expert state over no rank.
    let dir = scratch("auto_refused_plan");
    let file = dir.join("plan.json");
    std::fs::write(
        &file,
        r#"{"dp":2,"tp":1,"pp":1,"vpp":1,"cp":1,"ep":2,"micro_batch_size":1,"global_batch":8,
            "zero_stage":3,"recompute":"none","sequence_parallel":false,"schedule":"1f1b",
            "dtype":"f32","axis_order":["pp","dp","ep","cp","tp"]}"#,
    )
    .expect("write");
    let out = autopar_ok(&[
        "run",
        "moe-tiny",
        "--plan-file",
        file.to_str().expect("UTF-8 path"),
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(out.contains("ranks: 2 (ep=2)"), "{out}");
    assert!(out.trim_end().ends_with(" OK"), "{out}");
    let err = autopar_err(&["run", "gpt-tiny", "--plan-file", "/nonexistent/plan.json"]);
    assert!(err.contains("cannot read"), "{err}");
    // A misspelt (or retired) key is an error, not a silently different plan.
    std::fs::write(
        &file,
        r#"{"dp":1,"tp":2,"pp":1,"vpp":1,"cp":1,"ep":1,"micro_batch_size":8,"global_batch":8,
            "zero_stage":0,"recompute":"none","sequence_parallel":true,"schedule":"1f1b",
            "dtype":"f32","axis_order":["pp","dp","ep","cp","tp"],"mlp_sequence":true}"#,
    )
    .expect("write");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        file.to_str().expect("UTF-8 path"),
    ]);
    assert!(err.contains("unknown field `mlp_sequence`"), "{err}");
    // What the CPU runtime cannot run is refused by name; fp8 is priced by the cost model
    // only, so a plan file with it is refused, not run in bf16; and so is full recompute of
    // only some layers, where the runtime's pass covers all or none.
    for (name, model, plan, wants) in [
        (
            "auto_refused_cp_moe",
            "moe-tiny",
            "dp=2,ep=2,cp=2,mbs=1,gbs=8,dtype=f32",
            &[
                "cannot run on the CPU runtime",
                "context parallelism (cp=2) in a mixture of experts",
            ][..],
        ),
        (
            "auto_refused_fp8",
            "gpt-tiny",
            "dp=2,mbs=1,gbs=8,dtype=fp8",
            &["dtype=fp8"][..],
        ),
        (
            "auto_refused_partial_recompute",
            "gpt-tiny",
            "dp=2,mbs=1,gbs=8,dtype=f32,recompute=full,recompute_layers=1",
            &[
                "cannot run on the CPU runtime",
                "full recompute of only some layers (recompute_layers=1)",
            ][..],
        ),
    ] {
        let file = plan_file(name, plan);
        let err = autopar_err(&["run", model, "--plan-file", &file]);
        for want in wants {
            assert!(err.contains(want), "{name}: {want} missing from {err}");
        }
    }
}

#[test]
fn a_plan_pipelined_over_data_and_tensor_parallel_ranks_runs_and_verifies() {
    // ZeRO-3 inside the pipeline: every sub-program gathers the weights it uses.
    let file = plan_file(
        "auto_3d_plan",
        "dp=2,tp=2,pp=2,mbs=1,gbs=8,zero=3,dtype=f32",
    );
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        &file,
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(out.contains("pp=2, dp=2, tp=2"), "{out}");
    assert!(out.trim_end().ends_with("OK"), "{out}");
}

#[test]
fn a_plan_with_fixed_stage_layers_runs_with_those_stages() {
    let dir = scratch("auto_stage_layers_plan");
    let file = dir.join("plans.json");
    let model = "gpt:layers=4,hidden=32,heads=2,seq=16,vocab=64";
    let doc = plan_f32_on_two_ranks(model, "4", "pp=2,stages=1-3");
    assert!(doc.contains("\"stage_layers\""), "{doc}");
    std::fs::write(&file, doc).expect("write");
    let out = run_verified(model, "4", file.to_str().expect("UTF-8 path"));
    assert!(out.trim_end().ends_with(" OK"), "{out}");
    // The estimate balances the layers itself when the plan does not fix them, and reports
    // the division it used.
    let json = autopar_ok(&[
        "estimate",
        "gpt:layers=8,hidden=64,heads=4,seq=32,vocab=8192",
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--plan",
        "pp=4,mbs=1,dtype=f32",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    let layers: Vec<u64> = v["stage_layers"]
        .as_array()
        .expect("stage layers")
        .iter()
        .map(|n| n.as_u64().expect("count"))
        .collect();
    assert_eq!(layers.iter().sum::<u64>(), 8);
    assert!(
        layers[3] < 2,
        "the head's stage keeps fewer layers: {layers:?}"
    );
}

/// Llama 3's pipeline: the first virtual stage holds the embedding alone and the last the
/// final norm, head and loss alone (`stages=0-...-0`), interleaved over two ranks; the run
/// verifies against the single-device interpreter.
#[test]
fn a_plan_with_embedding_and_head_stages_of_their_own_runs_and_verifies() {
    let model = "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64";
    let file = plan_file(
        "auto_embedding_head_stages",
        "pp=2,vpp=2,schedule=interleaved,mbs=1,gbs=4,dtype=f32,stages=0-1-1-0",
    );
    let out = run_verified(model, "4", &file);
    assert!(out.contains("ranks: 2 (pp=2)"), "{out}");
    assert!(out.trim_end().ends_with(" OK"), "{out}");
    // The search takes the division as a pin, and a stage without layers anywhere else is
    // refused with the rule.
    let doc = plan_f32_on_two_ranks(model, "4", "pp=2,stages=0-2");
    assert!(doc.contains("\"stage_layers\""), "{doc}");
    let err = autopar_err(&[
        "plan",
        model,
        "--cluster",
        "cpu:ranks=3",
        "--batch",
        "3",
        "--pin",
        "pp=3,stages=1-0-1",
    ]);
    assert!(err.contains("first and last virtual"), "{err}");
}

#[test]
fn a_plan_with_the_mlp_on_sequence_shards_runs_as_planned() {
    let dir = scratch("auto_mlp_seq_plan");
    let file = dir.join("plans.json");
    let doc = plan_f32_on_two_ranks("gpt-tiny", "8", "tp=2,mlp=seq,runtime=cpu");
    let v: serde_json::Value = serde_json::from_str(&doc).expect("JSON");
    let best = &v["plans"][0]["config"];
    assert_eq!(best["layer"]["mlp_in"], "sequence", "{doc}");
    assert_eq!(best["layer"]["mlp_out"], "sequence", "{doc}");
    assert_eq!(best["sequence_parallel"], true, "{doc}");
    std::fs::write(&file, &doc).expect("write");
    let file = file.to_str().expect("UTF-8 path");
    let out = autopar_ok(&["run", "gpt-tiny", "--plan-file", file, "--verify"]);
    assert!(out.trim_end().ends_with(" OK"), "{out}");
}

#[test]
fn a_plan_with_the_attention_core_on_sequence_shards_runs_as_planned() {
    let dir = scratch("auto_attn_seq_plan");
    let file = dir.join("plans.json");
    let doc = plan_f32_on_two_ranks("gpt-tiny", "8", "tp=2,attn=seq,runtime=cpu");
    let v: serde_json::Value = serde_json::from_str(&doc).expect("JSON");
    assert_eq!(
        v["plans"][0]["config"]["layer"]["attention"], "sequence",
        "{doc}"
    );
    std::fs::write(&file, &doc).expect("write");
    let file = file.to_str().expect("UTF-8 path");
    let out = autopar_ok(&["run", "gpt-tiny", "--plan-file", file, "--verify"]);
    assert!(out.trim_end().ends_with(" OK"), "{out}");
}

/// `autopar plan MODEL --cluster cpu:ranks=2 --batch B --dtype f32 --pin PINS --json`.
/// `autopar run MODEL --batch BATCH --plan-file FILE --verify`, which must succeed.
fn run_verified(model: &str, batch: &str, file: &str) -> String {
    autopar_ok(&[
        "run",
        model,
        "--batch",
        batch,
        "--plan-file",
        file,
        "--verify",
    ])
}

fn plan_f32_on_two_ranks(model: &str, batch: &str, pins: &str) -> String {
    autopar_ok(&[
        "plan",
        model,
        "--cluster",
        "cpu:ranks=2",
        "--batch",
        batch,
        "--dtype",
        "f32",
        "--pin",
        pins,
        "--json",
    ])
}

#[test]
fn a_plan_pipelined_over_context_parallel_ranks_keeps_its_cp_axis() {
    // Only pp and cp: every rank of the plan's mesh runs, not a pipeline alone.
    let file = plan_file("auto_pp_cp_plan", "pp=2,cp=2,mbs=4,gbs=8,dtype=f32");
    let out = autopar_ok(&["run", "llama-tiny", "--plan-file", &file, "--verify"]);
    assert!(out.contains("ranks: 4 (pp=2, cp=2)"), "{out}");
    assert!(out.trim_end().ends_with(" OK"), "{out}");
}
