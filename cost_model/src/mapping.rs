//! Mesh mapping: which physical device each mesh coordinate runs on, and, for a collective
//! over some mesh axes, whether its groups stay inside a node or span nodes and how many of
//! them share each NIC.

use serde::{Deserialize, Serialize};

use autopar_ir::{DeviceMesh, MeshAxis};

use crate::cluster::Cluster;
use crate::error::CostError;

/// Where the groups of a collective over some mesh axes sit in the cluster. All groups of an
/// axis run their collective at the same time (as data-parallel gradient reduction or tensor
/// parallelism do), so the worst group is described.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInfo {
    /// Members per group.
    pub size: usize,
    /// Largest number of nodes one group spans (1: the group stays inside a node).
    pub nodes_spanned: usize,
    /// Largest number of a group's members on one node.
    pub members_per_node: usize,
    /// Fewest distinct NICs a spanning group's members use on one of its nodes (0 when the
    /// group stays inside a node).
    pub nics_per_group: usize,
    /// Largest number of spanning groups whose traffic goes through one NIC.
    pub groups_per_nic: usize,
}

impl GroupInfo {
    /// True when every member of every group is on one node.
    pub fn intra_node(&self) -> bool {
        self.nodes_spanned <= 1
    }

    /// Bandwidth (bytes/s) one group gets across the node boundary: the NICs its members use,
    /// divided among the groups sharing them.
    pub fn inter_node_bandwidth(&self, cluster: &Cluster) -> f64 {
        if self.intra_node() {
            return f64::INFINITY;
        }
        cluster.nic_bus_bandwidth() * self.nics_per_group.max(1) as f64
            / self.groups_per_nic.max(1) as f64
    }
}

/// A device mesh placed on a cluster.
///
/// By default ([`MeshMapping::new`]) the innermost (last) axis lies on consecutive devices,
/// so `[("pp", 4), ("dp", 2), ("tp", 8)]` on DGX nodes keeps each `tp` group in one node.
/// Any order, or an explicit device map, is allowed through [`MeshMapping::from_mesh`].
#[derive(Clone, Debug, PartialEq)]
pub struct MeshMapping {
    mesh: DeviceMesh,
    gpus_per_node: usize,
    /// Cached group descriptions per axis, in mesh-axis order.
    axis_groups: Vec<GroupInfo>,
    nodes: usize,
    nics_per_node: usize,
    nic_of_local: Vec<usize>,
}

impl MeshMapping {
    /// Places axes (outermost first) on consecutive devices of `cluster`.
    pub fn new<S: AsRef<str>>(axes: &[(S, usize)], cluster: &Cluster) -> Result<Self, CostError> {
        let axes: Vec<(String, usize)> = axes
            .iter()
            .map(|(n, s)| (n.as_ref().to_string(), *s))
            .collect();
        let mesh = DeviceMesh::new(axes).map_err(|e| CostError::PlanMismatch(e.to_string()))?;
        Self::from_mesh(mesh, cluster)
    }

