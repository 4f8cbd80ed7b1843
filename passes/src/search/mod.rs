//! Strategy search: a joint search over training plans of a transformer on a cluster (mesh
//! shape, axis placement, virtual stages, micro-batch size, ZeRO stage, recompute, sequence
//! parallelism, schedule), scored by the cost model and ranked by predicted step time.
//!
//! # What is searched
//!
//! [`space`](self) lists the plans: every mesh shape `(dp, tp, pp, cp, ep)` that uses all
//! devices and divides the model and the batch, every placement of its non-trivial axes on
//! the devices, and for each the micro-batch sizes, pipeline layouts, ZeRO stages, recompute
//! policies, sequence-parallel settings and layer placements (each of a layer's five ops split
//! over `tp` or run on sequence shards, [`autopar_cost_model::LayerPlacement`]) that are valid;
//! for mixtures of experts every expert tensor-parallel degree dividing `tp`
//! ([`Plan::etp`]), below `tp` with the experts folded over the tensor-parallel ranks so
//! that `ep` may exceed `dp` (`space::expert_layouts`); and CPU offload
//! ([`Plan::offload`]) for the base plans whose weights,
//! gradients and optimizer state alone do not fit on the GPU (offloading only adds time in
//! the cost model, so elsewhere it could not rank). Where the stack runs it
//! ([`autopar_cost_model::Offers::partial_recompute`]) and the policy is not pinned, a plan
//! that fits with every layer recomputed but not with none is also tried with full
//! recompute of only the first `N` layers of each virtual stage ([`Plan::recompute_layers`]),
//! `N` the fewest that fit: stored activations fall and step time rises with `N`, so a
//! bisection finds it and no other `N` could rank above it. [`Constraints`] pin any of them.
//!
//! # How it is pruned, exactly
//!
//! The search returns what an exhaustive enumeration of the same space with the same cost
//! model would return (`SearchOptions::prune = false` runs that enumeration; the tests compare
//! the two). It skips a plan only when it can prove the plan would not be ranked:
//!
//! - **Memory** ([`memory_lower_bound`]): a bound on the peak memory from the weights,
//!   gradients and optimizer state of each rank, which depend only on `(dp, tp, pp, vpp, ep,
//!   zero)`, plus the activations of the in-flight micro-batches once the schedule is known.
//!   Every term it leaves out is non-negative, so a bound above the capacity means the plan
//!   does not fit, and a plan that does not fit is never ranked.
//! - **Time, by recompute** (branch and bound): for plans equal in everything but the
//!   recompute policy, more recomputation never makes a step faster in the cost model. The
//!   backward of a layer gains a recompute term (`>= 0`) and nothing else changes; the pipeline
//!   simulation is a max-plus system, monotone in every duration; the bucketed gradient
//!   reduction starts at times interpolated between a backward's start and end, monotone too;
//!   and the step's remaining terms do not depend on recomputation. So the step time of the
//!   plan with less recomputation, fitting or not, is a lower bound for the others, and the
//!   search estimates policies from least to most recomputation and stops as soon as that
//!   bound exceeds the `top_k`-th best step time found so far (strictly: ties are kept).
//!
//! - **Time and memory, by layer placement** (branch and bound): for plans equal in
//!   everything but the layer placement, [`CostModel::layer_dominance`] orders the placements
//!   so that each comes after those that beat it in a per-layer profile (forward and backward
//!   times, stored activations under each recompute policy, parameters per rank, parameters
//!   replicated over `tp`) in which the estimate is monotone. A beaten placement's plan is no
//!   faster and no smaller than the plan of one that beats it under the same recompute
//!   policy, so it is skipped when that plan's step time exceeds the `top_k`-th best or that
//!   plan does not fit. The placements of one layer are profiled once per (micro-batch size,
//!   sp, axis order) and shared by every pipeline layout, ZeRO stage and recompute policy:
//!   the layers are identical, so one layer is solved for all of them.
//!
//! # Reuse and parallelism
//!
//! A pipeline schedule is built once per `(kind, pp, vpp, micro-batches)` and a mesh mapping
//! once per (shape, axis order); plans are scored with
//! [`CostModel::estimate_with_mapping`]. Mesh shapes are shared out to `threads` workers
//! through an atomic counter; each keeps its own top `k` and they share the `k`-th best step
//! time as the pruning threshold. Pruning is exact, so the answer does not depend on the
//! order in which workers finish; ties in step time are broken by peak memory, then by the
//! plan's text, so the ranking is deterministic.

