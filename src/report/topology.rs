//! The topology picture: the plan's mesh placed on the cluster's nodes. Nodes are boxes of
//! GPUs labelled with their mesh coordinates, with the node's fabric and NICs; the groups of
//! each mesh axis are drawn in the axis's colour (outlines or arcs inside a node, one example
//! group as a path across nodes). Up to [`FULL_NODES_MAX`] nodes are drawn in full; a larger
//! cluster shows node 0 in full and every node as a small square coloured by its pipeline
//! stage, so that 1024 nodes stay a few hundred kilobytes.

use std::collections::BTreeSet;

use anyhow::{Context, Result};

use autopar_cost_model::{Cluster, MeshMapping, Plan};

use super::svg::{Attrs, Svg, esc, num, polyline_d};

/// Clusters of at most this many nodes are drawn node by node.
pub const FULL_NODES_MAX: usize = 16;

/// The colour of a mesh axis (the same in every picture of the report).
pub fn axis_colour(axis: &str) -> &'static str {
    match axis {
        "tp" => "#d62728",
        "dp" => "#2ca02c",
        "pp" => "#1f77b4",
        "cp" => "#9467bd",
        "ep" => "#ff7f0e",
        _ => "#7f7f7f",
    }
}

/// A fill for pipeline stage `stage` of `stages`: hues around the wheel.
pub fn stage_fill(stage: usize, stages: usize) -> String {
    let hue = 300.0 * stage as f64 / stages.max(1) as f64;
    format!("hsl({} 70% 75%)", num(hue))
}

/// What the topology picture drew, for the page's checks.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TopologyCounts {
    /// GPU boxes drawn (every GPU of the nodes drawn in full).
    pub gpus_drawn: usize,
    /// Nodes drawn in full.
    pub nodes_full: usize,
    /// Nodes drawn as summary squares (0 when every node is drawn in full).
    pub nodes_summarised: usize,
}

/// The picture, the legend (HTML) and the counts.
pub struct Topology {
    /// The `<svg>` element.
    pub svg: String,
    /// The axis legend and the sentence about the nodes not drawn in full, as HTML.
    pub legend: String,
    /// What was drawn.
    pub counts: TopologyCounts,
}

/// The mesh axes of size above 1, outermost first, as `(name, size, axis index)`.
fn live_axes(mapping: &MeshMapping) -> Vec<(String, usize, usize)> {
    mapping
        .axes()
        .iter()
        .enumerate()
        .filter(|(_, a)| a.size > 1)
        .map(|(i, a)| (a.name.clone(), a.size, i))
        .collect()
}

/// The groups of axis `axis_idx`: lists of linear coordinates in the order of the axis.
fn groups_of(mapping: &MeshMapping, axis_idx: usize) -> Vec<Vec<usize>> {
    let mesh = mapping.mesh();
    let size = mesh.axes()[axis_idx].size;
    let n = mesh.num_devices();
    let mut out = Vec::with_capacity(n / size.max(1));
    for linear in 0..n {
        let c = mesh.coords(linear);
        if c[axis_idx] != 0 {
            continue;
        }
        let mut members = Vec::with_capacity(size);
        let mut cc = c.clone();
        for k in 0..size {
            cc[axis_idx] = k;
            members.push(mesh.linear(&cc));
        }
        out.push(members);
    }
    out
}

// Layout of a node drawn in full.
const GPU_W: f64 = 72.0;
const GPU_H: f64 = 58.0;
const GPU_GAP: f64 = 8.0;
const PAD: f64 = 12.0;
const HEADER: f64 = 20.0;
const ARC_ZONE: f64 = 26.0;
const SWITCH_H: f64 = 20.0;
const NIC_H: f64 = 18.0;
const NODE_GAP: f64 = 36.0;
const MAX_COLS: usize = 8;

struct NodeLayout {
    cols: usize,
    rows: usize,
    w: f64,
    h: f64,
}

