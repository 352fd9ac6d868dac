//! `--data-plane-tls`, `--tls-dir`, `--data-plane-ca-namespace`: where the
//! data plane's TLS material comes from, for the agent and the gateway.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

/// Where the data plane's certificates come from.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Issued by the operator on request and renewed before they expire
    /// (agents); the CA published by the operator (gateway).
    Operator,
    /// `ca.crt`, `tls.crt`, `tls.key` in --tls-dir, kept current by
    /// someone else (a cert-manager Secret mounted there); re-read when
    /// they change.
    Files,
    /// Plain TCP: only for a test or a network nobody else can reach.
    Off,
}

/// The data plane's TLS options.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct TlsArgs {
    /// Where the data plane's TLS certificates come from. Every connection
    /// between agents and from the gateway is TLS, and a client checks that
    /// the server's certificate names the node it meant to reach.
    #[arg(
        long = "data-plane-tls",
        env = "SHARDPLANE_DATA_PLANE_TLS",
        value_enum,
        default_value = "operator"
    )]
    pub mode: Mode,
    /// The directory of the TLS files: what `files` reads; where an agent
    /// keeps the certificate the operator issued (default: beside its
    /// cache directory, `<cache-dir>-tls`).
    #[arg(long, env = "SHARDPLANE_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// The namespace where the operator publishes the data plane's CA
    /// (ConfigMap shardplane-data-plane-ca): the agents' namespace. The
    /// kubeconfig's namespace when unset.
    #[arg(long, env = "SHARDPLANE_DATA_PLANE_CA_NAMESPACE")]
    pub data_plane_ca_namespace: Option<String>,
}

impl TlsArgs {
    fn files_dir(&self) -> anyhow::Result<PathBuf> {
        self.tls_dir
            .clone()
            .ok_or_else(|| anyhow::anyhow!("--data-plane-tls files needs --tls-dir: the directory holding ca.crt, tls.crt and tls.key"))
    }

    /// An agent's source, its issued files kept beside `cache_dir` unless
    /// --tls-dir says where.
    pub fn agent(&self, cache_dir: &Path) -> anyhow::Result<shardplane_agent::certificate::Source> {
        use shardplane_agent::certificate::Source;
        Ok(match self.mode {
            Mode::Off => Source::Off,
            Mode::Files => Source::Files(self.files_dir()?),
            Mode::Operator => Source::Operator {
                dir: self
                    .tls_dir
                    .clone()
                    .unwrap_or_else(|| default_dir(cache_dir)),
                namespace: self.data_plane_ca_namespace.clone(),
            },
        })
    }

    /// The gateway's source (it has no certificate of its own unless
    /// `files` gives it one).
    pub fn gateway(&self) -> anyhow::Result<shardplane_gateway::DataPlaneTls> {
        use shardplane_gateway::DataPlaneTls;
        Ok(match self.mode {
            Mode::Off => DataPlaneTls::Off,
            Mode::Files => DataPlaneTls::Files(self.files_dir()?),
            Mode::Operator => DataPlaneTls::Operator {
                namespace: self.data_plane_ca_namespace.clone(),
            },
        })
    }

    /// These options spelled out as arguments.
    pub fn to_args(&self) -> Vec<String> {
        let mode = self
            .mode
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        let mut a = vec!["--data-plane-tls".to_string(), mode];
        if let Some(d) = &self.tls_dir {
            a.extend(["--tls-dir".to_string(), d.display().to_string()]);
        }
        if let Some(n) = &self.data_plane_ca_namespace {
            a.extend(["--data-plane-ca-namespace".to_string(), n.clone()]);
        }
        a
    }
}

/// The data plane's CA, and the node an endpoint belongs to.
pub type NodeTls = (std::sync::Arc<shardplane_dataplane::tls::Tls>, String);

/// `--data-plane-ca`, `--node`: TLS to one agent's data plane, for commands
/// that call an agent straight (`bench --endpoint`, `generate --endpoint`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct RemoteTls {
    /// The data plane's CA certificate, for agents serving TLS (`kubectl -n
    /// shardplane get configmap shardplane-data-plane-ca -o
    /// jsonpath='{.data.ca\\.crt}'`).
    #[arg(long, requires = "node")]
    pub data_plane_ca: Option<PathBuf>,
    /// The node whose data plane the endpoint is (its certificate must name it).
    #[arg(long, requires = "data_plane_ca")]
    pub node: Option<String>,
}

impl RemoteTls {
    /// TLS to `--node`, when `--data-plane-ca` is given.
    pub fn load(&self) -> anyhow::Result<Option<NodeTls>> {
        use anyhow::Context;
        use shardplane_dataplane::tls::{Material, Tls};
        let (Some(ca), Some(node)) = (&self.data_plane_ca, &self.node) else {
            return Ok(None);
        };
        let ca_pem = std::fs::read_to_string(ca)
            .with_context(|| format!("--data-plane-ca {}", ca.display()))?;
        let tls = Tls::new(&Material {
            ca_pem,
            identity: None,
        })
        .map_err(anyhow::Error::msg)?;
        Ok(Some((tls, node.clone())))
    }
}

/// `<cache-dir>-tls`: beside the cache, one per agent as caches are.
pub fn default_dir(cache_dir: &Path) -> PathBuf {
    let mut name = cache_dir.file_name().unwrap_or_default().to_os_string();
    name.push("-tls");
    cache_dir.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_files_sit_beside_the_cache() {
        assert_eq!(
            default_dir(Path::new("/var/lib/shardplane/cache")),
            PathBuf::from("/var/lib/shardplane/cache-tls")
        );
        assert_eq!(
            default_dir(Path::new("/s/cache/node-0")),
            PathBuf::from("/s/cache/node-0-tls")
        );
    }
}
