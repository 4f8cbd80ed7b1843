//! Fusion bodies on the fast backend. Most bodies run over tiles of the iteration space (the
//! largest value's elements): each instruction is one tight, vectorised loop from tile buffers
//! into a tile buffer (the element-wise kernels' monomorphised loops), nothing but the results
//! is written at full size, and tiles are split over threads. Inside a tile a value is one of:
//! - full: one element per element of the iteration space (element-wise results, float, bool
//!   or integer operands, broadcasts of operands read through an index map, or read in place
//!   when the tile lies inside one run of consecutive source elements);
//! - per row: one element per row, when the body reduces the trailing dims of full values
//!   ("rows" of `R` elements: layer norm, softmax and their backward passes). Tiles hold whole
//!   rows; a row reduction's result is used in the same tile, broadcast back over its row.
//!   Element-wise ops on such broadcasts (a variance broadcast back, plus eps, rsqrt: how
//!   autodiff writes a norm's backward) are computed once per row, and a broadcast or such
//!   an op is written out over its rows only when something reads it at full size;
//! - per column: a reduction over the leading dims (a bias or norm-weight gradient), which
//!   must be a result of the body: each task accumulates its tiles, and the tasks' partial
//!   sums are added in task order at the end (a fixed order, whatever the thread count);
//! - a scalar (constants, splats);
//! - small: smaller than the iteration space and only broadcast to it. A small value computed
//!   from small operands (a causal mask compared on `[s, s]` positions, then broadcast over
//!   batch and heads) is evaluated once, before the tiles, on the fast kernels, and read
//!   through its broadcasts like an operand.
//!
//! A result computed by an instruction or a row reduction is written straight into its output;
//! selects blend on the bits (a branch would compile to gathers).
//!
//! Any other body (reductions of other dims, integer arithmetic, results of several
//! iteration spaces) runs instruction by instruction on the fast kernels, except that an f32
//! sum over every dim of a square used nowhere else (a gradient norm's terms) is taken in one
//! pass over the squared operand, without writing the squares. Either way every
//! instruction's result is rounded to its declared dtype, as the unfused nodes would be, and
//! sums accumulate in f64 as the reduction kernels do.

use autopar_ir::infer::infer;
use autopar_ir::{DType, FusionBody, Op, ReduceOp, TensorType};
use rayon::prelude::*;

use super::elementwise::{Side, binary_f32, blend, compare_f32, unary_f32};
use super::reduce::{reduce_rows, sum64_of};
use super::simd::vectorized;
use super::storage::{Elems, round_slice};
use super::{Ctx, FastTensor, Val, eval};
use crate::error::RuntimeError;
use crate::tensor::{round_to_dtype, strides};

/// Elements per tile: few enough that a body's tile buffers (16 KiB of f32 each) stay in L2,
/// enough that the per-instruction dispatch is spread over many elements.
pub const TILE: usize = 4096;

/// Tiles per thread task.
const TILES_PER_TASK: usize = 32;

/// The largest tile unit (least common multiple of the row and column lengths) a body may
/// have and still run tiled.
const MAX_UNIT: usize = 1 << 16;

/// A body with the types of all its values and, when it qualifies, its tiled form.
#[derive(Clone, Debug)]
pub(crate) struct Compiled {
    body: FusionBody,
    types: Vec<TensorType>,
    tiled: Option<Tiled>,
    /// For the stepwise form, per instruction: `Some(x)` for an f32 sum over all dims of
    /// `square x` whose square has no other use (a gradient norm's terms), computed in one
    /// pass without writing the squares; the square itself is then skipped.
    square_sums: Vec<Option<usize>>,
}

/// The tiled form of a body.
#[derive(Clone, Debug)]
struct Tiled {
    steps: Vec<Step>,
    class: Vec<Class>,
    /// Elements of the iteration space.
    n: usize,
    /// Elements per row (1 when nothing is reduced per row).
    row: usize,
    /// Elements of a tile: a multiple of the row and column lengths.
    tile: usize,
    /// The small values evaluated before the tiles, in body order; source `np + k` is the
    /// `k`-th (sources `0..np` are the operands).
    pre: Vec<usize>,
    /// Per value, whether its full tile is read (by an instruction, a reduction or as a
    /// result): a row broadcast or row computation that only feeds row computations is
    /// never written out.
    full: Vec<bool>,
}

/// How many elements of a tile a value has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// One per element of the tile.
    Full,
    /// One per row of the tile.
    Row,
    /// A reduction over the leading dims, accumulated across tiles (a result only).
    Col,
    /// One value for the whole tile, or read only through broadcasts.
    Scalar,
}

/// How one body value is read or computed inside a tile.
#[derive(Clone, Debug)]
enum Step {
    /// An operand of this value's class: its elements at the tile's (row) range.
    Operand(usize),
    /// An operand that only broadcasts read.
    Small,
    /// A float or bool scalar.
    Scalar(f64),
    /// A small value computed before the tiles (source `np + k` for the `k`-th of them).
    Pre,
    /// A broadcast of source `src` (an operand or a small value computed before the tiles)
    /// to full size, read at offsets `view`. Runs of `block` elements (0: none) read
    /// consecutive source elements, so a tile inside one run reads the source in place.
    Broadcast {
        src: usize,
        view: Vec<usize>,
        block: usize,
    },
    /// A per-row value repeated over its row (written out only when something reads it at
    /// full size: see [`Tiled::full`]).
    RowBroadcast { src: usize },
    /// An element-wise op on values that are constant along rows (row broadcasts, other such
    /// ops, scalars): computed once per row, and repeated over the rows only when something
    /// reads it at full size. A layer norm's backward takes `rsqrt(var + eps)` per row this
    /// way instead of once per element.
    RowCompute { op: Op, args: Vec<usize> },
    /// The same elements as body value `src`.
    Alias(usize),
    /// An element-wise op on earlier values of this value's class.
    Compute { op: Op, args: Vec<usize> },
    /// A reduction of each row of full value `src`.
    RowReduce { func: ReduceOp, src: usize },
    /// A reduction over the leading dims of full value `src`: `count` elements each.
    ColReduce {
        func: ReduceOp,
        src: usize,
        count: usize,
    },
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
        let square_sums = square_sums(body, &types);
        Ok(Compiled {
            body: body.clone(),
            types,
            tiled,
            square_sums,
        })
    }

    /// Whether the body runs over tiles.
    #[cfg(test)]
    pub fn is_tiled(&self) -> bool {
        self.tiled.is_some()
    }
}

