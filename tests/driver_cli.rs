//! The driver seen from the command line: `--timings` lists every pass that ran,
//! `--dump-after` writes a pass's graphs as text IR that parses back, and `--verify` fails
//! on a run whose values are not finite instead of calling it exact.

mod common;

use common::{autopar, autopar_err, autopar_ok, scratch};

#[test]
fn timings_list_every_pass_in_order() {
    let out = autopar_ok(&["run", "gpt-tiny", "--mesh", "dp=2,tp=2", "--timings"]);
    let passes: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("pass "))
        .skip(1)
        .take_while(|l| !l.starts_with("total"))
        .map(|l| l.split_whitespace().next().expect("a pass name"))
        .collect();
    assert_eq!(
        passes,
        [
            "model",
            "train-step",
            "parallelize",
            "partition",
            "fuse",
            "collectives",
            "memory-plan"
        ],
        "{out}"
    );
    // A pipeline with context parallelism runs every pass.
    let out = autopar_ok(&[
        "run",
        "llama-tiny",
        "--mesh",
        "cp=2,pp=2",
        "--micro-batches",
        "2",
        "--timings",
    ]);
    for pass in ["sequence-layout", "pipeline-split", "fuse", "collectives"] {
        assert!(out.lines().any(|l| l.starts_with(pass)), "{out}");
    }
}

#[test]
fn dump_after_partition_writes_every_rank_program() {
    let dir = scratch("dump-after-partition");
    let dir_text = dir.to_str().expect("a UTF-8 path");
    autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--dump-after",
        "partition",
        "--dump-dir",
        dir_text,
    ]);
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("the dump directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    files.sort();
    assert_eq!(
        files,
        (0..4)
            .map(|r| format!("partition.rank{r}.air"))
            .collect::<Vec<_>>()
    );
    // Each file is a rank's program: it parses back and prints identically, collectives
    // included.
    let text = std::fs::read_to_string(dir.join("partition.rank3.air")).expect("rank 3");
    let g = autopar_driver::ir::text::parse(&text).expect("parses");
    assert_eq!(autopar_driver::ir::text::print(&g), text);
    assert!(
        text.contains("all_reduce"),
        "no collective in rank 3's program"
    );

    let err = autopar_err(&["run", "gpt-tiny", "--dump-after", "optimise"]);
    assert!(
        err.contains("unknown pass `optimise`") && err.contains("partition"),
        "{err}"
    );
}

#[test]
fn verify_fails_when_the_loss_is_nan() {
    // A learning rate of 1e30 makes every weight NaN after the first update.
    let out = autopar(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "2",
        "--lr",
        "1e30",
        "--steps",
        "3",
        "--verify",
    ]);
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("verify: "))
        .expect("a verify line");
    assert!(
        line.contains("FAILED") && line.contains("non-finite"),
        "{line}"
    );
    assert!(!line.contains("max_abs_err=0.000e0"), "{line}");
    // The same on an SPMD mesh.
    let out = autopar(&[
        "run", "gpt-tiny", "--mesh", "dp=2", "--lr", "1e30", "--steps", "2", "--verify",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAILED (non-finite"));
}

/// Bad requests the driver refuses before anything runs, naming what is wrong.
#[test]
fn meshes_annotations_steps_and_outputs_are_checked_before_the_run() {
    for mesh in ["foo=2", "DP=2", "dp=2,xp=1"] {
        let err = autopar_err(&["run", "gpt-tiny", "--mesh", mesh]);
        assert!(
            err.contains("is not a mesh axis the compiler uses (dp, tp, pp, cp, ep)"),
            "{mesh}: {err}"
        );
    }
    let dir = scratch("driver-checks");
    let annotations = dir.join("cp.txt");
    std::fs::write(&annotations, "h.0.mlp.w1: cp=S(1)\n").expect("written");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--annotate",
        annotations.to_str().expect("UTF-8"),
    ]);
    assert!(
        err.contains("line 1") && err.contains("`h.0.mlp.w1`") && err.contains("`cp`"),
        "{err}"
    );
    // `plan --annotate` reads weights by their role in the model: a name the model does not
    // have is an error, not an annotation that silently constrains nothing.
    let unknown = dir.join("unknown.txt");
    std::fs::write(&unknown, "h.9.mlp.w1: tp=S(1)\n").expect("written");
    let err = autopar_err(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--annotate",
        unknown.to_str().expect("UTF-8"),
    ]);
    assert!(
        err.contains(":1: `h.9.mlp.w1` is neither a parameter nor an input of"),
        "{err}"
    );
    let err = autopar_err(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--stage",
        "partitioned",
        "--rank",
        "5",
    ]);
    assert!(
        err.contains("--rank 5") && err.contains("has 2 ranks"),
        "{err}"
    );
    let err = autopar_err(&[
        "run", "gpt-tiny", "--mesh", "dp=2", "--steps", "0", "--verify",
    ]);
    assert!(err.contains("--steps 0"), "{err}");
    // An unwritable trace is an error before the training (nothing is printed).
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "pp=2",
        "--trace",
        "/nonexistent-dir/step.json",
    ]);
    assert!(err.contains("/nonexistent-dir/step.json"), "{err}");
}

