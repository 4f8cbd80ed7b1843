//! What to compile: [`CompileOptions`] gathers the model, the training options, the mesh and
//! the parallel and pipeline options, and [`CompileOptions::from_plan`] maps a plan found by
//! the search (or written to a plan file) onto them.

use autopar_cost_model::{LayerPlacement, OpPlacement, Plan};
use autopar_ir::schedule::ScheduleKind;
use autopar_ir::{DType, DeviceMesh, Graph, axis};
use autopar_passes::parallelize::ParallelOptions;
use autopar_passes::recompute::Recompute;
use autopar_passes::train::{LossScaling, TrainOptions};

use crate::Error;
use crate::compile::Pass;

/// Everything [`crate::compile()`] needs.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// A zoo name or spec, or a `.air`/`.json` file (see [`crate::ModelSource`]).
    pub model: String,
    /// The global batch of a zoo model (default [`autopar_frontends::zoo::DEFAULT_BATCH`]);
    /// a file's shapes are fixed, so it must be `None` for a file.
    pub batch: Option<usize>,
    /// How the training step is built (optimizer, dtype, micro-batches, recompute).
    pub train: TrainOptions,
    /// Compile the forward pass only (its loss), not a training step.
    pub forward_only: bool,
    /// The loss built over an ONNX model's last output (zoo and `.air` models have theirs).
    pub loss: Option<autopar_frontends::onnx::Loss>,
    /// The device mesh; `None` runs on one device. A `pp` axis above 1 makes a pipeline,
    /// cut from every rank's local program on the other axes.
    pub mesh: Option<DeviceMesh>,
    /// ZeRO stage, annotations, sequence parallelism and layer placement over the mesh.
    pub parallel: ParallelOptions,
    /// Schedule, virtual stages and pinned boundaries of a pipeline.
    pub pipeline: PipelineSpec,
    /// The size of a bucket of gradient all-reduces, in MiB (default
    /// [`autopar_passes::collectives::DEFAULT_BUCKET_MB`], PyTorch DDP's); 0 keeps one
    /// all-reduce per gradient ([`crate::Pass::Collectives`]).
    pub bucket_mb: f64,
    /// Build the graph `--verify` runs on one device when it differs from the compiled one
    /// (the original step of a model laid out in a load-balanced sequence order).
    pub reference: bool,
    /// Stop after this pass (dumps of intermediate results): later passes do not run and
    /// the compiled step holds no programs past it.
    pub stop_after: Option<Pass>,
    /// Keep the output of these passes as text ([`crate::CompiledStep::dumps`]).
    pub dump_after: Vec<Pass>,
    /// Run [`Pass::Fuse`] over the rank programs (on by default; `--no-fuse` turns it off).
    /// The reference graph `--verify` runs is never fused.
    pub fuse: bool,
}

/// The pipeline part of the options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineSpec {
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank (virtual stages `pp * vpp`).
    pub vpp: usize,
    /// Layers (by name or index) that must start a virtual stage.
    pub boundaries: Vec<String>,
}

impl Default for PipelineSpec {
    fn default() -> Self {
        PipelineSpec {
            schedule: ScheduleKind::OneFOneB,
            vpp: 1,
            boundaries: Vec::new(),
        }
    }
}

impl CompileOptions {
    /// A training step of `model` on one device with the default training options.
    pub fn new(model: impl Into<String>) -> Self {
        CompileOptions {
            model: model.into(),
            batch: None,
            train: TrainOptions::default(),
            forward_only: false,
            loss: None,
            mesh: None,
            parallel: ParallelOptions::default(),
            pipeline: PipelineSpec::default(),
            bucket_mb: autopar_passes::collectives::DEFAULT_BUCKET_MB,
            reference: true,
            stop_after: None,
            dump_after: Vec::new(),
            fuse: true,
        }
    }

    /// The same options on the mesh `text` (`dp=2,tp=2`).
    pub fn on_mesh(mut self, text: &str) -> Result<Self, Error> {
        let mesh =
            DeviceMesh::parse(text).map_err(|e| Error::Usage(format!("--mesh `{text}`: {e}")))?;
        self.mesh = Some(mesh);
        Ok(self)
    }

