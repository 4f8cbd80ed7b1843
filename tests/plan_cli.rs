//! End-to-end tests of `autopar plan` on the zoo's models: the three workloads, the
//! JSON contract, the exports, the time limit, and no progress output when piped.

mod common;

use common::{autopar, autopar_err, autopar_ok};

/// A small search: GPT-3 13B on two DGX A100 nodes.
const GPT3_13B_ON_16: [&str; 6] = [
    "plan",
    "gpt3-13b",
    "--cluster",
    "dgx-a100:nodes=2",
    "--batch",
    "64",
];

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&autopar_ok(args)).expect("plan --json prints JSON")
}

#[test]
fn gpt3_175b_on_1024_a100s_beats_the_hand_tuned_plan_and_says_why() {
    let base = [
        "gpt3-175b",
        "--cluster",
        "dgx-a100:nodes=128",
        "--batch",
        "1536",
    ];
    let text = autopar_ok(&[&["plan"][..], &base].concat());
    assert!(text.contains("the space was fully explored"), "{text}");
    assert!(text.contains("best plan: dp="), "{text}");
    assert!(text.contains("The deciding term is "), "{text}");
    assert!(text.contains("against the runner-up (#2)"), "{text}");
    assert!(text.contains("Megatron-style reference"), "{text}");

    let doc = json(&[&["plan"][..], &base, &["--json"]].concat());
    let plans = doc["plans"].as_array().expect("plans");
    assert!(!plans.is_empty());
    assert!(plans.iter().all(|p| p["estimate"]["fits"] == true));
    let best = plans[0]["estimate"]["tokens_per_s"]
        .as_f64()
        .expect("tokens/s");
    let hand = json(
        &[
            &["estimate"][..],
            &base,
            &[
                "--plan",
                "dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,schedule=interleaved",
                "--json",
            ],
        ]
        .concat(),
    );
    let hand = hand["tokens_per_s"].as_f64().expect("tokens/s");
    assert!(best >= hand, "{best} < {hand}");
    assert_eq!(doc["stats"]["complete"], true);
    assert!(
        doc["explanations"][0]["deciding"].is_string(),
        "{}",
        doc["explanations"]
    );
    // The estimate of the best plan, given back to `estimate`, is the same.
    let plan = plans[0]["plan"].as_str().expect("plan text");
    let again = json(&[&["estimate"][..], &base, &["--plan", plan, "--json"]].concat());
    assert_eq!(again["iter_time_s"], plans[0]["estimate"]["iter_time_s"]);
}

#[test]
fn llama3_70b_and_mixtral_plans_fit() {
    for (model, cluster, batch) in [
        ("llama3-70b", "dgx-h100:nodes=8", "512"),
        ("mixtral-8x7b", "dgx-h100:nodes=4", "256"),
    ] {
        let doc = json(&[
            "plan",
            model,
            "--cluster",
            cluster,
            "--batch",
            batch,
            "--top",
            "3",
            "--json",
        ]);
        let plans = doc["plans"].as_array().expect("plans");
        assert_eq!(plans.len(), 3, "{model}");
        for p in plans {
            assert_eq!(p["estimate"]["fits"], true, "{model}");
            assert!(p["estimate"]["peak_memory_gib"].as_f64().expect("memory") <= 80.0);
        }
    }
}

#[test]
fn exports_name_the_frameworks_options() {
    let base = [
        "plan",
        "llama3-70b",
        "--cluster",
        "dgx-h100:nodes=8",
        "--batch",
        "512",
    ];
    let megatron = autopar_ok(&[&base[..], &["--export", "megatron"]].concat());
    for want in [
        "--tensor-model-parallel-size ",
        "--pipeline-model-parallel-size ",
        "--context-parallel-size ",
        "--micro-batch-size ",
        "--global-batch-size 512",
        "--bf16",
        "--group-query-attention",
    ] {
        assert!(megatron.contains(want), "{want} missing:\n{megatron}");
    }
    let titan = autopar_ok(&[&base[..], &["--export", "torchtitan"]].concat());
    for want in [
        "[training]",
        "global_batch_size = 512",
        "mixed_precision_param = \"bfloat16\"",
        "[parallelism]",
        "data_parallel_shard_degree = ",
        "tensor_parallel_degree = ",
        "pipeline_parallel_degree = ",
        "context_parallel_degree = ",
        "[activation_checkpoint]",
    ] {
        assert!(titan.contains(want), "{want} missing:\n{titan}");
    }
}

