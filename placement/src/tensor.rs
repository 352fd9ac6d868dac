//! Tensor-parallel instances: every layer of a stage split across the ranks
//! of a group, the groups in pipeline order.
//!
//! ```text
//!   instance.stages:  [a r0 0..30] [b r1 0..30]              one group of 2
//!                     [a r0 0..15] [b r1 0..15] [c r0 15..30] [d r1 15..30]
//!                      └── stage 0 (tensorSize 2) ──┘ └── stage 1 ──────┘
//!   links checked:    every pair within a group; leader to leader between stages
//! ```
//!
//! A rank's share of a layer's weights follows its weight (free memory
//! under `memoryWeighted`, equal otherwise). Its KV cache goes by whole KV
//! heads (the engine rounds to whole heads, at least one each), so it is
//! counted as the most heads the rank may get. The attention weights follow
//! the same rounding while the MLP's (most of a layer) split by the weight:
//! a rank may hold up to one KV head's attention weights more than counted,
//! which the stage overhead covers. Every rank of the first stage holds the
//! embedding; rank 0 of the last holds the output head.

use std::collections::BTreeSet;
use std::ops::Range;

use crate::cluster::{Cluster, Node};
use crate::explain;
use crate::footprint::{Footprint, KvBudget};
use crate::order::order_ring;
use crate::plan::{Instance, Planner, Policy, Stage, Unplaceable, UnplaceableReason, preferred};
use crate::split::{Room, split_layers};

/// One rank of a tensor group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorRank {
    /// This rank (0 leads).
    pub rank: u32,
    /// Every rank's weight, in rank order.
    pub weights: Vec<u32>,
}

impl TensorRank {
    /// This rank's weight and the sum of all ranks' weights.
    fn weight(&self) -> (u64, u64) {
        let total: u64 = self.weights.iter().map(|&w| u64::from(w)).sum();
        let mine = self
            .weights
            .get(self.rank as usize)
            .map_or(0, |&w| u64::from(w));
        (mine, total.max(1))
    }

    /// This rank's fraction of a layer's weights, in parts per million
    /// (rounded up).
    fn weights_ppm(&self) -> u64 {
        let (mine, total) = self.weight();
        (mine * 1_000_000).div_ceil(total).min(1_000_000)
    }

    /// This rank's fraction of a layer's KV cache, in parts per million:
    /// the most whole KV heads (of `kv_heads`, when known) the engine may
    /// give it, at least one.
    fn kv_ppm(&self, kv_heads: Option<u32>) -> u64 {
        let (mine, total) = self.weight();
        match kv_heads.filter(|&h| h > 0) {
            Some(h) => {
                let heads = (u64::from(h) * mine).div_ceil(total).max(1);
                (heads * 1_000_000).div_ceil(u64::from(h)).min(1_000_000)
            }
            None => self.weights_ppm(),
        }
    }
}

impl Footprint {
    /// Bytes rank `rank` of a group running `layers` needs: its share of
    /// the layers' weights (by its weight) and KV (by the whole KV heads it
    /// may get), the embedding (first stage), the output head (rank 0 of the
    /// last stage), and `overhead`.
    pub fn rank_bytes(
        &self,
        layers: &Range<u32>,
        kv: KvBudget,
        overhead: u64,
        rank: &TensorRank,
    ) -> u64 {
        let part = |bytes: u64, ppm: u64| {
            u64::try_from(u128::from(bytes) * u128::from(ppm) / 1_000_000).unwrap_or(u64::MAX)
        };
        let weights = layers.clone().fold(0u64, |sum, l| {
            sum.saturating_add(self.layer_bytes[l as usize])
        });
        let kv_bytes = self.layers_kv_bytes(layers, kv);
        let mut bytes = part(weights, rank.weights_ppm())
            .saturating_add(part(kv_bytes, rank.kv_ppm(self.kv_heads)))
            .saturating_add(overhead);
        if layers.start == 0 {
            bytes = bytes.saturating_add(self.embedding_bytes);
        }
        if layers.end == self.layers() && rank.rank == 0 {
            bytes = bytes.saturating_add(self.output_bytes);
        }
        bytes
    }
}

/// The instance's pipeline stages: each a lone entry or a whole tensor
/// group (rank 0 first, ranks in order, one layer range, one set of
/// weights, distinct nodes); `None` when a group is broken.
pub(crate) fn pipeline_stages(stages: &[Stage]) -> Option<Vec<&[Stage]>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < stages.len() {
        let n = match &stages[i].tensor {
            None => 1,
            Some(t) if t.rank == 0 => t.weights.len(),
            Some(_) => return None,
        };
        let group = stages.get(i..i + n)?;
        let whole = group.iter().enumerate().all(|(r, st)| {
            st.layers == group[0].layers
                && match (&st.tensor, &group[0].tensor) {
                    (Some(t), Some(lead)) => t.rank as usize == r && t.weights == lead.weights,
                    (None, None) => true,
                    _ => false,
                }
        });
        let nodes: BTreeSet<&str> = group.iter().map(|s| s.node.as_str()).collect();
        if !whole || nodes.len() != n {
            return None;
        }
        out.push(group);
        i += n;
    }
    Some(out)
}

