//! The MPI communicator: ranks are processes started by `mpirun`, one mesh rank per process,
//! running the same algorithms as the in-process communicator (`comm::endpoint`) over MPI
//! point-to-point messages, so that reductions add in the same order and give the same bits.
//!
//! A connection ([`MpiConnection`]) makes the communicators of a mesh once, collectively over
//! the MPI world: a base communicator of the processes that hold a mesh rank (point-to-point
//! messages and failure notices travel on it) and one sub-communicator per set of mesh axes a
//! group can span (`MPI_Comm_split` by the coordinates off those axes), on which that group's
//! collectives travel. They are made up front, because a split is collective over all
//! processes: a lazily made one would deadlock a pipeline whose stages reach their first
//! collective on a group at different times, and a per-launch one would block every rank in
//! the split once one has died. Each launch is an epoch of the connection that every message
//! carries, so that nothing one launch left in flight is taken for the next one's.
//!
//! No call blocks without a deadline. Sends are buffered (`MPI_Bsend` into a buffer attached
//! once per process), so they complete whatever the receiver does, the way a message is
//! posted to a thread's inbox. Receives poll (`MPI_Improbe`) for the message they want and
//! for notices from the other ranks (a failure, or a rank that has left), for at most the
//! communicator's timeout, and then fail naming the collective, the group and the rank that
//! held them up: a rank that has waited a while tells the others whom it waits for, so that
//! a timeout follows the chain of waiting ranks to the one that waits for nobody (dead, stuck
//! or computing) instead of blaming a peer that waits too. A matched message is received
//! without blocking too (`MPI_Imrecv`, tested as the wait goes on): a large message's body
//! follows its envelope only while the sender makes progress, and a sender that died in
//! between would hold a blocking receive forever. Polling rather than waiting inside MPI
//! lets a rank report and the job end within the timeout whether a peer died, diverged or is
//! stuck, without a watchdog thread.
//!
//! A message is a little-endian byte string: the channel (which collective, or which
//! point-to-point message, and which step of its algorithm), the signature of the call that
//! sent it, and the elements. Floats travel at the width of their dtype when that loses
//! nothing (a rounded f32 or bf16 tensor), and as `f64` otherwise (the partial sums of a
//! reduction); integers as `i32` when they fit.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::mem::ManuallyDrop;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::mpi::Threading;
use ::mpi::datatype::Equivalence;
use ::mpi::environment::Universe;
use ::mpi::point_to_point::{Destination, Message, Source, Status};
use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::{Color, Communicator, SimpleCommunicator};
use autopar_ir::{DType, DeviceMesh, TensorType};

use super::CommOptions;
use super::endpoint::{Endpoint, delegate_collectives};
use super::mailbox::{CallSignature, Channel, Context, Delivery, Transport};
use crate::error::RuntimeError;
use crate::tensor::Data;

/// Tag of data messages.
const DATA: i32 = 1;
/// Tag of notices (a rank failed, a rank left).
const NOTICE: i32 = 2;
/// Bytes attached for buffered sends: what may be in flight from one process at once.
/// Pages are only touched as messages use them.
const SEND_BUFFER_BYTES: usize = 1 << 30;
/// The largest message one send may post (the buffer keeps room for a few more).
const MAX_MESSAGE_BYTES: usize = SEND_BUFFER_BYTES / 4;
/// How long a receiver keeps looking for a peer's messages after the peer said it left
/// (notices and data travel on different communicators, whose relative order MPI does not
/// fix).
const EXIT_GRACE: Duration = Duration::from_millis(200);

/// The MPI environment of this process, set up on first use and ended by [`finalize`].
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);
static FINALIZED: AtomicBool = AtomicBool::new(false);

/// Whether this process was started by an MPI launcher (`mpirun`/`mpiexec` of Open MPI or
/// MPICH, or a PMI-speaking resource manager), judged from the environment it set.
pub fn started_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

fn setup_error(detail: impl Into<String>) -> RuntimeError {
    RuntimeError::SpmdSetup {
        detail: detail.into(),
    }
}

