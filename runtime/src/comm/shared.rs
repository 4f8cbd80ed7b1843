//! Shared-memory collectives of the `f32` path between the rank threads of one process: the
//! ranks of a group exchange through buffers they all see ([`GroupSlots`], one set per group,
//! kept for the life of the launch and reused from call to call) and meet at barriers
//! ([`World::barrier`]) that keep the mailbox's failure semantics: a barrier waits at most the
//! timeout, fails at once when any rank announces a failure or a member that has not arrived
//! has gone, and reports a member that called something else. A barrier wakes the members
//! waiting at it only when it completes, when a call disagrees with theirs, or at a failure or
//! exit notice, each group on its own condition variable.
//!
//! The gathers, the reduce-scatter, the all-to-all and the broadcast take two barriers.
//! Before the first, each member makes what the others need of its operand visible; at the
//! first, it checks its call against its ring predecessor's. Between the two it reads the
//! others' buffers (holding their read locks for the whole phase: nobody writes them then);
//! the second keeps a member from overwriting its buffer before everyone is done with it.
//!
//! An all-reduce moves no operand and takes one barrier ([`World::elect`]). Each member moves
//! its own buffer (the caller's `Vec`) into its slot of [`GroupSlots::buffers`] and enters.
//! The member whose arrival completes the barrier, and so is already running, leads: with
//! every buffer in its slot and every other member parked, it takes the write lock of every
//! slot once, reduces all the buffers in place ([`all_reduce_shared`]) and releases the
//! others ([`World::release`]), who take their buffers back; every member, on failure too,
//! gets its own allocation back. No lock is taken per element or block, and nobody waits on
//! a lock but a member that gives up while the leader works (until the leader is done).
//!
//! The reduction reads each element of each buffer from memory once and writes it back once,
//! the least an all-reduce of separate buffers can move (`2 n` times the operand over the
//! group, against `2` for one memcpy of it): 16 elements at a time, it folds that piece of
//! every buffer with the partial sums in registers and stores the result into every buffer
//! while the lines are still in cache. Large buffers are cut into consecutive ranges reduced
//! at once, one on the leader's thread and the others on the threads of the current rayon
//! pool, as many as the group has members at most (each member brings a thread, idle until it
//! is released). 64 MiB on 4 ranks moves 512 MiB, so at the memory bandwidth one memcpy
//! reaches it can run at a quarter of memcpy's speed at best; two cores drawing at once get a
//! little more (`benches/collectives.rs`).
//!
//! Reductions add in the ring algorithm's order (chunk `c` from member `c + 1` around to
//! member `c`), with partial sums in `f64` and one rounding at the end, so this path gives the
//! bits of the `Tensor` path and of MPI, and every member the same ones, whichever thread
//! reduced which range.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use autopar_ir::{DType, IrError, ReduceKind};

use super::blocks::chunk_bounds;
use super::mailbox::CallSignature;
use crate::error::RuntimeError;
use crate::fast::simd::vectorized;
use crate::tensor::{Precision, round_to_dtype};

/// What all the ranks of one launch share: failure and exit notices, the barrier state of
/// every group, and every group's buffers.
pub(crate) struct World {
    state: Mutex<WorldState>,
    slots: Mutex<HashMap<Arc<[usize]>, Arc<GroupSlots>>>,
}

struct WorldState {
    /// The first failure announced: originating rank and reason.
    failed: Option<(usize, String)>,
    /// Ranks whose communicators are gone.
    exited: Vec<bool>,
    groups: HashMap<Arc<[usize]>, GroupState>,
}

impl WorldState {
    /// Wakes every waiting member of every group (a failure or exit notice concerns all).
    fn wake_all(&self) {
        for group in self.groups.values() {
            group.wake.notify_all();
        }
    }
}

/// The barrier state of one group, by member position.
struct GroupState {
    /// How many barriers each member has entered.
    reached: Vec<u64>,
    /// The call each member made at its latest first barrier, with that barrier's number.
    calls: Vec<Option<(u64, Arc<CallSignature>)>>,
    /// Wakes the group's waiting members: at a barrier's completion, at a disagreement, and
    /// at any failure or exit notice.
    wake: Arc<Condvar>,
}

