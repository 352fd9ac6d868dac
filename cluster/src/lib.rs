//! What every Kubernetes client of shardplane (operator, agent, gateway)
//! shares.
//!
//! ```text
//!  watch ──► reflector ──► Store<K>  (read by reconciles, routing, peers)
//!  status ──► server-side apply under one field manager ──► /status
//! ```
//!
//! Layout: [`client`] builds the API client every component uses (calls
//! with a deadline); [`status`] writes an object's status the one way every
//! component does; [`stores`] keeps watch-fed caches of cluster objects;
//! [`secrets`] reads credentials from Secrets that opt in; [`trust`] reads
//! the data plane's CA the operator publishes; [`certificate`] gets an
//! agent's or the gateway's data-plane certificate and keeps it current.

pub mod certificate;
pub mod client;
pub mod secrets;
pub mod status;
pub mod stores;
pub mod trust;

pub use client::{CALL_DEADLINE, client};
pub use status::{apply_status, apply_status_at};
pub use stores::{Watched, run_watch, watch_all};
