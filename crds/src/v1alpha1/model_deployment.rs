//! `ModelDeployment`: a model served from a pool with a strategy, `replicas` times.

use k8s_openapi::api::core::v1::SecretKeySelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Conditions, LayerRange, ShardPhase, keep_field_docs};

/// Serves a Model on a NodePool, split by a ShardingStrategy, `replicas` times.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "shardplane.dev",
    version = "v1alpha1",
    kind = "ModelDeployment",
    namespaced,
    status = "ModelDeploymentStatus",
    shortname = "mdep",
    category = "shardplane",
    doc = "Serves a Model on a NodePool, split by a ShardingStrategy, replicas times. The operator places its shards and reports instances and conditions.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model"),
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.nodePool"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(name = "URL", type_ = "string", json_path = ".status.endpoint.url"),
    printcolumn(
        name = "Served",
        type_ = "string",
        json_path = ".status.endpoint.model"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ModelDeploymentSpec {
    /// Name of the Model to serve, in this namespace.
    #[schemars(length(min = 1, max = 253))]
    pub model: String,
    /// Name of the NodePool to place it on.
    #[schemars(length(min = 1, max = 253))]
    pub node_pool: String,
    /// Name of the ShardingStrategy that says how to split it.
    #[schemars(length(min = 1, max = 253))]
    pub strategy: String,
    /// Number of instances (each a full copy of the model, possibly spread over
    /// several nodes).
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = crate::limits::MAX_REPLICAS))]
    pub replicas: i32,
    /// More names clients may ask for besides the Model's served name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = crate::limits::MAX_ALIASES), inner(length(min = 1, max = 253)))]
    pub aliases: Vec<String>,
    /// Where requests go, in order, when no instance of this deployment is ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = crate::limits::MAX_FALLBACK))]
    pub fallback: Vec<FallbackTarget>,
}

fn default_replicas() -> i32 {
    1
}

/// One step of a fallback chain: exactly one of `deployment` or `external`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum FallbackTarget {
    /// Another ModelDeployment in this namespace, by name.
    Deployment(String),
    /// An external OpenAI-compatible endpoint (a cloud provider to burst to).
    External(ExternalEndpoint),
}

/// An OpenAI-compatible endpoint outside the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ExternalEndpoint {
    /// Base URL of the API, e.g. `https://api.example.com/v1`. The gateway
    /// uses it only when it falls under one of its allowed URLs
    /// (`--allow-external-url`; none by default).
    #[schemars(regex(pattern = r"^https?://.+"))]
    pub base_url: String,
    /// The model name to ask the endpoint for.
    #[schemars(length(min = 1))]
    pub model: String,
    /// The Secret key holding the endpoint's API key. The Secret must carry
    /// the label `shardplane.dev/external-credential: "true"`, or the
    /// gateway does not send its value out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<SecretKeySelector>,
}

/// The deployment as placed and observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ModelDeploymentStatus {
    /// Number of instances that exist (placed), for the scale subresource.
    #[serde(default)]
    pub replicas: i32,
    /// Number of instances whose every stage is `Ready`.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the deployment's Shards, for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The placed instances and their stages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceStatus>,
    /// Where clients reach the deployment: the gateway's URL and the model
    /// name to ask it for. Written once the deployment validates, when the
    /// operator knows the gateway (`--gateway-url`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<DeploymentEndpoint>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Placed`, `Progressing` and `Degraded`, with reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

/// Where clients reach a deployment.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct DeploymentEndpoint {
    /// The gateway's base URL (OpenAI-compatible, e.g. `http://gateway:8080/v1`).
    pub url: String,
    /// The model name to ask for (the Model's served name).
    pub model: String,
}

/// One instance: a full copy of the model over one or more stages.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct InstanceStatus {
    /// Index of the instance within the deployment.
    pub index: u32,
    /// Whether every stage is `Ready`.
    pub ready: bool,
    /// The stages in pipeline order.
    pub stages: Vec<StageStatus>,
}

/// One stage of an instance as placed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct StageStatus {
    /// Name of the Shard object of this stage.
    pub shard: String,
    /// The node the stage runs on.
    pub node: String,
    /// The layers the stage runs.
    pub layers: LayerRange,
    /// The Shard's phase as last observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ShardPhase>,
    /// The Shard's rank in its stage's tensor group (0 leads); unset when
    /// the stage is not split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_rank: Option<u32>,
}

impl ModelDeployment {
    /// The label selector matching this deployment's Shards.
    pub fn shard_selector(&self) -> String {
        format!(
            "{}={}",
            crate::DEPLOYMENT_LABEL,
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }
}
