//! One training step on one CPU device: the fast CPU backend (1 and 2 threads, f64 and f32
//! GEMM accumulation) against the reference interpreter, with the same architecture in
//! PyTorch CPU eager (`benches/torch_twin.py`, run when `python3 -c 'import torch'` works) as
//! the anchor, measured in the same run. Models: the 4-layer `gpt:` model of the fused-kernels
//! issue and gpt-tiny, batch 8. Besides criterion's figures, the bench prints a table of
//! steps/s (median of a few rounds) and the ratios to PyTorch at equal thread counts.

use std::collections::BTreeMap;
use std::process::Command;
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
        let mut times: Vec<f64> = (0..rounds)
            .map(|_| {
                let t = Instant::now();
                self.step();
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        1.0 / times[times.len() / 2]
    }
}

/// The PyTorch twin's steps/s, or why there is none.
fn torch_steps_per_sec(dims: [usize; 5], threads: usize, steps: usize) -> Result<f64, String> {
    let [layers, hidden, heads, seq, vocab] = dims;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_twin.py");
    let probe = Command::new("python3")
        .args(["-c", "import torch"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return Err("python3 with torch is not available".into());
    }
    let arg = |name: &str, v: usize| [format!("--{name}"), v.to_string()];
    let mut cmd = Command::new("python3");
    cmd.arg(script);
    for (name, v) in [
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("seq", seq),
        ("vocab", vocab),
        ("batch", BATCH),
        ("threads", threads),
        ("steps", steps),
    ] {
        cmd.args(arg(name, v));
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(text.trim()).map_err(|e| e.to_string())?;
    json["steps_per_sec"]
        .as_f64()
        .ok_or_else(|| format!("no steps_per_sec in `{text}`"))
}

fn steps(c: &mut Criterion) {
    let mut table = Vec::new();
    for (label, model, dims) in MODELS {
        let step = compiled(model);
        let big = dims[1] >= 256;
        let rounds = if big { 5 } else { 30 };
        let mut group = c.benchmark_group(format!("train step {label}"));
        group.sample_size(10);
        for threads in [1, 2] {
            for wide in [true, false] {
                let backend = FastCpuBackend::new(threads, 1)
                    .expect("threads")
                    .with_wide_accumulation(wide);
                let mut s = Stepper::new(&step, backend);
                let acc = if wide { "f64" } else { "f32" };
                group.bench_function(format!("fast x{threads} acc {acc}"), |b| {
                    b.iter(|| s.step())
                });
                table.push((
                    label,
                    format!("fast x{threads} acc {acc}"),
                    threads,
                    s.steps_per_sec(rounds),
                ));
            }
        }
        let mut s = Stepper::new(&step, CpuBackend::default());
        if !big {
            group.bench_function("interpreter", |b| b.iter(|| s.step()));
        }
        table.push((
            label,
            "interpreter".into(),
            1,
            s.steps_per_sec(if big { 2 } else { rounds }),
        ));
        group.finish();
        for threads in [1, 2] {
            match torch_steps_per_sec(dims, threads, rounds) {
                Ok(sps) => table.push((label, format!("pytorch x{threads}"), threads, sps)),
                Err(why) => eprintln!("{label}: PyTorch twin skipped: {why}"),
            }
        }
    }
    println!("\nsteps/s (median), and the ratio to PyTorch eager at the same thread count:");
    for (label, what, threads, sps) in &table {
        let torch = table
            .iter()
            .find(|(l, w, t, _)| l == label && w.starts_with("pytorch") && t == threads)
            .map(|r| r.3);
        let ratio = torch.map_or("-".to_string(), |t| format!("{:.2}x", sps / t));
        println!("  {label:<10} {what:<20} {sps:>9.2} steps/s  {ratio}");
    }
}

criterion_group!(benches, steps);
criterion_main!(benches);
