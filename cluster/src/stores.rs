//! Watch-fed caches of cluster objects: a reflector on a task of its own,
//! retrying with backoff.

use futures::{Stream, StreamExt};
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt, reflector, watcher};

/// A kind a watch can cache: what kube's reflectors need of it.
pub trait Watched:
    kube::Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Every object of kind `K` in the cluster, kept current by a watch on a task
/// of its own (retrying with backoff): the cache agents and the gateway look
/// Shards, nodes and deployments up in.
pub fn watch_all<K: Watched>(client: kube::Client) -> (Store<K>, tokio::task::JoinHandle<()>) {
    let (reader, writer) = reflector::store();
    let api: kube::Api<K> = kube::Api::all(client);
    let task = tokio::spawn(run_watch::<K>(
        watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer),
    ));
    (reader, task)
}

/// Runs a watch (one that retries with backoff) for as long as it goes on,
/// logging each failure with the kind watched.
pub async fn run_watch<K>(events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>)
where
    K: kube::Resource<DynamicType = ()>,
{
    events
        .for_each(|e| {
            if let Err(e) = e {
                tracing::warn!(kind = %K::kind(&()), error = %e, "watch failed; retrying");
            }
            std::future::ready(())
        })
        .await;
}
