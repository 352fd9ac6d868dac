//! The operator's errors, each with a metric label.

/// What can go wrong in a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API failed (transient: retried with backoff).
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// An object is missing a field the API guarantees (a name, a namespace).
    #[error("{0} has no {1}")]
    MissingField(String, &'static str),
    /// The finalizer machinery failed.
    #[error("finalizer: {0}")]
    Finalizer(String),
    /// The leader's last renewal is as old as its renew deadline: it writes
    /// nothing more (a standby may lead by now).
    #[error("not writing: the leader lease was last renewed {0:.1} s ago, past the renew deadline")]
    Fenced(f64),
    /// A certificate or key cannot be made.
    #[error("certificate: {0}")]
    Certificate(String),
    /// The reconcile panicked (caught; the object is retried later).
    #[error("the reconcile panicked: {0}")]
    Panicked(String),
}

impl Error {
    /// A short, bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::MissingField(..) => "missing_field",
            Error::Finalizer(_) => "finalizer",
            Error::Panicked(_) => "panicked",
            Error::Fenced(_) => "fenced",
            Error::Certificate(_) => "certificate",
        }
    }
}

/// Why the operator stopped running.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The admin address cannot be bound.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The admin address.
        address: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The node-lease namespace cannot be created.
    #[error("cannot create namespace {namespace}: {source}")]
    Namespace {
        /// The namespace.
        namespace: &'static str,
        /// The API's answer.
        source: kube::Error,
    },
    /// An HTTP client for model sources cannot be built.
    #[error(transparent)]
    Http(#[from] shardplane_models::Error),
    /// The admission webhook cannot start.
    #[error("admission webhook: {0}")]
    Webhook(#[from] crate::admission::WebhookError),
    /// A controller stopped on its own (not at a signal).
    #[error("a controller stopped: {0}")]
    ControllerStopped(String),
    /// The data-plane signer cannot make or publish its CA.
    #[error("data-plane signer: {0}")]
    Signer(String),
    /// Another replica took the leader Lease.
    #[error("lost the leader lease")]
    LostLeadership,
}

/// The operator's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
