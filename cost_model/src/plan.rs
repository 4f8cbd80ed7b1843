//! A parallel training plan: mesh shape (dp, tp, pp, cp, ep), virtual stages, batch sizes,
//! ZeRO stage, activation recompute, sequence parallelism, schedule and dtype, parsed from
//! `dp=8,tp=8,pp=16,mbs=1,recompute=full,...`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use autopar_ir::schedule::ScheduleKind;
use autopar_ir::{DType, axis};

use crate::error::CostError;
use crate::layer::LayerPlacement;
use crate::model::TransformerConfig;

/// Which activations are recomputed in the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute only the attention core (scores, softmax, dropout) as in Korthikanti et al.
    Selective,
    /// Keep each layer's input only and rerun the whole layer forward in the backward.
    Full,
}

impl Recompute {
    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// Where a rank's training state lives besides its GPU ([`Plan::offload`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Offload {
    /// Everything on the GPU.
    #[default]
    None,
    /// ZeRO-Offload (Ren et al., USENIX ATC 2021): the fp32 master weights, the Adam
    /// moments and the fp32 gradients of the rank's ZeRO shard live in host memory; each
    /// micro-batch's reduced gradient shard goes down over PCIe as the backward produces it,
    /// the optimizer step runs on the CPU, and the updated 16-bit weights come back up. Built
    /// on ZeRO-2 (or 3): it needs `zero=2` or `zero=3`.
    Optimizer,
    /// Parameters too (PyTorch FSDP's `CPUOffload(offload_params=True)`, DeepSpeed ZeRO-3's
    /// `offload_param`): the rank's fp32 parameter shard stays on the host, every all-gather
    /// of a layer's weights is preceded by the copy of the shard to the GPU, and the GPU
    /// keeps no weights, gradients or optimizer state between uses. Needs `zero=3`.
    Params,
}

impl Offload {
    /// The offload a plan key's value names, or the error text that says what is expected.
    pub fn parse(v: &str) -> Result<Offload, String> {
        match v {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "params" => Ok(Offload::Params),
            _ => Err(format!("expected none, optimizer or params, not `{v}`")),
        }
    }

    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
        }
    }

    /// Every value, least offloaded first.
    pub const ALL: [Offload; 3] = [Offload::None, Offload::Optimizer, Offload::Params];

    fn is_none(&self) -> bool {
        *self == Offload::None
    }
}

/// A plan. `dp * tp * pp * cp` devices are used; `ep` divides `dp` (experts are sharded over
/// data-parallel ranks, as in Megatron-LM).
///
/// In JSON an unknown field is an error, so that a misspelt key in a hand-written plan file
/// is not silently dropped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages (ranks).
    pub pp: usize,
    /// Model chunks per pipeline rank.
    pub vpp: usize,
    /// Context-parallel degree (sequence split for attention).
    pub cp: usize,
    /// Expert-parallel degree.
    pub ep: usize,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Sequences per step over all data-parallel ranks.
    pub global_batch: usize,
    /// ZeRO stage 0-3.
    pub zero_stage: u8,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Sequence parallelism in the tensor-parallel regions.
    pub sequence_parallel: bool,
    /// Pipeline schedule.
    pub schedule: ScheduleKind,
    /// Compute dtype.
    pub dtype: DType,
    /// Transformer-Engine-style fp8 training (`dtype=fp8`): the GEMMs of the transformer
    /// layers take fp8 operands with per-tensor scales and run at the device's fp8 rate;
    /// everything else (attention, norms, the head, communication, master weights) stays in
    /// `dtype` (bf16). Refused on a device without fp8 peak.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp8: bool,
    /// Mesh axes outermost first; the last is on consecutive devices.
    pub axis_order: Vec<String>,
    /// Layers of each virtual stage, when the user fixes them; otherwise the cost model
    /// balances them ([`crate::estimate::balanced_layers_per_virtual_stage`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_layers: Option<Vec<usize>>,
    /// The intra-op placement of every layer's ops over the tensor-parallel ranks
    /// ([`LayerPlacement`]; `attn=` and `mlp=` in the text form): Megatron-LM's by default.
    #[serde(default, skip_serializing_if = "LayerPlacement::is_megatron")]
    pub layer: LayerPlacement,
    /// CPU offload of the optimizer state, or of the parameters as well (`offload=`).
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// Expert tensor parallelism (`etp=`): over how many of the `tp` ranks each expert's
    /// GEMMs are split, Megatron-Core's `--expert-tensor-parallel-size`; `None` is `tp`,
    /// its default. It divides `tp`; the other `tp / etp` ranks of a tensor-parallel group
    /// hold the same expert shards and take their own tokens (they join the experts'
    /// data-parallel group, as Megatron-Core's expert data-parallel size
    /// `dp * tp / (ep * etp)` counts them). See [`Plan::expert_tp`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<usize>,
    /// Under `recompute=full`, how many layers of each virtual stage recompute
    /// (`recompute_layers=N`): its first `N`, the others keeping every activation, as
    /// Megatron-LM's `--recompute-method block --recompute-num-layers N` does in each model
    /// chunk (NeMo's `activations_checkpoint_num_layers`; torchtitan's every-`k`-th-layer
    /// checkpointing stores and repeats the same amounts with `N` a `1/k` share of the
    /// stage's layers). `None`: every layer. Trades the recompute time of the layers left
    /// out for their activations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_layers: Option<usize>,
}

