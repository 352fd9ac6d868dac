//! Apply: the Shards the plan wants, by server-side apply; the ones it no
//! longer wants, deleted; and events a person reads with `kubectl describe`.

use std::collections::BTreeMap;

use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use shardplane_crds::{ModelDeployment, OPERATOR_MANAGER, Shard};

use super::super::Context;
use crate::error::Result;

/// Makes the deployment's Shards `desired`: creates or updates what differs
/// and deletes `retired` (the Shards of `mine` it no longer wants that may
/// go now). Returns how many Shards changed.
pub async fn shards(
    ctx: &Context,
    d: &ModelDeployment,
    mine: &[&Shard],
    desired: &[Shard],
    retired: &[String],
) -> Result<usize> {
    let api: Api<Shard> = Api::namespaced(ctx.client.clone(), &d.namespace().unwrap_or_default());
    let existing: BTreeMap<String, &Shard> = mine.iter().map(|s| (s.name_any(), *s)).collect();
    let mut changed = 0;
    for shard in desired {
        let name = shard.name_any();
        let unchanged = existing
            .get(&name)
            .is_some_and(|s| s.spec == shard.spec && s.labels() == shard.labels());
        if unchanged {
            continue;
        }
        let mut patch = serde_json::to_value(shard).expect("a Shard serializes");
        patch["apiVersion"] = json!(Shard::api_version(&()));
        patch["kind"] = json!(Shard::kind(&()));
        patch.as_object_mut().expect("an object").remove("status");
        ctx.fence()?;
        api.patch(
            &name,
            &PatchParams::apply(OPERATOR_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
        changed += 1;
    }
    for stale in retired.iter().filter(|n| existing.contains_key(*n)) {
        ctx.fence()?;
        delete(&api, stale).await?;
        changed += 1;
    }
    Ok(changed)
}

/// Deletes every Shard in `shards` (the deployment is going away; the test
/// API server has no garbage collector, so owner references alone would
/// leave them behind there).
pub async fn delete_all(ctx: &Context, d: &ModelDeployment, shards: &[&Shard]) -> Result<()> {
    let api: Api<Shard> = Api::namespaced(ctx.client.clone(), &d.namespace().unwrap_or_default());
    for s in shards {
        ctx.fence()?;
        delete(&api, &s.name_any()).await?;
    }
    Ok(())
}

async fn delete(api: &Api<Shard>, name: &str) -> Result<()> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        // Gone already (the store lags the API server by a moment).
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Publishes an event about `d`.
pub async fn event(
    ctx: &Context,
    d: &ModelDeployment,
    warning: bool,
    reason: &str,
    action: &str,
    note: &str,
) -> Result<()> {
    let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
    recorder
        .publish(
            &Event {
                type_: if warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: reason.into(),
                note: Some(truncate(note)),
                action: action.into(),
                secondary: None,
            },
            &d.object_ref(&()),
        )
        .await?;
    Ok(())
}

/// Event notes are bounded.
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
