//! Every kernel the backend generates for the rank programs of every tiny zoo model (one
//! device, `dp=2,tp=2`, `pp=2` with two micro-batches, `cp=2`, `ep=2`, wherever the model
//! takes the mesh; f32, bf16 and f16), plus hand-written fusion bodies of the shapes the
//! fusion pass makes, compiles with NVRTC for `sm_80` and `sm_90` without a single
//! diagnostic. Skipped, with a message, only when libnvrtc cannot be loaded.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use autopar_driver::frontends::zoo::{self, EntryKind};
use autopar_driver::{CompileOptions, compile};
use autopar_ir::{DType, Graph, Op, TensorType};
use autopar_runtime_cuda::codegen::prelude::PRELUDE;
use autopar_runtime_cuda::codegen::{self, Kernel, NodeKernels};
use autopar_runtime_cuda::nvrtc;

/// The meshes, with the micro-batches each needs.
const MESHES: [(&str, usize); 5] = [
    ("dp=1", 1),
    ("dp=2,tp=2", 1),
    ("pp=2", 2),
    ("cp=2", 1),
    ("ep=2", 1),
];

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn tiny_models() -> Vec<&'static str> {
    zoo::entries()
        .iter()
        .filter(|e| e.kind == EntryKind::Preset && e.name.ends_with("-tiny"))
        .map(|e| e.name)
        .collect()
}

/// Every rank program of a compiled step: the SPMD programs, or every pipeline sub-program.
fn programs(step: &autopar_driver::CompiledStep) -> Vec<&Graph> {
    let mut out: Vec<&Graph> = Vec::new();
    match &step.pipeline {
        None => out.extend(&step.locals),
        Some(p) => {
            for pipe in &p.pipelines {
                for stage in pipe.forward.iter().chain(&pipe.backward) {
                    out.extend(stage.iter().map(|s| &s.graph));
                }
                out.extend(pipe.optimizer.iter().map(|s| &s.program.graph));
            }
        }
    }
    out
}

