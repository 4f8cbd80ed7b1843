//! The pipeline timeline: one row per pipeline rank, forward and backward passes, waits for
//! stage-to-stage messages and the optimizer drawn where a schedule's timeline put them, idle
//! time (the bubbles) as the row's background, and the phases after the pipeline (exposed
//! gradient reduction, optimizer, ZeRO gathers) as a tail. Slices of one kind closer than
//! half a pixel are merged, so that 16 ranks of 768 passes stay small.

use autopar_driver::ir::schedule::{Action, Schedule, Timeline};
use autopar_driver::ir::trace::describe;

use super::svg::{Attrs, Svg, num};

/// Colour of a slice category.
pub fn category_colour(category: &str) -> &'static str {
    match category {
        "forward" => "#4e79a7",
        "backward" => "#f28e2b",
        "wait" => "#e15759",
        "optimizer" => "#b07aa1",
        "grad-reduce" => "#59a14f",
        "embedding-sync" => "#76b7b2",
        "param-gather" => "#edc948",
        _ => "#9c9c9c",
    }
}

/// A phase after the pipeline, the same on every rank.
pub struct TailPhase {
    /// Legend text.
    pub label: String,
    /// Category ([`category_colour`]).
    pub category: &'static str,
    /// Seconds.
    pub seconds: f64,
}

/// What to draw.
pub struct TimelineInput<'a> {
    /// The class of the `<svg>` (`timeline-predicted`, `timeline-measured`).
    pub class: &'a str,
    /// The schedule whose actions the spans time.
    pub schedule: &'a Schedule,
    /// Spans in nanoseconds, one per action.
    pub timeline: &'a Timeline,
    /// Phases after the pipeline.
    pub tail: Vec<TailPhase>,
    /// Row labels, one per pipeline rank.
    pub row_labels: Vec<String>,
    /// The caption written above the rows (the bubble fraction).
    pub caption: String,
    /// Only this window of the step, in nanoseconds (a zoom on the warm-up or cool-down);
    /// `None` for the whole step.
    pub window: Option<(f64, f64)>,
}

/// The drawn timeline and its counts.
pub struct TimelinePicture {
    /// The `<svg>` element.
    pub svg: String,
    /// Rows drawn (pipeline ranks).
    pub ranks: usize,
    /// Slices drawn after merging.
    pub slices: usize,
}

const LABEL_W: f64 = 130.0;
const PLOT_W: f64 = 960.0;
const ROW_H: f64 = 16.0;
const ROW_GAP: f64 = 5.0;

