//! Attention forward and backward, FlashAttention-2 style: the probabilities are never
//! stored; key/value (or query/gradient) tiles are staged in shared memory in f32, every
//! accumulation is f32, and the softmax is online (running maximum and sum, rescaled as each
//! key tile arrives).
//!
//! * Forward: a block of 4 warps holds 16 query rows of one (batch, query head), 4 per warp;
//!   for each tile of keys, lane `j` scores key `j` against a row, the warp reduces the
//!   tile's maximum and sum, and each lane accumulates its share of the output features.
//!   Without positions, key tiles entirely in a causal block's future are skipped.
//! * Backward: a statistics pass (one warp per query row: its log-sum-exp and
//!   `delta = rowsum(g o)`, into scratch), then one kernel for `dk`/`dv` (a block per 8 keys of a
//!   kv head, looping over every query head of its group and every query tile, so no
//!   atomics are needed even with grouped-query attention) and one for `dq` (as the forward).
//!
//! The kernels use CUDA cores (no tensor-core MMA): they are correct for every shape the
//! IR allows with `d + dv <= 512`, but well below the GPU's attention peak.
//!
//! Grouped-query attention: query head `h` reads kv head `h / (hq / hkv)`. Positions (the
//! ring attention of context parallelism): with causal masking, query `i` sees key `j` when
//! `k_pos[j] <= q_pos[i]`; a query that sees no key gets NaN, as the reference's softmax of
//! only `-inf` does.

use std::fmt::Write as _;

use autopar_ir::TensorType;

use super::{Arg, Kernel, NodeProgram, Step, finish, load, require_float, storage, store};
use crate::error::CudaError;

/// Static shared memory a kernel may use.
const SHARED_LIMIT: u64 = 48 * 1024;

/// Query rows per warp in the forward and `dq` kernels.
const ROWS_PER_WARP: u64 = 4;

/// Warps per block.
const WARPS: u64 = 4;

/// Keys per block of the `dk`/`dv` kernel.
const KEYS_PER_BLOCK: u64 = 8;

/// The shapes of an attention.
struct Dims {
    b: u64,
    s: u64,
    hq: u64,
    t: u64,
    hkv: u64,
    d: u64,
    dv: u64,
    group: u64,
}

fn dims(
    op: &'static str,
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
) -> Result<Dims, CudaError> {
    let bad = |detail: &str| CudaError::Unsupported {
        op,
        operands: format!("{q}, {k}, {v}"),
        detail: detail.into(),
    };
    let (&[b, s, hq, d], &[_, t, hkv, _], &[_, _, _, dv]) = (q.dims(), k.dims(), v.dims()) else {
        return Err(bad("operands must have rank 4"));
    };
    if hkv == 0 || hq % hkv != 0 {
        return Err(bad("query heads must be a multiple of kv heads"));
    }
    if d + dv > 512 {
        return Err(bad(
            "head dims d + dv above 512 do not fit the shared-memory tiles",
        ));
    }
    for x in [q, k, v] {
        require_float(op, x.dtype)?;
    }
    let u = |x: usize| x as u64;
    Ok(Dims {
        b: u(b),
        s: u(s),
        hq: u(hq),
        t: u(t),
        hkv: u(hkv),
        d: u(d),
        dv: u(dv),
        group: u(hq / hkv),
    })
}

/// The visibility test of query `i` and key `j` (C expression), given the mask options.
fn visible(causal: bool, positions: bool) -> &'static str {
    match (causal, positions) {
        (false, _) => "true",
        (true, true) => "(kp[j] <= qp[i])",
        (true, false) => "(j <= i)",
    }
}

/// Parameters for the optional positions, at operand indices `first`, `first + 1`.
fn position_params(
    operands: &[&TensorType],
    first: usize,
) -> Result<Option<(String, Vec<Arg>)>, CudaError> {
    match (operands.get(first), operands.get(first + 1)) {
        (Some(qp), Some(kp)) => {
            for p in [qp, kp] {
                if !p.dtype.is_int() {
                    return Err(CudaError::UnsupportedDType {
                        op: "attention",
                        dtype: p.dtype,
                    });
                }
            }
            Ok(Some((
                format!(
                    ", const {}* __restrict__ qp, const {}* __restrict__ kp",
                    storage(qp.dtype),
                    storage(kp.dtype)
                ),
                vec![Arg::Operand(first), Arg::Operand(first + 1)],
            )))
        }
        _ => Ok(None),
    }
}

