//! What the planner sees of the cluster: a model's footprint, a strategy,
//! and the pool's nodes with the room other deployments already take.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;
use shardplane_crds::quantity::parse_bytes;
use shardplane_crds::*;
use shardplane_formats::config::PROMPT_STEP;
use shardplane_placement as placement;

use crate::controllers::node_pool::{node_allocatable, node_ready, selects};

/// Overhead assumed for another deployment's stage (its strategy is not read).
const DEFAULT_STAGE_OVERHEAD: u64 = 256 << 20;

/// The label on a Shard giving its deployment's tier.
pub const TIER_LABEL: &str = "shardplane.dev/tier";

/// A deployment's key in the planner: `namespace/name`.
pub fn deployment_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The planner's view of a model on nodes whose stages take at most
/// `prompt_step` prompt tokens a step ([`pool_prompt_step`]).
pub fn footprint(status: &ModelStatus, prompt_step: usize) -> Option<placement::Footprint> {
    let layers = status.layers? as u64;
    if layers == 0 || status.layer_bytes.len() as u64 != layers {
        return None;
    }
    Some(placement::Footprint {
        layer_bytes: status.layer_bytes.clone(),
        embedding_bytes: status.embedding_bytes.unwrap_or(0),
        output_bytes: status.output_bytes.unwrap_or(0),
        kv_bytes_per_token_per_layer: status.kv_bytes_per_token.unwrap_or(0) / layers,
        kv_heads: status.kv_heads,
        kv_token_caps: kv_token_caps(status, layers as usize, prompt_step),
    })
}

/// The planner's view of a model as `engine` holds it: `base` (its
/// footprint as stored, [`footprint`]) with that engine's weights and KV,
/// when the status has them.
pub fn engine_footprint(
    status: &ModelStatus,
    engine: Engine,
    base: &placement::Footprint,
) -> Option<placement::Footprint> {
    let held = status
        .engine_footprints
        .iter()
        .find(|e| e.engine == engine)?;
    let layers = base.layers() as u64;
    if held.layer_bytes.len() as u64 != layers {
        return None;
    }
    Some(placement::Footprint {
        layer_bytes: held.layer_bytes.clone(),
        embedding_bytes: held.embedding_bytes,
        output_bytes: held.output_bytes,
        kv_bytes_per_token_per_layer: held.kv_bytes_per_token / layers,
        ..base.clone()
    })
}

/// The engine a tensor rank runs on, whatever the node's stages run on.
const RANK_ENGINE: Engine = Engine::Candle;

/// The engine a node's agent loads stages into (the first it reports).
fn node_engine(node: &InferenceNode) -> Option<Engine> {
    node.status.as_ref()?.engines.first().copied()
}

/// Per layer, the tokens of KV a sequence holds at most there: the status's
/// sliding-window layers hold `heldTokens`, which assume the default prompt
/// step, and one row more or fewer per prompt token `prompt_step` takes
/// beyond or short of it (`sliding_rows_held`); the others every token
/// (layers the status names out of range are left out).
fn kv_token_caps(status: &ModelStatus, layers: usize, prompt_step: usize) -> Vec<Option<u64>> {
    let Some(sliding) = &status.sliding_window else {
        return Vec::new();
    };
    let held = (u64::from(sliding.held_tokens) + prompt_step as u64)
        .saturating_sub(PROMPT_STEP as u64)
        .max(1);
    let mut caps = vec![None; layers];
    for &l in &sliding.layers {
        if let Some(cap) = caps.get_mut(l as usize) {
            *cap = Some(held);
        }
    }
    caps
}

/// The most prompt tokens a step takes on the nodes `pool` selects, as
/// their agents report it (the default for one that does not): what a
/// sliding layer placed there may hold beyond its window.
pub fn pool_prompt_step(pool: &NodePool, nodes: &[Arc<InferenceNode>]) -> usize {
    nodes
        .iter()
        .filter(|n| selects(pool, n))
        .map(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.prompt_step_tokens)
                .map_or(PROMPT_STEP, |s| s as usize)
        })
        .max()
        .unwrap_or(PROMPT_STEP)
}

