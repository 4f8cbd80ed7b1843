//! Unit tests of the rules and of region formation: `.air` snippets in, structure out, and
//! every fused program evaluated against its original by the reference interpreter.

use std::collections::BTreeMap;

use autopar_cost_model::CostModel;
use autopar_cost_model::cluster;
use autopar_ir::text::parse;
use autopar_ir::{DType, Graph, Op, OpKind};
use autopar_runtime::{RunOptions, Tensor, run};

use super::{FuseOptions, FuseReport, fuse};

fn costs() -> CostModel {
    CostModel::new(cluster::cpu(1))
}

fn graph(body: &str) -> Graph {
    parse(&format!("graph \"t\" {{\n{body}\n}}\n")).expect("test graph parses")
}

fn simplify_only(g: &Graph) -> (Graph, FuseReport) {
    let options = FuseOptions {
        regions: false,
        ..FuseOptions::default()
    };
    fuse(g, &options, &costs()).expect("fuses")
}

fn kinds(g: &Graph) -> Vec<OpKind> {
    g.topo_order()
        .expect("acyclic")
        .into_iter()
        .map(|n| g.node(n).op.kind())
        .collect()
}

/// Deterministic inputs for every `input` of `g` (floats in [-2, 2), ints in 0..4, bools).
fn feeds(g: &Graph, seed: u64) -> BTreeMap<String, Tensor> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as f64 / (1u64 << 31) as f64
    };
    let mut out = BTreeMap::new();
    for (_, name, op) in g.inputs() {
        let Op::Input { ty, .. } = op else { continue };
        let n = ty.num_elements() as usize;
        let t = match ty.dtype {
            DType::Bool => {
                Tensor::from_bool(ty.shape.clone(), (0..n).map(|_| next() < 0.5).collect())
            }
            DType::I32 | DType::I64 => {
                Tensor::from_i64(ty.clone(), (0..n).map(|_| (next() * 4.0) as i64).collect())
            }
            _ => Tensor::from_f64(ty.clone(), (0..n).map(|_| next() * 4.0 - 2.0).collect()),
        };
        out.insert(name.to_string(), t.expect("valid feed").rounded());
    }
    out
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|x| x.to_bits()).collect()
}

/// The fused program computes every output bit for bit as the original does.
fn assert_same_outputs(original: &Graph, fused: &Graph) {
    for seed in 0..3 {
        let inputs = feeds(original, seed);
        let params = BTreeMap::new();
        let a = run(original, &params, &inputs, RunOptions::default()).expect("original runs");
        let b = run(fused, &params, &inputs, RunOptions::default()).expect("fused runs");
        for (name, t) in &a.outputs {
            assert_eq!(bits(t), bits(&b.outputs[name]), "output {name}");
        }
    }
}

#[test]
fn widen_then_narrow_back_is_removed_but_narrow_then_widen_stays() {
    let g = graph(
        r#"  %0: bf16[4,8] = input {name="x", role=features}
  %1: f32[4,8] = cast %0 {to=f32}
  %2: bf16[4,8] = cast %1 {to=bf16}
  %3: f32[4,8] = input {name="y", role=features}
  %4: bf16[4,8] = cast %3 {to=bf16}
  %5: f32[4,8] = cast %4 {to=f32}
  %6: f32[4,8] = cast %5 {to=f32}
  output "a" = %2
  output "b" = %6"#,
    );
    let (s, _) = simplify_only(&g);
    assert_eq!(s.output("a"), Some(autopar_ir::ValueId(0)));
    // `y` is rounded to bf16 and back: both casts stay, the same-dtype one goes.
    assert_eq!(
        kinds(&s),
        vec![OpKind::Input, OpKind::Input, OpKind::Cast, OpKind::Cast]
    );
    assert_same_outputs(&g, &s);
}

#[test]
fn a_cast_through_a_wider_type_goes_straight() {
    let g = graph(
        r#"  %0: f16[4] = input {name="x", role=features}
  %1: f32[4] = cast %0 {to=f32}
  %2: bf16[4] = cast %1 {to=bf16}
  output "a" = %2"#,
    );
    let (s, _) = simplify_only(&g);
    assert_eq!(kinds(&s), vec![OpKind::Input, OpKind::Cast]);
    assert_same_outputs(&g, &s);
}

#[test]
fn identities_are_removed_only_where_exact() {
    let g = graph(
        r#"  %0: f32[4,8] = input {name="x", role=features}
  %1: f32[] = constant {value=1.0}
  %2: f32[4,8] = broadcast %1 {shape=[4,8], dims=[]}
  %3: f32[4,8] = mul %0, %2
  %4: f32[4,8] = div %3, %2
  %5: f32[4,8] = neg %4
  %6: f32[4,8] = neg %5
  %7: f32[4,8] = constant {value=-0.0}
  %8: f32[4,8] = add %7, %6
  %9: f32[4,8] = constant {value=0.0}
  %10: f32[4,8] = sub %8, %9
  %11: f32[4,8] = add %10, %9
  output "a" = %10
  output "b" = %11"#,
    );
    let (s, _) = simplify_only(&g);
    // Everything folds to `x` but `x + 0.0`, which turns -0.0 into +0.0.
    assert_eq!(s.output("a"), Some(autopar_ir::ValueId(0)));
    let adds = kinds(&s).iter().filter(|k| **k == OpKind::Binary).count();
    assert_eq!(adds, 1, "{}", autopar_ir::text::print(&s));
    assert_same_outputs(&g, &s);
}

