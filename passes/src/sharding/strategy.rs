//! What a sharding strategy is: a placement per operand and per result along one mesh axis,
//! and the kernel each device runs.

use std::fmt;

use autopar_ir::Placement;

/// One way to run an op with its operands and results placed along one mesh axis.
///
/// Running [`Strategy::kernel`] on every device's local operands gives every device its part
/// of the global result, as [`Strategy::results`] describes it: its shard, an addend (or
/// max/min candidate) of a partial value, or the whole value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Strategy {
    /// Placement of each operand, in operand order.
    pub operands: Vec<Placement>,
    /// Placement of each result, in result order.
    pub results: Vec<Placement>,
    /// What each device runs.
    pub kernel: LocalKernel,
}

/// The local computation of a strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LocalKernel {
    /// The op itself, with shape attributes made local ([`crate::sharding::local_op`]).
    Same,
    /// A rewrite into several local ops ([`crate::sharding::lower()`]).
    Lowered(Lowering),
}

/// Local rewrites that strategies need when the op itself, run on shards, would compute
/// something else.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lowering {
    /// `reduce_mean` over a sharded dim: the local mean scaled by `1/shards` is an addend of
    /// the global mean (shards are equal in size), so the result is `Partial(sum)`.
    PartialMean,
    /// `gather` from a table sharded on its rows (vocabulary-parallel embedding): ids are
    /// shifted by the shard's first row, ids outside the shard read row 0 and are masked to
    /// zero, so the result is `Partial(sum)`.
    VocabParallelGather,
    /// `scatter_add` into rows sharded over devices (the gradient of a vocabulary-parallel
    /// embedding): ids are shifted by the shard's first row and updates of ids outside the
    /// shard are zeroed, so each device builds its own rows.
    RowParallelScatterAdd,
    /// `cross_entropy` with logits sharded on the vocabulary (Megatron): local max, all-reduce
    /// max; local sum of `exp(logit - max)`, all-reduce sum; the target's shifted logit picked
    /// on the device that holds it, all-reduce sum; `loss = log(sum) - picked`. The logits are
    /// never gathered.
    VocabParallelCrossEntropy,
    /// `attention` with queries, keys, values (and their positions) sharded on the sequence
    /// (context parallelism): for as many steps as there are shards, the local queries attend
    /// to the key/value block held (masked by the positions), the block is passed one step
    /// around the ring (`send` to the next device, `recv` from the previous), and the blocks'
    /// partial results are merged by online-softmax rescaling. The result is the local
    /// queries' rows.
    RingAttention,
    /// `attention_backward` with every operand sharded on the sequence: a first ring pass
    /// gives every local query row its softmax statistics over all keys (running max and sum
    /// of exponentials), a second one passes each key/value block around the ring together
    /// with its gradient accumulators, to which every device adds its queries' part, and a
    /// last step returns the accumulators to the block's owner. The results are the local rows
    /// of `dq`, `dk` and `dv`.
    RingAttentionBackward,
}

impl fmt::Display for Strategy {
    /// `S(0), R -> P(sum)`, with ` [lowering]` appended when the kernel is a lowering.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |ps: &[Placement]| {
            ps.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(f, "{} -> {}", list(&self.operands), list(&self.results))?;
        match self.kernel {
            LocalKernel::Same => Ok(()),
            LocalKernel::Lowered(l) => write!(f, " [{l:?}]"),
        }
    }
}
