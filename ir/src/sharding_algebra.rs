//! Pure algebra of shardings: the local shape and region a device holds, and how a sharding
//! passes through `transpose` and `reshape`.
//!
//! Conventions shared with the verifier: a mesh axis that the mesh does not have counts as
//! size 1, and so does an axis of size 1; such axes never change what a device holds. When
//! several axes shard one dim they split it in the order the sharding lists them, the first
//! outermost, so the shard a device holds on that dim is numbered row-major over those axes'
//! coordinates. A `Partial` axis does not change the shape: every device holds an addend (or a
//! candidate for the max/min) of the same region.
//!
//! Reshard planning, which builds on these functions, lives in [`crate::reshard`].

use std::ops::Range;

use crate::error::IrError;
use crate::mesh::DeviceMesh;
use crate::placement::{Placement, Sharding};
use crate::types::Shape;

/// Size of `axis` in `mesh`, 1 when the mesh lacks it.
pub fn axis_size_or_one(mesh: &DeviceMesh, axis: &str) -> usize {
    mesh.axis_size(axis).unwrap_or(1)
}

/// Checks that `s` can describe a value of shape `global` on `mesh`: each axis listed once,
/// shard dims in range, and every sharded dim split evenly.
///
/// ```
/// # use autopar_ir::{DeviceMesh, Placement, Sharding, sharding_algebra::check_sharding};
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
/// let s = Sharding::user([("dp".into(), Placement::Shard(0)), ("tp".into(), Placement::Shard(0))]);
/// assert!(check_sharding(&[8, 3], &s, &mesh).is_ok());
/// // 6 rows split 2 ways over dp, then the 3 rows of each half 4 ways over tp: uneven.
/// let err = check_sharding(&[6, 3], &s, &mesh).unwrap_err();
/// assert!(err.to_string().contains("dim 0") && err.to_string().contains("`tp`"));
/// ```
pub fn check_sharding(global: &[usize], s: &Sharding, mesh: &DeviceMesh) -> Result<(), IrError> {
    let invalid = |detail: String| IrError::InvalidSharding {
        sharding: s.to_string(),
        ty: Shape::new(global).to_string(),
        detail,
    };
    for (i, (axis, p)) in s.axes.iter().enumerate() {
        if s.axes[..i].iter().any(|(a, _)| a == axis) {
            return Err(invalid(format!("mesh axis `{axis}` is listed twice")));
        }
        if let Placement::Shard(d) = p
            && *d >= global.len()
        {
            return Err(invalid(format!(
                "mesh axis `{axis}` shards dim {d}, but the rank is {}",
                global.len()
            )));
        }
    }
    for (d, &size) in global.iter().enumerate() {
        let mut ways = 1usize;
        for axis in s.axes_sharding_dim(d) {
            ways = ways.saturating_mul(axis_size_or_one(mesh, axis));
            if !size.is_multiple_of(ways) {
                return Err(IrError::UnevenShard {
                    ty: Shape::new(global).to_string(),
                    dim: d,
                    size,
                    axis: axis.to_string(),
                    ways,
                });
            }
        }
    }
    Ok(())
}

/// The shape each device holds of a value of shape `global` sharded as `s`.
///
/// Dim `d` is divided by the product of the sizes of the axes that shard it; an uneven split is
/// an [`IrError::UnevenShard`] naming the dim and the mesh axis.
///
/// ```
/// # use autopar_ir::{DeviceMesh, Placement, ReduceKind, Sharding, sharding_algebra::local_shape};
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
/// // {dp: S(0), tp: S(1)} on [8, 12]: 8/2 rows, 12/4 columns.
/// let s = Sharding::user([("dp".into(), Placement::Shard(0)), ("tp".into(), Placement::Shard(1))]);
/// assert_eq!(local_shape(&[8, 12], &s, &mesh).unwrap(), vec![4, 3]);
/// // Both axes on dim 0 split it 8 ways; a partial axis keeps the shape.
/// let s = Sharding::user([("dp".into(), Placement::Shard(0)), ("tp".into(), Placement::Shard(0))]);
/// assert_eq!(local_shape(&[8, 12], &s, &mesh).unwrap(), vec![1, 12]);
/// let s = Sharding::user([("tp".into(), Placement::Partial(ReduceKind::Sum))]);
/// assert_eq!(local_shape(&[8, 12], &s, &mesh).unwrap(), vec![8, 12]);
/// ```
pub fn local_shape(
    global: &[usize],
    s: &Sharding,
    mesh: &DeviceMesh,
) -> Result<Vec<usize>, IrError> {
    check_sharding(global, s, mesh)?;
    Ok(global
        .iter()
        .enumerate()
        .map(|(d, &size)| size / ways(s, mesh, d))
        .collect())
}

