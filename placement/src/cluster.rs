//! The nodes and links placement chooses from.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::footprint::Footprint;

/// A node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Memory free for new shards: allocatable, less reserves, less what other
    /// deployments' shards hold.
    pub free_bytes: u64,
    /// Ready and not cordoned: may receive shards.
    pub schedulable: bool,
    /// Already holds the weights of the model being placed.
    pub has_weights: bool,
    /// The deployment this node is dedicated to (daily tier), if any.
    pub dedicated_to: Option<String>,
    /// Deployments with shards on this node.
    pub occupants: BTreeSet<String>,
    /// The model being placed as this node's engine holds it, when that
    /// differs from the request's footprint (an engine that converts the
    /// file's weight types, or keeps its KV cache in another precision).
    pub footprint: Option<Arc<Footprint>>,
    /// The same for a tensor rank, which runs on an engine of its own
    /// (candle) whatever the node's stages run on.
    pub rank_footprint: Option<Arc<Footprint>>,
}

impl Node {
    /// A schedulable, empty node with `free_bytes` free.
    pub fn new(free_bytes: u64) -> Self {
        Node {
            free_bytes,
            schedulable: true,
            has_weights: false,
            dedicated_to: None,
            occupants: BTreeSet::new(),
            footprint: None,
            rank_footprint: None,
        }
    }

    /// Whether `deployment` may put shards here.
    pub(crate) fn admits(&self, deployment: &str, daily: bool) -> bool {
        let dedication_ok = self.dedicated_to.as_deref().is_none_or(|d| d == deployment);
        // A daily deployment takes the node for itself: nobody else may be on it.
        let alone = !daily || self.occupants.iter().all(|o| o == deployment);
        dedication_ok && alone
    }
}

/// A measured link between two nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Round-trip latency in microseconds.
    pub latency_micros: u32,
    /// Throughput in megabits per second, when measured.
    pub bandwidth_mbps: Option<u32>,
    /// Whether the link supports RDMA.
    pub rdma: bool,
}

/// Latency assumed for a link never measured: worse than any measured one, so
/// measured links are preferred.
pub(crate) const UNMEASURED_LATENCY_MICROS: u64 = 100_000;

/// The hidden state one decode step sends across a hop, for weighing
/// bandwidth against latency: 4096 f32 values, the width of the large models
/// pipelines are for.
pub(crate) const STEP_BYTES: u64 = 16 * 1024;

/// Nodes by name, and the links between them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cluster {
    /// The nodes, by name (sorted, so plans are deterministic).
    pub nodes: BTreeMap<String, Node>,
    /// Links by one end, then the other (stored both ways, looked up without allocating).
    links: HashMap<String, HashMap<String, Link>>,
}

impl Cluster {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces a node.
    pub fn add_node(&mut self, name: impl Into<String>, node: Node) {
        self.nodes.insert(name.into(), node);
    }

    /// Records a link between `a` and `b` (either direction).
    pub fn add_link(&mut self, a: &str, b: &str, link: Link) {
        self.links
            .entry(a.to_string())
            .or_default()
            .insert(b.to_string(), link);
        self.links
            .entry(b.to_string())
            .or_default()
            .insert(a.to_string(), link);
    }

    /// The link between `a` and `b`, if measured.
    pub fn link(&self, a: &str, b: &str) -> Option<&Link> {
        self.links.get(a)?.get(b)
    }

    /// The cost of one hop between two nodes for ordering, in microseconds
    /// (0 on the same node): the round trip, plus the time one decode step's
    /// hidden state ([`STEP_BYTES`]) takes at the measured bandwidth, so that
    /// a narrow link costs what it adds to every token.
    pub(crate) fn hop_cost(&self, a: &str, b: &str) -> u64 {
        if a == b {
            return 0;
        }
        self.link(a, b).map_or(UNMEASURED_LATENCY_MICROS, |l| {
            let transfer = l
                .bandwidth_mbps
                .map_or(0, |mbps| STEP_BYTES * 8 / u64::from(mbps.max(1)));
            l.latency_micros as u64 + transfer
        })
    }
}
