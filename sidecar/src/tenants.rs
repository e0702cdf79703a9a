//! Tenants (DESIGN.md, "Tenants"): who is calling, and what each may take. `--tenants FILE` maps
//! bearer tokens to tenants; with it, a request without a known token is refused 401 before it
//! is counted as load, and each tenant's quotas (token buckets on requests and on tokens, a cap on
//! its rows in the sidecar) are checked before admission. Without it every caller is tenant
//! `default`, with no quota — unless a gateway names the request's flow
//! (`x-llm-d-inference-fairness-id`, as the Gateway API Inference Extension's endpoint picker
//! passes it): then each flow shares the pod fairly as a tenant of weight 1 of that name, the
//! first [`MAX_FLOWS`] distinct ones (the rest as `default`, so that labels stay bounded).
//!
//! The file is re-read when it changes (in Kubernetes a Secret's update swaps the mounted file):
//! [`Tenants::watch`] polls it — a mounted Secret changes by a symlink swap that file-event
//! libraries report unevenly, and a read a second costs nothing — and a file that no longer parses
//! leaves the last good one in force. Tenants keep their number across reloads (by name), so the
//! schedulers' fair shares and queued requests are untouched.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::http::{header, HeaderMap};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::time::Instant;
use subtle::ConstantTimeEq;

use ferry_core::outcome::{Outcome, Refusal};
use ferry_core::quota::Bucket;
use ferry_core::tenant::{TenantId, DEFAULT_TENANT};
use ferry_core::ticket::Priority;

/// The most weight a tenant may have (the fair-share arithmetic's resolution).
pub const MAX_WEIGHT: u32 = 65_536;
/// The most tenants one file may name (metric labels are bounded by the file).
pub const MAX_TENANTS: usize = 1000;
/// The headers naming a request's fairness flow where no tenants file is configured: the llm-d
/// router's and the Gateway API Inference Extension's spelling.
pub const FAIRNESS_HEADERS: [&str; 2] = ["x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"];
/// The headers naming a request's objective (an InferenceObjective of the Gateway API Inference
/// Extension), as the llm-d router and the Extension spell them.
pub const OBJECTIVE_HEADERS: [&str; 2] = ["x-llm-d-inference-objective", "x-gateway-inference-objective"];
/// Distinct fairness flows given a share of their own; later ones share `default`'s.
pub const MAX_FLOWS: usize = 64;
/// The longest fairness id taken.
pub const MAX_FLOW_ID: usize = 128;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tenants: Vec<Spec>,
}

/// One tenant of the file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Spec {
    pub name: String,
    pub token: String,
    /// Its share of seats against other backlogged tenants (default 1).
    #[serde(default = "one")]
    pub weight: u32,
    /// Requests per second (token bucket); none: no limit.
    pub rate: Option<f64>,
    /// Requests the bucket holds (default: a second's worth, at least 1).
    pub burst: Option<f64>,
    /// Tokens per minute: prompt + `max_tokens` for generation, rows × tokens for embeddings.
    pub tokens_per_minute: Option<f64>,
    /// Rows of its requests waiting or running in this sidecar at once.
    pub max_queued_rows: Option<u64>,
    /// Its requests' tier when they do not say (`x-ferry-priority`).
    #[serde(default)]
    pub priority: PrioritySpec,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PrioritySpec {
    #[default]
    Interactive,
    Batch,
}

