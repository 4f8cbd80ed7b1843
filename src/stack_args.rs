//! The flags `estimate`, `plan` and `report` share to say what the cost model prices: the
//! training stack (software profile and gradient bucket size) and the compute dtype.

use anyhow::Result;
use clap::ValueEnum;

use autopar_driver::cost_model::{Cluster, Plan};
use autopar_driver::ir::DType;
use autopar_driver::{self as driver};

/// The training stack whose speed a command models.
#[derive(clap::Args)]
pub struct StackArgs {
    /// The training stack whose speed is modelled: autopar (default), megatron-lm-2021,
    /// megatron-lm-2022, megatron-core, nemo, deepspeed, fsdp or torchtitan, with knobs
    /// overridden as `NAME,knob=value` (attention=flash|flash1|fused|unfused,
    /// overlap_grad_reduce, tp_backward_overlap, tp_forward_overlap, tp_comm_overlap,
    /// overlap_param_gather, param_gather=layer|tensor, fusion=fused|eager,
    /// reduce_dtype=bf16|fp32, bucket_mb=MIB, p2p_blocking, sm_carveout, loss=fused|megatron|torch, fp8_recipe=tensor|blockwise, fp8_weight_cache, fp8_params, zero_over_cp, selective=attention|op, cp_attention=ring|eager_ring|all_gather, fp32_grad_accumulation, recompute_early_stop, ep_comm_overlap, tp_relayout_copies, fp8_tp_gather, tp_pipelined_backward_reduce_scatter, dropout).
    /// Replaces a cluster file's `[software]` table.
    #[arg(long, value_name = "PROFILE")]
    pub software: Option<String>,
    /// Price the data-parallel gradient all-reduces as buckets of this many MiB, as the
    /// compiler's --bucket-mb forms them (0: one all-reduce per gradient); overrides the
    /// software profile's `bucket_mb` (autopar: 25; the others bucket by layer).
    #[arg(long, value_name = "MIB", value_parser = crate::spmd_cmd::parse_bucket_mb)]
    pub bucket_mb: Option<f64>,
}

/// The software profile `cluster`'s estimates are priced for, as `--software` takes it
/// (`megatron-core,tp_backward_overlap=true,...`): the profile and every knob it overrides.
pub fn stack_text(cluster: &Cluster) -> String {
    let Some(spec) = &cluster.software else {
        return autopar_driver::cost_model::Software::default().name;
    };
    let mut text = spec.profile.clone();
    if let Ok(serde_json::Value::Object(knobs)) = serde_json::to_value(spec) {
        for (key, value) in knobs.iter().filter(|(k, _)| k.as_str() != "profile") {
            let value = match value {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            text += &format!(",{key}={value}");
        }
    }
    text
}

impl StackArgs {
    /// The cluster `arg` names, with the stack these flags give.
    pub fn cluster(&self, arg: &str) -> Result<Cluster> {
        self.cluster_or(arg, None)
    }

    /// [`StackArgs::cluster`], with the profile `fallback` where `--software` gives none.
    pub fn cluster_or(&self, arg: &str, fallback: Option<&str>) -> Result<Cluster> {
        let software = self.software.as_deref().or(fallback);
        let mut cluster = driver::load_cluster_with(arg, software)?;
        if let Some(mb) = self.bucket_mb {
            driver::set_bucket_mb(&mut cluster, mb)?;
        }
        Ok(cluster)
    }
}

/// The compute dtype of a plan, fp8 included.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ComputeDtype {
    Bf16,
    /// Transformer-Engine-style fp8 GEMMs in the layers, bf16 elsewhere.
    #[value(alias = "f8")]
    Fp8,
    #[value(alias = "f16")]
    Fp16,
    #[value(alias = "f32")]
    Fp32,
}

impl ComputeDtype {
    /// The dtype of everything but fp8's GEMMs.
    pub fn dtype(self) -> DType {
        match self {
            ComputeDtype::Bf16 | ComputeDtype::Fp8 => DType::BF16,
            ComputeDtype::Fp16 => DType::F16,
            ComputeDtype::Fp32 => DType::F32,
        }
    }

    /// Whether the layers' GEMMs run in fp8.
    pub fn fp8(self) -> bool {
        self == ComputeDtype::Fp8
    }

    /// Sets `plan`'s dtype to this one.
    pub fn apply(self, plan: &mut Plan) {
        plan.dtype = self.dtype();
        plan.fp8 = self.fp8();
    }
}
