//! Tensor-parallel placement: groups sized by the strategy, uneven shares
//! from free memory, pipeline × tensor, the KV-heads bound, links within a
//! group, and a lost rank moved alone.

use shardplane_placement::*;

const GIB: u64 = 1 << 30;

/// 30 layers of 1 GiB, 1 GiB embedding and head, no KV cache, 3 KV heads.
fn model() -> Footprint {
    Footprint {
        layer_bytes: vec![GIB; 30],
        embedding_bytes: GIB,
        output_bytes: GIB,
        kv_bytes_per_token_per_layer: 0,
        kv_heads: Some(3),
        kv_token_caps: Vec::new(),
    }
}

fn tensor(tensor_size: Option<u32>) -> Strategy {
    Strategy {
        parallelism: Parallelism::Tensor,
        policy: Policy::MemoryWeighted,
        min_nodes: 1,
        max_nodes: None,
        kv: KvBudget {
            context_length: 0,
            sequences: 0,
        },
        stage_overhead: 0,
        max_latency_micros: None,
        min_bandwidth_mbps: None,
        require_rdma: false,
        tensor_size,
    }
}

fn cluster(nodes: &[(&str, u64)]) -> Cluster {
    let mut c = Cluster::new();
    for (name, gib) in nodes {
        c.add_node(*name, Node::new(gib * GIB));
    }
    c
}

fn place(c: &mut Cluster, f: &Footprint, s: &Strategy, current: &[Instance]) -> Plan {
    plan(
        c,
        &Request {
            deployment: "big",
            tier: Tier::Reasoning,
            replicas: 1,
            footprint: f,
            strategy: s,
            current,
        },
    )
}

/// Each entry as `node rank/ranks [layers)`.
fn shape(p: &Plan) -> Vec<String> {
    p.instances[0]
        .stages
        .iter()
        .map(|s| {
            let t = s.tensor.as_ref().expect("a tensor rank");
            format!(
                "{} {}/{} [{}-{})",
                s.node,
                t.rank,
                t.weights.len(),
                s.layers.start,
                s.layers.end
            )
        })
        .collect()
}

#[test]
fn one_group_on_the_fewest_nodes_that_fit_with_shares_from_free_memory() {
    let f = model();
    // 32 GiB of model: no single node holds it; two do, the biggest first.
    let mut c = cluster(&[("a", 40), ("b", 20), ("c", 12)]);
    let p = place(&mut c, &f, &tensor(None), &[]);
    assert_eq!(p.unplaced, None);
    assert_eq!(shape(&p), ["a 0/2 [0-30)", "b 1/2 [0-30)"]);
    // Uneven: a has twice b's free memory, so twice its share.
    let weights = &p.instances[0].stages[0].tensor.as_ref().unwrap().weights;
    assert_eq!(weights, &[40 * 1024, 20 * 1024]);
    // Memory taken: a holds 2/3 of the layers (20), the embedding and the
    // head; b at least one of the 3 KV heads' worth (10) and the embedding.
    let taken = |n: &str, total: u64| total * GIB - c.nodes[n].free_bytes;
    let near = |bytes: u64, gib: u64| bytes.abs_diff(gib * GIB) < (1 << 20);
    assert!(near(taken("a", 40), 22), "{}", taken("a", 40));
    assert!(near(taken("b", 20), 11), "{}", taken("b", 20));
}

#[test]
fn a_placed_group_stands_and_a_lost_rank_moves_alone() {
    let f = model();
    let s = tensor(None);
    let mut c = cluster(&[("a", 40), ("b", 20), ("spare", 15)]);
    let first = place(&mut c.clone(), &f, &s, &[]);
    let again = place(&mut c.clone(), &f, &s, &first.instances);
    assert_eq!(again.instances, first.instances, "kept as it is");
    // b is lost: only rank 1 moves, with the same weights.
    c.nodes.get_mut("b").unwrap().schedulable = false;
    let healed = place(&mut c, &f, &s, &first.instances);
    assert_eq!(shape(&healed), ["a 0/2 [0-30)", "spare 1/2 [0-30)"]);
    assert_eq!(
        healed.instances[0].stages[1].tensor,
        first.instances[0].stages[1].tensor
    );
}

