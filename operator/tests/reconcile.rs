//! The operator on a real kube-apiserver. Nodes are registered here the way
//! agents register them (InferenceNode status and a renewed Lease), and Shard
//! phases are reported the way agents report them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use shardplane_crds::*;
use shardplane_operator::{OperatorConfig, leader::Election};
use shardplane_testkit::as_agent::{register_node, renew_lease};
use shardplane_testkit::{control_plane, fixtures, unique_name};

const WAIT: Duration = Duration::from_secs(60);
const GATEWAY_URL: &str = "http://gateway.example:8080/v1";

/// Starts the operator in this process (once per test binary's runtime).
async fn start_operator(client: &Client) -> SocketAddr {
    // The operator's log, shown with a failing test's output.
    // RUST_LOG, when set, says what else to show.
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info,kube=warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    let admin = shardplane_testkit::free_address();
    let config = OperatorConfig {
        admin_address: admin,
        election: Election {
            namespace: unique_name("leader"),
            name: "shardplane-operator".into(),
            identity: unique_name("test-operator"),
            lease_duration: Duration::from_secs(6),
            renew_every: Duration::from_secs(2),
        },
        default_node_lease: Duration::from_secs(4),
        hugging_face_endpoint: shardplane_operator::HUGGING_FACE_HUB.into(),
        hugging_face_token: None,
        // No agents run in these tests: the operator reads the model itself.
        read_model_paths: true,
        gateway_url: Some(GATEWAY_URL.into()),
        view: None,
        webhook: None,
        signer: None,
    };
    let client = client.clone();
    tokio::spawn(async move {
        if let Err(e) = shardplane_operator::run(client, config).await {
            panic!("operator stopped: {e}");
        }
    });
    admin
}

async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    shardplane_testkit::eventually(what, WAIT, check).await
}

/// Reports every Shard of `deployment` Ready, as agents would.
async fn report_ready(client: &Client, ns: &str, deployment: &str) {
    let shards: Api<Shard> = Api::namespaced(client.clone(), ns);
    for s in shards
        .list(&ListParams::default().labels(&format!("{DEPLOYMENT_LABEL}={deployment}")))
        .await
        .unwrap()
        .items
    {
        // A lost node's agent reports nothing.
        if s.status.as_ref().and_then(|st| st.phase.as_ref()) == Some(&ShardPhase::Unknown) {
            continue;
        }
        let status = json!({"apiVersion": "shardplane.dev/v1alpha1", "kind": "Shard",
                            "status": {"phase": "Ready", "endpoint": "127.0.0.1:1"}});
        match shards
            .patch_status(
                &s.name_any(),
                &PatchParams::apply(AGENT_MANAGER).force(),
                &Patch::Apply(&status),
            )
            .await
        {
            // Retired since the list: an earlier report let the operator
            // delete it (a kept Shard goes once its replacement is Ready).
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => panic!("reporting {} Ready: {e}", s.name_any()),
        }
    }
}

fn condition<'a>(
    d: &'a ModelDeployment,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    d.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

async fn shards_of(client: &Client, ns: &str, deployment: &str) -> Vec<Shard> {
    let mut v = Api::<Shard>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{DEPLOYMENT_LABEL}={deployment}")))
        .await
        .unwrap()
        .items;
    v.sort_by_key(|s| (s.spec.instance, s.spec.stage));
    v
}

struct Setup {
    ns: String,
    daily_pool: String,
    reasoning_pool: String,
    whole: String,
    pipeline: String,
    nodes: Vec<String>,
}

/// A model (the real test GGUF), two pools, two strategies and `n` nodes in both pools.
/// The Model's chat template override, which the first stage gets.
const TEMPLATE: &str = "{% for m in messages %}{{ m.content }}\n{% endfor %}";

