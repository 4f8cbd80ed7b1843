//! autopar's cost model: cluster topology (nodes, GPUs, NVLink/NVSwitch and NIC fabrics), and
//! the compute, communication and memory costs of partitioned programs on it.
//!
//! The crate depends only on `autopar-ir`; passes receive the cost model as a value instead
//! of owning hardware tables. It is filled in by the cost-model work; today it only fixes the
//! crate boundary in the workspace.
