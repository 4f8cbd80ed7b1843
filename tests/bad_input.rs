//! The hostile-input harness: hundreds of bad inputs over every input surface of the command
//! line (model specs, `.air` and `.json` graphs, meshes, options and their edge values, plan
//! files, annotation files, cluster presets and TOML files, checkpoints and data files).
//!
//! Every case must fail as a user error: a non-zero exit code (not a signal), an error whose
//! first paragraph names the offending input (each case says what it must contain), no
//! panic, an end within [`TIMEOUT`] (a hang is killed and reported), and no more address
//! space than [`MEMORY_LIMIT_KIB`] (the child runs under `ulimit -v`, so an attempt to
//! allocate a model that does not fit aborts instead of refusing, and fails the case). The
//! cases run four at a time; all of them fail fast, so the whole table takes seconds.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long one case may run.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The address space of one case (4 GiB).
const MEMORY_LIMIT_KIB: u64 = 4 << 20;
/// The fewest cases the table must hold.
const MIN_CASES: usize = 150;

/// One bad input: the arguments (`{d}` is the scratch directory) and what the first
/// paragraph of the error must contain.
struct Case {
    args: Vec<String>,
    needle: String,
}

struct Table {
    dir: String,
    cases: Vec<Case>,
}

impl Table {
    fn add(&mut self, args: &[&str], needle: &str) {
        let fill = |s: &str| s.replace("{d}", &self.dir);
        let case = Case {
            args: args.iter().map(|a| fill(a)).collect(),
            needle: fill(needle),
        };
        self.cases.push(case);
    }
}

fn write(dir: &Path, name: &str, contents: impl AsRef<[u8]>) {
    std::fs::write(dir.join(name), contents).expect("a fixture is written");
}

/// The stdout of a successful `autopar` run (the valid inputs the bad ones are made from).
fn output_of(args: &[&str]) -> String {
    common::autopar_ok(args)
}

/// `text` with `old` replaced once by `new`; `old` must be there, so that no case is
/// silently the valid input.
fn replaced(text: &str, old: &str, new: &str) -> String {
    assert!(text.contains(old), "`{old}` is not in the valid input");
    text.replacen(old, new, 1)
}

const SPECS: &[&str] = &[
    "",
    " ",
    ":",
    "gpt",
    "gpt:",
    "gpt:layers=2",
    "gpt:layers=0,hidden=64,heads=4,seq=32,vocab=256",
    "gpt:layers=x,hidden=64,heads=4,seq=32,vocab=256",
    "gpt:layers=-1,hidden=64,heads=4,seq=32,vocab=256",
    "gpt:layers=2,hidden=63,heads=4,seq=32,vocab=256",
    "gpt:layers=2,hidden=64,heads=0,seq=32,vocab=256",
    "gpt:layers=2,hidden=64,heads=4,seq=0,vocab=256",
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=0",
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256,colour=red",
    "gpt:layers=2,layers=3,hidden=64,heads=4,seq=32,vocab=256",
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256,ffn=0",
    "gpt:layers=18446744073709551615,hidden=64,heads=4,seq=32,vocab=256",
    "gpt:layers=99999999999999999999,hidden=64,heads=4,seq=32,vocab=256",
    "gpt:layers=2,hidden=4294967296,heads=1,seq=4294967296,vocab=256",
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=18446744073709551615",
    "gpt:layers=2;hidden=64",
    "gpt:layers==2,hidden=64,heads=4,seq=32,vocab=256",
    "llama:layers=2,hidden=64,heads=4,seq=32,vocab=256",
    "llama:layers=2,hidden=64,heads=4,kv_heads=3,ffn=128,seq=32,vocab=256",
    "llama:layers=2,hidden=60,heads=4,ffn=128,seq=32,vocab=256",
    "llama:layers=2,hidden=64,heads=4,ffn=128,seq=32,vocab=256,rope_base=nan",
    "llama:layers=2,hidden=64,heads=4,ffn=128,seq=32,vocab=256,rope_base=-1",
    "llama:layers=2,hidden=64,heads=4,ffn=128,seq=32,vocab=256,rope_base=inf",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=5",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=0,top_k=1",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,capacity_factor=0",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,style=bert",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,normalize=maybe",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,shared_ffn=0",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,shared_ffn=-8",
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256,shared_ffn=8",
    "mlp:in=0,hidden=4,out=2",
    "mlp:in=4",
    "gpt-tiny:foo=1",
    "gpt-tiny:layers=",
    "gpt-tiny:layers=0",
    "gpt3-175b:experts=8",
    "gpt-tiny:heads=3",
];

