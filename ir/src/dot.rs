//! Graphviz DOT dump: one box per node labelled with its op and result types (and the
//! placements of its results when known), edges for operands, and clusters by what the node
//! is to the model: one per phase (and micro-batch), holding one per layer, read from the
//! node metadata (`ir::meta`); a node's scope becomes its tooltip.
//!
//! A training step has thousands of nodes, which no drawing makes readable: [`DotOptions`]
//! selects layers ([`LayerSelection`], e.g. `0`, `0..2`, `embedding,head`), and operands
//! computed outside the selection are drawn as small placeholders naming their producer.
//! The dump sets `newrank`, without which Graphviz fails on clustered graphs of this shape
//! ("trouble in init_rank"). Render with `dot -Tsvg`. The output is deterministic.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write};
use std::str::FromStr;

use crate::graph::{Graph, NodeId};
use crate::meta::{LayerId, NodeMeta, Phase};
use crate::op::Op;

/// Which layers a dump shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerSelection {
    /// The layers shown.
    layers: BTreeSet<LayerId>,
    /// Whether nodes that belong to no layer (global clipping, loss scaling) are shown.
    unlayered: bool,
}

impl LayerSelection {
    /// Whether a node of `layer` is shown.
    pub fn contains(&self, layer: Option<LayerId>) -> bool {
        match layer {
            Some(l) => self.layers.contains(&l),
            None => self.unlayered,
        }
    }
}

impl FromStr for LayerSelection {
    type Err = String;

    /// A comma-separated list of: a block index `N` or `block(N)`, a range of blocks `A..B`
    /// (end excluded) or `A..=B`, `embedding`, `final_norm`, `head`, `loss`, and `none` (the
    /// nodes that belong to no layer).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut sel = LayerSelection::default();
        for item in s.split(',').map(str::trim) {
            let block = |t: &str| {
                t.parse::<u32>().map_err(|_| {
                    format!(
                        "bad layer `{item}` in `{s}`: expected a block index `N`, a range \
                         `A..B` or `A..=B`, `block(N)`, `embedding`, `final_norm`, `head`, \
                         `loss` or `none`"
                    )
                })
            };
            if item == "none" {
                sel.unlayered = true;
            } else if let Some((a, b)) = item.split_once("..") {
                let (b, inclusive) = match b.strip_prefix('=') {
                    Some(b) => (b, true),
                    None => (b, false),
                };
                let (a, b) = (block(a)?, block(b)?);
                let end = if inclusive { b.checked_add(1) } else { Some(b) };
                match end {
                    Some(end) if a < end => {
                        // A range is bounded by its text; a huge one is an error, not a loop.
                        if end - a > 1 << 16 {
                            return Err(format!("layer range `{item}` is too long"));
                        }
                        sel.layers.extend((a..end).map(LayerId::Block));
                    }
                    _ => return Err(format!("layer range `{item}` is empty")),
                }
            } else if let Ok(i) = item.parse::<u32>() {
                sel.layers.insert(LayerId::Block(i));
            } else {
                sel.layers.insert(item.parse::<LayerId>().map_err(|e| {
                    format!("{e}; or a block index `N`, a range `A..B`, or `none`")
                })?);
            }
        }
        Ok(sel)
    }
}

impl fmt::Display for LayerSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items: Vec<String> = self.layers.iter().map(ToString::to_string).collect();
        if self.unlayered {
            items.push("none".into());
        }
        f.write_str(&items.join(","))
    }
}

/// Options of a DOT dump.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DotOptions {
    /// Only the nodes of these layers (all nodes when `None`).
    pub layers: Option<LayerSelection>,
}

/// Renders `g` as a DOT digraph.
pub fn to_dot(g: &Graph) -> String {
    to_dot_with(g, &DotOptions::default())
}

/// The cluster a node is drawn in: its phase and micro-batch outside, its layer inside.
type ClusterKey = (Option<Phase>, Option<u32>, Option<LayerId>);

