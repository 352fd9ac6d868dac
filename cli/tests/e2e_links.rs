//! End to end across network namespaces: six agents, each in its own
//! namespace with its own address on a bridge; the operator and the gateway
//! on the machine; the real model.
//!
//! - A slow link (`tc netem`, 25 ms each way between two nodes, or where the
//!   kernel lacks netem `tc htb` at 1 Mbit/s) is measured by
//!   the agents and the planner orders a 4-stage ring so that it never uses
//!   that link.
//! - A node cut off (its link down) loses its Lease; the operator re-places
//!   its instance on the other node of the pool, which serves again through
//!   the gateway; when the link returns nothing is duplicated: one Shard per
//!   stage, and the returning agent serves nothing stale.
//!
//! Prints a `REPORT` line with the time from node loss to serving again and
//! the requests that failed meanwhile.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::{WAIT, agent_status, create_model, start};

/// One short chat through the gateway, given 5 s.
async fn chat(http: &reqwest::Client, gateway: &str, model: &str) -> Result<(), String> {
    e2e::chat(http, gateway, model, Duration::from_secs(5)).await
}
use kube::Api;
use kube::api::{ListParams, PostParams};
use shardplane_crds::*;
use shardplane_operator::conditions::is_true;
use shardplane_testkit::{control_plane, eventually, eventually_or, fixtures, unique_name};

mod e2e;

/// When a request was sent, and how it ended.
type Probe = (Instant, Result<(), String>);

async fn ready(api: &Api<ModelDeployment>, name: &str) -> Option<ModelDeployment> {
    let d = api.get(name).await.ok()?;
    let st = d.status.as_ref()?;
    (st.ready_replicas == d.spec.replicas && is_true(&st.conditions, CONDITION_READY)).then_some(d)
}

