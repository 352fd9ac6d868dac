//! Tensor parallelism across agents, placed by the operator: a deployment
//! with `parallelism: tensor` becomes one group of two ranks on two agents;
//! its leader answers with exactly the greedy tokens of the same split run
//! in one process (`generate --tensor 2`), which are the whole model's on
//! prompts without near-ties; when a rank's agent is killed only that rank
//! moves, the group forms again and answers the same.
//!
//! The split of a quantized model rounds differently from the whole model
//! (its partial sums are added in another order), so on a near-tie the
//! whole model may pick the other token: the whole-model comparison uses
//! prompts on which one process with 1, 2 and 3 ranks agree for 24 tokens.

use std::time::Duration;

use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use shardplane_crds::*;
use shardplane_dataplane as dp;
use shardplane_testkit::{ChildGuard, control_plane, fixtures, free_address, unique_name};

const WAIT: Duration = Duration::from_secs(120);

/// Compared with the same split in one process.
const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
];
/// Of [`PROMPTS`], those without a near-tie in 24 tokens: compared with
/// the whole model too.
const NO_NEAR_TIES: [&str; 2] = ["Water boils at a temperature of", "def fibonacci(n):"];

fn shardplane(args: &[&str]) -> ChildGuard {
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), args)
}

/// An agent for `node` labelled `label`.
fn agent(node: &str, label: &str) -> ChildGuard {
    let admin = free_address().to_string();
    let cache = shardplane_testkit::agent_cache(env!("CARGO_TARGET_TMPDIR"), node);
    shardplane(&[
        "agent",
        "--node-name",
        node,
        "--admin-address",
        &admin,
        "--lease-seconds",
        "3",
        "--memory-reserve",
        "1Gi",
        "--label",
        label,
        "--cache-dir",
        cache.to_str().unwrap(),
    ])
}

/// The greedy tokens one process gives for `prompt` with `extra` options
/// (the whole model without), as `generate --print-tokens` writes them.
fn local_tokens(prompt: &str, extra: &[&str]) -> String {
    let model = shardplane_testkit::test_model();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(["generate", "--model", model.to_str().unwrap()])
        .args(["--prompt", prompt, "--max-tokens", "24", "--print-tokens"])
        .args(extra)
        .env_remove("SHARDPLANE_MODEL")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    shardplane_testkit::tokens_line(&stderr)
}

