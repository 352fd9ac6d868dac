//! The agent's gRPC data plane: `Generate` on head stages, `Forward` between
//! stages, `Status`, `Ping` for link measurement and `ReadBlob` for peers
//! copying weights.
//!
//! ```text
//!  Generate ─► head: tokenize, stage 0 ─Forward(open, step…)─► stage 1 ─Forward─► last: sample
//!     ▲                         ◄──────── token per step ◄─────── relay ◄────────┘
//!     └─ text deltas (detokenized, stop strings held back)
//! ```
//!
//! With TLS on, every caller has a certificate of the cluster CA (the
//! handshake refuses one without), and the calls only agents make need a
//! node's (one DNS name, the node's): `Ping` and `ReadBlob` from any node,
//! `Forward` from the node of the Shard's previous stage (refused, as
//! unavailable, while the watch store does not know that Shard).
//! `Generate` takes the gateway's certificate (naming no DNS name, common
//! name `shardplane-gateway`) or this node's own (a tool on its machine
//! with the agent's directory), never another node's: a node drives other
//! stages only by `Forward`, into its own next stage. `Status` takes a
//! node's or the gateway's. Any other certificate the CA may have signed
//! (several names, or none and another common name) is refused.
//!
//! A sequence lives as long as its streams: when the client of `Generate`
//! goes away, the head drops its `Forward` stream, the next stage sees it end
//! and drops its own, and every stage frees the sequence's KV cache.
//!
//! # Layout
//! - this module: the service, its calls, and the small ones (`Status`, `Ping`);
//! - [`head`]: `Generate`, admission and the generation loop of a first stage;
//! - [`relay`]: `Forward`, middle stages pass hidden states on, the last samples;
//! - [`next_stage`]: finding the next stage's node and opening the sequence there;
//! - [`wire`]: conversions between the wire's messages and the engine's types;
//! - `ReadBlob` is served by [`crate::peer_copy`], beside the side that copies.

mod head;
mod next_stage;
mod relay;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_admission;
#[cfg(test)]
mod tests_head;
#[cfg(test)]
mod tests_tls;
mod wire;

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use kube::runtime::reflector::Store;
use shardplane_crds::identity::GATEWAY_COMMON_NAME;
use shardplane_crds::{InferenceNode, NodeAddress, Shard};
use shardplane_dataplane as dp;
pub use shardplane_dataplane::Peers;
use shardplane_dataplane::data_plane_server::{DataPlane, DataPlaneServer};
use tonic::{Request, Response, Status, Streaming};

use crate::cache::Cache;
use crate::metrics::Metrics;
use crate::shards::{ServedStage, ShardSet};

/// Who a call comes from, by its certificate.
enum Caller<'p> {
    /// TLS is off: anyone with the token.
    Any,
    /// A node (its certificate's one DNS name).
    Node(&'p str),
    /// The gateway.
    Gateway,
}

/// Bytes a `Ping` may ask for.
const MAX_PING_BYTES: u32 = 64 << 20;

/// The data-plane service of one agent.
#[derive(Clone)]
pub struct Service {
    node: String,
    shards: ShardSet,
    directory: Store<Shard>,
    nodes: Store<InferenceNode>,
    addresses: Arc<Vec<NodeAddress>>,
    peers: Peers,
    metrics: Metrics,
    cache: Cache,
    max_queue_wait: std::time::Duration,
}

impl Service {
    /// A service for the stages in `shards`; `directory` holds every Shard of
    /// the cluster, to find next stages.
    pub fn new(
        node: String,
        shards: ShardSet,
        directory: Store<Shard>,
        nodes: Store<InferenceNode>,
        peers: Peers,
        metrics: Metrics,
        cache: Cache,
    ) -> Self {
        Service {
            node,
            shards,
            directory,
            nodes,
            addresses: Arc::new(crate::machine::Machine::read().addresses),
            peers,
            metrics,
            cache,
            max_queue_wait: std::time::Duration::from_secs(30),
        }
    }

