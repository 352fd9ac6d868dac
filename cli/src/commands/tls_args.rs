//! `--data-plane-tls`, `--tls-dir`, `--data-plane-ca-namespace`: where the
//! data plane's TLS material comes from, for the agent and the gateway.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use shardplane_cluster::certificate::Source;

/// Where the data plane's certificates come from.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Issued by the operator on request and renewed before they expire
    /// (an agent's names its node; the gateway's is client-only).
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
    /// between agents and from the gateway is TLS: a client checks that
    /// the server's certificate names the node it meant to reach, and an
    /// agent requires a certificate of every caller.
    #[arg(
        long = "data-plane-tls",
        env = "SHARDPLANE_DATA_PLANE_TLS",
        value_enum,
        default_value = "operator"
    )]
    pub mode: Mode,
    /// The directory of the TLS files: what `files` reads; where an agent
    /// keeps the certificate the operator issued (default: beside its
    /// cache directory, `<cache-dir>-tls`; the gateway keeps its in memory
    /// unless this is set).
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
    pub fn agent(&self, cache_dir: &Path) -> anyhow::Result<Source> {
        self.source(Some(
            self.tls_dir
                .clone()
                .unwrap_or_else(|| default_dir(cache_dir)),
        ))
    }

    /// The gateway's source: issued files kept in --tls-dir when set, in
    /// memory otherwise.
    pub fn gateway(&self) -> anyhow::Result<Source> {
        self.source(self.tls_dir.clone())
    }

    fn source(&self, kept_in: Option<PathBuf>) -> anyhow::Result<Source> {
        Ok(match self.mode {
            Mode::Off => Source::Off,
            Mode::Files => Source::Files(self.files_dir()?),
            Mode::Operator => Source::Operator {
                dir: kept_in,
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

/// `--data-plane-tls-dir`, `--node`: TLS to one agent's data plane, for
/// commands that call an agent straight (`bench --endpoint`, `generate
/// --endpoint`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct RemoteTls {
    /// A directory holding the data plane's CA (`ca.crt`) and a certificate
    /// it signed with its key (`tls.crt`, `tls.key`), for agents serving
    /// TLS: they require a certificate of every caller. The gateway's
    /// (kept on disk with its `--tls-dir`) does for any agent; an agent's own (`<cache-dir>-tls`
    /// on its machine) for that agent (`Generate` refuses other nodes'
    /// certificates), and for any agent's `ReadBlob` (`bench --copy-from`).
    #[arg(long, requires = "node")]
    pub data_plane_tls_dir: Option<PathBuf>,
    /// The node whose data plane the endpoint is (its certificate must name it).
    #[arg(long, requires = "data_plane_tls_dir")]
    pub node: Option<String>,
}

impl RemoteTls {
    /// TLS to `--node`, when `--data-plane-tls-dir` is given.
    pub fn load(&self) -> anyhow::Result<Option<NodeTls>> {
        use anyhow::Context;
        use shardplane_dataplane::tls::{Material, Tls};
        let (Some(dir), Some(node)) = (&self.data_plane_tls_dir, &self.node) else {
            return Ok(None);
        };
        let material = Material::read_dir(dir)
            .with_context(|| format!("--data-plane-tls-dir {}", dir.display()))?;
        if material.identity.is_none() {
            anyhow::bail!(
                "--data-plane-tls-dir {} holds no certificate (tls.crt, tls.key): agents refuse callers without one",
                dir.display()
            );
        }
        let tls = Tls::new(&material).map_err(anyhow::Error::msg)?;
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
