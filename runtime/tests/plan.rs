//! The execution plan against the interpreter: its static `peak_bytes` is what a run records,
//! for every runnable zoo model's forward graph, a hand-built training step (an optimizer
//! update taking its parameter's place) and random graphs; and its arena never puts two
//! values that are live at the same time on the same bytes.

use autopar_ir::{
    BinaryOp, DType, Graph, Init, InputRole, Op, ReduceOp, TensorType, UnaryOp, ValueId,
};
use autopar_runtime::plan::Slot;
use autopar_runtime::{ExecutionPlan, RunOptions, init_parameters, run, synthetic_batch};
use proptest::prelude::*;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Checks the arena of `plan`: every slot inside it, and no two slots of values live at a
/// common position overlapping.
fn check_arena(plan: &ExecutionPlan) -> Result<(), String> {
    let slots: Vec<(ValueId, Slot)> = plan.slots().collect();
    for (i, (v, a)) in slots.iter().enumerate() {
        if a.offset + a.bytes > plan.arena_bytes() {
            return Err(format!("{v} at {a:?} lies outside the arena"));
        }
        for (w, b) in &slots[i + 1..] {
            if a.overlaps_in_time(b) && a.overlaps_in_space(b) {
                return Err(format!("{v} {a:?} and {w} {b:?} overlap"));
            }
        }
    }
    if plan.arena_bytes() < plan.peak_bytes() {
        return Err(format!(
            "arena of {} bytes below the peak of {}",
            plan.arena_bytes(),
            plan.peak_bytes()
        ));
    }
    Ok(())
}

/// Runs `g` from seed 0 and compares the recorded peak with the plan's.
fn check_graph(g: &Graph) -> TestResult {
    let plan = ExecutionPlan::new(g)?;
    check_arena(&plan)?;
    let params = init_parameters(g, 0)?;
    let batch = synthetic_batch(g, 0, 0)?;
    let out = run(g, &params, &batch, RunOptions::default())?;
    assert_eq!(
        plan.peak_bytes(),
        out.peak_bytes,
        "{}: planned vs recorded peak",
        g.name()
    );
    Ok(())
}

#[test]
fn planned_peak_is_the_recorded_peak_for_every_tiny_zoo_model() -> TestResult {
    let tiny: Vec<&str> = autopar_frontends::zoo::entries()
        .into_iter()
        .map(|e| e.name)
        .filter(|name| name.ends_with("-tiny"))
        .collect();
    assert!(tiny.len() >= 3, "{tiny:?}");
    for name in tiny {
        for batch in [1, 2] {
            check_graph(&autopar_frontends::zoo::build(name, batch)?)?;
        }
    }
    Ok(())
}

/// A training step by hand: linear regression with an SGD update whose results take the
/// parameter's and the momentum's places (outputs named like them).
fn sgd_step() -> Result<Graph, Box<dyn std::error::Error>> {
    let f32_ty = |dims: [usize; 2]| TensorType::new(DType::F32, dims);
    let mut g = Graph::new("sgd_step");
    let x = g.add(
        Op::Input {
            name: "x".into(),
            ty: f32_ty([8, 3]),
            role: InputRole::Features,
        },
        &[],
    )?;
    let y = g.add(
        Op::Input {
            name: "y".into(),
            ty: f32_ty([8, 2]),
            role: InputRole::RegressionTargets,
        },
        &[],
    )?;
    let w = g.add(
        Op::Parameter {
            name: "w".into(),
            ty: f32_ty([3, 2]),
            init: Init::Normal { std: 0.1 },
        },
        &[],
    )?;
    let m = g.add(
        Op::Parameter {
            name: "m".into(),
            ty: f32_ty([3, 2]),
            init: Init::Zeros,
        },
        &[],
    )?;
    let pred = g.add(
        Op::Einsum {
            spec: "bf,fo->bo".parse()?,
        },
        &[x, w],
    )?;
    let err = g.add(
        Op::Binary {
            func: BinaryOp::Sub,
        },
        &[pred, y],
    )?;
    let sq = g.add(
        Op::Unary {
            func: UnaryOp::Square,
        },
        &[err],
    )?;
    let loss = g.add(
        Op::Reduce {
            func: ReduceOp::Mean,
            dims: vec![0, 1],
        },
        &[sq],
    )?;
    let grad = g.add(
        Op::Einsum {
            spec: "bf,bo->fo".parse()?,
        },
        &[x, err],
    )?;
    let update = g.add_node(
        Op::SgdUpdate {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        },
        &[w, grad, m],
    )?;
    let outs = g.node(update).outputs.clone();
    g.add_output("loss", loss)?;
    g.add_output("w", outs[0])?;
    g.add_output("m", outs[1])?;
    Ok(g)
}