impl NodeLayout {
    fn new(gpus_per_node: usize) -> Self {
        let cols = gpus_per_node.clamp(1, MAX_COLS);
        let rows = gpus_per_node.div_ceil(cols).max(1);
        // Wide enough for the fabric's label.
        let w = (2.0 * PAD + cols as f64 * GPU_W + (cols - 1) as f64 * GPU_GAP).max(400.0);
        let h = HEADER
            + ARC_ZONE
            + rows as f64 * (GPU_H + GPU_GAP)
            + 10.0
            + SWITCH_H
            + 10.0
            + NIC_H
            + PAD;
        NodeLayout { cols, rows, w, h }
    }

    /// Top-left corner of local GPU `local` relative to the node's corner.
    fn gpu(&self, local: usize) -> (f64, f64) {
        let (r, c) = (local / self.cols, local % self.cols);
        (
            PAD + c as f64 * (GPU_W + GPU_GAP),
            HEADER + ARC_ZONE + r as f64 * (GPU_H + GPU_GAP),
        )
    }
}

/// Draws the topology of `plan` on `cluster`.
pub fn draw(cluster: &Cluster, plan: &Plan) -> Result<Topology> {
    let mapping = MeshMapping::new(&plan.mesh_axes(), cluster)
        .with_context(|| format!("placing the mesh of plan `{plan}` on the cluster"))?;
    let gpn = cluster.gpus_per_node.max(1);
    let n_devices = cluster.num_devices();
    let mesh = mapping.mesh();
    let mut linear_of = vec![None; n_devices];
    for linear in 0..mesh.num_devices() {
        linear_of[mapping.device(linear)] = Some(linear);
    }
    let axes = live_axes(&mapping);
    let pp_idx = mesh.axis_index("pp");
    let pp_size = plan.pp;

    let full_nodes = if cluster.nodes <= FULL_NODES_MAX {
        cluster.nodes
    } else {
        1
    };
    let node = NodeLayout::new(gpn);
    let node_cols = if full_nodes >= 2 { 2 } else { 1 };
    let node_rows = full_nodes.div_ceil(node_cols);
    let margin = 10.0;
    let width =
        (2.0 * margin + node_cols as f64 * node.w + (node_cols - 1) as f64 * NODE_GAP).max(640.0);
    let node_origin = |n: usize| -> (f64, f64) {
        (
            margin + (n % node_cols) as f64 * (node.w + NODE_GAP),
            margin + (n / node_cols) as f64 * (node.h + NODE_GAP),
        )
    };
    let gpu_centre = |device: usize| -> Option<(f64, f64)> {
        let n = device / gpn;
        (n < full_nodes).then(|| {
            let (ox, oy) = node_origin(n);
            let (gx, gy) = node.gpu(device % gpn);
            (ox + gx + GPU_W / 2.0, oy + gy + GPU_H / 2.0)
        })
    };
    let full_bottom = margin + node_rows as f64 * (node.h + NODE_GAP) - NODE_GAP;
    let network_y = full_bottom + 14.0;

    let mut counts = TopologyCounts {
        nodes_full: full_nodes,
        ..TopologyCounts::default()
    };
    let mut svg = Svg::new(width, network_y + 40.0, Attrs::new().s("class", "topology"));
    svg.open("g", Attrs::new().s("class", "nodes"));
    for n in 0..full_nodes {
        let (ox, oy) = node_origin(n);
        svg.open(
            "g",
            Attrs::new()
                .s("class", "node-full")
                .s("data-node", n.to_string()),
        );
        svg.rect(
            ox,
            oy,
            node.w,
            node.h,
            Attrs::new().s("class", "node-box").n("rx", 6.0),
        );
        svg.text(
            Attrs::new()
                .n("x", ox + PAD)
                .n("y", oy + 15.0)
                .s("class", "node-title"),
            &format!("node {n} ({gpn} x {})", cluster.gpu.model),
        );
        for local in 0..gpn {
            let device = n * gpn + local;
            let (gx, gy) = node.gpu(local);
            let (x, y) = (ox + gx, oy + gy);
            let used = linear_of.get(device).copied().flatten();
            let fill = match (used, pp_idx) {
                (Some(l), Some(i)) if pp_size > 1 => stage_fill(mesh.coords(l)[i], pp_size),
                (Some(_), _) => "#f4f4f4".to_string(),
                (None, _) => "#d9d9d9".to_string(),
            };
            let title = match used {
                Some(l) => format!(
                    "GPU {device} (node {n}, local {local}): {}",
                    coords_text(&mapping, l)
                ),
                None => format!("GPU {device} (node {n}, local {local}): not used by the plan"),
            };
            svg.leaf_titled(
                "rect",
                Attrs::new()
                    .n("x", x)
                    .n("y", y)
                    .n("width", GPU_W)
                    .n("height", GPU_H)
                    .n("rx", 4.0)
                    .s("class", "gpu")
                    .s("fill", fill)
                    .s("data-device", device.to_string()),
                &title,
            );
            counts.gpus_drawn += 1;
            svg.text(
                Attrs::new()
                    .n("x", x + 5.0)
                    .n("y", y + 13.0)
                    .s("class", "gpu-name"),
                &format!("GPU {device}"),
            );
            match used {
                Some(l) => {
                    let c = mesh.coords(l);
                    for (line, chunk) in axes.chunks(2).enumerate() {
                        let mut runs = Vec::new();
                        for (k, (name, _, i)) in chunk.iter().enumerate() {
                            if k > 0 {
                                runs.push((" ".to_string(), None));
                            }
                            runs.push((format!("{name}{}", c[*i]), Some(axis_colour(name))));
                        }
                        svg.text_runs(
                            Attrs::new()
                                .n("x", x + 5.0)
                                .n("y", y + 27.0 + 12.0 * line as f64)
                                .s("class", "gpu-coord"),
                            &runs,
                        );
                    }
                    if axes.is_empty() {
                        svg.text(
                            Attrs::new()
                                .n("x", x + 5.0)
                                .n("y", y + 27.0)
                                .s("class", "gpu-coord"),
                            "rank 0",
                        );
                    }
                }
                None => svg.text(
                    Attrs::new()
                        .n("x", x + 5.0)
                        .n("y", y + 27.0)
                        .s("class", "gpu-coord"),
                    "idle",
                ),
            }
        }
        // The intra-node fabric: one switch bar every GPU connects to.
        let sy = oy + HEADER + ARC_ZONE + node.rows as f64 * (GPU_H + GPU_GAP) + 10.0;
        for local in 0..gpn {
            let (gx, gy) = node.gpu(local);
            svg.line(
                (ox + gx + GPU_W / 2.0, oy + gy + GPU_H),
                (ox + gx + GPU_W / 2.0, sy),
                Attrs::new().s("class", "link-nvlink"),
            );
        }
        svg.rect(
            ox + PAD,
            sy,
            node.w - 2.0 * PAD,
            SWITCH_H,
            Attrs::new().s("class", "switch").n("rx", 3.0),
        );
        svg.text(
            Attrs::new()
                .n("x", ox + node.w / 2.0)
                .n("y", sy + 14.0)
                .s("class", "link-label")
                .s("text-anchor", "middle"),
            &format!(
                "{}: {} GB/s bus bandwidth per GPU, {} us",
                cluster.intra_node.fabric,
                num(cluster.intra_node.bus_bandwidth_gb_per_s),
                num(cluster.intra_node.latency_us)
            ),
        );
        // NICs, each joined to the network below.
        let nics = cluster.network.nics_per_node.max(1);
        let ny = sy + SWITCH_H + 10.0;
        let nic_w = ((node.w - 2.0 * PAD) - (nics - 1) as f64 * 4.0) / nics as f64;
        for k in 0..nics {
            let x = ox + PAD + k as f64 * (nic_w + 4.0);
            svg.leaf_titled(
                "rect",
                Attrs::new()
                    .n("x", x)
                    .n("y", ny)
                    .n("width", nic_w)
                    .n("height", NIC_H)
                    .n("rx", 2.0)
                    .s("class", "nic"),
                &format!(
                    "NIC {k} of node {n}: {} GB/s bus bandwidth",
                    num(cluster.network.nic_bus_bandwidth_gb_per_s)
                ),
            );
            if nic_w > 34.0 {
                svg.text(
                    Attrs::new()
                        .n("x", x + nic_w / 2.0)
                        .n("y", ny + 12.5)
                        .s("class", "nic-label")
                        .s("text-anchor", "middle"),
                    &format!("NIC {k}"),
                );
            }
        }
        svg.line(
            (ox + node.w / 2.0, ny + NIC_H),
            (ox + node.w / 2.0, oy + node.h),
            Attrs::new().s("class", "link-net"),
        );
        svg.close("g");
    }
    svg.close("g");

    // Groups of each axis.
    let mut legend_rows = Vec::new();
    let innermost = axes.last().map(|a| a.0.clone());
    let arc_axes: Vec<&(String, usize, usize)> = axes
        .iter()
        .filter(|(name, _, _)| Some(name) != innermost.as_ref())
        .collect();
    svg.open("g", Attrs::new().s("class", "groups"));
    for (name, size, idx) in &axes {
        let info = mapping
            .axis_group(name)
            .with_context(|| format!("the `{name}` groups of the mesh"))?;
        let colour = axis_colour(name);
        let groups = groups_of(&mapping, *idx);
        let n_groups = groups.len();
        let contiguous = Some(name) == innermost.as_ref();
        let level = arc_axes.iter().position(|a| &a.0 == name).unwrap_or(0) as f64;
        if info.intra_node() {
            for (k, g) in groups.iter().enumerate() {
                let devices: Vec<usize> = g.iter().map(|&l| mapping.device(l)).collect();
                if devices[0] / gpn >= full_nodes {
                    continue;
                }
                let (ox, oy) = node_origin(devices[0] / gpn);
                let locals: Vec<usize> = devices.iter().map(|d| d % gpn).collect();
                let one_row = locals
                    .iter()
                    .all(|l| l / node.cols == locals[0] / node.cols);
                let consecutive = locals.windows(2).all(|w| w[1] == w[0] + 1);
                if contiguous && one_row && consecutive {
                    let (x0, y0) = node.gpu(locals[0]);
                    let (x1, _) = node.gpu(locals[locals.len() - 1]);
                    svg.leaf_titled(
                        "rect",
                        Attrs::new()
                            .n("x", ox + x0 - 3.0)
                            .n("y", oy + y0 - 3.0)
                            .n("width", x1 - x0 + GPU_W + 6.0)
                            .n("height", GPU_H + 6.0)
                            .n("rx", 6.0)
                            .s("class", "group-outline")
                            .s("stroke", colour),
                        &format!("a {name} group of {size} GPUs"),
                    );
                } else {
                    let mut d = String::new();
                    for w in locals.windows(2) {
                        let (ax, ay) = node.gpu(w[0]);
                        let (bx, by) = node.gpu(w[1]);
                        let (ax, bx) = (ox + ax + GPU_W / 2.0, ox + bx + GPU_W / 2.0);
                        let top = oy + ay.min(by);
                        let lift =
                            6.0 + 5.0 * level + 3.0 * (k % 4) as f64 + 0.02 * (bx - ax).abs();
                        d += &format!(
                            "M{} {} Q{} {} {} {} ",
                            num(ax),
                            num(oy + ay),
                            num((ax + bx) / 2.0),
                            num(top - lift.min(ARC_ZONE - 2.0)),
                            num(bx),
                            num(oy + by)
                        );
                    }
                    svg.leaf_titled(
                        "path",
                        Attrs::new()
                            .s("d", d.trim_end())
                            .s("class", "group-arc")
                            .s("stroke", colour),
                        &format!("a {name} group of {size} GPUs"),
                    );
                }
            }
        } else if let Some(example) = groups.first() {
            // One group across nodes, through the GPUs drawn.
            let points: Vec<(f64, f64)> = example
                .iter()
                .filter_map(|&l| gpu_centre(mapping.device(l)))
                .map(|(x, y)| (x + (level - 1.0) * 6.0, y + 8.0 + 4.0 * level))
                .collect();
            if points.len() >= 2 {
                svg.leaf_titled(
                    "path",
                    Attrs::new()
                        .s("d", polyline_d(&points))
                        .s("class", "group-path")
                        .s("stroke", colour),
                    &format!("the {name} group of GPU {}", mapping.device(example[0])),
                );
                for &(x, y) in &points {
                    svg.leaf(
                        "circle",
                        Attrs::new()
                            .n("cx", x)
                            .n("cy", y)
                            .n("r", 3.5)
                            .s("fill", colour),
                    );
                }
            }
        }
        let fabric = if info.intra_node() {
            format!(
                "inside a node over {} ({} GB/s bus)",
                cluster.intra_node.fabric,
                num(cluster.intra_node.bus_bandwidth_gb_per_s)
            )
        } else {
            format!(
                "each spanning {} nodes ({} per node), {} NIC(s) per group on a node, {} group(s) \
                 per NIC: {} GB/s across nodes per group",
                info.nodes_spanned,
                info.members_per_node,
                info.nics_per_group,
                info.groups_per_nic,
                num(info.inter_node_bandwidth(cluster) / 1e9)
            )
        };
        let drawn = if info.intra_node() {
            if contiguous {
                "outlined"
            } else {
                "joined by arcs"
            }
        } else {
            "one drawn as a path"
        };
        legend_rows.push(format!(
            "<li><span class=\"swatch\" style=\"background:{colour}\"></span><b>{name}={size}</b>: \
             {n_groups} groups of {size} GPUs, {} ({drawn})</li>",
            esc(&fabric)
        ));
    }
    svg.close("g");

    // The network joining the nodes.
    svg.rect(
        margin,
        network_y,
        width - 2.0 * margin,
        18.0,
        Attrs::new().s("class", "network").n("rx", 3.0),
    );
    svg.text(
        Attrs::new()
            .n("x", width / 2.0)
            .n("y", network_y + 13.0)
            .s("class", "link-label")
            .s("text-anchor", "middle"),
        &format!(
            "network: {} nodes x {} NIC(s) x {} GB/s bus bandwidth ({} GB/s per node), {} us",
            cluster.nodes,
            cluster.network.nics_per_node,
            num(cluster.network.nic_bus_bandwidth_gb_per_s),
            num(cluster.network.nic_bus_bandwidth_gb_per_s * cluster.network.nics_per_node as f64),
            num(cluster.network.latency_us)
        ),
    );
    let mut bottom = network_y + 30.0;

    let mut summary = String::new();
    if full_nodes < cluster.nodes {
        let (y, sentence) = draw_node_grid(&mut svg, cluster, &mapping, &linear_of, bottom, width);
        counts.nodes_summarised = cluster.nodes;
        bottom = y;
        summary = sentence;
    }
    svg.fit_height(bottom);
    svg.set_root(
        Attrs::new()
            .s("class", "topology")
            .s("data-gpus-drawn", counts.gpus_drawn.to_string())
            .s("data-nodes-full", counts.nodes_full.to_string())
            .s("data-nodes-summarised", counts.nodes_summarised.to_string()),
    );
    let svg_text = svg.finish();
    let used = mesh.num_devices();
    let mut legend = format!(
        "<p>{} of the {} GPUs ({} node(s) of {gpn}) run the mesh {}; each GPU is labelled with its \
         mesh coordinates{}.</p><ul class=\"legend\">{}</ul>",
        used,
        n_devices,
        cluster.nodes,
        esc(&mesh_text(&mapping)),
        if pp_size > 1 {
            " and filled with the colour of its pipeline stage"
        } else {
            ""
        },
        legend_rows.join("")
    );
    if !summary.is_empty() {
        legend += &format!("<p class=\"summary\">{}</p>", esc(&summary));
    }
    Ok(Topology {
        svg: svg_text,
        legend,
        counts,
    })
}