/// Per instruction, the operand `x` when it is an f32 sum over every dim of `square x` and
/// that square is used by nothing else (see [`Compiled`]).
fn square_sums(body: &FusionBody, types: &[TensorType]) -> Vec<Option<usize>> {
    let np = body.params.len();
    let mut uses = vec![0usize; types.len()];
    for &v in body
        .instrs
        .iter()
        .flat_map(|i| &i.operands)
        .chain(&body.results)
    {
        uses[v] += 1;
    }
    body.instrs
        .iter()
        .enumerate()
        .map(|(i, instr)| {
            let Op::Reduce {
                func: ReduceOp::Sum,
                dims,
            } = &instr.op
            else {
                return None;
            };
            let sq = *instr.operands.first()?;
            let def = body.instrs.get(sq.checked_sub(np)?)?;
            let all = {
                let mut d = dims.clone();
                d.sort_unstable();
                d.dedup();
                d.len() == types[sq].rank() && d.iter().enumerate().all(|(i, &x)| i == x)
            };
            let x = *def.operands.first()?;
            let square = matches!(
                def.op,
                Op::Unary {
                    func: autopar_ir::UnaryOp::Square
                }
            );
            (square
                && all
                && uses[sq] == 1
                && [x, sq, np + i]
                    .iter()
                    .all(|&v| types[v].dtype == DType::F32))
            .then_some(x)
        })
        .collect()
}