/// Text IR files: (file, contents).
const AIRS: &[(&str, &str)] = &[
    ("empty.air", ""),
    ("space.air", "   \n\n"),
    ("garbage.air", "hello world\n"),
    ("open.air", "graph \"g\" {\n"),
    ("noname.air", "graph {\n}\n"),
    (
        "unknown_op.air",
        "graph \"g\" {\n  %0: f32[2] = frobnicate\n}\n",
    ),
    (
        "undefined.air",
        r#"graph "g" {
  %0: f32[2] = input {name="x", role=features}
  %1: f32[2] = add %0, %9
  output "loss" = %1
}
"#,
    ),
    (
        "twice.air",
        r#"graph "g" {
  %0: f32[2] = input {name="x", role=features}
  %0: f32[2] = input {name="y", role=features}
}
"#,
    ),
    (
        "dtype.air",
        "graph \"g\" {\n  %0: f33[2] = input {name=\"x\", role=features}\n}\n",
    ),
    (
        "neg.air",
        "graph \"g\" {\n  %0: f32[-2] = input {name=\"x\", role=features}\n}\n",
    ),
    (
        "bigint.air",
        "graph \"g\" {\n  %0: f32[99999999999999999999] = input {name=\"x\", role=features}\n}\n",
    ),
    (
        "huge.air",
        r#"graph "g" {
  %0: f32[4294967296,4294967296] = input {name="x", role=features}
  %1: f32[] = reduce_mean %0 {dims=[0,1]}
  output "loss" = %1
}
"#,
    ),
    (
        "overflow.air",
        r#"graph "g" {
  %0: f32[18446744073709551615,18446744073709551615,2] = input {name="x", role=features}
}
"#,
    ),
    (
        "hugeid.air",
        r#"graph "g" {
  %4294967295: f32[2] = input {name="x", role=features}
  output "loss" = %4294967295
}
"#,
    ),
    (
        "hugeid2.air",
        "graph \"g\" {\n  %99999999999: f32[2] = input {name=\"x\", role=features}\n}\n",
    ),
    (
        "wrongtype.air",
        r#"graph "g" {
  %0: f32[2] = input {name="x", role=features}
  %1: f32[3] = neg %0
  output "loss" = %1
}
"#,
    ),
    (
        "badout.air",
        "graph \"g\" {\n  %0: f32[2] = input {name=\"x\", role=features}\n  output \"loss\" = %5\n}\n",
    ),
    (
        "dupout.air",
        r#"graph "g" {
  %0: f32[] = input {name="x", role=features}
  output "loss" = %0
  output "loss" = %0
}
"#,
    ),
    ("unterminated.air", "graph \"g {\n}\n"),
    (
        "badattr.air",
        "graph \"g\" {\n  %0: f32[2] = input {name=\"x\", role=wizard}\n}\n",
    ),
    (
        "badsharding.air",
        "graph \"g\" {\n  %0: f32[2] user{tp: S(9)} = input {name=\"x\", role=features}\n}\n",
    ),
    (
        "badinit.air",
        "graph \"g\" {\n  %0: f32[2] = parameter {name=\"w\", init=normal(nan)}\n}\n",
    ),
    ("nul.air", "graph \"g\" {\u{0}\n}\n"),
    (
        "einsum.air",
        r#"graph "g" {
  %0: f32[2,3] = input {name="x", role=features}
  %1: f32[2,3] = einsum %0, %0 {spec="ab,bc->ac"}
}
"#,
    ),
    (
        "reshape.air",
        r#"graph "g" {
  %0: f32[2,3] = input {name="x", role=features}
  %1: f32[7] = reshape %0 {shape=[7]}
}
"#,
    ),
    (
        "slice.air",
        r#"graph "g" {
  %0: f32[2,3] = input {name="x", role=features}
  %1: f32[2,9] = slice %0 {dim=1, start=0, end=9}
}
"#,
    ),
    (
        "noloss.air",
        "graph \"g\" {\n  %0: f32[2] = input {name=\"x\", role=features}\n}\n",
    ),
];

/// A graph that parses and types, whose tensors fit the IR but not any machine.
const BIG_AIR: &str = r#"graph "big" {
  %0: f32[100000,100000] = input {name="x", role=features}
  %1: f32[100000,100000] = parameter {name="w", init=normal(0.02)}
  %2: f32[100000,100000] = mul %0, %1
  %3: f32[] = reduce_mean %2 {dims=[0,1]}
  output "loss" = %3
}
"#;

/// Annotation files: (file, contents, what the error names).
const ANNOTATIONS: &[(&str, &[u8], &str)] = &[
    ("a_unknown.txt", b"h.9.mlp.w1: tp=S(1)\n", "`h.9.mlp.w1`"),
    ("a_axis.txt", b"h.0.mlp.w1: cp=S(1)\n", "`cp`"),
    ("a_dim.txt", b"h.0.mlp.w1: tp=S(9)\n", "S(9)"),
    ("a_syntax.txt", b"h.0.mlp.w1 tp=S(1)\n", "a_syntax.txt"),
    ("a_place.txt", b"h.0.mlp.w1: tp=Q(1)\n", "a_place.txt"),
    ("a_partial.txt", b"h.0.mlp.w1: tp=P(max)\n", "`h.0.mlp.w1`"),
    ("a_empty_name.txt", b": tp=S(1)\n", "a_empty_name.txt"),
    (
        "a_twice.txt",
        b"h.0.mlp.w1: tp=S(1), tp=S(0)\n",
        "a_twice.txt",
    ),
    ("a_uneven.txt", b"h.0.ln1.g: tp=S(0)\n", "`tp`"),
    ("a_mesh.txt", b"mesh: tp=3\n", "a_mesh.txt"),
    ("a_bin.txt", b"\xff\xfe\x00\n", "a_bin.txt"),
    ("a_neg.txt", b"h.0.mlp.w1: tp=S(-1)\n", "a_neg.txt"),
];

