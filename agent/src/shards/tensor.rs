//! Shards that are ranks of a tensor group: each agent loads its rank's
//! share, says where its group may reach it, waits until every rank has,
//! and joins them; rank 0 then serves the stage like any other, the others
//! follow it.
//!
//! ```text
//!  fetched ─► listen (kept while the agent runs the Shard) ─► load the share
//!    ─► Loading, status.tensorEndpoint = host:port
//!    ─► every rank's tensorEndpoint known (Shard directory) ─► join the mesh
//!    ─► rank 0: a TensorGroup behind the stage's worker    ─► Ready
//!       rank k: a thread running the leader's commands     ─► Ready
//!  the mesh fails (a rank gone, its leader left) ─► unloaded, Failed
//!    (TensorGroupBroken) ─► retried: the group forms again, with whoever
//!    the operator placed meanwhile
//! ```
//!
//! The mesh's peers prove they hold the cluster's data-plane token; what
//! they exchange (partial sums, commands) is not encrypted.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Client;
use kube::runtime::reflector::ObjectRef;
use shardplane_crds::{Shard, ShardPhase, ShardSpec, ShardStatus};
use shardplane_dataplane::collective::{Mesh, MeshConfig, MeshTls};
use shardplane_engine::Stage;
use shardplane_engine::pipeline::{TextModel, load_tensor_rank};
use shardplane_engine::tensor::TensorGroup;

use super::{Key, ShardSet, Sources, key, report_claimed};
use crate::cache::Failure;
use crate::metrics::Metrics;
use crate::tensor::{MeshFollowers, SharedMesh};

/// The longest a rank waits for the rest of its group to load and join.
const GROUP_WAIT: Duration = Duration::from_secs(600);
/// How often a leader looks whether a follower has gone while idle.
const IDLE_CHECK: Duration = Duration::from_secs(2);
/// The longest one attempt to join waits for a peer (every rank the same;
/// the closing ready exchange may take as long again and 5 s more).
const JOIN_ATTEMPT: Duration = Duration::from_secs(10);
/// The longest a joined rank waits for a peer's partial sums or reply.
const PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// A rank of a tensor group this agent runs.
pub(super) struct Rank {
    /// Its group's connections.
    pub mesh: SharedMesh,
    /// The Shard's spec when it was loaded.
    pub spec: ShardSpec,
    /// A follower's weights (a leader's are its worker's).
    pub follower_bytes: Option<usize>,
}

/// A loaded rank, joined to its group.
pub(super) enum Joined {
    /// Rank 0: serves the stage through its worker.
    Leads {
        stage: Box<dyn Stage>,
        text: Option<Arc<TextModel>>,
        mesh: SharedMesh,
        endpoint: String,
        /// The spec it joined as (its group may have changed meanwhile).
        spec: ShardSpec,
        /// The Shard's generation with that spec.
        generation: Option<i64>,
    },
    /// Another rank: to run the leader's commands (see [`follow`]).
    Follows {
        stage: Box<dyn Stage>,
        mesh: SharedMesh,
        endpoint: String,
        /// The spec it joined as.
        spec: ShardSpec,
        /// The Shard's generation with that spec.
        generation: Option<i64>,
    },
}

