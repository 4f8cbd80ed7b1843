//! The op table shared by the printer and the parser: one prototype op per mnemonic, and
//! the attribute names each op variant prints, in field order.

use crate::op::{
    BinaryOp, CompareOp, EinsumSpec, FusionBody, Init, InputRole, Op, OpKind, ReduceOp, UnaryOp,
};
use crate::placement::ReduceKind;
use crate::types::{DType, Shape, TensorType};

/// The ops of one kind, one per mnemonic, with placeholder attributes (the parser overwrites
/// every one of them, or reports it missing).
fn prototypes_of(kind: OpKind) -> Vec<Op> {
    let ty = TensorType::scalar(DType::F32);
    let spec = EinsumSpec {
        lhs: Vec::new(),
        rhs: Vec::new(),
        out: Vec::new(),
    };
    let op = match kind {
        OpKind::Parameter => Op::Parameter {
            name: String::new(),
            ty,
            init: Init::Zeros,
        },
        OpKind::Input => Op::Input {
            name: String::new(),
            ty,
            role: InputRole::Features,
        },
        OpKind::Constant => Op::Constant { ty, value: 0.0 },
        OpKind::Einsum => Op::Einsum { spec },
        OpKind::Unary => return UnaryOp::ALL.map(|func| Op::Unary { func }).to_vec(),
        OpKind::Binary => return BinaryOp::ALL.map(|func| Op::Binary { func }).to_vec(),
        OpKind::Compare => return CompareOp::ALL.map(|func| Op::Compare { func }).to_vec(),
        OpKind::Select => Op::Select,
        OpKind::Cast => Op::Cast { to: DType::F32 },
        OpKind::Reduce => {
            return ReduceOp::ALL
                .map(|func| Op::Reduce {
                    func,
                    dims: Vec::new(),
                })
                .to_vec();
        }
        OpKind::Softmax => Op::Softmax { dim: 0 },
        OpKind::LayerNorm => Op::LayerNorm { eps: 0.0 },
        OpKind::RmsNorm => Op::RmsNorm { eps: 0.0 },
        OpKind::Gather => Op::Gather,
        OpKind::ScatterAdd => Op::ScatterAdd { num_rows: 0 },
        OpKind::Reshape => Op::Reshape {
            shape: Shape::scalar(),
        },
        OpKind::Transpose => Op::Transpose { perm: Vec::new() },
        OpKind::Slice => Op::Slice {
            dim: 0,
            start: 0,
            end: 0,
        },
        OpKind::Concat => Op::Concat { dim: 0 },
        OpKind::Broadcast => Op::Broadcast {
            shape: Shape::scalar(),
            dims: Vec::new(),
        },
        OpKind::Rotary => Op::Rotary { base: 0.0 },
        OpKind::Attention => Op::Attention {
            causal: false,
            scale: 0.0,
        },
        OpKind::AttentionBackward => Op::AttentionBackward {
            causal: false,
            scale: 0.0,
        },
        OpKind::MoeRoute => Op::MoeRoute {
            top_k: 0,
            capacity: 0,
            normalize: false,
        },
        OpKind::CrossEntropy => Op::CrossEntropy,
        OpKind::SgdUpdate => Op::SgdUpdate {
            lr: 0.0,
            momentum: 0.0,
            weight_decay: 0.0,
        },
        OpKind::AdamWUpdate => Op::AdamWUpdate {
            lr: 0.0,
            beta1: 0.0,
            beta2: 0.0,
            eps: 0.0,
            weight_decay: 0.0,
        },
        OpKind::AllReduce => Op::AllReduce {
            axes: Vec::new(),
            reduce: ReduceKind::Sum,
        },
        OpKind::AllGather => Op::AllGather {
            axes: Vec::new(),
            dim: 0,
        },
        OpKind::ReduceScatter => Op::ReduceScatter {
            axes: Vec::new(),
            dim: 0,
            reduce: ReduceKind::Sum,
        },
        OpKind::AllToAll => Op::AllToAll {
            axes: Vec::new(),
            split_dim: 0,
            concat_dim: 0,
        },
        OpKind::CollectiveBroadcast => Op::CollectiveBroadcast {
            axes: Vec::new(),
            root: 0,
        },
        OpKind::Send => Op::Send {
            axis: String::new(),
            shift: 0,
        },
        OpKind::Recv => Op::Recv {
            axis: String::new(),
            shift: 0,
            ty,
        },
        OpKind::Fusion => Op::Fusion {
            body: FusionBody {
                params: Vec::new(),
                instrs: Vec::new(),
                results: Vec::new(),
            },
        },
    };
    vec![op]
}

