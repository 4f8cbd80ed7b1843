//! A collective that cannot complete ends in an error, never a hang: a rank that dies
//! mid-collective, a rank that calls another collective or passes another shape, and a rank
//! that is stuck, each make the others fail within seconds with an error naming the
//! collective, the group and the ranks.

use std::time::{Duration, Instant};

use autopar_ir::{BinaryOp, DType, DeviceMesh, Graph, InputRole, Op, ReduceKind, TensorType};
use autopar_runtime::comm::{Collectives, communicate};
use autopar_runtime::{
    CommOptions, InProcessCommunicator, Launcher, RankProgram, RuntimeError, SpmdOptions, Tensor,
    TensorMap, ThreadLauncher, in_process_communicators, run_spmd, run_spmd_per_rank,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn x_axes() -> Vec<String> {
    vec!["x".into()]
}

fn all_reduce() -> Op {
    Op::AllReduce {
        axes: x_axes(),
        reduce: ReduceKind::Sum,
    }
}

fn ones(dims: &[usize]) -> Tensor {
    Tensor::full(TensorType::new(DType::F32, dims.to_vec()), 1.0)
}

/// The implementation under test: a launcher of ranks whose communicators have the given
/// options (see `comm_collectives.rs`).
type Make<'a, L> = &'a dyn Fn(CommOptions) -> L;

/// Runs `body` on the ranks `make(options)` launches; returns each rank's result by rank
/// (`None` for a rank that did not run in this process), the [`RuntimeError::OnRank`]
/// context taken off errors, and the time the launch took.
fn run_ranks<L: Launcher, T: Send>(
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

/// Runs `body` on every in-process communicator's thread; returns each rank's result (`None`
/// when its thread panicked) and the time the slowest rank took.
fn run_threads<T: Send>(
    comms: Vec<InProcessCommunicator>,
    body: impl Fn(&mut InProcessCommunicator) -> Result<T, RuntimeError> + Sync,
) -> (Vec<Option<Result<T, RuntimeError>>>, Duration) {
    let start = Instant::now();
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let body = &body;
                s.spawn(move || body(&mut comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().ok()).collect()
    });
    (results, start.elapsed())
}

fn options(timeout: Duration) -> CommOptions {
    CommOptions {
        timeout,
        ..CommOptions::default()
    }
}

#[test]
fn a_rank_killed_mid_collective_fails_the_others_quickly() -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    // A long timeout: the others must notice the death, not wait it out.
    let mut comms = in_process_communicators(&mesh, options(Duration::from_secs(60)));
    // Rank 2 dies on its seventh send: the first of the second all-reduce (ring all-reduce
    // on 4 ranks sends 6 messages).
    comms[2].panic_after_sends(7);
    let x = ones(&[1 << 12]);
    let (results, elapsed) = run_threads(comms, |comm| {
        // A first collective succeeds everywhere; the second is where rank 2 dies.
        let first = communicate(comm, &all_reduce(), &[&x])?;
        communicate(comm, &all_reduce(), &[&first[0]])
    });
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(results[2].is_none(), "rank 2 should have panicked");
    for (rank, r) in results.iter().enumerate() {
        if rank == 2 {
            continue;
        }
        let Some(Err(e)) = r else {
            panic!("rank {rank} should have failed, got {r:?}")
        };
        match e {
            RuntimeError::PeerFailed {
                op,
                group,
                rank: me,
                failed_rank,
                reason,
            } => {
                assert_eq!(*op, "all_reduce");
                assert_eq!(group, &vec![0, 1, 2, 3]);
                assert_eq!(*me, rank);
                assert_eq!(*failed_rank, 2);
                assert!(reason.contains("panicked"), "{reason}");
            }
            other => panic!("rank {rank}: unexpected error {other}"),
        }
        let message = e.to_string();
        assert!(
            message.contains("all_reduce") && message.contains("rank 2"),
            "{message}"
        );
    }
    Ok(())
}

