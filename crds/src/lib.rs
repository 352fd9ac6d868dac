//! The `shardplane.dev` API: custom resource types, CRD generation and validation.
//!
//! Six kinds, version `v1alpha1`:
//!
//! ```text
//!  Model ─┐                       ┌─► Shard (one stage of one instance, bound to a node)
//!  NodePool ──► ModelDeployment ──┤
//!  ShardingStrategy ─┘            └─► status: instances, conditions, endpoint
//!  InferenceNode (registered by the agent; Lease heartbeat)
//! ```
//!
//! The Rust types are the source of truth: the CRD YAML in the Helm chart is
//! generated from them ([`all_crds`], `shardplane crds`). Old API servers ignore
//! CEL rules, so every cross-field rule also lives in a `validate()` method that
//! the operator runs ([`validation`]).
//!
//! This crate knows nothing of controllers, agents or engines.

// kube-derive takes one `printcolumn(...)` per column, which this lint reads as
// the same attribute repeated.
#![allow(clippy::duplicated_attributes)]

pub mod identity;
pub mod limits;
pub mod names;
pub mod quantity;
pub mod v1alpha1;
pub mod validation;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use v1alpha1::*;

/// The API group of every shardplane kind.
pub const GROUP: &str = "shardplane.dev";

/// The label on a `Shard` naming the `InferenceNode` it is bound to (its
/// value is [`node_label_value`] of the node's name).
pub const NODE_LABEL: &str = "shardplane.dev/node";

/// The value of [`NODE_LABEL`] for node `node`: the name itself when it fits
/// a label value (63 characters); a longer name (node names may have 253)
/// keeps its first 46 characters (less any `-` or `.` they end with) and
/// gets `-` and 16 hex digits of its SHA-256, so every node still has a
/// label of its own.
pub fn node_label_value(node: &str) -> String {
    const MAX: usize = 63;
    if node.len() <= MAX {
        return node.to_string();
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(node.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    // The kept part must end in a letter or digit before the `-`.
    let kept: String = node.chars().take(MAX - 1 - hash.len()).collect();
    format!("{}-{hash}", kept.trim_end_matches(['-', '.']))
}

/// The label on a `Shard` naming the `ModelDeployment` that owns it.
pub const DEPLOYMENT_LABEL: &str = "shardplane.dev/deployment";
/// The label on a `Shard` giving the index of the instance it belongs to.
pub const INSTANCE_LABEL: &str = "shardplane.dev/instance";
/// The label a Secret named by a Model's `tokenSecretRef` must carry (`"true"`).
pub const HUGGING_FACE_TOKEN_LABEL: &str = "shardplane.dev/hugging-face-token";
/// The field manager every shardplane component writes with (server-side apply).
pub const FIELD_MANAGER: &str = "shardplane";
/// The field manager of the operator (status of Models, pools, deployments,
/// the `Ready` condition of nodes, and Shard specs).
pub const OPERATOR_MANAGER: &str = "shardplane-operator";
/// The field manager of agents (InferenceNode and Shard status but conditions).
pub const AGENT_MANAGER: &str = "shardplane-agent";
/// The namespace holding one Lease per InferenceNode, renewed by its agent.
pub const NODE_LEASE_NAMESPACE: &str = "shardplane-node-lease";
/// The finalizer the operator puts on a ModelDeployment to delete its Shards.
pub const DEPLOYMENT_FINALIZER: &str = "modeldeployments.shardplane.dev/finalizer";

/// Every CRD of the API, in a stable order.
pub fn all_crds() -> Vec<CustomResourceDefinition> {
    [
        Model::crd(),
        NodePool::crd(),
        ShardingStrategy::crd(),
        ModelDeployment::crd(),
        Shard::crd(),
        InferenceNode::crd(),
    ]
    .into_iter()
    .map(without_nullable)
    .collect()
}

/// Removes `nullable: true` from a CRD's schemas.
///
/// Our clients never send `null` (absent optional fields are left out), and API
/// servers prune nulls of non-nullable fields anyway; but servers before 1.22
/// leave nullable properties out of their OpenAPI v2 document, and with them
/// every optional field from `kubectl explain` and client-side validation.
fn without_nullable(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    fn strip(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.remove("nullable");
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut value = serde_json::to_value(&crd).expect("a CRD serializes to JSON");
    for version in value["spec"]["versions"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        strip(&mut version["schema"]);
    }
    serde_json::from_value(value).expect("a CRD without nullable still deserializes")
}

/// Every CRD as one multi-document YAML stream.
pub fn all_crds_yaml() -> Result<String, serde_saphyr::SerializeError> {
    let mut out = String::new();
    for (_, yaml) in crd_files()? {
        out.push_str("---\n");
        out.push_str(&yaml);
    }
    Ok(out)
}

/// Every CRD as `(file name, YAML)`, the files committed in the Helm chart's
/// `files/crds/` (templated into the release; `shardplane crds --dir charts/shardplane/files/crds`).
pub fn crd_files() -> Result<Vec<(String, String)>, serde_saphyr::SerializeError> {
    all_crds()
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            Ok((format!("{name}.yaml"), serde_saphyr::to_string(&crd)?))
        })
        .collect()
}

#[cfg(test)]
mod node_label_tests {
    use super::node_label_value;

    #[test]
    fn long_node_names_get_label_values_of_their_own() {
        assert_eq!(node_label_value("studio-1"), "studio-1");
        let exact = "a".repeat(63);
        assert_eq!(node_label_value(&exact), exact);
        let long = format!("{}.{}", "a".repeat(45), "b".repeat(100));
        let other = format!("{}.{}", "a".repeat(45), "c".repeat(100));
        let (v, w) = (node_label_value(&long), node_label_value(&other));
        assert_ne!(v, w);
        for v in [&v, &w] {
            // 45 a's (the dot trimmed), '-', 16 hex digits.
            assert_eq!(v.len(), 62, "{v}");
            assert!(
                v.starts_with(&"a".repeat(45)) && v[45..].starts_with('-'),
                "{v}"
            );
            assert!(v[46..].chars().all(|c| c.is_ascii_hexdigit()), "{v}");
        }
        assert_eq!(node_label_value(&long), v, "the same name, the same value");
    }
}
