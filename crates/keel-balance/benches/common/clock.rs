//! The clock the balancer benches measure with (shared with bench/pingora-compare via `#[path]`).
//!
//! Default on Linux: CPU time of this process (all its threads), read with
//! `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`. On a shared 2-core machine other processes take
//! the cores away for whole time slices; wall time then counts their work as ours, CPU time does
//! not. Cache-line contention between our own threads still costs CPU time (stalled cycles are
//! on-CPU), so the two-thread numbers still show it. `KEEL_BENCH_CLOCK=wall` measures wall time
//! instead (criterion's usual clock).

use std::time::{Duration, Instant};

use criterion::measurement::{Measurement, ValueFormatter, WallTime};

/// Which clock; see the module docs.
pub struct BenchClock {
    cpu: bool,
    epoch: Instant,
    wall: WallTime,
}

impl BenchClock {
    /// From `KEEL_BENCH_CLOCK` (`cpu` or `wall`); CPU time by default where it is available.
    pub fn from_env() -> Self {
        let cpu = match std::env::var("KEEL_BENCH_CLOCK").as_deref() {
            Ok("wall") => false,
            Ok("cpu") | Err(_) => cfg!(all(target_os = "linux", target_pointer_width = "64")),
            Ok(other) => panic!("KEEL_BENCH_CLOCK must be `cpu` or `wall`, got `{other}`"),
        };
        Self {
            cpu,
            epoch: Instant::now(),
            wall: WallTime,
        }
    }

    /// The clock's name, for the run's header.
    pub fn name(&self) -> &'static str {
        if self.cpu {
            "process CPU time"
        } else {
            "wall time"
        }
    }

    /// The current reading.
    pub fn now(&self) -> Duration {
        if self.cpu {
            process_cpu_time()
        } else {
            self.epoch.elapsed()
        }
    }

    /// Time per op of one thread for a run of `threads` threads that each did the same number
    /// of ops since `start`: CPU time is summed over the threads, wall time is not.
    pub fn per_thread_since(&self, start: Duration, threads: u32) -> Duration {
        let spent = self.now().saturating_sub(start);
        if self.cpu {
            spent / threads
        } else {
            spent
        }
    }
}

impl Measurement for BenchClock {
    type Intermediate = Duration;
    type Value = Duration;

    fn start(&self) -> Duration {
        self.now()
    }

    fn end(&self, start: Duration) -> Duration {
        self.now().saturating_sub(start)
    }

    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }

    fn zero(&self) -> Duration {
        Duration::ZERO
    }

    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }

    fn formatter(&self) -> &dyn ValueFormatter {
        self.wall.formatter()
    }
}

#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn process_cpu_time() -> Duration {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: glibc's clock_gettime writes one timespec (two 64-bit fields on 64-bit Linux)
    // into the pointer we pass, which points to a live, properly laid out local.
    let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn process_cpu_time() -> Duration {
    unreachable!("the CPU clock is only chosen on 64-bit Linux")
}
