//! Overload: 200 clients at once against one replica whose KV budget holds
//! about three answers (`kvCache` 96 tokens × 2 sequences), half of them
//! streaming, through a gateway that waits 8 s for room
//! (`--busy-wait-seconds 8`). The real model, an agent in a network
//! namespace, the operator and the gateways on the machine.
//!
//! No request is lost: each ends, within its deadline, either with a whole
//! answer (a finish reason, usage, text; a stream ends with `[DONE]`) or
//! with a 429 in OpenAI's error shape carrying `Retry-After`. Afterwards the
//! agent holds no KV reservation and serves the next request, and its
//! memory grew by a bounded amount.
//!
//! Prints a `REPORT` line with the counts, times and memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use e2e::{WAIT, chat, create_model, start_with};
use kube::Api;
use kube::api::PostParams;
use shardplane_crds::*;
use shardplane_operator::conditions::is_true;
use shardplane_testkit::{control_plane, eventually, fixtures, metrics, unique_name};

mod e2e;

const CLIENTS: usize = 200;
const BUSY_WAIT_SECONDS: u64 = 8;

/// How one request ended.
#[derive(Debug)]
enum Outcome {
    /// A whole answer.
    Answered,
    /// 429 with Retry-After, in OpenAI's error shape.
    Refused,
    /// Anything else: a lost request.
    Lost(String),
}

