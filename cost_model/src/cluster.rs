//! Cluster descriptions: nodes of identical accelerators joined by an intra-node fabric
//! (NVLink/NVSwitch) and NICs, read from TOML or from presets such as `dgx-a100:nodes=4`.
//!
//! # TOML format
//!
//! Bandwidths are in decimal GB/s (1e9 bytes per second), capacities in GiB, latencies in
//! microseconds. Fabric and NIC bandwidths are *bus bandwidths* as nccl-tests reports them
//! for large messages (see [`crate::comm`]), not line rates.
//!
//! ```toml
//! name = "dgx-a100"            # optional
//! nodes = 4
//! gpus_per_node = 8
//!
//! [gpu]
//! model = "A100-SXM4-80GB"
//! hbm_capacity_gib = 80.0
//! hbm_bandwidth_gb_per_s = 2039.0
//! reserved_gib = 2.0           # optional: CUDA context, library workspaces, allocator slack
//! sms = 108                    # optional: streaming multiprocessors (enables wave quantisation)
//! arch = "ampere"              # optional: ampere, hopper, blackwell (attention kernel speed)
//!
//! [gpu.peak_tflops]            # dense (no 2:4 sparsity)
//! bf16 = 312.0
//! f16 = 312.0
//! f32 = 19.5
//! tf32 = 156.0                 # optional
//! fp8 = 624.0                  # optional
//!
//! [gpu.mamf_tflops]            # optional: measured maximum achievable matmul TFLOP/s
//! bf16 = 271.2
//! fp8 = 540.0                  # optional
//! [intra_node]
//! fabric = "nvswitch"
//! bus_bandwidth_gb_per_s = 230.0
//! latency_us = 1.0
//! nvls_algbw_gb_per_s = 291.0  # optional: NVLink SHARP all-reduce (Hopper NVSwitch)
//! nvls_chunk_kib = 128         # optional: NCCL_NVLS_CHUNKSIZE in KiB (NCCL's default)
//!
//! [network]
//! nics_per_node = 8
//! nic_bus_bandwidth_gb_per_s = 24.0
//! latency_us = 5.0
//! gpu_to_nic = [0, 1, 2, 3, 4, 5, 6, 7]   # optional: NIC index of each local GPU
//!
//! [host]                       # optional: for CPU offload (`offload=` in a plan)
//! memory_gib = 2048.0
//! memory_bandwidth_gb_per_s = 409.6
//! pcie_gb_per_s = 25.0         # effective, one direction, one host link
//! gpus_per_pcie_link = 2
//! ```
//!
//! An optional top-level `runtime` names the software that executes plans on the cluster,
//! as far as memory is concerned: `"mixed-precision-gpu"` (the default; a Megatron-LM-style
//! stack, see [`crate::memory`]) or `"autopar-cpu"` (this project's CPU runtime, what the
//! `cpu:ranks=N` preset describes). An optional `[software]` table names the training stack
//! whose speed is modelled: `profile = "deepspeed"` and any of its knobs
//! (`overlap_param_gather = true`, ...), as `--software` takes them ([`crate::software`]).
//!
//! `cost_model/clusters/dgx-a100.toml` is a complete example.

use serde::{Deserialize, Serialize};

use crate::software::SoftwareSpec;

use autopar_ir::DType;

use crate::error::CostError;

/// Peak dense FLOP/s of one device per dtype, in TFLOP/s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTflops {
    /// IEEE fp32 without tensor cores.
    pub f32: f64,
    /// TF32 tensor-core math (used for fp32 matmuls when enabled); optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tf32: Option<f64>,
    /// bfloat16.
    pub bf16: f64,
    /// fp16.
    pub f16: f64,
    /// fp8; optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<f64>,
}

/// An accelerator's architecture generation, as far as kernels care: Hopper and later
/// have warpgroup tensor-core instructions (`wgmma`) and TMA that kernels written for Ampere
/// (FlashAttention 1 and 2) do not use, so those reach a smaller fraction of the peak there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuArch {
    /// NVIDIA Ampere (A100): the generation the FlashAttention 1/2 kernels were tuned for.
    Ampere,
    /// NVIDIA Hopper (H100, H200, GH200).
    Hopper,
    /// NVIDIA Blackwell (B200, GB200).
    Blackwell,
    /// Anything else (CPUs, other vendors): kernels are priced as on Ampere.
    #[default]
    Other,
}

impl GpuArch {
    /// Whether cuBLAS's GEMM kernels for this generation are persistent: launched as one CTA
    /// per SM, each looping over output tiles (the warp-specialised sm90 and sm100 kernels;
    /// on Ampere a GEMM launches a CTA per tile, so a concurrent kernel only takes SMs as
    /// tiles retire). A collective that holds SMs beside a persistent GEMM pushes part of
    /// it into a second wave ([`crate::comm::CommParams::persistent_gemm_slowdown`]).
    pub fn persistent_gemms(self) -> bool {
        matches!(self, GpuArch::Hopper | GpuArch::Blackwell)
    }

    /// The model-FLOPs utilisation in 16-bit training that published large runs on this
    /// generation stay below: a prediction above it is reported with the mechanisms it rests
    /// on. Ampere 0.60 (Korthikanti et al. 2022 reach 56.3% on 3072 A100s for 1T, Table 5;
    /// MegaScale, NSDI 2024, 55.2% on A100 for 175B; small data-parallel runs go further,
    /// llm-foundry's MPT-7B reaching 64.2% on 8 A100-80GB without recomputation, reference
    /// table); Hopper 0.55 (Megatron-Core's weak scaling tops at 49% on H100, reference
    /// table; Llama 3 405B ran at 38-43%). `None` where no figure is collected.
    pub fn published_mfu_ceiling(self) -> Option<f64> {
        match self {
            GpuArch::Ampere => Some(0.60),
            GpuArch::Hopper => Some(0.55),
            GpuArch::Blackwell | GpuArch::Other => None,
        }
    }

    fn is_default(&self) -> bool {
        *self == GpuArch::default()
    }

    /// Whether the tensor cores apply per-block scales of fp8 operands themselves (Blackwell's
    /// `tcgen05` block-scaled MMA, which MXFP8 uses and Transformer Engine's block-scaling
    /// recipe runs on: TransformerEngine#2157); on Hopper the scaling runs on the CUDA cores.
    pub fn block_scaled_mma(self) -> bool {
        self == GpuArch::Blackwell
    }

    /// Whether the architecture has tensor-core paths that Ampere-era kernels leave unused.
    pub fn has_warpgroup_mma(self) -> bool {
        matches!(self, GpuArch::Hopper | GpuArch::Blackwell)
    }
}

/// The measured maximum achievable matmul throughput of one device (the best `torch.matmul`
/// over a brute-force search of shapes, ml-engineering's MAMF finder), in TFLOP/s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MamfTflops {
    /// bf16 (and fp16) GEMMs.
    pub bf16: f64,
    /// fp8 (e4m3) GEMMs; optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<f64>,
    /// The share of these maxima that a long training run sustains on this GPU: the finder
    /// times each shape for about 150 iterations, a few tens of milliseconds, before the
    /// power limit pulls the clock down to where a run of hours settles. Without it,
    /// [`crate::compute::ComputeParams::gemm_sustained_fraction`] (0.863, the A100's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sustained: Option<f64>,
}

/// One accelerator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// Model name, for reports.
    pub model: String,
    /// Dense peak throughput per dtype.
    pub peak_tflops: PeakTflops,
    /// HBM capacity.
    pub hbm_capacity_gib: f64,
    /// HBM bandwidth.
    pub hbm_bandwidth_gb_per_s: f64,
    /// Memory not available to tensors (CUDA context, cuBLAS/NCCL workspaces, allocator
    /// fragmentation).
    #[serde(default)]
    pub reserved_gib: f64,
    /// Streaming multiprocessors; when given, GEMM times include wave quantisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms: Option<usize>,
    /// Architecture generation (`ampere`, `hopper`, `blackwell`; default `other`, priced as
    /// Ampere): which attention kernels reach which fraction of the peak.
    #[serde(default, skip_serializing_if = "GpuArch::is_default")]
    pub arch: GpuArch,
    /// Measured maximum achievable matmul TFLOP/s (`[gpu.mamf_tflops]`, `bf16 = ...`,
    /// `fp8 = ...`): the ceiling of every GEMM. Without it the ceiling is a default fraction
    /// of the datasheet peak ([`crate::compute::ComputeParams::gemm_ceiling_default`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mamf_tflops: Option<MamfTflops>,
    /// The board power the device is rated for and its matmul maximum was measured at, W
    /// (the datasheet's maximum TDP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tdp_w: Option<f64>,
    /// The power limit the device runs under, W, where it is set below `tdp_w`
    /// (`nvidia-smi -pl`, or a platform's default): see [`GpuSpec::power_clock_share`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_limit_w: Option<f64>,
}

