//! Region formation: the fusible nodes of a program grouped into [`Op::Fusion`] nodes.
//!
//! Nodes whose op a [`FusionBody`] admits are merged, producer into consumer, into connected
//! regions; a merge is refused when it would make the regions cyclic (a path from the
//! merged region out through other nodes or regions and back in). Constants, broadcasts and
//! reshapes of those are not members of any region: they are *duplicated* into the body of
//! every fusion that reads them, so the fusion reads the small operand instead of the
//! materialised broadcast; one stays materialised only where an unfused node or an output
//! needs it. Each region is then priced with the cost model: it becomes a fusion when one
//! kernel over its operands and results costs no more than its nodes run one by one
//! ([`OpCostModel`]: bytes moved and a launch per kernel).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use autopar_cost_model::OpCostModel;
use autopar_ir::{FusedInstr, FusionBody, Graph, NodeId, Op, TensorType, ValueId};

use crate::PassError;

/// What region formation did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionStats {
    /// Fusion nodes made.
    pub fusions: usize,
    /// Nodes that became members of a fusion.
    pub members: usize,
    /// Constants, broadcasts and reshapes copied into fusion bodies (one per body).
    pub duplicated: usize,
    /// Candidate regions the cost model kept unfused.
    pub rejected: usize,
}

/// How a node takes part in fusion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A constant, a broadcast, or a reshape of one of these: copied into consumers.
    Duplicated,
    /// Any other op a body admits: a region member.
    Member,
    /// Everything else.
    Other,
}

/// A body value while the body is built: an operand (by order of first use) or an
/// instruction.
#[derive(Clone, Copy, Debug)]
enum Ref {
    Param(usize),
    Instr(usize),
}

/// The graph being fused, with its nodes in topological order and the per-node facts.
struct Program<'g> {
    graph: &'g Graph,
    order: Vec<NodeId>,
    pos: HashMap<NodeId, usize>,
    role: Vec<Role>,
    /// Effective producers (through duplicated nodes) of every non-duplicated node.
    eff_inputs: Vec<Vec<usize>>,
    eff_succ: Vec<Vec<usize>>,
    /// Users of each node's results, by position.
    users: Vec<Vec<usize>>,
    /// Positions of the nodes whose results are graph outputs.
    outputs: HashSet<ValueId>,
}

impl<'g> Program<'g> {
    fn new(graph: &'g Graph) -> Result<Self, PassError> {
        let order = graph.topo_order()?;
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let producer = |v: ValueId| pos[&graph.value(v).producer];
        let mut role = Vec::with_capacity(order.len());
        for &n in &order {
            let node = graph.node(n);
            role.push(match &node.op {
                Op::Constant { .. } | Op::Broadcast { .. } => Role::Duplicated,
                Op::Reshape { .. } if role[producer(node.inputs[0])] == Role::Duplicated => {
                    Role::Duplicated
                }
                op if FusionBody::admits(op) => Role::Member,
                _ => Role::Other,
            });
        }
        let mut eff_inputs: Vec<Vec<usize>> = vec![Vec::new(); order.len()];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); order.len()];
        for (i, &n) in order.iter().enumerate() {
            let mut eff = Vec::new();
            let mut stack: Vec<usize> = graph.node(n).inputs.iter().map(|&v| producer(v)).collect();
            for &p in &stack {
                users[p].push(i);
            }
            while let Some(p) = stack.pop() {
                match role[p] {
                    Role::Duplicated => {
                        stack.extend(graph.node(order[p]).inputs.iter().map(|&v| producer(v)))
                    }
                    Role::Member | Role::Other => eff.push(p),
                }
            }
            eff.sort_unstable();
            eff.dedup();
            eff_inputs[i] = eff;
        }
        for u in &mut users {
            u.sort_unstable();
            u.dedup();
        }
        // Communication keeps its order (peers pair calls in the order they are issued):
        // each waits for the one before it, an edge like any other for the cycle check.
        let comm: Vec<usize> = (0..order.len())
            .filter(|&i| graph.node(order[i]).op.is_communication())
            .collect();
        for w in comm.windows(2) {
            eff_inputs[w[1]].push(w[0]);
        }
        let mut eff_succ: Vec<Vec<usize>> = vec![Vec::new(); order.len()];
        for (i, ins) in eff_inputs.iter().enumerate() {
            if role[i] != Role::Duplicated {
                for &p in ins {
                    eff_succ[p].push(i);
                }
            }
        }
        Ok(Program {
            graph,
            outputs: graph.outputs().iter().map(|(_, v)| *v).collect(),
            order,
            pos,
            role,
            eff_inputs,
            eff_succ,
            users,
        })
    }

    fn node(&self, i: usize) -> &autopar_ir::Node {
        self.graph.node(self.order[i])
    }

    fn producer(&self, v: ValueId) -> usize {
        self.pos[&self.graph.value(v).producer]
    }

    fn types(&self, vs: &[ValueId]) -> Vec<&TensorType> {
        vs.iter().map(|&v| self.graph.ty(v)).collect()
    }
}

