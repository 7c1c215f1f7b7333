//! What a simulated server does with a call: how long its work takes (service-time
//! distribution, failure mode, slow-downs) and, when it has a capacity, where the call waits.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;

use super::scenario::{Discipline, FailureShare, MAX_FAILURE_MIX};
use crate::vocab::{FailureMode, LatencySampler, RESET_CUT};

/// What a call asks of a server.
pub(crate) enum Demand {
    /// Work the server does (queued behind others when it has a capacity): service time in
    /// nanoseconds at full speed, and whether the answer is good.
    Work(u64, bool),
    /// An answer that takes no work (a failing server's error or silence): after this long,
    /// never queued.
    Bypass(u64, bool),
}

/// One server: its healthy service time and how it fails (`FailureMode::None` when healthy),
/// as keel-model's vocabulary defines them.
#[derive(Clone, Copy)]
pub(crate) struct Server {
    pub latency: LatencySampler,
    pub failure: FailureMode,
    /// A flapping server's phase: where in its up/down period virtual time 0 falls.
    pub flap_offset: u64,
    /// Slow-down from antagonists (1: none).
    pub antagonist: f64,
    /// Slow-down from a scheduled step (1: none).
    pub slowdown: f64,
    /// A share of calls failing in other modes (an endpoint described on its own); empty for
    /// a server that is either healthy or failed as a whole.
    pub mix: Mix,
}

/// Failure modes a share of a server's calls fail in: each call draws one uniform number and
/// fails in the first mode whose cumulative share is above it. Compact (no flap, which is a
/// state of the server, not a share of calls) so that copying a server stays cheap.
#[derive(Clone, Copy, Default)]
pub(crate) struct Mix {
    len: u8,
    /// Cumulative share up to and including each mode.
    upto: [f64; MAX_FAILURE_MIX],
    mode: [MixMode; MAX_FAILURE_MIX],
}

#[derive(Clone, Copy, Default)]
enum MixMode {
    #[default]
    Hang,
    FailFast(u64),
    Refuse,
    Reset,
    Slow(f64),
    Error(f64),
}

impl Mix {
    /// The mix of `shares` (validated: at most [`MAX_FAILURE_MIX`], none `none` or `flap`).
    pub(crate) fn new(shares: &[FailureShare]) -> Self {
        let mut m = Mix::default();
        let mut upto = 0.0;
        for f in shares.iter().take(MAX_FAILURE_MIX) {
            let mode = match f.failure {
                FailureMode::Hang => MixMode::Hang,
                FailureMode::FailFast { after } | FailureMode::ServerError { after } => {
                    MixMode::FailFast(ns(after))
                }
                FailureMode::Refuse => MixMode::Refuse,
                FailureMode::Reset => MixMode::Reset,
                FailureMode::Slow { factor } => MixMode::Slow(factor),
                FailureMode::Error { probability } => MixMode::Error(probability),
                FailureMode::None | FailureMode::Flap { .. } => continue,
            };
            upto += f.share;
            m.upto[m.len as usize] = upto;
            m.mode[m.len as usize] = mode;
            m.len += 1;
        }
        m
    }

    /// The mode this call fails in, if any.
    #[inline]
    fn draw<R: Rng + ?Sized>(&self, rng: &mut R) -> Option<MixMode> {
        let u: f64 = rng.gen();
        (0..self.len as usize)
            .find(|&i| u < self.upto[i])
            .map(|i| self.mode[i])
    }
}

impl Server {
    pub(crate) fn new(latency: LatencySampler, failure: FailureMode, flap_offset: u64) -> Self {
        Self {
            latency,
            failure,
            flap_offset,
            antagonist: 1.0,
            slowdown: 1.0,
            mix: Mix::default(),
        }
    }

    /// What a call to a server with a failure mix asks: one draw says whether, and how, it
    /// fails.
    #[inline]
    fn mixed_demand<R: Rng + ?Sized>(&self, never: u64, rng: &mut R) -> Demand {
        match self.mix.draw(rng) {
            None => Demand::Work(self.base(rng), true),
            Some(MixMode::Hang) => Demand::Bypass(never, false),
            Some(MixMode::FailFast(after)) => Demand::Bypass(after, false),
            Some(MixMode::Refuse) => Demand::Bypass(0, false),
            Some(MixMode::Reset) => Demand::Work(self.base(rng) + ns(RESET_CUT), false),
            Some(MixMode::Slow(factor)) => {
                Demand::Work((self.base(rng) as f64 * factor) as u64, true)
            }
            Some(MixMode::Error(p)) => {
                let t = self.base(rng);
                Demand::Work(t, rng.gen::<f64>() >= p)
            }
        }
    }

