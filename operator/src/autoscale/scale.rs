//! The autoscaler's loop: every tick, scrape each ready worker pod's sidecar by pod IP (as
//! Knative's autoscaler scrapes its queue-proxies), run [`decide`] for each InferenceService, and
//! act: patch the worker Deployment's replicas as the `ferry-autoscaler` field manager (the
//! owner of that one field), write the observed figures and the decision into the status, and
//! record an Event when the count changes.
//!
//! It reads what it decides on from watches ([`Stores`]: reflector caches of the
//! InferenceServices, and of the Deployments and Pods that carry Ferry's service label), never
//! by listing the cluster each tick; it scrapes all pods at once, each within its own timeout,
//! so that one hung pod delays nothing; and it forgets a service's history when the service is
//! gone.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use std::time::Instant;

use super::collect::{fetch, scrape, Collector, PodSample};
use super::decide::{decide, History, Observed, Reason, ScaleDecision, Target, PRESSURE_TOLERANCE};
use super::startup::StartupTimes;
use crate::desired::{self, LABEL_SERVICE, METRICS_PORT, REPLICAS_MANAGER};
use crate::metrics::{Decided, OperatorMetrics};
use crate::status;
use ferry_core::spec::{InferenceService, InferenceServiceStatus};

/// The annotation a ReplicaSet reads to choose which of its pods to delete first (lowest cost).
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// Scrapes in flight at once.
const CONCURRENT_SCRAPES: usize = 64;
/// An unready pod older than twice the time-to-ready and this is stuck, not starting.
const STUCK_MARGIN: Duration = Duration::from_secs(60);
/// A pod that took longer than this from creation to its (latest) Ready did not just start.
const START_UP_AT_MOST: Duration = Duration::from_secs(600);

/// The objects the autoscaler reads, kept current by watches.
#[derive(Clone)]
pub struct Stores {
    pub services: Store<InferenceService>,
    pub deployments: Store<Deployment>,
    pub pods: Store<Pod>,
    /// The holder's pods (`None`: no holder, no service goes to zero).
    pub holders: Option<Store<Pod>>,
}

impl Stores {
    /// Starts watches of the Deployments and Pods that carry Ferry's service label (pods without
    /// their managed fields, which the autoscaler never reads), beside the controller's store of
    /// InferenceServices.
    pub fn watch(client: &Client, services: Store<InferenceService>, holder_selector: Option<&str>) -> Stores {
        let labelled = || watcher::Config::default().labels(LABEL_SERVICE);
        let (deployments, writer) = reflector::store();
        let stream = watcher(Api::<Deployment>::all(client.clone()), labelled()).default_backoff().reflect(writer);
        tokio::spawn(stream.for_each(|_| std::future::ready(())));
        let (pods, writer) = reflector::store();
        let stream = watcher(Api::<Pod>::all(client.clone()), labelled())
            .default_backoff()
            .modify(|pod: &mut Pod| pod.managed_fields_mut().clear())
            .reflect(writer);
        tokio::spawn(stream.for_each(|_| std::future::ready(())));
        let holders = holder_selector.map(|selector| {
            let (holders, writer) = reflector::store();
            let stream = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default().labels(selector))
                .default_backoff()
                .modify(|pod: &mut Pod| pod.managed_fields_mut().clear())
                .reflect(writer);
            tokio::spawn(stream.for_each(|_| std::future::ready(())));
            holders
        });
        Stores { services, deployments, pods, holders }
    }

    /// Resolves once every store has listed its objects.
    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        // The controller waits on its store too, and kube-runtime 5's readiness signal wakes only
        // one of two tasks waiting at once (a oneshot with one waker behind the shared reader):
        // look again every 100 ms rather than wait on it alone.
        loop {
            match tokio::time::timeout(Duration::from_millis(100), self.services.wait_until_ready()).await {
                Ok(result) => break result?,
                Err(_) => continue,
            }
        }
        self.deployments.wait_until_ready().await?;
        if let Some(holders) = &self.holders {
            holders.wait_until_ready().await?;
        }
        self.pods.wait_until_ready().await
    }
}

