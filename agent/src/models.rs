//! Models whose weights are a path on the nodes: the agent that holds the file
//! reads its header and reports the metadata into the Model's status (the
//! operator, which cannot see the nodes' files, marks it resolved).

use std::path::Path;

use futures::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use shardplane_crds::{AGENT_MANAGER, Model, ModelFormat, ModelSource, ModelStatus};

/// Watches Models and reports those whose file is on this node.
pub async fn run(client: Client) {
    let api: Api<Model> = Api::all(client.clone());
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(model) => {
                if let Err(e) = report(&client, &model).await {
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

async fn report(client: &Client, model: &Model) -> kube::Result<()> {
    let ModelSource::Path(p) = &model.spec.source else {
        return Ok(());
    };
    let present = match model.spec.format {
        ModelFormat::Gguf => Path::new(&p.path).is_file(),
        ModelFormat::Safetensors => Path::new(&p.path).join("config.json").is_file(),
    };
    if !present {
        return Ok(());
    }
    let (path, spec, format) = (p.path.clone(), model.spec.clone(), model.spec.format);
    let read = move || shardplane_models::resolve_path(Path::new(&path), format, &spec);
    let Ok(Ok(status)) = shardplane_models::off_runtime(&p.path, read).await else {
        // A file this agent cannot read is reported by the Shards that use it.
        return Ok(());
    };
    let current = model.status.as_ref().map(metadata);
    if current.as_ref() == Some(&status) {
        return Ok(());
    }
    let ns = model.namespace().unwrap_or_default();
    let api = Api::<Model>::namespaced(client.clone(), &ns);
    shardplane_cluster::apply_status(&api, &model.name_any(), AGENT_MANAGER, &status).await?;
    tracing::info!(model = %model.name_any(), path = %p.path, "reported model metadata");
    Ok(())
}
