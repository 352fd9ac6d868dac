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
//! A sequence lives as long as its streams: when the client of `Generate`
//! goes away, the head drops its `Forward` stream, the next stage sees it end
//! and drops its own, and every stage frees the sequence's KV cache.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use kube::runtime::reflector::{ObjectRef, Store};
use shardplane_crds::{InferenceNode, NodeAddress, Shard, ShardPhase};
use shardplane_dataplane as dp;
pub use shardplane_dataplane::Peers;
use shardplane_dataplane::data_plane_server::{DataPlane, DataPlaneServer};
use shardplane_engine::pipeline::ban;
use shardplane_engine::sampler::{Sampler, SamplingParams};
use shardplane_engine::text_output::TextOutput;
use shardplane_engine::{Activations, SequenceId, StageInput, StageOutput};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::cache::Cache;
use crate::links::route;
use crate::metrics::Metrics;
use crate::shards::{ServedStage, ShardSet};

/// Prompt tokens sent down the pipeline in one step; longer prompts go in
/// several steps, which later stages work on while earlier ones go on.
const PREFILL_CHUNK: usize = 512;

/// Bytes per `ReadBlob` chunk.
const BLOB_CHUNK: usize = 1 << 20;

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

    fn stage(&self, shard: Option<&dp::ShardRef>) -> Result<Arc<ServedStage>, Status> {
        let r = shard.ok_or_else(|| Status::invalid_argument("no shard named"))?;
        self.shards.served(&r.namespace, &r.name).ok_or_else(|| {
            Status::not_found(format!(
                "shard {}/{} is not loaded on node {}",
                r.namespace, r.name, self.node
            ))
        })
    }

    /// Opens the sequence on the stage after `stage`.
    async fn open_next(
        &self,
        stage: &ServedStage,
        mut open: dp::Open,
    ) -> Result<Downstream, Status> {
        let next = stage.spec.next.as_deref().ok_or_else(|| {
            Status::failed_precondition(format!(
                "shard {} is not the last stage but names no next stage",
                stage.name
            ))
        })?;
        let shard = self
            .directory
            .get(&ObjectRef::new(next).within(&stage.namespace))
            .ok_or_else(|| {
                Status::unavailable(format!(
                    "next stage {}/{next} is not known yet",
                    stage.namespace
                ))
            })?;
        let status = shard.status.clone().unwrap_or_default();
        let endpoint = match (status.phase, status.endpoint) {
            // The fastest link to the next stage's node, when it is known.
            (Some(ShardPhase::Ready), Some(e)) => self
                .nodes
                .get(&ObjectRef::new(&shard.spec.node))
                .and_then(|n| n.status.as_ref().and_then(|st| route(&self.addresses, st)))
                .map(|r| r.endpoint)
                .unwrap_or(e),
            (phase, _) => {
                return Err(Status::unavailable(format!(
                    "next stage {}/{next} is not ready (phase {})",
                    stage.namespace,
                    phase.map(|p| p.to_string()).unwrap_or("Pending".into())
                )));
            }
        };
        open.shard = Some(dp::ShardRef {
            namespace: stage.namespace.clone(),
            name: next.to_string(),
        });
        let mut client = self
            .peers
            .client(&endpoint)
            .map_err(Status::invalid_argument)?;
        let (requests, outbound) = mpsc::channel(64);
        requests
            .send(dp::ForwardRequest {
                message: Some(dp::forward_request::Message::Open(open)),
            })
            .await
            .map_err(|_| Status::internal("cannot queue the open message"))?;
        let answers = client
            .forward(ReceiverStream::new(outbound))
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "next stage {}/{next} at {endpoint}: {}",
                    stage.namespace,
                    e.message()
                ))
            })?
            .into_inner();
        Ok(Downstream { requests, answers })
    }
}

/// The sequence's stream to the next stage.
struct Downstream {
    requests: mpsc::Sender<dp::ForwardRequest>,
    answers: Streaming<dp::ForwardResponse>,
}

