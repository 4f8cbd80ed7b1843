//! The search space: which mesh shapes, axis orders, micro-batch sizes, pipeline layouts,
//! ZeRO stages, recompute policies and sequence-parallel settings a plan may take for a model
//! on a cluster, and the user's constraints (pinned values) that narrow it.
//!
//! Everything here defines the space; nothing here prunes it by cost. The rules are validity
//! rules (a divisibility the model or the frameworks need) or exact equivalences (two
//! settings the cost model cannot tell apart, of which one is kept), each stated where it is
//! applied, so that an exhaustive enumeration and the pruned search see the same plans.

use serde::{Deserialize, Serialize};

use autopar_cost_model::estimate::stage_layers;
use autopar_cost_model::parse_stage_layers;
use autopar_cost_model::{
    LayerOp, LayerPlacement, Offers, Offload, OpPlacement, Plan, Recompute, TransformerConfig,
};
use autopar_ir::axis;
use autopar_ir::schedule::ScheduleKind;

use crate::search::error::SearchError;

/// Values the user pins; `None` leaves a dimension to the search. The same machinery serves
/// semi-automatic use (some values pinned) and fully automatic use (none pinned).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraints {
    /// Data-parallel degree (including the expert-parallel ranks).
    pub dp: Option<usize>,
    /// Tensor-parallel degree.
    pub tp: Option<usize>,
    /// Pipeline ranks.
    pub pp: Option<usize>,
    /// Model chunks per pipeline rank.
    pub vpp: Option<usize>,
    /// Context-parallel degree.
    pub cp: Option<usize>,
    /// Expert-parallel degree.
    pub ep: Option<usize>,
    /// Micro-batch size.
    pub mbs: Option<usize>,
    /// ZeRO stage.
    pub zero: Option<u8>,
    /// Activation recomputation.
    pub recompute: Option<Recompute>,
    /// Sequence parallelism.
    pub sp: Option<bool>,
    /// CPU offload (`offload=none` keeps the search from offloading).
    #[serde(default)]
    pub offload: Option<Offload>,
    /// Expert tensor parallelism ([`Plan::expert_tp`]).
    #[serde(default)]
    pub etp: Option<usize>,
    /// Full recompute of the first `N` layers of each virtual stage
    /// ([`Plan::recompute_layers`]; pinning it pins `recompute=full`).
    #[serde(default)]
    pub recompute_layers: Option<usize>,
    /// The attention ops' placement over `tp` as a code of [`Plan::layer`] (`ttt`, `sts`, ...).
    #[serde(default)]
    pub attention: Option<String>,
    /// The MLP ops' placement over `tp` as a code of [`Plan::layer`] (`tt`, `ss`, ...).
    #[serde(default)]
    pub mlp: Option<String>,
    /// Ops that must stay split over `tp`: an annotation shards one of their weights over it
    /// (`plan --annotate`), which running the op on sequence shards would replicate.
    #[serde(default)]
    pub tensor_ops: Vec<LayerOp>,
    /// Pipeline schedule.
    pub schedule: Option<ScheduleKind>,
    /// Mesh axes outermost first (all five, as [`Plan::axis_order`]).
    pub axis_order: Option<Vec<String>>,
    /// Layers of each virtual stage, in order (pins the stage boundaries; the length pins
    /// `pp * vpp`).
    pub stage_layers: Option<Vec<usize>>,
    /// Only plans the CPU runtime executes (`autopar run --auto`): no context or expert
    /// parallelism.
    /// Applied while the space is enumerated, so the best executable plan is found rather
    /// than the best plan filtered afterwards.
    #[serde(default)]
    pub cpu_executable: bool,
    /// Mesh axes (`dp tp pp cp ep`) that must be longer than 1: an annotation shards a
    /// tensor over them (`plan --annotate`), which a plan without the axis cannot honour.
    #[serde(default)]
    pub sharded_axes: Vec<String>,
}