/// A worker pod as the decision counts it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerPod {
    pub uid: String,
    pub name: String,
    /// `None` while not ready.
    pub ip: Option<String>,
    /// How long it has been ready.
    pub ready_for: Option<Duration>,
    pub deletion_cost: Option<String>,
    /// Its work at the last scrape: queued requests, and the generation streams it is still
    /// sending (what a scale-down that removed it would cut).
    pub work: f64,
    /// Since its creation.
    pub age: Option<Duration>,
}

/// The pods of one service that are not being deleted.
pub fn workers(pods: &[Arc<Pod>], wall: Timestamp) -> Vec<WorkerPod> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let ready = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Ready" && c.status == "True"));
            let ready_for = ready.map(|c| {
                let since = c.last_transition_time.as_ref().map_or(wall, |t| t.0);
                Duration::from_millis(u64::try_from(wall.as_millisecond() - since.as_millisecond()).unwrap_or(0))
            });
            let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone()).filter(|_| ready.is_some());
            Some(WorkerPod {
                uid: p.uid()?,
                name: p.name_any(),
                ip,
                ready_for,
                deletion_cost: p.annotations().get(DELETION_COST).cloned(),
                work: 0.0,
                age: p.metadata.creation_timestamp.as_ref().map(|t| {
                    Duration::from_millis(u64::try_from(wall.as_millisecond() - t.0.as_millisecond()).unwrap_or(0))
                }),
            })
        })
        .collect()
}

/// The ready holder pods: (UID, IP).
fn ready_holders(pods: &[Arc<Pod>]) -> Vec<(String, String)> {
    let mut ready: Vec<(String, String)> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|p| Some((p.uid()?, p.status.as_ref()?.pod_ip.clone()?)))
        .collect();
    ready.sort();
    ready
}

/// `request` with the holder's bearer token, if there is one.
fn with_token(request: reqwest::RequestBuilder, token: &Option<String>) -> reqwest::RequestBuilder {
    match token {
        Some(token) => request.bearer_auth(token),
        None => request,
    }
}

/// What the autoscaler remembers of one service.
#[derive(Debug, Clone, Default)]
struct Memory {
    history: History,
    startup: StartupTimes,
    /// The holder EndpointSlice last applied for it, if any.
    slice: Option<serde_json::Value>,
    /// The latest capacity figure its pods gave (`ferry_capacity_requests_per_second`).
    capacity: Option<f64>,
    /// Whether this process made sure no slice of holder pods outlives scale to zero's end.
    slice_checked: bool,
}

pub struct Autoscaler {
    client: Client,
    recorder: Recorder,
    http: reqwest::Client,
    collector: Collector,
    services: HashMap<String, Memory>,
    metrics: OperatorMetrics,
    /// Port of the sidecars' metrics (9090 in worker pods).
    pub metrics_port: u16,
    /// How long one pod's scrape may take.
    pub scrape_timeout: Duration,
    /// How often it decides: a service at zero waits up to this for the decision that asks for
    /// its pods, part of the start-up the holder tells callers.
    pub interval: Duration,
    /// Port of the holder pods' admin listener (its directions and metrics).
    pub holder_port: u16,
    /// The bearer token the holder's directions carry.
    pub holder_token: Option<String>,
    /// Whether a holder pod is ready: without one, no service goes to zero.
    holders_ready: bool,
    /// Each holder pod's series (by its UID): service ("namespace/name") → collector key.
    holder_series: HashMap<String, HashMap<String, String>>,
}

fn key(isvc: &InferenceService) -> String {
    format!("{}/{}", isvc.namespace().unwrap_or_default(), isvc.name_any())
}

