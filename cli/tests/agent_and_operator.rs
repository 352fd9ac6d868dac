//! The agent and the operator as real processes on a real API server: an
//! agent registers with this machine's memory and renews its Lease, runs the
//! Shards bound to it (and fails broken ones without falling over), stops
//! renewing when killed, drains when asked; with the operator, deployments
//! become Ready on real agents.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use shardplane_crds::*;
use shardplane_testkit::{
    ChildGuard as Process, agent_calls, control_plane, fixtures, free_address, unique_name,
};

const WAIT: Duration = Duration::from_secs(90);

/// `shardplane status` for namespace `ns`, as a person runs it: its output.
fn status(ns: &str, output: &str) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(["status", "-n", ns, "-o", output, "--kubeconfig"])
        .arg(control_plane().kubeconfig())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shardplane status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn shardplane(args: &[&str]) -> Process {
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), args)
}

/// The download cache of the agent of `node` (under the tests' scratch directory).
fn cache_dir(node: &str) -> std::path::PathBuf {
    shardplane_testkit::agent_cache(env!("CARGO_TARGET_TMPDIR"), node)
}

/// Starts an agent for `node`; returns it and its admin address.
fn agent(node: &str, labels: &[&str]) -> (Process, String) {
    let admin = free_address().to_string();
    let cache = cache_dir(node);
    let mut args = vec![
        "agent",
        "--node-name",
        node,
        "--admin-address",
        &admin,
        "--lease-seconds",
        "3",
        "--memory-reserve",
        "1Gi",
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    for l in labels {
        args.extend(["--label", l]);
    }
    (shardplane(&args), admin)
}

async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    shardplane_testkit::eventually(what, WAIT, check).await
}

async fn renew_time(client: &Client, node: &str) -> Option<String> {
    let lease = Api::<Lease>::namespaced(client.clone(), NODE_LEASE_NAMESPACE)
        .get_opt(node)
        .await
        .ok()??;
    Some(format!("{:?}", lease.spec?.renew_time?))
}

fn mem_total() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = info
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    kib * 1024
}

fn model_source(path: &std::path::Path, sha256: Option<&str>) -> ModelSource {
    ModelSource::Path(PathSource {
        path: path.display().to_string(),
        sha256: sha256.map(str::to_string),
    })
}

/// A stage with sliding-window layers, whole model or a pipeline's, counts
/// a long sequence as less than its length in the KV budget its status
/// reports (those layers hold only a sequence's last rows), so more
/// sequences fit.
async fn sliding_layers_count_less(shards: &Api<Shard>, node: &str) {
    let dir = tempfile::tempdir().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/reference/tiny_model.py");
    shardplane_testkit::run_reference(&script, &[dir.path().as_os_str(), "gemma3_text".as_ref()]);
    let gguf = dir.path().join("model.gguf");
    // The tiny Gemma 3 has 7 layers, every sixth global: 6 slide with a
    // window of 4 and hold at most 1092 rows of a sequence (4 + 64 kept,
    // 256 not yet let go, 256 of rounding, a 512-token prompt step). At
    // 2048 tokens a sequence costs ⌈(2048 + 6 × 1092) / 7⌉ = 1229 on the
    // whole model, and ⌈(2048 + 3 × 1092) / 4⌉ = 1331 on a stage of layers
    // 3-6 (one global).
    for (deployment, stage, layers, budget) in [
        ("gemma", 0, LayerRange { start: 0, end: 7 }, 2 * 1229),
        ("gemmatail", 1, LayerRange { start: 3, end: 7 }, 2 * 1331),
    ] {
        let mut shard = fixtures::shard(deployment, node, stage, stage + 1, layers);
        shard.spec.model = "tiny-gemma3".into();
        shard.spec.source = model_source(&gguf, None);
        shard.spec.total_layers = 7;
        shard.spec.kv_cache = KvCacheBudget {
            context_length: 2048,
            concurrent_sequences: 2,
        };
        let name = shard.name_any();
        shards.create(&PostParams::default(), &shard).await.unwrap();
        let status = eventually("the Gemma 3 shard is Ready", || async {
            let st = shards.get(&name).await.ok()?.status?;
            (st.phase == Some(ShardPhase::Ready)).then_some(st)
        })
        .await;
        assert_eq!(status.kv_budget_tokens, Some(budget), "{name}: {status:?}");
        shards
            .delete(&name, &DeleteParams::default())
            .await
            .unwrap();
    }
}

