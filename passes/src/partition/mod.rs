//! SPMD partitioning: from a global graph whose values all carry complete shardings (after
//! [`crate::propagate`]) and the chosen strategies, emit the local program one rank runs,
//! with local shapes and explicit collectives over mesh-axis groups.
//!
//! **One program per rank.** A few local ops depend on where a rank sits in the mesh: the
//! offsets of a local slice, the first vocabulary row of a vocabulary-parallel embedding or
//! cross-entropy, the zeros that make a value partial. They are emitted as constants of the
//! rank's own program, so [`partition`] takes the rank; the programs of all ranks are the same
//! graph up to those constants (and every rank reaches the same collectives in the same
//! order, which the multi-rank runtime requires). The alternative, an op giving a rank its
//! mesh coordinates, would keep one program but add an op every backend and the cost model
//! must know; per-rank programs need nothing new.
//!
//! For every node, in topological order:
//! 1. each operand is resharded from what is available (its stored sharding, or a copy an
//!    earlier consumer already made) to what the node's strategies require, following
//!    [`autopar_ir::reshard::plan_reshard`] and lowering each step for this rank
//!    ([`autopar_ir::reshard::ReshardStep::lower`]); copies are cached, so a value is gathered
//!    or reduced once however many consumers need it that way;
//! 2. the node runs locally: the op with local shape attributes ([`crate::sharding::local_op`],
//!    applied axis by axis, outermost first), or the lowering the strategies name
//!    ([`crate::sharding::lower()`], or the sharded softmax of [`crate::propagate`]) with the
//!    axes that chose it;
//! 3. results whose stored sharding differs from what the strategies produce (a fixed
//!    placement) are resharded at once.
//!
//! Graph outputs are the stored copies of their values. Nodes emitted for a global node,
//! collectives included, carry its scope, so dumps show where each collective comes from, and
//! its metadata (phase, micro-batch, layer; the weight role stays on the parameter), so later
//! passes (the pipeline splitter) place them as they place the node; the reshards of graph
//! outputs carry neither.

use std::collections::HashMap;

use autopar_ir::reshard::{StepLowering, group_index, plan_reshard};
use autopar_ir::sharding_algebra::local_shape;
use autopar_ir::{
    BinaryOp, DeviceMesh, Graph, IrError, NodeId, NodeMeta, Op, ReduceKind, ReduceOp, Shape,
    Sharding, TensorType, UnaryOp, ValueId, verify,
};

use crate::error::PassError;
use crate::propagate::{AxisKernel, ShardingPlan};
use crate::sharding::{LocalKernel, ShardContext, Strategy, local_op, local_type, lower};

/// The local program of rank `rank` (a linear mesh coordinate) for the propagated graph `g`
/// and its strategies `plan` (see the module docs). The result has the mesh attached, no
/// shardings, and passes the verifier.
pub fn partition(g: &Graph, plan: &ShardingPlan, rank: usize) -> Result<Graph, PassError> {
    let mesh = g.mesh().cloned().ok_or_else(|| PassError::BadGraph {
        graph: g.name().to_string(),
        detail: "partitioning needs a device mesh".into(),
    })?;
    if rank >= mesh.num_devices() {
        return Err(PassError::BadOption {
            option: "--rank",
            detail: format!(
                "rank {rank} is not in the mesh `{mesh}` ({} ranks)",
                mesh.num_devices()
            ),
        });
    }
    let mut out = Graph::new(g.name());
    out.set_mesh(Some(mesh.clone()));
    let mut p = Partitioner {
        g,
        plan,
        coords: mesh.coords(rank),
        mesh,
        out,
        copies: HashMap::new(),
        meta: NodeMeta::default(),
    };
    for n in g.topo_order()? {
        p.node(n)?;
    }
    p.meta = NodeMeta::default();
    for (name, v) in g.outputs() {
        let want = p.stored(*v)?;
        let local = p.reshard(*v, &want, None)?;
        p.out.add_output(name.clone(), local)?;
    }
    verify(&p.out)?;
    Ok(p.out)
}

/// Partitions `g` for every rank of its mesh.
pub fn partition_all(g: &Graph, plan: &ShardingPlan) -> Result<Vec<Graph>, PassError> {
    let n = g.mesh().map_or(1, DeviceMesh::num_devices);
    (0..n).map(|rank| partition(g, plan, rank)).collect()
}

struct Partitioner<'a> {
    g: &'a Graph,
    plan: &'a ShardingPlan,
    mesh: DeviceMesh,
    coords: Vec<usize>,
    out: Graph,
    /// Local copies of every global value: its sharding and the local value holding it.
    copies: HashMap<ValueId, Vec<(Sharding, ValueId)>>,
    /// The metadata of the global node being partitioned, which every local node made for
    /// it gets (without a weight role: only the parameter itself keeps that).
    meta: NodeMeta,
}