/// `autopar run ... | head` stops training when the reader goes away.
#[test]
fn a_closed_pipe_stops_the_training() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(["run", "gpt-tiny", "--steps", "1000000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("autopar starts");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("a pipe"))
        .read_line(&mut first)
        .expect("a line");
    assert!(first.starts_with("step 1 loss: "), "{first}");
    // The reader is gone: the next line written ends the program.
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("waits") {
            assert!(status.success(), "{status}");
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("autopar kept training after its reader went away");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `run` and `dump` spell dtypes as `plan` and `estimate` do too (`fp16`, `fp32`).
#[test]
fn dtypes_are_spelled_alike_everywhere() {
    for (a, b) in [("f32", "fp32"), ("f16", "fp16")] {
        let one = autopar_ok(&["dump", "gpt-tiny", "--stage", "train", "--dtype", a]);
        let other = autopar_ok(&["dump", "gpt-tiny", "--stage", "train", "--dtype", b]);
        assert_eq!(one, other, "--dtype {a} and --dtype {b}");
    }
}

/// A plan file runs as written or not at all: fields that would make it run as another plan
/// are refused by name, and so are flags the plan overrides.
#[test]
fn plan_files_run_as_written_or_not_at_all() {
    let good = common::plan_file("plan-ok", "dp=2,tp=2,mbs=2,gbs=8,dtype=f32");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&good).expect("a plan file")).expect("JSON");
    let dir = scratch("plan-files-checked");
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("dp0", serde_json::json!({"dp": 0}), "`dp` is 0"),
        ("tp0", serde_json::json!({"tp": 0}), "`tp` is 0"),
        (
            "mbs0",
            serde_json::json!({"micro_batch_size": 0}),
            "`micro_batch_size` is 0",
        ),
        (
            "mbs3",
            serde_json::json!({"micro_batch_size": 3}),
            "is not whole micro-batches of mbs=3 on dp=2 ranks",
        ),
        (
            "order",
            serde_json::json!({"axis_order": ["pp", "dp", "ep", "cp", "xp"]}),
            "`xp`",
        ),
    ];
    for (name, patch, want) in cases {
        let mut plan = base.clone();
        for (k, v) in patch.as_object().expect("an object") {
            plan[k] = v.clone();
        }
        let file = dir.join(format!("{name}.json"));
        std::fs::write(&file, plan.to_string()).expect("written");
        let err = autopar_err(&[
            "run",
            "gpt-tiny",
            "--plan-file",
            file.to_str().expect("UTF-8"),
        ]);
        assert!(err.contains(want), "{name}: {err}");
    }
    // Leaving `tp` (degree 2) out of the order would drop it.
    let mut plan = base.clone();
    plan["axis_order"] = serde_json::json!(["pp", "dp", "ep", "cp"]);
    let file = dir.join("order-without-tp.json");
    std::fs::write(&file, plan.to_string()).expect("written");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        file.to_str().expect("UTF-8"),
    ]);
    assert!(err.contains("leaves out `tp`"), "{err}");
    // Flags the plan overrides.
    let err = autopar_err(&["run", "gpt-tiny", "--plan-file", &good, "--dtype", "bf16"]);
    assert!(err.contains("--dtype"), "{err}");
    let err = autopar_err(&[
        "run",
        "gpt-tiny",
        "--plan-file",
        &good,
        "--micro-batches",
        "2",
    ]);
    assert!(err.contains("--micro-batches"), "{err}");
    // The plan as written runs.
    let out = autopar_ok(&["run", "gpt-tiny", "--plan-file", &good, "--verify"]);
    assert!(out.contains(" OK"), "{out}");
}