/// The planner's view of a strategy.
pub fn strategy(spec: &ShardingStrategySpec) -> placement::Strategy {
    let links = spec.links.clone().unwrap_or_default();
    placement::Strategy {
        parallelism: match spec.parallelism {
            Parallelism::None => placement::Parallelism::None,
            Parallelism::Pipeline => placement::Parallelism::Pipeline,
            Parallelism::Tensor => placement::Parallelism::Tensor,
        },
        policy: match spec.placement {
            PlacementPolicy::MemoryWeighted => placement::Policy::MemoryWeighted,
            PlacementPolicy::FewestNodes => placement::Policy::FewestNodes,
            PlacementPolicy::EvenLayers => placement::Policy::EvenLayers,
        },
        min_nodes: spec.min_nodes.unwrap_or(1),
        max_nodes: match spec.parallelism {
            Parallelism::None => Some(1),
            _ => spec.max_nodes,
        },
        kv: placement::KvBudget {
            context_length: spec.kv_cache.context_length as u64,
            sequences: spec.kv_cache.concurrent_sequences as u64,
        },
        stage_overhead: spec
            .stage_overhead
            .as_ref()
            .and_then(|q| parse_bytes(q).ok())
            .unwrap_or(DEFAULT_STAGE_OVERHEAD),
        max_latency_micros: links.max_latency_micros,
        min_bandwidth_mbps: links.min_bandwidth_mbps,
        require_rdma: links.require_rdma,
        tensor_size: spec.tensor_size,
    }
}

/// Bytes a Shard of another deployment holds: what its agent reports, else
/// what its model and KV budget imply, as the engine it runs on holds them
/// (its status says; else a rank's, else its node's, `node_engine`).
fn shard_bytes(
    shard: &Shard,
    models: &BTreeMap<(String, String), Arc<Model>>,
    node_engine: Option<Engine>,
) -> u64 {
    if let Some(b) = shard.status.as_ref().and_then(|s| s.memory_bytes) {
        return b;
    }
    let engine = shard
        .status
        .as_ref()
        .and_then(|s| s.engine)
        .or(shard.spec.tensor.as_ref().map(|_| RANK_ENGINE))
        .or(node_engine);
    let ns = shard.namespace().unwrap_or_default();
    let status = models
        .get(&(ns, shard.spec.model.clone()))
        .and_then(|m| m.status.as_ref());
    let fp = status.and_then(|s| {
        let base = footprint(s, PROMPT_STEP)?;
        Some(
            engine
                .and_then(|e| engine_footprint(s, e, &base))
                .unwrap_or(base),
        )
    });
    let Some(fp) = fp else {
        return DEFAULT_STAGE_OVERHEAD;
    };
    let kv = placement::KvBudget {
        context_length: shard.spec.kv_cache.context_length as u64,
        sequences: shard.spec.kv_cache.concurrent_sequences as u64,
    };
    fp.stage_bytes(
        &(shard.spec.layers.start..shard.spec.layers.end),
        kv,
        DEFAULT_STAGE_OVERHEAD,
    )
}