/// Runs `f` on the world communicator, initialising MPI (with the send buffer attached) the
/// first time.
pub(super) fn with_world<R>(f: impl FnOnce(&SimpleCommunicator) -> R) -> Result<R, RuntimeError> {
    let mut guard = UNIVERSE.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(setup_error("MPI has been finalised in this process"));
        }
        if !started_by_mpirun() {
            return Err(setup_error(
                "the MPI launcher needs processes started by mpirun (e.g. `autopar launch -n N \
                 -- run ...` or `mpirun -np N autopar run ... --launcher mpi`); this one was not",
            ));
        }
        let (mut universe, _) = ::mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| setup_error("MPI was initialised outside autopar"))?;
        universe.set_buffer_size(SEND_BUFFER_BYTES);
        *guard = Some(universe);
    }
    let universe = guard
        .as_ref()
        .ok_or_else(|| setup_error("MPI is not initialised"))?;
    Ok(f(&universe.world()))
}

/// This process's rank in the MPI world and the world's size, initialising MPI if needed.
pub fn world_rank_and_size() -> Result<(usize, usize), RuntimeError> {
    with_world(|w| (w.rank() as usize, w.size() as usize))
}

/// Ends MPI in this process (`MPI_Finalize`), if it was started: call it once every rank has
/// succeeded, before the process exits. A process that failed calls [`abort_job`] instead.
pub fn finalize() {
    let mut guard = UNIVERSE.lock().unwrap_or_else(|p| p.into_inner());
    if guard.take().is_some() {
        FINALIZED.store(true, Ordering::SeqCst);
    }
}

/// Ends the whole MPI job with exit code `code` (`MPI_Abort` on the world), or just this
/// process when MPI was never started.
pub fn abort_job(code: i32) -> ! {
    let guard = UNIVERSE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(u) = guard.as_ref() {
        u.world().abort(code);
    }
    std::process::exit(code)
}

/// The communicators of one mesh among MPI processes, made once (collectively) and used by
/// every launch after: a rank that dies cannot then block the others in a communicator
/// split. Each launch is an epoch; every message carries its epoch, so that what one launch
/// left in flight (a notice nobody waited for, the data of a failed collective) is never
/// taken for the next one's.
pub struct MpiConnection {
    shared: Rc<RefCell<Shared>>,
    next_epoch: Cell<u64>,
}

impl MpiConnection {
    /// Connects this process for `mesh`: called by every process of the MPI world at once.
    /// Processes `0..n` take mesh ranks `0..n` (`n` the mesh's device count); a world with
    /// more processes leaves the rest out (`Ok(None)` there). A smaller world is an error.
    pub fn new(mesh: &DeviceMesh) -> Result<Option<MpiConnection>, RuntimeError> {
        Ok(Shared::connect(mesh)?.map(|shared| MpiConnection {
            shared: Rc::new(RefCell::new(shared)),
            next_epoch: Cell::new(0),
        }))
    }

    /// This rank's communicator for the next launch.
    pub fn communicator(&self, options: CommOptions) -> MpiCommunicator {
        let epoch = self.next_epoch.get();
        self.next_epoch.set(epoch + 1);
        let (rank, mesh) = {
            let s = self.shared.borrow();
            (s.rank, Arc::clone(&s.mesh))
        };
        let mut transport = MpiTransport {
            shared: Rc::clone(&self.shared),
            epoch,
            rank,
            failed: BTreeMap::new(),
            exited: BTreeMap::new(),
            timeout: options.timeout,
        };
        let held = std::mem::take(&mut self.shared.borrow_mut().notices);
        for (e, from, notice) in held {
            transport.file_notice(e, from, notice);
        }
        MpiCommunicator {
            inner: Endpoint::new(mesh, transport, options.precision),
        }
    }
}

/// One rank's communicator among MPI processes, for one launch ([`MpiConnection`]); it
/// implements [`super::Collectives`] with the same algorithms, reduction order, error reports
/// and timeouts as the in-process communicator. Dropping it tells the other ranks that it
/// has gone.
pub struct MpiCommunicator {
    inner: Endpoint<MpiTransport>,
}

delegate_collectives!(MpiCommunicator);

impl MpiCommunicator {
    /// A communicator of its own for one launch: [`MpiConnection::new`] and its first
    /// communicator (collective over every process of the world).
    pub fn connect(
        mesh: &DeviceMesh,
        options: CommOptions,
    ) -> Result<Option<MpiCommunicator>, RuntimeError> {
        Ok(MpiConnection::new(mesh)?.map(|c| c.communicator(options)))
    }
}

