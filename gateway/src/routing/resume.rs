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
//!                                 (at once when every instance ran it twice)
//! ```

use std::collections::VecDeque;

use kube::runtime::reflector::ObjectRef;
use shardplane_dataplane as dp;

use super::{Attempt, BusyWait, Instance, Opened, Outstanding, Router};
use crate::protocol::{ApiError, Event, Finish, Prompt};

/// How often an answer waiting for an instance to resume on looks again.
const HEAL_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Runs of one answer an instance takes at most (its first and one after
/// it came back): an answer that itself breaks its stage does not keep the
/// deployment's only instance failing.
const RUNS_PER_INSTANCE: usize = 2;

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
    /// Instances (key and incarnation) this answer broke off on, or failed
    /// to start on, while they are still ready: not tried again until they
    /// changed or left the ready instances and came back.
    tried: Vec<(String, u64)>,
    /// The instance (key and incarnation) the answer runs on now.
    running: Option<(String, u64)>,
    /// The instances (indexes) this answer ran on, once per run.
    ran: Vec<u32>,
    /// Until when a broken-off answer waits for an instance (set at the
    /// first break the cluster may heal; one wait per answer).
    heal_by: Option<tokio::time::Instant>,
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
            tried: Vec::new(),
            running: Some((inst.key.clone(), inst.incarnation)),
            ran: vec![inst.index],
            heal_by: None,
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
                        self.resume("the instance ended the answer early".into(), true)
                            .await?;
                        continue;
                    }
                    Err(s) => {
                        // A lost node or stage may come back; an error about
                        // the answer itself (its KV outgrew the budget, say)
                        // would come again: no waiting for that.
                        use dp::tonic::Code;
                        // (An HTTP/2 stream reset, as from an agent shutting
                        // down, comes as Internal.)
                        let heals = matches!(
                            s.code(),
                            Code::Unavailable
                                | Code::Unknown
                                | Code::Aborted
                                | Code::Cancelled
                                | Code::DeadlineExceeded
                        ) || (s.code() == Code::Internal
                            && s.message().starts_with("h2 protocol error"));
                        let why = format!("the instance failed mid-answer: {}", s.message());
                        self.resume(why, heals).await?;
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

    /// Goes on with the answer on another ready instance of the deployment
    /// (or on the one it broke off on, once that changed), after the tokens
    /// given so far; when the break is one the cluster may heal (`heals`)
    /// and none is ready, waits for one until the answer's heal wait is
    /// spent. An error when none can.
    async fn resume(&mut self, why: String, heals: bool) -> Result<(), ApiError> {
        let router = self.router.clone();
        router
            .metrics
            .upstream_errors
            .with_label_values(&[&self.model, "instance"])
            .inc();
        if self.tail_seen {
            return Err(ApiError::upstream(why));
        }
        // Always running here: a resume starts only from a break.
        let from = match self.running.take() {
            Some(broken) => {
                let key = broken.0.clone();
                self.tried.push(broken);
                key
            }
            None => String::new(),
        };
        let mut wait = BusyWait::new(router.busy_wait);
        if heals && self.heal_by.is_none() {
            self.heal_by = Some(tokio::time::Instant::now() + router.heal_wait);
        }
        let heal_by = self.heal_by.filter(|_| heals);
        let mut logged_wait = false;
        loop {
            // Read again on every try: a replica re-placed meanwhile counts,
            // and so does this answer's instance once it changed or left the
            // ready ones and came back (an agent restarted in place).
            let deployment = router
                .deployments
                .get(&ObjectRef::new(&self.deployment).within(&self.namespace));
            let replicas = deployment
                .as_ref()
                .map_or(0, |d| u32::try_from(d.spec.replicas).unwrap_or(0));
            let ready: Vec<Instance> = deployment.map(|d| router.instances(&d)).unwrap_or_default();
            self.tried
                .retain(|t| ready.iter().any(|i| (&i.key, i.incarnation) == (&t.0, t.1)));
            let candidates: Vec<Instance> = ready
                .into_iter()
                .filter(|i| !self.tried.contains(&(i.key.clone(), i.incarnation)))
                .filter(|i| self.runs(i.index) < RUNS_PER_INSTANCE)
                .collect();
            match self.resume_on(&router, candidates, &from, &why).await? {
                None => return Ok(()),
                Some((failures, busy)) => {
                    if busy && wait.pause(&router.metrics, &self.model).await {
                        continue;
                    }
                    let now = tokio::time::Instant::now();
                    // Every instance the deployment has took its runs: no
                    // re-placement can take the answer any more. (The
                    // operator numbers instances 0..replicas and removes
                    // those beyond.)
                    let spent =
                        replicas > 0 && (0..replicas).all(|i| self.runs(i) >= RUNS_PER_INSTANCE);
                    if !busy && !spent && heal_by.is_some_and(|by| now + HEAL_POLL < by) {
                        if !logged_wait {
                            logged_wait = true;
                            tracing::info!(model = %self.model, %from, %why, seconds = router.heal_wait.as_secs(), "an answer broke off and no instance is ready to resume it; waiting for one");
                        }
                        tokio::time::sleep(HEAL_POLL).await;
                        continue;
                    }
                    let waited = if logged_wait {
                        format!(" within {} s", router.heal_wait.as_secs())
                    } else {
                        String::new()
                    };
                    let failed = match failures.is_empty() {
                        true => String::new(),
                        false => format!(" ({})", failures.join("; ")),
                    };
                    return Err(ApiError::upstream(if spent && !busy {
                        format!(
                            "{why}; every instance of the deployment ({replicas}) has run it \
                             {RUNS_PER_INSTANCE} times; it is not tried again{failed}"
                        )
                    } else if failures.is_empty() {
                        format!("{why}; no instance became ready to resume it{waited}")
                    } else {
                        format!("{why}; resuming it failed{waited}{failed}")
                    }));
                }
            }
        }
    }

    /// Runs of this answer on the deployment's instance `index`, wherever
    /// its Shards were.
    fn runs(&self, index: u32) -> usize {
        self.ran.iter().filter(|&&r| r == index).count()
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
            let opened = router.open(&inst, &self.prompt, &self.tokens).await;
            let broke = matches!(opened, Err(Attempt::Broke(_)));
            match opened {
                Ok(opened) => {
                    self.ran.push(inst.index);
                    self.running = Some((inst.key.clone(), inst.incarnation));
                    let keys = super::affinity::Keys::of(&self.prompt);
                    router.holders_lock().served(&keys, &inst.holder());
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
                Err(Attempt::Next(failure) | Attempt::Broke(failure)) => {
                    // Started and broke off again: a run of the answer.
                    if broke {
                        self.ran.push(inst.index);
                    }
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
