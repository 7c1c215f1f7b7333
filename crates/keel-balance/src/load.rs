//! Server-reported load: what a server says about itself (requests in flight and the latency a
//! new request would see there), the server's side that works it out, and how it travels in
//! HTTP headers.
//!
//! One vocabulary for three drivers: the simulator's servers keep a [`ServerLoad`] each and
//! answer probes with its [`LoadReport`]; `keel backend` keeps one and puts its report on every
//! answer ([`RIF_HEADER`], [`LATENCY_HEADER`]) and on `GET /keel/load`; the proxy reads those
//! headers back with [`LoadReport::from_headers`] and hands the report to the balancer.

use std::cell::Cell;
use std::time::Duration;

use crate::time::nanos;

/// Response header carrying the server's requests in flight (a decimal integer), as Envoy's
/// ORCA carries server-reported load.
pub const RIF_HEADER: &str = "x-keel-rif";

/// Response header carrying the server's latency estimate in whole microseconds.
pub const LATENCY_HEADER: &str = "x-keel-latency-us";

/// The path at which a server answers a load probe (`GET`): at once, with both headers, without
/// counting the probe as a request in flight.
pub const LOAD_PATH: &str = "/keel/load";

/// What a server says about its load: requests in flight and the latency a new request would
/// see there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadReport {
    /// Requests the server has in flight (received, not yet answered), from all clients.
    pub in_flight: u32,
    /// The server's estimate of a new request's latency (zero: no estimate yet).
    pub latency: Duration,
}

impl LoadReport {
    /// The latency in whole microseconds, as [`LATENCY_HEADER`] carries it.
    pub fn latency_us(&self) -> u64 {
        self.latency.as_micros().min(u128::from(u64::MAX)) as u64
    }

    /// The report of a response's [`RIF_HEADER`] and [`LATENCY_HEADER`] values (ASCII decimal
    /// integers, surrounding blanks allowed); `None` if either is missing or not a number.
    pub fn from_headers(rif: Option<&[u8]>, latency_us: Option<&[u8]>) -> Option<Self> {
        let in_flight = u32::try_from(decimal(rif?)?).ok()?;
        let latency = Duration::from_micros(decimal(latency_us?)?);
        Some(Self { in_flight, latency })
    }
}

/// What an endpoint says about its utilisation, in ORCA's vocabulary (the
/// `endpoint-load-metrics` header, [`crate::orca`]): what gRPC's and Envoy's weighted
/// round-robin and keel's zone routing balance on.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Utilization {
    /// `cpu_utilization`: the CPU in use, 0 to 1 (more on a machine that reports per core).
    pub cpu: f64,
    /// `application_utilization`: the application's own measure of how busy it is; used
    /// instead of `cpu` when above zero.
    pub application: f64,
    /// `rps_fractional`: queries per second the endpoint served.
    pub qps: f64,
    /// `eps`: errors per second.
    pub eps: f64,
}

impl Utilization {
    /// The utilisation that counts: `application` when above zero, else `cpu` (gRFC A58).
    pub fn value(&self) -> f64 {
        if self.application > 0.0 {
            self.application
        } else {
            self.cpu
        }
    }
}

/// A decimal integer of at most 19 digits (no overflow possible), blanks trimmed.
fn decimal(text: &[u8]) -> Option<u64> {
    let text = text.trim_ascii();
    if text.is_empty() || text.len() > 19 {
        return None;
    }
    text.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

/// Completed requests a [`ServerLoad`] remembers for its latency estimate.
const SERVER_HISTORY: usize = 64;

/// How long a completed request counts in a [`ServerLoad`]'s estimate, by default.
pub const SERVER_WINDOW: Duration = Duration::from_secs(1);

/// A request as a [`ServerLoad`] saw it arrive: give it back to [`ServerLoad::finish`] (or
/// [`ServerLoad::cancel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ticket {
    found: u32,
    at: u64,
}

impl Ticket {
    /// Requests in flight at the server when this one arrived.
    pub fn found(&self) -> u32 {
        self.found
    }
}

