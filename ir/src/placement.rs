//! Placements: how a value is laid out over the axes of a device mesh.
//!
//! The vocabulary is that of DTensor and OneFlow's SBP: along each mesh axis a value is
//! replicated, sharded on one tensor dim, or a partial sum awaiting reduction. A
//! [`Sharding`] lists one entry per mesh axis it constrains; several axes may shard the
//! same tensor dim, and then they split it in the order they are listed (the first one
//! outermost). Axes that a sharding does not mention are unconstrained.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The reduction a partial value awaits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceKind {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceKind {
    /// Name in the text format.
    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "sum",
            ReduceKind::Max => "max",
            ReduceKind::Min => "min",
        }
    }

    /// Inverse of [`ReduceKind::name`].
    pub fn from_name(s: &str) -> Option<Self> {
        [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min]
            .into_iter()
            .find(|k| k.name() == s)
    }
}

/// Layout of a value along one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Every device along the axis holds the whole value. Text: `R`.
    Replicate,
    /// The value is split evenly on the given tensor dim. Text: `S(1)`.
    Shard(usize),
    /// Every device holds a partial value; the global value is their reduction. Text: `P(sum)`.
    Partial(ReduceKind),
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => f.write_str("R"),
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::Partial(k) => write!(f, "P({})", k.name()),
        }
    }
}

/// Whether a sharding was written by the user or derived by the compiler.
///
/// User annotations are constraints: propagation never overwrites them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardingOrigin {
    /// Written in model code, an `.air` file or on the command line.
    User,
    /// Filled in by a pass.
    Inferred,
}

/// Placements of one value over named mesh axes, e.g. `{dp: S(0), tp: R}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Sharding {
    /// `(mesh axis, placement)` pairs; an axis appears at most once.
    pub axes: Vec<(String, Placement)>,
    /// Who decided it.
    pub origin: ShardingOrigin,
}

impl Sharding {
    /// A user annotation.
    pub fn user(axes: impl IntoIterator<Item = (String, Placement)>) -> Self {
        Sharding {
            axes: axes.into_iter().collect(),
            origin: ShardingOrigin::User,
        }
    }

    /// The placement along `axis`, if this sharding constrains it.
    pub fn get(&self, axis: &str) -> Option<Placement> {
        self.axes.iter().find(|(a, _)| a == axis).map(|&(_, p)| p)
    }

    /// The mesh axes that shard tensor dim `dim`, in splitting order.
    pub fn axes_sharding_dim(&self, dim: usize) -> impl Iterator<Item = &str> {
        self.axes
            .iter()
            .filter(move |(_, p)| *p == Placement::Shard(dim))
            .map(|(a, _)| a.as_str())
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (a, p)) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{a}: {p}")?;
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display() {
        let s = Sharding::user([
            ("dp".to_string(), Placement::Shard(0)),
            ("tp".to_string(), Placement::Partial(ReduceKind::Sum)),
            ("pp".to_string(), Placement::Replicate),
        ]);
        assert_eq!(s.to_string(), "{dp: S(0), tp: P(sum), pp: R}");
        assert_eq!(s.get("tp"), Some(Placement::Partial(ReduceKind::Sum)));
        assert_eq!(s.get("cp"), None);
        assert_eq!(s.axes_sharding_dim(0).collect::<Vec<_>>(), vec!["dp"]);
    }
}
