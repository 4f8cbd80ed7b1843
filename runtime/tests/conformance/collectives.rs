//! The conformance suite of [`Collectives`] implementations, part one: every collective and
//! point-to-point op of the IR, on 1-D, 2-D and 3-D meshes and groups over every axis
//! combination (every group of a 2x2x2 mesh), against the result computed directly from all
//! ranks' operands; uneven sizes; message order; the documented order of a sum; and bitwise
//! reproducibility.
//!
//! Every check is a function of the implementation under test, given as a [`Launcher`] made
//! from [`CommOptions`], and looks only at the ranks the launcher ran in this process (an MPI
//! launcher runs one). `comm_collectives.rs` runs the suite over the in-process communicator
//! (the `conformance!` macro), `comm_mpi.rs` over MPI processes ([`CASES`]).

use std::time::Duration;

use autopar_ir::{DType, DeviceMesh, Op, ReduceKind, TensorType};
use autopar_runtime::comm::{Collectives, communicate};
use autopar_runtime::{CommOptions, Launcher, Precision, RuntimeError, Tensor, eval_op};

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The implementation under test: a launcher of ranks whose communicators have the given
/// options.
pub type Make<'a, L> = &'a dyn Fn(CommOptions) -> L;

/// The result of each rank the launcher ran, by rank, with the [`RuntimeError::OnRank`]
/// context taken off errors.
type PerRank<T> = Vec<(usize, Result<T, RuntimeError>)>;

fn launch<L: Launcher, T: Send>(
    make: Make<'_, L>,
    options: CommOptions,
    mesh: &DeviceMesh,
    body: impl Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync,
) -> PerRank<T> {
    make(options)
        .launch(mesh, body)
        .expect("the launch starts")
        .into_iter()
        .map(|(rank, r)| (rank, r.map_err(|e| e.innermost().clone())))
        .collect()
}

/// Runs `op` on every rank of `mesh` at once, rank `r` with `operands[r]`.
fn run_on_ranks<L: Launcher>(
    make: Make<'_, L>,
    mesh: &DeviceMesh,
    op: &Op,
    operands: &[Tensor],
) -> PerRank<Vec<Tensor>> {
    let options = CommOptions {
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    };
    run_on_ranks_with(make, mesh, op, operands, options)
}

fn run_on_ranks_with<L: Launcher>(
    make: Make<'_, L>,
    mesh: &DeviceMesh,
    op: &Op,
    operands: &[Tensor],
    options: CommOptions,
) -> PerRank<Vec<Tensor>> {
    launch(make, options, mesh, |comm| {
        let x = &operands[comm.rank()];
        communicate(comm, op, &[x])
    })
}

/// The group of `rank`, worked out independently of the library: the ranks that agree with it
/// off `axes`, sorted by their coordinates on `axes` read in the listed order.
pub fn expected_group(mesh: &DeviceMesh, rank: usize, axes: &[String]) -> Vec<usize> {
    let idx: Vec<usize> = axes
        .iter()
        .map(|a| mesh.axis_index(a).expect("axis"))
        .collect();
    let me = mesh.coords(rank);
    let mut members: Vec<(Vec<usize>, usize)> = (0..mesh.num_devices())
        .filter(|&r| {
            let c = mesh.coords(r);
            (0..c.len()).all(|i| idx.contains(&i) || c[i] == me[i])
        })
        .map(|r| {
            let c = mesh.coords(r);
            (idx.iter().map(|&i| c[i]).collect(), r)
        })
        .collect();
    members.sort();
    members.into_iter().map(|(_, r)| r).collect()
}

/// Distinct, reproducible values for rank `rank`, rounded to `dtype`.
fn operand(dtype: DType, dims: &[usize], rank: usize) -> Tensor {
    let ty = TensorType::new(dtype, dims.to_vec());
    let n = ty.num_elements() as usize;
    let values = (0..n)
        .map(|i| {
            let h = (i as u64 * 2654435761 + rank as u64 * 40503 + 17) % 1999;
            (h as f64 - 999.0) / 173.0
        })
        .collect();
    Tensor::from_f64(ty, values).expect("operand")
}

fn concat(dim: usize, xs: &[&Tensor]) -> Tensor {
    eval_op(&Op::Concat { dim }, xs, Precision::Declared)
        .expect("concat")
        .remove(0)
}

