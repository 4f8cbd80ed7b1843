//! The rewrite rules, as data: each [`Rule`] looks at one e-node and, when it applies, names
//! a simpler term equal to it. The policy (see `README.md` beside this file): every rule is
//! directional and never rewrites to worse code, and every rule is exact under the reference
//! interpreter's semantics (each op computed in `f64`, its result rounded to its declared
//! dtype), signed zeros and NaNs included.

use std::sync::Arc;

use autopar_ir::{BinaryOp, DType, Op, ReduceOp, UnaryOp};
use egg::{Applier, Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};

use super::lang::{RankEGraph, Term, is_pure_compute, value_type};

/// What a rule rewrites a node to.
#[derive(Clone, Debug, PartialEq)]
pub enum Rewritten {
    /// An existing class.
    Class(Id),
    /// A new node: `op` over these classes.
    Node(Op, Vec<Id>),
}

/// One rewrite rule: looks at the e-node `op(operands)` of a class and names what it equals.
pub trait Rule: Send + Sync {
    /// The rule's name (in egg's reports and the pass's report).
    fn name(&self) -> &'static str;
    /// The simpler term equal to `op(operands)`, when the rule applies.
    fn rewrite(&self, egraph: &RankEGraph, op: &Op, operands: &[Id]) -> Option<Rewritten>;
}

/// Every rule of the pass.
pub fn all_rules() -> Vec<Arc<dyn Rule>> {
    vec![
        Arc::new(CastToSameDtype),
        Arc::new(CastThroughWider),
        Arc::new(MulByOne),
        Arc::new(AddNegativeZero),
        Arc::new(SubPositiveZero),
        Arc::new(DivByOne),
        Arc::new(NegNeg),
        Arc::new(SelectSame),
        Arc::new(TransposePair),
        Arc::new(ReshapeChain),
        Arc::new(BroadcastIdentity),
        Arc::new(ReduceOfBroadcast),
    ]
}

/// The rules as egg rewrites.
pub fn rewrites(rules: &[Arc<dyn Rule>]) -> Vec<Rewrite<Term, super::lang::Types>> {
    rules
        .iter()
        .map(|r| {
            let rule = EggRule(r.clone());
            // A rule has no pattern variables, so `Rewrite::new` cannot refuse it.
            Rewrite::new(r.name(), rule.clone(), rule).unwrap_or_else(|e| {
                unreachable!("rule `{}` has no pattern variables: {e}", r.name())
            })
        })
        .collect()
}

/// A [`Rule`] as egg's searcher and applier: a class matches when one of its nodes is
/// rewritten; applying unions the class with every rewrite of its nodes.
#[derive(Clone)]
struct EggRule(Arc<dyn Rule>);

impl EggRule {
    /// Every rewrite of a pure node of `class`, with the identity (the merge domain) the
    /// rewritten node keeps.
    fn hits(&self, egraph: &RankEGraph, class: Id) -> Vec<(Rewritten, u32)> {
        egraph[class]
            .nodes
            .iter()
            .filter_map(|n| match n {
                Term::Apply {
                    op,
                    identity,
                    operands,
                } if is_pure_compute(egraph.analysis.table.get(*op)) => self
                    .0
                    .rewrite(egraph, egraph.analysis.table.get(*op), operands)
                    .map(|r| (r, *identity)),
                _ => None,
            })
            .collect()
    }
}

