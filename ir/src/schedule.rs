//! Pipeline schedules as data: for every pipeline rank, the ordered list of forward, backward,
//! send, receive and optimizer actions of one training step (GPipe, 1F1B, interleaved 1F1B).
//!
//! The same lists drive the runtime's executor, the cost model's simulation and timeline
//! exports, so what is predicted is what runs. Generation is deterministic and allocation is
//! linear in `pp * vpp * micro_batches`.
//!
//! # Conventions
//!
//! - Rank `r` of `pp` holds `vpp` model chunks. Local chunk `c` of rank `r` is *virtual stage*
//!   `c * pp + r` (the round-robin assignment of Narayanan et al., SC'21), so the model runs
//!   through virtual stages `0..pp * vpp` in order and activations travel from rank `r` to rank
//!   `(r + 1) % pp`.
//! - A send is posted and the sender continues (as with non-blocking sends waited on at the end
//!   of the step); a receive blocks until the matching send has been posted. [`Schedule::check`]
//!   runs the lists under these rules and reports a deadlock if one occurs.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Which pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al., 2019). Text: `gpipe`.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush; Narayanan et al., 2021). Text: `1f1b`.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `vpp` interleaved model chunks per rank (Narayanan et al., SC'21). Text:
    /// `interleaved`.
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl ScheduleKind {
    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, ScheduleError> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved-1f1b" => Ok(ScheduleKind::Interleaved),
            other => Err(ScheduleError::UnknownKind(other.to_string())),
        }
    }
}

/// One step of a rank's program. `chunk` is always the local chunk index on the rank that
/// executes the action (`0..vpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Forward pass of `micro_batch` through local chunk `chunk`.
    Forward {
        /// Micro-batch index.
        micro_batch: usize,
        /// Local chunk index.
        chunk: usize,
    },
    /// Backward pass of `micro_batch` through local chunk `chunk`.
    Backward {
        /// Micro-batch index.
        micro_batch: usize,
        /// Local chunk index.
        chunk: usize,
    },
    /// Send the output activation of (`micro_batch`, `chunk`) to rank `to`.
    SendActivation {
        /// Micro-batch index.
        micro_batch: usize,
        /// Local chunk index of the sender.
        chunk: usize,
        /// Destination rank.
        to: usize,
    },
    /// Receive the input activation of (`micro_batch`, `chunk`) from rank `from`.
    RecvActivation {
        /// Micro-batch index.
        micro_batch: usize,
        /// Local chunk index of the receiver.
        chunk: usize,
        /// Source rank.
        from: usize,
    },
    /// Send the gradient of the input of (`micro_batch`, `chunk`) to rank `to`.
    SendGradient {
        /// Micro-batch index.
        micro_batch: usize,
        /// Local chunk index of the sender.
        chunk: usize,
        /// Destination rank.
        to: usize,
    },
    /// Receive the gradient of the output of (`micro_batch`, `chunk`) from rank `from`.
    RecvGradient {
        /// Micro-batch index.
        micro_batch: usize,
        /// Local chunk index of the receiver.
        chunk: usize,
        /// Source rank.
        from: usize,
    },
    /// Gradient synchronisation and optimizer update, once all backwards have run.
    OptimizerStep,
}

