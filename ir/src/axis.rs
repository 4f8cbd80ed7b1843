//! The registry of the mesh axes the compiler gives a meaning to: one enum, one spelling per
//! axis, so that passes, the cost model, the runtime and the command line never disagree on
//! what `tp` is called. A mesh may carry axes of any other name; those are just names.

use std::fmt;
use std::str::FromStr;

/// A mesh axis with a meaning to the compiler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Data parallelism: the batch split; gradients reduced (and ZeRO state sharded) over it.
    Data,
    /// Tensor parallelism: weights split Megatron-style (and sequence shards with `--sp`).
    Tensor,
    /// Pipeline parallelism: layers cut into stages.
    Pipeline,
    /// Context parallelism: the sequence split, attention by ring exchange.
    Context,
    /// Expert parallelism: MoE experts split, tokens moved by all-to-all.
    Expert,
}

impl Axis {
    /// Every registered axis, in the order plans print them.
    pub const ALL: [Axis; 5] = [
        Axis::Data,
        Axis::Tensor,
        Axis::Pipeline,
        Axis::Context,
        Axis::Expert,
    ];

    /// The axis's name in meshes, plans, annotations and collectives (`dp`, `tp`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Axis::Data => DP,
            Axis::Tensor => TP,
            Axis::Pipeline => PP,
            Axis::Context => CP,
            Axis::Expert => EP,
        }
    }

    /// The registered axis called `name`, if any.
    pub fn from_name(name: &str) -> Option<Axis> {
        Axis::ALL.into_iter().find(|a| a.name() == name)
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Axis {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Axis::from_name(s).ok_or_else(|| {
            let names: Vec<&str> = Axis::ALL.iter().map(|a| a.name()).collect();
            format!(
                "unknown mesh axis `{s}` (expected one of {})",
                names.join(", ")
            )
        })
    }
}

/// The data-parallel axis's name.
pub const DP: &str = "dp";
/// The tensor-parallel axis's name.
pub const TP: &str = "tp";
/// The pipeline axis's name.
pub const PP: &str = "pp";
/// The context-parallel axis's name.
pub const CP: &str = "cp";
/// The expert-parallel axis's name.
pub const EP: &str = "ep";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in Axis::ALL {
            assert_eq!(a.name().parse::<Axis>(), Ok(a));
            assert_eq!(a.to_string(), a.name());
        }
        let err = "xp".parse::<Axis>().unwrap_err();
        assert!(
            err.contains("`xp`") && err.contains("dp, tp, pp, cp, ep"),
            "{err}"
        );
    }
}