fn slice(x: &Tensor, dim: usize, part: usize, parts: usize) -> Tensor {
    let len = x.dims()[dim] / parts;
    let op = Op::Slice {
        dim,
        start: part * len,
        end: (part + 1) * len,
    };
    eval_op(&op, &[x], Precision::Declared)
        .expect("slice")
        .remove(0)
}

/// Element-wise reduction of the members' operands, in `f64`, rounded once.
fn reduce(kind: ReduceKind, xs: &[&Tensor]) -> Tensor {
    let mut acc = xs[0].to_f64_vec();
    for x in &xs[1..] {
        for (a, b) in acc.iter_mut().zip(x.to_f64_vec()) {
            *a = match kind {
                ReduceKind::Sum => *a + b,
                ReduceKind::Max => a.max(b),
                ReduceKind::Min => a.min(b),
            };
        }
    }
    Tensor::from_f64(xs[0].ty().clone(), acc).expect("reduction")
}

/// The single-device result of `op` on rank `rank`, from every rank's operand.
fn expected(mesh: &DeviceMesh, op: &Op, operands: &[Tensor], rank: usize) -> Tensor {
    let axes = match op {
        Op::AllReduce { axes, .. }
        | Op::AllGather { axes, .. }
        | Op::ReduceScatter { axes, .. }
        | Op::AllToAll { axes, .. }
        | Op::CollectiveBroadcast { axes, .. } => axes,
        other => panic!("not a collective: {other}"),
    };
    let group = expected_group(mesh, rank, axes);
    let pos = group.iter().position(|&r| r == rank).expect("member");
    let xs: Vec<&Tensor> = group.iter().map(|&r| &operands[r]).collect();
    let n = group.len();
    match op {
        Op::AllReduce { reduce: kind, .. } => reduce(*kind, &xs),
        Op::AllGather { dim, .. } => concat(*dim, &xs),
        Op::ReduceScatter {
            dim, reduce: kind, ..
        } => slice(&reduce(*kind, &xs), *dim, pos, n),
        Op::AllToAll {
            split_dim,
            concat_dim,
            ..
        } => {
            let pieces: Vec<Tensor> = xs.iter().map(|x| slice(x, *split_dim, pos, n)).collect();
            concat(*concat_dim, &pieces.iter().collect::<Vec<_>>())
        }
        Op::CollectiveBroadcast { root, .. } => xs[*root].clone(),
        other => panic!("not a collective: {other}"),
    }
}

/// Checks `op` on every rank against the direct computation, bit for bit.
fn check<L: Launcher>(
    make: Make<'_, L>,
    mesh: &DeviceMesh,
    op: &Op,
    operands: &[Tensor],
) -> TestResult {
    let results = run_on_ranks(make, mesh, op, operands);
    for (rank, result) in results {
        let got = result?;
        assert_eq!(got.len(), 1);
        let want = expected(mesh, op, operands, rank);
        assert_eq!(
            got[0], want,
            "{op:?} on mesh {mesh}, rank {rank}: got {:?}, want {:?}",
            got[0], want
        );
    }
    Ok(())
}

