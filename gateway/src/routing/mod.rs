//! Where a request goes: from a model name to a deployment, its ready
//! instances (least outstanding requests first), and its fallback chain.
//!
//! ```text
//!  name ─► deployment (served name or alias) ─► ready instances ─► Generate on the head stage
//!                                 │ none ready, or each failed before its first token
//!                                 └─► fallback: other deployments ─► external OpenAI-compatible endpoint
//!                                                     └─► nothing: 503 + Retry-After
//! ```
//!
//! An instance that fails after its first token does not cut the answer: it
//! goes on, after the tokens already given, on another ready instance of the
//! same deployment (`GenerateRequest.resume`).
//!
//! # Layout
//! - this module: the router, its view of deployments and instances, and
//!   opening an answer on one instance or external endpoint;
//! - [`walk`]: the walk through instances and fallbacks up to an answer's
//!   first token, with its pauses while every instance is busy;
//! - [`affinity`]: which instance a prompt prefers (the one likely to hold
//!   its beginning in its prefix cache), within a load bound;
//! - [`outliers`]: instances that keep failing before their first token are
//!   tried last for a while;
//! - [`resume`]: an answer after its first token, resumed on another instance
//!   when its own fails.

mod affinity;
mod outliers;
mod resume;
mod walk;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use kube::runtime::reflector::{ObjectRef, Store};
use shardplane_crds::{
    DEPLOYMENT_LABEL, ExternalEndpoint, Model, ModelDeployment, Shard, ShardPhase, names,
};
use shardplane_dataplane as dp;
use shardplane_dataplane::tonic::Code;

use crate::metrics::Metrics;
use crate::protocol::{Answer, ApiError, Event, Events, Input, Prompt};
use resume::Answering;
use walk::BusyWait;

/// A ready instance: its head stage.
#[derive(Debug, Clone)]
pub struct Instance {
    /// `namespace/shard` of the head.
    pub key: String,
    /// The head Shard's namespace.
    pub namespace: String,
    /// The head Shard's name.
    pub shard: String,
    /// The head's data-plane endpoint.
    pub endpoint: String,
    /// The head's node (its data-plane certificate names it).
    pub node: String,
    /// Which of the deployment's instances it is (`spec.instance`, kept
    /// when its Shards move to other nodes and change names).
    pub index: u32,
    /// Which placement of the instance this is: a digest of its Shards'
    /// identities, specs, nodes and restarts. An answer that broke off on an
    /// instance may resume on it once this changed (the operator re-placed
    /// a lost stage or rank, or a failed stage came back).
    pub incarnation: u64,
}

impl Instance {
    /// The instance as it holds prefixes (see [`affinity`]).
    fn holder(&self) -> affinity::Holder {
        affinity::Holder {
            name: self.key.clone(),
            incarnation: self.incarnation,
        }
    }
}

/// `events`, and an [`Event::Waiting`] whenever they gave none for
/// `keepalive`: while an answer waits for an instance to heal, while
/// another instance runs its prompt and tokens again to take it over (up to
/// the first-token deadline), or while a stage or an external endpoint is
/// slow. Its dialect then sends a comment, a ping or an empty line, so that
/// the client and the proxies between, some of which cut streams idle for a
/// minute, hear from it. The answer's work goes on meanwhile: a stream
/// keeps what it was doing between polls.
fn kept_alive(events: Events, keepalive: Duration) -> Events {
    use futures::StreamExt;
    Box::pin(futures::stream::unfold(
        Some(events),
        move |state| async move {
            let mut events = state?;
            tokio::select! {
                event = events.next() => {
                    let event = event?;
                    let goes_on = !crate::protocol::ends(&event);
                    Some((event, goes_on.then_some(events)))
                }
                () = tokio::time::sleep(keepalive) => Some((Ok(Event::Waiting), Some(events))),
            }
        },
    ))
}

/// The digest [`Instance::incarnation`] of the Shards of `instance`.
fn incarnation(shards: &[Arc<Shard>], instance: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut parts: Vec<_> = shards
        .iter()
        .filter(|s| s.spec.instance == instance)
        .map(|s| {
            (
                s.metadata.uid.clone(),
                s.metadata.generation,
                s.spec.node.clone(),
                s.status.as_ref().and_then(|st| st.restarts),
            )
        })
        .collect();
    parts.sort();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut hasher);
    hasher.finish()
}

