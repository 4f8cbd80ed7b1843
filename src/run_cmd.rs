//! `autopar run` and the graph stages of `autopar dump`: the command line's options become
//! [`driver::CompileOptions`], the driver compiles and runs, and this module prints what it
//! reports (losses, memory per rank, `--verify`, `--timings`, `--dump-after` files, traces).

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};

use anyhow::{Context, Result, bail};

use autopar_driver::{self as driver, CompileOptions, CompiledStep, Pass, RunReport};
use driver::ir::DeviceMesh;
use driver::ir::schedule::{Schedule, ScheduleKind};

use crate::checkpoint_cmd::Session;
use crate::progress::{Ticker, training_status};
use crate::{PipelineArgs, RunArgs, Stage, TrainArgs, print_stdout, spmd_cmd};

/// Compiler options and diagnostics of `autopar run`.
#[derive(clap::Args)]
pub struct CompileDiagArgs {
    /// Compile without the fusion pass: the rank programs run as partitioning (and the
    /// pipeline split) left them, with no rewrites, merged collectives or fusions.
    #[arg(long)]
    pub no_fuse: bool,
    /// Print the wall time of every compiler pass (and of the verifier after it).
    #[arg(long)]
    pub timings: bool,
    /// Write the output of these passes as text IR, one file per graph, into --dump-dir:
    /// model, sequence-layout, train-step, parallelize, partition, pipeline-split, fuse,
    /// collectives (the last pass, memory-plan, produces no graph).
    #[arg(long, value_name = "PASS", value_delimiter = ',', value_parser = parse_pass)]
    pub dump_after: Vec<Pass>,
    /// Directory of the --dump-after files.
    #[arg(long, value_name = "DIR", default_value = "autopar-dump")]
    pub dump_dir: String,
}

/// Where `autopar run` executes.
#[derive(clap::Args)]
pub struct DeviceArgs {
    /// The device: `cpu` (the fast CPU backend, or the reference interpreter with
    /// --interpreter) or `cuda` (generated kernels on NVIDIA GPUs, one thread per rank, ranks
    /// round robin over the GPUs; needs libcuda, libnvrtc and libcublas on the loader's path).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
}

/// `autopar bench-kernels`: one line per figure, `name<TAB>value unit<TAB>fraction of what
/// it is compared with`.
pub fn bench_kernels(shrink: usize) -> Result<()> {
    let figures = driver::cuda_bench_kernels(shrink)?;
    let mut out = String::new();
    for f in figures {
        let against = match &f.against {
            Some((v, what)) => format!("{:.1}% of {v:.1} {} ({what})", 100.0 * f.value / v, f.unit),
            None => "no reference (unknown GPU)".to_string(),
        };
        let _ = writeln!(out, "{}\t{:.1} {}\t{against}", f.name, f.value, f.unit);
    }
    print_stdout(&out)
}

fn parse_pass(v: &str) -> Result<Pass, String> {
    match v.parse()? {
        Pass::MemoryPlan => Err(format!(
            "`{v}` produces execution plans, not graphs (--timings reports it)"
        )),
        pass => Ok(pass),
    }
}

/// The compile options of a model, its training options, its mesh and the SPMD and
/// pipeline flags.
pub fn compile_options(
    model: &str,
    batch: Option<usize>,
    train: &TrainArgs,
    pipeline: &PipelineArgs,
    spmd: &spmd_cmd::SpmdArgs,
    forward: bool,
    steps: Option<u64>,
) -> Result<CompileOptions> {
    let mut o = CompileOptions::new(model);
    o.batch = batch;
    o.train = train.options(steps)?;
    o.forward_only = forward;
    o.loss = train.loss;
    if let Some(mesh) = &pipeline.mesh {
        o = o.on_mesh(mesh)?;
        o.parallel = spmd.options()?;
    }
    o.bucket_mb = spmd.bucket_mb;
    o.pipeline = driver::PipelineSpec {
        schedule: pipeline.schedule.parse::<ScheduleKind>()?,
        vpp: pipeline.vpp,
        boundaries: pipeline.stage_boundaries.clone(),
    };
    Ok(o)
}

/// `autopar run` without `--auto` or `--plan-file`.
pub fn run(args: &RunArgs) -> Result<()> {
    let mut options = compile_options(
        &args.model,
        args.batch,
        &args.train,
        &args.pipeline,
        &args.spmd,
        args.forward,
        Some(args.steps),
    )?;
    options.reference = args.verify;
    if let Some(dir) = &args.outputs {
        return write_forward(&options, args.seed.unwrap_or(0), dir);
    }
    if let driver::ModelSource::OnnxFile(path) = driver::ModelSource::classify(&args.model)
        && options.loss.is_none()
    {
        bail!(
            "`{path}` is a forward without a loss: add --loss ce|mse, or write its outputs with \
             --forward --outputs DIR"
        );
    }
    run_options(args, options)
}