/// Loads the tensor rank `shard` names from the weights at `path` and joins
/// its group.
pub(super) async fn load_and_join(
    client: &Client,
    (shard, claim): (&Shard, super::Claim),
    shards: &ShardSet,
    sources: &Sources,
    path: std::path::PathBuf,
) -> Result<Joined, Failure> {
    let k = key(shard);
    let spec = shard.spec.clone();
    let t = spec.tensor.clone().ok_or_else(|| Failure {
        reason: "InvalidSpec",
        message: "not a tensor rank".into(),
    })?;
    let (listener, endpoint) = shards.mesh_listener(&k, claim).map_err(|e| Failure {
        reason: "TensorGroupIncomplete",
        message: format!("cannot listen for the tensor group: {e}"),
    })?;
    let mesh = SharedMesh::default();
    let collective = mesh.collective();
    let rank = t.rank as usize;
    let weights: Vec<f64> = t.weights.iter().map(|&w| f64::from(w)).collect();
    let loaded = tokio::task::spawn_blocking(move || {
        let (layout, options) = super::layout_and_options(&spec, 0)?;
        let (stage, text) = load_tensor_rank(&path, layout, &options, &weights, rank, collective)?;
        let text = super::with_template(text, &spec)?.map(Arc::new);
        Ok::<_, shardplane_engine::Error>((stage, text))
    })
    .await
    .map_err(|e| Failure {
        reason: "LoadPanicked",
        message: e.to_string(),
    })?
    .map_err(super::load_failure)?;
    let (stage, text) = loaded;
    let waiting = ShardStatus {
        phase: Some(ShardPhase::Loading),
        reason: Some("JoiningTensorGroup".into()),
        message: Some(format!(
            "rank {rank} of {} loaded; waiting for every rank to join",
            t.weights.len()
        )),
        tensor_endpoint: Some(endpoint.clone()),
        observed_generation: shard.metadata.generation,
        ..Default::default()
    };
    report_claimed(client, shards, (&k, claim), waiting);
    let (joined, spec, generation) = join(shard, listener, sources).await?;
    mesh.set(Some(joined));
    if rank == 0 {
        // Between requests nothing is read: a dead follower is looked for.
        if let Err(e) = mesh.watch_idle(IDLE_CHECK) {
            tracing::warn!(shard = %k.1, error = %e, "cannot watch the idle tensor group; a lost rank is found at the next request");
        }
        let followers = MeshFollowers::new(mesh.clone(), t.weights.len());
        return Ok(Joined::Leads {
            stage: Box::new(TensorGroup::led(stage, Box::new(followers))),
            text,
            mesh,
            endpoint,
            spec,
            generation,
        });
    }
    Ok(Joined::Follows {
        stage,
        mesh,
        endpoint,
        spec,
        generation,
    })
}

/// Runs the leader's commands on `stage` on a thread of its own until the
/// leader leaves or the mesh fails; either marks `mesh` broken.
pub(super) fn follow(
    mut stage: Box<dyn Stage>,
    mesh: SharedMesh,
    shard: &str,
) -> std::io::Result<()> {
    let name = shard.to_string();
    let rank = mesh.rank();
    std::thread::Builder::new()
        .name(format!("tensor-rank-{rank}"))
        .spawn(move || {
            let why = match crate::tensor::follow(stage.as_mut(), &mesh) {
                Ok(()) => "the group's leader left".to_string(),
                Err(e) => e.to_string(),
            };
            tracing::info!(shard = %name, why, "tensor rank stopped following");
            mesh.break_with(&why);
        })
        .map(drop)
}

