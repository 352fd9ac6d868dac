//! The validating admission webhook, served by every operator replica
//! (leader or standby) over HTTPS.
//!
//! ```text
//!  kube-apiserver ──AdmissionReview──► /validate ──► review::review ──► allowed / refused
//!        ▲                                 (TLS: certs, from a Secret shared by replicas)
//!        └── ValidatingWebhookConfiguration (applied here, caBundle kept current)
//! ```
//!
//! Two webhooks:
//! - `objects.shardplane.dev`: every shardplane.dev object and status, for
//!   node identities' writes and the `validate()` rules at apply time;
//!   `failurePolicy: Fail` (a check that can be skipped protects nothing):
//!   with the webhook unreachable nobody writes shardplane objects, and
//!   agents serve on meanwhile;
//! - `nodes.shardplane.dev`: Leases in namespaces labelled
//!   `shardplane.dev/node-leases=true` (the node-lease namespace), so a node
//!   identity renews only its own; `failurePolicy: Ignore`, because a
//!   webhook the API server cannot reach while the operator runs would
//!   otherwise stop every renewal and turn every node NotReady (an outage);
//!   a node can renew another's Lease only while the webhook is unreachable.

pub mod certs;
pub mod names;
pub mod review;

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde_json::json;
use shardplane_crds::identity::NODE_LEASES_LABEL;
use shardplane_crds::{GROUP, NODE_LEASE_NAMESPACE, OPERATOR_MANAGER};
use tokio::net::TcpListener;

/// What can stop the webhook from starting.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The Kubernetes API failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A certificate could not be made or read.
    #[error("certificate: {0}")]
    Certificate(String),
    /// The webhook's address cannot be bound.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The address.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The webhook's result type.
pub type Result<T, E = WebhookError> = std::result::Result<T, E>;

/// How the API server reaches the webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// A URL (`https://host:port`; `/validate` is added), for an operator
    /// outside the cluster.
    Url(String),
    /// A Service in front of the operator replicas.
    Service {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// Its port.
        port: u16,
    },
}

impl Reach {
    /// The host names the serving certificate must name.
    pub fn hosts(&self) -> Vec<String> {
        match self {
            Reach::Url(url) => reqwest::Url::parse(url)
                .ok()
                .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_string()))
                .into_iter()
                .collect(),
            Reach::Service {
                namespace, name, ..
            } => vec![
                format!("{name}.{namespace}.svc"),
                format!("{name}.{namespace}.svc.cluster.local"),
            ],
        }
    }

    fn client_config(&self, ca_pem: &str) -> serde_json::Value {
        use base64::Engine;
        let bundle = base64::engine::general_purpose::STANDARD.encode(ca_pem);
        match self {
            Reach::Url(url) => json!({
                "url": format!("{}/validate", url.trim_end_matches('/')),
                "caBundle": bundle,
            }),
            Reach::Service {
                namespace,
                name,
                port,
            } => json!({
                "service": { "namespace": namespace, "name": name, "port": port, "path": "/validate" },
                "caBundle": bundle,
            }),
        }
    }
}

/// The webhook's settings.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Where it listens.
    pub listen: SocketAddr,
    /// How the API server reaches it.
    pub reach: Reach,
    /// The Secret holding the CA and serving certificate (`namespace`, `name`).
    pub secret: (String, String),
    /// The ValidatingWebhookConfiguration's name.
    pub configuration: String,
}

/// The webhook configuration for `reach`, trusting `ca_pem`.
pub fn configuration(name: &str, reach: &Reach, ca_pem: &str) -> serde_json::Value {
    let client = reach.client_config(ca_pem);
    let common = json!({
        "clientConfig": client,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 10,
    });
    let webhook = |name: &str, extra: serde_json::Value| {
        let mut w = common.clone();
        w["name"] = json!(name);
        for (k, v) in extra.as_object().into_iter().flatten() {
            w[k] = v.clone();
        }
        w
    };
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {
            "name": name,
            "labels": { "app.kubernetes.io/managed-by": "shardplane-operator" },
        },
        "webhooks": [
            webhook("nodes.shardplane.dev", json!({
                "rules": [{
                    "apiGroups": ["coordination.k8s.io"],
                    "apiVersions": ["v1"],
                    "resources": ["leases"],
                    "operations": ["CREATE", "UPDATE", "DELETE"],
                    "scope": "Namespaced",
                }],
                "namespaceSelector": { "matchLabels": { NODE_LEASES_LABEL: "true" } },
                "failurePolicy": "Ignore",
            })),
            webhook("objects.shardplane.dev", json!({
                "rules": [{
                    "apiGroups": [GROUP],
                    "apiVersions": ["*"],
                    "resources": ["*", "*/status"],
                    "operations": ["CREATE", "UPDATE"],
                }],
                "failurePolicy": "Fail",
            })),
        ],
    })
}