    /// The options that run `plan` for `model`: the plan's mesh (in its axis order, its `dp`
    /// counting the `ep` ranks carved out of it: plan `dp=4,ep=2` is mesh `dp=2,ep=2`), ZeRO
    /// stage, sequence parallelism and layer placement; its pipeline schedule, virtual
    /// stages and per-stage layer counts; its dtype (f16 with dynamic loss scaling from
    /// `base`'s initial scale), micro-batch count and recompute policy; the optimizer and
    /// clipping of `base`. The global batch is the plan's.
    ///
    /// A plan that would run as another plan is refused, naming the field: a degree or
    /// micro-batch size of 0, an inconsistent plan ([`Plan::check`]), an axis order that
    /// names an unknown axis, repeats one or leaves out one of degree above 1, or a global
    /// batch that the data ranks' micro-batches do not divide exactly.
    pub fn from_plan(model: &str, plan: &Plan, base: &TrainOptions) -> Result<Self, Error> {
        check_executable(plan)?;
        let mut train = base.clone();
        train.compute_dtype = plan.dtype;
        let initial_scale = base
            .loss_scaling
            .as_ref()
            .map_or(LossScaling::default().initial_scale, |s| s.initial_scale);
        train.loss_scaling = (plan.dtype == DType::F16).then_some(LossScaling {
            initial_scale,
            ..LossScaling::default()
        });
        train.micro_batches = plan.micro_batches();
        train.recompute = match plan.recompute {
            autopar_cost_model::Recompute::None => Recompute::None,
            autopar_cost_model::Recompute::Selective => Recompute::Selective,
            autopar_cost_model::Recompute::Full => Recompute::Full,
        };
        let axes: Vec<(&str, usize)> = plan
            .axis_order
            .iter()
            .filter_map(|a| match a.as_str() {
                axis::DP => Some((axis::DP, plan.dp / plan.ep.max(1))),
                axis::EP => Some((axis::EP, plan.ep)),
                axis::TP => Some((axis::TP, plan.tp)),
                axis::CP => Some((axis::CP, plan.cp)),
                axis::PP => Some((axis::PP, plan.pp)),
                _ => None,
            })
            .filter(|&(_, size)| size > 1)
            .collect();
        let axes = if axes.is_empty() {
            vec![(axis::DP, 1)]
        } else {
            axes
        };
        let mesh = DeviceMesh::new(axes)?;
        // A plan that fixes its layers per virtual stage starts every stage after the first
        // at its first block (by the block's index, whatever its layers are called);
        // otherwise the splitter balances the step's FLOPs.
        let boundaries: Vec<String> = plan
            .stage_layers
            .iter()
            .flat_map(|layers| {
                layers[..layers.len().saturating_sub(1)]
                    .iter()
                    .scan(0, |start, n| {
                        *start += n;
                        Some(format!("block({start})"))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(CompileOptions {
            batch: Some(plan.global_batch),
            train,
            mesh: Some(mesh),
            parallel: ParallelOptions {
                zero: plan.zero_stage,
                annotations: Vec::new(),
                sequence_parallel: plan.sequence_parallel,
                layer: plan.layer,
            },
            pipeline: PipelineSpec {
                schedule: plan.schedule,
                vpp: plan.vpp,
                boundaries,
            },
            ..CompileOptions::new(model)
        })
    }

    /// The compute dtype of the step (what `--verify`'s tolerance depends on).
    pub fn compute_dtype(&self) -> DType {
        self.train.compute_dtype
    }
}

/// Refuses a plan that [`CompileOptions::from_plan`] could only run as another one.
fn check_executable(plan: &Plan) -> Result<(), Error> {
    let bad = |m: String| Err(Error::Usage(format!("plan `{plan}`: {m}")));
    for (field, value) in [
        ("dp", plan.dp),
        ("tp", plan.tp),
        ("pp", plan.pp),
        ("vpp", plan.vpp),
        ("cp", plan.cp),
        ("ep", plan.ep),
        ("micro_batch_size", plan.micro_batch_size),
        ("global_batch", plan.global_batch),
    ] {
        if value == 0 {
            return bad(format!("`{field}` is 0"));
        }
    }
    plan.check()
        .map_err(|e| Error::Usage(format!("plan `{plan}`: {e}")))?;
    if plan.fp8 {
        // The cost model prices fp8 GEMMs; the CPU runtime has no fp8 arithmetic, and
        // running the plan in bf16 instead would not be the plan.
        return bad(
            "`dtype=fp8` is an estimate-only dtype: the runtime has no fp8 GEMMs \
                    (run the plan with dtype=bf16)"
                .into(),
        );
    }
    if plan.expert_tp() < plan.tp {
        // The compiler splits each expert over all of tp; expert parallelism folded over
        // tensor-parallel ranks (`Plan::ep_over_tp`) has no mesh here either.
        return bad(format!(
            "`etp={}` below tp={} is estimate-only: the runtime splits each expert over all \
             of tp",
            plan.expert_tp(),
            plan.tp
        ));
    }
    if let Some(n) = plan.recompute_layers {
        // The runtime's recompute pass covers every layer or none.
        return bad(format!(
            "`recompute_layers={n}` is estimate-only: the runtime recomputes every layer \
             (recompute=full) or none"
        ));
    }
    let degree = |a: autopar_ir::Axis| match a {
        autopar_ir::Axis::Data => plan.dp / plan.ep,
        autopar_ir::Axis::Tensor => plan.tp,
        autopar_ir::Axis::Pipeline => plan.pp,
        autopar_ir::Axis::Context => plan.cp,
        autopar_ir::Axis::Expert => plan.ep,
    };
    let mut seen = Vec::new();
    for name in &plan.axis_order {
        let Some(a) = autopar_ir::Axis::from_name(name) else {
            return bad(format!(
                "`axis_order` names `{name}`, which is not a mesh axis"
            ));
        };
        if seen.contains(&a) {
            return bad(format!("`axis_order` names `{name}` twice"));
        }
        seen.push(a);
    }
    if let Some(a) = autopar_ir::Axis::ALL
        .into_iter()
        .find(|&a| degree(a) > 1 && !seen.contains(&a))
    {
        return bad(format!(
            "`axis_order` leaves out `{a}`, whose degree is {}",
            degree(a)
        ));
    }
    let per_step = plan.dp * plan.micro_batch_size;
    if !plan.global_batch.is_multiple_of(per_step) {
        return bad(format!(
            "the global batch {} is not a whole number of micro-batches of {} sequences on \
             each of dp={} ranks",
            plan.global_batch, plan.micro_batch_size, plan.dp
        ));
    }
    Ok(())
}

/// The load-balanced sequence layout a mesh needs (see
/// [`autopar_passes::context_parallel`]): the mesh axis whose ranks split the sequence, and
/// its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceLayout {
    /// `cp` for context parallelism, `tp` for the attention core on the sequence shards.
    pub axis: &'static str,
    /// The number of sequence shards (above 1).
    pub ways: usize,
}

impl SequenceLayout {
    /// The forward graph `g` rewritten into this layout.
    pub fn apply(&self, g: &Graph) -> Result<Graph, Error> {
        Ok(autopar_passes::context_parallel::load_balance(
            g, self.axis, self.ways,
        )?)
    }
}

/// The sequence layout a step on `mesh` with the layer placement `layer` must be built in,
/// `None` when the order of the sequence does not matter to it:
///
/// - context parallelism (a `cp` axis above 1) runs ring attention over `cp`;
/// - the attention core on the sequence shards ([`OpPlacement::Sequence`]) on a `tp` axis
///   above 1 attends each rank's queries to every key, and is priced by the cost model as
///   balanced over `tp`, with one chunk from each end of the sequence per rank.
///
/// Both at once would need the two layouts nested, which neither the cost model nor the
/// passes describe: an error.
pub fn sequence_layout(
    mesh: &DeviceMesh,
    layer: &LayerPlacement,
) -> Result<Option<SequenceLayout>, Error> {
    let size = |a: &str| mesh.axis_size(a).unwrap_or(1);
    let core_on_shards = layer.attention == OpPlacement::Sequence;
    match (size(axis::CP), size(axis::TP)) {
        (cp, tp) if cp > 1 && core_on_shards && tp > 1 => Err(Error::Usage(format!(
            "--attn: the layer placement `{layer}` runs the attention core on the sequence \
             shards of `{tp_axis}`, which does not compose with context parallelism \
             ({cp_axis}={cp}); keep the core split by heads (e.g. attn=sts) or drop `{cp_axis}`",
            tp_axis = axis::TP,
            cp_axis = axis::CP,
        ))),
        (cp, _) if cp > 1 => Ok(Some(SequenceLayout {
            axis: axis::CP,
            ways: cp,
        })),
        (_, tp) if tp > 1 && core_on_shards => Ok(Some(SequenceLayout {
            axis: axis::TP,
            ways: tp,
        })),
        _ => Ok(None),
    }
}

/// The mesh without its `pp` axis (`None` when no other axis is left): the mesh each
/// pipeline rank's programs are partitioned for.
pub fn without_pp(mesh: &DeviceMesh) -> Result<Option<DeviceMesh>, Error> {
    let axes: Vec<(String, usize)> = mesh
        .axes()
        .iter()
        .filter(|a| a.name != axis::PP)
        .map(|a| (a.name.clone(), a.size))
        .collect();
    if axes.is_empty() {
        return Ok(None);
    }
    Ok(Some(DeviceMesh::new(axes)?))
}
