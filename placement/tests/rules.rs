//! One test per placement rule, on small hand-made clusters.

use shardplane_placement::*;

const GIB: u64 = 1 << 30;

/// 30 layers of 1 GiB, 1 GiB embedding and head, no KV cache, no overhead.
fn model() -> Footprint {
    Footprint {
        layer_bytes: vec![GIB; 30],
        embedding_bytes: GIB,
        output_bytes: GIB,
        kv_bytes_per_token_per_layer: 0,
        kv_heads: None,
        kv_token_caps: Vec::new(),
    }
}

fn strategy(parallelism: Parallelism) -> Strategy {
    Strategy {
        parallelism,
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
        tensor_size: None,
    }
}

fn cluster(nodes: &[(&str, u64)]) -> Cluster {
    let mut c = Cluster::new();
    for (name, gib) in nodes {
        c.add_node(*name, Node::new(gib * GIB));
    }
    c
}

fn request<'a>(
    name: &'a str,
    tier: Tier,
    replicas: u32,
    f: &'a Footprint,
    s: &'a Strategy,
    current: &'a [Instance],
) -> Request<'a> {
    Request {
        deployment: name,
        tier,
        replicas,
        footprint: f,
        strategy: s,
        current,
    }
}

fn nodes_of(i: &Instance) -> Vec<&str> {
    i.stages.iter().map(|s| s.node.as_str()).collect()
}

#[test]
fn a_pipeline_uses_the_fewest_nodes_that_fit() {
    // 32 GiB in all: two 20 GiB nodes suffice, though five are there.
    let mut c = cluster(&[("a", 20), ("b", 20), ("c", 20), ("d", 20), ("e", 20)]);
    let (f, s) = (model(), strategy(Parallelism::Pipeline));
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    assert!(p.unplaced.is_none(), "{p:?}");
    assert_eq!(p.instances[0].stages.len(), 2);
    let layers: Vec<_> = p.instances[0]
        .stages
        .iter()
        .map(|s| s.layers.clone())
        .collect();
    assert_eq!(layers, vec![0..15, 15..30]);
}

#[test]
fn even_layers_spread_over_max_nodes() {
    let mut c = cluster(&[("a", 40), ("b", 40), ("c", 40), ("d", 40)]);
    let f = model();
    let s = Strategy {
        policy: Policy::EvenLayers,
        min_nodes: 2,
        max_nodes: Some(3),
        ..strategy(Parallelism::Pipeline)
    };
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    let layers: Vec<_> = p.instances[0]
        .stages
        .iter()
        .map(|s| s.layers.clone())
        .collect();
    assert_eq!(
        layers,
        vec![0..10, 10..20, 20..30],
        "three stages though one node would fit"
    );
}

#[test]
fn layers_follow_memory() {
    let mut c = cluster(&[("big", 24), ("small", 12)]);
    let (f, s) = (model(), strategy(Parallelism::Pipeline));
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    let i = &p.instances[0];
    assert_eq!(nodes_of(i), ["big", "small"]);
    assert!(
        i.stages[0].layers.len() > 2 * i.stages[1].layers.len() - 4,
        "{i:?}"
    );
    for st in &i.stages {
        assert!(
            f.stage_bytes(&st.layers, s.kv, 0)
                <= if st.node == "big" { 24 * GIB } else { 12 * GIB }
        );
    }
}

#[test]
fn the_ring_avoids_slow_links() {
    let mut c = cluster(&[("a", 9), ("b", 9), ("c", 9), ("d", 9)]);
    let fast = Link {
        latency_micros: 80,
        bandwidth_mbps: Some(40_000),
        rdma: false,
    };
    let slow = Link {
        latency_micros: 20_000,
        ..fast
    };
    for (x, y) in [
        ("a", "b"),
        ("a", "c"),
        ("a", "d"),
        ("b", "c"),
        ("b", "d"),
        ("c", "d"),
    ] {
        c.add_link(
            x,
            y,
            if (x, y) == ("a", "b") || (x, y) == ("c", "d") {
                slow
            } else {
                fast
            },
        );
    }
    let (f, s) = (model(), strategy(Parallelism::Pipeline));
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    let order = nodes_of(&p.instances[0]);
    assert_eq!(order.len(), 4);
    for i in 0..4 {
        let pair = [order[i], order[(i + 1) % 4]];
        assert!(
            !(pair.contains(&"a") && pair.contains(&"b")
                || pair.contains(&"c") && pair.contains(&"d")),
            "slow link in ring {order:?}"
        );
    }
}

