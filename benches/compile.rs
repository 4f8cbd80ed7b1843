//! The driver's pass pipeline against the passes called one after another, as the command
//! line did before the driver existed: the difference is what the driver adds (the verifier
//! after every pass, timings, state layout), measured in the same run.

use std::hint::black_box;

use autopar_driver::passes::parallelize::parallelize;
use autopar_driver::passes::partition::partition_all;
use autopar_driver::passes::train::build_train_step;
use autopar_driver::{CompileOptions, compile, load_micro_batch_forward};
use criterion::{Criterion, criterion_group, criterion_main};

const MODEL: &str = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=4096";

fn pipelines(c: &mut Criterion) {
    let mut group = c.benchmark_group("compile gpt 4x256 dp=2,tp=4");
    group.sample_size(10);
    let options = CompileOptions::new(MODEL)
        .on_mesh("dp=2,tp=4")
        .expect("a mesh");
    group.bench_function("passes called directly", |b| {
        b.iter(|| {
            let forward = load_micro_batch_forward(MODEL, None, 1).expect("builds");
            let step = build_train_step(&forward, &options.train).expect("a step");
            let mesh = options.mesh.as_ref().expect("a mesh");
            let p = parallelize(&step.graph, mesh, &options.parallel).expect("propagates");
            black_box(partition_all(&p.graph, &p.plan).expect("partitions"))
        })
    });
    group.bench_function("driver::compile", |b| {
        b.iter(|| black_box(compile(&options).expect("compiles")))
    });
    group.finish();
}

criterion_group!(benches, pipelines);
criterion_main!(benches);
