//! Writing status: server-side apply of the `status` subresource under a
//! fixed field manager, forced (each component owns the fields it writes).

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde::Serialize;

/// Applies `status` as the status of `name` in `api`, as field manager
/// `manager`. Only the fields in `status` are owned by `manager`.
pub async fn apply_status<K, S>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &S,
) -> kube::Result<()>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: Serialize,
{
    apply_status_at(api, name, manager, status, None).await
}

/// [`apply_status`], only if the object is still at `resource_version`
/// (when given): a status worked out from an object read earlier is not
/// applied over a change made since (409 Conflict instead).
pub async fn apply_status_at<K, S>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &S,
    resource_version: Option<&str>,
) -> kube::Result<()>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: Serialize,
{
    let mut patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    if let Some(version) = resource_version {
        patch["metadata"] = serde_json::json!({ "resourceVersion": version });
    }
    api.patch_status(
        name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}
