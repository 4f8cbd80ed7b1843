//! Context parallelism end to end: the load-balanced layout keeps the model's loss, ring
//! attention runs forward and backward on `cp` ranks and matches the single-device step.

use autopar::ir::DeviceMesh;
use autopar::passes::parallelize::ParallelOptions;
use autopar::{TrainOptions, load_train_step, load_train_step_cp, spmd};

#[test]
fn scratch_worst() {
    let opts = TrainOptions::default();
    for m in ["cp=2", "dp=2"] {
        let mesh = DeviceMesh::parse(m).unwrap();
        let cp = autopar::context_parallel_ways(&mesh);
        let step = load_train_step_cp("llama-tiny", None, &opts, cp).unwrap();
        let orig = load_train_step("llama-tiny", None, &opts).unwrap();
        let mut p = spmd::compile(&step.graph, &mesh, &ParallelOptions::default()).unwrap();
        p.reference = Some(orig.graph);
        let s = spmd::run(&p, 0, 1, Some(1e-4), |_, _| {}).unwrap();
        println!("{m}: {:?}", s.verify);
    }
}
