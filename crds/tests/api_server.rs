//! The API on a real kube-apiserver and etcd: CRDs establish, every kind goes
//! through create / list / watch / status (server-side apply) / delete with the
//! kube-rs client, and kubectl shows what a person expects.

use std::fmt::Debug;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::core::NamespaceResourceScope;
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use shardplane_crds::*;
use shardplane_testkit::{control_plane, fixtures, unique_name};

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn every_crd_is_established_with_its_names() -> anyhow::Result<()> {
    let client = control_plane().client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    for crd in all_crds() {
        let name = crd.name_any();
        let live = crds.get(&name).await?;
        let established = live
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Established" && c.status == "True");
        assert!(established, "{name} is not Established");
        assert_eq!(
            live.spec.names.categories, crd.spec.names.categories,
            "{name}"
        );
        assert_eq!(
            live.spec.names.short_names, crd.spec.names.short_names,
            "{name}"
        );
    }
    Ok(())
}

fn condition(type_: &str, reason: &str) -> Value {
    json!({
        "type": type_, "status": "True", "reason": reason, "message": "set by a test",
        "lastTransitionTime": "2026-01-02T03:04:05Z", "observedGeneration": 1,
    })
}

/// Creates `object` while a watch is open, patches its status with server-side
/// apply under the shardplane field manager, lists it, deletes it, and checks
/// the watch saw it come and go.
async fn round_trip<K>(api: Api<K>, object: K, status: Value) -> anyhow::Result<()>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned + Send + 'static,
{
    let name = object.name_any();
    let what = format!("{} {name}", K::kind(&()));
    let watch = api
        .watch(
            &WatchParams::default().fields(&format!("metadata.name={name}")),
            "0",
        )
        .await?
        .boxed();

    let created = api.create(&PostParams::default(), &object).await?;
    assert_eq!(created.meta().generation, Some(1), "{what}");

    let patch =
        json!({ "apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": status });
    let patched = api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
    let got = serde_json::to_value(&patched)?;
    for (key, want) in status.as_object().expect("status is an object") {
        assert_eq!(
            &got["status"][key], want,
            "{what}: status.{key} after the patch"
        );
    }
    let managers: Vec<_> = patched
        .meta()
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.manager.as_deref() == Some(FIELD_MANAGER) && m.operation.as_deref() == Some("Apply")
        })
        .collect();
    assert!(
        !managers.is_empty(),
        "{what}: status is not owned by field manager {FIELD_MANAGER}"
    );
    // A status patch does not bump the generation: it is not a spec change.
    assert_eq!(patched.meta().generation, Some(1), "{what}");

    let listed = api.list(&ListParams::default()).await?;
    assert!(
        listed.items.iter().any(|o| o.name_any() == name),
        "{what} is not listed"
    );

    api.delete(&name, &DeleteParams::default()).await?;

    let mut events = Vec::new();
    let mut watch = watch;
    tokio::time::timeout(WAIT, async {
        while let Some(event) = watch.try_next().await? {
            let done = matches!(event, WatchEvent::Deleted(_));
            events.push(match event {
                WatchEvent::Added(_) => "Added",
                WatchEvent::Modified(_) => "Modified",
                WatchEvent::Deleted(_) => "Deleted",
                WatchEvent::Bookmark(_) => "Bookmark",
                WatchEvent::Error(e) => panic!("{what}: watch error {e:?}"),
            });
            if done {
                break;
            }
        }
        anyhow::Ok(())
    })
    .await
    .map_err(|_| anyhow::anyhow!("{what}: watch saw only {events:?} within {WAIT:?}"))??;
    assert_eq!(events.first(), Some(&"Added"), "{what}: {events:?}");
    assert!(
        events.contains(&"Modified"),
        "{what}: the status patch was not seen: {events:?}"
    );
    assert_eq!(events.last(), Some(&"Deleted"), "{what}: {events:?}");
    Ok(())
}

fn namespaced<K>(client: &Client, ns: &str) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    Api::namespaced(client.clone(), ns)
}

