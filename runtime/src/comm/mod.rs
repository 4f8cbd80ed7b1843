//! Communication between ranks: groups derived from mesh axes, and the in-process
//! communicator that runs every collective and point-to-point op of the IR between threads.
//!
//! The [`crate::Communicator`] trait is the interface the interpreter calls;
//! [`InProcessCommunicator`] implements it for ranks that are threads of one process, moving
//! real data between them with ring, pairwise and tree algorithms. No collective can hang: a
//! receive waits at most [`CommOptions::timeout`], and a rank that fails or goes away makes
//! the others fail at their next receive.

mod blocks;
mod group;
mod in_process;
mod mailbox;

pub use group::{group_members, shifted_rank};
pub use in_process::{CommOptions, InProcessCommunicator, in_process_communicators};
