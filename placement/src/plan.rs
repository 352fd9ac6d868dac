//! Planning one deployment: keep what stands, repair what lost nodes, place
//! what is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::cluster::Cluster;
use crate::explain;
use crate::footprint::{Footprint, KvBudget};
use crate::order::order_ring;
use crate::split::{Room, split_layers};
use crate::tensor::TensorRank;
use crate::tensor::{link_peers, pipeline_stages};

/// The tier of the pool a deployment runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Whole models, one replica per dedicated node.
    Daily,
    /// Models sharded across nodes.
    Reasoning,
}

/// How a model is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parallelism {
    /// The whole model on one node.
    None,
    /// Layer ranges on successive nodes.
    Pipeline,
    /// Every layer split across the ranks of a tensor group; groups in
    /// pipeline order.
    Tensor,
}

/// How layers are assigned to the chosen nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// In proportion to free memory.
    MemoryWeighted,
    /// Fill each node before the next.
    FewestNodes,
    /// Equal numbers of layers.
    EvenLayers,
}

/// A sharding strategy, as placement needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strategy {
    /// How the model is split.
    pub parallelism: Parallelism,
    /// How layers are assigned.
    pub policy: Policy,
    /// Fewest nodes per instance.
    pub min_nodes: u32,
    /// Most nodes per instance (the model's layer count when unset).
    pub max_nodes: Option<u32>,
    /// KV cache every instance reserves.
    pub kv: KvBudget,
    /// Bytes each stage needs beyond weights and KV cache.
    pub stage_overhead: u64,
    /// Highest round-trip latency allowed between adjacent stages.
    pub max_latency_micros: Option<u32>,
    /// Lowest throughput allowed between adjacent stages.
    pub min_bandwidth_mbps: Option<u32>,
    /// Only RDMA links between stages.
    pub require_rdma: bool,
    /// Ranks per tensor group (tensor parallelism); `None`: one group of
    /// every node of the instance.
    pub tensor_size: Option<u32>,
}

/// One stage: a layer range on a node (or one rank of a tensor group that
/// computes the range together).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Stage {
    /// The node.
    pub node: String,
    /// Layers `[start, end)`.
    pub layers: Range<u32>,
    /// Set on each rank of a tensor group; the ranks of one group are
    /// adjacent in [`Instance::stages`], rank 0 first.
    pub tensor: Option<TensorRank>,
}

impl Stage {
    /// Layers `layers` on `node`, not split.
    pub fn new(node: impl Into<String>, layers: Range<u32>) -> Self {
        Stage {
            node: node.into(),
            layers,
            tensor: None,
        }
    }
}

/// One instance: a full copy of the model over its stages, in pipeline order
/// (a tensor group's ranks side by side, rank 0 first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Index within the deployment.
    pub index: u32,
    /// Stages in pipeline order.
    pub stages: Vec<Stage>,
}

/// What to place.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    /// The deployment's name (unique in the cluster view).
    pub deployment: &'a str,
    /// The pool's tier.
    pub tier: Tier,
    /// Instances wanted.
    pub replicas: u32,
    /// The model's memory.
    pub footprint: &'a Footprint,
    /// The strategy.
    pub strategy: &'a Strategy,
    /// The deployment's current placement (from its Shards); the cluster's free
    /// memory must not count it.
    pub current: &'a [Instance],
}

/// Why instances could not be placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnplaceableReason {
    /// No node in the pool may take shards.
    NoSchedulableNodes,
    /// Not enough memory on the nodes there are.
    InsufficientMemory,
    /// The links between nodes do not meet the strategy's requirements.
    LinkRequirements,
    /// The strategy cannot be placed (e.g. tensor parallelism).
    UnsupportedStrategy,
}

impl UnplaceableReason {
    /// The CamelCase word for conditions and events.
    pub fn as_str(self) -> &'static str {
        match self {
            UnplaceableReason::NoSchedulableNodes => "NoSchedulableNodes",
            UnplaceableReason::InsufficientMemory => "InsufficientMemory",
            UnplaceableReason::LinkRequirements => "LinkRequirements",
            UnplaceableReason::UnsupportedStrategy => "UnsupportedStrategy",
        }
    }
}

impl Instance {
    /// The pipeline's stages in order: each a lone entry of
    /// [`Instance::stages`] or the ranks of one tensor group (rank 0 first).
    /// An instance whose groups are broken is read entry by entry.
    pub fn pipeline(&self) -> Vec<&[Stage]> {
        pipeline_stages(&self.stages).unwrap_or_else(|| self.stages.chunks(1).collect::<Vec<_>>())
    }
}