/// A step too large for the machine is refused before anything is allocated, with what it
/// needs and what the machine has; a tensor too large to count is refused where the graph is
/// built.
#[test]
fn runs_larger_than_the_machine_are_refused_before_allocating() {
    let err = autopar_err(&["run", "gpt3-175b", "--forward"]);
    let first = err.lines().next().unwrap_or_default();
    assert!(
        first.contains("the step needs at least")
            && first.contains("GiB")
            && first.contains("available"),
        "{err}"
    );
    let dir = scratch("driver-huge");
    let huge = dir.join("huge.air");
    std::fs::write(
        &huge,
        "graph \"huge\" {\n  %0: f32[4294967296,4294967296] = input {name=\"x\", role=features}\n  \
         %1: f32[] = reduce_mean %0 {dims=[0,1]}\n  output \"loss\" = %1\n}\n",
    )
    .expect("written");
    let err = autopar_err(&["run", huge.to_str().expect("UTF-8"), "--forward"]);
    assert!(
        err.contains("huge.air:line 2") && err.contains("2^52 elements"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A hand-written safetensors file of `i64` tensors.
fn safetensors_i64(tensors: &[(&str, &[usize], &[i64])]) -> Vec<u8> {
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (i, (name, shape, values)) in tensors.iter().enumerate() {
        let start = data.len();
        for v in *values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
        header += &format!(
            "{}\"{name}\":{{\"dtype\":\"I64\",\"shape\":[{}],\"data_offsets\":[{start},{}]}}",
            if i > 0 { "," } else { "" },
            dims.join(","),
            data.len()
        );
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    out
}

/// Token ids outside the vocabulary are refused on every mesh, as a single device refuses
/// them: a vocabulary split over `tp` would otherwise mask them and report a plausible loss.
#[test]
fn token_ids_outside_the_vocabulary_are_refused_on_every_mesh() {
    let dir = scratch("driver-tokens");
    let ok: Vec<i64> = (0..256).map(|i| i % 256).collect();
    for (input, bad) in [("tokens", 256i64), ("targets", -1)] {
        let mut ids = ok.clone();
        ids[77] = bad;
        let (tokens, targets) = match input {
            "tokens" => (&ids, &ok),
            _ => (&ok, &ids),
        };
        let file = dir.join(format!("{input}.safetensors"));
        std::fs::write(
            &file,
            safetensors_i64(&[("tokens", &[8, 32], tokens), ("targets", &[8, 32], targets)]),
        )
        .expect("written");
        let file = file.to_str().expect("UTF-8");
        for mesh in [None, Some("tp=2"), Some("dp=2,tp=2")] {
            let mut args = vec!["run", "gpt-tiny", "--steps", "1", "--data", file];
            if let Some(m) = mesh {
                args.extend(["--mesh", m]);
            }
            let err = autopar_err(&args);
            assert!(
                err.contains(&format!("batch input `{input}`"))
                    && err.contains(&format!("token id {bad}, outside the vocabulary 0..256")),
                "{mesh:?}: {err}"
            );
        }
    }
}

/// Numbers at the edge of their type are refused by name, never overflowed.
#[test]
fn edge_values_are_refused_by_name() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "plan",
                "gpt-tiny",
                "--cluster",
                "cpu:ranks=4",
                "--batch",
                "8",
                "--max-seconds",
                "1e300",
            ],
            "--max-seconds",
        ),
        (
            &[
                "estimate",
                "gpt-tiny",
                "--cluster",
                "cpu:ranks=4",
                "--batch",
                "18446744073709551615",
            ],
            "--batch",
        ),
        (
            &[
                "estimate",
                "gpt-tiny",
                "--cluster",
                "dgx-h100:nodes=18446744073709551615",
                "--batch",
                "8",
            ],
            "`nodes` must be 1 to",
        ),
        (
            &[
                "plan",
                "gpt-tiny",
                "--cluster",
                "dgx-h100:nodes=18446744073709551615",
                "--batch",
                "8",
            ],
            "`nodes` must be 1 to",
        ),
        (
            &["topo", "dgx-h100:nodes=18446744073709551615"],
            "`nodes` must be 1 to",
        ),
        (
            &["topo", "dgx-h100:nodes=8388608"],
            "devices, the most a cluster may have",
        ),
    ];
    for (args, needle) in cases {
        let err = autopar_err(args);
        assert!(
            err.lines().next().unwrap_or_default().contains(needle),
            "{args:?}: {err}"
        );
    }
    // The largest cluster the bound allows is described, and searched promptly.
    let out = autopar_ok(&["topo", "dgx-h100:nodes=2097152"]);
    assert!(out.contains("16777216"), "{out}");
}

