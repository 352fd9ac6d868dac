//! A stage whose thread panics, in a real agent (the fault injected with
//! `FAILPOINTS`): the request in flight hears UNAVAILABLE, a server's fault
//! (so a gateway tries another instance), never a client's error; the Shard
//! turns Failed with reason StageCrashed, is loaded again after its back-off
//! with the restart and the failure recorded, and serves again.

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use shardplane_crds::*;
use shardplane_dataplane as dp;
use shardplane_dataplane::tonic::Code;
use shardplane_testkit::{control_plane, eventually, fixtures, free_address, unique_name};

const WAIT: Duration = Duration::from_secs(90);

/// Runs a Generate on the agent at `endpoint` to its end; the text.
async fn generate(endpoint: &str, ns: &str, shard: &str) -> Result<String, dp::tonic::Status> {
    shardplane_testkit::agent_calls::generate_text(
        endpoint,
        ns,
        shard,
        "The capital of France is",
        4,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_whose_thread_panics_fails_its_shard_answers_unavailable_and_comes_back() {
    let client = control_plane().client().await.unwrap();
    let node = unique_name("crash");
    let cache = shardplane_testkit::agent_cache(env!("CARGO_TARGET_TMPDIR"), &node);
    let admin = free_address().to_string();
    let _agent = shardplane_testkit::spawn_component_with(
        env!("CARGO_BIN_EXE_shardplane"),
        &[
            "agent",
            "--node-name",
            &node,
            "--admin-address",
            &admin,
            "--lease-seconds",
            "3",
            "--cache-dir",
            cache.to_str().unwrap(),
        ],
        control_plane().kubeconfig(),
        // The first forward pass of any stage of this agent panics.
        &[("FAILPOINTS", "stage-pass=1*panic(injected stage fault)")],
    );
    let ns = control_plane().namespace(&client, "crash").await.unwrap();
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    let mut shard = fixtures::shard("crash", &node, 0, 1, LayerRange { start: 0, end: 30 });
    shard.spec.source = ModelSource::Path(PathSource {
        path: shardplane_testkit::test_model().display().to_string(),
        sha256: None,
    });
    shards.create(&PostParams::default(), &shard).await.unwrap();
    let name = "crash-0-0";
    let status = |phase: ShardPhase| {
        let shards = shards.clone();
        move || {
            let shards = shards.clone();
            async move {
                let st = shards.get(name).await.ok()?.status?;
                (st.phase == Some(phase)).then_some(st)
            }
        }
    };
    let ready = eventually("the shard is Ready", WAIT, status(ShardPhase::Ready)).await;
    let endpoint = ready.endpoint.unwrap();

    let err = generate(&endpoint, &ns, name)
        .await
        .expect_err("the stage's thread panicked");
    assert_eq!(err.code(), Code::Unavailable, "a server's fault: {err:?}");

    let failed = eventually("the shard fails", WAIT, status(ShardPhase::Failed)).await;
    assert_eq!(failed.reason.as_deref(), Some("StageCrashed"), "{failed:?}");
    let message = failed.message.clone().unwrap_or_default();
    assert!(message.contains("injected stage fault"), "{message}");
    assert!(
        failed.next_retry_time.is_some(),
        "a retry is due: {failed:?}"
    );

    // After its back-off (10 s) it is loaded again and serves.
    let again = eventually("the shard is Ready again", WAIT, || async {
        status(ShardPhase::Ready)()
            .await
            .filter(|st| st.restarts == Some(1))
    })
    .await;
    let last = again.last_failure.unwrap_or_default();
    assert!(last.starts_with("StageCrashed: "), "{last}");
    let text = generate(&endpoint, &ns, name).await.unwrap();
    assert!(!text.is_empty(), "it serves again");
}
