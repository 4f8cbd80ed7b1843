//! End-to-end tests of the SPMD command line: `run --mesh ... --verify`, the dumps of the
//! sharded and partitioned step graphs (golden files, rewritten with `AUTOPAR_BLESS=1`), the
//! Megatron and ZeRO-3 collective patterns, and the errors of impossible requests.

mod common;

use common::{autopar, autopar_err, autopar_ok, check_golden, collectives, scratch};

#[test]
fn run_verify_prints_ok() {
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "3",
        "--verify",
    ]);
    let line = out
        .lines()
        .find(|l| l.starts_with("verify: "))
        .expect("a verify line");
    assert!(line.ends_with(" OK"), "{out}");
    let err = |key: &str| -> f64 {
        line.split(&format!("{key}="))
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .expect("an error value")
    };
    // Within 1e-4, or the tolerance the f32-accumulation noise floor widens it to.
    let tolerance = if line.contains("tolerance=") {
        err("tolerance")
    } else {
        1e-4
    };
    assert!(
        err("max_abs_err") <= tolerance && err("max_rel_err") <= tolerance,
        "{line}"
    );
    assert_eq!(out.lines().filter(|l| l.starts_with("step ")).count(), 3);
}

#[test]
fn forward_runs_on_a_mesh() {
    let out = autopar_ok(&["run", "mlp-tiny", "--forward", "--mesh", "dp=2", "--verify"]);
    assert!(
        out.contains("verify: ") && out.trim_end().ends_with("OK"),
        "{out}"
    );
}

/// Megatron: per layer, one all-reduce after the attention output projection and one after
/// the second MLP matmul in the forward, one per block input in the backward, and no other
/// collective on activations inside the layers.
#[test]
fn tensor_parallel_gpt_has_the_megatron_pattern() {
    let dump = autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--stage",
        "partitioned",
    ]);
    let colls = collectives(&dump);
    assert!(
        colls.iter().all(|(op, _, _)| op == "all_reduce"),
        "{colls:?}"
    );
    for layer in 0..2 {
        let count = |scope: &str| colls.iter().filter(|(_, _, s)| s == scope).count();
        assert_eq!(count(&format!("mb0/h.{layer}.attn")), 1, "{colls:?}");
        assert_eq!(count(&format!("mb0/h.{layer}.mlp")), 1, "{colls:?}");
        // Backward: the gradient of each block's input, reduced before the norm's backward.
        assert_eq!(count(&format!("mb0/grad/h.{layer}.ln1")), 1, "{colls:?}");
        assert_eq!(count(&format!("mb0/grad/h.{layer}.ln2")), 1, "{colls:?}");
        let in_layer = colls
            .iter()
            .filter(|(_, _, s)| s.contains(&format!("h.{layer}.")) && !s.starts_with("optimizer/"))
            .count();
        assert_eq!(in_layer, 4, "{colls:?}");
    }
    check_golden("gpt-tiny.tp2.partitioned.air", &dump);
}

#[test]
fn zero3_gathers_weights_before_use_and_scatters_gradients() {
    let dump = autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--zero",
        "3",
        "--stage",
        "partitioned",
    ]);
    let colls = collectives(&dump);
    let on_dp = |op: &str, scope: &str| {
        colls
            .iter()
            .filter(|(o, axes, s)| o == op && axes == "\"dp\"" && s.starts_with(scope))
            .count()
    };
    // Forward: the weights of each layer gathered on dp before their use.
    assert!(on_dp("all_gather", "mb0/h.0.attn") >= 4, "{colls:?}");
    assert!(on_dp("all_gather", "mb0/h.1.mlp") >= 2, "{colls:?}");
    // Backward: weight gradients reduce-scattered on dp, never all-reduced.
    assert!(
        on_dp("reduce_scatter", "mb0/grad/h.0.attn") >= 4,
        "{colls:?}"
    );
    assert!(
        !colls
            .iter()
            .any(|(o, axes, s)| o == "all_reduce" && axes == "\"dp\"" && s.starts_with("mb0/grad")),
        "{colls:?}"
    );
    // Without ZeRO the same gradients are all-reduced instead.
    let plain = collectives(&autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--stage",
        "partitioned",
    ]));
    assert!(
        !plain.iter().any(|(o, _, _)| o == "reduce_scatter"),
        "{plain:?}"
    );
    assert!(
        !plain.iter().any(|(o, _, _)| o == "all_gather"),
        "{plain:?}"
    );
}

#[test]
fn golden_sharded_and_partitioned_dumps() {
    let sharded = autopar_ok(&[
        "dump",
        "mlp-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--stage",
        "sharded",
    ]);
    check_golden("mlp-tiny.dp2-tp2.sharded.air", &sharded);
    let rank1 = autopar_ok(&[
        "dump",
        "mlp-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--stage",
        "partitioned",
        "--rank",
        "1",
    ]);
    check_golden("mlp-tiny.dp2-tp2.rank1.air", &rank1);
    // Every value of the sharded dump has a complete placement.
    for line in sharded.lines().filter(|l| l.trim_start().starts_with('%')) {
        assert!(line.contains("dp: ") && line.contains("tp: "), "{line}");
    }
}

