//! Benchmarks of the strategy search on the large workloads: GPT-3 175B on 1024 A100s
//! (global batch 1536) and Llama 3 405B on 16384 H100s (global batch 2048, 16M tokens).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};

use autopar_driver::cost_model::CostModel;
use autopar_driver::passes::search::{SearchOptions, search};

fn search_bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("search");
    // Each search takes between a fraction of a second and several seconds.
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(45));
    for (model, cluster, batch) in [
        ("gpt3-175b", "dgx-a100:nodes=128", 1536),
        ("llama3-405b", "dgx-h100:nodes=2048", 2048),
    ] {
        let cm = CostModel::new(autopar_driver::load_cluster(cluster).expect("preset"));
        let cfg = autopar_driver::model_config(model).expect("zoo model");
        let opts = SearchOptions::new(batch);
        group.bench_function(format!("{model} on {cluster}"), |b| {
            b.iter(|| search(black_box(&cm), black_box(&cfg), &opts).expect("search"))
        });
    }
    group.finish();
}

criterion_group!(benches, search_bench);
criterion_main!(benches);
