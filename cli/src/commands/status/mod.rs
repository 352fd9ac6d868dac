//! `shardplane status`: the cluster on one screen, read like kubectl reads
//! it (the kubeconfig), as text or JSON, once or refreshed.
//!
//! ```text
//!  list InferenceNodes, ModelDeployments, Shards ─► snapshot (pure) ─► render │ JSON
//!  --watch: again every interval, the screen cleared on a terminal, download
//!           rates from the refresh before
//! ```

mod render;
mod snapshot;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kube::Api;
use kube::api::ListParams;
use shardplane_crds::v1alpha1::{InferenceNode, ModelDeployment, Shard};

pub use snapshot::Snapshot;

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
}

/// Reads the cluster's objects and makes the snapshot.
async fn read(client: &kube::Client, namespace: Option<&str>) -> anyhow::Result<Snapshot> {
    let lp = ListParams::default();
    let nodes = Api::<InferenceNode>::all(client.clone())
        .list(&lp)
        .await
        .context("listing InferenceNodes (are the shardplane CRDs installed?)")?;
    let (deployments, shards) = match namespace {
        Some(ns) => (
            Api::<ModelDeployment>::namespaced(client.clone(), ns)
                .list(&lp)
                .await,
            Api::<Shard>::namespaced(client.clone(), ns).list(&lp).await,
        ),
        None => (
            Api::<ModelDeployment>::all(client.clone()).list(&lp).await,
            Api::<Shard>::all(client.clone()).list(&lp).await,
        ),
    };
    let deployments = deployments.context("listing ModelDeployments")?;
    let shards = shards.context("listing Shards")?;
    Ok(snapshot::snapshot(
        &nodes.items,
        &deployments.items,
        &shards.items,
    ))
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
        let terminal = std::io::stdout().is_terminal();
        let Some(every) = args.watch else {
            let s = read(&client, args.namespace.as_deref()).await?;
            return print(&s, args.output, terminal);
        };
        anyhow::ensure!(
            every.is_finite() && every >= 0.1,
            "--watch takes an interval of at least 0.1 s"
        );
        let mut earlier: Option<(Snapshot, std::time::Instant)> = None;
        loop {
            // A failed read is shown and tried again: the cluster may be
            // restarting.
            match read(&client, args.namespace.as_deref()).await {
                Ok(mut s) => {
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
