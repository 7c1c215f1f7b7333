//! The simulator's cost per simulated call, single-threaded: one replication of E2
//! (least-connections, 200 in flight, one hung server), of E4's peak-EWMA row, of the first rows
//! of E3 and E6 (the seed preset's longest experiments), and of E8's client-side rows at load
//! 0.9 for least-request and prequal (servers that queue, 100 balancers, load reports).
//! Criterion's throughput is in calls (`elements`), and time is the thread's CPU time (the
//! machine is shared: wall time would measure the others' load), so its report reads as calls
//! per CPU second, the figure `keel simulate` prints.

use std::time::Duration;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use keel_model::presets;
use keel_model::sim::{run_replication, Scenario};

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), formatted as durations.
struct ThreadCpu(WallTime);

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes to it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "thread CPU clock");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Measurement for ThreadCpu {
    type Intermediate = Duration;
    type Value = Duration;
    fn start(&self) -> Duration {
        thread_cpu()
    }
    fn end(&self, i: Duration) -> Duration {
        thread_cpu() - i
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, v: &Duration) -> f64 {
        v.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        self.0.formatter()
    }
}

fn row(
    group: &mut criterion::BenchmarkGroup<'_, ThreadCpu>,
    name: &str,
    mut sc: Scenario,
    requests: u64,
) {
    sc.requests = requests;
    let calls = run_replication(&sc, 0, &|_| {}).unwrap().calls;
    group.throughput(Throughput::Elements(calls));
    group.bench_function(name, |b| {
        b.iter(|| run_replication(&sc, 0, &|_| {}).unwrap())
    });
}

fn bench(c: &mut Criterion<ThreadCpu>) {
    let mut g = c.benchmark_group("sim");
    g.sample_size(10);
    row(
        &mut g,
        "e2_replication_calls",
        presets::e2().rows.remove(0),
        20_000,
    );
    let pe = presets::e4()
        .rows
        .into_iter()
        .find(|r| r.strategy().name() == "peak-ewma")
        .unwrap();
    row(&mut g, "e4_peak_ewma_replication_calls", pe, 20_000);
    row(
        &mut g,
        "e3_first_row_calls",
        presets::e3().rows.remove(0),
        20_000,
    );
    row(
        &mut g,
        "e6_first_row_calls",
        presets::e6().rows.remove(0),
        20_000,
    );
    let e8 = |s: &str| {
        presets::tail()
            .rows
            .into_iter()
            .find(|r| {
                r.strategy().name() == s
                    && r.label == "load 0.90, client-side x100"
                    && r.hedge.is_none()
            })
            .unwrap()
    };
    row(
        &mut g,
        "e8_least_request_calls",
        e8("least-request"),
        20_000,
    );
    row(&mut g, "e8_prequal_calls", e8("prequal"), 20_000);
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpu(WallTime));
    targets = bench
}
criterion_main!(benches);