/// The spec's numbers for [`decide`]; `None` for a spec the reconciler reports as invalid.
/// `measured`: the service's time-to-ready, which replaces `startupTime` once there is one.
pub fn target(isvc: &InferenceService, measured: Option<Duration>) -> Option<Target> {
    let checked = desired::check(&isvc.spec).ok()?;
    let s = &isvc.spec;
    Some(Target {
        workers: 1,
        max_batch_size: s.batching.max_batch_size,
        max_wait: checked.max_wait,
        latency_budget: checked.latency_budget,
        batch_time: checked.batch_time,
        target_utilization: s.scaling.target_utilization,
        min_replicas: s.scaling.min_replicas,
        max_replicas: s.scaling.max_replicas,
        warm_replicas: s.scaling.warm_replicas,
        scale_down_delay: checked.scale_down_delay,
        pressure_tolerance: PRESSURE_TOLERANCE,
        startup: measured.unwrap_or(checked.startup_time),
        ttft_budget: s.engine.kind.generates().then(|| {
            let budget = s.generation.as_ref().and_then(|g| g.ttft_budget.as_ref()).and_then(|d| d.parse().ok());
            // The sidecar's default when the spec names none.
            budget.unwrap_or(Duration::from_secs(1))
        }),
        scale_to_zero_after: checked.scale_to_zero_after,
    })
}

impl Autoscaler {
    /// `window`: the span rates are taken over.
    pub fn new(client: Client, recorder: Recorder, window: Duration, metrics: OperatorMetrics) -> Self {
        Autoscaler {
            client,
            recorder,
            http: reqwest::Client::new(),
            collector: Collector::new(window),
            services: HashMap::new(),
            metrics,
            metrics_port: METRICS_PORT as u16,
            scrape_timeout: Duration::from_secs(1),
            interval: Duration::from_secs(2),
            holder_port: METRICS_PORT as u16,
            holder_token: None,
            holders_ready: false,
            holder_series: HashMap::new(),
        }
    }

    /// The services it keeps a history for ("namespace/name"), sorted.
    pub fn remembered(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.services.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Waits for the stores, then runs a tick every `interval`, forever.
    pub async fn run(mut self, stores: Stores, interval: Duration) {
        if stores.ready().await.is_err() {
            tracing::error!("the autoscaler's watches stopped before listing");
            return;
        }
        tracing::info!(every = ?interval, "autoscaler started");
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.tick(&stores, ferry_core::clock::now(), Timestamp::now()).await;
        }
    }

