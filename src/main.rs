//! The `autopar` command line: list the model zoo, dump graphs, and run them.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use autopar_driver::frontends::zoo::{self, EntryKind};
use autopar_driver::ir::DType;
use autopar_driver::{self as driver, DumpFormat, LossScaling, Optimizer, Recompute, TrainOptions};

mod auto_cmd;
mod calibrate_cmd;
mod checkpoint_cmd;
mod launch_cmd;
mod plan_cmd;
mod progress;
mod report;
mod report_cmd;
mod run_cmd;
mod spmd_cmd;
mod stack_args;

/// autopar: an auto-parallel compiler for deep-learning training.
#[derive(Parser)]
#[command(name = "autopar", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the zoo's models and spec families with their parameter counts.
    Models {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Dump a model's forward graph or its training step as text IR (.air), Graphviz DOT or JSON.
    Dump {
        /// A zoo name, a spec (gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256), or a .air/.json file.
        model: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Write to this file instead of standard output.
        #[arg(short, long, value_name = "FILE")]
        output: Option<String>,
        /// Batch size for zoo models (the global batch of a training step) [default: 8].
        #[arg(long, value_parser = crate::parse_batch)]
        batch: Option<usize>,
        /// Which graph: the model's forward, or the whole training step (forward, backward
        /// and optimizer update, shaped by the training options).
        #[arg(long, value_enum, default_value_t = Stage::Forward)]
        stage: Stage,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        pipeline: PipelineArgs,
        #[command(flatten)]
        spmd: spmd_cmd::SpmdArgs,
        /// With --stage partitioned or fused, the rank whose program to show.
        #[arg(long, default_value_t = 0)]
        rank: usize,
        /// With --stage fused: show the rank program without the fusion pass.
        #[arg(long)]
        no_fuse: bool,
        /// Print the values of parameters imported with given values (ONNX initializers) in
        /// full, so that the text loads back; by default only their count is printed.
        #[arg(long)]
        values: bool,
        /// With --format dot, only the nodes of these layers (a training step has thousands
        /// of nodes): block indices `N`, ranges `A..B` (end excluded) or `A..=B`, `embedding`,
        /// `final_norm`, `head`, `loss`, and `none` for nodes of no layer; e.g. `--layers 0`.
        /// Operands from elsewhere are drawn as placeholders naming their producer.
        #[arg(long, value_name = "LAYERS", value_parser = parse_layers)]
        layers: Option<driver::ir::dot::LayerSelection>,
    },
    /// Train a model on CPU ranks, on the fast CPU backend (or the reference interpreter with
    /// --interpreter), or run one forward pass with --forward.
    ///
    /// Prints `step <i> loss: <value>` for each step, then `peak memory: <bytes>`, the largest
    /// total size of the tensors the backend held at once (in its storage: 4 bytes per float on
    /// the fast backend, the declared dtype's size on the interpreter).
    Run(Box<RunArgs>),
    /// Predict step time, throughput and memory of a training plan on a cluster.
    Estimate(EstimateArgs),
    /// Search the training plans of a model on a cluster and rank those that fit.
    Plan(plan_cmd::PlanArgs),
    /// Write one self-contained HTML page about a plan: the mesh on the machines, the
    /// pipeline timeline, memory per pipeline rank and where the time goes.
    Report(report_cmd::ReportArgs),
    /// Estimate every expressible row of the reference tables and report the errors against
    /// their measurements (median, worst, sign) per table and overall.
    Calibrate(calibrate_cmd::CalibrateArgs),
    /// Inspect a sharded checkpoint, or export its weights (Hugging Face safetensors).
    Checkpoint(checkpoint_cmd::CheckpointArgs),
    /// Run `autopar run ...` as an MPI job of N processes, one rank each: execs `mpirun` on
    /// this autopar with `--launcher mpi` added (e.g. `autopar launch -n 8 -- run gpt-tiny
    /// --mesh dp=2,tp=2,pp=2 --verify`).
    Launch(launch_cmd::LaunchArgs),
    /// Describe a cluster: devices, memory, fabrics and link bandwidths.
    Topo {
        /// A preset (dgx-a100:nodes=N, dgx-h100:nodes=N[,power=W], hgx-h200:nodes=N, cpu:ranks=N, ...) or a TOML file.
        cluster: String,
        /// Print the description as TOML (the input format of --cluster files).
        #[arg(long)]
        toml: bool,
    },
    /// Kernel benchmarks on a GPU (for scripts/gpu-check.sh): a bf16 GEMM, attention
    /// forward and backward, and a fused element-wise kernel against the copy bandwidth.
    #[command(hide = true)]
    BenchKernels {
        /// The device (only `cuda`).
        #[arg(long, default_value = "cuda", value_parser = ["cuda"])]
        device: String,
        /// Divide the problem sizes by this (1: the full sizes).
        #[arg(long, default_value_t = 1)]
        shrink: usize,
    },
}

