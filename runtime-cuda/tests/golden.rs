//! Golden tests of generated CUDA C: the source of a few kernels (without the shared
//! prelude) is held to `tests/golden/*.cu`, rewritten with `AUTOPAR_BLESS=1` (not under
//! `CI=true`); a mismatch fails with a line diff. The sources are deterministic: the same
//! op on the same types gives the same text and the same name.

mod common;

use std::path::PathBuf;

use autopar_ir::{BinaryOp, DType, Op, TensorType, UnaryOp};
use autopar_runtime_cuda::codegen::{self, NodeKernels, prelude::PRELUDE};

fn check_golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let bless = std::env::var("AUTOPAR_BLESS").is_ok_and(|v| v == "1")
        && !std::env::var("CI").is_ok_and(|v| v == "true");
    if bless {
        std::fs::write(&path, actual).expect("write golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing golden file {}; run with AUTOPAR_BLESS=1",
            path.display()
        )
    });
    if expected != actual {
        let first = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b);
        let line = first.unwrap_or(expected.lines().count().min(actual.lines().count()));
        let show = |s: &str| {
            s.lines()
                .skip(line.saturating_sub(2))
                .take(6)
                .collect::<Vec<_>>()
                .join("\n")
        };
        panic!(
            "{} differs from the golden file at line {} (rerun with AUTOPAR_BLESS=1 to accept):\n--- expected\n{}\n+++ actual\n{}",
            path.display(),
            line + 1,
            show(&expected),
            show(actual)
        );
    }
}

/// The kernels of `op` on `operands` (results typed by the IR), without the prelude.
fn sources(op: &Op, operands: &[TensorType]) -> String {
    let refs: Vec<&TensorType> = operands.iter().collect();
    let results = autopar_ir::infer::infer(op, &refs, None).expect("well typed");
    let NodeKernels::Compute(p) = codegen::kernels_for_node(op, &refs, &results).expect("kernels")
    else {
        panic!("{op} is computed");
    };
    let again = codegen::kernels_for_node(op, &refs, &results).expect("kernels");
    assert_eq!(
        again,
        NodeKernels::Compute(p.clone()),
        "generation is deterministic"
    );
    p.kernels()
        .map(|k| {
            let body = k
                .source
                .strip_prefix(PRELUDE)
                .expect("every kernel starts with the prelude");
            format!(
                "// {} grid {:?} block {:?}\n{}",
                k.name,
                k.grid,
                k.block,
                body.trim_start()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn vector_add_f32() {
    let t = TensorType::new(DType::F32, vec![4, 1030]);
    check_golden(
        "add_f32.cu",
        &sources(
            &Op::Binary {
                func: BinaryOp::Add,
            },
            &[t.clone(), t],
        ),
    );
}

#[test]
fn softmax_bf16_is_one_warp_per_row() {
    let t = TensorType::new(DType::BF16, vec![8, 256]);
    check_golden("softmax_bf16.cu", &sources(&Op::Softmax { dim: 1 }, &[t]));
}

#[test]
fn layer_norm_f16_is_one_block_per_row() {
    let x = TensorType::new(DType::F16, vec![4, 2048]);
    let g = TensorType::new(DType::F16, vec![2048]);
    check_golden(
        "layer_norm_f16.cu",
        &sources(&Op::LayerNorm { eps: 1e-5 }, &[x, g.clone(), g]),
    );
}

#[test]
fn bias_gelu_fusion_broadcasts_by_index_arithmetic() {
    let (name, body) = common::fusion_bodies(DType::BF16, 16, 64).remove(0);
    assert_eq!(name, "bias_gelu");
    let params = body.params.clone();
    check_golden("bias_gelu_bf16.cu", &sources(&Op::Fusion { body }, &params));
}

#[test]
fn einsum_permutes_around_the_gemm() {
    let q = TensorType::new(DType::F32, vec![2, 6, 4, 8]);
    let k = TensorType::new(DType::F32, vec![2, 5, 4, 8]);
    let spec = "bshd,bthd->bhst".parse().expect("a spec");
    check_golden("einsum_scores.cu", &sources(&Op::Einsum { spec }, &[q, k]));
}

#[test]
fn attention_forward_gqa_causal() {
    let q = TensorType::new(DType::BF16, vec![1, 40, 4, 32]);
    let kv = TensorType::new(DType::BF16, vec![1, 40, 2, 32]);
    check_golden(
        "attention_fwd_bf16.cu",
        &sources(
            &Op::Attention {
                causal: true,
                scale: 0.125,
            },
            &[q, kv.clone(), kv],
        ),
    );
}

#[test]
fn integer_ops_wrap_and_refuse_pow() {
    let t = TensorType::new(DType::I32, vec![10]);
    check_golden(
        "neg_i32.cu",
        &sources(&Op::Unary { func: UnaryOp::Neg }, std::slice::from_ref(&t)),
    );
    let refs = [&t, &t];
    let err = codegen::kernels_for_node(
        &Op::Binary {
            func: BinaryOp::Pow,
        },
        &refs,
        std::slice::from_ref(&t),
    )
    .expect_err("integer pow has no kernel");
    assert!(err.to_string().contains("pow"), "{err}");
}