/// The greedy tokens the instance led by Shard `ns/shard` at `endpoint`
/// gives for `prompt`, in the same form.
async fn group_tokens(endpoint: &str, ns: &str, shard: &str, prompt: &str) -> String {
    let mut client = dp::client(
        dp::channel(endpoint, None).unwrap(),
        dp::Token::new(shardplane_testkit::DATA_PLANE_TOKEN).unwrap(),
    );
    let request = dp::GenerateRequest {
        shard: Some(dp::ShardRef {
            namespace: ns.into(),
            name: shard.into(),
        }),
        input: Some(dp::generate_request::Input::Prompt(prompt.into())),
        sampling: Some(dp::Sampling {
            max_tokens: 24,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(dp::generate_response::Event::Delta(d)) = event.event {
            tokens.extend(d.tokens);
        }
    }
    format!("tokens: {tokens:?}")
}

/// The deployment's Shards once its one instance is Ready with a group of
/// two ranks on nodes other than `not_on`: (leader, follower).
async fn ready_group(
    deployments: &Api<ModelDeployment>,
    shards: &Api<Shard>,
    not_on: Option<&str>,
) -> (Shard, Shard) {
    shardplane_testkit::eventually("the tensor group is Ready", WAIT, || async {
        let d = deployments.get("tp").await.ok()?;
        let st = d.status.as_ref()?;
        let stages = &st.instances.first()?.stages;
        let placed = st.ready_replicas == 1
            && stages.len() == 2
            && stages.iter().all(|s| Some(s.node.as_str()) != not_on);
        if !placed {
            return None;
        }
        let mut ranks: Vec<Shard> = shards
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|s| stages.iter().any(|st| st.shard == s.name_any()))
            .collect();
        ranks.sort_by_key(|s| s.spec.tensor.as_ref().map(|t| t.rank));
        let ready = ranks.len() == 2
            && ranks
                .iter()
                .all(|s| s.status.as_ref().and_then(|st| st.phase) == Some(ShardPhase::Ready));
        ready.then(|| (ranks[0].clone(), ranks[1].clone()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_group_across_agents_answers_as_one_process_and_heals_a_lost_rank() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client, "tp").await.unwrap();
    let tag = unique_name("tp");
    let _operator = shardplane(&[
        "operator",
        "--admin-address",
        &free_address().to_string(),
        "--leader-namespace",
        &format!("leader-{tag}"),
        "--node-lease-seconds",
        "3",
    ]);
    let label = format!("tp={tag}");
    let agents: Vec<(String, ChildGuard)> = (0..3)
        .map(|i| {
            let node = format!("{tag}-n{i}");
            let a = agent(&node, &label);
            (node, a)
        })
        .collect();
    let mut model = fixtures::model("smollm2");
    model.spec.source = ModelSource::Path(PathSource {
        path: shardplane_testkit::test_model().display().to_string(),
        sha256: None,
    });
    Api::<Model>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &model)
        .await
        .unwrap();
    let pool = fixtures::node_pool_selecting(&format!("pool-{tag}"), Tier::Reasoning, ("tp", &tag));
    let mut strategy = fixtures::strategy(&format!("tp-{tag}"), Parallelism::Tensor);
    // Equal shares, as `generate --tensor 2` splits.
    strategy.spec.placement = PlacementPolicy::EvenLayers;
    strategy.spec.min_nodes = Some(2);
    strategy.spec.max_nodes = Some(2);
    strategy.spec.kv_cache = KvCacheBudget {
        context_length: 512,
        concurrent_sequences: 2,
    };
    let deployments = fixtures::deploy(&client, &ns, "tp", "smollm2", &pool, &strategy).await;
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);

    let (leader, follower) = ready_group(&deployments, &shards, None).await;
    let (lt, ft) = (
        leader.spec.tensor.clone().unwrap(),
        follower.spec.tensor.clone().unwrap(),
    );
    assert_eq!((lt.rank, ft.rank), (0, 1));
    assert_eq!(lt.group, [leader.name_any(), follower.name_any()]);
    assert_eq!(lt.weights, ft.weights);
    assert_ne!(leader.spec.node, follower.spec.node);
    for s in [&leader, &follower] {
        assert_eq!((s.spec.layers.start, s.spec.layers.end), (0, 30));
        let st = s.status.as_ref().unwrap();
        assert_eq!(st.engine, Some(Engine::Candle));
        assert!(st.tensor_endpoint.is_some(), "{st:?}");
    }
    let endpoint = leader.status.as_ref().unwrap().endpoint.clone().unwrap();
    assert_eq!(lt.weights, [1, 1]);
    let expected: Vec<String> = PROMPTS
        .iter()
        .map(|p| local_tokens(p, &["--tensor", "2"]))
        .collect();
    for prompt in NO_NEAR_TIES {
        let i = PROMPTS.iter().position(|p| *p == prompt).unwrap();
        assert_eq!(
            local_tokens(prompt, &[]),
            expected[i],
            "{prompt:?}: whole model"
        );
    }
    for (prompt, want) in PROMPTS.iter().zip(&expected) {
        let got = group_tokens(&endpoint, &ns, &leader.name_any(), prompt).await;
        assert_eq!(&got, want, "{prompt:?}");
    }

    // The follower's agent dies: its rank moves to the spare agent, the
    // leader stays, the group forms again and answers the same.
    let victim = follower.spec.node.clone();
    let index = agents.iter().position(|(n, _)| *n == victim).unwrap();
    agents[index].1.signal("-KILL");
    // The leader hears of it at its next step at the latest.
    let mut probe = dp::client(
        dp::channel(&endpoint, None).unwrap(),
        dp::Token::new(shardplane_testkit::DATA_PLANE_TOKEN).unwrap(),
    );
    let _ = probe
        .generate(dp::GenerateRequest {
            shard: Some(dp::ShardRef {
                namespace: ns.clone(),
                name: leader.name_any(),
            }),
            input: Some(dp::generate_request::Input::Prompt("Hello".into())),
            sampling: Some(dp::Sampling {
                max_tokens: 2,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await;
    let (healed_leader, healed_follower) = ready_group(&deployments, &shards, Some(&victim)).await;
    assert_eq!(
        healed_leader.spec.node, leader.spec.node,
        "the leader stays"
    );
    assert_ne!(healed_follower.spec.node, victim);
    assert_eq!(
        healed_follower.spec.tensor.as_ref().unwrap().weights,
        ft.weights,
        "the lost rank keeps its share"
    );
    let endpoint = healed_leader
        .status
        .as_ref()
        .unwrap()
        .endpoint
        .clone()
        .unwrap();
    for (prompt, want) in PROMPTS.iter().zip(&expected) {
        let got = group_tokens(&endpoint, &ns, &healed_leader.name_any(), prompt).await;
        assert_eq!(&got, want, "{prompt:?} after healing");
    }
    drop(agents);
}
