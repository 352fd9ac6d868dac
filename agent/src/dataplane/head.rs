//! `Generate` on a head stage: the request is checked and admitted (or
//! refused at once when the stage is too busy), the pipeline is opened, and
//! one task per generation runs prefill and decode, turning tokens into text.
//!
//! ```text
//!  request ─► prompt tokens ─► admit ─► open next stage ─► Generation::run
//!                                                        prefill (chunks) ─► first token
//!                                                        decode ─► Delta … ─► Finished
//! ```

use std::sync::Arc;
use std::time::Instant;

use shardplane_dataplane as dp;
use shardplane_engine::answer::{AnswerReader, Ending, Split};
use shardplane_engine::constraint::TokenMask;
use shardplane_engine::generation::{Decoder, FinishReason, ValidRequest};
use shardplane_engine::pipeline::ban;
use shardplane_engine::sampler::{Logprobs, Sampler};
use shardplane_engine::{StageInput, StageOutput};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::next_stage::{Downstream, later_stages};
use super::relay::Sequence;
use super::wire::{self, engine_status, event};
use super::{EventStream, Service};
use crate::kv_budget::{Account, KvReservation};
use crate::metrics::Metrics;
use crate::shards::ServedStage;

/// Prompt tokens sent down the pipeline in one step; longer prompts go in
/// several steps, which later stages work on while earlier ones go on.
const PREFILL_CHUNK: usize = 512;

/// How long a pipeline's head runs new prompts whole, without its prefix
/// cache, after a later stage held none of the prefix it took (or did not
/// say how much): a stage that keeps no cache (a tensor group's) would
/// refuse every time.
const SEEDING_PAUSE: std::time::Duration = std::time::Duration::from_secs(30);

/// How many times a pipeline's head asks its later stages again (after the
/// first ask), with the fewer tokens one said it holds, before it runs the
/// whole prompt: each ask costs a look in the caches and an open, a
/// fraction of running the prompt, and stages that keep evicting should not
/// make it ask forever.
const RETAKES: usize = 3;

/// KV tokens a head reserves ahead of what a generation holds:
/// its share of the budget grows this many tokens at a time.
const KV_GROWTH: u64 = 16;