mod bound;
mod error;
pub mod explain;
pub mod export;
mod space;

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use autopar_cost_model::cluster::Runtime;
use autopar_cost_model::estimate::stage_layers;
use autopar_cost_model::{
    CostModel, Estimate, LayerPlacement, MeshMapping, Offers, Offload, Plan, Recompute,
    TransformerConfig,
};
use autopar_ir::DType;
use autopar_ir::schedule::{Schedule, ScheduleKind};

pub use bound::{capacity_bytes, memory_lower_bound, step_time_lower_bound};
pub use error::SearchError;
pub use space::{Constraints, cpu_unsupported};

use space::Shape;

/// What to search for and how.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchOptions {
    /// Sequences per step over all data-parallel ranks.
    pub global_batch: usize,
    /// Compute dtype.
    pub dtype: DType,
    /// Transformer-Engine-style fp8 GEMMs in the layers ([`Plan::fp8`]).
    pub fp8: bool,
    /// How many plans to rank.
    pub top_k: usize,
    /// Pinned values.
    pub constraints: Constraints,
    /// Stop after this long and rank what was found (the result says it is incomplete).
    pub max_time: Option<Duration>,
    /// Worker threads; 0 uses the available parallelism.
    pub threads: usize,
    /// Apply the exact pruning bounds (false: estimate every plan of the space).
    pub prune: bool,
    /// Context parallelism is considered from this sequence length on (unless pinned): it
    /// splits attention over the sequence, which only pays off for long sequences.
    pub cp_min_seq: usize,
}

impl SearchOptions {
    /// Defaults for a global batch: bf16, top 10, no pins, no time limit, all cores, pruning
    /// on, context parallelism from 8192 tokens.
    pub fn new(global_batch: usize) -> Self {
        SearchOptions {
            global_batch,
            dtype: DType::BF16,
            fp8: false,
            top_k: 10,
            constraints: Constraints::default(),
            max_time: None,
            threads: 0,
            prune: true,
            cp_min_seq: 8192,
        }
    }
}

/// One ranked plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankedPlan {
    /// The plan.
    pub plan: Plan,
    /// Its estimate (always one that fits).
    pub estimate: Estimate,
}

/// Counts of what the search did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SearchStats {
    /// Mesh shapes in the space.
    pub mesh_shapes: usize,
    /// Mesh shapes fully explored.
    pub mesh_shapes_done: usize,
    /// Plans in the explored part of the space.
    pub candidates: u64,
    /// Plans skipped because the memory bound exceeds the capacity.
    pub pruned_by_memory: u64,
    /// Plans skipped because the time bound exceeds the `top_k`-th best step time.
    pub pruned_by_time: u64,
    /// Plans skipped because another layer placement of the same plan, which beats theirs
    /// ([`CostModel::layer_dominance`]), is already too slow or does not fit.
    #[serde(default)]
    pub pruned_by_dominance: u64,
    /// Plans estimated.
    pub estimated: u64,
    /// Estimated plans that fit.
    pub fitting: u64,
    /// Pipeline schedules built.
    pub schedules_built: u64,
    /// Wall-clock seconds.
    pub elapsed_s: f64,
    /// Worker threads used.
    pub threads: usize,
    /// False when the time limit stopped the search before the space was explored.
    pub complete: bool,
}

/// The answer: up to `top_k` fitting plans, best first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// Ranked plans.
    pub plans: Vec<RankedPlan>,
    /// What the search did.
    pub stats: SearchStats,
}

/// Progress reports, sent after each mesh shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// Mesh shapes explored.
    pub shapes_done: usize,
    /// Mesh shapes in the space.
    pub shapes_total: usize,
    /// Plans estimated so far.
    pub estimated: u64,
}