fn stage_nodes(d: &ModelDeployment) -> Vec<String> {
    d.status.as_ref().unwrap().instances[0]
        .stages
        .iter()
        .map(|s| s.node.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_avoids_a_slow_link_and_a_cut_off_node_is_replaced_without_duplicates() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client, "e2e-links")
        .await
        .unwrap();
    let tag = unique_name("links");
    let (ring_pool, part_pool) = (format!("{tag}-ring"), format!("{tag}-part"));
    let pools = [
        ring_pool.as_str(),
        ring_pool.as_str(),
        ring_pool.as_str(),
        ring_pool.as_str(),
        part_pool.as_str(),
        part_pool.as_str(),
    ];
    // The prober below gives up on a request after 5 s: a stage refuses work
    // it cannot start within 2 s rather than do it for nobody. Only the node
    // serving the prober computes at a time, so agents take both cores.
    let mut cluster = start(
        'l',
        77,
        &pools,
        &tag,
        &[
            "--probe-links-seconds",
            "2",
            "--max-queue-wait-seconds",
            "2",
        ],
    );
    let http = shardplane_models::http_client().unwrap();

    create_model(&client, &ns, &format!("{tag}-m")).await;
    let pool_api: Api<NodePool> = Api::all(client.clone());
    pool_api
        .create(
            &PostParams::default(),
            &fixtures::node_pool(&ring_pool, Tier::Reasoning),
        )
        .await
        .unwrap();
    pool_api
        .create(
            &PostParams::default(),
            &fixtures::node_pool(&part_pool, Tier::Daily),
        )
        .await
        .unwrap();
    let strategies: Api<ShardingStrategy> = Api::all(client.clone());
    let mut ring = fixtures::strategy(&format!("{tag}-ring4"), Parallelism::Pipeline);
    ring.spec.min_nodes = Some(4);
    ring.spec.max_nodes = Some(4);
    strategies
        .create(&PostParams::default(), &ring)
        .await
        .unwrap();
    strategies
        .create(
            &PostParams::default(),
            &fixtures::strategy(&format!("{tag}-whole"), Parallelism::None),
        )
        .await
        .unwrap();

    // The slow link: between the first two ring nodes, which an order that
    // ignored links would put next to each other.
    let nodes_api: Api<InferenceNode> = Api::all(client.clone());
    let link = |from: usize, to: usize| {
        let nodes_api = nodes_api.clone();
        let (from, to) = (cluster.nodes[from].clone(), cluster.nodes[to].clone());
        async move {
            let n = nodes_api.get(&from).await.ok()?;
            n.status?
                .links
                .into_iter()
                .find(|l| l.node == to)
                .map(|l| (l.latency_micros, l.bandwidth_mbps.unwrap_or(0)))
        }
    };
    for (a, b) in [(0, 1), (0, 2), (2, 3), (1, 3)] {
        eventually("the agents measure their links", WAIT, || link(a, b)).await;
    }
    let fast = link(0, 2).await.unwrap();
    let how = cluster.net.slow_link(0, 1);
    let last_measured = Mutex::new(Vec::new());
    let slow = eventually_or(
        "the slow link is measured",
        WAIT,
        || async {
            // Each end measures; an end whose probe cannot get through at all
            // (a shaped link clogged by the throughput probe) lists no link,
            // and the other end's measurement stands for both.
            let measured: Vec<(u32, u32)> = [link(0, 1).await, link(1, 0).await]
                .into_iter()
                .flatten()
                .collect();
            *last_measured.lock().unwrap() = measured.clone();
            let slow = |l: &(u32, u32)| l.0 > 10 * fast.0 || l.1 * 10 < fast.1;
            (!measured.is_empty() && measured.iter().all(slow)).then(|| measured[0])
        },
        || {
            format!(
                "{how}: the slow link's two ends last measured {:?} (microseconds, Mbit/s) against {fast:?} on a fast one",
                last_measured.lock().unwrap()
            )
        },
    )
    .await;

    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    let mut ring_deployment =
        fixtures::deployment("ring", "m", &ring_pool, &format!("{tag}-ring4"));
    ring_deployment.spec.aliases = vec![format!("{tag}-ring")];
    deployments
        .create(&PostParams::default(), &ring_deployment)
        .await
        .unwrap();
    let placed = eventually("the ring is Ready", WAIT, || ready(&deployments, "ring")).await;
    let order = stage_nodes(&placed);
    assert_eq!(order.len(), 4, "{order:?}");
    let slow_pair = [cluster.nodes[0].as_str(), cluster.nodes[1].as_str()];
    for i in 0..order.len() {
        let (a, b) = (&order[i], &order[(i + 1) % order.len()]);
        assert!(
            !(slow_pair.contains(&a.as_str()) && slow_pair.contains(&b.as_str())),
            "the ring {order:?} uses the slow link {slow_pair:?}"
        );
    }
    eventually("the ring answers", WAIT, || async {
        chat(&http, &cluster.gateway, &format!("{tag}-ring"))
            .await
            .ok()
    })
    .await;
    println!(
        "REPORT slow link ({how}): measured {} us round trip, {} Mbit/s, against {} us, {} Mbit/s; ring order {order:?} avoids {slow_pair:?}",
        slow.0, slow.1, fast.0, fast.1
    );

    // Cut off the node holding the daily instance.
    let mut part = fixtures::deployment("part", "m", &part_pool, &format!("{tag}-whole"));
    part.spec.aliases = vec![format!("{tag}-part")];
    deployments
        .create(&PostParams::default(), &part)
        .await
        .unwrap();
    let placed = eventually("the daily instance is Ready", WAIT, || {
        ready(&deployments, "part")
    })
    .await;
    let lost_node = stage_nodes(&placed)[0].clone();
    let lost = cluster.nodes.iter().position(|n| *n == lost_node).unwrap();
    let other = if lost == 4 { 5 } else { 4 };
    let model_name = format!("{tag}-part");
    eventually("the daily instance answers", WAIT, || async {
        chat(&http, &cluster.gateway, &model_name).await.ok()
    })
    .await;

    // A request every 250 ms (each on its own, so one that hangs on the cut
    // link does not hold the next back) from before the cut to after the
    // link returns.
    let outcomes: Arc<Mutex<Vec<Probe>>> = Default::default();
    let prober = {
        let (http, gateway, model_name, outcomes) = (
            http.clone(),
            cluster.gateway.clone(),
            model_name.clone(),
            outcomes.clone(),
        );
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(250));
            loop {
                every.tick().await;
                let (http, gateway, model_name, outcomes) = (
                    http.clone(),
                    gateway.clone(),
                    model_name.clone(),
                    outcomes.clone(),
                );
                tokio::spawn(async move {
                    let sent = Instant::now();
                    let result = chat(&http, &gateway, &model_name).await;
                    outcomes.lock().unwrap().push((sent, result));
                });
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cut = Instant::now();
    cluster.net.set_connected(lost, false);
    // Serving again: the first success after the first failure since the cut.
    let serving_again = loop {
        let found = {
            let mut o = outcomes.lock().unwrap().clone();
            o.sort_by_key(|(t, _)| *t);
            let first_failure = o
                .iter()
                .find(|(t, r)| *t >= cut && r.is_err())
                .map(|(t, _)| *t);
            first_failure.and_then(|f| {
                o.iter()
                    .filter(|(t, r)| *t > f && r.is_ok())
                    .map(|(t, _)| *t)
                    .next()
            })
        };
        if let Some(t) = found {
            break t;
        }
        if cut.elapsed() > WAIT {
            let d = deployments.get("part").await.ok().and_then(|d| d.status);
            // What the node that took over did (its generations and passes).
            let url = format!("http://{}:9091/metrics", cluster.net.hosts[other].ip);
            let agent = match http.get(&url).send().await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(e) => e.to_string(),
            };
            let agent: Vec<&str> = agent
                .lines()
                .filter(|l| {
                    l.starts_with("shardplane_agent_generations_total")
                        || l.starts_with("shardplane_agent_forward_seconds_sum")
                        || l.starts_with("shardplane_agent_forward_seconds_count")
                        || l.starts_with("shardplane_agent_forward_tokens_total")
                })
                .collect();
            let o = outcomes.lock().unwrap();
            let since: Vec<_> = o.iter().filter(|(t, _)| *t >= cut).collect();
            panic!(
                "not serving again {} s after the cut: {} requests since, last {:?}; deployment status {d:?}; the node that took over: {agent:?}",
                WAIT.as_secs(),
                since.len(),
                since.last()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let now_on = eventually("re-placed on the other node", WAIT, || async {
        let d = ready(&deployments, "part").await?;
        let nodes = stage_nodes(&d);
        (nodes == [cluster.nodes[other].clone()]).then_some(nodes)
    })
    .await;
    let outage = serving_again.duration_since(cut);

    // The link returns: the node comes back, and nothing is duplicated.
    let healed = Instant::now();
    cluster.net.set_connected(lost, true);
    eventually("the node is Ready again", WAIT, || async {
        let n = nodes_api.get(&lost_node).await.ok()?;
        is_true(&n.status?.conditions, CONDITION_READY).then_some(())
    })
    .await;
    let endpoint = format!("{}:7070", cluster.net.hosts[lost].ip);
    eventually("the returning agent serves nothing stale", WAIT, || async {
        let status = agent_status(&endpoint).await?;
        let stale = status.stages.iter().any(|s| {
            s.shard
                .as_ref()
                .is_some_and(|r| r.namespace == ns && r.name.starts_with("part-"))
        });
        (!stale).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    let part_shards = shards
        .list(&ListParams::default().labels(&format!("{DEPLOYMENT_LABEL}=part")))
        .await
        .unwrap();
    let placed_on: Vec<String> = part_shards
        .items
        .iter()
        .map(|s| s.spec.node.clone())
        .collect();
    assert_eq!(
        placed_on,
        [cluster.nodes[other].clone()],
        "one Shard, on the node that took over"
    );
    let d = ready(&deployments, "part").await.expect("still Ready");
    assert_eq!(d.status.unwrap().replicas, 1);
    prober.abort();
    // Requests still in flight end within their 5 s timeout.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after_heal: Vec<String> = outcomes
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| *t >= healed)
        .filter_map(|(t, r)| {
            r.clone().err().map(|e| {
                format!(
                    "{:.1} s after the heal: {e}",
                    t.duration_since(healed).as_secs_f64()
                )
            })
        })
        .collect();
    let (failed, sent) = {
        let o = outcomes.lock().unwrap();
        let during: Vec<_> = o
            .iter()
            .filter(|(t, _)| *t >= cut && *t < serving_again)
            .collect();
        (
            during.iter().filter(|(_, r)| r.is_err()).count(),
            during.len(),
        )
    };
    let sent_after_heal = outcomes
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| *t >= healed)
        .count();
    // Not asserted (a known problem, under investigation): requests sent
    // in a window of about a second, 2-4 s after the link returns, hang
    // until their timeout, with no error at the gateway. They are reported.
    println!(
        "REPORT partition: node {lost_node} cut off; its instance served again on {now_on:?} after {:.1} s; {failed} of {sent} requests sent meanwhile failed (lease 4 s); after the link returned {} of {sent_after_heal} failed: {after_heal:?}",
        outage.as_secs_f64(),
        after_heal.len()
    );

    // Stopped before their objects go, so nothing reacts to the deletions.
    cluster.operator.take();
    for a in &mut cluster.agents {
        a.take();
    }
    for n in &cluster.nodes {
        let _ = nodes_api.delete(n, &Default::default()).await;
    }
    let _ = pool_api.delete(&ring_pool, &Default::default()).await;
    let _ = pool_api.delete(&part_pool, &Default::default()).await;
    let _ = strategies
        .delete(&format!("{tag}-ring4"), &Default::default())
        .await;
    let _ = strategies
        .delete(&format!("{tag}-whole"), &Default::default())
        .await;
}
