//! A gated Hugging Face model end to end, against a stand-in hub speaking the
//! hub's protocol (the real hub is not reachable from the tests): the operator
//! resolves `main` to a commit with its token and records it; the Shards it
//! makes name that commit and the file's LFS SHA-256; a real agent downloads
//! that commit with its own token and serves the shard; neither token shows in
//! any status or event. A revision that does not exist says so in the
//! Model's conditions. A Model that names its own token in a Secret is
//! resolved and fetched with that token instead of the nodes', and a Secret
//! that does not opt in is not read.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use shardplane_crds::*;
use shardplane_testkit::hub::{
    HUB_COMMIT, HUB_FILE, HUB_MODEL_TOKEN, HUB_PRIVATE_REPO, HUB_REPO, HUB_TOKEN, serve_hub,
};
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
        token_secret_ref: None,
    })
}

/// The private repository, with its token in the Secret `secret`.
fn private(secret: &str) -> ModelSource {
    ModelSource::HuggingFace(HuggingFaceSource {
        repo: HUB_PRIVATE_REPO.into(),
        file: Some(HUB_FILE.into()),
        revision: None,
        sha256: None,
        token_secret_ref: Some(SecretKeyRef {
            name: secret.into(),
            key: "token".into(),
        }),
    })
}

/// A Secret holding `token` under `token`, labelled to be read when `opted_in`.
fn token_secret(name: &str, token: &str, opted_in: bool) -> Secret {
    let mut secret = Secret::default();
    secret.metadata.name = Some(name.into());
    if opted_in {
        secret.metadata.labels =
            Some([(HUGGING_FACE_TOKEN_LABEL.to_string(), "true".to_string())].into());
    }
    secret.string_data = Some([("token".to_string(), token.to_string())].into());
    secret
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
    // A Model with its own token, and one whose Secret does not opt in.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let pp = PostParams::default();
    for (name, opted_in) in [("hub-token", true), ("plain", false)] {
        let secret = token_secret(name, HUB_MODEL_TOKEN, opted_in);
        secrets.create(&pp, &secret).await.unwrap();
    }
    let mut own = fixtures::model("private");
    own.spec.source = private("hub-token");
    models.create(&pp, &own).await.unwrap();
    let mut unlabelled = fixtures::model("unlabelled");
    unlabelled.spec.source = private("plain");
    models.create(&pp, &unlabelled).await.unwrap();
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
    let own = eventually("the model with its own token resolves", WAIT, || async {
        models
            .get("private")
            .await
            .ok()?
            .status
            .filter(|s| s.layers.is_some())
    })
    .await;
    assert_eq!(own.resolved_revision.as_deref(), Some(HUB_COMMIT));
    let refused = eventually("the unlabelled Secret is refused", WAIT, || async {
        let st = models.get("unlabelled").await.ok()?.status?;
        st.conditions
            .into_iter()
            .find(|c| c.type_ == CONDITION_RESOLVED && c.status == "False")
    })
    .await;
    assert_eq!(refused.reason, "SecretNotOptedIn", "{}", refused.message);
    assert!(
        refused.message.contains(HUGGING_FACE_TOKEN_LABEL),
        "{}",
        refused.message
    );

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
        .filter(|(path, _)| path.contains(&format!("/{HUB_REPO}/resolve/")))
        .collect();
    assert!(!downloads.is_empty(), "{requests:?}");
    for (path, auth) in &downloads {
        assert!(path.contains(HUB_COMMIT), "{path}");
        assert_eq!(
            auth.as_deref(),
            Some(format!("Bearer {HUB_TOKEN}").as_str())
        );
    }

    // Moved to the Model with its own token, the agent fetches the private
    // repository with that token, not its own.
    deployments
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"model": "private"}})),
        )
        .await
        .unwrap();
    let shards_api = Api::<Shard>::namespaced(client.clone(), &ns);
    let moved = eventually("the private model's Shard is Ready", WAIT, || async {
        let shards = shards_api.list(&ListParams::default()).await.ok()?.items;
        let [shard] = &shards[..] else { return None };
        let ModelSource::HuggingFace(hf) = &shard.spec.source else {
            return None;
        };
        let status = shard.status.as_ref()?;
        let ready = status.phase == Some(ShardPhase::Ready)
            && status.observed_generation == shard.metadata.generation;
        (hf.repo == HUB_PRIVATE_REPO && ready).then(|| shard.clone())
    })
    .await;
    let ModelSource::HuggingFace(pinned) = &moved.spec.source else {
        unreachable!()
    };
    assert_eq!(pinned.revision.as_deref(), Some(HUB_COMMIT));
    let requests = hub.requests.lock().unwrap().clone();
    let private: Vec<_> = requests
        .iter()
        .filter(|(path, _)| path.contains(&format!("/{HUB_PRIVATE_REPO}/")))
        .collect();
    assert!(
        private.iter().any(|(path, _)| path.contains("/resolve/")),
        "{requests:?}"
    );
    for (path, auth) in &private {
        assert_eq!(
            auth.as_deref(),
            Some(format!("Bearer {HUB_MODEL_TOKEN}").as_str()),
            "{path}"
        );
    }

    // The tokens are nowhere to be read.
    let mut written =
        serde_json::to_string(&models.list(&ListParams::default()).await.unwrap()).unwrap();
    written += &serde_json::to_string(&shards).unwrap();
    written += &serde_json::to_string(&moved).unwrap();
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
    assert!(!written.contains(HUB_MODEL_TOKEN));
    assert!(!written.contains("hf_model_token"));
}
