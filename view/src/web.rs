//! The web view: a read-only page at `/ui` that draws the cluster (nodes
//! sized by memory, links with latency and bandwidth, each instance as a
//! path through its nodes), every deployment with its conditions, live
//! tokens per second and time to first token, and download progress.
//!
//! ```text
//!  browser ── GET /ui, /ui/app.js, /ui/style.css ──► assets embedded in the binary
//!          ── GET /ui/api/state every 2 s ─────────► guard (loopback or key)
//!                                                    └► at most one refresh a second, shared:
//!                                                       read (lists) + scrape gateways
//!                                                       ─► snapshot, download rates, traffic
//! ```
//!
//! Without a key it answers loopback peers only (a browser on the same
//! machine, or `kubectl port-forward`, which connects from the pod's
//! loopback); with a key every request carries it, as an HTTP Basic password
//! (the browser asks once) or a Bearer token. Nothing in it changes the
//! cluster: every route is a GET.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine;
use serde::Serialize;

use crate::Snapshot;
use crate::traffic::{self, Sample};

const INDEX: &str = include_str!("../assets/index.html");
const SCRIPT: &str = include_str!("../assets/app.js");
const STYLE: &str = include_str!("../assets/style.css");

/// A refresh is shared by every request within this time.
const FRESH_FOR: Duration = Duration::from_secs(1);
/// Rates are over about this long (the newest reading at least this old).
const RATE_WINDOW: Duration = Duration::from_secs(10);
/// Readings older than this are dropped.
const KEEP_SAMPLES: Duration = Duration::from_secs(60);

/// How the web view is served.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// Every request must carry this key; without one, only loopback peers
    /// are answered.
    pub key: Option<String>,
    /// The gateways' metrics URLs (see [`crate::traffic`]); no traffic
    /// is shown without any.
    pub gateway_metrics: Vec<String>,
}

/// What the page polls: the snapshot (the last one read, if the latest read
/// failed) and what went wrong.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
struct Shown {
    #[serde(flatten)]
    snapshot: Option<Snapshot>,
    /// Why the cluster could not be read just now.
    error: Option<String>,
    /// Whether gateway metrics are configured, and why they could not be read.
    traffic_configured: bool,
    traffic_error: Option<String>,
}

struct Viewer {
    client: kube::Client,
    http: reqwest::Client,
    settings: Settings,
    latest: tokio::sync::Mutex<Latest>,
}

#[derive(Default)]
struct Latest {
    body: Option<(Instant, String)>,
    last: Option<(Snapshot, Instant)>,
    samples: VecDeque<Sample>,
}

/// The routes of the web view (under `/ui`), to merge into a server that
/// is served with connection info (`into_make_service_with_connect_info`).
pub fn router(client: kube::Client, settings: Settings) -> Router {
    let viewer = Arc::new(Viewer {
        client,
        http: shardplane_models::http_client().unwrap_or_default(),
        settings,
        latest: tokio::sync::Mutex::new(Latest::default()),
    });
    Router::new()
        .route(
            "/ui",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/ui/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route("/ui/api/state", get(state))
        .layer(middleware::from_fn_with_state(viewer.clone(), guard))
        .with_state(viewer)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// Loopback or the key; then the page's headers on every answer.
async fn guard(State(viewer): State<Arc<Viewer>>, request: Request, next: Next) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    if let Err(refused) = admit(viewer.settings.key.as_deref(), peer, request.headers()) {
        return refused.into_response();
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Why a request may not see the page.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// No key is set and the peer is not on this machine.
    NotLoopback,
    /// A key is set and the request does not carry it.
    NoKey,
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Refused::NotLoopback => (
                StatusCode::FORBIDDEN,
                "The web view answers this machine only (loopback) unless it has a key \
                 (--ui-key-file). Reach it through `kubectl port-forward` or an SSH tunnel, \
                 or give it a key.\n",
            )
                .into_response(),
            Refused::NoKey => (
                StatusCode::UNAUTHORIZED,
                [(
                    header::WWW_AUTHENTICATE,
                    "Basic realm=\"shardplane\", charset=\"UTF-8\"",
                )],
                "The web view needs its key: any user name, the key as the password.\n",
            )
                .into_response(),
        }
    }
}

/// Whether a request may see the page.
fn admit(key: Option<&str>, peer: Option<SocketAddr>, headers: &HeaderMap) -> Result<(), Refused> {
    let Some(key) = key else {
        if peer.is_some_and(|p| p.ip().is_loopback()) {
            return Ok(());
        }
        return Err(Refused::NotLoopback);
    };
    let offered = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            if let Some(token) = v.strip_prefix("Bearer ") {
                return Some(token.trim().to_string());
            }
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(v.strip_prefix("Basic ")?.trim())
                .ok()?;
            let text = String::from_utf8(decoded).ok()?;
            Some(text.split_once(':')?.1.to_string())
        });
    if offered.is_some_and(|o| same(o.as_bytes(), key.as_bytes())) {
        return Ok(());
    }
    Err(Refused::NoKey)
}

