//! An answer after its first token: events are read from the instance's
//! stream and the tokens given are kept, so that when the instance fails
//! mid-answer another ready instance of the same deployment goes on after
//! them (`GenerateRequest.resume`) and the client sees one answer. With no
//! other instance (one pipeline or tensor group holding a large model), the
//! answer waits for the operator to re-place what the instance lost and
//! resumes on the instance's next incarnation.
//!
//! ```text
//!  instance A: Delta Delta ✗ ─► resume(tokens so far) ─► instance B: Delta … Finished
//!                                 busy? wait and retry    (or A re-placed: A′)
//!                                 none? wait for one, up to the heal wait; then 502
//! ```

use std::collections::VecDeque;

use kube::runtime::reflector::ObjectRef;
use shardplane_dataplane as dp;

use super::{Attempt, BusyWait, Instance, Opened, Outstanding, Router};
use crate::protocol::{ApiError, Event, Finish, Prompt};

/// How often an answer waiting for an instance to resume on looks again.
const HEAL_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// An answer being streamed, and what it takes to resume it elsewhere.
pub(super) struct Answering {
    router: Router,
    model: String,
    namespace: String,
    deployment: String,
    prompt: Prompt,
    /// Tokens given so far.
    tokens: Vec<u32>,
    /// The text held back at the end has been given (only `Finished` is
    /// left, so there is nothing to resume).
    tail_seen: bool,
    /// Instances this answer ran on (key and incarnation).
    tried: Vec<(String, u64)>,
    pending: VecDeque<dp::generate_response::Event>,
    /// Events of a delta received and not yet given.
    queued: VecDeque<Event>,
    stream: dp::tonic::Streaming<dp::GenerateResponse>,
    _guard: Outstanding,
}

impl Answering {
    /// The answer `opened` on `inst`, an instance of `deployment`, to
    /// `prompt` for the model called `model`.
    pub(super) fn new(
        router: Router,
        model: &str,
        deployment: &str,
        inst: &Instance,
        prompt: &Prompt,
        opened: Opened,
    ) -> Self {
        Answering {
            router,
            model: model.to_string(),
            namespace: inst.namespace.clone(),
            deployment: deployment.to_string(),
            prompt: prompt.clone(),
            tokens: Vec::new(),
            tail_seen: false,
            tried: vec![(inst.key.clone(), inst.incarnation)],
            pending: opened.first.into(),
            queued: VecDeque::new(),
            stream: opened.stream,
            _guard: opened.guard,
        }
    }

    /// The next event: text, or the end.
    pub(super) async fn next(&mut self) -> Result<Event, ApiError> {
        use dp::generate_response::Event as E;
        if let Some(e) = self.queued.pop_front() {
            return Ok(e);
        }
        loop {
            let event = match self.pending.pop_front() {
                Some(e) => e,
                None => match self.stream.message().await {
                    Ok(Some(dp::GenerateResponse { event: Some(e) })) => e,
                    Ok(Some(_)) => continue,
                    Ok(None) => {
                        self.resume("the instance ended the answer early".into())
                            .await?;
                        continue;
                    }
                    Err(s) => {
                        self.resume(format!("the instance failed mid-answer: {}", s.message()))
                            .await?;
                        continue;
                    }
                },
            };
            match event {
                E::Started(_) => {}
                E::Delta(d) => {
                    self.tail_seen |= d.tokens.is_empty();
                    self.tokens.extend(&d.tokens);
                    // The tokens' log-probabilities, then the reasoning, the
                    // text and the calls, one event each (no empty text
                    // before a call).
                    if !d.logprobs.is_empty() {
                        self.queued.push_back(Event::Logprobs(d.logprobs));
                    }
                    if !d.reasoning.is_empty() {
                        self.queued.push_back(Event::Reasoning(d.reasoning));
                    }
                    if !d.text.is_empty() || d.tool_calls.is_empty() {
                        self.queued.push_back(Event::Text(d.text));
                    }
                    self.queued
                        .extend(d.tool_calls.into_iter().map(Event::ToolCall));
                    if let Some(e) = self.queued.pop_front() {
                        return Ok(e);
                    }
                }
                E::Finished(f) => return Ok(done(&f)),
            }
        }
    }