#[test]
fn nodes_holding_the_weights_are_preferred() {
    // Two nodes are needed either way (32 GiB); c and d hold the weights.
    let mut c = cluster(&[("a", 30), ("b", 30), ("c", 20), ("d", 20)]);
    c.nodes.get_mut("c").unwrap().has_weights = true;
    c.nodes.get_mut("d").unwrap().has_weights = true;
    let (f, s) = (model(), strategy(Parallelism::Pipeline));
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    let mut used = nodes_of(&p.instances[0]);
    used.sort();
    assert_eq!(used, ["c", "d"]);
}

#[test]
fn an_unchanged_world_gives_an_unchanged_plan() {
    let nodes = [("a", 20), ("b", 20), ("c", 30)];
    let (f, s) = (model(), strategy(Parallelism::Pipeline));
    let first = plan(
        &mut cluster(&nodes),
        &request("r", Tier::Reasoning, 2, &f, &s, &[]),
    );
    let again = plan(
        &mut cluster(&nodes),
        &request("r", Tier::Reasoning, 2, &f, &s, &first.instances),
    );
    assert_eq!(again, first);
    // Even when a fresh plan would now choose differently (a new, bigger node).
    let mut bigger = cluster(&nodes);
    bigger.add_node("z", Node::new(100 * GIB));
    let kept = plan(
        &mut bigger,
        &request("r", Tier::Reasoning, 2, &f, &s, &first.instances),
    );
    assert_eq!(kept.instances, first.instances, "no needless moves");
}

#[test]
fn a_lost_node_moves_only_its_stage() {
    let mut c = cluster(&[("a", 12), ("b", 12), ("c", 12), ("spare", 12)]);
    let f = model();
    let s = Strategy {
        policy: Policy::EvenLayers,
        min_nodes: 3,
        max_nodes: Some(3),
        ..strategy(Parallelism::Pipeline)
    };
    let before = plan(
        &mut c.clone(),
        &request("r", Tier::Reasoning, 1, &f, &s, &[]),
    )
    .instances;
    let lost = before[0].stages[1].node.clone();
    c.nodes.get_mut(&lost).unwrap().schedulable = false;
    let after = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &before)).instances;
    for (b, a) in before[0].stages.iter().zip(&after[0].stages) {
        assert_eq!(a.layers, b.layers, "layer ranges stay");
        if b.node == lost {
            assert_eq!(a.node, "spare", "the lost stage moves to the free node");
        } else {
            assert_eq!(a.node, b.node, "other stages stay put");
        }
    }
}

#[test]
fn a_lost_node_without_a_spare_replans_the_instance_on_fewer_nodes() {
    let mut c = cluster(&[("a", 20), ("b", 20), ("c", 20)]);
    let f = model();
    let s = Strategy {
        policy: Policy::EvenLayers,
        min_nodes: 2,
        max_nodes: Some(3),
        ..strategy(Parallelism::Pipeline)
    };
    // Placed on three nodes as EvenLayers would with three.
    let current = vec![Instance {
        index: 0,
        stages: vec![
            Stage::new("a", 0..10),
            Stage::new("b", 10..20),
            Stage::new("c", 20..30),
        ],
    }];
    assert_eq!(
        plan(
            &mut c.clone(),
            &request("r", Tier::Reasoning, 1, &f, &s, &current)
        )
        .instances,
        current
    );
    c.nodes.get_mut("b").unwrap().schedulable = false;
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &current));
    assert!(p.unplaced.is_none(), "{p:?}");
    assert_eq!(nodes_of(&p.instances[0]).len(), 2);
    assert!(!nodes_of(&p.instances[0]).contains(&"b"));
}