/// True when two shardings place a value alike on every axis of size above 1.
fn same_layout(a: &Sharding, b: &Sharding, mesh: &DeviceMesh, rank: usize) -> bool {
    use autopar_ir::Placement::Replicate;
    mesh.axes()
        .iter()
        .filter(|x| x.size > 1)
        .all(|x| a.get(&x.name).unwrap_or(Replicate) == b.get(&x.name).unwrap_or(Replicate))
        && {
            // Axes sharding one dim must also nest alike.
            let order = |s: &Sharding, d: usize| -> Vec<String> {
                s.axes_sharding_dim(d)
                    .filter(|a| mesh.axis_size(a).is_some_and(|n| n > 1))
                    .map(str::to_string)
                    .collect()
            };
            (0..rank).all(|d| order(a, d) == order(b, d))
        }
}

impl Partitioner<'_> {
    fn stored(&self, v: ValueId) -> Result<Sharding, PassError> {
        self.g.value(v).sharding.clone().ok_or_else(|| {
            PassError::Ir(IrError::Verify(format!(
                "{v} has no sharding; run sharding propagation before partitioning"
            )))
        })
    }

    /// Sets `scope` and the current metadata on every node added since the graph had `before`
    /// nodes (the local graph never loses nodes, so new nodes take the next ids).
    fn scope_new(&mut self, before: usize, scope: &Option<String>) {
        for id in before..self.out.num_nodes() {
            self.out.set_scope(NodeId(id as u32), scope.clone());
            self.out
                .set_meta(NodeId(id as u32), self.meta.without_role());
        }
    }

    /// A local value holding global value `v` sharded as `want`, reusing or making a copy.
    fn reshard(
        &mut self,
        v: ValueId,
        want: &Sharding,
        scope: Option<&String>,
    ) -> Result<ValueId, PassError> {
        let copies = self.copies.get(&v).cloned().unwrap_or_default();
        if let Some((_, local)) = copies
            .iter()
            .find(|(s, _)| same_layout(s, want, &self.mesh, self.g.ty(v).rank()))
        {
            return Ok(*local);
        }
        let ty = self.g.ty(v);
        let mut best: Option<(usize, f64, Vec<_>, ValueId)> = None;
        for (s, local) in &copies {
            let plan = plan_reshard(ty, s, want, &self.mesh)?;
            let collectives = plan
                .steps
                .iter()
                .filter(|st| st.collective().is_some())
                .count();
            if best
                .as_ref()
                .is_none_or(|(c, b, _, _)| (collectives, plan.bytes_sent) < (*c, *b))
            {
                best = Some((collectives, plan.bytes_sent, plan.steps, *local));
            }
        }
        let Some((_, _, steps, mut cur)) = best else {
            return Err(PassError::Ir(IrError::Verify(format!(
                "{v} is used before it is defined"
            ))));
        };
        let before = self.out.num_nodes();
        for step in steps {
            let local_ty = self.out.ty(cur).clone();
            match step.lower(&local_ty, &self.mesh, &self.coords)? {
                StepLowering::Collective(op) => cur = self.out.add(op, &[cur])?,
                StepLowering::Local(op @ Op::Constant { .. }) => cur = self.out.add(op, &[])?,
                StepLowering::Local(op) => {
                    // A slice of a constant fill is a smaller fill: never build the whole one.
                    let fill = match &self.out.node(self.out.value(cur).producer).op {
                        Op::Constant { value, .. } if matches!(op, Op::Slice { .. }) => {
                            Some(*value)
                        }
                        _ => None,
                    };
                    cur = match fill {
                        Some(value) => {
                            let ty =
                                autopar_ir::infer::infer(&op, &[&local_ty], None)?.swap_remove(0);
                            self.out.add(Op::Constant { ty, value }, &[])?
                        }
                        None => self.out.add(op, &[cur])?,
                    };
                }
                StepLowering::Identity => {}
            }
        }
        self.scope_new(before, &scope.cloned());
        self.copies.entry(v).or_default().push((want.clone(), cur));
        Ok(cur)
    }

    fn node(&mut self, n: NodeId) -> Result<(), PassError> {
        let node = self.g.node(n);
        let scope = node.scope.clone();
        self.meta = self.g.meta(n);
        if node.op.is_source() {
            let v = node.outputs[0];
            let s = self.stored(v)?;
            let ty = self.g.ty(v);
            let local = TensorType::new(ty.dtype, local_shape(ty.dims(), &s, &self.mesh)?);
            let mut op = node.op.clone();
            if let Some(t) = op.source_type_mut() {
                *t = local;
            }
            let id = self.out.add_node(op, &[])?;
            self.out.set_scope(id, scope);
            self.out.set_meta(id, self.meta);
            let lv = self.out.node(id).outputs[0];
            self.copies.insert(v, vec![(s, lv)]);
            return Ok(());
        }
        let mut locals = Vec::with_capacity(node.inputs.len());
        for (i, &v) in node.inputs.iter().enumerate() {
            let want = self.plan.sharding(&self.mesh, n, i, false);
            locals.push(self.reshard(v, &want, scope.as_ref())?);
        }

        // The local op, axis by axis; lowered axes are collected.
        let mut op = node.op.clone();
        let mut tys: Vec<TensorType> = node.inputs.iter().map(|&v| self.g.ty(v).clone()).collect();
        let mut lowered: Vec<(String, AxisKernel)> = Vec::new();
        let strategies = self.plan.strategies.get(&n);
        for (k, (axis, size)) in self.plan.axes.iter().enumerate() {
            let Some(s) = strategies.and_then(|list| list.get(k)) else {
                continue;
            };
            match s.kernel {
                AxisKernel::Same => {
                    let st = Strategy {
                        operands: s.operands.clone(),
                        results: s.results.clone(),
                        kernel: LocalKernel::Same,
                    };
                    let refs: Vec<&TensorType> = tys.iter().collect();
                    op = local_op(&op, &st, &refs, *size)?;
                }
                AxisKernel::Lowered(_) | AxisKernel::ShardedSoftmax => {
                    lowered.push((axis.clone(), s.kernel));
                }
            }
            tys = tys
                .iter()
                .zip(&s.operands)
                .map(|(t, &p)| local_type(t, p, *size))
                .collect::<Result<_, _>>()?;
        }
        let before = self.out.num_nodes();
        let results = match lowered.first() {
            None => {
                let id = self.out.add_node(op, &locals)?;
                self.out.node(id).outputs.clone()
            }
            Some(&(_, kind)) => {
                if lowered.iter().any(|(_, k)| *k != kind) {
                    return Err(PassError::NoStrategy {
                        node: n.to_string(),
                        op: node.op.name(),
                        axis: lowered
                            .iter()
                            .map(|(a, _)| a.as_str())
                            .collect::<Vec<_>>()
                            .join(","),
                        detail: "different lowerings on different mesh axes".into(),
                    });
                }
                let axes: Vec<String> = lowered.into_iter().map(|(a, _)| a).collect();
                let (index, count) = group_index(&self.mesh, &axes, &self.coords);
                let ctx = ShardContext { axes, index, count };
                match kind {
                    AxisKernel::Lowered(l) => lower(&mut self.out, &op, l, &locals, &ctx)?,
                    AxisKernel::ShardedSoftmax => {
                        let Op::Softmax { dim } = op else {
                            return Err(PassError::Ir(IrError::Verify(format!(
                                "{n}: a sharded softmax on `{}`",
                                op.name()
                            ))));
                        };
                        vec![sharded_softmax(&mut self.out, dim, locals[0], &ctx.axes)?]
                    }
                    AxisKernel::Same => Vec::new(),
                }
            }
        };
        self.scope_new(before, &scope);
        if results.len() != node.outputs.len() {
            return Err(PassError::Ir(IrError::Verify(format!(
                "{n}: the local kernel gave {} results, not {}",
                results.len(),
                node.outputs.len()
            ))));
        }
        for (j, (&v, &local)) in node.outputs.iter().zip(&results).enumerate() {
            let raw = self.plan.sharding(&self.mesh, n, j, true);
            self.copies.insert(v, vec![(raw, local)]);
            let stored = self.stored(v)?;
            self.reshard(v, &stored, scope.as_ref())?;
        }
        Ok(())
    }
}