/// Instances that could not be placed, and why, in numbers a person can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unplaceable {
    /// Why.
    pub reason: UnplaceableReason,
    /// What is needed and what there is.
    pub message: String,
}

/// The placement of one deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Placed instances, by index.
    pub instances: Vec<Instance>,
    /// Set when fewer than `replicas` instances could be placed.
    pub unplaced: Option<Unplaceable>,
}

/// Plans one deployment and reserves what the plan uses in `cluster` (so a
/// later request sees the memory taken).
pub fn plan(cluster: &mut Cluster, request: &Request<'_>) -> Plan {
    let planner = Planner { request };
    // One slot per replica: the caller bounds `replicas` (a spec's bound).
    let mut placed: Vec<Option<Instance>> = vec![None; request.replicas as usize];

    // Keep what still stands before placing anything new, so new instances do
    // not take the memory of existing ones.
    for instance in request
        .current
        .iter()
        .filter(|i| i.index < request.replicas)
    {
        if planner.stands(cluster, instance, &placed) {
            planner.reserve(cluster, instance);
            placed[instance.index as usize] = Some(instance.clone());
        }
    }
    // Repair instances that lost stages, moving only those.
    for instance in request
        .current
        .iter()
        .filter(|i| i.index < request.replicas)
    {
        if placed[instance.index as usize].is_none()
            && let Some(repaired) = planner.repair(cluster, instance, &placed)
        {
            planner.reserve(cluster, &repaired);
            placed[instance.index as usize] = Some(repaired);
        }
    }
    let mut unplaced = None;
    for index in 0..request.replicas {
        if placed[index as usize].is_some() {
            continue;
        }
        match planner.place(cluster, index, &placed) {
            Ok(instance) => {
                planner.reserve(cluster, &instance);
                placed[index as usize] = Some(instance);
            }
            Err(why) => {
                unplaced = Some(why);
                break;
            }
        }
    }
    let instances: Vec<Instance> = placed.into_iter().flatten().collect();
    if let Some(why) = &mut unplaced {
        why.message = format!(
            "placed {} of {} instances: {}",
            instances.len(),
            request.replicas,
            why.message
        );
    }
    Plan {
        instances,
        unplaced,
    }
}

/// Whether the stages run every layer once, in order, none empty (and every
/// tensor group is whole).
fn covers_model(instance: &Instance, layers: u32) -> bool {
    let Some(groups) = pipeline_stages(&instance.stages) else {
        return false;
    };
    let stages: Vec<&Stage> = groups.iter().map(|g| &g[0]).collect();
    stages.first().is_some_and(|f| f.layers.start == 0)
        && stages.last().is_some_and(|l| l.layers.end == layers)
        && stages
            .windows(2)
            .all(|w| w[0].layers.end == w[1].layers.start)
        && stages.iter().all(|st| st.layers.start < st.layers.end)
}

pub(crate) struct Planner<'r, 'a> {
    pub(crate) request: &'r Request<'a>,
}

impl Planner<'_, '_> {
    fn daily(&self) -> bool {
        self.request.tier == Tier::Daily || self.request.strategy.parallelism == Parallelism::None
    }

    pub(crate) fn kv(&self) -> KvBudget {
        self.request.strategy.kv
    }

    /// The model as `node`'s engine holds it (the request's footprint for a
    /// node that does not say, or is not in the cluster, or says it for
    /// another number of layers).
    pub(crate) fn footprint_on<'c>(&'c self, cluster: &'c Cluster, node: &str) -> &'c Footprint {
        self.held(cluster.nodes.get(node).and_then(|n| n.footprint.as_deref()))
    }

