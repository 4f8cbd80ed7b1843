//! JSON dump and load of a graph, with a stable, documented schema.
//!
//! Schema (version 1); field names are stable and new fields only ever get added:
//!
//! ```text
//! {
//!   "format": "autopar-graph",          // constant
//!   "version": 1,
//!   "name": "gpt-tiny",
//!   "mesh": null | { "axes": [{"name": "dp", "size": 2}, ...], "devices": [0, 1, ...] },
//!   "summary": { "num_nodes": N, "num_values": N, "num_parameters": N,
//!                "parameter_elements": N, "parameter_bytes": N },
//!   "nodes": [ {                          // in topological order
//!       "id": 3,                          // node id
//!       "op": { "op": "einsum", "spec": "bsh,hf->bsf" },   // "op" = mnemonic family, then
//!                                         //   the attributes of that op (see `Op`)
//!       "inputs": [1, 2],                 // operand value ids
//!       "outputs": [ { "id": 3, "type": {"dtype": "f32", "shape": [8, 32, 256]},
//!                      "sharding": null | { "axes": [["tp", {"shard": 1}], ["dp", "replicate"],
//!                                                    ["cp", {"partial": "sum"}]],
//!                                           "origin": "user" | "inferred" } } ],
//!       "scope": null | "h.0.mlp",        // provenance only
//!       "meta": {                         // optional; absent when the node has none
//!         "phase": "forward" | "saved" | "backward" | "recompute" | "accumulate" | "optimizer",
//!         "micro_batch": 0,
//!         "layer": "embedding" | {"block": 3} | "final_norm" | "head" | "loss",
//!         "part": "norm" | "attention" | "mlp",
//!         "role": "query" | "mlp_in" | ... } } ],   // parameters only; see `WeightRole`
//!                                         // each field optional, absent when unset
//!   "outputs": [ { "name": "loss", "value": 40 } ]
//! }
//! ```
//!
//! The `op` object is the serde form of [`Op`]: `"op"` is the variant in snake_case
//! (`parameter`, `einsum`, `unary`, `reduce`, `all_reduce`, ...) and the other keys are the
//! variant's fields (`func` names the function for `unary`/`binary`/`compare`/`reduce`).
//! Loading rebuilds the graph through the same typing rules as every other path and verifies it.

use serde::{Deserialize, Serialize};

use crate::error::IrError;
use crate::graph::{Graph, ValueId};
use crate::mesh::{DeviceMesh, MeshAxis};
use crate::meta::NodeMeta;
use crate::op::Op;
use crate::placement::Sharding;
use crate::types::TensorType;

/// The value of the `format` field.
pub const FORMAT: &str = "autopar-graph";
/// The schema version written by [`to_json`].
pub const VERSION: u32 = 1;

/// Top-level JSON document.
#[derive(Debug, Serialize, Deserialize)]
pub struct GraphDoc {
    /// Always [`FORMAT`].
    pub format: String,
    /// Schema version.
    pub version: u32,
    /// Graph name.
    pub name: String,
    /// Device mesh, if any.
    pub mesh: Option<MeshDoc>,
    /// Totals, for readers that only want the headline numbers (ignored when loading).
    pub summary: Summary,
    /// Nodes in topological order.
    pub nodes: Vec<NodeDoc>,
    /// Named graph outputs.
    pub outputs: Vec<OutputDoc>,
}

/// A device mesh.
#[derive(Debug, Serialize, Deserialize)]
pub struct MeshDoc {
    /// Axes, outermost first.
    pub axes: Vec<MeshAxis>,
    /// Device of each linear coordinate.
    pub devices: Vec<usize>,
}

/// Headline numbers of a graph.
#[derive(Debug, Serialize, Deserialize)]
pub struct Summary {
    /// Live nodes.
    pub num_nodes: usize,
    /// Live values.
    pub num_values: usize,
    /// Parameter ops.
    pub num_parameters: usize,
    /// Sum of the element counts of all parameters.
    pub parameter_elements: u64,
    /// Sum of the byte sizes of all parameters.
    pub parameter_bytes: u64,
}

