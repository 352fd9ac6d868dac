//! An API-server outage under load deletes nothing and fails nothing: a
//! control plane of this test's own, three agents (two daily replicas and a
//! spare node with room for either), the operator (restarted when it exits,
//! as its Deployment would) and the gateway, all on loopback, with 4 s
//! node Leases and a 24 s leader Lease (renewed every 8 s, given up after
//! 16 s without renewal). Clients stream answers through the
//! gateway while the kube-apiserver is stopped (SIGSTOP) and continued,
//! for 7 s (the operator stays leader: it must not judge the agents' Leases
//! expired, since they could not renew through the outage either) and then
//! for 60 s (the operator steps down and is restarted).
//!
//! Every answer ends whole; the deployment's Shards afterwards are the ones
//! from before (same names and uids: none deleted, none on the spare, no
//! duplicate); every node is Ready again and no Shard is left `Unknown`.
//! Prints a `REPORT` line with the counts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use e2e::{BIN, WAIT, create_model};
use kube::{Api, ResourceExt};
use shardplane_crds::*;
use shardplane_operator::conditions::is_true;
use shardplane_testkit::{
    ChildGuard, OwnControlPlane, eventually, free_address, spawn_component_as, unique_name,
};

#[allow(dead_code)] // the network-namespace cluster is not used here
mod e2e;

/// A short outage (longer than the agents' Leases, shorter than the
/// leader's renew deadline: the operator stays leader throughout), then a
/// long one (the leader steps down, and is restarted).
const OUTAGES: [Duration; 2] = [Duration::from_secs(7), Duration::from_secs(60)];
const CLIENTS: usize = 2;

/// One streamed chat through the gateway: Ok when it ends whole.
async fn stream(http: &reqwest::Client, gateway: &str, model: &str) -> Result<(), String> {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Count from one to twenty."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": true,
    });
    let r = e2e::chat_request(http, gateway, &body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .map_err(|e| format!("no answer: {e:?}"))?;
    if r.status() != 200 {
        let status = r.status();
        return Err(format!("{status}: {}", r.text().await.unwrap_or_default()));
    }
    e2e::read_chat_stream(r).await.map(|_| ())
}

