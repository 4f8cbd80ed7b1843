//! Fusion bodies on the fast backend. A body whose instructions are all element-wise over one
//! iteration space (unary, binary, compare, select, float and bool casts, reshapes, and
//! broadcasts or constants feeding them) runs over tiles of [`TILE`] elements: each
//! instruction is one tight loop (the element-wise kernels' monomorphised loops) from tile
//! buffers into a tile buffer, broadcasts read their operand through an index map and
//! constants are scalars, so nothing but the results is written at full size; tiles are split
//! over threads. Any other body (reductions, integers) runs instruction by instruction on the
//! fast kernels. Either way every instruction's result is rounded to its declared dtype, as
//! the unfused nodes would be.

use autopar_ir::infer::infer;
use autopar_ir::{DType, FusionBody, Op, TensorType};
use rayon::prelude::*;

use super::elementwise::{Side, binary_f32, compare_f32, unary_f32};
use super::storage::{Elems, round_slice};
use super::{Ctx, FastTensor, Val, eval};
use crate::error::RuntimeError;
use crate::tensor::{round_to_dtype, strides};

/// Elements per tile: small enough that a body's tile buffers stay in L1/L2.
pub const TILE: usize = 512;

/// Tiles per thread task.
const TILES_PER_TASK: usize = 32;

/// A body with the types of all its values and, when it qualifies, its tiled form.
#[derive(Clone, Debug)]
pub(crate) struct Compiled {
    body: FusionBody,
    types: Vec<TensorType>,
    tiled: Option<Vec<Step>>,
}

/// How one body value is read inside a tile.
#[derive(Clone, Debug)]
enum Step {
    /// An operand of the full iteration space: its elements at the tile's range.
    Operand(usize),
    /// An operand that only broadcasts read.
    Small,
    /// A float or bool scalar.
    Scalar(f64),
    /// A broadcast of body value `src` (an operand), read at offsets `view`.
    Broadcast { src: usize, view: Vec<usize> },
    /// The same elements as body value `src`.
    Alias(usize),
    /// An element-wise op on earlier values, into this value's tile buffer.
    Compute { op: Op, args: Vec<usize> },
}

impl Compiled {
    /// Types every value of `body` and decides whether it runs tiled.
    pub(crate) fn new(body: &FusionBody) -> Result<Compiled, RuntimeError> {
        let mut types = body.params.clone();
        for instr in &body.instrs {
            let args: Vec<&TensorType> = instr.operands.iter().map(|&v| &types[v]).collect();
            let mut out = infer(&instr.op, &args, None)?;
            if out.len() != 1 {
                return Err(RuntimeError::BadTensor {
                    ty: types
                        .last()
                        .cloned()
                        .unwrap_or_else(|| TensorType::scalar(DType::F32)),
                    detail: format!(
                        "fusion instruction `{}` must have one result",
                        instr.op.name()
                    ),
                });
            }
            types.push(out.swap_remove(0));
        }
        let tiled = tile_plan(body, &types);
        Ok(Compiled {
            body: body.clone(),
            types,
            tiled,
        })
    }

    /// Whether the body runs over tiles.
    #[cfg(test)]
    pub fn is_tiled(&self) -> bool {
        self.tiled.is_some()
    }
}

