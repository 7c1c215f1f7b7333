//! E12, measured: N keel proxies on a three-member etcd in front of three endpoints, one failing
//! at once (503), random picks, Poisson arrivals of 100 requests/s over the fleet (seeded),
//! dealt in turn or spread at random. The fleet's failed tries at that endpoint, local against
//! shared detection, next to keel-model's closed form and simulation of the same setting
//! (`keel_model::fleet`, n = 3, k = 5, Λ = 100/s, d = etcd's put-to-watch delay measured at the
//! start). Not part of scripts/test-etcd.sh
//! (about seven minutes): `bash scripts/lab-e12.sh`.

use std::time::Duration;

use keel_model::fleet::{run, Detection, FleetSetting};
use keel_model::sim::Arrivals;
use keel_model::FailureMode;

use crate::evidence::{fleet_run, Arrival};
use crate::*;

/// Replications of each measured row.
const RUNS: u64 = 8;
/// Requests per run (enough for every proxy to see its k-th failure alone at N = 4).
const REQUESTS: usize = 240;
/// Puts timed from before the put to the watch event at another client: etcd's share of the
/// evidence's delay (a failure is published at once; keel's own part is microseconds).
async fn measured_delay(etcd: &keel_testbed::etcd::EtcdCluster) -> (Duration, Duration) {
    let mut writer = client_of(etcd).await;
    let mut reader = client_of(etcd).await;
    let mut watch = reader.watch("/keel/e12/delay", None).await.unwrap();
    let mut took = Vec::new();
    for i in 0..60 {
        let start = std::time::Instant::now();
        writer
            .put("/keel/e12/delay", format!("{i}"), None)
            .await
            .unwrap();
        loop {
            let m = watch.message().await.unwrap().unwrap();
            if !m.events().is_empty() {
                break;
            }
        }
        took.push(start.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    took.sort();
    let mean = took.iter().sum::<Duration>() / took.len() as u32;
    (mean, took[took.len() * 9 / 10])
}

fn setting(n: u32, arrivals: Arrivals, detection: Detection) -> FleetSetting {
    let mut s = FleetSetting::new(n, FailureMode::FAIL_AT_ONCE, arrivals, detection);
    s.endpoints = 3;
    s.rate = 100.0;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "E12, about seven minutes: run scripts/lab-e12.sh"]
async fn e12_fleet_failed_tries_measured_next_to_the_model() {
    let etcd = etcd3();
    let (delay, p90) = measured_delay(&etcd).await;
    println!("E12 | etcd put to watch event: mean {delay:?}, p90 {p90:?} (the model's d)");
    println!(
        "E12 | N | traffic | local measured (runs) | local closed form | local simulated (95 % CI) | shared measured (runs) | shared closed form | shared simulated (95 % CI) | writes"
    );
    let mut half = Vec::new();
    for n in [1u32, 2, 3, 4] {
        for (arrival, arrivals) in [
            (Arrival::InTurn, Arrivals::InTurn),
            (Arrival::Spread, Arrivals::Random),
        ] {
            let mut cells = Vec::new();
            let mut means = Vec::new();
            let mut writes = Vec::new();
            for shared in [false, true] {
                let mut got = Vec::new();
                let mut published = 0;
                for r in 0..RUNS {
                    let seed = 1000 * u64::from(n) + 10 * r + u64::from(shared);
                    let run = fleet_run(
                        &etcd,
                        n as usize,
                        shared,
                        arrival,
                        REQUESTS,
                        "random",
                        Some(seed),
                    )
                    .await;
                    got.push(run.failed);
                    published += run.published;
                }
                if shared {
                    writes.push(published as f64 / got.iter().sum::<u64>().max(1) as f64);
                }
                let mean = got.iter().sum::<u64>() as f64 / got.len() as f64;
                means.push(mean);
                let detection = if shared {
                    Detection::Shared { delay, quorum: 1 }
                } else {
                    Detection::Local
                };
                let st = setting(n, arrivals, detection);
                let sim = run(&st, 12, 200).unwrap();
                cells.push(format!(
                    "{mean:.1} ({got:?}) | {:.2} | {:.2} ({:.2}-{:.2})",
                    st.closed_form().unwrap(),
                    sim.mean,
                    sim.ci95.0,
                    sim.ci95.1
                ));
            }
            println!(
                "E12 | {n} | {arrival:?} | {} | {} | {:.2} evidence writes per failed try",
                cells[0], cells[1], writes[0]
            );
            // Local: every proxy pays the threshold alone.
            assert!(
                (means[0] - 5.0 * f64::from(n)).abs() <= 1.0,
                "N = {n}, {arrival:?}: local {}",
                means[0]
            );
            if n >= 2 {
                assert!(means[1] < means[0], "N = {n}, {arrival:?}: {means:?}");
            }
            if n == 3 {
                half.push((arrival, means[1], means[0]));
            }
        }
    }
    // The bar: with quorum 1 a fleet of three pays at most half of local detection's tries,
    // in turn and spread (checked after every row is printed).
    for (arrival, shared, local) in half {
        assert!(
            shared * 2.0 <= local,
            "N = 3, {arrival:?}: shared {shared} > half of local {local}"
        );
    }
}