/// Joins the group of the rank `shard` is once every rank of it says where
/// it listens, trying again (with what the ranks say then) until
/// [`GROUP_WAIT`] passes. A rank counts only when its Shard names the same
/// group, weights and layers (an earlier placement's rank does not) and its
/// node is not lost. When the Shard's group changes meanwhile (a lost rank
/// placed elsewhere) and nothing else does, the new group is joined; any
/// other change, or the Shard going, ends the wait. Returns the mesh, and
/// the spec it joined as with the Shard's generation then.
async fn join(
    shard: &Shard,
    listener: Arc<TcpListener>,
    sources: &Sources,
) -> Result<(Mesh, ShardSpec, Option<i64>), Failure> {
    let k = key(shard);
    let mut spec = shard.spec.clone();
    let mut generation = shard.metadata.generation;
    let deadline = Instant::now() + GROUP_WAIT;
    let incomplete = |why: String| Failure {
        reason: "TensorGroupIncomplete",
        message: why,
    };
    let mut last = String::from("no rank has said where it listens");
    while Instant::now() < deadline {
        let own = sources.directory.get(&ObjectRef::new(&k.1).within(&k.0));
        match own {
            Some(now) if now.spec == spec => {}
            Some(now) if only_group_changed(&spec, &now.spec) => {
                tracing::info!(shard = %k.1, "the tensor group changed; joining the new one");
                spec = now.spec.clone();
                generation = now.metadata.generation;
            }
            _ => {
                return Err(incomplete(
                    "the Shard changed (or went) while its tensor group formed".into(),
                ));
            }
        }
        let Some(t) = spec.tensor.clone() else {
            return Err(incomplete("not a tensor rank".into()));
        };
        let peers: Result<Vec<(String, String)>, String> = t
            .group
            .iter()
            .map(|name| peer_endpoint(sources, &k.0, name, &spec))
            .collect();
        let (endpoints, nodes): (Vec<String>, Vec<String>) = match peers {
            Ok(p) => p.into_iter().unzip(),
            Err(why) => {
                last = why;
                tokio::time::sleep(Duration::from_millis(250)).await;
                continue;
            }
        };
        // With TLS on the data plane, the mesh runs it too: each rank's
        // certificate must name the node its Shard is bound to.
        let tls = match &sources.tls {
            Some(tls) => Some(MeshTls::new(tls, nodes).map_err(|e| Failure {
                reason: "CertificateUnusable",
                message: format!("the tensor group's TLS: {e}"),
            })?),
            None => None,
        };
        let config = MeshConfig {
            group: group_id(&k.0, &spec),
            rank: t.rank as usize,
            addresses: Vec::new(),
            token: sources.token.clone(),
            timeout: JOIN_ATTEMPT,
            tls,
        };
        let listener = listener.clone();
        let attempt = tokio::task::spawn_blocking(move || {
            let addresses = endpoints
                .iter()
                .map(|e| resolve(e))
                .collect::<Result<Vec<_>, _>>()?;
            let mut mesh = Mesh::join(
                &listener,
                &MeshConfig {
                    addresses,
                    ..config
                },
            )
            .map_err(|e| e.to_string())?;
            mesh.set_timeout(PEER_TIMEOUT).map_err(|e| e.to_string())?;
            Ok::<_, String>(mesh)
        })
        .await
        .map_err(|e| incomplete(e.to_string()))?;
        match attempt {
            Ok(mesh) => return Ok((mesh, spec, generation)),
            Err(why) => {
                tracing::info!(shard = %k.1, why, "the tensor group did not form; trying again");
                last = why;
            }
        }
    }
    Err(incomplete(format!(
        "the tensor group did not form within {GROUP_WAIT:?}: {last}"
    )))
}

/// Whether `now` differs from `was` in its tensor group's members alone
/// (the same rank, weights, layers and weights' source: what was loaded
/// still holds).
fn only_group_changed(was: &ShardSpec, now: &ShardSpec) -> bool {
    let (Some(a), Some(b)) = (&was.tensor, &now.tensor) else {
        return false;
    };
    let mut same = now.clone();
    if let Some(t) = same.tensor.as_mut() {
        t.group.clone_from(&a.group);
    }
    a.group.len() == b.group.len() && same == *was
}

/// Where rank Shard `name` of the group `mine` names listens, and its node,
/// when it belongs to the same group and its node is not lost.
fn peer_endpoint(
    sources: &Sources,
    ns: &str,
    name: &str,
    mine: &ShardSpec,
) -> Result<(String, String), String> {
    let peer = sources
        .directory
        .get(&ObjectRef::new(name).within(ns))
        .ok_or_else(|| format!("rank Shard {name} does not exist (yet)"))?;
    let theirs = &peer.spec;
    let same_group = match (&mine.tensor, &theirs.tensor) {
        (Some(a), Some(b)) => a.group == b.group && a.weights == b.weights,
        _ => false,
    };
    if !same_group
        || theirs.layers != mine.layers
        || theirs.deployment != mine.deployment
        || theirs.source != mine.source
    {
        return Err(format!("rank Shard {name} belongs to another tensor group"));
    }
    let status = peer.status.as_ref();
    if status.and_then(|s| s.phase) == Some(ShardPhase::Unknown) {
        return Err(format!("rank Shard {name}'s node is lost"));
    }
    let endpoint = status
        .and_then(|s| s.tensor_endpoint.clone())
        .ok_or_else(|| format!("rank Shard {name} has not said where it listens"))?;
    Ok((endpoint, theirs.node.clone()))
}

