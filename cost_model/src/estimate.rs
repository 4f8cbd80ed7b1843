//! The step estimate: per-layer forward and backward times of a transformer under a plan
//! (GEMMs, memory-bound kernels, exposed tensor/context/expert-parallel communication,
//! recomputation), assembled into per-virtual-stage times, run through the pipeline
//! schedule's action lists, followed by data-parallel gradient reduction (overlapped where
//! it can be) and the optimizer step; plus the memory of every pipeline rank.

use serde::{Deserialize, Serialize};

use autopar_ir::schedule::{Action, Schedule, Timeline};
use autopar_ir::{DType, Op, TensorType, axis};

use crate::buckets::{GradientSpan, gradient_buckets, layer_gradient_params};
use crate::cluster::Cluster;
use crate::cluster::Runtime;
use crate::comm::{Collective, CommParams};
use crate::compute::{
    AttentionKernel, AttentionShape, ComputeParams, EAGER_GATE, EAGER_REPEAT_KV, EAGER_RMS_NORM,
    EAGER_ROTARY, EagerChain, GemmShape, OpCost,
};
use crate::cost::Cost;
use crate::error::CostError;
use crate::layer::{
    LayerOp, LayerPlacement, OpPlacement, Overlap, Pass, TpCollective, Width,
    attention_block_collectives, tp_collectives, tp_collectives_unexplained,
};
use crate::mapping::{GroupInfo, MeshMapping};
use crate::memory::{
    MemoryBreakdown, MemoryParams, RUNTIME_CROSS_ENTROPY_BYTES_PER_LOGIT, ZeroShards,
    activation_bytes_per_layer, expert_params_per_layer, layer_params_per_rank,
    op_policy_activation_bytes_per_layer, op_policy_recomputed_gemm_share,
    optimizer_params_per_layer, runtime_activation_bytes_per_layer,
    runtime_attention_bytes_per_layer, runtime_mlp_backward_temporaries,
    tp_replicated_params_per_layer,
};
use crate::model::TransformerConfig;
use crate::plan::{Offload, Plan, Recompute};
use crate::software::{
    CpAttention, FP32_GRAD_ACCUMULATION_BYTES, Fusion, GatherUnit, SelectiveRecompute, Software,
};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Costs one op at a time; what passes receive instead of owning hardware tables.
pub trait OpCostModel {
    /// FLOPs, bytes and time of `op` on one device of the cluster; collectives use `mapping`
    /// and are infeasible without it.
    fn op_cost(
        &self,
        op: &Op,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        mapping: Option<&MeshMapping>,
    ) -> OpCost;
}

/// The cost model: a cluster and every tunable parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// The hardware.
    pub cluster: Cluster,
    /// Compute parameters.
    pub compute: ComputeParams,
    /// Communication parameters.
    pub comm: CommParams,
    /// Memory parameters.
    pub memory: MemoryParams,
    /// The training stack's behaviour (already written into `compute` and `comm`, and
    /// read directly for how ZeRO-3 gathers weights).
    pub software: Software,
    /// Where set, every estimate is the slower of this model's and this other model's
    /// ([`CostModel::pessimistic`]).
    #[serde(skip)]
    pub slower_of: Option<Box<CostModel>>,
}

impl OpCostModel for CostModel {
    fn op_cost(
        &self,
        op: &Op,
        inputs: &[&TensorType],
        outputs: &[&TensorType],
        mapping: Option<&MeshMapping>,
    ) -> OpCost {
        self.compute
            .op_cost(op, inputs, outputs, &self.cluster, &self.comm, mapping)
    }
}

/// Where the time of one pass (forward or backward of one layer and micro-batch) goes, in
/// seconds. The total is the sum of the fields except `comm_total_s`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PassTime {
    /// Dense GEMMs (projections, MLP, logits).
    pub gemm_s: f64,
    /// Attention core (score GEMMs and their softmax/dropout, or a fused kernel).
    pub attention_s: f64,
    /// Other memory-bound kernels (norms, activations, dropout, residual adds).
    pub memory_s: f64,
    /// Communication on the critical path.
    pub comm_exposed_s: f64,
    /// All communication issued, hidden or not.
    pub comm_total_s: f64,
    /// Recomputation of forward work inside a backward.
    pub recompute_s: f64,
    /// `comm_exposed_s` split by the parallelism the collectives serve.
    pub exposed_by: ExposedComm,
    /// Of `comm_exposed_s`, what persistent GEMMs lose to the NCCL collectives beside them:
    /// the CTAs the collectives displace run as a second wave
    /// ([`crate::comm::CommParams::persistent_gemm_slowdown`]).
    #[serde(default)]
    pub second_wave_s: f64,
}

/// Exposed communication of a pass by what it serves, in seconds; the fields add up to the
/// pass's `comm_exposed_s`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExposedComm {
    /// Tensor (and sequence) parallelism: all-reduce, or all-gather and reduce-scatter.
    pub tp_s: f64,
    /// Context parallelism's key/value exchange.
    pub cp_s: f64,
    /// Expert parallelism's dispatch and combine all-to-alls.
    pub ep_s: f64,
    /// ZeRO's per-layer traffic: ZeRO-3 weight gathers, ZeRO-2/3 gradient reduce-scatters,
    /// and under CPU offload the PCIe copies of the shards (gradients down, offloaded
    /// parameters up before their gathers).
    pub zero_s: f64,
}

/// What a collective inside a layer serves (see [`ExposedComm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CommKind {
    Tensor,
    Context,
    Expert,
    Zero,
}

impl PassTime {
    /// The window a collective overlapping the whole pass hides under: the time on the
    /// critical path ([`PassTime::total_s`]) but the second waves already counted (GEMM
    /// time, which the estimate counts once per GEMM).
    pub fn overlap_window_s(&self) -> f64 {
        self.total_s() - self.second_wave_s
    }

    /// [`PassTime::overlap_window_s`] without the pass's exposed expert all-to-alls: what it
    /// offers beside them when the other micro-batch's work hides them
    /// (`Ctx::overlap_expert_all_to_alls`).
    fn window_beside_all_to_alls_s(&self) -> f64 {
        (self.overlap_window_s() - self.exposed_by.ep_s).max(0.0)
    }

    /// The GEMMs' share of [`PassTime::overlap_window_s`] (0 for an empty pass): what a
    /// collective overlapping the whole pass finds beside it. The exposed communication is
    /// part of the window and runs no GEMM, so a persistent GEMM's second wave
    /// ([`crate::comm::CommParams::exposed_beside`]) never costs more than the GEMMs
    /// themselves.
    pub fn gemm_share(&self) -> f64 {
        let window = self.overlap_window_s();
        if window > 0.0 {
            (self.gemm_s / window).min(1.0)
        } else {
            0.0
        }
    }

    /// Time on the critical path.
    pub fn total_s(&self) -> f64 {
        self.gemm_s + self.attention_s + self.memory_s + self.comm_exposed_s + self.recompute_s
    }

    /// Adds `o`'s times to these.
    fn add(&mut self, o: &PassTime) {
        self.gemm_s += o.gemm_s;
        self.attention_s += o.attention_s;
        self.memory_s += o.memory_s;
        self.comm_exposed_s += o.comm_exposed_s;
        self.comm_total_s += o.comm_total_s;
        self.recompute_s += o.recompute_s;
        self.second_wave_s += o.second_wave_s;
        let (a, b) = (&mut self.exposed_by, &o.exposed_by);
        a.tp_s += b.tp_s;
        a.cp_s += b.cp_s;
        a.ep_s += b.ep_s;
        a.zero_s += b.zero_s;
    }

    /// These times less `o`'s, each at least zero: a pass that skips `o`'s part of this one.
    fn without(&self, o: &PassTime) -> PassTime {
        let less = |a: f64, b: f64| (a - b).max(0.0);
        let (a, b) = (&self.exposed_by, &o.exposed_by);
        PassTime {
            gemm_s: less(self.gemm_s, o.gemm_s),
            attention_s: less(self.attention_s, o.attention_s),
            memory_s: less(self.memory_s, o.memory_s),
            comm_exposed_s: less(self.comm_exposed_s, o.comm_exposed_s),
            comm_total_s: less(self.comm_total_s, o.comm_total_s),
            recompute_s: less(self.recompute_s, o.recompute_s),
            exposed_by: ExposedComm {
                tp_s: less(a.tp_s, b.tp_s),
                cp_s: less(a.cp_s, b.cp_s),
                ep_s: less(a.ep_s, b.ep_s),
                zero_s: less(a.zero_s, b.zero_s),
            },
            second_wave_s: less(self.second_wave_s, o.second_wave_s),
        }
    }

    /// Communication nothing hides.
    fn exposed(&mut self, kind: CommKind, t: f64) {
        self.overlapped(kind, t, t);
    }

    /// `issued` seconds of communication of which `exposed` stay on the critical path.
    fn overlapped(&mut self, kind: CommKind, issued: f64, exposed: f64) {
        self.comm_total_s += issued;
        self.comm_exposed_s += exposed;
        let by = &mut self.exposed_by;
        *match kind {
            CommKind::Tensor => &mut by.tp_s,
            CommKind::Context => &mut by.cp_s,
            CommKind::Expert => &mut by.ep_s,
            CommKind::Zero => &mut by.zero_s,
        } += exposed;
    }
}

/// Where an iteration's time goes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeBreakdown {
    /// Forward of one transformer layer for one micro-batch.
    pub layer_forward: PassTime,
    /// Backward of one transformer layer for one micro-batch (with recomputation).
    pub layer_backward: PassTime,
    /// Forward time of each virtual stage for one micro-batch.
    pub stage_forward_s: Vec<f64>,
    /// Backward time of each virtual stage for one micro-batch.
    pub stage_backward_s: Vec<f64>,
    /// One activation transfer between adjacent stages (the slowest).
    pub p2p_s: f64,
    /// From the first forward to the last backward, as the schedule simulation ran it.
    pub pipeline_s: f64,
    /// The busiest rank's forward and backward work, without waiting.
    pub busiest_rank_compute_s: f64,
    /// `pipeline_s - busiest_rank_compute_s`: pipeline bubbles and transfer waits.
    pub bubble_s: f64,
    /// Data-parallel gradient reduction, in total.
    pub grad_reduce_s: f64,
    /// The part of it left after the last backward.
    pub grad_reduce_exposed_s: f64,
    /// All-reduce of the tied embedding gradient between the first and last stage.
    pub embedding_sync_s: f64,
    /// Optimizer update (under CPU offload: the host's step, then the copy of the updated
    /// 16-bit weights back to the GPU when only the optimizer is offloaded).
    pub optimizer_s: f64,
    /// All-gather of updated parameters (ZeRO-1/2).
    pub param_gather_s: f64,
}

/// The answer: the field names are the JSON contract of `autopar estimate --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Seconds per training step.
    pub iter_time_s: f64,
    /// Tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Model FLOP/s per device in TFLOP/s (no recomputation counted).
    pub model_tflops_per_gpu: f64,
    /// Hardware FLOP/s per device in TFLOP/s (recomputation counted).
    pub hardware_tflops_per_gpu: f64,
    /// Model FLOPs utilisation against the dense peak of the compute dtype (the fp8 peak for
    /// `dtype=fp8` plans, as Transformer Engine users report it).
    pub mfu: f64,
    /// Peak memory of the fullest device in GiB.
    pub peak_memory_gib: f64,
    /// Whether every device's peak fits its memory.
    pub fits: bool,
    /// Why not, when it does not.
    pub fits_reason: Option<String>,
    /// Devices used.
    pub num_gpus: usize,
    /// Micro-batches per pipeline per step.
    pub micro_batches: usize,
    /// Step time as a [`Cost`] (infeasible when the plan does not fit).
    pub cost: Cost,
    /// Memory of the fullest pipeline rank.
    pub memory: MemoryBreakdown,
    /// Memory of every pipeline rank, in pipeline-rank order (empty when infeasible).
    pub memory_per_pipeline_rank: Vec<MemoryBreakdown>,
    /// Layers of each virtual stage (fixed by the plan, or balanced; empty when infeasible).
    pub stage_layers: Vec<usize>,
    /// Time breakdown.
    pub time: TimeBreakdown,
    /// The tensor-parallel collectives of one layer and one micro-batch that the layer
    /// placement implies, forward then backward, with their sizes and times (before any
    /// overlap; empty without `tp` or when infeasible).
    #[serde(default)]
    pub layer_tp_collectives: Vec<TimedCollective>,
    /// When each action of the simulated schedule ran, in nanoseconds (for timeline exports;
    /// absent when the plan is infeasible). Not part of the JSON contract.
    #[serde(skip)]
    pub timeline: Option<Timeline>,
}

/// A collective of [`Estimate::layer_tp_collectives`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimedCollective {
    /// What, where and why.
    #[serde(flatten)]
    pub collective: TpCollective,
    /// Bytes in nccl-tests' convention for its kind ([`Collective`]).
    pub bytes: f64,
    /// Seconds, alone on the `tp` links.
    pub time_s: f64,
}

impl CostModel {
    /// Defaults for every parameter on `cluster`.
    pub fn new(cluster: Cluster) -> Self {
        let (compute, memory) = match cluster.runtime {
            Runtime::MixedPrecisionGpu => (ComputeParams::default(), MemoryParams::default()),
            // The CPU runtime's attention is the decomposed one, which stores probabilities.
            Runtime::AutoparCpu => (
                ComputeParams {
                    attention: AttentionKernel::Unfused,
                    ..ComputeParams::default()
                },
                MemoryParams::autopar_cpu(),
            ),
        };
        let software = cluster.software.clone();
        let mut model = CostModel {
            cluster,
            compute,
            comm: CommParams::default(),
            memory,
            software: Software::default(),
            slower_of: None,
        };
        if let Some(spec) = software {
            // A cluster's software table was checked when the cluster was read.
            if let Ok(s) = spec.resolve() {
                s.apply(&mut model);
            }
        }
        model
    }

    /// The same model with its software's overlap all off ([`Software::without_overlap`]):
    /// a plan's step under it is the pessimistic end of its predicted range, and a search
    /// under it (`plan --robust`) ranks plans by that end.
    pub fn without_overlap(&self) -> CostModel {
        let mut m = self.clone();
        m.slower_of = None;
        self.software.without_overlap().apply(&mut m);
        m
    }

    /// The pessimistic end of a plan's range as a model: each estimate the slower of the
    /// step without any overlap ([`CostModel::without_overlap`]) and the step with the
    /// profile's. The second is usually the faster, but where the profile splits GEMMs to
    /// pipeline the tensor-parallel collectives (Transformer Engine's userbuffers) small
    /// GEMMs can lose more to the split than the collectives cost. A search under it
    /// (`plan --robust`) stays exact: a step-time bound of the no-overlap model bounds the
    /// slower of the two, each model's step grows with recomputation, and one layer
    /// placement beats another only where it does under both models
    /// ([`CostModel::layer_profile`] is both profiles).
    pub fn pessimistic(&self) -> CostModel {
        let mut profile = self.clone();
        profile.slower_of = None;
        let mut m = profile.without_overlap();
        m.slower_of = Some(Box::new(profile));
        m
    }

    /// Over how many ranks ZeRO shards dense and expert state under `plan`: every
    /// data-parallel rank for dense state, the ranks holding the same experts for expert
    /// state, and the context-parallel ranks as well where the software's mesh puts them in
    /// the sharding group ([`ZeroShards::new`], [`Software::zero_over_cp`]).
    pub fn zero_shards(&self, plan: &Plan) -> ZeroShards {
        ZeroShards::new(plan, self.software.zero_over_cp)
    }