#[test]
fn daily_replicas_take_distinct_dedicated_nodes() {
    let mut c = cluster(&[("a", 40), ("b", 40), ("c", 40), ("d", 40)]);
    let f = model();
    let s = strategy(Parallelism::None);
    let chat = plan(&mut c, &request("chat", Tier::Daily, 2, &f, &s, &[]));
    assert_eq!(chat.instances.len(), 2);
    let used: Vec<&str> = chat.instances.iter().flat_map(nodes_of).collect();
    assert_ne!(used[0], used[1], "replicas on distinct nodes");
    assert_eq!(chat.instances[0].stages[0].layers, 0..30, "the whole model");
    // Another daily deployment gets the other two nodes, never the first's.
    let code = plan(&mut c, &request("code", Tier::Daily, 3, &f, &s, &[]));
    let code_nodes: Vec<&str> = code.instances.iter().flat_map(nodes_of).collect();
    assert_eq!(code.instances.len(), 2);
    assert!(code_nodes.iter().all(|n| !used.contains(n)));
    let why = code.unplaced.expect("the third replica has no node");
    assert_eq!(why.reason, UnplaceableReason::NoSchedulableNodes);
    assert!(
        why.message.starts_with("placed 2 of 3 instances"),
        "{}",
        why.message
    );
    // Nor does a pipeline deployment land on dedicated nodes.
    let r = plan(
        &mut c,
        &request(
            "r",
            Tier::Reasoning,
            1,
            &f,
            &strategy(Parallelism::Pipeline),
            &[],
        ),
    );
    assert_eq!(
        r.unplaced.unwrap().reason,
        UnplaceableReason::NoSchedulableNodes
    );
}

#[test]
fn a_daily_deployment_does_not_take_a_node_others_use() {
    let mut c = cluster(&[("shared", 100), ("empty", 40)]);
    let f = model();
    let p = plan(
        &mut c,
        &request(
            "r",
            Tier::Reasoning,
            1,
            &f,
            &strategy(Parallelism::Pipeline),
            &[],
        ),
    );
    assert_eq!(
        nodes_of(&p.instances[0]),
        ["shared"],
        "the fewest nodes: one"
    );
    let d = plan(
        &mut c,
        &request(
            "chat",
            Tier::Daily,
            1,
            &f,
            &strategy(Parallelism::None),
            &[],
        ),
    );
    assert_eq!(nodes_of(&d.instances[0]), ["empty"]);
}

#[test]
fn cordoned_nodes_get_nothing_new_and_lose_what_they_run() {
    let mut c = cluster(&[("a", 40), ("b", 40)]);
    c.nodes.get_mut("a").unwrap().schedulable = false;
    let f = model();
    let s = strategy(Parallelism::None);
    let p = plan(&mut c, &request("chat", Tier::Daily, 1, &f, &s, &[]));
    assert_eq!(nodes_of(&p.instances[0]), ["b"]);
    let on_a = vec![Instance {
        index: 0,
        stages: vec![Stage::new("a", 0..30)],
    }];
    let mut c = cluster(&[("a", 40), ("b", 40)]);
    c.nodes.get_mut("a").unwrap().schedulable = false;
    let moved = plan(&mut c, &request("chat", Tier::Daily, 1, &f, &s, &on_a));
    assert_eq!(nodes_of(&moved.instances[0]), ["b"]);
}

#[test]
fn scaling_down_keeps_the_first_instances() {
    let nodes = [("a", 40), ("b", 40), ("c", 40)];
    let f = model();
    let s = strategy(Parallelism::None);
    let three = plan(
        &mut cluster(&nodes),
        &request("chat", Tier::Daily, 3, &f, &s, &[]),
    )
    .instances;
    let one = plan(
        &mut cluster(&nodes),
        &request("chat", Tier::Daily, 1, &f, &s, &three),
    )
    .instances;
    assert_eq!(one, three[..1]);
}

/// A pipeline holding 4 sequences of 32768 tokens.
fn long_context() -> Strategy {
    Strategy {
        kv: KvBudget {
            context_length: 32_768,
            sequences: 4,
        },
        ..strategy(Parallelism::Pipeline)
    }
}

