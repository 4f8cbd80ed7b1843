//! Autodiff and training-step construction on GPT-3 175B (graphs only, no tensors).

use std::hint::black_box;

use autopar_driver::frontends::zoo;
use autopar_driver::passes::autodiff::differentiate;
use autopar_driver::passes::train::{TrainOptions, build_train_step};
use criterion::{Criterion, criterion_group, criterion_main};

fn autodiff(c: &mut Criterion) {
    let forward = zoo::build("gpt3-175b", 1).expect("gpt3-175b builds");
    let loss = forward.output("loss").expect("a loss output");
    let weights: Vec<_> = forward.parameters().iter().map(|(v, _, _)| *v).collect();
    let mut group = c.benchmark_group("gpt3-175b");
    group.sample_size(10);
    group.bench_function("differentiate", |b| {
        b.iter(|| {
            let mut g = forward.clone();
            black_box(differentiate(&mut g, loss, None, &weights).expect("differentiates"))
        })
    });
    group.bench_function("build_train_step", |b| {
        b.iter(|| black_box(build_train_step(&forward, &TrainOptions::default()).expect("builds")))
    });
    group.finish();
}

criterion_group!(benches, autodiff);
criterion_main!(benches);