#[test]
fn every_generated_kernel_compiles_for_ampere_and_hopper() {
    if !common::nvrtc_or_skip("every_generated_kernel_compiles_for_ampere_and_hopper") {
        return;
    }
    // Kernel name -> (kernel, where it came from); names are hashes of the source.
    let mut kernels: BTreeMap<String, (Kernel, String)> = BTreeMap::new();
    let mut compiled_meshes: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut ops_seen: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut refused = Vec::new();
    let models = tiny_models();
    assert!(models.len() >= 4, "{models:?}");
    for &model in &models {
        for (mesh, micro_batches) in MESHES {
            for dtype in DTYPES {
                let mut options = CompileOptions::new(model).on_mesh(mesh).expect("a mesh");
                options.train.compute_dtype = dtype;
                options.train.micro_batches = micro_batches;
                let step = match compile(&options) {
                    Ok(s) => s,
                    Err(e) => {
                        refused.push(format!("{model} {mesh} {dtype}: {e}"));
                        continue;
                    }
                };
                compiled_meshes
                    .entry(mesh)
                    .or_default()
                    .push(format!("{model}/{dtype}"));
                for g in programs(&step) {
                    for (id, node_kernels) in codegen::kernels_for_graph(g)
                        .unwrap_or_else(|e| panic!("{model} {mesh} {dtype}: no kernels: {e}"))
                    {
                        let op = &g.node(id).op;
                        *ops_seen.entry(op.name()).or_default() += 1;
                        if let NodeKernels::Compute(p) = node_kernels {
                            for k in p.kernels() {
                                kernels.entry(k.name.clone()).or_insert_with(|| {
                                    (k.clone(), format!("{model} {mesh} {dtype} {op}"))
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    for (mesh, _) in MESHES {
        assert!(
            compiled_meshes.contains_key(mesh),
            "no tiny model compiled on {mesh}: {refused:#?}"
        );
    }
    for dtype in DTYPES {
        for (name, body) in common::fusion_bodies(dtype, 24, 200)
            .into_iter()
            .chain(common::fusion_bodies(dtype, 3, 4096))
        {
            let NodeKernels::Compute(p) = codegen::kernels_for_node(
                &Op::Fusion { body: body.clone() },
                &body.params.iter().collect::<Vec<_>>(),
                &[],
            )
            .unwrap_or_else(|e| panic!("fusion {name} {dtype}: {e}")) else {
                panic!("a fusion is computed");
            };
            for k in p.kernels() {
                kernels
                    .entry(k.name.clone())
                    .or_insert_with(|| (k.clone(), format!("fusion {name} {dtype}")));
            }
        }
    }
    // Attention forward and backward at the shapes of real models (grouped-query, head dims
    // 64 and 128, with and without the positions of ring attention), which the tiny models'
    // programs do not all reach.
    for dtype in DTYPES {
        for (d, hq, hkv, positions) in [
            (64, 4, 2, false),
            (128, 8, 2, true),
            (128, 4, 4, false),
            (80, 2, 1, true),
        ] {
            let q = TensorType::new(dtype, vec![2, 96, hq, d]);
            let kv = TensorType::new(dtype, vec![2, 80, hkv, d]);
            let (qp, kp) = (
                TensorType::new(DType::I64, vec![96]),
                TensorType::new(DType::I64, vec![80]),
            );
            let mut fwd: Vec<&TensorType> = vec![&q, &kv, &kv];
            let mut bwd: Vec<&TensorType> = vec![&q, &kv, &kv, &q, &q];
            if positions {
                fwd.extend([&qp, &kp]);
                bwd.extend([&qp, &kp]);
            }
            let scale = 1.0 / (d as f64).sqrt();
            for (op, operands, results) in [
                (
                    Op::Attention {
                        causal: true,
                        scale,
                    },
                    &fwd,
                    vec![q.clone()],
                ),
                (
                    Op::AttentionBackward {
                        causal: true,
                        scale,
                    },
                    &bwd,
                    vec![q.clone(), kv.clone(), kv.clone()],
                ),
                (
                    Op::Attention {
                        causal: false,
                        scale,
                    },
                    &fwd,
                    vec![q.clone()],
                ),
            ] {
                let Ok(NodeKernels::Compute(p)) =
                    codegen::kernels_for_node(&op, operands, &results)
                else {
                    panic!("{op} on {dtype} d={d}: no kernels");
                };
                *ops_seen.entry(op.name()).or_default() += 1;
                for k in p.kernels() {
                    kernels
                        .entry(k.name.clone())
                        .or_insert_with(|| (k.clone(), format!("{op} {dtype} d={d}")));
                }
            }
        }
    }
    // Every op kind the programs hold that runs as a kernel must have produced some.
    for op in [
        "einsum",
        "softmax",
        "attention",
        "cross_entropy",
        "adamw_update",
        "gather",
        "scatter_add",
        "moe_route",
        "rotary",
    ] {
        assert!(
            ops_seen.contains_key(op),
            "no rank program holds `{op}`: {ops_seen:?}"
        );
    }
    let kinds: std::collections::BTreeSet<&str> = kernels
        .keys()
        .map(|n| n.rsplit_once('_').map_or("", |x| x.0))
        .collect();
    for kind in [
        "ap_ew",
        "ap_rowwarp",
        "ap_rowblock",
        "ap_loop",
        "ap_attn_fwd",
        "ap_attn_dkdv",
        "ap_attn_dq",
        "ap_attn_stats",
        "ap_permute",
    ] {
        assert!(
            kinds.contains(kind),
            "no `{kind}` kernel generated: {kinds:?}"
        );
    }
    // Kernels are compiled 48 to a translation unit (the prelude once), which is what makes
    // thousands of them affordable; a unit with a diagnostic is recompiled kernel by kernel
    // to name the culprit.
    let work: Vec<(&Kernel, &String)> = kernels.values().map(|(k, w)| (k, w)).collect();
    let chunks: Vec<&[(&Kernel, &String)]> = work.chunks(48).collect();
    eprintln!(
        "compiling {} distinct kernels in {} units",
        work.len(),
        chunks.len()
    );
    let failures = Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(chunk) = chunks.get(i) else { break };
                    if i.is_multiple_of(10) {
                        eprintln!("unit {i} of {}", chunks.len());
                    }
                    let mut unit = String::from(PRELUDE);
                    for (k, _) in chunk.iter() {
                        unit.push_str(
                            k.source
                                .strip_prefix(PRELUDE)
                                .expect("kernels start with the prelude"),
                        );
                    }
                    for arch in ["sm_80", "sm_90"] {
                        if nvrtc::compile(&format!("unit{i}"), &unit, arch).is_ok() {
                            continue;
                        }
                        for (k, from) in chunk.iter() {
                            if let Err(e) = nvrtc::compile(&k.name, &k.source, arch) {
                                failures
                                    .lock()
                                    .expect("lock")
                                    .push(format!("{from}: {e}\n{}", k.source));
                            }
                        }
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().expect("lock");
    // The distinct diagnostics, so that one run shows every kind of failure.
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for f in &failures {
        let line = f
            .lines()
            .find(|l| l.contains("error") || l.contains("warning"))
            .unwrap_or("");
        let kind = line.split_once(": ").map_or(line, |x| x.1);
        *kinds.entry(kind.chars().take(100).collect()).or_default() += 1;
    }
    assert!(
        failures.is_empty(),
        "{} of {} kernels failed ({kinds:#?}); the first:\n{}",
        failures.len(),
        work.len(),
        failures[0]
    );
    eprintln!(
        "{} distinct kernels compiled for sm_80 and sm_90",
        work.len()
    );
}
