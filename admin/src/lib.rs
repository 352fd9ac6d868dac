//! What every long-running shardplane process shares: the admin port
//! (`/metrics`, the process's Prometheus registry; `/livez`, the process runs;
//! `/readyz`, it is ready for work; and whatever else the process adds, such
//! as the operator's web view) and metric registration.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;

use prometheus::Registry;

/// Serves the admin endpoints, and the routes of `extra`, on `listener`
/// until `shutdown` resolves. Handlers can read the peer's address
/// (`ConnectInfo<SocketAddr>`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: Arc<AtomicBool>,
    extra: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = extra
        .route(
            "/metrics",
            get(move || async move {
                prometheus::TextEncoder::new()
                    .encode_to_string(&registry.gather())
                    .unwrap_or_default()
            }),
        )
        .route("/livez", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || async move {
                if ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// Binds the admin address.
pub async fn bind(address: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address).await
}

/// What can go wrong on the admin port.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address cannot be bound.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The admin address.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The admin port of a running process: serves until stopped, and answers
/// `/readyz` as the process says.
pub struct Admin {
    ready: Arc<AtomicBool>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Admin {
    /// Binds `address` and serves `registry` there, not ready yet.
    pub async fn start(address: SocketAddr, registry: Registry) -> Result<Admin, Error> {
        let listener = bind(address)
            .await
            .map_err(|source| Error::Listen { address, source })?;
        let ready = Arc::new(AtomicBool::new(false));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            listener,
            registry,
            ready.clone(),
            Router::new(),
            async {
                let _ = stopped.await;
            },
        ));
        Ok(Admin { ready, stop, task })
    }

    /// Sets what `/readyz` answers.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Stops serving, waiting at most `within` for open requests.
    pub async fn stop(self, within: std::time::Duration) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(within, self.task).await;
    }
}

/// A registered metric as `/metrics` shows it once it has a sample.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Described {
    /// The metric's name.
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: String,
    /// Its label names.
    pub labels: Vec<String>,
    /// Its help text.
    pub help: String,
}

/// Registers `collectors` in `registry` and describes each, so the list of
/// metrics a process can expose is known before any of them has a sample.
pub fn register(
    registry: &Registry,
    collectors: Vec<Box<dyn prometheus::core::Collector>>,
) -> Vec<Described> {
    let mut described = Vec::new();
    for c in collectors {
        for family in c.collect() {
            let labels = c
                .desc()
                .iter()
                .find(|d| d.fq_name == family.name())
                .map(|d| d.variable_labels.clone())
                .unwrap_or_default();
            described.push(Described {
                name: family.name().to_string(),
                kind: format!("{:?}", family.get_field_type()).to_lowercase(),
                labels,
                help: family.help().to_string(),
            });
        }
        registry.register(c).expect("metric names are unique");
    }
    described.sort();
    described
}
