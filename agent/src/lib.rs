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
pub mod dataplane;
pub mod download;
mod error;
pub mod kv_budget;
pub mod links;
pub mod machine;
pub mod metrics;
pub mod models;
pub mod peer_copy;
pub mod registration;
pub mod repository;
pub mod retry;
pub mod scheduler;
pub mod shards;
pub mod shared_prompt;
pub mod stage;
pub mod step_cost;
pub mod step_gather;
pub mod tensor;
#[cfg(test)]
mod test_stage;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kube::Client;

pub use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::registration::Registration;
pub use shardplane_cluster::certificate;

/// Arms the fault-injection points `FAILPOINTS` names (`point=actions;…`,
/// the `fail` crate's syntax), for tests that make a stage crash; none are
/// armed when it is unset. The one point is `stage-pass`, before each
/// forward pass of a stage (e.g. `stage-pass=1*panic(injected)`).
pub fn arm_fault_injection() -> std::result::Result<(), String> {
    let Ok(points) = std::env::var("FAILPOINTS") else {
        return Ok(());
    };
    for point in points.split(';').filter(|p| !p.trim().is_empty()) {
        let (name, actions) = point
            .split_once('=')
            .ok_or_else(|| format!("FAILPOINTS: {point:?} is not point=actions"))?;
        fail::cfg(name.trim(), actions.trim()).map_err(|e| format!("FAILPOINTS: {name}: {e}"))?;
        tracing::warn!(
            point = name.trim(),
            actions = actions.trim(),
            "fault injection armed"
        );
    }
    Ok(())
}

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
    /// The hub token for gated and private repositories; sent only to the
    /// hub's endpoint.
    pub hugging_face_token: Option<String>,
    /// The most bytes the cache may hold (least recently used models no
    /// shard uses are evicted); unlimited when unset.
    pub cache_budget: Option<u64>,
    /// Where the gRPC data plane listens (port 0 picks a free one).
    pub data_plane_address: SocketAddr,
    /// The `host:port` peers reach the data plane at; derived from the
    /// listening address when unset (see [`links::advertised`]).
    pub advertise_address: Option<String>,
    /// The API server's `host:port`: the advertised address of a data plane
    /// listening on every interface is the one on the route toward it.
    pub control_plane: Option<String>,
    /// The cluster's data-plane token.
    pub token: shardplane_dataplane::Token,
    /// Where the data plane's TLS certificate comes from.
    pub data_plane_tls: certificate::Source,
    /// How often the links to the other nodes are measured.
    pub probe_links_every: Duration,
    /// The engine stages run on.
    pub engine: shardplane_engine::pipeline::EngineKind,
    /// The longest a new generation may wait for its stage before it is
    /// refused (`RESOURCE_EXHAUSTED`), as the queued work and recent passes
    /// estimate it.
    pub max_queue_wait: Duration,
    /// How a stage's steps are made up (prompt tokens per step).
    pub budget: scheduler::Budget,
    /// Bytes of prompts' KV each whole-model stage keeps so that requests
    /// starting with the same tokens skip them (0: no prefix cache).
    pub prefix_cache_bytes: usize,
}

/// Runs the agent until `shutdown` resolves, then drains.
///
/// ```text
///  admin port ─► bind data plane ─► register (node, status, Lease) ─► ready
///     ─► serve: shards, models, links, data plane, heartbeat ─► shutdown ─► drain
/// ```
pub async fn run(
    client: Client,
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let metrics = metrics::Metrics::new();
    let admin =
        shardplane_admin::Admin::start(config.admin_address, metrics.registry.clone()).await?;
    let listen = |source| Error::Listen {
        address: config.data_plane_address,
        source,
    };
    let data_listener = tokio::net::TcpListener::bind(config.data_plane_address)
        .await
        .map_err(listen)?;
    let bound = data_listener.local_addr().map_err(listen)?;
    let endpoint = match &config.advertise_address {
        Some(a) => a.clone(),
        None => {
            let toward = match &config.control_plane {
                Some(host) => tokio::net::lookup_host(host.as_str())
                    .await
                    .ok()
                    .and_then(|mut all| all.find(|a| a.is_ipv4() == bound.is_ipv4()))
                    .and_then(links::source_toward),
                None => None,
            };
            let default_route = links::default_route_source(bound.is_ipv4());
            links::advertised(bound, &Machine::read().addresses, toward, default_route)
        }
    };
    // The certificate first: a node registers only once it can serve.
    let holder = certificate::Holder::Node(config.registration.node.clone());
    let tls = certificate::start(&client, &config.data_plane_tls, &holder)
        .await
        .map_err(|e| Error::Certificate(e.to_string()))?;
    let reg = register(&client, &config, &endpoint, &metrics).await?;
    admin.set_ready(true);
    let (tls, tls_task) = tls.unzip();
    let mut serving = serve(
        &client,
        &config,
        &reg,
        &endpoint,
        data_listener,
        tls.clone(),
        &metrics,
    )?;
    serving.tasks.extend(tls_task);
    tracing::info!(listen = %bound, endpoint = %endpoint, tls = tls.is_some(), "data plane up");
    shutdown.await;
    drain(&client, &reg, serving, &metrics, admin).await;
    Ok(())
}

