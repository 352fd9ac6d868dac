//! `Model`: fills status with what placement needs, read from the weights.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::Store;
use kube::{Api, ResourceExt};
use shardplane_crds::validation::Validate;
use shardplane_crds::{
    CONDITION_READY, CONDITION_RESOLVED, HUGGING_FACE_TOKEN_LABEL, InferenceNode, Model,
    ModelFormat, ModelSource, ModelStatus, OPERATOR_MANAGER,
};

use super::{Context, instrumented, retry_after_error};
use crate::caches::Caches;
use crate::conditions;
use crate::error::{Error, Result};
use shardplane_models::{
    Unresolved, hub, hugging_face_url, off_runtime, resolve_gguf_url, resolve_path, safetensors,
};

/// The Model controller.
pub fn controller(caches: &Caches) -> Controller<Model> {
    Controller::for_shared_stream(caches.models.subscribe(), caches.models.store.clone())
}

/// Runs the Model controller until the stream ends.
pub async fn run(controller: Controller<Model>, ctx: Arc<Context>) {
    controller
        .shutdown_on_signal()
        .run(
            |m, ctx| async move { instrumented(&ctx, "model", reconcile(m, ctx.clone())).await },
            retry_after_error,
            ctx,
        )
        .for_each(|_| async {})
        .await;
}

async fn resolve(model: &Model, ctx: &Context) -> Result<ModelStatus, Unresolved> {
    if let Err(e) = model.validate() {
        return Err(Unresolved {
            reason: "InvalidSpec",
            message: e.to_string(),
        });
    }
    let spec = &model.spec;
    match (&spec.source, spec.format) {
        // Read on a blocking thread: a hostile file never stalls the others.
        (ModelSource::Path(p), format) if ctx.read_model_paths => {
            let (path, spec) = (p.path.clone(), spec.clone());
            off_runtime(&p.path, move || {
                resolve_path(Path::new(&path), format, &spec)
            })
            .await?
        }
        (ModelSource::Path(p), _) => match model.status.as_ref().filter(|s| reported(s)) {
            // An agent holding the file read its header: keep what it wrote.
            Some(status) => Ok(ModelStatus {
                conditions: Vec::new(),
                ..status.clone()
            }),
            None => Err(Unresolved {
                reason: "WaitingForAgent",
                message: format!(
                    "no agent has reported {} yet: the model must be at that path on the nodes (agents read its header)",
                    p.path
                ),
            }),
        },
        (ModelSource::Url(u), _) => resolve_gguf_url(&ctx.http, &u.url, spec).await,
        (ModelSource::HuggingFace(hf), format) => {
            // Resolved once per spec: the commit goes into status and every
            // node fetches that commit (`Model::pinned_source`).
            let endpoint = &ctx.hugging_face_endpoint;
            // The Model's own token, when it names one, else the operator's.
            let own;
            let http = match &hf.token_secret_ref {
                Some(r) => {
                    let ns = model.namespace().unwrap_or_default();
                    let label = HUGGING_FACE_TOKEN_LABEL;
                    let token = shardplane_cluster::secrets::read_opted_in(
                        &ctx.client,
                        &ns,
                        &r.name,
                        &r.key,
                        label,
                    )
                    .await
                    .map_err(|e| Unresolved {
                        reason: e.reason(),
                        message: format!("the Model's tokenSecretRef: {e}"),
                    })?;
                    own = hub::api_client(Some(&token)).map_err(|e| Unresolved {
                        reason: "InvalidToken",
                        message: format!("the Model's tokenSecretRef: {e}"),
                    })?;
                    &own
                }
                None => &ctx.hub_http,
            };
            // Once: the commit recorded for this spec stays (an operator
            // restart does not follow a branch that moved since).
            let recorded = model
                .status
                .as_ref()
                .filter(|s| s.observed_generation == model.metadata.generation)
                .and_then(|s| s.resolved_revision.clone());
            let asked = recorded.as_deref().or(hf.revision.as_deref());
            let revision = hub::resolve_revision(http, endpoint, &hf.repo, asked).await?;
            let commit = Some(revision.commit.as_str());
            let mut status = match format {
                ModelFormat::Gguf => {
                    let file = hf.file.as_deref().unwrap_or_default();
                    let entry = revision.file(&hf.repo, file)?;
                    let url = hugging_face_url(endpoint, &hf.repo, file, commit);
                    let mut status = resolve_gguf_url(http, &url, spec).await?;
                    status.sha256 = entry.sha256.clone();
                    status.total_bytes = entry.size.or(status.total_bytes);
                    status
                }
                ModelFormat::Safetensors => {
                    let base = hugging_face_url(endpoint, &hf.repo, "", commit);
                    safetensors::resolve_repo(http, base.trim_end_matches('/'), spec).await?
                }
            };
            status.resolved_revision = Some(revision.commit);
            Ok(status)
        }
    }
}

