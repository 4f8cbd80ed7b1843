//! Kernels for fusion bodies (and for the single ops and decompositions written as bodies).
//!
//! Every body value is emitted on demand at a coordinate tuple of its own shape, once per
//! tuple (a memo keyed by value and coordinates), so a value read by several instructions at
//! the same index is computed once; a broadcast maps coordinates (index arithmetic, nothing
//! materialised), a reshape goes through the flat index, a reduction loops over its reduced
//! dims. Three kernel shapes follow from the body:
//!
//! * **vector**: no reduction and no broadcast, every operand and result of one element
//!   count: values are indexed by the flat index, and each thread loads and stores 128 bits
//!   of every operand at a time (a scalar loop takes the remainder);
//! * **row**: every reduction reduces trailing dims to one common shape `R`, and every result
//!   has shape `R` or `R ++ T`: each row of `R` is one warp (rows of up to 1024 elements) or
//!   one block, which first computes the row's reductions cooperatively (strided loop, warp
//!   shuffles, shared memory across warps), then its results;
//! * **loop**: anything else, one thread per element of the first result, reductions as
//!   serial loops.

use std::collections::HashMap;
use std::fmt::Write as _;

use autopar_ir::{BinaryOp, CompareOp, DType, FusionBody, Op, ReduceOp, TensorType, UnaryOp};

use super::{
    Arg, BLOCK, NodeProgram, blocks_for, body_types, finish, literal, load, register, round,
    storage, store, strides, unsupported,
};
use crate::error::CudaError;

/// Rows up to this length run one per warp; longer ones one per block.
pub const WARP_ROW_MAX: u64 = 1024;

/// Warps per block in the warp-per-row kernels.
pub const WARPS_PER_BLOCK: u32 = 8;

/// Threads per block in the block-per-row kernels.
pub const ROW_BLOCK: u32 = 512;

/// The kernel of `body`.
pub fn program(body: &FusionBody) -> Result<NodeProgram, CudaError> {
    let types = body_types(body)?;
    let first = body
        .results
        .first()
        .and_then(|&r| types.get(r))
        .ok_or_else(|| CudaError::Unsupported {
            op: "fusion",
            operands: String::new(),
            detail: "a fusion body with no results".into(),
        })?;
    let n = first.num_elements();
    let has_reduce = body
        .instrs
        .iter()
        .any(|i| matches!(i.op, Op::Reduce { .. }));
    let has_broadcast = body
        .instrs
        .iter()
        .any(|i| matches!(i.op, Op::Broadcast { .. }));
    let same_count = body
        .params
        .iter()
        .chain(body.results.iter().map(|&r| &types[r]))
        .all(|t| t.num_elements() == n);
    for &r in &body.results {
        if !has_reduce && types[r].num_elements() != n {
            return Err(CudaError::Unsupported {
                op: "fusion",
                operands: types[r].to_string(),
                detail: format!(
                    "results of different sizes ({n} and {})",
                    types[r].num_elements()
                ),
            });
        }
    }
    check_reductions(body, &types)?;
    let kernel = if !has_reduce && !has_broadcast && same_count {
        vector_kernel(body, &types, n)?
    } else if let Some(rows) = row_shape(body, &types) {
        row_kernel(body, &types, &rows)?
    } else {
        loop_kernel(body, &types, first)?
    };
    Ok(NodeProgram {
        steps: vec![super::Step::Launch(kernel)],
        scratch_bytes: 0,
    })
}

/// Max and min over an empty dim have no value (the reference refuses them too).
fn check_reductions(body: &FusionBody, types: &[TensorType]) -> Result<(), CudaError> {
    for (i, instr) in body.instrs.iter().enumerate() {
        if let Op::Reduce { func, dims } = &instr.op {
            let x = &types[instr.operands[0]];
            let count: u64 = dims.iter().map(|&d| x.dims()[d] as u64).product();
            let out = &types[body.params.len() + i];
            if count == 0 && out.num_elements() > 0 && matches!(func, ReduceOp::Max | ReduceOp::Min)
            {
                return Err(CudaError::Runtime(
                    autopar_runtime::RuntimeError::EmptyReduction {
                        op: instr.op.name(),
                    },
                ));
            }
            if x.dtype == DType::Bool || (x.dtype.is_int() && *func == ReduceOp::Mean) {
                return Err(CudaError::UnsupportedDType {
                    op: instr.op.name(),
                    dtype: x.dtype,
                });
            }
        }
    }
    Ok(())
}