/// Key tile length that fits next to `fixed` bytes of shared memory, each key taking
/// `per_key` bytes: 32, else 16.
fn key_tile(fixed: u64, per_key: u64) -> Result<u64, CudaError> {
    for bk in [32u64, 16] {
        if fixed + bk * per_key <= SHARED_LIMIT {
            return Ok(bk);
        }
    }
    Err(CudaError::Unsupported {
        op: "attention",
        operands: String::new(),
        detail: "the tiles do not fit in shared memory".into(),
    })
}

/// The forward kernel.
pub fn forward(
    causal: bool,
    scale: f64,
    operands: &[&TensorType],
    out: &TensorType,
) -> Result<Kernel, CudaError> {
    let (q, k, v) = (operands[0], operands[1], operands[2]);
    let x = dims("attention", q, k, v)?;
    let pos = position_params(operands, 3)?;
    let (qt, kt, vt, ot) = (
        storage(q.dtype),
        storage(k.dtype),
        storage(v.dtype),
        storage(out.dtype),
    );
    let rows_per_block = ROWS_PER_WARP * WARPS;
    let (d, dv) = (x.d, x.dv);
    let bk = key_tile(rows_per_block * d * 4, (d + 1 + dv + 1) * 4)?;
    let dvl = dv.div_ceil(32);
    let mut sig = format!(
        "const {qt}* __restrict__ q, const {kt}* __restrict__ k, const {vt}* __restrict__ v"
    );
    let mut args = vec![Arg::Operand(0), Arg::Operand(1), Arg::Operand(2)];
    if let Some((text, a)) = &pos {
        sig.push_str(text);
        args.extend(a);
    }
    let _ = write!(sig, ", {ot}* __restrict__ o");
    args.push(Arg::Result(0));
    let vis = visible(causal, pos.is_some());
    let scale_lit = super::float_literal(scale);
    let neg_inf = super::float_literal(f64::NEG_INFINITY);
    let (s, t, hq, hkv, group) = (x.s, x.t, x.hq, x.hkv, x.group);
    let mut src = String::new();
    let w = |src: &mut String, line: &str| {
        src.push_str(line);
        src.push('\n');
    };
    w(
        &mut src,
        &format!(
            "extern \"C\" __global__ void __launch_bounds__({}) KERNEL({sig}) {{",
            WARPS * 32
        ),
    );
    w(
        &mut src,
        &format!("  __shared__ float qs[{rows_per_block}][{d}];"),
    );
    w(
        &mut src,
        &format!("  __shared__ float ks[{bk}][{}];", d + 1),
    );
    w(
        &mut src,
        &format!("  __shared__ float vs[{bk}][{}];", dv + 1),
    );
    w(
        &mut src,
        "  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;",
    );
    w(
        &mut src,
        "  const ap_i64 bi = blockIdx.z, h = blockIdx.y, kh = h / GROUP;"
            .replace("GROUP", &group.to_string())
            .as_str(),
    );
    w(
        &mut src,
        &format!("  const ap_i64 i0 = (ap_i64)blockIdx.x * {rows_per_block};"),
    );
    w(
        &mut src,
        &format!(
            "  for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
            rows_per_block * d
        ),
    );
    w(
        &mut src,
        &format!("    const ap_i64 r = e / {d}, c = e % {d}, i = i0 + r;"),
    );
    w(
        &mut src,
        &format!(
            "    qs[r][c] = i < {s}ll ? {} : 0.0f;",
            load(
                q.dtype,
                &format!("q[((bi * {s}ll + i) * {hq}ll + h) * {d}ll + c]")
            )
        ),
    );
    w(&mut src, "  }");
    w(&mut src, &format!("  float acc[{ROWS_PER_WARP}][{dvl}];"));
    w(
        &mut src,
        &format!("  float m[{ROWS_PER_WARP}], l[{ROWS_PER_WARP}];"),
    );
    w(
        &mut src,
        &format!(
            "  for (int r = 0; r < {ROWS_PER_WARP}; ++r) {{ m[r] = {neg_inf}; l[r] = 0.0f; for (int c = 0; c < {dvl}; ++c) acc[r][c] = 0.0f; }}"
        ),
    );
    let tile_end = if causal && pos.is_none() {
        format!("min({t}ll, i0 + {rows_per_block}ll)")
    } else {
        format!("{t}ll")
    };
    w(
        &mut src,
        &format!("  for (ap_i64 j0 = 0; j0 < {tile_end}; j0 += {bk}) {{"),
    );
    w(&mut src, "    __syncthreads();");
    w(
        &mut src,
        &format!(
            "    for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
            bk * d
        ),
    );
    w(
        &mut src,
        &format!("      const ap_i64 r = e / {d}, c = e % {d}, j = j0 + r;"),
    );
    w(
        &mut src,
        &format!(
            "      ks[r][c] = j < {t}ll ? {} : 0.0f;",
            load(
                k.dtype,
                &format!("k[((bi * {t}ll + j) * {hkv}ll + kh) * {d}ll + c]")
            )
        ),
    );
    w(&mut src, "    }");
    w(
        &mut src,
        &format!(
            "    for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
            bk * dv
        ),
    );
    w(
        &mut src,
        &format!("      const ap_i64 r = e / {dv}, c = e % {dv}, j = j0 + r;"),
    );
    w(
        &mut src,
        &format!(
            "      vs[r][c] = j < {t}ll ? {} : 0.0f;",
            load(
                v.dtype,
                &format!("v[((bi * {t}ll + j) * {hkv}ll + kh) * {dv}ll + c]")
            )
        ),
    );
    w(&mut src, "    }");
    w(&mut src, "    __syncthreads();");
    w(
        &mut src,
        &format!("    for (int r = 0; r < {ROWS_PER_WARP}; ++r) {{"),
    );
    w(
        &mut src,
        &format!("      const int lr = warp * {ROWS_PER_WARP} + r;"),
    );
    w(&mut src, "      const ap_i64 i = i0 + lr;");
    w(&mut src, "      const ap_i64 j = j0 + lane;");
    w(&mut src, &format!("      float sc = {neg_inf};"));
    w(
        &mut src,
        &format!("      if (lane < {bk} && j < {t}ll && i < {s}ll && {vis}) {{"),
    );
    w(&mut src, "        float dot = 0.0f;");
    w(
        &mut src,
        &format!("        for (int c = 0; c < {d}; ++c) dot += qs[lr][c] * ks[lane][c];"),
    );
    w(&mut src, &format!("        sc = dot * {scale_lit};"));
    w(&mut src, "      }");
    w(&mut src, "      float tile_max = sc;");
    w(&mut src, "      AP_WARP_REDUCE(float, tile_max, fmaxf)");
    w(&mut src, "      const float m_new = fmaxf(m[r], tile_max);");
    w(
        &mut src,
        &format!("      const bool none = m_new == {neg_inf};"),
    );
    w(
        &mut src,
        "      const float alpha = none ? 1.0f : expf(m[r] - m_new);",
    );
    w(
        &mut src,
        "      const float p = none ? 0.0f : expf(sc - m_new);",
    );
    w(&mut src, "      float p_sum = p;");
    w(&mut src, "      AP_WARP_REDUCE(float, p_sum, ap_sum)");
    w(&mut src, "      l[r] = l[r] * alpha + p_sum;");
    w(&mut src, "      m[r] = m_new;");
    w(
        &mut src,
        &format!("      for (int c = 0; c < {dvl}; ++c) acc[r][c] *= alpha;"),
    );
    w(
        &mut src,
        &format!("      for (int jj = 0; jj < {bk}; ++jj) {{"),
    );
    w(
        &mut src,
        "        const float pj = __shfl_sync(0xffffffffu, p, jj);",
    );
    w(
        &mut src,
        &format!(
            "        for (int c = 0; c < {dvl}; ++c) {{ const int col = lane + 32 * c; if (col < {dv}) acc[r][c] += pj * vs[jj][col]; }}"
        ),
    );
    w(&mut src, "      }");
    w(&mut src, "    }");
    w(&mut src, "  }");
    w(
        &mut src,
        &format!("  for (int r = 0; r < {ROWS_PER_WARP}; ++r) {{"),
    );
    w(
        &mut src,
        &format!("    const ap_i64 i = i0 + warp * {ROWS_PER_WARP} + r;"),
    );
    w(&mut src, &format!("    if (i >= {s}ll) continue;"));
    w(&mut src, &format!("    for (int c = 0; c < {dvl}; ++c) {{"));
    w(&mut src, "      const int col = lane + 32 * c;");
    w(
        &mut src,
        &format!(
            "      if (col < {dv}) o[((bi * {s}ll + i) * {hq}ll + h) * {dv}ll + col] = {};",
            store(out.dtype, "acc[r][c] / l[r]")
        ),
    );
    w(&mut src, "    }");
    w(&mut src, "  }");
    w(&mut src, "}");
    Ok(finish(
        "attn_fwd",
        &src,
        [
            x.s.div_ceil(rows_per_block).max(1) as u32,
            x.hq as u32,
            x.b.max(1) as u32,
        ],
        [(WARPS * 32) as u32, 1, 1],
        0,
        args,
    ))
}