/// What the launches of one connection share: the communicators, and messages and notices
/// that arrived before the launch they belong to.
struct Shared {
    rank: usize,
    n: usize,
    mesh: Arc<DeviceMesh>,
    /// Never freed, nor are the groups' communicators: Open MPI reuses the context id of a
    /// freed communicator and hands a message still in flight on the old one to the new one.
    /// A connection leaks a few small communicators instead.
    base: ManuallyDrop<SimpleCommunicator>,
    /// The communicator of every group, by the mask of the mesh axes (of size above one) it
    /// spans.
    groups: ManuallyDrop<HashMap<u64, SimpleCommunicator>>,
    /// Data messages that arrived before they were wanted, by epoch, sender and channel.
    early: HashMap<(u64, usize, Channel), Delivery>,
    /// Notices of later epochs than the launch that received them.
    notices: Vec<(u64, usize, Notice)>,
    /// Ranks that said they have been waiting a while, and for which rank. What a rank waits
    /// for is a fact about the process, whichever launch it is in: a rank still waiting in an
    /// earlier launch (on a peer that died with its message half sent) holds up the ranks
    /// that have gone on to the next, and the chain must run through it.
    waiting: BTreeMap<usize, usize>,
}

impl Shared {
    fn connect(mesh: &DeviceMesh) -> Result<Option<Shared>, RuntimeError> {
        let n = mesh.num_devices();
        let split = with_world(|world| {
            let (rank, size) = (world.rank() as usize, world.size() as usize);
            if size < n {
                return Err(setup_error(format!(
                    "the mesh `{mesh}` has {n} ranks but MPI started {size} processes"
                )));
            }
            let color = if rank < n {
                Color::with_value(0)
            } else {
                Color::undefined()
            };
            Ok(world
                .split_by_color_with_key(color, rank as i32)
                .map(|base| (rank, base)))
        })??;
        let Some((rank, base)) = split else {
            return Ok(None);
        };
        let varying: Vec<usize> = (0..mesh.axes().len())
            .filter(|&i| mesh.axes()[i].size > 1)
            .collect();
        if varying.len() > 16 {
            return Err(setup_error(format!("the mesh `{mesh}` has too many axes")));
        }
        let mut groups = HashMap::new();
        for subset in 1u64..(1 << varying.len()) {
            let mask = varying
                .iter()
                .enumerate()
                .filter(|(bit, _)| subset & (1 << bit) != 0)
                .fold(0u64, |m, (_, &axis)| m | 1 << axis);
            // The group is the ranks that agree off the masked axes: colour by those
            // coordinates, order by rank.
            let mut coords = mesh.coords(rank);
            for (axis, c) in coords.iter_mut().enumerate() {
                if mask & (1 << axis) != 0 {
                    *c = 0;
                }
            }
            let color = Color::with_value(mesh.linear(&coords) as i32);
            let comm = base
                .split_by_color_with_key(color, rank as i32)
                .ok_or_else(|| setup_error("a group communicator split gave nothing"))?;
            groups.insert(mask, comm);
        }
        Ok(Some(Shared {
            rank,
            n,
            mesh: Arc::new(mesh.clone()),
            base: ManuallyDrop::new(base),
            groups: ManuallyDrop::new(groups),
            early: HashMap::new(),
            notices: Vec::new(),
            waiting: BTreeMap::new(),
        }))
    }

    /// The communicator a message to or from `peer` on `channel` travels on, and the peer's
    /// rank there.
    fn route(
        &self,
        peer: usize,
        channel: &Channel,
    ) -> Result<(&SimpleCommunicator, i32), RuntimeError> {
        match channel {
            Channel::PointToPoint { .. } => Ok((&self.base, peer as i32)),
            Channel::Collective { members, .. } => {
                let first = self.mesh.coords(members[0]);
                let mut mask = 0u64;
                for &m in members.iter() {
                    for (axis, (a, b)) in self.mesh.coords(m).iter().zip(&first).enumerate() {
                        if a != b {
                            mask |= 1 << axis;
                        }
                    }
                }
                if mask == 0 {
                    // A group of one: only messages to oneself.
                    return Ok((&self.base, peer as i32));
                }
                let comm = self.groups.get(&mask).ok_or_else(|| {
                    setup_error(format!("no communicator for the group {members:?}"))
                })?;
                Ok((comm, members.iter().filter(|&&m| m < peer).count() as i32))
            }
        }
    }

