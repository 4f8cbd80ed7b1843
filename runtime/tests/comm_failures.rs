//! A collective that cannot complete ends in an error, never a hang: the failure conformance
//! suite (`conformance/failures.rs`) over the in-process communicator, a rank that dies
//! mid-collective, and the SPMD executor's reports of a failing or divergent rank.

#[path = "conformance/f32_path.rs"]
mod f32_path;
#[path = "conformance/failures.rs"]
mod failures;

use std::time::{Duration, Instant};

use autopar_ir::{BinaryOp, DType, DeviceMesh, Graph, InputRole, Op, TensorType};
use autopar_runtime::comm::communicate;
use autopar_runtime::{
    InProcessCommunicator, RankProgram, RuntimeError, SpmdOptions, Tensor, TensorMap,
    ThreadLauncher, in_process_communicators, run_spmd, run_spmd_per_rank,
};

use failures::{TestResult, all_reduce, ones, options, x_axes};

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

failures_conformance!(in_process, |options| ThreadLauncher { options });

failures_conformance!(in_process_f32, |options| f32_path::F32Launcher {
    inner: ThreadLauncher { options },
    defaults: false,
});

#[test]
fn a_rank_killed_mid_f32_all_reduce_fails_the_others_quickly() -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let mut comms = in_process_communicators(&mesh, options(Duration::from_secs(60)));
    // The shared path publishes once per collective: rank 2 dies in the second.
    comms[2].panic_after_sends(1);
    let ty = TensorType::new(DType::F32, [1 << 12]);
    let (results, elapsed) = run_threads(comms, |comm| {
        use autopar_runtime::comm::Collectives;
        let mut x = vec![1.0f32; 1 << 12];
        comm.all_reduce_f32(&mut x, &ty, &x_axes(), autopar_ir::ReduceKind::Sum)?;
        comm.all_reduce_f32(&mut x, &ty, &x_axes(), autopar_ir::ReduceKind::Sum)?;
        Ok(x)
    });
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(results[2].is_none(), "rank 2 should have panicked");
    for (rank, r) in results.iter().enumerate() {
        if rank == 2 {
            continue;
        }
        match r {
            Some(Err(RuntimeError::PeerFailed {
                op,
                group,
                failed_rank: 2,
                reason,
                ..
            })) => {
                assert_eq!(*op, "all_reduce");
                assert_eq!(group, &vec![0, 1, 2, 3]);
                assert!(reason.contains("panicked"), "{reason}");
            }
            other => panic!("rank {rank}: unexpected {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn a_failed_f32_all_reduce_gives_the_caller_its_buffer_back() -> TestResult {
    let mesh = DeviceMesh::parse("x=4")?;
    let comms = in_process_communicators(&mesh, options(Duration::from_secs(60)));
    let len = 5000;
    let ty = TensorType::new(DType::F32, [len]);
    // Rank 3 never joins: it leaves, and the others' all-reduce fails at its first barrier,
    // with each member's buffer lent to the group at that moment.
    let (results, elapsed) = run_threads(comms, |comm| {
        use autopar_runtime::comm::Collectives;
        let mut x: Vec<f32> = (0..len).map(|i| i as f32).collect();
        if comm.rank() == 3 {
            return Ok(None);
        }
        let capacity = x.capacity();
        let r = comm.all_reduce_f32(&mut x, &ty, &x_axes(), autopar_ir::ReduceKind::Sum);
        Ok(Some((r, x, capacity)))
    });
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    for (rank, r) in results.into_iter().enumerate() {
        let r = r.ok_or(format!("rank {rank} panicked"))??;
        let Some((r, x, capacity)) = r else {
            continue;
        };
        assert!(
            matches!(
                r,
                Err(RuntimeError::PeerExited { peer: 3, .. } | RuntimeError::PeerFailed { .. })
            ),
            "rank {rank}: {r:?}"
        );
        assert_eq!(x.capacity(), capacity, "rank {rank}");
        assert!(
            x.iter().enumerate().all(|(i, &v)| v == i as f32),
            "rank {rank}: the operand changed"
        );
    }
    Ok(())
}
