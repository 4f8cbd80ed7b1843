//! autopar's cost model: cluster topology (nodes, GPUs, NVLink/NVSwitch and NIC fabrics), and
//! the compute, communication and memory costs of training plans on it, with a pipeline
//! simulation over the schedules of [`autopar_ir::schedule`].
//!
//! The crate depends only on `autopar-ir`. The entry points a driver calls are
//! [`Cluster::preset`] / [`Cluster::from_toml`], [`Plan::parse`],
//! [`TransformerConfig::from_graph`] (or a hand-written [`TransformerConfig`]) and
//! [`CostModel::estimate`]; passes receive the model as an [`OpCostModel`] and cost single
//! ops with it.

pub mod buckets;
pub mod calibrate;
pub mod cluster;
pub mod comm;
pub mod compute;
pub mod cost;
pub mod error;
pub mod estimate;
pub mod layer;
pub mod mapping;
pub mod memory;
pub mod model;
pub mod plan;
pub mod software;

pub use calibrate::{CalibrationReport, calibrate};
pub use cluster::Cluster;
pub use comm::{Collective, CommParams};
pub use compute::{AttentionKernel, ComputeParams, OpCost};
pub use cost::Cost;
pub use error::CostError;
pub use estimate::{
    BlockTimes, CostModel, Estimate, ExposedComm, OpCostModel, PassTime, StageTimes, TimeBreakdown,
    TimedCollective,
};
pub use layer::{LayerOp, LayerPlacement, OpPlacement};
pub use mapping::{GroupInfo, MeshMapping};
pub use memory::{MemoryBreakdown, MemoryParams, ZeroShards};
pub use model::TransformerConfig;
pub use plan::{Offload, Plan, Recompute, parse_stage_layers};
pub use software::{
    CpAttention, CpuOptimizer, Fp8Recipe, Fusion, GatherUnit, LossKernel, Offers,
    SelectiveRecompute, Software, SoftwareSpec,
};