    fn notify_all(&self, bytes: &[u8]) {
        for to in (0..self.n).filter(|&r| r != self.rank) {
            self.base
                .process_at_rank(to as i32)
                .buffered_send_with_tag(bytes, NOTICE);
        }
    }
}

/// The MPI end of one rank in one launch: its epoch and the notices of that epoch.
pub(crate) struct MpiTransport {
    shared: Rc<RefCell<Shared>>,
    epoch: u64,
    rank: usize,
    /// Failures announced so far: originating rank and reason.
    failed: BTreeMap<usize, String>,
    /// Ranks that said they left, and when this rank learnt it.
    exited: BTreeMap<usize, Instant>,
    timeout: Duration,
}

impl MpiTransport {
    /// The rank that holds up a wait for `peer`: `peer`, unless it said it is waiting for
    /// another rank, and so on along the chain (a rank that died waits for nobody). A cycle
    /// (ranks waiting for each other: a divergence) blames the direct peer.
    fn blame(&self, peer: usize) -> usize {
        let shared = self.shared.borrow();
        let mut blamed = peer;
        let mut seen = vec![self.rank, peer];
        while let Some(&next) = shared.waiting.get(&blamed) {
            if seen.contains(&next) {
                return peer;
            }
            seen.push(next);
            blamed = next;
        }
        blamed
    }

    fn tell_waiting(&self, on: Option<usize>) {
        let notice = Notice::Waiting {
            on: on.map_or(u64::MAX, |r| r as u64),
        };
        self.shared
            .borrow()
            .notify_all(&encode_notice(self.epoch, &notice));
    }

    /// Files every notice that has arrived.
    fn take_notices(&mut self) {
        loop {
            let got = {
                let shared = self.shared.borrow();
                shared
                    .base
                    .any_process()
                    .immediate_matched_probe_with_tag(NOTICE)
            };
            let Some((msg, status)) = got else { break };
            let from = status.source_rank() as usize;
            // Notices are short; one that never finishes arriving holds this rank no longer
            // than a receive's timeout.
            let bytes = Incoming::start(msg, &status).finish_by(Instant::now() + self.timeout);
            match bytes.as_deref().and_then(decode_notice) {
                Some((epoch, notice)) => self.file_notice(epoch, from, notice),
                // A notice this rank cannot read (or that never finished arriving) still
                // means something went wrong there.
                None => {
                    self.failed.entry(from).or_insert_with(|| {
                        match bytes {
                            Some(_) => "sent an unreadable notice",
                            None => "began a notice and never finished it",
                        }
                        .into()
                    });
                }
            }
        }
    }

    fn file_notice(&mut self, epoch: u64, from: usize, notice: Notice) {
        match notice {
            // Filed whatever its epoch: notices from one rank arrive in the order it sent them,
            // so the last one filed is what it waits for now.
            Notice::Waiting { on } => {
                let mut shared = self.shared.borrow_mut();
                match usize::try_from(on) {
                    Ok(on) if on < shared.n => shared.waiting.insert(from, on),
                    _ => shared.waiting.remove(&from),
                };
            }
            notice if epoch > self.epoch => {
                self.shared.borrow_mut().notices.push((epoch, from, notice));
            }
            _ if epoch < self.epoch => {}
            Notice::Failed { origin, reason } => {
                self.failed.entry(origin).or_insert(reason);
            }
            Notice::Exited => {
                self.exited.entry(from).or_insert_with(Instant::now);
            }
        }
    }

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