    /// One round: scrape, decide and act for every InferenceService. `now` times the scrapes;
    /// `wall` is the cluster's clock, for the pods' timestamps.
    pub async fn tick(&mut self, stores: &Stores, now: Instant, wall: Timestamp) {
        let services = stores.services.state();
        tracing::debug!(services = services.len(), pods = stores.pods.state().len(), "autoscaler tick");
        let alive: HashSet<String> = services.iter().map(|s| key(s)).collect();
        let metrics = &self.metrics;
        let mut held_gone = Vec::new();
        self.services.retain(|k, memory| {
            let keep = alive.contains(k);
            if !keep {
                let (namespace, name) = k.split_once('/').unwrap_or(("", k));
                metrics.forget(namespace, name, &Reason::ALL.map(Reason::label));
                if memory.slice.is_some() {
                    held_gone.push(k.clone());
                }
            }
            keep
        });
        // A deleted service's slice goes with it (its owner reference); the holders forget it.
        if let Some(holders) = &stores.holders {
            let (http, timeout, port, token) = (&self.http, self.scrape_timeout, self.holder_port, &self.holder_token);
            let told = held_gone.iter().flat_map(|k| {
                ready_holders(&holders.state()).into_iter().map(move |(_, ip)| {
                    let request = with_token(http.delete(format!("http://{ip}:{port}/services/{k}")), token);
                    tokio::time::timeout(timeout, request.send())
                })
            });
            futures::future::join_all(told).await;
        }

        let mut pods: HashMap<String, Vec<Arc<Pod>>> = HashMap::new();
        for pod in stores.pods.state() {
            if let Some(service) = pod.labels().get(LABEL_SERVICE) {
                pods.entry(format!("{}/{service}", pod.namespace().unwrap_or_default())).or_default().push(pod.clone());
            }
        }
        let mut workers: HashMap<&String, Vec<WorkerPod>> =
            pods.iter().map(|(service, pods)| (service, workers(pods, wall))).collect();

        // A pod that became ready as the end of its start-up, less than a window ago, counts
        // from zero at its Ready time. (One whose Ready only flapped has counted since long
        // before: its first scrape is a baseline, not growth.)
        for w in workers.values().flatten() {
            if let (Some(_), Some(ready_for), Some(age)) = (&w.ip, w.ready_for, w.age) {
                if ready_for < self.collector.span() && age.saturating_sub(ready_for) < START_UP_AT_MOST {
                    if let Some(at) = now.checked_sub(ready_for) {
                        self.collector.started(&w.uid, at);
                    }
                }
            }
        }
        let targets: Vec<(String, String)> = workers
            .values()
            .flatten()
            .filter_map(|w| {
                w.ip.as_ref().map(|ip| (w.uid.clone(), format!("http://{ip}:{}/metrics", self.metrics_port)))
            })
            .collect();
        let (http, timeout) = (&self.http, self.scrape_timeout);
        let scraped: Vec<(String, Result<PodSample, String>)> = futures::stream::iter(targets)
            .map(|(uid, url)| async move {
                let sample = match tokio::time::timeout(timeout, scrape(http, &url)).await {
                    Ok(result) => result,
                    Err(_) => Err(format!("{url}: no answer within {timeout:?}")),
                };
                (uid, sample)
            })
            .buffer_unordered(CONCURRENT_SCRAPES)
            .collect()
            .await;
        tracing::debug!(pods = scraped.len(), failed = scraped.iter().filter(|(_, s)| s.is_err()).count(), "scraped");
        for (uid, sample) in scraped {
            match sample {
                Ok(sample) => self.collector.observe(&uid, now, sample),
                Err(e) => {
                    self.metrics.scrape_failures.inc();
                    tracing::debug!(pod = %uid, error = %e, "scrape failed");
                }
            }
        }
        for w in workers.values_mut().flatten() {
            w.work = self.collector.last(&w.uid).map_or(0.0, |s| s.queue_depth + s.running);
        }
        let holders = stores.holders.as_ref().map(|h| ready_holders(&h.state()));
        self.holders_ready = holders.as_ref().is_some_and(|h| !h.is_empty());
        let held = self.scrape_holders(holders.as_deref().unwrap_or_default(), now).await;
        let mut uids: Vec<String> = workers.values().flatten().map(|w| w.uid.clone()).collect();
        uids.extend(held.values().flatten().cloned());
        self.collector.retain(&uids);

        for isvc in &services {
            let k = key(isvc);
            let mine = pods.get(&k).map(Vec::as_slice).unwrap_or_default();
            let memory = self.services.entry(k.clone()).or_default();
            for pod in mine {
                memory.startup.observe(pod, wall);
            }
            memory.startup.retain(&mine.iter().filter_map(|p| p.uid()).collect());
            let reference = ObjectRef::new(&isvc.name_any()).within(&isvc.namespace().unwrap_or_default());
            let Some(deployment) = stores.deployments.get(&reference) else { continue };
            let empty = Vec::new();
            let service_workers = workers.get(&k).unwrap_or(&empty);
            // The holder's figures are the service's load while no pod is ready; once one is, the
            // pods count what the holder releases to them (and what comes next), so counting the
            // holder's arrivals too would count the held requests twice.
            let up = service_workers.iter().any(|w| w.ip.is_some());
            let holding = if up { &[] } else { held.get(&k).map(Vec::as_slice).unwrap_or_default() };
            if let Err(e) = self.scale(isvc, &deployment, service_workers, holding, now).await {
                tracing::warn!(object = %k, error = %e, "could not scale");
            }
            // Without a holder configured (`--holder-selector=""`), no service goes to zero and
            // no slice of holder pods is kept.
            if let Some(holders) = &holders {
                if let Err(e) = self.hold(isvc, service_workers, holders).await {
                    tracing::warn!(object = %k, error = %e, "could not switch to or from the holder");
                }
            }
        }
    }