    #[inline]
    fn base<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        (self.latency.sample_secs(rng) * 1e9) as u64
    }

    /// How many times slower than normal the server works right now.
    #[inline]
    pub(crate) fn factor(&self) -> f64 {
        self.antagonist * self.slowdown
    }

    /// True while the server is failing (for a flapping one: while down).
    #[inline]
    pub(crate) fn failing(&self, now: u64) -> bool {
        match self.failure {
            FailureMode::None => false,
            FailureMode::Flap { up, down, .. } => {
                let up = ns(up);
                (now + self.flap_offset) % (up + ns(down)) >= up
            }
            _ => true,
        }
    }

    /// What a call arriving now asks of the server; `never` is what "no answer" costs the
    /// caller (its timeout).
    #[inline]
    pub(crate) fn demand<R: Rng + ?Sized>(&self, now: u64, never: u64, rng: &mut R) -> Demand {
        if self.mix.len > 0 {
            return self.mixed_demand(never, rng);
        }
        match self.failure {
            FailureMode::None => Demand::Work(self.base(rng), true),
            FailureMode::Hang => Demand::Bypass(never, false),
            FailureMode::FailFast { after } | FailureMode::ServerError { after } => {
                Demand::Bypass(ns(after), false)
            }
            FailureMode::Refuse => Demand::Bypass(0, false),
            // The answer is worked out, then cut on its way.
            FailureMode::Reset => Demand::Work(self.base(rng) + ns(RESET_CUT), false),
            FailureMode::Slow { factor } => {
                Demand::Work((self.base(rng) as f64 * factor) as u64, true)
            }
            FailureMode::Error { probability } => {
                let t = self.base(rng);
                Demand::Work(t, rng.gen::<f64>() >= probability)
            }
            FailureMode::Flap {
                down_fails_after, ..
            } => {
                if self.failing(now) {
                    Demand::Bypass(down_fails_after.map_or(never, ns), false)
                } else {
                    Demand::Work(self.base(rng), true)
                }
            }
        }
    }

    /// Whether a load probe gets an answer now (a server that hangs or refuses connections
    /// gives none).
    pub(crate) fn answers_probes(&self, now: u64) -> bool {
        match self.failure {
            FailureMode::Hang | FailureMode::Refuse => false,
            FailureMode::Flap {
                down_fails_after, ..
            } => !self.failing(now) || down_fails_after.is_some(),
            _ => true,
        }
    }

    /// An active health probe's verdict (probes take no place in the server's queue).
    pub(crate) fn probe(&self, now: u64, timeout: u64, rng: &mut StdRng) -> bool {
        if self.mix.len > 0 {
            // A probe is one more call: it fails as often as the calls do.
            return match self.mixed_demand(timeout, rng) {
                Demand::Work(t, ok) | Demand::Bypass(t, ok) => ok && t < timeout,
            };
        }
        match self.failure {
            FailureMode::None => true,
            FailureMode::Hang
            | FailureMode::FailFast { .. }
            | FailureMode::Refuse
            | FailureMode::Reset => false,
            _ => match self.demand(now, timeout, rng) {
                Demand::Work(t, ok) | Demand::Bypass(t, ok) => ok && t < timeout,
            },
        }
    }
}

/// Nanoseconds of a duration, capped far below u64's range so that sums cannot overflow.
#[inline]
pub(crate) fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128 / 4) as u64
}

/// One call's work at a server with a capacity.
#[derive(Clone, Copy)]
pub(crate) struct Job {
    /// The server (global position).
    pub server: u32,
    /// The request slot and which of its tries this is.
    pub slot: u32,
    pub which: u8,
    /// Whether the answer will be good.
    pub ok: bool,
    /// The caller has gone (timed out, or its other try won): nobody takes the answer.
    pub abandoned: bool,
    /// The server has started on it (no longer in its queue).
    pub started: bool,
    /// Service time at full speed.
    pub work: u64,
    /// How the server saw it arrive (for its load estimate).
    pub ticket: keel_balance::Ticket,
}

/// Where calls wait and are served at one server.
pub(crate) enum Station {
    /// No capacity limit: every call is served at once.
    Unlimited,
    /// At most `concurrency` in service, the rest in FIFO order. Abandoned calls stay in
    /// `queue` until they reach its head (a lazy removal), and are then dropped unserved.
    Fifo {
        concurrency: u32,
        busy: u32,
        queue: VecDeque<u32>,
    },
    /// Processor sharing on a virtual clock: `v` is the service each present call has received
    /// so far (in full-speed nanoseconds), so a call that arrived at `v0` with work `w` is done
    /// when `v` reaches `v0 + w`; `finishes` orders those instants.
    Ps {
        concurrency: u32,
        v: f64,
        at: u64,
        /// The next completion event's time (u64::MAX: none), to recognise stale events.
        due: u64,
        finishes: BinaryHeap<Reverse<(u64, u32)>>,
    },
}

impl Station {
    pub(crate) fn new(capacity: Option<(u32, Discipline)>) -> Self {
        match capacity {
            None => Station::Unlimited,
            Some((concurrency, Discipline::Fifo)) => Station::Fifo {
                concurrency,
                busy: 0,
                queue: VecDeque::new(),
            },
            Some((concurrency, Discipline::Ps)) => Station::Ps {
                concurrency,
                v: 0.0,
                at: 0,
                due: u64::MAX,
                finishes: BinaryHeap::new(),
            },
        }
    }
}

/// Processor sharing's speed per call with `n` calls present on a server `factor` times slower
/// than normal.
#[inline]
pub(crate) fn ps_rate(concurrency: u32, n: usize, factor: f64) -> f64 {
    if n == 0 {
        return 0.0;
    }
    (f64::from(concurrency) / n as f64).min(1.0) / factor
}
