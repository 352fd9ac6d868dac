//! `shardplane agent`: run the node agent, or `agent install` it as a
//! service (see [`super::agent_install`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use shardplane_agent::AgentConfig;
use shardplane_agent::machine;
use shardplane_agent::registration::Registration;
use shardplane_crds::quantity::parse_bytes_str;

/// `shardplane agent [OPTIONS]` runs the agent; `shardplane agent install
/// [OPTIONS]` installs it as a service with those options.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct AgentArgs {
    #[command(subcommand)]
    action: Option<AgentAction>,
    #[command(flatten)]
    run: RunArgs,
}

/// What `shardplane agent` does besides running.
#[derive(Subcommand, Debug)]
enum AgentAction {
    /// Install the agent as a service that starts at boot and is restarted
    /// when it stops: a systemd unit on Linux, a launchd daemon on macOS.
    Install(super::agent_install::InstallArgs),
}

/// Options of the agent.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct RunArgs {
    /// The kubeconfig to use; KUBECONFIG, ~/.kube/config or in-cluster when unset.
    #[arg(long, env = "SHARDPLANE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// This node's name (a DNS-1123 name); when unset, the host name's first
    /// label, lowercased, with characters a name cannot hold turned into `-`.
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
    /// A file holding the Hugging Face token for gated or private
    /// repositories (else the HF_TOKEN environment variable, if set); sent
    /// only to the hub's endpoint.
    #[arg(long, env = "SHARDPLANE_HUGGING_FACE_TOKEN_FILE")]
    hugging_face_token_file: Option<PathBuf>,
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
    /// File holding the cluster's data-plane token (required: the same on
    /// every agent and the gateway; calls without it are refused).
    // Checked when used: marked required, clap would ask for it before
    // `agent install` too, whose own copy of the options holds it.
    #[arg(long, env = "SHARDPLANE_DATA_PLANE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    tls: super::tls_args::TlsArgs,
    /// Seconds between measurements of the links to the other nodes (each a
    /// few small round trips and answers of up to 8 MiB per peer, smaller on
    /// slow links).
    #[arg(long, env = "SHARDPLANE_PROBE_LINKS_SECONDS", default_value_t = 30)]
    probe_links_seconds: u64,
    /// Seconds the node's Lease holds without renewal.
    #[arg(long, env = "SHARDPLANE_LEASE_SECONDS", default_value_t = 15)]
    lease_seconds: u64,
    /// The engine stages run on: candle, or mlx (binaries built with the
    /// `mlx` feature). When unset: mlx where it is built in and the machine
    /// has Metal (Apple Silicon), else candle.
    #[arg(long, env = "SHARDPLANE_ENGINE")]
    engine: Option<String>,
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
    #[arg(long, env = "SHARDPLANE_PREFILL_TOKENS_PER_STEP", default_value_t = shardplane_engine::config::PROMPT_STEP as u32,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    prefill_tokens_per_step: u32,
    /// Milliseconds a step should take while sequences decode: prompt
    /// slices shrink (to 8 tokens at least) on a slow stage so that every
    /// decoding sequence still gets a token about this often (a pipeline's
    /// head, which runs one step per group of its decoding sequences, paces
    /// each step to this ÷ its stages).
    #[arg(long, env = "SHARDPLANE_DECODE_STEP_MILLIS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    decode_step_millis: u64,
    /// Memory for the KV of recent prompts, kept in blocks of 32 tokens by
    /// each stage for its own layers (a tensor group's ranks keep none), so
    /// a request that starts with the same tokens (a system prompt, a
    /// conversation so far, an agent's context) skips computing them. Least
    /// recently used blocks go first; 0 turns the cache off. Count it beside
    /// the weights: it is held on top of the sequences' own KV.
    #[arg(long, env = "SHARDPLANE_PREFIX_CACHE", default_value = "512Mi")]
    prefix_cache: String,
}

