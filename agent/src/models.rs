//! Models whose weights are a path on the nodes: the agent that holds the file
//! reads its header and reports the metadata into the Model's status (the
//! operator, which cannot see the nodes' files, marks it resolved). The first
//! node to report names itself in `status.reportedBy`; the others leave the
//! Model alone until the operator clears that (its InferenceNode deleted, or
//! the spec changed), so two nodes with different files at one path do not
//! take turns. A node without an InferenceNode reports nothing. A report is
//! applied only onto the Model as the agent read it (its resource version),
//! so a report from an older spec, or a second node's racing claim, is
//! refused rather than taken as current.

use std::path::Path;

use futures::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use shardplane_crds::{AGENT_MANAGER, InferenceNode, Model, ModelFormat, ModelSource, ModelStatus};

/// Watches Models and reports those whose file is on this node, `node`,
/// unless another node reports them.
pub async fn run(client: Client, node: String) {
    let api: Api<Model> = Api::all(client.clone());
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(model) => {
                if let Err(e) = report(&client, &model, &node).await {
                    tracing::warn!(model = %model.name_any(), error = %e, "cannot report model metadata");
                }
            }
            Err(e) => tracing::warn!(error = %e, "model watch failed; retrying"),
        }
    }
}

/// The metadata part of a status (what the agent reports; conditions are the operator's).
fn metadata(status: &ModelStatus) -> ModelStatus {
    ModelStatus {
        conditions: Vec::new(),
        observed_generation: None,
        ..status.clone()
    }
}

async fn report(client: &Client, model: &Model, node: &str) -> kube::Result<()> {
    let ModelSource::Path(p) = &model.spec.source else {
        return Ok(());
    };
    let reporter = model.status.as_ref().and_then(|s| s.reported_by.as_deref());
    if reporter.is_some_and(|r| r != node) {
        // Another node's file: it reports until its InferenceNode is deleted.
        return Ok(());
    }
    let present = match model.spec.format {
        ModelFormat::Gguf => Path::new(&p.path).is_file(),
        ModelFormat::Safetensors => Path::new(&p.path).join("config.json").is_file(),
    };
    if !present {
        return Ok(());
    }
    let (path, spec, format) = (p.path.clone(), model.spec.clone(), model.spec.format);
    let read = move || shardplane_models::resolve_path(Path::new(&path), format, &spec);
    let Ok(Ok(mut status)) = shardplane_models::off_runtime(&p.path, read).await else {
        // A file this agent cannot read is reported by the Shards that use it.
        return Ok(());
    };
    status.reported_by = Some(node.to_string());
    let current = model.status.as_ref().map(metadata);
    if current.as_ref() == Some(&status) {
        return Ok(());
    }
    // A node whose InferenceNode was deleted does not report: the operator
    // releases such a node's reports, and claiming again would undo that.
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    if nodes.get_opt(node).await?.is_none() {
        tracing::debug!(model = %model.name_any(), node, "not reporting: this node has no InferenceNode");
        return Ok(());
    }
    let ns = model.namespace().unwrap_or_default();
    let api = Api::<Model>::namespaced(client.clone(), &ns);
    // Only onto the Model as read: a report worked out from an older spec,
    // or racing another node's claim, is refused, and the next event
    // decides again.
    let version = model.resource_version();
    let applied = shardplane_cluster::apply_status_at(
        &api,
        &model.name_any(),
        AGENT_MANAGER,
        &status,
        version.as_deref(),
    )
    .await;
    match applied {
        Ok(()) => {
            tracing::info!(model = %model.name_any(), path = %p.path, "reported model metadata")
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            tracing::debug!(model = %model.name_any(), "not reported: the Model changed since it was read")
        }
        Err(e) => return Err(e),
    }
    Ok(())
}
