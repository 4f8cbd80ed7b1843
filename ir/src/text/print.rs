//! The printer: writes a graph in the canonical layout of the text format, which the parser
//! reads back to an equal graph.

use std::fmt::Write;

use crate::graph::{Graph, ValueId};
use crate::mesh::{DeviceMesh, is_identifier};
use crate::op::{FusionBody, Init, InputRole, Op};
use crate::placement::{Sharding, ShardingOrigin};

/// Prints `g` in the text format. See the [module docs](super) for the layout.
pub fn print(g: &Graph) -> String {
    let mut out = String::new();
    // Writing to a `String` cannot fail, so the `fmt::Result`s below are always `Ok`.
    let _ = write_graph(&mut out, g);
    out
}

fn write_graph(out: &mut String, g: &Graph) -> std::fmt::Result {
    writeln!(out, "graph {} {{", quote(g.name()))?;
    if let Some(mesh) = g.mesh().filter(|m| !m.axes().is_empty()) {
        writeln!(out, "  mesh {}", mesh_line(mesh))?;
    }
    for n in g.nodes_in_order() {
        let node = g.node(n);
        out.push_str("  ");
        for (i, &v) in node.outputs.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            write_result(out, g, v)?;
        }
        if !node.outputs.is_empty() {
            out.push_str(" = ");
        }
        out.push_str(node.op.name());
        for (i, v) in node.inputs.iter().enumerate() {
            out.push_str(if i == 0 { " " } else { ", " });
            write!(out, "{v}")?;
        }
        let attrs = attrs(&node.op);
        if !attrs.is_empty() {
            out.push_str(" {");
            for (i, (k, v)) in attrs.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write!(out, "{k}={v}")?;
            }
            out.push('}');
        }
        if let Some(scope) = &node.scope {
            write!(out, " scope={}", quote(scope))?;
        }
        let meta = g.meta(n);
        if !meta.is_empty() {
            write!(out, " meta{{{meta}}}")?;
        }
        out.push('\n');
    }
    for (name, v) in g.outputs() {
        writeln!(out, "  output {} = {v}", quote(name))?;
    }
    out.push_str("}\n");
    Ok(())
}

/// `dp=2, tp=4`, followed by ` devices=[...]` when the device map is not the identity.
fn mesh_line(mesh: &DeviceMesh) -> String {
    let mut s = mesh.to_string();
    if !mesh.has_identity_devices() {
        s.push_str(" devices=");
        s.push_str(&int_list(mesh.devices()));
    }
    s
}

/// `%3: f32[8,4] user{dp: S(0)}`.
fn write_result(out: &mut String, g: &Graph, v: ValueId) -> std::fmt::Result {
    write!(out, "{v}: ")?;
    // Every result of a live node is defined; a broken graph still prints (unparsably).
    let Ok(val) = g.value_checked(v) else {
        out.push_str("<undefined>");
        return Ok(());
    };
    write!(out, "{}", val.ty)?;
    if let Some(s) = &val.sharding {
        out.push(' ');
        out.push_str(&sharding(s));
    }
    Ok(())
}

/// `user{dp: S(0), tp: R}` or `inferred{...}`; axis names that are not identifiers are quoted.
pub(crate) fn sharding(s: &Sharding) -> String {
    let mut out = String::from(match s.origin {
        ShardingOrigin::User => "user{",
        ShardingOrigin::Inferred => "inferred{",
    });
    for (i, (axis, p)) in s.axes.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        if is_identifier(axis) {
            out.push_str(axis);
        } else {
            out.push_str(&quote(axis));
        }
        out.push_str(": ");
        out.push_str(&p.to_string());
    }
    out.push('}');
    out
}