/// Runs the agent until Ctrl-C or SIGTERM, then drains; or installs it.
pub fn run(args: AgentArgs) -> anyhow::Result<()> {
    match args.action {
        Some(AgentAction::Install(install)) => super::agent_install::run(install),
        None => run_agent(args.run),
    }
}

impl RunArgs {
    /// This node's name: `--node-name` checked, else made from the host name.
    pub(crate) fn node(&self) -> anyhow::Result<String> {
        match &self.node_name {
            Some(n) => {
                machine::check_node_name(n).map_err(anyhow::Error::msg)?;
                Ok(n.clone())
            }
            None => machine::node_name_from_host(&machine::host_name()).map_err(anyhow::Error::msg),
        }
    }

    /// The engine: `--engine`, else this machine's default.
    pub(crate) fn engine(&self) -> &str {
        self.engine.as_deref().unwrap_or_else(|| {
            let mlx = shardplane_engine::pipeline::EngineKind::available().contains(&"mlx");
            machine::default_engine(mlx, machine::has_metal())
        })
    }

    /// The token file and the kubeconfig made absolute (a service does not
    /// start in the directory `install` ran in).
    pub(crate) fn with_absolute_paths(mut self) -> anyhow::Result<RunArgs> {
        let absolute = |p: &std::path::Path, what: &str| {
            std::path::absolute(p).with_context(|| format!("{what} {}", p.display()))
        };
        self.token_file = Some(absolute(self.token_file()?, "--token-file")?);
        if let Some(k) = &self.kubeconfig {
            self.kubeconfig = Some(absolute(k, "--kubeconfig")?);
        }
        self.cache_dir = absolute(&self.cache_dir, "--cache-dir")?;
        if let Some(d) = &self.tls.tls_dir {
            self.tls.tls_dir = Some(absolute(d, "--tls-dir")?);
        }
        Ok(self)
    }

    /// The token file this agent reads.
    pub(crate) fn token_file(&self) -> anyhow::Result<&std::path::Path> {
        self.token_file.as_deref().context(
            "--token-file is required: the cluster's data-plane token file \
             (or SHARDPLANE_DATA_PLANE_TOKEN_FILE)",
        )
    }

    /// The kubeconfig this agent reads, when one is named.
    pub(crate) fn kubeconfig(&self) -> Option<&std::path::Path> {
        self.kubeconfig.as_deref()
    }

    /// These options as `shardplane agent` arguments, every one spelled out
    /// (a service runs without the environment `install` ran in), with the
    /// node name and engine resolved so they stay fixed.
    pub(crate) fn to_args(&self, node: &str, engine: &str) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut put = |flag: &str, value: String| {
            a.push(format!("--{flag}"));
            a.push(value);
        };
        let path = |p: &PathBuf| p.display().to_string();
        if let Some(k) = &self.kubeconfig {
            put("kubeconfig", path(k));
        }
        put("node-name", node.to_string());
        for l in &self.labels {
            put("label", l.clone());
        }
        put("admin-address", self.admin_address.to_string());
        put("memory-reserve", self.memory_reserve.clone());
        put("cache-dir", path(&self.cache_dir));
        if let Some(b) = &self.cache_budget {
            put("cache-budget", b.clone());
        }
        put("hugging-face-endpoint", self.hugging_face_endpoint.clone());
        if let Some(t) = &self.hugging_face_token_file {
            put("hugging-face-token-file", path(t));
        }
        put("data-plane-address", self.data_plane_address.to_string());
        if let Some(x) = &self.advertise_address {
            put("advertise-address", x.clone());
        }
        if let Some(t) = &self.token_file {
            put("token-file", path(t));
        }
        put("probe-links-seconds", self.probe_links_seconds.to_string());
        put("lease-seconds", self.lease_seconds.to_string());
        put("engine", engine.to_string());
        if let Some(t) = self.threads {
            put("threads", t.to_string());
        }
        put(
            "max-queue-wait-seconds",
            self.max_queue_wait_seconds.to_string(),
        );
        put(
            "prefill-tokens-per-step",
            self.prefill_tokens_per_step.to_string(),
        );
        put("decode-step-millis", self.decode_step_millis.to_string());
        put("prefix-cache", self.prefix_cache.clone());
        a.extend(self.tls.to_args());
        a
    }
}

