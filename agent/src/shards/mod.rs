//! The Shards bound to this node: fetched, loaded, reported, unloaded.
//!
//! ```text
//!  watch Shards (label shardplane.dev/node=<me>)
//!    Apply  ──► Pending ─► Downloading (check / verify weights) ─► Loading ─► Ready
//!                                                         any failure ──► Failed + reason
//!    Ready, its stage's thread panics ──► unloaded, Failed (StageCrashed) ──► retried
//!    Delete ──► unload (free weights and KV cache)
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use shardplane_crds::{
    Engine, NODE_LABEL, Shard, ShardPhase, ShardSpec, ShardStatus, node_label_value,
};
use shardplane_engine::pipeline::{EngineKind, TextModel};
use tokio::sync::watch;

use crate::cache::{Cache, Failure};
use crate::metrics::Metrics;
use crate::retry;
use crate::stage::StageWorker;

mod decide;
mod fetch;
mod healing;
mod kv_room;
mod load;
mod status;
mod tensor;
use decide::{Decision, End, Origin, decide, ended, load_failed};
use healing::{Over, fail_shard};
use load::{bring_up, layout_and_options, load_failure, with_template};
use status::{reassert, report, report_claimed, report_seen};

/// A Shard's key: `namespace/name`.
type Key = (String, String);

/// One load's claim on a Shard ([`decide`]): a Shard unloaded during a
/// load and claimed again (deleted and created again under its name,
/// moved away and back) is claimed anew, so that the old load, still
/// running, cannot end over the new one's phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Claim(u64);

/// The claim of each load under way, and the number of the last one made.
#[derive(Default)]
struct Claims {
    by_shard: BTreeMap<Key, Claim>,
    last: u64,
}

/// A tensor rank's listener and its `host:port` as its group reaches it.
type MeshListener = (Arc<std::net::TcpListener>, String);

/// A loaded stage, served on the data plane.
pub struct ServedStage {
    /// The Shard's namespace.
    pub namespace: String,
    /// The Shard's name.
    pub name: String,
    /// The Shard's spec when it was loaded.
    pub spec: ShardSpec,
    /// The stage's thread.
    pub worker: StageWorker,
    /// Tokenizer and chat template, on a first stage.
    pub text: Option<Arc<TextModel>>,
}

impl ServedStage {
    /// Whether the stage applies the output head (and so samples).
    pub fn is_last(&self) -> bool {
        self.spec.layers.end == self.spec.total_layers
    }
}

/// The shards this agent runs. Its locks are taken in one order: `ranks`,
/// then `phases`, then any of the others (each alone); nothing takes an
/// earlier one while holding a later one.
#[derive(Clone)]
pub struct ShardSet {
    loaded: Arc<Mutex<BTreeMap<Key, Arc<ServedStage>>>>,
    phases: Arc<Mutex<BTreeMap<Key, ShardPhase>>>,
    failures: Arc<Mutex<BTreeMap<Key, retry::Record>>>,
    /// The claim of each load under way (set and read under the phase
    /// lock).
    claims: Arc<Mutex<Claims>>,
    /// The status each Shard should show; one task per Shard writes it.
    statuses: Arc<Mutex<BTreeMap<Key, watch::Sender<ShardStatus>>>>,
    /// Ranks of tensor groups: their meshes (leaders' and followers').
    ranks: Arc<Mutex<BTreeMap<Key, tensor::Rank>>>,
    /// Where each tensor rank's group reaches it, kept while its Shard
    /// runs here so that its address stays what it reported.
    listeners: Arc<Mutex<BTreeMap<Key, MeshListener>>>,
    /// The newest Shard an `ensure` passed over because a load of it was
    /// under way; the load takes it up when it ends.
    skipped: Arc<Mutex<BTreeMap<Key, Shard>>>,
    endpoint: Arc<str>,
}

impl ShardSet {
    /// No shard yet; loaded ones are served at the data-plane `endpoint`.
    pub fn new(endpoint: &str) -> Self {
        ShardSet {
            loaded: Arc::default(),
            phases: Arc::default(),
            failures: Arc::default(),
            claims: Arc::default(),
            statuses: Arc::default(),
            ranks: Arc::default(),
            listeners: Arc::default(),
            skipped: Arc::default(),
            endpoint: endpoint.into(),
        }
    }

