//! Placing 100 deployments on 1,000 nodes: median wall time of planning them
//! all, one after another, over several rounds. `cargo bench -p shardplane-placement`.

use std::time::Instant;

use shardplane_placement::*;

const GIB: u64 = 1 << 30;

fn cluster() -> Cluster {
    let mut c = Cluster::new();
    for i in 0..1000u64 {
        let mut node = Node::new((64 + (i % 5) * 32) * GIB);
        node.has_weights = i % 7 == 0;
        c.add_node(format!("node-{i:04}"), node);
    }
    // Racks of ten with fast links inside, slower links to the next rack.
    for i in 0..1000usize {
        for j in i + 1..(i / 10 + 1) * 10 {
            c.add_link(
                &format!("node-{i:04}"),
                &format!("node-{j:04}"),
                Link {
                    latency_micros: 60 + (i + j) as u32 % 40,
                    bandwidth_mbps: Some(40_000),
                    rdma: true,
                },
            );
        }
        if i + 10 < 1000 {
            c.add_link(
                &format!("node-{i:04}"),
                &format!("node-{:04}", i + 10),
                Link {
                    latency_micros: 400,
                    bandwidth_mbps: Some(10_000),
                    rdma: false,
                },
            );
        }
    }
    c
}

fn main() {
    let daily_model = Footprint {
        layer_bytes: vec![GIB / 2; 32],
        embedding_bytes: GIB,
        output_bytes: GIB,
        kv_bytes_per_token_per_layer: 2 * 1024,
        kv_heads: None,
        kv_token_caps: Vec::new(),
    };
    let big_model = Footprint {
        layer_bytes: vec![3 * GIB; 80],
        embedding_bytes: 2 * GIB,
        output_bytes: 2 * GIB,
        kv_bytes_per_token_per_layer: 4 * 1024,
        kv_heads: None,
        kv_token_caps: Vec::new(),
    };
    let whole = Strategy {
        parallelism: Parallelism::None,
        policy: Policy::MemoryWeighted,
        min_nodes: 1,
        max_nodes: Some(1),
        kv: KvBudget {
            context_length: 8192,
            sequences: 4,
        },
        stage_overhead: GIB / 2,
        max_latency_micros: None,
        min_bandwidth_mbps: None,
        require_rdma: false,
        tensor_size: None,
    };
    let pipeline = Strategy {
        parallelism: Parallelism::Pipeline,
        min_nodes: 2,
        max_nodes: Some(8),
        kv: KvBudget {
            context_length: 32_768,
            sequences: 4,
        },
        ..whole.clone()
    };
    let names: Vec<String> = (0..100).map(|d| format!("deployment-{d:03}")).collect();
    let mut times = Vec::new();
    let mut placed = 0;
    for _ in 0..15 {
        let mut c = cluster();
        let start = Instant::now();
        placed = 0;
        for (d, name) in names.iter().enumerate() {
            let (tier, replicas, footprint, strategy) = if d % 2 == 0 {
                (Tier::Daily, 3, &daily_model, &whole)
            } else {
                (Tier::Reasoning, 2, &big_model, &pipeline)
            };
            let p = plan(
                &mut c,
                &Request {
                    deployment: name,
                    tier,
                    replicas,
                    footprint,
                    strategy,
                    current: &[],
                },
            );
            placed += p.instances.len();
        }
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "placement: 100 deployments ({placed} instances) on 1000 nodes: median {:.2} ms (min {:.2}, max {:.2}) over {} rounds",
        times[times.len() / 2],
        times[0],
        times[times.len() - 1],
        times.len()
    );
}