/// The kernel signature: operands `p0..`, results `r0..`.
fn signature(body: &FusionBody, types: &[TensorType]) -> (String, Vec<Arg>) {
    let mut params = Vec::new();
    let mut args = Vec::new();
    for (k, t) in body.params.iter().enumerate() {
        params.push(format!("const {}* __restrict__ p{k}", storage(t.dtype)));
        args.push(Arg::Operand(k));
    }
    for (k, &r) in body.results.iter().enumerate() {
        params.push(format!("{}* __restrict__ r{k}", storage(types[r].dtype)));
        args.push(Arg::Result(k));
    }
    (params.join(", "), args)
}

/// How a kernel reads its operands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    /// `p{k}[flat]`.
    Flat,
    /// `p{k}[sum coords * strides]`.
    Coords,
    /// `pv{k}.v[e]` (the vector kernel's registers).
    Vector,
}

/// Emits body values as C locals.
struct Emitter<'a> {
    body: &'a FusionBody,
    types: &'a [TensorType],
    code: String,
    indent: usize,
    scopes: Vec<HashMap<(usize, Vec<String>), String>>,
    next: usize,
    access: Access,
    /// Threads sharing a row's reductions: `None` for serial loops.
    lane: Option<(&'static str, &'static str, bool)>,
}

impl<'a> Emitter<'a> {
    fn new(body: &'a FusionBody, types: &'a [TensorType], access: Access, indent: usize) -> Self {
        Emitter {
            body,
            types,
            code: String::new(),
            indent,
            scopes: vec![HashMap::new()],
            next: 0,
            access,
            lane: None,
        }
    }

    fn line(&mut self, text: &str) {
        for _ in 0..self.indent {
            self.code.push_str("  ");
        }
        self.code.push_str(text);
        self.code.push('\n');
    }