/// Parses and checks a tenants file; every error names the tenant, the field, the value and the
/// limit.
pub fn parse(text: &str, path: &Path) -> Result<Vec<Spec>, String> {
    let file: File =
        serde_saphyr::from_str(text).map_err(|e| format!("{}: {}", path.display(), one_line(&e.to_string())))?;
    let at = |i: usize, s: &Spec| format!("{}: tenants[{i}] ('{}')", path.display(), s.name);
    if file.tenants.len() > MAX_TENANTS {
        return Err(format!("{}: {} tenants; at most {MAX_TENANTS}", path.display(), file.tenants.len()));
    }
    let mut names = HashMap::new();
    let mut tokens = HashMap::new();
    for (i, s) in file.tenants.iter().enumerate() {
        if s.name.is_empty() || !s.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(format!("{}: name '{}' must be letters, digits, '-', '_' or '.'", at(i, s), s.name));
        }
        if let Some(j) = names.insert(s.name.as_str(), i) {
            return Err(format!("{}: the name is also tenants[{j}]'s", at(i, s)));
        }
        if s.token.len() < 8 {
            return Err(format!("{}: token is {} characters; at least 8", at(i, s), s.token.len()));
        }
        if let Some(j) = tokens.insert(s.token.as_str(), i) {
            return Err(format!("{}: the token is also tenants[{j}]'s", at(i, s)));
        }
        if !(1..=MAX_WEIGHT).contains(&s.weight) {
            return Err(format!("{}: weight is {}; it must be 1 to {MAX_WEIGHT}", at(i, s), s.weight));
        }
        for (field, value) in [("rate", s.rate), ("burst", s.burst), ("tokensPerMinute", s.tokens_per_minute)] {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(format!("{}: {field} is {v}; it must be a positive number", at(i, s)));
                }
            }
        }
        if s.burst.is_some() && s.rate.is_none() {
            return Err(format!("{}: burst is set without rate", at(i, s)));
        }
        if let Some(b) = s.burst.filter(|b| *b < 1.0) {
            return Err(format!("{}: burst is {b}; it must be at least 1 (a request takes 1)", at(i, s)));
        }
        if let Some(t) = s.tokens_per_minute.filter(|t| *t < 1.0) {
            return Err(format!("{}: tokensPerMinute is {t}; it must be at least 1", at(i, s)));
        }
        if s.max_queued_rows == Some(0) {
            return Err(format!("{}: maxQueuedRows is 0; it must be at least 1", at(i, s)));
        }
    }
    Ok(file.tenants)
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A tenant as the front sees it.
#[derive(Debug)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    /// SHA-256 of its token.
    digest: Vec<u8>,
    pub weight: u32,
    pub priority: Priority,
    /// Shared with the tenant's next version after a reload, so that requests in flight give
    /// back to the buckets in force.
    quota: Arc<Mutex<Quota>>,
    max_queued_rows: Option<u64>,
    queued_rows: Arc<AtomicU64>,
}

#[derive(Debug)]
struct Quota {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

/// Rows a tenant holds in the sidecar, given back when the request ends (dropped); and what it
/// took from the buckets, given back by [`Held::refund`] when the request was refused for want
/// of capacity (it did no work: a retry after `Retry-After` must not find the quota spent).
#[derive(Debug)]
pub struct Held {
    rows: u64,
    queued: Arc<AtomicU64>,
    quota: Arc<Mutex<Quota>>,
    tokens: f64,
    refunded: bool,
}

impl Held {
    pub fn refund(&mut self) {
        if std::mem::replace(&mut self.refunded, true) {
            return;
        }
        let mut quota = self.quota.lock().expect("quota lock");
        if let Some(b) = &mut quota.requests {
            b.give_back(1.0);
        }
        if let Some(b) = &mut quota.tokens {
            b.give_back(self.tokens);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.rows, Ordering::SeqCst);
    }
}

impl Tenant {
    /// The tier of one of its requests: the tenant's own (`priority` in the file) unless the
    /// request asks for a lower one (`x-ferry-priority: batch`). A batch-tier tenant cannot
    /// promote itself by asking for `interactive`: its requests stay batch-tier.
    pub fn tier(&self, asked: Option<&str>) -> Result<Priority, Refusal> {
        let Some(text) = asked else { return Ok(self.priority) };
        let asked = Priority::parse(text).ok_or_else(|| {
            Refusal::invalid(format!("x-ferry-priority is '{text}'; it must be 'interactive' or 'batch'"))
        })?;
        Ok(asked.max(self.priority))
    }

