//! Communication costs: alpha-beta models of ring, tree and hierarchical collectives and of
//! point-to-point transfers, in the bus-bandwidth convention of nccl-tests.
//!
//! nccl-tests reports, for a message of `S` bytes per rank taking time `t` on `n` ranks, the
//! *bus bandwidth* `busbw = S/t * f(n)` with `f = 2(n-1)/n` for all-reduce and `(n-1)/n` for
//! all-gather, reduce-scatter and all-to-all (`S` being the full gathered / scattered buffer);
//! busbw is what each link carries, so it can be compared with link speeds and is nearly
//! independent of `n`. The cluster description gives busbw of the intra-node fabric and of one
//! NIC, and the models invert the definition:
//!
//! | collective | ring time |
//! |---|---|
//! | all-reduce | `2(n-1) a + 2(n-1)/n * S/B` |
//! | all-gather, reduce-scatter | `(n-1) a + (n-1)/n * S/B` |
//! | all-to-all | `(n-1) a + (n-1)/n * S/B` |
//! | broadcast (pipelined chain) | `(n-1) a + S/B` |
//! | send/recv | `a + S/B` |
//!
//! with `a` the per-step latency and `B` the bus bandwidth of the slowest link the group
//! crosses. Trees replace `n-1` latency steps by `ceil(log2 n)` and pay `n/(n-1)` more in
//! bandwidth; hierarchical all-reduce (priced only when imposed: NCCL does not run it) is
//! reduce-scatter inside nodes, all-reduce across nodes on each node's NICs, all-gather
//! inside nodes; NVLink SHARP all-reduce inside a node moves
//! each byte once to the switch and once back (`2 a + S/B_nvls`, `B_nvls` the algorithm
//! bandwidth), and across nodes (NCCL's NVLS tree) reduces in each node's switch and
//! exchanges the node's sum over its NICs once, at 5/6 of the slower of the two (half the
//! NICs beyond two nodes). The cheapest of ring, tree and the NVLS forms is chosen, as
//! NCCL's tuner does. Inside a
//! GPU node `a` and the share of `B` are those of the cheapest of NCCL's protocols
//! ([`Protocol`]: LL, LL128, Simple), so small messages pay microseconds of latency at a
//! fraction of the bandwidth and large ones the full bandwidth after tens of microseconds.
//! The tuner picks by those figures; an NVLS all-reduce it picks then costs what its
//! chunked steps take (`nvls_steps`): medium messages run in small chunks, each step at
//! least a round trip through the switch, so NVLS reaches its large-message rate only above
//! a few hundred MiB.

use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, GpuArch};
use crate::cost::Cost;
use crate::mapping::GroupInfo;

/// Collective kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Every member gets the reduction; `bytes` is the buffer per rank.
    AllReduce,
    /// `bytes` is the gathered (output) buffer per rank.
    AllGather,
    /// `bytes` is the input buffer per rank (the output is `bytes / n`).
    ReduceScatter,
    /// `bytes` is the send buffer per rank.
    AllToAll,
    /// `bytes` is the broadcast buffer.
    Broadcast,
    /// One message of `bytes` between two group neighbours.
    SendRecv,
}

impl Collective {
    /// Name in messages (`all-gather`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllToAll => "all-to-all",
            Collective::Broadcast => "broadcast",
            Collective::SendRecv => "send/recv",
        }
    }
}

/// Algorithms the model chooses between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// A ring over all members.
    Ring,
    /// A (double binary) tree.
    Tree,
    /// Inside nodes first, then across nodes, then inside nodes again.
    Hierarchical,
    /// A direct transfer.
    Direct,
    /// NVLink SHARP: the NVSwitch reduces, each rank sends and receives its buffer once.
    Nvls,
    /// NVLink SHARP inside each node and a tree between the nodes (NCCL's `NVLS_TREE`).
    NvlsTree,
}

/// Tunable parameters of the communication model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommParams {
    /// Fixed software cost of launching one collective (kernel launch, proxy wake-up), added
    /// to every call. 5 us is the order of NCCL's small-message floor beyond link latency.
    pub launch_overhead_s: f64,
    /// When a collective overlaps computation, the computation runs this much slower for the
    /// overlapped time, because NCCL's kernels occupy SMs and memory bandwidth (NCCL uses
    /// roughly 8-16 of an A100's 108 SMs for a large collective).
    pub overlap_slowdown: f64,
    /// How much slower a GEMM runs while a NCCL collective overlaps it where the GEMM
    /// kernels are persistent and the stack leaves them every SM
    /// ([`crate::cluster::GpuArch::persistent_gemms`], [`crate::Software::sm_carveout`]): a
    /// persistent kernel launches one CTA per SM, each working through its share of the
    /// output tiles, so the CTAs that find their SM held by the collective's run as a second
    /// wave once the first finish, and the GEMM takes up to twice as long (pytorch/pytorch
    /// #144974, which added a matmul SM carve-out for this reason). 1.0: the overlapped
    /// GEMM time is paid again.
    #[serde(default = "one")]
    pub persistent_gemm_slowdown: f64,
    /// Data-parallel gradient reduction starts, bucket by bucket, while the last backward of
    /// each chunk runs (PyTorch DDP, Megatron-LM `--overlap-grad-reduce`); otherwise it starts
    /// after the last backward.
    pub overlap_grad_reduce: bool,
    /// Tensor-parallel collectives of the backward overlap the weight-gradient GEMMs
    /// (Megatron-LM's asynchronous tensor-parallel all-reduce, and the all-gather /
    /// reduce-scatter overlap of sequence parallelism).
    pub overlap_tp_backward: bool,
    /// Sequence-parallel collectives are pipelined with the GEMM they feed or follow
    /// (Megatron-Core's `--tp-comm-overlap`: Transformer Engine's userbuffers split the
    /// all-gather + GEMM and GEMM + reduce-scatter into chunks that overlap, and gather a
    /// row-parallel GEMM's output gradient chunk by chunk under its input-gradient GEMM);
    /// each chunk is priced as a GEMM of its own.
    pub overlap_tp_forward: bool,
    /// All-reduces inside a node may use NVLink SHARP where the fabric has it
    /// ([`crate::cluster::FabricSpec::nvls_algbw_gb_per_s`]); NCCL's default, off with
    /// `NCCL_NVLS_ENABLE=0`.
    pub nvls: bool,
    /// The all-reduce algorithm when one is imposed (NCCL's `NCCL_ALGO`, or a measurement
    /// that records which one NCCL ran); `None` lets the model take the cheapest.
    pub force_algorithm: Option<Algorithm>,
    /// Price ring and tree collectives inside a GPU node as NCCL's three protocols do (see
    /// [`Protocol`]) and take the cheapest, as NCCL's tuner does, with NVLink SHARP at
    /// NCCL's latency for it; otherwise (across nodes, and on clusters of
    /// [`crate::cluster::GpuArch::Other`]) one latency per step from the cluster description
    /// and the fabric's full bandwidth.
    #[serde(default = "yes")]
    pub nccl_protocols: bool,
}

