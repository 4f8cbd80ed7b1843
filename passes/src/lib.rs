//! autopar's compiler passes over the IR: autodiff, sharding propagation, SPMD partitioning,
//! pipeline splitting, rewrites and strategy search.
//!
//! Passes are plain functions from a graph (and a context) to a graph; the verifier runs
//! between them. The crate depends on `autopar-ir` and `autopar-cost-model` only, and the
//! runtime never depends on it, so the reference interpreter can judge what passes produce.
//!
//! - [`autodiff`]: reverse-mode differentiation, a VJP rule per op.
//! - [`train`]: the training-step graph (forward, backward, optimizer, mixed precision,
//!   gradient accumulation) and its execution order.
//! - [`recompute`]: activation recompute as a transformation of the step graph.
//! - [`search`]: the joint search over training plans on a cluster, driven by the cost
//!   model, with exact pruning.
//! - [`sharding`]: the per-op sharding strategies (valid operand/result placements along one
//!   mesh axis) and the local lowerings some of them need.
//! - [`propagate`]: sharding propagation from annotations to a complete sharding of every
//!   value, with the chosen strategy of every node as a side table.
//! - [`partition`]: SPMD partitioning into per-rank local programs with explicit collectives.
//! - [`expert_parallel`]: expert parallelism on the `ep` axis as placements.
//! - [`parallelize`]: data parallelism and ZeRO as placements, annotation files, and the
//!   driver that propagates and verifies.
//! - [`context_parallel`]: the load-balanced sequence layout and the placements of context
//!   parallelism (ring attention over the `cp` axis).
//! - [`collectives`]: bucketing of gradient all-reduces and batching of small ones in
//!   partitioned programs.
//! - [`pipeline`]: cutting a step into balanced pipeline stages and per-micro-batch
//!   sub-programs.
//! - [`fuse`]: the rewrite pass over rank programs (egg): algebraic simplification, CSE of
//!   identical collectives, and element-wise regions fused into `fusion` nodes.

pub mod autodiff;
pub mod collectives;
pub mod context_parallel;
pub mod error;
pub mod expert_parallel;
pub mod fuse;
pub mod parallelize;
pub mod partition;
pub mod pipeline;
pub mod propagate;
pub mod recompute;
pub mod search;
pub mod sharding;
pub mod train;

pub use error::PassError;