/// Whether an agent reported the model's metadata into its status.
fn reported(status: &ModelStatus) -> bool {
    status.architecture.is_some()
        && status
            .layers
            .is_some_and(|l| l as usize == status.layer_bytes.len())
}

/// How often a Model an agent reported is looked at again: its reporter
/// may have been deleted since.
const REPORTER_CHECK: Duration = Duration::from_secs(60);

/// Whether an agent reports `model`'s metadata (a `path` the operator
/// does not read itself).
fn agent_reported(model: &Model, read_model_paths: bool) -> bool {
    !read_model_paths && matches!(model.spec.source, ModelSource::Path(_))
}

/// Why a node's report of a path Model is let go, and what goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Release {
    /// Its node has no InferenceNode any more (deleted by its
    /// administrators, or revoked). The metadata stays (the same spec: the
    /// next node holding the file reports the same, presumably), so the
    /// Model stays resolved meanwhile.
    NodeGone(String),
    /// The spec changed since the report (another path, say, which the
    /// reporter may not hold). The metadata goes too, so nothing is
    /// resolved from the old spec's file, and the generation is marked
    /// seen: the reporter's node may report again for the new spec without
    /// being released once more.
    SpecChanged(String),
}

impl Release {
    fn why(&self) -> &str {
        match self {
            Release::NodeGone(why) | Release::SpecChanged(why) => why,
        }
    }

    /// The merge patch of `model`'s status that lets go, conditional on the
    /// resource version the reconcile read (a report made since is not
    /// undone).
    fn patch(&self, model: &Model) -> serde_json::Value {
        let mut status = serde_json::Map::new();
        if let Release::SpecChanged(_) = self {
            let reported = model
                .status
                .as_ref()
                .and_then(|s| serde_json::to_value(s).ok());
            if let Some(serde_json::Value::Object(fields)) = reported {
                for key in fields.keys() {
                    if key != "conditions" && key != "observedGeneration" {
                        status.insert(key.clone(), serde_json::Value::Null);
                    }
                }
            }
            status.insert(
                "observedGeneration".into(),
                serde_json::json!(model.metadata.generation),
            );
        }
        status.insert("reportedBy".into(), serde_json::Value::Null);
        serde_json::json!({
            "metadata": { "resourceVersion": model.resource_version() },
            "status": status,
        })
    }
}

/// Whether `model`'s reporter should let go of it, and why.
fn release(model: &Model, read_model_paths: bool, nodes: &Store<InferenceNode>) -> Option<Release> {
    if !agent_reported(model, read_model_paths) {
        return None;
    }
    let status = model.status.as_ref()?;
    // A changed spec first, whoever reported (the reporter may be gone too,
    // or already released): the old file's metadata must not resolve it.
    // With no generation seen yet (an agent reported before the operator
    // wrote any status), anything past the first is a change.
    let behind = match status.observed_generation {
        Some(seen) => Some(seen) != model.metadata.generation,
        None => model.metadata.generation.is_some_and(|g| g > 1),
    };
    if behind && (status.reported_by.is_some() || reported(status)) {
        let by = match status.reported_by.as_deref() {
            Some(node) => format!("node {node}"),
            None => "a node".into(),
        };
        return Some(Release::SpecChanged(format!(
            "its spec changed since {by} reported it"
        )));
    }
    let reporter = status.reported_by.as_deref()?;
    if nodes
        .get(&kube::runtime::reflector::ObjectRef::new(reporter))
        .is_none()
    {
        return Some(Release::NodeGone(format!(
            "node {reporter}, which reported it, is gone"
        )));
    }
    None
}