/// The backward: statistics, then `dk`/`dv`, then `dq`.
pub fn backward(
    causal: bool,
    scale: f64,
    operands: &[&TensorType],
) -> Result<NodeProgram, CudaError> {
    let (q, k, v, o, g) = (
        operands[0],
        operands[1],
        operands[2],
        operands[3],
        operands[4],
    );
    let x = dims("attention_backward", q, k, v)?;
    let pos = position_params(operands, 5)?;
    let rows = x.b * x.hq * x.s;
    let stats_bytes = (rows * 4).next_multiple_of(256);
    let lse = Arg::Scratch(0);
    let delta = Arg::Scratch(stats_bytes);
    let steps = vec![
        Step::Launch(stats(causal, scale, &x, [q, k, o, g], &pos, lse, delta)),
        Step::Launch(dkdv(causal, scale, &x, [q, k, v, g], &pos, lse, delta)?),
        Step::Launch(dq(causal, scale, &x, [q, k, v, g], &pos, lse, delta)?),
    ];
    Ok(NodeProgram {
        steps,
        scratch_bytes: 2 * stats_bytes,
    })
}

/// Per query row: `lse = log sum exp(scores)` and `delta = sum g o`.
fn stats(
    causal: bool,
    scale: f64,
    x: &Dims,
    [q, k, o, g]: [&TensorType; 4],
    pos: &Option<(String, Vec<Arg>)>,
    lse: Arg,
    delta: Arg,
) -> Kernel {
    let (s, t, hq, hkv, d, dv, group) = (x.s, x.t, x.hq, x.hkv, x.d, x.dv, x.group);
    let rows = x.b * hq * s;
    let mut sig = format!(
        "const {}* __restrict__ q, const {}* __restrict__ k, const {}* __restrict__ o, const {}* __restrict__ g",
        storage(q.dtype),
        storage(k.dtype),
        storage(o.dtype),
        storage(g.dtype)
    );
    let mut args = vec![
        Arg::Operand(0),
        Arg::Operand(1),
        Arg::Operand(3),
        Arg::Operand(4),
    ];
    if let Some((text, a)) = pos {
        sig.push_str(text);
        args.extend(a);
    }
    sig.push_str(", float* __restrict__ lse, float* __restrict__ delta");
    args.extend([lse, delta]);
    let vis = visible(causal, pos.is_some());
    let scale_lit = super::float_literal(scale);
    let neg_inf = super::float_literal(f64::NEG_INFINITY);
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__(256) KERNEL({sig}) {{"
    );
    let _ = writeln!(src, "  const int lane = threadIdx.x & 31;");
    let _ = writeln!(
        src,
        "  const ap_i64 row = (ap_i64)blockIdx.x * 8 + (threadIdx.x >> 5);"
    );
    let _ = writeln!(src, "  if (row >= {rows}ll) return;");
    let _ = writeln!(
        src,
        "  const ap_i64 i = row % {s}ll, h = (row / {s}ll) % {hq}ll, bi = row / ({s}ll * {hq}ll), kh = h / {group}ll;"
    );
    let _ = writeln!(src, "  const ap_i64 qo = ((bi * {s}ll + i) * {hq}ll + h);");
    let _ = writeln!(src, "  float dsum = 0.0f;");
    let _ = writeln!(
        src,
        "  for (ap_i64 c = lane; c < {dv}ll; c += 32) dsum += {} * {};",
        load(g.dtype, &format!("g[qo * {dv}ll + c]")),
        load(o.dtype, &format!("o[qo * {dv}ll + c]"))
    );
    let _ = writeln!(src, "  AP_WARP_REDUCE(float, dsum, ap_sum)");
    let _ = writeln!(src, "  float m = {neg_inf}, l = 0.0f;");
    let _ = writeln!(src, "  for (ap_i64 j0 = 0; j0 < {t}ll; j0 += 32) {{");
    let _ = writeln!(src, "    const ap_i64 j = j0 + lane;");
    let _ = writeln!(src, "    float sc = {neg_inf};");
    let _ = writeln!(src, "    if (j < {t}ll && {vis}) {{");
    let _ = writeln!(src, "      float dot = 0.0f;");
    let _ = writeln!(
        src,
        "      for (ap_i64 c = 0; c < {d}ll; ++c) dot += {} * {};",
        load(q.dtype, &format!("q[qo * {d}ll + c]")),
        load(
            k.dtype,
            &format!("k[((bi * {t}ll + j) * {hkv}ll + kh) * {d}ll + c]")
        )
    );
    let _ = writeln!(src, "      sc = dot * {scale_lit};");
    let _ = writeln!(src, "    }}");
    let _ = writeln!(src, "    float tm = sc;");
    let _ = writeln!(src, "    AP_WARP_REDUCE(float, tm, fmaxf)");
    let _ = writeln!(src, "    const float m_new = fmaxf(m, tm);");
    let _ = writeln!(src, "    if (m_new == {neg_inf}) continue;");
    let _ = writeln!(src, "    float p = expf(sc - m_new);");
    let _ = writeln!(src, "    AP_WARP_REDUCE(float, p, ap_sum)");
    let _ = writeln!(src, "    l = l * expf(m - m_new) + p;");
    let _ = writeln!(src, "    m = m_new;");
    let _ = writeln!(src, "  }}");
    let _ = writeln!(
        src,
        "  if (lane == 0) {{ lse[row] = m + logf(l); delta[row] = dsum; }}"
    );
    let _ = writeln!(src, "}}");
    finish(
        "attn_stats",
        &src,
        [rows.div_ceil(8).max(1) as u32, 1, 1],
        [256, 1, 1],
        0,
        args,
    )
}

/// `dk` and `dv`: a block per 8 keys of one kv head, 2 keys per warp, lanes over query
/// rows of each staged query tile.
fn dkdv(
    causal: bool,
    scale: f64,
    x: &Dims,
    [q, k, v, g]: [&TensorType; 4],
    pos: &Option<(String, Vec<Arg>)>,
    lse: Arg,
    delta: Arg,
) -> Result<Kernel, CudaError> {
    let (s, t, hq, hkv, d, dv, group) = (x.s, x.t, x.hq, x.hkv, x.d, x.dv, x.group);
    let kpw = KEYS_PER_BLOCK / WARPS;
    let (dl, dvl) = (d.div_ceil(32), dv.div_ceil(32));
    let fixed = KEYS_PER_BLOCK * (d + dv) * 4;
    let qt = key_tile(fixed, (d + 1 + dv + 1 + 2) * 4)?;
    let mut sig = format!(
        "const {}* __restrict__ q, const {}* __restrict__ k, const {}* __restrict__ v, const {}* __restrict__ g",
        storage(q.dtype),
        storage(k.dtype),
        storage(v.dtype),
        storage(g.dtype)
    );
    let mut args = vec![
        Arg::Operand(0),
        Arg::Operand(1),
        Arg::Operand(2),
        Arg::Operand(4),
    ];
    if let Some((text, a)) = pos {
        sig.push_str(text);
        args.extend(a);
    }
    let _ = write!(
        sig,
        ", const float* __restrict__ lse, const float* __restrict__ delta, {}* __restrict__ dk, {}* __restrict__ dvo",
        storage(k.dtype),
        storage(v.dtype)
    );
    args.extend([lse, delta, Arg::Result(1), Arg::Result(2)]);
    let vis = visible(causal, pos.is_some());
    let scale_lit = super::float_literal(scale);
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({}) KERNEL({sig}) {{",
        WARPS * 32
    );
    let _ = writeln!(src, "  __shared__ float ks[{KEYS_PER_BLOCK}][{d}];");
    let _ = writeln!(src, "  __shared__ float vs[{KEYS_PER_BLOCK}][{dv}];");
    let _ = writeln!(src, "  __shared__ float qs[{qt}][{}];", d + 1);
    let _ = writeln!(src, "  __shared__ float gs[{qt}][{}];", dv + 1);
    let _ = writeln!(src, "  __shared__ float ls[{qt}], ds[{qt}];");
    let _ = writeln!(
        src,
        "  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;"
    );
    let _ = writeln!(
        src,
        "  const ap_i64 bi = blockIdx.z, kh = blockIdx.y, j0 = (ap_i64)blockIdx.x * {KEYS_PER_BLOCK};"
    );
    let _ = writeln!(
        src,
        "  for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        KEYS_PER_BLOCK * d
    );
    let _ = writeln!(
        src,
        "    const ap_i64 r = e / {d}, c = e % {d}, j = j0 + r;"
    );
    let _ = writeln!(
        src,
        "    ks[r][c] = j < {t}ll ? {} : 0.0f;",
        load(
            k.dtype,
            &format!("k[((bi * {t}ll + j) * {hkv}ll + kh) * {d}ll + c]")
        )
    );
    let _ = writeln!(src, "  }}");
    let _ = writeln!(
        src,
        "  for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        KEYS_PER_BLOCK * dv
    );
    let _ = writeln!(
        src,
        "    const ap_i64 r = e / {dv}, c = e % {dv}, j = j0 + r;"
    );
    let _ = writeln!(
        src,
        "    vs[r][c] = j < {t}ll ? {} : 0.0f;",
        load(
            v.dtype,
            &format!("v[((bi * {t}ll + j) * {hkv}ll + kh) * {dv}ll + c]")
        )
    );
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "  float dka[{kpw}][{dl}], dva[{kpw}][{dvl}];");
    let _ = writeln!(
        src,
        "  for (int r = 0; r < {kpw}; ++r) {{ for (int c = 0; c < {dl}; ++c) dka[r][c] = 0.0f; for (int c = 0; c < {dvl}; ++c) dva[r][c] = 0.0f; }}"
    );
    let start = if causal && pos.is_none() {
        "(j0 / QT) * QT".replace("QT", &format!("{qt}ll"))
    } else {
        "0".into()
    };
    let _ = writeln!(src, "  for (ap_i64 hg = 0; hg < {group}ll; ++hg) {{");
    let _ = writeln!(src, "    const ap_i64 h = kh * {group}ll + hg;");
    let _ = writeln!(
        src,
        "    for (ap_i64 i0 = {start}; i0 < {s}ll; i0 += {qt}) {{"
    );
    let _ = writeln!(src, "      __syncthreads();");
    let _ = writeln!(
        src,
        "      for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        qt * d
    );
    let _ = writeln!(
        src,
        "        const ap_i64 r = e / {d}, c = e % {d}, i = i0 + r;"
    );
    let _ = writeln!(
        src,
        "        qs[r][c] = i < {s}ll ? {} : 0.0f;",
        load(
            q.dtype,
            &format!("q[((bi * {s}ll + i) * {hq}ll + h) * {d}ll + c]")
        )
    );
    let _ = writeln!(src, "      }}");
    let _ = writeln!(
        src,
        "      for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        qt * dv
    );
    let _ = writeln!(
        src,
        "        const ap_i64 r = e / {dv}, c = e % {dv}, i = i0 + r;"
    );
    let _ = writeln!(
        src,
        "        gs[r][c] = i < {s}ll ? {} : 0.0f;",
        load(
            g.dtype,
            &format!("g[((bi * {s}ll + i) * {hq}ll + h) * {dv}ll + c]")
        )
    );
    let _ = writeln!(src, "      }}");
    let _ = writeln!(
        src,
        "      for (int e = threadIdx.x; e < {qt}; e += blockDim.x) {{"
    );
    let _ = writeln!(
        src,
        "        const ap_i64 i = i0 + e, row = (bi * {hq}ll + h) * {s}ll + i;"
    );
    let _ = writeln!(src, "        ls[e] = i < {s}ll ? lse[row] : 0.0f;");
    let _ = writeln!(src, "        ds[e] = i < {s}ll ? delta[row] : 0.0f;");
    let _ = writeln!(src, "      }}");
    let _ = writeln!(src, "      __syncthreads();");
    let _ = writeln!(src, "      for (int r = 0; r < {kpw}; ++r) {{");
    let _ = writeln!(src, "        const int lk = warp * {kpw} + r;");
    let _ = writeln!(src, "        const ap_i64 j = j0 + lk;");
    let _ = writeln!(src, "        const ap_i64 i = i0 + lane;");
    let _ = writeln!(src, "        float p = 0.0f, dsc = 0.0f;");
    let _ = writeln!(
        src,
        "        if (lane < {qt} && i < {s}ll && j < {t}ll && {vis}) {{"
    );
    let _ = writeln!(src, "          float dot = 0.0f, dp = 0.0f;");
    let _ = writeln!(
        src,
        "          for (int c = 0; c < {d}; ++c) dot += qs[lane][c] * ks[lk][c];"
    );
    let _ = writeln!(
        src,
        "          for (int c = 0; c < {dv}; ++c) dp += gs[lane][c] * vs[lk][c];"
    );
    let _ = writeln!(src, "          p = expf(dot * {scale_lit} - ls[lane]);");
    let _ = writeln!(src, "          dsc = p * (dp - ds[lane]) * {scale_lit};");
    let _ = writeln!(src, "        }}");
    let _ = writeln!(src, "        for (int ii = 0; ii < {qt}; ++ii) {{");
    let _ = writeln!(
        src,
        "          const float pi = __shfl_sync(0xffffffffu, p, ii);"
    );
    let _ = writeln!(
        src,
        "          const float si = __shfl_sync(0xffffffffu, dsc, ii);"
    );
    let _ = writeln!(
        src,
        "          for (int c = 0; c < {dvl}; ++c) {{ const int col = lane + 32 * c; if (col < {dv}) dva[r][c] += pi * gs[ii][col]; }}"
    );
    let _ = writeln!(
        src,
        "          for (int c = 0; c < {dl}; ++c) {{ const int col = lane + 32 * c; if (col < {d}) dka[r][c] += si * qs[ii][col]; }}"
    );
    let _ = writeln!(src, "        }}");
    let _ = writeln!(src, "      }}");
    let _ = writeln!(src, "    }}");
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "  for (int r = 0; r < {kpw}; ++r) {{");
    let _ = writeln!(src, "    const ap_i64 j = j0 + warp * {kpw} + r;");
    let _ = writeln!(src, "    if (j >= {t}ll) continue;");
    let _ = writeln!(
        src,
        "    const ap_i64 base = (bi * {t}ll + j) * {hkv}ll + kh;"
    );
    let _ = writeln!(
        src,
        "    for (int c = 0; c < {dl}; ++c) {{ const int col = lane + 32 * c; if (col < {d}) dk[base * {d}ll + col] = {}; }}",
        store(k.dtype, "dka[r][c]")
    );
    let _ = writeln!(
        src,
        "    for (int c = 0; c < {dvl}; ++c) {{ const int col = lane + 32 * c; if (col < {dv}) dvo[base * {dv}ll + col] = {}; }}",
        store(v.dtype, "dva[r][c]")
    );
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        "attn_dkdv",
        &src,
        [
            t.div_ceil(KEYS_PER_BLOCK).max(1) as u32,
            hkv as u32,
            x.b.max(1) as u32,
        ],
        [(WARPS * 32) as u32, 1, 1],
        0,
        args,
    ))
}

