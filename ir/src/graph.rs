//! The dataflow graph: nodes (ops) over SSA values, stored in petgraph behind typed ids.
//!
//! A [`Graph`] owns its nodes, the values they produce, the named outputs, an optional device
//! mesh, the per-value sharding annotations and the per-node typed metadata of
//! [`crate::meta`] (phase, micro-batch, layer, weight role) in a side table. Node and value ids
//! are stable: removing a node never renumbers the others. petgraph indices never leave this
//! module.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::fmt;

use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};

use crate::error::IrError;
use crate::infer::infer;
use crate::mesh::DeviceMesh;
use crate::meta::NodeMeta;
use crate::op::Op;
use crate::placement::Sharding;
use crate::types::TensorType;

/// Identifies a node of a [`Graph`]. Printed `n3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

/// Identifies a value (an op result) of a [`Graph`]. Printed `%7`, as in the text format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ValueId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// A node: one op applied to operand values, producing result values.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Operand values, in order.
    pub inputs: Vec<ValueId>,
    /// Result values, in order.
    pub outputs: Vec<ValueId>,
    /// Where in the model the node comes from, e.g. `h.0.attn` (a layer path).
    pub scope: Option<String>,
}

/// A value: the result of one node.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    /// Its static type.
    pub ty: TensorType,
    /// The node producing it.
    pub producer: NodeId,
    /// Which result of the producer it is.
    pub index: usize,
    /// Its placement over the mesh, when annotated or inferred.
    pub sharding: Option<Sharding>,
}