/// The entries entry `i` must have a good link to: the other ranks of its
/// group, and (for a leader or a lone stage) the leaders of the stages
/// before and after it.
pub(crate) fn link_peers(stages: &[Stage], i: usize) -> Vec<usize> {
    let Some(groups) = pipeline_stages(stages) else {
        // Not a well-formed instance: adjacent entries, as a pipeline.
        return [i.checked_sub(1), (i + 1 < stages.len()).then_some(i + 1)]
            .into_iter()
            .flatten()
            .collect();
    };
    let mut starts = Vec::with_capacity(groups.len());
    let mut at = 0;
    for g in &groups {
        starts.push(at..at + g.len());
        at += g.len();
    }
    let Some(mine) = starts.iter().position(|r| r.contains(&i)) else {
        return Vec::new();
    };
    let mut peers: Vec<usize> = starts[mine].clone().filter(|&j| j != i).collect();
    if starts[mine].start == i {
        peers.extend(mine.checked_sub(1).map(|p| starts[p].start));
        peers.extend(starts.get(mine + 1).map(|r| r.start));
    }
    peers
}

impl Planner<'_, '_> {
    /// Whether an instance's entries are the groups the strategy asks for.
    pub(crate) fn tensor_shape_ok(&self, stages: &[Stage]) -> bool {
        let s = self.request.strategy;
        let Some(groups) = pipeline_stages(stages) else {
            return false;
        };
        if s.parallelism != crate::plan::Parallelism::Tensor {
            return stages.iter().all(|st| st.tensor.is_none());
        }
        let heads_ok = |n: usize| {
            self.request
                .footprint
                .kv_heads
                .is_none_or(|h| n <= h as usize)
        };
        match s.tensor_size {
            Some(size) => groups
                .iter()
                .all(|g| g.len() == size as usize && g[0].tensor.is_some() && heads_ok(g.len())),
            None => groups.len() == 1 && groups[0].len() >= 2 && heads_ok(groups[0].len()),
        }
    }

    /// Places one instance of tensor groups from scratch: the fewest nodes
    /// that fit (at least `minNodes`, at least 2), in groups of
    /// `tensorSize` (or one group), as many ranks as the model has KV heads
    /// at most.
    pub(crate) fn place_tensor(
        &self,
        cluster: &Cluster,
        index: u32,
        usable: &[(&String, &Node)],
        others: &BTreeSet<&str>,
    ) -> Result<Instance, Unplaceable> {
        let s = self.request.strategy;
        let footprint = self.request.footprint;
        let layers = footprint.layers() as usize;
        let kv_heads = footprint.kv_heads.map_or(usize::MAX, |h| h as usize);
        let min_k = s.min_nodes.max(2) as usize;
        let max_k = s
            .max_nodes
            .map_or(usable.len(), |m| m as usize)
            .min(usable.len());
        let whole = |name: &str| self.whole_bytes(self.rank_footprint_on(cluster, name));
        let (ranked, by_room) = preferred(usable, others, &whole);
        let mut link_blocked = false;
        let mut too_many_ranks = None;
        for k in min_k..=max_k {
            let size = s.tensor_size.map_or(k, |t| t as usize);
            if size < 2 || !k.is_multiple_of(size) || k / size > layers {
                continue;
            }
            if size > kv_heads {
                too_many_ranks.get_or_insert(size);
                continue;
            }
            let mut candidates: Vec<Vec<Vec<&str>>> = [&ranked, &by_room]
                .iter()
                .map(|pool| {
                    let chosen: Vec<&str> = pool.iter().take(k).map(|(n, _)| n.as_str()).collect();
                    let order = order_ring(cluster, &chosen);
                    order.chunks(size).map(<[&str]>::to_vec).collect()
                })
                .collect();
            candidates.extend(self.linked_groups(cluster, &ranked, k / size, size));
            for groups in candidates {
                let Some(stages) = self.split_groups(cluster, &groups) else {
                    continue;
                };
                if !self.links_ok(cluster, &stages) {
                    link_blocked = true;
                    continue;
                }
                return Ok(Instance { index, stages });
            }
        }
        if link_blocked {
            return Err(Unplaceable {
                reason: UnplaceableReason::LinkRequirements,
                message: format!("{} (within each tensor group too)", explain::links(s)),
            });
        }
        if let Some(size) = too_many_ranks
            && max_k >= min_k
        {
            return Err(Unplaceable {
                reason: UnplaceableReason::UnsupportedStrategy,
                message: format!(
                    "a tensor group of {size} ranks needs at least {size} KV heads (attention is \
                     split by whole KV heads); the model has {kv_heads}: lower tensorSize or maxNodes"
                ),
            });
        }
        Err(self.too_little_memory(cluster, usable, (min_k, max_k), true))
    }