/// One prototype per mnemonic, for every op kind.
pub(crate) fn prototypes() -> Vec<Op> {
    OpKind::ALL.into_iter().flat_map(prototypes_of).collect()
}

/// The attributes `op` prints, in the order of its fields. Functions encoded in the
/// mnemonic and the declared type of source ops are not attributes.
pub(crate) fn attr_names(op: &Op) -> &'static [&'static str] {
    match op {
        Op::Parameter { .. } => &["name", "init"],
        Op::Input { .. } => &["name", "role"],
        Op::Constant { .. } => &["value"],
        Op::Einsum { .. } => &["spec"],
        Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select
        | Op::Gather
        | Op::CrossEntropy => &[],
        Op::Cast { .. } => &["to"],
        Op::Reduce { .. } => &["dims"],
        Op::Softmax { .. } | Op::Concat { .. } => &["dim"],
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => &["eps"],
        Op::ScatterAdd { .. } => &["num_rows"],
        Op::Reshape { .. } => &["shape"],
        Op::Transpose { .. } => &["perm"],
        Op::Slice { .. } => &["dim", "start", "end"],
        Op::Broadcast { .. } => &["shape", "dims"],
        Op::Rotary { .. } => &["base"],
        Op::Attention { .. } | Op::AttentionBackward { .. } => &["causal", "scale"],
        Op::MoeRoute { .. } => &["top_k", "capacity", "normalize"],
        Op::SgdUpdate { .. } => &["lr", "momentum", "weight_decay"],
        Op::AdamWUpdate { .. } => &["lr", "beta1", "beta2", "eps", "weight_decay"],
        Op::AllReduce { .. } => &["axes", "reduce"],
        Op::AllGather { .. } => &["axes", "dim"],
        Op::ReduceScatter { .. } => &["axes", "dim", "reduce"],
        Op::AllToAll { .. } => &["axes", "split_dim", "concat_dim"],
        Op::CollectiveBroadcast { .. } => &["axes", "root"],
        Op::Send { .. } | Op::Recv { .. } => &["axis", "shift"],
        Op::Fusion { .. } => &["body"],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_prototype_and_mnemonics_are_unique() {
        let protos = prototypes();
        for kind in OpKind::ALL {
            assert!(protos.iter().any(|p| p.kind() == kind), "{kind:?}");
        }
        let mut names: Vec<&str> = protos.iter().map(Op::name).collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        // Words with another meaning at the start of a statement must not be mnemonics.
        for word in ["mesh", "output", "graph", "scope"] {
            assert!(!names.contains(&word), "{word}");
        }
    }

    #[test]
    fn attribute_names_match_serde_field_names() {
        for op in prototypes() {
            let json = serde_json::to_value(&op).unwrap_or_default();
            let mut fields: Vec<String> = json
                .as_object()
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default();
            // The tag, the function encoded in the mnemonic, and a source op's type are not
            // printed as attributes.
            fields.retain(|f| f != "op" && f != "func" && !(op.is_source() && f == "ty"));
            fields.sort();
            let mut names: Vec<&str> = attr_names(&op).to_vec();
            names.sort_unstable();
            assert_eq!(fields, names, "{}", op.name());
        }
    }
}