/// Equal, in time that depends on the length only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn state(State(viewer): State<Arc<Viewer>>) -> Response {
    let mut latest = viewer.latest.lock().await;
    let body = match &latest.body {
        Some((at, body)) if at.elapsed() < FRESH_FOR => body.clone(),
        _ => {
            let body = refresh(&viewer, &mut latest).await;
            latest.body = Some((Instant::now(), body.clone()));
            body
        }
    };
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Reads the cluster and the gateways once and makes the JSON the page gets.
async fn refresh(viewer: &Viewer, latest: &mut Latest) -> String {
    let now = Instant::now();
    let (mut snapshot, error) = match crate::read(&viewer.client, None).await {
        Ok(mut s) => {
            if let Some((before, at)) = &latest.last {
                s.rates_since(before, now.duration_since(*at).as_secs_f64());
            }
            latest.last = Some((s.clone(), now));
            (Some(s), None)
        }
        Err(e) => (
            latest.last.as_ref().map(|(s, _)| s.clone()),
            Some(e.to_string()),
        ),
    };
    let mut traffic_error = None;
    if !viewer.settings.gateway_metrics.is_empty() {
        match traffic::scrape(&viewer.http, &viewer.settings.gateway_metrics).await {
            Ok(sample) => {
                latest
                    .samples
                    .retain(|s| now.duration_since(s.at) < KEEP_SAMPLES);
                let earlier = latest
                    .samples
                    .iter()
                    .rev()
                    .find(|s| now.duration_since(s.at) >= RATE_WINDOW)
                    .or(latest.samples.front());
                if let Some(s) = snapshot.as_mut() {
                    s.with_traffic(earlier, &sample);
                }
                latest.samples.push_back(sample);
            }
            Err(e) => traffic_error = Some(e.to_string()),
        }
    }
    let shown = Shown {
        snapshot,
        error,
        traffic_configured: !viewer.settings.gateway_metrics.is_empty(),
        traffic_error,
    };
    serde_json::to_string(&shown).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user_and_key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let encoded = base64::engine::general_purpose::STANDARD.encode(user_and_key);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Basic {encoded}")).unwrap(),
        );
        h
    }

    #[test]
    fn without_a_key_only_loopback_peers_are_answered() {
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let local6: SocketAddr = "[::1]:5000".parse().unwrap();
        let remote: SocketAddr = "10.0.0.7:5000".parse().unwrap();
        assert!(admit(None, Some(local), &HeaderMap::new()).is_ok());
        assert!(admit(None, Some(local6), &HeaderMap::new()).is_ok());
        let refused = admit(None, Some(remote), &HeaderMap::new()).unwrap_err();
        assert_eq!(refused.into_response().status(), StatusCode::FORBIDDEN);
        assert!(
            admit(None, None, &HeaderMap::new()).is_err(),
            "unknown peer"
        );
    }

    #[test]
    fn with_a_key_every_request_carries_it() {
        let remote: SocketAddr = "10.0.0.7:5000".parse().unwrap();
        let key = Some("s3cret:with-colon");
        assert!(admit(key, Some(remote), &basic("anyone:s3cret:with-colon")).is_ok());
        let mut bearer = HeaderMap::new();
        bearer.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer s3cret:with-colon"),
        );
        assert!(admit(key, Some(remote), &bearer).is_ok());
        for wrong in [
            basic("anyone:s3cret"),
            basic("s3cret:with-colon"),
            HeaderMap::new(),
        ] {
            let refused = admit(key, Some(remote), &wrong)
                .unwrap_err()
                .into_response();
            assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
            assert!(
                refused.headers()[header::WWW_AUTHENTICATE]
                    .to_str()
                    .unwrap()
                    .starts_with("Basic ")
            );
        }
        // Loopback does not skip the key once there is one.
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert!(admit(key, Some(local), &HeaderMap::new()).is_err());
    }

    #[test]
    fn the_page_refers_only_to_its_own_assets() {
        for asset in ["/ui/app.js", "/ui/style.css"] {
            assert!(INDEX.contains(asset), "{asset}");
        }
        for text in [INDEX, SCRIPT, STYLE] {
            // The SVG namespace is a name, not something fetched.
            let text = text.replace("\"http://www.w3.org/2000/svg\"", "");
            assert!(
                !text.contains("http://") && !text.contains("https://"),
                "no CDN"
            );
        }
        assert!(
            !SCRIPT.contains("innerHTML"),
            "cluster text goes in as text only"
        );
    }
}