/// `true`, for serde defaults of flags on by default (here and in [`crate::software`]).
pub(crate) fn yes() -> bool {
    true
}

fn one() -> f64 {
    1.0
}

/// NCCL's protocols, which trade bandwidth for latency. LL sends 4 bytes of data with a
/// 4-byte flag in each 8-byte store (lowest latency, a quarter of the bus bandwidth in
/// NCCL's model), LL128 120 bytes of data per 128-byte line (92%), Simple whole chunks
/// behind a memory fence (full bandwidth, the highest latency). The figures are NCCL's own
/// performance model (`src/graph/tuning.cc` of NCCL 2.19: `baseLat`, `hwLat`, `llMaxBws`
/// and the bandwidth refinements of `ncclTopoTuneModel`), which its tuner uses to pick
/// algorithm and protocol per call. The model prices collectives inside a node this way;
/// across nodes it keeps one latency per step from the cluster description, because
/// NCCL's table prices rings of thousands of ranks below what the SC'21 ZeRO-3 rows and
/// the 4-node EFA sweep of the reference tables measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// Low latency: 8-byte stores, half of them flags.
    Ll,
    /// 128-byte lines, 8 bytes of each a flag.
    Ll128,
    /// Bulk chunks with fences.
    Simple,
}

const PROTOCOLS: [Protocol; 3] = [Protocol::Ll, Protocol::Ll128, Protocol::Simple];

impl Protocol {
    fn index(self) -> usize {
        match self {
            Protocol::Ll => 0,
            Protocol::Ll128 => 1,
            Protocol::Simple => 2,
        }
    }
}

/// NCCL's fixed latency of a ring collective per protocol (LL, LL128, Simple), us.
const RING_BASE_US: [f64; 3] = [6.6, 14.0, 8.4];
/// NCCL's fixed latency of a tree all-reduce per protocol, us.
const TREE_BASE_US: [f64; 3] = [6.8, 14.0, 0.0];
/// Latency of one ring step over NVLink and over PCIe, per protocol, us.
const RING_HOP_NVLINK_US: [f64; 3] = [0.6, 1.9, 3.4];
const RING_HOP_PCI_US: [f64; 3] = [1.0, 2.5, 5.7];
/// Latency of one tree level over NVLink and over PCIe, per protocol, us.
const TREE_HOP_NVLINK_US: [f64; 3] = [0.6, 1.25, 28.0];
const TREE_HOP_PCI_US: [f64; 3] = [1.0, 1.9, 28.0];
/// LL128's share of the ring's bus bandwidth (120 of 128 bytes, NCCL's 0.92).
const LL128_SHARE: f64 = 0.92;
/// The most LL reaches on one Ampere or Hopper node, GB/s (NCCL's `llMaxBws`).
const LL_MAX_BUSBW_GB_PER_S: f64 = 87.7;
/// NVLink SHARP's latency inside a node, us (NCCL's `hwLat` for NVLS over NVLink).
const NVLS_LATENCY_US: f64 = 23.0;
/// The algorithm bandwidth an NVLink SHARP tree across nodes reaches of its bottleneck's
/// rate: NCCL's model converts the bus bandwidth of its NVLS algorithms by 5/6
/// (`ncclTopoTuneModel`, `src/graph/tuning.cc`, NCCL 2.27).
const NVLS_TREE_SHARE: f64 = 5.0 / 6.0;

/// What one NVLink SHARP step costs beyond moving its chunk, us: the flags by which each
/// GPU's CTAs release the chunk they reduced through the switch before taking the next.
/// This model's reading of the B200 sweep of `mlengineering_allreduce_busbw.csv` (AWS
/// p6-b200, NCCL 2.27.7, chunks of 512 KiB there, see [`nvls_steps`]): from 1 to 4 GiB,
/// where NCCL moves 64 KiB per step, the all-reduce holds at 413-423 GB/s of algorithm
/// bandwidth, and at 8 and 16 GiB, 512 KiB per step, at 479-483; one fixed cost per step
/// accounts for both (a 64 KiB step of 192 operations: 25.8 us of transfer at 487 GB/s
/// and 3.5 of release).
const NVLS_STEP_SYNC_US: f64 = 3.5;