/// The tiled form of a body, or `None` when some instruction needs the whole tensor.
fn tile_plan(body: &FusionBody, types: &[TensorType]) -> Option<Vec<Step>> {
    let n = types.get(*body.results.first()?)?.num_elements();
    let float_or_bool = |t: &TensorType| t.dtype.is_float() || t.dtype == DType::Bool;
    if n == 0
        || body.results.iter().any(|&r| {
            types[r].num_elements() != n || !float_or_bool(&types[r]) || r < body.params.len()
        })
    {
        return None;
    }
    let np = body.params.len();
    let mut steps: Vec<Step> = body
        .params
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.num_elements() == n && float_or_bool(t) {
                Step::Operand(i)
            } else {
                Step::Small
            }
        })
        .collect();
    for (i, instr) in body.instrs.iter().enumerate() {
        let ty = &types[np + i];
        if !float_or_bool(ty) {
            return None;
        }
        let full = ty.num_elements() == n;
        let arg_full = |v: usize| {
            matches!(
                steps[v],
                Step::Operand(_)
                    | Step::Alias(_)
                    | Step::Compute { .. }
                    | Step::Scalar(_)
                    | Step::Broadcast { .. }
            )
        };
        let step = match &instr.op {
            Op::Constant { value, ty } => Step::Scalar(round_to_dtype(*value, ty.dtype)),
            Op::Broadcast { dims, .. } if full => {
                let src = instr.operands[0];
                match &steps[src] {
                    Step::Scalar(v) => Step::Scalar(*v),
                    _ if types[src].num_elements() == 1 && src < np => Step::Broadcast {
                        src,
                        view: vec![0; ty.rank()],
                    },
                    _ if src < np => {
                        let st = strides(types[src].dims());
                        let mut view = vec![0; ty.rank()];
                        for (j, &d) in dims.iter().enumerate() {
                            if types[src].dims()[j] != 1 {
                                view[d] = st[j];
                            }
                        }
                        Step::Broadcast { src, view }
                    }
                    _ => return None,
                }
            }
            Op::Reshape { .. } if full && arg_full(instr.operands[0]) => {
                match &steps[instr.operands[0]] {
                    Step::Scalar(v) => Step::Scalar(*v),
                    _ => Step::Alias(instr.operands[0]),
                }
            }
            Op::Unary { .. }
            | Op::Binary { .. }
            | Op::Compare { .. }
            | Op::Select
            | Op::Cast { .. }
                if full
                    && instr.operands.iter().all(|&v| arg_full(v))
                    && operand_kinds_fit(&instr.op, &instr.operands, types) =>
            {
                Step::Compute {
                    op: instr.op.clone(),
                    args: instr.operands.clone(),
                }
            }
            _ => return None,
        };
        steps.push(step);
    }
    Some(steps)
}

/// True when the tiled loops handle the operand dtypes of `op`: floats for arithmetic and
/// comparisons, a bool condition for select, floats or bools for casts.
fn operand_kinds_fit(op: &Op, operands: &[usize], types: &[TensorType]) -> bool {
    let float = |v: &usize| types[*v].dtype.is_float();
    let fb = |v: &usize| types[*v].dtype.is_float() || types[*v].dtype == DType::Bool;
    match op {
        Op::Unary { .. } | Op::Binary { .. } | Op::Compare { .. } => operands.iter().all(float),
        Op::Select => {
            operands
                .first()
                .is_some_and(|c| types[*c].dtype == DType::Bool)
                && operands[1..].iter().all(fb)
        }
        Op::Cast { .. } => operands.iter().all(fb),
        _ => false,
    }
}

/// Runs a compiled fusion on its operands.
pub(crate) fn run(ctx: &Ctx, c: &Compiled, args: &[&Val]) -> Result<Vec<Val>, RuntimeError> {
    match &c.tiled {
        Some(steps) => run_tiled(ctx, c, steps, args),
        None => run_stepwise(ctx, c, args),
    }
}

/// Instruction by instruction on the fast kernels.
fn run_stepwise(ctx: &Ctx, c: &Compiled, args: &[&Val]) -> Result<Vec<Val>, RuntimeError> {
    let np = c.body.params.len();
    let mut values: Vec<Val> = args.iter().map(|&a| a.clone()).collect();
    for (i, instr) in c.body.instrs.iter().enumerate() {
        let operands: Vec<&Val> = instr.operands.iter().map(|&v| &values[v]).collect();
        let out = std::slice::from_ref(&c.types[np + i]);
        let mut r = eval(ctx, &instr.op, &operands, out, None)?;
        if r.len() != 1 {
            return Err(RuntimeError::NotAKernel {
                op: instr.op.name(),
            });
        }
        values.push(r.swap_remove(0));
    }
    Ok(c.body.results.iter().map(|&r| values[r].clone()).collect())
}

