//! The gateway's HTTP server, bounded against clients that are slow or many:
//! a connection limit, a deadline for each request's headers (which also
//! closes connections left idle between requests) and a graceful stop.
//!
//! ```text
//!  accept ◄─ a permit of max_connections (else the kernel's backlog waits)
//!    └► hyper http1 (header_read_timeout, keep-alive) ─► axum routes
//!  shutdown: stop accepting, let open requests finish (bounded), close
//! ```
//!
//! A response sent before its request's body was read to the end (a 413
//! judged from `content-length`, a 401 before the body, a 408) says
//! `connection: close`: hyper would not reuse that connection anyway, and
//! a client told so opens a new one instead of sending its next request
//! into a socket that is closing.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{HeaderValue, Request, header};
use axum::response::Response;
use hyper::body::{Frame, SizeHint};

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
    let routes = routes.layer(axum::middleware::from_fn(close_when_body_unread));
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

/// Marks the response `connection: close` when the handler answered
/// without reading the request's body to its end.
async fn close_when_body_unread(
    request: Request<axum::body::Body>,
    next: axum::middleware::Next,
) -> Response {
    let sent_body = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_some_and(|v| v.as_bytes() != b"0")
        || request.headers().contains_key(header::TRANSFER_ENCODING);
    if !sent_body {
        return next.run(request).await;
    }
    let read = Arc::new(AtomicBool::new(false));
    let watched = read.clone();
    let request = request.map(|inner| {
        axum::body::Body::new(Watched {
            inner,
            read: watched,
        })
    });
    let mut response = next.run(request).await;
    if !read.load(Ordering::Acquire) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request body that records when it has been read to its end.
struct Watched {
    inner: axum::body::Body,
    read: Arc<AtomicBool>,
}

impl hyper::body::Body for Watched {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