#[test]
fn planned_peak_is_the_recorded_peak_for_a_training_step() -> TestResult {
    check_graph(&sgd_step()?)
}

#[test]
fn a_plan_frees_every_value_but_the_outputs_once() -> TestResult {
    let g = sgd_step()?;
    let plan = ExecutionPlan::new(&g)?;
    let mut freed: Vec<ValueId> = (0..plan.order().len())
        .flat_map(|pos| plan.frees_after(pos).to_vec())
        .collect();
    let n_freed = freed.len();
    freed.sort();
    freed.dedup();
    assert_eq!(freed.len(), n_freed, "a value freed twice");
    let outputs: Vec<ValueId> = g.outputs().iter().map(|&(_, v)| v).collect();
    assert!(freed.iter().all(|v| !outputs.contains(v)));
    assert_eq!(freed.len() + outputs.len(), plan.slots().count());
    Ok(())
}

/// A random well-typed graph: inputs and parameters of a few shapes, then element-wise ops
/// and reductions on earlier values, and some of the values as outputs.
fn random_graph(steps: &[(u8, usize, usize)], n_outputs: usize) -> Graph {
    const VECTOR: usize = usize::MAX;
    let shapes = [[4usize, 8], [8, 8], [2, 8]];
    let mut g = Graph::new("random");
    let mut values: Vec<(ValueId, usize)> = Vec::new();
    for (i, dims) in shapes.iter().enumerate() {
        let ty = TensorType::new(DType::F32, *dims);
        let v = if i % 2 == 0 {
            g.add(
                Op::Input {
                    name: format!("x{i}"),
                    ty,
                    role: InputRole::Features,
                },
                &[],
            )
        } else {
            g.add(
                Op::Parameter {
                    name: format!("p{i}"),
                    ty,
                    init: Init::Normal { std: 1.0 },
                },
                &[],
            )
        };
        values.push((v.expect("source"), i));
    }
    for &(kind, a, b) in steps {
        let (x, sx) = values[a % values.len()];
        let same: Vec<(ValueId, usize)> =
            values.iter().copied().filter(|&(_, s)| s == sx).collect();
        let (y, _) = same[b % same.len()];
        // Reductions of 2-D values give the 1-D values (shape key `VECTOR`), so sizes vary.
        let (op, operands, shape) = match kind % 4 {
            0 => (
                Op::Unary {
                    func: UnaryOp::Tanh,
                },
                vec![x],
                sx,
            ),
            1 => (
                Op::Binary {
                    func: BinaryOp::Add,
                },
                vec![x, y],
                sx,
            ),
            2 => (
                Op::Binary {
                    func: BinaryOp::Mul,
                },
                vec![x, y],
                sx,
            ),
            _ if sx != VECTOR => {
                let reduce = Op::Reduce {
                    func: ReduceOp::Sum,
                    dims: vec![0],
                };
                (reduce, vec![x], VECTOR)
            }
            _ => (Op::Unary { func: UnaryOp::Exp }, vec![x], sx),
        };
        let v = g.add(op, &operands).expect("op");
        values.push((v, shape));
    }
    let n = values.len();
    for k in 0..n_outputs.min(n) {
        let (v, _) = values[n - 1 - (k * 3) % n];
        g.add_output(format!("out{k}"), v).expect("output");
    }
    g
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn arena_slots_never_overlap_and_the_peak_is_recorded(
        steps in prop::collection::vec((0u8..4, 0usize..64, 0usize..64), 0..40),
        n_outputs in 1usize..4,
    ) {
        let g = random_graph(&steps, n_outputs);
        let plan = ExecutionPlan::new(&g).expect("plan");
        prop_assert!(check_arena(&plan).is_ok(), "{:?}", check_arena(&plan));
        let params = init_parameters(&g, 1).expect("params");
        let batch = synthetic_batch(&g, 1, 0).expect("batch");
        let out = run(&g, &params, &batch, RunOptions::default()).expect("run");
        prop_assert_eq!(plan.peak_bytes(), out.peak_bytes);
    }
}

/// Graphs the plan cannot tell apart share one plan, each equal to the graph's own; a graph
/// of other sizes gets its own.
#[test]
fn plan_all_plans_each_distinct_structure_once() -> TestResult {
    let one = autopar_frontends::zoo::build("gpt-tiny", 1)?;
    let two = autopar_frontends::zoo::build("gpt-tiny", 2)?;
    let plans = autopar_runtime::plan_all([&one, &two, &one])?;
    assert_eq!(plans[0], ExecutionPlan::new(&one)?);
    assert_eq!(plans[1], ExecutionPlan::new(&two)?);
    assert_eq!(plans[2], plans[0]);
    assert_ne!(plans[0].peak_bytes(), plans[1].peak_bytes());
    Ok(())
}