/// `dq`: as the forward, lanes over the keys of each staged tile.
fn dq(
    causal: bool,
    scale: f64,
    x: &Dims,
    [q, k, v, g]: [&TensorType; 4],
    pos: &Option<(String, Vec<Arg>)>,
    lse: Arg,
    delta: Arg,
) -> Result<Kernel, CudaError> {
    let (s, t, hq, hkv, d, dv, group) = (x.s, x.t, x.hq, x.hkv, x.d, x.dv, x.group);
    let rows_per_block = ROWS_PER_WARP * WARPS;
    let dl = d.div_ceil(32);
    let bk = key_tile(rows_per_block * (d + dv) * 4, (d + 1 + dv + 1) * 4)?;
    let mut sig = format!(
        "const {}* __restrict__ q, const {}* __restrict__ k, const {}* __restrict__ v, const {}* __restrict__ g",
        storage(q.dtype),
        storage(k.dtype),
        storage(v.dtype),
        storage(g.dtype)
    );
    let mut args = vec![
        Arg::Operand(0),
        Arg::Operand(1),
        Arg::Operand(2),
        Arg::Operand(4),
    ];
    if let Some((text, a)) = pos {
        sig.push_str(text);
        args.extend(a);
    }
    let _ = write!(
        sig,
        ", const float* __restrict__ lse, const float* __restrict__ delta, {}* __restrict__ dq",
        storage(q.dtype)
    );
    args.extend([lse, delta, Arg::Result(0)]);
    let vis = visible(causal, pos.is_some());
    let scale_lit = super::float_literal(scale);
    let tile_end = if causal && pos.is_none() {
        format!("min({t}ll, i0 + {rows_per_block}ll)")
    } else {
        format!("{t}ll")
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({}) KERNEL({sig}) {{",
        WARPS * 32
    );
    let _ = writeln!(src, "  __shared__ float qs[{rows_per_block}][{d}];");
    let _ = writeln!(src, "  __shared__ float gs[{rows_per_block}][{dv}];");
    let _ = writeln!(src, "  __shared__ float ks[{bk}][{}];", d + 1);
    let _ = writeln!(src, "  __shared__ float vs[{bk}][{}];", dv + 1);
    let _ = writeln!(
        src,
        "  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;"
    );
    let _ = writeln!(
        src,
        "  const ap_i64 bi = blockIdx.z, h = blockIdx.y, kh = h / {group}ll;"
    );
    let _ = writeln!(
        src,
        "  const ap_i64 i0 = (ap_i64)blockIdx.x * {rows_per_block};"
    );
    let _ = writeln!(
        src,
        "  for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        rows_per_block * d
    );
    let _ = writeln!(
        src,
        "    const ap_i64 r = e / {d}, c = e % {d}, i = i0 + r;"
    );
    let _ = writeln!(
        src,
        "    qs[r][c] = i < {s}ll ? {} : 0.0f;",
        load(
            q.dtype,
            &format!("q[((bi * {s}ll + i) * {hq}ll + h) * {d}ll + c]")
        )
    );
    let _ = writeln!(src, "  }}");
    let _ = writeln!(
        src,
        "  for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        rows_per_block * dv
    );
    let _ = writeln!(
        src,
        "    const ap_i64 r = e / {dv}, c = e % {dv}, i = i0 + r;"
    );
    let _ = writeln!(
        src,
        "    gs[r][c] = i < {s}ll ? {} : 0.0f;",
        load(
            g.dtype,
            &format!("g[((bi * {s}ll + i) * {hq}ll + h) * {dv}ll + c]")
        )
    );
    let _ = writeln!(src, "  }}");
    let _ = writeln!(
        src,
        "  float acc[{ROWS_PER_WARP}][{dl}], lr_lse[{ROWS_PER_WARP}], lr_delta[{ROWS_PER_WARP}];"
    );
    let _ = writeln!(src, "  for (int r = 0; r < {ROWS_PER_WARP}; ++r) {{");
    let _ = writeln!(
        src,
        "    const ap_i64 i = i0 + warp * {ROWS_PER_WARP} + r, row = (bi * {hq}ll + h) * {s}ll + i;"
    );
    let _ = writeln!(src, "    lr_lse[r] = i < {s}ll ? lse[row] : 0.0f;");
    let _ = writeln!(src, "    lr_delta[r] = i < {s}ll ? delta[row] : 0.0f;");
    let _ = writeln!(src, "    for (int c = 0; c < {dl}; ++c) acc[r][c] = 0.0f;");
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "  for (ap_i64 j0 = 0; j0 < {tile_end}; j0 += {bk}) {{");
    let _ = writeln!(src, "    __syncthreads();");
    let _ = writeln!(
        src,
        "    for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        bk * d
    );
    let _ = writeln!(
        src,
        "      const ap_i64 r = e / {d}, c = e % {d}, j = j0 + r;"
    );
    let _ = writeln!(
        src,
        "      ks[r][c] = j < {t}ll ? {} : 0.0f;",
        load(
            k.dtype,
            &format!("k[((bi * {t}ll + j) * {hkv}ll + kh) * {d}ll + c]")
        )
    );
    let _ = writeln!(src, "    }}");
    let _ = writeln!(
        src,
        "    for (int e = threadIdx.x; e < {}; e += blockDim.x) {{",
        bk * dv
    );
    let _ = writeln!(
        src,
        "      const ap_i64 r = e / {dv}, c = e % {dv}, j = j0 + r;"
    );
    let _ = writeln!(
        src,
        "      vs[r][c] = j < {t}ll ? {} : 0.0f;",
        load(
            v.dtype,
            &format!("v[((bi * {t}ll + j) * {hkv}ll + kh) * {dv}ll + c]")
        )
    );
    let _ = writeln!(src, "    }}");
    let _ = writeln!(src, "    __syncthreads();");
    let _ = writeln!(src, "    for (int r = 0; r < {ROWS_PER_WARP}; ++r) {{");
    let _ = writeln!(src, "      const int lr = warp * {ROWS_PER_WARP} + r;");
    let _ = writeln!(src, "      const ap_i64 i = i0 + lr, j = j0 + lane;");
    let _ = writeln!(src, "      float dsc = 0.0f;");
    let _ = writeln!(
        src,
        "      if (lane < {bk} && i < {s}ll && j < {t}ll && {vis}) {{"
    );
    let _ = writeln!(src, "        float dot = 0.0f, dp = 0.0f;");
    let _ = writeln!(
        src,
        "        for (int c = 0; c < {d}; ++c) dot += qs[lr][c] * ks[lane][c];"
    );
    let _ = writeln!(
        src,
        "        for (int c = 0; c < {dv}; ++c) dp += gs[lr][c] * vs[lane][c];"
    );
    let _ = writeln!(
        src,
        "        const float p = expf(dot * {scale_lit} - lr_lse[r]);"
    );
    let _ = writeln!(src, "        dsc = p * (dp - lr_delta[r]) * {scale_lit};");
    let _ = writeln!(src, "      }}");
    let _ = writeln!(src, "      for (int jj = 0; jj < {bk}; ++jj) {{");
    let _ = writeln!(
        src,
        "        const float sj = __shfl_sync(0xffffffffu, dsc, jj);"
    );
    let _ = writeln!(
        src,
        "        for (int c = 0; c < {dl}; ++c) {{ const int col = lane + 32 * c; if (col < {d}) acc[r][c] += sj * ks[jj][col]; }}"
    );
    let _ = writeln!(src, "      }}");
    let _ = writeln!(src, "    }}");
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "  for (int r = 0; r < {ROWS_PER_WARP}; ++r) {{");
    let _ = writeln!(src, "    const ap_i64 i = i0 + warp * {ROWS_PER_WARP} + r;");
    let _ = writeln!(src, "    if (i >= {s}ll) continue;");
    let _ = writeln!(
        src,
        "    for (int c = 0; c < {dl}; ++c) {{ const int col = lane + 32 * c; if (col < {d}) dq[((bi * {s}ll + i) * {hq}ll + h) * {d}ll + col] = {}; }}",
        store(q.dtype, "acc[r][c]")
    );
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        "attn_dq",
        &src,
        [
            s.div_ceil(rows_per_block).max(1) as u32,
            hq as u32,
            x.b.max(1) as u32,
        ],
        [(WARPS * 32) as u32, 1, 1],
        0,
        args,
    ))
}
