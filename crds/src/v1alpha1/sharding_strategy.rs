//! `ShardingStrategy`: how to split a model across nodes.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::keep_field_docs;

/// How a model is split across nodes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Parallelism {
    /// The whole model on one node (the daily tier).
    None,
    /// Layer ranges on successive nodes; hidden states flow from stage to stage.
    Pipeline,
    /// Every layer split across nodes, joined by collective operations.
    Tensor,
}

impl std::fmt::Display for Parallelism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Parallelism::None => "none",
            Parallelism::Pipeline => "pipeline",
            Parallelism::Tensor => "tensor",
        })
    }
}

/// How layers are assigned to the chosen nodes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum PlacementPolicy {
    /// Layers in proportion to each node's allocatable memory, on the fewest
    /// nodes that fit.
    #[default]
    MemoryWeighted,
    /// As few nodes as possible, each filled before the next is used.
    FewestNodes,
    /// An equal number of layers on each node, on `maxNodes` nodes when set
    /// (fewer only when that many do not fit or are not there).
    EvenLayers,
}

/// A cluster-wide recipe for splitting models: parallelism, placement policy,
/// node bounds, KV-cache budget and link requirements.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "shardplane.dev",
    version = "v1alpha1",
    kind = "ShardingStrategy",
    shortname = "sstrat",
    category = "shardplane",
    doc = "How to split a model across nodes: parallelism, placement policy, node bounds, KV-cache budget and link requirements.",
    printcolumn(
        name = "Parallelism",
        type_ = "string",
        json_path = ".spec.parallelism"
    ),
    printcolumn(name = "Placement", type_ = "string", json_path = ".spec.placement"),
    printcolumn(
        name = "Context",
        type_ = "integer",
        json_path = ".spec.kvCache.contextLength"
    ),
    printcolumn(
        name = "Sequences",
        type_ = "integer",
        json_path = ".spec.kvCache.concurrentSequences"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ShardingStrategySpec {
    /// `none` (whole model per node), `pipeline` (layer ranges on successive
    /// nodes) or `tensor` (layers split across nodes).
    pub parallelism: Parallelism,
    /// How layers are assigned to nodes. Defaults to `memoryWeighted`.
    #[serde(default)]
    pub placement: PlacementPolicy,
    /// The fewest nodes one instance may span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = crate::limits::MAX_NODES_PER_INSTANCE))]
    pub min_nodes: Option<u32>,
    /// The most nodes one instance may span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = crate::limits::MAX_NODES_PER_INSTANCE))]
    pub max_nodes: Option<u32>,
    /// With `parallelism: tensor`, the ranks of each tensor group: an
    /// instance on N nodes is a pipeline of N / tensorSize stages, each
    /// split across tensorSize nodes. Unset: one stage split across every
    /// node of the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = crate::limits::MAX_TENSOR_RANKS))]
    pub tensor_size: Option<u32>,
    /// The KV cache every instance must have room for.
    pub kv_cache: KvCacheBudget,
    /// Memory each stage needs beyond its weights and KV cache (activations,
    /// runtime buffers). Defaults to `256Mi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_overhead: Option<Quantity>,
    /// What the links between the stages of an instance must offer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub links: Option<LinkRequirements>,
}

/// The KV cache an instance reserves: room for `concurrentSequences` sequences
/// of `contextLength` tokens each.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct KvCacheBudget {
    /// Tokens of context per sequence (prompt and generated).
    #[schemars(range(min = 1, max = crate::limits::MAX_CONTEXT_LENGTH))]
    pub context_length: u32,
    /// Sequences served at once by one instance.
    #[schemars(range(min = 1, max = crate::limits::MAX_CONCURRENT_SEQUENCES))]
    pub concurrent_sequences: u32,
}

/// Requirements on the links between the stages of one instance.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct LinkRequirements {
    /// Only links with RDMA (Thunderbolt 5 on macOS 26.2+) between stages.
    #[serde(default)]
    pub require_rdma: bool,
    /// The highest measured round-trip latency allowed between adjacent stages,
    /// in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_latency_micros: Option<u32>,
    /// The lowest measured throughput allowed between adjacent stages, in megabits
    /// per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub min_bandwidth_mbps: Option<u32>,
}
