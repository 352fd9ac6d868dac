//! Status: a pure function of what was observed, planned and applied. The
//! reconcile writes it once, from one place.

use std::collections::BTreeMap;

use kube::ResourceExt;
use shardplane_crds::*;

use super::cluster_view::current_instances;
use super::plan::{Planned, describe, named_stages};
use super::validate::Blocked;
use crate::conditions;

/// The `Conflicted` reason while another namespace owns a name this
/// deployment claims.
pub const NAME_CONFLICT: &str = "NameConflict";

/// The `Progressing` reason while a stage moved off a failing node starts.
pub const STAGE_MOVED: &str = "StageMoved";

fn base(d: &ModelDeployment) -> ModelDeploymentStatus {
    ModelDeploymentStatus {
        selector: Some(d.shard_selector()),
        observed_generation: d.metadata.generation,
        ..Default::default()
    }
}

fn previous(d: &ModelDeployment) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    d.status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default()
}

/// The status of a deployment that cannot be planned.
pub fn blocked(d: &ModelDeployment, mine: &[&Shard], why: &Blocked) -> ModelDeploymentStatus {
    let previous = previous(d);
    let mut status = base(d);
    for t in [CONDITION_READY, CONDITION_PLACED, CONDITION_PROGRESSING] {
        conditions::set(
            &mut status.conditions,
            &previous,
            t,
            false,
            why.reason,
            why.message.clone(),
            d.metadata.generation,
        );
    }
    status.replicas = current_instances(mine).len() as i32;
    status
}

/// The status of a planned deployment: its instances with their stages'
/// phases, where clients reach it, and the conditions `Placed`, `Ready`,
/// `Progressing`, `Degraded`. `changed` counts the Shards just created,
/// updated or deleted.
pub fn planned(
    d: &ModelDeployment,
    mine: &[&Shard],
    planned: &Planned,
    changed: usize,
    endpoint: Option<DeploymentEndpoint>,
) -> ModelDeploymentStatus {
    let previous = previous(d);
    let generation = d.metadata.generation;
    let name = d.name_any();
    let plan = &planned.plan;
    let mut status = base(d);
    status.endpoint = endpoint;
    let phases: BTreeMap<String, ShardPhase> = mine
        .iter()
        .filter_map(|s| Some((s.name_any(), s.status.as_ref()?.phase?)))
        .collect();
    for inst in &plan.instances {
        let stages: Vec<StageStatus> = named_stages(&name, inst)
            .into_iter()
            .flatten()
            .map(|(s, shard)| StageStatus {
                phase: phases.get(&shard).copied(),
                shard,
                node: s.node.clone(),
                layers: LayerRange {
                    start: s.layers.start,
                    end: s.layers.end,
                },
                tensor_rank: s.tensor.as_ref().map(|t| t.rank),
            })
            .collect();
        let ready = stages.iter().all(|s| s.phase == Some(ShardPhase::Ready));
        status.instances.push(InstanceStatus {
            index: inst.index,
            ready,
            stages,
        });
    }
    let replicas = planned.replicas as i32;
    status.replicas = plan.instances.len() as i32;
    status.ready_replicas = status.instances.iter().filter(|i| i.ready).count() as i32;
    let wanted: Vec<&str> = planned
        .desired
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    let failed: Vec<String> = mine
        .iter()
        .filter(|s| wanted.contains(&s.name_any().as_str()))
        .filter_map(|s| {
            let st = s.status.as_ref()?;
            (st.phase == Some(ShardPhase::Failed)).then(|| {
                format!(
                    "{} on {}: {}",
                    s.name_any(),
                    s.spec.node,
                    st.message.clone().unwrap_or_default()
                )
            })
        })
        .collect();
    let set =
        |status: &mut ModelDeploymentStatus, t: &str, ok: bool, reason: &str, message: String| {
            conditions::set(
                &mut status.conditions,
                &previous,
                t,
                ok,
                reason,
                message,
                generation,
            )
        };
    match &plan.unplaced {
        None => set(
            &mut status,
            CONDITION_PLACED,
            true,
            "Placed",
            describe(plan),
        ),
        Some(why) => set(
            &mut status,
            CONDITION_PLACED,
            false,
            why.reason.as_str(),
            why.message.clone(),
        ),
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
    set(
        &mut status,
        CONDITION_READY,
        all_ready,
        ready_reason,
        ready_message.clone(),
    );
    // A stage moved off a node where it kept failing says so until the
    // deployment settles.
    let moved_before = previous
        .iter()
        .find(|c| c.type_ == CONDITION_PROGRESSING && c.reason == STAGE_MOVED)
        .map(|c| c.message.clone());
    let (reason, message) = match (progressing, planned.moved.is_empty(), moved_before) {
        (true, false, _) => (STAGE_MOVED, planned.moved.join("; ")),
        (true, true, Some(before)) => (STAGE_MOVED, before),
        // Shards kept until their replacements are Ready say so.
        (true, true, None) => (
            "ShardsStarting",
            planned
                .retiring
                .keep
                .iter()
                .map(|(_, why)| why.as_str())
                .collect::<Vec<_>>()
                .join("; "),
        ),
        (false, _, _) => ("Settled", String::new()),
    };
    set(
        &mut status,
        CONDITION_PROGRESSING,
        progressing,
        reason,
        message,
    );
    let degraded = replicas > 0
        && status.ready_replicas < replicas
        && (plan.unplaced.is_some() || !failed.is_empty() || status.ready_replicas > 0);
    set(
        &mut status,
        CONDITION_DEGRADED,
        degraded,
        if degraded { ready_reason } else { "AsExpected" },
        if degraded {
            ready_message
        } else {
            String::new()
        },
    );
    status
}

/// The `Conflicted` condition: True (reason `NameConflict`) while another
/// namespace owns names this deployment claims, naming each and its owner.
pub fn conflicts(
    status: &mut ModelDeploymentStatus,
    d: &ModelDeployment,
    taken: &[(String, String)],
) {
    let (reason, message) = if taken.is_empty() {
        ("NoConflicts", String::new())
    } else {
        (
            NAME_CONFLICT,
            format!(
                "{}: a name belongs to the namespace whose deployment claimed it first, and \
                 this deployment is not served under it; choose other aliases (or another \
                 servedName on the Model)",
                taken
                    .iter()
                    .map(|(name, owner)| format!("{name:?} is served by {owner}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    };
    conditions::set(
        &mut status.conditions,
        &previous(d),
        CONDITION_CONFLICTED,
        !taken.is_empty(),
        reason,
        message,
        d.metadata.generation,
    );
}