    /// Checks that `plan` divides `cfg` and fits on the cluster.
    pub fn check_plan(&self, cfg: &TransformerConfig, plan: &Plan) -> Result<(), CostError> {
        plan.check_model(cfg)?;
        let world = plan.world_size();
        if world > self.cluster.num_devices() {
            return Err(CostError::PlanMismatch(format!(
                "the plan needs {world} devices (dp x tp x pp x cp), the cluster has {}",
                self.cluster.num_devices()
            )));
        }
        if plan.fp8 && self.cluster.fp8_peak_flops().is_none() {
            return Err(CostError::PlanMismatch(format!(
                "dtype=fp8 needs fp8 tensor cores, and the cluster's {} has no fp8 peak \
                 (gpu.peak_tflops.fp8)",
                self.cluster.gpu.model
            )));
        }
        if self.cluster.runtime == Runtime::AutoparCpu && plan.expert_tp() < plan.tp {
            return Err(CostError::PlanMismatch(format!(
                "etp={} below tp={}: the CPU runtime splits experts over all of tp",
                plan.expert_tp(),
                plan.tp
            )));
        }
        if plan.offload != Offload::None {
            if self.cluster.runtime == Runtime::AutoparCpu {
                return Err(CostError::PlanMismatch(format!(
                    "offload={} moves GPU state to host memory; the CPU runtime has no GPU",
                    plan.offload.name()
                )));
            }
            if self.cluster.host.is_none() {
                return Err(CostError::PlanMismatch(format!(
                    "offload={} needs the host memory and PCIe links of the cluster's nodes, \
                     which `{}` does not describe (a [host] table)",
                    plan.offload.name(),
                    self.cluster.name
                )));
            }
            if self.software.holds_stage_weights(plan.pp) {
                return Err(CostError::PlanMismatch(format!(
                    "offload={} with pp={} under `{}`: its pipeline stages hold their layers' \
                     gathered weights and unsharded gradients over the step (PyTorch's \
                     pipelining stage defers FSDP's reshard and gradient reduction), which \
                     offloading the shards does not free; not modelled (use pp=1 or \
                     offload=none)",
                    plan.offload.name(),
                    plan.pp,
                    self.software.name
                )));
            }
        }
        if plan.fp8 && plan.dtype != DType::BF16 {
            return Err(CostError::PlanMismatch(
                "dtype=fp8 runs its non-GEMM work in bf16; it cannot be combined with another dtype"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl Plan {
    /// Checks that the plan is consistent ([`Plan::check`]) and divides `cfg`: the rules
    /// the compiler holds a plan to, whatever the cluster (a plan file is checked with them
    /// before it is compiled).
    pub fn check_model(&self, cfg: &TransformerConfig) -> Result<(), CostError> {
        let plan = self;
        cfg.validate()?;
        plan.check()?;
        let mis = |m: String| Err(CostError::PlanMismatch(m));
        if let Some(why) = cfg.tp_split_error(plan.tp) {
            return mis(why);
        }
        if !cfg
            .seq
            .is_multiple_of(plan.cp * if plan.sequence_parallel { plan.tp } else { 1 })
        {
            return mis(format!(
                "sequence {} is not divisible by cp (x tp with sp)",
                cfg.seq
            ));
        }
        if plan.stage_layers.is_none() && cfg.layers < plan.pp * plan.vpp {
            return mis(format!(
                "{} layers cannot fill pp x vpp = {} virtual stages",
                cfg.layers,
                plan.pp * plan.vpp
            ));
        }
        if let Some(why) = plan.layer.unsupported(cfg, plan.tp, plan.cp) {
            return mis(why);
        }
        if let Some(l) = &plan.stage_layers
            && l.iter().sum::<usize>() != cfg.layers
        {
            return mis(format!(
                "stages {:?} hold {} layers, the model has {}",
                l,
                l.iter().sum::<usize>(),
                cfg.layers
            ));
        }
        if cfg.experts > 1 && !cfg.experts.is_multiple_of(plan.ep) {
            return mis(format!(
                "ep={} does not divide {} experts",
                plan.ep, cfg.experts
            ));
        }
        if cfg.experts <= 1 && plan.ep > 1 {
            return mis(format!("ep={} on a model without experts", plan.ep));
        }
        if let Some(etp) = plan.etp {
            if cfg.experts <= 1 && etp != plan.tp {
                return mis(format!(
                    "etp={etp} on a model without experts (`{}` has a dense MLP)",
                    cfg.name
                ));
            }
            if !cfg.ffn.is_multiple_of(etp) {
                return mis(format!(
                    "etp={etp} does not divide the experts' MLP width {} of `{}`",
                    cfg.ffn, cfg.name
                ));
            }
        }
        Ok(())
    }
}

impl CostModel {
    /// Estimates one training step of `cfg` under `plan`.
    pub fn estimate(&self, cfg: &TransformerConfig, plan: &Plan) -> Result<Estimate, CostError> {
        let schedule = Schedule::new(plan.schedule, plan.pp, plan.vpp, plan.micro_batches())?;
        self.estimate_with_schedule(cfg, plan, &schedule)
    }

    /// As [`CostModel::estimate`], with the plan's schedule built by the caller: a search
    /// that scores many plans sharing `(schedule, pp, vpp, micro-batches)` builds it once.
    pub fn estimate_with_schedule(
        &self,
        cfg: &TransformerConfig,
        plan: &Plan,
        schedule: &Schedule,
    ) -> Result<Estimate, CostError> {
        // Checked before the mapping is built, so that a plan too large for the cluster is
        // reported in the plan's terms.
        self.check_plan(cfg, plan)?;
        let mapping = MeshMapping::new(&plan.mesh_axes(), &self.cluster)?;
        self.estimate_with_mapping(cfg, plan, schedule, &mapping)
    }

    /// As [`CostModel::estimate_with_schedule`], with the plan's mesh mapping built by the
    /// caller as well: building a mapping walks every device (milliseconds on 16K devices),
    /// and a search scores many plans on one mapping. `mapping` must place exactly the plan's
    /// mesh axes ([`Plan::mesh_axes`]) on this model's cluster.
    pub fn estimate_with_mapping(
        &self,
        cfg: &TransformerConfig,
        plan: &Plan,
        schedule: &Schedule,
        mapping: &MeshMapping,
    ) -> Result<Estimate, CostError> {
        self.check_plan(cfg, plan)?;
        if (
            schedule.kind,
            schedule.pp,
            schedule.vpp,
            schedule.micro_batches,
        ) != (plan.schedule, plan.pp, plan.vpp, plan.micro_batches())
        {
            return Err(CostError::PlanMismatch(format!(
                "schedule {} pp={} vpp={} m={} is not the plan's",
                schedule.kind, schedule.pp, schedule.vpp, schedule.micro_batches
            )));
        }
        check_mapping(plan, mapping)?;
        let run = self.as_run(plan);
        let ctx = Ctx::new(self, cfg, &run, mapping)?;
        let mine = ctx.run(schedule);
        match &self.slower_of {
            Some(other) => {
                let theirs = other.estimate_with_mapping(cfg, plan, schedule, mapping)?;
                Ok(match theirs.iter_time_s > mine.iter_time_s {
                    true => theirs,
                    false => mine,
                })
            }
            None => Ok(mine),
        }
    }

    /// `plan` as the software runs it: under pipeline parallelism a stack that holds a
    /// stage's gathered weights over the step ([`crate::Software::pp_holds_gathered_weights`])
    /// runs ZeRO-3, and ZeRO-2 alike, as ZeRO-1 does, the weights gathered once and the
    /// gradients reduced once, after the last micro-batch, with the full weights and
    /// gradients held meanwhile (such a plan cannot offload, [`CostModel::check_plan`]).
    fn as_run<'p>(&self, plan: &'p Plan) -> std::borrow::Cow<'p, Plan> {
        match self.software.holds_stage_weights(plan.pp) && plan.zero_stage >= 2 {
            true => std::borrow::Cow::Owned(Plan {
                zero_stage: 1,
                ..plan.clone()
            }),
            false => std::borrow::Cow::Borrowed(plan),
        }
    }
}

/// The forward and backward of one layer's MLP block for one micro-batch, as the step
/// estimate prices them inside the layer ([`CostModel::mlp_block_times`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BlockTimes {
    /// Forward.
    pub forward: PassTime,
    /// Backward (no recomputation).
    pub backward: PassTime,
}

impl CostModel {
    /// One layer's MLP block (for a mixture of experts: router, permutation, dispatch and
    /// combine all-to-alls, grouped expert GEMMs, unpermutation) under `plan`, priced by the
    /// code that prices it inside a layer of the step estimate, with the block's own
    /// tensor-parallel collectives (those that gather its input and reduce its output) on
    /// the critical path.
    pub fn mlp_block_times(
        &self,
        cfg: &TransformerConfig,
        plan: &Plan,
    ) -> Result<BlockTimes, CostError> {
        self.check_plan(cfg, plan)?;
        let mapping = MeshMapping::new(&plan.mesh_axes(), &self.cluster)?;
        let plan = self.as_run(plan);
        let ctx = Ctx::new(self, cfg, &plan, &mapping)?;
        let (_, mlp) = ctx.layer_gemms();
        let pass = |pass: Pass| {
            let (mut p, _, _) = ctx.mlp_block(&mlp, pass);
            for (c, in_block) in ctx.layer_tp_collectives(pass) {
                if in_block {
                    p.exposed(CommKind::Tensor, ctx.layer_tp_collective(&c, true));
                }
            }
            p
        };
        Ok(BlockTimes {
            forward: pass(Pass::Forward),
            backward: pass(Pass::Backward),
        })
    }
}

/// Per-virtual-stage times of one micro-batch, computed without running a schedule.
///
/// A search uses them for a lower bound on the step time before paying for the schedule
/// simulation: each rank runs its actions one after another, so the simulated pipeline takes
/// at least the busiest rank's work, and a rank cannot start before the stages ahead of it
/// have run a forward nor finish before those ahead of it have run the matching backwards.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageTimes {
    /// Forward of each virtual stage, seconds.
    pub forward_s: Vec<f64>,
    /// Backward of each virtual stage (with recomputation), seconds.
    pub backward_s: Vec<f64>,
}

/// Elements of a GEMM's weight operand (one per expert where the weights are batched).
fn gemm_weights(s: GemmShape, weights_batched: bool) -> f64 {
    let wb = if weights_batched { s.batch } else { 1 };
    (wb * s.k * s.n) as f64
}

struct Stages {
    layers: Vec<usize>,
    lf: PassTime,
    lb: PassTime,
    layer_flops: f64,
    head_flops: f64,
    fwd: Vec<f64>,
    /// Of `fwd`, the GEMMs' seconds.
    fwd_gemm: Vec<f64>,
    bwd: Vec<f64>,
}

impl CostModel {
    /// The per-virtual-stage times [`CostModel::estimate_with_mapping`] would feed to the
    /// schedule for `plan`, without running it (about as cheap as costing one layer).
    pub fn stage_times(
        &self,
        cfg: &TransformerConfig,
        plan: &Plan,
        mapping: &MeshMapping,
    ) -> Result<StageTimes, CostError> {
        self.check_plan(cfg, plan)?;
        check_mapping(plan, mapping)?;
        let plan = self.as_run(plan);
        let s = Ctx::new(self, cfg, &plan, mapping)?.stages();
        Ok(StageTimes {
            forward_s: s.fwd,
            backward_s: s.bwd,
        })
    }
}

impl CostModel {
    /// Everything the estimate of `plan` reads from its layer placement ([`Plan::layer`]):
    /// the layer's forward and backward seconds without recomputation, the attention core's
    /// forward (what selective recomputation adds), the activation bytes the layer stores
    /// under each recompute policy in both runtimes' accounting, the
    /// attention bytes a recomputed layer holds in autopar's runtime, the layer's parameters
    /// per rank, those whose optimizer state it holds and those replicated over `tp`.
    /// Computed without ZeRO: its gathers and
    /// reductions grow with the parameters and hide under the layer times, so they only grow
    /// with these; full recomputation adds the forward to the backward.
    ///
    /// The estimate is monotone in every component: the pipeline simulation is a max-plus
    /// system, gradient buckets start at times interpolated inside backward spans, exposed
    /// communication `max(0, c - u) + k min(c, u)` added to `u` never shrinks as `c` or `u`
    /// grows, and memory is a sum. So a placement whose profile is nowhere smaller than
    /// another's cannot rank above it ([`CostModel::layer_dominance`]).
    pub fn layer_profile(
        &self,
        cfg: &TransformerConfig,
        plan: &Plan,
        mapping: &MeshMapping,
    ) -> Result<Vec<f64>, CostError> {
        self.check_plan(cfg, plan)?;
        check_mapping(plan, mapping)?;
        let p = Plan {
            recompute: Recompute::None,
            zero_stage: 0,
            ..plan.clone()
        };
        let ctx = Ctx::new(self, cfg, &p, mapping)?;
        let mut out = vec![
            ctx.layer_forward().0.total_s(),
            ctx.layer_backward().total_s(),
            ctx.attention_forward().0,
        ];
        let e = plan.dtype.size_bytes() as f64;
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let kernel = self.compute.attention;
            let dropout = self.software.dropout;
            out.push(activation_bytes_per_layer(
                cfg, &p, recompute, kernel, dropout,
            ));
            out.push(runtime_activation_bytes_per_layer(cfg, &p, recompute, e));
        }
        out.push(runtime_attention_bytes_per_layer(cfg, &p, e));
        out.push(layer_params_per_rank(cfg, &p));
        out.push(optimizer_params_per_layer(cfg, &p));
        out.push(tp_replicated_params_per_layer(cfg, &p));
        // Under a pessimistic model, the other model's profile too: a placement beats
        // another only where it does under both.
        if let Some(other) = &self.slower_of {
            out.extend(other.layer_profile(cfg, plan, mapping)?);
        }
        Ok(out)
    }

    /// `candidates` (placements of `plan`'s layers) ordered so that each comes after every
    /// candidate that beats it, each with the positions (in the returned list) of those that
    /// beat it. A candidate beats another when its [`CostModel::layer_profile`] is nowhere
    /// larger and somewhere smaller; the estimate is monotone in the profile, so under every
    /// recompute policy, ZeRO stage and pipeline layout the beaten plan is no faster and no
    /// smaller than the one that beats it. A search uses this as a bound: a beaten placement
    /// needs no estimate when one that beats it is already too slow or does not fit.
    pub fn layer_dominance(
        &self,
        cfg: &TransformerConfig,
        plan: &Plan,
        mapping: &MeshMapping,
        candidates: &[LayerPlacement],
    ) -> Result<Vec<(LayerPlacement, Vec<usize>)>, CostError> {
        let mut profiled = Vec::with_capacity(candidates.len());
        for &layer in candidates {
            let p = Plan {
                layer,
                ..plan.clone()
            };
            profiled.push((layer, self.layer_profile(cfg, &p, mapping)?));
        }
        // If one profile beats another it is lexicographically smaller: a topological order.
        profiled.sort_by(|a, b| {
            a.1.iter()
                .zip(&b.1)
                .map(|(x, y)| x.total_cmp(y))
                .find(|o| o.is_ne())
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        let beats = |a: &[f64], b: &[f64]| {
            a.iter().zip(b).all(|(x, y)| x <= y) && a.iter().zip(b).any(|(x, y)| x < y)
        };
        Ok(profiled
            .iter()
            .map(|(layer, mine)| {
                let by = profiled
                    .iter()
                    .enumerate()
                    .filter(|(_, (_, other))| beats(other, mine))
                    .map(|(k, _)| k)
                    .collect();
                (*layer, by)
            })
            .collect())
    }
}

/// Chunks of a GEMM whose output Transformer Engine's userbuffers reduce-scatter pipelined
/// (the `pipeline` method's `num_splits` default, `initialize_ub`).
pub const PIPELINED_RS_SPLITS: u64 = 4;

fn check_mapping(plan: &Plan, mapping: &MeshMapping) -> Result<(), CostError> {
    let axes = plan.mesh_axes();
    if mapping.axes().len() != axes.len()
        || mapping
            .axes()
            .iter()
            .zip(&axes)
            .any(|(a, (name, size))| a.name != *name || a.size != *size)
    {
        return Err(CostError::PlanMismatch(
            "the mesh mapping does not place the plan's mesh axes".into(),
        ));
    }
    Ok(())
}

/// Layers of each virtual stage when they are spread as evenly as possible, earlier stages
/// taking the remainder.
pub fn layers_per_virtual_stage(layers: usize, virtual_stages: usize) -> Vec<usize> {
    let v = virtual_stages.max(1);
    (0..v)
        .map(|i| layers / v + usize::from(i < layers % v))
        .collect()
}

/// Layers pipeline rank `rank` of `pp` holds, given the layers of every virtual stage
/// (`layers[c * pp + rank]` is its chunk `c`'s, as [`stage_layers`] lists them).
pub fn rank_layers(layers: &[usize], pp: usize, rank: usize) -> usize {
    layers.iter().skip(rank).step_by(pp.max(1)).sum()
}

/// Layers of each virtual stage of `plan`: the ones it fixes, or the balanced division.
pub fn stage_layers(cfg: &TransformerConfig, plan: &Plan) -> Vec<usize> {
    plan.stage_layers
        .clone()
        .unwrap_or_else(|| balanced_layers_per_virtual_stage(cfg, plan.pp * plan.vpp))
}

/// Layers of each virtual stage, balanced: the division that minimises the costliest
/// virtual stage, counting the output head (its GEMM and the loss) on the last one, and
/// keeping the even division ([`layers_per_virtual_stage`]) whenever it is as good. Costs
/// are forward FLOPs per token (the backward is a fixed multiple for layers and head alike):
/// a layer's `2 (attention + active MLP parameters) + 4 s h` (scores and their product with
/// the values), the head's `2 h V` plus the vocabulary's softmax; the embedding is a gather.
/// Every virtual stage keeps at least one layer.
///
/// Depends only on the model and the number of virtual stages, so that memory bounds over
/// plans sharing a pipeline shape hold for all of them. This is the division the estimate,
/// the search's bounds and the exports use.
pub fn balanced_layers_per_virtual_stage(
    cfg: &TransformerConfig,
    virtual_stages: usize,
) -> Vec<usize> {
    let v = virtual_stages.max(1);
    let even = layers_per_virtual_stage(cfg.layers, v);
    if v == 1 || cfg.layers < v {
        return even;
    }
    let h = cfg.hidden as f64;
    let layer = 2.0 * (cfg.attention_params() as f64 + cfg.active_mlp_params())
        + 4.0 * cfg.seq as f64 * cfg.attention_width();
    let head = 2.0 * h * cfg.vocab as f64 + 5.0 * cfg.vocab as f64;
    let extra = |i: usize| if i == v - 1 { head } else { 0.0 };
    let cost = |n: &[usize]| {
        n.iter()
            .enumerate()
            .map(|(i, &k)| k as f64 * layer + extra(i))
            .fold(0.0, f64::max)
    };
    // The smallest feasible bound is `k * layer + extra(i)` for some stage `i` and count `k`:
    // a stage under bound `t` holds at most `floor((t - extra) / layer)` layers. Every stage
    // but the last has the same cap, so the caps are two numbers.
    let cap = |t: f64, extra: f64| ((t - extra) / layer + 1e-9).floor().max(0.0) as usize;
    let caps = |t: f64| -> Vec<usize> { (0..v).map(|i| cap(t, extra(i))).collect() };
    let feasible = |t: f64| {
        let (first, last) = (cap(t, 0.0), cap(t, head));
        first >= 1 && last >= 1 && first * (v - 1) + last >= cfg.layers
    };
    let mut best = cost(&even);
    for i in [0, v - 1] {
        // Binary search on the count of stage `i` at the bound.
        let (mut lo, mut hi) = (1usize, cfg.layers);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if feasible(mid as f64 * layer + extra(i)) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let t = lo as f64 * layer + extra(i);
        if feasible(t) {
            best = best.min(t);
        }
    }
    if cost(&even) <= best * (1.0 + 1e-12) {
        return even;
    }
    // Fill every stage to its cap under the bound, then give back the surplus from the
    // fullest stages (the earliest first), which keeps the division as even as it can be.
    let mut n = caps(best);
    let mut surplus = n.iter().sum::<usize>() - cfg.layers;
    while surplus > 0 {
        let (i, _) = n
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
            .expect("at least one stage");
        n[i] -= 1;
        surplus -= 1;
    }
    n
}

/// GEMM shapes with whether each batch has its own weights.
type GemmList = Vec<(Option<LayerOp>, GemmShape, bool)>;

/// Everything one estimate needs, computed once.
struct Ctx<'a> {
    m: &'a CostModel,
    cfg: &'a TransformerConfig,
    plan: &'a Plan,
    mapping: &'a MeshMapping,
    tp: GroupInfo,
    cp: GroupInfo,
    ep: GroupInfo,
    dp: GroupInfo,
    /// The ranks that hold the same experts (the mesh's `dp` axis, and with expert tensor
    /// parallelism below `tp` the `tp / etp` ranks of a tensor-parallel group that hold the
    /// same expert shards).
    dp_expert: GroupInfo,
    /// A group of `etp` consecutive ranks of a tensor-parallel group: the experts' GEMMs
    /// are split over it.
    etp: GroupInfo,
    /// Over how many ranks ZeRO shards dense and expert state.
    shards: ZeroShards,
    e: f64,
    /// Tokens per micro-batch on one rank (`b * s / cp`).
    n: u64,
    sp: bool,
}

impl<'a> Ctx<'a> {
    fn new(
        m: &'a CostModel,
        cfg: &'a TransformerConfig,
        plan: &'a Plan,
        mapping: &'a MeshMapping,
    ) -> Result<Self, CostError> {
        // The ranks that reduce a parameter's gradient and share its ZeRO state: the
        // context-parallel ranks too where the stack puts them in that group.
        let over_cp = m.software.zero_over_cp && plan.cp > 1;
        Ok(Ctx {
            m,
            cfg,
            plan,
            mapping,
            tp: mapping.axis_group(axis::TP)?.clone(),
            cp: mapping.axis_group(axis::CP)?.clone(),
            ep: expert_parallel_group(plan, mapping)?,
            dp: match over_cp {
                true => mapping.group(&[
                    axis::DP.to_string(),
                    axis::CP.to_string(),
                    axis::EP.to_string(),
                ])?,
                false => mapping.group(&[axis::DP.to_string(), axis::EP.to_string()])?,
            },
            dp_expert: expert_data_group(plan, mapping, over_cp)?,
            etp: expert_tp_group(plan, mapping.axis_group(axis::TP)?),
            shards: m.zero_shards(plan),
            e: plan.dtype.size_bytes() as f64,
            n: (plan.micro_batch_size * cfg.seq / plan.cp) as u64,
            sp: plan.sequence_parallel && plan.tp > 1,
        })
    }