    /// The listener Shard `k`'s tensor group reaches it at (bound on every
    /// interface on first use) and its `host:port` as peers reach it, for
    /// the load that made `claim` while it stands (a load whose Shard went
    /// meanwhile keeps none for it).
    fn mesh_listener(&self, k: &Key, claim: Claim) -> std::io::Result<MeshListener> {
        let phases = self.phases.lock().expect("phase lock");
        if !self.claimed(&phases, k, claim) {
            return Err(std::io::Error::other("the Shard went while it loaded"));
        }
        let mut listeners = self.listeners.lock().expect("listener lock");
        if let Some((l, e)) = listeners.get(k) {
            return Ok((l.clone(), e.clone()));
        }
        // Every interface of the endpoint's address family (a name: IPv6,
        // else IPv4).
        let host = tensor::endpoint_host(&self.endpoint);
        let ipv4 = host.parse::<std::net::Ipv4Addr>().is_ok();
        let listener = if ipv4 {
            std::net::TcpListener::bind(("0.0.0.0", 0))?
        } else {
            std::net::TcpListener::bind(("::", 0))
                .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", 0)))?
        };
        let port = listener.local_addr()?.port();
        let endpoint = format!("{}:{port}", tensor::endpoint_host(&self.endpoint));
        let entry = (Arc::new(listener), endpoint);
        listeners.insert(k.clone(), entry.clone());
        Ok(entry)
    }

    /// Claims a load of Shard `k` (the caller holds the phase lock and
    /// sets it Downloading).
    fn claim(&self, k: &Key) -> Claim {
        let mut claims = self.claims.lock().expect("claim lock");
        claims.last += 1;
        let claim = Claim(claims.last);
        claims.by_shard.insert(k.clone(), claim);
        claim
    }

    /// Forgets the claim on Shard `k` (unloaded: no load of it stands).
    fn forget_claim(&self, k: &Key) {
        self.claims.lock().expect("claim lock").by_shard.remove(k);
    }

    /// Whether the load that made `claim` still stands for Shard `k`:
    /// its phase one of a load, and no newer load claimed it since (the
    /// caller holds the phase lock, `phases`).
    fn claimed(&self, phases: &BTreeMap<Key, ShardPhase>, k: &Key, claim: Claim) -> bool {
        matches!(
            phases.get(k),
            Some(ShardPhase::Downloading | ShardPhase::Loading)
        ) && self.owns(k, claim)
    }

    /// Whether `claim` is the newest claim on Shard `k` (the caller holds
    /// the phase lock): no other load claimed it since, whatever its
    /// phase now.
    fn owns(&self, k: &Key, claim: Claim) -> bool {
        self.claims.lock().expect("claim lock").by_shard.get(k) == Some(&claim)
    }

    /// Remembers `shard`, passed over while a load of it runs (the caller
    /// holds the phase lock, so the load's end, which changes the phase
    /// first, finds it). An older generation never replaces a newer one.
    fn skip(&self, shard: Shard) {
        let mut skipped = self.skipped.lock().expect("skipped lock");
        let k = key(&shard);
        if skipped
            .get(&k)
            .is_none_or(|s| s.metadata.generation <= shard.metadata.generation)
        {
            skipped.insert(k, shard);
        }
    }

    /// The Shard passed over while the load of its spec at `generation`
    /// ran, when it is newer; forgotten either way.
    fn take_skipped(&self, k: &Key, generation: Option<i64>) -> Option<Shard> {
        let shard = self.skipped.lock().expect("skipped lock").remove(k)?;
        (shard.metadata.generation > generation).then_some(shard)
    }

    /// Number of loaded shards.
    pub fn loaded(&self) -> usize {
        self.loaded.lock().expect("shard set lock").len()
    }

