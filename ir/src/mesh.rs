//! Device meshes: named axes with sizes, and the map from mesh coordinates to physical devices.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::IrError;

/// One named mesh axis, e.g. `tp=8`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    /// Axis name (`dp`, `tp`, `pp`, `cp`, `ep`, or any identifier).
    pub name: String,
    /// Number of devices along the axis (at least 1).
    pub size: usize,
}

/// A logical device mesh: axes outermost first, and the physical device of every coordinate.
///
/// Coordinates are laid out row-major over the axes, so the last axis varies fastest:
/// for `dp=2, tp=4` the devices of `dp=0` are `devices[0..4]`. By default `devices` is the
/// identity (`0..size`), which places the innermost axis on consecutive devices.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceMesh {
    axes: Vec<MeshAxis>,
    devices: Vec<usize>,
}

impl DeviceMesh {
    /// A mesh with the given `(name, size)` axes and the identity device map.
    ///
    /// ```
    /// # use autopar_ir::DeviceMesh;
    /// let mesh = DeviceMesh::new([("dp", 2), ("tp", 4)]).unwrap();
    /// assert_eq!(mesh.num_devices(), 8);
    /// assert_eq!(mesh.to_string(), "dp=2, tp=4");
    /// ```
    pub fn new<S: Into<String>>(
        axes: impl IntoIterator<Item = (S, usize)>,
    ) -> Result<Self, IrError> {
        let axes: Vec<MeshAxis> = axes
            .into_iter()
            .map(|(name, size)| MeshAxis {
                name: name.into(),
                size,
            })
            .collect();
        let n = num_coords(&axes)?;
        Self::with_devices(axes, (0..n).collect())
    }

    /// A mesh with an explicit device map (`devices[linear coordinate] = device id`).
    pub fn with_devices(axes: Vec<MeshAxis>, devices: Vec<usize>) -> Result<Self, IrError> {
        for (i, a) in axes.iter().enumerate() {
            if !is_identifier(&a.name) {
                return Err(IrError::Mesh(format!(
                    "mesh axis name `{}` is not an identifier",
                    a.name
                )));
            }
            if a.size == 0 {
                return Err(IrError::Mesh(format!("mesh axis `{}` has size 0", a.name)));
            }
            if axes[..i].iter().any(|b| b.name == a.name) {
                return Err(IrError::Mesh(format!(
                    "mesh axis `{}` appears twice",
                    a.name
                )));
            }
        }
        let n = num_coords(&axes)?;
        if devices.len() != n {
            return Err(IrError::Mesh(format!(
                "mesh has {n} coordinates but the device map lists {} devices",
                devices.len()
            )));
        }
        let mut seen = devices.clone();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(IrError::Mesh("the device map lists a device twice".into()));
        }
        Ok(DeviceMesh { axes, devices })
    }

    /// Parses `dp=2,tp=4` (spaces allowed after commas).
    pub fn parse(s: &str) -> Result<Self, IrError> {
        let mut axes = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            let Some((name, size)) = part.split_once('=') else {
                return Err(IrError::Mesh(format!(
                    "mesh axis `{part}` is not of the form name=size"
                )));
            };
            let size: usize = size.trim().parse().map_err(|_| {
                IrError::Mesh(format!(
                    "mesh axis `{}` has a bad size `{}`",
                    name.trim(),
                    size.trim()
                ))
            })?;
            axes.push((name.trim().to_string(), size));
        }
        Self::new(axes)
    }

    /// The axes, outermost first.
    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }

    /// The device map, indexed by linear coordinate.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// Total number of devices.
    pub fn num_devices(&self) -> usize {
        self.devices.len()
    }

    /// Size of the named axis, if the mesh has it.
    pub fn axis_size(&self, name: &str) -> Option<usize> {
        self.axes.iter().find(|a| a.name == name).map(|a| a.size)
    }

    /// Position of the named axis, if the mesh has it.
    pub fn axis_index(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|a| a.name == name)
    }

    /// Product of the sizes of the given axes; an unknown axis is an error.
    pub fn group_size(&self, axes: &[String]) -> Result<usize, IrError> {
        axes.iter().try_fold(1usize, |acc, a| {
            self.axis_size(a)
                .map(|s| acc * s)
                .ok_or_else(|| IrError::UnknownMeshAxis {
                    axis: a.clone(),
                    mesh: self.to_string(),
                })
        })
    }

    /// True when the identity device map is in use (the text format omits it then).
    pub fn has_identity_devices(&self) -> bool {
        self.devices.iter().enumerate().all(|(i, &d)| i == d)
    }

    /// Mesh coordinates of a linear index (row-major, last axis fastest).
    pub fn coords(&self, mut linear: usize) -> Vec<usize> {
        let mut c = vec![0; self.axes.len()];
        for (i, a) in self.axes.iter().enumerate().rev() {
            c[i] = linear % a.size;
            linear /= a.size;
        }
        c
    }

    /// Linear index of mesh coordinates (inverse of [`DeviceMesh::coords`]).
    pub fn linear(&self, coords: &[usize]) -> usize {
        self.axes
            .iter()
            .zip(coords)
            .fold(0, |acc, (a, &c)| acc * a.size + c)
    }
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}={}", a.name, a.size)?;
        }
        Ok(())
    }
}

/// The most devices a mesh may have (a sanity bound far above any real cluster).
pub const MAX_DEVICES: usize = 1 << 24;

/// Number of coordinates of a mesh with these axes, bounded by [`MAX_DEVICES`].
fn num_coords(axes: &[MeshAxis]) -> Result<usize, IrError> {
    axes.iter()
        .try_fold(1usize, |acc, a| {
            acc.checked_mul(a.size).filter(|&n| n <= MAX_DEVICES)
        })
        .ok_or_else(|| IrError::Mesh(format!("more than {MAX_DEVICES} devices")))
}

/// True for `[A-Za-z_][A-Za-z0-9_]*`, the form of mesh axis names.
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_round_trip() {
        let m = DeviceMesh::parse("dp=2, pp=3,tp=4").unwrap();
        assert_eq!(m.num_devices(), 24);
        for i in 0..24 {
            assert_eq!(m.linear(&m.coords(i)), i);
        }
        assert_eq!(m.coords(5), vec![0, 1, 1]);
    }

    #[test]
    fn bad_meshes_are_rejected() {
        assert!(DeviceMesh::parse("dp=0").is_err());
        assert!(DeviceMesh::parse("dp=2,dp=2").is_err());
        assert!(DeviceMesh::parse("dp").is_err());
        assert!(DeviceMesh::parse("1x=2").is_err());
        assert!(DeviceMesh::parse("a=65536,b=65536,c=65536,d=65536").is_err());
        let axes = vec![MeshAxis {
            name: "a".into(),
            size: 2,
        }];
        assert!(DeviceMesh::with_devices(axes.clone(), vec![1, 1]).is_err());
        assert!(DeviceMesh::with_devices(axes, vec![3, 1]).is_ok());
    }
}