impl GpuSpec {
    /// The share of its rated clock the tensor cores keep under
    /// [`GpuSpec::power_limit_w`]: `(limit / tdp)^(1/3)`, 1 without a limit below the rating.
    /// Under matmul load the power limit already binds at the rated power (the sustained
    /// share of [`MamfTflops::sustained`]), so a lower limit lowers the clock further; the
    /// dynamic power of CMOS logic is `C V^2 f` and along the voltage-frequency curve the
    /// voltage rises about linearly with the clock, so the power goes as the cube of the
    /// clock and the clock as the cube root of the power. Leakage, which does not fall with
    /// the clock, would make the loss larger; the voltage floor at low clocks, smaller. A
    /// check from the MAMF table: the A100 PCIe (300 W) reaches 252.9 TFLOP/s where the SXM
    /// part (400 W) reaches 271.2, 0.933 of it; the cube root of 300/400 gives 0.909.
    pub fn power_clock_share(&self) -> f64 {
        match (self.tdp_w, self.power_limit_w) {
            (Some(tdp), Some(limit)) if limit < tdp => (limit / tdp).cbrt(),
            _ => 1.0,
        }
    }
}

/// The fabric joining the devices of one node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricSpec {
    /// `nvswitch`, `nvlink`, `pcie`, `shared-memory`, ...
    pub fabric: String,
    /// Bus bandwidth of large ring collectives among the node's devices.
    pub bus_bandwidth_gb_per_s: f64,
    /// Latency of one step of a collective.
    pub latency_us: f64,
    /// NVLink SHARP (NVLS): the switch reduces, so an all-reduce inside a node moves each
    /// byte once to the switch and once back, at this *algorithm* bandwidth whatever the
    /// group size (nccl-tests' busbw is then `algbw * 2(n-1)/n`, above the line rate).
    /// Absent where the switches cannot reduce (NVSwitch before Hopper, PCIe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvls_algbw_gb_per_s: Option<f64>,
    /// The largest chunk, KiB, NCCL moves per NVLink SHARP step (`NCCL_NVLS_CHUNKSIZE`);
    /// absent, NCCL's default of 128. AWS's EFA plugin sets 512 on its P5 and later
    /// instances (aws-ofi-nccl `src/platform-aws.cpp`), which NCCL loads with the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvls_chunk_kib: Option<u32>,
}

/// The NICs of a node and the network behind them (assumed non-blocking, rail-optimised).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// NICs used for application traffic.
    pub nics_per_node: usize,
    /// Bus bandwidth one NIC sustains in large inter-node collectives.
    pub nic_bus_bandwidth_gb_per_s: f64,
    /// Latency of one inter-node step.
    pub latency_us: f64,
    /// NIC index of each local device; default spreads devices evenly over the NICs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_to_nic: Option<Vec<usize>>,
}

/// The host side of a node, for CPU offload ([`crate::plan::Offload`]): its memory, the
/// bandwidth of that memory (which a CPU optimizer step is bound by), and the PCIe links
/// between the GPUs and the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Host (CPU) memory of one node, GiB.
    pub memory_gib: f64,
    /// Peak DRAM bandwidth of the node's CPU sockets together (channels x transfer rate x
    /// 8 bytes), decimal GB/s.
    pub memory_bandwidth_gb_per_s: f64,
    /// Effective bandwidth of one host PCIe link in one direction, as a pinned-memory
    /// `cudaMemcpy` reaches it (about 80% of the line rate: 25 of Gen4 x16's 31.5 GB/s,
    /// 50 of Gen5 x16's 63), decimal GB/s.
    pub pcie_gb_per_s: f64,
    /// GPUs sharing one PCIe link to the host (behind one PCIe switch): their copies divide
    /// its bandwidth when they run at once, as every rank's offload traffic does.
    pub gpus_per_pcie_link: usize,
}

/// The software that executes plans on a cluster, where it changes what the cost model
/// predicts (which bytes a rank keeps; see [`crate::memory`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// A Megatron-LM-style GPU stack: 16-bit weights with fp32 master weights, fp32
    /// gradient buffers allocated up front, dropout, fused kernels, NCCL communicators. The
    /// calibration against published measurements uses it.
    #[default]
    MixedPrecisionGpu,
    /// autopar's CPU runtime: the step graph's fp32 parameters are the master weights,
    /// gradients exist from the moment the backward produces them, no dropout, attention
    /// and the cross-entropy gradient decomposed into IR ops, in-process collectives.
    AutoparCpu,
}

impl Runtime {
    fn is_default(&self) -> bool {
        *self == Runtime::default()
    }
}

/// A homogeneous cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Name for reports.
    #[serde(default)]
    pub name: String,
    /// Number of nodes.
    pub nodes: usize,
    /// Devices per node.
    pub gpus_per_node: usize,
    /// The device.
    pub gpu: GpuSpec,
    /// The intra-node fabric.
    pub intra_node: FabricSpec,
    /// NICs and network.
    pub network: NetworkSpec,
    /// What executes plans here (default: a mixed-precision GPU stack).
    #[serde(default, skip_serializing_if = "Runtime::is_default")]
    pub runtime: Runtime,
    /// The training stack's profile (`[software]`, see [`crate::software`]); `None` is the
    /// default profile, `autopar`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub software: Option<SoftwareSpec>,
    /// Host memory and PCIe (`[host]`), for CPU offload; `None` where not described (a plan
    /// that offloads is then refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostSpec>,
}

const GB: f64 = 1e9;
/// More NICs than any node holds.
const MAX_NICS_PER_NODE: usize = 1024;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