/// Builds the cluster a deployment of `model` (whose footprint as stored
/// is `base`) is placed on: the pool's nodes, each with the model as its
/// engine holds it and what other deployments already use there.
pub fn cluster(
    me: &str,
    pool: &NodePool,
    model: &Model,
    base: &placement::Footprint,
    nodes: &[Arc<InferenceNode>],
    shards: &[Arc<Shard>],
    models: &BTreeMap<(String, String), Arc<Model>>,
) -> placement::Cluster {
    let source = model.pinned_source().cache_key();
    let held: Vec<(Engine, Arc<placement::Footprint>)> = model
        .status
        .iter()
        .flat_map(|s| {
            s.engine_footprints.iter().filter_map(|e| {
                engine_footprint(s, e.engine, base).map(|f| (e.engine, Arc::new(f)))
            })
        })
        .collect();
    let mut cluster = placement::Cluster::new();
    let mut engines: BTreeMap<String, Engine> = BTreeMap::new();
    for node in nodes.iter().filter(|n| selects(pool, n)) {
        let status = node.status.clone().unwrap_or_default();
        let mut n = placement::Node::new(node_allocatable(pool, node));
        n.schedulable = node_ready(node) && !node.spec.unschedulable;
        n.has_weights = status.cached_models.iter().any(|c| c.key == source);
        let held_by = |engine: Engine| {
            held.iter()
                .find(|(e, _)| *e == engine)
                .map(|(_, f)| f.clone())
        };
        if let Some(engine) = node_engine(node) {
            engines.insert(node.name_any(), engine);
            n.footprint = held_by(engine);
        }
        n.rank_footprint = held_by(RANK_ENGINE);
        cluster.add_node(node.name_any(), n);
    }
    for shard in shards {
        let key = deployment_key(
            &shard.namespace().unwrap_or_default(),
            &shard.spec.deployment,
        );
        if key == me {
            continue;
        }
        let bytes = shard_bytes(shard, models, engines.get(&shard.spec.node).copied());
        if let Some(n) = cluster.nodes.get_mut(&shard.spec.node) {
            n.free_bytes = n.free_bytes.saturating_sub(bytes);
            n.occupants.insert(key.clone());
            if shard.labels().get(TIER_LABEL).map(String::as_str) == Some("daily") {
                n.dedicated_to = Some(key);
            }
        }
    }
    // Measured links, as the agents report them.
    for node in nodes {
        for link in node.status.iter().flat_map(|s| &s.links) {
            cluster.add_link(
                &node.name_any(),
                &link.node,
                placement::Link {
                    latency_micros: link.latency_micros,
                    bandwidth_mbps: link.bandwidth_mbps,
                    rdma: link.rdma,
                },
            );
        }
    }
    cluster
}