/// The attributes of `op` as `(name, printed value)`, in field order. The names are exactly
/// [`super::schema::attr_names`].
pub(crate) fn attrs(op: &Op) -> Vec<(&'static str, String)> {
    let strs = |v: &[String]| {
        let items: Vec<String> = v.iter().map(|s| quote(s)).collect();
        format!("[{}]", items.join(","))
    };
    match op {
        Op::Parameter { name, ty: _, init } => {
            vec![("name", quote(name)), ("init", init_str(init))]
        }
        Op::Input { name, ty: _, role } => vec![("name", quote(name)), ("role", role_str(role))],
        Op::Constant { ty: _, value } => vec![("value", float(*value))],
        Op::Einsum { spec } => vec![("spec", quote(&spec.to_string()))],
        Op::Unary { func: _ }
        | Op::Binary { func: _ }
        | Op::Compare { func: _ }
        | Op::Select
        | Op::Gather
        | Op::CrossEntropy => Vec::new(),
        Op::Cast { to } => vec![("to", to.name().to_string())],
        Op::Reduce { func: _, dims } => vec![("dims", int_list(dims))],
        Op::Softmax { dim } | Op::Concat { dim } => vec![("dim", dim.to_string())],
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => vec![("eps", float(*eps))],
        Op::ScatterAdd { num_rows } => vec![("num_rows", num_rows.to_string())],
        Op::Reshape { shape } => vec![("shape", int_list(shape.dims()))],
        Op::Transpose { perm } => vec![("perm", int_list(perm))],
        Op::Slice { dim, start, end } => vec![
            ("dim", dim.to_string()),
            ("start", start.to_string()),
            ("end", end.to_string()),
        ],
        Op::Broadcast { shape, dims } => {
            vec![("shape", int_list(shape.dims())), ("dims", int_list(dims))]
        }
        Op::Rotary { base } => vec![("base", float(*base))],
        Op::Attention { causal, scale } | Op::AttentionBackward { causal, scale } => {
            vec![("causal", causal.to_string()), ("scale", float(*scale))]
        }
        Op::MoeRoute {
            top_k,
            capacity,
            normalize,
        } => vec![
            ("top_k", top_k.to_string()),
            ("capacity", capacity.to_string()),
            ("normalize", normalize.to_string()),
        ],
        Op::SgdUpdate {
            lr,
            momentum,
            weight_decay,
        } => vec![
            ("lr", float(*lr)),
            ("momentum", float(*momentum)),
            ("weight_decay", float(*weight_decay)),
        ],
        Op::AdamWUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => vec![
            ("lr", float(*lr)),
            ("beta1", float(*beta1)),
            ("beta2", float(*beta2)),
            ("eps", float(*eps)),
            ("weight_decay", float(*weight_decay)),
        ],
        Op::AllReduce { axes, reduce } => {
            vec![("axes", strs(axes)), ("reduce", reduce.name().to_string())]
        }
        Op::AllGather { axes, dim } => vec![("axes", strs(axes)), ("dim", dim.to_string())],
        Op::ReduceScatter { axes, dim, reduce } => vec![
            ("axes", strs(axes)),
            ("dim", dim.to_string()),
            ("reduce", reduce.name().to_string()),
        ],
        Op::AllToAll {
            axes,
            split_dim,
            concat_dim,
        } => vec![
            ("axes", strs(axes)),
            ("split_dim", split_dim.to_string()),
            ("concat_dim", concat_dim.to_string()),
        ],
        Op::CollectiveBroadcast { axes, root } => {
            vec![("axes", strs(axes)), ("root", root.to_string())]
        }
        Op::Send { axis, shift } | Op::Recv { axis, shift, ty: _ } => {
            vec![("axis", quote(axis)), ("shift", shift.to_string())]
        }
        Op::Fusion { body } => vec![("body", fusion_body(body))],
    }
}