/// Softmax over a dim sharded over `axes`: global max and sum by all-reduces of local ones.
fn sharded_softmax(
    g: &mut Graph,
    dim: usize,
    x: ValueId,
    axes: &[String],
) -> Result<ValueId, PassError> {
    let ty = g.ty(x).clone();
    let keep: Vec<usize> = (0..ty.rank()).filter(|&d| d != dim).collect();
    let spread = |g: &mut Graph, v: ValueId| -> Result<ValueId, IrError> {
        g.add(
            Op::Broadcast {
                shape: Shape::new(ty.dims()),
                dims: keep.clone(),
            },
            &[v],
        )
    };
    let local_max = g.add(
        Op::Reduce {
            func: ReduceOp::Max,
            dims: vec![dim],
        },
        &[x],
    )?;
    let max = g.add(
        Op::AllReduce {
            axes: axes.to_vec(),
            reduce: ReduceKind::Max,
        },
        &[local_max],
    )?;
    let max = spread(g, max)?;
    let z = g.add(
        Op::Binary {
            func: BinaryOp::Sub,
        },
        &[x, max],
    )?;
    let e = g.add(Op::Unary { func: UnaryOp::Exp }, &[z])?;
    let local_sum = g.add(
        Op::Reduce {
            func: ReduceOp::Sum,
            dims: vec![dim],
        },
        &[e],
    )?;
    let sum = g.add(
        Op::AllReduce {
            axes: axes.to_vec(),
            reduce: ReduceKind::Sum,
        },
        &[local_sum],
    )?;
    let sum = spread(g, sum)?;
    Ok(g.add(
        Op::Binary {
            func: BinaryOp::Div,
        },
        &[e, sum],
    )?)
}