fn a_mismatched_collective_is_named<L: Launcher>(make: Make<'_, L>) -> TestResult {
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
    let errors: Vec<RuntimeError> = results
        .into_iter()
        .map(|r| match r {
            Some(Err(e)) => e,
            other => panic!("every rank should fail, got {other:?}"),
        })
        .collect();
    // Rank 1 and its ring successor, rank 2, exchange messages and see the disagreement
    // (unless one of them learns first that the other has failed); the rest learn of it.
    let mut mismatches = 0;
    for (r, e) in errors.iter().enumerate() {
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
    assert!(mismatches >= 1);
    Ok(())
}

fn a_mismatched_shape_is_named<L: Launcher>(make: Make<'_, L>) -> TestResult {
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
    for r in &results[..2] {
        assert!(
            matches!(
                r,
                Some(Ok(_))
                    | Some(Err(RuntimeError::PeerFailed {
                        failed_rank: 2 | 3,
                        ..
                    }))
            ),
            "{r:?}"
        );
    }
    let Some(Err(e)) = &results[2] else {
        panic!("rank 2 should fail")
    };
    let message = e.to_string();
    assert!(
        message.contains("f32[4, 3]") || message.contains("f32[4,3]"),
        "{message}"
    );
    assert!(
        matches!(e, RuntimeError::CollectiveMismatch { group, peer: 3, .. } if group == &vec![2, 3]),
        "{e}"
    );
    Ok(())
}

fn a_stuck_rank_times_out_its_peers<L: Launcher>(make: Make<'_, L>) -> TestResult {
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
    for (rank, r) in results.iter().enumerate() {
        let Some(Err(e)) = r else {
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
                assert_eq!(*peer, (rank + 3) % 4);
                assert_eq!(group, &vec![0, 1, 2, 3]);
                assert_eq!(*timeout, Duration::from_millis(300));
            }
            RuntimeError::PeerFailed { reason, .. } => {
                assert!(reason.contains("within 300ms"), "{reason}");
            }
            other => panic!("rank {rank}: unexpected error {other}"),
        }
    }
    assert!(timeouts >= 1);
    Ok(())
}