/// Number of pieces dim `d` is split into: the product of the sizes of the axes sharding it.
pub fn ways(s: &Sharding, mesh: &DeviceMesh, d: usize) -> usize {
    s.axes_sharding_dim(d)
        .map(|a| axis_size_or_one(mesh, a))
        .fold(1usize, usize::saturating_mul)
}

/// Which piece of dim `d` the device at mesh coordinates `coords` holds, and how many pieces
/// there are: the index is row-major over the coordinates of the axes sharding `d`, in the
/// order the sharding lists them.
///
/// ```
/// # use autopar_ir::{DeviceMesh, Placement, Sharding, sharding_algebra::shard_index};
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
/// // tp listed first: tp is the outer split of dim 0.
/// let s = Sharding::user([("tp".into(), Placement::Shard(0)), ("dp".into(), Placement::Shard(0))]);
/// // The device at dp=1, tp=2 holds piece 2 * 2 + 1 of 8.
/// assert_eq!(shard_index(&s, &mesh, 0, &[1, 2]), (5, 8));
/// ```
pub fn shard_index(s: &Sharding, mesh: &DeviceMesh, d: usize, coords: &[usize]) -> (usize, usize) {
    s.axes_sharding_dim(d).fold((0, 1), |(index, count), axis| {
        let size = axis_size_or_one(mesh, axis);
        let c = mesh
            .axis_index(axis)
            .and_then(|i| coords.get(i).copied())
            .unwrap_or(0);
        (index * size + c, count * size)
    })
}

/// The index ranges of the global value that the device at `coords` holds (one range per dim).
///
/// ```
/// # use autopar_ir::{DeviceMesh, Placement, Sharding, sharding_algebra::local_region};
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
/// let s = Sharding::user([("dp".into(), Placement::Shard(0)), ("tp".into(), Placement::Shard(1))]);
/// assert_eq!(local_region(&[8, 12], &s, &mesh, &[1, 3]).unwrap(), vec![4..8, 9..12]);
/// ```
pub fn local_region(
    global: &[usize],
    s: &Sharding,
    mesh: &DeviceMesh,
    coords: &[usize],
) -> Result<Vec<Range<usize>>, IrError> {
    let local = local_shape(global, s, mesh)?;
    Ok(local
        .iter()
        .enumerate()
        .map(|(d, &len)| {
            let (index, _) = shard_index(s, mesh, d, coords);
            index * len..(index + 1) * len
        })
        .collect())
}

/// The sharding of `transpose(x, perm)` when `x` is sharded as `s`: result dim `i` is operand
/// dim `perm[i]`, so `Shard(perm[i])` becomes `Shard(i)`; other placements and the order of
/// the axes are kept. Transposing never needs communication.
///
/// ```
/// # use autopar_ir::{Placement, Sharding, sharding_algebra::transpose_sharding};
/// let s = Sharding::user([("dp".into(), Placement::Shard(0)), ("tp".into(), Placement::Shard(2))]);
/// // [b, s, h] -> [h, b, s]
/// let t = transpose_sharding(&s, &[2, 0, 1]).unwrap();
/// assert_eq!(t.to_string(), "{dp: S(1), tp: S(0)}");
/// ```
pub fn transpose_sharding(s: &Sharding, perm: &[usize]) -> Result<Sharding, IrError> {
    let mut inverse = vec![usize::MAX; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        match inverse.get_mut(p) {
            Some(slot) if *slot == usize::MAX => *slot = i,
            _ => {
                return Err(IrError::InvalidSharding {
                    sharding: s.to_string(),
                    ty: format!("rank {}", perm.len()),
                    detail: format!("{perm:?} is not a permutation"),
                });
            }
        }
    }
    let mut out = s.clone();
    for (axis, p) in &mut out.axes {
        if let Placement::Shard(d) = p {
            *d = *inverse.get(*d).ok_or_else(|| IrError::InvalidSharding {
                sharding: s.to_string(),
                ty: format!("rank {}", perm.len()),
                detail: format!("mesh axis `{axis}` shards dim {d}, out of range"),
            })?;
        }
    }
    Ok(out)
}