impl Cluster {
    /// Reads a TOML description; errors name the line or the key.
    pub fn from_toml(text: &str) -> Result<Cluster, CostError> {
        let c: Cluster = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|r| text[..r.start.min(text.len())].matches('\n').count() + 1)
                .unwrap_or(0);
            CostError::ClusterSyntax {
                line,
                message: e.message().trim().to_string(),
            }
        })?;
        c.validate()?;
        Ok(c)
    }

    /// The TOML form of this description (parses back to an equal cluster).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }

    /// A preset: `dgx-a100:nodes=N`, `dgx-a100-40gb:nodes=N`, `dgx-h100:nodes=N`,
    /// `hgx-h100-96gb:nodes=N`, `hgx-h200:nodes=N`, `dgx-b200:nodes=N`, the AWS instances
    /// `aws-p4d:nodes=N`, `aws-p4de:nodes=N`, `aws-p5:nodes=N`, `aws-p5e:nodes=N`,
    /// `aws-p5en:nodes=N`, `aws-p6-b200:nodes=N`, or
    /// `cpu:ranks=N`
    /// (options may be omitted: one node, or one rank). GPU presets whose rated power is
    /// known also take `power=W`, a power limit below it ([`GpuSpec::power_limit_w`]).
    pub fn preset(spec: &str) -> Result<Cluster, CostError> {
        let err = |message: String| CostError::Preset {
            preset: spec.to_string(),
            message,
        };
        let (name, opts) = spec.split_once(':').unwrap_or((spec, ""));
        let name = name.trim();
        let gpu = name != "cpu";
        let allowed = if gpu { "nodes" } else { "ranks" };
        let expected = match gpu {
            true => "`nodes` or `power`",
            false => "`ranks`",
        };
        let (mut count, mut power): (Option<usize>, Option<f64>) = (None, None);
        let opts = crate::plan::key_values(opts).map_err(|e| err(e.to_string()))?;
        for (k, v) in opts {
            let (k, v) = (k.trim(), v.trim());
            if k == "power" && gpu {
                if power.is_some() {
                    return Err(err("`power` is given twice".into()));
                }
                let w: f64 = v
                    .parse()
                    .map_err(|_| err(format!("`power` must be a number of watts, not `{v}`")))?;
                power = Some(w);
                continue;
            }
            if k != allowed {
                return Err(err(format!("unknown option `{k}` (expected {expected})")));
            }
            if count.is_some() {
                return Err(err(format!("`{allowed}` is given twice")));
            }
            let n: usize = v
                .parse()
                .map_err(|_| err(format!("`{allowed}` must be a positive integer, not `{v}`")))?;
            if n == 0 || n > crate::plan::MAX_DEVICES {
                return Err(err(format!(
                    "`{allowed}` must be 1 to {}, not {n}",
                    crate::plan::MAX_DEVICES
                )));
            }
            count = Some(n);
        }
        let n = count.unwrap_or(1);
        let mut c = match name {
            "dgx-a100" => dgx_a100(n),
            "dgx-h100" => dgx_h100(n),
            "hgx-h100-96gb" => hgx_h100_96gb(n),
            "hgx-h200" => hgx_h200(n),
            "dgx-a100-40gb" => dgx_a100_40gb(n),
            "dgx-b200" => dgx_b200(n),
            "aws-p4d" => aws_p4d(n),
            "aws-p4de" => aws_p4de(n),
            "aws-p5" => aws_p5(n),
            "aws-p5e" => aws_p5e(n),
            "aws-p5en" => aws_p5en(n),
            "aws-p6-b200" => aws_p6_b200(n),
            "cpu" => cpu(n),
            other => {
                return Err(err(format!(
                    "unknown preset `{other}` (expected dgx-a100, dgx-a100-40gb, dgx-h100, \
                     hgx-h100-96gb, hgx-h200, dgx-b200, aws-p4d, aws-p4de, aws-p5, \
                     aws-p5e, aws-p5en, aws-p6-b200 or cpu)"
                )));
            }
        };
        if let Some(w) = power {
            if c.gpu.tdp_w.is_none() {
                return Err(err(format!(
                    "`power` needs the device's rated power, which preset `{name}` does not give"
                )));
            }
            c.gpu.power_limit_w = Some(w);
            c.name = format!("{},power={w}", c.name);
        }
        c.validate().map_err(|e| err(e.to_string()))?;
        Ok(c)
    }

    /// Checks ranges, naming the key at fault.
    pub fn validate(&self) -> Result<(), CostError> {
        let bad = |key: &str, message: &str| {
            Err(CostError::ClusterValue {
                key: key.to_string(),
                message: message.to_string(),
            })
        };
        if let Some(spec) = &self.software
            && let Err(e) = spec.resolve()
        {
            return Err(CostError::ClusterValue {
                key: "software".into(),
                message: e.to_string(),
            });
        }
        let positive = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(key, &format!("must be a positive number, not {v}"))
            }
        };
        if self.nodes == 0 {
            return bad("nodes", "must be at least 1");
        }
        if self.gpus_per_node == 0 {
            return bad("gpus_per_node", "must be at least 1");
        }
        if self
            .nodes
            .checked_mul(self.gpus_per_node)
            .is_none_or(|n| n > crate::plan::MAX_DEVICES)
        {
            return bad(
                "nodes",
                &format!(
                    "{} nodes of {} devices is above {} devices, the most a cluster may have",
                    self.nodes,
                    self.gpus_per_node,
                    crate::plan::MAX_DEVICES
                ),
            );
        }
        // Bounded so that a device's NIC (`local * nics / gpus`) cannot overflow.
        if self.network.nics_per_node > MAX_NICS_PER_NODE {
            return bad(
                "network.nics_per_node",
                &format!(
                    "{} NICs per node is above {MAX_NICS_PER_NODE}",
                    self.network.nics_per_node
                ),
            );
        }
        let p = &self.gpu.peak_tflops;
        positive("gpu.peak_tflops.f32", p.f32)?;
        positive("gpu.peak_tflops.bf16", p.bf16)?;
        positive("gpu.peak_tflops.f16", p.f16)?;
        if let Some(v) = p.tf32 {
            positive("gpu.peak_tflops.tf32", v)?;
        }
        if let Some(v) = p.fp8 {
            positive("gpu.peak_tflops.fp8", v)?;
        }
        positive("gpu.hbm_capacity_gib", self.gpu.hbm_capacity_gib)?;
        positive(
            "gpu.hbm_bandwidth_gb_per_s",
            self.gpu.hbm_bandwidth_gb_per_s,
        )?;
        if !(self.gpu.reserved_gib >= 0.0 && self.gpu.reserved_gib < self.gpu.hbm_capacity_gib) {
            return bad(
                "gpu.reserved_gib",
                "must be at least 0 and below the capacity",
            );
        }
        if self.gpu.sms == Some(0) {
            return bad("gpu.sms", "must be at least 1");
        }
        if let Some(v) = self.gpu.tdp_w {
            positive("gpu.tdp_w", v)?;
        }
        if let Some(v) = self.gpu.power_limit_w {
            positive("gpu.power_limit_w", v)?;
            match self.gpu.tdp_w {
                None => return bad("gpu.power_limit_w", "is given but gpu.tdp_w is not"),
                Some(tdp) if v > tdp => {
                    return bad(
                        "gpu.power_limit_w",
                        &format!("{v} W is above the device's rated {tdp} W (gpu.tdp_w)"),
                    );
                }
                Some(_) => {}
            }
        }
        if let Some(m) = &self.gpu.mamf_tflops {
            positive("gpu.mamf_tflops.bf16", m.bf16)?;
            if m.bf16 > p.bf16 {
                return bad(
                    "gpu.mamf_tflops.bf16",
                    "must not exceed gpu.peak_tflops.bf16 (a measured maximum is below the peak)",
                );
            }
            if let Some(v) = m.fp8 {
                positive("gpu.mamf_tflops.fp8", v)?;
                match p.fp8 {
                    None => {
                        return bad(
                            "gpu.mamf_tflops.fp8",
                            "is given but gpu.peak_tflops.fp8 is not",
                        );
                    }
                    Some(peak) if v > peak => {
                        return bad("gpu.mamf_tflops.fp8", "must not exceed gpu.peak_tflops.fp8");
                    }
                    Some(_) => {}
                }
            }
        }
        positive(
            "intra_node.bus_bandwidth_gb_per_s",
            self.intra_node.bus_bandwidth_gb_per_s,
        )?;
        if let Some(v) = self.intra_node.nvls_algbw_gb_per_s {
            positive("intra_node.nvls_algbw_gb_per_s", v)?;
        }
        if let Some(k) = self.intra_node.nvls_chunk_kib
            && !(16..=65536).contains(&k)
        {
            return bad(
                "intra_node.nvls_chunk_kib",
                "must be between 16 and 65536 (KiB)",
            );
        }
        if !(self.intra_node.latency_us >= 0.0 && self.intra_node.latency_us.is_finite()) {
            return bad("intra_node.latency_us", "must be at least 0");
        }
        if self.network.nics_per_node == 0 {
            return bad("network.nics_per_node", "must be at least 1");
        }
        positive(
            "network.nic_bus_bandwidth_gb_per_s",
            self.network.nic_bus_bandwidth_gb_per_s,
        )?;
        if !(self.network.latency_us >= 0.0 && self.network.latency_us.is_finite()) {
            return bad("network.latency_us", "must be at least 0");
        }
        if let Some(h) = &self.host {
            positive("host.memory_gib", h.memory_gib)?;
            positive(
                "host.memory_bandwidth_gb_per_s",
                h.memory_bandwidth_gb_per_s,
            )?;
            positive("host.pcie_gb_per_s", h.pcie_gb_per_s)?;
            if h.gpus_per_pcie_link == 0 || h.gpus_per_pcie_link > self.gpus_per_node {
                return bad(
                    "host.gpus_per_pcie_link",
                    &format!("must be 1 to gpus_per_node ({})", self.gpus_per_node),
                );
            }
        }
        if let Some(map) = &self.network.gpu_to_nic {
            if map.len() != self.gpus_per_node {
                return bad(
                    "network.gpu_to_nic",
                    &format!(
                        "lists {} devices, gpus_per_node is {}",
                        map.len(),
                        self.gpus_per_node
                    ),
                );
            }
            if let Some(n) = map.iter().find(|&&n| n >= self.network.nics_per_node) {
                return bad(
                    "network.gpu_to_nic",
                    &format!(
                        "names NIC {n}, but nics_per_node is {}",
                        self.network.nics_per_node
                    ),
                );
            }
        }
        Ok(())
    }

    /// Total devices.
    pub fn num_devices(&self) -> usize {
        self.nodes.saturating_mul(self.gpus_per_node)
    }

    /// Node of a global device index.
    pub fn node_of(&self, device: usize) -> usize {
        device / self.gpus_per_node
    }

    /// NIC (within its node) that a device's inter-node traffic uses.
    pub fn nic_of(&self, device: usize) -> usize {
        let local = device % self.gpus_per_node;
        match &self.network.gpu_to_nic {
            Some(map) => map[local],
            None => local * self.network.nics_per_node / self.gpus_per_node,
        }
    }

    /// Dense peak FLOP/s for math in `dtype` (integers and bools run on the fp32 units).
    pub fn peak_flops(&self, dtype: DType) -> f64 {
        let p = &self.gpu.peak_tflops;
        let t = match dtype {
            DType::BF16 => p.bf16,
            DType::F16 => p.f16,
            DType::F32 | DType::I32 | DType::I64 | DType::Bool => p.f32,
        };
        t * 1e12
    }

    /// Dense fp8 peak FLOP/s, where the device has fp8 tensor cores.
    pub fn fp8_peak_flops(&self) -> Option<f64> {
        self.gpu.peak_tflops.fp8.map(|t| t * 1e12)
    }

    /// The most FLOP/s a GEMM in `dtype` (in fp8 when `fp8`) reaches on this device: the
    /// measured maximum achievable matmul rate ([`GpuSpec::mamf_tflops`]), or
    /// `default_fraction` of the peak where the description has no measurement. `None` for
    /// fp8 on a device without fp8 peak.
    pub fn gemm_ceiling_flops(
        &self,
        dtype: DType,
        fp8: bool,
        default_fraction: f64,
    ) -> Option<f64> {
        let mamf = self.gpu.mamf_tflops.as_ref();
        if fp8 {
            let peak = self.fp8_peak_flops()?;
            return Some(
                mamf.and_then(|m| m.fp8)
                    .map_or(peak * default_fraction, |t| t * 1e12),
            );
        }
        let peak = self.peak_flops(dtype);
        Some(match (dtype, mamf) {
            (DType::BF16 | DType::F16, Some(m)) => m.bf16 * 1e12,
            _ => peak * default_fraction,
        })
    }

    /// HBM bandwidth in bytes/s.
    pub fn hbm_bandwidth(&self) -> f64 {
        self.gpu.hbm_bandwidth_gb_per_s * GB
    }

    /// Bytes available to tensors on one device (capacity minus reserved).
    pub fn usable_memory_bytes(&self) -> f64 {
        (self.gpu.hbm_capacity_gib - self.gpu.reserved_gib) * GIB
    }

    /// Intra-node bus bandwidth in bytes/s.
    pub fn intra_bus_bandwidth(&self) -> f64 {
        self.intra_node.bus_bandwidth_gb_per_s * GB
    }

    /// Bus bandwidth of one NIC in bytes/s.
    pub fn nic_bus_bandwidth(&self) -> f64 {
        self.network.nic_bus_bandwidth_gb_per_s * GB
    }

    /// Host-GPU copy bandwidth one device gets, in bytes/s per direction, when every device
    /// of its node copies at once (its link's share); `None` without a `[host]`.
    pub fn pcie_bandwidth_per_gpu(&self) -> Option<f64> {
        self.host
            .as_ref()
            .map(|h| h.pcie_gb_per_s * GB / h.gpus_per_pcie_link.max(1) as f64)
    }

    /// Host memory bandwidth one device's share of the node's CPU work gets, in bytes/s;
    /// `None` without a `[host]`.
    pub fn host_bandwidth_per_gpu(&self) -> Option<f64> {
        self.host
            .as_ref()
            .map(|h| h.memory_bandwidth_gb_per_s * GB / self.gpus_per_node.max(1) as f64)
    }

    /// Host memory of one node, in bytes; `None` without a `[host]`.
    pub fn host_memory_bytes(&self) -> Option<f64> {
        self.host.as_ref().map(|h| h.memory_gib * GIB)
    }
}