/// The buffers of one group, by member position: `inputs[m][p]` holds what member `m`
/// publishes for piece `p` (for the collectives that are not cut into pieces, `p = 0` holds
/// the whole operand); they grow to the largest call and keep their capacity, so a run
/// allocates nothing here after its first step. `buffers[m]` holds member `m`'s own buffer
/// during an all-reduce, and an empty `Vec` (no allocation) between two.
pub(crate) struct GroupSlots {
    pub(crate) inputs: Vec<Vec<RwLock<Vec<f32>>>>,
    pub(crate) buffers: Vec<RwLock<Vec<f32>>>,
}

/// A member's place in one barrier, for waiting and for error messages.
pub(crate) struct BarrierCall<'a> {
    pub op: &'static str,
    pub members: &'a Arc<[usize]>,
    pub pos: usize,
    /// The call to check against the predecessor's (at a collective's first barrier).
    pub call: Option<&'a Arc<CallSignature>>,
    pub timeout: Duration,
}

/// Locks `m`, whose data stay consistent even if a holder panicked (the run then fails by the
/// panicking rank's notice).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl World {
    /// The shared state of `n` ranks.
    pub(crate) fn new(n: usize) -> World {
        World {
            state: Mutex::new(WorldState {
                failed: None,
                exited: vec![false; n],
                groups: HashMap::new(),
            }),
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// Records that the run failed because of rank `origin` (the first notice wins), and
    /// wakes every waiting rank.
    pub(crate) fn fail(&self, origin: usize, reason: &str) {
        let mut st = lock(&self.state);
        if st.failed.is_none() {
            st.failed = Some((origin, reason.to_string()));
        }
        st.wake_all();
    }

    /// Records that `rank`'s communicator is gone, and wakes every waiting rank.
    pub(crate) fn exit(&self, rank: usize) {
        let mut st = lock(&self.state);
        if let Some(e) = st.exited.get_mut(rank) {
            *e = true;
        }
        st.wake_all();
    }

    /// The first failure announced in this launch (originating rank and reason), if any.
    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        lock(&self.state).failed.clone()
    }

    /// The buffers of the group `members` (made by its first caller).
    pub(crate) fn slots(&self, members: &Arc<[usize]>) -> Arc<GroupSlots> {
        let mut slots = lock(&self.slots);
        let n = members.len();
        Arc::clone(slots.entry(Arc::clone(members)).or_insert_with(|| {
            Arc::new(GroupSlots {
                inputs: (0..n)
                    .map(|_| (0..n).map(|_| RwLock::new(Vec::new())).collect())
                    .collect(),
                buffers: (0..n).map(|_| RwLock::new(Vec::new())).collect(),
            })
        }))
    }

    /// Enters the next barrier of the group and waits until every member has entered it.
    ///
    /// Fails with [`RuntimeError::CollectiveMismatch`] when the ring predecessor made another
    /// call, [`RuntimeError::PeerFailed`] when any rank announces a failure first,
    /// [`RuntimeError::PeerExited`] when a member that has not arrived is gone, and
    /// [`RuntimeError::CollectiveTimeout`] after the timeout.
    pub(crate) fn barrier(&self, b: &BarrierCall<'_>) -> Result<(), RuntimeError> {
        let mut st = lock(&self.state);
        let ticket = Self::enter(&mut st, b);
        let group = &st.groups[b.members];
        if Self::completes(group, ticket) || Self::disagrees(group, ticket, b.call) {
            group.wake.notify_all();
        }
        self.wait(st, b, ticket, ticket + 1)
    }

    /// Enters the next barrier of the group as the first of a collective that one member
    /// carries out for all (the `f32` all-reduce). The member whose arrival completes the
    /// barrier, with every call posted there equal to its own, leads: it returns at once
    /// (nobody else needs waking), does the work, and [`release`](Self::release)s the others.
    /// Every other member follows: it enters the next barrier too (the leader's release
    /// completes it) and waits there. A member that called something else is reported as by
    /// [`barrier`](Self::barrier), whose failures these are.
    pub(crate) fn elect(&self, b: &BarrierCall<'_>) -> Result<Role, RuntimeError> {
        let mut st = lock(&self.state);
        let ticket = Self::enter(&mut st, b);
        let group = st
            .groups
            .get_mut(b.members)
            .ok_or_else(|| Self::unknown_group(b))?;
        let disagrees = Self::disagrees(group, ticket, b.call);
        if Self::completes(group, ticket) && !disagrees {
            return Ok(Role::Leader);
        }
        group.reached[b.pos] = ticket + 2;
        if disagrees {
            group.wake.notify_all();
        }
        self.wait(st, b, ticket, ticket + 2)
            .map(|()| Role::Follower)
    }

    /// The leader's arrival at the barrier its followers wait at (see [`elect`](Self::elect)):
    /// it completes that barrier and wakes them, and does not wait itself.
    pub(crate) fn release(&self, members: &Arc<[usize]>, pos: usize) {
        let mut st = lock(&self.state);
        if let Some(group) = st.groups.get_mut(members) {
            group.reached[pos] += 1;
            group.wake.notify_all();
        }
    }

    /// Records a member's arrival at its group's next barrier (with its call, at a
    /// collective's first); returns the barrier's number.
    fn enter(st: &mut WorldState, b: &BarrierCall<'_>) -> u64 {
        let n = b.members.len();
        let group = st
            .groups
            .entry(Arc::clone(b.members))
            .or_insert_with(|| GroupState {
                reached: vec![0; n],
                calls: vec![None; n],
                wake: Arc::new(Condvar::new()),
            });
        let ticket = group.reached[b.pos];
        group.reached[b.pos] = ticket + 1;
        if let Some(call) = b.call {
            group.calls[b.pos] = Some((ticket, Arc::clone(call)));
        }
        ticket
    }

    /// Whether every member has entered barrier `ticket`.
    fn completes(group: &GroupState, ticket: u64) -> bool {
        group.reached.iter().all(|&r| r > ticket)
    }

    /// Whether `call` differs from one posted at barrier `ticket`: the members waiting
    /// there must look again.
    fn disagrees(group: &GroupState, ticket: u64, call: Option<&Arc<CallSignature>>) -> bool {
        call.is_some_and(|ours| {
            group
                .calls
                .iter()
                .flatten()
                .any(|(t, theirs)| *t == ticket && **theirs != **ours)
        })
    }

    /// The error for a group that has no barrier state after a member entered (which
    /// [`enter`](Self::enter) rules out).
    fn unknown_group(b: &BarrierCall<'_>) -> RuntimeError {
        IrError::Verify(format!(
            "`{}`: group {:?} has no barrier state",
            b.op, b.members
        ))
        .into()
    }

    /// Waits, after entering barrier `ticket`, until every member of the group has entered
    /// barrier `until - 1`, checking the calls posted at `ticket` against `b.call` (see
    /// [`barrier`](Self::barrier) for the failures).
    fn wait(
        &self,
        mut st: MutexGuard<'_, WorldState>,
        b: &BarrierCall<'_>,
        ticket: u64,
        until: u64,
    ) -> Result<(), RuntimeError> {
        let n = b.members.len();
        let rank = b.members[b.pos];
        let prev = (b.pos + n - 1) % n;
        let deadline = Instant::now() + b.timeout;
        loop {
            let group = st
                .groups
                .get(b.members)
                .ok_or_else(|| Self::unknown_group(b))?;
            let posted = |m: usize| match &group.calls[m] {
                Some((t, theirs)) if *t == ticket => Some(theirs),
                _ => None,
            };
            let mut consistent = true;
            if let Some(ours) = b.call {
                if let Some(theirs) = posted(prev)
                    && **theirs != **ours
                {
                    return Err(RuntimeError::CollectiveMismatch {
                        op: b.op,
                        group: b.members.to_vec(),
                        rank,
                        peer: b.members[prev],
                        ours: ours.to_string(),
                        theirs: theirs.to_string(),
                    });
                }
                // A disagreement elsewhere in the ring is reported by the member that sees it
                // on its predecessor; this one waits for that notice.
                consistent = (0..n).all(|m| posted(m).is_none_or(|theirs| **theirs == **ours));
            }
            let missing = |m: &usize| group.reached[*m] < until;
            if consistent && !(0..n).any(|m| missing(&m)) {
                return Ok(());
            }
            if let Some((origin, reason)) = &st.failed {
                return Err(RuntimeError::PeerFailed {
                    op: b.op,
                    group: b.members.to_vec(),
                    rank,
                    failed_rank: *origin,
                    reason: reason.clone(),
                });
            }
            if let Some(m) = (0..n).filter(missing).find(|&m| st.exited[b.members[m]]) {
                return Err(RuntimeError::PeerExited {
                    op: b.op,
                    group: b.members.to_vec(),
                    rank,
                    peer: b.members[m],
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The predecessor, as the ring would name it, or else the first absent member.
                let peer = if missing(&prev) {
                    prev
                } else {
                    (0..n).find(missing).unwrap_or(prev)
                };
                return Err(RuntimeError::CollectiveTimeout {
                    op: b.op,
                    group: b.members.to_vec(),
                    rank,
                    peer: b.members[peer],
                    timeout: b.timeout,
                });
            }
            let wake = Arc::clone(&group.wake);
            st = wake
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A member's part in a collective that one member carries out for the group (see
/// [`World::elect`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// This member's arrival completed the barrier: it does the work, then releases the
    /// others.
    Leader,
    /// The leader has done the work and released this member.
    Follower,
}

/// How a reduced `f64` partial sum becomes the `f32` element the caller gets: rounded to the
/// declared dtype, or (keeping `f64`) only to `f32`.
#[derive(Clone, Copy)]
pub(crate) struct Rounding {
    pub dtype: DType,
    pub precision: Precision,
}

impl Rounding {
    /// Whether the result is just the `f32` nearest the partial sum.
    fn to_f32_only(self) -> bool {
        self.precision == Precision::F64 || self.dtype == DType::F32
    }
}

/// The ring's `f64` fold of `b` into the partial result `a` (the left operand): a NaN, once
/// met, stays. Generic over the kind so that each loop below is monomorphic and vectorises.
trait Combine: Copy {
    fn combine(a: f64, b: f64) -> f64;
}

#[derive(Clone, Copy)]
struct SumOf;
#[derive(Clone, Copy)]
struct MaxOf;
#[derive(Clone, Copy)]
struct MinOf;

impl Combine for SumOf {
    #[inline(always)]
    fn combine(a: f64, b: f64) -> f64 {
        a + b
    }
}

impl Combine for MaxOf {
    #[inline(always)]
    fn combine(a: f64, b: f64) -> f64 {
        if a.is_nan() || a >= b { a } else { b }
    }
}

impl Combine for MinOf {
    #[inline(always)]
    fn combine(a: f64, b: f64) -> f64 {
        if a.is_nan() || a <= b { a } else { b }
    }
}

/// Elements folded at a time: their partial sums stay in registers (two AVX-512 registers of
/// `f64`) while every contribution to them is folded in, and each step is a few vector
/// instructions on fixed-size arrays. Folding a whole block of partial sums per contribution
/// instead, through the first-level cache, took twice as long on 64 MiB.
const LANES: usize = 16;

// Everything below runs inside `vectorized` (compiled for the CPU's widest vector
// instructions, `fast::simd`), and every function and closure it calls is
// `#[inline(always)]`: a loop left out of line runs at the baseline's width.

/// The fold of `L` elements: contributions `piece(1)`, `piece(2)`, ... `piece(n)` in that
/// order, with `f64` partial sums (the partial result the left operand, a NaN once met
/// kept), rounded once.
#[inline(always)]
fn fold_lanes<C: Combine, const L: usize>(
    rounding: Rounding,
    n: usize,
    piece: impl Fn(usize) -> [f32; L],
) -> [f32; L] {
    let mut acc = [0f64; L];
    for (a, b) in acc.iter_mut().zip(piece(1)) {
        *a = f64::from(b);
    }
    for k in 2..=n {
        for (a, b) in acc.iter_mut().zip(piece(k)) {
            *a = C::combine(*a, f64::from(b));
        }
    }
    let mut out = [0f32; L];
    if rounding.to_f32_only() {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = a as f32;
        }
    } else {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = round_to_dtype(a, rounding.dtype) as f32;
        }
    }
    out
}

/// `src[i..i + L]` as an array.
#[inline(always)]
fn lanes_at<const L: usize>(src: &[f32], i: usize) -> [f32; L] {
    let mut v = [0f32; L];
    v.copy_from_slice(&src[i..i + L]);
    v
}

/// Runs `each::<LANES>(i)` over `0..len` in steps of [`LANES`], and `each::<1>` over the rest.
macro_rules! over_lanes {
    ($len:expr, |$i:ident, $l:ident| $body:expr) => {{
        let len = $len;
        let mut $i = 0;
        while $i + LANES <= len {
            const $l: usize = LANES;
            $body;
            $i += LANES;
        }
        while $i < len {
            const $l: usize = 1;
            $body;
            $i += 1;
        }
    }};
}

/// Calls `$run::<C>` with the [`Combine`] of `$kind`, compiled for the widest vector
/// instructions.
macro_rules! by_kind {
    ($kind:expr, $run:ident ( $($arg:expr),* )) => {
        match $kind {
            ReduceKind::Sum => vectorized(
                #[inline(always)]
                || $run::<SumOf>($($arg),*),
            ),
            ReduceKind::Max => vectorized(
                #[inline(always)]
                || $run::<MaxOf>($($arg),*),
            ),
            ReduceKind::Min => vectorized(
                #[inline(always)]
                || $run::<MinOf>($($arg),*),
            ),
        }
    };
}

/// Rounds the elements of `x` as [`Rounding`] says (the all-reduce of a lone member).
pub(crate) fn round_in_place(rounding: Rounding, x: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || {
            over_lanes!(x.len(), |i, L| {
                let out = fold_lanes::<SumOf, L>(
                    rounding,
                    1,
                    #[inline(always)]
                    |_| lanes_at::<L>(x, i),
                );
                x[i..i + L].copy_from_slice(&out);
            })
        },
    )
}

/// Reduces the pieces `srcs(0)`, `srcs(1)`, ... `srcs(n - 1)` (each as long as `out`) in
/// that order, as the ring's `f64` fold does, and writes the rounded results into `out`.
/// `srcs` must be cheap and `#[inline(always)]`: it is called per few elements.
pub(crate) fn reduce_pieces<'a>(
    kind: ReduceKind,
    rounding: Rounding,
    n: usize,
    srcs: impl Fn(usize) -> &'a [f32],
    out: &mut [f32],
) {
    by_kind!(kind, reduce_pieces_with(rounding, n, &srcs, out))
}

