//! autopar's intermediate representation: a dataflow graph of tensor ops, its types, the
//! device mesh and placements attached to its values, a verifier, and the text (`.air`),
//! Graphviz and JSON forms in which graphs are dumped.
//!
//! This crate does no I/O: dumps are produced as strings and parsed from strings.

pub mod axis;
pub mod dot;
pub mod error;
pub mod graph;
pub mod infer;
pub mod json;
pub mod mesh;
pub mod meta;
pub mod op;
pub mod pipeline;
pub mod placement;
pub mod reshard;
pub mod schedule;
pub mod sharding_algebra;
pub mod text;
pub mod trace;
pub mod types;
pub mod verify;

pub use axis::Axis;
pub use error::IrError;
pub use graph::{Graph, Node, NodeId, Value, ValueId};
pub use mesh::{DeviceMesh, MeshAxis};
pub use meta::{LayerId, NodeMeta, Part, Phase, WeightRole};
pub use op::{
    BinaryOp, CompareOp, EinsumSpec, FusedInstr, FusionBody, Init, InputRole, Op, OpKind, ReduceOp,
    UnaryOp,
};
pub use placement::{Placement, ReduceKind, Sharding, ShardingOrigin};
pub use types::{DType, Shape, TensorType};
pub use verify::verify;