/// A served name and its deployment.
#[derive(Debug, Clone)]
pub struct Served {
    /// The name clients use.
    pub name: String,
    /// `namespace/deployment`.
    pub deployment: String,
    /// The Model.
    pub model: Option<Model>,
    /// Ready instances right now.
    pub ready: usize,
}

impl Served {
    /// When its Model was created (what the APIs list as the model's date).
    pub fn created(&self) -> Option<k8s_openapi::jiff::Timestamp> {
        Some(self.model.as_ref()?.metadata.creation_timestamp.as_ref()?.0)
    }
}

/// The head Shards of a deployment's instances that can answer: the head
/// and every stage its `next` names, in order, are Ready. Shards of one
/// instance may stand side by side for a while (one kept on a lost node
/// until its replacement is Ready), so an instance is the chain its head
/// names, not every Shard with its index. A tensor group is its rank 0
/// (Ready only once every rank has joined it).
fn ready_heads(shards: &[Arc<Shard>]) -> Vec<&Arc<Shard>> {
    // A tensor group's other ranks follow its rank 0, which alone serves.
    let leads = |s: &Shard| s.spec.tensor.as_ref().is_none_or(|t| t.rank == 0);
    let ready = |s: &Shard| s.status.as_ref().and_then(|st| st.phase) == Some(ShardPhase::Ready);
    let by_name: HashMap<&str, &Arc<Shard>> = shards
        .iter()
        .filter(|s| ready(s))
        .filter_map(|s| Some((s.metadata.name.as_deref()?, s)))
        .collect();
    shards
        .iter()
        .filter(|head| head.spec.stage == 0 && leads(head) && ready(head))
        .filter(|head| {
            let (count, instance) = (head.spec.stage_count, head.spec.instance);
            let mut at: &Shard = head;
            for stage in 1..count {
                let next = at.spec.next.as_deref().and_then(|n| by_name.get(n));
                match next {
                    Some(n) if n.spec.stage == stage && n.spec.instance == instance => at = n,
                    _ => return false,
                }
            }
            at.spec.next.is_none()
        })
        .collect()
}

/// The gateway's view of the cluster and its routing state.
#[derive(Clone)]
pub struct Router {
    client: Client,
    deployments: Store<ModelDeployment>,
    models: Store<Model>,
    shards: Store<Shard>,
    peers: dp::Peers,
    outstanding: Arc<Mutex<HashMap<String, usize>>>,
    http: reqwest::Client,
    metrics: Metrics,
    busy_wait: Duration,
    heal_wait: Duration,
    /// How long an answer is silent at most: then it tells its client
    /// (`Event::Waiting`).
    keepalive: Duration,
    deadlines: Deadlines,
    outliers: outliers::Outliers,
    external: Arc<crate::external::Allowlist>,
    /// Which instances lately started answers for each affinity key.
    holders: Arc<Mutex<affinity::Holders>>,
}

/// How long an instance has to start an answer, and to give its first token.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// From the call to the instance's `Started` (it admits or refuses at
    /// once, so only a hung or unreachable instance takes long).
    pub start: Duration,
    /// From the call to the first token (the prompt's prefill and the
    /// instance's queue come before it).
    pub first_token: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            start: Duration::from_secs(10),
            first_token: Duration::from_secs(300),
        }
    }
}

/// Counts a request against an instance until dropped.
struct Outstanding {
    map: Arc<Mutex<HashMap<String, usize>>>,
    key: String,
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        let mut map = self.map.lock().expect("outstanding lock");
        if let Some(n) = map.get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

enum Attempt {
    /// Try the next candidate.
    Next(String),
    /// The candidate started the answer, then failed before its first
    /// token: try the next, and count a run of the answer on it (see
    /// `resume`: it may be the answer that breaks it).
    Broke(String),
    /// The candidate is too busy to start it soon: try the next; when every
    /// candidate says so, the client hears 429.
    Busy(String),
    /// Give the client this error.
    Fail(ApiError),
}

impl Router {
    /// A router over the cluster's deployments, models and shards.
    pub fn new(
        client: Client,
        deployments: Store<ModelDeployment>,
        models: Store<Model>,
        shards: Store<Shard>,
        token: dp::Token,
        http: reqwest::Client,
        metrics: Metrics,
    ) -> Self {
        Router {
            client,
            deployments,
            models,
            shards,
            peers: dp::Peers::new(token, None),
            outstanding: Arc::default(),
            http,
            metrics,
            busy_wait: Duration::from_secs(60),
            heal_wait: Duration::from_secs(120),
            keepalive: Duration::from_secs(10),
            deadlines: Deadlines::default(),
            outliers: outliers::Outliers::default(),
            external: Arc::default(),
            holders: Arc::default(),
        }
    }

