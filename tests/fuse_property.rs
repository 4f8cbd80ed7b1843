//! The fusion pass changes no value. For every tiny zoo model on `dp=2,tp=2`, `pp=2` (two
//! micro-batches), `cp=2` and `ep=2` where the model supports the mesh, in f32 and bf16:
//!
//! - every fusion of every program the driver fused evaluates, on random operands, to the
//!   values it replaced, computed by the unfused program's own nodes (the pass's report maps
//!   each value of the fused program to the original values it stands for);
//! - the whole fused step trains to the same losses and the same state, bit for bit, as the
//!   step compiled with `--no-fuse`.
//!
//! Floats compare by their bits, except that any NaN equals any NaN (an interpreter may
//! carry a NaN's payload differently through a rewritten but equal expression).

use std::collections::{BTreeMap, HashMap};

use autopar_driver::ir::{DType, Graph, Op, ValueId};
use autopar_driver::run::{RunHooks, SaveHook};
use autopar_driver::runtime::{Precision, Tensor, eval_op};
use autopar_driver::{CompileOptions, CompiledStep, RunOptions, TensorMap, compile, run_with};

/// The meshes of the property, with the micro-batches each needs.
const MESHES: [(&str, usize); 4] = [("dp=2,tp=2", 1), ("pp=2", 2), ("cp=2", 1), ("ep=2", 1)];

fn tiny_models() -> Vec<String> {
    autopar_driver::frontends::zoo::entries()
        .into_iter()
        .map(|e| e.name.to_string())
        .filter(|n| n.ends_with("-tiny"))
        .collect()
}

fn options(
    model: &str,
    mesh: &str,
    micro_batches: usize,
    dtype: DType,
    fuse: bool,
) -> CompileOptions {
    let mut o = CompileOptions::new(model).on_mesh(mesh).expect("a mesh");
    o.train.micro_batches = micro_batches;
    o.train.compute_dtype = dtype;
    o.reference = false;
    o.fuse = fuse;
    o
}

/// A deterministic stream of numbers in [0, 1).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn tensor(&mut self, ty: &autopar_driver::ir::TensorType) -> Tensor {
        let n = ty.num_elements() as usize;
        let t = match ty.dtype {
            DType::Bool => Tensor::from_bool(
                ty.shape.clone(),
                (0..n).map(|_| self.next() < 0.5).collect(),
            ),
            DType::I32 | DType::I64 => Tensor::from_i64(
                ty.clone(),
                (0..n).map(|_| (self.next() * 8.0) as i64 - 2).collect(),
            ),
            _ => Tensor::from_f64(
                ty.clone(),
                (0..n).map(|_| self.next() * 6.0 - 3.0).collect(),
            ),
        };
        t.expect("a tensor of its type").rounded()
    }
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    a.ty() == b.ty()
        && x.len() == y.len()
        && x.iter()
            .zip(&y)
            .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
}

/// Computes original value `v` of `g` from `known` by the nodes of `g`, refusing to go
/// through a parameter, an input or communication (a fusion is a function of its operands
/// and the constants copied into it).
fn compute(g: &Graph, v: ValueId, known: &mut HashMap<ValueId, Tensor>, what: &str) -> Tensor {
    if let Some(t) = known.get(&v) {
        return t.clone();
    }
    let node = g.node(g.value(v).producer);
    assert!(
        !matches!(node.op, Op::Parameter { .. } | Op::Input { .. }) && !node.op.is_communication(),
        "{what}: {v} depends on `{}`, which is not among the fusion's operands",
        node.op
    );
    let inputs: Vec<Tensor> = node
        .inputs
        .iter()
        .map(|&x| compute(g, x, known, what))
        .collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let outs = eval_op(&node.op, &refs, Precision::Declared).expect("the original node evaluates");
    for (&o, t) in node.outputs.iter().zip(outs) {
        known.insert(o, t);
    }
    known[&v].clone()
}