/// Whether `dims` (of a value of rank `rank`) are `first..rank` (a suffix) or `0..last` (a
/// prefix), sorted and without repeats: the split point, and whether it is a suffix.
fn split_of(dims: &[usize], rank: usize) -> Option<(usize, bool)> {
    let mut d = dims.to_vec();
    d.sort_unstable();
    d.dedup();
    if d.len() != dims.len() || d.is_empty() || d.windows(2).any(|w| w[1] != w[0] + 1) {
        return None;
    }
    let (first, last) = (d[0], d[d.len() - 1]);
    if last + 1 == rank {
        Some((first, true))
    } else if first == 0 {
        Some((last + 1, false))
    } else {
        None
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The tiled form of a body, or `None` when some instruction needs more than a tile.
fn tile_plan(body: &FusionBody, types: &[TensorType]) -> Option<Tiled> {
    let n = types.iter().map(|t| t.num_elements() as usize).max()?;
    if n == 0 || body.results.is_empty() {
        return None;
    }
    let elems = |v: usize| types[v].num_elements() as usize;
    let np = body.params.len();
    // The row length: every reduction of trailing dims must share it.
    let mut row = 1usize;
    let mut col = 1usize;
    for instr in &body.instrs {
        if let Op::Reduce { dims, .. } = &instr.op {
            let src = *instr.operands.first()?;
            if elems(src) != n {
                return None;
            }
            let sd = types[src].dims();
            let (k, suffix) = split_of(dims, sd.len())?;
            if suffix {
                let r: usize = sd[k..].iter().product();
                if row != 1 && r != row {
                    return None;
                }
                row = r;
            } else {
                let c: usize = sd[k..].iter().product();
                col = col / gcd(col, c) * c;
            }
        }
    }
    let unit = row / gcd(row, col) * col;
    if unit == 0 || unit > MAX_UNIT || n % unit != 0 {
        return None;
    }
    let rows_n = n / row;
    let kind_ok = |t: &TensorType| {
        t.dtype.is_float() || t.dtype == DType::Bool || matches!(t.dtype, DType::I32 | DType::I64)
    };
    let mut class: Vec<Class> = Vec::with_capacity(types.len());
    let mut steps: Vec<Step> = Vec::with_capacity(types.len());
    // The source index of every value readable as a whole tensor: operands and small values
    // computed before the tiles.
    let mut source: Vec<Option<usize>> = (0..np).map(Some).collect();
    let mut pre = Vec::new();
    for t in &body.params {
        let e = t.num_elements() as usize;
        if !kind_ok(t) {
            return None;
        }
        if e == n {
            class.push(Class::Full);
            steps.push(Step::Operand(steps.len()));
        } else if row > 1 && e == rows_n {
            class.push(Class::Row);
            steps.push(Step::Operand(steps.len()));
        } else {
            class.push(Class::Scalar);
            steps.push(Step::Small);
        }
    }
    for (i, instr) in body.instrs.iter().enumerate() {
        let v = np + i;
        let ty = &types[v];
        if !kind_ok(ty) {
            return None;
        }
        let e = elems(v);
        let own = if e == n {
            Class::Full
        } else if row > 1 && e == rows_n {
            Class::Row
        } else {
            Class::Scalar
        };
        let args = &instr.operands;
        let readable = |a: usize| {
            matches!(class[a], Class::Full | Class::Row) || matches!(steps[a], Step::Scalar(_))
        };
        // A small value from small values (at least one of them computed data, the others
        // scalars) is computed before the tiles.
        let small = |a: usize| class[a] == Class::Scalar && source[a].is_some();
        let scalar = |a: usize| matches!(steps[a], Step::Scalar(_));
        if own == Class::Scalar
            && !matches!(instr.op, Op::Constant { .. } | Op::Reduce { .. })
            && args.iter().any(|&a| small(a))
            && args.iter().all(|&a| small(a) || scalar(a))
        {
            source.push(Some(np + pre.len()));
            pre.push(v);
            class.push(Class::Scalar);
            steps.push(Step::Pre);
            continue;
        }
        source.push(None);
        let (step, cls) = match &instr.op {
            Op::Constant { value, ty } => (
                Step::Scalar(round_to_dtype(*value, ty.dtype)),
                Class::Scalar,
            ),
            Op::Broadcast { dims, .. } => {
                let src = *args.first()?;
                if let Step::Scalar(x) = steps[src] {
                    (Step::Scalar(x), Class::Scalar)
                } else if let (Class::Full, Some(at)) = (own, source[src]) {
                    let st = strides(types[src].dims());
                    let mut view = vec![0; ty.rank()];
                    for (j, &d) in dims.iter().enumerate() {
                        if types[src].dims()[j] != 1 {
                            view[d] = st[j];
                        }
                    }
                    let block = contiguous_block(ty.dims(), &view);
                    (
                        Step::Broadcast {
                            src: at,
                            view,
                            block,
                        },
                        Class::Full,
                    )
                } else if own == Class::Full
                    && class[src] == Class::Row
                    && dims.iter().enumerate().all(|(j, &d)| j == d)
                    && types[src].dims() == &ty.dims()[..dims.len()]
                {
                    (Step::RowBroadcast { src }, Class::Full)
                } else {
                    return None;
                }
            }
            Op::Reshape { .. } => {
                let src = *args.first()?;
                match steps[src] {
                    Step::Scalar(x) => (Step::Scalar(x), Class::Scalar),
                    _ if class[src] == own && own != Class::Scalar => (Step::Alias(src), own),
                    _ => return None,
                }
            }
            Op::Reduce { func, dims } => {
                let src = args[0];
                if class[src] != Class::Full || !types[src].dtype.is_float() {
                    return None;
                }
                let sd = types[src].dims();
                let (k, suffix) = split_of(dims, sd.len())?;
                if suffix && own == Class::Row {
                    (Step::RowReduce { func: *func, src }, Class::Row)
                } else if !suffix {
                    let count = sd[..k].iter().product();
                    (
                        Step::ColReduce {
                            func: *func,
                            src,
                            count,
                        },
                        Class::Col,
                    )
                } else {
                    return None;
                }
            }
            Op::Unary { .. } | Op::Binary { .. }
                if own == Class::Full
                    && ty.dtype.is_float()
                    && args.iter().any(|&a| row_constant(&steps[a]))
                    && args.iter().all(|&a| {
                        types[a].dtype.is_float()
                            && (row_constant(&steps[a]) || matches!(steps[a], Step::Scalar(_)))
                    }) =>
            {
                (
                    Step::RowCompute {
                        op: instr.op.clone(),
                        args: args.clone(),
                    },
                    Class::Full,
                )
            }
            Op::Unary { .. }
            | Op::Binary { .. }
            | Op::Compare { .. }
            | Op::Select
            | Op::Cast { .. }
                if own != Class::Scalar
                    && args.iter().all(|&a| {
                        readable(a) && (class[a] == own || matches!(steps[a], Step::Scalar(_)))
                    })
                    && operand_kinds_fit(&instr.op, args, types) =>
            {
                (
                    Step::Compute {
                        op: instr.op.clone(),
                        args: args.clone(),
                    },
                    own,
                )
            }
            _ => return None,
        };
        class.push(cls);
        steps.push(step);
    }
    // Column reductions are results only; every result has a tile form.
    if body
        .instrs
        .iter()
        .any(|instr| instr.operands.iter().any(|&a| class[a] == Class::Col))
    {
        return None;
    }
    let result_ok = |r: usize| {
        r >= np
            && !types[r].dtype.is_int()
            && (matches!(class[r], Class::Full | Class::Row | Class::Col)
                || matches!(steps[r], Step::Scalar(_)) && elems(r) == n)
    };
    if !body.results.iter().all(|&r| result_ok(r)) {
        return None;
    }
    let tile = unit * (TILE / unit).max(1);
    // Consumers come after what they read, so one backward pass settles `full`.
    let mut full = vec![false; steps.len()];
    for &r in &body.results {
        full[r] = true;
    }
    for v in (0..steps.len()).rev() {
        match &steps[v] {
            Step::Compute { args, .. } => args.iter().for_each(|&a| full[a] = true),
            Step::RowReduce { src, .. } | Step::ColReduce { src, .. } => full[*src] = true,
            Step::Alias(src) if full[v] => full[*src] = true,
            _ => {}
        }
    }
    Some(Tiled {
        steps,
        class,
        n,
        row,
        tile,
        pre,
        full,
    })
}

/// Whether a value's step makes it constant along rows: a row broadcast, or an element-wise
/// op on such values (see [`Step::RowCompute`]).
fn row_constant(step: &Step) -> bool {
    matches!(step, Step::RowBroadcast { .. } | Step::RowCompute { .. })
}

/// The length of the runs of a broadcast to `dims` read at offsets `view` whose elements are
/// consecutive in the source (the trailing dims whose offsets are those of a dense layout),
/// or 0 when the last dim is not read with stride 1.
fn contiguous_block(dims: &[usize], view: &[usize]) -> usize {
    let mut block = 1;
    for (&d, &stride) in dims.iter().zip(view).rev() {
        if d == 1 {
            continue;
        }
        if stride != block {
            break;
        }
        block *= d;
    }
    if block == 1 { 0 } else { block }
}

/// Where the tile `[at, at + len)` of a broadcast starts in its source, when the whole tile
/// lies inside one run of `block` consecutive source elements.
fn broadcast_view(
    dims: &[usize],
    view: &[usize],
    block: usize,
    at: usize,
    len: usize,
) -> Option<usize> {
    if block == 0 || at % block + len > block {
        return None;
    }
    let mut rem = at;
    let mut off = 0;
    for (&d, &stride) in dims.iter().zip(view).rev() {
        off += (rem % d) * stride;
        rem /= d;
    }
    Some(off)
}

/// True when the tiled loops handle the operand dtypes of `op`: floats for arithmetic,
/// floats or integers (not mixed) for comparisons, a bool condition and float or bool
/// branches for select, floats, bools or integers for casts to float or bool.
fn operand_kinds_fit(op: &Op, operands: &[usize], types: &[TensorType]) -> bool {
    let float = |v: &usize| types[*v].dtype.is_float();
    let int = |v: &usize| types[*v].dtype.is_int();
    let fb = |v: &usize| types[*v].dtype.is_float() || types[*v].dtype == DType::Bool;
    match op {
        Op::Unary { .. } | Op::Binary { .. } => operands.iter().all(float),
        Op::Compare { .. } => operands.iter().all(float) || operands.iter().all(int),
        Op::Select => {
            operands
                .first()
                .is_some_and(|c| types[*c].dtype == DType::Bool)
                && operands[1..].iter().all(fb)
        }
        Op::Cast { to } => (to.is_float() || *to == DType::Bool) && !operands.is_empty(),
        _ => false,
    }
}

/// Runs a compiled fusion on its operands.
pub(crate) fn run(ctx: &Ctx, c: &Compiled, args: &[&Val]) -> Result<Vec<Val>, RuntimeError> {
    match &c.tiled {
        Some(t) => run_tiled(ctx, c, t, args),
        None => run_stepwise(ctx, c, args),
    }
}

/// Instruction by instruction on the fast kernels.
fn run_stepwise(ctx: &Ctx, c: &Compiled, args: &[&Val]) -> Result<Vec<Val>, RuntimeError> {
    let np = c.body.params.len();
    // The squares that a fused square-sum reads directly (never computed).
    let skipped: Vec<usize> = c
        .body
        .instrs
        .iter()
        .zip(&c.square_sums)
        .filter_map(|(instr, s)| s.and(instr.operands.first().copied()))
        .collect();
    let mut values: Vec<Val> = args.iter().map(|&a| a.clone()).collect();
    for (i, instr) in c.body.instrs.iter().enumerate() {
        let out = std::slice::from_ref(&c.types[np + i]);
        if skipped.contains(&(np + i)) {
            // Never read: its only use is the fused square-sum.
            values.push(Val::Splat(out[0].clone(), f64::NAN));
            continue;
        }
        if let Some(x) = c.square_sums[i] {
            let x = ctx.dense(&values[x]);
            let Elems::F32(v) = x.elems() else {
                return Err(RuntimeError::NotAKernel { op: "fusion" });
            };
            let sum = vectorized(
                #[inline(always)]
                || sum64_of(v, |a| f64::from(a * a)),
            );
            let mut o = ctx.f32s(1);
            o[0] = sum as f32;
            values.push(Val::Dense(ctx.float(&out[0], o)));
            continue;
        }
        let operands: Vec<&Val> = instr.operands.iter().map(|&v| &values[v]).collect();
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
    Int(&'a [i64]),
    Scalar(f64),
}

/// Per-task tile buffers, one per body value (only computed and broadcast ones are used),
/// the task's column accumulators, and its shares of the results: a result computed by an
/// instruction or a row reduction (and yielded once) is written straight into its share
/// (`placed`), and read back from there by later instructions of the tile.
struct Scratch<'o> {
    f32s: Vec<Vec<f32>>,
    bools: Vec<Vec<bool>>,
    ints: Vec<Vec<i64>>,
    cols: Vec<Vec<f64>>,
    /// Per-row values of [`Step::RowCompute`] steps, one per row of the tile.
    rows: Vec<Vec<f32>>,
    /// The task's share of each result.
    slots: Vec<TaskSlot<'o>>,
    /// Per body value, the result slot it is computed in, if any.
    placed: Vec<Option<usize>>,
    /// The task's first element and first row.
    start: usize,
    start_row: usize,
}

impl Scratch<'_> {
    /// Where value `v`'s tile lies in its slot: `(offset, length)` within the task's share.
    fn placement(&self, t: &Tiled, v: usize, span: Span) -> (usize, usize) {
        match t.class[v] {
            Class::Row => (span.row_at - self.start_row, span.rows),
            _ => (span.at - self.start, span.len),
        }
    }
}

/// Where a tile lies: its first element and row, and its lengths.
#[derive(Clone, Copy)]
struct Span {
    at: usize,
    len: usize,
    row_at: usize,
    rows: usize,
}

impl Span {
    /// The start and length of the tile for a value of class `c`.
    fn of(self, c: Class) -> (usize, usize) {
        match c {
            Class::Row => (self.row_at, self.rows),
            _ => (self.at, self.len),
        }
    }
}

/// A result buffer being written.
enum OutBuf {
    F32(Vec<f32>),
    Bool(Vec<bool>),
}

/// One task's share of a result: a slice of a full or per-row result, or nothing (column
/// reductions and scalars are assembled after the tasks).
enum TaskSlot<'a> {
    F32(&'a mut [f32]),
    Bool(&'a mut [bool]),
    None,
}

/// Over tiles of the iteration space, every result written tile by tile.
fn run_tiled(ctx: &Ctx, c: &Compiled, t: &Tiled, args: &[&Val]) -> Result<Vec<Val>, RuntimeError> {
    let np = c.body.params.len();
    let results = &c.body.results;
    let n = t.n;
    // Operands dense (a splat operand is written out once: they are rare in bodies), then
    // the small values computed before the tiles.
    let mut operands: Vec<FastTensor> = args.iter().map(|a| ctx.dense(a)).collect();
    if operands.len() != np {
        return Err(RuntimeError::NotAKernel { op: "fusion" });
    }
    operands.extend(precompute(ctx, c, t, args)?);
    let size_of = |r: usize| match t.class[r] {
        Class::Row => n / t.row,
        Class::Col => 0,
        _ => n,
    };
    let mut outs: Vec<OutBuf> = results
        .iter()
        .map(|&r| {
            if c.types[r].dtype == DType::Bool {
                OutBuf::Bool(ctx.bools(size_of(r)))
            } else {
                OutBuf::F32(ctx.f32s(size_of(r)))
            }
        })
        .collect();
    // Results computed in their slots: instructions and row reductions yielded once, into a
    // slot of their element kind.
    let mut placed = vec![None; t.steps.len()];
    for (i, &r) in results.iter().enumerate() {
        let once = results.iter().filter(|&&x| x == r).count() == 1;
        let computed = matches!(t.steps[r], Step::Compute { .. } | Step::RowReduce { .. });
        if once && computed && matches!(t.class[r], Class::Full | Class::Row) {
            placed[r] = Some(i);
        }
    }
    let chunk = t.tile * TILES_PER_TASK;
    let tasks = n.div_ceil(chunk);
    let mut per: Vec<Vec<TaskSlot>> = (0..tasks).map(|_| Vec::new()).collect();
    for (o, &r) in outs.iter_mut().zip(results) {
        let cls = t.class[r];
        let step = if cls == Class::Row {
            chunk / t.row
        } else {
            chunk
        };
        let full_like = matches!(cls, Class::Full | Class::Row | Class::Scalar);
        match o {
            OutBuf::F32(v) if full_like => {
                for (p, s) in per.iter_mut().zip(v.chunks_mut(step)) {
                    p.push(TaskSlot::F32(s));
                }
            }
            OutBuf::Bool(v) if full_like => {
                for (p, s) in per.iter_mut().zip(v.chunks_mut(step)) {
                    p.push(TaskSlot::Bool(s));
                }
            }
            _ => per.iter_mut().for_each(|p| p.push(TaskSlot::None)),
        }
    }
    let col_values: Vec<usize> = (0..t.steps.len())
        .filter(|&v| t.class[v] == Class::Col)
        .collect();
    let task = |(k, mut slots): (usize, Vec<TaskSlot>)| {
        let serial = Ctx {
            pool: ctx.pool,
            threads: 1,
            wide: ctx.wide,
            workers: None,
        };
        let start = k * chunk;
        let end = (start + chunk).min(n);
        let mut scratch = Scratch {
            f32s: vec![Vec::new(); t.steps.len()],
            bools: vec![Vec::new(); t.steps.len()],
            ints: vec![Vec::new(); t.steps.len()],
            cols: vec![Vec::new(); t.steps.len()],
            rows: vec![Vec::new(); t.steps.len()],
            slots: std::mem::take(&mut slots),
            placed: placed.clone(),
            start,
            start_row: start / t.row,
        };
        for &v in &col_values {
            if let Step::ColReduce { func, .. } = &t.steps[v] {
                let init = match func {
                    ReduceOp::Max => f64::NEG_INFINITY,
                    ReduceOp::Min => f64::INFINITY,
                    ReduceOp::Sum | ReduceOp::Mean => 0.0,
                };
                scratch.cols[v] = vec![init; c.types[v].num_elements() as usize];
            }
        }
        let mut at = start;
        while at < end {
            let len = t.tile.min(end - at);
            let span = Span {
                at,
                len,
                row_at: at / t.row,
                rows: len / t.row,
            };
            run_tile(&serial, c, t, &operands, span, &mut scratch)?;
            for (i, &r) in results.iter().enumerate() {
                if scratch.placed[r] == Some(i) {
                    continue;
                }
                let (dst, l) = scratch.placement(t, r, span);
                let mut slot = std::mem::replace(&mut scratch.slots[i], TaskSlot::None);
                let value = tile_val(c, t, &operands, &scratch, r, span);
                match (&mut slot, value) {
                    (TaskSlot::F32(o), TileVal::F32(v)) => o[dst..dst + l].copy_from_slice(v),
                    (TaskSlot::Bool(o), TileVal::Bool(v)) => o[dst..dst + l].copy_from_slice(v),
                    (TaskSlot::F32(o), TileVal::Scalar(x)) => o[dst..dst + l].fill(x as f32),
                    (TaskSlot::Bool(o), TileVal::Scalar(x)) => o[dst..dst + l].fill(x != 0.0),
                    (TaskSlot::None, _) => {}
                    _ => return Err(RuntimeError::NotAKernel { op: "fusion" }),
                }
                scratch.slots[i] = slot;
            }
            at += len;
        }
        Ok::<Vec<Vec<f64>>, RuntimeError>(std::mem::take(&mut scratch.cols))
    };
    let partials: Vec<Vec<Vec<f64>>> = if ctx.threads > 1 && tasks > 1 {
        ctx.install(|| {
            per.into_par_iter()
                .enumerate()
                .map(task)
                .collect::<Result<_, _>>()
        })?
    } else {
        per.into_iter()
            .enumerate()
            .map(task)
            .collect::<Result<_, _>>()?
    };
    let mut values = Vec::with_capacity(results.len());
    for (o, &r) in outs.into_iter().zip(results) {
        let ty = &c.types[r];
        let v = match (t.class[r], o) {
            (Class::Col, _) => {
                let Step::ColReduce { func, count, .. } = &t.steps[r] else {
                    return Err(RuntimeError::NotAKernel { op: "fusion" });
                };
                Elems::F32(combine_cols(ctx, *func, *count, &partials, r))
            }
            (_, OutBuf::F32(v)) => Elems::F32(v),
            (_, OutBuf::Bool(v)) => Elems::Bool(v),
        };
        values.push(Val::Dense(ctx.of_elems(ty, v)));
    }
    Ok(values)
}

/// The small values of a tiled body, evaluated in body order on the fast kernels (their
/// operands are operands of the fusion, earlier small values or scalars).
fn precompute(
    ctx: &Ctx,
    c: &Compiled,
    t: &Tiled,
    args: &[&Val],
) -> Result<Vec<FastTensor>, RuntimeError> {
    let np = c.body.params.len();
    let mut done: Vec<(usize, Val)> = Vec::with_capacity(t.pre.len());
    for &v in &t.pre {
        let instr = &c.body.instrs[v - np];
        let mut vals = Vec::with_capacity(instr.operands.len());
        for &a in &instr.operands {
            let val = if a < np {
                args[a].clone()
            } else if let Some((_, x)) = done.iter().find(|(p, _)| *p == a) {
                x.clone()
            } else if let Step::Scalar(x) = t.steps[a] {
                Val::Splat(c.types[a].clone(), x)
            } else {
                return Err(RuntimeError::NotAKernel { op: "fusion" });
            };
            vals.push(val);
        }
        let refs: Vec<&Val> = vals.iter().collect();
        let mut r = eval(
            ctx,
            &instr.op,
            &refs,
            std::slice::from_ref(&c.types[v]),
            None,
        )?;
        if r.len() != 1 {
            return Err(RuntimeError::NotAKernel {
                op: instr.op.name(),
            });
        }
        done.push((v, r.swap_remove(0)));
    }
    Ok(done.iter().map(|(_, x)| ctx.dense(x)).collect())
}

/// The column reduction `v` from every task's partial accumulators, added in task order.
fn combine_cols(
    ctx: &Ctx,
    func: ReduceOp,
    count: usize,
    partials: &[Vec<Vec<f64>>],
    v: usize,
) -> Vec<f32> {
    let len = partials.first().map_or(0, |p| p[v].len());
    let mut acc = partials.first().map(|p| p[v].clone()).unwrap_or_default();
    for p in partials.iter().skip(1) {
        for (a, &x) in acc.iter_mut().zip(&p[v]) {
            *a = match func {
                ReduceOp::Sum | ReduceOp::Mean => *a + x,
                ReduceOp::Max => nan_max64(*a, x),
                ReduceOp::Min => nan_min64(*a, x),
            };
        }
    }
    let mut out = ctx.f32s(len);
    for (o, &a) in out.iter_mut().zip(&acc) {
        *o = if func == ReduceOp::Mean {
            (a / count as f64) as f32
        } else {
            a as f32
        };
    }
    out
}

#[inline(always)]
fn nan_max64(a: f64, b: f64) -> f64 {
    if a.is_nan() || a >= b { a } else { b }
}

#[inline(always)]
fn nan_min64(a: f64, b: f64) -> f64 {
    if a.is_nan() || a <= b { a } else { b }
}

/// Body value `v` in the tile `span`.
fn tile_val<'a>(
    c: &Compiled,
    t: &Tiled,
    operands: &'a [FastTensor],
    scratch: &'a Scratch,
    v: usize,
    span: Span,
) -> TileVal<'a> {
    let (at, len) = span.of(t.class[v]);
    if let Some(k) = scratch.placed[v] {
        let (off, len) = scratch.placement(t, v, span);
        return match &scratch.slots[k] {
            TaskSlot::F32(o) => TileVal::F32(&o[off..off + len]),
            TaskSlot::Bool(o) => TileVal::Bool(&o[off..off + len]),
            TaskSlot::None => TileVal::Scalar(f64::NAN),
        };
    }
    match &t.steps[v] {
        Step::Operand(i) => match operands[*i].elems() {
            Elems::F32(x) => TileVal::F32(&x[at..at + len]),
            Elems::Bool(x) => TileVal::Bool(&x[at..at + len]),
            Elems::Int(x) => TileVal::Int(&x[at..at + len]),
        },
        Step::Scalar(x) => TileVal::Scalar(*x),
        Step::Alias(src) => tile_val(c, t, operands, scratch, *src, span),
        Step::Small | Step::Pre | Step::ColReduce { .. } => TileVal::Scalar(f64::NAN),
        Step::Broadcast { src, view, block } => {
            match broadcast_view(c.types[v].dims(), view, *block, at, len) {
                Some(off) => match operands[*src].elems() {
                    Elems::F32(x) => TileVal::F32(&x[off..off + len]),
                    Elems::Bool(x) => TileVal::Bool(&x[off..off + len]),
                    Elems::Int(x) => TileVal::Int(&x[off..off + len]),
                },
                None => match c.types[v].dtype {
                    DType::Bool => TileVal::Bool(&scratch.bools[v][..len]),
                    DType::I32 | DType::I64 => TileVal::Int(&scratch.ints[v][..len]),
                    _ => TileVal::F32(&scratch.f32s[v][..len]),
                },
            }
        }
        Step::RowBroadcast { .. }
        | Step::RowCompute { .. }
        | Step::Compute { .. }
        | Step::RowReduce { .. } => match c.types[v].dtype {
            DType::Bool => TileVal::Bool(&scratch.bools[v][..len]),
            DType::I32 | DType::I64 => TileVal::Int(&scratch.ints[v][..len]),
            _ => TileVal::F32(&scratch.f32s[v][..len]),
        },
    }
}

/// Where one instruction of a tile writes: its result slot (taken out of the scratch while
/// it is written, so that the operands can be read from the scratch meanwhile) or its tile
/// buffers.
enum Out<'o> {
    Placed {
        slot: usize,
        taken: TaskSlot<'o>,
        off: usize,
    },
    Buffers {
        f32s: Vec<f32>,
        bools: Vec<bool>,
    },
}

