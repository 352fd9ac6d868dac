//! Why nothing fits, in numbers a person can act on.

use std::collections::BTreeSet;

use crate::cluster::{Cluster, Node};
use crate::footprint::Footprint;
use crate::plan::{Request, Strategy};

/// Bytes for people: `41.3 GiB`, `512.0 MiB`, `900 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: &[&str] = &["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    format!("{value:.1} {unit}")
}

/// The model's weights and KV budget as `footprint` (one engine's) holds them.
fn budget(request: &Request<'_>, footprint: &Footprint) -> String {
    let s: &Strategy = request.strategy;
    format!(
        "{} weights + {} KV cache for {} tokens x {} sequences",
        human_bytes(footprint.weight_bytes()),
        human_bytes(footprint.kv_bytes(s.kv)),
        s.kv.context_length,
        s.kv.sequences
    )
}

pub(crate) fn no_nodes(cluster: &Cluster, deployment: &str, daily: bool) -> String {
    let total = cluster.nodes.len();
    let cordoned = cluster.nodes.values().filter(|n| !n.schedulable).count();
    let taken = cluster
        .nodes
        .values()
        .filter(|n| n.schedulable && !n.admits(deployment, daily))
        .count();
    format!(
        "no node can take shards: the pool has {total} nodes, {cordoned} not ready or cordoned, {taken} dedicated to other deployments; add nodes to the pool (label them to match its selector) or uncordon some"
    )
}

pub(crate) fn no_spare_node(usable: usize) -> String {
    format!(
        "each of the {usable} nodes this deployment may use already runs one of its replicas, and daily replicas need a node each: add nodes to the pool or lower replicas"
    )
}

/// Nothing holds a whole replica: what one needs on the largest free node
/// (as that node's engine holds the model, `footprint_on`), and what it has.
pub(crate) fn whole<'f>(
    request: &'f Request<'_>,
    footprint_on: &dyn Fn(&str) -> &'f Footprint,
    usable: &[(&String, &Node)],
    others: &BTreeSet<&str>,
) -> String {
    let largest = usable
        .iter()
        .filter(|(name, _)| !others.contains(name.as_str()))
        .max_by_key(|(_, n)| n.free_bytes);
    let footprint = largest.map_or(request.footprint, |(name, _)| footprint_on(name));
    let need = footprint.stage_bytes(
        &(0..footprint.layers()),
        request.strategy.kv,
        request.strategy.stage_overhead,
    );
    let available = usable
        .iter()
        .filter(|(name, _)| !others.contains(name.as_str()))
        .count();
    format!(
        "one replica needs {} on one node ({} + {} overhead); the largest free node of {} available has {}: use nodes with more memory, a smaller context or fewer sequences, or a pipeline strategy on a reasoning pool",
        human_bytes(need),
        budget(request, footprint),
        human_bytes(request.strategy.stage_overhead),
        available,
        human_bytes(largest.map_or(0, |(_, n)| n.free_bytes))
    )
}

/// No pipeline fits: what one instance needs at least (as the leanest of
/// the nodes' engines holds the model, `footprint_on`), and what the pool
/// has.
pub(crate) fn pipeline<'f>(
    request: &'f Request<'_>,
    footprint_on: &dyn Fn(&str) -> &'f Footprint,
    usable: &[(&String, &Node)],
    min_k: usize,
    max_k: usize,
) -> String {
    let s = request.strategy;
    let total_free = usable
        .iter()
        .fold(0u64, |sum, (_, n)| sum.saturating_add(n.free_bytes));
    let largest = usable.iter().map(|(_, n)| n.free_bytes).max().unwrap_or(0);
    let footprint = usable
        .iter()
        .map(|(name, _)| footprint_on(name))
        .min_by_key(|f| f.weight_bytes().saturating_add(f.kv_bytes(s.kv)))
        .unwrap_or(request.footprint);
    let need = footprint
        .weight_bytes()
        .saturating_add(footprint.kv_bytes(s.kv))
        .saturating_add(s.stage_overhead.saturating_mul(min_k.max(1) as u64));
    let limit = if max_k < usable.len() {
        format!(", and the strategy allows at most {max_k} nodes per instance")
    } else {
        String::new()
    };
    format!(
        "one instance needs at least {} ({} + {} overhead per stage); the pool's {} schedulable nodes have {} free in all (largest {}){limit}: add nodes or memory, lower the KV budget, or raise maxNodes",
        human_bytes(need),
        budget(request, footprint),
        human_bytes(s.stage_overhead),
        usable.len(),
        human_bytes(total_free),
        human_bytes(largest)
    )
}

pub(crate) fn links(s: &Strategy) -> String {
    let mut wants = Vec::new();
    if s.require_rdma {
        wants.push("RDMA".to_string());
    }
    if let Some(l) = s.max_latency_micros {
        wants.push(format!("latency at most {l} µs"));
    }
    if let Some(b) = s.min_bandwidth_mbps {
        wants.push(format!("at least {b} Mbit/s"));
    }
    format!(
        "memory would fit, but no order of the nodes has links with {} between every pair of adjacent stages (links not yet measured do not count): relax the strategy's links or wait for the agents to measure them",
        wants.join(" and ")
    )
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn human_bytes_reads_well() {
        assert_eq!(human_bytes(900), "900 B");
        assert_eq!(human_bytes(512 << 20), "512.0 MiB");
        assert_eq!(human_bytes(41_300_000_000), "38.5 GiB");
    }
}