    fn cl(&self) -> &Cluster {
        &self.m.cluster
    }

    fn coll(&self, c: Collective, bytes: f64, g: &GroupInfo) -> f64 {
        self.m.comm.collective(c, bytes, g, self.cl()).time_s
    }

    fn gemm(&self, s: GemmShape, weights_batched: bool) -> f64 {
        let wb = if weights_batched { s.batch } else { 1 };
        let bytes = ((s.batch * s.m * s.k + wb * s.k * s.n + s.batch * s.m * s.n) as f64) * self.e;
        self.m
            .compute
            .gemm_time(s, self.plan.dtype, bytes, self.cl())
    }

    /// The forward GEMM of a transformer layer: in fp8 under `dtype=fp8` (Transformer
    /// Engine's linear layers, which cast the layer's input and weight for it), otherwise
    /// as [`Ctx::gemm`]. Where the stack keeps the weights' fp8 copies over a step
    /// ([`crate::Software::fp8_weight_cache`]), only the first micro-batch casts them: the
    /// step pays that once ([`Ctx::layer_weight_cast`]), not every micro-batch; where the
    /// weights are fp8 already ([`crate::Software::fp8_params`]), none does.
    fn layer_gemm(&self, s: GemmShape, weights_batched: bool) -> f64 {
        let sw = &self.m.software;
        let weight_casts = match sw.fp8_weight_cache || sw.fp8_params {
            true => 0.0,
            false => gemm_weights(s, weights_batched),
        };
        let cast = (s.batch * s.m * s.k) as f64 + weight_casts;
        self.layer_gemm_casting(s, weights_batched, cast)
    }

    /// What casting one layer's GEMM weights to fp8 takes where the stack keeps the copies
    /// over a step ([`crate::Software::fp8_weight_cache`]): the first micro-batch's forward
    /// of each layer pays it, and that micro-batch passes through every virtual stage in
    /// turn before the pipeline fills, so the step pays it once per layer of the model (a
    /// rank's own layers as its work, the others' as a wait). Zero otherwise, and where the
    /// weights live in fp8 ([`crate::Software::fp8_params`]: the optimizer step writes them
    /// so, and no forward casts them).
    fn layer_weight_cast(&self) -> f64 {
        let sw = &self.m.software;
        if !self.plan.fp8 || !sw.fp8_weight_cache || sw.fp8_params {
            return 0.0;
        }
        let (attn, mlp) = self.layer_gemms();
        let c = &self.m.compute;
        attn.iter()
            .chain(mlp.iter())
            .map(|(_, s, batched)| {
                c.memory_time(
                    gemm_weights(*s, *batched) * c.fp8_cast_bytes_per_element,
                    self.cl(),
                )
            })
            .sum()
    }

    /// A GEMM of a transformer layer that first casts `cast` elements to fp8 under
    /// `dtype=fp8` (none: its operands were cast for an earlier GEMM, or it is a chunk of
    /// one whose casts the unsplit GEMM counts).
    fn layer_gemm_casting(&self, s: GemmShape, weights_batched: bool, cast: f64) -> f64 {
        if self.plan.fp8
            && let Some(t) =
                self.m
                    .compute
                    .fp8_gemm_time(s, cast, self.m.software.fp8_recipe, self.cl())
        {
            return t;
        }
        self.gemm(s, weights_batched)
    }

    fn mem(&self, bytes: f64) -> f64 {
        self.m.compute.memory_time(bytes, self.cl())
    }

    /// The pass after a micro-batch's backward that adds the 16-bit gradients of `params`
    /// parameters into their fp32 copies, where the profile runs one
    /// ([`crate::Software::fp32_grad_accumulation`]: bf16 training with ZeRO-0/1).
    fn fp32_grad_accumulation(&self, params: f64) -> f64 {
        match self.accumulates_in_fp32() && params > 0.0 {
            true => self.mem(params * FP32_GRAD_ACCUMULATION_BYTES),
            false => 0.0,
        }
    }

    /// Whether the profile adds each micro-batch's 16-bit gradients into fp32 copies after
    /// the backward: then both live at the end of every backward.
    fn accumulates_in_fp32(&self) -> bool {
        self.m.software.fp32_grad_accumulation
            && self.plan.dtype == DType::BF16
            && !self.plan.fp8
            && self.plan.zero_stage <= 1
    }

    /// What eager (unfused) execution adds to one layer's forward or backward: extra passes
    /// over the `[tokens, hidden]` activation and the launch gaps of the extra kernels, and
    /// the element-wise chains of a Llama-style model ([`EagerChain`]): two RMSNorms over
    /// the norm inputs, rotary positions over this rank's queries and keys, `repeat_kv` over
    /// its query-wide keys and values where heads share them, the gated activation over
    /// each gate. The chains' bytes are counted at 16-bit activations and scale with the
    /// element size.
    fn eager_overhead(&self, backward: bool) -> f64 {
        let c = &self.m.compute;
        if c.fusion != Fusion::Eager {
            return 0.0;
        }
        let pass = usize::from(backward);
        let mut bytes = c.eager_passes[pass] * self.act() * self.e;
        let mut kernels = c.eager_kernels[pass];
        // `count` applications of a chain, each over `elements`.
        let mut add = |chain: EagerChain, count: f64, elements: f64| {
            bytes += count * chain.bytes[pass] * self.e / 2.0 * elements;
            kernels += count * chain.kernels[pass];
        };
        let cfg = self.cfg;
        if cfg.rms_norm {
            add(EAGER_RMS_NORM, 2.0, self.act_sp());
        }
        let (q, kv) = self.query_key_elements();
        if !cfg.learned_positions {
            add(EAGER_ROTARY, 1.0, q + kv);
        }
        if cfg.kv_heads < cfg.heads {
            add(EAGER_REPEAT_KV, 1.0, 2.0 * q);
        }
        if cfg.gated_mlp {
            let (elements, _) = self.mlp_activation_shape();
            add(EAGER_GATE, 1.0, elements);
        }
        bytes / (self.cl().hbm_bandwidth() * c.memory_bandwidth_fraction)
            + kernels * c.kernel_overhead_s
    }

    /// Elements of this rank's queries and of its keys in one micro-batch (its heads of
    /// each, at least one key/value head where `tp` exceeds their number).
    fn query_key_elements(&self) -> (f64, f64) {
        let cfg = self.cfg;
        let per_token = |heads: usize| {
            (heads / self.plan.tp).max(1) as f64 * cfg.head_dim() as f64 * self.n as f64
        };
        (per_token(cfg.heads), per_token(cfg.kv_heads))
    }

    /// Rotary positions applied to this rank's queries and keys by one fused kernel (a read
    /// and a write of each, in the forward and again for their gradients in the backward):
    /// Transformer Engine's fused RoPE, which NeMo and Megatron-Bridge enable
    /// (`apply_rope_fusion`), or a compiled kernel. Nothing for learned positions, which are
    /// added once below the first layer.
    fn rotary(&self) -> f64 {
        if self.cfg.learned_positions {
            return 0.0;
        }
        let (q, kv) = self.query_key_elements();
        self.mem((q + kv) * 2.0 * self.e)
    }

    /// Elements of a `[tokens, h]` activation in the replicated regions of one rank.
    fn act(&self) -> f64 {
        (self.n * self.cfg.hidden as u64) as f64
    }

    fn act_sp(&self) -> f64 {
        if self.sp {
            self.act() / self.plan.tp as f64
        } else {
            self.act()
        }
    }

    /// The tensor-parallel collective after a row-parallel GEMM (all-reduce, or
    /// reduce-scatter with sequence parallelism); its conjugate before a column-parallel GEMM
    /// costs the same (all-gather) or nothing.
    fn tp_comm(&self) -> f64 {
        let bytes = self.act() * self.e;
        if self.sp {
            self.coll(Collective::ReduceScatter, bytes, &self.tp)
        } else {
            self.coll(Collective::AllReduce, bytes, &self.tp)
        }
    }

    fn tp_gather(&self) -> f64 {
        self.coll(Collective::AllGather, self.act() * self.e, &self.tp)
    }

    /// One tensor-parallel collective of a layer ([`tp_collectives`]), in seconds.
    fn tp_collective(&self, c: &TpCollective) -> f64 {
        self.coll(c.kind, self.tp_collective_bytes(c), &self.tp)
    }

    /// The bytes of one tensor-parallel collective of a layer, in nccl-tests' convention.
    fn tp_collective_bytes(&self, c: &TpCollective) -> f64 {
        let cfg = self.cfg;
        let d = cfg.head_dim() as f64;
        let width = match c.width {
            Width::Hidden => cfg.hidden as f64,
            Width::Qkv => (cfg.heads + 2 * cfg.kv_heads) as f64 * d,
            Width::Query | Width::AttentionOut => cfg.heads as f64 * d,
            Width::KeyValue => 2.0 * cfg.kv_heads as f64 * d,
            Width::Ffn => cfg.ffn as f64,
        };
        // fp8 all-gathers move a byte per element ([`Software::fp8_tp_gather`]).
        let e =
            match c.kind == Collective::AllGather && self.plan.fp8 && self.m.software.fp8_tp_gather
            {
                true => 1.0,
                false => self.e,
            };
        let mut bytes = self.n as f64 * width * e;
        if c.kind == Collective::AllToAll {
            // The send buffer: this rank's share.
            bytes /= self.plan.tp as f64;
        }
        bytes
    }

    /// The layer's tensor-parallel collectives of one pass (none without `tp`), each with
    /// whether it belongs to the MLP block.
    fn layer_tp_collectives(&self, pass: Pass) -> Vec<(TpCollective, bool)> {
        if self.plan.tp <= 1 {
            return Vec::new();
        }
        let l = tp_collectives_unexplained(&self.plan.layer, self.sp);
        let mlp_from = attention_block_collectives(&self.plan.layer, self.sp);
        l.into_iter()
            .enumerate()
            .filter(|(_, c)| c.pass == pass)
            .map(|(i, c)| (c, i >= mlp_from))
            .collect()
    }

    /// The layer's tensor-parallel collectives with the reason of each, the forward's first.
    fn explained_tp_collectives(&self) -> Vec<TpCollective> {
        if self.plan.tp <= 1 {
            return Vec::new();
        }
        let mut l = tp_collectives(&self.plan.layer, self.sp);
        l.sort_by_key(|c| c.pass == Pass::Backward);
        l
    }

    fn placed_on_sequence(&self, op: LayerOp) -> bool {
        self.plan.layer.get(op) == OpPlacement::Sequence
    }

    /// The GEMMs of one layer's forward, as (shape, weights batched), in order: QKV,
    /// projection, MLP in, MLP out (MoE: router, then expert GEMMs batched over local
    /// experts), each with the placed op it belongs to. An op split over `tp` computes all
    /// tokens on its share of the features; one on sequence shards computes its tokens
    /// (`n / tp`) on every feature.
    fn layer_gemms(&self) -> (GemmList, GemmList) {
        let c = self.cfg;
        let t = self.plan.tp as u64;
        let (h, d) = (c.hidden as u64, c.head_dim() as u64);
        let (a, kv) = (c.heads as u64, c.kv_heads as u64);
        let a_t = a / t;
        let kv_t = (kv / t).max(1);
        let f_t = c.ffn as u64 / t;
        let n_t = self.n / t;
        let gate = if c.gated_mlp { 2 } else { 1 };
        let seq = |op| self.placed_on_sequence(op);
        let qkv = if seq(LayerOp::Qkv) {
            GemmShape::new(1, n_t, (a + 2 * kv) * d, h)
        } else {
            GemmShape::new(1, self.n, (a_t + 2 * kv_t) * d, h)
        };
        let proj = if seq(LayerOp::Proj) {
            GemmShape::new(1, n_t, h, a * d)
        } else {
            GemmShape::new(1, self.n, h, a_t * d)
        };
        let attn = vec![
            (Some(LayerOp::Qkv), qkv, false),
            (Some(LayerOp::Proj), proj, false),
        ];
        let mlp = if c.experts > 1 {
            let local = (c.experts / self.plan.ep) as u64;
            // Balanced routing: each rank's experts receive n * top_k tokens in all. First
            // order: capacity factor 1. The zoo routes each sequence as a group with
            // ceil(cf * s * top_k / e) slots per expert, so the programs compute (and move)
            // about cf times these tokens, padding included; the estimate counts the tokens.
            // The all-to-all moves the tokens between ranks of `ep`, which splits the
            // sequences (groups) like `dp`, so per-rank sizes are those of `n`.
            // With expert tensor parallelism below `tp` each group of `etp` ranks takes its
            // share of the tokens (`etp / tp`) on wider expert shards (`f / etp`).
            let etp = self.plan.expert_tp() as u64;
            let f_e = c.ffn as u64 / etp;
            let routed = self.n * c.top_k as u64 * etp / t;
            let per_expert = routed.div_ceil(local);
            // The router's GEMM is priced by `mlp_block` itself: it runs on the rank's
            // sequence shard, or replicated over `tp`.
            let mut gemms = vec![
                (
                    Some(LayerOp::MlpIn),
                    GemmShape::new(local, per_expert, gate * f_e, h),
                    true,
                ),
                (
                    Some(LayerOp::MlpOut),
                    GemmShape::new(local, per_expert, h, f_e),
                    true,
                ),
            ];
            // The shared expert: a dense MLP on every token, split over `tp` as the experts'
            // block is placed (its input gathered and its output reduced with theirs).
            if c.shared_ffn > 0 {
                let f_s = c.shared_ffn as u64 / t;
                gemms.push((None, GemmShape::new(1, self.n, gate * f_s, h), false));
                gemms.push((None, GemmShape::new(1, self.n, h, f_s), false));
            }
            gemms
        } else {
            let f = c.ffn as u64;
            let mlp_in = if seq(LayerOp::MlpIn) {
                GemmShape::new(1, n_t, gate * f, h)
            } else {
                GemmShape::new(1, self.n, gate * f_t, h)
            };
            let mlp_out = if seq(LayerOp::MlpOut) {
                GemmShape::new(1, n_t, h, f)
            } else {
                GemmShape::new(1, self.n, h, f_t)
            };
            vec![
                (Some(LayerOp::MlpIn), mlp_in, false),
                (Some(LayerOp::MlpOut), mlp_out, false),
            ]
        };
        (attn, mlp)
    }