/// `{^2: f32[8] = exp ^0; ^3: f32[8] = add ^2, ^1; yield ^3}`: the instructions of a fusion
/// body on one line, each with its result type, then the values it returns. The parameters
/// `^0..` are the fusion's operands, whose types the graph gives.
fn fusion_body(body: &FusionBody) -> String {
    let mut out = String::from("{");
    // The body admits no op without a result, and no result types are missing: every
    // instruction's type is inferred from the parameters.
    let types = body_types(body);
    for (i, instr) in body.instrs.iter().enumerate() {
        let at = body.params.len() + i;
        let ty = types
            .get(at)
            .map_or("<ill-typed>".to_string(), |t| t.to_string());
        let _ = write!(out, "^{at}: {ty} = {}", instr.op.name());
        for (k, v) in instr.operands.iter().enumerate() {
            out.push_str(if k == 0 { " " } else { ", " });
            let _ = write!(out, "^{v}");
        }
        let attrs = attrs(&instr.op);
        if !attrs.is_empty() {
            let items: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = write!(out, " {{{}}}", items.join(", "));
        }
        out.push_str("; ");
    }
    let results: Vec<String> = body.results.iter().map(|r| format!("^{r}")).collect();
    let _ = write!(out, "yield {}}}", results.join(", "));
    out
}

/// The type of every body value, as far as the body type-checks (a broken body prints,
/// unparsably, rather than panicking).
fn body_types(body: &FusionBody) -> Vec<crate::types::TensorType> {
    let mut types = body.params.clone();
    for instr in &body.instrs {
        let operands: Option<Vec<_>> = instr.operands.iter().map(|&v| types.get(v)).collect();
        let Some(operands) = operands else { break };
        match crate::infer::infer(&instr.op, &operands, None) {
            Ok(mut t) if t.len() == 1 => types.push(t.remove(0)),
            _ => break,
        }
    }
    types
}

fn init_str(init: &Init) -> String {
    match init {
        Init::Normal { std } => format!("normal({})", float(*std)),
        Init::Zeros => "zeros".into(),
        Init::Ones => "ones".into(),
    }
}

fn role_str(role: &InputRole) -> String {
    match role {
        InputRole::Tokens { vocab } => format!("tokens({vocab})"),
        InputRole::NextTokens { vocab } => format!("next_tokens({vocab})"),
        InputRole::Features => "features".into(),
        InputRole::RegressionTargets => "regression_targets".into(),
    }
}

/// `[1,2,3]`.
fn int_list(v: &[usize]) -> String {
    let items: Vec<String> = v.iter().map(usize::to_string).collect();
    format!("[{}]", items.join(","))
}

/// A float as Rust's `{:?}` writes it (the shortest text that reads back to the same bits:
/// `0.02`, `1e-5`, `1.0`, `-0.0`, `inf`, `NaN`). A NaN other than the canonical
/// [`f64::NAN`] has no such text, so it is written with its bits: `NaN(0x7ff8000000000001)`.
pub(crate) fn float(x: f64) -> String {
    if x.is_nan() && x.to_bits() != f64::NAN.to_bits() {
        format!("NaN(0x{:016x})", x.to_bits())
    } else {
        format!("{x:?}")
    }
}

/// A string literal: `"..."` with `\"`, `\\`, `\n`, `\t`, and `\u{XX}` for other control
/// characters; everything else as is.
pub(crate) fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::schema::{attr_names, prototypes};

    #[test]
    fn attrs_follow_the_schema() {
        for op in prototypes() {
            let names: Vec<&str> = attrs(&op).iter().map(|(k, _)| *k).collect();
            assert_eq!(names, attr_names(&op), "{}", op.name());
        }
    }

    #[test]
    fn floats_and_strings() {
        assert_eq!(float(0.02), "0.02");
        assert_eq!(float(1e-5), "1e-5");
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(-0.0), "-0.0");
        assert_eq!(float(f64::NEG_INFINITY), "-inf");
        assert_eq!(float(f64::NAN), "NaN");
        assert_eq!(float(-f64::NAN), "NaN(0xfff8000000000000)");
        assert_eq!(quote("a\"b\\\n\t\r\u{7f}é"), r#""a\"b\\\n\t\u{d}\u{7f}é""#);
    }
}