async fn setup(client: &Client, n: usize) -> Setup {
    let ns = control_plane().namespace(client, "op").await.unwrap();
    let tag = unique_name("t");
    let mut model = fixtures::model("smollm2");
    model.spec.source = ModelSource::Path(PathSource {
        path: shardplane_testkit::test_model().display().to_string(),
        sha256: None,
    });
    model.spec.chat_template = Some(TEMPLATE.into());
    Api::<Model>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &model)
        .await
        .unwrap();
    let pool_label = format!("pool-{tag}");
    let mut daily = fixtures::node_pool(&format!("daily-{tag}"), Tier::Daily);
    daily.spec.node_selector.match_labels =
        Some(BTreeMap::from([(pool_label.clone(), "daily".into())]));
    let mut reasoning = fixtures::node_pool(&format!("reasoning-{tag}"), Tier::Reasoning);
    reasoning.spec.node_selector.match_labels =
        Some(BTreeMap::from([(pool_label.clone(), "reasoning".into())]));
    for p in [&daily, &reasoning] {
        Api::<NodePool>::all(client.clone())
            .create(&PostParams::default(), p)
            .await
            .unwrap();
    }
    let mut whole = fixtures::strategy(&format!("whole-{tag}"), Parallelism::None);
    whole.spec.kv_cache = KvCacheBudget {
        context_length: 512,
        concurrent_sequences: 2,
    };
    let mut pipeline = fixtures::strategy(&format!("pipe-{tag}"), Parallelism::Pipeline);
    pipeline.spec.placement = PlacementPolicy::EvenLayers;
    pipeline.spec.min_nodes = Some(2);
    pipeline.spec.max_nodes = Some(3);
    pipeline.spec.kv_cache = KvCacheBudget {
        context_length: 512,
        concurrent_sequences: 2,
    };
    for s in [&whole, &pipeline] {
        Api::<ShardingStrategy>::all(client.clone())
            .create(&PostParams::default(), s)
            .await
            .unwrap();
    }
    let mut nodes = Vec::new();
    for i in 0..n {
        // The last node's name is longer than a label value may be.
        let name = match i + 1 == n {
            true => format!("{tag}-{}-n{i}", "long".repeat(16)),
            false => format!("{tag}-n{i}"),
        };
        let role = if i < 2 { "daily" } else { "reasoning" };
        register_node(client, &name, &[(&pool_label, role)], "1Gi").await;
        nodes.push(name);
    }
    Setup {
        ns,
        daily_pool: daily.name_any(),
        reasoning_pool: reasoning.name_any(),
        whole: whole.name_any(),
        pipeline: pipeline.name_any(),
        nodes,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_resolves_places_heals_scales_and_cleans_up() {
    let client = control_plane().client().await.unwrap();
    let admin = start_operator(&client).await;
    // Two daily nodes (n0, n1) and four reasoning nodes (n2..n5).
    let s = setup(&client, 6).await;
    let models: Api<Model> = Api::namespaced(client.clone(), &s.ns);
    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &s.ns);

    // The Model resolves from the real GGUF header.
    let status = eventually("the model resolves", || async {
        models
            .get("smollm2")
            .await
            .ok()?
            .status
            .filter(|st| st.layers.is_some())
    })
    .await;
    assert_eq!(status.architecture.as_deref(), Some("llama"));
    assert_eq!(
        (status.layers, status.hidden_size, status.kv_heads),
        (Some(30), Some(576), Some(3))
    );
    assert_eq!(status.layer_bytes.len(), 30);
    assert_eq!(status.kv_bytes_per_token, Some(2 * 3 * 64 * 4 * 30));
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == CONDITION_RESOLVED && c.status == "True")
    );

    // Pools see their members.
    let pools: Api<NodePool> = Api::all(client.clone());
    eventually("the reasoning pool sees its 4 ready nodes", || async {
        pools
            .get(&s.reasoning_pool)
            .await
            .ok()?
            .status
            .filter(|p| p.ready_nodes == 4)
            .map(|_| ())
    })
    .await;

    // A daily deployment of 2 replicas: distinct nodes, whole model each.
    let mut daily = fixtures::deployment("chat", "smollm2", &s.daily_pool, &s.whole);
    daily.spec.replicas = 2;
    deployments
        .create(&PostParams::default(), &daily)
        .await
        .unwrap();
    let chat = eventually("2 daily shards", || async {
        let v = shards_of(&client, &s.ns, "chat").await;
        (v.len() == 2).then_some(v)
    })
    .await;
    assert_ne!(chat[0].spec.node, chat[1].spec.node);
    assert!(
        chat.iter()
            .all(|sh| sh.spec.layers == LayerRange { start: 0, end: 30 }
                && s.nodes[..2].contains(&sh.spec.node))
    );

    // A 3-stage pipeline over the reasoning nodes, stages chained.
    let pipe = fixtures::deployment("reason", "smollm2", &s.reasoning_pool, &s.pipeline);
    deployments
        .create(&PostParams::default(), &pipe)
        .await
        .unwrap();
    let stages = eventually("3 pipeline shards", || async {
        let v = shards_of(&client, &s.ns, "reason").await;
        (v.len() == 3).then_some(v)
    })
    .await;
    let ranges: Vec<(u32, u32)> = stages
        .iter()
        .map(|x| (x.spec.layers.start, x.spec.layers.end))
        .collect();
    assert_eq!(ranges, vec![(0, 10), (10, 20), (20, 30)]);
    assert_eq!(
        stages[0].spec.next.as_deref(),
        Some(stages[1].name_any().as_str())
    );
    assert_eq!(
        stages[2].spec.previous.as_deref(),
        Some(stages[1].name_any().as_str())
    );
    // Only the first stage renders conversations.
    let templates: Vec<Option<&str>> = stages
        .iter()
        .map(|x| x.spec.chat_template.as_deref())
        .collect();
    assert_eq!(templates, [Some(TEMPLATE), None, None]);
    for sh in &stages {
        use shardplane_crds::validation::Validate;
        sh.validate().unwrap();
        assert_eq!(sh.labels()[NODE_LABEL], node_label_value(&sh.spec.node));
    }
    assert!(
        stages.iter().any(|sh| sh.spec.node.len() > 63),
        "a stage is on the node whose name is longer than a label value"
    );
    let d = eventually("Placed, not yet Ready", || async {
        let d = deployments.get("reason").await.ok()?;
        (condition(&d, CONDITION_PLACED)?.status == "True").then_some(d)
    })
    .await;
    assert_eq!(condition(&d, CONDITION_READY).unwrap().status, "False");

    // Agents report the shards Ready: the deployment becomes Ready.
    report_ready(&client, &s.ns, "reason").await;
    let d = eventually("Ready", || async {
        let d = deployments.get("reason").await.ok()?;
        (condition(&d, CONDITION_READY)?.status == "True").then_some(d)
    })
    .await;
    let st = d.status.unwrap();
    assert_eq!((st.replicas, st.ready_replicas), (1, 1));
    assert_eq!(st.instances[0].stages.len(), 3);
    let served = models.get("smollm2").await.unwrap();
    assert_eq!(
        st.endpoint,
        Some(DeploymentEndpoint {
            url: GATEWAY_URL.into(),
            model: served.served_name().into(),
        }),
        "clients are told where to ask"
    );

    // A node stops renewing its Lease: only its stage moves, to the spare
    // node. Its Shard is marked Unknown and kept until the new one is Ready.
    let lost = stages[1].spec.node.clone();
    renew_lease(&client, &lost, 1).await;
    let moving = eventually(
        "the lost stage is re-placed beside the kept one",
        || async {
            let v = shards_of(&client, &s.ns, "reason").await;
            let kept = v.iter().find(|x| x.spec.node == lost)?;
            let unknown = kept.status.as_ref()?.phase == Some(ShardPhase::Unknown);
            (v.len() == 4 && unknown).then_some(v)
        },
    )
    .await;
    let kept = moving.iter().find(|x| x.spec.node == lost).unwrap();
    assert_eq!(kept.name_any(), stages[1].name_any());
    assert_eq!(
        kept.status.as_ref().unwrap().reason.as_deref(),
        Some("NodeNotReady")
    );
    let replacement = moving
        .iter()
        .find(|x| x.spec.stage == 1 && x.spec.node != lost)
        .unwrap()
        .name_any();
    assert_eq!(
        moving[0].spec.next.as_deref(),
        Some(replacement.as_str()),
        "stage 0 sends to the replacement"
    );
    // The replacement reports Ready: the kept Shard goes.
    report_ready(&client, &s.ns, "reason").await;
    let healed = eventually(
        "the kept shard goes once its replacement is Ready",
        || async {
            let v = shards_of(&client, &s.ns, "reason").await;
            (v.len() == 3 && v.iter().all(|x| x.spec.node != lost)).then_some(v)
        },
    )
    .await;
    assert_eq!(healed[1].name_any(), replacement);
    assert_eq!(
        healed[0].name_any(),
        stages[0].name_any(),
        "stage 0 is untouched"
    );
    assert_eq!(
        healed[2].name_any(),
        stages[2].name_any(),
        "stage 2 is untouched"
    );
    assert_eq!(healed[1].spec.layers, stages[1].spec.layers);
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    let lost_node = nodes.get(&lost).await.unwrap();
    let ready = lost_node
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == CONDITION_READY)
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "LeaseExpired")
    );

    // Cordoning a node moves the daily replica off it.
    let cordoned = chat[0].spec.node.clone();
    // Only two daily nodes exist: add a third so the replica has somewhere to go.
    let pool_label = pools
        .get(&s.daily_pool)
        .await
        .unwrap()
        .spec
        .node_selector
        .match_labels
        .unwrap();
    let (k, v) = pool_label.into_iter().next().unwrap();
    let spare = format!("{}-spare", s.nodes[0]);
    register_node(&client, &spare, &[(&k, &v)], "1Gi").await;
    nodes
        .patch(
            &cordoned,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": true}})),
        )
        .await
        .unwrap();
    eventually("the cordoned node is emptied", || async {
        let v = shards_of(&client, &s.ns, "chat").await;
        (v.len() == 2 && v.iter().all(|x| x.spec.node != cordoned)).then_some(())
    })
    .await;

    // A replica that keeps failing on its node (its agent's retries say so)
    // moves to a node that can take it, and the deployment says why.
    nodes
        .patch(
            &cordoned,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": false}})),
        )
        .await
        .unwrap();
    let failing = shards_of(&client, &s.ns, "chat").await.remove(0);
    let failing_node = failing.spec.node.clone();
    let failed = json!({"apiVersion": "shardplane.dev/v1alpha1", "kind": "Shard",
                        "status": {"phase": "Failed", "restarts": 3,
                                   "message": "load: out of memory",
                                   "lastFailure": "load: out of memory"}});
    Api::<Shard>::namespaced(client.clone(), &s.ns)
        .patch_status(
            &failing.name_any(),
            &PatchParams::apply(AGENT_MANAGER).force(),
            &Patch::Apply(&failed),
        )
        .await
        .unwrap();
    eventually("the failing replica moves", || async {
        let v = shards_of(&client, &s.ns, "chat").await;
        (v.len() == 2 && v.iter().all(|x| x.spec.node != failing_node)).then_some(())
    })
    .await;
    // A Warning event says why (the Progressing condition says it too, in
    // the reconcile that moves it; a later one that reads a stale copy of
    // the deployment may already say ShardsStarting).
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &s.ns);
    let wanted = format!("failed 3 times on {failing_node}: load: out of memory");
    eventually(
        "a StageMoved event names the node and the failure",
        || async {
            let list = events.list(&ListParams::default()).await.ok()?;
            list.items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some("StageMoved")
                        && e.note.as_deref().is_some_and(|n| n.contains(&wanted))
                })
                .map(|_| ())
        },
    )
    .await;

    // Scaling to 1 removes an instance; scaling up again cannot exceed the nodes.
    deployments
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .unwrap();
    eventually("one daily shard left", || async {
        (shards_of(&client, &s.ns, "chat").await.len() == 1).then_some(())
    })
    .await;

    // Deleting a deployment removes its shards (finalizer; no garbage collector here).
    deployments
        .delete("reason", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the pipeline's shards and the deployment are gone",
        || async {
            let gone = shards_of(&client, &s.ns, "reason").await.is_empty()
                && deployments.get_opt("reason").await.ok()?.is_none();
            gone.then_some(())
        },
    )
    .await;

    // Metrics are served.
    let body = String::from_utf8(
        tokio::process::Command::new("curl")
            .args(["-sf", &format!("http://{admin}/metrics")])
            .output()
            .await
            .unwrap()
            .stdout,
    )
    .unwrap();
    for name in [
        "shardplane_operator_reconciles_total",
        "shardplane_operator_placements_total",
        "shardplane_operator_reconcile_duration_seconds",
        "shardplane_operator_leader 1",
        "shardplane_operator_instances{phase=\"ready\"}",
    ] {
        assert!(body.contains(name), "/metrics lacks {name}:\n{body}");
    }

    // Bad input: Ready=False with a reason naming what to change, and no shards.
    let bad = [
        (
            "no-model",
            fixtures::deployment("no-model", "absent", &s.daily_pool, &s.whole),
            "ModelNotFound",
        ),
        (
            "no-pool",
            fixtures::deployment("no-pool", "smollm2", "absent-pool", &s.whole),
            "NodePoolNotFound",
        ),
        (
            "wrong-tier",
            fixtures::deployment("wrong-tier", "smollm2", &s.daily_pool, &s.pipeline),
            "StrategyDoesNotFitTier",
        ),
    ];
    let mut huge = fixtures::strategy(&unique_name("huge"), Parallelism::Pipeline);
    huge.spec.kv_cache = KvCacheBudget {
        context_length: 1 << 20,
        concurrent_sequences: 64,
    };
    Api::<ShardingStrategy>::all(client.clone())
        .create(&PostParams::default(), &huge)
        .await
        .unwrap();
    let too_big = fixtures::deployment("too-big", "smollm2", &s.reasoning_pool, &huge.name_any());
    deployments
        .create(&PostParams::default(), &too_big)
        .await
        .unwrap();
    let d = eventually("too-big is Ready=False InsufficientMemory", || async {
        let d = deployments.get("too-big").await.ok()?;
        let c = condition(&d, CONDITION_READY)?;
        (c.status == "False" && c.reason == "InsufficientMemory").then_some(d)
    })
    .await;
    assert_eq!(
        d.status
            .as_ref()
            .unwrap()
            .endpoint
            .as_ref()
            .map(|e| e.url.as_str()),
        Some(GATEWAY_URL),
        "where to ask is known before anything is placed"
    );
    let message = &condition(&d, CONDITION_READY).unwrap().message;
    assert!(
        message.contains("KV cache for 1048576 tokens x 64 sequences")
            && message.contains("free in all"),
        "{message}"
    );
    assert!(
        shards_of(&client, &s.ns, "too-big").await.is_empty(),
        "too-big created shards"
    );
    for (name, d, _) in &bad {
        deployments.create(&PostParams::default(), d).await.unwrap();
        let _ = name;
    }
    for (name, _, reason) in &bad {
        let d = eventually(&format!("{name} is Ready=False {reason}"), || async {
            let d = deployments.get(name).await.ok()?;
            let c = condition(&d, CONDITION_READY)?;
            (c.status == "False" && c.reason == *reason).then_some(d)
        })
        .await;
        assert!(!condition(&d, CONDITION_READY).unwrap().message.is_empty());
        assert!(
            shards_of(&client, &s.ns, name).await.is_empty(),
            "{name} created shards"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_another_namespace_claimed_first_is_reported_as_a_conflict() {
    let client = control_plane().client().await.unwrap();
    start_operator(&client).await;
    let (first_ns, second_ns) = (
        control_plane().namespace(&client, "names-a").await.unwrap(),
        control_plane().namespace(&client, "names-b").await.unwrap(),
    );
    let shared = unique_name("shared");
    let claim = |alias: &str, own: &str| {
        let mut d = fixtures::deployment("d", "no-model", "no-pool", "no-strategy");
        d.spec.aliases = vec![alias.to_string(), own.to_string()];
        d
    };
    let first: Api<ModelDeployment> = Api::namespaced(client.clone(), &first_ns);
    let second: Api<ModelDeployment> = Api::namespaced(client.clone(), &second_ns);
    first
        .create(&PostParams::default(), &claim(&shared, &unique_name("own")))
        .await
        .unwrap();
    // Creation times have a resolution of a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    second
        .create(&PostParams::default(), &claim(&shared, &unique_name("own")))
        .await
        .unwrap();
    let conflicted = |api: Api<ModelDeployment>, want: bool| async move {
        let d = api.get("d").await.ok()?;
        let c = condition(&d, CONDITION_CONFLICTED)?.clone();
        ((c.status == "True") == want).then_some(c)
    };
    let c = eventually("the later claimant reports the conflict", || {
        conflicted(second.clone(), true)
    })
    .await;
    assert_eq!(c.reason, "NameConflict");
    assert!(
        c.message
            .contains(&format!("{shared:?} is served by {first_ns}/d")),
        "{}",
        c.message
    );
    let c = eventually("the first claimant has none", || {
        conflicted(first.clone(), false)
    })
    .await;
    assert_eq!(c.reason, "NoConflicts");
    // The owner goes: the name is free.
    first.delete("d", &DeleteParams::default()).await.unwrap();
    eventually("the conflict ends with its owner", || {
        conflicted(second.clone(), false)
    })
    .await;
}
