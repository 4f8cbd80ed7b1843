//! The in-process ring all-reduce on 2 and 4 ranks, at 1 MiB and 64 MiB of f32.
//!
//! Each measurement runs the ranks on their own threads for the whole batch of iterations,
//! so thread start-up is not timed. Throughput is reported in bytes of the declared dtype
//! (4 per f32 element; the runtime holds floats as f64, so twice that moves in memory). Bus
//! bandwidth, comparable across rank counts, is that figure times `2 (n - 1) / n`.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use autopar_ir::{DType, DeviceMesh, Op, ReduceKind, TensorType};
use autopar_runtime::{CommOptions, Tensor, communicate, in_process_communicators};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const MIB: usize = 1 << 20;

/// Time of `iters` all-reduces of `bytes` bytes of f32 on `n` ranks.
fn time_all_reduce(n: usize, bytes: usize, iters: u64) -> Duration {
    let mesh = DeviceMesh::new([("x", n)]).expect("mesh");
    let op = Op::AllReduce {
        axes: vec!["x".into()],
        reduce: ReduceKind::Sum,
    };
    let ty = TensorType::new(DType::F32, [bytes / 4]);
    let operands: Vec<Tensor> = (0..n)
        .map(|r| Tensor::full(ty.clone(), r as f64 + 0.5))
        .collect();
    let options = CommOptions {
        timeout: Duration::from_secs(120),
        ..CommOptions::default()
    };
    let comms = in_process_communicators(&mesh, options);
    let start = Barrier::new(n + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(&operands)
            .map(|(mut comm, x)| {
                let (op, start) = (&op, &start);
                s.spawn(move || {
                    start.wait();
                    for _ in 0..iters {
                        black_box(communicate(&mut comm, op, &[x]).expect("all-reduce"));
                    }
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        for h in handles {
            h.join().expect("rank thread");
        }
        t0.elapsed()
    })
}

fn all_reduce(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_f32");
    for bytes in [MIB, 64 * MIB] {
        if bytes > MIB {
            group.sample_size(10);
            group.measurement_time(Duration::from_secs(20));
        }
        group.throughput(Throughput::Bytes(bytes as u64));
        for n in [2, 4] {
            let id = BenchmarkId::new(format!("{n}_ranks"), format!("{}MiB", bytes / MIB));
            group.bench_function(id, |b| {
                b.iter_custom(|iters| time_all_reduce(n, bytes, iters))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, all_reduce);
criterion_main!(benches);