/// Why a schedule cannot be built, or why a run of its lists failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// A size that must be at least 1 was 0.
    #[error("pipeline schedule: `{what}` must be at least 1")]
    Zero {
        /// `pp`, `vpp` or `micro_batches`.
        what: &'static str,
    },
    /// The interleaved schedule groups micro-batches by `pp`.
    #[error(
        "interleaved schedule needs micro_batches ({micro_batches}) to be a multiple of pp ({pp})"
    )]
    InterleavedMicroBatches {
        /// Micro-batches requested.
        micro_batches: usize,
        /// Pipeline ranks.
        pp: usize,
    },
    /// GPipe and 1F1B place one chunk per rank.
    #[error("schedule `{kind}` has one model chunk per rank; vpp={vpp} needs `interleaved`")]
    VirtualStagesNeedInterleaved {
        /// The schedule asked for.
        kind: ScheduleKind,
        /// Chunks per rank asked for.
        vpp: usize,
    },
    /// Not a schedule name.
    #[error("unknown pipeline schedule `{0}` (expected gpipe, 1f1b or interleaved)")]
    UnknownKind(String),
    /// A run of the action lists stopped with every unfinished rank waiting on a receive.
    #[error("pipeline schedule deadlocks: {0}")]
    Deadlock(String),
    /// An action list breaks an ordering invariant.
    #[error("pipeline schedule is inconsistent: {0}")]
    Invalid(String),
}

/// A pipeline schedule: the action list of every rank for one training step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Which schedule.
    pub kind: ScheduleKind,
    /// Pipeline ranks.
    pub pp: usize,
    /// Model chunks per rank (1 except for interleaved).
    pub vpp: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// `per_rank[r]` is rank `r`'s program, in execution order.
    pub per_rank: Vec<Vec<Action>>,
}

/// When each action of a timed run started and ended, in the caller's time unit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// `spans[r][k] = (start, end)` of action `per_rank[r][k]`.
    pub spans: Vec<Vec<(u64, u64)>>,
    /// Time at which the last action of any rank ended.
    pub makespan: u64,
}

