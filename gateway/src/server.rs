//! The gateway's HTTP server, bounded against clients that are slow or many:
//! a connection limit, a deadline for each request's headers (which also
//! closes connections left idle between requests) and a graceful stop.
//!
//! ```text
//!  accept ◄─ a permit of max_connections (else the kernel's backlog waits)
//!    └► hyper http1 (header_read_timeout, keep-alive) ─► axum routes
//!  shutdown: stop accepting, let open requests finish (bounded), close
//! ```

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

/// What the server allows each client.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most; more wait in the listen backlog.
    pub max_connections: usize,
    /// How long a client has to send a request's headers, counted from the
    /// moment the server waits for them (so also an idle keep-alive).
    pub header_timeout: Duration,
    /// How long open requests may take to finish once the gateway stops.
    pub drain: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            drain: Duration::from_secs(30),
        }
    }
}

/// Serves `routes` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    routes: axum::Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of descriptors or a connection reset before accept:
                // wait a little and go on, as a server must.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(routes.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still open after the drain period were cut");
    }
    Ok(())
}