/// Registers this node: its InferenceNode, a first status, and its Lease.
async fn register(
    client: &Client,
    config: &AgentConfig,
    endpoint: &str,
    metrics: &metrics::Metrics,
) -> Result<Registration> {
    let mut reg = config.registration.clone();
    reg.data_plane_endpoint = Some(endpoint.to_string());
    reg.engines = shards::engines(config.engine);
    reg.prompt_step = u32::try_from(config.budget.prefill_tokens).ok();
    ensure_lease_namespace(client, &reg.node).await?;
    let refused = |step| {
        let node = reg.node.clone();
        move |source| Error::Registration { step, node, source }
    };
    reg.ensure_node(client).await.map_err(refused("register"))?;
    reg.report(client, &Machine::read(), false, &[], metrics)
        .await
        .map_err(refused("report"))?;
    reg.renew(client)
        .await
        .map_err(refused("take the Lease of"))?;
    tracing::info!(node = %reg.node, "registered");
    Ok(reg)
}

/// What runs while the agent serves, to be stopped by [`drain`].
struct Serving {
    shard_set: shards::ShardSet,
    cache: cache::Cache,
    /// Watches, controllers, the link prober and the heartbeat.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop_data: tokio::sync::oneshot::Sender<()>,
    data_plane: tokio::task::JoinHandle<std::result::Result<(), tonic::transport::Error>>,
}

/// Starts everything that serves: the cache, the Shard and Model
/// controllers, the link prober, the data plane and the heartbeat.
fn serve(
    client: &Client,
    config: &AgentConfig,
    reg: &Registration,
    endpoint: &str,
    data_listener: tokio::net::TcpListener,
    tls: Option<std::sync::Arc<shardplane_dataplane::tls::Tls>>,
    metrics: &metrics::Metrics,
) -> Result<Serving> {
    let reg = reg.clone();
    let (client, metrics) = (client.clone(), metrics.clone());
    let shard_set = shards::ShardSet::new(endpoint);
    // Weights: no total deadline, but 30 s without a byte is a stall.
    let idle = cache::DOWNLOAD_IDLE;
    let http = shardplane_models::download_client(idle)?;
    let hub = shardplane_models::hub::download_client(idle, config.hugging_face_token.as_deref())?;
    let cache = cache::Cache::new(config.cache_dir.clone(), http)
        .map_err(|source| Error::CacheDirectory {
            dir: config.cache_dir.clone(),
            source,
        })?
        .with_budget(config.cache_budget)
        .with_hub(&config.hugging_face_endpoint, hub);
    cache.make_room(0);
    let (shard_directory, shard_directory_task) = shardplane_cluster::watch_all(client.clone());
    let (node_directory, node_directory_task) = shardplane_cluster::watch_all(client.clone());
    let peers = dataplane::Peers::new(config.token.clone(), tls.clone());
    let failures = metrics.handshake_failures.clone();
    let incoming = shardplane_dataplane::tls::incoming(data_listener, tls.clone(), move |why| {
        failures.with_label_values(&[why]).inc()
    })
    .map_err(|e| Error::Certificate(e.to_string()))?;
    // The certificate's expiry on /metrics, as renewals (or a reloaded
    // directory) change it.
    let expiry = tls.clone().map(|tls| {
        let gauge = metrics.certificate_expiry.clone();
        certificate::report_expiry(tls, move |at| gauge.set(at))
    });
    let sources = shards::Sources {
        cache: cache.clone(),
        hugging_face_endpoint: config.hugging_face_endpoint.clone(),
        peers: Some(shards::PeerSources {
            node: reg.node.clone(),
            nodes: node_directory.clone(),
            peers: peers.clone(),
            addresses: Machine::read().addresses,
        }),
        engine: config.engine,
        budget: config.budget,
        prefix_cache_bytes: config.prefix_cache_bytes,
        memory_reserve: config.registration.memory_reserve,
        directory: shard_directory.clone(),
        token: config.token.clone(),
        tls: tls.clone(),
    };
    let shard_task = tokio::spawn(shards::run(
        client.clone(),
        reg.node.clone(),
        shard_set.clone(),
        metrics.clone(),
        sources,
    ));
    let model_task = tokio::spawn(models::run(client.clone(), reg.node.clone()));
    let service = dataplane::Service::new(
        reg.node.clone(),
        shard_set.clone(),
        shard_directory,
        node_directory.clone(),
        peers,
        metrics.clone(),
        cache.clone(),
    )
    .with_max_queue_wait(config.max_queue_wait);
    let link_task = tokio::spawn(links::run(
        client.clone(),
        reg.node.clone(),
        node_directory,
        service.peers(),
        config.probe_links_every,
        metrics.clone(),
    ));
    let (stop_data, data_stopped) = tokio::sync::oneshot::channel::<()>();
    let data_plane = tokio::spawn(
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(32 << 20))
            .max_frame_size(shardplane_dataplane::MAX_FRAME_BYTES)
            .add_service(service.into_server(config.token.clone()))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = data_stopped.await;
            }),
    );
    let heartbeat = heartbeat(
        client,
        reg,
        metrics,
        cache.clone(),
        shard_set.clone(),
        (config.renew_every, config.report_every),
    );
    Ok(Serving {
        shard_set,
        cache,
        tasks: vec![
            heartbeat,
            shard_task,
            model_task,
            shard_directory_task,
            node_directory_task,
            link_task,
        ]
        .into_iter()
        .chain(expiry)
        .collect(),
        stop_data,
        data_plane,
    })
}