    fn new(id: TenantId, spec: &Spec, now: Instant, previous: Option<&Tenant>) -> Tenant {
        let requests = spec.rate.map(|rate| (rate, spec.burst.unwrap_or(rate.max(1.0))));
        let tokens = spec.tokens_per_minute.map(|tpm| (tpm / 60.0, tpm));
        // A reload keeps what the buckets hold (a tenant cannot refill its quota by a rewrite),
        // in the same buckets: requests in flight give back to the ones in force.
        let bucket = |limits: Option<(f64, f64)>, old: Option<Bucket>| {
            limits.map(|(rate, burst)| match old {
                Some(mut b) => {
                    b.reconfigure(rate, burst, now);
                    b
                }
                None => Bucket::new(rate, burst, now),
            })
        };
        let quota = match previous {
            Some(p) => {
                let mut q = p.quota.lock().expect("quota lock");
                q.requests = bucket(requests, q.requests.take());
                q.tokens = bucket(tokens, q.tokens.take());
                drop(q);
                p.quota.clone()
            }
            None => Arc::new(Mutex::new(Quota { requests: bucket(requests, None), tokens: bucket(tokens, None) })),
        };
        Tenant {
            id,
            name: spec.name.clone(),
            digest: Sha256::digest(spec.token.as_bytes()).to_vec(),
            weight: spec.weight,
            priority: match spec.priority {
                PrioritySpec::Interactive => Priority::Interactive,
                PrioritySpec::Batch => Priority::Batch,
            },
            quota,
            max_queued_rows: spec.max_queued_rows,
            queued_rows: previous.map_or_else(|| Arc::new(AtomicU64::new(0)), |p| p.queued_rows.clone()),
        }
    }