/// Bad values of plan file keys, each written as `p_<key>_<n>.json`.
fn plan_mutations() -> Vec<(&'static str, Value)> {
    vec![
        ("dp", json!(0)),
        ("tp", json!(0)),
        ("pp", json!(0)),
        ("micro_batch_size", json!(0)),
        ("micro_batch_size", json!(3)),
        ("global_batch", json!(0)),
        ("global_batch", json!(u64::MAX)),
        ("zero_stage", json!(7)),
        ("dtype", json!("f64")),
        ("schedule", json!("zigzag")),
        ("recompute", json!("always")),
        ("axis_order", json!(["pp", "dp", "xp", "cp", "tp"])),
        ("tp", json!(3)),
        ("dp", json!(3)),
        ("vpp", json!(0)),
        ("ep", json!(3)),
        ("cp", json!(3)),
        ("dp", json!(-1)),
        ("tp", json!("two")),
        ("axis_order", json!([])),
        ("stage_layers", json!([1])),
        ("bogus_key", json!(1)),
        ("dp", json!(u64::MAX)),
        ("sequence_parallel", json!("yes")),
    ]
}

/// Cluster TOML files: (file, the valid text's line, its replacement).
const TOMLS: &[(&str, &str, &str)] = &[
    ("t_nodes0.toml", "nodes = 2", "nodes = 0"),
    ("t_gpus0.toml", "gpus_per_node = 8", "gpus_per_node = 0"),
    (
        "t_neg_bw.toml",
        "hbm_bandwidth_gb_per_s = ",
        "hbm_bandwidth_gb_per_s = -",
    ),
    (
        "t_nan.toml",
        "hbm_capacity_gib = 80.0",
        "hbm_capacity_gib = nan",
    ),
    (
        "t_inf.toml",
        "hbm_capacity_gib = 80.0",
        "hbm_capacity_gib = inf",
    ),
    (
        "t_unknown.toml",
        "nodes = 2",
        "nodes = 2\ncolour = \"green\"",
    ),
    (
        "t_hugenodes.toml",
        "nodes = 2",
        "nodes = 18446744073709551615",
    ),
    (
        "t_overflow.toml",
        "gpus_per_node = 8",
        "gpus_per_node = 9223372036854775807",
    ),
    (
        "t_nic_map.toml",
        "[network]",
        "[network]\ngpu_to_nic = [0, 1]",
    ),
    (
        "t_nic_index.toml",
        "[network]",
        "[network]\ngpu_to_nic = [0, 0, 0, 0, 0, 0, 0, 99]",
    ),
    (
        "t_reserved.toml",
        "reserved_gib = 2.0",
        "reserved_gib = 500.0",
    ),
    ("t_nics0.toml", "nics_per_node = 8", "nics_per_node = 0"),
    (
        "t_nics_huge.toml",
        "nics_per_node = 8",
        "nics_per_node = 18446744073709551615",
    ),
    ("t_type.toml", "nodes = 2", "nodes = \"two\""),
    ("t_dup.toml", "nodes = 2", "nodes = 2\nnodes = 3"),
    ("t_latency.toml", "latency_us = 5.0", "latency_us = -1.0"),
    (
        "t_runtime.toml",
        "nodes = 2",
        "nodes = 2\nruntime = \"tpu\"",
    ),
    ("t_sms0.toml", "sms = 108", "sms = 0"),
];

