//! End to end across network namespaces: which address a node advertises,
//! and which one its peers use.
//!
//! ```text
//!   machine (API server relay, operator, gateway) ── LAN 10.78.0.0/24 ──┬── host 0
//!                                                                       └── host 1
//!   host 0 ── thunderbolt0, 10.79.0.0/24 (only these two) ── host 1
//! ```
//!
//! Both agents listen on every interface (`--data-plane-address
//! 0.0.0.0:7070`) and are on two networks; the gateway is on the LAN only.
//! The faster bridge must not be what they advertise, since the gateway
//! cannot reach it: each advertises its address on the route to the API
//! server. Their link to each other, measured and used for activations,
//! is the bridge.

use std::time::Duration;

use e2e::{WAIT, chat, create_model, start_with};
use kube::Api;
use kube::api::PostParams;
use shardplane_crds::*;
use shardplane_operator::conditions::is_true;
use shardplane_testkit::{control_plane, eventually, eventually_or, fixtures, unique_name};

mod e2e;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_two_networks_advertise_the_one_the_gateway_reaches_and_talk_over_the_bridge() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client, "e2e-addr")
        .await
        .unwrap();
    let tag = unique_name("addr");
    let pool = format!("{tag}-pool");
    let mut bridge = [std::net::Ipv4Addr::UNSPECIFIED; 2];
    let mut cluster = start_with(
        'a',
        78,
        &[pool.as_str(), pool.as_str()],
        &tag,
        &[
            "--data-plane-address",
            "0.0.0.0:7070",
            "--probe-links-seconds",
            "2",
        ],
        &[],
        |net| bridge = net.private_link(0, 1, 79, "thunderbolt0"),
    );
    let lan: Vec<String> = cluster.net.hosts.iter().map(|h| h.ip.to_string()).collect();
    let http = shardplane_models::http_client().unwrap();

    // What each node registered: both addresses, the LAN one advertised.
    let nodes_api: Api<InferenceNode> = Api::all(client.clone());
    for (i, node) in cluster.nodes.iter().enumerate() {
        let status = eventually("the node registers", WAIT, || async {
            nodes_api.get(node).await.ok()?.status
        })
        .await;
        let bridge_address = status
            .addresses
            .iter()
            .find(|a| a.address == bridge[i].to_string())
            .unwrap_or_else(|| panic!("{node} lists no bridge address: {:?}", status.addresses));
        assert_eq!(
            bridge_address.kind,
            LinkKind::Thunderbolt,
            "{bridge_address:?}"
        );
        assert_eq!(
            status.data_plane_endpoint.as_deref(),
            Some(format!("{}:7070", lan[i]).as_str()),
            "{node} must advertise its address on the route to the API server, not the bridge the gateway cannot reach: {:?}",
            status.addresses
        );
    }

    // The agents measure their link over the bridge.
    for (from, to) in [(0, 1), (1, 0)] {
        let (node, peer) = (&cluster.nodes[from], &cluster.nodes[to]);
        let want = format!("{}:7070", bridge[to]);
        let link = eventually_or(
            "the link is measured",
            WAIT,
            || async {
                let links = nodes_api.get(node).await.ok()?.status?.links;
                links.into_iter().find(|l| l.node == *peer)
            },
            || format!("{node} lists no link to {peer}"),
        )
        .await;
        assert_eq!(
            (link.address.as_str(), link.kind),
            (want.as_str(), LinkKind::Thunderbolt),
            "{node} → {peer}"
        );
    }

    // A pipeline across both, served through the gateway on the LAN.
    create_model(&client, &ns, &format!("{tag}-m")).await;
    let pools: Api<NodePool> = Api::all(client.clone());
    pools
        .create(
            &PostParams::default(),
            &fixtures::node_pool(&pool, Tier::Reasoning),
        )
        .await
        .unwrap();
    let strategies: Api<ShardingStrategy> = Api::all(client.clone());
    let mut two = fixtures::strategy(&format!("{tag}-two"), Parallelism::Pipeline);
    two.spec.min_nodes = Some(2);
    two.spec.max_nodes = Some(2);
    strategies
        .create(&PostParams::default(), &two)
        .await
        .unwrap();
    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    let mut pipeline = fixtures::deployment("split", "m", &pool, &format!("{tag}-two"));
    pipeline.spec.aliases = vec![format!("{tag}-split")];
    deployments
        .create(&PostParams::default(), &pipeline)
        .await
        .unwrap();
    let placed = eventually("the pipeline is Ready", WAIT, || async {
        let d = deployments.get("split").await.ok()?;
        let st = d.status.as_ref()?;
        (st.ready_replicas == 1 && is_true(&st.conditions, CONDITION_READY)).then_some(d)
    })
    .await;
    let order: Vec<usize> = placed.status.unwrap().instances[0]
        .stages
        .iter()
        .map(|s| cluster.nodes.iter().position(|n| *n == s.node).unwrap())
        .collect();
    assert_eq!(order.len(), 2, "{order:?}");
    let last_error = std::sync::Mutex::new(String::new());
    eventually_or(
        "the pipeline answers through the gateway",
        WAIT,
        || async {
            let r = chat(
                &http,
                &cluster.gateway,
                &format!("{tag}-split"),
                Duration::from_secs(20),
            )
            .await;
            if let Err(e) = &r {
                *last_error.lock().unwrap() = e.clone();
            }
            r.ok()
        },
        || format!("last answer: {}", last_error.lock().unwrap()),
    )
    .await;

    // The head sends activations over the bridge, never over the LAN.
    let (head, next) = (order[0], order[1]);
    let connections = cluster.net.connections(head);
    assert!(
        connections.contains(&format!("{}:7070", bridge[next])),
        "the head on host {head} has no connection to the next stage's bridge address {}:7070: {connections}",
        bridge[next]
    );
    assert!(
        !connections.contains(&format!("{}:7070", lan[next])),
        "the head on host {head} talks to the next stage over the LAN: {connections}"
    );
    println!(
        "REPORT advertised {:?} (LAN); links and activations over the bridge {bridge:?}; pipeline order {order:?}",
        lan
    );

    // Stopped before their objects go, so nothing reacts to the deletions.
    cluster.operator.take();
    for a in &mut cluster.agents {
        a.take();
    }
    for n in &cluster.nodes {
        let _ = nodes_api.delete(n, &Default::default()).await;
    }
    let _ = pools.delete(&pool, &Default::default()).await;
    let _ = strategies
        .delete(&format!("{tag}-two"), &Default::default())
        .await;
}