#[derive(clap::Args)]
struct EstimateArgs {
    /// A transformer from the zoo (name or spec) or a .air/.json file.
    model: String,
    /// A preset (dgx-a100:nodes=N, dgx-h100:nodes=N[,power=W], hgx-h200:nodes=N, cpu:ranks=N, ...) or a TOML file.
    #[arg(long)]
    cluster: String,
    #[command(flatten)]
    stack: stack_args::StackArgs,
    /// Global batch size in sequences.
    #[arg(long, value_parser = crate::parse_batch)]
    batch: usize,
    /// The plan, e.g. "dp=8,tp=8,pp=16,vpp=2,mbs=1,zero=1,recompute=selective,sp=true,schedule=interleaved".
    /// Keys: dp tp pp vpp cp ep etp mbs zero offload recompute recompute_layers sp schedule dtype order stages attn mlp (attn/mlp: each op split over tp, `t`, or on sequence shards, `s`: attn=ttt|sts|sss..., mlp=tt|ss...; recompute_layers=N: with recompute=full, only the first N layers of each virtual stage recompute); omitted keys are 1/none/false/1f1b/Megatron-LM placement.
    #[arg(long, default_value = "")]
    plan: String,
    /// Compute dtype (overrides the plan's).
    #[arg(long, value_enum)]
    dtype: Option<stack_args::ComputeDtype>,
    /// Print JSON.
    #[arg(long, conflicts_with = "explain")]
    json: bool,
    /// Print where the time and the memory go.
    #[arg(long)]
    explain: bool,
    /// Write the simulated pipeline schedule as a Chrome trace (open in Perfetto).
    #[arg(long, value_name = "FILE")]
    trace: Option<String>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// A zoo name, a spec, or a .air/.json file.
    model: String,
    /// Run one forward pass and print `loss: <value>` instead of training.
    #[arg(long, conflicts_with = "steps")]
    forward: bool,
    /// With --forward: write every input fed and every output computed to DIR as `.npy`
    /// files (`inputs.NAME.npy`, `outputs.NAME.npy`), e.g. to compare with ONNX Runtime.
    #[arg(
        long,
        value_name = "DIR",
        requires = "forward",
        conflicts_with_all = ["checkpoint", "resume", "init_from", "data"]
    )]
    outputs: Option<String>,
    /// Number of training steps.
    #[arg(long, default_value_t = 1)]
    steps: u64,
    /// Batch size for zoo models (the global batch, split into the micro-batches) [default: 8].
    #[arg(long, value_parser = crate::parse_batch)]
    batch: Option<usize>,
    /// Seed of the parameter initialisation and the synthetic data [default: 0; a resumed
    /// run keeps its checkpoint's].
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    pipeline: PipelineArgs,
    #[command(flatten)]
    spmd: spmd_cmd::SpmdArgs,
    /// Compare the step with the single-device step and print
    /// `verify: max_abs_err=<x> max_rel_err=<y> OK` (or FAILED, exiting with 1).
    #[arg(long)]
    verify: bool,
    /// Write the executed (last) step of a pipeline as a Chrome trace JSON (open in
    /// Perfetto): one track per rank of the mesh, one slice per schedule action.
    #[arg(long, value_name = "FILE")]
    trace: Option<String>,
    /// Write an HTML report of the run: the plan's predicted timeline and memory beside the
    /// measured ones (see `autopar report`).
    #[arg(long, value_name = "FILE")]
    report: Option<String>,
    /// Search the plans the CPU runtime executes on --cluster, print the best and run it.
    #[arg(long, requires = "cluster", conflicts_with = "plan_file")]
    auto: bool,
    /// The cluster of --auto (e.g. `cpu:ranks=8`): its device count is the number of ranks.
    #[arg(long, requires = "auto")]
    cluster: Option<String>,
    /// Run exactly this plan (written by `autopar plan --save`, or an `autopar plan --json`
    /// document, whose best plan is taken).
    #[arg(long, value_name = "FILE")]
    plan_file: Option<String>,
    #[command(flatten)]
    diag: run_cmd::CompileDiagArgs,
    #[command(flatten)]
    checkpoint: checkpoint_cmd::CheckpointRunArgs,
    #[command(flatten)]
    launch: launch_cmd::LauncherArgs,
    #[command(flatten)]
    device: run_cmd::DeviceArgs,
}

