//! The controllers: observe → validate → plan → apply → status, one per kind.

pub mod deployment;
pub mod model;
pub mod node;
pub mod node_pool;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Client;
use kube::runtime::controller::Action;
use kube::runtime::events::Reporter;

use crate::caches::Stores;
use crate::error::Error;
use crate::metrics::Metrics;

/// What every reconcile gets.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// The metrics.
    pub metrics: Metrics,
    /// Who publishes events.
    pub reporter: Reporter,
    /// How long after its last renewal a node's Lease counts as expired when
    /// the Lease does not say.
    pub default_lease_duration: Duration,
    /// HTTP client for reading remote model headers.
    pub http: reqwest::Client,
    /// HTTP client for the hub's endpoint only: it carries the hub token.
    pub hub_http: reqwest::Client,
    /// Base URL of the Hugging Face hub (or a mirror).
    pub hugging_face_endpoint: String,
    /// Read `path` model sources here rather than wait for an agent's report.
    pub read_model_paths: bool,
    /// The gateway's base URL for deployments' `status.endpoint`.
    pub gateway_url: Option<String>,
    /// What the watches have seen: reconciles read these, never LIST.
    pub stores: Stores,
    /// The leader's contact with the API server (node Leases are judged
    /// only while it holds).
    pub contact: Arc<crate::leader::Contact>,
    /// The longest pause between leader renewals that is still contact.
    pub contact_gap: Duration,
    /// The leader's renew deadline: no write once its last renewal is this
    /// old (`Context::fence`).
    pub renew_deadline: Duration,
    /// Node Leases as the node controller last saw them, on its own clock.
    pub node_leases: node::Observations,
}

impl Context {
    /// Call before every write: refuses once this replica may no longer be
    /// the leader (its last renewal is as old as the renew deadline).
    pub fn fence(&self) -> Result<(), Error> {
        self.contact
            .fence(self.renew_deadline)
            .map_err(|age| Error::Fenced(age.as_secs_f64()))
    }
}

/// Runs `reconcile` and records its outcome and duration under `controller`.
pub(crate) async fn instrumented<F>(
    ctx: &Arc<Context>,
    controller: &str,
    reconcile: F,
) -> Result<Action, Error>
where
    F: std::future::Future<Output = Result<Action, Error>>,
{
    // Never on a partial view: until every watch has listed its kind the
    // object waits (a reconcile that saw, say, a deployment's Shards but
    // none of its nodes would delete them).
    if futures::FutureExt::now_or_never(ctx.stores.ready()).is_none() {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    let start = Instant::now();
    // A reconcile that panics (a bug met by one odd object) fails that
    // object's reconcile, retried later; the controller and every other
    // object go on.
    let result =
        match futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(reconcile)).await {
            Ok(result) => result,
            Err(panic) => Err(Error::Panicked(panic_message(panic.as_ref()))),
        };
    ctx.metrics
        .reconcile_duration
        .with_label_values(&[controller])
        .observe(start.elapsed().as_secs_f64());
    match &result {
        Ok(_) => ctx
            .metrics
            .reconciles
            .with_label_values(&[controller, "ok"])
            .inc(),
        Err(e) => {
            ctx.metrics
                .reconciles
                .with_label_values(&[controller, "error"])
                .inc();
            ctx.metrics
                .reconcile_errors
                .with_label_values(&[controller, e.metric_label()])
                .inc();
        }
    }
    result
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Transient errors retry after a short wait; the watch brings spec changes.
pub(crate) fn retry_after_error<K>(_object: Arc<K>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(%error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}