impl Constraints {
    /// Parses `key=value` pairs separated by commas, with the keys of [`Plan::parse`] (`dp tp
    /// pp vpp cp ep etp mbs zero offload recompute recompute_layers sp schedule order attn
    /// mlp`) and `stages` (layers per virtual
    /// stage joined by `-`, e.g. `stages=12-12-12-12`) and `runtime=cpu` (only plans the CPU
    /// runtime executes, see [`cpu_unsupported`]).
    ///
    /// ```
    /// # use autopar_passes::search::Constraints;
    /// let c = Constraints::parse("tp=8,recompute=full,stages=48-48").unwrap();
    /// assert_eq!(c.tp, Some(8));
    /// assert_eq!(c.stage_layers, Some(vec![48, 48]));
    /// assert!(Constraints::parse("tp=0").is_err());
    /// ```
    pub fn parse(s: &str) -> Result<Constraints, SearchError> {
        let mut c = Constraints::default();
        let items =
            autopar_cost_model::plan::key_values(s).map_err(|e| SearchError::Constraint {
                key: s.to_string(),
                message: e.to_string(),
            })?;
        let mut seen: Vec<&str> = Vec::new();
        for (k, v) in items {
            let part = format!("{k}={v}");
            let part = part.as_str();
            let err = |message: String| SearchError::Constraint {
                key: k.to_string(),
                message,
            };
            let canonical = if k == "micro_batch" { "mbs" } else { k };
            if seen.contains(&canonical) {
                return Err(err("pinned twice".into()));
            }
            seen.push(canonical);
            // The plan parser knows every plan key and its values; reuse it on one pair.
            let one = || Plan::parse(part).map_err(|e| err(e.to_string()));
            match k {
                axis::DP => c.dp = Some(one()?.dp),
                axis::TP => c.tp = Some(one()?.tp),
                axis::PP => c.pp = Some(one()?.pp),
                "vpp" => c.vpp = Some(one()?.vpp),
                axis::CP => c.cp = Some(one()?.cp),
                axis::EP => {
                    // `Plan::parse` alone would reject ep > dp = 1; read the number directly.
                    c.ep =
                        Some(v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                            err(format!("expected a positive integer, not `{v}`"))
                        })?)
                }
                "mbs" | "micro_batch" => c.mbs = Some(one()?.micro_batch_size),
                "zero" => c.zero = Some(one()?.zero_stage),
                "recompute" => c.recompute = Some(one()?.recompute),
                "sp" => c.sp = Some(one()?.sequence_parallel),
                "offload" => c.offload = Some(Offload::parse(v).map_err(err)?),
                "etp" => {
                    c.etp =
                        Some(v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                            err(format!("expected a positive integer, not `{v}`"))
                        })?)
                }
                "recompute_layers" => {
                    c.recompute_layers =
                        Some(v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                            err(format!("expected a positive integer, not `{v}`"))
                        })?)
                }
                "attn" => {
                    let mut l = LayerPlacement::MEGATRON;
                    l.set_attention(v).map_err(err)?;
                    c.attention = Some(l.attention_code());
                }
                "mlp" => {
                    let mut l = LayerPlacement::MEGATRON;
                    l.set_mlp(v).map_err(err)?;
                    c.mlp = Some(l.mlp_code());
                }
                "schedule" => {
                    c.schedule = Some(v.parse().map_err(|e| err(format!("{e}")))?);
                }
                "order" => c.axis_order = Some(one()?.axis_order),
                "runtime" => match v {
                    "cpu" => c.cpu_executable = true,
                    "any" => c.cpu_executable = false,
                    _ => return Err(err(format!("expected cpu or any, not `{v}`"))),
                },
                "stages" => c.stage_layers = Some(parse_stage_layers(v).map_err(err)?),
                _ => {
                    return Err(err(
                        "unknown key (expected dp, tp, pp, vpp, cp, ep, etp, mbs, zero, \
                         offload, recompute, recompute_layers, sp, attn, mlp, schedule, order, \
                         stages or runtime)"
                            .into(),
                    ));
                }
            }
        }
        // Some layers recomputed is full recompute of fewer of them.
        if let Some(n) = c.recompute_layers {
            match c.recompute {
                None => c.recompute = Some(Recompute::Full),
                Some(Recompute::Full) => {}
                Some(other) => {
                    return Err(SearchError::Constraint {
                        key: "recompute_layers".into(),
                        message: format!(
                            "recompute_layers={n} pins full recompute of some layers, which \
                             contradicts recompute={}",
                            other.name()
                        ),
                    });
                }
            }
        }
        Ok(c)
    }

    /// Whether `plan` satisfies every pinned value (`cfg` gives the layer count for pinned
    /// stage boundaries).
    pub fn admits(&self, cfg: &TransformerConfig, plan: &Plan) -> bool {
        fn ok<T: PartialEq>(pin: &Option<T>, v: T) -> bool {
            pin.as_ref().is_none_or(|p| *p == v)
        }
        ok(&self.dp, plan.dp)
            && ok(&self.tp, plan.tp)
            && ok(&self.pp, plan.pp)
            && ok(&self.vpp, plan.vpp)
            && ok(&self.cp, plan.cp)
            && ok(&self.ep, plan.ep)
            && ok(&self.mbs, plan.micro_batch_size)
            && ok(&self.zero, plan.zero_stage)
            && ok(&self.recompute, plan.recompute)
            && ok(&self.sp, plan.sequence_parallel)
            && ok(&self.offload, plan.offload)
            && ok(&self.etp, plan.expert_tp())
            && self
                .recompute_layers
                .is_none_or(|n| plan.recompute_layers == Some(n))
            && self.admits_layer(&plan.layer)
            && ok(&self.schedule, plan.schedule)
            && self
                .axis_order
                .as_ref()
                .is_none_or(|o| *o == plan.axis_order)
            && self
                .stage_layers
                .as_ref()
                .is_none_or(|s| *s == stage_layers(cfg, plan))
            && (!self.cpu_executable || cpu_unsupported(cfg, plan).is_empty())
            && [
                (axis::DP, plan.dp),
                (axis::TP, plan.tp),
                (axis::PP, plan.pp),
                (axis::CP, plan.cp),
                (axis::EP, plan.ep),
            ]
            .iter()
            .all(|&(axis, n)| self.allows_degree(axis, n))
    }

    /// Whether the layer placement `l` satisfies the pinned codes and keeps the annotated ops
    /// split over `tp`.
    pub fn admits_layer(&self, l: &LayerPlacement) -> bool {
        self.attention
            .as_ref()
            .is_none_or(|a| *a == l.attention_code())
            && self.mlp.as_ref().is_none_or(|m| *m == l.mlp_code())
            && self
                .tensor_ops
                .iter()
                .all(|&op| l.get(op) == OpPlacement::Tensor)
    }

    /// False when `axis` must be sharded over (see [`Constraints::sharded_axes`]) and
    /// `degree` is 1.
    pub fn allows_degree(&self, axis: &str, degree: usize) -> bool {
        degree > 1 || !self.sharded_axes.iter().any(|a| a == axis)
    }
}

