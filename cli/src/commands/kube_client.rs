//! A Kubernetes client from a kubeconfig path, or the usual defaults
//! (`KUBECONFIG`, `~/.kube/config`, in-cluster).

use std::path::Path;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Builds a client (each call answered within
/// [`shardplane_cluster::CALL_DEADLINE`]; watches unaffected).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    Ok(shardplane_cluster::client(config(kubeconfig).await?)?)
}

/// Reads the client configuration.
pub async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<Config> {
    Ok(match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => Config::infer()
            .await
            .context("no kubeconfig: pass --kubeconfig or set KUBECONFIG")?,
    })
}

/// The API server's `host:port` in `config` (the scheme's port when the
/// URL names none).
pub fn api_server(config: &Config) -> Option<String> {
    let url = &config.cluster_url;
    let host = url.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = url
        .port_u16()
        .unwrap_or(if url.scheme_str() == Some("http") {
            80
        } else {
            443
        });
    Some(if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_server_is_host_and_port() {
        let at = |url: &str| api_server(&Config::new(url.parse().unwrap()));
        assert_eq!(
            at("https://10.0.0.1:6443").as_deref(),
            Some("10.0.0.1:6443")
        );
        assert_eq!(
            at("https://api.example.com").as_deref(),
            Some("api.example.com:443")
        );
        assert_eq!(at("http://[fd00::1]").as_deref(), Some("[fd00::1]:80"));
    }
}
