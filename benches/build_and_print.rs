//! Benchmarks of the foundation: building full-size zoo graphs (shapes only) and printing and
//! parsing their text IR.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;

use autopar_driver::frontends::zoo;
use autopar_driver::ir::text;

fn build_and_print(c: &mut Criterion) {
    let mut group = c.benchmark_group("foundation");
    group.sample_size(20);
    for model in ["gpt3-175b", "llama3-405b"] {
        group.bench_function(format!("build {model}"), |b| {
            b.iter(|| zoo::build(black_box(model), 8).expect("zoo model builds"))
        });
    }
    let g = zoo::build("gpt3-175b", 8).expect("zoo model builds");
    group.bench_function("print gpt3-175b", |b| b.iter(|| text::print(black_box(&g))));
    let printed = text::print(&g);
    group.bench_function("parse gpt3-175b", |b| {
        b.iter(|| text::parse(black_box(&printed)).expect("printed text parses"))
    });
    group.finish();
}

criterion_group!(benches, build_and_print);
criterion_main!(benches);
