//! Splitting a model's layers into contiguous stages that fit their nodes.

use std::ops::Range;

use crate::footprint::{Footprint, KvBudget};
use crate::plan::Policy;

/// Splits the layers over nodes with `free` bytes each, in pipeline order, so
/// every stage fits; `None` when no split of this policy fits.
pub(crate) fn split_layers(
    footprint: &Footprint,
    kv: KvBudget,
    overhead: u64,
    free: &[u64],
    policy: Policy,
) -> Option<Vec<Range<u32>>> {
    let layers = footprint.layers() as usize;
    let k = free.len();
    if k == 0 || k > layers {
        return None;
    }
    let fits = |ranges: &[Range<u32>]| {
        ranges
            .iter()
            .zip(free)
            .all(|(r, &f)| footprint.stage_bytes(r, kv, overhead) <= f)
    };
    let candidates: Vec<Vec<usize>> = match policy {
        Policy::EvenLayers => vec![even_counts(layers, k)],
        Policy::MemoryWeighted => {
            let mut c = vec![weighted_counts(footprint, kv, overhead, free)];
            // When rounding makes a stage overflow, fill greedily instead.
            c.extend(fill_counts(footprint, kv, overhead, free));
            c
        }
        Policy::FewestNodes => fill_counts(footprint, kv, overhead, free)
            .into_iter()
            .collect(),
    };
    candidates
        .into_iter()
        .map(|counts| to_ranges(&counts))
        .find(|r| fits(r))
}

fn to_ranges(counts: &[usize]) -> Vec<Range<u32>> {
    let mut start = 0u32;
    counts
        .iter()
        .map(|&n| {
            let r = start..start + n as u32;
            start = r.end;
            r
        })
        .collect()
}

/// As equal as can be; the first stages take one more when it does not divide.
fn even_counts(layers: usize, k: usize) -> Vec<usize> {
    (0..k)
        .map(|i| layers / k + usize::from(i < layers % k))
        .collect()
}

/// What each node can hold for layers: its free memory less overhead and the
/// embedding (first) or output head (last).
fn layer_capacity(footprint: &Footprint, overhead: u64, free: &[u64]) -> Vec<u64> {
    let k = free.len();
    free.iter()
        .enumerate()
        .map(|(i, &f)| {
            let mut fixed = overhead;
            if i == 0 {
                fixed += footprint.embedding_bytes;
            }
            if i + 1 == k {
                fixed += footprint.output_bytes;
            }
            f.saturating_sub(fixed)
        })
        .collect()
}

/// Layers in proportion to each node's capacity (at least one each).
fn weighted_counts(footprint: &Footprint, kv: KvBudget, overhead: u64, free: &[u64]) -> Vec<usize> {
    let layers = footprint.layers() as usize;
    let k = free.len();
    let caps = layer_capacity(footprint, overhead, free);
    let total_cap: u128 = caps.iter().map(|&c| c as u128).sum();
    let total_cost: u128 = (0..layers as u32)
        .map(|l| footprint.layer_cost(l, kv) as u128)
        .sum();
    if total_cap == 0 {
        return even_counts(layers, k);
    }
    // Walk the layers; a stage ends where the cumulative cost passes its
    // cumulative share of the total.
    let mut counts = Vec::with_capacity(k);
    let mut layer = 0usize;
    let mut cum_cost: u128 = 0;
    let mut cum_cap: u128 = 0;
    for (i, &cap) in caps.iter().enumerate() {
        let remaining_stages = k - i - 1;
        if remaining_stages == 0 {
            counts.push(layers - layer);
            break;
        }
        cum_cap += cap as u128;
        let target = total_cost * cum_cap / total_cap;
        let start = layer;
        // At least one layer here, and one left for every later stage.
        while layer < layers - remaining_stages
            && (layer == start || {
                let next = cum_cost + footprint.layer_cost(layer as u32, kv) as u128;
                // Take the layer if that lands closer to the target than stopping.
                next <= target || next - target < target.saturating_sub(cum_cost)
            })
        {
            cum_cost += footprint.layer_cost(layer as u32, kv) as u128;
            layer += 1;
        }
        counts.push(layer - start);
    }
    counts
}

/// Fills each node in turn as far as it fits, leaving a layer for each later
/// stage; `None` when the last stage cannot hold what is left.
fn fill_counts(
    footprint: &Footprint,
    kv: KvBudget,
    overhead: u64,
    free: &[u64],
) -> Option<Vec<usize>> {
    let layers = footprint.layers() as usize;
    let k = free.len();
    let caps = layer_capacity(footprint, overhead, free);
    let mut counts = Vec::with_capacity(k);
    let mut layer = 0usize;
    for (i, &cap) in caps.iter().enumerate() {
        let remaining_stages = k - i - 1;
        if remaining_stages == 0 {
            counts.push(layers - layer);
            break;
        }
        let start = layer;
        let mut used = 0u64;
        while layer < layers - remaining_stages {
            let cost = footprint.layer_cost(layer as u32, kv);
            if used + cost > cap {
                break;
            }
            used += cost;
            layer += 1;
        }
        if layer == start {
            return None;
        }
        counts.push(layer - start);
    }
    Some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(layers: usize) -> Footprint {
        Footprint {
            layer_bytes: vec![100; layers],
            embedding_bytes: 50,
            output_bytes: 50,
            kv_bytes_per_token_per_layer: 0,
            kv_heads: None,
            kv_token_caps: Vec::new(),
        }
    }

    const KV: KvBudget = KvBudget {
        context_length: 1,
        sequences: 1,
    };

    #[test]
    fn even_split_puts_the_remainder_first() {
        assert_eq!(even_counts(30, 3), vec![10, 10, 10]);
        assert_eq!(even_counts(31, 3), vec![11, 10, 10]);
    }

    #[test]
    fn weighted_split_follows_memory() {
        // Capacities for layers 1450, 3000, 1450 (embedding and head take 50).
        let r = split_layers(
            &model(40),
            KV,
            0,
            &[1500, 3000, 1500],
            Policy::MemoryWeighted,
        )
        .unwrap();
        let lens: Vec<usize> = r.iter().map(|r| r.len()).collect();
        assert_eq!(lens, vec![10, 20, 10]);
    }

    #[test]
    fn fill_uses_the_first_nodes_fully() {
        let r = split_layers(&model(10), KV, 0, &[1050, 10_000], Policy::FewestNodes).unwrap();
        // 1050 less the embedding holds 10 layers, but one is left for the last stage.
        assert_eq!(r, vec![0..9, 9..10]);
    }

    #[test]
    fn nothing_fits_is_none() {
        assert!(split_layers(&model(10), KV, 0, &[500, 500], Policy::MemoryWeighted).is_none());
        assert!(split_layers(&model(2), KV, 0, &[1000, 1000, 1000], Policy::EvenLayers).is_none());
    }
}
