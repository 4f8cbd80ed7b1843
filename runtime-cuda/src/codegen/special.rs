//! Kernels of their own: the rotary embedding, cross-entropy (one row per warp or block) and
//! MoE routing (one thread per routing group, serial like the reference).

use std::fmt::Write as _;

use autopar_ir::TensorType;

use super::fusion::{ROW_BLOCK, WARP_ROW_MAX, WARPS_PER_BLOCK};
use super::{
    Arg, BLOCK, Kernel, NodeProgram, Step, blocks_for, finish, load, require_float, storage, store,
};
use crate::error::CudaError;

/// Rotate-half rotary embedding of `x[..., s, heads, d]`, positions from the optional
/// integer operand (else the row index). Angles and their cosines are computed in f64.
pub fn rotary(base: f64, operands: &[&TensorType]) -> Result<Kernel, CudaError> {
    let x = operands[0];
    require_float("rotary", x.dtype)?;
    let r = x.rank();
    if r < 3 || !x.dims()[r - 1].is_multiple_of(2) {
        return Err(CudaError::Unsupported {
            op: "rotary",
            operands: x.to_string(),
            detail: "needs [..., s, heads, d] with d even".into(),
        });
    }
    let (s, heads, d) = (
        x.dims()[r - 3] as u64,
        x.dims()[r - 2] as u64,
        x.dims()[r - 1] as u64,
    );
    let half = d / 2;
    let t = storage(x.dtype);
    let mut sig = format!("const {t}* __restrict__ p0");
    let mut args = vec![Arg::Operand(0)];
    let position = if let Some(p) = operands.get(1) {
        if !p.dtype.is_int() {
            return Err(CudaError::UnsupportedDType {
                op: "rotary",
                dtype: p.dtype,
            });
        }
        let _ = write!(sig, ", const {}* __restrict__ p1", storage(p.dtype));
        args.push(Arg::Operand(1));
        "(double)p1[row]".to_string()
    } else {
        "(double)row".to_string()
    };
    let _ = write!(sig, ", {t}* __restrict__ r0");
    args.push(Arg::Result(0));
    let n = x.num_elements();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({BLOCK}) KERNEL({sig}) {{"
    );
    let _ = writeln!(
        src,
        "  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;"
    );
    let _ = writeln!(
        src,
        "  for (ap_i64 i = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < {n}ll; i += stride) {{"
    );
    let _ = writeln!(src, "    const ap_i64 vec = i / {d}ll;");
    let _ = writeln!(src, "    const ap_i64 c = i % {d}ll;");
    let _ = writeln!(src, "    const ap_i64 row = (vec / {heads}ll) % {s}ll;");
    let _ = writeln!(src, "    const ap_i64 k = c < {half}ll ? c : c - {half}ll;");
    let _ = writeln!(
        src,
        "    const double theta = {position} * pow({base:e}, -2.0 * (double)k / {d}.0);"
    );
    let _ = writeln!(src, "    double sn, cs;");
    let _ = writeln!(src, "    sincos(theta, &sn, &cs);");
    let _ = writeln!(
        src,
        "    const double lo = (double){};",
        load(x.dtype, &format!("p0[vec * {d}ll + k]"))
    );
    let _ = writeln!(
        src,
        "    const double hi = (double){};",
        load(x.dtype, &format!("p0[vec * {d}ll + k + {half}ll]"))
    );
    let _ = writeln!(
        src,
        "    const float y = (float)(c < {half}ll ? lo * cs - hi * sn : hi * cs + lo * sn);"
    );
    let _ = writeln!(src, "    r0[i] = {};", store(x.dtype, "y"));
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        "rotary",
        &src,
        [blocks_for(n, u64::from(BLOCK)), 1, 1],
        [BLOCK, 1, 1],
        0,
        args,
    ))
}

/// The reduction of `v` (a float) over a warp, or a block through `sh[32]`.
fn row_reduce(src: &mut String, v: &str, combine: &str, init: &str, block: bool) {
    let _ = writeln!(src, "    AP_WARP_REDUCE(float, {v}, {combine})");
    if block {
        let _ = writeln!(
            src,
            "    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = {v};"
        );
        let _ = writeln!(src, "    __syncthreads();");
        let _ = writeln!(src, "    if (threadIdx.x < 32) {{");
        let _ = writeln!(
            src,
            "      {v} = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : {init};"
        );
        let _ = writeln!(src, "      AP_WARP_REDUCE(float, {v}, {combine})");
        let _ = writeln!(src, "      if (threadIdx.x == 0) sh[0] = {v};");
        let _ = writeln!(src, "    }}");
        let _ = writeln!(src, "    __syncthreads();");
        let _ = writeln!(src, "    {v} = sh[0];");
        let _ = writeln!(src, "    __syncthreads();");
    }
}