/// Searches the plans of `cfg` on `model`'s cluster.
pub fn search(
    model: &CostModel,
    cfg: &TransformerConfig,
    opts: &SearchOptions,
) -> Result<SearchResult, SearchError> {
    search_with_progress(model, cfg, opts, &|_| {})
}

/// As [`search`], calling `progress` (from worker threads) after each mesh shape.
pub fn search_with_progress(
    model: &CostModel,
    cfg: &TransformerConfig,
    opts: &SearchOptions,
    progress: &(dyn Fn(&Progress) + Sync),
) -> Result<SearchResult, SearchError> {
    let start = Instant::now();
    cfg.validate()?;
    let max_batch = autopar_cost_model::plan::MAX_GLOBAL_BATCH;
    if opts.global_batch == 0 || opts.global_batch > max_batch {
        return Err(SearchError::Option {
            option: "global_batch",
            message: format!("must be 1 to {max_batch}, not {}", opts.global_batch),
        });
    }
    if opts.top_k == 0 {
        return Err(SearchError::Option {
            option: "top_k",
            message: "must be at least 1".into(),
        });
    }
    let devices = model.cluster.num_devices();
    let offers = model.software.offers();
    let shapes = space::mesh_shapes(
        cfg,
        devices,
        opts.global_batch,
        opts.cp_min_seq,
        &opts.constraints,
        &offers,
    );
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    }
    .clamp(1, shapes.len().max(1));
    let shared = Shared {
        model,
        cfg,
        opts,
        offers,
        shapes: &shapes,
        next: AtomicUsize::new(0),
        threshold: AtomicU64::new(f64::INFINITY.to_bits()),
        stop: AtomicBool::new(false),
        deadline: opts.max_time.map(|d| start + d),
        shapes_done: AtomicUsize::new(0),
        estimated: AtomicU64::new(0),
        progress,
    };
    let outcomes: Vec<Result<Done, (usize, SearchError)>> = if threads == 1 {
        vec![run_worker(&shared)]
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| scope.spawn(|| run_worker(&shared)))
                .collect();
            handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(r) => r,
                    Err(payload) => std::panic::resume_unwind(payload),
                })
                .collect()
        })
    };
    let mut workers = Vec::new();
    let mut first_error: Option<(usize, SearchError)> = None;
    for o in outcomes {
        match o {
            Ok(w) => workers.push(w),
            // Report the error of the earliest shape, whichever worker met it.
            Err((i, e)) if first_error.as_ref().is_none_or(|(j, _)| i < *j) => {
                first_error = Some((i, e))
            }
            Err(_) => {}
        }
    }
    if let Some((_, e)) = first_error {
        return Err(e);
    }
    let mut stats = SearchStats {
        mesh_shapes: shapes.len(),
        mesh_shapes_done: shared.shapes_done.load(AtomicOrdering::Relaxed),
        threads,
        ..SearchStats::default()
    };
    let mut entries = Vec::new();
    for w in workers {
        let s = &w.stats;
        stats.candidates += s.candidates;
        stats.pruned_by_memory += s.pruned_by_memory;
        stats.pruned_by_time += s.pruned_by_time;
        stats.pruned_by_dominance += s.pruned_by_dominance;
        stats.estimated += s.estimated;
        stats.fitting += s.fitting;
        stats.schedules_built += s.schedules_built;
        entries.extend(w.top.entries.into_vec());
    }
    entries.sort_by(Entry::rank_order);
    entries.truncate(opts.top_k);
    stats.complete = !shared.stop.load(AtomicOrdering::Relaxed);
    stats.elapsed_s = start.elapsed().as_secs_f64();
    Ok(SearchResult {
        plans: entries
            .into_iter()
            .map(|e| RankedPlan {
                plan: e.plan,
                estimate: e.estimate,
            })
            .collect(),
        stats,
    })
}

