//! `ModelDeployment`: validate → plan → create, update and delete Shards →
//! status, with a finalizer that removes its Shards.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use shardplane_crds::validation::Validate;
use shardplane_crds::*;
use shardplane_placement as placement;

use super::{Context, instrumented, retry_after_error};
use crate::conditions;
use crate::error::{Error, Result};
use crate::world::{self, TIER_LABEL, deployment_key};

/// Runs the ModelDeployment controller until the stream ends.
pub async fn run(ctx: Arc<Context>) {
    let deployments: Api<ModelDeployment> = Api::all(ctx.client.clone());
    let controller = Controller::new(deployments, watcher::Config::default());
    let store = controller.store();
    let all = move || {
        store
            .state()
            .into_iter()
            .map(|d| ObjectRef::from_obj(&*d))
            .collect::<Vec<_>>()
    };
    let (all_nodes, all_pools, all_models, all_strategies) =
        (all.clone(), all.clone(), all.clone(), all);
    tokio::spawn(count_instances(controller.store(), ctx.clone()));
    controller
        .owns(
            Api::<Shard>::all(ctx.client.clone()),
            watcher::Config::default(),
        )
        .watches(
            Api::<InferenceNode>::all(ctx.client.clone()),
            watcher::Config::default(),
            move |_| all_nodes(),
        )
        .watches(
            Api::<NodePool>::all(ctx.client.clone()),
            watcher::Config::default(),
            move |_| all_pools(),
        )
        .watches(
            Api::<Model>::all(ctx.client.clone()),
            watcher::Config::default(),
            move |_| all_models(),
        )
        .watches(
            Api::<ShardingStrategy>::all(ctx.client.clone()),
            watcher::Config::default(),
            move |_| all_strategies(),
        )
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
async fn count_instances(
    store: kube::runtime::reflector::Store<ModelDeployment>,
    ctx: Arc<Context>,
) {
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
            Finalizer::Apply(d) => apply(&d, &ctx).await,
            Finalizer::Cleanup(d) => cleanup(&d, &ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    })
}

/// Deletes every Shard of the deployment (the test API server has no garbage
/// collector, and owner references alone would leave them behind there).
async fn cleanup(d: &ModelDeployment, ctx: &Context) -> Result<Action> {
    let ns = d.namespace().unwrap_or_default();
    let shards: Api<Shard> = Api::namespaced(ctx.client.clone(), &ns);
    let mine = shards
        .list(&ListParams::default().labels(&d.shard_selector()))
        .await?;
    for s in mine.items {
        shards
            .delete(&s.name_any(), &DeleteParams::default())
            .await?;
    }
    Ok(Action::await_change())
}

/// Everything a reconcile reads.
struct Observed {
    model: Option<Model>,
    pool: Option<NodePool>,
    strategy: Option<ShardingStrategy>,
    nodes: Vec<InferenceNode>,
    shards: Vec<Shard>,
    models: BTreeMap<(String, String), Model>,
}

async fn observe(d: &ModelDeployment, ctx: &Context) -> Result<Observed> {
    let ns = d.namespace().unwrap_or_default();
    let c = &ctx.client;
    let models = Api::<Model>::all(c.clone())
        .list(&ListParams::default())
        .await?;
    let models: BTreeMap<(String, String), Model> = models
        .items
        .into_iter()
        .map(|m| ((m.namespace().unwrap_or_default(), m.name_any()), m))
        .collect();
    Ok(Observed {
        model: models.get(&(ns, d.spec.model.clone())).cloned(),
        pool: Api::<NodePool>::all(c.clone())
            .get_opt(&d.spec.node_pool)
            .await?,
        strategy: Api::<ShardingStrategy>::all(c.clone())
            .get_opt(&d.spec.strategy)
            .await?,
        nodes: Api::<InferenceNode>::all(c.clone())
            .list(&ListParams::default())
            .await?
            .items,
        shards: Api::<Shard>::all(c.clone())
            .list(&ListParams::default())
            .await?
            .items,
        models,
    })
}

/// Why a deployment cannot be planned: a reason and what to change.
struct Blocked {
    reason: &'static str,
    message: String,
}

