//! Kernels that move elements: permutes (transpose, and the operand layouts of GEMMs), slice,
//! concat, the embedding gather and its scatter-add gradient, and einsum as a cuBLASLt GEMM
//! between permutes.
//!
//! Copies move storage as it is (no conversion) and use one thread per result element with
//! the source offset computed from the result's coordinates; they are not shared-memory
//! tiled, which costs bandwidth on transposes of the innermost dim.

use std::fmt::Write as _;

use autopar_ir::{DType, EinsumSpec, TensorType};

use super::{
    Arg, BLOCK, Gemm, Kernel, NodeProgram, Step, blocks_for, finish, load, storage, store, strides,
    types_text,
};
use crate::error::CudaError;

/// Offsets in scratch are rounded up to this.
const SCRATCH_ALIGN: u64 = 256;

/// C statements that decompose `i` over `dims` into `c0, c1, ...`.
fn coords(src: &mut String, dims: &[usize], indent: &str) {
    let st = strides(dims);
    for (d, &size) in dims.iter().enumerate() {
        let _ = writeln!(
            src,
            "{indent}const ap_i64 c{d} = (i / {}ll) % {}ll;",
            st[d],
            size.max(1)
        );
    }
}

/// A grid-stride kernel over `n` result elements whose loop body is `inner` (which reads `i`
/// and `c0..` and writes the result).
fn elementwise_kernel(
    what: &str,
    sig: &str,
    n: u64,
    prologue: &str,
    inner: &str,
    args: Vec<Arg>,
) -> Kernel {
    let mut src = String::new();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({BLOCK}) KERNEL({sig}) {{"
    );
    src.push_str(prologue);
    let _ = writeln!(
        src,
        "  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;"
    );
    let _ = writeln!(
        src,
        "  for (ap_i64 i = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < {n}ll; i += stride) {{"
    );
    src.push_str(inner);
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    finish(
        what,
        &src,
        [blocks_for(n, u64::from(BLOCK)), 1, 1],
        [BLOCK, 1, 1],
        0,
        args,
    )
}

/// `dst = x` with its dims permuted (result dim `i` is operand dim `perm[i]`).
pub fn permute(x: &TensorType, perm: &[usize], src: Arg, dst: Arg) -> Result<Kernel, CudaError> {
    if perm.len() != x.rank() {
        return Err(CudaError::Unsupported {
            op: "transpose",
            operands: x.to_string(),
            detail: format!("permutation {perm:?} of the wrong rank"),
        });
    }
    let out_dims: Vec<usize> = perm.iter().map(|&p| x.dims()[p]).collect();
    let st = strides(x.dims());
    let t = storage(x.dtype);
    let mut inner = String::new();
    coords(&mut inner, &out_dims, "    ");
    let offset: Vec<String> = perm
        .iter()
        .enumerate()
        .map(|(i, &p)| format!("c{i} * {}ll", st[p]))
        .collect();
    let offset = if offset.is_empty() {
        "0".into()
    } else {
        offset.join(" + ")
    };
    let _ = writeln!(inner, "    r0[i] = p0[{offset}];");
    Ok(elementwise_kernel(
        "permute",
        &format!("const {t}* __restrict__ p0, {t}* __restrict__ r0"),
        x.num_elements(),
        "",
        &inner,
        vec![src, dst],
    ))
}

/// The range `start..end` of `dim`.
pub fn slice(
    dim: usize,
    start: usize,
    _end: usize,
    x: &TensorType,
    out: &TensorType,
) -> Result<Kernel, CudaError> {
    let st = strides(x.dims());
    let t = storage(x.dtype);
    let mut inner = String::new();
    coords(&mut inner, out.dims(), "    ");
    let mut terms: Vec<String> = (0..out.rank())
        .map(|d| format!("c{d} * {}ll", st[d]))
        .collect();
    terms.push(format!("{}ll", start as u64 * st[dim]));
    let _ = writeln!(inner, "    r0[i] = p0[{}];", terms.join(" + "));
    Ok(elementwise_kernel(
        "slice",
        &format!("const {t}* __restrict__ p0, {t}* __restrict__ r0"),
        out.num_elements(),
        "",
        &inner,
        vec![Arg::Operand(0), Arg::Result(0)],
    ))
}

/// Concatenation along `dim`.
pub fn concat(dim: usize, xs: &[&TensorType], out: &TensorType) -> Result<Kernel, CudaError> {
    let t = storage(out.dtype);
    let mut sig: Vec<String> = (0..xs.len())
        .map(|k| format!("const {t}* __restrict__ p{k}"))
        .collect();
    sig.push(format!("{t}* __restrict__ r0"));
    let mut args: Vec<Arg> = (0..xs.len()).map(Arg::Operand).collect();
    args.push(Arg::Result(0));
    let mut inner = String::new();
    coords(&mut inner, out.dims(), "    ");
    let mut begin = 0usize;
    for (k, x) in xs.iter().enumerate() {
        let st = strides(x.dims());
        let size = x.dims()[dim];
        let terms: Vec<String> = (0..out.rank())
            .map(|d| {
                if d == dim {
                    format!("(c{d} - {begin}ll) * {}ll", st[d])
                } else {
                    format!("c{d} * {}ll", st[d])
                }
            })
            .collect();
        let cond = if k + 1 == xs.len() {
            String::new()
        } else {
            format!("if (c{dim} < {}ll) ", begin + size)
        };
        let keyword = if k == 0 { "" } else { "else " };
        let _ = writeln!(
            inner,
            "    {keyword}{cond}{{ r0[i] = p{k}[{}]; }}",
            terms.join(" + ")
        );
        begin += size;
    }
    Ok(elementwise_kernel(
        "concat",
        &sig.join(", "),
        out.num_elements(),
        "",
        &inner,
        args,
    ))
}

/// The C type of an integer id operand, or an error.
fn id_type(op: &'static str, ids: &TensorType) -> Result<&'static str, CudaError> {
    match ids.dtype {
        DType::I32 | DType::I64 => Ok(storage(ids.dtype)),
        dtype => Err(CudaError::UnsupportedDType { op, dtype }),
    }
}

/// Rows `ids[...]` of `table[v, rest...]`; an id outside `0..v` gives a zero row.
pub fn gather(operands: &[&TensorType], out: &TensorType) -> Result<Kernel, CudaError> {
    let (table, ids) = (operands[0], operands[1]);
    let it = id_type("gather", ids)?;
    let rows = table.dims().first().copied().unwrap_or(0) as u64;
    let row_len: u64 = table.dims().iter().skip(1).map(|&d| d as u64).product();
    let t = storage(table.dtype);
    let mut inner = String::new();
    let _ = writeln!(
        inner,
        "    const ap_i64 id = (ap_i64)p1[i / {}ll];",
        row_len.max(1)
    );
    let _ = writeln!(
        inner,
        "    r0[i] = (id >= 0 && id < {rows}ll) ? p0[id * {row_len}ll + i % {}ll] : ({t})0;",
        row_len.max(1)
    );
    Ok(elementwise_kernel(
        "gather",
        &format!("const {t}* __restrict__ p0, const {it}* __restrict__ p1, {t}* __restrict__ r0"),
        out.num_elements(),
        "",
        &inner,
        vec![Arg::Operand(0), Arg::Operand(1), Arg::Result(0)],
    ))
}

/// Row `r` of the result is the sum of the update rows whose id is `r`: zero the result,
/// add every update with atomics (into f32 scratch for f16 and bf16, then converted).
pub fn scatter_add(operands: &[&TensorType], out: &TensorType) -> Result<NodeProgram, CudaError> {
    let (ids, updates) = (operands[0], operands[1]);
    let it = id_type("scatter_add", ids)?;
    let rows = out.dims().first().copied().unwrap_or(0) as u64;
    let row_len: u64 = out.dims().iter().skip(1).map(|&d| d as u64).product();
    let n_out = out.num_elements();
    let (acc_type, via_scratch) = match out.dtype {
        DType::F32 => ("float", false),
        DType::F16 | DType::BF16 => ("float", true),
        DType::I32 => ("int", false),
        DType::I64 => ("unsigned long long", false),
        DType::Bool => {
            return Err(CudaError::UnsupportedDType {
                op: "scatter_add",
                dtype: DType::Bool,
            });
        }
    };
    let acc_arg = if via_scratch {
        Arg::Scratch(0)
    } else {
        Arg::Result(0)
    };
    let ut = storage(updates.dtype);
    let mut inner = String::new();
    let _ = writeln!(
        inner,
        "    const ap_i64 id = (ap_i64)p0[i / {}ll];",
        row_len.max(1)
    );
    let value = match updates.dtype {
        DType::I64 => "(unsigned long long)p1[i]".to_string(),
        d => load(d, "p1[i]"),
    };
    let _ = writeln!(
        inner,
        "    if (id >= 0 && id < {rows}ll) atomicAdd(&r0[id * {row_len}ll + i % {}ll], {value});",
        row_len.max(1)
    );
    let add = elementwise_kernel(
        "scatter",
        &format!(
            "const {it}* __restrict__ p0, const {ut}* __restrict__ p1, {acc_type}* __restrict__ r0"
        ),
        updates.num_elements(),
        "",
        &inner,
        vec![Arg::Operand(0), Arg::Operand(1), acc_arg],
    );
    let acc_bytes = n_out
        * if via_scratch {
            4
        } else {
            out.dtype.size_bytes() as u64
        };
    let mut steps = vec![
        Step::Zero {
            at: acc_arg,
            bytes: acc_bytes,
        },
        Step::Launch(add),
    ];
    if via_scratch {
        let t = storage(out.dtype);
        let inner = format!("    r0[i] = {};\n", store(out.dtype, "p0[i]"));
        steps.push(Step::Launch(elementwise_kernel(
            "narrow",
            &format!("const float* __restrict__ p0, {t}* __restrict__ r0"),
            n_out,
            "",
            &inner,
            vec![Arg::Scratch(0), Arg::Result(0)],
        )));
    }
    Ok(NodeProgram {
        steps,
        scratch_bytes: if via_scratch { acc_bytes } else { 0 },
    })
}

/// The labels of `labels` with their sizes, from the operand `dims`.
fn size_of(label: char, spec: &EinsumSpec, lhs: &TensorType, rhs: &TensorType) -> usize {
    if let Some(i) = spec.lhs.iter().position(|&c| c == label) {
        return lhs.dims()[i];
    }
    spec.rhs
        .iter()
        .position(|&c| c == label)
        .map(|i| rhs.dims()[i])
        .unwrap_or(1)
}

/// An einsum as `[batch, m, k] x [batch, k, n]`: each operand permuted into that order when
/// it is not already, one batched GEMM, and the result permuted into the spec's order when
/// that differs from `[batch, m, n]`.
pub fn einsum(
    spec: &EinsumSpec,
    operands: &[&TensorType],
    out: &TensorType,
) -> Result<NodeProgram, CudaError> {
    let (lhs, rhs) = (operands[0], operands[1]);
    if !lhs.dtype.is_float() || lhs.dtype != rhs.dtype {
        return Err(CudaError::Unsupported {
            op: "einsum",
            operands: types_text(operands),
            detail: "cuBLASLt GEMMs take float operands of one dtype".into(),
        });
    }
    let batch = spec.batch();
    let contracting = spec.contracting();
    let m_labels: Vec<char> = spec
        .out
        .iter()
        .copied()
        .filter(|c| spec.lhs.contains(c) && !spec.rhs.contains(c))
        .collect();
    let n_labels: Vec<char> = spec
        .out
        .iter()
        .copied()
        .filter(|c| spec.rhs.contains(c) && !spec.lhs.contains(c))
        .collect();
    let canon_lhs: Vec<char> = batch
        .iter()
        .chain(&m_labels)
        .chain(&contracting)
        .copied()
        .collect();
    let canon_rhs: Vec<char> = batch
        .iter()
        .chain(&contracting)
        .chain(&n_labels)
        .copied()
        .collect();
    let canon_out: Vec<char> = batch
        .iter()
        .chain(&m_labels)
        .chain(&n_labels)
        .copied()
        .collect();
    if canon_lhs.len() != spec.lhs.len()
        || canon_rhs.len() != spec.rhs.len()
        || canon_out.len() != spec.out.len()
    {
        return Err(CudaError::Unsupported {
            op: "einsum",
            operands: types_text(operands),
            detail: format!("spec `{spec}` is not a batched matrix product"),
        });
    }
    let product = |labels: &[char]| -> u64 {
        labels
            .iter()
            .map(|&c| size_of(c, spec, lhs, rhs) as u64)
            .product()
    };
    let elem = lhs.dtype.size_bytes() as u64;
    let position = |labels: &[char], c: char| labels.iter().position(|&x| x == c).unwrap_or(0);
    let mut steps = Vec::new();
    let mut scratch = 0u64;
    let mut place = |bytes: u64| {
        let at = scratch;
        scratch = (scratch + bytes).next_multiple_of(SCRATCH_ALIGN);
        at
    };
    let mut operand = |k: usize,
                       t: &TensorType,
                       labels: &[char],
                       canon: &[char],
                       steps: &mut Vec<Step>|
     -> Result<Arg, CudaError> {
        if labels == canon {
            return Ok(Arg::Operand(k));
        }
        let perm: Vec<usize> = canon.iter().map(|&c| position(labels, c)).collect();
        let at = Arg::Scratch(place(t.num_elements() * elem));
        steps.push(Step::Launch(permute(t, &perm, Arg::Operand(k), at)?));
        Ok(at)
    };
    let a = operand(0, lhs, &spec.lhs, &canon_lhs, &mut steps)?;
    let b = operand(1, rhs, &spec.rhs, &canon_rhs, &mut steps)?;
    let direct = spec.out == canon_out;
    let c = if direct {
        Arg::Result(0)
    } else {
        Arg::Scratch(place(out.num_elements() * elem))
    };
    let k = product(&contracting);
    if k == 0 {
        steps.push(Step::Zero {
            at: c,
            bytes: out.num_elements() * elem,
        });
    } else {
        steps.push(Step::Gemm(Gemm {
            batch: product(&batch),
            m: product(&m_labels),
            n: product(&n_labels),
            k,
            dtype: lhs.dtype,
            lhs: a,
            rhs: b,
            out: c,
        }));
    }
    if !direct {
        let canon_dims: Vec<usize> = canon_out
            .iter()
            .map(|&ch| size_of(ch, spec, lhs, rhs))
            .collect();
        let canon_ty = TensorType::new(out.dtype, canon_dims);
        let perm: Vec<usize> = spec
            .out
            .iter()
            .map(|&ch| position(&canon_out, ch))
            .collect();
        steps.push(Step::Launch(permute(&canon_ty, &perm, c, Arg::Result(0))?));
    }
    Ok(NodeProgram {
        steps,
        scratch_bytes: scratch,
    })
}