/// The group's name on the wire: a digest of what makes it one group (its
/// namespace, every rank's Shard, the weights, the layers, the weights'
/// source), so that a rank of another placement that reuses a name is
/// refused.
fn group_id(ns: &str, spec: &ShardSpec) -> String {
    use sha2::{Digest, Sha256};
    let t = spec.tensor.as_ref();
    let text = format!(
        "{ns}|{:?}|{:?}|{}-{}|{:?}",
        t.map(|t| &t.group),
        t.map(|t| &t.weights),
        spec.layers.start,
        spec.layers.end,
        spec.source,
    );
    let digest = Sha256::digest(text.as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// `host:port` as an address.
fn resolve(endpoint: &str) -> Result<SocketAddr, String> {
    endpoint
        .to_socket_addrs()
        .map_err(|e| format!("{endpoint}: {e}"))?
        .next()
        .ok_or_else(|| format!("{endpoint} resolves to no address"))
}

/// The host of a data-plane endpoint (`scheme://host:port`).
pub(super) fn endpoint_host(endpoint: &str) -> &str {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Shard `k`'s tensor group broke (`mesh` is the [`SharedMesh::id`] of
/// the one that did): unless
/// another load replaced it meanwhile, its rank is unloaded and the Shard
/// fails (and is retried) like any failure.
pub(super) fn group_broken(
    client: &Client,
    k: Key,
    generation: Option<i64>,
    (mesh, why): (usize, String),
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    // The phase is read with the rank taken, under the rank lock: a load
    // that ends meanwhile sees either its rank or the phase it left.
    let (rank, phase) = {
        let mut ranks = shards.ranks.lock().expect("rank lock");
        let rank = match ranks.get(&k) {
            Some(r) if r.mesh.id() == mesh => ranks.remove(&k),
            _ => None,
        };
        let phase = shards.phases.lock().expect("phase lock").get(&k).copied();
        (rank, phase)
    };
    let Some(rank) = rank else {
        return;
    };
    release(&k, rank, shards, metrics, sources);
    // A load of the Shard is under way: it stands for the Shard. The rank
    // was the one it replaces (only let go of), or its own, just joined
    // (the load then finds its rank gone and fails the Shard).
    if matches!(phase, Some(ShardPhase::Downloading | ShardPhase::Loading)) {
        tracing::info!(shard = %k.1, why, "the replaced rank's group broke");
        return;
    }
    let f = Failure {
        reason: "TensorGroupBroken",
        message: format!("the tensor group broke: {why}"),
    };
    let f = (f, super::healing::Over::Ready);
    super::healing::fail_shard(client, k, generation, f, shards, metrics, sources);
}

/// Lets go of Shard `k`'s `rank`, taken out of the rank set: its mesh
/// closed, its weights (a leader's stage with them) and cache pin released.
pub(super) fn release(
    k: &Key,
    rank: Rank,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    rank.mesh.close();
    match rank.follower_bytes {
        Some(bytes) => {
            sources.cache.unpin(&rank.spec.source.cache_key());
            metrics.weight_bytes.sub(bytes as i64);
        }
        // A leader's pin and weights are its stage's (let go of already
        // when its thread crashed).
        None => {
            let stage = shards.loaded.lock().expect("shard set lock").remove(k);
            if let Some(stage) = stage {
                sources.cache.unpin(&stage.spec.source.cache_key());
                metrics.weight_bytes.sub(stage.worker.weight_bytes as i64);
                metrics.forget_shard(&stage.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::endpoint_host;

    #[test]
    fn the_host_of_an_endpoint() {
        assert_eq!(endpoint_host("https://10.0.0.2:7443"), "10.0.0.2");
        assert_eq!(endpoint_host("http://node-a.local:80/"), "node-a.local");
        assert_eq!(endpoint_host("https://[fd00::1]:7443"), "[fd00::1]");
        assert_eq!(endpoint_host("127.0.0.1:9"), "127.0.0.1");
    }
}
