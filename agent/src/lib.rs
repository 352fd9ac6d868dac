//! The shardplane node agent: this system's kubelet.
//!
//! ```text
//!  agent ──► InferenceNode (create; status: chip, memory, addresses, engines)
//!        ──► Lease in shardplane-node-lease (renewed every few seconds)
//!        ◄── Shards labelled shardplane.dev/node=<me>: fetch, load, report, unload
//! ```
//!
//! On shutdown it drains: says so in its status, unloads its shards and gives
//! up its Lease so the operator re-places them at once.

pub mod cache;
pub mod machine;
pub mod metrics;
pub mod models;
pub mod registration;
pub mod shards;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kube::Client;

use crate::machine::Machine;
use crate::registration::Registration;

/// The longest one step of draining may take.
const DRAIN_STEP: Duration = Duration::from_secs(5);

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Registration: node name, labels, reserve, lease.
    pub registration: Registration,
    /// Where `/metrics`, `/livez` and `/readyz` listen.
    pub admin_address: SocketAddr,
    /// How often the Lease is renewed.
    pub renew_every: Duration,
    /// How often the machine's facts are written.
    pub report_every: Duration,
    /// Where downloaded weights are kept.
    pub cache_dir: std::path::PathBuf,
    /// Base URL of the Hugging Face hub (or a mirror).
    pub hugging_face_endpoint: String,
}

/// Runs the agent until `shutdown` resolves, then drains.
pub async fn run(
    client: Client,
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    let metrics = metrics::Metrics::new();
    let ready = Arc::new(AtomicBool::new(false));
    let listener = shardplane_admin::bind(config.admin_address)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.admin_address))?;
    let (stop_admin, admin_stopped) = tokio::sync::oneshot::channel::<()>();
    let admin = tokio::spawn(shardplane_admin::serve(
        listener,
        metrics.registry.clone(),
        ready.clone(),
        async {
            let _ = admin_stopped.await;
        },
    ));

    let reg = &config.registration;
    ensure_lease_namespace(&client).await?;
    reg.ensure_node(&client)
        .await
        .map_err(|e| format!("cannot register node {}: {e}", reg.node))?;
    reg.report(&client, &Machine::read(), false, &[], &metrics)
        .await
        .map_err(|e| format!("cannot report node {}: {e}", reg.node))?;
    reg.renew(&client)
        .await
        .map_err(|e| format!("cannot take the Lease of node {}: {e}", reg.node))?;
    tracing::info!(node = %reg.node, "registered");
    ready.store(true, Ordering::Relaxed);

    let shard_set = shards::ShardSet::default();
    let http = shardplane_models::http_client()?;
    let cache = cache::Cache::new(config.cache_dir.clone(), http).map_err(|e| {
        format!(
            "cannot use cache directory {}: {e}",
            config.cache_dir.display()
        )
    })?;
    let sources = shards::Sources {
        cache: cache.clone(),
        hugging_face_endpoint: config.hugging_face_endpoint.clone(),
    };
    let shard_task = tokio::spawn(shards::run(
        client.clone(),
        reg.node.clone(),
        shard_set.clone(),
        metrics.clone(),
        sources,
    ));
    let model_task = tokio::spawn(models::run(client.clone()));
    let heartbeat = {
        let (client, reg, metrics, cache) =
            (client.clone(), reg.clone(), metrics.clone(), cache.clone());
        let (renew_every, report_every) = (config.renew_every, config.report_every);
        tokio::spawn(async move {
            let mut last_report = tokio::time::Instant::now();
            loop {
                // A new model in the cache is reported at once; otherwise on the timer.
                let cache_changed = tokio::select! {
                    _ = tokio::time::sleep(renew_every) => false,
                    _ = cache.changed() => true,
                };
                match reg.renew(&client).await {
                    Ok(()) => metrics.lease_renewals.inc(),
                    Err(e) => {
                        metrics.lease_failures.inc();
                        tracing::warn!(error = %e, "cannot renew the Lease");
                    }
                }
                if cache_changed || last_report.elapsed() >= report_every {
                    last_report = tokio::time::Instant::now();
                    if let Err(e) = reg
                        .report(&client, &Machine::read(), false, &cache.listed(), &metrics)
                        .await
                    {
                        tracing::warn!(error = %e, "cannot report the node");
                    }
                }
            }
        })
    };

    shutdown.await;
    tracing::info!(node = %reg.node, "draining");
    ready.store(false, Ordering::Relaxed);
    heartbeat.abort();
    shard_task.abort();
    model_task.abort();
    // Every step is bounded: a drain must end even when the API server is gone.
    let bounded = |what: &'static str| {
        move |r: Result<kube::Result<()>, tokio::time::error::Elapsed>| match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "drain: cannot {what}"),
            Err(_) => tracing::warn!("drain: timed out trying to {what}"),
        }
    };
    bounded("report draining")(
        tokio::time::timeout(
            DRAIN_STEP,
            reg.report(&client, &Machine::read(), true, &cache.listed(), &metrics),
        )
        .await,
    );
    shard_set.unload_all();
    bounded("give up the Lease")(tokio::time::timeout(DRAIN_STEP, reg.release(&client)).await);
    let _ = stop_admin.send(());
    let _ = tokio::time::timeout(DRAIN_STEP, admin).await;
    tracing::info!(node = %reg.node, "stopped");
    Ok(())
}

/// Creates the node-lease namespace if the operator has not yet.
async fn ensure_lease_namespace(client: &Client) -> Result<(), String> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::Api;
    use kube::api::{ObjectMeta, PostParams};
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(shardplane_crds::NODE_LEASE_NAMESPACE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 || e.code == 403 => Ok(()),
        Err(e) => Err(format!(
            "cannot create namespace {}: {e}",
            shardplane_crds::NODE_LEASE_NAMESPACE
        )),
    }
}