/// `pp=16 x dp=8 x tp=8` (axes of size above 1, outermost first).
fn mesh_text(mapping: &MeshMapping) -> String {
    let axes = live_axes(mapping);
    if axes.is_empty() {
        return "of one device".into();
    }
    axes.iter()
        .map(|(n, s, _)| format!("{n}={s}"))
        .collect::<Vec<_>>()
        .join(" x ")
}

/// `pp=1, dp=0, tp=3` of a linear coordinate.
fn coords_text(mapping: &MeshMapping, linear: usize) -> String {
    let c = mapping.mesh().coords(linear);
    let parts: Vec<String> = live_axes(mapping)
        .iter()
        .map(|(n, _, i)| format!("{n}={}", c[*i]))
        .collect();
    if parts.is_empty() {
        "rank 0".into()
    } else {
        parts.join(", ")
    }
}

/// Every node as a square coloured by the pipeline stage of its GPUs, the example group of
/// each axis that spans nodes as a path through the squares; returns the bottom and the
/// sentence that describes the pattern.
fn draw_node_grid(
    svg: &mut Svg,
    cluster: &Cluster,
    mapping: &MeshMapping,
    linear_of: &[Option<usize>],
    top: f64,
    width: f64,
) -> (f64, String) {
    let gpn = cluster.gpus_per_node.max(1);
    let nodes = cluster.nodes;
    let mesh = mapping.mesh();
    let axes = live_axes(mapping);
    let pp_idx = mesh.axis_index("pp");
    let pp = pp_idx.map_or(1, |i| mesh.axes()[i].size);
    let gap = 3.0;
    // The pipeline stage of each node (that of its first GPU in use).
    let node_stage: Vec<Option<usize>> = (0..nodes)
        .map(|n| {
            let first = (0..gpn).find_map(|l| linear_of.get(n * gpn + l).copied().flatten())?;
            Some(pp_idx.map_or(0, |i| mesh.coords(first)[i]))
        })
        .collect();
    // When each stage holds a run of consecutive nodes, whole rows per stage (labelled);
    // otherwise a square.
    let per_stage = if pp > 1 && nodes.is_multiple_of(pp) {
        nodes / pp
    } else {
        0
    };
    let stage_rows = per_stage >= 2
        && node_stage
            .iter()
            .enumerate()
            .all(|(n, s)| s.is_none_or(|s| s == n / per_stage));
    let divisor = (1..=per_stage.min(48))
        .rev()
        .find(|c| per_stage.is_multiple_of(*c))
        .unwrap_or(1);
    let by_stage = stage_rows && (divisor >= 8 || divisor == per_stage);
    // Stages taking turns node by node (pp inside dp): a column per stage.
    let stage_cols = !by_stage
        && (2..=48).contains(&pp)
        && node_stage
            .iter()
            .enumerate()
            .all(|(n, s)| s.is_none_or(|s| s == n % pp));
    let cols = if by_stage {
        divisor
    } else if stage_cols {
        pp
    } else {
        (nodes as f64).sqrt().ceil() as usize
    }
    .max(1);
    let rows_per_stage = if by_stage { per_stage / cols } else { 1 };
    let left = if by_stage { 62.0 } else { 10.0 };
    let cell = ((width - left - 10.0) / cols as f64 - gap).clamp(5.0, 20.0);
    let grid_top = top + 22.0;
    svg.text(
        Attrs::new().n("x", 10.0).n("y", top + 12.0).s("class", "node-title"),
        &format!(
            "all {nodes} nodes (node 0 above), each square a node of {gpn} GPUs filled with its pipeline stage"
        ),
    );
    let centre = |n: usize| -> (f64, f64) {
        (
            left + (n % cols) as f64 * (cell + gap) + cell / 2.0,
            grid_top + (n / cols) as f64 * (cell + gap) + cell / 2.0,
        )
    };
    // Distinct coordinates per node and axis: the pattern the sentence describes.
    let mut distinct: Vec<(usize, usize)> = vec![(usize::MAX, 0); axes.len()];
    svg.open(
        "g",
        Attrs::new()
            .s("class", "node-grid")
            .s("data-nodes", nodes.to_string()),
    );
    for (n, stage) in node_stage.iter().enumerate() {
        let members: Vec<usize> = (0..gpn)
            .filter_map(|l| linear_of.get(n * gpn + l).copied().flatten())
            .collect();
        let mut sets: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); axes.len()];
        for &l in &members {
            let c = mesh.coords(l);
            for (k, (_, _, i)) in axes.iter().enumerate() {
                sets[k].insert(c[*i]);
            }
        }
        if !members.is_empty() {
            for (k, s) in sets.iter().enumerate() {
                distinct[k].0 = distinct[k].0.min(s.len());
                distinct[k].1 = distinct[k].1.max(s.len());
            }
        }
        let fill = match *stage {
            None => "#d9d9d9".to_string(),
            Some(s) if pp > 1 => stage_fill(s, pp),
            Some(_) => "#f4f4f4".to_string(),
        };
        let what: Vec<String> = axes
            .iter()
            .zip(&sets)
            .map(|((name, _, _), s)| format!("{name} {}", range_text(s)))
            .collect();
        let (cx, cy) = centre(n);
        svg.leaf_titled(
            "rect",
            Attrs::new()
                .n("x", cx - cell / 2.0)
                .n("y", cy - cell / 2.0)
                .n("width", cell)
                .n("height", cell)
                .s("class", "node-cell")
                .s("fill", fill),
            &if members.is_empty() {
                format!("node {n}: not used")
            } else {
                format!("node {n}: {}", what.join(", "))
            },
        );
    }
    svg.close("g");
    if by_stage {
        for s in 0..pp {
            let (_, cy) = centre(s * cols * rows_per_stage);
            svg.text(
                Attrs::new()
                    .n("x", left - 6.0)
                    .n("y", cy + 4.0)
                    .s("class", "gpu-coord")
                    .s("text-anchor", "end"),
                &format!("stage {s}"),
            );
        }
    }
    for (name, _, idx) in &axes {
        let spans = mapping.axis_group(name).is_ok_and(|g| !g.intra_node());
        if !spans {
            continue;
        }
        let Some(example) = groups_of(mapping, *idx).into_iter().next() else {
            continue;
        };
        let mut points: Vec<(f64, f64)> = Vec::new();
        for &l in &example {
            let p = centre(mapping.node(l));
            if points.last() != Some(&p) {
                points.push(p);
            }
        }
        if points.len() >= 2 {
            svg.leaf_titled(
                "path",
                Attrs::new()
                    .s("d", polyline_d(&points))
                    .s("class", "group-path")
                    .s("stroke", axis_colour(name)),
                &format!("the nodes of the {name} group of GPU 0"),
            );
        }
    }
    let rows = nodes.div_ceil(cols);
    let mut bottom = grid_top + rows as f64 * (cell + gap) + 8.0;
    // The colour scale of the stages.
    if pp > 1 {
        let w = ((width - 120.0) / pp as f64).min(40.0);
        svg.text(
            Attrs::new()
                .n("x", 10.0)
                .n("y", bottom + 12.0)
                .s("class", "gpu-coord"),
            "pipeline stage",
        );
        for s in 0..pp {
            let x = 100.0 + s as f64 * w;
            svg.rect(
                x,
                bottom,
                w,
                16.0,
                Attrs::new()
                    .s("fill", stage_fill(s, pp))
                    .s("class", "stage-key"),
            );
            if w >= 16.0 {
                svg.text(
                    Attrs::new()
                        .n("x", x + w / 2.0)
                        .n("y", bottom + 12.0)
                        .s("class", "gpu-coord")
                        .s("text-anchor", "middle"),
                    &s.to_string(),
                );
            }
        }
        bottom += 24.0;
    }
    let per_node: Vec<String> = axes
        .iter()
        .zip(&distinct)
        .map(|((name, size, _), &(lo, hi))| {
            let count = if lo == hi {
                format!("{lo}")
            } else {
                format!("{lo} to {hi}")
            };
            if lo == *size && hi == *size {
                format!("all {size} {name} coordinates")
            } else {
                format!("{count} of the {size} {name} coordinates")
            }
        })
        .collect();
    let used_nodes = (0..nodes)
        .filter(|n| (0..gpn).any(|l| linear_of.get(n * gpn + l).copied().flatten().is_some()))
        .count();
    let sentence = format!(
        "{nodes} nodes of {gpn} GPUs: node 0 is drawn in full, the other {} repeat its pattern \
         shifted along the mesh ({used_nodes} nodes used). Every used node holds {}; the squares \
         show each node's pipeline stage, and the paths the nodes of the first group of each axis \
         that spans nodes.",
        nodes - 1,
        if per_node.is_empty() {
            "one device".to_string()
        } else {
            per_node.join(", ")
        }
    );
    (bottom, sentence)
}

/// `3`, `0-7` or `{0, 2, 5}` for a set of coordinates.
fn range_text(s: &BTreeSet<usize>) -> String {
    let (Some(&lo), Some(&hi)) = (s.first(), s.last()) else {
        return "-".into();
    };
    if lo == hi {
        lo.to_string()
    } else if hi - lo + 1 == s.len() {
        format!("{lo}-{hi}")
    } else {
        let v: Vec<String> = s.iter().map(|x| x.to_string()).collect();
        format!("{{{}}}", v.join(", "))
    }
}