    /// The attention core of one rank: (batch x query heads, queries, keys, head dim, key/value
    /// heads per sequence). Split by heads over `tp`, or on the local queries against every
    /// key with all heads; the sequence is then in a load-balanced order (each rank holds a
    /// chunk from each end, as context parallelism lays it out), so every rank does the same
    /// share of the causal work.
    fn core_shape(&self) -> (u64, u64, u64, u64, u64) {
        let c = self.cfg;
        let b = self.plan.micro_batch_size as u64;
        let s = (c.seq / self.plan.cp) as u64;
        let (t, d) = (c.seq as u64, c.head_dim() as u64);
        if self.placed_on_sequence(LayerOp::Attention) {
            (
                b * c.heads as u64,
                s / self.plan.tp as u64,
                t,
                d,
                c.kv_heads as u64,
            )
        } else {
            let kv = (c.kv_heads / self.plan.tp).max(1) as u64;
            (b * (c.heads / self.plan.tp) as u64, s, t, d, kv)
        }
    }

    /// Keys one call of the attention kernel attends over: the sequence, or under ring
    /// context parallelism the chunk each ring step brings (all of them where they are
    /// gathered first, [`crate::CpAttention::AllGather`]).
    fn attention_keys_per_call(&self) -> f64 {
        match self.m.software.cp_attention {
            CpAttention::AllGather => self.cfg.seq as f64,
            CpAttention::Ring | CpAttention::EagerRing => {
                (self.cfg.seq / self.plan.cp.max(1)) as f64
            }
        }
    }

    /// Attention core forward (scores, softmax, dropout, weighted sum) and its FLOPs.
    fn attention_forward(&self) -> (f64, f64) {
        let b = self.plan.micro_batch_size as u64;
        let (heads, s, t, d, kv) = self.core_shape();
        let full = 4.0 * (heads * s * t * d) as f64;
        match self.m.compute.attention {
            AttentionKernel::Unfused => (
                self.m.compute.unfused_attention_forward(
                    AttentionShape {
                        heads,
                        s,
                        t,
                        d,
                        dv: d,
                    },
                    self.plan.dtype,
                    self.cl(),
                    self.m.software.dropout,
                ),
                full,
            ),
            AttentionKernel::Flash | AttentionKernel::Flash1 | AttentionKernel::Fused => {
                let flops = full * 0.5;
                let io = ((2 * heads * s * d) + 2 * b * kv * t * d) as f64 * self.e;
                (
                    self.m.compute.flash_time(
                        flops,
                        io,
                        self.plan.dtype,
                        self.cl(),
                        false,
                        self.attention_keys_per_call(),
                        true,
                    ),
                    flops,
                )
            }
        }
    }

    fn attention_backward(&self) -> f64 {
        let (heads, s, t, d, _) = self.core_shape();
        match self.m.compute.attention {
            AttentionKernel::Unfused => {
                let scores = (heads * s * t) as f64;
                self.gemm(GemmShape::new(heads, s, d, t), true)
                    + self.gemm(GemmShape::new(heads, t, d, s), true)
                    + self.gemm(GemmShape::new(heads, s, t, d), true)
                    + self.gemm(GemmShape::new(heads, t, d, s), true)
                    // The dropout's backward (with dropout), then the softmax's.
                    + match self.m.software.dropout {
                        true => self
                            .m
                            .compute
                            .score_memory_time(scores * (2.0 * self.e + 1.0), self.cl()),
                        false => 0.0,
                    }
                    + self
                        .m
                        .compute
                        .score_memory_time(scores * 3.0 * self.e, self.cl())
            }
            AttentionKernel::Flash | AttentionKernel::Flash1 | AttentionKernel::Fused => {
                // The backward recomputes the scores: 2.5x the forward FLOPs.
                let flops = 2.0 * (heads * s * t * d) as f64 * 2.5;
                let io = (4 * heads * s * d) as f64 * self.e * 2.0;
                self.m.compute.flash_time(
                    flops,
                    io,
                    self.plan.dtype,
                    self.cl(),
                    true,
                    self.attention_keys_per_call(),
                    true,
                )
            }
        }
    }

    /// What merging the ring steps of context-parallel attention moves in one pass: `cp`
    /// steps of the software's [`crate::CpAttention`] over this rank's queries and keys
    /// (nothing where the keys and values are gathered and nothing merges).
    fn ring_merge(&self, backward: bool) -> f64 {
        let (per_query, per_key) =
            self.m.software.cp_attention.bytes_per_step()[usize::from(backward)];
        if self.plan.cp <= 1 || per_query + per_key == 0.0 {
            return 0.0;
        }
        let (q, kv) = self.query_key_elements();
        self.plan.cp as f64 * self.mem((per_query * q + per_key * kv) * self.e / 2.0)
    }

    /// The context-parallel exchange of one layer's keys and values in its forward or
    /// backward beside `attention` seconds of attention, as (issued, exposed) seconds.
    ///
    /// Transformer Engine's ring (and Llama 3's gather) passes each step's keys and values
    /// under the step before, so the exchange hides under the whole attention (twice the
    /// traffic in the backward, the key and value gradients travelling too). PyTorch's
    /// `context_parallel` as torchtitan ran it ([`crate::CpAttention::EagerRing`], rotate
    /// method `allgather`, torchtitan's default) all-gathers the query-wide keys and values
    /// once, after issuing the first step's attention, which is all the gather hides under
    /// (`_AllGatherRotater`); its backward gathers them again the same way and passes the
    /// fp32 key and value gradients around the ring, one step's shard at a time, each under
    /// its step (`_templated_ring_attention_backward`, `dkv_rotater`).
    fn cp_exchange(&self, backward: bool, attention: f64) -> (f64, f64) {
        if self.plan.cp <= 1 {
            return (0.0, 0.0);
        }
        let comm = &self.m.comm;
        match self.m.software.cp_attention {
            CpAttention::EagerRing => {
                let cp = self.plan.cp as f64;
                let (queries, _) = self.query_key_elements();
                let step = attention / cp;
                let gather =
                    self.coll(Collective::AllGather, cp * 2.0 * queries * self.e, &self.cp);
                let (mut issued, mut exposed) = (gather, comm.exposed(gather, step));
                if backward {
                    let pass = self.coll(Collective::SendRecv, 2.0 * queries * 4.0, &self.cp);
                    issued += (cp - 1.0) * pass;
                    exposed += (cp - 1.0) * comm.exposed(pass, step);
                }
                (issued, exposed)
            }
            CpAttention::Ring | CpAttention::AllGather => {
                let t = self.cp_comm() * if backward { 2.0 } else { 1.0 };
                (t, comm.exposed(t, attention))
            }
        }
    }

    /// Context-parallel exchange of K and V around the ring, for the whole sequence.
    fn cp_comm(&self) -> f64 {
        let c = self.cfg;
        let kv = (c.kv_heads / self.plan.tp).max(1) as f64;
        let bytes =
            2.0 * (self.plan.micro_batch_size * c.seq) as f64 * kv * c.head_dim() as f64 * self.e;
        self.coll(Collective::AllGather, bytes, &self.cp)
    }

    /// One all-to-all of a MoE layer over `ep` (dispatch or combine): the rank's routed
    /// tokens, `top_k` copies of its activations (capacity factor 1, as in the GEMMs).
    ///
    /// With expert tensor parallelism below `tp` (which needs sequence parallelism) the
    /// rank dispatches its sequence shard, `1/tp` of the tokens, as Megatron-Core's
    /// all-to-all dispatcher does before it gathers the received tokens over `etp`
    /// (`MoEAlltoAllTokenDispatcher`: all-to-all over the expert-parallel group, then
    /// all-gather over the expert tensor-parallel group; the reverse to combine).
    fn moe_all_to_all(&self) -> f64 {
        if self.cfg.experts <= 1 {
            return 0.0;
        }
        let mut bytes = self.act() * self.cfg.top_k as f64 * self.e;
        if self.expert_tp_below_tp() {
            bytes /= self.plan.tp as f64;
        }
        self.coll(Collective::AllToAll, bytes, &self.ep)
    }

    /// Whether the experts are split over fewer ranks than the rest of the layer.
    fn expert_tp_below_tp(&self) -> bool {
        self.cfg.experts > 1 && self.plan.expert_tp() < self.plan.tp
    }

    /// One collective of the layer in seconds: the attention block's and a dense MLP's
    /// over `tp`; a MoE block's, with expert tensor parallelism below `tp`, over the `etp`
    /// group on the routed tokens its ranks share (the all-gather of the dispatched tokens
    /// before the experts and the reduce-scatter after them, and their conjugates in the
    /// backward: `top_k * etp / tp` of the tokens instead of all of them).
    fn layer_tp_collective(&self, c: &TpCollective, moe_block: bool) -> f64 {
        match self.experts_tp_share(moe_block) {
            Some(share) => self.coll(c.kind, self.tp_collective_bytes(c) * share, &self.etp),
            None => self.tp_collective(c),
        }
    }

    /// The share of a collective's tokens that a MoE block's collective moves over the `etp`
    /// group (`top_k * etp / tp`), where the experts are split over fewer ranks than the rest
    /// of the layer; `None` for the attention block's, a dense MLP's, or without `etp < tp`.
    fn experts_tp_share(&self, moe_block: bool) -> Option<f64> {
        (moe_block && self.expert_tp_below_tp())
            .then(|| self.cfg.top_k as f64 * self.plan.expert_tp() as f64 / self.plan.tp as f64)
    }

    /// The copies that move the sequence dimension around a tensor-parallel collective
    /// where the stack's collectives gather and scatter along another dimension
    /// ([`Software::tp_relayout_copies`]): an all-gather's output rewritten whole, a
    /// reduce-scatter's input; under micro-pipelined TP (`pipelined`) the local shard
    /// restrided before the gather, and the peers' partial products summed after the scatter.
    fn tp_relayout(&self, c: &TpCollective, moe_block: bool, pipelined: bool) -> f64 {
        if !self.m.software.tp_relayout_copies {
            return 0.0;
        }
        let whole = self.tp_collective_bytes(c) * self.experts_tp_share(moe_block).unwrap_or(1.0);
        let shard = whole / self.plan.tp as f64;
        match (c.kind, pipelined) {
            (Collective::AllGather, false) | (Collective::ReduceScatter, false) => {
                self.mem(2.0 * whole)
            }
            (Collective::AllGather, true) => self.mem(2.0 * shard),
            (Collective::ReduceScatter, true) => self.mem(whole + shard),
            _ => 0.0,
        }
    }

    fn layer_params_per_rank(&self) -> f64 {
        layer_params_per_rank(self.cfg, self.plan)
    }

    /// The embedding's parameters on a rank of the first stage (the vocabulary split over
    /// `tp`, learned positions with it).
    fn embedding_params_per_rank(&self) -> f64 {
        self.cfg.embedding_params() as f64 / self.plan.tp as f64
    }

    /// The output layer's weight on a rank of the last stage (the vocabulary split over
    /// `tp`), and whether that rank holds it as a weight of its own, with its own gradient:
    /// untied, or tied under pipelining (a copy of the first stage's embedding); a tied head
    /// without pipelining is the embedding itself.
    fn head_weight_per_rank(&self) -> (f64, bool) {
        let c = self.cfg;
        let own = !c.tied_embeddings || self.plan.pp > 1;
        ((c.vocab * c.hidden) as f64 / self.plan.tp as f64, own)
    }

    /// One collective per kind of parameter of one layer, `bytes` per parameter: the dense
    /// ones over every data-parallel rank sharing their ZeRO state, the experts' over the
    /// ranks that hold the same experts.
    fn layer_zero_collective(&self, c: Collective, bytes: f64) -> f64 {
        let expert = expert_params_per_layer(self.cfg, self.plan);
        let dense = self.layer_params_per_rank() - expert;
        self.zero_collective(c, dense * bytes, expert * bytes)
    }

    /// Parameters of one layer on this rank that are not experts'.
    fn layer_dense_params(&self) -> f64 {
        self.layer_params_per_rank() - expert_params_per_layer(self.cfg, self.plan)
    }

    /// The data-parallel gradient all-reduces of a rank as the compiler's buckets of `mb`
    /// MiB ([`crate::buckets`]) over the dense gradients of `spans` (in any order), each
    /// `(ready, duration)` with its own latency; what a layer's reduction `layer_reduce`
    /// holds besides its dense gradients (the experts', over their own group, and the
    /// weights replicated over `tp`) stays one collective per layer, ready with the layer
    /// (at `layer_ends`).
    fn sized_buckets(
        &self,
        mut spans: Vec<GradientSpan>,
        layer_ends: &[f64],
        mb: f64,
        layer_reduce: f64,
        grad_bytes: f64,
    ) -> Vec<(f64, f64)> {
        spans.sort_by(|a, b| a.end.total_cmp(&b.end));
        let dense_layer = self.zero_collective(
            Collective::AllReduce,
            self.layer_dense_params() * grad_bytes,
            0.0,
        );
        let rest = (layer_reduce - dense_layer).max(0.0);
        let mut out: Vec<(f64, f64)> = gradient_buckets(&spans, mb * f64::from(1u32 << 20))
            .into_iter()
            .map(|b| {
                (
                    b.ready,
                    self.zero_collective(Collective::AllReduce, b.bytes, 0.0),
                )
            })
            .collect();
        if rest > 0.0 {
            out.extend(layer_ends.iter().map(|&end| (end, rest)));
        }
        out
    }

    /// `c` over the dense parameters' ZeRO group for `dense` bytes and over the experts' for
    /// `expert` bytes.
    fn zero_collective(&self, c: Collective, dense: f64, expert: f64) -> f64 {
        let mut t = self.coll(c, dense, &self.dp);
        if expert > 0.0 {
            t += self.coll(c, expert, &self.dp_expert);
        }
        t
    }

    /// Bytes per layer weight that a ZeRO gather moves: a byte where the weights live in fp8
    /// ([`crate::Software::fp8_params`] under `dtype=fp8`), the compute dtype's otherwise.
    fn gathered_weight_bytes(&self) -> f64 {
        match self.plan.fp8 && self.m.software.fp8_params {
            true => 1.0,
            false => self.e,
        }
    }

    /// ZeRO-3 all-gather of one layer's weights in one pass, cut as the software cuts it.
    fn zero3_gather_pass(&self) -> f64 {
        if self.plan.zero_stage < 3 {
            return 0.0;
        }
        self.zero3_collective(Collective::AllGather, self.gathered_weight_bytes())
    }

    /// `c` over one layer's ZeRO-3 state at `bytes` per parameter, cut into collectives as the
    /// software does: one for the layer, or one per weight tensor (the same bytes, a latency
    /// per tensor, and for gathers the list all-gather's work, [`GatherUnit::Tensor`]).
    fn zero3_collective(&self, c: Collective, bytes: f64) -> f64 {
        match self.m.software.param_gather {
            GatherUnit::Layer => self.layer_zero_collective(c, bytes),
            GatherUnit::Tensor => {
                let tensors = layer_weight_tensors(self.cfg) as f64;
                let mut t = tensors * self.layer_zero_collective(c, bytes / tensors);
                if c == Collective::AllGather {
                    // Each tensor's gather zero-fills its full buffer, receives it through a
                    // flat copy and copies it out one rank's view at a time.
                    let gathered = self.layer_params_per_rank() * bytes;
                    let ranks = self.shards.dense.max(1.0);
                    t += self.mem(3.0 * gathered)
                        + tensors * ranks * self.m.compute.kernel_overhead_s;
                }
                t
            }
        }
    }

    /// Exposed time of the ZeRO-3 collectives `z3` of a pass whose own work is `under`,
    /// `gemm_share` of it GEMMs: hidden under it when the software prefetches them, on the
    /// critical path otherwise; and, of that, the GEMMs' second waves
    /// ([`Ctx::nccl_exposed`]).
    fn zero3_exposed(&self, z3: f64, under: f64, gemm_share: f64) -> (f64, f64) {
        match self.m.software.overlap_param_gather {
            true => self.nccl_exposed(z3, under, gemm_share),
            false => (z3, 0.0),
        }
    }

    /// Exposed time of `comm` seconds of NCCL collectives beside `under` seconds of
    /// computation, `gemm_share` of it GEMMs ([`CommParams::exposed_beside`]): the GEMMs
    /// are split into two waves where they are persistent and the software leaves them
    /// every SM. Also returns what those second waves add
    /// ([`PassTime::second_wave_s`]).
    fn nccl_exposed(&self, comm: f64, under: f64, gemm_share: f64) -> (f64, f64) {
        let persistent = self.cl().gpu.arch.persistent_gemms() && !self.m.software.sm_carveout;
        let c = &self.m.comm;
        let exposed = c.exposed_beside(comm, under, gemm_share, persistent);
        (exposed, exposed - c.exposed(comm, under))
    }

    /// A collective's `(exposed, second wave)` beside a pass `p` whose other collectives
    /// already cost `p.second_wave_s` of second waves: a persistent GEMM spills its
    /// displaced tiles into one second wave however many collectives take its SMs, so the
    /// waves of a pass stay within its GEMMs' time (times
    /// [`CommParams::persistent_gemm_slowdown`]), and what would exceed that is not exposed.
    fn within_wave_budget(&self, p: &PassTime, (exposed, wave): (f64, f64)) -> (f64, f64) {
        let budget = self.m.comm.persistent_gemm_slowdown * p.gemm_s - p.second_wave_s;
        let cut = (wave - budget.max(0.0)).max(0.0);
        (exposed - cut, wave - cut)
    }

