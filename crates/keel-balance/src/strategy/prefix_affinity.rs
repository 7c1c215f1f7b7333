//! prefix-affinity: an inference prompt goes to the endpoint whose prefix cache likely holds
//! the most of its leading blocks, within bounded loads.
//!
//! keel keeps, per endpoint, an estimate of the blocks its engine caches: an LRU of block
//! names ([`crate::prefix`]) of `cache_blocks` entries, updated at each pick with the prompt's
//! blocks (the engine will cache them). An endpoint's match is the number of the prompt's
//! leading blocks its estimate holds. Among the endpoints that are not full, the longest match
//! wins; equal matches go to the session key's endpoint (rendezvous on `PickContext::hash_key`)
//! when there is one, then, for a prompt matched nowhere, to the endpoint holding the fewest
//! prompts' first blocks (a new prefix gets the most room: the prefixes spread evenly), then
//! to the least loaded, then at random. A prompt with no blocks at all goes by load. A match
//! shorter than [`MIN_MATCH`] of the prompt counts as none: a system prompt of a block or two
//! that every request starts with would otherwise draw every new conversation to the
//! endpoints that already hold it and leave another idle.
//!
//! An endpoint is full when it holds at least ceil(c x (calls in flight + 1) x weight share)
//! calls (the hash strategies' bounded loads, c = `bounded_load`, default 1.25) **and** at
//! least [`SLACK`] (5) more than the least loaded endpoint the call may take. Both are relative
//! to the pool's state and hold at any load, so one hot prefix spills to the next best endpoint
//! once its own is that far ahead, where a switch to balancing that fires only above an
//! absolute imbalance of 64 calls lets a pool of three serve 150/0/0; the slack keeps the
//! chance imbalance of a few calls in flight from spilling prefixes onto engines that lack them.
//!
//! A failed call (refused, reset, timed out, a 5xx: the driver's `Outcome::Failure`; never a
//! 4xx) drops the endpoint's estimate (a restarted engine has lost its cache) and passes the
//! endpoint over for [`FAILED_PASS_OVER`] unless every other endpoint is full or unavailable,
//! or until one of its calls picked after the failure succeeds: the prefix moves to its
//! next-best endpoint after one failed try, not after the ten an outlier detector may need. After that the emptied estimate
//! takes new prefixes first, so a still-failing engine costs each new prefix at most one
//! failed try per period.
//!
//! The estimates sit behind one lock per strategy, taken once per pick (the match of each
//! endpoint, then the chosen endpoint's update: about a microsecond for a prompt of a few
//! dozen blocks on three endpoints). The proxy shares one balancer per cluster between its
//! workers (one per core), so at most that many picks wait on it, each for that long.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::api::{Call, LoadKey, Observation, Strategy, View};
use super::hashing::Cap;
use crate::config::{StrategyOptions, TieBreak, DEFAULT_AFFINITY_BOUND};
use crate::endpoint::Endpoint;
use crate::hash::rendezvous_score;
use crate::rng::{below, mix64};
use crate::Outcome;

/// Calls an endpoint may hold ahead of the least loaded one before the relative bound applies.
///
/// A relative bound alone is coarse at a few calls in flight: with 6 in flight on 3 endpoints
/// its cap is 3, and a placement that gives each endpoint its share of the prefixes still puts
/// a fourth call on one of them about one pick in five, by chance. Spilling that call costs
/// the whole shared prefix's prefill on an engine that lacks it (400 tokens: 100 ms at 4,000
/// tokens/s, and every call batched with it waits) and makes that engine a second home for
/// the prefix, which crowds the caches; the calls ahead of it on its own engine cost it only a
/// share of their steps. One hot prefix reaches 5 ahead at once (every call on one endpoint);
/// a balanced placement at 6 in flight about one pick in 250 (the 5 others all on the new
/// call's endpoint). At larger loads the relative bound is the larger and decides. SMG's
/// `cache_aware` has the same two terms (64 calls, 1.5 x the idlest).
const SLACK: u32 = 5;