/// Union-find over node positions, with each root's members.
struct Regions {
    parent: Vec<usize>,
    members: Vec<Vec<usize>>,
}

impl Regions {
    fn new(n: usize) -> Self {
        Regions {
            parent: (0..n).collect(),
            members: (0..n).map(|i| vec![i]).collect(),
        }
    }

    fn find(&mut self, mut i: usize) -> usize {
        while self.parent[i] != i {
            self.parent[i] = self.parent[self.parent[i]];
            i = self.parent[i];
        }
        i
    }

    fn union(&mut self, a: usize, b: usize) {
        let (keep, gone) = (a.min(b), a.max(b));
        self.parent[gone] = keep;
        let moved = std::mem::take(&mut self.members[gone]);
        self.members[keep].extend(moved);
    }
}

/// Groups the fusible nodes of `graph` into fusions (see the module docs). Value ids, the
/// outputs, and every unfused node (with its scope and metadata) stay as they are; a fusion
/// takes the scope and metadata of its last member, and its results keep the ids of the
/// values they compute.
pub fn fuse_regions(
    graph: &Graph,
    costs: &dyn OpCostModel,
) -> Result<(Graph, RegionStats), PassError> {
    let p = Program::new(graph)?;
    let n = p.order.len();
    let mut regions = Regions::new(n);
    for b in 0..n {
        if p.role[b] != Role::Member {
            continue;
        }
        for &a in &p.eff_inputs[b] {
            // Regions stay within one phase and micro-batch: a fusion reaching from the
            // forward into the backward would run where its first part was, computing the
            // backward's values early and keeping them alive until they are used.
            if p.role[a] != Role::Member || !same_step_part(&p, a, b) {
                continue;
            }
            let (ra, rb) = (regions.find(a), regions.find(b));
            if ra == rb {
                continue;
            }
            if !closes_cycle(&p, &mut regions, ra, rb) {
                regions.union(ra, rb);
            }
        }
    }
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for i in 0..n {
        if p.role[i] == Role::Member && regions.find(i) == i {
            let mut m = regions.members[i].clone();
            m.sort_unstable();
            for &x in &m {
                group_of[x] = Some(groups.len());
            }
            groups.push(m);
        }
    }
    let mut fused: Vec<bool> = vec![true; groups.len()];
    let mut stats = RegionStats::default();
    // Price every candidate; a rejected one changes what the others must export, so price
    // again until nothing changes.
    let bodies = loop {
        let materialised = materialised(&p, &group_of, &fused);
        let mut bodies: Vec<Option<Built>> = Vec::with_capacity(groups.len());
        let mut rejected = false;
        for (g, members) in groups.iter().enumerate() {
            if !fused[g] {
                bodies.push(None);
                continue;
            }
            let built = build_body(&p, g, members, &group_of, &materialised)?;
            if built.body.instrs.len() < 2 {
                fused[g] = false;
                bodies.push(None);
                continue;
            }
            if !cheaper(&p, &built, members, costs) {
                fused[g] = false;
                stats.rejected += 1;
                rejected = true;
                bodies.push(None);
                continue;
            }
            bodies.push(Some(built));
        }
        if !rejected {
            break (bodies, materialised);
        }
    };
    let (bodies, materialised) = bodies;
    emit(
        &p,
        &groups,
        &group_of,
        &fused,
        &bodies,
        &materialised,
        &mut stats,
    )
}

