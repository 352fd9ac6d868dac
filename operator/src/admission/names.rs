//! A served name or alias belongs to one namespace (`shardplane_crds::names`:
//! the oldest claimant's). The webhook refuses a ModelDeployment that would
//! claim a name another namespace owns, at `kubectl apply`, instead of
//! letting it be created and marked `NameConflict`.
//!
//! ```text
//!  new spec ──► names it claims (its Model's served name, aliases)
//!           ──► owned by another namespace, and not already before this change? ──► 409
//! ```
//!
//! A Model whose served name changes later is not checked here; the
//! operator's `NameConflict` condition still covers it, and the gateway never
//! routes a name to a namespace that does not own it.

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, Operation};
use shardplane_crds::{GROUP, Model, ModelDeployment, names};

use super::review::Refusal;

/// The names `new` would claim that another namespace owns and that `old`
/// (its version before the change) did not already conflict on, each with
/// its owner (`namespace/name`).
pub fn new_conflicts(
    new: &ModelDeployment,
    old: Option<&ModelDeployment>,
    models: &[Model],
    deployments: &[ModelDeployment],
) -> Vec<(String, String)> {
    let served = |d: &ModelDeployment| {
        models
            .iter()
            .find(|m| m.namespace() == d.namespace() && m.name_any() == d.spec.model)
            .map(|m| m.served_name().to_string())
    };
    let others: Vec<(&ModelDeployment, Vec<String>)> = deployments
        .iter()
        .filter(|o| o.namespace() != new.namespace() || o.name_any() != new.name_any())
        .map(|o| (o, names::claims(o, served(o).as_deref())))
        .collect();
    let conflicts = |d: &ModelDeployment| {
        let mine = names::claims(d, served(d).as_deref());
        names::conflicts(d, &mine, &others)
    };
    let before = old.map(conflicts).unwrap_or_default();
    conflicts(new)
        .into_iter()
        .filter(|c| !before.contains(c))
        .collect()
}

/// The refusal for `conflicts`.
pub fn refusal(name: &str, conflicts: &[(String, String)]) -> Refusal {
    let parts: Vec<String> = conflicts
        .iter()
        .map(|(n, owner)| format!("the name {n:?} is served by {owner} in another namespace"))
        .collect();
    Refusal {
        code: 409,
        reason: "Conflict",
        message: format!(
            "ModelDeployment.{GROUP} {name:?} cannot claim a name another namespace owns: {} \
             (choose other aliases, or a Model with another servedName)",
            parts.join("; ")
        ),
    }
}

fn typed(object: Option<&DynamicObject>) -> Option<ModelDeployment> {
    serde_json::to_value(object?)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
}

/// Checks a ModelDeployment's create or update against every deployment and
/// Model in the cluster (read from the API server). Other requests, and any
/// the API server cannot answer for, pass: the operator's `NameConflict`
/// condition is the check behind this one.
pub async fn check(
    client: &kube::Client,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Refusal> {
    let is_deployment = request.resource.group == GROUP
        && request.resource.resource == "modeldeployments"
        && request.sub_resource.is_none()
        && matches!(request.operation, Operation::Create | Operation::Update);
    if !is_deployment {
        return Ok(());
    }
    let Some(new) = typed(request.object.as_ref()) else {
        return Ok(());
    };
    let old = typed(request.old_object.as_ref());
    if old.as_ref().is_some_and(|o| o.spec == new.spec) {
        return Ok(());
    }
    let list = ListParams::default();
    let (model_api, deployment_api) = (
        Api::<Model>::all(client.clone()),
        Api::<ModelDeployment>::all(client.clone()),
    );
    let (models, deployments) = tokio::join!(model_api.list(&list), deployment_api.list(&list));
    let (models, deployments) = match (models, deployments) {
        (Ok(m), Ok(d)) => (m.items, d.items),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "cannot list deployments to check served names; the operator checks them");
            return Ok(());
        }
    };
    let conflicts = new_conflicts(&new, old.as_ref(), &models, &deployments);
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(refusal(&new.name_any(), &conflicts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    fn deployment(
        ns: &str,
        name: &str,
        model: &str,
        aliases: &[&str],
        created: Option<i64>,
    ) -> ModelDeployment {
        let mut d: ModelDeployment = serde_json::from_value(json!({
            "apiVersion": "shardplane.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": { "name": name, "namespace": ns },
            "spec": { "model": model, "nodePool": "p", "strategy": "s", "aliases": aliases },
        }))
        .unwrap();
        d.metadata.creation_timestamp =
            created.map(|s| Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap()));
        d
    }

    fn model(ns: &str, name: &str, served: &str) -> Model {
        serde_json::from_value(json!({
            "apiVersion": "shardplane.dev/v1alpha1",
            "kind": "Model",
            "metadata": { "name": name, "namespace": ns },
            "spec": { "format": "gguf", "servedName": served, "source": { "path": { "path": "/m.gguf" } } },
        }))
        .unwrap()
    }

    #[test]
    fn a_name_another_namespace_owns_is_refused_a_new_claimant() {
        let models = [model("team-a", "m", "llama"), model("team-b", "m", "llama")];
        let owner = deployment("team-a", "d", "m", &["chat"], Some(100));
        let all = [owner.clone()];
        // Its Model's served name, and an alias, are owned by team-a.
        let late = deployment("team-b", "x", "m", &["chat", "mine"], None);
        let found = new_conflicts(&late, None, &models, &all);
        assert_eq!(
            found,
            [
                ("chat".to_string(), "team-a/d".to_string()),
                ("llama".to_string(), "team-a/d".to_string())
            ]
        );
        let r = refusal("x", &found);
        assert_eq!((r.code, r.reason), (409, "Conflict"));
        assert!(
            r.message
                .contains("the name \"chat\" is served by team-a/d in another namespace"),
            "{}",
            r.message
        );
        // The same namespace may share it; a free name passes.
        assert!(
            new_conflicts(
                &deployment("team-a", "y", "m", &["chat"], None),
                None,
                &models,
                &all
            )
            .is_empty()
        );
        assert!(
            new_conflicts(
                &deployment("team-c", "z", "none", &["free"], None),
                None,
                &models,
                &all
            )
            .is_empty()
        );
        // The owner itself, updated, conflicts with nobody.
        let mut more = owner.clone();
        more.spec.replicas = 3;
        assert!(new_conflicts(&more, Some(&owner), &models, &all).is_empty());
    }

    #[test]
    fn an_old_conflict_does_not_block_other_changes_but_a_new_one_does() {
        let models = [model("team-a", "m", "llama")];
        let owner = deployment("team-a", "d", "m", &["chat"], Some(100));
        // Made before the webhook: already claims "chat" in team-b.
        let late = deployment("team-b", "x", "other", &["chat"], Some(200));
        let all = [owner, late.clone()];
        let mut scaled = late.clone();
        scaled.spec.replicas = 2;
        assert!(new_conflicts(&scaled, Some(&late), &models, &all).is_empty());
        let mut grabbing = late.clone();
        grabbing.spec.model = "m".into();
        grabbing.metadata.namespace = Some("team-b".into());
        let models = [model("team-a", "m", "llama"), model("team-b", "m", "llama")];
        assert_eq!(
            new_conflicts(&grabbing, Some(&late), &models, &all),
            [("llama".to_string(), "team-a/d".to_string())]
        );
    }
}