    fn fresh(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}{}", self.next)
    }

    fn lookup(&self, key: &(usize, Vec<String>)) -> Option<String> {
        self.scopes.iter().rev().find_map(|s| s.get(key).cloned())
    }

    fn remember(&mut self, key: (usize, Vec<String>), name: String) {
        if let Some(s) = self.scopes.last_mut() {
            s.insert(key, name);
        }
    }

    /// Coordinates of flat index expression `flat` in `dims`, as locals.
    fn decompose(&mut self, flat: &str, dims: &[usize]) -> Vec<String> {
        let st = strides(dims);
        let mut coords = Vec::with_capacity(dims.len());
        for (d, &size) in dims.iter().enumerate() {
            if size == 1 {
                coords.push("0".to_string());
                continue;
            }
            let expr = match (d, st[d]) {
                (0, 1) => flat.to_string(),
                (0, s) => format!("({flat} / {s}ll)"),
                (_, 1) => format!("({flat} % {size}ll)"),
                (_, s) => format!("(({flat} / {s}ll) % {size}ll)"),
            };
            let c = self.fresh("c");
            self.line(&format!("[[maybe_unused]] const ap_i64 {c} = {expr};"));
            coords.push(c);
        }
        coords
    }

    /// The flat index of `coords` in `dims`.
    fn flatten(coords: &[String], dims: &[usize]) -> String {
        let st = strides(dims);
        let terms: Vec<String> = coords
            .iter()
            .zip(&st)
            .filter(|(c, _)| c.as_str() != "0")
            .map(|(c, &s)| {
                if s == 1 {
                    c.clone()
                } else {
                    format!("{c} * {s}ll")
                }
            })
            .collect();
        if terms.is_empty() {
            "0".to_string()
        } else {
            terms.join(" + ")
        }
    }

    /// The C expression (a local or a literal) of body value `v` at `coords`.
    fn value(&mut self, v: usize, coords: &[String]) -> Result<String, CudaError> {
        let key = (v, coords.to_vec());
        if let Some(name) = self.lookup(&key) {
            return Ok(name);
        }
        let ty = self.types[v].clone();
        let name = if v < self.body.params.len() {
            let access = match self.access {
                Access::Vector => format!("pv{v}.v[e]"),
                Access::Flat => format!("p{v}[{}]", coords[0]),
                Access::Coords => format!("p{v}[{}]", Self::flatten(coords, ty.dims())),
            };
            let name = self.fresh("v");
            let text = format!(
                "const {} {name} = {};",
                register(ty.dtype),
                load(ty.dtype, &access)
            );
            self.line(&text);
            name
        } else {
            let instr = &self.body.instrs[v - self.body.params.len()];
            self.instruction(&instr.op, &instr.operands, &ty, coords)?
        };
        self.remember(key, name.clone());
        Ok(name)
    }

    fn instruction(
        &mut self,
        op: &Op,
        operands: &[usize],
        ty: &TensorType,
        coords: &[String],
    ) -> Result<String, CudaError> {
        let dtype = ty.dtype;
        let in_types: Vec<TensorType> = operands.iter().map(|&o| self.types[o].clone()).collect();
        let refs: Vec<&TensorType> = in_types.iter().collect();
        let expr = match op {
            Op::Constant { value, .. } => return Ok(literal(dtype, *value)),
            Op::Unary { func } => {
                let x = self.value(operands[0], coords)?;
                unary(*func, dtype, &x)
                    .ok_or_else(|| unsupported(op, &refs, "not defined on this dtype"))?
            }
            Op::Binary { func } => {
                let a = self.value(operands[0], coords)?;
                let b = self.value(operands[1], coords)?;
                binary(*func, dtype, &a, &b)
                    .ok_or_else(|| unsupported(op, &refs, "not defined on this dtype"))?
            }
            Op::Compare { func } => {
                let a = self.value(operands[0], coords)?;
                let b = self.value(operands[1], coords)?;
                format!("({a} {} {b})", compare(*func))
            }
            Op::Select => {
                let c = self.value(operands[0], coords)?;
                let a = self.value(operands[1], coords)?;
                let b = self.value(operands[2], coords)?;
                format!("({c} ? {a} : {b})")
            }
            Op::Cast { to } => {
                let x = self.value(operands[0], coords)?;
                cast(in_types[0].dtype, *to, &x)
            }
            Op::Reshape { .. } => {
                if self.access != Access::Coords {
                    return self.value(operands[0], coords);
                }
                let flat = self.fresh("f");
                let text = format!(
                    "const ap_i64 {flat} = {};",
                    Self::flatten(coords, ty.dims())
                );
                self.line(&text);
                let inner = self.decompose(&flat, in_types[0].dims());
                return self.value(operands[0], &inner);
            }
            Op::Broadcast { dims, .. } => {
                let inner: Vec<String> = dims
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| {
                        if in_types[0].dims()[i] == 1 {
                            "0".to_string()
                        } else {
                            coords[d].clone()
                        }
                    })
                    .collect();
                return self.value(operands[0], &inner);
            }
            Op::Reduce { func, dims } => {
                return self.reduce(*func, dims, operands[0], ty, coords, false);
            }
            other => return Err(unsupported(other, &refs, "not admitted in a fusion body")),
        };
        let name = self.fresh("v");
        let rounded = if dtype.is_float() {
            round(dtype, &expr)
        } else {
            expr
        };
        let text = format!("const {} {name} = {rounded};", register(dtype));
        self.line(&text);
        Ok(name)
    }

    /// A reduction at `coords` of its result: a serial loop, or (with `shared`) the lanes'
    /// strided loop followed by a warp or block reduction.
    fn reduce(
        &mut self,
        func: ReduceOp,
        dims: &[usize],
        operand: usize,
        ty: &TensorType,
        coords: &[String],
        shared: bool,
    ) -> Result<String, CudaError> {
        let x = self.types[operand].clone();
        let reduced: Vec<usize> = dims.iter().map(|&d| x.dims()[d]).collect();
        let count: u64 = reduced.iter().map(|&d| d as u64).product();
        let reg = register(x.dtype);
        let (init, combine) = reduce_ops(func, x.dtype);
        let acc = self.fresh("acc");
        self.line(&format!("{reg} {acc} = {init};"));
        let j = self.fresh("j");
        let lane = if shared { self.lane } else { None };
        match lane {
            Some((lane, step, _)) => self.line(&format!(
                "for (ap_i64 {j} = {lane}; {j} < {count}ll; {j} += {step}) {{"
            )),
            None => self.line(&format!("for (ap_i64 {j} = 0; {j} < {count}ll; ++{j}) {{")),
        }
        self.indent += 1;
        self.scopes.push(HashMap::new());
        let inner_reduced = self.decompose(&j, &reduced);
        let mut kept = coords.iter();
        let mut red = inner_reduced.iter();
        let inner: Vec<String> = (0..x.rank())
            .map(|d| {
                if dims.contains(&d) {
                    red.next().cloned().unwrap_or_else(|| "0".into())
                } else {
                    kept.next().cloned().unwrap_or_else(|| "0".into())
                }
            })
            .collect();
        let xv = self.value(operand, &inner)?;
        self.line(&format!("{acc} = {combine}({acc}, {xv});"));
        self.scopes.pop();
        self.indent -= 1;
        self.line("}");
        if let Some((_, _, block)) = lane {
            self.line(&format!("AP_WARP_REDUCE({reg}, {acc}, {combine})"));
            if block {
                let s = self.fresh("sh");
                self.line(&format!("__shared__ {reg} {s}[32];"));
                self.line(&format!(
                    "if ((threadIdx.x & 31) == 0) {s}[threadIdx.x >> 5] = {acc};"
                ));
                self.line("__syncthreads();");
                self.line("if (threadIdx.x < 32) {");
                self.line(&format!(
                    "  {acc} = threadIdx.x < (blockDim.x >> 5) ? {s}[threadIdx.x] : {init};"
                ));
                self.line(&format!("  AP_WARP_REDUCE({reg}, {acc}, {combine})"));
                self.line(&format!("  if (threadIdx.x == 0) {s}[0] = {acc};"));
                self.line("}");
                self.line("__syncthreads();");
                self.line(&format!("{acc} = {s}[0];"));
            }
        }
        let name = self.fresh("v");
        let value = if func == ReduceOp::Mean {
            format!("{acc} / {}", super::float_literal(count as f64))
        } else {
            acc
        };
        let rounded = if ty.dtype.is_float() {
            round(ty.dtype, &value)
        } else {
            value
        };
        self.line(&format!("const {} {name} = {rounded};", register(ty.dtype)));
        Ok(name)
    }
}

