//! Round trips through the text format: hand-built graphs with every op kind, shardings,
//! scopes, sparse value ids, a permuted mesh, tricky floats and strings, and the exact
//! layout of the printer.

#![allow(clippy::unwrap_used)]

mod text_common;

use std::collections::BTreeSet;

use autopar_ir::text::{parse, print};
use autopar_ir::{DType, DeviceMesh, Graph, Init, Op, OpKind, TensorType, UnaryOp, ValueId};
use text_common::*;

/// print → parse → print is the identity on the text, and parse(print(g)) == g.
fn assert_round_trip(g: &Graph) -> String {
    let text = print(g);
    let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(print(&parsed), text);
    assert!(parsed == *g, "parsed graph differs:\n{text}");
    text
}

#[test]
fn every_op_kind_round_trips() {
    let g = every_op_graph();
    let text = assert_round_trip(&g);
    let kinds: BTreeSet<OpKind> = g.node_ids().iter().map(|&n| g.node(n).op.kind()).collect();
    for kind in OpKind::ALL {
        assert!(kinds.contains(&kind), "{kind:?} is not exercised");
    }
    // Every mnemonic appears in the text.
    for n in g.node_ids() {
        let name = g.node(n).op.name();
        assert!(
            text.contains(&format!(" {name}")),
            "`{name}` missing from\n{text}"
        );
    }
}

#[test]
fn sparse_value_ids_survive() {
    let g = every_op_graph();
    let parsed = parse(&print(&g)).unwrap();
    let a: Vec<ValueId> = g.value_ids().collect();
    let b: Vec<ValueId> = parsed.value_ids().collect();
    assert_eq!(a, b);
    // The removed value leaves a hole at %1.
    assert!(parsed.value_checked(ValueId(1)).is_err());
    assert!(parsed.value_checked(ValueId(2)).is_ok());
}

#[test]
fn mesh_lines() {
    let g = every_op_graph();
    let text = print(&g);
    assert!(
        text.contains("\n  mesh dp=2, tp=2, pp=2 devices=[0,4,2,6,1,5,3,7]\n"),
        "{text}"
    );
    let parsed = parse(&text).unwrap();
    assert_eq!(parsed.mesh(), g.mesh());

    let mut g = Graph::new("m");
    g.set_mesh(Some(DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap()));
    let text = assert_round_trip(&g);
    assert_eq!(text, "graph \"m\" {\n  mesh dp=2, tp=4\n}\n");
}

#[test]
fn exact_layout() {
    let mut g = Graph::new("gpt-tiny");
    g.set_mesh(Some(DeviceMesh::new([("dp", 2), ("pp", 2)]).unwrap()));
    let tokens = input(
        &mut g,
        "tokens",
        TensorType::new(DType::I32, [8, 32]),
        autopar_ir::InputRole::Tokens { vocab: 256 },
    );
    let wte = param(&mut g, "wte", f32t(&[256, 64]), Init::Normal { std: 0.02 });
    g.set_scope(g.value(wte).producer, Some("embed".into()));
    let h = g.add(Op::Gather, &[wte, tokens]).unwrap();
    let a = g
        .add(
            Op::Unary {
                func: UnaryOp::Gelu,
            },
            &[h],
        )
        .unwrap();
    g.set_sharding(
        a,
        Some(autopar_ir::Sharding {
            axes: vec![
                ("dp".into(), autopar_ir::Placement::Shard(0)),
                ("tp".into(), autopar_ir::Placement::Replicate),
            ],
            origin: autopar_ir::ShardingOrigin::Inferred,
        }),
    )
    .unwrap();
    g.add_node(
        Op::Send {
            axis: "pp".into(),
            shift: 1,
        },
        &[a],
    )
    .unwrap();
    g.add_output("act", a).unwrap();
    let text = assert_round_trip(&g);
    let expected = r#"graph "gpt-tiny" {
  mesh dp=2, pp=2
  %0: i32[8,32] = input {name="tokens", role=tokens(256)}
  %1: f32[256,64] = parameter {name="wte", init=normal(0.02)} scope="embed"
  %2: f32[8,32,64] = gather %1, %0
  %3: f32[8,32,64] inferred{dp: S(0), tp: R} = gelu %2
  send %3 {axis="pp", shift=1}
  output "act" = %3
}
"#;
    assert_eq!(text, expected);
}