impl<'o> Out<'o> {
    fn take(scratch: &mut Scratch<'o>, t: &Tiled, v: usize, span: Span) -> Out<'o> {
        match scratch.placed[v] {
            Some(slot) => Out::Placed {
                slot,
                taken: std::mem::replace(&mut scratch.slots[slot], TaskSlot::None),
                off: scratch.placement(t, v, span).0,
            },
            None => Out::Buffers {
                f32s: std::mem::take(&mut scratch.f32s[v]),
                bools: std::mem::take(&mut scratch.bools[v]),
            },
        }
    }

    /// The `len` floats to write (`None`: the slot holds bools).
    fn f32s(&mut self, len: usize) -> Option<&mut [f32]> {
        match self {
            Out::Placed {
                taken: TaskSlot::F32(o),
                off,
                ..
            } => Some(&mut o[*off..*off + len]),
            Out::Placed { .. } => None,
            Out::Buffers { f32s, .. } => {
                f32s.resize(len, 0.0);
                Some(f32s)
            }
        }
    }

    /// The `len` bools to write (`None`: the slot holds floats).
    fn bools(&mut self, len: usize) -> Option<&mut [bool]> {
        match self {
            Out::Placed {
                taken: TaskSlot::Bool(o),
                off,
                ..
            } => Some(&mut o[*off..*off + len]),
            Out::Placed { .. } => None,
            Out::Buffers { bools, .. } => {
                bools.resize(len, false);
                Some(bools)
            }
        }
    }

    fn put_back(self, scratch: &mut Scratch<'o>, v: usize) {
        match self {
            Out::Placed { slot, taken, .. } => scratch.slots[slot] = taken,
            Out::Buffers { f32s, bools } => {
                scratch.f32s[v] = f32s;
                scratch.bools[v] = bools;
            }
        }
    }
}

/// Computes every broadcast, instruction and reduction of one tile into `scratch`.
fn run_tile(
    serial: &Ctx,
    c: &Compiled,
    t: &Tiled,
    operands: &[FastTensor],
    span: Span,
    scratch: &mut Scratch,
) -> Result<(), RuntimeError> {
    for v in 0..t.steps.len() {
        let ty = &c.types[v];
        let (_, len) = span.of(t.class[v]);
        match &t.steps[v] {
            Step::Operand(_) | Step::Small | Step::Pre | Step::Scalar(_) | Step::Alias(_) => {}
            Step::Broadcast { src, view, block } => {
                let dims = ty.dims();
                if broadcast_view(dims, view, *block, span.at, len).is_some() {
                    // Read in place (see `tile_val`).
                    continue;
                }
                match operands[*src].elems() {
                    Elems::F32(x) => {
                        let buf = &mut scratch.f32s[v];
                        buf.resize(len, 0.0);
                        gather_view(x, dims, view, span.at, buf);
                    }
                    Elems::Bool(x) => {
                        let buf = &mut scratch.bools[v];
                        buf.resize(len, false);
                        gather_view(x, dims, view, span.at, buf);
                    }
                    Elems::Int(x) => {
                        let buf = &mut scratch.ints[v];
                        buf.resize(len, 0);
                        gather_view(x, dims, view, span.at, buf);
                    }
                }
            }
            Step::RowBroadcast { .. } if !t.full[v] => {}
            Step::RowCompute { op, args } => {
                let mut per_row = std::mem::take(&mut scratch.rows[v]);
                per_row.resize(span.rows, 0.0);
                // Unary and binary ops only (see `tile_plan`).
                let mut vals = [TileVal::Scalar(0.0); 2];
                if args.len() > vals.len() {
                    return Err(RuntimeError::NotAKernel { op: op.name() });
                }
                for (slot, &a) in vals.iter_mut().zip(args) {
                    *slot = match &t.steps[a] {
                        Step::RowBroadcast { src } => tile_val(c, t, operands, scratch, *src, span),
                        Step::RowCompute { .. } => TileVal::F32(&scratch.rows[a][..span.rows]),
                        _ => tile_val(c, t, operands, scratch, a, span),
                    };
                }
                compute_floats(serial, op, &vals[..args.len()], &mut per_row, ty.dtype)?;
                round_slice(ty.dtype, &mut per_row);
                if t.full[v] {
                    let mut fbuf = std::mem::take(&mut scratch.f32s[v]);
                    fbuf.resize(len, 0.0);
                    repeat_rows(&per_row, t.row, &mut fbuf);
                    scratch.f32s[v] = fbuf;
                }
                scratch.rows[v] = per_row;
            }
            Step::RowBroadcast { src } => {
                let row = t.row;
                let mut fbuf = std::mem::take(&mut scratch.f32s[v]);
                let mut bbuf = std::mem::take(&mut scratch.bools[v]);
                match tile_val(c, t, operands, scratch, *src, span) {
                    TileVal::F32(r) => {
                        fbuf.resize(len, 0.0);
                        repeat_rows(r, row, &mut fbuf);
                    }
                    TileVal::Bool(r) => {
                        bbuf.resize(len, false);
                        for (o, &x) in bbuf.chunks_exact_mut(row).zip(r) {
                            o.fill(x);
                        }
                    }
                    _ => return Err(RuntimeError::NotAKernel { op: "fusion" }),
                }
                scratch.f32s[v] = fbuf;
                scratch.bools[v] = bbuf;
            }
            Step::RowReduce { func, src } => {
                let mut out = Out::take(scratch, t, v, span);
                let TileVal::F32(x) = tile_val(c, t, operands, scratch, *src, span) else {
                    return Err(RuntimeError::NotAKernel { op: "fusion" });
                };
                let Some(buf) = out.f32s(len) else {
                    return Err(RuntimeError::NotAKernel { op: "fusion" });
                };
                reduce_rows(serial, *func, x, t.row, buf);
                round_slice(ty.dtype, buf);
                out.put_back(scratch, v);
            }
            Step::ColReduce { func, src, .. } => {
                let mut acc = std::mem::take(&mut scratch.cols[v]);
                let TileVal::F32(x) = tile_val(c, t, operands, scratch, *src, span) else {
                    return Err(RuntimeError::NotAKernel { op: "fusion" });
                };
                accumulate_cols(*func, x, &mut acc);
                scratch.cols[v] = acc;
            }
            Step::Compute { op, args } => {
                let mut out = Out::take(scratch, t, v, span);
                // Element-wise ops have at most three operands.
                let mut vals = [TileVal::Scalar(0.0); 3];
                if args.len() > vals.len() {
                    return Err(RuntimeError::NotAKernel { op: op.name() });
                }
                for (slot, &a) in vals.iter_mut().zip(args) {
                    *slot = tile_val(c, t, operands, scratch, a, span);
                }
                let vals = &vals[..args.len()];
                if ty.dtype == DType::Bool {
                    let Some(buf) = out.bools(len) else {
                        return Err(RuntimeError::NotAKernel { op: "fusion" });
                    };
                    compute_bools(op, vals, buf, ty.dtype)?;
                } else {
                    let Some(buf) = out.f32s(len) else {
                        return Err(RuntimeError::NotAKernel { op: "fusion" });
                    };
                    compute_floats(serial, op, vals, buf, ty.dtype)?;
                    round_slice(ty.dtype, buf);
                }
                out.put_back(scratch, v);
            }
        }
    }
    Ok(())
}

/// Each of `per_row` repeated over its row of `row` elements of `out`.
fn repeat_rows(per_row: &[f32], row: usize, out: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || {
            for (o, &x) in out.chunks_exact_mut(row).zip(per_row) {
                o.fill(x);
            }
        },
    );
}

