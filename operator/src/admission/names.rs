//! A served name or alias belongs to one namespace (`shardplane_crds::names`:
//! the oldest claimant's). The webhook refuses a ModelDeployment, or a
//! Model's new served name, that would claim a name another namespace owns,
//! at `kubectl apply`, instead of letting it be created and marked
//! `NameConflict`.
//!
//! ```text
//!  new spec ──► names it claims (its Model's served name, aliases)
//!           ──► owned by another namespace, and not already before this change? ──► 409
//!  Model's new servedName ──► the same, for each deployment of that Model
//! ```
//!
//! The operator's `NameConflict` condition stays the check behind this one
//! (objects made before the webhook, a list the API server could not
//! answer), and the gateway never routes a name to a namespace that does not
//! own it.

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, Operation};
use shardplane_crds::{GROUP, Model, ModelDeployment, names};

use super::review::Refusal;

/// The names `d` claims that another namespace owns, with their owners,
/// given every Model and deployment (`d` itself among them or not).
fn conflicts_of(
    d: &ModelDeployment,
    models: &[&Model],
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
        .filter(|o| o.namespace() != d.namespace() || o.name_any() != d.name_any())
        .map(|o| (o, names::claims(o, served(o).as_deref())))
        .collect();
    let mine = names::claims(d, served(d).as_deref());
    names::conflicts(d, &mine, &others)
}

/// The names `new` would claim that another namespace owns and that `old`
/// (its version before the change) did not already conflict on, each with
/// its owner (`namespace/name`).
pub fn new_conflicts(
    new: &ModelDeployment,
    old: Option<&ModelDeployment>,
    models: &[Model],
    deployments: &[ModelDeployment],
) -> Vec<(String, String)> {
    let models: Vec<&Model> = models.iter().collect();
    let before = old
        .map(|o| conflicts_of(o, &models, deployments))
        .unwrap_or_default();
    conflicts_of(new, &models, deployments)
        .into_iter()
        .filter(|c| !before.contains(c))
        .collect()
}

/// For a Model created or changed (its served name): the names its
/// deployments would newly claim that another namespace owns, with owners.
pub fn model_conflicts(
    new: &Model,
    old: Option<&Model>,
    models: &[Model],
    deployments: &[ModelDeployment],
) -> Vec<(String, String)> {
    let same = |m: &Model| m.namespace() == new.namespace() && m.name_any() == new.name_any();
    let rest = models.iter().filter(|m| !same(m));
    let after: Vec<&Model> = rest.clone().chain(std::iter::once(new)).collect();
    let before: Vec<&Model> = rest.chain(old).collect();
    let mut found: Vec<(String, String)> = deployments
        .iter()
        .filter(|d| d.namespace() == new.namespace() && d.spec.model == new.name_any())
        .flat_map(|d| {
            let earlier = conflicts_of(d, &before, deployments);
            conflicts_of(d, &after, deployments)
                .into_iter()
                .filter(move |c| !earlier.contains(c))
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

/// The refusal for `conflicts`.
pub fn refusal(kind: &str, name: &str, conflicts: &[(String, String)]) -> Refusal {
    let parts: Vec<String> = conflicts
        .iter()
        .map(|(n, owner)| format!("the name {n:?} is served by {owner} in another namespace"))
        .collect();
    Refusal {
        code: 409,
        reason: "Conflict",
        message: format!(
            "{kind}.{GROUP} {name:?} cannot claim a name another namespace owns: {} \
             (choose other aliases, or another servedName)",
            parts.join("; ")
        ),
    }
}

/// Held while a check lists deployments and Models.
static LISTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn typed<K: serde::de::DeserializeOwned>(object: Option<&DynamicObject>) -> Option<K> {
    serde_json::to_value(object?)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
}

/// Checks a ModelDeployment's create or update, or a Model's served name,
/// against every deployment and Model in the cluster (read from the API
/// server). Other requests, and any the API server cannot answer for, pass:
/// the operator's `NameConflict` condition is the check behind this one.
pub async fn check(
    client: &kube::Client,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Refusal> {
    let relevant = request.resource.group == GROUP
        && request.sub_resource.is_none()
        && matches!(request.operation, Operation::Create | Operation::Update);
    if !relevant {
        return Ok(());
    }
    enum Changed {
        Deployment(Box<(ModelDeployment, Option<ModelDeployment>)>),
        Model(Box<(Model, Option<Model>)>),
    }
    let changed = match request.resource.resource.as_str() {
        "modeldeployments" => {
            let Some(new) = typed::<ModelDeployment>(request.object.as_ref()) else {
                return Ok(());
            };
            let old = typed::<ModelDeployment>(request.old_object.as_ref());
            if old.as_ref().is_some_and(|o| o.spec == new.spec) {
                return Ok(());
            }
            Changed::Deployment(Box::new((new, old)))
        }
        "models" => {
            let Some(new) = typed::<Model>(request.object.as_ref()) else {
                return Ok(());
            };
            let old = typed::<Model>(request.old_object.as_ref());
            if old
                .as_ref()
                .is_some_and(|o| o.served_name() == new.served_name())
            {
                return Ok(());
            }
            Changed::Model(Box::new((new, old)))
        }
        _ => return Ok(()),
    };
    // One check lists at a time: whoever reaches the webhook (it does not
    // know its caller) cannot turn requests into a storm of LISTs.
    let _one = LISTING.lock().await;
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
    let (kind, name, conflicts) = match &changed {
        Changed::Deployment(pair) => (
            "ModelDeployment",
            pair.0.name_any(),
            new_conflicts(&pair.0, pair.1.as_ref(), &models, &deployments),
        ),
        Changed::Model(pair) => (
            "Model",
            pair.0.name_any(),
            model_conflicts(&pair.0, pair.1.as_ref(), &models, &deployments),
        ),
    };
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(refusal(kind, &name, &conflicts))
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
        let r = refusal("ModelDeployment", "x", &found);
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
    fn a_model_may_not_take_a_served_name_another_namespace_owns() {
        let owner_model = model("team-a", "m", "llama");
        let mine = model("team-b", "n", "mistral");
        let models = [owner_model.clone(), mine.clone()];
        let all = [
            deployment("team-a", "d", "m", &[], Some(100)),
            deployment("team-b", "x", "n", &[], Some(200)),
        ];
        let renamed = model("team-b", "n", "llama");
        assert_eq!(
            model_conflicts(&renamed, Some(&mine), &models, &all),
            [("llama".to_string(), "team-a/d".to_string())]
        );
        // Unused, or renamed to a free name: nothing to refuse.
        assert!(
            model_conflicts(&model("team-b", "unused", "llama"), None, &models, &all).is_empty()
        );
        assert!(
            model_conflicts(&model("team-b", "n", "free"), Some(&mine), &models, &all).is_empty()
        );
        // The owner's own Model may keep or change its name.
        assert!(
            model_conflicts(
                &model("team-a", "m", "llama"),
                Some(&owner_model),
                &models,
                &all
            )
            .is_empty()
        );
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
