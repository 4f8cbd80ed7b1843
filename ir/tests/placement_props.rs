//! Property tests of the placement algebra: local shapes tile the global value, transpose and
//! reshape of a sharding agree with transposing and reshaping the shards, and a planned
//! reshard, simulated on random data with plain slicing and summing, turns source shards into
//! target shards on random meshes of two and three axes.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::ops::Range;

use autopar_ir::reshard::{ReshardStep, StepLowering, group_index, plan_reshard};
use autopar_ir::sharding_algebra::{
    local_region, local_shape, reshape_sharding, transpose_sharding, ways,
};
use autopar_ir::{DType, DeviceMesh, Op, Placement, ReduceKind, Sharding, TensorType};
use proptest::prelude::*;

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn int(&mut self, lo: i64, hi: i64) -> f64 {
        (lo + self.below((hi - lo + 1) as usize) as i64) as f64
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// A dense row-major array of `f64`, enough to simulate shards and collectives.
#[derive(Clone, Debug, PartialEq)]
struct Nd {
    dims: Vec<usize>,
    data: Vec<f64>,
}

fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// Every multi-index of `dims`, row-major.
fn indices(dims: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = dims.iter().product();
    let st = strides(dims);
    (0..n)
        .map(|lin| dims.iter().zip(&st).map(|(&d, &s)| lin / s % d).collect())
        .collect()
}

impl Nd {
    fn random(dims: &[usize], rng: &mut Rng) -> Nd {
        let n = dims.iter().product();
        Nd {
            dims: dims.to_vec(),
            data: (0..n).map(|_| rng.int(-9, 9)).collect(),
        }
    }
    fn get(&self, idx: &[usize]) -> f64 {
        let st = strides(&self.dims);
        self.data[idx.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>()]
    }
    fn region(&self, r: &[Range<usize>]) -> Nd {
        let dims: Vec<usize> = r.iter().map(|r| r.len()).collect();
        let data = indices(&dims)
            .iter()
            .map(|idx| {
                let g: Vec<usize> = idx.iter().zip(r).map(|(i, r)| r.start + i).collect();
                self.get(&g)
            })
            .collect();
        Nd { dims, data }
    }
    fn piece(&self, dim: usize, n: usize, i: usize) -> Nd {
        let len = self.dims[dim] / n;
        let r: Vec<Range<usize>> = self
            .dims
            .iter()
            .enumerate()
            .map(|(d, &s)| {
                if d == dim {
                    i * len..(i + 1) * len
                } else {
                    0..s
                }
            })
            .collect();
        self.region(&r)
    }
    fn concat(parts: &[Nd], dim: usize) -> Nd {
        let mut dims = parts[0].dims.clone();
        dims[dim] = parts.iter().map(|p| p.dims[dim]).sum();
        let data = indices(&dims)
            .iter()
            .map(|idx| {
                let mut idx = idx.clone();
                let mut k = 0;
                while idx[dim] >= parts[k].dims[dim] {
                    idx[dim] -= parts[k].dims[dim];
                    k += 1;
                }
                parts[k].get(&idx)
            })
            .collect();
        Nd { dims, data }
    }
    fn transpose(&self, perm: &[usize]) -> Nd {
        let dims: Vec<usize> = perm.iter().map(|&p| self.dims[p]).collect();
        let data = indices(&dims)
            .iter()
            .map(|idx| {
                let mut src = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    src[p] = idx[i];
                }
                self.get(&src)
            })
            .collect();
        Nd { dims, data }
    }
    fn reshape(&self, dims: &[usize]) -> Nd {
        Nd {
            dims: dims.to_vec(),
            data: self.data.clone(),
        }
    }
    fn zip(&self, other: &Nd, f: impl Fn(f64, f64) -> f64) -> Nd {
        Nd {
            dims: self.dims.clone(),
            data: self
                .data
                .iter()
                .zip(&other.data)
                .map(|(&a, &b)| f(a, b))
                .collect(),
        }
    }
}

fn reduce(k: ReduceKind, parts: &[Nd]) -> Nd {
    let f = match k {
        ReduceKind::Sum => |a: f64, b: f64| a + b,
        ReduceKind::Max => f64::max,
        ReduceKind::Min => f64::min,
    };
    parts[1..]
        .iter()
        .fold(parts[0].clone(), |acc, p| acc.zip(p, f))
}

fn random_mesh(rng: &mut Rng, n_axes: usize, max_size: usize) -> DeviceMesh {
    let names = ["a", "b", "c"];
    DeviceMesh::new((0..n_axes).map(|i| (names[i], 1 + rng.below(max_size)))).unwrap()
}