/// The most devices a plan or a cluster may have, the bound of a device mesh: beyond every
/// machine built, and small enough that products of degrees and device counts cannot
/// overflow.
pub const MAX_DEVICES: usize = autopar_ir::mesh::MAX_DEVICES;

/// The largest global batch, in sequences, a plan or a search accepts.
pub const MAX_GLOBAL_BATCH: usize = 1 << 24;

/// The `key=value` items of a comma-separated list, trimmed: an empty list is no items, but
/// an empty item inside a list (`dp=2,,tp=2`, `,,,`) or one without `=` is an error naming
/// it. Plans, pins and cluster options are all read with it.
pub fn key_values(s: &str) -> Result<Vec<(&str, &str)>, KeyValueError> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(str::trim)
        .enumerate()
        .map(|(i, part)| {
            if part.is_empty() {
                return Err(KeyValueError {
                    item: s.to_string(),
                    message: format!("item {} is empty", i + 1),
                });
            }
            let (k, v) = part.split_once('=').ok_or_else(|| KeyValueError {
                item: part.to_string(),
                message: "expected key=value".into(),
            })?;
            Ok((k.trim(), v.trim()))
        })
        .collect()
}

/// A malformed item of a `key=value` list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValueError {
    /// The item (or the whole list for an empty item).
    pub item: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for KeyValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.item, self.message)
    }
}

impl std::error::Error for KeyValueError {}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            dp: 1,
            tp: 1,
            pp: 1,
            vpp: 1,
            cp: 1,
            ep: 1,
            micro_batch_size: 1,
            global_batch: 1,
            zero_stage: 0,
            recompute: Recompute::None,
            sequence_parallel: false,
            schedule: ScheduleKind::OneFOneB,
            dtype: DType::BF16,
            fp8: false,
            axis_order: Plan::DEFAULT_ORDER.iter().map(|s| s.to_string()).collect(),
            stage_layers: None,
            layer: LayerPlacement::MEGATRON,
            offload: Offload::None,
            etp: None,
            recompute_layers: None,
        }
    }
}

/// The layers of each virtual stage as `stages=` spells them (`0-12-12-...-0`): counts
/// joined by `-`, each positive but for the first virtual stage's, which may hold the
/// embedding alone, and the last's, which may hold the head alone (Llama 3's pipeline;
/// Megatron-Core's `--account-for-embedding-in-pipeline-split` and
/// `--account-for-loss-in-pipeline-split`).
pub fn parse_stage_layers(v: &str) -> Result<Vec<usize>, String> {
    let layers: Result<Vec<usize>, _> = v.split('-').map(|x| x.trim().parse::<usize>()).collect();
    let inner_positive = |l: &[usize]| match l.len() {
        0 => false,
        1 => l[0] > 0,
        n => l[1..n - 1].iter().all(|&x| x > 0) && l.iter().sum::<usize>() > 0,
    };
    match layers {
        Ok(l) if inner_positive(&l) => Ok(l),
        _ => Err(format!(
            "expected layer counts joined by `-`, positive but for the first and last virtual \
             stages (the embedding's and the head's), not `{v}`"
        )),
    }
}