/// Adds (or takes the max or min of) each run of `acc.len()` elements of `x` into `acc`; the
/// tile starts at a multiple of that length and holds whole runs. The kind of reduction is
/// chosen once, outside the loops: matched per element, it kept the loop scalar.
fn accumulate_cols(func: ReduceOp, x: &[f32], acc: &mut [f64]) {
    #[inline(always)]
    fn each(x: &[f32], acc: &mut [f64], f: impl Fn(f64, f64) -> f64) {
        let w = acc.len();
        vectorized(
            #[inline(always)]
            || {
                for r in x.chunks_exact(w) {
                    for (a, &b) in acc.iter_mut().zip(r) {
                        *a = f(*a, f64::from(b));
                    }
                }
            },
        );
    }
    if acc.is_empty() {
        return;
    }
    match func {
        ReduceOp::Sum | ReduceOp::Mean => each(
            x,
            acc,
            #[inline(always)]
            |a, b| a + b,
        ),
        ReduceOp::Max => each(x, acc, nan_max64),
        ReduceOp::Min => each(x, acc, nan_min64),
    }
}

fn side<'a>(t: TileVal<'a>) -> Option<Side<'a>> {
    match t {
        TileVal::F32(s) => Some(Side::Slice(s)),
        TileVal::Scalar(x) => Some(Side::Scalar(x as f32)),
        TileVal::Bool(_) | TileVal::Int(_) => None,
    }
}