    /// The loaded stage of Shard `namespace/name`.
    pub fn served(&self, namespace: &str, name: &str) -> Option<Arc<ServedStage>> {
        self.loaded
            .lock()
            .expect("shard set lock")
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Every loaded stage.
    pub fn all_served(&self) -> Vec<Arc<ServedStage>> {
        self.loaded
            .lock()
            .expect("shard set lock")
            .values()
            .cloned()
            .collect()
    }

    /// Serves `stage` as if it had been loaded.
    #[cfg(test)]
    pub(crate) fn insert(&self, stage: ServedStage) {
        let key = (stage.namespace.clone(), stage.name.clone());
        self.loaded
            .lock()
            .expect("shard set lock")
            .insert(key, Arc::new(stage));
    }

    /// Unloads everything (shutdown).
    pub fn unload_all(&self) {
        self.loaded.lock().expect("shard set lock").clear();
    }
}

/// Where weights come from besides paths on the node.
#[derive(Clone)]
pub struct Sources {
    /// The download cache.
    pub cache: Cache,
    /// Base URL of the Hugging Face hub (or a mirror).
    pub hugging_face_endpoint: String,
    /// Other agents whose caches hold models, tried before the source.
    pub peers: Option<PeerSources>,
    /// The engine stages are loaded into.
    pub engine: EngineKind,
    /// How the stages' steps are made up.
    pub budget: crate::scheduler::Budget,
    /// Bytes of prompts' KV each stage but a tensor rank keeps for reuse.
    pub prefix_cache_bytes: usize,
    /// Memory kept free for the rest of the machine (`--memory-reserve`):
    /// a head's KV budget never counts on it.
    pub memory_reserve: u64,
    /// Every Shard (a tensor rank finds its group's addresses there).
    pub directory: kube::runtime::reflector::Store<Shard>,
    /// The cluster's data-plane token (a tensor group's ranks prove it).
    pub token: shardplane_dataplane::Token,
    /// The data plane's TLS (a tensor group's mesh runs it too); none:
    /// plain TCP.
    pub tls: Option<Arc<shardplane_dataplane::tls::Tls>>,
}

/// The API's name for an engine.
pub fn crd_engine(kind: EngineKind) -> Engine {
    match kind.name() {
        "mlx" => Engine::Mlx,
        _ => Engine::Candle,
    }
}

/// The engines built into this agent, `preferred` (the one stages load
/// into) first.
pub fn engines(preferred: EngineKind) -> Vec<Engine> {
    let mut all = vec![crd_engine(preferred)];
    for name in EngineKind::available() {
        if let Ok(kind) = name.parse::<EngineKind>() {
            let engine = crd_engine(kind);
            if !all.contains(&engine) {
                all.push(engine);
            }
        }
    }
    all
}

/// Other agents to copy weights from.
#[derive(Clone)]
pub struct PeerSources {
    /// This node's name.
    pub node: String,
    /// Every InferenceNode (their cached models, addresses and links).
    pub nodes: kube::runtime::reflector::Store<shardplane_crds::InferenceNode>,
    /// Channels to peers' data planes.
    pub peers: crate::dataplane::Peers,
    /// This machine's addresses.
    pub addresses: Vec<shardplane_crds::NodeAddress>,
}

/// A peer holding a model: who, where, and what it says of the file.
struct Holder {
    node: String,
    endpoint: String,
    bytes: u64,
    sha256: Option<String>,
}

impl PeerSources {
    /// The peers whose caches hold `key`, best first: the fastest kind of
    /// link, then the lowest measured latency.
    fn holders(&self, key: &str) -> Vec<Holder> {
        let my_links = self
            .nodes
            .get(&ObjectRef::new(&self.node))
            .and_then(|n| n.status.clone())
            .map(|s| s.links)
            .unwrap_or_default();
        let mut found: Vec<(u8, u32, Holder)> = self
            .nodes
            .state()
            .iter()
            .filter_map(|n| {
                let name = n.metadata.name.clone()?;
                let status = n.status.as_ref()?;
                if name == self.node || !status.reachable() {
                    return None;
                }
                let model = status.cached_models.iter().find(|m| m.key == key)?;
                let route = crate::links::route(&self.addresses, status)?;
                let latency = my_links
                    .iter()
                    .find(|l| l.node == name)
                    .map_or(u32::MAX, |l| l.latency_micros);
                Some((
                    crate::machine::link_rank(route.kind),
                    latency,
                    Holder {
                        node: name,
                        endpoint: route.endpoint,
                        bytes: model.bytes,
                        sha256: model.sha256.clone(),
                    },
                ))
            })
            .collect();
        found.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        found.into_iter().map(|(_, _, h)| h).collect()
    }
}

/// Watches the Shards bound to `node` and runs them until the stream ends.
pub async fn run(
    client: Client,
    node: String,
    shards: ShardSet,
    metrics: Metrics,
    sources: Sources,
) {
    let api: Api<Shard> = Api::all(client.clone());
    let config =
        watcher::Config::default().labels(&format!("{NODE_LABEL}={}", node_label_value(&node)));
    let mut seen_during_init: HashSet<Key> = HashSet::new();
    // The cache key each of this node's Shards wants: partial downloads of
    // any other model are swept once the Shards are known and when one goes.
    let mut wanted: HashMap<Key, String> = HashMap::new();
    let sweep = |wanted: &HashMap<Key, String>| {
        sources
            .cache
            .sweep_partials(wanted.values().map(String::as_str));
    };
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) => {
                seen_during_init.insert(key(&s));
                wanted.insert(key(&s), s.spec.source.cache_key());
                reassert(&shards, &key(&s), s.status.as_ref().and_then(|st| st.phase));
                ensure(&client, s, &shards, &metrics, &sources, Origin::Watch);
            }
            Ok(watcher::Event::Delete(s)) => {
                unload(&key(&s), &shards, &metrics, &sources.cache);
                wanted.remove(&key(&s));
                sweep(&wanted);
            }
            Ok(watcher::Event::Init) => seen_during_init.clear(),
            Ok(watcher::Event::InitDone) => {
                wanted.retain(|k, _| seen_during_init.contains(k));
                sweep(&wanted);
                // Shards deleted while the watch was down.
                let mut gone: Vec<Key> = shards
                    .loaded
                    .lock()
                    .expect("shard set lock")
                    .keys()
                    .filter(|k| !seen_during_init.contains(*k))
                    .cloned()
                    .collect();
                let ranks: Vec<Key> = shards
                    .ranks
                    .lock()
                    .expect("rank lock")
                    .keys()
                    .cloned()
                    .collect();
                let listening: Vec<Key> = shards
                    .listeners
                    .lock()
                    .expect("listener lock")
                    .keys()
                    .cloned()
                    .collect();
                // Loads under way (their stages not yet loaded) and failed
                // Shards waiting for a retry.
                let phased: Vec<Key> = shards
                    .phases
                    .lock()
                    .expect("phase lock")
                    .keys()
                    .cloned()
                    .collect();
                let mut others: Vec<Key> = ranks
                    .into_iter()
                    .chain(listening)
                    .chain(phased)
                    .filter(|k| !seen_during_init.contains(k) && !gone.contains(k))
                    .collect();
                others.sort();
                others.dedup();
                gone.extend(others);
                for k in gone {
                    unload(&k, &shards, &metrics, &sources.cache);
                }
            }
            Err(e) => tracing::warn!(error = %e, "shard watch failed; retrying"),
        }
    }
}