/// One node.
#[derive(Debug, Serialize, Deserialize)]
pub struct NodeDoc {
    /// Node id.
    pub id: u32,
    /// The op and its attributes.
    pub op: Op,
    /// Operand value ids.
    pub inputs: Vec<u32>,
    /// Result values.
    pub outputs: Vec<ValueDoc>,
    /// Scope (layer path), if any.
    pub scope: Option<String>,
    /// Typed metadata (phase, micro-batch, layer, part, weight role); absent when empty.
    #[serde(default, skip_serializing_if = "NodeMeta::is_empty")]
    pub meta: NodeMeta,
}

/// One result value.
#[derive(Debug, Serialize, Deserialize)]
pub struct ValueDoc {
    /// Value id.
    pub id: u32,
    /// Static type.
    #[serde(rename = "type")]
    pub ty: TensorType,
    /// Placement, if annotated or inferred.
    pub sharding: Option<Sharding>,
}

/// One named graph output.
#[derive(Debug, Serialize, Deserialize)]
pub struct OutputDoc {
    /// Output name.
    pub name: String,
    /// Value id.
    pub value: u32,
}

/// The document for `g`.
pub fn to_doc(g: &Graph) -> GraphDoc {
    let params = g.parameters();
    GraphDoc {
        format: FORMAT.to_string(),
        version: VERSION,
        name: g.name().to_string(),
        mesh: g.mesh().map(|m| MeshDoc {
            axes: m.axes().to_vec(),
            devices: m.devices().to_vec(),
        }),
        summary: Summary {
            num_nodes: g.num_nodes(),
            num_values: g.value_ids().count(),
            num_parameters: params.len(),
            parameter_elements: g.num_parameter_elements(),
            parameter_bytes: params
                .iter()
                .map(|(_, _, t)| t.size_bytes())
                .fold(0, u64::saturating_add),
        },
        nodes: g
            .nodes_in_order()
            .into_iter()
            .map(|n| {
                let node = g.node(n);
                NodeDoc {
                    id: n.0,
                    op: node.op.clone(),
                    inputs: node.inputs.iter().map(|v| v.0).collect(),
                    outputs: node
                        .outputs
                        .iter()
                        .map(|&v| ValueDoc {
                            id: v.0,
                            ty: g.value(v).ty.clone(),
                            sharding: g.value(v).sharding.clone(),
                        })
                        .collect(),
                    scope: node.scope.clone(),
                    meta: g.meta(n),
                }
            })
            .collect(),
        outputs: g
            .outputs()
            .iter()
            .map(|(name, v)| OutputDoc {
                name: name.clone(),
                value: v.0,
            })
            .collect(),
    }
}

/// `g` as pretty-printed JSON.
pub fn to_json(g: &Graph) -> String {
    // Serialising plain data with string keys cannot fail.
    serde_json::to_string_pretty(&to_doc(g)).unwrap_or_default() + "\n"
}

/// Rebuilds a graph from a document: nodes are added in document order (which must define
/// values before their use), typing is re-checked, and the result is verified.
pub fn from_doc(doc: GraphDoc) -> Result<Graph, IrError> {
    if doc.format != FORMAT || doc.version != VERSION {
        return Err(IrError::Verify(format!(
            "not an {FORMAT} version {VERSION} document (format `{}`, version {})",
            doc.format, doc.version
        )));
    }
    let mut g = Graph::new(doc.name);
    if let Some(m) = doc.mesh {
        g.set_mesh(Some(DeviceMesh::with_devices(m.axes, m.devices)?));
    }
    for node in doc.nodes {
        let inputs: Vec<ValueId> = node.inputs.iter().map(|&v| ValueId(v)).collect();
        let ids: Vec<ValueId> = node.outputs.iter().map(|v| ValueId(v.id)).collect();
        let name = node.op.name();
        let n = g.add_node_with_ids(node.op, &inputs, &ids, node.scope)?;
        g.set_meta(n, node.meta);
        for (out, &v) in node.outputs.into_iter().zip(&g.node(n).outputs.clone()) {
            if g.ty(v) != &out.ty {
                return Err(IrError::ty(
                    name,
                    format!("{v} is declared {} but the op gives {}", out.ty, g.ty(v)),
                ));
            }
            g.set_sharding(v, out.sharding)?;
        }
    }
    for o in doc.outputs {
        g.add_output(o.name, ValueId(o.value))?;
    }
    crate::verify::verify(&g)?;
    Ok(g)
}

