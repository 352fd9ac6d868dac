//! `InferenceNode`: `Ready` follows the node's Lease, renewed by its agent,
//! judged on the operator's own clock and only while the operator reaches
//! the API server; a node that is not Ready has its Shards marked `Unknown`.
//!
//! ```text
//!  Lease record changed ──► seen at (operator's clock)
//!  now > max(seen at, contact restored) + lease ──► Ready False ──► its Shards Unknown
//!  no contact with the API server ──► no judgement (looked at again in 1 s)
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use shardplane_crds::{
    CONDITION_READY, InferenceNode, NODE_LEASE_NAMESPACE, OPERATOR_MANAGER, Shard, ShardPhase,
};
use tokio::time::Instant;

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

/// Node Leases as the operator saw them: each record (holder and renewal
/// time) and when it was first seen, on the operator's monotonic clock.
#[derive(Debug, Default)]
pub struct Observations(Mutex<HashMap<String, Seen>>);

#[derive(Debug, Clone, PartialEq)]
struct Seen {
    record: (Option<String>, Option<MicroTime>),
    at: Instant,
}

impl Observations {
    /// When `node`'s Lease expires on the operator's clock: `lease duration`
    /// after its record last changed, or after contact with the API server
    /// was last restored (`since`), whichever is later. A record first seen
    /// now counts as renewed now, so a new leader gives every node a whole
    /// lease. The writer's `renewTime` is never compared with this clock, so
    /// skewed clocks do not matter.
    fn expires(&self, node: &str, lease: &Lease, default: Duration, since: Instant) -> Instant {
        let spec = lease.spec.as_ref();
        let record = (
            spec.and_then(|s| s.holder_identity.clone()),
            spec.and_then(|s| s.renew_time.clone().or_else(|| s.acquire_time.clone())),
        );
        let duration = spec
            .and_then(|s| s.lease_duration_seconds)
            .map_or(default, |s| Duration::from_secs(s.max(0) as u64));
        let now = Instant::now();
        let mut seen = self.0.lock().expect("observations lock");
        let entry = seen.entry(node.to_string()).or_insert_with(|| Seen {
            record: record.clone(),
            at: now,
        });
        if entry.record != record {
            *entry = Seen { record, at: now };
        }
        entry.at.max(since) + duration
    }

    /// Forgets `node` (its Lease is gone).
    fn forget(&self, node: &str) {
        self.0.lock().expect("observations lock").remove(node);
    }
}

async fn reconcile(node: Arc<InferenceNode>, ctx: Arc<Context>) -> Result<Action> {
    let name = node.name_any();
    let lease = ctx
        .stores
        .leases
        .get(&ObjectRef::new(&name).within(NODE_LEASE_NAMESPACE));
    // Expired only when the operator itself reached the API server after
    // the Lease's expiry: through an outage no agent can renew either.
    let contact = ctx.contact.state();
    let expires = match lease.as_deref() {
        Some(l) => {
            Some(
                ctx.node_leases
                    .expires(&name, l, ctx.default_lease_duration, contact.since),
            )
        }
        None => {
            ctx.node_leases.forget(&name);
            None
        }
    };
    let left = expires
        .filter(|e| contact.last < *e)
        .map(|e| e.saturating_duration_since(Instant::now()));
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
        ctx.fence()?;
        shardplane_cluster::apply_status(
            &api,
            &name,
            OPERATOR_MANAGER,
            &serde_json::json!({ "conditions": conds }),
        )
        .await?;
    }
    if !ready {
        mark_shards_unknown(&ctx, &name, reason).await?;
    }
    // Look again right after the Lease would expire, and after the next
    // renewal of the leader's own Lease has shown contact.
    Ok(match left {
        Some(left) => Action::requeue(left.max(ctx.contact_gap / 2) + Duration::from_millis(500)),
        None => Action::requeue(Duration::from_secs(30)),
    })
}

/// Marks the Shards bound to a node that is not Ready `Unknown`: what its
/// agent reported last cannot be trusted, so nobody routes to them, but
/// they are kept until replacements are Ready (the deployment controller
/// decides). Their agent, once back, reports them again.
async fn mark_shards_unknown(ctx: &Context, node: &str, reason: &str) -> Result<()> {
    let shards = ctx.stores.shards.state();
    let bound = shards.iter().filter(|s| {
        s.spec.node == node
            && s.metadata.deletion_timestamp.is_none()
            && s.status.as_ref().and_then(|st| st.phase) != Some(ShardPhase::Unknown)
    });
    for shard in bound {
        let api: Api<Shard> =
            Api::namespaced(ctx.client.clone(), &shard.namespace().unwrap_or_default());
        let status = serde_json::json!({
            "phase": ShardPhase::Unknown,
            "reason": "NodeNotReady",
            "message": format!("node {node} is not Ready ({reason}): its agent's last report cannot be trusted"),
        });
        ctx.fence()?;
        match shardplane_cluster::apply_status(&api, &shard.name_any(), OPERATOR_MANAGER, &status)
            .await
        {
            Ok(()) => tracing::info!(shard = %shard.name_any(), %node, "shard marked Unknown"),
            // Deleted meanwhile.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