impl Searcher<Term, super::lang::Types> for EggRule {
    fn search_eclass_with_limit(
        &self,
        egraph: &RankEGraph,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, Term>> {
        (limit > 0 && !self.hits(egraph, eclass).is_empty()).then(|| SearchMatches {
            eclass,
            substs: vec![Subst::default()],
            ast: None,
        })
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

impl Applier<Term, super::lang::Types> for EggRule {
    fn apply_one(
        &self,
        egraph: &mut RankEGraph,
        eclass: Id,
        _subst: &Subst,
        _ast: Option<&PatternAst<Term>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let mut changed = Vec::new();
        for (hit, identity) in self.hits(egraph, eclass) {
            let target = match hit {
                Rewritten::Class(c) => c,
                Rewritten::Node(op, operands) => {
                    let op = egraph.analysis.table.intern(&op);
                    egraph.add(Term::Apply {
                        op,
                        identity,
                        operands,
                    })
                }
            };
            // A rule that names a value of another type is a bug in the rule; refuse it
            // rather than merge unequal values.
            let (a, b) = (value_type(egraph, eclass), value_type(egraph, target));
            if a.is_some() && a == b && egraph.union(eclass, target) {
                changed.push(eclass);
            }
        }
        changed
    }
}

/// The fill value of a class that holds a constant (a `constant`, or a broadcast or reshape
/// of one).
pub fn constant_value(egraph: &RankEGraph, class: Id) -> Option<f64> {
    fn go(egraph: &RankEGraph, class: Id, depth: usize) -> Option<f64> {
        if depth == 0 {
            return None;
        }
        egraph[class].nodes.iter().find_map(|n| match n {
            Term::Apply { op, operands, .. } => match egraph.analysis.table.get(*op) {
                Op::Constant { value, .. } => Some(*value),
                Op::Broadcast { .. } | Op::Reshape { .. } => go(egraph, operands[0], depth - 1),
                _ => None,
            },
            _ => None,
        })
    }
    go(egraph, class, 8)
}

/// The ops of the nodes of `class` (pure ones), with their operands.
fn nodes_of(egraph: &RankEGraph, class: Id) -> impl Iterator<Item = (&Op, &[Id])> {
    egraph[class].nodes.iter().filter_map(|n| match n {
        Term::Apply { op, operands, .. } if is_pure_compute(egraph.analysis.table.get(*op)) => {
            Some((egraph.analysis.table.get(*op), operands.as_slice()))
        }
        _ => None,
    })
}

fn dtype(egraph: &RankEGraph, class: Id) -> Option<DType> {
    value_type(egraph, class).map(|t| t.dtype)
}

/// Whether every value of `from` is exactly a value of `to`, so that a cast `from -> to`
/// loses nothing (bf16 and f16 into f32, i32 into i64, bool into any type).
pub fn widens(from: DType, to: DType) -> bool {
    matches!(
        (from, to),
        (DType::BF16 | DType::F16, DType::F32)
            | (DType::I32, DType::I64)
            | (
                DType::Bool,
                DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::I64
            )
    )
}

/// `cast(x)` to `x`'s own dtype is `x`.
struct CastToSameDtype;

impl Rule for CastToSameDtype {
    fn name(&self) -> &'static str {
        "cast-to-same-dtype"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        match op {
            Op::Cast { to } if dtype(eg, x[0]) == Some(*to) => Some(Rewritten::Class(x[0])),
            _ => None,
        }
    }
}

/// `cast(cast(x: A, B), C)` with `A -> B` exact is `cast(x, C)` (and `x` when `C` is `A`):
/// widen-then-narrow back is the identity. Narrow-then-widen is not (it rounds), and is left.
struct CastThroughWider;

impl Rule for CastThroughWider {
    fn name(&self) -> &'static str {
        "cast-through-wider"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let Op::Cast { to } = op else { return None };
        nodes_of(eg, x[0]).find_map(|(inner, y)| match inner {
            Op::Cast { to: mid } => {
                let from = dtype(eg, y[0])?;
                widens(from, *mid).then(|| match from == *to {
                    true => Rewritten::Class(y[0]),
                    false => Rewritten::Node(Op::Cast { to: *to }, vec![y[0]]),
                })
            }
            _ => None,
        })
    }
}

/// `x * 1` and `1 * x` are `x`.
struct MulByOne;

impl Rule for MulByOne {
    fn name(&self) -> &'static str {
        "mul-by-one"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        match op {
            Op::Binary {
                func: BinaryOp::Mul,
            } => identity_operand(eg, x, |c| c == 1.0, true),
            _ => None,
        }
    }
}

/// The operand of a binary op that the other operand leaves unchanged: `other` is a constant
/// for which `neutral` holds (`commutes`: on either side, else only on the right).
fn identity_operand(
    eg: &RankEGraph,
    x: &[Id],
    neutral: impl Fn(f64) -> bool,
    commutes: bool,
) -> Option<Rewritten> {
    let is_neutral = |c: Id| constant_value(eg, c).is_some_and(&neutral);
    if is_neutral(x[1]) {
        Some(Rewritten::Class(x[0]))
    } else if commutes && is_neutral(x[0]) {
        Some(Rewritten::Class(x[1]))
    } else {
        None
    }
}

fn is_float(eg: &RankEGraph, c: Id) -> bool {
    dtype(eg, c).is_some_and(DType::is_float)
}

/// `x + 0` is `x` for integers; for floats only `x + (-0.0)` is (`-0.0 + 0.0` is `+0.0`).
struct AddNegativeZero;

impl Rule for AddNegativeZero {
    fn name(&self) -> &'static str {
        "add-zero"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let Op::Binary {
            func: BinaryOp::Add,
        } = op
        else {
            return None;
        };
        let float = is_float(eg, x[0]);
        identity_operand(
            eg,
            x,
            |c| c == 0.0 && (!float || c.is_sign_negative()),
            true,
        )
    }
}

/// `x - 0` is `x` (for floats `x - (+0.0)`: `-0.0 - 0.0` is `-0.0`, but `x - (-0.0)` is
/// `x + 0.0`, which is not).
struct SubPositiveZero;

impl Rule for SubPositiveZero {
    fn name(&self) -> &'static str {
        "sub-zero"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let Op::Binary {
            func: BinaryOp::Sub,
        } = op
        else {
            return None;
        };
        let float = is_float(eg, x[0]);
        identity_operand(
            eg,
            x,
            |c| c == 0.0 && (!float || c.is_sign_positive()),
            false,
        )
    }
}

/// `x / 1` is `x`.
struct DivByOne;