/// A server's own load: requests in flight, and the latencies of its last 64 requests, each
/// with the in-flight count it arrived to. Its estimate for a new request is the median
/// latency of the remembered requests of the last second (`window`) that arrived to about as
/// many in flight as there are now (the same power-of-two band: 0, 1, 2-3, 4-7, ...), or of the
/// nearest band with any: as Prequal's servers do, it learns how latency grows with load
/// without knowing how the server works (one worker or many, queue or shared CPU).
///
/// Within the band, each remembered latency is scaled by (in flight now + 1) / (in flight it
/// arrived to + 1), as on a server that works through its requests one after another: a band
/// spans up to 2x (8-15), and its plain median said the same for 8 and 15 in flight, so a
/// balancer ranking reports by latency could not tell a server at 15 from one at 8 (measured:
/// prequal lost to least-request on 10 servers). The same scaling carries a neighbouring
/// band's latencies over when the server's own band has none.
///
/// With no recent request the estimate is zero ("no idea"): a server that a balancer stopped
/// using because it looked slow is tried again once its bad samples are a window old, instead
/// of keeping its last, bad estimate forever (without the window, some servers of a simulated
/// cluster of identical ones were never used again after one slow spell).
///
/// Not thread-safe by itself (`&mut self`, and not `Sync`: a report remembers its median for
/// the next); a multi-threaded server wraps it in a mutex.
#[derive(Debug, Clone)]
pub struct ServerLoad {
    in_flight: u32,
    window: u64,
    /// (in-flight count at arrival, latency in ns, completed at), a ring.
    history: [(u32, u64, u64); SERVER_HISTORY],
    next: usize,
    len: usize,
    /// The last estimate's median sample, for the reports that come before anything it rests
    /// on changes (a prequal simulation reads three reports per call, and working each out
    /// afresh was a third of its time).
    median: Cell<Option<Median>>,
}

/// The sample a median fell on, and what it holds for.
#[derive(Debug, Clone, Copy)]
struct Median {
    /// The band of in-flight counts it was worked out for.
    want: u8,
    /// It holds from `from` to before `until`: over that span the same samples are recent
    /// (and `finish`, the only change to the samples, forgets it).
    from: u64,
    until: u64,
    /// (in flight at arrival, latency) of the median sample; `None`: no recent sample.
    sample: Option<(u32, u64)>,
}

impl Default for ServerLoad {
    fn default() -> Self {
        Self::new(SERVER_WINDOW)
    }
}

/// The power-of-two band of an in-flight count.
#[inline]
fn band(in_flight: u32) -> u8 {
    (32 - in_flight.leading_zeros()) as u8
}

impl ServerLoad {
    /// An idle server with no history, whose estimate uses the requests of the last `window`.
    pub fn new(window: Duration) -> Self {
        Self {
            in_flight: 0,
            window: nanos(window),
            history: [(0, 0, 0); SERVER_HISTORY],
            next: 0,
            len: 0,
            median: Cell::new(None),
        }
    }

    /// A request arrives at `now`.
    pub fn start(&mut self, now: Duration) -> Ticket {
        let found = self.in_flight;
        self.in_flight += 1;
        Ticket {
            found,
            at: nanos(now),
        }
    }

    /// The request of `ticket` is answered at `now`.
    pub fn finish(&mut self, ticket: Ticket, now: Duration) {
        let now = nanos(now);
        self.in_flight = self.in_flight.saturating_sub(1);
        self.history[self.next] = (ticket.found, now.saturating_sub(ticket.at), now);
        self.next = (self.next + 1) % SERVER_HISTORY;
        self.len = (self.len + 1).min(SERVER_HISTORY);
        self.median.set(None);
    }

    /// The request of `ticket` leaves unanswered (its client went away before the server
    /// started on it): no longer in flight, and no latency to learn from.
    pub fn cancel(&mut self, _ticket: Ticket) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The report a probe gets at `now`.
    pub fn report(&self, now: Duration) -> LoadReport {
        LoadReport {
            in_flight: self.in_flight,
            latency: Duration::from_nanos(self.estimate_ns(nanos(now))),
        }
    }

    fn estimate_ns(&self, now: u64) -> u64 {
        let want = band(self.in_flight);
        let m = match self.median.get() {
            Some(m) if m.want == want && m.from <= now && now < m.until => m,
            _ => {
                let m = self.median_at(now, want);
                self.median.set(Some(m));
                m
            }
        };
        m.sample
            .map_or(0, |(found, ns)| scale(ns, self.in_flight, found))
    }