    /// Goes on with the answer on another ready instance of the deployment,
    /// after the tokens given so far; an error when none can.
    async fn resume(&mut self, why: String) -> Result<(), ApiError> {
        let router = self.router.clone();
        let errors = router
            .metrics
            .upstream_errors
            .with_label_values(&[&self.model, "instance"]);
        errors.inc();
        let from = self
            .tried
            .last()
            .map(|(k, _)| k.clone())
            .unwrap_or_default();
        if self.tail_seen {
            return Err(ApiError::upstream(why));
        }
        let mut wait = BusyWait::new(router.busy_wait);
        let healed_by = tokio::time::Instant::now() + router.heal_wait;
        let mut waited = false;
        loop {
            // Read again on every try: a replica re-placed meanwhile counts,
            // and so does this answer's instance once it was re-placed.
            let deployment = router
                .deployments
                .get(&ObjectRef::new(&self.deployment).within(&self.namespace));
            let candidates: Vec<Instance> = deployment
                .map(|d| router.instances(&d))
                .unwrap_or_default()
                .into_iter()
                .filter(|i| !self.tried.contains(&(i.key.clone(), i.incarnation)))
                .collect();
            match self.resume_on(&router, candidates, &from, &why).await? {
                None => return Ok(()),
                Some((failures, busy)) => {
                    if busy && wait.pause(&router.metrics, &self.model).await {
                        continue;
                    }
                    if !busy && tokio::time::Instant::now() + HEAL_POLL < healed_by {
                        if !waited {
                            waited = true;
                            tracing::info!(model = %self.model, %from, %why, seconds = router.heal_wait.as_secs(), "an answer broke off and no instance is ready to resume it; waiting for one");
                        }
                        tokio::time::sleep(HEAL_POLL).await;
                        continue;
                    }
                    let waited = if waited {
                        format!(" within {} s", router.heal_wait.as_secs())
                    } else {
                        String::new()
                    };
                    return Err(ApiError::upstream(if failures.is_empty() {
                        format!("{why}; no instance became ready to resume it{waited}")
                    } else {
                        format!(
                            "{why}; resuming it failed{waited} ({})",
                            failures.join("; ")
                        )
                    }));
                }
            }
        }
    }

    /// One try of `candidates` in turn: `None` once one took the answer
    /// over, else why each failed and whether any was only busy (a busy
    /// instance stays a candidate for the next try).
    async fn resume_on(
        &mut self,
        router: &Router,
        candidates: Vec<Instance>,
        from: &str,
        why: &str,
    ) -> Result<Option<(Vec<String>, bool)>, ApiError> {
        let errors = router
            .metrics
            .upstream_errors
            .with_label_values(&[&self.model, "instance"]);
        let mut failures = Vec::new();
        let mut busy = false;
        for inst in candidates {
            match router.open(&inst, &self.prompt, &self.tokens).await {
                Ok(opened) => {
                    self.tried.push((inst.key.clone(), inst.incarnation));
                    if inst.key == from {
                        tracing::warn!(model = %self.model, instance = %from, tokens = self.tokens.len(), %why, "an answer broke off; resumed on its instance, re-placed");
                    } else {
                        tracing::warn!(model = %self.model, %from, to = %inst.key, tokens = self.tokens.len(), %why, "an answer broke off; resumed on another instance");
                    }
                    router
                        .metrics
                        .resumed_answers
                        .with_label_values(&[&self.model])
                        .inc();
                    self.pending = opened.first.into();
                    self.stream = opened.stream;
                    self._guard = opened.guard;
                    return Ok(None);
                }
                Err(Attempt::Fail(e)) => {
                    return Err(ApiError::upstream(format!(
                        "{why}; {} refused to resume it: {}",
                        inst.key, e.message
                    )));
                }
                Err(Attempt::Busy(failure)) => {
                    busy = true;
                    failures.push(format!("{}: {failure}", inst.key));
                }
                Err(Attempt::Next(failure)) => {
                    self.tried.push((inst.key.clone(), inst.incarnation));
                    errors.inc();
                    failures.push(format!("{}: {failure}", inst.key));
                }
            }
        }
        Ok(Some((failures, busy)))
    }
}

fn done(f: &dp::Finished) -> Event {
    Event::Done {
        finish: match dp::FinishReason::try_from(f.reason) {
            Ok(dp::FinishReason::Length) => Finish::Length,
            Ok(dp::FinishReason::ToolCalls) => Finish::ToolCalls,
            _ => Finish::Stop,
        },
        prompt_tokens: f.prompt_tokens,
        completion_tokens: f.completion_tokens,
        cached_tokens: f.cached_tokens,
    }
}