    /// Scrapes every ready holder pod; each one's figures for a service are recorded as one more
    /// pod of that service (`holder/POD/NAMESPACE/NAME`). Returns those, by service, for the
    /// holder pods that are still there (one whose scrape failed this time keeps its series).
    async fn scrape_holders(&mut self, holders: &[(String, String)], now: Instant) -> HashMap<String, Vec<String>> {
        let (http, timeout, port) = (&self.http, self.scrape_timeout, self.holder_port);
        let scraped: Vec<(String, Result<String, String>)> = futures::stream::iter(holders.iter().cloned())
            .map(|(uid, ip)| async move {
                let url = format!("http://{ip}:{port}/metrics");
                let text = match tokio::time::timeout(timeout, fetch(http, &url)).await {
                    Ok(result) => result,
                    Err(_) => Err(format!("{url}: no answer within {timeout:?}")),
                };
                (uid, text)
            })
            .buffer_unordered(CONCURRENT_SCRAPES)
            .collect()
            .await;
        for (uid, text) in scraped {
            match text.and_then(|t| super::hold::parse(&t)) {
                Ok(services) => {
                    let series = self.holder_series.entry(uid.clone()).or_default();
                    for ((namespace, name), sample) in services {
                        let pseudo = format!("holder/{uid}/{namespace}/{name}");
                        self.collector.observe(&pseudo, now, sample);
                        series.insert(format!("{namespace}/{name}"), pseudo);
                    }
                }
                Err(e) => {
                    self.metrics.scrape_failures.inc();
                    tracing::debug!(holder = %uid, error = %e, "holder scrape failed");
                }
            }
        }
        self.holder_series.retain(|uid, _| holders.iter().any(|(alive, _)| alive == uid));
        let mut held: HashMap<String, Vec<String>> = HashMap::new();
        for series in self.holder_series.values() {
            for (service, pseudo) in series {
                held.entry(service.clone()).or_default().push(pseudo.clone());
            }
        }
        held
    }