/// The operator, restarted whenever it exits (a leader that cannot renew
/// steps down by exiting), until dropped; counts its starts.
struct Supervised {
    stop: Arc<AtomicBool>,
    starts: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Supervised {
    fn operator(kubeconfig: &std::path::Path, leader_namespace: &str) -> Supervised {
        let (stop, starts) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let (kubeconfig, ns) = (kubeconfig.to_path_buf(), leader_namespace.to_string());
        let thread = {
            let (stop, starts) = (stop.clone(), starts.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let admin = free_address().to_string();
                    let mut child: ChildGuard = spawn_component_as(
                        BIN,
                        &[
                            "operator",
                            "--admin-address",
                            &admin,
                            "--leader-namespace",
                            &ns,
                            // Longer than the agents' Leases: the short
                            // outage passes without a step-down.
                            "--leader-lease-seconds",
                            "24",
                            "--node-lease-seconds",
                            "4",
                            "--read-model-paths",
                        ],
                        &kubeconfig,
                    );
                    starts.fetch_add(1, Ordering::Relaxed);
                    while !stop.load(Ordering::Relaxed) && matches!(child.0.try_wait(), Ok(None)) {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    // Dropping the guard stops a running one.
                    drop(child);
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        };
        Supervised {
            stop,
            starts,
            thread: Some(thread),
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The kube-apiserver continued however the test ends.
struct Continue(u32);

impl Drop for Continue {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// `name`, uid and node of each of the deployment's Shards, sorted.
async fn shards(api: &Api<Shard>) -> Vec<(String, String, String)> {
    let mut v: Vec<(String, String, String)> = api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|s| (s.name_any(), s.uid().unwrap_or_default(), s.spec.node))
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_outage_under_load_deletes_nothing_and_fails_nothing() {
    shardplane_testkit::install_quickstart_model();
    let cp = OwnControlPlane::start_with_crds();
    let kubeconfig = cp.kubeconfig().to_path_buf();
    let client = cp.client().await.unwrap();
    let ns = cp.namespace(&client, "outage").await.unwrap();
    let tag = unique_name("out");
    let pool = format!("{tag}-pool");
    let dir = tempfile::tempdir().unwrap();

    // Three agents in one pool: two replicas and a spare with room for either.
    let nodes: Vec<String> = (0..3).map(|i| format!("{tag}-n{i}")).collect();
    let _agents: Vec<ChildGuard> = nodes
        .iter()
        .map(|node| {
            let (admin, cache) = (free_address().to_string(), dir.path().join(node));
            let label = format!("pool={pool}");
            spawn_component_as(
                BIN,
                &[
                    "agent",
                    "--node-name",
                    node,
                    "--label",
                    &label,
                    "--admin-address",
                    &admin,
                    "--lease-seconds",
                    "4",
                    "--memory-reserve",
                    "512Mi",
                    "--cache-dir",
                    cache.to_str().unwrap(),
                ],
                &kubeconfig,
            )
        })
        .collect();
    let operator = Supervised::operator(&kubeconfig, &ns);
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "test: sk-test\n").unwrap();
    let (gateway, gateway_admin) = (free_address().to_string(), free_address().to_string());
    let _gateway = spawn_component_as(
        BIN,
        &[
            "gateway",
            "--listen",
            &gateway,
            "--admin-address",
            &gateway_admin,
            "--api-keys-file",
            keys.to_str().unwrap(),
        ],
        &kubeconfig,
    );

    let served = format!("{tag}-m");
    create_model(&client, &ns, &served).await;
    let strategy = format!("{tag}-whole");
    let deployments = e2e::create_daily(&client, &ns, &pool, &strategy, 2).await;
    eventually("two replicas are Ready", WAIT, || async {
        let st = deployments.get("chat").await.ok()?.status?;
        (st.ready_replicas == 2 && is_true(&st.conditions, CONDITION_READY)).then_some(())
    })
    .await;
    let http = shardplane_models::http_client().unwrap();
    eventually("it answers", WAIT, || async {
        stream(&http, &gateway, &served).await.ok()
    })
    .await;
    let shard_api: Api<Shard> = Api::namespaced(client.clone(), &ns);
    let before = shards(&shard_api).await;
    assert_eq!(before.len(), 2, "{before:?}");

    // Clients stream answers, one after another each, throughout.
    let running = Arc::new(AtomicBool::new(true));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (http, gateway, served, running) = (
                http.clone(),
                gateway.clone(),
                served.clone(),
                running.clone(),
            );
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                while running.load(Ordering::Relaxed) {
                    outcomes.push(stream(&http, &gateway, &served).await);
                }
                outcomes
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(5)).await;

    let pid = cp.api_server_pid();
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert_eq!(
        comm.trim(),
        "kube-apiserver",
        "process {pid} is the API server"
    );
    let mut starts_after = Vec::new();
    for outage in OUTAGES {
        let resume = Continue(pid);
        assert!(
            std::process::Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .status()
                .unwrap()
                .success()
        );
        tokio::time::sleep(outage).await;
        drop(resume);
        // The agents renew, the operator (restarted after a long outage)
        // leads again and looks.
        tokio::time::sleep(Duration::from_secs(30)).await;
        starts_after.push(operator.starts.load(Ordering::Relaxed));
    }
    running.store(false, Ordering::Relaxed);
    let mut outcomes = Vec::new();
    for c in clients {
        outcomes.extend(c.await.unwrap());
    }
    let failed: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    let after = shards(&shard_api).await;
    let statuses: Vec<String> = shard_api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|s| {
            format!(
                "{} {:?}",
                s.name_any(),
                s.status.as_ref().and_then(|st| st.phase)
            )
        })
        .collect();
    let node_api: Api<InferenceNode> = Api::all(client.clone());
    let mut ready_nodes = 0;
    for n in &nodes {
        let node = node_api.get(n).await.unwrap();
        let conds = node.status.map(|s| s.conditions).unwrap_or_default();
        ready_nodes += usize::from(is_true(&conds, CONDITION_READY));
    }
    println!(
        "REPORT API server stopped for {:?} under {CLIENTS} streaming clients: {} of {} answers failed; Shards before {before:?}, after {after:?} ({statuses:?}); {ready_nodes} of 3 nodes Ready; the operator had started {starts_after:?} times after each",
        OUTAGES,
        failed.len(),
        outcomes.len(),
    );
    assert_eq!(
        starts_after[0], 1,
        "the operator led through the short outage (else it tests nothing)"
    );
    assert!(failed.is_empty(), "answers failed: {failed:?}");
    assert!(outcomes.len() >= 10, "too few answers: {}", outcomes.len());
    assert_eq!(after, before, "no Shard deleted, moved or added");
    assert_eq!(ready_nodes, 3, "every node is Ready again");
    assert!(
        statuses.iter().all(|s| s.ends_with("Some(Ready)")),
        "no Shard left Unknown: {statuses:?}"
    );
    drop(operator);
}