/// A value inside one tile.
#[derive(Clone, Copy)]
enum TileVal<'a> {
    F32(&'a [f32]),
    Bool(&'a [bool]),
    Scalar(f64),
}

/// Per-task tile buffers, one per body value (only computed and broadcast ones are used).
struct Scratch {
    f32s: Vec<Vec<f32>>,
    bools: Vec<Vec<bool>>,
}

/// One thread task's share of the float and bool results.
type TaskOut<'a> = (Vec<&'a mut [f32]>, Vec<&'a mut [bool]>);

/// Over tiles of the iteration space, every result written tile by tile.
fn run_tiled(
    ctx: &Ctx,
    c: &Compiled,
    steps: &[Step],
    args: &[&Val],
) -> Result<Vec<Val>, RuntimeError> {
    let np = c.body.params.len();
    let out_types: Vec<&TensorType> = c.body.results.iter().map(|&r| &c.types[r]).collect();
    let n = out_types.first().map_or(0, |t| t.num_elements() as usize);
    // Operands dense (a splat operand is written out once: they are rare in bodies).
    let operands: Vec<FastTensor> = args.iter().map(|a| ctx.dense(a)).collect();
    if operands.len() != np {
        return Err(RuntimeError::NotAKernel { op: "fusion" });
    }
    let mut f32_outs: Vec<Vec<f32>> = Vec::new();
    let mut bool_outs: Vec<Vec<bool>> = Vec::new();
    for t in &out_types {
        if t.dtype == DType::Bool {
            bool_outs.push(ctx.bools(n));
        } else {
            f32_outs.push(ctx.f32s(n));
        }
    }
    let chunk = TILE * TILES_PER_TASK;
    let tasks = n.div_ceil(chunk);
    let mut per: Vec<TaskOut> = (0..tasks).map(|_| (Vec::new(), Vec::new())).collect();
    for o in f32_outs.iter_mut() {
        for (p, c) in per.iter_mut().zip(o.chunks_mut(chunk)) {
            p.0.push(c);
        }
    }
    for o in bool_outs.iter_mut() {
        for (p, c) in per.iter_mut().zip(o.chunks_mut(chunk)) {
            p.1.push(c);
        }
    }
    let task = |(t, (mut fo, mut bo)): (usize, TaskOut)| {
        let serial = Ctx {
            pool: ctx.pool,
            threads: 1,
            wide: ctx.wide,
            workers: None,
        };
        let mut scratch = Scratch {
            f32s: vec![Vec::new(); steps.len()],
            bools: vec![Vec::new(); steps.len()],
        };
        let start = t * chunk;
        let end = (start + chunk).min(n);
        let mut at = start;
        while at < end {
            let len = TILE.min(end - at);
            run_tile(&serial, c, steps, &operands, at, len, &mut scratch)?;
            let (mut fi, mut bi) = (0, 0);
            for &r in &c.body.results {
                let dst = at - start;
                match tile_val(c, steps, &operands, &scratch, r, at, len) {
                    TileVal::F32(v) => {
                        fo[fi][dst..dst + len].copy_from_slice(v);
                        fi += 1;
                    }
                    TileVal::Bool(v) => {
                        bo[bi][dst..dst + len].copy_from_slice(v);
                        bi += 1;
                    }
                    TileVal::Scalar(x) => {
                        if c.types[r].dtype == DType::Bool {
                            bo[bi][dst..dst + len].fill(x != 0.0);
                            bi += 1;
                        } else {
                            fo[fi][dst..dst + len].fill(x as f32);
                            fi += 1;
                        }
                    }
                }
            }
            at += len;
        }
        Ok::<(), RuntimeError>(())
    };
    if ctx.threads > 1 && tasks > 1 {
        ctx.install(|| per.into_par_iter().enumerate().try_for_each(task))?;
    } else {
        per.into_iter().enumerate().try_for_each(task)?;
    }
    let (mut fi, mut bi) = (f32_outs.into_iter(), bool_outs.into_iter());
    let mut results = Vec::with_capacity(out_types.len());
    for t in out_types {
        let elems = if t.dtype == DType::Bool {
            Elems::Bool(bi.next().unwrap_or_default())
        } else {
            Elems::F32(fi.next().unwrap_or_default())
        };
        results.push(Val::Dense(ctx.of_elems(t, elems)));
    }
    Ok(results)
}

/// Body value `v` in the tile `at..at + len`.
fn tile_val<'a>(
    c: &Compiled,
    steps: &[Step],
    operands: &'a [FastTensor],
    scratch: &'a Scratch,
    v: usize,
    at: usize,
    len: usize,
) -> TileVal<'a> {
    match &steps[v] {
        Step::Operand(i) => match operands[*i].elems() {
            Elems::F32(x) => TileVal::F32(&x[at..at + len]),
            Elems::Bool(x) => TileVal::Bool(&x[at..at + len]),
            Elems::Int(_) => TileVal::Scalar(f64::NAN),
        },
        Step::Scalar(x) => TileVal::Scalar(*x),
        Step::Alias(src) => tile_val(c, steps, operands, scratch, *src, at, len),
        Step::Small => TileVal::Scalar(f64::NAN),
        Step::Broadcast { .. } | Step::Compute { .. } => {
            if c.types[v].dtype == DType::Bool {
                TileVal::Bool(&scratch.bools[v])
            } else {
                TileVal::F32(&scratch.f32s[v][..len])
            }
        }
    }
}