    /// The one-byte mask a dropout writes per element in the forward and its backward reads
    /// ([`crate::Software::dropout`]); none without dropout.
    fn dropout_mask_bytes(&self) -> f64 {
        f64::from(self.m.software.dropout)
    }

    /// Host-device copy of `bytes` over this rank's share of its PCIe link (CPU offload);
    /// zero without a `[host]`, which [`CostModel::check_plan`] refuses for offloading plans.
    fn pcie(&self, bytes: f64) -> f64 {
        self.cl()
            .pcie_bandwidth_per_gpu()
            .map_or(0.0, |bw| bytes / bw)
    }

    /// Parameters of one layer in this rank's ZeRO shard (dense over their shards, the
    /// experts' over theirs).
    fn layer_shard_params(&self) -> f64 {
        let expert = expert_params_per_layer(self.cfg, self.plan);
        self.layer_dense_params() / self.shards.dense + expert / self.shards.expert
    }

    /// The copy of one layer's offloaded fp32 parameter shard to the GPU before its gather
    /// (`offload=params`: FSDP copies the CPU shard up, then casts and gathers it).
    fn offloaded_param_copy(&self) -> f64 {
        match self.plan.offload {
            Offload::Params => self.pcie(self.layer_shard_params() * 4.0),
            Offload::None | Offload::Optimizer => 0.0,
        }
    }

    /// The copy of one layer's reduced gradient shard to the host, each micro-batch
    /// (DeepSpeed's ZeRO-2 offload accumulates gradients on the CPU, FSDP's CPU offload
    /// moves each reduce-scattered shard there), in the reduce-scatter's dtype.
    fn offloaded_grad_copy(&self) -> f64 {
        match self.plan.offload {
            Offload::None => 0.0,
            Offload::Optimizer | Offload::Params => {
                self.pcie(self.layer_shard_params() * self.m.software.reduce_bytes)
            }
        }
    }

    /// What the MLP's element-wise kernels touch per layer: the local MLP width times the
    /// tokens (`f/t * n`) times the experts each token visits, plus the shared expert's
    /// width times the tokens; and the gate factor (2 for gated MLPs).
    fn mlp_activation_shape(&self) -> (f64, f64) {
        let t = self.plan.tp;
        let topk = if self.cfg.experts > 1 {
            self.cfg.top_k as f64
        } else {
            1.0
        };
        let width = (self.cfg.ffn / t) as f64 * topk + (self.cfg.shared_ffn / t) as f64;
        let gate = if self.cfg.gated_mlp { 2.0 } else { 1.0 };
        (width * self.n as f64, gate)
    }

    /// Exposed time of a tensor-parallel collective of `t` seconds pipelined chunk by chunk
    /// of tokens with the GEMM `s`, as Transformer Engine's userbuffers run them
    /// (`--tp-comm-overlap`; `transformer_engine/pytorch/module/base.py`, `initialize_ub`):
    /// an all-gather (`gather`) as a ring exchange in `tp` steps, each GEMM chunk computed on
    /// the rows that have arrived while the next arrive, the local rows first; a
    /// reduce-scatter after its GEMM in [`PIPELINED_RS_SPLITS`] chunks, each reduced while the
    /// next is computed, the last one's reduction exposed. The chunks are GEMMs of their own,
    /// so a split that leaves too few tiles for the SMs costs GEMM time as well; and the
    /// computation runs [`CommParams::overlap_slowdown`] slower while communication shares
    /// the device. What is returned is the pipeline's time beyond the unsplit GEMM, which the
    /// pass already counts.
    fn pipelined(&self, t: f64, s: GemmShape, batched: bool, gather: bool) -> f64 {
        let chunks = match gather {
            true => self.plan.tp as u64,
            false => PIPELINED_RS_SPLITS,
        }
        .clamp(1, s.m.max(1));
        // The casts come before the pipeline and are the same split or not.
        let whole = self.layer_gemm_casting(s, batched, 0.0);
        let chunk = self.layer_gemm_casting(
            GemmShape::new(s.batch, s.m.div_ceil(chunks), s.n, s.k),
            batched,
            0.0,
        );
        let c = t / chunks as f64;
        let steps = (chunks - 1) as f64;
        let pipeline = match gather {
            true => steps * chunk.max(c) + chunk,
            false => chunk + steps * chunk.max(c) + c,
        };
        let slowdown = self.m.comm.overlap_slowdown * steps * chunk.min(c);
        (pipeline + slowdown - whole).max(0.0)
    }

    /// The input- and weight-gradient GEMMs of a forward GEMM. Under `dtype=fp8` the
    /// output gradient is cast (with its transposed copy) before the input-gradient GEMM;
    /// the weight-gradient GEMM reads the transposed copies of it and of the forward input.
    fn gemm_grads(&self, s: &GemmShape, batched: bool) -> (f64, f64) {
        let grad_output = (s.batch * s.m * s.n) as f64;
        (
            self.layer_gemm_casting(GemmShape::new(s.batch, s.m, s.k, s.n), batched, grad_output),
            self.layer_gemm_casting(GemmShape::new(s.batch, s.k, s.n, s.m), batched, 0.0),
        )
    }

    /// The MLP block of one layer in one pass, without the tensor-parallel collectives
    /// that bring its input and take its output ([`Ctx::layer_tp_collectives`]): its GEMMs
    /// (`mlp`, from [`Ctx::layer_gemms`]: a dense MLP's two, or a MoE's router and grouped
    /// expert GEMMs), the activation between them, and for a mixture of experts the
    /// router's softmax and top-k, the permutation of the routed tokens and its inverse, and
    /// the dispatch and combine all-to-alls over `ep`. Returns the time, the dgrad and wgrad
    /// of each placed op (backward) and the FLOPs (forward).
    ///
    /// Permutation as Megatron-Core's fused `permute`/`unpermute` (`moe_utils.py`): one read
    /// of the rank's tokens and one write of their `top_k` copies grouped by expert, the
    /// reverse (with the routing-weighted sum) after the experts; with more than one local
    /// expert the all-to-all dispatcher also sorts the received chunks by expert and back
    /// (`sort_chunks_by_idxs`), a read and a write of the routed tokens each. The backward
    /// moves the same bytes. The router's fp32 logits are read and written by the softmax
    /// and read by the top-k.
    fn mlp_block(&self, mlp: &GemmList, pass: Pass) -> (PassTime, Vec<(LayerOp, f64, f64)>, f64) {
        let mut p = PassTime::default();
        let mut grads = Vec::new();
        let mut flops = 0.0;
        if self.cfg.experts > 1 {
            // The router: the block's input onto the experts' logits. Under sequence
            // parallelism Megatron-Core routes the rank's sequence shard; otherwise every
            // tensor-parallel rank routes all its tokens, the same work `tp` times, which the
            // model's FLOPs count once.
            let t = self.plan.tp as u64;
            let (tokens, copies) = match self.sp {
                true => (self.n / t, 1.0),
                false => (self.n, t as f64),
            };
            let router = GemmShape::new(1, tokens, self.cfg.experts as u64, self.cfg.hidden as u64);
            match pass {
                Pass::Forward => {
                    p.gemm_s += self.layer_gemm(router, false);
                    flops += router.flops() / copies;
                }
                Pass::Backward => {
                    let (dgrad, wgrad) = self.gemm_grads(&router, false);
                    p.gemm_s += dgrad + wgrad;
                }
            }
        }
        for (op, s, batched) in mlp {
            match pass {
                Pass::Forward => {
                    p.gemm_s += self.layer_gemm(*s, *batched);
                    flops += s.flops();
                }
                Pass::Backward => {
                    let (dgrad, wgrad) = self.gemm_grads(s, *batched);
                    p.gemm_s += dgrad + wgrad;
                    if let Some(op) = op {
                        grads.push((*op, dgrad, wgrad));
                    }
                }
            }
        }
        let e = self.e;
        let (elements, gate) = self.mlp_activation_shape();
        // The activation: reads its input(s) and writes its output; the backward also reads
        // the output gradient.
        let passes = match pass {
            Pass::Forward => gate + 1.0,
            Pass::Backward => gate + 2.0,
        };
        p.memory_s += self.mem(elements * passes * e);
        if self.cfg.experts > 1 {
            let mut tokens = self.n as f64;
            if self.expert_tp_below_tp() {
                tokens /= self.plan.tp as f64;
            }
            let (h, k) = (self.cfg.hidden as f64, self.cfg.top_k as f64);
            let permute = (tokens * h + tokens * k * h) * e;
            let local = self.cfg.experts / self.plan.ep.max(1);
            let sort = if local > 1 && self.plan.ep > 1 {
                2.0 * tokens * k * h * e
            } else {
                0.0
            };
            let router = tokens * self.cfg.experts as f64 * 4.0 * 3.0;
            p.memory_s += 2.0 * self.mem(permute) + 2.0 * self.mem(sort) + self.mem(router);
            p.exposed(CommKind::Expert, 2.0 * self.moe_all_to_all());
        }
        (p, grads, flops)
    }

    /// Whether the software's split GEMMs carry the tensor-parallel collectives of a block
    /// of the layer (Transformer Engine's userbuffers under `--tp-comm-overlap`, or torch's
    /// async TP): those of the attention block and of a dense MLP. A mixture of experts'
    /// grouped GEMMs cannot be split for them (Transformer Engine's `GroupedLinear` takes no
    /// userbuffers options and clears every one in its context), so the gathers and
    /// reductions of an MoE block stay NCCL's, as without the overlap.
    fn userbuffers(&self, mlp_block: bool) -> bool {
        self.m.comm.overlap_tp_forward && !(mlp_block && self.cfg.experts > 1)
    }

    /// Whether a forward tensor-parallel collective of the attention (`mlp_block` false)
    /// or MLP block is pipelined with its GEMM ([`Ctx::userbuffers`]).
    fn fprop_pipelined(&self, c: &TpCollective, mlp_block: bool) -> bool {
        matches!(c.overlap, Overlap::PipelinedFprop(_)) && self.userbuffers(mlp_block)
    }

    /// One forward tensor-parallel collective of the layer: its time and the part of it
    /// exposed (with `--tp-comm-overlap` the sequence-parallel gathers and reduce-scatters
    /// are pipelined with the GEMM they feed or follow, among `shapes`).
    fn forward_tp_collective(
        &self,
        c: &TpCollective,
        mlp_block: bool,
        shapes: &[&(Option<LayerOp>, GemmShape, bool)],
    ) -> (f64, f64) {
        let t = self.layer_tp_collective(c, mlp_block);
        let gemm = match c.overlap {
            Overlap::PipelinedFprop(op) if self.fprop_pipelined(c, mlp_block) => {
                shapes.iter().find(|g| g.0 == Some(op)).map(|g| (g.1, g.2))
            }
            _ => None,
        };
        match gemm {
            Some((s, batched)) => {
                let gather = c.kind == Collective::AllGather;
                (t, self.pipelined(t, s, batched, gather))
            }
            None => (t, t),
        }
    }

    /// What a full recomputation that stops early ([`Software::recompute_early_stop`]) does
    /// not run again of a dense layer's forward: the MLP's output GEMM, the reduction of
    /// its partial sums over `tp` where one follows it, and the residual add, as (their
    /// times, the GEMM's FLOPs, its weights' share of the layer's on the rank); nothing for
    /// an MoE layer or a profile that replays the whole forward.
    fn early_stop_skips(&self) -> (PassTime, f64, f64) {
        let mut p = PassTime::default();
        if !self.m.software.recompute_early_stop || self.cfg.experts > 1 {
            return (p, 0.0, 0.0);
        }
        let (attn, mlp) = self.layer_gemms();
        let Some(out) = mlp.iter().find(|g| g.0 == Some(LayerOp::MlpOut)) else {
            return (p, 0.0, 0.0);
        };
        let weights = (out.1.batch * out.1.n * out.1.k) as f64;
        let weight_share = (weights / self.layer_params_per_rank().max(1.0)).min(1.0);
        p.gemm_s += self.layer_gemm(out.1, out.2);
        p.memory_s += self.mem(self.act_sp() * (3.0 * self.e + self.dropout_mask_bytes()));
        let shapes: Vec<_> = attn.iter().chain(mlp.iter()).collect();
        if let Some((c, true)) = self.layer_tp_collectives(Pass::Forward).last()
            && c.kind != Collective::AllGather
        {
            let (t, exposed) = self.forward_tp_collective(c, true, &shapes);
            p.overlapped(CommKind::Tensor, t, exposed);
            p.memory_s += self.tp_relayout(c, true, self.fprop_pipelined(c, true));
        }
        (p, out.1.flops(), weight_share)
    }

    /// A layer's forward for one micro-batch, its ZeRO-3 gather included, and its FLOPs.
    fn layer_forward(&self) -> (PassTime, f64) {
        let (mut p, flops) = self.layer_forward_work();
        self.add_forward_zero(&mut p, 1.0);
        (p, flops)
    }

    /// A layer's forward but its ZeRO-3 gather, and its FLOPs.
    fn layer_forward_work(&self) -> (PassTime, f64) {
        let mut p = PassTime::default();
        let (attn, mlp) = self.layer_gemms();
        let act_sp = self.act_sp();
        let e = self.e;
        // Two layer norms, two bias-dropout-residual adds, rotary positions; the MLP
        // block's own work.
        p.memory_s += 2.0 * self.mem(act_sp * 2.0 * e)
            + 2.0 * self.mem(act_sp * (3.0 * e + self.dropout_mask_bytes()))
            + self.rotary()
            + self.eager_overhead(false);
        let mut flops = 0.0;
        for (_, s, batched) in &attn {
            p.gemm_s += self.layer_gemm(*s, *batched);
            flops += s.flops();
        }
        let (block, _, block_flops) = self.mlp_block(&mlp, Pass::Forward);
        p.add(&block);
        flops += block_flops;
        let (t_attn, f_attn) = self.attention_forward();
        p.attention_s += t_attn;
        flops += f_attn;
        // What converts the layouts between the placed ops (Megatron: one gather and one
        // reduction per block). With `--tp-comm-overlap` the sequence-parallel gathers and
        // reduce-scatters are pipelined with the GEMM they feed or follow.
        let shapes: Vec<_> = attn.iter().chain(mlp.iter()).collect();
        for (c, mlp_block) in self.layer_tp_collectives(Pass::Forward) {
            let (t, exposed) = self.forward_tp_collective(&c, mlp_block, &shapes);
            p.overlapped(CommKind::Tensor, t, exposed);
            p.memory_s += self.tp_relayout(&c, mlp_block, self.fprop_pipelined(&c, mlp_block));
        }
        p.memory_s += self.ring_merge(false);
        let (cp, cp_exposed) = self.cp_exchange(false, t_attn);
        p.overlapped(CommKind::Context, cp, cp_exposed);
        (p, flops)
    }

    /// Adds a layer forward's ZeRO-3 gather of `share` of the layer's weights to its pass
    /// `p`, hidden under `p`.
    fn add_forward_zero(&self, p: &mut PassTime, share: f64) {
        // Offloaded parameters are copied up before their gather: one chain, prefetched alike.
        let z3 = share * (self.zero3_gather_pass() + self.offloaded_param_copy());
        let hidden_under = self.zero_window(p);
        let exposed = self.zero3_exposed(z3, hidden_under, p.gemm_share());
        let (exposed, second_wave) = self.within_wave_budget(p, exposed);
        p.overlapped(CommKind::Zero, z3, exposed);
        p.second_wave_s += second_wave;
    }

    /// The window a layer pass's ZeRO traffic hides under ([`PassTime::overlap_window_s`]):
    /// the pass's critical path, less its expert all-to-alls where they will hide under the
    /// other micro-batch's work ([`Ctx::overlap_expert_all_to_alls`]), which then takes them
    /// off this pass.
    fn zero_window(&self, p: &PassTime) -> f64 {
        match self.hides_expert_all_to_alls() {
            true => p.window_beside_all_to_alls_s(),
            false => p.overlap_window_s(),
        }
    }

    /// Whether the expert all-to-alls hide under the other micro-batch's work (see
    /// [`Ctx::overlap_expert_all_to_alls`]).
    fn hides_expert_all_to_alls(&self) -> bool {
        self.m.software.ep_comm_overlap
            && self.plan.overlaps_expert_all_to_alls(self.cfg)
            && self.plan.micro_batches() >= 2
    }

    fn layer_backward(&self) -> PassTime {
        self.layer_backward_under(self.plan.recompute)
    }