async fn send_step(
    requests: &mpsc::Sender<dp::ForwardRequest>,
    a: &Activations,
    sample: bool,
) -> Result<(), Status> {
    let step = dp::Step {
        hidden: Some(dp::Hidden {
            tokens: a.tokens as u32,
            width: a.hidden as u32,
            data: dp::encode_f32(&a.data),
        }),
        sample,
    };
    requests
        .send(dp::ForwardRequest {
            message: Some(dp::forward_request::Message::Step(step)),
        })
        .await
        .map_err(|_| Status::unavailable("the next stage closed the sequence"))
}

impl Downstream {
    async fn send(&self, a: &Activations, sample: bool) -> Result<(), Status> {
        send_step(&self.requests, a, sample).await
    }

    async fn answer(&mut self) -> Result<dp::ForwardResponse, Status> {
        match self.answers.message().await {
            Ok(Some(a)) => Ok(a),
            Ok(None) => Err(Status::unavailable("the next stage ended the sequence")),
            Err(e) => Err(Status::unavailable(format!("next stage: {}", e.message()))),
        }
    }
}

/// Frees a sequence on a stage when dropped, however the call ends.
struct Sequence {
    stage: Arc<ServedStage>,
    id: SequenceId,
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.stage.worker.release(self.id);
    }
}

fn engine_status(e: shardplane_engine::Error) -> Status {
    match e {
        shardplane_engine::Error::InvalidInput(m) | shardplane_engine::Error::Sampling(m) => {
            Status::invalid_argument(m)
        }
        e @ shardplane_engine::Error::ContextOverflow { .. } => {
            Status::invalid_argument(e.to_string())
        }
        e => Status::internal(e.to_string()),
    }
}

/// The engine's sampling parameters from the wire's (0 means unset).
pub fn sampling_params(s: &dp::Sampling, room: usize) -> Result<SamplingParams, Status> {
    let params = SamplingParams {
        temperature: s.temperature,
        top_k: (s.top_k > 0).then_some(s.top_k as usize),
        top_p: (s.top_p > 0.0).then_some(s.top_p),
        min_p: (s.min_p > 0.0).then_some(s.min_p),
        repetition_penalty: if s.repetition_penalty == 0.0 {
            1.0
        } else {
            s.repetition_penalty
        },
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        seed: s.seed,
        max_tokens: if s.max_tokens == 0 {
            room
        } else {
            (s.max_tokens as usize).min(room)
        },
        stop: s.stop.clone(),
        ignore_eos: s.ignore_eos,
    };
    params.validate().map_err(engine_status)?;
    Ok(params)
}

/// Runs one inbound `Forward` message (a step of hidden states) through the
/// sequence's stage.
async fn run_step(
    seq: &Sequence,
    msg: dp::ForwardRequest,
    width: usize,
) -> Result<(dp::Step, StageOutput), Status> {
    let Some(dp::forward_request::Message::Step(step)) = msg.message else {
        return Err(Status::invalid_argument("only steps follow Open"));
    };
    let input = hidden_input(&step, width)?;
    let out = seq
        .stage
        .worker
        .forward(seq.id, input)
        .await
        .map_err(engine_status)?;
    Ok((step, out))
}

/// Runs `work` unless the stream it answers on closes first (the stage
/// before went away): then the work is dropped, and with it the queued job.
async fn until_closed<T, R>(
    answers: &mpsc::Sender<Result<R, Status>>,
    work: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    tokio::select! {
        biased;
        _ = answers.closed() => Err(Status::cancelled("the previous stage went away")),
        r = work => r,
    }
}