fn axes(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Every mesh shape under test, with the axis lists to form groups over.
pub fn mesh_cases() -> Vec<(DeviceMesh, Vec<Vec<String>>)> {
    let mesh = |s: &str| DeviceMesh::parse(s).expect("mesh");
    vec![
        (mesh("x=4"), vec![axes(&["x"])]),
        (mesh("x=3"), vec![axes(&["x"])]),
        (
            mesh("dp=2,tp=2"),
            vec![
                axes(&["dp"]),
                axes(&["tp"]),
                axes(&["dp", "tp"]),
                axes(&["tp", "dp"]),
            ],
        ),
        (
            mesh("a=2,b=2,c=2"),
            vec![
                axes(&["a"]),
                axes(&["b"]),
                axes(&["c"]),
                axes(&["a", "b"]),
                axes(&["b", "c"]),
                axes(&["c", "a"]),
                axes(&["a", "b", "c"]),
                axes(&["c", "b", "a"]),
            ],
        ),
        (mesh("dp=1,tp=2"), vec![axes(&["dp"]), axes(&["dp", "tp"])]),
    ]
}

/// The shape of every operand: dim 0 splits over any group up to 8 (but 3 and 6 too).
const DIMS: [usize; 2] = [24, 4];

fn for_every_group(mut f: impl FnMut(&DeviceMesh, &[String], DType) -> TestResult) -> TestResult {
    for (mesh, groups) in mesh_cases() {
        for group in &groups {
            for dtype in [DType::F32, DType::BF16] {
                f(&mesh, group, dtype)?;
            }
        }
    }
    Ok(())
}

fn operands(mesh: &DeviceMesh, dtype: DType, dims: &[usize]) -> Vec<Tensor> {
    (0..mesh.num_devices())
        .map(|r| operand(dtype, dims, r))
        .collect()
}

pub fn all_reduce_matches_the_direct_reduction<L: Launcher>(make: Make<'_, L>) -> TestResult {
    for_every_group(|mesh, group, dtype| {
        for kind in [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min] {
            let op = Op::AllReduce {
                axes: group.to_vec(),
                reduce: kind,
            };
            check(make, mesh, &op, &operands(mesh, dtype, &DIMS))?;
        }
        // Fewer elements than ranks, and an element count no group size divides.
        let op = Op::AllReduce {
            axes: group.to_vec(),
            reduce: ReduceKind::Sum,
        };
        check(make, mesh, &op, &operands(mesh, dtype, &[]))?;
        check(make, mesh, &op, &operands(mesh, dtype, &[5, 7]))
    })
}

pub fn all_gather_concatenates_in_group_order<L: Launcher>(make: Make<'_, L>) -> TestResult {
    for_every_group(|mesh, group, dtype| {
        for dim in [0, 1] {
            let op = Op::AllGather {
                axes: group.to_vec(),
                dim,
            };
            check(make, mesh, &op, &operands(mesh, dtype, &DIMS))?;
        }
        Ok(())
    })
}

pub fn reduce_scatter_keeps_the_member_slice<L: Launcher>(make: Make<'_, L>) -> TestResult {
    for_every_group(|mesh, group, dtype| {
        for kind in [ReduceKind::Sum, ReduceKind::Max] {
            let op = Op::ReduceScatter {
                axes: group.to_vec(),
                dim: 0,
                reduce: kind,
            };
            check(make, mesh, &op, &operands(mesh, dtype, &DIMS))?;
        }
        // Scatter along the inner dim, where slices are not contiguous.
        let op = Op::ReduceScatter {
            axes: group.to_vec(),
            dim: 1,
            reduce: ReduceKind::Sum,
        };
        check(make, mesh, &op, &operands(mesh, dtype, &[3, 24, 2]))
    })
}

pub fn all_to_all_exchanges_pieces<L: Launcher>(make: Make<'_, L>) -> TestResult {
    for_every_group(|mesh, group, dtype| {
        for (split_dim, concat_dim) in [(0, 1), (0, 0), (1, 0)] {
            let op = Op::AllToAll {
                axes: group.to_vec(),
                split_dim,
                concat_dim,
            };
            let dims = if split_dim == 1 { [4, 24] } else { DIMS };
            check(make, mesh, &op, &operands(mesh, dtype, &dims))?;
        }
        Ok(())
    })
}

pub fn broadcast_copies_the_root_operand_from_every_root<L: Launcher>(
    make: Make<'_, L>,
) -> TestResult {
    for_every_group(|mesh, group, dtype| {
        let n = mesh.group_size(group)?;
        for root in 0..n {
            let op = Op::CollectiveBroadcast {
                axes: group.to_vec(),
                root,
            };
            check(make, mesh, &op, &operands(mesh, dtype, &[3, 5]))?;
        }
        Ok(())
    })
}

pub fn larger_groups_use_the_tree_and_ring_beyond_powers_of_two<L: Launcher>(
    make: Make<'_, L>,
) -> TestResult {
    let mesh = DeviceMesh::parse("x=7")?;
    let group = axes(&["x"]);
    for root in [0, 3, 6] {
        let op = Op::CollectiveBroadcast {
            axes: group.clone(),
            root,
        };
        check(make, &mesh, &op, &operands(&mesh, DType::F32, &[2, 3]))?;
    }
    let op = Op::AllReduce {
        axes: group.clone(),
        reduce: ReduceKind::Sum,
    };
    check(make, &mesh, &op, &operands(&mesh, DType::F32, &[13]))?;
    let op = Op::AllGather {
        axes: group,
        dim: 0,
    };
    check(make, &mesh, &op, &operands(&mesh, DType::BF16, &[2, 2]))
}

pub fn integer_and_bool_reductions<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let ints: Vec<Tensor> = (0..4)
        .map(|r| {
            Tensor::from_i64(
                TensorType::new(DType::I32, [3]),
                vec![i64::from(i32::MAX) - r, r, -r],
            )
        })
        .collect::<Result<_, _>>()?;
    let op = Op::AllReduce {
        axes: axes(&["x"]),
        reduce: ReduceKind::Sum,
    };
    let results = run_on_ranks(make, &mesh, &op, &ints);
    for (_, r) in results {
        // i32 sums wrap, as the reduce kernels' do.
        let sum = (4 * i64::from(i32::MAX) - 6) as i32 as i64;
        assert_eq!(r?[0].ints(), Some(&[sum, 6, -6][..]));
    }
    let bools: Vec<Tensor> = (0..4)
        .map(|r| Tensor::from_bool([2], vec![r == 2, r != 3]))
        .collect::<Result<_, _>>()?;
    let op = Op::AllReduce {
        axes: axes(&["x"]),
        reduce: ReduceKind::Max,
    };
    for (_, r) in run_on_ranks(make, &mesh, &op, &bools) {
        assert_eq!(r?[0].bools(), Some(&[true, true][..]));
    }
    let op = Op::AllReduce {
        axes: axes(&["x"]),
        reduce: ReduceKind::Sum,
    };
    for (_, r) in run_on_ranks(make, &mesh, &op, &bools) {
        assert!(matches!(r, Err(RuntimeError::UnsupportedDType { .. })));
    }
    Ok(())
}