#[inline(always)]
fn reduce_pieces_with<'a, C: Combine>(
    rounding: Rounding,
    n: usize,
    srcs: &impl Fn(usize) -> &'a [f32],
    out: &mut [f32],
) {
    over_lanes!(out.len(), |i, L| {
        let r = fold_lanes::<C, L>(
            rounding,
            n,
            #[inline(always)]
            |k| lanes_at::<L>(srcs(k - 1), i),
        );
        out[i..i + L].copy_from_slice(&r);
    })
}

/// Fewest elements of each buffer worth a thread of their own in [`all_reduce_shared`]:
/// below this, the leader's thread does the whole all-reduce faster than it could hand a
/// part of it to another.
const PIECE_GRAIN: usize = 1 << 16;

/// [`all_reduce_in_place`] of whole buffers, cut into consecutive ranges reduced at the same
/// time: the leader's thread takes the first, the threads of the current rayon pool the
/// others. As many ranges as there are members (each member brings a thread, idle while it
/// waits for the leader), at most one per pool thread and [`PIECE_GRAIN`] elements each. A
/// range's elements fold as they would in the whole, so the bits do not depend on the cut.
pub(crate) fn all_reduce_shared(kind: ReduceKind, rounding: Rounding, bufs: &mut [&mut [f32]]) {
    let n = bufs.len();
    let len = bufs.first().map_or(0, |b| b.len());
    // The pool is asked only when there is something to hand it: asking starts it.
    let most = n.min(len / PIECE_GRAIN);
    let pieces = if most > 1 {
        most.min(rayon::current_num_threads())
    } else {
        1
    };
    if pieces <= 1 {
        all_reduce_in_place(kind, rounding, bufs, 0, len);
        return;
    }
    let bound = |p: usize| p * len / pieces;
    let mut parts: Vec<Vec<&mut [f32]>> = (0..pieces).map(|_| Vec::with_capacity(n)).collect();
    for buf in bufs.iter_mut() {
        let mut rest: &mut [f32] = buf;
        for (p, part) in parts.iter_mut().enumerate() {
            let (head, tail) = rest.split_at_mut(bound(p + 1) - bound(p));
            part.push(head);
            rest = tail;
        }
    }
    let mut parts = parts.into_iter().enumerate();
    let first = parts.next();
    rayon::in_place_scope(|s| {
        for (p, mut part) in parts {
            s.spawn(move |_| all_reduce_in_place(kind, rounding, &mut part, bound(p), len));
        }
        if let Some((_, mut part)) = first {
            all_reduce_in_place(kind, rounding, &mut part, 0, len);
        }
    });
}