    /// The median for an estimate at `now` in band `want`.
    ///
    /// The estimate is the median of the chosen band's latencies, each scaled by the ratio
    /// (in flight + 1) / (found + 1). Scaling is monotone in latency / (found + 1), so the
    /// median of the scaled values is the scaled value of the sample with the median ratio:
    /// that sample holds while the in-flight count moves within its band, and is what is
    /// remembered.
    fn median_at(&self, now: u64, want: u8) -> Median {
        let recent = |at: u64| now.saturating_sub(at) <= self.window;
        // Which bands have recent samples, as a bit mask (bands are 0..=32), and when the
        // first recent sample stops being recent, in one pass.
        let mut bands = 0u64;
        let mut until = u64::MAX;
        for &(found, _, at) in &self.history[..self.len] {
            if recent(at) {
                bands |= 1 << band(found);
                until = until.min(at.saturating_add(self.window).saturating_add(1));
            }
        }
        let mut m = Median {
            want,
            from: now,
            until,
            sample: None,
        };
        if bands == 0 {
            return m;
        }
        // The nearest band that has samples; between two as near, the busier one (a guess on
        // the slow side does not attract load the server may not take).
        let b = (0..=32u8)
            .find_map(|d| {
                let up = want + d;
                if up <= 32 && bands & (1 << up) != 0 {
                    return Some(up);
                }
                let down = want.checked_sub(d)?;
                (bands & (1 << down) != 0).then_some(down)
            })
            .expect("some band has samples");
        let mut xs = [(0u32, 0u64); SERVER_HISTORY];
        let mut n = 0;
        for &(found, ns, at) in &self.history[..self.len] {
            if recent(at) && band(found) == b {
                xs[n] = (found, ns);
                n += 1;
            }
        }
        // By latency / (found + 1), compared exactly: a x (g + 1) against b x (f + 1).
        let xs = &mut xs[..n];
        let (_, median, _) = xs.select_nth_unstable_by(n / 2, |&(f, a), &(g, b)| {
            (u128::from(a) * (u128::from(g) + 1)).cmp(&(u128::from(b) * (u128::from(f) + 1)))
        });
        m.sample = Some(*median);
        m
    }
}

