//! `InferenceNode`: one machine, registered and kept fresh by its agent.

use k8s_openapi::apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Conditions, Engine, keep_field_docs};

/// One machine that runs shards. The agent creates it and keeps its status; a
/// person may set `spec.unschedulable` to cordon it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "shardplane.dev",
    version = "v1alpha1",
    kind = "InferenceNode",
    status = "InferenceNodeStatus",
    shortname = "inode",
    category = "shardplane",
    doc = "One machine that runs shards, registered by its agent, which keeps its status and renews a Lease. Set spec.unschedulable to cordon it.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Chip", type_ = "string", json_path = ".status.chip"),
    printcolumn(
        name = "Accelerator",
        type_ = "string",
        json_path = ".status.accelerator"
    ),
    printcolumn(name = "Memory", type_ = "string", json_path = ".status.memory.total"),
    printcolumn(
        name = "Allocatable",
        type_ = "string",
        json_path = ".status.memory.allocatable"
    ),
    printcolumn(
        name = "Unschedulable",
        type_ = "boolean",
        json_path = ".spec.unschedulable",
        priority = 1
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".status.dataPlaneEndpoint",
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
pub struct InferenceNodeSpec {
    /// Cordons the node: it keeps what it runs but gets no new shards, and the
    /// operator moves its shards elsewhere.
    #[serde(default)]
    pub unschedulable: bool,
}

/// The accelerator a node computes with.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Accelerator {
    /// Apple GPU through Metal (unified memory).
    Metal,
    /// NVIDIA GPU through CUDA.
    Cuda,
    /// CPU only.
    #[default]
    None,
}

/// The kind of network link an address is on, fastest first.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum LinkKind {
    /// The same machine.
    Loopback,
    /// Thunderbolt networking (the Thunderbolt Bridge on macOS).
    Thunderbolt,
    /// Wired Ethernet.
    Ethernet,
    /// Wi-Fi.
    Wifi,
    /// Anything else (virtual interfaces, tunnels).
    Other,
}

/// Memory of a node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct NodeMemory {
    /// Physical memory.
    pub total: Quantity,
    /// Memory shards may use: total less the agent's reserve.
    pub allocatable: Quantity,
    /// Memory free right now.
    pub available: Quantity,
}

/// A network address of a node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct NodeAddress {
    /// The IP address.
    pub address: String,
    /// The interface that holds it (e.g. `en0`, `bridge0`, `eth0`).
    pub interface: String,
    /// The kind of link the interface is on.
    pub kind: LinkKind,
}

/// A measured link from this node to a peer's data plane.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct LinkStatus {
    /// The peer InferenceNode.
    pub node: String,
    /// The peer address the measurement used.
    pub address: String,
    /// The kind of link used.
    pub kind: LinkKind,
    /// Median round-trip time of a small message, in microseconds.
    pub latency_micros: u32,
    /// Measured throughput, in megabits per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_mbps: Option<u32>,
    /// Whether the link supports RDMA.
    #[serde(default)]
    pub rdma: bool,
    /// When the link was last measured.
    pub measured_at: Time,
}

/// A model file in the node's cache.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct CachedModel {
    /// The key the cache knows the file by (derived from its source).
    pub key: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the file, when verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// The machine as its agent sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct InferenceNodeStatus {
    /// Chip or CPU model (e.g. `Apple M4 Max`, `AMD EPYC 7B13`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chip: Option<String>,
    /// Number of CPU cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<u32>,
    /// Operating system (`macos`, `linux`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os: Option<String>,
    /// CPU architecture (`aarch64`, `x86_64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
    /// Memory totals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<NodeMemory>,
    /// `metal`, `cuda` or `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<Accelerator>,
    /// Engines the agent was built with, preferred first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<Engine>,
    /// The node's network addresses, classified by link kind.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<NodeAddress>,
    /// The agent's data-plane endpoint (`host:port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_plane_endpoint: Option<String>,
    /// Measured links to the other nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkStatus>,
    /// Model files in the node's cache.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cached_models: Vec<CachedModel>,
    /// The agent is shutting down: finishing or cancelling work and unloading.
    #[serde(default)]
    pub draining: bool,
    /// The agent's version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// Prompt tokens a step of the agent's stages takes at most
    /// (`--prefill-tokens-per-step`): a sliding-window layer holds this
    /// many rows of a sequence beyond its window, so a pipeline's head and
    /// placement count the node's sliding layers with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_step_tokens: Option<u32>,
    /// `Ready`, driven by the agent's Lease.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

impl InferenceNodeStatus {
    /// Whether other agents should reach out to the node (to measure a link,
    /// or to copy weights from it): it is not draining, and the operator has
    /// not marked it not Ready (its Lease lapsed: the process is gone, and
    /// its address may belong to something else by now). Without an operator
    /// no condition is written and a node counts as reachable.
    pub fn reachable(&self) -> bool {
        !self.draining
            && !self
                .conditions
                .iter()
                .any(|c| c.type_ == super::CONDITION_READY && c.status != "True")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn ready(status: &str) -> Condition {
        Condition {
            type_: super::super::CONDITION_READY.into(),
            status: status.into(),
            reason: "LeaseExpired".into(),
            message: String::new(),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
            observed_generation: None,
        }
    }

    #[test]
    fn a_node_is_reachable_unless_draining_or_marked_not_ready() {
        let fresh = InferenceNodeStatus::default();
        assert!(fresh.reachable(), "no operator, no condition");
        let up = InferenceNodeStatus {
            conditions: vec![ready("True")],
            ..Default::default()
        };
        assert!(up.reachable());
        for status in ["False", "Unknown"] {
            let down = InferenceNodeStatus {
                conditions: vec![ready(status)],
                ..Default::default()
            };
            assert!(!down.reachable(), "Ready={status}");
        }
        let draining = InferenceNodeStatus {
            draining: true,
            ..up
        };
        assert!(!draining.reachable());
    }
}