/// The all-reduce of the buffers `bufs` (one per member, by position, equally long) in
/// place: chunk `c` (of [`chunk_bounds`]`(len, n)`) is folded in the ring's order, from
/// member `c + 1` around to member `c`, with `f64` partial sums and one rounding, and the
/// result written into every buffer. A few elements at a time, so that each element of each
/// buffer is read from memory once and written back once, and the partial sums never leave
/// the registers.
///
/// `bufs` may be the elements `offset..offset + bufs[m].len()` of buffers of `total`
/// elements: the chunks, and so the order of each element's fold, are those of the whole.
pub(crate) fn all_reduce_in_place(
    kind: ReduceKind,
    rounding: Rounding,
    bufs: &mut [&mut [f32]],
    offset: usize,
    total: usize,
) {
    by_kind!(
        kind,
        all_reduce_in_place_with(rounding, bufs, offset, total)
    )
}

/// Member `c + k` of `n`, around the ring (`c < n`, `k <= n`).
#[inline(always)]
fn ring(c: usize, k: usize, n: usize) -> usize {
    if c + k >= n { c + k - n } else { c + k }
}

#[inline(always)]
fn all_reduce_in_place_with<C: Combine>(
    rounding: Rounding,
    bufs: &mut [&mut [f32]],
    offset: usize,
    total: usize,
) {
    let n = bufs.len();
    let Some(len) = bufs.first().map(|b| b.len()) else {
        return;
    };
    debug_assert!(bufs.iter().all(|b| b.len() == len) && offset + len <= total);
    for (c, chunk) in chunk_bounds(total, n).into_iter().enumerate() {
        // This chunk's part of the range, relative to the range.
        let (lo, hi) = (
            chunk.start.clamp(offset, offset + len) - offset,
            chunk.end.clamp(offset, offset + len) - offset,
        );
        over_lanes!(hi - lo, |j, L| {
            let i = lo + j;
            let out = fold_lanes::<C, L>(
                rounding,
                n,
                #[inline(always)]
                |k| lanes_at::<L>(bufs[ring(c, k, n)], i),
            );
            for buf in bufs.iter_mut() {
                buf[i..i + L].copy_from_slice(&out);
            }
        })
    }
}