/// `ns` x (in flight + 1) / (found + 1), in u64 unless it overflows (u128 division is a
/// library call), saturated.
#[inline]
pub(crate) fn scale(ns: u64, in_flight: u32, found: u32) -> u64 {
    let now_plus_one = u64::from(in_flight) + 1;
    match ns.checked_mul(now_plus_one) {
        Some(p) => p / (u64::from(found) + 1),
        None => {
            let scaled = u128::from(ns) * u128::from(now_plus_one) / (u128::from(found) + 1);
            scaled.min(u128::from(u64::MAX)) as u64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn rep(in_flight: u32, latency_ms: u64) -> LoadReport {
        LoadReport {
            in_flight,
            latency: ms(latency_ms),
        }
    }

    #[test]
    fn server_load_estimates_by_in_flight_band_over_the_last_second() {
        let mut s = ServerLoad::default();
        assert_eq!(s.report(ms(0)), rep(0, 0));
        // Alone, requests take 10 ms; arriving to 4-7 in flight, 50 ms.
        for i in 0..10 {
            let t = s.start(ms(10 * i));
            s.finish(t, ms(10 * i + 10));
        }
        let held: Vec<Ticket> = (0..5).map(|_| s.start(ms(100))).collect();
        assert_eq!(s.in_flight(), 5);
        // Nothing seen at 4-7 yet: the nearest band with samples (0) says 10 ms at 0 in
        // flight, 60 ms at 5.
        assert_eq!(s.report(ms(100)), rep(5, 60));
        for lat in [40, 50, 60] {
            let t = s.start(ms(100));
            assert_eq!(t.found(), 5);
            s.finish(t, ms(100 + lat));
        }
        assert_eq!(s.report(ms(200)), rep(5, 50));
        // 64 newer samples push the old ones out.
        for _ in 0..64 {
            let t = s.start(ms(200));
            s.finish(t, ms(290));
        }
        assert_eq!(s.report(ms(300)), rep(5, 90));
        // A second later nothing is recent: no estimate.
        assert_eq!(s.report(ms(1291)), rep(5, 0));
        for t in held {
            s.cancel(t);
        }
        assert_eq!(s.in_flight(), 0);
    }

    /// A band's plain median said the same for 8 and 15 in flight. Ten requests
    /// that arrived to 8 in flight took 90 ms (10 ms each, one after another); at 15 in flight
    /// the estimate is 90 x 16 / 9 = 160 ms, at 8 it is 90 ms. Before, both said 90 ms.
    #[test]
    fn the_estimate_is_scaled_by_in_flight_within_the_band() {
        let mut s = ServerLoad::default();
        let mut held: Vec<Ticket> = (0..8).map(|_| s.start(ms(0))).collect();
        for i in 0..10 {
            let t = s.start(ms(i));
            assert_eq!(t.found(), 8);
            s.finish(t, ms(i + 90));
        }
        assert_eq!(s.report(ms(100)), rep(8, 90));
        held.extend((0..7).map(|_| s.start(ms(100))));
        assert_eq!(s.report(ms(100)), rep(15, 160));
        for t in held {
            s.cancel(t);
        }
    }

    /// The estimate as it was computed before its one-pass rewrite (bands compared sample by
    /// sample, u128 arithmetic throughout): the rewrite must give the same nanosecond.
    fn estimate_reference(s: &ServerLoad, now: u64) -> u64 {
        let recent = |&&(_, _, at): &&(u32, u64, u64)| now.saturating_sub(at) <= s.window;
        let want = band(s.in_flight);
        let mut best: Option<u8> = None;
        for &(found, _, _) in s.history[..s.len].iter().filter(recent) {
            let b = band(found);
            let closer = match best {
                None => true,
                Some(cur) => {
                    let (d, dc) = (b.abs_diff(want), cur.abs_diff(want));
                    d < dc || (d == dc && b > cur)
                }
            };
            if closer {
                best = Some(b);
            }
        }
        let Some(b) = best else {
            return 0;
        };
        let mut xs: Vec<u64> = s.history[..s.len]
            .iter()
            .filter(recent)
            .filter(|x| band(x.0) == b)
            .map(|&(found, ns, _)| {
                let v = u128::from(ns) * (u128::from(s.in_flight) + 1) / (u128::from(found) + 1);
                v.min(u128::from(u64::MAX)) as u64
            })
            .collect();
        let mid = xs.len() / 2;
        *xs.select_nth_unstable(mid).1
    }

    #[test]
    fn the_estimate_matches_its_reference_on_random_histories() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = |m: u64| {
            x = crate::mix64(x);
            x % m
        };
        for _ in 0..2000 {
            let mut s = ServerLoad::new(Duration::from_nanos(1 + next(2_000)));
            let mut held = Vec::new();
            let mut now = 0;
            for _ in 0..next(150) {
                now += next(100);
                if next(3) == 0 || held.is_empty() {
                    held.push(s.start(Duration::from_nanos(now)));
                } else {
                    let t = held.swap_remove(next(held.len() as u64) as usize);
                    // Now and then a latency so large that the u64 product overflows.
                    let late = if next(50) == 0 {
                        u64::MAX / 4
                    } else {
                        next(1_000)
                    };
                    s.finish(t, Duration::from_nanos(t.at.saturating_add(late)));
                }
                // Twice, at times in any order: the second may reuse the first's median.
                for _ in 0..2 {
                    let at = now + next(1_500);
                    assert_eq!(
                        s.estimate_ns(at),
                        estimate_reference(&s, at),
                        "{s:?} at {at}"
                    );
                }
            }
        }
    }

    #[test]
    fn reports_read_back_from_header_values() {
        let r = LoadReport::from_headers(Some(b"12"), Some(b" 3500 ")).unwrap();
        assert_eq!(r.in_flight, 12);
        assert_eq!(r.latency, Duration::from_micros(3500));
        assert_eq!(r.latency_us(), 3500);
        for (rif, lat) in [
            (None, Some(&b"1"[..])),
            (Some(&b"1"[..]), None),
            (Some(b"-1"), Some(b"1")),
            (Some(b"1"), Some(b"1.5")),
            (Some(b""), Some(b"1")),
            (Some(b"4294967296"), Some(b"1")),
            (Some(b"1"), Some(b"99999999999999999999")),
        ] {
            assert_eq!(LoadReport::from_headers(rif, lat), None, "{rif:?} {lat:?}");
        }
    }
}
