//! `shardplane status`: the cluster on one screen, read like kubectl reads
//! it (the kubeconfig), as text or JSON, once or refreshed.
//!
//! ```text
//!  list InferenceNodes, ModelDeployments, Shards ─► snapshot (pure) ─► render │ JSON
//!  --gateway-metrics: the gateways' /metrics ─► traffic per deployment
//!  --watch: again every interval, the screen cleared on a terminal, download
//!           and token rates from the refresh before
//! ```

mod render;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use shardplane_view::Snapshot;
use shardplane_view::traffic::{self, Sample};

/// How the status is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Tables for a person.
    Text,
    /// The snapshot as JSON.
    Json,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Kubeconfig to use (default: `KUBECONFIG`, `~/.kube/config`, in-cluster).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Only this namespace's deployments (default: every namespace).
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "text")]
    output: Output,
    /// Refresh every this many seconds until interrupted.
    #[arg(long, short = 'w', num_args = 0..=1, default_missing_value = "2", value_name = "SECONDS")]
    watch: Option<f64>,
    /// A gateway's metrics URL, to show each deployment's requests, tokens
    /// per second (under --watch) and time to first token;
    /// `dns+http://name:port/metrics` reads every address the name resolves to.
    #[arg(long, env = "SHARDPLANE_GATEWAY_METRICS", value_delimiter = ',',
          value_parser = |t: &str| traffic::check_url(t).map(|()| t.to_string()))]
    gateway_metrics: Vec<String>,
}

/// Reads the cluster and, when asked, the gateways' metrics (rates since
/// `earlier`, the reading before).
async fn read(
    client: &kube::Client,
    args: &StatusArgs,
    http: &reqwest::Client,
    earlier: Option<&Sample>,
) -> anyhow::Result<(Snapshot, Option<Sample>)> {
    let mut s = shardplane_view::read(client, args.namespace.as_deref()).await?;
    if args.gateway_metrics.is_empty() {
        return Ok((s, None));
    }
    let sample = traffic::scrape(http, &args.gateway_metrics).await?;
    s.with_traffic(earlier, &sample);
    Ok((s, Some(sample)))
}

fn print(s: &Snapshot, output: Output, terminal: bool) -> anyhow::Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(s)?),
        Output::Text => print!("{}", render::render(s, terminal)),
    }
    Ok(())
}

/// Prints the status (again and again with `--watch`).
pub fn run(args: StatusArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let client = super::kube_client::client(args.kubeconfig.as_deref()).await?;
        let http = shardplane_models::http_client()?;
        let terminal = std::io::stdout().is_terminal();
        let Some(every) = args.watch else {
            let (s, _) = read(&client, &args, &http, None).await?;
            return print(&s, args.output, terminal);
        };
        anyhow::ensure!(
            every.is_finite() && every >= 0.1,
            "--watch takes an interval of at least 0.1 s"
        );
        let mut earlier: Option<(Snapshot, std::time::Instant)> = None;
        let mut sample: Option<Sample> = None;
        loop {
            // A failed read is shown and tried again: the cluster may be
            // restarting.
            match read(&client, &args, &http, sample.as_ref()).await {
                Ok((mut s, read_sample)) => {
                    sample = read_sample;
                    let now = std::time::Instant::now();
                    if let Some((before, at)) = &earlier {
                        s.rates_since(before, (now - *at).as_secs_f64());
                    }
                    if terminal && args.output == Output::Text {
                        print!("\x1b[2J\x1b[H");
                    }
                    print(&s, args.output, terminal)?;
                    earlier = Some((s, now));
                }
                Err(e) => eprintln!("{e:#}"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs_f64(every)) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
        }
    })
}