/// One chat through the gateway, streamed or not, judged whole.
async fn one(http: &reqwest::Client, gateway: &str, model: &str, stream: bool) -> Outcome {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
    });
    let sent = e2e::chat_request(http, gateway, &body)
        // The busy wait, then a whole answer at the back of the queue.
        .timeout(Duration::from_secs(120))
        .send()
        .await;
    let r = match sent {
        Ok(r) => r,
        Err(e) => return Outcome::Lost(format!("no answer: {e:?}")),
    };
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if status == 429 {
        let text = r.text().await.unwrap_or_default();
        let body: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let shaped = body["error"]["type"] == "rate_limit_error"
            && body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty());
        let waits = retry_after.is_some_and(|s| s.parse::<u64>().is_ok_and(|s| s > 0));
        return if shaped && waits {
            Outcome::Refused
        } else {
            Outcome::Lost(format!("a 429 without its shape or Retry-After: {text}"))
        };
    }
    if status != 200 {
        let text = r.text().await.unwrap_or_default();
        return Outcome::Lost(format!("{status}: {text}"));
    }
    if !stream {
        let text = match r.text().await {
            Ok(t) => t,
            Err(e) => return Outcome::Lost(format!("the body did not arrive whole: {e}")),
        };
        let body: serde_json::Value = match serde_json::from_str(&text) {
            Ok(b) => b,
            Err(e) => return Outcome::Lost(format!("the body is not JSON ({e}): {text}")),
        };
        let choice = &body["choices"][0];
        let whole = choice["finish_reason"].is_string()
            && choice["message"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            && body["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0;
        return if whole {
            Outcome::Answered
        } else {
            Outcome::Lost(format!("not a whole answer: {body}"))
        };
    }
    match e2e::read_chat_stream(r).await {
        Ok(_) => Outcome::Answered,
        Err(why) => Outcome::Lost(why),
    }
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))?
                .trim()
                .trim_end_matches(" kB")
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0)
        * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_at_once_are_each_answered_or_told_to_retry() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client, "overload")
        .await
        .unwrap();
    let tag = unique_name("over");
    let pool = format!("{tag}-pool");
    // A gateway that waits only briefly for room before it answers 429.
    let busy_wait = BUSY_WAIT_SECONDS.to_string();
    let mut cluster = start_with(
        'o',
        80,
        &[pool.as_str()],
        &tag,
        // This test is about load, not lost nodes: with the 4 s Lease the
        // other tests use, 200 clients starving two cores can delay a
        // renewal past it, and the operator then takes the Shard away (once
        // in CI: 47 requests answered 503 "shard … is not loaded"; the
        // report printed on a loss now shows the Shards and the node).
        &["--lease-seconds", "30"],
        &["--busy-wait-seconds", &busy_wait],
        |_| (),
    );
    let gateway = cluster.gateway.clone();
    let http = shardplane_models::http_client().unwrap();

    let served = format!("{tag}-m");
    create_model(&client, &ns, &served).await;
    Api::<NodePool>::all(client.clone())
        .create(
            &PostParams::default(),
            &fixtures::node_pool(&pool, Tier::Daily),
        )
        .await
        .unwrap();
    let strategies: Api<ShardingStrategy> = Api::all(client.clone());
    let mut small = fixtures::strategy(&format!("{tag}-small"), Parallelism::None);
    small.spec.kv_cache = KvCacheBudget {
        context_length: 96,
        concurrent_sequences: 2,
    };
    strategies
        .create(&PostParams::default(), &small)
        .await
        .unwrap();
    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(
            &PostParams::default(),
            &fixtures::deployment("small", "m", &pool, &format!("{tag}-small")),
        )
        .await
        .unwrap();
    eventually("the deployment is Ready", WAIT, || async {
        let d = deployments.get("small").await.ok()?;
        let st = d.status?;
        (st.ready_replicas == 1 && is_true(&st.conditions, CONDITION_READY)).then_some(())
    })
    .await;
    eventually("it answers", WAIT, || async {
        chat(&http, &gateway, &served, Duration::from_secs(20))
            .await
            .ok()
    })
    .await;

    // The agent's memory, sampled while the clients come.
    let pid = cluster.agents[0].as_ref().unwrap().0.id();
    let before = rss(pid);
    let peak = Arc::new(AtomicU64::new(before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(rss(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let started = Instant::now();
    let outcomes = futures::future::join_all((0..CLIENTS).map(|i| {
        let (http, gateway, served) = (http.clone(), gateway.clone(), served.clone());
        async move {
            let t = Instant::now();
            let outcome = one(&http, &gateway, &served, i % 2 == 0).await;
            (outcome, t.elapsed())
        }
    }))
    .await;
    let took = started.elapsed();
    sampling.store(false, Ordering::Relaxed);
    sampler.await.unwrap();

    let lost: Vec<String> = outcomes
        .iter()
        .filter_map(|(o, _)| match o {
            Outcome::Lost(why) => Some(why.clone()),
            _ => None,
        })
        .collect();
    let answered = outcomes
        .iter()
        .filter(|(o, _)| matches!(o, Outcome::Answered))
        .count();
    let refused = outcomes
        .iter()
        .filter(|(o, _)| matches!(o, Outcome::Refused))
        .count();
    let longest = outcomes.iter().map(|(_, t)| *t).max().unwrap_or_default();
    let grew = peak.load(Ordering::Relaxed).saturating_sub(before);
    let admin = format!("{}:9091", cluster.net.hosts[0].ip);
    let agent = metrics::scrape(&admin).await;
    let refusals = metrics::sum(
        &agent,
        "shardplane_agent_generations_total{outcome=\"refused\"",
    );
    println!(
        "REPORT {CLIENTS} clients at once: {answered} answered, {refused} told to retry (429 + Retry-After), {} lost, in {:.1} s (longest {:.1} s); the agent refused {refusals} generations for room; agent memory {} MiB before, peak +{} MiB",
        lost.len(),
        took.as_secs_f64(),
        longest.as_secs_f64(),
        before >> 20,
        grew >> 20
    );
    if !lost.is_empty() {
        // Name the cause: a Shard gone or re-created, or the node gone NotReady.
        let shards = Api::<Shard>::namespaced(client.clone(), &ns)
            .list(&Default::default())
            .await
            .map(|l| {
                l.items
                    .iter()
                    .map(|s| {
                        format!(
                            "{} (uid {:?}, created {:?}, node {}, status {:?})",
                            s.metadata.name.as_deref().unwrap_or("?"),
                            s.metadata.uid,
                            s.metadata.creation_timestamp,
                            s.spec.node,
                            s.status
                        )
                    })
                    .collect::<Vec<_>>()
            });
        let nodes = Api::<InferenceNode>::all(client.clone())
            .list(&Default::default())
            .await
            .map(|l| {
                l.items
                    .iter()
                    .filter(|n| {
                        n.metadata
                            .name
                            .as_deref()
                            .is_some_and(|n| n.starts_with(&tag))
                    })
                    .map(|n| {
                        format!(
                            "{:?}: {:?}",
                            n.metadata.name,
                            n.status.as_ref().map(|s| &s.conditions)
                        )
                    })
                    .collect::<Vec<_>>()
            });
        let deployment = deployments.get("small").await.map(|d| d.status);
        println!("LOST: shards now {shards:?}\nnodes {nodes:?}\ndeployment {deployment:?}");
    }
    assert!(lost.is_empty(), "{} requests lost: {lost:?}", lost.len());
    assert!(
        answered > 0,
        "none answered: the budget admits several at a time"
    );
    assert!(
        refused > 0,
        "none refused: 200 clients must overflow a budget of three answers within {BUSY_WAIT_SECONDS} s"
    );
    assert!(
        grew < 512 << 20,
        "the agent's memory grew by {} MiB under load",
        grew >> 20
    );

    // Afterwards: no KV held for anyone, and the next request is served.
    let kv = |m: &str, kind: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("shardplane_agent_kv_tokens{"))
            .filter(|l| l.contains(&format!("kind=\"{kind}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    eventually("every KV reservation is returned", WAIT, || async {
        let m = metrics::scrape(&admin).await;
        (kv(&m, "budget") > 0.0 && kv(&m, "reserved") == 0.0).then_some(())
    })
    .await;
    chat(&http, &gateway, &served, Duration::from_secs(20))
        .await
        .expect("served after the burst");

    cluster.operator.take();
    for a in &mut cluster.agents {
        a.take();
    }
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    for n in &cluster.nodes {
        let _ = nodes.delete(n, &Default::default()).await;
    }
    let _ = Api::<NodePool>::all(client.clone())
        .delete(&pool, &Default::default())
        .await;
    let _ = strategies
        .delete(&format!("{tag}-small"), &Default::default())
        .await;
}
