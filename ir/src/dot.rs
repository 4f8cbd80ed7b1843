//! Graphviz DOT dump: one box per node labelled with its op and result types (and the
//! placements of its results when known), edges for operands, and one cluster per scope.
//!
//! Render with `dot -Tsvg`. The output is deterministic.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::graph::{Graph, NodeId};
use crate::op::Op;

/// Renders `g` as a DOT digraph.
pub fn to_dot(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph {} {{", quote(g.name()));
    out.push_str("  rankdir=TB;\n");
    out.push_str("  node [shape=box, style=\"rounded,filled\", fillcolor=white, fontname=\"monospace\", fontsize=10];\n");
    out.push_str("  edge [fontname=\"monospace\", fontsize=9];\n");
    if let Some(mesh) = g.mesh() {
        let _ = writeln!(
            out,
            "  label={}; labelloc=t;",
            quote(&format!("{}  (mesh {mesh})", g.name()))
        );
    }

    let order = g.nodes_in_order();
    let mut by_scope: BTreeMap<&str, Vec<NodeId>> = BTreeMap::new();
    for &n in &order {
        by_scope
            .entry(g.node(n).scope.as_deref().unwrap_or(""))
            .or_default()
            .push(n);
    }
    for (i, (scope, nodes)) in by_scope.iter().enumerate() {
        let indent = if scope.is_empty() {
            "  "
        } else {
            let _ = writeln!(out, "  subgraph cluster_{i} {{");
            let _ = writeln!(
                out,
                "    label={}; style=dashed; color=gray50;",
                quote(scope)
            );
            "    "
        };
        for &n in nodes {
            let _ = writeln!(
                out,
                "{indent}{n} [label={}{}];",
                quote(&node_label(g, n)),
                node_style(&g.node(n).op)
            );
        }
        if !scope.is_empty() {
            out.push_str("  }\n");
        }
    }
    for &n in &order {
        for (k, &v) in g.node(n).inputs.iter().enumerate() {
            let producer = g.value(v).producer;
            let label = if g.node(n).inputs.len() > 1 {
                format!("{v} #{k}")
            } else {
                v.to_string()
            };
            let _ = writeln!(out, "  {producer} -> {n} [label={}];", quote(&label));
        }
    }
    for (i, (name, v)) in g.outputs().iter().enumerate() {
        let _ = writeln!(
            out,
            "  out{i} [label={}, shape=oval, fillcolor=\"#e8e8e8\"];",
            quote(name)
        );
        let _ = writeln!(
            out,
            "  {} -> out{i} [label={}];",
            g.value(*v).producer,
            quote(&v.to_string())
        );
    }
    out.push_str("}\n");
    out
}

fn node_label(g: &Graph, n: NodeId) -> String {
    let node = g.node(n);
    let mut label = match &node.op {
        Op::Parameter { name, .. } | Op::Input { name, .. } => format!("{} {name}", node.op.name()),
        Op::Einsum { spec } => format!("einsum {spec}"),
        op => op.name().to_string(),
    };
    for &v in &node.outputs {
        let val = g.value(v);
        let _ = write!(label, "\n{v}: {}", val.ty);
        if let Some(s) = &val.sharding {
            let _ = write!(label, "\n{s}");
        }
    }
    label
}

fn node_style(op: &Op) -> &'static str {
    if op.is_communication() {
        ", fillcolor=\"#ffd9b3\""
    } else {
        match op {
            Op::Parameter { .. } => ", fillcolor=\"#d6eaff\"",
            Op::Input { .. } => ", fillcolor=\"#dff5d8\"",
            _ => "",
        }
    }
}

/// A DOT string literal.
fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Init, UnaryOp};
    use crate::placement::{Placement, Sharding};
    use crate::types::{DType, TensorType};

    #[test]
    fn dot_has_nodes_edges_placements_and_clusters() {
        let mut g = Graph::new("t\"q");
        let p = g
            .add(
                Op::Parameter {
                    name: "w".into(),
                    ty: TensorType::new(DType::F32, [4, 8]),
                    init: Init::Zeros,
                },
                &[],
            )
            .unwrap();
        g.set_sharding(
            p,
            Some(Sharding::user([("tp".to_string(), Placement::Shard(1))])),
        )
        .unwrap();
        let y = g
            .add(
                Op::Unary {
                    func: UnaryOp::Gelu,
                },
                &[p],
            )
            .unwrap();
        g.set_scope(g.value(y).producer, Some("h.0.mlp".into()));
        g.add_output("y", y).unwrap();
        let dot = to_dot(&g);
        assert!(dot.starts_with("digraph \"t\\\"q\" {"));
        assert!(dot.contains("n0 [label=\"parameter w\\n%0: f32[4,8]\\n{tp: S(1)}\""));
        assert!(dot.contains("subgraph cluster_1 {"));
        assert!(dot.contains("label=\"h.0.mlp\""));
        assert!(dot.contains("n0 -> n1 [label=\"%0\"];"));
        assert!(dot.contains("n1 -> out0"));
        assert!(dot.trim_end().ends_with('}'));
    }
}
