//! The fast CPU backend's memory-bound kernels, one at a time, against memcpy measured in the
//! same run. Every distinct fusion body, and every other node that is not a GEMM, of at least
//! 256 Ki elements in the 4-layer `gpt:` model's fused step (the one `benches/step_cpu.rs`
//! times; batch 8: softmax, cross-entropy, attention, layer norm, the AdamW update) runs as a
//! one-node program on random operands, on one thread; the bench prints each one's time and
//! its bandwidth (the bytes of its operands and results, as f32 or i64 storage, per second) as
//! a fraction of a memcpy of 64 MiB. A kernel near 1.0x moves its bytes as fast as memory
//! allows; far below, it is bound by arithmetic or by the evaluator's overheads.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use autopar_driver::ir::{Graph, InputRole, Op};
use autopar_driver::runtime::{
    Backend, ExecutionPlan, FastCpuBackend, SingleDevice, Tensor, fast::storage_bytes,
};
use autopar_driver::{CompileOptions, compile};
use criterion::{Criterion, criterion_group, criterion_main};

const MODEL: &str = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=4096";
const MIN_ELEMENTS: u64 = 1 << 18;
const MEMCPY_BYTES: usize = 64 << 20;

/// A one-node program of `op` on inputs of the types of `node`'s operands in `g`.
fn one_node(g: &Graph, op: &Op, operands: &[autopar_driver::ir::ValueId]) -> Graph {
    let mut one = Graph::new("fusion");
    let args: Vec<_> = operands
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            one.add(
                Op::Input {
                    name: format!("x{i}"),
                    ty: g.ty(v).clone(),
                    role: InputRole::Features,
                },
                &[],
            )
            .expect("an input")
        })
        .collect();
    let node = one.add_node(op.clone(), &args).expect("the body types");
    for (i, v) in one.node(node).outputs.clone().into_iter().enumerate() {
        one.add_output(format!("y{i}"), v).expect("an output");
    }
    one
}

/// Operands in `[-1, 1)` (floats) or `0..128` (integers: labels and positions).
fn operands(g: &Graph) -> BTreeMap<String, Tensor> {
    g.inputs()
        .into_iter()
        .map(|(v, name, _)| {
            let ty = g.ty(v).clone();
            let n = ty.num_elements() as usize;
            let t = if ty.dtype.is_float() {
                let vals = (0..n).map(|i| (i * 7919 % 2000) as f64 / 1000.0 - 1.0);
                Tensor::from_f64(ty, vals.collect())
            } else {
                Tensor::from_i64(ty, (0..n).map(|i| (i * 31 % 128) as i64).collect())
            };
            (name.to_string(), t.expect("fits"))
        })
        .collect()
}

/// The best of `rounds` calls of `f`, in seconds.
fn best(rounds: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn fusions(c: &mut Criterion) {
    let mut options = CompileOptions::new(MODEL);
    options.batch = Some(8);
    let step = compile(&options).expect("the model compiles");
    let g = &step.locals[0];
    // Distinct bodies, by their text, with their operands in the step.
    let mut bodies: BTreeMap<String, (Op, Vec<_>, u64)> = BTreeMap::new();
    for id in g.nodes_in_order() {
        let node = g.node(id);
        // The largest operand or result (a cross-entropy's logits, not its losses).
        let elements = node
            .outputs
            .iter()
            .chain(&node.inputs)
            .map(|&v| g.ty(v).num_elements())
            .max()
            .unwrap_or(0);
        let kernel = !matches!(
            node.op,
            Op::Einsum { .. } | Op::Input { .. } | Op::Parameter { .. } | Op::Constant { .. }
        );
        if kernel && elements >= MIN_ELEMENTS {
            let key = match &node.op {
                Op::Fusion { body } => format!("{body:?}"),
                op => format!(
                    "{op:?} {:?}",
                    node.inputs.iter().map(|&v| g.ty(v)).collect::<Vec<_>>()
                ),
            };
            bodies
                .entry(key)
                .or_insert((node.op.clone(), node.inputs.clone(), elements));
        }
    }

    let src = vec![1.0f32; MEMCPY_BYTES / 4];
    let mut dst = vec![0.0f32; MEMCPY_BYTES / 4];
    let mut group = c.benchmark_group("fusion bodies");
    group.sample_size(10);
    group.bench_function("memcpy 64 MiB", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    let memcpy = best(20, || dst.copy_from_slice(black_box(&src)));
    let memcpy_bw = MEMCPY_BYTES as f64 * 2.0 / memcpy;

    let backend = FastCpuBackend::default();
    let mut table = Vec::new();
    for (i, (op, inputs, elements)) in bodies.values().enumerate() {
        let one = one_node(g, op, inputs);
        let exe = backend
            .load(&one, ExecutionPlan::new(&one).expect("plans"))
            .expect("loads");
        let fed: BTreeMap<_, _> = operands(&one)
            .iter()
            .map(|(k, t)| (k.clone(), backend.upload(t).expect("uploads")))
            .collect();
        let none = BTreeMap::new();
        let mut call = || {
            black_box(
                backend
                    .execute(&exe, &none, &fed, &mut SingleDevice)
                    .expect("runs"),
            );
        };
        group.bench_function(format!("body {i}"), |b| b.iter(&mut call));
        let secs = best(20, &mut call);
        let bytes: u64 = one
            .value_ids()
            .filter(|&v| {
                one.inputs().iter().any(|(x, _, _)| *x == v)
                    || one.outputs().iter().any(|(_, y)| *y == v)
            })
            .map(|v| storage_bytes(one.ty(v)))
            .sum();
        // The body's instructions, by name.
        let name = match op {
            Op::Fusion { body } => body
                .instrs
                .iter()
                .map(|i| i.op.name())
                .filter(|n| !matches!(*n, "broadcast" | "constant" | "reshape"))
                .collect::<Vec<_>>()
                .join(","),
            op => op.name().to_string(),
        };
        table.push((i, name, *elements, secs, bytes as f64 / secs / memcpy_bw));
    }
    group.finish();
    println!(
        "\nmemcpy: {:.1} GB/s (read and write); kernels of `{MODEL}`, 1 thread:",
        memcpy_bw * 1e-9
    );
    for (i, name, elements, secs, ratio) in table {
        let name: String = name.chars().take(60).collect();
        println!(
            "  body {i:>2} {elements:>8} elems {:>8.3} ms  {ratio:>5.2}x memcpy  {name}",
            secs * 1e3
        );
    }
}

criterion_group!(benches, fusions);
criterion_main!(benches);