#[test]
fn transpose_pairs_and_reshape_chains_collapse() {
    let g = graph(
        r#"  %0: f32[2,3,4] = input {name="x", role=features}
  %1: f32[3,4,2] = transpose %0 {perm=[1,2,0]}
  %2: f32[2,3,4] = transpose %1 {perm=[2,0,1]}
  %3: f32[4,3,2] = transpose %1 {perm=[1,0,2]}
  %4: f32[6,4] = reshape %0 {shape=[6,4]}
  %5: f32[24] = reshape %4 {shape=[24]}
  %6: f32[2,3,4] = reshape %5 {shape=[2,3,4]}
  %7: f32[2,12] = reshape %5 {shape=[2,12]}
  output "a" = %2
  output "b" = %3
  output "c" = %6
  output "d" = %7"#,
    );
    let (s, _) = simplify_only(&g);
    assert_eq!(s.output("a"), Some(autopar_ir::ValueId(0)));
    assert_eq!(s.output("c"), Some(autopar_ir::ValueId(0)));
    // `b` is one transpose of `x`, `d` one reshape of it.
    let b = s.value(s.output("b").expect("b")).producer;
    assert_eq!(
        s.node(b).op,
        Op::Transpose {
            perm: vec![2, 1, 0]
        }
    );
    assert_eq!(s.node(b).inputs, vec![autopar_ir::ValueId(0)]);
    let d = s.value(s.output("d").expect("d")).producer;
    assert_eq!(s.node(d).inputs, vec![autopar_ir::ValueId(0)]);
    assert_eq!(s.num_nodes(), 3);
    assert_same_outputs(&g, &s);
}

#[test]
fn max_over_broadcast_dims_is_the_operand_but_sum_is_kept() {
    let g = graph(
        r#"  %0: f32[4] = input {name="x", role=features}
  %1: f32[4,8] = broadcast %0 {shape=[4,8], dims=[0]}
  %2: f32[4] = reduce_max %1 {dims=[1]}
  %3: f32[4] = reduce_sum %1 {dims=[1]}
  output "a" = %2
  output "b" = %3"#,
    );
    let (s, _) = simplify_only(&g);
    assert_eq!(s.output("a"), Some(autopar_ir::ValueId(0)));
    assert!(kinds(&s).contains(&OpKind::Reduce));
    assert_same_outputs(&g, &s);
}

#[test]
fn identical_collectives_merge_and_messages_do_not() {
    let g = graph(
        r#"  mesh tp=2, pp=2
  %0: f32[4] = input {name="x", role=features}
  %1: f32[4] = all_reduce %0 {axes=["tp"], reduce=sum}
  %2: f32[4] = all_reduce %0 {axes=["tp"], reduce=sum}
  %3: f32[4] = all_reduce %0 {axes=["tp"], reduce=max}
  %4: f32[4] = recv {axis="pp", shift=1}
  %5: f32[4] = recv {axis="pp", shift=1}
  %6: f32[4] = add %1, %2
  %7: f32[4] = add %3, %4
  %8: f32[4] = add %6, %5
  send %0 {axis="pp", shift=1}
  send %0 {axis="pp", shift=1}
  output "a" = %7
  output "b" = %8"#,
    );
    let (s, report) = simplify_only(&g);
    assert_eq!(report.collectives_before, 3);
    assert_eq!(report.collectives_after, 2);
    let count = |k: OpKind| kinds(&s).iter().filter(|x| **x == k).count();
    assert_eq!(count(OpKind::Recv), 2);
    assert_eq!(count(OpKind::Send), 2);
    // `%2` now stands for the same value as `%1`.
    assert_eq!(
        report.values[&autopar_ir::ValueId(1)],
        vec![autopar_ir::ValueId(1), autopar_ir::ValueId(2)]
    );
}

#[test]
fn collectives_stay_apart_where_a_peer_would_not_merge_them() {
    // On rank 0 the two slices coincide, on rank 1 they do not: no rank may merge.
    let rank = |start: usize| {
        graph(&format!(
            r#"  mesh tp=2
  %0: f32[8] = input {{name="x", role=features}}
  %1: f32[4] = slice %0 {{dim=0, start=0, end=4}}
  %2: f32[4] = slice %0 {{dim=0, start={start}, end={}}}
  %3: f32[4] = all_reduce %1 {{axes=["tp"], reduce=sum}}
  %4: f32[4] = all_reduce %2 {{axes=["tp"], reduce=sum}}
  %5: f32[4] = add %3, %4
  output "a" = %5"#,
            start + 4
        ))
    };
    let (r0, r1) = (rank(0), rank(4));
    let options = FuseOptions::default();
    let alone = fuse(&r0, &options, &costs()).expect("fuses").1;
    assert_eq!(alone.collectives_merged(), 1);
    let out = super::fuse_group(&[&r0, &r1], &options, &costs()).expect("fuses");
    assert!(out.iter().all(|(_, r)| r.collectives_merged() == 0));
}

