//! The etcd source: every key under a prefix is one endpoint, its value JSON
//! `{"address": "host:port", "weight": 1, "zone": "a", "priority": 0}`.
//!
//! etcd pushes changes, so this source is not a [`super::source::Source`] that is asked every
//! so often: it reads the prefix, then watches it from the revision after that read (no event
//! is missed between the two), and applies each batch of events as it arrives. When the watch
//! cannot go on (the stream ended, a member stopped answering, or the periodic linearizable
//! check failed: no leader) it connects again and resumes the watch after the last revision it
//! applied; when etcd compacted past that revision, cancelled the watch, or is no longer the
//! store the set was read from (its revision went back below the one applied, as after a
//! restore from a snapshot, or its cluster id changed), it reads the whole prefix again. A
//! session that worked and lost its member is not an outage while another member answers.
//! While etcd cannot be reached the last set stays ([`Discovered::record`] with an error:
//! logged, counted, shown in `/status`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, KeyValue, WatchOptions};
use keel_balance::EndpointSpec;
use serde::Deserialize;

use crate::config::EtcdConfig;
use crate::control::discovery::error::{DiscoveryError, EndpointError};
use crate::control::discovery::file::check_endpoint;
use crate::control::etcd::{connect, escaped, explain, prefix_read, within, EtcdError};
use crate::upstream::discovered::Discovered;

/// Time between two checks that etcd still has a leader and answers (a watch on a member cut
/// off from the others would otherwise stay silent).
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Time between two tries to reach etcd again after a failure.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// One key's value. Unknown fields are ignored (a registrar may add its own).
#[derive(Deserialize)]
struct Value {
    address: String,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    zone: Option<String>,
    #[serde(default)]
    priority: u32,
}

fn one() -> u32 {
    1
}

/// Why a key's value is not an endpoint.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ValueError {
    /// Not the JSON object of an endpoint.
    #[error("expected {{\"address\": \"host:port\", \"weight\": 1, \"zone\": \"a\", \"priority\": 0}}: {0}")]
    Json(#[source] serde_json::Error),
    /// An endpoint that is refused.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
}

/// A key's value as an endpoint, or why it is not one.
pub(crate) fn parse_value(value: &[u8]) -> Result<EndpointSpec, ValueError> {
    let v: Value = serde_json::from_slice(value).map_err(ValueError::Json)?;
    let e = EndpointSpec {
        address: v.address,
        weight: v.weight,
        priority: v.priority,
        zone: v.zone,
    };
    check_endpoint(&e)?;
    Ok(e)
}

/// The endpoints the source holds now, by key.
#[derive(Default)]
struct Keys(BTreeMap<Vec<u8>, EndpointSpec>);

impl Keys {
    /// Puts one key's value; a bad value is logged with its key and the key dropped (the rest
    /// stays).
    fn put(&mut self, cluster: &str, kv: &KeyValue) {
        match parse_value(kv.value()) {
            Ok(e) => {
                self.0.insert(kv.key().to_vec(), e);
            }
            Err(m) => {
                self.0.remove(kv.key());
                tracing::warn!(
                    cluster,
                    key = %escaped(kv.key()),
                    "etcd discovery: value skipped: {}",
                    escaped(&m.to_string())
                );
            }
        }
    }

    /// The set: one endpoint per address (the first key's, by key order).
    fn set(&self, cluster: &str) -> Vec<EndpointSpec> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(self.0.len());
        for (k, e) in &self.0 {
            if seen.insert(e.address.as_str()) {
                out.push(e.clone());
            } else {
                tracing::warn!(
                    cluster,
                    key = %escaped(k),
                    address = %escaped(&e.address),
                    "etcd discovery: address already registered under another key; skipped"
                );
            }
        }
        out
    }
}