impl Schedule {
    /// Builds the schedule `kind` for `pp` ranks, `vpp` chunks per rank and `micro_batches`
    /// micro-batches.
    ///
    /// ```
    /// # use autopar_ir::schedule::{Schedule, ScheduleKind, Action};
    /// let s = Schedule::new(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
    /// assert_eq!(s.per_rank[1][0], Action::RecvActivation { micro_batch: 0, chunk: 0, from: 0 });
    /// assert!(Schedule::new(ScheduleKind::Interleaved, 4, 2, 6).is_err());
    /// ```
    pub fn new(
        kind: ScheduleKind,
        pp: usize,
        vpp: usize,
        micro_batches: usize,
    ) -> Result<Schedule, ScheduleError> {
        for (what, v) in [("pp", pp), ("vpp", vpp), ("micro_batches", micro_batches)] {
            if v == 0 {
                return Err(ScheduleError::Zero { what });
            }
        }
        match kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB if vpp != 1 => {
                return Err(ScheduleError::VirtualStagesNeedInterleaved { kind, vpp });
            }
            ScheduleKind::Interleaved if vpp > 1 && !micro_batches.is_multiple_of(pp) => {
                return Err(ScheduleError::InterleavedMicroBatches { micro_batches, pp });
            }
            _ => {}
        }
        let mut s = Schedule {
            kind,
            pp,
            vpp,
            micro_batches,
            per_rank: Vec::with_capacity(pp),
        };
        for rank in 0..pp {
            let order = match kind {
                ScheduleKind::GPipe => gpipe_order(micro_batches),
                ScheduleKind::OneFOneB => one_f_one_b_order(pp, rank, micro_batches),
                ScheduleKind::Interleaved => interleaved_order(pp, vpp, rank, micro_batches),
            };
            let list = s.with_communication(rank, &order);
            s.per_rank.push(list);
        }
        Ok(s)
    }

    /// Number of virtual stages, `pp * vpp`.
    pub fn num_virtual_stages(&self) -> usize {
        self.pp * self.vpp
    }

    /// Virtual stage of local chunk `chunk` on `rank`.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.pp + rank
    }

    /// Rank and local chunk of a virtual stage.
    pub fn rank_chunk(&self, virtual_stage: usize) -> (usize, usize) {
        (virtual_stage % self.pp, virtual_stage / self.pp)
    }

    /// Surrounds the compute order of `rank` with the receives it needs and the sends it owes.
    fn with_communication(&self, rank: usize, order: &[(bool, usize, usize)]) -> Vec<Action> {
        let last = self.num_virtual_stages() - 1;
        let next = (rank + 1) % self.pp;
        let prev = (rank + self.pp - 1) % self.pp;
        let mut out = Vec::with_capacity(order.len() * 2 + 2 * self.micro_batches * self.vpp + 1);
        for &(forward, micro_batch, chunk) in order {
            let vs = self.virtual_stage(rank, chunk);
            if forward {
                if vs > 0 {
                    out.push(Action::RecvActivation {
                        micro_batch,
                        chunk,
                        from: prev,
                    });
                }
                out.push(Action::Forward { micro_batch, chunk });
                if vs < last {
                    out.push(Action::SendActivation {
                        micro_batch,
                        chunk,
                        to: next,
                    });
                }
            } else {
                if vs < last {
                    out.push(Action::RecvGradient {
                        micro_batch,
                        chunk,
                        from: next,
                    });
                }
                out.push(Action::Backward { micro_batch, chunk });
                if vs > 0 {
                    out.push(Action::SendGradient {
                        micro_batch,
                        chunk,
                        to: prev,
                    });
                }
            }
        }
        out.push(Action::OptimizerStep);
        out
    }

    /// Largest number of (micro-batch, chunk) activations rank `rank` holds at once: forwards
    /// run whose backward has not.
    pub fn max_in_flight(&self, rank: usize) -> usize {
        self.peak_in_flight_by(rank, |_| 1.0).round() as usize
    }

    /// Largest total `weight(chunk)` of the (micro-batch, chunk) activations rank `rank` holds
    /// at once, where a local chunk's activations weigh `weight(chunk)` (the bytes it stores
    /// per micro-batch, say). With chunks of unequal size this is below `max_in_flight` times
    /// the largest chunk: the interleaved schedule's warm-up holds every chunk, not only the
    /// largest.
    pub fn peak_in_flight_by(&self, rank: usize, weight: impl Fn(usize) -> f64) -> f64 {
        let mut live = 0.0f64;
        let mut peak = 0.0f64;
        for a in self.per_rank.get(rank).map(Vec::as_slice).unwrap_or(&[]) {
            match a {
                Action::Forward { chunk, .. } => {
                    live += weight(*chunk);
                    peak = peak.max(live);
                }
                Action::Backward { chunk, .. } => live = (live - weight(*chunk)).max(0.0),
                Action::SendActivation { .. }
                | Action::RecvActivation { .. }
                | Action::SendGradient { .. }
                | Action::RecvGradient { .. }
                | Action::OptimizerStep => {}
            }
        }
        peak
    }

    /// Checks the ordering invariants of every list (each (micro-batch, chunk) runs forward
    /// once and backward once, forward first; receives precede their compute) and runs the
    /// lists with unit durations to prove they complete.
    pub fn check(&self) -> Result<(), ScheduleError> {
        if self.per_rank.len() != self.pp {
            return Err(ScheduleError::Invalid(format!(
                "{} action lists for pp={}",
                self.per_rank.len(),
                self.pp
            )));
        }
        let m = self.micro_batches;
        for (rank, list) in self.per_rank.iter().enumerate() {
            let mut fwd = vec![false; m * self.vpp];
            let mut bwd = vec![false; m * self.vpp];
            let key = |mb: usize, c: usize| -> Result<usize, ScheduleError> {
                if mb >= m || c >= self.vpp {
                    return Err(ScheduleError::Invalid(format!(
                        "rank {rank}: micro-batch {mb} chunk {c} out of range"
                    )));
                }
                Ok(c * m + mb)
            };
            for a in list {
                match *a {
                    Action::Forward { micro_batch, chunk } => {
                        let k = key(micro_batch, chunk)?;
                        if fwd[k] {
                            return Err(ScheduleError::Invalid(format!(
                                "rank {rank}: forward of micro-batch {micro_batch} chunk {chunk} runs twice"
                            )));
                        }
                        fwd[k] = true;
                    }
                    Action::Backward { micro_batch, chunk } => {
                        let k = key(micro_batch, chunk)?;
                        if !fwd[k] || bwd[k] {
                            return Err(ScheduleError::Invalid(format!(
                                "rank {rank}: backward of micro-batch {micro_batch} chunk {chunk} \
                                 before its forward, or twice"
                            )));
                        }
                        bwd[k] = true;
                    }
                    Action::SendActivation {
                        micro_batch, chunk, ..
                    }
                    | Action::SendGradient {
                        micro_batch, chunk, ..
                    }
                    | Action::RecvActivation {
                        micro_batch, chunk, ..
                    }
                    | Action::RecvGradient {
                        micro_batch, chunk, ..
                    } => {
                        key(micro_batch, chunk)?;
                    }
                    Action::OptimizerStep => {}
                }
            }
            if fwd.iter().chain(&bwd).any(|d| !d) {
                return Err(ScheduleError::Invalid(format!(
                    "rank {rank}: some micro-batch misses its forward or backward"
                )));
            }
        }
        self.simulate(|_, _| 1, |_, _| 0).map(|_| ())
    }

    /// Runs the lists: `duration(rank, action)` is how long a compute or optimizer action
    /// occupies its rank, and `transfer(rank, action)` how long after a send is posted the
    /// message is available to the receiver (`rank` is the sender). Sends and receives take no
    /// time on their rank beyond waiting. Returns when each action started and ended, or a
    /// deadlock error naming the blocked ranks.
    pub fn simulate(
        &self,
        mut duration: impl FnMut(usize, &Action) -> u64,
        mut transfer: impl FnMut(usize, &Action) -> u64,
    ) -> Result<Timeline, ScheduleError> {
        let m = self.micro_batches;
        let vs_count = self.num_virtual_stages();
        // Arrival time of each message, indexed by (kind, receiving virtual stage, micro-batch).
        const NOT_SENT: u64 = u64::MAX;
        let mut act_arrival = vec![NOT_SENT; vs_count * m];
        let mut grad_arrival = vec![NOT_SENT; vs_count * m];
        let mut pc = vec![0usize; self.pp];
        let mut clock = vec![0u64; self.pp];
        let mut spans: Vec<Vec<(u64, u64)>> = self
            .per_rank
            .iter()
            .map(|l| Vec::with_capacity(l.len()))
            .collect();
        // Ranks run until they block on a receive; a send wakes the rank waiting for it, so
        // each action is visited once and a blocked rank once per wake-up.
        let mut waiting: Vec<Option<(bool, usize)>> = vec![None; self.pp];
        let mut ready: Vec<usize> = (0..self.pp).rev().collect();
        while let Some(rank) = ready.pop() {
            waiting[rank] = None;
            let list = &self.per_rank[rank];
            while let Some(action) = list.get(pc[rank]) {
                let now = clock[rank];
                let vs_of = |chunk: usize| chunk * self.pp + rank;
                let (start, end) = match *action {
                    Action::Forward { .. } | Action::Backward { .. } | Action::OptimizerStep => {
                        (now, now.saturating_add(duration(rank, action)))
                    }
                    Action::SendActivation {
                        micro_batch,
                        chunk,
                        to,
                    } => {
                        let dest = vs_of(chunk) + 1;
                        if dest < vs_count {
                            let key = dest * m + micro_batch;
                            act_arrival[key] = now.saturating_add(transfer(rank, action));
                            if to < self.pp && waiting[to] == Some((true, key)) {
                                waiting[to] = None;
                                ready.push(to);
                            }
                        }
                        (now, now)
                    }
                    Action::SendGradient {
                        micro_batch,
                        chunk,
                        to,
                    } => {
                        if let Some(dest) = vs_of(chunk).checked_sub(1) {
                            let key = dest * m + micro_batch;
                            grad_arrival[key] = now.saturating_add(transfer(rank, action));
                            if to < self.pp && waiting[to] == Some((false, key)) {
                                waiting[to] = None;
                                ready.push(to);
                            }
                        }
                        (now, now)
                    }
                    Action::RecvActivation {
                        micro_batch, chunk, ..
                    } => {
                        let key = vs_of(chunk) * m + micro_batch;
                        let t = act_arrival[key];
                        if t == NOT_SENT {
                            waiting[rank] = Some((true, key));
                            break;
                        }
                        (now, now.max(t))
                    }
                    Action::RecvGradient {
                        micro_batch, chunk, ..
                    } => {
                        let key = vs_of(chunk) * m + micro_batch;
                        let t = grad_arrival[key];
                        if t == NOT_SENT {
                            waiting[rank] = Some((false, key));
                            break;
                        }
                        (now, now.max(t))
                    }
                };
                spans[rank].push((start, end));
                clock[rank] = end;
                pc[rank] += 1;
            }
        }
        if (0..self.pp).any(|r| pc[r] < self.per_rank[r].len()) {
            let blocked: Vec<String> = (0..self.pp)
                .filter_map(|r| {
                    self.per_rank[r]
                        .get(pc[r])
                        .map(|a| format!("rank {r} waits at {a:?}"))
                })
                .collect();
            return Err(ScheduleError::Deadlock(blocked.join("; ")));
        }
        let makespan = clock.iter().copied().max().unwrap_or(0);
        Ok(Timeline { spans, makespan })
    }
}