    /// The backward of one layer that recomputes under `recompute` (a layer that
    /// [`Plan::recompute_layers`] leaves out runs under [`Recompute::None`]).
    fn layer_backward_under(&self, recompute: Recompute) -> PassTime {
        let mut p = PassTime::default();
        let (attn, mlp) = self.layer_gemms();
        let act_sp = self.act_sp();
        let e = self.e;
        p.memory_s += 2.0 * self.mem(act_sp * 4.0 * e)
            + 2.0 * self.mem(act_sp * (3.0 * e + self.dropout_mask_bytes()))
            + self.rotary()
            + self.eager_overhead(true)
            + self.fp32_grad_accumulation(self.layer_params_per_rank());
        // dgrad and wgrad of every GEMM, by op: the collectives of a column-parallel GEMM's
        // input run under them.
        let mut grads: Vec<(LayerOp, f64, f64)> = Vec::new();
        for (op, s, batched) in &attn {
            let (dgrad, wgrad) = self.gemm_grads(s, *batched);
            p.gemm_s += dgrad + wgrad;
            if let Some(op) = op {
                grads.push((*op, dgrad, wgrad));
            }
        }
        let (block, block_grads, _) = self.mlp_block(&mlp, Pass::Backward);
        p.add(&block);
        grads.extend(block_grads);
        p.attention_s += self.attention_backward();
        let comm = &self.m.comm;
        let under = |o: Overlap| {
            let find = |op| grads.iter().find(|g| g.0 == op);
            match o {
                Overlap::None | Overlap::PipelinedFprop(_) | Overlap::PipelinedDgrad(_) => None,
                Overlap::Dgrad(op) => find(op).map(|g| g.1),
                Overlap::Wgrad(op) => find(op).map(|g| g.2),
            }
        };
        let shapes: Vec<_> = attn.iter().chain(mlp.iter()).collect();
        // The input-gradient GEMM of `op` (its forward GEMM with `n` and `k` swapped).
        let dgrad_shape = |op| {
            shapes.iter().find(|g| g.0 == Some(op)).map(|g| {
                let s = g.1;
                (GemmShape::new(s.batch, s.m, s.k, s.n), g.2)
            })
        };
        // Megatron-SP re-gathers a column-parallel GEMM's sharded input for its weight
        // gradient under the input-gradient GEMM and reduce-scatters the input gradient under
        // the weight-gradient GEMM (without SP, all-reduces it there); with
        // `--tp-comm-overlap` the gather of a row-parallel GEMM's output gradient is
        // pipelined with its input-gradient GEMM.
        for (c, mlp_block) in self.layer_tp_collectives(Pass::Backward) {
            let t = self.layer_tp_collective(&c, mlp_block);
            let pipelined = match (c.overlap, self.userbuffers(mlp_block)) {
                (Overlap::PipelinedDgrad(op), true) => dgrad_shape(op),
                _ => None,
            };
            p.memory_s += self.tp_relayout(&c, mlp_block, pipelined.is_some());
            if let Some((s, batched)) = pipelined {
                p.overlapped(CommKind::Tensor, t, self.pipelined(t, s, batched, true));
                continue;
            }
            match under(c.overlap) {
                // Transformer Engine's userbuffers (`--tp-comm-overlap`) run these under
                // the GEMM on SMs the GEMM leaves them; otherwise they are NCCL's.
                Some(gemm) if comm.overlap_tp_backward => {
                    let pipelined = self.userbuffers(mlp_block)
                        && (c.kind != Collective::ReduceScatter
                            || self.m.software.tp_pipelined_backward_reduce_scatter);
                    let (exposed, second_wave) = match pipelined {
                        true => (comm.exposed(t, gemm), 0.0),
                        false => self.nccl_exposed(t, gemm, 1.0),
                    };
                    p.overlapped(CommKind::Tensor, t, exposed);
                    p.second_wave_s += second_wave;
                }
                _ => p.exposed(CommKind::Tensor, t),
            }
        }
        p.memory_s += self.ring_merge(true);
        let (cp, cp_exposed) = self.cp_exchange(true, p.attention_s);
        p.overlapped(CommKind::Context, cp, cp_exposed);
        // The recomputed forward runs first, inside the backward, so the backward's ZeRO
        // traffic below overlaps it too. Under full recompute it is the whole layer forward,
        // with its ZeRO-3 gather only where the profile gathers per module
        // (`GatherUnit::regathers_for_recompute`); otherwise the backward's gather serves
        // both.
        match recompute {
            Recompute::None => {}
            Recompute::Selective => match self.m.software.selective {
                SelectiveRecompute::Attention => {
                    if self.m.compute.attention.materialises_scores() {
                        p.recompute_s += self.attention_forward().0;
                    }
                }
                // The matmuls the policy does not save and every element-wise kernel.
                SelectiveRecompute::Op => {
                    let f = self.layer_forward().0;
                    p.recompute_s +=
                        op_policy_recomputed_gemm_share(self.cfg) * f.gemm_s + f.memory_s;
                }
            },
            Recompute::Full => {
                // The replay stops where the profile stops it; a gather it runs again fetches
                // the weights of the modules it replays, hidden under them.
                let (skipped, _, skipped_weights) = self.early_stop_skips();
                let mut replay = self.layer_forward_work().0.without(&skipped);
                if self.m.software.param_gather.regathers_for_recompute() {
                    self.add_forward_zero(&mut replay, 1.0 - skipped_weights);
                }
                p.recompute_s += replay.total_s();
            }
        }
        self.add_backward_zero(&mut p);
        p
    }

    /// Adds a layer backward's ZeRO traffic to its pass `p`, hidden as the forward's is.
    fn add_backward_zero(&self, p: &mut PassTime) {
        // ZeRO-3 re-gathers the weights. ZeRO-2 and -3 hold only a 1/dp shard of the
        // gradients (that is what their memory is charged for), so there is no full-size
        // buffer to accumulate micro-batches into: each micro-batch's gradients are
        // reduce-scattered as its backward produces them.
        let z3 = self.zero3_gather_pass() + self.offloaded_param_copy();
        // Under CPU offload the reduced shard then goes down to the host: it follows the
        // reduce-scatter on the same schedule.
        let rs = self.offloaded_grad_copy()
            + match self.plan.zero_stage {
                3 => self.zero3_collective(Collective::ReduceScatter, self.m.software.reduce_bytes),
                2 => self
                    .layer_zero_collective(Collective::ReduceScatter, self.m.software.reduce_bytes),
                _ => 0.0,
            };
        if z3 + rs > 0.0 {
            let under = self.zero_window(p);
            let share = p.gemm_share();
            // The gradient reduce-scatter is issued after the layer's backward (it overlaps
            // as the gradient reduction does); the gathers follow the profile.
            let (rs_exposed, rs_wave) = match self.m.comm.overlap_grad_reduce {
                true => {
                    self.within_wave_budget(p, self.nccl_exposed(rs, (under - z3).max(0.0), share))
                }
                false => (rs, 0.0),
            };
            p.second_wave_s += rs_wave;
            let (z3_exposed, z3_wave) =
                self.within_wave_budget(p, self.zero3_exposed(z3, under, share));
            let exposed = z3_exposed + rs_exposed;
            p.overlapped(CommKind::Zero, z3 + rs, exposed.min(z3 + rs));
            p.second_wave_s += z3_wave;
        }
    }

    /// Embedding forward and backward (first virtual stage).
    fn embedding(&self) -> (PassTime, PassTime) {
        let (mut f, mut b) = (PassTime::default(), PassTime::default());
        let act = self.act();
        let e = self.e;
        f.memory_s += self.mem(act * 2.0 * e)
            + self.mem(self.act_sp() * (3.0 * e + self.dropout_mask_bytes()));
        b.memory_s += self.mem(act * 3.0 * e)
            + self.mem(self.act_sp() * (2.0 * e + self.dropout_mask_bytes()))
            + self.fp32_grad_accumulation(self.embedding_params_per_rank());
        if self.plan.tp > 1 {
            f.exposed(CommKind::Tensor, self.tp_comm());
            if self.sp {
                b.exposed(CommKind::Tensor, self.tp_gather());
            }
        }
        (f, b)
    }

    /// Final norm, logits and loss (last virtual stage): forward, backward, FLOPs.
    fn head(&self) -> (PassTime, PassTime, f64) {
        let (mut f, mut b) = (PassTime::default(), PassTime::default());
        let c = self.cfg;
        let e = self.e;
        let h = c.hidden as u64;
        let v_t = c.vocab.div_ceil(self.plan.tp) as u64;
        let logits = (self.n * v_t) as f64;
        let s = GemmShape::new(1, self.n, v_t, h);
        f.gemm_s += self.gemm(s, false);
        let (loss_forward, loss_backward) = self.m.software.loss.bytes_per_logit(e);
        f.memory_s += self.mem(self.act_sp() * 2.0 * e) + self.mem(logits * loss_forward);
        let small = self.coll(Collective::AllReduce, self.n as f64 * 4.0, &self.tp);
        f.exposed(CommKind::Tensor, 3.0 * small);
        if self.sp {
            f.exposed(CommKind::Tensor, self.tp_gather());
        }
        let dgrad = self.gemm(GemmShape::new(1, self.n, h, v_t), false);
        let wgrad = self.gemm(GemmShape::new(1, h, v_t, self.n), false);
        b.gemm_s += dgrad + wgrad;
        let (head_params, own_weight) = self.head_weight_per_rank();
        b.memory_s += self.mem(logits * loss_backward)
            + self.mem(self.act_sp() * 4.0 * e)
            + self.fp32_grad_accumulation(if own_weight { head_params } else { 0.0 });
        if self.plan.tp > 1 {
            let tc = self.tp_comm();
            b.overlapped(CommKind::Tensor, tc, self.m.comm.exposed(tc, wgrad));
        }
        (f, b, s.flops())
    }

    /// Activation message between stages: scattered over the tensor-parallel ranks, each
    /// sending its share over its own link, then gathered on the receiving node (Megatron-LM's
    /// scatter/gather optimisation; with sequence parallelism the activation is already
    /// scattered).
    fn p2p(&self, rank: usize) -> f64 {
        let (send, gather) = self.p2p_parts(rank);
        send + gather
    }

    /// [`Ctx::p2p`] in its two parts: the send from pipeline rank `rank` to the next, and the
    /// all-gather over `tp` the receiver runs to rebuild a scattered activation.
    fn p2p_parts(&self, rank: usize) -> (f64, f64) {
        if self.plan.pp <= 1 {
            return (0.0, 0.0);
        }
        let bytes = self.act() * self.e / self.plan.tp as f64;
        let pp_index = self.mapping.mesh().axis_index(axis::PP).unwrap_or(0);
        let linear = |r: usize| {
            let mut c = vec![0; self.mapping.axes().len()];
            c[pp_index] = r % self.plan.pp;
            self.mapping.mesh().linear(&c)
        };
        let group = if self.mapping.same_node(linear(rank), linear(rank + 1)) {
            GroupInfo {
                size: 2,
                nodes_spanned: 1,
                members_per_node: 2,
                nics_per_group: 0,
                groups_per_nic: 0,
            }
        } else {
            let pp = self
                .mapping
                .axis_group(axis::PP)
                .cloned()
                .unwrap_or(GroupInfo {
                    size: 2,
                    nodes_spanned: 2,
                    members_per_node: 1,
                    nics_per_group: 1,
                    groups_per_nic: 1,
                });
            GroupInfo { size: 2, ..pp }
        };
        let send = self.coll(Collective::SendRecv, bytes, &group);
        let gather = if self.plan.tp > 1 && !self.sp {
            self.tp_gather()
        } else {
            0.0
        };
        (send, gather)
    }

    /// Under [`Software::ep_comm_overlap`], hides a layer's expert all-to-alls under the
    /// other micro-batch's work they run beside in Megatron-Core's merged forward-backward
    /// step (`TransformerLayerSchedulePlan.run`, `models/common/model_chunk_schedule_plan.py`):
    /// the backward's combine under the forward's attention block (attention, norm, router),
    /// the forward's dispatch under the backward's expert data-gradient GEMMs, the backward's
    /// dispatch (after the weight gradients) under the forward's experts, and the forward's
    /// combine under the backward's attention block. Each sub-block offers its share of what
    /// the pass's critical path leaves free: its computation and the waits on its own exposed
    /// collectives, less the collectives it issues itself (tensor, context and ZeRO traffic,
    /// which the all-to-alls queue behind). Each pair exposes what that cover does not take,
    /// and slows the computation beside it: its GEMMs by a second wave where they are
    /// persistent, the rest at the overlap's slowdown ([`CommParams::exposed_beside`]); the
    /// waves stay within the GEMMs they displace, with those the pass's ZeRO collectives
    /// already cost ([`Ctx::within_wave_budget`]). Nothing hides with a single micro-batch per
    /// pipeline, nor where Megatron-Core refuses the option
    /// ([`Plan::overlaps_expert_all_to_alls`]).
    fn overlap_expert_all_to_alls(&self, lf: &mut PassTime, lb: &mut PassTime) {
        if !self.hides_expert_all_to_alls() {
            return;
        }
        // Each sub-block as (compute seconds, GEMM seconds).
        let compute = |p: &PassTime| (p.total_s() - p.comm_exposed_s, p.gemm_s);
        let (_, mlp) = self.layer_gemms();
        let f_mlp = compute(&self.mlp_block(&mlp, Pass::Forward).0);
        let b_mlp = compute(&self.mlp_block(&mlp, Pass::Backward).0);
        let rest = |whole: (f64, f64), part: (f64, f64)| {
            ((whole.0 - part.0).max(0.0), (whole.1 - part.1).max(0.0))
        };
        let (lf_compute, lb_compute) = (compute(lf), compute(lb));
        // What of the critical path the pass's own issued collectives leave free, as a
        // multiple of its computation.
        let free = |p: &PassTime, (busy, _): (f64, f64)| {
            let own_issued = p.comm_total_s - p.exposed_by.ep_s;
            match busy > 0.0 {
                true => ((p.window_beside_all_to_alls_s() - own_issued) / busy).max(0.0),
                false => 0.0,
            }
        };
        let (f_free, b_free) = (free(lf, lf_compute), free(lb, lb_compute));
        let scale = |(t, g): (f64, f64), k: f64| (t * k, g * k);
        let f_attn = scale(rest(lf_compute, f_mlp), f_free);
        let b_attn = scale(rest(lb_compute, b_mlp), b_free);
        let (f_mlp, b_mlp) = (scale(f_mlp, f_free), scale(b_mlp, b_free));
        // Dispatch and combine move the same bytes; the data gradients are half the experts'
        // backward GEMMs.
        let (f_a2a, b_a2a) = (lf.exposed_by.ep_s / 2.0, lb.exposed_by.ep_s / 2.0);
        // NCCL's all-to-all kernels take SMs beside the other micro-batch's GEMMs, which on
        // Hopper and Blackwell are persistent and push their displaced tiles into a second
        // wave, as under every other NCCL collective the model overlaps with GEMMs
        // (`nccl_exposed`); Megatron-Core carves out no SMs for them.
        let exposed = |a2a: f64, (under, gemm): (f64, f64)| {
            let share = if under > 0.0 { gemm / under } else { 0.0 };
            self.nccl_exposed(a2a, under, share)
        };
        let sum = |a: (f64, f64), b: (f64, f64)| (a.0 + b.0, a.1 + b.1);
        let half = (b_mlp.0 / 2.0, b_mlp.1 / 2.0);
        // The forward's all-to-alls displace the backward's GEMMs and the other way round;
        // each pass's GEMMs take one second wave at most, whatever collectives share them.
        let (f_left, f_wave) =
            self.within_wave_budget(lb, sum(exposed(f_a2a, half), exposed(f_a2a, b_attn)));
        let (b_left, b_wave) =
            self.within_wave_budget(lf, sum(exposed(b_a2a, f_attn), exposed(b_a2a, f_mlp)));
        // A pass keeps what of its own all-to-alls the other does not cover, and its GEMMs
        // run the second waves the other pass's all-to-alls push into them.
        for (p, left, wave, pushed_in) in [
            (&mut *lf, f_left, f_wave, b_wave),
            (&mut *lb, b_left, b_wave, f_wave),
        ] {
            let stays = (left - wave).clamp(0.0, p.exposed_by.ep_s);
            let change = pushed_in - (p.exposed_by.ep_s - stays);
            p.comm_exposed_s += change;
            p.exposed_by.ep_s += change;
            p.second_wave_s += pushed_in;
        }
    }

    /// Forward and backward of one layer, per-virtual-stage times, FLOPs of a layer and of
    /// the head: everything before the schedule runs.
    fn stages(&self) -> Stages {
        let v = self.plan.pp * self.plan.vpp;
        let layers = stage_layers(self.cfg, self.plan);
        let (mut lf, layer_flops) = self.layer_forward();
        let mut lb = self.layer_backward();
        self.overlap_expert_all_to_alls(&mut lf, &mut lb);
        // The layers `recompute_layers` leaves out of full recompute keep their activations.
        let kept = match self.plan.recompute_layers {
            Some(_) => self.layer_backward_under(Recompute::None).total_s(),
            None => lb.total_s(),
        };
        let (ef, eb) = self.embedding();
        let (hf, hb, head_flops) = self.head();
        let mut fwd = vec![0.0; v];
        let mut fwd_gemm = vec![0.0; v];
        let mut bwd = vec![0.0; v];
        for vs in 0..v {
            let (under, whole) = self.plan.recompute_split(layers[vs]);
            fwd[vs] = layers[vs] as f64 * lf.total_s();
            fwd_gemm[vs] = layers[vs] as f64 * lf.gemm_s;
            bwd[vs] = under as f64 * lb.total_s() + whole as f64 * kept;
            if vs == 0 {
                fwd[vs] += ef.total_s();
                fwd_gemm[vs] += ef.gemm_s;
                bwd[vs] += eb.total_s();
            }
            if vs == v - 1 {
                fwd[vs] += hf.total_s();
                fwd_gemm[vs] += hf.gemm_s;
                bwd[vs] += hb.total_s();
            }
        }
        Stages {
            layers,
            lf,
            lb,
            layer_flops,
            head_flops,
            fwd,
            fwd_gemm,
            bwd,
        }
    }