/// Checks the deployment and what it names; returns the inputs of planning.
fn validate(
    d: &ModelDeployment,
    o: &Observed,
) -> Result<(Model, NodePool, ShardingStrategy, placement::Footprint), Blocked> {
    let invalid = |message: String| Blocked {
        reason: "InvalidSpec",
        message,
    };
    d.validate().map_err(|e| invalid(e.to_string()))?;
    let model = o.model.clone().ok_or_else(|| Blocked {
        reason: "ModelNotFound",
        message: format!(
            "Model {:?} does not exist in this namespace: create it or fix spec.model",
            d.spec.model
        ),
    })?;
    let pool = o.pool.clone().ok_or_else(|| Blocked {
        reason: "NodePoolNotFound",
        message: format!(
            "NodePool {:?} does not exist: create it or fix spec.nodePool",
            d.spec.node_pool
        ),
    })?;
    let strategy = o.strategy.clone().ok_or_else(|| Blocked {
        reason: "StrategyNotFound",
        message: format!(
            "ShardingStrategy {:?} does not exist: create it or fix spec.strategy",
            d.spec.strategy
        ),
    })?;
    pool.validate()
        .map_err(|e| invalid(format!("NodePool {}: {e}", pool.name_any())))?;
    strategy
        .validate()
        .map_err(|e| invalid(format!("ShardingStrategy {}: {e}", strategy.name_any())))?;
    d.validate_binding(&pool, &strategy).map_err(|e| Blocked {
        reason: "StrategyDoesNotFitTier",
        message: e.to_string(),
    })?;
    let footprint = model
        .status
        .as_ref()
        .and_then(world::footprint)
        .ok_or_else(|| Blocked {
            reason: "ModelNotResolved",
            message: format!(
                "Model {:?} is not resolved yet: {}",
                d.spec.model,
                model
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION_RESOLVED))
                    .map_or(
                        "waiting for the operator to read its weights".to_string(),
                        |c| c.message.clone()
                    )
            ),
        })?;
    Ok((model, pool, strategy, footprint))
}

/// A Shard's name: deployment, instance, stage and a hash of where it runs, so
/// a stage moved to another node is a new Shard (as a moved Pod is a new Pod).
fn shard_name(deployment: &str, instance: u32, stage: usize, s: &placement::Stage) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&s.node, s.layers.start, s.layers.end).hash(&mut h);
    format!("{deployment}-{instance}-{stage}-{:08x}", h.finish() as u32)
}

fn desired_shards(
    d: &ModelDeployment,
    model: &Model,
    pool: &NodePool,
    strategy: &ShardingStrategy,
    layers: u32,
    plan: &placement::Plan,
) -> Vec<Shard> {
    let name = d.name_any();
    let owner = d.controller_owner_ref(&()).into_iter().collect::<Vec<_>>();
    let mut out = Vec::new();
    for inst in &plan.instances {
        let names: Vec<String> = inst
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| shard_name(&name, inst.index, i, s))
            .collect();
        for (i, s) in inst.stages.iter().enumerate() {
            let labels = BTreeMap::from([
                (NODE_LABEL.to_string(), s.node.clone()),
                (DEPLOYMENT_LABEL.to_string(), name.clone()),
                (INSTANCE_LABEL.to_string(), inst.index.to_string()),
                (TIER_LABEL.to_string(), pool.spec.tier.to_string()),
            ]);
            out.push(Shard {
                metadata: ObjectMeta {
                    name: Some(names[i].clone()),
                    namespace: d.namespace(),
                    labels: Some(labels),
                    owner_references: Some(owner.clone()),
                    ..Default::default()
                },
                spec: ShardSpec {
                    deployment: name.clone(),
                    model: model.name_any(),
                    source: model.spec.source.clone(),
                    format: model.spec.format,
                    node: s.node.clone(),
                    instance: inst.index,
                    stage: i as u32,
                    stage_count: inst.stages.len() as u32,
                    layers: LayerRange {
                        start: s.layers.start,
                        end: s.layers.end,
                    },
                    total_layers: layers,
                    kv_cache: strategy.spec.kv_cache,
                    engine: None,
                    next: names.get(i + 1).cloned(),
                    previous: i.checked_sub(1).map(|p| names[p].clone()),
                },
                status: None,
            });
        }
    }
    out
}

