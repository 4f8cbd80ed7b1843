//! Fewer, larger all-reduces in a rank program: gradient **bucketing** and **batching** of
//! small reductions, one rewrite over partitioned programs (each SPMD rank's program, or each
//! sub-program of a pipeline).
//!
//! - A *gradient reduction* is an all-reduce of the backward (or of gradient accumulation)
//!   that nothing of the forward or the backward waits for: all its users accumulate it or
//!   update the optimizer. Those of one (dtype, axes, reduce kind) are grouped, in the order
//!   the backward produces them, into buckets of at most [`CollectiveOptions::bucket_bytes`]
//!   (PyTorch DDP's `bucket_cap_mb`, 25 MiB by default: [`DEFAULT_BUCKET_MB`]), so that a
//!   bucket can start as soon as its last gradient is ready, while the backward goes on. A
//!   gradient larger than a bucket has one to itself; a bucket size of 0 keeps one reduction
//!   per tensor.
//! - Every other all-reduce of at most [`BATCH_MAX_ELEMENTS`] elements is *batched* with the
//!   others of the same (dtype, axes, reduce kind, phase, micro-batch) that are ready at the
//!   same point, for example the partial squares of the global gradient norm under tensor
//!   parallelism, which then cost one all-reduce.
//!
//! A group of `k > 1` all-reduces becomes one: each operand reshaped to 1-D, the pieces
//! concatenated, one all-reduce, and each result sliced back out and reshaped. Concatenating
//! and slicing are exact and an all-reduce reduces every element on its own, so the program
//! computes the same bits; the new nodes carry the metadata and scope of the group's last
//! member, and the member results keep their value ids (so a pipeline's messages and
//! exports, which name values by id, still hold).
//!
//! Grouping never makes a cycle and never moves a collective before its operands. Members
//! are taken in topological order; a node that depends on a member of an open group closes
//! that group first, so a group's members are independent of one another, and a group that
//! reads another's result closes after it, which orders the groups. The rewritten program
//! is emitted in the original order, a group where its last member was (its users wait for
//! it, its operands are all earlier).
//!
//! Reduce-scatters (the gradient reductions under ZeRO 1, 2 and 3, which shard the optimizer
//! state over the data ranks) are not bucketed: each member of a reduce-scatter keeps its own
//! slice of every tensor, so a bucket would need every tensor laid out scatter dim first and
//! the pieces interleaved member by member, which this pass does not do; they stay one
//! collective per tensor. A pipeline's sub-programs are rewritten one by one, so a bucket
//! never spans two of them.

use std::collections::{BinaryHeap, HashMap};

use autopar_ir::{DType, Graph, IrError, NodeId, Op, Phase, ReduceKind, Shape, ValueId};

use crate::error::PassError;

/// PyTorch DDP's default bucket size, in MiB.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

/// The largest all-reduce (in elements) that is batched with others of its kind: batching
/// saves latency, which only small reductions are dominated by.
pub const BATCH_MAX_ELEMENTS: u64 = 4096;

/// How [`group_collectives`] groups reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveOptions {
    /// The largest bucket of gradient reductions, in bytes of the gradients' dtype; 0 keeps
    /// one reduction per gradient.
    pub bucket_bytes: u64,
    /// Batch small all-reduces that are ready at the same point.
    pub batch: bool,
}

impl CollectiveOptions {
    /// Buckets of `mb` MiB (0: no bucketing), with batching. A negative or non-finite size is
    /// an error naming `--bucket-mb`.
    pub fn with_bucket_mb(mb: f64) -> Result<Self, PassError> {
        if !mb.is_finite() || mb < 0.0 {
            return Err(PassError::BadOption {
                option: "--bucket-mb",
                detail: format!("{mb} is not a bucket size in MiB (0 or more; 0 disables)"),
            });
        }
        let bytes = mb * f64::from(1u32 << 20);
        Ok(CollectiveOptions {
            // Saturates at u64::MAX for absurd sizes: one bucket holds everything.
            bucket_bytes: bytes as u64,
            batch: true,
        })
    }
}

impl Default for CollectiveOptions {
    fn default() -> Self {
        CollectiveOptions {
            bucket_bytes: (DEFAULT_BUCKET_MB * f64::from(1u32 << 20)) as u64,
            batch: true,
        }
    }
}

/// What a rewrite did: the groups it made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CollectiveReport {
    /// Buckets of gradient reductions (of two or more tensors), as member counts.
    pub buckets: Vec<usize>,
    /// Batches of small all-reduces (of two or more), as member counts.
    pub batches: Vec<usize>,
}