/// What the workers share.
struct Shared<'a> {
    model: &'a CostModel,
    cfg: &'a TransformerConfig,
    opts: &'a SearchOptions,
    /// What the software profile's stack runs: the space offers only that.
    offers: Offers,
    shapes: &'a [Shape],
    next: AtomicUsize,
    /// Bits of the smallest `top_k`-th best step time of any worker (non-negative floats
    /// order like their bits).
    threshold: AtomicU64,
    stop: AtomicBool,
    deadline: Option<Instant>,
    shapes_done: AtomicUsize,
    estimated: AtomicU64,
    progress: &'a (dyn Fn(&Progress) + Sync),
}

impl Shared<'_> {
    fn threshold(&self) -> f64 {
        f64::from_bits(self.threshold.load(AtomicOrdering::Relaxed))
    }

    fn out_of_time(&self) -> bool {
        if self.stop.load(AtomicOrdering::Relaxed) {
            return true;
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.stop.store(true, AtomicOrdering::Relaxed);
            return true;
        }
        false
    }
}

/// A ranked entry; ordered by step time, then peak memory, then the plan's text.
struct Entry {
    time: f64,
    memory: f64,
    key: String,
    plan: Plan,
    estimate: Estimate,
}

impl Entry {
    fn rank_order(a: &Entry, b: &Entry) -> Ordering {
        a.time
            .total_cmp(&b.time)
            .then(a.memory.total_cmp(&b.memory))
            .then_with(|| a.key.cmp(&b.key))
    }
}

impl PartialEq for Entry {
    fn eq(&self, other: &Entry) -> bool {
        Entry::rank_order(self, other) == Ordering::Equal
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Entry) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Entry) -> Ordering {
        Entry::rank_order(self, other)
    }
}

/// The best `top_k` plans a worker has seen: a max-heap whose top is the worst kept, so
/// that offering a plan costs `O(log top_k)` however many are kept.
#[derive(Default)]
struct TopK {
    entries: BinaryHeap<Entry>,
}

#[derive(Default)]
struct LocalStats {
    candidates: u64,
    pruned_by_memory: u64,
    pruned_by_time: u64,
    pruned_by_dominance: u64,
    estimated: u64,
    fitting: u64,
    schedules_built: u64,
}

/// Layer placements, each after those that beat it, with their positions.
type Dominance = Vec<(LayerPlacement, Vec<usize>)>;

/// One base plan (mesh shape, axis order, micro-batches, pipeline, ZeRO stage, sp) whose
/// layer placements and recompute policies a worker explores together.
struct Family<'a> {
    base: &'a Plan,
    built: &'a Built,
    micro_batches: usize,
    recomputes: &'a [Recompute],
    /// Whether full recompute of only some layers per stage is searched
    /// ([`Worker::least_recompute`]).
    partial: bool,
}

/// The mapping of `plan`'s mesh, built on first use, and again when the plan's mesh differs
/// from the one kept (expert tensor parallelism below `tp` moves expert-parallel ranks from
/// the `ep` axis into `tp`, [`Plan::ep_over_tp`]).
fn mapping_of<'m>(
    slot: &'m mut Option<MeshMapping>,
    plan: &Plan,
    model: &CostModel,
) -> Result<&'m MeshMapping, SearchError> {
    let axes = plan.mesh_axes();
    let same = |m: &MeshMapping| {
        m.axes().len() == axes.len()
            && m.axes()
                .iter()
                .zip(&axes)
                .all(|(a, (name, size))| a.name == *name && a.size == *size)
    };
    if !slot.as_ref().is_some_and(same) {
        *slot = None;
    }
    Ok(match slot {
        Some(mapping) => mapping,
        None => slot.insert(MeshMapping::new(&axes, &model.cluster)?),
    })
}

/// A schedule and the in-flight chunk count of each of its ranks.
struct Built {
    schedule: Schedule,
    in_flight: Vec<usize>,
}

type ScheduleKey = (ScheduleKind, usize, usize, usize);

/// Schedules kept per worker before the cache is emptied (they can be large: actions grow
/// with `pp * vpp * micro-batches`).
const SCHEDULE_CACHE: usize = 64;

struct Worker {
    top: TopK,
    stats: LocalStats,
    /// Thread-local (the schedules are shared by reference count).
    schedules: HashMap<ScheduleKey, Rc<Built>>,
}

/// What a worker hands back.
struct Done {
    top: TopK,
    stats: LocalStats,
}