/// What in `plan` for `cfg` the CPU runtime cannot execute, one phrase each (empty: it
/// executes it). The runtime runs data, tensor, expert and context parallelism with ZeRO 0-3,
/// alone or inside a pipeline (any schedule, micro-batches and virtual stages), and every
/// layer placement (an attention core on sequence shards on a step laid out in the
/// load-balanced sequence order over `tp`). ZeRO shards a dense weight's state over every
/// data-parallel rank (the mesh's `dp` and `ep` axes) and an expert's over `dp`. What it
/// refuses is context parallelism in a mixture of experts: routing with capacity depends on
/// the order of the tokens, which the context-parallel layout changes.
///
/// ```
/// # use autopar_cost_model::{Plan, TransformerConfig};
/// # use autopar_passes::search::cpu_unsupported;
/// let dense = TransformerConfig::gpt("small", 4, 256, 8, 1024, 1000);
/// assert!(cpu_unsupported(&dense, &Plan::parse("dp=2,tp=2,cp=2,pp=2,sp=true").unwrap()).is_empty());
/// let moe = TransformerConfig { experts: 8, top_k: 2, ..dense };
/// assert!(cpu_unsupported(&moe, &Plan::parse("dp=4,ep=2,zero=3").unwrap()).is_empty());
/// assert_eq!(
///     cpu_unsupported(&moe, &Plan::parse("dp=2,ep=2,cp=2").unwrap()),
///     ["context parallelism (cp=2) in a mixture of experts (8 experts)"]
/// );
/// ```
pub fn cpu_unsupported(cfg: &TransformerConfig, plan: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    if plan.cp > 1 && cfg.experts > 1 {
        out.push(format!(
            "context parallelism (cp={}) in a mixture of experts ({} experts)",
            plan.cp, cfg.experts
        ));
    }
    if plan.expert_tp() < plan.tp {
        out.push(format!(
            "expert tensor parallelism below tp (etp={}, tp={})",
            plan.expert_tp(),
            plan.tp
        ));
    }
    if plan.offload != Offload::None {
        out.push(format!("CPU offload (offload={})", plan.offload.name()));
    }
    if let Some(n) = plan.recompute_layers {
        out.push(format!(
            "full recompute of only some layers (recompute_layers={n})"
        ));
    }
    out
}

/// A mesh shape: `dp * tp * pp * cp` devices, `ep` dividing `dp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Shape {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    pub ep: usize,
}

