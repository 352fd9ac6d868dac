//! `NodePool`: a set of `InferenceNode`s chosen by labels, with a tier.

use k8s_openapi::apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Conditions, Tier, keep_field_docs};

/// A set of `InferenceNode`s chosen by a label selector, and what they are for.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "shardplane.dev",
    version = "v1alpha1",
    kind = "NodePool",
    status = "NodePoolStatus",
    shortname = "npool",
    category = "shardplane",
    doc = "A set of InferenceNodes chosen by labels, with a tier: daily pools hold whole models on dedicated nodes, reasoning pools shard one large model across nodes.",
    printcolumn(name = "Tier", type_ = "string", json_path = ".spec.tier"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".status.nodeCount"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyNodes"),
    printcolumn(
        name = "Allocatable",
        type_ = "string",
        json_path = ".status.allocatableMemory"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct NodePoolSpec {
    /// `daily` (whole models, one replica per dedicated node) or `reasoning`
    /// (one model sharded across nodes).
    pub tier: Tier,
    /// Which InferenceNodes belong to the pool. An empty selector selects every node.
    #[serde(default)]
    pub node_selector: LabelSelector,
    /// Memory kept free on every member node for the system and other programs,
    /// on top of what the node itself reserves (e.g. `4Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_reserve: Option<Quantity>,
}

/// The pool as the operator sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct NodePoolStatus {
    /// Names of the member nodes, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    /// Number of member nodes.
    #[serde(default)]
    pub node_count: u32,
    /// Number of member nodes whose `Ready` condition is `True`.
    #[serde(default)]
    pub ready_nodes: u32,
    /// Memory the pool's ready nodes can give to shards, after reserves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocatable_memory: Option<Quantity>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: at least one member node is ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}