/// Initial value and combining function of a reduction over `dtype`.
fn reduce_ops(func: ReduceOp, dtype: DType) -> (String, &'static str) {
    match (func, dtype) {
        (ReduceOp::Sum | ReduceOp::Mean, DType::I32) => ("0".into(), "ap_sum32"),
        (ReduceOp::Sum | ReduceOp::Mean, DType::I64) => ("0ll".into(), "ap_sum64"),
        (ReduceOp::Sum | ReduceOp::Mean, _) => ("0.0f".into(), "ap_sum"),
        (ReduceOp::Max, DType::I32) => ("(-2147483647 - 1)".into(), "ap_imax32"),
        (ReduceOp::Max, DType::I64) => ("(-9223372036854775807ll - 1)".into(), "ap_imax64"),
        (ReduceOp::Max, _) => (super::float_literal(f64::NEG_INFINITY), "ap_rmax"),
        (ReduceOp::Min, DType::I32) => ("2147483647".into(), "ap_imin32"),
        (ReduceOp::Min, DType::I64) => ("9223372036854775807ll".into(), "ap_imin64"),
        (ReduceOp::Min, _) => (super::float_literal(f64::INFINITY), "ap_rmin"),
    }
}

fn unary(func: UnaryOp, dtype: DType, x: &str) -> Option<String> {
    let int = |f32: &str, f64: &str| match dtype {
        DType::I32 => Some(format!("{f32}({x})")),
        DType::I64 => Some(format!("{f64}({x})")),
        _ => None,
    };
    if !dtype.is_float() {
        return match func {
            UnaryOp::Neg => int("ap_neg32", "ap_neg64"),
            UnaryOp::Abs => int("ap_abs32", "ap_abs64"),
            UnaryOp::Square => match dtype {
                DType::I32 => Some(format!("ap_mul32({x}, {x})")),
                DType::I64 => Some(format!("ap_mul64({x}, {x})")),
                _ => None,
            },
            _ => None,
        };
    }
    Some(match func {
        UnaryOp::Neg => format!("(-{x})"),
        UnaryOp::Abs => format!("fabsf({x})"),
        UnaryOp::Exp => format!("expf({x})"),
        UnaryOp::Log => format!("logf({x})"),
        UnaryOp::Sqrt => format!("sqrtf({x})"),
        UnaryOp::Rsqrt => format!("(1.0f / sqrtf({x}))"),
        UnaryOp::Recip => format!("(1.0f / {x})"),
        UnaryOp::Square => format!("({x} * {x})"),
        UnaryOp::Tanh => format!("tanhf({x})"),
        UnaryOp::Sigmoid => format!("ap_sigmoid({x})"),
        UnaryOp::Relu => format!("ap_relu({x})"),
        UnaryOp::Gelu => format!("ap_gelu({x})"),
        UnaryOp::GeluGrad => format!("ap_gelu_grad({x})"),
        UnaryOp::Silu => format!("({x} * ap_sigmoid({x}))"),
        UnaryOp::Erf => format!("erff({x})"),
        UnaryOp::GeluErf => format!("ap_gelu_erf({x})"),
        UnaryOp::Sin => format!("sinf({x})"),
        UnaryOp::Cos => format!("cosf({x})"),
    })
}