    /// How long each attempt on an instance may take to start an answer
    /// and to give its first token before the next instance is tried.
    pub fn with_deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    /// Where external fallbacks may send requests (nowhere by default).
    pub fn with_external_allowlist(mut self, allowed: crate::external::Allowlist) -> Self {
        self.external = Arc::new(allowed);
        self
    }

    /// Calls to agents over TLS with `tls` (plain TCP when none).
    pub fn with_data_plane_tls(mut self, tls: Option<Arc<shardplane_dataplane::tls::Tls>>) -> Self {
        self.peers = self.peers.with_tls(tls);
        self
    }

    /// How long a request waits, retrying, while every instance that could
    /// answer it is busy, before it is answered 429.
    pub fn with_busy_wait(mut self, busy_wait: Duration) -> Self {
        self.busy_wait = busy_wait;
        self
    }

    /// How long an answer cut off by a failed instance waits for an
    /// instance to resume on (another replica, or the same one once the
    /// operator re-placed what it lost) before it ends with an error.
    pub fn with_heal_wait(mut self, heal_wait: Duration) -> Self {
        self.heal_wait = heal_wait;
        self
    }

    /// How long a streamed answer is silent at most before it sends its
    /// client a keep-alive (10 s unless set): while it waits to heal, while
    /// another instance takes it over, or while a stage is slow; so that
    /// proxies and clients with idle timeouts keep the connection.
    pub fn with_keepalive(mut self, keepalive: Duration) -> Self {
        self.keepalive = keepalive.max(Duration::from_millis(100));
        self
    }

    fn model_of(&self, d: &ModelDeployment) -> Option<Arc<Model>> {
        let ns = d.metadata.namespace.clone().unwrap_or_default();
        self.models.get(&ObjectRef::new(&d.spec.model).within(&ns))
    }

    /// Every served name (served names first, then aliases), sorted; each
    /// by the deployment that owns it (see `shardplane_crds::names`).
    pub fn served(&self) -> Vec<Served> {
        let mut out = BTreeMap::new();
        let mut deployments = self.deployments.state();
        deployments.sort_by_key(|d| names::age(d));
        for d in deployments {
            let model = self.model_of(&d);
            let key = format!(
                "{}/{}",
                d.metadata.namespace.clone().unwrap_or_default(),
                d.metadata.name.clone().unwrap_or_default()
            );
            let ready = self.instances(&d).len();
            let names = model
                .iter()
                .map(|m| m.served_name().to_string())
                .chain(d.spec.aliases.iter().cloned());
            for name in names {
                out.entry(name.clone()).or_insert(Served {
                    name,
                    deployment: key.clone(),
                    model: model.as_deref().cloned(),
                    ready,
                });
            }
        }
        out.into_values().collect()
    }

    /// The deployment serving `name` (served name or alias; `name:latest`
    /// is `name` when nothing is served under the tagged name, as in Ollama):
    /// the oldest that claims it, so a deployment created later in another
    /// namespace can never take a name over (`shardplane_crds::names`).
    pub fn deployment_for(&self, name: &str) -> Option<Arc<ModelDeployment>> {
        let mut deployments = self.deployments.state();
        deployments.sort_by_key(|d| names::age(d));
        let serves = |d: &ModelDeployment, name: &str| {
            d.spec.aliases.iter().any(|a| a == name)
                || self.model_of(d).is_some_and(|m| m.served_name() == name)
        };
        let bare = name.strip_suffix(":latest");
        deployments
            .iter()
            .find(|d| serves(d, name))
            .or_else(|| {
                deployments
                    .iter()
                    .find(|d| bare.is_some_and(|b| serves(d, b)))
            })
            .cloned()
    }

