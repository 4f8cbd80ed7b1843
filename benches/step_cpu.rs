//! One training step on one CPU device: the fast CPU backend (1 and 2 threads, f64 and f32
//! GEMM accumulation) against the reference interpreter, with the same architecture in
//! PyTorch CPU eager (`benches/torch_twin.py`, run when `python3 -c 'import torch'` works) as
//! the anchor, measured in the same run. Models: the 4-layer `gpt:` model of the fused-kernels
//! issue and gpt-tiny, batch 8. Besides criterion's figures, the bench prints a table of
//! steps/s and the ratios to PyTorch at equal thread counts: rounds of a few steps of each
//! configuration alternate with rounds of the twin, which stays up between them (`--serve`),
//! and each ratio is the median of the rounds' ratios, printed with their range.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use autopar_driver::runtime::{
    self as rt, Backend, CpuBackend, ExecutionPlan, FastCpuBackend, SingleDevice, TensorMap,
};
use autopar_driver::{CompileOptions, CompiledStep, compile};
use criterion::{Criterion, criterion_group, criterion_main};

/// The models, as the CLI names them, and the twin's arguments.
const MODELS: [(&str, &str, [usize; 5]); 2] = [
    (
        "gpt 4x256",
        "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=4096",
        [4, 256, 8, 128, 4096],
    ),
    ("gpt-tiny", "gpt-tiny", [2, 64, 4, 32, 256]),
];
const BATCH: usize = 8;

fn compiled(model: &str) -> CompiledStep {
    let mut options = CompileOptions::new(model);
    options.batch = Some(BATCH);
    compile(&options).expect("the model compiles")
}

/// A loaded step on `backend`: its state in the backend's buffers, carried between steps.
struct Stepper<'s, B: Backend> {
    backend: B,
    exe: B::Executable<'s>,
    params: BTreeMap<String, B::Buffer>,
    inputs: BTreeMap<String, B::Buffer>,
}

impl<'s, B: Backend> Stepper<'s, B> {
    fn new(step: &'s CompiledStep, backend: B) -> Self {
        let graph = &step.locals[0];
        let plan = step
            .plans
            .first()
            .cloned()
            .unwrap_or_else(|| ExecutionPlan::new(graph).expect("plans"));
        let exe = backend.load(graph, plan).expect("loads");
        let up = |m: &TensorMap| {
            m.iter()
                .map(|(k, t)| (k.clone(), backend.upload(t).expect("uploads")))
                .collect::<BTreeMap<_, _>>()
        };
        let params = up(&step.state.init_rank(0, 0).expect("state"));
        let inputs = up(&rt::synthetic_batch(&step.global, 0, 0).expect("batch"));
        Stepper {
            backend,
            exe,
            params,
            inputs,
        }
    }

    fn step(&mut self) {
        let out = self
            .backend
            .execute(&self.exe, &self.params, &self.inputs, &mut SingleDevice)
            .expect("runs");
        for (name, b) in out.outputs {
            if let Some(slot) = self.params.get_mut(&name) {
                *slot = b;
            }
        }
    }

    /// Steps per second: the median of `rounds` single steps, after one warm-up step.
    fn steps_per_sec(&mut self, rounds: usize) -> f64 {
        self.step();
        self.round(rounds)
    }

    /// Steps per second: the median of `steps` single steps.
    fn round(&mut self, steps: usize) -> f64 {
        median_rate((0..steps).map(|_| {
            let t = Instant::now();
            self.step();
            t.elapsed().as_secs_f64()
        }))
    }
}

/// One over the median of some step times.
fn median_rate(times: impl Iterator<Item = f64>) -> f64 {
    1.0 / spread(&times.collect::<Vec<_>>()).0
}