/// Divisors of `n`, ascending.
pub(crate) fn divisors(n: usize) -> Vec<usize> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The mesh shapes that use all `devices` and divide the model and the batch:
///
/// - `tp` divides the heads, the key/value heads (Megatron-LM requires whole query groups
///   per rank) and the MLP width;
/// - `cp > 1` only for sequences of at least `cp_min_seq` tokens (unless pinned), with the
///   sequence divisible by `2 cp` (the causal load-balancing split of Megatron-LM);
/// - `pp` at most the number of layers;
/// - `dp` divides the global batch (whole micro-batches on every rank);
/// - `ep` divides `dp` and the experts (1 for dense models); a pinned `ep` may also be a
///   multiple of it that folds over tensor-parallel ranks ([`expert_layouts`]).
pub(crate) fn mesh_shapes(
    cfg: &TransformerConfig,
    devices: usize,
    global_batch: usize,
    cp_min_seq: usize,
    c: &Constraints,
    offers: &Offers,
) -> Vec<Shape> {
    let mut out = Vec::new();
    for tp in divisors(devices) {
        let tp_ok = cfg.tp_split_error(tp).is_none()
            && (tp == 1 || offers.tensor_parallel || c.tp.is_some());
        if !tp_ok || c.tp.is_some_and(|p| p != tp) || !c.allows_degree(axis::TP, tp) {
            continue;
        }
        for cp in divisors(devices / tp) {
            let useful =
                cp == 1 || c.cp.is_some() || (offers.context_parallel && cfg.seq >= cp_min_seq);
            if !useful
                // MoE routing depends on the token order that the cp layout changes.
                || (c.cpu_executable && cp > 1 && cfg.experts > 1)
                || !c.allows_degree(axis::CP, cp)
                || (cp > 1 && !cfg.seq.is_multiple_of(2 * cp))
                || c.cp.is_some_and(|p| p != cp)
            {
                continue;
            }
            for pp in divisors(devices / (tp * cp)) {
                if pp > cfg.layers
                    || (pp > 1 && !offers.pipeline && c.pp.is_none())
                    || c.pp.is_some_and(|p| p != pp)
                    || !c.allows_degree(axis::PP, pp)
                {
                    continue;
                }
                let dp = devices / (tp * cp * pp);
                if !global_batch.is_multiple_of(dp)
                    || c.dp.is_some_and(|p| p != dp)
                    || !c.allows_degree(axis::DP, dp)
                {
                    continue;
                }
                for ep in divisors(dp) {
                    let ep_ok = if cfg.experts > 1 {
                        cfg.experts.is_multiple_of(ep)
                            && (ep == 1 || offers.expert_parallel || c.ep.is_some())
                    } else {
                        ep == 1
                    };
                    if ep_ok
                        && c.allows_degree(axis::EP, ep)
                        && c.ep.is_none_or(|p| ep_pin_allows(cfg, p, ep, tp))
                    {
                        out.push(Shape { dp, tp, pp, cp, ep });
                    }
                }
            }
        }
    }
    out
}

/// The orders in which a shape's mesh axes may be laid onto the devices, outermost first
/// (the last axis on consecutive devices, i.e. inside a node first).
///
/// Axes of size 1 do not change the placement, so only the axes larger than 1 are permuted:
/// the pipeline axis, the data-parallel block (`dp` outside `ep`, kept together: together
/// they form the gradient-reduction group), `cp` and `tp`. Every permutation is listed,
/// Megatron-LM's order (`pp dp ep cp tp`, tensor parallelism innermost) first; among them are
/// those that put `dp` or `pp` inside the node. A pinned order is the only one.
pub(crate) fn axis_orders(s: &Shape, pinned: Option<&Vec<String>>) -> Vec<Vec<String>> {
    if let Some(order) = pinned {
        return vec![order.clone()];
    }
    let mut units: Vec<Vec<&'static str>> = Vec::new();
    if s.pp > 1 {
        units.push(vec![axis::PP]);
    }
    let dp_block: Vec<&'static str> = [(axis::DP, s.dp / s.ep), (axis::EP, s.ep)]
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .map(|(a, _)| a)
        .collect();
    if !dp_block.is_empty() {
        units.push(dp_block);
    }
    if s.cp > 1 {
        units.push(vec![axis::CP]);
    }
    if s.tp > 1 {
        units.push(vec![axis::TP]);
    }
    let used: Vec<&str> = units.iter().flatten().copied().collect();
    let trivial: Vec<String> = Plan::DEFAULT_ORDER
        .iter()
        .filter(|a| !used.contains(a))
        .map(|a| a.to_string())
        .collect();
    permutations(units.len())
        .into_iter()
        .map(|perm| {
            if perm.iter().enumerate().all(|(i, &p)| i == p) {
                Plan::DEFAULT_ORDER.iter().map(|a| a.to_string()).collect()
            } else {
                let mut order = trivial.clone();
                for &u in &perm {
                    order.extend(units[u].iter().map(|a| a.to_string()));
                }
                order
            }
        })
        .collect()
}

