//! `ModelDeployment`: its instances placed as Shards, its status written
//! once per reconcile, and its Shards removed with it (a finalizer).
//!
//! ```text
//!  observe (watch-fed stores) ─► validate (pure) ─► plan (pure, the placement crate)
//!     ─► apply (Shards by server-side apply, deletes, events) ─► status (pure) ─► write once
//! ```
//!
//! Layout: [`observe`], [`validate`], [`plan`] (with [`cluster_view`], the
//! planner's view of the cluster), [`apply`], [`status`]: one module a step.

mod apply;
mod cluster_view;
mod observe;
mod plan;
mod status;
mod validate;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::Store;
use kube::{Api, ResourceExt};
use shardplane_crds::*;

pub use plan::shard_name;

use super::{Context, instrumented, retry_after_error};
use crate::caches::{Caches, all_of};
use crate::error::{Error, Result};

/// The ModelDeployment controller: a deployment is looked at again when its
/// Shards change, and every deployment when a node, pool, model or strategy
/// does (each look is cheap: it reads the stores).
pub fn controller(caches: &Caches) -> Controller<ModelDeployment> {
    let store = &caches.deployments.store;
    let (nodes, pools, models, strategies) =
        (store.clone(), store.clone(), store.clone(), store.clone());
    Controller::for_shared_stream(
        caches.deployments.subscribe(),
        caches.deployments.store.clone(),
    )
    .owns_shared_stream(caches.shards.subscribe())
    .watches_shared_stream(caches.nodes.subscribe(), move |_| all_of(&nodes))
    .watches_shared_stream(caches.pools.subscribe(), move |_| all_of(&pools))
    .watches_shared_stream(caches.models.subscribe(), move |_| all_of(&models))
    .watches_shared_stream(caches.strategies.subscribe(), move |_| all_of(&strategies))
}

/// Runs the ModelDeployment controller until the stream ends.
pub async fn run(controller: Controller<ModelDeployment>, ctx: Arc<Context>) {
    tokio::spawn(count_instances(ctx.stores.deployments.clone(), ctx.clone()));
    controller
        .shutdown_on_signal()
        .run(
            |d, ctx| async move {
                instrumented(&ctx, "modeldeployment", reconcile(d, ctx.clone())).await
            },
            retry_after_error,
            ctx,
        )
        .for_each(|_| async {})
        .await;
}

