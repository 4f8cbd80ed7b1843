//! Point-to-point transport between the ranks of one process: every rank owns an inbox (an
//! unbounded channel) and a sender into every other rank's inbox. Messages carry a tag and
//! the signature of the call that sent them, so that a receiver takes exactly the message it
//! expects, keeps early ones for later, and notices a peer that called something else.
//!
//! Besides data, ranks post two notices: `Failed` (this rank hit an error or panicked; the
//! whole run is doomed) and `Exited` (this rank's communicator is gone and will send nothing
//! more). A receive fails at once on either instead of waiting for its timeout.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use autopar_ir::{Op, TensorType};

use super::shared::World;
use crate::error::RuntimeError;
use crate::tensor::Data;

/// Which conversation a data message belongs to. Members of a group number their
/// collectives on that group in call order; a pair of ranks numbers its point-to-point
/// messages per direction.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Channel {
    /// The `seq`-th collective on the group with these members; `step` within its algorithm.
    Collective {
        members: Arc<[usize]>,
        seq: u64,
        step: u32,
    },
    /// The `seq`-th message from the sender to the receiver.
    PointToPoint { seq: u64 },
}

/// What a rank was doing when it sent a message: the op with the attributes that must agree
/// ([`describe`]), whether it was a `send`, and the type of its operand. Every member of a
/// collective must send the same signature. It is plain data, so that it can travel between
/// processes as well as between threads.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CallSignature {
    pub op: String,
    pub sends: bool,
    pub operand: TensorType,
}

impl CallSignature {
    pub(crate) fn new(op: &Op, operand: &TensorType) -> CallSignature {
        CallSignature {
            op: describe(op),
            sends: matches!(op, Op::Send { .. }),
            operand: operand.clone(),
        }
    }
}

impl std::fmt::Display for CallSignature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {}", self.op, self.operand)
    }
}

/// How the collective algorithms reach the other ranks: tagged data messages that carry the
/// signature of the call that sent them, and failure notices. [`Mailbox`] moves them between
/// threads; the MPI transport between processes.
pub(crate) trait Transport {
    /// This rank.
    fn rank(&self) -> usize;

    /// Sends `payload` to rank `to` on `channel`, without waiting for the receiver.
    fn send(
        &mut self,
        to: usize,
        channel: Channel,
        call: &Arc<CallSignature>,
        payload: Data,
        cx: &Context<'_>,
    ) -> Result<(), RuntimeError>;

    /// Waits, for at most the timeout, for the message from rank `from` on `channel`; fails
    /// early when a rank announces a failure or `from` goes away.
    fn recv(
        &mut self,
        from: usize,
        channel: &Channel,
        cx: &Context<'_>,
    ) -> Result<Delivery, RuntimeError>;

    /// Tells every other rank that this rank has failed with `error` (or passes on the
    /// failure of the rank `error` reports).
    fn announce_error(&mut self, error: &RuntimeError);
}

impl Transport for Mailbox {
    fn rank(&self) -> usize {
        Mailbox::rank(self)
    }

    fn send(
        &mut self,
        to: usize,
        channel: Channel,
        call: &Arc<CallSignature>,
        payload: Data,
        cx: &Context<'_>,
    ) -> Result<(), RuntimeError> {
        Mailbox::send(self, to, channel, call, payload, cx)
    }

    fn recv(
        &mut self,
        from: usize,
        channel: &Channel,
        cx: &Context<'_>,
    ) -> Result<Delivery, RuntimeError> {
        Mailbox::recv(self, from, channel, cx)
    }

    fn announce_error(&mut self, error: &RuntimeError) {
        Mailbox::announce_error(self, error);
    }
}

/// The op with the attributes that must agree between ranks, e.g. `all_gather(axes=[tp], dim=1)`.
pub(crate) fn describe(op: &Op) -> String {
    match op {
        Op::AllReduce { axes, reduce } => {
            format!("all_reduce(axes={axes:?}, {})", reduce.name())
        }
        Op::AllGather { axes, dim } => format!("all_gather(axes={axes:?}, dim={dim})"),
        Op::ReduceScatter { axes, dim, reduce } => {
            format!(
                "reduce_scatter(axes={axes:?}, dim={dim}, {})",
                reduce.name()
            )
        }
        Op::AllToAll {
            axes,
            split_dim,
            concat_dim,
        } => format!("all_to_all(axes={axes:?}, split_dim={split_dim}, concat_dim={concat_dim})"),
        Op::CollectiveBroadcast { axes, root } => {
            format!("collective_broadcast(axes={axes:?}, root={root})")
        }
        Op::Send { axis, shift } => format!("send(axis={axis}, shift={shift})"),
        Op::Recv { axis, shift, ty } => format!("recv(axis={axis}, shift={shift}, ty={ty})"),
        other => other.name().to_string(),
    }
}

