//! Shared-memory collectives of the `f32` path between the rank threads of one process: the
//! ranks of a group exchange through buffers they all see ([`GroupSlots`], one set per group,
//! kept for the life of the launch and reused from call to call) and meet at barriers
//! ([`World::barrier`]) that keep the mailbox's failure semantics: a barrier waits at most the
//! timeout, fails at once when any rank announces a failure or a member that has not arrived
//! has gone, and reports a member that called something else.
//!
//! Every collective takes two barriers. Before the first, each member makes what the others
//! need of its operand visible; at the first, it checks its call against its ring
//! predecessor's. Between the two it reads (and, in an all-reduce, writes) the others'
//! buffers; the second keeps a member from taking back or overwriting its buffer before
//! everyone is done with it.
//!
//! An all-reduce moves no operand: each member moves its own buffer (the caller's `Vec`) into
//! its slot of [`GroupSlots::buffers`] and takes it back after the second barrier. Between
//! the barriers member `p` owns chunk `p` of every buffer: block by block (a few KiB, so the
//! partial sums stay in the first-level cache) it reads that block of every member's buffer,
//! folds them, and writes the rounded result into that block of every buffer, its own
//! included. Each element of each buffer is read once and written once, which is the least an
//! all-reduce of separate buffers can move (`2 n` times the operand over the group, against
//! `2` for one memcpy of it). Buffers are locked per block and one at a time, so no member
//! waits on another for longer than one block's copy.
//!
//! Reductions add in the ring algorithm's order (chunk `c` from member `c + 1` around to
//! member `c`), with partial sums in `f64` and one rounding at the end, so this path gives the
//! bits of the `Tensor` path and of MPI, and every member the same ones.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use autopar_ir::{DType, ReduceKind};

use super::mailbox::CallSignature;
use crate::error::RuntimeError;
use crate::tensor::{Precision, round_to_dtype};

/// What all the ranks of one launch share: failure and exit notices, the barrier state of
/// every group, and every group's buffers.
pub(crate) struct World {
    state: Mutex<WorldState>,
    wake: Condvar,
    slots: Mutex<HashMap<Arc<[usize]>, Arc<GroupSlots>>>,
}

struct WorldState {
    /// The first failure announced: originating rank and reason.
    failed: Option<(usize, String)>,
    /// Ranks whose communicators are gone.
    exited: Vec<bool>,
    groups: HashMap<Arc<[usize]>, GroupState>,
}

/// The barrier state of one group, by member position.
struct GroupState {
    /// How many barriers each member has entered.
    reached: Vec<u64>,
    /// The call each member made at its latest first barrier, with that barrier's number.
    calls: Vec<Option<(u64, Arc<CallSignature>)>>,
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
            wake: Condvar::new(),
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
        drop(st);
        self.wake.notify_all();
    }

    /// Records that `rank`'s communicator is gone, and wakes every waiting rank.
    pub(crate) fn exit(&self, rank: usize) {
        let mut st = lock(&self.state);
        if let Some(e) = st.exited.get_mut(rank) {
            *e = true;
        }
        drop(st);
        self.wake.notify_all();
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
        let n = b.members.len();
        let rank = b.members[b.pos];
        let prev = (b.pos + n - 1) % n;
        let deadline = Instant::now() + b.timeout;
        let mut st = lock(&self.state);
        let group = st
            .groups
            .entry(Arc::clone(b.members))
            .or_insert_with(|| GroupState {
                reached: vec![0; n],
                calls: vec![None; n],
            });
        let ticket = group.reached[b.pos];
        group.reached[b.pos] = ticket + 1;
        if let Some(call) = b.call {
            group.calls[b.pos] = Some((ticket, Arc::clone(call)));
        }
        self.wake.notify_all();
        loop {
            let group = &st.groups[b.members];
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
            let missing = |m: &usize| group.reached[*m] <= ticket;
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
            st = self
                .wake
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
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

/// Elements reduced at a time: the partial sums of one block stay in the first-level cache.
pub(crate) const BLOCK: usize = 2048;

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

fn fold_with<C: Combine>(acc: &mut [f64], src: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(src) {
        *a = C::combine(*a, f64::from(b));
    }
}

/// Folds `src` into the partial results `acc` (or starts them, `first`), as the ring's `f64`
/// fold does: the partial result is the left operand, and a NaN, once met, stays.
#[inline]
pub(crate) fn fold_block(kind: ReduceKind, acc: &mut [f64], src: &[f32], first: bool) {
    if first {
        for (a, &b) in acc.iter_mut().zip(src) {
            *a = f64::from(b);
        }
        return;
    }
    match kind {
        ReduceKind::Sum => fold_with::<SumOf>(acc, src),
        ReduceKind::Max => fold_with::<MaxOf>(acc, src),
        ReduceKind::Min => fold_with::<MinOf>(acc, src),
    }
}

/// Writes the rounded partial results `acc` into `out`.
#[inline]
pub(crate) fn write_block(rounding: Rounding, acc: &[f64], out: &mut [f32]) {
    // Decided once per block, so that the common loop vectorises.
    if rounding.to_f32_only() {
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = a as f32;
        }
    } else {
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = round_to_dtype(a, rounding.dtype) as f32;
        }
    }
}

fn finish_with<C: Combine>(rounding: Rounding, acc: &[f64], src: &[f32], out: &mut [f32]) {
    let elems = out.iter_mut().zip(acc).zip(src);
    if rounding.to_f32_only() {
        for ((o, &a), &b) in elems {
            *o = C::combine(a, f64::from(b)) as f32;
        }
    } else {
        for ((o, &a), &b) in elems {
            *o = round_to_dtype(C::combine(a, f64::from(b)), rounding.dtype) as f32;
        }
    }
}

/// Folds the last contribution `src` into `acc` and writes the rounded results into `out`:
/// [`fold_block`] then [`write_block`] in one pass, with the same bits.
#[inline]
pub(crate) fn finish_block(
    kind: ReduceKind,
    rounding: Rounding,
    acc: &[f64],
    src: &[f32],
    out: &mut [f32],
) {
    match kind {
        ReduceKind::Sum => finish_with::<SumOf>(rounding, acc, src, out),
        ReduceKind::Max => finish_with::<MaxOf>(rounding, acc, src, out),
        ReduceKind::Min => finish_with::<MinOf>(rounding, acc, src, out),
    }
}

/// Replaces the contents of `slot` with `src`, reusing its allocation.
pub(crate) fn publish(slot: &RwLock<Vec<f32>>, src: &[f32]) {
    let mut v = slot.write().unwrap_or_else(PoisonError::into_inner);
    v.clear();
    v.extend_from_slice(src);
}