    fn run(&self, schedule: &Schedule) -> Estimate {
        let plan = self.plan;
        let cfg = self.cfg;
        let v = plan.pp * plan.vpp;
        let Stages {
            layers,
            lf,
            lb,
            layer_flops,
            head_flops,
            fwd,
            fwd_gemm,
            bwd,
        } = self.stages();
        let pp = plan.pp;
        let p2p: Vec<Cost> = (0..pp).map(|r| Cost::from_secs(self.p2p(r))).collect();
        // Blocking transfers (`Software::p2p_blocking`) are time the ranks spend in them: a
        // chunk's pass takes its send to the next virtual stage and the gather of what it
        // received, and a message arrives when its sender's pass ends.
        let blocking = self.m.software.p2p_blocking && pp > 1;
        let (mut fwd_busy, mut bwd_busy) = (fwd.clone(), bwd.clone());
        if blocking {
            let parts: Vec<(f64, f64)> = (0..pp).map(|r| self.p2p_parts(r)).collect();
            for vs in 0..v {
                let rank = vs % pp;
                let prev = (rank + pp - 1) % pp;
                if vs + 1 < v {
                    fwd_busy[vs] += parts[rank].0;
                    bwd_busy[vs] += parts[rank].1;
                }
                if vs > 0 {
                    fwd_busy[vs] += parts[prev].1;
                    bwd_busy[vs] += parts[prev].0;
                }
            }
        }
        let fwd_c: Vec<Cost> = fwd_busy.iter().map(|&t| Cost::from_secs(t)).collect();
        let bwd_c: Vec<Cost> = bwd_busy.iter().map(|&t| Cost::from_secs(t)).collect();
        let timeline = schedule.simulate(
            |rank, a| match *a {
                Action::Forward { chunk, .. } => fwd_c[chunk * pp + rank].nanos(),
                Action::Backward { chunk, .. } => bwd_c[chunk * pp + rank].nanos(),
                _ => 0,
            },
            |rank, a| match *a {
                _ if blocking => 0,
                Action::SendActivation { .. } => p2p[rank].nanos(),
                Action::SendGradient { .. } => p2p[(rank + pp - 1) % pp].nanos(),
                _ => 0,
            },
        );
        // The schedules built here always complete; a failure would be a bug in them.
        let timeline = match timeline {
            Ok(t) => t,
            Err(_) => {
                debug_assert!(false, "schedule simulation failed");
                return self.infeasible("the pipeline schedule could not be simulated");
            }
        };

        // Per rank: end of the last backward and when each chunk's last backward ran.
        let grad_bytes = self.m.memory.grad_bytes_per_param;
        let kind = if plan.zero_stage == 0 {
            Collective::AllReduce
        } else {
            Collective::ReduceScatter
        };
        let reduce = |bytes: f64| self.zero_collective(kind, bytes, 0.0);
        // ZeRO-2/3 reduce-scatter each micro-batch's layer gradients in its backward (priced
        // there); what remains here is the embedding's and the replicated weights'.
        let mut layer_reduce = match plan.zero_stage {
            0 | 1 => self.layer_zero_collective(kind, grad_bytes),
            _ => 0.0,
        };
        let replicated = tp_replicated_params_per_layer(cfg, plan);
        if replicated > 0.0 {
            // The weights of ops on sequence shards: their gradients are also summed over `tp`.
            layer_reduce += self.coll(
                Collective::AllReduce,
                replicated * grad_bytes
                    / if plan.zero_stage >= 2 {
                        self.shards.dense
                    } else {
                        1.0
                    },
                &self.tp,
            );
        }
        let emb_params = self.embedding_params_per_rank();
        // A layer's dense gradients on this rank, tensor by tensor (their shares of the
        // layer's, scaled to what the rank holds).
        let layer_tensor_bytes: Vec<f64> = {
            let params = layer_gradient_params(cfg);
            let total: f64 = params.iter().sum();
            let bytes = self.layer_dense_params() * grad_bytes;
            params.iter().map(|p| p / total.max(1.0) * bytes).collect()
        };
        let mut iter_end = 0.0f64;
        let mut grad_reduce = 0.0f64;
        let mut grad_exposed = 0.0f64;
        let mut busiest = 0.0f64;
        let mut pipeline_end = 0.0f64;
        // The first micro-batch's weight casts (`fp8_weight_cache`): each rank's own are its
        // work; the whole chain delays every rank's schedule.
        let weight_cast = self.layer_weight_cast();
        for rank in 0..pp {
            let list = &schedule.per_rank[rank];
            let spans = &timeline.spans[rank];
            let mut last_bwd: Vec<(f64, f64)> = vec![(0.0, 0.0); plan.vpp];
            let mut end = 0.0f64;
            for (a, &(s, e)) in list.iter().zip(spans) {
                if let Action::Backward { chunk, .. } = *a {
                    last_bwd[chunk] = (s as f64 * 1e-9, e as f64 * 1e-9);
                    end = end.max(e as f64 * 1e-9);
                }
            }
            pipeline_end = pipeline_end.max(end);
            let work: f64 = (0..plan.vpp)
                .map(|c| {
                    let vs = c * pp + rank;
                    (fwd[vs] + bwd[vs]) * plan.micro_batches() as f64
                        + layers[vs] as f64 * weight_cast
                })
                .sum();
            busiest = busiest.max(work);
            // Buckets, one per layer (and the embedding or head), ready as the last backward
            // of their chunk proceeds; the communication stream takes them in order.
            let mut buckets: Vec<(f64, f64)> = Vec::new();
            let mut spans = Vec::new();
            let mut layer_ends = Vec::new();
            for (c, &(s, e)) in last_bwd.iter().enumerate() {
                let vs = c * pp + rank;
                let nl = layers[vs].max(1);
                for j in 0..layers[vs] {
                    // The last layer ends exactly with its chunk, so that the embedding's
                    // gradient (ready at `e`) stays after it whatever the rounding.
                    let at = |k: usize| match k == nl {
                        true => e,
                        false => s + (e - s) * k as f64 / nl as f64,
                    };
                    buckets.push((at(j + 1), layer_reduce));
                    layer_ends.push(at(j + 1));
                    spans.push(GradientSpan {
                        start: at(j),
                        end: at(j + 1),
                        tensor_bytes: layer_tensor_bytes.clone(),
                    });
                }
                if vs == 0 || (vs == v - 1 && !cfg.tied_embeddings) {
                    buckets.push((e, reduce(emb_params * grad_bytes)));
                    spans.push(GradientSpan {
                        start: e,
                        end: e,
                        tensor_bytes: vec![emb_params * grad_bytes],
                    });
                }
            }
            if kind == Collective::AllReduce
                && let Some(mb) = self.m.software.bucket_mb
            {
                buckets = self.sized_buckets(spans, &layer_ends, mb, layer_reduce, grad_bytes);
            }
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut t = if self.m.comm.overlap_grad_reduce {
                0.0
            } else {
                end
            };
            let mut total = 0.0;
            for (ready, dur) in buckets {
                t = t.max(ready) + dur;
                total += dur;
            }
            // What runs after the last backward is exposed; what ran under it slowed the
            // computation as any overlapped collective does ([`CommParams::overlap_slowdown`];
            // not the persistent-GEMM second wave, which Megatron-Core's weak-scaling rows on
            // H100 do not show for their bucketed reduce-scatters).
            let after = (t - end).max(0.0);
            let exposed = self.m.comm.exposed(total, (total - after).max(0.0));
            grad_reduce = grad_reduce.max(total);
            grad_exposed = grad_exposed.max(exposed);
            iter_end = iter_end.max(end + exposed);
        }
        let cast_chain = cfg.layers as f64 * weight_cast;
        pipeline_end += cast_chain;
        iter_end += cast_chain;
        // Tied embeddings: the first and last stage add their gradients.
        let embedding_sync = if pp > 1 && cfg.tied_embeddings {
            let pair = self
                .mapping
                .axis_group(axis::PP)
                .cloned()
                .map(|g| GroupInfo { size: 2, ..g });
            pair.map_or(0.0, |g| {
                self.coll(Collective::AllReduce, emb_params * grad_bytes, &g)
            })
        } else {
            0.0
        };
        // Optimizer on the fullest rank: memory-bound over the parameters it updates.
        let memory = self.memory(schedule, &layers);
        let worst = memory
            .iter()
            .max_by(|a, b| a.total.total_cmp(&b.total))
            .cloned()
            .unwrap_or_default();
        // fp32 gradient read, master weight read and write, two moments read and written,
        // 16-bit weight written, gradient read again for the norm and zeroed: 38 bytes.
        let (mut optimizer, mut param_gather) = (0.0f64, 0.0f64);
        for m in &memory {
            let dense = m.num_params - m.num_expert_params;
            let step = match plan.offload {
                Offload::None => {
                    let updated = self.shards.bytes(plan, 1, dense, m.num_expert_params, 38.0);
                    self.mem(updated)
                }
                // On the host, memory-bound over its DRAM, which the node's ranks share;
                // then the updated 16-bit shard goes up (the next step's gathers copy
                // offloaded parameters themselves).
                offload => {
                    let shard = self.shards.bytes(plan, 1, dense, m.num_expert_params, 1.0);
                    let bw = self.cl().host_bandwidth_per_gpu().unwrap_or(f64::INFINITY);
                    let up = match offload {
                        Offload::Optimizer => self.pcie(shard * self.e),
                        Offload::None | Offload::Params => 0.0,
                    };
                    self.m.software.cpu_optimizer.step_time(shard, bw) + up
                }
            };
            optimizer = optimizer.max(step);
            if (1..=2).contains(&plan.zero_stage) {
                // The layers' weights at their gathered bytes; the embedding and head are
                // 16-bit.
                let per_param = self.gathered_weight_bytes();
                let layer_dense =
                    rank_layers(&layers, pp, m.pipeline_rank) as f64 * self.layer_dense_params();
                let gather = self.zero_collective(
                    Collective::AllGather,
                    (dense - layer_dense) * self.e + layer_dense * per_param,
                    m.num_expert_params * per_param,
                );
                param_gather = param_gather.max(gather);
            }
        }
        // Megatron's `--overlap-param-gather`: the updated weights are gathered bucket by
        // bucket under the next step's first forward pass (the first pipeline rank's
        // chunks, the embedding's and, without a pipeline, the head's GEMMs among them).
        let param_gather_exposed = match self.m.software.overlap_param_gather {
            true => {
                let first_forward: f64 = (0..plan.vpp).map(|c| fwd[c * pp]).sum();
                let gemm: f64 = (0..plan.vpp).map(|c| fwd_gemm[c * pp]).sum();
                let share = match first_forward > 0.0 {
                    true => (gemm / first_forward).min(1.0),
                    false => 0.0,
                };
                self.nccl_exposed(param_gather, first_forward, share).0
            }
            false => param_gather,
        };
        let iter = iter_end + embedding_sync + optimizer + param_gather_exposed;

        // FLOPs: model FLOPs count each layer's forward three times (forward, and twice that
        // in the backward); hardware FLOPs add what recomputation repeats.
        let mb_total = plan.global_batch as f64 / plan.micro_batch_size as f64;
        let per_mb_model = 3.0 * (cfg.layers as f64 * layer_flops + head_flops) * plan.tp as f64;
        let model_flops = per_mb_model * mb_total * plan.cp as f64;
        let recompute_flops = match plan.recompute {
            Recompute::None => 0.0,
            Recompute::Full => {
                let recomputed: usize = layers.iter().map(|&l| plan.recompute_split(l).0).sum();
                recomputed as f64 * (layer_flops - self.early_stop_skips().1)
            }
            Recompute::Selective => match self.m.software.selective {
                SelectiveRecompute::Attention => {
                    if self.m.compute.attention.materialises_scores() {
                        cfg.layers as f64 * self.attention_forward().1
                    } else {
                        0.0
                    }
                }
                SelectiveRecompute::Op => {
                    let gemms = layer_flops - self.attention_forward().1;
                    cfg.layers as f64 * op_policy_recomputed_gemm_share(cfg) * gemms
                }
            },
        } * plan.tp as f64
            * mb_total
            * plan.cp as f64;
        let world = plan.world_size() as f64;
        // fp8 plans are measured against the fp8 peak, as Transformer Engine users report.
        let peak = match plan.fp8 {
            true => self
                .cl()
                .fp8_peak_flops()
                .unwrap_or(self.cl().peak_flops(plan.dtype)),
            false => self.cl().peak_flops(plan.dtype),
        };
        let model_tflops = model_flops / iter / world / 1e12;
        let hardware_tflops = (model_flops + recompute_flops) / iter / world / 1e12;
        let capacity = self.cl().gpu.hbm_capacity_gib * GIB;
        // Under CPU offload every rank of a node keeps its shard in the node's memory.
        let host_per_node = memory.iter().map(|m| m.host).fold(0.0, f64::max)
            * self.cl().gpus_per_node.min(plan.world_size()) as f64;
        let host_capacity = self.cl().host_memory_bytes().unwrap_or(f64::INFINITY);
        // A plan that overflows the host's memory is priced all the same, as one that
        // overflows the GPU's is: it does not fit, and the reason says where.
        let host_reason = (host_per_node > host_capacity).then(|| {
            format!(
                "offload={}: the ranks of a node keep {:.1} GiB in host memory (master \
                 weights, optimizer moments and gradients of their shards), but a node of `{}` \
                 has {:.1} GiB",
                plan.offload.name(),
                host_per_node / GIB,
                self.cl().name,
                host_capacity / GIB
            )
        });
        let gpu_reason = (worst.total > capacity).then(|| {
            format!(
                "pipeline rank {} needs {:.1} GiB (weights {:.1}, gradients {:.1}, optimizer {:.1}, \
                 activations {:.1} for {} in-flight chunks, working {:.1}, buffers {:.1}, reserved {:.1}) \
                 but a {} has {:.1} GiB",
                worst.pipeline_rank,
                worst.total / GIB,
                worst.weights / GIB,
                worst.gradients / GIB,
                worst.optimizer / GIB,
                worst.activations / GIB,
                worst.in_flight,
                worst.working / GIB,
                worst.comm_buffers / GIB,
                worst.reserved / GIB,
                self.cl().gpu.model,
                capacity / GIB
            )
        });
        let fits = gpu_reason.is_none() && host_reason.is_none();
        let fits_reason = match (gpu_reason, host_reason) {
            (Some(gpu), Some(host)) => Some(format!("{gpu}; {host}")),
            (gpu, host) => gpu.or(host),
        };
        Estimate {
            iter_time_s: iter,
            tokens_per_s: plan.global_batch as f64 * cfg.seq as f64 / iter,
            model_tflops_per_gpu: model_tflops,
            hardware_tflops_per_gpu: hardware_tflops,
            mfu: model_tflops * 1e12 / peak,
            peak_memory_gib: worst.total / GIB,
            fits,
            fits_reason,
            num_gpus: plan.world_size(),
            micro_batches: plan.micro_batches(),
            cost: if fits {
                Cost::from_secs(iter)
            } else {
                Cost::INFEASIBLE
            },
            memory: worst,
            memory_per_pipeline_rank: memory,
            stage_layers: layers.clone(),
            layer_tp_collectives: self
                .explained_tp_collectives()
                .into_iter()
                .map(|c| TimedCollective {
                    bytes: self.tp_collective_bytes(&c),
                    time_s: self.tp_collective(&c),
                    collective: c,
                })
                .collect(),
            time: TimeBreakdown {
                layer_forward: lf,
                layer_backward: lb,
                stage_forward_s: fwd,
                stage_backward_s: bwd,
                p2p_s: p2p.iter().map(|c| c.secs()).fold(0.0, f64::max),
                pipeline_s: pipeline_end,
                busiest_rank_compute_s: busiest,
                bubble_s: (pipeline_end - busiest).max(0.0),
                grad_reduce_s: grad_reduce,
                grad_reduce_exposed_s: grad_exposed,
                embedding_sync_s: embedding_sync,
                optimizer_s: optimizer,
                param_gather_s: param_gather,
            },
            timeline: Some(timeline),
        }
    }

    fn infeasible(&self, why: &str) -> Estimate {
        Estimate {
            iter_time_s: f64::INFINITY,
            tokens_per_s: 0.0,
            model_tflops_per_gpu: 0.0,
            hardware_tflops_per_gpu: 0.0,
            mfu: 0.0,
            peak_memory_gib: 0.0,
            fits: false,
            fits_reason: Some(why.to_string()),
            num_gpus: self.plan.world_size(),
            micro_batches: self.plan.micro_batches(),
            cost: Cost::INFEASIBLE,
            memory: MemoryBreakdown::default(),
            memory_per_pipeline_rank: Vec::new(),
            stage_layers: Vec::new(),
            layer_tp_collectives: Vec::new(),
            time: TimeBreakdown::default(),
            timeline: None,
        }
    }

