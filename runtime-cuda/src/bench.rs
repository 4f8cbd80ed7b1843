//! Kernel benchmarks for a machine with a GPU (`autopar bench-kernels --device cuda`, which
//! `scripts/gpu-check.sh` runs): a bf16 GEMM, attention forward plus backward, and a fused
//! element-wise kernel, each a one-op program loaded on [`CudaBackend`] and timed on its
//! own (no feeds, no read-back), against the GPU's peak or the copy bandwidth measured in
//! the same run.

use autopar_ir::{
    BinaryOp, DType, FusedInstr, FusionBody, Graph, Init, Op, Shape, TensorType, UnaryOp,
};
use autopar_runtime::{Backend, ExecutionPlan, RuntimeError};

use crate::backend::CudaBackend;

/// One measured figure.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// What was measured.
    pub name: String,
    /// The figure.
    pub value: f64,
    /// Its unit (`TFLOP/s`, `GB/s`).
    pub unit: &'static str,
    /// What it is compared with (a peak, a measured bandwidth), and its name.
    pub against: Option<(f64, String)>,
}

/// Dense bf16 tensor-core peaks in TFLOP/s, by a substring of the device name (vendor data
/// sheets: H100/H200 SXM 989, A100 312, L40S 362, B200 2250).
const PEAKS: [(&str, f64); 5] = [
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("B200", 2250.0),
];

fn parameter(
    g: &mut Graph,
    name: &str,
    ty: TensorType,
) -> Result<autopar_ir::ValueId, RuntimeError> {
    Ok(g.add(
        Op::Parameter {
            name: name.into(),
            ty,
            init: Init::Zeros,
        },
        &[],
    )?)
}

/// Seconds per run of `graph` (all its nodes) on GPU 0.
fn time(backend: &CudaBackend, graph: &Graph, iters: usize) -> Result<f64, RuntimeError> {
    let plan = ExecutionPlan::new(graph)?;
    let exe = backend.load(graph, plan)?;
    backend.time_compute(&exe, iters)
}

/// Runs every benchmark; `scale` (1 for the full sizes, larger to shrink them) divides the
/// problem sizes for a quick run.
pub fn run(backend: &CudaBackend, scale: usize) -> Result<Vec<Figure>, RuntimeError> {
    let scale = scale.max(1);
    let name = backend.device_name(0)?;
    let peak = PEAKS
        .iter()
        .find(|(n, _)| name.contains(n))
        .map(|&(n, p)| (p, format!("{n} bf16 peak")));
    let mut out = Vec::new();

    // GEMM, bf16 8192^3.
    let n = 8192 / scale;
    let mut g = Graph::new("gemm");
    let ty = TensorType::new(DType::BF16, vec![n, n]);
    let a = parameter(&mut g, "a", ty.clone())?;
    let b = parameter(&mut g, "b", ty)?;
    let c = g.add(
        Op::Einsum {
            spec: "mk,kn->mn"
                .parse()
                .map_err(|e: String| RuntimeError::SpmdSetup { detail: e })?,
        },
        &[a, b],
    )?;
    g.add_output("c", c)?;
    let secs = time(backend, &g, 20)?;
    out.push(Figure {
        name: format!("GEMM bf16 {n}^3"),
        value: 2.0 * (n as f64).powi(3) / secs / 1e12,
        unit: "TFLOP/s",
        against: peak.clone(),
    });

    // Attention forward + backward, causal, seq 4096, head dim 128, 16 heads.
    let (s, h, d) = (4096 / scale, 16, 128);
    let mut g = Graph::new("attention");
    let ty = TensorType::new(DType::BF16, vec![1, s, h, d]);
    let q = parameter(&mut g, "q", ty.clone())?;
    let k = parameter(&mut g, "k", ty.clone())?;
    let v = parameter(&mut g, "v", ty.clone())?;
    let scale_f = 1.0 / (d as f64).sqrt();
    let o = g.add(
        Op::Attention {
            causal: true,
            scale: scale_f,
        },
        &[q, k, v],
    )?;
    let grads = g.add_node(
        Op::AttentionBackward {
            causal: true,
            scale: scale_f,
        },
        &[q, k, v, o, o],
    )?;
    let dq = g.node(grads).outputs[0];
    g.add_output("o", o)?;
    g.add_output("dq", dq)?;
    let secs = time(backend, &g, 5)?;
    // Causal forward: 2 matmuls of s*s/2*d per head; backward 2.5 times the forward.
    let fwd = 4.0 * (s as f64) * (s as f64) / 2.0 * d as f64 * h as f64;
    out.push(Figure {
        name: format!("attention fwd+bwd bf16 s={s} d={d} h={h} causal"),
        value: 3.5 * fwd / secs / 1e12,
        unit: "TFLOP/s",
        against: peak,
    });

    // Fused element-wise: gelu(x + bias) * y on bf16 [8192, 8192], against a copy of the
    // same bytes.
    let (rows, cols) = (8192 / scale, 8192);
    let mat = TensorType::new(DType::BF16, vec![rows, cols]);
    let row = TensorType::new(DType::BF16, vec![cols]);
    let body = FusionBody {
        params: vec![mat.clone(), row.clone(), mat.clone()],
        instrs: vec![
            FusedInstr {
                op: Op::Broadcast {
                    shape: Shape::new(vec![rows, cols]),
                    dims: vec![1],
                },
                operands: vec![1],
            },
            FusedInstr {
                op: Op::Binary {
                    func: BinaryOp::Add,
                },
                operands: vec![0, 3],
            },
            FusedInstr {
                op: Op::Unary {
                    func: UnaryOp::Gelu,
                },
                operands: vec![4],
            },
            FusedInstr {
                op: Op::Binary {
                    func: BinaryOp::Mul,
                },
                operands: vec![5, 2],
            },
        ],
        results: vec![6],
    };
    let mut g = Graph::new("fused");
    let x = parameter(&mut g, "x", mat.clone())?;
    let bias = parameter(&mut g, "bias", row)?;
    let y = parameter(&mut g, "y", mat.clone())?;
    let f = g.add(Op::Fusion { body }, &[x, bias, y])?;
    g.add_output("f", f)?;
    let secs = time(backend, &g, 20)?;
    let bytes = 3.0 * mat.size_bytes() as f64;
    let copy = backend.time_copy(mat.size_bytes() as usize * 3 / 2, 20)?;
    out.push(Figure {
        name: format!("fused bias-GELU-mul bf16 [{rows}, {cols}]"),
        value: bytes / secs / 1e9,
        unit: "GB/s",
        against: Some((bytes / copy / 1e9, "cuMemcpyDtoD of the same bytes".into())),
    });
    Ok(out)
}
