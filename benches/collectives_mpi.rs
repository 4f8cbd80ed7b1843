//! A 64 MiB all-reduce (16 Mi f32 elements) on 4 ranks three ways, in one run: as MPI
//! processes (`MpiLauncher`), as threads (the in-process communicator), and, as the floor,
//! one memcpy of 64 MiB. Both communicators run the same ring algorithm; the runtime holds
//! floats as f64, and partial sums travel as f64, so a ring step moves twice the f32 bytes.
//!
//! The MPI measurement starts this bench again under `mpirun -np 4` for each batch of
//! iterations; the processes time the batch themselves (after one warm-up all-reduce), so
//! that process start-up is not timed, and rank 0 reports the time on standard output.
//! Throughput is in bytes of the declared dtype (64 MiB per all-reduce).

use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use autopar_ir::{DType, DeviceMesh, ReduceKind, TensorType};
use autopar_runtime::comm::mpi::{finalize, started_by_mpirun};
use autopar_runtime::{CommOptions, Launcher, MpiLauncher, Tensor, ThreadLauncher, root_cause};
use criterion::{Criterion, Throughput};

const BYTES: usize = 64 << 20;
const RANKS: usize = 4;
/// Environment variable that tells a process under mpirun how many all-reduces to time.
const ITERS: &str = "AUTOPAR_BENCH_ITERS";

fn options() -> CommOptions {
    CommOptions {
        timeout: Duration::from_secs(600),
        ..CommOptions::default()
    }
}

/// `iters` all-reduces of this rank's operand after one warm-up; the time of the batch.
fn timed_all_reduces(launcher: &impl Launcher, iters: u64) -> Duration {
    let mesh = DeviceMesh::new([("x", RANKS)]).expect("mesh");
    let axes = vec!["x".to_string()];
    let ty = TensorType::new(DType::F32, [BYTES / 4]);
    let results = launcher
        .launch(&mesh, |comm| {
            let x = Tensor::full(ty.clone(), comm.rank() as f64 + 0.5);
            comm.all_reduce(&x, &axes, ReduceKind::Sum)?;
            let start = Instant::now();
            for _ in 0..iters {
                black_box(comm.all_reduce(&x, &axes, ReduceKind::Sum)?);
            }
            Ok(start.elapsed())
        })
        .expect("the ranks start");
    let times = root_cause(results).expect("every rank all-reduces");
    times.into_iter().map(|(_, t)| t).max().unwrap_or_default()
}

/// One process of the MPI job: times the batch and, on rank 0, prints it.
fn mpi_process() {
    let iters = std::env::var(ITERS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let launcher = MpiLauncher::new(options());
    let elapsed = timed_all_reduces(&launcher, iters);
    if std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("0") {
        println!("elapsed_ns={}", elapsed.as_nanos());
    }
    finalize();
}

/// Times `iters` all-reduces on `RANKS` MPI processes of this bench.
fn mpi_batch(iters: u64) -> Duration {
    let exe = std::env::current_exe().expect("this bench's binary");
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(RANKS.to_string())
        .arg(exe)
        .env(ITERS, iters.to_string())
        .output()
        .expect("mpirun runs (install Open MPI: openmpi-bin)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mpirun failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ns: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("elapsed_ns="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no time in {stdout}"));
    Duration::from_nanos(ns)
}

fn all_reduce_64mib(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_64MiB_4_ranks");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(20));
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("mpi_processes", |b| b.iter_custom(mpi_batch));
    group.bench_function("in_process_threads", |b| {
        b.iter_custom(|iters| timed_all_reduces(&ThreadLauncher { options: options() }, iters))
    });
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    group.finish();
}

fn main() {
    if started_by_mpirun() {
        mpi_process();
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    all_reduce_64mib(&mut c);
    c.final_summary();
}
