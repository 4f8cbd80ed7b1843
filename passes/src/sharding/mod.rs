//! Per-op sharding strategies: for every op, the placements of its operands and results along
//! one mesh axis under which running a local kernel on each device's shards gives each
//! device's shard of the global result.
//!
//! - [`strategies`] lists them ([`rules`] holds the table, one exhaustive `match` on
//!   [`autopar_ir::Op`]). A value sharded over several mesh axes takes one strategy per
//!   axis: query the axes in the order they split dims (outermost first), each time with the
//!   local operand types the previous axes left.
//! - [`Strategy::kernel`] says what each device runs: the op itself with its shape attributes
//!   made local ([`local_op`]), or a [`Lowering`] into several local ops and, for
//!   cross-entropy, collectives ([`lower()`]).
//!
//! Collectives are not listed here; the partitioner inserts them where a producer's placement
//! differs from what a consumer's strategy needs, as planned by [`autopar_ir::reshard`].

pub mod error;
pub mod local;
pub mod lower;
pub mod rules;
pub mod strategy;

pub use error::ShardingError;
pub use local::{local_op, local_type};
pub use lower::{ShardContext, iota, lower};
pub use rules::strategies;
pub use strategy::{LocalKernel, Lowering, Strategy};