    /// Scale to zero's part of a tick for one service: tells every holder pod the service's
    /// deadlines, start-up and ready pods, and keeps its EndpointSlice of holder pods, ready while
    /// no worker pod is. A service that stops scaling to zero is forgotten by the holders and its
    /// slice deleted.
    async fn hold(
        &mut self,
        isvc: &InferenceService,
        workers: &[WorkerPod],
        holders: &[(String, String)],
    ) -> Result<(), kube::Error> {
        let k = key(isvc);
        let (namespace, name) = (isvc.namespace().unwrap_or_default(), isvc.name_any());
        let memory = self.services.entry(k.clone()).or_default();
        let zero = target(isvc, memory.startup.measured())
            .filter(|t| t.min_replicas == 0 && t.scale_to_zero_after.is_some())
            .zip(desired::check(&isvc.spec).ok());
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &namespace);
        let (http, timeout, port, token) = (&self.http, self.scrape_timeout, self.holder_port, &self.holder_token);
        // Without a ready holder pod there is nothing to switch to: the decision keeps one pod.
        let zero = zero.filter(|_| !holders.is_empty());
        let Some((t, checked)) = zero else {
            // A slice this process never applied (another leader did, before) is deleted once.
            let unseen = !std::mem::replace(&mut memory.slice_checked, true);
            if memory.slice.take().is_some() || unseen {
                let url = |ip: &String| format!("http://{ip}:{port}/services/{namespace}/{name}");
                let told = holders
                    .iter()
                    .map(|(_, ip)| tokio::time::timeout(timeout, with_token(http.delete(url(ip)), token).send()));
                futures::future::join_all(told).await;
                match slices.delete(&super::hold::slice_name(&name), &Default::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
            return Ok(());
        };
        let stuck_after = 2 * t.startup + STUCK_MARGIN;
        let ttr = t.startup + 2 * self.interval;
        let state = super::hold::state(isvc, checked.latency_budget, t.ttft_budget, ttr, stuck_after, workers);
        // Sent without waiting for the answers: a hung holder pod must not hold up the tick (for
        // each service); what one misses, the next tick tells it again.
        for (_, ip) in holders {
            let url = format!("http://{ip}:{port}/services/{namespace}/{name}");
            let request = with_token(http.put(url), token).json(&state).send();
            let ip = ip.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(timeout, request).await {
                    Ok(Ok(r)) if r.status().is_success() => {}
                    Ok(Ok(r)) => {
                        tracing::debug!(holder = %ip, status = %r.status(), "the holder refused a service's state")
                    }
                    Ok(Err(e)) => tracing::debug!(holder = %ip, error = %e, "could not tell the holder"),
                    Err(_) => tracing::debug!(holder = %ip, "the holder did not answer in time"),
                }
            });
        }
        let mut ips: Vec<String> = holders.iter().map(|(_, ip)| ip.clone()).collect();
        ips.sort();
        let at_zero = workers.iter().all(|w| w.ip.is_none());
        let slice = super::hold::endpoint_slice(isvc, &ips, at_zero);
        if memory.slice.as_ref() != Some(&slice) {
            let params = PatchParams::apply(desired::FIELD_MANAGER).force();
            slices.patch(&super::hold::slice_name(&name), &params, &Patch::Apply(&slice)).await?;
            tracing::info!(object = %k, at_zero, holders = ips.len(), "holder endpoints applied");
            memory.slice = Some(slice);
        }
        Ok(())
    }

    /// Decides for one InferenceService, whose worker Deployment is `deployment` and whose pods
    /// are `workers`, from the collector's figures, and acts.
    /// `holding`: the holder's series for the service (its load while at zero).
    pub async fn scale(
        &mut self,
        isvc: &InferenceService,
        deployment: &Deployment,
        workers: &[WorkerPod],
        holding: &[String],
        now: Instant,
    ) -> Result<Option<ScaleDecision>, kube::Error> {
        let mut uids: Vec<String> = workers.iter().filter(|w| w.ip.is_some()).map(|w| w.uid.clone()).collect();
        uids.extend(holding.iter().cloned());
        let window = self.collector.span();
        let settling: Vec<String> = workers
            .iter()
            .filter(|w| w.ip.is_some() && w.ready_for.is_some_and(|r| r < window))
            .map(|w| w.uid.clone())
            .collect();
        let observed = self.collector.observed(&uids, &settling, now);
        let fill =
            self.collector.rows_per_batch(&uids, now).map(|rows| rows / f64::from(isvc.spec.batching.max_batch_size));
        self.act(isvc, deployment, workers, observed, fill, now).await
    }

    /// Decides on `observed` (its pod counts are taken from `workers`) and acts. `None` for a
    /// spec the reconciler reports as invalid.
    pub async fn act(
        &mut self,
        isvc: &InferenceService,
        deployment: &Deployment,
        workers: &[WorkerPod],
        observed: Observed,
        fill: Option<f64>,
        now: Instant,
    ) -> Result<Option<ScaleDecision>, kube::Error> {
        let k = key(isvc);
        let memory = self.services.entry(k.clone()).or_default();
        let measured = memory.startup.measured();
        let Some(mut target) = target(isvc, measured) else { return Ok(None) };
        if !self.holders_ready {
            // Nothing would hold its requests, nor show their load: one pod at least.
            target.scale_to_zero_after = None;
        }
        // The pods' own capacity figure outlives them: at zero, the held load is sized by what
        // the last pods said they serve, not by the batch arithmetic.
        if observed.capacity.is_some() {
            memory.capacity = observed.capacity;
        }
        let observed = Observed { capacity: observed.capacity.or(memory.capacity), ..observed };
        let namespace = isvc.namespace().unwrap_or_default();
        let name = isvc.name_any();
        let current = deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1).max(0) as u32;
        let ready: Vec<&WorkerPod> = workers.iter().filter(|w| w.ip.is_some()).collect();
        let window = self.collector.span();
        // Pods asked for but not there yet, and unready pods young enough to be on their way, are
        // capacity to come. One unready for longer (unschedulable, failing its image pull or
        // crash-looping) is not: it must not hold scale-down and pressure back for ever.
        let stuck_after = 2 * target.startup + STUCK_MARGIN;
        let coming = workers.iter().filter(|w| w.ip.is_none() && w.age.is_none_or(|a| a < stuck_after)).count();
        let unready = workers.iter().filter(|w| w.ip.is_none()).count();
        let observed = Observed {
            starting: current.saturating_sub(workers.len() as u32) + coming as u32,
            stuck: (unready - coming) as u32,
            rolling_out: rolling_out(deployment),
            settling: ready.iter().filter(|w| w.ready_for.is_some_and(|r| r < window)).count() as u32,
            ..observed
        };
        let decision = decide(&observed, &target, current, &memory.history, now);
        tracing::debug!(object = %k, rate = observed.arrival_rate, latest = observed.latest_rate, pressure = observed.pressure,
            starting = observed.starting, settling = observed.settling, replicas = decision.replicas,
            reason = decision.reason.label(), "decided");
        memory.history = decision.history.clone();
        let capacity_per_replica = observed.capacity.unwrap_or_else(|| {
            let batch_time = observed.batch_time.unwrap_or(target.batch_time);
            super::decide::capacity_per_replica(&target, batch_time, observed.rows_per_request)
        });
        self.metrics.decided(
            &namespace,
            &name,
            decision.reason.label(),
            &Decided {
                desired: decision.replicas,
                ready: ready.len() as u32,
                starting: observed.starting,
                stuck: observed.stuck,
                min: target.min_replicas,
                max: target.max_replicas,
                offered: observed.arrival_rate,
                capacity_per_replica,
                configured_startup: desired::check(&isvc.spec).map_or(0.0, |c| c.startup_time.as_secs_f64()),
                measured_startup: measured.map(|d| d.as_secs_f64()),
            },
        );

        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &namespace);
        let changed = decision.replicas != current;
        if decision.replicas < current {
            self.write_deletion_costs(&namespace, &ready).await?;
        }
        if changed {
            let patch = desired::replicas_patch(isvc, decision.replicas as i32);
            deployments.patch(&name, &PatchParams::apply(REPLICAS_MANAGER).force(), &Patch::Apply(&patch)).await?;
        }
        let status = InferenceServiceStatus {
            desired_replicas: Some(decision.replicas as i32),
            arrival_rate: Some(round(observed.arrival_rate)),
            queue_depth: Some(observed.queue_depth),
            oldest_queue_age: Some(round(observed.oldest_queue_age.as_secs_f64())),
            batch_fill: fill.map(round),
            capacity_per_replica: Some(round(capacity_per_replica)),
            tokens_per_second: target.ttft_budget.map(|_| round(observed.tokens_rate)),
            kv_usage: observed.kv_usage.map(round),
            last_scale_time: changed.then(|| Time(Timestamp::now())),
            last_scale_reason: changed.then(|| decision.message.clone()),
            startup_time: Some(round(target.startup.as_secs_f64())),
            measured_startup_time: measured.map(|d| round(d.as_secs_f64())),
            ..InferenceServiceStatus::default()
        };
        let isvcs: Api<InferenceService> = Api::namespaced(self.client.clone(), &namespace);
        isvcs.patch_status(&name, &PatchParams::default(), &status::patch(&status)).await?;
        if changed {
            tracing::info!(object = %k, from = current, to = decision.replicas, reason = decision.reason.label(), message = %decision.message, "scaled");
            // The counts are in the action too: the recorder folds repeats of one action into a
            // series that keeps its first note, so "2 → 3" must not stand for a later "3 → 8".
            let event = Event {
                type_: EventType::Normal,
                reason: "Scaled".into(),
                note: Some(format!("{current} → {} replicas: {}", decision.replicas, decision.message)),
                action: format!("Scale {current} to {}", decision.replicas),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&event, &isvc.object_ref(&())).await {
                tracing::warn!(object = %k, error = %e, "could not publish an event");
            }
        }
        Ok(Some(decision))
    }

    /// Before a scale-down: each ready pod's deletion cost is its work at the last scrape (its
    /// queue, and the streams it is sending), so the ReplicaSet removes the pods with the least.
    /// Ready pods go only while none is starting; a scale-down while pods start (rule 7's
    /// cancel) is meant to take them, which a ReplicaSet removes first.
    async fn write_deletion_costs(&self, namespace: &str, ready: &[&WorkerPod]) -> Result<(), kube::Error> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        for pod in ready {
            let cost = (pod.work.round() as i64).clamp(0, i64::from(i32::MAX)).to_string();
            if pod.deletion_cost.as_deref() == Some(cost.as_str()) {
                continue;
            }
            let patch = json!({"metadata": {"annotations": {DELETION_COST: cost}}});
            pods.patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        }
        Ok(())
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The Deployment still has pods of an older template (`kubectl rollout status`'s test): a
/// rollout is replacing them.
pub fn rolling_out(deployment: &Deployment) -> bool {
    deployment.status.as_ref().is_some_and(|s| s.replicas.unwrap_or(0) > s.updated_replicas.unwrap_or(0))
}