/// Each rank sends one tensor along an axis and receives from the opposite direction.
fn shift<L: Launcher>(
    make: Make<'_, L>,
    mesh: &DeviceMesh,
    axis: &str,
    shift: i64,
    rounds: usize,
) -> TestResult {
    let results = launch(make, CommOptions::default(), mesh, |comm| {
        let rank = comm.rank();
        let send = Op::Send {
            axis: axis.into(),
            shift,
        };
        let ty = TensorType::new(DType::F32, [2, 3]);
        let recv = Op::Recv {
            axis: axis.into(),
            shift: -shift,
            ty,
        };
        // Several messages in flight at once must arrive in order.
        for k in 0..rounds {
            let x = operand(DType::F32, &[2, 3], rank * 10 + k);
            assert!(communicate(comm, &send, &[&x])?.is_empty());
        }
        (0..rounds)
            .map(|_| communicate(comm, &recv, &[]).map(|mut v| v.remove(0)))
            .collect::<Result<Vec<Tensor>, RuntimeError>>()
    });
    let idx = mesh.axis_index(axis).expect("axis");
    let n = mesh.axes()[idx].size as i64;
    for (rank, got) in results {
        let mut c = mesh.coords(rank);
        c[idx] = (c[idx] as i64 - shift).rem_euclid(n) as usize;
        let source = mesh.linear(&c);
        for (k, t) in got?.into_iter().enumerate() {
            assert_eq!(
                t,
                operand(DType::F32, &[2, 3], source * 10 + k),
                "rank {rank}"
            );
        }
    }
    Ok(())
}

pub fn send_and_recv_shift_along_an_axis<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("pp=4,tp=2")?;
    shift(make, &mesh, "pp", 1, 1)?;
    shift(make, &mesh, "pp", -1, 3)?;
    shift(make, &mesh, "pp", 6, 2)?;
    shift(make, &mesh, "tp", 1, 2)?;
    // A shift by a whole turn sends to oneself.
    shift(make, &mesh, "tp", 2, 1)
}