/// A dataflow graph. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    name: String,
    mesh: Option<DeviceMesh>,
    graph: StableDiGraph<Node, usize>,
    values: Vec<Option<Value>>,
    outputs: Vec<(String, ValueId)>,
    /// Where each output name is in `outputs`: declaring and finding an output is a lookup,
    /// not a scan (a step of a large model has thousands of named outputs).
    output_index: HashMap<String, usize>,
    /// Typed metadata of the nodes that have any (see [`crate::meta`]).
    meta: BTreeMap<NodeId, NodeMeta>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            ..Graph::default()
        }
    }

    /// The graph's name (the model name for zoo models).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renames the graph.
    pub fn set_name(&mut self, name: impl Into<String>) {
        self.name = name.into();
    }

    /// The device mesh, if one is attached.
    pub fn mesh(&self) -> Option<&DeviceMesh> {
        self.mesh.as_ref()
    }

    /// Attaches (or removes) a device mesh.
    pub fn set_mesh(&mut self, mesh: Option<DeviceMesh>) {
        self.mesh = mesh;
    }

    /// Adds a node after inferring its result types; returns the node id.
    pub fn add_node(&mut self, op: Op, inputs: &[ValueId]) -> Result<NodeId, IrError> {
        self.insert_node(op, inputs, None, None)
    }

    /// Adds a single-result node and returns its result.
    pub fn add(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId, IrError> {
        let name = op.name();
        let n = self.add_node(op, inputs)?;
        match self.node(n).outputs.as_slice() {
            [v] => Ok(*v),
            outs => Err(IrError::ty(
                name,
                format!(
                    "has {} results; use add_node for multi-result ops",
                    outs.len()
                ),
            )),
        }
    }

    /// Adds a node whose result values get the given ids (used by the text parser so that
    /// value numbers survive a round trip). `ids` must be unused.
    pub fn add_node_with_ids(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        ids: &[ValueId],
        scope: Option<String>,
    ) -> Result<NodeId, IrError> {
        self.insert_node(op, inputs, Some(ids), scope)
    }

    fn insert_node(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        ids: Option<&[ValueId]>,
        scope: Option<String>,
    ) -> Result<NodeId, IrError> {
        let types = {
            let mut tys = Vec::with_capacity(inputs.len());
            for &v in inputs {
                tys.push(&self.value_checked(v)?.ty);
            }
            infer(&op, &tys, self.mesh.as_ref())?
        };
        if let Some(ty) = types
            .iter()
            .find(|t| t.num_elements() > crate::types::MAX_TENSOR_ELEMENTS)
        {
            return Err(IrError::ty(
                op.name(),
                format!(
                    "gives {ty}, more than the 2^52 elements a tensor may have (sizes and \
                     byte counts of larger tensors would overflow)"
                ),
            ));
        }
        let ids: Vec<ValueId> = match ids {
            Some(ids) => {
                if ids.len() != types.len() {
                    return Err(IrError::ty(
                        op.name(),
                        format!("has {} results, but {} were named", types.len(), ids.len()),
                    ));
                }
                for (i, id) in ids.iter().enumerate() {
                    if self.values.get(id.0 as usize).is_some_and(Option::is_some)
                        || ids[..i].contains(id)
                    {
                        return Err(IrError::Verify(format!("value {id} is defined twice")));
                    }
                }
                ids.to_vec()
            }
            None => {
                let base = self.values.len() as u32;
                (0..types.len() as u32).map(|i| ValueId(base + i)).collect()
            }
        };
        let idx = self.graph.add_node(Node {
            op,
            inputs: inputs.to_vec(),
            outputs: ids.clone(),
            scope,
        });
        let node = NodeId(idx.index() as u32);
        for (k, &v) in inputs.iter().enumerate() {
            let producer = self.value_checked(v)?.producer;
            self.graph
                .add_edge(NodeIndex::new(producer.0 as usize), idx, k);
        }
        for (i, (id, ty)) in ids.iter().zip(types).enumerate() {
            let slot = id.0 as usize;
            if self.values.len() <= slot {
                self.values.resize(slot + 1, None);
            }
            self.values[slot] = Some(Value {
                ty,
                producer: node,
                index: i,
                sharding: None,
            });
        }
        Ok(node)
    }

    /// The node with id `n`. Panics on an id from another graph (a compiler bug).
    pub fn node(&self, n: NodeId) -> &Node {
        &self.graph[NodeIndex::new(n.0 as usize)]
    }

    /// The node with id `n`, if it exists.
    pub fn get_node(&self, n: NodeId) -> Option<&Node> {
        self.graph.node_weight(NodeIndex::new(n.0 as usize))
    }

    /// Sets the scope (layer path) of a node.
    pub fn set_scope(&mut self, n: NodeId, scope: Option<String>) {
        if let Some(node) = self.graph.node_weight_mut(NodeIndex::new(n.0 as usize)) {
            node.scope = scope;
        }
    }

    /// The typed metadata of node `n` (every field `None` when it has none).
    pub fn meta(&self, n: NodeId) -> NodeMeta {
        self.meta.get(&n).copied().unwrap_or_default()
    }

    /// Sets the typed metadata of node `n` (an empty one removes it).
    pub fn set_meta(&mut self, n: NodeId, meta: NodeMeta) {
        if meta.is_empty() || self.get_node(n).is_none() {
            self.meta.remove(&n);
        } else {
            self.meta.insert(n, meta);
        }
    }

    /// Adds a copy of node `n` of `src` (its op, scope and metadata) over operands `inputs`,
    /// its results numbered `ids`: how passes that rebuild a graph keep what each node is.
    pub fn copy_node(
        &mut self,
        src: &Graph,
        n: NodeId,
        inputs: &[ValueId],
        ids: &[ValueId],
    ) -> Result<NodeId, IrError> {
        let node = src.node(n);
        let id = self.add_node_with_ids(node.op.clone(), inputs, ids, node.scope.clone())?;
        self.set_meta(id, src.meta(n));
        Ok(id)
    }

    /// The value with id `v`. Panics on an undefined id (a compiler bug).
    pub fn value(&self, v: ValueId) -> &Value {
        self.values[v.0 as usize]
            .as_ref()
            .unwrap_or_else(|| panic!("value {v} is not defined"))
    }

    /// The value with id `v`, or an error naming it.
    pub fn value_checked(&self, v: ValueId) -> Result<&Value, IrError> {
        self.values
            .get(v.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| IrError::UnknownValue(v.to_string()))
    }

    /// The type of value `v`.
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.value(v).ty
    }

    /// Sets (or clears) the sharding of a value.
    pub fn set_sharding(&mut self, v: ValueId, sharding: Option<Sharding>) -> Result<(), IrError> {
        let slot = self
            .values
            .get_mut(v.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| IrError::UnknownValue(v.to_string()))?;
        slot.sharding = sharding;
        Ok(())
    }

    /// Marks `v` as a graph output under `name` (names are unique).
    pub fn add_output(&mut self, name: impl Into<String>, v: ValueId) -> Result<(), IrError> {
        let name = name.into();
        self.value_checked(v)?;
        if self.output_index.contains_key(&name) {
            return Err(IrError::Verify(format!("output `{name}` is defined twice")));
        }
        self.output_index.insert(name.clone(), self.outputs.len());
        self.outputs.push((name, v));
        Ok(())
    }

    /// The named outputs, in declaration order.
    pub fn outputs(&self) -> &[(String, ValueId)] {
        &self.outputs
    }

    /// The output called `name`.
    pub fn output(&self, name: &str) -> Option<ValueId> {
        self.output_index.get(name).map(|&i| self.outputs[i].1)
    }

    /// Number of live nodes.
    pub fn num_nodes(&self) -> usize {
        self.graph.node_count()
    }

    /// Ids of all live nodes, in increasing order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self
            .graph
            .node_indices()
            .map(|i| NodeId(i.index() as u32))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Ids of all live values, in increasing order.
    pub fn value_ids(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_some())
            .map(|(i, _)| ValueId(i as u32))
    }

    /// The nodes that use `v`, with the operand position, sorted.
    pub fn users(&self, v: ValueId) -> Vec<(NodeId, usize)> {
        let Some(val) = self.values.get(v.0 as usize).and_then(Option::as_ref) else {
            return Vec::new();
        };
        let mut users: Vec<(NodeId, usize)> = self
            .graph
            .edges_directed(NodeIndex::new(val.producer.0 as usize), Direction::Outgoing)
            .filter(|e| self.graph[e.target()].inputs[*e.weight()] == v)
            .map(|e| (NodeId(e.target().index() as u32), *e.weight()))
            .collect();
        users.sort_unstable();
        users
    }

    /// Nodes in a deterministic topological order: among ready nodes, the lowest id first.
    ///
    /// When node ids already are a topological order (as in any graph built front to back or
    /// parsed from text), this is simply id order. Errors if the graph has a cycle.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, IrError> {
        let mut indegree: BTreeMap<NodeIndex, usize> = BTreeMap::new();
        let mut ready = BinaryHeap::new();
        for i in self.graph.node_indices() {
            let d = self.graph.edges_directed(i, Direction::Incoming).count();
            if d == 0 {
                ready.push(Reverse(i.index()));
            } else {
                indegree.insert(i, d);
            }
        }
        let mut order = Vec::with_capacity(self.graph.node_count());
        while let Some(Reverse(i)) = ready.pop() {
            let idx = NodeIndex::new(i);
            order.push(NodeId(i as u32));
            for e in self.graph.edges_directed(idx, Direction::Outgoing) {
                let t = e.target();
                if let Some(d) = indegree.get_mut(&t) {
                    *d -= 1;
                    if *d == 0 {
                        indegree.remove(&t);
                        ready.push(Reverse(t.index()));
                    }
                }
            }
        }
        if order.len() != self.graph.node_count() {
            return Err(IrError::Verify("the graph has a cycle".into()));
        }
        Ok(order)
    }

    /// Makes every use of `old` a use of `new` (same type required), including graph outputs.
    pub fn replace_all_uses(&mut self, old: ValueId, new: ValueId) -> Result<(), IrError> {
        let (old_ty, new_val) = (
            self.value_checked(old)?.ty.clone(),
            self.value_checked(new)?,
        );
        if new_val.ty != old_ty {
            return Err(IrError::Verify(format!(
                "cannot replace {old} ({old_ty}) by {new} ({})",
                new_val.ty
            )));
        }
        let new_producer = NodeIndex::new(new_val.producer.0 as usize);
        for (user, k) in self.users(old) {
            let u = NodeIndex::new(user.0 as usize);
            self.graph[u].inputs[k] = new;
            let old_producer = NodeIndex::new(self.value(old).producer.0 as usize);
            if let Some(e) = self
                .graph
                .edges_connecting(old_producer, u)
                .find(|e| *e.weight() == k)
                .map(|e| e.id())
            {
                self.graph.remove_edge(e);
            }
            self.graph.add_edge(new_producer, u, k);
        }
        for (_, v) in &mut self.outputs {
            if *v == old {
                *v = new;
            }
        }
        Ok(())
    }

    /// Removes a node whose results are unused; its values become undefined.
    pub fn remove_node(&mut self, n: NodeId) -> Result<Node, IrError> {
        let node = self
            .get_node(n)
            .ok_or_else(|| IrError::Verify(format!("node {n} does not exist")))?;
        for &v in &node.outputs {
            if !self.users(v).is_empty() || self.outputs.iter().any(|(_, o)| *o == v) {
                return Err(IrError::Verify(format!(
                    "cannot remove {n}: {v} is still used"
                )));
            }
        }
        let node = self
            .graph
            .remove_node(NodeIndex::new(n.0 as usize))
            .ok_or_else(|| IrError::Verify(format!("node {n} does not exist")))?;
        for v in &node.outputs {
            self.values[v.0 as usize] = None;
        }
        self.meta.remove(&n);
        Ok(node)
    }

    /// The parameters, in topological order: `(result value, name, type)`.
    pub fn parameters(&self) -> Vec<(ValueId, &str, &TensorType)> {
        self.nodes_in_order()
            .into_iter()
            .filter_map(|n| match &self.node(n).op {
                Op::Parameter { name, ty, .. } => {
                    Some((self.node(n).outputs[0], name.as_str(), ty))
                }
                _ => None,
            })
            .collect()
    }

    /// The data inputs, in topological order: `(result value, name, op)`.
    pub fn inputs(&self) -> Vec<(ValueId, &str, &Op)> {
        self.nodes_in_order()
            .into_iter()
            .filter_map(|n| match &self.node(n).op {
                op @ Op::Input { name, .. } => Some((self.node(n).outputs[0], name.as_str(), op)),
                _ => None,
            })
            .collect()
    }

    /// Total number of parameter elements.
    pub fn num_parameter_elements(&self) -> u64 {
        self.parameters()
            .iter()
            .map(|(_, _, t)| t.num_elements())
            .fold(0u64, u64::saturating_add)
    }

    /// Topological order, or id order if the graph has a cycle (only the verifier cares).
    pub fn nodes_in_order(&self) -> Vec<NodeId> {
        self.topo_order().unwrap_or_else(|_| self.node_ids())
    }

    /// Structural equality: same name, mesh and outputs, and the same nodes (op, operands,
    /// results, scope, metadata) and values (type, sharding) in topological order. Node ids
    /// may differ.
    pub fn structurally_equal(&self, other: &Graph) -> bool {
        if self.name != other.name || self.mesh != other.mesh || self.outputs != other.outputs {
            return false;
        }
        let (a, b) = (self.nodes_in_order(), other.nodes_in_order());
        a.len() == b.len()
            && a.iter().zip(&b).all(|(&x, &y)| {
                let (nx, ny) = (self.node(x), other.node(y));
                nx.op == ny.op
                    && nx.inputs == ny.inputs
                    && nx.outputs == ny.outputs
                    && nx.scope == ny.scope
                    && self.meta(x) == other.meta(y)
                    && nx.outputs.iter().all(|&v| {
                        let (vx, vy) = (self.value(v), other.value(v));
                        vx.ty == vy.ty && vx.sharding == vy.sharding && vx.index == vy.index
                    })
            })
    }

    /// Internal consistency used by the verifier: edges mirror operand lists.
    pub(crate) fn check_edges(&self) -> Result<(), IrError> {
        for idx in self.graph.node_indices() {
            let node = &self.graph[idx];
            let n = NodeId(idx.index() as u32);
            let mut seen = HashSet::new();
            for e in self.graph.edges_directed(idx, Direction::Incoming) {
                let k = *e.weight();
                let Some(&v) = node.inputs.get(k) else {
                    return Err(IrError::Verify(format!(
                        "{n} has an edge for missing operand {k}"
                    )));
                };
                let producer = self.value_checked(v)?.producer;
                if producer.0 as usize != e.source().index() || !seen.insert(k) {
                    return Err(IrError::Verify(format!(
                        "{n}: edge for operand {k} is inconsistent"
                    )));
                }
            }
            if seen.len() != node.inputs.len() {
                return Err(IrError::Verify(format!("{n}: operands and edges disagree")));
            }
        }
        Ok(())
    }
}