    /// Refuses new generations that would wait longer than `wait` for their
    /// stage (30 s unless set).
    pub fn with_max_queue_wait(mut self, wait: std::time::Duration) -> Self {
        self.max_queue_wait = wait;
        self
    }

    /// The channels to peers, shared with the link prober.
    pub fn peers(&self) -> Peers {
        self.peers.clone()
    }

    /// The tonic service, refusing calls without `token`.
    pub fn into_server(
        self,
        token: dp::Token,
    ) -> tonic::service::interceptor::InterceptedService<DataPlaneServer<Service>, dp::RequireToken>
    {
        tonic::service::interceptor::InterceptedService::new(
            DataPlaneServer::new(self)
                .max_decoding_message_size(dp::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(dp::MAX_MESSAGE_BYTES),
            dp::RequireToken(token),
        )
    }

    /// With TLS on, the node the caller's certificate names; refused when
    /// it sent none (`call` is for agents only). None with TLS off.
    fn calling_node(
        &self,
        caller: Option<&dp::tls::PeerInfo>,
        call: &str,
    ) -> Result<Option<String>, Status> {
        if self.peers.tls().is_none() {
            return Ok(None);
        }
        match caller.and_then(|p| p.node.clone()) {
            Some(node) => Ok(Some(node)),
            None => Err(Status::permission_denied(format!(
                "{call} is a call between agents: the caller's certificate names no node (a \
                 node's has one DNS name, the node's)"
            ))),
        }
    }

    /// With TLS on, refuses a `Generate` but from the gateway's certificate
    /// or this node's own (a tool on this node's machine): not another
    /// node's, nor any other the CA signed.
    fn check_client(&self, caller: Option<&dp::tls::PeerInfo>) -> Result<(), Status> {
        match self.caller(caller, "Generate")? {
            Caller::Node(node) if node != self.node => Err(Status::permission_denied(format!(
                "node {node} may not call Generate on node {}: prompts come with the gateway's \
                 certificate or this node's own",
                self.node
            ))),
            _ => Ok(()),
        }
    }

    /// With TLS on, who a call comes from: a node, or the gateway; any
    /// other certificate of the CA is refused. `Caller::Any` with TLS off.
    fn caller<'p>(
        &self,
        caller: Option<&'p dp::tls::PeerInfo>,
        call: &str,
    ) -> Result<Caller<'p>, Status> {
        if self.peers.tls().is_none() {
            return Ok(Caller::Any);
        }
        let Some(caller) = caller else {
            return Err(Status::permission_denied(format!(
                "{call}: the caller's connection is not known"
            )));
        };
        match (&caller.node, caller.client.as_deref()) {
            (Some(node), _) => Ok(Caller::Node(node)),
            (None, Some(GATEWAY_COMMON_NAME)) => Ok(Caller::Gateway),
            (None, client) => Err(Status::permission_denied(format!(
                "{call} takes a node's certificate (one DNS name, the node's) or the gateway's \
                 (no DNS name, common name {GATEWAY_COMMON_NAME}); the caller's has {}",
                match client {
                    Some(name) => format!("no DNS name and common name {name:?}"),
                    None => "several DNS names, or no DNS name and no common name".into(),
                }
            ))),
        }
    }

    /// With TLS on (a `caller` node), refuses a `Forward` into `stage` from
    /// any node but its previous stage's. It fails closed: a stage without
    /// a previous one takes no `Forward`, and while the watch store does not
    /// know the previous Shard (not seen yet, or gone) the call is refused
    /// as unavailable, so the sender tries again or elsewhere.
    fn check_previous(&self, stage: &ServedStage, caller: Option<&str>) -> Result<(), Status> {
        let Some(caller) = caller else {
            return Ok(());
        };
        let Some(previous) = stage.spec.previous.as_deref() else {
            return Err(Status::permission_denied(format!(
                "shard {}/{} runs the first layers: nothing forwards into it",
                stage.namespace, stage.name
            )));
        };
        let key = kube::runtime::reflector::ObjectRef::new(previous).within(&stage.namespace);
        match self.directory.get(&key) {
            Some(shard) if shard.spec.node == caller => Ok(()),
            Some(shard) => Err(Status::permission_denied(format!(
                "node {caller} may not drive shard {}/{}: its previous stage {previous} is on node {}",
                stage.namespace, stage.name, shard.spec.node
            ))),
            None => Err(Status::unavailable(format!(
                "shard {}/{}'s previous stage {previous} is not known on node {} (yet): a \
                 Forward from node {caller} cannot be checked",
                stage.namespace, stage.name, self.node
            ))),
        }
    }

    fn stage(&self, shard: Option<&dp::ShardRef>) -> Result<Arc<ServedStage>, Status> {
        let r = shard.ok_or_else(|| Status::invalid_argument("no shard named"))?;
        self.shards.served(&r.namespace, &r.name).ok_or_else(|| {
            Status::not_found(format!(
                "shard {}/{} is not loaded on node {}",
                r.namespace, r.name, self.node
            ))
        })
    }
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl DataPlane for Service {
    type GenerateStream = EventStream<dp::GenerateResponse>;
    type ForwardStream = EventStream<dp::ForwardResponse>;
    type ReadBlobStream = EventStream<dp::BlobChunk>;

    async fn generate(
        &self,
        request: Request<dp::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.check_client(request.extensions().get())?;
        self.generate_on_head(request).await
    }

    async fn forward(
        &self,
        request: Request<Streaming<dp::ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStream>, Status> {
        self.relay(request).await
    }

    async fn status(
        &self,
        request: Request<dp::StatusRequest>,
    ) -> Result<Response<dp::StatusResponse>, Status> {
        self.caller(request.extensions().get(), "Status")?;
        use std::sync::atomic::Ordering::Relaxed;
        let stages = self
            .shards
            .all_served()
            .into_iter()
            .map(|s| dp::StageStatus {
                shard: Some(dp::ShardRef {
                    namespace: s.namespace.clone(),
                    name: s.name.clone(),
                }),
                first_layer: s.spec.layers.start,
                end_layer: s.spec.layers.end,
                total_layers: s.spec.total_layers,
                sequences: s.worker.stats.sequences.load(Relaxed) as u32,
                kv_cache_bytes: s.worker.stats.kv_cache_bytes.load(Relaxed),
                weight_bytes: s.worker.weight_bytes as u64,
            })
            .collect();
        Ok(Response::new(dp::StatusResponse {
            node: self.node.clone(),
            stages,
        }))
    }

    async fn ping(
        &self,
        request: Request<dp::PingRequest>,
    ) -> Result<Response<dp::PingResponse>, Status> {
        self.calling_node(request.extensions().get(), "Ping")?;
        let n = request.into_inner().reply_bytes;
        if n > MAX_PING_BYTES {
            return Err(Status::invalid_argument(format!(
                "reply_bytes {n} is over {MAX_PING_BYTES}"
            )));
        }
        Ok(Response::new(dp::PingResponse {
            payload: vec![0; n as usize],
        }))
    }

    async fn read_blob(
        &self,
        request: Request<dp::ReadBlobRequest>,
    ) -> Result<Response<Self::ReadBlobStream>, Status> {
        self.calling_node(request.extensions().get(), "ReadBlob")?;
        let req = request.into_inner();
        let path = self.cache.complete_file(&req.key).ok_or_else(|| {
            Status::not_found(format!(
                "model {:?} is not in the cache of node {}",
                req.key, self.node
            ))
        })?;
        let stream = crate::peer_copy::serve(path, req.offset, req.length, self.metrics.clone());
        Ok(Response::new(Box::pin(stream)))
    }
}
