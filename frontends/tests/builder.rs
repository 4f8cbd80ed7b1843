//! The builder API: scopes, parameter naming, annotations, and the sticky first error.

use autopar_frontends::{
    DType, FrontendError, InputRole, ModelBuilder, ONES, Placement, ZEROS, normal,
};
use autopar_ir::{Graph, Op, OpKind, ShardingOrigin, verify};

/// The scope of the node producing parameter `name`.
fn param_scope(g: &Graph, name: &str) -> Option<String> {
    let (v, _, _) = g.parameters().into_iter().find(|(_, n, _)| *n == name)?;
    g.node(g.value(v).producer).scope.clone()
}

#[test]
fn scopes_nest_and_qualify_parameter_names() -> Result<(), FrontendError> {
    let m = ModelBuilder::new("scoped");
    let x = m.input("x", DType::F32, [2, 8], InputRole::Features);
    let y = m.scope("h.1", || {
        assert_eq!(m.current_scope(), "h.1");
        m.scope("mlp", || {
            let w = m.param("w1", [8, 8], normal(0.02));
            x.einsum("bh,hf->bf", w).gelu()
        })
    });
    assert_eq!(m.current_scope(), "");
    m.output("loss", y.mean([0, 1]));
    let g = m.finish()?;
    verify(&g).map_err(|e| FrontendError::Verify(Box::new(e)))?;

    assert_eq!(param_scope(&g, "h.1.mlp.w1").as_deref(), Some("h.1.mlp"));
    let gelu = g
        .node_ids()
        .into_iter()
        .map(|n| g.node(n))
        .find(|n| n.op.name() == "gelu")
        .expect("the graph has a gelu");
    assert_eq!(gelu.scope.as_deref(), Some("h.1.mlp"));
    // Inputs and the top-level mean have no scope.
    let mean = g.node(g.value(g.output("loss").expect("loss")).producer);
    assert_eq!(mean.scope, None);
    assert_eq!(g.inputs()[0].1, "x");
    Ok(())
}

#[test]
fn shape_mismatch_names_scope_op_and_shapes() {
    let m = ModelBuilder::new("bad");
    let x = m.input("x", DType::F32, [2, 4, 64], InputRole::Features);
    let out = m.scope("h.1", || {
        m.scope("mlp", || {
            let w = m.param("w1", [32, 128], normal(0.02));
            x.einsum("bsh,hf->bsf", w).gelu()
        })
    });
    let nodes_after_error = m.num_nodes();
    // Everything after the first error is a no-op, including a second mistake.
    let later = out + x;
    assert_eq!(later.value(), None);
    assert_eq!(m.num_nodes(), nodes_after_error);
    m.output("loss", later);

    let err = m.finish().expect_err("the einsum does not type-check");
    assert_eq!(
        err.to_string(),
        "h.1.mlp: `einsum`: `bsh,hf->bsf`: label `h` is 64 in lhs f32[2,4,64] but 32 in rhs f32[32,128]"
    );
    let FrontendError::Op { scope, op, .. } = err else {
        panic!("expected an op error, got {err:?}");
    };
    assert_eq!((scope.as_str(), op), ("h.1.mlp", "einsum"));
}

#[test]
fn elementwise_mismatch_reads_like_model_code() {
    let m = ModelBuilder::new("bad");
    let a = m.param("a", [2, 3], ZEROS);
    let b = m.param("b", [3, 2], ZEROS);
    let _ = m.scope("block", || a + b);
    assert_eq!(
        m.error().map(|e| e.to_string()).as_deref(),
        Some("block: `add`: operand types differ: f32[2,3] vs f32[3,2]")
    );
}

#[test]
fn bad_einsum_spec_is_an_error_not_a_panic() {
    let m = ModelBuilder::new("bad");
    let a = m.param("a", [2, 3], ZEROS);
    let _ = a.einsum("ab->b", a);
    let err = m.finish().expect_err("the spec has one operand");
    assert_eq!(
        err.to_string(),
        "`einsum`: invalid attribute `spec`: einsum spec `ab->b` needs two operands separated by `,`"
    );
}

#[test]
fn annotations_accumulate_as_user_shardings() -> Result<(), FrontendError> {
    let m = ModelBuilder::new("annotated");
    let w = m
        .param("w", [8, 16], normal(0.02))
        .shard(1, "tp")
        .replicate("dp");
    let s = w.sharding().expect("annotated");
    assert_eq!(s.origin, ShardingOrigin::User);
    assert_eq!(
        s.axes,
        vec![
            ("tp".to_string(), Placement::Shard(1)),
            ("dp".to_string(), Placement::Replicate)
        ]
    );
    m.output("w", w);
    let g = m.finish()?;
    let (v, _, _) = g.parameters()[0];
    assert_eq!(g.value(v).sharding.as_ref(), Some(&s));
    Ok(())
}

#[test]
fn an_axis_annotated_twice_is_an_error() {
    let m = ModelBuilder::new("twice");
    let _ = m.scope("mlp", || {
        m.param("w1", [8, 16], normal(0.02))
            .shard(1, "tp")
            .shard(0, "tp")
    });
    assert_eq!(
        m.error().map(|e| e.to_string()).as_deref(),
        Some(
            "mlp: sharding of `mlp.w1` (f32[8,16]) over mesh axis `tp`: the axis is listed twice (it already has S(1))"
        )
    );
}

