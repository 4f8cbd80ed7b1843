//! The conformance suite of [`Collectives`] implementations, part two: a collective that
//! cannot complete ends in an error, never a hang. A rank that calls another collective or
//! passes another shape, a rank that is stuck, and a rank that leaves early each make the
//! others fail within seconds with an error naming the collective, the group and the ranks.
//!
//! Every check looks only at the ranks the launcher ran in this process (an MPI launcher runs
//! one), and makes the claims about all ranks together only when it saw them all.
//! `comm_failures.rs` runs it over the in-process communicator, `comm_mpi.rs` over MPI.

use std::time::{Duration, Instant};

use autopar_ir::{DType, DeviceMesh, Op, ReduceKind, TensorType};
use autopar_runtime::comm::{Collectives, communicate};
use autopar_runtime::{CommOptions, Launcher, RuntimeError, Tensor};

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

pub fn x_axes() -> Vec<String> {
    vec!["x".into()]
}

pub fn all_reduce() -> Op {
    Op::AllReduce {
        axes: x_axes(),
        reduce: ReduceKind::Sum,
    }
}

pub fn ones(dims: &[usize]) -> Tensor {
    Tensor::full(TensorType::new(DType::F32, dims.to_vec()), 1.0)
}

/// The implementation under test: a launcher of ranks whose communicators have the given
/// options (see `comm_collectives.rs`).
pub type Make<'a, L> = &'a dyn Fn(CommOptions) -> L;

/// Runs `body` on the ranks `make(options)` launches; returns each rank's result by rank
/// (`None` for a rank that did not run in this process), the [`RuntimeError::OnRank`]
/// context taken off errors, and the time the launch took.
pub fn run_ranks<L: Launcher, T: Send>(
    make: Make<'_, L>,
    mesh: &DeviceMesh,
    options: CommOptions,
    body: impl Fn(&mut dyn Collectives) -> Result<T, RuntimeError> + Sync,
) -> (Vec<Option<Result<T, RuntimeError>>>, Duration) {
    let start = Instant::now();
    let ran = make(options).launch(mesh, body).expect("the launch starts");
    let elapsed = start.elapsed();
    let mut results: Vec<Option<Result<T, RuntimeError>>> =
        (0..mesh.num_devices()).map(|_| None).collect();
    for (rank, r) in ran {
        results[rank] = Some(r.map_err(|e| e.innermost().clone()));
    }
    (results, elapsed)
}

/// Whether a launch ran every rank in this process.
fn saw_all<T>(results: &[Option<T>]) -> bool {
    results.iter().all(Option::is_some)
}

pub fn options(timeout: Duration) -> CommOptions {
    CommOptions {
        timeout,
        ..CommOptions::default()
    }
}

pub fn a_mismatched_collective_is_named<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let x = ones(&[8, 2]);
    let (results, elapsed) = run_ranks(make, &mesh, options(Duration::from_secs(60)), |comm| {
        let op = if comm.rank() == 1 {
            Op::AllGather {
                axes: x_axes(),
                dim: 0,
            }
        } else {
            all_reduce()
        };
        communicate(comm, &op, &[&x])
    });
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    let all = saw_all(&results);
    let errors: Vec<(usize, RuntimeError)> = results
        .into_iter()
        .enumerate()
        .filter_map(|(rank, r)| r.map(|r| (rank, r)))
        .map(|(rank, r)| match r {
            Err(e) => (rank, e),
            other => panic!("every rank should fail, got {other:?}"),
        })
        .collect();
    // Rank 1 and its ring successor, rank 2, exchange messages and see the disagreement
    // (unless one of them learns first that the other has failed); the rest learn of it.
    let mut mismatches = 0;
    for (r, e) in errors.iter().map(|(r, e)| (*r, e)) {
        match e {
            RuntimeError::CollectiveMismatch {
                group,
                rank,
                peer,
                ours,
                theirs,
                ..
            } => {
                mismatches += 1;
                assert_eq!(*rank, r);
                assert!([(1, 0), (2, 1)].contains(&(*rank, *peer)), "{e}");
                assert_eq!(group, &vec![0, 1, 2, 3]);
                let calls = format!("{ours} / {theirs}");
                assert!(
                    calls.contains("all_reduce(axes=[\"x\"], sum) on f32[8,2]")
                        && calls.contains("all_gather(axes=[\"x\"], dim=0) on f32[8,2]"),
                    "{calls}"
                );
            }
            RuntimeError::PeerFailed {
                failed_rank,
                reason,
                ..
            } => {
                assert!([1, 2].contains(failed_rank), "{e}");
                assert!(reason.contains("all_gather"), "{reason}");
            }
            other => panic!("rank {r}: unexpected error {other}"),
        }
    }
    assert!(!all || mismatches >= 1);
    Ok(())
}