/// Writes every fixture into `dir` and returns the table of cases.
fn table(dir: &Path) -> Table {
    let mut t = Table {
        dir: dir.to_str().expect("a UTF-8 scratch path").to_string(),
        cases: Vec::new(),
    };
    const M: &str = "gpt-tiny";

    // Model specs, presets and files that do not exist.
    for spec in SPECS {
        let needle = if spec.trim().is_empty() {
            "model"
        } else {
            spec.trim()
        };
        t.add(&["dump", spec], needle);
    }
    for (name, needle) in [
        ("bert:layers=2", "`bert`"),
        ("gpt-huge", "`gpt-huge`"),
        ("GPT-TINY", "`GPT-TINY`"),
    ] {
        t.add(&["dump", name], needle);
    }
    t.add(&["dump", "{d}/missing.air"], "missing.air");
    t.add(&["dump", "{d}/missing.json"], "missing.json");
    t.add(&["dump", "{d}"], "{d}");

    // Text IR.
    for (name, text) in AIRS {
        write(dir, name, text);
        if *name != "noloss.air" {
            t.add(&["dump", &format!("{{d}}/{name}")], name);
        }
    }
    write(
        dir,
        "nested.air",
        format!(
            "graph \"g\" {{\n  %1: f32[2] = add {}\n}}\n",
            "(".repeat(5000)
        ),
    );
    t.add(&["dump", "{d}/nested.air"], "nested.air");
    write(dir, "deep.air", "[".repeat(100_000));
    t.add(&["dump", "{d}/deep.air"], "deep.air");
    for name in ["huge.air", "overflow.air", "hugeid.air"] {
        let file = format!("{{d}}/{name}");
        t.add(&["run", &file, "--forward"], name);
        t.add(&["run", &file, "--steps", "1"], name);
    }
    t.add(&["run", "{d}/noloss.air", "--forward"], "`loss`");
    t.add(&["run", "{d}/noloss.air", "--steps", "1"], "`loss`");
    write(dir, "big.air", BIG_AIR);
    t.add(
        &["run", "{d}/big.air", "--forward"],
        "the step needs at least",
    );
    t.add(
        &["run", "{d}/big.air", "--mesh", "dp=2", "--steps", "1"],
        "the step needs at least",
    );
    t.add(
        &["run", "gpt3-175b", "--forward"],
        "the step needs at least",
    );
    t.add(
        &[
            "estimate",
            "{d}/noloss.air",
            "--cluster",
            "cpu:ranks=2",
            "--batch",
            "8",
        ],
        "transformer",
    );

    // JSON graphs, made from a valid dump.
    let graph: Value = serde_json::from_str(&output_of(&["dump", "mlp-tiny", "--format", "json"]))
        .expect("the JSON dump parses");
    let mutated = |f: &dyn Fn(&mut Value)| {
        let mut g = graph.clone();
        f(&mut g);
        assert_ne!(g, graph, "a JSON case is the valid graph");
        g.to_string()
    };
    let jsons: Vec<(&str, String)> = vec![
        ("j_empty.json", String::new()),
        ("j_brace.json", "{".into()),
        ("j_array.json", "[]".into()),
        ("j_null.json", "null".into()),
        ("j_obj.json", "{}".into()),
        ("j_string.json", "\"graph\"".into()),
        ("j_deep.json", "[".repeat(100_000)),
        ("j_trunc.json", graph.to_string()[..500].to_string()),
        ("j_format.json", mutated(&|g| g["format"] = json!("onnx"))),
        ("j_version.json", mutated(&|g| g["version"] = json!(99))),
        (
            "j_dtype.json",
            mutated(&|g| g["nodes"][0]["op"]["ty"]["dtype"] = json!("f99")),
        ),
        (
            "j_shape.json",
            mutated(&|g| g["nodes"][0]["op"]["ty"]["shape"] = json!([8, 33])),
        ),
        (
            "j_huge.json",
            mutated(&|g| {
                let huge = json!([u64::MAX, u64::MAX]);
                g["nodes"][0]["op"]["ty"]["shape"] = huge.clone();
                g["nodes"][0]["outputs"][0]["type"]["shape"] = huge;
            }),
        ),
        (
            "j_op.json",
            mutated(&|g| g["nodes"][4]["op"]["op"] = json!("frobnicate")),
        ),
        (
            "j_input.json",
            mutated(&|g| g["nodes"][4]["inputs"] = json!([999])),
        ),
        ("j_nodes.json", mutated(&|g| g["nodes"] = json!("many"))),
    ];
    for (name, text) in &jsons {
        write(dir, name, text);
        t.add(&["dump", &format!("{{d}}/{name}")], name);
    }
    t.add(&["run", "{d}/j_huge.json", "--forward"], "j_huge.json");

    // Meshes.
    for (mesh, needle) in [
        ("", "mesh"),
        (",", "mesh"),
        ("dp", "dp"),
        ("dp=", "dp="),
        ("=2", "=2"),
        ("dp=0", "dp=0"),
        ("dp=-1", "dp=-1"),
        ("dp=x", "dp=x"),
        ("dp=2.5", "dp=2.5"),
        ("foo=2", "foo=2"),
        ("DP=2", "DP=2"),
        ("dp=2,dp=2", "dp"),
        ("dp=2,,tp=2", "dp=2"),
        ("dp=99999999999", "dp=99999999999"),
        ("dp=18446744073709551615", "dp=18446744073709551615"),
        ("dp=65536,tp=65536", "dp=65536"),
        ("tp=3", "`tp`"),
        ("tp=8", "`tp`"),
        ("pp=8", "pipeline stages"),
        ("dp=3", "`dp`"),
        ("cp=3", "`cp`"),
        ("ep=2", "`ep`"),
        ("dp=2;tp=2", "dp=2;tp=2"),
        ("dp=2 tp=2", "dp=2"),
        ("d p=2", "d p=2"),
    ] {
        t.add(&["run", M, "--mesh", mesh, "--steps", "1"], needle);
    }
    // A shared expert whose width `tp` does not divide: the weight, dim and axis are named.
    let shared = "moe:layers=1,hidden=64,heads=4,seq=32,vocab=256,experts=4,top_k=2,ffn=128,\
                  shared_ffn=30";
    t.add(
        &["run", shared, "--mesh", "tp=4", "--steps", "1"],
        "`h.0.mlp.shared.w1` (f32[64,30]): dim 1",
    );

    // Options of run and dump, and their edge values.
    let options: &[(&[&str], &str)] = &[
        (&["run", M, "--steps", "-1"], "-1"),
        (&["run", M, "--steps", "x"], "--steps"),
        (&["run", M, "--steps", "0"], "--steps 0"),
        (&["run", M, "--steps", "18446744073709551616"], "--steps"),
        (&["run", M, "--lr", "nan"], "lr"),
        (&["run", M, "--lr", "-1"], "-1"),
        (&["run", M, "--lr", "inf"], "lr"),
        (&["run", M, "--lr", "0"], "lr"),
        (&["run", M, "--lr", "1e400"], "lr"),
        (&["run", M, "--clip-norm", "-1"], "-1"),
        (&["run", M, "--clip-norm", "nan"], "clip"),
        (&["run", M, "--dtype", "f64"], "--dtype"),
        (&["run", M, "--dtype", "f16", "--loss-scale", "0"], "loss"),
        (&["run", M, "--dtype", "f16", "--loss-scale", "nan"], "loss"),
        (&["run", M, "--dtype", "f16", "--loss-scale", "-5"], "-5"),
        (&["run", M, "--loss-scale", "1024"], "--loss-scale"),
        (&["run", M, "--lr-schedule", "step"], "--lr-schedule"),
        (&["run", M, "--min-lr", "1e-4"], "--min-lr"),
        (&["run", M, "--lr-decay-steps", "10"], "--lr-decay-steps"),
        (
            &[
                "run",
                M,
                "--lr-schedule",
                "cosine",
                "--steps",
                "4",
                "--warmup",
                "4",
            ],
            "warmup",
        ),
        (
            &["run", M, "--lr-schedule", "cosine", "--min-lr", "1"],
            "--min-lr",
        ),
        (
            &["run", M, "--lr-schedule", "linear", "--min-lr", "nan"],
            "--min-lr",
        ),
        (
            &["run", M, "--lr-schedule", "cosine", "--lr-decay-steps", "0"],
            "decay",
        ),
        (&["run", M, "--warmup", "-1"], "-1"),
        (
            &["dump", M, "--stage", "train", "--lr-schedule", "cosine"],
            "--lr-decay-steps",
        ),
        (&["run", M, "--micro-batches", "0"], "micro"),
        (&["run", M, "--micro-batches", "3"], "micro"),
        (&["run", M, "--micro-batches", "9"], "micro"),
        (&["run", M, "--batch", "0"], "--batch"),
        (&["run", M, "--batch", "18446744073709551615"], "--batch"),
        (&["run", M, "--batch", "-3"], "-3"),
        (
            &["run", M, "--batch", "16777216"],
            "the step needs at least",
        ),
        (&["run", M, "--mesh", "pp=2", "--vpp", "0"], "--vpp"),
        (&["run", M, "--mesh", "pp=2", "--vpp", "2"], "interleaved"),
        (
            &["run", M, "--mesh", "pp=2", "--schedule", "zigzag"],
            "zigzag",
        ),
        (
            &["run", M, "--mesh", "pp=2", "--stage-boundaries", "h.9"],
            "h.9",
        ),
        (
            &[
                "run",
                M,
                "--mesh",
                "pp=2",
                "--micro-batches",
                "3",
                "--schedule",
                "interleaved",
                "--vpp",
                "2",
            ],
            "micro",
        ),
        (&["run", M, "--mesh", "dp=2", "--zero", "4"], "zero"),
        (&["run", M, "--zero", "1"], "--mesh"),
        (&["run", M, "--mesh", "tp=2", "--attn", "xyz"], "xyz"),
        (&["run", M, "--mesh", "tp=2", "--mlp", "ttt"], "ttt"),
        (
            &["run", M, "--mesh", "dp=2", "--trace", "{d}/nodir/x.json"],
            "--trace",
        ),
        (
            &["run", M, "--mesh", "pp=2", "--trace", "{d}/nodir/x.json"],
            "nodir",
        ),
        (
            &["run", M, "--mesh", "pp=2", "--report", "{d}/nodir/r.html"],
            "nodir",
        ),
        (&["run", M, "--verify"], "--verify"),
        (&["run", M, "--forward", "--mesh", "pp=2"], "forward"),
        (
            &["run", M, "--data", "{d}/missing.safetensors"],
            "missing.safetensors",
        ),
        (&["run", M, "--data", "{d}/garbage.air"], "garbage.air"),
        (&["run", M, "--init-from", "{d}/garbage.air"], "garbage.air"),
        (&["run", M, "--resume", "{d}/nockpt"], "nockpt"),
        (
            &[
                "run",
                M,
                "--checkpoint",
                "{d}/garbage.air/x",
                "--steps",
                "1",
            ],
            "garbage.air",
        ),
        (
            &["run", M, "--checkpoint", "{d}/ck", "--save-every", "0"],
            "save",
        ),
        (&["run", M, "--auto"], "--cluster"),
        (&["run", M, "--auto", "--cluster", "cpu:ranks=0"], "ranks"),
        (
            &[
                "dump",
                M,
                "--stage",
                "partitioned",
                "--mesh",
                "tp=2",
                "--rank",
                "2",
            ],
            "--rank 2",
        ),
        (
            &[
                "dump",
                M,
                "--stage",
                "partitioned",
                "--mesh",
                "tp=2",
                "--rank",
                "18446744073709551616",
            ],
            "--rank",
        ),
        (&["dump", M, "--stage", "sharded"], "mesh"),
        (&["dump", M, "--stage", "pipeline", "--mesh", "dp=2"], "pp"),
        (&["dump", M, "--stage", "bogus"], "bogus"),
        (&["dump", M, "--format", "yaml"], "yaml"),
        (&["dump", M, "--mesh", "dp=2", "--zero", "3"], "--mesh"),
        (
            &["dump", M, "--stage", "train", "--mesh", "tp=2", "--sp"],
            "--mesh",
        ),
        (
            &[
                "dump", M, "--stage", "schedule", "--mesh", "pp=2", "--format", "json",
            ],
            "--format",
        ),
        (
            &["dump", M, "--stage", "train", "--loss-scale", "4"],
            "--loss-scale",
        ),
        (&["dump", M, "-o", "{d}/nodir/out.air"], "nodir"),
        (
            &["dump", M, "--stage", "train", "--dump-after", "bogus"],
            "--dump-after",
        ),
        (&["run", M, "--dump-after", "bogus"], "bogus"),
        (&["models", "--format", "x"], "--format"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, needle) in options {
        t.add(args, needle);
    }

    // Plan files, made from a plan the search saves.
    let doc: Value = serde_json::from_str(&output_of(&[
        "plan",
        M,
        "--cluster",
        "cpu:ranks=2",
        "--batch",
        "8",
        "--dtype",
        "f32",
        "--pin",
        "runtime=cpu",
        "--json",
    ]))
    .expect("plan --json parses");
    let plan = doc["plans"][0]["config"].clone();
    assert!(plan.is_object(), "{doc}");
    write(dir, "p_ok.json", plan.to_string());
    for (name, text) in [
        ("p_empty.json", ""),
        ("p_garbage.json", "not json"),
        ("p_array.json", "[]"),
        ("p_null.json", "null"),
        ("p_noplans.json", "{\"plans\": []}"),
    ] {
        write(dir, name, text);
        t.add(&["run", M, "--plan-file", &format!("{{d}}/{name}")], name);
    }
    t.add(
        &["run", M, "--plan-file", "{d}/missing_plan.json"],
        "missing_plan.json",
    );
    for (i, (key, value)) in plan_mutations().into_iter().enumerate() {
        let mut bad = plan.clone();
        bad[key] = value;
        assert_ne!(bad, plan, "plan case {key} is the valid plan");
        let name = format!("p_{key}_{i}.json");
        write(dir, &name, bad.to_string());
        t.add(&["run", M, "--plan-file", &format!("{{d}}/{name}")], &name);
    }
    for (flag, value) in [
        ("--dtype", "bf16"),
        ("--micro-batches", "2"),
        ("--loss-scale", "8"),
    ] {
        t.add(
            &["run", M, "--plan-file", "{d}/p_ok.json", flag, value],
            flag,
        );
    }

    // Annotation files.
    for (name, text, needle) in ANNOTATIONS {
        write(dir, name, text);
        let file = format!("{{d}}/{name}");
        t.add(
            &[
                "run",
                M,
                "--mesh",
                "tp=2",
                "--annotate",
                &file,
                "--steps",
                "1",
            ],
            needle,
        );
    }
    write(dir, "a_mesh_bad.txt", "mesh: tp=2,tp=4\n");
    t.add(
        &[
            "run",
            M,
            "--mesh",
            "tp=2",
            "--annotate",
            "{d}/missing_ann.txt",
        ],
        "missing_ann.txt",
    );
    let plan_cmd = [
        "plan",
        M,
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--annotate",
    ];
    for (file, needle) in [
        ("{d}/a_unknown.txt", "a_unknown.txt"),
        ("{d}/a_mesh_bad.txt", "a_mesh_bad.txt"),
        ("{d}/a_syntax.txt", "a_syntax.txt"),
    ] {
        let mut args = plan_cmd.to_vec();
        args.push(file);
        t.add(&args, needle);
    }

    // Cluster presets and TOML files.
    for preset in [
        "",
        "tpu",
        "dgx-a100:nodes=0",
        "dgx-a100:nodes=x",
        "dgx-a100:ranks=2",
        "cpu:nodes=2",
        "dgx-a100:nodes=2,nodes=4",
        "dgx-h100:nodes=18446744073709551615",
        "dgx-h100:nodes=18446744073709551616",
        "dgx-h100:nodes=-1",
        "dgx-h100:nodes=4194304",
        "cpu:ranks=0",
        "cpu:ranks=99999999",
        "dgx-a100:nodes",
        "dgx-a100:=4",
        "dgx-a100:nodes=2,,",
        "DGX-A100:nodes=2",
        "dgx-h100:nodes=2,power=900",
        "dgx-h100:power=-5",
        "dgx-h100:power=nan",
        "dgx-b200:power=500",
    ] {
        let needle = if preset.is_empty() { "cluster" } else { preset };
        t.add(&["topo", preset], needle);
        t.add(
            &["estimate", M, "--cluster", preset, "--batch", "8"],
            needle,
        );
    }
    t.add(
        &[
            "plan",
            M,
            "--cluster",
            "dgx-h100:nodes=18446744073709551615",
            "--batch",
            "8",
        ],
        "dgx-h100",
    );
    t.add(&["topo", "{d}/missing.toml"], "missing.toml");
    let toml = output_of(&["topo", "dgx-a100:nodes=2", "--toml"]);
    write(dir, "t_empty.toml", "");
    write(dir, "t_garbage.toml", "[[[\n");
    t.add(&["topo", "{d}/t_empty.toml"], "t_empty.toml");
    t.add(&["topo", "{d}/t_garbage.toml"], "t_garbage.toml");
    for (name, old, new) in TOMLS {
        write(dir, name, replaced(&toml, old, new));
        t.add(&["topo", &format!("{{d}}/{name}")], name);
    }
    t.add(
        &[
            "estimate",
            M,
            "--cluster",
            "{d}/t_hugenodes.toml",
            "--batch",
            "8",
        ],
        "t_hugenodes.toml",
    );
    t.add(
        &[
            "plan",
            M,
            "--cluster",
            "{d}/t_overflow.toml",
            "--batch",
            "8",
        ],
        "t_overflow.toml",
    );

    // estimate, plan and report: numbers at their edges and plans that cannot run.
    let est = ["estimate", M, "--cluster", "cpu:ranks=8"];
    let search = ["plan", M, "--cluster", "cpu:ranks=8"];
    let moe = ["plan", "mixtral-8x7b", "--cluster", "dgx-h100:nodes=2"];
    let numbers: &[(&[&str], &[&str], &str)] = &[
        (&est, &["--batch", "0"], "--batch"),
        (&est, &["--batch", "18446744073709551615"], "--batch"),
        (&est, &["--batch", "1e3"], "--batch"),
        (&est, &["--batch", "8", "--plan", "dp=8,dp=4"], "dp"),
        (&est, &["--batch", "8", "--plan", ",,,"], ",,,"),
        (&est, &["--batch", "8", "--plan", "dp=3"], "dp=3"),
        (&est, &["--batch", "8", "--plan", "mbs=3"], "mbs=3"),
        (&est, &["--batch", "1", "--plan", "dp=8"], "dp=8"),
        (&est, &["--batch", "8", "--plan", "dp=0"], "dp"),
        (&est, &["--batch", "8", "--plan", "tp=16"], "16"),
        (&est, &["--batch", "8", "--plan", "tp=3"], "tp=3"),
        (&est, &["--batch", "8", "--plan", "pp=4"], "layers"),
        (
            &est,
            &["--batch", "8", "--plan", "dp=18446744073709551615"],
            "dp",
        ),
        (
            &est,
            &["--batch", "8", "--plan", "dp=4294967296,tp=4294967296"],
            "devices",
        ),
        (
            &est,
            &["--batch", "8", "--plan", "vpp=2,schedule=1f1b"],
            "vpp",
        ),
        (&est, &["--batch", "8", "--plan", "zero=4"], "zero"),
        (&est, &["--batch", "8", "--plan", "bogus=1"], "bogus"),
        (&est, &["--batch", "8", "--plan", "dp"], "dp"),
        (&est, &["--batch", "8", "--plan", "stages=1-1"], "stages"),
        (&est, &["--batch", "8", "--plan", "order=pp-xp"], "order"),
        (&est, &["--batch", "8", "--plan", "attn=zzz"], "attn"),
        (&est, &["--batch", "8", "--plan", "ep=2"], "ep"),
        (&est, &["--batch", "8", "--plan", "gbs=16"], "global batch"),
        (
            &est,
            &["--batch", "8", "--trace", "{d}/nodir/t.json"],
            "nodir",
        ),
        (
            &search,
            &["--batch", "8", "--max-seconds", "1e300"],
            "--max-seconds",
        ),
        (
            &search,
            &["--batch", "8", "--max-seconds", "nan"],
            "--max-seconds",
        ),
        (&search, &["--batch", "8", "--max-seconds", "-1"], "-1"),
        (
            &search,
            &["--batch", "8", "--max-seconds", "inf"],
            "--max-seconds",
        ),
        (&search, &["--batch", "8", "--top", "0"], "top"),
        (&search, &["--batch", "8", "--top", "-1"], "-1"),
        (&search, &["--batch", "8", "--top", "100000"], "--top"),
        (&search, &["--batch", "0"], "--batch"),
        (&search, &["--batch", "18446744073709551615"], "--batch"),
        (&search, &["--batch", "8", "--pin", "tp=2,tp=4"], "tp"),
        (&search, &["--batch", "8", "--pin", ",,"], ",,"),
        (&search, &["--batch", "8", "--pin", "bogus=1"], "bogus"),
        (&search, &["--batch", "8", "--pin", "tp=3"], "tp"),
        (
            &search,
            &["--batch", "8", "--pin", "runtime=gpu"],
            "runtime",
        ),
        (&search, &["--batch", "8", "--reference", "dp=0"], "dp"),
        (
            &search,
            &["--batch", "8", "--save", "{d}/nodir/p.json"],
            "nodir",
        ),
        (&search, &["--batch", "8", "--threads", "-1"], "-1"),
        // Pins the MoE search cannot meet: an ep the 8 experts do not divide, and a folded
        // ep whose etp lacks the sequence parallelism it needs.
        (
            &moe,
            &["--batch", "64", "--pin", "ep=16,etp=1"],
            "ep divide the 8 experts",
        ),
        (
            &moe,
            &["--batch", "64", "--pin", "ep=8,etp=1,sp=false,tp=2"],
            "no plan satisfies the pins",
        ),
    ];
    for (command, rest, needle) in numbers {
        let args: Vec<&str> = command.iter().chain(rest.iter()).copied().collect();
        t.add(&args, needle);
    }
    let others: &[(&[&str], &str)] = &[
        (
            &[
                "estimate",
                "gpt3-175b:vocab=50257",
                "--cluster",
                "dgx-a100:nodes=1",
                "--batch",
                "8",
                "--plan",
                "tp=8",
            ],
            "vocabulary",
        ),
        (
            &[
                "report",
                M,
                "--cluster",
                "cpu:ranks=8",
                "--batch",
                "8",
                "--max-seconds",
                "1e300",
                "-o",
                "{d}/r.html",
            ],
            "--max-seconds",
        ),
        (
            &[
                "report",
                M,
                "--cluster",
                "cpu:ranks=8",
                "--batch",
                "0",
                "-o",
                "{d}/r.html",
            ],
            "--batch",
        ),
        (
            &[
                "report",
                M,
                "--cluster",
                "cpu:ranks=8",
                "--batch",
                "8",
                "-o",
                "{d}/nodir/r.html",
            ],
            "nodir",
        ),
        (&["calibrate", "--reference", "{d}/nodir"], "nodir"),
        (&["calibrate", "--table", "bogus"], "bogus"),
        (&["checkpoint", "inspect", "{d}/nockpt"], "nockpt"),
        (
            &[
                "checkpoint",
                "export",
                "{d}/nockpt",
                "--format",
                "hf",
                "-o",
                "{d}/x.safetensors",
            ],
            "nockpt",
        ),
    ];
    for (args, needle) in others {
        t.add(args, needle);
    }
    t
}

/// Why case `case` is not a clean refusal, if it is not.
fn check(bin: &Path, dir: &Path, index: usize, case: &Case, timeout: Duration) -> Option<String> {
    let out_path = dir.join(format!("case{index}.out"));
    let err_path = dir.join(format!("case{index}.err"));
    let file = |p: &PathBuf| std::fs::File::create(p).expect("an output file");
    // `exec` keeps the limit and makes the shell's process the one killed on a hang.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {MEMORY_LIMIT_KIB} && exec \"$0\" \"$@\""
        ))
        .arg(bin)
        .args(&case.args)
        .stdin(Stdio::null())
        .stdout(file(&out_path))
        .stderr(file(&err_path))
        .spawn()
        .expect("sh runs");
    let start = Instant::now();
    let status: ExitStatus = loop {
        match child.try_wait().expect("the child can be waited for") {
            Some(status) => break status,
            None if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Some(format!("no answer within {timeout:?} (a hang)"));
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let stderr =
        String::from_utf8_lossy(&std::fs::read(&err_path).unwrap_or_default()).into_owned();
    let first = stderr.split("\n\n").next().unwrap_or_default().trim();
    if stderr.contains("panicked") {
        return Some(format!("panicked: {stderr}"));
    }
    match status.code() {
        None => {
            return Some(format!(
                "killed by a signal (out of memory?): {status}; {stderr}"
            ));
        }
        Some(0) => return Some("exit code 0".into()),
        Some(_) => {}
    }
    if first.is_empty() {
        return Some("no error message".into());
    }
    if !first.contains(&case.needle) {
        return Some(format!(
            "the error does not name `{}`: {first}",
            case.needle
        ));
    }
    None
}

#[test]
fn every_bad_input_is_refused_cleanly() {
    let dir = common::scratch("bad_input");
    let t = table(&dir);
    assert!(t.cases.len() >= MIN_CASES, "only {} cases", t.cases.len());
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_autopar"));
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(case) = t.cases.get(i) else { break };
                    if let Some(why) = check(&bin, &dir, i, case, TIMEOUT) {
                        let line = format!("autopar {:?}: {why}", case.args);
                        failures.lock().expect("not poisoned").push(line);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().expect("not poisoned");
    assert!(
        failures.is_empty(),
        "{} of {} bad inputs were not refused cleanly:\n{}",
        failures.len(),
        t.cases.len(),
        failures.join("\n")
    );
}

/// The harness itself tells a clean refusal from what it must catch.
#[test]
fn the_harness_catches_success_missing_names_and_hangs() {
    let dir = common::scratch("bad_input_self");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_autopar"));
    let case = |args: &[&str], needle: &str| Case {
        args: args.iter().map(|a| a.to_string()).collect(),
        needle: needle.to_string(),
    };
    let t = TIMEOUT;
    assert_eq!(
        check(&bin, &dir, 0, &case(&["dump", "gpt:"], "gpt:"), t),
        None
    );
    let ok = check(&bin, &dir, 1, &case(&["models"], "x"), t);
    assert!(ok.is_some_and(|why| why.contains("exit code 0")));
    let unnamed = check(&bin, &dir, 2, &case(&["dump", "gpt:"], "no such text"), t);
    assert!(unnamed.is_some_and(|why| why.contains("does not name")));
    // `sleep` stands in for a hang: under the same wrapper it is killed at the timeout.
    let sleeper = Path::new("/bin/sleep");
    if sleeper.exists() {
        let started = Instant::now();
        let hang = check(
            sleeper,
            &dir,
            3,
            &case(&["1000"], ""),
            Duration::from_millis(300),
        );
        assert!(hang.is_some_and(|why| why.contains("hang")));
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
