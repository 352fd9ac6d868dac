//! Observe: everything a deployment's reconcile reads, taken from the
//! watch-fed stores (no API call).

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use shardplane_crds::{
    InferenceNode, Model, ModelDeployment, NodePool, Shard, ShardingStrategy, names,
};

use crate::caches::Stores;

/// What a reconcile reads.
pub struct Observed {
    /// The Model the deployment names.
    pub model: Option<Arc<Model>>,
    /// The NodePool it names.
    pub pool: Option<Arc<NodePool>>,
    /// The ShardingStrategy it names.
    pub strategy: Option<Arc<ShardingStrategy>>,
    /// Every InferenceNode.
    pub nodes: Vec<Arc<InferenceNode>>,
    /// Every Shard (other deployments' take room on shared nodes).
    pub shards: Vec<Arc<Shard>>,
    /// Every Model, by `(namespace, name)` (to size other deployments' Shards).
    pub models: BTreeMap<(String, String), Arc<Model>>,
    /// Every other deployment, with the names it claims (served name and
    /// aliases; see `shardplane_crds::names`).
    pub claims: Vec<(Arc<ModelDeployment>, Vec<String>)>,
}

impl Observed {
    /// The deployment's own Shards.
    pub fn mine<'a>(&'a self, d: &ModelDeployment) -> Vec<&'a Shard> {
        let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
        self.shards
            .iter()
            .filter(|s| s.namespace().as_deref() == Some(ns.as_str()) && s.spec.deployment == name)
            .map(|s| s.as_ref())
            .collect()
    }
}

/// Reads what `d`'s reconcile needs from the stores.
pub fn observe(d: &ModelDeployment, stores: &Stores) -> Observed {
    let ns = d.namespace().unwrap_or_default();
    let models: BTreeMap<(String, String), Arc<Model>> = stores
        .models
        .state()
        .into_iter()
        .map(|m| ((m.namespace().unwrap_or_default(), m.name_any()), m))
        .collect();
    let served_name = |o: &ModelDeployment| {
        models
            .get(&(o.namespace().unwrap_or_default(), o.spec.model.clone()))
            .map(|m| m.served_name().to_string())
    };
    let claims = stores
        .deployments
        .state()
        .into_iter()
        .filter(|o| o.namespace() != d.namespace() || o.name_any() != d.name_any())
        .map(|o| {
            let names = names::claims(&o, served_name(&o).as_deref());
            (o, names)
        })
        .collect();
    Observed {
        model: models.get(&(ns, d.spec.model.clone())).cloned(),
        pool: stores.pools.get(&ObjectRef::new(&d.spec.node_pool)),
        strategy: stores.strategies.get(&ObjectRef::new(&d.spec.strategy)),
        nodes: stores.nodes.state(),
        shards: stores.shards.state(),
        models,
        claims,
    }
}