/// DGX A100's host: 2 TB of DDR4 (the DGX A100 640 GB datasheet's system memory) on two
/// AMD EPYC 7742 sockets of 8 DDR4-3200 channels each (2 x 8 x 3.2 GT/s x 8 B = 409.6 GB/s,
/// AMD's EPYC 7742 specification); PCIe Gen4 x16 at ~25 GB/s effective per direction (of
/// 31.5 GB/s line rate; `bandwidthTest` with pinned memory), two GPUs behind each of the four
/// PCIe switches that connect them (and their two NICs) to the CPUs (DGX A100 system
/// architecture white paper, Fig. 2).
fn dgx_a100_host() -> HostSpec {
    HostSpec {
        memory_gib: 2048.0,
        memory_bandwidth_gb_per_s: 409.6,
        pcie_gb_per_s: 25.0,
        gpus_per_pcie_link: 2,
    }
}

/// DGX H100's host: 2 TB of DDR5 (DGX H100 datasheet) on two Intel Xeon Platinum 8480C
/// sockets of 8 DDR5-4800 channels each (2 x 8 x 4.8 GT/s x 8 B = 614.4 GB/s, Intel's
/// 8480+ specification); PCIe Gen5 x16 at ~50 GB/s effective per direction (of 63 GB/s line
/// rate), two GPUs per host PCIe switch as on DGX A100 (DGX H100 user guide's system topology).
fn dgx_h100_host() -> HostSpec {
    HostSpec {
        memory_gib: 2048.0,
        memory_bandwidth_gb_per_s: 614.4,
        pcie_gb_per_s: 50.0,
        gpus_per_pcie_link: 2,
    }
}

/// DGX A100 (80 GB): 8x A100-SXM4-80GB on six NVSwitches, 8x ConnectX-6 HDR 200 Gb/s for
/// application traffic (the Selene node of Narayanan et al., SC'21 Sec. 5).
///
/// - 312 TFLOP/s bf16/fp16 dense, 156 TF32, 19.5 fp32; 2039 GB/s HBM2e; 80 GB: NVIDIA A100
///   datasheet (hardware_specs.csv rows "A100 SXM4 80GB ...").
/// - 230 GB/s all-reduce bus bandwidth over NVSwitch for 8 GPUs: NCCL maintainer in
///   github.com/NVIDIA/nccl-tests/issues/149; users measured 232.5 (nccl-tests#175).
/// - ~24 GB/s bus bandwidth per HDR NIC: NCCL maintainer in github.com/NVIDIA/nccl/issues/412.
/// - Latencies (1 us per NVLink step, 5 us per InfiniBand step) are typical small-message
///   figures, not taken from the reference tables.
/// - Maximum achievable bf16 matmul 271.2 TFLOP/s (86.9% of peak): ml-engineering's MAMF
///   finder table (`mlengineering_mamf_gemm.csv`, torch 2.6 / CUDA 12.6).
pub fn dgx_a100(nodes: usize) -> Cluster {
    Cluster {
        name: format!("dgx-a100:nodes={nodes}"),
        nodes,
        gpus_per_node: 8,
        gpu: GpuSpec {
            model: "A100-SXM4-80GB".into(),
            peak_tflops: PeakTflops {
                f32: 19.5,
                tf32: Some(156.0),
                bf16: 312.0,
                f16: 312.0,
                fp8: None,
            },
            hbm_capacity_gib: 80.0,
            hbm_bandwidth_gb_per_s: 2039.0,
            reserved_gib: 2.0,
            sms: Some(108),
            arch: GpuArch::Ampere,
            mamf_tflops: Some(MamfTflops {
                bf16: 271.2,
                fp8: None,
                sustained: None,
            }),
            tdp_w: Some(400.0),
            power_limit_w: None,
        },
        intra_node: FabricSpec {
            fabric: "nvswitch".into(),
            bus_bandwidth_gb_per_s: 230.0,
            latency_us: 1.0,
            nvls_algbw_gb_per_s: None,
            nvls_chunk_kib: None,
        },
        network: NetworkSpec {
            nics_per_node: 8,
            nic_bus_bandwidth_gb_per_s: 24.0,
            latency_us: 5.0,
            gpu_to_nic: None,
        },
        runtime: Runtime::MixedPrecisionGpu,
        software: None,
        host: Some(dgx_a100_host()),
    }
}