/// Element `i` of a tile value read as a bool.
fn as_bool(t: TileVal, i: usize) -> bool {
    match t {
        TileVal::Bool(s) => s[i],
        TileVal::Scalar(x) => x != 0.0,
        TileVal::F32(s) => s[i] != 0.0,
        TileVal::Int(s) => s[i] != 0,
    }
}

/// Element `i` of a tile value read as a float.
fn as_f32(t: TileVal, i: usize) -> f32 {
    match t {
        TileVal::F32(s) => s[i],
        TileVal::Scalar(x) => x as f32,
        TileVal::Bool(s) => f32::from(u8::from(s[i])),
        // Through f64, as the reference converts integers (one rounding below 2^53).
        TileVal::Int(s) => s[i] as f64 as f32,
    }
}

/// Element `i` of an integer tile value (scalars are integers already).
fn as_i64(t: TileVal, i: usize) -> i64 {
    match t {
        TileVal::Int(s) => s[i],
        TileVal::Scalar(x) => x as i64,
        TileVal::F32(s) => s[i] as i64,
        TileVal::Bool(s) => i64::from(s[i]),
    }
}

/// `buf[i] = f(a[i], b[i])` on integer tile values (either may be a scalar).
#[inline(always)]
fn compare_ints(a: TileVal, b: TileVal, buf: &mut [bool], f: impl Fn(i64, i64) -> bool) {
    vectorized(
        #[inline(always)]
        || match (a, b) {
            (TileVal::Int(p), TileVal::Int(q)) => {
                for ((o, &p), &q) in buf.iter_mut().zip(p).zip(q) {
                    *o = f(p, q);
                }
            }
            (TileVal::Int(p), q) => {
                let q = as_i64(q, 0);
                for (o, &p) in buf.iter_mut().zip(p) {
                    *o = f(p, q);
                }
            }
            (p, TileVal::Int(q)) => {
                let p = as_i64(p, 0);
                for (o, &q) in buf.iter_mut().zip(q) {
                    *o = f(p, q);
                }
            }
            (p, q) => {
                for (i, o) in buf.iter_mut().enumerate() {
                    *o = f(as_i64(p, i), as_i64(q, i));
                }
            }
        },
    );
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
            _ if vals.iter().any(|v| matches!(v, TileVal::Int(_))) => {
                use autopar_ir::CompareOp as C;
                let (a, b) = (vals[0], vals[1]);
                match func {
                    C::Eq => compare_ints(a, b, buf, |p, q| p == q),
                    C::Ne => compare_ints(a, b, buf, |p, q| p != q),
                    C::Lt => compare_ints(a, b, buf, |p, q| p < q),
                    C::Le => compare_ints(a, b, buf, |p, q| p <= q),
                    C::Gt => compare_ints(a, b, buf, |p, q| p > q),
                    C::Ge => compare_ints(a, b, buf, |p, q| p >= q),
                }
            }
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
            TileVal::Bool(_) | TileVal::Int(_) => return Err(bad()),
        },
        Op::Binary { func } => match (side(vals[0]), side(vals[1])) {
            (Some(a), Some(b)) => binary_f32(serial, *func, a, b, buf),
            _ => return Err(bad()),
        },
        Op::Select => match (vals[0], side(vals[1]), side(vals[2])) {
            (TileVal::Bool(c), Some(Side::Slice(a)), Some(Side::Slice(b))) => vectorized(
                #[inline(always)]
                || {
                    for (((o, &c), &p), &q) in buf.iter_mut().zip(c).zip(a).zip(b) {
                        *o = blend(c, p, q);
                    }
                },
            ),
            (TileVal::Bool(c), Some(Side::Scalar(p)), Some(Side::Slice(b))) => vectorized(
                #[inline(always)]
                || {
                    for ((o, &c), &q) in buf.iter_mut().zip(c).zip(b) {
                        *o = blend(c, p, q);
                    }
                },
            ),
            (TileVal::Bool(c), Some(Side::Slice(a)), Some(Side::Scalar(q))) => vectorized(
                #[inline(always)]
                || {
                    for ((o, &c), &p) in buf.iter_mut().zip(c).zip(a) {
                        *o = blend(c, p, q);
                    }
                },
            ),
            (TileVal::Bool(c), Some(Side::Scalar(p)), Some(Side::Scalar(q))) => vectorized(
                #[inline(always)]
                || {
                    for (o, &c) in buf.iter_mut().zip(c) {
                        *o = blend(c, p, q);
                    }
                },
            ),
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
        Op::Cast { .. } => match vals[0] {
            TileVal::Bool(s) => vectorized(
                #[inline(always)]
                || {
                    for (o, &b) in buf.iter_mut().zip(s) {
                        *o = f32::from(u8::from(b));
                    }
                },
            ),
            v => {
                for (i, o) in buf.iter_mut().enumerate() {
                    *o = as_f32(v, i);
                }
            }
        },
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
    // The multi-index of `at`, then an odometer; runs along the last dim are copied (stride
    // 1) or filled (stride 0) whole.
    let mut index = vec![0usize; rank];
    let mut rem = at;
    let mut off = 0;
    for d in (0..rank).rev() {
        index[d] = rem % dims[d];
        rem /= dims[d];
        off += index[d] * view[d];
    }
    let last = rank - 1;
    let (inner, step) = (dims[last], view[last]);
    let mut i = 0;
    while i < dst.len() {
        let run = (inner - index[last]).min(dst.len() - i);
        match step {
            0 => dst[i..i + run].fill(src[off]),
            1 => dst[i..i + run].copy_from_slice(&src[off..off + run]),
            _ => {
                for (j, o) in dst[i..i + run].iter_mut().enumerate() {
                    *o = src[off + j * step];
                }
            }
        }
        i += run;
        off += run * step;
        index[last] += run;
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
        let reduced = body(vec![(sum, vec![0]), (add.clone(), vec![1, 2])], vec![3]);
        assert!(!Compiled::new(&reduced)?.is_tiled());
        // A body that returns an operand as it is has nothing to tile.
        assert!(!Compiled::new(&body(vec![(bcast.clone(), vec![1])], vec![0]))?.is_tiled());
        // A column sum as a result tiles; rows reduced and broadcast back tile.
        let col = Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![0],
        };
        assert!(Compiled::new(&body(vec![(col, vec![0])], vec![2]))?.is_tiled());
        let rowsum = Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![1],
        };
        let back = Op::Broadcast {
            shape: Shape::new(vec![4, 6]),
            dims: vec![0],
        };
        let norm = body(
            vec![
                (rowsum, vec![0]),
                (back, vec![2]),
                (add.clone(), vec![0, 3]),
            ],
            vec![4, 2],
        );
        assert!(Compiled::new(&norm)?.is_tiled());
        // A reduction of middle dims does not.
        let mut three = body(vec![], vec![]);
        three.params = vec![TensorType::new(DType::F32, [2, 3, 4])];
        three.instrs = vec![FusedInstr {
            op: Op::Reduce {
                func: ReduceOp::Sum,
                dims: vec![1],
            },
            operands: vec![0],
        }];
        three.results = vec![1];
        assert!(!Compiled::new(&three)?.is_tiled());
        Ok(())
    }

    #[test]
    fn arithmetic_on_row_broadcasts_runs_per_row() -> Result<(), RuntimeError> {
        // `x * rsqrt(broadcast(mean(x)) + eps)` on `[4, 6]`: the sum and the rsqrt are
        // computed per row; only the rsqrt, which the full-size product reads, is written
        // out over its rows.
        let instr = |op, operands| FusedInstr { op, operands };
        let dims = [4, 6];
        let body = FusionBody {
            params: vec![TensorType::new(DType::F32, dims)],
            instrs: vec![
                instr(
                    Op::Reduce {
                        func: ReduceOp::Mean,
                        dims: vec![1],
                    },
                    vec![0],
                ),
                instr(
                    Op::Broadcast {
                        shape: Shape::new(dims.to_vec()),
                        dims: vec![0],
                    },
                    vec![1],
                ),
                instr(
                    Op::Constant {
                        ty: TensorType::new(DType::F32, dims),
                        value: 1e-5,
                    },
                    vec![],
                ),
                instr(
                    Op::Binary {
                        func: BinaryOp::Add,
                    },
                    vec![2, 3],
                ),
                instr(
                    Op::Unary {
                        func: autopar_ir::UnaryOp::Rsqrt,
                    },
                    vec![4],
                ),
                instr(
                    Op::Binary {
                        func: BinaryOp::Mul,
                    },
                    vec![0, 5],
                ),
            ],
            results: vec![6],
        };
        let c = Compiled::new(&body)?;
        let t = c.tiled.as_ref().expect("the body tiles");
        assert!(matches!(t.steps[2], Step::RowBroadcast { .. }));
        assert!(matches!(t.steps[4], Step::RowCompute { .. }));
        assert!(matches!(t.steps[5], Step::RowCompute { .. }));
        assert!(matches!(t.steps[6], Step::Compute { .. }));
        assert_eq!(
            [t.full[2], t.full[4], t.full[5], t.full[6]],
            [false, false, true, true]
        );
        Ok(())
    }

    #[test]
    fn small_values_from_operands_are_computed_before_the_tiles() -> Result<(), RuntimeError> {
        // A `[4, 4]` mask compared from a `[4]` operand, broadcast over `[2, 4, 4]` scores.
        let sq = [4, 4];
        let full = [2, 4, 4];
        let bcast = |shape: &[usize], dims: Vec<usize>| Op::Broadcast {
            shape: Shape::new(shape.to_vec()),
            dims,
        };
        let instr = |op, operands| FusedInstr { op, operands };
        let mask = FusionBody {
            params: vec![
                TensorType::new(DType::I64, [4]),
                TensorType::new(DType::F32, full),
            ],
            instrs: vec![
                instr(bcast(&sq, vec![1]), vec![0]),
                instr(bcast(&sq, vec![0]), vec![0]),
                instr(
                    Op::Compare {
                        func: autopar_ir::CompareOp::Gt,
                    },
                    vec![2, 3],
                ),
                instr(bcast(&full, vec![1, 2]), vec![4]),
                instr(
                    Op::Constant {
                        ty: TensorType::new(DType::F32, full),
                        value: f64::NEG_INFINITY,
                    },
                    vec![],
                ),
                instr(Op::Select, vec![5, 6, 1]),
            ],
            results: vec![7],
        };
        let c = Compiled::new(&mask)?;
        assert!(c.is_tiled());
        assert_eq!(c.tiled.as_ref().map(|t| t.pre.clone()), Some(vec![2, 3, 4]));
        // A small computed value as a result has no tile form: the body runs stepwise.
        let mut direct = mask.clone();
        direct.results = vec![4];
        assert!(!Compiled::new(&direct)?.is_tiled());
        Ok(())
    }

    #[test]
    fn sums_of_squares_fuse_only_when_the_square_has_no_other_use() -> Result<(), RuntimeError> {
        let square = Op::Unary {
            func: autopar_ir::UnaryOp::Square,
        };
        let sum = |dims: Vec<usize>| Op::Reduce {
            func: ReduceOp::Sum,
            dims,
        };
        // ^2 = square ^0; ^3 = sum ^2 over [0, 1]: fused. ^4 = square ^1; ^5 = sum ^4 over
        // [0] with ^4 also a result: not fused. ^6 = sum ^2 over [1]: a second use of ^2.
        let mut b = body(
            vec![
                (square.clone(), vec![0]),
                (sum(vec![0, 1]), vec![2]),
                (square.clone(), vec![1]),
                (sum(vec![0]), vec![4]),
            ],
            vec![3, 5, 4],
        );
        assert_eq!(
            Compiled::new(&b)?.square_sums,
            vec![None, Some(0), None, None]
        );
        b.instrs.push(FusedInstr {
            op: sum(vec![1]),
            operands: vec![2],
        });
        assert!(Compiled::new(&b)?.square_sums.iter().all(Option::is_none));
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