fn hidden_input(step: &dp::Step, width: usize) -> Result<StageInput, Status> {
    let h = step
        .hidden
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("a step carries no hidden states"))?;
    let data = dp::decode_hidden(h).map_err(Status::invalid_argument)?;
    if h.width as usize != width {
        return Err(Status::invalid_argument(format!(
            "hidden states are {} wide; this stage takes {width}",
            h.width
        )));
    }
    Ok(StageInput::Hidden(
        Activations::new(h.tokens as usize, width, data).map_err(engine_status)?,
    ))
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
        let received = Instant::now();
        let req = request.into_inner();
        let stage = self.stage(req.shard.as_ref())?;
        let text = stage.text.clone().ok_or_else(|| {
            Status::failed_precondition(format!(
                "shard {} runs layers from {}; Generate goes to the first stage",
                stage.name, stage.spec.layers.start
            ))
        })?;
        use dp::generate_request::Input;
        let prompt = match &req.input {
            Some(Input::Chat(c)) => {
                let messages: Vec<_> = c
                    .messages
                    .iter()
                    .map(|m| shardplane_engine::chat::ChatMessage {
                        role: m.role.clone(),
                        content: m.content.clone(),
                    })
                    .collect();
                text.chat_prompt(&messages).map_err(engine_status)?
            }
            Some(Input::Prompt(p)) => text.raw_prompt(p).map_err(engine_status)?,
            Some(Input::Tokens(t)) => in_vocabulary(&text, t.ids.clone())?,
            None => return Err(Status::invalid_argument("no chat, prompt or tokens")),
        };
        let resume = in_vocabulary(&text, req.resume.map(|t| t.ids).unwrap_or_default())?;
        let context = stage.worker.context_length;
        if prompt.is_empty() {
            return Err(Status::invalid_argument("the prompt is empty"));
        }
        if prompt.len() >= context {
            return Err(Status::invalid_argument(format!(
                "the prompt is {} tokens; the context holds {context}, so at most {} fit with room for a reply",
                prompt.len(),
                context - 1
            )));
        }
        let sampling = req.sampling.unwrap_or_default();
        let params = sampling_params(&sampling, context - prompt.len())?;
        if resume.len() > params.max_tokens {
            return Err(Status::invalid_argument(format!(
                "{} tokens to resume from; this answer may have at most {}",
                resume.len(),
                params.max_tokens
            )));
        }
        // The prompt, then the answer so far (which repetition penalties see
        // as well).
        let prompt_len = prompt.len();
        let mut context = prompt;
        context.extend(&resume);
        let banned: Vec<u32> = if params.ignore_eos {
            text.tokenizer.stop_tokens().to_vec()
        } else {
            Vec::new()
        };
        // Admission: work this stage cannot start within the bound is refused
        // at once, so a client learns it now (and the gateway tries another
        // instance) instead of waiting in a queue that only grows.
        let wait = stage.worker.stats.estimated_wait();
        if wait > self.max_queue_wait {
            self.metrics
                .generations
                .with_label_values(&["refused"])
                .inc();
            return Err(Status::resource_exhausted(format!(
                "shard {} on node {} is busy: about {:.1} s of work is queued, more than the {:.1} s it admits",
                stage.name,
                self.node,
                wait.as_secs_f64(),
                self.max_queue_wait.as_secs_f64()
            )));
        }
        let id: SequenceId = rand::random();
        let downstream = if stage.is_last() {
            None
        } else {
            Some(
                self.open_next(
                    &stage,
                    dp::Open {
                        shard: None,
                        sequence: id,
                        sampling: Some(sampling),
                        prompt: context.clone(),
                        banned: banned.clone(),
                    },
                )
                .await?,
            )
        };
        let local_sampler = if downstream.is_none() {
            Some(Sampler::new(params.clone(), &context).map_err(engine_status)?)
        } else {
            None
        };
        let (events, stream) = mpsc::channel(64);
        let generation = Generation {
            seq: Sequence {
                stage: stage.clone(),
                id,
            },
            text,
            params,
            context,
            prompt_len,
            banned,
            downstream,
            sampler: local_sampler,
            events: events.clone(),
            received,
            metrics: self.metrics.clone(),
        };
        tokio::spawn(async move {
            let outcome = generation.run().await;
            match outcome {
                Ok(()) => {}
                Err(e) if e.code() == tonic::Code::Cancelled => {}
                Err(e) => {
                    let _ = events.send(Err(e)).await;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }

    async fn forward(
        &self,
        request: Request<Streaming<dp::ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStream>, Status> {
        let mut inbound = request.into_inner();
        let open = match inbound.message().await? {
            Some(dp::ForwardRequest {
                message: Some(dp::forward_request::Message::Open(open)),
            }) => open,
            _ => {
                return Err(Status::invalid_argument(
                    "a Forward stream starts with an Open message",
                ));
            }
        };
        let stage = self.stage(open.shard.as_ref())?;
        if stage.text.is_some() {
            return Err(Status::failed_precondition(format!(
                "shard {} is a first stage; it takes Generate, not hidden states",
                stage.name
            )));
        }
        let seq = Sequence {
            stage: stage.clone(),
            id: open.sequence,
        };
        let width = stage.worker.hidden;
        let (answers, stream) = mpsc::channel(64);
        if stage.is_last() {
            let sampling = open.sampling.clone().unwrap_or_default();
            let params = sampling_params(&sampling, stage.worker.context_length)?;
            let mut sampler = Sampler::new(params, &open.prompt).map_err(engine_status)?;
            let banned = open.banned.clone();
            tokio::spawn(async move {
                let seq = seq;
                while let Ok(Some(msg)) = inbound.message().await {
                    let answer = async {
                        let (step, out) =
                            until_closed(&answers, run_step(&seq, msg, width)).await?;
                        let StageOutput::Logits(mut logits) = out else {
                            return Err(Status::internal("the last stage gave hidden states"));
                        };
                        if !step.sample {
                            return Ok(dp::ForwardResponse::default());
                        }
                        ban(&mut logits, &banned);
                        Ok(dp::ForwardResponse {
                            token: sampler.sample(&mut logits),
                            sampled: true,
                        })
                    }
                    .await;
                    let failed = answer.is_err();
                    if answers.send(answer).await.is_err() || failed {
                        break;
                    }
                }
            });
        } else {
            let mut open = open;
            open.shard = None;
            let downstream = self.open_next(&stage, open).await?;
            let Downstream {
                requests,
                answers: mut down_answers,
                ..
            } = downstream;
            let relay = answers.clone();
            // Answers come back up on their own task, so several prefill
            // chunks can be in flight along the pipeline.
            tokio::spawn(async move {
                loop {
                    let item = match down_answers.message().await {
                        Ok(Some(a)) => Ok(a),
                        Ok(None) => break,
                        Err(e) => Err(e),
                    };
                    let failed = item.is_err();
                    if relay.send(item).await.is_err() || failed {
                        break;
                    }
                }
            });
            let metrics = self.metrics.clone();
            tokio::spawn(async move {
                let seq = seq;
                while let Ok(Some(msg)) = inbound.message().await {
                    let sent = async {
                        let (step, out) =
                            until_closed(&answers, run_step(&seq, msg, width)).await?;
                        let StageOutput::Hidden(a) = out else {
                            return Err(Status::internal("a middle stage gave logits"));
                        };
                        send_step(&requests, &a, step.sample).await?;
                        metrics.hidden_bytes_sent.inc_by((a.data.len() * 4) as u64);
                        Ok(())
                    }
                    .await;
                    if let Err(e) = sent {
                        let _ = answers.send(Err(e)).await;
                        break;
                    }
                }
            });
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }

    async fn status(
        &self,
        _request: Request<dp::StatusRequest>,
    ) -> Result<Response<dp::StatusResponse>, Status> {
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
        let req = request.into_inner();
        let path = self.cache.complete_file(&req.key).ok_or_else(|| {
            Status::not_found(format!(
                "model {:?} is not in the cache of node {}",
                req.key, self.node
            ))
        })?;
        let (chunks, stream) = mpsc::channel(8);
        let metrics = self.metrics.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = send_blob(&path, req.offset, req.length, &chunks, &metrics) {
                let _ = chunks.blocking_send(Err(e));
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }
}

/// Streams `length` bytes of `path` from `offset` (to the end when 0) in
/// `BLOB_CHUNK` pieces, read on a thread of its own with positioned reads.
fn send_blob(
    path: &std::path::Path,
    offset: u64,
    length: u64,
    chunks: &mpsc::Sender<Result<dp::BlobChunk, Status>>,
    metrics: &Metrics,
) -> Result<(), Status> {
    use std::os::unix::fs::FileExt;
    let io = |e: std::io::Error| Status::internal(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    if offset > size {
        return Err(Status::out_of_range(format!(
            "offset {offset} is past the file's {size} bytes"
        )));
    }
    let end = if length == 0 {
        size
    } else {
        offset.saturating_add(length).min(size)
    };
    let mut at = offset;
    let mut first = true;
    while at < end || first {
        let n = ((end - at) as usize).min(BLOB_CHUNK);
        let mut data = vec![0; n];
        file.read_exact_at(&mut data, at).map_err(io)?;
        let chunk = dp::BlobChunk {
            offset: at,
            data: data.into(),
            size: if first { size } else { 0 },
        };
        first = false;
        at += n as u64;
        metrics.blob_bytes_served.inc_by(n as u64);
        if chunks.blocking_send(Ok(chunk)).is_err() {
            break;
        }
    }
    Ok(())
}

/// One generation on a head stage.
struct Generation {
    seq: Sequence,
    text: Arc<shardplane_engine::pipeline::TextModel>,
    params: SamplingParams,
    /// The prompt, then the tokens of the answer given before (see
    /// `GenerateRequest.resume`).
    context: Vec<u32>,
    prompt_len: usize,
    banned: Vec<u32>,
    downstream: Option<Downstream>,
    sampler: Option<Sampler>,
    events: mpsc::Sender<Result<dp::GenerateResponse, Status>>,
    received: Instant,
    metrics: Metrics,
}

/// `ids` when every one is in the model's vocabulary.
fn in_vocabulary(
    text: &shardplane_engine::pipeline::TextModel,
    ids: Vec<u32>,
) -> Result<Vec<u32>, Status> {
    let vocab = text.tokenizer.vocab_size() as u32;
    match ids.iter().find(|&&id| id >= vocab) {
        Some(bad) => Err(Status::invalid_argument(format!(
            "token {bad} is past the vocabulary of {vocab}"
        ))),
        None => Ok(ids),
    }
}

fn event(e: dp::generate_response::Event) -> Result<dp::GenerateResponse, Status> {
    Ok(dp::GenerateResponse { event: Some(e) })
}

impl Generation {
    async fn emit(&self, e: dp::generate_response::Event) -> Result<(), Status> {
        self.events
            .send(event(e))
            .await
            .map_err(|_| Status::cancelled("the client went away"))
    }

    /// Runs `tokens` through the head stage and the rest of the pipeline;
    /// returns the sampled token. Gives up as soon as the client goes away,
    /// so a stage never computes for a request nobody waits for.
    async fn step(&mut self, tokens: &[u32]) -> Result<u32, Status> {
        let events = self.events.clone();
        tokio::select! {
            biased;
            _ = events.closed() => Err(Status::cancelled("the client went away")),
            token = self.step_inner(tokens) => token,
        }
    }

    async fn step_inner(&mut self, tokens: &[u32]) -> Result<u32, Status> {
        let stage = self.seq.stage.clone();
        match &mut self.downstream {
            None => {
                let out = stage
                    .worker
                    .forward(self.seq.id, StageInput::Tokens(tokens.to_vec()))
                    .await
                    .map_err(engine_status)?;
                let StageOutput::Logits(mut logits) = out else {
                    return Err(Status::internal("a whole-model stage gave hidden states"));
                };
                ban(&mut logits, &self.banned);
                Ok(self
                    .sampler
                    .as_mut()
                    .expect("a local sampler without a next stage")
                    .sample(&mut logits))
            }
            Some(down) => {
                let chunks = tokens.len().div_ceil(PREFILL_CHUNK);
                for (i, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
                    let out = stage
                        .worker
                        .forward(self.seq.id, StageInput::Tokens(chunk.to_vec()))
                        .await
                        .map_err(engine_status)?;
                    let StageOutput::Hidden(a) = out else {
                        return Err(Status::internal("a first stage gave logits"));
                    };
                    down.send(&a, i + 1 == chunks).await?;
                    self.metrics
                        .hidden_bytes_sent
                        .inc_by((a.data.len() * 4) as u64);
                }
                let sent = Instant::now();
                let mut last = dp::ForwardResponse::default();
                for _ in 0..chunks {
                    last = down.answer().await?;
                }
                if tokens.len() == 1 {
                    self.metrics
                        .downstream_step_seconds
                        .with_label_values(&[&stage.name])
                        .observe(sent.elapsed().as_secs_f64());
                }
                if !last.sampled {
                    return Err(Status::internal("the last stage sampled no token"));
                }
                Ok(last.token)
            }
        }
    }

    async fn run(mut self) -> Result<(), Status> {
        let outcome = self.run_inner().await;
        let label = match &outcome {
            Ok(()) => "ok",
            Err(e) if e.code() == tonic::Code::Cancelled => "cancelled",
            Err(_) => "error",
        };
        self.metrics.generations.with_label_values(&[label]).inc();
        outcome
    }

    async fn run_inner(&mut self) -> Result<(), Status> {
        use dp::generate_response::Event;
        self.emit(Event::Started(dp::Started {
            prompt_tokens: self.prompt_len as u32,
            sequence: self.seq.id,
        }))
        .await?;
        let text = self.text.clone();
        let mut output = TextOutput::new(&text.tokenizer, &self.params);
        let max_new = self.params.max_tokens;
        let context = std::mem::take(&mut self.context);
        let resume = &context[self.prompt_len..];
        let mut reason = dp::FinishReason::Length;
        // The answer so far: the text it released was given then; what it
        // holds back comes with the next token.
        for (i, &token) in resume.iter().enumerate() {
            if output.push(token).map_err(engine_status)?.stop {
                if i + 1 < resume.len() {
                    return Err(Status::invalid_argument(format!(
                        "the tokens to resume from end the answer at token {i} of {}",
                        resume.len()
                    )));
                }
                reason = dp::FinishReason::Stop;
            }
        }
        let mut generated = resume.len();
        let finished_already = reason == dp::FinishReason::Stop || generated >= max_new;
        let mut first_token_at = Instant::now();
        if !finished_already {
            let token = self.step(&context).await?;
            first_token_at = Instant::now();
            reason = self.decode(&mut output, token, &mut generated).await?;
        }
        let tail = output.finish().map_err(engine_status)?;
        if !tail.is_empty() {
            self.emit(Event::Delta(dp::Delta {
                text: tail,
                tokens: Vec::new(),
            }))
            .await?;
        }
        let done = Instant::now();
        self.emit(Event::Finished(dp::Finished {
            reason: reason as i32,
            prompt_tokens: self.prompt_len as u32,
            completion_tokens: generated as u32,
            time_to_first_token_us: (first_token_at - self.received).as_micros() as u64,
            decode_us: (done - first_token_at).as_micros() as u64,
        }))
        .await?;
        Ok(())
    }

    /// Gives `token` and decodes the ones after it until a stop or the
    /// limit; `generated` counts the answer's tokens.
    async fn decode(
        &mut self,
        output: &mut TextOutput<'_>,
        mut token: u32,
        generated: &mut usize,
    ) -> Result<dp::FinishReason, Status> {
        use dp::generate_response::Event;
        let max_new = self.params.max_tokens;
        loop {
            *generated += 1;
            self.metrics.generated_tokens.inc();
            let piece = output.push(token).map_err(engine_status)?;
            self.emit(Event::Delta(dp::Delta {
                text: piece.text,
                tokens: vec![token],
            }))
            .await?;
            if piece.stop {
                return Ok(dp::FinishReason::Stop);
            }
            if *generated >= max_new {
                return Ok(dp::FinishReason::Length);
            }
            token = self.step(&[token]).await?;
        }
    }
}
