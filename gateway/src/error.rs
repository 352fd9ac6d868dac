//! What keeps the gateway from starting or from reading a Secret. Errors a
//! client sees are [`crate::protocol::ApiError`]s, rendered by each dialect.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Why the gateway cannot run, or cannot read what it needs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The admin port cannot start.
    #[error(transparent)]
    Admin(#[from] shardplane_admin::Error),
    /// The API address cannot be bound, or serving on it failed.
    #[error("cannot serve on {address}: {source}")]
    Serve {
        /// The API address.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The HTTP client for external endpoints cannot be built.
    #[error("cannot build an HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// The API keys file cannot be read.
    #[error("cannot read API keys {}: {source}", path.display())]
    KeysUnreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A Secret cannot be read.
    #[error("cannot read Secret {namespace}/{name}: {source}")]
    SecretUnreadable {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The API's answer.
        source: kube::Error,
    },
    /// The data plane's TLS material cannot be used.
    #[error("data-plane TLS: {0}")]
    Tls(String),
    /// A Secret named as an external endpoint's key cannot be used.
    #[error(transparent)]
    Secret(#[from] shardplane_cluster::secrets::SecretError),
}

/// The gateway's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
