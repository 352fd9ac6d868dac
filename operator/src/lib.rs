//! The shardplane operator.
//!
//! ```text
//!  Model ──► model controller ──► status: architecture, layers, bytes per layer…
//!  Lease ──► node controller ──► InferenceNode Ready
//!  InferenceNode ──► node-pool controller ──► NodePool members, ready, allocatable
//!  ModelDeployment + Model + NodePool + ShardingStrategy + nodes + Shards
//!     ──► deployment controller: observe → validate → plan (shardplane-placement)
//!                                → apply Shards → status
//! ```
//!
//! One watch per kind fills the stores every controller reads (`caches`);
//! a reconcile never LISTs.
//!
//! Only the replica holding the leader Lease runs controllers, each in a task
//! of its own beside the lease renewal (which steps down at its renew
//! deadline, before the Lease can pass to another replica). Every replica
//! serves `/metrics`, `/livez`, `/readyz` and the web view (`/ui`,
//! `shardplane-view`) on its admin port; `/readyz` says
//! the replica reaches the API server (leader or standby), the
//! `shardplane_operator_leader` gauge says it leads. Every replica also
//! serves the validating admission webhook when it is on (`admission`).

pub mod admission;
pub mod caches;
pub mod conditions;
pub mod controllers;
pub mod error;
pub mod leader;
pub mod metrics;
pub mod signer;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kube::Client;
use kube::runtime::events::Reporter;
use shardplane_crds::NODE_LEASE_NAMESPACE;

pub use error::{Error, Result, RunError};

/// How the operator runs.
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    /// Where `/metrics`, `/livez` and `/readyz` listen.
    pub admin_address: SocketAddr,
    /// The leader election.
    pub election: leader::Election,
    /// How long a node's Lease lasts when it does not say.
    pub default_node_lease: Duration,
    /// Base URL of the Hugging Face hub (or a mirror) for `huggingFace` sources.
    pub hugging_face_endpoint: String,
    /// The hub token for gated and private repositories; sent only to the
    /// hub's endpoint, never logged or written anywhere.
    pub hugging_face_token: Option<String>,
    /// Read `path` model sources where the operator runs (one machine); when
    /// false, agents holding the file report its metadata.
    pub read_model_paths: bool,
    /// The gateway's base URL, written into each placed deployment's
    /// `status.endpoint`; no endpoint is written when unset.
    pub gateway_url: Option<String>,
    /// The web view at `/ui` on the admin port; none when turned off.
    pub view: Option<shardplane_view::web::Settings>,
    /// The validating admission webhook; none when turned off.
    pub webhook: Option<admission::WebhookConfig>,
    /// The data-plane signer; none when turned off.
    pub signer: Option<signer::SignerConfig>,
}

pub use shardplane_models::{HUGGING_FACE_HUB, http_client};

/// Runs the operator until a signal arrives or leadership is lost; returns an
/// error in the latter case so the process exits non-zero and is restarted.
pub async fn run(client: Client, config: OperatorConfig) -> std::result::Result<(), RunError> {
    let metrics = metrics::Metrics::new();
    let ready = Arc::new(AtomicBool::new(false));
    let listener = shardplane_admin::bind(config.admin_address)
        .await
        .map_err(|source| RunError::Listen {
            address: config.admin_address,
            source,
        })?;
    tracing::info!(address = %config.admin_address, "admin endpoints up");
    // Every replica serves the view (it lists what it shows, so a standby
    // shows the same as the leader).
    let view = match &config.view {
        Some(settings) => shardplane_view::web::router(client.clone(), settings.clone()),
        None => axum::Router::new(),
    };
    let admin = tokio::spawn(shardplane_admin::serve(
        listener,
        metrics.registry.clone(),
        ready.clone(),
        view,
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    ));

    // Every replica serves the webhook, so that a standby answers while
    // the leader is away.
    let webhook = match &config.webhook {
        Some(settings) => Some(tokio::spawn(
            admission::start(client.clone(), settings.clone(), metrics.clone()).await?,
        )),
        None => None,
    };

    config.election.acquire(&client, &ready).await;
    metrics.leader.set(1);
    leader::ensure_namespace(&client, NODE_LEASE_NAMESPACE)
        .await
        .map_err(|source| RunError::Namespace {
            namespace: NODE_LEASE_NAMESPACE,
            source,
        })?;
    // Controllers subscribe to the shared watches before they start.
    let mut caches = caches::Caches::new();
    let (models, nodes, pools, deployments) = (
        controllers::model::controller(&caches),
        controllers::node::controller(&caches),
        controllers::node_pool::controller(&caches),
        controllers::deployment::controller(&caches),
    );
    caches.start(&client);
    let signing = match &config.signer {
        Some(settings) => Some((
            signer::controller(&client),
            signer::ensure_ca(&client, settings)
                .await
                .map_err(|e| RunError::Signer(e.to_string()))?,
        )),
        None => None,
    };
    let contact = Arc::new(leader::Contact::new());
    let ctx = Arc::new(controllers::Context {
        client: client.clone(),
        metrics: metrics.clone(),
        reporter: Reporter {
            controller: "shardplane-operator".into(),
            instance: Some(config.election.identity.clone()),
        },
        default_lease_duration: config.default_node_lease,
        http: http_client()?,
        hub_http: shardplane_models::hub::api_client(config.hugging_face_token.as_deref())?,
        hugging_face_endpoint: config.hugging_face_endpoint.clone(),
        read_model_paths: config.read_model_paths,
        gateway_url: config.gateway_url.clone(),
        stores: caches.stores(),
        contact: contact.clone(),
        contact_gap: config.election.contact_gap(),
        renew_deadline: config.election.renew_deadline(),
        node_leases: Default::default(),
    });
    // Controllers run in tasks of their own, apart from the lease renewal:
    // however long a reconcile takes, the renewal is never behind it.
    let mut controllers = tokio::task::JoinSet::new();
    controllers.spawn(controllers::model::run(models, ctx.clone()));
    controllers.spawn(controllers::node::run(nodes, ctx.clone()));
    controllers.spawn(controllers::node_pool::run(pools, ctx.clone()));
    if let Some((signer, ca)) = signing {
        controllers.spawn(signer::run(signer, ctx.clone(), ca));
    }
    controllers.spawn(controllers::deployment::run(deployments, ctx));
    let first_stopped = async {
        match controllers.join_next().await {
            Some(Err(e)) if e.is_panic() => Err(RunError::ControllerStopped(e.to_string())),
            // They stop together at a signal.
            _ => Ok(()),
        }
    };
    let outcome = tokio::select! {
        stopped = first_stopped => stopped,
        () = config.election.hold(&client, &contact) => Err(RunError::LostLeadership),
    };
    if outcome.is_ok() {
        while controllers.join_next().await.is_some() {}
        config.election.release(&client).await;
    }
    // A replica that lost the lease stops acting at once.
    controllers.abort_all();
    metrics.leader.set(0);
    admin.abort();
    if let Some(webhook) = webhook {
        webhook.abort();
    }
    outcome
}