/// Sliding-window layers hold a capped number of tokens per sequence: a
/// model whose every layer but five slides needs a fraction of the KV a
/// model that keeps every token does, and fits where the other does not.
#[test]
fn sliding_layers_count_only_the_tokens_they_hold() {
    let s = long_context();
    let full = Footprint {
        kv_bytes_per_token_per_layer: 4096,
        ..model()
    };
    // Layers 5, 11, 17, 23, 29 global; the others hold 4096 tokens at most.
    let sliding = Footprint {
        kv_token_caps: (0..30)
            .map(|l| ((l + 1) % 6 != 0).then_some(4096))
            .collect(),
        ..full.clone()
    };
    let kv = |f: &Footprint| f.kv_bytes(s.kv);
    assert_eq!(kv(&full), 30 * 4096 * 32_768 * 4);
    assert_eq!(kv(&sliding), (5 * 32_768 + 25 * 4096) * 4096 * 4);
    // A budget shorter than the cap counts the budget.
    let short = KvBudget {
        context_length: 1000,
        sequences: 4,
    };
    assert_eq!(sliding.kv_bytes(short), full.kv_bytes(short));
    let nodes = [("a", 20), ("b", 20)];
    let p = plan(
        &mut cluster(&nodes),
        &request("r", Tier::Reasoning, 1, &full, &s, &[]),
    );
    assert!(p.instances.is_empty(), "47 GiB do not fit in 40");
    let p = plan(
        &mut cluster(&nodes),
        &request("r", Tier::Reasoning, 1, &sliding, &s, &[]),
    );
    assert_eq!(p.instances.len(), 1, "{:?}", p.unplaced);
}

#[test]
fn nothing_fits_explains_with_numbers() {
    let f = model();
    let s = long_context();
    let f = Footprint {
        kv_bytes_per_token_per_layer: 4096,
        kv_heads: None,
        ..f
    };
    let mut c = cluster(&[("a", 16), ("b", 16)]);
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    assert!(p.instances.is_empty());
    let why = p.unplaced.unwrap();
    assert_eq!(why.reason, UnplaceableReason::InsufficientMemory);
    assert_eq!(
        why.message,
        "placed 0 of 1 instances: one instance needs at least 47.0 GiB (32.0 GiB weights + 15.0 GiB KV cache for 32768 tokens x 4 sequences + 0 B overhead per stage); the pool's 2 schedulable nodes have 32.0 GiB free in all (largest 16.0 GiB): add nodes or memory, lower the KV budget, or raise maxNodes"
    );
    let d = plan(
        &mut cluster(&[("a", 16)]),
        &request(
            "chat",
            Tier::Daily,
            1,
            &f,
            &strategy(Parallelism::None),
            &[],
        ),
    );
    let why = d.unplaced.unwrap().message;
    assert!(
        why.contains("one replica needs 32.0 GiB on one node")
            && why.contains("largest free node of 1 available has 16.0 GiB"),
        "{why}"
    );
}

#[test]
fn link_requirements_are_met_or_explained() {
    let mut c = cluster(&[("a", 20), ("b", 20)]);
    c.add_link(
        "a",
        "b",
        Link {
            latency_micros: 90,
            bandwidth_mbps: Some(80_000),
            rdma: false,
        },
    );
    let f = model();
    let s = Strategy {
        require_rdma: true,
        tensor_size: None,
        ..strategy(Parallelism::Pipeline)
    };
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    let why = p.unplaced.unwrap();
    assert_eq!(why.reason, UnplaceableReason::LinkRequirements);
    assert!(why.message.contains("RDMA"), "{}", why.message);
    c.add_link(
        "a",
        "b",
        Link {
            latency_micros: 90,
            bandwidth_mbps: Some(80_000),
            rdma: true,
        },
    );
    assert!(
        plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]))
            .unplaced
            .is_none()
    );
}

#[test]
fn plans_reserve_memory_for_the_next_deployment() {
    let mut c = cluster(&[("a", 40), ("b", 40)]);
    let f = model();
    let s = strategy(Parallelism::Pipeline);
    let one = plan(&mut c, &request("one", Tier::Reasoning, 1, &f, &s, &[]));
    let two = plan(&mut c, &request("two", Tier::Reasoning, 1, &f, &s, &[]));
    assert!(one.unplaced.is_none() && two.unplaced.is_none());
    assert_ne!(
        nodes_of(&one.instances[0]),
        nodes_of(&two.instances[0]),
        "the second cannot fit where the first is"
    );
    assert!(c.nodes.values().all(|n| n.free_bytes < 40 * GIB));
}

