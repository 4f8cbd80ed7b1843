//! Local types and local ops: what a device holds and runs under a strategy whose kernel is
//! the op itself.

use autopar_ir::infer::infer;
use autopar_ir::{IrError, Op, Placement, Shape, TensorType};

use super::error::ShardingError;
use super::strategy::{LocalKernel, Strategy};

/// The type a device holds of a value of type `global` placed as `p` along an axis of
/// `axis_size` devices: the sharded dim divided, anything else unchanged.
///
/// ```
/// # use autopar_ir::{DType, Placement, TensorType};
/// # use autopar_passes::sharding::local_type;
/// let t = TensorType::new(DType::F32, [8, 6]);
/// assert_eq!(local_type(&t, Placement::Shard(1), 3).unwrap(), TensorType::new(DType::F32, [8, 2]));
/// assert!(local_type(&t, Placement::Shard(1), 4).is_err());
/// ```
pub fn local_type(
    global: &TensorType,
    p: Placement,
    axis_size: usize,
) -> Result<TensorType, IrError> {
    match p {
        Placement::Replicate | Placement::Partial(_) => Ok(global.clone()),
        Placement::Shard(d) => {
            let Some(&size) = global.dims().get(d) else {
                return Err(IrError::InvalidSharding {
                    sharding: p.to_string(),
                    ty: global.to_string(),
                    detail: format!("dim {d} is out of range"),
                });
            };
            if axis_size == 0 || !size.is_multiple_of(axis_size) {
                return Err(IrError::UnevenShard {
                    ty: global.to_string(),
                    dim: d,
                    size,
                    axis: "axis".into(),
                    ways: axis_size,
                });
            }
            let mut dims = global.dims().to_vec();
            dims[d] = size / axis_size;
            Ok(TensorType::new(global.dtype, dims))
        }
    }
}

/// The op each device runs under `strategy` (whose kernel must be [`LocalKernel::Same`]) when
/// the global operands have types `operands`: the op with every shape attribute replaced by
/// its local counterpart (a source's type, a reshape's or broadcast's target shape).
///
/// ```
/// # use autopar_ir::{DType, Op, Placement, Shape, TensorType};
/// # use autopar_passes::sharding::{local_op, strategies};
/// let x = TensorType::new(DType::F32, [4, 6]);
/// let op = Op::Reshape { shape: Shape::new([2, 2, 6]) };
/// let st = strategies(&op, &[&x], 2).unwrap();
/// let batch = st.iter().find(|s| s.operands == [Placement::Shard(0)]).unwrap();
/// assert_eq!(local_op(&op, batch, &[&x], 2).unwrap(), Op::Reshape { shape: Shape::new([1, 2, 6]) });
/// ```
pub fn local_op(
    op: &Op,
    strategy: &Strategy,
    operands: &[&TensorType],
    axis_size: usize,
) -> Result<Op, ShardingError> {
    if let LocalKernel::Lowered(l) = strategy.kernel {
        return Err(ShardingError::Mismatch {
            op: op.name(),
            detail: format!("strategy {strategy} needs the lowering {l:?}, not a local op"),
        });
    }
    if op.is_communication() {
        return Err(ShardingError::Communication { op: op.name() });
    }
    let results = infer(op, operands, None)?;
    if results.len() != strategy.results.len() || operands.len() != strategy.operands.len() {
        return Err(ShardingError::Mismatch {
            op: op.name(),
            detail: format!("strategy {strategy} does not fit the op's operands and results"),
        });
    }
    let local_result = |i: usize| local_type(&results[i], strategy.results[i], axis_size);
    let mut local = op.clone();
    match &mut local {
        Op::Parameter { ty, .. } | Op::Input { ty, .. } | Op::Constant { ty, .. } => {
            *ty = local_result(0)?;
        }
        Op::Reshape { shape } | Op::Broadcast { shape, .. } => {
            *shape = Shape::new(local_result(0)?.dims());
        }
        // No shape attributes, or attributes on dims that the strategies never shard (a
        // slice's or concat's dim, a softmax's dim, a scatter-add's rows).
        Op::Einsum { .. }
        | Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Gather
        | Op::ScatterAdd { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Rotary { .. }
        | Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::MoeRoute { .. }
        | Op::CrossEntropy
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. } => {}
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => return Err(ShardingError::Communication { op: op.name() }),
        Op::Fusion { .. } => return Err(ShardingError::Fusion),
    }
    Ok(local)
}