fn binary(func: BinaryOp, dtype: DType, a: &str, b: &str) -> Option<String> {
    let w = match dtype {
        DType::I32 => "32",
        DType::I64 => "64",
        DType::Bool => return None,
        DType::F32 | DType::F16 | DType::BF16 => {
            return Some(match func {
                BinaryOp::Add => format!("({a} + {b})"),
                BinaryOp::Sub => format!("({a} - {b})"),
                BinaryOp::Mul => format!("({a} * {b})"),
                BinaryOp::Div => format!("({a} / {b})"),
                BinaryOp::Max => format!("ap_fmax({a}, {b})"),
                BinaryOp::Min => format!("ap_fmin({a}, {b})"),
                BinaryOp::Pow => format!("powf({a}, {b})"),
            });
        }
    };
    Some(match func {
        BinaryOp::Add => format!("ap_add{w}({a}, {b})"),
        BinaryOp::Sub => format!("ap_sub{w}({a}, {b})"),
        BinaryOp::Mul => format!("ap_mul{w}({a}, {b})"),
        BinaryOp::Div => format!("ap_div{w}({a}, {b})"),
        BinaryOp::Max => format!("ap_imax{w}({a}, {b})"),
        BinaryOp::Min => format!("ap_imin{w}({a}, {b})"),
        BinaryOp::Pow => return None,
    })
}

fn compare(func: CompareOp) -> &'static str {
    match func {
        CompareOp::Eq => "==",
        CompareOp::Ne => "!=",
        CompareOp::Lt => "<",
        CompareOp::Le => "<=",
        CompareOp::Gt => ">",
        CompareOp::Ge => ">=",
    }
}