#[test]
fn tricky_floats_keep_their_bits() {
    let values = [
        1e-5,
        0.1,
        -0.0,
        0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1e300,
        -1e-300,
        5e-324,
        f64::MAX,
        f64::MIN_POSITIVE,
        1.0 / 3.0,
        0.02,
        123456789.0,
        1e16,
    ];
    let mut g = Graph::new("floats");
    for &x in &values {
        constant(&mut g, TensorType::scalar(DType::F32), x);
    }
    let text = assert_round_trip(&g);
    let parsed = parse(&text).unwrap();
    let mut got = Vec::new();
    for n in parsed.node_ids() {
        if let Op::Constant { value, .. } = parsed.node(n).op {
            got.push(value.to_bits());
        }
    }
    let want: Vec<u64> = values.iter().map(|x| x.to_bits()).collect();
    assert_eq!(got, want);
    assert!(text.contains("value=1e-5}"), "{text}");
    assert!(text.contains("value=-0.0}"), "{text}");
    assert!(text.contains("value=-inf}"), "{text}");
    assert!(text.contains("value=1e300}"), "{text}");
}

#[test]
fn nans_keep_their_bits() {
    // NaN attributes make `==` false (floats compare as IEEE numbers), so compare bits.
    let nans = [
        f64::NAN,
        -f64::NAN,
        f64::from_bits(0x7ff0_0000_0000_0001),
        f64::from_bits(0xfff8_dead_beef_0001),
    ];
    let mut g = Graph::new("nans");
    for &x in &nans {
        constant(&mut g, TensorType::scalar(DType::F32), x);
    }
    param(&mut g, "p", f32t(&[2]), Init::Normal { std: -f64::NAN });
    let text = print(&g);
    assert!(text.contains("{value=NaN}"), "{text}");
    assert!(text.contains("{value=NaN(0xfff8000000000000)}"), "{text}");
    assert!(
        text.contains("init=normal(NaN(0xfff8000000000000))"),
        "{text}"
    );
    let parsed = parse(&text).unwrap();
    assert_eq!(print(&parsed), text);
    let mut got = Vec::new();
    for n in parsed.node_ids() {
        match &parsed.node(n).op {
            Op::Constant { value, .. } => got.push(value.to_bits()),
            Op::Parameter {
                init: Init::Normal { std },
                ..
            } => got.push(std.to_bits()),
            other => panic!("unexpected {other:?}"),
        }
    }
    let mut want: Vec<u64> = nans.iter().map(|x| x.to_bits()).collect();
    want.push((-f64::NAN).to_bits());
    assert_eq!(got, want);
}