/// Every fusion of `fused` against the subgraph of `original` it replaced; returns how many
/// fusions were checked.
fn check_fusions(
    what: &str,
    original: &Graph,
    fused: &Graph,
    values: &BTreeMap<ValueId, Vec<ValueId>>,
    draw: &mut Draw,
) -> usize {
    let mut checked = 0;
    for n in fused.node_ids() {
        let node = fused.node(n);
        if !matches!(node.op, Op::Fusion { .. }) {
            continue;
        }
        let operands: Vec<Tensor> = node
            .inputs
            .iter()
            .map(|&v| draw.tensor(fused.ty(v)))
            .collect();
        let mut known: HashMap<ValueId, Tensor> = HashMap::new();
        for (&v, t) in node.inputs.iter().zip(&operands) {
            for &o in values.get(&v).map(Vec::as_slice).unwrap_or(&[]) {
                known.insert(o, t.clone());
            }
        }
        let refs: Vec<&Tensor> = operands.iter().collect();
        let results = eval_op(&node.op, &refs, Precision::Declared).expect("the fusion evaluates");
        for (&r, got) in node.outputs.iter().zip(&results) {
            let stands_for = values.get(&r).unwrap_or_else(|| {
                panic!("{what}: fusion result {r} stands for no original value")
            });
            for &o in stands_for {
                let want = compute(original, o, &mut known, what);
                assert!(
                    same(got, &want),
                    "{what}: fusion {n} result {r} differs from original {o}\n{}",
                    autopar_driver::ir::text::print(fused)
                );
            }
        }
        checked += 1;
    }
    checked
}

/// Runs two steps and returns the losses and every rank's final state.
fn train(step: &CompiledStep) -> (Vec<f64>, Vec<TensorMap>) {
    let mut state: Vec<TensorMap> = Vec::new();
    let mut save = |_: u64, s: &[TensorMap]| {
        state = s.to_vec();
        Ok(())
    };
    let hooks = RunHooks {
        save: Some(SaveHook {
            every: 2,
            save: &mut save,
        }),
        ..RunHooks::default()
    };
    let options = RunOptions {
        steps: 2,
        ..RunOptions::default()
    };
    let report = run_with(step, &options, hooks, |_| {}).expect("the step runs");
    (report.losses, state)
}

fn check(model: &str, mesh: &str, micro_batches: usize, dtype: DType) -> Option<usize> {
    let what = format!("{model} on {mesh} in {}", dtype.name());
    let fused = compile(&options(model, mesh, micro_batches, dtype, true));
    let unfused = compile(&options(model, mesh, micro_batches, dtype, false));
    let (fused, unfused) = match (fused, unfused) {
        (Ok(f), Ok(u)) => (f, u),
        (Err(f), Err(u)) => {
            // The model does not support the mesh: both refuse it alike.
            assert_eq!(f.to_string(), u.to_string(), "{what}");
            eprintln!("{what}: not supported ({f})");
            return None;
        }
        (f, u) => panic!("{what}: fused {:?}, unfused {:?}", f.err(), u.err()),
    };
    let originals: BTreeMap<String, &Graph> = unfused.programs().into_iter().collect();
    let reports: BTreeMap<&str, _> = fused.fusion.iter().map(|(l, r)| (l.as_str(), r)).collect();
    assert_eq!(
        reports.len(),
        originals.len(),
        "{what}: a report per program"
    );
    let mut draw = Draw(0x5eed);
    let mut fusions = 0;
    for (label, g) in fused.programs() {
        let report = reports[label.as_str()];
        fusions += check_fusions(
            &format!("{what}, {label}"),
            originals[&label],
            g,
            &report.values,
            &mut draw,
        );
    }
    let (a, b) = (train(&fused), train(&unfused));
    assert_eq!(
        a.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "{what}: losses {:?} fused, {:?} unfused",
        a.0,
        b.0
    );
    assert_eq!(a.1.len(), b.1.len(), "{what}");
    for (rank, (x, y)) in a.1.iter().zip(&b.1).enumerate() {
        assert_eq!(
            x.keys().collect::<Vec<_>>(),
            y.keys().collect::<Vec<_>>(),
            "{what}"
        );
        for (name, t) in x {
            assert!(
                same(t, &y[name]),
                "{what}: rank {rank} state `{name}` differs"
            );
        }
    }
    eprintln!("{what}: {fusions} fusions checked");
    Some(fusions)
}

fn check_all(dtype: DType) {
    let models = tiny_models();
    assert!(models.len() >= 4, "{models:?}");
    for (mesh, micro_batches) in MESHES {
        let supported: Vec<&String> = models
            .iter()
            .filter(|m| check(m, mesh, micro_batches, dtype).is_some_and(|n| n > 0))
            .collect();
        // Every mesh is exercised by some model (the language models run them all).
        assert!(!supported.is_empty(), "no model fused on {mesh}");
    }
}

#[test]
fn every_fusion_equals_what_it_replaced_in_f32() {
    check_all(DType::F32);
}

#[test]
fn every_fusion_equals_what_it_replaced_in_bf16() {
    check_all(DType::BF16);
}