/// Whether two nodes are in the same phase and micro-batch.
fn same_step_part(p: &Program<'_>, a: usize, b: usize) -> bool {
    let (x, y) = (p.graph.meta(p.order[a]), p.graph.meta(p.order[b]));
    (x.phase, x.micro_batch) == (y.phase, y.micro_batch)
}

/// True when merging regions `a` and `b` would close a cycle: a path leaves the pair and
/// comes back to it through other nodes, a whole region counted as one node (a direct edge
/// between the two is what the merge absorbs).
fn closes_cycle(p: &Program<'_>, regions: &mut Regions, a: usize, b: usize) -> bool {
    let pair: Vec<usize> = regions.members[a]
        .iter()
        .chain(&regions.members[b])
        .copied()
        .collect();
    let mut stack: Vec<usize> = Vec::new();
    for m in pair {
        for &s in &p.eff_succ[m] {
            let r = regions.find(s);
            if r != a && r != b {
                stack.push(s);
            }
        }
    }
    let mut seen_region: HashSet<usize> = HashSet::new();
    while let Some(s) = stack.pop() {
        let r = regions.find(s);
        if r == a || r == b {
            return true;
        }
        if seen_region.insert(r) {
            for &m in &regions.members[r] {
                stack.extend(p.eff_succ[m].iter().copied());
            }
        }
    }
    false
}

/// Which duplicated nodes stay materialised: those that are outputs or have a user that is
/// not inside a fusion (an unfused node, or a materialised duplicated node).
fn materialised(p: &Program<'_>, group_of: &[Option<usize>], fused: &[bool]) -> Vec<bool> {
    let n = p.order.len();
    let mut m = vec![false; n];
    for i in (0..n).rev() {
        if p.role[i] != Role::Duplicated {
            continue;
        }
        let is_output = p.node(i).outputs.iter().any(|v| p.outputs.contains(v));
        m[i] = is_output
            || p.users[i].iter().any(|&u| match p.role[u] {
                Role::Duplicated => m[u],
                Role::Member => !group_of[u].is_some_and(|g| fused[g]),
                Role::Other => true,
            });
    }
    m
}

/// A body, with its operands and the values its results stand for.
struct Built {
    body: FusionBody,
    params: Vec<ValueId>,
    results: Vec<ValueId>,
    /// Duplicated nodes copied in.
    inlined: Vec<usize>,
}