/// Seconds an NVLink SHARP all-reduce of `bytes` inside one node of `n` GPUs spends in its
/// steps, as NCCL runs it (`src/enqueue.cc`, NCCL 2.27): `nvlsChannels` CTAs per GPU (16 on
/// Hopper, 24 on a Blackwell node, `src/transport/nvls.cc`), each GPU's CTAs reducing
/// `n` heads' slices, so `channels x n` operations run side by side, each moving one chunk
/// per step; the chunk is the fabric's NVLS chunk (128 KiB unless set,
/// [`crate::cluster::FabricSpec::nvls_chunk_kib`]), cut to 64, 32 and 16 KiB below 64, 8
/// and 2 buffers of `channels x n` chunks, so that a medium message still spreads over
/// every operation. A step costs its chunk at the operation's share of the algorithm
/// bandwidth plus the release of the chunk ([`NVLS_STEP_SYNC_US`]), and never less than
/// NCCL's NVLS latency ([`NVLS_LATENCY_US`]), taken as one round trip through the switch (a
/// multimem reduction of the chunk and the flags that release it). That floor is this
/// model's reading of the same B200 sweep, whose 4 to 64 MiB points take 20-35 us per step
/// whether the chunk is 16 or 32 KiB (126 GB/s busbw at 8 MiB, 401 at 64 MiB, 839 at 8 GiB);
/// no NCCL source states it. Small chunks are latency-bound, so NVLS reaches its
/// large-message rate only above a few hundred MiB, and its full rate only with chunks
/// large enough to carry their release.
fn nvls_steps(bytes: f64, algbw_gb_per_s: f64, n: f64, cluster: &Cluster) -> f64 {
    let channels = match cluster.gpu.arch {
        GpuArch::Blackwell => 24.0,
        _ => 16.0,
    };
    let ops = channels * n;
    let mut chunk = f64::from(cluster.intra_node.nvls_chunk_kib.unwrap_or(128)) * 1024.0;
    for (buffers, smaller) in [(64.0, 65536.0), (8.0, 32768.0), (2.0, 16384.0)] {
        if bytes < buffers * ops * chunk && chunk > smaller {
            chunk = smaller;
        }
    }
    let op_bw = algbw_gb_per_s * 1e9 / ops;
    let floor = NVLS_LATENCY_US * 1e-6;
    let sync = NVLS_STEP_SYNC_US * 1e-6;
    let per_step = ops * chunk;
    let full = (bytes / per_step).floor();
    let rest = bytes / ops - full * chunk;
    // Every operation's chunks, the last one short; the first step's round trip is the
    // collective's latency, which the caller adds.
    let step = |b: f64| (b / op_bw + sync).max(floor);
    let (first, later) = match full >= 1.0 {
        true => (chunk, (full - 1.0) * step(chunk)),
        false => (rest, 0.0),
    };
    let tail = match full >= 1.0 && rest > 0.0 {
        true => step(rest),
        false => 0.0,
    };
    first / op_bw + later + tail
}

impl Default for CommParams {
    fn default() -> Self {
        CommParams {
            launch_overhead_s: 5e-6,
            overlap_slowdown: 0.1,
            persistent_gemm_slowdown: 1.0,
            overlap_grad_reduce: true,
            overlap_tp_backward: true,
            overlap_tp_forward: false,
            nvls: true,
            force_algorithm: None,
            nccl_protocols: true,
        }
    }
}

impl CommParams {
    /// Exposed time of `comm` seconds of communication overlapping `compute` seconds of
    /// independent computation: what does not fit under the computation, plus the slowdown of
    /// the computation while both run.
    pub fn exposed(&self, comm: f64, compute: f64) -> f64 {
        (comm - compute).max(0.0) + self.overlap_slowdown * comm.min(compute)
    }

    /// [`CommParams::exposed`] for a NCCL collective beside computation of which
    /// `gemm_share` is GEMM time: where the GEMMs are `persistent` (and left every SM),
    /// that share runs [`CommParams::persistent_gemm_slowdown`] slower while both run, the
    /// rest [`CommParams::overlap_slowdown`].
    pub fn exposed_beside(
        &self,
        comm: f64,
        compute: f64,
        gemm_share: f64,
        persistent: bool,
    ) -> f64 {
        let slowdown = match persistent {
            true => {
                let g = gemm_share.clamp(0.0, 1.0);
                g * self.persistent_gemm_slowdown + (1.0 - g) * self.overlap_slowdown
            }
            false => self.overlap_slowdown,
        };
        (comm - compute).max(0.0) + slowdown * comm.min(compute)
    }
}

/// The time of one collective and the algorithm that achieves it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommCost {
    /// Seconds.
    pub time_s: f64,
    /// The algorithm chosen.
    pub algorithm: Algorithm,
}

impl CommCost {
    /// As a [`Cost`].
    pub fn cost(&self) -> Cost {
        Cost::from_secs(self.time_s)
    }
}

fn ring_factor(c: Collective, n: f64) -> (f64, f64) {
    // (latency steps, bandwidth factor) of the ring algorithm.
    match c {
        Collective::AllReduce => (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n),
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
            (n - 1.0, (n - 1.0) / n)
        }
        Collective::Broadcast => (n - 1.0, 1.0),
        Collective::SendRecv => (1.0, 1.0),
    }
}