fn key(s: &Shard) -> Key {
    (s.namespace().unwrap_or_default(), s.name_any())
}

/// Sets Shard `key`'s phase (tests; the code sets it under locks it holds);
/// none: its claim goes too, as [`take`] does.
#[cfg(test)]
fn set_phase(shards: &ShardSet, metrics: &Metrics, key: &Key, phase: Option<ShardPhase>) {
    if phase.is_none() {
        shards.forget_claim(key);
    }
    put_phase(
        &mut shards.phases.lock().expect("phase lock"),
        metrics,
        key,
        phase,
    );
}

/// A shard set for tests, its metrics, and sources with a cache in a
/// temporary directory (kept while the first is) and nothing else to
/// fetch from.
#[cfg(test)]
fn test_set() -> (tempfile::TempDir, ShardSet, Metrics, Sources) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let sources = test_sources(dir.path());
    (dir, ShardSet::new("127.0.0.1:1"), Metrics::new(), sources)
}

/// Sources for tests: a cache in `dir`, nothing else to fetch from.
#[cfg(test)]
fn test_sources(dir: &std::path::Path) -> Sources {
    let http = shardplane_models::http_client().expect("http client");
    Sources {
        cache: Cache::new(dir.into(), http).expect("cache"),
        hugging_face_endpoint: String::new(),
        peers: None,
        engine: EngineKind::Candle,
        budget: crate::scheduler::Budget::default(),
        prefix_cache_bytes: 0,
        memory_reserve: 0,
        directory: kube::runtime::reflector::store::Writer::default().as_reader(),
        token: shardplane_dataplane::Token::random().expect("token"),
        tls: None,
    }
}