    /// The ready instances of `d`, least outstanding requests first (ties
    /// broken at random, so equal replicas share the load).
    pub fn instances(&self, d: &ModelDeployment) -> Vec<Instance> {
        self.instances_for(d, None)
    }

    /// The ready instances of `d` in the order a prompt with the affinity
    /// `keys` tries them (see [`affinity`]); without keys, least outstanding
    /// requests first.
    fn instances_for(&self, d: &ModelDeployment, keys: Option<&affinity::Keys>) -> Vec<Instance> {
        let ns = d.metadata.namespace.clone().unwrap_or_default();
        let name = d.metadata.name.clone().unwrap_or_default();
        let mine: Vec<Arc<Shard>> = self
            .shards
            .state()
            .into_iter()
            .filter(|s| {
                s.metadata.namespace.as_deref() == Some(&ns)
                    && s.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(DEPLOYMENT_LABEL))
                        == Some(&name)
            })
            .collect();
        let outstanding = self.outstanding.lock().expect("outstanding lock").clone();
        let mut ready: Vec<(usize, u32, Instance)> = ready_heads(&mine)
            .into_iter()
            .filter_map(|head| {
                let endpoint = head.status.as_ref()?.endpoint.clone()?;
                let shard = head.metadata.name.clone()?;
                let key = format!("{ns}/{shard}");
                let load = outstanding.get(&key).copied().unwrap_or(0);
                Some((
                    load,
                    rand::random::<u32>(),
                    Instance {
                        key,
                        namespace: ns.clone(),
                        shard,
                        endpoint,
                        node: head.spec.node.clone(),
                        index: head.spec.instance,
                        incarnation: incarnation(&mine, head.spec.instance),
                    },
                ))
            })
            .collect();
        let ordered = if let Some(keys) = keys {
            let candidates = ready
                .into_iter()
                .map(|(load, _, i)| (load, i.holder(), i))
                .collect();
            let held = self.holders_lock().held(keys);
            affinity::order(keys.opening, candidates, &held)
        } else {
            ready.sort_by_key(|(load, tie, _)| (*load, *tie));
            ready.into_iter().map(|(_, _, i)| i).collect()
        };
        self.outliers.ejected_last(ordered, |i| i.key.as_str())
    }