impl CommParams {
    /// Time of `coll` moving `bytes` (nccl-tests size convention, see [`Collective`]) over the
    /// groups described by `group`.
    pub fn collective(
        &self,
        coll: Collective,
        bytes: f64,
        group: &GroupInfo,
        cluster: &Cluster,
    ) -> CommCost {
        let n = group.size;
        if n <= 1 || bytes <= 0.0 {
            return CommCost {
                time_s: 0.0,
                algorithm: Algorithm::Direct,
            };
        }
        let nf = n as f64;
        let intra_bw = cluster.intra_bus_bandwidth();
        let a_intra = cluster.intra_node.latency_us * 1e-6;
        let a_inter = cluster.network.latency_us * 1e-6;
        let (bw, alpha) = if group.intra_node() {
            (intra_bw, a_intra)
        } else {
            (intra_bw.min(group.inter_node_bandwidth(cluster)), a_inter)
        };
        if coll == Collective::SendRecv {
            // A point-to-point message uses one device's link: its NIC share across nodes.
            let bw = if group.intra_node() {
                intra_bw
            } else {
                intra_bw.min(cluster.nic_bus_bandwidth() / group.groups_per_nic.max(1) as f64)
            };
            return CommCost {
                time_s: self.launch_overhead_s + alpha + bytes / bw,
                algorithm: Algorithm::Direct,
            };
        }
        let (steps, factor) = ring_factor(coll, nf);
        if coll == Collective::AllToAll && !group.intra_node() {
            // Every rank sends each peer its own slice: the slices for the `n - m` peers on
            // other nodes leave through the NICs its node's `m` members share, while those
            // for the `m - 1` on its own node cross NVLink at the same time. No ring forwards
            // anything, so unlike the ring collectives the off-node bytes are the rank's own,
            // at its share of the NICs.
            let m = (group.members_per_node.max(1) as f64).min(nf);
            let nic_share = group.inter_node_bandwidth(cluster) / m;
            let off_node = bytes * (nf - m) / nf / nic_share;
            let on_node = bytes * (m - 1.0) / nf / intra_bw;
            return CommCost {
                time_s: self.launch_overhead_s + steps * alpha + off_node.max(on_node),
                algorithm: Algorithm::Direct,
            };
        }
        let nccl = self.nccl_protocols && cluster.gpu.arch != GpuArch::Other;
        let ring_by_protocol = nccl
            && group.intra_node()
            && matches!(
                coll,
                Collective::AllReduce | Collective::AllGather | Collective::ReduceScatter
            );
        let ring = if ring_by_protocol {
            self.launch_overhead_s + self.nccl_ring(coll, bytes, bw, nf, cluster)
        } else {
            self.launch_overhead_s + steps * alpha + factor * bytes / bw
        };
        let mut best = CommCost {
            time_s: ring,
            algorithm: Algorithm::Ring,
        };
        // An imposed all-reduce algorithm replaces the ring whenever it applies here.
        let imposed =
            |a: Algorithm| coll == Collective::AllReduce && self.force_algorithm == Some(a);
        let allowed = |a: Algorithm| {
            coll != Collective::AllReduce || self.force_algorithm.is_none_or(|f| f == a)
        };
        let better = |t: f64, a: Algorithm, best: &CommCost| {
            allowed(a) && (t < best.time_s || (imposed(a) && best.algorithm != a))
        };
        if matches!(coll, Collective::AllReduce | Collective::Broadcast) {
            let depth = nf.log2().ceil();
            let tree_steps = if coll == Collective::AllReduce {
                2.0 * depth
            } else {
                depth
            };
            // Reduce up and broadcast down for all-reduce; for broadcast, every inner node
            // forwards the data to two children.
            let tree_factor = 2.0;
            let t = if nccl && coll == Collective::AllReduce && group.intra_node() {
                self.launch_overhead_s + self.nccl_tree(bytes, bw, nf, cluster)
            } else {
                self.launch_overhead_s + tree_steps * alpha + tree_factor * bytes / bw
            };
            if better(t, Algorithm::Tree, &best) {
                best = CommCost {
                    time_s: t,
                    algorithm: Algorithm::Tree,
                };
            }
        }
        // An NVLink SHARP pass through a node's switch: one multimem store to it and one load
        // of the reduced buffer.
        let switch_latency = if nccl {
            NVLS_LATENCY_US * 1e-6
        } else {
            2.0 * a_intra
        };
        if let (true, Collective::AllReduce, true, Some(algbw)) = (
            self.nvls,
            coll,
            group.intra_node(),
            cluster.intra_node.nvls_algbw_gb_per_s,
        ) {
            let t = self.launch_overhead_s + switch_latency + bytes / (algbw * 1e9);
            if better(t, Algorithm::Nvls, &best) {
                // NCCL's tuner chose it by the figure above; what it takes is its chunks'.
                let achieved = match nccl {
                    true => {
                        self.launch_overhead_s
                            + switch_latency
                            + nvls_steps(bytes, algbw, nf, cluster)
                    }
                    false => t,
                };
                best = CommCost {
                    time_s: achieved,
                    algorithm: Algorithm::Nvls,
                };
            }
        }
        // NVLink SHARP trees across nodes: each node reduces through its switch, the nodes
        // exchange the node's sum over their NICs in a tree, and the switch broadcasts the
        // result. NCCL prices the network part at the NICs' rate on two nodes and half of it
        // beyond (an inner node of the tree forwards to two children), never above the
        // switch's (`ncclTopoTuneModel`); a node needs two members for its switch to reduce.
        // Beyond two nodes the plain tree is as fast, so this pays on two nodes: a ring there
        // crosses the NICs 2(n-1)/n times per byte, the NVLS tree once.
        if let (true, Collective::AllReduce, false, true, Some(algbw)) = (
            self.nvls,
            coll,
            group.intra_node(),
            group.members_per_node > 1,
            cluster.intra_node.nvls_algbw_gb_per_s,
        ) {
            let net = group.inter_node_bandwidth(cluster)
                / if group.nodes_spanned <= 2 { 1.0 } else { 2.0 };
            let bw = NVLS_TREE_SHARE * (algbw * 1e9).min(net);
            let levels = (group.nodes_spanned as f64).log2().ceil();
            // Each node's bytes still pass its switch in NVLS chunks, as a node's own NVLS
            // all-reduce moves them: the tree is never faster than that plus its network
            // levels.
            let switch = match nccl {
                true => nvls_steps(bytes, algbw, group.members_per_node as f64, cluster),
                false => 0.0,
            };
            let t = self.launch_overhead_s
                + switch_latency
                + 2.0 * levels * a_inter
                + (bytes / bw).max(switch);
            if better(t, Algorithm::NvlsTree, &best) {
                best = CommCost {
                    time_s: t,
                    algorithm: Algorithm::NvlsTree,
                };
            }
        }
        // NCCL's tuner chooses among ring, tree and NVLS (and CollNet on SHARP switches); the
        // two-level all-reduce is not one of its algorithms, so it is priced only when
        // imposed. Offered freely it would beat what NCCL reaches where NICs are scarce: 2
        // nodes with 4 HDR NICs each measure 86-91 GB/s busbw, about the ring's 4 x 24
        // (nccl_busbw_reference.csv), where the two-level form would give 104.
        if coll == Collective::AllReduce
            && self.force_algorithm == Some(Algorithm::Hierarchical)
            && !group.intra_node()
            && group.members_per_node > 1
        {
            let k = group.members_per_node as f64;
            let nodes = group.nodes_spanned as f64;
            // Each of the k members all-reduces S/k across nodes on a 1/k share of the NICs.
            let inter_bw = group.inter_node_bandwidth(cluster) / k;
            let t = self.launch_overhead_s
                + 2.0 * (k - 1.0) * a_intra
                + 2.0 * (k - 1.0) / k * bytes / intra_bw
                + 2.0 * (nodes - 1.0) * a_inter
                + 2.0 * (nodes - 1.0) / nodes * (bytes / k) / inter_bw;
            if better(t, Algorithm::Hierarchical, &best) {
                best = CommCost {
                    time_s: t,
                    algorithm: Algorithm::Hierarchical,
                };
            }
        }
        best
    }