fn run_worker(sh: &Shared<'_>) -> Result<Done, (usize, SearchError)> {
    let mut w = Worker {
        top: TopK::default(),
        stats: LocalStats::default(),
        schedules: HashMap::new(),
    };
    loop {
        if sh.out_of_time() {
            break;
        }
        let i = sh.next.fetch_add(1, AtomicOrdering::Relaxed);
        let Some(&shape) = sh.shapes.get(i) else {
            break;
        };
        let finished = w.run_shape(sh, shape).map_err(|e| (i, e))?;
        if !finished {
            break;
        }
        let done = sh.shapes_done.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        (sh.progress)(&Progress {
            shapes_done: done,
            shapes_total: sh.shapes.len(),
            estimated: sh.estimated.load(AtomicOrdering::Relaxed),
        });
    }
    Ok(Done {
        top: w.top,
        stats: w.stats,
    })
}

impl Worker {
    fn schedule(
        &mut self,
        kind: ScheduleKind,
        pp: usize,
        vpp: usize,
        m: usize,
    ) -> Result<Rc<Built>, SearchError> {
        let key = (kind, pp, vpp, m);
        if let Some(b) = self.schedules.get(&key) {
            return Ok(Rc::clone(b));
        }
        if self.schedules.len() >= SCHEDULE_CACHE {
            self.schedules.clear();
        }
        let schedule =
            Schedule::new(kind, pp, vpp, m).map_err(autopar_cost_model::CostError::from)?;
        let in_flight = (0..pp).map(|r| schedule.max_in_flight(r)).collect();
        let built = Rc::new(Built {
            schedule,
            in_flight,
        });
        self.stats.schedules_built += 1;
        self.schedules.insert(key, Rc::clone(&built));
        Ok(built)
    }