/// A random sharding of a rank-`rank` value: each axis replicated, sharding a random dim, or
/// partial with `kind`; listed in a random order, replicated axes sometimes left out.
fn random_sharding(rng: &mut Rng, mesh: &DeviceMesh, rank: usize, kind: ReduceKind) -> Sharding {
    let mut axes: Vec<(String, Placement)> = Vec::new();
    for a in mesh.axes() {
        let p = match rng.below(5) {
            0 => Placement::Replicate,
            1 => Placement::Partial(kind),
            _ if rank > 0 => Placement::Shard(rng.below(rank)),
            _ => Placement::Replicate,
        };
        if p != Placement::Replicate || rng.below(2) == 0 {
            axes.push((a.name.clone(), p));
        }
    }
    rng.shuffle(&mut axes);
    Sharding::user(axes)
}

fn coords_of(mesh: &DeviceMesh) -> Vec<Vec<usize>> {
    (0..mesh.num_devices()).map(|i| mesh.coords(i)).collect()
}

/// Groups of devices spanned by `axes`: devices that agree on every other axis, each group in
/// group order.
fn groups(mesh: &DeviceMesh, axes: &[String]) -> Vec<Vec<usize>> {
    let mut by_key: BTreeMap<Vec<usize>, Vec<(usize, usize)>> = BTreeMap::new();
    for (dev, c) in coords_of(mesh).iter().enumerate() {
        let key: Vec<usize> = mesh
            .axes()
            .iter()
            .zip(c)
            .map(|(a, &x)| if axes.contains(&a.name) { 0 } else { x })
            .collect();
        by_key
            .entry(key)
            .or_default()
            .push((group_index(mesh, axes, c).0, dev));
    }
    by_key
        .into_values()
        .map(|mut g| {
            g.sort_unstable();
            g.into_iter().map(|(_, d)| d).collect()
        })
        .collect()
}

/// What every device holds of `global` under `s`, partial axes split into random addends
/// (integers, so sums are exact) or random candidates below/above the value for max/min.
fn distribute(global: &Nd, s: &Sharding, mesh: &DeviceMesh, rng: &mut Rng) -> Vec<Nd> {
    let mut local: Vec<Nd> = coords_of(mesh)
        .iter()
        .map(|c| global.region(&local_region(&global.dims, s, mesh, c).unwrap()))
        .collect();
    let partial: Vec<(String, ReduceKind)> = s
        .axes
        .iter()
        .filter_map(|(a, p)| match p {
            Placement::Partial(k) => Some((a.clone(), *k)),
            _ => None,
        })
        .collect();
    let Some(&(_, kind)) = partial.first() else {
        return local;
    };
    let axes: Vec<String> = partial.into_iter().map(|(a, _)| a).collect();
    for g in groups(mesh, &axes) {
        let holder = g[rng.below(g.len())];
        let mut total = local[holder].zip(&local[holder], |_, _| 0.0);
        for &dev in &g {
            if dev == holder {
                continue;
            }
            let noise: Vec<f64> = (0..local[dev].data.len()).map(|_| rng.int(0, 5)).collect();
            for (i, x) in local[dev].data.iter_mut().enumerate() {
                match kind {
                    ReduceKind::Sum => {
                        *x = noise[i] - 2.0;
                        total.data[i] += *x;
                    }
                    ReduceKind::Max => *x -= noise[i],
                    ReduceKind::Min => *x += noise[i],
                }
            }
        }
        if kind == ReduceKind::Sum {
            let h = &mut local[holder];
            for (x, t) in h.data.iter_mut().zip(&total.data) {
                *x -= t;
            }
        }
    }
    local
}

/// Runs one reshard step on every device: collectives by their definition, local steps by
/// what [`ReshardStep::lower`] says.
fn simulate(step: &ReshardStep, local: &mut [Nd], mesh: &DeviceMesh) {
    let coords = coords_of(mesh);
    for g in groups(mesh, step.axes()) {
        let n = g.len();
        let members: Vec<Nd> = g.iter().map(|&d| local[d].clone()).collect();
        for (i, &dev) in g.iter().enumerate() {
            local[dev] = match step {
                ReshardStep::AllReduce { reduce: k, .. } => reduce(*k, &members),
                ReshardStep::AllGather { dim, .. } => Nd::concat(&members, *dim),
                ReshardStep::ReduceScatter { dim, reduce: k, .. } => {
                    reduce(*k, &members).piece(*dim, n, i)
                }
                ReshardStep::AllToAll {
                    split_dim,
                    concat_dim,
                    ..
                } => {
                    let pieces: Vec<Nd> =
                        members.iter().map(|m| m.piece(*split_dim, n, i)).collect();
                    Nd::concat(&pieces, *concat_dim)
                }
                ReshardStep::LocalSlice { .. } | ReshardStep::MakePartial { .. } => {
                    let ty = TensorType::new(DType::F32, members[i].dims.clone());
                    match step.lower(&ty, mesh, &coords[dev]).unwrap() {
                        StepLowering::Identity => members[i].clone(),
                        StepLowering::Local(Op::Slice { dim, start, end }) => {
                            let r: Vec<Range<usize>> = members[i]
                                .dims
                                .iter()
                                .enumerate()
                                .map(|(d, &s)| if d == dim { start..end } else { 0..s })
                                .collect();
                            members[i].region(&r)
                        }
                        StepLowering::Local(Op::Constant { value, .. }) => {
                            members[i].zip(&members[i], |_, _| value)
                        }
                        other => panic!("unexpected lowering {other:?}"),
                    }
                }
            };
        }
    }
}