/// `logsumexp(logits) - logits[target]` per row of `logits[..., v]`; a target outside
/// `0..v` gives NaN.
pub fn cross_entropy(operands: &[&TensorType], out: &TensorType) -> Result<Kernel, CudaError> {
    let (logits, targets) = (operands[0], operands[1]);
    require_float("cross_entropy", logits.dtype)?;
    if !targets.dtype.is_int() {
        return Err(CudaError::UnsupportedDType {
            op: "cross_entropy",
            dtype: targets.dtype,
        });
    }
    let v = logits.dims().last().copied().unwrap_or(1) as u64;
    let rows = out.num_elements();
    let per_warp = v <= WARP_ROW_MAX;
    let (lt, tt) = (storage(logits.dtype), storage(targets.dtype));
    let threads = if per_warp {
        32 * WARPS_PER_BLOCK
    } else {
        ROW_BLOCK
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({threads}) KERNEL(const {lt}* __restrict__ p0, const {tt}* __restrict__ p1, float* __restrict__ r0) {{"
    );
    let (step, grid) = if per_warp {
        let _ = writeln!(src, "  const ap_i64 lane = threadIdx.x & 31;");
        let _ = writeln!(
            src,
            "  for (ap_i64 row = (ap_i64)blockIdx.x * {WARPS_PER_BLOCK} + (threadIdx.x >> 5); row < {rows}ll; row += (ap_i64)gridDim.x * {WARPS_PER_BLOCK}) {{"
        );
        ("32", blocks_for(rows, u64::from(WARPS_PER_BLOCK)))
    } else {
        let _ = writeln!(src, "  __shared__ float sh[32];");
        let _ = writeln!(src, "  const ap_i64 lane = threadIdx.x;");
        let _ = writeln!(
            src,
            "  for (ap_i64 row = blockIdx.x; row < {rows}ll; row += gridDim.x) {{"
        );
        ("blockDim.x", blocks_for(rows, 1))
    };
    let x = |j: &str| load(logits.dtype, &format!("p0[row * {v}ll + {j}]"));
    let neg_inf = super::float_literal(f64::NEG_INFINITY);
    // The reference's maximum ignores NaN (`f64::max`); a NaN still reaches the sum.
    let _ = writeln!(src, "    float m = {neg_inf};");
    let _ = writeln!(
        src,
        "    for (ap_i64 j = lane; j < {v}ll; j += {step}) m = fmaxf(m, {});",
        x("j")
    );
    row_reduce(&mut src, "m", "fmaxf", &neg_inf, !per_warp);
    let _ = writeln!(src, "    float s = 0.0f;");
    let _ = writeln!(
        src,
        "    for (ap_i64 j = lane; j < {v}ll; j += {step}) s += expf({} - m);",
        x("j")
    );
    row_reduce(&mut src, "s", "ap_sum", "0.0f", !per_warp);
    let _ = writeln!(src, "    if (lane == 0) {{");
    let _ = writeln!(src, "      const ap_i64 t = (ap_i64)p1[row];");
    let _ = writeln!(
        src,
        "      r0[row] = (t >= 0 && t < {v}ll) ? m + logf(s) - {} : __int_as_float(0x7fc00000);",
        x("t")
    );
    let _ = writeln!(src, "    }}");
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        if per_warp { "xentwarp" } else { "xentblock" },
        &src,
        [grid, 1, 1],
        [threads, 1, 1],
        0,
        vec![Arg::Operand(0), Arg::Operand(1), Arg::Result(0)],
    ))
}