/// `estimate` prices only what could run: whole micro-batches on every data-parallel rank,
/// each key once, no empty items; the search and the estimate refuse a vocabulary that `tp`
/// does not divide, as the compiler does, and GPT-3's is padded as Megatron-LM pads it.
#[test]
fn estimates_refuse_impossible_plans() {
    let est = |batch: &str, plan: &str| {
        autopar_err(&[
            "estimate",
            "gpt-tiny",
            "--cluster",
            "cpu:ranks=8",
            "--batch",
            batch,
            "--plan",
            plan,
        ])
    };
    assert!(est("8", "dp=3").contains("multiple of dp x mbs = 3"));
    assert!(est("8", "mbs=3").contains("multiple of dp x mbs = 3"));
    assert!(est("1", "dp=8").contains("multiple of dp x mbs = 8"));
    assert!(est("8", "dp=8,dp=4").contains("`dp`: given twice"));
    assert!(est("8", "mbs=2,micro_batch=4").contains("`micro_batch`: given twice"));
    assert!(est("8", ",,,").contains("item 1 is empty"));
    let err = autopar_err(&[
        "plan",
        "gpt-tiny",
        "--cluster",
        "cpu:ranks=8",
        "--batch",
        "8",
        "--pin",
        "tp=2,tp=4",
    ]);
    assert!(err.contains("`tp`: pinned twice"), "{err}");
    let err = autopar_err(&["topo", "cpu:ranks=2,ranks=4"]);
    assert!(err.contains("`ranks` is given twice"), "{err}");

    let megatron = "dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,schedule=interleaved";
    let cluster = "dgx-a100:nodes=128";
    let out = autopar_ok(&[
        "estimate",
        "gpt3-175b",
        "--cluster",
        cluster,
        "--batch",
        "1536",
        "--plan",
        megatron,
    ]);
    assert!(out.contains("iteration time"), "{out}");
    let err = autopar_err(&[
        "estimate",
        "gpt3-175b:vocab=50257",
        "--cluster",
        cluster,
        "--batch",
        "1536",
        "--plan",
        megatron,
    ]);
    assert!(
        err.contains("tp=8 does not divide the vocabulary (50257)"),
        "{err}"
    );
    let out = autopar_ok(&[
        "plan",
        "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=257",
        "--cluster",
        "cpu:ranks=4",
        "--batch",
        "8",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let plans = json["plans"].as_array().expect("plans");
    assert!(!plans.is_empty(), "{out}");
    assert!(plans.iter().all(|p| p["config"]["tp"] == 1), "{out}");
    let models = autopar_ok(&["models"]);
    assert!(models.contains("vocab 50257 padded to 50304"), "{models}");
}

/// Options a command would ignore are errors naming the option.
#[test]
fn ignored_options_are_refused() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["dump", "gpt-tiny", "--mesh", "dp=2", "--zero", "3"],
            "--mesh does not apply to `dump --stage forward`",
        ),
        (
            &["dump", "gpt-tiny", "--dtype", "bf16"],
            "--dtype does not apply to `dump --stage forward`",
        ),
        (
            &[
                "dump", "gpt-tiny", "--stage", "train", "--mesh", "tp=2", "--sp",
            ],
            "--mesh does not apply to `dump --stage train`",
        ),
        (
            &[
                "dump", "gpt-tiny", "--stage", "sharded", "--mesh", "tp=2", "--rank", "1",
            ],
            "--rank does not apply",
        ),
        (
            &[
                "dump", "gpt-tiny", "--stage", "schedule", "--mesh", "pp=2", "--format", "json",
            ],
            "--format does not apply",
        ),
        (
            &[
                "dump", "gpt-tiny", "--stage", "pipeline", "--mesh", "pp=2", "--format", "dot",
            ],
            "--format does not apply",
        ),
        (
            &["run", "gpt-tiny", "--loss-scale", "1024"],
            "--loss-scale applies to --dtype f16 only",
        ),
        (
            &[
                "dump",
                "gpt-tiny",
                "--stage",
                "train",
                "--dtype",
                "bf16",
                "--loss-scale",
                "8",
            ],
            "--loss-scale applies",
        ),
    ];
    for (args, needle) in cases {
        let err = autopar_err(args);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // What does apply still works.
    autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--stage",
        "train",
        "--dtype",
        "f16",
        "--loss-scale",
        "8",
    ]);
    autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--stage",
        "schedule",
        "--mesh",
        "pp=2",
        "--micro-batches",
        "2",
    ]);
}