#[test]
fn a_lost_stage_moves_to_a_spare_even_when_fewer_nodes_would_do() {
    let mut c = cluster(&[("n0", 20), ("n1", 20), ("n2", 20), ("n3", 20)]);
    let f = model();
    let s = Strategy {
        policy: Policy::EvenLayers,
        min_nodes: 2,
        max_nodes: Some(3),
        ..strategy(Parallelism::Pipeline)
    };
    let current = vec![Instance {
        index: 0,
        stages: vec![
            Stage::new("n0", 0..10),
            Stage::new("n1", 10..20),
            Stage::new("n2", 20..30),
        ],
    }];
    c.nodes.get_mut("n1").unwrap().schedulable = false;
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &current));
    assert_eq!(nodes_of(&p.instances[0]), ["n0", "n3", "n2"]);
}

#[test]
fn each_node_counts_the_model_as_its_engine_holds_it() {
    let (f, s) = (model(), strategy(Parallelism::Pipeline));
    // An engine that converts the weights to a type twice the file's size,
    // and one that holds them in half.
    let double = std::sync::Arc::new(Footprint {
        layer_bytes: vec![2 * GIB; 30],
        ..model()
    });
    let half = std::sync::Arc::new(Footprint {
        layer_bytes: vec![GIB / 2; 30],
        ..model()
    });
    let with = |gib: u64, footprint: &std::sync::Arc<Footprint>| Node {
        footprint: Some(footprint.clone()),
        ..Node::new(gib * GIB)
    };

    // Daily: 32 GiB as stored fit a 40 GiB node; 62 GiB as the other
    // engine holds them do not, and the reason says so.
    let mut c = cluster(&[("stored", 40)]);
    c.add_node("converting", with(40, &double));
    let daily = strategy(Parallelism::None);
    let p = plan(&mut c, &request("d", Tier::Daily, 2, &f, &daily, &[]));
    assert_eq!(p.instances.len(), 1);
    assert_eq!(nodes_of(&p.instances[0]), ["stored"]);
    let why = p.unplaced.expect("the second replica does not fit");
    assert!(why.message.contains("needs 62.0 GiB"), "{}", why.message);

    // Pipeline: 32 GiB as stored do not fit 10 + 20 GiB, but the model
    // held in half the bytes on the smaller node does.
    let mut stored_only = cluster(&[("small", 10), ("big", 20)]);
    let p = plan(
        &mut stored_only,
        &request("r", Tier::Reasoning, 1, &f, &s, &[]),
    );
    assert!(p.instances.is_empty());
    let mut c = cluster(&[("big", 20)]);
    c.add_node("small", with(10, &half));
    let p = plan(
        &mut c.clone(),
        &request("r", Tier::Reasoning, 1, &f, &s, &[]),
    );
    assert!(p.unplaced.is_none(), "{p:?}");
    for stage in &p.instances[0].stages {
        let (footprint, free) = match stage.node.as_str() {
            "small" => (&*half, 10 * GIB),
            _ => (&f, 20 * GIB),
        };
        let need = footprint.stage_bytes(&stage.layers, s.kv, 0);
        assert!(need <= free, "{stage:?} needs {need} of {free}");
    }
    assert_eq!(p.instances[0].stages.len(), 2);
}

#[test]
fn nodes_rank_by_the_share_of_the_model_they_hold_as_their_engine_holds_it() {
    let s = strategy(Parallelism::Pipeline);
    let f = model();
    // 62 GiB on the converting engine, 17 GiB on the lean one.
    let double = std::sync::Arc::new(Footprint {
        layer_bytes: vec![2 * GIB; 30],
        ..model()
    });
    let half = std::sync::Arc::new(Footprint {
        layer_bytes: vec![GIB / 2; 30],
        ..model()
    });
    let mut c = Cluster::new();
    c.add_node(
        "converting",
        Node {
            footprint: Some(double),
            ..Node::new(50 * GIB)
        },
    );
    c.add_node(
        "lean",
        Node {
            footprint: Some(half),
            ..Node::new(20 * GIB)
        },
    );
    // The node with more free bytes holds 80 % of the model; the other all
    // of it: one stage there, not a pipeline across both.
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    assert!(p.unplaced.is_none(), "{p:?}");
    assert_eq!(nodes_of(&p.instances[0]), ["lean"]);
    assert_eq!(p.instances[0].stages[0].layers, 0..30);

    // With the same engine everywhere, room is free bytes: the bigger node.
    let mut c = cluster(&[("a", 33), ("b", 40)]);
    let p = plan(&mut c, &request("r", Tier::Reasoning, 1, &f, &s, &[]));
    assert_eq!(nodes_of(&p.instances[0]), ["b"]);
}