impl Rule for DivByOne {
    fn name(&self) -> &'static str {
        "div-by-one"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        match op {
            Op::Binary {
                func: BinaryOp::Div,
            } => identity_operand(eg, x, |c| c == 1.0, false),
            _ => None,
        }
    }
}

/// `-(-x)` is `x` for floats (for integers the interpreter's wrapping makes it true too,
/// but the rule stays with what IEEE negation guarantees).
struct NegNeg;

impl Rule for NegNeg {
    fn name(&self) -> &'static str {
        "neg-neg"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let neg = |op: &Op| matches!(op, Op::Unary { func: UnaryOp::Neg });
        if !neg(op) || !is_float(eg, x[0]) {
            return None;
        }
        nodes_of(eg, x[0]).find_map(|(inner, y)| neg(inner).then(|| Rewritten::Class(y[0])))
    }
}

/// `select(c, x, x)` is `x`.
struct SelectSame;

impl Rule for SelectSame {
    fn name(&self) -> &'static str {
        "select-same"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        match op {
            Op::Select if eg.find(x[1]) == eg.find(x[2]) => Some(Rewritten::Class(x[1])),
            _ => None,
        }
    }
}

/// `transpose(transpose(x, p), q)` is `transpose(x, p∘q)`, and `x` when that is the
/// identity; `transpose(x, identity)` is `x`.
struct TransposePair;

impl Rule for TransposePair {
    fn name(&self) -> &'static str {
        "transpose-pair"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let Op::Transpose { perm: outer } = op else {
            return None;
        };
        let identity = |p: &[usize]| p.iter().enumerate().all(|(i, &d)| i == d);
        if identity(outer) {
            return Some(Rewritten::Class(x[0]));
        }
        nodes_of(eg, x[0]).find_map(|(inner, y)| match inner {
            Op::Transpose { perm: first } if first.len() == outer.len() => {
                // Result dim i is the inner result's dim outer[i], which is x's dim
                // first[outer[i]].
                let composed: Vec<usize> = outer.iter().map(|&d| first[d]).collect();
                Some(match identity(&composed) {
                    true => Rewritten::Class(y[0]),
                    false => Rewritten::Node(Op::Transpose { perm: composed }, vec![y[0]]),
                })
            }
            _ => None,
        })
    }
}

/// `reshape(reshape(x, s), t)` is `reshape(x, t)`, and `reshape(x, shape(x))` is `x`.
struct ReshapeChain;

impl Rule for ReshapeChain {
    fn name(&self) -> &'static str {
        "reshape-chain"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let Op::Reshape { shape } = op else {
            return None;
        };
        if value_type(eg, x[0]).is_some_and(|t| t.shape == *shape) {
            return Some(Rewritten::Class(x[0]));
        }
        nodes_of(eg, x[0]).find_map(|(inner, y)| match inner {
            Op::Reshape { .. } => Some(
                match value_type(eg, y[0]).is_some_and(|t| t.shape == *shape) {
                    true => Rewritten::Class(y[0]),
                    false => Rewritten::Node(
                        Op::Reshape {
                            shape: shape.clone(),
                        },
                        vec![y[0]],
                    ),
                },
            ),
            _ => None,
        })
    }
}

/// A broadcast that adds no dim and expands none is its operand.
struct BroadcastIdentity;

impl Rule for BroadcastIdentity {
    fn name(&self) -> &'static str {
        "broadcast-identity"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        match op {
            Op::Broadcast { shape, .. }
                if value_type(eg, x[0]).is_some_and(|t| t.shape == *shape) =>
            {
                Some(Rewritten::Class(x[0]))
            }
            _ => None,
        }
    }
}

/// `reduce_max` or `reduce_min` over exactly the dims a broadcast added (expanding none of
/// the operand's) is the broadcast's operand: the maximum of copies of `v` is `v`, NaN and
/// signed zeros included. Sum and mean are left: `0.0 + (-0.0)` is `+0.0`, so neither gives
/// back a negative zero.
struct ReduceOfBroadcast;

impl Rule for ReduceOfBroadcast {
    fn name(&self) -> &'static str {
        "reduce-of-broadcast"
    }
    fn rewrite(&self, eg: &RankEGraph, op: &Op, x: &[Id]) -> Option<Rewritten> {
        let Op::Reduce {
            func: ReduceOp::Max | ReduceOp::Min,
            dims: reduced,
        } = op
        else {
            return None;
        };
        nodes_of(eg, x[0]).find_map(|(inner, y)| match inner {
            Op::Broadcast { shape, dims: kept } => {
                let operand = value_type(eg, y[0])?;
                let added: Vec<usize> = (0..shape.rank()).filter(|d| !kept.contains(d)).collect();
                let expands = kept
                    .iter()
                    .enumerate()
                    .any(|(i, &d)| operand.shape.dims()[i] != shape.dims()[d]);
                (added == *reduced && !expands).then_some(Rewritten::Class(y[0]))
            }
            _ => None,
        })
    }
}