/// The median of some values, with their least and greatest.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// The PyTorch twin, running: built once, then asked for rounds of steps
/// (`benches/torch_twin.py --serve`).
struct Twin {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Twin {
    /// Starts the twin of a `gpt:` model with `dims` on `threads` threads, or says why not.
    fn start(dims: [usize; 5], threads: usize) -> Result<Twin, String> {
        let [layers, hidden, heads, seq, vocab] = dims;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_twin.py");
        let probe = Command::new("python3")
            .args(["-c", "import torch"])
            .output();
        if !probe.is_ok_and(|o| o.status.success()) {
            return Err("python3 with torch is not available".into());
        }
        let mut cmd = Command::new("python3");
        cmd.arg(script).arg("--serve");
        for (name, v) in [
            ("layers", layers),
            ("hidden", hidden),
            ("heads", heads),
            ("seq", seq),
            ("vocab", vocab),
            ("batch", BATCH),
            ("threads", threads),
        ] {
            cmd.args([format!("--{name}"), v.to_string()]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| e.to_string())?;
        let input = child.stdin.take().ok_or("no stdin")?;
        let output = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut twin = Twin {
            child,
            input,
            output,
        };
        let ready = twin.reply()?;
        if ready["ready"] != true {
            return Err(format!("the twin did not start: {ready}"));
        }
        Ok(twin)
    }

    fn reply(&mut self) -> Result<serde_json::Value, String> {
        let mut line = String::new();
        self.output
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        serde_json::from_str(line.trim()).map_err(|e| format!("`{line}`: {e}"))
    }

    /// Steps per second over `steps` more steps (their median).
    fn round(&mut self, steps: usize) -> Result<f64, String> {
        writeln!(self.input, "{steps}").map_err(|e| e.to_string())?;
        self.input.flush().map_err(|e| e.to_string())?;
        let reply = self.reply()?;
        let times = reply["step_ms"]
            .as_array()
            .ok_or_else(|| format!("no step_ms in `{reply}`"))?;
        let times: Vec<f64> = times.iter().filter_map(|t| t.as_f64()).collect();
        if times.len() != steps {
            return Err(format!("asked for {steps} steps, got `{reply}`"));
        }
        Ok(median_rate(times.into_iter().map(|t| t / 1e3)))
    }
}

impl Drop for Twin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A row of the table: what ran, at how many threads, its steps/s, and its ratio to the
/// PyTorch twin at the same thread count (median over the interleaved rounds, least,
/// greatest).
struct Row {
    label: &'static str,
    what: String,
    sps: f64,
    ratio: Option<(f64, f64, f64)>,
}

fn steps(c: &mut Criterion) {
    let mut table = Vec::new();
    for (label, model, dims) in MODELS {
        let step = compiled(model);
        let big = dims[1] >= 256;
        let mut group = c.benchmark_group(format!("train step {label}"));
        group.sample_size(10);
        // Per thread count, the fast backend with f64 and with f32 GEMM accumulation: timed by
        // criterion, then in the interleaved rounds below.
        let mut fast: Vec<Vec<(String, Stepper<FastCpuBackend>)>> = [1, 2]
            .into_iter()
            .map(|threads| {
                [true, false]
                    .into_iter()
                    .map(|wide| {
                        let backend = FastCpuBackend::new(threads, 1)
                            .expect("threads")
                            .with_wide_accumulation(wide);
                        let acc = if wide { "f64" } else { "f32" };
                        (
                            format!("fast x{threads} acc {acc}"),
                            Stepper::new(&step, backend),
                        )
                    })
                    .collect()
            })
            .collect();
        for (what, s) in fast.iter_mut().flatten() {
            group.bench_function(what.as_str(), |b| b.iter(|| s.step()));
        }
        let mut s = Stepper::new(&step, CpuBackend::default());
        if !big {
            group.bench_function("interpreter", |b| b.iter(|| s.step()));
        }
        group.finish();
        // The ratios: rounds of each configuration and of the twin, interleaved, so that the
        // machine's drift in speed (a shared two-core machine's can exceed 20% over a
        // minute) falls on both sides of each ratio.
        let (rounds, per_round) = if big { (7, 3) } else { (15, 10) };
        for (threads, steppers) in [1, 2].into_iter().zip(&mut fast) {
            let mut twin = Twin::start(dims, threads);
            if let Err(why) = &twin {
                eprintln!("{label}: PyTorch twin skipped: {why}");
            }
            let mut ours = vec![Vec::new(); steppers.len()];
            let mut theirs = Vec::new();
            for _ in 0..rounds {
                for (i, (_, s)) in steppers.iter_mut().enumerate() {
                    ours[i].push(s.round(per_round));
                }
                if let Ok(t) = twin.as_mut() {
                    match t.round(per_round) {
                        Ok(sps) => theirs.push(sps),
                        Err(why) => {
                            eprintln!("{label}: PyTorch twin failed: {why}");
                            twin = Err(why);
                        }
                    }
                }
            }
            let full = theirs.len() == rounds;
            for ((what, _), rates) in steppers.iter().zip(&ours) {
                let ratios: Vec<f64> = rates.iter().zip(&theirs).map(|(a, b)| a / b).collect();
                table.push(Row {
                    label,
                    what: what.clone(),
                    sps: spread(rates).0,
                    ratio: full.then(|| spread(&ratios)),
                });
            }
            if full {
                table.push(Row {
                    label,
                    what: format!("pytorch x{threads}"),
                    sps: spread(&theirs).0,
                    ratio: Some((1.0, 1.0, 1.0)),
                });
            }
        }
        // The interpreter is the oracle, not a contender: its rate, once.
        table.push(Row {
            label,
            what: "interpreter".into(),
            sps: s.steps_per_sec(if big { 2 } else { 30 }),
            ratio: None,
        });
    }
    println!(
        "\nsteps/s (median), and the ratio to PyTorch eager at the same thread count (median of \
         rounds interleaved with the twin's, and their range):"
    );
    for row in &table {
        let ratio = row.ratio.map_or("-".to_string(), |(m, lo, hi)| {
            format!("{m:.2}x ({lo:.2}-{hi:.2})")
        });
        println!(
            "  {:<10} {:<20} {:>9.2} steps/s  {ratio}",
            row.label, row.what, row.sps
        );
    }
}

criterion_group!(benches, steps);
criterion_main!(benches);