/// Parses JSON text produced by [`to_json`].
pub fn from_json(s: &str) -> Result<Graph, IrError> {
    let doc: GraphDoc =
        serde_json::from_str(s).map_err(|e| IrError::Verify(format!("invalid graph JSON: {e}")))?;
    from_doc(doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{EinsumSpec, Init, InputRole};
    use crate::placement::{Placement, ReduceKind, Sharding};
    use crate::types::DType;

    /// JSON has no NaN or infinity: non-finite constants (an attention mask's `-inf`) travel
    /// as strings, NaN with its bits, and load back to the same values.
    #[test]
    fn non_finite_constants_round_trip() {
        let nan = f64::from_bits(0x7ff8_0000_0000_1234);
        for value in [f64::NEG_INFINITY, f64::INFINITY, nan, -0.0, 1.5e300] {
            let mut g = Graph::new("c");
            let c = g
                .add(
                    Op::Constant {
                        ty: TensorType::new(DType::F32, [2]),
                        value,
                    },
                    &[],
                )
                .unwrap();
            g.add_output("c", c).unwrap();
            let text = to_json(&g);
            let back = from_json(&text).unwrap_or_else(|e| panic!("{value}: {e}\n{text}"));
            let got = back
                .node_ids()
                .into_iter()
                .find_map(|n| match back.node(n).op {
                    Op::Constant { value, .. } => Some(value),
                    _ => None,
                })
                .expect("a constant");
            assert_eq!(got.to_bits(), value.to_bits(), "{text}");
        }
        let bad = to_json(&{
            let mut g = Graph::new("c");
            let c = g
                .add(
                    Op::Constant {
                        ty: TensorType::new(DType::F32, []),
                        value: f64::INFINITY,
                    },
                    &[],
                )
                .unwrap();
            g.add_output("c", c).unwrap();
            g
        })
        .replace("\"inf\"", "\"infinity\"");
        let err = from_json(&bad).unwrap_err().to_string();
        assert!(err.contains("`infinity` is not a number"), "{err}");
    }

    #[test]
    fn json_round_trips_and_has_stable_fields() {
        let mut g = Graph::new("j");
        g.set_mesh(Some(DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap()));
        let x = g
            .add(
                Op::Input {
                    name: "x".into(),
                    ty: TensorType::new(DType::F32, [4, 8]),
                    role: InputRole::Features,
                },
                &[],
            )
            .unwrap();
        let w = g
            .add(
                Op::Parameter {
                    name: "w".into(),
                    ty: TensorType::new(DType::F32, [8, 6]),
                    init: Init::Normal { std: 0.02 },
                },
                &[],
            )
            .unwrap();
        g.set_sharding(
            w,
            Some(Sharding::user([("tp".to_string(), Placement::Shard(1))])),
        )
        .unwrap();
        let y = g
            .add(
                Op::Einsum {
                    spec: "bh,hf->bf".parse::<EinsumSpec>().unwrap(),
                },
                &[x, w],
            )
            .unwrap();
        let z = g
            .add(
                Op::AllReduce {
                    axes: vec!["dp".into()],
                    reduce: ReduceKind::Sum,
                },
                &[y],
            )
            .unwrap();
        g.add_output("z", z).unwrap();
        let s = to_json(&g);
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["format"], "autopar-graph");
        assert_eq!(v["summary"]["parameter_elements"], 48);
        assert_eq!(v["nodes"][1]["op"]["op"], "parameter");
        assert_eq!(v["nodes"][1]["op"]["init"]["normal"]["std"], 0.02);
        assert_eq!(
            v["nodes"][1]["outputs"][0]["sharding"]["axes"][0][1]["shard"],
            1
        );
        assert_eq!(v["nodes"][2]["op"]["spec"], "bh,hf->bf");
        assert_eq!(v["nodes"][3]["op"]["axes"][0], "dp");
        assert_eq!(v["outputs"][0]["name"], "z");
        let back = from_json(&s).unwrap();
        assert_eq!(back, g);
        assert_eq!(to_json(&back), s);
    }

    #[test]
    fn bad_json_is_an_error() {
        assert!(from_json("{").is_err());
        assert!(from_json(r#"{"format":"x","version":1}"#).is_err());
    }
}