/// Builds the body of group `g`: its members in order, with the duplicated nodes they read
/// copied in, reading every other value as an operand; its results are the members' values
/// read outside the fusion.
fn build_body(
    p: &Program<'_>,
    g: usize,
    members: &[usize],
    group_of: &[Option<usize>],
    materialised: &[bool],
) -> Result<Built, PassError> {
    let mut index: HashMap<ValueId, Ref> = HashMap::new();
    let mut params: Vec<ValueId> = Vec::new();
    let mut instrs: Vec<(Op, Vec<Ref>)> = Vec::new();
    let mut inlined: Vec<usize> = Vec::new();
    let in_group = |i: usize| group_of[i] == Some(g);

    fn operand(
        p: &Program<'_>,
        v: ValueId,
        in_group: &dyn Fn(usize) -> bool,
        index: &mut HashMap<ValueId, Ref>,
        params: &mut Vec<ValueId>,
        instrs: &mut Vec<(Op, Vec<Ref>)>,
        inlined: &mut Vec<usize>,
    ) -> Result<Ref, PassError> {
        if let Some(r) = index.get(&v) {
            return Ok(*r);
        }
        let prod = p.producer(v);
        let r = if in_group(prod) {
            return Err(PassError::BadGraph {
                graph: p.graph.name().to_string(),
                detail: format!("fusion: {v} is read before the member computing it"),
            });
        } else if p.role[prod] == Role::Duplicated {
            let node = p.node(prod);
            let mut ops = Vec::with_capacity(node.inputs.len());
            for &x in &node.inputs {
                ops.push(operand(p, x, in_group, index, params, instrs, inlined)?);
            }
            instrs.push((node.op.clone(), ops));
            inlined.push(prod);
            Ref::Instr(instrs.len() - 1)
        } else {
            params.push(v);
            Ref::Param(params.len() - 1)
        };
        index.insert(v, r);
        Ok(r)
    }

    for &m in members {
        let node = p.node(m);
        let mut ops = Vec::with_capacity(node.inputs.len());
        for &x in &node.inputs {
            ops.push(operand(
                p,
                x,
                &in_group,
                &mut index,
                &mut params,
                &mut instrs,
                &mut inlined,
            )?);
        }
        instrs.push((node.op.clone(), ops));
        index.insert(node.outputs[0], Ref::Instr(instrs.len() - 1));
    }
    // A member's value leaves the fusion when an output, an unfused node, another fusion or
    // a materialised copy reads it.
    let leaves = |v: ValueId, m: usize| -> bool {
        if p.outputs.contains(&v) {
            return true;
        }
        let mut stack: Vec<usize> = p.users[m].clone();
        let mut seen: HashSet<usize> = HashSet::new();
        while let Some(u) = stack.pop() {
            if !seen.insert(u) {
                continue;
            }
            match p.role[u] {
                Role::Duplicated if materialised[u] => return true,
                Role::Duplicated => stack.extend(p.users[u].iter().copied()),
                Role::Member if group_of[u] == Some(g) => {}
                Role::Member => return true,
                Role::Other => return true,
            }
        }
        false
    };
    let n_params = params.len();
    let number = |r: Ref| match r {
        Ref::Param(k) => k,
        Ref::Instr(j) => n_params + j,
    };
    let mut results = Vec::new();
    let mut result_values = Vec::new();
    for &m in members {
        let v = p.node(m).outputs[0];
        if leaves(v, m) {
            result_values.push(v);
            results.push(number(index[&v]));
        }
    }
    let body = FusionBody {
        params: params.iter().map(|&v| p.graph.ty(v).clone()).collect(),
        instrs: instrs
            .into_iter()
            .map(|(op, ops)| FusedInstr {
                op,
                operands: ops.into_iter().map(number).collect(),
            })
            .collect(),
        results,
    };
    Ok(Built {
        body,
        params,
        results: result_values,
        inlined,
    })
}

/// Whether the fusion costs no more than its members and the copies it inlines, each run as
/// its own kernel.
fn cheaper(p: &Program<'_>, built: &Built, members: &[usize], costs: &dyn OpCostModel) -> bool {
    if built.results.is_empty() {
        return false;
    }
    let op = Op::Fusion {
        body: built.body.clone(),
    };
    let fused = costs.op_cost(&op, &p.types(&built.params), &p.types(&built.results), None);
    let mut unfused = autopar_cost_model::Cost::ZERO;
    for &i in members.iter().chain(&built.inlined) {
        let node = p.node(i);
        let cost = costs.op_cost(
            &node.op,
            &p.types(&node.inputs),
            &p.types(&node.outputs),
            None,
        );
        unfused += cost.time;
    }
    fused.time <= unfused
}