/// The nodes of one phase cluster, by layer.
type LayerClusters = BTreeMap<Option<LayerId>, Vec<NodeId>>;

fn cluster_key(meta: &NodeMeta) -> ClusterKey {
    (meta.phase, meta.micro_batch, meta.layer)
}

fn phase_label(phase: Option<Phase>, mb: Option<u32>) -> Option<String> {
    match (phase, mb) {
        (None, None) => None,
        (Some(p), None) => Some(p.to_string()),
        (None, Some(m)) => Some(format!("mb={m}")),
        (Some(p), Some(m)) => Some(format!("{p} mb={m}")),
    }
}

/// Renders the nodes of `g` that `options` selects as a DOT digraph.
pub fn to_dot_with(g: &Graph, options: &DotOptions) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph {} {{", quote(g.name()));
    out.push_str("  rankdir=TB; newrank=true;\n");
    out.push_str("  node [shape=box, style=\"rounded,filled\", fillcolor=white, fontname=\"monospace\", fontsize=10];\n");
    out.push_str("  edge [fontname=\"monospace\", fontsize=9];\n");
    let mut title = g.name().to_string();
    if let Some(mesh) = g.mesh() {
        let _ = write!(title, "  (mesh {mesh})");
    }
    if let Some(sel) = &options.layers {
        let _ = write!(title, "  (layers {sel})");
    }
    if title != g.name() {
        let _ = writeln!(out, "  label={}; labelloc=t;", quote(&title));
    }

    let order = g.nodes_in_order();
    let shown: BTreeSet<NodeId> = order
        .iter()
        .copied()
        .filter(|&n| match &options.layers {
            Some(sel) => sel.contains(g.meta(n).layer),
            None => true,
        })
        .collect();
    // Phase (and micro-batch) clusters, each holding layer clusters, in first-use order.
    let mut clusters: BTreeMap<(Option<Phase>, Option<u32>), LayerClusters> = BTreeMap::new();
    for &n in order.iter().filter(|n| shown.contains(n)) {
        let (phase, mb, layer) = cluster_key(&g.meta(n));
        clusters
            .entry((phase, mb))
            .or_default()
            .entry(layer)
            .or_default()
            .push(n);
    }
    let mut next_cluster = 0;
    for ((phase, mb), layers) in &clusters {
        let outer = phase_label(*phase, *mb);
        let indent = match &outer {
            Some(label) => {
                let _ = writeln!(out, "  subgraph cluster_{next_cluster} {{");
                next_cluster += 1;
                let _ = writeln!(
                    out,
                    "    label={}; style=solid; color=gray70;",
                    quote(label)
                );
                "    "
            }
            None => "  ",
        };
        for (layer, nodes) in layers {
            let inner = layer.map(|l| l.to_string());
            let node_indent = match &inner {
                Some(label) => {
                    let _ = writeln!(out, "{indent}subgraph cluster_{next_cluster} {{");
                    next_cluster += 1;
                    let _ = writeln!(
                        out,
                        "{indent}  label={}; style=dashed; color=gray50;",
                        quote(label)
                    );
                    format!("{indent}  ")
                }
                None => indent.to_string(),
            };
            for &n in nodes {
                let tooltip = match &g.node(n).scope {
                    Some(scope) => format!(", tooltip={}", quote(scope)),
                    None => String::new(),
                };
                let _ = writeln!(
                    out,
                    "{node_indent}{n} [label={}{}{tooltip}];",
                    quote(&node_label(g, n)),
                    node_style(&g.node(n).op)
                );
            }
            if inner.is_some() {
                let _ = writeln!(out, "{indent}}}");
            }
        }
        if outer.is_some() {
            out.push_str("  }\n");
        }
    }
    // Producers outside the selection, drawn once each as a placeholder.
    let mut elided = BTreeSet::new();
    for &n in order.iter().filter(|n| shown.contains(n)) {
        for (k, &v) in g.node(n).inputs.iter().enumerate() {
            let producer = g.value(v).producer;
            if !shown.contains(&producer) && elided.insert(producer) {
                let from = match g.meta(producer).layer {
                    Some(l) => format!("{v} from {l}"),
                    None => format!("{v} from {}", g.node(producer).op.name()),
                };
                let _ = writeln!(
                    out,
                    "  {producer} [label={}, shape=plaintext, style=\"\", fontcolor=gray40];",
                    quote(&from)
                );
            }
            let label = if g.node(n).inputs.len() > 1 {
                format!("{v} #{k}")
            } else {
                v.to_string()
            };
            let _ = writeln!(out, "  {producer} -> {n} [label={}];", quote(&label));
        }
    }
    for (i, (name, v)) in g.outputs().iter().enumerate() {
        let producer = g.value(*v).producer;
        if !shown.contains(&producer) {
            continue;
        }
        let _ = writeln!(
            out,
            "  out{i} [label={}, shape=oval, fillcolor=\"#e8e8e8\"];",
            quote(name)
        );
        let _ = writeln!(
            out,
            "  {producer} -> out{i} [label={}];",
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
    use crate::meta::NodeMeta;
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
        let block0 = NodeMeta {
            phase: Some(Phase::Forward),
            layer: Some(LayerId::Block(0)),
            ..NodeMeta::default()
        };
        g.set_meta(g.value(y).producer, block0);
        g.add_output("y", y).unwrap();
        let dot = to_dot(&g);
        assert!(dot.starts_with("digraph \"t\\\"q\" {"));
        assert!(dot.contains("newrank=true"));
        assert!(dot.contains("n0 [label=\"parameter w\\n%0: f32[4,8]\\n{tp: S(1)}\""));
        assert!(dot.contains("subgraph cluster_0 {"));
        assert!(dot.contains("label=\"forward\""));
        assert!(dot.contains("subgraph cluster_1 {"));
        assert!(dot.contains("label=\"block(0)\""));
        assert!(dot.contains("tooltip=\"h.0.mlp\""));
        assert!(dot.contains("n0 -> n1 [label=\"%0\"];"));
        assert!(dot.contains("n1 -> out0"));
        assert!(dot.trim_end().ends_with('}'));

        // Only block 0: the parameter (no layer) becomes a placeholder naming its producer.
        let options = DotOptions {
            layers: Some("0".parse().unwrap()),
        };
        let dot = to_dot_with(&g, &options);
        assert!(dot.contains("(layers block(0))"));
        assert!(dot.contains("n0 [label=\"%0 from parameter\", shape=plaintext"));
        assert!(dot.contains("n1 [label=\"gelu"));
        assert!(dot.contains("n1 -> out0"));
        // Only nodes without a layer: the consumer and the output are left out.
        let options = DotOptions {
            layers: Some("none".parse().unwrap()),
        };
        let dot = to_dot_with(&g, &options);
        assert!(dot.contains("n0 [label=\"parameter w"));
        assert!(!dot.contains("n1 ") && !dot.contains("out0"));
    }

    #[test]
    fn layer_selections_parse_and_refuse() {
        let sel: LayerSelection = "embedding, 0..2, 5, block(7), 9..=10, head, none"
            .parse()
            .unwrap();
        assert_eq!(
            sel.to_string(),
            "embedding,block(0),block(1),block(5),block(7),block(9),block(10),head,none"
        );
        assert!(sel.contains(None) && sel.contains(Some(LayerId::Head)));
        assert!(!sel.contains(Some(LayerId::Block(2))) && !sel.contains(Some(LayerId::Loss)));
        for bad in [
            "",
            "2..2",
            "3..1",
            "x",
            "1..y",
            "0..=4294967295",
            "0..4000000000",
            "block(z)",
        ] {
            let err = bad.parse::<LayerSelection>().unwrap_err();
            assert!(!err.is_empty(), "{bad}");
        }
    }
}