/// GPipe: every forward, then every backward, in micro-batch order.
fn gpipe_order(m: usize) -> Vec<(bool, usize, usize)> {
    (0..m)
        .map(|i| (true, i, 0))
        .chain((0..m).map(|i| (false, i, 0)))
        .collect()
}

/// 1F1B: `pp - rank - 1` warm-up forwards, then alternate one forward and one backward, then
/// drain the remaining backwards.
fn one_f_one_b_order(pp: usize, rank: usize, m: usize) -> Vec<(bool, usize, usize)> {
    let warmup = (pp - rank - 1).min(m);
    let mut out = Vec::with_capacity(2 * m);
    out.extend((0..warmup).map(|i| (true, i, 0)));
    for k in 0..m - warmup {
        out.push((true, warmup + k, 0));
        out.push((false, k, 0));
    }
    out.extend((m - warmup..m).map(|i| (false, i, 0)));
    out
}

/// Interleaved 1F1B as in Megatron-LM: forwards walk groups of `pp` micro-batches through
/// chunk 0, then chunk 1, ...; backwards walk the chunks in reverse. Warm-up is
/// `2 (pp - rank - 1) + (vpp - 1) pp` forwards.
fn interleaved_order(pp: usize, vpp: usize, rank: usize, m: usize) -> Vec<(bool, usize, usize)> {
    let total = m * vpp;
    // Forward order: groups of `pp` micro-batches, each walked through chunk 0, 1, ...; the
    // backward order walks the chunks in reverse. Built with loops rather than divisions,
    // since a search generates many schedules.
    let mut fwd = Vec::with_capacity(total);
    let mut bwd = Vec::with_capacity(total);
    let mut first = 0;
    while first < m {
        let len = pp.min(m - first);
        for c in 0..vpp {
            fwd.extend((first..first + len).map(|mb| (true, mb, c)));
            bwd.extend((first..first + len).map(|mb| (false, mb, vpp - 1 - c)));
        }
        first += len;
    }
    let warmup = if vpp == 1 {
        pp - rank - 1
    } else {
        (pp - rank - 1) * 2 + (vpp - 1) * pp
    }
    .min(total);
    let mut out = Vec::with_capacity(2 * total);
    out.extend_from_slice(&fwd[..warmup]);
    for k in 0..total - warmup {
        out.push(fwd[warmup + k]);
        out.push(bwd[k]);
    }
    out.extend_from_slice(&bwd[total - warmup..]);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn all_schedules() -> Vec<Schedule> {
        let mut v = Vec::new();
        for pp in 1..=5 {
            for m in 1..=9 {
                v.push(Schedule::new(ScheduleKind::GPipe, pp, 1, m).unwrap());
                v.push(Schedule::new(ScheduleKind::OneFOneB, pp, 1, m).unwrap());
                for vpp in 1..=3 {
                    if m % pp == 0 {
                        v.push(Schedule::new(ScheduleKind::Interleaved, pp, vpp, m).unwrap());
                    }
                }
            }
        }
        v
    }

    #[test]
    fn every_schedule_is_consistent_and_completes() {
        for s in all_schedules() {
            s.check().unwrap_or_else(|e| {
                panic!(
                    "{} pp={} vpp={} m={}: {e}",
                    s.kind, s.pp, s.vpp, s.micro_batches
                )
            });
        }
    }

    /// With forward 1 and backward 2 time units and a transfer delay, forward of virtual stage
    /// `v` ends before forward of `v + 1` starts for each micro-batch, and backward runs the
    /// other way.
    #[test]
    fn chunks_run_in_model_order() {
        for s in all_schedules() {
            let tl = s
                .simulate(
                    |_, a| match a {
                        Action::Backward { .. } => 2,
                        _ => 1,
                    },
                    |_, _| 1,
                )
                .unwrap();
            let n = s.num_virtual_stages();
            let m = s.micro_batches;
            let mut fwd = vec![(0u64, 0u64); n * m];
            let mut bwd = vec![(0u64, 0u64); n * m];
            for (r, list) in s.per_rank.iter().enumerate() {
                for (a, span) in list.iter().zip(&tl.spans[r]) {
                    match *a {
                        Action::Forward { micro_batch, chunk } => {
                            fwd[s.virtual_stage(r, chunk) * m + micro_batch] = *span
                        }
                        Action::Backward { micro_batch, chunk } => {
                            bwd[s.virtual_stage(r, chunk) * m + micro_batch] = *span
                        }
                        _ => {}
                    }
                }
            }
            for mb in 0..m {
                for v in 0..n {
                    assert!(fwd[v * m + mb].1 <= bwd[v * m + mb].0);
                    if v + 1 < n {
                        assert!(fwd[v * m + mb].1 < fwd[(v + 1) * m + mb].0);
                        assert!(bwd[(v + 1) * m + mb].1 < bwd[v * m + mb].0);
                    }
                }
            }
        }
    }

    #[test]
    fn in_flight_counts_match_the_literature() {
        for pp in 1..=6 {
            for m in [1, 3, 8, 12] {
                let g = Schedule::new(ScheduleKind::GPipe, pp, 1, m).unwrap();
                let f = Schedule::new(ScheduleKind::OneFOneB, pp, 1, m).unwrap();
                for r in 0..pp {
                    assert_eq!(g.max_in_flight(r), m, "gpipe holds every micro-batch");
                    assert_eq!(f.max_in_flight(r), (pp - r).min(m), "1f1b stage {r}");
                }
            }
        }
        // Interleaved: warm-up of 2 (pp - r - 1) + (vpp - 1) pp chunk-forwards, plus one.
        let s = Schedule::new(ScheduleKind::Interleaved, 4, 2, 8).unwrap();
        for r in 0..4 {
            assert_eq!(s.max_in_flight(r), 2 * (4 - r - 1) + 4 + 1);
        }
        // Stage 0 of 1F1B holds about half of what GPipe's does at pp=4, m=8.
        let g = Schedule::new(ScheduleKind::GPipe, 4, 1, 8).unwrap();
        let f = Schedule::new(ScheduleKind::OneFOneB, 4, 1, 8).unwrap();
        assert!(2 * f.max_in_flight(0) <= g.max_in_flight(0));
    }

    #[test]
    fn weighted_in_flight_counts_each_chunk_at_its_own_weight() {
        let s = Schedule::new(ScheduleKind::Interleaved, 4, 2, 8).unwrap();
        for r in 0..4 {
            let n = s.max_in_flight(r) as f64;
            // Equal weights: the count times the weight.
            assert_eq!(s.peak_in_flight_by(r, |_| 3.0), 3.0 * n);
            // A heavier second chunk: between the count at the lighter and at the heavier
            // weight, and strictly below the latter, since the warm-up holds both chunks.
            let w = |c: usize| if c == 1 { 2.0 } else { 1.0 };
            let peak = s.peak_in_flight_by(r, w);
            assert!(peak > n && peak < 2.0 * n, "rank {r}: {peak} of {n}");
        }
        // Rank 0 runs chunk 0 (virtual stage 0) of every micro-batch before the first of
        // their backwards reaches it, so chunk 0 alone peaks at all 8, below the 11 in flight.
        assert_eq!(s.max_in_flight(0), 11);
        assert_eq!(
            s.peak_in_flight_by(0, |c| if c == 0 { 1.0 } else { 0.0 }),
            8.0
        );
    }

    #[test]
    fn bubbles_match_the_closed_forms() {
        // Forward 1, backward 2, free transfers: 1F1B and GPipe take (m + pp - 1) * 3; the
        // interleaved schedule shrinks the bubble by vpp.
        let dur = |_: usize, a: &Action| match a {
            Action::Forward { .. } => 2,
            Action::Backward { .. } => 4,
            _ => 0,
        };
        let (pp, m) = (4, 8);
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let t = Schedule::new(kind, pp, 1, m)
                .unwrap()
                .simulate(dur, |_, _| 0)
                .unwrap();
            assert_eq!(t.makespan, ((m + pp - 1) * 6) as u64, "{kind}");
        }
        // Two chunks each half as long: ideal m * 6, bubble (pp - 1) * 6 / 2.
        let s = Schedule::new(ScheduleKind::Interleaved, pp, 2, m).unwrap();
        let t = s
            .simulate(
                |_, a| match a {
                    Action::Forward { .. } => 1,
                    Action::Backward { .. } => 2,
                    _ => 0,
                },
                |_, _| 0,
            )
            .unwrap();
        assert_eq!(t.makespan, (m * 6 + (pp - 1) * 3) as u64);
    }

    #[test]
    fn bad_requests_are_errors() {
        assert!(matches!(
            Schedule::new(ScheduleKind::Interleaved, 4, 2, 6),
            Err(ScheduleError::InterleavedMicroBatches { .. })
        ));
        assert!(matches!(
            Schedule::new(ScheduleKind::OneFOneB, 4, 2, 8),
            Err(ScheduleError::VirtualStagesNeedInterleaved { .. })
        ));
        assert!(Schedule::new(ScheduleKind::GPipe, 0, 1, 8).is_err());
        assert!("zigzag".parse::<ScheduleKind>().is_err());
        assert_eq!("1f1b".parse::<ScheduleKind>(), Ok(ScheduleKind::OneFOneB));
    }

    #[test]
    fn a_deadlock_is_reported() {
        let mut s = Schedule::new(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
        // Rank 0 waits for a gradient before sending the activation that produces it.
        let recv = s.per_rank[0].remove(4);
        assert!(matches!(recv, Action::RecvGradient { micro_batch: 0, .. }));
        s.per_rank[0].insert(0, recv);
        assert!(matches!(s.check(), Err(ScheduleError::Deadlock(_))));
    }

    #[test]
    fn schedules_serialise_and_are_deterministic() {
        let a = Schedule::new(ScheduleKind::Interleaved, 4, 3, 8).unwrap();
        let b = Schedule::new(ScheduleKind::Interleaved, 4, 3, 8).unwrap();
        assert_eq!(a, b);
        let json = serde_json::to_string(&a).unwrap();
        assert!(json.contains("\"kind\":\"interleaved\""));
        let back: Schedule = serde_json::from_str(&json).unwrap();
        assert_eq!(a, back);
    }
}
