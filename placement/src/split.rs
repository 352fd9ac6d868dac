//! Splitting a model's layers into contiguous stages that fit their nodes.

use std::ops::Range;

use crate::footprint::{Footprint, KvBudget};
use crate::plan::Policy;

/// One node a pipeline's stage may go on: the model as that node's engine
/// holds it, and the bytes free there.
pub(crate) type Room<'f> = (&'f Footprint, u64);

/// Splits the layers over `nodes` in pipeline order, so every stage fits
/// its node; `None` when no split of this policy fits.
pub(crate) fn split_layers(
    nodes: &[Room<'_>],
    kv: KvBudget,
    overhead: u64,
    policy: Policy,
) -> Option<Vec<Range<u32>>> {
    let k = nodes.len();
    let layers = nodes.first()?.0.layers() as usize;
    if k > layers || nodes.iter().any(|(f, _)| f.layers() as usize != layers) {
        return None;
    }
    let fits = |ranges: &[Range<u32>]| {
        ranges
            .iter()
            .zip(nodes)
            .all(|(r, (footprint, free))| footprint.stage_bytes(r, kv, overhead) <= *free)
    };
    let candidates: Vec<Vec<usize>> = match policy {
        Policy::EvenLayers => vec![even_counts(layers, k)],
        Policy::MemoryWeighted => {
            let mut c = vec![weighted_counts(nodes, kv, overhead)];
            // When rounding makes a stage overflow, fill greedily instead.
            c.extend(fill_counts(nodes, kv, overhead));
            c
        }
        Policy::FewestNodes => fill_counts(nodes, kv, overhead).into_iter().collect(),
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
/// embedding (first) or output head (last), as its engine holds them.
fn layer_capacity(nodes: &[Room<'_>], overhead: u64) -> Vec<u64> {
    let k = nodes.len();
    nodes
        .iter()
        .enumerate()
        .map(|(i, &(footprint, free))| {
            let mut fixed = overhead;
            if i == 0 {
                fixed = fixed.saturating_add(footprint.embedding_bytes);
            }
            if i + 1 == k {
                fixed = fixed.saturating_add(footprint.output_bytes);
            }
            free.saturating_sub(fixed)
        })
        .collect()
}

/// Bytes of all layers as `footprint` holds them, for the budget.
fn total_cost(footprint: &Footprint, kv: KvBudget) -> u128 {
    (0..footprint.layers())
        .map(|l| footprint.layer_cost(l, kv) as u128)
        .sum()
}

/// Layers in proportion to each node's capacity (at least one each). The
/// walk counts the first node's engine's bytes; a node whose engine holds
/// the model in more or fewer bytes has its capacity scaled to match (the
/// share of the model it holds stays the same).
fn weighted_counts(nodes: &[Room<'_>], kv: KvBudget, overhead: u64) -> Vec<usize> {
    let reference = nodes[0].0;
    let layers = reference.layers() as usize;
    let k = nodes.len();
    let total_cost = total_cost(reference, kv);
    let caps: Vec<u128> = layer_capacity(nodes, overhead)
        .into_iter()
        .zip(nodes)
        .map(|(cap, (footprint, _))| {
            // Exact when the footprints are the same.
            (cap as u128)
                .checked_mul(total_cost)
                .and_then(|c| c.checked_div(self::total_cost(footprint, kv)))
                .unwrap_or(cap as u128)
        })
        .collect();
    let total_cap: u128 = caps.iter().fold(0u128, |sum, &c| sum.saturating_add(c));
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
        cum_cap = cum_cap.saturating_add(cap);
        // Saturating: a hostile model's sizes read as "too big", never wrap.
        let target = total_cost.saturating_mul(cum_cap) / total_cap;
        let start = layer;
        // At least one layer here, and one left for every later stage.
        while layer < layers - remaining_stages
            && (layer == start || {
                let next = cum_cost + reference.layer_cost(layer as u32, kv) as u128;
                // Take the layer if that lands closer to the target than stopping.
                next <= target || next - target < target.saturating_sub(cum_cost)
            })
        {
            cum_cost += reference.layer_cost(layer as u32, kv) as u128;
            layer += 1;
        }
        counts.push(layer - start);
    }
    counts
}

/// Fills each node in turn as far as it fits, leaving a layer for each later
/// stage; `None` when the last stage cannot hold what is left.
fn fill_counts(nodes: &[Room<'_>], kv: KvBudget, overhead: u64) -> Option<Vec<usize>> {
    let layers = nodes[0].0.layers() as usize;
    let k = nodes.len();
    let caps = layer_capacity(nodes, overhead);
    let mut counts = Vec::with_capacity(k);
    let mut layer = 0usize;
    for (i, (&cap, (footprint, _))) in caps.iter().zip(nodes).enumerate() {
        let remaining_stages = k - i - 1;
        if remaining_stages == 0 {
            counts.push(layers - layer);
            break;
        }
        let start = layer;
        let mut used = 0u64;
        while layer < layers - remaining_stages {
            let cost = footprint.layer_cost(layer as u32, kv);
            if used.saturating_add(cost) > cap {
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

    fn rooms<'f>(footprint: &'f Footprint, free: &[u64]) -> Vec<Room<'f>> {
        free.iter().map(|&f| (footprint, f)).collect()
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
        let m = model(40);
        let r = split_layers(
            &rooms(&m, &[1500, 3000, 1500]),
            KV,
            0,
            Policy::MemoryWeighted,
        )
        .unwrap();
        let lens: Vec<usize> = r.iter().map(|r| r.len()).collect();
        assert_eq!(lens, vec![10, 20, 10]);
    }

    #[test]
    fn fill_uses_the_first_nodes_fully() {
        let m = model(10);
        let r = split_layers(&rooms(&m, &[1050, 10_000]), KV, 0, Policy::FewestNodes).unwrap();
        // 1050 less the embedding holds 10 layers, but one is left for the last stage.
        assert_eq!(r, vec![0..9, 9..10]);
    }

    #[test]
    fn nothing_fits_is_none() {
        let (ten, two) = (model(10), model(2));
        assert!(split_layers(&rooms(&ten, &[500, 500]), KV, 0, Policy::MemoryWeighted).is_none());
        assert!(
            split_layers(&rooms(&two, &[1000, 1000, 1000]), KV, 0, Policy::EvenLayers).is_none()
        );
    }

    #[test]
    fn a_node_whose_engine_holds_the_model_in_fewer_bytes_takes_more_layers() {
        // The second node's engine holds each layer in half the bytes: with
        // the same free memory it takes twice the layers, and fits them.
        let (m, half) = (
            model(30),
            Footprint {
                layer_bytes: vec![50; 30],
                ..model(30)
            },
        );
        let r = split_layers(&[(&m, 1100), (&half, 1100)], KV, 0, Policy::MemoryWeighted).unwrap();
        assert_eq!(r, vec![0..10, 10..30]);
        // Counted by the first node's engine alone, nothing would fit.
        assert!(split_layers(&rooms(&m, &[1100, 1100]), KV, 0, Policy::MemoryWeighted).is_none());
        let r = split_layers(&[(&m, 1100), (&half, 1100)], KV, 0, Policy::FewestNodes).unwrap();
        assert_eq!(r, vec![0..10, 10..30]);
    }
}
