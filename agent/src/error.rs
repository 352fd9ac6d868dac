//! What keeps an agent from starting, and node names it refuses. Failures of
//! one Shard are not errors of the agent: they become the Shard's status
//! (see [`crate::cache::Failure`]).

use std::net::SocketAddr;
use std::path::PathBuf;

/// Why the agent cannot run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The admin port cannot start.
    #[error(transparent)]
    Admin(#[from] shardplane_admin::Error),
    /// The data plane's address cannot be bound.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The data plane's address.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The Kubernetes API refused a step of registration.
    #[error("cannot {step} node {node}: {source}")]
    Registration {
        /// What was refused ("register", "report", "take the Lease of",
        /// "create the Lease namespace for").
        step: &'static str,
        /// This node.
        node: String,
        /// The API's answer.
        source: kube::Error,
    },
    /// No usable data-plane certificate.
    #[error("data-plane TLS: {0}")]
    Certificate(String),
    /// No HTTP client for downloads.
    #[error(transparent)]
    Http(#[from] shardplane_models::Error),
    /// The cache directory cannot be used.
    #[error("cannot use cache directory {}: {source}", dir.display())]
    CacheDirectory {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The host's name gives no node name.
    #[error(
        "the host name {host:?} gives no valid node name: set --node-name \
         (or SHARDPLANE_NODE_NAME) to a DNS-1123 name such as \"mac-studio-1\""
    )]
    NoNodeName {
        /// The host name.
        host: String,
    },
    /// A node name given by hand that Kubernetes would refuse.
    #[error(
        "--node-name {name:?} is not a valid node name: {why} \
         (a DNS-1123 name such as \"mac-studio-1\")"
    )]
    InvalidNodeName {
        /// The name given.
        name: String,
        /// The rule it breaks.
        why: &'static str,
    },
}

/// The agent's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