/// The share of its measured matmul maximum that a 700 W Hopper GPU (H100 and H200 SXM)
/// sustains over a long training run: 0.72, below the A100's 0.863
/// ([`crate::compute::ComputeParams::gemm_sustained_fraction`]), which Korthikanti et al.'s
/// per-layer times pin on Ampere. Hopper does 1.4 dense TFLOP/s per watt of its limit where
/// the A100 does 0.8, so its power limit binds harder under hours of tensor-core work than in
/// the MAMF finder's milliseconds per shape, and the clock settles further below the
/// finder's. No clock trace of such a run, nor an isolated per-layer measurement on H100, is
/// at hand: 0.72 (572 of the finder's 794.5 TFLOP/s) is where the H100 runs the compute
/// dominates agree. Megatron-Core r0.8's GPT-3 177B runs at 47% MFU on 96 GPUs with next to
/// no pipeline bubble, which the model meets within 5% at 0.72 and 14% too fast at 0.82; its
/// weak-scaling table, read with the virtual stages its pipelined rows must have run
/// (`calibrate::megatron_core_case`), stays within 6% in the median only below 0.73; NeMo
/// 24.07's fp8 table and torchtitan's benchmarks, 9% and 13% too fast at 0.82, come to 2% and
/// 9%; the Llama 3 paper's 405B runs at 8K, with the layout its text gives (no activation
/// checkpointing), are 8% too fast even at 0.72. The cost: llm-foundry's H100 rows are 7% too
/// slow in the median, and Megatron-LM's and Megatron-Bridge's 2025 releases 5-8%: newer
/// stacks reach more of the GPU than Megatron-Core and NeMo of mid-2024 did, by a mechanism
/// the model does not have.
pub const HOPPER_700W_SUSTAINED: f64 = 0.72;

/// DGX H100: 8x H100-SXM5-80GB on four third-generation NVSwitches, 8x ConnectX-7 NDR
/// 400 Gb/s.
///
/// - 989 TFLOP/s bf16/fp16 dense, 1979 fp8, 494.7 TF32; 3.35 TB/s HBM3; 80 GB: NVIDIA H100
///   datasheet (hardware_specs.csv). fp32 (67 TFLOP/s) is the datasheet's non-tensor figure.
/// - 370 GB/s bus bandwidth for ring collectives over NVLink4 (450 GB/s line rate minus
///   protocol overhead): NCCL maintainer in github.com/NVIDIA/nccl-tests/issues/212. NVLink
///   SHARP all-reduce reaches ~480; the ring figure is used for every collective.
/// - 48 GB/s per NDR NIC: NCCL maintainer in github.com/NVIDIA/nccl-tests/issues/267.
/// - NVLink SHARP all-reduce at ~275 GB/s algorithm bandwidth for large messages (busbw
///   ~480 on 8 GPUs): the same maintainer statement (nccl-tests#212). NCCL moves them in
///   128 KiB steps, each paying the step's release (`comm::NVLS_STEP_SYNC_US`), so the
///   switch's own rate is 291 GB/s.
/// - Maximum achievable matmul 794.5 TFLOP/s bf16 (80.3%), 1402.6 fp8 (70.9%): the MAMF
///   finder table (torch 2.7 / CUDA 12.6), of which a long run sustains
///   [`HOPPER_700W_SUSTAINED`].
pub fn dgx_h100(nodes: usize) -> Cluster {
    Cluster {
        name: format!("dgx-h100:nodes={nodes}"),
        nodes,
        gpus_per_node: 8,
        gpu: GpuSpec {
            model: "H100-SXM5-80GB".into(),
            peak_tflops: PeakTflops {
                f32: 67.0,
                tf32: Some(494.7),
                bf16: 989.0,
                f16: 989.0,
                fp8: Some(1979.0),
            },
            hbm_capacity_gib: 80.0,
            hbm_bandwidth_gb_per_s: 3350.0,
            reserved_gib: 2.0,
            sms: Some(132),
            arch: GpuArch::Hopper,
            mamf_tflops: Some(MamfTflops {
                bf16: 794.5,
                fp8: Some(1402.6),
                sustained: Some(HOPPER_700W_SUSTAINED),
            }),
            tdp_w: Some(700.0),
            power_limit_w: None,
        },
        intra_node: FabricSpec {
            fabric: "nvswitch".into(),
            bus_bandwidth_gb_per_s: 370.0,
            latency_us: 1.0,
            nvls_algbw_gb_per_s: Some(291.0),
            nvls_chunk_kib: None,
        },
        network: NetworkSpec {
            nics_per_node: 8,
            nic_bus_bandwidth_gb_per_s: 48.0,
            latency_us: 5.0,
            gpu_to_nic: None,
        },
        runtime: Runtime::MixedPrecisionGpu,
        software: None,
        host: Some(dgx_h100_host()),
    }
}

/// HGX H200: the H100 node with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 datasheet,
/// hardware_specs.csv); same compute and NVLink4 (900 GB/s) as H100, 8x NDR 400 Gb/s NICs
/// assumed as on DGX H100. Capacity is the 140 GiB the driver exposes of the 141 GB.
/// Maximum achievable fp8 matmul 1453.4 TFLOP/s (MAMF table, H200 SXM row); the table has no
/// H200 bf16 row, so the H100's 794.5 (the same die at the same 700 W) is kept.
pub fn hgx_h200(nodes: usize) -> Cluster {
    let mut c = dgx_h100(nodes);
    c.name = format!("hgx-h200:nodes={nodes}");
    c.gpu.model = "H200-SXM-141GB".into();
    c.gpu.hbm_capacity_gib = 140.0;
    c.gpu.hbm_bandwidth_gb_per_s = 4800.0;
    c.gpu.mamf_tflops = Some(MamfTflops {
        bf16: 794.5,
        fp8: Some(1453.4),
        sustained: Some(HOPPER_700W_SUSTAINED),
    });
    c
}

/// HGX H100 with the 96 GB HBM2e part that torchtitan's published benchmarks ran on
/// (`benchmarks/llama3_h100_202412_torchtitan.md` and `asyncTP_llama3_h100_2025-06_torchtitan.md`
/// in github.com/pytorch/torchtitan: Meta's Grand Teton hosts, "96GB HBM2e with 2.4 TB/sec
/// peak memory bandwidth", 400 Gb/s of RDMA per GPU, "the default 500W power limit"): the
/// H100 SXM die (the same peaks, SMs and matmul maximum at 700 W) with 96 GiB at 2.4 TB/s,
/// limited to 500 W ([`GpuSpec::power_clock_share`]; `power=700` lifts it). The RDMA NICs
/// are priced as DGX H100's 400 Gb/s ones.
pub fn hgx_h100_96gb(nodes: usize) -> Cluster {
    let mut c = dgx_h100(nodes);
    c.name = format!("hgx-h100-96gb:nodes={nodes}");
    c.gpu.model = "H100-SXM5-96GB-HBM2e".into();
    c.gpu.hbm_capacity_gib = 96.0;
    c.gpu.hbm_bandwidth_gb_per_s = 2400.0;
    c.gpu.power_limit_w = Some(500.0);
    c
}