/// A deployment's current placement, from its Shards (complete instances
/// only: every stage, every rank of every tensor group).
pub fn current_instances(shards: &[&Shard]) -> Vec<placement::Instance> {
    let mut by_instance: BTreeMap<u32, Vec<&Shard>> = BTreeMap::new();
    for s in shards {
        by_instance.entry(s.spec.instance).or_default().push(s);
    }
    let rank = |s: &Shard| s.spec.tensor.as_ref().map_or(0, |t| t.rank);
    by_instance
        .into_iter()
        .filter_map(|(index, mut stages)| {
            // A stage moved moments ago may still have its old Shard in the
            // cache beside the new one: the newest is the last plan's. (Seen
            // as an incomplete instance, it would be placed anew, moving
            // stages that stand.)
            stages.retain(|s| s.metadata.deletion_timestamp.is_none());
            stages.sort_by(|a, b| {
                (a.spec.stage, rank(a))
                    .cmp(&(b.spec.stage, rank(b)))
                    .then_with(|| {
                        b.metadata
                            .creation_timestamp
                            .cmp(&a.metadata.creation_timestamp)
                    })
            });
            stages.dedup_by_key(|s| (s.spec.stage, rank(s)));
            let count = stages.first()?.spec.stage_count as usize;
            let instance = placement::Instance {
                index,
                stages: stages
                    .iter()
                    .map(|s| placement::Stage {
                        node: s.spec.node.clone(),
                        layers: s.spec.layers.start..s.spec.layers.end,
                        tensor: s.spec.tensor.as_ref().map(|t| placement::TensorRank {
                            rank: t.rank,
                            weights: t.weights.clone(),
                        }),
                    })
                    .collect(),
            };
            let pipeline = instance.pipeline();
            let groups_whole = stages.iter().all(|s| {
                s.spec.tensor.as_ref().is_none_or(|t| {
                    stages
                        .iter()
                        .filter(|o| o.spec.stage == s.spec.stage)
                        .count()
                        == t.weights.len()
                })
            });
            let complete = groups_whole
                && pipeline.len() == count
                && pipeline.iter().enumerate().all(|(i, group)| {
                    group.iter().all(|e| {
                        stages
                            .iter()
                            .any(|s| s.spec.stage as usize == i && s.spec.node == e.node)
                    })
                });
            complete.then_some(instance)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use shardplane_crds::v1alpha1::LayerRange;

    fn shard(node: &str, stage: u32, created: i64) -> Shard {
        let layers = LayerRange {
            start: stage * 10,
            end: stage * 10 + 10,
        };
        let mut s = shardplane_testkit::fixtures::shard("d", node, stage, 3, layers);
        s.metadata.creation_timestamp = Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
        ));
        s
    }

    #[test]
    fn sliding_layers_reach_the_planner_capped() {
        let status = ModelStatus {
            layers: Some(4),
            layer_bytes: vec![10; 4],
            kv_bytes_per_token: Some(400),
            sliding_window: Some(shardplane_crds::SlidingWindowStatus {
                tokens: 128,
                held_tokens: 1152,
                // 9 is no layer of this model: left out.
                layers: vec![0, 2, 9],
            }),
            ..Default::default()
        };
        let f = footprint(&status, PROMPT_STEP).unwrap();
        assert_eq!(f.kv_bytes_per_token_per_layer, 100);
        assert_eq!(f.kv_token_caps, [Some(1152), None, Some(1152), None]);
        // Nodes whose steps take 2048 prompt tokens hold 1536 rows more
        // (as `sliding_rows_held` counts them), 256 fewer with 256.
        let f = footprint(&status, 2048).unwrap();
        assert_eq!(f.kv_token_caps, [Some(2688), None, Some(2688), None]);
        use shardplane_formats::config::sliding_rows_held;
        assert_eq!(
            sliding_rows_held(128, 2048) - sliding_rows_held(128, PROMPT_STEP),
            1536
        );
        let f = footprint(&status, 256).unwrap();
        assert_eq!(f.kv_token_caps[0], Some(896));
        let without = footprint(
            &ModelStatus {
                sliding_window: None,
                ..status
            },
            PROMPT_STEP,
        )
        .unwrap();
        assert!(without.kv_token_caps.is_empty());
    }

    #[test]
    fn each_node_sees_the_model_as_its_engine_holds_it() {
        let held = |engine, layer_bytes: Vec<u64>, kv| shardplane_crds::EngineFootprint {
            engine,
            layer_bytes,
            embedding_bytes: 7,
            output_bytes: 8,
            kv_bytes_per_token: kv,
        };
        let mut model = shardplane_testkit::fixtures::model("m");
        model.status = Some(ModelStatus {
            layers: Some(2),
            layer_bytes: vec![10, 10],
            embedding_bytes: Some(5),
            output_bytes: Some(5),
            kv_bytes_per_token: Some(40),
            engine_footprints: vec![
                held(Engine::Candle, vec![12, 12], 20),
                held(Engine::Mlx, vec![15, 15], 40),
            ],
            ..Default::default()
        });
        let base = footprint(model.status.as_ref().unwrap(), PROMPT_STEP).unwrap();
        let pool = shardplane_testkit::fixtures::node_pool("p", Tier::Reasoning);
        let node = |name: &str, engines: Vec<Engine>| {
            let mut n = shardplane_testkit::fixtures::inference_node(name);
            n.metadata.labels = Some([("pool".to_string(), "p".to_string())].into());
            n.status = Some(InferenceNodeStatus {
                engines,
                ..Default::default()
            });
            Arc::new(n)
        };
        let nodes = [
            node("linux", vec![Engine::Candle, Engine::Mlx]),
            node("mac", vec![Engine::Mlx]),
            node("old", vec![]),
        ];
        let view = cluster("ns/d", &pool, &model, &base, &nodes, &[], &BTreeMap::new());
        let linux = view.nodes["linux"].footprint.as_deref().unwrap();
        assert_eq!(linux.layer_bytes, [12, 12]);
        assert_eq!(linux.kv_bytes_per_token_per_layer, 10);
        assert_eq!((linux.embedding_bytes, linux.output_bytes), (7, 8));
        let mac = view.nodes["mac"].footprint.as_deref().unwrap();
        assert_eq!(mac.layer_bytes, [15, 15]);
        assert_eq!(mac.kv_bytes_per_token_per_layer, 20);
        // An agent that does not say counts the model as stored.
        assert!(view.nodes["old"].footprint.is_none());
        // A tensor rank runs on candle wherever it is.
        for node in ["linux", "mac", "old"] {
            let rank = view.nodes[node].rank_footprint.as_deref().unwrap();
            assert_eq!(rank.layer_bytes, [12, 12], "{node}");
        }
        // A figure of another layer count is not used.
        let status = model.status.as_mut().unwrap();
        status.engine_footprints[0].layer_bytes.push(12);
        assert!(engine_footprint(status, Engine::Candle, &base).is_none());
        let view = cluster("ns/d", &pool, &model, &base, &nodes, &[], &BTreeMap::new());
        assert!(view.nodes["linux"].footprint.is_none());
    }

    #[test]
    fn a_moved_stage_s_old_shard_does_not_make_the_instance_incomplete() {
        let (a, b_old, b_new, c) = (
            shard("a", 0, 1),
            shard("b", 1, 1),
            shard("spare", 1, 50),
            shard("c", 2, 1),
        );
        let current = current_instances(&[&a, &b_old, &b_new, &c]);
        let nodes: Vec<&str> = current[0].stages.iter().map(|s| s.node.as_str()).collect();
        assert_eq!(nodes, ["a", "spare", "c"]);
        // One being deleted does not count at all.
        let mut going = shard("b", 1, 99);
        going.metadata.deletion_timestamp = going.metadata.creation_timestamp.clone();
        let current = current_instances(&[&a, &b_new, &going, &c]);
        assert_eq!(current[0].stages[1].node, "spare");
        // A stage missing is still an incomplete instance.
        assert!(current_instances(&[&a, &c]).is_empty());
    }

    /// Rank `rank` of `ranks` of stage `stage` (layers `layers`) on `node`.
    fn rank(
        node: &str,
        stage: u32,
        stages: u32,
        layers: (u32, u32),
        rank: u32,
        ranks: u32,
    ) -> Shard {
        let layers = LayerRange {
            start: layers.0,
            end: layers.1,
        };
        let mut s = shardplane_testkit::fixtures::shard("d", node, stage, stages, layers);
        s.metadata.name = Some(format!("d-0-{stage}-{rank}"));
        s.spec.tensor = Some(shardplane_crds::TensorRankSpec {
            rank,
            weights: vec![1; ranks as usize],
            group: (0..ranks).map(|r| format!("d-0-{stage}-{r}")).collect(),
        });
        s
    }

    #[test]
    fn tensor_ranks_make_an_instance_only_when_every_group_is_whole() {
        let (a, b, c, d) = (
            rank("a", 0, 2, (0, 15), 0, 2),
            rank("b", 0, 2, (0, 15), 1, 2),
            rank("c", 1, 2, (15, 30), 0, 2),
            rank("d", 1, 2, (15, 30), 1, 2),
        );
        let current = current_instances(&[&d, &b, &c, &a]);
        let entries: Vec<(&str, u32)> = current[0]
            .stages
            .iter()
            .map(|s| (s.node.as_str(), s.tensor.as_ref().unwrap().rank))
            .collect();
        assert_eq!(entries, [("a", 0), ("b", 1), ("c", 0), ("d", 1)]);
        assert_eq!(current[0].pipeline().len(), 2);
        // A rank missing: no instance (it is placed again).
        assert!(current_instances(&[&a, &c, &d]).is_empty());
    }

    #[test]
    fn the_pool_prompt_step_is_the_largest_its_nodes_report() {
        let pool = shardplane_testkit::fixtures::node_pool("p", Tier::Reasoning);
        let node = |name: &str, pool: &str, step: Option<u32>| {
            let mut n = InferenceNode::new(name, InferenceNodeSpec::default());
            n.metadata.labels = Some([("pool".to_string(), pool.to_string())].into());
            n.status = Some(InferenceNodeStatus {
                prompt_step_tokens: step,
                ..Default::default()
            });
            Arc::new(n)
        };
        assert_eq!(pool_prompt_step(&pool, &[]), PROMPT_STEP);
        assert_eq!(pool_prompt_step(&pool, &[node("a", "p", Some(256))]), 256);
        // A node that reports none counts as the default.
        let nodes = [node("a", "p", None), node("b", "p", Some(256))];
        assert_eq!(pool_prompt_step(&pool, &nodes), PROMPT_STEP);
        // Only the pool's nodes.
        let nodes = [
            node("a", "p", Some(256)),
            node("b", "other", Some(4096)),
            node("c", "p", Some(1024)),
        ];
        assert_eq!(pool_prompt_step(&pool, &nodes), 1024);
    }
}
