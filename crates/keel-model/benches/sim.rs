//! The simulator's cost per simulated call: one replication of E2 (least-connections, 200 in
//! flight, one hung server) and of E4's peak-EWMA row, single-threaded.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use keel_model::presets;
use keel_model::sim::run_replication;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("sim");
    g.sample_size(10);
    let mut e2 = presets::e2().rows.remove(0);
    e2.requests = 20_000;
    let calls = run_replication(&e2, 0, &|_| {}).unwrap().calls;
    g.throughput(Throughput::Elements(calls));
    g.bench_function("e2_replication_calls", |b| {
        b.iter(|| run_replication(&e2, 0, &|_| {}).unwrap())
    });
    let mut pe = presets::e4()
        .rows
        .into_iter()
        .find(|r| r.strategy().name() == "peak-ewma")
        .unwrap();
    pe.requests = 20_000;
    let calls = run_replication(&pe, 0, &|_| {}).unwrap().calls;
    g.throughput(Throughput::Elements(calls));
    g.bench_function("e4_peak_ewma_replication_calls", |b| {
        b.iter(|| run_replication(&pe, 0, &|_| {}).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