    /// Per-step latencies inside a node, per protocol, by fabric (ring, tree).
    fn intra_hops(cluster: &Cluster) -> ([f64; 3], [f64; 3]) {
        if cluster
            .intra_node
            .fabric
            .to_ascii_lowercase()
            .contains("pci")
        {
            (RING_HOP_PCI_US, TREE_HOP_PCI_US)
        } else {
            (RING_HOP_NVLINK_US, TREE_HOP_NVLINK_US)
        }
    }

    /// Seconds (without the launch) of a ring all-reduce, all-gather or reduce-scatter inside
    /// one node under the cheapest protocol NCCL may run: the protocol's fixed latency, its
    /// per-step latency on the node's fabric for each of the ring's steps, and the bytes at
    /// the protocol's share of the bus bandwidth `bw` (bytes/s).
    fn nccl_ring(&self, coll: Collective, bytes: f64, bw: f64, n: f64, cluster: &Cluster) -> f64 {
        let (steps, factor) = ring_factor(coll, n);
        let (hops, _) = Self::intra_hops(cluster);
        let mut best = f64::INFINITY;
        for p in PROTOCOLS {
            let i = p.index();
            let latency = RING_BASE_US[i] + steps * hops[i];
            let busbw = match p {
                Protocol::Simple => bw,
                Protocol::Ll128 => bw * LL128_SHARE,
                Protocol::Ll => {
                    let share = if coll == Collective::AllReduce {
                        0.25
                    } else {
                        1.0 / 3.0
                    };
                    (bw * share).min(LL_MAX_BUSBW_GB_PER_S * 1e9)
                }
            };
            best = best.min(latency * 1e-6 + factor * bytes / busbw);
        }
        best
    }

    /// Seconds (without the launch) of NCCL's tree all-reduce inside one node (a chain of
    /// `n` members, up and down) under its cheapest protocol, at half the tree's bus
    /// bandwidth: 92% of `bw`, LL a 3.8th of that, LL128 7/9 of it.
    fn nccl_tree(&self, bytes: f64, bw: f64, n: f64, cluster: &Cluster) -> f64 {
        let (_, hops) = Self::intra_hops(cluster);
        let tree_bw = bw * 0.92;
        let mut best = f64::INFINITY;
        for p in PROTOCOLS {
            let i = p.index();
            let latency = TREE_BASE_US[i] + 2.0 * (n - 1.0) * hops[i];
            let busbw = match p {
                Protocol::Simple => tree_bw,
                Protocol::Ll128 => tree_bw * 7.0 / 9.0,
                Protocol::Ll => (tree_bw / 3.8).min(LL_MAX_BUSBW_GB_PER_S * 1e9),
            };
            best = best.min(latency * 1e-6 + 2.0 * bytes / busbw);
        }
        best
    }

    /// Bus bandwidth (bytes/s) that `collective` would report in nccl-tests for this group and
    /// size: the inverse of the model, for comparison with measurements.
    pub fn bus_bandwidth(
        &self,
        coll: Collective,
        bytes: f64,
        group: &GroupInfo,
        cluster: &Cluster,
    ) -> f64 {
        let t = self.collective(coll, bytes, group, cluster).time_s;
        let (_, f) = ring_factor(coll, group.size as f64);
        bytes / t * f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster;

    fn intra(n: usize) -> GroupInfo {
        GroupInfo {
            size: n,
            nodes_spanned: 1,
            members_per_node: n,
            nics_per_group: 0,
            groups_per_nic: 0,
        }
    }

    /// A group of `size` members over `nodes` nodes, `per_node` on each, using `nics` NICs of
    /// each node that no other group shares.
    fn across(size: usize, nodes: usize, per_node: usize, nics: usize) -> GroupInfo {
        GroupInfo {
            size,
            nodes_spanned: nodes,
            members_per_node: per_node,
            nics_per_group: nics,
            groups_per_nic: 1,
        }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-9 * b.abs().max(1e-12), "{a} vs {b}");
    }

    const P: CommParams = CommParams {
        launch_overhead_s: 5e-6,
        overlap_slowdown: 0.1,
        persistent_gemm_slowdown: 1.0,
        overlap_grad_reduce: true,
        overlap_tp_backward: true,
        overlap_tp_forward: false,
        nvls: true,
        force_algorithm: None,
        nccl_protocols: true,
    };

    /// Beside persistent GEMMs the GEMM share of the overlapped time is paid again; beside
    /// other work, or where the GEMMs are not persistent, a tenth of it.
    #[test]
    fn persistent_gemms_split_into_a_second_wave() {
        // 1 s of collectives under 3 s of work, half of it GEMMs.
        close(P.exposed_beside(1.0, 3.0, 0.5, false), 0.1);
        close(P.exposed_beside(1.0, 3.0, 0.5, true), 0.5 * 1.0 + 0.5 * 0.1);
        close(P.exposed_beside(1.0, 3.0, 0.0, true), 0.1);
        // What does not fit under the work is exposed whatever runs beside it.
        close(P.exposed_beside(3.0, 1.0, 1.0, true), 2.0 + 1.0);
        close(P.exposed_beside(3.0, 1.0, 1.0, false), P.exposed(3.0, 1.0));
    }

    /// NVLink SHARP: all-reduce busbw above the ring's, growing with the group as
    /// `algbw * 2(n-1)/n`; off with `nvls = false`, and an imposed algorithm wins.
    #[test]
    fn nvls_all_reduce_and_imposed_algorithms() {
        let h = cluster::dgx_h100(1);
        let g = intra(8);
        let big = 8.0 * (1u64 << 30) as f64;
        let busbw = |p: &CommParams| p.bus_bandwidth(Collective::AllReduce, big, &g, &h) / 1e9;
        let on = busbw(&P);
        assert!((470.0..490.0).contains(&on), "{on}");
        let off = busbw(&CommParams { nvls: false, ..P });
        assert!((360.0..372.0).contains(&off), "{off}");
        let ring = CommParams {
            force_algorithm: Some(Algorithm::Ring),
            ..P
        };
        assert_eq!(
            ring.collective(Collective::AllReduce, big, &g, &h)
                .algorithm,
            Algorithm::Ring
        );
        // No NVLS on A100's NVSwitch.
        let a = cluster::dgx_a100(1);
        assert_ne!(
            P.collective(Collective::AllReduce, big, &g, &a).algorithm,
            Algorithm::Nvls
        );
    }

