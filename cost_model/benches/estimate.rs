//! One step estimate of GPT-3 175B on 128 DGX A100 nodes: a strategy search calls this
//! hundreds of thousands of times; and the ordering of a layer's placements by their profiles,
//! which it computes once per micro-batch size, sp and axis order.

use std::hint::black_box;

use autopar_cost_model::{
    Cluster, CostModel, LayerPlacement, MeshMapping, Plan, TransformerConfig,
};
use criterion::{Criterion, criterion_group, criterion_main};

fn estimate(c: &mut Criterion) {
    let model = CostModel::new(Cluster::preset("dgx-a100:nodes=128").expect("preset"));
    let cfg = TransformerConfig::gpt3_175b();
    let plan =
        Plan::parse("dp=8,tp=8,pp=16,mbs=1,recompute=full,schedule=interleaved,vpp=2,gbs=1536")
            .expect("plan");
    c.bench_function("estimate gpt3-175b dp8 tp8 pp16 vpp2", |b| {
        b.iter(|| model.estimate(black_box(&cfg), black_box(&plan)))
    });
    // What a search pays when it reuses the schedule across plans.
    let schedule =
        autopar_ir::schedule::Schedule::new(plan.schedule, plan.pp, plan.vpp, plan.micro_batches())
            .expect("schedule");
    c.bench_function("estimate gpt3-175b, schedule reused", |b| {
        b.iter(|| model.estimate_with_schedule(black_box(&cfg), black_box(&plan), &schedule))
    });
    // What the search pays once per (micro-batch size, sp, axis order) to order the 32 layer
    // placements by their profiles.
    let sp = Plan {
        sequence_parallel: true,
        ..plan.clone()
    };
    let mapping = MeshMapping::new(&sp.mesh_axes(), &model.cluster).expect("mapping");
    let all = LayerPlacement::all();
    c.bench_function("layer_dominance gpt3-175b tp8, 32 placements", |b| {
        b.iter(|| model.layer_dominance(black_box(&cfg), black_box(&sp), &mapping, &all))
    });
}

criterion_group!(benches, estimate);
criterion_main!(benches);