/// Sets Shard `key`'s phase in `phases` (locked by the caller), and the
/// per-phase counts on `/metrics`.
fn put_phase(
    phases: &mut BTreeMap<Key, ShardPhase>,
    metrics: &Metrics,
    key: &Key,
    phase: Option<ShardPhase>,
) {
    match phase {
        Some(p) => {
            phases.insert(key.clone(), p);
        }
        None => {
            phases.remove(key);
        }
    }
    for p in [
        ShardPhase::Pending,
        ShardPhase::Downloading,
        ShardPhase::Loading,
        ShardPhase::Ready,
        ShardPhase::Failed,
    ] {
        let n = phases.values().filter(|x| **x == p).count();
        metrics
            .shards
            .with_label_values(&[&p.to_string()])
            .set(n as i64);
    }
}

fn unload(key: &Key, shards: &ShardSet, metrics: &Metrics, cache: &Cache) {
    let taken = {
        let mut ranks = shards.ranks.lock().expect("rank lock");
        let mut phases = shards.phases.lock().expect("phase lock");
        take(key, shards, metrics, &mut ranks, &mut phases)
    };
    let_go(key, taken, metrics, cache);
}

/// What [`take`] took out of the set for a Shard, to be let go of.
pub(super) struct Taken {
    rank: Option<tensor::Rank>,
    stage: Option<Arc<ServedStage>>,
}

impl Taken {
    /// Nothing taken.
    fn none() -> Self {
        Taken {
            rank: None,
            stage: None,
        }
    }
}

/// Takes everything of Shard `key` out of the set, under the rank and
/// phase locks (so that a Shard of the same name arriving meanwhile keeps
/// what it claims). Its status writer writes what it was last given, then
/// ends.
fn take(
    key: &Key,
    shards: &ShardSet,
    metrics: &Metrics,
    ranks: &mut BTreeMap<Key, tensor::Rank>,
    phases: &mut BTreeMap<Key, ShardPhase>,
) -> Taken {
    shards.failures.lock().expect("failure lock").remove(key);
    shards.statuses.lock().expect("status lock").remove(key);
    shards.listeners.lock().expect("listener lock").remove(key);
    shards.skipped.lock().expect("skipped lock").remove(key);
    shards.forget_claim(key);
    let taken = Taken {
        rank: ranks.remove(key),
        stage: shards.loaded.lock().expect("shard set lock").remove(key),
    };
    put_phase(phases, metrics, key, None);
    taken
}

/// Lets go of what [`take`] took: meshes closed, weights and cache pins
/// released (in-flight sequences hold a stage until their streams end).
fn let_go(key: &Key, taken: Taken, metrics: &Metrics, cache: &Cache) {
    if let Some(rank) = taken.rank {
        // A follower's thread ends; a leader's group ends with its stage.
        rank.mesh.close();
        if let Some(bytes) = rank.follower_bytes {
            cache.unpin(&rank.spec.source.cache_key());
            metrics.weight_bytes.sub(bytes as i64);
            tracing::info!(shard = %key.1, namespace = %key.0, "unloaded");
        }
    }
    if let Some(l) = taken.stage {
        cache.unpin(&l.spec.source.cache_key());
        metrics.weight_bytes.sub(l.worker.weight_bytes as i64);
        metrics.forget_shard(&l.name);
        tracing::info!(shard = %key.1, namespace = %key.0, "unloaded");
    }
}