    /// NVLS runs medium messages in small chunks, each step at least a round trip through
    /// the switch: a B200 node reaches a fraction of its large-message bus bandwidth at 8
    /// MiB (the sweep measured 126 of 839 GB/s), more with every doubling, all of it at 8
    /// GiB, where AWS's 512 KiB chunks carry their release better than NCCL's default 128
    /// KiB; a message within one step costs the latency and its bytes only.
    #[test]
    fn nvls_medium_messages_are_bound_by_their_steps() {
        let b = Cluster::preset("aws-p6-b200").unwrap();
        let g = intra(8);
        let busbw = |bytes: f64| P.bus_bandwidth(Collective::AllReduce, bytes, &g, &b) / 1e9;
        let mib = (1u64 << 20) as f64;
        let sizes = [8.0, 64.0, 1024.0, 8192.0];
        let bw: Vec<f64> = sizes.iter().map(|&m| busbw(m * mib)).collect();
        assert!(bw.windows(2).all(|w| w[0] < w[1]), "{bw:?}");
        assert!(bw[0] < 0.25 * bw[3], "{bw:?}");
        assert!((820.0..850.0).contains(&bw[3]), "{bw:?}");
        // 1 GiB runs in 64 KiB steps whatever the chunk setting, 8 GiB in the chunk set.
        let dgx = cluster::dgx_b200(1);
        let on_dgx = |bytes: f64| P.bus_bandwidth(Collective::AllReduce, bytes, &g, &dgx) / 1e9;
        close(on_dgx(1024.0 * mib), bw[2]);
        let default_chunk = on_dgx(8192.0 * mib);
        assert!(
            default_chunk < 0.97 * bw[3] && default_chunk > 0.9 * bw[3],
            "{default_chunk} vs {}",
            bw[3]
        );
        let algbw = b.intra_node.nvls_algbw_gb_per_s.unwrap() * 1e9;
        let small = 64.0 * 1024.0;
        let nvls = CommParams {
            force_algorithm: Some(Algorithm::Nvls),
            ..P
        };
        let t = nvls.collective(Collective::AllReduce, small, &g, &b);
        assert_eq!(t.algorithm, Algorithm::Nvls);
        close(t.time_s, 5e-6 + NVLS_LATENCY_US * 1e-6 + small / algbw);
        // Without NCCL's protocols (the fabric's own latency) NVLS keeps the plain form.
        let plain = ALPHA.collective(Collective::AllReduce, 8.0 * mib, &g, &b);
        assert_eq!(plain.algorithm, Algorithm::Nvls);
        close(
            plain.time_s,
            5e-6 + 2.0 * b.intra_node.latency_us * 1e-6 + 8.0 * mib / algbw,
        );
    }

    #[test]
    fn exposed_time_of_overlapped_communication() {
        close(P.exposed(3.0, 1.0), 2.0 + 0.1);
        close(P.exposed(1.0, 3.0), 0.1);
    }

    /// The per-step latency of the cluster description, as across nodes.
    const ALPHA: CommParams = CommParams {
        nccl_protocols: false,
        ..P
    };

    /// Inside a GPU node the ring runs NCCL's cheapest protocol: LL for small messages
    /// (6.6 + 14 x 0.6 us, a quarter of the bus bandwidth), LL128 for mid-size ones
    /// (14 + 14 x 1.9 us, 92%), Simple (8.4 + 14 x 3.4 us, all of it) for large ones.
    #[test]
    fn nccl_protocols_inside_a_node_by_hand() {
        let c = cluster::dgx_a100(1);
        let g = intra(8);
        let t = |s: f64| P.collective(Collective::AllReduce, s, &g, &c);
        let ll = |s: f64| 5e-6 + (6.6 + 14.0 * 0.6) * 1e-6 + 1.75 * s / (230e9 / 4.0);
        let ll128 = |s: f64| 5e-6 + (14.0 + 14.0 * 1.9) * 1e-6 + 1.75 * s / (230e9 * 0.92);
        let simple = |s: f64| 5e-6 + (8.4 + 14.0 * 3.4) * 1e-6 + 1.75 * s / 230e9;
        for (s, want) in [
            (32768.0, ll(32768.0)),
            (4e6, ll128(4e6)),
            (1e9, simple(1e9)),
        ] {
            let got = t(s);
            assert_eq!(got.algorithm, Algorithm::Ring, "{s}");
            close(got.time_s, want);
        }
        // All-gather's LL keeps a third of the bandwidth.
        close(
            P.collective(Collective::AllGather, 32768.0, &g, &c).time_s,
            5e-6 + (6.6 + 7.0 * 0.6) * 1e-6 + 0.875 * 32768.0 / (230e9 / 3.0),
        );
        // Off, or on a cluster that is not of GPUs: the cluster's latency per step.
        close(
            ALPHA.collective(Collective::AllReduce, 1e9, &g, &c).time_s,
            5e-6 + 14e-6 + 1.75e9 / 230e9,
        );
        let cpu = cluster::Cluster::preset("cpu:ranks=8").unwrap();
        assert_eq!(
            P.collective(Collective::AllReduce, 4e6, &g, &cpu),
            ALPHA.collective(Collective::AllReduce, 4e6, &g, &cpu)
        );
        // Across nodes the cluster's latency per step stands.
        let g2 = across(16, 2, 8, 8);
        let c2 = cluster::dgx_a100(2);
        assert_eq!(
            P.collective(Collective::AllGather, 4e6, &g2, &c2),
            ALPHA.collective(Collective::AllGather, 4e6, &g2, &c2)
        );
    }

