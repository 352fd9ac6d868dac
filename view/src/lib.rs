//! How a person sees a shardplane cluster.
//!
//! ```text
//!  InferenceNodes, ModelDeployments, Shards ─► snapshot (pure) ─┬─► `shardplane status` (cli)
//!  gateways' /metrics ─► traffic (rates between readings) ──────┘   `/ui` web view (web)
//! ```
//!
//! `read` lists the objects as kubectl does; `snapshot` turns them into what
//! is shown; `traffic` adds the gateway's request rate, tokens per second
//! and time to first token; `web` serves the read-only page that draws it.

pub mod read;
pub mod snapshot;
pub mod traffic;
pub mod web;

pub use read::read;
pub use snapshot::Snapshot;

/// What can go wrong while looking.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a list.
    #[error("listing {kind}: {source}")]
    List {
        /// The kind, and a hint when it may be the reason.
        kind: &'static str,
        /// Why.
        source: kube::Error,
    },
    /// A gateway's metrics could not be read.
    #[error("reading the gateway's metrics at {url}: {source}")]
    Scrape {
        /// Where.
        url: String,
        /// Why.
        source: reqwest::Error,
    },
    /// A gateway's metrics answered with an error status.
    #[error("the gateway's metrics at {url} answered HTTP {status}")]
    ScrapeStatus {
        /// Where.
        url: String,
        /// The status.
        status: u16,
    },
    /// A `dns+` metrics URL's host did not resolve.
    #[error("resolving {host}: {source}")]
    Resolve {
        /// The host.
        host: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not an http(s) metrics URL.
    #[error("not an http(s) metrics URL: {0}")]
    MetricsUrl(String),
}