/// Which kind of group an all-reduce may join, and with which others.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum GroupKey {
    Bucket {
        dtype: DType,
        axes: Vec<String>,
        reduce: ReduceKind,
    },
    Batch {
        dtype: DType,
        axes: Vec<String>,
        reduce: ReduceKind,
        phase: Option<Phase>,
        micro_batch: Option<u32>,
    },
}

/// A group being filled.
struct OpenGroup {
    key: GroupKey,
    members: Vec<usize>,
    bytes: u64,
    /// The members, as a bit set over candidate indexes.
    bits: Vec<u64>,
}

/// Whether any user of `n`'s results runs in the forward or the backward (so that the
/// program waits for `n` there, and `n` is no gradient reduction).
fn waited_for(g: &Graph, n: NodeId) -> bool {
    g.node(n).outputs.iter().any(|&v| {
        g.users(v).iter().any(|&(u, _)| {
            matches!(
                g.meta(u).phase,
                Some(Phase::Forward | Phase::Saved | Phase::Backward | Phase::Recompute) | None
            )
        })
    })
}

/// The group key of all-reduce node `n`, if it may be grouped at all.
fn key_of(g: &Graph, n: NodeId, options: &CollectiveOptions) -> Option<GroupKey> {
    let node = g.node(n);
    let Op::AllReduce { axes, reduce } = &node.op else {
        return None;
    };
    let ty = g.ty(*node.inputs.first()?);
    if ty.num_elements() == 0 {
        return None;
    }
    let meta = g.meta(n);
    let gradient =
        matches!(meta.phase, Some(Phase::Backward | Phase::Accumulate)) && !waited_for(g, n);
    if gradient {
        return (options.bucket_bytes > 0).then(|| GroupKey::Bucket {
            dtype: ty.dtype,
            axes: axes.clone(),
            reduce: *reduce,
        });
    }
    (options.batch && ty.num_elements() <= BATCH_MAX_ELEMENTS).then(|| GroupKey::Batch {
        dtype: ty.dtype,
        axes: axes.clone(),
        reduce: *reduce,
        phase: meta.phase,
        micro_batch: meta.micro_batch,
    })
}

fn intersects(a: &[u64], b: &[u64]) -> bool {
    a.iter().zip(b).any(|(x, y)| x & y != 0)
}

/// Groups the all-reduces of `g` as the module docs describe, numbering every new value
/// from `first_fresh` on (above every value id the program shares ids with); returns the
/// rewritten program and what was grouped. A program with nothing to group comes back
/// unchanged.
pub fn group_collectives(
    g: &Graph,
    options: &CollectiveOptions,
    first_fresh: u32,
) -> Result<(Graph, CollectiveReport), PassError> {
    let topo = g.topo_order()?;
    // Candidates in topological order, with their keys.
    let candidates: Vec<(NodeId, GroupKey)> = topo
        .iter()
        .filter_map(|&n| key_of(g, n, options).map(|k| (n, k)))
        .collect();
    let index: HashMap<NodeId, usize> = candidates
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (*n, i))
        .collect();
    let words = candidates.len().div_ceil(64);
    // For every node, the candidates it depends on (itself excluded).
    let mut ancestors: HashMap<NodeId, Vec<u64>> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<OpenGroup> = Vec::new();
    for &n in &topo {
        let mut anc = vec![0u64; words];
        for &v in &g.node(n).inputs {
            let p = g.value(v).producer;
            if let Some(a) = ancestors.get(&p) {
                for (w, x) in anc.iter_mut().zip(a) {
                    *w |= x;
                }
            }
            if let Some(&i) = index.get(&p) {
                anc[i / 64] |= 1 << (i % 64);
            }
        }
        if let Some(&i) = index.get(&n) {
            let key = &candidates[i].1;
            // Groups holding something this node depends on are complete.
            let (done, still): (Vec<OpenGroup>, Vec<OpenGroup>) =
                open.drain(..).partition(|o| intersects(&o.bits, &anc));
            groups.extend(done.into_iter().map(|o| o.members));
            open = still;
            let bytes = g.ty(g.node(n).inputs[0]).size_bytes();
            let cap = match key {
                GroupKey::Bucket { .. } => options.bucket_bytes,
                GroupKey::Batch { .. } => u64::MAX,
            };
            // A bucket that this gradient would overflow is complete.
            if let Some(k) = open.iter().position(|o| &o.key == key)
                && open[k].bytes.saturating_add(bytes) > cap
            {
                groups.push(open.remove(k).members);
            }
            let k = match open.iter().position(|o| &o.key == key) {
                Some(k) => k,
                None => {
                    open.push(OpenGroup {
                        key: key.clone(),
                        members: Vec::new(),
                        bytes: 0,
                        bits: vec![0; words],
                    });
                    open.len() - 1
                }
            };
            let o = &mut open[k];
            o.members.push(i);
            o.bytes = o.bytes.saturating_add(bytes);
            o.bits[i / 64] |= 1 << (i % 64);
            if o.bytes >= cap {
                groups.push(open.remove(k).members);
            }
        }
        ancestors.insert(n, anc);
    }
    groups.extend(open.into_iter().map(|o| o.members));
    groups.retain(|m| m.len() > 1);
    let mut report = CollectiveReport::default();
    if groups.is_empty() {
        return Ok((g.clone(), report));
    }
    for m in &groups {
        match candidates[m[0]].1 {
            GroupKey::Bucket { .. } => report.buckets.push(m.len()),
            GroupKey::Batch { .. } => report.batches.push(m.len()),
        }
    }
    let groups: Vec<Vec<NodeId>> = groups
        .into_iter()
        .map(|m| m.into_iter().map(|i| candidates[i].0).collect())
        .collect();
    Ok((emit(g, &topo, &groups, first_fresh)?, report))
}