/// The cast of register `x` of `from` to `to` (the caller rounds float results).
fn cast(from: DType, to: DType, x: &str) -> String {
    match (from.is_float(), from, to) {
        (true, _, DType::F32 | DType::F16 | DType::BF16) => x.to_string(),
        (true, _, DType::I32) => format!("ap_f2i32({x})"),
        (true, _, DType::I64) => format!("ap_f2i64({x})"),
        (true, _, DType::Bool) => format!("({x} != 0.0f)"),
        (false, DType::Bool, DType::F32 | DType::F16 | DType::BF16) => {
            format!("({x} ? 1.0f : 0.0f)")
        }
        (false, DType::Bool, DType::I32) => format!("({x} ? 1 : 0)"),
        (false, DType::Bool, DType::I64) => format!("({x} ? 1ll : 0ll)"),
        (false, DType::Bool, DType::Bool) => x.to_string(),
        (false, _, DType::F32 | DType::F16 | DType::BF16) => format!("((float){x})"),
        (false, _, DType::Bool) => format!("({x} != 0)"),
        (false, DType::I64, DType::I32) => format!("((int)(unsigned int)(ap_u64){x})"),
        (false, _, DType::I64) => format!("((ap_i64){x})"),
        (false, _, DType::I32) => x.to_string(),
    }
}

/// The vector kernel: every value at the flat index, 128 bits of each operand per load.
fn vector_kernel(
    body: &FusionBody,
    types: &[TensorType],
    n: u64,
) -> Result<super::Kernel, CudaError> {
    let sizes = body
        .params
        .iter()
        .chain(body.results.iter().map(|&r| &types[r]))
        .map(|t| t.dtype.size_bytes());
    let min_size = sizes.min().unwrap_or(4).max(1);
    let vec = (16 / min_size).clamp(1, 8) as u64;
    let (sig, args) = signature(body, types);
    let mut src = String::new();
    for (k, t) in body.params.iter().enumerate() {
        let align = (vec as usize * t.dtype.size_bytes()).min(16);
        let _ = writeln!(
            src,
            "struct __align__({align}) KERNEL_pv{k} {{ {} v[{vec}]; }};",
            storage(t.dtype)
        );
    }
    for (k, &r) in body.results.iter().enumerate() {
        let t = &types[r];
        let align = (vec as usize * t.dtype.size_bytes()).min(16);
        let _ = writeln!(
            src,
            "struct __align__({align}) KERNEL_rv{k} {{ {} v[{vec}]; }};",
            storage(t.dtype)
        );
    }
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({BLOCK}) KERNEL({sig}) {{"
    );
    let _ = writeln!(src, "  const ap_i64 n = {n}ll;");
    let _ = writeln!(src, "  const ap_i64 n_vec = n / {vec}ll;");
    let _ = writeln!(
        src,
        "  const ap_i64 stride = (ap_i64)gridDim.x * blockDim.x;"
    );
    let _ = writeln!(
        src,
        "  for (ap_i64 w = (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; w < n_vec; w += stride) {{"
    );
    for k in 0..body.params.len() {
        let _ = writeln!(
            src,
            "    const KERNEL_pv{k} pv{k} = *reinterpret_cast<const KERNEL_pv{k}*>(p{k} + w * {vec}ll);"
        );
    }
    for k in 0..body.results.len() {
        let _ = writeln!(src, "    KERNEL_rv{k} rv{k};");
    }
    let _ = writeln!(src, "#pragma unroll");
    let _ = writeln!(src, "    for (int e = 0; e < {vec}; ++e) {{");
    let mut em = Emitter::new(body, types, Access::Vector, 3);
    let coords = vec!["(w * {vec}ll + e)".replace("{vec}", &vec.to_string())];
    let mut results = Vec::new();
    for &r in &body.results {
        results.push(em.value(r, &coords));
    }
    let results = first_error(results)?;
    src.push_str(&em.code);
    for (k, (&r, v)) in body.results.iter().zip(&results).enumerate() {
        let _ = writeln!(src, "      rv{k}.v[e] = {};", store(types[r].dtype, v));
    }
    let _ = writeln!(src, "    }}");
    for k in 0..body.results.len() {
        let _ = writeln!(
            src,
            "    *reinterpret_cast<KERNEL_rv{k}*>(r{k} + w * {vec}ll) = rv{k};"
        );
    }
    let _ = writeln!(src, "  }}");
    let _ = writeln!(
        src,
        "  for (ap_i64 i = n_vec * {vec}ll + (ap_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {{"
    );
    let mut em = Emitter::new(body, types, Access::Flat, 2);
    let coords = vec!["i".to_string()];
    let mut tail = Vec::new();
    for &r in &body.results {
        tail.push(em.value(r, &coords));
    }
    let tail = first_error(tail)?;
    src.push_str(&em.code);
    for (k, (&r, v)) in body.results.iter().zip(&tail).enumerate() {
        let _ = writeln!(src, "    r{k}[i] = {};", store(types[r].dtype, v));
    }
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        "ew",
        &src,
        [blocks_for(n.div_ceil(vec), u64::from(BLOCK)), 1, 1],
        [BLOCK, 1, 1],
        0,
        args,
    ))
}

