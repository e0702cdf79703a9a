//! The operator process: metrics and health server, leader election, and the controller and the
//! autoscaler, which start only once this replica leads and stops the process if leadership is lost (the pod is
//! restarted and becomes a candidate again, as controller-runtime does).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use kube::api::DynamicObject;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{predicates, reflector, watcher, Controller, Predicate, WatchStreamExt};
use kube::{Api, Client};
use tokio::sync::watch;

use crate::autoscale::scale::{Autoscaler, Stores};
use crate::desired::{Images, LABEL_SERVICE};
use crate::lease::{self, LeaseConfig};
use crate::metrics::OperatorMetrics;
use crate::reconcile::{error_policy, reconcile, Context};
use crate::routing;
use ferry_core::spec::InferenceService;

#[derive(Debug, Clone)]
pub struct Options {
    pub listen: SocketAddr,
    pub images: Images,
    /// `None`: no leader election (a single replica).
    pub lease: Option<(String, LeaseConfig)>,
    /// How often the autoscaler scrapes and decides, and the span its rates are taken over.
    pub scale_interval: Duration,
    pub metrics_window: Duration,
    /// The holder pods' label selector; `None`: no holder, and no service goes to zero.
    pub holder_selector: Option<String>,
    /// The bearer token of the holder's directions.
    pub holder_token: Option<String>,
    /// Watch the InferencePools the operator owns (the CRD and the RBAC are there).
    pub watch_inference_pools: bool,
}

/// Resolves on SIGTERM (the kubelet stopping the pod) or Ctrl-C.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Runs until SIGTERM/SIGINT, or until leadership is lost (an error: the process should restart).
pub async fn run(
    options: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let metrics = OperatorMetrics::new();
    let listener = tokio::net::TcpListener::bind(options.listen).await?;
    tracing::info!(address = %listener.local_addr()?, "serving /metrics and /healthz");
    let served = metrics.clone();
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(served.render())))
        .route("/healthz", get(|| std::future::ready("ok")));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let shutdown = shutdown.shared();
    let (leading_tx, mut leading) = watch::channel(options.lease.is_none());
    let mut election = None;
    if let Some((namespace, config)) = options.lease.clone() {
        let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
        let holder = tokio::spawn(lease::hold(leases.clone(), config.clone(), leading_tx));
        election = Some((holder, leases, config));
        tracing::info!("waiting to become the leader");
        tokio::select! {
            led = leading.wait_for(|l| *l) => { led?; }
            () = shutdown.clone() => {
                tracing::info!("stopped before becoming the leader");
                return Ok(());
            }
        }
    }

    let reporter = Reporter {
        controller: "ferry-operator".into(),
        instance: options.lease.as_ref().map(|(_, c)| c.identity.clone()),
    };
    // Owned objects are watched by Ferry's label only: a big cluster's other Deployments and
    // Services are none of the operator's business.
    let labelled = || watcher::Config::default().labels(LABEL_SERVICE);
    // The autoscaler writes each service's status every interval: a reconcile for each of those
    // writes would re-apply the Deployment and Service about once a second for nothing. The store
    // sees every change (the autoscaler reads it); reconciles follow spec changes (generation),
    // changes to the owned objects, and the periodic requeue. Where no generation is kept (an
    // emulator), every change passes.
    let (services, writer) = reflector::store();
    let changed = watcher(Api::<InferenceService>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation.fallback(predicates::resource_version), Default::default());
    let mut controller = Controller::for_stream(changed, services.clone())
        .owns(Api::<Deployment>::all(client.clone()), labelled())
        .owns(Api::<Service>::all(client.clone()), labelled());
    if options.watch_inference_pools {
        // A pool changed or deleted by anyone else is put back by the reconcile its change
        // triggers (its owner reference names the service), not at the next periodic one.
        let pools = routing::pool_resource();
        controller = controller.owns_with(Api::<DynamicObject>::all_with(client.clone(), &pools), pools, labelled());
    }
    let stores = Stores::watch(&client, services, options.holder_selector.as_deref());
    let autoscaler = Autoscaler::new(
        client.clone(),
        Recorder::new(client.clone(), reporter.clone()),
        options.metrics_window,
        metrics.clone(),
    );
    let mut autoscaler = autoscaler;
    autoscaler.interval = options.scale_interval;
    autoscaler.holder_token = options.holder_token.clone();
    let scaling = tokio::spawn(autoscaler.run(stores, options.scale_interval));
    let ctx = Arc::new(Context::new(client.clone(), options.images, metrics, Recorder::new(client.clone(), reporter)));
    let controller =
        controller.graceful_shutdown_on(shutdown).run(reconcile, error_policy, ctx).for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "reconcile did not complete");
            }
        });
    let lost = async move {
        let _ = leading.wait_for(|l| !*l).await;
    };
    tokio::select! {
        () = controller => {
            tracing::info!("controller stopped");
            // Stop scaling before the Lease goes: a follower may act at once after the release.
            scaling.abort();
            let _ = scaling.await;
            // Hand the Lease over at once rather than after its duration.
            if let Some((holder, leases, config)) = election {
                holder.abort();
                match tokio::time::timeout(config.retry, lease::release(&leases, &config)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not release the leader Lease"),
                    Err(_) => tracing::warn!("releasing the leader Lease timed out"),
                }
            }
            Ok(())
        }
        () = lost => {
            // Stop acting at once; the pod restarts as a candidate.
            scaling.abort();
            anyhow::bail!("lost the leader Lease; exiting so that only one replica acts")
        }
    }
}