/// Options of a pipeline-parallel run or dump.
#[derive(clap::Args)]
struct PipelineArgs {
    /// Device mesh, e.g. `dp=2,tp=2` (data, tensor and expert parallel on CPU ranks, with
    /// ZeRO and annotations), `pp=2` (a pipeline) or both (`dp=2,tp=2,pp=2`: every
    /// `dp`/`tp` rank's local step cut into a pipeline).
    #[arg(long)]
    mesh: Option<String>,
    /// Pipeline schedule: gpipe, 1f1b or interleaved (with --vpp).
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Model chunks per pipeline rank (virtual stages; needs --schedule interleaved).
    #[arg(long, default_value_t = 1, value_parser = parse_positive)]
    vpp: usize,
    /// Layers that must start a stage, by name or index (e.g. `h.2` or `3,5`).
    #[arg(long, value_delimiter = ',')]
    stage_boundaries: Vec<String>,
}

/// Options shaping the training step.
#[derive(clap::Args)]
struct TrainArgs {
    /// Optimizer: AdamW (betas 0.9/0.95, weight decay 0.01) or SGD with momentum 0.9.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    optimizer: OptimizerArg,
    /// Learning rate [default: 3e-3 with AdamW, 0.1 with SGD]: the peak rate of a schedule.
    #[arg(long)]
    lr: Option<f64>,
    /// Learning-rate decay after the warmup: constant, cosine or linear, from --lr down to
    /// --min-lr at step --lr-decay-steps.
    #[arg(long, value_enum, default_value_t = LrScheduleArg::Constant)]
    lr_schedule: LrScheduleArg,
    /// Steps of linear learning-rate warmup from lr/N up to --lr.
    #[arg(long, default_value_t = 0, value_name = "N")]
    warmup: u64,
    /// The step at which a cosine or linear decay ends, counted from the start of training
    /// [default: --steps of `run`].
    #[arg(long, value_name = "N")]
    lr_decay_steps: Option<u64>,
    /// The learning rate a decay ends at [default: a tenth of --lr].
    #[arg(long, value_name = "X")]
    min_lr: Option<f64>,
    /// Compute dtype; bf16 and f16 keep fp32 master weights and optimizer state, and f16
    /// uses dynamic loss scaling.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    /// Micro-batches per step (gradient accumulation); must divide the batch size.
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Activation recompute: none, selective (the attention core) or full (every layer
    /// from its input).
    #[arg(long, value_enum, default_value_t = RecomputeArg::None)]
    recompute: RecomputeArg,
    /// Clip gradients to this global L2 norm; 0 disables clipping.
    #[arg(long, default_value_t = 1.0)]
    clip_norm: f64,
    /// Initial loss scale with --dtype f16 (halved after an overflow, doubled after 2000
    /// finite steps) [default: 65536].
    #[arg(long)]
    loss_scale: Option<f64>,
    /// The loss of an ONNX model (a forward): `ce`, cross-entropy of its last output's
    /// logits against a new `targets` input of next tokens, or `mse`.
    #[arg(long, value_parser = parse_loss)]
    loss: Option<driver::frontends::onnx::Loss>,
}

fn parse_loss(v: &str) -> Result<driver::frontends::onnx::Loss, String> {
    v.parse()
}

impl TrainArgs {
    /// Options that contradict each other.
    fn check(&self) -> Result<()> {
        if self.loss_scale.is_some() && !matches!(self.dtype, DTypeArg::F16) {
            anyhow::bail!(
                "--loss-scale applies to --dtype f16 only (bf16 and f32 need no loss scaling)"
            );
        }
        Ok(())
    }

    /// The training options; `steps` is the length of the run, where the learning-rate
    /// decay ends unless --lr-decay-steps says otherwise.
    fn options(&self, steps: Option<u64>) -> Result<TrainOptions> {
        let optimizer = match self.optimizer {
            OptimizerArg::Adamw => Optimizer::adamw(self.lr.unwrap_or(Optimizer::DEFAULT_ADAMW_LR)),
            OptimizerArg::Sgd => Optimizer::sgd(self.lr.unwrap_or(Optimizer::DEFAULT_SGD_LR)),
        };
        let lr_schedule = self.lr_schedule(optimizer.lr(), steps)?;
        let compute_dtype = match self.dtype {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::F16 => DType::F16,
        };
        Ok(TrainOptions {
            optimizer,
            lr_schedule,
            clip_norm: (self.clip_norm != 0.0).then_some(self.clip_norm),
            compute_dtype,
            loss_scaling: (compute_dtype == DType::F16).then_some(LossScaling {
                initial_scale: self
                    .loss_scale
                    .unwrap_or(LossScaling::default().initial_scale),
                ..LossScaling::default()
            }),
            micro_batches: self.micro_batches,
            recompute: match self.recompute {
                RecomputeArg::None => Recompute::None,
                RecomputeArg::Selective => Recompute::Selective,
                RecomputeArg::Full => Recompute::Full,
            },
        })
    }