#[test]
fn tricky_strings() {
    let names = [
        "plain",
        "with \"quotes\"",
        "back\\slash",
        "new\nline and\ttab",
        "bell\u{7}del\u{7f}nul\u{0}cr\r",
        "unicode é ü 漢字 🦀 \u{2028}",
        "",
        "# not a comment",
        "trailing \\",
    ];
    let mut g = Graph::new("strings \"🦀\"\n");
    for (i, name) in names.iter().enumerate() {
        let v = param(&mut g, name, f32t(&[1]), Init::Zeros);
        g.set_scope(g.value(v).producer, Some(format!("scope {name}")));
        g.add_output(format!("out {i} {name}"), v).unwrap();
    }
    let text = assert_round_trip(&g);
    assert!(text.contains(r#"name="with \"quotes\"""#), "{text}");
    assert!(text.contains(r#"name="new\nline and\ttab""#), "{text}");
    assert!(
        text.contains(r#"name="bell\u{7}del\u{7f}nul\u{0}cr\u{d}""#),
        "{text}"
    );
    // One node per line: no raw control characters leak into the text.
    assert_eq!(text.lines().count(), 2 + 2 * names.len());
}

#[test]
fn empty_graph_and_comments_and_free_spacing() {
    let g = Graph::new("");
    assert_eq!(assert_round_trip(&g), "graph \"\" {\n}\n");

    let spaced = "# leading comment\n graph\t\"g\"{mesh dp = 2 ,tp=2 # axes\n%0 :f32 [ 4 , 2 ]user{ dp :S( 0 ) }=parameter{init=zeros,name=\"p\"}\n\n%2:f32[4,2]\n=\nneg\n%0 scope = \"s\" output \"o\"=%2}   # done\n";
    let g = parse(spaced).unwrap();
    let expected = "graph \"g\" {\n  mesh dp=2, tp=2\n  %0: f32[4,2] user{dp: S(0)} = parameter {name=\"p\", init=zeros}\n  %2: f32[4,2] = neg %0 scope=\"s\"\n  output \"o\" = %2\n}\n";
    assert_eq!(print(&g), expected);
    assert_round_trip(&g);
}

#[test]
fn huge_but_valid_dims_allocate_nothing() {
    // The largest tensor the IR accepts (2^52 elements) parses without allocating.
    let huge = 1usize << 26;
    let src = format!(
        "graph \"g\" {{\n  %0: f32[{huge},{huge}] = parameter {{name=\"p\", init=zeros}}\n  %1: f32[{huge},{huge}] = exp %0\n  %2: f32[{huge}] = reduce_sum %1 {{dims=[1]}}\n}}\n"
    );
    let g = parse(&src).unwrap();
    assert_eq!(print(&g), src);
    assert_eq!(g.num_parameter_elements(), 1 << 52);
}

#[test]
fn metadata_round_trips_through_text_and_json() {
    use autopar_ir::{LayerId, NodeMeta, Phase, WeightRole};
    let src = r#"graph "m" {
  %0: f32[4,2] = parameter {name="w", init=zeros} scope="h.0.mlp" meta{layer=block(0), role=mlp_in}
  %1: f32[4,2] = exp %0 meta{phase=backward, mb=1, layer=block(0), part=mlp}
  %2: f32[4,2] = exp %1 meta{phase=optimizer}
  output "y" = %2
}
"#;
    let g = parse(src).unwrap();
    assert_eq!(print(&g), src);
    let w = g.value(ValueId(0)).producer;
    assert_eq!(
        g.meta(w),
        NodeMeta {
            layer: Some(LayerId::Block(0)),
            role: Some(WeightRole::MlpIn),
            ..NodeMeta::default()
        }
    );
    assert_eq!(
        g.meta(g.value(ValueId(1)).producer).phase,
        Some(Phase::Backward)
    );
    let back = autopar_ir::json::from_json(&autopar_ir::json::to_json(&g)).unwrap();
    assert!(back == g);
    // Fields in any order read back; repeated, unknown or misplaced ones are errors.
    let reordered = src.replace(
        "phase=backward, mb=1, layer=block(0), part=mlp",
        "part=mlp, layer=block(0), mb=1, phase=backward",
    );
    assert_eq!(print(&parse(&reordered).unwrap()), src);
    for (bad, why) in [
        ("mb=1, layer=block(0), part=mlp}", "mb=1, mb=2}"),
        ("part=mlp}", "part=head}"),
        ("role=mlp_in}", "role=bogus}"),
        ("layer=block(0), role=mlp_in}", "layer=blk(0), role=mlp_in}"),
        ("phase=optimizer}", "phase=optimizer, role=norm}"),
        (
            "layer=block(0), role=mlp_in}",
            "phase=forward, role=mlp_in}",
        ),
    ] {
        let text = src.replace(bad, why);
        assert!(parse(&text).is_err(), "accepted {why}");
    }
}

#[test]
fn given_values_round_trip_bit_for_bit_and_elide_in_dumps() {
    let mut g = Graph::new("values");
    let values = vec![
        0.1f32,
        -0.0,
        f32::INFINITY,
        1e-40,
        -3.5,
        f32::from_bits(0x7fc0_0001),
    ];
    g.add(
        Op::Parameter {
            name: "w".into(),
            ty: TensorType::new(DType::F32, [2, 3]),
            init: Init::Values(autopar_ir::Values::new(values.clone())),
        },
        &[],
    )
    .unwrap();
    let text = print(&g);
    assert!(text.contains("init=values(\"3dcccccd80000000"), "{text}");
    let back = parse(&text).unwrap();
    let Op::Parameter {
        init: Init::Values(v),
        ..
    } = &back.node(back.node_ids()[0]).op
    else {
        panic!("not a parameter with values");
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(v.as_slice()), bits(&values));
    assert_eq!(print(&back), text);

    let dump = autopar_ir::text::print_with(&g, autopar_ir::text::Values::Elided);
    assert!(dump.contains("init=values(elided, 6)"), "{dump}");
    let err = parse(&dump).unwrap_err().to_string();
    assert!(err.contains("left out of this dump"), "{err}");
    assert!(parse(&text.replace("3dcccccd", "3dcccccz")).is_err());
    assert!(parse(&text.replace("3dcccccd", "3dccccc")).is_err());
}