impl Service {
    /// `Generate` on a head stage: checks the request, admits it or refuses
    /// it at once, opens the pipeline and starts the generation's task.
    pub(super) async fn generate_on_head(
        &self,
        request: Request<dp::GenerateRequest>,
    ) -> Result<Response<EventStream<dp::GenerateResponse>>, Status> {
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
        let tools = wire::tools(req.tools.as_ref())?;
        if tools.is_some() && !matches!(req.input, Some(Input::Chat(_))) {
            return Err(Status::invalid_argument("tools go with a chat"));
        }
        // A chat's options also shape its answer's grammar.
        let mut chat = None;
        let prompt = match &req.input {
            Some(Input::Chat(c)) => {
                let messages: Vec<_> = c.messages.iter().map(wire::chat_message).collect();
                let options = chat.insert(wire::chat_options(c)?);
                text.conversation_prompt(&messages, tools.as_ref(), options)
                    .map_err(engine_status)?
            }
            Some(Input::Prompt(p)) => text.raw_prompt(p).map_err(engine_status)?,
            Some(Input::Tokens(t)) => t.ids.clone(),
            None => return Err(Status::invalid_argument("no chat, prompt or tokens")),
        };
        let sampling = req.sampling.unwrap_or_default();
        let mut request = ValidRequest::new(
            prompt,
            req.resume.map(|t| t.ids).unwrap_or_default(),
            wire::params(&sampling),
            text.tokenizer.vocab_size(),
            stage.worker.context_length,
        )
        .map_err(engine_status)?;
        let grammar = text
            .answer_grammar(
                wire::grammar(req.grammar.as_ref())?,
                tools.as_ref(),
                chat.as_ref(),
            )
            .map_err(engine_status)?;
        if let Some(grammar) = grammar {
            // Compiling (and, the first time, reading the vocabulary) is
            // CPU work: off the async threads.
            let model = text.clone();
            let constraint = tokio::task::spawn_blocking(move || model.constraint(&grammar))
                .await
                .map_err(|e| Status::internal(format!("compiling the output grammar: {e}")))?
                .map_err(engine_status)?;
            request = request.with_constraint(constraint).map_err(engine_status)?;
        }
        let banned: Vec<u32> = if request.params().ignore_eos {
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
        // KV admission. The Shard's budget, context length × concurrent
        // sequences (with sliding layers, sequences × the `KvCost` of a
        // context), is what placement made room for. A head reserves a
        // generation's prompt and next `KV_GROWTH` tokens and grows the share
        // as it decodes; when there is no room to grow, the youngest
        // generation is preempted and resumes by recompute when there is
        // (`Generation::room`), so short answers do not hold room for the
        // long ones they might have been. Refused, the gateway tries another
        // instance or waits.
        let most = (request.prompt().len() + request.params().max_tokens) as u64;
        let need = most.min(request.context().len() as u64 + KV_GROWTH);
        let waiting = stage.worker.stats.kv.waiting();
        // The later stages hold every token the head admits: it admits within
        // what each of them reports, counted as each counts it.
        let ledger = &stage.worker.stats.kv;
        ledger.set_later(later_stages(&self.directory, &self.nodes, &stage));
        let refused = || {
            self.metrics
                .generations
                .with_label_values(&["refused"])
                .inc();
        };
        if let Some(full) = ledger.beyond(most) {
            refused();
            return Err(Status::resource_exhausted(format!(
                "this sequence may need {most} tokens of KV (prompt and max_tokens){}, more than \
                 the {} {} holds even for it alone; ask for fewer",
                counted(&full, most),
                full.budget,
                self.holder(&stage, &full)
            )));
        }
        let reservation = KvReservation::take(&stage.worker.stats.kv, need).map_err(|full| {
            refused();
            Status::resource_exhausted(format!(
                "shard {} on node {} has no room for this sequence's KV: it needs {need} tokens \
                 (its prompt and the next tokens of its answer){}, and {} of the {} {} holds \
                 are reserved by the sequences it runs{}",
                stage.name,
                self.node,
                counted(&full, need),
                full.reserved,
                full.budget,
                self.holder(&stage, &full),
                match waiting {
                    0 => String::new(),
                    n => format!("; {n} sequences it runs wait for room first"),
                }
            ))
        })?;
        let mut seq = Sequence {
            stage: stage.clone(),
            id: rand::random(),
        };
        let (downstream, local_sampler, skip) = if stage.is_last() {
            let sampler = Sampler::resumed(
                request.params().clone(),
                request.prompt(),
                request.resumed(),
            )
            .map_err(engine_status)?;
            (None, Some(sampler), 0)
        } else {
            let open = dp::Open {
                shard: None,
                sequence: seq.id,
                sampling: Some(sampling.clone()),
                prompt: request.context(),
                banned: banned.clone(),
                generated: request.resumed().len() as u32,
                cached: 0,
                replaces: 0,
            };
            let (down, skip) = self.open_pipeline(&mut seq, open).await?;
            (Some(down), None, skip)
        };
        let (events, stream) = mpsc::channel(64);
        let generation = Generation {
            seq,
            text,
            request,
            tools: tools.is_some(),
            chat: matches!(req.input, Some(Input::Chat(_))),
            thinking_budget: match &req.input {
                Some(Input::Chat(c)) if c.thinking_budget > 0 => Some(c.thinking_budget as usize),
                _ => None,
            },
            banned,
            downstream,
            sampler: local_sampler,
            events: events.clone(),
            received,
            metrics: self.metrics.clone(),
            cached_tokens: 0,
            skip,
            reservation,
            most,
            fed: Vec::new(),
            service: self.clone(),
            sampling,
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
}

/// One generation on a head stage.
struct Generation {
    seq: Sequence,
    text: Arc<shardplane_engine::pipeline::TextModel>,
    /// The prompt, the tokens of the answer given before (see
    /// `GenerateRequest.resume`) and the sampling parameters, checked.
    request: ValidRequest,
    /// Whether the answer may call tools (calls are told from text).
    tools: bool,
    /// Whether the input was a chat (the answer's reasoning, if the model
    /// writes any, is told from its text).
    chat: bool,
    /// The most reasoning tokens, if bounded.
    thinking_budget: Option<usize>,
    banned: Vec<u32>,
    downstream: Option<Downstream>,
    sampler: Option<Sampler>,
    events: mpsc::Sender<Result<dp::GenerateResponse, Status>>,
    received: Instant,
    metrics: Metrics,
    /// Prompt tokens the head stage took from its prefix cache.
    cached_tokens: usize,
    /// Of the tokens the next step runs, those a pipeline's stages took
    /// from their prefix caches when it was opened (`open_pipeline`).
    skip: usize,
    /// Its share of the stage's KV budget, until it ends.
    reservation: KvReservation,
    /// The most KV tokens it may come to hold (prompt and max_tokens).
    most: u64,
    /// What the head ran for it so far: what a recompute runs again.
    fed: Vec<u32>,
    /// To open the next stage again after a preemption, and every Shard
    /// (the later stages' reported KV room).
    service: super::Service,
    /// How the last stage samples (a pipeline's).
    sampling: dp::Sampling,
}

impl Generation {
    async fn emit(&self, e: dp::generate_response::Event) -> Result<(), Status> {
        self.events
            .send(event(e))
            .await
            .map_err(|_| Status::cancelled("the client went away"))
    }

    /// Runs `tokens` through the head stage and the rest of the pipeline;
    /// returns the token sampled (from among `allowed`, when given). Gives
    /// up as soon as the client goes away, so a stage never computes for a
    /// request nobody waits for.
    async fn step(
        &mut self,
        tokens: Vec<u32>,
        allowed: Option<TokenMask>,
    ) -> Result<(u32, Option<Logprobs>), Status> {
        let events = self.events.clone();
        tokio::select! {
            biased;
            _ = events.closed() => Err(Status::cancelled("the client went away")),
            token = self.step_inner(tokens, allowed) => token,
        }
    }

    async fn step_inner(
        &mut self,
        tokens: Vec<u32>,
        allowed: Option<TokenMask>,
    ) -> Result<(u32, Option<Logprobs>), Status> {
        let stage = self.seq.stage.clone();
        let (tokens, recompute) = self.room(tokens).await?;
        match &mut self.downstream {
            None => {
                let out = stage
                    .worker
                    .forward_counted(self.seq.id, StageInput::Tokens(tokens))
                    .await
                    .map_err(engine_status)?;
                if !recompute {
                    self.cached_tokens += out.cached;
                }
                let StageOutput::Logits(mut logits) = out.output else {
                    return Err(Status::internal("a whole-model stage gave hidden states"));
                };
                ban(&mut logits, &self.banned);
                let sampler = self
                    .sampler
                    .as_mut()
                    .expect("a local sampler without a next stage");
                let token = sampler.sample_within(&mut logits, allowed.as_ref());
                Ok((token, sampler.take_logprobs()))
            }
            Some(down) => {
                let skip = std::mem::take(&mut self.skip);
                let Some(tokens) = tokens.get(skip..).filter(|t| !t.is_empty()) else {
                    return Err(Status::internal(format!(
                        "{skip} tokens were taken from the prefix cache of a step of {}",
                        tokens.len()
                    )));
                };
                if !recompute {
                    self.cached_tokens += skip;
                }
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
                    // The rows go with their tokens, for the later stages'
                    // prefix caches.
                    let a = a.with_ids(chunk.to_vec()).map_err(engine_status)?;
                    let last = i + 1 == chunks;
                    let mask = match (&allowed, last) {
                        (Some(m), true) => m.to_bytes(),
                        _ => Vec::new(),
                    };
                    down.send(&a, last, mask).await?;
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
                Ok((
                    last.token,
                    last.logprobs.map(|l| wire::logprobs(last.token, l)),
                ))
            }
        }
    }

    /// Makes room in the stage's KV budget for `tokens` more: the share
    /// grows `KV_GROWTH` tokens at a time. With no room left, the youngest
    /// younger generation is asked to yield its room and this one waits for
    /// it; with none younger, or when asked to yield itself, this one is
    /// preempted: its KV is freed (its sequence released; a new one takes
    /// its place; a pipeline's stream to the next stage closes, freeing the
    /// later stages' KV) and its share given back; it waits for room for all
    /// it held and `tokens` (before any new generation is admitted), then
    /// runs all of them again, the prompt mostly from the prefix cache (a
    /// pipeline's next stage opened again naming the old sequence, which
    /// each later stage then frees first, its sampler resumed after the
    /// answer so far). Its text state stays, so the answer goes on as if
    /// nothing happened. Returns what to run and whether it is a recompute.
    async fn room(&mut self, tokens: Vec<u32>) -> Result<(Vec<u32>, bool), Status> {
        self.fed.extend_from_slice(&tokens);
        let need = self.fed.len() as u64;
        let want = (need + KV_GROWTH).min(self.most.max(need));
        let stats = self.seq.stage.worker.stats.clone();
        loop {
            let room = stats.kv.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.reservation.yield_asked() {
                break;
            }
            if need <= self.reservation.tokens() {
                return Ok((tokens, false));
            }
            // The later stages' room as they report it now: growth stays
            // within what a machine that filled up since admission holds.
            if self.seq.stage.spec.next.is_some() {
                stats.kv.set_later(later_stages(
                    &self.service.directory,
                    &self.service.nodes,
                    &self.seq.stage,
                ));
            }
            if self.reservation.grow(want).is_ok() {
                return Ok((tokens, false));
            }
            if let Some(full) = stats.kv.beyond(need) {
                return Err(Status::resource_exhausted(format!(
                    "this sequence needs {need} tokens of KV{}, more than the whole {} {} holds",
                    counted(&full, need),
                    full.budget,
                    self.service.holder(&self.seq.stage, &full)
                )));
            }
            if !self.reservation.ask_younger_to_yield() {
                break;
            }
            self.reservation.wait_to_grow(room).await;
        }
        stats
            .kv
            .preemptions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.metrics
            .preemptions
            .with_label_values(&[&self.seq.stage.name])
            .inc();
        tracing::debug!(
            shard = %self.seq.stage.name,
            tokens = need,
            "a generation is preempted for KV room; it resumes by recompute"
        );
        // The old sequence's KV goes when it is dropped, and the later
        // stages' when its stream to them closes, or sooner when they see
        // the new open that names it.
        let replaces = self.seq.id;
        self.seq = Sequence {
            stage: self.seq.stage.clone(),
            id: rand::random(),
        };
        let pipeline = self.downstream.take().is_some();
        self.reservation.give_back();
        self.reservation.regain(want).await;
        if pipeline {
            // The last stage samples on from where it was: everything run
            // but the prompt is the answer's so far.
            let open = dp::Open {
                shard: None,
                sequence: self.seq.id,
                sampling: Some(self.sampling.clone()),
                prompt: self.fed.clone(),
                banned: self.banned.clone(),
                generated: (self.fed.len() - self.request.prompt().len()) as u32,
                cached: 0,
                replaces,
            };
            let (down, skip) = self.service.open_pipeline(&mut self.seq, open).await?;
            self.downstream = Some(down);
            self.skip = skip;
        }
        Ok((self.fed.clone(), true))
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
            prompt_tokens: self.request.prompt().len() as u32,
            sequence: self.seq.id,
        }))
        .await?;
        let text = self.text.clone();
        let mut decoder = Decoder::new(&text.tokenizer, &self.request).map_err(engine_status)?;
        let mut first_token_at = None;
        // A chat's reasoning, answer and calls are told apart in the
        // model's format; the text resumed tokens released (given, or held,
        // before) goes through the reader first.
        let mut reader = AnswerReader::new(&text, self.request.prompt(), self.chat, self.tools);
        reader.push(decoder.replayed()).map_err(engine_status)?;
        let opened = reader.opened_reasoning();
        // A reasoning budget: once spent, the model is held, token by token,
        // to the text that closes the reasoning. (An answer under a grammar
        // is held to the grammar instead.)
        let mut budget = self
            .thinking_budget
            .filter(|_| !self.request.is_constrained());
        let close = match budget {
            Some(_) => text
                .tokenizer
                .encode(&reader.reasoning_close(), false)
                .map_err(engine_status)?,
            None => Vec::new(),
        };
        let mut forced = std::collections::VecDeque::new();
        let mut inside = opened;
        while let Some(input) = decoder.next_input() {
            let allowed = match forced.pop_front() {
                Some(t) => Some(TokenMask::of(&[t])),
                None => decoder.allowed().map_err(engine_status)?,
            };
            let (token, logprobs) = self.step(input, allowed).await?;
            first_token_at.get_or_insert_with(Instant::now);
            self.metrics.generated_tokens.inc();
            let logprobs: Vec<dp::TokenLogprobs> = logprobs
                .map(|l| wire::token_logprobs(&text.tokenizer, &l))
                .into_iter()
                .collect();
            let piece = decoder.accept(token).map_err(engine_status)?;
            let split = reader.push(&piece.text).map_err(engine_status)?;
            // A token counts against the budget when it is written inside
            // the reasoning (the marker that opens it does not).
            let counts = std::mem::replace(&mut inside, split.thinking);
            if counts && let Some(left) = &mut budget {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    budget = None;
                    forced.extend(close.iter().copied());
                }
            }
            self.emit(delta(split, vec![token], logprobs)).await?;
        }
        let generated = decoder.generated();
        let (tail, finish) = decoder.finish().map_err(engine_status)?;
        let mut last = reader.push(&tail).map_err(engine_status)?;
        let Ending {
            split: held,
            called,
            cut,
        } = reader
            .finish(finish == FinishReason::Stop)
            .map_err(engine_status)?;
        last.reasoning.push_str(&held.reasoning);
        last.text.push_str(&held.text);
        last.tool_calls.extend(held.tool_calls);
        if !last.text.is_empty() || !last.tool_calls.is_empty() || !last.reasoning.is_empty() {
            self.emit(delta(last, Vec::new(), Vec::new())).await?;
        }
        let done = Instant::now();
        let first_token_at = first_token_at.unwrap_or(done);
        let reason = match finish {
            // A call cut short by the limit was dropped: the answer is cut.
            FinishReason::Length if cut => dp::FinishReason::Length,
            _ if called => dp::FinishReason::ToolCalls,
            FinishReason::Stop => dp::FinishReason::Stop,
            FinishReason::Length => dp::FinishReason::Length,
        };
        self.emit(Event::Finished(dp::Finished {
            reason: reason as i32,
            prompt_tokens: self.request.prompt().len() as u32,
            completion_tokens: generated as u32,
            time_to_first_token_us: (first_token_at - self.received).as_micros() as u64,
            decode_us: (done - first_token_at).as_micros() as u64,
            cached_tokens: self.cached_tokens as u32,
        }))
        .await?;
        Ok(())
    }
}

