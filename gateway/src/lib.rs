//! `shardplane gateway`: one OpenAI-, Anthropic- and Ollama-compatible
//! endpoint in front of every ModelDeployment.
//!
//! ```text
//!  client ──HTTP──► gateway: API key ─► parse (per API) ─► route ─► Generate on a head stage (gRPC)
//!         ◄── JSON, SSE or NDJSON (per API) ◄──────────── text deltas ◄──┘
//! ```
//!
//! It reads ModelDeployments, Models and Shards from the Kubernetes API
//! (watches) and knows which instances are ready without asking the operator.

pub mod apis;
pub mod auth;
pub mod conversations;
mod error;
pub mod external;
pub mod metrics;
pub mod protocol;
pub mod routing;
pub mod server;
pub mod sse;

use std::net::SocketAddr;

use axum::Router as Http;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderMap;
use axum::routing::{get, post};
use kube::Client;

use crate::apis::{Anthropic, Dialect, Ollama, OpenAi, Responses};
pub use crate::error::{Error, Result};

/// How the gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Where the APIs listen.
    pub listen: SocketAddr,
    /// Where `/metrics`, `/livez` and `/readyz` listen.
    pub admin_address: SocketAddr,
    /// The data-plane token.
    pub token: shardplane_dataplane::Token,
    /// Where the data plane's CA and the gateway's certificate come from.
    pub data_plane_tls: DataPlaneTls,
    /// Where API keys come from.
    pub keys: auth::KeySource,
    /// Requests per minute per key, when limited.
    pub rate_limit_per_minute: Option<u32>,
    /// How long a request waits while every instance is busy (then 429).
    pub busy_wait: std::time::Duration,
    /// How long an answer cut off by a failed instance waits for an
    /// instance to resume on (another replica, or the same one re-placed).
    pub heal_wait: std::time::Duration,
    /// How long an instance has to start an answer and to give its first
    /// token before the next is tried.
    pub deadlines: routing::Deadlines,
    /// The largest generation request body, in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// How long a request's body may take to arrive (longer: 408).
    pub body_timeout: std::time::Duration,
    /// Connections, header deadline and drain of the HTTP server.
    pub limits: server::Limits,
    /// Where external fallbacks may send requests.
    pub external_allowlist: external::Allowlist,
}

/// Where the gateway's data-plane TLS material comes from: its client-only
/// certificate (agents require one of every caller) and the CA.
pub use shardplane_cluster::certificate::Source as DataPlaneTls;

/// The largest body of the routes that are not generation requests.
pub(crate) const SMALL_BODY_BYTES: usize = 64 << 10;

/// The shared state of the handlers.
#[derive(Clone)]
pub struct App {
    router: routing::Router,
    keys: auth::Keys,
    metrics: metrics::Metrics,
    responses: Responses,
    max_body_bytes: usize,
    body_timeout: std::time::Duration,
}

/// The HTTP routes.
pub fn routes(app: App) -> Http {
    fn generation<D: Dialect>(
        api: D,
    ) -> impl Fn(
        State<App>,
        HeaderMap,
        Body,
    ) -> futures::future::BoxFuture<'static, axum::response::Response>
    + Clone
    + Send
    + Sync
    + 'static {
        move |State(app): State<App>, headers: HeaderMap, body: Body| {
            Box::pin(apis::handle(app, api.clone(), headers, body))
        }
    }
    Http::new()
        .route("/v1/chat/completions", post(generation(OpenAi::Chat)))
        .route("/v1/completions", post(generation(OpenAi::Text)))
        .route("/v1/responses", post(generation(app.responses.clone())))
        .route(
            "/v1/responses/{id}",
            get(apis::get_response).delete(apis::delete_response),
        )
        .route("/v1/models", get(apis::openai_models))
        .route("/v1/models/{*id}", get(apis::openai_model))
        .route("/v1/messages", post(generation(Anthropic)))
        .route("/api/chat", post(generation(Ollama::Chat)))
        .route("/api/generate", post(generation(Ollama::Generate)))
        .route("/api/tags", get(apis::ollama_tags))
        .route("/api/show", post(apis::ollama_show))
        .route("/api/ps", get(apis::ollama_ps))
        .route(
            "/api/version",
            get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    format!("{{\"version\":\"{}\"}}", env!("CARGO_PKG_VERSION")),
                )
            }),
        )
        // Generation routes read their bodies themselves, after the key,
        // up to `max_body_bytes`; every other route takes a small one.
        .layer(DefaultBodyLimit::max(SMALL_BODY_BYTES))
        .with_state(app)
}

/// Runs the gateway until `shutdown` resolves.
pub async fn run(
    client: Client,
    config: GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let metrics = metrics::Metrics::new();
    let admin =
        shardplane_admin::Admin::start(config.admin_address, metrics.registry.clone()).await?;
    let keys = auth::Keys::new(config.keys.clone(), config.rate_limit_per_minute);
    keys.load(&client).await?;
    tokio::spawn(keys.clone().reload_forever(client.clone()));
    let (deployments, _) = shardplane_cluster::watch_all(client.clone());
    let (models, _) = shardplane_cluster::watch_all(client.clone());
    let (shards, _) = shardplane_cluster::watch_all(client.clone());
    let http = external::http_client()?;
    let holder = shardplane_cluster::certificate::Holder::Gateway;
    let tls = shardplane_cluster::certificate::start(&client, &config.data_plane_tls, &holder)
        .await
        .map_err(|e| Error::Tls(e.to_string()))?
        .map(|(tls, _renewal)| {
            let gauge = metrics.certificate_expiry.clone();
            shardplane_cluster::certificate::report_expiry(tls.clone(), move |at| gauge.set(at));
            tls
        });
    let router = routing::Router::new(
        client.clone(),
        deployments.clone(),
        models.clone(),
        shards.clone(),
        config.token.clone(),
        http,
        metrics.clone(),
    )
    .with_data_plane_tls(tls)
    .with_busy_wait(config.busy_wait)
    .with_heal_wait(config.heal_wait)
    .with_deadlines(config.deadlines)
    .with_external_allowlist(config.external_allowlist.clone());
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Serve {
            address: config.listen,
            source,
        })?;
    let _ = tokio::join!(
        deployments.wait_until_ready(),
        models.wait_until_ready(),
        shards.wait_until_ready()
    );
    admin.set_ready(true);
    tracing::info!(listen = %config.listen, "gateway up");
    let app = App {
        router,
        keys,
        metrics,
        responses: Responses::default(),
        max_body_bytes: config.max_body_bytes,
        body_timeout: config.body_timeout,
    };
    let served = server::serve(listener, routes(app), config.limits, shutdown).await;
    admin.stop(std::time::Duration::from_secs(5)).await;
    served.map_err(|source| Error::Serve {
        address: config.listen,
        source,
    })
}