#[test]
fn pins_time_limits_and_piped_output() {
    let base = GPT3_13B_ON_16;
    let out = autopar(&[&base[..], &["--pin", "tp=2,recompute=full", "--top", "5"]].concat());
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    // No progress bar when stderr is not a terminal.
    assert!(!String::from_utf8_lossy(&out.stderr).contains('\r'));
    // The header names the stack the plans are priced for.
    assert!(
        text.lines()
            .next()
            .is_some_and(|l| l.ends_with("priced for the `autopar` stack")),
        "{text}"
    );
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert_eq!(rows.len(), 5, "{text}");
    for r in rows {
        let cols: Vec<&str> = r.split_whitespace().collect();
        assert_eq!((cols[2], cols[9]), ("2", "full"), "{r}");
    }
    let err = autopar_err(&[&base[..], &["--max-seconds", "0"]].concat());
    assert!(err.contains("--max-seconds"), "{err}");
    let err = autopar_err(&[&base[..], &["--pin", "tp=x"]].concat());
    assert!(err.contains("constraint `tp`"), "{err}");
}

#[test]
fn layer_placements_are_searched_pinned_and_explained() {
    let base = [&GPT3_13B_ON_16[..], &["--top", "5"]].concat();
    // Ulysses-style attention pinned: every plan has it (so tp > 1), and the best is compared
    // with the same plan with every op split over tp.
    let pinned = [&base[..], &["--pin", "attn=ulysses"]].concat();
    let doc = json(&[&pinned[..], &["--json"]].concat());
    let plans = doc["plans"].as_array().expect("plans");
    assert!(!plans.is_empty(), "{doc}");
    for p in plans {
        let layer = &p["config"]["layer"];
        assert_eq!(layer["qkv"], "sequence", "{p}");
        assert_eq!(layer["attention"], "tensor", "{p}");
        assert_eq!(layer["proj"], "sequence", "{p}");
        assert!(
            p["plan"].as_str().expect("text").contains("attn=sts"),
            "{p}"
        );
    }
    let text = autopar_ok(&pinned);
    assert!(text.contains("sts-"), "{text}");
    assert!(
        text.contains("against the same plan with every op split over tp"),
        "{text}"
    );
    let err = autopar_err(&[&base[..], &["--pin", "attn=xyz"]].concat());
    assert!(err.contains("attn") && err.contains("3 letters"), "{err}");
}

/// Every ranked plan comes with its predicted range (the step with the profile's overlap and
/// with none); `--robust` ranks by the pessimistic end; `--explain` says how much of the lead
/// over the runner-up depends on overlap.
#[test]
fn ranges_robust_ranking_and_overlap_explained() {
    let base = [&GPT3_13B_ON_16[..], &["--top", "4"]].concat();
    let range = |p: &serde_json::Value| {
        let r = &p["step_s_range"];
        let (a, b) = (
            r["overlapped"].as_f64().expect("overlapped"),
            r["no_overlap"].as_f64().expect("no_overlap"),
        );
        assert!(a > 0.0 && a <= b * (1.0 + 1e-9), "{p}");
        (a, b)
    };
    let doc = json(&[&base[..], &["--json", "--explain"]].concat());
    assert_eq!(doc["ranked_by"], "overlapped");
    let plans = doc["plans"].as_array().expect("plans");
    assert!(plans.len() >= 2, "{doc}");
    for p in plans {
        let (a, _) = range(p);
        let t = p["estimate"]["iter_time_s"].as_f64().expect("time");
        assert!((a - t).abs() <= 1e-9 * t, "{p}");
    }
    let notes: Vec<&str> = doc["overlap"]
        .as_array()
        .expect("--explain notes")
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("lead over the runner-up")),
        "{notes:?}"
    );

    let doc = json(&[&base[..], &["--json", "--robust"]].concat());
    assert_eq!(doc["ranked_by"], "no_overlap");
    let ends: Vec<f64> = doc["plans"]
        .as_array()
        .expect("plans")
        .iter()
        .map(|p| range(p).1)
        .collect();
    assert!(
        ends.windows(2).all(|w| w[0] <= w[1] * (1.0 + 1e-9)),
        "{ends:?}"
    );

    let text = autopar_ok(&[&base[..], &["--explain"]].concat());
    assert!(text.contains("range (no overlap)"), "{text}");
    assert!(text.contains("what rests on overlap"), "{text}");
}