#[test]
fn pipeline_by_tensor_two_stages_of_two() {
    let f = model();
    // 9 GiB each: two nodes cannot hold 32 GiB; four in two groups can.
    let mut c = cluster(&[("n0", 9), ("n1", 9), ("n2", 9), ("n3", 9)]);
    let p = place(&mut c, &f, &tensor(Some(2)), &[]);
    assert_eq!(p.unplaced, None, "{p:?}");
    let shape = shape(&p);
    assert_eq!(shape.len(), 4);
    let ranks: Vec<&str> = shape.iter().map(|s| s.split(' ').nth(1).unwrap()).collect();
    assert_eq!(ranks, ["0/2", "1/2", "0/2", "1/2"]);
    let stages = &p.instances[0].stages;
    assert_eq!(stages[0].layers, stages[1].layers);
    assert_eq!(stages[2].layers, stages[3].layers);
    assert_eq!(
        (stages[0].layers.start, stages[1].layers.end),
        (0, stages[2].layers.start)
    );
    assert_eq!(stages[3].layers.end, 30);
}

#[test]
fn a_group_has_no_more_ranks_than_kv_heads() {
    let f = model();
    let s = Strategy {
        min_nodes: 4,
        ..tensor(None)
    };
    let p = place(
        &mut cluster(&[("a", 9), ("b", 9), ("c", 9), ("d", 9)]),
        &f,
        &s,
        &[],
    );
    let why = p.unplaced.unwrap();
    assert_eq!(why.reason, UnplaceableReason::UnsupportedStrategy);
    assert!(
        why.message.contains("needs at least 4 KV heads"),
        "{}",
        why.message
    );
    assert!(why.message.contains("the model has 3"), "{}", why.message);
}

#[test]
fn every_link_within_a_group_meets_the_strategy() {
    let f = model();
    let s = Strategy {
        max_latency_micros: Some(500),
        ..tensor(None)
    };
    let mut c = cluster(&[("a", 40), ("b", 20), ("c", 20)]);
    let fast = Link {
        latency_micros: 100,
        bandwidth_mbps: None,
        rdma: false,
    };
    let slow = Link {
        latency_micros: 5000,
        ..fast
    };
    c.add_link("a", "b", slow);
    c.add_link("a", "c", fast);
    c.add_link("b", "c", fast);
    let p = place(&mut c, &f, &s, &[]);
    assert_eq!(p.unplaced, None, "{p:?}");
    let nodes: Vec<&str> = p.instances[0]
        .stages
        .iter()
        .map(|s| s.node.as_str())
        .collect();
    assert_eq!(nodes, ["a", "c"], "a and b are too far apart");
    // No fast pair at all: refused for the links.
    c = cluster(&[("a", 40), ("b", 20)]);
    c.add_link("a", "b", slow);
    let p = place(&mut c, &f, &s, &[]);
    assert_eq!(
        p.unplaced.unwrap().reason,
        UnplaceableReason::LinkRequirements
    );
}

#[test]
fn a_rank_counts_the_model_as_the_rank_engine_holds_it() {
    // 32 GiB as stored fit two 20 GiB nodes as ranks; the ranks' engine
    // holding the layers at twice the bytes (62 GiB) does not, whatever
    // the nodes' own stages would run on.
    let (f, s) = (model(), tensor(None));
    let p = place(&mut cluster(&[("a", 20), ("b", 20)]), &f, &s, &[]);
    assert!(p.unplaced.is_none(), "{p:?}");
    let double = std::sync::Arc::new(Footprint {
        layer_bytes: vec![2 * GIB; 30],
        ..model()
    });
    let mut c = Cluster::new();
    for name in ["a", "b"] {
        let node = Node {
            rank_footprint: Some(double.clone()),
            ..Node::new(20 * GIB)
        };
        c.add_node(name, node);
    }
    let p = place(&mut c, &f, &s, &[]);
    let why = p.unplaced.expect("the ranks do not fit");
    assert_eq!(why.reason, UnplaceableReason::InsufficientMemory);
    assert!(
        why.message.contains("needs at least 62.0 GiB"),
        "{}",
        why.message
    );
    // With room for them, the ranks are placed.
    for (_, node) in c.nodes.iter_mut() {
        node.free_bytes = 40 * GIB;
    }
    let p = place(&mut c, &f, &s, &[]);
    assert!(p.unplaced.is_none(), "{p:?}");
}