/// True when the devices hold `global` sharded as `s` (partial axes reduced first).
fn holds(local: &[Nd], global: &Nd, s: &Sharding, mesh: &DeviceMesh) -> bool {
    let partial: Vec<(String, ReduceKind)> = s
        .axes
        .iter()
        .filter_map(|(a, p)| match p {
            Placement::Partial(k) => Some((a.clone(), *k)),
            _ => None,
        })
        .collect();
    let coords = coords_of(mesh);
    let expect =
        |dev: usize| global.region(&local_region(&global.dims, s, mesh, &coords[dev]).unwrap());
    match partial.first() {
        None => (0..local.len()).all(|d| local[d] == expect(d)),
        Some(&(_, kind)) => {
            let axes: Vec<String> = partial.iter().map(|(a, _)| a.clone()).collect();
            groups(mesh, &axes).iter().all(|g| {
                let parts: Vec<Nd> = g.iter().map(|&d| local[d].clone()).collect();
                reduce(kind, &parts) == expect(g[0])
            })
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn local_shapes_tile_the_global_value(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let n_axes = 1 + rng.below(3);
        let mesh = random_mesh(&mut rng, n_axes, 3);
        let rank = rng.below(4);
        let s = random_sharding(&mut rng, &mesh, rank, ReduceKind::Sum);
        let global: Vec<usize> = (0..rank)
            .map(|d| ways(&s, &mesh, d) * (1 + rng.below(3)))
            .collect();
        let local = local_shape(&global, &s, &mesh).unwrap();
        for d in 0..rank {
            prop_assert_eq!(local[d] * ways(&s, &mesh, d), global[d]);
        }
        // Every element is held by (devices / shards) devices.
        let n_shards: usize = (0..rank).map(|d| ways(&s, &mesh, d)).product();
        let mut count = vec![0usize; global.iter().product()];
        let st = strides(&global);
        for c in coords_of(&mesh) {
            let r = local_region(&global, &s, &mesh, &c).unwrap();
            let dims: Vec<usize> = r.iter().map(|r| r.len()).collect();
            for idx in indices(&dims) {
                let lin: usize = idx.iter().zip(&r).zip(&st).map(|((i, r), s)| (r.start + i) * s).sum();
                count[lin] += 1;
            }
        }
        prop_assert!(count.iter().all(|&c| c == mesh.num_devices() / n_shards));
    }

    #[test]
    fn transposing_a_sharding_transposes_the_shards(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let n_axes = 1 + rng.below(3);
        let mesh = random_mesh(&mut rng, n_axes, 3);
        let rank = 1 + rng.below(4);
        let s = random_sharding(&mut rng, &mesh, rank, ReduceKind::Sum);
        let global: Vec<usize> = (0..rank).map(|d| ways(&s, &mesh, d) * (1 + rng.below(2))).collect();
        let mut perm: Vec<usize> = (0..rank).collect();
        rng.shuffle(&mut perm);
        let t = transpose_sharding(&s, &perm).unwrap();
        let x = Nd::random(&global, &mut rng);
        let y = x.transpose(&perm);
        for c in coords_of(&mesh) {
            let xs = x.region(&local_region(&x.dims, &s, &mesh, &c).unwrap());
            let ys = y.region(&local_region(&y.dims, &t, &mesh, &c).unwrap());
            prop_assert_eq!(xs.transpose(&perm), ys);
        }
    }

    #[test]
    fn reshaping_a_sharding_reshapes_the_shards(seed in any::<u64>()) {
        check_reshape(seed)?;
    }

    #[test]
    fn planned_reshards_turn_source_shards_into_target_shards(seed in any::<u64>()) {
        check_reshard(seed)?;
    }
}

#[test]
fn swapping_the_nesting_of_two_axes() {
    // {a: S(0), b: S(0)} -> {b: S(0), a: S(0)} on 2x2: not a no-op, and the plan is right.
    let mesh = DeviceMesh::new([("a", 2), ("b", 2)]).unwrap();
    let sh = |p: &[(&str, usize)]| {
        Sharding::user(p.iter().map(|&(a, d)| (a.to_string(), Placement::Shard(d))))
    };
    let (from, to) = (sh(&[("a", 0), ("b", 0)]), sh(&[("b", 0), ("a", 0)]));
    let ty = TensorType::new(DType::F32, [8, 2]);
    let plan = plan_reshard(&ty, &from, &to, &mesh).unwrap();
    assert!(!plan.steps.is_empty());
    let mut rng = Rng(7);
    let x = Nd::random(&[8, 2], &mut rng);
    let mut local = distribute(&x, &from, &mesh, &mut rng);
    for step in &plan.steps {
        simulate(step, &mut local, &mesh);
    }
    assert!(holds(&local, &x, &to, &mesh));
}

/// One reshape case; true when a non-trivial sharding survived and was checked.
fn check_reshape(seed: u64) -> Result<bool, TestCaseError> {
    let mut rng = Rng(seed);
    let n_axes = 1 + rng.below(3);
    let mesh = random_mesh(&mut rng, n_axes, 3);
    // Factors grouped two ways give two shapes of one size.
    let factors: Vec<usize> = (0..2 + rng.below(4)).map(|_| 1 + rng.below(4)).collect();
    let group = |rng: &mut Rng| {
        let mut dims = Vec::new();
        let mut acc = 1;
        for (i, &f) in factors.iter().enumerate() {
            acc *= f;
            if i + 1 == factors.len() || rng.below(2) == 0 {
                dims.push(acc);
                acc = 1;
            }
        }
        dims
    };
    let from = group(&mut rng);
    let to = group(&mut rng);
    let s = random_sharding(&mut rng, &mesh, from.len(), ReduceKind::Max);
    if local_shape(&from, &s, &mesh).is_err() {
        return Ok(false);
    }
    let Some(t) = reshape_sharding(&s, &from, &to, &mesh).unwrap() else {
        return Ok(false);
    };
    let local_to = local_shape(&to, &t, &mesh).unwrap();
    let x = Nd::random(&from, &mut rng);
    let y = x.reshape(&to);
    for c in coords_of(&mesh) {
        let xs = x.region(&local_region(&from, &s, &mesh, &c).unwrap());
        let ys = y.region(&local_region(&to, &t, &mesh, &c).unwrap());
        prop_assert_eq!(xs.reshape(&local_to), ys);
    }
    for (axis, p) in &s.axes {
        if !matches!(p, Placement::Shard(_)) {
            prop_assert_eq!(t.get(axis), Some(*p));
        }
    }
    Ok(s.axes
        .iter()
        .any(|(a, p)| matches!(p, Placement::Shard(_)) && mesh.axis_size(a).unwrap_or(1) > 1))
}

/// One reshard case; true when the plan had a communicating step.
fn check_reshard(seed: u64) -> Result<bool, TestCaseError> {
    let mut rng = Rng(seed);
    let n_axes = 2 + rng.below(2);
    let mesh = random_mesh(&mut rng, n_axes, 3);
    let rank = 1 + rng.below(3);
    let kinds = [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min];
    let (k1, k2) = (kinds[rng.below(3)], kinds[rng.below(3)]);
    let from = random_sharding(&mut rng, &mesh, rank, k1);
    let to = random_sharding(&mut rng, &mesh, rank, k2);
    let global: Vec<usize> = (0..rank)
        .map(|d| {
            let mut f = 1;
            for a in mesh.axes() {
                let shards = |s: &Sharding| s.get(&a.name) == Some(Placement::Shard(d));
                if shards(&from) || shards(&to) {
                    f *= a.size;
                }
            }
            f * (1 + rng.below(2))
        })
        .collect();
    let ty = TensorType::new(DType::F32, global.clone());
    let plan = plan_reshard(&ty, &from, &to, &mesh).unwrap();
    let x = Nd::random(&global, &mut rng);
    let mut local = distribute(&x, &from, &mesh, &mut rng);
    prop_assert!(holds(&local, &x, &from, &mesh));
    for step in &plan.steps {
        simulate(step, &mut local, &mesh);
    }
    prop_assert!(
        holds(&local, &x, &to, &mesh),
        "plan {:?} from {} to {}",
        plan.steps,
        from,
        to
    );
    prop_assert!(plan.bytes_sent >= 0.0);
    Ok(plan.steps.iter().any(|s| s.collective().is_some()))
}

#[test]
fn the_properties_are_not_vacuous() {
    let reshaped = (0..400)
        .filter(|&seed| check_reshape(seed).unwrap())
        .count();
    let communicated = (0..400)
        .filter(|&seed| check_reshard(seed).unwrap())
        .count();
    assert!(reshaped > 40, "{reshaped} non-trivial reshapes");
    assert!(communicated > 200, "{communicated} plans with collectives");
}