    /// The model as a tensor rank on `node` holds it (see
    /// [`Planner::footprint_on`]).
    pub(crate) fn rank_footprint_on<'c>(
        &'c self,
        cluster: &'c Cluster,
        node: &str,
    ) -> &'c Footprint {
        self.held(
            cluster
                .nodes
                .get(node)
                .and_then(|n| n.rank_footprint.as_deref()),
        )
    }

    fn held<'c>(&'c self, footprint: Option<&'c Footprint>) -> &'c Footprint {
        footprint
            .filter(|f| f.layers() == self.request.footprint.layers())
            .unwrap_or(self.request.footprint)
    }

    /// Bytes of the whole model, weights and KV for the budget, as
    /// `footprint` counts it (no stage overhead): what ranks nodes by room.
    pub(crate) fn whole_bytes(&self, footprint: &Footprint) -> u64 {
        footprint
            .weight_bytes()
            .saturating_add(footprint.kv_bytes(self.kv()))
    }

    /// Bytes `layers` need as one stage on `node`.
    fn stage_bytes(&self, cluster: &Cluster, node: &str, layers: &Range<u32>) -> u64 {
        self.footprint_on(cluster, node).stage_bytes(
            layers,
            self.kv(),
            self.request.strategy.stage_overhead,
        )
    }

    /// Bytes one entry of an instance needs on `node` (its own, or one
    /// that would replace it): its stage, or its rank's share of it.
    pub(crate) fn entry_bytes(&self, cluster: &Cluster, stage: &Stage, node: &str) -> u64 {
        match &stage.tensor {
            None => self.stage_bytes(cluster, node, &stage.layers),
            Some(rank) => self.rank_footprint_on(cluster, node).rank_bytes(
                &stage.layers,
                self.kv(),
                self.request.strategy.stage_overhead,
                rank,
            ),
        }
    }

    /// Nodes other instances of this deployment use.
    fn nodes_in_use(placed: &[Option<Instance>], except: u32) -> BTreeSet<&str> {
        placed
            .iter()
            .flatten()
            .filter(|i| i.index != except)
            .flat_map(|i| i.stages.iter().map(|s| s.node.as_str()))
            .collect()
    }

    pub(crate) fn node_usable(&self, cluster: &Cluster, node: &str) -> bool {
        cluster
            .nodes
            .get(node)
            .is_some_and(|n| n.schedulable && n.admits(self.request.deployment, self.daily()))
    }

    pub(crate) fn link_ok(&self, cluster: &Cluster, a: &str, b: &str) -> bool {
        let s = self.request.strategy;
        if a == b {
            return true;
        }
        let link = cluster.link(a, b);
        let needs_measurement =
            s.require_rdma || s.max_latency_micros.is_some() || s.min_bandwidth_mbps.is_some();
        match link {
            None => !needs_measurement,
            Some(l) => {
                (!s.require_rdma || l.rdma)
                    && s.max_latency_micros
                        .is_none_or(|max| l.latency_micros <= max)
                    && s.min_bandwidth_mbps
                        .is_none_or(|min| l.bandwidth_mbps.is_some_and(|b| b >= min))
            }
        }
    }

    /// Adjacent stages' links, and every link within a tensor group.
    pub(crate) fn links_ok(&self, cluster: &Cluster, stages: &[Stage]) -> bool {
        (0..stages.len()).all(|i| {
            link_peers(stages, i)
                .into_iter()
                .all(|j| self.link_ok(cluster, &stages[i].node, &stages[j].node))
        })
    }

    /// Whether an existing instance still stands as it is.
    fn stands(&self, cluster: &Cluster, instance: &Instance, placed: &[Option<Instance>]) -> bool {
        let layers = self.request.footprint.layers();
        let k = instance.stages.len() as u32;
        let s = self.request.strategy;
        let shape_ok = if self.daily() {
            k == 1
        } else {
            k >= s.min_nodes.max(1)
                && s.max_nodes.is_none_or(|m| k <= m)
                && self.tensor_shape_ok(&instance.stages)
        };
        let covers = covers_model(instance, layers);
        let others = Self::nodes_in_use(placed, instance.index);
        let distinct_ok = !self.daily()
            || instance
                .stages
                .iter()
                .all(|st| !others.contains(st.node.as_str()));
        // Memory per node (two stages may share a node).
        let mut need: BTreeMap<&str, u64> = Default::default();
        for st in &instance.stages {
            let bytes = self.entry_bytes(cluster, st, &st.node);
            let sum = need.entry(st.node.as_str()).or_default();
            *sum = sum.saturating_add(bytes);
        }
        shape_ok
            && covers
            && distinct_ok
            && instance
                .stages
                .iter()
                .all(|st| self.node_usable(cluster, &st.node))
            && need.iter().all(|(n, b)| cluster.nodes[*n].free_bytes >= *b)
            && self.links_ok(cluster, &instance.stages)
    }

    /// Moves only the stages whose nodes are gone, when replacements fit.
    fn repair(
        &self,
        cluster: &Cluster,
        instance: &Instance,
        placed: &[Option<Instance>],
    ) -> Option<Instance> {
        let layers = self.request.footprint.layers();
        let covers = covers_model(instance, layers);
        // Another split (pipeline or tensor, another tensorSize) is placed anew.
        if !covers || !self.tensor_shape_ok(&instance.stages) {
            return None;
        }
        let others = Self::nodes_in_use(placed, instance.index);
        let mut stages = instance.stages.clone();
        let mut taken: BTreeSet<String> = stages
            .iter()
            .filter(|s| self.node_usable(cluster, &s.node))
            .map(|s| s.node.clone())
            .collect();
        for i in 0..stages.len() {
            let fits = |name: &str, n: &crate::cluster::Node| {
                n.free_bytes >= self.entry_bytes(cluster, &stages[i], name)
            };
            let ok = self.node_usable(cluster, &stages[i].node)
                && fits(&stages[i].node, &cluster.nodes[&stages[i].node]);
            if ok {
                continue;
            }
            let peers = link_peers(&stages, i);
            let replacement = cluster
                .nodes
                .iter()
                .filter(|(name, n)| {
                    fits(name, n)
                        && self.node_usable(cluster, name)
                        && !taken.contains(*name)
                        && !(self.daily() && others.contains(name.as_str()))
                })
                .filter(|(name, _)| {
                    peers
                        .iter()
                        .all(|&p| self.link_ok(cluster, &stages[p].node, name))
                })
                .min_by_key(|(name, n)| {
                    let cost: u64 = peers
                        .iter()
                        .map(|&p| cluster.hop_cost(&stages[p].node, name))
                        .sum();
                    (
                        !n.has_weights,
                        cost,
                        std::cmp::Reverse(n.free_bytes),
                        (*name).clone(),
                    )
                })
                .map(|(name, _)| name.clone())?;
            taken.insert(replacement.clone());
            stages[i].node = replacement;
        }
        Some(Instance {
            index: instance.index,
            stages,
        })
    }

    /// Places one instance from scratch.
    fn place(
        &self,
        cluster: &Cluster,
        index: u32,
        placed: &[Option<Instance>],
    ) -> Result<Instance, Unplaceable> {
        let others = Self::nodes_in_use(placed, index);
        let usable: Vec<(&String, &crate::cluster::Node)> = cluster
            .nodes
            .iter()
            .filter(|(name, _)| self.node_usable(cluster, name))
            .collect();
        if usable.is_empty() {
            return Err(Unplaceable {
                reason: UnplaceableReason::NoSchedulableNodes,
                message: explain::no_nodes(cluster, self.request.deployment, self.daily()),
            });
        }
        if self.daily() {
            return self.place_whole(cluster, index, &usable, &others);
        }
        if self.request.strategy.parallelism == Parallelism::Tensor {
            return self.place_tensor(cluster, index, &usable, &others);
        }
        self.place_pipeline(cluster, index, &usable, &others)
    }

    fn place_whole(
        &self,
        cluster: &Cluster,
        index: u32,
        usable: &[(&String, &crate::cluster::Node)],
        others: &BTreeSet<&str>,
    ) -> Result<Instance, Unplaceable> {
        let all = 0..self.request.footprint.layers();
        let need = |name: &str| self.stage_bytes(cluster, name, &all);
        let footprint_on = |name: &str| self.footprint_on(cluster, name);
        if usable
            .iter()
            .all(|(name, _)| others.contains(name.as_str()))
        {
            return Err(Unplaceable {
                reason: UnplaceableReason::NoSchedulableNodes,
                message: explain::no_spare_node(usable.len()),
            });
        }
        // Nodes with the weights first, then the tightest fit (big nodes stay free for big models).
        let best = usable
            .iter()
            .filter(|(name, n)| n.free_bytes >= need(name) && !others.contains(name.as_str()))
            .min_by(|(a, na), (b, nb)| {
                (!na.has_weights, na.free_bytes)
                    .cmp(&(!nb.has_weights, nb.free_bytes))
                    .then_with(|| a.cmp(b))
            });
        match best {
            Some((name, _)) => Ok(Instance {
                index,
                stages: vec![Stage::new((*name).clone(), all)],
            }),
            None => Err(Unplaceable {
                reason: UnplaceableReason::InsufficientMemory,
                message: explain::whole(self.request, &footprint_on, usable, others),
            }),
        }
    }

    fn place_pipeline(
        &self,
        cluster: &Cluster,
        index: u32,
        usable: &[(&String, &crate::cluster::Node)],
        others: &BTreeSet<&str>,
    ) -> Result<Instance, Unplaceable> {
        let s = self.request.strategy;
        let layers = self.request.footprint.layers();
        let min_k = s.min_nodes.max(1) as usize;
        let max_k = (s.max_nodes.unwrap_or(layers).min(layers) as usize).min(usable.len());
        // Preference: holds the weights, not used by another instance of this
        // deployment, most room for the model as the node holds it, name.
        let whole = |name: &str| self.whole_bytes(self.footprint_on(cluster, name));
        let (ranked, by_room) = preferred(usable, others, &whole);
        let mut link_blocked = false;
        // Even layers spread over maxNodes nodes when it is set (the strategy
        // asks for that many stages); the other policies take the fewest that fit.
        let counts: Vec<usize> = if s.policy == Policy::EvenLayers && s.max_nodes.is_some() {
            (min_k..=max_k).rev().collect()
        } else {
            (min_k..=max_k).collect()
        };
        for k in counts {
            for pool in [&ranked, &by_room] {
                let chosen: Vec<&str> =
                    pool.iter().take(k).map(|(name, _)| name.as_str()).collect();
                let order = order_ring(cluster, &chosen);
                let rooms: Vec<Room<'_>> = order
                    .iter()
                    .map(|n| (self.footprint_on(cluster, n), cluster.nodes[*n].free_bytes))
                    .collect();
                let Some(ranges) = split_layers(&rooms, self.kv(), s.stage_overhead, s.policy)
                else {
                    continue;
                };
                let stages: Vec<Stage> = order
                    .iter()
                    .zip(ranges)
                    .map(|(n, layers)| Stage::new(*n, layers))
                    .collect();
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
                message: explain::links(s),
            });
        }
        Err(self.too_little_memory(cluster, usable, (min_k, max_k), false))
    }

    /// No split of `min_k` to `max_k` nodes (`ranks`: in tensor ranks)
    /// fits: what one needs, and what the pool has.
    pub(crate) fn too_little_memory(
        &self,
        cluster: &Cluster,
        usable: &[Usable<'_>],
        (min_k, max_k): (usize, usize),
        ranks: bool,
    ) -> Unplaceable {
        let footprint_on = |name: &str| match ranks {
            true => self.rank_footprint_on(cluster, name),
            false => self.footprint_on(cluster, name),
        };
        Unplaceable {
            reason: UnplaceableReason::InsufficientMemory,
            message: explain::pipeline(self.request, &footprint_on, usable, min_k, max_k),
        }
    }

    /// Takes the memory `instance` uses from the cluster, and the daily
    /// deployment's nodes for itself.
    fn reserve(&self, cluster: &mut Cluster, instance: &Instance) {
        for st in &instance.stages {
            let bytes = self.entry_bytes(cluster, st, &st.node);
            if let Some(node) = cluster.nodes.get_mut(&st.node) {
                node.free_bytes = node.free_bytes.saturating_sub(bytes);
                node.occupants.insert(self.request.deployment.to_string());
                if self.daily() {
                    node.dedicated_to = Some(self.request.deployment.to_string());
                }
            }
        }
    }
}