/// The least share of a prompt's blocks an endpoint must hold for its match to count (SMG's
/// `cache_threshold`, 0.3 by default there too). Shorter matches are the few blocks every
/// request shares (a system prompt): on a Mooncake conversation trace, where every request
/// starts with the same block, counting them sent new conversations to two of three engines
/// (160/0/157 requests, 0.27 of prompt tokens from cache against 0.35 spread evenly).
pub(crate) const MIN_MATCH: f64 = 0.3;

/// How long an endpoint whose call failed is passed over (nanoseconds): long enough for its
/// prefixes to settle on their next-best endpoints, short enough that a recovered engine
/// soon takes its share again.
pub(crate) const FAILED_PASS_OVER: u64 = 5_000_000_000;

/// The strategy: the load bound and the per-endpoint estimates.
pub(crate) struct PrefixAffinity {
    bound: f64,
    total_weight: u64,
    /// Every weight equal (rendezvous skips its logarithm).
    uniform: bool,
    caches: Mutex<Vec<BlockLru>>,
    /// Per endpoint: when its last call failed (view nanoseconds, at least 1), or 0 after a
    /// success.
    failed_at: Box<[AtomicU64]>,
}

impl PrefixAffinity {
    pub(crate) fn new(o: &StrategyOptions, eps: &[Arc<Endpoint>]) -> Self {
        Self {
            bound: o.bounded_load.unwrap_or(DEFAULT_AFFINITY_BOUND),
            total_weight: eps.iter().map(|e| u64::from(e.weight())).sum(),
            uniform: eps.windows(2).all(|w| w[0].weight() == w[1].weight()),
            caches: Mutex::new(
                (0..eps.len())
                    .map(|_| BlockLru::new(o.cache_blocks))
                    .collect(),
            ),
            failed_at: eps.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Endpoint `i` failed a call less than [`FAILED_PASS_OVER`] ago and has not succeeded
    /// since.
    #[inline]
    fn passed_over(&self, v: &View<'_>, i: usize) -> bool {
        let at = self
            .failed_at
            .get(i)
            .map_or(0, |a| a.load(Ordering::Relaxed));
        at != 0 && v.now.saturating_sub(at) < FAILED_PASS_OVER
    }
}

impl Strategy for PrefixAffinity {
    fn pick(&self, v: &View<'_>, call: Call<'_>) -> Option<usize> {
        if call.prefix.is_empty() && call.key.is_none() {
            // Nothing to be near: the least loaded (no lock taken).
            return v.min_by(TieBreak::Random, |i| LoadKey(v, i));
        }
        let cap = Cap::new(v, Some(self.bound), self.total_weight);
        let idlest = (0..v.eps.len())
            .filter(|&i| v.allowed(i))
            .map(|i| v.load(i))
            .min()
            .unwrap_or(0);
        // Full: at the relative bound and SLACK calls ahead of the least loaded.
        let admits = |i: usize| cap.admits(v, i) || v.load(i) < idlest + SLACK;
        let mut caches = self.caches.lock().unwrap_or_else(PoisonError::into_inner);
        // (index, match, session score); ties in all three drawn uniformly (reservoir).
        let mut best: Option<(usize, usize, f64)> = None;
        let mut tied = 0usize;
        let mut bits = v.rng.next_u64();
        for (i, cache) in caches.iter().enumerate().take(v.eps.len()) {
            if !v.allowed(i) || !admits(i) {
                continue;
            }
            let m = cache.leading(call.prefix);
            let m = if (m as f64) < MIN_MATCH * call.prefix.len() as f64 {
                0
            } else {
                m
            };
            let s = call.key.map_or(0.0, |k| {
                let e = &v.eps[i];
                rendezvous_score(k, e.hash(), e.weight(), self.uniform)
            });
            let order = match best {
                None => std::cmp::Ordering::Greater,
                Some((b, bm, bs)) => self
                    .passed_over(v, b)
                    .cmp(&self.passed_over(v, i))
                    .then(m.cmp(&bm))
                    .then(s.partial_cmp(&bs).unwrap_or(std::cmp::Ordering::Equal))
                    // A prompt matched nowhere starts a new home: the endpoint holding the
                    // fewest prompts' first blocks (the most room for it, SMG's smallest tree).
                    .then_with(|| match m {
                        0 => caches[b].heads.cmp(&cache.heads),
                        _ => std::cmp::Ordering::Equal,
                    })
                    .then_with(|| v.lighter(b, i)),
            };
            match order {
                std::cmp::Ordering::Greater => {
                    best = Some((i, m, s));
                    tied = 1;
                }
                std::cmp::Ordering::Equal => {
                    tied += 1;
                    bits = mix64(bits);
                    if below(bits, tied) == 0 {
                        best = Some((i, m, s));
                    }
                }
                std::cmp::Ordering::Less => {}
            }
        }
        // Every allowed endpoint full (only when some are unavailable): the least loaded
        // rather than none.
        let i = match best {
            Some((i, _, _)) => i,
            None => v.min_by(TieBreak::LowestIndex, |i| LoadKey(v, i))?,
        };
        if let Some(cache) = caches.get_mut(i) {
            cache.touch(call.prefix);
        }
        Some(i)
    }

    fn uses_group_load(&self) -> bool {
        true
    }

    fn follows_calls(&self) -> bool {
        true
    }

    fn observe(&self, v: &View<'_>, i: usize, what: &Observation) {
        let Observation::CallEnded {
            outcome,
            latency_ns,
        } = what
        else {
            return;
        };
        let Some(at) = self.failed_at.get(i) else {
            return;
        };
        match outcome {
            Outcome::Success => {
                // Only a call picked after the failure clears it: one already running on the
                // engine when it failed says nothing of it since.
                let failed = at.load(Ordering::Relaxed);
                if failed != 0 && v.now.saturating_sub(*latency_ns) >= failed {
                    at.store(0, Ordering::Relaxed);
                }
            }
            Outcome::Failure => {
                at.store(v.now.max(1), Ordering::Relaxed);
                let mut caches = self.caches.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(cache) = caches.get_mut(i) {
                    cache.clear();
                }
            }
        }
    }
}

/// Hashes a block name to itself: names are xxh3 hashes already, uniform in every bit.
#[derive(Default)]
struct BlockName(u64);

impl Hasher for BlockName {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (keys are u64); fold anything else in anyway.
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const NIL: u32 = u32::MAX;

/// One endpoint's estimate: the `cap` most recently used block names, in a list threaded
/// through `slots` (no allocation once full: the least recent slot is reused).
struct BlockLru {
    index: HashMap<u64, u32, BuildHasherDefault<BlockName>>,
    slots: Vec<Slot>,
    /// Most recent.
    head: u32,
    /// Least recent: the next evicted.
    tail: u32,
    cap: usize,
    /// Slots holding the first block of a prompt.
    heads: usize,
}

struct Slot {
    name: u64,
    head: bool,
    prev: u32,
    next: u32,
}

impl BlockLru {
    fn new(cap: u32) -> Self {
        Self {
            index: HashMap::with_capacity_and_hasher(2 * cap.max(1) as usize, Default::default()),
            slots: Vec::with_capacity(cap.max(1) as usize),
            head: NIL,
            tail: NIL,
            cap: cap.max(1) as usize,
            heads: 0,
        }
    }

    /// Forgets every block (keeping the allocations).
    fn clear(&mut self) {
        self.index.clear();
        self.slots.clear();
        (self.head, self.tail, self.heads) = (NIL, NIL, 0);
    }

    /// How many of `prefix`'s first blocks are held.
    fn leading(&self, prefix: &[u64]) -> usize {
        if self.index.is_empty() {
            return 0;
        }
        prefix
            .iter()
            .take_while(|b| self.index.contains_key(b))
            .count()
    }

    /// Marks the prompt's blocks (at most `cap` of its first) as just used, deepest first, so
    /// that its first block is the most recent: the LRU then evicts a prefix from its end, as
    /// vLLM's free-block queue does, and what it holds of a prompt stays a prefix of it.
    fn touch(&mut self, prefix: &[u64]) {
        let n = prefix.len().min(self.cap);
        for (k, &name) in prefix[..n].iter().enumerate().rev() {
            self.touch_one(name, k == 0);
        }
    }

    fn touch_one(&mut self, name: u64, first: bool) {
        if let Some(&s) = self.index.get(&name) {
            if s != self.head {
                self.unlink(s);
                self.push_front(s);
            }
            if first && !self.slots[s as usize].head {
                self.slots[s as usize].head = true;
                self.heads += 1;
            }
            return;
        }
        let s = if self.slots.len() < self.cap {
            self.slots.push(Slot {
                name,
                head: false,
                prev: NIL,
                next: NIL,
            });
            (self.slots.len() - 1) as u32
        } else {
            let s = self.tail;
            self.unlink(s);
            let old = self.slots[s as usize].name;
            self.index.remove(&old);
            if self.slots[s as usize].head {
                self.heads -= 1;
            }
            self.slots[s as usize].name = name;
            self.slots[s as usize].head = false;
            s
        };
        if first {
            self.slots[s as usize].head = true;
            self.heads += 1;
        }
        self.index.insert(name, s);
        self.push_front(s);
    }

    fn unlink(&mut self, s: u32) {
        let (prev, next) = {
            let slot = &self.slots[s as usize];
            (slot.prev, slot.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, s: u32) {
        let old = self.head;
        {
            let slot = &mut self.slots[s as usize];
            slot.prev = NIL;
            slot.next = old;
        }
        match old {
            NIL => self.tail = s,
            o => self.slots[o as usize].prev = s,
        }
        self.head = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::Bench;
    use std::sync::atomic::Ordering::Relaxed;

    fn strategy(b: &Bench, cache_blocks: u32) -> PrefixAffinity {
        let o = StrategyOptions {
            cache_blocks,
            ..StrategyOptions::default()
        };
        PrefixAffinity::new(&o, &b.eps)
    }

    /// A prompt of `n` blocks whose first `shared` are group `g`'s and the rest unique to `u`.
    fn prompt(g: u64, shared: usize, u: u64, n: usize) -> Vec<u64> {
        let mut names = Vec::with_capacity(n);
        let mut prev = None;
        for k in 0..n {
            let seed = if k < shared { g } else { 1_000_000 + u };
            let name = crate::prefix::chain(
                prev,
                &[seed.to_le_bytes(), (k as u64).to_le_bytes()].concat(),
            );
            names.push(name);
            prev = Some(name);
        }
        names
    }

    /// Picks with `call`, counting the call in flight as the balancer does.
    fn start(b: &Bench, s: &PrefixAffinity, call: Call<'_>) -> usize {
        let i = s.pick(&b.view(0), call).expect("an endpoint");
        b.eps[i].begin_call();
        b.group.fetch_add(1, Relaxed);
        i
    }

    fn end(b: &Bench, i: usize) {
        b.eps[i].end_call();
        b.group.fetch_sub(1, Relaxed);
    }

    fn with(prefix: &[u64]) -> Call<'_> {
        Call { key: None, prefix }
    }

    #[test]
    fn a_shared_prefix_goes_where_it_is_cached() {
        let b = Bench::new(&[1; 3]);
        let s = strategy(&b, 96);
        // Six groups of 25 blocks, each request with 2 unique blocks after its group's.
        let groups: Vec<Vec<Vec<u64>>> = (0..6)
            .map(|g| (0..10).map(|u| prompt(g, 25, g * 100 + u, 27)).collect())
            .collect();
        let mut home = [usize::MAX; 6];
        for u in 0..10 {
            for (g, prompts) in groups.iter().enumerate() {
                // One call at a time: the bound never binds, affinity decides alone.
                let i = start(&b, &s, with(&prompts[u]));
                end(&b, i);
                if u == 0 {
                    home[g] = i;
                } else {
                    assert_eq!(i, home[g], "group {g} moved at request {u}");
                }
            }
        }
        // With no match anywhere the first of each group went to the least loaded, at random
        // among idle endpoints: the groups spread.
        let mut used = home.to_vec();
        used.sort_unstable();
        used.dedup();
        assert!(used.len() >= 2, "{home:?}");
    }

    #[test]
    fn a_system_prompt_every_request_shares_does_not_draw_new_conversations() {
        let b = Bench::new(&[1; 3]);
        let s = strategy(&b, 960);
        // 30 conversations of 10 blocks, each starting with the same block (group 0's first
        // block: a system prompt), one call at a time.
        let mut per = [0usize; 3];
        for c in 0..30u64 {
            let p = prompt(0, 1, c, 10);
            let i = start(&b, &s, with(&p));
            end(&b, i);
            per[i] += 1;
        }
        // Counting the shared block as a match sent all 30 to the first endpoint that held it.
        assert!(per.iter().all(|&n| n >= 5), "{per:?}");
        // A conversation's next turn still goes where its own blocks are.
        let first = prompt(0, 1, 7, 10);
        let home = (0..3)
            .find(|&i| s.caches.lock().unwrap()[i].leading(&first) == 10)
            .unwrap();
        let next = prompt(0, 1, 7, 14);
        let i = start(&b, &s, with(&next));
        end(&b, i);
        assert_eq!(i, home);
    }

    #[test]
    fn requests_without_a_prompt_go_by_load() {
        let b = Bench::new(&[1; 3]);
        let s = strategy(&b, 96);
        b.eps[0].begin_call();
        b.eps[0].begin_call();
        b.eps[1].begin_call();
        for _ in 0..20 {
            assert_eq!(s.pick(&b.view(0), with(&[])), Some(2));
        }
    }

    #[test]
    fn eviction_forgets_the_least_recent_prompt_from_its_end() {
        let mut lru = BlockLru::new(8);
        let a = prompt(1, 6, 0, 6);
        let c = prompt(2, 6, 0, 6);
        lru.touch(&a);
        assert_eq!(lru.leading(&a), 6);
        lru.touch(&c);
        // 12 blocks into 8: a's last four went first, its first two stay.
        assert_eq!(lru.leading(&c), 6);
        assert_eq!(lru.leading(&a), 2);
        assert_eq!(lru.index.len(), 8);
        // Touching a again brings it back whole and pushes c's end out.
        lru.touch(&a);
        assert_eq!(lru.leading(&a), 6);
        assert_eq!(lru.leading(&c), 2);
        // A prompt longer than the cache: its first `cap` blocks are kept.
        let long = prompt(3, 20, 0, 20);
        lru.touch(&long);
        assert_eq!(lru.leading(&long), 8);
    }

    #[test]
    fn a_session_key_keeps_a_conversation_on_one_endpoint() {
        let b = Bench::new(&[1; 4]);
        let s = strategy(&b, 96);
        for key in 0..20u64 {
            let first = s
                .pick(
                    &b.view(0),
                    Call {
                        key: Some(key),
                        prefix: &[],
                    },
                )
                .unwrap();
            // The same key, a growing conversation: always the same endpoint.
            for turn in 1..5 {
                let p = prompt(500 + key, turn * 3, key, turn * 3);
                let i = s
                    .pick(
                        &b.view(0),
                        Call {
                            key: Some(key),
                            prefix: &p,
                        },
                    )
                    .unwrap();
                assert_eq!(i, first, "session {key} turn {turn}");
            }
        }
    }

    /// The most an endpoint may hold after a pick: under the relative bound, or under the
    /// least loaded + SLACK (both counted before the pick).
    fn limit(b: &Bench, before: u64) -> u32 {
        let n = b.eps.len() as f64;
        let cap = ((1.25 * (before + 1) as f64 / n).ceil() as u32).max(1);
        let idlest = b.eps.iter().map(|e| e.in_flight()).min().unwrap_or(0);
        cap.max(idlest + SLACK)
    }

    #[test]
    fn one_hot_prefix_spills_at_the_bound() {
        let b = Bench::new(&[1; 3]);
        let s = strategy(&b, 96);
        let hot = prompt(9, 25, 0, 25);
        let mut picked = Vec::new();
        for _ in 1..=60u64 {
            let limit = limit(&b, b.group.load(Relaxed));
            let i = start(&b, &s, with(&hot));
            assert!(
                b.eps[i].in_flight() <= limit,
                "{} > {limit}",
                b.eps[i].in_flight()
            );
            picked.push(i);
        }
        // 60 in flight: the relative cap of ceil(1.25 x 60 / 3) = 25 binds, not the slack.
        assert!(b.eps.iter().all(|e| e.in_flight() <= 25), "bounded");
        assert!(b.eps.iter().all(|e| e.in_flight() >= 10), "spread");
        for i in picked {
            end(&b, i);
        }
    }

    /// 12 calls of one prefix on 3 endpoints: the first endpoint takes 5 (SLACK ahead of the
    /// idle ones), the next 5, and the third the rest: every endpoint caches the prefix and
    /// then shares it by load.
    #[test]
    fn one_hot_prefix_reaches_every_endpoint_at_twelve_in_flight() {
        let b = Bench::new(&[1; 3]);
        let s = strategy(&b, 96);
        let hot = prompt(9, 25, 0, 27);
        let picked: Vec<usize> = (0..12).map(|_| start(&b, &s, with(&hot))).collect();
        let mut loads: Vec<u32> = b.eps.iter().map(|e| e.in_flight()).collect();
        loads.sort_unstable();
        assert_eq!(loads, vec![2, 5, 5], "{picked:?}");
        // Finish and resend one at a time: equal matches go by load, to the idlest.
        for (k, i) in picked.into_iter().enumerate() {
            end(&b, i);
            start(&b, &s, with(&hot));
            if k >= 6 {
                let most = b.eps.iter().map(|e| e.in_flight()).max().unwrap();
                assert!(most <= 5, "resend {k}");
            }
        }
        let least = b.eps.iter().map(|e| e.in_flight()).min().unwrap();
        assert!(least >= 3, "the third endpoint shares the prefix");
    }

    /// Six prefixes, one call of each at a time in a burst of 6 and then 5 more on the busiest
    /// endpoint's prefixes: a placement by the fewest held prefixes puts two on each endpoint,
    /// and calls of a prefix stay on its endpoint while it is up to 5 ahead of the idlest (the
    /// relative cap at 6 in flight, 3, would spill the fourth).
    #[test]
    fn new_prefixes_spread_and_a_few_extra_calls_do_not_spill() {
        let b = Bench::new(&[1; 3]);
        let s = strategy(&b, 96);
        let groups: Vec<Vec<u64>> = (0..6).map(|g| prompt(g, 25, g, 27)).collect();
        // Placed one after another, finishing each: load says nothing, held prefixes decide.
        let mut home = [0usize; 6];
        for (g, p) in groups.iter().enumerate() {
            home[g] = start(&b, &s, with(p));
            end(&b, home[g]);
        }
        let mut per = [0; 3];
        for &h in &home {
            per[h] += 1;
        }
        assert_eq!(per, [2, 2, 2], "{home:?}");
        // Calls of the two prefixes homed on endpoint home[0]: 5 land there, and more
        // spill only when it is 5 ahead of an idle endpoint.
        let mine: Vec<usize> = (0..6).filter(|&g| home[g] == home[0]).collect();
        let mut open = Vec::new();
        for k in 0..5 {
            let i = start(&b, &s, with(&groups[mine[k % 2]]));
            assert_eq!(i, home[0], "call {k}");
            open.push(i);
        }
        let i = start(&b, &s, with(&groups[mine[0]]));
        assert_ne!(
            i, home[0],
            "the sixth is 5 ahead of the idle endpoints: it spills"
        );
        open.push(i);
        for i in open {
            end(&b, i);
        }
    }

    proptest::proptest! {
        /// Whatever the order of picks and finishes, one hot prefix never puts more than
        /// max(ceil(1.25 x (in flight + 1) / n), least loaded + SLACK) calls on an endpoint
        /// (counted when picked; in flight and the least loaded before the pick).
        #[test]
        fn the_bound_holds_under_a_single_hot_prefix(
            n in 2usize..6,
            ops in proptest::collection::vec(0u8..4, 1..400),
        ) {
            let b = Bench::new(&vec![1; n]);
            let s = strategy(&b, 96);
            let hot = prompt(7, 25, 0, 25);
            let mut open: Vec<usize> = Vec::new();
            for (k, op) in ops.into_iter().enumerate() {
                if op == 0 && !open.is_empty() {
                    let i = open.swap_remove(k % open.len());
                    end(&b, i);
                    continue;
                }
                let limit = limit(&b, b.group.load(Relaxed));
                let i = start(&b, &s, with(&hot));
                proptest::prop_assert!(b.eps[i].in_flight() <= limit);
                open.push(i);
            }
        }
    }
}
