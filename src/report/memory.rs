//! Memory per pipeline rank as stacked bars (weights, gradients, optimizer state,
//! activations of the in-flight micro-batches, working buffers, communication buffers,
//! reserved) against the device's capacity, with the measured peak of a run as a tick.

use autopar_cost_model::MemoryBreakdown;

use super::svg::{Attrs, Svg, num};

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// The segments of a bar: `(name, class, colour, bytes)`.
pub fn segments(m: &MemoryBreakdown) -> [(String, &'static str, &'static str, f64); 7] {
    [
        ("weights".into(), "weights", "#4e79a7", m.weights),
        ("gradients".into(), "gradients", "#f28e2b", m.gradients),
        (
            "optimizer state".into(),
            "optimizer",
            "#b07aa1",
            m.optimizer,
        ),
        (
            format!("activations ({} micro-batch chunks in flight)", m.in_flight),
            "activations",
            "#59a14f",
            m.activations,
        ),
        (
            "working (backward of one layer)".into(),
            "working",
            "#edc948",
            m.working,
        ),
        (
            "communication buffers".into(),
            "comm",
            "#76b7b2",
            m.comm_buffers,
        ),
        ("reserved".into(), "reserved", "#bab0ac", m.reserved),
    ]
}

/// The bars picture and the number of bars.
pub struct MemoryPicture {
    /// The `<svg>` element.
    pub svg: String,
    /// Bars drawn.
    pub bars: usize,
}