#[test]
fn an_elementwise_chain_becomes_one_fusion_with_its_constants_copied_in() {
    let g = graph(
        r#"  %0: f32[4,8] = input {name="x", role=features}
  %1: f32[8] = input {name="b", role=features}
  %2: f32[4,8] = broadcast %1 {shape=[4,8], dims=[1]}
  %3: f32[4,8] = add %0, %2
  %4: f32[4,8] = gelu %3
  %5: f32[] = constant {value=2.0}
  %6: f32[4,8] = broadcast %5 {shape=[4,8], dims=[]}
  %7: f32[4,8] = mul %4, %6
  %8: f32[8,4] = transpose %7 {perm=[1,0]}
  %9: f32[8,4] = exp %8
  %10: f32[8,4] = broadcast %5 {shape=[8,4], dims=[]}
  %11: f32[8,4] = sub %9, %10
  output "y" = %11"#,
    );
    let (f, report) = fuse(&g, &FuseOptions::default(), &costs()).expect("fuses");
    // Two fusions either side of the transpose, which a body does not admit; the constant
    // is copied into both, the broadcasts never materialised.
    assert_eq!(report.fusions, 2, "{}", autopar_ir::text::print(&f));
    assert_eq!(
        kinds(&f),
        vec![
            OpKind::Input,
            OpKind::Input,
            OpKind::Fusion,
            OpKind::Transpose,
            OpKind::Fusion
        ]
    );
    let first = f
        .node_ids()
        .into_iter()
        .find(|&n| f.node(n).op.kind() == OpKind::Fusion)
        .expect("a fusion");
    let Op::Fusion { body } = &f.node(first).op else {
        unreachable!()
    };
    assert_eq!(body.params.len(), 2);
    assert_eq!(body.results.len(), 1);
    assert!(report.bytes_written_after < report.bytes_written_before);
    assert_same_outputs(&g, &f);
    // The result keeps the id of the value it computes, and the text round-trips.
    assert_eq!(f.node(first).outputs, vec![autopar_ir::ValueId(7)]);
    let printed = autopar_ir::text::print(&f);
    assert_eq!(
        autopar_ir::text::print(&parse(&printed).expect("parses")),
        printed
    );
}

#[test]
fn a_region_never_closes_a_cycle_through_an_unfused_node() {
    // exp -> einsum -> add and exp -> tanh -> add: fusing exp, tanh and add would make the
    // einsum both read the fusion and feed it.
    let g = graph(
        r#"  %0: f32[4,8] = input {name="x", role=features}
  %1: f32[8,8] = input {name="w", role=features}
  %2: f32[4,8] = exp %0
  %3: f32[4,8] = tanh %2
  %4: f32[4,8] = einsum %2, %1 {spec="ab,bc->ac"}
  %5: f32[4,8] = add %3, %4
  %6: f32[4,8] = neg %5
  output "y" = %6"#,
    );
    let (f, report) = fuse(&g, &FuseOptions::default(), &costs()).expect("fuses");
    assert_eq!(report.fusions, 2, "{}", autopar_ir::text::print(&f));
    let einsum = f
        .node_ids()
        .into_iter()
        .find(|&n| f.node(n).op.kind() == OpKind::Einsum)
        .expect("the einsum stays");
    let producer = f.value(f.node(einsum).inputs[0]).producer;
    assert_eq!(f.node(producer).op.kind(), OpKind::Fusion);
    for u in f.users(f.node(einsum).outputs[0]) {
        assert_ne!(u.0, producer, "the einsum feeds the fusion it reads");
    }
    assert!(autopar_ir::verify(&f).is_ok());
    assert_same_outputs(&g, &f);
}

#[test]
fn the_softmax_all_reduces_of_the_loss_backward_merge_under_tp() {
    let g = parse(include_str!(
        "../../../tests/golden/gpt-tiny.tp2.partitioned.air"
    ))
    .expect("golden parses");
    let (f, report) = fuse(&g, &FuseOptions::default(), &costs()).expect("fuses");
    assert_eq!(
        report.collectives_merged(),
        2,
        "{} nodes after",
        report.nodes_after
    );
    assert!(report.fusions > 0);
    assert!(report.nodes_after < report.nodes_before);
    assert!(autopar_ir::verify(&f).is_ok());
    // Metadata is kept: every fusion has a phase.
    for n in f.node_ids() {
        if f.node(n).op.kind() == OpKind::Fusion {
            assert!(f.meta(n).phase.is_some(), "{n} lost its metadata");
        }
    }
}