/// One GH200 superchip's GPU (the Hopper die of H100 with 132 SMs, 989 TFLOP/s bf16 and
/// 1979 fp8 dense, NVIDIA GH200 datasheet) in the 141 GB HBM3e version the MAMF table's
/// GH200 row names ("900W 141GiB HBM3e version"), at the 4.8 TB/s of H200's 141 GB of HBM3e
/// (hardware_specs.csv; the datasheet's 144 GB version has 4.9). Maximum achievable matmul 828.6 TFLOP/s
/// bf16 and 1535 fp8 (MAMF table, GH200 row), above the H100's 794.5 at its higher power
/// limit. For single-GPU figures: the node around it is the DGX H100's.
pub fn gh200_gpu() -> Cluster {
    let mut c = dgx_h100(1);
    c.name = "gh200-gpu".into();
    c.gpus_per_node = 1;
    c.gpu.model = "GH200-141GB".into();
    c.gpu.hbm_capacity_gib = 140.0;
    c.gpu.hbm_bandwidth_gb_per_s = 4800.0;
    c.gpu.mamf_tflops = Some(MamfTflops {
        bf16: 828.6,
        fp8: Some(1535.0),
        sustained: None,
    });
    // The module's 900 W covers the Grace CPU as well; the GPU's own share is not stated.
    c.gpu.tdp_w = None;
    // The Grace CPU's 480 GB of LPDDR5X at up to 512 GB/s, reached over NVLink-C2C at
    // 450 GB/s per direction (NVIDIA GH200 datasheet: 900 GB/s bidirectional).
    c.host = Some(HostSpec {
        memory_gib: 480.0,
        memory_bandwidth_gb_per_s: 512.0,
        pcie_gb_per_s: 450.0,
        gpus_per_pcie_link: 1,
    });
    c
}

/// One A100 PCIe 80 GB (the A100 die, 108 SMs, 312 TFLOP/s bf16 dense; 1935 GB/s of HBM2e:
/// NVIDIA A100 datasheet, PCIe 80GB column). Maximum achievable bf16 matmul 252.9 TFLOP/s
/// (MAMF table, A100 PCIe row), below the SXM part's 271.2 at its 300 W limit. For
/// single-GPU figures: the node around it is the DGX A100's.
pub fn a100_pcie_gpu() -> Cluster {
    let mut c = dgx_a100(1);
    c.name = "a100-pcie-gpu".into();
    c.gpus_per_node = 1;
    c.gpu.model = "A100-PCIe-80GB".into();
    c.gpu.hbm_bandwidth_gb_per_s = 1935.0;
    c.gpu.mamf_tflops = Some(MamfTflops {
        bf16: 252.9,
        fp8: None,
        sustained: None,
    });
    // 300 W: the datasheet's PCIe 80GB column.
    c.gpu.tdp_w = Some(300.0);
    // Alone in the node: its Gen4 x16 link is its own.
    c.host = Some(HostSpec {
        gpus_per_pcie_link: 1,
        ..dgx_a100_host()
    });
    c
}

/// DGX A100 with the 40 GB part: 1555 GB/s of HBM2 (hardware_specs.csv, A100 bandwidth row)
/// and 1 TB of host memory (the DGX A100 320 GB datasheet), otherwise the 80 GB node.
pub fn dgx_a100_40gb(nodes: usize) -> Cluster {
    let mut c = dgx_a100(nodes);
    c.name = format!("dgx-a100-40gb:nodes={nodes}");
    c.gpu.model = "A100-SXM4-40GB".into();
    c.gpu.hbm_capacity_gib = 40.0;
    c.gpu.hbm_bandwidth_gb_per_s = 1555.0;
    c.host = Some(HostSpec {
        memory_gib: 1024.0,
        ..dgx_a100_host()
    });
    c
}

/// DGX B200: 8x B200 (Blackwell, 148 SMs) on NVLink5 switches, 8x ConnectX-7 400 Gb/s.
///
/// - 2250 TFLOP/s bf16 dense, 4500 fp8, 1125 TF32; 180 GB HBM3e at 8 TB/s: NVIDIA DGX B200
///   datasheet (1440 GB of GPU memory over 8 GPUs, 64 TB/s aggregate HBM bandwidth).
///   fp32 (75 TFLOP/s non-tensor) is the datasheet's per-GPU figure.
/// - Maximum achievable matmul 1745 TFLOP/s bf16, 3432.5 fp8: MAMF finder table.
/// - Ring bus bandwidth 680 GB/s and NVLink SHARP algorithm bandwidth 487 GB/s: the plateaus
///   of ml-engineering's nccl-tests sweep on 8x B200 (NCCL 2.27.7, 8 GiB: ring 673-682 GB/s
///   busbw with NVLS off, 838 with NVLS on 8 GPUs = 479 algbw in 512 KiB steps, each
///   paying its release, `comm::NVLS_STEP_SYNC_US`), 76% and 54% of NVLink5's 900 GB/s per
///   direction. The sweep ran on AWS instances, whose 512 KiB NVLS chunk
///   ([`aws_p6_b200`]) this preset does not take: with NCCL's 128 KiB an 8 GiB all-reduce
///   is priced at 798 GB/s busbw.
/// - 48 GB/s per 400 Gb/s NIC, as NDR on DGX H100.
/// - Host: 2 TB of DDR5 (the datasheet's base configuration, which goes to 4 TB) on two Xeon Platinum 8570 sockets of 8 DDR5-5600 channels (2 x 8 x 5.6 GT/s x
///   8 B = 716.8 GB/s); PCIe Gen5 as on DGX H100.
pub fn dgx_b200(nodes: usize) -> Cluster {
    let mut c = dgx_h100(nodes);
    c.name = format!("dgx-b200:nodes={nodes}");
    c.gpu = GpuSpec {
        model: "B200-SXM-180GB".into(),
        peak_tflops: PeakTflops {
            f32: 75.0,
            tf32: Some(1125.0),
            bf16: 2250.0,
            f16: 2250.0,
            fp8: Some(4500.0),
        },
        hbm_capacity_gib: 178.0,
        hbm_bandwidth_gb_per_s: 8000.0,
        reserved_gib: 2.0,
        sms: Some(148),
        arch: GpuArch::Blackwell,
        mamf_tflops: Some(MamfTflops {
            bf16: 1745.0,
            fp8: Some(3432.5),
            sustained: None,
        }),
        tdp_w: None,
        power_limit_w: None,
    };
    c.intra_node.bus_bandwidth_gb_per_s = 680.0;
    c.intra_node.nvls_algbw_gb_per_s = Some(487.0);
    c.host = Some(HostSpec {
        memory_bandwidth_gb_per_s: 716.8,
        ..dgx_h100_host()
    });
    c
}

/// AWS p4d.24xlarge: DGX A100 40 GB's GPUs and NVSwitch fabric (8x A100-SXM4-40GB on
/// NVLink3, AWS's instance page) with four 100 Gb/s Elastic Fabric Adapters (EFA v1, 400 Gb/s
/// per instance) in place of eight HDR NICs: all-reduce tests reach about 340 Gb/s of them
/// (ml-engineering `network/README.md`, EFA: "EFA v1 0.4Tbps (effective 340Gbps for
/// all_reduce tests)"), 10.6 GB/s per adapter, a quarter of a DGX A100's per-node inter-node
/// bandwidth. Two GPUs share each adapter (`gpu_to_nic` spreads them evenly). Host: the
/// instance's 1152 GiB, its two Cascade Lake sockets' six DDR4-2933 channels each (2 x 6 x
/// 2.933 GT/s x 8 B = 281.6 GB/s), PCIe Gen4 as on DGX A100. EFA's per-step latency is priced
/// as InfiniBand's: the 4-node P6-B200 sweep of `mlengineering_allreduce_busbw.csv` fits it.
pub fn aws_p4d(nodes: usize) -> Cluster {
    let mut c = dgx_a100_40gb(nodes);
    c.name = format!("aws-p4d:nodes={nodes}");
    c.network.nics_per_node = 4;
    c.network.nic_bus_bandwidth_gb_per_s = 340.0 / 8.0 / 4.0;
    c.host = Some(HostSpec {
        memory_gib: 1152.0,
        memory_bandwidth_gb_per_s: 281.6,
        ..dgx_a100_host()
    });
    c
}