pub fn reductions_are_bitwise_reproducible<L: Launcher>(make: Make<'_, L>) -> TestResult {
    // Values over many magnitudes, so that the order of the additions shows in the bits.
    let mesh = DeviceMesh::parse("x=4")?;
    let ops: Vec<Tensor> = (0..4)
        .map(|r| {
            let values = (0..64)
                .map(|i| {
                    let scale = 10f64.powi((i * 7 + r * 3) % 17 - 8);
                    scale * if (i + r) % 2 == 0 { 1.0 } else { -1.0 } * (1.0 + i as f64 / 3.0)
                })
                .collect();
            Tensor::from_f64(TensorType::new(DType::F32, [64]), values)
        })
        .collect::<Result<_, _>>()?;
    let op = Op::AllReduce {
        axes: axes(&["x"]),
        reduce: ReduceKind::Sum,
    };
    let bits = |t: &Tensor| -> Vec<u64> {
        t.floats()
            .expect("floats")
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    let first: Vec<Tensor> = run_on_ranks(make, &mesh, &op, &ops)
        .into_iter()
        .map(|(_, r)| r_or(r))
        .collect::<Result<_, _>>()?;
    // Every member ends with the same bits...
    for t in first.iter().skip(1) {
        assert_eq!(bits(t), bits(&first[0]));
    }
    // ...and so does every repetition.
    for _ in 0..20 {
        for (i, (_, t)) in run_on_ranks(make, &mesh, &op, &ops).into_iter().enumerate() {
            assert_eq!(bits(&r_or(t)?), bits(&first[i]));
        }
    }
    Ok(())
}

pub fn sums_add_in_the_ring_order<L: Launcher>(make: Make<'_, L>) -> TestResult {
    // The documented order: element `i` of chunk `c` (chunk `c` spans `c * len / n` up to
    // `(c + 1) * len / n`) is summed in `f64` from member `c + 1` around to member `c`.
    // Member `c + 1 + j` holds `[2^60, 1, -2^60, 0.5][j]` there, so the ring's order gives
    // ((2^60 + 1) - 2^60) + 0.5 = 0.5 (the 1 is lost in f64), and every other starting
    // member 0 or 1. An uneven length longer than one reduction block of the f32 path.
    let n = 4;
    let len = 4 * 2048 + 6;
    let mesh = DeviceMesh::parse("x=4")?;
    let big = 2f64.powi(60);
    let pattern = [big, 1.0, -big, 0.5];
    let chunk = |i: usize| (0..n).find(|&c| i < (c + 1) * len / n).unwrap_or(n - 1);
    let ops: Vec<Tensor> = (0..n)
        .map(|r| {
            let values = (0..len)
                .map(|i| pattern[(r + 2 * n - chunk(i) - 1) % n])
                .collect();
            Tensor::from_f64(TensorType::new(DType::F32, [len]), values)
        })
        .collect::<Result<_, _>>()?;
    let op = Op::AllReduce {
        axes: axes(&["x"]),
        reduce: ReduceKind::Sum,
    };
    for (rank, r) in run_on_ranks(make, &mesh, &op, &ops) {
        let t = r_or(r)?;
        let got = t.floats().expect("floats");
        if let Some(i) = got.iter().position(|&x| x != 0.5) {
            panic!(
                "rank {rank}: element {i} (chunk {}) is {}",
                chunk(i),
                got[i]
            );
        }
    }
    Ok(())
}

fn r_or(t: Result<Vec<Tensor>, RuntimeError>) -> Result<Tensor, RuntimeError> {
    t.map(|mut v| v.remove(0))
}

pub fn f64_precision_keeps_unrounded_sums<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=2")?;
    let ty = TensorType::new(DType::BF16, [1]);
    let ops = vec![
        Tensor::from_f64(ty.clone(), vec![1.0])?,
        Tensor::from_f64(ty, vec![2f64.powi(-9)])?,
    ];
    let op = Op::AllReduce {
        axes: axes(&["x"]),
        reduce: ReduceKind::Sum,
    };
    for (precision, want) in [
        (Precision::Declared, 1.0),
        (Precision::F64, 1.0 + 2f64.powi(-9)),
    ] {
        let options = CommOptions {
            precision,
            ..CommOptions::default()
        };
        let got = run_on_ranks_with(make, &mesh, &op, &ops, options)
            .into_iter()
            .map(|(_, r)| Ok(r_or(r)?.floats().map_or(f64::NAN, |v| v[0])))
            .collect::<Result<Vec<f64>, RuntimeError>>()?;
        // (An MPI process that sat this launch out has nothing to check.)
        assert!(got.iter().all(|&x| x == want), "{got:?}");
    }
    Ok(())
}