/// A node placement may use, by name.
pub(crate) type Usable<'n> = (&'n String, &'n crate::cluster::Node);

/// The nodes to choose from, in two orders: preferred (holds the weights,
/// not used by another instance of this deployment, most room, name) and by
/// room alone. A node's room is the share of the model its free memory
/// holds as its own engine holds the model (`whole`: the model's bytes,
/// weights and KV, on that node), so a node with a leaner engine can rank
/// above one with more free bytes.
pub(crate) fn preferred<'u, 'n>(
    usable: &'u [Usable<'n>],
    others: &BTreeSet<&str>,
    whole: &dyn Fn(&str) -> u64,
) -> (Vec<&'u Usable<'n>>, Vec<&'u Usable<'n>>) {
    let room: BTreeMap<&str, (u64, u64)> = usable
        .iter()
        // A model of no bytes counts as one, so that room stays a total order.
        .map(|(name, n)| (name.as_str(), (n.free_bytes, whole(name).max(1))))
        .collect();
    // Most room first: free_a / whole_a > free_b / whole_b, compared exactly.
    let more_room = |a: &str, b: &str| {
        let ((free_a, whole_a), (free_b, whole_b)) = (room[a], room[b]);
        (u128::from(free_b) * u128::from(whole_a)).cmp(&(u128::from(free_a) * u128::from(whole_b)))
    };
    let mut ranked: Vec<_> = usable.iter().collect();
    ranked.sort_by(|(a, na), (b, nb)| {
        (!na.has_weights, others.contains(a.as_str()))
            .cmp(&(!nb.has_weights, others.contains(b.as_str())))
            .then_with(|| more_room(a, b))
            .then_with(|| a.cmp(b))
    });
    let mut by_room = ranked.clone();
    by_room.sort_by(|(a, _), (b, _)| more_room(a, b).then_with(|| a.cmp(b)));
    (ranked, by_room)
}