#[test]
fn impossible_requests_name_tensor_dim_and_axis() {
    // 4 heads cannot be split 3 ways (every other dim divides).
    let err = autopar_err(&[
        "run",
        "gpt:layers=1,hidden=48,heads=4,seq=12,vocab=96",
        "--mesh",
        "tp=3",
    ]);
    assert!(
        err.contains("`h.0.attn.wq`") && err.contains("dim 1") && err.contains("mesh axis `tp`"),
        "{err}"
    );
    // A batch of 8 over 3 data-parallel ranks.
    let err = autopar_err(&["run", "mlp-tiny", "--mesh", "dp=3"]);
    assert!(
        err.contains("`features`") && err.contains("dim 0") && err.contains("mesh axis `dp`"),
        "{err}"
    );
    let err = autopar_err(&["run", "mlp-tiny", "--mesh", "dp=2", "--zero", "4"]);
    assert!(err.contains("--zero"), "{err}");
    // ZeRO shards over `dp`: asked for on a mesh without it, it is an error, not ignored.
    for mesh in ["tp=2", "pp=2"] {
        let err = autopar_err(&["run", "gpt-tiny", "--mesh", mesh, "--zero", "1"]);
        assert!(
            err.contains("--zero") && err.contains("`dp`"),
            "{mesh}: {err}"
        );
    }
    let err = autopar_err(&[
        "dump",
        "mlp-tiny",
        "--mesh",
        "dp=2",
        "--stage",
        "partitioned",
        "--rank",
        "2",
    ]);
    assert!(err.contains("rank 2"), "{err}");
    let err = autopar_err(&["dump", "mlp-tiny", "--stage", "sharded"]);
    assert!(err.contains("--mesh"), "{err}");
}

#[test]
fn annotation_files() {
    let dir = scratch("spmd_annotate");
    let good = dir.join("replicated_mlp.txt");
    std::fs::write(
        &good,
        "# Megatron MLP of layer 0 replicated instead\nh.0.mlp.w1: tp=R\nh.0.mlp.b1: tp=R\nh.0.mlp.w2: tp=R\n",
    )
    .unwrap();
    let good = good.to_string_lossy().to_string();
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--steps",
        "2",
        "--verify",
        "--annotate",
        &good,
    ]);
    assert!(out.trim_end().ends_with("OK"), "{out}");
    let dump = autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--stage",
        "partitioned",
        "--annotate",
        &good,
    ]);
    let colls = collectives(&dump);
    assert_eq!(
        colls.iter().filter(|(_, _, s)| s == "mb0/h.0.mlp").count(),
        0,
        "{colls:?}"
    );

    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "h.0.mlp.w1: tp=S(1)\nh.0.mlp.w2 tp=S(0)\n").unwrap();
    let bad = bad.to_string_lossy().to_string();
    let err = autopar_err(&["run", "gpt-tiny", "--mesh", "tp=2", "--annotate", &bad]);
    assert!(err.contains("bad.txt: line 2:"), "{err}");
    let unknown = dir.join("unknown.txt");
    std::fs::write(&unknown, "h.9.mlp.w1: tp=S(1)\n").unwrap();
    let unknown = unknown.to_string_lossy().to_string();
    let err = autopar_err(&["run", "gpt-tiny", "--mesh", "tp=2", "--annotate", &unknown]);
    assert!(
        err.contains("`h.9.mlp.w1`") && err.contains("line 1"),
        "{err}"
    );
    let uneven = dir.join("uneven.txt");
    std::fs::write(&uneven, "fc1.w: tp=S(0)\n").unwrap();
    let uneven = uneven.to_string_lossy().to_string();
    let err = autopar_err(&["run", "mlp-tiny", "--mesh", "tp=3", "--annotate", &uneven]);
    assert!(err.contains("`fc1.w`") && err.contains("dim 0"), "{err}");
    assert!(autopar(&["run", "mlp-tiny", "--verify"]).status.code() != Some(0));
}