/// One check of the suite, for the implementation `L`.
#[allow(dead_code)]
pub type Check<L> = fn(Make<'_, L>) -> TestResult;

/// Every check of this suite, by name, for a runner without the test harness.
#[allow(dead_code)]
pub fn cases<L: Launcher>() -> Vec<(&'static str, Check<L>)> {
    vec![
        (
            "all_reduce_matches_the_direct_reduction",
            all_reduce_matches_the_direct_reduction::<L>,
        ),
        (
            "all_gather_concatenates_in_group_order",
            all_gather_concatenates_in_group_order::<L>,
        ),
        (
            "reduce_scatter_keeps_the_member_slice",
            reduce_scatter_keeps_the_member_slice::<L>,
        ),
        (
            "all_to_all_exchanges_pieces",
            all_to_all_exchanges_pieces::<L>,
        ),
        (
            "broadcast_copies_the_root_operand_from_every_root",
            broadcast_copies_the_root_operand_from_every_root::<L>,
        ),
        (
            "larger_groups_use_the_tree_and_ring_beyond_powers_of_two",
            larger_groups_use_the_tree_and_ring_beyond_powers_of_two::<L>,
        ),
        (
            "integer_and_bool_reductions",
            integer_and_bool_reductions::<L>,
        ),
        (
            "send_and_recv_shift_along_an_axis",
            send_and_recv_shift_along_an_axis::<L>,
        ),
        (
            "reductions_are_bitwise_reproducible",
            reductions_are_bitwise_reproducible::<L>,
        ),
        (
            "f64_precision_keeps_unrounded_sums",
            f64_precision_keeps_unrounded_sums::<L>,
        ),
        (
            "sums_add_in_the_ring_order",
            sums_add_in_the_ring_order::<L>,
        ),
    ]
}

/// Instantiates every check of this suite as a test, for the implementation that `$make`
/// (a `Fn(CommOptions) -> impl Launcher`) launches.
#[macro_export]
macro_rules! collectives_conformance {
    ($name:ident, $make:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::collectives::TestResult;

            #[test]
            fn all_reduce_matches_the_direct_reduction() -> TestResult {
                $crate::collectives::all_reduce_matches_the_direct_reduction(&$make)
            }

            #[test]
            fn all_gather_concatenates_in_group_order() -> TestResult {
                $crate::collectives::all_gather_concatenates_in_group_order(&$make)
            }

            #[test]
            fn reduce_scatter_keeps_the_member_slice() -> TestResult {
                $crate::collectives::reduce_scatter_keeps_the_member_slice(&$make)
            }

            #[test]
            fn all_to_all_exchanges_pieces() -> TestResult {
                $crate::collectives::all_to_all_exchanges_pieces(&$make)
            }

            #[test]
            fn broadcast_copies_the_root_operand_from_every_root() -> TestResult {
                $crate::collectives::broadcast_copies_the_root_operand_from_every_root(&$make)
            }

            #[test]
            fn larger_groups_use_the_tree_and_ring_beyond_powers_of_two() -> TestResult {
                $crate::collectives::larger_groups_use_the_tree_and_ring_beyond_powers_of_two(
                    &$make,
                )
            }

            #[test]
            fn integer_and_bool_reductions() -> TestResult {
                $crate::collectives::integer_and_bool_reductions(&$make)
            }

            #[test]
            fn send_and_recv_shift_along_an_axis() -> TestResult {
                $crate::collectives::send_and_recv_shift_along_an_axis(&$make)
            }

            #[test]
            fn reductions_are_bitwise_reproducible() -> TestResult {
                $crate::collectives::reductions_are_bitwise_reproducible(&$make)
            }

            #[test]
            fn f64_precision_keeps_unrounded_sums() -> TestResult {
                $crate::collectives::f64_precision_keeps_unrounded_sums(&$make)
            }

            #[test]
            fn sums_add_in_the_ring_order() -> TestResult {
                $crate::collectives::sums_add_in_the_ring_order(&$make)
            }
        }
    };
}
