//! Communication groups on a device mesh: which ranks take part in a collective over a list
//! of mesh axes, in which order, and which rank a point-to-point shift reaches.
//!
//! A rank is a linear mesh coordinate ([`DeviceMesh::linear`]); the device map of the mesh
//! plays no part here.

use autopar_ir::{DeviceMesh, IrError};

use crate::error::RuntimeError;

/// The members of `rank`'s group over `axes`, in group order.
///
/// The members are the ranks whose coordinates equal `rank`'s on every axis not listed. They
/// are ordered row-major over the listed axes *in the listed order*: the first listed axis
/// varies slowest. So member `i` of the group is the one whose listed coordinates, read as a
/// mixed-radix number (first axis most significant), equal `i`. This is the order in which
/// `all_gather` concatenates, `reduce_scatter` and `all_to_all` hand out slices, and
/// `collective_broadcast` counts its `root`; it matches a value sharded on one dim by
/// several axes, the first listed outermost.
///
/// ```
/// # use autopar_ir::DeviceMesh;
/// # use autopar_runtime::comm::group_members;
/// let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
/// // Rank 3 is (dp=1, tp=1).
/// assert_eq!(group_members(&mesh, 3, &["tp".into()]).unwrap(), vec![2, 3]);
/// assert_eq!(group_members(&mesh, 3, &["dp".into()]).unwrap(), vec![1, 3]);
/// assert_eq!(group_members(&mesh, 3, &["dp".into(), "tp".into()]).unwrap(), vec![0, 1, 2, 3]);
/// // Listing tp first makes tp the slow coordinate.
/// assert_eq!(group_members(&mesh, 3, &["tp".into(), "dp".into()]).unwrap(), vec![0, 2, 1, 3]);
/// ```
pub fn group_members(
    mesh: &DeviceMesh,
    rank: usize,
    axes: &[String],
) -> Result<Vec<usize>, RuntimeError> {
    check_rank(mesh, rank)?;
    let mut listed = Vec::with_capacity(axes.len());
    for (i, a) in axes.iter().enumerate() {
        let idx = axis_index(mesh, a)?;
        if axes[..i].contains(a) {
            return Err(
                IrError::Mesh(format!("mesh axis `{a}` is listed twice in a group")).into(),
            );
        }
        listed.push(idx);
    }
    let size: usize = listed.iter().map(|&i| mesh.axes()[i].size).product();
    let base = mesh.coords(rank);
    let mut members = Vec::with_capacity(size);
    for member in 0..size {
        let mut coords = base.clone();
        let mut rest = member;
        // Peel the mixed-radix digits off from the last listed axis (the fastest).
        for &axis in listed.iter().rev() {
            let n = mesh.axes()[axis].size;
            coords[axis] = rest % n;
            rest /= n;
        }
        members.push(mesh.linear(&coords));
    }
    Ok(members)
}

/// The rank `shift` steps from `rank` along mesh axis `axis`, wrapping around the axis (the
/// peer of `send` and `recv`).
///
/// ```
/// # use autopar_ir::DeviceMesh;
/// # use autopar_runtime::comm::shifted_rank;
/// let mesh = DeviceMesh::new([("pp", 4), ("tp", 2)]).unwrap();
/// assert_eq!(shifted_rank(&mesh, 1, "pp", 1).unwrap(), 3); // (0, 1) -> (1, 1)
/// assert_eq!(shifted_rank(&mesh, 1, "pp", -1).unwrap(), 7); // (0, 1) -> (3, 1)
/// ```
pub fn shifted_rank(
    mesh: &DeviceMesh,
    rank: usize,
    axis: &str,
    shift: i64,
) -> Result<usize, RuntimeError> {
    check_rank(mesh, rank)?;
    let idx = axis_index(mesh, axis)?;
    let mut coords = mesh.coords(rank);
    // Mesh axes are bounded far below i64::MAX, so these conversions are exact.
    let n = mesh.axes()[idx].size as i64;
    coords[idx] = (coords[idx] as i64 + shift).rem_euclid(n) as usize;
    Ok(mesh.linear(&coords))
}

fn axis_index(mesh: &DeviceMesh, axis: &str) -> Result<usize, RuntimeError> {
    mesh.axis_index(axis).ok_or_else(|| {
        IrError::UnknownMeshAxis {
            axis: axis.into(),
            mesh: mesh.to_string(),
        }
        .into()
    })
}

fn check_rank(mesh: &DeviceMesh, rank: usize) -> Result<(), RuntimeError> {
    if rank < mesh.num_devices() {
        Ok(())
    } else {
        Err(RuntimeError::SpmdSetup {
            detail: format!("rank {rank} is outside the mesh `{mesh}`"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn axes(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn groups_partition_the_mesh() -> Result<(), RuntimeError> {
        let mesh = DeviceMesh::parse("a=2,b=3,c=2")?;
        for listed in [
            &["a"][..],
            &["b"],
            &["c"],
            &["a", "c"],
            &["c", "b"],
            &["a", "b", "c"],
        ] {
            let listed = axes(listed);
            for rank in 0..mesh.num_devices() {
                let g = group_members(&mesh, rank, &listed)?;
                assert!(g.contains(&rank));
                // Every member computes the same group.
                for &m in &g {
                    assert_eq!(group_members(&mesh, m, &listed)?, g);
                }
            }
        }
        Ok(())
    }

    #[test]
    fn group_order_follows_the_listed_axes() -> Result<(), RuntimeError> {
        let mesh = DeviceMesh::parse("a=2,b=3,c=2")?;
        // Rank 0 is (0, 0, 0); members over [c, a] vary a fastest.
        assert_eq!(
            group_members(&mesh, 0, &axes(&["c", "a"]))?,
            vec![0, 6, 1, 7]
        );
        assert_eq!(group_members(&mesh, 2, &axes(&["b"]))?, vec![0, 2, 4]);
        Ok(())
    }

    #[test]
    fn bad_groups_are_errors() -> Result<(), RuntimeError> {
        let mesh = DeviceMesh::parse("dp=2")?;
        assert!(group_members(&mesh, 0, &axes(&["tp"])).is_err());
        assert!(group_members(&mesh, 0, &axes(&["dp", "dp"])).is_err());
        assert!(group_members(&mesh, 2, &axes(&["dp"])).is_err());
        assert!(shifted_rank(&mesh, 0, "tp", 1).is_err());
        assert_eq!(shifted_rank(&mesh, 0, "dp", -3)?, 1);
        Ok(())
    }
}