/// Keeps the first order of each class of orders that place every group alike, so that no
/// two plans differing only in such orders are both estimated.
///
/// Lay the axes larger than 1 out from the innermost, with consecutive devices forming nodes
/// of `g = gpus_per_node`. An axis is *inside* when it and the axes inside it fit in a node
/// (the product of their sizes is at most `g`), the *straddler* when it starts inside a node
/// but ends outside, and *outer* otherwise. When the product of the inside sizes divides `g`
/// and the product up to the straddler is a multiple of `g`:
///
/// - every group of an inside axis lies in one node, whatever its stride, so it is described
///   by its size alone; pipeline neighbours along an inside `pp` share a node;
/// - the straddler's stride is the product of the inside sizes, whatever their order, so its
///   groups sit the same way;
/// - every outer axis has a stride that is a multiple of `g`: one member per node, one NIC per
///   member, every device of a node in a different group, whatever the order among the outer
///   axes; pipeline neighbours along an outer `pp` never share a node.
///
/// Everything the estimate reads from a mapping (the groups of `tp`, `cp`, `ep`, `pp` and of
/// `dp` with `ep`, and which pipeline neighbours share a node) is then the same for two orders
/// with the same inside set, straddler and outer set. When the conditions fail no order is
/// merged.
pub(crate) fn distinct_placements(
    s: &Shape,
    orders: Vec<Vec<String>>,
    gpus_per_node: usize,
) -> Vec<Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    orders
        .into_iter()
        .filter(|o| match placement_class(s, o, gpus_per_node) {
            Some(class) => seen.insert(class),
            None => true,
        })
        .collect()
}

/// The class of an order under [`distinct_placements`]: the sorted inside axes, the
/// straddler, the sorted outer axes; `None` when the conditions fail.
pub(crate) fn placement_class(
    s: &Shape,
    order: &[String],
    gpus_per_node: usize,
) -> Option<(Vec<String>, Option<String>, Vec<String>)> {
    let size = |a: &str| match a {
        axis::PP => s.pp,
        axis::DP => s.dp / s.ep,
        axis::EP => s.ep,
        axis::CP => s.cp,
        axis::TP => s.tp,
        _ => 1,
    };
    let g = gpus_per_node.max(1);
    let (mut inside, mut straddler, mut outer) = (Vec::new(), None, Vec::new());
    let (mut inside_product, mut stride) = (1, 1);
    for a in order.iter().rev().filter(|a| size(a) > 1) {
        let n = size(a);
        if stride * n <= g {
            inside.push(a.clone());
            inside_product *= n;
        } else if stride < g {
            straddler = Some(a.clone());
        } else {
            outer.push(a.clone());
        }
        stride *= n;
    }
    let boundary = inside_product * straddler.as_deref().map_or(1, size);
    if !g.is_multiple_of(inside_product) || !boundary.is_multiple_of(g) {
        return None;
    }
    inside.sort();
    outer.sort();
    Some((inside, straddler, outer))
}

/// All permutations of `0..n` in lexicographic order (identity first).
fn permutations(n: usize) -> Vec<Vec<usize>> {
    let mut p: Vec<usize> = (0..n).collect();
    let mut out = vec![p.clone()];
    loop {
        // Next lexicographic permutation.
        let Some(i) = (1..p.len()).rev().find(|&i| p[i - 1] < p[i]) else {
            return out;
        };
        let Some(j) = (i..p.len()).rev().find(|&j| p[j] > p[i - 1]) else {
            return out;
        };
        p.swap(i - 1, j);
        p[i..].reverse();
        out.push(p.clone());
    }
}

/// Micro-batch sizes: the divisors of the per-replica batch `global_batch / dp` (whole
/// micro-batches; Megatron-LM requires it).
pub(crate) fn micro_batch_sizes(s: &Shape, global_batch: usize, c: &Constraints) -> Vec<usize> {
    divisors(global_batch / s.dp)
        .into_iter()
        .filter(|&b| c.mbs.is_none_or(|p| p == b))
        .collect()
}

