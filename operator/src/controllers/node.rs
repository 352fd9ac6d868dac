//! `InferenceNode`: `Ready` follows the node's Lease, renewed by its agent.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use shardplane_crds::{CONDITION_READY, InferenceNode, NODE_LEASE_NAMESPACE, OPERATOR_MANAGER};

use super::{Context, instrumented, retry_after_error};
use crate::caches::Caches;
use crate::conditions;
use crate::error::Result;

/// The InferenceNode controller, triggered by nodes and their Leases.
pub fn controller(caches: &Caches) -> Controller<InferenceNode> {
    Controller::for_shared_stream(caches.nodes.subscribe(), caches.nodes.store.clone())
        .watches_shared_stream(caches.leases.subscribe(), |lease| {
            Some(ObjectRef::<InferenceNode>::new(&lease.name_any()))
        })
}

/// Runs the InferenceNode controller until the stream ends.
pub async fn run(controller: Controller<InferenceNode>, ctx: Arc<Context>) {
    controller
        .shutdown_on_signal()
        .run(
            |n, ctx| async move { instrumented(&ctx, "inferencenode", reconcile(n, ctx.clone())).await },
            retry_after_error,
            ctx,
        )
        .for_each(|_| async {})
        .await;
}

/// How long until the Lease expires (`None`: no Lease or already expired).
fn lease_left(lease: Option<&Lease>, default: Duration) -> Option<Duration> {
    let spec = lease?.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref().or(spec.acquire_time.as_ref())?.0;
    let duration = spec
        .lease_duration_seconds
        .map_or(default, |s| Duration::from_secs(s.max(0) as u64));
    let expires = renewed + k8s_openapi::jiff::SignedDuration::try_from(duration).ok()?;
    let left = expires.duration_since(k8s_openapi::jiff::Timestamp::now());
    (left.is_positive())
        .then(|| Duration::try_from(left).ok())
        .flatten()
}

async fn reconcile(node: Arc<InferenceNode>, ctx: Arc<Context>) -> Result<Action> {
    let name = node.name_any();
    let lease = ctx
        .stores
        .leases
        .get(&ObjectRef::new(&name).within(NODE_LEASE_NAMESPACE));
    let left = lease_left(lease.as_deref(), ctx.default_lease_duration);
    let previous = node
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let mut conds = previous.clone();
    let (ready, reason, message) = match (&lease, left) {
        (None, _) => (
            false,
            "NoLease",
            "the agent has not registered a Lease yet".to_string(),
        ),
        (Some(_), Some(_)) => (true, "LeaseRenewed", String::new()),
        (Some(_), None) => (
            false,
            "LeaseExpired",
            "the agent stopped renewing its Lease: the node is down or cut off".to_string(),
        ),
    };
    conditions::set(
        &mut conds,
        &previous,
        CONDITION_READY,
        ready,
        reason,
        message,
        node.metadata.generation,
    );
    if conds != previous {
        tracing::info!(node = %name, ready, reason, "node readiness changed");
        let api: Api<InferenceNode> = Api::all(ctx.client.clone());
        shardplane_cluster::apply_status(
            &api,
            &name,
            OPERATOR_MANAGER,
            &serde_json::json!({ "conditions": conds }),
        )
        .await?;
    }
    // Look again right after the Lease would expire.
    Ok(match left {
        Some(left) => Action::requeue(left + Duration::from_millis(500)),
        None => Action::requeue(Duration::from_secs(30)),
    })
}
