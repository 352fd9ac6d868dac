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
