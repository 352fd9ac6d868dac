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
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}