/// The certificate rustls serves, swapped when it is renewed.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok().map(|k| k.clone())
    }
}

fn certified(tls: &certs::ServingTls) -> Result<Arc<CertifiedKey>> {
    let bad = |e: String| WebhookError::Certificate(e);
    let chain = CertificateDer::pem_slice_iter(tls.cert_pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    let key =
        PrivateKeyDer::from_pem_slice(tls.key_pem.as_bytes()).map_err(|e| bad(e.to_string()))?;
    let signer =
        rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| bad(e.to_string()))?;
    Ok(Arc::new(CertifiedKey::new(chain, signer)))
}

/// Applies the webhook configuration and labels the node-lease namespace.
async fn register(client: &kube::Client, config: &WebhookConfig, ca_pem: &str) -> Result<()> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let body = configuration(&config.configuration, &config.reach, ca_pem);
    api.patch(
        &config.configuration,
        &PatchParams::apply(OPERATOR_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let has_label = |ns: &Namespace| {
        ns.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(NODE_LEASES_LABEL))
            .is_some_and(|v| v == "true")
    };
    // The chart labels it; the operator may not patch namespaces there.
    if let Ok(Some(ns)) = namespaces.get_opt(NODE_LEASE_NAMESPACE).await
        && has_label(&ns)
    {
        return Ok(());
    }
    let labelled = json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": NODE_LEASE_NAMESPACE, "labels": { NODE_LEASES_LABEL: "true" } },
    });
    if let Err(e) = namespaces
        .patch(
            NODE_LEASE_NAMESPACE,
            &PatchParams::apply(OPERATOR_MANAGER),
            &Patch::Apply(labelled),
        )
        .await
    {
        tracing::warn!(error = %e, "cannot label namespace {NODE_LEASE_NAMESPACE} {NODE_LEASES_LABEL}=true: node Leases are not checked by the webhook until it is labelled");
    }
    Ok(())
}

/// Binds the webhook's address, gets its certificate and applies its
/// configuration; the future serves it (renewing the certificate) until
/// the process ends.
pub async fn start(
    client: kube::Client,
    config: WebhookConfig,
    metrics: crate::metrics::Metrics,
) -> Result<impl Future<Output = ()> + Send + 'static> {
    let listener =
        TcpListener::bind(config.listen)
            .await
            .map_err(|source| WebhookError::Listen {
                address: config.listen,
                source,
            })?;
    let hosts = config.reach.hosts();
    let (ns, name) = &config.secret;
    // The Secret's namespace (the operator's own); an operator not allowed
    // to read namespaces finds it there already.
    if let Err(e) = crate::leader::ensure_namespace(&client, ns).await {
        tracing::debug!(error = %e, namespace = %ns, "cannot ensure the webhook Secret's namespace");
    }
    let tls = certs::ensure(&client, ns, name, &hosts).await?;
    let current = Arc::new(Current(RwLock::new(certified(&tls)?)));
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| WebhookError::Certificate(e.to_string()))?
    .with_no_client_auth()
    .with_cert_resolver(current.clone());
    register(&client, &config, &tls.ca_pem).await?;
    tracing::info!(address = %config.listen, configuration = %config.configuration, "admission webhook up");
    Ok(async move {
        let renew = renew(client.clone(), config, tls, current);
        let serve = serve(listener, Arc::new(server), (client.clone(), metrics));
        tokio::join!(renew, serve);
    })
}

/// Checks the certificate twice a day; a new one is served at once, and a
/// new CA (its Secret deleted) re-registered.
async fn renew(
    client: kube::Client,
    config: WebhookConfig,
    mut tls: certs::ServingTls,
    current: Arc<Current>,
) {
    let hosts = config.reach.hosts();
    let (ns, name) = &config.secret;
    loop {
        tokio::time::sleep(Duration::from_secs(12 * 3600)).await;
        let fresh = match certs::ensure(&client, ns, name, &hosts).await {
            Ok(fresh) => fresh,
            Err(e) => {
                tracing::warn!(error = %e, "cannot renew the webhook's certificate; retried later");
                continue;
            }
        };
        if fresh == tls {
            continue;
        }
        match certified(&fresh) {
            Ok(key) => {
                if let Ok(mut slot) = current.0.write() {
                    *slot = key;
                }
            }
            Err(e) => tracing::warn!(error = %e, "the renewed certificate cannot be served"),
        }
        if let Err(e) = register(&client, &config, &fresh.ca_pem).await {
            tracing::warn!(error = %e, "cannot update the webhook configuration");
        }
        tls = fresh;
    }
}

/// The largest review the webhook reads: an object and its old version,
/// each at most the API server's 1.5 MiB, and their envelope.
const REVIEW_LIMIT: usize = 4 << 20;

/// The shardplane resources, as the metric labels them.
const KINDS: [&str; 6] = [
    "models",
    "modeldeployments",
    "nodepools",
    "shardingstrategies",
    "inferencenodes",
    "shards",
];