    fn announce_failure(&self, origin: usize, reason: &str) {
        let notice = Notice::Failed {
            origin,
            reason: reason.to_string(),
        };
        self.shared
            .borrow()
            .notify_all(&encode_notice(self.epoch, &notice));
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn send(
        &mut self,
        to: usize,
        channel: Channel,
        call: &Arc<CallSignature>,
        payload: Data,
        cx: &Context<'_>,
    ) -> Result<(), RuntimeError> {
        let bytes = encode_data(self.epoch, &channel, call, &payload);
        if bytes.len() > MAX_MESSAGE_BYTES {
            return Err(setup_error(format!(
                "`{}` over ranks {:?}: a message of {} bytes exceeds the MPI communicator's \
                 limit of {MAX_MESSAGE_BYTES}",
                cx.op,
                cx.group,
                bytes.len()
            )));
        }
        let shared = self.shared.borrow();
        let (comm, dest) = shared.route(to, &channel)?;
        comm.process_at_rank(dest)
            .buffered_send_with_tag(&bytes[..], DATA);
        Ok(())
    }

    fn recv(
        &mut self,
        from: usize,
        channel: &Channel,
        cx: &Context<'_>,
    ) -> Result<Delivery, RuntimeError> {
        let key = (self.epoch, from, channel.clone());
        if let Some(d) = self.shared.borrow_mut().early.remove(&key) {
            return Ok(d);
        }
        let started = Instant::now();
        let deadline = started + self.timeout;
        // After a while, the others learn whom this rank waits for, so that a timeout names
        // the rank that holds everyone up rather than a peer that waits too.
        let tell_after = (self.timeout / 4).min(Duration::from_secs(1));
        let mut told = false;
        let mut idle = 0u32;
        // A message matched for this receive whose body is still arriving; one left
        // unfinished when the receive fails stays with MPI (see [`Incoming`]).
        let mut incoming = None;
        let outcome = loop {
            if !told && started.elapsed() >= tell_after {
                self.tell_waiting(Some(from));
                told = true;
            }
            match self.poll(from, channel, &mut incoming, cx) {
                Ok(Some(d)) => break Ok(d),
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            if Instant::now() >= deadline {
                break Err(RuntimeError::CollectiveTimeout {
                    op: cx.op,
                    group: cx.group.to_vec(),
                    rank: self.rank,
                    peer: self.blame(from),
                    timeout: self.timeout,
                });
            }
            back_off(&mut idle);
        };
        // A rank whose wait failed goes on holding up whoever waits for it: it says so no
        // more only when the message came.
        if told && outcome.is_ok() {
            self.tell_waiting(None);
        }
        outcome
    }

    fn announce_error(&mut self, error: &RuntimeError) {
        match error.innermost() {
            RuntimeError::PeerFailed {
                failed_rank,
                reason,
                ..
            } => self.announce_failure(*failed_rank, reason),
            other => self.announce_failure(self.rank, &other.to_string()),
        }
    }
}

impl MpiTransport {
    /// One look for the message from `from` on `channel`: `Some` when it is here, an error
    /// when a rank failed or `from` left.
    fn poll(
        &mut self,
        from: usize,
        channel: &Channel,
        incoming: &mut Option<Incoming>,
        cx: &Context<'_>,
    ) -> Result<Option<Delivery>, RuntimeError> {
        loop {
            self.take_notices();
            if let Some(e) = self.failure(cx) {
                return Err(e);
            }
            let pending = match incoming.take() {
                Some(pending) => Some(pending),
                None => {
                    let shared = self.shared.borrow();
                    let (comm, source) = shared.route(from, channel)?;
                    comm.process_at_rank(source)
                        .immediate_matched_probe_with_tag(DATA)
                        .map(|(msg, status)| Incoming::start(msg, &status))
                }
            };
            if let Some(pending) = pending {
                // A large message's body follows its envelope only while the sender makes
                // progress: until it is all here, this receive goes on waiting as for any
                // message (telling the others, watching notices, keeping its deadline).
                let bytes = match pending.test() {
                    Ok(bytes) => bytes,
                    Err(pending) => {
                        *incoming = Some(pending);
                        return Ok(None);
                    }
                };
                let (epoch, ch, d) =
                    decode_data(&bytes).ok_or_else(|| RuntimeError::CollectiveMismatch {
                        op: cx.op,
                        group: cx.group.to_vec(),
                        rank: self.rank,
                        peer: from,
                        ours: "a readable message".into(),
                        theirs: format!("{} unreadable bytes", bytes.len()),
                    })?;
                if epoch == self.epoch && ch == *channel {
                    return Ok(Some(d));
                }
                // Later in this launch, or in a later one; one of an earlier launch is dead.
                if epoch >= self.epoch {
                    self.shared.borrow_mut().early.insert((epoch, from, ch), d);
                }
                continue;
            }
            if self
                .exited
                .get(&from)
                .is_some_and(|t| t.elapsed() >= EXIT_GRACE)
            {
                return Err(RuntimeError::PeerExited {
                    op: cx.op,
                    group: cx.group.to_vec(),
                    rank: self.rank,
                    peer: from,
                });
            }
            return Ok(None);
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.announce_failure(self.rank, "the rank panicked");
        }
        let exited = encode_notice(self.epoch, &Notice::Exited);
        self.shared.borrow().notify_all(&exited);
        // This launch's leftovers can never be wanted again.
        let epoch = self.epoch;
        self.shared.borrow_mut().early.retain(|k, _| k.0 > epoch);
    }
}

/// A message a probe matched, being received without blocking (`MPI_Imrecv`): a large
/// message's body follows its envelope only while the sender makes progress, and
/// `MPI_Mrecv` would wait forever for a sender that died in between.
///
/// A receive that MPI has begun cannot be withdrawn. Dropping an unfinished `Incoming` (its
/// receive failed) therefore leaves the request and the buffer with MPI for the life of the
/// process, deliberately: the price, paid once on the way to a failed job, of a receive that
/// never blocks past its deadline.
struct Incoming {
    /// Never dropped: `Request` panics when dropped unfinished, and a finished one is taken
    /// out by [`Incoming::test`].
    request: ManuallyDrop<Request<'static, [u8]>>,
    /// The allocation MPI writes into, ours again once the receive completes.
    buffer: *mut [u8],
}

impl Incoming {
    #[allow(unsafe_code)]
    fn start(msg: Message, status: &Status) -> Incoming {
        let len = usize::try_from(status.count(u8::equivalent_datatype())).unwrap_or(0);
        let buffer: *mut [u8] = Box::into_raw(vec![0u8; len].into_boxed_slice());
        // SAFETY: `buffer` is a live allocation that nothing else refers to; it is lent to MPI
        // until the receive completes, or for the life of the process.
        let request = msg.immediate_matched_receive_into(StaticScope, unsafe { &mut *buffer });
        Incoming {
            request: ManuallyDrop::new(request),
            buffer,
        }
    }

    /// The message, if it has all arrived; else the receive, still in progress.
    #[allow(unsafe_code)]
    fn test(mut self) -> Result<Vec<u8>, Incoming> {
        // SAFETY: `self.request` is not used again: it is moved back into `self` on `Err`,
        // and `self` is consumed on `Ok`.
        let request = unsafe { ManuallyDrop::take(&mut self.request) };
        match request.test() {
            // SAFETY: the receive is complete, so MPI no longer writes to the buffer, and the
            // request that borrowed it is gone: the allocation is ours again.
            Ok(_) => Ok(unsafe { Box::from_raw(self.buffer) }.into_vec()),
            Err(pending) => {
                self.request = ManuallyDrop::new(pending);
                Err(self)
            }
        }
    }

    /// The message, waiting for the rest of it until `deadline` at most.
    fn finish_by(mut self, deadline: Instant) -> Option<Vec<u8>> {
        let mut idle = 0u32;
        loop {
            match self.test() {
                Ok(bytes) => return Some(bytes),
                Err(pending) => self = pending,
            }
            if Instant::now() >= deadline {
                return None;
            }
            back_off(&mut idle);
        }
    }
}

/// Waits a little before the next poll: yields the processor at first (a peer on the same
/// core may be about to send), then sleeps, so that ranks oversubscribing the cores do not
/// starve the ones that compute.
fn back_off(idle: &mut u32) {
    *idle = idle.saturating_add(1);
    match *idle {
        0..64 => std::thread::yield_now(),
        64..2048 => std::thread::sleep(Duration::from_micros(20)),
        _ => std::thread::sleep(Duration::from_micros(500)),
    }
}

enum Notice {
    Failed {
        origin: usize,
        reason: String,
    },
    Exited,
    /// The sender has been waiting a while for rank `on` (`u64::MAX`: it no longer waits).
    Waiting {
        on: u64,
    },
}

fn encode_notice(epoch: u64, n: &Notice) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(epoch);
    match n {
        Notice::Failed { origin, reason } => {
            w.u8(0);
            w.u64(*origin as u64);
            w.str(reason);
        }
        Notice::Exited => w.u8(1),
        Notice::Waiting { on } => {
            w.u8(2);
            w.u64(*on);
        }
    }
    w.0
}

fn decode_notice(bytes: &[u8]) -> Option<(u64, Notice)> {
    let mut r = Reader(bytes);
    let epoch = r.u64()?;
    let notice = match r.u8()? {
        0 => Notice::Failed {
            origin: r.u64()? as usize,
            reason: r.str()?,
        },
        1 => Notice::Exited,
        2 => Notice::Waiting { on: r.u64()? },
        _ => return None,
    };
    Some((epoch, notice))
}

/// How a message's elements are laid out.
#[derive(Clone, Copy)]
enum Encoding {
    F64 = 0,
    F32 = 1,
    Bf16 = 2,
    F16 = 3,
    I64 = 4,
    I32 = 5,
    Bool = 6,
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
        DType::Bool => 5,
    }
}