/// Pairs up the dims of two shapes with the same number of elements into minimal groups of
/// equal size: `[2, 3, 4] -> [6, 2, 2]` gives `(0..2, 0..1)` and `(2..3, 1..3)`. Size-1 dims
/// join the group before them (or the first group). `None` when the sizes differ, or when a
/// dim of size 0 makes the grouping ambiguous.
pub fn reshape_groups(from: &[usize], to: &[usize]) -> Option<Vec<(Range<usize>, Range<usize>)>> {
    if from.contains(&0) || to.contains(&0) {
        return None;
    }
    let (mut i, mut j) = (0, 0);
    let mut groups: Vec<(Range<usize>, Range<usize>)> = Vec::new();
    while i < from.len() || j < to.len() {
        let (si, sj) = (i, j);
        let (mut pf, mut pt) = (1u128, 1u128);
        if i < from.len() {
            pf *= from[i] as u128;
            i += 1;
        }
        if j < to.len() {
            pt *= to[j] as u128;
            j += 1;
        }
        while pf != pt {
            if pf < pt && i < from.len() {
                pf *= from[i] as u128;
                i += 1;
            } else if pt < pf && j < to.len() {
                pt *= to[j] as u128;
                j += 1;
            } else {
                return None;
            }
        }
        // Trailing size-1 dims belong to this group rather than opening an empty one.
        while i < from.len() && from[i] == 1 && (j == to.len() || to[j] != 1) {
            i += 1;
        }
        while j < to.len() && to[j] == 1 && (i == from.len() || from[i] != 1) {
            j += 1;
        }
        groups.push((si..i, sj..j));
    }
    Some(groups)
}