/// What the handler needs.
type Shared = (kube::Client, crate::metrics::Metrics);

async fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, state: Shared) {
    let router = axum::Router::new()
        .route("/validate", post(validate))
        .layer(DefaultBodyLimit::max(REVIEW_LIMIT))
        .with_state(state);
    let listener = TlsListener::new(listener, tokio_rustls::TlsAcceptor::from(tls));
    if let Err(e) = axum::serve(listener, router).await {
        tracing::error!(error = %e, "the admission webhook stopped");
    }
}

async fn validate(State((client, metrics)): State<Shared>, body: Bytes) -> Response {
    let started = std::time::Instant::now();
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(review) => review,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("not an AdmissionReview: {e}\n"),
            )
                .into_response();
        }
    };
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return reply(&AdmissionResponse::invalid(e).into_review()),
    };
    let outcome = match review::verdict(&request) {
        Ok(()) => names::check(&client, &request).await,
        refused => refused,
    };
    let decision = match &outcome {
        Ok(()) => "allowed",
        Err(refusal) => match refusal.code {
            403 => "forbidden",
            409 => "conflict",
            _ => "invalid",
        },
    };
    // Bounded whoever sends the review (the webhook does not know its
    // caller): the kinds its rules name, else `other`.
    let resource = match (
        request.resource.group.as_str(),
        request.resource.resource.as_str(),
    ) {
        ("coordination.k8s.io", "leases") => "leases",
        (shardplane_crds::GROUP, r) if KINDS.contains(&r) => r,
        _ => "other",
    };
    metrics
        .admission_reviews
        .with_label_values(&[resource, decision])
        .inc();
    let response = review::respond(&request, outcome);
    metrics
        .admission_review_duration
        .with_label_values(&[resource])
        .observe(started.elapsed().as_secs_f64());
    if !response.allowed {
        tracing::info!(
            user = request.user_info.username.as_deref().unwrap_or_default(),
            operation = ?request.operation,
            resource = %request.resource.resource,
            name = %request.name,
            reason = %response.result.message,
            "admission refused"
        );
    }
    reply(&response.into_review())
}

fn reply(review: &AdmissionReview<DynamicObject>) -> Response {
    match serde_json::to_vec(review) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Accepts TCP connections and completes TLS handshakes in tasks of their
/// own (bounded in time), so one slow client holds up nobody.
struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        SocketAddr,
    )>,
    local: SocketAddr,
}

/// How long a client has to finish its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How many handshakes run at once; further connections wait to be accepted.
const HANDSHAKES: usize = 64;

impl TlsListener {
    fn new(listener: TcpListener, acceptor: tokio_rustls::TlsAcceptor) -> Self {
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let (send, ready) = tokio::sync::mpsc::channel(64);
        let handshakes = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = handshakes.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::debug!(error = %e, "webhook accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, send) = (acceptor.clone(), send.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = send.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "webhook TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "webhook TLS handshake timed out"),
                    }
                });
            }
        });
        Self { ready, local }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(ready) => ready,
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_names_how_the_api_server_reaches_the_webhook() {
        let service = Reach::Service {
            namespace: "shardplane".into(),
            name: "sp-operator-webhook".into(),
            port: 443,
        };
        assert_eq!(
            service.hosts(),
            [
                "sp-operator-webhook.shardplane.svc",
                "sp-operator-webhook.shardplane.svc.cluster.local"
            ]
        );
        let url = Reach::Url("https://127.0.0.1:9443".into());
        assert_eq!(url.hosts(), ["127.0.0.1"]);
        assert_eq!(Reach::Url("https://[::1]:9443".into()).hosts(), ["::1"]);

        let c = configuration("sp", &service, "CA");
        let webhooks = c["webhooks"].as_array().unwrap();
        assert_eq!(webhooks.len(), 2);
        let by_name = |n: &str| webhooks.iter().find(|w| w["name"] == n).unwrap();
        let (nodes, objects) = (
            by_name("nodes.shardplane.dev"),
            by_name("objects.shardplane.dev"),
        );
        assert_eq!(objects["failurePolicy"], "Fail");
        assert_eq!(nodes["failurePolicy"], "Ignore");
        assert_eq!(
            nodes["namespaceSelector"]["matchLabels"][NODE_LEASES_LABEL],
            "true"
        );
        assert_eq!(objects["rules"][0]["resources"], json!(["*", "*/status"]));
        assert_eq!(
            objects["clientConfig"]["service"],
            json!({ "namespace": "shardplane", "name": "sp-operator-webhook", "port": 443, "path": "/validate" })
        );
        assert_eq!(objects["clientConfig"]["caBundle"], "Q0E=");
        let c = configuration("sp", &url, "CA");
        assert_eq!(
            c["webhooks"][0]["clientConfig"]["url"],
            "https://127.0.0.1:9443/validate"
        );
    }
}