/// One message between ranks.
pub(crate) enum Envelope {
    Data {
        from: usize,
        channel: Channel,
        call: Arc<CallSignature>,
        payload: Data,
    },
    /// The sender failed; `origin` is the rank whose failure started it all (the sender
    /// itself, or a peer whose failure the sender is passing on).
    Failed { origin: usize, reason: String },
    /// Rank `from` will send nothing more (its communicator is gone).
    Exited { from: usize },
}

/// The op and group a message is part of, for error messages.
pub(crate) struct Context<'a> {
    pub op: &'static str,
    pub group: &'a [usize],
}

/// A data message taken from the inbox.
pub(crate) struct Delivery {
    pub call: Arc<CallSignature>,
    pub payload: Data,
}

/// One rank's end of the transport.
pub(crate) struct Mailbox {
    rank: usize,
    inbox: Receiver<Envelope>,
    peers: Vec<Sender<Envelope>>,
    /// Messages that arrived before they were wanted, by sender and channel.
    early: HashMap<(usize, Channel), Delivery>,
    /// Failures announced so far: originating rank and reason.
    failed: BTreeMap<usize, String>,
    exited: BTreeSet<usize>,
    timeout: Duration,
    /// Fault injection: how many more data messages this rank sends before it panics.
    sends_before_panic: Option<usize>,
    /// What the ranks share besides the channels (the shared-memory collectives), told of
    /// every failure and exit the channels carry.
    world: Arc<World>,
}