/// The first error among emitted results, if any.
fn first_error(results: Vec<Result<String, CudaError>>) -> Result<Vec<String>, CudaError> {
    results.into_iter().collect()
}

/// The loop kernel: one thread per element of the first result.
fn loop_kernel(
    body: &FusionBody,
    types: &[TensorType],
    first: &TensorType,
) -> Result<super::Kernel, CudaError> {
    let n = first.num_elements();
    let (sig, args) = signature(body, types);
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
    let mut em = Emitter::new(body, types, Access::Coords, 2);
    let mut results = Vec::new();
    let mut coords_of: HashMap<Vec<usize>, Vec<String>> = HashMap::new();
    for &r in &body.results {
        let dims = types[r].dims().to_vec();
        let coords = match coords_of.get(&dims) {
            Some(c) => c.clone(),
            None => {
                let c = em.decompose("i", &dims);
                coords_of.insert(dims, c.clone());
                c
            }
        };
        results.push(em.value(r, &coords));
    }
    let results = first_error(results)?;
    src.push_str(&em.code);
    for (k, (&r, v)) in body.results.iter().zip(&results).enumerate() {
        let _ = writeln!(src, "    r{k}[i] = {};", store(types[r].dtype, v));
    }
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        "loop",
        &src,
        [blocks_for(n, u64::from(BLOCK)), 1, 1],
        [BLOCK, 1, 1],
        0,
        args,
    ))
}

/// The rows of a row kernel: the shape every reduction reduces to, when every reduction
/// reduces trailing dims to it and every result has that shape or extends it by one common
/// trailing shape. Returns `(row dims, trailing dims of the full results)`.
fn row_shape(body: &FusionBody, types: &[TensorType]) -> Option<RowShape> {
    let mut rows: Option<Vec<usize>> = None;
    let mut longest = 0u64;
    for instr in &body.instrs {
        if let Op::Reduce { dims, .. } = &instr.op {
            let x = types[instr.operands[0]].dims();
            let k = x.len() - dims.len();
            if dims.iter().copied().ne(k..x.len()) {
                return None;
            }
            let kept = x[..k].to_vec();
            if rows.as_ref().is_some_and(|r| *r != kept) {
                return None;
            }
            longest = longest.max(x[k..].iter().map(|&d| d as u64).product());
            rows = Some(kept);
        }
    }
    let rows = rows?;
    let mut trailing: Option<Vec<usize>> = None;
    for &r in &body.results {
        let dims = types[r].dims();
        if dims == rows.as_slice() {
            continue;
        }
        if dims.len() <= rows.len() || dims[..rows.len()] != rows[..] {
            return None;
        }
        let t = dims[rows.len()..].to_vec();
        if trailing.as_ref().is_some_and(|x| *x != t) {
            return None;
        }
        longest = longest.max(t.iter().map(|&d| d as u64).product());
        trailing = Some(t);
    }
    Some(RowShape {
        rows,
        trailing: trailing.unwrap_or_default(),
        longest,
    })
}

/// See [`row_shape`].
struct RowShape {
    rows: Vec<usize>,
    trailing: Vec<usize>,
    longest: u64,
}

