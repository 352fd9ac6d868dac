//! `NodePool`: members by label selector, ready count, allocatable memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use kube::core::{Selector, SelectorExt};
use kube::runtime::controller::{Action, Controller};
use kube::{Api, ResourceExt};
use shardplane_crds::quantity::{format_bytes, parse_bytes};
use shardplane_crds::validation::Validate;
use shardplane_crds::{CONDITION_READY, InferenceNode, NodePool, NodePoolStatus, OPERATOR_MANAGER};

use super::{Context, instrumented, retry_after_error};
use crate::caches::{Caches, all_of};
use crate::conditions;
use crate::error::Result;

/// The NodePool controller: every pool is looked at again when a node changes.
pub fn controller(caches: &Caches) -> Controller<NodePool> {
    let pools = caches.pools.store.clone();
    Controller::for_shared_stream(caches.pools.subscribe(), pools.clone())
        .watches_shared_stream(caches.nodes.subscribe(), move |_| all_of(&pools))
}

/// Runs the NodePool controller until the stream ends.
pub async fn run(controller: Controller<NodePool>, ctx: Arc<Context>) {
    controller
        .shutdown_on_signal()
        .run(
            |p, ctx| async move { instrumented(&ctx, "nodepool", reconcile(p, ctx.clone())).await },
            retry_after_error,
            ctx,
        )
        .for_each(|_| async {})
        .await;
}

/// Whether `node` is a member of `pool`.
pub fn selects(pool: &NodePool, node: &InferenceNode) -> bool {
    let Ok(selector) = Selector::try_from(pool.spec.node_selector.clone()) else {
        return false;
    };
    let labels: BTreeMap<String, String> = node.labels().clone();
    selector.matches(&labels)
}

/// Memory a member node can give to shards: its allocatable less the pool's reserve.
pub fn node_allocatable(pool: &NodePool, node: &InferenceNode) -> u64 {
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.memory.as_ref())
        .and_then(|m| parse_bytes(&m.allocatable).ok())
        .unwrap_or(0);
    let reserve = pool
        .spec
        .memory_reserve
        .as_ref()
        .and_then(|q| parse_bytes(q).ok())
        .unwrap_or(0);
    allocatable.saturating_sub(reserve)
}

/// Whether a node is ready and accepting work.
pub fn node_ready(node: &InferenceNode) -> bool {
    node.status
        .as_ref()
        .is_some_and(|s| conditions::is_true(&s.conditions, CONDITION_READY) && !s.draining)
}

async fn reconcile(pool: Arc<NodePool>, ctx: Arc<Context>) -> Result<Action> {
    let name = pool.name_any();
    let generation = pool.metadata.generation;
    let previous = pool
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let mut status = NodePoolStatus {
        observed_generation: generation,
        ..Default::default()
    };
    if let Err(e) = pool.validate() {
        conditions::set(
            &mut status.conditions,
            &previous,
            CONDITION_READY,
            false,
            "InvalidSpec",
            e.to_string(),
            generation,
        );
    } else {
        let nodes = ctx.stores.nodes.state();
        let members: Vec<&InferenceNode> = nodes
            .iter()
            .map(|n| n.as_ref())
            .filter(|n| selects(&pool, n))
            .collect();
        let ready: Vec<&&InferenceNode> = members.iter().filter(|n| node_ready(n)).collect();
        status.nodes = members.iter().map(|n| n.name_any()).collect();
        status.nodes.sort();
        status.node_count = members.len() as u32;
        status.ready_nodes = ready.len() as u32;
        status.allocatable_memory = Some(format_bytes(
            ready.iter().map(|n| node_allocatable(&pool, n)).sum(),
        ));
        let (ok, reason, message) = if ready.is_empty() {
            (
                false,
                "NoReadyNodes",
                format!("{} member nodes, none ready", members.len()),
            )
        } else {
            (
                true,
                "NodesReady",
                format!("{} of {} member nodes ready", ready.len(), members.len()),
            )
        };
        conditions::set(
            &mut status.conditions,
            &previous,
            CONDITION_READY,
            ok,
            reason,
            message,
            generation,
        );
    }
    if pool.status.as_ref() != Some(&status) {
        let api: Api<NodePool> = Api::all(ctx.client.clone());
        ctx.fence()?;
        shardplane_cluster::apply_status(&api, &name, OPERATOR_MANAGER, &status).await?;
    }
    Ok(Action::await_change())
}
