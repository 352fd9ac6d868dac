//! `shardplane operator`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use shardplane_operator::admission::{Reach, WebhookConfig};
use shardplane_operator::{OperatorConfig, leader::Election};

use super::kube_client::client;

/// Options of `shardplane operator`.
#[derive(Args, Debug)]
pub struct OperatorArgs {
    /// The kubeconfig to use; KUBECONFIG, ~/.kube/config or in-cluster when unset.
    #[arg(long, env = "SHARDPLANE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Where `/metrics`, `/livez` and `/readyz` listen.
    #[arg(
        long,
        env = "SHARDPLANE_ADMIN_ADDRESS",
        default_value = "127.0.0.1:9090"
    )]
    admin_address: SocketAddr,
    /// Namespace of the leader election Lease.
    #[arg(
        long,
        env = "SHARDPLANE_LEADER_NAMESPACE",
        default_value = "shardplane-system"
    )]
    leader_namespace: String,
    /// The agents' namespace: where their node identities (ServiceAccounts
    /// `shardplane-node-<node>`) live, and where the data plane's CA
    /// certificate is published (ConfigMap shardplane-data-plane-ca).
    #[arg(long, env = "SHARDPLANE_AGENT_NAMESPACE", default_value = "shardplane")]
    agent_namespace: String,
    /// Do not sign agents' data-plane certificates (when cert-manager or
    /// another CA issues them, or the data plane runs without TLS).
    #[arg(long, env = "SHARDPLANE_NO_DATA_PLANE_SIGNER")]
    no_data_plane_signer: bool,
    /// A user (as the API server names it, for a ServiceAccount
    /// `system:serviceaccount:<namespace>:<name>`) that is a gateway: its
    /// requests get a client-only data-plane certificate naming no node,
    /// which agents require of every caller. Repeat (or separate by commas)
    /// for several gateways.
    #[arg(
        long = "data-plane-gateway-user",
        env = "SHARDPLANE_DATA_PLANE_GATEWAY_USERS",
        value_delimiter = ','
    )]
    data_plane_gateway_users: Vec<String>,
    /// This replica's identity in the election (host name and process id when unset).
    #[arg(long, env = "SHARDPLANE_IDENTITY")]
    identity: Option<String>,
    /// Seconds the leader Lease holds without renewal.
    #[arg(long, env = "SHARDPLANE_LEADER_LEASE_SECONDS", default_value_t = 15)]
    leader_lease_seconds: u64,
    /// Base URL of the Hugging Face hub, or a mirror, for `huggingFace` sources.
    #[arg(long, env = "HF_ENDPOINT", default_value = shardplane_operator::HUGGING_FACE_HUB)]
    hugging_face_endpoint: String,
    /// A file holding the Hugging Face token for gated or private
    /// repositories (else the HF_TOKEN environment variable, if set).
    #[arg(long, env = "SHARDPLANE_HUGGING_FACE_TOKEN_FILE")]
    hugging_face_token_file: Option<PathBuf>,
    /// Read `path` model sources where the operator runs (all on one machine)
    /// instead of waiting for an agent holding the file to report it.
    #[arg(long, env = "SHARDPLANE_READ_MODEL_PATHS")]
    read_model_paths: bool,
    /// Seconds a node's Lease holds when it does not say.
    #[arg(long, env = "SHARDPLANE_NODE_LEASE_SECONDS", default_value_t = 15)]
    node_lease_seconds: u64,
    /// The gateway's base URL as clients reach it (`http://host:8080/v1`),
    /// written with the served model name into each deployment's
    /// `status.endpoint`.
    #[arg(long, env = "SHARDPLANE_GATEWAY_URL", value_parser = gateway_url)]
    gateway_url: Option<String>,
    /// Do not serve the web view (`/ui` on the admin port).
    #[arg(long, env = "SHARDPLANE_NO_UI")]
    no_ui: bool,
    /// A file holding the web view's key: every request must carry it (the
    /// browser asks; any user name, the key as the password), else the
    /// SHARDPLANE_UI_KEY environment variable. Without a key the view
    /// answers only this machine's loopback.
    #[arg(long, env = "SHARDPLANE_UI_KEY_FILE")]
    ui_key_file: Option<PathBuf>,
    /// A gateway's metrics URL, for the view's tokens/s and time to first
    /// token; `dns+http://name:port/metrics` reads every address the name
    /// resolves to (a headless Service of several gateway replicas). Repeat
    /// for several gateways.
    #[arg(long, env = "SHARDPLANE_GATEWAY_METRICS", value_delimiter = ',', value_parser = metrics_url)]
    gateway_metrics: Vec<String>,
    /// Serve the validating admission webhook here (HTTPS). It lets each
    /// node identity write only its own objects and refuses invalid specs
    /// at apply time; say how the API server reaches it with
    /// `--webhook-url` or `--webhook-service`.
    #[arg(long, env = "SHARDPLANE_WEBHOOK_ADDRESS")]
    webhook_address: Option<SocketAddr>,
    /// The webhook's base URL as the API server reaches it
    /// (`https://127.0.0.1:9443`), for an operator outside the cluster.
    #[arg(long, env = "SHARDPLANE_WEBHOOK_URL", requires = "webhook_address", conflicts_with = "webhook_service", value_parser = webhook_url)]
    webhook_url: Option<String>,
    /// The Service in front of the operator replicas (`namespace/name:port`).
    #[arg(long, env = "SHARDPLANE_WEBHOOK_SERVICE", requires = "webhook_address", value_parser = webhook_service)]
    webhook_service: Option<Reach>,
    /// The Secret (in the leader namespace) holding the webhook's CA and
    /// serving certificate; made when missing.
    #[arg(
        long,
        env = "SHARDPLANE_WEBHOOK_SECRET",
        default_value = "shardplane-webhook-tls"
    )]
    webhook_secret: String,
    /// The name of the ValidatingWebhookConfiguration the operator applies.
    #[arg(
        long,
        env = "SHARDPLANE_WEBHOOK_CONFIGURATION",
        default_value = "shardplane"
    )]
    webhook_configuration: String,
}