    /// The learning-rate schedule the flags give, with peak rate `lr`.
    fn lr_schedule(&self, lr: f64, steps: Option<u64>) -> Result<driver::LrSchedule> {
        use driver::LrDecay;
        let decay = match self.lr_schedule {
            LrScheduleArg::Constant => {
                if self.lr_decay_steps.is_some() || self.min_lr.is_some() {
                    anyhow::bail!(
                        "--lr-decay-steps and --min-lr apply to --lr-schedule cosine or linear"
                    );
                }
                LrDecay::Constant
            }
            kind => {
                let steps = self.lr_decay_steps.or(steps).ok_or_else(|| {
                    anyhow::anyhow!(
                        "--lr-schedule {} needs --lr-decay-steps (the step its decay ends at)",
                        if kind == LrScheduleArg::Cosine {
                            "cosine"
                        } else {
                            "linear"
                        }
                    )
                })?;
                let min_lr = self.min_lr.unwrap_or(lr / 10.0);
                if !(min_lr.is_finite() && lr > 0.0) {
                    anyhow::bail!("--min-lr {min_lr} is not a learning rate");
                }
                let min_ratio = min_lr / lr;
                match kind {
                    LrScheduleArg::Cosine => LrDecay::Cosine { steps, min_ratio },
                    _ => LrDecay::Linear { steps, min_ratio },
                }
            }
        };
        let schedule = driver::LrSchedule {
            warmup: self.warmup,
            decay,
        };
        schedule.check().map_err(|e| match (e, self.min_lr) {
            (driver::LrScheduleError::FinalRatio { .. }, Some(m)) => {
                anyhow::anyhow!("--min-lr {m} must lie between 0 and --lr {lr}")
            }
            (driver::LrScheduleError::FinalRatio { .. }, None) => anyhow::anyhow!("{e} (--min-lr)"),
            (driver::LrScheduleError::DecayEndsInWarmup { .. }, _) => {
                anyhow::anyhow!("{e} (--lr-decay-steps, --warmup)")
            }
        })?;
        Ok(schedule)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Stage {
    /// The model's forward graph.
    Forward,
    /// The training-step graph.
    Train,
    /// The training step with a placement on every value (needs --mesh).
    Sharded,
    /// One rank's local program of the training step, with its collectives (needs --mesh;
    /// --rank picks the rank).
    Partitioned,
    /// One rank's program as it runs: the local program after the rewrite and fusion pass
    /// (simplified, identical collectives merged, element-wise regions in `fusion` nodes); on
    /// one device without --mesh; --rank picks the rank.
    Fused,
    /// One rank's local program as it runs: its data-parallel gradient all-reduces in
    /// --bucket-mb buckets and its small all-reduces batched (needs --mesh without a pp axis,
    /// whose sub-programs `run --dump-after collectives` shows; --rank picks the rank).
    Collectives,
    /// The pipeline stages of the training step (needs --mesh with a pp axis, alone or with
    /// dp/tp): layers and cost (FLOPs of the global step; with dp/tp also of each rank's
    /// local step).
    Pipeline,
    /// The pipeline schedule's action lists (needs --mesh with a pp axis; with dp/tp, the
    /// ranks that run each list).
    Schedule,
}

#[derive(Clone, Copy, ValueEnum)]
enum OptimizerArg {
    /// AdamW with bias correction and decoupled weight decay.
    Adamw,
    /// SGD with momentum.
    Sgd,
}

#[derive(Clone, Copy, ValueEnum)]
enum DTypeArg {
    /// Everything in fp32.
    #[value(alias = "fp32")]
    F32,
    /// bfloat16 compute.
    Bf16,
    /// float16 compute with dynamic loss scaling.
    #[value(alias = "fp16")]
    F16,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LrScheduleArg {
    /// The rate stays at --lr after the warmup.
    Constant,
    /// Half a cosine down to --min-lr (GPT-3's and LLaMA's schedule).
    Cosine,
    /// A straight line down to --min-lr.
    Linear,
}

#[derive(Clone, Copy, ValueEnum)]
enum RecomputeArg {
    /// Store every activation the backward reads.
    None,
    /// Recompute the attention core.
    Selective,
    /// Recompute every layer from its input.
    Full,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Dot,
    Json,
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let given = |sub: &str, ids: &[&'static str]| -> Vec<&'static str> {
        matches
            .subcommand_matches(sub)
            .map(|m| ignored_options(m, ids))
            .unwrap_or_default()
    };
    if let Err(e) = check_options(&cli, &given) {
        eprintln!("error: {e:#}");
        return ExitCode::FAILURE;
    }
    let grace = match &cli.command {
        Command::Run(args) if args.launch.is_mpi() => Some(args.launch.grace()),
        _ => None,
    };
    let mpi = grace.is_some();
    let outcome = match mpi {
        true => launch_cmd::as_mpi_rank().and_then(|()| execute(cli)),
        false => execute(cli),
    };
    match outcome {
        Ok(()) => {
            if mpi {
                driver::launch::finish();
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            // One write, so that the reports of several MPI ranks sharing a terminal or a
            // pipe do not interleave.
            let _ = std::io::stderr().write_all(format!("error: {e:#}\n").as_bytes());
            if let Some(grace) = grace {
                // Every rank reports its own error, then the job ends: a rank that died or
                // hangs must not keep the others (or mpirun) waiting.
                launch_cmd::end_job(grace);
            }
            ExitCode::FAILURE
        }
    }
}

/// The options among `ids` given on the command line (not defaults).
fn ignored_options(m: &clap::ArgMatches, ids: &[&'static str]) -> Vec<&'static str> {
    ids.iter()
        .copied()
        .filter(|id| {
            m.try_get_raw(id).is_ok_and(|v| v.is_some())
                && m.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
        })
        .collect()
}

/// Options that the command as given would silently ignore: each is an error, so that
/// nobody reads a dump or a run believing an option shaped it. `given(subcommand, ids)`
/// returns the ids among `ids` that were on the command line.
fn check_options(
    cli: &Cli,
    given: &dyn Fn(&str, &[&'static str]) -> Vec<&'static str>,
) -> Result<()> {
    const TRAIN: &[&str] = &[
        "optimizer",
        "lr",
        "dtype",
        "micro_batches",
        "recompute",
        "clip_norm",
        "loss_scale",
    ];
    const SPMD: &[&str] = &["mesh", "zero", "annotate", "sp", "attn", "mlp"];
    const PIPELINE: &[&str] = &["schedule", "vpp", "stage_boundaries"];
    let refuse = |ids: Vec<&str>, context: &str| -> Result<()> {
        match ids.first() {
            Some(id) => anyhow::bail!(
                "--{} does not apply to {context}, which would ignore it",
                id.replace('_', "-")
            ),
            None => Ok(()),
        }
    };
    match &cli.command {
        Command::Dump {
            stage,
            format,
            train,
            layers,
            ..
        } => {
            if layers.is_some() && !matches!(format, Format::Dot) {
                anyhow::bail!(
                    "--layers applies to `--format dot` only: a text or JSON dump of part of \
                     a graph would not load back"
                );
            }
            let mut ignored: Vec<&'static str> = Vec::new();
            if !matches!(stage, Stage::Fused | Stage::Collectives) {
                ignored.push("no_fuse");
            }
            if !matches!(stage, Stage::Collectives) {
                ignored.push("bucket_mb");
            }
            let (name, graph) = match stage {
                Stage::Forward => {
                    ignored.extend(TRAIN.iter().chain(SPMD).chain(PIPELINE));
                    ignored.push("rank");
                    ("forward", true)
                }
                Stage::Train => {
                    ignored.extend(SPMD.iter().chain(PIPELINE));
                    ignored.push("rank");
                    ("train", true)
                }
                Stage::Sharded => {
                    ignored.extend(PIPELINE);
                    ignored.push("rank");
                    ("sharded", true)
                }
                Stage::Partitioned => {
                    ignored.extend(PIPELINE);
                    ("partitioned", true)
                }
                Stage::Fused => {
                    ignored.extend(PIPELINE);
                    ("fused", true)
                }
                Stage::Collectives => {
                    ignored.extend(PIPELINE);
                    ("collectives", true)
                }
                Stage::Pipeline => {
                    ignored.push("rank");
                    ("pipeline", false)
                }
                Stage::Schedule => {
                    ignored.extend(["rank", "zero", "annotate", "sp", "attn", "mlp"]);
                    ignored.extend(TRAIN.iter().filter(|&&id| id != "micro_batches"));
                    ignored.push("stage_boundaries");
                    ("schedule", false)
                }
            };
            if !graph && !matches!(format, Format::Text) {
                anyhow::bail!(
                    "--format does not apply to `dump --stage {name}`, which prints a text \
                     description, not a graph"
                );
            }
            refuse(given("dump", &ignored), &format!("`dump --stage {name}`"))?;
            train.check()
        }
        // A plan file or a search sets the dtype; `auto_cmd` checks --loss-scale against it.
        Command::Run(args) if args.auto || args.plan_file.is_some() => Ok(()),
        Command::Run(args) => args.train.check(),
        _ => Ok(()),
    }
}

fn execute(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Models { json } => models(json),
        Command::Dump {
            model,
            format,
            output,
            batch,
            stage,
            train,
            pipeline,
            spmd,
            rank,
            values,
            layers,
            no_fuse,
        } => {
            let which = run_cmd::DumpRank {
                rank,
                fuse: !no_fuse,
            };
            let dumped = run_cmd::dump(&model, batch, stage, &train, &pipeline, &spmd, which)?;
            let text = match dumped {
                run_cmd::Dumped::Text(text) => text,
                run_cmd::Dumped::Graph(g) => {
                    if matches!(format, Format::Dot) && layers.is_none() && g.num_nodes() > 1000 {
                        eprintln!(
                            "note: {} nodes are more than a drawing shows legibly; `--layers 0` \
                             draws block 0 only",
                            g.num_nodes()
                        );
                    }
                    let text = driver::dump_with(
                        &g,
                        match format {
                            Format::Text if values => DumpFormat::TextWithValues,
                            Format::Text => DumpFormat::Text,
                            Format::Dot => DumpFormat::Dot,
                            Format::Json => DumpFormat::Json,
                        },
                        layers,
                    );
                    match (format, run_cmd::import_report(&model, batch, &train)?) {
                        (Format::Text, Some(report)) => format!("{report}{text}"),
                        _ => text,
                    }
                }
            };
            match output {
                Some(path) => {
                    std::fs::write(&path, text).with_context(|| format!("cannot write `{path}`"))
                }
                None => print_stdout(&text),
            }
        }
        Command::Run(args) => match args.auto || args.plan_file.is_some() {
            true => auto_cmd::run(&args),
            false => run_cmd::run(&args),
        },
        Command::Estimate(args) => estimate(args),
        Command::Plan(args) => plan_cmd::plan(args),
        Command::Report(args) => report_cmd::report(args),
        Command::Calibrate(args) => calibrate_cmd::calibrate_cmd(args),
        Command::Checkpoint(args) => checkpoint_cmd::run(&args),
        Command::Topo { cluster, toml } => topo(&cluster, toml),
        Command::Launch(args) => launch_cmd::launch(&args),
        Command::BenchKernels { device: _, shrink } => run_cmd::bench_kernels(shrink),
    }
}

/// `--layers` of `dump`.
fn parse_layers(s: &str) -> Result<driver::ir::dot::LayerSelection, String> {
    s.parse()
}

fn estimate(args: EstimateArgs) -> Result<()> {
    use driver::cost_model::Plan;
    let cluster = args.stack.cluster(&args.cluster)?;
    let cluster_desc = format!("{} ({} devices)", args.cluster, cluster.num_devices());
    let mut plan = if args.plan.trim().is_empty() {
        Plan::default()
    } else {
        Plan::parse(&args.plan)?
    };
    let gives_batch = driver::cost_model::plan::key_values(&args.plan)?
        .iter()
        .any(|(k, _)| matches!(*k, "gbs" | "batch" | "global_batch"));
    if gives_batch && plan.global_batch != args.batch {
        bail!(
            "--plan gives a global batch of {}, --batch {}: give it once",
            plan.global_batch,
            args.batch
        );
    }
    plan.global_batch = args.batch;
    plan.check()?;
    if let Some(d) = args.dtype {
        d.apply(&mut plan);
    }
    let est = driver::estimate(&args.model, cluster, &plan)?;
    if let Some(path) = &args.trace {
        let timeline = est
            .timeline
            .as_ref()
            .context("the plan is infeasible, so there is no schedule to trace")?;
        let schedule = driver::ir::schedule::Schedule::new(
            plan.schedule,
            plan.pp,
            plan.vpp,
            plan.micro_batches(),
        )?;
        let slices = driver::ir::trace::schedule_slices(&schedule, timeline, 1.0);
        let names: Vec<String> = (0..plan.pp).map(|r| format!("pipeline rank {r}")).collect();
        std::fs::write(path, driver::ir::trace::chrome_trace(&names, &slices))
            .with_context(|| format!("cannot write `{path}`"))?;
    }
    if args.json {
        return print_stdout(&(serde_json::to_string_pretty(&est)? + "\n"));
    }
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut out = format!("model {} on {cluster_desc}\nplan  {plan}\n\n", args.model);
    out += &format!("iteration time        {:.3} s\n", est.iter_time_s);
    out += &format!("tokens/s              {:.0}\n", est.tokens_per_s);
    out += &format!("model TFLOP/s/GPU     {:.1}\n", est.model_tflops_per_gpu);
    out += &format!("hardware TFLOP/s/GPU  {:.1}\n", est.hardware_tflops_per_gpu);
    out += &format!("MFU                   {:.1}%\n", 100.0 * est.mfu);
    out += &format!(
        "peak memory           {:.1} GiB of {:.1} GiB: {}\n",
        est.peak_memory_gib,
        gib(est.memory.capacity),
        if est.fits {
            "fits".to_string()
        } else {
            format!(
                "does NOT fit ({})",
                est.fits_reason.as_deref().unwrap_or("over capacity")
            )
        }
    );
    if args.explain {
        let t = &est.time;
        let ms = |s: f64| s * 1e3;
        out += "\ntime of one layer, one micro-batch (ms)   forward  backward\n";
        if let Some(n) = plan.recompute_layers {
            // The backward below is a recomputing layer's; the others run without.
            out += &format!(
                "  (a recomputed layer: the first {n} of each virtual stage recompute, the rest \
                 keep their activations)\n"
            );
        }
        for (what, f, b) in [
            (
                "dense GEMMs",
                t.layer_forward.gemm_s,
                t.layer_backward.gemm_s,
            ),
            (
                "attention core",
                t.layer_forward.attention_s,
                t.layer_backward.attention_s,
            ),
            (
                "memory-bound kernels",
                t.layer_forward.memory_s,
                t.layer_backward.memory_s,
            ),
            (
                "recompute",
                t.layer_forward.recompute_s,
                t.layer_backward.recompute_s,
            ),
            (
                "communication, exposed",
                t.layer_forward.comm_exposed_s,
                t.layer_backward.comm_exposed_s,
            ),
            (
                "  tensor-parallel",
                t.layer_forward.exposed_by.tp_s,
                t.layer_backward.exposed_by.tp_s,
            ),
            (
                "  context-parallel",
                t.layer_forward.exposed_by.cp_s,
                t.layer_backward.exposed_by.cp_s,
            ),
            (
                "  expert-parallel",
                t.layer_forward.exposed_by.ep_s,
                t.layer_backward.exposed_by.ep_s,
            ),
            (
                "  ZeRO",
                t.layer_forward.exposed_by.zero_s,
                t.layer_backward.exposed_by.zero_s,
            ),
            (
                "  of which GEMM second waves",
                t.layer_forward.second_wave_s,
                t.layer_backward.second_wave_s,
            ),
            (
                "communication, issued",
                t.layer_forward.comm_total_s,
                t.layer_backward.comm_total_s,
            ),
            (
                "total",
                t.layer_forward.total_s(),
                t.layer_backward.total_s(),
            ),
        ] {
            out += &format!("  {what:<38} {:>8.3}  {:>8.3}\n", ms(f), ms(b));
        }
        if !est.layer_tp_collectives.is_empty() {
            out += &format!(
                "\ntensor-parallel collectives of one layer, one micro-batch (tp={}, {}{})\n",
                plan.tp,
                plan.layer,
                if plan.sequence_parallel { ", sp" } else { "" }
            );
            for c in &est.layer_tp_collectives {
                let t = &c.collective;
                out += &format!(
                    "  {:<8} {:<14} {:>9.1} MB {:>8.3} ms  {}\n",
                    match t.pass {
                        driver::cost_model::layer::Pass::Forward => "forward",
                        driver::cost_model::layer::Pass::Backward => "backward",
                    },
                    t.kind.name(),
                    c.bytes / 1e6,
                    ms(c.time_s),
                    t.why
                );
            }
        }
        out += "\nstep (s)\n";
        for (what, v) in [
            ("pipeline (first forward to last backward)", t.pipeline_s),
            ("  busiest rank's compute", t.busiest_rank_compute_s),
            ("  bubbles and transfer waits", t.bubble_s),
            ("  one stage-to-stage transfer", t.p2p_s),
            ("data-parallel gradient reduction", t.grad_reduce_s),
            ("  of which exposed", t.grad_reduce_exposed_s),
            ("embedding gradient sync", t.embedding_sync_s),
            ("optimizer", t.optimizer_s),
            ("parameter all-gather (ZeRO)", t.param_gather_s),
        ] {
            out += &format!("  {what:<44} {v:>10.4}\n");
        }
        let m = &est.memory;
        out += &format!("\nmemory of pipeline rank {} (GiB)\n", m.pipeline_rank);
        for (what, v) in [
            ("weights", m.weights),
            ("gradients", m.gradients),
            ("optimizer state", m.optimizer),
            (
                &format!("activations ({} micro-batch chunks in flight)", m.in_flight) as &str,
                m.activations,
            ),
            ("working (backward of one layer)", m.working),
            ("communication buffers", m.comm_buffers),
            ("reserved", m.reserved),
            ("total", m.total),
            ("capacity", m.capacity),
        ] {
            out += &format!("  {what:<44} {:>10.2}\n", gib(v));
        }
        if m.host > 0.0 {
            out += &format!(
                "  {:<44} {:>10.2}\n",
                format!("host memory (offload={})", plan.offload.name()),
                gib(m.host)
            );
        }
    }
    print_stdout(&out)
}

fn topo(arg: &str, toml: bool) -> Result<()> {
    let c = driver::load_cluster(arg)?;
    if toml {
        return print_stdout(&c.to_toml());
    }
    let g = &c.gpu;
    let mut out = format!(
        "{}: {} node(s) x {} {} = {} devices\n",
        if c.name.is_empty() { arg } else { &c.name },
        c.nodes,
        c.gpus_per_node,
        g.model,
        c.num_devices()
    );
    out += &format!(
        "device     peak {} TFLOP/s bf16, {} fp16, {} fp32; HBM {} GiB at {} GB/s ({} GiB reserved)\n",
        g.peak_tflops.bf16,
        g.peak_tflops.f16,
        g.peak_tflops.f32,
        g.hbm_capacity_gib,
        g.hbm_bandwidth_gb_per_s,
        g.reserved_gib
    );
    if let (Some(tdp), Some(limit)) = (g.tdp_w, g.power_limit_w) {
        out += &format!(
            "power      limited to {limit} W of its rated {tdp} W: tensor cores at {:.1}% of \
             their clock\n",
            100.0 * g.power_clock_share()
        );
    }
    out += &format!(
        "intra-node {}: {} GB/s bus bandwidth, {} us per step\n",
        c.intra_node.fabric, c.intra_node.bus_bandwidth_gb_per_s, c.intra_node.latency_us
    );
    if let Some(algbw) = c.intra_node.nvls_algbw_gb_per_s {
        out += &format!(
            "           NVLink SHARP all-reduce: {algbw} GB/s algorithm bandwidth, chunks of up \
             to {} KiB\n",
            c.intra_node.nvls_chunk_kib.unwrap_or(128)
        );
    }
    let n = &c.network;
    out += &format!(
        "inter-node {} NIC(s) per node, {} GB/s bus bandwidth each ({} GB/s per node), {} us per step\n",
        n.nics_per_node,
        n.nic_bus_bandwidth_gb_per_s,
        n.nic_bus_bandwidth_gb_per_s * n.nics_per_node as f64,
        n.latency_us
    );
    out += "NIC of each local device: ";
    out += &(0..c.gpus_per_node)
        .map(|d| c.nic_of(d).to_string())
        .collect::<Vec<_>>()
        .join(" ");
    out += "\n";
    print_stdout(&out)
}

fn models(json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for e in zoo::entries() {
        let params = match e.kind {
            EntryKind::Preset => Some(zoo::resolve(e.name)?.num_parameters()),
            EntryKind::Family => None,
        };
        rows.push((e, params));
    }
    if json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|(e, p)| {
                serde_json::json!({
                    "name": e.name,
                    "kind": match e.kind { EntryKind::Preset => "model", EntryKind::Family => "spec" },
                    "parameters": p,
                    "description": e.description,
                })
            })
            .collect();
        return print_stdout(&(serde_json::to_string_pretty(&list)? + "\n"));
    }
    let models: Vec<_> = rows
        .iter()
        .filter(|(e, _)| e.kind == EntryKind::Preset)
        .collect();
    let width = models
        .iter()
        .map(|(e, _)| e.name.len())
        .max()
        .unwrap_or(0)
        .max(5);
    let mut out = format!(
        "{:<width$}  {:>16}  {:>7}  DESCRIPTION\n",
        "MODEL", "PARAMETERS", ""
    );
    for (e, p) in &models {
        let n = p.unwrap_or(0);
        out += &format!(
            "{:<width$}  {:>16}  {:>7}  {}\n",
            e.name,
            group_digits(n),
            human_count(n),
            e.description
        );
    }
    out += "\nGeneric specs (also: a zoo name with overrides, e.g. llama3-8b:seq=4096):\n";
    for (e, _) in rows.iter().filter(|(e, _)| e.kind == EntryKind::Family) {
        out += &format!("  {}\n      {}\n", e.name, e.description);
    }
    print_stdout(&out)
}

/// `--max-seconds`: a non-negative number of seconds that a `Duration` holds.
fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    std::time::Duration::try_from_secs_f64(secs)
        .map_err(|_| format!("`{s}` is not a number of seconds from 0 to about 1.8e19"))
}

/// A count that must be at least 1.
fn parse_positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{s}` is not a positive integer")),
    }
}

/// `--batch`: a global batch of 1 to [`driver::cost_model::plan::MAX_GLOBAL_BATCH`]
/// sequences, the range every command (and the search) accepts.
fn parse_batch(s: &str) -> Result<usize, String> {
    let max = driver::cost_model::plan::MAX_GLOBAL_BATCH;
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a batch size from 1 to {max} sequences"
        )),
    }
}

/// `--top`: how many plans `plan` and `report` rank, 1 to 10000 (the search keeps that many
/// in memory).
fn parse_top(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=10_000).contains(&n) => Ok(n),
        _ => Err(format!("`{s}` is not a number of plans from 1 to 10000")),
    }
}

/// Writes to stdout; a closed pipe (`autopar dump ... | head`) ends the program, successfully.
fn print_stdout(s: &str) -> Result<()> {
    if launch_cmd::stdout_is_quiet() {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|()| out.flush()) {
        // Nobody reads any more (`autopar run ... | head`): stop, whatever was running.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        r => r.context("cannot write to standard output"),
    }
}

/// `174604259328` → `174,604,259,328`.
fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `174604259328` → `174.6B`.
fn human_count(n: u64) -> String {
    let x = n as f64;
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}M", x / 1e6),
        _ => format!("{:.1}B", x / 1e9),
    }
}