/// A change to a path Model's spec lets go of its report, metadata and all:
/// a node holding the file reports for the new spec, once (it is not let go
/// of again and again), and a path no node holds stays unresolved rather than
/// resolved from the old file.
async fn a_path_models_spec_change_lets_go_of_the_old_report(client: &Client, ns: &str) {
    use kube::api::{Patch, PatchParams};
    let models = Api::<Model>::namespaced(client.clone(), ns);
    let mut probe = fixtures::model("probe");
    probe.spec.source = model_source(&shardplane_testkit::test_model(), None);
    models.create(&PostParams::default(), &probe).await.unwrap();
    // The Resolved condition's status and reason once the operator has seen
    // `generation`, with the status.
    let resolved = |generation: i64| {
        let models = models.clone();
        async move {
            let m = models.get("probe").await.ok()?;
            let status = m.status.clone()?;
            let c = status.conditions.iter().find(|c| {
                c.type_ == CONDITION_RESOLVED && c.observed_generation == Some(generation)
            })?;
            (status.observed_generation == Some(generation))
                .then(|| (c.status.clone(), c.reason.clone(), m))
        }
    };
    eventually("an agent reports the probe Model", || async {
        resolved(1).await.filter(|(s, _, _)| s == "True")
    })
    .await;
    let edit = |spec: serde_json::Value| {
        let models = models.clone();
        async move {
            models
                .patch(
                    "probe",
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({ "spec": spec })),
                )
                .await
                .unwrap()
        }
    };
    edit(serde_json::json!({ "maxContextLength": 256 })).await;
    let (_, reason, m) = eventually("the probe is reported again for its new spec", || async {
        resolved(2).await.filter(|(s, _, m)| {
            s == "True" && m.status.as_ref().is_some_and(|s| s.reported_by.is_some())
        })
    })
    .await;
    assert_eq!(reason, "ReportedByAgent");
    // Settled: the report is not let go of and made again without end.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let later = models.get("probe").await.unwrap();
    assert_eq!(
        later.resource_version(),
        m.resource_version(),
        "the probe's status kept changing: {:?}",
        later.status
    );
    // A path no node holds: not resolved from the old file's metadata.
    edit(serde_json::json!({ "source": { "path": { "path": "/nonexistent/probe.gguf" } } })).await;
    let (_, reason, m) = eventually("the probe waits for an agent at its new path", || async {
        resolved(3).await.filter(|(s, _, _)| s == "False")
    })
    .await;
    assert_eq!(reason, "WaitingForAgent");
    let status = m.status.unwrap();
    assert_eq!((status.layers, status.reported_by), (None, None));
    models
        .delete("probe", &DeleteParams::default())
        .await
        .unwrap();
}