/// Replaces the contents of `slot` with `src`, reusing its allocation.
pub(crate) fn publish(slot: &RwLock<Vec<f32>>, src: &[f32]) {
    let mut v = slot.write().unwrap_or_else(PoisonError::into_inner);
    v.clear();
    v.extend_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring's fold of chunk `c`'s element `i`, one element at a time.
    fn reference(
        kind: ReduceKind,
        rounding: Rounding,
        bufs: &[Vec<f32>],
        c: usize,
        i: usize,
    ) -> f32 {
        let n = bufs.len();
        let mut acc = f64::from(bufs[(c + 1) % n][i]);
        for k in 2..=n {
            let b = f64::from(bufs[(c + k) % n][i]);
            acc = match kind {
                ReduceKind::Sum => acc + b,
                ReduceKind::Max => {
                    if acc.is_nan() || acc >= b {
                        acc
                    } else {
                        b
                    }
                }
                ReduceKind::Min => {
                    if acc.is_nan() || acc <= b {
                        acc
                    } else {
                        b
                    }
                }
            };
        }
        if rounding.to_f32_only() {
            acc as f32
        } else {
            round_to_dtype(acc, rounding.dtype) as f32
        }
    }

    /// Member `m`'s element `i`: drawn by a hash of both from large and small magnitudes of
    /// both signs, both zeros, NaN and infinities, so that the order of the fold (`1e30 + 1 -
    /// 1e30` is 0, `1 + 1e30 - 1e30` is 1) and the NaN rule show in the bits.
    fn value(m: usize, i: usize) -> f32 {
        let mut h = (i as u64) << 8 | m as u64;
        h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        match h % 16 {
            0 => f32::NAN,
            1 => -0.0,
            2 => 0.0,
            3 if h.is_multiple_of(7) => f32::INFINITY,
            3..=5 => 1e30,
            6..=8 => -1e30,
            _ => (h >> 40) as f32 * 1e-3 - 5.0,
        }
    }

    #[test]
    fn the_in_place_all_reduce_gives_the_ring_fold_bits_everywhere() {
        let roundings = [
            Rounding {
                dtype: DType::F32,
                precision: Precision::Declared,
            },
            Rounding {
                dtype: DType::BF16,
                precision: Precision::Declared,
            },
            Rounding {
                dtype: DType::F16,
                precision: Precision::F64,
            },
        ];
        for n in 1..=5 {
            for len in [0, 1, 5, 16, 17, 3 * LANES * n + 7, 1000] {
                for kind in [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min] {
                    for rounding in roundings {
                        let bufs: Vec<Vec<f32>> = (0..n)
                            .map(|m| (0..len).map(|i| value(m, i)).collect())
                            .collect();
                        let chunks = chunk_bounds(len, n);
                        let expected: Vec<u32> = (0..len)
                            .map(|i| {
                                let c = chunks.iter().position(|r| r.contains(&i)).unwrap_or(0);
                                reference(kind, rounding, &bufs, c, i).to_bits()
                            })
                            .collect();
                        let mut out = bufs.clone();
                        let mut views: Vec<&mut [f32]> =
                            out.iter_mut().map(|b| b.as_mut_slice()).collect();
                        all_reduce_in_place(kind, rounding, &mut views, 0, len);
                        for (m, b) in out.iter().enumerate() {
                            let bits: Vec<u32> = b.iter().map(|v| v.to_bits()).collect();
                            assert_eq!(bits, expected, "n={n} len={len} {kind:?} member {m}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_cut_all_reduce_gives_the_bits_of_the_whole() {
        let rounding = Rounding {
            dtype: DType::F32,
            precision: Precision::Declared,
        };
        for n in [2, 3, 4] {
            // Long enough to be cut wherever the pool has threads to spare; the cuts fall
            // inside chunks.
            let len = 3 * PIECE_GRAIN * n + 11;
            let bufs: Vec<Vec<f32>> = (0..n)
                .map(|m| (0..len).map(|i| value(m + 7, i)).collect())
                .collect();
            let mut whole = bufs.clone();
            let mut views: Vec<&mut [f32]> = whole.iter_mut().map(|b| b.as_mut_slice()).collect();
            all_reduce_in_place(ReduceKind::Sum, rounding, &mut views, 0, len);
            let mut cut = bufs.clone();
            let mut views: Vec<&mut [f32]> = cut.iter_mut().map(|b| b.as_mut_slice()).collect();
            all_reduce_shared(ReduceKind::Sum, rounding, &mut views);
            let chunks = chunk_bounds(len, n);
            for m in 0..n {
                for (i, (a, b)) in whole[m].iter().zip(&cut[m]).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "n={n} member {m} element {i}");
                }
            }
            for i in (0..len).step_by(997) {
                let c = chunks.iter().position(|r| r.contains(&i)).unwrap_or(0);
                let expected = reference(ReduceKind::Sum, rounding, &bufs, c, i);
                assert_eq!(cut[0][i].to_bits(), expected.to_bits(), "n={n} element {i}");
            }
        }
    }

    #[test]
    fn reduce_pieces_folds_in_the_order_given() {
        let rounding = Rounding {
            dtype: DType::F32,
            precision: Precision::Declared,
        };
        // 1e30 + 1 - 1e30 is 0 in this order, 1 in another.
        let pieces = [vec![1e30f32; 40], vec![1.0; 40], vec![-1e30; 40]];
        let mut out = vec![f32::NAN; 40];
        reduce_pieces(ReduceKind::Sum, rounding, 3, |k| &pieces[k][..], &mut out);
        assert!(out.iter().all(|&v| v == 0.0), "{out:?}");
        reduce_pieces(
            ReduceKind::Sum,
            rounding,
            3,
            |k| &pieces[(k + 1) % 3][..],
            &mut out,
        );
        assert!(out.iter().all(|&v| v == 0.0), "{out:?}");
        reduce_pieces(
            ReduceKind::Sum,
            rounding,
            3,
            |k| &pieces[[0, 2, 1][k]][..],
            &mut out,
        );
        assert!(out.iter().all(|&v| v == 1.0), "{out:?}");
    }
}