/// An https URL with a host, without a trailing slash.
fn webhook_url(text: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(text).map_err(|e| format!("not a URL ({e}): {text}"))?;
    if url.scheme() != "https" || url.host_str().is_none() {
        return Err(format!("an https:// URL with a host is wanted: {text}"));
    }
    Ok(text.trim_end_matches('/').to_string())
}

/// `namespace/name:port`.
fn webhook_service(text: &str) -> Result<Reach, String> {
    let wanted = || format!("namespace/name:port is wanted: {text}");
    let (namespace, rest) = text.split_once('/').ok_or_else(wanted)?;
    let (name, port) = rest.split_once(':').ok_or_else(wanted)?;
    let port: u16 = port.parse().map_err(|_| wanted())?;
    if namespace.is_empty() || name.is_empty() {
        return Err(wanted());
    }
    Ok(Reach::Service {
        namespace: namespace.into(),
        name: name.into(),
        port,
    })
}

fn metrics_url(text: &str) -> Result<String, String> {
    shardplane_view::traffic::check_url(text).map(|()| text.to_string())
}

/// An http(s) URL with a host, without a trailing slash.
fn gateway_url(text: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(text).map_err(|e| format!("not a URL ({e}): {text}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(format!(
            "an http:// or https:// URL with a host is wanted: {text}"
        ));
    }
    Ok(text.trim_end_matches('/').to_string())
}

/// Runs the operator until Ctrl-C or lost leadership.
pub fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let identity = args.identity.unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "operator".into());
        format!("{}-{}", host.trim(), std::process::id())
    });
    let lease = Duration::from_secs(args.leader_lease_seconds.max(3));
    let webhook = match (args.webhook_address, args.webhook_url, args.webhook_service) {
        (None, ..) => None,
        (Some(_), None, None) => anyhow::bail!(
            "--webhook-address needs --webhook-url or --webhook-service: how the API server reaches the webhook"
        ),
        (Some(listen), url, service) => Some(WebhookConfig {
            listen,
            reach: service.unwrap_or_else(|| Reach::Url(url.unwrap_or_default())),
            secret: (args.leader_namespace.clone(), args.webhook_secret),
            configuration: args.webhook_configuration,
        }),
    };
    let gateway_users: Vec<String> = args
        .data_plane_gateway_users
        .iter()
        .map(|u| u.trim().to_string())
        .filter(|u| !u.is_empty())
        .collect();
    if !args.no_data_plane_signer && gateway_users.is_empty() {
        tracing::warn!(
            "no --data-plane-gateway-user: no gateway gets a data-plane certificate, and agents refuse callers without one"
        );
    }
    let signer = (!args.no_data_plane_signer).then(|| shardplane_operator::signer::SignerConfig {
        secret_namespace: args.leader_namespace.clone(),
        agent_namespace: args.agent_namespace.clone(),
        gateway_users,
    });
    let config = OperatorConfig {
        signer,
        admin_address: args.admin_address,
        election: Election {
            namespace: args.leader_namespace,
            name: "shardplane-operator".into(),
            identity,
            lease_duration: lease,
            renew_every: lease / 3,
        },
        default_node_lease: Duration::from_secs(args.node_lease_seconds),
        hugging_face_endpoint: args.hugging_face_endpoint,
        hugging_face_token: super::hugging_face_token(args.hugging_face_token_file.as_deref())?,
        read_model_paths: args.read_model_paths,
        gateway_url: args.gateway_url,
        view: (!args.no_ui)
            .then(|| -> anyhow::Result<_> {
                Ok(shardplane_view::web::Settings {
                    key: match args.ui_key_file.as_deref() {
                        Some(file) => Some(super::read_secret_file(file)?),
                        // From a Secret in the chart; never a flag (ps shows flags).
                        None => std::env::var("SHARDPLANE_UI_KEY")
                            .ok()
                            .map(|k| k.trim().to_string())
                            .filter(|k| !k.is_empty()),
                    },
                    gateway_metrics: args.gateway_metrics,
                })
            })
            .transpose()?,
        webhook,
    };
    tokio::runtime::Runtime::new()?.block_on(async {
        let client = client(args.kubeconfig.as_deref()).await?;
        shardplane_operator::run(client, config)
            .await
            .map_err(anyhow::Error::msg)
    })
}
