//! A 64 MiB all-reduce (16 Mi f32 elements) on 4 and on 2 thread ranks, in one run: through
//! the `f32` path of `Collectives` (each rank's buffer lent to the group, all of them reduced
//! in place by one leader and the rayon pool), through the `Tensor` path (ring over channels,
//! floats held as f64), and, as the floor, one memcpy of 64 MiB (and two at once on two
//! threads, for the memory bandwidth the cores share). Throughput is in bytes of the declared
//! dtype (64 MiB per all-reduce). Needs no MPI (`benches/collectives_mpi.rs` adds MPI
//! processes).
//!
//! The rank threads start once per batch of iterations and time the batch themselves after
//! one warm-up all-reduce, so that neither thread start-up nor the first call's buffer
//! allocation is timed. After the criterion groups, the bench prints the median of a few
//! batches of each, the all-reduce bandwidth as a fraction of memcpy's, and the memory
//! traffic each reaches: the `f32` path reads and writes every element of every member's
//! buffer once (`2 n` times 64 MiB on `n` ranks, against memcpy's 2), so at memcpy's own
//! traffic it would run at `1 / n` of memcpy's speed. The load average is printed before and
//! after: on a shared machine the figures are only as good as the quiet they were taken in.

use std::hint::black_box;
use std::time::{Duration, Instant};

use autopar_ir::{DType, DeviceMesh, ReduceKind, TensorType};
use autopar_runtime::comm::Collectives;
use autopar_runtime::{CommOptions, Launcher, Tensor, ThreadLauncher, root_cause};
use criterion::{Criterion, Throughput};

const BYTES: usize = 64 << 20;
const RANKS: usize = 4;

fn launcher() -> ThreadLauncher {
    ThreadLauncher {
        options: CommOptions {
            timeout: Duration::from_secs(600),
            ..CommOptions::default()
        },
    }
}

/// Which method the ranks call.
#[derive(Clone, Copy)]
enum Path {
    F32,
    Tensor,
}

/// `iters` all-reduces on every one of `ranks` ranks after one warm-up; the slowest rank's
/// time.
fn timed_all_reduces(path: Path, ranks: usize, iters: u64) -> Duration {
    let mesh = DeviceMesh::new([("x", ranks)]).expect("mesh");
    let axes = vec!["x".to_string()];
    let ty = TensorType::new(DType::F32, [BYTES / 4]);
    let results = launcher()
        .launch(&mesh, |comm: &mut dyn Collectives| {
            let value = comm.rank() as f32 + 0.5;
            match path {
                Path::F32 => {
                    let mut x = vec![value; BYTES / 4];
                    comm.all_reduce_f32(&mut x, &ty, &axes, ReduceKind::Sum)?;
                    let start = Instant::now();
                    for _ in 0..iters {
                        comm.all_reduce_f32(black_box(&mut x), &ty, &axes, ReduceKind::Sum)?;
                    }
                    Ok(start.elapsed())
                }
                Path::Tensor => {
                    let x = Tensor::full(ty.clone(), f64::from(value));
                    comm.all_reduce(&x, &axes, ReduceKind::Sum)?;
                    let start = Instant::now();
                    for _ in 0..iters {
                        black_box(comm.all_reduce(&x, &axes, ReduceKind::Sum)?);
                    }
                    Ok(start.elapsed())
                }
            }
        })
        .expect("the ranks start");
    let times = root_cause(results).expect("every rank all-reduces");
    times.into_iter().map(|(_, t)| t).max().unwrap_or_default()
}

fn memcpy(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn all_reduce_64mib(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_64MiB_4_thread_ranks");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("f32_shared_buffers", |b| {
        b.iter_custom(|iters| timed_all_reduces(Path::F32, RANKS, iters))
    });
    group.bench_function("f32_shared_buffers_2_ranks", |b| {
        b.iter_custom(|iters| timed_all_reduces(Path::F32, 2, iters))
    });
    group.bench_function("tensor_ring", |b| {
        b.iter_custom(|iters| timed_all_reduces(Path::Tensor, RANKS, iters))
    });
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    group.bench_function("memcpy", |b| b.iter(|| memcpy(&src, &mut dst)));
    group.finish();

    // The same, a few batches each, for the ratio the target is stated in.
    println!("load average before: {}", load_average());
    let batches = 5;
    let copy = median(
        (0..batches)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..4 {
                    memcpy(&src, &mut dst);
                }
                start.elapsed() / 4
            })
            .collect(),
    );
    let two_copies = median((0..batches).map(|_| two_memcpys(4) / 4).collect());
    let all_reduce = |path: Path, ranks: usize, iters: u32| {
        median(
            (0..batches)
                .map(|_| timed_all_reduces(path, ranks, u64::from(iters)) / iters)
                .collect(),
        )
    };
    let gib = |t: Duration| BYTES as f64 / t.as_secs_f64() / f64::from(1u32 << 30);
    // Bytes read and written, in GB/s.
    let traffic = |copies: usize, t: Duration| (copies * BYTES) as f64 / t.as_secs_f64() / 1e9;
    println!(
        "memcpy {:.2} GiB/s, {:.1} GB/s of traffic (two at once on two threads: {:.2} GiB/s each)",
        gib(copy),
        traffic(2, copy),
        gib(two_copies)
    );
    for (name, path, ranks, iters) in [
        ("f32 path, 4 ranks", Path::F32, RANKS, 4),
        ("f32 path, 2 ranks", Path::F32, 2, 4),
        ("tensor path, 4 ranks", Path::Tensor, RANKS, 1),
        ("tensor path, 2 ranks", Path::Tensor, 2, 1),
    ] {
        let t = all_reduce(path, ranks, iters);
        let moved = match path {
            Path::F32 => format!(", {:.1} GB/s of traffic", traffic(2 * ranks, t)),
            Path::Tensor => String::new(),
        };
        println!(
            "{name}: {:.3} GiB/s ({:.3}x memcpy{moved})",
            gib(t),
            copy.as_secs_f64() / t.as_secs_f64()
        );
    }
    println!("load average after: {}", load_average());
}

/// The load averages of `/proc/loadavg` (empty where there is none).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Two 64 MiB memcpys at once, `iters` times each, on two threads; the slower one's time.
fn two_memcpys(iters: u32) -> Duration {
    std::thread::scope(|s| {
        let copies: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    let src = vec![1u8; BYTES];
                    let mut dst = vec![0u8; BYTES];
                    memcpy(&src, &mut dst);
                    let start = Instant::now();
                    for _ in 0..iters {
                        memcpy(&src, &mut dst);
                    }
                    start.elapsed()
                })
            })
            .collect();
        copies
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .max()
            .unwrap_or_default()
    })
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    all_reduce_64mib(&mut c);
    c.final_summary();
}