fn dtype_of(code: u8) -> Option<DType> {
    Some(match code {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        3 => DType::I32,
        4 => DType::I64,
        5 => DType::Bool,
        _ => return None,
    })
}

/// The narrowest encoding of `v` (elements of a tensor of `dtype`) that loses nothing.
fn float_encoding(v: &[f64], dtype: DType) -> Encoding {
    let exact = |f: fn(f64) -> f64| v.iter().all(|&x| f(x).to_bits() == x.to_bits());
    match dtype {
        DType::F32 if exact(|x| x as f32 as f64) => Encoding::F32,
        DType::BF16 if exact(|x| half::bf16::from_f64(x).to_f64()) => Encoding::Bf16,
        DType::F16 if exact(|x| half::f16::from_f64(x).to_f64()) => Encoding::F16,
        _ => Encoding::F64,
    }
}

fn encode_data(epoch: u64, channel: &Channel, call: &CallSignature, payload: &Data) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + payload.len() * 8));
    w.u64(epoch);
    match channel {
        Channel::Collective { members, seq, step } => {
            w.u8(0);
            w.u64(*seq);
            w.u32(*step);
            w.u32(members.len() as u32);
            for &m in members.iter() {
                w.u32(m as u32);
            }
        }
        Channel::PointToPoint { seq } => {
            w.u8(1);
            w.u64(*seq);
        }
    }
    w.str(&call.op);
    w.u8(u8::from(call.sends));
    w.u8(dtype_code(call.operand.dtype));
    w.u32(call.operand.dims().len() as u32);
    for &d in call.operand.dims() {
        w.u64(d as u64);
    }
    match payload {
        Data::Float(v) => {
            let enc = float_encoding(v, call.operand.dtype);
            w.u8(enc as u8);
            w.u64(v.len() as u64);
            match enc {
                Encoding::F32 => v.iter().for_each(|&x| w.0.extend((x as f32).to_le_bytes())),
                Encoding::Bf16 => v
                    .iter()
                    .for_each(|&x| w.0.extend(half::bf16::from_f64(x).to_le_bytes())),
                Encoding::F16 => v
                    .iter()
                    .for_each(|&x| w.0.extend(half::f16::from_f64(x).to_le_bytes())),
                _ => v.iter().for_each(|&x| w.0.extend(x.to_le_bytes())),
            }
        }
        Data::Int(v) => {
            let narrow = v.iter().all(|&x| i32::try_from(x).is_ok());
            w.u8(if narrow { Encoding::I32 } else { Encoding::I64 } as u8);
            w.u64(v.len() as u64);
            if narrow {
                v.iter().for_each(|&x| w.0.extend((x as i32).to_le_bytes()));
            } else {
                v.iter().for_each(|&x| w.0.extend(x.to_le_bytes()));
            }
        }
        Data::Bool(v) => {
            w.u8(Encoding::Bool as u8);
            w.u64(v.len() as u64);
            w.0.extend(v.iter().map(|&b| u8::from(b)));
        }
    }
    w.0
}