/// The sharding of `reshape(x, to)` when `x` of shape `from` is sharded as `s`, if the shards
/// stay shards: `Ok(None)` when they do not (the reshape then needs a reshard first).
///
/// Reshape works on groups of dims whose sizes match ([`reshape_groups`]). Within a group, a
/// device's shard is a contiguous run of the group's row-major elements exactly when every
/// dim before the last sharded one is split all the way down (a sharded dim is the *outer*
/// part of what it merges into). The axes then split the group's elements in a fixed nested
/// order, and they land on the result dims of the group from the outermost on, moving to the
/// next dim only once one is split all the way down. Partial and replicated axes pass through.
///
/// ```
/// # use autopar_ir::{DeviceMesh, Placement, Sharding, sharding_algebra::reshape_sharding};
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
/// let s = |p: &[(&str, usize)]| Sharding::user(p.iter().map(|&(a, d)| (a.into(), Placement::Shard(d))));
/// // Merging [b, s] -> [b*s] keeps a batch sharding (b is the outer part)...
/// let merged = reshape_sharding(&s(&[("dp", 0)]), &[4, 6], &[24], &mesh).unwrap();
/// assert_eq!(merged, Some(s(&[("dp", 0)])));
/// // ...but not a sequence sharding (s is the inner part: each shard would be strided).
/// assert_eq!(reshape_sharding(&s(&[("dp", 1)]), &[4, 6], &[24], &mesh).unwrap(), None);
/// // Splitting heads out of the hidden dim: [b, h*d] -> [b, h, d] with the hidden dim on tp.
/// let split = reshape_sharding(&s(&[("tp", 1)]), &[2, 32], &[2, 4, 8], &mesh).unwrap();
/// assert_eq!(split, Some(s(&[("tp", 1)])));
/// // With 2 heads, 4 tp ranks cannot each hold whole heads.
/// assert_eq!(reshape_sharding(&s(&[("tp", 1)]), &[2, 16], &[2, 2, 8], &mesh).unwrap(), None);
/// // A dim split all the way down lets the next one be split too: [2, 8] -> [16] with dp on
/// // dim 0 (2 ways, whole) and tp on dim 1 becomes dp outer, tp inner on the merged dim.
/// let both = reshape_sharding(&s(&[("tp", 1), ("dp", 0)]), &[2, 8], &[16], &mesh).unwrap();
/// assert_eq!(both, Some(s(&[("dp", 0), ("tp", 0)])));
/// ```
pub fn reshape_sharding(
    s: &Sharding,
    from: &[usize],
    to: &[usize],
    mesh: &DeviceMesh,
) -> Result<Option<Sharding>, IrError> {
    check_sharding(from, s, mesh)?;
    let n_from: u128 = from.iter().map(|&d| d as u128).product();
    let n_to: u128 = to.iter().map(|&d| d as u128).product();
    if n_from != n_to {
        return Err(IrError::InvalidSharding {
            sharding: s.to_string(),
            ty: Shape::new(from).to_string(),
            detail: format!("cannot reshape {} to {}", Shape::new(from), Shape::new(to)),
        });
    }
    let has_shard = s.axes.iter().any(|(_, p)| matches!(p, Placement::Shard(_)));
    if !has_shard {
        return Ok(Some(s.clone()));
    }
    let Some(groups) = reshape_groups(from, to) else {
        return Ok(None);
    };
    // New placement of every sharding axis, and its position in the nested split order (the
    // order the result must list axes that share a dim in).
    let mut placed: Vec<(usize, Placement, (usize, usize))> = Vec::new();
    for (g, (src, dst)) in groups.iter().enumerate() {
        // The group's axes in nested order: source dims outermost first, each in listed order.
        let mut seq: Vec<(usize, usize)> = Vec::new(); // (index into s.axes, axis size)
        let mut last_sharded = None;
        for d in src.clone() {
            for (k, (axis, p)) in s.axes.iter().enumerate() {
                if *p == Placement::Shard(d) {
                    let size = axis_size_or_one(mesh, axis);
                    seq.push((k, size));
                    if size > 1 {
                        last_sharded = Some(d);
                    }
                }
            }
        }
        if let Some(last) = last_sharded
            && (src.start..last).any(|d| ways(s, mesh, d) != from[d])
        {
            return Ok(None);
        }
        let mut e = dst.start;
        let mut rem = to.get(e).copied().unwrap_or(1);
        for (pos, &(k, size)) in seq.iter().enumerate() {
            if size > 1 {
                while rem == 1 && e + 1 < dst.end {
                    e += 1;
                    rem = to[e];
                }
                if !rem.is_multiple_of(size) {
                    return Ok(None);
                }
                rem /= size;
            }
            // A trivial axis on a group with no result dims (a dropped size-1 dim) replicates.
            let p = if dst.is_empty() {
                Placement::Replicate
            } else {
                Placement::Shard(e)
            };
            placed.push((k, p, (g, pos)));
        }
    }
    // Keep every axis in its slot, but order the sharding axes by the nested split order so
    // that axes sharing a result dim are listed outermost first.
    let mut order: Vec<&(usize, Placement, (usize, usize))> = placed.iter().collect();
    order.sort_by_key(|&&(_, _, key)| key);
    let mut slots = order.into_iter();
    let mut out = s.clone();
    for (k, entry) in out.axes.iter_mut().enumerate() {
        if matches!(s.axes[k].1, Placement::Shard(_)) {
            let Some(&(src_k, p, _)) = slots.next() else {
                continue;
            };
            *entry = (s.axes[src_k].0.clone(), p);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(p: &[(&str, usize)]) -> Sharding {
        Sharding::user(p.iter().map(|&(a, d)| (a.to_string(), Placement::Shard(d))))
    }

    #[test]
    fn groups() {
        assert_eq!(
            reshape_groups(&[2, 3, 4], &[6, 2, 2]),
            Some(vec![(0..2, 0..1), (2..3, 1..3)])
        );
        assert_eq!(reshape_groups(&[4, 1], &[4]), Some(vec![(0..2, 0..1)]));
        assert_eq!(reshape_groups(&[1, 4], &[4, 1]), Some(vec![(0..2, 0..2)]));
        assert_eq!(reshape_groups(&[], &[1, 1]), Some(vec![(0..0, 0..2)]));
        assert_eq!(reshape_groups(&[3], &[4]), None);
    }

    #[test]
    fn unknown_axes_count_as_one() {
        let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
        let s = shard(&[("tp", 0), ("dp", 0)]);
        assert_eq!(local_shape(&[6], &s, &mesh).unwrap(), vec![3]);
    }

    #[test]
    fn errors_name_dim_and_axis() {
        let mesh = DeviceMesh::new([("tp", 4)]).unwrap();
        let err = local_shape(&[3, 6], &shard(&[("tp", 1)]), &mesh).unwrap_err();
        assert_eq!(
            err,
            IrError::UnevenShard {
                ty: "[3,6]".into(),
                dim: 1,
                size: 6,
                axis: "tp".into(),
                ways: 4
            }
        );
        assert!(local_shape(&[4], &shard(&[("tp", 1)]), &mesh).is_err());
        let twice = Sharding::user([
            ("tp".to_string(), Placement::Shard(0)),
            ("tp".to_string(), Placement::Replicate),
        ]);
        assert!(local_shape(&[4], &twice, &mesh).is_err());
        assert!(transpose_sharding(&shard(&[("tp", 0)]), &[0, 0]).is_err());
    }

    #[test]
    fn reshape_keeps_axis_slots() {
        let mesh = DeviceMesh::new([("a", 2), ("b", 2), ("c", 2)]).unwrap();
        // b shards dim 1 (inner), a dim 0 fully: merged lists a first, in b's old slot.
        let s = Sharding::user([
            ("b".to_string(), Placement::Shard(1)),
            ("c".to_string(), Placement::Replicate),
            ("a".to_string(), Placement::Shard(0)),
        ]);
        let r = reshape_sharding(&s, &[2, 4, 3], &[8, 3], &mesh)
            .unwrap()
            .unwrap();
        assert_eq!(r.to_string(), "{a: S(0), c: R, b: S(0)}");
        // A dim not fully split before a sharded one: strided shards.
        let s = shard(&[("a", 0), ("b", 1)]);
        assert_eq!(reshape_sharding(&s, &[4, 4], &[16], &mesh).unwrap(), None);
    }
}
