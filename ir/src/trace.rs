//! Timeline export in the Chrome trace-event format (loads in Perfetto and `chrome://tracing`):
//! one track per rank and one slice per action, for executed steps and simulated schedules.
//!
//! The format is a JSON object `{"traceEvents": [...], "displayTimeUnit": "ms"}` whose events
//! are complete slices (`"ph": "X"`, start `ts` and duration `dur` in microseconds, track `tid`)
//! and one `thread_name` metadata event per track.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::schedule::{Action, Schedule, Timeline};

/// One slice of a timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSlice {
    /// Track (rank) index.
    pub track: usize,
    /// Label, e.g. `F mb3 c0`.
    pub name: String,
    /// Kind of work: `forward`, `backward`, `send`, `recv`, `collective`, `optimizer`, ...
    pub category: String,
    /// Start in nanoseconds from the beginning of the step.
    pub start_ns: u64,
    /// Duration in nanoseconds.
    pub duration_ns: u64,
    /// Extra key/value pairs shown when the slice is selected.
    pub args: BTreeMap<String, Value>,
}

/// Renders slices as a Chrome trace JSON document, naming track `i` `track_names[i]` (or
/// `rank i` when there are fewer names).
pub fn chrome_trace(track_names: &[String], slices: &[TraceSlice]) -> String {
    let n_tracks = slices
        .iter()
        .map(|s| s.track + 1)
        .max()
        .unwrap_or(0)
        .max(track_names.len());
    let mut events: Vec<Value> = (0..n_tracks)
        .map(|t| {
            let name = track_names
                .get(t)
                .cloned()
                .unwrap_or_else(|| format!("rank {t}"));
            json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": name}})
        })
        .collect();
    for s in slices {
        events.push(json!({
            "name": s.name,
            "cat": s.category,
            "ph": "X",
            "pid": 0,
            "tid": s.track,
            "ts": s.start_ns as f64 / 1e3,
            "dur": s.duration_ns as f64 / 1e3,
            "args": s.args,
        }));
    }
    let doc = json!({"traceEvents": events, "displayTimeUnit": "ms"});
    serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
}

/// The slices of a timed run of `schedule` (as returned by [`Schedule::simulate`]), with
/// `ns_per_unit` nanoseconds per timeline unit: one slice per action, in list order.
pub fn schedule_slices(
    schedule: &Schedule,
    timeline: &Timeline,
    ns_per_unit: f64,
) -> Vec<TraceSlice> {
    let mut slices = Vec::new();
    for (rank, (actions, spans)) in schedule.per_rank.iter().zip(&timeline.spans).enumerate() {
        for (action, &(start, end)) in actions.iter().zip(spans) {
            let (name, category) = describe(action);
            let mut args = BTreeMap::new();
            if let Some((mb, chunk)) = micro_batch_chunk(action) {
                args.insert("micro_batch".to_string(), json!(mb));
                args.insert("chunk".to_string(), json!(chunk));
                args.insert(
                    "virtual_stage".to_string(),
                    json!(schedule.virtual_stage(rank, chunk)),
                );
            }
            slices.push(TraceSlice {
                track: rank,
                name,
                category: category.to_string(),
                start_ns: (start as f64 * ns_per_unit) as u64,
                duration_ns: (end.saturating_sub(start) as f64 * ns_per_unit) as u64,
                args,
            });
        }
    }
    slices
}

/// Label and category of an action.
pub fn describe(action: &Action) -> (String, &'static str) {
    match *action {
        Action::Forward { micro_batch, chunk } => {
            (format!("F mb{micro_batch} c{chunk}"), "forward")
        }
        Action::Backward { micro_batch, chunk } => {
            (format!("B mb{micro_batch} c{chunk}"), "backward")
        }
        Action::SendActivation {
            micro_batch, to, ..
        } => (format!("send act mb{micro_batch} to {to}"), "send"),
        Action::RecvActivation {
            micro_batch, from, ..
        } => (format!("recv act mb{micro_batch} from {from}"), "recv"),
        Action::SendGradient {
            micro_batch, to, ..
        } => (format!("send grad mb{micro_batch} to {to}"), "send"),
        Action::RecvGradient {
            micro_batch, from, ..
        } => (format!("recv grad mb{micro_batch} from {from}"), "recv"),
        Action::OptimizerStep => ("optimizer step".to_string(), "optimizer"),
    }
}

fn micro_batch_chunk(action: &Action) -> Option<(usize, usize)> {
    match *action {
        Action::Forward { micro_batch, chunk }
        | Action::Backward { micro_batch, chunk }
        | Action::SendActivation {
            micro_batch, chunk, ..
        }
        | Action::RecvActivation {
            micro_batch, chunk, ..
        }
        | Action::SendGradient {
            micro_batch, chunk, ..
        }
        | Action::RecvGradient {
            micro_batch, chunk, ..
        } => Some((micro_batch, chunk)),
        Action::OptimizerStep => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleKind;

    #[test]
    fn one_track_per_rank_and_one_slice_per_action() {
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
        let t = s
            .simulate(
                |_, a| match a {
                    Action::Forward { .. } => 10,
                    Action::Backward { .. } => 20,
                    _ => 1,
                },
                |_, _| 2,
            )
            .unwrap();
        let slices = schedule_slices(&s, &t, 1000.0);
        let text = chrome_trace(&[], &slices);
        let doc: Value = serde_json::from_str(&text).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let meta: Vec<_> = events.iter().filter(|e| e["ph"] == "M").collect();
        assert_eq!(meta.len(), 2);
        assert_eq!(meta[1]["args"]["name"], "rank 1");
        let xs: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(xs.len(), s.per_rank.iter().map(Vec::len).sum::<usize>());
        // Per track, slices appear in schedule order and never go back in time.
        for rank in 0..2 {
            let starts: Vec<f64> = xs
                .iter()
                .filter(|e| e["tid"] == rank)
                .map(|e| e["ts"].as_f64().unwrap())
                .collect();
            assert!(starts.windows(2).all(|w| w[0] <= w[1]));
        }
        let first_fwd = xs.iter().find(|e| e["cat"] == "forward").unwrap();
        assert_eq!(first_fwd["name"], "F mb0 c0");
        assert_eq!(first_fwd["dur"], 10.0);
    }
}
