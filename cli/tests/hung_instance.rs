//! A hung instance costs a few seconds, not the answer: two daily replicas
//! on agents in network namespaces, Leases long enough (60 s) that the
//! operator keeps both nodes Ready throughout, and a gateway that gives an
//! instance 2 s to start an answer (`--start-timeout-seconds 2`). One agent
//! is stopped (SIGSTOP): its connections stay open and answer nothing.
//!
//! Every request is answered, by the other replica. The same prompt again
//! and again pays the 2 s deadline once: the other replica then holds its
//! beginning and is preferred for it. Fresh prompts that prefer the hung
//! instance pay it until that instance has failed three times in a row and
//! is tried last (outlier ejection, counted in
//! `shardplane_gateway_ejections_total`); then none does. Prints `REPORT`
//! lines.

use std::time::{Duration, Instant};

use e2e::{WAIT, chat, chat_saying, create_model, start_with};
use shardplane_testkit::{control_plane, eventually, metrics, unique_name};

mod e2e;

const REQUESTS: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_instance_is_passed_over_after_its_start_deadline_and_then_tried_last() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client, "hung").await.unwrap();
    let tag = unique_name("hung");
    let pool = format!("{tag}-pool");
    let cluster = start_with(
        'h',
        82,
        &[pool.as_str(), pool.as_str()],
        &tag,
        &["--lease-seconds", "60"],
        &["--start-timeout-seconds", "2"],
        |_| (),
    );
    let gateway = cluster.gateway.clone();
    let served = format!("{tag}-m");
    create_model(&client, &ns, &served).await;
    let strategy = format!("{tag}-whole");
    let deployments = e2e::create_daily(&client, &ns, &pool, &strategy, 2).await;
    eventually("two replicas are Ready", WAIT, || async {
        let st = deployments.get("chat").await.ok()?.status?;
        (st.ready_replicas == 2).then_some(())
    })
    .await;
    let http = shardplane_models::http_client().unwrap();
    eventually("it answers", WAIT, || async {
        chat(&http, &gateway, &served, Duration::from_secs(20))
            .await
            .ok()
    })
    .await;

    // Stop the agent this prompt goes to first (the gateway prefers one
    // instance per prompt): the one whose generations grow with one more.
    let generations = || async {
        let mut v = Vec::new();
        for host in &cluster.net.hosts {
            let scraped = metrics::scrape(&format!("{}:9091", host.ip)).await;
            v.push(metrics::sum(&scraped, "shardplane_agent_generations_total"));
        }
        v
    };
    let before = generations().await;
    chat(&http, &gateway, &served, Duration::from_secs(20))
        .await
        .unwrap();
    let after = generations().await;
    let preferred = (0..2).find(|i| after[*i] > before[*i]).unwrap();
    let agent = cluster.agents[preferred].as_ref().unwrap();
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", agent.0.id())).unwrap();
    assert_eq!(
        comm.trim(),
        "shardplane",
        "the agent's own process is stopped"
    );
    agent.signal("-STOP");
    let gateway_counts = || async {
        let scraped = metrics::scrape(&cluster.gateway_admin).await;
        (
            metrics::sum(
                &scraped,
                "shardplane_gateway_upstream_errors_total{kind=\"instance\"",
            ),
            metrics::sum(&scraped, "shardplane_gateway_ejections_total"),
        )
    };
    let mut times = Vec::new();
    let mut failed = Vec::new();
    for _ in 0..REQUESTS {
        let t = Instant::now();
        if let Err(e) = chat(&http, &gateway, &served, Duration::from_secs(60)).await {
            failed.push(e);
        }
        times.push(t.elapsed().as_secs_f64());
    }
    let slow = times.iter().filter(|t| **t >= 1.9).count();
    let (instance_failures, ejections) = gateway_counts().await;
    println!(
        "REPORT one of two replicas hung (SIGSTOP), one prompt: {} of {REQUESTS} requests failed; seconds each {times:.2?}; {slow} took 1.9 s or more; {instance_failures} attempts on the hung instance; {ejections} ejections",
        failed.len()
    );
    assert!(failed.is_empty(), "requests failed: {failed:?}");
    assert_eq!(
        (instance_failures, ejections),
        (1.0, 0.0),
        "one attempt met the hung instance; then the replica that answered held the prompt"
    );

    // Fresh prompts: about half prefer the hung instance, until it has
    // failed three times in a row (the one above included).
    let mut fresh = 0;
    let mut times = Vec::new();
    while gateway_counts().await.1 < 1.0 {
        assert!(fresh < 40, "no ejection after {fresh} fresh prompts");
        fresh += 1;
        let t = Instant::now();
        chat_saying(
            &http,
            &gateway,
            &served,
            &format!("Say hi to {fresh}."),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    // Ejected: tried last, so no request meets it.
    for n in 0..REQUESTS {
        chat_saying(
            &http,
            &gateway,
            &served,
            &format!("Say hello to {n}."),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    }
    agent.signal("-CONT");
    let (instance_failures, ejections) = gateway_counts().await;
    println!(
        "REPORT fresh prompts: ejected after {fresh} (seconds each {times:.2?}); {instance_failures} attempts on the hung instance in all; {ejections} ejections"
    );
    assert_eq!(
        (instance_failures, ejections),
        (3.0, 1.0),
        "three attempts in a row met the hung instance, then it was ejected and met no more"
    );
}