#[test]
fn zero2_reduce_scatters_every_micro_batch_and_zero1_once() {
    let scatters_on_dp = |zero: &str| {
        let dump = autopar_ok(&[
            "dump",
            "gpt-tiny",
            "--mesh",
            "dp=2",
            "--zero",
            zero,
            "--micro-batches",
            "4",
            "--stage",
            "partitioned",
        ]);
        collectives(&dump)
            .into_iter()
            .filter(|(o, axes, _)| o == "reduce_scatter" && axes == "\"dp\"")
            .count()
    };
    let (z1, z2) = (scatters_on_dp("1"), scatters_on_dp("2"));
    // ZeRO-1 sums the four micro-batches' partial gradients, then reduce-scatters once per
    // weight; ZeRO-2 keeps the accumulated gradient sharded, so every micro-batch scatters.
    assert!(
        z1 > 0 && z2 >= 4 * z1 - z1 / 2,
        "zero 1: {z1}, zero 2: {z2}"
    );
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2",
        "--zero",
        "2",
        "--micro-batches",
        "4",
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(out.trim_end().ends_with("OK"), "{out}");
}

#[test]
fn sequence_parallelism_turns_each_block_all_reduce_into_reduce_scatter_and_all_gather() {
    let dump = autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--sp",
        "--stage",
        "partitioned",
    ]);
    check_golden("gpt-tiny.tp2-sp.partitioned.air", &dump);
    let sp = collectives(&dump);
    let forward = |op: &str, scope: &str| {
        sp.iter()
            .filter(|(o, axes, s)| o == op && axes == "\"tp\"" && s == scope)
            .count()
    };
    for layer in 0..2 {
        for block in ["attn", "mlp"] {
            let scope = format!("mb0/h.{layer}.{block}");
            assert_eq!(forward("all_gather", &scope), 1, "{scope}: {sp:?}");
            assert_eq!(forward("reduce_scatter", &scope), 1, "{scope}: {sp:?}");
            assert_eq!(forward("all_reduce", &scope), 0, "{scope}: {sp:?}");
        }
    }
    // No all-reduce of activations anywhere in the layers, forward or backward: the norms'
    // backward reduce-scatters the column-parallel input gradient onto the sequence shards.
    let in_layers = |s: &str| s.starts_with("mb0/h.") || s.starts_with("mb0/grad/h.");
    assert!(
        !sp.iter().any(|(o, _, s)| o == "all_reduce" && in_layers(s)),
        "{sp:?}"
    );
    for layer in 0..2 {
        for norm in ["ln1", "ln2"] {
            let scope = format!("mb0/grad/h.{layer}.{norm}");
            assert_eq!(forward("reduce_scatter", &scope), 1, "{scope}: {sp:?}");
        }
        // As in Megatron's backward, each block re-gathers the sequence (for the weight
        // gradients and the row-parallel input gradient) and never moves the head-sharded
        // gradients onto the sequence by all-to-all.
        for block in ["attn", "mlp"] {
            let scope = format!("mb0/grad/h.{layer}.{block}");
            assert_eq!(forward("all_gather", &scope), 1, "{scope}: {sp:?}");
        }
    }
    assert!(!sp.iter().any(|(o, _, _)| o == "all_to_all"), "{sp:?}");
    let out = autopar_ok(&[
        "run", "gpt-tiny", "--mesh", "tp=2", "--sp", "--steps", "3", "--verify",
    ]);
    assert!(out.trim_end().ends_with("OK"), "{out}");
    let out = autopar_ok(&[
        "run",
        "llama-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--sp",
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(out.trim_end().ends_with("OK"), "{out}");
    let err = autopar_err(&["run", "gpt-tiny", "--mesh", "dp=2", "--sp"]);
    assert!(err.contains("--sp") && err.contains("tp"), "{err}");
}

#[test]
fn mlp_on_sequence_shards_moves_no_mlp_activations() {
    // With sequence parallelism, `--mlp seq` runs each MLP on the rank's sequence shard with
    // its weights replicated over tp: the MLP blocks have no collective of their own, forward
    // or backward; only their weight gradients are summed over tp.
    let dump = autopar_ok(&[
        "dump",
        "gpt-tiny",
        "--mesh",
        "tp=2",
        "--sp",
        "--mlp",
        "seq",
        "--stage",
        "partitioned",
    ]);
    let ops = collectives(&dump);
    for layer in 0..2 {
        for scope in [
            format!("mb0/h.{layer}.mlp"),
            format!("mb0/grad/h.{layer}.mlp"),
        ] {
            assert!(!ops.iter().any(|(_, _, s)| *s == scope), "{scope}: {ops:?}");
        }
        let attention = format!("mb0/h.{layer}.attn");
        assert!(
            ops.iter()
                .any(|(o, _, s)| o == "all_gather" && *s == attention),
            "{ops:?}"
        );
    }
    assert!(
        ops.iter()
            .any(|(o, _, s)| o == "all_reduce" && s.starts_with("optimizer/h.0.mlp")),
        "the replicated MLP weights' gradients are summed over tp: {ops:?}"
    );
    let out = autopar_ok(&[
        "run",
        "gpt-tiny",
        "--mesh",
        "dp=2,tp=2",
        "--sp",
        "--mlp",
        "seq",
        "--steps",
        "2",
        "--verify",
    ]);
    assert!(out.trim_end().ends_with("OK"), "{out}");
}
