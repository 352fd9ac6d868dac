//! `shardplane agent`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use shardplane_agent::AgentConfig;
use shardplane_agent::registration::Registration;
use shardplane_crds::quantity::parse_bytes_str;

use super::kube_client::client;

/// Options of `shardplane agent`.
#[derive(Args, Debug)]
pub struct AgentArgs {
    /// The kubeconfig to use; KUBECONFIG, ~/.kube/config or in-cluster when unset.
    #[arg(long, env = "SHARDPLANE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// This node's name (the host name when unset).
    #[arg(long, env = "SHARDPLANE_NODE_NAME")]
    node_name: Option<String>,
    /// Labels for the InferenceNode when it is first created, `key=value`
    /// (repeatable); they decide which pools the node joins.
    #[arg(long = "label", env = "SHARDPLANE_NODE_LABELS", value_delimiter = ',')]
    labels: Vec<String>,
    /// Where `/metrics`, `/livez` and `/readyz` listen.
    #[arg(
        long,
        env = "SHARDPLANE_ADMIN_ADDRESS",
        default_value = "127.0.0.1:9091"
    )]
    admin_address: SocketAddr,
    /// Memory kept back from shards (e.g. `4Gi`).
    #[arg(long, env = "SHARDPLANE_MEMORY_RESERVE", default_value = "1Gi")]
    memory_reserve: String,
    /// Directory for downloaded weights.
    #[arg(
        long,
        env = "SHARDPLANE_CACHE_DIR",
        default_value = "/var/lib/shardplane/cache"
    )]
    cache_dir: PathBuf,
    /// The most the cache may hold (e.g. `200Gi`): least recently used
    /// models no shard uses are evicted to make room. Unlimited when unset.
    #[arg(long, env = "SHARDPLANE_CACHE_BUDGET")]
    cache_budget: Option<String>,
    /// Base URL of the Hugging Face hub, or a mirror, for `huggingFace` sources.
    #[arg(long, env = "HF_ENDPOINT", default_value = shardplane_models::HUGGING_FACE_HUB)]
    hugging_face_endpoint: String,
    /// Where the gRPC data plane listens (`0.0.0.0:7070` listens everywhere; port 0 picks a free one).
    #[arg(
        long,
        env = "SHARDPLANE_DATA_PLANE_ADDRESS",
        default_value = "0.0.0.0:7070"
    )]
    data_plane_address: SocketAddr,
    /// The `host:port` other agents and the gateway reach the data plane at;
    /// by default the listening address, or this machine's address on its
    /// fastest link when listening everywhere.
    #[arg(long, env = "SHARDPLANE_ADVERTISE_ADDRESS")]
    advertise_address: Option<String>,
    /// File holding the cluster's data-plane token (the same on every agent
    /// and the gateway; calls without it are refused).
    #[arg(long, env = "SHARDPLANE_DATA_PLANE_TOKEN_FILE")]
    token_file: PathBuf,
    /// Seconds between measurements of the links to the other nodes (each a
    /// few small round trips and answers of up to 8 MiB per peer, smaller on
    /// slow links).
    #[arg(long, env = "SHARDPLANE_PROBE_LINKS_SECONDS", default_value_t = 30)]
    probe_links_seconds: u64,
    /// Seconds the node's Lease holds without renewal.
    #[arg(long, env = "SHARDPLANE_LEASE_SECONDS", default_value_t = 15)]
    lease_seconds: u64,
    /// The engine stages run on: candle, or mlx (Macs; binaries built with
    /// the `mlx` feature).
    #[arg(long, env = "SHARDPLANE_ENGINE", default_value = "candle")]
    engine: String,
    /// Compute threads for this agent's stages (default: the machine's
    /// cores). Agents sharing a machine should split its cores between them:
    /// compute pools that together outnumber the cores slow every agent
    /// several-fold.
    #[arg(long, env = "SHARDPLANE_THREADS")]
    threads: Option<usize>,
    /// Seconds a new generation may wait for its stage: when the queued work
    /// would take longer, the request is refused at once and the gateway
    /// tries another instance or answers 429 (clients that give up sooner
    /// than this would otherwise wait for nothing).
    #[arg(
        long,
        env = "SHARDPLANE_MAX_QUEUE_WAIT_SECONDS",
        default_value_t = 30.0
    )]
    max_queue_wait_seconds: f64,
    /// Prompt tokens a stage's step takes at most besides its decode tokens:
    /// long prompts run in slices, so sequences already decoding never wait
    /// for a whole prompt.
    #[arg(long, env = "SHARDPLANE_PREFILL_TOKENS_PER_STEP", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    prefill_tokens_per_step: u32,
    /// Milliseconds a step should take while sequences decode: prompt
    /// slices shrink (to 8 tokens at least) on a slow stage so that every
    /// decoding sequence still gets a token about this often.
    #[arg(long, env = "SHARDPLANE_DECODE_STEP_MILLIS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    decode_step_millis: u64,
}

/// Runs the agent until Ctrl-C or SIGTERM, then drains.
pub fn run(args: AgentArgs) -> anyhow::Result<()> {
    super::threads::use_threads(args.threads)?;
    let node = match args.node_name {
        Some(n) => n,
        None => std::fs::read_to_string("/etc/hostname")
            .context("no --node-name and no /etc/hostname")?
            .trim()
            .to_lowercase(),
    };
    let mut labels = BTreeMap::new();
    for l in &args.labels {
        let Some((k, v)) = l.split_once('=') else {
            bail!("label {l:?} is not key=value");
        };
        labels.insert(k.trim().to_string(), v.trim().to_string());
    }
    let memory_reserve = parse_bytes_str(&args.memory_reserve)?;
    let lease = Duration::from_secs(args.lease_seconds.max(3));
    let token =
        shardplane_dataplane::Token::from_file(&args.token_file).map_err(anyhow::Error::msg)?;
    let config = AgentConfig {
        registration: Registration {
            node,
            labels,
            memory_reserve,
            lease_duration: lease,
            data_plane_endpoint: None,
            engines: Vec::new(),
        },
        admin_address: args.admin_address,
        renew_every: lease / 3,
        report_every: Duration::from_secs(30),
        cache_dir: args.cache_dir,
        hugging_face_endpoint: args.hugging_face_endpoint,
        data_plane_address: args.data_plane_address,
        advertise_address: args.advertise_address,
        token,
        cache_budget: args
            .cache_budget
            .as_deref()
            .map(parse_bytes_str)
            .transpose()?,
        probe_links_every: Duration::from_secs(args.probe_links_seconds.max(1)),
        max_queue_wait: Duration::try_from_secs_f64(args.max_queue_wait_seconds)
            .context("--max-queue-wait-seconds must be a number of seconds, 0 or more")?,
        budget: shardplane_agent::scheduler::Budget {
            prefill_tokens: args.prefill_tokens_per_step as usize,
            decode_step: Duration::from_millis(args.decode_step_millis),
        },
        engine: args.engine.parse()?,
    };
    tokio::runtime::Runtime::new()?.block_on(async {
        let client = client(args.kubeconfig.as_deref()).await?;
        shardplane_agent::run(client, config, shutdown_signal())
            .await
            .map_err(anyhow::Error::msg)
    })
}

pub(crate) async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