pub fn a_mismatched_shape_is_named<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("dp=2,tp=2")?;
    let (results, elapsed) = run_ranks(make, &mesh, options(Duration::from_secs(60)), |comm| {
        let x = if comm.rank() == 3 {
            ones(&[4, 3])
        } else {
            ones(&[4, 2])
        };
        let op = Op::AllReduce {
            axes: vec!["tp".into()],
            reduce: ReduceKind::Sum,
        };
        communicate(comm, &op, &[&x])
    });
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    // Ranks 2 and 3 disagree. The dp=0 group is fine, but a failure dooms the whole run:
    // ranks 0 and 1 finish or learn of the failure, whichever comes first.
    for r in results[..2].iter().flatten() {
        assert!(
            matches!(
                r,
                Ok(_)
                    | Err(RuntimeError::PeerFailed {
                        failed_rank: 2 | 3,
                        ..
                    })
            ),
            "{r:?}"
        );
    }
    let Some(r2) = &results[2] else {
        return Ok(());
    };
    let Err(e) = r2 else {
        panic!("rank 2 should fail")
    };
    let message = e.to_string();
    assert!(
        message.contains("f32[4, 3]") || message.contains("f32[4,3]"),
        "{message}"
    );
    // Rank 2 finds the mismatch itself, or (across processes, where rank 3 may compare
    // first and report its failure before rank 2 compares) learns it from rank 3's report,
    // which names both calls.
    assert!(
        match e {
            RuntimeError::CollectiveMismatch { group, peer: 3, .. } => group == &vec![2, 3],
            RuntimeError::PeerFailed {
                group,
                failed_rank: 3,
                reason,
                ..
            } => {
                let reason = reason.replace(' ', "");
                group == &vec![2, 3] && reason.contains("f32[4,3]") && reason.contains("f32[4,2]")
            }
            _ => false,
        },
        "{e}"
    );
    Ok(())
}

pub fn a_stuck_rank_times_out_its_peers<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let x = ones(&[16]);
    let (results, elapsed) = run_ranks(make, &mesh, options(Duration::from_millis(300)), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2));
        }
        communicate(comm, &all_reduce(), &[&x])
    });
    // Rank 1 sleeps 2 s; nobody waits for longer than that.
    assert!(elapsed < Duration::from_secs(4), "took {elapsed:?}");
    // Ranks 0, 2 and 3 each wait on their ring predecessor and time out at about the same
    // moment; the first to do so tells the others. Rank 1 wakes to find the run failed.
    let mut timeouts = 0;
    let all = saw_all(&results);
    for (rank, r) in results.iter().enumerate() {
        let Some(r) = r else { continue };
        let Err(e) = r else {
            panic!("rank {rank} should fail, got {r:?}")
        };
        match e {
            RuntimeError::CollectiveTimeout {
                op,
                group,
                rank: me,
                peer,
                timeout,
            } => {
                timeouts += 1;
                assert_eq!((*op, *me), ("all_reduce", rank));
                // The ring predecessor it waited for, or (where a communicator follows the
                // chain of waiting ranks) the stuck rank itself.
                assert!([(rank + 3) % 4, 1].contains(peer), "{e}");
                assert_eq!(group, &vec![0, 1, 2, 3]);
                assert_eq!(*timeout, Duration::from_millis(300));
            }
            RuntimeError::PeerFailed { reason, .. } => {
                assert!(reason.contains("within 300ms"), "{reason}");
            }
            other => panic!("rank {rank}: unexpected error {other}"),
        }
    }
    assert!(!all || timeouts >= 1);
    Ok(())
}