fn decode_data(bytes: &[u8]) -> Option<(u64, Channel, Delivery)> {
    let mut r = Reader(bytes);
    let epoch = r.u64()?;
    let channel = match r.u8()? {
        0 => {
            let seq = r.u64()?;
            let step = r.u32()?;
            let n = r.u32()? as usize;
            let members = (0..n)
                .map(|_| r.u32().map(|m| m as usize))
                .collect::<Option<Vec<_>>>()?;
            Channel::Collective {
                members: members.into(),
                seq,
                step,
            }
        }
        1 => Channel::PointToPoint { seq: r.u64()? },
        _ => return None,
    };
    let op = r.str()?;
    let sends = r.u8()? != 0;
    let dtype = dtype_of(r.u8()?)?;
    let ndims = r.u32()? as usize;
    let dims = (0..ndims)
        .map(|_| r.u64().map(|d| d as usize))
        .collect::<Option<Vec<_>>>()?;
    let enc = r.u8()?;
    let len = usize::try_from(r.u64()?).ok()?;
    let payload = match enc {
        0 => Data::Float(r.elems(len, 8, |b| {
            f64::from_le_bytes(b.try_into().unwrap_or_default())
        })?),
        1 => Data::Float(r.elems(len, 4, |b| {
            f64::from(f32::from_le_bytes(b.try_into().unwrap_or_default()))
        })?),
        2 => Data::Float(r.elems(len, 2, |b| {
            half::bf16::from_le_bytes(b.try_into().unwrap_or_default()).to_f64()
        })?),
        3 => Data::Float(r.elems(len, 2, |b| {
            half::f16::from_le_bytes(b.try_into().unwrap_or_default()).to_f64()
        })?),
        4 => Data::Int(r.elems(len, 8, |b| {
            i64::from_le_bytes(b.try_into().unwrap_or_default())
        })?),
        5 => Data::Int(r.elems(len, 4, |b| {
            i64::from(i32::from_le_bytes(b.try_into().unwrap_or_default()))
        })?),
        6 => Data::Bool(r.elems(len, 1, |b| b[0] != 0)?),
        _ => return None,
    };
    let call = Arc::new(CallSignature {
        op,
        sends,
        operand: TensorType::new(dtype, dims),
    });
    Some((epoch, channel, Delivery { call, payload }))
}