/// Computes every broadcast and instruction of one tile into `scratch`.
fn run_tile(
    serial: &Ctx,
    c: &Compiled,
    steps: &[Step],
    operands: &[FastTensor],
    at: usize,
    len: usize,
    scratch: &mut Scratch,
) -> Result<(), RuntimeError> {
    for v in 0..steps.len() {
        let ty = &c.types[v];
        match &steps[v] {
            Step::Operand(_) | Step::Small | Step::Scalar(_) | Step::Alias(_) => {}
            Step::Broadcast { src, view } => {
                let dims = ty.dims();
                match operands[*src].elems() {
                    Elems::F32(x) => {
                        let mut buf = std::mem::take(&mut scratch.f32s[v]);
                        buf.resize(len, 0.0);
                        gather_view(x, dims, view, at, &mut buf);
                        scratch.f32s[v] = buf;
                        scratch.bools[v].clear();
                    }
                    Elems::Bool(x) => {
                        let mut buf = std::mem::take(&mut scratch.bools[v]);
                        buf.resize(len, false);
                        gather_view(x, dims, view, at, &mut buf);
                        scratch.bools[v] = buf;
                    }
                    Elems::Int(_) => return Err(RuntimeError::NotAKernel { op: "fusion" }),
                }
            }
            Step::Compute { op, args } => {
                let mut fbuf = std::mem::take(&mut scratch.f32s[v]);
                let mut bbuf = std::mem::take(&mut scratch.bools[v]);
                let vals: Vec<TileVal> = args
                    .iter()
                    .map(|&a| tile_val(c, steps, operands, scratch, a, at, len))
                    .collect();
                if ty.dtype == DType::Bool {
                    bbuf.resize(len, false);
                    compute_bools(op, &vals, &mut bbuf, ty.dtype)?;
                } else {
                    fbuf.resize(len, 0.0);
                    compute_floats(serial, op, &vals, &mut fbuf, ty.dtype)?;
                    round_slice(ty.dtype, &mut fbuf);
                }
                scratch.f32s[v] = fbuf;
                scratch.bools[v] = bbuf;
            }
        }
    }
    Ok(())
}

fn side<'a>(t: TileVal<'a>) -> Option<Side<'a>> {
    match t {
        TileVal::F32(s) => Some(Side::Slice(s)),
        TileVal::Scalar(x) => Some(Side::Scalar(x as f32)),
        TileVal::Bool(_) => None,
    }
}

/// Element `i` of a tile value read as a bool.
fn as_bool(t: TileVal, i: usize) -> bool {
    match t {
        TileVal::Bool(s) => s[i],
        TileVal::Scalar(x) => x != 0.0,
        TileVal::F32(s) => s[i] != 0.0,
    }
}

/// Element `i` of a tile value read as a float.
fn as_f32(t: TileVal, i: usize) -> f32 {
    match t {
        TileVal::F32(s) => s[i],
        TileVal::Scalar(x) => x as f32,
        TileVal::Bool(s) => f32::from(u8::from(s[i])),
    }
}

/// One bool-valued instruction over a tile.
fn compute_bools(
    op: &Op,
    vals: &[TileVal],
    buf: &mut [bool],
    dtype: DType,
) -> Result<(), RuntimeError> {
    let bad = || RuntimeError::UnsupportedDType {
        op: op.name(),
        dtype,
    };
    match op {
        Op::Compare { func } => match (side(vals[0]), side(vals[1])) {
            (Some(a), Some(b)) => compare_f32(*func, a, b, buf),
            _ => return Err(bad()),
        },
        Op::Cast { .. } => {
            for (i, o) in buf.iter_mut().enumerate() {
                *o = as_bool(vals[0], i);
            }
        }
        Op::Select => {
            for (i, o) in buf.iter_mut().enumerate() {
                *o = if as_bool(vals[0], i) {
                    as_bool(vals[1], i)
                } else {
                    as_bool(vals[2], i)
                };
            }
        }
        _ => return Err(bad()),
    }
    Ok(())
}