/// Writes the fused program: the fusions and every node that stays, in an order as close to
/// the original as dependencies allow (each unit keyed by its first member's position).
fn emit(
    p: &Program<'_>,
    groups: &[Vec<usize>],
    group_of: &[Option<usize>],
    fused: &[bool],
    bodies: &[Option<Built>],
    materialised: &[bool],
    stats: &mut RegionStats,
) -> Result<(Graph, RegionStats), PassError> {
    let n = p.order.len();
    // Units: a fused group is `groups.len()`-indexed after the nodes.
    let unit_of = |i: usize| -> Option<usize> {
        match (p.role[i], group_of[i]) {
            (Role::Member, Some(g)) if fused[g] => Some(n + g),
            (Role::Duplicated, _) if !materialised[i] => None,
            _ => Some(i),
        }
    };
    let mut units: Vec<usize> = Vec::new();
    for i in 0..n {
        if let Some(u) = unit_of(i)
            && (u == i || groups[u - n][0] == i)
        {
            units.push(u);
        }
    }
    let inputs_of = |u: usize| -> Vec<ValueId> {
        match u.checked_sub(n) {
            Some(g) => bodies[g]
                .as_ref()
                .map(|b| b.params.clone())
                .unwrap_or_default(),
            None => p.node(u).inputs.clone(),
        }
    };
    let key = |u: usize| match u.checked_sub(n) {
        Some(g) => groups[g][0],
        None => u,
    };
    let comm: Vec<usize> = units
        .iter()
        .copied()
        .filter(|&u| u < n && p.node(u).op.is_communication())
        .collect();
    let previous_comm: HashMap<usize, usize> = comm.windows(2).map(|w| (w[1], w[0])).collect();
    let mut indegree: HashMap<usize, usize> = HashMap::new();
    let mut dependents: HashMap<usize, Vec<usize>> = HashMap::new();
    for &u in &units {
        let mut deps: Vec<usize> = previous_comm.get(&u).copied().into_iter().collect();
        for v in inputs_of(u) {
            let prod = p.producer(v);
            let Some(d) = unit_of(prod) else {
                return Err(PassError::BadGraph {
                    graph: p.graph.name().to_string(),
                    detail: format!("fusion: {v} is read but no longer computed"),
                });
            };
            deps.push(d);
        }
        deps.sort_unstable();
        deps.dedup();
        indegree.insert(u, deps.len());
        for d in deps {
            dependents.entry(d).or_default().push(u);
        }
    }
    let mut ready: BinaryHeap<Reverse<(usize, usize)>> = units
        .iter()
        .filter(|u| indegree[u] == 0)
        .map(|&u| Reverse((key(u), u)))
        .collect();
    let mut out = Graph::new(p.graph.name());
    out.set_mesh(p.graph.mesh().cloned());
    let mut emitted = 0usize;
    while let Some(Reverse((_, u))) = ready.pop() {
        emitted += 1;
        match u.checked_sub(n) {
            Some(g) => {
                let Some(built) = &bodies[g] else {
                    continue;
                };
                let root = *groups[g].last().unwrap_or(&groups[g][0]);
                let root_node = p.node(root);
                let id = out.add_node_with_ids(
                    Op::Fusion {
                        body: built.body.clone(),
                    },
                    &built.params,
                    &built.results,
                    root_node.scope.clone(),
                )?;
                out.set_meta(id, p.graph.meta(p.order[root]));
                for &v in &built.results {
                    out.set_sharding(v, p.graph.value(v).sharding.clone())?;
                }
                stats.fusions += 1;
                stats.members += groups[g].len();
                stats.duplicated += built.inlined.len();
            }
            None => {
                let node = p.node(u);
                out.copy_node(p.graph, p.order[u], &node.inputs, &node.outputs)?;
                for &v in &node.outputs {
                    out.set_sharding(v, p.graph.value(v).sharding.clone())?;
                }
            }
        }
        for &d in dependents.get(&u).map(Vec::as_slice).unwrap_or(&[]) {
            let e = indegree.get_mut(&d).map(|e| {
                *e -= 1;
                *e
            });
            if e == Some(0) {
                ready.push(Reverse((key(d), d)));
            }
        }
    }
    if emitted != units.len() {
        return Err(PassError::BadGraph {
            graph: p.graph.name().to_string(),
            detail: "fusion: the fused regions form a cycle".into(),
        });
    }
    for (name, v) in p.graph.outputs() {
        out.add_output(name.clone(), *v)?;
    }
    Ok((out, stats.clone()))
}