/// Renews the Lease and reports the node, on a timer and whenever the
/// cache lists a new model.
fn heartbeat(
    client: Client,
    reg: Registration,
    metrics: metrics::Metrics,
    cache: cache::Cache,
    shard_set: shards::ShardSet,
    (renew_every, report_every): (Duration, Duration),
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last_report = tokio::time::Instant::now();
        // The (head, later stage) pairs of the last beat's KV series.
        let mut later_series = std::collections::BTreeSet::new();
        loop {
            // A new model in the cache is reported at once; otherwise on the timer.
            let cache_changed = tokio::select! {
                _ = tokio::time::sleep(renew_every) => false,
                _ = cache.changed() => true,
            };
            metrics.cache_bytes.set(cache.total_bytes() as i64);
            let mut later_now = std::collections::BTreeSet::new();
            for stage in shard_set.all_served() {
                let stats = &stage.worker.stats;
                metrics
                    .sequences
                    .with_label_values(&[&stage.name])
                    .set(stats.sequences.load(Ordering::Relaxed) as i64);
                // A generation gives its reservation back after its stage's
                // last pass (which is when the gauge is set otherwise), so a
                // stage that falls idle would show its last reservation for
                // good without this.
                metrics
                    .kv_tokens
                    .with_label_values(&[&stage.name, "reserved"])
                    .set(stats.kv.reserved_tokens.load(Ordering::Relaxed) as i64);
                for (later, reserved, budget) in stats.kv.later_usage() {
                    for (kind, value) in [("reserved", reserved), ("budget", budget)] {
                        metrics
                            .kv_later_tokens
                            .with_label_values(&[&stage.name, &later, kind])
                            .set(value as i64);
                    }
                    later_now.insert((stage.name.clone(), later));
                }
            }
            // Later stages come and go with placements, heads with their
            // Shards: the series of those gone go too.
            for (shard, later) in later_series.difference(&later_now) {
                for kind in ["reserved", "budget"] {
                    let _ = metrics
                        .kv_later_tokens
                        .remove_label_values(&[shard, later, kind]);
                }
            }
            later_series = later_now;
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
}

/// Drains: not ready, background work stopped, in-flight generations ended,
/// the node reported draining, shards unloaded, the Lease given up. Every
/// step is bounded: a drain must end even when the API server is gone.
async fn drain(
    client: &Client,
    reg: &Registration,
    serving: Serving,
    metrics: &metrics::Metrics,
    admin: shardplane_admin::Admin,
) {
    tracing::info!(node = %reg.node, "draining");
    admin.set_ready(false);
    for task in &serving.tasks {
        task.abort();
    }
    // In-flight generations end when the data plane stops; new ones are refused.
    let _ = serving.stop_data.send(());
    match tokio::time::timeout(DRAIN_STEP, serving.data_plane).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "data plane failed"),
        Ok(Err(e)) => tracing::warn!(error = %e, "data plane panicked"),
        Err(_) => tracing::warn!("drain: in-flight streams outlived the drain step"),
    }
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
            reg.report(
                client,
                &Machine::read(),
                true,
                &serving.cache.listed(),
                metrics,
            ),
        )
        .await,
    );
    serving.shard_set.unload_all();
    bounded("give up the Lease")(tokio::time::timeout(DRAIN_STEP, reg.release(client)).await);
    admin.stop(DRAIN_STEP).await;
    tracing::info!(node = %reg.node, "stopped");
}

/// Creates the node-lease namespace if the operator has not yet.
async fn ensure_lease_namespace(client: &Client, node: &str) -> Result<()> {
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
        Err(source) => Err(Error::Registration {
            step: "create the Lease namespace for",
            node: node.to_string(),
            source,
        }),
    }
}
