//! Idempotent requests (`idempotency-key`): a retried request with the same key gets the outcome
//! of the first one instead of running again.
//!
//! Each record holds a fingerprint of the request (method, path and a SHA-256 of the body) and,
//! once the first execution has ended, its response, for a TTL. The same key with the same
//! fingerprint joins the execution in flight, or replays the saved response after it; the same
//! key with another fingerprint is a conflict (409), as in the IETF Idempotency-Key draft and
//! Stripe's API. Only final outcomes are kept for replay (2xx and 4xx, but not 409 or 429):
//! after a 5xx the key may be retried for real. Keys are scoped per tenant. The store is bounded
//! by entries and bytes and evicts the oldest completed records first; records in flight are
//! never evicted (they are bounded by the queue).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, StatusCode};
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::time::Instant;
use tokio::sync::watch;

pub const KEY_HEADER: &str = "idempotency-key";
/// Marks a response that was not produced for this request but saved from the first one.
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response kept for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub status: StatusCode,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl Saved {
    fn size(&self) -> usize {
        self.body.len() + self.headers.iter().map(|(k, v)| k.as_str().len() + v.len()).sum::<usize>()
    }

    /// Whether a later retry with the same key should get this response rather than run again.
    pub fn is_final(&self) -> bool {
        let s = self.status;
        (s.is_success() || s.is_client_error()) && s != StatusCode::CONFLICT && s != StatusCode::TOO_MANY_REQUESTS
    }
}

/// What identifies "the same request".
pub type Fingerprint = [u8; 32];

pub fn fingerprint(method: &str, path: &str, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    for part in [method.as_bytes(), b"\n", path.as_bytes(), b"\n", body] {
        h.update(part);
    }
    h.finalize().into()
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub scope: String,
    pub key: String,
}

/// The answer to "may I run this request?".
#[derive(Debug)]
pub enum Claim {
    /// Run it, then call [`Store::finish`] with this key; the outcome also comes on the receiver
    /// (the caller that runs it may wait there like the joiners).
    Execute(watch::Receiver<Option<Arc<Saved>>>),
    /// The same request is running: wait for its outcome.
    Join(watch::Receiver<Option<Arc<Saved>>>),
    /// The same request ran: here is its response.
    Replay(Arc<Saved>),
    /// The key was used for a different request.
    Conflict,
}

#[derive(Debug)]
enum State {
    InFlight(watch::Sender<Option<Arc<Saved>>>),
    Done(Arc<Saved>),
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    created: Instant,
    seq: u64,
    size: usize,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub ttl: Duration,
    pub max_entries: usize,
    pub max_bytes: usize,
}

#[derive(Debug)]
pub struct Store {
    limits: Limits,
    entries: HashMap<Key, Entry>,
    /// Creation order, for expiry and eviction.
    order: BTreeMap<(Instant, u64), Key>,
    bytes: usize,
    seq: u64,
}