impl Plan {
    /// Megatron-LM's placement: `tp` fastest, then `cp`, `ep`, `dp`, and `pp` slowest.
    pub const DEFAULT_ORDER: [&'static str; 5] = [axis::PP, axis::DP, axis::EP, axis::CP, axis::TP];

    /// Parses `key=value` pairs separated by commas. Keys: `dp tp pp vpp cp ep mbs`
    /// (`micro_batch`), `gbs` (`batch`), `zero` (0-3), `recompute` (none|selective|full),
    /// `sp` (true|false), `schedule` (gpipe|1f1b|interleaved), `dtype` (bf16|fp16|f16|f32|fp8),
    /// `order` (axes outermost first joined by `-`, e.g. `pp-dp-tp`), `stages` (layers of each
    /// virtual stage joined by `-`, e.g. `stages=13-14-14-13`), `attn` and `mlp` (the
    /// ops' placement over `tp`, see [`LayerPlacement`]: `attn=tp|seq|ulysses` or three
    /// letters `t`/`s` for QKV, core and projection, `mlp=tp|seq` or two letters for the MLP's
    /// input and output GEMMs), `offload` (none|optimizer|params, [`Offload`]), `etp`
    /// (expert tensor parallelism, [`Plan::etp`]) and `recompute_layers` (how many layers
    /// of each virtual stage `recompute=full` covers, [`Plan::recompute_layers`]). Omitted
    /// keys take their defaults; the global batch defaults to `dp * mbs` (the CLI sets it from `--batch`);
    /// `vpp > 1` without a schedule means `interleaved`.
    ///
    /// ```
    /// # use autopar_cost_model::Plan;
    /// let p = Plan::parse("dp=8,tp=8,pp=16,vpp=2,mbs=1,recompute=full,gbs=1536").unwrap();
    /// assert_eq!(p.micro_batches(), 192);
    /// assert_eq!(p.world_size(), 1024);
    /// assert_eq!(Plan::parse(&p.to_string()).unwrap(), p);
    /// ```
    pub fn parse(s: &str) -> Result<Plan, CostError> {
        let mut p = Plan::default();
        let mut gbs = None;
        let mut schedule = None;
        let mut seen: Vec<&str> = Vec::new();
        let items = key_values(s).map_err(|e| CostError::PlanSyntax {
            key: e.item,
            message: e.message,
        })?;
        for part in items {
            let (k, v) = part;
            let err = |message: String| CostError::PlanSyntax {
                key: k.to_string(),
                message,
            };
            let canonical = match k {
                "micro_batch" => "mbs",
                "batch" | "global_batch" => "gbs",
                k => k,
            };
            if seen.contains(&canonical) {
                return Err(err("given twice".into()));
            }
            seen.push(canonical);
            let num = || -> Result<usize, CostError> {
                match v.parse::<usize>() {
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(err(format!("expected a positive integer, not `{v}`"))),
                }
            };
            match k {
                axis::DP => p.dp = num()?,
                axis::TP => p.tp = num()?,
                axis::PP => p.pp = num()?,
                "vpp" => p.vpp = num()?,
                axis::CP => p.cp = num()?,
                axis::EP => p.ep = num()?,
                "etp" => p.etp = Some(num()?),
                "recompute_layers" => p.recompute_layers = Some(num()?),
                "offload" => p.offload = Offload::parse(v).map_err(err)?,
                "mbs" | "micro_batch" => p.micro_batch_size = num()?,
                "gbs" | "batch" | "global_batch" => gbs = Some(num()?),
                "zero" => {
                    p.zero_stage = match v {
                        "0" => 0,
                        "1" => 1,
                        "2" => 2,
                        "3" => 3,
                        _ => return Err(err(format!("expected 0, 1, 2 or 3, not `{v}`"))),
                    }
                }
                "recompute" => {
                    p.recompute = match v {
                        "none" => Recompute::None,
                        "selective" => Recompute::Selective,
                        "full" => Recompute::Full,
                        _ => {
                            return Err(err(format!(
                                "expected none, selective or full, not `{v}`"
                            )));
                        }
                    }
                }
                "sp" => {
                    p.sequence_parallel = match v {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => return Err(err(format!("expected true or false, not `{v}`"))),
                    }
                }
                "schedule" => schedule = Some(v.parse().map_err(|e| err(format!("{e}")))?),
                "dtype" => {
                    p.fp8 = matches!(v, "fp8" | "f8");
                    p.dtype = match v {
                        "bf16" | "fp8" | "f8" => DType::BF16,
                        "fp16" | "f16" => DType::F16,
                        "fp32" | "f32" => DType::F32,
                        _ => {
                            return Err(err(format!("expected bf16, fp16, f32 or fp8, not `{v}`")));
                        }
                    }
                }
                "attn" => p.layer.set_attention(v).map_err(err)?,
                "mlp" => p.layer.set_mlp(v).map_err(err)?,
                "stages" => p.stage_layers = Some(parse_stage_layers(v).map_err(err)?),
                "order" => {
                    let axes: Vec<String> = v.split('-').map(|a| a.trim().to_string()).collect();
                    let mut sorted = axes.clone();
                    sorted.sort();
                    sorted.dedup();
                    if sorted.len() != axes.len()
                        || axes
                            .iter()
                            .any(|a| !Plan::DEFAULT_ORDER.contains(&a.as_str()))
                    {
                        return Err(err(format!(
                            "expected distinct axes among pp, dp, ep, cp, tp joined by `-`, not `{v}`"
                        )));
                    }
                    // Axes left out keep their default relative order, outermost.
                    let mut order: Vec<String> = Plan::DEFAULT_ORDER
                        .iter()
                        .filter(|a| !axes.iter().any(|x| x == *a))
                        .map(|a| a.to_string())
                        .collect();
                    order.extend(axes);
                    p.axis_order = order;
                }
                _ => {
                    return Err(err(
                        "unknown key (expected dp, tp, pp, vpp, cp, ep, etp, mbs, gbs, zero, \
                         offload, recompute, recompute_layers, sp, schedule, dtype, order, \
                         stages, attn or mlp)"
                            .into(),
                    ));
                }
            }
        }
        p.schedule = schedule.unwrap_or(if p.vpp > 1 {
            ScheduleKind::Interleaved
        } else {
            ScheduleKind::OneFOneB
        });
        p.global_batch = gbs.unwrap_or(p.dp * p.micro_batch_size);
        p.check()?;
        Ok(p)
    }

    /// Consistency of the plan on its own (not against a model or cluster): degrees whose
    /// product is a device count, a global batch of whole micro-batches on every
    /// data-parallel rank, and keys that agree with each other.
    pub fn check(&self) -> Result<(), CostError> {
        let mis = |m: String| Err(CostError::PlanMismatch(m));
        let degrees = [
            (axis::DP, self.dp),
            (axis::TP, self.tp),
            (axis::PP, self.pp),
            ("vpp", self.vpp),
            (axis::CP, self.cp),
            (axis::EP, self.ep),
            ("mbs", self.micro_batch_size),
        ];
        if let Some((key, _)) = degrees.iter().find(|(_, d)| *d == 0) {
            return Err(CostError::PlanSyntax {
                key: key.to_string(),
                message: "must be at least 1".into(),
            });
        }
        if self.zero_stage > 3 {
            return Err(CostError::PlanSyntax {
                key: "zero".into(),
                message: format!("stage {} does not exist (0, 1, 2 or 3)", self.zero_stage),
            });
        }
        let world = [self.dp, self.tp, self.pp, self.cp]
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if world.is_none_or(|w| w > MAX_DEVICES) {
            return mis(format!(
                "dp x tp x pp x cp is above {MAX_DEVICES} devices, the most a plan may use"
            ));
        }
        if self.pp.saturating_mul(self.vpp) > MAX_DEVICES {
            return mis(format!("pp x vpp is above {MAX_DEVICES} virtual stages"));
        }
        if self.global_batch == 0 || self.global_batch > MAX_GLOBAL_BATCH {
            return Err(CostError::PlanSyntax {
                key: "gbs".into(),
                message: format!(
                    "the global batch must be 1 to {MAX_GLOBAL_BATCH} sequences, not {}",
                    self.global_batch
                ),
            });
        }
        let replicas = self.dp.saturating_mul(self.micro_batch_size);
        if !self.global_batch.is_multiple_of(replicas) {
            return mis(format!(
                "a global batch of {} sequences is not whole micro-batches of mbs={} on dp={} \
                 ranks (it must be a multiple of dp x mbs = {replicas})",
                self.global_batch, self.micro_batch_size, self.dp
            ));
        }
        if let Some(etp) = self.etp {
            if etp == 0 {
                return Err(CostError::PlanSyntax {
                    key: "etp".into(),
                    message: "must be at least 1".into(),
                });
            }
            if !self.tp.is_multiple_of(etp) {
                return mis(format!(
                    "etp={etp} does not divide tp={}: expert tensor parallelism splits each \
                     expert over some of the tensor-parallel ranks",
                    self.tp
                ));
            }
            if etp < self.tp && !self.sequence_parallel {
                return mis(format!(
                    "etp={etp} below tp={} needs sp=true: the experts take the sequence \
                     shards of the tensor-parallel ranks (Megatron-Core requires sequence \
                     parallelism for MoE with tp above 1)",
                    self.tp
                ));
            }
        }
        // Expert parallelism takes the tensor-parallel ranks that hold the same expert
        // shards first (`tp / etp` of them), then data-parallel ranks.
        let folded = self.ep_over_tp();
        let replicas = self.tp / self.expert_tp();
        if !replicas.is_multiple_of(folded)
            || !self.ep.is_multiple_of(folded)
            || !self.dp.is_multiple_of(self.ep / folded)
        {
            return mis(match replicas {
                1 => format!("ep={} does not divide dp={}", self.ep, self.dp),
                r => format!(
                    "ep={} does not fit dp={} with etp={} below tp={}: the {r} \
                     tensor-parallel ranks holding the same expert shards join expert \
                     parallelism first, so ep must divide {r} or be {r} times a divisor of dp",
                    self.ep,
                    self.dp,
                    self.expert_tp(),
                    self.tp
                ),
            });
        }
        match self.recompute_layers {
            Some(0) => {
                return Err(CostError::PlanSyntax {
                    key: "recompute_layers".into(),
                    message: "must be at least 1 (recompute=none recomputes no layer)".into(),
                });
            }
            Some(n) if self.recompute != Recompute::Full => {
                return mis(format!(
                    "recompute_layers={n} says how many layers of each virtual stage \
                     recompute=full covers: it needs recompute=full, not recompute={}",
                    self.recompute.name()
                ));
            }
            _ => {}
        }
        match self.offload {
            Offload::None => {}
            Offload::Optimizer if self.zero_stage < 2 => {
                return mis(format!(
                    "offload=optimizer moves the ZeRO-2/3 shards of the optimizer state and \
                     gradients to the host: it needs zero=2 or zero=3, not zero={}",
                    self.zero_stage
                ));
            }
            Offload::Params if self.zero_stage < 3 => {
                return mis(format!(
                    "offload=params keeps the parameter shards on the host and gathers them \
                     per layer: it needs zero=3, not zero={}",
                    self.zero_stage
                ));
            }
            Offload::Optimizer | Offload::Params => {}
        }
        if self.vpp > 1 && self.schedule != ScheduleKind::Interleaved {
            return mis(format!("vpp={} needs schedule=interleaved", self.vpp));
        }
        if self.tp == 1 && !self.layer.is_megatron() {
            return mis(format!(
                "{} places ops over tp: it needs tp above 1",
                self.layer
            ));
        }
        if let Some(l) = &self.stage_layers
            && l.len() != self.pp * self.vpp
        {
            return mis(format!(
                "stages gives {} virtual stages, pp x vpp is {}",
                l.len(),
                self.pp * self.vpp
            ));
        }
        Ok(())
    }

    /// A virtual stage's `layers` split into those that run under the plan's recompute
    /// policy and those that keep every activation: all of them under the policy, except
    /// under `recompute=full` with [`Plan::recompute_layers`], which covers at most its
    /// first `N`.
    pub fn recompute_split(&self, layers: usize) -> (usize, usize) {
        let under = match (self.recompute, self.recompute_layers) {
            (Recompute::Full, Some(n)) => n.min(layers),
            _ => layers,
        };
        (under, layers - under)
    }

    /// The recompute policy as tables show it: `none`, `selective`, `full`, or `full:N` for
    /// full recompute of the first `N` layers of each virtual stage.
    pub fn recompute_label(&self) -> String {
        match (self.recompute, self.recompute_layers) {
            (Recompute::Full, Some(n)) => format!("full:{n}"),
            (r, _) => r.name().to_string(),
        }
    }

    /// Expert tensor parallelism: [`Plan::etp`], or `tp` when it is not given.
    pub fn expert_tp(&self) -> usize {
        self.etp.unwrap_or(self.tp).max(1)
    }

    /// How many of an expert-parallel group's `ep` ranks are tensor-parallel ranks: with
    /// expert tensor parallelism below `tp`, the `tp / etp` ranks of a tensor-parallel group
    /// that hold the same expert shards are the first members of expert parallelism
    /// (Megatron-Core's MoE parallel folding: expert ranks run `etp`, then `ep`, then expert
    /// data parallelism over the `tp x dp` ranks of a stage), so `ep` may exceed `dp` (tp=2,
    /// etp=1, ep=32 on dp=16, as Megatron-Bridge runs Qwen3-235B-A22B); the rest of `ep` is
    /// data-parallel ranks. 1 without expert tensor parallelism below `tp`.
    pub fn ep_over_tp(&self) -> usize {
        let replicas = (self.tp / self.expert_tp()).max(1);
        self.ep.clamp(1, replicas)
    }

    /// Whether Megatron-Core runs this plan of `cfg` with its expert all-to-alls overlapped
    /// (`--overlap-moe-expert-parallel-comm`, [`crate::Software::ep_comm_overlap`]): only for
    /// mixtures of experts with expert parallelism, without full recomputation of whole
    /// layers, in 16-bit, and under pipeline parallelism only with virtual stages (the
    /// assertions of `TransformerConfig.__post_init__`, `megatron/core/transformer/
    /// transformer_config.py`).
    pub fn overlaps_expert_all_to_alls(&self, cfg: &TransformerConfig) -> bool {
        cfg.experts > 1
            && self.ep > 1
            && self.recompute != Recompute::Full
            && matches!(self.dtype, DType::BF16 | DType::F16)
            && (self.pp == 1 || self.schedule == ScheduleKind::Interleaved)
    }

    /// The data-parallel ranks of an expert-parallel group: `ep` over [`Plan::ep_over_tp`].
    pub fn ep_over_dp(&self) -> usize {
        (self.ep / self.ep_over_tp()).max(1)
    }

    /// Devices used.
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.pp * self.cp
    }