    /// `count` groups of `size` nodes whose links within the group meet the
    /// strategy: each group taken greedily from `ranked` (a node joins when
    /// its links to every member so far do); `None` when they do not come
    /// together.
    fn linked_groups<'n>(
        &self,
        cluster: &Cluster,
        ranked: &[&(&'n String, &'n Node)],
        count: usize,
        size: usize,
    ) -> Option<Vec<Vec<&'n str>>> {
        let mut left: Vec<&'n str> = ranked.iter().map(|(n, _)| n.as_str()).collect();
        let mut groups = Vec::with_capacity(count);
        for _ in 0..count {
            let mut group: Vec<&str> = Vec::with_capacity(size);
            left.retain(|n| {
                let joins = group.len() < size && group.iter().all(|m| self.link_ok(cluster, m, n));
                if joins {
                    group.push(n);
                }
                !joins
            });
            if group.len() < size {
                return None;
            }
            groups.push(group);
        }
        Some(groups)
    }

    /// Layers split across `groups` (pipeline order) by the strategy's
    /// policy, every rank checked against its node's free memory; `None`
    /// when some rank does not fit.
    fn split_groups(&self, cluster: &Cluster, groups: &[Vec<&str>]) -> Option<Vec<Stage>> {
        let s = self.request.strategy;
        let free = |n: &str| cluster.nodes[n].free_bytes;
        // A group holds what its nodes hold, less what every rank repeats
        // (its overhead, and on the first stage the embedding), counted as
        // its first rank's engine holds the model (every rank is checked
        // on its own below).
        let rooms: Vec<Room<'_>> = groups
            .iter()
            .enumerate()
            .map(|(g, nodes)| {
                let footprint = self.rank_footprint_on(cluster, nodes[0]);
                let repeated = s.stage_overhead.saturating_add(if g == 0 {
                    footprint.embedding_bytes
                } else {
                    0
                });
                let capacity = nodes
                    .iter()
                    .map(|n| free(n))
                    .fold(0u64, u64::saturating_add)
                    .saturating_sub(repeated.saturating_mul(nodes.len() as u64 - 1));
                (footprint, capacity)
            })
            .collect();
        let ranges = split_layers(&rooms, self.kv(), s.stage_overhead, s.policy)?;
        let mut stages = Vec::with_capacity(groups.len() * groups[0].len());
        for (nodes, layers) in groups.iter().zip(ranges) {
            let weights: Vec<u32> = nodes
                .iter()
                .map(|n| match s.policy {
                    Policy::MemoryWeighted => {
                        u32::try_from(free(n) >> 20).unwrap_or(u32::MAX).max(1)
                    }
                    Policy::FewestNodes | Policy::EvenLayers => 1,
                })
                .collect();
            for (rank, node) in nodes.iter().enumerate() {
                let stage = Stage {
                    node: node.to_string(),
                    layers: layers.clone(),
                    tensor: Some(TensorRank {
                        rank: rank as u32,
                        weights: weights.clone(),
                    }),
                };
                if self.entry_bytes(cluster, &stage, node) > free(node) {
                    return None;
                }
                stages.push(stage);
            }
        }
        Some(stages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: u32, weights: &[u32]) -> TensorRank {
        TensorRank {
            rank,
            weights: weights.to_vec(),
        }
    }

    #[test]
    fn a_rank_s_kv_is_counted_in_whole_kv_heads() {
        // 3 KV heads, two equal ranks: the engine gives one of them 2 heads.
        assert_eq!(rank(0, &[1, 1]).kv_ppm(Some(3)), 666_667);
        assert_eq!(rank(1, &[1, 1]).kv_ppm(Some(3)), 666_667);
        assert_eq!(rank(1, &[1, 1]).weights_ppm(), 500_000);
        // Heads unknown: the weight's share.
        assert_eq!(rank(1, &[1, 3]).kv_ppm(None), 750_000);
        // A tiny weight still gets a whole head.
        assert_eq!(rank(1, &[1000, 1]).kv_ppm(Some(4)), 250_000);
    }

    #[test]
    fn groups_and_their_links() {
        let st = |node: &str, layers: Range<u32>, t: Option<TensorRank>| Stage {
            node: node.into(),
            layers,
            tensor: t,
        };
        let w = [1, 1];
        let two_by_two = vec![
            st("a", 0..15, Some(rank(0, &w))),
            st("b", 0..15, Some(rank(1, &w))),
            st("c", 15..30, Some(rank(0, &w))),
            st("d", 15..30, Some(rank(1, &w))),
        ];
        let groups = pipeline_stages(&two_by_two).unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(link_peers(&two_by_two, 0), [1, 2]);
        assert_eq!(link_peers(&two_by_two, 1), [0]);
        assert_eq!(link_peers(&two_by_two, 2), [3, 0]);
        // A group missing a rank, or two ranks on one node, is broken.
        assert!(pipeline_stages(&two_by_two[..3]).is_none());
        let mut same_node = two_by_two.clone();
        same_node[1].node = "a".into();
        assert!(pipeline_stages(&same_node).is_none());
        // Plain pipeline stages are groups of one.
        let pipe = vec![st("a", 0..10, None), st("b", 10..30, None)];
        assert_eq!(pipeline_stages(&pipe).unwrap().len(), 2);
        assert_eq!(link_peers(&pipe, 1), [0]);
    }
}