pub fn a_timeout_names_the_stuck_peer<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=2")?;
    let x = ones(&[16]);
    let (results, elapsed) = run_ranks(make, &mesh, options(Duration::from_millis(200)), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(1));
        }
        communicate(comm, &all_reduce(), &[&x])
    });
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    let Some(r0) = &results[0] else {
        return Ok(());
    };
    let Err(e) = r0 else {
        panic!("rank 0 should time out")
    };
    assert!(
        matches!(
            e,
            RuntimeError::CollectiveTimeout {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "`all_reduce` over ranks [0, 1] on rank 0: nothing from rank 1 within 200ms \
         (it died, diverged or is stuck)"
    );
    Ok(())
}

pub fn a_recv_of_the_wrong_type_is_named<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("pp=2")?;
    let (results, _) = run_ranks(make, &mesh, options(Duration::from_secs(60)), |comm| {
        if comm.rank() == 0 {
            let send = Op::Send {
                axis: "pp".into(),
                shift: 1,
            };
            communicate(comm, &send, &[&ones(&[2, 2])])
        } else {
            let recv = Op::Recv {
                axis: "pp".into(),
                shift: -1,
                ty: TensorType::new(DType::F32, [4]),
            };
            communicate(comm, &recv, &[])
        }
    });
    assert!(
        matches!(
            &results[1],
            None | Some(Err(RuntimeError::CollectiveMismatch {
                op: "recv",
                peer: 0,
                ..
            }))
        ),
        "{:?}",
        results[1]
    );
    Ok(())
}

pub fn a_peer_that_finishes_early_is_noticed<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=2")?;
    let x = ones(&[4]);
    let (results, elapsed) = run_ranks(make, &mesh, options(Duration::from_secs(60)), |comm| {
        if comm.rank() == 0 {
            communicate(comm, &all_reduce(), &[&x])
        } else {
            Ok(Vec::new())
        }
    });
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(
        matches!(
            &results[0],
            None | Some(Err(RuntimeError::PeerExited { peer: 1, .. }))
        ),
        "{:?}",
        results[0]
    );
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
            "a_mismatched_collective_is_named",
            a_mismatched_collective_is_named::<L>,
        ),
        (
            "a_mismatched_shape_is_named",
            a_mismatched_shape_is_named::<L>,
        ),
        (
            "a_stuck_rank_times_out_its_peers",
            a_stuck_rank_times_out_its_peers::<L>,
        ),
        (
            "a_timeout_names_the_stuck_peer",
            a_timeout_names_the_stuck_peer::<L>,
        ),
        (
            "a_recv_of_the_wrong_type_is_named",
            a_recv_of_the_wrong_type_is_named::<L>,
        ),
        (
            "a_peer_that_finishes_early_is_noticed",
            a_peer_that_finishes_early_is_noticed::<L>,
        ),
    ]
}

/// Instantiates the implementation-independent checks of this suite as tests, for the
/// implementation that `$make` (a `Fn(CommOptions) -> impl Launcher`) launches.
#[macro_export]
macro_rules! failures_conformance {
    ($name:ident, $make:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::failures::TestResult;

            #[test]
            fn a_mismatched_collective_is_named() -> TestResult {
                $crate::failures::a_mismatched_collective_is_named(&$make)
            }

            #[test]
            fn a_mismatched_shape_is_named() -> TestResult {
                $crate::failures::a_mismatched_shape_is_named(&$make)
            }

            #[test]
            fn a_stuck_rank_times_out_its_peers() -> TestResult {
                $crate::failures::a_stuck_rank_times_out_its_peers(&$make)
            }

            #[test]
            fn a_timeout_names_the_stuck_peer() -> TestResult {
                $crate::failures::a_timeout_names_the_stuck_peer(&$make)
            }

            #[test]
            fn a_recv_of_the_wrong_type_is_named() -> TestResult {
                $crate::failures::a_recv_of_the_wrong_type_is_named(&$make)
            }

            #[test]
            fn a_peer_that_finishes_early_is_noticed() -> TestResult {
                $crate::failures::a_peer_that_finishes_early_is_noticed(&$make)
            }
        }
    };
}
