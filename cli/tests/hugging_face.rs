//! A gated Hugging Face model end to end, against a stand-in hub speaking the
//! hub's protocol (the real hub is not reachable from the tests): the operator
//! resolves `main` to a commit with its token and records it; the Shards it
//! makes name that commit and the file's LFS SHA-256; a real agent downloads
//! that commit with its own token and serves the shard; neither token shows in
//! any status or event. A revision that does not exist says so in the
//! Model's conditions.

use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, PostParams};
use shardplane_crds::*;
use shardplane_testkit::hub::{HUB_COMMIT, HUB_FILE, HUB_REPO, HUB_TOKEN, serve_hub};
use shardplane_testkit::{
    ChildGuard, control_plane, eventually, fixtures, free_address, unique_name,
};

const WAIT: Duration = Duration::from_secs(90);

fn shardplane(args: &[&str]) -> ChildGuard {
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), args)
}

fn hugging_face(revision: Option<&str>) -> ModelSource {
    ModelSource::HuggingFace(HuggingFaceSource {
        repo: HUB_REPO.into(),
        file: Some(HUB_FILE.into()),
        revision: revision.map(str::to_string),
        sha256: None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_model_is_pinned_to_a_commit_downloaded_with_the_token_and_verified() {
    let hub = serve_hub().await;
    let client = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client, "hf").await.unwrap();
    let tag = unique_name("hf");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("hf-token");
    std::fs::write(&token_file, format!("{HUB_TOKEN}\n")).unwrap();
    std::fs::set_permissions(
        &token_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let token_file = token_file.to_str().unwrap();
    let _operator = shardplane(&[
        "operator",
        "--admin-address",
        &free_address().to_string(),
        "--leader-namespace",
        &format!("leader-{tag}"),
        "--node-lease-seconds",
        "5",
        "--hugging-face-endpoint",
        &hub.base,
        "--hugging-face-token-file",
        token_file,
    ]);
    let node = format!("{tag}-n0");
    let cache = dir.path().join("cache");
    let label = format!("hf={tag}");
    let _agent = shardplane(&[
        "agent",
        "--node-name",
        &node,
        "--label",
        &label,
        "--admin-address",
        &free_address().to_string(),
        "--lease-seconds",
        "5",
        "--memory-reserve",
        "1Gi",
        "--cache-dir",
        cache.to_str().unwrap(),
        "--hugging-face-endpoint",
        &hub.base,
        "--hugging-face-token-file",
        token_file,
    ]);

    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let mut model = fixtures::model("gated");
    model.spec.source = hugging_face(None);
    models.create(&PostParams::default(), &model).await.unwrap();
    let mut missing = fixtures::model("missing-revision");
    missing.spec.source = hugging_face(Some("v9"));
    models
        .create(&PostParams::default(), &missing)
        .await
        .unwrap();

    // The revision resolves once, to the commit, with the file's checksum.
    let status = eventually("the gated model resolves", WAIT, || async {
        models
            .get("gated")
            .await
            .ok()?
            .status
            .filter(|s| s.layers.is_some())
    })
    .await;
    assert_eq!(status.resolved_revision.as_deref(), Some(HUB_COMMIT));
    assert_eq!(status.sha256.as_deref(), Some(hub.sha256.as_str()));
    let unresolved = eventually("the missing revision is reported", WAIT, || async {
        let st = models.get("missing-revision").await.ok()?.status?;
        st.conditions
            .into_iter()
            .find(|c| c.type_ == CONDITION_RESOLVED && c.status == "False")
    })
    .await;
    assert_eq!(
        unresolved.reason, "RevisionNotFound",
        "{}",
        unresolved.message
    );
    assert!(unresolved.message.contains("v9"), "{}", unresolved.message);

    let pool = fixtures::node_pool_selecting(&format!("pool-{tag}"), Tier::Daily, ("hf", &tag));
    let mut strategy = fixtures::strategy(&format!("whole-{tag}"), Parallelism::None);
    strategy.spec.kv_cache = KvCacheBudget {
        context_length: 512,
        concurrent_sequences: 1,
    };
    let deployments = fixtures::deploy(&client, &ns, "chat", "gated", &pool, &strategy).await;
    eventually("the deployment is Ready on the agent", WAIT, || async {
        let d = deployments.get("chat").await.ok()?;
        (d.status?.ready_replicas == 1).then_some(())
    })
    .await;

    // The Shard names the commit and the checksum; the agent fetched the
    // file at that commit, with the token.
    let shards = Api::<Shard>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(shards.len(), 1);
    let ModelSource::HuggingFace(pinned) = &shards[0].spec.source else {
        panic!("{:?}", shards[0].spec.source);
    };
    assert_eq!(pinned.revision.as_deref(), Some(HUB_COMMIT));
    assert_eq!(pinned.sha256.as_deref(), Some(hub.sha256.as_str()));
    let requests = hub.requests.lock().unwrap().clone();
    let downloads: Vec<_> = requests
        .iter()
        .filter(|(path, _)| path.contains("/resolve/"))
        .collect();
    assert!(!downloads.is_empty(), "{requests:?}");
    for (path, auth) in &downloads {
        assert!(path.contains(HUB_COMMIT), "{path}");
        assert_eq!(
            auth.as_deref(),
            Some(format!("Bearer {HUB_TOKEN}").as_str())
        );
    }

    // The token is nowhere to be read.
    let mut written =
        serde_json::to_string(&models.list(&ListParams::default()).await.unwrap()).unwrap();
    written += &serde_json::to_string(&shards).unwrap();
    written += &serde_json::to_string(&deployments.get("chat").await.unwrap()).unwrap();
    written += &serde_json::to_string(
        &Api::<Event>::namespaced(client.clone(), &ns)
            .list(&ListParams::default())
            .await
            .unwrap(),
    )
    .unwrap();
    assert!(!written.contains(HUB_TOKEN));
    assert!(!written.contains("hf_test_token"));
}
