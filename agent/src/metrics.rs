//! The agent's Prometheus metrics.

use prometheus::{IntCounter, IntGauge, IntGaugeVec, Opts, Registry};

/// Every metric the agent exposes.
#[derive(Clone)]
pub struct Metrics {
    /// The registry served on `/metrics`.
    pub registry: Registry,
    /// Shards on this node by phase.
    pub shards: IntGaugeVec,
    /// Lease renewals that succeeded.
    pub lease_renewals: IntCounter,
    /// Lease renewals that failed.
    pub lease_failures: IntCounter,
    /// Bytes of weights loaded.
    pub weight_bytes: IntGauge,
    /// Machine memory by kind (`total`, `available`, `allocatable`).
    pub memory_bytes: IntGaugeVec,
}

impl Metrics {
    /// Registers every metric in a new registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let shards = IntGaugeVec::new(
            Opts::new("shardplane_agent_shards", "Shards on this node by phase."),
            &["phase"],
        )
        .expect("valid metric");
        let lease_renewals = IntCounter::new(
            "shardplane_agent_lease_renewals_total",
            "Lease renewals that succeeded.",
        )
        .expect("valid metric");
        let lease_failures = IntCounter::new(
            "shardplane_agent_lease_failures_total",
            "Lease renewals that failed.",
        )
        .expect("valid metric");
        let weight_bytes =
            IntGauge::new("shardplane_agent_weight_bytes", "Bytes of weights loaded.")
                .expect("valid metric");
        let memory_bytes = IntGaugeVec::new(
            Opts::new("shardplane_agent_memory_bytes", "Machine memory by kind."),
            &["kind"],
        )
        .expect("valid metric");
        for c in [
            Box::new(shards.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(lease_renewals.clone()),
            Box::new(lease_failures.clone()),
            Box::new(weight_bytes.clone()),
            Box::new(memory_bytes.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            shards,
            lease_renewals,
            lease_failures,
            weight_bytes,
            memory_bytes,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