/// Starts bringing `shard` to Ready unless it is already loaded or on its
/// way (see [`decide`]; `origin`: who asks).
fn ensure(
    client: &Client,
    shard: Shard,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
    origin: Origin,
) {
    let k = key(&shard);
    let layers = (shard.spec.layers.start, shard.spec.layers.end);
    let claim = match decide(shards, metrics, &shard, origin) {
        Decision::Kept { changed } => {
            if changed {
                tracing::info!(
                    shard = %k.1,
                    namespace = %k.0,
                    next = ?shard.spec.next,
                    previous = ?shard.spec.previous,
                    "the shard changed around its loaded stage; serving on with the new spec"
                );
            }
            report_seen(shards, &k, shard.metadata.generation);
            return;
        }
        Decision::PassedOver | Decision::Left => return,
        Decision::Load(claim) => claim,
    };
    // The weights stay in the cache while the shard runs.
    let cache_key = shard.spec.source.cache_key();
    sources.cache.pin(&cache_key);
    let (client, shards, metrics, sources) = owned(client, shards, metrics, sources);
    tokio::spawn(async move {
        match bring_up(&client, (&shard, claim), &shards, &metrics, &sources).await {
            Ok(loaded) => {
                let message = match &shard.spec.tensor {
                    Some(t) => format!(
                        "rank {} of {} of layers {}-{} loaded; its group joined",
                        t.rank,
                        t.weights.len(),
                        layers.0,
                        layers.1
                    ),
                    None => format!("layers {}-{} loaded", layers.0, layers.1),
                };
                let status = ShardStatus {
                    phase: Some(ShardPhase::Ready),
                    reason: Some("Loaded".into()),
                    message: Some(message),
                    engine: Some(loaded.engine),
                    endpoint: Some(shards.endpoint.to_string()),
                    tensor_endpoint: loaded.tensor_endpoint,
                    memory_bytes: Some(loaded.bytes),
                    kv_budget_tokens: Some(loaded.kv_budget_tokens),
                    observed_generation: loaded.generation,
                    ..Default::default()
                };
                // A tensor rank whose group broke as it formed is not Ready:
                // its rank is let go of (if the break's handler has not
                // already) and the Shard fails, to be tried again. So does a
                // stage whose thread panicked before the load ended. A
                // Shard unloaded during the load lets go of what it loaded.
                let end = ended(
                    &shards,
                    &metrics,
                    (&k, claim),
                    (shard.spec.tensor.is_some(), loaded.follows),
                    || report(&client, &shards, &k, status),
                );
                let failure = match end {
                    End::Ready => None,
                    End::Broken(rank, why) => {
                        if let Some(rank) = rank {
                            tensor::release(&k, rank, &shards, &metrics, &sources);
                        }
                        Some(Failure {
                            reason: "TensorGroupBroken",
                            message: match why {
                                Some(why) => {
                                    format!("the tensor group broke as it formed: {why}")
                                }
                                None => "the tensor group broke as it formed".into(),
                            },
                        })
                    }
                    End::Crashed => Some(Failure {
                        reason: "StageCrashed",
                        message: "the stage's thread panicked as its load ended".into(),
                    }),
                    End::Unloaded(taken) => {
                        tracing::info!(shard = %k.1, namespace = %k.0, "the shard went while it loaded");
                        let_go(&k, taken, &metrics, &sources.cache);
                        return;
                    }
                    End::Superseded(phase) => {
                        tracing::info!(shard = %k.1, ?phase, "the shard's load ended after it changed phase");
                        None
                    }
                };
                let failed = failure.is_some();
                if let Some(f) = failure {
                    fail_shard(
                        &client,
                        k.clone(),
                        loaded.generation,
                        (f, Over::Load(claim)),
                        &shards,
                        &metrics,
                        &sources,
                    );
                }
                // The Shard changed while it loaded (its `ensure` passed
                // over the change): served on with the new spec, or loaded
                // again. A failed load is tried again as the Shard then is.
                if let Some(newer) = shards.take_skipped(&k, loaded.generation)
                    && !failed
                {
                    ensure(&client, newer, &shards, &metrics, &sources, Origin::LoadEnd);
                }
            }
            Err(f) => {
                sources.cache.unpin(&cache_key);
                let (old, here) = load_failed(&shards, &metrics, (&k, claim));
                let_go(&k, old, &metrics, &sources.cache);
                if !here {
                    tracing::info!(shard = %k.1, namespace = %k.0, "the shard went while it loaded");
                    return;
                }
                let generation = shard.metadata.generation;
                fail_shard(
                    &client,
                    k.clone(),
                    generation,
                    (f, Over::Load(claim)),
                    &shards,
                    &metrics,
                    &sources,
                );
                // A spec that changed while this one failed is tried (a
                // retry already pending reads the Shard as it then is).
                if let Some(newer) = shards.take_skipped(&k, generation) {
                    ensure(&client, newer, &shards, &metrics, &sources, Origin::LoadEnd);
                }
            }
        }
    });
}

/// Owned handles for a spawned task.
fn owned(
    client: &Client,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) -> (Client, ShardSet, Metrics, Sources) {
    (
        client.clone(),
        shards.clone(),
        metrics.clone(),
        sources.clone(),
    )
}