    /// Micro-batches per pipeline per step ([`Plan::check`] refuses a global batch that
    /// `dp * mbs` does not divide; such a batch is rounded up here).
    pub fn micro_batches(&self) -> usize {
        self.global_batch
            .div_ceil((self.dp * self.micro_batch_size).max(1))
            .max(1)
    }

    /// Mesh axes, outermost first, as `(name, size)`; `dp` here is the data-parallel degree
    /// outside the expert axis (`dp / ep`), and `ep` the expert-parallel ranks the
    /// data-parallel ones hold ([`Plan::ep_over_dp`]; the others are tensor-parallel ranks).
    pub fn mesh_axes(&self) -> Vec<(String, usize)> {
        self.axis_order
            .iter()
            .map(|a| {
                let size = match a.as_str() {
                    axis::PP => self.pp,
                    axis::DP => self.dp / self.ep_over_dp(),
                    axis::EP => self.ep_over_dp(),
                    axis::CP => self.cp,
                    axis::TP => self.tp,
                    _ => 1,
                };
                (a.clone(), size)
            })
            .collect()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp={},tp={},pp={},vpp={},cp={},ep={},mbs={},gbs={},zero={},recompute={},sp={},schedule={},dtype={},order={}",
            self.dp,
            self.tp,
            self.pp,
            self.vpp,
            self.cp,
            self.ep,
            self.micro_batch_size,
            self.global_batch,
            self.zero_stage,
            self.recompute.name(),
            self.sequence_parallel,
            self.schedule,
            if self.fp8 {
                "fp8".to_string()
            } else {
                self.dtype.to_string()
            },
            self.axis_order.join("-")
        )?;
        if let Some(l) = &self.stage_layers {
            let l: Vec<String> = l.iter().map(|n| n.to_string()).collect();
            write!(f, ",stages={}", l.join("-"))?;
        }
        if self.layer.attention_code() != "ttt" {
            write!(f, ",attn={}", self.layer.attention_code())?;
        }
        if self.layer.mlp_code() != "tt" {
            write!(f, ",mlp={}", self.layer.mlp_code())?;
        }
        if self.offload != Offload::None {
            write!(f, ",offload={}", self.offload.name())?;
        }
        if let Some(etp) = self.etp {
            write!(f, ",etp={etp}")?;
        }
        if let Some(n) = self.recompute_layers {
            write!(f, ",recompute_layers={n}")?;
        }
        Ok(())
    }
}