    fn default_tenant() -> Tenant {
        Tenant {
            id: DEFAULT_TENANT,
            name: "default".into(),
            digest: Vec::new(),
            weight: 1,
            priority: Priority::Interactive,
            quota: Arc::new(Mutex::new(Quota { requests: None, tokens: None })),
            max_queued_rows: None,
            queued_rows: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Checks and takes this request's quota: one request, `tokens` tokens, `rows` rows held
    /// until the returned guard is dropped. Over quota: 429 with `Retry-After` from the bucket.
    pub fn take(&self, rows: u64, tokens: u64, now: Instant) -> Result<Held, Refusal> {
        let held = self.queued_rows.fetch_add(rows, Ordering::SeqCst);
        let mut guard = Held {
            rows,
            queued: self.queued_rows.clone(),
            quota: self.quota.clone(),
            tokens: tokens as f64,
            // Nothing taken yet.
            refunded: true,
        };
        if let Some(max) = self.max_queued_rows {
            if rows > max {
                return Err(Refusal::new(
                    Outcome::Quota,
                    format!(
                        "quota: this request has {rows} rows; tenant '{}' may hold {max} at once (maxQueuedRows)",
                        self.name
                    ),
                ));
            }
            if held + rows > max {
                return Err(Refusal::new(
                    Outcome::Quota,
                    format!(
                        "quota: tenant '{}' has {held} rows waiting or running and this request has {rows}; its \
                         maxQueuedRows is {max}",
                        self.name
                    ),
                )
                .retry_after(Duration::from_secs(1)));
            }
        }
        let mut quota = self.quota.lock().expect("quota lock");
        let tokens = tokens as f64;
        if let Some(b) = &mut quota.tokens {
            if tokens > b.burst() {
                return Err(Refusal::new(
                    Outcome::Quota,
                    format!(
                        "quota: this request needs {tokens} tokens; tenant '{}' may use {} a minute (tokensPerMinute)",
                        self.name,
                        b.burst()
                    ),
                ));
            }
        }
        let wait_requests = quota.requests.as_mut().map(|b| b.check(1.0, now)).transpose();
        let wait_tokens = quota.tokens.as_mut().map(|b| b.check(tokens, now)).transpose();
        match (wait_requests, wait_tokens) {
            (Ok(_), Ok(_)) => {}
            (r, t) => {
                let wait = r.err().unwrap_or_default().max(t.err().unwrap_or_default());
                let (what, limit) = match (&quota.requests, &quota.tokens) {
                    (Some(b), _) if r.is_err() => {
                        ("requests", format!("{} a second (rate), burst {}", b.rate(), b.burst()))
                    }
                    (_, Some(b)) => ("tokens", format!("{} a minute (tokensPerMinute)", b.burst())),
                    _ => unreachable!("a bucket refused"),
                };
                return Err(Refusal::new(
                    Outcome::Quota,
                    format!(
                        "quota: tenant '{}' is over its {what} quota of {limit}; retry in {} ms",
                        self.name,
                        wait.as_millis()
                    ),
                )
                .retry_after(wait));
            }
        }
        if let Some(b) = &mut quota.requests {
            b.take(1.0, now);
        }
        if let Some(b) = &mut quota.tokens {
            b.take(tokens, now);
        }
        guard.refunded = false;
        Ok(guard)
    }
}

struct Table {
    /// Configured (from a file), else every caller is `default`.
    configured: bool,
    tenants: Vec<Arc<Tenant>>,
}

/// The tenants of this sidecar, reloadable.
pub struct Tenants {
    path: Option<PathBuf>,
    table: RwLock<Table>,
    default: Arc<Tenant>,
    /// Numbers by name, kept across reloads; 0 is `default`.
    ids: Mutex<HashMap<String, TenantId>>,
    /// The fairness flows seen, by id (no file configured).
    flows: Mutex<HashMap<String, Arc<Tenant>>>,
    /// Objectives whose requests ride the batch tier (`--batch-objectives`).
    batch_objectives: Vec<String>,
    last_text: Mutex<String>,
}

impl Tenants {
    /// No file: every caller is `default`.
    pub fn none() -> Self {
        Tenants {
            path: None,
            table: RwLock::new(Table { configured: false, tenants: Vec::new() }),
            default: Arc::new(Tenant::default_tenant()),
            ids: Mutex::new(HashMap::new()),
            flows: Mutex::new(HashMap::new()),
            batch_objectives: Vec::new(),
            last_text: Mutex::new(String::new()),
        }
    }

    /// Reads `path` (a start-up error if it does not parse).
    pub fn load(path: &Path) -> Result<Self, String> {
        let tenants = Tenants { path: Some(path.to_path_buf()), ..Tenants::none() };
        let text = std::fs::read_to_string(path).map_err(|e| format!("--tenants {}: {e}", path.display()))?;
        tenants.apply(&text)?;
        Ok(tenants)
    }

    /// Requests naming one of `objectives` ride the batch tier ([`Tenants::asked_tier`]).
    pub fn with_batch_objectives(mut self, objectives: Vec<String>) -> Self {
        self.batch_objectives = objectives.into_iter().map(|o| o.trim().to_owned()).filter(|o| !o.is_empty()).collect();
        self
    }

    /// The tier a request asks for, for [`Tenant::tier`]: its `x-ferry-priority`, else `batch`
    /// where a gateway's objective header names one of the batch objectives (the documented
    /// rule: InferenceObjectives of negative priority are listed as such), else none.
    pub fn asked_tier<'h>(&self, headers: &'h HeaderMap) -> Result<Option<&'h str>, Refusal> {
        let text = |name: &str| -> Result<Option<&'h str>, Refusal> {
            headers
                .get(name)
                .map(|v| v.to_str().map_err(|_| Refusal::invalid(format!("header {name} is not readable text"))))
                .transpose()
        };
        if let Some(asked) = text(crate::front::PRIORITY.as_str())? {
            return Ok(Some(asked));
        }
        for name in OBJECTIVE_HEADERS {
            if let Some(objective) = text(name)? {
                let batch = self.batch_objectives.iter().any(|b| b == objective.trim());
                return Ok(batch.then_some("batch"));
            }
        }
        Ok(None)
    }

