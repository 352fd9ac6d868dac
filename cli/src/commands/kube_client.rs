//! A Kubernetes client from a kubeconfig path, or the usual defaults
//! (`KUBECONFIG`, `~/.kube/config`, in-cluster).

use std::path::Path;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Builds a client.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => Config::infer()
            .await
            .context("no kubeconfig: pass --kubeconfig or set KUBECONFIG")?,
    };
    Ok(Client::try_from(config)?)
}
