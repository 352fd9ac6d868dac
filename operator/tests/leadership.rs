//! Two operator replicas: only the Lease holder acts; when it dies mid-way
//! the other takes over and converges, with no duplicate or orphaned Shards.
//! Both report ready (`/readyz`) while they reach the API server: a standby is
//! ready to take over; the leader gauge says which one leads.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use shardplane_crds::*;
use shardplane_operator::{OperatorConfig, leader::Election};
use shardplane_testkit::as_agent::register_node;
use shardplane_testkit::{control_plane, eventually, fixtures, unique_name};

const WAIT: Duration = Duration::from_secs(60);

fn replica(client: &Client, election_ns: &str) -> (tokio::task::JoinHandle<()>, SocketAddr) {
    let admin: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let config = OperatorConfig {
        admin_address: admin,
        election: Election {
            namespace: election_ns.to_string(),
            name: "shardplane-operator".into(),
            identity: unique_name("replica"),
            lease_duration: Duration::from_secs(4),
            renew_every: Duration::from_secs(1),
        },
        default_node_lease: Duration::from_secs(30),
        hugging_face_endpoint: shardplane_operator::HUGGING_FACE_HUB.into(),
        hugging_face_token: None,
        // No agents run in these tests: the operator reads the model itself.
        read_model_paths: true,
        gateway_url: None,
        view: None,
        webhook: None,
        signer: None,
    };
    let client = client.clone();
    let task = tokio::spawn(async move {
        let _ = shardplane_operator::run(client, config).await;
    });
    (task, admin)
}

async fn ready(admin: SocketAddr) -> bool {
    let out = tokio::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://{admin}/readyz"),
        ])
        .output()
        .await
        .unwrap();
    String::from_utf8_lossy(&out.stdout) == "200"
}

/// Whether the replica at `admin` says it leads (its leader gauge is 1).
async fn leads(admin: SocketAddr) -> bool {
    let metrics = shardplane_testkit::metrics::scrape(&admin.to_string()).await;
    shardplane_testkit::metrics::sum(&metrics, "shardplane_operator_leader ") == 1.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_and_the_other_takes_over_without_duplicates() {
    let client = control_plane().client().await.unwrap();
    let election = unique_name("election");
    let (a, admin_a) = replica(&client, &election);
    eventually("replica A leads", WAIT, || async {
        (leads(admin_a).await && ready(admin_a).await).then_some(())
    })
    .await;
    let (b, admin_b) = replica(&client, &election);
    eventually("standby B is ready", WAIT, || async {
        ready(admin_b).await.then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !leads(admin_b).await,
        "replica B must stand by while A holds the Lease"
    );
    assert!(ready(admin_b).await, "a standby stays ready");

    // A places a deployment.
    let ns = control_plane().namespace(&client, "lead").await.unwrap();
    let tag = unique_name("l");
    let mut model = fixtures::model("m");
    model.spec.source = ModelSource::Path(PathSource {
        path: shardplane_testkit::test_model().display().to_string(),
        sha256: None,
    });
    Api::<Model>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &model)
        .await
        .unwrap();
    let mut pool = fixtures::node_pool(&format!("p-{tag}"), Tier::Daily);
    pool.spec.node_selector.match_labels = Some([("lead".to_string(), tag.clone())].into());
    Api::<NodePool>::all(client.clone())
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();
    let mut strategy = fixtures::strategy(&format!("s-{tag}"), Parallelism::None);
    strategy.spec.kv_cache = KvCacheBudget {
        context_length: 256,
        concurrent_sequences: 1,
    };
    Api::<ShardingStrategy>::all(client.clone())
        .create(&PostParams::default(), &strategy)
        .await
        .unwrap();
    for i in 0..4 {
        register_node(&client, &format!("{tag}-{i}"), &[("lead", &tag)], "4Gi").await;
    }
    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    let mut d = fixtures::deployment("chat", "m", &pool.name_any(), &strategy.name_any());
    d.spec.replicas = 2;
    deployments
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    eventually("A places 2 shards", WAIT, || async {
        (shards.list(&ListParams::default()).await.ok()?.items.len() == 2).then_some(())
    })
    .await;

    // A dies without giving up its Lease; the spec changes while nobody leads.
    a.abort();
    deployments
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await
        .unwrap();

    // B takes over once the Lease expires and converges: 3 shards, no duplicates.
    eventually("replica B leads", WAIT, || async {
        leads(admin_b).await.then_some(())
    })
    .await;
    let items = eventually("B converges to 3 instances", WAIT, || async {
        let items = shards.list(&ListParams::default()).await.ok()?.items;
        let d = deployments.get("chat").await.ok()?;
        (items.len() == 3 && d.status.as_ref()?.replicas == 3).then_some(items)
    })
    .await;
    let instances: BTreeSet<u32> = items.iter().map(|s| s.spec.instance).collect();
    let nodes: BTreeSet<&str> = items.iter().map(|s| s.spec.node.as_str()).collect();
    assert_eq!(
        instances,
        BTreeSet::from([0, 1, 2]),
        "one shard per instance"
    );
    assert_eq!(nodes.len(), 3, "daily replicas on distinct nodes");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        shards
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        3,
        "nothing more appears"
    );
    b.abort();
}