/// `run --forward --outputs DIR`: one forward pass on one device, its inputs and outputs
/// written as `.npy` files.
fn write_forward(options: &CompileOptions, seed: u64, dir: &str) -> Result<()> {
    if options.mesh.is_some() {
        bail!("--outputs runs the forward on one device; leave out --mesh");
    }
    let step = driver::compile(options)?;
    let values = driver::run_forward(&step, seed)?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create `{dir}`"))?;
    let mut n = 0;
    for (kind, tensors) in [("inputs", &values.inputs), ("outputs", &values.outputs)] {
        for t in tensors {
            let path = std::path::Path::new(dir).join(format!("{kind}.{}.npy", t.name));
            std::fs::write(&path, npy(t))
                .with_context(|| format!("cannot write `{}`", path.display()))?;
            n += 1;
        }
    }
    print_stdout(&format!("wrote {n} files to {dir}/\n"))
}

/// A tensor in NumPy's `.npy` format (version 1.0): float outputs as `<f4`, integers as `<i8`.
fn npy(t: &driver::NamedTensor) -> Vec<u8> {
    let (descr, data): (&str, Vec<u8>) = match &t.values {
        driver::TensorValues::Float(v) => (
            "<f4",
            v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        ),
        driver::TensorValues::Int(v) => ("<i8", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    let shape: Vec<String> = t.dims.iter().map(usize::to_string).collect();
    let shape = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!("({})", shape.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    out
}

/// The import report of an ONNX model argument (what raising recognised), for the top of a
/// text dump; `None` for other models.
pub fn import_report(
    model: &str,
    batch: Option<usize>,
    train: &TrainArgs,
) -> Result<Option<String>> {
    match driver::ModelSource::classify(model) {
        driver::ModelSource::OnnxFile(path) => Ok(Some(
            driver::import_onnx(&path, batch, train.loss)?
                .report
                .to_string(),
        )),
        _ => Ok(None),
    }
}

/// Compiles `options`, runs it as `args` asks and prints the report.
pub fn run_options(args: &RunArgs, mut options: CompileOptions) -> Result<()> {
    if options.mesh.is_none() && (args.verify || args.trace.is_some()) {
        bail!("--verify and --trace need --mesh");
    }
    if args.launch.is_mpi() && (args.trace.is_some() || args.report.is_some()) {
        bail!(
            "--trace and --report need --launcher threads (the timeline stays with each process)"
        );
    }
    let mut launch = args.launch.launch()?;
    launch.device = args.device.device.parse()?;
    if launch.device == driver::Device::Cuda
        && (launch.backend == driver::BackendKind::Interpreter
            || launch.threads.is_some()
            || launch.wide_accumulation)
    {
        bail!(
            "--interpreter, --threads and --wide-accumulation choose a CPU backend: not with --device cuda"
        );
    }
    options.dump_after = args.diag.dump_after.clone();
    options.fuse = !args.diag.no_fuse;
    let step = driver::compile(&options)?;
    if args.trace.is_some() && !step.is_pipeline() {
        bail!("--trace applies to pipelines (--mesh pp=N)");
    }
    // The output files are opened before the run, so that a path that cannot be written is
    // an error before the training, not after it.
    let open = |path: &Option<String>| -> Result<Option<(String, std::fs::File)>> {
        path.as_ref()
            .map(|p| {
                let file =
                    std::fs::File::create(p).with_context(|| format!("cannot write `{p}`"))?;
                Ok((p.clone(), file))
            })
            .transpose()
    };
    let trace_file = open(&args.trace)?;
    let report_file = open(&args.report)?;
    // Under MPI every process compiles the same step; rank 0 writes the dumps.
    if !crate::launch_cmd::stdout_is_quiet() {
        write_dumps(&step, &args.diag.dump_dir)?;
    }
    if args.diag.timings {
        print_stdout(&timings(&step))?;
    }
    let session = Session::new(&args.checkpoint, &options, &step, args.seed)?;
    let run_options = driver::RunOptions {
        seed: session.seed,
        steps: match args.forward {
            true => 1,
            false => session.steps_to_run(args.steps)?,
        },
        verify: args.verify,
        first_step: session.first_step,
        // `run_launched` sets `accumulation` for the backend it starts.
        ..driver::RunOptions::default()
    };
    let initial = session
        .initial
        .as_ref()
        .map(|states| move |rank: usize| Ok(states[rank].clone()));
    let batch = session.data.as_ref().map(|d| move |i: u64| d.batch(i));
    let compiled = &step;
    let mut save = session.save.as_ref().map(|target| {
        let (seed, first) = (session.seed, session.first_step);
        (
            target.every(),
            move |done: u64, states: &[driver::TensorMap]| {
                target.save(compiled, done, seed, first, states)
            },
        )
    });
    let hooks = driver::RunHooks {
        initial_state: initial.as_ref().map(|f| f as &driver::StateFn),
        batch: batch.as_ref().map(|f| f as &driver::BatchFn),
        save: save.as_mut().map(|(every, f)| driver::SaveHook {
            every: *every,
            save: f,
        }),
    };
    let single_forward = args.forward && options.mesh.is_none();
    // When the step lines go to a file or a pipe, standard error shows how far the run is.
    let mut ticker = match std::io::stdout().is_terminal() || args.forward {
        true => Ticker::disabled(),
        false => Ticker::new(),
    };
    let (first_step, total_steps) = (run_options.first_step, run_options.steps);
    let mut printed = Ok(());
    let report = driver::run_launched(&step, &launch, &run_options, hooks, |e| {
        let done = (e.step + 1).saturating_sub(first_step);
        let elapsed = ticker.elapsed();
        ticker.tick(
            || training_status(done, total_steps, elapsed, e.loss),
            false,
        );
        let line = match single_forward {
            true => format!("loss: {:.6}\n", e.loss),
            false => format!("step {} loss: {:.6}\n", e.step + 1, e.loss),
        };
        if printed.is_ok() {
            printed = print_stdout(&line);
        }
        if e.grads_finite == Some(false) {
            eprintln!(
                "step {}: gradients are not finite; update skipped, loss scale reduced",
                e.step + 1
            );
        }
    })?;
    printed?;
    if !report.primary {
        return Ok(());
    }
    if options.mesh.is_some() {
        print_stdout(&ranks_summary(&step, &report))?;
    } else if !single_forward {
        print_stdout(&format!(
            "peak memory: {}{}\n",
            bytes(report.peak_bytes),
            arena(&report)
        ))?;
    }
    if let Some((path, mut file)) = trace_file {
        let text = driver::describe::pipeline_trace(&step, &report.pipeline_reports)?;
        file.write_all(text.as_bytes())
            .with_context(|| format!("cannot write `{path}`"))?;
    }
    if let Some((path, file)) = report_file {
        drop(file);
        crate::report_cmd::write_run_report(&path, &options, &step, &report)?;
    }
    if let Some(v) = &report.verify {
        print_stdout(&format!("{}\n", v.line()))?;
        if !v.ok() {
            // Top-k routing is discontinuous: rounding noise can send a token to another
            // expert (or past an expert's capacity) in one run and not in the other, a jump
            // no noise floor predicts.
            let routed = step
                .global
                .node_ids()
                .into_iter()
                .any(|n| matches!(step.global.node(n).op, driver::ir::Op::MoeRoute { .. }));
            let hint = match v.noise_floor.is_some() && routed {
                true => {
                    "; with f32 accumulation, rounding noise can flip a routing decision of \
                     `moe_route` over many steps: --wide-accumulation keeps the run within \
                     rounding of the reference"
                }
                false => "",
            };
            bail!(
                "the parallel run differs from the single-device reference (worst: `{}`){hint}",
                v.worst
            );
        }
    }
    Ok(())
}

/// What the ranks of a run held: one line for an SPMD mesh, a line per rank and a summary
/// for a pipeline.
fn ranks_summary(step: &CompiledStep, report: &RunReport) -> String {
    let mesh = &step.mesh;
    let n = mesh.num_devices();
    let mut out = String::new();
    let Some(pipeline) = &step.pipeline else {
        let _ = writeln!(
            out,
            "ranks: {n} ({mesh}), peak memory per rank: {}{}",
            bytes(report.peak_bytes),
            arena(report)
        );
        return out;
    };
    let pipeline_only = step.strategies.is_none();
    for (rank, r) in report.ranks.iter().enumerate() {
        let p = r.pipeline.clone().unwrap_or(driver::PipelineRankStats {
            peak_activation_bytes: 0,
            max_in_flight: 0,
        });
        if pipeline_only {
            let _ = writeln!(
                out,
                "rank {rank}: peak memory {} bytes, peak activations {} bytes, {} micro-batch chunks in flight",
                r.peak_bytes, p.peak_activation_bytes, p.max_in_flight
            );
        } else {
            let _ = writeln!(
                out,
                "{}: peak memory {} bytes, peak activations {} bytes, state {} bytes, {} micro-batch chunks in flight",
                driver::describe::rank_label(mesh, rank),
                r.peak_bytes,
                p.peak_activation_bytes,
                r.state_bytes,
                p.max_in_flight
            );
        }
    }
    if pipeline_only {
        let _ = writeln!(out, "ranks: {n} ({mesh})");
        return out;
    }
    let peak = report.ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
    let state = report
        .ranks
        .iter()
        .map(|r| r.state_bytes)
        .max()
        .unwrap_or(0);
    let stages = pipeline.split.num_stages();
    let _ = writeln!(
        out,
        "ranks: {n} ({mesh}), {} pipelines of {stages} stages, peak memory per rank: {}, \
         state per rank: {}",
        pipeline.pipelines.len(),
        bytes(peak),
        bytes(state),
    );
    out
}

/// A byte count with its unit, exact and for people: `2008072 bytes (1.9 MiB)`.
fn bytes(n: u64) -> String {
    format!("{n} bytes ({})", driver::host::human_bytes(n))
}

/// `, arena N bytes (...)` when the backend laid the program out in a static arena (the peak
/// is what it really held; the arena what its plan reserves).
fn arena(report: &RunReport) -> String {
    report
        .arena_bytes
        .map_or_else(String::new, |a| format!(", arena {}", bytes(a)))
}

/// The `--timings` table.
fn timings(step: &CompiledStep) -> String {
    let mut out = format!(
        "{:<16} {:>10} {:>10} {:>7} {:>9}\n",
        "pass", "time ms", "verify ms", "graphs", "nodes"
    );
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let (mut wall, mut verify) = (0.0, 0.0);
    for t in &step.timings {
        wall += ms(t.wall);
        verify += ms(t.verify);
        let _ = writeln!(
            out,
            "{:<16} {:>10.3} {:>10.3} {:>7} {:>9}",
            t.pass.name(),
            ms(t.wall),
            ms(t.verify),
            t.graphs,
            t.nodes
        );
    }
    let _ = writeln!(out, "{:<16} {wall:>10.3} {verify:>10.3}", "total");
    if !step.fusion.is_empty() {
        let sum = |f: &dyn Fn(&driver::FuseReport) -> u64| -> u64 {
            step.fusion.iter().map(|(_, r)| f(r)).sum()
        };
        let _ = writeln!(
            out,
            "fuse: {} programs, {} nodes -> {}, {} fusions, {} collectives merged, \
             {} bytes written -> {} (cost model's count)",
            step.fusion.len(),
            sum(&|r| r.nodes_before as u64),
            sum(&|r| r.nodes_after as u64),
            sum(&|r| r.fusions as u64),
            sum(&|r| r.collectives_merged() as u64),
            sum(&|r| r.bytes_written_before),
            sum(&|r| r.bytes_written_after),
        );
        // Why the e-graph runner stopped, with how many programs stopped so.
        let mut reasons: std::collections::BTreeMap<&str, usize> = Default::default();
        for (_, r) in &step.fusion {
            *reasons.entry(r.stop_reason.as_str()).or_default() += 1;
        }
        let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{r} ({n})")).collect();
        let _ = writeln!(
            out,
            "fuse: the rewrite runner stopped: {}",
            reasons.join(", ")
        );
    }
    out
}

/// Writes the `--dump-after` files into `dir`.
fn write_dumps(step: &CompiledStep, dir: &str) -> Result<()> {
    for dump in &step.dumps {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create `{dir}`"))?;
        for (name, text) in &dump.files {
            let path = std::path::Path::new(dir).join(name);
            std::fs::write(&path, text)
                .with_context(|| format!("cannot write `{}`", path.display()))?;
        }
        eprintln!(
            "dumped the output of `{}` to {dir}/ ({} files)",
            dump.pass,
            dump.files.len()
        );
    }
    Ok(())
}

/// The graph `autopar dump --stage forward|train|sharded|partitioned|fused` prints, or the
/// text of `--stage pipeline|schedule`.
pub enum Dumped {
    /// A graph, to print in the chosen format.
    Graph(Box<driver::ir::Graph>),
    /// A description.
    Text(String),
}

/// Which rank program `dump --stage partitioned|fused|collectives` shows, and whether fused.
pub struct DumpRank {
    /// The SPMD rank.
    pub rank: usize,
    /// Run the fusion pass (`--stage fused|collectives` without `--no-fuse`).
    pub fuse: bool,
}

/// `autopar dump`.
pub fn dump(
    model: &str,
    batch: Option<usize>,
    stage: Stage,
    train: &TrainArgs,
    pipeline: &PipelineArgs,
    spmd: &spmd_cmd::SpmdArgs,
    which: DumpRank,
) -> Result<Dumped> {
    let DumpRank { rank, fuse } = which;
    if let Stage::Forward = stage {
        return Ok(Dumped::Graph(Box::new(driver::load_model(model, batch)?)));
    }
    let mut options = compile_options(model, batch, train, pipeline, spmd, false, None)?;
    options.reference = false;
    let mesh_text = pipeline.mesh.as_deref().unwrap_or("");
    match stage {
        Stage::Forward | Stage::Train => {
            options.mesh = None;
            options.parallel = Default::default();
            options.stop_after = Some(Pass::TrainStep);
            Ok(Dumped::Graph(Box::new(driver::compile(&options)?.global)))
        }
        Stage::Sharded | Stage::Partitioned | Stage::Collectives => {
            if options.mesh.is_none() {
                bail!("--stage sharded, partitioned and collectives need --mesh");
            }
            let partitioned = !matches!(stage, Stage::Sharded);
            if let Stage::Collectives = stage
                && options
                    .mesh
                    .as_ref()
                    .and_then(|m| m.axis_size(driver::ir::axis::PP))
                    .is_some_and(|pp| pp > 1)
            {
                bail!(
                    "--stage collectives shows a rank program, and the mesh `{mesh_text}` cuts \
                     them into pipeline sub-programs, each bucketed on its own: see them with \
                     `run --dump-after collectives`"
                );
            }
            // The collectives stage comes after the fusion pass (unless --no-fuse).
            options.fuse = fuse;
            options.stop_after = Some(match stage {
                Stage::Sharded => Pass::Parallelize,
                Stage::Collectives => Pass::Collectives,
                _ => Pass::Partition,
            });
            let step = driver::compile(&options)?;
            if !partitioned {
                return Ok(Dumped::Graph(Box::new(step.global)));
            }
            let n = step.locals.len();
            step.locals
                .into_iter()
                .nth(rank)
                .map(|g| Dumped::Graph(Box::new(g)))
                .with_context(|| {
                    format!("--rank {rank}: the mesh `{mesh_text}` has {n} ranks besides `pp`")
                })
        }
        Stage::Fused => {
            options.fuse = fuse;
            options.stop_after = Some(Pass::Fuse);
            let step = driver::compile(&options)?;
            if step.is_pipeline() {
                bail!(
                    "--stage fused shows one rank program, but the mesh `{mesh_text}` cuts the \
                     step into pipeline sub-programs: write them all with \
                     `autopar run ... --dump-after fuse`"
                );
            }
            let n = step.locals.len();
            step.locals
                .into_iter()
                .nth(rank)
                .map(|g| Dumped::Graph(Box::new(g)))
                .with_context(|| match mesh_text {
                    "" => format!("--rank {rank}: one device has only rank 0"),
                    _ => {
                        format!("--rank {rank}: the mesh `{mesh_text}` has {n} ranks besides `pp`")
                    }
                })
        }
        Stage::Pipeline | Stage::Schedule => {
            let mesh: DeviceMesh = options
                .mesh
                .clone()
                .context("--stage pipeline and --stage schedule need --mesh with a pp axis")?;
            let pp = mesh.axis_size(driver::ir::axis::PP).unwrap_or(1);
            if pp < 2 {
                bail!(
                    "--stage pipeline and --stage schedule need a `pp` axis above 1 in --mesh `{mesh_text}`"
                );
            }
            if let Stage::Pipeline = stage {
                return Ok(Dumped::Text(driver::describe::pipeline_stages(&options)?));
            }
            let p = &options.pipeline;
            let schedule = Schedule::new(p.schedule, pp, p.vpp, options.train.micro_batches)?;
            let others = mesh
                .axes()
                .iter()
                .any(|a| a.name != driver::ir::axis::PP && a.size > 1);
            Ok(Dumped::Text(if others {
                driver::describe::describe_mesh_schedule(&schedule, &mesh)
            } else {
                driver::describe::describe_schedule(&schedule)
            }))
        }
    }
}