async fn apply(d: &ModelDeployment, ctx: &Context) -> Result<Action> {
    let ns = d.namespace().unwrap_or_default();
    let name = d.name_any();
    let generation = d.metadata.generation;
    let previous = d
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
    let reference = d.object_ref(&());
    let observed = observe(d, ctx).await?;
    let mine: Vec<&Shard> = observed
        .shards
        .iter()
        .filter(|s| s.namespace().as_deref() == Some(ns.as_str()) && s.spec.deployment == name)
        .collect();

    let mut status = ModelDeploymentStatus {
        selector: Some(d.shard_selector()),
        observed_generation: generation,
        ..Default::default()
    };
    let (model, pool, strategy, footprint) = match validate(d, &observed) {
        Ok(inputs) => inputs,
        Err(blocked) => {
            ctx.metrics.placements.with_label_values(&["invalid"]).inc();
            if previous.iter().all(|c| c.reason != blocked.reason) {
                recorder
                    .publish(
                        &Event {
                            type_: EventType::Warning,
                            reason: blocked.reason.into(),
                            note: Some(truncate(&blocked.message)),
                            action: "Validate".into(),
                            secondary: None,
                        },
                        &reference,
                    )
                    .await?;
            }
            for (t, ok) in [
                (CONDITION_READY, false),
                (CONDITION_PLACED, false),
                (CONDITION_PROGRESSING, false),
            ] {
                conditions::set(
                    &mut status.conditions,
                    &previous,
                    t,
                    ok,
                    blocked.reason,
                    blocked.message.clone(),
                    generation,
                );
            }
            status.replicas = world::current_instances(&mine).len() as i32;
            write_status(ctx, &ns, &name, d, status).await?;
            // A missing Model, pool or strategy may be created any moment; watches bring it.
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    };

    let me = deployment_key(&ns, &name);
    let mut cluster = world::cluster(
        &me,
        &pool,
        &model,
        &observed.nodes,
        &observed.shards,
        &observed.models,
    );
    let current = world::current_instances(&mine);
    let planner_strategy = world::strategy(&strategy.spec);
    let request = placement::Request {
        deployment: &me,
        tier: match pool.spec.tier {
            Tier::Daily => placement::Tier::Daily,
            Tier::Reasoning => placement::Tier::Reasoning,
        },
        replicas: d.spec.replicas.max(0) as u32,
        footprint: &footprint,
        strategy: &planner_strategy,
        current: &current,
    };
    let plan = placement::plan(&mut cluster, &request);
    let desired = desired_shards(d, &model, &pool, &strategy, footprint.layers(), &plan);

    // Apply: create or update what the plan wants, delete the rest.
    let shards_api: Api<Shard> = Api::namespaced(ctx.client.clone(), &ns);
    let wanted: BTreeSet<String> = desired.iter().map(|s| s.name_any()).collect();
    let existing: BTreeMap<String, &Shard> = mine.iter().map(|s| (s.name_any(), *s)).collect();
    let mut changed = 0;
    for shard in &desired {
        let shard_name = shard.name_any();
        let unchanged = existing
            .get(&shard_name)
            .is_some_and(|s| s.spec == shard.spec && s.labels() == shard.labels());
        if unchanged {
            continue;
        }
        let mut patch = serde_json::to_value(shard).expect("a Shard serializes");
        patch["apiVersion"] = json!("shardplane.dev/v1alpha1");
        patch["kind"] = json!("Shard");
        patch.as_object_mut().expect("an object").remove("status");
        shards_api
            .patch(
                &shard_name,
                &PatchParams::apply(OPERATOR_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        changed += 1;
    }
    for stale in existing.keys().filter(|n| !wanted.contains(*n)) {
        shards_api.delete(stale, &DeleteParams::default()).await?;
        changed += 1;
    }
    if changed > 0 {
        let nodes: BTreeSet<&str> = plan
            .instances
            .iter()
            .flat_map(|i| i.stages.iter().map(|s| s.node.as_str()))
            .collect();
        recorder
            .publish(
                &Event {
                    type_: EventType::Normal,
                    reason: "Placed".into(),
                    note: Some(truncate(&format!(
                        "{} instances on nodes {}: {}",
                        plan.instances.len(),
                        nodes.into_iter().collect::<Vec<_>>().join(", "),
                        describe(&plan)
                    ))),
                    action: "Place".into(),
                    secondary: None,
                },
                &reference,
            )
            .await?;
    }

    // Status: instances, phases and conditions.
    let phases: BTreeMap<String, ShardPhase> = mine
        .iter()
        .filter_map(|s| Some((s.name_any(), s.status.as_ref()?.phase?)))
        .collect();
    for inst in &plan.instances {
        let stages: Vec<StageStatus> = inst
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let shard = shard_name(&name, inst.index, i, s);
                StageStatus {
                    phase: phases.get(&shard).copied(),
                    shard,
                    node: s.node.clone(),
                    layers: LayerRange {
                        start: s.layers.start,
                        end: s.layers.end,
                    },
                }
            })
            .collect();
        let ready = stages.iter().all(|s| s.phase == Some(ShardPhase::Ready));
        status.instances.push(InstanceStatus {
            index: inst.index,
            ready,
            stages,
        });
    }
    let replicas = request.replicas as i32;
    status.replicas = plan.instances.len() as i32;
    status.ready_replicas = status.instances.iter().filter(|i| i.ready).count() as i32;
    let failed: Vec<String> = mine
        .iter()
        .filter(|s| wanted.contains(&s.name_any()))
        .filter(|s| s.status.as_ref().and_then(|st| st.phase) == Some(ShardPhase::Failed))
        .map(|s| {
            let st = s.status.as_ref().expect("phase implies status");
            format!(
                "{} on {}: {}",
                s.name_any(),
                s.spec.node,
                st.message.clone().unwrap_or_default()
            )
        })
        .collect();
    let outcome = match (&plan.unplaced, plan.instances.is_empty()) {
        (None, _) => "placed",
        (Some(_), false) => "partial",
        (Some(_), true) => "unplaceable",
    };
    ctx.metrics.placements.with_label_values(&[outcome]).inc();
    match &plan.unplaced {
        None => conditions::set(
            &mut status.conditions,
            &previous,
            CONDITION_PLACED,
            true,
            "Placed",
            describe(&plan),
            generation,
        ),
        Some(why) => {
            conditions::set(
                &mut status.conditions,
                &previous,
                CONDITION_PLACED,
                false,
                why.reason.as_str(),
                why.message.clone(),
                generation,
            );
            if previous.iter().all(|c| c.message != why.message) {
                recorder
                    .publish(
                        &Event {
                            type_: EventType::Warning,
                            reason: why.reason.as_str().into(),
                            note: Some(truncate(&why.message)),
                            action: "Place".into(),
                            secondary: None,
                        },
                        &reference,
                    )
                    .await?;
            }
        }
    }
    let all_ready = status.ready_replicas >= replicas;
    let progressing = changed > 0
        || status
            .instances
            .iter()
            .any(|i| !i.ready && i.stages.iter().all(|s| s.phase != Some(ShardPhase::Failed)));
    let (ready_reason, ready_message) = if replicas == 0 {
        ("ScaledToZero", "no replicas requested".to_string())
    } else if all_ready {
        (
            "InstancesReady",
            format!("{} of {replicas} instances ready", status.ready_replicas),
        )
    } else if let Some(why) = &plan.unplaced {
        (why.reason.as_str(), why.message.clone())
    } else if !failed.is_empty() {
        ("ShardsFailed", failed.join("; "))
    } else {
        (
            "ShardsNotReady",
            format!(
                "{} of {replicas} instances ready; shards are fetching and loading",
                status.ready_replicas
            ),
        )
    };
    conditions::set(
        &mut status.conditions,
        &previous,
        CONDITION_READY,
        all_ready,
        ready_reason,
        ready_message.clone(),
        generation,
    );
    conditions::set(
        &mut status.conditions,
        &previous,
        CONDITION_PROGRESSING,
        progressing,
        if progressing {
            "ShardsStarting"
        } else {
            "Settled"
        },
        "",
        generation,
    );
    let degraded = replicas > 0
        && status.ready_replicas < replicas
        && (plan.unplaced.is_some() || !failed.is_empty() || status.ready_replicas > 0);
    conditions::set(
        &mut status.conditions,
        &previous,
        CONDITION_DEGRADED,
        degraded,
        if degraded { ready_reason } else { "AsExpected" },
        if degraded {
            ready_message
        } else {
            String::new()
        },
        generation,
    );
    write_status(ctx, &ns, &name, d, status).await?;
    Ok(if all_ready && plan.unplaced.is_none() {
        Action::requeue(Duration::from_secs(300))
    } else {
        Action::requeue(Duration::from_secs(10))
    })
}

fn describe(plan: &placement::Plan) -> String {
    plan.instances
        .iter()
        .map(|i| {
            let stages: Vec<String> = i
                .stages
                .iter()
                .map(|s| format!("{}[{}-{})", s.node, s.layers.start, s.layers.end))
                .collect();
            format!("instance {}: {}", i.index, stages.join(" -> "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn truncate(s: &str) -> String {
    if s.len() <= 1000 {
        return s.to_string();
    }
    let mut end = 1000;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

async fn write_status(
    ctx: &Context,
    ns: &str,
    name: &str,
    d: &ModelDeployment,
    status: ModelDeploymentStatus,
) -> Result<()> {
    if d.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<ModelDeployment> = Api::namespaced(ctx.client.clone(), ns);
    let patch = json!({"apiVersion": "shardplane.dev/v1alpha1", "kind": "ModelDeployment", "status": status});
    api.patch_status(
        name,
        &PatchParams::apply(OPERATOR_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}