    /// Explores every plan of one mesh shape; false when the time limit interrupted it.
    fn run_shape(&mut self, sh: &Shared<'_>, s: Shape) -> Result<bool, SearchError> {
        let (model, cfg, opts) = (sh.model, sh.cfg, sh.opts);
        let c = &opts.constraints;
        let batch = opts.global_batch;
        let capacity = capacity_bytes(model);
        let orders = space::distinct_placements(
            &s,
            space::axis_orders(&s, c.axis_order.as_ref()),
            model.cluster.gpus_per_node,
        );
        let mut mappings: Vec<Option<MeshMapping>> = vec![None; orders.len()];
        let offers = &sh.offers;
        let zeros = space::zero_stages(&s, c, offers);
        let sps = space::sequence_parallel(cfg, &s, c, offers);
        let placements = space::layer_placements(cfg, &s, c, offers);
        // Sequence parallelism with expert tensor parallelism: experts below `tp` take
        // sequence shards, so they need sp.
        // Offload and experts over fewer ranks than tp are the GPU stack's: the CPU runtime
        // (and a search for what it runs) has neither, nor offload a cluster without a host.
        let gpu_stack = model.cluster.runtime == Runtime::MixedPrecisionGpu && !c.cpu_executable;
        // Pipeline stages that hold their gathered weights over the step (torchtitan's)
        // free nothing by offloading the shards; the estimate refuses it.
        let can_offload =
            gpu_stack && model.cluster.host.is_some() && !model.software.holds_stage_weights(s.pp);
        let layouts = if gpu_stack || c.etp.is_some() {
            space::expert_layouts(cfg, &s, c)
        } else {
            vec![(None, s.ep)]
        };
        let sp_layouts: Vec<(bool, Option<usize>, usize)> = sps
            .iter()
            .flat_map(|&sp| layouts.iter().map(move |&(etp, ep)| (sp, etp, ep)))
            .filter(|&(sp, etp, _)| sp || etp.is_none())
            .collect();
        // Per (micro-batch size, sp, etp, ep, axis order): the layer placements in dominance
        // order.
        type DominanceKey = (usize, bool, Option<usize>, usize, usize);
        let mut dominance: HashMap<DominanceKey, Rc<Dominance>> = HashMap::new();
        let selective_works = model.software.selective.does_work(model.compute.attention);
        let recomputes = space::recomputes(selective_works, c, offers);
        // Recomputing only some layers is weighed between none and all of them, where both
        // are in the space (not when a policy is pinned) and the stack can run it.
        let partial = offers.partial_recompute
            && gpu_stack
            && recomputes.first() == Some(&Recompute::None)
            && recomputes.contains(&Recompute::Full);
        for mbs in space::micro_batch_sizes(&s, batch, c) {
            let m = batch / (s.dp * mbs);
            for (vpp, kind) in space::pipelines(cfg, s.pp, m, c, offers) {
                for &zero in &zeros {
                    // Offload is in the space only where the GPU cannot hold the plan's state
                    // without it, the least that lets it (whatever `prune` says: the space is
                    // the same either way).
                    let on_gpu = Plan {
                        dp: s.dp,
                        tp: s.tp,
                        pp: s.pp,
                        vpp,
                        cp: s.cp,
                        ep: s.ep,
                        micro_batch_size: mbs,
                        global_batch: batch,
                        zero_stage: zero,
                        dtype: opts.dtype,
                        fp8: opts.fp8,
                        stage_layers: c.stage_layers.clone(),
                        ..Plan::default()
                    };
                    let fits = |offload| {
                        if !can_offload {
                            return true;
                        }
                        let p = Plan {
                            offload,
                            ..on_gpu.clone()
                        };
                        memory_lower_bound(model, cfg, &p, None) <= capacity
                    };
                    let offloads = space::offloads(zero, fits, c)
                        .into_iter()
                        .filter(|&o| o == Offload::None || can_offload);
                    for offload in offloads {
                        let base = Plan {
                            recompute: Recompute::None,
                            sequence_parallel: false,
                            schedule: kind,
                            axis_order: Vec::new(),
                            layer: LayerPlacement::MEGATRON,
                            offload,
                            etp: None,
                            recompute_layers: None,
                            ..on_gpu.clone()
                        };
                        // Megatron-LM's placement has the fewest parameters per rank, so the
                        // base plan's weights bound every placement's from below.
                        let family =
                            (sp_layouts.len() * placements.len() * orders.len() * recomputes.len())
                                as u64;
                        self.stats.candidates += family;
                        if opts.prune && memory_lower_bound(model, cfg, &base, None) > capacity {
                            self.stats.pruned_by_memory += family;
                            continue;
                        }
                        let built = self.schedule(kind, s.pp, vpp, m)?;
                        for &(sp, etp, ep) in &sp_layouts {
                            for (oi, order) in orders.iter().enumerate() {
                                let base = Plan {
                                    sequence_parallel: sp,
                                    axis_order: order.clone(),
                                    etp,
                                    ep,
                                    ..base.clone()
                                };
                                // No placement fits even with the most recomputation: the
                                // whole family goes before any mapping or profile is built.
                                let heaviest = Plan {
                                    recompute: *recomputes.last().expect("a recompute policy"),
                                    ..base.clone()
                                };
                                if opts.prune
                                    && placements.iter().all(|&layer| {
                                        let p = Plan {
                                            layer,
                                            ..heaviest.clone()
                                        };
                                        memory_lower_bound(model, cfg, &p, Some(&built.in_flight))
                                            > capacity
                                    })
                                {
                                    self.stats.pruned_by_memory +=
                                        (placements.len() * recomputes.len()) as u64;
                                    continue;
                                }
                                let mapping = &mut mappings[oi];
                                let layers = if opts.prune && placements.len() > 1 {
                                    let key = (mbs, sp, etp, ep, oi);
                                    if let Some(l) = dominance.get(&key) {
                                        Rc::clone(l)
                                    } else {
                                        let mapping = mapping_of(mapping, &base, model)?;
                                        let l = Rc::new(model.layer_dominance(
                                            cfg,
                                            &base,
                                            mapping,
                                            &placements,
                                        )?);
                                        dominance.insert(key, Rc::clone(&l));
                                        l
                                    }
                                } else {
                                    Rc::new(placements.iter().map(|&l| (l, Vec::new())).collect())
                                };
                                let family = Family {
                                    base: &base,
                                    built: &built,
                                    micro_batches: m,
                                    recomputes: &recomputes,
                                    partial,
                                };
                                if !self.run_family(sh, &family, &layers, mapping)? {
                                    return Ok(false);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(true)
    }

    /// Estimates the plans of one family (one base plan, every layer placement and recompute
    /// policy), skipping what the bounds prove cannot rank; false when the time limit
    /// interrupted it.
    ///
    /// `layers` lists the placements, each after those that beat it in the layer profile
    /// ([`CostModel::layer_dominance`]), with their positions. A beaten placement's plan is no
    /// faster and no smaller than the plan of one that beats it under the same recompute
    /// policy, so that plan's step time bounds it from below and, if that plan does not fit,
    /// neither does it.
    fn run_family(
        &mut self,
        sh: &Shared<'_>,
        f: &Family<'_>,
        layers: &[(LayerPlacement, Vec<usize>)],
        mapping: &mut Option<MeshMapping>,
    ) -> Result<bool, SearchError> {
        let (model, cfg, opts) = (sh.model, sh.cfg, sh.opts);
        let capacity = capacity_bytes(model);
        let base = f.base;
        let n = f.recomputes.len();
        // Per placement and recompute policy: a lower bound on the step time, and whether the
        // plan is known not to fit.
        let mut seen: Vec<Vec<(f64, bool)>> = vec![vec![(0.0, false); n]; layers.len()];
        let full = f.recomputes.iter().position(|&r| r == Recompute::Full);
        for (li, (layer, beaten_by)) in layers.iter().enumerate() {
            // A lower bound on the step time of this plan under this and every later (heavier)
            // recompute policy.
            let mut floor = 0.0f64;
            let mut partial_tried = false;
            for (ri, &recompute) in f.recomputes.iter().enumerate() {
                if sh.out_of_time() {
                    return Ok(false);
                }
                let rest = (n - ri) as u64;
                let by_dominance = beaten_by
                    .iter()
                    .map(|&k| seen[k][ri].0)
                    .fold(0.0f64, f64::max);
                if opts.prune && by_dominance.max(floor) > sh.threshold() {
                    if by_dominance > floor {
                        self.stats.pruned_by_dominance += rest;
                    } else {
                        self.stats.pruned_by_time += rest;
                    }
                    for s in &mut seen[li][ri..] {
                        s.0 = by_dominance.max(floor);
                    }
                    break;
                }
                floor = floor.max(by_dominance);
                seen[li][ri].0 = floor;
                if opts.prune && beaten_by.iter().any(|&k| seen[k][ri].1) {
                    self.stats.pruned_by_dominance += 1;
                    seen[li][ri].1 = true;
                    continue;
                }
                // A pinned count of recomputed layers goes with full recompute (the pin
                // implies it).
                let plan = Plan {
                    recompute,
                    layer: *layer,
                    recompute_layers: opts
                        .constraints
                        .recompute_layers
                        .filter(|_| recompute == Recompute::Full),
                    ..base.clone()
                };
                if opts.prune
                    && memory_lower_bound(model, cfg, &plan, Some(&f.built.in_flight)) > capacity
                {
                    self.stats.pruned_by_memory += 1;
                    seen[li][ri].1 = true;
                    continue;
                }
                let mapping = mapping_of(mapping, &plan, model)?;
                if opts.prune {
                    let stages = model.stage_times(cfg, &plan, mapping)?;
                    floor = floor.max(step_time_lower_bound(
                        &stages,
                        plan.pp,
                        plan.vpp,
                        f.micro_batches,
                    ));
                    if floor > sh.threshold() {
                        self.stats.pruned_by_time += rest;
                        for s in &mut seen[li][ri..] {
                            s.0 = floor;
                        }
                        break;
                    }
                }
                let mut est =
                    model.estimate_with_mapping(cfg, &plan, &f.built.schedule, mapping)?;
                self.stats.estimated += 1;
                sh.estimated.fetch_add(1, AtomicOrdering::Relaxed);
                floor = floor.max(est.iter_time_s);
                seen[li][ri] = (floor, !est.fits);
                // Where no recompute did not fit and recomputing every layer does, the
                // fewest recomputed layers per stage that fit are faster than all of them.
                let partial = f.partial
                    && recompute == Recompute::Full
                    && est.fits
                    && seen[li][0].1
                    && !(opts.prune && seen[li][0].0 > sh.threshold());
                if est.fits {
                    self.stats.fitting += 1;
                    est.timeline = None;
                    self.offer(sh, plan.clone(), est);
                }
                if partial {
                    partial_tried = true;
                    if let Some((plan, est)) = self.least_recompute(sh, f, &plan, mapping)? {
                        self.offer(sh, plan, est);
                    }
                }
            }
            // Recomputing only some layers is faster than recomputing all of them, so the
            // bounds that stopped the loop at full recompute (its own step-time bound, or a
            // dominating placement's) bound nothing below it: only the plan without
            // recomputation bounds those plans from below. Where the loop did not reach them,
            // they are tried here, unless full recompute is known not to fit (then nothing
            // fewer does).
            let tries_partial = f.partial
                && !partial_tried
                && full.is_some_and(|k| !seen[li][k].1)
                && seen[li][0].1
                && !(opts.prune && seen[li][0].0 > sh.threshold());
            if tries_partial {
                if sh.out_of_time() {
                    return Ok(false);
                }
                let plan = Plan {
                    recompute: Recompute::Full,
                    layer: *layer,
                    ..base.clone()
                };
                let mapping = mapping_of(mapping, &plan, model)?;
                if let Some((plan, est)) = self.least_recompute(sh, f, &plan, mapping)? {
                    self.offer(sh, plan, est);
                }
            }
        }
        Ok(true)
    }

    /// `full` (a plan recomputing every layer, which fits) with the fewest recomputed layers
    /// per virtual stage that still fit ([`Plan::recompute_layers`]), when fewer than the
    /// widest stage's do: stored activations fall as layers are added, so a bisection over
    /// the count finds it.
    fn least_recompute(
        &mut self,
        sh: &Shared<'_>,
        f: &Family<'_>,
        full: &Plan,
        mapping: &MeshMapping,
    ) -> Result<Option<(Plan, Estimate)>, SearchError> {
        let (model, cfg) = (sh.model, sh.cfg);
        let widest = stage_layers(cfg, full).into_iter().max().unwrap_or(1);
        let mut estimate = |n: usize| -> Result<(Plan, Estimate), SearchError> {
            let plan = Plan {
                recompute_layers: Some(n),
                ..full.clone()
            };
            let est = model.estimate_with_mapping(cfg, &plan, &f.built.schedule, mapping)?;
            self.stats.estimated += 1;
            sh.estimated.fetch_add(1, AtomicOrdering::Relaxed);
            Ok((plan, est))
        };
        // The least count known to fit (`widest`: every layer) and the most known not to.
        let (mut fits, mut fails) = (widest, 0);
        let mut best = None;
        while fits - fails > 1 {
            let mid = fails + (fits - fails) / 2;
            let (plan, est) = estimate(mid)?;
            if est.fits {
                fits = mid;
                best = Some((plan, est));
            } else {
                fails = mid;
            }
        }
        Ok(best.map(|(plan, mut est)| {
            self.stats.fitting += 1;
            est.timeline = None;
            (plan, est)
        }))
    }

    /// Keeps `plan` if it is among the best `top_k` this worker has seen.
    fn offer(&mut self, sh: &Shared<'_>, plan: Plan, estimate: Estimate) {
        let k = sh.opts.top_k;
        let entries = &mut self.top.entries;
        let time = estimate.iter_time_s;
        if entries.len() == k && entries.peek().is_some_and(|worst| time > worst.time) {
            return;
        }
        entries.push(Entry {
            time,
            memory: estimate.peak_memory_gib,
            key: plan.to_string(),
            plan,
            estimate,
        });
        if entries.len() > k {
            entries.pop();
        }
        if entries.len() == k
            && let Some(last) = entries.peek()
        {
            sh.threshold
                .fetch_min(last.time.to_bits(), AtomicOrdering::Relaxed);
        }
    }
}