#[test]
fn sharding_a_missing_dim_or_a_bad_axis_is_an_error() {
    let m = ModelBuilder::new("rank");
    let _ = m.param("b", [16], ZEROS).shard(1, "tp");
    assert_eq!(
        m.error().map(|e| e.to_string()).as_deref(),
        Some(
            "sharding of `b` (f32[16]) over mesh axis `tp`: dim 1 does not exist (the tensor has rank 1)"
        )
    );

    let m = ModelBuilder::new("axis");
    let _ = m.param("b", [16], ONES).shard(0, "t p");
    let Some(FrontendError::Annotation { tensor, axis, .. }) = m.error() else {
        panic!("expected an annotation error, got {:?}", m.error());
    };
    assert_eq!((tensor.as_str(), axis.as_str()), ("b", "t p"));
}

#[test]
fn duplicate_names_are_errors() {
    let m = ModelBuilder::new("dup");
    let _ = m.scope("attn", || m.param("w", [4], ZEROS));
    let _ = m.scope("attn", || m.param("w", [4], ZEROS));
    assert_eq!(
        m.error().map(|e| e.to_string()).as_deref(),
        Some("attn: parameter `attn.w` is declared twice")
    );

    let m = ModelBuilder::new("dup");
    let _ = m.input("x", DType::F32, [4], InputRole::Features);
    let _ = m.input("x", DType::F32, [4], InputRole::Features);
    assert!(matches!(
        m.error(),
        Some(FrontendError::DuplicateName { kind: "input", .. })
    ));

    let m = ModelBuilder::new("dup");
    let x = m.input("x", DType::F32, [4], InputRole::Features);
    m.output("y", x);
    m.output("y", x);
    assert!(matches!(
        m.error(),
        Some(FrontendError::DuplicateName { kind: "output", .. })
    ));
}

#[test]
fn tensors_of_another_builder_are_rejected() {
    let (m1, m2) = (ModelBuilder::new("one"), ModelBuilder::new("two"));
    let a = m1.param("a", [4], ZEROS);
    let b = m2.param("b", [4], ZEROS);
    let _ = a + b;
    assert_eq!(
        m1.error().map(|e| e.to_string()).as_deref(),
        Some("`add`: operand 1 comes from another model builder")
    );
    assert_eq!(m2.error(), None);
}

#[test]
fn scalar_operands_become_filled_constants() -> Result<(), FrontendError> {
    let m = ModelBuilder::new("scalar");
    let x = m.param("x", [2, 3], ONES);
    let y = -(x * 0.5 + 1.0);
    assert_eq!(
        format!("{y:?}"),
        format!("Tensor({}: f32[2,3])", y.value().expect("live"))
    );
    m.output("y", y);
    let g = m.finish()?;
    let constants: Vec<f64> = g
        .node_ids()
        .into_iter()
        .filter_map(|n| match &g.node(n).op {
            Op::Constant { ty, value } => {
                assert_eq!(ty.to_string(), "f32[2,3]");
                Some(*value)
            }
            _ => None,
        })
        .collect();
    assert_eq!(constants, vec![0.5, 1.0]);
    let kinds: Vec<OpKind> = g
        .node_ids()
        .into_iter()
        .map(|n| g.node(n).op.kind())
        .collect();
    assert_eq!(
        kinds,
        vec![
            OpKind::Parameter,
            OpKind::Constant,
            OpKind::Binary,
            OpKind::Constant,
            OpKind::Binary,
            OpKind::Unary
        ]
    );
    Ok(())
}

#[test]
fn multi_result_ops_through_the_escape_hatch() -> Result<(), FrontendError> {
    let m = ModelBuilder::new("sgd");
    let p = m.param("p", [4], ZEROS);
    let grad = m.param("g", [4], ONES);
    let mom = m.param("mom", [4], ZEROS);
    let op = Op::SgdUpdate {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let results = m.op(op, &[p, grad, mom]);
    assert_eq!(results.len(), 2);
    m.output("p", results[0]);
    m.output("mom", results[1]);
    let g = m.finish()?;
    assert_eq!(g.outputs().len(), 2);
    Ok(())
}

#[test]
fn inert_handles_after_an_error_are_harmless() {
    let m = ModelBuilder::new("inert");
    let a = m.param("a", [2], ZEROS);
    let bad = a.reshape([3]);
    assert_eq!(format!("{bad:?}"), "Tensor(inert)");
    assert_eq!(bad.shape().rank(), 0);
    assert_eq!(bad.ty(), None);
    // Methods that read shapes of inert handles do not panic either.
    let _ = bad.add_bias(a).broadcast_like(bad, [0]).shard(3, "tp");
    let (combine, dispatch) = bad.moe_route(autopar_frontends::MoeRouting {
        top_k: 1,
        capacity: 1,
        normalize: false,
    });
    assert_eq!((combine.value(), dispatch.value()), (None, None));
    let err = m.finish().expect_err("reshape of 2 elements to 3");
    assert_eq!(
        err.to_string(),
        "`reshape`: cannot reshape f32[2] (2 elements) to [3] (3 elements)"
    );
}
