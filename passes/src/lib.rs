//! autopar's compiler passes over the IR: autodiff, sharding propagation, SPMD partitioning,
//! pipeline splitting, rewrites and strategy search.
//!
//! Passes are plain functions from a graph (and a context) to a graph; the verifier runs
//! between them. The crate depends on `autopar-ir` and `autopar-cost-model` only, and the
//! runtime never depends on it, so the reference interpreter can judge what passes produce.
//! No pass exists yet; this fixes the crate boundary in the workspace.

pub mod search;