/// Follows `prefix` until aborted: each new set goes to `apply`.
pub(crate) async fn follow(
    cluster: &str,
    discovered: &Arc<Discovered>,
    apply: &impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
    etcd: &EtcdConfig,
    prefix: &str,
) {
    // Kept across connections: after an outage the watch resumes from the last revision
    // applied (a fleet reconnecting at once does not read every prefix again), unless etcd
    // compacted past it.
    let mut keys = Keys::default();
    let mut at = At::default();
    // After a session lost its member: the member that answered instead, watched alone.
    let mut member: Option<EtcdConfig> = None;
    loop {
        at.reached = false;
        let err = session(
            cluster,
            discovered,
            apply,
            member.as_ref().unwrap_or(etcd),
            prefix,
            &mut keys,
            &mut at,
        )
        .await
        .for_config(etcd);
        // A session that worked until now lost its member (one restarted, say): while
        // another member answers with a leader, etcd is there, and the next session watches
        // through that member at once; the set is stale only when no member answers.
        member = answering_member(etcd, prefix).await;
        if at.reached && member.is_some() {
            tracing::info!(
                cluster,
                prefix,
                "etcd discovery: the watch ended ({err}); watching again through another member"
            );
            continue;
        }
        if let Some(set) = discovered.record(cluster, Err(DiscoveryError::from(err).shared())) {
            apply(cluster, discovered, set);
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

/// Where the source's set is in etcd's history: the revision it applied last (`None`: read the
/// prefix again), and the cluster it was read from.
#[derive(Default)]
struct At {
    applied: Option<i64>,
    cluster_id: Option<u64>,
    /// The current session reached etcd with a leader (a read, or a check, answered).
    reached: bool,
}

impl At {
    /// Why the store an answer of header `h` came from is not the one the set was read from
    /// (restored from a snapshot: its revision went back below what was applied; or another
    /// cluster, by its id); `None` when it is the same.
    fn moved(&self, h: Option<&etcd_client::ResponseHeader>) -> Option<String> {
        let h = h?;
        if let Some(applied) = self.applied.filter(|a| h.revision() < *a) {
            return Some(format!(
                "etcd's revision went back from {applied} to {} (a restore?)",
                h.revision()
            ));
        }
        match self.cluster_id {
            Some(id) if id != h.cluster_id() => Some(format!(
                "etcd's cluster id changed from {id:x} to {:x}",
                h.cluster_id()
            )),
            _ => None,
        }
    }
}

/// The first member of `etcd` that, asked alone, answers a linearizable read (it has a
/// leader), as a configuration of that member only; `None` when none answers.
async fn answering_member(etcd: &EtcdConfig, prefix: &str) -> Option<EtcdConfig> {
    let mut asks = tokio::task::JoinSet::new();
    for e in &etcd.endpoints {
        let one = EtcdConfig {
            endpoints: vec![e.clone()],
            ..etcd.clone()
        };
        let prefix = prefix.to_string();
        asks.spawn(async move {
            let mut c = connect(&one).await.ok()?;
            let probe = c.get(
                prefix,
                Some(GetOptions::new().with_prefix().with_count_only()),
            );
            within(one.dial_timeout, probe).await.ok().map(|_| one)
        });
    }
    // The first member that answers will do; the others' asks are dropped with the set.
    while let Some(answered) = asks.join_next().await {
        if let Ok(Some(one)) = answered {
            return Some(one);
        }
    }
    None
}

/// Records `set` and applies it when it changed.
fn publish(
    cluster: &str,
    discovered: &Arc<Discovered>,
    apply: &impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
    set: Vec<EndpointSpec>,
) {
    if let Some(set) = discovered.record(cluster, Ok(set)) {
        tracing::info!(
            cluster = %cluster,
            source = %discovered.config.describe(),
            endpoints = set.len(),
            "discovery: new endpoints"
        );
        apply(cluster, discovered, set);
    }
}

/// One connection: read (unless a watch can resume after `applied`), then watch, until
/// something fails; returns why. `keys` and `applied` hold the set and the revision it is at.
async fn session(
    cluster: &str,
    discovered: &Arc<Discovered>,
    apply: &impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
    etcd: &EtcdConfig,
    prefix: &str,
    keys: &mut Keys,
    at: &mut At,
) -> EtcdError {
    let mut client = match connect(etcd).await {
        Ok(c) => c,
        Err(e) => return e,
    };
    let t = etcd.dial_timeout;
    // Read, then watch from the next revision; again after a compaction outran the watch.
    loop {
        let resumed = at.applied.is_some();
        let revision = match at.applied {
            Some(r) => r,
            None => {
                let read = match within(t, client.get(prefix, Some(prefix_read()))).await {
                    Ok(r) => r,
                    Err(e) => return e,
                };
                let revision = read.header().map_or(0, |h| h.revision());
                *keys = Keys::default();
                for kv in read.kvs() {
                    keys.put(cluster, kv);
                }
                at.applied = Some(revision);
                at.cluster_id = read.header().map(|h| h.cluster_id());
                publish(cluster, discovered, apply, keys.set(cluster));
                revision
            }
        };
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut watch = match within(t, client.watch(prefix, Some(options))).await {
            Ok(w) => w,
            Err(e) => return e,
        };
        let mut check = tokio::time::interval(CHECK_EVERY);
        if !resumed {
            // The read was linearizable: etcd answered with a leader.
            at.reached = true;
            // Just read: the first check is due a period from now. A resumed watch checks at
            // once, so that /status says fresh again as soon as etcd answers.
            check.tick().await;
        }
        loop {
            tokio::select! {
                m = watch.message() => {
                    let m = match m {
                        Ok(Some(m)) => m,
                        Ok(None) => return EtcdError::WatchEnded("closed by etcd".into()),
                        Err(e) => return explain(e),
                    };
                    if m.compact_revision() > 0 {
                        tracing::info!(cluster, prefix, compacted = m.compact_revision(), "etcd discovery: the watch fell behind a compaction; reading the prefix again");
                        at.applied = None;
                        break;
                    }
                    if m.canceled() {
                        // Whatever the reason (a future revision, say), what the watch would
                        // have said is unknown: read the prefix again (a refusal fails the read).
                        tracing::info!(cluster, prefix, reason = %escaped(m.cancel_reason()), "etcd discovery: etcd cancelled the watch; reading the prefix again");
                        at.applied = None;
                        break;
                    }
                    if m.events().is_empty() {
                        continue;
                    }
                    for ev in m.events() {
                        let Some(kv) = ev.kv() else { continue };
                        match ev.event_type() {
                            EventType::Put => keys.put(cluster, kv),
                            EventType::Delete => {
                                keys.0.remove(kv.key());
                            }
                        }
                        // A delete's kv carries the revision of the delete.
                        at.applied = Some(at.applied.unwrap_or(0).max(kv.mod_revision()));
                    }
                    publish(cluster, discovered, apply, keys.set(cluster));
                }
                _ = check.tick() => {
                    // Linearizable: fails without a leader, and proves the watch's member alive
                    // only as far as the client's keep-alive does; enough to say "unreachable".
                    let probe = client.get(prefix, Some(GetOptions::new().with_prefix().with_count_only()));
                    let answer = match within(t, probe).await {
                        Ok(a) => a,
                        Err(e) => return e,
                    };
                    // A store restored from a snapshot answers, and a watch from a revision of
                    // its future stays silent: seen here, the prefix is read again.
                    if let Some(why) = at.moved(answer.header()) {
                        tracing::warn!(cluster, prefix, "etcd discovery: {why}; reading the prefix again");
                        at.applied = None;
                        break;
                    }
                    at.reached = true;
                    // Recorded as a contact (`last_refresh`), and as fresh again after an
                    // error (an outage the watch resumed after, or one that did not break it).
                    publish(cluster, discovered, apply, keys.set(cluster));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_need_an_address_and_take_the_rest_or_defaults() {
        let e = parse_value(br#"{"address":"10.0.0.1:80"}"#).unwrap();
        assert_eq!((e.weight, e.priority, e.zone), (1, 0, None));
        let e = parse_value(br#"{"address":"a.test:81","weight":3,"zone":"b","priority":1,"x":0}"#)
            .unwrap();
        assert_eq!((e.weight, e.priority, e.zone.as_deref()), (3, 1, Some("b")));
        assert!(parse_value(b"{").is_err());
        let e = parse_value(br#"{"weight":1}"#).unwrap_err();
        assert!(matches!(e, ValueError::Json(_)), "{e:?}");
        assert!(e.to_string().contains("address"), "{e}");
        let e = parse_value(br#"{"address":"10.0.0.1"}"#).unwrap_err();
        assert!(
            matches!(e, ValueError::Endpoint(EndpointError::NotAnAddress { .. })),
            "{e:?}"
        );
        assert!(e.to_string().contains("host:port"), "{e}");
        let e = parse_value(br#"{"address":"10.0.0.1:80","weight":0}"#).unwrap_err();
        assert!(e.to_string().contains("weight 0"), "{e}");
    }
}
