//! The strategy search as the driver offers it: the search itself and its result types
//! (from [`autopar_passes::search`]), and the constraints a user's annotation file and
//! `--pin` impose on it.

pub use autopar_passes::search::explain::{Comparison, megatron_reference, placed_axes};
pub use autopar_passes::search::export::{megatron_args, torchtitan_toml};
pub use autopar_passes::search::{
    Constraints, Progress, RankedPlan, SearchOptions, SearchResult, cpu_unsupported,
    search_with_progress,
};

use autopar_ir::{Axis, Graph, Placement, axis};

use crate::Error;

/// The constraints of an annotation file (`path`, its text `text`) for `model` combined with
/// `--pin`: `mesh:` lines pin plan keys, tensor lines require the axes they shard over to be
/// longer than 1, and a layer weight (by its role in `model`, not its name) split over `tp`
/// keeps its op split over `tp` in every plan. A tensor line must name a parameter or an
/// input of `model`.
pub fn annotation_constraints(
    model: &Graph,
    path: &str,
    text: &str,
    pin: &str,
) -> Result<Constraints, Error> {
    let usage = |e: String| Error::Usage(e);
    let mut pins = Vec::new();
    // Tensor lines go to the annotation parser with their line numbers kept.
    let mut tensors = String::new();
    for line in text.lines() {
        let content = line.split('#').next().unwrap_or("").trim();
        match content.split_once(':') {
            Some((name, rest)) if name.trim() == "mesh" => {
                pins.push(rest.trim().to_string());
                tensors.push('\n');
            }
            _ => {
                tensors.push_str(line);
                tensors.push('\n');
            }
        }
    }
    let file_pins = pins.join(",");
    let from_file =
        Constraints::parse(&file_pins).map_err(|e| usage(format!("{path}: `mesh:`: {e}")))?;
    let from_flag = Constraints::parse(pin).map_err(|e| usage(e.to_string()))?;
    let json = |c: &Constraints| serde_json::to_value(c).map_err(|e| usage(e.to_string()));
    let (a, b) = (json(&from_file)?, json(&from_flag)?);
    if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
        for (key, va) in a {
            if let Some(vb) = b.get(key)
                && !va.is_null()
                && !vb.is_null()
                // A flag such as `runtime=cpu` is either side's `true`.
                && !va.is_boolean()
                && va != vb
            {
                return Err(usage(format!("{path} pins {key} to {va}, --pin to {vb}")));
            }
        }
    }
    // The union of the two (they agree where both pin a key).
    let mut merged = b.clone();
    if let (Some(a), Some(m)) = (a.as_object(), merged.as_object_mut()) {
        for (key, va) in a {
            let unset = m
                .get(key)
                .is_none_or(|v| v.is_null() || *v == serde_json::Value::Bool(false));
            if unset {
                m.insert(key.clone(), va.clone());
            }
        }
    }
    let mut c: Constraints = serde_json::from_value(merged).map_err(|e| usage(e.to_string()))?;
    let annotations = autopar_passes::parallelize::parse_annotations(&tensors)
        .map_err(|e| usage(format!("{path}: {e}")))?;
    for a in &annotations {
        let parameter = model
            .parameters()
            .into_iter()
            .find(|(_, name, _)| *name == a.tensor)
            .map(|(v, _, _)| v);
        let is_input = model.inputs().iter().any(|(_, name, _)| *name == a.tensor);
        if parameter.is_none() && !is_input {
            return Err(usage(format!(
                "{path}:{}: `{}` is neither a parameter nor an input of `{}`",
                a.line,
                a.tensor,
                model.name()
            )));
        }
        for (name, placement) in &a.axes {
            if !matches!(placement, Placement::Shard(_)) {
                continue;
            }
            if Axis::from_name(name).is_none() {
                let names: Vec<&str> = Axis::ALL.iter().map(|a| a.name()).collect();
                return Err(usage(format!(
                    "{path}:{}: `{}` is sharded over `{name}`, which is not a plan axis ({})",
                    a.line,
                    a.tensor,
                    names.join(", ")
                )));
            }
            if !c.sharded_axes.contains(name) {
                c.sharded_axes.push(name.clone());
            }
            // A weight split over tp keeps its op split over tp in every plan.
            if name == axis::TP
                && let Some(op) = parameter
                    .and_then(|v| autopar_passes::parallelize::layer_op_of_parameter(model, v))
                && !c.tensor_ops.contains(&op)
            {
                c.tensor_ops.push(op);
            }
        }
    }
    Ok(c)
}