    fn holders_lock(&self) -> std::sync::MutexGuard<'_, affinity::Holders> {
        self.holders.lock().expect("holders lock")
    }

    /// Answers on `inst`, a ready instance of deployment `deployment`. Once
    /// the first token is out, a failure of the instance resumes the answer
    /// on another ready instance of the same deployment.
    async fn try_instance(
        &self,
        name: &str,
        deployment: &str,
        inst: &Instance,
        prompt: &Prompt,
    ) -> Result<Answer, Attempt> {
        let opened = self.open(inst, prompt, &[]).await?;
        let prompt_tokens = opened.prompt_tokens;
        let answering = Answering::new(self.clone(), name, deployment, inst, prompt, opened);
        let events = futures::stream::unfold(Some(answering), |state| async move {
            let mut answering = state?;
            let event = answering.next().await;
            let goes_on = !crate::protocol::ends(&event);
            Some((event, goes_on.then_some(answering)))
        });
        Ok(Answer {
            model: name.to_string(),
            prompt_tokens,
            events: Box::pin(events),
        })
    }

    /// Starts `prompt` on `inst` (going on after `resume`, the tokens an
    /// answer already gave) and waits for its first token: until then
    /// another instance can take over.
    async fn open(
        &self,
        inst: &Instance,
        prompt: &Prompt,
        resume: &[u32],
    ) -> Result<Opened, Attempt> {
        let guard = {
            let mut map = self.outstanding.lock().expect("outstanding lock");
            *map.entry(inst.key.clone()).or_default() += 1;
            Outstanding {
                map: self.outstanding.clone(),
                key: inst.key.clone(),
            }
        };
        let mut client = self
            .peers
            .client(&inst.node, &inst.endpoint)
            .map_err(|e| Attempt::Next(e.to_string()))?;
        let input = match &prompt.input {
            Input::Chat(c) => dp::generate_request::Input::Chat(c.clone()),
            Input::Text(t) => dp::generate_request::Input::Prompt(t.clone()),
        };
        let request = dp::GenerateRequest {
            shard: Some(dp::ShardRef {
                namespace: inst.namespace.clone(),
                name: inst.shard.clone(),
            }),
            input: Some(input),
            sampling: Some(prompt.sampling.clone()),
            resume: (!resume.is_empty()).then(|| dp::TokenIds {
                ids: resume.to_vec(),
            }),
            grammar: prompt.grammar.clone(),
            tools: prompt.tools.clone(),
        };
        let refused = |s: dp::tonic::Status| match s.code() {
            Code::InvalidArgument => Attempt::Fail(ApiError::invalid(s.message())),
            Code::ResourceExhausted => Attempt::Busy(s.message().to_string()),
            Code::Unauthenticated => Attempt::Fail(ApiError::upstream(
                "the gateway's data-plane token was refused by the agents",
            )),
            _ => Attempt::Next(format!("{:?}: {}", s.code(), s.message())),
        };
        let called = tokio::time::Instant::now();
        let (start_by, first_by) = (
            called + self.deadlines.start,
            called + self.deadlines.first_token,
        );
        let late = |what: &str, d: Duration| {
            Attempt::Next(format!(
                "the instance did not {what} within {:.0} s",
                d.as_secs_f64()
            ))
        };
        let mut stream = tokio::time::timeout_at(start_by, client.generate(request))
            .await
            .map_err(|_| late("start the answer", self.deadlines.start))?
            .map_err(refused)?
            .into_inner();
        let (mut prompt_tokens, mut started) = (0, false);
        // Once started, a failure is a run of the answer that broke off.
        let broke = |a: Attempt, started: bool| match a {
            Attempt::Next(why) if started => Attempt::Broke(why),
            a => a,
        };
        loop {
            use dp::generate_response::Event as E;
            let (by, what, d) = match started {
                false => (start_by, "start the answer", self.deadlines.start),
                true => (first_by, "give a first token", self.deadlines.first_token),
            };
            let message = tokio::time::timeout_at(by, stream.message())
                .await
                .map_err(|_| broke(late(what, d), started))?;
            match message.map_err(|s| broke(refused(s), started))? {
                None => {
                    let why = "the stream ended without an answer".to_string();
                    return Err(broke(Attempt::Next(why), started));
                }
                Some(dp::GenerateResponse { event: Some(e) }) => match e {
                    E::Started(s) => {
                        prompt_tokens = s.prompt_tokens;
                        started = true;
                    }
                    e @ (E::Delta(_) | E::Finished(_)) => {
                        return Ok(Opened {
                            prompt_tokens,
                            first: vec![e],
                            stream,
                            guard,
                        });
                    }
                },
                Some(_) => {}
            }
        }
    }

    async fn api_key(&self, ns: &str, ext: &ExternalEndpoint) -> crate::Result<Option<String>> {
        let Some(r) = &ext.api_key_secret_ref else {
            return Ok(None);
        };
        let label = crate::external::EXTERNAL_CREDENTIAL_LABEL;
        let value =
            shardplane_cluster::secrets::read_opted_in(&self.client, ns, &r.name, &r.key, label)
                .await?;
        Ok(Some(value))
    }

    async fn try_external(
        &self,
        name: &str,
        ns: &str,
        ext: &ExternalEndpoint,
        prompt: &Prompt,
    ) -> Result<Answer, Attempt> {
        if !self.external.allows(&ext.base_url) {
            return Err(Attempt::Next(format!(
                "{name}'s external endpoint {} is not among the gateway's allowed URLs (--allow-external-url)",
                ext.base_url
            )));
        }
        let key = self
            .api_key(ns, ext)
            .await
            .map_err(|e| Attempt::Next(e.to_string()))?;
        crate::external::start(&self.http, name, ext, key.as_deref(), prompt)
            .await
            .map_err(|e| match e {
                crate::external::Failure::Retry(why) => Attempt::Next(why),
                crate::external::Failure::Client(e) => Attempt::Fail(e),
            })
    }
}

/// An instance's answer once its first token is out.
struct Opened {
    prompt_tokens: u32,
    /// Events already read (a `Delta` or `Finished`).
    first: Vec<dp::generate_response::Event>,
    stream: dp::tonic::Streaming<dp::GenerateResponse>,
    guard: Outstanding,
}

#[cfg(test)]
mod tests;
