//! The router's choice of deployment for a name, over in-memory stores.

use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::Event;

use super::*;

fn store<K>(objects: Vec<K>) -> Store<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let mut writer = Writer::default();
    for o in objects {
        writer.apply_watcher_event(&Event::Apply(o));
    }
    writer.as_reader()
}

fn deployment(ns: &str, name: &str, created: i64, aliases: &[&str]) -> ModelDeployment {
    let mut d = ModelDeployment::new(
        name,
        serde_json::from_value(serde_json::json!({
            "model": "m", "nodePool": "p", "strategy": "s", "aliases": aliases
        }))
        .unwrap(),
    );
    d.metadata.namespace = Some(ns.into());
    d.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
    ));
    d
}

fn model(ns: &str, served: &str) -> Model {
    let mut m = Model::new(
        "m",
        serde_json::from_value(serde_json::json!({
            "servedName": served, "format": "gguf", "source": {"path": {"path": "/m.gguf"}}
        }))
        .unwrap(),
    );
    m.metadata.namespace = Some(ns.into());
    m
}

#[tokio::test]
async fn a_name_goes_to_its_oldest_claimant_whatever_the_namespaces_are_called() {
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let router = Router::new(
        client,
        store(vec![
            deployment("prod", "llm", 100, &["coder"]),
            // Created later, in a namespace that sorts first.
            deployment("aaa", "intruder", 200, &["coder", "free"]),
        ]),
        store(vec![model("prod", "smol"), model("aaa", "smol")]),
        store(Vec::new()),
        dp::Token::new("a-token-long-enough-for-tests").unwrap(),
        reqwest::Client::new(),
        Metrics::new(),
    );
    let owner = |name: &str| {
        router.deployment_for(name).map(|d| {
            format!(
                "{}/{}",
                d.metadata.namespace.clone().unwrap_or_default(),
                d.metadata.name.clone().unwrap_or_default()
            )
        })
    };
    assert_eq!(owner("coder").as_deref(), Some("prod/llm"));
    assert_eq!(owner("smol").as_deref(), Some("prod/llm"));
    assert_eq!(owner("free").as_deref(), Some("aaa/intruder"));
    let listed: Vec<(String, String)> = router
        .served()
        .into_iter()
        .map(|s| (s.name, s.deployment))
        .collect();
    assert!(
        listed.contains(&("coder".into(), "prod/llm".into())),
        "{listed:?}"
    );
    assert!(
        listed.contains(&("smol".into(), "prod/llm".into())),
        "{listed:?}"
    );
}

/// Shard `name` of instance `instance`, stage `stage` of `count`, naming
/// `next`, in `phase`.
fn stage(
    name: &str,
    instance: u32,
    stage: u32,
    count: u32,
    next: Option<&str>,
    phase: ShardPhase,
) -> Arc<Shard> {
    let layers = shardplane_crds::LayerRange {
        start: stage * 10,
        end: stage * 10 + 10,
    };
    let mut s = shardplane_testkit::fixtures::shard("d", "n", stage, count, layers);
    s.metadata.name = Some(name.into());
    s.spec.instance = instance;
    s.spec.next = next.map(String::from);
    s.status = Some(shardplane_crds::ShardStatus {
        phase: Some(phase),
        endpoint: Some("127.0.0.1:1".into()),
        ..Default::default()
    });
    Arc::new(s)
}

#[test]
fn an_instance_is_the_chain_its_head_names() {
    use ShardPhase::*;
    let heads = |shards: &[Arc<Shard>]| -> Vec<String> {
        let mut v: Vec<String> = ready_heads(shards)
            .into_iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        v.sort();
        v
    };
    // A daily instance whose old Shard is kept (Unknown) beside its Ready
    // replacement: the replacement answers.
    let kept = [
        stage("old", 0, 0, 1, None, Unknown),
        stage("new", 0, 0, 1, None, Ready),
    ];
    assert_eq!(heads(&kept), ["new"]);
    // Both Ready for a moment: either may answer.
    let both = [
        stage("old", 0, 0, 1, None, Ready),
        stage("new", 0, 0, 1, None, Ready),
    ];
    assert_eq!(heads(&both), ["new", "old"]);
    // A pipeline whose second stage moved: the head names the new one, which
    // is still loading, so the instance waits although the old one is Ready.
    let moving = [
        stage("h", 0, 0, 2, Some("s1-new"), Ready),
        stage("s1-old", 0, 1, 2, None, Ready),
        stage("s1-new", 0, 1, 2, None, Loading),
    ];
    assert!(heads(&moving).is_empty());
    let moved = [
        stage("h", 0, 0, 2, Some("s1-new"), Ready),
        stage("s1-old", 0, 1, 2, None, Unknown),
        stage("s1-new", 0, 1, 2, None, Ready),
    ];
    assert_eq!(heads(&moved), ["h"]);
    // A chain must be whole: a stage missing, or one of another instance.
    assert!(heads(&[stage("h", 0, 0, 2, Some("gone"), Ready)]).is_empty());
    let crossed = [
        stage("h", 0, 0, 2, Some("other"), Ready),
        stage("other", 1, 1, 2, None, Ready),
    ];
    assert!(heads(&crossed).is_empty());
}

#[test]
fn an_instance_is_another_incarnation_once_re_placed_or_restarted_not_while_it_serves() {
    use shardplane_crds::{LayerRange, ShardPhase, ShardStatus};
    let stage = |s: u32, node: &str| {
        let mut shard = shardplane_testkit::fixtures::shard(
            "d",
            node,
            s,
            2,
            LayerRange {
                start: 15 * s,
                end: 15 * (s + 1),
            },
        );
        shard.metadata.uid = Some(format!("uid-{s}"));
        shard.metadata.generation = Some(1);
        shard.status = Some(ShardStatus {
            phase: Some(ShardPhase::Ready),
            ..Default::default()
        });
        shard
    };
    let of =
        |shards: Vec<Shard>| incarnation(&shards.into_iter().map(Arc::new).collect::<Vec<_>>(), 0);
    let serving = of(vec![stage(0, "a"), stage(1, "b")]);
    // Status other than restarts, and other instances, do not count.
    let mut busy = stage(1, "b");
    busy.status.as_mut().unwrap().kv_budget_tokens = Some(7);
    let mut other = stage(1, "z");
    other.spec.instance = 1;
    assert_eq!(of(vec![stage(0, "a"), busy, other]), serving);
    // A stage moved to another node, edited, re-created or restarted does.
    let mut edited = stage(1, "b");
    edited.metadata.generation = Some(2);
    let mut recreated = stage(1, "b");
    recreated.metadata.uid = Some("uid-new".into());
    let mut restarted = stage(1, "b");
    restarted.status.as_mut().unwrap().restarts = Some(1);
    for changed in [stage(1, "c"), edited, recreated, restarted] {
        assert_ne!(of(vec![stage(0, "a"), changed]), serving);
    }
}