const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_registers_runs_shards_survives_bad_weights_and_stops_renewing_when_killed() {
    let client = control_plane().client().await.unwrap();
    let node = unique_name("agent");
    let (agent, admin) = agent(&node, &["role=test"]);
    let nodes: Api<InferenceNode> = Api::all(client.clone());

    // Registered with this machine's real memory, and the label it was given.
    let n = eventually("the node registers", || async {
        nodes
            .get_opt(&node)
            .await
            .ok()?
            .filter(|n| n.status.is_some())
    })
    .await;
    let status = n.status.clone().unwrap();
    let memory = status.memory.unwrap();
    assert_eq!(quantity::parse_bytes(&memory.total).unwrap(), mem_total());
    assert_eq!(
        quantity::parse_bytes(&memory.allocatable).unwrap(),
        mem_total() - (1 << 30)
    );
    assert_eq!(n.labels().get("role").map(String::as_str), Some("test"));
    // Candle first (the default), then what else the binary has built in.
    let built_in = if cfg!(feature = "mlx") {
        vec![Engine::Candle, Engine::Mlx]
    } else {
        vec![Engine::Candle]
    };
    assert_eq!(status.engines, built_in);
    // The prompt step its stages take (the default): what a pipeline's head
    // and placement count its sliding layers with.
    assert_eq!(status.prompt_step_tokens, Some(512));
    assert!(
        status
            .addresses
            .iter()
            .any(|a| a.kind == LinkKind::Loopback)
    );
    assert!(!status.draining);

    // The Lease is renewed.
    let first = eventually("a Lease", || renew_time(&client, &node)).await;
    eventually("the Lease is renewed", || async {
        (renew_time(&client, &node).await? != first).then_some(())
    })
    .await;

    // A Shard made by hand (no operator) goes Ready; deleting it unloads it.
    let ns = control_plane().namespace(&client, "agent").await.unwrap();
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    let model = shardplane_testkit::test_model();
    let mut shard = fixtures::shard("hand", &node, 0, 1, LayerRange { start: 0, end: 30 });
    shard.spec.source = model_source(&model, Some(MODEL_SHA256));
    shards.create(&PostParams::default(), &shard).await.unwrap();
    let ready = eventually("the shard is Ready", || async {
        let s = shards.get("hand-0-0").await.ok()?;
        (s.status.as_ref()?.phase == Some(ShardPhase::Ready)).then_some(s)
    })
    .await;
    let st = ready.status.unwrap();
    assert!(st.memory_bytes.unwrap() > 50_000_000, "{st:?}");
    // The machine has room for the whole KV cache the Shard asks for.
    let kv = shard.spec.kv_cache;
    assert_eq!(
        st.kv_budget_tokens,
        Some(u64::from(kv.context_length) * u64::from(kv.concurrent_sequences)),
        "{st:?}"
    );
    assert_eq!(st.engine, Some(Engine::Candle));
    assert!(
        shardplane_testkit::metrics::scrape(&admin)
            .await
            .contains("shardplane_agent_shards{phase=\"Ready\"} 1")
    );
    shards
        .delete("hand-0-0", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the shard is unloaded", || async {
        let m = shardplane_testkit::metrics::scrape(&admin).await;
        (m.contains("shardplane_agent_shards{phase=\"Ready\"} 0")
            && m.contains("shardplane_agent_weight_bytes 0"))
        .then_some(())
    })
    .await;

    sliding_layers_count_less(&shards, &node).await;

    // A url source is downloaded into the cache, resuming an interrupted
    // download, verified, and listed in the node's status.
    let (base, ranges) = shardplane_testkit::serve_test_model().await;
    let url = format!("{base}/m.gguf");
    let key = format!("url:{url}");
    let bytes = std::fs::read(&model).unwrap();
    let cache =
        shardplane_agent::cache::Cache::new(cache_dir(&node), reqwest::Client::new()).unwrap();
    let partial = cache.file_for(&key).with_extension("gguf.partial");
    std::fs::write(&partial, &bytes[..bytes.len() / 3]).unwrap();
    let mut remote = fixtures::shard("remote", &node, 0, 1, LayerRange { start: 0, end: 30 });
    remote.spec.source = ModelSource::Url(UrlSource {
        url: url.clone(),
        sha256: Some(MODEL_SHA256.into()),
    });
    shards
        .create(&PostParams::default(), &remote)
        .await
        .unwrap();
    eventually("the downloaded shard is Ready", || async {
        let s = shards.get("remote-0-0").await.ok()?;
        (s.status.as_ref()?.phase == Some(ShardPhase::Ready)).then_some(())
    })
    .await;
    assert_eq!(
        *ranges.lock().unwrap(),
        vec![format!("bytes={}-", bytes.len() / 3)],
        "the download resumed"
    );
    assert_eq!(std::fs::read(cache.file_for(&key)).unwrap(), bytes);
    let listed = eventually("the node lists the cached model", || async {
        let st = nodes.get(&node).await.ok()?.status?;
        st.cached_models.into_iter().find(|c| c.key == key)
    })
    .await;
    assert_eq!(
        (listed.bytes, listed.sha256.as_deref()),
        (bytes.len() as u64, Some(MODEL_SHA256))
    );
    // A checksum that does not match fails the Shard and discards the file.
    let mut bad = fixtures::shard("badsum", &node, 0, 1, LayerRange { start: 0, end: 30 });
    let other = format!("{base}/m.gguf?copy");
    bad.spec.source = ModelSource::Url(UrlSource {
        url: other.clone(),
        sha256: Some("1".repeat(64)),
    });
    shards.create(&PostParams::default(), &bad).await.unwrap();
    let failed = eventually("badsum fails", || async {
        let s = shards.get("badsum-0-0").await.ok()?;
        (s.status.as_ref()?.phase == Some(ShardPhase::Failed)).then_some(s)
    })
    .await;
    assert_eq!(
        failed.status.as_ref().unwrap().reason.as_deref(),
        Some("ChecksumMismatch")
    );
    assert!(
        !cache.file_for(&format!("url:{other}")).exists(),
        "a mismatching download is discarded"
    );
    let st = failed.status.as_ref().unwrap();
    assert!(st.next_retry_time.is_some(), "a fresh fetch is due: {st:?}");
    // The fresh fetch mismatches too: Failed for good, not hot-looped.
    let st = eventually("badsum fails again, for good", || async {
        let st = shards.get("badsum-0-0").await.ok()?.status?;
        (st.phase == Some(ShardPhase::Failed) && st.restarts == Some(1)).then_some(st)
    })
    .await;
    assert_eq!(st.next_retry_time, None, "{st:?}");
    assert!(
        st.last_failure
            .as_deref()
            .is_some_and(|f| f.starts_with("ChecksumMismatch: ")),
        "{st:?}"
    );

    // A source that served a damaged file once heals on the retry.
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flaky = {
        let (served, bytes) = (served.clone(), bytes.clone());
        axum::Router::new().route(
            "/flaky.gguf",
            axum::routing::get(move || {
                let (served, mut bytes) = (served.clone(), bytes.clone());
                async move {
                    if served.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                        bytes[1000] ^= 0xff;
                    }
                    bytes
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let flaky_url = format!("http://{}/flaky.gguf", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, flaky).await.unwrap() });
    let mut healing = fixtures::shard("healing", &node, 0, 1, LayerRange { start: 0, end: 30 });
    healing.spec.source = ModelSource::Url(UrlSource {
        url: flaky_url,
        sha256: Some(MODEL_SHA256.into()),
    });
    shards
        .create(&PostParams::default(), &healing)
        .await
        .unwrap();
    let st = eventually("the damaged download's Shard heals", || async {
        let st = shards.get("healing-0-0").await.ok()?.status?;
        (st.phase == Some(ShardPhase::Ready)).then_some(st)
    })
    .await;
    assert_eq!(st.restarts, Some(1), "{st:?}");
    assert!(
        st.last_failure
            .as_deref()
            .is_some_and(|f| f.starts_with("ChecksumMismatch: ")),
        "{st:?}"
    );
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 2);
    shards
        .delete("healing-0-0", &DeleteParams::default())
        .await
        .unwrap();
    std::fs::remove_dir_all(cache_dir(&node)).unwrap();

    // Broken weights fail their Shard with a reason; the agent keeps running.
    let dir = tempfile::tempdir().unwrap();
    let truncated = dir.path().join("truncated.gguf");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    for (name, source, reason) in [
        ("cut", model_source(&truncated, None), "CorruptWeights"),
        (
            "sum",
            model_source(&model, Some(&"0".repeat(64))),
            "ChecksumMismatch",
        ),
        (
            "gone",
            model_source(&dir.path().join("absent.gguf"), None),
            "WeightsNotFound",
        ),
    ] {
        let mut s = fixtures::shard(name, &node, 0, 1, LayerRange { start: 0, end: 30 });
        s.spec.source = source;
        shards.create(&PostParams::default(), &s).await.unwrap();
        let failed = eventually(&format!("{name} fails"), || async {
            let s = shards.get(&format!("{name}-0-0")).await.ok()?;
            (s.status.as_ref()?.phase == Some(ShardPhase::Failed)).then_some(s)
        })
        .await;
        let st = failed.status.unwrap();
        assert_eq!(st.reason.as_deref(), Some(reason), "{st:?}");
        assert!(!st.message.unwrap_or_default().is_empty());
    }
    let before = renew_time(&client, &node).await.unwrap();
    eventually("the agent still renews its Lease", || async {
        (renew_time(&client, &node).await? != before).then_some(())
    })
    .await;

    // Killed with SIGKILL: the Lease is no longer renewed.
    agent.signal("-KILL");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let last = renew_time(&client, &node).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        renew_time(&client, &node).await.unwrap(),
        last,
        "a killed agent renewed its Lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_drains_and_gives_up_its_lease() {
    let client = control_plane().client().await.unwrap();
    let node = unique_name("drain");
    let (agent, _) = agent(&node, &[]);
    eventually("a Lease", || renew_time(&client, &node)).await;
    agent.signal("-TERM");
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    eventually("draining and no Lease", || async {
        let draining = nodes.get(&node).await.ok()?.status?.draining;
        (draining && renew_time(&client, &node).await.is_none()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_operator_deployments_become_ready_on_real_agents() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client, "e2e").await.unwrap();
    let tag = unique_name("e2e");
    let _operator = shardplane(&[
        "operator",
        "--admin-address",
        &free_address().to_string(),
        "--leader-namespace",
        &format!("leader-{tag}"),
        "--node-lease-seconds",
        "3",
    ]);
    let label = format!("e2e={tag}");
    let agents: Vec<(Process, String)> = (0..4)
        .map(|i| agent(&format!("{tag}-n{i}"), &[&label]))
        .collect();

    let inodes: Api<InferenceNode> = Api::all(client.clone());
    eventually("the four agents are Ready", || async {
        let nodes = inodes
            .list(&ListParams::default().labels(&label))
            .await
            .ok()?
            .items;
        let ready = nodes
            .iter()
            .filter(|n| {
                n.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == CONDITION_READY && c.status == "True")
                })
            })
            .count();
        (ready == 4).then_some(())
    })
    .await;
    let mut model = fixtures::model("smollm2");
    model.spec.source = model_source(&shardplane_testkit::test_model(), Some(MODEL_SHA256));
    Api::<Model>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &model)
        .await
        .unwrap();
    let pool =
        fixtures::node_pool_selecting(&format!("pool-{tag}"), Tier::Reasoning, ("e2e", &tag));
    let mut strategy = fixtures::strategy(&format!("pipe-{tag}"), Parallelism::Pipeline);
    strategy.spec.placement = PlacementPolicy::EvenLayers;
    strategy.spec.min_nodes = Some(2);
    strategy.spec.max_nodes = Some(3);
    strategy.spec.kv_cache = KvCacheBudget {
        context_length: 512,
        concurrent_sequences: 2,
    };
    let deployments = fixtures::deploy(&client, &ns, "reason", "smollm2", &pool, &strategy).await;

    let ready = |d: &ModelDeployment| {
        d.status.as_ref().is_some_and(|s| {
            s.ready_replicas == 1 && s.instances.first().is_some_and(|i| i.stages.len() == 3)
        })
    };
    let d = eventually("the 3-stage deployment is Ready on the agents", || async {
        deployments.get("reason").await.ok().filter(|d| ready(d))
    })
    .await;
    // The operator cannot see the nodes' files (no --read-model-paths): an agent reported the model.
    let model = Api::<Model>::namespaced(client.clone(), &ns)
        .get("smollm2")
        .await
        .unwrap();
    let reported = model.status.unwrap();
    let resolved = reported
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_RESOLVED)
        .unwrap();
    assert_eq!(
        (resolved.status.as_str(), resolved.reason.as_str()),
        ("True", "ReportedByAgent")
    );
    // An agent (this test's or another's watching the same file), which
    // names itself: only it may report again.
    assert!(reported.reported_by.is_some_and(|r| !r.is_empty()));
    a_path_models_spec_change_lets_go_of_the_old_report(&client, &ns).await;
    let stages = &d.status.unwrap().instances[0].stages;
    let nodes: std::collections::BTreeSet<&str> = stages.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(nodes.len(), 3, "three stages on three agents");

    // `shardplane status` shows every node, the deployment and its stages.
    let seen: serde_json::Value = serde_json::from_str(&status(&ns, "json")).unwrap();
    let ours: Vec<&serde_json::Value> = seen["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["name"].as_str().unwrap().starts_with(&tag))
        .collect();
    assert_eq!(ours.len(), 4, "{seen:#}");
    assert!(ours.iter().all(|n| n["ready"] == "Ready"), "{seen:#}");
    let shown = &seen["deployments"][0];
    assert_eq!(
        (&shown["name"], &shown["readyReplicas"]),
        (&"reason".into(), &1.into())
    );
    let shown_stages: Vec<(&str, &str)> = shown["instances"][0]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["node"].as_str().unwrap(), s["phase"].as_str().unwrap()))
        .collect();
    let expected: Vec<(&str, &str)> = stages.iter().map(|s| (s.node.as_str(), "Ready")).collect();
    assert_eq!(shown_stages, expected);
    let text = status(&ns, "text");
    for n in &nodes {
        assert!(text.contains(n), "{n} not in\n{text}");
    }
    assert!(
        text.contains(&format!("{ns}/reason  model smollm2  1/1 ready")),
        "{text}"
    );

    // Kill the agent of the middle stage: only that stage moves, to the spare
    // agent, and the instance is Ready again without anyone acting.
    let victim = stages[1].node.clone();
    let index = (0..4).find(|i| format!("{tag}-n{i}") == victim).unwrap();
    agents[index].0.signal("-KILL");
    let killed_at = std::time::Instant::now();
    let d = eventually("Ready again without the killed agent", || async {
        let d = deployments.get("reason").await.ok()?;
        let st = d.status.as_ref()?;
        (st.ready_replicas == 1 && st.instances[0].stages.iter().all(|s| s.node != victim))
            .then_some(d)
    })
    .await;
    eprintln!(
        "node loss to Ready again: {:.1} s (Lease of 3 s)",
        killed_at.elapsed().as_secs_f64()
    );
    // ... and `status` sees the killed node go NotReady.
    eventually("status shows the killed node NotReady", || async {
        let seen: serde_json::Value = serde_json::from_str(&status(&ns, "json")).ok()?;
        seen["nodes"]
            .as_array()?
            .iter()
            .any(|n| {
                n["name"] == victim.as_str()
                    && n["ready"]
                        .as_str()
                        .is_some_and(|r| r.starts_with("NotReady"))
            })
            .then_some(())
    })
    .await;
    let healed = d.status.unwrap().instances[0].stages.clone();
    assert_eq!(healed.len(), 3);
    assert_eq!(
        (&healed[0].node, &healed[2].node),
        (&stages[0].node, &stages[2].node),
        "the other stages stay"
    );
    // Their Shards kept their names (same node, same layers) and changed in
    // place to name the new middle stage: the healed pipeline answers, and
    // each says it has seen its new spec.
    assert_eq!(
        (&healed[0].shard, &healed[2].shard),
        (&stages[0].shard, &stages[2].shard)
    );
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    let head = shards.get(&healed[0].shard).await.unwrap();
    let endpoint = head.status.and_then(|s| s.endpoint).unwrap();
    eventually("the healed pipeline answers", || async {
        let prompt = "The capital of France is";
        match agent_calls::generate_text(&endpoint, &ns, &healed[0].shard, prompt, 4).await {
            Ok(text) if !text.is_empty() => Some(()),
            answer => {
                eprintln!("the healed pipeline does not answer yet: {answer:?}");
                None
            }
        }
    })
    .await;
    eventually("the kept stages report their new specs seen", || async {
        let mut current = true;
        for stage in [&healed[0], &healed[2]] {
            let s = shards.get(&stage.shard).await.ok()?;
            let seen = s.status.as_ref().and_then(|st| st.observed_generation);
            current &= seen.is_some() && seen == s.metadata.generation;
        }
        current.then_some(())
    })
    .await;

    // Cordon a node in use: its stage leaves it; two nodes are left, so two stages.
    let cordoned = healed[0].node.clone();
    let nodes_api: Api<InferenceNode> = Api::all(client.clone());
    nodes_api
        .patch(
            &cordoned,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    eventually("Ready off the cordoned node", || async {
        let d = deployments.get("reason").await.ok()?;
        let st = d.status.as_ref()?;
        (st.ready_replicas == 1 && st.instances[0].stages.iter().all(|s| s.node != cordoned))
            .then_some(())
    })
    .await;

    // Scale to two instances: both become Ready on the agents.
    deployments
        .patch(
            "reason",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": 2}})),
        )
        .await
        .unwrap();
    eventually("two instances Ready", || async {
        let d = deployments.get("reason").await.ok()?;
        (d.status.as_ref()?.ready_replicas == 2).then_some(())
    })
    .await;

    // Deleting the deployment removes every Shard.
    deployments
        .delete("reason", &DeleteParams::default())
        .await
        .unwrap();
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    eventually("no shards left", || async {
        shards
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    drop(agents);
}