/// Memory figures carry their unit.
#[test]
fn memory_figures_have_units() {
    let out = autopar_ok(&["run", "gpt-tiny", "--mesh", "dp=2", "--steps", "1"]);
    let line = out
        .lines()
        .find(|l| l.contains("peak memory per rank:"))
        .expect("a summary");
    assert!(
        line.contains(" bytes (") && (line.ends_with("KiB)") || line.ends_with("MiB)")),
        "{out}"
    );
    let out = autopar_ok(&["run", "gpt-tiny", "--steps", "1"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("peak memory: ") && l.contains(" bytes (")),
        "{out}"
    );
}

/// The fast backend's peak is the storage it really held, and it is reported beside the
/// static arena its plan lays the program out in: within 10% of it, single device and SPMD.
#[test]
fn peak_memory_is_held_storage_within_the_arena() {
    let number = |s: &str| -> f64 {
        s.split(" bytes")
            .next()
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    for args in [
        &["run", "gpt-tiny", "--steps", "2"][..],
        &["run", "gpt-tiny", "--mesh", "dp=2,tp=2", "--steps", "2"][..],
        &[
            "run",
            "llama-tiny",
            "--mesh",
            "tp=2",
            "--steps",
            "1",
            "--dtype",
            "bf16",
        ][..],
    ] {
        let out = autopar_ok(args);
        let line = out
            .lines()
            .find(|l| l.contains("peak memory"))
            .unwrap_or_else(|| panic!("no peak memory in: {out}"));
        let (peak, arena) = line
            .split_once("peak memory")
            .and_then(|(_, rest)| rest.split_once(": "))
            .and_then(|(_, rest)| rest.split_once(", arena "))
            .unwrap_or_else(|| panic!("no arena in `{line}`"));
        let (peak, arena) = (number(peak), number(arena));
        assert!(peak > 0.0 && arena > 0.0, "`{line}`");
        assert!(
            (peak - arena).abs() <= 0.1 * arena,
            "peak {peak} is not within 10% of the arena {arena}: `{line}`"
        );
    }
    // The interpreter has no arena: its peak is in declared-dtype bytes.
    let out = autopar_ok(&["run", "gpt-tiny", "--steps", "1", "--interpreter"]);
    assert!(!out.contains("arena"), "{out}");
}

/// A learning-rate schedule runs the same on every mesh: the partitioned and pipelined steps
/// compute its factor from their replicated step count, and `--verify` holds them to one
/// device.
#[test]
fn lr_schedules_verify_on_meshes() {
    for mesh in ["dp=2,tp=2", "pp=2"] {
        let out = autopar_ok(&[
            "run",
            "gpt-tiny",
            "--mesh",
            mesh,
            "--micro-batches",
            "2",
            "--steps",
            "4",
            "--lr-schedule",
            "cosine",
            "--warmup",
            "2",
            "--verify",
        ]);
        assert!(
            out.contains("step 4 loss") && out.contains("OK"),
            "{mesh}: {out}"
        );
    }
}