/// AWS p4de.24xlarge: [`aws_p4d`] with the 80 GB A100 (DGX A100's GPUs, 2039 GB/s HBM2e).
pub fn aws_p4de(nodes: usize) -> Cluster {
    let mut c = aws_p4d(nodes);
    let gpu = dgx_a100(1).gpu;
    c.name = format!("aws-p4de:nodes={nodes}");
    c.gpu = gpu;
    c
}

/// AWS p5.48xlarge: DGX H100's GPUs and NVLink4 fabric (8x H100-SXM5-80GB) with thirty-two
/// 100 Gb/s EFA v2 adapters, four per GPU (AWS's instance page; ml-engineering
/// `network/README.md`: "EFA v2 3.2Tbps ... 32 100GbE (4x28G) NICs"), priced as one rail per
/// GPU at 44.6 GB/s: NCCL's ring all-reduce across four of these nodes plateaus at 357.0 GB/s
/// bus bandwidth at 8 GiB (nccl-tests, 1000 iterations: github.com/crazyguitar/
/// aws-gpu-communication-benchmark `data/nccl_all_reduce.csv` at 4fdb5a4f), 89% of the
/// adapters' line rate where EFA v3 on p5en reaches 91%; the same sweep's 8, 16 and 32 nodes
/// are not used here (`cost_model/tests/comm.rs` checks the preset against them). Host: 2 TiB
/// (AWS's instance page) on two third-generation EPYC (7R13) sockets of eight DDR4-3200
/// channels each (2 x 8 x 3.2 GT/s x 8 B = 409.6 GB/s), PCIe Gen5 as on DGX H100. NVLink
/// SHARP steps of 512 KiB, as AWS's EFA plugin sets them on p5 and p5e (aws-ofi-nccl
/// `src/platform-aws.cpp`).
pub fn aws_p5(nodes: usize) -> Cluster {
    let mut c = dgx_h100(nodes);
    c.name = format!("aws-p5:nodes={nodes}");
    c.intra_node.nvls_chunk_kib = Some(AWS_NVLS_CHUNK_KIB);
    c.network.nics_per_node = 8;
    c.network.nic_bus_bandwidth_gb_per_s = 357.0 / 8.0;
    c.host = Some(HostSpec {
        memory_gib: 2048.0,
        memory_bandwidth_gb_per_s: 409.6,
        ..dgx_h100_host()
    });
    c
}

/// AWS p5e.48xlarge: [`aws_p5`] with HGX H200's GPUs (141 GB, 4.8 TB/s; AWS's instance page
/// lists the same EFA v2 adapters and host).
pub fn aws_p5e(nodes: usize) -> Cluster {
    let mut c = aws_p5(nodes);
    c.name = format!("aws-p5e:nodes={nodes}");
    c.gpu = hgx_h200(1).gpu;
    c
}

/// AWS p5en.48xlarge: HGX H200 (8x H200 on NVLink4) with sixteen 200 Gb/s EFA v3 adapters,
/// two per GPU. An adapter sustains 193.7 Gb/s in `ib_write_bw` over SRD (96.9% of line
/// rate; ml-engineering `network/README.md`, measured on p5en.48xlarge, 2026-08-07): the two
/// of a GPU are priced as one rail of 2 x 24.2 = 48.4 GB/s, as NCCL drives them. Host: 2 TiB
/// (AWS's instance page) on Sapphire Rapids sockets, priced as DGX H100's. That source's
/// 4-node all-reduce (32 ranks, 4 GiB, NCCL's ring: 364.65 GB/s bus bandwidth) is not used
/// here; `cost_model/tests/comm.rs` checks the preset against it. AWS's EFA plugin sets
/// NCCL's NVLink SHARP chunk to 512 KiB on these instances (aws-ofi-nccl
/// `src/platform-aws.cpp`, `NCCL_NVLS_CHUNKSIZE`).
pub fn aws_p5en(nodes: usize) -> Cluster {
    let mut c = hgx_h200(nodes);
    c.name = format!("aws-p5en:nodes={nodes}");
    c.intra_node.nvls_chunk_kib = Some(AWS_NVLS_CHUNK_KIB);
    c.network.nics_per_node = 8;
    c.network.nic_bus_bandwidth_gb_per_s = 2.0 * 193.72 / 8.0;
    c
}

/// AWS p6-b200.48xlarge: DGX B200's GPUs and NVLink5 fabric with eight 400 Gb/s EFA v4
/// adapters, one per GPU (AWS's instance page; ml-engineering `network/README.md`), priced
/// at DGX B200's 48 GB/s per NIC: the 4-node all-reduce sweep of
/// `mlengineering_allreduce_busbw.csv`, run on these instances, plateaus at 381.8 GB/s bus
/// bandwidth, 47.7 per adapter. Host: 2 TiB, priced as DGX B200's. NVLink SHARP steps of
/// 512 KiB, as AWS's EFA plugin sets them (see [`aws_p5en`]).
pub fn aws_p6_b200(nodes: usize) -> Cluster {
    let mut c = dgx_b200(nodes);
    c.name = format!("aws-p6-b200:nodes={nodes}");
    c.intra_node.nvls_chunk_kib = Some(AWS_NVLS_CHUNK_KIB);
    c
}

/// `NCCL_NVLS_CHUNKSIZE` that aws-ofi-nccl's platform table (`src/platform-aws.cpp`, entries
/// `p5/p5e`, `p5en/p6-b200` and later) sets when NCCL loads it, KiB.
const AWS_NVLS_CHUNK_KIB: u32 = 512;

