//! Properties every plan has, on random clusters, models and strategies.

use std::collections::BTreeMap;

use proptest::prelude::{Just, ProptestConfig, prop_assert, prop_assert_eq, prop_oneof, proptest};
use proptest::strategy::Strategy as Generator;
use shardplane_placement::*;

#[derive(Debug, Clone)]
struct World {
    nodes: Vec<(u64, bool)>,
    deployments: Vec<(Tier, u32, Footprint, Strategy)>,
}

fn footprint() -> impl Generator<Value = Footprint> {
    (1usize..48, 1u64..4_000, 0u64..8_000, 0u64..8_000, 0u64..64).prop_map(
        |(layers, layer, emb, out, kv)| Footprint {
            layer_bytes: (0..layers).map(|i| layer + (i as u64 % 3) * 17).collect(),
            embedding_bytes: emb,
            output_bytes: out,
            kv_bytes_per_token_per_layer: kv,
            kv_heads: None,
            kv_token_caps: Vec::new(),
        },
    )
}

fn strategy(tier: Tier) -> impl Generator<Value = Strategy> {
    (
        0usize..3,
        1u32..4,
        proptest::option::of(1u32..8),
        0u64..32,
        1u64..4,
        0u64..500,
    )
        .prop_map(move |(policy, min, max, ctx, seqs, overhead)| Strategy {
            parallelism: if tier == Tier::Daily {
                Parallelism::None
            } else {
                Parallelism::Pipeline
            },
            policy: [
                Policy::MemoryWeighted,
                Policy::FewestNodes,
                Policy::EvenLayers,
            ][policy],
            min_nodes: if tier == Tier::Daily { 1 } else { min },
            max_nodes: if tier == Tier::Daily {
                Some(1)
            } else {
                max.map(|m| m.max(min))
            },
            kv: KvBudget {
                context_length: ctx,
                sequences: seqs,
            },
            stage_overhead: overhead,
            max_latency_micros: None,
            min_bandwidth_mbps: None,
            require_rdma: false,
            tensor_size: None,
        })
}

fn world() -> impl Generator<Value = World> {
    let nodes = proptest::collection::vec((0u64..200_000, proptest::bool::weighted(0.85)), 1..14);
    let deployment = prop_oneof![Just(Tier::Daily), Just(Tier::Reasoning)]
        .prop_flat_map(|tier| (Just(tier), 1u32..4, footprint(), strategy(tier)));
    let deployments = proptest::collection::vec(deployment, 1..5);
    (nodes, deployments).prop_map(|(nodes, deployments)| World { nodes, deployments })
}

fn cluster(w: &World) -> Cluster {
    let mut c = Cluster::new();
    for (i, (free, schedulable)) in w.nodes.iter().enumerate() {
        let mut n = Node::new(*free);
        n.schedulable = *schedulable;
        c.add_node(format!("n{i:02}"), n);
    }
    c
}

fn plan_all(w: &World, current: &[Vec<Instance>]) -> Vec<Plan> {
    let mut c = cluster(w);
    w.deployments
        .iter()
        .enumerate()
        .map(|(d, (tier, replicas, f, s))| {
            let name = format!("d{d}");
            let cur = current.get(d).map(Vec::as_slice).unwrap_or_default();
            plan(
                &mut c,
                &Request {
                    deployment: &name,
                    tier: *tier,
                    replicas: *replicas,
                    footprint: f,
                    strategy: s,
                    current: cur,
                },
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn plans_cover_every_layer_once_and_fit_memory(w in world()) {
        let plans = plan_all(&w, &[]);
        let c = cluster(&w);
        let mut used: BTreeMap<String, u64> = BTreeMap::new();
        let mut daily_nodes: BTreeMap<String, usize> = BTreeMap::new();
        let mut node_users: BTreeMap<String, std::collections::BTreeSet<usize>> = BTreeMap::new();
        for (d, (p, (tier, replicas, f, s))) in plans.iter().zip(&w.deployments).enumerate() {
            prop_assert!(p.instances.len() as u32 <= *replicas);
            prop_assert_eq!(p.unplaced.is_some(), (p.instances.len() as u32) < *replicas);
            for inst in &p.instances {
                // Contiguous, non-empty stages covering 0..layers exactly once.
                let mut next = 0;
                for st in &inst.stages {
                    prop_assert_eq!(st.layers.start, next);
                    prop_assert!(st.layers.start < st.layers.end);
                    next = st.layers.end;
                    prop_assert!(c.nodes[&st.node].schedulable, "stage on an unschedulable node");
                    *used.entry(st.node.clone()).or_default() += f.stage_bytes(&st.layers, s.kv, s.stage_overhead);
                    node_users.entry(st.node.clone()).or_default().insert(d);
                    if *tier == Tier::Daily {
                        *daily_nodes.entry(st.node.clone()).or_default() += 1;
                    }
                }
                prop_assert_eq!(next, f.layers());
                let k = inst.stages.len() as u32;
                prop_assert!(k >= s.min_nodes && s.max_nodes.is_none_or(|m| k <= m), "{} stages", k);
            }
        }
        for (node, bytes) in &used {
            prop_assert!(*bytes <= c.nodes[node].free_bytes, "{} over-committed: {} > {}", node, bytes, c.nodes[node].free_bytes);
        }
        for (node, n) in &daily_nodes {
            prop_assert_eq!(*n, 1, "daily node {} runs {} replicas", node, n);
            prop_assert_eq!(node_users[node].len(), 1, "daily node {} is shared", node);
        }
    }

    #[test]
    fn replanning_an_unchanged_world_changes_nothing(w in world()) {
        let first = plan_all(&w, &[]);
        let current: Vec<Vec<Instance>> = first.iter().map(|p| p.instances.clone()).collect();
        let again = plan_all(&w, &current);
        for (a, b) in first.iter().zip(&again) {
            prop_assert_eq!(&a.instances[..], &b.instances[..a.instances.len()]);
        }
    }
}