/// The row kernel: a warp or a block per row, reductions first, then results.
fn row_kernel(
    body: &FusionBody,
    types: &[TensorType],
    shape: &RowShape,
) -> Result<super::Kernel, CudaError> {
    let n_rows: u64 = shape.rows.iter().map(|&d| d as u64).product();
    let t_len: u64 = shape.trailing.iter().map(|&d| d as u64).product();
    let per_warp = shape.longest <= WARP_ROW_MAX;
    let (sig, args) = signature(body, types);
    let mut src = String::new();
    let threads = if per_warp {
        32 * WARPS_PER_BLOCK
    } else {
        ROW_BLOCK
    };
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __launch_bounds__({threads}) KERNEL({sig}) {{"
    );
    let grid = if per_warp {
        let _ = writeln!(src, "  const ap_i64 lane = threadIdx.x & 31;");
        let _ = writeln!(
            src,
            "  for (ap_i64 row = (ap_i64)blockIdx.x * {WARPS_PER_BLOCK} + (threadIdx.x >> 5); row < {n_rows}ll; row += (ap_i64)gridDim.x * {WARPS_PER_BLOCK}) {{"
        );
        blocks_for(n_rows, u64::from(WARPS_PER_BLOCK))
    } else {
        let _ = writeln!(src, "  const ap_i64 lane = threadIdx.x;");
        let _ = writeln!(
            src,
            "  for (ap_i64 row = blockIdx.x; row < {n_rows}ll; row += gridDim.x) {{"
        );
        blocks_for(n_rows, 1)
    };
    let mut em = Emitter::new(body, types, Access::Coords, 2);
    em.lane = Some((
        "lane",
        if per_warp { "32" } else { "blockDim.x" },
        !per_warp,
    ));
    let row_coords = em.decompose("row", &shape.rows);
    // Every reduction of the row, cooperatively, in body order (later ones read earlier ones
    // from the memo).
    for (i, instr) in body.instrs.iter().enumerate() {
        if let Op::Reduce { func, dims } = &instr.op {
            let v = body.params.len() + i;
            let name = em.reduce(*func, dims, instr.operands[0], &types[v], &row_coords, true)?;
            em.remember((v, row_coords.clone()), name);
        }
    }
    let full: Vec<(usize, usize)> = body
        .results
        .iter()
        .enumerate()
        .filter(|&(_, &r)| types[r].dims() != shape.rows.as_slice())
        .map(|(k, &r)| (k, r))
        .collect();
    if !full.is_empty() {
        let step = if per_warp { "32" } else { "blockDim.x" };
        em.line(&format!(
            "for (ap_i64 col = lane; col < {t_len}ll; col += {step}) {{"
        ));
        em.indent += 1;
        em.scopes.push(HashMap::new());
        let mut coords = row_coords.clone();
        coords.extend(em.decompose("col", &shape.trailing));
        for &(k, r) in &full {
            let v = em.value(r, &coords)?;
            let text = format!(
                "r{k}[row * {t_len}ll + col] = {};",
                store(types[r].dtype, &v)
            );
            em.line(&text);
        }
        em.scopes.pop();
        em.indent -= 1;
        em.line("}");
    }
    let reduced: Vec<(usize, usize)> = body
        .results
        .iter()
        .enumerate()
        .filter(|&(_, &r)| types[r].dims() == shape.rows.as_slice())
        .map(|(k, &r)| (k, r))
        .collect();
    if !reduced.is_empty() {
        em.line("if (lane == 0) {");
        em.indent += 1;
        em.scopes.push(HashMap::new());
        for &(k, r) in &reduced {
            let v = em.value(r, &row_coords)?;
            let text = format!("r{k}[row] = {};", store(types[r].dtype, &v));
            em.line(&text);
        }
        em.scopes.pop();
        em.indent -= 1;
        em.line("}");
    }
    if !per_warp {
        // The next row reuses the shared reduction slots.
        em.line("__syncthreads();");
    }
    src.push_str(&em.code);
    let _ = writeln!(src, "  }}");
    let _ = writeln!(src, "}}");
    Ok(finish(
        if per_warp { "rowwarp" } else { "rowblock" },
        &src,
        [grid, 1, 1],
        [threads, 1, 1],
        0,
        args,
    ))
}