    #[test]
    fn ring_collectives_inside_a_node_by_hand() {
        let c = cluster::dgx_a100(1);
        let g = intra(8);
        let s = 1e9;
        // all-reduce: 5 us + 14 steps x 1 us + 2*7/8 * 1 GB / 230 GB/s.
        let ar = ALPHA.collective(Collective::AllReduce, s, &g, &c);
        assert_eq!(ar.algorithm, Algorithm::Ring);
        close(ar.time_s, 5e-6 + 14e-6 + 1.75 * s / 230e9);
        // all-gather and reduce-scatter: 5 us + 7 us + 7/8 * S / B.
        for coll in [
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
        ] {
            close(
                ALPHA.collective(coll, s, &g, &c).time_s,
                12e-6 + 0.875 * s / 230e9,
            );
        }
        // broadcast: the pipelined chain, 5 + 7 us + S / B (ring beats tree at 1 GB).
        close(
            ALPHA.collective(Collective::Broadcast, s, &g, &c).time_s,
            12e-6 + s / 230e9,
        );
        // send/recv: 5 + 1 us + S / B.
        close(
            P.collective(Collective::SendRecv, s, &g, &c).time_s,
            6e-6 + s / 230e9,
        );
        // busbw of a large all-reduce is the fabric's.
        let bb = ALPHA.bus_bandwidth(Collective::AllReduce, 8e9, &g, &c);
        assert!((bb - 230e9).abs() / 230e9 < 0.001, "{bb}");
    }

    #[test]
    fn small_all_reduce_takes_the_tree() {
        let c = cluster::dgx_a100(1);
        let t = ALPHA.collective(Collective::AllReduce, 1024.0, &intra(8), &c);
        assert_eq!(t.algorithm, Algorithm::Tree);
        // 5 us + 2*3 steps + 2 * 1 KiB / 230 GB/s.
        close(t.time_s, 5e-6 + 6e-6 + 2.0 * 1024.0 / 230e9);
    }

    #[test]
    fn data_parallel_all_reduce_across_nodes_by_hand() {
        // dp=8 with tp=8 inside nodes: one member per node, one NIC of 24 GB/s per group.
        let c = cluster::dgx_a100(8);
        let g = across(8, 8, 1, 1);
        let s = 4e9;
        let t = P.collective(Collective::AllReduce, s, &g, &c);
        assert_eq!(t.algorithm, Algorithm::Ring);
        close(t.time_s, 5e-6 + 14.0 * 5e-6 + 1.75 * s / 24e9);
        // Point-to-point across nodes: one NIC.
        close(
            P.collective(Collective::SendRecv, 1e8, &g, &c).time_s,
            10e-6 + 1e8 / 24e9,
        );
    }

    #[test]
    fn all_to_all_across_nodes_is_bound_by_each_ranks_nic_share() {
        // ep=16 over two DGX A100 nodes (8 HDR NICs of 24 GB/s each): of each rank's buffer,
        // the half for the other node leaves through its own NIC, the 7/16 for its own node's
        // peers crosses NVLink at the same time.
        let c = cluster::dgx_a100(2);
        let g = across(16, 2, 8, 8);
        let s = 1e9;
        let t = P.collective(Collective::AllToAll, s, &g, &c);
        assert_eq!(t.algorithm, Algorithm::Direct);
        close(t.time_s, 5e-6 + 15.0 * 5e-6 + 0.5 * s / 24e9);
        // Twice the NICs' load where two groups share them.
        let shared = GroupInfo {
            groups_per_nic: 2,
            ..g.clone()
        };
        close(
            P.collective(Collective::AllToAll, s, &shared, &c).time_s,
            5e-6 + 15.0 * 5e-6 + 0.5 * s / 12e9,
        );
        // Inside one node it stays the NVLink ring's, seven steps of 1 us at 230 GB/s.
        close(
            P.collective(Collective::AllToAll, s, &intra(8), &c).time_s,
            12e-6 + 0.875 * s / 230e9,
        );
    }

    /// The AWS presets against measurements they were not built from: on four p5en.48xlarge
    /// nodes (32 H200 ranks, EFA v3) a 4 GiB all-reduce ran NCCL's ring at 364.65 GB/s bus
    /// bandwidth (ml-engineering `network/README.md`, 2026-08-07, NCCL 2.27.7), where the
    /// preset takes its adapters' rate from a one-adapter `ib_write_bw` (193.7 Gb/s of 200).
    /// A p4d node has a quarter of a DGX A100's inter-node bandwidth, and its ring all-reduce
    /// across nodes is bound by it.
    #[test]
    fn aws_presets_against_what_they_were_not_built_from() {
        let busbw = |c: &Cluster, g: &GroupInfo, bytes: f64| {
            let mut p = P.clone();
            p.force_algorithm = Some(Algorithm::Ring);
            p.bus_bandwidth(Collective::AllReduce, bytes, g, c) / 1e9
        };
        let p5en = Cluster::preset("aws-p5en:nodes=4").unwrap();
        let got = busbw(&p5en, &across(32, 4, 8, 8), 4.0 * (1u64 << 30) as f64);
        assert!((got / 364.65 - 1.0).abs() < 0.07, "{got}");
        let p4d = Cluster::preset("aws-p4d:nodes=2").unwrap();
        let dgx = Cluster::preset("dgx-a100-40gb:nodes=2").unwrap();
        let (on_p4d, on_dgx) = (
            busbw(&p4d, &across(16, 2, 8, 4), 8e9),
            busbw(&dgx, &across(16, 2, 8, 8), 8e9),
        );
        assert!(on_p4d < 43.0 && on_p4d > 38.0, "{on_p4d}");
        assert!(on_dgx > 4.0 * on_p4d * 0.95, "{on_dgx} vs {on_p4d}");
        // p4de is p4d with the 80 GB part; p6-b200 is DGX B200's node on EFA.
        let p4de = Cluster::preset("aws-p4de").unwrap();
        assert_eq!(p4de.gpu.hbm_capacity_gib, 80.0);
        assert_eq!(p4de.network, p4d.network);
        let p6 = Cluster::preset("aws-p6-b200:nodes=4").unwrap();
        assert_eq!(p6.network, cluster::dgx_b200(4).network);
        // p5, built from nccl-tests' 4-node ring at 8 GiB, against the same sweep's 8, 16
        // and 32 nodes (355.4, 356.3 and 321.1 GB/s; crazyguitar/aws-gpu-communication-
        // benchmark `data/nccl_all_reduce.csv`). Its 2-node point, 478 GB/s, is NCCL's NVLS
        // tree, which the model does not price across nodes.
        let gib8 = 8.0 * (1u64 << 30) as f64;
        for (nodes, measured) in [(8, 355.36), (16, 356.27), (32, 321.10)] {
            let c = Cluster::preset(&format!("aws-p5:nodes={nodes}")).unwrap();
            let got = busbw(&c, &across(8 * nodes, nodes, 8, 8), gib8);
            assert!((got / measured - 1.0).abs() < 0.07, "{nodes} nodes: {got}");
        }
        let p5e = Cluster::preset("aws-p5e:nodes=2").unwrap();
        assert_eq!(p5e.gpu, cluster::hgx_h200(1).gpu);
        assert_eq!(
            p5e.network,
            Cluster::preset("aws-p5:nodes=2").unwrap().network
        );
    }

