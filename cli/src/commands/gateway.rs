//! `shardplane gateway`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use shardplane_gateway::GatewayConfig;
use shardplane_gateway::auth::KeySource;

use super::kube_client::client;

/// Options of `shardplane gateway`.
#[derive(Args, Debug)]
pub struct GatewayArgs {
    /// The kubeconfig to use; KUBECONFIG, ~/.kube/config or in-cluster when unset.
    #[arg(long, env = "SHARDPLANE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Where the OpenAI, Anthropic and Ollama APIs listen.
    #[arg(
        long,
        env = "SHARDPLANE_GATEWAY_ADDRESS",
        default_value = "0.0.0.0:8080"
    )]
    listen: SocketAddr,
    /// Where `/metrics`, `/livez` and `/readyz` listen.
    #[arg(
        long,
        env = "SHARDPLANE_ADMIN_ADDRESS",
        default_value = "127.0.0.1:9092"
    )]
    admin_address: SocketAddr,
    /// File holding the cluster's data-plane token.
    #[arg(long, env = "SHARDPLANE_DATA_PLANE_TOKEN_FILE")]
    token_file: PathBuf,
    #[command(flatten)]
    tls: super::tls_args::TlsArgs,
    /// API keys from a file: one per line, `name:key` or just `key`.
    #[arg(
        long,
        env = "SHARDPLANE_API_KEYS_FILE",
        conflicts_with = "api_keys_secret"
    )]
    api_keys_file: Option<PathBuf>,
    /// API keys from a Secret, `namespace/name`: each data entry is a key.
    #[arg(long, env = "SHARDPLANE_API_KEYS_SECRET")]
    api_keys_secret: Option<String>,
    /// Serve without API keys (only for a gateway nobody else can reach).
    #[arg(long, conflicts_with_all = ["api_keys_file", "api_keys_secret"])]
    allow_anonymous: bool,
    /// Requests per minute each API key may make (unlimited when unset).
    #[arg(long, env = "SHARDPLANE_RATE_LIMIT_PER_MINUTE")]
    rate_limit_per_minute: Option<u32>,
    /// Seconds a request waits, retrying, while every instance that could
    /// answer it is busy (their agents refuse new work); then 429 with
    /// Retry-After. 0 answers 429 at once.
    #[arg(long, env = "SHARDPLANE_BUSY_WAIT_SECONDS", default_value_t = 60)]
    busy_wait_seconds: u64,
    /// Seconds an answer cut off mid-way by a failed instance waits for an
    /// instance to resume it on: another replica, or the same one once the
    /// operator has re-placed the stage or tensor rank it lost (the lost
    /// node's Lease has to run out first, then the stage loads). The client
    /// gets keep-alives, then the rest of the answer; when none is ready in
    /// time, or every instance has run it twice, the answer ends with an
    /// error. 0 ends it at once.
    #[arg(long, env = "SHARDPLANE_HEAL_WAIT_SECONDS", default_value_t = 120)]
    heal_wait_seconds: u64,
    /// Seconds an instance has to start an answer (it admits or refuses at
    /// once, so only a hung or unreachable instance takes longer); then the
    /// next instance is tried.
    #[arg(long, env = "SHARDPLANE_START_TIMEOUT_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    start_timeout_seconds: u32,
    /// Seconds an instance has to give an answer's first token (its queue
    /// and the prompt's prefill come first); then the next instance is
    /// tried.
    #[arg(long, env = "SHARDPLANE_FIRST_TOKEN_TIMEOUT_SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u32).range(1..=86400))]
    first_token_timeout_seconds: u32,
    /// The largest generation request body in MiB (larger: 413 in the API's
    /// shape, refused before it is read). Long contexts with tools fit in a
    /// few MiB.
    #[arg(long, env = "SHARDPLANE_MAX_BODY_MIB", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_body_mib: u32,
    /// Open client connections at most; more wait to be accepted.
    #[arg(long, env = "SHARDPLANE_MAX_CONNECTIONS", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Seconds a client has to send a request's headers; also how long a
    /// kept-alive connection may sit idle.
    #[arg(long, env = "SHARDPLANE_HEADER_TIMEOUT_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    header_timeout_seconds: u32,
    /// Seconds a client has to send a request's body once its headers came
    /// (longer: 408 in the API's shape).
    #[arg(long, env = "SHARDPLANE_BODY_TIMEOUT_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    body_timeout_seconds: u32,
    /// A URL external fallbacks may use: a fallback's baseUrl must fall
    /// under one of these (same scheme, host and port; path beneath). None
    /// by default, so no prompt leaves the cluster unless allowed here.
    /// Repeat, or separate with commas.
    #[arg(long, env = "SHARDPLANE_ALLOW_EXTERNAL_URLS", value_delimiter = ',')]
    allow_external_url: Vec<String>,
}

/// Runs the gateway until Ctrl-C or SIGTERM.
pub fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let keys = match (
        &args.api_keys_file,
        &args.api_keys_secret,
        args.allow_anonymous,
    ) {
        (Some(f), _, _) => KeySource::File(f.clone()),
        (_, Some(s), _) => {
            let (namespace, name) = s
                .split_once('/')
                .with_context(|| format!("--api-keys-secret {s:?} is not namespace/name"))?;
            KeySource::Secret {
                namespace: namespace.into(),
                name: name.into(),
            }
        }
        (_, _, true) => KeySource::Anonymous,
        _ => bail!("give --api-keys-file, --api-keys-secret or --allow-anonymous"),
    };
    let token =
        shardplane_dataplane::Token::from_file(&args.token_file).map_err(anyhow::Error::msg)?;
    let config = GatewayConfig {
        data_plane_tls: args.tls.gateway()?,
        busy_wait: std::time::Duration::from_secs(args.busy_wait_seconds),
        heal_wait: std::time::Duration::from_secs(args.heal_wait_seconds),
        deadlines: shardplane_gateway::routing::Deadlines {
            start: std::time::Duration::from_secs(args.start_timeout_seconds.into()),
            first_token: std::time::Duration::from_secs(args.first_token_timeout_seconds.into()),
        },
        listen: args.listen,
        admin_address: args.admin_address,
        token,
        keys,
        rate_limit_per_minute: args.rate_limit_per_minute,
        max_body_bytes: (args.max_body_mib as usize) << 20,
        body_timeout: std::time::Duration::from_secs(args.body_timeout_seconds.into()),
        limits: shardplane_gateway::server::Limits {
            max_connections: args.max_connections as usize,
            header_timeout: std::time::Duration::from_secs(args.header_timeout_seconds.into()),
            ..Default::default()
        },
        external_allowlist: shardplane_gateway::external::Allowlist::parse(
            &args.allow_external_url,
        )
        .map_err(|e| anyhow::anyhow!("--allow-external-url {e}"))?,
    };
    tokio::runtime::Runtime::new()?.block_on(async {
        let client = client(args.kubeconfig.as_deref()).await?;
        shardplane_gateway::run(client, config, super::agent::shutdown_signal())
            .await
            .map_err(anyhow::Error::msg)
    })
}
