//! What the operator knows of the cluster: one watch per kind, reflected
//! into a store every controller reads, and fanned out to the controllers
//! it triggers. A reconcile reads these stores; it never LISTs.
//!
//! ```text
//!  watch Model ──────────► store ─┬─► model controller
//!  watch InferenceNode ──► store ─┼─► node, node-pool, deployment controllers
//!  watch Lease (node ns) ► store ─┤
//!  watch NodePool ───────► store ─┤
//!  watch ShardingStrategy► store ─┤
//!  watch Shard ──────────► store ─┤
//!  watch ModelDeployment ► store ─┘
//! ```

use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::reflector::{self, ReflectHandle, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use shardplane_crds::{
    InferenceNode, Model, ModelDeployment, NODE_LEASE_NAMESPACE, NodePool, Shard, ShardingStrategy,
};

/// Events a subscriber may fall behind by before the watch waits for it.
const SUBSCRIBER_BUFFER: usize = 1024;

/// One kind's store, and its writer until the watch starts.
pub struct Cached<K: Resource<DynamicType = ()> + Clone + 'static> {
    /// The objects, as the watch last saw them.
    pub store: Store<K>,
    writer: Option<Writer<K>>,
}

impl<K> Cached<K>
where
    K: shardplane_cluster::Watched,
{
    fn new() -> Self {
        let (store, writer) = reflector::store_shared(SUBSCRIBER_BUFFER);
        Cached {
            store,
            writer: Some(writer),
        }
    }

    /// A stream of the objects as they change, for a controller's trigger.
    /// Every subscriber must be polled (the watch waits for the slowest), and
    /// all subscribe before [`Caches::start`].
    pub fn subscribe(&self) -> ReflectHandle<K> {
        self.writer
            .as_ref()
            .and_then(Writer::subscribe)
            .expect("subscribe before the watches start")
    }

    /// Starts the watch that fills the store and feeds the subscribers.
    fn watch(&mut self, api: Api<K>) -> tokio::task::JoinHandle<()> {
        let writer = self.writer.take().expect("watched once");
        tokio::spawn(shardplane_cluster::run_watch::<K>(
            watcher(api, watcher::Config::default())
                .default_backoff()
                .reflect_shared(writer),
        ))
    }
}

/// Every kind the operator reads.
pub struct Caches {
    /// Models.
    pub models: Cached<Model>,
    /// InferenceNodes.
    pub nodes: Cached<InferenceNode>,
    /// The nodes' Leases.
    pub leases: Cached<Lease>,
    /// NodePools.
    pub pools: Cached<NodePool>,
    /// ShardingStrategies.
    pub strategies: Cached<ShardingStrategy>,
    /// Shards.
    pub shards: Cached<Shard>,
    /// ModelDeployments.
    pub deployments: Cached<ModelDeployment>,
    watches: Vec<tokio::task::JoinHandle<()>>,
}

impl Caches {
    /// Stores for every kind, not yet watched: controllers subscribe, then
    /// [`Caches::start`] starts the watches, so no event is missed.
    pub fn new() -> Self {
        Caches {
            models: Cached::new(),
            nodes: Cached::new(),
            leases: Cached::new(),
            pools: Cached::new(),
            strategies: Cached::new(),
            shards: Cached::new(),
            deployments: Cached::new(),
            watches: Vec::new(),
        }
    }

    /// Starts one watch per kind.
    pub fn start(&mut self, client: &Client) {
        self.watches = vec![
            self.models.watch(Api::all(client.clone())),
            self.nodes.watch(Api::all(client.clone())),
            self.leases
                .watch(Api::namespaced(client.clone(), NODE_LEASE_NAMESPACE)),
            self.pools.watch(Api::all(client.clone())),
            self.strategies.watch(Api::all(client.clone())),
            self.shards.watch(Api::all(client.clone())),
            self.deployments.watch(Api::all(client.clone())),
        ];
    }

    /// The stores only (what reconciles read).
    pub fn stores(&self) -> Stores {
        Stores {
            models: self.models.store.clone(),
            nodes: self.nodes.store.clone(),
            leases: self.leases.store.clone(),
            pools: self.pools.store.clone(),
            strategies: self.strategies.store.clone(),
            shards: self.shards.store.clone(),
            deployments: self.deployments.store.clone(),
        }
    }
}

impl Default for Caches {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Caches {
    fn drop(&mut self) {
        for w in &self.watches {
            w.abort();
        }
    }
}

/// Read handles on every cached kind.
#[derive(Clone)]
pub struct Stores {
    /// Models.
    pub models: Store<Model>,
    /// InferenceNodes.
    pub nodes: Store<InferenceNode>,
    /// The nodes' Leases.
    pub leases: Store<Lease>,
    /// NodePools.
    pub pools: Store<NodePool>,
    /// ShardingStrategies.
    pub strategies: Store<ShardingStrategy>,
    /// Shards.
    pub shards: Store<Shard>,
    /// ModelDeployments.
    pub deployments: Store<ModelDeployment>,
}

impl Stores {
    /// Waits until every store has its first full listing (at once after
    /// that). A reconcile that read a store still filling would see, say,
    /// a deployment's Shards but none of its nodes, and delete them.
    pub async fn ready(&self) {
        let _ = futures::join!(
            self.models.wait_until_ready(),
            self.nodes.wait_until_ready(),
            self.leases.wait_until_ready(),
            self.pools.wait_until_ready(),
            self.strategies.wait_until_ready(),
            self.shards.wait_until_ready(),
            self.deployments.wait_until_ready(),
        );
    }
}

/// Every object in `store`, as references for a controller that reconciles
/// all of them when something they all depend on changes.
pub fn all_of<K>(store: &Store<K>) -> Vec<reflector::ObjectRef<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    store
        .state()
        .iter()
        .map(|o| reflector::ObjectRef::from_obj(o.as_ref()))
        .collect()
}