impl Store {
    pub fn new(limits: Limits) -> Self {
        Store { limits, entries: HashMap::new(), order: BTreeMap::new(), bytes: 0, seq: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn claim(&mut self, key: Key, fingerprint: Fingerprint, now: Instant) -> Claim {
        self.expire(now);
        if let Some(entry) = self.entries.get(&key) {
            if entry.fingerprint != fingerprint {
                return Claim::Conflict;
            }
            return match &entry.state {
                State::InFlight(tx) => Claim::Join(tx.subscribe()),
                State::Done(saved) => Claim::Replay(saved.clone()),
            };
        }
        let (tx, rx) = watch::channel(None);
        let size = key.scope.len() + key.key.len() + 64;
        self.seq += 1;
        self.order.insert((now, self.seq), key.clone());
        self.entries.insert(key, Entry { fingerprint, created: now, seq: self.seq, size, state: State::InFlight(tx) });
        self.bytes += size;
        self.evict();
        Claim::Execute(rx)
    }

    /// The execution of `key` ended with `saved`: joiners get it, and a final outcome is kept for
    /// replay until the TTL.
    pub fn finish(&mut self, key: &Key, saved: Saved) {
        let saved = Arc::new(saved);
        let Some(entry) = self.entries.get_mut(key) else { return };
        if let State::InFlight(tx) = &entry.state {
            let _ = tx.send(Some(saved.clone()));
        }
        if saved.is_final() {
            self.bytes += saved.size();
            entry.size += saved.size();
            entry.state = State::Done(saved);
            self.evict();
        } else {
            self.remove(key);
        }
    }

    fn remove(&mut self, key: &Key) {
        if let Some(entry) = self.entries.remove(key) {
            self.order.remove(&(entry.created, entry.seq));
            self.bytes -= entry.size;
        }
    }

    fn expire(&mut self, now: Instant) {
        let expired: Vec<Key> = self
            .order
            .iter()
            .take_while(|((created, _), _)| *created + self.limits.ttl <= now)
            .map(|(_, k)| k.clone())
            .filter(|k| matches!(self.entries.get(k).map(|e| &e.state), Some(State::Done(_))))
            .collect();
        for key in expired {
            self.remove(&key);
        }
    }

    /// Oldest completed records go first while a bound is passed.
    fn evict(&mut self) {
        while self.entries.len() > self.limits.max_entries || self.bytes > self.limits.max_bytes {
            let oldest_done = self
                .order
                .values()
                .find(|k| matches!(self.entries.get(*k).map(|e| &e.state), Some(State::Done(_))))
                .cloned();
            match oldest_done {
                Some(key) => self.remove(&key),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { ttl: Duration::from_secs(60), max_entries: 3, max_bytes: 1 << 20 };

    fn key(k: &str) -> Key {
        Key { scope: String::new(), key: k.into() }
    }

    fn saved(status: u16, body: &str) -> Saved {
        Saved { status: StatusCode::from_u16(status).unwrap(), headers: vec![], body: Bytes::from(body.to_owned()) }
    }

    #[test]
    fn the_same_request_joins_then_replays_and_another_body_conflicts() {
        let mut store = Store::new(LIMITS);
        let now = ferry_core::clock::now();
        let (a, b) = (fingerprint("POST", "/p", b"a"), fingerprint("POST", "/p", b"b"));
        assert!(matches!(store.claim(key("k"), a, now), Claim::Execute(_)));
        let Claim::Join(mut joiner) = store.claim(key("k"), a, now) else { panic!("joins") };
        assert!(matches!(store.claim(key("k"), b, now), Claim::Conflict));
        store.finish(&key("k"), saved(200, "done"));
        assert_eq!(joiner.borrow_and_update().as_ref().unwrap().body, "done");
        let Claim::Replay(r) = store.claim(key("k"), a, now) else { panic!("replays") };
        assert_eq!(r.status, StatusCode::OK);
    }

    #[test]
    fn keys_are_scoped_per_tenant() {
        let mut store = Store::new(LIMITS);
        let now = ferry_core::clock::now();
        let f = fingerprint("POST", "/p", b"a");
        assert!(matches!(store.claim(key("k"), f, now), Claim::Execute(_)));
        let other = Key { scope: "tenant-b".into(), key: "k".into() };
        assert!(matches!(store.claim(other, f, now), Claim::Execute(_)));
    }

    #[test]
    fn a_retryable_outcome_is_not_kept() {
        let mut store = Store::new(LIMITS);
        let now = ferry_core::clock::now();
        let f = fingerprint("POST", "/p", b"a");
        store.claim(key("k"), f, now);
        store.finish(&key("k"), saved(503, "queue full"));
        assert!(store.is_empty());
        assert!(matches!(store.claim(key("k"), f, now), Claim::Execute(_)));
    }

    #[test]
    fn records_expire_after_the_ttl() {
        let mut store = Store::new(LIMITS);
        let now = ferry_core::clock::now();
        let f = fingerprint("POST", "/p", b"a");
        store.claim(key("k"), f, now);
        store.finish(&key("k"), saved(200, "x"));
        assert!(matches!(store.claim(key("k"), f, now + Duration::from_secs(59)), Claim::Replay(_)));
        assert!(matches!(store.claim(key("k"), f, now + Duration::from_secs(60)), Claim::Execute(_)));
    }

    #[test]
    fn the_oldest_completed_records_are_evicted_first() {
        let mut store = Store::new(LIMITS);
        let t = ferry_core::clock::now();
        let f = fingerprint("POST", "/p", b"a");
        for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
            store.claim(key(k), f, t + Duration::from_millis(i as u64));
        }
        store.finish(&key("b"), saved(200, "b"));
        store.finish(&key("c"), saved(200, "c"));
        // A fourth record passes max_entries: "b", the oldest completed one, goes; "a" is in flight.
        store.claim(key("d"), f, t + Duration::from_millis(3));
        assert_eq!(store.len(), 3);
        assert!(matches!(store.claim(key("a"), f, t), Claim::Join(_)));
        assert!(matches!(store.claim(key("b"), f, t), Claim::Execute(_)));
    }

    #[test]
    fn the_byte_bound_holds() {
        let mut store = Store::new(Limits { max_entries: 100, max_bytes: 1000, ..LIMITS });
        let t = ferry_core::clock::now();
        let f = fingerprint("POST", "/p", b"a");
        for i in 0..10 {
            let k = key(&i.to_string());
            store.claim(k.clone(), f, t);
            store.finish(&k, saved(200, &"x".repeat(300)));
            assert!(store.bytes() <= 1000, "{} bytes", store.bytes());
        }
        assert!(store.len() < 10);
    }
}
