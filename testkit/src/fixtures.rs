//! Valid objects of every kind, to be changed by a test into what it needs.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::ObjectMeta;
use shardplane_crds::*;

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        ..Default::default()
    }
}

/// The quickstart's model source: the test GGUF at a path on the nodes.
pub fn gguf_path_source() -> ModelSource {
    ModelSource::Path(PathSource {
        path: "/var/lib/shardplane/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
        sha256: None,
    })
}

/// A GGUF Model at a path on the nodes.
pub fn model(name: &str) -> Model {
    Model {
        metadata: meta(name),
        spec: ModelSpec {
            source: gguf_path_source(),
            format: ModelFormat::Gguf,
            served_name: None,
            max_context_length: None,
            chat_template: None,
        },
        status: None,
    }
}

/// A NodePool of `tier` selecting nodes labelled `pool=<name>`.
pub fn node_pool(name: &str, tier: Tier) -> NodePool {
    NodePool {
        metadata: meta(name),
        spec: NodePoolSpec {
            tier,
            node_selector: LabelSelector {
                match_labels: Some([("pool".to_string(), name.to_string())].into()),
                ..Default::default()
            },
            memory_reserve: None,
        },
        status: None,
    }
}

/// A ShardingStrategy with a 4096-token, 4-sequence KV budget.
pub fn strategy(name: &str, parallelism: Parallelism) -> ShardingStrategy {
    ShardingStrategy {
        metadata: meta(name),
        spec: ShardingStrategySpec {
            parallelism,
            placement: PlacementPolicy::MemoryWeighted,
            min_nodes: None,
            max_nodes: None,
            kv_cache: KvCacheBudget {
                context_length: 4096,
                concurrent_sequences: 4,
            },
            stage_overhead: None,
            links: None,
            tensor_size: None,
        },
    }
}

/// A NodePool of tier `tier` choosing the nodes labelled `label`
/// (`(key, value)`).
pub fn node_pool_selecting(name: &str, tier: Tier, label: (&str, &str)) -> NodePool {
    let mut pool = node_pool(name, tier);
    pool.spec.node_selector.match_labels =
        Some([(label.0.to_string(), label.1.to_string())].into());
    pool
}

/// Creates `pool` and `strategy`, then a deployment `name` of `model` in
/// `ns` on them: the setup of a test that deploys on agents of its own.
pub async fn deploy(
    client: &kube::Client,
    ns: &str,
    name: &str,
    model: &str,
    pool: &NodePool,
    strategy: &ShardingStrategy,
) -> kube::Api<ModelDeployment> {
    use kube::ResourceExt;
    use kube::api::{Api, PostParams};
    let create = PostParams::default();
    Api::<NodePool>::all(client.clone())
        .create(&create, pool)
        .await
        .expect("create the NodePool");
    Api::<ShardingStrategy>::all(client.clone())
        .create(&create, strategy)
        .await
        .expect("create the ShardingStrategy");
    let deployments = Api::<ModelDeployment>::namespaced(client.clone(), ns);
    deployments
        .create(
            &create,
            &deployment(name, model, &pool.name_any(), &strategy.name_any()),
        )
        .await
        .expect("create the ModelDeployment");
    deployments
}

/// A ModelDeployment of one replica.
pub fn deployment(name: &str, model: &str, pool: &str, strategy: &str) -> ModelDeployment {
    ModelDeployment {
        metadata: meta(name),
        spec: ModelDeploymentSpec {
            model: model.into(),
            node_pool: pool.into(),
            strategy: strategy.into(),
            replicas: 1,
            aliases: vec![],
            fallback: vec![],
        },
        status: None,
    }
}

/// Stage `stage` of `stage_count` of instance 0, running `layers` of a
/// 30-layer model on `node`, with consistent previous/next names
/// (`<deployment>-0-<stage>`).
pub fn shard(
    deployment: &str,
    node: &str,
    stage: u32,
    stage_count: u32,
    layers: LayerRange,
) -> Shard {
    let name = |s: u32| format!("{deployment}-0-{s}");
    let mut shard = Shard {
        metadata: meta(&name(stage)),
        spec: ShardSpec {
            deployment: deployment.into(),
            model: "smollm2-135m".into(),
            source: gguf_path_source(),
            format: ModelFormat::Gguf,
            node: node.into(),
            instance: 0,
            stage,
            stage_count,
            layers,
            total_layers: 30,
            kv_cache: KvCacheBudget {
                context_length: 4096,
                concurrent_sequences: 4,
            },
            next: (stage + 1 < stage_count).then(|| name(stage + 1)),
            previous: (stage > 0).then(|| name(stage - 1)),
            chat_template: None,
            tensor: None,
        },
        status: None,
    };
    shard.metadata.labels = Some(
        [
            (
                NODE_LABEL.to_string(),
                shardplane_crds::node_label_value(node),
            ),
            (DEPLOYMENT_LABEL.to_string(), deployment.to_string()),
            (INSTANCE_LABEL.to_string(), "0".to_string()),
        ]
        .into(),
    );
    shard
}

/// An InferenceNode as a person would first create it (no status).
pub fn inference_node(name: &str) -> InferenceNode {
    InferenceNode {
        metadata: meta(name),
        spec: InferenceNodeSpec::default(),
        status: None,
    }
}