/// The CPU runtime: `ranks` threads of one process, each treated as a device. The numbers
/// are deliberately modest, for one core per rank: 20 GFLOP/s fp32 (about a tenth of what an
/// AVX-512 GEMM reaches on one core, leaving room for small shapes and shared cores),
/// 10 GFLOP/s for bf16/fp16 (converted to fp32 by the kernels), 10 GB/s of memory bandwidth,
/// 16 GiB per rank, in-process collectives at 5 GB/s with 10 us per step, nothing
/// reserved (the executor counts tensor bytes only), and the memory behaviour of the CPU
/// runtime ([`Runtime::AutoparCpu`]).
pub fn cpu(ranks: usize) -> Cluster {
    Cluster {
        name: format!("cpu:ranks={ranks}"),
        nodes: 1,
        gpus_per_node: ranks,
        gpu: GpuSpec {
            model: "cpu-thread".into(),
            peak_tflops: PeakTflops {
                f32: 0.02,
                tf32: None,
                bf16: 0.01,
                f16: 0.01,
                fp8: None,
            },
            hbm_capacity_gib: 16.0,
            hbm_bandwidth_gb_per_s: 10.0,
            reserved_gib: 0.0,
            sms: None,
            arch: GpuArch::Other,
            mamf_tflops: None,
            tdp_w: None,
            power_limit_w: None,
        },
        intra_node: FabricSpec {
            fabric: "shared-memory".into(),
            bus_bandwidth_gb_per_s: 5.0,
            latency_us: 10.0,
            nvls_algbw_gb_per_s: None,
            nvls_chunk_kib: None,
        },
        network: NetworkSpec {
            nics_per_node: 1,
            nic_bus_bandwidth_gb_per_s: 1.0,
            latency_us: 50.0,
            gpu_to_nic: None,
        },
        runtime: Runtime::AutoparCpu,
        software: None,
        host: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_file_parses_and_matches_the_preset() {
        let text = include_str!("../clusters/dgx-a100.toml");
        let c = Cluster::from_toml(text).unwrap();
        let mut p = Cluster::preset("dgx-a100:nodes=4").unwrap();
        p.name = c.name.clone();
        assert_eq!(c, p);
        assert_eq!(c.num_devices(), 32);
        assert_eq!(c.peak_flops(DType::BF16), 312e12);
        assert_eq!(Cluster::from_toml(&c.to_toml()).unwrap(), c);
    }

    #[test]
    fn presets_parse() {
        assert_eq!(
            Cluster::preset("dgx-h100:nodes=2").unwrap().num_devices(),
            16
        );
        let h200 = Cluster::preset("hgx-h200").unwrap();
        assert_eq!(h200.nodes, 1);
        assert!(h200.gpu.hbm_capacity_gib > 100.0);
        let cpu = Cluster::preset("cpu:ranks=4").unwrap();
        assert_eq!(cpu.num_devices(), 4);
        assert_eq!(cpu.nodes, 1);
        for bad in [
            "tpu:nodes=1",
            "dgx-a100:nodes=0",
            "dgx-a100:ranks=2",
            "dgx-a100:nodes=x",
            "cpu:nodes=2",
        ] {
            assert!(
                matches!(Cluster::preset(bad), Err(CostError::Preset { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn errors_name_the_line_and_key() {
        let text = include_str!("../clusters/dgx-a100.toml");
        let broken = text.replace("gpus_per_node = 8", "gpus_per_node = \"eight\"");
        match Cluster::from_toml(&broken) {
            Err(CostError::ClusterSyntax { line, .. }) => {
                let expected = broken.lines().position(|l| l.contains("eight")).unwrap() + 1;
                assert_eq!(line, expected);
            }
            other => panic!("{other:?}"),
        }
        let negative = text.replace("bf16 = 312.0", "bf16 = -1.0");
        let e = Cluster::from_toml(&negative).unwrap_err();
        assert!(e.to_string().contains("gpu.peak_tflops.bf16"), "{e}");
        let unknown = text.replace("nodes = 4", "nodes = 4\ncolour = \"green\"");
        assert!(
            Cluster::from_toml(&unknown)
                .unwrap_err()
                .to_string()
                .contains("colour")
        );
        let nic = text.replace("latency_us = 5.0", "latency_us = 5.0\ngpu_to_nic = [0, 1]");
        assert!(
            Cluster::from_toml(&nic)
                .unwrap_err()
                .to_string()
                .contains("network.gpu_to_nic")
        );
        // An NVLS chunk NCCL would not run is refused; the AWS presets' round-trips.
        let chunk = text.replace("latency_us = 1.0", "latency_us = 1.0\nnvls_chunk_kib = 4");
        let e = Cluster::from_toml(&chunk).unwrap_err().to_string();
        assert!(e.contains("intra_node.nvls_chunk_kib"), "{e}");
        let p6 = Cluster::preset("aws-p6-b200:nodes=2").unwrap();
        assert_eq!(p6.intra_node.nvls_chunk_kib, Some(512));
        assert!(p6.to_toml().contains("nvls_chunk_kib = 512"));
        assert_eq!(Cluster::from_toml(&p6.to_toml()).unwrap(), p6);
    }

    /// A power limit below the rating keeps the cube root of its share of the clock; the
    /// presets take it as `power=W`, torchtitan's 96 GB H100 starts at its 500 W, and the
    /// description round-trips through TOML. A limit above the rating, or without one, is
    /// refused with the key at fault.
    #[test]
    fn power_limits_lower_the_clock_by_their_cube_root() {
        let full = Cluster::preset("dgx-h100:nodes=2").unwrap();
        assert_eq!(full.gpu.tdp_w, Some(700.0));
        assert_eq!(full.gpu.power_clock_share(), 1.0);
        let capped = Cluster::preset("dgx-h100:nodes=2,power=500").unwrap();
        assert_eq!(capped.num_devices(), 16);
        assert!((capped.gpu.power_clock_share() - (500.0f64 / 700.0).cbrt()).abs() < 1e-12);
        assert!(capped.name.contains("power=500"), "{}", capped.name);
        assert_eq!(Cluster::from_toml(&capped.to_toml()).unwrap(), capped);
        let tt = Cluster::preset("hgx-h100-96gb:nodes=4").unwrap();
        assert_eq!(tt.num_devices(), 32);
        assert_eq!(tt.gpu.power_limit_w, Some(500.0));
        assert_eq!(tt.gpu.hbm_bandwidth_gb_per_s, 2400.0);
        let lifted = Cluster::preset("hgx-h100-96gb:power=700").unwrap();
        assert_eq!(lifted.gpu.power_clock_share(), 1.0);
        // The A100 PCIe / SXM pair of the MAMF table: 0.933 measured, 0.909 by the law.
        let mut pcie = dgx_a100(1);
        pcie.gpu.power_limit_w = Some(300.0);
        let law = pcie.gpu.power_clock_share();
        assert!((law - 0.909).abs() < 0.001 && (law - 252.9 / 271.2).abs() < 0.03);
        for (spec, want) in [
            ("dgx-h100:power=800", "above the device's rated 700 W"),
            ("dgx-h100:power=lots", "`power` must be a number of watts"),
            ("dgx-h100:power=500,power=600", "`power` is given twice"),
            ("dgx-h100:power=0", "gpu.power_limit_w"),
            ("dgx-b200:power=800", "does not give"),
            ("cpu:ranks=2,power=100", "unknown option `power`"),
        ] {
            let e = Cluster::preset(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
        let text = include_str!("../clusters/dgx-a100.toml");
        let orphan = text.replace("tdp_w = 400.0", "power_limit_w = 300.0");
        let e = Cluster::from_toml(&orphan).unwrap_err().to_string();
        assert!(
            e.contains("gpu.power_limit_w") && e.contains("gpu.tdp_w"),
            "{e}"
        );
    }

    #[test]
    fn host_descriptions_are_checked() {
        let c = dgx_h100(2);
        assert_eq!(c.pcie_bandwidth_per_gpu(), Some(25e9));
        assert_eq!(c.host_bandwidth_per_gpu(), Some(614.4e9 / 8.0));
        let mut bad = c.clone();
        bad.host.as_mut().unwrap().gpus_per_pcie_link = 9;
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("host.gpus_per_pcie_link"), "{err}");
        let mut bad = c;
        bad.host.as_mut().unwrap().pcie_gb_per_s = 0.0;
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("host.pcie_gb_per_s")
        );
        assert_eq!(cpu(2).host, None);
    }

    #[test]
    fn matmul_ceilings_and_their_checks() {
        for name in ["dgx-a100-40gb", "dgx-b200:nodes=2", "hgx-h200"] {
            let c = Cluster::preset(name).unwrap();
            assert!(c.gpu.mamf_tflops.is_some(), "{name}");
            assert_eq!(Cluster::from_toml(&c.to_toml()).unwrap(), c, "{name}");
        }
        // The one-GPU descriptions are valid clusters with their own ceilings.
        for (c, bf16) in [(gh200_gpu(), 828.6e12), (a100_pcie_gpu(), 252.9e12)] {
            c.validate().unwrap();
            assert_eq!(c.num_devices(), 1);
            assert_eq!(c.gemm_ceiling_flops(DType::BF16, false, 0.8), Some(bf16));
            assert_eq!(Cluster::from_toml(&c.to_toml()).unwrap(), c);
        }
        let h = dgx_h100(1);
        assert_eq!(
            h.gemm_ceiling_flops(DType::BF16, false, 0.8),
            Some(794.5e12)
        );
        assert_eq!(
            h.gemm_ceiling_flops(DType::BF16, true, 0.8),
            Some(1402.6e12)
        );
        assert_eq!(dgx_a100(1).gemm_ceiling_flops(DType::BF16, true, 0.8), None);
        assert_eq!(
            cpu(1).gemm_ceiling_flops(DType::F32, false, 0.8),
            Some(0.02e12 * 0.8)
        );
        let text = include_str!("../clusters/dgx-a100.toml");
        let over = text.replace("bf16 = 271.2", "bf16 = 400.0");
        let e = Cluster::from_toml(&over).unwrap_err().to_string();
        assert!(e.contains("gpu.mamf_tflops.bf16"), "{e}");
        let fp8 = text.replace("bf16 = 271.2", "bf16 = 271.2\nfp8 = 500.0");
        let e = Cluster::from_toml(&fp8).unwrap_err().to_string();
        assert!(e.contains("gpu.mamf_tflops.fp8"), "{e}");
    }

    #[test]
    fn nic_sharing_defaults_to_even_spread() {
        let mut c = dgx_a100(2);
        assert_eq!(c.nic_of(9), 1);
        c.network.nics_per_node = 4;
        assert_eq!(c.nic_of(3), 1);
        assert_eq!(c.nic_of(15), 3);
    }
}