/// `(vpp, schedule)` pairs for `pp` ranks and `m` micro-batches:
///
/// - `pp = 1`: 1F1B only. With one stage GPipe runs the same work in the same order of
///   completion but holds every micro-batch's activations, so the cost model gives it the
///   same time and no less memory: an exact equivalence, of which 1F1B is kept.
/// - `pp > 1`: 1F1B and GPipe with one chunk per rank (layers may divide unevenly: earlier
///   stages take one more), and the interleaved schedule with every `vpp > 1` that leaves
///   each of the `pp * vpp` virtual stages at least one layer, when `pp` divides `m` (as
///   Megatron-LM requires). The layers need not divide evenly: the virtual stages then take
///   the cost model's balanced division ([`stage_layers`]), exactly as the estimate prices
///   them and as Megatron-LM's `--pipeline-model-parallel-layout` runs them.
///
/// [`stage_layers`]: autopar_cost_model::estimate::stage_layers
pub(crate) fn pipelines(
    cfg: &TransformerConfig,
    pp: usize,
    m: usize,
    c: &Constraints,
    offers: &Offers,
) -> Vec<(usize, ScheduleKind)> {
    let mut out = vec![(1, ScheduleKind::OneFOneB)];
    let interleaved = offers.interleaved
        || c.vpp.is_some_and(|v| v > 1)
        || c.schedule == Some(ScheduleKind::Interleaved);
    if pp > 1 {
        out.push((1, ScheduleKind::GPipe));
        if interleaved && m.is_multiple_of(pp) {
            for vpp in 2..=cfg.layers / pp {
                out.push((vpp, ScheduleKind::Interleaved));
            }
        }
    } else if c.schedule == Some(ScheduleKind::GPipe) {
        // Pinned: honour it even though it is equivalent to 1F1B.
        out = vec![(1, ScheduleKind::GPipe)];
    }
    out.retain(|&(vpp, kind)| {
        c.vpp.is_none_or(|p| p == vpp)
            && c.schedule.is_none_or(|p| p == kind)
            && c.stage_layers.as_ref().is_none_or(|s| s.len() == pp * vpp)
    });
    out
}

/// ZeRO stages: those the software profile's stack implements
/// ([`autopar_cost_model::Software::offers`]), unless one is pinned. With `dp = 1`
/// every stage divides by one and every data-parallel collective runs on a group of one
/// (free), so the stages are exactly equivalent and 0 is kept.
/// The CPU runtime shards ZeRO over the data ranks outside `ep` only (none when `dp = ep`).
pub(crate) fn zero_stages(s: &Shape, c: &Constraints, offers: &Offers) -> Vec<u8> {
    match c.zero {
        Some(z) => vec![z],
        None if s.dp == 1 => vec![0],
        None => offers.zero.to_vec(),
    }
}

/// CPU offload for a plan at ZeRO stage `zero`: none, and the least offload that lets the
/// plan's weights, gradients and optimizer state fit on the GPU when they do not without it
/// (`fits` says whether they do under an offload): the optimizer state (from ZeRO-2) when
/// nothing offloaded does not fit, the parameters too (at ZeRO-3) when that does not fit
/// either. Offloading never makes a step faster in the cost model (it adds PCIe copies and a
/// slower optimizer step and removes nothing), so it earns a place in the space only where
/// the GPU cannot hold the plan otherwise. A pin overrides the rule.
pub(crate) fn offloads(zero: u8, fits: impl Fn(Offload) -> bool, c: &Constraints) -> Vec<Offload> {
    let allowed = |o: Offload| match o {
        Offload::None => true,
        Offload::Optimizer => zero >= 2,
        Offload::Params => zero >= 3,
    };
    if let Some(o) = c.offload {
        return [o].into_iter().filter(|&o| allowed(o)).collect();
    }
    let mut out = vec![Offload::None];
    for (less, more) in [
        (Offload::None, Offload::Optimizer),
        (Offload::Optimizer, Offload::Params),
    ] {
        if !allowed(more) || fits(less) {
            break;
        }
        out.push(more);
    }
    out
}