/// One bar per entry of `ranks` (named by `labels`); `capacity` in bytes; `measured[i]`, when
/// given, the peak a run recorded on rank `i`, in bytes.
pub fn draw(
    ranks: &[MemoryBreakdown],
    labels: &[String],
    capacity: f64,
    measured: Option<&[f64]>,
) -> MemoryPicture {
    let plot_h = 260.0;
    let left = 56.0;
    let top = 20.0;
    let bar_w = (900.0 / ranks.len().max(1) as f64).clamp(6.0, 56.0);
    let gap = (bar_w * 0.35).max(2.0);
    let width = (left + ranks.len() as f64 * (bar_w + gap) + 20.0).max(480.0);
    let drawn_peak = ranks
        .iter()
        .map(|m| m.total)
        .chain(measured.into_iter().flatten().copied())
        .fold(0.0, f64::max);
    // The capacity line only when it is on a readable scale with the bars.
    let show_capacity = capacity <= 4.0 * drawn_peak;
    let highest = if show_capacity {
        drawn_peak.max(capacity)
    } else {
        drawn_peak
    }
    .max(1.0);
    let (unit, per_unit) = if highest >= GIB {
        ("GiB", GIB)
    } else {
        ("MiB", MIB)
    };
    // The axis: the top at a whole tick.
    let step = nice((highest / per_unit) / 6.0);
    let highest = ((highest / per_unit / step).ceil() * step * per_unit).max(highest);
    let y_of = |bytes: f64| top + plot_h - bytes / highest * plot_h;
    let mut svg = Svg::new(width, top + plot_h + 150.0, Attrs::new());
    let mut g = 0.0;
    while g * per_unit <= highest * 1.0001 {
        let y = y_of(g * per_unit);
        svg.line(
            (left - 4.0, y),
            (width - 10.0, y),
            Attrs::new().s("class", "grid"),
        );
        svg.text(
            Attrs::new()
                .n("x", left - 6.0)
                .n("y", y + 4.0)
                .s("class", "tick")
                .s("text-anchor", "end"),
            &format!("{} {unit}", num(g)),
        );
        g += step;
    }
    let label_every = (ranks.len() / 24).max(1);
    for (i, m) in ranks.iter().enumerate() {
        let x = left + gap / 2.0 + i as f64 * (bar_w + gap);
        let name = labels
            .get(i)
            .cloned()
            .unwrap_or_else(|| format!("rank {i}"));
        svg.open(
            "g",
            Attrs::new()
                .s("class", "mem-bar")
                .s("data-rank", i.to_string())
                .s("data-total-bytes", format!("{}", m.total)),
        );
        let mut base = 0.0;
        for (what, class, colour, bytes) in segments(m) {
            if bytes <= 0.0 {
                continue;
            }
            let (y0, y1) = (y_of(base + bytes), y_of(base));
            svg.leaf_titled(
                "rect",
                Attrs::new()
                    .n("x", x)
                    .n("y", y0)
                    .n("width", bar_w)
                    .n("height", (y1 - y0).max(0.0))
                    .s("class", format!("mem-seg {class}"))
                    .s("fill", colour),
                &format!("{name}: {what} {} {unit}", num(bytes / per_unit)),
            );
            base += bytes;
        }
        if let Some(&peak) = measured.and_then(|m| m.get(i)) {
            let y = y_of(peak);
            svg.leaf_titled(
                "rect",
                Attrs::new()
                    .n("x", x - 2.0)
                    .n("y", y - 1.5)
                    .n("width", bar_w + 4.0)
                    .n("height", 3.0)
                    .s("class", "measured-peak"),
                &format!(
                    "{name}: measured peak {} MiB",
                    num(peak / (1u64 << 20) as f64)
                ),
            );
        }
        if i % label_every == 0 {
            let lx = x + bar_w / 2.0;
            let ly = top + plot_h + 12.0;
            svg.text(
                Attrs::new()
                    .n("x", lx)
                    .n("y", ly)
                    .s("class", "tick")
                    .s("text-anchor", "end")
                    .s("transform", format!("rotate(-40 {} {})", num(lx), num(ly))),
                &name,
            );
        }
        svg.close("g");
    }
    let cy = if show_capacity { y_of(capacity) } else { top };
    if show_capacity {
        svg.line(
            (left - 4.0, cy),
            (width - 10.0, cy),
            Attrs::new().s("class", "capacity"),
        );
    }
    svg.text(
        Attrs::new()
            .n("x", width - 12.0)
            .n("y", cy - 4.0)
            .s("class", "tick")
            .s("text-anchor", "end"),
        &if show_capacity {
            format!("capacity {} GiB", num(capacity / GIB))
        } else {
            format!("capacity {} GiB, far above this scale", num(capacity / GIB))
        },
    );
    // Legend.
    let ly = top + plot_h + 96.0;
    let mut lx = left;
    let mut row = 0.0;
    let mut keys: Vec<(String, &str)> = ranks
        .first()
        .map(|m| {
            segments(m)
                .into_iter()
                .map(|(what, _, colour, _)| {
                    (what.split(" (").next().unwrap_or("").to_string(), colour)
                })
                .collect()
        })
        .unwrap_or_default();
    if measured.is_some() {
        keys.push(("measured peak".into(), "#000000"));
    }
    for (what, colour) in keys {
        let w = 24.0 + 6.2 * what.len() as f64;
        if lx + w > width {
            lx = left;
            row += 16.0;
        }
        svg.rect(
            lx,
            ly + row,
            11.0,
            11.0,
            Attrs::new().s("fill", colour).s("class", "key"),
        );
        svg.text(
            Attrs::new()
                .n("x", lx + 15.0)
                .n("y", ly + row + 10.0)
                .s("class", "tick"),
            &what,
        );
        lx += w;
    }
    svg.fit_height(ly + row + 24.0);
    svg.set_root(
        Attrs::new()
            .s("class", "memory")
            .s("data-bars", ranks.len().to_string()),
    );
    MemoryPicture {
        svg: svg.finish(),
        bars: ranks.len(),
    }
}

/// 1, 2 or 5 times a power of ten, at least `x`.
fn nice(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return 1.0;
    }
    let pow = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * pow)
        .find(|s| *s >= x)
        .unwrap_or(10.0 * pow)
}
