//! `manifests/quickstart/` on real processes: an operator and five agents
//! (two daily, three reasoning) make both quickstart deployments Ready with
//! their shards where the planner puts them.

use std::collections::BTreeSet;
use std::time::Duration;

use kube::Api;
use kube::api::ListParams;
use shardplane_crds::*;
use shardplane_operator::conditions::is_true;
use shardplane_testkit::{
    ChildGuard as Process, control_plane, eventually, free_address, repo_root, unique_name,
};

fn shardplane(args: &[&str]) -> Process {
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_becomes_ready_on_five_agents() {
    // The quickstart's Model names this path on the nodes.
    shardplane_testkit::install_quickstart_model();
    let client = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client, "quickstart")
        .await
        .unwrap();
    let _operator = shardplane(&[
        "operator",
        "--admin-address",
        &free_address().to_string(),
        "--leader-namespace",
        &unique_name("qs"),
    ]);
    let tag = unique_name("qs");
    let _agents: Vec<Process> = (0..5)
        .map(|i| {
            let tier = if i < 2 { "daily" } else { "reasoning" };
            shardplane(&[
                "agent",
                "--node-name",
                &format!("{tag}-{i}"),
                "--label",
                &format!("tier.shardplane.dev/{tier}=true"),
                "--admin-address",
                &free_address().to_string(),
                "--lease-seconds",
                "3",
                "--cache-dir",
                std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                    .join("quickstart-cache")
                    .to_str()
                    .unwrap(),
            ])
        })
        .collect();
    // All five Ready first, as `shardplane up` does: a pipeline placed while
    // a reasoning node is still registering keeps fewer stages.
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    for i in 0..5 {
        let name = format!("{tag}-{i}");
        eventually(
            &format!("{name} is Ready"),
            Duration::from_secs(60),
            || async {
                let n = nodes.get_opt(&name).await.ok()??;
                is_true(&n.status?.conditions, CONDITION_READY).then_some(())
            },
        )
        .await;
    }
    let dir = repo_root().join("manifests/quickstart");
    control_plane()
        .kubectl(&["apply", "-n", &ns, "-f", dir.to_str().unwrap()])
        .unwrap();

    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    let ready = |name: &'static str, replicas: i32| {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get(name).await.ok()?;
            let ok = d
                .status
                .as_ref()?
                .conditions
                .iter()
                .any(|c| c.type_ == CONDITION_READY && c.status == "True");
            (ok && d.status.as_ref()?.ready_replicas == replicas).then_some(d)
        }
    };
    let daily = eventually("smollm2-daily is Ready", Duration::from_secs(120), || {
        ready("smollm2-daily", 2)
    })
    .await;
    let pipeline = eventually(
        "smollm2-pipeline is Ready",
        Duration::from_secs(120),
        || ready("smollm2-pipeline", 1),
    )
    .await;

    // Daily: two whole-model replicas on the two daily nodes.
    let daily_nodes: BTreeSet<String> = daily
        .status
        .unwrap()
        .instances
        .iter()
        .map(|i| i.stages[0].node.clone())
        .collect();
    assert_eq!(
        daily_nodes,
        BTreeSet::from([format!("{tag}-0"), format!("{tag}-1")])
    );
    // Reasoning: evenLayers over maxNodes 3, one stage per reasoning node.
    let stages = &pipeline.status.unwrap().instances[0].stages;
    let ranges: Vec<(u32, u32)> = stages
        .iter()
        .map(|s| (s.layers.start, s.layers.end))
        .collect();
    assert_eq!(ranges, vec![(0, 10), (10, 20), (20, 30)]);
    let nodes: BTreeSet<&str> = stages.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(nodes.len(), 3);
    assert!(
        nodes.iter().all(|n| !daily_nodes.contains(*n)),
        "daily nodes are dedicated"
    );
    let shards = Api::<Shard>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(shards.items.len(), 5);
    assert!(
        shards
            .items
            .iter()
            .all(|s| s.status.as_ref().and_then(|st| st.phase) == Some(ShardPhase::Ready))
    );
}