#[tokio::test]
async fn namespaced_kinds_round_trip() -> anyhow::Result<()> {
    let cp = control_plane();
    let client = cp.client().await?;
    let ns = cp.namespace(&client, "kinds").await?;

    round_trip(
        namespaced::<Model>(&client, &ns),
        fixtures::model("smollm2"),
        json!({
            "architecture": "llama", "layers": 30, "hiddenSize": 576, "attentionHeads": 9,
            "kvHeads": 3, "layerBytes": [3_000_000, 3_000_000], "kvBytesPerToken": 23040,
            "observedGeneration": 1, "conditions": [condition("Resolved", "HeaderRead")],
        }),
    )
    .await?;

    round_trip(
        namespaced::<ModelDeployment>(&client, &ns),
        fixtures::deployment("chat", "smollm2", "daily", "whole"),
        json!({
            "replicas": 1, "readyReplicas": 1, "selector": "shardplane.dev/deployment=chat",
            "instances": [{"index": 0, "ready": true, "stages": [
                {"shard": "chat-0-0", "node": "mac-1", "layers": {"start": 0, "end": 30}, "phase": "Ready"}]}],
            "observedGeneration": 1,
            "conditions": [condition("Ready", "InstancesReady"), condition("Placed", "Planned")],
        }),
    )
    .await?;

    round_trip(
        namespaced::<Shard>(&client, &ns),
        fixtures::shard("chat", "mac-1", 0, 2, LayerRange { start: 0, end: 15 }),
        json!({
            "phase": "Downloading", "downloadedBytes": 1024, "totalBytes": 98_000_000,
            "endpoint": "10.0.0.1:7070", "engine": "candle", "observedGeneration": 1,
        }),
    )
    .await
}

#[tokio::test]
async fn cluster_kinds_round_trip() -> anyhow::Result<()> {
    let client = control_plane().client().await?;

    round_trip(
        Api::<NodePool>::all(client.clone()),
        fixtures::node_pool(&unique_name("pool"), Tier::Reasoning),
        json!({"nodes": ["mac-1", "mac-2"], "nodeCount": 2, "readyNodes": 1,
               "allocatableMemory": "48Gi", "conditions": [condition("Ready", "NodesReady")]}),
    )
    .await?;

    round_trip(
        Api::<InferenceNode>::all(client.clone()),
        fixtures::inference_node(&unique_name("mac")),
        json!({
            "chip": "Apple M4 Max", "os": "macos", "arch": "aarch64", "accelerator": "metal",
            "memory": {"total": "64Gi", "allocatable": "56Gi", "available": "50Gi"},
            "engines": ["mlx", "candle"],
            "addresses": [{"address": "169.254.1.2", "interface": "bridge0", "kind": "thunderbolt"}],
            "links": [{"node": "mac-2", "address": "169.254.1.3", "kind": "thunderbolt",
                       "latencyMicros": 80, "bandwidthMbps": 40000, "rdma": true,
                       "measuredAt": "2026-01-02T03:04:05Z"}],
            "conditions": [condition("Ready", "LeaseRenewed")],
        }),
    )
    .await?;

    // ShardingStrategy has no status: create, list, watch and delete it.
    let api = Api::<ShardingStrategy>::all(client);
    let name = unique_name("strategy");
    api.create(
        &PostParams::default(),
        &fixtures::strategy(&name, Parallelism::Pipeline),
    )
    .await?;
    let got = api.get(&name).await?;
    assert_eq!(
        got.spec.placement,
        PlacementPolicy::MemoryWeighted,
        "the default placement is filled in"
    );
    api.delete(&name, &DeleteParams::default()).await?;
    Ok(())
}

#[tokio::test]
async fn kubectl_scale_changes_replicas_through_the_scale_subresource() -> anyhow::Result<()> {
    let cp = control_plane();
    let client = cp.client().await?;
    let ns = cp.namespace(&client, "scale").await?;
    let api = namespaced::<ModelDeployment>(&client, &ns);
    api.create(
        &PostParams::default(),
        &fixtures::deployment("chat", "m", "p", "s"),
    )
    .await?;
    let status = json!({"apiVersion": "shardplane.dev/v1alpha1", "kind": "ModelDeployment",
                        "status": {"replicas": 1, "readyReplicas": 1, "selector": "shardplane.dev/deployment=chat",
                                   "endpoint": {"url": "http://gw.example:8080/v1", "model": "chat-model"}}});
    api.patch_status(
        "chat",
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&status),
    )
    .await?;
    // `kubectl get mdep` says where to send requests.
    let listed = cp.kubectl(&["get", "mdep", "-n", &ns])?;
    assert!(
        listed.contains("URL")
            && listed.contains("http://gw.example:8080/v1")
            && listed.contains("chat-model"),
        "{listed}"
    );

    cp.kubectl(&["scale", "-n", &ns, "modeldeployment/chat", "--replicas=3"])?;
    assert_eq!(api.get("chat").await?.spec.replicas, 3);
    let scale = api.get_scale("chat").await?;
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(3));
    let scale_status = scale.status.expect("scale has a status");
    assert_eq!(scale_status.replicas, 1);
    assert_eq!(
        scale_status.selector.as_deref(),
        Some("shardplane.dev/deployment=chat")
    );

    cp.kubectl(&["scale", "-n", &ns, "mdep/chat", "--replicas=0"])?;
    assert_eq!(
        api.get("chat").await?.spec.replicas,
        0,
        "scaling to zero is allowed"
    );
    Ok(())
}