/// The expert layouts of a mesh shape, as `(etp, ep)` pairs: for MoE models with `tp > 1`,
/// expert tensor parallelism over every divisor of `tp` that divides the experts' width,
/// `tp` itself (Megatron-Core's default, `None`) first with the shape's `ep`. Below `tp`
/// the experts fold over the tensor-parallel ranks as Megatron-Core's MoE parallel folding
/// lays them out ([`Plan::ep_over_tp`]): the `tp / etp` ranks holding the same expert shards
/// join expert parallelism before the shape's `ep` data-parallel ones, so `ep` is their
/// product and may exceed `dp` (tp=2, etp=1, ep=32 on dp=16, as Megatron-Bridge runs
/// Qwen3-235B-A22B); where the shape has no expert parallelism, the experts may also stay
/// whole on every one of those ranks (`ep = 1`). Dense models get `(None, 1)` only. Below
/// `tp` the layout needs sequence parallelism, which the caller checks.
pub(crate) fn expert_layouts(
    cfg: &TransformerConfig,
    s: &Shape,
    c: &Constraints,
) -> Vec<(Option<usize>, usize)> {
    let mut out = vec![(None, s.ep)];
    if cfg.experts > 1 && s.tp > 1 {
        for e in divisors(s.tp) {
            if e == s.tp || !cfg.ffn.is_multiple_of(e) {
                continue;
            }
            let folded = s.ep * (s.tp / e);
            if cfg.experts.is_multiple_of(folded) {
                out.push((Some(e), folded));
            }
            if s.ep == 1 {
                out.push((Some(e), 1));
            }
        }
    }
    out.retain(|&(e, ep)| {
        c.etp.is_none_or(|p| p == e.unwrap_or(s.tp)) && c.ep.is_none_or(|p| p == ep)
    });
    out
}

/// Whether a shape whose mesh has `ep` expert-parallel data ranks may hold a plan of the
/// pinned `pin`: the same, or `ep` times some of the `tp` ranks the experts fold over
/// ([`expert_layouts`]).
fn ep_pin_allows(cfg: &TransformerConfig, pin: usize, ep: usize, tp: usize) -> bool {
    pin == ep
        || (cfg.experts > 1
            && cfg.experts.is_multiple_of(pin)
            && tp > 1
            && pin.is_multiple_of(ep)
            && pin > ep
            && tp.is_multiple_of(pin / ep))
}

/// Sequence parallelism: only with `tp > 1` (the cost model ignores it otherwise), only
/// when `cp * tp` divides the sequence, and only where the stack has it (or it is pinned).
pub(crate) fn sequence_parallel(
    cfg: &TransformerConfig,
    s: &Shape,
    c: &Constraints,
    offers: &Offers,
) -> Vec<bool> {
    let mut out = vec![false];
    let offered = offers.sequence_parallel || c.sp == Some(true);
    if offered && s.tp > 1 && cfg.seq.is_multiple_of(s.cp * s.tp) {
        out.push(true);
    }
    out.retain(|&sp| c.sp.is_none_or(|p| p == sp));
    out
}

/// The layer placements ([`Plan::layer`]) to weigh for a mesh shape: Megatron-LM's alone
/// without `tp`, or under a stack that has no other ([`Offers::layer_placements`]) unless
/// one is pinned; otherwise every placement the model admits
/// ([`LayerPlacement::unsupported`], the rule the cost model checks plans with) and the pins
/// allow, Megatron-LM's first.
pub(crate) fn layer_placements(
    cfg: &TransformerConfig,
    s: &Shape,
    c: &Constraints,
    offers: &Offers,
) -> Vec<LayerPlacement> {
    let mut out = vec![LayerPlacement::MEGATRON];
    let pinned = c.attention.is_some() || c.mlp.is_some();
    if s.tp > 1 && (offers.layer_placements || pinned) {
        out = LayerPlacement::all();
        out.retain(|l| l.unsupported(cfg, s.tp, s.cp).is_none());
    }
    out.retain(|l| c.admits_layer(l));
    out
}