    pub fn is_configured(&self) -> bool {
        self.table.read().expect("tenants lock").configured
    }

    /// Every tenant's name (for metric labels).
    pub fn names(&self) -> Vec<String> {
        self.table.read().expect("tenants lock").tenants.iter().map(|t| t.name.clone()).collect()
    }

    fn apply(&self, text: &str) -> Result<usize, String> {
        let path = self.path.as_deref().unwrap_or(Path::new("tenants"));
        let specs = parse(text, path)?;
        let now = ferry_core::clock::now();
        let mut ids = self.ids.lock().expect("ids lock");
        let new_names = specs.iter().filter(|s| !ids.contains_key(&s.name)).count();
        if ids.len() + new_names >= usize::from(TenantId::MAX) {
            return Err(format!(
                "{}: {} distinct tenant names since start-up with this file's; at most {} (restart the sidecar)",
                path.display(),
                ids.len() + new_names,
                TenantId::MAX - 1
            ));
        }
        let mut table = self.table.write().expect("tenants lock");
        let tenants: Vec<Arc<Tenant>> = specs
            .iter()
            .map(|spec| {
                let next = ids.len() as TenantId + 1;
                let id = *ids.entry(spec.name.clone()).or_insert(next);
                let previous = table.tenants.iter().find(|t| t.name == spec.name);
                Arc::new(Tenant::new(id, spec, now, previous.map(|p| p.as_ref())))
            })
            .collect();
        let n = tenants.len();
        *table = Table { configured: true, tenants };
        *self.last_text.lock().expect("text lock") = text.to_owned();
        Ok(n)
    }

    /// Re-reads the file if its text changed; a file that does not parse is logged and the last
    /// good one stays.
    pub fn reload(&self) {
        let Some(path) = &self.path else { return };
        let Ok(text) = std::fs::read_to_string(path) else {
            tracing::warn!(path = %path.display(), "the tenants file cannot be read; the last one read stays in force");
            return;
        };
        let mut last = self.last_text.lock().expect("text lock");
        if *last == text {
            return;
        }
        // Whatever happens, this text is not read again until it changes (a broken file is
        // reported once, not every second).
        *last = text.clone();
        drop(last);
        match self.apply(&text) {
            Ok(n) => tracing::info!(path = %path.display(), tenants = n, "tenants file reloaded"),
            Err(e) => {
                tracing::warn!(error = %e, "the tenants file changed but does not parse; the last one read stays")
            }
        }
    }