/// `g` rebuilt in its topological order with every group of `groups` (all-reduce nodes,
/// each group in topological order) emitted as one all-reduce, at the first moment all its
/// operands exist, no earlier than where its last member was.
fn emit(
    g: &Graph,
    topo: &[NodeId],
    groups: &[Vec<NodeId>],
    first_fresh: u32,
) -> Result<Graph, PassError> {
    // Units of emission: a node, or a group. A unit's rank is where it was in `topo`.
    let position: HashMap<NodeId, usize> = topo.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut unit_of: HashMap<NodeId, usize> = HashMap::new();
    let mut units: Vec<Vec<NodeId>> = Vec::new();
    for group in groups {
        for &n in group {
            unit_of.insert(n, units.len());
        }
        units.push(group.clone());
    }
    for &n in topo {
        if let std::collections::hash_map::Entry::Vacant(e) = unit_of.entry(n) {
            e.insert(units.len());
            units.push(vec![n]);
        }
    }
    let rank: Vec<usize> = units
        .iter()
        .map(|u| u.iter().map(|n| position[n]).max().unwrap_or(0))
        .collect();
    // Kahn's algorithm over the units, lowest rank first.
    let mut indegree = vec![0usize; units.len()];
    let mut successors: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
    for (u, members) in units.iter().enumerate() {
        let mut preds: Vec<usize> = members
            .iter()
            .flat_map(|&n| {
                g.node(n)
                    .inputs
                    .iter()
                    .map(|&v| unit_of[&g.value(v).producer])
            })
            .filter(|&p| p != u)
            .collect();
        preds.sort_unstable();
        preds.dedup();
        indegree[u] = preds.len();
        for p in preds {
            successors[p].push(u);
        }
    }
    let mut ready: BinaryHeap<std::cmp::Reverse<(usize, usize)>> = (0..units.len())
        .filter(|&u| indegree[u] == 0)
        .map(|u| std::cmp::Reverse((rank[u], u)))
        .collect();
    let mut out = Graph::new(g.name());
    out.set_mesh(g.mesh().cloned());
    let mut fresh = first_fresh;
    let mut emitted = 0;
    while let Some(std::cmp::Reverse((_, u))) = ready.pop() {
        emitted += 1;
        match units[u].as_slice() {
            [n] => copy(g, &mut out, *n)?,
            members => emit_group(g, &mut out, members, &mut fresh)?,
        }
        for &s in &successors[u] {
            indegree[s] -= 1;
            if indegree[s] == 0 {
                ready.push(std::cmp::Reverse((rank[s], s)));
            }
        }
    }
    if emitted != units.len() {
        return Err(PassError::BadGraph {
            graph: g.name().to_string(),
            detail: "grouping the all-reduces made a cycle (a compiler bug)".into(),
        });
    }
    for (name, v) in g.outputs() {
        out.add_output(name.clone(), *v)?;
    }
    Ok(out)
}