/// Recompute policies, from least to most recomputation (the search relies on this order).
/// Megatron's selective recompute re-runs the attention core; with a FlashAttention-style
/// kernel the scores are never stored and the backward recomputes them anyway, so the cost
/// model gives selective exactly the time and memory of none. Selective is listed where it
/// does something (`selective_works`: unfused attention, or torchtitan's per-op policy) or
/// when pinned, and only where the stack has it.
pub(crate) fn recomputes(
    selective_works: bool,
    c: &Constraints,
    offers: &Offers,
) -> Vec<Recompute> {
    if let Some(r) = c.recompute {
        return vec![r];
    }
    if selective_works && offers.selective_recompute {
        vec![Recompute::None, Recompute::Selective, Recompute::Full]
    } else {
        vec![Recompute::None, Recompute::Full]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_and_permutations() {
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(1), [1]);
        assert_eq!(divisors(16), [1, 2, 4, 8, 16]);
        let p = permutations(3);
        assert_eq!(p.len(), 6);
        assert_eq!(p[0], [0, 1, 2]);
        assert_eq!(p[5], [2, 1, 0]);
        assert_eq!(permutations(0), [Vec::<usize>::new()]);
    }

    #[test]
    fn orders_start_with_megatron_and_move_dp_and_pp_inward() {
        let s = Shape {
            dp: 8,
            tp: 8,
            pp: 16,
            cp: 1,
            ep: 1,
        };
        let orders = axis_orders(&s, None);
        assert_eq!(orders.len(), 6);
        assert_eq!(orders[0], Plan::DEFAULT_ORDER);
        let inner = |o: &Vec<String>| o.last().cloned().unwrap_or_default();
        assert!(orders.iter().any(|o| inner(o) == "dp"));
        assert!(orders.iter().any(|o| inner(o) == "pp"));
        // Each order names all five axes once.
        for o in &orders {
            let mut sorted = o.clone();
            sorted.sort();
            assert_eq!(sorted, ["cp", "dp", "ep", "pp", "tp"]);
        }
        // A single non-trivial axis has one placement.
        let s = Shape {
            dp: 8,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
        };
        assert_eq!(axis_orders(&s, None).len(), 1);
    }

    /// Orders merged by [`distinct_placements`] give the same groups, pipeline neighbours and
    /// estimates.
    #[test]
    fn merged_orders_place_every_group_alike() {
        use autopar_cost_model::{Cluster, CostModel, MeshMapping};
        let m = CostModel::new(Cluster::preset("dgx-a100:nodes=16").unwrap());
        let cfg = TransformerConfig::gpt("t", 16, 2048, 16, 2048, 32000);
        let shapes = [
            (8, 2, 4, 2, 1),
            (2, 8, 4, 1, 2),
            (16, 4, 2, 1, 1),
            (4, 2, 16, 1, 1),
        ];
        let mut merged = 0;
        for (dp, tp, pp, cp, ep) in shapes {
            let s = Shape { dp, tp, pp, cp, ep };
            let orders = axis_orders(&s, None);
            let kept = distinct_placements(&s, orders.clone(), 8);
            merged += orders.len() - kept.len();
            let facts = |o: &Vec<String>| {
                let plan = Plan {
                    dp,
                    tp,
                    pp,
                    cp,
                    ep,
                    global_batch: 8 * dp,
                    axis_order: o.clone(),
                    ..Plan::default()
                };
                let mapping = MeshMapping::new(&plan.mesh_axes(), &m.cluster).unwrap();
                let groups: Vec<_> = ["tp", "cp", "ep", "pp", "dp"]
                    .iter()
                    .map(|a| mapping.axis_group(a).unwrap().clone())
                    .chain([mapping.group(&["dp".into(), "ep".into()]).unwrap()])
                    .collect();
                let at = |r: usize| {
                    let mut c = vec![0; mapping.axes().len()];
                    c[mapping.mesh().axis_index("pp").unwrap()] = r % pp;
                    mapping.mesh().linear(&c)
                };
                let neighbours: Vec<bool> = (0..pp)
                    .map(|r| mapping.same_node(at(r), at(r + 1)))
                    .collect();
                let mut cfg = cfg.clone();
                cfg.experts = ep.max(1) * 2;
                let e = m.estimate(&cfg, &plan).unwrap();
                (groups, neighbours, e.iter_time_s, e.peak_memory_gib)
            };
            for o in &orders {
                let class = placement_class(&s, o, 8);
                let Some(k) = kept
                    .iter()
                    .find(|k| class.is_some() && placement_class(&s, k, 8) == class)
                else {
                    continue;
                };
                assert_eq!(facts(o), facts(k), "{o:?} vs {k:?}");
            }
        }
        assert!(merged > 0);
    }

    #[test]
    fn constraints_parse_and_admit() {
        let c =
            Constraints::parse("tp=8, pp=16, vpp=2, recompute=full, schedule=interleaved").unwrap();
        let cfg = TransformerConfig::gpt3_175b();
        let plan = Plan::parse("dp=8,tp=8,pp=16,vpp=2,recompute=full,gbs=1536").unwrap();
        assert!(c.admits(&cfg, &plan));
        let other = Plan {
            tp: 4,
            ..plan.clone()
        };
        assert!(!c.admits(&cfg, &other));
        let stages = Constraints::parse(&format!("stages={}", vec!["3"; 32].join("-"))).unwrap();
        assert!(stages.admits(&cfg, &plan));
        assert!(!stages.admits(&cfg, &Plan { vpp: 1, ..plan }));
        for bad in ["tp", "tp=x", "zero=5", "stages=1-0-1", "colour=red", "ep=0"] {
            assert!(
                matches!(Constraints::parse(bad), Err(SearchError::Constraint { .. })),
                "{bad}"
            );
        }
        assert_eq!(Constraints::parse("ep=8").unwrap().ep, Some(8));
    }
}