/// GShard-style top-k routing with capacity: both results zeroed, then one thread per group
/// picks each token's experts (highest probability first, ties to the lower index) and hands
/// out slots choice rank by choice rank, token by token.
pub fn moe_route(
    top_k: usize,
    capacity: usize,
    normalize: bool,
    operands: &[&TensorType],
    out: &TensorType,
) -> Result<NodeProgram, CudaError> {
    let probs = operands[0];
    require_float("moe_route", probs.dtype)?;
    let r = probs.rank();
    if r < 2 || top_k == 0 || top_k > probs.dims()[r - 1] {
        return Err(CudaError::Unsupported {
            op: "moe_route",
            operands: probs.to_string(),
            detail: format!("top_k {top_k} needs 1..=experts over [..., tokens, experts]"),
        });
    }
    let (tokens, experts) = (probs.dims()[r - 2] as u64, probs.dims()[r - 1] as u64);
    let groups: u64 = probs.dims()[..r - 2].iter().map(|&d| d as u64).product();
    let c = capacity as u64;
    let t = storage(probs.dtype);
    let p = |e: &str| {
        load(
            probs.dtype,
            &format!("p0[g * {}ll + tok * {experts}ll + {e}]", tokens * experts),
        )
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__(128) KERNEL(const {t}* __restrict__ p0, {t}* __restrict__ r0, {t}* __restrict__ r1) {{"
    );
    let _ = writeln!(
        src,
        "  const ap_i64 g = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x;"
    );
    let _ = writeln!(src, "  if (g >= {groups}ll) return;");
    let _ = writeln!(src, "  int used[{experts}];");
    let _ = writeln!(src, "  for (int e = 0; e < {experts}; ++e) used[e] = 0;");
    let _ = writeln!(src, "  for (int rank = 0; rank < {top_k}; ++rank) {{");
    let _ = writeln!(src, "    for (ap_i64 tok = 0; tok < {tokens}ll; ++tok) {{");
    let _ = writeln!(src, "      int chosen[{top_k}];");
    let _ = writeln!(src, "      float gate[{top_k}];");
    let _ = writeln!(src, "      float sum = 0.0f;");
    let _ = writeln!(src, "      for (int k = 0; k < {top_k}; ++k) {{");
    let _ = writeln!(src, "        int best = -1;");
    let _ = writeln!(src, "        float best_p = 0.0f;");
    let _ = writeln!(src, "        for (int e = 0; e < {experts}; ++e) {{");
    let _ = writeln!(src, "          bool taken = false;");
    let _ = writeln!(
        src,
        "          for (int q = 0; q < k; ++q) taken = taken || chosen[q] == e;"
    );
    let _ = writeln!(src, "          const float pe = {};", p("e"));
    let _ = writeln!(
        src,
        "          if (!taken && (best < 0 || pe > best_p)) {{ best = e; best_p = pe; }}"
    );
    let _ = writeln!(src, "        }}");
    let _ = writeln!(src, "        chosen[k] = best;");
    let _ = writeln!(src, "        gate[k] = best_p;");
    let _ = writeln!(src, "        sum += best_p;");
    let _ = writeln!(src, "      }}");
    let norm = if normalize {
        "(sum != 0.0f ? sum : 1.0f)"
    } else {
        "1.0f"
    };
    let _ = writeln!(src, "      const int e = chosen[rank];");
    let _ = writeln!(src, "      if (used[e] < {c}) {{");
    let _ = writeln!(
        src,
        "        const ap_i64 slot = g * {}ll + (tok * {experts}ll + e) * {c}ll + used[e];",
        tokens * experts * c
    );
    let _ = writeln!(
        src,
        "        r0[slot] = {};",
        store(probs.dtype, &format!("gate[rank] / {norm}"))
    );
    let _ = writeln!(src, "        r1[slot] = {};", store(probs.dtype, "1.0f"));
    let _ = writeln!(src, "        used[e] += 1;");
    let _ = writeln!(src, "      }}");
    let _ = writeln!(src, "    }}");
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    let kernel = finish(
        "moe",
        &src,
        [blocks_for(groups, 128), 1, 1],
        [128, 1, 1],
        0,
        vec![Arg::Operand(0), Arg::Result(0), Arg::Result(1)],
    );
    let bytes = out.size_bytes();
    Ok(NodeProgram {
        steps: vec![
            Step::Zero {
                at: Arg::Result(0),
                bytes,
            },
            Step::Zero {
                at: Arg::Result(1),
                bytes,
            },
            Step::Launch(kernel),
        ],
        scratch_bytes: 0,
    })
}