fn a_timeout_names_the_stuck_peer<L: Launcher>(make: Make<'_, L>) -> TestResult {
    let mesh = DeviceMesh::parse("x=2")?;
    let x = ones(&[16]);
    let (results, elapsed) = run_ranks(make, &mesh, options(Duration::from_millis(200)), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(1));
        }
        communicate(comm, &all_reduce(), &[&x])
    });
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    let Some(Err(e)) = &results[0] else {
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

fn a_recv_of_the_wrong_type_is_named<L: Launcher>(make: Make<'_, L>) -> TestResult {
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
            Some(Err(RuntimeError::CollectiveMismatch {
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

fn a_peer_that_finishes_early_is_noticed<L: Launcher>(make: Make<'_, L>) -> TestResult {
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
    assert!(matches!(
        &results[0],
        Some(Err(RuntimeError::PeerExited { peer: 1, .. }))
    ));
    Ok(())
}

/// A program for `x=4`: all-reduce the input, gather a row of a table by an id input, and
/// all-reduce again. An out-of-range id makes one rank fail between the collectives.
fn program(mesh: &DeviceMesh) -> Result<Graph, Box<dyn std::error::Error>> {
    let mut g = Graph::new("failing");
    g.set_mesh(Some(mesh.clone()));
    let x = g.add(
        Op::Input {
            name: "x".into(),
            ty: TensorType::new(DType::F32, [3, 4]),
            role: InputRole::Features,
        },
        &[],
    )?;
    let ids = g.add(
        Op::Input {
            name: "ids".into(),
            ty: TensorType::new(DType::I64, [2]),
            role: InputRole::Features,
        },
        &[],
    )?;
    let summed = g.add(all_reduce(), &[x])?;
    let rows = g.add(Op::Gather, &[summed, ids])?;
    let doubled = g.add(
        Op::Binary {
            func: BinaryOp::Add,
        },
        &[rows, rows],
    )?;
    let out = g.add(all_reduce(), &[doubled])?;
    g.add_output("out", out)?;
    Ok(g)
}

#[test]
fn run_spmd_reports_the_failing_rank() -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let g = program(&mesh)?;
    let inputs: Vec<TensorMap> = (0..4)
        .map(|r| {
            let mut m = TensorMap::new();
            m.insert("x".into(), ones(&[3, 4]));
            let bad = if r == 3 { 7 } else { 2 };
            m.insert(
                "ids".into(),
                Tensor::from_i64(TensorType::new(DType::I64, [2]), vec![0, bad])?,
            );
            Ok(m)
        })
        .collect::<Result<_, RuntimeError>>()?;
    let params = TensorMap::new();
    let ranks: Vec<RankProgram<'_>> = inputs
        .iter()
        .map(|inputs| RankProgram {
            graph: &g,
            params: &params,
            inputs,
        })
        .collect();
    let options = SpmdOptions {
        timeout: Duration::from_secs(60),
        ..SpmdOptions::default()
    };
    let start = Instant::now();
    let err = run_spmd(&mesh, &ranks, options).expect_err("rank 3 fails");
    assert!(start.elapsed() < Duration::from_secs(5));
    let RuntimeError::OnRank { rank: 3, .. } = &err else {
        panic!("unexpected error {err}")
    };
    assert!(matches!(
        err.innermost(),
        RuntimeError::IndexOutOfRange { id: 7, .. }
    ));
    // The other ranks stopped in the second all-reduce because of rank 3.
    let each = run_spmd_per_rank(&mesh, &ranks, options)?;
    for (rank, r) in each.iter().enumerate().take(3) {
        let Err(e) = r else {
            panic!("rank {rank} should fail")
        };
        assert!(
            matches!(
                e.innermost(),
                RuntimeError::PeerFailed {
                    op: "all_reduce",
                    failed_rank: 3,
                    ..
                }
            ),
            "rank {rank}: {e}"
        );
        assert!(
            e.to_string().starts_with(&format!("rank {rank}: at ")),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn run_spmd_reports_divergent_programs() -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let g = program(&mesh)?;
    // Rank 1 runs a program whose first collective is an all-gather.
    let mut other = Graph::new("divergent");
    other.set_mesh(Some(mesh.clone()));
    let x = other.add(
        Op::Input {
            name: "x".into(),
            ty: TensorType::new(DType::F32, [3, 4]),
            role: InputRole::Features,
        },
        &[],
    )?;
    let gathered = other.add(
        Op::AllGather {
            axes: x_axes(),
            dim: 0,
        },
        &[x],
    )?;
    other.add_output("out", gathered)?;
    let mut inputs = TensorMap::new();
    inputs.insert("x".into(), ones(&[3, 4]));
    inputs.insert(
        "ids".into(),
        Tensor::from_i64(TensorType::new(DType::I64, [2]), vec![0, 1])?,
    );
    let params = TensorMap::new();
    let ranks: Vec<RankProgram<'_>> = (0..4)
        .map(|r| RankProgram {
            graph: if r == 1 { &other } else { &g },
            params: &params,
            inputs: &inputs,
        })
        .collect();
    let start = Instant::now();
    let err = run_spmd(&mesh, &ranks, SpmdOptions::default()).expect_err("mismatch");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(err.innermost(), RuntimeError::CollectiveMismatch { .. }),
        "{err}"
    );
    Ok(())
}

/// Instantiates the implementation-independent checks of this suite as tests, for the
/// implementation that `$make` (a `Fn(CommOptions) -> impl Launcher`) launches.
macro_rules! conformance {
    ($name:ident, $make:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn a_mismatched_collective_is_named() -> TestResult {
                super::a_mismatched_collective_is_named(&$make)
            }

            #[test]
            fn a_mismatched_shape_is_named() -> TestResult {
                super::a_mismatched_shape_is_named(&$make)
            }

            #[test]
            fn a_stuck_rank_times_out_its_peers() -> TestResult {
                super::a_stuck_rank_times_out_its_peers(&$make)
            }

            #[test]
            fn a_timeout_names_the_stuck_peer() -> TestResult {
                super::a_timeout_names_the_stuck_peer(&$make)
            }

            #[test]
            fn a_recv_of_the_wrong_type_is_named() -> TestResult {
                super::a_recv_of_the_wrong_type_is_named(&$make)
            }

            #[test]
            fn a_peer_that_finishes_early_is_noticed() -> TestResult {
                super::a_peer_that_finishes_early_is_noticed(&$make)
            }
        }
    };
}

conformance!(in_process, |options| ThreadLauncher { options });