impl FromStr for Plan {
    type Err = CostError;
    fn from_str(s: &str) -> Result<Plan, CostError> {
        Plan::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_issue_example() {
        let p =
            Plan::parse("dp=8,tp=8,pp=16,mbs=1,recompute=full,schedule=interleaved,vpp=2,gbs=1536")
                .unwrap();
        assert_eq!((p.dp, p.tp, p.pp, p.vpp), (8, 8, 16, 2));
        assert_eq!(p.recompute, Recompute::Full);
        assert_eq!(p.schedule, ScheduleKind::Interleaved);
        assert_eq!(p.micro_batches(), 192);
        assert_eq!(p.dtype, DType::BF16);
        assert_eq!(p.mesh_axes()[0], ("pp".to_string(), 16));
        assert_eq!(p.mesh_axes()[4], ("tp".to_string(), 8));
    }

    /// `recompute_layers` bounds the layers `recompute=full` covers in each virtual stage,
    /// survives the text form, and is refused without full recompute.
    #[test]
    fn partial_full_recompute() {
        let p = Plan::parse("pp=2,recompute=full,recompute_layers=3").unwrap();
        assert_eq!(p.recompute_layers, Some(3));
        assert_eq!(
            (p.recompute_split(8), p.recompute_split(2)),
            ((3, 5), (2, 0))
        );
        assert_eq!(Plan::parse(&p.to_string()).unwrap(), p);
        assert_eq!(p.recompute_label(), "full:3");
        let all = Plan::parse("recompute=full").unwrap();
        assert_eq!(all.recompute_label(), "full");
        assert_eq!(all.recompute_split(8), (8, 0));
        assert!(!all.to_string().contains("recompute_layers"));
        for r in ["none", "selective"] {
            let p = Plan::parse(&format!("recompute={r}")).unwrap();
            assert_eq!(p.recompute_split(8), (8, 0));
            let e = Plan::parse(&format!("recompute={r},recompute_layers=2")).unwrap_err();
            assert!(
                matches!(&e, CostError::PlanMismatch(m) if m.contains("needs recompute=full")),
                "{e}"
            );
        }
    }

    #[test]
    fn only_the_end_stages_may_hold_no_layers() {
        assert_eq!(parse_stage_layers("0-2-2-0"), Ok(vec![0, 2, 2, 0]));
        assert_eq!(parse_stage_layers("3-0"), Ok(vec![3, 0]));
        assert_eq!(parse_stage_layers("4"), Ok(vec![4]));
        for bad in ["0", "0-0", "1-0-1", "2--2", "a-1", ""] {
            let e = parse_stage_layers(bad).unwrap_err();
            assert!(e.contains("first and last"), "{bad}: {e}");
        }
        let p = Plan::parse("pp=2,stages=0-4").unwrap();
        assert_eq!(p.stage_layers, Some(vec![0, 4]));
        assert!(p.to_string().contains("stages=0-4"));
    }

    #[test]
    fn errors_name_the_key() {
        for (s, key) in [
            ("dp=0", "dp"),
            ("tp=x", "tp"),
            ("zero=4", "zero"),
            ("recompute=some", "recompute"),
            ("sp=maybe", "sp"),
            ("schedule=zigzag", "schedule"),
            ("colour=red", "colour"),
            ("order=tp-tp", "order"),
            ("offload=disk", "offload"),
            ("etp=0", "etp"),
            ("recompute=full,recompute_layers=0", "recompute_layers"),
            ("recompute_layers=x", "recompute_layers"),
        ] {
            match Plan::parse(s) {
                Err(CostError::PlanSyntax { key: k, .. }) => assert_eq!(k, key, "{s}"),
                other => panic!("{s}: {other:?}"),
            }
        }
        assert!(Plan::parse("dp=2").is_ok());
        assert_eq!(Plan::parse("dp=2,mbs=2,gbs=8").unwrap().micro_batches(), 2);
        // A batch that is not whole micro-batches on every rank would be padded silently.
        assert!(matches!(
            Plan::parse("dp=2,mbs=2,gbs=6"),
            Err(CostError::PlanMismatch(_))
        ));
        for s in [
            "dp=2,dp=4",
            "mbs=2,micro_batch=2",
            "gbs=8,batch=8",
            ",,,",
            "dp=2,,tp=2",
        ] {
            assert!(
                matches!(Plan::parse(s), Err(CostError::PlanSyntax { .. })),
                "{s}"
            );
        }
        assert!(matches!(
            Plan::parse("vpp=2,schedule=1f1b"),
            Err(CostError::PlanMismatch(_))
        ));
        assert!(matches!(
            Plan::parse("dp=4,ep=3"),
            Err(CostError::PlanMismatch(_))
        ));
    }

    #[test]
    fn offload_and_etp_parse_round_trip_and_are_checked() {
        let p = Plan::parse("dp=8,zero=2,offload=optimizer").unwrap();
        assert_eq!(p.offload, Offload::Optimizer);
        assert_eq!(Plan::parse(&p.to_string()).unwrap(), p);
        let p = Plan::parse("dp=8,zero=3,offload=params,tp=4,etp=2,sp=true").unwrap();
        assert_eq!((p.offload, p.expert_tp()), (Offload::Params, 2));
        assert_eq!(Plan::parse(&p.to_string()).unwrap(), p);
        assert_eq!(Plan::parse("tp=4").unwrap().expert_tp(), 4);
        for (bad, says) in [
            ("dp=8,zero=1,offload=optimizer", "zero=2 or zero=3"),
            ("dp=8,zero=2,offload=params", "needs zero=3"),
            ("tp=4,etp=3,sp=true", "does not divide tp=4"),
            ("tp=4,etp=2", "needs sp=true"),
        ] {
            match Plan::parse(bad) {
                Err(CostError::PlanMismatch(m)) => assert!(m.contains(says), "{bad}: {m}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn order_moves_axes_inward() {
        let p = Plan::parse("dp=2,tp=2,order=tp-dp").unwrap();
        let names: Vec<_> = p.mesh_axes().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["pp", "ep", "cp", "tp", "dp"]);
        assert_eq!(Plan::parse(&p.to_string()).unwrap(), p);
    }
}
