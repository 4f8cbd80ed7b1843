//! The verifier: structural, typing and placement invariants that every graph must satisfy
//! after every pass.
//!
//! Invariants checked by [`verify`]:
//! 1. Operand lists and petgraph edges agree, and every operand is a defined value.
//! 2. The graph is acyclic.
//! 3. Every node's recorded result types equal what [`crate::infer::infer`] gives for its op
//!    and operand types, and every result value points back to its producer and position.
//! 4. Graph outputs name defined values, and output names are unique.
//! 5. Parameter names are unique, and so are input names.
//! 6. Every sharding names each mesh axis at most once, shards only existing tensor dims, and,
//!    for axes present in the mesh, splits each dim evenly. Axes absent from the mesh (or all
//!    axes when there is no mesh) count as size 1, so model code may annotate `tp` whether or
//!    not a run uses tensor parallelism.
//! 7. Only parameters have a weight role ([`crate::meta::NodeMeta::role`]), and parameters
//!    and inputs have no phase (they are state and feeds that every phase reads).
//!
//! A verifier failure after a pass is a compiler bug; user mistakes are caught earlier with
//! errors that name the tensor, dim and mesh axis.

use std::collections::HashSet;

use crate::error::IrError;
use crate::graph::{Graph, ValueId};
use crate::infer::infer;
use crate::op::Op;
use crate::placement::{Placement, Sharding};
use crate::types::TensorType;

/// Checks every invariant listed in the module docs.
pub fn verify(g: &Graph) -> Result<(), IrError> {
    g.check_edges()?;
    let order = g.topo_order()?;
    let (mut params, mut inputs) = (HashSet::new(), HashSet::new());
    for n in order {
        let node = g.node(n);
        let mut tys = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            tys.push(&g.value_checked(v)?.ty);
        }
        let expected = infer(&node.op, &tys, g.mesh())
            .map_err(|e| IrError::Verify(format!("{n} ({}): {e}", node.op.name())))?;
        if expected.len() != node.outputs.len() {
            return Err(IrError::Verify(format!(
                "{n} ({}) has {} results, expected {}",
                node.op.name(),
                node.outputs.len(),
                expected.len()
            )));
        }
        for (i, (&v, ty)) in node.outputs.iter().zip(&expected).enumerate() {
            let val = g.value_checked(v)?;
            if val.producer != n || val.index != i {
                return Err(IrError::Verify(format!("{v} does not point back to {n}")));
            }
            if val.ty != *ty {
                return Err(IrError::Verify(format!(
                    "{v} = {} has type {} but its op gives {ty}",
                    node.op.name(),
                    val.ty
                )));
            }
            if let Some(s) = &val.sharding {
                check_sharding(g, v, &val.ty, s)?;
            }
        }
        match &node.op {
            Op::Parameter { name, .. } if !params.insert(name.clone()) => {
                return Err(IrError::Verify(format!(
                    "parameter `{name}` is defined twice"
                )));
            }
            Op::Input { name, .. } if !inputs.insert(name.clone()) => {
                return Err(IrError::Verify(format!("input `{name}` is defined twice")));
            }
            _ => {}
        }
        let meta = g.meta(n);
        if let Some(role) = meta.role
            && !matches!(node.op, Op::Parameter { .. })
        {
            return Err(IrError::Verify(format!(
                "{n} ({}) has weight role `{role}`, but only parameters have one",
                node.op.name()
            )));
        }
        if let Some(phase) = meta.phase
            && matches!(node.op, Op::Parameter { .. } | Op::Input { .. })
        {
            return Err(IrError::Verify(format!(
                "{n} ({}) has phase `{phase}`, but parameters and inputs have none",
                node.op.name()
            )));
        }
    }
    let mut names = HashSet::new();
    for (name, v) in g.outputs() {
        g.value_checked(*v)?;
        if !names.insert(name) {
            return Err(IrError::Verify(format!("output `{name}` is defined twice")));
        }
    }
    Ok(())
}

/// Checks one sharding against its value (invariant 6).
pub fn check_sharding(g: &Graph, v: ValueId, ty: &TensorType, s: &Sharding) -> Result<(), IrError> {
    let err = |detail: String| IrError::Sharding {
        value: v.to_string(),
        ty: ty.to_string(),
        detail,
    };
    for (i, (axis, p)) in s.axes.iter().enumerate() {
        if s.axes[..i].iter().any(|(a, _)| a == axis) {
            return Err(err(format!("mesh axis `{axis}` is listed twice")));
        }
        if let Placement::Shard(d) = p
            && *d >= ty.rank()
        {
            return Err(err(format!(
                "mesh axis `{axis}` shards dim {d}, but the value has rank {}",
                ty.rank()
            )));
        }
    }
    let Some(mesh) = g.mesh() else { return Ok(()) };
    for d in 0..ty.rank() {
        let mut ways = 1;
        for axis in s.axes_sharding_dim(d) {
            ways *= mesh.axis_size(axis).unwrap_or(1);
            if !ty.dims()[d].is_multiple_of(ways) {
                return Err(err(format!(
                    "dim {d} (size {}) does not split evenly over mesh axis `{axis}` ({ways} ways in all)",
                    ty.dims()[d]
                )));
            }
        }
    }
    Ok(())
}