    /// NVLink SHARP trees across nodes, against nccl-tests on p5.48xlarge (crazyguitar/
    /// aws-gpu-communication-benchmark `data/nccl_all_reduce.csv`): on two nodes NCCL's
    /// choice moves 477.7 GB/s at 8 GiB where a ring is bound by the NICs (357); on four and
    /// eight nodes its plateau below the ring's (280.3 at 1 GiB, 278.2 at 2 GiB) is the NVLS
    /// tree at half the NICs' rate. A node with one member has nothing for its switch to
    /// reduce, and A100's switches reduce nothing.
    #[test]
    fn nvls_trees_across_nodes_against_nccl_tests() {
        let gib = (1u64 << 30) as f64;
        let busbw = |p: &CommParams, nodes: usize, per_node: usize, bytes: f64| {
            let c = Cluster::preset(&format!("aws-p5:nodes={nodes}")).unwrap();
            let g = across(nodes * per_node, nodes, per_node, per_node);
            let t = p.collective(Collective::AllReduce, bytes, &g, &c);
            (
                p.bus_bandwidth(Collective::AllReduce, bytes, &g, &c) / 1e9,
                t.algorithm,
            )
        };
        let (two, algo) = busbw(&P, 2, 8, 8.0 * gib);
        assert_eq!(algo, Algorithm::NvlsTree);
        assert!((two / 477.71 - 1.0).abs() < 0.06, "{two}");
        let ring = CommParams {
            force_algorithm: Some(Algorithm::Ring),
            ..P
        };
        assert!(busbw(&ring, 2, 8, 8.0 * gib).0 < 0.8 * two);
        let tree = CommParams {
            force_algorithm: Some(Algorithm::NvlsTree),
            ..P
        };
        for (nodes, bytes, measured) in [(4, gib, 280.30), (8, 2.0 * gib, 278.15)] {
            let (got, algo) = busbw(&tree, nodes, 8, bytes);
            assert_eq!(algo, Algorithm::NvlsTree);
            assert!((got / measured - 1.0).abs() < 0.06, "{nodes} nodes: {got}");
        }
        // Each node's bytes pass its switch in NVLS chunks: the tree over two nodes is never
        // faster than one node's own NVLS all-reduce of the same bytes (at 4-25 MiB, where
        // those steps are latency-bound, it was, priced at the tree's rate alone).
        let (one, two) = (
            Cluster::preset("dgx-h100:nodes=1").unwrap(),
            Cluster::preset("dgx-h100:nodes=2").unwrap(),
        );
        for mib in [1.0, 4.0, 16.0, 25.0, 64.0, 256.0, 1024.0] {
            let bytes = mib * 1048576.0;
            let node = P.collective(Collective::AllReduce, bytes, &intra(8), &one);
            let pair = tree.collective(Collective::AllReduce, bytes, &across(16, 2, 8, 8), &two);
            assert!(pair.time_s >= node.time_s, "{mib} MiB: {pair:?} < {node:?}");
        }
        // One member per node, or a switch that cannot reduce: no NVLS tree.
        assert_ne!(busbw(&P, 2, 1, 8.0 * gib).1, Algorithm::NvlsTree);
        let a100 = cluster::dgx_a100(2);
        let g = across(16, 2, 8, 8);
        assert_ne!(
            P.collective(Collective::AllReduce, 8.0 * gib, &g, &a100)
                .algorithm,
            Algorithm::NvlsTree
        );
    }

    #[test]
    fn hierarchical_all_reduce_by_hand_and_against_nccl_tests() {
        // 2 nodes x 8 GPUs with 4 HDR NICs per node (nccl_busbw_reference.csv: 86-91 GB/s).
        let mut c = cluster::dgx_a100(2);
        c.network.nics_per_node = 4;
        let g = across(16, 2, 8, 4);
        let s = 4e9;
        let ring = 5e-6 + 30.0 * 5e-6 + 2.0 * 15.0 / 16.0 * s / 96e9;
        let hier = 5e-6 + 14e-6 + 1.75 * s / 230e9 + 2.0 * 5e-6 + 1.0 * (s / 8.0) / 12e9;
        // NCCL runs the ring (the tree costs more here); the two-level form only when imposed.
        let t = P.collective(Collective::AllReduce, s, &g, &c);
        close(t.time_s, ring);
        assert_eq!(t.algorithm, Algorithm::Ring);
        let imposed = CommParams {
            force_algorithm: Some(Algorithm::Hierarchical),
            ..P
        };
        let t = imposed.collective(Collective::AllReduce, s, &g, &c);
        close(t.time_s, hier);
        assert_eq!(t.algorithm, Algorithm::Hierarchical);
        let bb = P.bus_bandwidth(Collective::AllReduce, s, &g, &c);
        assert!((86e9..97e9).contains(&bb), "busbw {bb}");
    }

    #[test]
    fn trivial_groups_are_free() {
        let c = cluster::dgx_a100(1);
        assert_eq!(
            P.collective(Collective::AllReduce, 1e9, &intra(1), &c)
                .time_s,
            0.0
        );
        assert_eq!(
            P.collective(Collective::AllGather, 0.0, &intra(8), &c)
                .time_s,
            0.0
        );
    }
}
