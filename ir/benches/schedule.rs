//! Pipeline schedule generation at the largest scale a search considers: interleaved 1F1B on
//! 64 pipeline ranks with 3 virtual stages each and 3072 micro-batches (about 1.2 million
//! actions), and a simulated run of the lists.

use std::hint::black_box;

use autopar_ir::schedule::{Schedule, ScheduleKind};
use criterion::{Criterion, criterion_group, criterion_main};

fn schedules(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule");
    group.sample_size(10);
    group.bench_function("interleaved pp=64 vpp=3 m=3072", |b| {
        b.iter(|| Schedule::new(ScheduleKind::Interleaved, black_box(64), 3, 3072))
    });
    group.bench_function("1f1b pp=64 m=3072", |b| {
        b.iter(|| Schedule::new(ScheduleKind::OneFOneB, black_box(64), 1, 3072))
    });
    let s = Schedule::new(ScheduleKind::Interleaved, 64, 3, 3072).expect("schedule");
    group.bench_function("simulate interleaved pp=64 vpp=3 m=3072", |b| {
        b.iter(|| s.simulate(|_, _| 10, |_, _| 1))
    });
    group.finish();
}

criterion_group!(benches, schedules);
criterion_main!(benches);