/// How `tokens` of a sequence count in the budget that is `full`, when
/// that is not their number (sliding-window layers), for a refusal.
fn counted(full: &Account, tokens: u64) -> String {
    match full.units {
        units if units == tokens => String::new(),
        units => format!(
            ", counted as {units} since its sliding-window layers hold only its last tokens"
        ),
    }
}

impl Service {
    /// Opens `seq` down the pipeline for the tokens `open.prompt`, after
    /// starting it from the head's prefix cache: the later stages then take
    /// the same tokens from theirs (`Open.cached`), and all run only the
    /// rest. A later stage that holds fewer says how many: the head lets the
    /// sequence go and asks again, a new one started from that many (at most
    /// `RETAKES` times; then, or when its own cache no longer holds them,
    /// the prompt runs whole). When one holds none (or does not say), the
    /// whole prompt runs in a new sequence, and the head stops looking in
    /// its cache for a while. Returns the stream and the tokens taken.
    async fn open_pipeline(
        &self,
        seq: &mut Sequence,
        mut open: dp::Open,
    ) -> Result<(Downstream, usize), Status> {
        // Asked on the stage's thread (a step's wait when it is busy), so
        // only when there is a cache to look in and the later stages held
        // what it gave lately.
        let stats = seq.stage.worker.stats.clone();
        let looked = stats.seeds();
        let prompt = open.prompt.len();
        // Counted once per prompt, with what the sequence that runs took.
        let count = |held: usize| {
            if looked {
                stats.count_look(prompt, held);
            }
        };
        let mut held = match looked {
            true => seq.stage.worker.seed(seq.id, open.prompt.clone()).await,
            false => 0,
        };
        let mut asked = 0;
        while held > 0 {
            open.cached = held as u32;
            let e = match self.open_next(&seq.stage, open.clone()).await {
                Ok(down) => {
                    count(held);
                    return Ok((down, held));
                }
                Err(e) if e.code() == tonic::Code::Aborted => e,
                Err(e) => return Err(e),
            };
            asked += 1;
            let fewer = e
                .metadata()
                .get(dp::CACHED_HEADER)
                .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
                .filter(|&n| n < held)
                .unwrap_or(0);
            let again = fewer > 0 && asked <= RETAKES;
            tracing::debug!(
                shard = %seq.stage.name,
                error = e.message(),
                "a later stage lacks some of the cached prefix"
            );
            // The seeded sequence goes when dropped.
            *seq = Sequence {
                stage: seq.stage.clone(),
                id: rand::random(),
            };
            open.sequence = seq.id;
            held = match (again, fewer) {
                (true, n) => {
                    seq.stage
                        .worker
                        .seed(seq.id, open.prompt[..=n].to_vec())
                        .await
                }
                // Asked enough: this prompt runs whole, the next look again.
                (false, 1..) => 0,
                (false, 0) => {
                    stats.pause_seeding(SEEDING_PAUSE);
                    0
                }
            };
            // Counted once the head knows whether it asks again.
            let [asked_again, ran_whole] = crate::metrics::RETAKE_OUTCOMES;
            self.metrics
                .prefix_misses_downstream
                .with_label_values(&[
                    seq.stage.name.as_str(),
                    if held > 0 { asked_again } else { ran_whole },
                ])
                .inc();
        }
        open.cached = 0;
        let down = self.open_next(&seq.stage, open).await?;
        count(0);
        Ok((down, 0))
    }

    /// Who holds the budget that is `full`, for a refusal: a later stage's
    /// machine, or the head's shard.
    fn holder(&self, stage: &ServedStage, full: &Account) -> String {
        match &full.later {
            Some(shard) => format!("stage {shard}'s machine"),
            None => format!(
                "shard {} on node {} ({} sequences of {})",
                stage.name,
                self.node,
                stage.spec.kv_cache.concurrent_sequences,
                stage.spec.kv_cache.context_length
            ),
        }
    }
}

/// A piece of the answer as the client gets it.
fn delta(
    split: Split,
    tokens: Vec<u32>,
    logprobs: Vec<dp::TokenLogprobs>,
) -> dp::generate_response::Event {
    dp::generate_response::Event::Delta(dp::Delta {
        text: split.text,
        tokens,
        tool_calls: split.tool_calls.into_iter().map(wire::tool_call).collect(),
        logprobs,
        reasoning: split.reasoning,
    })
}