    /// Memory of every pipeline rank.
    fn memory(&self, schedule: &Schedule, layers: &[usize]) -> Vec<MemoryBreakdown> {
        let plan = self.plan;
        let cfg = self.cfg;
        let mp = &self.m.memory;
        let pp = plan.pp;
        let v = pp * plan.vpp;
        let t = plan.tp as f64;
        let per_layer_act = match (plan.recompute, self.m.software.selective) {
            (Recompute::Selective, SelectiveRecompute::Op) => {
                op_policy_activation_bytes_per_layer(cfg, plan)
            }
            _ => activation_bytes_per_layer(
                cfg,
                plan,
                plan.recompute,
                self.m.compute.attention,
                self.m.software.dropout,
            ),
        };
        let full_layer_act = activation_bytes_per_layer(
            cfg,
            plan,
            Recompute::None,
            self.m.compute.attention,
            self.m.software.dropout,
        );
        // What a chunk of `l` layers stores per micro-batch: the layers under the policy what
        // it keeps, those `recompute_layers` leaves out everything.
        let chunk_act = |l: usize| {
            let (under, whole) = plan.recompute_split(l);
            under as f64 * per_layer_act + whole as f64 * full_layer_act
        };
        let emb = self.embedding_params_per_rank();
        let (head_params, own_head) = self.head_weight_per_rank();
        let msg = self.act() * self.e / t;
        let groups_used = [plan.tp, plan.dp, plan.pp, plan.cp, plan.ep]
            .iter()
            .filter(|&&g| g > 1)
            .count() as f64;
        // Per layer: parameters, the experts' among them, and those held whole whose
        // optimizer state is sharded over `tp`.
        let layer_params = self.layer_params_per_rank();
        let layer_experts = expert_params_per_layer(cfg, plan);
        let layer_tp_sharded_state = layer_params - optimizer_params_per_layer(cfg, plan);
        (0..pp)
            .map(|rank| {
                let held_layers = rank_layers(layers, pp, rank);
                let mut params = held_layers as f64 * layer_params;
                let expert = held_layers as f64 * layer_experts;
                let tp_sharded_state = held_layers as f64 * layer_tp_sharded_state;
                for c in 0..plan.vpp {
                    let vs = c * pp + rank;
                    if vs == 0 {
                        params += emb;
                    }
                    if vs == v - 1 && own_head {
                        params += head_params;
                    }
                }
                let in_flight = schedule.max_in_flight(rank);
                // The activations the rank holds at its peak, each in-flight micro-batch
                // chunk at its own chunk's size.
                let stored = |chunk: &dyn Fn(usize) -> f64| {
                    schedule.peak_in_flight_by(rank, |c| chunk(layers[c * pp + rank]))
                };
                if self.cl().runtime == Runtime::AutoparCpu {
                    let last = (0..plan.vpp).any(|c| c * pp + rank == v - 1);
                    let head = if last { head_params } else { 0.0 };
                    let kept =
                        runtime_activation_bytes_per_layer(cfg, plan, plan.recompute, self.e);
                    let whole =
                        runtime_activation_bytes_per_layer(cfg, plan, Recompute::None, self.e);
                    let held = Held {
                        params,
                        expert_params: expert,
                        optimizer_params: params - tp_sharded_state,
                        head_params: head,
                        in_flight,
                        activations: stored(&|l| {
                            let (under, rest) = plan.recompute_split(l);
                            under as f64 * kept + rest as f64 * whole
                        }),
                        last_stage: last,
                    };
                    return self.cpu_runtime_memory(rank, &held);
                }
                let z = &self.shards;
                let dense = params - expert;
                let mut weights = z.bytes(plan, 3, dense, expert, self.e);
                let offload = plan.offload;
                if plan.fp8 {
                    // Transformer Engine keeps an fp8 copy of every layer weight and its
                    // transpose (a byte each) across the micro-batches of a step; with fp8
                    // parameters those are the layer weights, with no 16-bit copy beside.
                    let layer_dense = held_layers as f64 * (layer_params - layer_experts);
                    weights += z.bytes(plan, 3, layer_dense, expert, 2.0);
                    if self.m.software.fp8_params {
                        weights -= z.bytes(plan, 3, layer_dense, expert, self.e);
                    }
                }
                let mut gradients = z.bytes(plan, 2, dense, expert, mp.grad_bytes_per_param);
                if self.accumulates_in_fp32() {
                    // The backward's 16-bit gradients, until they are added into the fp32 ones.
                    gradients += z.bytes(plan, 2, dense, expert, self.e);
                }
                let mut optimizer = z.bytes(
                    plan,
                    1,
                    dense - tp_sharded_state,
                    expert,
                    mp.optimizer_bytes_per_param,
                );
                // CPU offload: the fp32 state and gradients of the shard live on the host.
                // With the optimizer offloaded the GPU keeps its 16-bit weights and a
                // 16-bit gradient shard for each micro-batch's reduce-scatter; with the
                // parameters offloaded as well it keeps neither between uses (the gathered
                // layers are counted in `working`).
                let mut host = 0.0;
                if offload != Offload::None {
                    host = optimizer + z.bytes(plan, 2, dense, expert, mp.grad_bytes_per_param);
                    optimizer = 0.0;
                    gradients = match offload {
                        Offload::Params => 0.0,
                        _ => z.bytes(plan, 2, dense, expert, self.e),
                    };
                    if offload == Offload::Params {
                        weights = 0.0;
                    }
                }
                let activations = stored(&chunk_act);
                let mut working = match plan.recompute {
                    Recompute::Full => full_layer_act,
                    Recompute::Selective => full_layer_act - per_layer_act,
                    Recompute::None => 0.0,
                };
                // Gradients flowing through one layer: input and output gradient buffers.
                working += 2.0 * self.act_sp() * self.e;
                if (0..plan.vpp).any(|c| c * pp + rank == v - 1) {
                    // Logits in the compute dtype and their fp32 softmax for one micro-batch.
                    working += (self.n as f64) * cfg.vocab as f64 / t * (self.e + 4.0);
                }
                if plan.zero_stage >= 3 {
                    // Two layers' gathered weights (current and prefetched).
                    working += 2.0 * self.layer_params_per_rank() * self.e;
                }
                if plan.zero_stage >= 2 {
                    // A layer's unsharded gradients before their reduce-scatter, which ZeRO-2
                    // and -3 run after each micro-batch's backward of the layer.
                    working += self.layer_params_per_rank() * self.m.software.reduce_bytes;
                }
                if offload == Offload::Params {
                    // The fp32 shards copied up for the next gathers.
                    working += self.layer_params_per_rank() * 2.0 * 4.0 / z.dense.max(1.0);
                }
                let comm_buffers = 2.0 * msg
                    + if self.sp { self.act() * self.e } else { 0.0 }
                    + groups_used * mp.nccl_buffer_bytes_per_group;
                let reserved = self.cl().gpu.reserved_gib * GIB;
                let total = weights
                    + gradients
                    + optimizer
                    + activations
                    + working
                    + comm_buffers
                    + reserved;
                MemoryBreakdown {
                    pipeline_rank: rank,
                    num_params: params,
                    num_expert_params: expert,
                    weights,
                    gradients,
                    optimizer,
                    activations,
                    in_flight,
                    working,
                    comm_buffers,
                    reserved,
                    total,
                    capacity: self.cl().gpu.hbm_capacity_gib * GIB,
                    host,
                }
            })
            .collect()
    }
}

/// What one pipeline rank holds, for the CPU runtime's memory.
struct Held {
    /// Parameters of the rank's chunks (after tensor division, before ZeRO).
    params: f64,
    /// Of which the output head's (0 off the last stage).
    head_params: f64,
    /// Micro-batch chunks in flight at the peak.
    in_flight: usize,
    /// Parameters whose optimizer state it holds (the weights replicated over `tp` count at
    /// their shard).
    optimizer_params: f64,
    /// Of `params`, the experts'.
    expert_params: f64,
    /// Bytes of the activations stored at the peak (every in-flight micro-batch chunk's).
    activations: f64,
    /// Whether the rank runs the last virtual stage (logits and loss).
    last_stage: bool,
}

impl Ctx<'_> {
    /// Peak memory of one pipeline rank of autopar's CPU runtime, which frees every value
    /// after its last use: resident weights and optimizer state, plus the larger of two
    /// moments. In the backward: the stored activations of the in-flight micro-batches, the
    /// transient tensors of one layer's backward or of the loss's (whichever is larger), the
    /// gradients produced so far (the head's and about one layer's), and with ZeRO-3 the
    /// gathered weights (the runtime gathers a weight at its first use in a step and keeps
    /// it until its last use in the backward). At the optimizer: every gradient.
    fn cpu_runtime_memory(&self, rank: usize, held: &Held) -> MemoryBreakdown {
        let (plan, cfg, mp) = (self.plan, self.cfg, &self.m.memory);
        let t = plan.tp as f64;
        let n = self.n as f64;
        let zero = plan.zero_stage;
        let wb = mp.weight_bytes_per_param.unwrap_or(self.e);
        let z = &self.shards;
        let dense = held.params - held.expert_params;
        let weights = z.bytes(plan, 3, dense, held.expert_params, wb);
        // A tied output embedding on the last stage is a copy: the first stage, which owns
        // the embedding, updates it and sends it back, so the copy has no optimizer state.
        let tied_copy = if self.cfg.tied_embeddings && plan.pp > 1 {
            held.head_params
        } else {
            0.0
        };
        let optimizer = z.bytes(
            plan,
            1,
            held.optimizer_params - held.expert_params - tied_copy,
            held.expert_params,
            mp.optimizer_bytes_per_param,
        );
        let activations = held.activations;
        let stored = runtime_activation_bytes_per_layer(cfg, plan, plan.recompute, self.e);
        let unrecomputed = runtime_activation_bytes_per_layer(cfg, plan, Recompute::None, self.e);

        let experts = if cfg.experts > 1 {
            cfg.top_k as f64
        } else {
            1.0
        };
        let mut layer =
            runtime_mlp_backward_temporaries(cfg) * n * cfg.ffn as f64 / t * experts * self.e;
        // A recomputed layer holds its forward again while its MLP's backward runs: all but
        // the MLP's own tensors under full recompute, the probabilities under selective.
        layer += match plan.recompute {
            Recompute::None => 0.0,
            Recompute::Selective => unrecomputed - stored,
            Recompute::Full => runtime_attention_bytes_per_layer(cfg, plan, self.e),
        };
        let loss = if held.last_stage {
            n * cfg.vocab as f64 / t * (self.e + RUNTIME_CROSS_ENTROPY_BYTES_PER_LOGIT)
        } else {
            0.0
        };
        let mut working = layer.max(loss);
        if zero >= 3 {
            // The gathered weights, beyond the rank's own shards.
            working += (held.params - held.expert_params) * wb * (1.0 - 1.0 / z.dense)
                + held.expert_params * wb * (1.0 - 1.0 / z.expert);
        }
        let grad_bytes = mp.grad_bytes_per_param;
        let all_grads = z.bytes(plan, 2, dense, held.expert_params, grad_bytes);
        // With several micro-batches, every gradient accumulator exists from the first
        // micro-batch's backward on.
        let grads_so_far = if plan.micro_batches() > 1 {
            all_grads
        } else {
            let expert = expert_params_per_layer(cfg, plan);
            let dense = held.head_params + self.layer_params_per_rank() - expert;
            z.bytes(plan, 2, dense, expert, grad_bytes)
        };
        let pipeline_messages = if plan.pp > 1 {
            2.0 * self.act() * self.e / t
        } else {
            0.0
        };
        let (gradients, activations, working, comm_buffers) =
            if activations + working + grads_so_far + pipeline_messages >= all_grads {
                (grads_so_far, activations, working, pipeline_messages)
            } else {
                (all_grads, 0.0, 0.0, 0.0)
            };
        let total = weights + gradients + optimizer + activations + working + comm_buffers;
        MemoryBreakdown {
            pipeline_rank: rank,
            num_params: held.params,
            num_expert_params: held.expert_params,
            weights,
            gradients,
            optimizer,
            activations,
            in_flight: held.in_flight,
            working,
            comm_buffers,
            reserved: self.cl().gpu.reserved_gib * GIB,
            total: total + self.cl().gpu.reserved_gib * GIB,
            capacity: self.cl().gpu.hbm_capacity_gib * GIB,
            host: 0.0,
        }
    }
}

/// The group of `etp` consecutive ranks of the tensor-parallel group `tp` (the first
/// `etp` of its members; the ranks of a tensor-parallel group are consecutive under every
/// axis order, so its sub-groups stay on as few nodes as the group allows).
fn expert_tp_group(plan: &Plan, tp: &GroupInfo) -> GroupInfo {
    let etp = plan.expert_tp().min(tp.size.max(1));
    if etp >= tp.size {
        return tp.clone();
    }
    let per_node = tp.members_per_node.clamp(1, etp);
    let nodes = etp.div_ceil(per_node);
    GroupInfo {
        size: etp,
        nodes_spanned: nodes,
        members_per_node: per_node,
        nics_per_group: if nodes > 1 { tp.nics_per_group } else { 0 },
        groups_per_nic: if nodes > 1 { tp.groups_per_nic } else { 0 },
    }
}

/// The expert-parallel group: the mesh's `ep` axis, and with `etp < tp` first the
/// [`Plan::ep_over_tp`] ranks of a tensor-parallel group that hold the same expert shards
/// (Megatron-Core's order: `etp`, then `ep`). Placed as the `ep` and `tp` axes together place
/// their ranks, with the group's size and its share of each node's.
fn expert_parallel_group(plan: &Plan, mapping: &MeshMapping) -> Result<GroupInfo, CostError> {
    let ep = mapping.axis_group(axis::EP)?;
    let folded = plan.ep_over_tp();
    if folded <= 1 {
        return Ok(ep.clone());
    }
    let both = mapping.group(&[axis::EP.to_string(), axis::TP.to_string()])?;
    // Of each tensor-parallel group's `tp` ranks, `folded` are members.
    let per_node = (both.members_per_node * folded / plan.tp.max(1)).max(1);
    Ok(GroupInfo {
        size: plan.ep,
        members_per_node: per_node.min(plan.ep),
        ..both
    })
}

/// The ranks holding the same expert shards: the mesh's `dp` axis, and with `etp < tp` the
/// `tp / etp` ranks of each tensor-parallel group that hold the same shards and are not in
/// the expert-parallel group ([`Plan::ep_over_tp`]; Megatron-Core's expert data-parallel
/// group, `dp * tp / (ep * etp)` ranks), and the `cp` axis where the stack reduces and shards
/// over context parallelism (`over_cp`). Placed as those axes together place their ranks,
/// with the group's size.
fn expert_data_group(
    plan: &Plan,
    mapping: &MeshMapping,
    over_cp: bool,
) -> Result<GroupInfo, CostError> {
    let dp = match over_cp {
        true => mapping.group(&[axis::DP.to_string(), axis::CP.to_string()])?,
        false => mapping.axis_group(axis::DP)?.clone(),
    };
    let replicas = plan.tp / plan.expert_tp() / plan.ep_over_tp();
    if replicas <= 1 {
        return Ok(dp);
    }
    let mut axes = vec![axis::DP.to_string(), axis::TP.to_string()];
    if over_cp {
        axes.push(axis::CP.to_string());
    }
    let both = mapping.group(&axes)?;
    Ok(GroupInfo {
        size: dp.size * replicas,
        members_per_node: both.members_per_node.min(dp.size * replicas),
        ..both
    })
}

/// Weight tensors of one transformer layer as training stacks hold them, for which a
/// per-tensor ZeRO-3 gather issues one collective each: a GPT-style layer has two norms
/// (scale and shift), a fused QKV weight and bias, the output projection's weight and bias
/// and the MLP's two weights and biases (12); a gated (Llama-style) layer two norm scales,
/// the fused QKV, the output projection and the gate, up and down weights (7). With experts,
/// the MLP is the router plus every expert's two (three when gated) weights.
fn layer_weight_tensors(cfg: &TransformerConfig) -> usize {
    let (attention, norms, mlp) = match cfg.gated_mlp {
        true => (2, 2, 3),
        false => (4, 4, 4),
    };
    let mlp = match cfg.experts > 1 {
        true => 1 + cfg.experts * if cfg.gated_mlp { 3 } else { 4 },
        false => mlp,
    };
    attention + norms + mlp
}

#[cfg(test)]
mod stage_tests {
    use super::*;

    fn costliest(cfg: &TransformerConfig, n: &[usize]) -> f64 {
        let h = cfg.hidden as f64;
        let layer = 2.0 * (cfg.attention_params() as f64 + cfg.active_mlp_params())
            + 4.0 * cfg.seq as f64 * cfg.attention_width();
        let head = 2.0 * h * cfg.vocab as f64 + 5.0 * cfg.vocab as f64;
        n.iter()
            .enumerate()
            .map(|(i, &k)| k as f64 * layer + if i + 1 == n.len() { head } else { 0.0 })
            .fold(0.0, f64::max)
    }

    /// Every division of `layers` into `v` stages of at least one layer.
    fn divisions(layers: usize, v: usize) -> Vec<Vec<usize>> {
        if v == 1 {
            return vec![vec![layers]];
        }
        (1..=layers.saturating_sub(v - 1))
            .flat_map(|first| {
                divisions(layers - first, v - 1)
                    .into_iter()
                    .map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
            })
            .collect()
    }

    #[test]
    fn balanced_division_is_optimal_and_even_when_it_can_be() {
        // A heavy head (vocabulary 64x the hidden size) moves layers off the last stage.
        let heavy = TransformerConfig::gpt("heavy", 8, 64, 4, 32, 4096);
        let n = balanced_layers_per_virtual_stage(&heavy, 4);
        assert_eq!(n.iter().sum::<usize>(), 8);
        assert!(n[3] < 2, "{n:?}");
        for (layers, v) in [(8, 4), (7, 3), (10, 4), (6, 6)] {
            let cfg = TransformerConfig::gpt("t", layers, 64, 4, 32, 4096);
            let got = balanced_layers_per_virtual_stage(&cfg, v);
            let best = divisions(layers, v)
                .iter()
                .map(|d| costliest(&cfg, d))
                .fold(f64::INFINITY, f64::min);
            assert!(
                costliest(&cfg, &got) <= best * (1.0 + 1e-12),
                "{layers} layers on {v}: {got:?}"
            );
        }
        // GPT-3 175B's head is a third of a layer: 96 layers on 32 virtual stages stay even.
        let gpt3 = TransformerConfig::gpt3_175b();
        assert_eq!(balanced_layers_per_virtual_stage(&gpt3, 32), vec![3; 32]);
    }
}
