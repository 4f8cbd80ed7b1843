//! What the tests of the CUDA backend share: whether NVRTC can be loaded, and hand-written
//! fusion bodies of the shapes the fusion pass makes.

#![allow(dead_code)]

use autopar_ir::{
    BinaryOp, DType, FusedInstr, FusionBody, Op, ReduceOp, Shape, TensorType, UnaryOp,
};

/// Whether libnvrtc loads; prints why a test is skipped when it does not.
pub fn nvrtc_or_skip(test: &str) -> bool {
    if autopar_runtime_cuda::device::nvrtc_present() {
        return true;
    }
    eprintln!(
        "SKIPPED {test}: libnvrtc cannot be loaded (install the nvidia-cuda-nvrtc wheel and put \
         its nvidia/cu13/lib on LD_LIBRARY_PATH; .ci/run does)"
    );
    false
}

fn instr(op: Op, operands: &[usize]) -> FusedInstr {
    FusedInstr {
        op,
        operands: operands.to_vec(),
    }
}

/// Fusion bodies of the shapes an element-wise fusion pass makes, over `[rows, cols]` of
/// `dtype`: a bias-GELU (broadcast of a row vector), a residual add with a cast, a
/// softmax-like row reduction, a GELU backward (several results), and a mean-of-squares
/// reduction to one row value.
pub fn fusion_bodies(dtype: DType, rows: usize, cols: usize) -> Vec<(&'static str, FusionBody)> {
    let mat = TensorType::new(dtype, vec![rows, cols]);
    let row = TensorType::new(dtype, vec![cols]);
    let bcast = |d: Vec<usize>| Op::Broadcast {
        shape: Shape::new(vec![rows, cols]),
        dims: d,
    };
    let unary = |func| Op::Unary { func };
    let binary = |func| Op::Binary { func };
    vec![
        (
            "bias_gelu",
            FusionBody {
                params: vec![mat.clone(), row.clone()],
                instrs: vec![
                    instr(bcast(vec![1]), &[1]),
                    instr(binary(BinaryOp::Add), &[0, 2]),
                    instr(unary(UnaryOp::Gelu), &[3]),
                ],
                results: vec![4],
            },
        ),
        (
            "residual_cast",
            FusionBody {
                params: vec![mat.clone(), mat.clone()],
                instrs: vec![
                    instr(binary(BinaryOp::Add), &[0, 1]),
                    instr(Op::Cast { to: DType::F32 }, &[2]),
                ],
                results: vec![2, 3],
            },
        ),
        (
            "softmax_rows",
            FusionBody {
                params: vec![mat.clone()],
                instrs: vec![
                    instr(
                        Op::Reduce {
                            func: ReduceOp::Max,
                            dims: vec![1],
                        },
                        &[0],
                    ),
                    instr(
                        Op::Broadcast {
                            shape: Shape::new(vec![rows, cols]),
                            dims: vec![0],
                        },
                        &[1],
                    ),
                    instr(binary(BinaryOp::Sub), &[0, 2]),
                    instr(unary(UnaryOp::Exp), &[3]),
                    instr(
                        Op::Reduce {
                            func: ReduceOp::Sum,
                            dims: vec![1],
                        },
                        &[4],
                    ),
                    instr(
                        Op::Broadcast {
                            shape: Shape::new(vec![rows, cols]),
                            dims: vec![0],
                        },
                        &[5],
                    ),
                    instr(binary(BinaryOp::Div), &[4, 6]),
                ],
                results: vec![7],
            },
        ),
        (
            "gelu_backward",
            FusionBody {
                params: vec![mat.clone(), mat.clone()],
                instrs: vec![
                    instr(unary(UnaryOp::Tanh), &[0]),
                    instr(unary(UnaryOp::Square), &[2]),
                    instr(binary(BinaryOp::Mul), &[1, 3]),
                    instr(binary(BinaryOp::Max), &[4, 0]),
                ],
                results: vec![4, 5],
            },
        ),
        (
            "mean_square_column",
            FusionBody {
                params: vec![mat.clone()],
                instrs: vec![
                    instr(unary(UnaryOp::Square), &[0]),
                    instr(
                        Op::Reduce {
                            func: ReduceOp::Mean,
                            dims: vec![0],
                        },
                        &[1],
                    ),
                ],
                results: vec![2],
            },
        ),
        (
            "sum_of_squares",
            FusionBody {
                params: vec![mat],
                instrs: vec![
                    instr(unary(UnaryOp::Square), &[0]),
                    instr(
                        Op::Reduce {
                            func: ReduceOp::Sum,
                            dims: vec![0, 1],
                        },
                        &[1],
                    ),
                ],
                results: vec![2],
            },
        ),
    ]
}
