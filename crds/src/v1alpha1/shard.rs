//! `Shard`: one stage of one instance, bound to one node. This system's Pod.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    Conditions, Engine, KvCacheBudget, LayerRange, ModelFormat, ModelSource, keep_field_docs,
};

/// One stage of one instance of a ModelDeployment, bound to one InferenceNode:
/// the agent on that node fetches the weights, loads `layers` and serves them.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "shardplane.dev",
    version = "v1alpha1",
    kind = "Shard",
    namespaced,
    status = "ShardStatus",
    shortname = "shd",
    category = "shardplane",
    doc = "One stage of one instance of a ModelDeployment, bound to one InferenceNode. The agent on that node fetches the weights, loads the layer range and serves it.",
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.node"),
    printcolumn(name = "Stage", type_ = "integer", json_path = ".spec.stage"),
    printcolumn(name = "Rank", type_ = "integer", json_path = ".spec.tensor.rank"),
    printcolumn(name = "From", type_ = "integer", json_path = ".spec.layers.start"),
    printcolumn(name = "To", type_ = "integer", json_path = ".spec.layers.end"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Restarts", type_ = "integer", json_path = ".status.restarts"),
    printcolumn(
        name = "Downloaded",
        type_ = "integer",
        json_path = ".status.downloadedBytes"
    ),
    printcolumn(name = "Of", type_ = "integer", json_path = ".status.totalBytes"),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".status.endpoint",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ShardSpec {
    /// The ModelDeployment this shard belongs to.
    #[schemars(length(min = 1, max = 253))]
    pub deployment: String,
    /// The Model whose layers this shard runs.
    #[schemars(length(min = 1, max = 253))]
    pub model: String,
    /// Where the weights come from (copied from the Model, so the agent needs nothing else).
    pub source: ModelSource,
    /// The format of the weights.
    pub format: ModelFormat,
    /// The InferenceNode the shard is bound to (also the label `shardplane.dev/node`).
    #[schemars(length(min = 1, max = 253))]
    pub node: String,
    /// Index of the instance within the deployment.
    #[serde(default)]
    pub instance: u32,
    /// Position of this stage in the pipeline, from 0.
    #[serde(default)]
    pub stage: u32,
    /// Number of stages of the instance.
    #[schemars(range(min = 1))]
    pub stage_count: u32,
    /// The transformer layers this stage runs, `[start, end)`. The first stage
    /// also embeds tokens; the last also applies the final norm and output head.
    pub layers: LayerRange,
    /// The model's total number of layers.
    #[schemars(range(min = 1))]
    pub total_layers: u32,
    /// The KV cache this stage must hold.
    pub kv_cache: KvCacheBudget,
    /// The Shard of the next stage, to which hidden states are sent; unset on the last stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// The Shard of the previous stage; unset on the first stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// The Model's chat template override (first stage only: the stage
    /// that renders conversations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// Set when this stage is computed by a tensor-parallel group: which
    /// rank of the group this Shard is, every rank's share weight and every
    /// rank's Shard. Every rank runs the same layers; rank 0 leads (serves
    /// the data plane, is named by the stages before and after it) and the
    /// others follow it over the group's own connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<TensorRankSpec>,
}

/// One rank of a tensor-parallel group.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct TensorRankSpec {
    /// This Shard's rank (0 leads).
    pub rank: u32,
    /// Every rank's share weight, in rank order: attention heads (in whole
    /// KV-head groups) and MLP columns go to the ranks in these proportions.
    #[schemars(length(min = 2, max = crate::limits::MAX_TENSOR_RANKS))]
    pub weights: Vec<u32>,
    /// Every rank's Shard name, in rank order (this one's included).
    #[schemars(length(min = 2, max = crate::limits::MAX_TENSOR_RANKS))]
    pub group: Vec<String>,
}

/// The lifecycle of a shard on its node.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum ShardPhase {
    /// Accepted by the operator; the agent has not started on it.
    Pending,
    /// The agent is fetching the weights.
    Downloading,
    /// The agent is loading the layer range into its engine.
    Loading,
    /// Loaded and serving on its data-plane endpoint.
    Ready,
    /// Cannot run; `reason` and `message` say why.
    Failed,
    /// Its node stopped renewing its Lease: what the agent last reported
    /// cannot be trusted (set by the operator, which keeps the Shard until a
    /// replacement is Ready; the agent reports again when it is back).
    Unknown,
}

impl std::fmt::Display for ShardPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// The shard as its agent reports it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ShardStatus {
    /// `Pending`, `Downloading`, `Loading`, `Ready`, `Failed` or `Unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ShardPhase>,
    /// A CamelCase word saying why the shard is in its phase (e.g. `CorruptWeights`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What happened, for a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Bytes of the weights fetched so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downloaded_bytes: Option<u64>,
    /// Bytes of the weights to fetch in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    /// The data-plane endpoint (`host:port`) serving this stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// A tensor-parallel rank's address for its group (`host:port`): where
    /// it waits for the higher ranks to join it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_endpoint: Option<String>,
    /// The engine that runs the stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<Engine>,
    /// Memory the loaded stage uses (weights and KV cache), in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Tokens of KV cache this stage's machine holds for the shard: its
    /// `kvCache` (context length × concurrent sequences), or fewer when the
    /// machine's free memory has room for fewer (measured at load and every
    /// 15 s). The first stage admits generations within its own and each
    /// later stage's. A stage with sliding-window layers counts a sequence
    /// as fewer tokens than its length once it is longer than those layers
    /// hold (by its own layers and its agent's prompt step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_budget_tokens: Option<u64>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Times the agent has tried the shard again after a failure that may pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarts: Option<u32>,
    /// The last failure, `Reason: message`; kept after the shard recovers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,
    /// When a Failed shard is tried again; absent when its failure is
    /// permanent (it waits for a new spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_time: Option<Time>,
    /// `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}