/// Appends little-endian fields to a byte string.
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }

    fn u32(&mut self, x: u32) {
        self.0.extend(x.to_le_bytes());
    }

    fn u64(&mut self, x: u64) {
        self.0.extend(x.to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend(s.as_bytes());
    }
}

/// Reads what [`Writer`] wrote; `None` past the end.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn str(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }

    fn elems<T>(&mut self, len: usize, width: usize, read: impl Fn(&[u8]) -> T) -> Option<Vec<T>> {
        let bytes = self.take(len.checked_mul(width)?)?;
        Some(bytes.chunks_exact(width).map(read).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_at_the_narrowest_lossless_width() {
        let call = CallSignature {
            op: "all_gather(axes=[\"tp\"], dim=0)".into(),
            sends: false,
            operand: TensorType::new(DType::BF16, vec![3]),
        };
        let channel = Channel::Collective {
            members: vec![0, 2].into(),
            seq: 7,
            step: 1,
        };
        // bf16 values travel in two bytes; a partial sum that bf16 cannot hold in eight.
        for (values, bytes_per) in [(vec![1.0, -0.5, 3.0], 2), (vec![1.0, 1.0 + 1e-9, 0.0], 8)] {
            let bytes = encode_data(3, &channel, &call, &Data::Float(values.clone()));
            let (epoch, ch, d) = decode_data(&bytes).expect("decodes");
            assert_eq!(epoch, 3);
            assert_eq!(ch, channel);
            assert_eq!(*d.call, call);
            assert_eq!(d.payload, Data::Float(values));
            let header = encode_data(3, &channel, &call, &Data::Float(Vec::new())).len();
            assert_eq!(bytes.len() - header, 3 * bytes_per);
        }
        let ints = Data::Int(vec![1, -2, i64::MAX]);
        let (_, _, d) = decode_data(&encode_data(0, &channel, &call, &ints)).expect("decodes");
        assert_eq!(d.payload, ints);
        assert!(decode_data(&[0, 1, 2]).is_none());
    }
}