#[tokio::test]
async fn kubectl_get_shows_printer_columns_and_the_category() -> anyhow::Result<()> {
    let cp = control_plane();
    let client = cp.client().await?;
    let ns = cp.namespace(&client, "columns").await?;
    let shards = namespaced::<Shard>(&client, &ns);
    shards
        .create(
            &PostParams::default(),
            &fixtures::shard("chat", "mac-2", 1, 2, LayerRange { start: 15, end: 30 }),
        )
        .await?;
    let status = json!({"apiVersion": "shardplane.dev/v1alpha1", "kind": "Shard",
                        "status": {"phase": "Downloading", "endpoint": "10.0.0.2:7070",
                                   "downloadedBytes": 1048576, "totalBytes": 4194304}});
    shards
        .patch_status(
            "chat-0-1",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&status),
        )
        .await?;
    namespaced::<Model>(&client, &ns)
        .create(&PostParams::default(), &fixtures::model("smollm2-135m"))
        .await?;

    let out = cp.kubectl(&["get", "shards", "-n", &ns])?;
    let mut lines = out.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "MODEL",
            "NODE",
            "STAGE",
            "RANK",
            "FROM",
            "TO",
            "PHASE",
            "RESTARTS",
            "DOWNLOADED",
            "OF",
            "AGE"
        ],
        "{out}"
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..7],
        [
            "chat-0-1",
            "smollm2-135m",
            "mac-2",
            "1",
            "15",
            "30",
            "Downloading"
        ],
        "{out}"
    );
    // Download progress, in bytes.
    assert!(out.contains("1048576") && out.contains("4194304"), "{out}");

    let wide = cp.kubectl(&["get", "shd", "-n", &ns, "-o", "wide"])?;
    assert!(
        wide.contains("ENDPOINT") && wide.contains("10.0.0.2:7070"),
        "{wide}"
    );

    let all = cp.kubectl(&["get", "shardplane", "-n", &ns])?;
    for kind in [
        "model.shardplane.dev/smollm2-135m",
        "shard.shardplane.dev/chat-0-1",
    ] {
        assert!(
            all.contains(kind),
            "`kubectl get shardplane` misses {kind}:\n{all}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn kubectl_explain_shows_the_field_docs() -> anyhow::Result<()> {
    let out = control_plane().kubectl(&["explain", "modeldeployment.spec"])?;
    for words in [
        "Name of the Model to serve",
        "Name of the NodePool to place it on",
        "Where requests go, in order, when no instance",
    ] {
        assert!(
            out.contains(words),
            "`kubectl explain` misses {words:?}:\n{out}"
        );
    }
    let out = control_plane().kubectl(&["explain", "shard.status.phase"])?;
    assert!(out.contains("Pending"), "{out}");
    Ok(())
}

#[tokio::test]
async fn quickstart_is_clean_under_server_dry_run() -> anyhow::Result<()> {
    let cp = control_plane();
    let client = cp.client().await?;
    let ns = cp.namespace(&client, "quickstart").await?;
    let dir = shardplane_testkit::repo_root().join("manifests/quickstart");
    let dir = dir.to_str().expect("utf-8 path");
    let out = cp.kubectl_output(&["apply", "--dry-run=server", "-n", &ns, "-f", dir], "")?;
    assert!(
        out.success && out.stderr.trim().is_empty(),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    assert_eq!(
        out.stdout.matches("(server dry run)").count(),
        7,
        "{}",
        out.stdout
    );
    Ok(())
}

/// Applies `yaml` with kubectl and expects the API server to refuse it with all of `words`.
fn assert_refused(ns: &str, yaml: &str, words: &[&str]) -> anyhow::Result<()> {
    let out = control_plane().kubectl_output(&["apply", "-n", ns, "-f", "-"], yaml)?;
    assert!(!out.success, "the server accepted:\n{yaml}\n{}", out.stdout);
    for w in words {
        assert!(
            out.stderr.contains(w),
            "expected {w:?} in the refusal: {}",
            out.stderr
        );
    }
    Ok(())
}

#[tokio::test]
async fn bad_input_is_refused_by_the_schema_or_reported_by_validate() -> anyhow::Result<()> {
    let cp = control_plane();
    let client = cp.client().await?;
    let ns = cp.namespace(&client, "bad").await?;

    assert_refused(
        &ns,
        "apiVersion: shardplane.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: neg}\n\
         spec: {model: m, nodePool: p, strategy: s, replicas: -1}\n",
        &["spec.replicas", "greater than or equal to 0"],
    )?;
    // Counts past their bounds (`limits`) are refused at apply time, so no
    // controller ever sees them.
    assert_refused(
        &ns,
        "apiVersion: shardplane.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: huge}\n\
         spec: {model: m, nodePool: p, strategy: s, replicas: 2147483647}\n",
        &["spec.replicas", "less than or equal to 1024"],
    )?;
    let aliases: Vec<String> = (0..=limits::MAX_ALIASES).map(|i| format!("a{i}")).collect();
    assert_refused(
        &ns,
        &format!(
            "apiVersion: shardplane.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {{name: many}}\n\
             spec: {{model: m, nodePool: p, strategy: s, aliases: [{}]}}\n",
            aliases.join(", ")
        ),
        &["spec.aliases", "should have at most 64 items"],
    )?;
    let wide = unique_name("wide");
    assert_refused(
        &ns,
        &format!(
            "apiVersion: shardplane.dev/v1alpha1\nkind: ShardingStrategy\nmetadata: {{name: {wide}}}\n\
             spec: {{parallelism: pipeline, maxNodes: 100000, \
             kvCache: {{contextLength: 4294967295, concurrentSequences: 1000000}}}}\n"
        ),
        &[
            "spec.maxNodes",
            "spec.kvCache.contextLength",
            "spec.kvCache.concurrentSequences",
        ],
    )?;
    assert_refused(
        &ns,
        "apiVersion: shardplane.dev/v1alpha1\nkind: Model\nmetadata: {name: long}\n\
         spec: {format: gguf, source: {path: {path: /m.gguf}}, maxContextLength: 4000000000}\n",
        &["spec.maxContextLength", "less than or equal to 16777216"],
    )?;
    let pool = unique_name("weekly");
    assert_refused(
        &ns,
        &format!(
            "apiVersion: shardplane.dev/v1alpha1\nkind: NodePool\nmetadata: {{name: {pool}}}\nspec: {{tier: weekly}}\n"
        ),
        &[
            "spec.tier",
            "Unsupported value: \"weekly\"",
            "\"daily\", \"reasoning\"",
        ],
    )?;
    assert_refused(
        &ns,
        "apiVersion: shardplane.dev/v1alpha1\nkind: Model\nmetadata: {name: two}\nspec:\n  format: gguf\n  source:\n    \
         path: {path: /m.gguf}\n    url: {url: 'http://host.invalid/m.gguf'}\n",
        &[
            "spec.source",
            "must validate one and only one schema (oneOf)",
            "Found 2 valid alternatives",
        ],
    )?;
    assert_refused(
        &ns,
        "apiVersion: shardplane.dev/v1alpha1\nkind: Model\nmetadata: {name: none}\nspec: {format: gguf, source: {}}\n",
        &["spec.source", "Found none valid"],
    )?;
    assert_refused(
        &ns,
        "apiVersion: shardplane.dev/v1alpha1\nkind: Model\nmetadata: {name: missing}\nspec: {format: gguf}\n",
        // kubectl's own schema check refuses this one before it reaches the server.
        &["missing required field \"source\""],
    )?;

    // start < end needs a CEL rule, which this API server generation ignores: the
    // server stores the Shard and validate() (run by the operator and agent) reports it.
    let reversed = "apiVersion: shardplane.dev/v1alpha1\nkind: Shard\nmetadata: {name: reversed}\nspec:\n  \
        deployment: d\n  model: m\n  source: {path: {path: /m.gguf}}\n  format: gguf\n  node: mac-1\n  \
        stage: 1\n  stageCount: 2\n  previous: d-0-0\n  layers: {start: 30, end: 15}\n  totalLayers: 30\n  \
        kvCache: {contextLength: 4096, concurrentSequences: 1}\n";
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], reversed)?;
    let stored = namespaced::<Shard>(&client, &ns).get("reversed").await?;
    use shardplane_crds::validation::Validate;
    let errors = stored.validate().expect_err("a reversed range is invalid");
    assert!(errors.has_path("spec.layers"), "{errors}");
    assert!(
        errors
            .to_string()
            .contains("layer range 30-15 is empty or reversed"),
        "{errors}"
    );
    Ok(())
}