/// One float-valued instruction over a tile (rounded by the caller).
fn compute_floats(
    serial: &Ctx,
    op: &Op,
    vals: &[TileVal],
    buf: &mut [f32],
    dtype: DType,
) -> Result<(), RuntimeError> {
    let bad = || RuntimeError::UnsupportedDType {
        op: op.name(),
        dtype,
    };
    match op {
        Op::Unary { func } => match vals[0] {
            TileVal::F32(s) => unary_f32(serial, *func, s, buf),
            TileVal::Scalar(x) => {
                let mut one = [0.0f32];
                unary_f32(serial, *func, &[x as f32], &mut one);
                buf.fill(one[0]);
            }
            TileVal::Bool(_) => return Err(bad()),
        },
        Op::Binary { func } => match (side(vals[0]), side(vals[1])) {
            (Some(a), Some(b)) => binary_f32(serial, *func, a, b, buf),
            _ => return Err(bad()),
        },
        Op::Select => match (vals[0], side(vals[1]), side(vals[2])) {
            (TileVal::Bool(c), Some(Side::Slice(a)), Some(Side::Slice(b))) => {
                for (((o, &c), &p), &q) in buf.iter_mut().zip(c).zip(a).zip(b) {
                    *o = if c { p } else { q };
                }
            }
            _ => {
                for (i, o) in buf.iter_mut().enumerate() {
                    *o = if as_bool(vals[0], i) {
                        as_f32(vals[1], i)
                    } else {
                        as_f32(vals[2], i)
                    };
                }
            }
        },
        Op::Cast { .. } => {
            for (i, o) in buf.iter_mut().enumerate() {
                *o = as_f32(vals[0], i);
            }
        }
        _ => return Err(bad()),
    }
    Ok(())
}

/// `dst[i]` = `src` at the view offset of linear index `at + i` of `dims`.
fn gather_view<T: Copy>(src: &[T], dims: &[usize], view: &[usize], at: usize, dst: &mut [T]) {
    let rank = dims.len();
    if rank == 0 {
        dst.fill(src[0]);
        return;
    }
    // The multi-index of `at`, then an odometer.
    let mut index = vec![0usize; rank];
    let mut rem = at;
    let mut off = 0;
    for d in (0..rank).rev() {
        index[d] = rem % dims[d];
        rem /= dims[d];
        off += index[d] * view[d];
    }
    let last = rank - 1;
    for o in dst.iter_mut() {
        *o = src[off];
        index[last] += 1;
        off += view[last];
        let mut d = last;
        while index[d] == dims[d] && d > 0 {
            off -= view[d] * dims[d];
            index[d] = 0;
            d -= 1;
            index[d] += 1;
            off += view[d];
        }
    }
}

#[cfg(test)]
mod tests {
    use autopar_ir::{BinaryOp, FusedInstr, ReduceOp, Shape};

    use super::*;

    fn body(instrs: Vec<(Op, Vec<usize>)>, results: Vec<usize>) -> FusionBody {
        FusionBody {
            params: vec![
                TensorType::new(DType::F32, [4, 6]),
                TensorType::new(DType::F32, [6]),
            ],
            instrs: instrs
                .into_iter()
                .map(|(op, operands)| FusedInstr { op, operands })
                .collect(),
            results,
        }
    }

    #[test]
    fn element_wise_bodies_tile_and_others_do_not() -> Result<(), RuntimeError> {
        let bcast = Op::Broadcast {
            shape: Shape::new(vec![4, 6]),
            dims: vec![1],
        };
        let add = Op::Binary {
            func: BinaryOp::Add,
        };
        let tiled = body(
            vec![(bcast.clone(), vec![1]), (add.clone(), vec![0, 2])],
            vec![3],
        );
        assert!(Compiled::new(&tiled)?.is_tiled());
        let sum = Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![0],
        };
        let reduced = body(vec![(sum, vec![0]), (add, vec![1, 2])], vec![3]);
        assert!(!Compiled::new(&reduced)?.is_tiled());
        // A body that returns an operand as it is has nothing to tile.
        assert!(!Compiled::new(&body(vec![(bcast, vec![1])], vec![0]))?.is_tiled());
        Ok(())
    }

    #[test]
    fn broadcast_views_walk_the_operand() {
        // [2, 3] read from a row of 3 (stride 0 on the first dim), from linear index 2.
        let mut dst = [0; 4];
        gather_view(&[10, 11, 12], &[2, 3], &[0, 1], 2, &mut dst);
        assert_eq!(dst, [12, 10, 11, 12]);
    }
}