/// Copies node `n` of `g` into `out` with its value ids and their shardings.
fn copy(g: &Graph, out: &mut Graph, n: NodeId) -> Result<(), PassError> {
    let node = g.node(n);
    out.copy_node(g, n, &node.inputs, &node.outputs)?;
    for &v in &node.outputs {
        out.set_sharding(v, g.value(v).sharding.clone())?;
    }
    Ok(())
}

/// Emits the all-reduces `members` (same axes and kind, same operand dtype) as one: reshape
/// each operand to 1-D, concatenate, all-reduce, slice and reshape back into the members'
/// own result ids.
fn emit_group(
    g: &Graph,
    out: &mut Graph,
    members: &[NodeId],
    fresh: &mut u32,
) -> Result<(), PassError> {
    let last = *members
        .last()
        .ok_or_else(|| IrError::Verify("an empty group".into()))?;
    let op = g.node(last).op.clone();
    let scope = g.node(last).scope.clone();
    let meta = g.meta(last);
    let mut add = |out: &mut Graph, op: Op, inputs: &[ValueId], id: Option<ValueId>| {
        let id = id.unwrap_or_else(|| {
            *fresh += 1;
            ValueId(*fresh - 1)
        });
        let n = out.add_node_with_ids(op, inputs, &[id], scope.clone())?;
        out.set_meta(n, meta);
        Ok::<ValueId, PassError>(id)
    };
    let mut flat = Vec::with_capacity(members.len());
    let mut sizes = Vec::with_capacity(members.len());
    for &m in members {
        let x = g.node(m).inputs[0];
        let len = g.ty(x).num_elements() as usize;
        let v = match g.ty(x).dims() {
            [d] if *d == len => x,
            _ => add(
                out,
                Op::Reshape {
                    shape: Shape::from(vec![len]),
                },
                &[x],
                None,
            )?,
        };
        flat.push(v);
        sizes.push(len);
    }
    let joined = add(out, Op::Concat { dim: 0 }, &flat, None)?;
    let reduced = add(out, op, &[joined], None)?;
    let mut start = 0;
    for (&m, &len) in members.iter().zip(&sizes) {
        let result = g.node(m).outputs[0];
        let one_d = matches!(g.ty(result).dims(), [d] if *d == len);
        let slice = Op::Slice {
            dim: 0,
            start,
            end: start + len,
        };
        start += len;
        if one_d {
            add(out, slice, &[reduced], Some(result))?;
        } else {
            let piece = add(out, slice, &[reduced], None)?;
            let shape = Op::Reshape {
                shape: g.ty(result).shape.clone(),
            };
            add(out, shape, &[piece], Some(result))?;
        }
        out.set_sharding(result, g.value(result).sharding.clone())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopar_ir::text::parse;

    fn count_all_reduces(g: &Graph) -> usize {
        g.node_ids()
            .into_iter()
            .filter(|&n| matches!(g.node(n).op, Op::AllReduce { .. }))
            .count()
    }

    fn group(src: &str, options: &CollectiveOptions) -> (Graph, Graph, CollectiveReport) {
        let g = parse(src).expect("the test graph parses");
        let fresh = g.value_ids().map(|v| v.0 + 1).max().unwrap_or(0);
        let (out, report) = group_collectives(&g, options, fresh).expect("the pass runs");
        autopar_ir::verify(&out).expect("the result verifies");
        (g, out, report)
    }

    /// Three gradients (a scalar, a matrix and a vector) reduced over `dp` and used only by
    /// the optimizer, and an activation gradient the backward waits for.
    const GRADIENTS: &str = r#"graph "g" {
  mesh dp=2
  %0: f32[2,3] = parameter {name="a", init=zeros}
  %1: f32[] = reduce_sum %0 {dims=[0,1]} meta{phase=backward, mb=0, layer=block(1)}
  %2: f32[] = all_reduce %1 {axes=["dp"], reduce=sum} meta{phase=backward, mb=0, layer=block(1)}
  %3: f32[2,3] = neg %0 meta{phase=backward, mb=0, layer=block(1)}
  %4: f32[2,3] = all_reduce %3 {axes=["dp"], reduce=sum} meta{phase=backward, mb=0, layer=block(0)}
  %5: f32[2,3] = all_reduce %0 {axes=["dp"], reduce=max} meta{phase=backward, mb=0, layer=block(0)}
  %6: f32[2,3] = exp %5 meta{phase=backward, mb=0, layer=block(0)}
  %7: f32[3] = reduce_sum %6 {dims=[0]} meta{phase=backward, mb=0, layer=embedding}
  %8: f32[3] = all_reduce %7 {axes=["dp"], reduce=sum} meta{phase=backward, mb=0, layer=embedding}
  %9: f32[2,3] = sub %0, %4 meta{phase=optimizer}
  %10: f32[3] = neg %8 meta{phase=optimizer}
  %11: f32[] = neg %2 meta{phase=optimizer}
  output "w" = %9
  output "b" = %10
  output "s" = %11
}"#;

    #[test]
    fn gradients_share_a_bucket_and_keep_their_ids_and_order() {
        let (g, out, report) = group(GRADIENTS, &CollectiveOptions::default());
        // The three sums of gradients become one; the max, which the backward waits for,
        // stays apart.
        assert_eq!(report.buckets, vec![3]);
        assert_eq!(count_all_reduces(&g), 4);
        assert_eq!(count_all_reduces(&out), 2);
        // The results keep their ids and types, the outputs their values.
        for v in [2, 4, 8] {
            assert_eq!(out.ty(ValueId(v)), g.ty(ValueId(v)));
        }
        assert_eq!(out.outputs(), g.outputs());
        // The bucket carries its last gradient's metadata and runs after its operands.
        let order = out.topo_order().expect("acyclic");
        let bucket = order
            .iter()
            .copied()
            .find(|&n| {
                matches!(
                    &out.node(n).op,
                    Op::AllReduce {
                        reduce: ReduceKind::Sum,
                        ..
                    }
                )
            })
            .expect("the bucket");
        assert_eq!(out.meta(bucket).layer, Some(autopar_ir::LayerId::Embedding));
        assert_eq!(out.ty(out.node(bucket).outputs[0]).dims(), &[1 + 6 + 3]);
    }

    #[test]
    fn small_buckets_split_in_backward_order_and_zero_disables() {
        // 4 + 24 + 12 bytes: a 28-byte bucket takes the scalar and the matrix, then the
        // vector is alone.
        let options = CollectiveOptions {
            bucket_bytes: 28,
            batch: false,
        };
        let (_, out, report) = group(GRADIENTS, &options);
        assert_eq!(report.buckets, vec![2]);
        assert_eq!(count_all_reduces(&out), 3);
        // A matrix larger than the bucket gets its own.
        let options = CollectiveOptions {
            bucket_bytes: 8,
            batch: false,
        };
        let (_, out, report) = group(GRADIENTS, &options);
        assert!(report.buckets.is_empty());
        assert_eq!(count_all_reduces(&out), 4);
        let options = CollectiveOptions {
            bucket_bytes: 0,
            batch: false,
        };
        let (g, out, _) = group(GRADIENTS, &options);
        assert!(out.structurally_equal(&g));
    }

    #[test]
    fn dependent_reductions_are_never_merged() {
        // %3 reads %2's result: batching both would make a cycle.
        let src = r#"graph "g" {
  mesh tp=2
  %0: f32[4] = parameter {name="a", init=zeros}
  %1: f32[] = reduce_sum %0 {dims=[0]} meta{phase=optimizer}
  %2: f32[] = all_reduce %1 {axes=["tp"], reduce=sum} meta{phase=optimizer}
  %3: f32[] = all_reduce %2 {axes=["tp"], reduce=sum} meta{phase=optimizer}
  %4: f32[] = reduce_max %0 {dims=[0]} meta{phase=optimizer}
  %5: f32[] = all_reduce %4 {axes=["tp"], reduce=sum} meta{phase=optimizer}
  %6: f32[] = add %3, %5 meta{phase=optimizer}
  output "n" = %6
}"#;
        let (_, out, report) = group(src, &CollectiveOptions::default());
        // %2 and %5 are independent: one batch; %3 waits for %2.
        assert_eq!(report.batches, vec![2]);
        assert_eq!(count_all_reduces(&out), 2);
    }

    #[test]
    fn bad_bucket_sizes_are_named() {
        for mb in [-1.0, f64::NAN, f64::INFINITY] {
            let e = CollectiveOptions::with_bucket_mb(mb).expect_err("refused");
            assert!(e.to_string().contains("--bucket-mb"), "{e}");
        }
        assert_eq!(
            CollectiveOptions::with_bucket_mb(1.0)
                .map(|o| o.bucket_bytes)
                .ok(),
            Some(1 << 20)
        );
    }
}