    /// Uses the mesh's own device map.
    pub fn from_mesh(mesh: DeviceMesh, cluster: &Cluster) -> Result<Self, CostError> {
        let n = cluster.num_devices();
        if let Some(d) = mesh.devices().iter().find(|&&d| d >= n) {
            return Err(CostError::PlanMismatch(format!(
                "mesh {mesh} needs device {d}, but the cluster has {n} devices"
            )));
        }
        let mut m = MeshMapping {
            mesh,
            gpus_per_node: cluster.gpus_per_node,
            axis_groups: Vec::new(),
            nodes: cluster.nodes,
            nics_per_node: cluster.network.nics_per_node,
            nic_of_local: (0..cluster.gpus_per_node)
                .map(|d| cluster.nic_of(d))
                .collect(),
        };
        let names: Vec<String> = m.mesh.axes().iter().map(|a| a.name.clone()).collect();
        m.axis_groups = names
            .iter()
            .map(|a| m.compute_group(std::slice::from_ref(a)))
            .collect::<Result<_, _>>()?;
        Ok(m)
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The axes, outermost first.
    pub fn axes(&self) -> &[MeshAxis] {
        self.mesh.axes()
    }

    /// Device of a linear mesh coordinate.
    pub fn device(&self, linear: usize) -> usize {
        self.mesh.devices()[linear]
    }

    /// Node of a linear mesh coordinate.
    pub fn node(&self, linear: usize) -> usize {
        self.device(linear) / self.gpus_per_node
    }

    /// The groups of a collective over one axis.
    pub fn axis_group(&self, axis: &str) -> Result<&GroupInfo, CostError> {
        self.mesh
            .axis_index(axis)
            .map(|i| &self.axis_groups[i])
            .ok_or_else(|| CostError::UnknownAxis(axis.to_string()))
    }

    /// The groups of a collective over several axes at once (e.g. `["dp", "cp"]`).
    pub fn group(&self, axes: &[String]) -> Result<GroupInfo, CostError> {
        if let [one] = axes {
            return self.axis_group(one).cloned();
        }
        // An axis of size 1 adds no member to a group: when at most one axis is larger, the
        // cached group of that axis is the answer (building a group walks every device).
        let mut larger = Vec::with_capacity(axes.len());
        for a in axes {
            let i = self
                .mesh
                .axis_index(a)
                .ok_or_else(|| CostError::UnknownAxis(a.clone()))?;
            if self.mesh.axes()[i].size > 1 {
                larger.push(i);
            }
        }
        match larger.as_slice() {
            [] => self.axis_group(&axes[0]).cloned(),
            [i] => Ok(self.axis_groups[*i].clone()),
            _ => self.compute_group(axes),
        }
    }

    fn compute_group(&self, axes: &[String]) -> Result<GroupInfo, CostError> {
        let idx: Vec<usize> = axes
            .iter()
            .map(|a| {
                self.mesh
                    .axis_index(a)
                    .ok_or_else(|| CostError::UnknownAxis(a.clone()))
            })
            .collect::<Result<_, _>>()?;
        let mesh_axes = self.mesh.axes();
        // Row-major strides: the last axis varies fastest.
        let mut strides = vec![1usize; mesh_axes.len()];
        for i in (0..mesh_axes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * mesh_axes[i + 1].size;
        }
        let size: usize = idx.iter().map(|&i| mesh_axes[i].size).product();
        // (node, nic) of every coordinate, laid out group by group: a coordinate's group is
        // its position along the other axes, its rank in the group its position along the
        // group's axes, so no sort over all devices is needed.
        let n = self.mesh.num_devices();
        let mut rows = vec![(0usize, 0usize); n];
        for linear in 0..n {
            let (mut group, mut member) = (0usize, 0usize);
            for (i, axis) in mesh_axes.iter().enumerate() {
                let c = (linear / strides[i]) % axis.size;
                if idx.contains(&i) {
                    member = member * axis.size + c;
                } else {
                    group = group * axis.size + c;
                }
            }
            let d = self.device(linear);
            rows[group * size + member] = (
                d / self.gpus_per_node,
                self.nic_of_local[d % self.gpus_per_node],
            );
        }
        let mut info = GroupInfo {
            size,
            nodes_spanned: 1,
            members_per_node: 0,
            nics_per_group: 0,
            groups_per_nic: 0,
        };
        // How many spanning groups use each (node, NIC).
        let nics = self.nic_of_local.iter().max().map_or(1, |&m| m + 1);
        let mut per_nic = vec![0usize; self.nodes.max(1) * nics];
        let mut min_nics = usize::MAX;
        for group in rows.chunks_mut(size.max(1)) {
            group.sort_unstable();
            let nodes: Vec<&[(usize, usize)]> = group.chunk_by(|a, b| a.0 == b.0).collect();
            info.nodes_spanned = info.nodes_spanned.max(nodes.len());
            for on_node in &nodes {
                info.members_per_node = info.members_per_node.max(on_node.len());
                if nodes.len() > 1 {
                    let mut distinct = 0;
                    for (k, r) in on_node.iter().enumerate() {
                        if k == 0 || on_node[k - 1].1 != r.1 {
                            distinct += 1;
                            per_nic[r.0 * nics + r.1] += 1;
                        }
                    }
                    min_nics = min_nics.min(distinct);
                }
            }
        }
        if info.nodes_spanned > 1 {
            info.nics_per_group = min_nics;
            info.groups_per_nic = per_nic.iter().copied().max().unwrap_or(1).max(1);
        }
        debug_assert!(
            self.nodes >= info.nodes_spanned && self.nics_per_node >= info.nics_per_group
        );
        Ok(info)
    }

    /// True when linear coordinates `a` and `b` are on the same node.
    pub fn same_node(&self, a: usize, b: usize) -> bool {
        self.node(a) == self.node(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster;

    /// The groups of `axes` by sorting every device by (group, node, NIC): slow, plain.
    fn group_by_sorting(m: &MeshMapping, axes: &[&str]) -> GroupInfo {
        let mesh_axes = m.mesh.axes();
        let idx: Vec<usize> = axes.iter().map(|a| m.mesh.axis_index(a).unwrap()).collect();
        let mut strides = vec![1usize; mesh_axes.len()];
        for i in (0..mesh_axes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * mesh_axes[i + 1].size;
        }
        let mut rows: Vec<(usize, usize, usize)> = (0..m.mesh.num_devices())
            .map(|linear| {
                let key = idx.iter().fold(linear, |k, &i| {
                    k - (linear / strides[i]) % mesh_axes[i].size * strides[i]
                });
                let d = m.device(linear);
                (
                    key,
                    d / m.gpus_per_node,
                    m.nic_of_local[d % m.gpus_per_node],
                )
            })
            .collect();
        rows.sort_unstable();
        let mut info = GroupInfo {
            size: idx.iter().map(|&i| mesh_axes[i].size).product(),
            nodes_spanned: 1,
            members_per_node: 0,
            nics_per_group: 0,
            groups_per_nic: 0,
        };
        let (mut spanning, mut min_nics) = (Vec::new(), usize::MAX);
        for group in rows.chunk_by(|a, b| a.0 == b.0) {
            let nodes: Vec<_> = group.chunk_by(|a, b| a.1 == b.1).collect();
            info.nodes_spanned = info.nodes_spanned.max(nodes.len());
            for on_node in &nodes {
                info.members_per_node = info.members_per_node.max(on_node.len());
                if nodes.len() > 1 {
                    let mut nics: Vec<_> = on_node.iter().map(|r| (r.1, r.2)).collect();
                    nics.dedup();
                    min_nics = min_nics.min(nics.len());
                    spanning.extend(nics);
                }
            }
        }
        if info.nodes_spanned > 1 {
            spanning.sort_unstable();
            info.nics_per_group = min_nics;
            info.groups_per_nic = spanning
                .chunk_by(|a, b| a == b)
                .map(<[_]>::len)
                .max()
                .unwrap();
        }
        info
    }

    #[test]
    fn groups_match_a_plain_sort_over_every_device() {
        let mut compared = 0;
        for c in [cluster::dgx_a100(16), cluster::dgx_h100(16)] {
            for axes in [
                vec![("pp", 2), ("dp", 8), ("tp", 8)],
                vec![("tp", 4), ("dp", 4), ("pp", 8)],
                vec![("dp", 16), ("cp", 2), ("tp", 4)],
                vec![("pp", 4), ("ep", 4), ("dp", 2), ("tp", 2), ("cp", 2)],
                vec![("dp", 128)],
                vec![("dp", 3), ("tp", 5)],
            ] {
                let Ok(m) = MeshMapping::new(&axes, &c) else {
                    continue;
                };
                let names: Vec<&str> = axes.iter().map(|a| a.0).collect();
                for i in 0..names.len() {
                    for j in i..names.len() {
                        let set: Vec<&str> = if i == j {
                            vec![names[i]]
                        } else {
                            vec![names[i], names[j]]
                        };
                        let owned: Vec<String> = set.iter().map(|a| a.to_string()).collect();
                        assert_eq!(
                            m.compute_group(&owned).unwrap(),
                            group_by_sorting(&m, &set),
                            "{axes:?} {set:?}"
                        );
                        compared += 1;
                    }
                }
            }
        }
        assert_eq!(compared, 74);
    }

    #[test]
    fn innermost_axis_on_consecutive_devices() {
        let c = cluster::dgx_a100(16);
        let m = MeshMapping::new(&[("pp", 2), ("dp", 8), ("tp", 8)], &c).unwrap();
        let tp = m.axis_group("tp").unwrap();
        assert!(tp.intra_node());
        assert_eq!(tp.members_per_node, 8);
        // Each dp group has one member per node, on its own rail: 8 groups, 8 NICs.
        let dp = m.axis_group("dp").unwrap();
        assert_eq!(dp.nodes_spanned, 8);
        assert_eq!(dp.members_per_node, 1);
        assert_eq!(dp.nics_per_group, 1);
        assert_eq!(dp.groups_per_nic, 1);
        assert_eq!(dp.inter_node_bandwidth(&c), 24e9);
        // Stages are 8 nodes apart.
        assert!(!m.same_node(0, 64));
    }

    #[test]
    fn reordered_axes_span_nodes_and_share_nics() {
        let mut c = cluster::dgx_a100(4);
        // tp outermost: each tp group has one member per node.
        let m = MeshMapping::new(&[("tp", 4), ("dp", 8)], &c).unwrap();
        let tp = m.axis_group("tp").unwrap();
        assert_eq!(tp.nodes_spanned, 4);
        assert_eq!(m.axis_group("dp").unwrap().nodes_spanned, 1);
        // Two NICs per node: four tp groups share each.
        c.network.nics_per_node = 2;
        let m = MeshMapping::new(&[("tp", 4), ("dp", 8)], &c).unwrap();
        let tp = m.axis_group("tp").unwrap();
        assert_eq!(tp.groups_per_nic, 4);
        assert_eq!(tp.inter_node_bandwidth(&c), 6e9);
        // A group of all 16 devices of two nodes uses all 8 NICs of each node.
        let c = cluster::dgx_a100(2);
        let m = MeshMapping::new(&[("dp", 16)], &c).unwrap();
        let g = m.axis_group("dp").unwrap();
        assert_eq!((g.nics_per_group, g.groups_per_nic), (8, 1));
        assert_eq!(g.inter_node_bandwidth(&c), 192e9);
        let both = m.group(&["dp".to_string()]).unwrap();
        assert_eq!(&both, g);
        // Axes of size 1 change nothing, and the shortcut agrees with a full walk.
        let m = MeshMapping::new(&[("dp", 16), ("ep", 1)], &c).unwrap();
        let pair = ["dp".to_string(), "ep".to_string()];
        assert_eq!(m.group(&pair).unwrap(), m.compute_group(&pair).unwrap());
        let m = MeshMapping::new(&[("dp", 1), ("ep", 1), ("tp", 16)], &c).unwrap();
        assert_eq!(m.group(&pair).unwrap(), m.compute_group(&pair).unwrap());
    }

    #[test]
    fn multi_axis_groups_and_errors() {
        let c = cluster::dgx_a100(2);
        let m = MeshMapping::new(&[("dp", 4), ("tp", 4)], &c).unwrap();
        let g = m.group(&["dp".into(), "tp".into()]).unwrap();
        assert_eq!((g.size, g.nodes_spanned, g.members_per_node), (16, 2, 8));
        assert!(m.axis_group("ep").is_err());
        assert!(MeshMapping::new(&[("dp", 32)], &c).is_err());
    }
}