/// The part of an agent-reported Model's status the operator writes: its
/// conditions and generation. The metadata stays the reporting agent's
/// alone, so a field the next reporter's file lacks does not linger under
/// the operator's name.
fn operators_part(status: &ModelStatus) -> ModelStatus {
    ModelStatus {
        conditions: status.conditions.clone(),
        observed_generation: status.observed_generation,
        ..ModelStatus::default()
    }
}

async fn reconcile(model: Arc<Model>, ctx: Arc<Context>) -> Result<Action> {
    let name = model.name_any();
    let ns = model
        .namespace()
        .ok_or_else(|| Error::MissingField(format!("Model {name}"), "namespace"))?;
    // Another node holding the file may report it now (the webhook lets a
    // node change only its own report, and the agents leave others' alone).
    // Only the object this reconcile read is changed: a report made since
    // (the resource version moved) is not undone.
    if let Some(release) = release(&model, ctx.read_model_paths, &ctx.stores.nodes) {
        let api: Api<Model> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.fence()?;
        let cleared = api
            .patch_status(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&release.patch(&model)),
            )
            .await;
        return match cleared {
            Ok(_) => {
                let why = release.why();
                tracing::info!(model = %name, %why, "released the model's report: a node holding the file reports it again");
                Ok(Action::await_change())
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                Ok(Action::requeue(Duration::from_secs(1)))
            }
            Err(e) => Err(e.into()),
        };
    }
    let generation = model.metadata.generation;
    let previous = model
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let (mut status, requeue) = match resolve(&model, &ctx).await {
        Ok(mut status) => {
            let how = match &model.spec.source {
                ModelSource::Path(_) if !ctx.read_model_paths => "ReportedByAgent",
                _ => "HeaderRead",
            };
            let pinned = status
                .resolved_revision
                .as_ref()
                .map(|c| format!("revision resolved to commit {c}"))
                .unwrap_or_default();
            conditions::set(
                &mut status.conditions,
                &previous,
                CONDITION_RESOLVED,
                true,
                how,
                pinned,
                generation,
            );
            conditions::set(
                &mut status.conditions,
                &previous,
                CONDITION_READY,
                true,
                "Resolved",
                "",
                generation,
            );
            let again = match status.reported_by {
                Some(_) => Action::requeue(REPORTER_CHECK),
                None => Action::await_change(),
            };
            (status, again)
        }
        Err(why) => {
            tracing::info!(model = %name, reason = why.reason, message = %why.message, "model not resolved");
            let mut status = ModelStatus::default();
            conditions::set(
                &mut status.conditions,
                &previous,
                CONDITION_RESOLVED,
                false,
                why.reason,
                why.message.clone(),
                generation,
            );
            conditions::set(
                &mut status.conditions,
                &previous,
                CONDITION_READY,
                false,
                why.reason,
                why.message,
                generation,
            );
            // The file may appear later (copied to the node, mount attached).
            (status, Action::requeue(Duration::from_secs(30)))
        }
    };
    status.observed_generation = generation;
    let current = model.status.clone();
    let (written, current) = if agent_reported(&model, ctx.read_model_paths) {
        (
            operators_part(&status),
            current.as_ref().map(operators_part),
        )
    } else {
        (status, current)
    };
    if current.as_ref() != Some(&written) {
        let api: Api<Model> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.fence()?;
        shardplane_cluster::apply_status(&api, &name, OPERATOR_MANAGER, &written).await?;
    }
    Ok(requeue)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::{reflector, watcher};

    #[test]
    fn a_path_models_report_is_released_when_its_node_is_deleted_or_its_spec_changes() {
        let (nodes, mut writer) = reflector::store::<InferenceNode>();
        writer.apply_watcher_event(&watcher::Event::Apply(
            shardplane_testkit::fixtures::inference_node("node-a"),
        ));
        let mut model = shardplane_testkit::fixtures::model("m");
        model.metadata.generation = Some(2);
        let by = |model: &Model, node: &str, seen: i64| {
            let mut m = model.clone();
            m.status = Some(ModelStatus {
                reported_by: Some(node.into()),
                observed_generation: Some(seen),
                ..ModelStatus::default()
            });
            m
        };
        assert_eq!(release(&by(&model, "node-a", 2), false, &nodes), None);
        let gone_from = by(&model, "node-b", 2);
        let gone = release(&gone_from, false, &nodes).unwrap();
        assert!(
            gone.why()
                .contains("node node-b, which reported it, is gone"),
            "{gone:?}"
        );
        // Only the reporter goes: the metadata of the same spec stays.
        model.metadata.resource_version = Some("7".into());
        let mut reported = by(&model, "node-a", 1);
        reported.status.as_mut().unwrap().layers = Some(30);
        let status = reported.status.as_mut().unwrap();
        conditions::set(
            &mut status.conditions,
            &[],
            CONDITION_RESOLVED,
            true,
            "ReportedByAgent",
            "",
            Some(1),
        );
        assert_eq!(
            gone.patch(&reported),
            serde_json::json!({
                "metadata": { "resourceVersion": "7" },
                "status": { "reportedBy": null },
            })
        );
        let changed = release(&reported, false, &nodes).unwrap();
        assert!(changed.why().contains("spec changed"), "{changed:?}");
        // A changed spec takes the old file's metadata too, and marks the
        // generation seen (the reporter may report the new spec's).
        assert_eq!(
            changed.patch(&reported),
            serde_json::json!({
                "metadata": { "resourceVersion": "7" },
                "status": {
                    "layers": null,
                    "reportedBy": null,
                    "observedGeneration": 2,
                },
            })
        );
        let mut seen = reported.clone();
        seen.status.as_mut().unwrap().observed_generation = Some(2);
        assert_eq!(release(&seen, false, &nodes), None);
        // A changed spec wins over a gone reporter, and its metadata goes even
        // when the reporter was already let go (deleted, then the spec changed).
        let mut gone_and_changed = reported.clone();
        gone_and_changed.status.as_mut().unwrap().reported_by = Some("node-b".into());
        assert!(matches!(
            release(&gone_and_changed, false, &nodes),
            Some(Release::SpecChanged(_))
        ));
        let mut let_go = reported.clone();
        let s = let_go.status.as_mut().unwrap();
        s.reported_by = None;
        s.architecture = Some("llama".into());
        s.layer_bytes = vec![1; 30];
        assert!(matches!(
            release(&let_go, false, &nodes),
            Some(Release::SpecChanged(_))
        ));
        // Reported before the operator saw any generation: the first one is
        // the report's own, a later one a change.
        let mut unseen = reported.clone();
        unseen.status.as_mut().unwrap().observed_generation = None;
        assert!(matches!(
            release(&unseen, false, &nodes),
            Some(Release::SpecChanged(_))
        ));
        unseen.metadata.generation = Some(1);
        assert_eq!(release(&unseen, false, &nodes), None);
        // Read by the operator itself, or not a path, or not reported yet.
        assert_eq!(release(&by(&model, "node-b", 2), true, &nodes), None);
        assert_eq!(release(&model, false, &nodes), None);
        let mut url = by(&model, "node-b", 2);
        url.spec.source = ModelSource::Url(shardplane_crds::UrlSource {
            url: "https://example.com/m.gguf".into(),
            sha256: None,
        });
        assert_eq!(release(&url, false, &nodes), None);
        // Of an agent's report the operator writes only its own part.
        let mut status = by(&model, "node-a", 2).status.unwrap();
        status.layers = Some(30);
        let part = operators_part(&status);
        assert_eq!((part.layers, part.reported_by), (None, None));
        assert_eq!(part.observed_generation, Some(2));
    }
}