/// Draws `input`.
pub fn draw(input: &TimelineInput) -> TimelinePicture {
    let pipeline_ns = input.timeline.makespan as f64;
    let tail_ns: f64 = input.tail.iter().map(|p| p.seconds.max(0.0) * 1e9).sum();
    let total_ns = (pipeline_ns + tail_ns).max(1.0);
    let (t0, t1) = input.window.unwrap_or((0.0, total_ns));
    let t1 = t1.max(t0 + 1.0);
    let scale = PLOT_W / (t1 - t0);
    // x of time `t`, clipped to the window.
    let x_of = |t: f64| LABEL_W + (t.clamp(t0, t1) - t0) * scale;
    let ranks = input
        .schedule
        .per_rank
        .len()
        .min(input.timeline.spans.len());
    let top = 26.0;
    let rows_h = ranks as f64 * (ROW_H + ROW_GAP);
    let height = top + rows_h + 64.0;
    let mut svg = Svg::new(LABEL_W + PLOT_W + 20.0, height, Attrs::new());
    svg.text(
        Attrs::new()
            .n("x", LABEL_W)
            .n("y", 14.0)
            .s("class", "caption"),
        &input.caption,
    );
    let mut drawn = 0;
    for rank in 0..ranks {
        let y = top + rank as f64 * (ROW_H + ROW_GAP);
        svg.open(
            "g",
            Attrs::new()
                .s("class", "pp-rank")
                .s("data-rank", rank.to_string()),
        );
        svg.text(
            Attrs::new()
                .n("x", LABEL_W - 6.0)
                .n("y", y + 12.0)
                .s("class", "row-label")
                .s("text-anchor", "end"),
            input.row_labels.get(rank).map_or("", String::as_str),
        );
        svg.leaf_titled(
            "rect",
            Attrs::new()
                .n("x", x_of(0.0))
                .n("y", y)
                .n("width", x_of(pipeline_ns) - x_of(0.0))
                .n("height", ROW_H)
                .s("class", "idle"),
            "idle: pipeline bubble",
        );
        // (category, x0, x1, label of the first action, actions merged)
        let mut pieces: Vec<(&'static str, f64, f64, String, usize)> = Vec::new();
        for (action, &(s, e)) in input.schedule.per_rank[rank]
            .iter()
            .zip(&input.timeline.spans[rank])
        {
            if e <= s || (e as f64) < t0 || (s as f64) > t1 {
                continue;
            }
            let category = match action {
                Action::Forward { .. } => "forward",
                Action::Backward { .. } => "backward",
                Action::OptimizerStep => "optimizer",
                _ => "wait",
            };
            let (x0, x1) = (x_of(s as f64), x_of(e as f64));
            if let Some(last) = pieces.last_mut()
                && last.0 == category
                && x0 - last.2 < 0.5
            {
                last.2 = last.2.max(x1);
                last.4 += 1;
                continue;
            }
            pieces.push((category, x0, x1, describe(action).0, 1));
        }
        // Tooltips while the picture stays small; thousands of slices go without.
        if pieces.len() * ranks <= 1500 {
            for (category, x0, x1, label, merged) in &pieces {
                let a = Attrs::new()
                    .n("x", *x0)
                    .n("y", y)
                    .n("width", (x1 - x0).max(0.3))
                    .n("height", ROW_H)
                    .s("class", format!("slice {category}"));
                let ms = (x1 - x0) / scale / 1e6;
                let title = if *merged == 1 {
                    format!("{label}: {} ms", num_ms(ms))
                } else {
                    format!(
                        "{merged} {category} actions from {label}: {} ms",
                        num_ms(ms)
                    )
                };
                svg.leaf_titled("rect", a, &title);
            }
        } else {
            // Thousands of slices: one path of horizontal strokes per category, a few bytes
            // each, instead of an element per slice.
            for category in ["forward", "backward", "wait", "optimizer"] {
                let mut d = String::new();
                for (_, x0, x1, _, _) in pieces.iter().filter(|p| p.0 == category) {
                    d += &format!(
                        "M{} {}h{}",
                        num(*x0),
                        num(y + ROW_H / 2.0),
                        num((x1 - x0).max(0.3))
                    );
                }
                if !d.is_empty() {
                    svg.leaf(
                        "path",
                        Attrs::new()
                            .s("d", d)
                            .n("stroke-width", ROW_H)
                            .s("class", format!("lane {category}")),
                    );
                }
            }
        }
        drawn += pieces.len();
        // The phases after the pipeline.
        let mut t = pipeline_ns;
        for p in &input.tail {
            let d = p.seconds.max(0.0) * 1e9;
            let (x0, x1) = (x_of(t), x_of(t + d));
            if x1 > x0 {
                svg.leaf_titled(
                    "rect",
                    Attrs::new()
                        .n("x", x0)
                        .n("y", y)
                        .n("width", (x1 - x0).max(0.3))
                        .n("height", ROW_H)
                        .s("class", format!("slice {}", p.category)),
                    &format!("{}: {} ms", p.label, num_ms(p.seconds * 1e3)),
                );
                drawn += 1;
            }
            t += d;
        }
        svg.close("g");
    }
    // The time axis.
    let axis_y = top + rows_h + 2.0;
    svg.line(
        (LABEL_W, axis_y),
        (LABEL_W + PLOT_W, axis_y),
        Attrs::new().s("class", "axis"),
    );
    let (step, unit, div) = tick_step(t1 - t0, t1);
    let mut t = (t0 / step).ceil() * step;
    while t <= t1 * 1.0001 {
        let x = x_of(t);
        svg.line(
            (x, axis_y),
            (x, axis_y + 4.0),
            Attrs::new().s("class", "axis"),
        );
        svg.text(
            Attrs::new()
                .n("x", x)
                .n("y", axis_y + 15.0)
                .s("class", "tick")
                .s("text-anchor", "middle"),
            &format!("{} {unit}", num(t / div)),
        );
        t += step;
    }
    // Legend.
    let mut lx = LABEL_W;
    let ly = axis_y + 26.0;
    let mut keys: Vec<(String, &str)> = vec![
        ("forward".into(), "forward"),
        ("backward".into(), "backward"),
        ("waiting for a stage-to-stage message".into(), "wait"),
        ("idle (bubble)".into(), "idle"),
    ];
    for p in &input.tail {
        if p.seconds > 0.0 {
            keys.push((p.label.clone(), p.category));
        }
    }
    for (label, category) in keys {
        let fill = if category == "idle" {
            "#e8e8e8"
        } else {
            category_colour(category)
        };
        svg.rect(
            lx,
            ly,
            11.0,
            11.0,
            Attrs::new().s("fill", fill).s("class", "key"),
        );
        svg.text(
            Attrs::new()
                .n("x", lx + 15.0)
                .n("y", ly + 10.0)
                .s("class", "tick"),
            &label,
        );
        lx += 24.0 + 6.2 * label.len() as f64;
    }
    svg.set_root(
        Attrs::new()
            .s("class", input.class)
            .s("data-ranks", ranks.to_string())
            .s("data-slices", drawn.to_string()),
    );
    TimelinePicture {
        svg: svg.finish(),
        ranks,
        slices: drawn,
    }
}

fn num_ms(ms: f64) -> String {
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 1.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.4}")
    }
}

/// A tick step of 1, 2 or 5 times a power of ten giving at most about ten ticks over
/// `span_ns`, with the unit of times up to `end_ns` and the nanoseconds per unit.
fn tick_step(span_ns: f64, end_ns: f64) -> (f64, &'static str, f64) {
    let raw = span_ns / 8.0;
    let pow = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * pow)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * pow);
    let (unit, div) = if end_ns >= 1e9 {
        ("s", 1e9)
    } else if end_ns >= 1e6 {
        ("ms", 1e6)
    } else {
        ("us", 1e3)
    };
    (step, unit, div)
}