    /// Polls the file every `every` until the process ends.
    pub fn watch(self: &Arc<Self>, every: Duration) {
        if self.path.is_none() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(tenants) = me.upgrade() else { return };
                tenants.reload();
            }
        });
    }

    /// Who is calling: the tenant whose token the `authorization: Bearer` header carries (every
    /// token compared in constant time), or `default` when no file is configured.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, Refusal> {
        let table = self.table.read().expect("tenants lock");
        if !table.configured {
            drop(table);
            return self.flow(headers);
        }
        let unauthorized = |why: &str| Refusal::new(Outcome::Unauthorized, format!("unauthorized: {why}"));
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(unauthorized("this service has tenants; send 'authorization: Bearer <token>'"));
        };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| unauthorized("the authorization header must be 'Bearer <token>'"))?;
        // Digests compared, every one, in constant time: neither the position of a match nor the
        // length of a token shows in the time taken.
        let digest = Sha256::digest(token.as_bytes());
        let mut found = None;
        for t in &table.tenants {
            if bool::from(t.digest.as_slice().ct_eq(digest.as_slice())) {
                found = Some(t.clone());
            }
        }
        found.ok_or_else(|| unauthorized("the bearer token is not one of this service's tenants"))
    }

    /// The caller where no file is configured: its fairness flow's tenant, or `default`.
    fn flow(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, Refusal> {
        let Some((name, value)) = FAIRNESS_HEADERS.iter().find_map(|h| headers.get(*h).map(|v| (*h, v))) else {
            return Ok(self.default.clone());
        };
        let id = value
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|id| id.len() <= MAX_FLOW_ID && id.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| {
                Refusal::invalid(format!(
                    "header {name} is '{}'; a fairness id is at most {MAX_FLOW_ID} printable ASCII characters",
                    String::from_utf8_lossy(value.as_bytes()).chars().take(MAX_FLOW_ID + 8).collect::<String>()
                ))
            })?;
        if id.is_empty() || id == self.default.name {
            return Ok(self.default.clone());
        }
        let mut flows = self.flows.lock().expect("flows lock");
        if let Some(t) = flows.get(id) {
            return Ok(t.clone());
        }
        if flows.len() >= MAX_FLOWS {
            return Ok(self.default.clone());
        }
        let mut ids = self.ids.lock().expect("ids lock");
        let next = ids.len() as TenantId + 1;
        let number = *ids.entry(id.to_owned()).or_insert(next);
        let spec = Spec {
            name: id.to_owned(),
            token: String::new(),
            weight: 1,
            rate: None,
            burst: None,
            tokens_per_minute: None,
            max_queued_rows: None,
            priority: PrioritySpec::Interactive,
        };
        let tenant = Arc::new(Tenant::new(number, &spec, ferry_core::clock::now(), None));
        flows.insert(id.to_owned(), tenant.clone());
        Ok(tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "tenants:\n  - {name: gold, token: gold-secret-1, weight: 3, rate: 10, burst: 2}\n  - name: free\n    token: free-secret-1\n    tokensPerMinute: 600\n    maxQueuedRows: 4\n    priority: batch\n";

    fn headers(token: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(t) = token {
            h.insert(header::AUTHORIZATION, format!("Bearer {t}").parse().unwrap());
        }
        h
    }

    fn loaded(text: &str) -> Tenants {
        let t = Tenants { path: Some("tenants.yaml".into()), ..Tenants::none() };
        t.apply(text).unwrap();
        t
    }

    #[test]
    fn a_request_may_lower_its_tier_but_a_batch_tenant_cannot_promote_itself() {
        let t = loaded(FILE);
        let gold = t.authenticate(&headers(Some("gold-secret-1"))).unwrap();
        let free = t.authenticate(&headers(Some("free-secret-1"))).unwrap();
        let (i, b) = (Priority::Interactive, Priority::Batch);
        assert_eq!([gold.tier(None), gold.tier(Some("interactive")), gold.tier(Some("batch"))], [Ok(i), Ok(i), Ok(b)]);
        assert_eq!([free.tier(None), free.tier(Some("interactive")), free.tier(Some("batch"))], [Ok(b), Ok(b), Ok(b)]);
        let bad = gold.tier(Some("urgent")).unwrap_err();
        assert_eq!(bad.outcome, Outcome::Invalid);
        assert!(bad.message.contains("x-ferry-priority is 'urgent'"), "{}", bad.message);
    }

    fn with(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.insert(*name, value.parse().unwrap());
        }
        h
    }

    #[test]
    fn without_a_file_a_gateways_fairness_id_is_a_tenant_of_weight_one() {
        let t = Tenants::none();
        let a = t.authenticate(&with(&[("x-llm-d-inference-fairness-id", "team-a")])).unwrap();
        let b = t.authenticate(&with(&[("x-gateway-inference-fairness-id", "team-b")])).unwrap();
        let again = t.authenticate(&with(&[("x-llm-d-inference-fairness-id", " team-a ")])).unwrap();
        assert_eq!((a.name.as_str(), a.weight, a.priority), ("team-a", 1, Priority::Interactive));
        assert_eq!(b.name, "team-b");
        assert_ne!(a.id, b.id);
        assert_ne!(a.id, DEFAULT_TENANT);
        assert_eq!(again.id, a.id, "one flow, one share");
        assert_eq!(t.authenticate(&HeaderMap::new()).unwrap().id, DEFAULT_TENANT);
        // Bad ids are refused naming the header and the limit; past MAX_FLOWS, flows share default.
        let long = "x".repeat(MAX_FLOW_ID + 1);
        let bad = t.authenticate(&with(&[("x-llm-d-inference-fairness-id", &long)])).unwrap_err();
        assert_eq!(bad.outcome, Outcome::Invalid);
        assert!(
            bad.message.contains("x-llm-d-inference-fairness-id") && bad.message.contains("128"),
            "{}",
            bad.message
        );
        for i in 0..MAX_FLOWS {
            t.authenticate(&with(&[("x-llm-d-inference-fairness-id", &format!("flow-{i}"))])).unwrap();
        }
        let late = t.authenticate(&with(&[("x-llm-d-inference-fairness-id", "one-too-many")])).unwrap();
        assert_eq!(late.id, DEFAULT_TENANT);
        assert_eq!(t.authenticate(&with(&[("x-llm-d-inference-fairness-id", "team-a")])).unwrap().id, a.id);
    }

    #[test]
    fn with_a_file_the_fairness_id_is_not_who_calls() {
        let t = loaded(FILE);
        let h = with(&[("x-llm-d-inference-fairness-id", "team-a"), ("authorization", "Bearer gold-secret-1")]);
        assert_eq!(t.authenticate(&h).unwrap().name, "gold");
        let anonymous = t.authenticate(&with(&[("x-llm-d-inference-fairness-id", "team-a")])).unwrap_err();
        assert_eq!(anonymous.outcome, Outcome::Unauthorized);
    }

    #[test]
    fn a_batch_objective_asks_for_the_batch_tier_unless_the_request_says_otherwise() {
        let t = Tenants::none().with_batch_objectives(vec!["offline".into()]);
        let ask = |pairs: &[(&'static str, &str)]| t.asked_tier(&with(pairs)).unwrap().map(str::to_owned);
        assert_eq!(ask(&[("x-llm-d-inference-objective", "offline")]), Some("batch".into()));
        assert_eq!(ask(&[("x-gateway-inference-objective", "offline")]), Some("batch".into()));
        assert_eq!(ask(&[("x-llm-d-inference-objective", "chat")]), None);
        assert_eq!(ask(&[]), None);
        let explicit = [("x-llm-d-inference-objective", "offline"), ("x-ferry-priority", "interactive")];
        assert_eq!(ask(&explicit), Some("interactive".into()));
        assert_eq!(Tenants::none().asked_tier(&with(&[("x-llm-d-inference-objective", "offline")])).unwrap(), None);
        let empty = Tenants::none().with_batch_objectives(vec![String::new()]);
        assert_eq!(empty.asked_tier(&with(&[("x-llm-d-inference-objective", "")])).unwrap(), None);
    }

    #[test]
    fn tokens_name_their_tenant_and_anything_else_is_401() {
        let t = loaded(FILE);
        let gold = t.authenticate(&headers(Some("gold-secret-1"))).unwrap();
        assert_eq!((gold.name.as_str(), gold.weight, gold.id), ("gold", 3, 1));
        let free = t.authenticate(&headers(Some("free-secret-1"))).unwrap();
        assert_eq!((free.priority, free.id), (Priority::Batch, 2));
        for h in [headers(None), headers(Some("gold-secret-2")), headers(Some(""))] {
            assert_eq!(t.authenticate(&h).unwrap_err().outcome, Outcome::Unauthorized);
        }
        let none = Tenants::none();
        assert_eq!(none.authenticate(&headers(None)).unwrap().name, "default");
    }

    #[test]
    fn quotas_refuse_with_the_wait_their_bucket_needs() {
        let t = loaded(FILE);
        let now = ferry_core::clock::now();
        let gold = t.authenticate(&headers(Some("gold-secret-1"))).unwrap();
        let _a = gold.take(1, 0, now).unwrap();
        let _b = gold.take(1, 0, now).unwrap();
        let refused = gold.take(1, 0, now).unwrap_err();
        assert_eq!(refused.outcome, Outcome::Quota);
        assert_eq!(refused.retry_after, Some(Duration::from_millis(100)));
        assert!(refused.message.contains("10 a second (rate), burst 2"), "{refused}");
        assert!(gold.take(1, 0, now + Duration::from_millis(100)).is_ok());

        let free = t.authenticate(&headers(Some("free-secret-1"))).unwrap();
        let held = free.take(3, 500, now).unwrap();
        // Rows held: 3 of 4.
        let refused = free.take(2, 1, now).unwrap_err();
        assert!(refused.message.contains("maxQueuedRows is 4"), "{refused}");
        drop(held);
        // Tokens: 100 left of 600 a minute (10 a second): 150 more come in 5 s.
        let refused = free.take(1, 150, now).unwrap_err();
        assert_eq!(refused.retry_after, Some(Duration::from_secs(5)));
        assert!(free.take(1, 700, now).unwrap_err().retry_after.is_none(), "never fits: no Retry-After");
        assert!(free.take(5, 1, now).unwrap_err().retry_after.is_none(), "5 rows never fit 4");
        // A refund gives back what a request took.
        let mut h = free.take(1, 100, now).unwrap();
        assert!(free.take(1, 1, now).is_err(), "the 600 tokens are spent");
        h.refund();
        h.refund();
        assert!(free.take(1, 100, now).is_ok());
        assert!(free.take(1, 1, now).is_err(), "a second refund gave nothing more");
    }

    #[test]
    fn a_reload_keeps_numbers_buckets_and_held_rows() {
        let t = loaded(FILE);
        let now = ferry_core::clock::now();
        let gold = t.authenticate(&headers(Some("gold-secret-1"))).unwrap();
        let _a = gold.take(1, 0, now).unwrap();
        let _b = gold.take(1, 0, now).unwrap();
        t.apply(&FILE.replace("gold-secret-1", "gold-secret-2").replace("weight: 3", "weight: 5")).unwrap();
        assert!(t.authenticate(&headers(Some("gold-secret-1"))).is_err());
        let gold = t.authenticate(&headers(Some("gold-secret-2"))).unwrap();
        assert_eq!((gold.id, gold.weight), (1, 5));
        assert!(gold.take(1, 0, now).is_err(), "the bucket kept its level across the reload");
    }

    #[test]
    fn bad_files_name_the_tenant_the_field_and_the_limit() {
        let p = Path::new("t.yaml");
        let bad = |text: &str| parse(text, p).unwrap_err();
        assert!(bad("tenants:\n  - {name: a, token: abcdefgh, weight: 0}")
            .contains("tenants[0] ('a'): weight is 0; it must be 1 to 65536"));
        assert!(bad("tenants:\n  - {name: a, token: short}").contains("token is 5 characters; at least 8"));
        assert!(bad("tenants:\n  - {name: a, token: abcdefgh}\n  - {name: a, token: abcdefgi}")
            .contains("also tenants[0]'s"));
        assert!(bad("tenants:\n  - {name: a, token: abcdefgh, rate: -1}")
            .contains("rate is -1; it must be a positive number"));
        assert!(bad("tenants:\n  - {name: a, token: abcdefgh, sped: 1}").contains("sped"));
        assert!(bad("tenants:\n  - {name: a, token: abcdefgh, priority: urgent}").contains("urgent"));
    }
}