impl Mailbox {
    /// The mailboxes of `n` ranks, wired to one another, which also post their failure and
    /// exit notices to `world`.
    pub(crate) fn connect(n: usize, timeout: Duration, world: &Arc<World>) -> Vec<Mailbox> {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..n).map(|_| std::sync::mpsc::channel()).unzip();
        receivers
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| Mailbox {
                rank,
                inbox,
                peers: senders.clone(),
                early: HashMap::new(),
                failed: BTreeMap::new(),
                exited: BTreeSet::new(),
                timeout,
                sends_before_panic: None,
                world: Arc::clone(world),
            })
            .collect()
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Makes this rank panic when it is about to send its `(n + 1)`-th data message from now
    /// on, to test how the others cope with a rank that dies mid-collective.
    pub(crate) fn panic_after_sends(&mut self, n: usize) {
        self.sends_before_panic = Some(n);
    }

    /// Counts one data message of `op` against the fault injection of
    /// [`panic_after_sends`](Self::panic_after_sends), panicking when its turn has come. The
    /// shared-memory collectives count each publication of their data as one.
    pub(crate) fn fault_point(&mut self, op: &str) {
        if let Some(left) = &mut self.sends_before_panic {
            if *left == 0 {
                panic!("rank {} killed by fault injection during `{op}`", self.rank);
            }
            *left -= 1;
        }
    }

    /// Sends `payload` to rank `to`. Never blocks: the inbox is unbounded.
    pub(crate) fn send(
        &mut self,
        to: usize,
        channel: Channel,
        call: &Arc<CallSignature>,
        payload: Data,
        cx: &Context<'_>,
    ) -> Result<(), RuntimeError> {
        self.fault_point(cx.op);
        let delivered = self.peers.get(to).is_some_and(|peer| {
            peer.send(Envelope::Data {
                from: self.rank,
                channel,
                call: Arc::clone(call),
                payload,
            })
            .is_ok()
        });
        if delivered {
            return Ok(());
        }
        // The peer is gone. A peer that failed said so before it went, so its notice (or the
        // one it passed on) is in the inbox already.
        self.take_notices();
        Err(self
            .failure(cx)
            .unwrap_or_else(|| RuntimeError::PeerExited {
                op: cx.op,
                group: cx.group.to_vec(),
                rank: self.rank,
                peer: to,
            }))
    }

    /// Moves everything already in the inbox to where `recv` looks for it, without waiting.
    fn take_notices(&mut self) {
        while let Ok(envelope) = self.inbox.try_recv() {
            self.file(envelope);
        }
    }

    /// Records a message that is not the one being waited for.
    fn file(&mut self, envelope: Envelope) {
        match envelope {
            Envelope::Data {
                from,
                channel,
                call,
                payload,
            } => {
                let previous = self
                    .early
                    .insert((from, channel), Delivery { call, payload });
                debug_assert!(previous.is_none(), "two messages on one channel");
            }
            Envelope::Failed { origin, reason } => {
                self.failed.entry(origin).or_insert(reason);
            }
            Envelope::Exited { from } => {
                self.exited.insert(from);
            }
        }
    }

    /// The error to report when some rank has announced a failure.
    fn failure(&self, cx: &Context<'_>) -> Option<RuntimeError> {
        let (&origin, reason) = self.failed.iter().next()?;
        Some(RuntimeError::PeerFailed {
            op: cx.op,
            group: cx.group.to_vec(),
            rank: self.rank,
            failed_rank: origin,
            reason: reason.clone(),
        })
    }

    /// Waits for the message from rank `from` on `channel`, for at most the timeout. Fails
    /// early when any rank announces a failure or `from` exits without having sent it.
    pub(crate) fn recv(
        &mut self,
        from: usize,
        channel: &Channel,
        cx: &Context<'_>,
    ) -> Result<Delivery, RuntimeError> {
        let key = (from, channel.clone());
        if let Some(d) = self.early.remove(&key) {
            return Ok(d);
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(e) = self.failure(cx) {
                return Err(e);
            }
            // Messages from one sender arrive in order, so once its exit notice is in,
            // everything it sent before is in `early` already.
            if self.exited.contains(&from) {
                return Err(RuntimeError::PeerExited {
                    op: cx.op,
                    group: cx.group.to_vec(),
                    rank: self.rank,
                    peer: from,
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RuntimeError::CollectiveTimeout {
                    op: cx.op,
                    group: cx.group.to_vec(),
                    rank: self.rank,
                    peer: from,
                    timeout: self.timeout,
                });
            }
            match self.inbox.recv_timeout(left) {
                Ok(Envelope::Data {
                    from: sender,
                    channel: ch,
                    call,
                    payload,
                }) if sender == from && ch == *channel => return Ok(Delivery { call, payload }),
                Ok(envelope) => self.file(envelope),
                Err(RecvTimeoutError::Timeout) => {}
                // This mailbox holds a sender into its own inbox, so this cannot happen; if it
                // did, nothing more could arrive.
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(RuntimeError::PeerExited {
                        op: cx.op,
                        group: cx.group.to_vec(),
                        rank: self.rank,
                        peer: from,
                    });
                }
            }
        }
    }

    /// Tells every other rank that this rank has failed with `error`. When the error only
    /// reports another rank's failure, that rank's failure is passed on instead, so that every
    /// rank learns which one started it.
    pub(crate) fn announce_error(&self, error: &RuntimeError) {
        match error.innermost() {
            RuntimeError::PeerFailed {
                failed_rank,
                reason,
                ..
            } => self.announce_failure(*failed_rank, reason),
            other => self.announce_failure(self.rank, &other.to_string()),
        }
    }

    /// Tells every other rank that this run has failed, because of `origin` (this rank or a
    /// peer whose failure this rank observed).
    pub(crate) fn announce_failure(&self, origin: usize, reason: &str) {
        self.world.fail(origin, reason);
        for (to, peer) in self.peers.iter().enumerate() {
            if to != self.rank {
                // A peer that is gone needs no warning.
                let _ = peer.send(Envelope::Failed {
                    origin,
                    reason: reason.to_string(),
                });
            }
        }
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.announce_failure(self.rank, "the rank's thread panicked");
        }
        for (to, peer) in self.peers.iter().enumerate() {
            if to != self.rank {
                let _ = peer.send(Envelope::Exited { from: self.rank });
            }
        }
        self.world.exit(self.rank);
    }
}