fn run_agent(args: RunArgs) -> anyhow::Result<()> {
    super::threads::use_threads(args.threads)?;
    shardplane_agent::arm_fault_injection().map_err(anyhow::Error::msg)?;
    let node = args.node()?;
    let engine = args.engine().parse()?;
    let mut labels = BTreeMap::new();
    for l in &args.labels {
        let Some((k, v)) = l.split_once('=') else {
            bail!("label {l:?} is not key=value");
        };
        labels.insert(k.trim().to_string(), v.trim().to_string());
    }
    let memory_reserve = parse_bytes_str(&args.memory_reserve)?;
    let lease = Duration::from_secs(args.lease_seconds.max(3));
    // Not readable by every user of the machine, as `agent install` demands.
    super::agent_install::check_token_file(args.token_file()?)?;
    let token =
        shardplane_dataplane::Token::from_file(args.token_file()?).map_err(anyhow::Error::msg)?;
    let data_plane_tls = args.tls.agent(&args.cache_dir)?;
    let config = AgentConfig {
        registration: Registration {
            node,
            labels,
            memory_reserve,
            lease_duration: lease,
            data_plane_endpoint: None,
            engines: Vec::new(),
            prompt_step: None,
        },
        admin_address: args.admin_address,
        renew_every: lease / 3,
        report_every: Duration::from_secs(30),
        cache_dir: args.cache_dir,
        hugging_face_token: super::hugging_face_token(args.hugging_face_token_file.as_deref())?,
        hugging_face_endpoint: args.hugging_face_endpoint,
        data_plane_address: args.data_plane_address,
        advertise_address: args.advertise_address,
        control_plane: None,
        token,
        data_plane_tls,
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
            // Set per Shard: a pipeline's head splits its decoding sequences.
            decode_groups: 1,
        },
        prefix_cache_bytes: usize::try_from(
            parse_bytes_str(&args.prefix_cache).context("--prefix-cache")?,
        )
        .context("--prefix-cache is larger than this machine can address")?,
        engine,
    };
    tokio::runtime::Runtime::new()?.block_on(async {
        let kube = super::kube_client::config(args.kubeconfig.as_deref()).await?;
        let config = AgentConfig {
            control_plane: super::kube_client::api_server(&kube),
            ..config
        };
        let client = shardplane_cluster::client(kube)?;
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Agent {
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn the_arguments_a_service_gets_parse_back_to_the_same_options() {
        let given = [
            "agent",
            "--kubeconfig=/etc/shardplane/kubeconfig",
            "--node-name=mac-1",
            "--label=tier=daily",
            "--label=room=attic",
            "--admin-address=0.0.0.0:9191",
            "--memory-reserve=6Gi",
            "--cache-dir=/srv/weights",
            "--cache-budget=300Gi",
            "--hugging-face-endpoint=https://hf-mirror.example",
            "--data-plane-address=0.0.0.0:7171",
            "--advertise-address=10.0.0.5:7171",
            "--token-file=/etc/shardplane/token",
            "--probe-links-seconds=45",
            "--lease-seconds=20",
            "--engine=candle",
            "--threads=6",
            "--max-queue-wait-seconds=12.5",
            "--prefill-tokens-per-step=256",
            "--decode-step-millis=150",
        ];
        let run = Agent::parse_from(given).run;
        let args = run.to_args("mac-1", "candle");
        let again = Agent::parse_from(std::iter::once("agent".to_string()).chain(args)).run;
        assert_eq!(again, run);
        // Every option was given a value other than its default, so an option
        // `to_args` forgot would come back different.
        let defaults = Agent::parse_from(["agent", "--token-file=/t"]).run;
        assert_ne!(defaults.admin_address, run.admin_address);
        assert_ne!(defaults.decode_step_millis, run.decode_step_millis);
    }
}
