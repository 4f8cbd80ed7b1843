//! The e-graph language of rank programs: every node of a graph as a term over e-classes,
//! its op interned in a table, with a type analysis that gives each class its result types.
//!
//! Pure ops are hash-consed (two equal ops on the same classes are one class), within a merge
//! domain: a large value merges only with values of its own phase and micro-batch (merging a
//! backward's recomputation into the forward would keep the forward's value alive until the
//! backward), a small one with any. Ops with side effects or an identity of their own
//! (sources, `send`, `recv`, recomputed nodes, anything that is not a function of its operands
//! alone) carry a unique identity, so that nothing merges them. Collectives are pure in value (an all-reduce of one value over
//! the same axes gives one result), but merging two of them changes what a rank says to the
//! others, so the caller decides, per collective, whether it may merge ([`Purity`]).

use std::collections::HashMap;

use autopar_ir::infer::infer;
use autopar_ir::{DeviceMesh, Op, TensorType};
use egg::{Analysis, DidMerge, EGraph, Id, Language};

/// An op of the table, by index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpRef(pub u32);

/// Identities below this are merge domains of pure nodes (0: merges with any equal node; a
/// domain: only with equal nodes of the same domain); from it on, each is one node's own.
pub const FIRST_OWN_IDENTITY: u32 = 1 << 24;

/// Whether a node of this identity is pure (a function of its operands), in some domain.
pub fn is_pure_identity(identity: u32) -> bool {
    identity < FIRST_OWN_IDENTITY
}

/// One e-node: an op over operand classes, or one result of a multi-result op.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Term {
    /// `op` applied to `operands`. `identity` is 0 for a node that may merge with any equal
    /// one, a merge domain below [`FIRST_OWN_IDENTITY`], or the node's own.
    Apply {
        /// The op, in the table.
        op: OpRef,
        /// 0, a merge domain, or the node's own number.
        identity: u32,
        /// Operand classes, in order.
        operands: Vec<Id>,
    },
    /// Result `index` of the multi-result op in class `tuple[0]`.
    Result {
        /// Which result.
        index: u32,
        /// The class of the op.
        tuple: [Id; 1],
    },
}

/// What a [`Term`] is, without its operands (egg's matching key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TermKind {
    /// An [`Term::Apply`] of this op and identity.
    Apply(OpRef, u32),
    /// A [`Term::Result`] of this index.
    Result(u32),
}

impl Language for Term {
    type Discriminant = TermKind;

    fn discriminant(&self) -> TermKind {
        match self {
            Term::Apply { op, identity, .. } => TermKind::Apply(*op, *identity),
            Term::Result { index, .. } => TermKind::Result(*index),
        }
    }

    fn matches(&self, other: &Self) -> bool {
        self.discriminant() == other.discriminant()
            && self.children().len() == other.children().len()
    }

    fn children(&self) -> &[Id] {
        match self {
            Term::Apply { operands, .. } => operands,
            Term::Result { tuple, .. } => tuple,
        }
    }

    fn children_mut(&mut self) -> &mut [Id] {
        match self {
            Term::Apply { operands, .. } => operands,
            Term::Result { tuple, .. } => tuple,
        }
    }
}

/// The ops of an e-graph, each stored once: equal ops (by `PartialEq`) share an [`OpRef`].
#[derive(Clone, Debug, Default)]
pub struct OpTable {
    ops: Vec<Op>,
    /// Candidates by their debug text (which is equal for equal ops); checked with `==`.
    by_text: HashMap<String, Vec<OpRef>>,
}

impl OpTable {
    /// The [`OpRef`] of `op`, adding it if it is new.
    pub fn intern(&mut self, op: &Op) -> OpRef {
        let text = format!("{op:?}");
        let candidates = self.by_text.entry(text).or_default();
        if let Some(r) = candidates.iter().find(|r| self.ops[r.0 as usize] == *op) {
            return *r;
        }
        let r = OpRef(self.ops.len() as u32);
        self.ops.push(op.clone());
        candidates.push(r);
        r
    }

    /// The [`OpRef`] of `op`, if it is in the table.
    pub fn find(&self, op: &Op) -> Option<OpRef> {
        self.by_text
            .get(&format!("{op:?}"))?
            .iter()
            .find(|r| self.ops[r.0 as usize] == *op)
            .copied()
    }

    /// The op behind `r`.
    pub fn get(&self, r: OpRef) -> &Op {
        &self.ops[r.0 as usize]
    }
}

/// Whether a node may merge with an equal one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purity {
    /// A function of its operands: equal nodes merge.
    Pure,
    /// It has an identity of its own (a source, a message, a collective the caller keeps).
    Unique,
}

/// Whether `op` is a function of its operands alone, with no effect and no identity. Sources
/// are not (a parameter or input is its name; a constant is, and is pure), nor are
/// point-to-point messages; collectives are, but the caller decides whether to merge them.
pub fn is_pure_compute(op: &Op) -> bool {
    match op {
        Op::Parameter { .. } | Op::Input { .. } | Op::Send { .. } | Op::Recv { .. } => false,
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::CollectiveBroadcast { .. } => false,
        Op::Constant { .. }
        | Op::Einsum { .. }
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
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Broadcast { .. }
        | Op::Rotary { .. }
        | Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::MoeRoute { .. }
        | Op::CrossEntropy
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::Fusion { .. } => true,
    }
}

/// The e-graph's analysis: the op table, the mesh (collectives' typing rules need it), and
/// for each class the types of its results (one for a value, several for a multi-result op,
/// none for `send`).
#[derive(Clone, Debug, Default)]
pub struct Types {
    /// Every op of the e-graph.
    pub table: OpTable,
    /// The program's mesh.
    pub mesh: Option<DeviceMesh>,
    /// Own identities handed out so far.
    pub identities: u32,
}

impl Types {
    /// A fresh identity for a node that must not merge.
    pub fn fresh_identity(&mut self) -> u32 {
        self.identities += 1;
        FIRST_OWN_IDENTITY + self.identities
    }
}

/// The e-graph of a rank program.
pub type RankEGraph = EGraph<Term, Types>;

impl Analysis<Term> for Types {
    type Data = Vec<TensorType>;

    fn make(egraph: &mut RankEGraph, enode: &Term, _id: Id) -> Vec<TensorType> {
        match enode {
            Term::Result { index, tuple } => egraph[tuple[0]]
                .data
                .get(*index as usize)
                .cloned()
                .into_iter()
                .collect(),
            Term::Apply { op, operands, .. } => {
                let mut tys = Vec::with_capacity(operands.len());
                for &c in operands {
                    match egraph[c].data.as_slice() {
                        [t] => tys.push(t),
                        // Only values are operands; a term over anything else is never built.
                        _ => return Vec::new(),
                    }
                }
                let op = egraph.analysis.table.get(*op);
                infer(op, &tys, egraph.analysis.mesh.as_ref()).unwrap_or_default()
            }
        }
    }

    fn merge(&mut self, a: &mut Vec<TensorType>, b: Vec<TensorType>) -> DidMerge {
        // Rules only merge classes of equal types (they check before they union).
        debug_assert_eq!(*a, b, "an e-class merged values of different types");
        DidMerge(false, false)
    }
}

/// The single type of a value class, if it is one.
pub fn value_type(egraph: &RankEGraph, class: Id) -> Option<&TensorType> {
    match egraph[class].data.as_slice() {
        [t] => Some(t),
        _ => None,
    }
}
