//! Reading the cluster as kubectl does: one list per kind.

use kube::Api;
use kube::api::ListParams;
use shardplane_crds::v1alpha1::{InferenceNode, ModelDeployment, Shard};

use crate::{Error, Snapshot, snapshot};

/// Lists the nodes and the deployments and Shards of `namespace` (every
/// namespace when none) and makes the snapshot.
pub async fn read(client: &kube::Client, namespace: Option<&str>) -> Result<Snapshot, Error> {
    let lp = ListParams::default();
    let nodes = Api::<InferenceNode>::all(client.clone())
        .list(&lp)
        .await
        .map_err(|source| Error::List {
            kind: "InferenceNodes (are the shardplane CRDs installed?)",
            source,
        })?;
    let (deployments, shards) = match namespace {
        Some(ns) => (
            Api::<ModelDeployment>::namespaced(client.clone(), ns)
                .list(&lp)
                .await,
            Api::<Shard>::namespaced(client.clone(), ns).list(&lp).await,
        ),
        None => (
            Api::<ModelDeployment>::all(client.clone()).list(&lp).await,
            Api::<Shard>::all(client.clone()).list(&lp).await,
        ),
    };
    let deployments = deployments.map_err(|source| Error::List {
        kind: "ModelDeployments",
        source,
    })?;
    let shards = shards.map_err(|source| Error::List {
        kind: "Shards",
        source,
    })?;
    Ok(snapshot::snapshot(
        &nodes.items,
        &deployments.items,
        &shards.items,
    ))
}
