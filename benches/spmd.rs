//! Sharding propagation and SPMD partitioning of the GPT-3 175B training step on a
//! `dp=8, tp=8` mesh (graphs only, no tensors).
//!
//! The vocabulary is padded to 51200 (as Megatron pads it to a multiple of 128 times the
//! tensor-parallel size): 50257 rows do not split over 8 ranks.

use std::hint::black_box;

use autopar_driver::TrainOptions;
use autopar_driver::ir::DeviceMesh;
use autopar_driver::passes::parallelize::{ParallelOptions, parallelize};
use autopar_driver::passes::partition::partition;
use criterion::{Criterion, criterion_group, criterion_main};

fn spmd(c: &mut Criterion) {
    let step =
        autopar_driver::load_train_step("gpt3-175b:vocab=51200", Some(8), &TrainOptions::default())
            .expect("the step graph builds");
    let mesh = DeviceMesh::parse("dp=8,tp=8").expect("a mesh");
    let mut group = c.benchmark_group("gpt3-175b dp=8,tp=8");
    group.sample_size(10);
    for zero in [0u8, 3] {
        let options = ParallelOptions {
            zero,
            ..ParallelOptions::default()
        };
        group.bench_function(format!("propagate (zero {zero})"), |b| {
            b.iter(|| black_box(parallelize(&step.graph, &mesh, &options).expect("propagates")))
        });
        let p = parallelize(&step.graph, &mesh, &options).expect("propagates");
        group.bench_function(format!("partition one rank (zero {zero})"), |b| {
            b.iter(|| black_box(partition(&p.graph, &p.plan, 9).expect("partitions")))
        });
    }
    group.finish();
}

criterion_group!(benches, spmd);
criterion_main!(benches);