/// Keeps the instances-by-phase gauge, summed over every deployment.
async fn count_instances(store: Store<ModelDeployment>, ctx: Arc<Context>) {
    loop {
        let (mut ready, mut starting, mut unplaced) = (0i64, 0i64, 0i64);
        for d in store.state() {
            let wanted = i64::from(d.spec.replicas.max(0));
            let (placed, ok) = d.status.as_ref().map_or((0, 0), |s| {
                (i64::from(s.replicas), i64::from(s.ready_replicas))
            });
            ready += ok;
            starting += (placed - ok).max(0);
            unplaced += (wanted - placed).max(0);
        }
        for (phase, n) in [
            ("ready", ready),
            ("starting", starting),
            ("unplaced", unplaced),
        ] {
            ctx.metrics.instances.with_label_values(&[phase]).set(n);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

async fn reconcile(deployment: Arc<ModelDeployment>, ctx: Arc<Context>) -> Result<Action> {
    let ns = deployment.namespace().ok_or_else(|| {
        Error::MissingField(
            format!("ModelDeployment {}", deployment.name_any()),
            "namespace",
        )
    })?;
    let api: Api<ModelDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, DEPLOYMENT_FINALIZER, deployment, |event| async {
        match event {
            Finalizer::Apply(d) => place(&d, &ctx).await,
            Finalizer::Cleanup(d) => {
                let observed = observe::observe(&d, &ctx.stores);
                apply::delete_all(&ctx, &d, &observed.mine(&d)).await?;
                Ok(Action::await_change())
            }
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    })
}

/// The pipeline: observe → validate → plan → apply → status.
async fn place(d: &ModelDeployment, ctx: &Context) -> Result<Action> {
    let observed = observe::observe(d, &ctx.stores);
    let mine = observed.mine(d);
    let previous = d
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let taken = validate::name_conflicts(d, &observed);
    if !taken.is_empty() {
        let message = taken
            .iter()
            .map(|(name, owner)| format!("{name:?} is served by {owner}"))
            .collect::<Vec<_>>()
            .join(", ");
        let before = previous
            .iter()
            .find(|c| c.type_ == CONDITION_CONFLICTED && c.status == "True")
            .is_some_and(|c| c.message.starts_with(&message));
        if !before {
            apply::event(ctx, d, true, status::NAME_CONFLICT, "Validate", &message).await?;
        }
    }
    let valid = match validate::validate(d, &observed) {
        Ok(v) => v,
        Err(blocked) => {
            ctx.metrics.placements.with_label_values(&["invalid"]).inc();
            if previous.iter().all(|c| c.reason != blocked.reason) {
                apply::event(ctx, d, true, blocked.reason, "Validate", &blocked.message).await?;
            }
            let mut status = status::blocked(d, &mine, &blocked);
            status::conflicts(&mut status, d, &taken);
            // Kept as written before (see `place` below).
            status.endpoint = ctx
                .gateway_url
                .as_ref()
                .and(d.status.as_ref())
                .and_then(|s| s.endpoint.clone());
            write_status(ctx, d, status).await?;
            // A missing Model, pool or strategy may be created any moment;
            // watches bring it. A conflict's owner may go, which they do not.
            let again = if taken.is_empty() { 60 } else { 10 };
            return Ok(Action::requeue(Duration::from_secs(again)));
        }
    };

    let planned = plan::plan(d, &observed, &valid);
    let retiring = &planned.retiring;
    let changed = apply::shards(ctx, d, &mine, &planned.desired, &retiring.delete).await?;
    for (shard, why) in &retiring.keep {
        tracing::debug!(%shard, "{why}");
    }
    let plan = &planned.plan;
    if changed > 0 {
        let nodes: std::collections::BTreeSet<&str> = plan
            .instances
            .iter()
            .flat_map(|i| i.stages.iter().map(|s| s.node.as_str()))
            .collect();
        let note = format!(
            "{} instances on nodes {}: {}",
            plan.instances.len(),
            nodes.into_iter().collect::<Vec<_>>().join(", "),
            plan::describe(plan)
        );
        apply::event(ctx, d, false, "Placed", "Place", &note).await?;
    }
    if !planned.moved.is_empty() && changed > 0 {
        let note = planned.moved.join("; ");
        apply::event(ctx, d, true, "StageMoved", "Place", &note).await?;
    }
    let outcome = match (&plan.unplaced, plan.instances.is_empty()) {
        (None, _) => "placed",
        (Some(_), false) => "partial",
        (Some(_), true) => "unplaceable",
    };
    ctx.metrics.placements.with_label_values(&[outcome]).inc();
    if let Some(why) = &plan.unplaced
        && previous.iter().all(|c| c.message != why.message)
    {
        apply::event(ctx, d, true, why.reason.as_str(), "Place", &why.message).await?;
    }
    // Where clients ask: known once the deployment validates, and kept while
    // instances come and go (servers before 1.22 turn a field that server-side
    // apply drops into a null the schema refuses, so it is never dropped
    // while a gateway is configured).
    let endpoint = ctx.gateway_url.as_ref().map(|url| DeploymentEndpoint {
        url: url.clone(),
        // An alias names this deployment alone; the Model's served name may
        // be shared by several deployments of it.
        model: d
            .spec
            .aliases
            .first()
            .cloned()
            .unwrap_or_else(|| valid.model.served_name().to_string()),
    });
    let mut status = status::planned(d, &mine, &planned, changed, endpoint);
    status::conflicts(&mut status, d, &taken);
    let settled = status.ready_replicas >= planned.replicas as i32 && plan.unplaced.is_none();
    write_status(ctx, d, status).await?;
    Ok(if settled && taken.is_empty() {
        Action::requeue(Duration::from_secs(300))
    } else {
        // A conflict ends when the owner goes, which no watch of this
        // deployment sees.
        Action::requeue(Duration::from_secs(10))
    })
}

async fn write_status(
    ctx: &Context,
    d: &ModelDeployment,
    status: ModelDeploymentStatus,
) -> Result<()> {
    if d.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<ModelDeployment> =
        Api::namespaced(ctx.client.clone(), &d.namespace().unwrap_or_default());
    ctx.fence()?;
    shardplane_cluster::apply_status(&api, &d.name_any(), OPERATOR_MANAGER, &status).await?;
    Ok(())
}