impl PartialEq for Graph {
    fn eq(&self, other: &Self) -> bool {
        self.structurally_equal(other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{BinaryOp, Init, UnaryOp};
    use crate::types::DType;

    fn param(g: &mut Graph, name: &str, dims: &[usize]) -> ValueId {
        g.add(
            Op::Parameter {
                name: name.into(),
                ty: TensorType::new(DType::F32, dims.to_vec()),
                init: Init::Zeros,
            },
            &[],
        )
        .unwrap()
    }

    #[test]
    fn build_users_and_topo() {
        let mut g = Graph::new("t");
        let a = param(&mut g, "a", &[2, 3]);
        let b = param(&mut g, "b", &[2, 3]);
        let c = g
            .add(
                Op::Binary {
                    func: BinaryOp::Add,
                },
                &[a, b],
            )
            .unwrap();
        let d = g.add(Op::Unary { func: UnaryOp::Exp }, &[c]).unwrap();
        let e = g
            .add(
                Op::Binary {
                    func: BinaryOp::Mul,
                },
                &[c, c],
            )
            .unwrap();
        g.add_output("d", d).unwrap();
        assert_eq!(g.users(c).len(), 3);
        assert_eq!(g.topo_order().unwrap().len(), 5);
        g.replace_all_uses(c, a).unwrap();
        assert!(g.users(c).is_empty());
        assert_eq!(g.node(g.value(e).producer).inputs, vec![a, a]);
        let cn = g.value(c).producer;
        g.remove_node(cn).unwrap();
        assert!(g.value_checked(c).is_err());
        assert!(g.remove_node(g.value(a).producer).is_err());
        crate::verify::verify(&g).unwrap();
    }

    #[test]
    fn shape_mismatch_names_op_and_shapes() {
        let mut g = Graph::new("t");
        let a = param(&mut g, "a", &[2, 3]);
        let b = param(&mut g, "b", &[3, 2]);
        let err = g
            .add(
                Op::Binary {
                    func: BinaryOp::Add,
                },
                &[a, b],
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "`add`: operand types differ: f32[2,3] vs f32[3,2]"
        );
    }
}
